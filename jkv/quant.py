"""Cache dtypes and the FP8 conversion every writer shares.

``kv_cache_dtype`` names (vLLM / AITER spelling):

===================  =========================  ======
name                 cache array dtype          max
===================  =========================  ======
``"auto"``           the cache's own dtype      --
``"fp8"``            ``float8_e4m3fn``          448
``"fp8_e4m3"``       ``float8_e4m3fn``          448
``"fp8_e4m3fnuz"``   ``float8_e4m3fnuz``        240
``"fp8_e5m2"``       ``float8_e5m2``            57344
===================  =========================  ======

Quantize: ``q = sat(x * (1 / scale))`` in float32 (AITER's form: the reciprocal is
computed once per op), round to nearest even, saturated to +-max (JAX's own cast
gives NaN past the max, so we clip first; NaN stays NaN). Dequantize: ``q * scale``.
Why not ``x / scale`` (vLLM on NVIDIA)? XLA:CPU's float32 division is not correctly
rounded (4.5 / 0.3 gives 15.0, not 14.999999), so a division is not reproducible
across back ends; a multiplication by one shared reciprocal is. The two differ by
at most one float32 ulp before the FP8 rounding. ``k_scale`` / ``v_scale`` are float32 scalars,
``[1]`` or ``[num_heads]`` (one scale per kv head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPES = {
    "fp8": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e4m3fnuz": jnp.float8_e4m3fnuz,
    "fp8_e5m2": jnp.float8_e5m2,
}
KV_CACHE_DTYPES = ("auto",) + tuple(FP8_DTYPES)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
  if kv_cache_dtype not in KV_CACHE_DTYPES:
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def fp8_dtype(kv_cache_dtype: str):
  """The FP8 dtype of a kv_cache_dtype name, or None for "auto"."""
  check_kv_cache_dtype(kv_cache_dtype)
  return FP8_DTYPES.get(kv_cache_dtype)


def is_fp8(dtype) -> bool:
  return np.dtype(dtype) in {np.dtype(d) for d in FP8_DTYPES.values()}


def dtype_max(dtype) -> float:
  """Largest finite value of a (quantized) dtype."""
  return float(jnp.finfo(dtype).max)


# NaN's bits (sign apart) in the FP8 formats with a sign bit on NaN.
_SIGNED_NAN_BITS = {np.dtype(jnp.float8_e4m3fn): 0x7F, np.dtype(jnp.float8_e5m2): 0x7F}

# (mantissa bits, smallest normal exponent) of the FP8 formats.
_FP8_FORMAT = {
    np.dtype(jnp.float8_e4m3fn): (3, -6),
    np.dtype(jnp.float8_e4m3fnuz): (3, -7),
    np.dtype(jnp.float8_e5m2): (2, -14),
}


def _round_half_even(v):
  """Round to nearest integer, ties to even, with floor only (Triton has no round)."""
  r = jnp.floor(v + 0.5)
  tie_to_odd = (r - v == 0.5) & (jnp.floor(r * 0.5) * 2.0 != r)
  return jnp.where(tie_to_odd, r - 1.0, r)


def pow2(exponent):
  """2.0 ** exponent as float32, exact, for int32 exponent in [-126, 127] (built from the
  exponent bits: no transcendental, the same on every back end)."""
  return jax.lax.bitcast_convert_type(((exponent + 127) << 23).astype(jnp.uint32), jnp.float32)


def round_up_pow2(scale):
  """2 ** ceil(log2(scale)) for positive normal float32 (exact, from the bits): the UE8M0
  scale format."""
  raw = jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
  exponent = ((raw >> 23) & 0xFF).astype(jnp.int32) - 127
  return pow2(exponent + ((raw & 0x7FFFFF) != 0).astype(jnp.int32))


def round_to_grid(y, *, mantissa_bits: int, min_exponent: int):
  """Rounds float32 y to the nearest value of a small float format, ties to even.

  The format has ``mantissa_bits`` explicit mantissa bits and smallest normal exponent
  ``min_exponent`` (subnormals share its quantum); no range limit is applied. Exact
  float32 arithmetic (power-of-two scaling and integer rounding), so a cast that follows
  is exact on every back end.
  """
  bits = jax.lax.bitcast_convert_type(y, jnp.uint32)
  exponent = ((bits >> 23) & 0xFF).astype(jnp.int32) - 127
  exponent = jnp.maximum(exponent, min_exponent)
  quantum = pow2(exponent - mantissa_bits)
  magnitude = _round_half_even(jnp.abs(y) / quantum) * quantum
  # Put y's sign back with integer ops: float negation or select may lose -0.0 under
  # the GPU compiler's no-signed-zeros rewrites.
  magnitude_bits = jax.lax.bitcast_convert_type(magnitude, jnp.uint32)
  return jax.lax.bitcast_convert_type(magnitude_bits | (bits & jnp.uint32(0x80000000)),
                                      jnp.float32)


def round_to_fp8_grid(y, dtype):
  """Rounds float32 y (|y| <= max) to the nearest value of an FP8 dtype, ties to even.

  XLA:CPU's own float32 -> float8_e5m2 cast rounds twice (through float16) in some
  fusions; this does not.
  """
  mantissa_bits, min_exponent = _FP8_FORMAT[np.dtype(dtype)]
  return round_to_grid(y, mantissa_bits=mantissa_bits, min_exponent=min_exponent)


def saturate_cast(y, dtype, *, native: bool = False):
  """float32 -> FP8, round to nearest even, saturated to +-max (NaN stays NaN).

  ``native=True`` (compiled GPU kernels only) leaves the rounding and the saturation to
  the hardware conversion: Pallas' Triton and Mosaic GPU lowerings both convert with
  ``cvt.rn.satfinite`` on NVIDIA, which rounds to nearest even, saturates finite values
  and infinities to +-max and keeps NaN. The compiled tests check it bit for bit against
  the exact path on every special value (``tests/test_quant.py``).
  """
  y = y.astype(jnp.float32)
  if native:
    return y.astype(dtype)
  m = dtype_max(dtype)
  # Clip, keeping NaN explicitly (Triton's min / max return the non-NaN operand).
  y = jnp.where(y == y, jnp.clip(y, -m, m), y)
  q = round_to_fp8_grid(y, dtype).astype(dtype)
  nan_bits = _SIGNED_NAN_BITS.get(np.dtype(dtype))
  if nan_bits is None:   # e4m3fnuz: one NaN (0x80), which the conversion writes
    return q
  # NaN as the GPU's conversion writes it (0x7F, with y's sign): XLA:CPU's conversion to
  # e5m2 writes 0x7E eagerly and 0x7F in some fusions.
  # Selected as bits: a select on FP8 values may go through float32 and lose the sign.
  sign = (jax.lax.bitcast_convert_type(y, jnp.uint32) >> 31).astype(jnp.uint8)
  bits = jnp.where(y == y, jax.lax.bitcast_convert_type(q, jnp.uint8),
                   jnp.uint8(nan_bits) | (sign << 7))
  return jax.lax.bitcast_convert_type(bits, dtype)


def e4m3fnuz_bits(y):
  """Bits (uint8) of ``saturate_cast(y, float8_e4m3fnuz)`` computed through e4m3fn.

  For kernels on back ends that can convert to e4m3fn but not e4m3fnuz (Triton on
  NVIDIA). e4m3fnuz has exponent bias 8 where e4m3fn has 7, so once y sits on the
  fnuz grid, the fnuz bits of y are the fn bits of 2y, except: fnuz' top value 240
  (0x7F) is NaN in fn, fnuz has no negative zero, and fnuz' only NaN is 0x80.
  """
  y = y.astype(jnp.float32)
  nan = y != y   # before clipping: Triton's min / max drop NaN
  y = round_to_fp8_grid(jnp.clip(y, -240.0, 240.0), jnp.float8_e4m3fnuz)
  fn = jnp.clip(2.0 * y, -448.0, 448.0).astype(jnp.float8_e4m3fn)
  bits = jax.lax.bitcast_convert_type(fn, jnp.uint8)
  sign = jnp.where(y < 0, jnp.uint8(0x80), jnp.uint8(0))
  bits = jnp.where(jnp.abs(y) == 240.0, sign | jnp.uint8(0x7F), bits)
  bits = jnp.where(bits == jnp.uint8(0x80), jnp.uint8(0), bits)
  return jnp.where(nan, jnp.uint8(0x80), bits)


# ---- Scaled quantization (per-token, per-block): FP8 or INT8 ------------------------------

SCALED_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e4m3fnuz, jnp.float8_e5m2, jnp.int8)
SCALE_FLOOR = 1e-12    # per-token quant: inv = 1 / max(scale, SCALE_FLOOR) (AITER)
AMAX_FLOOR = 1e-6      # per-block quant: amax = max(amax, AMAX_FLOOR) (AITER)


def check_scaled_dtype(name: str, dtype) -> None:
  if np.dtype(dtype) not in {np.dtype(d) for d in SCALED_DTYPES}:
    raise TypeError(f"{name} must be a float8_e4m3fn, float8_e4m3fnuz, float8_e5m2 or int8 "
                    f"cache, got dtype {np.dtype(dtype).name}")


def qmax(dtype) -> float:
  """Largest magnitude a scaled quantization maps amax to: 127 for int8, the FP8 max."""
  if np.dtype(dtype) == np.dtype(jnp.int8):
    return 127.0
  return dtype_max(dtype)


def scale_of(amax, dtype):
  """The scale that maps amax to qmax: ``amax * float32(1 / qmax)``.

  A multiplication by a constant, not AITER's ``amax / qmax``: XLA:CPU turns a division
  by a constant into this multiplication in some fusions and not in others, so only the
  multiplication gives the same bits everywhere (it is within one ulp of the division).
  """
  return amax * np.float32(1.0 / qmax(dtype))


def finite_abs(x):
  """|x| as float32 with non-finite entries as 0: what enters an amax (the NaN / Inf
  policy: a non-finite value never sets a scale)."""
  a = jnp.abs(x.astype(jnp.float32))
  return jnp.where(a < jnp.inf, a, 0.0)   # NaN < inf is False


def round_to_dtype(y, dtype, *, native: bool = False):
  """float32 y -> FP8 (saturating, RNE, NaN stays NaN) or INT8 (toward zero, as AITER's
  ``static_cast``; clamped to +-127, NaN -> 0), as ``dtype``. ``native``: see
  :func:`saturate_cast` (FP8 only; the compiled kernels convert INT8 with
  :func:`pallas_kernels.lowering.int8_toward_zero`)."""
  if np.dtype(dtype) == np.dtype(jnp.int8):
    y = y.astype(jnp.float32)
    return jnp.where(y == y, jnp.clip(y, -127.0, 127.0), 0.0).astype(jnp.int8)
  return saturate_cast(y, dtype, native=native)


def quantize(x, inv_scale, dtype):
  """``sat(float32(x) * inv_scale)`` as ``dtype`` (an FP8 dtype); inv_scale = 1 / scale
  broadcasts against x."""
  return saturate_cast(x.astype(jnp.float32) * inv_scale, dtype)


def dequantize(q, scale, dtype=jnp.float32):
  """``float32(q) * scale`` as ``dtype``."""
  return (q.astype(jnp.float32) * scale).astype(dtype)


def normalize_scale(scale, num_heads: int, name: str):
  """A k_scale / v_scale argument as a float32 array of shape [1] or [num_heads].

  None means 1.0 (AITER's default). Accepts Python floats, scalars, [1] and [num_heads].
  """
  if scale is None:
    return jnp.ones((1,), jnp.float32)
  if isinstance(scale, (int, float)):
    return jnp.full((1,), scale, jnp.float32)
  scale = jnp.asarray(scale)
  if not jnp.issubdtype(scale.dtype, jnp.floating):
    raise TypeError(f"{name} must be a float array, got dtype {scale.dtype}")
  if scale.ndim == 0:
    scale = scale.reshape(1)
  if scale.ndim != 1 or scale.shape[0] not in (1, num_heads):
    raise ValueError(f"{name} must be a scalar, [1] or [num_heads={num_heads}], got shape {scale.shape}")
  return scale.astype(jnp.float32)


def e4m3fnuz_value(bits):
  """float32 value of float8_e4m3fnuz bits (uint8), by arithmetic (no FP8 types needed):
  bias 8, no infinities, 0x80 is the only NaN."""
  b = bits.astype(jnp.int32)
  e, m = (b >> 3) & 15, (b & 7).astype(jnp.float32)
  exponent = jnp.maximum(e, 1) - 8
  scale = pow2(exponent)
  magnitude = jnp.where(e == 0, m * (2.0 ** -10), scale * (1.0 + m * 0.125))
  value = jnp.where((b & 0x80) != 0, -magnitude, magnitude)
  return jnp.where(b == 0x80, jnp.nan, value)
