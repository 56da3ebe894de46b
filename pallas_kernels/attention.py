"""Paged decode attention kernel (split over the context, then a small combine in XLA).

Grid ``(num_seqs, num_kv_heads, num_splits)``. A program takes the ``G = Hq / Hkv`` query
heads that share its KV head (padded to at least 16 rows for the tensor cores) and walks
its share of the sequence's pages in tiles of ``pages_per_tile`` pages: it gathers the
tile's K and V through the block table (any layout: the element offsets come from
:class:`jkv.layout.Plane`), dequantizes by scaling the logits (K scales) and the
probabilities (V scales), and keeps a running max / sum / accumulator (online softmax) in
float32. It writes its partial ``(acc, max, sum)``; :func:`paged_attention_decode`
combines the splits. Positions outside ``[max(0, L - W), L)`` and blocks outside the
cache are masked on load, so NaN in unused entries never reaches the output. MLA's
``fp8_split`` entries scale the logits and probabilities by their per-entry scale;
``fp8_ds_mla`` entries (bytes) give their FP8 content per 128-value tile (a dot each,
scaled by the tile's float32 scale) and their bf16 RoPE part; the scales and the RoPE
part are each one contiguous byte load, put together by shifts. vLLM / ASM values
(tokens fastest in a block) are loaded per page, so the loads along tokens vectorize; their
x-vectorized keys ([D/x, bs, x] per head) are loaded per page in memory order and permuted
in registers, so neighbouring lanes read neighbouring bytes.
A bf16 query meets a per-tensor FP8 cache in f16, scaled per program by a power of two
(:func:`common.f16_query_tiles`).
FP4 caches have no kernel (they are read through the reference).
Semantics: :mod:`jkv.reference.attention`.
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
from jkv.formats import DS_MLA_TILE, FLT_MIN
from pallas_kernels import common, lowering

_NEG = -1e30   # the running max starts here: finite, so fully masked tiles stay NaN-free


def _kernel(block_tables_ref,   # int32 [B, W]
            seq_lens_ref,       # int32 [B]
            layer_ref,          # int32 [1]
            query_ref,          # [B, Hq, D]
            k_scale_ref,        # float32 [H] (tensor), flat token / block / fp8_split
            v_scale_ref,        # entry scales, or [1] unused
            alibi_ref,          # float32 [Hq], or None (no ALiBi)
            k_ref,              # [rows, page elems]: the key plane (FP8 as bytes)
            v_ref,              # [rows, page elems]: the value plane (or the RoPE part)
            acc_ref,            # out float32 [B * H * splits, G, Dv]: unnormalized output
            max_ref,            # out float32 [B * H * splits, G]: running max per row
            sum_ref,            # out float32 [B * H * splits, G]: softmax denominator
            *, fmt, key_plane, value_plane, key_rows, value_rows, key_chunks, value_chunks,
            num_blocks, num_heads,
            group, group_rows, head_blocks, tile_pages, pages_per_split, scale,
            logits_soft_cap, sliding_window, fnuz, fp8, compute_dtype, f16_query=False,
            f16_latent=False, rope_plane=None, ds_mla_rank=None, transposed_values=False):
  """Program (sequence b, KV head x head block, context split): ``group_rows`` query
  heads of one KV head over the split's pages, ``tile_pages`` pages per K/V tile gathered
  through the block table, online softmax in float32; writes the split's partial
  (acc, max, sum), combined over splits in XLA. Positions outside the window, at or past
  the sequence length and in blocks outside the cache are masked on load. ``f16_latent``
  (a bf16 query, an fp8_ds_mla cache): the FP8 content meets the query in f16 (scaled by a
  power of two, as ``f16_query``) and the probabilities times the tile scales in f16
  (divided per tile by its largest scale); the RoPE part meets its query in bf16."""
  b, split = pl.program_id(0), pl.program_id(2)
  kvh, head_block = pl.program_id(1) // head_blocks, pl.program_id(1) % head_blocks
  bs = key_plane.block_size
  tile = tile_pages * bs
  length = seq_lens_ref[b]
  layer = layer_ref[0]
  start = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)

  rows_g = head_block * group_rows + lax.iota(jnp.int32, group_rows)
  g_ok = rows_g < group
  q_heads = kvh * group + jnp.where(g_ok, rows_g, 0)

  def columns(chunk):
    """(clamped, raw, mask or None) dims of a (start, size, padded) chunk."""
    first, size, padded = chunk
    clamped, raw, ok = lowering.padded_columns(size, padded)
    return first + clamped, first + raw, ok

  def both(rows_ok, cols_ok):
    """A [rows, cols] mask from a row mask and an optional column mask."""
    if cols_ok is None:
      return rows_ok[:, None]
    return rows_ok[:, None] & cols_ok[None, :]

  def query_chunk(chunk):
    d, _, d_ok = columns(chunk)
    shape = (group_rows, chunk[2])
    q = lowering.load(query_ref.at[jnp.broadcast_to(b, shape),
                                   jnp.broadcast_to(q_heads[:, None], shape),
                                   jnp.broadcast_to(d[None, :], shape)],
                      mask=jnp.broadcast_to(both(g_ok, d_ok), shape), other=0)
    return q.astype(jnp.float32 if f16_query or f16_latent else compute_dtype)

  queries = [query_chunk(chunk) for chunk in key_chunks]
  if fmt.quant == "tensor":
    k_factor, v_factor = k_scale_ref[kvh], v_scale_ref[kvh]
  if f16_query:   # a bf16 query against FP8 keys: f16 after a power of two
    queries, query_factor = common.f16_query_tiles(queries)
    k_factor = k_factor * query_factor
  rope_dtype = compute_dtype
  if f16_latent:   # the content chunks' query in f16 (scaled), the RoPE chunk's in bf16
    content_queries, content_factor = common.f16_query_tiles(queries[:-1])
    queries = content_queries + [queries[-1].astype(jnp.bfloat16)]
    rope_dtype = jnp.bfloat16
  slopes = None
  if alibi_ref is not None:
    slopes = lowering.load(alibi_ref.at[q_heads], mask=g_ok, other=0.0)

  t = lax.iota(jnp.int32, tile)
  offset = t % bs
  # Logits [group_rows, tile], or [tile, group_rows] with transposed values (the keys
  # and values then are the dots' left operands, kept in registers; the wrapper turns
  # them on only for the plain path: fp8_split / ds_mla compute [group_rows, tile]).
  token_axis = 0 if transposed_values else 1

  def per_token(vector):   # [tile] against the logits
    return vector[:, None] if transposed_values else vector[None, :]

  def per_row(vector):     # [group_rows] against the logits
    return vector[None, :] if transposed_values else vector[:, None]

  token_minor_values = value_plane.tokens_fastest
  # vLLM / ASM keys: whole x-vectors per chunk (plain caches; the MLA formats are NHD).
  x_vectorized_keys = (key_plane.kind == "KX" and rope_plane is None and ds_mla_rank is None
                       and all(first % key_plane.x == 0 and size == padded
                               and size % key_plane.x == 0
                               for first, size, padded in key_chunks))
  k_tokens = key_plane.token_offset(offset)[:, None]
  v_tokens = value_plane.token_offset(offset)[:, None]

  first_page = split * pages_per_split
  used_pages = (length + bs - 1) // bs
  end_page = jnp.minimum(first_page + pages_per_split, used_pages)
  begin_page = jnp.maximum(first_page, start // bs)
  num_tiles = jnp.maximum(end_page - begin_page + tile_pages - 1, 0) // tile_pages

  def load_chunk(ref, plane, tokens, row, ok, chunk, stored_fp8=True):
    d, _, d_ok = columns(chunk)
    shape = (tile, chunk[2])
    x = lowering.load(ref.at[jnp.broadcast_to(row, shape),
                             tokens + plane.elem_offset(kvh, d)[None, :]],
                      mask=jnp.broadcast_to(both(ok, d_ok), shape), other=0)
    return stored_value(x, stored_fp8)

  def load_token_minor(ref, plane, page_row, page_ok, ok, chunk):
    """[tile, chunk] of a plane whose fastest dim is the token (vLLM / ASM values),
    loaded as [pages, bs, chunk]: the row is one per page, so Triton sees the addresses
    along a page's tokens as contiguous and vectorizes the loads. The load is masked per
    page (a per-token mask would stop the vectorizing); tokens outside ``ok`` (past the
    length: possibly NaN) are zeroed after it. ``transposed_values``: [chunk, tile],
    loaded as [chunk, pages, bs] (the tokens fastest, as in memory)."""
    d, _, d_ok = columns(chunk)
    tokens = plane.token_offset(lax.iota(jnp.int32, bs))
    elems = plane.elem_offset(kvh, d)
    if transposed_values:
      shape = (chunk[2], tile_pages, bs)
      index = elems[:, None, None] + tokens[None, None, :]
      rows = page_row[None, :, None]
      mask = page_ok[None, :, None]
      if d_ok is not None:
        mask = mask & d_ok[:, None, None]
    else:
      shape = (tile_pages, bs, chunk[2])
      index = tokens[None, :, None] + elems[None, None, :]
      rows = page_row[:, None, None]
      mask = page_ok[:, None, None] if d_ok is None else page_ok[:, None, None] & d_ok
    x = lowering.load(ref.at[jnp.broadcast_to(rows, shape), jnp.broadcast_to(index, shape)],
                      mask=jnp.broadcast_to(mask, shape), other=0)
    if transposed_values:
      return jnp.where(ok[None, :], stored_value(x.reshape(chunk[2], tile)), 0)
    return jnp.where(ok[:, None], stored_value(x.reshape(tile, chunk[2])), 0)

  def load_x_vectorized(ref, plane, page_row, page_ok, ok, chunk):
    """[tile, chunk] of an x-vectorized key plane (vLLM / ASM keys, [H, D/x, bs, x] per
    block), loaded per page in memory order [pages, D/x, bs, x]: a page's part of the
    chunk is one contiguous run, so neighbouring lanes read neighbouring bytes (a per-token
    [tile, D] load used half of each 32-byte sector), then permuted to [pages, bs, D/x, x]
    = [tile, chunk]. Masked per page; tokens outside ``ok`` are zeroed after the load."""
    first, size, _ = chunk
    x = plane.x
    shape = (tile_pages, size // x, bs, x)
    index = (plane.elem_offset(kvh, first + x * lax.iota(jnp.int32, size // x))[:, None, None]
             + plane.token_offset(lax.iota(jnp.int32, bs))[None, :, None]
             + lax.iota(jnp.int32, x)[None, None, :])[None]
    x_data = lowering.load(ref.at[jnp.broadcast_to(page_row[:, None, None, None], shape),
                                  jnp.broadcast_to(index, shape)],
                           mask=jnp.broadcast_to(page_ok[:, None, None, None], shape), other=0)
    if size > x:
      x_data = x_data.transpose(0, 2, 1, 3)
    x_data = x_data.reshape(tile, size)
    return jnp.where(ok[:, None], stored_value(x_data), 0)

  def stored_value(x, stored_fp8=True):
    """Loaded cache elements -> compute_dtype."""
    if fnuz and stored_fp8:
      x = quant.e4m3fnuz_value(x)
    elif fp8 is not None and stored_fp8:   # FP8 read as bytes (Triton has no FP8 fill value)
      x = lax.bitcast_convert_type(x, fp8)
    return x.astype(compute_dtype)

  if rope_plane is not None:   # fp8_split MLA: the rope part from v_ref, its own columns
    r_tokens = rope_plane.token_offset(offset)[:, None]
    rope_chunk = (0,) + key_chunks[1][1:]

  def load_uints(row, ok, first_byte, count, padded, width):
    """fp8_ds_mla: ``count`` little-endian unsigned ints of ``width`` bytes from entry byte
    ``first_byte`` on, uint32 [tile, padded] (a power of two; padding lanes 0): one
    contiguous byte load (vectorized), then each int's bytes shifted into place (Triton
    bitcasts only between types of one width)."""
    lanes, _, lanes_ok = lowering.padded_columns(count * width, padded * width)
    shape = (tile, lanes.shape[0])
    mask = ok[:, None] if lanes_ok is None else ok[:, None] & lanes_ok[None, :]
    byte_columns = k_tokens + key_plane.elem_offset(kvh, first_byte + lanes)[None, :]
    data = lowering.load(k_ref.at[jnp.broadcast_to(row, shape), byte_columns],
                         mask=jnp.broadcast_to(mask, shape), other=0)
    data = data.astype(jnp.uint32).reshape(tile, lanes.shape[0] // width, width)
    shift = (8 * lax.iota(jnp.int32, width)).astype(jnp.uint32)
    return jnp.sum(data << shift[None, None, :], axis=2)

  def load_ds_mla(row, ok):
    """fp8_ds_mla entries: (logits [group_rows, tile] unscaled, the FP8 content chunks
    [tile, 128] and their tile scales [tile] as the values and value scales)."""
    tiles = len(value_chunks)
    scales = lax.bitcast_convert_type(
        load_uints(row, ok, ds_mla_rank, tiles, common.next_pow2(tiles), 4), jnp.float32)
    scale_lane = lax.iota(jnp.int32, scales.shape[1])[None, :]
    contents, tile_scales, logits = [], [], None
    for j in range(tiles):
      content = load_chunk(k_ref, key_plane, k_tokens, row, ok, key_chunks[j])
      tile_scale = jnp.sum(jnp.where(scale_lane == j, scales, 0.0), axis=1)
      key_scale = tile_scale * content_factor if f16_latent else tile_scale
      part = lowering.dot(queries[j], content, trans_b=True) * key_scale[None, :]
      logits = part if logits is None else logits + part
      contents.append(content)
      tile_scales.append(tile_scale)
    pe_size, pe_padded = key_chunks[tiles][1:]
    pe_bits = load_uints(row, ok, ds_mla_rank + 4 * tiles, pe_size, pe_padded,
                         2).astype(jnp.uint16)
    rope = lax.bitcast_convert_type(pe_bits, jnp.bfloat16)   # [tile, pe_padded], padding 0
    logits = logits + lowering.dot(queries[tiles], rope.astype(rope_dtype), trans_b=True)
    return logits, contents, tile_scales

  def body(i, carry):
    accs, running_max, running_sum = carry
    page = begin_page + i * tile_pages + t // bs
    pos = page * bs + offset
    page_ok = page < end_page
    block = lowering.load(block_tables_ref.at[jnp.broadcast_to(b, (tile,)),
                                              jnp.where(page_ok, page, 0)],
                          mask=page_ok, other=-1)
    ok = page_ok & (pos < length) & (pos >= start) & (block >= 0) & (block < num_blocks)
    safe_block = jnp.where(ok, block, 0)
    row = key_rows.row(layer, safe_block)[:, None]
    value_row = value_rows.row(layer, safe_block)[:, None]
    if token_minor_values or x_vectorized_keys:   # the same pages, one entry per page
      pages = begin_page + i * tile_pages + lax.iota(jnp.int32, tile_pages)
      page_block = lowering.load(block_tables_ref.at[jnp.broadcast_to(b, (tile_pages,)),
                                                     jnp.where(pages < end_page, pages, 0)],
                                 mask=pages < end_page, other=-1)
      page_ok = (pages < end_page) & (page_block >= 0) & (page_block < num_blocks)
      page_block = jnp.where(page_ok, page_block, 0)
    value_scales = None   # ds_mla / MAX groups: per-token scales [tile], one per value chunk
    key_scales = None     # MAX groups: per-token scales [tile], one per key chunk
    if fmt.scale_collection:   # [rows, bs, H, G], through the page rows
      key_scales, value_scales = (
          common.group_scales(k_scale_ref, page_rows, layer, safe_block, offset, num_heads,
                              kvh, fmt.scale_groups, bs, ok)
          for page_rows in (key_rows, value_rows))
    if ds_mla_rank is not None:
      logits, values, value_scales = load_ds_mla(row, ok)
    elif rope_plane is not None:   # logits = (q_c . content) * entry scale + q_pe . rope
      content = load_chunk(k_ref, key_plane, k_tokens, row, ok, key_chunks[0])
      rope = load_chunk(v_ref, rope_plane, r_tokens, value_row, ok, rope_chunk,
                        stored_fp8=False)
      index = ((layer * num_blocks + safe_block) * bs + offset) * num_heads + kvh
      entry_scale = lowering.load(k_scale_ref.at[index], mask=ok, other=0.0)
      logits = (lowering.dot(queries[0], content, trans_b=True) * entry_scale[None, :]
                + lowering.dot(queries[1], rope, trans_b=True))
      values = [content]
    else:
      if x_vectorized_keys:
        key_page_row = key_rows.row(layer, page_block)
        keys = [load_x_vectorized(k_ref, key_plane, key_page_row, page_ok, ok, chunk)
                for chunk in key_chunks]
      else:
        keys = [load_chunk(k_ref, key_plane, k_tokens, row, ok, chunk) for chunk in key_chunks]
      logits = None
      for j, (q, k) in enumerate(zip(queries, keys)):
        part = lowering.dot(k, q, trans_b=True) if transposed_values else lowering.dot(
            q, k, trans_b=True)
        if key_scales is not None:
          part = part * per_token(key_scales[j])
        logits = part if logits is None else logits + part
      if token_minor_values:
        page_row = value_rows.row(layer, page_block)
        values = [load_token_minor(v_ref, value_plane, page_row, page_ok, ok, chunk)
                  for chunk in value_chunks]
      else:
        values = [load_chunk(v_ref, value_plane, v_tokens, value_row, ok, chunk)
                  for chunk in value_chunks]
    k_tok = v_tok = None
    if rope_plane is not None:
      v_tok = entry_scale
    elif fmt.quant == "token" and not fmt.scale_collection:
      index = ((layer * num_blocks + safe_block) * num_heads + kvh) * bs + offset
      k_tok = lowering.load(k_scale_ref.at[index], mask=ok, other=0.0)
      v_tok = lowering.load(v_scale_ref.at[index], mask=ok, other=0.0)
    elif fmt.quant == "block":
      units = num_blocks * bs // fmt.scale_block_tokens
      unit = (safe_block * bs + offset) // fmt.scale_block_tokens
      index = (layer * units + unit) * num_heads + kvh
      k_tok = lowering.load(k_scale_ref.at[index], mask=ok, other=0.0)
      v_tok = lowering.load(v_scale_ref.at[index], mask=ok, other=0.0)
    logits = logits * scale
    if fmt.quant == "tensor":
      logits = logits * k_factor
    elif k_tok is not None:
      logits = logits * per_token(k_tok)
    if logits_soft_cap is not None:
      logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    if slopes is not None:
      logits = logits + per_row(slopes) * per_token((pos - length + 1).astype(jnp.float32))
    logits = jnp.where(per_token(ok), logits, -jnp.inf)
    new_max = jnp.maximum(running_max, jnp.max(logits, axis=token_axis))
    alpha = jnp.exp(running_max - new_max)
    p = jnp.exp(logits - per_row(new_max))
    running_sum = running_sum * alpha + jnp.sum(p, axis=token_axis)
    if v_tok is not None:
      p = p * per_token(v_tok)

    def weighted(v, v_scale):
      """This tile's contribution to a value chunk's accumulator."""
      if v_scale is None:
        w, top = p, None
      elif f16_latent:   # w <= 1 in f16 whatever the scales; the tile's largest scale after
        top = jnp.maximum(jnp.max(v_scale), FLT_MIN)
        w = p * per_token(v_scale * (1.0 / top))
      else:
        w, top = p * per_token(v_scale), None
      w = w.astype(compute_dtype)
      # acc^T [chunk, rows] += v^T [chunk, tile] . p^T [tile, rows]
      part = lowering.dot(v, w) if transposed_values else lowering.dot(w, v)
      return part if top is None else part * top

    value_scales = value_scales or [None] * len(values)
    row_alpha = alpha[None, :] if transposed_values else alpha[:, None]
    accs = tuple(acc * row_alpha + weighted(v, v_scale)
                 for acc, v, v_scale in zip(accs, values, value_scales))
    return accs, new_max, running_sum

  acc_shape = (lambda chunk: (chunk[2], group_rows)) if transposed_values else (
      lambda chunk: (group_rows, chunk[2]))
  carry = (tuple(jnp.zeros(acc_shape(chunk), jnp.float32) for chunk in value_chunks),
           jnp.full((group_rows,), _NEG, jnp.float32), jnp.zeros((group_rows,), jnp.float32))
  accs, running_max, running_sum = lax.fori_loop(0, num_tiles, body, carry)
  if transposed_values:
    accs = tuple(acc.T for acc in accs)
  out_rows = (b * num_heads + kvh) * pl.num_programs(2) + split
  # Masked lanes (padding rows / dims) index past the outputs: the interpreter drops them,
  # the GPU never touches them.
  for acc, chunk in zip(accs, value_chunks):
    if fmt.quant == "tensor":
      acc = acc * v_factor
    _, lanes, d_ok = columns(chunk)
    full = (group_rows, chunk[2])
    lowering.store(acc_ref.at[jnp.broadcast_to(out_rows, full),
                              jnp.broadcast_to(rows_g[:, None], full),
                              jnp.broadcast_to(lanes[None, :], full)],
                   acc, mask=jnp.broadcast_to(both(g_ok, d_ok), full))
  vec_rows = jnp.broadcast_to(out_rows, (group_rows,))
  lowering.store(max_ref.at[vec_rows, rows_g], running_max, mask=g_ok)
  lowering.store(sum_ref.at[vec_rows, rows_g], running_sum, mask=g_ok)


def supports(block_size: int) -> bool:
  """Whether the kernel handles this block size (tiles must be powers of two)."""
  return block_size == common.next_pow2(block_size)


def default_tiling(num_seqs: int, num_kv_heads: int, width: int, block_size: int,
                   tile_tokens: int = 64, target_programs: int = 1024) -> tuple[int, int]:
  """(pages_per_tile, num_splits): tiles of about ``tile_tokens`` tokens (at least 16),
  and enough context splits that ``num_seqs * num_kv_heads * num_splits`` reaches about
  ``target_programs``."""
  tile_pages = max(-(-16 // block_size),
                   min(common.next_pow2(width), max(1, tile_tokens // block_size)))
  tiles = -(-width // tile_pages)
  splits = max(1, min(tiles, -(-target_programs // (num_seqs * num_kv_heads))))
  return tile_pages, splits


def paged_attention_decode(fmt, query, key_cache, value_cache, k_scale, v_scale, layer,
                           block_tables, seq_lens, *, key_plane: Plane, value_plane: Plane,
                           num_blocks: int, scale: float, alibi_slopes, logits_soft_cap,
                           sliding_window, interpret: bool, value_dim: int | None = None,
                           tile_pages: int | None = None, num_splits: int | None = None,
                           max_group_rows: int | None = None, num_warps: int = 4,
                           num_stages: int | None = None, combine_axes=None,
                           rope_plane: Plane | None = None, ds_mla: bool = False,
                           key_rows: PageRows | None = None,
                           value_rows: PageRows | None = None,
                           key_chunk: int | None = None,
                           transposed_values: bool | None = None):
  """Decode attention over one layer of stacked caches (see :mod:`jkv.ops.attention`).

  query [B, Hq, D]; key_cache / value_cache [L, ...] in the planes' layout (value_cache
  None: K and V share key_cache); k_scale / v_scale: float32 [H] or [1] (``tensor``),
  [L, nb, H, bs] (``token``) or [L, units, H] (``block``); layer int32 scalar.
  ``rope_plane`` (the fp8_split MLA cache): key_cache is the FP8 content [L, nb, bs, (H,)
  Dv] (key_plane), value_cache the bf16 RoPE part [L, nb, bs, (H,) D - Dv] (rope_plane),
  k_scale the float32 per-entry scales [L, nb, bs, (H,)]; keys are
  ``[content * scale | rope]`` and values ``content * scale`` (needs ``value_dim``).
  ``ds_mla`` (vLLM's fp8_ds_mla cache): key_cache uint8 [L, nb, bs, E] of
  :func:`jkv.reference.mla.ds_mla_entries` (key_plane NHD, one head of E byte columns),
  value_dim the rank R: keys ``[kv_c | k_pe]`` and values ``kv_c``, each 128-value tile of
  kv_c scaled by its float32 scale (on the logits and the probabilities), k_pe bf16.
  value_dim: None (values are [D] like keys), or Dv < D: values are the first Dv columns of
  the key entries (MLA's latent cache: keys ``[kv_c | k_pe]``, values ``kv_c``; the key dims
  are then two chunks, Dv and D - Dv). tile_pages / num_splits: None picks
  :func:`default_tiling`. max_group_rows: query heads per program (a power of two >= 16;
  a KV head's group of query heads is split over programs beyond it; default 64, 16 with
  ``value_dim``). num_warps / num_stages: Triton's (stages None: tuned default).
  key_chunk: x-vectorized keys (vLLM / ASM) are read in chunks of this many head dims
  (head_size: one chunk, permuted in registers); a chunk of whole x-vectors and at least
  16 dims is loaded per page, a smaller one through the per-token loads. Default: 16 (one
  x-vector) for one-byte caches, head_size otherwise. transposed_values: values whose
  tokens are fastest (vLLM / ASM) are loaded as [D, tile], as in memory, the logits are
  computed transposed (``logits^T = k . q^T``, [tile, rows]) and the output accumulated as
  ``acc^T += v^T . p^T``, so the tiles of K and V are the dots' left operands (registers)
  and the small query / probability tiles the right ones; default: for one-byte caches.
  combine_axes: None, or the mesh axes of block shards (inside a partitioned call): the
  softmax partials are combined over them (collectives of [B, Hq, Dv]). Returns
  [B, Hq, Dv] in the query's dtype. key_rows / value_rows: where each (layer, block)'s
  page lies in the caches viewed as ``[rows, page_elems]`` (one page of the plane); None:
  stacked caches ``[L, nb, ...]`` (the MAX collection ``[nb, 2, L, bs, H, D]`` passes
  itself as both caches with :func:`jkv.layout.max_rows`). Token / block scales are
  stacked ([L, nb, ...]), except a per-token quantized MAX collection's (``fmt.layout``
  "max"): its scale collection ``[nb, 2, L, bs, H, G]`` (as both k_scale and v_scale) is
  addressed through key_rows / value_rows, and each of the G head-dim groups is a key /
  value chunk of its own, its logits and probabilities scaled by the group's scale.
  """
  batch, num_q_heads, head_size = query.shape
  num_heads = key_plane.num_heads
  group = num_q_heads // num_heads
  width = block_tables.shape[1]
  latent = value_dim is not None
  max_group_rows = max_group_rows or (16 if latent else 64)
  group_rows = min(max(16, common.next_pow2(group)), max_group_rows)
  head_blocks = -(-group // group_rows)
  # Tuned on an H200 (benchmarks/RESULTS.md, "Decode attention"): 64-token tiles (32 for
  # MLA's 576-wide entries), ~1024 programs (2048 for 1-byte caches), 3 pipeline stages
  # for MLA and 1-byte caches, 2 otherwise. vLLM / ASM value layouts (tokens fastest):
  # 128-token tiles and 3 stages (H100, 8 x 32K: bf16 490 vs 601 us with 64-token tiles,
  # FP8 600 vs 821 us). The fp8_split MLA cache (FP8 content + bf16 RoPE part): 2 stages
  # (H100, 64 x 8K, 16 heads: 280 vs 312 us with 3; ncu: 255 registers, 12.5% occupancy).
  # Both FP8 MLA caches: ~256 programs (two per SM at that occupancy), and fp8_ds_mla
  # 64-token tiles (H100 2026-11-28, 64 x 8K, 16 heads, profiler: fp8_split 293 us with
  # 16 splits, 282 with 8, 276 with 4; fp8_ds_mla 383 -> 352 us with 4 splits, 339 with 4
  # splits and 64-token tiles; 8 warps or 1 stage were slower in both). One-byte vLLM / ASM
  # caches: ~512 programs (H200 2026-11-28, f16 queries, profiler: 8 x 32K FP8 vllm 317 us
  # with 32 splits, 300 with 8; 64 x 2K 179 us with 4 splits, 159 with 1; int8 per-token
  # vllm and per-block asm 2% faster at 8 x 32K, 7% at 64 x 2K).
  one_byte = np.dtype(key_cache.dtype).itemsize == 1
  token_minor = value_plane.tokens_fastest
  if fmt.quant == "tensor":
    k_scale, v_scale = common.head_scales(k_scale, v_scale, num_heads)
  # The vLLM / ASM read variants, timed by ``--sweep`` (H100, 8 x 32K, 32/8 heads, d128):
  # FP8 vllm 541 us with one key chunk and [tile, D] values, 352 us with 16-dim chunks
  # and transposed values; FP8 asm 587 -> 501 us with 16-dim chunks; bf16 vllm fastest
  # with one chunk and [tile, D] values (448 us; 590 with 16-dim chunks). Transposed
  # logits too (2026-11-27, H100): FP8 asm 505 -> 453 us, int8 per-block asm 491 -> 411
  # (both before the ASM value plane's one-group offsets: 355 / 360 us),
  # int8 per-token vllm 366 -> 356, FP8 vllm 353 -> 353. Transposed logits alone, over
  # [tile, D] values (a transposed left operand in the value dot), were slower: FP8 hnd
  # 247 -> 375 us, int8 per-token hnd 276 -> 359, bf16 MLA 64 x 8K 252 -> 276.
  if key_chunk is None:
    key_chunk = 16 if one_byte else head_size
  if transposed_values is None:
    transposed_values = one_byte
  # 16-bit token-minor values (bf16 vLLM / ASM): one stage. Their x-vectorized keys load
  # 16 bytes a lane since 15ad8e2, so Triton pipelines them: 3 stages cost 74 KB of shared
  # memory a program (H200, 8 x 32K: vllm 495 us, asm 578; 2 stages alike; 1 stage 335 and
  # 341; flash the same at 1, 2 or 3; FP8 vllm 300 at 2 or 3, 351 at 1).
  num_stages = num_stages or (2 if rope_plane is not None else
                              1 if token_minor and not one_byte else
                              3 if latent or one_byte or token_minor else 2)
  fp8_latent = rope_plane is not None or ds_mla
  default_pages, default_splits = default_tiling(
      batch, num_heads * head_blocks, width, key_plane.block_size,
      64 if ds_mla else 32 if latent else 128 if token_minor else 64,
      256 if fp8_latent else 512 if one_byte and token_minor else
      2048 if one_byte and not latent else 1024)
  tile_pages = tile_pages or default_pages
  num_splits = num_splits or default_splits
  pages_per_split = -(-(-(-width // num_splits)) // tile_pages) * tile_pages
  num_splits = -(-width // pages_per_split)
  fnuz = np.dtype(key_cache.dtype) == common.FNUZ
  fp8 = None if fnuz or not quant.is_fp8(key_cache.dtype) else np.dtype(key_cache.dtype)
  if ds_mla:   # the content bytes are e4m3fn
    fp8 = np.dtype(jnp.float8_e4m3fn)
  caches = [key_cache, key_cache if value_cache is None else value_cache]
  key_rows = key_rows or PageRows(num_blocks)
  value_rows = value_rows or PageRows(num_blocks)
  stacked = key_rows == value_rows == PageRows(num_blocks)
  views = []
  for cache in caches:
    # Stacked: a row per (layer, block); else a row per page of one plane (MAX collection).
    view = cache.reshape((cache.shape[0] * num_blocks, -1) if stacked
                         else (-1, key_plane.block_size * num_heads * head_size))
    one_byte_fp8 = np.dtype(cache.dtype) == np.dtype(key_cache.dtype) and (fnuz or fp8)
    views.append(lax.bitcast_convert_type(view, jnp.uint8) if one_byte_fp8 else view)
  f16_query = common.f16_queries(query.dtype, key_cache.dtype, fmt)
  # fp8_ds_mla entries and a bf16 query: the content in f16 (H200, 64 x 8K, 16 heads,
  # profiler: 338.6 -> 328.1 us; fp8_split 276.1 -> 283.8 us, so it keeps bf16). ncu, H200,
  # 64 x 8K: both FP8 MLA kernels execute ~2x the instructions of the bf16 cache's (103M /
  # 98M vs 51M; 255 registers, 12.5% occupancy): the FP8 content tile feeds two dots, one
  # contracting its tokens (its non-contiguous dim, which Hopper's ldmatrix cannot transpose
  # for 8-bit types), so Triton re-stages it per dot.
  f16_latent = ds_mla and np.dtype(query.dtype) == np.dtype(jnp.bfloat16)
  compute_dtype = (np.dtype(jnp.float16) if f16_query or f16_latent
                   else common.compute_dtype_of(query.dtype, key_cache.dtype))
  if ds_mla:   # one chunk per scale tile of kv_c, then k_pe
    key_chunks = common.chunks(*[DS_MLA_TILE] * (value_dim // DS_MLA_TILE), head_size - value_dim)
    value_chunks = key_chunks[:-1]
  elif value_dim is None:   # a chunk per scale group of a MAX collection (one otherwise)
    key_chunks = value_chunks = common.chunks(*[head_size // fmt.scale_groups] * fmt.scale_groups)
    value_dim = head_size
    if key_plane.kind == "KX" and fmt.scale_groups == 1 and head_size % key_chunk == 0:
      # x-vectorized keys ([H, D/x, bs, x] per block) in chunks of whole x-vectors: each
      # chunk's part of a page is one contiguous run (ncu, H100, FP8 8 x 32K with one
      # chunk, permuted in registers: 204 registers, 12.5% occupancy, DRAM 30%, 532 us).
      key_chunks = common.chunks(*[key_chunk] * (head_size // key_chunk))
  else:
    key_chunks = common.chunks(value_dim, head_size - value_dim)
    value_chunks = key_chunks[:1]
  if fmt.quant in ("token", "block") or rope_plane is not None:
    k_scale, v_scale = k_scale.reshape(-1), v_scale.reshape(-1)
  kernel = functools.partial(
      _kernel, fmt=fmt, key_plane=key_plane, value_plane=value_plane, key_rows=key_rows,
      value_rows=value_rows, num_blocks=num_blocks,
      key_chunks=key_chunks, value_chunks=value_chunks, num_heads=num_heads, group=group,
      group_rows=group_rows, head_blocks=head_blocks, tile_pages=tile_pages,
      pages_per_split=pages_per_split, scale=scale,
      logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, fnuz=fnuz, fp8=fp8,
      compute_dtype=compute_dtype, f16_query=f16_query, f16_latent=f16_latent,
      rope_plane=rope_plane,
      ds_mla_rank=value_dim if ds_mla else None,
      transposed_values=(transposed_values and value_plane.tokens_fastest
                         and rope_plane is None and not ds_mla))
  if alibi_slopes is None:
    kernel = functools.partial(_without_alibi, kernel)
    alibi_args = ()
  else:
    alibi_args = (alibi_slopes,)
  programs = batch * num_heads * num_splits
  acc, running_max, running_sum = lowering.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((programs, group, value_dim), jnp.float32),
                 jax.ShapeDtypeStruct((programs, group), jnp.float32),
                 jax.ShapeDtypeStruct((programs, group), jnp.float32)),
      grid=(batch, num_heads * head_blocks, num_splits),
      input_output_aliases={},
      interpret=interpret,
      num_warps=num_warps,
      num_stages=num_stages,
      name="jkv_paged_attention_decode",
  )(block_tables, seq_lens, jnp.asarray(layer, jnp.int32).reshape(1), query, k_scale, v_scale,
    *alibi_args, *views)
  shape = (batch, num_heads, num_splits, group)
  running_max = running_max.reshape(shape)
  local_max = jnp.max(running_max, axis=2, keepdims=True)
  weight = jnp.exp(running_max - local_max)
  total = jnp.sum(running_sum.reshape(shape) * weight, axis=2)
  out = jnp.sum(acc.reshape(shape + (value_dim,)) * weight[..., None], axis=2)
  if combine_axes is not None:   # the other block shards' partials of the same heads
    local_max = local_max[:, :, 0]
    weight = jnp.exp(local_max - lax.pmax(local_max, combine_axes))
    total = lax.psum(total * weight, combine_axes)
    out = lax.psum(out * weight[..., None], combine_axes)
  out = out / (total[..., None] + 1e-6)
  return out.reshape(batch, num_q_heads, value_dim).astype(query.dtype)


def _without_alibi(kernel, block_tables_ref, seq_lens_ref, layer_ref, query_ref, k_scale_ref,
                   v_scale_ref, *refs):
  """The kernel signature with no alibi operand."""
  return kernel(block_tables_ref, seq_lens_ref, layer_ref, query_ref, k_scale_ref,
                v_scale_ref, None, *refs)
