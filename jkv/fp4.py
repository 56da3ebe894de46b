"""FP4 cache formats: E2M1 values packed two per byte, with micro-block scales.

=========  ==============  ==========================================================
format     values / scale  scale
=========  ==============  ==========================================================
mxfp4      32              E8M0 (a power of two, stored as ``float8_e8m0fnu``), OCP MX
nvfp4      16              E4M3 (``float8_e4m3fn``) times a float32 per-tensor global scale
=========  ==============  ==========================================================

Packing: element ``2i`` of a head row is the low nibble of byte ``i``, element ``2i+1``
the high nibble. E2M1 nibble: sign bit 3, exponent bits 2..1, mantissa bit 0; magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6.

Rounding rules (tested against float64 models in ``tests/test_fp4.py``):

* **E2M1**: round to nearest, ties to even (even mantissa), saturating to +-6; the sign of
  the input is kept (-0 stays -0).
* **mxfp4** (OCP Microscaling spec v1.0, section 6.3): ``X = floor(log2(amax)) - 2``
  clamped to [-127, 127] (amax = 0 gives -127); values ``x * 2**-X`` (exact) go through
  E2M1 (values in [6, 8) * 2**X saturate to 6, as the spec says).
* **nvfp4**: ``sf = e4m3(amax * r)`` (RNE, saturating to 448) with the float32 scalar
  ``r = 1 / (6 * global_scale)`` computed once (:func:`nvfp4_scale_multiplier`; one
  multiplication per group, so no back end can reassociate it); values
  ``x * (1 / (sf * global_scale))`` in float32 go through E2M1 (0 when sf is 0).
  Dequantize: ``e2m1 * float32(sf * global_scale)``.

NaN / Inf: a non-finite value in a group makes the group's scale NaN (E8M0 0xFF, E4M3
0x7F), so the whole group reads back NaN; no other group is affected.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jkv import quant

FORMATS = ("mxfp4", "nvfp4")
GROUP_SIZE = {"mxfp4": 32, "nvfp4": 16}
SCALE_DTYPE = {"mxfp4": jnp.float8_e8m0fnu, "nvfp4": jnp.float8_e4m3fn}
E2M1_MAX = 6.0


def check_format(fp4_format: str) -> None:
  if fp4_format not in FORMATS:
    raise ValueError(f"fp4_format must be one of {FORMATS}, got {fp4_format!r}")



# Magnitudes at which the E2M1 code steps up, rounding to nearest with ties to the even
# code: a tie (0.25, 1.25, 2.5, 5) stays on the even code below, a tie (0.75, 1.75,
# 3.5) moves up to the even code above.
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
               (3.5, True), (5.0, False))


def e2m1_code(y):
  """float32 y -> E2M1 nibble (uint8 0..15), RNE, saturating to +-6 (counting the
  rounding thresholds below |y|). NaN gives 0 (its group's scale carries the NaN)."""
  y = y.astype(jnp.float32)
  a = jnp.abs(y)
  code = jnp.zeros(y.shape, jnp.int32)
  for step, inclusive in _E2M1_STEPS:
    code = code + jnp.where((a >= step) if inclusive else (a > step), 1, 0)
  sign = (jax.lax.bitcast_convert_type(y, jnp.uint32) >> 28) & 0x8
  return (code | sign.astype(jnp.int32)).astype(jnp.uint8)


def e2m1_value(code):
  """E2M1 nibble (uint8, low 4 bits) -> float32."""
  code = code.astype(jnp.int32)
  e, m = (code >> 1) & 3, (code & 1).astype(jnp.float32)
  mag = jnp.where(e == 0, m * 0.5, quant.pow2(jnp.maximum(e, 1) - 1) * (1.0 + 0.5 * m))
  return jnp.where((code & 8) != 0, -mag, mag)


def pack(codes):
  """[..., 2n] nibbles -> [..., n] bytes (element 2i in the low nibble)."""
  return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed):
  """[..., n] bytes -> [..., 2n] nibbles."""
  low, high = packed & 0xF, packed >> 4
  return jnp.stack([low, high], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def mx_exponent(amax):
  """E8M0 scale exponent X of a group with finite float32 amax: floor(log2(amax)) - 2,
  clamped to [-127, 127] (exact: read off amax's exponent bits)."""
  exp_field = (jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.uint32) >> 23) & 0xFF
  return jnp.maximum(exp_field.astype(jnp.int32) - 127 - 2, -127)


