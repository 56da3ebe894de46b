"""FP4 caches (MXFP4, NVFP4): jkv.fp4 vs an independent float64 numpy model of the rules in
its docstring, round-trip error bounds, the paged write (reference vs model), argument
checks, and the FP4 ops' back ends (no Pallas kernel: "auto" runs the reference, an
explicit kernel back end raises)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jkv
from jkv import fp4
from conftest import assert_same, bits, random_slots

GROUP = {"mxfp4": 32, "nvfp4": 16}
SCALE_DTYPE = {"mxfp4": ml_dtypes.float8_e8m0fnu, "nvfp4": ml_dtypes.float8_e4m3fn}
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Jitted once per shape (eager op-by-op dispatch compiles every op: slow on CPU).
quantize_groups = jax.jit(fp4.quantize_groups, static_argnums=1)
dequantize_groups = jax.jit(fp4.dequantize_groups, static_argnums=2)


# ---- float64 numpy model -----------------------------------------------------------------

def model_e2m1(y):
  """float64 y -> E2M1 nibbles: nearest of E2M1 (ties to the even index), magnitudes above
  6 saturate, sign bit from the input's sign (so -0 -> 8). NaN -> magnitude 0."""
  y = np.asarray(y, np.float64)
  a = np.abs(y)
  a = np.where(np.isnan(a), 0.0, np.minimum(a, 6.0))
  dist = np.abs(a[..., None] - E2M1)
  best = dist == dist.min(axis=-1, keepdims=True)           # one entry, or two at a tie
  even = best & (np.arange(8) % 2 == 0)
  code = np.where(even.any(axis=-1), even.argmax(axis=-1), best.argmax(axis=-1))
  return (code | np.where(np.signbit(y), 8, 0)).astype(np.uint8)


def model_value(code):
  code = np.asarray(code)
  mag = E2M1[code & 7]
  return np.where(code & 8, -mag, mag)


def model_pack(codes):
  return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def model_unpack(packed):
  packed = np.asarray(packed)
  return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(
      packed.shape[:-1] + (2 * packed.shape[-1],))


def model_e4m3(s):
  """float64 s >= 0 -> float8_e4m3fn, RNE, saturating to 448. Rounded here in float64
  (ml_dtypes' float64 -> float8 cast rounds through float32 first: a double rounding);
  the rounded value is exact in e4m3, so ml_dtypes only encodes it."""
  s = np.minimum(np.asarray(s, np.float64), 448.0)
  exponent = np.floor(np.log2(np.maximum(s, 2.0 ** -6)))   # subnormals: spacing 2**-9
  step = 2.0 ** (exponent - 3)                              # 3 mantissa bits
  return (np.round(s / step) * step).astype(ml_dtypes.float8_e4m3fn)   # np.round: to even


# fp4.py evaluates nvfp4's amax / 6 / g in float32 (amax * (1 / 6) * (1 / g), which XLA
# may re-associate into amax * ((1 / 6) * (1 / g))): a few float32 ulps off the exact
# quotient, so within that of an E4M3 midpoint its sf can be the other neighbour (e.g. g
# = 3, amax = 0.087890625: amax / 6 / g = 0.0048828125 is exactly halfway between E4M3
# 0.00390625 and 0.005859375; RNE gives the even 0.00390625, fp4.py 0.005859375). The
# model accepts either neighbour when the quotient is within 2**-20 (relative) of a
# midpoint (random data: rarely, under 1e-5 of the groups) and then checks
# the values for the sf that was chosen. Ties with a power-of-two g are exact
# (test_nvfp4_scale_ties_to_even).
NEAR_TIE = 2.0 ** -20


