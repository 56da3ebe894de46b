"""jkv's caches, writes and decode attention on a device mesh (``jax.sharding`` / ``jax.shard_map``).

The rule, for every cache pytree:

* **kv heads** go over a tensor-parallel mesh axis (``tp_axis``): each device keeps the
  K/V (and per-head scales) of ``num_heads / tp`` heads, as its attention shard needs
  them; ``num_heads`` must be a multiple of the tp size. When the tp size exceeds the kv
  head count (and is a multiple of it), repeat the heads first
  (:func:`repeat_kv_heads`, ``kv_head_repeats``): every device then holds one copy of one
  kv head, the one its query heads read (vLLM's rule).
* **pages (blocks)** go over an optional data-parallel axis (``dp_axis``): device ``i``
  of that axis holds the contiguous block range ``[i * nb / dp, (i + 1) * nb / dp)``, so
  each shard writes only the slots of its own pages (:func:`localize_slot_mapping`).

Per cache type (``L`` = num_layers; ``tp``/``dp``: the mesh axes an array dim is split over):

=====================  ========================================  ==========================
cache                  arrays                                    split
=====================  ========================================  ==========================
``PagedKVCache``       key/value data [L, nb, ...] (any layout)  nb: dp, heads dim: tp
                       ``tensor`` k/v_scale [H] / [1]            [H]: tp; [1]: replicated
                       ``token`` scales [L, nb, H, bs]           nb: dp, H: tp
                       ``block`` scales [L, units, H]            units: dp, H: tp
                       FP4 scales [L, nb, H, bs, D/g]            nb: dp, H: tp
                       nvfp4 k/v_global_scale [1]                replicated
``ContiguousKVCache``  keys/values [L, batch, S, H, D]           batch: dp, H: tp
                       position [batch]                          batch: dp
``StateCache``         pages uint8 [L, slots, page_bytes]        slots: dp (states are raw
                                                                 bytes: replicated over tp)
``PagePool``           ref_count, block_table, seq_lens, flag    replicated (small; its
                                                                 free-page search is global),
                                                                 or one pool per dp shard
                                                                 (:func:`shard_pools`)
``MLACache``           kv_cache [L, nb, bs, (H,) E]; fp8_split   nb: dp (the latent is
                       rope_cache / entry_scale [L, nb, ...]     replicated over tp)
                       scale [1]                                 replicated
``IndexerKCache``      kv_cache uint8 [L, nb, bs, bytes]         nb: dp
``FP4IndexerCache``    keys, scales [L, nb, bs, ...];            nb: dp
                       global_scale [L, nb]
=====================  ========================================  ==========================

A ``block`` cache under dp needs its scale units to split evenly too (``units % dp == 0``).
Mesh axis arguments are a mesh axis name, a tuple of names (split over their product) or
None (not split).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jkv import errors, layout as layout_lib, pytree, quant
from jkv.cache import ContiguousKVCache, PagedKVCache
from jkv.mla_cache import FP4IndexerCache, IndexerKCache, MLACache
from jkv.ops import attention as attention_ops
from jkv.ops import blocks as blocks_ops
from jkv.ops import write as write_ops
from jkv.page_pool import PagePool
from jkv.partitioning import localize_block_mapping, localize_slot_mapping
from jkv.state_cache import StateCache

CACHE_TYPES = (PagedKVCache, ContiguousKVCache, StateCache, PagePool, MLACache, IndexerKCache,
               FP4IndexerCache)


def kv_cache_partition_spec(layout: str, kv_layout: str = "NHD", *, stacked: bool = False,
                            tp_axis="tp", dp_axis=None) -> PartitionSpec:
  """PartitionSpec of a raw key / value / packed cache array of ``layout`` (one spec fits
  both K and V; trailing dims replicated), for the array-level ops. ``stacked``: the
  array has a leading num_layers dim (replicated)."""
  entries = [None] * (layout_lib.heads_dim(layout, kv_layout) + 1)
  entries[0], entries[-1] = dp_axis, tp_axis
  return PartitionSpec(*([None] if stacked else []), *entries)


def _split_dims(cache) -> dict[str, tuple[int | None, int | None]]:
  """{array field: (dim split over dp, dim split over tp)} of a cache pytree."""
  if isinstance(cache, PagedKVCache):
    heads = 1 + layout_lib.heads_dim(cache.layout, cache.kv_layout)   # FP4: layout hnd
    dims = {"key_cache": (1, heads), "value_cache": (1, heads),
            "k_global_scale": (None, None), "v_global_scale": (None, None)}
    for name in ("k_scale", "v_scale"):
      if cache.quant != "tensor":
        dims[name] = (1, 2)
      else:   # [1] (per tensor) or [H] (per head); a 1-head cache's [1] is both
        per_head = getattr(cache, name).shape[0] == cache.num_heads > 1
        dims[name] = (None, 0 if per_head else None)
    return dims
  if isinstance(cache, ContiguousKVCache):
    return {"keys": (1, 3), "values": (1, 3), "position": (0, None)}
  if isinstance(cache, StateCache):
    return {"pages": (1, None)}
  if isinstance(cache, PagePool):
    return dict.fromkeys(pytree.fields(cache)[0], (None, None))
  if isinstance(cache, (MLACache, IndexerKCache, FP4IndexerCache)):
    dims = dict.fromkeys(pytree.fields(cache)[0], (1, None))   # pages over dp only
    if isinstance(cache, MLACache):
      dims["scale"] = (None, None)
    return dims
  raise TypeError(f"cache must be one of {tuple(t.__name__ for t in CACHE_TYPES)}, got "
                  f"{type(cache).__name__}")


def cache_partition_spec(cache, *, tp_axis="tp", dp_axis=None):
  """A pytree of the cache's structure (same class, static fields, None fields) with a
  full-length ``PartitionSpec`` in place of every array, per the module's table.
  ``cache`` may hold ``jax.ShapeDtypeStruct`` leaves (``jax.eval_shape`` of a create)."""
  dims = _split_dims(cache)

  def spec(path, array):
    dp_dim, tp_dim = dims[path[0].name]
    entries = [None] * array.ndim
    if dp_dim is not None:
      entries[dp_dim] = dp_axis
    if tp_dim is not None:
      entries[tp_dim] = tp_axis
    return PartitionSpec(*entries)

  return jax.tree_util.tree_map_with_path(spec, cache)


def axis_size(mesh, axis) -> int:
  """Devices along a mesh axis name, a tuple of names (their product) or None (1)."""
  names = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
  for name in names:
    if name not in mesh.shape:
      raise ValueError(f"mesh axis {name!r} is not an axis of the mesh (axes: "
                       f"{tuple(mesh.axis_names)})")
  return math.prod(mesh.shape[name] for name in names)


def kv_head_repeats(num_kv_heads: int, tp_size: int) -> int:
  """How often to repeat each kv head for a tp size: 1 when tp divides num_kv_heads,
  ``tp // num_kv_heads`` when num_kv_heads divides tp; else ValueError."""
  if num_kv_heads % tp_size == 0:
    return 1
  if tp_size % num_kv_heads == 0:
    return tp_size // num_kv_heads
  raise ValueError(f"num_kv_heads ({num_kv_heads}) and the tensor-parallel size ({tp_size}) "
                   f"must divide one another")


