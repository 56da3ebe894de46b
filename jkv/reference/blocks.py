"""Reference block copies: ``copy_blocks`` and ``swap_blocks`` (vLLM / AITER), as a gather
then a scatter.

``dst[d] = src[s]`` for every ``(s, d)`` pair of ``block_mapping`` [N, 2], over whole
blocks (the block axis of any layout and dtype). Every source is read before any
destination is written (vLLM leaves overlapping ``copy_blocks`` pairs undefined; jkv
defines them). Pairs with a negative entry are skipped (``PagePool.append`` marks "no
copy" with -1), as are pairs out of range (under jit; eager calls raise first); of pairs
with the same destination, the last one wins (vLLM's in-order ``swap_blocks``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device


def live_pairs(block_mapping, num_src_blocks: int, num_dst_blocks: int | None = None):
  """(src, dst) int32 [N]: dst = -1 for skipped or overridden pairs, src clipped in range.

  O(N + num_dst_blocks) (a winner table over the destination blocks, no N x N compare).
  """
  num_dst_blocks = num_src_blocks if num_dst_blocks is None else num_dst_blocks
  src, dst = block_mapping[:, 0].astype(jnp.int32), block_mapping[:, 1].astype(jnp.int32)
  ok = (src >= 0) & (dst >= 0) & (src < num_src_blocks) & (dst < num_dst_blocks)
  target = jnp.where(ok, dst, num_dst_blocks)
  pair = jnp.arange(src.shape[0], dtype=jnp.int32)
  winner = jnp.full((num_dst_blocks + 1,), -1, jnp.int32).at[target].max(pair)
  keep = ok & (winner[target] == pair)
  return jnp.where(ok, src, 0), jnp.where(keep, dst, -1)


def copy_blocks(caches, block_mapping, *, block_axis: int = 0):
  """caches: arrays sharing a block axis (``block_axis``) of one size. Returns them copied.

  Values, not bits: XLA:CPU's gather / scatter turns bfloat16 / float8_e5m2 NaNs into its
  canonical NaN (in untouched blocks too). Moving them as integers would keep the bits but
  costs a copy of the cache on CPU; the kernels move bits."""
  num_blocks = caches[0].shape[block_axis]
  src, dst = live_pairs(block_mapping, num_blocks)
  dst = jnp.where(dst >= 0, dst, num_blocks)
  lead = (slice(None),) * block_axis
  blocks = [c[lead + (src,)] for c in caches]          # every source read first
  return [c.at[lead + (dst,)].set(b, mode="drop") for c, b in zip(caches, blocks)]


def swap_blocks(src, dst, block_mapping, *, block_axis: int = 0):
  """``dst[d] = src[s]``; ``src`` and ``dst`` may live in device or ``pinned_host`` memory.

  The spec, not a fast path: host-side arrays are brought to the device whole, and the
  result goes back to ``dst``'s memory. Values, not bits (NaNs: see :func:`copy_blocks`).
  """
  num_dst = dst.shape[block_axis]
  s, d = live_pairs(block_mapping, src.shape[block_axis], num_dst)
  dst_space = jax.typeof(dst).memory_space
  on_device = [x if jax.typeof(x).memory_space == DEVICE else jax.device_put(x, DEVICE)
               for x in (src, dst)]
  lead = (slice(None),) * block_axis
  blocks = on_device[0][lead + (s,)]
  out = on_device[1].at[lead + (jnp.where(d >= 0, d, num_dst),)].set(blocks, mode="drop")
  return out if dst_space == DEVICE else jax.device_put(out, dst_space)
