"""MLA decode attention over a DeepSeek-V4 ``fp8_split`` latent cache, or vLLM's
``fp8_ds_mla`` one, for Mosaic GPU (Hopper TMA and wgmma), with the keys as wgmma's M.

``lowering="auto"``'s choice on a Hopper GPU where :func:`supported` takes the case
(H200, 16 query heads, rank 512 + 64: 167 us against Triton's 276 at 64 x 8K, 97 against
146 at 8 x 32K, 63 against 77 at 128 x 1K). Two warpgroups a program run in a pipeline:
0 computes ``S`` and the softmax, 1 converts the content and multiplies ``P V``, so that
one tile's ``P V`` overlaps the next tile's logits. At about 2.0 TB/s of the 4.15 copy
ceiling, bytes do not bound it (ncu does not profile Mosaic kernels here). History at
64 x 8K (H200): one warpgroup running every step in turn took 206 us; taken apart (each
variant's output wrong by design), 141 without the content's conversion, 159 without the
``P V`` wgmma, 176 with one query term, 110 without conversion and ``P V``. Measured and not
taken: one warpgroup with the values and weights in f16, 199 once range-safe; two
warpgroups each converting and multiplying half of the columns, 195; this pipeline with
the values and weights in bf16, 185 (f16 here, 167: one conversion step instead of two).

The cache holds per entry and latent head an e4m3fn content row [R], a bf16 RoPE row [P]
and a float32 scale; each latent head is read by a group of query heads (one head for all:
MQA), which are wgmma's N (padded to ``columns``, a multiple of 8; at most ``MAX_HEADS``).
Per tile of 64 keys:

* ``S^T = (C Q^T) s / c + E Q_pe^T`` [64, n]: the content tile ``C`` as TMA loads it (FP8,
  K-major: wgmma's A) times the query's nope part as e4m3 terms (split per head with a
  power of two ``c`` in XLA, :func:`pallas_kernels.mosaic_attention.query_terms`: B), each
  row times its entry scale ``s``, each column ``1 / c``; plus the RoPE tile ``E`` (bf16,
  A) times the query's RoPE part (in bf16, B);
* an online softmax in base 2 down each column (as
  :mod:`pallas_kernels.mosaic_fp8_decode` does);
* ``O^T += C^T W^T`` [R, n]: the content converted to f16 (exact) in shared memory by
  warpgroup 1, rows past the keys zeroed (stale entries may hold NaN), read transposed
  (16-bit wgmma reads MN-major A); the weights ``W = P s`` (each key's entry scale) in f16,
  stored transposed as a K-major B: ``exp2(S + log2 |s| - w)`` with ``w`` a second running
  max down each column, so at most 1 whatever the scales; ``O^T`` is kept in units of
  ``2^w`` and XLA rebases each split's to ``2^max S`` (``2^(w - max S)``) before the combine.

A program takes one sequence, one latent head and one split of the context, in two
warpgroups (see :func:`_kernel`); ``stages``
tiles stream in by TMA (content, RoPE part and scales: a copy each per page, or per
64-token part of a larger page). The splits are combined in XLA.

``fp8_ds_mla`` (:func:`ds_mla_decode`; ``auto``'s choice on Hopper too: H100, 64 x 8K,
182 us against Triton's 329): one latent head of E = R + R / 32 + 2 P bytes an entry,
e4m3fn content, a float32 scale per 128 content columns (``k`` blocks), the bf16 RoPE
part, read in place as uint8 (XLA on CPU materializes a ``bitcast_convert_type`` view of
the cache, a copy: of both the e4m3fn and the bf16 one). ``S^T`` sums ``k`` block
products, each row times its block's scale; the weights are ``exp2(S + log2 m - w)``
with ``m`` the key's largest |scale|, and block b's rows of ``O^T`` take them times
``s_b / m`` (within +-1), a weights tile a block. Mosaic tiles a TMA copy's whole GMEM
array as it tiles the destination, and an entry is no whole number of 128-byte tiles:
compiled, the content stages are swizzled only (a copy per 128 bytes of a row) and the
content and RoPE tiles reach wgmma as A from registers (the content bitcast to e4m3fn there, the
RoPE part read as bf16 through a union with the bytes its copy wrote); interpreted,
typed copies of the cache fill tiled stages (Pallas' GPU interpreter has no A in
registers, and gives a union's members buffers of their own). The scales come with the
tile: compiled, one copy per page of each entry's bytes from its scales to its end (the
scales and the RoPE part, 144 bytes a row, unswizzled), into a union that reads them as
float32 (the scales, a strided column a block) and as bf16 (the RoPE part); each block's
weights of rows past the keys are zeroed (a stale entry's scale may be anything). H100,
64 x 8K, the call: 213 us with the scales gathered per split in XLA (27.5 us of it), 200-204
with a copy of their own per page (the kernel 188 us), 182-183 with one copy for scales and
RoPE part (the kernel 166 us: the sixth copy a page, of 16 bytes a row, cost 22 us).
Measured and not taken: the content and RoPE stages as unions of their bytes and the same
memory typed and tiled, so that wgmma reads A from shared memory: kernel 185 us against
171 (H100).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jkv.formats import DS_MLA_TILE
from pallas_kernels import lowering
from pallas_kernels.mosaic_fp8_decode import column_softmax, column_softmax_start, columns
from pallas_kernels.mosaic_attention import (COUNT, QUERY_TERMS, TILE, PageTiles, add_product,
                                             copy_info_row, info_copies, normalized,
                                             query_row_scale, query_term_count, query_terms,
                                             split_counts, split_geometry, split_info,
                                             split_weights, zero_rows_past)

MAX_HEADS = 16     # query heads a latent head at most: O^T [R, 16] float32 is 64 registers
                   # a thread
MAX_PAGES = 2048   # pages of a split at most (an 8 KiB info row)
STAGES = 2
_SMEM_LIMIT = 200 * 1024
_LOG2E = math.log2(math.e)


def smem_bytes(rank: int, pe: int, stages: int, n: int, terms: int, info_words: int,
               blocks: int = 1) -> int:
  """Shared memory of one program: the stages (FP8 content, bf16 RoPE part, ``blocks``
  scales an entry), the f16 values (the output shares them), the query's terms and RoPE
  part, the weights (two tiles a block) and their factors, the column factors and
  statistics, the info row."""
  return (stages * TILE * (rank + 2 * pe + 4 * blocks) + TILE * rank * 2 + terms * n * rank
          + n * pe * 2 + 2 * blocks * n * TILE * 2 + (32 + 5 * n) * 4 + info_words * 4 + 1024)


def supported(num_kv_heads: int, rank: int, pe: int, block_size: int, query_dtype,
              num_q_heads: int) -> bool:
  """Whether this kernel takes the case: ``rank`` a multiple of 128 and ``pe`` of 64 (whole
  swizzled tiles), pages of 8+ tokens (a power of two), bf16 / fp16 queries, at most
  ``MAX_HEADS`` query heads a latent head, within shared memory."""
  group = num_q_heads // num_kv_heads
  return (group * num_kv_heads == num_q_heads and rank % 128 == 0 and pe % 64 == 0 and pe > 0
          and _fits(rank, pe, block_size, query_dtype, group, blocks=1))


def supported_ds_mla(rank: int, pe: int, block_size: int, query_dtype,
                     num_q_heads: int) -> bool:
  """Whether :func:`ds_mla_decode` takes the case (one latent head): ``rank`` a multiple of
  512 and ``pe`` 64 (entries of whole 16-byte units, their RoPE part 16-byte aligned and
  one 128-byte row), and as :func:`supported`."""
  return (rank % 512 == 0 and rank > 0 and pe == 64
          and _fits(rank, pe, block_size, query_dtype, num_q_heads, rank // DS_MLA_TILE))


def _fits(rank: int, pe: int, block_size: int, query_dtype, group: int, blocks: int) -> bool:
  """Pages of 8+ tokens (a power of two), bf16 / fp16 queries, at most ``MAX_HEADS`` query
  heads a latent head, within shared memory, on a JAX with Mosaic GPU."""
  terms = query_term_count(query_dtype) if np.dtype(query_dtype).itemsize == 2 else 0
  return (block_size >= 8 and block_size & (block_size - 1) == 0
          and np.dtype(query_dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
          and group <= MAX_HEADS
          and smem_bytes(rank, pe, STAGES, columns(group), terms, MAX_PAGES + 64,
                         blocks) <= _SMEM_LIMIT
          and lowering.mosaic_available())


def _kernel(info_ref,      # int32 [B, S, INFO + pages_per_split] GMEM
            terms_ref,     # e4m3fn [B, H, terms, n, R] GMEM: the nope part's terms
            q_pe_ref,      # bf16 [B, H, n, P] GMEM
            factor_ref,    # float32 [B, H, 32] GMEM: 1 / c times the softmax scale, base 2
            scale_ref,     # float32 [B, H, S, pages_per_split * bs] GMEM: the split's
                           # scales (fp8_ds_mla: compiled, the entries' uint8 bytes, unread:
                           # rope_ref's copies bring the scales; interpreted, the scales
                           # float32 [pages, bs, 1, k])
            content_ref,   # e4m3fn [pages, bs, H, R] GMEM (fp8_ds_mla: [pages, bs, 1, E],
                           # the entries' uint8 bytes; interpreted, an e4m3fn copy)
            rope_ref,      # bf16 [pages, bs, H, P] GMEM (fp8_ds_mla: compiled, the entries'
                           # uint8 bytes [pages, bs, 1, E], copied from byte R on: scales,
                           # then the RoPE part; interpreted, a bf16 copy [pages, bs, 1,
                           # E / 2], the RoPE part from byte rope_base)
            out_ref,       # float32 [B, H, S, R, n] GMEM: O^T, unnormalized
            stats_ref,     # float32 [B, H, S, 3, n] GMEM: running max (base 2), sum,
                           # O^T's basis (the weights' running max)
            info_smem, terms_smem, q_pe_smem, factor_smem, p_smem, alpha_smem,
            stage_smem,    # (content, RoPE part, scales) stages; fp8_ds_mla compiled:
                           # (content, the union of each entry's bytes from R on)
            shared, stats_smem, info_bar, query_bar, tile_bars,
            free_bars, p_ready, p_free, *, stages, rope_factor, num_pages, tiles, ds_mla,
            rope_base, interpret):   # rope_base: the RoPE part's first byte (fp8_ds_mla,
                                     # interpreted)
  """Two warpgroups: 0 issues the copies and computes ``S^T`` and the softmax, leaving each
  tile's weights and rescaling factors in shared memory (two tiles of them); 1 converts
  the content, refills a stage once both have released it, and multiplies
  ``O^T += C^T W^T``."""
  plgpu = lowering.plgpu
  wg = lax.axis_index("wg")
  head = lax.axis_index("head")
  split = lax.axis_index("split")
  seq = lax.axis_index("seq")
  values16, o_smem = shared   # the output tile shares the values' memory (warpgroup 1's)
  num_terms, n, rank = terms_smem.shape
  pe = q_pe_smem.shape[1]
  blocks = rank // DS_MLA_TILE if ds_mla else 1   # scale blocks of an entry's content
  if ds_mla and not interpret:   # the content; the bytes from the scales to the entry's
    content_smem, tail_smem = stage_smem   # end as uint8, bf16 and float32 (a union)
  else:
    content_smem, rope_smem, scale_smem = stage_smem
  wgmma = plgpu.Layout.WGMMA
  upcast = plgpu.Layout.WGMMA_UPCAST_2X
  down, across = wgmma.reduce(0), wgmma.reduce(1)   # per column, per row of [TILE, n]

  @pl.when(wg == 0)
  def _query():
    copy_info_row(info_ref.at[seq, split], info_smem, info_bar)
    for term in range(num_terms):   # a copy each (a TMA box strides at most 5 dimensions)
      plgpu.copy_gmem_to_smem(terms_ref.at[seq, head, term], terms_smem.at[term], query_bar)
    plgpu.copy_gmem_to_smem(q_pe_ref.at[seq, head], q_pe_smem, query_bar)
    plgpu.copy_gmem_to_smem(factor_ref.at[seq, head], factor_smem, query_bar)

  plgpu.barrier_wait(info_bar)
  num_tokens = info_smem[COUNT]
  num_tiles = (num_tokens + TILE - 1) // TILE

  def issue(t, slot):
    for p in range(tiles.copies):
      page, rows, part = tiles.page(info_smem, t, p), tiles.rows_of(t), tiles.part(p)
      if ds_mla:   # a copy per scale block of the content, then the scales and RoPE part
        for b in range(blocks):
          plgpu.copy_gmem_to_smem(
              content_ref.at[page, rows, head, pl.ds(b * DS_MLA_TILE, DS_MLA_TILE)],
              content_smem.at[slot, b, part], tile_bars.at[slot])
        if interpret:   # typed: the RoPE part bf16, the scales float32 [rows, k]
          plgpu.copy_gmem_to_smem(rope_ref.at[page, rows, head, pl.ds(rope_base // 2, pe)],
                                  rope_smem.at[slot, part], tile_bars.at[slot])
          plgpu.copy_gmem_to_smem(scale_ref.at[page, rows, head], scale_smem.at[slot, part],
                                  tile_bars.at[slot])
        else:   # one copy of the bytes from the scales on, into the union's uint8 member
          plgpu.copy_gmem_to_smem(
              rope_ref.at[page, rows, head, pl.ds(rank, rope_ref.shape[-1] - rank)],
              tail_smem[0].at[slot, part], tile_bars.at[slot])
        continue
      for ref, stage in ((content_ref, content_smem), (rope_ref, rope_smem)):
        plgpu.copy_gmem_to_smem(ref.at[page, rows, head], stage.at[slot, part],
                                tile_bars.at[slot])
    if ds_mla:
      return
    # The scales of a 16-token page are 64 bytes, and a copy moves a multiple of 128: the
    # tile's run of the split's scales, gathered in XLA.
    last = scale_ref.shape[-1] // TILE - 1   # (a prologue's tile past the split never runs)
    start = jnp.minimum(t, last) * TILE
    plgpu.copy_gmem_to_smem(scale_ref.at[seq, head, split, pl.ds(start, TILE)],
                            scale_smem.at[slot], tile_bars.at[slot])

  for i in range(stages):
    pl.when((wg == 0) & (i < num_tiles))(functools.partial(issue, i, i))

  def release(slot):
    """This warpgroup's reads of stage ``slot`` are done (wgmmas waited for, loads in
    registers): warpgroup 1 refills it once both warpgroups have released it."""
    plgpu.commit_smem()
    plgpu.barrier_arrive(free_bars.at[slot])

  def softmax_body(t, carry, column_factor):   # warpgroup 0
    running_max, sums, weight_max = carry
    slot, buffer = lax.rem(t, stages), lax.rem(t, 2)
    left = num_tokens - t * TILE
    plgpu.barrier_wait(tile_bars.at[slot])

    def logits(nope_ref, rope_acc_ref):
      for term in range(num_terms):
        plgpu.wgmma(nope_ref, content_smem.at[slot], terms_smem.at[term].transpose((1, 0)))
      plgpu.wgmma(rope_acc_ref, rope_smem.at[slot], q_pe_smem.transpose((1, 0)))
      return nope_ref[...], rope_acc_ref[...]

    def ds_mla_logits(*refs):   # a product per scale block; compiled, A from registers
      for b, block_ref in enumerate(refs[:-1]):
        block = content_smem.at[slot, b]
        if not interpret:   # the entries' bytes, read as e4m3fn
          block = lax.bitcast_convert_type(
              plgpu.load(block, layout=plgpu.Layout.WGMMA_8BIT, optimized=False),
              jnp.float8_e4m3fn)
        for term in range(num_terms):
          plgpu.wgmma(block_ref, block, terms_smem.at[
              term, :, pl.ds(b * DS_MLA_TILE, DS_MLA_TILE)].transpose((1, 0)))
      if interpret:
        rope_tile = rope_smem.at[slot]
      else:   # the union's bf16 member past the scales: the bytes the TMA copy wrote
        rope_tile = plgpu.load(tail_smem[1].at[slot, :, pl.ds(2 * blocks, pe)], layout=wgmma,
                               optimized=False)
      plgpu.wgmma(refs[-1], rope_tile, q_pe_smem.transpose((1, 0)))
      return tuple(ref[...] for ref in refs)

    if ds_mla:
      *block_logits, rope_part = pl.run_scoped(
          ds_mla_logits, *[plgpu.ACC((TILE, n), jnp.float32)] * (blocks + 1))
      scales_f32 = scale_smem if interpret else tail_smem[2]   # [stages, TILE, k (+ ...)]
      block_scales = [plgpu.load(scales_f32.at[slot, :, b], layout=across, optimized=False)
                      for b in range(blocks)]
      release(slot)
      # Block b's logits times its scale; the weights below are P times the key's largest
      # |scale| m, then per block times s_b / m (within +-1).
      nope = sum(logit * lax.broadcast_in_dim(scale_b, (TILE, n), [0])
                 for logit, scale_b in zip(block_logits, block_scales))
      largest = functools.reduce(jnp.maximum, [jnp.abs(scale_b) for scale_b in block_scales])
      ratios = [jnp.where(largest > 0, scale_b / largest, 0.0) for scale_b in block_scales]
      log_scale = lax.broadcast_in_dim(jnp.log2(largest), (TILE, n), [0])
    else:
      nope, rope_part = pl.run_scoped(logits, plgpu.ACC((TILE, n), jnp.float32),
                                      plgpu.ACC((TILE, n), jnp.float32))
      scale_row = plgpu.load(scale_smem.at[slot], layout=across, optimized=False)
      release(slot)
      entry_scale = lax.broadcast_in_dim(scale_row, (TILE, n), [0])
      log_scale = lax.broadcast_in_dim(jnp.log2(jnp.abs(scale_row)), (TILE, n), [0])
    keys = plgpu.broadcasted_iota(jnp.int32, (TILE, n), 0, layout=wgmma)
    visible = (keys < left) & tiles.inside_cache(keys, info_smem, t, num_pages)
    if not ds_mla:
      nope = nope * entry_scale
    s = nope * lax.broadcast_in_dim(column_factor, (TILE, n), [1]) + rope_part * rope_factor
    s = jnp.where(visible, s, -jnp.inf)   # also the NaN of stale scales and RoPE parts
    _, _, new_max, sums = column_softmax(s, running_max, sums)   # (P: the sums' alone)
    # The weights P s in f16 as exp2(s + log2 |scale| - w), w the running max of
    # s + log2 |scale| down the column: at most 1, the largest exactly 1, whatever the scales.
    weighted = jnp.where(visible, s + log_scale, -jnp.inf)   # (a zero scale: -inf)
    new_weight_max = jnp.maximum(weight_max, weighted.max(axis=0))
    alpha = jnp.exp2(weight_max - new_weight_max)
    weights = jnp.exp2(weighted - lax.broadcast_in_dim(new_weight_max, (TILE, n), [1]))
    if not ds_mla:
      weights = jnp.where(entry_scale < 0, -weights, weights)
    pl.when(t >= 2)(lambda: plgpu.barrier_wait(p_free.at[buffer]))   # tile t - 2's, read
    alpha_smem[buffer] = alpha
    if ds_mla:   # (the rows past the keys 0: their scales are the stale entries' bytes)
      for b, ratio in enumerate(ratios):
        factor = jnp.where(visible, lax.broadcast_in_dim(ratio, (TILE, n), [0]), 0.0)
        p_smem.at[buffer, b].transpose((1, 0))[...] = (weights * factor).astype(p_smem.dtype)
    else:
      p_smem.at[buffer].transpose((1, 0))[...] = weights.astype(p_smem.dtype)
    plgpu.commit_smem()
    plgpu.barrier_arrive(p_ready.at[buffer])

    return new_max, sums, new_weight_max

  def values_body(t, acc):   # warpgroup 1
    slot, buffer = lax.rem(t, stages), lax.rem(t, 2)
    left = num_tokens - t * TILE
    plgpu.barrier_wait(tile_bars.at[slot])
    # The content in f16 (exact), 128 columns at a time; in the last tile only, the rows
    # past the keys zeroed (masking every tile's conversion cost 31 us of 237 at 64 x 8K,
    # H200).
    for start in range(0, rank, 128):
      columns_ = values16.at[:, pl.ds(start, 128)]
      source = (content_smem.at[slot, start // DS_MLA_TILE] if ds_mla
                else content_smem.at[slot, :, pl.ds(start, 128)])
      content = plgpu.load(source, layout=upcast)
      if content.dtype == jnp.uint8:   # fp8_ds_mla, compiled: the entries' bytes
        content = lax.bitcast_convert_type(content, jnp.float8_e4m3fn)
      columns_[...] = content.astype(jnp.float16)
      pl.when(left < TILE)(functools.partial(zero_rows_past, columns_, left, 128))
    release(slot)   # (its commit also readies the values for wgmma)

    @pl.when(t + stages < num_tiles)
    def _refill():   # (here, not in warpgroup 0: it never waits for the conversion)
      plgpu.barrier_wait(free_bars.at[slot])
      issue(t + stages, slot)

    plgpu.barrier_wait(p_ready.at[buffer])
    alpha = plgpu.load(alpha_smem.at[buffer], layout=down, optimized=False)
    if ds_mla:   # O^T's rows of block b from its weights
      acc = tuple(add_product(
          acc_b, alpha, 1, values16.at[:, pl.ds(b * DS_MLA_TILE, DS_MLA_TILE)].transpose((1, 0)),
          p_smem.at[buffer, b].transpose((1, 0))) for b, acc_b in enumerate(acc))
    else:
      acc = add_product(acc, alpha, 1, values16.transpose((1, 0)),
                        p_smem.at[buffer].transpose((1, 0)))
    plgpu.barrier_arrive(p_free.at[buffer])
    return acc

  acc0, max0, sums0 = column_softmax_start(rank, n)
  if ds_mla:
    acc0 = tuple(column_softmax_start(DS_MLA_TILE, n)[0] for _ in range(blocks))

  @pl.when(wg == 0)
  def _softmax_warpgroup():
    plgpu.barrier_wait(query_bar)
    column_factor = plgpu.load(factor_smem.at[pl.ds(0, n)], layout=down, optimized=False)
    running_max, sums, weight_max = lax.fori_loop(
        0, num_tiles, functools.partial(softmax_body, column_factor=column_factor),
        (max0, sums0, max0))
    stats_smem[0] = running_max
    stats_smem[1] = sums.sum(axis=0)
    stats_smem[2] = weight_max   # O^T's basis
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stats_smem, stats_ref.at[seq, head, split])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _values_warpgroup():
    acc = lax.fori_loop(0, num_tiles, values_body, acc0)
    if ds_mla:
      for b, acc_b in enumerate(acc):
        o_smem.at[pl.ds(b * DS_MLA_TILE, DS_MLA_TILE)][...] = acc_b
    else:
      o_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[seq, head, split])
    plgpu.wait_smem_to_gmem(0)


def mla_decode(query, kv_cache, rope_cache, entry_scale, layer, block_table, seq_lens, *,
               num_blocks: int, scale: float, interpret: bool, num_splits: int | None = None,
               stages: int = STAGES):
  """MLA decode attention over one layer of an ``fp8_split`` cache, the cases
  :func:`supported` takes (see :func:`jkv.ops.mla.mla_attention`).

  query [B, Hq, R + P] bf16 / fp16; kv_cache e4m3fn [L, NB, bs, (H,) R]; rope_cache bf16
  [L, NB, bs, (H,) P]; entry_scale float32 [L, NB, bs, (H,)]; layer int32 scalar;
  block_table int32 [B, W]; seq_lens int32 [B], at most W * bs. Returns [B, Hq, R] in the
  query's dtype.
  """
  bs, rank = kv_cache.shape[2], kv_cache.shape[-1]
  heads = kv_cache.shape[3] if kv_cache.ndim == 5 else 1
  return _decode(query, kv_cache.reshape(-1, bs, heads, rank),
                 rope_cache.reshape(-1, bs, heads, query.shape[-1] - rank),
                 entry_scale.reshape(-1, bs, heads), layer, block_table, seq_lens,
                 rank=rank, num_blocks=num_blocks, scale=scale, interpret=interpret,
                 num_splits=num_splits, stages=stages, ds_mla=False)


def ds_mla_decode(query, kv_cache, layer, block_table, seq_lens, *, kv_lora_rank: int,
                  num_blocks: int, scale: float, interpret: bool,
                  num_splits: int | None = None, stages: int = STAGES):
  """MLA decode attention over one layer of an ``fp8_ds_mla`` cache, the cases
  :func:`supported_ds_mla` takes (see :func:`jkv.ops.mla.mla_attention`), read in place.

  query [B, Hq, R + P] bf16 / fp16; kv_cache uint8 [L, NB, bs, E], E = R + R / 32 + 2 P
  bytes an entry (e4m3fn content [R], float32 scales [R / 128], bf16 RoPE part [P]), read
  as bytes (interpreted: through typed copies). layer
  int32 scalar; block_table int32 [B, W]; seq_lens int32 [B], at most W * bs. Returns
  [B, Hq, R] in the query's dtype.
  """
  bs, entry_bytes = kv_cache.shape[2], kv_cache.shape[-1]
  rank, blocks = kv_lora_rank, kv_lora_rank // DS_MLA_TILE
  entries = kv_cache.reshape(-1, bs, 1, entry_bytes)

  if interpret:   # typed copies (XLA materializes a width-changing bitcast-convert)
    content = lax.bitcast_convert_type(entries, jnp.float8_e4m3fn)
    rope = lax.bitcast_convert_type(entries.reshape(*entries.shape[:-1], entry_bytes // 2, 2),
                                    jnp.bfloat16)
    scale_bytes = entries[..., rank:rank + 4 * blocks]
    scales = lax.bitcast_convert_type(scale_bytes.reshape(*scale_bytes.shape[:-1], blocks, 4),
                                      jnp.float32)
  else:   # the bytes themselves, read as e4m3fn, float32 and bf16 in the kernel: no copy
    content = rope = scales = entries
  return _decode(query, content, rope, scales, layer, block_table, seq_lens, rank=rank,
                 num_blocks=num_blocks, scale=scale, interpret=interpret,
                 num_splits=num_splits, stages=stages, ds_mla=True)


def _decode(query, content, rope, scales, layer, block_table, seq_lens, *, rank: int,
            num_blocks: int, scale: float, interpret: bool, num_splits: int | None,
            stages: int, ds_mla: bool):
  """The launch and the splits' combine: content e4m3fn [pages, bs, H, R], rope bf16
  [pages, bs, H, P], scales float32 [pages, bs, H], gathered per split in XLA (scales of
  keys past a split's count read 0: stale entries may hold any bytes). ds_mla: content,
  rope and scales the entries uint8 [pages, bs, 1, E], the scales copied with each tile
  (interpreted: typed copies, the scales float32 [pages, bs, 1, k])."""
  plgpu = lowering.plgpu
  batch, num_q_heads, entry = query.shape
  _, bs, heads, _ = content.shape
  group = num_q_heads // heads
  pe = entry - rank
  n = columns(group)
  blocks = rank // DS_MLA_TILE if ds_mla else 1
  num_pages = content.shape[0]
  splits, pages_per_split = split_geometry(batch, heads, block_table.shape[1], bs, num_splits,
                                           max_pages=MAX_PAGES)
  counts = split_counts(seq_lens, splits, pages_per_split * bs)
  info = split_info(block_table, layer, counts, splits, pages_per_split, num_blocks,
                    num_pages)
  if not ds_mla:   # [B, H, S, tokens]
    table = jnp.pad(block_table,
                    ((0, 0), (0, splits * pages_per_split - block_table.shape[1])))
    valid = (table >= 0) & (table < num_blocks)
    scales = jnp.where(valid[..., None, None],
                       scales[jnp.where(valid, table + layer * num_blocks, 0)], 0)
    scales = scales.reshape(batch, splits, pages_per_split * bs, heads)
    owned = jnp.arange(pages_per_split * bs)[None, None, :] < counts[:, :, None]
    scales = jnp.where(owned[..., None], scales, 0).transpose(0, 3, 1, 2)
  # The query in XLA: the nope part's e4m3 terms and 1 / c per query head, the RoPE part in
  # bf16 (the RoPE cache's type), each latent head's group padded to n.
  nope = query[..., :rank].reshape(batch * num_q_heads, rank)
  parts = query_terms(nope, xla=True)
  pad_group = ((0, 0), (0, 0), (0, n - group))
  terms = jnp.stack(parts).reshape(len(parts), batch, heads, group, rank).transpose(1, 2, 0, 3, 4)
  terms = jnp.pad(terms, ((0, 0),) + pad_group + ((0, 0),))
  factor = (1.0 / query_row_scale(nope)).reshape(batch, heads, group) * (scale * _LOG2E)
  factor = jnp.pad(factor, ((0, 0), (0, 0), (0, 32 - group)))
  q_pe = query[..., rank:].astype(jnp.bfloat16).reshape(batch, heads, group, pe)
  q_pe = jnp.pad(q_pe, pad_group + ((0, 0),))
  info_width = info.shape[-1]
  if smem_bytes(rank, pe, stages, n, len(parts), info_width, blocks) > _SMEM_LIMIT:
    raise ValueError(f"{stages} stages of {rank} + {pe}-wide entries take more shared memory "
                     f"than a program may ({_SMEM_LIMIT} bytes)")
  fp8_tiles = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
  b16_tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  tiles = PageTiles(bs)
  if ds_mla:
    # A TMA copy tiles its GMEM box's whole array as the destination is tiled, and an
    # entry is no whole number of 128-byte tiles: compiled, the stages are swizzled only
    # (a copy per 128 bytes of a row) and reach wgmma through registers; interpreted
    # (Pallas' GPU interpreter has no wgmma A in registers), tiled.
    # Compiled, each entry's bytes from the scales to its end (scales and RoPE part) come
    # in one copy, into a union of those bytes, the same as bf16 (the RoPE part wgmma's
    # operand loads read) and as float32 (the scales): rows of 144 bytes, unswizzled.
    swizzled = (plgpu.SwizzleTransform(128),)
    content_stage = plgpu.SMEM((stages, blocks, TILE, DS_MLA_TILE), content.dtype,
                               transforms=fp8_tiles if interpret else swizzled)
    if interpret:
      stage_types = (content_stage,
                     plgpu.SMEM((stages, TILE, pe), jnp.bfloat16, transforms=b16_tiles),
                     plgpu.SMEM((stages, TILE, blocks), jnp.float32))
    else:
      tail = 4 * blocks + 2 * pe
      stage_types = (content_stage, plgpu.RefUnion(
          plgpu.SMEM((stages, TILE, tail), jnp.uint8),
          plgpu.SMEM((stages, TILE, tail // 2), jnp.bfloat16),
          plgpu.SMEM((stages, TILE, tail // 4), jnp.float32)))
    weight_shape = (2, blocks, n, TILE)
  else:
    stage_types = (
        plgpu.SMEM((stages, TILE, rank), content.dtype, transforms=fp8_tiles),
        plgpu.SMEM((stages, TILE, pe), jnp.bfloat16, transforms=b16_tiles),
        plgpu.SMEM((stages, TILE), jnp.float32))
    weight_shape = (2, n, TILE)
  scratch = [
      plgpu.SMEM((info_width,), jnp.int32),
      plgpu.SMEM((len(parts), n, rank), QUERY_TERMS, transforms=fp8_tiles),
      plgpu.SMEM((n, pe), jnp.bfloat16, transforms=b16_tiles),
      plgpu.SMEM((32,), jnp.float32),
      plgpu.SMEM(weight_shape, jnp.float16, transforms=b16_tiles),    # W, two tiles
      plgpu.SMEM((2, n), jnp.float32),                                 # their alphas
      stage_types,
      plgpu.RefUnion(plgpu.SMEM((TILE, rank), jnp.float16, transforms=b16_tiles),
                     plgpu.SMEM((rank, n), jnp.float32)),
      plgpu.SMEM((3, n), jnp.float32),
      plgpu.Barrier(num_arrivals=info_copies(info_width)),
      plgpu.Barrier(num_arrivals=len(parts) + 2),
      plgpu.Barrier(num_arrivals=(blocks + 1 + interpret) * tiles.copies if ds_mla
                    else 2 * tiles.copies + 1, num_barriers=stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),   # a stage released by both
      plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2)]   # W ready, W read
  kernel = functools.partial(_kernel, stages=stages, rope_factor=scale * _LOG2E,
                             num_pages=num_pages, tiles=tiles, ds_mla=ds_mla,
                             rope_base=rank + 4 * blocks, interpret=interpret)
  out, stats = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((batch, heads, splits, rank, n), jnp.float32),
                jax.ShapeDtypeStruct((batch, heads, splits, 3, n), jnp.float32)),
      grid=(heads, splits, batch), grid_names=("head", "split", "seq"),
      num_threads=2, thread_name="wg", scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(lowering_semantics=lowering.MOSAIC_SEMANTICS,
                                           approx_math=True),
      interpret=lowering.mosaic_interpret(interpret, 2),
      kernel_name="jkv_mla_decode_fp8_ds_mla_mosaic" if ds_mla
      else "jkv_mla_decode_fp8_split_mosaic",
  )(info, terms, q_pe, factor, scales, content, rope)
  out = out * jnp.exp2(stats[:, :, :, 2] - stats[:, :, :, 0])[:, :, :, None]   # to 2^max
  weight, total = split_weights(stats, group)
  acc = jnp.einsum("bhsrg,bhsg->bhgr", out[..., :group], weight)               # [B, H, G, R]
  out = normalized(acc, total)
  return out.reshape(batch, num_q_heads, rank).astype(query.dtype)
