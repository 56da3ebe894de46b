import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jkv import quant
from conftest import KERNEL
from pallas_kernels import common, lowering

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


# Around INT8's clamp and truncation, and around each FP8 format's largest value.
EDGES = np.concatenate([
    [126.9, 127.0, 127.5, 128.0, 128.5, 129.0, 0.99, -0.99, -126.9, -127.5, -128.0, -128.5,
     -129.0, 3e38, -3e38],
    *[m * (1.0 + np.arange(-4, 9) / 64.0) for m in (240.0, 448.0, 57344.0)],
]).astype(np.float32)


@pytest.mark.skipif(KERNEL == "interpret" or not lowering.triton_available(),
                    reason="the hardware conversion: compiled Triton kernels only")
@pytest.mark.parametrize("dtype", FP8 + [jnp.int8])
def test_native_conversion_in_a_kernel_matches_exact(dtype, rng):
  """What every compiled quantizing kernel stores (``common.quantize_stored(..., native=True)``:
  FP8 by the hardware's saturating conversion, no clip of ours; INT8 by the PTX of
  ``lowering.int8_toward_zero``) is bit for bit the exact path's (float64 rounding, explicit
  saturation), specials, infinities and NaN included."""
  y = np.concatenate([_sample(rng), EDGES, -EDGES])
  block = 4096
  y = np.pad(y, (0, -y.size % block), constant_values=1.0)
  y = jnp.asarray(y)
  stored = jnp.uint8 if dtype == jnp.float8_e4m3fnuz else dtype   # Triton: fnuz as bits

  def kernel(y_ref, out_ref):
    out_ref[...] = common.quantize_stored(y_ref[...], dtype, stored, True)

  got = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(y.shape, stored), grid=(y.size // block,),
      in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
      out_specs=pl.BlockSpec((block,), lambda i: (i,)),
      compiler_params=lowering.pl_triton.CompilerParams(num_warps=4, num_stages=1))(y)
  want = common.quantize_stored(y, dtype, stored, False)
  got, want = np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)
  differ = np.nonzero(got != want)[0]
  assert differ.size == 0, (f"{differ.size} differ, first at y={np.asarray(y)[differ[:5]]}: "
                            f"{got[differ[:5]]} vs {want[differ[:5]]}")


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
