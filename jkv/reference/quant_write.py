"""Reference quantized writes: per-token and per-block FP8 / INT8 scales, and FP4.

Semantics (AITER ``csrc/kernels/cache_kernels.cu``):

* **Per token** (``reshape_and_cache_with_pertoken_quant``): per (token, head)
  ``scale = amax / qmax`` over head_size (computed as ``amax * (1 / qmax)``,
  :func:`jkv.quant.scale_of`), values ``q(x * (1 / max(scale, 1e-12)))``; the stored
  scale is that (0 for an all-zero row).
* **Per block** (``reshape_and_cache_with_block_quant``): one scale per (scale block of
  L tokens, head). The new tokens of a scale block give ``s_new = max(amax, 1e-6) /
  qmax`` (as ``scale_of``). If the lowest new offset in the block is 0 the block starts fresh with
  ``s_new``; else the scale becomes ``max(s_old, s_new)`` and, when it grows, every
  token of the block that this write does not overwrite is re-quantized:
  ``q(float(q_old) * s_old * (1 / s))`` (AITER re-quantizes the offsets below the first
  new one; the others hold no tokens when slots are consecutive). New tokens:
  ``q(x * (1 / s))``. Tokens go to their own slots; of tokens with the same slot the
  last one wins.
* ``q``: FP8 saturating RNE, INT8 toward zero (:func:`jkv.quant.round_to_dtype`).
* **NaN / Inf**: non-finite values never enter an amax. Per token, a non-finite value
  makes its (token, head) scale NaN (the row reads back NaN). Per block the shared scale
  ignores it; the value itself is stored as NaN (FP8) or 0 (INT8, which has no NaN),
  +-Inf saturate to +-max. Other tokens are never affected.

Scale arrays (float32; an optional leading layer dim):

* per token: ``[num_blocks, H, block_size]`` (block-major, AITER ``asm_layout``) or
  ``[H, num_blocks * block_size]`` (head-major). A MAX collection (layout ``"max"``): one
  scale collection ``[num_blocks, 2, L, block_size, H, G]``, a scale per group of D / G
  head-dim elements (MAX's ``quantization_granularity`` D / G; G = 1: per (token, head)).
* per block: ``[num_scale_blocks, H]`` (block-major) or ``[H, num_scale_blocks]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jkv import fp4, layout as layout_lib, quant, segments as segments_lib
from jkv.reference import write as write_ref

REQUANT_CHUNK = 64  # grown scale blocks re-quantized per loop iteration


def _index(layout, kv_layout, block, offset, head_size, cache_dtype):
  return layout_lib.token_index(layout, block, offset, head_size,
                                layout_lib.vector_width(cache_dtype), kv_layout)


def per_token_scales(x, dtype, groups: int | None = None):
  """x [T, H, D] -> (scale, inv_scale) float32 [T, H], or [T, H, groups] with ``groups``:
  one per group of D / groups consecutive head-dim elements."""
  xf = x.astype(jnp.float32)
  if groups is not None:
    xf = xf.reshape(xf.shape[:-1] + (groups, xf.shape[-1] // groups))
  amax = jnp.max(quant.finite_abs(xf), axis=-1)
  finite = jnp.all(jnp.abs(xf) < jnp.inf, axis=-1)
  inv = 1.0 / jnp.maximum(quant.scale_of(amax, dtype), quant.SCALE_FLOOR)
  scale = jnp.where(finite, quant.scale_of(amax, dtype), jnp.nan)
  return scale, inv


def write_token_quant(key, value, key_cache, value_cache, k_scales, v_scales, slot_mapping, *,
                      layout, kv_layout, block_size, num_blocks, scales_block_major, layer=None):
  """Per-token quantized write. key, value [T, H, D]; caches FP8 / INT8 of ``layout``.

  Returns ``(key_cache, value_cache, k_scales, v_scales)`` (value_cache None for packed).
  """
  head_size = key.shape[2]
  dtype = key_cache.dtype
  b, o = write_ref.block_offset(slot_mapping, block_size, num_blocks)
  lead = () if layer is None else (layer,)
  k_index, v_index = _index(layout, kv_layout, b, o, head_size, dtype)
  x = layout_lib.vector_width(dtype)
  caches = [key_cache, value_cache]
  scales = [k_scales, v_scales]
  for i, (src, index) in enumerate(((key, k_index), (value, v_index))):
    scale, inv = per_token_scales(src, dtype)
    q = quant.round_to_dtype(src.astype(jnp.float32) * inv[:, :, None], dtype)
    if i == 0:
      q = write_ref.key_entry(layout, q, x)
    target = 0 if value_cache is None else i
    caches[target] = caches[target].at[lead + index].set(q, mode="drop")
    if scales_block_major:
      scales[i] = scales[i].at[lead + (b, slice(None), o)].set(scale, mode="drop")
    else:   # [H, nb * bs]; a dropped slot's b * bs + o is past the end
      heads = jnp.arange(scale.shape[1], dtype=jnp.int32)[:, None]   # (not a slice: see
      slots = (b * block_size + o)[None, :]                          # _block_scale_index)
      scales[i] = scales[i].at[lead + (heads, slots)].set(scale.T, mode="drop")
  return caches[0], caches[1], scales[0], scales[1]


def write_max_token_quant(key, value, collection, scales, slot_mapping, *, block_size,
                          num_blocks, layer):
  """Per-token quantized write into a MAX collection, a scale per group of head-dim
  elements (MAX's ``quantization_granularity``).

  key, value [T, H, D]; collection FP8 / INT8 [nb, 2, L, bs, H, D]; scales float32
  [nb, 2, L, bs, H, G] (G groups of D / G elements, each quantized as a per-token row);
  layer an int32 scalar. Returns ``(collection, scales)``.
  """
  num_tokens, num_heads, head_size = key.shape
  groups = scales.shape[-1]
  dtype = collection.dtype
  b, o = write_ref.block_offset(slot_mapping, block_size, num_blocks)
  for kv, src in enumerate((key, value)):
    scale, inv = per_token_scales(src, dtype, groups)                     # [T, H, G]
    grouped = src.astype(jnp.float32).reshape(num_tokens, num_heads, groups, -1)
    q = quant.round_to_dtype((grouped * inv[..., None]).reshape(src.shape), dtype)
    collection = collection.at[b, kv, layer, o].set(q, mode="drop")
    scales = scales.at[b, kv, layer, o].set(scale, mode="drop")
  return collection, scales


def _block_scale_index(unit, num_heads, scales_block_major):
  """Index of scale blocks ``unit`` [S] in a (layer's) scale array: selects [S, H]
  block-major, [H, S] head-major. The heads are an index array, not a slice: a layer index
  before a slice and an index array would move the selection's dims to the front (NumPy's
  rule for advanced indices split by a slice), transposing head-major scales."""
  heads = jnp.arange(num_heads, dtype=jnp.int32)
  return (unit[:, None], heads) if scales_block_major else (heads[:, None], unit)


def write_block_quant(key, value, key_cache, value_cache, k_scales, v_scales, slot_mapping, *,
                      layout, kv_layout, block_size, num_blocks, tokens_per_scale_block,
                      scales_block_major, layer=None):
  """Per-block quantized write (scale per ``tokens_per_scale_block`` tokens and head).

  key, value [T, H, D]. Returns ``(key_cache, value_cache, k_scales, v_scales)``.
  """
  num_tokens, num_heads, head_size = key.shape
  dtype = key_cache.dtype
  unit_size = tokens_per_scale_block
  num_units = num_blocks * block_size // unit_size
  vec = layout_lib.vector_width(dtype)
  lead = () if layer is None else (layer,)
  seg = segments_lib.sort_by_scale_block(slot_mapping, num_blocks * block_size, unit_size)
  kept = seg.slot >= 0
  seg_ids = jnp.arange(num_tokens, dtype=jnp.int32)
  live = seg_ids < seg.num_segments
  # The segment of each position (in slot order), num_tokens - 1 past the kept tokens.
  is_start = jnp.zeros((num_tokens,), jnp.bool_).at[
      jnp.where(live, seg.start, num_tokens)].set(True, mode="drop")
  segment = jnp.where(kept, jnp.cumsum(is_start, dtype=jnp.int32) - 1, num_tokens - 1)
  first_slot = seg.slot[seg.start]
  unit = jnp.where(live, first_slot // unit_size, num_units)          # [S]
  fresh = first_slot % unit_size == 0
  b, o = write_ref.block_offset(seg.slot, block_size, num_blocks)
  k_index, v_index = _index(layout, kv_layout, b, o, head_size, dtype)
  caches = [key_cache, value_cache]
  scales = [k_scales, v_scales]
  for i, (src, index) in enumerate(((key, k_index), (value, v_index))):
    target = 0 if value_cache is None else i
    xf = src[jnp.maximum(seg.token, 0)].astype(jnp.float32)            # [T, H, D] slot order
    token_amax = jnp.where(kept[:, None], jnp.max(quant.finite_abs(xf), axis=-1), 0.0)
    amax = jax.ops.segment_max(token_amax, segment, num_segments=num_tokens)
    s_new = quant.scale_of(jnp.maximum(amax, quant.AMAX_FLOOR), dtype)  # [S, H]
    old_index = _block_scale_index(jnp.minimum(unit, num_units - 1), num_heads,
                                   scales_block_major)
    s_old = scales[i][lead + old_index]
    s_old = s_old if scales_block_major else s_old.T
    grows = s_new > s_old
    s = jnp.where(fresh[:, None] | grows, s_new, s_old)
    inv = 1.0 / s
    grown = live[:, None] & ~fresh[:, None] & grows                    # [S, H]
    caches[target] = _requantize(caches[target], lead, unit, grown, s_old, inv, layout, kv_layout,
                                 block_size, unit_size, head_size, vec, i, num_units, dtype)
    new_index = _block_scale_index(unit, num_heads, scales_block_major)
    scales[i] = scales[i].at[lead + new_index].set(s if scales_block_major else s.T, mode="drop")
    q = quant.round_to_dtype(xf * inv[segment][:, :, None], dtype)
    if i == 0:
      q = write_ref.key_entry(layout, q, vec)
    caches[target] = caches[target].at[lead + index].set(q, mode="drop")
  return caches[0], caches[1], scales[0], scales[1]


def _requantize(cache, lead, unit, grown, s_old, inv, layout, kv_layout, block_size, unit_size,
                head_size, vec, which, num_units, dtype):
  """Re-quantizes every token of the scale blocks where a head's scale grew (before the new
  tokens are written over theirs), REQUANT_CHUNK blocks per loop iteration."""
  num_segments = unit.shape[0]
  any_grown = jnp.any(grown, axis=1)
  count = jnp.sum(any_grown, dtype=jnp.int32)
  # Grown segments first (stable), so the loop only visits them.
  order = jnp.argsort(~any_grown, stable=True)
  pad = (-num_segments) % REQUANT_CHUNK
  order = jnp.concatenate([order, jnp.zeros((pad,), order.dtype)])
  offsets = jnp.arange(unit_size, dtype=jnp.int32)

  def body(step, cache):
    pick = lax.dynamic_slice(order, (step * REQUANT_CHUNK,), (REQUANT_CHUNK,))
    use = step * REQUANT_CHUNK + jnp.arange(REQUANT_CHUNK) < count
    u = jnp.where(use, unit[pick], num_units)
    slots = jnp.minimum(u, num_units - 1)[:, None] * unit_size + offsets[None, :]  # [C, L]
    blk = jnp.where(use[:, None], slots // block_size, cache.shape[len(lead)])  # OOB: dropped
    off = slots % block_size
    index = layout_lib.token_index(layout, blk, off, head_size, vec, kv_layout)[which]
    read_index = layout_lib.token_index(layout, jnp.minimum(blk, cache.shape[len(lead)] - 1), off,
                                        head_size, vec, kv_layout)[which]
    old = cache[lead + read_index]
    shape = old.shape
    old = old.reshape(shape[:3] + (head_size,)).astype(jnp.float32)   # [C, L, H, D]
    ratio_old, ratio_inv = s_old[pick][:, None, :, None], inv[pick][:, None, :, None]
    new = quant.round_to_dtype(old * ratio_old * ratio_inv, dtype)
    new = jnp.where(grown[pick][:, None, :, None], new, old.astype(dtype))
    return cache.at[lead + index].set(new.reshape(shape), mode="drop")

  return lax.fori_loop(0, (count + REQUANT_CHUNK - 1) // REQUANT_CHUNK, body, cache)


def write_fp4(key, value, key_data, value_data, k_block_scales, v_block_scales, slot_mapping, *,
              fp4_format, k_global_scale, v_global_scale, block_size, num_blocks, layer=None):
  """FP4 write into ``[nb, H, bs, D/2]`` uint8 data and ``[nb, H, bs, D/G]`` scale caches
  (see :mod:`jkv.fp4`). Returns the four arrays."""
  b, o = write_ref.block_offset(slot_mapping, block_size, num_blocks)
  lead = () if layer is None else (layer,)
  index = lead + (b, slice(None), o)
  out = []
  for src, data, scales, g in ((key, key_data, k_block_scales, k_global_scale),
                               (value, value_data, v_block_scales, v_global_scale)):
    packed, scale_bytes = fp4.quantize_groups(src, fp4_format, g)
    scale_bytes = lax.bitcast_convert_type(scale_bytes, scales.dtype)
    out.append((data.at[index].set(packed, mode="drop"),
                scales.at[index].set(scale_bytes, mode="drop")))
  return out[0][0], out[1][0], out[0][1], out[1][1]