def model_groups(x, fmt, g=None, chosen=None):
  """x [..., n * G] (float32 values) -> (codes [..., n * G], scale bytes [..., n], y [..., n * G]
  the scaled values that went through E2M1). Non-finite entries never enter the amax.
  ``chosen``: the implementation's scale bytes [..., n], taken (nvfp4) where the exact sf
  is a near-tie (NEAR_TIE) and they are one of its two neighbours."""
  x = np.asarray(x, np.float32)
  group = GROUP[fmt]
  grouped = x.reshape(x.shape[:-1] + (x.shape[-1] // group, group))
  finite = np.isfinite(grouped).all(axis=-1)
  a = np.abs(grouped.astype(np.float64))
  amax = np.where(np.isfinite(a), a, 0.0).max(axis=-1)
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    if fmt == "mxfp4":
      exponent = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2
      exponent = np.clip(np.where(amax > 0, exponent, -127), -127, 127)
      y = grouped.astype(np.float64) * 2.0 ** -exponent[..., None]   # exact
      scale = np.where(finite, exponent + 127, 0xFF).astype(np.uint8)
    else:
      g32 = np.float32(g)
      q = amax / 6.0 / np.float64(g32)
      sf = model_e4m3(q)
      if chosen is not None:
        lo, hi = model_e4m3(q * (1 - NEAR_TIE)), model_e4m3(q * (1 + NEAR_TIE))
        chosen = np.asarray(chosen, np.uint8).view(ml_dtypes.float8_e4m3fn)
        take = (lo != hi) & ((chosen == lo) | (chosen == hi))
        sf = np.where(take, chosen, sf)
      sf32 = sf.astype(np.float32)
      # As documented: x * (1 / (sf * g)), each operation in float32 (numpy rounds every
      # float32 operation correctly).
      inv = np.where(sf32 > 0, np.float32(1) / np.where(sf32 > 0, sf32 * g32, 1),
                     np.float32(0)).astype(np.float32)
      y = (grouped * inv[..., None]).astype(np.float64)
      scale = np.where(finite, sf.view(np.uint8), 0x7F).astype(np.uint8)
  y = y.reshape(x.shape)
  return model_e2m1(y), scale, y


def model_scale_value(scale, fmt, g=None):
  scale = np.asarray(scale, np.uint8)
  if fmt == "mxfp4":
    return np.where(scale == 0xFF, np.nan, 2.0 ** (scale.astype(np.float64) - 127))
  return scale.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * np.float64(np.float32(g))


def model_dequantize(codes, scale, fmt, g=None):
  """float64 e2m1 * scale (exact: e2m1 has 2 significant bits, the scale 4), not rounded."""
  group = GROUP[fmt]
  v = model_value(codes)
  v = v.reshape(v.shape[:-1] + (v.shape[-1] // group, group))
  return (v * model_scale_value(scale, fmt, g)[..., None]).reshape(codes.shape)


def assert_dequantized(got, want, fmt):
  """mxfp4: exact. nvfp4: dequantize_groups computes e2m1 * float32(sf * g): the rounding
  of sf * g (<= half an ulp of it, times e2m1 <= 6) plus the final rounding put it within
  1.25 ulp of the exact product (not always its correct rounding)."""
  got, want = np.asarray(got), np.asarray(want, np.float64)
  want32 = want.astype(np.float32)
  if fmt == "mxfp4":   # NaN payloads differ between back ends: compare NaN-ness
    nan = np.isnan(want32)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(bits(got[~nan]), bits(want32[~nan]))
    return
  nan = np.isnan(want)
  assert (np.isnan(got) == nan).all()
  got, want, want32 = got[~nan], want[~nan], want32[~nan]
  ulp = np.spacing(np.maximum(np.abs(got), np.abs(want32))).astype(np.float64)
  assert (np.abs(got.astype(np.float64) - want) <= 1.25 * ulp).all()
  np.testing.assert_array_equal(np.signbit(got), np.signbit(want32))


# ---- test data ---------------------------------------------------------------------------

def wide_range(rng, shape, group):
  """normal * 10**uniform(-3, 3) per group, times 10**uniform(-1, 1) per element."""
  per_group = 10.0 ** rng.uniform(-3, 3, shape[:-1] + (shape[-1] // group, 1))
  x = rng.standard_normal(shape[:-1] + (shape[-1] // group, group)) * per_group
  x = x * 10.0 ** rng.uniform(-1, 1, x.shape)
  return x.reshape(shape).astype(np.float32)


def special_rows(fmt, g=None):
  """Rows [4, 4 * G] of hand-made groups: E2M1 ties and grid points, zeros, -0, an
  all-zero group, saturation, NaN and Inf. With mxfp4 or a power-of-two g (nvfp4) the
  scaled values are exact, so the ties are exact."""
  group = GROUP[fmt]
  scale = 2.0 ** 5 if fmt == "mxfp4" else 2.0 ** 3 * g
  ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.125, 0.375, 6.0])
  grid = np.concatenate([E2M1, -E2M1])
  rows = []
  for sign in (1.0, -1.0):
    row = np.zeros(4 * group)
    # group 0: ties and grid points; amax = 6 * scale, so mxfp4: X = floor(log2(6 * 32)) - 2
    # = 5, 2**X = scale; nvfp4: sf = e4m3(6 * 8 g / 6 / g) = 8, x * (1 / (sf * g)) = x / scale.
    vals = np.concatenate([ties, -ties, grid])[:group]
    row[:group] = sign * vals * scale
    row[0] = 6.0 * scale
    # group 1: all zero, with negative zeros.
    row[group:2 * group] = 0.0
    row[group + 1:2 * group:3] = -0.0
    # group 2: tiny negatives (round to -0) next to a big value; ties around 2**X.
    row[2 * group:3 * group] = -1e-4 * scale
    row[2 * group] = sign * 4.0 * scale
    row[2 * group + 1:2 * group + 5] = sign * np.array([0.25, 0.75, 2.5, 5.0]) * scale
    # group 3: values in (6, 8) * 2**X (mxfp4: saturate to 6) and ties at the top.
    row[3 * group:4 * group] = sign * np.linspace(0.1, 7.9, group) * scale
    row[3 * group + 1] = sign * 7.0 * scale
    rows.append(row)
  nonfinite = np.ones((2, 4 * group)) * scale
  nonfinite[0, 5] = np.nan
  nonfinite[1, group + 3] = np.inf
  nonfinite[1, 2 * group + 7] = -np.inf
  return np.concatenate([np.stack(rows), nonfinite]).astype(np.float32)


def nvfp4_global(rng, x, low=0.5):
  """A per-tensor global scale the usual way (amax / (6 * 448)), times a random factor in
  [low, 2) (below 1: the largest groups' sf saturates at 448)."""
  a = np.abs(np.asarray(x, np.float64))
  return np.float32(np.max(a[np.isfinite(a)]) / (6 * 448) * rng.uniform(low, 2.0))


def compare_to_model(x, fmt, g):
  packed, scale = quantize_groups(jnp.asarray(x), fmt, g)
  packed, scale = np.asarray(packed), np.asarray(scale)
  codes, want_scale, y = model_groups(x, fmt, g, chosen=scale)
  assert packed.dtype == np.uint8 and scale.dtype == np.uint8
  np.testing.assert_array_equal(scale, want_scale)
  got = model_unpack(packed)
  # A NaN's sign bit is not defined by IEEE arithmetic: compare its magnitude code only.
  mask = np.where(np.isnan(y), 7, 15).astype(np.uint8)
  if jax.default_backend() != "cpu":
    # XLA's GPU code for x * (1 / (sf * g)) is not always the float32 formula to the last
    # ulp; where the model's scaled value lies within 4 ulps of an E2M1 rounding
    # threshold, accept the neighbouring code too.
    a = np.abs(y)
    near = np.zeros(y.shape, bool)
    for step in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
      near |= np.abs(a - step) <= 4 * np.spacing(np.float32(step))
    step_apart = np.abs((got & 7).astype(int) - (codes & 7).astype(int)) <= 1
    ok = ((got & mask) == (codes & mask)) | (near & step_apart)
    assert ok.all(), x[~ok.all(-1)]
    return packed, scale
  np.testing.assert_array_equal(got & mask, codes & mask)
  return packed, scale


# ---- quantize_groups vs model ------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_quantize_groups_matches_model(fmt, rng):
  group = GROUP[fmt]
  x = wide_range(rng, (64, 4 * group), group)
  g = nvfp4_global(rng, x) if fmt == "nvfp4" else None
  compare_to_model(x, fmt, g)
  if fmt == "nvfp4":
    compare_to_model(special_rows(fmt, g), fmt, g)           # near-ties, g arbitrary
    g = np.float32(0.125)                                     # exact ties
  special = special_rows(fmt, g)
  packed, scale = compare_to_model(special, fmt, g)
  eager = fp4.quantize_groups(jnp.asarray(special), fmt, g)   # not jitted: same bits
  np.testing.assert_array_equal(np.asarray(eager[0]), packed)
  np.testing.assert_array_equal(np.asarray(eager[1]), scale)
  codes = model_unpack(packed)
  assert (codes[0, group + 1:2 * group:3] == 8).all()   # -0 -> code 8
  assert (codes[0, group:2 * group:3] == 0).all()
  assert (codes[:2, 2 * group + 5:3 * group] == 8).all()  # tiny negatives: -0
  if fmt == "mxfp4":
    assert scale[-2, 0] == 0xFF and scale[-2, 1] != 0xFF and scale[-1, 1] == 0xFF
    assert scale[0, 1] == 0   # all-zero group: X = -127
  else:
    assert scale[-2, 0] == 0x7F and scale[-2, 1] != 0x7F and scale[-1, 1] == 0x7F
    assert scale[0, 1] == 0


def test_e2m1_ties_to_even():
  """Each rounding threshold, exactly and one float32 ulp either side."""
  mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
  want_at = [0, 2, 2, 4, 4, 6, 6]       # even codes
  for fmt, g in (("mxfp4", None), ("nvfp4", np.float32(0.25))):
    group = GROUP[fmt]
    # amax 6 * 2**X with X = 3 (mxfp4) / sf = 16, g = 0.25 (nvfp4): scale 8 and 4.
    scale = np.float32(8.0 if fmt == "mxfp4" else 4.0)
    for sign in (1, -1):
      x = np.zeros((3, group), np.float32)
      for row, m in enumerate((np.nextafter(mids, 0, dtype=np.float32), mids,
                               np.nextafter(mids, 7, dtype=np.float32))):
        x[row, :7] = sign * m * scale
        x[row, 7] = 6 * scale
      packed, _ = compare_to_model(x, fmt, g)
      codes = model_unpack(packed)[:, :7] & 7
      np.testing.assert_array_equal(codes[1], want_at)
      np.testing.assert_array_equal(codes[0], [0, 1, 2, 3, 4, 5, 6])
      np.testing.assert_array_equal(codes[2], [1, 2, 3, 4, 5, 6, 7])


def test_nvfp4_scale_ties_to_even():
  """amax / 6 / g exactly halfway between two E4M3 values (power-of-two g: exact in
  float32): sf goes to the even one, and 448 + 16 (halfway to 480) saturates to 448."""
  e4m3 = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
  mids = np.append((e4m3[:-1] + e4m3[1:]) / 2, 464.0)
  for g in (np.float32(1.0), np.float32(0.5), np.float32(2.0 ** -10)):
    x = np.zeros((len(mids), 16), np.float32)
    x[:, 3] = mids * 6 * np.float64(g)          # exact in float32
    x[::2, 3] *= -1
    assert (np.abs(x[:, 3].astype(np.float64)) / 6 / np.float64(g) == mids).all()
    _, scale = quantize_groups(jnp.asarray(x), "nvfp4", g)
    scale = np.asarray(scale)[:, 0]
    np.testing.assert_array_equal(scale, model_e4m3(mids).view(np.uint8))
    assert (scale[:-1] % 2 == 0).all() and scale[-1] == 0x7E   # even mantissa; 448
    compare_to_model(x, "nvfp4", g)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_nonfinite_only_poisons_its_group(fmt, rng):
  group = GROUP[fmt]
  x = wide_range(rng, (3, 4 * group), group)
  x[0, 3], x[1, group], x[2, 3 * group + 1] = np.nan, np.inf, -np.inf
  g = np.float32(0.01)
  packed, scale = quantize_groups(jnp.asarray(x), fmt, g)
  clean = x.copy()
  clean[0, :group], clean[1, group:2 * group], clean[2, 3 * group:] = 1.0, 1.0, 1.0
  packed_clean, scale_clean = quantize_groups(jnp.asarray(clean), fmt, g)
  nan_byte = 0xFF if fmt == "mxfp4" else 0x7F
  hit = np.zeros(scale.shape, bool)
  hit[0, 0] = hit[1, 1] = hit[2, 3] = True
  scale, scale_clean = np.asarray(scale), np.asarray(scale_clean)
  assert (scale[hit] == nan_byte).all()
  np.testing.assert_array_equal(scale[~hit], scale_clean[~hit])
  out = np.asarray(dequantize_groups(packed, jnp.asarray(scale), fmt, g))
  out = out.reshape(3, 4, group)
  assert np.isnan(out[hit]).all()
  assert np.isfinite(out[~hit]).all()


# ---- round trip --------------------------------------------------------------------------

def half_step(y):
  """Half the E2M1 spacing at magnitude |y| (<= 6)."""
  a = np.abs(y)
  return np.where(a < 2, 0.25, np.where(a < 4, 0.5, 1.0))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_round_trip_error_bounds(fmt, rng):
  group = GROUP[fmt]
  x = wide_range(rng, (128, 8 * group), group)
  g = nvfp4_global(rng, x, low=1.0) if fmt == "nvfp4" else None
  packed, scale = quantize_groups(jnp.asarray(x), fmt, g)
  out = np.asarray(dequantize_groups(packed, scale, fmt, g), np.float64)
  scale = np.asarray(scale)
  assert_dequantized(out.astype(np.float32),
                     model_dequantize(model_unpack(np.asarray(packed)), scale, fmt, g), fmt)
  xg = x.astype(np.float64).reshape(128, 8, group)
  err = np.abs(out.reshape(xg.shape) - xg)
  if fmt == "mxfp4":
    s = 2.0 ** (scale.astype(np.float64) - 127)[..., None]    # 2**X
    y = np.abs(xg) / s
    sat = y > 6
    # Not saturated: at most half the E2M1 step at |y| (so <= 2**X, half the largest step).
    assert (err[~sat] <= (half_step(y) * s)[~sat]).all()
    assert (err[~sat] <= np.broadcast_to(s, err.shape)[~sat]).all()
    # Saturated values ([6, 8) * 2**X): read back as +-6 * 2**X, an error below 2 * 2**X.
    assert (np.abs(out.reshape(xg.shape)) <= 6 * s).all()
    assert (err[sat] < 2 * np.broadcast_to(s, err.shape)[sat]).all()
    assert sat.any()
  else:
    # S = sf * g. Unsaturated values (|x| <= 6 S) round to within half an E2M1 step, <= S.
    # A value above 6 S saturates to 6 S: |x| - 6 S <= amax - 6 S <= 6 g (amax / (6 g) - sf)
    # <= 6 g u / 2 with u the E4M3 spacing at sf (RNE, no saturation), u <= sf / 8 for normal
    # sf (error <= 0.375 S) and u = 2**-9 for subnormal sf or sf = 0 (error <= 3 g 2**-9;
    # sf = 0: everything reads 0, |x| <= amax <= 6 g 2**-10). So |err| <= max(S, 3 g 2**-9),
    # plus float32 rounding of x * (1 / (sf g)) (3 roundings, relative 2**-22) at the
    # rounding thresholds.
    sf = scale.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    # g is large enough that no sf saturates: amax / (6 g) <= 448 (it may still round up
    # to 448 itself, from 432 on, with u = 32 <= sf / 8).
    assert (np.abs(xg).max(-1) / (6 * np.float64(g)) <= 448).all()
    s = (sf * np.float64(g))[..., None]
    bound = np.maximum(s, 3 * np.float64(g) * 2.0 ** -9) + 2.0 ** -20 * np.abs(xg)
    assert (err <= bound).all()
    # (float32(sf * g) may round up by half an ulp.)
    assert (np.abs(out.reshape(xg.shape)) <= 6 * s * (1 + 2.0 ** -23)).all()
    assert (sf == 0).any() and (sf < 2.0 ** -6).any()         # subnormal / zero sf covered


def test_nvfp4_saturated_scale_round_trip():
  """amax / 6 / g above 448: sf saturates to 448 and values above 6 * 448 * g to +-6 * 448 g."""
  g = np.float32(0.5)
  x = np.linspace(-3000, 3000, 32, dtype=np.float32)[None]
  packed, scale = quantize_groups(jnp.asarray(x), "nvfp4", g)
  compare_to_model(x, "nvfp4", g)
  assert (np.asarray(scale) == np.array(448, ml_dtypes.float8_e4m3fn).view(np.uint8)).all()
  out = np.asarray(dequantize_groups(packed, scale, "nvfp4", g))
  assert np.abs(out).max() == 6 * 448 * 0.5


# ---- paged write -------------------------------------------------------------------------

def random_fp4_caches(rng, fmt, num_blocks, block_size, heads, head_size, num_layers=None):
  """Random bytes everywhere (never all zeros), so untouched entries are checkable."""
  data_shape, scale_shape = jkv.fp4_cache_shapes(num_blocks, block_size, heads, head_size, fmt)
  lead = () if num_layers is None else (num_layers,)
  data = [jnp.asarray(rng.integers(1, 256, lead + data_shape, dtype=np.uint8)) for _ in range(2)]
  scales = [jnp.asarray(rng.integers(1, 255, lead + scale_shape, dtype=np.uint8)
                        .view(SCALE_DTYPE[fmt])) for _ in range(2)]
  return data + scales


def numpy_fp4_write(key, value, caches, slots, fmt, globals_, chosen):
  """Independent model: per-token loop. Returns the four expected arrays as uint8 and
  bit masks of what to compare (a NaN nibble's sign bit is left out: IEEE arithmetic does
  not define a NaN's sign). ``chosen``: the written K / V scale bytes (see NEAR_TIE)."""
  out = [np.array(c).view(np.uint8).copy() for c in caches]
  masks = [np.full(o.shape, 0xFF, np.uint8) for o in out]
  block_size = out[0].shape[2]
  for t, s in enumerate(slots):
    if s < 0:
      continue
    b, o = divmod(int(s), block_size)
    for i, src in enumerate((key, value)):
      codes, scale, y = model_groups(np.asarray(src[t], np.float32), fmt, globals_[i],
                                     chosen=np.asarray(chosen[i])[b, :, o])
      out[i][b, :, o] = model_pack(codes)
      out[2 + i][b, :, o] = scale
      masks[i][b, :, o] = ~model_pack(np.where(np.isnan(y), 8, 0).astype(np.uint8))
  return out, masks


@pytest.mark.parametrize("fmt,head_size,dtype", [
    ("mxfp4", 64, jnp.bfloat16), ("mxfp4", 128, jnp.float16), ("mxfp4", 64, jnp.float32),
    ("nvfp4", 64, jnp.float16), ("nvfp4", 128, jnp.float32), ("nvfp4", 80, jnp.bfloat16)])
def test_write_fp4_reference_model(fmt, head_size, dtype, rng):
  num_blocks, block_size, heads, tokens = 5, 16, 3, 21
  caches = random_fp4_caches(rng, fmt, num_blocks, block_size, heads, head_size)
  group = GROUP[fmt]
  slots = random_slots(rng, tokens, num_blocks * block_size, padding=3)
  t = np.flatnonzero(slots >= 0)
  key = wide_range(rng, (tokens, heads, head_size), group)
  key[t[0], 1, 5], key[t[1], 0, group] = np.nan, -np.inf     # poisons one group each
  key[t[2], 2, :3] = -0.0
  value = (rng.standard_normal((tokens, heads, head_size)) * 3).astype(np.float32)
  key, value = jnp.asarray(key, dtype), jnp.asarray(value, dtype)
  kg, vg = (None, None) if fmt == "mxfp4" else (nvfp4_global(rng, key), np.float32(0.0041))
  ref = jkv.reshape_and_cache_fp4(key, value, *caches, slots, fmt, kg, vg)
  for r, c in zip(ref, caches):
    assert r.dtype == c.dtype and r.shape == c.shape
  globals_ = (1.0, 1.0) if kg is None else (kg, vg)
  got = [np.asarray(r).view(np.uint8) for r in ref]
  want, masks = numpy_fp4_write(key, value, caches, slots, fmt, globals_, got[2:])
  for g_, w_, m_ in zip(got, want, masks):   # written slots as modeled, the rest untouched
    np.testing.assert_array_equal(g_ & m_, w_ & m_)
  assert (masks[0] != 0xFF).any()           # the NaN (and -inf * 0 when sf = 0)
  written = np.zeros((num_blocks, block_size), bool)
  for s in slots[slots >= 0]:
    written[divmod(int(s), block_size)] = True
  for g_, old in zip(got, caches):
    old = np.asarray(old).view(np.uint8)
    np.testing.assert_array_equal(g_.transpose(0, 2, 1, 3)[~written],
                                  old.transpose(0, 2, 1, 3)[~written])
  # Written slots decode to the model's values.
  for i, (src, g) in enumerate(zip((key, value), globals_)):
    for t, s in enumerate(slots):
      if s < 0:
        continue
      b, o = divmod(int(s), block_size)
      out = dequantize_groups(jnp.asarray(got[i][b, :, o]), jnp.asarray(got[2 + i][b, :, o]),
                              fmt, g)
      codes, scale, _ = model_groups(np.asarray(src[t], np.float32), fmt, g,
                                     chosen=got[2 + i][b, :, o])
      assert_dequantized(out, model_dequantize(codes, scale, fmt, g), fmt)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_write_fp4_layer_traced(fmt, rng):
  num_layers, num_blocks, block_size, heads, head_size, tokens = 3, 5, 16, 2, 64, 12
  caches = random_fp4_caches(rng, fmt, num_blocks, block_size, heads, head_size, num_layers)
  key = jnp.asarray(rng.standard_normal((tokens, heads, head_size)) * 5, jnp.bfloat16)
  value = jnp.asarray(rng.standard_normal((tokens, heads, head_size)), jnp.bfloat16)
  slots = random_slots(rng, tokens, num_blocks * block_size, padding=2)
  kg, vg = (None, None) if fmt == "mxfp4" else (np.float32(0.003), np.float32(0.002))
  write = jax.jit(lambda k, v, c, s, layer: jkv.reshape_and_cache_fp4(
      k, v, *c, s, fmt, kg, vg, layer=layer))
  out = write(key, value, caches, slots, jnp.int32(1))
  assert_same(write(key, value, caches, slots, jnp.int32(num_layers)), caches)  # dropped
  flat = jkv.reshape_and_cache_fp4(key, value, *[c[1] for c in caches], slots, fmt, kg, vg)
  for got, old, one in zip(out, caches, flat):
    np.testing.assert_array_equal(bits(got[1]), bits(one))
    np.testing.assert_array_equal(bits(got[0]), bits(old[0]))
    np.testing.assert_array_equal(bits(got[2]), bits(old[2]))


def test_write_fp4_cache_shapes():
  assert jkv.fp4_cache_shapes(5, 16, 3, 64, "mxfp4") == ((5, 3, 16, 32), (5, 3, 16, 2))
  assert jkv.fp4_cache_shapes(5, 16, 3, 80, "nvfp4") == ((5, 3, 16, 40), (5, 3, 16, 5))


# ---- argument checks ---------------------------------------------------------------------

def test_fp4_bad_inputs(rng):
  num_blocks, block_size, heads, head_size, tokens = 4, 8, 2, 64, 5
  key = jnp.asarray(rng.standard_normal((tokens, heads, head_size)), jnp.float32)
  slots = np.arange(tokens, dtype=np.int32)
  mx = random_fp4_caches(rng, "mxfp4", num_blocks, block_size, heads, head_size)
  nv = random_fp4_caches(rng, "nvfp4", num_blocks, block_size, heads, head_size)
  write = lambda caches, fmt="mxfp4", k=key, s=slots: jkv.reshape_and_cache_fp4(
      k, k, *caches, s, fmt)
  # head_size 48: not a multiple of mxfp4's 32.
  key48 = key[:, :, :48]
  bad = [jnp.zeros((num_blocks, heads, block_size, 24), jnp.uint8)] * 2 + [
      jnp.zeros((num_blocks, heads, block_size, 1), jnp.float8_e8m0fnu)] * 2
  with pytest.raises(ValueError, match="multiple of 32"):
    write(bad, k=key48)
  with pytest.raises(ValueError, match="multiple of 16"):
    jkv.fp4_cache_shapes(4, 8, 2, 40, "nvfp4")
  with pytest.raises(TypeError, match="key_cache must have dtype uint8"):
    write([mx[0].astype(jnp.int8)] + mx[1:])
  with pytest.raises(TypeError, match="value_cache must have dtype uint8"):
    write([mx[0], mx[1].view(jnp.int8)] + mx[2:])
  with pytest.raises(TypeError, match="k_block_scales must have dtype float8_e8m0fnu"):
    write(mx[:2] + [mx[2].astype(jnp.float32), mx[3]])
  with pytest.raises(TypeError, match="v_block_scales must have dtype float8_e4m3fn"):
    write(nv[:3] + [nv[3].view(jnp.uint8)], "nvfp4")
  with pytest.raises(TypeError, match="k_block_scales must have dtype float8_e4m3fn"):
    write(nv[:2] + [jnp.zeros(nv[2].shape, jnp.float8_e8m0fnu), nv[3]], "nvfp4")
  with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 32 is out of range"):
    write(mx, s=np.array([0, 1, num_blocks * block_size, -1], np.int32))
  with pytest.raises(ValueError, match="fp4_format must be one of"):
    write(mx, "fp4")
  with pytest.raises(ValueError, match="fp4_format must be one of"):
    jkv.fp4_cache_shapes(4, 8, 2, 64, "nvfp8")


# ---- back ends ---------------------------------------------------------------------------

def test_fp4_ops_have_no_kernel(rng):
  """The paged write, decode attention over an FP4 cache and the FP4 indexer pool write run
  the reference whatever the device ("auto" == "reference" bit for bit); an explicit
  kernel back end raises NotImplementedError (their kernels were removed, issue 28)."""
  heads, head_size, block_size, num_blocks = 2, 64, 16, 4
  key = jnp.asarray(rng.standard_normal((5, heads, head_size)), jnp.float32)
  slots = jnp.asarray([3, 17, -1, 40, 63], jnp.int32)
  table, lens = jnp.asarray([[1, 3], [0, 2]], jnp.int32), jnp.asarray([20, 9], jnp.int32)
  query = jnp.asarray(rng.standard_normal((2, 2 * heads, head_size)), jnp.float32)
  pool = jkv.FP4IndexerCache.create(num_blocks, block_size, head_size, num_layers=2)
  ops = {}
  for fmt in fp4.FORMATS:
    cache = jkv.PagedKVCache.create(num_blocks, block_size, heads, head_size, layout="hnd",
                                    quant=fmt, dtype=jnp.float32, num_layers=2)
    written = cache.write(1, key, -key, slots, backend="reference")
    ops[f"write {fmt}"] = lambda backend, c=cache: c.write(1, key, -key, slots,
                                                           backend=backend)
    ops[f"attend {fmt}"] = lambda backend, c=written: c.attend(1, query, table, lens,
                                                               backend=backend)
  ops["indexer pool write"] = lambda backend: pool.write(1, key[:, 0], slots, backend=backend)
  for name, op in ops.items():
    for backend in ("pallas", "interpret"):
      with pytest.raises(NotImplementedError, match="no Pallas kernel for this case"):
        op(backend)
    assert_same(op("auto"), op("reference"), name)
