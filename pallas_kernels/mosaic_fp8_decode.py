"""FP8 paged decode attention for Mosaic GPU (Hopper TMA and wgmma) with the keys as
wgmma's M: NHD / HND pages of an e4m3fn / e5m2 cache, per-tensor / per-head scales.

The 16-bit decode kernel (:mod:`pallas_kernels.mosaic_attention`) makes a group's query
heads wgmma's M, padded to 64 rows: with a GQA group of 4, 15/16 of each wgmma, of the
softmax and of its registers are padding. That is free while bytes bound the kernel (a
16-bit cache), not over an FP8 one, which halves the bytes per key. This kernel turns
both products around, so that the padding is only the group's heads rounded up to
``columns`` (a multiple of 8, wgmma's N):

* ``S^T = K Q^T`` [64 keys, columns]: the key tile as loaded by TMA (FP8, K-major, as FP8
  wgmma needs) is A, the query's e4m3 terms B (two for a bf16 query, three for fp16: the
  query rows scaled per row by a power of two and split,
  :func:`pallas_kernels.mosaic_attention.split_query`; ``1 / c`` and the key scale
  multiply each column after the wgmmas);
* an online softmax down each column, in base 2: the column max per tile is a
  cross-warp reduction, the column sums stay per element until the end;
* ``O^T += V^T P^T`` [D, columns]: the value tile, converted to f16 in shared memory
  while ``S^T``'s wgmmas run (``P V`` contracts over the tile's rows, which FP8 wgmma
  cannot read), is A, transposed (16-bit wgmma reads MN-major operands); ``P^T`` is B,
  stored transposed (as ``P`` [columns, 64], K-major) in f16.

A program takes one sequence, one KV head and one split of the context, one warpgroup, as
the 16-bit kernel; ``stages`` K / V tiles of 64 tokens stream in by TMA (one copy per page,
or per 64-token part of a larger page). Keys past the sequence's length or in blocks
outside the cache are masked; on the last tile the converted value rows past the length
are zeroed (stale entries may hold NaN). The program writes ``O^T`` unnormalized and per
column its running max (base 2) and sum; :func:`paged_attention_decode` combines the
splits and applies the value scale.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jkv.layout import Plane
from pallas_kernels import lowering, mosaic_attention
from pallas_kernels.mosaic_attention import (FP8, INFO, MAX_SPLIT_PAGES, QUERY_TERMS, ROWS,
                                             TILE, PageTiles, add_product, copy_info_row,
                                             decode_info, info_copies, normalized,
                                             page_views, query_term_count, scale_rows,
                                             split_query, split_weights, start_streams,
                                             zero_rows_past)

_SMEM_LIMIT = 200 * 1024
_LOG2E = math.log2(math.e)
STAGES = 3   # K / V tiles in flight (8 x 32K e4m3, H200: 161 us against 167 with 2; 64 x
             # 2K 88 against 90)


def columns(group: int) -> int:
  """wgmma's N for a GQA group of ``group`` query heads: whole 8-row tiles."""
  return -(-group // 8) * 8


def smem_bytes(head_size: int, stages: int, group: int, info_words: int, terms: int) -> int:
  """Shared memory of one program: the FP8 K / V stages, the converted value tile (which
  the query as loaded shares), the query's ``terms`` e4m3 terms, P, O^T and its statistics
  for ``group`` query heads, the column factors, the info row of ``info_words`` int32."""
  n = columns(group)
  return (2 * stages * TILE * head_size + TILE * head_size * 2 + terms * ROWS * head_size
          + n * TILE * 2 + head_size * n * 4 + 2 * n * 4 + ROWS * 4 + info_words * 4 + 1024)


def column_softmax(s, running_max, sums):
  """One tile of an online softmax in base 2 down the columns of ``s`` [TILE, n] (masked
  logits -inf), the running max [n] and the per-element sums [TILE, n] carried:
  ``(p, alpha, new_max, sums)``, ``alpha`` [n] the factor of what was accumulated."""
  new_max = jnp.maximum(running_max, s.max(axis=0))
  alpha = jnp.exp2(running_max - new_max)
  p = jnp.exp2(s - jax.lax.broadcast_in_dim(new_max, s.shape, [1]))
  return p, alpha, new_max, sums * jax.lax.broadcast_in_dim(alpha, s.shape, [1]) + p


def column_softmax_start(rows: int, n: int):
  """The carry of a loop of :func:`column_softmax` tiles with an accumulator ``O^T``
  [rows, n]: zeros, the running max (-1e30), the per-element sums [TILE, n]."""
  wgmma = lowering.plgpu.Layout.WGMMA
  return (lowering.plgpu.layout_cast(jnp.zeros((rows, n), jnp.float32), wgmma),
          lowering.plgpu.layout_cast(jnp.full((n,), -1e30, jnp.float32), wgmma.reduce(0)),
          lowering.plgpu.layout_cast(jnp.zeros((TILE, n), jnp.float32), wgmma))


def store_partials(carry, o_smem, stats_smem, out_dst, stats_dst):
  """A split's unnormalized ``O^T`` and its statistics (running max, sum) from the final
  carry of :func:`column_softmax` tiles, through ``o_smem`` / ``stats_smem`` to GMEM
  ``out_dst`` / ``stats_dst``."""
  plgpu = lowering.plgpu
  acc, running_max, sums = carry
  if acc.shape[1] * 4 % 128 == 0 and hasattr(plgpu, "store"):
    # Rows 128 / 256 bytes apart (32 or 64 columns): every row of a warp's store meets the
    # same banks. jax >= 0.12 refuses such a store unless told it need not be optimized
    # (jax 0.11.2 stores it as is, with no such option).
    plgpu.store(o_smem, acc, optimized=False)
  else:
    o_smem[...] = acc
  stats_smem[0] = running_max
  stats_smem[1] = sums.sum(axis=0)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, out_dst)
  plgpu.copy_smem_to_gmem(stats_smem, stats_dst)
  plgpu.wait_smem_to_gmem(0)


