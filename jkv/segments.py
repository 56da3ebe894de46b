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
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  sorted_key = key[order]
  following = jnp.concatenate([sorted_key[1:], jnp.full((1,), capacity + 1, jnp.int32)])
  kept = (sorted_key < capacity) & (sorted_key != following)
  num_kept = jnp.sum(kept, dtype=jnp.int32)
  dest = jnp.where(kept, jnp.cumsum(kept, dtype=jnp.int32) - 1, num_tokens)
  token = jnp.full((num_tokens,), -1, jnp.int32).at[dest].set(order, mode="drop")
  slot = jnp.full((num_tokens,), -1, jnp.int32).at[dest].set(sorted_key, mode="drop")
  unit = jnp.where(slot >= 0, slot // tokens_per_scale_block, -1)
  previous = jnp.concatenate([jnp.full((1,), -1, jnp.int32), unit[:-1]])
  is_start = (position < num_kept) & (unit != previous)
  num_segments = jnp.sum(is_start, dtype=jnp.int32)
  segment = jnp.cumsum(is_start, dtype=jnp.int32) - 1
  start = jnp.full((num_tokens,), num_tokens, jnp.int32).at[
      jnp.where(is_start, segment, num_tokens)].set(position, mode="drop")
  following_start = jnp.concatenate([start[1:], jnp.full((1,), num_tokens, jnp.int32)])
  end = jnp.where(position < num_segments - 1, following_start, num_kept)
  length = jnp.where(position < num_segments, end - start, 0)
  start = jnp.where(position < num_segments, start, 0)
  segment = jnp.where(position < num_kept, segment, num_tokens - 1)
  return Segments(token=token, slot=slot, start=start, length=length, segment=segment,
                  num_segments=num_segments)
