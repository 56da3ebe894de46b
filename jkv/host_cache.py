"""Host offload tier: a :class:`HostKVCache` keeps whole sequences' blocks in ``pinned_host``
memory while their device pages go back to the :class:`~jkv.PagePool`.

The host tier is managed eagerly from Python, like vLLM's CPU offloading manager: the
host page table and free list are numpy; the block moves are :func:`jkv.swap_blocks`
(zero-copy kernels on the GPU). ``offload`` copies a sequence's pages to free host blocks
and frees its device pages; ``reload`` allocates fresh device pages for it through
``PagePool.append`` and copies the blocks back. Shared pages (forks) are copied per
sequence: each sequence comes back with pages of its own.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jkv import errors
from jkv.cache import PagedKVCache
from jkv.ops.blocks import swap_blocks

_HOST = "pinned_host"


@dataclasses.dataclass(frozen=True)
class HostKVCache:
  """Blocks of a :class:`PagedKVCache` in ``pinned_host`` memory, held per sequence slot.

  Fields:
    cache: a PagedKVCache (same layout, quantization and layers as the device cache) whose
      block arrays live in ``pinned_host`` memory; ``num_blocks`` host blocks.
    block_table: int32 numpy [max_seqs, max_pages_per_seq]; host blocks of each offloaded
      sequence slot, in order (-1 past its last block).
    seq_lens: int32 numpy [max_seqs]; tokens held on the host per slot (0: none).
    free: bool numpy [num_blocks]; host blocks not in use.
  Eager only (numpy bookkeeping); every method returns a new HostKVCache.
  """
  cache: PagedKVCache
  block_table: np.ndarray
  seq_lens: np.ndarray
  free: np.ndarray

  @classmethod
  def create(cls, like: PagedKVCache, num_blocks: int, max_seqs: int,
             max_pages_per_seq: int) -> "HostKVCache":
    """An empty host tier for caches shaped like ``like`` (any layout / quantization whose
    blocks can move alone), with ``num_blocks`` host blocks."""
    if not isinstance(like, PagedKVCache):
      raise TypeError(f"like must be a PagedKVCache, got {type(like).__name__}")
    for name, size in (("num_blocks", num_blocks), ("max_seqs", max_seqs),
                       ("max_pages_per_seq", max_pages_per_seq)):
      errors.check_size(name, size)
    names = like.block_array_names()
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=_HOST)
    axis = like.block_axis
    arrays = {n: jax.device_put(jnp.zeros(_with_blocks(getattr(like, n).shape, axis, num_blocks),
                                          getattr(like, n).dtype), host) for n in names}
    return cls(cache=like.replace(**arrays),
               block_table=np.full((max_seqs, max_pages_per_seq), -1, np.int32),
               seq_lens=np.zeros((max_seqs,), np.int32),
               free=np.ones((num_blocks,), bool))

  @property
  def num_free_blocks(self) -> int:
    return int(self.free.sum())

  def _check_seqs(self, seq_ids):
    ids = np.asarray(seq_ids).reshape(-1)
    if not np.issubdtype(ids.dtype, np.integer):
      raise TypeError(f"seq_ids must be integers, got dtype {ids.dtype}")
    bad = np.nonzero((ids < 0) | (ids >= self.seq_lens.shape[0]))[0]
    if bad.size:
      raise ValueError(f"seq_ids[{bad[0]}] = {ids[bad[0]]} is out of range: the host tier has "
                       f"{self.seq_lens.shape[0]} sequence slots")
    if np.unique(ids).size != ids.size:
      raise ValueError("seq_ids has duplicate sequence ids")
    return ids

  def offload(self, pool, cache: PagedKVCache, seq_ids, *, backend: str = "auto"):
    """Moves sequences ``seq_ids`` to the host: their blocks are copied to free host
    blocks and their device pages are freed in ``pool`` (``cache`` is unchanged: the
    freed pages keep their data until reused).

    Returns ``(pool, host)``; this HostKVCache is consumed (its host arrays are donated
    to the returned one). Raises ValueError when the host tier lacks blocks or a slot is
    empty or already holds host blocks.
    """
    require_eager(pool, cache)
    ids = self._check_seqs(seq_ids)
    lens = np.asarray(pool.seq_lens)[ids]
    taken = ids[self.seq_lens[ids] > 0]
    if taken.size:
      raise ValueError(f"sequence {taken[0]} already has blocks on the host")
    empty = ids[lens == 0]
    if empty.size:
      raise ValueError(f"sequence {empty[0]} holds no tokens in the page pool")
    pages = [np.asarray(pool.block_table)[s, :n] for s, n in zip(ids, -(-lens // pool.page_size))]
    if self.block_table.shape[1] < max((p.size for p in pages), default=0):
      raise ValueError(f"a sequence has more pages than the host table's "
                       f"{self.block_table.shape[1]} columns")
    needed = sum(p.size for p in pages)
    if needed > self.num_free_blocks:
      raise ValueError(f"out of host blocks: need {needed}, {self.num_free_blocks} free")
    host_blocks = np.nonzero(self.free)[0][:needed].astype(np.int32)
    pairs = np.stack([np.concatenate(pages or [np.zeros(0, np.int32)]), host_blocks], 1)
    host_cache = copy_blocks_between(cache, self.cache, pairs, backend)
    table, seq_lens, free = self.block_table.copy(), self.seq_lens.copy(), self.free.copy()
    start = 0
    for s, n, p in zip(ids, lens, pages):
      table[s, :p.size] = host_blocks[start:start + p.size]
      seq_lens[s] = n
      start += p.size
    free[host_blocks] = False
    return (pool.free(jnp.asarray(ids, jnp.int32)),
            HostKVCache(cache=host_cache, block_table=table, seq_lens=seq_lens, free=free))

  def reload(self, pool, cache: PagedKVCache, seq_ids, *, backend: str = "auto"):
    """Brings sequences ``seq_ids`` back: ``pool.append`` gives each (an empty slot) fresh
    device pages for its host length, the blocks are copied into them and the host
    blocks are freed. Returns ``(pool, cache, host)``; ``cache`` is donated when called
    eagerly (see :func:`jkv.swap_blocks`)."""
    require_eager(pool, cache)
    ids = self._check_seqs(seq_ids)
    lens = self.seq_lens[ids]
    missing = ids[lens == 0]
    if missing.size:
      raise ValueError(f"sequence {missing[0]} has no blocks on the host")
    busy = ids[np.asarray(pool.seq_lens)[ids] > 0]
    if busy.size:
      raise ValueError(f"sequence slot {busy[0]} is in use in the page pool")
    pool, _ = pool.append(jnp.asarray(ids, jnp.int32), jnp.asarray(lens, jnp.int32))
    counts = -(-lens // pool.page_size)
    device_table = np.asarray(pool.block_table)
    host_blocks = np.concatenate([self.block_table[s, :n] for s, n in zip(ids, counts)])
    device_pages = np.concatenate([device_table[s, :n] for s, n in zip(ids, counts)])
    cache = copy_blocks_between(self.cache, cache, np.stack([host_blocks, device_pages], 1), backend)
    table, seq_lens, free = self.block_table.copy(), self.seq_lens.copy(), self.free.copy()
    table[ids] = -1
    seq_lens[ids] = 0
    free[host_blocks] = True
    return pool, cache, HostKVCache(cache=self.cache, block_table=table, seq_lens=seq_lens,
                                    free=free)


def copy_blocks_between(src: PagedKVCache, dst: PagedKVCache, pairs, backend) -> PagedKVCache:
  """``dst`` with every block array's blocks copied from ``src`` for (src block, dst block)
  pairs int [N, 2] (one :func:`jkv.swap_blocks` per block array; ``dst`` is donated)."""
  _check_like(src, dst)
  moved = {n: swap_blocks(getattr(src, n), getattr(dst, n), pairs, block_axis=dst.block_axis,
                          backend=backend) for n in dst.block_array_names()}
  return dst.replace(**moved)


def _with_blocks(shape, axis: int, num_blocks: int) -> tuple[int, ...]:
  """``shape`` with ``num_blocks`` on the block axis."""
  return tuple(shape[:axis]) + (num_blocks,) + tuple(shape[axis + 1:])


def _check_like(src: PagedKVCache, dst: PagedKVCache) -> None:
  _, static = jax.tree_util.tree_flatten(src)
  _, static_dst = jax.tree_util.tree_flatten(dst)
  if static != static_dst:
    raise ValueError("the host tier and the device cache differ in layout, dtype or "
                     "quantization")
  for name in dst.block_array_names():
    a, b = getattr(src, name), getattr(dst, name)
    if _with_blocks(a.shape, dst.block_axis, 0) != _with_blocks(b.shape, dst.block_axis, 0):
      raise ValueError(f"{name}: host and device block shapes differ: {a.shape} vs {b.shape}")


def require_eager(pool, cache, owner: str = "HostKVCache") -> None:
  """TypeError unless ``pool`` and ``cache`` are concrete (the host tiers run eagerly)."""
  if not all(errors.is_concrete(x) for x in jax.tree.leaves((pool, cache))):
    raise TypeError(f"{owner} is managed eagerly (numpy bookkeeping): call it outside jit")
