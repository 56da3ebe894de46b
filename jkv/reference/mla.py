"""Reference MLA cache writes: ``concat_and_cache_mla`` and
``fused_qk_rope_concat_and_cache_mla`` (AITER ``csrc/kernels/cache_kernels.cu``; vLLM's
``concat_and_cache_mla``).

An MLA cache entry of token t (and KV head h, for multi-head caches) is the compressed
latent ``kv_c`` and the RoPE key ``k_pe``, concatenated: ``[kv_c | k_pe]`` for
``concat_and_cache_mla``; for the fused op ``[nope | rope(pe)]`` when ``is_nope_first``,
else ``[rope(pe) | nope]``. RoPE (:mod:`jkv.rope`) is computed in float32 from the input
values at ``positions[t]`` (clamped to the cos / sin cache), then stored once: cast to the
cache dtype, or FP8 ``sat(x * (1 / scale))``. ``q_out`` gets the same treatment for every
token and query head (padding slots too), in the query dtype or FP8 through ``q_scale``;
its nope part is an exact copy (or the FP8 of it). Slots < 0 (and, under jit, past the
cache) are not written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jkv import quant, rope
from jkv.formats import (ACT_AMAX_FLOOR, DS_MLA_TILE, FLT_MIN, MLA_DS_MLA, MLA_SPLIT,
                         mla_per_tensor_fp8)
from jkv.reference.write import block_offset


def entries(nope, pe, positions, cos_cache, sin_cache, *, is_neox: bool, is_nope_first: bool,
            rotate: bool):
  """float32 [T, H, R + P] entries from nope [T, H, R] and pe [T, H, P]."""
  pe32 = pe.astype(jnp.float32)
  if rotate:
    pos = jnp.clip(positions.astype(jnp.int32), 0, cos_cache.shape[0] - 1)
    pe32 = rope.apply_rope(pe, cos_cache[pos][:, None, :], sin_cache[pos][:, None, :],
                           is_neox=is_neox)
  parts = (nope.astype(jnp.float32), pe32)
  return jnp.concatenate(parts if is_nope_first else parts[::-1], axis=-1)


def stored(entry32, dtype, inv_scale):
  """float32 entries -> values of ``dtype``: FP8 through ``inv_scale`` [1], else a cast."""
  if quant.is_fp8(dtype):
    return quant.quantize(entry32, inv_scale[0], dtype)
  return entry32.astype(dtype)


def scatter_entries(kv_cache, values, slot_mapping, layer=None):
  """values [T, H, E] into kv_cache [NB, bs, H, E] (or [NB, bs, E] with H == 1), or into
  layer ``layer`` of a cache with a leading num_layers dim."""
  lead = () if layer is None else (layer,)
  per_layer = kv_cache.shape[len(lead):]
  num_blocks, block_size = per_layer[:2]
  b, o = block_offset(slot_mapping, block_size, num_blocks)
  values = values.reshape(values.shape[:1] + per_layer[2:])
  return kv_cache.at[lead + (b, o)].set(values, mode="drop")


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, inv_scale, layer=None):
  """kv_c [T, H, R], k_pe [T, H, P] -> kv_cache with ``[kv_c | k_pe]`` at each slot."""
  entry = entries(kv_c, k_pe, None, None, None, is_neox=True, is_nope_first=True, rotate=False)
  return scatter_entries(kv_cache, stored(entry, kv_cache.dtype, inv_scale), slot_mapping, layer)


def fused_qk_rope_concat_and_cache_mla(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping,
                                       positions, cos_cache, sin_cache, k_inv_scale,
                                       q_inv_scale, *, is_neox, is_nope_first, q_out_dtype,
                                       layer=None):
  """Returns ``(q_out [T, Hq, R + P] of q_out_dtype, kv_cache)``."""
  kw = dict(is_neox=is_neox, is_nope_first=is_nope_first, rotate=True)
  q_out = stored(entries(q_nope, q_pe, positions, cos_cache, sin_cache, **kw), q_out_dtype,
                 q_inv_scale)
  kv = stored(entries(kv_c, k_pe, positions, cos_cache, sin_cache, **kw), kv_cache.dtype,
              k_inv_scale)
  return q_out, scatter_entries(kv_cache, kv, slot_mapping, layer)


def ds_mla_entries(kv_c, k_pe):
  """kv_c [T, R], k_pe [T, P] -> uint8 [T, ds_mla_entry_bytes(R, P)]."""
  num_tokens, rank = kv_c.shape
  tiles = kv_c.reshape(num_tokens, rank // DS_MLA_TILE, DS_MLA_TILE)
  amax = jnp.max(quant.finite_abs(tiles), axis=-1)
  scale = jnp.maximum(quant.scale_of(amax, jnp.float8_e4m3fn), FLT_MIN)
  values = quant.quantize(tiles, (1.0 / scale)[..., None], jnp.float8_e4m3fn)
  parts = (values.reshape(num_tokens, rank), scale, k_pe.astype(jnp.bfloat16))
  return jnp.concatenate([jax.lax.bitcast_convert_type(p, jnp.uint8).reshape(num_tokens, -1)
                          for p in parts], axis=1)


def ds_mla_decode(entry_bytes, rank: int, pe_dim: int):
  """uint8 [..., E] entries -> (kv_c float32 [..., R] dequantized, k_pe bfloat16 [..., P])."""
  lead = entry_bytes.shape[:-1]
  tiles = rank // DS_MLA_TILE
  values = jax.lax.bitcast_convert_type(entry_bytes[..., :rank], jnp.float8_e4m3fn)
  scales = jax.lax.bitcast_convert_type(
      entry_bytes[..., rank:rank + 4 * tiles].reshape(lead + (tiles, 4)), jnp.float32)
  rope_part = jax.lax.bitcast_convert_type(
      entry_bytes[..., rank + 4 * tiles:].reshape(lead + (pe_dim, 2)), jnp.bfloat16)
  kv_c = (values.astype(jnp.float32).reshape(lead + (tiles, DS_MLA_TILE))
          * scales[..., None]).reshape(lead + (rank,))
  return kv_c, rope_part


def read_entries(kv_cache, rope_cache, entry_scale, fp8_scale, layer, blocks, offsets, *,
                 kv_cache_dtype: str, kv_lora_rank: int, pe_dim: int):
  """float32 dequantized entries ``[..., (H,) R + P]`` of layer ``layer`` at (blocks,
  offsets) (int arrays of one shape, in range) of an MLA cache in any format:
  ``fp8_split`` (content times its entry scale, then the bf16 RoPE part), ``fp8_ds_mla``
  (:func:`ds_mla_decode`), or plain / per-tensor FP8 entries (times ``fp8_scale`` [1])."""
  if kv_cache_dtype == MLA_SPLIT:
    content = kv_cache[layer, blocks, offsets].astype(jnp.float32)
    kv_c = content * entry_scale[layer, blocks, offsets][..., None]
    rope_part = rope_cache[layer, blocks, offsets].astype(jnp.float32)
    return jnp.concatenate([kv_c, rope_part], axis=-1)
  if kv_cache_dtype == MLA_DS_MLA:
    kv_c, k_pe = ds_mla_decode(kv_cache[layer, blocks, offsets], kv_lora_rank, pe_dim)
    return jnp.concatenate([kv_c, k_pe.astype(jnp.float32)], axis=-1)
  entries = kv_cache[layer, blocks, offsets].astype(jnp.float32)
  if mla_per_tensor_fp8(kv_cache_dtype):
    entries = entries * fp8_scale[0]
  return entries


def concat_and_cache_ds_mla(kv_c, k_pe, kv_cache, slot_mapping, layer=None):
  """kv_c [T, 1, R], k_pe [T, 1, P] -> uint8 kv_cache ([L,] NB, bs, E) entries."""
  entry = ds_mla_entries(kv_c[:, 0], k_pe[:, 0])
  return scatter_entries(kv_cache, entry[:, None, :], slot_mapping, layer)


def split_entries(kv_c, k_pe32):
  """DeepSeek-V4 pool entries: kv_c [T, H, R] -> FP8 content with one float32 scale per
  entry (``max(amax * (1 / 448), FLT_MIN)``, amax over finite values), k_pe32 (float32,
  rotated) -> bfloat16. Returns (content e4m3fn [T, H, R], rope bf16 [T, H, P],
  scale float32 [T, H])."""
  amax = jnp.max(quant.finite_abs(kv_c), axis=-1)
  scale = jnp.maximum(quant.scale_of(amax, jnp.float8_e4m3fn), FLT_MIN)
  content = quant.quantize(kv_c, (1.0 / scale)[..., None], jnp.float8_e4m3fn)
  return content, k_pe32.astype(jnp.bfloat16), scale


def write_split(caches, kv_c, k_pe, slot_mapping, positions=None, cos_cache=None,
                sin_cache=None, *, is_neox=True, layer=None):
  """caches (content, rope, scale) ``([L,] NB, bs, (H,) ...)``; k_pe rotated at
  ``positions`` when given (float32 RoPE), else stored as given."""
  pe32 = k_pe.astype(jnp.float32)
  if positions is not None:
    pos = jnp.clip(positions.astype(jnp.int32), 0, cos_cache.shape[0] - 1)
    pe32 = rope.apply_rope(k_pe, cos_cache[pos][:, None, :], sin_cache[pos][:, None, :],
                           is_neox=is_neox)
  parts = split_entries(kv_c, pe32)
  return tuple(scatter_entries(cache, part, slot_mapping, layer)
               for cache, part in zip(caches, parts))


# AITER's fused_fp8_bmm_rope_cat_and_cache_mla (aiter/ops/triton/fusions/fused_bmm_rope_kv_cache.py)
def per_token_group_quant(x, group_size: int):
  """x [..., K] -> (FP8 e4m3fn [..., K], float32 scales [..., K / group_size]):
  ``scale = max(amax, 1e-10) * (1 / 448)`` per group (finite values), q = sat(x / scale)."""
  groups = x.reshape(x.shape[:-1] + (x.shape[-1] // group_size, group_size))
  amax = jnp.max(quant.finite_abs(groups), axis=-1)
  scale = quant.scale_of(jnp.maximum(amax, ACT_AMAX_FLOOR), jnp.float8_e4m3fn)
  q = quant.quantize(groups, (1.0 / scale)[..., None], jnp.float8_e4m3fn)
  return q.reshape(x.shape), scale


def fp8_group_bmm(q_nope, w_k, w_k_scale, group_size: int):
  """q_nope [QH, B, P] (quantized per token group), w_k FP8 [QH, R, P] with the scalar
  w_k_scale [1] -> float32 [B, QH, R] = sum_g a_scale_g * (q_g . w_g) * w_k_scale."""
  num_heads, batch, width = q_nope.shape
  q, a_scale = per_token_group_quant(q_nope, group_size)
  groups = width // group_size
  q = q.astype(jnp.float32).reshape(num_heads, batch, groups, group_size)
  w = w_k.astype(jnp.float32).reshape(num_heads, w_k.shape[1], groups, group_size)
  partial = jnp.einsum("hbgk,hngk->hbng", q, w, precision=jax.lax.Precision.HIGHEST)
  out = jnp.sum(partial * a_scale[:, :, None, :], axis=-1) * w_k_scale[0]
  return out.transpose(1, 0, 2)


def fused_fp8_bmm_rope_cat_and_cache_mla(q_nope, w_k, w_k_scale, q_pe, k_nope, k_rope, kv_cache,
                                         slot_mapping, positions, cos_cache, sin_cache, *,
                                         group_size, k_inv_scale, is_neox, q_out_dtype,
                                         num_decode_toks_for_zeros):
  """See :func:`jkv.ops.mla.fused_fp8_bmm_rope_cat_and_cache_mla`."""
  batch, num_q_heads, _ = q_pe.shape
  pos = jnp.clip(positions.astype(jnp.int32), 0, cos_cache.shape[0] - 1)
  cos, sin = cos_cache[pos][:, None, :], sin_cache[pos][:, None, :]
  q_rot = rope.apply_rope(q_pe, cos[:batch], sin[:batch], is_neox=is_neox)
  k_rot = rope.apply_rope(k_rope, cos, sin, is_neox=is_neox)
  ql_nope = fp8_group_bmm(q_nope, w_k, w_k_scale, group_size)
  q_out = jnp.concatenate([ql_nope, q_rot], axis=-1)
  # FP8: saturated, as Triton's conversion in AITER's kernel (NaN stays NaN)
  q_out = (quant.saturate_cast(q_out, q_out_dtype) if quant.is_fp8(q_out_dtype)
           else q_out.astype(q_out_dtype))
  entries = jnp.concatenate([k_nope.astype(jnp.float32), k_rot], axis=-1)
  num_slots = kv_cache.shape[0]
  slot = slot_mapping.astype(jnp.int32)
  rows = jnp.where((slot >= 0) & (slot < num_slots), slot, num_slots)
  kv_cache = kv_cache.at[rows].set(stored(entries[:slot.shape[0]], kv_cache.dtype, k_inv_scale),
                                   mode="drop")
  n0 = num_decode_toks_for_zeros
  return (q_out, q_rot[:n0].astype(q_nope.dtype), k_rot.astype(k_rope.dtype),
          jnp.zeros((n0, num_q_heads, k_nope.shape[2]), q_nope.dtype), kv_cache)
