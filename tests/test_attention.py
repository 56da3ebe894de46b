"""Paged decode attention: the kernel (interpret on CPU, compiled with JKV_BACKEND=pallas)
against the reference, the reference against an independent numpy model, every layout and
cache format, GQA / MQA, ALiBi, soft cap, sliding window, split contexts, NaN in unused
entries, and the array-level op's AITER scale shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import backend as backend_lib
from jkv.cache import PagedKVCache
from pallas_kernels import attention as kernels
from pallas_kernels import common
from tests.conftest import KERNEL

LAYOUTS = ("vllm", "asm", "flash", "hnd", "packed")


def build(rng, *, layout="flash", kv_layout="NHD", num_heads=2, head_size=64, block_size=16,
          num_blocks=24, batch=3, width=6, dtype=jnp.float32, num_layers=1, lens=None,
          poison=True, **create):
  """A cache whose unused entries hold NaN (or random ints), sequences written at random
  pages through the reference writes. Returns (cache, block_table, seq_lens, K, V) with K / V
  float32 [batch, width * bs, H, D] the written values (inputs, before quantization)."""
  cache = PagedKVCache.create(num_blocks, block_size, num_heads, head_size, layout=layout,
                              kv_layout=kv_layout, dtype=dtype, num_layers=num_layers, **create)
  if poison:
    fills = {}
    for name in ("key_cache", "value_cache"):
      array = getattr(cache, name)
      if array is None:
        continue
      if jnp.issubdtype(array.dtype, jnp.integer):
        fills[name] = jnp.asarray(rng.integers(-127, 128, array.shape), array.dtype)
      else:
        fills[name] = jnp.full(array.shape, jnp.nan, array.dtype)
    if cache.quant == "token":
      fills["k_scale"] = jnp.full(cache.k_scale.shape, jnp.nan, jnp.float32)
      fills["v_scale"] = jnp.full(cache.v_scale.shape, jnp.nan, jnp.float32)
    cache = cache.replace(**fills)
  table = rng.permutation(num_blocks)[:batch * width].reshape(batch, width).astype(np.int32)
  if lens is None:
    lens = rng.integers(1, width * block_size + 1, batch)
    lens[-1] = width * block_size
  lens = np.asarray(lens, np.int32)
  length = width * block_size
  keys = rng.standard_normal((batch, length, num_heads, head_size)).astype(np.float32)
  values = rng.standard_normal((batch, length, num_heads, head_size)).astype(np.float32)
  pos = np.arange(length)
  for layer in range(num_layers):
    for b in range(batch):
      slots = np.where(pos < lens[b], table[b, pos // block_size] * block_size + pos % block_size,
                       -1).astype(np.int32)
      cache = cache.write(layer, jnp.asarray(keys[b], dtype), jnp.asarray(values[b], dtype),
                          jnp.asarray(slots), backend="reference")
  return cache, jnp.asarray(table), jnp.asarray(lens), keys, values


def numpy_attention(query, keys, values, lens, *, scale, alibi=None, soft_cap=None,
                    window=None):
  """vLLM's ref_single_query_cached_kv_attention, one (sequence, head) at a time."""
  query = np.asarray(query, np.float64)
  batch, num_q_heads, _ = query.shape
  group = num_q_heads // keys.shape[2]
  out = np.zeros((batch, num_q_heads, values.shape[-1]))
  for b in range(batch):
    length = int(lens[b])
    first = 0 if window is None else max(0, length - window)
    for h in range(num_q_heads):
      k = keys[b, first:length, h // group].astype(np.float64)
      v = values[b, first:length, h // group].astype(np.float64)
      logits = scale * (k @ query[b, h])
      if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
      if alibi is not None:
        logits = logits + alibi[h] * (np.arange(first, length) - length + 1)
      if length == first:
        continue
      p = np.exp(logits - logits.max())
      out[b, h] = p @ v / (p.sum() + 1e-6)
  return out


def query_of(rng, batch, num_q_heads, head_size, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal((batch, num_q_heads, head_size)), dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("options", [{}, {"alibi": True}, {"soft_cap": 5.0}, {"window": 21}])
def test_reference_matches_numpy_model(rng, layout, options):
  cache, table, lens, keys, values = build(rng, layout=layout, lens=[0, 37, 96])
  query = query_of(rng, 3, 4, 64)
  alibi = rng.uniform(-0.3, 0, 4).astype(np.float32) if options.get("alibi") else None
  out = cache.attend(0, query, table, lens, alibi_slopes=alibi,
                     logits_soft_cap=options.get("soft_cap"),
                     sliding_window=options.get("window"), backend="reference")
  expected = numpy_attention(query, keys, values, lens, scale=64 ** -0.5, alibi=alibi,
                             soft_cap=options.get("soft_cap"), window=options.get("window"))
  np.testing.assert_allclose(out, expected, atol=2e-5, rtol=1e-5)
  assert np.all(np.asarray(out[0]) == 0)   # an empty sequence attends to nothing


def compare(cache, query, table, lens, atol, **options):
  expected = cache.attend(0, query, table, lens, backend="reference", **options)
  got = cache.attend(0, query, table, lens, backend=KERNEL, **options)
  assert got.dtype == query.dtype and got.shape == query.shape
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                             atol=atol, rtol=atol)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_kernel_matches_reference_plain(rng, layout, dtype):
  cache, table, lens, _, _ = build(rng, layout=layout, dtype=dtype)
  atol = 2e-5 if dtype == jnp.float32 else 3e-2
  compare(cache, query_of(rng, 3, 8, 64, dtype), table, lens, atol)


@pytest.mark.parametrize("backend", ["reference", KERNEL])
def test_no_sequences(rng, backend):
  """A batch of 0 sequences gives [0, Hq, D] in the query's dtype, eagerly and under jit."""
  cache, table, lens, _, _ = build(rng, layout="vllm", dtype=jnp.bfloat16)
  query = query_of(rng, 3, 4, 64, jnp.bfloat16)[:0]
  for attend in (cache.attend, jax.jit(cache.attend, static_argnames="backend")):
    out = attend(0, query, table[:0], lens[:0], backend=backend)
    assert out.shape == (0, 4, 64) and out.dtype == jnp.bfloat16


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3fnuz", "fp8_e5m2"])
@pytest.mark.parametrize("layout", ["vllm", "flash"])
def test_kernel_matches_reference_fp8_tensor(rng, layout, kv_cache_dtype):
  cache, table, lens, _, _ = build(rng, layout=layout, dtype=jnp.bfloat16,
                                   kv_cache_dtype=kv_cache_dtype, k_scale=0.05,
                                   v_scale=jnp.asarray([0.02, 0.04], jnp.float32))
  compare(cache, query_of(rng, 3, 4, 64, jnp.bfloat16), table, lens, 3e-2)


@pytest.mark.parametrize("magnitude", [2.0 ** 40, 2.0 ** -40])
@pytest.mark.parametrize("layout", ["vllm", "hnd"])
def test_fp8_kernel_with_a_query_outside_f16(rng, layout, magnitude):
  """A bf16 query meets per-tensor FP8 keys in f16 (common.f16_query_tiles): a query far
  past f16's largest value (cast as is: inf, then NaN) or far below its normal range (cast
  as is: zeros) gives the reference's result; ``scale`` brings the logits back to size."""
  cache, table, lens, _, _ = build(rng, layout=layout, dtype=jnp.bfloat16, kv_cache_dtype="fp8",
                                   k_scale=0.05, v_scale=jnp.asarray([0.02, 0.04], jnp.float32))
  query = (query_of(rng, 3, 4, 64) * magnitude).astype(jnp.bfloat16)
  compare(cache, query, table, lens, 3e-2, scale=0.125 / magnitude)


def test_f16_query_tiles_are_exact():
  """The f16 query tiles times the returned power of two are the bf16 query, bit for bit,
  over 2^25 of range below its largest value, for queries from 2^-49 (smaller ones are
  scaled by 2^64 at most: no logit can see them) to bf16's largest; only a bf16 query
  against a per-tensor FP8 cache takes that path."""
  rng = np.random.default_rng(3)
  for top in (-49, -14, 0, 15, 16, 60, 127):
    tiles = [jnp.asarray(np.exp2(rng.uniform(top - 25, top, shape))
                         * rng.choice([-1.0, 1.0], shape), jnp.bfloat16).astype(jnp.float32)
             for shape in ((16, 64), (16, 32))]
    tiles16, factor = jax.jit(common.f16_query_tiles)(tiles)
    factor = float(factor)
    assert np.log2(factor) == np.round(np.log2(factor))
    largest = max(np.max(np.abs(np.asarray(tile, np.float64))) for tile in tiles16)
    assert 2.0 ** 14 <= largest < 2.0 ** 15
    for tile16, tile in zip(tiles16, tiles):
      assert tile16.dtype == jnp.float16
      np.testing.assert_array_equal(np.asarray(tile16, np.float64) * factor,
                                    np.asarray(tile, np.float64))
  tensor, token = jkv.formats.CacheFormat("vllm", quant="tensor"), jkv.formats.CacheFormat(
      "vllm", quant="token")
  assert common.f16_queries(jnp.bfloat16, jnp.float8_e4m3fn, tensor)
  assert common.f16_queries(jnp.bfloat16, jnp.float8_e5m2, tensor)
  assert not common.f16_queries(jnp.float16, jnp.float8_e4m3fn, tensor)
  assert not common.f16_queries(jnp.bfloat16, jnp.int8, tensor)
  assert not common.f16_queries(jnp.bfloat16, jnp.float8_e4m3fn, token)


@pytest.mark.parametrize("quant,kv_cache_dtype,unit", [
    ("token", "int8", None), ("token", "fp8", None), ("block", "fp8", None),
    ("block", "int8", 32), ("block", "fp8_e4m3fnuz", None)])
@pytest.mark.parametrize("layout", ["asm", "hnd"])
def test_kernel_matches_reference_scaled(rng, layout, quant, kv_cache_dtype, unit):
  cache, table, lens, _, _ = build(rng, layout=layout, dtype=jnp.bfloat16, quant=quant,
                                   kv_cache_dtype=kv_cache_dtype, scale_block_tokens=unit)
  compare(cache, query_of(rng, 3, 4, 64, jnp.bfloat16), table, lens, 3e-2)


@pytest.mark.parametrize("options", [{"alibi": True}, {"soft_cap": 3.0}, {"window": 19},
                                     {"window": 19, "alibi": True, "soft_cap": 8.0}])
def test_kernel_options(rng, options):
  cache, table, lens, _, _ = build(rng, layout="vllm", lens=[5, 40, 96])
  alibi = rng.uniform(-0.3, 0, 8).astype(np.float32) if options.get("alibi") else None
  compare(cache, query_of(rng, 3, 8, 64), table, lens, 2e-5, alibi_slopes=alibi,
          logits_soft_cap=options.get("soft_cap"), sliding_window=options.get("window"))


@pytest.mark.parametrize("num_q_heads,num_heads,head_size,block_size", [
    (1, 1, 64, 16),     # MHA, one head
    (8, 1, 80, 8),      # MQA, head size not a power of two
    (6, 2, 32, 1),      # group of 3, block size 1
    (40, 8, 128, 32)])  # group of 5
def test_kernel_shapes(rng, num_q_heads, num_heads, head_size, block_size):
  cache, table, lens, _, _ = build(rng, layout="hnd", num_heads=num_heads, head_size=head_size,
                                   block_size=block_size, num_blocks=80 // block_size * 4 + 8,
                                   width=max(2, 64 // block_size))
  compare(cache, query_of(rng, 3, num_q_heads, head_size), table, lens, 2e-5)


@pytest.mark.parametrize("num_splits,tile_pages", [(1, 1), (3, 1), (2, 2), (6, 4)])
def test_split_contexts_combine(rng, num_splits, tile_pages):
  cache, table, lens, keys, values = build(rng, layout="flash", lens=[1, 50, 96],
                                           poison=True)
  query = query_of(rng, 3, 4, 64)
  fmt = cache.cache_format()
  key_plane, value_plane = jkv.layout.planes("flash", 16, 2, 64, jnp.float32)
  out = kernels.paged_attention_decode(
      fmt, query, cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale,
      jnp.int32(0), table, lens, key_plane=key_plane, value_plane=value_plane, num_blocks=24,
      scale=0.125, alibi_slopes=None, logits_soft_cap=None, sliding_window=None,
      interpret=KERNEL == "interpret", num_splits=num_splits, tile_pages=tile_pages)
  np.testing.assert_allclose(out, numpy_attention(query, keys, values, lens, scale=0.125),
                             atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layout,kv_cache_dtype,quant,key_chunk,transposed_values,head_size", [
    ("vllm", "fp8", "tensor", 16, False, 64), ("vllm", "fp8", "tensor", 32, True, 64),
    ("vllm", "fp8", "tensor", 64, False, 64), ("vllm", "fp8", "tensor", None, None, 64),
    ("vllm", "auto", "tensor", 16, True, 64), ("asm", "fp8", "tensor", 16, True, 64),
    ("asm", "auto", "tensor", 64, False, 64), ("vllm", "auto", "tensor", 8, False, 64),
    ("vllm", "fp8", "tensor", 16, True, 80),   # 80: a padded value chunk (masked dims)
    ("vllm", "fp8", "tensor", 64, True, 80), ("vllm", "auto", "tensor", 64, True, 64),
    ("vllm", "int8", "token", None, None, 64), ("asm", "int8", "token", 16, True, 64),
    ("vllm", "int8", "block", None, None, 64), ("asm", "int8", "block", 8, True, 64),
    ("asm", "auto", "tensor", 16, True, 64)])   # bf16 asm: two groups of x = 8 tokens
def test_x_vectorized_key_chunks_and_transposed_values(rng, layout, kv_cache_dtype, quant,
                                                       key_chunk, transposed_values, head_size):
  """The vLLM / ASM read variants: keys in chunks of whole x-vectors (8: below the
  16-column tile, read through the generic loads), values (and logits) transposed (None:
  the kernel's defaults)."""
  cache, table, lens, _, _ = build(rng, layout=layout, dtype=jnp.bfloat16, lens=[7, 50, 96],
                                   head_size=head_size, kv_cache_dtype=kv_cache_dtype,
                                   quant=quant, **(dict(k_scale=0.05, v_scale=0.03)
                                                   if quant == "tensor" else {}))
  query = query_of(rng, 3, 4, head_size, jnp.bfloat16)
  fmt = cache.cache_format()
  key_plane, value_plane = jkv.layout.planes(layout, 16, 2, head_size, cache.key_cache.dtype)
  k_scale, v_scale = cache.read_scales()
  out = kernels.paged_attention_decode(
      fmt, query, cache.key_cache, cache.value_cache, k_scale, v_scale,
      jnp.int32(0), table, lens, key_plane=key_plane, value_plane=value_plane, num_blocks=24,
      scale=0.125, alibi_slopes=None, logits_soft_cap=None, sliding_window=None,
      interpret=KERNEL == "interpret", tile_pages=2, key_chunk=key_chunk,
      transposed_values=transposed_values)
  expected = cache.attend(0, query, table, lens, scale=0.125, backend="reference")
  assert not np.any(np.isnan(np.asarray(out, np.float32)))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                             atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("layout,kv_cache_dtype", [("vllm", "fp8"), ("asm", "int8")])
@pytest.mark.parametrize("options", [{"alibi": True}, {"soft_cap": 3.0},
                                     {"window": 19, "alibi": True, "soft_cap": 8.0}])
def test_kernel_options_one_byte_token_minor(rng, layout, kv_cache_dtype, options):
  """ALiBi, soft cap and sliding window over one-byte vLLM / ASM caches (read with the
  transposed logits and values by default)."""
  cache, table, lens, _, _ = build(rng, layout=layout, dtype=jnp.bfloat16, lens=[5, 40, 96],
                                   kv_cache_dtype=kv_cache_dtype,
                                   quant="tensor" if kv_cache_dtype == "fp8" else "token",
                                   **(dict(k_scale=0.05, v_scale=0.03)
                                      if kv_cache_dtype == "fp8" else {}))
  alibi = rng.uniform(-0.3, 0, 8).astype(np.float32) if options.get("alibi") else None
  compare(cache, query_of(rng, 3, 8, 64, jnp.bfloat16), table, lens, 3e-2,
          alibi_slopes=alibi, logits_soft_cap=options.get("soft_cap"),
          sliding_window=options.get("window"))


def test_kernel_broadcasts_a_tensor_scale_per_head(rng):
  """A [1] per-tensor scale is broadcast to the KV heads at the kernel entry (indexed by
  head as stored, a GPU read KV head 1's scale past its end); a scale of another shape is
  refused."""
  cache, table, lens, _, _ = build(rng, layout="vllm", dtype=jnp.bfloat16, lens=[7, 50, 96],
                                   kv_cache_dtype="fp8", k_scale=0.05, v_scale=0.03)
  key_plane, value_plane = jkv.layout.planes("vllm", 16, 2, 64, cache.key_cache.dtype)
  query = query_of(rng, 3, 4, 64, jnp.bfloat16)

  def attend(k_scale, v_scale):
    return kernels.paged_attention_decode(
        cache.cache_format(), query, cache.key_cache, cache.value_cache, k_scale, v_scale,
        jnp.int32(0), table, lens, key_plane=key_plane, value_plane=value_plane,
        num_blocks=24, scale=0.125, alibi_slopes=None, logits_soft_cap=None,
        sliding_window=None, interpret=KERNEL == "interpret")

  assert cache.k_scale.shape == (1,)
  np.testing.assert_array_equal(np.asarray(attend(cache.k_scale, cache.v_scale), np.float32),
                                np.asarray(attend(*cache.read_scales()), np.float32))
  with pytest.raises(ValueError):
    attend(jnp.full((3,), 0.05, jnp.float32), cache.v_scale)


def test_array_op_aiter_scale_shapes(rng):
  """The array-level op with AITER's per-token and per-block scale shapes equals the
  cache method (whose scales are stored in the asm shapes)."""
  for quant, unit in (("token", None), ("block", 32)):
    cache, table, lens, _, _ = build(rng, layout="vllm", dtype=jnp.bfloat16, quant=quant,
                                     kv_cache_dtype="int8", scale_block_tokens=unit)
    query = query_of(rng, 3, 4, 64, jnp.bfloat16)
    expected = cache.attend(0, query, table, lens, backend="reference")
    k_s, v_s = cache.k_scale[0], cache.v_scale[0]
    if quant == "token":   # [nb, H, bs] -> [H, nb * bs]
      k_flat, v_flat = (jnp.transpose(s, (1, 0, 2)).reshape(2, -1) for s in (k_s, v_s))
    else:                  # [units, H] -> [H, units]
      k_flat, v_flat = k_s.T, v_s.T
    for asm, (ks, vs) in ((True, (k_s, v_s)), (False, (k_flat, v_flat))):
      for backend in ("reference", KERNEL):
        got = jkv.paged_attention_decode(query, cache.key_cache[0], cache.value_cache[0], table,
                                         lens, layout="vllm", k_dequant_scales=ks,
                                         v_dequant_scales=vs, asm_layout=asm, backend=backend)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                                   atol=3e-2, rtol=3e-2)


def test_array_op_layer_and_packed_hnd(rng):
  cache, table, lens, keys, values = build(rng, layout="packed", kv_layout="HND", num_layers=3)
  query = query_of(rng, 3, 4, 64)
  expected = numpy_attention(query, keys, values, lens, scale=0.1)

  @jax.jit
  def run(kv, layer):
    return jkv.paged_attention_decode(query, kv, None, table, lens, layout="packed",
                                      kv_layout="HND", scale=0.1, layer=layer, backend=KERNEL)

  for layer in (0, 2):
    np.testing.assert_allclose(run(cache.key_cache, layer), expected, atol=2e-5, rtol=1e-5)
  assert np.all(np.asarray(run(cache.key_cache, 7)) == 0)   # traced layer out of range


def test_traced_layer_in_scan(rng):
  cache, table, lens, _, _ = build(rng, layout="asm", num_layers=2, dtype=jnp.bfloat16)
  query = query_of(rng, 3, 4, 64, jnp.bfloat16)

  def per_layer(carry, layer):
    return carry, cache.attend(layer, query, table, lens, backend=KERNEL)

  _, outs = jax.lax.scan(per_layer, 0, jnp.arange(2))
  for layer in range(2):
    expected = cache.attend(layer, query, table, lens, backend="reference")
    np.testing.assert_allclose(np.asarray(outs[layer], np.float32),
                               np.asarray(expected, np.float32), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("quant,query_dtype", [
    ("mxfp4", jnp.float32), ("nvfp4", jnp.float32), ("mxfp4", jnp.bfloat16),
    ("nvfp4", jnp.bfloat16), ("nvfp4", jnp.float16), ("mxfp4", jnp.float16)])
def test_fp4_reference_equals_numpy(rng, quant, query_dtype):
  """FP4 caches (packed E2M1 with group scales; nvfp4 global scales; read through the
  reference on every back end, tests/test_fp4.py): the reference == numpy over the
  dequantized K / V that gather returns. Unused entries hold random bytes and NaN group
  scales, which must not leak. A float32 query is exact to float32 rounding; a 16-bit one
  to the 16-bit tolerance of the other paths."""
  globals_ = {"k_global_scale": 0.02, "v_global_scale": 0.05} if quant == "nvfp4" else {}
  cache, table, lens, _, _ = build(rng, layout="hnd", quant=quant, poison=False,
                                   num_layers=2, **globals_)
  nan_byte = 0xFF if quant == "mxfp4" else 0x7F   # E8M0 / E4M3 NaN
  written = np.asarray(jax.lax.bitcast_convert_type(cache.k_scale, jnp.uint8)) != 0
  poisoned = {}
  for name in ("key_cache", "value_cache", "k_scale", "v_scale"):
    array = getattr(cache, name)
    bits = np.asarray(jax.lax.bitcast_convert_type(array, jnp.uint8))
    junk = (rng.integers(0, 256, bits.shape).astype(np.uint8) if name.endswith("cache")
            else np.full(bits.shape, nan_byte, np.uint8))
    used = written if name.endswith("scale") else np.repeat(
        written[..., :1], bits.shape[-1], axis=-1)
    poisoned[name] = jax.lax.bitcast_convert_type(jnp.asarray(np.where(used, bits, junk)),
                                                  array.dtype)
  cache = cache.replace(**poisoned)
  query = query_of(rng, 3, 4, 64, query_dtype)
  tolerance = 1e-5 if query_dtype == jnp.float32 else 3e-2
  for layer in (0, 1):
    got = cache.attend(layer, query, table, lens, backend="reference")
    assert got.dtype == query_dtype and np.isfinite(np.asarray(got, np.float32)).all()
    k, v = cache.gather(layer, table, lens)
    expected = numpy_attention(np.asarray(query, np.float32), np.asarray(k), np.asarray(v),
                               lens, scale=0.125)
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, atol=2 * tolerance,
                               rtol=tolerance)


def test_bad_inputs(rng):
  cache, table, lens, _, _ = build(rng, layout="flash", poison=False)
  query = query_of(rng, 3, 4, 64)
  with pytest.raises(ValueError, match="seq_lens\\[1\\] = 97 is out of range"):
    cache.attend(0, query, table, jnp.asarray([1, 97, 3]))
  bad_table = np.asarray(table).copy()
  bad_table[2, 1] = 24
  with pytest.raises(ValueError, match="block_tables\\[2, 1\\] = 24 is outside the cache"):
    cache.attend(0, query, bad_table, jnp.asarray([1, 1, 17]))
  cache.attend(0, query, bad_table, jnp.asarray([1, 1, 16]))   # the bad block is not read
  with pytest.raises(ValueError, match="query must be"):
    cache.attend(0, query_of(rng, 3, 3, 64), table, lens)
  with pytest.raises(ValueError, match="sliding_window"):
    cache.attend(0, query, table, lens, sliding_window=-1)
  with pytest.raises(ValueError, match="alibi_slopes must have shape"):
    cache.attend(0, query, table, lens, alibi_slopes=jnp.zeros(3))
  int8 = jnp.zeros((24, 16, 2, 64), jnp.int8)
  with pytest.raises(ValueError, match="int8 cache needs k_dequant_scales"):
    jkv.paged_attention_decode(query, int8, int8, table, lens, layout="flash",
                               kv_cache_dtype="int8")
  with pytest.raises(ValueError, match="k_dequant_scales must be"):
    jkv.paged_attention_decode(query, int8, int8, table, lens, layout="flash",
                               k_dequant_scales=jnp.ones((2, 5)), v_dequant_scales=jnp.ones((2, 5)))
  # Per-block scales ([H, units]: 2 heads, 24 blocks) with a per-tensor scale or a kv_cache_dtype
  # that is not the cache's: both were ignored.
  per_block = jnp.ones((2, 24), jnp.float32)
  scaled = dict(layout="flash", k_dequant_scales=per_block, v_dequant_scales=per_block)
  with pytest.raises(ValueError, match="pass them or k_dequant_scales"):
    jkv.paged_attention_decode(query, int8, int8, table, lens, k_scale=0.5, **scaled)
  with pytest.raises(TypeError, match="must have dtype float8_e4m3fn for kv_cache_dtype"):
    jkv.paged_attention_decode(query, int8, int8, table, lens, kv_cache_dtype="fp8", **scaled)
  fp8 = int8.astype(jnp.float8_e4m3fn)
  with pytest.raises(TypeError, match="must have dtype int8 for kv_cache_dtype='int8'"):
    jkv.paged_attention_decode(query, fp8, fp8, table, lens, kv_cache_dtype="int8", **scaled)
  with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
    jkv.paged_attention_decode(query, int8, int8, table, lens, kv_cache_dtype="int4", **scaled)
  jkv.paged_attention_decode(query, int8, int8, table, lens, kv_cache_dtype="int8", **scaled)
  jkv.paged_attention_decode(query, fp8, fp8, table, lens, kv_cache_dtype="fp8", **scaled)


# ---- MLA decode attention (absorbed form over the latent cache) -----------------------------

def build_mla(rng, *, rank=64, pe=16, num_heads=None, kv_cache_dtype="auto", dtype=jnp.float32,
              block_size=16, num_blocks=20, batch=3, width=5, lens=(0, 33, 80), magnitude=1.0):
  """An MLA cache (unused entries NaN where the format can hold it) with sequences written
  at random pages (kv_c standard normal times ``magnitude``); returns (cache, table, lens,
  entries float32 [B, S, Hkv, R + P])."""
  from jkv.mla_cache import MLACache
  cache = MLACache.create(num_blocks, block_size, rank, pe, num_heads=num_heads, dtype=dtype,
                          kv_cache_dtype=kv_cache_dtype, scale=0.05)
  if kv_cache_dtype in ("auto", "fp8"):
    cache = cache.replace(kv_cache=jnp.full(cache.kv_cache.shape, jnp.nan, cache.kv_cache.dtype))
  if kv_cache_dtype == "fp8_split":   # NaN content bytes, RoPE parts and scales
    cache = cache.replace(
        kv_cache=jnp.full(cache.kv_cache.shape, jnp.nan, cache.kv_cache.dtype),
        rope_cache=jnp.full(cache.rope_cache.shape, jnp.nan, cache.rope_cache.dtype),
        entry_scale=jnp.full(cache.entry_scale.shape, jnp.nan, jnp.float32))
  if kv_cache_dtype == "fp8_ds_mla":   # 0xFF bytes: NaN content, tile scales and k_pe
    cache = cache.replace(kv_cache=jnp.full(cache.kv_cache.shape, 0xFF, jnp.uint8))
  heads = () if num_heads is None else (num_heads,)
  table = rng.permutation(num_blocks)[:batch * width].reshape(batch, width).astype(np.int32)
  lens = np.asarray(lens, np.int32)
  length = width * block_size
  kv_c = (magnitude * rng.standard_normal((batch, length) + heads + (rank,))).astype(np.float32)
  k_pe = rng.standard_normal((batch, length) + heads + (pe,)).astype(np.float32)
  pos = np.arange(length)
  for b in range(batch):
    slots = np.where(pos < lens[b], table[b, pos // block_size] * block_size + pos % block_size,
                     -1).astype(np.int32)
    cache = cache.write(0, jnp.asarray(kv_c[b], dtype), jnp.asarray(k_pe[b], dtype),
                        jnp.asarray(slots), backend="reference")
  entries = np.concatenate([kv_c, k_pe], axis=-1)
  if num_heads is None:
    entries = entries[:, :, None]
  return cache, jnp.asarray(table), jnp.asarray(lens), entries


def test_mla_reference_matches_numpy_model(rng):
  cache, table, lens, entries = build_mla(rng)
  query = query_of(rng, 3, 4, 80)
  out = cache.attend(0, query, table, lens, scale=0.1, backend="reference")
  expected = numpy_attention(query, entries, entries[..., :64], lens, scale=0.1)
  assert out.shape == (3, 4, 64)
  np.testing.assert_allclose(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype,num_heads,dtype", [
    ("auto", None, jnp.float32), ("auto", None, jnp.bfloat16), ("fp8", None, jnp.bfloat16),
    ("auto", 2, jnp.float32)])
def test_mla_kernel_matches_reference(rng, kv_cache_dtype, num_heads, dtype):
  cache, table, lens, _ = build_mla(rng, kv_cache_dtype=kv_cache_dtype, num_heads=num_heads,
                                    dtype=dtype)
  query = query_of(rng, 3, 4 if num_heads is None else 6, 80, dtype)
  expected = cache.attend(0, query, table, lens, scale=0.1, backend="reference")
  got = cache.attend(0, query, table, lens, scale=0.1, backend=KERNEL)
  atol = 2e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                             atol=atol, rtol=atol)


def test_mla_kernel_deepseek_sizes(rng):
  """kv_lora_rank 512, pe 64, 32 query heads (two programs per KV head)."""
  cache, table, lens, _ = build_mla(rng, rank=512, pe=64, dtype=jnp.bfloat16, num_blocks=10,
                                    width=3, lens=(1, 17, 48))
  query = query_of(rng, 3, 32, 576, jnp.bfloat16)
  expected = cache.attend(0, query, table, lens, scale=576 ** -0.5, backend="reference")
  got = cache.attend(0, query, table, lens, scale=576 ** -0.5, backend=KERNEL)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                             atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kv_cache_dtype,num_heads,dtype,rank,pe,query_heads", [
    ("fp8_split", None, jnp.float32, 64, 16, 4), ("fp8_split", 2, jnp.float32, 64, 16, 6),
    ("fp8_split", None, jnp.bfloat16, 64, 16, 4), ("fp8_split", None, jnp.bfloat16, 512, 64, 32),
    ("fp8_ds_mla", None, jnp.float32, 128, 8, 4), ("fp8_ds_mla", None, jnp.float32, 384, 16, 4),
    ("fp8_ds_mla", None, jnp.bfloat16, 256, 24, 4),
    ("fp8_ds_mla", None, jnp.bfloat16, 512, 64, 32)])
