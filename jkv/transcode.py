"""Layout transcoding of paged KV caches: read a cache written in one layout as another.

Every layout of :mod:`jkv.layout` (and FlashInfer's ``[P, 2, ...]`` tensor, ``"paged5d"``,
and Mojo MAX's all-layers collection ``[nb, 2, L, bs, H, D]``, ``"max"``, which needs
``layer_axis=True``: its canonical form is ``[L, nb, bs, H, D]``) is a permutation of the
*canonical* form: key and value each ``[nb, bs, H, D]``, token
``slot = block * bs + offset`` at ``[block, offset]``. :func:`to_canonical` and
:func:`from_canonical` map to and from it with reshapes, transposes, slices and
concatenations only (no arithmetic), so any dtype (float8, int8, the uint8 of FP4 data)
and every bit (NaN payloads, -0) comes through unchanged. :func:`transcode` chains the
two, optionally for a subset of blocks (what a prefill engine hands a decode engine).

``kv_layout`` is the storage order of ``packed`` and ``paged5d``, as in :mod:`jkv.layout`:
``flash`` is always NHD ``[nb, bs, H, D]`` and ``hnd`` is vLLM's flash cache in HND
storage ``[nb, H, bs, D]``; ``("flash", "HND")`` is refused rather than read as NHD.

``layer_axis=True``: every cache array has a leading ``num_layers`` axis (as in
:class:`jkv.PagedKVCache`), carried through unchanged; ``block_ids`` then selects along
axis 1.

Each function takes ``backend`` like the ops; transcoding is jnp only (no kernel), see
:func:`jkv.backend.jnp_only`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jkv import backend as backend_lib
from jkv import errors, fp4, layout as layout_lib
from jkv.cache import PagedKVCache
from jkv.ops import write as write_ops

LAYOUTS = layout_lib.LAYOUTS + ("paged5d", layout_lib.MAX)
_SINGLE_TENSOR = ("packed", "paged5d", layout_lib.MAX)   # K and V in one array
# Rank per layer (the MAX collection: 6-D with its layers inside, counted as a layer axis).
_KEY_RANK = {"vllm": 5, "asm": 5, "flash": 4, "hnd": 4, "packed": 4, "paged5d": 5,
             layout_lib.MAX: 5}


def _check_layout(layout: str, kv_layout: str) -> None:
  """ValueError unless ``layout`` is one of :data:`LAYOUTS` and ``kv_layout`` one it has
  (:func:`jkv.layout.check_layout`; ``paged5d`` takes NHD and HND)."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  if layout == layout_lib.MAX and kv_layout != "NHD":
    raise ValueError(f"layout 'max' stores NHD pages [bs, H, D]: leave kv_layout='NHD', got "
                     f"{kv_layout!r}")
  if layout in ("paged5d", layout_lib.MAX):
    layout_lib.check_kv_layout(kv_layout)
  else:
    layout_lib.check_layout(layout, kv_layout)


def _cache_dims(key_cache, value_cache, layout: str, kv_layout: str, lead: int):
  """Validates one layout's caches; returns (num_blocks, block_size, num_heads, head_size)."""
  _check_layout(layout, kv_layout)
  _check_lead(layout, lead)
  single = layout in _SINGLE_TENSOR
  name = "kv_cache" if single else "key_cache"
  rank = _KEY_RANK[layout] + lead
  if key_cache.ndim != rank:
    raise ValueError(f"{name} of layout {layout!r} must be {rank}-D (layer_axis="
                     f"{bool(lead)}), got shape {tuple(key_cache.shape)}")
  per_layer = key_cache.shape[lead:]
  if layout == layout_lib.MAX:
    _, _, block_size, heads, head_size = layout_lib.max_dims(key_cache.shape)
    num_blocks, _, _, _ = write_ops.check_caches(layout, kv_layout, key_cache, value_cache, 0,
                                                 heads, head_size)
    return num_blocks, block_size, heads, head_size
  if layout == "paged5d":   # [P, 2, bs, H, D] (NHD) / [P, 2, H, bs, D] (HND)
    heads, head_size = per_layer[3 if kv_layout == "NHD" else 2], per_layer[4]
  else:
    heads, head_size = layout_lib.heads_of(layout, per_layer, kv_layout)
  num_blocks, block_size, _, _ = write_ops.check_caches(layout, kv_layout, key_cache, value_cache,
                                                        lead, heads, head_size)
  return num_blocks, block_size, heads, head_size


