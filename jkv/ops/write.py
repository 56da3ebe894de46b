"""Paged cache writes: vLLM / AITER ``reshape_and_cache*`` and FlashInfer ``append_paged_kv_cache``.

Functional versions of the in-place originals: they return the updated caches in
the order the caches were passed. Donate the caches to the surrounding ``jax.jit``
and the update happens in place (the Pallas kernel aliases them; the reference
uses ``.at[].set``, which XLA does in place on donated buffers).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jkv import backend as backend_lib
from jkv import errors, layout as layout_lib, pages, quant
from jkv.reference import write as reference
from pallas_kernels import write as kernels


def _resolve_quant(kv_cache_dtype: str, cache_dtype, name: str):
  """FP8 dtype to quantize to (None for "auto"), checking the cache's dtype."""
  fp8 = quant.fp8_dtype(kv_cache_dtype)
  if fp8 is None:
    if quant.is_fp8(cache_dtype):
      raise TypeError(f"{name} has dtype {np.dtype(cache_dtype).name} but kv_cache_dtype='auto'; "
                      f"pass the FP8 kv_cache_dtype (e.g. 'fp8') and k_scale/v_scale")
    if not jnp.issubdtype(cache_dtype, jnp.floating):
      raise TypeError(f"{name} must be a floating-point cache, got dtype {cache_dtype}")
    return None
  if np.dtype(cache_dtype) != np.dtype(fp8):
    raise TypeError(f"{name} must have dtype {np.dtype(fp8).name} for kv_cache_dtype="
                    f"{kv_cache_dtype!r}, got {np.dtype(cache_dtype).name}")
  return fp8


def token_inputs(key, value, slot_mapping):
  """(key, value, slot_mapping) as validated arrays; key and value cut to the length of
  slot_mapping (vLLM: extra key rows are CUDA-graph padding)."""
  key, value, slot_mapping = jnp.asarray(key), jnp.asarray(value), jnp.asarray(slot_mapping)
  errors.check_token_inputs(key, value, slot_mapping)
  num_tokens = slot_mapping.shape[0]
  return key[:num_tokens], value[:num_tokens], slot_mapping


def check_caches(layout, kv_layout, key_cache, value_cache, lead, num_heads, head_size):
  """Validates the caches of a write (``lead`` = 1: a leading num_layers dim).

  layout: one of :data:`jkv.layout.LAYOUTS` or ``"paged5d"``; value_cache is None for
  ``packed`` and ``paged5d``. Returns ``(num_blocks, block_size, key_plane, value_plane)``.
  """
  packed = layout in ("packed", "paged5d")
  if packed and value_cache is not None:
    raise ValueError(f"layout {layout!r} keeps K and V in one tensor; pass value_cache=None")
  if not packed and value_cache is None:
    raise ValueError(f"layout {layout!r} needs a value_cache")
  per_layer = key_cache.shape[lead:]
  if layout == "paged5d":
    if len(per_layer) != 5 or per_layer[1] != 2:
      raise ValueError(f"paged_kv_cache must be [P, 2, ...] 5-D, got shape {tuple(key_cache.shape)}")
    num_blocks = per_layer[0]
    block_size = per_layer[2] if kv_layout == "NHD" else per_layer[3]
    four_d = (num_blocks, block_size, num_heads, head_size) if kv_layout == "NHD" else (
        num_blocks, num_heads, block_size, head_size)
    expected = (four_d[0], 2) + four_d[1:]
    key_plane, value_plane = layout_lib.paged5d_planes(block_size, num_heads, head_size, kv_layout)
    expected_value = None
  else:
    num_blocks, block_size = layout_lib.blocks_of(layout, per_layer, kv_layout)
    expected, expected_value = layout_lib.cache_shapes(
        layout, num_blocks, block_size, num_heads, head_size, key_cache.dtype, kv_layout)
    key_plane, value_plane = layout_lib.planes(
        layout, block_size, num_heads, head_size, key_cache.dtype, kv_layout)
  num_layers = key_cache.shape[:lead]
  errors.check_shape("kv_cache" if packed else "key_cache", key_cache,
                     num_layers + tuple(expected))
  if value_cache is not None:
    errors.check_shape("value_cache", value_cache, num_layers + tuple(expected_value))
    if value_cache.dtype != key_cache.dtype:
      raise TypeError(f"value_cache dtype {value_cache.dtype} differs from key_cache dtype "
                      f"{key_cache.dtype}")
  return num_blocks, block_size, key_plane, value_plane


