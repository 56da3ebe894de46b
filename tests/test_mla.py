"""MLA cache writes and RoPE: kernel (interpret on CPU, compiled with JKV_BACKEND=pallas) vs the
jnp reference vs independent float64 numpy models; padding slots, FP8, both RoPE styles
and entry orders, single- and multi-head caches, DeepSeek's sizes and a small odd one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import rope
from conftest import KERNEL, bits

BACKENDS = ["reference", KERNEL]
SIZES = [(512, 64), (13, 6)]          # (kv_lora_rank R, pe dim P): DeepSeek's and a small odd one
MANTISSA = {np.dtype(jnp.bfloat16): 7, np.dtype(jnp.float16): 10, np.dtype(jnp.float32): 23,
            np.dtype(jnp.float8_e4m3fn): 3, np.dtype(jnp.float8_e4m3fnuz): 3}


def numpy_rope(x, pos, cos, sin, is_neox):
  """float64 model: rotate pairs as complex numbers by the cache's (cos, sin) at the
  clamped positions."""
  x = np.asarray(x, np.float64)
  cos, sin = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
  pos = np.clip(np.asarray(pos), 0, cos.shape[0] - 1)
  rot = (cos[pos] + 1j * sin[pos])[:, None, :]
  rot_dim = x.shape[-1]
  if is_neox:
    z = (x[..., :rot_dim // 2] + 1j * x[..., rot_dim // 2:]) * rot
    return np.concatenate([z.real, z.imag], -1)
  z = (x[..., 0::2] + 1j * x[..., 1::2]) * rot
  out = np.empty_like(x)
  out[..., 0::2], out[..., 1::2] = z.real, z.imag
  return out


def within_ulps(got, want, dtype, ulps=1):
  """|got - want| <= ulps units in the last place of dtype (both given as dtype arrays)."""
  g, w = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
  unit = np.spacing(np.abs(w).astype(np.float32)).astype(np.float64) * 2.0 ** (
      23 - MANTISSA[np.dtype(dtype)])
  return np.all((np.abs(g - w) <= ulps * unit) | ((g == w) | (np.isnan(g) & np.isnan(w))))


def test_rope_helpers_match_float64(rng):
  cos, sin = rope.rope_cache(50, 8, dtype=jnp.float32)
  angles = np.arange(50)[:, None] * 10000.0 ** (-np.arange(0, 8, 2) / 8)[None, :]
  np.testing.assert_allclose(np.asarray(cos), np.cos(angles), rtol=0, atol=1e-7)
  np.testing.assert_allclose(np.asarray(sin), np.sin(angles), rtol=0, atol=1e-7)
  x = rng.standard_normal((5, 3, 8)).astype(np.float32)
  pos = rng.integers(0, 50, 5)
  for is_neox in (True, False):
    got = rope.apply_rope(jnp.asarray(x), cos[pos][:, None], sin[pos][:, None], is_neox=is_neox)
    np.testing.assert_allclose(np.asarray(got), numpy_rope(x, pos, cos, sin, is_neox), atol=2e-6)
  both = jnp.concatenate([cos, sin], axis=1)
  c, s = rope.split_cos_sin_cache(both)
  np.testing.assert_array_equal(np.asarray(c), np.asarray(cos))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(sin))
  with pytest.raises(ValueError, match="rot_dim must be a positive even number"):
    rope.rope_cache(4, 7)
  with pytest.raises(ValueError, match="cos_sin_cache must be"):
    rope.split_cos_sin_cache(jnp.zeros((4, 7)))


def poisoned_cache(rng, shape, dtype):
  """A cache of random bit patterns: untouched entries must keep them. Multi-byte NaNs are
  replaced (XLA:CPU's bf16 scatter canonicalizes NaN payloads of untouched elements)."""
  raw = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
  values = raw.view(np.dtype(dtype)).reshape(shape)
  if np.dtype(dtype).itemsize > 1:
    values = np.where(np.isnan(values.astype(np.float32)), np.asarray(1.5, dtype), values)
  return jnp.asarray(values)


def slot_mapping(rng, num_tokens, num_blocks, block_size):
  slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int32)
  slots[rng.random(num_tokens) < 0.25] = -1                      # padding
  return slots


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank,pe", SIZES)
@pytest.mark.parametrize("heads", [None, 2])
@pytest.mark.parametrize("in_dtype,cache_dtype,kv_cache_dtype", [
    (jnp.bfloat16, jnp.bfloat16, "auto"), (jnp.float32, jnp.bfloat16, "auto"),
    (jnp.bfloat16, jnp.float8_e4m3fn, "fp8"), (jnp.float16, jnp.float8_e4m3fnuz, "fp8_e4m3fnuz")])
