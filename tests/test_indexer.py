"""DeepSeek-V3.2 indexer cache: quantized writes and the gather, against an independent
numpy model of the byte layout (values block-major, then float32 scales)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from conftest import bits

FP8 = np.dtype(jnp.float8_e4m3fn)


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
  with pytest.raises(ValueError, match="quant_block_size must divide head_dim=128, got 96"):
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
  with pytest.raises(NotImplementedError, match="no Pallas kernel"):
    jkv.indexer_k_quant_and_cache(k, cache, jnp.arange(3), backend="pallas")
