"""Saving / loading cache pytrees, and donation semantics of a donated cache."""

import json
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import persist
from jkv.cache import ContiguousKVCache, PagedKVCache
from conftest import bits


def filled(cache, rng):
  """The cache with random (never zero) contents in every array, NaN and -0 included."""
  def fill(a):
    if a is None:
      return None
    raw = rng.integers(0, 256, a.size * a.dtype.itemsize, dtype=np.uint8)
    if np.dtype(a.dtype).kind == "f" and a.dtype.itemsize >= 2:
      values = rng.standard_normal(a.size).astype(a.dtype)
      if values.size >= 2:
        values.reshape(-1)[:2] = [np.nan, -0.0]
      return jnp.asarray(values.reshape(a.shape))
    return jnp.asarray(raw.view(a.dtype).reshape(a.shape))
  return jax.tree.map(fill, cache, is_leaf=lambda x: x is None)


CACHES = {
    "flash-bf16": lambda: PagedKVCache.create(4, 16, 2, 64, num_layers=2, layout="flash"),
    "vllm-fp8": lambda: PagedKVCache.create(4, 16, 2, 64, layout="vllm", kv_cache_dtype="fp8",
                                            k_scale=jnp.array([0.1, 0.2]), v_scale=0.5),
    "packed-block-int8": lambda: PagedKVCache.create(4, 16, 2, 64, layout="packed",
                                                     quant="block", kv_cache_dtype="int8",
                                                     scale_block_tokens=32),
    "mxfp4": lambda: PagedKVCache.create(4, 16, 2, 64, layout="hnd", quant="mxfp4"),
    "nvfp4": lambda: PagedKVCache.create(4, 16, 2, 64, layout="hnd", quant="nvfp4",
                                         k_global_scale=0.01, v_global_scale=0.02),
    "contiguous": lambda: ContiguousKVCache.create(2, 8, 2, 64, batch_size=3),
    "page-pool": lambda: jkv.PagePool.create(num_pages=9, page_size=4, max_seqs=3,
                                             max_pages_per_seq=2),
    "prefix-caching-pool": lambda: jkv.PagePool.create(num_pages=9, page_size=4, max_seqs=3,
                                                       max_pages_per_seq=2,
                                                       prefix_caching=True),
}


@pytest.mark.parametrize("name", CACHES)
def test_round_trip_is_exact(name, tmp_path, rng):
  cache = filled(CACHES[name](), rng)
  path = tmp_path / "cache.npz"
  jkv.save(path, cache)
  for loaded in (jkv.load(path), jkv.load(path, like=cache)):
    assert type(loaded) is type(cache)
    assert jax.tree.structure(loaded) == jax.tree.structure(cache)   # static fields too
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(cache)):
      assert a.dtype == b.dtype and a.shape == b.shape
      np.testing.assert_array_equal(bits(a), bits(b))


def test_loaded_cache_works(tmp_path, rng):
  cache = PagedKVCache.create(4, 16, 2, 64, layout="asm", quant="token", kv_cache_dtype="fp8")
  key = jnp.asarray(rng.standard_normal((5, 2, 64)), jnp.float32)
  cache = cache.write(0, key, key, jnp.arange(5, dtype=jnp.int32) + 16)
  jkv.save(tmp_path / "c.npz", cache)
  loaded = jkv.load(tmp_path / "c.npz")
  table, lens = jnp.array([[1]], jnp.int32), jnp.array([5], jnp.int32)
  for a, b in zip(loaded.gather(0, table, lens), cache.gather(0, table, lens)):
    np.testing.assert_array_equal(bits(a), bits(b))


def test_a_loaded_prefix_cache_still_matches(tmp_path):
  pool = jkv.PagePool.create(16, 4, 2, 4, prefix_caching=True)
  prompt = jnp.arange(9, dtype=jnp.int32)[None]
  pool, _ = pool.append([0], [9])
  pool = pool.cache_pages([0], prompt).free([0])
  jkv.save(tmp_path / "pool.npz", pool)
  loaded = jkv.load(tmp_path / "pool.npz", like=pool)
  assert int(loaded.match_prefix([1], prompt, [9])[1][0]) == 8
  with pytest.raises(ValueError, match="fields"):     # a template without the prefix cache
    jkv.load(tmp_path / "pool.npz", like=jkv.PagePool.create(16, 4, 2, 4))


def rewrite(path, change):
  """Rewrites a saved file through change(dict of arrays) (header bytes included)."""
  with np.load(path) as archive:
    arrays = {k: archive[k] for k in archive.files}
  change(arrays)
  with open(path, "wb") as f:
    np.savez(f, **arrays)