def test_concat_and_cache_mla(rank, pe, heads, in_dtype, cache_dtype, kv_cache_dtype, backend,
                              rng):
  num_tokens, num_blocks, block_size = 37, 6, 8
  head_shape = () if heads is None else (heads,)
  kv_c = jnp.asarray(rng.standard_normal((num_tokens,) + head_shape + (rank,)) * 3, in_dtype)
  k_pe = jnp.asarray(rng.standard_normal((num_tokens,) + head_shape + (pe,)) * 3, in_dtype)
  cache = poisoned_cache(rng, (num_blocks, block_size) + head_shape + (rank + pe,), cache_dtype)
  slots = slot_mapping(rng, num_tokens, num_blocks, block_size)
  scale = 0.1 if kv_cache_dtype != "auto" else None
  out = jkv.concat_and_cache_mla(kv_c, k_pe, cache, jnp.asarray(slots), kv_cache_dtype, scale,
                                 backend=backend)
  # numpy model
  want = np.array(cache)
  entry = np.concatenate([np.asarray(kv_c, np.float32), np.asarray(k_pe, np.float32)], -1)
  if scale is not None:
    entry = np.clip(entry * np.float32(1 / np.float32(scale)), -float(jnp.finfo(cache_dtype).max),
                    float(jnp.finfo(cache_dtype).max))
  for t, s in enumerate(slots):
    if s >= 0:
      want[s // block_size, s % block_size] = entry[t].astype(np.dtype(cache_dtype))
  np.testing.assert_array_equal(bits(out), bits(want))


def rope_inputs(rng, num_tokens, q_heads, kv_heads, rank, pe, dtype, max_pos=64):
  def rand(*shape):
    return jnp.asarray(rng.standard_normal(shape) * 2, dtype)
  kv_shape = () if kv_heads is None else (kv_heads,)
  positions = rng.integers(0, max_pos, num_tokens).astype(np.int32)
  positions[:2] = [-3, max_pos + 5]                              # clamped
  cos, sin = rope.rope_cache(max_pos, pe, dtype=dtype)
  return dict(q_nope=rand(num_tokens, q_heads, rank), q_pe=rand(num_tokens, q_heads, pe),
              kv_c=rand(num_tokens, *kv_shape, rank), k_pe=rand(num_tokens, *kv_shape, pe),
              positions=jnp.asarray(positions), cos_cache=cos, sin_cache=sin)


def parts(x, rank, pe, is_nope_first):
  """(nope, rope) halves of entries [..., R + P]."""
  x = np.asarray(x)
  if is_nope_first:
    return x[..., :rank], x[..., rank:]
  return x[..., pe:], x[..., :pe]


@pytest.mark.parametrize("rank,pe", SIZES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("is_nope_first", [True, False])
@pytest.mark.parametrize("kv_heads,cache_dtype,q_out_dtype", [
    (None, jnp.bfloat16, None), (2, jnp.float8_e4m3fn, jnp.float8_e4m3fn),
    (None, jnp.float8_e4m3fnuz, jnp.float8_e4m3fnuz)])
def test_fused_rope_concat_and_cache(rank, pe, is_neox, is_nope_first, kv_heads, cache_dtype,
                                     q_out_dtype, rng):
  num_tokens, q_heads, num_blocks, block_size = 21, 4, 4, 8
  inputs = rope_inputs(rng, num_tokens, q_heads, kv_heads, rank, pe, jnp.bfloat16)
  head_shape = () if kv_heads is None else (kv_heads,)
  cache = poisoned_cache(rng, (num_blocks, block_size) + head_shape + (rank + pe,), cache_dtype)
  slots = jnp.asarray(slot_mapping(rng, num_tokens, num_blocks, block_size))
  fp8_cache = cache_dtype != jnp.bfloat16
  arrays = dict(inputs, kv_cache=cache, slot_mapping=slots)
  static = dict(k_scale=0.5 if fp8_cache else None,
                q_scale=0.25 if q_out_dtype is not None else None, is_neox=is_neox,
                is_nope_first=is_nope_first, q_out_dtype=q_out_dtype)
  q_ref, kv_ref = jkv.fused_qk_rope_concat_and_cache_mla(**arrays, **static, backend="reference")
  q_ker, kv_ker = jax.jit(lambda a: jkv.fused_qk_rope_concat_and_cache_mla(
      **a, **static, backend=KERNEL))(arrays)
  q_dtype = q_ref.dtype
  # kernel vs reference: nope parts and untouched entries bit-exact; rotated parts within
  # one unit in the last place (the GPU may contract the rotation into FMAs)
  for got, want, dtype in ((q_ker, q_ref, q_dtype), (kv_ker, kv_ref, cache_dtype)):
    got_nope, got_rope = parts(got, rank, pe, is_nope_first)
    want_nope, want_rope = parts(want, rank, pe, is_nope_first)
    np.testing.assert_array_equal(bits(got_nope), bits(want_nope))
    assert within_ulps(got_rope, want_rope, dtype)
  written = np.zeros((num_blocks * block_size,), bool)
  written[np.asarray(slots)[np.asarray(slots) >= 0]] = True
  flat_ref = np.asarray(kv_ref).reshape((num_blocks * block_size, -1))
  flat_old = np.asarray(cache).reshape((num_blocks * block_size, -1))
  np.testing.assert_array_equal(bits(flat_ref[~written]), bits(flat_old[~written]))
  # reference vs float64 model
  q_nope_out, q_rope_out = parts(q_ref, rank, pe, is_nope_first)
  q_scale = 1.0 if q_out_dtype is None else 0.25
  if q_out_dtype is None:
    np.testing.assert_array_equal(bits(q_nope_out), bits(inputs["q_nope"]))   # exact copy
  cos, sin = inputs["cos_cache"], inputs["sin_cache"]
  want_rope = numpy_rope(inputs["q_pe"], inputs["positions"], cos, sin, is_neox) / q_scale
  tolerance = 2.0 ** -MANTISSA[np.dtype(q_dtype)] * np.abs(want_rope) + 2.0 ** -8
  assert np.all(np.abs(q_rope_out.astype(np.float64) - want_rope) <= tolerance)
  kv_nope, kv_rope = parts(kv_ref, rank, pe, is_nope_first)
  rows = np.nonzero(np.asarray(slots) >= 0)[0]
  k_scale = 0.5 if fp8_cache else 1.0
  pe_in = np.asarray(inputs["k_pe"], np.float64).reshape(num_tokens, -1, pe)
  want_k = numpy_rope(pe_in, inputs["positions"], cos, sin, is_neox) / k_scale
  got_k = kv_rope.reshape((num_blocks * block_size, -1, pe))[np.asarray(slots)[rows]]
  tolerance = 2.0 ** -MANTISSA[np.dtype(cache_dtype)] * np.abs(want_k[rows]) + 2.0 ** -8
  assert np.all(np.abs(got_k.astype(np.float64) - want_k[rows]) <= tolerance)
  got_nope = kv_nope.reshape((num_blocks * block_size, -1, rank))[np.asarray(slots)[rows]]
  want_nope = np.asarray(inputs["kv_c"], np.float32).reshape(num_tokens, -1, rank)[rows] / k_scale
  np.testing.assert_array_equal(
      bits(got_nope), bits(np.asarray(jnp.asarray(want_nope).astype(cache_dtype))))


@pytest.mark.parametrize("backend", ["reference", KERNEL])
def test_fused_rope_and_split_writes_of_no_tokens(backend, rng):
  """0 tokens: the fused op returns an empty q_out and the cache as it was; the fp8_split
  write (with RoPE) returns its caches; its RoPE tables are checked as the fused op's."""
  inputs = rope_inputs(rng, 2, 4, None, 32, 16, jnp.bfloat16)
  cache = poisoned_cache(rng, (3, 4, 48), jnp.bfloat16)
  empty = {k: v[:0] for k, v in inputs.items() if k not in ("cos_cache", "sin_cache")}
  q_out, out = jkv.fused_qk_rope_concat_and_cache_mla(
      **empty, cos_cache=inputs["cos_cache"], sin_cache=inputs["sin_cache"], kv_cache=cache,
      slot_mapping=jnp.zeros((0,), jnp.int32), k_scale=None, q_scale=None, backend=backend)
  assert q_out.shape == (0, 4, 48)
  np.testing.assert_array_equal(bits(out), bits(cache))
  split = jkv.MLACache.create(3, 4, 32, 16, kv_cache_dtype="fp8_split")
  cos, sin = inputs["cos_cache"], inputs["sin_cache"]
  after = split.write_split_rope(0, jnp.ones((0, 32)), jnp.ones((0, 16)), jnp.zeros((0,), int),
                                 jnp.zeros((0,), int), cos, sin, backend=backend)
  np.testing.assert_array_equal(bits(after.kv_cache), bits(split.kv_cache))
  with pytest.raises(ValueError, match=r"cos_cache must be \[max_pos >= 1, 8\] for pe dim 16"):
    split.write_split_rope(0, jnp.ones((2, 32)), jnp.ones((2, 16)), jnp.arange(2),
                           jnp.arange(2), jnp.ones((8, 16)), jnp.ones((8, 16)), backend=backend)


def test_fp8_saturates_and_keeps_nan():
  kv_c = jnp.asarray([[1e6, -1e6, np.nan, 1.0]], jnp.float32)
  k_pe = jnp.asarray([[np.inf, -2.0]], jnp.float32)
  for backend in BACKENDS:
    cache = jnp.zeros((1, 2, 6), jnp.float8_e4m3fn)
    out = jkv.concat_and_cache_mla(kv_c, k_pe, cache, jnp.array([1]), "fp8", 1.0,
                                   backend=backend)
    row = np.asarray(out[0, 1], np.float32)
    np.testing.assert_array_equal(row[[0, 1, 3, 4, 5]], [448, -448, 1, 448, -2])
    assert np.isnan(row[2])
    assert not np.asarray(out[0, 0], np.float32).any()


def test_mla_bad_inputs():
  kv_c, k_pe = jnp.zeros((3, 8)), jnp.zeros((3, 4))
  cache = jnp.zeros((2, 4, 12), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"kv_cache must have shape \(2, 4, 12\)"):
    jkv.concat_and_cache_mla(kv_c, k_pe, jnp.zeros((2, 4, 11)), jnp.zeros(3, jnp.int32))
  with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 8 is out of range"):
    jkv.concat_and_cache_mla(kv_c, k_pe, cache, jnp.array([0, 8, -1]))
  with pytest.raises(ValueError, match="slot_mapping must have 3 entries"):
    jkv.concat_and_cache_mla(kv_c, k_pe, cache, jnp.array([0, 1]))
  with pytest.raises(ValueError, match="scale is required"):
    jkv.concat_and_cache_mla(kv_c, k_pe, cache.astype(jnp.float8_e4m3fn), jnp.array([0, 1, 2]),
                             "fp8")
  with pytest.raises(TypeError, match="kv_cache must have dtype float8_e4m3fn"):
    jkv.concat_and_cache_mla(kv_c, k_pe, cache, jnp.array([0, 1, 2]), "fp8", 1.0)
  with pytest.raises(ValueError, match="must both be"):
    jkv.concat_and_cache_mla(kv_c, k_pe[:, None], cache, jnp.array([0, 1, 2]))
  with pytest.raises(TypeError, match="slot_mapping must be an integer array"):
    jkv.concat_and_cache_mla(kv_c, k_pe, cache, jnp.array([0.0, 1.0, 2.0]))
  inputs = rope_inputs(np.random.default_rng(0), 3, 2, None, 8, 4, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"cos_cache must be \[max_pos >= 1, 2\]"):
    jkv.fused_qk_rope_concat_and_cache_mla(
        **dict(inputs, cos_cache=jnp.zeros((8, 3)), sin_cache=jnp.zeros((8, 3))),
        kv_cache=cache, slot_mapping=jnp.array([0, 1, 2]), k_scale=None, q_scale=None)
  with pytest.raises(ValueError, match=r"positions must have shape \(3,\)"):
    jkv.fused_qk_rope_concat_and_cache_mla(
        **dict(inputs, positions=jnp.zeros(2, jnp.int32)), kv_cache=cache,
        slot_mapping=jnp.array([0, 1, 2]), k_scale=None, q_scale=None)
  with pytest.raises(ValueError, match="q_scale is required"):
    jkv.fused_qk_rope_concat_and_cache_mla(**inputs, kv_cache=cache,
                                           slot_mapping=jnp.array([0, 1, 2]), k_scale=None,
                                           q_scale=None, q_out_dtype=jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match=r"more KV heads \(3\) than query heads \(2\)"):
    jkv.fused_qk_rope_concat_and_cache_mla(
        **dict(inputs, kv_c=jnp.zeros((3, 3, 8)), k_pe=jnp.zeros((3, 3, 4))),
        kv_cache=jnp.zeros((2, 4, 3, 12)), slot_mapping=jnp.array([0, 1, 2]), k_scale=None,
        q_scale=None)


def test_fp8_ds_mla_entries(rng):
  """vLLM's 656-byte entry: FP8 kv_c per 128-value tile, float32 tile scales, bf16 k_pe;
  against a numpy byte model."""
  num_tokens, rank, pe = 9, 512, 64
  kv_c = rng.standard_normal((num_tokens, rank)).astype(np.float32) * rng.uniform(
      0.01, 50, (num_tokens, 1)).astype(np.float32)
  kv_c[2, :128] = 0.0                                            # a zero tile: FLT_MIN scale
  kv_c = jnp.asarray(kv_c, jnp.bfloat16)
  k_pe = jnp.asarray(rng.standard_normal((num_tokens, pe)), jnp.bfloat16)
  cache = jnp.asarray(rng.integers(0, 256, (3, 4, 656), dtype=np.uint8))
  slots = np.array([0, 5, 6, 7, -1, 11, 1, 2, 3], np.int32)
  out = jkv.concat_and_cache_mla(kv_c, k_pe, cache, jnp.asarray(slots), "fp8_ds_mla")
  want = np.array(cache).reshape(12, 656)
  x = np.asarray(kv_c, np.float32).reshape(num_tokens, 4, 128)
  scale = np.maximum(np.abs(x).max(-1) * np.float32(1 / 448), np.finfo(np.float32).tiny)
  values = np.clip(x * (np.float32(1) / scale)[..., None], -448, 448).astype(
      np.dtype(jnp.float8_e4m3fn)).reshape(num_tokens, rank)
  for t, s in enumerate(slots):
    if s >= 0:
      want[s] = np.concatenate([values[t].view(np.uint8), scale[t].astype(np.float32).view(
          np.uint8), np.asarray(k_pe)[t].view(np.uint8)])
  np.testing.assert_array_equal(np.asarray(out).reshape(12, 656), want)
  from jkv.reference.mla import ds_mla_decode
  got_c, got_pe = ds_mla_decode(out.reshape(12, 656)[slots[slots >= 0]], rank, pe)
  written = np.asarray(kv_c, np.float32)[slots >= 0]
  # e4m3: half an ulp is 2^-4 of the value for normals, 2^-10 of the tile scale for subnormals.
  tile_scale = np.repeat(scale[slots >= 0], 128, axis=-1)
  assert np.all(np.abs(np.asarray(got_c) - written)
                <= 2.0 ** -4 * np.abs(written) + 2.0 ** -10 * tile_scale)
  np.testing.assert_array_equal(bits(got_pe), bits(np.asarray(k_pe)[slots >= 0]))
  with pytest.raises(ValueError, match="multiple of 128"):
    jkv.concat_and_cache_mla(kv_c[:, :100], k_pe, cache, jnp.asarray(slots), "fp8_ds_mla")
  with pytest.raises(ValueError, match=r"kv_cache must have shape \(3, 4, 656\)"):
    jkv.concat_and_cache_mla(kv_c, k_pe, cache[..., :600], jnp.asarray(slots), "fp8_ds_mla")


def test_fused_fp8_bmm_rope_cat_and_cache(rng):
  """AITER's absorbed-MLA fusion: the FP8 group-quantized BMM against a float64 model of the
  same quantization, RoPE parts against the float64 rotation, the cache rows, extra outputs."""
  qh, batch, width, rank, pe, kh, bk, gs = 4, 3, 64, 16, 8, 2, 5, 32
  q_nope = rng.standard_normal((qh, batch, width)).astype(np.float32) * 2
  w = np.asarray(jnp.asarray(rng.standard_normal((qh, rank, width)), jnp.float8_e4m3fn))
  w_scale = np.array([0.05], np.float32)
  q_pe = jnp.asarray(rng.standard_normal((batch, qh, pe)), jnp.bfloat16)
  k_nope = jnp.asarray(rng.standard_normal((bk, kh, rank)), jnp.bfloat16)
  k_rope = jnp.asarray(rng.standard_normal((bk, kh, pe)), jnp.bfloat16)
  cos, sin = rope.rope_cache(32, pe, dtype=jnp.bfloat16)
  slots = jnp.array([6, -1, 2, 9], jnp.int32)                     # B_slot = 4 (3 decode + 1)
  positions = jnp.array([5, 9, 31, 40], jnp.int32)
  cache = jnp.asarray(rng.standard_normal((10, kh, rank + pe)), jnp.bfloat16)
  q_out, q_pe_out, k_pe_out, zeros, new_cache = jkv.fused_fp8_bmm_rope_cat_and_cache_mla(
      jnp.asarray(q_nope), jnp.asarray(w), jnp.asarray(w_scale), q_pe, k_nope, k_rope, cache,
      slots, positions, cos, sin, group_size=gs, is_neox=True, q_out_dtype=jnp.float32,
      num_decode_toks_for_zeros=2)
  # float64 model of the BMM with the same activation quantization
  groups = q_nope.reshape(qh, batch, width // gs, gs)
  a_scale = np.maximum(np.abs(groups).max(-1), 1e-10) * np.float32(1 / 448)
  qa = np.clip(groups * (np.float32(1) / a_scale)[..., None], -448, 448).astype(
      np.dtype(jnp.float8_e4m3fn)).astype(np.float64)
  wq = w.astype(np.float64).reshape(qh, rank, width // gs, gs)
  want = np.einsum("hbgk,hngk,hbg->bhn", qa, wq, a_scale.astype(np.float64)) * w_scale[0]
  np.testing.assert_allclose(np.asarray(q_out)[..., :rank], want, rtol=1e-5, atol=1e-5)
  want_rope = numpy_rope(q_pe, np.asarray(positions)[:batch], cos, sin, True)
  np.testing.assert_allclose(np.asarray(q_out)[..., rank:], want_rope, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(q_pe_out, np.float32), want_rope[:2], rtol=2 ** -8,
                             atol=1e-2)
  k_want = numpy_rope(k_rope, np.concatenate([np.asarray(positions), [0]]), cos, sin, True)
  np.testing.assert_allclose(np.asarray(k_pe_out, np.float32), k_want, rtol=2 ** -8, atol=1e-2)
  assert zeros.shape == (2, qh, rank) and not np.asarray(zeros).any()
  got = np.asarray(new_cache, np.float32)
  for t, s in enumerate(np.asarray(slots)):
    if s >= 0:
      np.testing.assert_array_equal(got[s, :, :rank], np.asarray(k_nope, np.float32)[t])
      np.testing.assert_allclose(got[s, :, rank:], k_want[t], rtol=2 ** -8, atol=1e-2)
  untouched = np.array([i for i in range(10) if i not in (6, 2, 9)])
  np.testing.assert_array_equal(bits(new_cache[untouched]), bits(cache[untouched]))
  with pytest.raises(ValueError, match="needs k_scale"):
    jkv.fused_fp8_bmm_rope_cat_and_cache_mla(
        jnp.asarray(q_nope), jnp.asarray(w), jnp.asarray(w_scale), q_pe, k_nope, k_rope,
        cache.astype(jnp.float8_e4m3fn), slots, positions, cos, sin, group_size=gs)
  with pytest.raises(ValueError, match="group_size must be a power of two dividing P=64"):
    jkv.fused_fp8_bmm_rope_cat_and_cache_mla(
        jnp.asarray(q_nope), jnp.asarray(w), jnp.asarray(w_scale), q_pe, k_nope, k_rope, cache,
        slots, positions, cos, sin, group_size=48)
