"""Ragged paged attention kernel: chunked prefill and decode rows of many sequences.

A program owns a tile of ``block_q`` consecutive query tokens of one sequence and the
``G = Hq / Hkv`` query heads that share its KV head: ``rows = block_q * G`` rows of the
logit matrix (row ``r`` is token ``r // G``, head ``r % G``), so every K/V tile it loads
serves all of them (GQA). It walks the sequence's pages up to its last token's position in
tiles of ``tile_pages`` pages, gathering K and V through the block table in any layout
(element offsets from :class:`jkv.layout.Plane`), masks causally (and by the sliding
window) per row, and keeps a running max / sum / accumulator in float32 (online softmax).

:func:`ragged_paged_attention` runs the kernel over two work lists built in XLA from
``cu_q_lens``, two kinds of program (by default a launch each, the prefill first; with
``one_launch`` both in one launch along the first grid axis, heavy ones first):

* **long** items (prefill chunks): one program per ``block_q``-token tile (128 rows by
  default), no context split; the program writes its normalized rows straight into the
  output;
* **short** items (sequences of at most ``short_q`` new tokens: decodes, small speculative
  steps): one program per sequence, KV head and context split, ``rows`` small (16 for G <=
  16), the context split so that a few long decodes fill the GPU; their partials ``(acc,
  max, sum)`` are combined in XLA and placed at their rows.

With ``prefill_lowering="mosaic"`` the long items (64 tokens each) run on
:func:`pallas_kernels.mosaic_ragged.prefill` instead; with ``decode_lowering="mosaic"`` the
short items run on :func:`pallas_kernels.mosaic_attention.ragged_partials` (the decode
kernel with a causal limit per token), whose partials the same XLA combine takes.

In one launch, decode programs (memory-bound) run beside prefill tiles (matmul-bound), but
the kernel then has the prefill path's register count, which starves the decodes of
occupancy (benchmarks/NOTES_ragged.md): two launches are the default.

Positions outside ``[p - W + 1, p]`` (``p`` the row's position), at or past ``kv_lens`` and
blocks outside the cache are masked on load, so NaN in unused entries never reaches the
output. Padding rows (no sequence) read 0. Semantics: :mod:`jkv.reference.ragged_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jkv import quant
from jkv.layout import PageRows, Plane
from pallas_kernels import common, lowering, mosaic_attention, mosaic_ragged

_NEG = -1e30   # the running max starts here: finite, so fully masked tiles stay NaN-free
_LOG2E = float(np.log2(np.e))
_LN2 = float(np.log(2.0))


def _kernel(seq_ref,            # int32 [items]: the work list (long items first): sequence,
            row0_ref,           # int32 [items]: first query row,
            rows_ref,           # int32 [items]: rows owned (0: none),
            pos0_ref,           # int32 [items]: position of the first row
            kv_lens_ref,        # int32 [S]
            block_tables_ref,   # int32 [S, W]
            layer_ref,          # int32 [1]
            query_ref,          # [T * Hq, D]
            k_scale_ref,        # float32 [H] (tensor), [L * nb * H * bs] (token) or
            v_scale_ref,        # [L * units * H] (block)
            alibi_ref,          # float32 [Hq]
            sinks_ref,          # float32 [Hq]
            k_ref,              # [rows, page elems]: the key plane (FP8 as bytes)
            v_ref,              # [rows, page elems]: the value plane
            _out_in_ref,        # [T * Hq, D], aliased to out_ref
            out_ref,            # out [T * Hq, D]: the long items' rows
            acc_ref,            # out float32 [S * H * splits, rows, D]: short partials
            max_ref,            # out float32 [S * H * splits, rows]
            sum_ref,            # out float32 [S * H * splits, rows]
            *, num_long: int, num_short: int, num_splits: int, long, short, **static):
  """Programs ``[0, num_long)`` along grid axis 0 are long items (prefill tiles, written
  into ``out_ref``); the next ``num_short * num_splits`` are the short items' context
  splits (partials into acc / max / sum, combined in XLA). Axis 1 is the KV head."""
  p, kvh = pl.program_id(0), pl.program_id(1)
  work = (seq_ref, row0_ref, rows_ref, pos0_ref, kv_lens_ref, block_tables_ref, layer_ref,
          query_ref, k_scale_ref, v_scale_ref, alibi_ref, sinks_ref, k_ref, v_ref)
  if num_long:
    @pl.when(p < num_long)
    def _():
      _program(*work, (out_ref,), item=p, kvh=kvh, split=0, out_row=0, partials=False,
               **long, **static)

  if not num_short:
    return

  @pl.when(p >= num_long)
  def _():
    q = p - num_long
    short_item, split = q // num_splits, q % num_splits
    _program(*work, (acc_ref, max_ref, sum_ref), item=num_long + short_item, kvh=kvh,
             split=split, out_row=(short_item * pl.num_programs(1) + kvh) * num_splits + split,
             partials=True, **short, **static)


def _program(seq_ref, row0_ref, rows_ref, pos0_ref, kv_lens_ref, block_tables_ref, layer_ref,
             query_ref, k_scale_ref, v_scale_ref, alibi_ref, sinks_ref, k_ref, v_ref, out_refs,
             *, item, kvh, split, out_row, fmt, key_plane: Plane, value_plane: Plane,
             key_rows: PageRows, value_rows: PageRows, head_chunks, num_blocks: int, num_q_heads: int, group: int, block_q: int,
             rows: int, tile_pages: int, pages_per_split: int, num_rows: int, scale: float,
             logits_soft_cap, sliding_window, use_alibi: bool, use_sinks: bool, fnuz: bool,
             fp8, compute_dtype, partials: bool):
  """One (work item, KV head, context split): ``rows`` logit rows (``block_q`` tokens x
  the group's query heads) over the item's keys in ``split``'s pages; writes normalized
  rows into ``out_refs[0]``, or (``partials``) its (acc, max, sum) at ``out_row``."""
  seq = seq_ref[item]
  row0 = row0_ref[item]
  owned = rows_ref[item]
  pos0 = pos0_ref[item]
  kv_len = kv_lens_ref[seq]
  layer = layer_ref[0]
  bs = key_plane.block_size
  tile = tile_pages * bs

  r = lax.iota(jnp.int32, rows)
  token, head = r // group, r % group
  row_ok = ((r < block_q * group) & (token < owned) & (row0 + token >= 0)
            & (row0 + token < num_rows))
  q_head = kvh * group + head
  q_row = jnp.where(row_ok, (row0 + token) * num_q_heads + q_head, 0)
  pos = pos0 + token                                          # [rows] query positions

  end = jnp.where(owned > 0, jnp.minimum(pos0 + owned, kv_len), 0)   # keys < end
  start = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
  first_page = split * pages_per_split
  end_page = jnp.minimum(first_page + pages_per_split, (end + bs - 1) // bs)
  begin_page = jnp.maximum(first_page, start // bs)
  num_tiles = jnp.maximum(end_page - begin_page + tile_pages - 1, 0) // tile_pages

  def columns(chunk):
    first, size, padded = chunk
    clamped, raw, ok = lowering.padded_columns(size, padded)
    return first + clamped, first + raw, ok

  def mask2(a, b_ok):
    return a[:, None] if b_ok is None else a[:, None] & b_ok[None, :]

  def load_query(chunk):
    d, _, d_ok = columns(chunk)
    shape = (rows, chunk[2])
    q = lowering.load(query_ref.at[jnp.broadcast_to(q_row[:, None], shape),
                                   jnp.broadcast_to(d[None, :], shape)],
                      mask=jnp.broadcast_to(mask2(row_ok, d_ok), shape), other=0)
    return q.astype(compute_dtype)

  queries = [load_query(chunk) for chunk in head_chunks]
  if fmt.quant == "tensor":
    k_factor, v_factor = k_scale_ref[kvh], v_scale_ref[kvh]
  if use_alibi:
    slopes = lowering.load(alibi_ref.at[q_head], mask=row_ok, other=0.0)

  t = lax.iota(jnp.int32, tile)
  offset = t % bs
  k_tokens = key_plane.token_offset(offset)[:, None]
  v_tokens = value_plane.token_offset(offset)[:, None]
  token_minor_values = value_plane.tokens_fastest

  def stored_value(x):
    if fnuz:
      x = quant.e4m3fnuz_value(x)
    elif fp8 is not None:   # FP8 read as bytes (Triton has no FP8 fill value)
      x = lax.bitcast_convert_type(x, fp8)
    return x.astype(compute_dtype)

  def load_chunk(ref, plane, tokens, cache_row, ok, chunk):
    d, _, d_ok = columns(chunk)
    shape = (tile, chunk[2])
    x = lowering.load(ref.at[jnp.broadcast_to(cache_row, shape),
                             tokens + plane.elem_offset(kvh, d)[None, :]],
                      mask=jnp.broadcast_to(mask2(ok, d_ok), shape), other=0)
    return stored_value(x)

  def load_token_minor(ref, plane, page_row, page_ok, ok, chunk):
    """[tile, chunk] of a plane whose fastest dim is the token (vLLM / ASM values), loaded
    as [pages, bs, chunk] so the loads along a page's tokens vectorize; masked per page,
    tokens outside ``ok`` zeroed after the load."""
    d, _, d_ok = columns(chunk)
    shape = (tile_pages, bs, chunk[2])
    index = (plane.token_offset(lax.iota(jnp.int32, bs))[None, :, None]
             + plane.elem_offset(kvh, d)[None, None, :])
    mask = page_ok[:, None, None] if d_ok is None else page_ok[:, None, None] & d_ok
    x = lowering.load(ref.at[jnp.broadcast_to(page_row[:, None, None], shape),
                             jnp.broadcast_to(index, shape)],
                      mask=jnp.broadcast_to(mask, shape), other=0).reshape(tile, chunk[2])
    return jnp.where(ok[:, None], stored_value(x), 0)

  # Scores are kept in base 2 (exp2 is one instruction): s2 = logit * log2(e). A plain cache
  # with a positive scale folds both factors into one multiply-add per score.
  plain = (fmt.quant == "none" and logits_soft_cap is None and not use_alibi and scale > 0)
  score_factor = scale * _LOG2E

  def body(i, carry, masked):
    """One K/V tile. ``masked``: the tile may hold keys some rows must not see (causal
    diagonal, window edge); else every key it holds is seen by every row (only keys
    outside the cache or the sequence are masked, per column)."""
    accs, running_max, running_sum = carry
    page = begin_page + i * tile_pages + t // bs
    key_pos = page * bs + offset
    page_in = page < end_page
    block = lowering.load(block_tables_ref.at[jnp.broadcast_to(seq, (tile,)),
                                              jnp.where(page_in, page, 0)],
                          mask=page_in, other=-1)
    ok = (page_in & (key_pos < end) & (key_pos >= start) & (block >= 0)
          & (block < num_blocks))
    safe_block = jnp.where(ok, block, 0)
    cache_row = key_rows.row(layer, safe_block)[:, None]
    value_row = value_rows.row(layer, safe_block)[:, None]
    keys = [load_chunk(k_ref, key_plane, k_tokens, cache_row, ok, chunk)
            for chunk in head_chunks]
    if token_minor_values:   # the same pages, one entry per page
      pages = begin_page + i * tile_pages + lax.iota(jnp.int32, tile_pages)
      pages_in = pages < end_page
      page_block = lowering.load(block_tables_ref.at[jnp.broadcast_to(seq, (tile_pages,)),
                                                     jnp.where(pages_in, pages, 0)],
                                 mask=pages_in, other=-1)
      page_ok = pages_in & (page_block >= 0) & (page_block < num_blocks)
      page_row = value_rows.row(layer, jnp.where(page_ok, page_block, 0))
      values = [load_token_minor(v_ref, value_plane, page_row, page_ok, ok, chunk)
                for chunk in head_chunks]
    else:
      values = [load_chunk(v_ref, value_plane, v_tokens, value_row, ok, chunk)
                for chunk in head_chunks]
    key_scales = value_scales = None   # MAX groups: per-token scales [tile] per chunk
    if fmt.scale_collection:   # [rows, bs, H, G], through the page rows
      key_scales, value_scales = (
          common.group_scales(k_scale_ref, page_rows, layer, safe_block, offset,
                              key_plane.num_heads, kvh, fmt.scale_groups, bs, ok)
          for page_rows in (key_rows, value_rows))
    logits = None
    for j, (q, k) in enumerate(zip(queries, keys)):
      part = lowering.dot(q, k, trans_b=True)                # [rows, tile]
      if key_scales is not None:
        part = part * key_scales[j][None, :]
      logits = part if logits is None else logits + part
    k_tok = v_tok = None
    if fmt.quant == "token" and not fmt.scale_collection:
      index = ((layer * num_blocks + safe_block) * key_plane.num_heads + kvh) * bs + offset
      k_tok = lowering.load(k_scale_ref.at[index], mask=ok, other=0.0)
      v_tok = lowering.load(v_scale_ref.at[index], mask=ok, other=0.0)
    elif fmt.quant == "block":
      units = num_blocks * bs // fmt.scale_block_tokens
      unit = (safe_block * bs + offset) // fmt.scale_block_tokens
      index = (layer * units + unit) * key_plane.num_heads + kvh
      k_tok = lowering.load(k_scale_ref.at[index], mask=ok, other=0.0)
      v_tok = lowering.load(v_scale_ref.at[index], mask=ok, other=0.0)
    if masked:
      seen = ok[None, :] & (key_pos[None, :] <= pos[:, None])
      if sliding_window is not None:
        seen &= key_pos[None, :] > pos[:, None] - sliding_window
    else:
      seen = ok[None, :]
    if plain:   # base-2 scores = logits * score_factor, folded into the exponent below
      logits = jnp.where(seen, logits, -jnp.inf)
      new_max = jnp.maximum(running_max, jnp.max(logits, axis=1) * score_factor)
      prob = jnp.exp2(logits * score_factor - new_max[:, None])
    else:
      logits = logits * scale
      if fmt.quant == "tensor":
        logits = logits * k_factor
      elif k_tok is not None:
        logits = logits * k_tok[None, :]
      if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
      if use_alibi:
        logits = logits + slopes[:, None] * (key_pos[None, :] - pos[:, None]).astype(
            jnp.float32)
      logits = jnp.where(seen, logits * _LOG2E, -jnp.inf)
      new_max = jnp.maximum(running_max, jnp.max(logits, axis=1))
      prob = jnp.exp2(logits - new_max[:, None])
    alpha = jnp.exp2(running_max - new_max)
    running_sum = running_sum * alpha + jnp.sum(prob, axis=1)
    if v_tok is not None:
      prob = prob * v_tok[None, :]
    if value_scales is not None:   # each value chunk under its own group scale
      accs = tuple(acc * alpha[:, None]
                   + lowering.dot((prob * v_scale[None, :]).astype(compute_dtype), v)
                   for acc, v, v_scale in zip(accs, values, value_scales))
      return accs, new_max, running_sum
    prob = prob.astype(compute_dtype)
    accs = tuple(acc * alpha[:, None] + lowering.dot(prob, v) for acc, v in zip(accs, values))
    return accs, new_max, running_sum

  # Tiles [0, full_first) and [full_end, num_tiles) are masked per row; the tiles between
  # hold only keys every row sees: at or before the first row's position and (window) at or
  # after the last row's window start.
  last_pos = pos0 + owned - 1
  full_start = start if sliding_window is None else jnp.maximum(
      start, last_pos - sliding_window + 1)
  full_stop = jnp.minimum(pos0 + 1, end)
  tile_first_key = begin_page * bs
  full_first = jnp.clip((full_start - tile_first_key + tile - 1) // tile, 0, num_tiles)
  full_end = jnp.clip((full_stop - tile_first_key) // tile, full_first, num_tiles)

  if use_sinks and not partials:   # the sink joins the softmax once, as a logit with no value
    sink = lowering.load(sinks_ref.at[q_head], mask=row_ok, other=_NEG)
    init_max, init_sum = (jnp.maximum(sink * _LOG2E, _NEG), jnp.ones((rows,), jnp.float32))
  else:
    init_max, init_sum = jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32)
  carry = (tuple(jnp.zeros((rows, chunk[2]), jnp.float32) for chunk in head_chunks),
           init_max, init_sum)
  masked_body = functools.partial(body, masked=True)
  carry = lax.fori_loop(0, full_first, masked_body, carry)
  carry = lax.fori_loop(full_first, full_end, functools.partial(body, masked=False), carry)
  accs, running_max, running_sum = lax.fori_loop(full_end, num_tiles, masked_body, carry)
  running_max = running_max * _LN2   # natural units for the combine

  full = lambda width: (rows, width)   # noqa: E731
  if partials:
    acc_ref, max_ref, sum_ref = out_refs
    for acc, chunk in zip(accs, head_chunks):
      if fmt.quant == "tensor":
        acc = acc * v_factor
      _, lanes, d_ok = columns(chunk)
      shape = full(chunk[2])
      lowering.store(acc_ref.at[jnp.broadcast_to(out_row, shape),
                                jnp.broadcast_to(r[:, None], shape),
                                jnp.broadcast_to(lanes[None, :], shape)],
                     acc, mask=jnp.broadcast_to(mask2(row_ok, d_ok), shape))
    vec_rows = jnp.broadcast_to(out_row, (rows,))
    lowering.store(max_ref.at[vec_rows, r], running_max, mask=row_ok)
    lowering.store(sum_ref.at[vec_rows, r], running_sum, mask=row_ok)
  else:
    out_ref, = out_refs
    inverse = 1.0 / (running_sum + 1e-6)
    # Masked rows get distinct indices past the output: the interpreter drops them (one
    # shared in-range index would let a masked lane's stale value win), the GPU never
    # touches them.
    store_row = jnp.where(row_ok, q_row, num_rows * num_q_heads + r)
    for acc, chunk in zip(accs, head_chunks):
      if fmt.quant == "tensor":
        acc = acc * v_factor
      _, lanes, d_ok = columns(chunk)
      shape = full(chunk[2])
      lowering.store(out_ref.at[jnp.broadcast_to(store_row[:, None], shape),
                                jnp.broadcast_to(lanes[None, :], shape)],
                     (acc * inverse[:, None]).astype(out_ref.dtype),
                     mask=jnp.broadcast_to(mask2(row_ok, d_ok), shape))


def supports(block_size: int) -> bool:
  """Whether the kernel handles this block size (tiles must be powers of two)."""
  return block_size == common.next_pow2(block_size)


def short_rows(group: int) -> int:
  """Rows of a short (decode) program: 16 (tensor-core minimum) or the group."""
  return max(16, common.next_pow2(group))


def long_rows(group: int, target: int = 128) -> int:
  """Rows of a long (prefill) program: ``target`` or the group."""
  return max(target, common.next_pow2(group))


def work_lists(cu_q_lens, kv_lens, num_seqs, num_rows: int, short_q: int, long_q: int):
  """The two work lists (XLA): ``(short, long)``, each int32 ``(seq, row0, rows, pos0)``
  arrays. short: one item per sequence slot ([S]), owning its rows when it has at most
  ``short_q`` new tokens. long: one item per ``long_q``-token tile of the other sequences,
  ``cdiv(T, long_q) + min(S, T // (short_q + 1))`` items (an upper bound; the rest own
  nothing)."""
  num_slots = kv_lens.shape[0]
  active = jnp.arange(num_slots, dtype=jnp.int32) < num_seqs
  q_lens = jnp.where(active, jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0), 0)
  is_short = q_lens <= short_q
  short = (jnp.arange(num_slots, dtype=jnp.int32), cu_q_lens[:-1],
           jnp.where(is_short, q_lens, 0), kv_lens - q_lens)
  tiles = jnp.where(is_short, 0, (q_lens + long_q - 1) // long_q)
  tile_end = jnp.cumsum(tiles)
  # Tiles: sum of ceil(q / long_q) over long sequences <= T / long_q + their count, and a
  # long sequence has more than short_q of the T rows.
  items = -(-num_rows // long_q) + min(num_slots, num_rows // (short_q + 1))
  item = jnp.arange(items, dtype=jnp.int32)
  seq = jnp.sum(tile_end[None, :] <= item[:, None], axis=1, dtype=jnp.int32)
  in_list = seq < num_slots
  seq = jnp.minimum(seq, num_slots - 1)
  first = (item - (tile_end[seq] - tiles[seq])) * long_q
  owned = jnp.where(in_list, jnp.clip(q_lens[seq] - first, 0, long_q), 0)
  long = (seq, cu_q_lens[seq] + first, owned, kv_lens[seq] - q_lens[seq] + first)
  return short, long


def default_splits(num_seqs: int, num_kv_heads: int, width: int, block_size: int,
                   tile_pages: int, target_programs: int = 1024) -> int:
  """Context splits of the short pass: enough that ``S * Hkv * splits`` reaches about
  ``target_programs``."""
  tiles = -(-width // tile_pages)
  return max(1, min(tiles, -(-target_programs // (num_seqs * num_kv_heads))))


def ragged_paged_attention(fmt, query, key_cache, value_cache, k_scale, v_scale, layer,
                           block_tables, kv_lens, cu_q_lens, num_seqs, *, key_plane: Plane,
                           value_plane: Plane, num_blocks: int, scale: float, alibi_slopes,
                           logits_soft_cap, sliding_window, sinks, interpret: bool,
                           one_launch: bool = False, long_block_rows: int = 128,
                           long_tile_tokens: int | None = None, short_tile_tokens: int = 64,
                           num_warps: int = 4, num_stages: int | None = None,
                           num_splits: int | None = None, key_rows: PageRows | None = None,
                           value_rows: PageRows | None = None, prefill_lowering: str = "triton",
                           decode_lowering: str = "triton"):
  """Ragged attention over one layer of stacked caches (see :mod:`jkv.ops.ragged_attention`).

  query [T, Hq, D]; key_cache / value_cache [L, ...] in the planes' layout (value_cache
  None: K and V share key_cache); k_scale / v_scale float32 [H] or [1] (``tensor``),
  [L, nb, H, bs] (``token``) or [L, units, H] (``block``); layer int32 scalar;
  block_tables int32 [S, W]; kv_lens int32 [S]; cu_q_lens int32 [S + 1]; num_seqs int32
  scalar; alibi_slopes / sinks float32 [Hq] or None. one_launch: both kinds of program in one kernel (decodes overlap
  prefill tiles), else a launch per kind (each its own register count). The other keywords
  tune the kernel (rows of a long program, tokens per K/V tile of each kind, Triton warps
  and pipeline stages, context splits of the short items; None: defaults). key_rows /
  value_rows: where each (layer, block)'s page lies in the caches viewed as ``[rows,
  page_elems]``; None: stacked caches (as
  :func:`pallas_kernels.attention.paged_attention_decode`, which also reads a per-token
  quantized MAX collection's scale collection the same way). prefill_lowering:
  ``"mosaic"`` runs the long items (64-token tiles) on
  :func:`pallas_kernels.mosaic_ragged.prefill` (the cases its ``supported`` takes, stacked
  caches, two launches), ``"triton"`` on this kernel. decode_lowering: ``"mosaic"`` runs
  the short items on :func:`pallas_kernels.mosaic_attention.ragged_partials` (the cases its
  ``supported`` takes, stacked caches, two launches), ``"triton"`` on this kernel.
  Returns [T, Hq, D] in the query's dtype.
  """
  num_rows, num_q_heads, head_size = query.shape
  num_heads = key_plane.num_heads
  num_slots, width = block_tables.shape
  group = num_q_heads // num_heads
  out_dtype = query.dtype
  # The Mosaic kernels take them as given (before the Triton kernel's f16 queries).
  mosaic_query, mosaic_k_scale, mosaic_v_scale = query, k_scale, v_scale
  if fmt.quant == "tensor":
    k_scale, v_scale = common.head_scales(k_scale, v_scale, num_heads)
    if common.f16_queries(query.dtype, key_cache.dtype, fmt):   # FP8 keys: f16 dots
      query, k_scale = common.f16_query(query, k_scale)
  bs = key_plane.block_size
  one_byte = np.dtype(key_cache.dtype).itemsize == 1
  fnuz = np.dtype(key_cache.dtype) == np.dtype(jnp.float8_e4m3fnuz)
  fp8 = None if fnuz or not quant.is_fp8(key_cache.dtype) else np.dtype(key_cache.dtype)
  key_rows = key_rows or PageRows(num_blocks)
  value_rows = value_rows or PageRows(num_blocks)
  stacked = key_rows == value_rows == PageRows(num_blocks)
  views = []
  for cache in (key_cache, key_cache if value_cache is None else value_cache):
    # Stacked: a row per (layer, block); else a row per page of one plane (MAX collection).
    view = cache.reshape((cache.shape[0] * num_blocks, -1) if stacked
                         else (-1, bs * num_heads * head_size))
    views.append(lax.bitcast_convert_type(view, jnp.uint8) if fnuz or fp8 else view)
  if fmt.quant in ("token", "block"):
    k_scale, v_scale = k_scale.reshape(-1), v_scale.reshape(-1)
  zeros = jnp.zeros((num_q_heads,), jnp.float32)
  operands = (kv_lens, block_tables, jnp.asarray(layer, jnp.int32).reshape(1),
              query.reshape(num_rows * num_q_heads, head_size), k_scale, v_scale,
              zeros if alibi_slopes is None else alibi_slopes,
              zeros if sinks is None else sinks, *views)
  kernel = functools.partial(
      _kernel, fmt=fmt, key_plane=key_plane, value_plane=value_plane, key_rows=key_rows,
      value_rows=value_rows, num_blocks=num_blocks, num_q_heads=num_q_heads,
      # a chunk per head-dim scale group of a MAX collection (one chunk otherwise)
      head_chunks=common.chunks(*[head_size // fmt.scale_groups] * fmt.scale_groups),
      group=group, num_rows=num_rows, scale=scale, logits_soft_cap=logits_soft_cap,
      sliding_window=sliding_window, use_alibi=alibi_slopes is not None,
      use_sinks=sinks is not None, fnuz=fnuz, fp8=fp8,
      compute_dtype=common.compute_dtype_of(query.dtype, key_cache.dtype))

  def tile_pages_of(tokens):
    return max(-(-16 // bs), min(common.next_pow2(width), max(1, tokens // bs)))

  short_r = short_rows(group)
  short_q = max(1, short_r // group)
  for name, value in (("prefill_lowering", prefill_lowering),
                      ("decode_lowering", decode_lowering)):
    if value not in ("triton", "mosaic"):
      raise ValueError(f"{name} must be 'triton' or 'mosaic', got {value!r}")
  mosaic = prefill_lowering == "mosaic"
  mosaic_decode = decode_lowering == "mosaic"
  if (mosaic or mosaic_decode) and one_launch:
    raise ValueError("one_launch runs both kinds of program on Triton; a Mosaic GPU "
                     "lowering takes a launch per kind")
  long_r = long_rows(group, long_block_rows)
  long_q = mosaic_ragged.TILE_Q if mosaic else max(1, long_r // group)
  short, long = work_lists(cu_q_lens, kv_lens, num_seqs, num_rows, short_q, long_q)
  num_long = 0 if num_rows <= short_q else long[0].shape[0]   # no sequence can be long

  short_pages = tile_pages_of(short_tile_tokens * (2 if value_plane.tokens_fastest else 1))
  splits = num_splits or default_splits(num_slots, num_heads, width, bs, short_pages,
                                        2048 if one_byte else 1024)
  pages_per_split = -(-(-(-width // splits)) // short_pages) * short_pages
  splits = -(-width // pages_per_split)
  stages = num_stages or (3 if one_byte or value_plane.tokens_fastest else 2)

  def launch(work, out, *, num_long, num_short, long_tokens):
    """One pallas_call over ``num_long`` long items then ``num_short`` short items' splits;
    ``out`` (aliased) receives the long items' rows."""
    long_pages = tile_pages_of(long_tokens)
    partial_rows = max(num_short * num_heads * splits, 1)
    return lowering.call_in_place(
        functools.partial(
            kernel, num_long=num_long, num_short=num_short, num_splits=splits,
            long=dict(block_q=long_q, rows=long_r, tile_pages=long_pages,
                      pages_per_split=-(-width // long_pages) * long_pages),
            short=dict(block_q=short_q, rows=short_r, tile_pages=short_pages,
                       pages_per_split=pages_per_split)),
        (*work, *operands), (out,), grid=(num_long + num_short * splits, num_heads),
        interpret=interpret, num_warps=num_warps, num_stages=stages,
        name="jkv_ragged_paged_attention",
        new_outputs=(jax.ShapeDtypeStruct((partial_rows, short_r, head_size), jnp.float32),
                     jax.ShapeDtypeStruct((partial_rows, short_r), jnp.float32),
                     jax.ShapeDtypeStruct((partial_rows, short_r), jnp.float32)))

  # Tuned on an H100 / H200 (benchmarks/NOTES_ragged.md): 128-row prefill tiles, 4 warps;
  # 3 stages for 1-byte caches and vLLM / ASM values, 2 otherwise, as in decode attention.
  # Two launches by default: in one, the kernel takes the prefill path's registers (255,
  # two programs per SM) and its decode programs slow down (H200, one run: 64 x 2K 163 us
  # in one launch, 122 in two, 124 for paged_attention_decode; the mixed step 502 vs 458;
  # the prefill 3110 us in two launches with 64-token K/V tiles). One launch keeps 32-token
  # prefill tiles (64 ran 4-15% faster there but slowed the decodes further).
  out = jnp.zeros((num_rows * num_q_heads, head_size), out_dtype)
  if one_launch:
    work = [jnp.concatenate([a, b]) for a, b in zip(long, short)] if num_long else list(short)
    out, acc, running_max, running_sum = launch(work, out, num_long=num_long,
                                                num_short=num_slots,
                                                long_tokens=long_tile_tokens or 32)
  else:
    if num_long and mosaic:
      prefill_rows = mosaic_ragged.prefill(
          mosaic_query, key_cache, value_cache, mosaic_k_scale, mosaic_v_scale, layer,
          block_tables, kv_lens, long,
          key_plane=key_plane, value_plane=value_plane, num_blocks=num_blocks, scale=scale,
          interpret=interpret, stages=num_stages or 2)
    elif num_long:
      out = launch(list(long), out, num_long=num_long, num_short=0,
                   long_tokens=long_tile_tokens or 64)[0]
    if mosaic_decode:
      acc, running_max, running_sum = mosaic_attention.ragged_partials(
          mosaic_query, key_cache, value_cache, mosaic_k_scale, mosaic_v_scale, layer,
          block_tables, kv_lens, short, q_tokens=short_q, key_plane=key_plane,
          value_plane=value_plane, num_blocks=num_blocks, scale=scale, interpret=interpret,
          num_splits=num_splits)
    else:
      out, acc, running_max, running_sum = launch(list(short), out, num_long=0,
                                                  num_short=num_slots, long_tokens=16)
  # Combine the short items' splits and place their rows: row t of sequence s, head h <-
  # combined[s, h // G, j * G + h % G].
  short_r = acc.shape[1]   # the Mosaic kernel's rows: G * short_q in whole 8-row tiles
  shape = (num_slots, num_heads, acc.shape[0] // (num_slots * num_heads), short_r)
  running_max = running_max.reshape(shape)
  peak = jnp.max(running_max, axis=2)                              # [S, H, rows]
  if sinks is not None:
    head = jnp.arange(short_r) % group
    sink = sinks.reshape(num_heads, group)[:, head][None]          # [1, H, rows]
    peak = jnp.maximum(peak, sink)
  # At most 0; clamped because a row that sees no key has max -1e30 in every split, and
  # XLA may fuse the Mosaic partials' base-2 -> natural conversion into this subtraction as
  # one FMA (unrounded product minus rounded peak: +1e22, exp inf, 0 * inf NaN).
  weight = jnp.exp(jnp.minimum(running_max - peak[:, :, None], 0.0))
  total = jnp.sum(running_sum.reshape(shape) * weight, axis=2)
  if sinks is not None:
    total = total + jnp.exp(sink - peak)
  combined = jnp.sum(acc.reshape(shape + (head_size,)) * weight[..., None], axis=2)
  combined = combined / (total[..., None] + 1e-6)                  # [S, H, rows, D]
  rows_ = jnp.arange(num_rows, dtype=jnp.int32)
  active = jnp.arange(num_slots, dtype=jnp.int32) < num_seqs     # entries past num_seqs: any
  seq_of_row = jnp.minimum(
      jnp.sum((cu_q_lens[1:][None, :] <= rows_[:, None]) & active[None, :], axis=1),
      num_slots - 1)
  j = rows_ - cu_q_lens[seq_of_row]
  short_row = ((j >= 0) & (j < short[2][seq_of_row]) & (seq_of_row < num_seqs)
               & (rows_ < cu_q_lens[jnp.clip(num_seqs, 0, num_slots)]))
  heads = jnp.arange(num_q_heads)
  picked = combined[seq_of_row[:, None], (heads // group)[None, :],
                    jnp.clip(j, 0, short_q - 1)[:, None] * group + (heads % group)[None, :]]
  out = out.reshape(num_rows, num_q_heads, head_size)
  if num_long and mosaic:   # the long items' rows from [N, Hq, TILE_Q, D]
    _, long_row0, owned, _ = long
    item = jnp.sum((long_row0[None, :] <= rows_[:, None]) & (owned > 0)[None, :], axis=1) - 1
    item = jnp.maximum(item, 0)
    offset = rows_ - long_row0[item]
    long_row = (offset >= 0) & (offset < owned[item])
    gathered = prefill_rows[item[:, None], heads[None, :],
                            jnp.clip(offset, 0, long_q - 1)[:, None]]
    out = jnp.where(long_row[:, None, None], gathered, out)
  return jnp.where(short_row[:, None, None], picked.astype(out_dtype), out)
