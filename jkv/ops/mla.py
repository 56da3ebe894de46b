"""MLA (DeepSeek latent attention) cache writes: AITER / vLLM ``concat_and_cache_mla`` and
AITER ``fused_qk_rope_concat_and_cache_mla``.

Functional versions: they return the updated cache (and ``q_out``). Donate the cache to
the surrounding ``jax.jit`` and the update is in place. Semantics:
:mod:`jkv.reference.mla`; kernels: :mod:`pallas_kernels.mla`, :mod:`pallas_kernels.ds_mla`,
:mod:`pallas_kernels.mla_bmm`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jkv import backend as backend_lib
from jkv import errors, formats, pages, partitioning, quant
from jkv import layout as layout_lib
from jkv.ops import attention as attention_ops
from jkv.ops.write import as_cache, layer_index, resolve_quant
from jkv.reference import attention as attention_reference
from jkv.reference import mla as reference
from pallas_kernels import attention as attention_kernels
from pallas_kernels import ds_mla as ds_mla_kernels
from pallas_kernels import mla as kernels
from pallas_kernels import mla_bmm as bmm_kernels
from pallas_kernels import mosaic_mla


def _heads(name_c, kv_c, name_pe, k_pe, kv_cache, lead: int = 0):
  """kv_c / k_pe as [T, H, R] / [T, H, P] and the cache's entry checks. 2-D inputs go
  with a single-head cache [NB, bs, R+P], 3-D ones with [NB, bs, H, R+P] (after ``lead``
  = 1 leading num_layers dim)."""
  kv_c, k_pe = jnp.asarray(kv_c), jnp.asarray(k_pe)
  if kv_c.ndim not in (2, 3) or k_pe.ndim != kv_c.ndim:
    raise ValueError(f"{name_c} and {name_pe} must both be [T, dim] or [T, heads, dim], got "
                     f"shapes {tuple(kv_c.shape)} and {tuple(k_pe.shape)}")
  errors.check_float(name_c, kv_c)
  errors.check_float(name_pe, k_pe)
  if kv_c.ndim == 2:
    kv_c, k_pe = kv_c[:, None, :], k_pe[:, None, :]
  if k_pe.shape[:2] != kv_c.shape[:2]:
    raise ValueError(f"{name_pe} must have shape {kv_c.shape[:2] + (k_pe.shape[2],)}, got "
                     f"{tuple(k_pe.shape)}")
  num_heads = kv_c.shape[1]
  entry = kv_c.shape[2] + k_pe.shape[2]
  layers = "[num_layers, ...] " if lead else ""
  if kv_cache.ndim - lead not in (3, 4):
    raise ValueError(f"kv_cache must be {layers}[NB, bs, R+P] or [NB, bs, H, R+P], got shape "
                     f"{tuple(kv_cache.shape)}")
  blocks = tuple(kv_cache.shape[:lead + 2])
  single = kv_cache.ndim - lead == 3 and num_heads == 1
  errors.check_shape("kv_cache", kv_cache,
                     blocks + ((entry,) if single else (num_heads, entry)))
  return kv_c, k_pe


def _slots(slot_mapping, num_tokens, kv_cache, layer):
  """Validated int32 slots, and the layer: checked eagerly; a traced layer out of range
  writes nothing."""
  slot_mapping = errors.int_array("slot_mapping", slot_mapping)
  errors.check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
  errors.check_int("slot_mapping", slot_mapping)
  if slot_mapping.shape[0] != num_tokens:
    raise ValueError(f"slot_mapping must have {num_tokens} entries (one per token), got "
                     f"{slot_mapping.shape[0]}")
  lead = 0 if layer is None else 1
  num_blocks, block_size = kv_cache.shape[lead:lead + 2]
  errors.check_slots_in_range("slot_mapping", slot_mapping, num_blocks * block_size,
                              f"a cache of {num_blocks} blocks x {block_size}")
  layer, slot_mapping = layer_index(layer, kv_cache, slot_mapping.astype(jnp.int32))
  return slot_mapping, layer


def _inv_scale(scale, name, needed: bool):
  if scale is None:
    if needed:
      raise ValueError(f"{name} is required for an FP8 destination")
    return jnp.ones((1,), jnp.float32)
  scale = quant.normalize_scale(scale, 1, name)
  if needed:
    errors.check_scales_positive(name, scale)
  return 1.0 / scale


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype="auto", scale=None,
                         *, layer=None, backend: str = "auto"):
  """Writes ``[kv_c | k_pe]`` entries into an MLA cache.

  Args:
    kv_c: [T, R] (or [T, H, R] for a multi-head cache) float, the compressed latent.
    k_pe: [T, P] (or [T, H, P]) float, the RoPE key part (already rotated).
    kv_cache: [NB, bs, R + P] (or [NB, bs, H, R + P]); float, or the FP8 dtype of
      ``kv_cache_dtype``.
    slot_mapping: int [T]; < 0 skipped; past the cache: ValueError eagerly, dropped under jit.
    kv_cache_dtype: "auto" (cast to the cache dtype) or an FP8 name ("fp8", ...); or
      "fp8_ds_mla" (vLLM / FlashMLA sparse): a uint8 cache [NB, bs, R + R/128 * 4 + 2 P]
      of entries [FP8 kv_c | float32 scale per 128 values | bf16 k_pe], 2-D inputs, R a
      multiple of 128 (656 bytes for R = 512, P = 64; kernel: :mod:`pallas_kernels.ds_mla`).
    scale: float scalar / [1], required for FP8: stored = sat(x * (1 / scale)); unused
      for "fp8_ds_mla" (its scales are per tile).
    layer: None, or an int (may be traced) into a leading num_layers dim of kv_cache.
  Returns the updated kv_cache.

  >>> import jax.numpy as jnp, jkv
  >>> kv_cache = jnp.zeros((4, 16, 512 + 64), jnp.bfloat16)   # [nb, bs, R + P]
  >>> kv_c, k_pe = jnp.ones((2, 512)), jnp.full((2, 64), 2.0)
  >>> kv_cache = jkv.concat_and_cache_mla(kv_c, k_pe, kv_cache, jnp.array([3, 40]))
  >>> float(kv_cache[2, 8, 0]), float(kv_cache[2, 8, 512])
  (1.0, 2.0)
  """
  if kv_cache_dtype == formats.MLA_DS_MLA:
    return _concat_and_cache_ds_mla(kv_c, k_pe, kv_cache, slot_mapping, layer, backend)
  kv_cache = as_cache("kv_cache", kv_cache)
  kv_c, k_pe = _heads("kv_c", kv_c, "k_pe", k_pe, kv_cache, 0 if layer is None else 1)
  slot_mapping, layer = _slots(slot_mapping, kv_c.shape[0], kv_cache, layer)
  quant_dtype = resolve_quant(kv_cache_dtype, kv_cache.dtype, "kv_cache")
  inv_scale = _inv_scale(scale, "scale", quant_dtype is not None)
  chosen = backend_lib.resolve(backend)
  if kv_c.shape[0] == 0:
    return kv_cache
  if chosen == "reference":
    return reference.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, inv_scale, layer)

  def kernel(kv_c, k_pe, slot_mapping, inv_scale, kv_cache, *layer):   # one page shard's
    return (kernels.write_entries(kv_c, k_pe, kv_cache, slot_mapping, None, None, None,
                                  inv_scale, is_neox=True, is_nope_first=True, rotate=False,
                                  quant_dtype=quant_dtype, interpret=chosen == "interpret",
                                  layer=layer[0] if layer else None),)

  return _on_page_shards(kernel, (kv_c, k_pe, slot_mapping, inv_scale), kv_cache, layer)


def _on_page_shards(kernel, inputs, kv_cache, layer):
  """``kernel(*inputs, kv_cache[, layer])`` -> (kv_cache,), per page shard of a cache sharded
  over its blocks under a plain jit (:func:`jkv.partitioning.per_shard`; the latent has
  no heads dim to split). inputs: token arrays [T, ...], the slot mapping, then replicated
  arrays."""
  lead = 0 if layer is None else 1
  roles = ((partitioning.TOKENS, partitioning.TOKENS, partitioning.SLOTS)
           + (partitioning.REPLICATED,) * (len(inputs) - 3)
           + (partitioning.Cache(lead, None),) + (partitioning.REPLICATED,) * lead)
  (kv_cache,) = partitioning.per_shard(kernel, inputs + (kv_cache,) + (() if layer is None
                                                                       else (layer,)),
                                       roles, block_size=kv_cache.shape[lead + 1])
  return kv_cache


def _check_ds_mla_cache(kv_cache, rank: int, pe_dim: int, *, stacked: bool):
  """An fp8_ds_mla cache is ``([num_layers,] NB, bs, entry_bytes)``: one head of
  ``formats.ds_mla_entry_bytes(rank, pe_dim)`` bytes per entry."""
  lead = 1 if stacked else 0
  errors.check_ndim("kv_cache", kv_cache, 3 + lead, "[(num_layers,) NB, bs, entry_bytes]")
  errors.check_shape("kv_cache", kv_cache, kv_cache.shape[:lead + 2] + (
      formats.ds_mla_entry_bytes(rank, pe_dim),))


def _concat_and_cache_ds_mla(kv_c, k_pe, kv_cache, slot_mapping, layer, backend):
  kv_c, k_pe = jnp.asarray(kv_c), jnp.asarray(k_pe)
  errors.check_ndim("kv_c", kv_c, 2, "[num_tokens, kv_lora_rank] for fp8_ds_mla")
  errors.check_ndim("k_pe", k_pe, 2, "[num_tokens, pe_dim] for fp8_ds_mla")
  errors.check_float("kv_c", kv_c)
  errors.check_float("k_pe", k_pe)
  rank, pe_dim = kv_c.shape[1], k_pe.shape[1]
  if rank % formats.DS_MLA_TILE:
    raise ValueError(f"fp8_ds_mla needs kv_lora_rank a multiple of {formats.DS_MLA_TILE}, "
                     f"got {rank}")
  if k_pe.shape[0] != kv_c.shape[0]:
    raise ValueError(f"k_pe must have {kv_c.shape[0]} tokens, got shape {tuple(k_pe.shape)}")
  if kv_cache.dtype != jnp.uint8:
    raise TypeError(f"kv_cache must be uint8 for fp8_ds_mla, got dtype {kv_cache.dtype}")
  _check_ds_mla_cache(kv_cache, rank, pe_dim, stacked=layer is not None)
  slot_mapping, layer = _slots(slot_mapping, kv_c.shape[0], kv_cache, layer)
  chosen = backend_lib.resolve(backend)
  if kv_c.shape[0] == 0:
    return kv_cache
  if chosen == "reference":
    return reference.concat_and_cache_ds_mla(kv_c[:, None], k_pe[:, None], kv_cache,
                                             slot_mapping, layer)
  def kernel(kv_c, k_pe, slot_mapping, kv_cache, *layer):   # one page shard's
    return (ds_mla_kernels.write_entries(kv_c[:, 0], k_pe[:, 0], kv_cache, slot_mapping,
                                         layer[0] if layer else None,
                                         interpret=chosen == "interpret"),)

  # [T, 1, ...]: token operands as the other MLA writes pass them (one latent head)
  return _on_page_shards(kernel, (kv_c[:, None], k_pe[:, None], slot_mapping), kv_cache, layer)


def fused_qk_rope_concat_and_cache_mla(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, k_scale,
                                       q_scale, positions, cos_cache, sin_cache, is_neox=True,
                                       is_nope_first=False, q_out_dtype=None, *, layer=None,
                                       backend: str = "auto"):
  """RoPE on ``q_pe`` and ``k_pe``, ``q_out`` for every token, the KV entries into the cache.

  Args:
    q_nope: [T, Hq, R], q_pe: [T, Hq, P] float (the query's latent and RoPE parts).
    kv_c: [T, R] or [T, Hkv, R]; k_pe: [T, P] or [T, Hkv, P] (Hkv <= Hq).
    kv_cache: [NB, bs, R + P] or [NB, bs, Hkv, R + P]; an FP8 cache is written as
      sat(x * (1 / k_scale)), any other dtype by a cast.
    slot_mapping: int [T] (< 0: no KV write; q_out is still computed).
    k_scale, q_scale: float scalar / [1] (k_scale needed for an FP8 cache, q_scale for an
      FP8 ``q_out_dtype``; None otherwise).
    positions: int [T], clamped to [0, max_pos - 1].
    cos_cache, sin_cache: [max_pos, P / 2] (:func:`jkv.rope.rope_cache`).
    is_neox: NeoX (i, i + P/2) pairs, else GPT-J (2i, 2i+1).
    is_nope_first: entries ``[nope | rope]``, else ``[rope | nope]``.
    q_out_dtype: None (q_nope's dtype) or a dtype (FP8: quantized with q_scale).
    layer: None, or an int (may be traced) into a leading num_layers dim of kv_cache.
  Returns ``(q_out [T, Hq, R + P], kv_cache)``.

  >>> import jax.numpy as jnp, jkv
  >>> kv_cache = jnp.zeros((4, 16, 128 + 32), jnp.bfloat16)   # [nb, bs, R + P]
  >>> q_nope, q_pe = jnp.ones((2, 4, 128)), jnp.ones((2, 4, 32))   # [T, Hq, R], [T, Hq, P]
  >>> kv_c, k_pe = jnp.ones((2, 128)), jnp.ones((2, 32))
  >>> cos = jnp.ones((64, 16)); sin = jnp.zeros((64, 16))   # [max_pos, P / 2]: no rotation
  >>> one = jnp.ones((1,), jnp.float32)
  >>> q_out, kv_cache = jkv.fused_qk_rope_concat_and_cache_mla(
  ...     q_nope, q_pe, kv_c, k_pe, kv_cache, jnp.array([0, 17]), one, one,
  ...     jnp.array([5, 6]), cos, sin)
  >>> q_out.shape, float(kv_cache[1, 1, 0])
  ((2, 4, 160), 1.0)
  """
  q_nope, q_pe = _query(q_nope, q_pe)
  kv_c, k_pe = _heads("kv_c", kv_c, "k_pe", k_pe, kv_cache, 0 if layer is None else 1)
  num_tokens, num_q_heads, rank = q_nope.shape
  if kv_c.shape[0] != num_tokens or kv_c.shape[2] != rank or k_pe.shape[2] != q_pe.shape[2]:
    raise ValueError(f"kv_c / k_pe must be [T={num_tokens}, (Hkv,) {rank}] / [.., "
                     f"{q_pe.shape[2]}], got {tuple(kv_c.shape)} and {tuple(k_pe.shape)}")
  if kv_c.shape[1] > num_q_heads:
    raise ValueError(f"more KV heads ({kv_c.shape[1]}) than query heads ({num_q_heads})")
  positions, cos_cache, sin_cache = _rope_inputs(positions, cos_cache, sin_cache, num_tokens,
                                                 q_pe.shape[2])
  slot_mapping, layer = _slots(slot_mapping, num_tokens, kv_cache, layer)
  kv_quant = kv_cache.dtype if quant.is_fp8(kv_cache.dtype) else None
  if kv_quant is None and not jnp.issubdtype(kv_cache.dtype, jnp.floating):
    raise TypeError(f"kv_cache must be a floating-point or FP8 cache, got {kv_cache.dtype}")
  q_out_dtype = np.dtype(q_nope.dtype if q_out_dtype is None else q_out_dtype)
  q_quant = q_out_dtype if quant.is_fp8(q_out_dtype) else None
  if q_quant is None and not jnp.issubdtype(q_out_dtype, jnp.floating):
    raise TypeError(f"q_out_dtype must be a floating-point or FP8 dtype, got {q_out_dtype}")
  k_inv_scale = _inv_scale(k_scale, "k_scale", kv_quant is not None)
  q_inv_scale = _inv_scale(q_scale, "q_scale", q_quant is not None)
  chosen = backend_lib.resolve(backend)
  if chosen == "reference" or num_tokens == 0:   # (the kernels need a token)
    return reference.fused_qk_rope_concat_and_cache_mla(
        q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, positions, cos_cache, sin_cache,
        k_inv_scale, q_inv_scale, is_neox=is_neox, is_nope_first=is_nope_first,
        q_out_dtype=q_out_dtype, layer=layer)
  common = dict(is_neox=is_neox, is_nope_first=is_nope_first, rotate=True,
                interpret=chosen == "interpret")
  q_out = kernels.write_entries(q_nope, q_pe, None, None, positions, cos_cache, sin_cache,
                                q_inv_scale, quant_dtype=q_quant, out_dtype=q_out_dtype, **common)

  def kernel(kv_c, k_pe, slot_mapping, positions, cos_cache, sin_cache, k_inv_scale, kv_cache,
             *layer):   # one page shard's
    return (kernels.write_entries(kv_c, k_pe, kv_cache, slot_mapping, positions, cos_cache,
                                  sin_cache, k_inv_scale, quant_dtype=kv_quant,
                                  layer=layer[0] if layer else None, **common),)

  kv_cache = _on_page_shards(kernel, (kv_c, k_pe, slot_mapping, positions, cos_cache, sin_cache,
                                      k_inv_scale), kv_cache, layer)
  return q_out, kv_cache


def _rope_inputs(positions, cos_cache, sin_cache, num_tokens: int, pe_dim: int):
  """Validated (positions int32 [T], cos_cache, sin_cache float [max_pos, pe_dim / 2])."""
  cos_cache, sin_cache = jnp.asarray(cos_cache), jnp.asarray(sin_cache)
  for name, table in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
    errors.check_ndim(name, table, 2, "[max_pos, rot_dim / 2]")
    errors.check_float(name, table)
    if table.shape[1] * 2 != pe_dim or table.shape[0] == 0:
      raise ValueError(f"{name} must be [max_pos >= 1, {pe_dim // 2}] for pe dim {pe_dim}, "
                       f"got shape {tuple(table.shape)}")
  errors.check_shape("sin_cache", sin_cache, cos_cache.shape)
  positions = errors.int_array("positions", positions)
  errors.check_shape("positions", positions, (num_tokens,))
  errors.check_int("positions", positions)
  return positions, cos_cache, sin_cache


def _query(q_nope, q_pe):
  q_nope, q_pe = jnp.asarray(q_nope), jnp.asarray(q_pe)
  errors.check_ndim("q_nope", q_nope, 3, "[num_tokens, num_q_heads, kv_lora_rank]")
  errors.check_ndim("q_pe", q_pe, 3, "[num_tokens, num_q_heads, pe_dim]")
  errors.check_float("q_nope", q_nope)
  errors.check_float("q_pe", q_pe)
  if q_pe.shape[:2] != q_nope.shape[:2]:
    raise ValueError(f"q_pe must have shape {q_nope.shape[:2] + (q_pe.shape[2],)}, got "
                     f"{tuple(q_pe.shape)}")
  if q_pe.shape[2] % 2:
    raise ValueError(f"the RoPE dim (q_pe's last) must be even, got {q_pe.shape[2]}")
  return q_nope, q_pe


def fused_fp8_bmm_rope_cat_and_cache_mla(q_nope, w_k, w_k_scale, q_pe, k_nope, k_rope, kv_cache,
                                         slot_mapping, positions, cos, sin, group_size=128,
                                         transpose_bm=True, k_scale=None, is_neox=False,
                                         q_out_dtype=jnp.bfloat16, num_decode_toks_for_zeros=0,
                                         *, backend: str = "auto"):
  """AITER's absorbed-MLA fusion (Triton op of the same name): the query's latent part
  through the per-head FP8 up-projection, RoPE on q_pe and k_rope, and the KV entries into
  the cache, in one call.

  Args (AITER's names, order and shapes):
    q_nope: [QH, B, P] float; quantized to FP8 per token and ``group_size`` values
      (scale = max(amax, 1e-10) / 448; jkv multiplies by the reciprocal).
    w_k: float8_e4m3fn [QH, R, P]; w_k_scale: float32 [1].
    q_pe: [B, QH, d_pe]; k_nope: [Bk, KH, R]; k_rope: [Bk, KH, d_pe] (KH divides QH).
    kv_cache: [num_slots, KH, R + d_pe] (a flat entry cache: slot s is row s); FP8 when
      ``k_scale`` is given (stored sat(x / k_scale)), else cast.
    slot_mapping: int [B_slot] (B <= B_slot <= Bk; < 0 skipped); positions: int [B_slot].
    cos, sin: [max_pos, d_pe / 2] (AITER also takes [max_pos, 1, 1, d_pe / 2]).
    transpose_bm: must be True (q_out is [B, QH, ...]).
  Returns ``(q_out [B, QH, R + d_pe] of q_out_dtype = [q_nope W_k^T | rope(q_pe)],
  decode_q_pe_out [n0, QH, d_pe] = rope(q_pe[:n0]), k_pe_out [Bk, KH, d_pe] = rope(k_rope),
  q_nope_zeros_out [n0, QH, R] zeros, kv_cache)`` with n0 = num_decode_toks_for_zeros
  (k_pe_out rows past B_slot are rotated at position 0; AITER leaves them unwritten).
  An FP8 q_out_dtype saturates (as Triton's conversion in AITER's kernel; NaN stays NaN).
  Kernel: :mod:`pallas_kernels.mla_bmm` (``auto`` on a GPU: 15-18 vs 28-29 us for the reference
  at 128 tokens, 16 heads, R = 512 on an H100).

  >>> import jax.numpy as jnp, jkv
  >>> q_nope = jnp.ones((4, 2, 128))                            # [QH, B, P]
  >>> w_k = jnp.ones((4, 64, 128), jnp.float8_e4m3fn)            # [QH, R, P]
  >>> q_pe, k_rope = jnp.ones((2, 4, 32)), jnp.ones((2, 1, 32))  # [B, QH, d_pe], [Bk, KH, d_pe]
  >>> k_nope = jnp.ones((2, 1, 64))                              # [Bk, KH, R]
  >>> kv_cache = jnp.zeros((8, 1, 64 + 32), jnp.bfloat16)        # [num_slots, KH, R + d_pe]
  >>> cos, sin = jnp.ones((16, 16)), jnp.zeros((16, 16))         # [max_pos, d_pe / 2]
  >>> q_out, _, k_pe, _, kv_cache = jkv.fused_fp8_bmm_rope_cat_and_cache_mla(
  ...     q_nope, w_k, jnp.ones((1,)), q_pe, k_nope, k_rope, kv_cache, jnp.array([3, 5]),
  ...     jnp.array([0, 1]), cos, sin)
  >>> q_out.shape, float(q_out[0, 0, 0]), float(kv_cache[5, 0, 0])   # q_nope . w_k = 128
  ((2, 4, 96), 128.0, 1.0)
  """
  q_nope, w_k, q_pe = jnp.asarray(q_nope), jnp.asarray(w_k), jnp.asarray(q_pe)
  k_nope, k_rope = jnp.asarray(k_nope), jnp.asarray(k_rope)
  cos, sin = jnp.asarray(cos), jnp.asarray(sin)
  if cos.ndim == 4:
    cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
  if not transpose_bm:
    raise NotImplementedError("transpose_bm=False (q_out as [QH, B, ...]) is not supported")
  errors.check_ndim("q_nope", q_nope, 3, "[QH, B, P]")
  errors.check_float("q_nope", q_nope)
  num_q_heads, batch, width = q_nope.shape
  errors.check_shape("w_k", w_k, (num_q_heads, w_k.shape[1] if w_k.ndim == 3 else -1, width))
  if np.dtype(w_k.dtype) != np.dtype(jnp.float8_e4m3fn):
    raise TypeError(f"w_k must be float8_e4m3fn, got dtype {w_k.dtype}")
  rank = w_k.shape[1]
  w_k_scale = jnp.asarray(w_k_scale, jnp.float32).reshape(-1)
  errors.check_shape("w_k_scale", w_k_scale, (1,))
  if group_size <= 0 or group_size & (group_size - 1) or width % group_size:
    raise ValueError(f"group_size must be a power of two dividing P={width}, got {group_size}")
  errors.check_ndim("q_pe", q_pe, 3, "[B, QH, d_pe]")
  pe_dim = q_pe.shape[2]
  errors.check_shape("q_pe", q_pe, (batch, num_q_heads, pe_dim))
  errors.check_ndim("k_nope", k_nope, 3, "[Bk, KH, R]")
  num_k, kv_heads = k_nope.shape[:2]
  errors.check_shape("k_nope", k_nope, (num_k, kv_heads, rank))
  errors.check_shape("k_rope", k_rope, (num_k, kv_heads, pe_dim))
  if num_q_heads % kv_heads:
    raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({kv_heads})")
  errors.check_ndim("kv_cache", kv_cache, 3, "[num_slots, KH, R + d_pe]")
  errors.check_shape("kv_cache", kv_cache, (kv_cache.shape[0], kv_heads, rank + pe_dim))
  slot_mapping = errors.int_array("slot_mapping", slot_mapping)
  positions = errors.int_array("positions", positions)
  errors.check_int("slot_mapping", slot_mapping)
  errors.check_ndim("slot_mapping", slot_mapping, 1, "[B_slot]")
  if not batch <= slot_mapping.shape[0] <= num_k:
    raise ValueError(f"slot_mapping must have between B={batch} and Bk={num_k} entries, got "
                     f"{slot_mapping.shape[0]}")
  errors.check_shape("positions", positions, slot_mapping.shape)
  errors.check_int("positions", positions)
  errors.check_slots_in_range("slot_mapping", slot_mapping, kv_cache.shape[0],
                              f"a cache of {kv_cache.shape[0]} entries")
  for name, table in (("cos", cos), ("sin", sin)):
    errors.check_ndim(name, table, 2, "[max_pos, d_pe / 2]")
    if table.shape[1] * 2 != pe_dim:
      raise ValueError(f"{name} must be [max_pos, {pe_dim // 2}] (the d_pe-wide form is not "
                       f"supported), got shape {tuple(table.shape)}")
  if num_decode_toks_for_zeros < 0 or num_decode_toks_for_zeros > batch:
    raise ValueError(f"num_decode_toks_for_zeros must be in [0, {batch}], got "
                     f"{num_decode_toks_for_zeros}")
  q_out_dtype = np.dtype(q_out_dtype)
  if not (quant.is_fp8(q_out_dtype) or jnp.issubdtype(q_out_dtype, jnp.floating)):
    raise TypeError(f"q_out_dtype must be a floating-point or FP8 dtype, got {q_out_dtype}")
  fp8_cache = quant.is_fp8(kv_cache.dtype)
  if not (fp8_cache or jnp.issubdtype(kv_cache.dtype, jnp.floating)):
    raise TypeError(f"kv_cache must be a floating-point or FP8 cache, got dtype "
                    f"{np.dtype(kv_cache.dtype).name}")
  if fp8_cache != (k_scale is not None):
    raise ValueError("an FP8 kv_cache needs k_scale, and k_scale needs an FP8 kv_cache")
  k_inv_scale = _inv_scale(k_scale, "k_scale", fp8_cache)
  chosen = backend_lib.resolve(backend)
  # rows past B_slot are rotated at position 0
  positions = jnp.concatenate([positions,
                               jnp.zeros((num_k - positions.shape[0],), positions.dtype)])
  args = (q_nope, w_k, w_k_scale, q_pe, k_nope, k_rope, kv_cache, slot_mapping, positions, cos,
          sin)
  static = dict(group_size=group_size, is_neox=is_neox, q_out_dtype=q_out_dtype,
                num_decode_toks_for_zeros=num_decode_toks_for_zeros)
  if chosen == "reference" or batch == 0:   # B = 0: no BMM (Pallas takes no empty q_out)
    return reference.fused_fp8_bmm_rope_cat_and_cache_mla(*args, k_inv_scale=k_inv_scale,
                                                          **static)
  # A flat [num_slots, KH, E] cache: the kernel is called directly (no page shards).
  return bmm_kernels.fused_bmm_rope_cache(*args, k_inv_scale, interpret=chosen == "interpret",
                                          **static)


def write_split(kv_c, k_pe, kv_cache, rope_cache, entry_scale, slot_mapping, positions=None,
                cos_cache=None, sin_cache=None, *, layer, is_neox: bool = True,
                backend: str = "auto"):
  """The ``fp8_split`` MLA write (the DeepSeek-V4 pool): per entry, FP8 content with one
  scale (``max(amax / 448, FLT_MIN)``) and the bf16 RoPE part, rotated first when
  ``positions`` is given.

  kv_c [T, H, R], k_pe [T, H, P] float; kv_cache float8_e4m3fn [L, NB, bs, (H,) R];
  rope_cache bfloat16 [L, NB, bs, (H,) P]; entry_scale float32 [L, NB, bs, (H,)];
  slot_mapping int [T] (< 0: skipped); positions int [T] with cos_cache / sin_cache
  [max_pos, P / 2] (float32 RoPE, ``is_neox`` halves or interleaved pairs); layer int
  (may be traced). Returns ``(kv_cache, rope_cache, entry_scale)``, aliased (in place
  when donated).
  """
  slot_mapping, layer = _slots(slot_mapping, kv_c.shape[0], kv_cache, layer)
  if positions is not None:
    if k_pe.shape[-1] % 2:
      raise ValueError(f"the RoPE dim (k_pe's last) must be even, got {k_pe.shape[-1]}")
    positions, cos_cache, sin_cache = _rope_inputs(positions, cos_cache, sin_cache,
                                                   kv_c.shape[0], k_pe.shape[-1])
  chosen = backend_lib.resolve(backend)
  caches = (kv_cache, rope_cache, entry_scale)
  if kv_c.shape[0] == 0:   # nothing to write
    return caches
  if chosen == "reference":
    return reference.write_split(caches, kv_c, k_pe, slot_mapping, positions, cos_cache,
                                 sin_cache, is_neox=is_neox, layer=layer)
  rope_args = () if positions is None else (positions, cos_cache, sin_cache)

  def kernel(kv_c, k_pe, slot_mapping, layer, *arrays):   # one page shard's
    return kernels.write_split(
        kv_c, k_pe, *arrays[-3:], slot_mapping, *(arrays[:3] if rope_args else (None,) * 3),
        layer, is_neox=is_neox, interpret=chosen == "interpret")

  entries = partitioning.Cache(1, None)
  return partitioning.per_shard(
      kernel, (kv_c, k_pe, slot_mapping, layer) + rope_args + caches,
      (partitioning.TOKENS, partitioning.TOKENS, partitioning.SLOTS)
      + (partitioning.REPLICATED,) * (1 + len(rope_args)) + (entries,) * 3,
      block_size=kv_cache.shape[2])


def mla_attention(query, kv_cache, rope_cache, entry_scale, fp8_scale, layer, block_table,
                  seq_lens, *, kv_cache_dtype: str, kv_lora_rank: int, pe_dim: int,
                  scale: float, backend: str = "auto", lowering: str = "auto"):
  """MLA decode attention in the absorbed form over one layer of a paged latent cache.

  query [B, Hq, R + P] float (``[q_nope . W_UK | rope(q_pe)]``); kv_cache [L, NB, bs, (H,)
  E] in ``kv_cache_dtype``'s format (``"auto"`` / an FP8 name: entries ``[kv_c | k_pe]``
  times ``fp8_scale`` [1]; ``"fp8_split"``: content with rope_cache and entry_scale beside
  it; ``"fp8_ds_mla"``: uint8 entries); layer int (may be traced; out of range under jit:
  zeros); block_table int [B, W]; seq_lens int [B]. Logits ``scale * <query, entry>``,
  values ``kv_c``. Returns [B, Hq, R] in the query's dtype. ``lowering``
  (:func:`jkv.backend.lowering`): ``"mosaic"`` runs an ``fp8_split`` cache on
  :mod:`pallas_kernels.mosaic_mla` (``auto``'s choice on a Hopper GPU where it takes
  the case: 0.61x Triton's time at 64 x 8K, 0.66x at 8 x 32K, 0.82x at 128 x 1K; H200), and
  an ``fp8_ds_mla`` one (rank a multiple of 512, RoPE part 64) in place (also ``auto``'s
  choice on Hopper: 211 us against Triton's 330 at 64 x 8K, H200).
  """
  num_blocks, block_size = kv_cache.shape[1:3]
  split, ds_mla = kv_cache_dtype == formats.MLA_SPLIT, kv_cache_dtype == formats.MLA_DS_MLA
  if ds_mla:   # (a multi-head cache would be read as more pages)
    _check_ds_mla_cache(kv_cache, kv_lora_rank, pe_dim, stacked=True)
  heads = kv_cache.shape[3] if kv_cache.ndim == 5 else 1
  entry = kv_lora_rank + pe_dim
  block_table, seq_lens = attention_ops.check_tables(block_table, seq_lens, num_blocks,
                                                     block_size)
  layer, seq_lens = attention_ops.layer_and_lengths(layer, kv_cache.shape[0], seq_lens)
  query = attention_ops.check_query(query, heads, entry)
  attention_ops.check_batch(query, block_table)
  scale, _, _, _ = attention_ops.check_options(query.shape[1], entry, scale, None, None, None)
  chosen = backend_lib.resolve(backend)
  mosaic_ok = (((split and mosaic_mla.supported(heads, kv_lora_rank, pe_dim, block_size,
                                                     query.dtype, query.shape[1]))
                or (ds_mla and mosaic_mla.supported_ds_mla(
                    kv_lora_rank, pe_dim, block_size, query.dtype, query.shape[1])))
               and not (chosen == "interpret" and partitioning.wraps_kernels()))
  # (fp8_ds_mla on Hopper: Mosaic 211 us against Triton's 330; H200, 64 x 8K, 2026-12-05)
  lowering = backend_lib.lowering(lowering, mosaic_supported=mosaic_ok,
                                  mosaic_first=(split or ds_mla) and backend_lib.hopper(),
                                  kernel=chosen != "reference")
  if query.shape[0] == 0:   # no sequences
    return jnp.zeros(query.shape[:2] + (kv_lora_rank,), query.dtype)
  if chosen == "reference":
    blocks, offsets, _ = pages.table_positions(block_table, seq_lens, block_size)
    entries = reference.read_entries(
        kv_cache, rope_cache, entry_scale, fp8_scale, layer,
        jnp.clip(blocks, 0, num_blocks - 1), offsets, kv_cache_dtype=kv_cache_dtype,
        kv_lora_rank=kv_lora_rank, pe_dim=pe_dim)
    if entries.ndim == 3:
      entries = entries[:, :, None]
    valid = attention_reference.positions_valid(block_table, seq_lens, num_blocks, block_size)
    return attention_reference.attend(query, entries, entries[..., :kv_lora_rank], valid,
                                      seq_lens, scale=scale)
  if split:   # FP8 content [.., R] + per-entry scale, bf16 RoPE part [.., P]
    key_plane = layout_lib.Plane("NHD", block_size, heads, kv_lora_rank)
    rope_plane = layout_lib.Plane("NHD", block_size, heads, pe_dim)
    arrays = (kv_cache, rope_cache, entry_scale)
  elif ds_mla:   # one head of E bytes per entry: FP8 kv_c, its tile scales, bf16 k_pe
    key_plane = layout_lib.Plane("NHD", block_size, 1, kv_cache.shape[-1])
    rope_plane = None
    arrays = (kv_cache, jnp.ones((1,), jnp.float32))
  else:
    key_plane, rope_plane = layout_lib.Plane("NHD", block_size, heads, entry), None
    arrays = (kv_cache, jnp.broadcast_to(fp8_scale, (heads,)))
  per_tensor = formats.mla_per_tensor_fp8(kv_cache_dtype)
  fmt = formats.CacheFormat("flash", quant="tensor" if per_tensor else "none")

  def kernel(query, layer, block_table, seq_lens, *arrays, block_axes):
    if lowering == "mosaic" and block_axes is None and ds_mla:   # (no block shards either)
      return mosaic_mla.ds_mla_decode(
          query, arrays[0], layer, block_table, seq_lens, kv_lora_rank=kv_lora_rank,
          num_blocks=arrays[0].shape[1], scale=scale, interpret=chosen == "interpret")
    if lowering == "mosaic" and block_axes is None:   # it does not combine block shards
      return mosaic_mla.mla_decode(
          query, arrays[0], arrays[1], arrays[2], layer, block_table, seq_lens,
          num_blocks=arrays[0].shape[1], scale=scale, interpret=chosen == "interpret")
    return attention_kernels.paged_attention_decode(
        fmt, query, arrays[0], arrays[1] if split else None, arrays[-1], arrays[-1], layer,
        block_table, seq_lens, key_plane=key_plane, value_plane=key_plane,
        num_blocks=arrays[0].shape[1], scale=scale, alibi_slopes=None, logits_soft_cap=None,
        sliding_window=None, interpret=chosen == "interpret", value_dim=kv_lora_rank,
        combine_axes=block_axes, rope_plane=rope_plane, ds_mla=ds_mla)

  # Under a plain jit on a cache paged over devices: per page shard, partials combined.
  page_shards = partitioning.Cache(1, None)
  return partitioning.per_shard(
      kernel, (query, layer, block_table, seq_lens) + arrays,
      (partitioning.QUERY, partitioning.REPLICATED, partitioning.BLOCK_TABLE,
       partitioning.REPLICATED)
      + ((page_shards,) * 3 if split else (page_shards, partitioning.REPLICATED)),
      block_size=block_size, read=True)
