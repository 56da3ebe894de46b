"""Paged decode attention kernel for Mosaic GPU (Hopper TMA and wgmma): NHD / HND pages.

A program takes one sequence, one KV head and one split of the context (a run of
``pages_per_split`` pages). Its group of G query heads is the A operand of wgmma, padded
to 64 rows (rows past G are zero and ignored). The split's pages stream into shared
memory by TMA in tiles of 64 tokens (one copy per page, or a 64-token part of a larger
page), ``stages`` tiles in flight, into swizzled tiles wgmma reads directly:
``S = Q K^T`` (64 x 64, float32), an online softmax in base 2, then ``acc += P V``.
Columns past the sequence's length are masked; the value rows past it, on the last
tile, are zeroed in shared memory first (stale entries may hold NaN, and 0 * NaN is
NaN). A program writes its unnormalized ``[G, D]`` float32 accumulator and its rows'
running max (base 2) and sum; :func:`paged_attention_decode` combines the splits.

The short items of ragged attention run on the same kernel (:func:`ragged_partials`): an
item's tokens (up to ``q_tokens``) x the group's heads are its rows (row ``r``: token
``r // G``), loaded by one TMA per token from the info row's first query row, and token
``j`` sees the split's keys before ``LIMIT + j`` (causal within the item); the partials go
to the ragged op's combine.

FP8 caches (e4m3fn / e5m2, per-tensor or per-head scales): the keys stay in FP8. The
query rows, scaled per row by a power of two ``c`` (the largest with ``|q| c <= 448``), are
split once into e4m3 terms (:func:`query_terms`): ``hi = e4m3(q c)``, ``lo = e4m3(q c -
hi)`` and, for an fp16 query, ``low = e4m3(q c - hi - lo)``. Each term takes the next 4
significant bits, so two terms hold a bf16 element (8 bits) and three an fp16 one (11):
their sum is ``q c`` exactly for elements of ``|q c| >= 2^-2`` (bf16) or ``>= 2`` (fp16),
about 2^-11 and 2^-8 of the row's largest; below, the last term is e4m3-subnormal, an
absolute error of at most 2^-10. (Two terms left an fp16 element 2^-9 of itself: over
wide rows with logits in the tens, more than a test's 0.02 in the output.) FP8 wgmma's
accumulation is coarser than float32's, far below the e4m3 keys' own 2^-4. ``S = sum_t
term_t K^T / c`` is then two (three) FP8 wgmmas straight from the TMA stage (K-major, as
FP8 wgmma needs), the terms wgmma's A operand in registers (interpreted: in shared
memory). The values are converted in shared memory
(through registers) to f16 (the probabilities too), since ``P V`` contracts over the
tile's rows, the layout FP8 wgmma cannot read. The key scale multiplies the logits and
the value scale the output, as in :mod:`pallas_kernels.attention`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jkv import quant
from jkv.layout import Plane
from pallas_kernels import common, lowering

TILE = 64          # tokens per tile: wgmma's N for Q K^T, its K for P V
ROWS = 64          # wgmma's M: the group's query rows, zero-padded
INFO = 32          # int32 words before the split's page ids in its info row, so the page
                   # ids start 128 bytes in
MAX_SPLIT_PAGES = 8192   # a split's pages at most (its info row: 32 KiB of shared memory)
COUNT, ROW, LIMIT = range(3)   # the info row's words: the split's keys, the first query row
                               # (ragged), the first row's keys past the split's start
_SMEM_LIMIT = 200 * 1024
FP8 = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))   # the FP8 caches read
QUERY_TERMS = jnp.float8_e4m3fn   # the dtype of the FP8 query's terms (query_terms)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def smem_bytes(head_size: int, stages: int, query_dtype, cache_dtype) -> int:
  """Shared memory of one program: the K / V stages (and the converted value tile for FP8),
  the query (FP8: its e4m3 terms), P, the float32 output tile and its statistics, the info
  row (at most ``MAX_SPLIT_PAGES`` pages)."""
  itemsize, cache_itemsize = np.dtype(query_dtype).itemsize, np.dtype(cache_dtype).itemsize
  tile = TILE * head_size
  shared = max(2 * stages * tile * cache_itemsize, ROWS * head_size * (itemsize + 4))
  fp8 = np.dtype(cache_dtype) in FP8
  converted = tile * 2 if fp8 else 0   # the f16 value tile
  query = ROWS * head_size * (query_term_count(query_dtype) if fp8 else itemsize)
  info = (INFO + MAX_SPLIT_PAGES) * 4
  return shared + converted + query + ROWS * TILE * 2 + 2 * ROWS * 4 + info + 1024


def supported(key_plane: Plane, value_plane: Plane, query_dtype, cache_dtype, group: int,
              *, quant: str, alibi: bool, soft_cap: bool, window: bool) -> bool:
  """Whether this kernel handles the case:

  * NHD / HND planes (flash, hnd, packed layouts) with pages of at least 8 tokens, a power
    of two (tiles of 64 tokens are whole pages or whole parts of one);
  * a bf16 / fp16 query, and a cache of the query's dtype or FP8 (e4m3fn / e5m2) with
    per-tensor / per-head scales (``quant`` ``"none"`` / ``"tensor"``);
  * head_size 64 or 128 (128 for FP8 caches: 128-byte swizzled rows; 256 would hold a
    [64, 256] float32 accumulator twice in registers, and was never compiled), at most 64
    query heads per KV head, shared memory within ``_SMEM_LIMIT``;
  * no ALiBi, soft cap or sliding window (those run on the Triton kernel).
  """
  planes_ok = all(p.kind in ("NHD", "HND") for p in (key_plane, value_plane))
  bs, d = key_plane.block_size, key_plane.head_size
  query_dtype, cache_dtype = np.dtype(query_dtype), np.dtype(cache_dtype)
  dtype_ok = query_dtype in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)) and (
      (quant == "none" and cache_dtype == query_dtype)
      or (quant == "tensor" and cache_dtype in FP8))
  fp8_ok = cache_dtype not in FP8 or d % 128 == 0   # FP8 tiles: 128-byte swizzled rows
  shape_ok = (bs >= 8 and bs & (bs - 1) == 0 and d in (64, 128) and group <= ROWS
              and fp8_ok)
  smem_ok = smem_bytes(d, 2, query_dtype, cache_dtype) <= _SMEM_LIMIT
  return (planes_ok and dtype_ok and shape_ok and smem_ok and not (alibi or soft_cap or window)
          and lowering.mosaic_available())


class PageTiles:
  """How ``TILE``-token K / V tiles cover pages of ``block_size`` tokens, for the Mosaic
  attention kernels: a tile is ``copies`` TMA copies of ``rows`` tokens each (whole pages)
  or a ``rows``-token part of one page (``tiles_per_page`` tiles a page). The page ids come
  from an info row in shared memory, from word ``INFO``; a block outside the cache has the
  id ``num_pages`` (past the view: TMA fills zeros)."""

  def __init__(self, block_size: int):
    self.copies = max(1, TILE // block_size)
    self.rows = min(block_size, TILE)
    self.tiles_per_page = max(1, block_size // TILE)

  def page(self, info_smem, t, p):
    """Page id of tile ``t``'s ``p``-th copy."""
    if self.tiles_per_page > 1:
      return info_smem[INFO + t // self.tiles_per_page]
    return info_smem[INFO + t * self.copies + p]

  def rows_of(self, t):
    """The token rows of tile ``t``'s copies in their pages."""
    return pl.ds((t % self.tiles_per_page) * TILE if self.tiles_per_page > 1 else 0,
                 self.rows)

  def part(self, p):
    """Copy ``p``'s rows of a tile in shared memory."""
    return pl.ds(p * self.rows, self.rows)

  def source(self, ref, plane: Plane, page, rows, head, head_size: int):
    """The GMEM box of a copy: ``rows`` of page ``page``, head ``head`` of ``plane`` in
    ``ref`` (``[pages, bs, H, row]`` NHD or ``[pages, H, bs, row]`` HND, :func:`page_views`)."""
    columns = pl.ds(plane.base, head_size)
    return (ref.at[page, rows, head, columns] if plane.kind == "NHD"
            else ref.at[page, head, rows, columns])

  def load(self, info_smem, t, slot, head, head_size: int, streams):
    """TMA loads of tile ``t`` into stage ``slot`` of each of ``streams``: ``(ref, plane,
    stages, barriers)`` (the GMEM cache view, its plane, the shared-memory stages, their
    barriers), head ``head``."""
    for p in range(self.copies):
      page = self.page(info_smem, t, p)
      rows = self.rows_of(t)
      for ref, plane, stage, bars in streams:
        lowering.plgpu.copy_gmem_to_smem(self.source(ref, plane, page, rows, head, head_size),
                                         stage.at[slot, self.part(p)], bars.at[slot])

  def inside_cache(self, columns, info_smem, t, num_pages: int):
    """Mask of tile ``t``'s columns (int32 iota, any layout) whose block lies in the cache
    (one bit per copy)."""
    pages = [self.page(info_smem, t, p) for p in range(self.copies)]
    if len(pages) == 1:
      return pages[0] < num_pages
    outside = sum((page >= num_pages).astype(jnp.int32) << p for p, page in enumerate(pages))
    return ((outside >> (columns // self.rows)) & 1) == 0


def start_streams(tiles: PageTiles, info_smem, head, head_size: int, stages: int, streams):
  """A split's ``(num_tokens, num_tiles, issue)``: its keys (the info row's ``COUNT``), its
  tiles and ``issue(t, slot)``, the TMA loads of tile ``t`` into stage ``slot`` of each of
  ``streams`` (:meth:`PageTiles.load`); the first ``stages`` tiles' loads are issued."""
  num_tokens = info_smem[COUNT]
  num_tiles = (num_tokens + TILE - 1) // TILE

  def issue(t, slot):
    tiles.load(info_smem, t, slot, head, head_size, streams)

  for i in range(stages):
    pl.when(i < num_tiles)(functools.partial(issue, i, i))
  return num_tokens, num_tiles, issue


def add_product(acc, alpha, alpha_axis: int, a, b):
  """``acc * alpha + a @ b``: ``alpha`` broadcast along ``acc``'s axis ``alpha_axis`` (one
  factor per row, or per column), the product by wgmma into a scoped float32 accumulator
  (what Pallas' GPU interpreter runs, as a running one in place does not)."""
  def product(acc_ref):
    lowering.plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]

  return acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [alpha_axis]) + pl.run_scoped(
      product, lowering.plgpu.ACC(acc.shape, jnp.float32))


def zero_rows_past(values, left, head_size: int):
  """Zeroes the rows at and past ``left`` of the [TILE, head_size] value tile ``values``
  (shared memory, 16-bit): a tile's rows past the keys may hold stale entries, NaN even,
  and 0 * NaN is NaN."""
  plgpu = lowering.plgpu
  wgmma = plgpu.Layout.WGMMA
  v = plgpu.load(values, layout=wgmma)
  v_rows = plgpu.broadcasted_iota(jnp.int32, (TILE, head_size), 0, layout=wgmma)
  values[...] = jnp.where(v_rows < left, v, jnp.zeros_like(v))


def split_counts(seq_lens, splits: int, split_tokens: int):
  """int32 [B, splits]: the keys of each sequence (``seq_lens`` [B]) in each of ``splits``
  context splits of ``split_tokens`` tokens."""
  return jnp.clip(seq_lens[:, None] - jnp.arange(splits)[None] * split_tokens, 0,
                  split_tokens)


def info_copies(words: int) -> int:
  """TMA copies of an info row of ``words`` int32 (a box holds at most 256 a dimension)."""
  return -(-words // 256)


def copy_info_row(src, info_smem, bar):
  """The info row ``src`` (int32 GMEM ``[words]``) into ``info_smem``, in
  :func:`info_copies` copies arriving on ``bar``."""
  words = info_smem.shape[0]
  for start in range(0, words, 256):
    size = min(256, words - start)
    lowering.plgpu.copy_gmem_to_smem(src.at[pl.ds(start, size)],
                                     info_smem.at[pl.ds(start, size)], bar)


def query_row_scale(query):
  """c [rows] of the query rows [rows, D] (any layout): a power of two per row, the largest
  with ``max |query row| * c <= 448`` (e4m3's largest; the exponent bits of ``448 / amax``;
  an all-zero row: 2^108)."""
  amax = jnp.max(jnp.abs(query.astype(jnp.float32)), axis=1)
  quotient = quant.dtype_max(QUERY_TERMS) / jnp.maximum(amax, 1e-30)
  return jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(quotient, jnp.int32) & 0x7F800000, jnp.float32)


def query_term_count(query_dtype) -> int:
  """e4m3 terms of a query of ``query_dtype`` (:func:`query_terms`): 2 for bf16 (8
  significant bits), 3 for fp16 (11)."""
  return 3 if np.dtype(query_dtype) == np.dtype(jnp.float16) else 2


def query_terms(query, layout=None, *, xla: bool = False):
  """The query rows [rows, D] as :func:`query_term_count` e4m3 arrays whose sum is
  ``query * c`` per row (:func:`query_row_scale`; exactly for elements of ``|query * c|``
  at least 2^-2 (bf16) or 2 (fp16), see the module docstring), largest first. ``layout``:
  the query's register layout where it is not WGMMA (the broadcast of ``c`` takes it).
  ``xla``: the split runs in XLA, not in a kernel: each term's round trip through e4m3 is
  kept behind an optimization barrier, as XLA on GPU (excess precision allowed) folds
  ``f32 -> e4m3 -> f32`` away, which made every later term zero (H200, jax 0.11.2)."""
  c = jax.lax.broadcast_in_dim(query_row_scale(query), query.shape, [0])
  if layout is not None:
    c = lowering.plgpu.layout_cast(c, layout)
  x = query.astype(jnp.float32) * c
  terms = [x.astype(QUERY_TERMS)]
  for _ in range(query_term_count(query.dtype) - 1):
    rounded = jax.lax.optimization_barrier(terms[-1]) if xla else terms[-1]
    x = x - rounded.astype(jnp.float32)
    terms.append(x.astype(QUERY_TERMS))
  return tuple(terms)


def split_query(query, q_tile):
  """:func:`query_terms` of the query rows [ROWS, D] stored at ``q_tile[0]``,
  ``q_tile[1]``, ...; returns ``1 / c`` [ROWS]."""
  for index, term in enumerate(query_terms(query)):
    q_tile[index] = term
  return 1.0 / query_row_scale(query)


def _kernel(info_ref,       # int32 [B, S, INFO + pages_per_split] GMEM
            query_ref,      # [B, Hq, D] GMEM (ragged: [T, Hq, D])
            scale_ref,      # float32 [2, >= H] GMEM: k_scale, v_scale per head (FP8)
            key_ref,        # [pages, bs, H, row] (NHD) or [pages, H, bs, row] (HND) GMEM
            value_ref,
            out_ref,        # float32 [B, H, S, G * q_tokens rounded up to 8, D] GMEM
            stats_ref,      # float32 [B, H, S, 2, ROWS] GMEM: running max (base 2), sum
            info_smem, q_tile, p_tile, scale_smem, shared, stats_smem,
            info_bar, query_bar, scale_bar, k_bars, v_bars, *converted,
            group, planes, head_size, stages, scale, fp8, num_pages, q_tokens,
            query_registers):
  """``q_tokens`` None: decode (query row ``seq``, every row sees the split's keys); an
  int: short items of ragged attention, ``q_tokens`` consecutive query rows from the info
  row's ``ROW`` (row ``r`` is token ``r // group``), token ``j`` seeing the keys before
  ``LIMIT + j`` (split-local)."""
  plgpu = lowering.plgpu
  head = jax.lax.axis_index("head")
  split = jax.lax.axis_index("split")
  seq = jax.lax.axis_index("seq")
  (k_smem, v_smem), (q_smem, o_smem) = shared   # the stages alias the query's and output's
  tiles = PageTiles(planes[0].block_size)
  copy_info_row(info_ref.at[seq, split], info_smem, info_bar)
  plgpu.copy_gmem_to_smem(scale_ref, scale_smem, scale_bar)
  if q_tokens is None:
    plgpu.copy_gmem_to_smem(query_ref.at[seq, pl.ds(head * group, group)],
                            q_smem.at[pl.ds(0, group)], query_bar)
    plgpu.barrier_wait(info_bar)
  else:   # the item's rows (clamped into the query: rows past the item are ignored)
    plgpu.barrier_wait(info_bar)
    last_row = query_ref.shape[0] - 1
    for j in range(q_tokens):
      plgpu.copy_gmem_to_smem(
          query_ref.at[jnp.minimum(info_smem[ROW] + j, last_row), pl.ds(head * group, group)],
          q_smem.at[pl.ds(j * group, group)], query_bar)
  plgpu.barrier_wait(query_bar)
  plgpu.barrier_wait(scale_bar)
  wgmma = plgpu.Layout.WGMMA
  reduced = wgmma.reduce(1)
  q_rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, head_size), 0, layout=wgmma)
  # Rows past the group are never loaded (masked); a one-off load, bank conflicts allowed.
  # Done before the first tile loads: those overwrite q_smem (commit_smem orders them).
  query = plgpu.load(q_smem, layout=wgmma, optimized=False)
  query = jnp.where(q_rows < group * (q_tokens or 1), query, jnp.zeros_like(query))
  # FP8, compiled: the e4m3 terms in registers, in the 8-bit A layout (8 x 32K, H200: 220
  # us against 226 from shared memory); interpreted (Pallas' GPU interpreter runs wgmma on
  # shared-memory operands only): in q_tile.
  if fp8 and query_registers:
    row_scale = 1.0 / query_row_scale(query)
    layout = plgpu.Layout.WGMMA_8BIT
    rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, head_size), 0, layout=layout)
    query = plgpu.load(q_smem, layout=layout, optimized=False)
    q_terms = query_terms(jnp.where(rows < group * (q_tokens or 1), query,
                                    jnp.zeros_like(query)), layout)
  elif fp8:
    row_scale = split_query(query, q_tile)
    q_terms = tuple(q_tile.at[index] for index in range(q_tile.shape[0]))
  else:
    q_tile[...] = query
    q_terms = (q_tile,)
  plgpu.commit_smem()
  num_tokens, num_tiles, issue = start_streams(
      tiles, info_smem, head, head_size, stages, ((key_ref, planes[0], k_smem, k_bars),
                                                  (value_ref, planes[1], v_smem, v_bars)))

  logit_scale = scale * _LOG2E   # logits in base 2: exp2 of them is exp of the natural
  if fp8:   # and per row, 1 / c of the split query
    row_scale = row_scale * (logit_scale * scale_smem[0, head])

  def convert(stage, slot, dst):
    """FP8 tile -> ``dst``'s dtype, in shared memory (the scales apply outside)."""
    x = plgpu.load(stage.at[slot], layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(jnp.float16)
    dst[...] = x.astype(dst.dtype)   # exact: FP8 values fit f16 and bf16

  def body(t, carry):
    acc, running_max, running_sum = carry
    slot = jax.lax.rem(t, stages)
    plgpu.barrier_wait(k_bars.at[slot])
    keys = k_smem.at[slot].transpose((1, 0))
    left = num_tokens - t * TILE

    def logits(acc_ref):
      for q_term in q_terms:
        plgpu.wgmma(acc_ref, q_term, keys)
      return acc_ref[...]

    s = pl.run_scoped(logits, plgpu.ACC((ROWS, TILE), jnp.float32))
    s = s * (jax.lax.broadcast_in_dim(row_scale, s.shape, [0]) if fp8 else logit_scale)
    columns = plgpu.broadcasted_iota(jnp.int32, (ROWS, TILE), 1, layout=wgmma)
    visible = (columns < left) & tiles.inside_cache(columns, info_smem, t, num_pages)
    if q_tokens is not None and q_tokens > 1:   # causal among the item's tokens
      rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, TILE), 0, layout=wgmma)
      visible &= columns < info_smem[LIMIT] - t * TILE + rows // group
    s = jnp.where(visible, s, -jnp.inf)
    new_max = jnp.maximum(running_max, s.max(axis=1))
    alpha = jnp.exp2(running_max - new_max)
    p = jnp.exp2(s - jax.lax.broadcast_in_dim(new_max, s.shape, [0]))
    running_sum = running_sum * alpha + p.sum(axis=1)
    p_tile[...] = p.astype(p_tile.dtype)
    # The values after the softmax (preparing them while Q K^T ran measured no faster in bf16
    # and 2-3% slower in FP8, H200 2026-11-26).
    plgpu.barrier_wait(v_bars.at[slot])
    values = v_smem.at[slot]
    if fp8:
      convert(v_smem, slot, converted[0])
      values = converted[0]

    # The last tile: value rows past the length may hold NaN.
    pl.when(left < TILE)(functools.partial(zero_rows_past, values, left, head_size))

    plgpu.commit_smem()

    acc = add_product(acc, alpha, 0, p_tile, values)
    pl.when(t + stages < num_tiles)(lambda: issue(t + stages, slot))
    return acc, new_max, running_sum

  init = (plgpu.layout_cast(jnp.zeros((ROWS, head_size), jnp.float32), wgmma),
          plgpu.layout_cast(jnp.full((ROWS,), -1e30, jnp.float32), reduced),
          plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), reduced))
  acc, running_max, running_sum = jax.lax.fori_loop(0, num_tiles, body, init)
  o_smem[...] = acc
  stats_smem[0] = running_max
  stats_smem[1] = running_sum
  plgpu.commit_smem()
  out_rows = out_ref.shape[3]   # the group's rows, in whole 8-row tiles
  plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, out_rows)], out_ref.at[seq, head, split])
  plgpu.copy_smem_to_gmem(stats_smem, stats_ref.at[seq, head, split])
  plgpu.wait_smem_to_gmem(0)


