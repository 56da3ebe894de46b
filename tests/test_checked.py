"""jkv.checked: value checks under jit through checkify; free without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jkv
from jkv import checked
from jkv.ops import contiguous as contiguous_ops

R = "reference"
NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 4, 16, 2, 16   # 64 slots


def run_checked(fn, *args):
  """(err, out) of fn under jax.jit(checkify.checkify(fn, errors=user_checks))."""
  return jax.jit(checkify.checkify(fn, errors=checkify.user_checks))(*args)


def expect_error(err, message):
  """err holds a user check failure whose message contains ``message``."""
  assert err.get() is not None and message in err.get(), err.get()
  with pytest.raises(checkify.JaxRuntimeError):
    err.throw()


def same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def random_cache(rng):
  cache = jkv.PagedKVCache.create(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, num_layers=2,
                                  layout="flash", dtype=jnp.float32)
  data = lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32)
  return cache.replace(key_cache=data(cache.key_cache), value_cache=data(cache.value_cache))


def tokens(rng, n):
  return (jnp.asarray(rng.standard_normal((n, HEADS, HEAD_SIZE)), jnp.float32),
          jnp.asarray(rng.standard_normal((n, HEADS, HEAD_SIZE)), jnp.float32))


# ---- PagedKVCache.write ---------------------------------------------------------------

def write_step(cache, layer, key, value, slots):
  return checked.checked_write(cache, layer, key, value, slots, backend=R)


def test_write_good_inputs_match_the_op(rng):
  cache, (key, value) = random_cache(rng), tokens(rng, 5)
  slots = jnp.asarray(np.r_[rng.choice(64, 4, replace=False), -1], jnp.int32)
  expected = cache.write(1, key, value, slots, backend=R)
  err, out = run_checked(write_step, cache, jnp.int32(1), key, value, slots)
  assert err.get() is None
  same(out, expected)
  same(jax.jit(write_step)(cache, jnp.int32(1), key, value, slots), expected)   # unchecked


def test_write_reports_a_slot_past_the_cache(rng):
  cache, (key, value) = random_cache(rng), tokens(rng, 4)
  slots = jnp.asarray([3, -1, 64 + int(rng.integers(0, 10)), 5], jnp.int32)
  err, _ = run_checked(write_step, cache, jnp.int32(0), key, value, slots)
  expect_error(err, f"slot_mapping[2] = {int(slots[2])} is out of range: a cache of 4 blocks "
               "x 16 has 64 slots (valid: 0..63, or < 0 for padding)")


def test_write_reports_a_traced_layer_out_of_range(rng):
  cache, (key, value) = random_cache(rng), tokens(rng, 2)
  slots = jnp.asarray([1, 2], jnp.int32)
  for layer in (2, -1):
    err, _ = run_checked(write_step, cache, jnp.int32(layer), key, value, slots)
    expect_error(err, f"layer must be in [0, 2), got {layer}")


# ---- array-level writes ---------------------------------------------------------------

def test_write_kv_checks_slots_and_layer(rng):
  cache, (key, value) = random_cache(rng), tokens(rng, 3)

  def step(kc, vc, layer, slots):
    return checked.checked_write_kv(key, value, kc, vc, slots, layout="flash", layer=layer,
                                    backend=R)

  slots = jnp.asarray([0, 63, -1], jnp.int32)
  expected = jkv.write_kv(key, value, cache.key_cache, cache.value_cache, slots, layout="flash",
                          layer=1, backend=R)
  err, out = run_checked(step, cache.key_cache, cache.value_cache, jnp.int32(1), slots)
  assert err.get() is None
  same(out, expected)
  same(jax.jit(step)(cache.key_cache, cache.value_cache, jnp.int32(1), slots), expected)
  err, _ = run_checked(step, cache.key_cache, cache.value_cache, jnp.int32(1),
                       jnp.asarray([0, 64, -1], jnp.int32))
  expect_error(err, "slot_mapping[1] = 64 is out of range")
  err, _ = run_checked(step, cache.key_cache, cache.value_cache, jnp.int32(5), slots)
  expect_error(err, "layer must be in [0, 2), got 5")


def test_reshape_and_cache_checks_slots(rng):
  key, value = tokens(rng, 3)
  key_cache = jnp.asarray(rng.standard_normal((NUM_BLOCKS, HEADS, HEAD_SIZE // 4, BLOCK_SIZE, 4)),
                          jnp.float32)
  value_cache = jnp.asarray(rng.standard_normal((NUM_BLOCKS, HEADS, HEAD_SIZE, BLOCK_SIZE)),
                            jnp.float32)

  def step(kc, vc, slots):
    return checked.checked_reshape_and_cache(key, value, kc, vc, slots, backend=R)

  slots = jnp.asarray([7, -1, 40], jnp.int32)
  expected = jkv.reshape_and_cache(key, value, key_cache, value_cache, slots, backend=R)
  err, out = run_checked(step, key_cache, value_cache, slots)
  assert err.get() is None
  same(out, expected)
  same(jax.jit(step)(key_cache, value_cache, slots), expected)
  err, _ = run_checked(step, key_cache, value_cache, jnp.asarray([7, 100, 64], jnp.int32))
  expect_error(err, "slot_mapping[1] = 100 is out of range: a cache of 4 blocks x 16")


def test_reshape_and_cache_flash_checks_slots(rng):
  key, value = tokens(rng, 2)
  cache = random_cache(rng)
  key_cache, value_cache = cache.key_cache[0], cache.value_cache[0]

  def step(kc, vc, slots):
    return checked.checked_reshape_and_cache_flash(key, value, kc, vc, slots, backend=R)

  slots = jnp.asarray([9, 12], jnp.int32)
  expected = jkv.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, backend=R)
  err, out = run_checked(step, key_cache, value_cache, slots)
  assert err.get() is None
  same(out, expected)
  err, _ = run_checked(step, key_cache, value_cache, jnp.asarray([9, 80], jnp.int32))
  expect_error(err, "slot_mapping[1] = 80 is out of range")


# ---- PagedKVCache.attend --------------------------------------------------------------

def attend_step(cache, layer, query, block_table, seq_lens):
  return checked.checked_attend(cache, layer, query, block_table, seq_lens, backend=R)


def attend_inputs(rng):
  query = jnp.asarray(rng.standard_normal((2, 4, HEAD_SIZE)), jnp.float32)   # GQA 4 / 2
  block_table = jnp.asarray([[1, 3], [2, 0]], jnp.int32)   # W = 2: up to 32 tokens
  seq_lens = jnp.asarray([int(rng.integers(17, 33)), int(rng.integers(1, 17))], jnp.int32)
  return query, block_table, seq_lens


def test_attend_good_inputs_match_the_op(rng):
  cache = random_cache(rng)
  query, block_table, seq_lens = attend_inputs(rng)
  expected = cache.attend(1, query, block_table, seq_lens, backend=R)
  err, out = run_checked(attend_step, cache, jnp.int32(1), query, block_table, seq_lens)
  assert err.get() is None
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-6)
  out = jax.jit(attend_step)(cache, jnp.int32(1), query, block_table, seq_lens)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-6)
  # A block id outside the cache that seq_lens does not read is fine.
  table = block_table.at[1, 1].set(99)
  err, _ = run_checked(attend_step, cache, jnp.int32(0), query, table, seq_lens)
  assert err.get() is None


def test_attend_reports_seq_lens_past_the_table(rng):
  cache = random_cache(rng)
  query, block_table, seq_lens = attend_inputs(rng)
  for bad in (33, -1):
    lens = seq_lens.at[1].set(bad)
    err, _ = run_checked(attend_step, cache, jnp.int32(0), query, block_table, lens)
    expect_error(err, f"seq_lens[1] = {bad} is out of range: block_table has 2 blocks of 16 "
                 "tokens per sequence (valid: 0..32)")


def test_attend_reports_a_block_read_past_the_cache(rng):
  cache = random_cache(rng)
  query, block_table, seq_lens = attend_inputs(rng)
  for bad in (4, 50, -2):
    table = block_table.at[0, 1].set(bad)
    err, _ = run_checked(attend_step, cache, jnp.int32(0), query, table, seq_lens)
    expect_error(err, f"block_table[0, 1] = {bad} is outside the cache (valid: 0..3) and "
                 f"seq_lens[0] = {int(seq_lens[0])} reads it")


def test_attend_reports_a_traced_layer_out_of_range(rng):
  cache = random_cache(rng)
  query, block_table, seq_lens = attend_inputs(rng)
  err, _ = run_checked(attend_step, cache, jnp.int32(3), query, block_table, seq_lens)
  expect_error(err, "layer must be in [0, 2), got 3")


# ---- PagePool.append ------------------------------------------------------------------

def append_step(pool, seq_ids, num_tokens):
  return checked.checked_append(pool, seq_ids, num_tokens)


def test_append_good_inputs_match_the_op(rng):
  pool = jkv.PagePool.create(6, 4, 3, 3)   # 5 usable pages
  ids = jnp.asarray([0, 2], jnp.int32)
  counts = jnp.asarray(rng.integers(1, 9, 2), jnp.int32)
  expected = pool.append(ids, counts)
  err, out = run_checked(append_step, pool, ids, counts)
  assert err.get() is None
  same(out, expected)
  same(jax.jit(append_step)(pool, ids, counts), expected)
  # Padding ids (< 0) are ignored, not errors.
  err, _ = run_checked(append_step, pool, jnp.asarray([-1, 1], jnp.int32), counts)
  assert err.get() is None


def test_append_reports_an_exhausted_pool(rng):
  pool = jkv.PagePool.create(4, 4, 3, 3)   # 3 usable pages
  pool, _ = pool.append(jnp.asarray([0]), jnp.asarray([int(rng.integers(5, 9))]))  # 2 pages
  err, (out, _) = run_checked(append_step, pool, jnp.asarray([1, 2], jnp.int32),
                              jnp.asarray([4, 4], jnp.int32))
  assert bool(out.out_of_pages)
  expect_error(err, "out of pages: the append needs 2 pages, 1 are free (max_new_pages=6)")


def test_append_reports_a_full_block_table():
  pool = jkv.PagePool.create(10, 4, 2, 2)   # 2 pages per sequence
  err, _ = run_checked(append_step, pool, jnp.asarray([1], jnp.int32), jnp.asarray([9], jnp.int32))
  expect_error(err, "out of pages: sequence 1 would need 3 pages, its block table has 2")


def test_append_reports_a_pool_already_out_of_pages():
  pool = jkv.PagePool.create(3, 4, 2, 4)
  full, _ = jax.jit(lambda p: p.append(jnp.asarray([0]), jnp.asarray([100])))(pool)
  assert bool(full.out_of_pages)
  err, _ = run_checked(append_step, full, jnp.asarray([1], jnp.int32), jnp.asarray([1], jnp.int32))
  expect_error(err, "PagePool.out_of_pages is already set")


def test_append_reports_bad_ids_and_counts():
  pool = jkv.PagePool.create(8, 4, 3, 3)
  err, _ = run_checked(append_step, pool, jnp.asarray([0, 3], jnp.int32), jnp.asarray([1, 1]))
  expect_error(err, "seq_ids[1] = 3 is out of range: the pool has 3 sequence slots")
  err, _ = run_checked(append_step, pool, jnp.asarray([2, 2], jnp.int32), jnp.asarray([1, 1]))
  expect_error(err, "seq_ids has duplicate sequence ids: seq_ids[1] = 2")
  err, _ = run_checked(append_step, pool, jnp.asarray([0, 1], jnp.int32), jnp.asarray([1, -3]))
  expect_error(err, "num_tokens must be >= 0, got num_tokens[1] = -3")


# ---- update_kv_cache ------------------------------------------------------------------

def test_update_kv_cache_reports_overflow(rng):
  keys = jnp.asarray(rng.standard_normal((2, 3, 8, 2, 4)), jnp.float32)   # [L, B, S, H, D]
  new = jnp.asarray(rng.standard_normal((3, 2, 2, 4)), jnp.float32)       # [B, T, H, D]

  def step(layer, position):
    return checked.checked_update_kv_cache(keys, keys, new, new, position, layer=layer,
                                           backend=R)

  position = jnp.asarray([0, 3, 6], jnp.int32)
  expected = contiguous_ops.update_kv_cache(keys, keys, new, new, position, layer=1, backend=R)
  err, out = run_checked(step, jnp.int32(1), position)
  assert err.get() is None
  same(out, expected)
  same(jax.jit(step)(jnp.int32(1), position), expected)
  err, _ = run_checked(step, jnp.int32(1), jnp.asarray([0, 7, 1], jnp.int32))
  expect_error(err, "KV cache overflow: writing 2 tokens at position 7 of sequence 1 exceeds "
               "max context length 8")
  err, _ = run_checked(step, jnp.int32(0), jnp.asarray([0, -2, 1], jnp.int32))
  expect_error(err, "position must be >= 0, got -2")
  err, _ = run_checked(step, jnp.int32(2), position)
  expect_error(err, "layer must be in [0, 2), got 2")


# ---- the unchecked path ---------------------------------------------------------------

def test_unchecked_path_lowers_to_the_plain_op(rng):
  """Without checkify the checks lower to nothing: no host callback in the HLO, and the
  optimized HLO is as big as the plain op's (the predicate arithmetic is dead code)."""
  cache, (key, value) = random_cache(rng), tokens(rng, 3)
  slots = jnp.asarray([1, 2, 3], jnp.int32)
  query, block_table, seq_lens = attend_inputs(rng)
  pool = jkv.PagePool.create(6, 4, 3, 3)
  cases = [
      (write_step, lambda c, l, k, v, s: c.write(l, k, v, s, backend=R),
       (cache, jnp.int32(0), key, value, slots)),
      (attend_step, lambda c, l, q, t, n: c.attend(l, q, t, n, backend=R),
       (cache, jnp.int32(0), query, block_table, seq_lens)),
      (append_step, lambda p, i, n: p.append(i, n),
       (pool, jnp.asarray([0, 1], jnp.int32), jnp.asarray([3, 5], jnp.int32))),
  ]
  for checked_fn, plain_fn, args in cases:
    lowered = jax.jit(checked_fn).lower(*args)
    text = lowered.as_text()
    assert "custom_call" not in text   # a host callback lowers to a custom call
    compiled = lowered.compile().as_text()
    assert "custom-call" not in compiled
    plain = jax.jit(plain_fn).lower(*args).compile().as_text()
    count = lambda hlo: sum(" = " in line for line in hlo.splitlines())
    assert count(compiled) == count(plain), (count(compiled), count(plain))


def test_eager_calls_raise_value_errors(rng):
  """Concrete (eager) bad values raise the ops' ValueError; good ones match the op."""
  cache, (key, value) = random_cache(rng), tokens(rng, 2)
  with pytest.raises(ValueError, match="slot_mapping\\[1\\] = 64 is out of range"):
    checked.checked_write(cache, 0, key, value, jnp.asarray([0, 64]), backend=R)
  slots = jnp.asarray([0, 5])
  same(checked.checked_write(cache, 0, key, value, slots, backend=R),
       cache.write(0, key, value, slots, backend=R))
  with pytest.raises(ValueError, match="out of pages"):
    checked.checked_append(jkv.PagePool.create(2, 4, 1, 4), jnp.asarray([0]), jnp.asarray([9]))
