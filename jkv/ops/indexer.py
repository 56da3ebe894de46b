"""DeepSeek-V3.2 indexer cache: ``indexer_k_quant_and_cache`` and
``cp_gather_indexer_k_quant_cache`` (AITER / vLLM names and argument order).

Functional: they return the updated cache / destination buffers (in place when donated).
Byte layout and quantization: :mod:`jkv.reference.indexer`; kernels:
:mod:`pallas_kernels.indexer` (the cache, or ``dst_k`` / ``dst_scale``, aliased to the
outputs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jkv import backend as backend_lib
from jkv import errors, formats, fp4, pages, partitioning
from jkv.ops.write import layer_index
from jkv.reference import indexer as reference
from jkv.reference.write import block_offset
from pallas_kernels import indexer as kernels

SCALE_FMTS = ("ue8m0", "float32")


def _check_cache(kv_cache, head_dim: int, quant_block_size: int, layer):
  if quant_block_size <= 0 or head_dim % quant_block_size:
    raise ValueError(f"quant_block_size must divide head_dim = k.shape[1] = {head_dim}, got "
                     f"{quant_block_size}")
  ndim = 3 if layer is None else 4
  errors.check_ndim("kv_cache", kv_cache, ndim,
                    "[num_blocks, block_size, stride]" if layer is None
                    else "[num_layers, num_blocks, block_size, stride]")
  if kv_cache.dtype != jnp.uint8:
    raise TypeError(f"kv_cache must be uint8 bytes, got dtype {kv_cache.dtype}")
  stride = formats.indexer_stride(head_dim, quant_block_size)
  if kv_cache.shape[-1] != stride:
    raise ValueError(f"kv_cache's last dim must be head_dim + head_dim // quant_block_size * 4 "
                     f"= {stride}, got shape {tuple(kv_cache.shape)}")
  return kv_cache.shape[-3], kv_cache.shape[-2]


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size=128, scale_fmt="ue8m0",
                              *, layer=None, backend: str = "auto"):
  """Quantizes indexer keys to FP8 per ``quant_block_size`` group and writes values and
  float32 scales into the byte cache.

  Args:
    k: [T, head_dim] float.
    kv_cache: uint8 [NB, bs, head_dim + head_dim // quant_block_size * 4] (with a leading
      num_layers dim when ``layer`` is given).
    slot_mapping: int [T]; < 0 skipped; past the cache: ValueError eagerly, dropped under jit.
    quant_block_size: values per scale (divides head_dim).
    scale_fmt: "ue8m0" (scales rounded up to powers of two) or "float32" (plain).
    layer: None, or an int (may be traced) into the leading num_layers dim.
  Returns the updated kv_cache.

  >>> import jax, jax.numpy as jnp, jkv
  >>> kv_cache = jnp.zeros((4, 16, 128 + 4), jnp.uint8)   # [nb, bs, head_dim + G * 4], G = 1
  >>> kv_cache = jkv.indexer_k_quant_and_cache(jnp.full((1, 128), 4.48), kv_cache,
  ...                                          jnp.array([17]), scale_fmt="float32")
  >>> block = kv_cache[1].reshape(-1)       # values of its 16 tokens, then their scales
  >>> scale = jax.lax.bitcast_convert_type(block[16 * 128 + 4:16 * 128 + 8], jnp.float32)
  >>> round(float(scale), 4)                # token 1's scale: amax / 448
  0.01
  """
  k, slot_mapping = jnp.asarray(k), errors.int_array("slot_mapping", slot_mapping)
  errors.check_ndim("k", k, 2, "[num_tokens, head_dim]")
  errors.check_float("k", k)
  errors.check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
  errors.check_int("slot_mapping", slot_mapping)
  if slot_mapping.shape[0] != k.shape[0]:
    raise ValueError(f"slot_mapping must have {k.shape[0]} entries (one per token), got "
                     f"{slot_mapping.shape[0]}")
  if scale_fmt not in SCALE_FMTS:
    raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got {scale_fmt!r}")
  num_blocks, block_size = _check_cache(kv_cache, k.shape[1], quant_block_size, layer)
  errors.check_slots_in_range("slot_mapping", slot_mapping, num_blocks * block_size,
                              f"a cache of {num_blocks} blocks x {block_size}")
  layer, slot_mapping = layer_index(layer, kv_cache, slot_mapping)
  chosen = backend_lib.resolve(backend)
  if chosen == "reference":
    return reference.indexer_k_quant_and_cache(k, kv_cache, slot_mapping,
                                               quant_block_size=quant_block_size,
                                               scale_fmt=scale_fmt, layer=layer)
  if k.shape[0] == 0:
    return kv_cache

  def kernel(k, slot_mapping, kv_cache, *layer):   # one page shard's (plain jit, sharded)
    return (kernels.quant_write(k, kv_cache, slot_mapping, layer[0] if layer else None,
                                quant_block_size=quant_block_size, scale_fmt=scale_fmt,
                                interpret=chosen == "interpret"),)

  lead = 0 if layer is None else 1
  (kv_cache,) = partitioning.per_shard(
      kernel, (k, slot_mapping, kv_cache) + (() if layer is None else (layer,)),
      (partitioning.TOKENS, partitioning.SLOTS, partitioning.Cache(lead, None))
      + (partitioning.REPLICATED,) * lead, block_size=block_size)
  return kv_cache


def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, *,
                                    layer=None, backend: str = "auto"):
  """Gathers the FP8 values and scales of sequences back to contiguous rows (a byte copy,
  no dequantization).

  Args:
    kv_cache: the indexer byte cache (see :func:`indexer_k_quant_and_cache`).
    dst_k: uint8 or float8_e4m3fn [T, head_dim]; dst_scale: float32 [T, G] or uint8
      [T, 4 G] (vLLM's bytes); G = head_dim / quant_block_size gives the group size.
    block_table: int [batch, max_blocks]; cu_seq_lens: int [batch + 1] (row t belongs to
      the sequence b with cu_seq_lens[b] <= t < cu_seq_lens[b + 1]).
  Returns ``(dst_k, dst_scale)``: rows t >= cu_seq_lens[-1] keep their values. Eagerly,
  rows past dst, a sequence longer than its table row and a negative block id a sequence
  reads raise ValueError; under jit such rows keep dst's values (rows past dst: dropped).

  >>> import jax.numpy as jnp, jkv
  >>> kv_cache = jnp.zeros((4, 16, 128 + 4), jnp.uint8)   # FP8 values + one float32 scale
  >>> k = jnp.full((2, 128), 4.48)
  >>> kv_cache = jkv.indexer_k_quant_and_cache(k, kv_cache, jnp.array([0, 17]),
  ...                                          scale_fmt="float32")
  >>> dst_k, dst_scale = jnp.zeros((20, 128), jnp.uint8), jnp.zeros((20, 1))
  >>> dst_k, dst_scale = jkv.cp_gather_indexer_k_quant_cache(
  ...     kv_cache, dst_k, dst_scale, jnp.array([[0, 1]]), jnp.array([0, 18]))
  >>> round(float(dst_scale[17, 0]), 4)       # amax / 448
  0.01
  """
  dst_k, dst_scale = jnp.asarray(dst_k), jnp.asarray(dst_scale)
  block_table = errors.int_array("block_table", block_table)
  cu_seq_lens = errors.int_array("cu_seq_lens", cu_seq_lens)
  errors.check_ndim("dst_k", dst_k, 2, "[num_tokens, head_dim]")
  if np.dtype(dst_k.dtype) not in (np.dtype(jnp.uint8), np.dtype(jnp.float8_e4m3fn)):
    raise TypeError(f"dst_k must be uint8 or float8_e4m3fn, got dtype {dst_k.dtype}")
  errors.check_ndim("dst_scale", dst_scale, 2, "[num_tokens, groups]")
  num_tokens, head_dim = dst_k.shape
  if dst_scale.dtype == jnp.float32:
    groups = dst_scale.shape[1]
  elif dst_scale.dtype == jnp.uint8 and dst_scale.shape[1] % 4 == 0:
    groups = dst_scale.shape[1] // 4
  else:
    raise TypeError(f"dst_scale must be float32 [T, G] or uint8 [T, 4 G], got "
                    f"{dst_scale.dtype} {tuple(dst_scale.shape)}")
  if dst_scale.shape[0] != num_tokens or groups == 0 or head_dim % groups:
    raise ValueError(f"dst_scale must have {num_tokens} rows and a group count dividing "
                     f"head_dim={head_dim}, got shape {tuple(dst_scale.shape)}")
  errors.check_ndim("block_table", block_table, 2, "[batch, max_blocks]")
  errors.check_int("block_table", block_table)
  errors.check_shape("cu_seq_lens", cu_seq_lens, (block_table.shape[0] + 1,))
  cu_seq_lens = pages.check_indptr("cu_seq_lens", cu_seq_lens)   # eagerly >= 0, non-decreasing
  num_blocks, block_size = _check_cache(kv_cache, head_dim, head_dim // groups, layer)
  if errors.is_concrete(block_table):
    bad = np.argwhere(np.asarray(block_table) >= num_blocks)
    if bad.size:
      i, j = (int(v) for v in bad[0])
      raise ValueError(f"block_table[{i}, {j}] = {int(np.asarray(block_table)[i, j])} is out "
                       f"of range: the cache has {num_blocks} blocks")
  if errors.is_concrete(block_table) and errors.is_concrete(cu_seq_lens):
    _check_gather_rows(np.asarray(block_table), np.asarray(cu_seq_lens), num_tokens, block_size)
  if layer is not None:   # a traced layer out of range gathers nothing
    errors.check_index("layer", layer, kv_cache.shape[0])
    layer = jnp.asarray(layer, jnp.int32)
  chosen = backend_lib.resolve(backend)
  if chosen != "reference":
    return _gather_kernel(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, layer,
                          interpret=chosen == "interpret")
  layer_ok = True
  if layer is not None:
    layer_ok = (layer >= 0) & (layer < kv_cache.shape[0])
    layer = jnp.clip(layer, 0, kv_cache.shape[0] - 1)
  new_k, new_scale = reference.cp_gather_indexer_k_quant_cache(
      kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, quant_block_size=head_dim // groups,
      layer=layer)
  return jnp.where(layer_ok, new_k, dst_k), jnp.where(layer_ok, new_scale, dst_scale)


def _check_gather_rows(block_table, cu_seq_lens, num_tokens: int, block_size: int) -> None:
  """Eagerly (numpy arrays): the gathered rows fit in dst, every sequence fits in its row of
  the block table, and no block id a sequence reads is negative (each would leave dst rows
  silently stale or drop them)."""
  if cu_seq_lens[-1] > num_tokens:
    raise ValueError(f"cu_seq_lens[-1] = {int(cu_seq_lens[-1])} rows do not fit in dst_k / "
                     f"dst_scale's {num_tokens} rows")
  lengths, width = np.diff(cu_seq_lens), block_table.shape[1]
  bad = np.nonzero(lengths > width * block_size)[0]
  if bad.size:
    b = int(bad[0])
    raise ValueError(f"sequence {b} has {int(lengths[b])} tokens (cu_seq_lens[{b + 1}] - "
                     f"cu_seq_lens[{b}]), more than block_table's {width} blocks of "
                     f"{block_size} tokens hold")
  used = np.arange(width)[None, :] * block_size < lengths[:, None]
  bad = np.argwhere(used & (block_table < 0))
  if bad.size:
    b, j = (int(v) for v in bad[0])
    raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is negative and "
                     f"sequence {b}'s {int(lengths[b])} tokens read it")


def _gather_kernel(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, layer, *,
                   interpret: bool):
  """The gather kernel; under a plain jit on a cache paged over devices, per page shard:
  each shard gathers the rows of its own blocks, and the rows are combined by a sum over
  the shards of their bits (each row is owned by one shard, or by none: it keeps dst's
  values). The collectives are of the destination's size, never of the cache's."""

  def kernel(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, *layer, block_axes):
    layer = layer[0] if layer else None
    new = kernels.gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, layer,
                         interpret=interpret)
    if block_axes is None:
      return new
    num_blocks, block_size = kv_cache.shape[-3:-1]
    _, _, mine = pages.gather_sources(block_table, cu_seq_lens, dst_k.shape[0],
                                          block_size, num_blocks)
    if layer is not None:
      mine &= (layer >= 0) & (layer < kv_cache.shape[0])
    owned = jax.lax.psum(mine.astype(jnp.int32), block_axes) > 0

    def combine(new, old):   # bit-exact: integer sums of one shard's bits and zeros
      bits = jnp.uint8 if new.dtype.itemsize == 1 else jnp.uint32
      rows = (slice(None),) + (None,) * (new.ndim - 1)
      summed = jax.lax.psum(jnp.where(mine[rows], jax.lax.bitcast_convert_type(new, bits), 0),
                            block_axes)
      return jnp.where(owned[rows], jax.lax.bitcast_convert_type(summed, new.dtype), old)

    return tuple(combine(n, o) for n, o in zip(new, (dst_k, dst_scale)))

  args = (kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)
  roles = (partitioning.Cache(kv_cache.ndim - 3, None), partitioning.REPLICATED,
           partitioning.REPLICATED, partitioning.BLOCK_TABLE, partitioning.REPLICATED)
  if layer is not None:
    args, roles = args + (layer,), roles + (partitioning.REPLICATED,)
  return partitioning.per_shard(kernel, args, roles, read=True, outputs="replicated")


def fp4_pool_write(k, keys, scales, global_scale, slot_mapping, *, layer,
                   backend: str = "auto"):
  """The DeepSeek-V4 pool's NVFP4 indexer write: each token's keys quantized in groups of 16
  with its slot's block global scale (E2M1 pairs packed per byte, E4M3 group scales).

  k [T, head_dim] float; keys uint8 [L, NB, bs, head_dim / 2]; scales float8_e4m3fn
  [L, NB, bs, head_dim / 16]; global_scale float32 [L, NB]; slot_mapping int [T] (< 0, and
  past the cache under jit: skipped; checked by the caller); layer int (may be traced).
  jnp code (XLA) on every back end: ``"pallas"`` / ``"interpret"`` raise
  ``NotImplementedError``. Its Pallas kernel was removed, slower than XLA's code (H100, 16K
  tokens: 23.8 vs 12.1 us, benchmarks/RESULTS.md). Returns ``(keys, scales)`` (in place
  when donated).
  """
  backend_lib.resolve(backend, kernel_supported=False)   # no kernel: auto runs the jnp code
  num_blocks, block_size = keys.shape[1:3]
  block, offset = block_offset(slot_mapping, block_size, num_blocks)
  g = global_scale[layer, jnp.minimum(block, num_blocks - 1)]
  packed, scale_bytes = jax.vmap(lambda x, s: fp4.quantize_groups(x, "nvfp4", s))(k, g)
  group_scales = jax.lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn)
  return (keys.at[layer, block, offset].set(packed, mode="drop"),
          scales.at[layer, block, offset].set(group_scales, mode="drop"))
