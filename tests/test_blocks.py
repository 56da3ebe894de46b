"""copy_blocks (reference; no kernel yet) and copy-on-write with PagePool end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import layout as layout_lib
from conftest import bits


def numpy_copy(cache, pairs):
  """Independent model: read all sources, then write destinations in order."""
  cache = np.array(cache)
  pairs = [(int(s), int(d)) for s, d in np.asarray(pairs) if s >= 0 and d >= 0]
  blocks = [cache[s].copy() for s, _ in pairs]
  for (_, d), block in zip(pairs, blocks):
    cache[d] = block
  return cache


@pytest.mark.parametrize("layout,dtype", [("vllm", jnp.bfloat16), ("asm", jnp.float8_e4m3fn),
                                          ("flash", jnp.float32), ("packed", jnp.int8)])
def test_copy_blocks_matches_numpy(layout, dtype, rng):
  layers, nb = 3, 12
  shapes = layout_lib.cache_shapes(layout, nb, 16, 2, 64, dtype)
  def cache(shape):
    return jnp.asarray(rng.integers(0, 256, shape, dtype=np.uint8)).view(dtype) \
        if np.dtype(dtype).itemsize == 1 else jnp.asarray(rng.standard_normal(shape), dtype)
  keys = [cache(shapes[0]) for _ in range(layers)]
  values = None if shapes[1] is None else [cache(shapes[1]) for _ in range(layers)]
  # a swap (3 <-> 4: both read before written), a chain (5 -> 6 -> 7), a skipped pair, and a
  # duplicate destination (the later pair wins)
  pairs = jnp.array([[3, 4], [4, 3], [5, 6], [6, 7], [-1, 2], [1, 9], [2, 9]], jnp.int32)
  k_out, v_out = jkv.copy_blocks(keys, values, pairs)
  for got, old in zip(k_out + (v_out or []), keys + (values or [])):
    np.testing.assert_array_equal(bits(got), bits(numpy_copy(old, pairs)))
  jitted = jax.jit(lambda k, v, p: jkv.copy_blocks(k, v, p))(keys, values, pairs)
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves((k_out, v_out))):
    np.testing.assert_array_equal(bits(a), bits(b))


def test_copy_blocks_errors_and_no_copy(rng):
  kc = jnp.zeros((8, 16, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"block_mapping\[1, 1\] = 8 is out of range"):
    jkv.copy_blocks([kc], [kc], jnp.array([[0, 1], [2, 8]]))
  with pytest.raises(ValueError, match=r"block_mapping must be \[num_pairs, 2\]"):
    jkv.copy_blocks([kc], [kc], jnp.array([[0, 1, 2]]))
  with pytest.raises(ValueError, match="every cache must have 8 blocks on axis 0"):
    jkv.copy_blocks([kc], [kc[:4]], jnp.array([[0, 1]]))
  with pytest.raises(NotImplementedError, match="no Pallas kernel"):
    jkv.copy_blocks([kc], [kc], jnp.array([[0, 1]]), backend="pallas")
  big = jnp.asarray(rng.standard_normal((512, 16, 4, 128)), jnp.float32)
  fn = jax.jit(lambda k, v: jkv.copy_blocks([k], [v], jnp.array([[1, 2], [3, 4]])),
               donate_argnums=(0, 1))
  memory = fn.lower(big, big).compile().memory_analysis()
  if memory is not None:
    assert memory.temp_size_in_bytes < big.nbytes // 4, memory


@pytest.mark.parametrize("mode", [dict(layout="flash", dtype=jnp.float32),
                                  dict(layout="vllm", quant="token", kv_cache_dtype="fp8",
                                       dtype=jnp.float32),
                                  dict(layout="hnd", quant="mxfp4", dtype=jnp.float32)])
def test_fork_copy_on_write_end_to_end(mode, rng):
  """PagePool fork + append gives copy pairs; PagedKVCache.copy_blocks applies them; then the
  child's new token lands in its own copy and the parent reads back unchanged."""
  bs, heads, head_size = 4, 2, 64
  pool = jkv.PagePool.create(num_pages=10, page_size=bs, max_seqs=2, max_pages_per_seq=4)
  cache = jkv.PagedKVCache.create(10, bs, heads, head_size, num_layers=2, **mode)
  prompt = jnp.asarray(rng.standard_normal((6, heads, head_size)), jnp.float32)
  pool, _ = pool.append(jnp.array([0]), jnp.array([6]))
  slots = pool.slot_mapping(jnp.zeros(6, jnp.int32), jnp.arange(6))
  for layer in range(2):
    cache = cache.write(layer, prompt, prompt, slots)
  pool = pool.fork(jnp.array([0]), jnp.array([1]))
  pool, copies = pool.append(jnp.array([1]), jnp.array([1]))
  assert int(copies[0, 0]) == int(pool.block_table[0, 1]) and int(copies[0, 1]) > 0
  cache = cache.copy_blocks(copies)
  token = jnp.asarray(rng.standard_normal((1, heads, head_size)), jnp.float32) * 3
  slot = pool.slot_mapping(jnp.array([1]), jnp.array([6]))
  for layer in range(2):
    cache = cache.write(layer, token, token, slot)
  for layer in range(2):
    k, _ = cache.gather(layer, pool.block_table, pool.seq_lens)
    np.testing.assert_array_equal(bits(k[0, :6]), bits(k[1, :6]))   # shared prefix, copied page
    assert not np.asarray(k[0, 6:]).any()                            # the parent never saw it
    want = np.concatenate([np.asarray(prompt), np.asarray(token)])
    tolerance = 0.5 if mode.get("quant") == "mxfp4" else 2**-4
    assert np.all(np.abs(np.asarray(k[1, :7]) - want) <= tolerance * np.abs(want).max())
  with pytest.raises(NotImplementedError, match="block scale spans 2 blocks"):
    jkv.PagedKVCache.create(8, bs, heads, head_size, quant="block", kv_cache_dtype="int8",
                            scale_block_tokens=8).copy_blocks(jnp.array([[0, 1]]))
