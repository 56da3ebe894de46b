"""Grouping a write's tokens by the scale block they land in (per-block quantization).

A block-quantized cache shares one scale per (scale block, head), so a writer must see
all of a block's new tokens together, as one segment, with the last of a duplicated slot
kept. Two ways to cut segments, picked statically by :func:`group_by_scale_block`:

- :func:`index_by_slot` (no sort, any token order): a table over the cache's slots holds
  each slot's last writer, so a segment is a scale block's range of the table (holes where
  nothing is written). Its cost grows with the cache's capacity: used when the table has
  at most ``TABLE_SLOTS_PER_TOKEN`` slots per token.
- :func:`sort_by_scale_block` sorts the valid tokens by slot (a stable sort: among tokens
  with the same slot the last one wins and the others are dropped) and cuts the sorted
  list at scale-block boundaries. Its cost grows with the number of tokens only: a small
  write into a huge cache (a decode step) sorts.

Neither needs a device-side check or a ``lax.cond`` (XLA:GPU reads a conditional's
predicate on the host: 24 us of a 39 us grouping on an H100, 2026-11-27). jit-able, static
sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jkv import pages as pages_lib, pytree

# index_by_slot's table costs one int32 per slot of the cache: used while that is at most
# this many slots per written token (1 KiB a token, less than the token's K/V in any
# cache), so a small write into a huge cache never pays for the cache's size.
TABLE_SLOTS_PER_TOKEN = 256


@pytree.dataclass
class Segments:
  """A write's tokens cut into segments: one per scale block written (and, in
  :func:`index_by_slot`'s uncompacted form, an empty one per scale block not written).

  Segment s < num_segments covers positions ``start[s] .. start[s] + length[s] - 1`` of
  ``token`` / ``slot``, all in one scale block, each scale block written in one segment;
  within a segment, slots strictly increase. A position holds no token (``token`` -1:
  padding, a dropped duplicate, a hole of :func:`index_by_slot`) or one. A segment may be
  empty (``length`` 0: :func:`index_by_slot`'s segment of a scale block nothing writes,
  where every scale block has one): kernels skip it.

  token: int32 [N]; ``token[i]`` is the input row at position i, -1 where none.
  slot: int32 [N]; its slot (where ``token[i] >= 0``).
  start, length: int32 [S]; 0 past num_segments.
  full: int32 [S]; 1 where the segment writes its whole scale block (a token for every slot
  of it: no hole), else 0 (0 past num_segments). Kernels branch on it instead of reducing
  a segment's tokens.
  num_segments: int32 scalar.
  slot_is_position: static; ``slot[i] == i`` (:func:`index_by_slot`): a kernel need not
  load the slots, and a segment's slots are consecutive.
  """
  token: jax.Array
  slot: jax.Array
  start: jax.Array
  length: jax.Array
  full: jax.Array
  num_segments: jax.Array
  slot_is_position: bool = pytree.static(default=False)


def group_by_scale_block(slot_mapping, capacity: int, tokens_per_scale_block: int) -> Segments:
  """slot_mapping int [T] (< 0 or >= capacity: dropped) -> :class:`Segments`:
  :func:`index_by_slot` when its table is small enough for T tokens, else
  :func:`sort_by_scale_block`."""
  num_tokens = slot_mapping.shape[0]
  if num_tokens and capacity <= TABLE_SLOTS_PER_TOKEN * num_tokens:
    return index_by_slot(slot_mapping, capacity, tokens_per_scale_block)
  return sort_by_scale_block(slot_mapping, capacity, tokens_per_scale_block)


def index_by_slot(slot_mapping, capacity: int, tokens_per_scale_block: int) -> Segments:
  """:class:`Segments` whose positions are the cache's slots (N = capacity): ``token[i]``
  is the last input row writing slot i (-1: none), ``slot[i] = i``; a segment is a whole
  scale block (from ``start[s]``, ``tokens_per_scale_block`` long). A block is written
  when its range of the table holds a writer (a reduction over the table).

  With at most as many scale blocks as tokens, segment s is scale block s, empty (length 0)
  where nothing writes it (S = num_segments = capacity / unit): the grouping is the
  table's fill, its scatter and one reduction (H100, 32K tokens into 4096 scale blocks:
  4.0 us, 9.6 with the compaction below; 2026-12-07). With more (a small write into a big
  cache), the written blocks are compacted, in slot order (S = T): a prefix sum over the
  blocks and scatters by it, so that kernels loop over the written blocks only."""
  slot_mapping = jnp.asarray(slot_mapping).astype(jnp.int32)
  num_tokens = slot_mapping.shape[0]
  unit_size = tokens_per_scale_block
  num_units = capacity // unit_size
  position = jnp.arange(num_tokens, dtype=jnp.int32)
  valid = (slot_mapping >= 0) & (slot_mapping < capacity)
  token = jnp.full((capacity,), -1, jnp.int32).at[
      jnp.where(valid, slot_mapping, capacity)].max(position, mode="drop")
  # A unit's first slot, length (unit_size if written, else 0) and full flag as reductions
  # over its slots: XLA computes the three in one launch, with nothing after it.
  slot = jnp.arange(capacity, dtype=jnp.int32)
  held = (token >= 0).astype(jnp.int32).reshape(num_units, unit_size)
  # (A select on the table, always true, puts the starts in the table's reduction: an iota
  # reduced alone is a launch of its own.)
  unit_starts = jnp.min(jnp.where(token >= -1, slot, capacity).reshape(num_units, unit_size),
                        axis=1)
  length = jnp.max(held * unit_size, axis=1)
  full = jnp.min(held, axis=1)
  written = length > 0
  if num_units <= num_tokens:
    return Segments(token=token, slot=slot, start=unit_starts, length=length, full=full,
                    num_segments=jnp.asarray(num_units, jnp.int32), slot_is_position=True)
  num_segments = num_tokens
  index = jnp.where(written, pages_lib.inclusive_sum(written) - 1, num_segments)
  start = jnp.zeros((num_segments,), jnp.int32).at[index].set(unit_starts, mode="drop")
  full = jnp.zeros((num_segments,), jnp.int32).at[index].set(full, mode="drop")
  count = jnp.sum(written, dtype=jnp.int32)
  length = jnp.where(jnp.arange(num_segments) < count, unit_size, 0).astype(jnp.int32)
  return Segments(token=token, slot=slot, start=start, length=length, full=full,
                  num_segments=count, slot_is_position=True)


def sort_by_scale_block(slot_mapping, capacity: int, tokens_per_scale_block: int) -> Segments:
  """slot_mapping int [T] (< 0 or >= capacity: dropped) -> :class:`Segments` in slot
  order: ``token[i]`` (i < num_kept) is the input row of the i-th kept token (the last of
  a duplicated slot), -1 past num_kept."""
  slot_mapping = jnp.asarray(slot_mapping).astype(jnp.int32)
  num_tokens = slot_mapping.shape[0]
  position = jnp.arange(num_tokens, dtype=jnp.int32)
  valid = (slot_mapping >= 0) & (slot_mapping < capacity)
  key = jnp.where(valid, slot_mapping, capacity)
  order, sorted_key = _stable_sort_by(key, capacity)
  following = jnp.concatenate([sorted_key[1:], jnp.full((1,), capacity + 1, jnp.int32)])
  kept = (sorted_key < capacity) & (sorted_key != following)
  num_kept = jnp.sum(kept, dtype=jnp.int32)
  dest = jnp.where(kept, pages_lib.inclusive_sum(kept) - 1, num_tokens)
  token = jnp.full((num_tokens,), -1, jnp.int32).at[dest].set(order, mode="drop")
  slot = jnp.full((num_tokens,), -1, jnp.int32).at[dest].set(sorted_key, mode="drop")
  unit = jnp.where(slot >= 0, slot // tokens_per_scale_block, -1)
  previous = jnp.concatenate([jnp.full((1,), -1, jnp.int32), unit[:-1]])
  is_start = (position < num_kept) & (unit != previous)
  num_segments = jnp.sum(is_start, dtype=jnp.int32)
  start = jnp.full((num_tokens,), num_tokens, jnp.int32).at[
      jnp.where(is_start, pages_lib.inclusive_sum(is_start) - 1, num_tokens)].set(
          position, mode="drop")
  following_start = jnp.concatenate([start[1:], jnp.full((1,), num_tokens, jnp.int32)])
  end = jnp.where(position < num_segments - 1, following_start, num_kept)
  length = jnp.where(position < num_segments, end - start, 0)
  start = jnp.where(position < num_segments, start, 0)
  # A segment's slots are distinct and in one scale block: as many as the block's, it is full.
  full = (length == tokens_per_scale_block).astype(jnp.int32)
  return Segments(token=token, slot=slot, start=start, length=length, full=full,
                  num_segments=num_segments)


def _stable_sort_by(key, max_key: int):
  """(order, key[order]) for int32 key [T] in [0, max_key], equal keys in input order.

  When ``(max_key + 1) * T`` fits in 32 bits, one sort of ``key * T + position`` (uint32)
  does it: a keys-only sort, faster on a GPU than argsort's (key, index) pairs (H100, 32K
  tokens: the whole grouping 74 us, 86 with argsort, 90 with argsort and cumsums)."""
  num_tokens = key.shape[0]
  if (max_key + 1) * num_tokens > 1 << 32:
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    return order, key[order]
  position = jnp.arange(num_tokens, dtype=jnp.uint32)
  packed = jnp.sort(key.astype(jnp.uint32) * jnp.uint32(num_tokens) + position)
  return ((packed % jnp.uint32(num_tokens)).astype(jnp.int32),
          (packed // jnp.uint32(num_tokens)).astype(jnp.int32))
