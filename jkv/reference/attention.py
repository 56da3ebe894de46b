"""Reference paged decode attention: read the cache, then one query token per sequence.

Semantics follow vLLM ``paged_attention_v1`` (``csrc/attention/attention_kernels.cuh``):
query head h reads KV head ``h // (Hq // Hkv)``; token j of sequence b lives at block
``block_tables[b, j // bs]``, offset ``j % bs``; quantized entries are dequantized by
multiplying by their scale; logits ``scale * <q, k_j>`` in float32, then
``cap * tanh(logit / cap)`` with ``logits_soft_cap``, then ``+ slope[h] * (j - L + 1)`` with
ALiBi; only positions ``max(0, L - W) <= j < L`` count (``L = seq_lens[b]``, W the sliding
window); ``out = sum_j p_j v_j / (sum_j p_j + 1e-6)`` with ``p_j = exp(logit_j - max)``
(vLLM's ``1 / (sum + 1e-6)``). Cache entries outside the counted positions (and entries
in blocks whose id is outside the cache) never reach the output, even when they hold NaN.
A sequence with no counted position gets zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jkv import fp4
from jkv import layout as layout_lib
from jkv.formats import CacheFormat


def read_tokens(fmt: CacheFormat, key_cache, value_cache, k_scale, v_scale, k_global_scale,
                v_global_scale, layer, block_table, num_blocks: int, block_size: int,
                num_heads: int, head_size: int):
  """Dequantized K and V of every table position: two float32 [B, W * bs, H, D].

  Caches and the token / block / FP4 scale arrays carry a leading num_layers dim (or
  key_cache is the MAX collection [nb, 2, L, bs, H, D], ``fmt.layout`` "max"); ``layer``
  is an int32 scalar (may be traced). Positions whose block id is outside the cache read
  block 0 (callers mask them; see :func:`positions_valid`).
  """
  batch, width = block_table.shape
  bs, h, d = block_size, num_heads, head_size
  max_len = width * bs
  pos = jnp.arange(max_len, dtype=jnp.int32)
  b = jnp.clip(block_table[:, pos // bs], 0, num_blocks - 1)  # [B, max_len]
  o = jnp.broadcast_to(pos % bs, b.shape)
  if fmt.quant in fp4.FORMATS:
    out = []
    for data, scales, g in ((key_cache, k_scale, k_global_scale),
                            (value_cache, v_scale, v_global_scale)):
      scale_bytes = jax.lax.bitcast_convert_type(scales[layer][b, :, o], jnp.uint8)
      out.append(fp4.dequantize_groups(data[layer][b, :, o], scale_bytes, fmt.quant, g))
    return tuple(out)
  if fmt.layout == layout_lib.MAX:   # the collection [nb, 2, L, bs, H, D]: NHD pages
    kc = vc = key_cache
    k_index, v_index = (b, 0, layer, o), (b, 1, layer, o)
  else:
    kc = key_cache[layer]
    vc = kc if value_cache is None else value_cache[layer]
    k_index, v_index = layout_lib.token_index(fmt.layout, b, o, d,
                                              layout_lib.vector_width(kc.dtype), fmt.kv_layout)
  k = kc[k_index].reshape(batch, max_len, h, d).astype(jnp.float32)
  v = vc[v_index].astype(jnp.float32)
  if fmt.scale_collection:   # scales [nb, 2, L, bs, H, G]
    k, v = (dequantize_groups(x, k_scale[b, kv, layer, o]) for kv, x in enumerate((k, v)))
  elif fmt.quant == "token":
    k = k * k_scale[layer][b, :, o][..., None]
    v = v * v_scale[layer][b, :, o][..., None]
  elif fmt.quant == "block":
    unit = (b * bs + o) // fmt.scale_block_tokens
    k = k * k_scale[layer][unit][..., None]
    v = v * v_scale[layer][unit][..., None]
  elif fmt.quant == "tensor":
    k = k * k_scale[:, None]
    v = v * v_scale[:, None]
  return k, v


def dequantize_groups(x, scales):
  """x [..., D] float32 times its group scales [..., G] (each D / G consecutive elements)."""
  grouped = x.reshape(x.shape[:-1] + (scales.shape[-1], -1))
  return (grouped * scales[..., None]).reshape(x.shape)


def positions_valid(block_table, seq_lens, num_blocks: int, block_size: int,
                    sliding_window=None):
  """bool [B, W * bs]: the positions attention counts (see the module docstring)."""
  width = block_table.shape[1]
  pos = jnp.arange(width * block_size, dtype=jnp.int32)
  lens = seq_lens.astype(jnp.int32)[:, None]
  blocks = block_table[:, pos // block_size]
  valid = (pos[None, :] < lens) & (blocks >= 0) & (blocks < num_blocks)
  if sliding_window is not None:
    valid &= pos[None, :] >= lens - sliding_window
  return valid


def attend(query, keys, values, valid, seq_lens, *, scale: float, alibi_slopes=None,
           logits_soft_cap=None):
  """One decode query per sequence over gathered K / V.

  query: [B, Hq, D]; keys: float32 [B, N, Hkv, D], values [B, N, Hkv, Dv] (Hq a multiple
  of Hkv); valid: bool [B, N]; alibi_slopes: float32 [Hq] or None. Returns [B, Hq, Dv] in
  the query's dtype.
  """
  batch, num_q_heads, head_size = query.shape
  num_kv_heads = keys.shape[2]
  group = num_q_heads // num_kv_heads
  q = query.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_size)
  logits = jnp.einsum("bkgd,bnkd->bkgn", q, keys, precision=jax.lax.Precision.HIGHEST) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  if alibi_slopes is not None:
    pos = jnp.arange(keys.shape[1], dtype=jnp.int32)
    distance = (pos[None, :] - seq_lens.astype(jnp.int32)[:, None] + 1).astype(jnp.float32)
    slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group)
    logits = logits + slopes[None, :, :, None] * distance[:, None, None, :]
  mask = valid[:, None, None, :]
  logits = jnp.where(mask, logits, -jnp.inf)
  peak = jnp.max(logits, axis=-1, keepdims=True)
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  p = jnp.where(mask, jnp.exp(logits - peak), 0.0)
  values = jnp.where(valid[:, :, None, None], values, 0.0)
  out = jnp.einsum("bkgn,bnkd->bkgd", p, values, precision=jax.lax.Precision.HIGHEST)
  out = out / (jnp.sum(p, axis=-1, keepdims=True) + 1e-6)
  return out.reshape(batch, num_q_heads, values.shape[-1]).astype(query.dtype)


def paged_attention_decode(fmt: CacheFormat, query, key_cache, value_cache, k_scale, v_scale,
                           k_global_scale, v_global_scale, layer, block_tables, seq_lens, *,
                           num_blocks: int, block_size: int, num_heads: int, head_size: int,
                           scale: float, alibi_slopes=None, logits_soft_cap=None,
                           sliding_window=None):
  """Decode attention straight from the cache (arguments as :func:`read_tokens` and
  :func:`attend`). Returns [B, Hq, D] in the query's dtype."""
  keys, values = read_tokens(fmt, key_cache, value_cache, k_scale, v_scale, k_global_scale,
                             v_global_scale, layer, block_tables, num_blocks, block_size,
                             num_heads, head_size)
  valid = positions_valid(block_tables, seq_lens, num_blocks, block_size, sliding_window)
  return attend(query, keys, values, valid, seq_lens, scale=scale, alibi_slopes=alibi_slopes,
                logits_soft_cap=logits_soft_cap)
