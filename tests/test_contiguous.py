import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jkv
from jkv.cache import ContiguousKVCache
from conftest import KERNEL, bits


def test_seed_position_tracking_and_errors():
  cache = ContiguousKVCache.create(24, 5, 2, 8)
  assert cache.position.tolist() == [0] and not bool(cache.is_full[0])
  cache = cache.advance(5)
  assert bool(cache.is_full[0]) and cache.remaining_capacity.tolist() == [0]
  with pytest.raises(ValueError, match=r"^KV cache overflow: position 6 exceeds max context "
                     r"length 5 \(tried to advance by 1 tokens\)$"):
    cache.advance(1)
  for bad in (0, -1):
    with pytest.raises(ValueError, match="^num_tokens must be positive$"):
      cache.advance(bad)
  with pytest.raises(ValueError, match=r"^Layer index out of range: 100 \(must be 0-23\)$"):
    cache.update(100, jnp.ones((1, 2, 8)), jnp.ones((1, 2, 8)))
  assert cache.reset().position.tolist() == [0]


def test_reset_zeroes_memory(rng):
  cache = ContiguousKVCache.create(2, 6, 2, 8, dtype=jnp.float32)
  cache = cache.update(1, jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32),
                       jnp.ones((3, 2, 8)), backend=KERNEL).advance(3)
  assert np.asarray(cache.keys).any()
  cache = cache.reset()
  assert not np.asarray(cache.keys).any() and not np.asarray(cache.values).any()


def test_prefill_then_decode_batch_matches_numpy(rng):
  layers, batch, max_len, heads, dim = 3, 2, 12, 2, 16
  cache = ContiguousKVCache.create(layers, max_len, heads, dim, dtype=jnp.float32,
                                   batch_size=batch)
  expected_k = np.zeros((layers, batch, max_len, heads, dim), np.float32)
  prompt = rng.standard_normal((layers, batch, 5, heads, dim)).astype(np.float32)
  for layer in range(layers):
    cache = cache.update(layer, prompt[layer], -prompt[layer], backend=KERNEL)
  expected_k[:, :, :5] = prompt
  cache = cache.advance(jnp.asarray([5, 5]))

  @jax.jit
  def decode(cache, tokens):
    for layer in range(layers):
      cache = cache.update(layer, tokens[layer], -tokens[layer], backend=KERNEL)
    return cache.advance(1)

  for step in range(4):
    tokens = rng.standard_normal((layers, batch, 1, heads, dim)).astype(np.float32)
    cache = decode(cache, tokens)
    expected_k[:, :, 5 + step] = tokens[:, :, 0]
  assert cache.position.tolist() == [9, 9]
  np.testing.assert_array_equal(np.asarray(cache.keys), expected_k)
  np.testing.assert_array_equal(np.asarray(cache.values), -expected_k)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_update_kv_cache_kernel_vs_reference(dtype, head_dim, rng):
  batch, max_len, heads, tokens = 3, 17, 2, 5
  cache = jnp.asarray(rng.standard_normal((batch, max_len, heads, head_dim)), dtype)
  new = jnp.asarray(rng.standard_normal((batch, tokens, heads, head_dim)), jnp.float32)
  position = jnp.asarray([0, 12, 7], jnp.int32)
  outs = [jkv.update_kv_cache(cache, cache + 1, new, new * 2, position, backend=b)
          for b in ("reference", KERNEL)]
  for a, b in zip(*outs):
    np.testing.assert_array_equal(bits(a), bits(b))
  expected = np.asarray(cache).copy()
  for b in range(batch):
    expected[b, int(position[b]):int(position[b]) + tokens] = np.asarray(new[b].astype(dtype))
  np.testing.assert_array_equal(bits(outs[0][0]), bits(expected))


def test_update_kv_cache_single_sequence_and_overflow(rng):
  cache = jnp.asarray(rng.standard_normal((8, 2, 64)), jnp.float32)
  new = jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.float32)
  k, _ = jkv.update_kv_cache(cache, cache, new, new, 2, backend=KERNEL)
  np.testing.assert_array_equal(np.asarray(k[2:5]), np.asarray(new))
  np.testing.assert_array_equal(np.asarray(k[5:]), np.asarray(cache[5:]))
  with pytest.raises(ValueError, match="KV cache overflow: position 9 exceeds max context length 8"):
    jkv.update_kv_cache(cache, cache, new, new, 6)
  with pytest.raises(ValueError, match="KV cache overflow"):  # would wrap to 0 as int32
    jkv.update_kv_cache(cache, cache, new, new, np.int64(2**32))
  for backend in ("reference", KERNEL):  # under jit: the tail past the end is dropped
    k, _ = jax.jit(lambda p: jkv.update_kv_cache(cache, cache, new, new, p, backend=backend))(6)
    np.testing.assert_array_equal(np.asarray(k[6:]), np.asarray(new[:2]))
    np.testing.assert_array_equal(np.asarray(k[:6]), np.asarray(cache[:6]))


def test_checkify_reports_overflow_and_bad_layer_under_jit():
  cache = ContiguousKVCache.create(2, 4, 1, 8, dtype=jnp.float32)

  def step(cache, n, layer):
    cache = cache.update(layer, jnp.ones((1, 1, 8)), jnp.ones((1, 1, 8)))
    return cache.advance(n)

  checked = jax.jit(checkify.checkify(step))
  err, _ = checked(cache, 2, 0)
  err.throw()  # fine
  err, _ = checked(cache, 5, 0)
  with pytest.raises(checkify.JaxRuntimeError, match="KV cache overflow: position 5 exceeds"):
    err.throw()
  err, _ = checked(cache, 0, 0)
  with pytest.raises(checkify.JaxRuntimeError, match="num_tokens must be positive"):
    err.throw()
  err, _ = checked(cache, 1, 7)
  with pytest.raises(checkify.JaxRuntimeError, match=r"Layer index out of range: 7 \(must be 0-1\)"):
    err.throw()
  # Plain jit (no checkify): no error, and nothing is written to another layer.
  out = jax.jit(step)(cache, 1, 7)
  assert not np.asarray(out.keys).any()


def test_advance_and_checked_writes_never_wrap_int32():
  """Advancing by nearly 2**31 (or by an int64 count past int32) raises eagerly and under
  checkify, where position + num_tokens would wrap to a small or negative int32."""
  cache = ContiguousKVCache.create(1, 8, 1, 4, dtype=jnp.float32).advance(5)
  with pytest.raises(ValueError, match="KV cache overflow: position 2147483652 exceeds"):
    cache.advance(2**31 - 1)
  with pytest.raises(ValueError, match=r"num_tokens = 4294967297 does not fit in int32"):
    cache.advance(np.int64(2**32 + 1))
  err, _ = jax.jit(checkify.checkify(lambda c, n: c.advance(n)))(cache, jnp.int32(2**31 - 1))
  with pytest.raises(checkify.JaxRuntimeError, match="KV cache overflow"):
    err.throw()
  keys = jnp.zeros((1, 8, 1, 4))
  checked = jax.jit(checkify.checkify(lambda p: jkv.checked.checked_update_kv_cache(
      keys, keys, jnp.ones((1, 3, 1, 4)), jnp.ones((1, 3, 1, 4)), p)))
  err, _ = checked(jnp.int32(2**31 - 2))
  with pytest.raises(checkify.JaxRuntimeError, match="KV cache overflow"):
    err.throw()
