"""Host offload tier: sequences go to pinned_host memory and come back bit-exact, with the
page pool and host tables consistent."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from conftest import KERNEL, bits

BS, HEADS, HEAD_SIZE = 4, 2, 32


def _fill(pool, cache, seq_ids, lengths, rng):
  """Appends random prompts for seq_ids to pool and cache (every layer)."""
  pool, _ = pool.append(jnp.asarray(seq_ids), jnp.asarray(lengths))
  for s, n in zip(seq_ids, lengths):
    slots = pool.slot_mapping(jnp.full((n,), s, jnp.int32), jnp.arange(n, dtype=jnp.int32))
    for layer in range(cache.num_layers):
      k = jnp.asarray(rng.standard_normal((n, HEADS, HEAD_SIZE)), jnp.float32)
      cache = cache.write(layer, k, -k, slots)
  return pool, cache


def _contents(pool, cache):
  return [tuple(np.asarray(x) for x in cache.gather(layer, pool.block_table, pool.seq_lens))
          for layer in range(cache.num_layers)]


@pytest.mark.parametrize("backend", ["reference", KERNEL])
@pytest.mark.parametrize("mode", [dict(layout="vllm", dtype=jnp.float32),
                                  dict(layout="flash", quant="token", kv_cache_dtype="fp8",
                                       dtype=jnp.float32),
                                  dict(layout="hnd", quant="nvfp4", dtype=jnp.float32)])
def test_offload_and_reload_round_trip(mode, backend, rng):
  pool = jkv.PagePool.create(num_pages=12, page_size=BS, max_seqs=4, max_pages_per_seq=4)
  cache = jkv.PagedKVCache.create(12, BS, HEADS, HEAD_SIZE, num_layers=2, **mode)
  host = jkv.HostKVCache.create(cache, num_blocks=9, max_seqs=4, max_pages_per_seq=4)
  pool, cache = _fill(pool, cache, [0, 1, 2], [5, 7, 3], rng)
  before = _contents(pool, cache)
  free_before = int(pool.num_free_pages)
  pool, host = host.offload(pool, cache, [1, 2], backend=backend)
  assert int(pool.num_free_pages) == free_before + 3          # 2 + 1 pages back to the pool
  assert host.num_free_blocks == 9 - 3
  np.testing.assert_array_equal(host.seq_lens[:3], [0, 7, 3])
  assert np.asarray(pool.seq_lens)[1] == 0
  for name in cache.block_array_names():
    assert getattr(host.cache, name).sharding.memory_kind == "pinned_host"
  # the freed pages are reused (overwritten) by a new sequence
  pool, cache = _fill(pool, cache, [3], [12], rng)
  assert int(pool.num_free_pages) == free_before + 3 - 3
  pool, cache, host = host.reload(pool, cache, [2, 1], backend=backend)
  assert host.num_free_blocks == 9 and not host.seq_lens.any()
  after = _contents(pool, cache)
  for layer in range(2):
    for b, a in zip(before[layer], after[layer]):
      for seq in (0, 1, 2):
        np.testing.assert_array_equal(bits(a[seq]), bits(b[seq]))


def test_offload_errors(rng):
  pool = jkv.PagePool.create(num_pages=8, page_size=BS, max_seqs=3, max_pages_per_seq=4)
  cache = jkv.PagedKVCache.create(8, BS, HEADS, HEAD_SIZE, layout="flash", dtype=jnp.float32)
  host = jkv.HostKVCache.create(cache, num_blocks=2, max_seqs=3, max_pages_per_seq=4)
  pool, cache = _fill(pool, cache, [0, 1], [9, 2], rng)
  with pytest.raises(ValueError, match="out of host blocks: need 3, 2 free"):
    host.offload(pool, cache, [0])
  with pytest.raises(ValueError, match="sequence 2 holds no tokens"):
    host.offload(pool, cache, [2])
  with pytest.raises(ValueError, match=r"seq_ids\[0\] = 5 is out of range"):
    host.offload(pool, cache, [5])
  with pytest.raises(ValueError, match="duplicate"):
    host.offload(pool, cache, [1, 1])
  pool, host = host.offload(pool, cache, [1])
  with pytest.raises(ValueError, match="sequence 1 already has blocks on the host"):
    host.offload(pool, cache, [1])
  with pytest.raises(ValueError, match="sequence 0 has no blocks on the host"):
    host.reload(pool, cache, [0])
  pool_busy, cache = _fill(pool, cache, [1], [1], rng)
  with pytest.raises(ValueError, match="sequence slot 1 is in use"):
    host.reload(pool_busy, cache, [1])
  other = jkv.PagedKVCache.create(8, BS, HEADS, HEAD_SIZE, layout="vllm", dtype=jnp.float32)
  with pytest.raises(ValueError, match="differ in layout"):
    host.reload(pool, other, [1])
  with pytest.raises(TypeError, match="managed eagerly"):
    jax.jit(lambda p, c: host.offload(p, c, [0]))(pool, cache)
  with pytest.raises(NotImplementedError, match="block scale spans 2 blocks"):
    jkv.HostKVCache.create(jkv.PagedKVCache.create(8, BS, HEADS, HEAD_SIZE, quant="block",
                                                   kv_cache_dtype="int8", scale_block_tokens=8),
                           num_blocks=2, max_seqs=1, max_pages_per_seq=1)