def layer_index(layer, key_cache, slot_mapping):
  """``(layer, slot_mapping)`` for a write into one layer of stacked caches.

  layer: None (unstacked caches; returned as None) or an int, possibly traced: checked
  eagerly; a traced layer out of range writes nothing (every slot dropped) rather than
  another layer.
  """
  if layer is None:
    return None, slot_mapping
  num_layers = key_cache.shape[0]
  errors.check_index("layer", layer, num_layers)
  layer = jnp.asarray(layer, jnp.int32)
  layer_ok = (layer >= 0) & (layer < num_layers)
  slot_mapping = jnp.where(layer_ok, slot_mapping, -1)
  return jnp.clip(layer, 0, num_layers - 1), slot_mapping


def write_kv(key, value, key_cache, value_cache, slot_mapping, *, layout: str,
             kv_layout: str = "NHD", kv_cache_dtype: str = "auto", k_scale=None, v_scale=None,
             layer=None, backend: str = "auto"):
  """Writes key/value [T, H, D] into a paged cache of any layout.

  Args:
    layout: one of :data:`jkv.layout.LAYOUTS`, or ``"paged5d"`` (FlashInfer's single
      ``[P, 2, ps, H, D]`` / ``[P, 2, H, ps, D]`` tensor). ``value_cache`` is None for
      ``packed`` and ``paged5d``.
    slot_mapping: int [T'] with T' <= T (vLLM: extra key rows are CUDA-graph padding).
      < 0: skipped. >= num_blocks * block_size: ValueError eagerly, dropped under jit.
    layer: None, or an int (may be traced) indexing a leading ``num_layers`` dim.
  Returns:
    ``(key_cache, value_cache)``, or ``(kv_cache,)`` when value_cache is None.
  """
  given_slots = slot_mapping  # range-checked as given: int64 values would wrap in int32
  key, value, slot_mapping = token_inputs(key, value, slot_mapping)
  num_tokens, num_heads, head_size = key.shape

  lead = 0 if layer is None else 1
  num_blocks, block_size, key_plane, value_plane = check_caches(
      layout, kv_layout, key_cache, value_cache, lead, num_heads, head_size)
  cache_name = "kv_cache" if value_cache is None else "key_cache"
  quant_dtype = _resolve_quant(kv_cache_dtype, key_cache.dtype, cache_name)
  k_inv_scale = 1.0 / quant.normalize_scale(k_scale, num_heads, "k_scale")
  v_inv_scale = 1.0 / quant.normalize_scale(v_scale, num_heads, "v_scale")
  errors.check_slots_in_range("slot_mapping", given_slots, num_blocks * block_size,
                              f"a cache of {num_blocks} blocks x {block_size}")
  layer, slot_mapping = layer_index(layer, key_cache, slot_mapping)
  caches = (key_cache,) if value_cache is None else (key_cache, value_cache)
  if num_tokens == 0:
    return caches

  chosen = backend_lib.resolve(backend)
  if chosen == "reference":
    return reference.write_kv(
        key, value, key_cache, value_cache, slot_mapping, layout=layout, kv_layout=kv_layout,
        block_size=block_size, num_blocks=num_blocks, quant_dtype=quant_dtype,
        k_inv_scale=k_inv_scale, v_inv_scale=v_inv_scale, layer=layer)
  return kernels.scatter_kv(
      key, value, key_cache, value_cache, slot_mapping, 0 if layer is None else layer,
      k_inv_scale, v_inv_scale, key_plane=key_plane, value_plane=value_plane, num_blocks=num_blocks,
      quant_dtype=quant_dtype, interpret=chosen == "interpret")


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                      k_scale=None, v_scale=None, asm_layout=False, *, backend="auto"):
  """vLLM / AITER ``reshape_and_cache``.

  key, value: [T, H, D]. key_cache: [nb, H, D/x, bs, x]; value_cache: [nb, H, D, bs], or
  with ``asm_layout`` [nb, H, bs/x, D, x]. Returns ``(key_cache, value_cache)``.
  """
  return write_kv(key, value, key_cache, value_cache, slot_mapping,
                  layout="asm" if asm_layout else "vllm", kv_cache_dtype=kv_cache_dtype,
                  k_scale=k_scale, v_scale=v_scale, backend=backend)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                            k_scale=None, v_scale=None, kv_layout="NHD", *, backend="auto"):
  """vLLM ``reshape_and_cache_flash``: caches [nb, bs, H, D] (NHD) or [nb, H, bs, D] (HND).

  k_scale / v_scale may be per head ([H]). Returns ``(key_cache, value_cache)``.
  """
  layout_lib.check_layout("flash", kv_layout)
  return write_kv(key, value, key_cache, value_cache, slot_mapping,
                  layout="flash" if kv_layout == "NHD" else "hnd", kv_cache_dtype=kv_cache_dtype,
                  k_scale=k_scale, v_scale=v_scale, backend=backend)