def _field_name(path) -> str:
  """The field (or dict key) a leaf's tree path starts with."""
  return getattr(path[0], "name", None) or str(path[0].key)


def _check_mesh(cache, specs, mesh, tp_axis, dp_axis) -> None:
  """The mesh has the axes and every split dim divides evenly over them."""
  if tp_axis is not None and dp_axis is not None and (
      set(jax.tree.leaves(tp_axis)) & set(jax.tree.leaves(dp_axis))):
    raise ValueError(f"tp_axis and dp_axis must name different mesh axes, got {tp_axis!r} "
                     f"and {dp_axis!r}")
  sizes = {"tp": axis_size(mesh, tp_axis), "dp": axis_size(mesh, dp_axis)}

  def check(path, spec, array):
    name = _field_name(path)
    for dim, (entry, size) in enumerate(zip(spec, array.shape)):
      if entry is None:
        continue
      which = "tp" if entry == tp_axis else "dp"
      if size % sizes[which] == 0:
        continue
      if which == "tp" and sizes["tp"] % size == 0:
        raise ValueError(f"{name} has {size} kv heads (dim {dim}), fewer than the "
                         f"tensor-parallel size {sizes['tp']} of mesh axis {tp_axis!r}: "
                         f"repeat them first, repeat_kv_heads(cache, "
                         f"{sizes['tp'] // size}) (and the same for key / value)")
      raise ValueError(f"{name} dim {dim} (size {size}, shape {tuple(array.shape)}) must "
                       f"split evenly over the {sizes[which]} devices of mesh axis "
                       f"{entry!r} ({which}_axis)")

  jax.tree_util.tree_map_with_path(check, specs, cache)


def cache_sharding(cache, mesh, *, tp_axis="tp", dp_axis=None):
  """:func:`cache_partition_spec` as ``NamedSharding``s on ``mesh``, after checking that
  the mesh has the axes and every split dim divides evenly (ValueError otherwise)."""
  specs = cache_partition_spec(cache, tp_axis=tp_axis, dp_axis=dp_axis)
  _check_mesh(cache, specs, mesh, tp_axis, dp_axis)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


