"""The fused FP8 BMM + RoPE + MLA cache kernel (:mod:`pallas_kernels.mla_bmm`; interpret on CPU,
compiled with JKV_BACKEND=pallas) against the jnp reference on fresh random data, under jit:
DeepSeek's sizes (16 query heads, P = 128, R = 512, d_pe = 64, group 128) and small odd ones
(1 or 2 KV heads, groups of 8 / 32 / 64, R not a power of two, padded RoPE pairs, two token
tiles), both RoPE styles, bf16 / f16 / f32 inputs, bf16 / f16 / FP8 caches, bf16 / f32 / FP8
q_out, n0 = 0 and > 0, padding slots and slots past the cache, clamped positions, NaN / Inf in
the query latent. Caches are poisoned with random non-zero values; untouched rows must keep
them.

Tolerances: the BMM's float32 sums are accumulated in another order than the reference's
(a bf16 x bf16 dot vs an einsum), so q_out[..., :R] must be the output-dtype rounding of some
float32 value within 1e-5 x sum |terms| of the reference's float32 value (sum |terms| =
|w_k_scale| sum_g a_scale_g sum_k |q_gk w_gk|, from the reference's own quantization); the
rotated parts (same float32 formula; the GPU may contract it into FMAs) within one unit in
the last place of their dtype; the cache's nope part and the zeros bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from conftest import KERNEL, bits
from jkv import rope
from jkv.reference import mla as reference
from pallas_kernels import mla_bmm

FP8 = jnp.float8_e4m3fn
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
MAX_POS, NUM_SLOTS, W_K_SCALE, K_SCALE = 40, 24, 0.05, 0.5
ARGS = ("q_nope", "w_k", "w_k_scale", "q_pe", "k_nope", "k_rope", "kv_cache", "slot_mapping",
        "positions", "cos", "sin")


def make_inputs(rng, qh, kh, batch, num_k, num_slot_tokens, width, group, rank, pe, dtype,
                cache_dtype, nonfinite=False):
  """Arguments of the op: q_nope groups scaled by 10^-2..10^2 each (per-group scales
  matter), slots with a padding (-1) and a past-the-cache entry, clamped positions, a cache
  of random non-zero values."""
  q_nope = rng.standard_normal((qh, batch, width // group, group)) * 10.0 ** rng.uniform(
      -2, 2, (qh, batch, width // group, 1))
  q_nope = q_nope.reshape(qh, batch, width)
  if nonfinite:   # Inf: left out of the amax, saturated; NaN: that row's q_out latent is NaN
    q_nope[0, 1, 3], q_nope[qh - 1, 2, width - 1], q_nope[1, 0, 5] = np.inf, -np.inf, np.nan
  slots = rng.permutation(NUM_SLOTS)[:num_slot_tokens].astype(np.int32)
  slots[1] = -1
  slots[num_slot_tokens - 2] = NUM_SLOTS + 3
  positions = rng.integers(0, MAX_POS, num_slot_tokens).astype(np.int32)
  positions[[0, 2]] = [-3, MAX_POS + 5]
  cos, sin = rope.rope_cache(MAX_POS, pe, dtype=BF16)
  cache = rng.uniform(0.25, 4, (NUM_SLOTS, kh, rank + pe)) * rng.choice([-1, 1], (
      NUM_SLOTS, kh, rank + pe))
  return dict(
      q_nope=jnp.asarray(q_nope, dtype),
      w_k=jnp.asarray(rng.standard_normal((qh, rank, width)), FP8),
      w_k_scale=jnp.asarray([W_K_SCALE], jnp.float32),
      q_pe=jnp.asarray(rng.standard_normal((batch, qh, pe)) * 2, dtype),
      k_nope=jnp.asarray(rng.standard_normal((num_k, kh, rank)) * 2, dtype),
      k_rope=jnp.asarray(rng.standard_normal((num_k, kh, pe)) * 2, dtype),
      kv_cache=jnp.asarray(cache, cache_dtype), slot_mapping=jnp.asarray(slots),
      positions=jnp.asarray(positions), cos=cos, sin=sin)


def run(inputs, backend, **static):
  fn = jax.jit(lambda a: jkv.fused_fp8_bmm_rope_cat_and_cache_mla(**a, **static,
                                                                   backend=backend))
  return fn(inputs)


def ordinal(x):
  """Values of a float dtype as integers in their order (adjacent values differ by 1; +-0
  are both 0)."""
  b = bits(x).astype(np.int64)
  sign_bit = 1 << (8 * np.asarray(x).dtype.itemsize - 1)
  return np.where(b & sign_bit, -(b & (sign_bit - 1)), b)


def assert_within_ulp(got, want):
  """got and want (one float dtype) equal or adjacent, NaN where the other is NaN."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype
  nan = np.isnan(want.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
  assert np.abs(ordinal(got) - ordinal(want))[~nan].max(initial=0) <= 1


@jax.jit(static_argnames="group")
def reference_bmm(q_nope, w_k, w_k_scale, group):
  """The reference's float32 BMM [B, QH, R], FP8 q_nope and its scales [QH, B, P / group]."""
  return (reference.fp8_group_bmm(q_nope, w_k, w_k_scale, group),
          *reference.per_token_group_quant(q_nope, group))


def assert_bmm_close(got, inputs, group):
  """got: q_out[..., :R] [B, QH, R]: the rounding to its dtype (saturating) of a float32
  value within 1e-5 x sum |terms| of the reference's float32 BMM."""
  want, q, a_scale = (np.asarray(x, np.float64) for x in reference_bmm(
      inputs["q_nope"], inputs["w_k"], inputs["w_k_scale"], group=group))
  qh, batch, width = q.shape
  q = np.abs(q).reshape(qh, batch, width // group, group)
  w = np.abs(np.asarray(inputs["w_k"], np.float64)).reshape(qh, -1, width // group, group)
  terms = np.einsum("hbgk,hngk,hbg->bhn", q, w, a_scale) * W_K_SCALE
  err = 1e-5 * terms
  dtype = got.dtype
  top = float(jnp.finfo(dtype).max)

  def rounded(x, direction):   # the output dtype's rounding (FP8 saturates), float64
    x = np.nextafter(x.astype(np.float32), direction)
    return np.clip(x, -top, top).astype(dtype).astype(np.float64)

  lo, hi = rounded(want - err, -np.inf), rounded(want + err, np.inf)
  got, nan = got.astype(np.float64), np.isnan(want)
  np.testing.assert_array_equal(np.isnan(got), nan)
  assert np.all((lo <= got) & (got <= hi) | nan)


def check(got, want, inputs, group, num_decode):
  """Kernel outputs vs the reference's (see the module docstring for the tolerances)."""
  got, want = ([np.asarray(x) for x in outs] for outs in (got, want))
  q_out, decode_q_pe, k_pe_out, zeros, cache = got
  rank = inputs["w_k"].shape[1]
  assert q_out.dtype == want[0].dtype and q_out.shape == want[0].shape
  assert_bmm_close(q_out[..., :rank], inputs, group)
  assert_within_ulp(q_out[..., rank:], want[0][..., rank:])
  assert_within_ulp(decode_q_pe, want[1])
  assert decode_q_pe.shape[0] == num_decode
  assert_within_ulp(k_pe_out, want[2])
  np.testing.assert_array_equal(bits(zeros), bits(want[3]))
  assert zeros.shape[0] == num_decode and not np.asarray(zeros, np.float32).any()
  assert cache.dtype == want[4].dtype
  slots = np.asarray(inputs["slot_mapping"])
  written = np.unique(slots[(slots >= 0) & (slots < NUM_SLOTS)])
  kept = np.setdiff1d(np.arange(NUM_SLOTS), written)
  poison = np.asarray(inputs["kv_cache"])
  np.testing.assert_array_equal(bits(cache[kept]), bits(poison[kept]))
  np.testing.assert_array_equal(bits(cache[written, :, :rank]), bits(want[4][written, :, :rank]))
  assert_within_ulp(cache[written, :, rank:], want[4][written, :, rank:])
  assert (bits(cache[written]) != bits(poison[written])).any()


# (QH, KH, B, Bk, B_slot, P, group, R, d_pe, input dtype, cache dtype, q_out dtype, n0, neox)
CASES = [
    (16, 1, 4, 4, 4, 128, 128, 512, 64, BF16, FP8, BF16, 2, True),          # DeepSeek
    (3, 1, 5, 7, 6, 64, 32, 48, 16, BF16, BF16, BF16, 0, True),
    (3, 1, 5, 7, 6, 64, 32, 48, 16, F16, FP8, FP8, 3, False),
    (4, 2, 5, 7, 6, 64, 32, 48, 16, F32, BF16, F32, 2, False),
    (4, 2, 5, 7, 6, 64, 32, 48, 16, BF16, FP8, F32, 5, True),
    (4, 2, 5, 5, 5, 64, 8, 48, 24, BF16, BF16, FP8, 1, False),
    (4, 1, 5, 7, 7, 64, 64, 80, 16, F32, FP8, BF16, 0, True),
    (2, 2, 17, 20, 18, 32, 16, 16, 8, F16, F16, F16, 4, True),              # two token tiles
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(
    str(np.dtype(x).name) if isinstance(x, type) else str(x) for x in c))
def test_kernel_matches_reference(case, rng):
  (qh, kh, batch, num_k, num_slot_tokens, width, group, rank, pe, dtype, cache_dtype,
   q_out_dtype, n0, is_neox) = case
  inputs = make_inputs(rng, qh, kh, batch, num_k, num_slot_tokens, width, group, rank, pe,
                       dtype, cache_dtype, nonfinite=dtype == F32 and kh == 2)
  static = dict(group_size=group, k_scale=K_SCALE if cache_dtype == FP8 else None,
                is_neox=is_neox, q_out_dtype=q_out_dtype, num_decode_toks_for_zeros=n0)
  got = run(inputs, KERNEL, **static)
  want = run(inputs, "reference", **static)
  check(got, want, inputs, group, n0)


@pytest.mark.parametrize("tokens_per_program,rank_per_step", [(16, 16), (32, 32)])
def test_kernel_tiles(tokens_per_program, rank_per_step, rng):
  """The kernel called directly with other tiles: R = 48 in 3 steps of 16 (or a padded
  second step of 32), a token tile larger than Bk."""
  inputs = make_inputs(rng, 4, 2, 5, 7, 6, 64, 32, 48, 16, BF16, BF16)
  args = dict(inputs, positions=jnp.concatenate([inputs["positions"], jnp.zeros(1, jnp.int32)]))
  static = dict(group_size=32, is_neox=False, q_out_dtype=F32, num_decode_toks_for_zeros=2)
  args = [args[name] for name in ARGS]   # positional, in the signatures' order
  got = jax.jit(lambda a: mla_bmm.fused_bmm_rope_cache(
      *a, jnp.ones((1,), jnp.float32), **static, interpret=KERNEL == "interpret",
      tokens_per_program=tokens_per_program, rank_per_step=rank_per_step))(args)
  want = jax.jit(lambda a: reference.fused_fp8_bmm_rope_cat_and_cache_mla(
      *a, k_inv_scale=jnp.ones((1,), jnp.float32), **static))(args)
  check(got, want, inputs, 32, 2)


@pytest.mark.parametrize("q_out_dtype", [FP8, jnp.float8_e4m3fnuz])
def test_fp8_q_out_saturates(q_out_dtype, rng):
  """An FP8 q_out saturates at the format's max (as Triton's conversion in AITER's kernel)
  in the latent and the rotated parts, and keeps NaN; e4m3fnuz too (the kernel computes its
  bits through e4m3fn)."""
  inputs = make_inputs(rng, 4, 2, 5, 7, 6, 64, 32, 48, 16, F32, BF16)
  inputs["q_pe"] = inputs["q_pe"] * 400.0
  inputs["w_k"] = jnp.asarray(np.asarray(inputs["w_k"], np.float32) * 64, FP8)
  inputs["q_nope"] = inputs["q_nope"].at[1, 0, 5].set(jnp.nan)
  static = dict(group_size=32, q_out_dtype=q_out_dtype, num_decode_toks_for_zeros=1)
  got, want = run(inputs, KERNEL, **static), run(inputs, "reference", **static)
  q_out = np.asarray(got[0], np.float32)
  top = float(jnp.finfo(q_out_dtype).max)
  assert np.nanmax(np.abs(q_out)) == top and np.isnan(q_out[0, 1, :48]).all()
  assert (np.abs(q_out[..., 48:]) == top).any()
  check(got, want, inputs, 32, 1)


def test_backend_choice(rng):
  """auto runs the back end resolve picks (the kernel on a GPU); B = 0 (key entries only)
  goes through the reference; a q_out_dtype that is not a float is refused."""
  inputs = make_inputs(rng, 2, 1, 3, 4, 4, 32, 16, 16, 8, BF16, BF16)
  static = dict(group_size=16, q_out_dtype=BF16)
  want = run(inputs, jkv.backend.resolve("auto"), **static)
  for g, w in zip(run(inputs, "auto", **static), want):
    np.testing.assert_array_equal(bits(g), bits(w))
  with pytest.raises(TypeError, match="q_out_dtype"):
    run(inputs, KERNEL, group_size=16, q_out_dtype=jnp.int8)
  empty = dict(inputs, q_nope=inputs["q_nope"][:, :0], q_pe=inputs["q_pe"][:0])
  got, want = run(empty, KERNEL, **static), run(empty, "reference", **static)
  assert got[0].shape == (0, 2, 24)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(bits(g), bits(w))
