"""Paged cache writes: vLLM / AITER ``reshape_and_cache*`` and FlashInfer ``append_paged_kv_cache``.

Functional versions of the in-place originals: they return the updated caches in
the order the caches were passed. Donate the caches to the surrounding ``jax.jit``
and the update happens in place (the Pallas kernel aliases them; the reference
uses ``.at[].set``, which XLA does in place on donated buffers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jkv import backend as backend_lib
from jkv import errors, layout as layout_lib, pages, partitioning, quant
from jkv.reference import write as reference
from pallas_kernels import lowering as lowering_lib
from pallas_kernels import mosaic_write
from pallas_kernels import write as kernels


# ``lowering="auto"`` picks the Mosaic GPU write on Hopper from this many tokens on
# (profiler device times, flash bf16, 8 x 128, RESULTS.md "lowering"). H200: faster from
# 1K tokens on (1K 2.39 against Triton's 2.51 us, 4K 6.24 / 6.68, 32K 69.4 / 73.2); H100
# (the section's current run): a tie at 1K (2.58 / 2.57), faster from 4K (7.28 / 7.64, 32K
# 94.0 / 96.2, 0.95-0.96 of the copy ceiling in every layout); at 256 tokens the two tie
# on both (1.53 / 1.51 and 1.60 / 1.61 us).
MOSAIC_WRITE_MIN_TOKENS = 1024


def resolve_quant(kv_cache_dtype: str, cache_dtype, name: str):
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
  """(key, value, slot_mapping) as validated arrays (the slots' values checked as given
  to fit in int32); key and value cut to the length of slot_mapping (vLLM: extra key rows
  are CUDA-graph padding)."""
  key, value = jnp.asarray(key), jnp.asarray(value)
  slot_mapping = errors.int_array("slot_mapping", slot_mapping)
  errors.check_token_inputs(key, value, slot_mapping)
  num_tokens = slot_mapping.shape[0]
  return key[:num_tokens], value[:num_tokens], slot_mapping


# Dims of one layer's key (or only) cache per layout, for errors (HND storage of packed
# swaps bs and H).
CACHE_DIMS = {"vllm": ("nb", "H", "D/x", "bs", "x"), "asm": ("nb", "H", "D/x", "bs", "x"),
              "flash": ("nb", "bs", "H", "D"), "hnd": ("nb", "H", "bs", "D"),
              "packed": ("nb", "bs", "H", "2D")}


def as_cache(name: str, cache):
  """A cache argument as a JAX array (numpy input is copied to the device; a JAX array
  or tracer comes back as is, so a donated cache stays donated)."""
  if cache is None or isinstance(cache, jax.Array):
    return cache
  if not hasattr(cache, "shape") or not hasattr(cache, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(cache).__name__}")
  return jnp.asarray(cache)


def check_caches(layout, kv_layout, key_cache, value_cache, lead, num_heads, head_size):
  """Validates the caches of a write (``lead`` = 1: a leading num_layers dim).

  layout: one of :data:`jkv.layout.LAYOUTS`, ``"paged5d"`` or ``"max"`` (the MAX collection
  ``[nb, 2, L, bs, H, D]``: its layers are inside, ``lead`` is 0); value_cache is None for
  ``packed``, ``paged5d`` and ``max``. Returns ``(num_blocks, block_size, key_plane,
  value_plane)``.
  """
  packed = layout in ("packed", "paged5d", layout_lib.MAX)
  if packed and value_cache is not None:
    raise ValueError(f"layout {layout!r} keeps K and V in one tensor; pass value_cache=None")
  if not packed and value_cache is None:
    raise ValueError(f"layout {layout!r} needs a value_cache")
  check_rank(layout, key_cache, lead)
  per_layer = key_cache.shape[lead:]
  if layout == layout_lib.MAX:
    if kv_layout != "NHD":
      raise ValueError(f"layout 'max' stores NHD pages [bs, H, D]: leave kv_layout='NHD', got "
                       f"{kv_layout!r}")
    num_blocks, num_layers, block_size, _, _ = layout_lib.max_dims(per_layer)
    expected = layout_lib.max_shape(num_blocks, num_layers, block_size, num_heads, head_size)
    key_plane, value_plane = layout_lib.max_planes(block_size, num_heads, head_size)
    expected_value = None
  elif layout == "paged5d":
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
    cache_heads = layout_lib.heads_of(layout, per_layer, kv_layout)
    if cache_heads != (num_heads, head_size):
      raise ValueError(f"key / value [num_tokens, num_heads, head_size] have num_heads="
                       f"{num_heads}, head_size={head_size}; the "
                       f"{'kv_cache' if packed else 'key_cache'} {tuple(key_cache.shape)} "
                       f"holds num_heads={cache_heads[0]}, head_size={cache_heads[1]}")
    expected, expected_value = layout_lib.cache_shapes(
        layout, num_blocks, block_size, num_heads, head_size, key_cache.dtype, kv_layout)
    key_plane, value_plane = layout_lib.planes(
        layout, block_size, num_heads, head_size, key_cache.dtype, kv_layout)
  num_layers = key_cache.shape[:lead]
  for name, cache, shape in (("kv_cache" if packed else "key_cache", key_cache, expected),
                             ("value_cache", value_cache, expected_value)):
    if cache is not None and tuple(cache.shape) != num_layers + tuple(shape):
      raise ValueError(f"{name} must have shape {num_layers + tuple(shape)}, got "
                       f"{tuple(cache.shape)} (for num_heads={num_heads}, "
                       f"head_size={head_size})")
  if value_cache is not None:
    if value_cache.dtype != key_cache.dtype:
      raise TypeError(f"value_cache dtype {value_cache.dtype} differs from key_cache dtype "
                      f"{key_cache.dtype}")
  return num_blocks, block_size, key_plane, value_plane


def check_rank(layout: str, key_cache, lead: int):
  """ValueError unless the key (or packed) cache of ``layout`` has its layout's rank
  (``lead`` = 1: plus a leading num_layers dim, ``layer`` given)."""
  if layout in CACHE_DIMS:
    dims = ("num_layers",) * lead + CACHE_DIMS[layout]
    if key_cache.ndim != len(dims):
      name = "kv_cache" if layout == "packed" else "key_cache"
      raise ValueError(f"{name} of layout {layout!r} must be {len(dims)}-D "
                       f"[{', '.join(dims)}]{' (layer is given)' if lead else ''}, got shape "
                       f"{tuple(key_cache.shape)}")


def cache_lead(layout: str, layer, use: str) -> int:
  """Leading layer dims of an op's caches: 1 when ``layer`` is given, else 0; 0 for the
  MAX collection (its layers are inside), which needs ``layer`` (ValueError; ``use``:
  "write" or "read", for the message)."""
  if layout != layout_lib.MAX:
    return 0 if layer is None else 1
  if layer is None:
    raise ValueError("layout 'max' holds every layer in one collection [nb, 2, L, bs, H, D]: "
                     f"pass the layer to {use}")
  return 0


def layer_index(layer, key_cache, slot_mapping, num_layers: int | None = None):
  """``(layer, slot_mapping)`` for a write into one layer of stacked caches.

  layer: None (unstacked caches; returned as None) or an int, possibly traced: checked
  eagerly; a traced layer out of range writes nothing (every slot dropped) rather than
  another layer. num_layers: default the caches' leading dim.
  """
  if layer is None:
    return None, slot_mapping
  num_layers = key_cache.shape[0] if num_layers is None else num_layers
  errors.check_index("layer", layer, num_layers)   # an integer scalar; eagerly in range
  layer = jnp.asarray(layer, jnp.int32)
  layer_ok = (layer >= 0) & (layer < num_layers)
  slot_mapping = jnp.where(layer_ok, slot_mapping, -1)
  return jnp.clip(layer, 0, num_layers - 1), slot_mapping


def write_kv(key, value, key_cache, value_cache, slot_mapping, *, layout: str,
             kv_layout: str = "NHD", kv_cache_dtype: str = "auto", k_scale=None, v_scale=None,
             layer=None, backend: str = "auto", lowering: str = "auto"):
  """Writes key/value [T, H, D] into a paged cache of any layout.

  Args:
    layout: one of :data:`jkv.layout.LAYOUTS`, ``"paged5d"`` (FlashInfer's single
      ``[P, 2, ps, H, D]`` / ``[P, 2, H, ps, D]`` tensor) or ``"max"`` (Mojo MAX's
      collection ``[nb, 2, L, bs, H, D]``, every layer inside a block; ``layer`` required).
      ``value_cache`` is None for ``packed``, ``paged5d`` and ``max``.
    slot_mapping: int [T'] with T' <= T (vLLM: extra key rows are CUDA-graph padding).
      < 0: skipped. >= num_blocks * block_size: ValueError eagerly, dropped under jit.
      A slot given twice holds one of its tokens, which one is unspecified on a GPU (as
      in vLLM; the CPU back ends keep the last).
    layer: None, or an int (may be traced) indexing a leading ``num_layers`` dim (with
      ``max``: the collection's layer dim).
    lowering: the kernel's lowering (:func:`jkv.backend.lowering`): ``"mosaic"`` runs the
      Mosaic GPU kernel (layouts flash, hnd and packed; the input's dtype or an FP8 e4m3 /
      e5m2 cache), ``"triton"`` the Triton one (every layout and format).
  Returns:
    ``(key_cache, value_cache)``, or ``(kv_cache,)`` when value_cache is None.

  >>> import jax.numpy as jnp, jkv
  >>> key_cache = value_cache = jnp.zeros((4, 16, 2, 64), jnp.bfloat16)   # flash [nb, bs, H, D]
  >>> key = value = jnp.ones((3, 2, 64), jnp.bfloat16)
  >>> key_cache, value_cache = jkv.write_kv(key, value, key_cache, value_cache,
  ...                                       jnp.array([0, 17, -1]), layout="flash")
  >>> float(key_cache[1, 1, 0, 0]), float(key_cache[1, 2, 0, 0])   # slot 17 = block 1, offset 1
  (1.0, 0.0)
  """
  key, value, slot_mapping = token_inputs(key, value, slot_mapping)
  num_tokens, num_heads, head_size = key.shape

  collection = layout == layout_lib.MAX
  lead = cache_lead(layout, layer, "write")
  cache_name = "kv_cache" if value_cache is None else "key_cache"
  key_cache = as_cache(cache_name, key_cache)
  value_cache = as_cache("value_cache", value_cache)
  num_blocks, block_size, key_plane, value_plane = check_caches(
      layout, kv_layout, key_cache, value_cache, lead, num_heads, head_size)
  quant_dtype = resolve_quant(kv_cache_dtype, key_cache.dtype, cache_name)
  k_scale = quant.normalize_scale(k_scale, num_heads, "k_scale")
  v_scale = quant.normalize_scale(v_scale, num_heads, "v_scale")
  if quant_dtype is not None:   # "auto" does not use the scales
    errors.check_scales_positive("k_scale", k_scale)
    errors.check_scales_positive("v_scale", v_scale)
  k_inv_scale, v_inv_scale = 1.0 / k_scale, 1.0 / v_scale
  errors.check_slots_in_range("slot_mapping", slot_mapping, num_blocks * block_size,
                              f"a cache of {num_blocks} blocks x {block_size}")
  layer, slot_mapping = layer_index(
      layer, key_cache, slot_mapping,
      layout_lib.max_dims(key_cache.shape)[1] if collection else None)
  caches = (key_cache,) if value_cache is None else (key_cache, value_cache)
  mosaic_ok = not collection and mosaic_write.supported(
      key_plane, value_plane, key.dtype, value.dtype, key_cache.dtype, quant_dtype)
  triton_ok = lowering_lib.triton_available()
  chosen = backend_lib.resolve(backend, kernel_supported=mosaic_ok or triton_ok)
  mosaic_ok = mosaic_ok and not (chosen == "interpret" and partitioning.wraps_kernels())
  lowering = backend_lib.lowering(lowering, mosaic_supported=mosaic_ok,
                                  mosaic_first=(num_tokens >= MOSAIC_WRITE_MIN_TOKENS
                                                and backend_lib.hopper()),
                                  triton_available=triton_ok, kernel=chosen != "reference")
  if num_tokens == 0:
    return caches
  if chosen == "reference":
    return reference.write_kv(
        key, value, key_cache, value_cache, slot_mapping, layout=layout, kv_layout=kv_layout,
        block_size=block_size, num_blocks=num_blocks, quant_dtype=quant_dtype,
        k_inv_scale=k_inv_scale, v_inv_scale=v_inv_scale, layer=layer)
  def kernel(key, value, slot_mapping, layer, k_inv_scale, v_inv_scale, *caches):
    num_blocks, _, key_plane, value_plane = check_caches(
        layout, kv_layout, caches[0], caches[1] if len(caches) > 1 else None, lead,
        key.shape[1], head_size)
    # A shard (heads split over devices) may leave the Mosaic kernel's shapes: Triton there.
    mosaic = lowering == "mosaic" and not collection and mosaic_write.supported(
        key_plane, value_plane, key.dtype, value.dtype, caches[0].dtype, quant_dtype)
    if not mosaic and not triton_ok:
      raise NotImplementedError(f"a shard of {key.shape[1]} heads is not the Mosaic GPU "
                                "write's and this JAX has no Pallas Triton; use "
                                "backend='reference'")
    if mosaic:
      return mosaic_write.scatter_kv(
          key, value, caches[0], caches[1] if len(caches) > 1 else None, slot_mapping, layer,
          k_inv_scale, v_inv_scale, key_plane=key_plane, value_plane=value_plane,
          num_blocks=num_blocks, quant_dtype=quant_dtype, interpret=chosen == "interpret")
    rows = {}
    if collection:   # one page per (block, K|V, layer): rows of bs * H * D elements
      key_rows, value_rows = layout_lib.max_rows(layout_lib.max_dims(caches[0].shape)[1])
      rows = dict(key_rows=key_rows, value_rows=value_rows,
                  page_elems=key_plane.block_size * key.shape[1] * head_size)
    return kernels.scatter_kv(
        key, value, caches[0], caches[1] if len(caches) > 1 else None, slot_mapping, layer,
        k_inv_scale, v_inv_scale, key_plane=key_plane, value_plane=value_plane,
        num_blocks=num_blocks, quant_dtype=quant_dtype, interpret=chosen == "interpret",
        **rows)

  cache = partitioning.Cache(block_dim=lead, head_dim=lead + layout_lib.heads_dim(layout, kv_layout))
  roles = (partitioning.TOKENS, partitioning.TOKENS, partitioning.SLOTS,
           partitioning.REPLICATED, partitioning.HEAD_SCALE, partitioning.HEAD_SCALE)
  return partitioning.per_shard(
      kernel, (key, value, slot_mapping, jnp.asarray(0 if layer is None else layer, jnp.int32),
               k_inv_scale, v_inv_scale) + caches, roles + (cache,) * len(caches),
      block_size=block_size)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                      k_scale=None, v_scale=None, asm_layout=False, *, backend="auto"):
  """vLLM / AITER ``reshape_and_cache``.

  key, value: [T, H, D]. key_cache: [nb, H, D/x, bs, x]; value_cache: [nb, H, D, bs], or
  with ``asm_layout`` [nb, H, bs/x, D, x]. Returns ``(key_cache, value_cache)``.

  >>> import jax.numpy as jnp, jkv
  >>> key_cache = jnp.zeros((4, 2, 8, 16, 8), jnp.bfloat16)   # [nb, H, D / x, bs, x], x = 8
  >>> value_cache = jnp.zeros((4, 2, 64, 16), jnp.bfloat16)   # [nb, H, D, bs]
  >>> key = value = jnp.ones((3, 2, 64), jnp.bfloat16)
  >>> key_cache, value_cache = jkv.reshape_and_cache(key, value, key_cache, value_cache,
  ...                                                jnp.array([0, 17, -1]))
  >>> float(value_cache[1, 0, 5, 1])
  1.0
  """
  return write_kv(key, value, key_cache, value_cache, slot_mapping,
                  layout="asm" if asm_layout else "vllm", kv_cache_dtype=kv_cache_dtype,
                  k_scale=k_scale, v_scale=v_scale, backend=backend)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                            k_scale=None, v_scale=None, kv_layout="NHD", *, backend="auto"):
  """vLLM ``reshape_and_cache_flash``: caches [nb, bs, H, D] (NHD) or [nb, H, bs, D] (HND).

  k_scale / v_scale may be per head ([H]). Returns ``(key_cache, value_cache)``.

  >>> import jax.numpy as jnp, jkv
  >>> key_cache = value_cache = jnp.zeros((4, 16, 2, 64), jnp.float16)   # [nb, bs, H, D]
  >>> key = value = jnp.ones((2, 2, 64), jnp.float16)
  >>> key_cache, value_cache = jkv.reshape_and_cache_flash(key, value, key_cache, value_cache,
  ...                                                      jnp.array([5, 33]))
  >>> float(key_cache[2, 1, 1, 7])
  1.0
  """
  layout_lib.check_kv_layout(kv_layout)
  return write_kv(key, value, key_cache, value_cache, slot_mapping,
                  layout="flash" if kv_layout == "NHD" else "hnd", kv_cache_dtype=kv_cache_dtype,
                  k_scale=k_scale, v_scale=v_scale, backend=backend)


def reshape_and_cache_packed(key, value, kv_cache, slot_mapping, kv_cache_dtype="auto",
                             k_scale=None, v_scale=None, kv_layout="NHD", *, backend="auto"):
  """vLLM's standardized packed layout: one tensor, K in [..., :D], V in [..., D:].

  kv_cache: [nb, bs, H, 2D] (NHD storage) or [nb, H, bs, 2D] (HND). Returns kv_cache.

  >>> import jax.numpy as jnp, jkv
  >>> kv_cache = jnp.zeros((4, 16, 2, 128), jnp.bfloat16)   # [nb, bs, H, 2D]: K then V
  >>> key, value = jnp.ones((2, 2, 64), jnp.bfloat16), jnp.full((2, 2, 64), 2.0, jnp.bfloat16)
  >>> kv_cache = jkv.reshape_and_cache_packed(key, value, kv_cache, jnp.array([0, 1]))
  >>> float(kv_cache[0, 1, 0, 0]), float(kv_cache[0, 1, 0, 64])
  (1.0, 2.0)
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

  >>> import jax.numpy as jnp, jkv
  >>> pages = (jnp.zeros((4, 16, 2, 64), jnp.bfloat16),) * 2     # (k, v) [P, ps, H, D]
  >>> kv_indptr, kv_indices = jnp.array([0, 1, 3]), jnp.array([2, 0, 3])
  >>> kv_last_page_len = jnp.array([3, 5])
  >>> seq_lens = jkv.get_seq_lens(kv_indptr, kv_last_page_len, 16)          # [3, 21]
  >>> append_indptr = jnp.array([0, 1, 3])     # request 0 appends 1 token, request 1 two
  >>> batch, positions = jkv.get_batch_indices_positions(append_indptr, seq_lens, 3)
  >>> new = jnp.ones((3, 2, 64), jnp.bfloat16)
  >>> k_cache, v_cache = jkv.append_paged_kv_cache(new, new, batch, positions, pages,
  ...                                              kv_indices, kv_indptr, kv_last_page_len)
  >>> float(k_cache[2, 2, 0, 0]), float(k_cache[3, 4, 0, 0])   # positions 2 and 20
  (1.0, 1.0)
  """
  del kv_last_page_len
  layout_lib.check_kv_layout(kv_layout)
  append_key, append_value = jnp.asarray(append_key), jnp.asarray(append_value)
  errors.check_ndim("append_key", append_key, 3, "[nnz, num_heads, head_size]")
  errors.check_shape("append_value", append_value, append_key.shape)
  single = not isinstance(paged_kv_cache, (tuple, list))
  if not single and len(paged_kv_cache) != 2:
    raise ValueError(f"paged_kv_cache must be a (k_cache, v_cache) pair or one 5-D tensor, got "
                     f"a {type(paged_kv_cache).__name__} of {len(paged_kv_cache)} entries")
  if single:
    paged_kv_cache = first = as_cache("paged_kv_cache", paged_kv_cache)
  else:
    paged_kv_cache = tuple(as_cache(f"paged_kv_cache[{i}]", c)
                           for i, c in enumerate(paged_kv_cache))
    first = paged_kv_cache[0]
  if first.ndim != (5 if single else 4):
    raise ValueError("paged_kv_cache must be a (k_cache, v_cache) tuple of 4-D caches or one 5-D "
                     f"[P, 2, ...] tensor, got a {first.ndim}-D "
                     f"{'tensor' if single else 'k_cache'}")
  for name, x in (("append_key", append_key), ("append_value", append_value)):
    if first.dtype != x.dtype:
      raise TypeError(f"paged_kv_cache dtype {first.dtype} must equal {name} dtype "
                      f"{x.dtype} (append_paged_kv_cache does not convert)")
  nnz = append_key.shape[0]
  for name, x in (("batch_indices", batch_indices), ("positions", positions)):
    x = jnp.asarray(x)
    if tuple(x.shape) != (nnz,):
      raise ValueError(f"{name} must have shape ({nnz},) (one entry per append_key row), got "
                       f"{tuple(x.shape)}")
  _, num_heads, head_size = append_key.shape
  if single:
    page_size = first.shape[2] if kv_layout == "NHD" else first.shape[3]
    inner = (page_size, num_heads) if kv_layout == "NHD" else (num_heads, page_size)
    errors.check_shape("paged_kv_cache", first, (first.shape[0], 2) + inner + (head_size,))
  else:
    page_size = first.shape[1] if kv_layout == "NHD" else first.shape[2]
    inner = (page_size, num_heads) if kv_layout == "NHD" else (num_heads, page_size)
    errors.check_shape("paged_kv_cache[0]", first, (first.shape[0],) + inner + (head_size,))
    errors.check_shape("paged_kv_cache[1]", paged_kv_cache[1], first.shape)
  slots, in_range = pages.append_slot_mapping(batch_indices, positions, kv_indices, kv_indptr,
                                              page_size)
  _check_kv_indices(kv_indices, kv_indptr, first.shape[0])
  if errors.is_concrete(in_range) and not bool(np.all(np.asarray(in_range))):
    i = int(np.nonzero(~np.asarray(in_range))[0][0])
    position = int(np.asarray(positions)[i])
    if position < 0:
      raise ValueError(f"positions[{i}] = {position} must be >= 0")
    raise ValueError(f"positions[{i}] = {position} lies past the pages that "
                     f"kv_indptr gives request {int(np.asarray(batch_indices)[i])}")
  if single:
    (out,) = write_kv(append_key, append_value, paged_kv_cache, None, slots, layout="paged5d",
                      kv_layout=kv_layout, backend=backend)
    return out
  k_cache, v_cache = paged_kv_cache
  return write_kv(append_key, append_value, k_cache, v_cache, slots,
                  layout="flash" if kv_layout == "NHD" else "hnd", backend=backend)


def _check_kv_indices(kv_indices, kv_indptr, num_pages: int) -> None:
  """Eagerly: the pages kv_indptr hands out (kv_indices[indptr[0]:indptr[-1]]) exist."""
  if not (errors.is_concrete(kv_indices) and errors.is_concrete(kv_indptr)):
    return
  indptr, indices = np.asarray(kv_indptr), np.asarray(kv_indices)
  start, end = int(indptr[0]), int(indptr[-1])
  used = indices[start:end]
  bad = np.nonzero((used < 0) | (used >= num_pages))[0]
  if bad.size:
    i = start + int(bad[0])
    raise ValueError(f"kv_indices[{i}] = {int(indices[i])} is out of range: paged_kv_cache has "
                     f"{num_pages} pages (valid: 0..{num_pages - 1})")
