"""DeepSeek-V3.2 indexer cache: quantized writes and the gather, against an independent
numpy model of the byte layout (values block-major, then float32 scales), and the kernels
(interpret on CPU, compiled with JKV_BACKEND=pallas) against the jnp reference bit for bit
on poisoned caches / destinations."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from conftest import KERNEL, bits, poisoned_bytes

FP8 = np.dtype(jnp.float8_e4m3fn)
# (head_dim, quant_block_size): DeepSeek-V3.2's, and small ones with 2 and 1 groups
CONFIGS = [(128, 128), (32, 16), (32, 32)]


def numpy_quantize(k, qbs, scale_fmt):
  """float64 amax over finite values, float32 scale, FP8 values (saturating)."""
  k = np.asarray(k, np.float32)
  groups = k.reshape(k.shape[0], -1, qbs)
  finite = np.where(np.isfinite(groups), np.abs(groups), 0)
  scale = np.maximum(finite.max(-1), np.float32(1e-4)) * np.float32(1 / 448)
  if scale_fmt == "ue8m0":
    scale = np.exp2(np.ceil(np.log2(scale.astype(np.float64)))).astype(np.float32)
  y = groups * (np.float32(1) / scale)[..., None]
  y = np.where(np.isnan(y), y, np.clip(y, -448, 448))
  return y.astype(FP8).reshape(k.shape), scale.astype(np.float32)


def numpy_write(cache, k, slots, qbs, scale_fmt):
  cache = np.array(cache)
  num_blocks, block_size, stride = cache.shape
  head_dim = k.shape[1]
  values, scales = numpy_quantize(k, qbs, scale_fmt)
  flat = cache.reshape(num_blocks, -1)
  for t, s in enumerate(slots):
    if s < 0:
      continue
    b, o = divmod(int(s), block_size)
    flat[b, o * head_dim:(o + 1) * head_dim] = values[t].view(np.uint8)
    groups = head_dim // qbs
    start = block_size * head_dim + o * groups * 4
    flat[b, start:start + groups * 4] = scales[t].view(np.uint8)
  return flat.reshape(cache.shape), values, scales


@pytest.mark.parametrize("head_dim,qbs", [(128, 128), (128, 64), (128, 32), (64, 16)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float32"])
def test_write_then_gather(head_dim, qbs, block_size, scale_fmt, rng):
  num_tokens, num_blocks = 29, 40 // block_size + 2
  stride = head_dim + head_dim // qbs * 4
  k = rng.standard_normal((num_tokens, head_dim)).astype(np.float32) * rng.uniform(
      0.01, 30, (num_tokens, 1)).astype(np.float32)
  k[3, 5], k[4, 0] = np.nan, np.inf
  k = jnp.asarray(k, jnp.bfloat16)
  slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int32)
  slots[[1, 7]] = -1
  cache = jnp.asarray(rng.integers(0, 256, (num_blocks, block_size, stride), dtype=np.uint8))
  out = jkv.indexer_k_quant_and_cache(k, cache, jnp.asarray(slots), qbs, scale_fmt)
  want, values, scales = numpy_write(cache, k, slots, qbs, scale_fmt)
  np.testing.assert_array_equal(np.asarray(out), want)
  # round trip bound: |x - q * scale| <= 2^-4 |x| + scale * 2^-9 (e4m3 half ulp, subnormals)
  finite = np.isfinite(np.asarray(k, np.float32))
  deq = values.astype(np.float32).reshape(num_tokens, -1, qbs) * scales[..., None]
  x = np.asarray(k, np.float32).reshape(num_tokens, -1, qbs)
  ok = finite.reshape(x.shape)
  err = np.abs(deq - x)[ok]
  assert np.all(err <= 2.0 ** -4 * np.abs(x[ok]) + np.repeat(scales[..., None], qbs, -1)[ok] * 2.0 ** -9 * 1.01)
  assert np.isnan(values.astype(np.float32)[3, 5]) and values.astype(np.float32)[4, 0] == 448
  # gather: sequences of the written tokens through a block table (token-order pages)
  order = np.argsort(slots)
  slots_sorted = slots[order][slots[order] >= 0]
  lens = [5, len(slots_sorted) - 5]
  cu = np.array([0, lens[0], lens[0] + lens[1]], np.int32)
  # one "sequence" = consecutive written slots; block table lists each slot's block
  table = np.zeros((2, max(lens)), np.int32)
  dst_rows = cu[-1] + 3
  dst_k = jnp.asarray(rng.integers(0, 256, (dst_rows, head_dim), dtype=np.uint8))
  dst_scale = jnp.asarray(rng.standard_normal((dst_rows, head_dim // qbs)), jnp.float32)
  if block_size == 1:
    for b in range(2):
      table[b, :lens[b]] = slots_sorted[cu[b]:cu[b + 1]]
    got_k, got_scale = jkv.cp_gather_indexer_k_quant_cache(
        out, dst_k, dst_scale, jnp.asarray(table), jnp.asarray(cu))
    token_of_slot = {int(s): t for t, s in enumerate(slots)}
    rows = [token_of_slot[int(s)] for s in slots_sorted]
    np.testing.assert_array_equal(np.asarray(got_k)[:cu[-1]], values[rows].view(np.uint8))
    np.testing.assert_array_equal(bits(got_scale[:cu[-1]]), bits(scales[rows]))
    np.testing.assert_array_equal(np.asarray(got_k)[cu[-1]:], np.asarray(dst_k)[cu[-1]:])
    np.testing.assert_array_equal(bits(got_scale[cu[-1]:]), bits(dst_scale[cu[-1]:]))


def test_gather_pages_layers_and_byte_scales(rng):
  """Sequences spanning pages of block_size 4, a stacked layer (traced), vLLM's byte scales."""
  head_dim, qbs, block_size, layers = 32, 16, 4, 2
  stride = head_dim + head_dim // qbs * 4
  cache = jnp.asarray(rng.integers(0, 256, (layers, 6, block_size, stride), dtype=np.uint8))
  k = jnp.asarray(rng.standard_normal((7, head_dim)), jnp.float32)
  table = np.array([[3, 1], [5, 0]], np.int32)
  lens = [6, 1]
  slots = np.array([3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 1 * 4 + 0, 1 * 4 + 1, 5 * 4 + 0],
                   np.int32)
  write = jax.jit(lambda c, k, s, layer: jkv.indexer_k_quant_and_cache(k, c, s, qbs, layer=layer))
  out = write(cache, k, jnp.asarray(slots), jnp.int32(1))
  np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(cache[0]))      # other layer
  want, values, scales = numpy_write(cache[1], k, slots, qbs, "ue8m0")
  np.testing.assert_array_equal(np.asarray(out[1]), want)
  cu = np.array([0, lens[0], lens[0] + lens[1]], np.int32)
  dst_k = jnp.zeros((8, head_dim), jnp.float8_e4m3fn)
  dst_scale = jnp.zeros((8, head_dim // qbs * 4), jnp.uint8)
  gather = jax.jit(lambda c, dk, ds, t, cu, layer: jkv.cp_gather_indexer_k_quant_cache(
      c, dk, ds, t, cu, layer=layer))
  got_k, got_scale = gather(out, dst_k, dst_scale, jnp.asarray(table), jnp.asarray(cu),
                            jnp.int32(1))
  np.testing.assert_array_equal(bits(got_k[:7]), bits(values))
  np.testing.assert_array_equal(np.asarray(got_scale[:7]), scales.view(np.uint8).reshape(7, -1))
  assert not np.asarray(got_scale[7]).any()
  nothing = gather(out, dst_k, dst_scale, jnp.asarray(table), jnp.asarray(cu), jnp.int32(2))
  assert not np.asarray(nothing[1]).any()                      # traced layer out of range


def test_indexer_bad_inputs():
  k = jnp.zeros((3, 128))
  cache = jnp.zeros((4, 1, 132), jnp.uint8)
  with pytest.raises(ValueError,
                     match=r"quant_block_size must divide head_dim = k.shape\[1\] = 128, got 96"):
    jkv.indexer_k_quant_and_cache(k, cache, jnp.arange(3), 96)
  with pytest.raises(ValueError, match=r"last dim must be .* = 132, got shape \(4, 1, 136\)"):
    jkv.indexer_k_quant_and_cache(k, jnp.zeros((4, 1, 136), jnp.uint8), jnp.arange(3))
  with pytest.raises(TypeError, match="kv_cache must be uint8 bytes"):
    jkv.indexer_k_quant_and_cache(k, cache.astype(jnp.float32), jnp.arange(3))
  with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 4 is out of range"):
    jkv.indexer_k_quant_and_cache(k, cache, jnp.array([0, 1, 4]))
  with pytest.raises(ValueError, match="scale_fmt must be one of"):
    jkv.indexer_k_quant_and_cache(k, cache, jnp.arange(3), scale_fmt="e8m0")
  with pytest.raises(ValueError, match="slot_mapping must have 3 entries"):
    jkv.indexer_k_quant_and_cache(k, cache, jnp.arange(2))
  dst_k, dst_scale = jnp.zeros((3, 128), jnp.uint8), jnp.zeros((3, 1), jnp.float32)
  with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 4 is out of range"):
    jkv.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_scale, jnp.array([[0, 4]]),
                                        jnp.array([0, 2]))
  with pytest.raises(ValueError, match=r"cu_seq_lens must have shape \(2,\)"):
    jkv.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_scale, jnp.array([[0, 1]]),
                                        jnp.array([0, 1, 2]))
  with pytest.raises(TypeError, match="dst_scale must be float32"):
    jkv.cp_gather_indexer_k_quant_cache(cache, dst_k, jnp.zeros((3, 3), jnp.uint8),
                                        jnp.array([[0, 1]]), jnp.array([0, 2]))