def test_mla_fp8_entry_kernels_match_reference(rng, kv_cache_dtype, num_heads, dtype, rank, pe,
                                               query_heads):
  """fp8_split (DeepSeek-V4) and fp8_ds_mla (vLLM's 656-byte entries at R = 512) caches:
  the kernel (interpreter on CPU, compiled on a GPU) == the reference; unused entries hold
  NaN content, RoPE parts and scales (fp8_ds_mla: 0xFF bytes), which must not leak."""
  cache, table, lens, _ = build_mla(rng, rank=rank, pe=pe, num_heads=num_heads,
                                    kv_cache_dtype=kv_cache_dtype, dtype=dtype)
  query = query_of(rng, 3, query_heads, rank + pe, dtype)
  expected = cache.attend(0, query, table, lens, scale=0.1, backend="reference")
  got = cache.attend(0, query, table, lens, scale=0.1, backend=KERNEL)
  assert np.isfinite(np.asarray(got, np.float32)).all()
  atol = 2e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                             atol=atol, rtol=atol)
  auto = cache.attend(0, query, table, lens, scale=0.1)   # the kernel on a GPU
  np.testing.assert_array_equal(np.asarray(auto), np.asarray(
      expected if backend_lib.resolve("auto") == "reference" else got))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_split", "fp8_ds_mla"])