def reshape_and_cache_packed(key, value, kv_cache, slot_mapping, kv_cache_dtype="auto",
                             k_scale=None, v_scale=None, kv_layout="NHD", *, backend="auto"):
  """vLLM's standardized packed layout: one tensor, K in [..., :D], V in [..., D:].

  kv_cache: [nb, bs, H, 2D] (NHD storage) or [nb, H, bs, 2D] (HND). Returns kv_cache.
  """
  (kv_cache,) = write_kv(key, value, kv_cache, None, slot_mapping, layout="packed",
                         kv_layout=kv_layout, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                         v_scale=v_scale, backend=backend)
  return kv_cache


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD", *,
                          backend="auto"):
  """FlashInfer ``append_paged_kv_cache``.

  append_key, append_value: [nnz, H, D] (same dtype as the cache: no conversion).
  batch_indices, positions: int [nnz]; entry i goes to request ``batch_indices[i]`` at
  absolute position ``positions[i]``: page ``kv_indices[kv_indptr[b] + p // ps]``,
  offset ``p % ps``. A negative batch index (what :func:`get_batch_indices_positions`
  gives unused entries) or a position past the request's pages writes nothing
  (FlashInfer leaves both undefined); eagerly the latter raises ValueError.
  paged_kv_cache: ``(k_cache, v_cache)`` each [P, ps, H, D] (NHD) / [P, H, ps, D] (HND),
  or one [P, 2, ps, H, D] / [P, 2, H, ps, D] tensor. Returns the same structure.
  kv_last_page_len is not used by the append itself (as in FlashInfer).
  """
  del kv_last_page_len
  layout_lib.check_layout("flash", kv_layout)
  append_key = jnp.asarray(append_key)
  single = not isinstance(paged_kv_cache, (tuple, list))
  first = jnp.asarray(paged_kv_cache if single else paged_kv_cache[0])
  if first.ndim != (5 if single else 4):
    raise ValueError("paged_kv_cache must be a (k_cache, v_cache) tuple of 4-D caches or one 5-D "
                     f"[P, 2, ...] tensor, got a {first.ndim}-D "
                     f"{'tensor' if single else 'k_cache'}")
  if first.dtype != append_key.dtype:
    raise TypeError(f"paged_kv_cache dtype {first.dtype} must equal append_key dtype "
                    f"{append_key.dtype} (append_paged_kv_cache does not convert)")
  if single:
    page_size = first.shape[2] if kv_layout == "NHD" else first.shape[3]
  else:
    page_size = first.shape[1] if kv_layout == "NHD" else first.shape[2]
  slots, in_range = pages.append_slot_mapping(batch_indices, positions, kv_indices, kv_indptr,
                                              page_size)
  if errors.is_concrete(in_range) and not bool(np.all(np.asarray(in_range))):
    i = int(np.nonzero(~np.asarray(in_range))[0][0])
    raise ValueError(f"positions[{i}] = {int(np.asarray(positions)[i])} lies past the pages that "
                     f"kv_indptr gives request {int(np.asarray(batch_indices)[i])}")
  if single:
    (out,) = write_kv(append_key, append_value, paged_kv_cache, None, slots, layout="paged5d",
                      kv_layout=kv_layout, backend=backend)
    return out
  k_cache, v_cache = paged_kv_cache
  return write_kv(append_key, append_value, k_cache, v_cache, slots,
                  layout="flash" if kv_layout == "NHD" else "hnd", backend=backend)
