import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jkv import quant

FP8 = [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz, jnp.float8_e5m2]
SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 232.0, 240.0, 239.9, 448.0, 464.0,
                     470.0, 57344.0, 61440.0, 1e9, -1e9, 2.0**-10, 2.0**-17, -(2.0**-9)],
                    np.float32)


def _sample(rng):
  scales = [1e-5, 1e-3, 0.1, 1, 10, 100, 1000, 1e5]
  y = np.concatenate([rng.standard_normal(20000) * s for s in scales]).astype(np.float32)
  return np.concatenate([y, SPECIALS])


@pytest.mark.parametrize("dtype", FP8)
def test_saturate_cast_matches_float64_rounding(dtype, rng):
  y = _sample(rng)
  m = float(jnp.finfo(dtype).max)
  expected = np.clip(y.astype(np.float64), -m, m).astype(dtype)  # one rounding, from float64
  got = np.asarray(quant.saturate_cast(jnp.asarray(y), dtype))
  nan = np.isnan(expected.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)  # NaN payloads may differ
  np.testing.assert_array_equal(got.view(np.uint8)[~nan], expected.view(np.uint8)[~nan])


@pytest.mark.parametrize("dtype", FP8)
def test_saturation_never_gives_nan_for_finite(dtype):
  m = float(jnp.finfo(dtype).max)
  y = jnp.asarray([m * 1.01, -m * 3, 1e30, -np.inf, np.inf], jnp.float32)
  got = np.asarray(quant.saturate_cast(y, dtype)).astype(np.float32)
  np.testing.assert_array_equal(got, [m, -m, m, -m, m])
  assert np.isnan(np.asarray(quant.saturate_cast(jnp.asarray([np.nan]), dtype)).astype(np.float32))


def test_e4m3fnuz_bits_equal_native_cast(rng):
  y = _sample(rng)
  expected = np.clip(y.astype(np.float64), -240, 240).astype(ml_dtypes.float8_e4m3fnuz)
  got = np.asarray(quant.e4m3fnuz_bits(jnp.asarray(y)))
  np.testing.assert_array_equal(got, expected.view(np.uint8))


def test_quantize_dequantize_round_trip(rng):
  x = jnp.asarray(rng.standard_normal(4096) * 3, jnp.float32)
  scale = float(jnp.max(jnp.abs(x))) / 448.0  # no saturation
  q = quant.quantize(x, 1 / scale, jnp.float8_e4m3fn)
  back = np.asarray(quant.dequantize(q, scale))
  # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normal values
  normal = np.abs(np.asarray(x)) / scale > 2.0**-6
  rel = np.abs(back - np.asarray(x))[normal] / np.abs(np.asarray(x))[normal]
  assert rel.max() <= 2.0**-4


def test_normalize_scale():
  assert quant.normalize_scale(None, 4, "k_scale").tolist() == [1.0]
  assert quant.normalize_scale(0.5, 4, "k_scale").tolist() == [0.5]
  assert quant.normalize_scale(jnp.float32(2), 4, "k_scale").shape == (1,)
  assert quant.normalize_scale(jnp.ones(4), 4, "k_scale").shape == (4,)
  with pytest.raises(ValueError, match=r"k_scale must be a scalar, \[1\] or \[num_heads=4\]"):
    quant.normalize_scale(jnp.ones(3), 4, "k_scale")
  with pytest.raises(TypeError, match="v_scale must be a float array"):
    quant.normalize_scale(jnp.ones(4, jnp.int32), 4, "v_scale")


def test_kv_cache_dtype_names():
  assert quant.fp8_dtype("auto") is None
  assert quant.fp8_dtype("fp8") == jnp.float8_e4m3fn
  assert quant.fp8_dtype("fp8_e4m3fnuz") == jnp.float8_e4m3fnuz
  with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
    quant.fp8_dtype("fp16")
