"""Prefill tiles of ragged paged attention for Mosaic GPU (Hopper TMA and wgmma): NHD / HND
pages, 16-bit caches or FP8 ones with per-tensor / per-head scales.

The kernel runs the long items of :func:`pallas_kernels.ragged_attention.work_lists` built
with ``TILE_Q`` tokens per item (a tile of consecutive query tokens of one sequence). A
program takes one item and ``wgs`` query heads of one KV head (2 when the GQA group is
even, else 1), in ``wgs + 1`` warpgroups:

* a **compute** warpgroup per query head: its ``TILE_Q`` rows (the item's tokens), loaded
  by TMA from ``query [T, Hq, D]`` into an unswizzled tile (a swizzled tile's global box
  must start at a multiple of 8 rows) and loaded into registers, wgmma's A operand; per
  K/V tile of ``TILE`` tokens ``S = Q K^T`` (float32), the mask, an online softmax in
  base 2 (the scale folded into the exponent), then ``acc += P V`` with P from registers,
  accumulated in place (interpreted: Q and P through swizzled shared memory tiles, a
  scoped accumulator added, what Pallas' GPU interpreter runs);
* a **memory** warpgroup that streams the item's pages into shared memory by TMA (one copy
  per page, or per 64-token part of a larger page), ``stages`` tiles in flight, so the
  compute warpgroups share every K/V tile: a stage is refilled once every compute
  warpgroup has arrived on its consumed barrier (an FP8 value stage once its tile is
  converted, below).

Tiles wholly before the item's first position (``info`` word ``FULL``: every row sees all
their keys, none outside the cache) skip the mask; the others mask causally per row, past
the item's last key and per copy for blocks outside the cache (those read as zeros: the
page id is past the view). Value rows past the item's last key are zeroed in shared
memory before ``P V`` (stale entries may hold NaN, and 0 * NaN is NaN): each compute
warpgroup rewrites the same values, so the race is benign. A warpgroup writes its rows,
normalized, in the query's dtype into ``out [items, Hq, TILE_Q, D]``; rows past the item's
tokens hold garbage, and :func:`pallas_kernels.ragged_attention.ragged_paged_attention`
gathers only the owned ones. Items that own no row (the work list's tail: its length is a
static bound) stop after reading their info row.

FP8 caches (e4m3fn / e5m2): the stages hold the FP8 tiles. Each compute warpgroup splits
its query rows once into e4m3 terms (two for a bf16 query, three for fp16; scaled per row
by a power of two, as the decode kernel does:
:func:`pallas_kernels.mosaic_attention.query_terms`), kept in registers in wgmma's 8-bit A
layout (interpreted: in shared memory), and ``S = Q K^T`` is two (three) FP8 wgmmas
straight from the key stage. The values, which FP8 wgmma cannot read as ``P V``'s
B operand (it contracts over their rows), are converted once by the memory warpgroup into
one of ``CONVERTED`` f16 slots the compute warpgroups share (P in f16 too), while they run
the matmuls of the tile before; it refills a value stage as soon as its tile is
converted, a key stage once every compute warpgroup has read it. The key scale multiplies
the base-2 exponent with the softmax scale and ``1 / c`` (one factor per row; a zero
key scale counts as float32's smallest normal, so masked logits stay -inf), the value scale
the output.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jkv.layout import Plane
from pallas_kernels import lowering
from pallas_kernels.mosaic_attention import (FP8, INFO, QUERY_TERMS, TILE, PageTiles,
                                             copy_info_row, info_copies, page_views,
                                             query_row_scale, query_term_count,
                                             query_terms, scale_rows, split_query,
                                             zero_rows_past)

TILE_Q = 64        # query tokens per item: wgmma's M
# TILE (tokens per K/V tile: wgmma's N for Q K^T, its K for P V) and INFO (int32 words
# before the item's page ids in its info row, 128 bytes) are the decode kernel's.
KV_END, POS0, ROW0, FULL, OWNED = range(5)   # the info row's words: keys < KV_END, the
                                             # first row's position, its query row, unmasked
                                             # tiles, the rows the item owns
CONVERTED = 2      # FP8 caches: f16 value slots the memory warpgroup converts into (the FP8
                   # prefill of RESULTS.md, H200: 3 slots 2084 us against 2101 with the
                   # registers 208 / 88, 2073 against 2052 with 224 / 56)
# Registers per thread of the compute warpgroups (2 / 1 of them) and of the memory one:
# {FP8: ((with 2, with 1), memory)}; FP8 caches give the memory warpgroup what its
# conversion holds. The compute warpgroups' increase waits for the registers the memory
# one releases: the counts must fit what the program's threads hold at launch (see
# _register_budget), or the kernel hangs. (With one compute warpgroup, 240 lies below the
# 248 a thread holds at launch, so its "increase" asks for no more: 248 and 256 ran no
# faster, 2148 and 2127 us against 2123 for a bf16 prefill of GQA group 3, H200.)
# FP8 (the memory warpgroup converting the values only), H200: 224 / 56 2052 us, 216 / 72
# 2083, 208 / 88 2101, 232 / 40 2120; with one factor per row in the exponent (below),
# 216 / 72 2004 against 224 / 56 2019 (one run), 232 / 40 2067, 208 / 88 2098 against 2103
# (another run). H100 (2026-12-06, bf16 1802-1807 us): 208 / 88 2004.4, 2005.2, 2008.3
# against 216 / 72 2032.4, 2028.0, 2028.1; 224 / 56 2026.7, 200 / 104 2046.7, 192 / 120
# 2033.3.
REGISTERS = {False: ((232, 240), 40), True: ((208, 240), 88)}
_SMEM_LIMIT = 200 * 1024
_LOG2E = math.log2(math.e)
_16_BIT = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def smem_bytes(head_size: int, stages: int, wgs: int, words: int,
               cache_itemsize: int = 2) -> int:
  """Shared memory of one compiled program: the query tiles (as loaded and swizzled), the
  K / V stages, for FP8 caches the converted value slots, the info row of ``words`` int32
  (interpreted, FP8 caches add the query's e4m3 terms, with no limit to meet)."""
  converted = CONVERTED * TILE * head_size * 2 if cache_itemsize == 1 else 0
  return (4 * wgs * TILE_Q * head_size + 2 * stages * TILE * head_size * cache_itemsize
          + converted + words * 4 + 1024)


def _register_budget(wgs: int, fp8: bool) -> tuple[int, int]:
  """(compute, memory) registers per thread of ``REGISTERS``; ValueError unless the
  warpgroups' counts fit the 64K registers split evenly at launch (65536 / threads per
  thread, at most 255, rounded down to 8: 168 for three warpgroups, 248 for two)."""
  compute, memory = REGISTERS[fp8]
  compute = compute[2 - wgs]
  at_launch = min(65536 // (128 * (wgs + 1)), 255) // 8 * 8
  if wgs * compute + memory > (wgs + 1) * at_launch:
    raise ValueError(f"{wgs} x {compute} + {memory} registers per thread exceed the "
                     f"{(wgs + 1) * at_launch} that {wgs + 1} warpgroups hold at launch")
  return compute, memory


def info_width(width: int) -> int:
  """Words of an item's info row for block tables of ``width`` pages (whole 128 bytes)."""
  return -(-(INFO + width) // 32) * 32


def warpgroups(group: int) -> int:
  """Compute warpgroups (query heads) per program: 2 when the group is even, else 1."""
  return 2 if group % 2 == 0 else 1


def supported(key_plane: Plane, value_plane: Plane, query_dtype, cache_dtype, group: int,
              width: int, *, scale: float, quant: str, alibi: bool, soft_cap: bool,
              window: bool, sinks: bool) -> bool:
  """Whether this kernel runs the prefill tiles of the case:

  * NHD / HND planes (flash, hnd, packed layouts), pages of at least 8 tokens, a power of
    two (64-token tiles are whole pages or whole parts of one);
  * a bf16 / fp16 query and a cache of the same dtype (no quantization), or an FP8 cache
    (e4m3fn / e5m2) with per-tensor / per-head scales (``quant`` ``"tensor"``, head_size
    128: 128-byte swizzled rows);
  * head_size 64 or 128, shared memory within ``_SMEM_LIMIT`` for block tables of
    ``width`` pages (2 stages);
  * a positive ``scale`` (masked logits are -inf before the scale, folded into exp2's
    argument, multiplies them);
  * no ALiBi, soft cap, sliding window or sinks (those run on the Triton kernel).
  """
  planes_ok = all(p.kind in ("NHD", "HND") for p in (key_plane, value_plane))
  bs, d = key_plane.block_size, key_plane.head_size
  query_dtype, cache_dtype = np.dtype(query_dtype), np.dtype(cache_dtype)
  dtype_ok = query_dtype in _16_BIT and (
      (quant == "none" and cache_dtype == query_dtype)
      or (quant == "tensor" and cache_dtype in FP8 and d == 128))
  shape_ok = bs >= 8 and bs & (bs - 1) == 0 and d in (64, 128)
  smem_ok = smem_bytes(d, 2, warpgroups(group), info_width(width),
                       cache_dtype.itemsize) <= _SMEM_LIMIT
  options = alibi or soft_cap or window or sinks
  return (planes_ok and dtype_ok and shape_ok and smem_ok and scale > 0 and not options
          and lowering.mosaic_available())


def _kernel(info_ref,    # int32 [items, info_width] GMEM: KV_END, POS0, ROW0, FULL, OWNED,
                         # then from INFO the sequence's page ids (outside the cache:
                         # num_pages)
            query_ref,   # [T, Hq, D] GMEM
            key_ref,     # [pages, bs, H, row] (NHD) or [pages, H, bs, row] (HND) GMEM
            value_ref,
            scale_ref,   # float32 [2, >= H] GMEM: k_scale, v_scale per head (FP8), or None
            out_ref,     # [items, Hq, TILE_Q, D] GMEM
            scoped, *, group, wgs, planes, head_size, stages, scale, num_pages, interpret):
  plgpu = lowering.plgpu
  buffers, loaded, (k_free, v_free) = scoped
  info_smem, q_raw, q_smem, k_smem, v_smem, p_smem, scale_smem, q8, v16 = buffers
  info_bar, q_bars, k_bars, v_bars, scale_bar, v16_bars = loaded
  fp8 = scale_ref is not None
  wg = lax.axis_index("wg")
  item = lax.axis_index("item")
  first_head = lax.axis_index("heads") * wgs
  kv_head = first_head // group
  tiles = PageTiles(planes[0].block_size)
  wgmma = plgpu.Layout.WGMMA
  compute_registers, memory_registers = _register_budget(wgs, fp8)
  # The value tiles the compute warpgroups read: the stages, or the FP8 stages' converted
  # slots (the keys: the stages, FP8 or not).
  v_tiles, v_ready, v_slots = ((v16, v16_bars, CONVERTED) if fp8
                               else (v_smem, v_bars, stages))

  @pl.when(wg == wgs)
  def _memory():
    plgpu.set_max_registers(memory_registers, action="decrease")
    copy_info_row(info_ref.at[item], info_smem, info_bar)
    plgpu.barrier_wait(info_bar)
    if fp8:   # only for the compute warpgroups that wait for it (no copy left in flight)
      pl.when(info_smem[OWNED] > 0)(
          lambda: plgpu.copy_gmem_to_smem(scale_ref, scale_smem, scale_bar))
    num_tiles = (info_smem[KV_END] + TILE - 1) // TILE

    def issue(t, slot, ref, plane, stage, bars):
      for p in range(tiles.copies):
        rows = tiles.rows_of(t)
        page = tiles.page(info_smem, t, p)
        plgpu.copy_gmem_to_smem(tiles.source(ref, plane, page, rows, kv_head, head_size),
                                stage.at[slot, tiles.part(p)], bars.at[slot])

    keys = functools.partial(issue, ref=key_ref, plane=planes[0], stage=k_smem, bars=k_bars)
    values = functools.partial(issue, ref=value_ref, plane=planes[1], stage=v_smem,
                               bars=v_bars)
    def first(t):
      keys(t, lax.rem(t, stages))
      values(t, lax.rem(t, stages))

    for i in range(stages):
      pl.when(i < num_tiles)(functools.partial(first, i))

    def refill(t, carry):
      slot = lax.rem(t, stages)
      plgpu.barrier_wait(k_free.at[slot])
      keys(t, slot)
      plgpu.barrier_wait(v_free.at[slot])
      values(t, slot)
      return carry

    def convert(t, carry, reuse):
      """FP8 tile ``t``: its values loaded, converted into f16 slot ``t % CONVERTED``
      (once every compute warpgroup released it: ``reuse``), their stage refilled, then
      the key stage once every compute warpgroup has read its keys."""
      slot, converted = lax.rem(t, stages), lax.rem(t, CONVERTED)
      plgpu.barrier_wait(v_bars.at[slot])
      x = plgpu.load(v_smem.at[slot], layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(jnp.float16)
      if reuse:
        plgpu.barrier_wait(v_free.at[converted])
      v16.at[converted][...] = x
      plgpu.commit_smem()   # also orders the stage's reads before its refill's TMA writes
      plgpu.barrier_arrive(v16_bars.at[converted])

      @pl.when(t + stages < num_tiles)
      def _refill():
        values(t + stages, slot)
        plgpu.barrier_wait(k_free.at[slot])
        keys(t + stages, slot)

      return carry

    if fp8:
      fresh = jnp.minimum(num_tiles, CONVERTED)
      lax.fori_loop(0, fresh, functools.partial(convert, reuse=False), 0)
      lax.fori_loop(fresh, num_tiles, functools.partial(convert, reuse=True), 0)
    else:
      lax.fori_loop(stages, num_tiles, refill, 0)

  def _rows():
    head = first_head + wg
    # Into an unswizzled tile (a tiled GMEM box must start at a multiple of its 8-row tile,
    # and ROW0 is any row), then through registers into wgmma's swizzled operand tile.
    plgpu.copy_gmem_to_smem(query_ref.at[pl.ds(info_smem[ROW0], TILE_Q), head],
                            q_raw.at[wg], q_bars.at[wg])
    kv_end, pos0, full = info_smem[KV_END], info_smem[POS0], info_smem[FULL]
    num_tiles = (kv_end + TILE - 1) // TILE
    plgpu.barrier_wait(q_bars.at[wg])
    # Compiled: the query stays in registers, wgmma's A (1965 -> 1788 us for the bf16
    # prefill of RESULTS.md, H200: fewer shared-memory reads per tile); interpreted: in
    # its swizzled tile.
    query = plgpu.load(q_raw.at[wg], layout=wgmma, optimized=False)
    if fp8 and interpret:   # the e4m3 terms, in shared memory
      row_factor = split_query(query, q8.at[wg])
      plgpu.commit_smem()
      query = tuple(q8.at[wg, index] for index in range(q8.shape[1]))
    elif fp8:   # in registers, in the 8-bit A layout (4 values a register)
      row_factor = 1.0 / query_row_scale(query)
      layout = plgpu.Layout.WGMMA_8BIT
      query = query_terms(plgpu.load(q_raw.at[wg], layout=layout, optimized=False), layout)
    elif interpret:
      q_smem.at[wg][...] = query
      plgpu.commit_smem()
      query = (q_smem.at[wg],)
    else:
      query = (query,)
    logit_factor = scale * _LOG2E   # base-2 scores: exp2 of them is exp of the natural ones
    if fp8:
      plgpu.barrier_wait(scale_bar)
      # Per row also 1 / c and the key scale. Masked logits are -inf before it multiplies
      # them, so it must be > 0: a zero key scale (every logit 0) counts as float32's
      # smallest normal (the same uniform softmax); scales are > 0 (the writes reject others).
      logit_factor = jnp.maximum(row_factor * scale_smem[0, kv_head] * logit_factor,
                                 np.finfo(np.float32).tiny)
      v_factor = scale_smem[1, kv_head]

    def logits_of(t, s, masked):
      """Tile ``t``'s logits ``s`` [TILE_Q, TILE] float32, ``-inf`` where a row does not
      see the key when ``masked``."""
      if not masked:
        return s
      rows = plgpu.broadcasted_iota(jnp.int32, (TILE_Q, TILE), 0, layout=wgmma)
      columns = plgpu.broadcasted_iota(jnp.int32, (TILE_Q, TILE), 1, layout=wgmma)
      key_pos = t * TILE + columns
      visible = ((key_pos <= pos0 + rows) & (key_pos < kv_end)
                 & tiles.inside_cache(columns, info_smem, t, num_pages))
      return jnp.where(visible, s, -jnp.inf)

    def softmax(s, acc, running_max, running_sum):
      """The online softmax of a tile's logits ``s``: ``(probs, acc, max, sum)`` with
      ``acc`` rescaled to the new max and ``probs`` in the values' dtype (FP8: f16;
      probabilities lie in [0, 1])."""
      # Base-2 scores: the max of the raw logits times the (positive) factor, then one
      # multiply-add per element (FP8: a factor per row; the FP8 prefill of RESULTS.md,
      # H200: 2052 -> 2017 us against scaling the logits first).
      new_max = jnp.maximum(running_max, s.max(axis=1) * logit_factor)
      alpha = jnp.exp2(running_max - new_max)
      p = jnp.exp2(s * (lax.broadcast_in_dim(logit_factor, s.shape, [0]) if fp8
                        else logit_factor) - lax.broadcast_in_dim(new_max, s.shape, [0]))
      running_sum = running_sum * alpha + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      return p.astype(v_tiles.dtype), acc, new_max, running_sum

    def values_of(t, slot, last):
      """Tile ``t``'s value tile (slot ``slot``) in shared memory, once there; when it may
      be the item's ``last`` tile, its rows past the keys zeroed."""
      plgpu.barrier_wait(v_ready.at[slot])
      values = v_tiles.at[slot]
      if last:
        left = kv_end - t * TILE
        pl.when(left < TILE)(functools.partial(zero_rows_past, values, left, head_size))
        plgpu.commit_smem()
      return values

    def step(t, carry, masked):
      """Tile ``t``: ``S``, its softmax, then ``acc += P V``."""
      acc, running_max, running_sum = carry
      k_slot, v_slot = lax.rem(t, stages), lax.rem(t, v_slots)
      plgpu.barrier_wait(k_bars.at[k_slot])
      keys = k_smem.at[k_slot].transpose((1, 0))

      def logits(acc_ref):
        for q_term in query:
          plgpu.wgmma(acc_ref, q_term, keys)
        return acc_ref[...]

      s = pl.run_scoped(logits, plgpu.ACC((TILE_Q, TILE), jnp.float32))
      plgpu.barrier_arrive(k_free.at[k_slot])
      probs, acc, running_max, running_sum = softmax(logits_of(t, s, masked), acc,
                                                     running_max, running_sum)
      values = values_of(t, v_slot, masked)
      if interpret:   # P through shared memory, a fresh accumulator added
        p_smem.at[wg][...] = probs
        plgpu.commit_smem()

        def weighted_scoped(acc_ref):
          plgpu.wgmma(acc_ref, p_smem.at[wg], values)
          return acc_ref[...]

        acc = acc + pl.run_scoped(weighted_scoped, plgpu.ACC((TILE_Q, head_size), jnp.float32))
      else:           # P from registers, accumulated in place
        def weighted(acc_ref):
          plgpu.wgmma(acc_ref, probs, values)

        acc = pl.run_state(weighted)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(v_free.at[v_slot])
      return acc, running_max, running_sum

    def store_rows(acc, running_sum):
      inverse = (v_factor if fp8 else 1.0) / (running_sum + 1e-6)
      q_smem.at[wg][...] = (acc * lax.broadcast_in_dim(inverse, acc.shape, [0])).astype(
          q_smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem.at[wg], out_ref.at[item, head])
      plgpu.wait_smem_to_gmem(0)

    reduced = wgmma.reduce(1)
    acc = plgpu.layout_cast(jnp.zeros((TILE_Q, head_size), jnp.float32), wgmma)
    running_max = plgpu.layout_cast(jnp.full((TILE_Q,), -1e30, jnp.float32), reduced)
    running_sum = plgpu.layout_cast(jnp.zeros((TILE_Q,), jnp.float32), reduced)
    carry = lax.fori_loop(0, full, functools.partial(step, masked=False),
                          (acc, running_max, running_sum))
    acc, _, running_sum = lax.fori_loop(full, num_tiles, functools.partial(step, masked=True),
                                        carry)
    store_rows(acc, running_sum)

  @pl.when(wg < wgs)
  def _compute():
    plgpu.set_max_registers(compute_registers, action="increase")
    plgpu.barrier_wait(info_bar)
    # Items past the work list's end own no rows (their rows are never gathered): they stop
    # here, so a list of many empty items costs little more than its launch (with its
    # query and output copies, 8 us for 208 programs, H200).
    pl.when(info_smem[OWNED] > 0)(_rows)


def item_info(items, kv_lens, block_tables, layer, *, num_blocks: int, block_size: int,
              num_pages: int):
  """The info rows int32 [N, info_width] of the long items ``(seq, row0, owned, pos0)``
  (XLA): KV_END (the item's keys end, 0 when it owns no row), POS0, ROW0 (at least 0; a box
  past the query's rows reads TMA's zero fill), FULL (leading tiles every row sees whole,
  all blocks in the cache), OWNED, then from ``INFO`` the sequence's page ids offset to
  ``layer`` (outside the cache: ``num_pages``)."""
  seq, row0, owned, pos0 = items
  width = block_tables.shape[1]
  kv_end = jnp.where(owned > 0, jnp.minimum(pos0 + owned, kv_lens[seq]), 0)
  table = block_tables[seq]                                          # [N, W]
  inside = (table >= 0) & (table < num_blocks)
  needed = jnp.arange(width)[None, :] < (kv_end[:, None] + block_size - 1) // block_size
  first_outside = jnp.min(jnp.where(needed & ~inside, jnp.arange(width)[None, :], width),
                          axis=1)
  full = jnp.minimum(jnp.maximum(pos0 + 1, 0), first_outside * block_size) // TILE
  full = jnp.where(owned > 0, jnp.minimum(full, (kv_end + TILE - 1) // TILE), 0)
  pages = jnp.where(inside, table + layer * num_blocks, num_pages)
  header = jnp.stack([kv_end, pos0, jnp.maximum(row0, 0), full, owned], axis=1)
  return jnp.concatenate([header, jnp.zeros((seq.shape[0], INFO - header.shape[1]), jnp.int32),
                          pages, jnp.zeros((seq.shape[0], info_width(width) - INFO - width),
                                           jnp.int32)], axis=1)


def prefill(query, key_cache, value_cache, k_scale, v_scale, layer, block_tables, kv_lens,
            items, *, key_plane: Plane, value_plane: Plane, num_blocks: int, scale: float,
            interpret: bool, stages: int = 2):
  """The long items' rows over one layer of stacked caches (the cases :func:`supported`
  takes; see :mod:`jkv.ops.ragged_attention`).

  query [T, Hq, D] bf16 / fp16; key_cache / value_cache [L, ...] in the planes' NHD / HND
  layout (value_cache None: K and V share key_cache, packed); k_scale / v_scale float32 [H]
  or [1] (used for FP8 caches: keys read as stored by a query split into e4m3 terms,
  values and probabilities converted to f16, the scales applied to the logits and the
  output); layer int32
  scalar;
  block_tables int32 [S, W]; kv_lens int32 [S]; items: the long work list ``(seq, row0,
  owned, pos0)`` int32 [N] of ``TILE_Q``-token items. ``stages``: K/V tiles in flight.
  Returns [N, Hq, TILE_Q, D] in the query's dtype: item n's row j, head h at [n, h, j]
  (rows past the item's tokens: garbage).
  """
  plgpu = lowering.plgpu
  num_rows, num_q_heads, head_size = query.shape
  num_heads, bs = key_plane.num_heads, key_plane.block_size
  group = num_q_heads // num_heads
  wgs = warpgroups(group)
  views = page_views(key_cache, value_cache, key_plane, value_plane)
  num_pages = views[0].shape[0]
  info = item_info(items, kv_lens, block_tables, layer, num_blocks=num_blocks, block_size=bs,
                   num_pages=num_pages)
  if num_rows < TILE_Q:   # a query box of TILE_Q rows must fit the array
    query = jnp.pad(query, ((0, TILE_Q - num_rows), (0, 0), (0, 0)))
  num_items, words = info.shape
  dtype = query.dtype
  cache_dtype = np.dtype(views[0].dtype)
  fp8 = cache_dtype in FP8
  if smem_bytes(head_size, stages, wgs, words, cache_dtype.itemsize) > _SMEM_LIMIT:
    raise ValueError(f"{stages} stages of {head_size}-wide tiles and a {words}-word info row "
                     f"take more shared memory than a program may ({_SMEM_LIMIT} bytes)")
  operands = [info, query, *views]
  if fp8:
    operands.append(scale_rows(k_scale, v_scale, num_heads))
  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  stage = (plgpu.SMEM((stages, TILE, head_size), cache_dtype,
                      transforms=(plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128)))
           if fp8 else plgpu.SMEM((stages, TILE, head_size), dtype, transforms=swizzled))
  probs_dtype = jnp.float16 if fp8 else dtype

  def entry(info_ref, query_ref, key_ref, value_ref, *refs):
    scale_ref, out_ref = refs if fp8 else (None, *refs)
    buffers = (plgpu.SMEM((words,), jnp.int32),
               plgpu.SMEM((wgs, TILE_Q, head_size), dtype),
               # the output tile (interpreted: the query's wgmma tile first)
               plgpu.SMEM((wgs, TILE_Q, head_size), dtype, transforms=swizzled),
               stage, stage,
               # P in shared memory (Pallas' GPU interpreter lacks wgmma with A in registers)
               plgpu.SMEM((wgs, TILE_Q, TILE), probs_dtype, transforms=swizzled) if interpret
               else None,
               plgpu.SMEM(operands[-1].shape, jnp.float32) if fp8 else None,
               # FP8: the query's e4m3 terms per compute warpgroup (interpreted), the
               # converted values
               plgpu.SMEM((wgs, query_term_count(dtype), TILE_Q, head_size), QUERY_TERMS,
                          transforms=stage.transforms) if fp8 and interpret else None,
               plgpu.SMEM((CONVERTED, TILE, head_size), jnp.float16, transforms=swizzled)
               if fp8 else None)
    loaded = (plgpu.Barrier(num_arrivals=info_copies(words)),
              plgpu.Barrier(num_barriers=wgs),
              plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
              plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
              plgpu.Barrier() if fp8 else None,
              plgpu.Barrier(num_barriers=CONVERTED) if fp8 else None)
    consumed = (plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
                plgpu.Barrier(num_arrivals=wgs, num_barriers=CONVERTED if fp8 else stages))
    pl.run_scoped(
        lambda *scoped: _kernel(info_ref, query_ref, key_ref, value_ref, scale_ref, out_ref,
                                scoped, group=group, wgs=wgs, planes=(key_plane, value_plane),
                                head_size=head_size, stages=stages, scale=scale,
                                num_pages=num_pages, interpret=interpret),
        buffers, loaded, consumed, collective_axes="wg")

  copies = PageTiles(bs).copies   # TMA copies per K / V tile
  return plgpu.kernel(
      entry,
      out_type=jax.ShapeDtypeStruct((num_items, num_q_heads, TILE_Q, head_size), dtype),
      grid=(num_q_heads // wgs, num_items), grid_names=("heads", "item"),
      num_threads=wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=lowering.MOSAIC_SEMANTICS,
                                           approx_math=True),
      interpret=lowering.mosaic_interpret(interpret, wgs + 1),
      kernel_name="jkv_ragged_prefill_mosaic",
  )(*operands)
