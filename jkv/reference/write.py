"""Reference paged writes: ``cache.at[...].set(..., mode="drop")`` per layout.

Semantics follow vLLM ``reshape_and_cache`` / ``reshape_and_cache_flash`` and AITER
(``csrc/kernels/cache_kernels.cu``): token t goes to block ``slot // bs``, offset
``slot % bs``; negative slots are skipped; FP8 caches store ``sat(x * (1 / scale))`` (see :mod:`jkv.quant`).
jkv additionally drops slots ``>= num_blocks * block_size`` instead of writing out
of bounds. XLA does the ``.at[].set`` in place when the caller donates the cache.
"""

from __future__ import annotations

import jax.numpy as jnp

from jkv import layout as layout_lib
from jkv import quant


def convert(x, inv_scale, quant_dtype, cache_dtype):
  """[T, H, D] input -> stored values: cast for "auto", saturating FP8 otherwise.

  inv_scale: float32 [1] or [H], 1 / scale.
  """
  if quant_dtype is None:
    return x.astype(cache_dtype)
  return quant.quantize(x, inv_scale[None, :, None], quant_dtype)


def block_offset(slot_mapping, block_size: int, num_blocks: int):
  """(block, offset) int32 of each slot; a slot < 0 or past the cache gets block
  ``num_blocks``, which ``.at[...].set(mode="drop")`` drops."""
  slot = slot_mapping.astype(jnp.int32)
  valid = (slot >= 0) & (slot < num_blocks * block_size)
  return jnp.where(valid, slot // block_size, num_blocks), jnp.where(valid, slot % block_size, 0)


def key_entry(layout, k, x: int):
  """Key values [..., H, D] as ``cache[token_index]`` holds them: [..., H, D/x, x] for the
  x-vectorized key of vllm / asm, unchanged otherwise."""
  if layout in ("vllm", "asm"):
    return k.reshape(k.shape[:-1] + (k.shape[-1] // x, x))
  return k


def write_kv(key, value, key_cache, value_cache, slot_mapping, *, layout, kv_layout,
             block_size, num_blocks, quant_dtype, k_inv_scale, v_inv_scale, layer=None):
  """key, value [T, H, D] -> updated (key_cache, value_cache) or (kv_cache,).

  layout: "vllm" | "asm" | "flash" | "hnd" | "packed" | "paged5d" (FlashInfer's single
  [P, 2, ps, H, D] / [P, 2, H, ps, D] tensor) | "max" (MAX's collection [nb, 2, L, bs, H,
  D]); value_cache is None for the last three.
  layer: None, or the index into a leading num_layers dim of the caches (``max``: into the
  collection's layer dim, required).
  """
  head_size = key.shape[2]
  b, o = block_offset(slot_mapping, block_size, num_blocks)
  lead = () if layer is None or layout == layout_lib.MAX else (layer,)
  k = convert(key, k_inv_scale, quant_dtype, key_cache.dtype)
  v = convert(value, v_inv_scale, quant_dtype, key_cache.dtype)

  def put(cache, index, val):
    return cache.at[lead + index].set(val, mode="drop")

  x = layout_lib.vector_width(key_cache.dtype)
  if layout == layout_lib.MAX:   # [nb, 2, L, bs, H, D]: the layer inside the block
    k_index, v_index = (b, 0, layer, o), (b, 1, layer, o)
  else:
    k_index, v_index = layout_lib.token_index(layout, b, o, head_size, x, kv_layout)
  k = key_entry(layout, k, x)
  if value_cache is None:
    return (put(put(key_cache, k_index, k), v_index, v),)
  return put(key_cache, k_index, k), put(value_cache, v_index, v)