def random_keys(rng, num_tokens, head_dim, dtype):
  """Keys of magnitudes 1e-6..1e4 per token, a zero row and a tiny row (the amax floor:
  FP8 subnormals and zeros), NaN, +-Inf (saturate to +-448) and, in float32, 3e38."""
  k = rng.standard_normal((num_tokens, head_dim)).astype(np.float32) * (
      10.0 ** rng.uniform(-6, 4, (num_tokens, 1))).astype(np.float32)
  k[1] = 0
  k[2] *= np.float32(1e-7) / np.abs(k[2]).max()
  k[3, 3] = np.nan
  k[4, 0], k[4, 1] = np.inf, -np.inf
  if dtype == jnp.float32:
    k[5, 2] = 3e38
  return jnp.asarray(k, dtype)


def written_bytes(shape, slots, head_dim, groups):
  """bool mask of the cache bytes ([NB, bs, stride]) that writes to ``slots`` touch."""
  num_blocks, block_size, _ = shape
  mask = np.zeros((num_blocks, block_size * shape[2]), bool)
  for s in slots[slots >= 0]:
    b, o = divmod(int(s), block_size)
    mask[b, o * head_dim:(o + 1) * head_dim] = True
    start = block_size * head_dim + o * groups * 4
    mask[b, start:start + groups * 4] = True
  return mask.reshape(shape)


