"""Quantized paged writes: AITER's per-token and per-block FP8 / INT8 ops, and FP4 caches.

Functional: each op returns the updated caches and scale arrays (in the order passed).
Semantics, scale layouts and the NaN / Inf policy: :mod:`jkv.reference.quant_write`
and :mod:`jkv.fp4`. Donate the caches and scales to the surrounding ``jax.jit``: the
Pallas kernels alias them, nothing is copied. FP4 caches have no kernel: they are written
through the reference (XLA).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jkv import backend as backend_lib
from jkv import errors, fp4, layout as layout_lib, partitioning, quant, segments as segments_lib
from jkv.ops import write as write_ops
from jkv.reference import quant_write as reference
from pallas_kernels import block_quant, token_quant

def _check_scales(name, scales, expected):
  scales = jnp.asarray(scales)
  if scales.dtype != jnp.float32:
    raise TypeError(f"{name} must be float32, got dtype {scales.dtype}")
  errors.check_shape(name, scales, expected)
  return scales


def write_quant_kv(key, value, key_cache, value_cache, k_scales, v_scales, slot_mapping, *,
                   granularity: str, layout: str, kv_layout: str = "NHD",
                   scales_block_major: bool = True, tokens_per_scale_block: int | None = None,
                   layer=None, backend: str = "auto"):
  """Per-token or per-block FP8 / INT8 write into a paged cache of any layout.

  Args:
    key, value: [T, H, D] float.
    key_cache, value_cache: float8_e4m3fn / float8_e4m3fnuz / float8_e5m2 / int8 caches
      of ``layout`` (value_cache None for ``packed``), with a leading num_layers dim
      when ``layer`` is given.
    k_scales, v_scales: float32. ``granularity="token"``: [nb, H, bs]
      (``scales_block_major``) or [H, nb * bs]. ``"block"``: [units, H] or [H, units],
      units = nb * bs / tokens_per_scale_block. Leading num_layers dim with ``layer``.
    slot_mapping: int [T'] (T' <= T); < 0 padding; >= nb * bs: ValueError eagerly,
      dropped under jit. Per block, of tokens with the same slot the last one wins. Per
      token a slot may appear once (ValueError eagerly; under jit a repeated slot's value
      and scale may come from different tokens on a GPU).
    tokens_per_scale_block: tokens sharing a block scale (``"block"`` only; default
      block_size; AITER's ``ori_block_size`` for the asm_pa variant).
  Returns:
    ``(key_cache, value_cache, k_scales, v_scales)`` (value_cache None for packed).

  >>> import jax.numpy as jnp, jkv
  >>> key_cache = value_cache = jnp.zeros((4, 16, 2, 64), jnp.int8)   # flash, int8
  >>> k_scales = v_scales = jnp.ones((4, 2, 16), jnp.float32)        # per token [nb, H, bs]
  >>> key = value = jnp.full((2, 2, 64), 0.5)
  >>> key_cache, value_cache, k_scales, v_scales = jkv.write_quant_kv(
  ...     key, value, key_cache, value_cache, k_scales, v_scales, jnp.array([0, 17]),
  ...     granularity="token", layout="flash")
  >>> int(key_cache[1, 1, 0, 0]), round(float(k_scales[1, 0, 1]) * 127, 4)   # 0.5 / scale
  (127, 0.5)
  """
  return _write_quant_kv(key, value, key_cache, value_cache, k_scales, v_scales, slot_mapping,
                         granularity=granularity, layout=layout, kv_layout=kv_layout,
                         scales_block_major=scales_block_major,
                         tokens_per_scale_block=tokens_per_scale_block, layer=layer,
                         backend=backend, scale_names=("k_scales", "v_scales"))


def _write_quant_kv(key, value, key_cache, value_cache, k_scales, v_scales, slot_mapping, *,
                    granularity, layout, kv_layout="NHD", scales_block_major=True,
                    tokens_per_scale_block=None, layer=None, backend="auto",
                    scale_names=("k_dequant_scales", "v_dequant_scales")):
  """:func:`write_quant_kv`; ``scale_names`` are the scale arguments' names in errors (the
  AITER wrappers call them ``k_dequant_scales`` / ``v_dequant_scales``)."""
  key, value, slot_mapping = write_ops.token_inputs(key, value, slot_mapping)
  if granularity not in ("token", "block"):
    raise ValueError(f"granularity must be 'token' or 'block', got {granularity!r}")
  if layout == layout_lib.MAX:
    if granularity != "token" or tokens_per_scale_block is not None or not scales_block_major:
      raise ValueError("a MAX collection (layout 'max') is quantized per token (granularity="
                       "'token', block-major scale collection); got granularity="
                       f"{granularity!r}, tokens_per_scale_block={tokens_per_scale_block}, "
                       f"scales_block_major={scales_block_major}")
    return _write_max_quant(key, value, key_cache, value_cache, k_scales, v_scales,
                            slot_mapping, kv_layout=kv_layout, layer=layer,
                            backend=backend, scale_names=scale_names)
  layout_lib.check_layout(layout, kv_layout)
  if tokens_per_scale_block is not None:
    if granularity == "token":
      raise ValueError(f"tokens_per_scale_block ({tokens_per_scale_block}) is for "
                       "granularity='block'; a per-token write has no scale blocks")
    errors.check_size("tokens_per_scale_block", tokens_per_scale_block)
  num_tokens, num_heads, head_size = key.shape
  lead = 0 if layer is None else 1
  key_cache = write_ops.as_cache("kv_cache" if value_cache is None else "key_cache", key_cache)
  value_cache = write_ops.as_cache("value_cache", value_cache)
  num_layers = key_cache.shape[:lead]
  quant.check_scaled_dtype("key_cache", key_cache.dtype)
  num_blocks, block_size, key_plane, value_plane = write_ops.check_caches(
      layout, kv_layout, key_cache, value_cache, lead, num_heads, head_size)
  capacity = num_blocks * block_size
  if granularity == "token":
    scale_shape = ((num_blocks, num_heads, block_size) if scales_block_major
                   else (num_heads, capacity))
  else:
    unit = tokens_per_scale_block or block_size
    if unit % block_size or capacity % unit:
      raise ValueError(f"tokens_per_scale_block {unit} must be a multiple of block_size "
                       f"{block_size} that divides the cache's {capacity} slots")
    units = capacity // unit
    scale_shape = (units, num_heads) if scales_block_major else (num_heads, units)
  k_scales = _check_scales(scale_names[0], k_scales, num_layers + scale_shape)
  v_scales = _check_scales(scale_names[1], v_scales, num_layers + scale_shape)
  errors.check_slots_in_range("slot_mapping", slot_mapping, capacity,
                              f"a cache of {num_blocks} blocks x {block_size}")
  if granularity == "token":
    _check_unique_slots(slot_mapping)
  layer, slot_mapping = write_ops.layer_index(layer, key_cache, slot_mapping)
  if num_tokens == 0:
    return key_cache, value_cache, k_scales, v_scales
  chosen = backend_lib.resolve(backend)
  if chosen == "reference" and granularity == "token":
    return reference.write_token_quant(
        key, value, key_cache, value_cache, k_scales, v_scales, slot_mapping, layout=layout,
        kv_layout=kv_layout, block_size=block_size, num_blocks=num_blocks,
        scales_block_major=scales_block_major, layer=layer)
  if chosen == "reference":
    return reference.write_block_quant(
        key, value, key_cache, value_cache, k_scales, v_scales, slot_mapping, layout=layout,
        kv_layout=kv_layout, block_size=block_size, num_blocks=num_blocks,
        tokens_per_scale_block=unit, scales_block_major=scales_block_major, layer=layer)

  def kernel(key, value, slot_mapping, layer, *arrays):   # on one shard's heads and blocks
    key_cache, value_cache = arrays[0], (arrays[1] if len(arrays) == 4 else None)
    num_blocks, block_size, key_plane, value_plane = write_ops.check_caches(
        layout, kv_layout, key_cache, value_cache, lead, key.shape[1], head_size)
    common = dict(key_plane=key_plane, value_plane=value_plane, num_blocks=num_blocks,
                  scales_block_major=scales_block_major, interpret=chosen == "interpret")
    if granularity == "token":
      out = token_quant.token_quant(key, value, key_cache, value_cache, *arrays[-2:],
                                    slot_mapping, layer, **common)
    else:
      segments = segments_lib.group_by_scale_block(slot_mapping, num_blocks * block_size, unit)
      out = block_quant.block_quant(key, value, key_cache, value_cache, *arrays[-2:],
                                    segments, layer, unit_size=unit, **common)
    return [a for a in out if a is not None]

  caches = (key_cache,) if value_cache is None else (key_cache, value_cache)
  cache = partitioning.Cache(lead, lead + layout_lib.heads_dim(layout, kv_layout))
  scales = partitioning.Cache(lead, lead + 1) if scales_block_major else \
      partitioning.Cache(lead + 1, lead)
  out = partitioning.per_shard(
      kernel, (key, value, slot_mapping, jnp.asarray(0 if layer is None else layer, jnp.int32))
      + caches + (k_scales, v_scales),
      (partitioning.TOKENS, partitioning.TOKENS, partitioning.SLOTS, partitioning.REPLICATED)
      + (cache,) * len(caches) + (scales, scales), block_size=block_size)
  if value_cache is None:
    return out[0], None, out[1], out[2]
  return tuple(out)


def _check_unique_slots(slot_mapping):
  """Eagerly (concrete slots): ValueError when a slot appears twice; a per-token quantized
  write needs each slot at most once (value and scale could come from different tokens)."""
  if errors.is_concrete(slot_mapping):
    slots = np.asarray(slot_mapping)
    slots = slots[slots >= 0]
    if np.unique(slots).size != slots.size:
      raise ValueError("slot_mapping has duplicate slots; per-token quantized writes need each "
                       "slot at most once (value and scale could come from different tokens)")


def check_max_scales(name, scales, collection_shape, other_name, other):
  """The scale collection of a per-token quantized MAX collection ``[nb, 2, L, bs, H, D]``:
  float32 ``[nb, 2, L, bs, H, G]`` with G dividing D (``other``, the V scales argument,
  must be None: the collection holds both). Returns it as a JAX array."""
  if other is not None:
    raise ValueError(f"a MAX collection's scale collection holds K and V scales: pass it as "
                     f"{name} and {other_name}=None")
  if scales is None:
    raise ValueError(f"a per-token quantized MAX collection needs its scale collection "
                     f"{name} [num_blocks, 2, num_layers, block_size, H, G]")
  scales = jnp.asarray(scales)
  head_size = collection_shape[-1]
  if (scales.ndim != 6 or tuple(scales.shape[:5]) != tuple(collection_shape[:5])
      or scales.shape[5] < 1 or head_size % scales.shape[5]):
    raise ValueError(f"{name} of a MAX collection {tuple(collection_shape)} must be "
                     f"[{', '.join(map(str, collection_shape[:5]))}, G] with G groups dividing "
                     f"head_size {head_size}, got shape {tuple(scales.shape)}")
  if scales.dtype != jnp.float32:
    raise TypeError(f"{name} must be float32, got dtype {scales.dtype}")
  return scales


def max_kernel_groups(head_size: int, groups: int) -> bool:
  """True when the Pallas kernels take a MAX collection's ``groups`` scale groups: groups
  of a power of two >= 16 head-dim elements (others run on the reference)."""
  group_size = head_size // groups
  return group_size >= 16 and group_size & (group_size - 1) == 0


def kernel_reads_format(fmt, head_size: int) -> bool:
  """False for a per-token quantized MAX collection whose scale groups the attention kernels
  do not take (:func:`max_kernel_groups`); True for every other format."""
  return not fmt.scale_collection or max_kernel_groups(head_size, fmt.scale_groups)


def _write_max_quant(key, value, collection, value_cache, scales, v_scales, slot_mapping,
                     *, kv_layout, layer, backend, scale_names):
  """:func:`write_quant_kv` into a MAX collection ``[nb, 2, L, bs, H, D]`` (FP8 / INT8)
  with its scale collection ``[nb, 2, L, bs, H, G]`` (passed as the K scales)."""
  num_tokens, num_heads, head_size = key.shape
  lead = write_ops.cache_lead(layout_lib.MAX, layer, "write")
  collection = write_ops.as_cache("kv_cache", collection)
  value_cache = write_ops.as_cache("value_cache", value_cache)
  quant.check_scaled_dtype("kv_cache", collection.dtype)
  num_blocks, block_size, key_plane, value_plane = write_ops.check_caches(
      layout_lib.MAX, kv_layout, collection, value_cache, lead, num_heads, head_size)
  scales = check_max_scales(scale_names[0], scales, collection.shape, scale_names[1], v_scales)
  num_layers, groups = collection.shape[2], scales.shape[5]
  capacity = num_blocks * block_size
  errors.check_slots_in_range("slot_mapping", slot_mapping, capacity,
                              f"a cache of {num_blocks} blocks x {block_size}")
  _check_unique_slots(slot_mapping)
  layer, slot_mapping = write_ops.layer_index(layer, collection, slot_mapping, num_layers)
  if num_tokens == 0:
    return collection, None, scales, None
  chosen = backend_lib.resolve(backend,
                               kernel_supported=max_kernel_groups(head_size, groups))
  if chosen == "reference":
    collection, scales = reference.write_max_token_quant(
        key, value, collection, scales, slot_mapping, block_size=block_size,
        num_blocks=num_blocks, layer=layer)
    return collection, None, scales, None

  def kernel(key, value, slot_mapping, layer, collection, scales):   # one shard's
    shard_blocks, _, key_plane, value_plane = write_ops.check_caches(
        layout_lib.MAX, kv_layout, collection, None, 0, key.shape[1], head_size)
    key_rows, value_rows = layout_lib.max_rows(num_layers)
    out = token_quant.token_quant(
        key, value, collection, None, scales, None, slot_mapping, layer,
        key_plane=key_plane, value_plane=value_plane, num_blocks=shard_blocks,
        scales_block_major=True, interpret=chosen == "interpret", key_rows=key_rows,
        value_rows=value_rows, scale_groups=groups)
    return out[0], out[2]

  role = partitioning.Cache(0, layout_lib.heads_dim(layout_lib.MAX, kv_layout))
  collection, scales = partitioning.per_shard(
      kernel, (key, value, slot_mapping, layer, collection, scales),
      (partitioning.TOKENS, partitioning.TOKENS, partitioning.SLOTS, partitioning.REPLICATED,
       role, role), block_size=block_size)
  return collection, None, scales, None


def reshape_and_cache_with_pertoken_quant(key, value, key_cache, value_cache, k_dequant_scales,
                                          v_dequant_scales, slot_mapping, asm_layout=False, *,
                                          backend="auto"):
  """AITER ``reshape_and_cache_with_pertoken_quant``.

  key, value [T, H, D]; key_cache [nb, H, D/16, bs, 16]; value_cache [nb, H, D, bs] or
  (``asm_layout``) [nb, H, bs/16, D, 16]; FP8 or INT8. Scales float32: [H, nb * bs], or
  [nb, H, bs] with ``asm_layout``. Returns ``(key_cache, value_cache, k_dequant_scales,
  v_dequant_scales)``.

  >>> import jax.numpy as jnp, jkv
  >>> key_cache = jnp.zeros((4, 2, 4, 16, 16), jnp.float8_e4m3fn)   # [nb, H, D / 16, bs, 16]
  >>> value_cache = jnp.zeros((4, 2, 64, 16), jnp.float8_e4m3fn)    # [nb, H, D, bs]
  >>> k_scales = v_scales = jnp.zeros((2, 4 * 16), jnp.float32)     # [H, nb * bs]
  >>> key = value = jnp.full((2, 2, 64), 3.0)
  >>> out = jkv.reshape_and_cache_with_pertoken_quant(key, value, key_cache, value_cache,
  ...                                                 k_scales, v_scales, jnp.array([0, 17]))
  >>> round(float(out[2][0, 17]) * 448, 4)    # the token's scale: amax / 448
  3.0
  """
  return _write_quant_kv(key, value, key_cache, value_cache, k_dequant_scales, v_dequant_scales,
                         slot_mapping, granularity="token", layout="asm" if asm_layout else "vllm",
                         scales_block_major=asm_layout, backend=backend)


def _flatten_batch(key, value):
  key, value = jnp.asarray(key), jnp.asarray(value)
  if key.ndim not in (3, 4):
    raise ValueError(f"key must be 4-D [batch, seq_len, num_heads, head_size] or 3-D "
                     f"[num_tokens, num_heads, head_size], got shape {tuple(key.shape)}")
  errors.check_shape("value", value, key.shape)
  if key.ndim == 4:   # AITER passes [batch, seq_len, H, D]
    key = key.reshape((-1,) + key.shape[2:])
    value = value.reshape((-1,) + value.shape[2:])
  return key, value


def reshape_and_cache_with_block_quant(key, value, key_cache, value_cache, k_dequant_scales,
                                       v_dequant_scales, slot_mapping, asm_layout=False, *,
                                       backend="auto"):
  """AITER ``reshape_and_cache_with_block_quant``: one scale per (block, head).

  key, value [batch, seq_len, H, D] (or [T, H, D]); caches as the per-token op; scales
  float32 [H, nb], or [nb, H] with ``asm_layout``. Returns ``(key_cache, value_cache,
  k_dequant_scales, v_dequant_scales)``.

  >>> import jax.numpy as jnp, jkv
  >>> key_cache = jnp.zeros((4, 2, 4, 16, 16), jnp.int8)   # [nb, H, D / 16, bs, 16]
  >>> value_cache = jnp.zeros((4, 2, 64, 16), jnp.int8)    # [nb, H, D, bs]
  >>> k_scales = v_scales = jnp.zeros((2, 4), jnp.float32)  # [H, nb]: one per block
  >>> key = value = jnp.full((2, 2, 64), 2.54)
  >>> out = jkv.reshape_and_cache_with_block_quant(key, value, key_cache, value_cache,
  ...                                              k_scales, v_scales, jnp.array([0, 1]))
  >>> round(float(out[2][0, 0]), 4)    # block 0's scale: amax / 127
  0.02
  """
  key, value = _flatten_batch(key, value)
  return _write_quant_kv(key, value, key_cache, value_cache, k_dequant_scales, v_dequant_scales,
                         slot_mapping, granularity="block", layout="asm" if asm_layout else "vllm",
                         scales_block_major=asm_layout, backend=backend)


def reshape_and_cache_with_block_quant_for_asm_pa(key, value, key_cache, value_cache,
                                                  k_dequant_scales, v_dequant_scales, slot_mapping,
                                                  asm_layout=True, ori_block_size=128, *,
                                                  backend="auto"):
  """AITER ``reshape_and_cache_with_block_quant_for_asm_pa``: one scale per
  ``ori_block_size`` (128 or 256) tokens and head, over physical blocks of block_size.

  Scales float32 [nb * bs / ori_block_size, H] with ``asm_layout``, else [H, ...].

  >>> import jax.numpy as jnp, jkv
  >>> key_cache = jnp.zeros((16, 2, 4, 16, 16), jnp.int8)         # [nb, H, D / 16, bs, 16]
  >>> value_cache = jnp.zeros((16, 2, 1, 64, 16), jnp.int8)       # asm [nb, H, bs / 16, D, 16]
  >>> k_scales = v_scales = jnp.zeros((2, 2), jnp.float32)        # [nb * bs / 128, H]
  >>> key = value = jnp.full((3, 2, 64), 1.27)
  >>> out = jkv.reshape_and_cache_with_block_quant_for_asm_pa(
  ...     key, value, key_cache, value_cache, k_scales, v_scales, jnp.array([0, 100, 200]))
  >>> [round(float(s), 4) for s in out[2][:, 0]]   # 128-token scale blocks 0 and 1
  [0.01, 0.01]
  """
  if ori_block_size not in (128, 256):
    raise ValueError(f"ori_block_size must be 128 or 256, got {ori_block_size}")
  key, value = _flatten_batch(key, value)
  return _write_quant_kv(key, value, key_cache, value_cache, k_dequant_scales, v_dequant_scales,
                         slot_mapping, granularity="block", layout="asm" if asm_layout else "vllm",
                         scales_block_major=asm_layout, tokens_per_scale_block=ori_block_size,
                         backend=backend)


def fp4_cache_shapes(num_blocks: int, block_size: int, num_heads: int, head_size: int,
                     fp4_format: str):
  """(data shape, scale shape) of one layer of an FP4 cache (K or V)."""
  for name, size in (("num_blocks", num_blocks), ("block_size", block_size),
                     ("num_heads", num_heads), ("head_size", head_size)):
    errors.check_size(name, size)
  fp4.check_format(fp4_format)
  group = fp4.GROUP_SIZE[fp4_format]
  if head_size % group:
    raise ValueError(f"head_size {head_size} must be a multiple of {group} for {fp4_format}")
  return ((num_blocks, num_heads, block_size, head_size // 2),
          (num_blocks, num_heads, block_size, head_size // group))


def reshape_and_cache_fp4(key, value, key_cache, value_cache, k_block_scales, v_block_scales,
                          slot_mapping, fp4_format="mxfp4", k_global_scale=None,
                          v_global_scale=None, *, layer=None, backend="auto"):
  """Writes key/value [T, H, D] into FP4 caches (:mod:`jkv.fp4`).

  key_cache, value_cache: uint8 [nb, H, bs, D/2] (two E2M1 values per byte).
  k_block_scales, v_block_scales: [nb, H, bs, D/G]: float8_e8m0fnu (mxfp4, G = 32) or
  float8_e4m3fn (nvfp4, G = 16). k/v_global_scale: float32 per-tensor scales (nvfp4;
  default 1.0). A leading num_layers dim on all four arrays when ``layer`` is given.
  Returns ``(key_cache, value_cache, k_block_scales, v_block_scales)``. Written through
  the jnp reference (XLA) on every back end (``"pallas"`` / ``"interpret"`` raise
  ``NotImplementedError``): the FP4 kernel was removed, slower than XLA's code (H100, 32K
  tokens: MXFP4 198 vs 181 us, NVFP4 240 vs 205 us, benchmarks/RESULTS.md).

  >>> import jax.numpy as jnp, jkv
  >>> data_shape, scale_shape = jkv.fp4_cache_shapes(4, 16, 2, 64, "mxfp4")
  >>> caches = [jnp.zeros(data_shape, jnp.uint8)] * 2             # [nb, H, bs, D / 2]
  >>> scales = [jnp.ones(scale_shape, jnp.float8_e8m0fnu)] * 2     # [nb, H, bs, D / 32]
  >>> key = value = jnp.full((2, 2, 64), 1.5)
  >>> key_cache, value_cache, k_scales, v_scales = jkv.reshape_and_cache_fp4(
  ...     key, value, *caches, *scales, jnp.array([0, 17]), "mxfp4")
  >>> key_cache.shape, key_cache.dtype    # two E2M1 values per byte
  ((4, 2, 16, 32), dtype('uint8'))
  """
  key, value, slot_mapping = write_ops.token_inputs(key, value, slot_mapping)
  num_tokens, num_heads, head_size = key.shape
  fp4.check_format(fp4_format)
  lead = 0 if layer is None else 1
  key_cache, value_cache, k_block_scales, v_block_scales = (
      write_ops.as_cache(name, array) for name, array in (
          ("key_cache", key_cache), ("value_cache", value_cache),
          ("k_block_scales", k_block_scales), ("v_block_scales", v_block_scales)))
  num_layers = key_cache.shape[:lead]
  if key_cache.ndim != 4 + lead:
    raise ValueError(f"key_cache must be {4 + lead}-D [{'L, ' if lead else ''}nb, H, bs, D/2], "
                     f"got shape {tuple(key_cache.shape)}")
  num_blocks, block_size = key_cache.shape[lead], key_cache.shape[lead + 2]
  data_shape, scale_shape = fp4_cache_shapes(num_blocks, block_size, num_heads, head_size,
                                             fp4_format)
  for name, array, shape, dtype in (
      ("key_cache", key_cache, data_shape, jnp.uint8),
      ("value_cache", value_cache, data_shape, jnp.uint8),
      ("k_block_scales", k_block_scales, scale_shape, fp4.SCALE_DTYPE[fp4_format]),
      ("v_block_scales", v_block_scales, scale_shape, fp4.SCALE_DTYPE[fp4_format])):
    errors.check_shape(name, array, num_layers + shape)
    if array.dtype != dtype:
      raise TypeError(f"{name} must have dtype {np.dtype(dtype).name} for {fp4_format}, got "
                      f"{np.dtype(array.dtype).name}")
  globals_ = []
  for scale, name in ((k_global_scale, "k_global_scale"), (v_global_scale, "v_global_scale")):
    if scale is not None and fp4_format != "nvfp4":
      raise ValueError(f"{name} is an nvfp4 scale; {fp4_format} has none (pass None), got "
                       f"{scale!r}")
    globals_.append(quant.normalize_scale(scale, 1, name))
    errors.check_scales_positive(name, globals_[-1])
  errors.check_slots_in_range("slot_mapping", slot_mapping, num_blocks * block_size,
                              f"a cache of {num_blocks} blocks x {block_size}")
  layer, slot_mapping = write_ops.layer_index(layer, key_cache, slot_mapping)
  if num_tokens == 0:
    return key_cache, value_cache, k_block_scales, v_block_scales
  backend_lib.resolve(backend, kernel_supported=False)   # no kernel: auto runs the reference
  return reference.write_fp4(
      key, value, key_cache, value_cache, k_block_scales, v_block_scales, slot_mapping,
      fp4_format=fp4_format, k_global_scale=globals_[0], v_global_scale=globals_[1],
      block_size=block_size, num_blocks=num_blocks, layer=layer)
