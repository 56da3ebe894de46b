"""Page tables: vLLM block tables, FlashInfer / SGLang indptr tables, slot mappings.

Everything here is jit-able (static output sizes). Two forms of the same table:

* vLLM: ``block_table`` int32 [batch, max_blocks_per_seq] + ``seq_lens`` [batch].
* FlashInfer: ``kv_indptr`` [batch + 1], ``kv_indices`` [num_pages_used],
  ``kv_last_page_len`` [batch]; request b owns pages
  ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` and has
  ``(num_pages - 1) * page_size + last_page_len`` tokens (0 with no pages).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def slot_mapping(block_table, seq_ids, positions, block_size: int):
  """Slot of each token: ``block_table[seq, pos // bs] * bs + pos % bs``.

  Args:
    block_table: int32 [batch, max_blocks_per_seq].
    seq_ids: int [T] row of block_table per token; < 0 marks padding.
    positions: int [T] absolute position of each token in its sequence.
  Returns:
    int32 [T]; -1 for padding tokens and for positions past the table's width.
  """
  block_table = jnp.asarray(block_table, jnp.int32)
  seq_ids = jnp.asarray(seq_ids, jnp.int32)
  positions = jnp.asarray(positions, jnp.int32)
  max_blocks = block_table.shape[1]
  column = positions // block_size
  valid = (seq_ids >= 0) & (positions >= 0) & (column < max_blocks)
  block = block_table[jnp.where(valid, seq_ids, 0), jnp.where(valid, column, 0)]
  return jnp.where(valid, block * block_size + positions % block_size, -1).astype(jnp.int32)


def decode_slot_mapping(block_table, seq_lens, block_size: int):
  """Slots of one new token per sequence, at position ``seq_lens[b]`` (the next free one)."""
  seq_lens = jnp.asarray(seq_lens, jnp.int32)
  return slot_mapping(block_table, jnp.arange(seq_lens.shape[0], dtype=jnp.int32), seq_lens,
                      block_size)


def get_seq_lens(kv_indptr, kv_last_page_len, page_size: int):
  """FlashInfer ``get_seq_lens``: ``max(indptr[1:] - indptr[:-1] - 1, 0) * ps + last_page_len``."""
  kv_indptr = jnp.asarray(kv_indptr, jnp.int32)
  num_pages = kv_indptr[1:] - kv_indptr[:-1]
  return (jnp.maximum(num_pages - 1, 0) * page_size
          + jnp.asarray(kv_last_page_len, jnp.int32)).astype(jnp.int32)


def count_at_most(sorted_edges, values):
  """``searchsorted(sorted_edges, values, side="right")`` (int32) without a loop: one
  fused comparison when ``len(edges) x len(values)`` is small, a sort otherwise (the
  default binary search is a loop, ~10 us an iteration on a GPU)."""
  method = "compare_all" if sorted_edges.shape[0] * values.shape[0] <= 1 << 22 else "sort"
  return jnp.searchsorted(sorted_edges, values, side="right", method=method).astype(jnp.int32)


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int):
  """FlashInfer ``get_batch_indices_positions``.

  Entry k of request b (``append_indptr[b] <= k < append_indptr[b+1]``) gets
  ``batch_indices = b`` and ``positions = seq_lens[b] - num_appended[b] + (k -
  append_indptr[b])``: the appended tokens are the tail of the sequence. Entries
  ``k >= append_indptr[-1]`` get batch index -1 and position 0.
  Returns (batch_indices, positions), int32 [nnz].
  """
  append_indptr = jnp.asarray(append_indptr, jnp.int32)
  seq_lens = jnp.asarray(seq_lens, jnp.int32)
  k = jnp.arange(nnz, dtype=jnp.int32)
  batch = count_at_most(append_indptr, k) - 1
  used = k < append_indptr[-1]
  b = jnp.clip(batch, 0, seq_lens.shape[0] - 1)
  appended = append_indptr[b + 1] - append_indptr[b]
  positions = seq_lens[b] - appended + (k - append_indptr[b])
  return jnp.where(used, b, -1), jnp.where(used, positions, 0)


def append_slot_mapping(batch_indices, positions, kv_indices, kv_indptr, page_size: int):
  """Slots for FlashInfer appends, and whether each used entry lies inside its request's pages.

  Returns (slots int32 [nnz] with -1 for unused or out-of-range entries,
  in_range bool [nnz], True for unused entries).
  """
  batch_indices = jnp.asarray(batch_indices, jnp.int32)
  positions = jnp.asarray(positions, jnp.int32)
  kv_indices = jnp.asarray(kv_indices, jnp.int32)
  kv_indptr = jnp.asarray(kv_indptr, jnp.int32)
  used = batch_indices >= 0
  b = jnp.clip(batch_indices, 0, kv_indptr.shape[0] - 2)
  page_iter = kv_indptr[b] + positions // page_size
  inside = (positions >= 0) & (page_iter < kv_indptr[b + 1]) & (page_iter < kv_indices.shape[0])
  ok = used & inside
  page = kv_indices[jnp.where(ok, page_iter, 0)]
  slots = jnp.where(ok, page * page_size + positions % page_size, -1).astype(jnp.int32)
  return slots, inside | ~used


def block_table_to_indptr(block_table, seq_lens, block_size: int):
  """vLLM block table -> FlashInfer (kv_indptr, kv_indices, kv_last_page_len).

  kv_indices has static length ``batch * max_blocks_per_seq``; entries at and past
  ``kv_indptr[-1]`` are 0 (unused). A sequence of length 0 owns no pages and has
  last_page_len 0.
  """
  block_table = jnp.asarray(block_table, jnp.int32)
  seq_lens = jnp.asarray(seq_lens, jnp.int32)
  batch, max_blocks = block_table.shape
  num_pages = (seq_lens + block_size - 1) // block_size
  kv_indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(num_pages, dtype=jnp.int32)])
  column = jnp.arange(max_blocks, dtype=jnp.int32)
  used = column[None, :] < num_pages[:, None]
  target = jnp.where(used, kv_indptr[:-1, None] + column[None, :], batch * max_blocks)
  kv_indices = jnp.zeros((batch * max_blocks,), jnp.int32).at[target.reshape(-1)].set(
      block_table.reshape(-1), mode="drop")
  last = jnp.where(num_pages > 0, seq_lens - (num_pages - 1) * block_size, 0)
  return kv_indptr, kv_indices, last.astype(jnp.int32)


def indptr_to_block_table(kv_indptr, kv_indices, kv_last_page_len, page_size: int,
                          max_blocks_per_seq: int):
  """FlashInfer table -> vLLM (block_table [batch, max_blocks_per_seq], seq_lens).

  Columns past a request's pages are 0. Pages past ``max_blocks_per_seq`` do not fit:
  eagerly that raises ValueError; under jit they are cut off (and seq_lens with them).
  """
  kv_indptr = jnp.asarray(kv_indptr, jnp.int32)
  kv_indices = jnp.asarray(kv_indices, jnp.int32)
  num_pages = kv_indptr[1:] - kv_indptr[:-1]
  if not isinstance(num_pages, jax.core.Tracer):
    widest = int(jnp.max(num_pages)) if num_pages.size else 0
    if widest > max_blocks_per_seq:
      raise ValueError(f"a request owns {widest} pages but max_blocks_per_seq is "
                       f"{max_blocks_per_seq}")
  column = jnp.arange(max_blocks_per_seq, dtype=jnp.int32)
  used = column[None, :] < num_pages[:, None]
  source = jnp.where(used, kv_indptr[:-1, None] + column[None, :], 0)
  block_table = jnp.where(used, kv_indices[jnp.clip(source, 0, kv_indices.shape[0] - 1)], 0)
  seq_lens = get_seq_lens(kv_indptr, kv_last_page_len, page_size)
  seq_lens = jnp.minimum(seq_lens, max_blocks_per_seq * page_size)
  return block_table.astype(jnp.int32), seq_lens
