"""Cache kernels under plain ``jax.jit`` on sharded caches: a ``custom_partitioning`` rule.

XLA cannot split a Pallas call across devices: given a sharded cache, it would gather the
whole cache onto every device, run the kernel there, and keep a slice. :func:`per_shard`
wraps a kernel call in ``jax.experimental.custom_partitioning`` instead, so the SPMD
partitioner runs the kernel on every device's own shard, as :mod:`jkv.sharded_ops` does
under ``jax.shard_map``. (Which is which: :mod:`jkv.sharding` says where a cache's arrays
go on a mesh; :mod:`jkv.sharded_ops` runs ops on them explicitly under ``shard_map``; this
module makes the ops' kernels run per shard when a plain ``jit`` sees sharded operands.)

* the mesh axes that split the first cache operand's **heads** dim split the heads of
  every operand that has them (token rows, queries, per-head scales, other caches); a
  cache without a heads dim (MLA's latent, the indexer's keys) leaves every head whole;
* the axes that split its **block** dim split the block (or slot) dim of every cache
  operand; a global ``slot_mapping`` becomes each shard's local slots (slots of other
  shards' pages are dropped) and a global block table each shard's local block ids
  (blocks of other shards read as masked);
* every other dim is replicated (a cache split along another dim is gathered first),
  except in an ``elementwise`` cache operand (block copies), whose other dims keep their
  sharding;
* a global ``block_mapping`` of (src, dst) block pairs becomes each shard's local pairs
  (pairs with a block in another shard are skipped, as in :mod:`jkv.sharded_ops`).

A read (:func:`per_shard` with ``read=True``) returns a query-shaped output [B, Hq, ...]
split by heads and replicated over the block shards (``outputs="query"``), or replicated
outputs (``outputs="replicated"``): the kernel gets the block axes and combines its
partial results over them (e.g. attention's softmax partials: collectives of the output's
size, never of the cache's).

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
BLOCK_MAPPING = "block_mapping"  # int [N, 2] global (src, dst) pairs: replicated, localised
REPLICATED = "replicated"   # anything else the kernel reads whole (layer, lengths, scales)


@dataclasses.dataclass(frozen=True)
class Cache:
  """A cache operand: its block (or slot) dim and its heads dim (None: no heads dim).

  written: False for a cache the kernel only reads (a write kernel does not return it).
  elementwise: the kernel treats every other dim elementwise, so those keep their
  sharding (heads_dim is then None)."""
  block_dim: int
  head_dim: int | None
  written: bool = True
  elementwise: bool = False


def _axes(entry) -> tuple:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def per_shard(kernel, args, roles, *, block_size: int | None = None, read: bool = False,
              outputs: str = "query"):
  """``kernel(*args)`` run on every device's shard when the caches are sharded.

  roles: one per arg (the module's role names, or a :class:`Cache`); the first Cache's
    block dim has ``num_blocks`` entries of ``block_size`` slots (needed with SLOTS). A
    BLOCK_MAPPING's
    sources are blocks of the first Cache, its destinations of the first written one.
  read: False: a write; ``kernel(*args)`` returns the written Cache operands' new values,
    in operand order (sharded like them). True: ``kernel(*args, block_axes=...)`` returns
    its outputs combined over ``block_axes`` (the mesh axes of the block shards, None when
    there are none) inside the kernel function: ``outputs="query"``: one [B, Hq, ...]
    array (query heads on dim 1, split like the cache's heads); ``"replicated"``: a tuple
    of arrays, replicated.
  """
  if outputs not in ("query", "replicated"):
    raise ValueError(f"outputs must be 'query' or 'replicated', got {outputs!r}")
  roles = tuple(roles)
  if SLOTS in roles and block_size is None:
    raise ValueError("a SLOTS operand needs block_size")
  replicated = read and outputs == "replicated"

  def call(*arrays, block_axes=None):   # the kernel, its outputs as per_shard returns them
    if not read:
      return tuple(kernel(*arrays))
    out = kernel(*arrays, block_axes=block_axes)
    return tuple(out) if replicated else out

  if not wraps_kernels():   # nothing to partition (and the kernel keeps its vmap rule)
    return call(*args)
  caches = [i for i, r in enumerate(roles) if isinstance(r, Cache)]
  written = [i for i in caches if roles[i].written]
  first = caches[0]
  twin = written[0] if written else first   # a BLOCK_MAPPING's destination cache
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
      elif isinstance(role, Cache) and role.elementwise:   # read-only: the twin's dims
        names.append(f"e{i if role.written else twin}_{d}")
      else:
        names.append(f"x{i}_{d}")
    return " ".join(names)

  def rule(mesh, operand_types, result_types):
    del mesh
    shapes = [tuple(_ranked(t).shape) for t in operand_types]
    operands = [factors(i, r, s) for i, (r, s) in enumerate(zip(roles, shapes))]
    if replicated:
      results = [" ".join(f"r{k}_{d}" for d in range(len(_ranked(t).shape)))
                 for k, t in enumerate(result_types)]
    elif read:
      out_shape = tuple(_ranked(result_types[0]).shape)
      results = [factors(len(roles), QUERY, out_shape)]
    else:
      results = [operands[i] for i in written]
    return f"{', '.join(operands)} -> {', '.join(results)}"

  def partition(mesh, arg_shapes, result_shape):
    spec = tuple(arg_shapes[first].sharding.spec)
    spec += (None,) * (len(arg_shapes[first].shape) - len(spec))
    block_axes = _axes(spec[roles[first].block_dim])
    tp = None if first_heads is None else (_axes(spec[first_heads]) or None)
    dp = block_axes or None

    def sharding_of(role, shape, spec=()):
      if isinstance(role, Cache) and role.elementwise:   # other dims as they come
        entries = list(spec) + [None] * (len(shape) - len(spec))
        entries[role.block_dim] = dp
        return NamedSharding(mesh, PartitionSpec(*entries))
      entries = [None] * len(shape)
      heads = head_dim_of(role, shape)
      if heads is not None:
        entries[heads] = tp
      if isinstance(role, Cache):
        entries[role.block_dim] = dp
      return NamedSharding(mesh, PartitionSpec(*entries))

    arg_shardings = tuple(
        sharding_of(r, a.shape, tuple(arg_shapes[i if r.written else twin].sharding.spec)
                    if isinstance(r, Cache) and r.elementwise else ())
        for i, (r, a) in enumerate(zip(roles, arg_shapes)))
    if replicated:
      result_shardings = tuple(NamedSharding(mesh, PartitionSpec()) for _ in result_shape)
    elif read:
      entries = [None] * len(result_shape.shape)
      entries[1] = tp
      result_shardings = NamedSharding(mesh, PartitionSpec(*entries))
    else:
      result_shardings = tuple(arg_shardings[i] for i in written)
    num_shards = math.prod(mesh.shape[a] for a in block_axes)
    shard_blocks = arg_shapes[first].shape[roles[first].block_dim] // num_shards
    dst_shard_blocks = arg_shapes[twin].shape[roles[twin].block_dim] // num_shards
    axis = block_axes[0] if len(block_axes) == 1 else block_axes

    def localize(role, array, index):
      if role == SLOTS:
        return localize_slot_mapping(array, index, shard_blocks * block_size)
      if role == BLOCK_TABLE:   # ids outside [0, shard_blocks) read as masked
        return array - index * shard_blocks
      if role == BLOCK_MAPPING:
        return localize_block_mapping(array, index, shard_blocks, dst_shard_blocks)
      return array

    def lower(*local):
      if dp is not None:
        index = jax.lax.axis_index(axis)
        local = tuple(localize(r, a, index) for r, a in zip(roles, local))
      return call(*local, block_axes=None if dp is None else axis)

    return mesh, lower, result_shardings, arg_shardings

  wrapped = custom_partitioning(lambda *arrays: call(*arrays))
  wrapped.def_partition(partition=partition, sharding_rule=rule)
  return wrapped(*args)


def wraps_kernels() -> bool:
  """Whether :func:`per_shard` runs kernels inside ``custom_partitioning`` (more than one
  device), where Pallas' GPU interpreter (its io_callbacks) cannot lower: interpreted
  Mosaic GPU kernels then give way to the Triton ones."""
  return jax.device_count() > 1


def localize_slot_mapping(slot_mapping, shard_index, shard_slots: int):
  """Global slots -> the slots of one page shard.

  slot_mapping: int [T] global slots (< 0 padding). Shard ``shard_index`` (int, may be
  traced, e.g. ``jax.lax.axis_index(dp_axis)``) holds global slots
  ``[shard_index * shard_slots, (shard_index + 1) * shard_slots)``; they become
  ``slot - shard_index * shard_slots``, every other slot -1 (padding on this shard).
  """
  slot_mapping = jnp.asarray(slot_mapping)
  local = slot_mapping - shard_index * shard_slots
  return jnp.where((local >= 0) & (local < shard_slots), local, -1).astype(slot_mapping.dtype)


def localize_block_mapping(block_mapping, shard_index, src_shard_blocks: int,
                           dst_shard_blocks: int | None = None):
  """Global (src, dst) block pairs -> the pairs of one page shard.

  block_mapping: int [N, 2] global block ids (negative: skipped pair). Shard
  ``shard_index`` (int, may be traced) holds source blocks ``[i * src_shard_blocks,
  (i + 1) * src_shard_blocks)`` and destination blocks likewise (``dst_shard_blocks``,
  default the same). A pair with both blocks in the shard becomes local ids; every other
  pair becomes ``(-1, -1)`` (skipped on this shard). Returns int32 [N, 2].
  """
  dst_shard_blocks = src_shard_blocks if dst_shard_blocks is None else dst_shard_blocks
  mapping = jnp.asarray(block_mapping).astype(jnp.int32)
  src = mapping[:, 0] - shard_index * src_shard_blocks
  dst = mapping[:, 1] - shard_index * dst_shard_blocks
  here = ((mapping[:, 0] >= 0) & (mapping[:, 1] >= 0) & (src >= 0) & (src < src_shard_blocks)
          & (dst >= 0) & (dst < dst_shard_blocks))
  return jnp.where(here[:, None], jnp.stack([src, dst], axis=1), -1)


def _ranked(ir_type):
  return ir.RankedTensorType(ir_type)
