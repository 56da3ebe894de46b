"""MLACache and IndexerKCache pytrees: stacked layers, traced layer index, write / gather
round trips, the fused RoPE path, use inside a jitted loop with donation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from conftest import KERNEL, bits
from test_mla import within_ulps


@pytest.mark.parametrize("backend", ["reference", KERNEL])
@pytest.mark.parametrize("num_heads,kv_cache_dtype", [(None, "auto"), (2, "auto"),
                                                      (None, "fp8"), (None, "fp8_ds_mla")])
def test_mla_cache_write_gather(num_heads, kv_cache_dtype, backend, rng):
  rank, pe, bs = (128 if kv_cache_dtype == "fp8_ds_mla" else 24), 8, 4
  cache = jkv.MLACache.create(6, bs, rank, pe, num_layers=2, num_heads=num_heads,
                              dtype=jnp.float32, kv_cache_dtype=kv_cache_dtype, scale=0.05)
  heads = () if num_heads is None else (num_heads,)
  kv_c = jnp.asarray(rng.standard_normal((7,) + heads + (rank,)), jnp.float32)
  k_pe = jnp.asarray(rng.standard_normal((7,) + heads + (pe,)), jnp.float32)
  table = jnp.array([[3, 5], [1, 0]], jnp.int32)
  slots = jnp.array([12, 13, 14, 15, 20, 4, 5], jnp.int32)          # seq 0: 5 tokens, seq 1: 2
  step = jax.jit(lambda c, layer: c.write(layer, kv_c, k_pe, slots, backend=backend),
                 donate_argnums=0)
  cache = step(cache, jnp.int32(1))
  got_c, got_pe = cache.gather(1, table, jnp.array([5, 2]))
  want_c = np.zeros((2, 8) + heads + (rank,), np.float32)
  want_pe = np.zeros((2, 8) + heads + (pe,), np.float32)
  want_c[0, :5], want_c[1, :2] = np.asarray(kv_c)[:5], np.asarray(kv_c)[5:]
  want_pe[0, :5], want_pe[1, :2] = np.asarray(k_pe)[:5], np.asarray(k_pe)[5:]
  if kv_cache_dtype == "auto":
    np.testing.assert_array_equal(np.asarray(got_c), want_c)
    np.testing.assert_array_equal(np.asarray(got_pe), want_pe)
  elif kv_cache_dtype == "fp8_ds_mla":    # FP8 latent per 128-value tile, bf16 k_pe
    assert np.all(np.abs(np.asarray(got_c) - want_c) <= 2.0 ** -4 * np.abs(want_c) + 1e-6)
    np.testing.assert_array_equal(
        np.asarray(got_pe), np.asarray(jnp.asarray(want_pe, jnp.bfloat16), np.float32))
  else:                                   # e4m3: half an ulp (2^-4 relative), subnormals
    for got, want in ((got_c, want_c), (got_pe, want_pe)):
      assert np.all(np.abs(np.asarray(got) - want) <= 2.0 ** -4 * np.abs(want) + 0.05 * 2.0 ** -9)
  other_c, _ = cache.gather(0, table, jnp.array([5, 2]))
  assert not np.asarray(other_c).any()                               # layer 0 untouched


def test_mla_cache_fused_rope_matches_op(rng):
  rank, pe, bs, q_heads = 16, 8, 4, 3
  cache = jkv.MLACache.create(4, bs, rank, pe, num_layers=2, dtype=jnp.bfloat16)
  cos, sin = jkv.rope.rope_cache(32, pe, dtype=jnp.bfloat16)
  args = dict(q_nope=jnp.asarray(rng.standard_normal((5, q_heads, rank)), jnp.bfloat16),
              q_pe=jnp.asarray(rng.standard_normal((5, q_heads, pe)), jnp.bfloat16),
              kv_c=jnp.asarray(rng.standard_normal((5, rank)), jnp.bfloat16),
              k_pe=jnp.asarray(rng.standard_normal((5, pe)), jnp.bfloat16),
              slot_mapping=jnp.array([0, 1, 2, -1, 9], jnp.int32),
              positions=jnp.array([0, 1, 2, 3, 31], jnp.int32), cos_cache=cos, sin_cache=sin)
  q_out, new = cache.write_rope(1, **args, is_neox=False, backend="reference")
  q_ref, layer_ref = jkv.fused_qk_rope_concat_and_cache_mla(
      **args, kv_cache=cache.kv_cache[1], k_scale=None, q_scale=None, is_neox=False,
      is_nope_first=True, backend="reference")
  np.testing.assert_array_equal(bits(q_out), bits(q_ref))
  np.testing.assert_array_equal(bits(new.kv_cache[1]), bits(layer_ref))
  np.testing.assert_array_equal(bits(new.kv_cache[0]), bits(cache.kv_cache[0]))
  kv_c, k_pe = new.gather(1, jnp.array([[0, 2]]), jnp.array([5]))
  np.testing.assert_array_equal(bits(kv_c[0, :3]), bits(args["kv_c"][:3]))
  np.testing.assert_array_equal(bits(k_pe[0, :3]), bits(layer_ref[0, :3, rank:]))


def test_indexer_cache_round_trip(rng):
  cache = jkv.IndexerKCache.create(5, 4, 64, quant_block_size=32, num_layers=2)
  k = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
  write = jax.jit(lambda c, k, s, layer: c.write(layer, k, s), donate_argnums=0)
  cache = write(cache, k, jnp.array([8, 9, 10, 11, 4, 5], jnp.int32), jnp.int32(0))
  table, cu = jnp.array([[2, 1], [1, 0]]), jnp.array([0, 6, 6])
  keys = cache.read(0, table, cu, 8)
  x = np.asarray(k)
  err = np.abs(np.asarray(keys)[:6] - x)
  scales = np.abs(x).reshape(6, 2, 32).max(-1) / 448
  bound = 2.0 ** -4 * np.abs(x) + np.repeat(2 * scales, 32, -1) * 2.0 ** -9
  assert np.all(err <= bound)
  assert not np.asarray(keys)[6:].any()
  with pytest.raises(ValueError, match="quant_block_size must divide head_dim=64"):
    jkv.IndexerKCache.create(5, 4, 64, quant_block_size=48)


def test_caches_need_a_layer_and_a_traced_layer_out_of_range_reads_zeros(rng):
  """Every stacked cache's method names a missing layer; MLACache.gather and
  FP4IndexerCache.read with a traced layer past the stack read zeros, as attend does (not
  the last layer)."""
  mla = jkv.MLACache.create(3, 4, 32, 16, num_layers=2, dtype=jnp.float32)
  mla = mla.write(1, jnp.ones((4, 32)), jnp.ones((4, 16)), jnp.arange(4))
  fp4 = jkv.FP4IndexerCache.create(3, 4, 32, num_layers=2)
  fp4 = fp4.write(1, jnp.asarray(rng.standard_normal((4, 32)), jnp.float32), jnp.arange(4))
  table, lens = jnp.array([[0]]), jnp.array([4])
  for read in (jax.jit(lambda layer: mla.gather(layer, table, lens)[0]),
               jax.jit(lambda layer: fp4.read(layer, table, lens))):
    assert np.asarray(read(jnp.int32(1))).any()
    assert not np.asarray(read(jnp.int32(7))).any()
  with pytest.raises(ValueError, match="layer is required"):
    mla.write(None, jnp.ones((1, 32)), jnp.ones((1, 16)), jnp.arange(1))
  with pytest.raises(ValueError, match="layer is required"):
    fp4.read(None, table, lens)
  with pytest.raises(ValueError, match="layer is required"):
    jkv.PagedKVCache.create(4, 16, 2, 32, num_layers=2).gather(None, table, lens)
  with pytest.raises(ValueError, match="num_blocks must be positive, got -2"):
    jkv.FP4IndexerCache.create(-2, 4, 32)


@pytest.mark.parametrize("num_heads", [None, 2])
def test_mla_cache_fp8_split(num_heads, rng):
  """DeepSeek-V4 pool entries: FP8 content with a per-entry scale, bf16 rotated RoPE part."""
  rank, pe, bs = 32, 8, 4
  cache = jkv.MLACache.create(5, bs, rank, pe, num_layers=2, num_heads=num_heads,
                              dtype=jnp.float32, kv_cache_dtype="fp8_split")
  heads = () if num_heads is None else (num_heads,)
  kv_c = rng.standard_normal((6,) + heads + (rank,)).astype(np.float32) * rng.uniform(
      0.01, 40, (6,) + heads + (1,)).astype(np.float32)
  k_pe = rng.standard_normal((6,) + heads + (pe,)).astype(np.float32)
  cos, sin = jkv.rope.rope_cache(16, pe)
  positions = jnp.array([0, 3, 7, 15, 2, 1])
  slots = jnp.array([4, 5, 6, 7, 8, -1], jnp.int32)
  step = jax.jit(lambda c: c.write_split_rope(1, kv_c, k_pe, slots, positions, cos, sin,
                                               is_neox=False), donate_argnums=0)
  cache = step(cache)
  got_c, got_pe = cache.gather(1, jnp.array([[1, 2]]), jnp.array([5]))
  got_c, got_pe = np.asarray(got_c)[0, :5], np.asarray(got_pe)[0, :5]
  entry_scale = np.abs(kv_c[:5]).max(-1, keepdims=True) / 448   # e4m3: 2^-4 relative,
  assert np.all(np.abs(got_c - kv_c[:5])                          # 2^-10 x scale subnormal
                <= 2.0 ** -4 * np.abs(kv_c[:5]) + 2.0 ** -10 * entry_scale + 1e-30)
  from jkv import rope
  pos = np.asarray(positions)[:5]
  rotated = rope.apply_rope(jnp.asarray(k_pe[:5]).reshape(5, -1, pe), cos[pos][:, None],
                            sin[pos][:, None], is_neox=False)
  np.testing.assert_array_equal(
      got_pe, np.asarray(rotated.astype(jnp.bfloat16), np.float32).reshape(got_pe.shape))
  scale = np.asarray(cache.entry_scale[1, 1])                        # block 1: slots 4..7
  amax = np.abs(kv_c[:4]).max(-1)
  np.testing.assert_allclose(scale, amax * np.float32(1 / 448), rtol=1e-6)
  plain = jkv.MLACache.create(5, bs, rank, pe, kv_cache_dtype="fp8_split").write(
      0, jnp.asarray(kv_c[:, 0] if heads else kv_c), jnp.asarray(k_pe[:, 0] if heads else k_pe),
      slots)
  assert plain.rope_cache.dtype == jnp.bfloat16
  with pytest.raises(NotImplementedError, match="use write_split_rope"):
    cache.write_rope(0, None, None, None, None, slots, positions, cos, sin)


@pytest.mark.parametrize("num_heads", [None, 3])
@pytest.mark.parametrize("rotate", [False, True])
def test_mla_cache_fp8_split_kernel_equals_reference(num_heads, rotate, rng):
  """The fp8_split write kernel (interpreter on CPU, compiled on a GPU) == the
  reference: content bytes and entry scales bit for bit, the bf16 RoPE part
  within one ulp (float32 products may fuse differently); NaN / Inf and all-zero entries,
  padding slots; entries not written keep their bytes."""
  rank, pe, bs, blocks = 24, 6, 4, 5
  cache = jkv.MLACache.create(blocks, bs, rank, pe, num_layers=2, num_heads=num_heads,
                              dtype=jnp.float32, kv_cache_dtype="fp8_split")
  poison = lambda a: jax.lax.bitcast_convert_type(jnp.asarray(
      rng.integers(0, 2 ** 8, a.shape + (a.dtype.itemsize,), dtype=np.uint8)
      if a.dtype.itemsize > 1 else rng.integers(0, 2 ** 8, a.shape, dtype=np.uint8)), a.dtype)
  cache = cache.replace(kv_cache=poison(cache.kv_cache),
                        rope_cache=jnp.asarray(rng.standard_normal(cache.rope_cache.shape),
                                               jnp.bfloat16),
                        entry_scale=jnp.asarray(rng.uniform(1, 2, cache.entry_scale.shape),
                                                jnp.float32))
  heads = () if num_heads is None else (num_heads,)
  tokens = 9
  kv_c = rng.standard_normal((tokens,) + heads + (rank,)).astype(np.float32) * rng.uniform(
      1e-3, 60, (tokens,) + heads + (1,)).astype(np.float32)
  kv_c[1] = 0.0
  kv_c[2, ..., 3] = np.nan
  kv_c[3, ..., 5] = np.inf
  k_pe = rng.standard_normal((tokens,) + heads + (pe,)).astype(np.float32)
  slots = jnp.asarray(rng.permutation(blocks * bs)[:tokens].astype(np.int32)).at[4].set(-1)
  positions = jnp.asarray(rng.integers(0, 16, tokens).astype(np.int32))
  cos, sin = jkv.rope.rope_cache(16, pe)

  def write(c, backend):
    if rotate:
      return c.write_split_rope(1, kv_c, k_pe, slots, positions, cos, sin, is_neox=False,
                                backend=backend)
    return c.write(1, kv_c, k_pe, slots, backend=backend)

  got = jax.jit(lambda c: write(c, KERNEL))(cache)
  want = jax.jit(lambda c: write(c, "reference"))(cache)
  np.testing.assert_array_equal(bits(got.kv_cache), bits(want.kv_cache))
  np.testing.assert_array_equal(bits(got.entry_scale), bits(want.entry_scale))
  assert within_ulps(got.rope_cache, want.rope_cache, jnp.bfloat16)
  assert not np.array_equal(bits(want.kv_cache), bits(cache.kv_cache))   # something written
  auto = write(cache, "auto")
  np.testing.assert_array_equal(bits(auto.kv_cache), bits(want.kv_cache))


def test_fp4_indexer_pool(rng):
  """NVFP4 keys with per-block global scales: the pool holds exactly jkv.fp4's encoding of
  each token with its block's global scale, and reads it back through the block table."""
  from jkv import fp4
  cache = jkv.FP4IndexerCache.create(6, 4, 64, num_layers=2)
  k = jnp.asarray(rng.standard_normal((7, 64)) * 30, jnp.float32)
  cache = cache.with_global_scale(1, jnp.array([2, 5, -1]), jnp.array([0.1, 0.5, 9.0]))
  slots = jnp.array([8, 9, 10, 20, 21, -1, 11], jnp.int32)
  step = jax.jit(lambda c, k, s: c.write(1, k, s), donate_argnums=0)
  cache = step(cache, k, slots)
  got = cache.read(1, jnp.array([[2, 5]]), jnp.array([6]))[0]
  g = np.array([0.1, 0.1, 0.1, 0.5, 0.5, 0.0, 0.1], np.float32)
  for t, (slot, row) in enumerate([(8, 0), (9, 1), (10, 2), (20, 4), (21, 5), (11, 3)]):
    token = t if t < 5 else 6
    packed, scales = fp4.quantize_groups(k[token], "nvfp4", g[token])
    want = fp4.dequantize_groups(packed, scales, "nvfp4", g[token])
    np.testing.assert_array_equal(bits(got[row]), bits(want))
  assert not np.asarray(cache.read(0, jnp.array([[2, 5]]), jnp.array([6]))).any()
  # E2M1 steps: at most one scale unit (~ amax16 / 6, the E4M3 scale within 2^-4) off
  x = np.asarray(k[0])
  amax16 = np.repeat(np.abs(x).reshape(4, 16).max(-1), 16)
  assert np.all(np.abs(np.asarray(got[0]) - x) <= amax16 / 6 * (1 + 2.0 ** -4) + 1e-6)
  with pytest.raises(ValueError, match="multiple of 16"):
    jkv.FP4IndexerCache.create(4, 4, 40)