def e8m0_value(byte):
  """E8M0 byte (uint8) -> float32 2**(byte - 127); 0xFF is NaN. Exact (2**-127 is a
  float32 subnormal)."""
  e = byte.astype(jnp.int32) - 127
  value = jnp.where(e >= -126, quant.pow2(jnp.maximum(e, -126)), np.float32(2.0 ** -127))
  return jnp.where(byte == 0xFF, jnp.nan, value)


def nvfp4_scale_multiplier(global_scale):
  """float32 scalar r = 1 / (6 * global_scale): nvfp4's sf is e4m3(amax * r)."""
  g = jnp.asarray(global_scale, jnp.float32).reshape(())
  return 1.0 / (6.0 * g)


def group_scale(amax, fp4_format: str, global_scale=None):
  """Scales of groups with finite float32 ``amax`` -> (factor, scale).

  The values are multiplied by ``factor`` before E2M1. mxfp4: ``scale`` is the E8M0
  exponent X (int32), factor ``2**-X``. nvfp4: ``scale`` is sf (float32 on the E4M3
  grid), factor ``1 / (sf * g)`` (0 where sf is 0).
  """
  if fp4_format == "mxfp4":
    exponent = mx_exponent(amax)
    return quant.pow2(-exponent), exponent
  multiplier = nvfp4_scale_multiplier(global_scale)
  sf = quant.round_to_fp8_grid(jnp.minimum(amax * multiplier, 448.0), jnp.float8_e4m3fn)
  return jnp.where(sf > 0, 1.0 / (sf * global_scale), 0.0), sf


def quantize_groups(x, fp4_format: str, global_scale=None):
  """x [..., G * n] -> (packed uint8 [..., G * n // 2], scale bytes uint8 [..., n]).

  Groups are consecutive ``GROUP_SIZE[fp4_format]`` values of the last axis. Scale
  bytes are E8M0 (mxfp4) or E4M3 (nvfp4) bits. ``global_scale``: float32 scalar (nvfp4).
  """
  group = GROUP_SIZE[fp4_format]
  x = x.astype(jnp.float32)
  lead, width = x.shape[:-1], x.shape[-1]
  grouped = x.reshape(lead + (width // group, group))
  finite = jnp.all(jnp.abs(grouped) < jnp.inf, axis=-1)
  amax = jnp.max(quant.finite_abs(grouped), axis=-1)
  g = None if global_scale is None else jnp.asarray(global_scale, jnp.float32).reshape(())
  factor, scale = group_scale(amax, fp4_format, g)
  y = grouped * factor[..., None]
  if fp4_format == "mxfp4":
    scale_bytes = jnp.where(finite, (scale + 127).astype(jnp.uint8), jnp.uint8(0xFF))
  else:
    scale_bytes = jax.lax.bitcast_convert_type(scale.astype(jnp.float8_e4m3fn), jnp.uint8)
    scale_bytes = jnp.where(finite, scale_bytes, jnp.uint8(0x7F))
  codes = e2m1_code(y).reshape(lead + (width,))
  return pack(codes), scale_bytes


def scale_value(scale_bytes, fp4_format: str, global_scale=None):
  """Scale bytes -> float32 multiplier of the E2M1 values."""
  if fp4_format == "mxfp4":
    return e8m0_value(scale_bytes)
  g = jnp.asarray(global_scale, jnp.float32).reshape(())
  sf = jax.lax.bitcast_convert_type(scale_bytes.astype(jnp.uint8), jnp.float8_e4m3fn)
  return sf.astype(jnp.float32) * g


def dequantize_groups(packed, scale_bytes, fp4_format: str, global_scale=None, dtype=jnp.float32):
  """Inverse of :func:`quantize_groups`: [..., n_bytes], [..., n] -> [..., 2 * n_bytes]."""
  group = GROUP_SIZE[fp4_format]
  values = e2m1_value(unpack(packed))
  lead, width = values.shape[:-1], values.shape[-1]
  scale = scale_value(scale_bytes, fp4_format, global_scale)
  out = values.reshape(lead + (width // group, group)) * scale[..., None]
  return out.reshape(lead + (width,)).astype(dtype)
