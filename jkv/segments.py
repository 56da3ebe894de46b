"""Grouping a write's tokens by the scale block they land in (per-block quantization).

A block-quantized cache shares one scale per (scale block, head), so a writer must see
all of a block's new tokens together. :func:`group_by_scale_block` sorts the valid
tokens by slot (a stable sort: among tokens with the same slot the last one wins and the
others are dropped) and cuts the sorted list into segments, one per scale block
touched. All arrays have static size ``T`` (the number of tokens), jit-able.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jkv import pages as pages_lib


@dataclasses.dataclass(frozen=True)
class Segments:
  """Tokens in slot order, deduplicated, cut by scale block.

  token: int32 [T]; ``token[i]`` (i < num_kept) is the input row of the i-th kept token
    in slot order; -1 past num_kept.
  slot: int32 [T]; its slot (strictly increasing), -1 past num_kept.
  start, length: int32 [T]; segment s < num_segments covers kept positions
    ``start[s] .. start[s] + length[s] - 1`` (all in one scale block); length 0 past.
  segment: int32 [T]; the segment of kept position i (T - 1 past num_kept).
  num_segments: int32 scalar.
  """
  token: jax.Array
  slot: jax.Array
  start: jax.Array
  length: jax.Array
  segment: jax.Array
  num_segments: jax.Array


def group_by_scale_block(slot_mapping, capacity: int, tokens_per_scale_block: int) -> Segments:
  """slot_mapping int [T] (< 0 or >= capacity: dropped) -> :class:`Segments`."""
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
  segment = pages_lib.inclusive_sum(is_start) - 1
  start = jnp.full((num_tokens,), num_tokens, jnp.int32).at[
      jnp.where(is_start, segment, num_tokens)].set(position, mode="drop")
  following_start = jnp.concatenate([start[1:], jnp.full((1,), num_tokens, jnp.int32)])
  end = jnp.where(position < num_segments - 1, following_start, num_kept)
  length = jnp.where(position < num_segments, end - start, 0)
  start = jnp.where(position < num_segments, start, 0)
  segment = jnp.where(position < num_kept, segment, num_tokens - 1)
  return Segments(token=token, slot=slot, start=start, length=length, segment=segment,
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
