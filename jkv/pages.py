"""Page tables: vLLM block tables, FlashInfer / SGLang indptr tables, slot mappings.

Everything here is jit-able (static output sizes). Two forms of the same table:

* vLLM: ``block_table`` int32 [batch, max_blocks_per_seq] + ``seq_lens`` [batch].
* FlashInfer: ``kv_indptr`` [batch + 1], ``kv_indices`` [num_pages_used],
  ``kv_last_page_len`` [batch]; request b owns pages
  ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` and has
  ``(num_pages - 1) * page_size + last_page_len`` tokens (0 with no pages).

Every public helper takes ``backend`` like the ops: ``"auto"`` and ``"reference"`` run its
jnp code (XLA fuses it into the caller); there is no kernel for them, so ``"pallas"`` and
``"interpret"`` raise ``NotImplementedError``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jkv import backend as backend_lib
from jkv import errors


def _int_array(name: str, x, ndim: int, what: str):
  """x as an int32 array, checked to be ``ndim``-D of an integer dtype (floats are not
  truncated silently)."""
  x = errors.int_array(name, x)
  errors.check_ndim(name, x, ndim, what)
  errors.check_int(name, x)
  return x.astype(jnp.int32)


def _take(array, *index):
  """``array[index]``, an empty indexed dim read as one of zeros (what the callers mask:
  XLA cannot gather from an empty operand)."""
  n = len(index)
  if 0 in array.shape[:n]:
    array = jnp.zeros(tuple(max(d, 1) for d in array.shape[:n]) + array.shape[n:], array.dtype)
  return array[index]


def check_indptr(name: str, indptr, num_indices: int | None = None, indices_name: str = ""):
  """An indptr table (int [batch + 1]) as int32; eagerly non-decreasing, from >= 0 and,
  given num_indices, ending at most there."""
  indptr = _int_array(name, indptr, 1, "[batch + 1]")
  if indptr.shape[0] == 0:
    raise ValueError(f"{name} must have batch + 1 >= 1 entries, got shape (0,)")
  if errors.is_concrete(indptr):
    values = np.asarray(indptr)
    if values[0] < 0:
      raise ValueError(f"{name}[0] must be >= 0, got {int(values[0])}")
    down = np.nonzero(np.diff(values) < 0)[0]
    if down.size:
      i = int(down[0]) + 1
      raise ValueError(f"{name} must be non-decreasing, got {name}[{i}] = {int(values[i])} < "
                       f"{name}[{i - 1}] = {int(values[i - 1])}")
    if num_indices is not None and values[-1] > num_indices:
      raise ValueError(f"{name}[-1] = {int(values[-1])} is past the end of {indices_name} "
                       f"({num_indices} entries)")
  return indptr


def _check_lengths_in(name: str, lengths, low: int, high: int, why: str) -> None:
  """Eagerly: low <= lengths[i] <= high."""
  if not errors.is_concrete(lengths):
    return
  values = np.asarray(lengths)
  bad = np.nonzero((values < low) | (values > high))[0]
  if bad.size:
    i = int(bad[0])
    raise ValueError(f"{name}[{i}] = {int(values[i])} is out of range: must be in "
                     f"[{low}, {high}] ({why})")


def slot_mapping(block_table, seq_ids, positions, block_size: int, *, backend: str = "auto"):
  """Slot of each token: ``block_table[seq, pos // bs] * bs + pos % bs``.

  Args:
    block_table: int32 [batch, max_blocks_per_seq].
    seq_ids: int [T] row of block_table per token; < 0 marks padding.
    positions: int [T] absolute position of each token in its sequence.
  Returns:
    int32 [T]; -1 for padding tokens and for positions past the table's width. A seq_id
    past the table's rows raises ValueError eagerly and gives -1 under jit.
  """
  backend_lib.jnp_only(backend)
  errors.check_size("block_size", block_size)
  block_table = _int_array("block_table", block_table, 2, "[batch, max_blocks_per_seq]")
  seq_ids = errors.int_array("seq_ids", seq_ids)
  positions = errors.int_array("positions", positions)
  errors.check_int("seq_ids", seq_ids)
  errors.check_int("positions", positions)
  errors.check_shape("positions", positions, seq_ids.shape)
  seq_ids, positions = seq_ids.astype(jnp.int32), positions.astype(jnp.int32)
  batch, max_blocks = block_table.shape
  errors.check_slots_in_range("seq_ids", seq_ids.reshape(-1), batch, "block_table", "rows")
  column = positions // block_size
  valid = (seq_ids >= 0) & (seq_ids < batch) & (positions >= 0) & (column < max_blocks)
  block = _take(block_table, jnp.where(valid, seq_ids, 0), jnp.where(valid, column, 0))
  return jnp.where(valid, block * block_size + positions % block_size, -1).astype(jnp.int32)


def decode_slot_mapping(block_table, seq_lens, block_size: int, *, backend: str = "auto"):
  """Slots of one new token per sequence, at position ``seq_lens[b]`` (the next free one)."""
  backend_lib.jnp_only(backend)
  block_table = _int_array("block_table", block_table, 2, "[batch, max_blocks_per_seq]")
  seq_lens = _int_array("seq_lens", seq_lens, 1, "[batch]")
  errors.check_shape("seq_lens", seq_lens, block_table.shape[:1])
  return slot_mapping(block_table, jnp.arange(seq_lens.shape[0], dtype=jnp.int32), seq_lens,
                      block_size)


def get_seq_lens(kv_indptr, kv_last_page_len, page_size: int, *, backend: str = "auto"):
  """FlashInfer ``get_seq_lens``: ``max(indptr[1:] - indptr[:-1] - 1, 0) * ps + last_page_len``.

  Eagerly: kv_indptr non-decreasing and 0 <= kv_last_page_len <= page_size (ValueError).

  >>> import jax.numpy as jnp, jkv
  >>> jkv.get_seq_lens(jnp.array([0, 1, 3, 3]), jnp.array([3, 5, 0]), 16)
  Array([ 3, 21,  0], dtype=int32)
  """
  backend_lib.jnp_only(backend)
  errors.check_size("page_size", page_size)
  kv_indptr = check_indptr("kv_indptr", kv_indptr)
  kv_last_page_len = _int_array("kv_last_page_len", kv_last_page_len, 1, "[batch]")
  errors.check_shape("kv_last_page_len", kv_last_page_len, (kv_indptr.shape[0] - 1,))
  if errors.is_concrete(page_size):
    _check_lengths_in("kv_last_page_len", kv_last_page_len, 0, int(page_size),
                      "tokens in a request's last page")
  num_pages = kv_indptr[1:] - kv_indptr[:-1]
  return (jnp.maximum(num_pages - 1, 0) * page_size + kv_last_page_len).astype(jnp.int32)


def inclusive_sum(values, width: int = 64):
  """``jnp.cumsum`` of int values [n] (int32) as fused triangular reductions.

  XLA lowers cumsum to a reduce-window, which GPU fusion may duplicate into every
  consumer and recompute over the whole window per element (O(n^2) each time; ~25 us
  for a PagePool append, benchmarks/RESULTS.md). Here sums are row reductions: up to
  1024 values in one [n, n] masked sum, more as rows of ``width`` summed within each row
  and over the rows' totals (recursively), about ``width`` adds per value.
  """
  values = values.astype(jnp.int32)
  n = values.shape[0]
  if n <= 1024:
    index = jnp.arange(n)
    return jnp.sum(jnp.where(index[None, :] <= index[:, None], values[None, :], 0), axis=1)
  rows = -(-n // width)
  tiles = jnp.pad(values, (0, rows * width - n)).reshape(rows, width)
  index = jnp.arange(width)
  within = jnp.sum(jnp.where(index[None, None, :] <= index[None, :, None], tiles[:, None, :], 0),
                   axis=2)                                         # [rows, width]
  totals = within[:, -1]
  before = inclusive_sum(totals, width) - totals                   # sum of earlier rows
  return (within + before[:, None]).reshape(-1)[:n]


def count_at_most(sorted_edges, values):
  """``searchsorted(sorted_edges, values, side="right")`` (int32) without a loop: one
  fused comparison when ``len(edges) x len(values)`` is small, a sort otherwise (the
  default binary search is a loop, ~10 us an iteration on a GPU)."""
  method = "compare_all" if sorted_edges.shape[0] * values.shape[0] <= 1 << 22 else "sort"
  return jnp.searchsorted(sorted_edges, values, side="right", method=method).astype(jnp.int32)


def table_positions(block_table, seq_lens, block_size: int):
  """(blocks [B, S], offsets [B, S], valid [B, S]) of positions 0..S-1 of each sequence,
  S = max_blocks * block_size: block_table int [B, max_blocks], seq_lens int [B]."""
  block_table = jnp.asarray(block_table, jnp.int32)
  seq_lens = jnp.asarray(seq_lens, jnp.int32)
  errors.check_ndim("block_table", block_table, 2, "[batch, max_blocks_per_seq]")
  errors.check_shape("seq_lens", seq_lens, block_table.shape[:1])
  position = jnp.arange(block_table.shape[1] * block_size, dtype=jnp.int32)
  blocks = block_table[:, position // block_size]
  return blocks, jnp.broadcast_to(position % block_size, blocks.shape), (
      position[None, :] < seq_lens[:, None])


def gather_sources(block_table, cu_seq_lens, num_tokens: int, block_size: int,
                   num_blocks: int):
  """Where each gathered row t comes from: (block, position in its sequence, ok), int32 /
  bool [T]. Row t belongs to the sequence b with cu_seq_lens[b] <= t < cu_seq_lens[b + 1];
  ``ok`` is False before cu_seq_lens[0], past cu_seq_lens[-1], past the block table and
  for blocks outside the cache."""
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  cu = cu_seq_lens.astype(jnp.int32)
  batch = jnp.clip(count_at_most(cu, t) - 1, 0, max(block_table.shape[0] - 1, 0))
  position = t - cu[batch]
  column = jnp.clip(position // block_size, 0, max(block_table.shape[1] - 1, 0))
  block = _take(block_table, batch, column).astype(jnp.int32)
  ok = ((position >= 0) & (t < cu[-1]) & (position // block_size < block_table.shape[1])
        & (block >= 0) & (block < num_blocks))
  return block, position, ok


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int, *,
                                backend: str = "auto"):
  """FlashInfer ``get_batch_indices_positions``.

  Entry k of request b (``append_indptr[b] <= k < append_indptr[b+1]``) gets
  ``batch_indices = b`` and ``positions = seq_lens[b] - num_appended[b] + (k -
  append_indptr[b])``: the appended tokens are the tail of the sequence. Entries
  ``k >= append_indptr[-1]`` get batch index -1 and position 0.
  Returns (batch_indices, positions), int32 [nnz]. Eagerly ValueError when append_indptr
  decreases or appends more than nnz entries, or a request appends more tokens than
  seq_lens gives it.

  >>> import jax.numpy as jnp, jkv
  >>> batch, positions = jkv.get_batch_indices_positions(jnp.array([0, 1, 3]),
  ...                                                    jnp.array([3, 21]), 4)
  >>> batch, positions     # the 4th entry is unused (nnz > appended tokens)
  (Array([ 0,  1,  1, -1], dtype=int32), Array([ 2, 19, 20,  0], dtype=int32))
  """
  backend_lib.jnp_only(backend)
  errors.check_size("nnz", nnz, minimum=0)
  append_indptr = check_indptr("append_indptr", append_indptr)
  seq_lens = _int_array("seq_lens", seq_lens, 1, "[batch]")
  errors.check_shape("seq_lens", seq_lens, (append_indptr.shape[0] - 1,))
  if errors.is_concrete(append_indptr) and errors.is_concrete(nnz):
    total = int(np.asarray(append_indptr)[-1])
    if total > int(nnz):
      raise ValueError(f"append_indptr[-1] = {total} entries do not fit in nnz = {int(nnz)}")
    if errors.is_concrete(seq_lens):
      appended = np.diff(np.asarray(append_indptr))
      short = np.nonzero(np.asarray(seq_lens) < appended)[0]
      if short.size:
        b = int(short[0])
        raise ValueError(f"seq_lens[{b}] = {int(np.asarray(seq_lens)[b])} is less than the "
                         f"{int(appended[b])} tokens append_indptr appends to request {b}")
  k = jnp.arange(nnz, dtype=jnp.int32)
  batch = count_at_most(append_indptr, k) - 1
  used = k < append_indptr[-1]
  b = jnp.clip(batch, 0, max(seq_lens.shape[0] - 1, 0))
  appended = append_indptr[b + 1] - append_indptr[b]
  positions = _take(seq_lens, b) - appended + (k - append_indptr[b])
  return jnp.where(used, b, -1), jnp.where(used, positions, 0)


def append_slot_mapping(batch_indices, positions, kv_indices, kv_indptr, page_size: int, *,
                        backend: str = "auto"):
  """Slots for FlashInfer appends, and whether each used entry lies inside its request's pages.

  Returns (slots int32 [nnz] with -1 for unused or out-of-range entries,
  in_range bool [nnz], True for unused entries). A batch index past kv_indptr's requests
  raises ValueError eagerly and is out of range (no write) under jit.
  """
  backend_lib.jnp_only(backend)
  errors.check_size("page_size", page_size)
  batch_indices = _int_array("batch_indices", batch_indices, 1, "[nnz]")
  positions = _int_array("positions", positions, 1, "[nnz]")
  errors.check_shape("positions", positions, batch_indices.shape)
  kv_indices = _int_array("kv_indices", kv_indices, 1, "[num_pages_used]")
  kv_indptr = check_indptr("kv_indptr", kv_indptr, kv_indices.shape[0], "kv_indices")
  num_requests = kv_indptr.shape[0] - 1
  errors.check_slots_in_range("batch_indices", batch_indices, num_requests, "kv_indptr",
                              "requests")
  used = batch_indices >= 0
  b = jnp.clip(batch_indices, 0, max(num_requests - 1, 0))
  page_of_request = positions // page_size   # (compared before the sum, which could wrap)
  page_iter = kv_indptr[b] + page_of_request
  inside = ((batch_indices < num_requests) & (positions >= 0)
            & (page_of_request < kv_indptr[b + 1] - kv_indptr[b])
            & (page_iter < kv_indices.shape[0]))
  ok = used & inside
  page = _take(kv_indices, jnp.where(ok, page_iter, 0))
  slots = jnp.where(ok, page * page_size + positions % page_size, -1).astype(jnp.int32)
  return slots, inside | ~used


def block_table_to_indptr(block_table, seq_lens, block_size: int, *, backend: str = "auto"):
  """vLLM block table -> FlashInfer (kv_indptr, kv_indices, kv_last_page_len).

  kv_indices has static length ``batch * max_blocks_per_seq``; entries at and past
  ``kv_indptr[-1]`` are 0 (unused). A sequence of length 0 owns no pages and has
  last_page_len 0. Eagerly, seq_lens outside [0, max_blocks_per_seq * block_size] raise
  ValueError.
  """
  backend_lib.jnp_only(backend)
  errors.check_size("block_size", block_size)
  block_table = _int_array("block_table", block_table, 2, "[batch, max_blocks_per_seq]")
  seq_lens = _int_array("seq_lens", seq_lens, 1, "[batch]")
  errors.check_shape("seq_lens", seq_lens, block_table.shape[:1])
  batch, max_blocks = block_table.shape
  if errors.is_concrete(block_size):
    _check_lengths_in("seq_lens", seq_lens, 0, max_blocks * int(block_size),
                      f"block_table holds {max_blocks} blocks of {int(block_size)} tokens")
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
                          max_blocks_per_seq: int, *, backend: str = "auto"):
  """FlashInfer table -> vLLM (block_table [batch, max_blocks_per_seq], seq_lens).

  Columns past a request's pages are 0. Pages past ``max_blocks_per_seq`` do not fit:
  eagerly that raises ValueError; under jit they are cut off (and seq_lens with them).
  """
  backend_lib.jnp_only(backend)
  errors.check_size("max_blocks_per_seq", max_blocks_per_seq, minimum=0)
  kv_indices = _int_array("kv_indices", kv_indices, 1, "[num_pages_used]")
  kv_indptr = check_indptr("kv_indptr", kv_indptr, kv_indices.shape[0], "kv_indices")
  num_pages = kv_indptr[1:] - kv_indptr[:-1]
  if not isinstance(num_pages, jax.core.Tracer):
    widest = int(jnp.max(num_pages)) if num_pages.size else 0
    if widest > max_blocks_per_seq:
      raise ValueError(f"a request owns {widest} pages but max_blocks_per_seq is "
                       f"{max_blocks_per_seq}")
  column = jnp.arange(max_blocks_per_seq, dtype=jnp.int32)
  used = column[None, :] < num_pages[:, None]
  source = jnp.where(used, kv_indptr[:-1, None] + column[None, :], 0)
  source = jnp.clip(source, 0, max(kv_indices.shape[0] - 1, 0))
  block_table = jnp.where(used, _take(kv_indices, source), 0)
  seq_lens = get_seq_lens(kv_indptr, kv_last_page_len, page_size)
  seq_lens = jnp.minimum(seq_lens, max_blocks_per_seq * page_size)
  return block_table.astype(jnp.int32), seq_lens
