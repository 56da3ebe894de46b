"""Property tests: random shapes, layouts, dtypes and slot mappings; kernel == reference.

Marked slow: ``-m slow`` runs them (the GPU check, by hand), CI does not. Bounded
by the hypothesis profile in conftest.py (``HYPOTHESIS_PROFILE=thorough`` for a long run by
hand).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import jkv
from jkv import layout as layout_lib
from conftest import KERNEL, bits
from test_mla import within_ulps

pytestmark = pytest.mark.slow   # hypothesis over the kernels: -m slow runs it, not CI

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


def numpy_token(layout, kv_layout, key_cache, value_cache, block, offset):
  """K and V [H, D] of the token at (block, offset), by the layouts' definitions
  (DESIGN.md's table), independently of jkv.layout."""
  kc = np.asarray(key_cache, np.float32)
  if layout in ("vllm", "asm"):       # key [nb, H, D/x, bs, x]
    k = kc[block, :, :, offset, :].reshape(kc.shape[1], -1)
    vc = np.asarray(value_cache, np.float32)
    if layout == "vllm":              # value [nb, H, D, bs]
      return k, vc[block, :, :, offset]
    x = vc.shape[-1]                  # value [nb, H, bs/x, D, x]
    return k, vc[block, :, offset // x, :, offset % x]
  if layout == "flash":               # [nb, bs, H, D]
    return kc[block, offset], np.asarray(value_cache, np.float32)[block, offset]
  if layout == "hnd":                 # [nb, H, bs, D]
    return kc[block, :, offset], np.asarray(value_cache, np.float32)[block, :, offset]
  row = kc[block, offset] if kv_layout == "NHD" else kc[block, :, offset]   # packed [.., 2D]
  half = row.shape[-1] // 2
  return row[:, :half], row[:, half:]


# Attention in the interpreter loops over tiles: a third of the profile's examples.
@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(layout=st.sampled_from(LAYOUTS), kv_heads=st.integers(1, 3), group=st.integers(1, 5),
       head_units=st.integers(1, 5), block_size=st.sampled_from([1, 8, 16, 32]),
       num_blocks=st.integers(2, 12), batch=st.integers(1, 4), width=st.integers(1, 4),
       options=st.sampled_from([{}, {"alibi": True}, {"soft_cap": 4.0}, {"window": 7},
                                {"alibi": True, "window": 20, "soft_cap": 9.0}]),
       seed=st.integers(0, 2**31 - 1))
def test_attention_kernel_equals_reference_equals_numpy(layout, kv_heads, group, head_units,
                                                        block_size, num_blocks, batch, width,
                                                        options, seed):
  """paged_attention_decode: random shapes, block tables (blocks may repeat, as vLLM's
  tests allow), lengths (0 included) and options; kernel == reference == a numpy model
  that reads the cache by the layouts' definitions."""
  rng = np.random.default_rng(seed)
  name, kv_layout = layout
  head_size = 16 * head_units
  assume(name != "asm" or block_size % 8 == 0)
  k_shape, v_shape = layout_lib.cache_shapes(name, num_blocks, block_size, kv_heads, head_size,
                                             jnp.float32, kv_layout)
  kc = jnp.asarray(rng.standard_normal(k_shape), jnp.float32)
  vc = None if v_shape is None else jnp.asarray(rng.standard_normal(v_shape), jnp.float32)
  table = rng.integers(0, num_blocks, (batch, width)).astype(np.int32)
  lens = rng.integers(0, width * block_size + 1, batch).astype(np.int32)
  num_q_heads = kv_heads * group
  query = jnp.asarray(rng.standard_normal((batch, num_q_heads, head_size)), jnp.float32)
  alibi = (rng.uniform(-0.5, 0, num_q_heads).astype(np.float32) if options.get("alibi")
           else None)
  cap, window, scale = options.get("soft_cap"), options.get("window"), head_size ** -0.5
  outs = [np.asarray(jkv.paged_attention_decode(
      query, kc, vc, table, lens, layout=name, kv_layout=kv_layout, alibi_slopes=alibi,
      logits_soft_cap=cap, sliding_window=window, backend=b)) for b in ("reference", KERNEL)]
  np.testing.assert_allclose(outs[1], outs[0], atol=2e-5, rtol=2e-5)
  expected = np.zeros((batch, num_q_heads, head_size))
  for b in range(batch):
    first = 0 if window is None else max(0, int(lens[b]) - window)
    positions = range(first, int(lens[b]))
    if not positions:
      continue
    tokens = [numpy_token(name, kv_layout, kc, vc, table[b, j // block_size], j % block_size)
              for j in positions]
    keys = np.stack([t[0] for t in tokens]).astype(np.float64)     # [n, Hkv, D]
    values = np.stack([t[1] for t in tokens]).astype(np.float64)
    for h in range(num_q_heads):
      logits = scale * keys[:, h // group] @ np.asarray(query[b, h], np.float64)
      if cap is not None:
        logits = cap * np.tanh(logits / cap)
      if alibi is not None:
        logits = logits + alibi[h] * (np.arange(first, int(lens[b])) - int(lens[b]) + 1)
      p = np.exp(logits - logits.max())
      expected[b, h] = p @ values[:, h // group] / (p.sum() + 1e-6)
  np.testing.assert_allclose(outs[0], expected, atol=2e-5, rtol=2e-5)


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(head_groups=st.sampled_from([(32, 16), (32, 32), (64, 16), (128, 128), (128, 64)]),
       block_size=st.sampled_from([1, 4, 16]), num_blocks=st.integers(1, 6),
       tokens=st.integers(1, 40), scale_fmt=st.sampled_from(["ue8m0", "float32"]),
       seed=st.integers(0, 2**31 - 1))
def test_indexer_write_kernel_equals_reference(head_groups, block_size, num_blocks, tokens,
                                               scale_fmt, seed):
  """indexer_k_quant_and_cache: random sizes and slots (padding, distinct valid slots) on a
  random byte cache; kernel == reference bit for bit, so untouched bytes keep theirs."""
  rng = np.random.default_rng(seed)
  head_dim, quant_block = head_groups
  stride = head_dim + head_dim // quant_block * 4
  cache = jnp.asarray(rng.integers(0, 256, (num_blocks, block_size, stride)), jnp.uint8)
  capacity = num_blocks * block_size
  slots = np.full(tokens, -1, np.int32)
  chosen = rng.permutation(capacity)[: min(tokens, capacity)]
  slots[rng.permutation(tokens)[: chosen.size]] = chosen
  slots[rng.random(tokens) < 0.2] = -1
  k = jnp.asarray(rng.standard_normal((tokens, head_dim)) * np.exp(rng.uniform(-4, 4)),
                  jnp.bfloat16)
  outs = [jkv.indexer_k_quant_and_cache(k, cache, slots, quant_block, scale_fmt, backend=b)
          for b in ("reference", KERNEL)]
  np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
  # each block is flat bytes: all values (token-major), then all scales (token-major)
  touched = np.zeros((num_blocks, block_size * stride), bool)
  scale_bytes = head_dim // quant_block * 4
  for slot in slots[slots >= 0]:
    block, offset = divmod(int(slot), block_size)
    touched[block, offset * head_dim:(offset + 1) * head_dim] = True
    first = block_size * head_dim + offset * scale_bytes
    touched[block, first:first + scale_bytes] = True
  np.testing.assert_array_equal(np.asarray(outs[1]).reshape(num_blocks, -1)[~touched],
                                np.asarray(cache).reshape(num_blocks, -1)[~touched])


@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(rank=st.integers(1, 40), pe=st.integers(1, 12).map(lambda n: 2 * n),
       heads=st.sampled_from([None, 1, 3]), tokens=st.integers(1, 24),
       num_blocks=st.integers(1, 5), block_size=st.sampled_from([1, 4, 16]),
       is_neox=st.booleans(), is_nope_first=st.booleans(), fp8=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_mla_rope_write_kernel_equals_reference(rank, pe, heads, tokens, num_blocks, block_size,
                                                is_neox, is_nope_first, fp8, seed):
  """fused_qk_rope_concat_and_cache_mla: random latent / RoPE sizes (padded tiles), head
  counts, entry orders, slots (padding, distinct valid ones) and an FP8 or float cache
  pre-filled with random values; kernel == reference, q_out included, element by element
  to 1 unit in the last place of the output dtype or 1e-5 (the rotation's float32
  products may be fused differently, and a pair's difference can cancel to a value much
  smaller than its terms; tests/test_mla.py checks the copied parts bit for bit)."""
  rng = np.random.default_rng(seed)
  kv_heads = () if heads is None else (heads,)
  q_heads = 2 * (heads or 1)
  cache_dtype = jnp.float8_e4m3fn if fp8 else jnp.float32
  cache = jnp.asarray(rng.standard_normal((num_blocks, block_size) + kv_heads + (rank + pe,)),
                      jnp.float32).astype(cache_dtype)
  capacity = num_blocks * block_size
  slots = np.full(tokens, -1, np.int32)
  chosen = rng.permutation(capacity)[: min(tokens, capacity)]
  slots[rng.permutation(tokens)[: chosen.size]] = chosen
  slots[rng.random(tokens) < 0.2] = -1
  inputs = [jnp.asarray(rng.standard_normal(shape) * 3, jnp.bfloat16) for shape in (
      (tokens, q_heads, rank), (tokens, q_heads, pe), (tokens,) + kv_heads + (rank,),
      (tokens,) + kv_heads + (pe,))]
  cos, sin = jkv.rope.rope_cache(32, pe, dtype=jnp.float32)
  positions = jnp.asarray(rng.integers(0, 32, tokens), jnp.int32)
  k_scale = 0.05 if fp8 else None
  outs = [jkv.fused_qk_rope_concat_and_cache_mla(
      *inputs, cache, slots, k_scale, None, positions, cos, sin, is_neox=is_neox,
      is_nope_first=is_nope_first, backend=b) for b in ("reference", KERNEL)]
  for a, b in zip(*outs):
    assert a.dtype == b.dtype
    close = [within_ulps(g, w, a.dtype) or abs(float(g) - float(w)) <= 1e-5
             for g, w in zip(np.asarray(b, np.float32).ravel(), np.asarray(a, np.float32).ravel())]
    assert all(close), np.nonzero(~np.asarray(close))[0][:5]


@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(layers=st.integers(1, 3), num_blocks=st.integers(2, 9), pairs=st.integers(0, 12),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8]),
       with_values=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_copy_blocks_kernel_equals_reference_equals_numpy(layers, num_blocks, pairs, dtype,
                                                          with_values, seed):
  """copy_blocks: random pairs (sources that are also destinations, duplicate
  destinations: the last pair wins, padding pairs) over random layers; kernel ==
  reference == numpy (every source read before any destination is written)."""
  rng = np.random.default_rng(seed)
  shape = (num_blocks, 3, 4)
  def caches():
    return [jnp.asarray(rng.integers(-100, 100, shape), jnp.int8).view(dtype)
            if dtype != jnp.bfloat16 else jnp.asarray(rng.standard_normal(shape), dtype)
            for _ in range(layers)]
  keys, values = caches(), (caches() if with_values else None)
  mapping = rng.integers(0, num_blocks, (pairs, 2)).astype(np.int32)
  mapping[rng.random(pairs) < 0.15] = -1
  outs = [jkv.copy_blocks(keys, values, mapping, backend=b) for b in ("reference", KERNEL)]
  for side, originals in ((0, keys), (1, values)):
    if originals is None:
      continue
    for layer, original in enumerate(originals):
      want = np.array(original)
      source = np.array(original)
      for src, dst in mapping:
        if src >= 0 and dst >= 0:
          want[dst] = source[src]
      for out in outs:
        np.testing.assert_array_equal(bits(out[side][layer]), bits(want))
