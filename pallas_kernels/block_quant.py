"""Per-block FP8 / INT8 paged write: one scale per (scale block of tokens, head), grown as
tokens arrive (AITER ``reshape_and_cache_with_block_quant`` and its asm_pa variant).

Semantics are those of :func:`jkv.reference.quant_write.write_block_quant` (bit for bit).
Grid over (programs, head groups); program p handles the scale blocks (segments of
:func:`jkv.segments.group_by_scale_block`) p, p + P, p + 2P, ... Scale blocks of one
16-token chunk: each segment is owned by one program: it reads the new tokens once,
computes the block amax, updates the scale, writes the new tokens and notes per (segment,
head) whether the scale grew and from what; an empty segment (a scale block the slot
table's grouping holds but nothing writes) is skipped. Segments of the slot table
(:func:`jkv.segments.index_by_slot`) need no slot loads (the slots are the positions);
into token-fastest value planes (vLLM / ASM) their chunks inside one block are stored as
runs, holes masked, with no scatter path in the kernel. Sorted segments: into those planes
a chunk of tokens that fills consecutive slots (a prefill page) is stored as one run,
which Triton vectorizes along the tokens; other chunks are scattered by slot. Scale
blocks of several chunks (asm_pa 128 / 256): a program per (segment, head group; of 128
tokens or more, K or V) walks the segment's chunks twice, for the block amax, then to
store the tokens under the new scale.
A last launch re-quantizes the grown blocks' older tokens (offsets the write never touches, so
order does not matter); it does nothing for fresh blocks, so a prefill pays one cheap pass.
Decode-sized writes of scale blocks of one chunk on planes where every store scatters
(flash, HND, packed) re-quantize them in the write kernel instead, with no pass. The
caches and scale arrays are aliased to the outputs: nothing is copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jkv import quant
from jkv.layout import Plane
from pallas_kernels import common, lowering


def _dequantize(q, dtype):
  """Stored cache values -> float32."""
  if np.dtype(dtype) == common.FNUZ:
    return quant.e4m3fnuz_value(q)
  return q.astype(jnp.float32)



def _store_run(out_ref, plane: Plane, first_row, first_slot, heads, dims, values, mask):
  """Stores values [run, HB, DP] of the tokens at slots ``first_slot + 0 .. run - 1``
  (first_slot a multiple of run; the run inside one block) from cache row ``first_row``
  (the layer's first). mask [1 or run, HB, DP]; masked lanes point one row past the cache.
  A mask that is the same for every token lets the stores vectorize along the tokens of a
  token-fastest plane."""
  run, block_size = values.shape[0], plane.block_size
  align = min(run, plane.x) if plane.kind == "VASM" else run
  base = pl.multiple_of(plane.token_offset(first_slot % block_size), align)
  # token_offset's lax div / rem keep the run's contiguity visible to Triton (jnp's // and
  # % hid it: the ASM value runs were stored a byte at a time, asm 353 us against 243 with a
  # plain iota; H100, 32K int8).
  tokens = plane.token_offset(lax.iota(jnp.int32, run))
  offsets = (base + tokens[:, None, None]
             + plane.elem_offset(heads[None, :, None], dims[None, None, :]))
  row = first_row + first_slot // block_size
  shape = values.shape
  rows = jnp.broadcast_to(jnp.where(mask, row, out_ref.shape[0]), shape)
  lowering.store(out_ref.at[rows, offsets], values, mask=jnp.broadcast_to(mask, shape))


def _head_lanes(heads_per_program, num_heads, head_size):
  """This program's heads and the padded head dim: (h, h_ok, d, d_ok), h clamped where
  past num_heads."""
  h = pl.program_id(1) * heads_per_program + lax.iota(jnp.int32, heads_per_program)
  h_ok = h < num_heads
  h = jnp.where(h_ok, h, 0)
  d = lax.iota(jnp.int32, common.next_pow2(head_size))
  return h, h_ok, d, d < head_size


def _segment_loop(num_segments_ref, num_programs, body):
  """Runs body(s) for segments s = p, p + P, ... < num_segments (p = program_id(0))."""
  p = pl.program_id(0)
  count = jnp.maximum((num_segments_ref[0] - p + num_programs - 1) // num_programs, 0)
  lax.fori_loop(0, count, lambda i, carry: (body(p + i * num_programs), carry)[1], 0)


def _unless_empty(length_ref, body):
  """body(s), skipped for an empty segment (length 0: a scale block nothing writes, its
  scale left alone and its grown flags unwritten)."""
  return lambda s: pl.when(length_ref[s] > 0)(functools.partial(body, s))


def _scale_index(unit, layer, h, num_units, num_heads, scales_block_major):
  if scales_block_major:   # [L, units, H]
    return (layer * num_units + unit) * num_heads + h
  return (layer * num_heads + h) * num_units + unit   # [L, H, units]


def _segment_chunk(start, length, c, chunk, token_ref, slot_ref):
  """Chunk c of a segment: (input rows, slots, mask of the positions holding a token)
  [chunk]; a segment of :func:`jkv.segments.index_by_slot` has holes (token -1).
  slot_ref None: the slots are the positions (index_by_slot's), not loaded."""
  k = c * chunk + lax.iota(jnp.int32, chunk)
  in_range = k < length
  pos = jnp.where(in_range, start + k, 0)
  tokens = lowering.load(token_ref.at[pos], mask=in_range, other=-1)
  in_seg = tokens >= 0
  slots = pos if slot_ref is None else lowering.load(slot_ref.at[pos], mask=in_seg, other=0)
  return jnp.maximum(tokens, 0), slots, in_seg


def _rebuilt(mask):
  """bool mask [n] rebuilt from integers of its bits (one uint32 per 32 lanes): a mask
  computed from scalars and an iota reaches any register layout, where Triton redid the
  loads ``mask`` came from in the layout of the store that used it (H100 sm_90a, the vLLM
  per-block write with a per-token mask on its run stores: 16 more loads of the tokens,
  128 registers against 96)."""
  lane = lax.iota(jnp.int32, mask.shape[0])
  word_of, shift = lax.div(lane, 32), lax.rem(lane, 32).astype(jnp.uint32)
  bit = jnp.left_shift(jnp.uint32(1), shift)
  word = jnp.uint32(0)
  for w in range(-(-mask.shape[0] // 32)):
    word = jnp.where(word_of == w, jnp.sum(jnp.where(mask & (word_of == w), bit, 0)
                                           .astype(jnp.uint32)), word)
  return (jnp.right_shift(word, shift) & 1) > 0


def _all(mask):
  """Whether every lane of bool mask [n] is set (a chunk without holes)."""
  return jnp.min(jnp.where(mask, 1, 0)) > 0


def _first_slot(start, token_ref, slot_ref, unit_size):
  """(the segment's scale block, whether it is fresh: its first slot is written now);
  slot_ref None: slots are positions."""
  first_slot = start if slot_ref is None else slot_ref[start]
  return first_slot // unit_size, (first_slot % unit_size == 0) & (token_ref[start] >= 0)


def _write_outputs(refs, shared_cache):
  """(cache outputs, scale outputs, grown-flag outputs) of a per-block write kernel, from
  the refs after its other inputs (the aliased caches and scales come first)."""
  num_caches = 1 if shared_cache else 2
  outs = refs[num_caches + 2:]
  return outs[:num_caches], outs[num_caches:num_caches + 2], outs[num_caches + 2:]


def _block_write_kernel(num_segments_ref,   # int32 [1]: segments (some may be empty)
                        start_ref,          # int32 [S]: segment s's first position in
                                            # token / slot
                        length_ref,         # int32 [S]: its positions
                        full_ref,           # int32 [S]: 1 where it writes its whole
                                            # scale block
                        token_ref,          # int32 [N]: token rows (-1: none), grouped
                                            # by segment
                        slot_ref,           # int32 [N]: their slots (unread with
                                            # slot_is_position)
                        layer_ref,          # int32 [1]
                        key_ref,            # [T, H * D]
                        value_ref,          # [T, H * D]
                        *refs,              # caches [L * nb, block elems], k / v
                                            # scales float32 [L * units * H] (flat);
                                            # outputs: the same (aliased), then k / v
                                            # grown flags float32 [S * H] (the old scale
                                            # where it grew, else -1; per segment and
                                            # head)
                        num_programs, num_heads, head_size, block_size, num_blocks, unit_size,
                        chunk, heads_per_program, key_plane, value_plane, dtype,
                        scales_block_major, shared_cache, split_kv, native,
                        slot_is_position, requant_in_write):
  """Scale blocks of one chunk (unit_size == chunk): program p owns segments p, p + P, ...;
  a segment's tokens stay in registers: block amax, the new scale (grown or kept), the
  new tokens stored under it, the grown flag for the re-quantization pass, or with
  ``requant_in_write`` the block's older tokens re-quantized right there (no flags, no
  re-quantization pass: the program owns the whole scale block). K and V are
  both loaded before either is stored (loading and storing K, then V, H200 32K fp8:
  vllm 117 -> 136 us, flash 64 -> 66: half the registers, the loads not overlapped), or
  with ``split_kv`` by two programs (grid axis 2: 0 writes K, 1 writes V)."""
  cache_outs, scale_outs, grown_outs = _write_outputs(refs, shared_cache)
  num_units = num_blocks * block_size // unit_size
  h, h_ok, d, d_ok = _head_lanes(heads_per_program, num_heads, head_size)
  layer = layer_ref[0]
  planes, srcs = (key_plane, value_plane), (key_ref, value_ref)
  cache_program = pl.program_id(2) if split_kv else None   # (read outside the loop)

  slots = None if slot_is_position else slot_ref

  def segment(s):
    start, length = start_ref[s], length_ref[s]
    unit, fresh = _first_slot(start, token_ref, slots, unit_size)
    tokens, slot, in_seg = _segment_chunk(start, length, 0, chunk, token_ref, slots)
    mask = in_seg[:, None, None] & h_ok[None, :, None] & d_ok[None, None, :]
    # Whether the chunk has no hole, from the grouping (Segments.full): reducing in_seg here
    # took 150 of the vllm kernel's 1030 SASS instructions and 24 registers a thread (124 ->
    # 96 without it; jaxlib's compile, benchmarks.deviceless).
    filled = full_ref[s] > 0

    def write(which, x):
      out_ref = cache_outs[0 if shared_cache else which]
      amax = common.finite_tile_amax(x, native)
      index = _scale_index(unit, layer, h, num_units, num_heads, scales_block_major)
      scale, s_old, grown = _update_scale(
          scale_outs[which], None if requant_in_write else grown_outs[which], index,
          s * num_heads + h, amax, fresh, h_ok, dtype, native)
      inv = 1.0 / scale
      stored = common.quantize_stored(x * inv[None, :, None], dtype, out_ref.dtype, native)
      _store_chunk(out_ref, planes[which], layer * num_blocks, slot, in_seg, filled,
                   h, h_ok, d, d_ok, stored, mask,
                   first_slot=start if slot_is_position else None)
      if requant_in_write:   # the block's older tokens, where its scale grew
        pl.when(jnp.max(jnp.where(grown, 1, 0)) > 0)(lambda: _requant_old(
            out_ref, planes[which], layer * num_blocks,
            unit * unit_size + lax.iota(jnp.int32, chunk),
            [jnp.where(in_seg, slot % unit_size, -1)], grown, s_old, inv, h, d, d_ok,
            unit_size, dtype, native))

    load = lambda which: common.load_rows(srcs[which], tokens, h, d, head_size, mask)
    if split_kv:
      for which in range(2):
        pl.when(cache_program == which)(functools.partial(
            lambda which: write(which, load(which)), which))
    else:
      kept = [load(which) for which in range(2)]
      for which in range(2):
        write(which, kept[which])

  _segment_loop(num_segments_ref, num_programs, _unless_empty(length_ref, segment))


def _update_scale(scale_ref, grown_ref, index, flag_index, amax, fresh, h_ok, dtype, native):
  """A segment's scales [HB] at ``index`` after this write (amax [HB] of its new tokens),
  stored in place, and its grown flags (the old scale where it grew, else -1) at
  ``flag_index`` (grown_ref None: not stored); returns (the new scales, the old ones,
  whether each grew, False past num_heads)."""
  s_old = lowering.load(scale_ref.at[jnp.where(h_ok, index, 0)], mask=h_ok, other=0.0)
  scale, grown = _new_scale(amax, s_old, fresh, dtype)
  lowering.block_barrier(native)   # every warp has read s_old before it is replaced
  common.store_flat(scale_ref, index, scale, h_ok)
  if grown_ref is not None:
    common.store_flat(grown_ref, flag_index, jnp.where(grown, s_old, -1.0), h_ok)
  return scale, s_old, grown & h_ok


def _new_scale(amax, s_old, fresh, dtype):
  """(the block's scale after this write, whether it grew over an older one) [HB]."""
  s_new = quant.scale_of(jnp.maximum(amax, quant.AMAX_FLOOR), dtype)
  grows = s_new > s_old
  return jnp.where(fresh | grows, s_new, s_old), grows & jnp.logical_not(fresh)


def _walk_write_kernel(num_segments_ref, start_ref, length_ref, token_ref, slot_ref, layer_ref,
                       key_ref, value_ref,   # as _block_write_kernel's (no full_ref)
                       *refs,                # as _block_write_kernel's
                       num_programs, num_heads, head_size, block_size, num_blocks, unit_size,
                       chunk, heads_per_program, key_plane, value_plane, dtype,
                       scales_block_major, shared_cache, split_kv, native,
                       slot_is_position):
  """Scale blocks of several chunks (asm_pa 128 / 256): program p owns segments p, p + P, ...
  and walks each segment's chunks twice: their amaxes, then (under the new scale) their
  tokens quantized and stored (the second walk reads the tokens again). Writes the scale
  and the grown flag as _block_write_kernel; K and V together, or with ``split_kv`` one of
  them a program (grid axis 2). (A program per (segment, chunk) in two
  launches, chunk amaxes then the write, was slower: H200, 32K int8, asm_pa 128 over
  128-token pages 186 us against 173 walking 16-token chunks, 148 walking 32; 16-token
  pages 356 against 299; asm_pa 256 294 against 193.)"""
  cache_outs, scale_outs, grown_outs = _write_outputs(refs, shared_cache)
  num_units = num_blocks * block_size // unit_size
  h, h_ok, d, d_ok = _head_lanes(heads_per_program, num_heads, head_size)
  layer = layer_ref[0]
  planes, srcs = (key_plane, value_plane), (key_ref, value_ref)
  cache_program = pl.program_id(2) if split_kv else None   # (read outside the loop)

  slots = None if slot_is_position else slot_ref

  def walk(s, which_caches):
    start, length = start_ref[s], length_ref[s]
    unit, fresh = _first_slot(start, token_ref, slots, unit_size)
    num_chunks = (length + chunk - 1) // chunk

    def chunk_of(c):
      tokens, slot, in_seg = _segment_chunk(start, length, c, chunk, token_ref, slots)
      return tokens, slot, in_seg, in_seg[:, None, None] & h_ok[None, :, None] & d_ok

    def amax_step(c, amaxes):
      tokens, _, _, mask = chunk_of(c)
      return tuple(
          jnp.maximum(amax, common.finite_tile_amax(
              common.load_rows(srcs[which], tokens, h, d, head_size, mask), native))
          for amax, which in zip(amaxes, which_caches))

    amaxes = lax.fori_loop(0, num_chunks, amax_step,
                           (jnp.zeros(h.shape, jnp.float32),) * len(which_caches))
    scales = []
    # An empty segment (no chunk walked) leaves its scales alone: every lane masked (a
    # branch around the walk instead: 96 -> 128 registers, jaxlib's compile).
    h_written = h_ok & (length > 0)
    for amax, which in zip(amaxes, which_caches):
      index = _scale_index(unit, layer, h, num_units, num_heads, scales_block_major)
      scales.append(_update_scale(scale_outs[which], grown_outs[which], index,
                                  s * num_heads + h, amax, fresh, h_written, dtype,
                                  native)[0])

    def write_step(c, carry):
      tokens, slot, in_seg, mask = chunk_of(c)
      for scale, which in zip(scales, which_caches):
        out_ref = cache_outs[0 if shared_cache else which]
        x = common.load_rows(srcs[which], tokens, h, d, head_size, mask)
        stored = common.quantize_stored(x * (1.0 / scale)[None, :, None], dtype,
                                        out_ref.dtype, native)
        _store_chunk(out_ref, planes[which], layer * num_blocks, slot, in_seg, _all(in_seg),
                     h, h_ok, d, d_ok, stored, mask,
                     first_slot=start + c * chunk if slot_is_position else None)
      return carry

    lax.fori_loop(0, num_chunks, write_step, 0)

  def segment(s):
    if not split_kv:
      walk(s, (0, 1))
      return
    for which in range(2):
      pl.when(cache_program == which)(functools.partial(walk, s, (which,)))

  _segment_loop(num_segments_ref, num_programs, segment)


def _store_chunk(out_ref, plane: Plane, first_row, slot, in_seg, filled, heads, h_ok, dims,
                 d_ok, values, mask, first_slot=None):
  """Stores a segment chunk's values [chunk, HB, DP] at its slots [chunk] (rows from
  ``first_row``, the layer's first). ``first_slot`` (a chunk-aligned scalar; index_by_slot's
  segments): the slots are ``first_slot + 0 .. chunk - 1``, holes where not ``in_seg``;
  on a token-fastest plane, inside one block, they are stored as a run
  (:func:`_store_run`), the mask per token only where the chunk has holes (a full chunk's
  stores vectorize along tokens), and the kernel holds no scatter path; elsewhere by slot
  (the slots computed, not loaded). Otherwise, on a token-fastest plane a chunk that fills ``chunk``
  consecutive slots from a chunk-aligned one (``filled``: no lane past the segment; a
  prefill page) is stored as a run, the others by slot (every chunk by slot, H200 32K fp8
  vllm: 121 us against 112 with runs)."""
  chunk, block_size = slot.shape[0], plane.block_size
  if first_slot is not None and plane.tokens_fastest and block_size % chunk == 0:
    store = lambda lanes: _store_run(out_ref, plane, first_row, first_slot, heads, dims,
                                     values, lanes)
    lanes = h_ok[None, :, None] & d_ok
    pl.when(filled)(lambda: store(lanes))
    pl.when(jnp.logical_not(filled))(lambda: store(_rebuilt(in_seg)[:, None, None] & lanes))
    return

  def scattered():
    common.store_tile(out_ref, plane, first_row + slot // block_size, slot % block_size,
                      heads, dims, values, mask)

  if not (plane.tokens_fastest and block_size % chunk == 0):
    scattered()
    return
  first = jnp.min(jnp.where(in_seg, slot, jnp.iinfo(jnp.int32).max))
  last = jnp.max(jnp.where(in_seg, slot, -1))
  run = filled & (last - first == chunk - 1) & (first % chunk == 0)   # slots increase
  pl.when(jnp.logical_not(run))(scattered)

  @pl.when(run)
  def _():
    _store_run(out_ref, plane, first_row, first, heads, dims, values,
               h_ok[None, :, None] & d_ok)


def _requant_old(out_ref, plane: Plane, first_row, slots, written_offsets, grown, s_old, inv,
                 heads, dims, d_ok, unit_size, dtype, native):
  """Re-quantizes in place the tokens at ``slots`` [n] (of one scale block) that this write
  does not store (their offset in the block in none of ``written_offsets``, each [m], -1
  for none), for the heads whose scale grew (``grown`` [HB]): old value * s_old * inv (inv
  = 1 / the new scale), [HB] each. ``first_row``: the layer's first cache row."""
  block_size = plane.block_size
  offsets_in_unit = slots % unit_size
  written = jnp.zeros(slots.shape, jnp.bool_)
  for offs in written_offsets:
    written = written | (jnp.max(jnp.where(offsets_in_unit[:, None] == offs[None, :], 1, 0),
                                 axis=1) > 0)
  rows = first_row + slots // block_size
  mask = jnp.logical_not(written)[:, None, None] & grown[None, :, None] & d_ok[None, None, :]
  offsets = (plane.token_offset(slots % block_size)[:, None, None]
             + plane.elem_offset(heads[None, :, None], dims[None, None, :]))
  full = (slots.shape[0], heads.shape[0], dims.shape[0])
  old = lowering.load(out_ref.at[jnp.broadcast_to(rows[:, None, None], full),
                                 jnp.broadcast_to(offsets, full)], mask=mask)
  y = _dequantize(old, dtype) * s_old[None, :, None] * inv[None, :, None]
  common.store_tile(out_ref, plane, rows, slots % block_size, heads, dims,
                    common.quantize_stored(y, dtype, out_ref.dtype, native), mask)


def _block_requant_kernel(num_segments_ref,   # int32 [1]
                          start_ref,          # int32 [S]: segment starts
                          length_ref,         # int32 [S]: segment lengths
                          token_ref,          # int32 [N]: token rows (-1: none)
                          slot_ref,           # int32 [N]: slots, grouped by segment
                                              # (unread with slot_is_position)
                          layer_ref,          # int32 [1]
                          k_grown_ref,        # float32 [S * H]: old scale where grown, -1
                          v_grown_ref,        # float32 [S * H]
                          *refs,              # k / v scales float32 [L * units * H] (the
                                              # new ones), caches [L * nb, block elems],
                                              # then the caches as outputs (aliased)
                          segments_per_program, num_heads, head_size, block_size,
                          num_blocks, unit_size, chunk, heads_per_program, key_plane,
                          value_plane, dtype, scales_block_major, shared_cache, native,
                          slot_is_position):
  """Where a segment's scale grew: the block's older tokens (those not written now)
  dequantized with the old scale and re-quantized with the new one, in place. Program p
  owns segments p * G .. p * G + G - 1 (G = segments_per_program) and loads their grown
  flags first, in one load, and stops after one reduction over them where none grew
  (every program of a prefill into fresh blocks)."""
  num_caches = 1 if shared_cache else 2
  scale_refs, cache_outs = refs[:2], refs[2 + num_caches:]   # k / v scales, caches, outs
  num_units = num_blocks * block_size // unit_size
  h, h_ok, d, d_ok = _head_lanes(heads_per_program, num_heads, head_size)
  layer = layer_ref[0]
  num_chunks = unit_size // chunk
  j = lax.iota(jnp.int32, chunk)
  planes, grown_refs = (key_plane, value_plane), (k_grown_ref, v_grown_ref)
  slots = None if slot_is_position else slot_ref

  group = segments_per_program
  g = lax.iota(jnp.int32, group)
  first = pl.program_id(0) * group
  # An empty segment's flags were never written (the write kernel skipped it).
  in_use = (first + g) < num_segments_ref[0]
  in_use &= lowering.load(length_ref.at[jnp.where(in_use, first + g, 0)], mask=in_use,
                          other=0) > 0
  flag_ok = in_use[:, None] & h_ok[None, :]
  flag_index = jnp.where(flag_ok, (first + g)[:, None] * num_heads + h[None, :], 0)
  # [G, HB] per cache: the old scale where the segment's scale grew, else -1.
  flags = [lowering.load(ref.at[flag_index], mask=flag_ok, other=-1.0) for ref in grown_refs]

  def segment(i, carry):
    s_olds = [jnp.max(jnp.where((g == i)[:, None], f, -1.0), axis=0) for f in flags]
    grown = [h_ok & (s_old >= 0.0) for s_old in s_olds]

    @pl.when(jnp.max(jnp.where(grown[0] | grown[1], 1, 0)) > 0)
    def _():
      s = first + i
      start, length = start_ref[s], length_ref[s]
      unit = (start if slots is None else slots[start]) // unit_size
      for which in range(2):
        requant(which, start, length, unit, s_olds[which], grown[which])
    return carry

  def requant(which, start, length, unit, s_old, grown):
    @pl.when(jnp.max(jnp.where(grown, 1, 0)) > 0)
    def _():
      out_ref, plane = cache_outs[0 if shared_cache else which], planes[which]
      index = _scale_index(unit, layer, h, num_units, num_heads, scales_block_major)
      inv = 1.0 / lowering.load(scale_refs[which].at[jnp.where(h_ok, index, 0)], mask=h_ok,
                                other=1.0)
      # Offsets (in the unit) of the segment's new tokens, -1 for none: left alone.
      written_offsets = []
      for c in range(num_chunks):
        _, slot, in_seg = _segment_chunk(start, length, c, chunk, token_ref, slots)
        written_offsets.append(jnp.where(in_seg, slot % unit_size, -1))
      for c in range(num_chunks):
        _requant_old(out_ref, plane, layer * num_blocks, unit * unit_size + c * chunk + j,
                     written_offsets, grown, s_old, inv, h, d, d_ok, unit_size, dtype,
                     native)

  # One reduction over every flag first: a program none of whose segments grew (every
  # program of a prefill into fresh blocks) stops there, without a reduction per segment.
  any_grown = jnp.maximum(jnp.max(flags[0]), jnp.max(flags[1])) >= 0.0
  @pl.when(any_grown)
  def _():
    lax.fori_loop(0, group, segment, 0)


# The re-quantization pass of a prefill-sized write (at least 8 x this many segments: most
# blocks fresh, nothing to re-quantize) runs about this many programs, each for up to 16
# segments and 8 heads of d128: a program loads its segments' grown flags at once, so the
# pass costs one load per program. H200, 32K fp8 vllm: 14.6 us with a program per
# (segment, 4 heads), 5.7 with 16 segments x 8 heads. A smaller write (a decode step,
# whose blocks grow) keeps a program per (segment, head group of the write).
REQUANT_PROGRAMS = 128


def _requant_group(max_segments: int, num_chunks: int) -> int:
  """Segments per re-quantization program: a power of two, at most 16."""
  if num_chunks > 1 or max_segments < 8 * REQUANT_PROGRAMS:
    return 1
  group = min(16, max_segments // REQUANT_PROGRAMS)
  return 1 << (group.bit_length() - 1)


def _chunk_size(unit_size: int, most: int) -> int:
  """Tokens a kernel chunk holds: the largest power of two (a Triton tile) dividing
  ``unit_size`` and at most ``most``. A chunk that does not divide the scale block would
  leave its last offsets unwritten and never re-quantized (scale blocks of 24 or 160
  tokens)."""
  chunk = 1
  while chunk * 2 <= most and unit_size % (chunk * 2) == 0:
    chunk *= 2
  return chunk


def block_quant(key, value, key_cache, value_cache, k_scales, v_scales, segments, layer, *,
                key_plane: Plane, value_plane: Plane, num_blocks: int, unit_size: int,
                scales_block_major: bool, interpret: bool, max_programs: int = 2048,
                tokens_per_chunk: int | None = None, heads_per_program: int | None = None,
                num_warps: int | None = None, requant_segments_per_program: int | None = None,
                split_kv: bool | None = None, requant_in_write: bool | None = None):
  """Per-block FP8 / INT8 write (see :func:`jkv.reference.quant_write.write_block_quant`).

  segments: :class:`jkv.segments.Segments` of the slot mapping for ``unit_size`` tokens
  per scale block. k_scales, v_scales float32 block-major [L, units, H] or head-major
  [L, H, units]. Returns the four arrays. The keywords after ``interpret`` are launch
  parameters (benchmark sweeps); None picks the measured default.
  """
  num_tokens, num_heads, head_size = key.shape
  caches = (key_cache,) if value_cache is None else (key_cache, value_cache)
  block_elems = key_plane.block_size * num_heads * head_size * (2 if value_cache is None else 1)
  views = common.cache_views(caches, block_elems)
  # Chunks of 16 tokens (a block); scale blocks of 128 or more are walked in 64 with 8 warps
  # (H200, 32K int8, asm_pa 128: 173 us with 16-token chunks and 4 warps, 148 with 32 and
  # 4, 172 with 64 and 4, 144 with 64 and 8; 2026-12-05, fp8, profiler, the walk kernel
  # after the index-math fix: asm_pa 128 112.0 us with 32 and 4, 100.7 with 64 and 8,
  # whole 128-token blocks in one chunk 242-311; the call 126.2 / 110.5 us, 122.1 with 32
  # and 8; asm_pa 256 139.0 / 129.9).
  wide = unit_size >= 128
  chunk = _chunk_size(unit_size, tokens_per_chunk or (64 if wide else 16))
  # Scale blocks of one chunk keep K and V in registers: 2 heads of d128 per program (H200,
  # 32K fp8, kernel time: vllm 112 us with 2 heads and 2 warps, 117 with 4 heads and 4
  # warps (255 registers, spilled), 136 with 8 and 4, 192 with 4 and 2; flash 64 with 2 and
  # 4 warps, 86 with 2 and 2). Walked scale blocks (asm_pa) take 1 (H200, 32K int8,
  # asm_pa 128, 16-token chunks: 173 us against 195 with 2 heads, 226 with 4).
  hb = heads_per_program or common.head_group(
      num_heads, head_size, chunk, target=2048 if unit_size > chunk else 4096)
  num_chunks = unit_size // chunk
  # Scale blocks of 128 or more split K and V between programs, 1 head and 4 warps each
  # (H100, 32K fp8, asm_pa 128, walk kernel: 115.8 us with K and V together and 8 warps,
  # 97.5 split with 8 warps, 92.8 split with 4, 109.5 split with 2 heads and 8 warps;
  # 2026-12-05). Scale blocks of one chunk keep them together (H100, 32K fp8, write
  # kernel: vllm 136 us, split 158-174 with 2-8 heads; flash 82.5, split 83.3-94.8).
  if split_kv is None:
    split_kv = wide
  # Slots computed from positions serve the run stores of token-fastest planes; where
  # every store scatters (flash, HND) they are loaded (H200, 32K, write kernel, loaded ->
  # computed: vllm fp8 97.9 -> 89.5 us, int8 106.3 -> 97.3; flash fp8 66.5 -> 70.4, int8
  # 75.5 -> 75.0; 2026-12-06, profiler).
  runs = key_plane.tokens_fastest or value_plane.tokens_fastest   # a plane stores runs
  slot_is_position = segments.slot_is_position and runs
  max_segments = segments.start.shape[0]
  # Computed slots free registers (174 instead of 255 at 2 warps), so 4 warps pay off there
  # where the tokens fill their scale blocks, at least half on average (H100, 32K fp8 vllm,
  # the call: 2 heads / 2 warps 109.3 us, 2 / 4 104.2, 1 / 2 104.4, 4 / 4 118.0, 1 / 1
  # 115.7; int8 115.9 -> 108.7 with 4 warps), not for a decode step's single tokens (256
  # into 4096 blocks, 4 warps: int8 vllm 24.3 -> 24.6 us, fp8 23.0 -> 23.5; 2026-12-06).
  fills = 2 * num_tokens >= max_segments * unit_size   # a prefill, not a decode step
  if num_warps is None and wide:
    num_warps = 4 if split_kv else 8
  elif num_warps is None:
    narrow = value_plane.tokens_fastest and num_chunks == 1 and not (slot_is_position and fills)
    num_warps = 2 if narrow else 4
  num_programs = max(1, min(max_segments, num_tokens, max_programs))
  static = dict(num_programs=num_programs, num_heads=num_heads, head_size=head_size,
                block_size=key_plane.block_size, num_blocks=num_blocks, unit_size=unit_size,
                chunk=chunk, heads_per_program=hb, scales_block_major=scales_block_major,
                key_plane=key_plane, value_plane=value_plane, dtype=key_cache.dtype,
                shared_cache=value_cache is None, split_kv=split_kv, native=not interpret,
                slot_is_position=slot_is_position)
  grid = (num_programs, pl.cdiv(num_heads, hb)) + ((2,) if split_kv else ())
  scales = (k_scales.reshape(-1), v_scales.reshape(-1))
  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  seg = (segments.num_segments.reshape(1), segments.start, segments.length)
  # Slots that are positions are never loaded: the token rows stand in for them, so XLA
  # does not build index_by_slot's iota over the cache's slots.
  slot_rows = segments.token if slot_is_position else segments.slot
  rows = (segments.token, slot_rows, layer, key.reshape(num_tokens, -1),
          value.reshape(num_tokens, -1))
  arrays = tuple(views) + scales
  # Decode-sized writes of scale blocks of one chunk on planes where every store scatters
  # (flash, HND, packed) re-quantize their older tokens in the write kernel, with no pass
  # of their own (H100, 256 tokens into 4096 blocks, the call: flash int8 22.9 -> 20.9 us,
  # fp8 20.6 -> 18.8; hnd int8 22.4 -> 20.6, fp8 20.1 -> 18.6). A prefill keeps the pass:
  # the write kernel's extra registers cost more than the pass (32K, flash fp8 89.4 -> 92.3
  # us, int8 93.8 -> 97.4; 2026-12-06), as they do on token-fastest planes.
  if requant_in_write is None:
    requant_in_write = num_chunks == 1 and not fills and not runs
  if requant_in_write and num_chunks != 1:
    raise ValueError(f"requant_in_write needs scale blocks of one chunk, got {num_chunks}")
  if num_chunks == 1:
    kernel = functools.partial(_block_write_kernel, **static,
                               requant_in_write=requant_in_write)
    inputs = seg + (segments.full,) + rows
  else:
    kernel = functools.partial(_walk_write_kernel, **static)
    inputs = seg + rows
  per_head = jax.ShapeDtypeStruct((max_segments * num_heads,), jnp.float32)
  outs = lowering.call_in_place(kernel, inputs, arrays, grid=grid, interpret=interpret,
                                num_warps=num_warps,
                                name=("jkv_block_quant_write" if num_chunks == 1
                                      else "jkv_block_quant_walk_write"),
                                new_outputs=() if requant_in_write else (per_head,) * 2)
  if requant_in_write:
    return _outputs(outs, caches, k_scales, v_scales)
  views, scales, grown = outs[:len(views)], outs[len(views):len(views) + 2], outs[-2:]
  group = requant_segments_per_program or _requant_group(max_segments, num_chunks)
  # Grouped programs (mostly segments that did not grow) take every head of d128.
  requant_hb = hb if group == 1 else common.head_group(num_heads, head_size, chunk,
                                                       target=16384)
  requant_static = dict(static, heads_per_program=requant_hb)
  for name in ("num_programs", "split_kv"):
    del requant_static[name]
  views = lowering.call_in_place(
      functools.partial(_block_requant_kernel, **requant_static, segments_per_program=group),
      (*seg, segments.token, slot_rows, layer, *grown, *scales), views,
      grid=(pl.cdiv(max_segments, group), pl.cdiv(num_heads, requant_hb)), interpret=interpret,
      num_warps=4, name="jkv_block_quant_requant")
  return _outputs(views + scales, caches, k_scales, v_scales)


def _outputs(outs, caches, k_scales, v_scales):
  """(key_cache, value_cache or None, k_scales, v_scales) from a kernel's cache views and
  flat scales (``outs``, any grown flags after them)."""
  cache_outs = common.restore_caches(outs[:len(caches)], caches)
  scales = outs[len(caches):len(caches) + 2]
  return (cache_outs[0], (None if len(caches) == 1 else cache_outs[1]),
          scales[0].reshape(k_scales.shape), scales[1].reshape(v_scales.shape))