@pytest.mark.parametrize("head_dim", [64, 48])
def test_fp4_indexer_pool_write_matches_model(head_dim, rng):
  """The FP4 indexer pool write (jnp code, no kernel) under jit, traced layer: each written
  slot holds jkv.fp4's NVFP4 encoding of its token under its block's global scale
  (tests/test_fp4.py checks jkv.fp4 against a numpy model) with NaN / Inf / all-zero /
  saturating keys; padding writes nothing and every other entry keeps its bytes."""
  from jkv import fp4
  blocks, bs = 7, 4
  cache = jkv.FP4IndexerCache.create(blocks, bs, head_dim, num_layers=2)
  cache = cache.with_global_scale(1, jnp.arange(blocks), jnp.asarray(
      rng.uniform(0.01, 2.0, blocks), jnp.float32))
  cache = dataclasses.replace(
      cache, keys=jnp.asarray(rng.integers(0, 256, cache.keys.shape), jnp.uint8),
      scales=jax.lax.bitcast_convert_type(jnp.asarray(
          rng.integers(0, 127, cache.scales.shape), jnp.uint8), jnp.float8_e4m3fn))
  tokens = 11
  k = rng.standard_normal((tokens, head_dim)).astype(np.float32) * rng.uniform(
      0.001, 500, (tokens, 1)).astype(np.float32)
  k[1] = 0.0
  k[2, 3] = np.nan
  k[3, 17] = -np.inf
  slots = jnp.asarray(rng.permutation(blocks * bs)[:tokens].astype(np.int32)).at[5].set(-1)
  got = jax.jit(lambda c, layer: c.write(layer, k, slots))(cache, 1)
  quantize = jax.jit(fp4.quantize_groups, static_argnums=1)
  want_keys, want_scales = bits(cache.keys).copy(), bits(cache.scales).copy()
  for t, slot in enumerate(np.asarray(slots)):
    if slot >= 0:
      b, o = divmod(int(slot), bs)
      packed, scale_bytes = quantize(jnp.asarray(k[t]), "nvfp4", cache.global_scale[1, b])
      want_keys[1, b, o], want_scales[1, b, o] = packed, scale_bytes
  np.testing.assert_array_equal(bits(got.keys), want_keys)
  np.testing.assert_array_equal(bits(got.scales), want_scales)
  b, o = divmod(int(slots[2]), bs)
  assert bits(got.scales)[1, b, o, 0] == 0x7F   # the NaN's group: a NaN scale
  assert not np.array_equal(want_keys, bits(cache.keys))
