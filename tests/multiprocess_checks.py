"""Checks of jkv on a simulated cluster: one process of several launched by
``tests/test_multiprocess.py``, each with its own CPU devices, joined by
``jax.distributed`` (a local coordinator, gloo CPU collectives) into one mesh that spans
the processes.

Usage: ``python tests/multiprocess_checks.py PROCESS_ID NUM_PROCESSES PORT DEVICES
TRANSFER_PORT`` (PORT: the coordinator's; TRANSFER_PORT: this process's socket for
cross-process device transfers; every process runs every check; ``--list`` prints the
check names). Prints ``ok CHECK`` or
``FAIL CHECK`` with the traceback per check; exits 1 if any failed. Sharded results are
gathered onto every process (``multihost_utils.process_allgather``) and compared with the
same op run unsharded in this process: bit for bit for writes and copies, to float32
rounding for attention.
"""

from __future__ import annotations

import os
import shutil
import sys
import traceback

CHECKS = ("write", "plain_jit_write", "attend", "copy_blocks", "pools", "ragged",
          "prefill_to_decode", "checkpoint")

if __name__ == "__main__" and sys.argv[1:] != ["--list"]:
  PROCESS, NUM_PROCESSES, PORT, DEVICES, TRANSFER_PORT = (int(a) for a in sys.argv[1:6])
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={DEVICES}")
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import jkv  # noqa: E402
from conftest import assert_same  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, LAYERS = 8, 16, 4, 32, 2


def gathered(tree):
  """Every array of ``tree`` gathered whole onto this process (numpy)."""
  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                      tree)