def start_program(info_src, query_src, scale_ref, info_smem, scale_smem, q_raw, query_terms,
                  column_smem, bars, *, head, group: int, scale: float):
  """A program's start: its info row (``info_src``), the scales and its ``group`` query
  rows of ``query_src`` [Hq, D] copied in (``bars``: the three copies' barriers), the query
  rows split into e4m3 terms in ``query_terms``; returns the factor of each column of
  ``S^T`` (1 / c, the softmax scale in base 2, the key scale), in the layout of a
  reduction down the columns of a WGMMA array."""
  plgpu = lowering.plgpu
  wgmma = plgpu.Layout.WGMMA
  info_bar, query_bar, scale_bar = bars
  head_size = q_raw.shape[1]
  copy_info_row(info_src, info_smem, info_bar)
  plgpu.copy_gmem_to_smem(scale_ref, scale_smem, scale_bar)
  plgpu.copy_gmem_to_smem(query_src.at[pl.ds(head * group, group)],
                          q_raw.at[pl.ds(0, group)], query_bar)
  plgpu.barrier_wait(info_bar)
  plgpu.barrier_wait(query_bar)
  plgpu.barrier_wait(scale_bar)
  # The query rows past the group are never loaded: zeroed (a one-off load).
  q_rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, head_size), 0, layout=wgmma)
  query = plgpu.load(q_raw, layout=wgmma, optimized=False)
  query = jnp.where(q_rows < group, query, jnp.zeros_like(query))
  inverse_c = split_query(query, query_terms)
  column_smem[...] = inverse_c * (scale * _LOG2E * scale_smem[0, head])
  plgpu.commit_smem()   # the terms for wgmma, q_raw before anything overwrites it
  return plgpu.load(column_smem.at[pl.ds(0, columns(group))], layout=wgmma.reduce(0),
                    optimized=False)