def _check_lead(layout: str, lead: int) -> None:
  if layout == layout_lib.MAX and not lead:
    raise ValueError("layout 'max' holds every layer in one collection [nb, 2, L, bs, H, D]: "
                     "pass layer_axis=True (its canonical form is [L, nb, bs, H, D])")


def _block_axis(layout: str, lead: int) -> int:
  """The axis of the blocks: after the layer axis, or first in the MAX collection."""
  return 0 if layout == layout_lib.MAX else lead


def _check_canonical(key, value, lead: int) -> None:
  what = "[num_layers, nb, bs, H, D]" if lead else "[nb, bs, H, D]"
  errors.check_ndim("key", key, 4 + lead, what)
  errors.check_shape("value", value, key.shape)
  if value.dtype != key.dtype:
    raise TypeError(f"value dtype {value.dtype} differs from key dtype {key.dtype}")


def _check_destination(layout: str, kv_layout: str, num_blocks: int, block_size: int,
                       heads: int, head_size: int, dtype) -> None:
  """ValueError when the sizes do not fit ``layout`` (head_size / block_size vs x)."""
  _check_layout(layout, kv_layout)
  if layout not in ("paged5d", layout_lib.MAX):
    layout_lib.cache_shapes(layout, num_blocks, block_size, heads, head_size, dtype, kv_layout)


def _as_bits(a):
  """A float array as the unsigned integers of its bits (None stays None): XLA may quieten
  NaN payloads when it moves floats (XLA:CPU's bfloat16 concatenate does), not integers."""
  if a is None or not jnp.issubdtype(a.dtype, jnp.floating):
    return a
  width = 8 * a.dtype.itemsize
  if jnp.finfo(a.dtype).bits != width:   # sub-byte floats: no same-size unsigned dtype
    return a
  return jax.lax.bitcast_convert_type(a, np.dtype(f"uint{width}"))


def _from_bits(a, dtype):
  """Inverse of :func:`_as_bits`."""
  if a is None or a.dtype == dtype:
    return a
  return jax.lax.bitcast_convert_type(a, dtype)


def _permute(a, lead: int, perm):
  """Transposes the per-layer axes of ``a`` (those after the first ``lead``) by ``perm``."""
  return jnp.transpose(a, tuple(range(lead)) + tuple(lead + p for p in perm))


def _to_canonical(key_cache, value_cache, layout: str, kv_layout: str, lead: int):
  """Unvalidated :func:`to_canonical`."""
  layers = key_cache.shape[:lead]
  if layout == layout_lib.MAX:   # [nb, 2, L, bs, H, D] -> [L, nb, bs, H, D] each
    return jnp.moveaxis(key_cache[:, 0], 1, 0), jnp.moveaxis(key_cache[:, 1], 1, 0)
  if layout in _SINGLE_TENSOR:
    if layout == "packed":
      d = key_cache.shape[-1] // 2
      key, value = key_cache[..., :d], key_cache[..., d:]
    else:
      key, value = (key_cache[(slice(None),) * (lead + 1) + (i,)] for i in (0, 1))
    if kv_layout == "HND":
      key, value = _permute(key, lead, (0, 2, 1, 3)), _permute(value, lead, (0, 2, 1, 3))
    return key, value
  if layout == "flash":
    return key_cache, value_cache
  if layout == "hnd":
    return _permute(key_cache, lead, (0, 2, 1, 3)), _permute(value_cache, lead, (0, 2, 1, 3))
  nb, h, d_over_x, bs, x = key_cache.shape[lead:]
  canonical = layers + (nb, bs, h, d_over_x * x)
  # [nb, H, D/x, bs, x] -> [nb, bs, H, D/x, x]
  key = _permute(key_cache, lead, (0, 3, 1, 2, 4)).reshape(canonical)
  if layout == "vllm":   # [nb, H, D, bs]
    return key, _permute(value_cache, lead, (0, 3, 1, 2))
  # asm: [nb, H, bs/x, D, x] -> [nb, bs/x, x, H, D]
  return key, _permute(value_cache, lead, (0, 2, 4, 1, 3)).reshape(canonical)


