"""Cache kernels under plain ``jax.jit`` on sharded caches: a ``custom_partitioning`` rule.

XLA cannot split a Pallas call across devices: given a sharded cache, it would gather the
whole cache onto every device, run the kernel there, and keep a slice. :func:`per_shard`
wraps a kernel call in ``jax.experimental.custom_partitioning`` instead, so the SPMD
partitioner runs the kernel on every device's own shard, as :mod:`jkv.sharding` does under
``jax.shard_map``:

* the mesh axes that split the first cache operand's **heads** dim split the heads of
  every operand that has them (token rows, queries, per-head scales, other caches); a
  cache without a heads dim (MLA's latent, the indexer's keys) leaves every head whole;
* the axes that split its **block** dim split the block (or slot) dim of every cache
  operand; a global ``slot_mapping`` becomes each shard's local slots (slots of other
  shards' pages are dropped) and a global block table each shard's local block ids
  (blocks of other shards read as masked);
* every other dim is replicated (a cache split along another dim is gathered first).

A read (:func:`per_shard` with ``read=True``) returns a query-shaped output [B, Hq, ...]
split by heads and replicated over the block shards: the kernel gets the block axes and combines its partial
results over them (e.g. attention's softmax partials: collectives of the output's size,
never of the cache's).

A call with no mesh, inside ``jax.shard_map`` (all axes manual) or on one device runs the
kernel as is. ``custom_partitioning`` has no batching rule: where JAX sees more than one
device, these kernel calls cannot be ``jax.vmap``-ed (call them per item, or use
``backend="reference"``); with one device the rule is not used and vmap works.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.mlir import ir
from jax.sharding import NamedSharding, PartitionSpec

TOKENS = "tokens"           # [T, H, ...] kv heads, heads split with the cache
QUERY = "query"             # [B, Hq, ...] query heads (Hq a multiple of H), split likewise
QUERY_HEAD = "query_head"   # [Hq] per query head (ALiBi slopes)
HEAD_SCALE = "head_scale"   # [1] or [H]: split with the cache when [H]
SLOTS = "slots"             # int [T] global slots: replicated, localised per block shard
BLOCK_TABLE = "block_table"  # int [B, W] global block ids: replicated, localised
REPLICATED = "replicated"   # anything else the kernel reads whole (layer, lengths, scales)


@dataclasses.dataclass(frozen=True)
class Cache:
  """A cache operand: its block (or slot) dim and its heads dim (None: no heads dim)."""
  block_dim: int
  head_dim: int | None


def _axes(entry) -> tuple:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def per_shard(kernel, args, roles, *, block_size: int, read: bool = False):
  """``kernel(*args)`` run on every device's shard when the caches are sharded.

  roles: one per arg (the module's role names, or a :class:`Cache`); the first Cache's
    block dim has ``num_blocks`` entries of ``block_size`` slots.
  read: False: a write; ``kernel(*args)`` returns the Cache operands' new values, in
    operand order (sharded like them). True: ``kernel(*args, block_axes=...)`` returns one
    [B, Hq, ...] array (query heads on dim 1), combined over ``block_axes`` (the mesh axes
    of the block shards, None when there are none) inside the kernel function.
  """
  if jax.device_count() == 1:   # nothing to partition (and the kernel keeps its vmap rule)
    return kernel(*args, block_axes=None) if read else tuple(kernel(*args))
  roles = tuple(roles)
  caches = [i for i, r in enumerate(roles) if isinstance(r, Cache)]
  first = caches[0]
  first_heads = roles[first].head_dim   # None: a cache without a heads dim (MLA, indexer)
  num_heads = None if first_heads is None else args[first].shape[first_heads]

  def head_dim_of(role, shape):
    if role in (TOKENS, QUERY):
      return 1
    if role == QUERY_HEAD:
      return 0
    if role == HEAD_SCALE:
      return 0 if num_heads is not None and shape[0] == num_heads > 1 else None
    return role.head_dim if isinstance(role, Cache) else None

  def factors(i, role, shape):
    names = []
    for d, size in enumerate(shape):
      if d == head_dim_of(role, shape):
        names.append("q" if role in (QUERY, QUERY_HEAD) else "h")
      elif role in (TOKENS, SLOTS) and d == 0:
        names.append("t")
      elif role in (QUERY, BLOCK_TABLE) and d == 0:
        names.append("s")
      elif isinstance(role, Cache) and d == role.block_dim:
        names.append(f"b{size}")
      else:
        names.append(f"x{i}_{d}")
    return " ".join(names)

  def rule(mesh, operand_types, result_types):
    del mesh
    shapes = [tuple(_ranked(t).shape) for t in operand_types]
    operands = [factors(i, r, s) for i, (r, s) in enumerate(zip(roles, shapes))]
    if read:
      out_shape = tuple(_ranked(result_types[0]).shape)
      results = [factors(len(roles), QUERY, out_shape)]
    else:
      results = [operands[i] for i in caches]
    return f"{', '.join(operands)} -> {', '.join(results)}"

  def partition(mesh, arg_shapes, result_shape):
    spec = tuple(arg_shapes[first].sharding.spec)
    spec += (None,) * (len(arg_shapes[first].shape) - len(spec))
    block_axes = _axes(spec[roles[first].block_dim])
    tp = None if first_heads is None else (_axes(spec[first_heads]) or None)
    dp = block_axes or None

    def sharding_of(role, shape):
      entries = [None] * len(shape)
      heads = head_dim_of(role, shape)
      if heads is not None:
        entries[heads] = tp
      if isinstance(role, Cache):
        entries[role.block_dim] = dp
      return NamedSharding(mesh, PartitionSpec(*entries))

    arg_shardings = tuple(sharding_of(r, a.shape) for r, a in zip(roles, arg_shapes))
    if read:
      entries = [None] * len(result_shape.shape)
      entries[1] = tp
      result_shardings = NamedSharding(mesh, PartitionSpec(*entries))
    else:
      result_shardings = tuple(arg_shardings[i] for i in caches)
    shard_blocks = (arg_shapes[first].shape[roles[first].block_dim]
                    // math.prod(mesh.shape[a] for a in block_axes))
    axis = block_axes[0] if len(block_axes) == 1 else block_axes

    def localize(role, array, index):
      if role == SLOTS:
        local = array - index * shard_blocks * block_size
        return jnp.where((local >= 0) & (local < shard_blocks * block_size), local, -1)
      if role == BLOCK_TABLE:   # ids outside [0, shard_blocks) read as masked
        return array - index * shard_blocks
      return array

    def lower(*local):
      if dp is not None:
        index = jax.lax.axis_index(axis)
        local = tuple(localize(r, a, index) for r, a in zip(roles, local))
      if read:
        return kernel(*local, block_axes=None if dp is None else axis)
      return tuple(kernel(*local))

    return mesh, lower, result_shardings, arg_shardings

  if read:
    wrapped = custom_partitioning(lambda *a: kernel(*a, block_axes=None))
  else:
    wrapped = custom_partitioning(lambda *a: tuple(kernel(*a)))
  wrapped.def_partition(partition=partition, sharding_rule=rule)
  return wrapped(*args)


def _ranked(ir_type):
  return ir.RankedTensorType(ir_type)
