"""jkv's writes, decode attention and block copies / swaps under ``jax.shard_map``: each
device works on its own shard of a cache placed as :mod:`jkv.sharding` says (kv heads over
the tensor-parallel axis, pages over the data-parallel one). Same bytes as the unsharded
ops; eager checks run on the global arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jkv import errors, layout as layout_lib, quant
from jkv.cache import PagedKVCache
from jkv.ops import attention as attention_ops
from jkv.ops import blocks as blocks_ops
from jkv.ops import write as write_ops
from jkv.partitioning import localize_block_mapping, localize_slot_mapping
from jkv.sharding import axis_size, cache_partition_spec, check_mesh, kv_cache_partition_spec


def _check_tokens(key, value, num_heads: int):
  """key / value [T, num_heads, D] arrays (the global head count)."""
  key, value = jnp.asarray(key), jnp.asarray(value)
  errors.check_ndim("key", key, 3, "[num_tokens, num_heads, head_size]")
  errors.check_shape("value", value, key.shape)
  if key.shape[1] != num_heads:
    raise ValueError(f"key must have the cache's {num_heads} kv heads (dim 1), got shape "
                     f"{tuple(key.shape)}")
  return key, value


def _write_on_mesh(write_shard, mesh, args, arg_specs, key, value, slot_mapping, *, tp_axis,
                   dp_axis, shard_slots: int, split_tokens: bool = False):
  """``write_shard(*args, key, value, local_slots)`` under ``jax.shard_map``: key / value
  split over tp by heads, slot_mapping replicated (``split_tokens``: token rows split over
  dp too) and localised per page shard. Returns ``write_shard``'s result, sharded as
  ``arg_specs[0]``."""

  def shard(args, key, value, slot_mapping):
    if dp_axis is not None:
      slot_mapping = localize_slot_mapping(slot_mapping, jax.lax.axis_index(dp_axis),
                                           shard_slots)
    return write_shard(*args, key, value, slot_mapping)

  rows = dp_axis if split_tokens else None
  tokens = PartitionSpec(rows, tp_axis, None)
  in_specs = (arg_specs, tokens, tokens, PartitionSpec(rows))
  return _on_mesh(shard, mesh, in_specs, arg_specs[0], (args, key, value, slot_mapping))


def sharded_write(cache: PagedKVCache, layer, key, value, slot_mapping, mesh, *,
                  tp_axis="tp", dp_axis=None, split_tokens: bool = False,
                  backend: str = "auto") -> PagedKVCache:
  """:meth:`PagedKVCache.write` under ``jax.shard_map`` on ``mesh``: each device writes
  its kv heads (and, with ``dp_axis``, only the slots of its own pages) into its shard.

  cache: sharded as :func:`jkv.sharding.cache_sharding` says (shard it once with :func:`jkv.sharding.shard_cache`;
    other shardings are resharded by XLA, which costs copies of the cache).
  layer: int, may be traced. key, value: [T, H, D] with the cache's global H (split over
    tp here). slot_mapping: int [T'] global slots (< 0 padding), replicated.
  tp_axis, dp_axis: a mesh axis name, a tuple of names or None (static).
  split_tokens: with ``dp_axis``, the token rows (key, value, slot_mapping) are split over
    dp as well, so each device reads only its own rows: rows ``[i T / dp, (i + 1) T / dp)``
    must write pages of dp shard ``i`` (data-parallel serving: each shard's sequences
    and pages); a row's slot in another shard's pages is dropped. T must divide by dp.
    Without it every device scans every row and keeps the slots of its own pages.
  Eager value checks (layer and slot range) run here, on the global arrays; under jit an
  out-of-range slot is dropped, as in the unsharded write. Same bytes as the unsharded
  write, any layout and quant mode, every back end. Returns the cache, same sharding.
  Jitted inside (compiled once per configuration when called eagerly); inside the
  caller's jit it fuses like any op, and a donated cache is updated in place.

  >>> import jax, jax.numpy as jnp, jkv
  >>> mesh = jax.make_mesh((1, 1), ("dp", "tp"))     # e.g. (2, 4) over 8 devices
  >>> cache = jkv.shard_cache(jkv.PagedKVCache.create(8, 16, 2, 64, dtype=jnp.bfloat16),
  ...                         mesh, dp_axis="dp")
  >>> key = jnp.ones((2, 2, 64), jnp.bfloat16)
  >>> cache = jkv.sharded_write(cache, 0, key, key, jnp.array([0, 100]), mesh, dp_axis="dp")
  >>> float(cache.key_cache[0, 6, 4, 1, 0])       # slot 100: block 6, offset 4
  1.0
  """
  if not isinstance(cache, PagedKVCache):
    raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
  check_mesh(cache, cache_partition_spec(cache, tp_axis=tp_axis, dp_axis=dp_axis), mesh,
              tp_axis, dp_axis)
  key, value = _check_tokens(key, value, cache.num_heads)
  errors.check_index("layer", layer, cache.num_layers)
  errors.check_slots_in_range("slot_mapping", slot_mapping, cache.num_blocks * cache.block_size,
                              f"a cache of {cache.num_blocks} blocks x {cache.block_size}")
  slot_mapping = jnp.asarray(slot_mapping)
  split_tokens = bool(split_tokens and dp_axis is not None)
  if split_tokens and (slot_mapping.shape[0] != key.shape[0]
                       or key.shape[0] % axis_size(mesh, dp_axis)):
    raise ValueError(f"split_tokens needs key rows == slot_mapping entries, divisible by the "
                     f"dp size {axis_size(mesh, dp_axis)}; got {key.shape[0]} rows and "
                     f"{slot_mapping.shape[0]} slots")
  return _sharded_write(cache, jnp.asarray(layer, jnp.int32), key, value, slot_mapping,
                        mesh=mesh, tp_axis=tp_axis, dp_axis=dp_axis,
                        split_tokens=split_tokens, backend=backend)


@functools.partial(jax.jit, static_argnames=("mesh", "tp_axis", "dp_axis", "split_tokens",
                                             "backend"))
def _sharded_write(cache, layer, key, value, slot_mapping, *, mesh, tp_axis, dp_axis,
                   split_tokens, backend):
  def write_shard(cache, layer, key, value, slot_mapping):
    return cache.write(layer, key, value, slot_mapping, backend=backend)

  specs = cache_partition_spec(cache, tp_axis=tp_axis, dp_axis=dp_axis)
  shard_slots = cache.num_blocks * cache.block_size // axis_size(mesh, dp_axis)
  return _write_on_mesh(write_shard, mesh, (cache, layer), (specs, PartitionSpec()), key,
                        value, slot_mapping, tp_axis=tp_axis, dp_axis=dp_axis,
                        shard_slots=shard_slots, split_tokens=split_tokens)


def sharded_write_kv(key, value, key_cache, value_cache, slot_mapping, mesh, *, layout: str,
                     kv_layout: str = "NHD", kv_cache_dtype: str = "auto", k_scale=None,
                     v_scale=None, layer=None, tp_axis="tp", dp_axis=None,
                     backend: str = "auto"):
  """:func:`jkv.write_kv` under ``jax.shard_map``: the array-level twin of
  :func:`sharded_write`.

  key_cache / value_cache (None for ``packed``): sharded as
    :func:`jkv.sharding.kv_cache_partition_spec` (``stacked=layer is not None``) says.
  k_scale / v_scale: None, scalars, [1] (replicated) or [H] (split over tp).
  Returns ``(key_cache, value_cache)``, or ``(kv_cache,)`` when value_cache is None.

  >>> import jax, jax.numpy as jnp, jkv
  >>> mesh = jax.make_mesh((1,), ("tp",))
  >>> key_cache = value_cache = jnp.zeros((4, 16, 2, 64), jnp.bfloat16)   # flash
  >>> key = jnp.ones((2, 2, 64), jnp.bfloat16)
  >>> key_cache, value_cache = jkv.sharded_write_kv(key, key, key_cache, value_cache,
  ...                                               jnp.array([0, 17]), mesh, layout="flash")
  >>> float(value_cache[1, 1, 1, 63])
  1.0
  """
  stacked = layer is not None
  caches = tuple(write_ops.as_cache(name, c) for name, c in
                 (("key_cache", key_cache), ("value_cache", value_cache)) if c is not None)
  per_layer = caches[0].shape[int(stacked):]
  num_blocks, block_size = layout_lib.blocks_of(layout, per_layer, kv_layout)
  num_heads = layout_lib.heads_of(layout, per_layer, kv_layout)[0]
  key, value = _check_tokens(key, value, num_heads)
  scales = tuple(quant.normalize_scale(s, num_heads, name)
                 for s, name in ((k_scale, "k_scale"), (v_scale, "v_scale")))
  specs = _kv_specs(caches, scales, layout, kv_layout, stacked, tp_axis, dp_axis)
  names = ("key_cache", "value_cache")[:len(caches)] + ("k_scale", "v_scale")
  check_mesh(dict(zip(names, caches + scales)), dict(zip(names, specs[0] + specs[1])),
              mesh, tp_axis, dp_axis)
  if stacked:
    errors.check_index("layer", layer, caches[0].shape[0])
  errors.check_slots_in_range("slot_mapping", slot_mapping, num_blocks * block_size,
                              f"a cache of {num_blocks} blocks x {block_size}")
  return _sharded_write_kv(
      caches, scales, None if layer is None else jnp.asarray(layer, jnp.int32), key, value,
      jnp.asarray(slot_mapping), mesh=mesh, layout=layout, kv_layout=kv_layout,
      kv_cache_dtype=kv_cache_dtype, tp_axis=tp_axis, dp_axis=dp_axis, backend=backend)


def _kv_specs(caches, scales, layout, kv_layout, stacked, tp_axis, dp_axis):
  """(cache specs, scale specs) of :func:`sharded_write_kv`'s arrays."""
  spec = kv_cache_partition_spec(layout, kv_layout, stacked=stacked, tp_axis=tp_axis,
                                 dp_axis=dp_axis)
  num_heads = layout_lib.heads_of(layout, caches[0].shape[int(stacked):], kv_layout)[0]
  return (tuple(spec for _ in caches),
          tuple(PartitionSpec(tp_axis if s.shape[0] == num_heads > 1 else None)
                for s in scales))


@functools.partial(jax.jit, static_argnames=("mesh", "layout", "kv_layout", "kv_cache_dtype",
                                             "tp_axis", "dp_axis", "backend"))
def _sharded_write_kv(caches, scales, layer, key, value, slot_mapping, *, mesh, layout,
                      kv_layout, kv_cache_dtype, tp_axis, dp_axis, backend):
  def write_shard(caches, scales, layer, key, value, slot_mapping):
    return write_ops.write_kv(key, value, caches[0], caches[1] if len(caches) == 2 else None,
                              slot_mapping, layout=layout, kv_layout=kv_layout,
                              kv_cache_dtype=kv_cache_dtype, k_scale=scales[0],
                              v_scale=scales[1], layer=layer, backend=backend)

  stacked = layer is not None
  cache_specs, scale_specs = _kv_specs(caches, scales, layout, kv_layout, stacked, tp_axis,
                                       dp_axis)
  num_blocks, block_size = layout_lib.blocks_of(layout, caches[0].shape[int(stacked):],
                                                kv_layout)
  return _write_on_mesh(write_shard, mesh, (caches, scales, layer),
                        (cache_specs, scale_specs, PartitionSpec()), key, value, slot_mapping,
                        tp_axis=tp_axis, dp_axis=dp_axis,
                        shard_slots=num_blocks * block_size // axis_size(mesh, dp_axis))


def sharded_attend(cache: PagedKVCache, layer, query, block_table, seq_lens, mesh, *,
                   tp_axis="tp", dp_axis=None, scale=None, alibi_slopes=None,
                   logits_soft_cap=None, sliding_window=None, backend: str = "auto"):
  """:meth:`PagedKVCache.attend` under ``jax.shard_map``: each device attends with its own
  kv heads (and the query heads that read them) and, with ``dp_axis``, its own sequences.

  cache: sharded as :func:`jkv.sharding.cache_sharding` says. query [B, Hq, D] (global Hq, split over
  tp; Hq / tp must be a multiple of the local kv heads). With ``dp_axis`` the batch is
  split over dp (data parallel attention): the sequences of dp shard ``i`` are rows
  ``[i * B / dp, (i + 1) * B / dp)`` and their block tables hold global block ids of that
  shard's page range (pages from the shard's own pool); a block of another shard reads as
  masked. block_table int [B, W], seq_lens int [B]; alibi_slopes [Hq] (split over tp).
  Eager checks run on the global arrays. Returns [B, Hq, D] split like the query.

  >>> import jax, jax.numpy as jnp, jkv
  >>> mesh = jax.make_mesh((1, 1), ("dp", "tp"))     # e.g. (2, 4) over 8 devices
  >>> cache = jkv.shard_cache(jkv.PagedKVCache.create(8, 16, 2, 64, dtype=jnp.bfloat16),
  ...                         mesh, dp_axis="dp")
  >>> query = jnp.ones((2, 4, 64), jnp.bfloat16)
  >>> out = jkv.sharded_attend(cache, 0, query, jnp.array([[0, 1], [4, 5]]),
  ...                          jnp.array([20, 3]), mesh, dp_axis="dp")
  >>> out.shape
  (2, 4, 64)
  """
  if not isinstance(cache, PagedKVCache):
    raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
  check_mesh(cache, cache_partition_spec(cache, tp_axis=tp_axis, dp_axis=dp_axis), mesh,
              tp_axis, dp_axis)
  errors.check_index("layer", layer, cache.num_layers)
  query = attention_ops.check_query(query, cache.num_heads, cache.head_size)
  block_table, seq_lens = attention_ops.check_tables(block_table, seq_lens, cache.num_blocks,
                                                     cache.block_size)
  errors.check_shape("query", query, (block_table.shape[0],) + query.shape[1:])
  tp, dp = axis_size(mesh, tp_axis), axis_size(mesh, dp_axis)
  if query.shape[1] % tp or query.shape[0] % dp:
    raise ValueError(f"query [B, Hq, D] = {tuple(query.shape)} must split over the mesh: Hq "
                     f"over tp ({tp}) and B over dp ({dp})")
  scale, alibi_slopes, logits_soft_cap, sliding_window = attention_ops.check_options(
      query.shape[1], cache.head_size, scale, alibi_slopes, logits_soft_cap, sliding_window)
  return _sharded_attend(cache, jnp.asarray(layer, jnp.int32), query, block_table, seq_lens,
                         alibi_slopes, mesh=mesh, tp_axis=tp_axis, dp_axis=dp_axis,
                         scale=scale, logits_soft_cap=logits_soft_cap,
                         sliding_window=sliding_window, backend=backend)


@functools.partial(jax.jit, static_argnames=("mesh", "tp_axis", "dp_axis", "scale",
                                             "logits_soft_cap", "sliding_window", "backend"))
def _sharded_attend(cache, layer, query, block_table, seq_lens, alibi_slopes, *, mesh, tp_axis,
                    dp_axis, scale, logits_soft_cap, sliding_window, backend):
  local_blocks = cache.num_blocks // axis_size(mesh, dp_axis)

  def shard(cache, layer, query, block_table, seq_lens, alibi_slopes):
    if dp_axis is not None:   # global block ids -> this shard's; others read as masked
      block_table = block_table - jax.lax.axis_index(dp_axis) * local_blocks
    return cache.attend(layer, query, block_table, seq_lens, scale=scale,
                        alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap,
                        sliding_window=sliding_window, backend=backend)

  queries = PartitionSpec(dp_axis, tp_axis, None)
  rows = PartitionSpec(dp_axis, None)
  in_specs = (cache_partition_spec(cache, tp_axis=tp_axis, dp_axis=dp_axis), PartitionSpec(),
              queries, rows, PartitionSpec(dp_axis),
              None if alibi_slopes is None else PartitionSpec(tp_axis))
  return _on_mesh(shard, mesh, in_specs, queries,
                  (cache, layer, query, block_table, seq_lens, alibi_slopes))


# ---- block copies and swaps --------------------------------------------------------------

def _block_specs(cache: PagedKVCache, tp_axis, dp_axis) -> dict[str, PartitionSpec]:
  specs = cache_partition_spec(cache, tp_axis=tp_axis, dp_axis=dp_axis)
  return {n: getattr(specs, n) for n in cache.block_array_names()}


def sharded_copy_blocks(cache: PagedKVCache, block_mapping, mesh, *, tp_axis="tp",
                        dp_axis=None, backend: str = "auto") -> PagedKVCache:
  """:meth:`PagedKVCache.copy_blocks` under ``jax.shard_map``: each device copies the blocks
  of its own kv heads (and, with ``dp_axis``, of its own page range).

  cache: sharded as :func:`jkv.sharding.cache_sharding` says. block_mapping: int [N, 2] global (src,
  dst) block ids, replicated (negative: skipped; of pairs with one destination the last
  wins). With ``dp_axis`` a pair must keep both blocks inside one dp shard's range
  ``[i * nb / dp, (i + 1) * nb / dp)``, as the copy-on-write pairs of a pool per dp shard
  do (:func:`jkv.sharded_pools.pools_append`, mapped by :func:`jkv.sharded_pools.pools_global_pages`): eagerly a pair across
  shards raises ValueError, under jit it is skipped. Same bytes as the unsharded copy.
  Returns the cache, same sharding (in place when the caller's jit donates it).

  >>> import jax, jax.numpy as jnp, jkv
  >>> mesh = jax.make_mesh((1, 1), ("dp", "tp"))     # e.g. (2, 4) over 8 devices
  >>> cache = jkv.shard_cache(jkv.PagedKVCache.create(8, 16, 2, 64, dtype=jnp.bfloat16),
  ...                         mesh, dp_axis="dp")
  >>> cache = jkv.sharded_write(cache, 0, jnp.ones((1, 2, 64), jnp.bfloat16),
  ...                           jnp.ones((1, 2, 64), jnp.bfloat16), jnp.array([16]), mesh)
  >>> cache = jkv.sharded_copy_blocks(cache, jnp.array([[1, 7]]), mesh, dp_axis="dp")
  >>> float(cache.key_cache[0, 7, 0, 0, 0])
  1.0
  """
  if not isinstance(cache, PagedKVCache):
    raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
  check_mesh(cache, cache_partition_spec(cache, tp_axis=tp_axis, dp_axis=dp_axis), mesh,
              tp_axis, dp_axis)
  block_mapping = blocks_ops.check_mapping(block_mapping)
  errors.check_pairs_in_range("block_mapping", block_mapping, cache.num_blocks)
  shard_blocks = cache.num_blocks // axis_size(mesh, dp_axis)
  blocks_ops.check_pairs_within_shards(block_mapping, shard_blocks, shard_blocks,
                                       axis_size(mesh, dp_axis))
  return _sharded_copy_blocks(cache, jnp.asarray(block_mapping), mesh=mesh, tp_axis=tp_axis,
                              dp_axis=dp_axis, backend=backend)


@functools.partial(jax.jit, static_argnames=("mesh", "tp_axis", "dp_axis", "backend"))
def _sharded_copy_blocks(cache, block_mapping, *, mesh, tp_axis, dp_axis, backend):
  names = cache.block_array_names()
  shard_blocks = cache.num_blocks // axis_size(mesh, dp_axis)

  def shard(arrays, block_mapping):
    if dp_axis is not None:
      block_mapping = localize_block_mapping(block_mapping, jax.lax.axis_index(dp_axis),
                                             shard_blocks)
    copied, _ = blocks_ops.copy_blocks([arrays[n] for n in names], None, block_mapping,
                                       block_axis=cache.block_axis, backend=backend)
    return dict(zip(names, copied))

  specs = _block_specs(cache, tp_axis, dp_axis)
  arrays = {n: getattr(cache, n) for n in names}
  return cache.replace(**_on_mesh(shard, mesh, (specs, PartitionSpec()), specs,
                                  (arrays, block_mapping)))


def sharded_swap_blocks(src: PagedKVCache, dst: PagedKVCache, block_mapping, mesh, *,
                        tp_axis="tp", dp_axis=None, backend: str = "auto") -> PagedKVCache:
  """``dst[d] = src[s]`` for every block array of two like caches (e.g. a device cache and
  a host tier in ``pinned_host`` memory), under ``jax.shard_map``: each device moves the
  blocks of its own kv heads (and, with ``dp_axis``, of its own page ranges).

  src, dst: PagedKVCache of one layout, quantization, layers and heads (block counts may
  differ), each sharded as :func:`jkv.sharding.cache_sharding` says (the memory kind of each is kept).
  block_mapping: int [N, 2] global (src block, dst block) ids, replicated; negative pairs
  are skipped, of pairs with one destination the last wins. With ``dp_axis`` a pair must
  keep its blocks in one dp shard (source block in src's shard ``i`` range, destination in
  dst's shard ``i`` range): eagerly a pair across shards raises ValueError, under jit it is
  skipped. Same bytes as :func:`jkv.swap_blocks` of every block array. Returns dst's
  updated cache, same sharding and memory kind (in place when the caller donates dst).

  >>> import jax, jax.numpy as jnp, jkv
  >>> mesh = jax.make_mesh((1, 1), ("dp", "tp"))     # e.g. (2, 4) over 8 devices
  >>> cache = jkv.shard_cache(jkv.PagedKVCache.create(8, 16, 2, 64, dtype=jnp.bfloat16),
  ...                         mesh, dp_axis="dp")
  >>> host = jkv.shard_cache(jkv.PagedKVCache.create(4, 16, 2, 64, dtype=jnp.bfloat16), mesh)
  >>> cache = jkv.sharded_write(cache, 0, jnp.ones((1, 2, 64), jnp.bfloat16),
  ...                           jnp.ones((1, 2, 64), jnp.bfloat16), jnp.array([16]), mesh)
  >>> host = jkv.sharded_swap_blocks(cache, host, jnp.array([[1, 3]]), mesh)
  >>> float(host.value_cache[0, 3, 0, 0, 0])
  1.0
  """
  for name, cache in (("src", src), ("dst", dst)):
    if not isinstance(cache, PagedKVCache):
      raise TypeError(f"{name} must be a PagedKVCache, got {type(cache).__name__}")
    check_mesh(cache, cache_partition_spec(cache, tp_axis=tp_axis, dp_axis=dp_axis), mesh,
                tp_axis, dp_axis)
  like = lambda c: (c.layout, c.kv_layout, c.quant, c.num_layers, c.num_heads, c.block_size,
                    c.head_size, c.key_cache.dtype)
  if like(src) != like(dst):
    raise ValueError(f"src and dst must be like caches (layout, kv_layout, quant, layers, "
                     f"heads, block_size, head_size, dtype), got {like(src)} and {like(dst)}")
  block_mapping = blocks_ops.check_mapping(block_mapping)
  errors.check_pairs_in_range("block_mapping", block_mapping, src.num_blocks, dst.num_blocks)
  dp = axis_size(mesh, dp_axis)
  blocks_ops.check_pairs_within_shards(block_mapping, src.num_blocks // dp,
                                       dst.num_blocks // dp, dp)
  return _sharded_swap_blocks(src, dst, jnp.asarray(block_mapping), mesh=mesh,
                              tp_axis=tp_axis, dp_axis=dp_axis, backend=backend)


@functools.partial(jax.jit, static_argnames=("mesh", "tp_axis", "dp_axis", "backend"))
def _sharded_swap_blocks(src, dst, block_mapping, *, mesh, tp_axis, dp_axis, backend):
  names = dst.block_array_names()
  dp = axis_size(mesh, dp_axis)

  def shard(src_arrays, dst_arrays, block_mapping):
    if dp_axis is not None:
      block_mapping = localize_block_mapping(block_mapping, jax.lax.axis_index(dp_axis),
                                             src.num_blocks // dp, dst.num_blocks // dp)
    return {n: blocks_ops.swap_blocks(src_arrays[n], dst_arrays[n], block_mapping,
                                      block_axis=dst.block_axis, backend=backend)
            for n in names}

  src_specs, dst_specs = _block_specs(src, tp_axis, dp_axis), _block_specs(dst, tp_axis, dp_axis)
  arrays = ({n: getattr(src, n) for n in names}, {n: getattr(dst, n) for n in names})
  return dst.replace(**_on_mesh(shard, mesh, (src_specs, dst_specs, PartitionSpec()),
                                dst_specs, arrays + (block_mapping,)))


def _on_mesh(shard, mesh, in_specs, out_specs, inputs):
  """``shard(*inputs)`` under ``jax.shard_map`` (inputs resharded first on a mesh of
  Explicit axes, whose shard_map takes its in_specs' types only)."""
  if AxisType.Explicit in mesh.axis_types:
    inputs = jax.reshard(inputs, jax.tree.map(lambda s: NamedSharding(mesh, s), in_specs))
  # check_vma=False: the Pallas kernels' out_shape carries no varying-axes type.
  return jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)(*inputs)


# ---- one PagePool per data-parallel shard ------------------------------------------------
