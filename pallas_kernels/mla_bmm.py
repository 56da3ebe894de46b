"""AITER's ``fused_fp8_bmm_rope_cat_and_cache_mla`` in one launch: the absorbed query
up-projection (FP8 group-quantized BMM), RoPE on the query and key, the query output and
the MLA cache entries. Semantics: :func:`jkv.reference.mla.fused_fp8_bmm_rope_cat_and_cache_mla`.

Grid ``(QH, token tiles over Bk)``; program ``(h, i)`` owns tokens ``t = i * TB + [0, TB)``
(``TB`` >= 16: Triton's dot wants every dim >= 16; tokens past B / Bk are masked):

* query latent: for each group of ``group_size`` columns of ``q_nope[h]`` (padded to 16
  when narrower, masked lanes 0), the ``[TB, group]`` tile's per-token amax over finite
  values, the scale ``max(amax, 1e-10) * (1 / 448)`` and the saturated e4m3 values, as
  bfloat16 (exact). Then for each ``rank_per_step`` rows of ``w_k[h]`` (read as bytes,
  bitcast to e4m3, to bfloat16): ``sum_g dot(q_g, w_g^T) * scale_g`` (bf16 x bf16 dots
  accumulating in float32), times ``w_k_scale``, into ``q_out[t, h, :R]``;
* query RoPE: pairs of ``q_pe[t, h]`` rotated in float32 (NeoX ``(i, i + d/2)`` or GPT-J
  ``(2i, 2i + 1)``, cos / sin at the clamped positions) into ``q_out[t, h, R:]`` (and into
  ``decode_q_pe_out`` when its dtype differs from q_out's);
* key (programs with ``h < KH``): ``k_rope[t, h]`` rotated alike into ``k_pe_out`` and, for
  tokens with a slot in ``[0, num_slots)``, ``[k_nope | rope(k_rope)]`` cast or FP8-quantized
  (``sat(x * k_inv_scale)``) into cache row ``slot``, head ``h``.

Arrays are 2-D views: q_nope ``[QH * B, P]``, w_k ``uint8 [QH * R, P]``, q_pe ``[B, QH * d_pe]``,
k_nope / k_rope ``[Bk, KH * R]`` / ``[Bk, KH * d_pe]``, q_out ``[B, QH * (R + d_pe)]``, the
cache ``[num_slots, KH * (R + d_pe)]`` (aliased to its output: updated in place). Masked
lanes of a store point one row past their array (the interpreter drops them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jkv import quant
from jkv.formats import ACT_AMAX_FLOOR
from pallas_kernels import common, lowering

_FP8 = jnp.float8_e4m3fn
_MIN_DOT = 16   # Triton's smallest dot dim


def _index(rows, columns):
  """rows [N], columns [M] -> [N, M] row and column index arrays."""
  shape = (rows.shape[0], columns.shape[0])
  return jnp.broadcast_to(rows[:, None], shape), jnp.broadcast_to(columns[None, :], shape)


def _mask(rows_ok, cols_ok, shape):
  """Row [N] and column [M] masks (None: every lane) as one [N, M] mask, or None."""
  if rows_ok is None and cols_ok is None:
    return None
  if cols_ok is None:
    return jnp.broadcast_to(rows_ok[:, None], shape)
  if rows_ok is None:
    return jnp.broadcast_to(cols_ok[None, :], shape)
  return jnp.broadcast_to(rows_ok[:, None] & cols_ok[None, :], shape)


def _load(ref, rows, rows_ok, columns, cols_ok):
  """ref[rows, columns] as [N, M], 0 where masked (indices in range on every lane)."""
  r, c = _index(rows, columns)
  mask = _mask(rows_ok, cols_ok, r.shape)
  if mask is None:
    return lowering.load(ref.at[r, c])
  return lowering.load(ref.at[r, c], mask=mask, other=0)


def _store(ref, rows, rows_ok, columns, cols_ok, value):
  """value [N, M] into ref[rows, columns] where rows_ok (& cols_ok)."""
  # Masked lanes point one row past the array (the interpreter drops them).
  r, c = _index(jnp.where(rows_ok, rows, ref.shape[0]), columns)
  lowering.store(ref.at[r, c], value, mask=_mask(rows_ok, cols_ok, r.shape))


def _kernel(slot_ref,          # int32 [B_slot] (< 0: skipped)
            pos_ref,           # int32 [B_slot]
            w_scale_ref,       # float32 [1]: w_k's scale
            k_inv_scale_ref,   # float32 [1]: 1 / k_scale (FP8 caches)
            q_nope_ref,        # [QH * B, P]
            w_ref,             # uint8 [QH * R, P]: w_k's e4m3fn bits
            q_pe_ref,          # [B, QH * d_pe]
            k_nope_ref,        # [Bk, KH * R]
            k_rope_ref,        # [Bk, KH * d_pe]
            cos_ref,           # [max_pos, d_pe / 2]
            sin_ref,           # [max_pos, d_pe / 2]
            cache_ref,         # [num_slots, KH * (R + d_pe)] (aliased to out_ref)
            q_out_ref,         # out [B, QH * (R + d_pe)] (e4m3fnuz as uint8 bits)
            k_pe_ref,          # out [Bk, KH * d_pe]: rope(k_rope)
            out_ref,           # out [num_slots, KH * (R + d_pe)]: the cache
            *decode_ref,       # out [n0, QH * d_pe] when its dtype differs from q_out's
            batch, num_slot_tokens, num_kv_heads, width, group_size, rank, pe_dim,
            tokens_per_program, rank_per_step, is_neox, quant_dtype, q_out_dtype, interpret):
  """Program (query head, token tile): the tile's q_nope quantized to FP8 per group and
  multiplied by the head's w_k (``rank_per_step`` columns a step), rope(q_pe) beside it in
  q_out. The programs of query heads ``head < KH`` also write, for KV head ``head``,
  rope(k_rope) and the cache entries of the tile's tokens that have slots."""
  del cache_ref   # aliased to out_ref
  entry = rank + pe_dim
  tb = tokens_per_program
  head = pl.program_id(0)
  t = pl.program_id(1) * tb + lax.iota(jnp.int32, tb)
  k_ok = t < k_rope_ref.shape[0]
  q_ok = t < batch
  # token rows clamped in range for loads (masked lanes read nothing on the GPU)
  tq, tk = jnp.where(q_ok, t, 0), jnp.where(k_ok, t, 0)

  # RoPE pairs, cos / sin at each token's clamped position.
  half = pe_dim // 2
  pair, raw, pair_ok = lowering.padded_columns(half)
  first, second = (pair, pair + half) if is_neox else (2 * pair, 2 * pair + 1)
  # stores: masked lanes at distinct columns past the pairs
  first_out, second_out = (raw, raw + half) if is_neox else (2 * raw, 2 * raw + 1)
  pos = jnp.clip(lowering.load(pos_ref.at[tk], mask=k_ok, other=0), 0, cos_ref.shape[0] - 1)
  cos = _load(cos_ref, pos, k_ok, pair, pair_ok).astype(jnp.float32)
  sin = _load(sin_ref, pos, k_ok, pair, pair_ok).astype(jnp.float32)

  def rotated(ref, rows, rows_ok, column):
    """The rotated pairs (float32 [TB, pairs], first and second elements) of
    ref[rows, column + (0 .. d_pe)]."""
    x1 = _load(ref, rows, rows_ok, column + first, pair_ok).astype(jnp.float32)
    x2 = _load(ref, rows, rows_ok, column + second, pair_ok).astype(jnp.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin

  def store_pairs(ref, rows, rows_ok, column, pairs, convert):
    for y, columns in zip(pairs, (first_out, second_out)):
      _store(ref, rows, rows_ok, column + columns, pair_ok, convert(y))

  def q_stored(y):   # float32 -> q_out's values (FP8 saturated; e4m3fnuz as uint8 bits)
    if not quant.is_fp8(q_out_dtype):
      return y.astype(q_out_ref.dtype)
    return common.quantize_stored(y, q_out_dtype, q_out_ref.dtype, not interpret)

  # The query latent: FP8 groups of q_nope[h] ([TB, group] each) as bfloat16, with scales.
  group_cols, _, group_ok = lowering.padded_columns(group_size, max(group_size, _MIN_DOT))
  groups = []
  for g in range(width // group_size):
    x = _load(q_nope_ref, head * batch + tq, q_ok, g * group_size + group_cols, group_ok)
    x = x.astype(jnp.float32)
    amax = jnp.max(quant.finite_abs(x), axis=1)                        # masked lanes are 0
    scale = quant.scale_of(jnp.maximum(amax, ACT_AMAX_FLOOR), _FP8)
    values = common.quantize_stored(x * (1.0 / scale)[:, None], _FP8, _FP8, not interpret)
    groups.append((values.astype(jnp.bfloat16), scale))

  # q_out[t, h, :R]: rank_per_step rows of w_k[h] per dot.
  step = min(rank_per_step, max(common.next_pow2(rank), _MIN_DOT))
  for start in range(0, rank, step):
    r, r_raw, r_ok = lowering.padded_columns(min(step, rank - start), step)
    acc = None
    for g, (values, scale) in enumerate(groups):
      w = _load(w_ref, head * rank + start + r, r_ok, g * group_size + group_cols, group_ok)
      w = lax.bitcast_convert_type(w, _FP8).astype(jnp.bfloat16)    # FP8 read as bytes
      part = lowering.dot(values, w, trans_b=True) * scale[:, None]  # [TB, step] float32
      acc = part if acc is None else acc + part
    _store(q_out_ref, t, q_ok, head * entry + start + r_raw, r_ok,
           q_stored(acc * w_scale_ref[0]))

  # q_out[t, h, R:] = rope(q_pe[t, h]) (and decode_q_pe_out's rows [0, n0)).
  q_rot = rotated(q_pe_ref, tq, q_ok, head * pe_dim)
  store_pairs(q_out_ref, t, q_ok, head * entry + rank, q_rot, q_stored)
  for ref in decode_ref:
    store_pairs(ref, t, q_ok & (t < ref.shape[0]), head * pe_dim, q_rot,
                lambda y, ref=ref: y.astype(ref.dtype))

  @pl.when(head < num_kv_heads)
  def _key():
    k_rot = rotated(k_rope_ref, tk, k_ok, head * pe_dim)
    store_pairs(k_pe_ref, t, k_ok, head * pe_dim, k_rot, lambda y: y.astype(k_pe_ref.dtype))
    has_slot = t < num_slot_tokens
    slot = lowering.load(slot_ref.at[jnp.where(has_slot, t, 0)], mask=has_slot, other=-1)
    row_ok = (slot >= 0) & (slot < out_ref.shape[0])

    def stored(y):   # float32 -> the cache's values
      if quant_dtype is None:
        return y.astype(out_ref.dtype)
      return common.quantize_stored(y * k_inv_scale_ref[0], quant_dtype, out_ref.dtype,
                                    not interpret)

    cols, cols_raw, cols_ok = lowering.padded_columns(rank)
    nope = _load(k_nope_ref, tk, k_ok, head * rank + cols, cols_ok).astype(jnp.float32)
    _store(out_ref, slot, row_ok, head * entry + cols_raw, cols_ok, stored(nope))
    store_pairs(out_ref, slot, row_ok, head * entry + rank, k_rot, stored)


def fused_bmm_rope_cache(q_nope, w_k, w_k_scale, q_pe, k_nope, k_rope, kv_cache, slot_mapping,
                         positions, cos, sin, k_inv_scale, *, group_size: int, is_neox: bool,
                         q_out_dtype, num_decode_toks_for_zeros: int, interpret: bool,
                         tokens_per_program: int | None = None, rank_per_step: int = 64,
                         num_warps: int = 4):
  """The fused op, inputs as :func:`jkv.reference.mla.fused_fp8_bmm_rope_cat_and_cache_mla`.

  q_nope [QH, B, P] float (P a multiple of the power of two ``group_size``); w_k
  float8_e4m3fn [QH, R, P]; w_k_scale float32 [1]; q_pe [B, QH, d_pe]; k_nope [Bk, KH, R],
  k_rope [Bk, KH, d_pe] float (KH divides QH, 1 <= B <= Bk); kv_cache [num_slots, KH, R + d_pe]
  (float, or FP8 written as ``sat(x * k_inv_scale)``, k_inv_scale float32 [1]);
  slot_mapping int [B_slot] (B <= B_slot <= Bk; < 0 or >= num_slots: not written);
  positions int [Bk] (clamped to the cos / sin rows); cos, sin [max_pos, d_pe / 2].
  q_out_dtype: a float or FP8 dtype (FP8 saturated, NaN kept; e4m3fnuz computed as its
  bits). tokens_per_program: a power of two >= 16 (None: 16,
  up to 64 while that leaves >= 256 programs); rank_per_step: rows of w_k per dot, a power
  of two >= 16.

  Returns ``(q_out [B, QH, R + d_pe] of q_out_dtype, decode_q_pe_out [n0, QH, d_pe] of
  q_nope's dtype, k_pe_out [Bk, KH, d_pe] of k_rope's dtype, zeros [n0, QH, R] of q_nope's
  dtype, kv_cache)``, n0 = num_decode_toks_for_zeros.
  """
  num_q_heads, batch, width = q_nope.shape
  rank = w_k.shape[1]
  num_k, num_kv_heads, pe_dim = k_rope.shape
  entry = rank + pe_dim
  n0 = num_decode_toks_for_zeros
  tb = tokens_per_program or _MIN_DOT
  while tokens_per_program is None and tb < 64 and pl.cdiv(num_k, 2 * tb) * num_q_heads >= 256:
    tb *= 2
  if tb < _MIN_DOT or tb & (tb - 1) or rank_per_step < _MIN_DOT or rank_per_step & (
      rank_per_step - 1):
    raise ValueError(f"tokens_per_program ({tb}) and rank_per_step ({rank_per_step}) must be "
                     f"powers of two >= {_MIN_DOT}")
  quant_dtype = kv_cache.dtype if quant.is_fp8(kv_cache.dtype) else None
  (view,) = common.cache_views([kv_cache], num_kv_heads * entry)
  decode_dtype = np.dtype(q_nope.dtype)
  # decode_q_pe_out is a slice of q_out's rope part when the dtypes agree, else its own output
  separate_decode = n0 > 0 and np.dtype(q_out_dtype) != decode_dtype
  q_out_dtype = np.dtype(q_out_dtype)
  fnuz = q_out_dtype == np.dtype(jnp.float8_e4m3fnuz)   # Triton converts to e4m3fn only
  out_shape = [jax.ShapeDtypeStruct((batch, num_q_heads * entry),
                                    jnp.uint8 if fnuz else q_out_dtype),
               jax.ShapeDtypeStruct((num_k, num_kv_heads * pe_dim), k_rope.dtype),
               jax.ShapeDtypeStruct(view.shape, view.dtype)]
  if separate_decode:
    out_shape.append(jax.ShapeDtypeStruct((n0, num_q_heads * pe_dim), decode_dtype))
  kernel = functools.partial(
      _kernel, batch=batch, num_slot_tokens=slot_mapping.shape[0],
      num_kv_heads=num_kv_heads, width=width, group_size=group_size, rank=rank,
      pe_dim=pe_dim, tokens_per_program=tb, rank_per_step=rank_per_step, is_neox=is_neox,
      quant_dtype=quant_dtype, q_out_dtype=q_out_dtype, interpret=interpret)
  inputs = (slot_mapping.astype(jnp.int32), positions.astype(jnp.int32),
            jnp.asarray(w_k_scale, jnp.float32).reshape(1),
            jnp.asarray(k_inv_scale, jnp.float32).reshape(1),
            q_nope.reshape(num_q_heads * batch, width),
            lax.bitcast_convert_type(w_k, jnp.uint8).reshape(num_q_heads * rank, width),
            q_pe.reshape(batch, num_q_heads * pe_dim),
            k_nope.reshape(num_k, num_kv_heads * rank),
            k_rope.reshape(num_k, num_kv_heads * pe_dim), cos, sin)
  outs = lowering.pallas_call(   # the cache (last input) is output 2, after q_out and k_rope
      kernel, out_shape=tuple(out_shape), grid=(num_q_heads, pl.cdiv(num_k, tb)),
      input_output_aliases={len(inputs): 2}, interpret=interpret, num_warps=num_warps,
      name="jkv_mla_fp8_bmm_rope_cache",
  )(*inputs, view)
  q_out = outs[0].reshape(batch, num_q_heads, entry)
  if fnuz:
    q_out = lax.bitcast_convert_type(q_out, q_out_dtype)
  if separate_decode:
    decode_q_pe = outs[3].reshape(n0, num_q_heads, pe_dim)
  else:   # (n0 = 0: an empty slice, retyped)
    decode_q_pe = q_out[:n0, :, rank:].astype(decode_dtype)
  return (q_out, decode_q_pe, outs[1].reshape(num_k, num_kv_heads, pe_dim),
          jnp.zeros((n0, num_q_heads, rank), decode_dtype),
          common.restore_caches([outs[2]], [kv_cache])[0])