@pytest.mark.parametrize("head_dim,qbs", CONFIGS)
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float32"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_kernel_write_matches_reference(head_dim, qbs, scale_fmt, dtype, rng):
  num_tokens, num_blocks, block_size = 13, 5, 4
  stride = head_dim + head_dim // qbs * 4
  k = random_keys(rng, num_tokens, head_dim, dtype)
  free = [s for s in rng.permutation(num_blocks * block_size) if s != 9]
  slots = np.array(free[:num_tokens], np.int32)
  slots[4] = 9                                 # the saturating token, at a known slot
  slots[[0, 6]] = -1
  cache = poisoned_bytes(rng, (num_blocks, block_size, stride))
  got = jkv.indexer_k_quant_and_cache(k, cache, jnp.asarray(slots), qbs, scale_fmt,
                                      backend=KERNEL)
  want = jkv.indexer_k_quant_and_cache(k, cache, jnp.asarray(slots), qbs, scale_fmt,
                                       backend="reference")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  untouched = ~written_bytes(cache.shape, slots, head_dim, head_dim // qbs)
  np.testing.assert_array_equal(np.asarray(got)[untouched], np.asarray(cache)[untouched])
  block, offset = divmod(9, block_size)
  saturated = np.asarray(got)[block].reshape(-1)[offset * head_dim:offset * head_dim + 2]
  np.testing.assert_array_equal(saturated, [0x7E, 0xFE])         # +-Inf -> +-448


def test_kernel_write_traced_layer(rng):
  head_dim, qbs, num_blocks, block_size = 32, 16, 3, 4
  cache = poisoned_bytes(rng, (2, num_blocks, block_size, head_dim + head_dim // qbs * 4))
  k = random_keys(rng, 7, head_dim, jnp.bfloat16)
  slots = jnp.asarray([5, -1, 0, 11, 2, -1, 7], jnp.int32)
  write = jax.jit(lambda c, k, s, layer, backend: jkv.indexer_k_quant_and_cache(
      k, c, s, qbs, "float32", layer=layer, backend=backend), static_argnums=4)
  got = write(cache, k, slots, jnp.int32(1), KERNEL)
  want = write(cache, k, slots, jnp.int32(1), "reference")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(cache[0]))
  nothing = write(cache, k, slots, jnp.int32(2), KERNEL)       # traced layer out of range
  np.testing.assert_array_equal(np.asarray(nothing), np.asarray(cache))


@pytest.mark.parametrize("head_dim,qbs", CONFIGS[:2])
@pytest.mark.parametrize("dst_k_dtype", [jnp.uint8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("byte_scales", [False, True])
def test_kernel_gather_matches_reference(head_dim, qbs, dst_k_dtype, byte_scales, rng):
  """Sequences of 5, 0 and 6 rows over blocks of 2 (the first needs 3 blocks, the table
  has 2: its last row keeps its value), a -1 table entry, 3 rows past cu_seq_lens[-1].
  Under jit (eagerly the first two raise: test_bad_inputs)."""
  num_blocks, block_size, groups = 6, 2, head_dim // qbs
  cache = poisoned_bytes(rng, (num_blocks, block_size, head_dim + groups * 4))
  table = jnp.asarray([[4, 1], [0, 0], [5, -1]], jnp.int32)
  cu = jnp.asarray([0, 5, 5, 11], jnp.int32)
  num_rows = 14
  dst_k = jax.lax.bitcast_convert_type(poisoned_bytes(rng, (num_rows, head_dim)), dst_k_dtype)
  dst_scale = (poisoned_bytes(rng, (num_rows, groups * 4)) if byte_scales else
               jnp.asarray(rng.standard_normal((num_rows, groups)), jnp.float32))
  got, want = (jax.jit(functools.partial(jkv.cp_gather_indexer_k_quant_cache, backend=backend))(
      cache, dst_k, dst_scale, table, cu) for backend in (KERNEL, "reference"))
  for g, w, before in zip(got, want, (dst_k, dst_scale)):
    assert g.dtype == before.dtype and g.shape == before.shape
    np.testing.assert_array_equal(bits(g), bits(w))
  kept = np.array([4, 7, 8, 9, 10, 11, 12, 13])   # past the table, block -1, past cu[-1]
  np.testing.assert_array_equal(bits(got[0])[kept], bits(dst_k)[kept])
  np.testing.assert_array_equal(bits(got[1])[kept], bits(dst_scale)[kept])


@pytest.mark.parametrize("backend", ["reference", KERNEL])
def test_gather_rows_before_the_first_sequence_keep_their_values(backend, rng):
  """cu_seq_lens[0] > 0: rows before it belong to no sequence (vLLM), so they keep dst's
  values; a decreasing cu_seq_lens raises eagerly; no sequences gather nothing."""
  head_dim, num_blocks, block_size = 32, 3, 4
  cache = poisoned_bytes(rng, (num_blocks, block_size, head_dim + 4))
  dst_k = poisoned_bytes(rng, (5, head_dim))
  dst_scale = jnp.asarray(rng.standard_normal((5, 1)), jnp.float32)
  table, cu = jnp.asarray([[1, 2]], jnp.int32), jnp.asarray([2, 5], jnp.int32)
  got = jkv.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_scale, table, cu,
                                            backend=backend)
  np.testing.assert_array_equal(bits(got[0])[:2], bits(dst_k)[:2])
  np.testing.assert_array_equal(bits(got[1])[:2], bits(dst_scale)[:2])
  first = jkv.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_scale, table,
                                             jnp.asarray([0, 3], jnp.int32), backend=backend)
  for g, f in zip(got, first):   # the sequence's rows, moved down by two
    np.testing.assert_array_equal(bits(g)[2:], bits(f)[:3])
  with pytest.raises(ValueError, match="cu_seq_lens must be non-decreasing"):
    jkv.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_scale, jnp.zeros((2, 2), jnp.int32),
                                        jnp.asarray([0, 4, 2]), backend=backend)
  none = jkv.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_scale,
                                             jnp.zeros((0, 2), jnp.int32),
                                             jnp.zeros((1,), jnp.int32), backend=backend)
  np.testing.assert_array_equal(bits(none[0]), bits(dst_k))


