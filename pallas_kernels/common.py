"""Helpers that more than one kernel module uses: tile sizes, cache views, stored values,
and the quantized writes' loads and stores.

Kernel modules import these (and :mod:`pallas_kernels.lowering`, the back-end shims) and
nothing private from each other; format constants come from :mod:`jkv.formats`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jkv import quant
from jkv.layout import Plane
from pallas_kernels import lowering

FNUZ = np.dtype(jnp.float8_e4m3fnuz)   # stored as uint8 bits in kernels (Triton has no such type)


def next_pow2(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1); Triton tiles are powers of two."""
  return 1 << max(0, int(n) - 1).bit_length()


def tokens_per_program(num_tokens: int, elems_per_token: int, target: int,
                       min_programs: int = 128) -> int:
  """A power of two with tokens x elems ~ target, halved while that leaves fewer than
  ``min_programs`` programs (small writes: more programs in flight)."""
  tokens = max(1, target // next_pow2(elems_per_token))
  tokens = min(1 << (tokens.bit_length() - 1), next_pow2(num_tokens))
  while tokens > 1 and pl.cdiv(num_tokens, tokens) < min_programs:
    tokens //= 2
  return tokens


def program_tokens(slot_ref, tokens_per_program: int, num_tokens: int, num_slots: int):
  """This program's tokens along grid axis 0 and their slots: ``(t, t_ok, slot, ok)``, t
  int32 [TB] clamped in range, slot int32 [TB] (-1 past the tokens), ``ok`` where the slot
  is in ``[0, num_slots)`` (padding and slots past the cache write nothing)."""
  t = pl.program_id(0) * tokens_per_program + lax.iota(jnp.int32, tokens_per_program)
  t_ok = t < num_tokens
  t = jnp.where(t_ok, t, 0)
  slot = lowering.load(slot_ref.at[t], mask=t_ok, other=-1)
  return t, t_ok, slot, (slot >= 0) & (slot < num_slots)


def program_heads(heads_per_program: int, num_heads: int):
  """This program's heads along grid axis 1: ``(h, h_ok)``, h int32 [HB] clamped in range."""
  h = pl.program_id(1) * heads_per_program + lax.iota(jnp.int32, heads_per_program)
  h_ok = h < num_heads
  return jnp.where(h_ok, h, 0), h_ok


def chunks(*sizes: int) -> tuple[tuple[int, int, int], ...]:
  """Consecutive column chunks ``(start, size, padded)`` of the given sizes, each padded
  to a power of two >= 16 (Triton tiles)."""
  out, first = [], 0
  for size in sizes:
    out.append((first, size, max(16, next_pow2(size))))
    first += size
  return tuple(out)


def head_scales(k_scale, v_scale, num_heads: int):
  """Per-tensor scales as the attention kernels index them, by KV head: float32
  [num_heads] each, broadcast from a scalar or [1] (a GPU does not bounds-check a [1]
  scale indexed by head); any other shape raises."""
  return (jnp.broadcast_to(k_scale, (num_heads,)).astype(jnp.float32),
          jnp.broadcast_to(v_scale, (num_heads,)).astype(jnp.float32))


def compute_dtype_of(query_dtype, cache_dtype):
  """The tensor-core input dtype: the query's 16-bit dtype when every cache value is exact
  in it (the same dtype, or FP8 / INT8), else float32."""
  query_dtype, cache_dtype = np.dtype(query_dtype), np.dtype(cache_dtype)
  if query_dtype.itemsize == 2 and (cache_dtype == query_dtype or cache_dtype.itemsize == 1):
    return query_dtype
  return np.dtype(jnp.float32)


def f16_queries(query_dtype, cache_dtype, fmt) -> bool:
  """Whether a kernel takes the query as f16 (:func:`f16_query_tiles`): a bf16 query
  and a per-tensor FP8 cache. An FP8 value converts to f16 in one instruction, to bf16 in
  three (H200, FP8 cache, 32/8 heads, d128: 8 x 32K decode over the vLLM layout 350 ->
  316 us; the 4 x 2048-token ragged prefill 3798 -> 3360 us)."""
  return (np.dtype(query_dtype) == np.dtype(jnp.bfloat16) and quant.is_fp8(cache_dtype)
          and fmt.quant == "tensor")


def f16_query(query, k_scale):
  """Outside a kernel: a bf16 query [..., D] -> (f16, k_scale float32 [H] times 2^-s),
  scaled as a whole by the power of two 2^s of :func:`f16_query_tiles`. The ragged kernel
  takes its query so (H200, FP8 4 x 2048-token prefill: 3798 us with bf16, 3711 with
  f16_query_tiles per program, 3360 with the f16 query in memory)."""
  query = query.astype(jnp.float32)
  (query,), factor = f16_query_tiles([query])
  return query, k_scale * factor


def f16_query_tiles(tiles):
  """In a kernel: a program's query tiles (float32, the bf16 query's values; padding 0)
  -> (the tiles times 2^s in f16, 2^-s float32) with 2^s the power of two that puts
  their largest magnitude in [2^14, 2^15): every value of at least 2^-28 of it is then
  exact in f16 and none overflows. The logits' key scale takes 2^-s. s is at most 64
  (tiles below 2^-49 are zero against any logit)."""
  largest = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(tile)) for tile in tiles])
  # largest < 2^e with e = its biased exponent - 126 (largest >= 0: no sign bit)
  exponent = (lax.bitcast_convert_type(largest, jnp.int32) >> 23) - 126
  shift = jnp.minimum(15 - exponent, 64)
  factor = lax.bitcast_convert_type((shift + 127) << 23, jnp.float32)
  inverse = lax.bitcast_convert_type((127 - shift) << 23, jnp.float32)
  return [(tile * factor).astype(jnp.float16) for tile in tiles], inverse