def header_of(arrays):
  return json.loads(arrays[persist._HEADER].tobytes().decode())


def set_header(arrays, header):
  arrays[persist._HEADER] = np.frombuffer(json.dumps(header).encode(), np.uint8)


def test_refuses_corrupted_and_foreign_files(tmp_path, rng):
  cache = filled(CACHES["vllm-fp8"](), rng)
  path = tmp_path / "c.npz"

  def fresh():
    jkv.save(path, cache)
    return path

  def flip(arrays):
    arrays["key_cache"] = arrays["key_cache"].copy()
    arrays["key_cache"][7] ^= 1
  rewrite(fresh(), flip)
  with pytest.raises(ValueError, match="checksum mismatch"):
    jkv.load(path)

  def edit_static(arrays):   # a consistent-looking header edit is caught by the checksum too
    header = header_of(arrays)
    header["static"]["layout"] = "asm"
    set_header(arrays, header)
  rewrite(fresh(), edit_static)
  with pytest.raises(ValueError, match="checksum mismatch"):
    jkv.load(path)

  def drop(arrays):
    del arrays["value_cache"]
  rewrite(fresh(), drop)
  with pytest.raises(ValueError, match="array 'value_cache' is missing"):
    jkv.load(path)

  def truncate(arrays):
    arrays["k_scale"] = arrays["k_scale"][:-1]
  rewrite(fresh(), truncate)
  with pytest.raises(ValueError, match=r"array 'k_scale' holds 7 bytes, its header says \[2\]"):
    jkv.load(path)

  def version(arrays):
    header = header_of(arrays)
    header["version"] = 99
    set_header(arrays, header)
  rewrite(fresh(), version)
  with pytest.raises(ValueError, match="format version 99; this jkv reads version 1"):
    jkv.load(path)

  other = tmp_path / "other.npz"
  np.savez(other, x=np.zeros(3))
  with pytest.raises(ValueError, match="is not a jkv cache file"):
    jkv.load(other)
  junk = tmp_path / "junk.npz"
  junk.write_bytes(b"not a zip file")
  with pytest.raises(ValueError, match="not a readable .npz file"):
    jkv.load(junk)
  half = tmp_path / "half.npz"
  half.write_bytes(fresh().read_bytes()[:200])
  with pytest.raises(ValueError, match="not a readable .npz file|not a jkv cache file"):
    jkv.load(half)
  assert zipfile.is_zipfile(fresh())


def test_refuses_mismatch_with_template(tmp_path, rng):
  cache = filled(CACHES["vllm-fp8"](), rng)
  jkv.save(tmp_path / "c.npz", cache)
  with pytest.raises(ValueError, match="holds a PagedKVCache, expected a ContiguousKVCache"):
    jkv.load(tmp_path / "c.npz", like=CACHES["contiguous"]())
  with pytest.raises(ValueError, match="layout is 'vllm', expected 'asm'"):
    jkv.load(tmp_path / "c.npz", like=PagedKVCache.create(4, 16, 2, 64, layout="asm",
                                                          kv_cache_dtype="fp8"))
  bigger = PagedKVCache.create(8, 16, 2, 64, layout="vllm", kv_cache_dtype="fp8",
                               k_scale=jnp.array([0.1, 0.2]), v_scale=0.5)
  with pytest.raises(ValueError, match=r"key_cache is \(1, 4, 2, 4, 16, 16\) float8_e4m3fn, "
                                       r"expected \(1, 8, 2, 4, 16, 16\)"):
    jkv.load(tmp_path / "c.npz", like=bigger)
  with pytest.raises(TypeError, match="save expects one of"):
    jkv.save(tmp_path / "d.npz", {"key": jnp.zeros(3)})


def test_using_a_donated_cache_raises(rng):
  """Donation semantics: the donated input is deleted; using it raises JAX's deleted-buffer
  error, never returns stale data."""
  cache = PagedKVCache.create(4, 16, 2, 64, layout="flash", dtype=jnp.float32)
  key = jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.float32)
  step = jax.jit(lambda c, k, s: c.write(0, k, k, s), donate_argnums=0)
  new = step(cache, key, jnp.array([1, 2, 3], jnp.int32))
  assert cache.key_cache.is_deleted()
  with pytest.raises(RuntimeError, match="deleted"):
    np.asarray(cache.key_cache)
  with pytest.raises((RuntimeError, ValueError), match="deleted"):
    step(cache, key, jnp.array([4, 5, 6], jnp.int32))
  np.testing.assert_array_equal(np.asarray(new.key_cache)[0, 0, 1:4], np.asarray(key))
