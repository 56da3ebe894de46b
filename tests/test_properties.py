"""Property tests: random shapes, layouts, dtypes and slot mappings; kernel == reference.

Bounded for CI by the hypothesis profile in conftest.py (``HYPOTHESIS_PROFILE=thorough``
for a long run by hand).
"""

import jax.numpy as jnp
import numpy as np
from hypothesis import assume, given, settings, strategies as st

import jkv
from jkv import layout as layout_lib
from conftest import KERNEL, bits

LAYOUTS = [("vllm", "NHD"), ("asm", "NHD"), ("flash", "NHD"), ("hnd", "NHD"),
           ("packed", "NHD"), ("packed", "HND")]


@given(layout=st.sampled_from(LAYOUTS), kv_cache_dtype=st.sampled_from(
    ["auto", "fp8", "fp8_e4m3fnuz", "fp8_e5m2"]), heads=st.integers(1, 5),
       head_units=st.integers(1, 6), block_size=st.sampled_from([8, 16, 32]),
       num_blocks=st.integers(1, 6), tokens=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_write_kernel_equals_reference(layout, kv_cache_dtype, heads, head_units, block_size,
                                       num_blocks, tokens, seed):
  rng = np.random.default_rng(seed)
  name, kv_layout = layout
  head_size = 16 * head_units  # a multiple of x for every cache dtype
  cache_dtype = jnp.bfloat16 if kv_cache_dtype == "auto" else jkv.quant.FP8_DTYPES[kv_cache_dtype]
  assume(name != "asm" or block_size % layout_lib.vector_width(cache_dtype) == 0)
  k_shape, v_shape = layout_lib.cache_shapes(name, num_blocks, block_size, heads, head_size,
                                             cache_dtype, kv_layout)
  kc = jnp.asarray(rng.standard_normal(k_shape)).astype(cache_dtype)
  vc = None if v_shape is None else jnp.asarray(rng.standard_normal(v_shape)).astype(cache_dtype)
  capacity = num_blocks * block_size
  # distinct valid slots, plus padding (-1); no duplicates (their winner is unspecified)
  slots = np.full(tokens, -1, np.int32)
  chosen = rng.permutation(capacity)[: min(tokens, capacity)]
  slots[rng.permutation(tokens)[: chosen.size]] = chosen
  slots[rng.random(tokens) < 0.2] = -1
  key = jnp.asarray(rng.standard_normal((tokens, heads, head_size)) * 3, jnp.float32)
  value = jnp.asarray(rng.standard_normal((tokens, heads, head_size)), jnp.float32)
  outs = [jkv.write_kv(key, value, kc, vc, slots, layout=name, kv_layout=kv_layout,
                       kv_cache_dtype=kv_cache_dtype, k_scale=0.1, v_scale=0.02, backend=b)
          for b in ("reference", KERNEL)]
  for a, b in zip(*outs):
    np.testing.assert_array_equal(bits(a), bits(b))


# Quantized writes are slower in the interpreter: a third of the profile's examples.
@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(granularity=st.sampled_from(["token", "block"]), layout=st.sampled_from(LAYOUTS),
       cache_dtype=st.sampled_from([jnp.float8_e4m3fn, jnp.float8_e4m3fnuz, jnp.int8]),
       heads=st.integers(1, 3), head_units=st.integers(1, 5),
       units_per_scale=st.sampled_from([1, 2]),
       num_blocks=st.integers(1, 4), tokens=st.integers(1, 30), block_major=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_quant_write_kernel_equals_reference(granularity, layout, cache_dtype, heads, head_units,
                                             units_per_scale, num_blocks, tokens, block_major,
                                             seed):
  """Per-token / per-block quantized writes: random shapes and slots (padding; duplicates
  for per-block, where the last token wins), pre-filled random caches and scales."""
  rng = np.random.default_rng(seed)
  name, kv_layout = layout
  head_size, block_size = 16 * head_units, 16
  unit = block_size * units_per_scale if granularity == "block" else None
  num_blocks *= units_per_scale
  k_shape, v_shape = layout_lib.cache_shapes(name, num_blocks, block_size, heads, head_size,
                                             cache_dtype, kv_layout)
  def cache(shape):
    return jnp.asarray(rng.integers(-100, 100, shape), jnp.int8).view(cache_dtype)
  kc, vc = cache(k_shape), None if v_shape is None else cache(v_shape)
  capacity = num_blocks * block_size
  if granularity == "token":
    scale_shape = (num_blocks, heads, block_size) if block_major else (heads, capacity)
  else:
    scale_shape = ((capacity // unit, heads) if block_major else (heads, capacity // unit))
  ks, vs = (jnp.asarray(rng.uniform(0, 0.05, scale_shape), jnp.float32) for _ in range(2))
  slots = rng.integers(0, capacity, tokens).astype(np.int32)
  if granularity == "token":   # per-token writes take each slot at most once
    slots = np.where(np.arange(tokens) < capacity, rng.permutation(max(capacity, tokens))[:tokens],
                     -1).astype(np.int32)
    slots[slots >= capacity] = -1
  slots[rng.random(tokens) < 0.2] = -1
  scale = np.exp(rng.uniform(-3, 3, (tokens, 1, 1)))
  key = jnp.asarray(rng.standard_normal((tokens, heads, head_size)) * scale, jnp.float32)
  value = jnp.asarray(rng.standard_normal((tokens, heads, head_size)) * scale, jnp.bfloat16)
  outs = [jkv.write_quant_kv(key, value, kc, vc, ks, vs, slots, granularity=granularity,
                             layout=name, kv_layout=kv_layout, scales_block_major=block_major,
                             tokens_per_scale_block=unit, backend=b)
          for b in ("reference", KERNEL)]
  for a, b in zip(*outs):
    if a is not None:
      np.testing.assert_array_equal(bits(a), bits(b))
