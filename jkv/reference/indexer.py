"""Reference DeepSeek-V3.2 indexer cache: ``indexer_k_quant_and_cache`` and
``cp_gather_indexer_k_quant_cache`` (AITER ``csrc/kernels/cache_kernels.cu``, vLLM
``indexer_k_quant_and_cache_kernel`` / ``cp_gather_indexer_k_quant_cache_kernel``).

The cache is bytes, ``uint8 [NB, bs, head_dim + G * 4]`` with ``G = head_dim / qbs``
groups per token, but each block is one flat byte array (not per-token rows):

* bytes ``[0, bs * head_dim)``: FP8 (e4m3fn) values, token offset o at ``o * head_dim``;
* bytes ``[bs * head_dim, bs * (head_dim + 4 G))``: float32 scales, token o group g at
  ``bs * head_dim + (o * G + g) * 4`` (little-endian).

Quantization per (token, group of ``qbs`` values): ``scale = max(amax, 1e-4) * (1 / 448)``
(``amax`` over the finite values: a NaN / Inf never sets a scale); ``scale_fmt="ue8m0"``
rounds it up to a power of two; values ``sat(k * (1 / scale))``, NaN stays NaN, +-Inf
saturate to +-448. Slots < 0 (and, under jit, past the cache) are skipped. Any ``qbs``
dividing ``head_dim`` works (AITER / vLLM hard-wire 128 in their reductions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jkv import pages, quant
from jkv.formats import INDEXER_AMAX_FLOOR, INDEXER_FP8, INDEXER_SCALE_BYTES


def quantize(k, quant_block_size: int, scale_fmt: str):
  """k [T, head_dim] float -> (values float8_e4m3fn [T, head_dim], scales float32 [T, G])."""
  num_tokens, head_dim = k.shape
  groups = k.reshape(num_tokens, head_dim // quant_block_size, quant_block_size)
  amax = jnp.max(quant.finite_abs(groups), axis=-1)
  scale = quant.scale_of(jnp.maximum(amax, INDEXER_AMAX_FLOOR), INDEXER_FP8)
  if scale_fmt == "ue8m0":
    scale = quant.round_up_pow2(scale)
  values = quant.quantize(groups, (1.0 / scale)[..., None], INDEXER_FP8)
  return values.reshape(num_tokens, head_dim), scale


def byte_offsets(block_size: int, head_dim: int, groups: int, offset):
  """Flat in-block byte offsets of token offsets ``offset`` [T]: (values [T, head_dim],
  scales [T, G * 4])."""
  values = offset[:, None] * head_dim + jnp.arange(head_dim)[None, :]
  scales = (block_size * head_dim + offset[:, None] * groups * INDEXER_SCALE_BYTES
            + jnp.arange(groups * INDEXER_SCALE_BYTES)[None, :])
  return values, scales


def _flat(kv_cache, layer):
  """kv_cache ([L,] NB, bs, stride) as [L or 1, NB, bs * stride] and the layer to index."""
  num_layers = kv_cache.shape[0] if kv_cache.ndim == 4 else 1
  num_blocks, block_size, stride = kv_cache.shape[-3:]
  flat = kv_cache.reshape((num_layers, num_blocks, block_size * stride))
  return flat, (0 if layer is None else layer), num_blocks, block_size


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, *, quant_block_size: int,
                              scale_fmt: str, layer=None):
  """k [T, head_dim] -> kv_cache ([L,] NB, bs, stride) uint8 updated (one scatter into
  the given layer: in place when the cache is donated)."""
  num_tokens, head_dim = k.shape
  flat, layer, num_blocks, block_size = _flat(kv_cache, layer)
  groups = head_dim // quant_block_size
  values, scales = quantize(k, quant_block_size, scale_fmt)
  value_bytes = jax.lax.bitcast_convert_type(values, jnp.uint8)
  scale_bytes = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(num_tokens, -1)
  slot = slot_mapping.astype(jnp.int32)
  ok = (slot >= 0) & (slot < num_blocks * block_size)
  block, offset = jnp.where(ok, slot // block_size, num_blocks), jnp.where(ok, slot % block_size, 0)
  value_at, scale_at = byte_offsets(block_size, head_dim, groups, offset)
  flat = flat.at[layer, block[:, None], value_at].set(value_bytes, mode="drop")
  flat = flat.at[layer, block[:, None], scale_at].set(scale_bytes, mode="drop")
  return flat.reshape(kv_cache.shape)


def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, *,
                                    quant_block_size: int, layer=None):
  """Rows t < cu_seq_lens[-1] of dst_k [T, head_dim] (uint8 / INDEXER_FP8) and dst_scale float32
  [T, G] (or uint8 [T, 4 G]) from the cache; other rows (and rows whose block-table entry
  is past the cache) keep their values."""
  num_tokens, head_dim = dst_k.shape
  flat, layer, num_blocks, block_size = _flat(kv_cache, layer)
  groups = head_dim // quant_block_size
  block, position, ok = pages.gather_sources(block_table, cu_seq_lens, num_tokens, block_size,
                                       num_blocks)
  block = jnp.where(ok, block, 0)
  value_at, scale_at = byte_offsets(block_size, head_dim, groups, position % block_size)
  value_bytes = flat[layer, block[:, None], value_at]
  scale_bytes = flat[layer, block[:, None], scale_at]
  new_k = jax.lax.bitcast_convert_type(value_bytes, dst_k.dtype)
  if dst_scale.dtype == jnp.uint8:
    new_scale = scale_bytes
  else:
    new_scale = jax.lax.bitcast_convert_type(
        scale_bytes.reshape(num_tokens, groups, INDEXER_SCALE_BYTES), jnp.float32)
  return (jnp.where(ok[:, None], new_k, dst_k), jnp.where(ok[:, None], new_scale, dst_scale))