def softmax_tile(s, column_factor, left, tiles: PageTiles, info_smem, t, num_pages: int,
                 running_max, sums, p_smem):
  """Tile ``t``'s logits ``s`` [TILE, n] (unscaled) through the column softmax: scaled per
  column, keys past ``left`` or in blocks outside the cache masked; P stored transposed
  (f16) into ``p_smem`` [n, TILE]; returns ``(alpha, new_max, sums)``."""
  plgpu = lowering.plgpu
  s = s * jax.lax.broadcast_in_dim(column_factor, s.shape, [1])
  keys = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
  visible = (keys < left) & tiles.inside_cache(keys, info_smem, t, num_pages)
  p, alpha, new_max, sums = column_softmax(jnp.where(visible, s, -jnp.inf), running_max, sums)
  p_smem.transpose((1, 0))[...] = p.astype(p_smem.dtype)
  return alpha, new_max, sums


def swizzled_tiles():
  """The shared-memory transforms of the FP8 decode kernels' swizzled tiles: ``(fp8, f16)``,
  128-byte rows in tiles of 8."""
  plgpu = lowering.plgpu
  return ((plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128)),
          (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def program_scratch(info_width: int, scales_shape, terms: int, head_size: int, n: int,
                    copies: int, stages: int, streams):
  """The FP8 decode kernels' scratch, in their refs' order: the info row, the scales, the
  query's ``terms`` e4m3 terms, the column factors, P [n, TILE]; ``streams`` (the K
  stages, the V stages and the buffer the query is loaded into, each kernel's own); O^T
  [D, n] and its statistics; the barriers (info, query, scales, then K and V stages of
  ``copies`` TMA copies a tile)."""
  plgpu = lowering.plgpu
  fp8_tiles, f16_tiles = swizzled_tiles()
  return [
      plgpu.SMEM((info_width,), jnp.int32),
      plgpu.SMEM(scales_shape, jnp.float32),
      plgpu.SMEM((terms, ROWS, head_size), QUERY_TERMS, transforms=fp8_tiles),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.SMEM((n, TILE), jnp.float16, transforms=f16_tiles),
      *streams,
      plgpu.SMEM((head_size, n), jnp.float32),
      plgpu.SMEM((2, n), jnp.float32),
      plgpu.Barrier(num_arrivals=info_copies(info_width)),
      plgpu.Barrier(),
      plgpu.Barrier(),
      plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
      plgpu.Barrier(num_arrivals=copies, num_barriers=stages)]


def launch(kernel, scratch, inputs, *, name: str, num_heads: int, head_size: int, n: int,
           interpret: bool):
  """Runs ``kernel`` over the grid (kv head, split, sequence) on ``inputs`` (the info rows
  [B, splits, width] first) with the shared memory ``scratch``. Returns ``(O^T float32
  [B, H, splits, D, n]`` unnormalized, ``stats float32 [B, H, splits, 2, n])``."""
  plgpu = lowering.plgpu
  batch, splits, _ = inputs[0].shape
  return plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((batch, num_heads, splits, head_size, n), jnp.float32),
                jax.ShapeDtypeStruct((batch, num_heads, splits, 2, n), jnp.float32)),
      grid=(num_heads, splits, batch), grid_names=("head", "split", "seq"),
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(lowering_semantics=lowering.MOSAIC_SEMANTICS,
                                           approx_math=True),
      interpret=lowering.mosaic_interpret(interpret),
      kernel_name=name,
  )(*inputs)


def combine_splits(out, stats, scales, query):
  """The kernels' splits combined: ``out`` [B, H, S, D, columns] (O^T, unnormalized) and
  ``stats`` [B, H, S, 2, columns] over the softmax denominator, times the value scale
  (``scales`` [2, >= H]); returns [B, Hq, D] in ``query``'s dtype."""
  batch, num_q_heads, head_size = query.shape
  num_heads = out.shape[1]
  group = num_q_heads // num_heads
  weight, total = split_weights(stats, group)
  acc = jnp.einsum("bhsdg,bhsg->bhgd", out[..., :group], weight)            # [B, H, G, D]
  out = normalized(acc, total) * scales[1, :num_heads, None, None]
  return out.reshape(batch, num_q_heads, head_size).astype(query.dtype)


