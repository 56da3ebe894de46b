"""Where jkv's caches go on a device mesh (``jax.sharding``): partition specs and shardings
of every cache pytree. The ops that run on the shards are :mod:`jkv.sharded_ops`
(``jax.shard_map`` wrappers); a page pool per data-parallel shard is
:mod:`jkv.sharded_pools`.

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
                                                                 (:mod:`jkv.sharded_pools`)
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

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jkv import backend as backend_lib
from jkv import errors, layout as layout_lib
from jkv.cache import ContiguousKVCache, PagedKVCache
from jkv.mla_cache import FP4IndexerCache, IndexerKCache, MLACache
from jkv.page_pool import PagePool
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
  """{array field: (dim split over dp, dim split over tp)}: the cache class's own table."""
  if not isinstance(cache, CACHE_TYPES):
    raise TypeError(f"cache must be one of {tuple(t.__name__ for t in CACHE_TYPES)}, got "
                    f"{type(cache).__name__}")
  return cache.split_dims()


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


def check_mesh(cache, specs, mesh, tp_axis, dp_axis) -> None:
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
  check_mesh(cache, specs, mesh, tp_axis, dp_axis)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


def shard_cache(cache, mesh, *, tp_axis="tp", dp_axis=None):
  """``jax.device_put`` of the cache with :func:`cache_sharding`."""
  return jax.device_put(cache, cache_sharding(cache, mesh, tp_axis=tp_axis, dp_axis=dp_axis))


def repeat_kv_heads(x, repeats: int, *, backend: str = "auto"):
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

  >>> import jax.numpy as jnp, jkv
  >>> key = jnp.arange(2.0)[None, :, None] * jnp.ones((3, 2, 4))   # [T, H, D]
  >>> jkv.repeat_kv_heads(key, 2)[0, :, 0]                         # heads h0 h0 h1 h1
  Array([0., 0., 1., 1.], dtype=float32)
  """
  backend_lib.jnp_only(backend)   # jnp only
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