def test_mla_fp8_entry_kernels_large_scales(rng, kv_cache_dtype):
  """Entry / tile scales past f16's range (kv_c ~ 1e8, scales ~ 1e6): the fp8_ds_mla
  kernel meets a bf16 query in f16 and must not overflow the probabilities' f16 weights
  (each tile's are scaled by its largest scale); fp8_split computes in bf16."""
  rank = 128
  cache, table, lens, _ = build_mla(rng, rank=rank, kv_cache_dtype=kv_cache_dtype,
                                    dtype=jnp.bfloat16, magnitude=1e8)
  query = query_of(rng, 3, 4, rank + 16, jnp.bfloat16)
  expected = cache.attend(0, query, table, lens, scale=1e-9, backend="reference")
  got = cache.attend(0, query, table, lens, scale=1e-9, backend=KERNEL)
  expected, got = np.asarray(expected, np.float32), np.asarray(got, np.float32)
  assert np.abs(expected).max() > 1e6   # the scales are past f16's largest value (65504)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got / 1e8, expected / 1e8, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("shape", [(1, 20, 16, 2, 208), (1, 20, 16, 200)])
def test_mla_attention_rejects_malformed_ds_mla_caches(shape):
  """An fp8_ds_mla cache of several heads (read as more pages) or of entries of another
  size than R + R / 32 + 2 P bytes (the RoPE part read past them) is refused."""
  from jkv.ops import mla as mla_ops
  query = jnp.ones((1, 4, 128 + 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="kv_cache must"):
    mla_ops.mla_attention(query, jnp.zeros(shape, jnp.uint8), None, None, None, 0,
                          jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32),
                          kv_cache_dtype="fp8_ds_mla", kv_lora_rank=128, pe_dim=16, scale=0.1,
                          backend="reference")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_split", "fp8_ds_mla"])
def test_mla_byte_formats_match_numpy_model(rng, kv_cache_dtype):
  rank = 128 if kv_cache_dtype == "fp8_ds_mla" else 64
  cache, table, lens, _ = build_mla(rng, rank=rank, kv_cache_dtype=kv_cache_dtype,
                                    dtype=jnp.bfloat16)
  query = query_of(rng, 3, 4, rank + 16)
  kv_c, k_pe = cache.gather(0, table, lens)
  entries = np.concatenate([np.asarray(kv_c, np.float32), np.asarray(k_pe, np.float32)], -1)
  expected = numpy_attention(query, entries[:, :, None], entries[:, :, None, :rank], lens,
                             scale=0.1)
  out = cache.attend(0, query, table, lens, scale=0.1, backend="reference")
  np.testing.assert_allclose(out, expected, atol=5e-3, rtol=5e-3)