def mesh_2d():
  """dp over the first mesh dim, tp over the second, spanning every process's devices
  (Auto axes: XLA propagates the cache's sharding through jitted code)."""
  return jax.make_mesh((2, jax.device_count() // 2), ("dp", "tp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def tokens(rng, count):
  return [jnp.asarray(rng.standard_normal((count, HEADS, HEAD_SIZE)) * 3, jnp.bfloat16)
          for _ in range(2)]


def filled(rng):
  """A bf16 cache with every slot of both layers written (unsharded, this process)."""
  cache = jkv.PagedKVCache.create(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, num_layers=LAYERS,
                                  dtype=jnp.bfloat16)
  slots = jnp.arange(NUM_BLOCKS * BLOCK_SIZE, dtype=jnp.int32)
  for layer in range(LAYERS):
    cache = cache.write(layer, *tokens(rng, NUM_BLOCKS * BLOCK_SIZE), slots,
                        backend="reference")
  return cache


def check_write():
  """sharded_write (reference and the interpreted kernel) = the unsharded write."""
  rng = np.random.default_rng(1)
  mesh = mesh_2d()
  cache = filled(rng)
  key, value = tokens(rng, 12)
  slots = jnp.asarray(np.r_[rng.permutation(NUM_BLOCKS * BLOCK_SIZE)[:10], -1, -1], jnp.int32)
  want = cache.write(1, key, value, slots, backend="reference")
  for backend in ("reference", "interpret"):
    got = jkv.sharded_write(jkv.shard_cache(cache, mesh, dp_axis="dp"), 1, key, value, slots,
                            mesh, dp_axis="dp", backend=backend)
    assert_same(gathered(got), want, f"sharded_write {backend}")


def check_plain_jit_write():
  """The write kernel under a plain jit on a cache sharded over processes (the
  custom_partitioning rule runs it per shard) = the unsharded write."""
  rng = np.random.default_rng(2)
  mesh = mesh_2d()
  cache = filled(rng)
  key, value = tokens(rng, 9)
  slots = jnp.asarray(rng.permutation(NUM_BLOCKS * BLOCK_SIZE)[:9], jnp.int32)
  want = cache.write(0, key, value, slots, backend="reference")
  write = jax.jit(lambda c: c.write(0, key, value, slots, backend="interpret"))
  got = write(jkv.shard_cache(cache, mesh, dp_axis="dp"))
  assert_same(gathered(got), want, "plain jit write")


def check_attend():
  """sharded_attend over tp and dp (each dp shard's sequences on its own pages) = the
  unsharded decode attention."""
  rng = np.random.default_rng(3)
  mesh = mesh_2d()
  cache = filled(rng)
  half = NUM_BLOCKS // 2   # dp shard i holds blocks [i * half, (i + 1) * half)
  table = jnp.asarray([rng.permutation(half)[:3], half + rng.permutation(half)[:3]], jnp.int32)
  lens = jnp.asarray([40, 29], jnp.int32)
  query = jnp.asarray(rng.standard_normal((2, 2 * HEADS, HEAD_SIZE)), jnp.bfloat16)
  want = cache.attend(1, query, table, lens, backend="reference")
  for backend in ("reference", "interpret"):
    got = jkv.sharded_attend(jkv.shard_cache(cache, mesh, dp_axis="dp"), 1, query, table, lens,
                             mesh, dp_axis="dp", backend=backend)
    np.testing.assert_allclose(np.asarray(gathered(got), np.float32),
                               np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def check_copy_blocks():
  """sharded_copy_blocks with pairs inside each dp shard = the unsharded copy."""
  rng = np.random.default_rng(4)
  mesh = mesh_2d()
  cache = filled(rng)
  pairs = jnp.asarray([[0, 3], [2, 1], [5, 7], [6, 4], [-1, -1]], jnp.int32)
  want = cache.copy_blocks(pairs, backend="reference")
  got = jkv.sharded_copy_blocks(jkv.shard_cache(cache, mesh, dp_axis="dp"), pairs, mesh,
                                dp_axis="dp", backend="interpret")
  assert_same(gathered(got), want, "sharded_copy_blocks")


def check_pools():
  """A page pool per dp shard: decode steps append, write through split_tokens and attend,
  equal to the same steps with the pools and the cache on this process alone."""
  rng = np.random.default_rng(5)
  mesh = mesh_2d()
  dp = 2
  pool = jkv.PagePool.create(NUM_BLOCKS // dp, BLOCK_SIZE, 2, 4)
  ids = jnp.asarray([[0, 1], [0, 1]], jnp.int32)
  query = jnp.asarray(rng.standard_normal((dp * 2, 2 * HEADS, HEAD_SIZE)), jnp.bfloat16)

  def run(cache, pools, sharded):
    outs = []
    for step in range(3):
      key = jnp.asarray(rng.standard_normal((dp * 2, HEADS, HEAD_SIZE)), jnp.bfloat16)
      pools, _ = jkv.sharded_pools.pools_append(pools, ids, jnp.ones_like(ids))
      positions = pools.seq_lens[jnp.arange(dp)[:, None], ids] - 1
      slots = jkv.sharded_pools.pools_slot_mapping(pools, ids, positions)
      table, lens = jkv.sharded_pools.pools_block_table(pools)
      if sharded:
        cache = jkv.sharded_write(cache, 0, key, -key, slots, mesh, dp_axis="dp",
                                  split_tokens=True, backend="reference")
        outs.append(jkv.sharded_attend(cache, 0, query, table, lens, mesh, dp_axis="dp",
                                       backend="reference"))
      else:
        cache = cache.write(0, key, -key, slots, backend="reference")
        outs.append(cache.attend(0, query, table, lens, backend="reference"))
    return cache, outs

  cache = jkv.PagedKVCache.create(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, num_layers=1,
                                  dtype=jnp.bfloat16)
  state = rng.bit_generator.state
  want_cache, want = run(cache, jax.tree.map(lambda x: jnp.broadcast_to(x, (dp,) + x.shape),
                                             pool), False)
  rng.bit_generator.state = state   # the same keys for the sharded run
  got_cache, got = run(jkv.shard_cache(cache, mesh, dp_axis="dp"),
                       jkv.sharded_pools.shard_pools(pool, mesh), True)
  assert_same(gathered(got_cache), want_cache, "pools: cache")
  for step, (g, w) in enumerate(zip(got, want)):
    np.testing.assert_allclose(np.asarray(gathered(g), np.float32), np.asarray(w, np.float32),
                               rtol=2e-2, atol=2e-2, err_msg=f"pools: step {step}")


def check_ragged():
  """ragged_paged_attention under a plain jit on a cache sharded over processes (XLA
  gathers what it needs) = the unsharded call."""
  rng = np.random.default_rng(6)
  mesh = mesh_2d()
  cache = filled(rng)
  table = jnp.asarray([[0, 5, 2], [7, 1, 4]], jnp.int32)
  kv_lens, cu_q_lens = jnp.asarray([37, 20], jnp.int32), jnp.asarray([0, 5, 6], jnp.int32)
  query = jnp.asarray(rng.standard_normal((6, 2 * HEADS, HEAD_SIZE)), jnp.bfloat16)
  attend = jax.jit(lambda c: c.attend_ragged(1, query, table, kv_lens, cu_q_lens,
                                             backend="reference"))
  want = attend(cache)
  got = attend(jkv.shard_cache(cache, mesh, dp_axis="dp"))
  np.testing.assert_allclose(np.asarray(gathered(got), np.float32),
                             np.asarray(want, np.float32), rtol=1e-6, atol=1e-6)


def check_prefill_to_decode():
  """Disaggregated serving: a prefill mesh (the first half of the processes' devices) and
  a decode mesh (the other half), each with its own cache and page pool. A request is
  prefilled on the prefill side; its pages (every layer of a page together) move to pages
  the decode pool allocates, in one cross-process ``jax.device_put``; decode attention
  then runs on the decode side and equals attention over one unsharded cache holding the
  same request."""
  rng = np.random.default_rng(7)
  devices = np.array(jax.devices())
  half = len(devices) // 2
  prefill_mesh, decode_mesh = Mesh(devices[:half], ("tp",)), Mesh(devices[half:], ("tp",))
  prompt = 37
  key, value = [jnp.asarray(rng.standard_normal((prompt, HEADS, HEAD_SIZE)), jnp.bfloat16)
                for _ in range(2)]
  query = jnp.asarray(rng.standard_normal((1, 2 * HEADS, HEAD_SIZE)), jnp.bfloat16)
  empty = jkv.PagedKVCache.create(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, num_layers=LAYERS,
                                  dtype=jnp.bfloat16)

  # Prefill side: its pool's pages for the request, the prompt written into every layer.
  prefill_pool, _ = jkv.PagePool.create(NUM_BLOCKS, BLOCK_SIZE, 2, 4).append(
      jnp.asarray([1]), jnp.asarray([prompt]))
  prefill_pages = prefill_pool.block_table[1, :3]
  slots = prefill_pool.slot_mapping(jnp.ones((prompt,), jnp.int32),
                                    jnp.arange(prompt, dtype=jnp.int32))
  prefill = jkv.shard_cache(empty, prefill_mesh)
  for layer in range(LAYERS):
    prefill = jkv.sharded_write(prefill, layer, key, value, slots, prefill_mesh,
                                backend="reference")

  # Decode side: its own pool allocates pages (other ids); one transfer for all layers.
  decode_pool = jkv.PagePool.create(NUM_BLOCKS, BLOCK_SIZE, 2, 4)
  decode_pool, _ = decode_pool.append(jnp.asarray([0]), jnp.asarray([20]))   # another request
  decode_pool, _ = decode_pool.append(jnp.asarray([1]), jnp.asarray([prompt]))
  decode_pages = decode_pool.block_table[1, :3]
  take = jax.jit(lambda c: (c.key_cache[:, prefill_pages], c.value_cache[:, prefill_pages]))
  moved = take(prefill)   # [L, 3, bs, H, D] each, heads over the prefill mesh's tp
  spec = PartitionSpec(None, None, None, "tp", None)
  moved = jax.device_put(moved, NamedSharding(decode_mesh, spec))
  decode = jkv.shard_cache(empty, decode_mesh)
  place = jax.jit(lambda c, k, v: c.replace(key_cache=c.key_cache.at[:, decode_pages].set(k),
                                            value_cache=c.value_cache.at[:, decode_pages].set(v)))
  decode = place(decode, *moved)
  table = decode_pool.block_table[1:2, :3]
  lens = jnp.asarray([prompt], jnp.int32)
  got = jkv.sharded_attend(decode, 1, query, table, lens, decode_mesh, backend="reference")

  # The same request in one unsharded cache on this process.
  local_slots = decode_pool.slot_mapping(jnp.ones((prompt,), jnp.int32),
                                         jnp.arange(prompt, dtype=jnp.int32))
  want = empty.write(1, key, value, local_slots, backend="reference").attend(
      1, query, table, lens, backend="reference")
  decode_side = PROCESS >= NUM_PROCESSES // 2
  assert (len(got.addressable_shards) > 0) == decode_side, (PROCESS, got.sharding)
  for shard in got.addressable_shards:   # decode-side processes check their heads
    np.testing.assert_allclose(np.asarray(shard.data, np.float32),
                               np.asarray(want[shard.index], np.float32), rtol=2e-2,
                               atol=2e-2)


def check_checkpoint():
  """save_sharded of a cache sharded over every process (each writes its shards), then
  load_sharded onto another mesh (dp and tp swapped in size): the same bytes as the
  unsharded cache; and a page pool per dp shard (prefix caching on) round-trips."""
  rng = np.random.default_rng(9)
  cache = filled(rng)
  directory = f"/tmp/jkv_multiprocess_ckpt_{PORT}/cache"   # one path for every process
  jkv.save_sharded(directory, jkv.shard_cache(cache, mesh_2d(), dp_axis="dp"), overwrite=True)
  other = jax.make_mesh((jax.device_count() // 2, 2), ("dp", "tp"),
                        axis_types=(jax.sharding.AxisType.Auto,) * 2)
  like = jkv.shard_cache(jax.tree.map(jnp.zeros_like, cache), other, dp_axis="dp")
  loaded = jkv.load_sharded(directory, like)
  for got, template in zip(jax.tree.leaves(loaded), jax.tree.leaves(like)):
    assert got.sharding == template.sharding
  assert_same(gathered(loaded), cache, "load_sharded onto another mesh")
  pool = jkv.PagePool.create(NUM_BLOCKS // 2, BLOCK_SIZE, 2, 4, prefix_caching=True)
  pools = jkv.sharded_pools.shard_pools(pool, mesh_2d())
  pools, _ = jkv.sharded_pools.pools_append(pools, jnp.asarray([[0, 1], [1, -1]], jnp.int32),
                                            jnp.asarray([[5, 17], [33, 0]], jnp.int32))
  pools_directory = f"/tmp/jkv_multiprocess_ckpt_{PORT}/pools"
  jkv.save_sharded(pools_directory, pools, overwrite=True)
  assert_same(gathered(jkv.load_sharded(pools_directory, pools)), gathered(pools),
              "load_sharded of per-dp pools")
  multihost_utils.sync_global_devices("checkpoint read")
  if jax.process_index() == 0:
    shutil.rmtree(os.path.dirname(directory))


def main() -> int:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{TRANSFER_PORT}")
  jax.distributed.initialize(f"localhost:{PORT}", num_processes=NUM_PROCESSES,
                             process_id=PROCESS, initialization_timeout=120)
  assert jax.process_count() == NUM_PROCESSES and jax.device_count() == NUM_PROCESSES * DEVICES
  failed = 0
  for name in CHECKS:
    try:
      globals()[f"check_{name}"]()
    except Exception:   # report every failing check, then fail the run
      failed += 1
      print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    else:
      print(f"ok {name}", flush=True)
  jax.distributed.shutdown()
  return 1 if failed else 0


if __name__ == "__main__":
  if sys.argv[1:] == ["--list"]:
    print("\n".join(CHECKS))
    sys.exit(0)
  sys.exit(main())
