"""Whole-block copies: ``copy_blocks`` (within caches) and ``swap_blocks`` (between caches,
across device and ``pinned_host`` memory).

Semantics in :mod:`jkv.reference.blocks`; the Pallas kernel in :mod:`pallas_kernels.blocks`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jkv import backend as backend_lib
from jkv import errors, partitioning
from jkv.ops.write import as_cache
from jkv.reference import blocks as reference
from pallas_kernels import blocks as kernels

MIN_BUCKET = 16


def check_mapping(block_mapping):
  """block_mapping int [N, 2] (numpy or JAX), checked: rank, integer dtype, int32 range."""
  if not isinstance(block_mapping, jax.Array):   # numpy stays numpy (padded on the host)
    try:
      block_mapping = np.asarray(block_mapping)
    except ValueError:   # numpy: a ragged list of pairs
      raise ValueError("block_mapping must be [num_pairs, 2] (pairs of two block ids), got a "
                       "ragged sequence (rows of different lengths)") from None
    if block_mapping.dtype == object:
      raise ValueError("block_mapping holds integers that do not fit in int64")
    errors.fits_int32("block_mapping", block_mapping)   # (int64 would wrap in jnp.asarray)
  if block_mapping.size == 0:   # [], np.array([]), jnp.zeros((0,)): no pairs this step
    return np.zeros((0, 2), np.int32)
  errors.check_ndim("block_mapping", block_mapping, 2, "[num_pairs, 2]")
  errors.check_int("block_mapping", block_mapping)
  if block_mapping.shape[1] != 2:
    raise ValueError(f"block_mapping must be [num_pairs, 2], got shape "
                     f"{tuple(block_mapping.shape)}")
  return block_mapping


def check_pairs_within_shards(block_mapping, src_shard_blocks: int, dst_shard_blocks: int,
                              dp: int) -> None:
  """Eagerly: every live pair has its source and destination in one dp page shard."""
  if dp == 1 or not errors.is_concrete(block_mapping):
    return
  pairs = np.asarray(block_mapping).astype(np.int64)
  live = (pairs >= 0).all(axis=1)
  src_shard, dst_shard = pairs[:, 0] // src_shard_blocks, pairs[:, 1] // dst_shard_blocks
  crossing = np.nonzero(live & (src_shard != dst_shard))[0]
  if crossing.size:
    i = int(crossing[0])
    raise ValueError(f"block_mapping[{i}] = ({pairs[i, 0]}, {pairs[i, 1]}) crosses data-parallel "
                     f"page shards: the source block is in shard {src_shard[i]}, the "
                     f"destination in shard {dst_shard[i]} (each of the {dp} dp shards holds "
                     f"{src_shard_blocks} source and {dst_shard_blocks} destination blocks); "
                     f"pairs must stay inside one shard, as a pool per dp shard gives them")


def _check_sharded_pairs(block_mapping, src, dst, block_axis: int) -> None:
  """Eagerly, for concrete caches whose block axis is split over devices (the kernels run
  per page shard): every live pair stays inside one shard."""
  if not (errors.is_concrete(src) and errors.is_concrete(dst)):
    return
  num_src, num_dst = src.shape[block_axis], dst.shape[block_axis]
  if num_src == 0 or num_dst == 0:   # (no pair is in range)
    return
  shards = num_src // src.sharding.shard_shape(src.shape)[block_axis]
  check_pairs_within_shards(block_mapping, num_src // shards, num_dst // shards, shards)


def _on_device(src, dst) -> bool:
  """Both arrays in device memory (swaps with a host side have no per-shard rule)."""
  return reference.DEVICE == jax.typeof(src).memory_space == jax.typeof(dst).memory_space


def _check_not_bool(arrays):
  """TypeError for a bool array: the kernels move bytes through bit casts, which bool has
  not (store flags as uint8)."""
  for a in arrays:
    if a.dtype == jnp.bool_:
      raise TypeError("block copies move numeric arrays (any float, integer or FP8 dtype); "
                      "got a bool array: store it as uint8")


def _check_block_axis(block_axis: int, arrays, names):
  for name, a in zip(names, arrays):
    if not 0 <= block_axis < a.ndim:
      raise ValueError(f"block_axis {block_axis} is not an axis of {name} "
                       f"(shape {tuple(a.shape)})")


def copy_blocks(key_caches, value_caches, block_mapping, *, block_axis: int = 0,
                backend: str = "auto"):
  """vLLM / AITER ``copy_blocks``: for every layer and ``(src, dst)`` pair of
  ``block_mapping`` int [N, 2], ``cache[dst] = cache[src]`` (K and V), every layer and
  array in one kernel (two launches: the staging of sources that are also destinations,
  then the copy).

  key_caches, value_caches: lists of arrays (one per layer; any layout, a numeric dtype)
  whose axis ``block_axis`` indexes blocks (1 for layer-stacked [L, nb, ...] arrays; scale
  arrays with a block axis may be passed along). value_caches may be None (packed / MLA
  caches). Every source is read before any destination is written: pairs whose source is
  also a destination go through a staging buffer (one block per such pair and array;
  the buffer is sized for all N pairs). Negative pairs are skipped; of pairs with one
  destination the last wins. In place when the caller donates the caches. Caches paged
  over devices (block axis sharded): the kernel runs per page shard, also under a plain
  jit; a pair must stay inside one shard (ValueError eagerly; skipped under jit).
  Returns ``(key_caches, value_caches)`` as lists.

  >>> import jax.numpy as jnp, jkv
  >>> key_cache = jnp.arange(4.0)[:, None, None, None] * jnp.ones((4, 16, 2, 8))
  >>> value_cache = -key_cache                      # flash [nb, bs, H, D], one layer
  >>> keys, values = jkv.copy_blocks([key_cache], [value_cache], jnp.array([[1, 3]]))
  >>> float(keys[0][3, 0, 0, 0]), float(values[0][3, 0, 0, 0])     # block 3 <- block 1
  (1.0, -1.0)
  """
  for name, caches in (("key_caches", key_caches), ("value_caches", value_caches)):
    if caches is not None and not isinstance(caches, (list, tuple)):
      raise TypeError(f"{name} must be a list of per-layer arrays, got "
                      f"{type(caches).__name__}")
  key_caches = [as_cache("key_caches", c) for c in key_caches]
  value_caches = (None if value_caches is None
                  else [as_cache("value_caches", c) for c in value_caches])
  block_mapping = jnp.asarray(check_mapping(block_mapping))
  caches = key_caches + (value_caches or [])
  if not caches:
    raise ValueError("copy_blocks needs at least one cache")
  _check_not_bool(caches)
  _check_block_axis(block_axis, caches, [f"cache {i}" for i in range(len(caches))])
  num_blocks = caches[0].shape[block_axis]
  num_layers = math.prod(caches[0].shape[:block_axis])
  for i, c in enumerate(caches):
    if c.shape[block_axis] != num_blocks or math.prod(c.shape[:block_axis]) != num_layers:
      raise ValueError(f"every cache must have shape {tuple(caches[0].shape[:block_axis + 1])} "
                       f"up to the block axis {block_axis}, array {i} has shape "
                       f"{tuple(c.shape)}")
  errors.check_pairs_in_range("block_mapping", block_mapping, num_blocks)
  _check_sharded_pairs(block_mapping, caches[0], caches[0], block_axis)
  backend = backend_lib.resolve(backend)
  if block_mapping.shape[0] == 0 or num_blocks == 0:   # nothing to copy (the kernel needs
    out = caches                                        # a pair and a block)
  elif backend == "reference":
    out = reference.copy_blocks(caches, block_mapping, block_axis=block_axis)
  else:
    def kernel(*arrays):   # one page shard's (plain jit, sharded caches)
      local, mapping = arrays[:-1], arrays[-1]
      shape = local[0].shape
      return _copy_blocks_kernel(local, mapping, math.prod(shape[:block_axis]),
                                 shape[block_axis], interpret=backend == "interpret")

    # Under a plain jit on caches paged over devices: per page shard, pairs localised.
    out = list(partitioning.per_shard(
        kernel, tuple(caches) + (block_mapping,),
        (partitioning.Cache(block_axis, None, elementwise=True),) * len(caches)
        + (partitioning.BLOCK_MAPPING,)))
  k = out[:len(key_caches)]
  return k, (None if value_caches is None else out[len(key_caches):])


def _copy_blocks_kernel(caches, block_mapping, num_layers, num_blocks, *, interpret, chunk=None):
  """Two launches of the block copy kernel: stage the sources that are also destinations,
  then copy every pair (staged ones from the staging buffer). The second launch reads
  the staging buffer, so it runs after the first (no copy of the caches is needed to
  keep the first launch's reads intact)."""
  src, dst = reference.live_pairs(block_mapping, num_blocks)
  num_pairs = src.shape[0]
  is_dst = jnp.zeros((num_blocks + 1,), bool).at[jnp.where(dst >= 0, dst, num_blocks)].set(True)
  staged = (dst >= 0) & is_dst[src]
  views = [kernels.copyable_view(c, num_layers * num_blocks) for c in caches]
  cache_rows = kernels.Rows(layer_stride=num_blocks, index_stride=1)
  staging_rows = kernels.Rows(layer_stride=1, index_stride=num_layers)
  pair = jnp.arange(num_pairs, dtype=jnp.int32)
  copy = functools.partial(kernels.copy_rows, num_layers=num_layers, interpret=interpret,
                           chunk=chunk)
  staging = copy(views, None, src, jnp.where(staged, pair, -1), src_rows=cache_rows,
                 dst_rows=staging_rows, fresh_rows=num_pairs * num_layers)
  views = copy(None, views, src, dst, src_rows=cache_rows, dst_rows=cache_rows,
               staged=staging, staged_rows=staging_rows, use_staged=staged)
  return [kernels.restore(v, c.shape, c.dtype) for v, c in zip(views, caches)]


def bucket_size(num_pairs: int) -> int:
  """Pair counts are padded to a power of two (at least 16), so that varying counts
  compile a handful of programs, not one per count."""
  return max(MIN_BUCKET, 1 << max(0, num_pairs - 1).bit_length())


def swap_blocks(src, dst, block_mapping, *, block_axis: int = 0, backend: str = "auto"):
  """vLLM / AITER ``swap_blocks``: ``dst[d] = src[s]`` for every ``(s, d)`` pair of
  ``block_mapping`` int [N, 2] (a numpy or JAX array); ``src`` is not modified.

  src, dst: arrays of one dtype (any, incl. FP8 and byte caches) whose shapes agree
    except on the block axis ``block_axis`` (1 for layer-stacked [L, nb, ...] caches);
    each in device or ``pinned_host`` memory (every direction: device->device,
    device->host, host->device, host->host). The result is in ``dst``'s memory.
  Negative pairs are skipped; of pairs with one destination the last wins. Device
  caches paged over devices: the kernel runs per page shard, also under a plain jit; a
  pair must stay inside one shard (ValueError eagerly; skipped under jit).

  Called eagerly, ``dst`` is donated (updated in place; do not use it afterwards) and a
  concrete ``block_mapping`` is padded to :func:`bucket_size` pairs. A host ``dst`` that
  was read with ``np.asarray`` keeps a zero-copy numpy view and cannot be donated (JAX
  raises "Donation requested for buffer with external reference"): read a copy instead. Under jit, donate
  ``dst`` yourself. On the GPU the kernel reads and writes host memory directly (no
  staging copy of either cache).

  >>> import jax.numpy as jnp, jkv
  >>> src = jnp.arange(4.0)[:, None] * jnp.ones((4, 8))   # blocks of 8 values
  >>> dst = jnp.zeros((2, 8))
  >>> dst = jkv.swap_blocks(src, dst, jnp.array([[3, 0], [1, 1]]))
  >>> dst[:, 0]
  Array([3., 1.], dtype=float32)
  """
  block_mapping = check_mapping(block_mapping)
  for name, array in (("src", src), ("dst", dst)):
    if not isinstance(array, jax.Array):
      raise TypeError(f"{name} must be a JAX array (device or pinned_host memory), got "
                      f"{type(array).__name__}")
  _check_block_axis(block_axis, (src, dst), ("src", "dst"))
  if src.dtype != dst.dtype:
    raise TypeError(f"src and dst must have one dtype, got {src.dtype} and {dst.dtype}")
  _check_not_bool((src,))
  if src is dst:
    raise ValueError("src and dst are one array (swap_blocks writes dst in place, so it "
                     "cannot also be read): use copy_blocks to move blocks inside a cache")
  other = lambda shape: shape[:block_axis] + shape[block_axis + 1:]
  if other(src.shape) != other(dst.shape):
    raise ValueError(f"src and dst shapes must agree except on block axis {block_axis}, got "
                     f"{tuple(src.shape)} and {tuple(dst.shape)}")
  errors.check_pairs_in_range("block_mapping", block_mapping, src.shape[block_axis],
                              dst.shape[block_axis])
  if _on_device(src, dst):
    _check_sharded_pairs(block_mapping, src, dst, block_axis)
  backend = backend_lib.resolve(backend)
  if 0 in (block_mapping.shape[0], src.shape[block_axis], dst.shape[block_axis]):
    return dst   # nothing to move (the kernel needs a pair and a block on each side)
  if not errors.is_concrete(dst):
    return _swap(src, dst, jnp.asarray(block_mapping), block_axis, backend)
  if errors.is_concrete(block_mapping):
    # Padded on the host and handed to the jitted call as numpy (jnp.asarray first would
    # cost a separate ~0.2 ms transfer on a GPU).
    mapping = np.asarray(block_mapping, np.int64)
    padded = np.full((bucket_size(mapping.shape[0]), 2), -1, np.int32)
    padded[:mapping.shape[0]] = mapping
    block_mapping = padded
  return _eager_swap(dst.sharding, block_axis, backend)(src, dst, block_mapping)


@functools.lru_cache(maxsize=None)
def _eager_swap(dst_sharding, block_axis, backend):
  return jax.jit(functools.partial(_swap, block_axis=block_axis, backend=backend),
                 donate_argnums=1, out_shardings=dst_sharding)


def _swap(src, dst, block_mapping, block_axis, backend):
  if backend == "reference":
    return reference.swap_blocks(src, dst, block_mapping, block_axis=block_axis)
  dst_space = jax.typeof(dst).memory_space
  if backend == "interpret":   # the interpreter cannot address host memory
    src, dst = (jax.device_put(x, reference.DEVICE)
                if jax.typeof(x).memory_space != reference.DEVICE else x for x in (src, dst))

  def kernel(src, dst, block_mapping):   # one page shard's (plain jit, sharded caches)
    num_layers = math.prod(src.shape[:block_axis])
    num_src, num_dst = src.shape[block_axis], dst.shape[block_axis]
    s, d = reference.live_pairs(block_mapping, num_src, num_dst)
    (out,) = kernels.copy_rows(
        [kernels.copyable_view(src, num_layers * num_src)],
        [kernels.copyable_view(dst, num_layers * num_dst)], s, d, num_layers=num_layers,
        src_rows=kernels.Rows(num_src, 1), dst_rows=kernels.Rows(num_dst, 1),
        interpret=backend == "interpret")
    return (kernels.restore(out, dst.shape, dst.dtype),)

  if _on_device(src, dst):
    # Device caches under a plain jit, paged over devices: per page shard (host memory
    # has no partitioning rule; use jkv.sharded_swap_blocks for sharded host tiers).
    (out,) = partitioning.per_shard(
        kernel, (src, dst, block_mapping),
        (partitioning.Cache(block_axis, None, written=False, elementwise=True),
         partitioning.Cache(block_axis, None, elementwise=True), partitioning.BLOCK_MAPPING))
  else:
    (out,) = kernel(src, dst, block_mapping)
  if jax.typeof(out).memory_space != dst_space:
    out = jax.device_put(out, dst_space)
  return out