def supported(key_plane: Plane, value_plane: Plane, query_dtype, cache_dtype, group: int,
              *, quant: str, alibi: bool, soft_cap: bool, window: bool) -> bool:
  """Whether this kernel handles the case: an FP8 cache (e4m3fn / e5m2) that
  :func:`pallas_kernels.mosaic_attention.supported` takes (NHD / HND pages of 8+ tokens, a
  power of two; bf16 / fp16 queries; per-tensor / per-head scales; head_size 128; at most
  64 query heads per KV head; no ALiBi, soft cap or sliding window), within shared memory
  at ``STAGES`` stages."""
  return (np.dtype(cache_dtype) in FP8
          and mosaic_attention.supported(key_plane, value_plane, query_dtype, cache_dtype,
                                         group, quant=quant, alibi=alibi, soft_cap=soft_cap,
                                         window=window)
          and smem_bytes(key_plane.head_size, STAGES, ROWS, INFO + MAX_SPLIT_PAGES,
                         query_term_count(query_dtype)) <= _SMEM_LIMIT)


def _kernel(info_ref,     # int32 [B, S, INFO + pages_per_split] GMEM
            query_ref,    # [B, Hq, D] GMEM
            scale_ref,    # float32 [2, >= H] GMEM: k_scale, v_scale per head
            key_ref,      # [pages, bs, H, D] (NHD) or [pages, H, bs, D] (HND) GMEM, FP8
            value_ref,
            out_ref,      # float32 [B, H, S, D, columns] GMEM: O^T, unnormalized
            stats_ref,    # float32 [B, H, S, 2, columns] GMEM: running max (base 2), sum
            info_smem, scale_smem, query_terms, column_smem, p_smem, k_smem, v_smem,
            shared, o_smem, stats_smem, info_bar, query_bar, scale_bar, k_bars, v_bars, *,
            group, planes, head_size, stages, scale, num_pages):
  plgpu = lowering.plgpu
  head = jax.lax.axis_index("head")
  split = jax.lax.axis_index("split")
  seq = jax.lax.axis_index("seq")
  values16, q_raw = shared   # the converted values share their memory with the query
  n = columns(group)
  tiles = PageTiles(planes[0].block_size)
  column_factor = start_program(info_ref.at[seq, split], query_ref.at[seq], scale_ref,
                                info_smem, scale_smem, q_raw, query_terms, column_smem,
                                (info_bar, query_bar, scale_bar), head=head, group=group,
                                scale=scale)
  num_tokens, num_tiles, issue = start_streams(
      tiles, info_smem, head, head_size, stages, ((key_ref, planes[0], k_smem, k_bars),
                                                  (value_ref, planes[1], v_smem, v_bars)))

  def body(t, carry):
    acc, running_max, sums = carry
    slot = jax.lax.rem(t, stages)
    left = num_tokens - t * TILE
    plgpu.barrier_wait(k_bars.at[slot])

    def logits(acc_ref):
      for term in range(query_terms.shape[0]):
        plgpu.wgmma(acc_ref, k_smem.at[slot],
                    query_terms.at[term, pl.ds(0, n)].transpose((1, 0)))
      # While the wgmmas run: the values in f16 (exact: FP8 values fit f16).
      plgpu.barrier_wait(v_bars.at[slot])
      values16[...] = plgpu.load(v_smem.at[slot], layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(
          jnp.float16)
      return acc_ref[...]

    s = pl.run_scoped(logits, plgpu.ACC((TILE, n), jnp.float32))

    # The last tile: value rows past the length may hold NaN.
    pl.when(left < TILE)(functools.partial(zero_rows_past, values16, left, head_size))

    alpha, new_max, sums = softmax_tile(s, column_factor, left, tiles, info_smem, t,
                                        num_pages, running_max, sums, p_smem)
    plgpu.commit_smem()   # P and the values for wgmma; the stage's reads before its refill

    acc = add_product(acc, alpha, 1, values16.transpose((1, 0)), p_smem.transpose((1, 0)))
    pl.when(t + stages < num_tiles)(lambda: issue(t + stages, slot))
    return acc, new_max, sums

  carry = jax.lax.fori_loop(0, num_tiles, body, column_softmax_start(head_size, n))
  store_partials(carry, o_smem, stats_smem, out_ref.at[seq, head, split],
                 stats_ref.at[seq, head, split])


def _run(query, key_cache, value_cache, k_scale, v_scale, info, *, key_plane: Plane,
         value_plane: Plane, group: int, scale: float, interpret: bool, stages: int):
  """The kernel over ``info`` [B, splits, width]
  (:func:`pallas_kernels.mosaic_attention.split_info`): ``(out float32 [B, H, splits, D,
  columns] (O^T, unnormalized), stats float32 [B, H, splits, 2, columns]: running max in
  base 2 and sum, scales [2, >= H])``, column ``c`` the group's query head ``c``."""
  plgpu = lowering.plgpu
  info_width = info.shape[2]
  head_size = query.shape[-1]
  num_heads, bs = key_plane.num_heads, key_plane.block_size
  n = columns(group)
  terms = query_term_count(query.dtype)
  if group > ROWS or smem_bytes(head_size, stages, group, info_width, terms) > _SMEM_LIMIT:
    raise ValueError(f"{group} query heads a KV head, {stages} stages of {head_size}-wide "
                     f"tiles: more than {ROWS} heads or {_SMEM_LIMIT} bytes of shared memory")
  views = page_views(key_cache, value_cache, key_plane, value_plane)
  scales = scale_rows(k_scale, v_scale, num_heads)
  cache_dtype = views[0].dtype
  fp8_tiles, f16_tiles = swizzled_tiles()
  scratch = program_scratch(
      info_width, scales.shape, terms, head_size, n, PageTiles(bs).copies, stages,
      (plgpu.SMEM((stages, TILE, head_size), cache_dtype, transforms=fp8_tiles),
       plgpu.SMEM((stages, TILE, head_size), cache_dtype, transforms=fp8_tiles),
       plgpu.RefUnion(plgpu.SMEM((TILE, head_size), jnp.float16, transforms=f16_tiles),
                      plgpu.SMEM((ROWS, head_size), query.dtype))))
  kernel = functools.partial(_kernel, group=group, planes=(key_plane, value_plane),
                             head_size=head_size, stages=stages, scale=scale,
                             num_pages=views[0].shape[0])
  out, stats = launch(kernel, scratch, (info, query, scales, *views),
                      name="jkv_paged_attention_decode_fp8_mosaic", num_heads=num_heads,
                      head_size=head_size, n=n, interpret=interpret)
  return out, stats, scales


def paged_attention_decode(query, key_cache, value_cache, k_scale, v_scale, layer,
                           block_tables, seq_lens, *, key_plane: Plane, value_plane: Plane,
                           num_blocks: int, scale: float, interpret: bool,
                           num_splits: int | None = None, stages: int = STAGES):
  """Decode attention over one layer of stacked FP8 caches, for the cases
  :func:`supported` accepts (see :mod:`jkv.ops.attention`).

  query [B, Hq, D] bf16 / fp16; key_cache / value_cache [L, ...] e4m3fn / e5m2 in the
  planes' NHD / HND layout (value_cache None: K and V share key_cache, packed); k_scale /
  v_scale float32 [H] or [1]; layer int32 scalar; block_tables int32 [B, W]; seq_lens int32
  [B], at most W * block_size. ``num_splits`` None: as the 16-bit kernel
  (:func:`pallas_kernels.mosaic_attention.default_splits`). ``stages``: tiles in flight.
  Returns [B, Hq, D] in the query's dtype.
  """
  group = query.shape[1] // key_plane.num_heads
  info = decode_info(key_cache, value_cache, layer, block_tables, seq_lens,
                     key_plane=key_plane, value_plane=value_plane, num_blocks=num_blocks,
                     num_splits=num_splits)
  out, stats, scales = _run(query, key_cache, value_cache, k_scale, v_scale, info,
                            key_plane=key_plane, value_plane=value_plane, group=group,
                            scale=scale, interpret=interpret, stages=stages)
  return combine_splits(out, stats, scales, query)