def arrange(plane: Plane, *tiles):
  """Permutes [tokens, elems] tiles so that neighbouring lanes write neighbouring addresses.

  Only the order in which lanes store changes, never which value goes where: every
  tile (values, offsets, rows, mask) is permuted alike.
  """
  tokens, elems = tiles[0].shape
  x = plane.x
  if plane.kind == "KX" and elems % x == 0:
    return tuple(t.reshape(tokens, elems // x, x).transpose(1, 0, 2) for t in tiles)
  if plane.kind == "VASM" and tokens % x == 0:
    return tuple(t.reshape(tokens // x, x, elems).transpose(0, 2, 1) for t in tiles)
  if plane.kind in ("VD", "VASM"):
    return tuple(t.T for t in tiles)
  return tiles


def cache_views(caches, block_elems):
  """Caches as [rows, block_elems] views; float8_e4m3fnuz through uint8 (Triton cannot
  convert to it: kernels store its bits, :func:`quantize_stored`)."""
  views = []
  for cache in caches:
    view = cache.reshape(-1, block_elems)
    if np.dtype(cache.dtype) == FNUZ:
      view = lax.bitcast_convert_type(view, jnp.uint8)
    views.append(view)
  return views


def restore_caches(outs, caches):
  """Kernel outputs of :func:`cache_views` back in the caches' shapes and dtypes."""
  results = []
  for out, cache in zip(outs, caches):
    if np.dtype(cache.dtype) == FNUZ:
      out = lax.bitcast_convert_type(out, cache.dtype)
    results.append(out.reshape(cache.shape))
  return results


def quantize_stored(y, dtype, stored_dtype, native):
  """float32 -> stored cache values of ``dtype`` (FP8 / INT8; e4m3fnuz as uint8 bits when
  ``stored_dtype`` is uint8). ``native``: the hardware's RNE FP8 conversion (compiled
  kernels only; INT8 by :func:`lowering.int8_toward_zero`)."""
  if np.dtype(stored_dtype) == np.dtype(jnp.uint8):
    return quant.e4m3fnuz_bits(y)
  if native and np.dtype(dtype) == np.dtype(jnp.int8):
    return lowering.int8_toward_zero(y)
  return quant.round_to_dtype(y, dtype, native=native)


# ---- quantized writes (token_quant, block_quant, indexer) ---------------------------------

def store_tile(out_ref, plane: Plane, rows, offset_in_block, heads, dims, values, mask):
  """Stores values [N, HB, DP] of N tokens (rows, offset_in_block [N]) at their plane
  offsets, in the plane's preferred lane order. Masked lanes point one row past the
  cache (the interpreter drops them; the GPU never touches them)."""
  n, hb, dp = values.shape
  rows = jnp.where(mask, rows[:, None, None], out_ref.shape[0])
  offsets = (plane.token_offset(offset_in_block)[:, None, None]
             + plane.elem_offset(heads[None, :, None], dims[None, None, :]))
  flat = lambda a: jnp.broadcast_to(a, (n, hb, dp)).reshape(n, hb * dp)
  tiles = arrange(plane, flat(values), flat(rows), flat(offsets), flat(mask))
  values, rows, offsets, mask = tiles
  lowering.store(out_ref.at[rows, offsets], values, mask=mask)


def load_rows(src_ref, tokens, heads, dims, head_size, mask):
  """Input rows [N, HB, DP] (float32) of tokens [N] from a [T, H * D] ref; 0 where masked."""
  n, hb, dp = mask.shape
  cols = jnp.broadcast_to(heads[None, :, None] * head_size + dims[None, None, :], (n, hb, dp))
  rows = jnp.broadcast_to(tokens[:, None, None], (n, hb, dp))
  return lowering.load(src_ref.at[rows, cols], mask=mask, other=0).astype(jnp.float32)


def store_flat(ref, index, values, mask):
  """Masked store into a 1-D ref; masked lanes point past its end."""
  lowering.store(ref.at[jnp.where(mask, index, ref.shape[0])], values, mask=mask)


def group_scales(scale_ref, page_rows, layer, block, offset, num_heads: int, head,
                 groups: int, block_size: int, mask):
  """A MAX collection's per-token group scales: ``groups`` float32 [tile] vectors of the
  tokens at (block, offset) [tile], KV head ``head``, read from the flat scale collection
  ``[rows, bs, H, groups]`` through the plane's ``page_rows``; 0 where masked."""
  base = ((page_rows.row(layer, block) * block_size + offset) * num_heads + head) * groups
  return [lowering.load(scale_ref.at[base + j], mask=mask, other=0.0) for j in range(groups)]


def finite_amax(x):
  """max |x| over the last axis ignoring non-finite values, and whether all were finite."""
  a = jnp.abs(x)
  finite = a < jnp.inf
  amax = jnp.max(jnp.where(finite, a, 0.0), axis=-1)
  all_finite = jnp.min(jnp.where(finite, 1.0, 0.0), axis=-1) > 0.0
  return amax, all_finite


def finite_tile_amax(x, native):
  """max |x| over the first and last axes of x [N, HB, DP], non-finite values ignored ->
  [HB] (0 where none is finite), as :func:`finite_amax` gives. ``native`` (compiled): two
  instructions a value instead of three: :func:`lowering.abs_or_nan` and the GPU's max
  (Triton's maxnumf, IEEE maxNum), which skips NaN. (The interpreter's max propagates
  NaN, so there the non-finite values are selected out.) A lowering whose max propagated
  NaN would break this: the compiled
  ``test_per_block_non_finite_amax_matches_reference`` checks it on the GPU."""
  if not native:
    return jnp.max(finite_amax(x)[0], axis=0)
  amax = jnp.max(jnp.max(lowering.abs_or_nan(x), axis=-1), axis=0)
  return jnp.maximum(amax, 0.0)   # maxNum(NaN, 0) = 0: a head with no finite value


def head_group(num_heads: int, head_size: int, tokens: int, target: int = 4096) -> int:
  """Heads per program: a power of two with tokens x heads x padded head_size ~ target."""
  per_head = tokens * next_pow2(head_size)
  hb = max(1, target // per_head)
  return min(next_pow2(num_heads), 1 << (hb.bit_length() - 1))
