"""Reference block copies: ``copy_blocks`` (vLLM / AITER) as a gather then a scatter.

``cache[dst] = cache[src]`` for every ``(src, dst)`` pair of ``block_mapping`` [N, 2], over
whole blocks (the leading block axis of any layout and dtype). Every source is read before
any destination is written (vLLM leaves overlapping pairs undefined; jkv defines them).
Pairs with a negative entry are skipped (``PagePool.append`` marks "no copy" with -1); of
pairs with the same destination, the last one wins.
"""

from __future__ import annotations

import jax.numpy as jnp


def live_pairs(block_mapping, num_blocks: int):
  """(src, dst) int32 [N] with dst = num_blocks (dropped) for skipped or overridden pairs."""
  src, dst = block_mapping[:, 0].astype(jnp.int32), block_mapping[:, 1].astype(jnp.int32)
  ok = (src >= 0) & (dst >= 0) & (src < num_blocks) & (dst < num_blocks)
  later = jnp.triu(dst[:, None] == dst[None, :], k=1) & ok[None, :]
  keep = ok & ~jnp.any(later, axis=1)
  return jnp.where(ok, src, 0), jnp.where(keep, dst, num_blocks)


def copy_blocks(caches, block_mapping, *, block_axis: int = 0):
  """caches: arrays sharing a block axis (``block_axis``) of one size. Returns them copied."""
  num_blocks = caches[0].shape[block_axis]
  src, dst = live_pairs(block_mapping, num_blocks)
  lead = (slice(None),) * block_axis
  blocks = [c[lead + (src,)] for c in caches]          # every source read first
  return [c.at[lead + (dst,)].set(b, mode="drop") for c, b in zip(caches, blocks)]