def default_splits(num_seqs: int, num_heads: int, tiles: int, target_programs: int = 256) -> int:
  """Context splits: enough that ``num_seqs * num_heads * splits`` reaches about
  ``target_programs`` (two programs fit an SM), at most one per tile. Measured on an H100
  (2026-11-26, 8 x 32K, 8 kv heads, bf16): 4 splits 359 us, 8: 360, 16: 362."""
  return max(1, min(tiles, -(-target_programs // (num_seqs * num_heads))))


def page_views(key_cache, value_cache, key_plane: Plane, value_plane: Plane):
  """The stacked caches as every layer's pages in one view, ``[pages, bs, H, row]`` (NHD)
  or ``[pages, H, bs, row]`` (HND) (value_cache None: K and V share key_cache)."""
  bs, num_heads = key_plane.block_size, key_plane.num_heads
  row = key_plane.row or key_plane.head_size
  caches = (key_cache, key_cache if value_cache is None else value_cache)
  return [c.reshape((-1, bs, num_heads, row) if p.kind == "NHD" else (-1, num_heads, bs, row))
          for c, p in zip(caches, (key_plane, value_plane))]


def scale_rows(k_scale, v_scale, num_heads: int):
  """float32 [2, H rounded up to 32] (whole 128-byte rows): k_scale, v_scale per head."""
  head_pad = -(-num_heads // 32) * 32
  return jnp.zeros((2, head_pad), jnp.float32).at[:, :num_heads].set(
      jnp.stack(common.head_scales(k_scale, v_scale, num_heads)))


def split_geometry(batch: int, num_heads: int, width: int, block_size: int,
                   num_splits: int | None, max_pages: int = MAX_SPLIT_PAGES):
  """``(splits, pages_per_split)`` of a block table ``width`` pages wide: whole tiles per
  split, at most ``max_pages`` pages; ``num_splits`` None: :func:`default_splits`."""
  tile_pages = PageTiles(block_size).copies   # pages per tile (1: a page holds whole tiles)
  tiles = -(-width // tile_pages)
  splits = num_splits or default_splits(batch, num_heads, tiles)
  # Enough splits that a split's info row fits shared memory (long tables, many sequences).
  splits = max(splits, -(-tiles // (max_pages // tile_pages)))
  pages_per_split = -(-tiles // splits) * tile_pages
  return -(-width // pages_per_split), pages_per_split


def split_info(block_tables, layer, counts, splits: int, pages_per_split: int,
               num_blocks: int, num_pages: int, words=()):
  """int32 [B, splits, width]: per (sequence, split) its key count (``counts`` [B, splits]),
  ``words`` (``(index, [B, splits])`` pairs), then from ``INFO`` its pages (every layer's
  pages in one view; blocks outside the cache -> ``num_pages``, which TMA reads as zeros)."""
  batch, width = block_tables.shape
  info_width = -(-(INFO + pages_per_split) // 32) * 32
  table = jnp.pad(block_tables, ((0, 0), (0, splits * pages_per_split - width)))
  pages = jnp.where((table >= 0) & (table < num_blocks), table + layer * num_blocks, num_pages)
  header = [jnp.zeros((batch, splits), jnp.int32)] * INFO
  for index, value in ((COUNT, counts), *words):
    header[index] = value.astype(jnp.int32)
  # One concatenation (one XLA fusion), not an update per word.
  return jnp.concatenate(
      [jnp.stack(header, axis=2), pages.reshape(batch, splits, pages_per_split),
       jnp.zeros((batch, splits, info_width - INFO - pages_per_split), jnp.int32)], axis=2)


def decode_info(key_cache, value_cache, layer, block_tables, seq_lens, *, key_plane: Plane,
                value_plane: Plane, num_blocks: int, num_splits: int | None):
  """The decode kernels' info rows (:func:`split_info`): each sequence's ``seq_lens`` keys
  in :func:`split_geometry`'s context splits of its ``block_tables`` row."""
  batch, width = block_tables.shape
  bs = key_plane.block_size
  splits, pages_per_split = split_geometry(batch, key_plane.num_heads, width, bs, num_splits)
  num_pages = page_views(key_cache, value_cache, key_plane, value_plane)[0].shape[0]
  counts = split_counts(seq_lens, splits, pages_per_split * bs)
  return split_info(block_tables, layer, counts, splits, pages_per_split, num_blocks,
                    num_pages)


def split_weights(stats, group: int):
  """The combine of a decode's splits, from the kernels' ``stats`` [B, H, S, 2, >= group]
  (running max in base 2, sum): ``(weight [B, H, S, group]`` of each split's unnormalized
  partial, ``total [B, H, group])`` the combined softmax denominator."""
  running_max, running_sum = stats[:, :, :, 0, :group], stats[:, :, :, 1, :group]
  weight = jnp.exp2(running_max - jnp.max(running_max, axis=2, keepdims=True))
  return weight, jnp.sum(running_sum * weight, axis=2)


def normalized(acc, total):
  """The combined partials ``acc`` [B, H, G, D] over their denominator ``total`` [B, H, G];
  0 where no key was seen."""
  return jnp.where(total[..., None] > 0, acc / jnp.where(total > 0, total, 1)[..., None], 0)


def _run(query, key_cache, value_cache, k_scale, v_scale, info, *, key_plane: Plane,
         value_plane: Plane, group: int, scale: float, interpret: bool, stages: int,
         q_tokens: int | None):
  """The kernel over ``info`` [B, splits, width] (:func:`split_info`): ``(out float32 [B, H,
  splits, rows, D] unnormalized, stats float32 [B, H, splits, 2, ROWS]: running max in base
  2 and sum; scales [2, >= H])`` with ``rows`` the item's rows (``group * q_tokens``) in
  whole 8-row tiles."""
  plgpu = lowering.plgpu
  batch, splits, info_width = info.shape
  head_size = query.shape[-1]
  num_heads, bs = key_plane.num_heads, key_plane.block_size
  views = page_views(key_cache, value_cache, key_plane, value_plane)
  scales = scale_rows(k_scale, v_scale, num_heads)
  head_pad = scales.shape[1]
  cache_dtype = np.dtype(views[0].dtype)
  fp8 = cache_dtype in FP8
  dtype = query.dtype
  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  if fp8:
    stage_type = plgpu.SMEM((stages, TILE, head_size), cache_dtype,
                            transforms=(plgpu.TilingTransform((8, 128)),
                                        plgpu.SwizzleTransform(128)))
    # Values and probabilities in f16 (one conversion from FP8; probabilities lie in
    # [0, 1], where f16 is the finer format); the keys are read as stored.
    converted = [plgpu.SMEM((TILE, head_size), jnp.float16, transforms=swizzled)]
    # The query's e4m3 terms (:func:`split_query`), wgmma's A operands.
    q_type = plgpu.SMEM((query_term_count(dtype), ROWS, head_size), QUERY_TERMS,
                        transforms=stage_type.transforms)
  else:
    stage_type = plgpu.SMEM((stages, TILE, head_size), dtype, transforms=swizzled)
    converted = []
    q_type = plgpu.SMEM((ROWS, head_size), dtype, transforms=swizzled)
  # The K / V stages share their memory with the query as loaded (before the first tile)
  # and the output (after the last).
  shared = plgpu.RefUnion((stage_type, stage_type),
                          (plgpu.SMEM((ROWS, head_size), dtype),
                           plgpu.SMEM((ROWS, head_size), jnp.float32,   # swizzled: stores of
                                      transforms=(plgpu.TilingTransform((8, 32)),   # WGMMA
                                                  plgpu.SwizzleTransform(128)))))   # rows
  scratch = [plgpu.SMEM((info_width,), jnp.int32), q_type,
             plgpu.SMEM((ROWS, TILE), jnp.float16 if fp8 else dtype, transforms=swizzled),
             plgpu.SMEM((2, head_pad), jnp.float32), shared, plgpu.SMEM((2, ROWS), jnp.float32),
             plgpu.Barrier(num_arrivals=info_copies(info_width)),
             plgpu.Barrier(num_arrivals=q_tokens or 1), plgpu.Barrier(),
             plgpu.Barrier(num_arrivals=PageTiles(bs).copies, num_barriers=stages),
             plgpu.Barrier(num_arrivals=PageTiles(bs).copies, num_barriers=stages)] + converted
  if smem_bytes(head_size, stages, dtype, cache_dtype) > _SMEM_LIMIT:
    raise ValueError(f"{stages} stages of {head_size}-wide tiles take more shared memory than "
                     f"a program may ({_SMEM_LIMIT} bytes)")
  out_rows = -(-group * (q_tokens or 1) // 8) * 8   # whole 8-row tiles of the output tile
  kernel = functools.partial(
      _kernel, group=group, planes=(key_plane, value_plane), head_size=head_size,
      stages=stages, scale=scale, fp8=fp8, num_pages=views[0].shape[0], q_tokens=q_tokens,
      query_registers=not interpret)
  out, stats = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((batch, num_heads, splits, out_rows, head_size),
                                     jnp.float32),
                jax.ShapeDtypeStruct((batch, num_heads, splits, 2, ROWS), jnp.float32)),
      grid=(num_heads, splits, batch), grid_names=("head", "split", "seq"),
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(lowering_semantics=lowering.MOSAIC_SEMANTICS),
      interpret=lowering.mosaic_interpret(interpret),
      kernel_name="jkv_paged_attention_decode_mosaic",
  )(info, query, scales, *views)
  return out, stats, scales


def paged_attention_decode(query, key_cache, value_cache, k_scale, v_scale, layer,
                           block_tables, seq_lens, *, key_plane: Plane, value_plane: Plane,
                           num_blocks: int, scale: float, interpret: bool,
                           num_splits: int | None = None, stages: int = 2):
  """Decode attention over one layer of stacked caches, for the cases :func:`supported`
  accepts (see :mod:`jkv.ops.attention`).

  query [B, Hq, D] bf16 / fp16; key_cache / value_cache [L, ...] in the planes' NHD / HND
  layout (value_cache None: K and V share key_cache, packed); k_scale / v_scale float32
  [H] (used for FP8 caches); layer int32 scalar; block_tables int32 [B, W]; seq_lens int32
  [B], at most W * block_size. ``num_splits`` None: :func:`default_splits`. ``stages``:
  tiles in flight (2 lets two programs share an SM: 8 x 32K bf16 on an H100, 359 us
  against 361 with 3; 64 x 2K 185 against 192). Returns [B, Hq, D] in the query's dtype.
  """
  batch, num_q_heads, head_size = query.shape
  num_heads = key_plane.num_heads
  group = num_q_heads // num_heads
  info = decode_info(key_cache, value_cache, layer, block_tables, seq_lens,
                     key_plane=key_plane, value_plane=value_plane, num_blocks=num_blocks,
                     num_splits=num_splits)
  out, stats, scales = _run(query, key_cache, value_cache, k_scale, v_scale, info,
                            key_plane=key_plane, value_plane=value_plane, group=group,
                            scale=scale, interpret=interpret, stages=stages, q_tokens=None)
  weight, total = split_weights(stats, group)
  acc = jnp.sum(out[:, :, :, :group] * weight[..., None], axis=2)    # [B, H, G, D]
  out = normalized(acc, total)
  if np.dtype(key_cache.dtype) in FP8:
    out = out * scales[1, :num_heads, None, None]
  return out.reshape(batch, num_q_heads, head_size).astype(query.dtype)


def ragged_partials(query, key_cache, value_cache, k_scale, v_scale, layer, block_tables,
                    kv_lens, short_items, *, q_tokens: int, key_plane: Plane,
                    value_plane: Plane, num_blocks: int, scale: float, interpret: bool,
                    num_splits: int | None = None, stages: int = 2):
  """The short items of ragged attention (:func:`pallas_kernels.ragged_attention.work_lists`:
  one per sequence slot, ``(seq, row0, rows, pos0)`` int32 [S] each, ``rows`` at most
  ``q_tokens``), for the cases :func:`supported` accepts.

  query [T, Hq, D]; caches, scales and layer as :func:`paged_attention_decode`;
  block_tables int32 [S, W]; kv_lens int32 [S], clamped to the table. Token ``j`` of an
  item sees the keys before ``kv_len - (rows - 1 - j)``. Returns the partials of each
  (item, KV head, split) at ``(item * H + head) * splits + split``: ``acc`` float32 [N,
  rows, D] (the value scale applied), ``max`` (natural units) and ``sum`` float32 [N,
  rows], ``rows = G * q_tokens`` in whole 8-row tiles (row ``r``: token ``r // G``).
  """
  num_slots, width = block_tables.shape
  num_heads, bs = key_plane.num_heads, key_plane.block_size
  group = query.shape[1] // num_heads
  _, row0, owned, _ = short_items
  splits, pages_per_split = split_geometry(num_slots, num_heads, width, bs, num_splits)
  num_pages = page_views(key_cache, value_cache, key_plane, value_plane)[0].shape[0]
  split_start = jnp.arange(splits, dtype=jnp.int32)[None] * (pages_per_split * bs)
  end = jnp.where(owned > 0, kv_lens, 0)[:, None] - split_start       # [S, splits]
  counts = jnp.clip(end, 0, pages_per_split * bs)
  limit = end - (owned[:, None] - 1)
  first_row = jnp.broadcast_to(jnp.clip(row0, 0, query.shape[0] - 1)[:, None], counts.shape)
  info = split_info(block_tables, layer, counts, splits, pages_per_split, num_blocks,
                    num_pages, words=((ROW, first_row), (LIMIT, limit)))
  out, stats, scales = _run(query, key_cache, value_cache, k_scale, v_scale, info,
                            key_plane=key_plane, value_plane=value_plane, group=group,
                            scale=scale, interpret=interpret, stages=stages, q_tokens=q_tokens)
  rows = out.shape[3]
  if np.dtype(key_cache.dtype) in FP8:
    out = out * scales[1, :num_heads, None, None, None]
  partials = num_slots * num_heads * splits
  return (out.reshape(partials, rows, -1),
          (stats[:, :, :, 0, :rows] * _LN2).reshape(partials, rows),
          stats[:, :, :, 1, :rows].reshape(partials, rows))