def test_kernel_gather_traced_layer(rng):
  """Stacked layers under jit: a traced layer, a block-table entry past the cache (dropped
  under jit), a traced layer out of range (nothing gathered)."""
  head_dim, qbs, num_blocks, block_size = 32, 16, 3, 4
  cache = poisoned_bytes(rng, (2, num_blocks, block_size, head_dim + head_dim // qbs * 4))
  table = jnp.asarray([[2, 7], [1, 0]], jnp.int32)
  cu = jnp.asarray([0, 6, 9], jnp.int32)
  dst_k = poisoned_bytes(rng, (10, head_dim))
  dst_scale = jnp.asarray(rng.standard_normal((10, head_dim // qbs)), jnp.float32)
  gather = jax.jit(lambda c, table, layer, backend: jkv.cp_gather_indexer_k_quant_cache(
      c, dst_k, dst_scale, table, cu, layer=layer, backend=backend), static_argnums=3)
  got = gather(cache, table, jnp.int32(1), KERNEL)
  want = gather(cache, table, jnp.int32(1), "reference")
  for g, w in zip(got, want):
    np.testing.assert_array_equal(bits(g), bits(w))
  np.testing.assert_array_equal(bits(got[0])[[4, 5, 9]], bits(dst_k)[[4, 5, 9]])  # block 7
  nothing = gather(cache, table, jnp.int32(-1), KERNEL)
  np.testing.assert_array_equal(bits(nothing[0]), bits(dst_k))
  np.testing.assert_array_equal(bits(nothing[1]), bits(dst_scale))
