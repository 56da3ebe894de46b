"""A page pool per data-parallel shard: each dp shard allocates from its own page range
of a cache paged over dp, and the cache's global block id of a shard's local page ``p`` is
``p + shard * num_pages``. The pools are one :class:`jkv.PagePool` stacked on a leading dp
axis (split over the mesh's dp axis); these helpers map the per-shard operations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jkv.page_pool import PagePool
from jkv.sharding import axis_size


def shard_pools(pool: PagePool, mesh, *, dp_axis="dp") -> PagePool:
  """One page pool per data-parallel shard, for a cache whose pages are split over dp.

  pool: an empty pool sized for ONE shard (``num_pages`` = the cache's
  ``num_blocks / dp``; page 0 of every shard is that shard's null page). Returns a
  PagePool whose every leaf has a leading [dp] axis, split over ``dp_axis``: shard ``i``
  hands out the global blocks ``[i * num_pages, (i + 1) * num_pages)`` to its own
  sequences. Use it with :func:`pools_append`, :func:`pools_slot_mapping` and
  :func:`pools_block_table` (vmapped over the shards; XLA keeps each shard's work on its
  devices), then :func:`jkv.sharded_ops.sharded_write` (``split_tokens=True``) and :func:`jkv.sharded_ops.sharded_attend`.
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
  as :func:`jkv.sharded_ops.sharded_write` with ``split_tokens=True`` wants them."""
  local = jax.vmap(lambda pool, ids, pos: pool.slot_mapping(ids, pos))(
      pools, jnp.asarray(seq_ids, jnp.int32), jnp.asarray(positions, jnp.int32))
  page_size = pools.page_size
  shard_slots = pools.ref_count.shape[1] * page_size
  shard = jnp.arange(local.shape[0], dtype=jnp.int32)[:, None]
  return jnp.where(local >= 0, local + shard * shard_slots, -1).reshape(-1)


def pools_block_table(pools: PagePool):
  """(block_table int32 [dp * max_seqs, max_pages_per_seq] of global block ids, seq_lens
  int32 [dp * max_seqs]): every shard's sequences in shard order, as
  :func:`jkv.sharded_ops.sharded_attend` with ``dp_axis`` wants them."""
  table = pools_global_pages(pools, pools.block_table)
  return table.reshape(-1, table.shape[-1]), pools.seq_lens.reshape(-1)