def shard_cache(cache, mesh, *, tp_axis="tp", dp_axis=None):
  """``jax.device_put`` of the cache with :func:`cache_sharding`."""
  return jax.device_put(cache, cache_sharding(cache, mesh, tp_axis=tp_axis, dp_axis=dp_axis))


def repeat_kv_heads(x, repeats: int):
  """Every kv head repeated ``repeats`` times in place (heads h0 h0 h1 h1 ... for 2), so
  that a tp size of ``repeats * num_kv_heads`` splits them one per device and device
  ``i`` holds head ``i // repeats``: the kv head of its query heads under GQA.

  x: key / value [T, H, D] or [B, T, H, D] (heads are dim -2) -> [..., H * repeats, D];
  or a ``PagedKVCache`` / ``ContiguousKVCache``: every array with a heads dim repeated
  (data and per-head scales; a per-tensor [1] scale stays). Writes of repeated inputs
  into a repeated cache give each copy exactly the unrepeated head's bytes.

  Memory: the cache (and the K/V inputs) grow ``repeats`` times in total: each of the tp
  devices holds one kv head's cache, ``1 / num_kv_heads`` of the unrepeated cache, not
  ``1 / tp``; that is the smallest per-device share heads can give.
  """
  errors.check_size("repeats", repeats)
  if isinstance(x, (PagedKVCache, ContiguousKVCache)):
    dims = _split_dims(x)

    def repeat(path, array):
      heads = dims[path[0].name][1]
      return array if heads is None else jnp.repeat(array, repeats, axis=heads)

    return jax.tree_util.tree_map_with_path(repeat, x)
  if isinstance(x, CACHE_TYPES):
    raise TypeError(f"x must be a key / value array, a PagedKVCache or a ContiguousKVCache "
                    f"(a {type(x).__name__} has no kv heads)")
  x = jnp.asarray(x)
  if x.ndim not in (3, 4):
    raise ValueError(f"x must be 3-D [T, H, D] or 4-D [B, T, H, D], got shape {tuple(x.shape)}")
  return jnp.repeat(x, repeats, axis=-2)


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

  cache: sharded as :func:`cache_sharding` says (shard it once with :func:`shard_cache`;
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
  """
  if not isinstance(cache, PagedKVCache):
    raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
  _check_mesh(cache, cache_partition_spec(cache, tp_axis=tp_axis, dp_axis=dp_axis), mesh,
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
    :func:`kv_cache_partition_spec` (``stacked=layer is not None``) says.
  k_scale / v_scale: None, scalars, [1] (replicated) or [H] (split over tp).
  Returns ``(key_cache, value_cache)``, or ``(kv_cache,)`` when value_cache is None.
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
  _check_mesh(dict(zip(names, caches + scales)), dict(zip(names, specs[0] + specs[1])),
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

  cache: sharded as :func:`cache_sharding` says. query [B, Hq, D] (global Hq, split over
  tp; Hq / tp must be a multiple of the local kv heads). With ``dp_axis`` the batch is
  split over dp (data parallel attention): the sequences of dp shard ``i`` are rows
  ``[i * B / dp, (i + 1) * B / dp)`` and their block tables hold global block ids of that
  shard's page range (pages from the shard's own pool); a block of another shard reads as
  masked. block_table int [B, W], seq_lens int [B]; alibi_slopes [Hq] (split over tp).
  Eager checks run on the global arrays. Returns [B, Hq, D] split like the query.
  """
  if not isinstance(cache, PagedKVCache):
    raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
  _check_mesh(cache, cache_partition_spec(cache, tp_axis=tp_axis, dp_axis=dp_axis), mesh,
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

  cache: sharded as :func:`cache_sharding` says. block_mapping: int [N, 2] global (src,
  dst) block ids, replicated (negative: skipped; of pairs with one destination the last
  wins). With ``dp_axis`` a pair must keep both blocks inside one dp shard's range
  ``[i * nb / dp, (i + 1) * nb / dp)``, as the copy-on-write pairs of a pool per dp shard
  do (:func:`pools_append`, mapped by :func:`pools_global_pages`): eagerly a pair across
  shards raises ValueError, under jit it is skipped. Same bytes as the unsharded copy.
  Returns the cache, same sharding (in place when the caller's jit donates it).
  """
  if not isinstance(cache, PagedKVCache):
    raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
  _check_mesh(cache, cache_partition_spec(cache, tp_axis=tp_axis, dp_axis=dp_axis), mesh,
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
                                       block_axis=1, backend=backend)
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
  differ), each sharded as :func:`cache_sharding` says (the memory kind of each is kept).
  block_mapping: int [N, 2] global (src block, dst block) ids, replicated; negative pairs
  are skipped, of pairs with one destination the last wins. With ``dp_axis`` a pair must
  keep its blocks in one dp shard (source block in src's shard ``i`` range, destination in
  dst's shard ``i`` range): eagerly a pair across shards raises ValueError, under jit it is
  skipped. Same bytes as :func:`jkv.swap_blocks` of every block array. Returns dst's
  updated cache, same sharding and memory kind (in place when the caller donates dst).
  """
  for name, cache in (("src", src), ("dst", dst)):
    if not isinstance(cache, PagedKVCache):
      raise TypeError(f"{name} must be a PagedKVCache, got {type(cache).__name__}")
    _check_mesh(cache, cache_partition_spec(cache, tp_axis=tp_axis, dp_axis=dp_axis), mesh,
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
                                      block_axis=1, backend=backend) for n in names}

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

def shard_pools(pool: PagePool, mesh, *, dp_axis="dp") -> PagePool:
  """One page pool per data-parallel shard, for a cache whose pages are split over dp.

  pool: an empty pool sized for ONE shard (``num_pages`` = the cache's
  ``num_blocks / dp``; page 0 of every shard is that shard's null page). Returns a
  PagePool whose every leaf has a leading [dp] axis, split over ``dp_axis``: shard ``i``
  hands out the global blocks ``[i * num_pages, (i + 1) * num_pages)`` to its own
  sequences. Use it with :func:`pools_append`, :func:`pools_slot_mapping` and
  :func:`pools_block_table` (vmapped over the shards; XLA keeps each shard's work on its
  devices), then :func:`sharded_write` (``split_tokens=True``) and :func:`sharded_attend`.
  """
  if not isinstance(pool, PagePool):
    raise TypeError(f"pool must be a PagePool, got {type(pool).__name__}")
  dp = axis_size(mesh, dp_axis)
  stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (dp,) + x.shape), pool)
  return jax.device_put(stacked, jax.tree.map(
      lambda x: NamedSharding(mesh, PartitionSpec(dp_axis, *([None] * (x.ndim - 1)))),
      stacked))


