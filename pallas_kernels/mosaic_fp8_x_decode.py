"""FP8 paged decode attention for Mosaic GPU over vLLM / ASM pages: x-vectorized keys
``[H, D/x, bs, x]`` and token-fastest values (vLLM ``[H, D, bs]`` with 16-token pages, ASM
``[H, bs/x, D, x]``), x = 16 one-byte values, e4m3fn / e5m2 with per-tensor / per-head
scales.

The kernel of :mod:`pallas_kernels.mosaic_fp8_decode` (the keys as wgmma's M: ``S^T = K
Q^T`` with the query's e4m3 terms as B, an online softmax down the columns, ``O^T += V^T
P^T``), with the two operands that come from the cache read as these layouts store them:

* **Keys.** A page's keys of one head are ``D/x`` planes of ``[bs, x]``: a token's 128
  bytes lie in 16-byte pieces 16 * bs bytes apart. TMA copies a page as stored (rows of 128
  bytes: a copy whose rows were the 16-byte pieces, planes and tokens swapped, ran 1.4x
  slower end to end); the warpgroup then moves the pieces, 16 bytes a thread, into token
  rows of ``D/x + 1`` pieces (rows 144 bytes apart, so the loads below meet no bank
  conflicts) and loads the tile into registers in wgmma's 8-bit A layout, where it is A
  (an unswizzled tile cannot be A from shared memory). Interpreted (Pallas' GPU
  interpreter has no A in registers), the tile goes through a swizzled shared-memory tile.
* **Values.** A 16-token group of a page is ``[D, 16]`` (V^T, tokens contiguous), which
  TMA copies as stored (as rows of 128 bytes: as ``[D, 16]``, 16-byte rows, the kernel
  ran 1.3x slower); each group is loaded into registers in wgmma's 16-bit layout,
  converted to f16 (exact) and its columns outside the sequence zeroed (stale entries may
  hold NaN); the tile's four groups, put side by side in registers, are A of ``O^T += V^T
  P^T`` (P in f16 in shared memory, as the NHD / HND kernel stores it).

Everything else (the info rows, splits and their combine, the query's terms and the
scales) is the NHD / HND kernel's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jkv.layout import Plane
from pallas_kernels import lowering
from pallas_kernels.mosaic_attention import (COUNT, FP8, INFO, MAX_SPLIT_PAGES, ROWS, TILE,
                                             PageTiles, decode_info, query_term_count,
                                             scale_rows)
from pallas_kernels.mosaic_fp8_decode import (column_softmax_start, columns, combine_splits,
                                              launch, program_scratch, softmax_tile,
                                              start_program, store_partials, swizzled_tiles)

X = 16             # one-byte values per x-vector
GROUP = 16         # tokens of a value group ([D, 16]): a wgmma's K for P V
_SMEM_LIMIT = 200 * 1024
STAGES = 3   # as the NHD / HND FP8 kernel


def smem_bytes(head_size: int, stages: int, group: int, info_words: int, terms: int,
               interpret: bool) -> int:
  """Shared memory of one program: the K and V stages, the key rows (one spare x-vector
  a row; interpreted, the swizzled key tile and the converted value tile), the query as
  loaded and its ``terms`` e4m3 terms, P, O^T and its statistics for ``group`` query
  heads, the column factors, the info row of ``info_words`` int32."""
  n = columns(group)
  tiles = TILE * head_size * 3 if interpret else TILE * (head_size + X)
  return (2 * stages * TILE * head_size + ROWS * head_size * 2
          + terms * ROWS * head_size + n * TILE * 2 + head_size * n * 4 + 2 * n * 4
          + ROWS * 4 + info_words * 4 + tiles + 1024)


def supported(key_plane: Plane, value_plane: Plane, query_dtype, cache_dtype, group: int,
              *, quant: str, alibi: bool, soft_cap: bool, window: bool) -> bool:
  """Whether this kernel handles the case: an FP8 cache (e4m3fn / e5m2, per-tensor /
  per-head scales) in the vLLM layout with 16-token pages or the ASM layout with pages of
  16 tokens or more (a power of two); bf16 / fp16 queries; head_size 128; at most 64 query
  heads per KV head; no ALiBi, soft cap or sliding window; within shared memory at
  ``STAGES`` stages."""
  bs = key_plane.block_size
  values_ok = ((value_plane.kind == "VD" and bs == GROUP)
               or (value_plane.kind == "VASM" and value_plane.x == X))
  return (key_plane.kind == "KX" and key_plane.x == X and values_ok
          and np.dtype(cache_dtype) in FP8 and quant == "tensor"
          and np.dtype(query_dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
          and bs >= GROUP and bs & (bs - 1) == 0 and key_plane.head_size == 128
          and group <= ROWS and not (alibi or soft_cap or window)
          and lowering.mosaic_available()
          and smem_bytes(key_plane.head_size, STAGES, ROWS, INFO + MAX_SPLIT_PAGES,
                         query_term_count(query_dtype), True) <= _SMEM_LIMIT)


def page_views(key_cache, value_cache, key_plane: Plane):
  """The stacked caches as TMA reads them, in rows of 128 bytes: keys ``[pages * H, D/x,
  bs / 8, 128]`` (page p, head h at ``p * H + h``; a plane's 8 tokens a row), values
  ``[pages * H, bs / 16, D / 8, 128]`` (a 16-token group's ``[D, 16]``)."""
  bs, d = key_plane.block_size, key_plane.head_size
  return (key_cache.reshape(-1, d // X, bs * X // 128, 128),
          value_cache.reshape(-1, bs // GROUP, d * GROUP // 128, 128))


def _kernel(info_ref,     # int32 [B, S, INFO + pages_per_split] GMEM
            query_ref,    # [B, Hq, D] GMEM
            scale_ref,    # float32 [2, >= H] GMEM: k_scale, v_scale per head
            key_ref,      # [pages * H, D/x, bs / 8, 128] GMEM, FP8 (page_views)
            value_ref,    # [pages * H, bs / 16, D / 8, 128] GMEM, FP8
            out_ref,      # float32 [B, H, S, D, columns] GMEM: O^T, unnormalized
            stats_ref,    # float32 [B, H, S, 2, columns] GMEM: running max (base 2), sum
            info_smem, scale_smem, query_terms, column_smem, p_smem, k_smem, v_smem, q_raw,
            o_smem, stats_smem, info_bar, query_bar, scale_bar, k_bars, v_bars, *rows,
            group, num_heads, head_size, block_size, stages, scale, num_pages, interpret):
  plgpu = lowering.plgpu
  head = jax.lax.axis_index("head")
  split = jax.lax.axis_index("split")
  seq = jax.lax.axis_index("seq")
  n = columns(group)
  planes = head_size // X
  pages = PageTiles(block_size)
  lines = pages.rows * X // 128        # 128-byte rows of a plane's tokens per copy
  groups = pages.rows // GROUP         # value groups per copy
  wgmma = plgpu.Layout.WGMMA
  column_factor = start_program(info_ref.at[seq, split], query_ref.at[seq], scale_ref,
                                info_smem, scale_smem, q_raw, query_terms, column_smem,
                                (info_bar, query_bar, scale_bar), head=head, group=group,
                                scale=scale)
  num_tokens = info_smem[COUNT]
  num_tiles = (num_tokens + TILE - 1) // TILE

  def issue(t, slot):
    """TMA loads of tile ``t`` into stage ``slot``: per page (or 64-token part of one) its
    key planes and its value groups, as stored."""
    first = (t % pages.tiles_per_page) * TILE if pages.tiles_per_page > 1 else 0
    for p in range(pages.copies):
      page_head = pages.page(info_smem, t, p) * num_heads + head
      plgpu.copy_gmem_to_smem(key_ref.at[page_head, :, pl.ds(first * X // 128, lines)],
                              k_smem.at[slot, p], k_bars.at[slot])
      plgpu.copy_gmem_to_smem(value_ref.at[page_head, pl.ds(first // GROUP, groups)],
                              v_smem.at[slot, pl.ds(p * groups, groups)], v_bars.at[slot])

  for i in range(stages):
    pl.when(i < num_tiles)(functools.partial(issue, i, i))

  def body(t, carry):
    acc, running_max, sums = carry
    slot = jax.lax.rem(t, stages)
    left = num_tokens - t * TILE
    plgpu.barrier_wait(k_bars.at[slot])
    # The tile's keys as token rows [TILE, D]: each thread moves 16-byte pieces.
    if interpret:
      k_tile, v_tile = rows
      k_tile[...] = k_smem[slot].reshape(pages.copies, planes, pages.rows, X).transpose(
          0, 2, 1, 3).reshape(TILE, head_size)
      plgpu.commit_smem()
      keys = k_tile
    else:
      (k_rows,) = rows   # [copies, rows, D/x + 1, x]: rows 144 bytes apart
      pieces = plgpu.load(k_smem.at[slot], layout=plgpu.Layout.WG_STRIDED(
          k_smem.shape[1:], vec_size=X))
      k_rows.at[:, :, pl.ds(0, planes)].transpose((0, 2, 1, 3))[...] = pieces.reshape(
          pages.copies, planes, pages.rows, X)
      plgpu.commit_smem()
      keys = plgpu.load(k_rows.reshape(TILE, (planes + 1) * X).at[:, pl.ds(0, head_size)],
                        layout=plgpu.Layout.WGMMA_8BIT, optimized=False)

    def logits(acc_ref):
      for term in range(query_terms.shape[0]):
        plgpu.wgmma(acc_ref, keys, query_terms.at[term, pl.ds(0, n)].transpose((1, 0)))
      # While the wgmmas run: the value groups in f16 (exact), columns outside the
      # sequence (past its length, or in a block outside the cache) zeroed.
      plgpu.barrier_wait(v_bars.at[slot])
      values = []
      for g in range(TILE // GROUP):
        if interpret:   # (the interpreter reshapes values, not refs)
          v = v_smem[slot, g].reshape(head_size, GROUP).astype(jnp.float16)
        else:
          v = plgpu.load(v_smem.at[slot, g].reshape(head_size, GROUP), layout=wgmma,
                         optimized=False).astype(jnp.float16)
        cols = plgpu.broadcasted_iota(jnp.int32, (head_size, GROUP), 1, layout=wgmma)
        cols = cols + g * GROUP
        keep = (cols < left) & pages.inside_cache(cols, info_smem, t, num_pages)
        values.append(jnp.where(keep, v, jnp.zeros_like(v)))
      return acc_ref[...], jnp.concatenate(values, axis=1)   # V^T [D, TILE]

    s, values = pl.run_scoped(logits, plgpu.ACC((TILE, n), jnp.float32))
    alpha, new_max, sums = softmax_tile(s, column_factor, left, pages, info_smem, t,
                                        num_pages, running_max, sums, p_smem)
    if interpret:
      v_tile[...] = values
      values = v_tile
    plgpu.commit_smem()   # P for wgmma; the stage's reads before its refill

    def product(acc_ref):
      plgpu.wgmma(acc_ref, values, p_smem.transpose((1, 0)))
      return acc_ref[...]

    acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [1]) + pl.run_scoped(
        product, plgpu.ACC(acc.shape, jnp.float32))
    pl.when(t + stages < num_tiles)(lambda: issue(t + stages, slot))
    return acc, new_max, sums

  carry = jax.lax.fori_loop(0, num_tiles, body, column_softmax_start(head_size, n))
  store_partials(carry, o_smem, stats_smem, out_ref.at[seq, head, split],
                 stats_ref.at[seq, head, split])


def paged_attention_decode(query, key_cache, value_cache, k_scale, v_scale, layer,
                           block_tables, seq_lens, *, key_plane: Plane, value_plane: Plane,
                           num_blocks: int, scale: float, interpret: bool,
                           num_splits: int | None = None, stages: int = STAGES):
  """Decode attention over one layer of stacked FP8 vLLM / ASM caches, for the cases
  :func:`supported` accepts (see :mod:`jkv.ops.attention`).

  query [B, Hq, D] bf16 / fp16; key_cache [L, nb, H, D/x, bs, x], value_cache [L, nb, H,
  D, bs] (vLLM) or [L, nb, H, bs/x, D, x] (ASM), e4m3fn / e5m2; k_scale / v_scale float32
  [H] or [1]; layer int32 scalar; block_tables int32 [B, W]; seq_lens int32 [B], at most W
  * block_size. ``num_splits`` None: as the NHD / HND kernels. Returns [B, Hq, D] in the
  query's dtype.
  """
  plgpu = lowering.plgpu
  _, num_q_heads, head_size = query.shape
  num_heads, bs = key_plane.num_heads, key_plane.block_size
  group = num_q_heads // num_heads
  n = columns(group)
  terms = query_term_count(query.dtype)
  info = decode_info(key_cache, value_cache, layer, block_tables, seq_lens,
                     key_plane=key_plane, value_plane=value_plane, num_blocks=num_blocks,
                     num_splits=num_splits)
  info_width = info.shape[2]
  if group > ROWS or smem_bytes(head_size, stages, group, info_width, terms,
                                interpret) > _SMEM_LIMIT:
    raise ValueError(f"{group} query heads a KV head, {stages} stages of {head_size}-wide "
                     f"tiles: more than {ROWS} heads or {_SMEM_LIMIT} bytes of shared memory")
  keys, values = page_views(key_cache, value_cache, key_plane)
  num_pages = keys.shape[0] // num_heads
  scales = scale_rows(k_scale, v_scale, num_heads)
  cache_dtype = keys.dtype
  fp8_tiles, f16_tiles = swizzled_tiles()
  copies = PageTiles(bs).copies
  scratch = program_scratch(
      info_width, scales.shape, terms, head_size, n, copies, stages,
      (plgpu.SMEM((stages, copies, head_size // X, min(bs, TILE) * X // 128, 128),
                  cache_dtype),
       plgpu.SMEM((stages, TILE // GROUP, head_size * GROUP // 128, 128), cache_dtype),
       plgpu.SMEM((ROWS, head_size), query.dtype)))
  if interpret:   # the swizzled key tile and the converted value tile wgmma reads
    scratch += [plgpu.SMEM((TILE, head_size), cache_dtype, transforms=fp8_tiles),
                plgpu.SMEM((head_size, TILE), jnp.float16, transforms=f16_tiles)]
  else:           # the key rows, one spare x-vector a row
    scratch += [plgpu.SMEM((copies, min(bs, TILE), head_size // X + 1, X), cache_dtype)]
  kernel = functools.partial(_kernel, group=group, num_heads=num_heads, head_size=head_size,
                             block_size=bs, stages=stages, scale=scale, num_pages=num_pages,
                             interpret=interpret)
  out, stats = launch(kernel, scratch, (info, query, scales, keys, values),
                      name="jkv_paged_attention_decode_fp8_x_mosaic", num_heads=num_heads,
                      head_size=head_size, n=n, interpret=interpret)
  return combine_splits(out, stats, scales, query)
