"""Property tests: random shapes, layouts, dtypes and slot mappings; kernel == reference.

Bounded for CI by the hypothesis profile in conftest.py (``HYPOTHESIS_PROFILE=thorough``
for a long run by hand).
"""

import jax.numpy as jnp
import numpy as np
from hypothesis import assume, given, strategies as st

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
