"""Quantized paged writes: per-token and per-block FP8 / INT8 scales, and FP4.

Semantics are those of :mod:`jkv.reference.quant_write` (bit for bit). The caches are
viewed as ``[rows, block_elems]`` and addressed through :class:`jkv.layout.Plane`
offsets, as in :mod:`pallas_kernels.write`; scale arrays are viewed flat. Tiles are
``[tokens, heads, head_size padded to a power of two]``, so a program holds whole head
rows and computes their amax itself. All caches and scale arrays are aliased to the
outputs (``input_output_aliases``): nothing is copied.

* :func:`token_quant` -- grid over (token tiles, head groups).
* :func:`block_quant` -- grid over (programs, head groups); program p handles the scale
  blocks (segments of :func:`jkv.segments.group_by_scale_block`) p, p + P, p + 2P, ...
  Each segment is owned by one program: it reads the new tokens once, computes the
  block amax, updates the scale, re-quantizes the block's other tokens when the scale
  grows, and writes the new tokens. Into token-fastest value planes (vLLM / ASM) a
  chunk of tokens that fills consecutive slots (a prefill page) is stored as one run,
  which Triton vectorizes along the tokens; other chunks are scattered by slot. Scale
  blocks of several 16-token chunks (asm_pa 128 / 256) run a program per (segment, head
  group, chunk) instead, in two launches: chunk amaxes, then the write with the reduced
  scale.
* :func:`fp4_write` -- grid over (token tiles, head groups), groups of 32 / 16 values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jkv import fp4, quant
from jkv.layout import Plane
from pallas_kernels import lowering
from pallas_kernels.write import (_arrange, _next_pow2, cache_views, quantize_stored,
                                  restore_caches)

_FNUZ = np.dtype(jnp.float8_e4m3fnuz)


def _dequantize(q, dtype):
  """Stored cache values -> float32."""
  if np.dtype(dtype) == _FNUZ:
    return quant.e4m3fnuz_value(q)
  return q.astype(jnp.float32)


def _store_tile(out_ref, plane: Plane, rows, offset_in_block, heads, dims, values, mask):
  """Stores values [N, HB, DP] of N tokens (rows, offset_in_block [N]) at their plane
  offsets, in the plane's preferred lane order. Masked lanes point one row past the
  cache (the interpreter drops them; the GPU never touches them)."""
  n, hb, dp = values.shape
  rows = jnp.where(mask, rows[:, None, None], out_ref.shape[0])
  offsets = (plane.token_offset(offset_in_block)[:, None, None]
             + plane.elem_offset(heads[None, :, None], dims[None, None, :]))
  flat = lambda a: jnp.broadcast_to(a, (n, hb, dp)).reshape(n, hb * dp)
  tiles = _arrange(plane, flat(values), flat(rows), flat(offsets), flat(mask))
  values, rows, offsets, mask = tiles
  lowering.store(out_ref.at[rows, offsets], values, mask=mask)


def _store_run(out_ref, plane: Plane, row, first_offset, heads, dims, values, mask):
  """Stores values [run, HB, DP] of tokens at offsets ``first_offset + 0 .. run - 1`` of
  cache row ``row`` (first_offset a multiple of run; the run inside one block); mask
  [1, HB, DP] (the same for every token; masked lanes point one row past the cache)."""
  run = values.shape[0]
  align = min(run, plane.x) if plane.kind == "VASM" else run
  base = pl.multiple_of(plane.token_offset(first_offset), align)
  tokens = lax.iota(jnp.int32, run)
  # VASM runs within one x-group: token_offset(tokens) equals tokens, and Triton sees the
  # contiguity of a plain iota only, not through token_offset's // and % (asm 353 us, 243
  # with the iota; H100, 32K int8).
  if not (plane.kind == "VASM" and run <= plane.x):
    tokens = plane.token_offset(tokens)
  offsets = (base + tokens[:, None, None]
             + plane.elem_offset(heads[None, :, None], dims[None, None, :]))
  shape = values.shape
  rows = jnp.broadcast_to(jnp.where(mask, row, out_ref.shape[0]), shape)
  lowering.store(out_ref.at[rows, offsets], values, mask=jnp.broadcast_to(mask, shape))


def _load_rows(src_ref, tokens, heads, dims, head_size, mask):
  """Input rows [N, HB, DP] (float32) of tokens [N] from a [T, H * D] ref; 0 where masked."""
  n, hb, dp = mask.shape
  cols = jnp.broadcast_to(heads[None, :, None] * head_size + dims[None, None, :], (n, hb, dp))
  rows = jnp.broadcast_to(tokens[:, None, None], (n, hb, dp))
  return lowering.load(src_ref.at[rows, cols], mask=mask, other=0).astype(jnp.float32)


def _store_flat(ref, index, values, mask):
  """Masked store into a 1-D ref; masked lanes point past its end."""
  lowering.store(ref.at[jnp.where(mask, index, ref.shape[0])], values, mask=mask)


def _finite_amax(x):
  """max |x| over the last axis ignoring non-finite values, and whether all were finite."""
  a = jnp.abs(x)
  finite = a < jnp.inf
  amax = jnp.max(jnp.where(finite, a, 0.0), axis=-1)
  all_finite = jnp.min(jnp.where(finite, 1.0, 0.0), axis=-1) > 0.0
  return amax, all_finite


# ---- per-token ---------------------------------------------------------------------------

def _token_quant_kernel(slot_ref, layer_ref, key_ref, value_ref, *refs, num_tokens, num_heads,
                        head_size, block_size, num_blocks, total_rows, tokens_per_program,
                        heads_per_program, key_plane, value_plane, dtype, scales_block_major,
                        shared_cache, native):
  num_caches = 1 if shared_cache else 2
  outs = refs[num_caches + 2:]
  cache_outs, scale_outs = outs[:num_caches], outs[num_caches:]
  tb, hb, dp = tokens_per_program, heads_per_program, _next_pow2(head_size)
  t = pl.program_id(0) * tb + lax.iota(jnp.int32, tb)
  h = pl.program_id(1) * hb + lax.iota(jnp.int32, hb)
  d = lax.iota(jnp.int32, dp)
  t_ok = t < num_tokens
  t = jnp.where(t_ok, t, 0)
  slot = lowering.load(slot_ref.at[t], mask=t_ok, other=-1)
  ok = (slot >= 0) & (slot < num_blocks * block_size)
  h_ok = h < num_heads
  h = jnp.where(h_ok, h, 0)
  mask = ok[:, None, None] & h_ok[None, :, None] & (d < head_size)[None, None, :]
  layer = layer_ref[0]
  block = jnp.where(ok, slot // block_size, 0)
  offset = jnp.where(ok, slot % block_size, 0)
  rows = jnp.where(ok, layer * num_blocks + block, total_rows)
  loaded = [_load_rows(src, t, h, d, head_size, mask) for src in (key_ref, value_ref)]
  for x, plane, which in zip(loaded, (key_plane, value_plane), range(2)):
    out_ref = cache_outs[0 if shared_cache else which]
    amax, all_finite = _finite_amax(x)
    inv = 1.0 / jnp.maximum(quant.scale_of(amax, dtype), quant.SCALE_FLOOR)   # [TB, HB]
    scale = jnp.where(all_finite, quant.scale_of(amax, dtype), jnp.nan)
    stored = quantize_stored(x * inv[:, :, None], dtype, out_ref.dtype, native)
    _store_tile(out_ref, plane, rows, offset, h, d, stored, mask)
    if scales_block_major:   # [L, nb, H, bs]
      index = ((layer * num_blocks + block)[:, None] * num_heads + h[None, :]) * block_size \
          + offset[:, None]
    else:                    # [L, H, nb * bs]
      index = (layer * num_heads + h[None, :]) * (num_blocks * block_size) + slot[:, None]
    scale_mask = ok[:, None] & h_ok[None, :]
    _store_flat(scale_outs[which], index, scale, scale_mask)


def _head_group(num_heads: int, head_size: int, tokens: int, target: int = 4096) -> int:
  """Heads per program: a power of two with tokens x heads x padded head_size ~ target."""
  per_head = tokens * _next_pow2(head_size)
  hb = max(1, target // per_head)
  return min(_next_pow2(num_heads), 1 << (hb.bit_length() - 1))


def token_quant(key, value, key_cache, value_cache, k_scales, v_scales, slot_mapping, layer, *,
                key_plane: Plane, value_plane: Plane, num_blocks: int, scales_block_major: bool,
                interpret: bool, tokens_per_program: int | None = None,
                heads_per_program: int | None = None, num_warps: int | None = None):
  """Per-token FP8 / INT8 write (see :func:`jkv.reference.quant_write.write_token_quant`).

  key, value [T, H, D]; caches of one layout (value_cache None: K and V share
  key_cache); k_scales, v_scales float32, block-major [L, nb, H, bs] or head-major
  [L, H, nb * bs] (any leading dims are flattened). Returns the four arrays.
  """
  num_tokens, num_heads, head_size = key.shape
  caches = (key_cache,) if value_cache is None else (key_cache, value_cache)
  block_elems = key_plane.block_size * num_heads * head_size * (2 if value_cache is None else 1)
  views = cache_views(caches, block_elems)
  # Fastest tiles in sweeps (benchmarks/run.py --sections quant --sweep): 4 tokens x 8
  # heads x 128 with 4 warps (H200, flash and others); for vLLM's value plane ([H, D, bs],
  # token-minor) 8 tokens x 8 heads with 8 warps (H100, 2026-11-22: FP8 85.9 vs 92.8 us,
  # INT8 91.1 vs 97.3 us for 32K tokens): twice the tokens per stored run of a head dim.
  token_minor = value_plane.kind == "VD"
  tb = min(tokens_per_program or (8 if token_minor else 4), _next_pow2(num_tokens))
  num_warps = num_warps or (8 if token_minor else 4)
  hb = heads_per_program or _head_group(num_heads, head_size, tb,
                                       target=8192 if token_minor else 4096)
  kernel = functools.partial(
      _token_quant_kernel, num_tokens=num_tokens, num_heads=num_heads, head_size=head_size,
      block_size=key_plane.block_size, num_blocks=num_blocks, total_rows=views[0].shape[0],
      tokens_per_program=tb, heads_per_program=hb, key_plane=key_plane, value_plane=value_plane,
      dtype=key_cache.dtype, scales_block_major=scales_block_major,
      shared_cache=value_cache is None, native=not interpret)
  scales = (k_scales.reshape(-1), v_scales.reshape(-1))
  arrays = tuple(views) + scales
  first = 4
  outs = lowering.pallas_call(
      kernel,
      out_shape=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays),
      grid=(pl.cdiv(num_tokens, tb), pl.cdiv(num_heads, hb)),
      input_output_aliases={first + i: i for i in range(len(arrays))},
      interpret=interpret, num_warps=num_warps, name="jkv_token_quant",
  )(slot_mapping.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
    key.reshape(num_tokens, -1), value.reshape(num_tokens, -1), *arrays)
  cache_outs = restore_caches(outs[:len(views)], caches)
  k_out, v_out = outs[len(views)].reshape(k_scales.shape), outs[len(views) + 1].reshape(v_scales.shape)
  return cache_outs[0], (None if value_cache is None else cache_outs[1]), k_out, v_out


# ---- per-block ---------------------------------------------------------------------------
# Two launches. The first owns each segment (the new tokens of one scale block): it reads
# them once, computes the block amax, updates the scale, writes the new tokens and notes
# per (segment, head) whether the scale grew and from what. The second re-quantizes the
# grown blocks' other tokens (offsets the first never writes, so order does not matter);
# it does nothing for fresh blocks, so a prefill pays one cheap pass.


def _head_lanes(heads_per_program, num_heads, head_size):
  """This program's heads and the padded head dim: (h, h_ok, d, d_ok), h clamped where
  past num_heads."""
  h = pl.program_id(1) * heads_per_program + lax.iota(jnp.int32, heads_per_program)
  h_ok = h < num_heads
  h = jnp.where(h_ok, h, 0)
  d = lax.iota(jnp.int32, _next_pow2(head_size))
  return h, h_ok, d, d < head_size


def _segment_loop(num_segments_ref, num_programs, body):
  """Runs body(s) for segments s = p, p + P, ... < num_segments (p = program_id(0))."""
  p = pl.program_id(0)
  count = jnp.maximum((num_segments_ref[0] - p + num_programs - 1) // num_programs, 0)
  lax.fori_loop(0, count, lambda i, carry: (body(p + i * num_programs), carry)[1], 0)


def _scale_index(unit, layer, h, num_units, num_heads, scales_block_major):
  if scales_block_major:   # [L, units, H]
    return (layer * num_units + unit) * num_heads + h
  return (layer * num_heads + h) * num_units + unit   # [L, H, units]


def _segment_slots(start, length, c, chunk, slot_ref):
  """Chunk c of a segment: (positions in the segment arrays, slots, in-segment mask)."""
  k = c * chunk + lax.iota(jnp.int32, chunk)
  in_seg = k < length
  pos = jnp.where(in_seg, start + k, 0)
  return pos, lowering.load(slot_ref.at[pos], mask=in_seg, other=0), in_seg


def _segment_chunk(start, length, c, chunk, token_ref, slot_ref):
  """Chunk c of a segment: (input rows, slots, in-segment mask) [chunk]."""
  pos, slot, in_seg = _segment_slots(start, length, c, chunk, slot_ref)
  return lowering.load(token_ref.at[pos], mask=in_seg, other=0), slot, in_seg


def _write_outputs(refs, shared_cache):
  """(cache outputs, scale outputs, grown-flag outputs) of a per-block write kernel, from
  the refs after its other inputs (the aliased caches and scales come first)."""
  num_caches = 1 if shared_cache else 2
  outs = refs[num_caches + 2:]
  return outs[:num_caches], outs[num_caches:num_caches + 2], outs[num_caches + 2:]


def _block_write_kernel(num_segments_ref, start_ref, length_ref, token_ref, slot_ref, layer_ref,
                        key_ref, value_ref, *refs, num_programs, num_heads, head_size, block_size,
                        num_blocks, unit_size, chunk, heads_per_program, key_plane, value_plane,
                        dtype, scales_block_major, shared_cache, native):
  """Scale blocks of one chunk (unit_size == chunk): K and V stay in registers."""
  cache_outs, scale_outs, grown_outs = _write_outputs(refs, shared_cache)
  num_units = num_blocks * block_size // unit_size
  h, h_ok, d, d_ok = _head_lanes(heads_per_program, num_heads, head_size)
  layer = layer_ref[0]
  planes, srcs = (key_plane, value_plane), (key_ref, value_ref)

  def segment(s):
    start, length = start_ref[s], length_ref[s]
    first_slot = slot_ref[start]
    unit = first_slot // unit_size
    fresh = first_slot % unit_size == 0
    tokens, slot, in_seg = _segment_chunk(start, length, 0, chunk, token_ref, slot_ref)
    mask = in_seg[:, None, None] & h_ok[None, :, None] & d_ok[None, None, :]
    # Both loaded before any store.
    kept = [_load_rows(src, tokens, h, d, head_size, mask) for src in srcs]
    for which in range(2):
      out_ref, x = cache_outs[0 if shared_cache else which], kept[which]
      amax = jnp.max(_finite_amax(x)[0], axis=0)
      index = _scale_index(unit, layer, h, num_units, num_heads, scales_block_major)
      s_old = lowering.load(scale_outs[which].at[jnp.where(h_ok, index, 0)], mask=h_ok,
                            other=0.0)
      scale, grown = _new_scale(amax, s_old, fresh, dtype)
      lowering.block_barrier(native)   # every warp has read s_old before it is replaced
      _store_flat(scale_outs[which], index, scale, h_ok)
      _store_flat(grown_outs[which], s * num_heads + h, jnp.where(grown, s_old, -1.0), h_ok)
      _store_chunk(out_ref, planes[which], layer * num_blocks, slot, in_seg, length == chunk,
                   h, h_ok, d, d_ok,
                   quantize_stored(x * (1.0 / scale)[None, :, None], dtype, out_ref.dtype,
                                   native), mask)

  _segment_loop(num_segments_ref, num_programs, segment)


def _new_scale(amax, s_old, fresh, dtype):
  """(the block's scale after this write, whether it grew over an older one) [HB]."""
  s_new = quant.scale_of(jnp.maximum(amax, quant.AMAX_FLOOR), dtype)
  grows = s_new > s_old
  return jnp.where(fresh | grows, s_new, s_old), grows & jnp.logical_not(fresh)


# Scale blocks of several chunks (AITER's asm_pa 128 / 256): a program per (segment,
# chunk, head group) in two launches. The first stores each chunk's amax, at the chunk's
# first position in the segment arrays (unique), and snapshots the old scale; the second
# reduces the segment's chunk amaxes, writes its chunk, and (chunk 0) the scale and grown
# flag. Reading K / V twice costs bytes, but the chunks run in parallel instead of one
# program walking them twice.


def _chunk_amax_kernel(num_segments_ref, start_ref, length_ref, token_ref, slot_ref, layer_ref,
                       key_ref, value_ref, k_scale_ref, v_scale_ref, *outs, num_programs,
                       num_heads, head_size, block_size, num_blocks, unit_size, chunk,
                       heads_per_program, scales_block_major):
  amax_outs, old_outs = outs[:2], outs[2:]
  num_units = num_blocks * block_size // unit_size
  h, h_ok, d, d_ok = _head_lanes(heads_per_program, num_heads, head_size)
  c = pl.program_id(2)
  layer = layer_ref[0]

  def segment(s):
    start, length = start_ref[s], length_ref[s]

    @pl.when(c * chunk < length)
    def _():
      tokens, _, in_seg = _segment_chunk(start, length, c, chunk, token_ref, slot_ref)
      mask = in_seg[:, None, None] & h_ok[None, :, None] & d_ok[None, None, :]
      for src, out in zip((key_ref, value_ref), amax_outs):
        x = _load_rows(src, tokens, h, d, head_size, mask)
        _store_flat(out, (start + c * chunk) * num_heads + h,
                    jnp.max(_finite_amax(x)[0], axis=0), h_ok)

    @pl.when(c == 0)
    def _():
      index = _scale_index(slot_ref[start] // unit_size, layer, h, num_units, num_heads,
                           scales_block_major)
      for scale_ref, out in zip((k_scale_ref, v_scale_ref), old_outs):
        s_old = lowering.load(scale_ref.at[jnp.where(h_ok, index, 0)], mask=h_ok, other=0.0)
        _store_flat(out, start * num_heads + h, s_old, h_ok)

  _segment_loop(num_segments_ref, num_programs, segment)


def _chunk_write_kernel(num_segments_ref, start_ref, length_ref, token_ref, slot_ref, layer_ref,
                        key_ref, value_ref, k_amax_ref, v_amax_ref, k_old_ref, v_old_ref, *refs,
                        num_programs, num_heads, head_size, block_size, num_blocks, unit_size,
                        chunk, heads_per_program, key_plane, value_plane, dtype,
                        scales_block_major, shared_cache, native):
  cache_outs, scale_outs, grown_outs = _write_outputs(refs, shared_cache)
  num_units = num_blocks * block_size // unit_size
  h, h_ok, d, d_ok = _head_lanes(heads_per_program, num_heads, head_size)
  c = pl.program_id(2)
  layer = layer_ref[0]
  planes, srcs = (key_plane, value_plane), (key_ref, value_ref)

  def segment(s):
    start, length = start_ref[s], length_ref[s]

    @pl.when(c * chunk < length)
    def _():
      first_slot = slot_ref[start]
      fresh = first_slot % unit_size == 0
      tokens, slot, in_seg = _segment_chunk(start, length, c, chunk, token_ref, slot_ref)
      mask = in_seg[:, None, None] & h_ok[None, :, None] & d_ok[None, None, :]
      for which, amax_ref, old_ref in zip(range(2), (k_amax_ref, v_amax_ref),
                                          (k_old_ref, v_old_ref)):
        amax = jnp.zeros(h.shape, jnp.float32)
        for other in range(unit_size // chunk):
          ok = h_ok & (other * chunk < length)
          index = jnp.where(ok, (start + other * chunk) * num_heads + h, 0)
          amax = jnp.maximum(amax, lowering.load(amax_ref.at[index], mask=ok, other=0.0))
        s_old = lowering.load(old_ref.at[start * num_heads + h], mask=h_ok, other=0.0)
        scale, grown = _new_scale(amax, s_old, fresh, dtype)

        @pl.when(c == 0)
        def _():
          index = _scale_index(first_slot // unit_size, layer, h, num_units, num_heads,
                               scales_block_major)
          _store_flat(scale_outs[which], index, scale, h_ok)
          _store_flat(grown_outs[which], s * num_heads + h, jnp.where(grown, s_old, -1.0),
                      h_ok)

        out_ref = cache_outs[0 if shared_cache else which]
        x = _load_rows(srcs[which], tokens, h, d, head_size, mask)
        _store_chunk(out_ref, planes[which], layer * num_blocks, slot, in_seg,
                     (c + 1) * chunk <= length, h, h_ok, d, d_ok,
                     quantize_stored(x * (1.0 / scale)[None, :, None], dtype, out_ref.dtype,
                                     native), mask)

  _segment_loop(num_segments_ref, num_programs, segment)


def _store_chunk(out_ref, plane: Plane, first_row, slot, in_seg, filled, heads, h_ok, dims,
                 d_ok, values, mask):
  """Stores a segment chunk's values [chunk, HB, DP] at its slots [chunk] (rows from
  ``first_row``, the layer's first). On a token-fastest plane a chunk that fills ``chunk``
  consecutive slots from a chunk-aligned one (``filled``: no lane past the segment; a
  prefill page) is stored as a run (:func:`_store_run`), the others by slot."""
  chunk, block_size = slot.shape[0], plane.block_size

  def scattered():
    _store_tile(out_ref, plane, first_row + slot // block_size, slot % block_size, heads, dims,
                values, mask)

  if not (plane.tokens_fastest and block_size % chunk == 0):
    scattered()
    return
  first = jnp.min(jnp.where(in_seg, slot, jnp.iinfo(jnp.int32).max))
  last = jnp.max(jnp.where(in_seg, slot, -1))
  run = filled & (last - first == chunk - 1) & (first % chunk == 0)   # slots increase
  pl.when(jnp.logical_not(run))(scattered)

  @pl.when(run)
  def _():
    _store_run(out_ref, plane, first_row + first // block_size, first % block_size, heads,
               dims, values, h_ok[None, :, None] & d_ok)


def _block_requant_kernel(num_segments_ref, start_ref, length_ref, slot_ref, layer_ref,
                          k_grown_ref, v_grown_ref, *refs, num_programs, num_heads, head_size,
                          block_size, num_blocks, unit_size, chunk, heads_per_program,
                          key_plane, value_plane, dtype, scales_block_major, shared_cache,
                          native):
  num_caches = 1 if shared_cache else 2
  outs = refs[num_caches + 2:]
  cache_outs, scale_refs = outs[:num_caches], refs[num_caches:num_caches + 2]
  hb, dp = heads_per_program, _next_pow2(head_size)
  num_units = num_blocks * block_size // unit_size
  h, h_ok, d, d_ok = _head_lanes(hb, num_heads, head_size)
  layer = layer_ref[0]
  num_chunks = unit_size // chunk
  j = lax.iota(jnp.int32, chunk)
  planes, grown_refs = (key_plane, value_plane), (k_grown_ref, v_grown_ref)

  def segment(s):
    start, length = start_ref[s], length_ref[s]
    unit = slot_ref[start] // unit_size
    for which in range(2):
      s_old = lowering.load(grown_refs[which].at[s * num_heads + h], mask=h_ok, other=-1.0)
      grown = h_ok & (s_old >= 0.0)

      @pl.when(jnp.max(jnp.where(grown, 1, 0)) > 0)
      def _():
        out_ref, plane = cache_outs[0 if shared_cache else which], planes[which]
        index = _scale_index(unit, layer, h, num_units, num_heads, scales_block_major)
        inv = 1.0 / lowering.load(scale_refs[which].at[jnp.where(h_ok, index, 0)], mask=h_ok,
                                  other=1.0)
        # Offsets (in the unit) of the segment's new tokens, -1 past its end: left alone.
        written_offsets = []
        for c in range(num_chunks):
          _, slot, in_seg = _segment_slots(start, length, c, chunk, slot_ref)
          written_offsets.append(jnp.where(in_seg, slot % unit_size, -1))
        for c in range(num_chunks):
          o = c * chunk + j
          written = jnp.zeros((chunk,), jnp.bool_)
          for offs in written_offsets:
            written = written | (jnp.max(jnp.where(o[:, None] == offs[None, :], 1, 0),
                                         axis=1) > 0)
          slots = unit * unit_size + o
          rows = layer * num_blocks + slots // block_size
          mask = (jnp.logical_not(written)[:, None, None] & grown[None, :, None]
                  & d_ok[None, None, :])
          offsets = (plane.token_offset(slots % block_size)[:, None, None]
                     + plane.elem_offset(h[None, :, None], d[None, None, :]))
          full = (chunk, hb, dp)
          old = lowering.load(out_ref.at[jnp.broadcast_to(rows[:, None, None], full),
                                         jnp.broadcast_to(offsets, full)], mask=mask)
          y = _dequantize(old, dtype) * s_old[None, :, None] * inv[None, :, None]
          _store_tile(out_ref, plane, rows, slots % block_size, h, d,
                      quantize_stored(y, dtype, out_ref.dtype, native), mask)

  _segment_loop(num_segments_ref, num_programs, segment)


def block_quant(key, value, key_cache, value_cache, k_scales, v_scales, segments, layer, *,
                key_plane: Plane, value_plane: Plane, num_blocks: int, unit_size: int,
                scales_block_major: bool, interpret: bool, max_programs: int = 2048,
                tokens_per_chunk: int | None = None, heads_per_program: int | None = None,
                num_warps: int = 4):
  """Per-block FP8 / INT8 write (see :func:`jkv.reference.quant_write.write_block_quant`).

  segments: :class:`jkv.segments.Segments` of the slot mapping for ``unit_size`` tokens
  per scale block. k_scales, v_scales float32 block-major [L, units, H] or head-major
  [L, H, units]. Returns the four arrays.
  """
  num_tokens, num_heads, head_size = key.shape
  caches = (key_cache,) if value_cache is None else (key_cache, value_cache)
  block_elems = key_plane.block_size * num_heads * head_size * (2 if value_cache is None else 1)
  views = cache_views(caches, block_elems)
  chunk = min(tokens_per_chunk or 16, unit_size)
  # Scale blocks of one chunk keep K and V in registers: 4 heads of d128 per program
  # (H100, 32K int8 / fp8 into vllm / asm, A/B in one run: 225-231 us against 252-268 for
  # 2). Longer ones (asm_pa 128, chunk-parallel) do better with 1 (391 us against 574 for
  # 2, H100, 32K int8).
  hb = heads_per_program or _head_group(num_heads, head_size, chunk,
                                        target=8192 if unit_size == chunk else 2048)
  num_chunks = unit_size // chunk
  # A program per (segment, chunk) for multi-chunk scale blocks: as many programs in all.
  num_programs = max(1, min(num_tokens, max_programs) // num_chunks)
  common = dict(num_programs=num_programs, num_heads=num_heads, head_size=head_size,
                block_size=key_plane.block_size, num_blocks=num_blocks, unit_size=unit_size,
                chunk=chunk, heads_per_program=hb, scales_block_major=scales_block_major)
  static = dict(common, key_plane=key_plane, value_plane=value_plane, dtype=key_cache.dtype,
                shared_cache=value_cache is None, native=not interpret)
  grid = (num_programs, pl.cdiv(num_heads, hb))
  scales = (k_scales.reshape(-1), v_scales.reshape(-1))
  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  seg = (segments.num_segments.reshape(1), segments.start, segments.length)
  inputs = seg + (segments.token, segments.slot, layer, key.reshape(num_tokens, -1),
                  value.reshape(num_tokens, -1))
  arrays = tuple(views) + scales
  per_head = jax.ShapeDtypeStruct((num_tokens * num_heads,), jnp.float32)
  out_shape = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays) + (per_head,) * 2
  if num_chunks == 1:
    outs = lowering.pallas_call(
        functools.partial(_block_write_kernel, **static), out_shape=out_shape, grid=grid,
        input_output_aliases={len(inputs) + i: i for i in range(len(arrays))},
        interpret=interpret, num_warps=num_warps, name="jkv_block_quant_write",
    )(*inputs, *arrays)
  else:
    # Per head, at segment positions: each chunk's amax, and the old scale.
    partials = lowering.pallas_call(
        functools.partial(_chunk_amax_kernel, **common), out_shape=(per_head,) * 4,
        grid=grid + (num_chunks,), input_output_aliases={}, interpret=interpret,
        num_warps=num_warps, name="jkv_block_quant_amax",
    )(*inputs, *scales)
    outs = lowering.pallas_call(
        functools.partial(_chunk_write_kernel, **static), out_shape=out_shape,
        grid=grid + (num_chunks,),
        input_output_aliases={len(inputs) + 4 + i: i for i in range(len(arrays))},
        interpret=interpret, num_warps=num_warps, name="jkv_block_quant_chunk_write",
    )(*inputs, *partials, *arrays)
  views, scales, grown = outs[:len(views)], outs[len(views):len(views) + 2], outs[-2:]
  requant_programs = max(1, min(num_tokens, max_programs))
  views = lowering.pallas_call(
      functools.partial(_block_requant_kernel, **dict(static, num_programs=requant_programs)),
      out_shape=tuple(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in views),
      grid=(requant_programs, grid[1]), input_output_aliases={7 + i: i for i in range(len(views))},
      interpret=interpret, num_warps=num_warps, name="jkv_block_quant_requant",
  )(*seg, segments.slot, layer, *grown, *views, *scales)
  cache_outs = restore_caches(views, caches)
  return (cache_outs[0], (None if value_cache is None else cache_outs[1]),
          scales[0].reshape(k_scales.shape), scales[1].reshape(v_scales.shape))


# ---- FP4 ---------------------------------------------------------------------------------

def fp4_groups(even, odd, fp4_format, global_scale=None, multiplier=None):
  """Quantizes groups given as their even and odd elements, float32 [..., groups, G/2]:
  returns (packed bytes uint8 [..., groups, G/2], scales [..., groups]: E8M0 bits as uint8
  for mxfp4, float8_e4m3fn for nvfp4; NaN for a group with a non-finite value).
  global_scale / multiplier (nvfp4): float32, broadcasting against [..., groups]
  (:func:`jkv.fp4.nvfp4_scale_multiplier` of it, computed outside the kernel)."""
  amax_even, finite_even = _finite_amax(even)
  amax_odd, finite_odd = _finite_amax(odd)
  amax = jnp.maximum(amax_even, amax_odd)
  finite = finite_even & finite_odd
  if fp4_format == "mxfp4":
    factor, exponent = fp4.group_scale(amax, fp4_format)
    scale = jnp.where(finite, exponent + 127, 255).astype(jnp.uint8)
  else:
    factor, sf = fp4.group_scale(amax, fp4_format, global_scale, multiplier=multiplier)
    scale = jnp.where(finite, sf, jnp.nan).astype(jnp.float8_e4m3fn)
  lo = fp4.e2m1_code(even * factor[..., None])
  hi = fp4.e2m1_code(odd * factor[..., None])
  return lo | (hi << 4), scale


def _fp4_kernel(slot_ref, layer_ref, global_ref, key_ref, value_ref, *refs, num_tokens, num_heads,
                head_size, block_size, num_blocks, tokens_per_program, heads_per_program,
                fp4_format):
  outs = refs[4:]
  data_outs, scale_outs = outs[:2], outs[2:]
  group = fp4.GROUP_SIZE[fp4_format]
  half = group // 2
  num_groups = head_size // group
  tb, hb, gp = tokens_per_program, heads_per_program, _next_pow2(num_groups)
  t = pl.program_id(0) * tb + lax.iota(jnp.int32, tb)
  h = pl.program_id(1) * hb + lax.iota(jnp.int32, hb)
  g = lax.iota(jnp.int32, gp)
  i = lax.iota(jnp.int32, half)
  t_ok = t < num_tokens
  t = jnp.where(t_ok, t, 0)
  slot = lowering.load(slot_ref.at[t], mask=t_ok, other=-1)
  ok = (slot >= 0) & (slot < num_blocks * block_size)
  h_ok = h < num_heads
  h = jnp.where(h_ok, h, 0)
  layer = layer_ref[0]
  # Entry (token, head) of a [L, nb, H, bs, n] array starts at entry * n.
  entry = (((layer * num_blocks + jnp.where(ok, slot // block_size, 0))[:, None] * num_heads
            + h[None, :]) * block_size + jnp.where(ok, slot % block_size, 0)[:, None])
  shape4 = (tb, hb, gp, half)
  mask3 = ok[:, None, None] & h_ok[None, :, None] & (g < num_groups)[None, None, :]
  mask4 = jnp.broadcast_to(mask3[..., None], shape4)
  pair = g[:, None] * half + i[None, :]                        # [GP, half]
  rows = jnp.broadcast_to(t[:, None, None, None], shape4)
  cols = jnp.broadcast_to((h[:, None, None] * head_size + 2 * pair[None])[None], shape4)
  for which, src in enumerate((key_ref, value_ref)):
    even = lowering.load(src.at[rows, cols], mask=mask4, other=0).astype(jnp.float32)
    odd = lowering.load(src.at[rows, cols + 1], mask=mask4, other=0).astype(jnp.float32)
    byte, scale = fp4_groups(even, odd, fp4_format, global_ref[which], global_ref[2 + which])
    data_index = entry[:, :, None, None] * (head_size // 2) + pair[None, None]
    _store_flat(data_outs[which], data_index, byte, mask4)
    scale_index = entry[:, :, None] * num_groups + g[None, None, :]
    _store_flat(scale_outs[which], scale_index, scale, mask3)


def _global_inputs(global_scales):
  """float32 [4]: the K and V global scales, then their nvfp4 scale multipliers."""
  g = jnp.asarray(global_scales, jnp.float32).reshape(2)
  return jnp.concatenate([g, jnp.stack([fp4.nvfp4_scale_multiplier(g[0]),
                                        fp4.nvfp4_scale_multiplier(g[1])])])


def fp4_write(key, value, key_data, value_data, k_block_scales, v_block_scales, slot_mapping,
              layer, global_scales, *, fp4_format: str, num_blocks: int, block_size: int,
              interpret: bool, tokens_per_program: int = 4, num_warps: int = 4):
  """FP4 write (see :func:`jkv.reference.quant_write.write_fp4`).

  key_data, value_data uint8 [L, nb, H, bs, D/2]; k/v_block_scales [L, nb, H, bs, D/G]
  (float8_e8m0fnu for mxfp4, float8_e4m3fn for nvfp4); global_scales float32 [2]
  (K, V; nvfp4). Returns the four arrays.
  """
  num_tokens, num_heads, head_size = key.shape
  tb = min(tokens_per_program, _next_pow2(num_tokens))
  hb = _head_group(num_heads, head_size // 2, tb, target=2048)
  scales = [s.reshape(-1) for s in (k_block_scales, v_block_scales)]
  if fp4_format == "mxfp4":   # E8M0 through its bits
    scales = [lax.bitcast_convert_type(s, jnp.uint8) for s in scales]
  arrays = (key_data.reshape(-1), value_data.reshape(-1), *scales)
  kernel = functools.partial(
      _fp4_kernel, num_tokens=num_tokens, num_heads=num_heads, head_size=head_size,
      block_size=block_size, num_blocks=num_blocks, tokens_per_program=tb, heads_per_program=hb,
      fp4_format=fp4_format)
  outs = lowering.pallas_call(
      kernel,
      out_shape=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays),
      grid=(pl.cdiv(num_tokens, tb), pl.cdiv(num_heads, hb)),
      input_output_aliases={5 + i: i for i in range(4)},
      interpret=interpret, num_warps=num_warps, name="jkv_fp4_write",
  )(slot_mapping.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
    _global_inputs(global_scales), key.reshape(num_tokens, -1),
    value.reshape(num_tokens, -1), *arrays)
  k_scales_out, v_scales_out = outs[2], outs[3]
  if fp4_format == "mxfp4":
    k_scales_out = lax.bitcast_convert_type(k_scales_out, k_block_scales.dtype)
    v_scales_out = lax.bitcast_convert_type(v_scales_out, v_block_scales.dtype)
  return (outs[0].reshape(key_data.shape), outs[1].reshape(value_data.shape),
          k_scales_out.reshape(k_block_scales.shape), v_scales_out.reshape(v_block_scales.shape))