def pools_append(pools: PagePool, seq_ids, num_tokens, *, max_new_pages: int | None = None):
  """:meth:`PagePool.append` on every shard's pool: seq_ids / num_tokens int [dp, B]
  (local sequence ids of each shard). Returns ``(pools, copies)``, copies int32
  [dp, B, 2] of local page ids (use :func:`pools_global_pages` for the cache's ids)."""
  return jax.vmap(lambda pool, ids, counts: pool.append(ids, counts,
                                                        max_new_pages=max_new_pages))(
      pools, jnp.asarray(seq_ids, jnp.int32), jnp.asarray(num_tokens, jnp.int32))


def pools_global_pages(pools: PagePool, local_pages):
  """Local page ids [dp, ...] of each shard's pool -> the cache's global block ids
  (``local + shard * num_pages``; negative ids stay -1)."""
  local_pages = jnp.asarray(local_pages, jnp.int32)
  num_pages = pools.ref_count.shape[1]
  shard = jnp.arange(local_pages.shape[0], dtype=jnp.int32).reshape(
      (-1,) + (1,) * (local_pages.ndim - 1))
  return jnp.where(local_pages >= 0, local_pages + shard * num_pages, -1)


def pools_slot_mapping(pools: PagePool, seq_ids, positions):
  """Global cache slots int32 [dp * B] of tokens at ``positions`` [dp, B] of the shards'
  local sequences ``seq_ids`` [dp, B] (-1 where the pool says -1); rows in shard order,
  as :func:`sharded_write` with ``split_tokens=True`` wants them."""
  local = jax.vmap(lambda pool, ids, pos: pool.slot_mapping(ids, pos))(
      pools, jnp.asarray(seq_ids, jnp.int32), jnp.asarray(positions, jnp.int32))
  page_size = pools.page_size
  shard_slots = pools.ref_count.shape[1] * page_size
  shard = jnp.arange(local.shape[0], dtype=jnp.int32)[:, None]
  return jnp.where(local >= 0, local + shard * shard_slots, -1).reshape(-1)


def pools_block_table(pools: PagePool):
  """(block_table int32 [dp * max_seqs, max_pages_per_seq] of global block ids, seq_lens
  int32 [dp * max_seqs]): every shard's sequences in shard order, as
  :func:`sharded_attend` with ``dp_axis`` wants them."""
  table = pools_global_pages(pools, pools.block_table)
  return table.reshape(-1, table.shape[-1]), pools.seq_lens.reshape(-1)