def _from_canonical(key, value, layout: str, kv_layout: str, lead: int):
  """Unvalidated :func:`from_canonical`."""
  layers = key.shape[:lead]
  nb, bs, h, d = key.shape[lead:]
  if layout == layout_lib.MAX:   # [L, nb, bs, H, D] each -> [nb, 2, L, bs, H, D]
    return jnp.transpose(jnp.stack([key, value]), (2, 0, 1, 3, 4, 5)), None
  if layout in _SINGLE_TENSOR:
    if kv_layout == "HND":
      key, value = _permute(key, lead, (0, 2, 1, 3)), _permute(value, lead, (0, 2, 1, 3))
    if layout == "packed":
      return jnp.concatenate([key, value], axis=-1), None
    return jnp.stack([key, value], axis=lead + 1), None
  if layout == "flash":
    return key, value
  if layout == "hnd":
    return _permute(key, lead, (0, 2, 1, 3)), _permute(value, lead, (0, 2, 1, 3))
  x = layout_lib.vector_width(key.dtype)
  # [nb, bs, H, D/x, x] -> [nb, H, D/x, bs, x]
  key_cache = _permute(key.reshape(layers + (nb, bs, h, d // x, x)), lead, (0, 2, 3, 1, 4))
  if layout == "vllm":   # -> [nb, H, D, bs]
    return key_cache, _permute(value, lead, (0, 2, 3, 1))
  # asm: [nb, bs/x, x, H, D] -> [nb, H, bs/x, D, x]
  value = value.reshape(layers + (nb, bs // x, x, h, d))
  return key_cache, _permute(value, lead, (0, 3, 1, 4, 2))


# The two halves of a transcode, each compiled once per (layout, shapes, dtype): an eager
# transcode is two dispatches (the canonical form in between); under an outer jit XLA fuses
# them into one copy.
@functools.partial(jax.jit, static_argnames=("layout", "kv_layout", "lead"))
def _canonical_of(key_cache, value_cache, block_index, *, layout, kv_layout, lead):
  """Validated caches of ``layout`` -> canonical (key, value); only the blocks of
  ``block_index`` (None, or int32 [n] from :func:`_block_index`) when given."""
  dtype = key_cache.dtype
  key_cache, value_cache = _as_bits(key_cache), _as_bits(value_cache)
  if block_index is not None:
    take = lambda cache: jnp.take(cache, block_index, axis=_block_axis(layout, lead),
                                  mode="fill", fill_value=0)
    key_cache = take(key_cache)
    value_cache = None if value_cache is None else take(value_cache)
  key, value = _to_canonical(key_cache, value_cache, layout, kv_layout, lead)
  return _from_bits(key, dtype), _from_bits(value, dtype)


@functools.partial(jax.jit, static_argnames=("layout", "kv_layout", "lead"))
def _layout_of(key, value, *, layout, kv_layout, lead):
  """Validated canonical (key, value) -> the caches of ``layout``."""
  key_cache, value_cache = _from_canonical(_as_bits(key), _as_bits(value), layout, kv_layout, lead)
  return _from_bits(key_cache, key.dtype), _from_bits(value_cache, key.dtype)


def to_canonical(key_cache, value_cache, layout: str, kv_layout: str = "NHD", *,
                 layer_axis: bool = False, backend: str = "auto"):
  """One layout's caches -> ``(key, value)``, each ``[nb, bs, H, D]`` of the caches' dtype.

  key_cache, value_cache: the arrays of ``layout`` (one of :data:`LAYOUTS`); value_cache
  is None for ``packed`` and ``paged5d``. ``layer_axis``: a leading ``num_layers`` axis on
  every array (kept: ``[L, nb, bs, H, D]``). Exact: no arithmetic.
  """
  backend_lib.jnp_only(backend)
  key_cache = jnp.asarray(key_cache)
  value_cache = None if value_cache is None else jnp.asarray(value_cache)
  lead = int(layer_axis)
  _cache_dims(key_cache, value_cache, layout, kv_layout, lead)
  return _canonical_of(key_cache, value_cache, None, layout=layout, kv_layout=kv_layout,
                       lead=lead)


def from_canonical(key, value, layout: str, kv_layout: str = "NHD", *, layer_axis: bool = False,
                   backend: str = "auto"):
  """``key``, ``value`` ``[nb, bs, H, D]`` (one dtype) -> ``(key_cache, value_cache)`` of
  ``layout``; value_cache is None for ``packed`` and ``paged5d``. ``layer_axis``: a leading
  ``num_layers`` axis (``[L, nb, bs, H, D]`` in, ``[L, ...]`` out). Exact: no arithmetic.
  ValueError when head_size (vllm, asm) or block_size (asm) is not a multiple of
  x = 16 // itemsize.
  """
  backend_lib.jnp_only(backend)
  key, value = jnp.asarray(key), jnp.asarray(value)
  lead = int(layer_axis)
  _check_canonical(key, value, lead)
  _check_destination(layout, kv_layout, *key.shape[lead:], key.dtype)
  _check_lead(layout, lead)
  return _layout_of(key, value, layout=layout, kv_layout=kv_layout, lead=lead)


def _block_index(block_ids, num_blocks: int):
  """block_ids int [n] -> int32 [n] in which every id < 0 (padding) or past the cache is
  ``num_blocks``, which ``jnp.take(mode="fill")`` reads as a zero block. Eagerly, ids >=
  num_blocks raise ValueError."""
  concrete = errors.is_concrete(block_ids)
  ids = np.asarray(block_ids) if concrete else block_ids
  errors.check_ndim("block_ids", ids, 1, "[num_selected_blocks]")
  errors.check_int("block_ids", ids)
  if concrete:
    bad = np.nonzero(ids >= num_blocks)[0]
    if bad.size:
      i = int(bad[0])
      raise ValueError(f"block_ids[{i}] = {int(ids[i])} is out of range: the cache has "
                       f"{num_blocks} blocks (valid: 0..{num_blocks - 1}, or < 0 for padding)")
    ids = np.maximum(ids, -1).astype(np.int32)   # no int64 wrap-around into int32
  ids = jnp.asarray(ids, jnp.int32)
  return jnp.where((ids >= 0) & (ids < num_blocks), ids, num_blocks)


def transcode(key_cache, value_cache, src_layout: str, dst_layout: str, *,
              src_kv_layout: str = "NHD", dst_kv_layout: str = "NHD", block_ids=None,
              layer_axis: bool = False, backend: str = "auto"):
  """Caches of ``src_layout`` -> ``(key_cache, value_cache)`` of ``dst_layout`` (value_cache
  None for ``packed`` / ``paged5d``), same dtype, bit for bit.

  Args:
    key_cache, value_cache: the source arrays (value_cache None for ``packed`` /
      ``paged5d``); a leading ``num_layers`` axis with ``layer_axis=True``.
    src_layout, dst_layout, src_kv_layout, dst_kv_layout: static; layouts are
      :data:`LAYOUTS`, kv_layout the storage of ``packed`` / ``paged5d``.
    block_ids: None (the whole cache), or int [n]: only these blocks, returned as an
      ``n``-block cache (``[n, ...]``, ``[L, n, ...]`` with layer_axis) in order. An id < 0
      is padding and gives a zero block; ids >= num_blocks raise ValueError eagerly and
      give zero blocks under jit.
  jit-able with the layouts and ``layer_axis`` static; ``block_ids`` may be traced.
  """
  backend_lib.jnp_only(backend)
  key_cache = jnp.asarray(key_cache)
  value_cache = None if value_cache is None else jnp.asarray(value_cache)
  lead = int(layer_axis)
  num_blocks, block_size, heads, head_size = _cache_dims(key_cache, value_cache, src_layout,
                                                         src_kv_layout, lead)
  _check_destination(dst_layout, dst_kv_layout, num_blocks, block_size, heads, head_size,
                     key_cache.dtype)
  _check_lead(dst_layout, lead)
  block_index = None if block_ids is None else _block_index(block_ids, num_blocks)
  key, value = _canonical_of(key_cache, value_cache, block_index, layout=src_layout,
                             kv_layout=src_kv_layout, lead=lead)
  return _layout_of(key, value, layout=dst_layout, kv_layout=dst_kv_layout, lead=lead)


def transcode_paged_kv_cache(cache: PagedKVCache, layout: str, kv_layout: str = "NHD", *,
                             backend: str = "auto") -> PagedKVCache:
  """The same cache in ``layout`` (one of :data:`jkv.layout.LAYOUTS`, or ``"max"``: Mojo
  MAX's all-layers collection) / ``kv_layout``.

  Scales are per tensor / head (``tensor``), per (block, head, offset) (``token``) or per
  (scale block, head) (``block``): none depends on the storage layout, so they are kept
  as they are and ``gather`` reads the same values. FP4 caches (``mxfp4`` / ``nvfp4``)
  exist in layout ``hnd`` only: NotImplementedError.

  >>> import jax.numpy as jnp, jkv
  >>> cache = jkv.PagedKVCache.create(4, 16, 2, 64, layout="flash", dtype=jnp.bfloat16)
  >>> key = jnp.ones((1, 2, 64), jnp.bfloat16)
  >>> cache = cache.write(0, key, key, jnp.array([17]))
  >>> vllm = jkv.transcode_paged_kv_cache(cache, "vllm")
  >>> vllm.key_cache.shape, float(vllm.value_cache[0, 1, 0, 0, 1])   # [L, nb, H, D, bs]
  ((1, 4, 2, 8, 16, 8), 1.0)
  """
  backend_lib.jnp_only(backend)
  if not isinstance(cache, PagedKVCache):
    raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
  if cache.quant in fp4.FORMATS:
    raise NotImplementedError(f"transcode_paged_kv_cache: quant={cache.quant!r} caches are "
                              "stored in layout 'hnd' only")
  if layout_lib.MAX in (layout, cache.layout) and cache.quant != "tensor":
    raise NotImplementedError(f"transcode_paged_kv_cache: to or from a MAX collection, plain or "
                              f"per-tensor FP8 caches only, not quant={cache.quant!r}")
  if layout == layout_lib.MAX:
    _check_layout(layout, kv_layout)
  else:
    layout_lib.check_layout(layout, kv_layout)
  # kv_layout only orders a packed cache; a 'flash' cache created with "HND" is NHD storage.
  src_kv_layout = cache.kv_layout if cache.layout == "packed" else "NHD"
  key_cache, value_cache = transcode(cache.key_cache, cache.value_cache, cache.layout, layout,
                                     src_kv_layout=src_kv_layout, dst_kv_layout=kv_layout,
                                     layer_axis=True, backend=backend)
  return cache.replace(key_cache=key_cache, value_cache=value_cache, layout=layout,
                       kv_layout=kv_layout)
