"""Property tests for the byte formats: FP4 paged writes (MXFP4, NVFP4; reference only, no
kernel), swap_blocks and the MLA formats ("fp8_ds_mla" entries, MLACache "fp8_split").
Random shapes, dtypes, slot mappings (padding, out of range under jit) and block mappings
(skipped pairs, duplicate destinations); kernel == reference bit for bit where a kernel
exists; the reference == an independent numpy model of the bytes (derived from the format
docs, not from jkv's functions); entries not written keep their (random, never zero)
bytes.

Bounded for CI by the hypothesis profile in conftest.py (``HYPOTHESIS_PROFILE=thorough``
for a long run by hand). Every op runs under ``jax.jit`` (slots traced, so out-of-range
slots are dropped rather than rejected; and one compile is cheaper than eager dispatch).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jkv
from conftest import KERNEL, bits

pytestmark = pytest.mark.slow   # hypothesis over the kernels: -m slow runs it, not CI

DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
HOST = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
FLT_MIN = np.float32(np.finfo(np.float32).tiny)
SEEDS = st.integers(0, 2**31 - 1)


# ---- shared numpy helpers ----------------------------------------------------------------

def poison(rng, shape, dtype):
  """Random bit patterns of ``dtype`` (never all zeros), NaNs included, except for
  bfloat16 and float8_e5m2: XLA:CPU's gather / scatter canonicalizes their NaNs (bf16:
  quieted; e5m2: to 0x7F, sign lost), untouched elements' too, so those get none (a NaN's
  top exponent bit is cleared, which keeps the rest of its random bits)."""
  dtype = np.dtype(dtype)
  raw = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
  top_exponent = {np.dtype(jnp.float8_e5m2): 0x40, np.dtype(jnp.bfloat16): 0x4000}.get(dtype)
  if top_exponent is not None:
    word = raw.view(f"u{dtype.itemsize}").copy()
    nan = np.isnan(word.view(dtype).astype(np.float32))
    word[nan] &= ~np.array(top_exponent, word.dtype)
    raw = word.view(np.uint8)
  return jnp.asarray(raw.view(dtype).reshape(shape))


def adversarial_slots(rng, num_slots, capacity):
  """Distinct valid slots (some tokens get none when num_slots > capacity), then ~15 %
  padding (-1 and other negatives) and ~10 % past the cache (dropped under jit)."""
  slots = np.full(num_slots, -1, np.int64)
  n = min(num_slots, capacity)
  slots[rng.permutation(num_slots)[:n]] = rng.permutation(capacity)[:n]
  r = rng.random(num_slots)
  pad = r < 0.15
  slots[pad] = rng.choice([-1, -1, -7, -2**31], pad.sum())
  far = (r >= 0.15) & (r < 0.25)
  slots[far] = rng.choice([capacity, capacity + 1, 3 * capacity + 5, 2**31 - 1], far.sum())
  return slots.astype(np.int32)


def spread_values(rng, shape, group, decades, dtype, zero_groups=0.15):
  """float64 values: normal x 10**U(-decades, decades) per group of ``group`` along the last
  axis x 10**U(-3, 1) per element (so small ones fall into FP8 / E2M1 subnormal or zero
  codes), some all-zero groups and some -0.0; clipped to a range ``dtype`` holds."""
  lead, width = shape[:-1], shape[-1]
  g = lead + (width // group, group)
  x = rng.standard_normal(g) * 10.0 ** rng.uniform(-decades, decades, lead + (width // group, 1))
  x = x * 10.0 ** rng.uniform(-3, 1, g)
  x[rng.random(lead + (width // group,)) < zero_groups] = 0.0
  x[rng.random(g) < 0.03] = -0.0
  limit = float(jnp.finfo(dtype).max) / 4
  return np.clip(x, -limit, limit).reshape(shape)


def add_nonfinite(rng, x, count):
  flat = x.reshape(-1)
  flat[rng.integers(0, flat.size, count)] = rng.choice([np.nan, np.inf, -np.inf], count)
  return x


def e4m3_magnitude(a):
  """float64 |a| (finite) -> nearest float8_e4m3fn magnitude, ties to even, saturated to
  448 (3 mantissa bits, smallest normal exponent -6, subnormal spacing 2**-9)."""
  a = np.minimum(np.abs(np.asarray(a, np.float64)), 448.0)
  _, e = np.frexp(np.maximum(a, 2.0 ** -6))        # a = m 2**e, m in [0.5, 1)
  step = np.ldexp(1.0, e - 1 - 3)
  return np.round(a / step) * step                 # np.round: half to even


def e4m3_byte(magnitude, negative):
  """An e4m3fn grid magnitude (float64) and a sign -> its byte (bit 7 sign, bits 6..3
  exponent with bias 7, bits 2..0 mantissa; exponent 0: subnormal m 2**-9)."""
  m = np.asarray(magnitude, np.float64)
  _, e = np.frexp(np.where(m > 0, m, 1.0))
  exponent = e - 1
  normal = m >= 2.0 ** -6
  mant = np.where(normal, (np.ldexp(m, -exponent) - 1) * 8, m / 2.0 ** -9)
  field = np.where(normal, exponent + 7, 0)
  return ((field << 3) | mant.astype(np.int64) | np.where(negative, 0x80, 0)).astype(np.uint8)


def fp8_e4m3_bytes(y32):
  """float32 y -> (e4m3fn bytes of sat(y) RNE, mask): NaN stays NaN (0x7F, its sign bit
  not compared: IEEE does not define it), +-Inf saturate to +-448."""
  y = np.asarray(y32, np.float32)
  nan = np.isnan(y)
  mag = e4m3_magnitude(np.where(nan, 0.0, np.abs(y.astype(np.float64))))
  byte = np.where(nan, 0x7F, e4m3_byte(mag, np.signbit(y))).astype(np.uint8)
  return byte, np.where(nan, 0x7F, 0xFF).astype(np.uint8)


def bf16_bits(x32):
  """float32 (no NaN) -> bfloat16 bits, round to nearest even."""
  u = np.asarray(x32, np.float32).view(np.uint32).astype(np.uint64)
  return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def u8(x):
  return np.asarray(x).view(np.uint8)


# ---- FP4 ----------------------------------------------------------------------------------

E2M1_THRESHOLDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)


def e2m1_codes(y):
  """float y -> E2M1 nibbles (jkv/fp4.py's docstring): magnitudes 0, .5, 1, 1.5, 2, 3, 4,
  6 are codes 0..7; round to nearest, ties to the even code, saturating at 6; sign bit 3
  from y's sign (-0 -> 8); NaN -> code 0 (its group's scale carries the NaN)."""
  a = np.abs(np.asarray(y, np.float64))
  a = np.where(np.isnan(a), 0.0, a)
  with np.errstate(invalid="ignore"):
    code = np.where(a < 2, np.round(a * 2), np.where(
        a < 4, 4 + np.round(a - 2), np.where(a < 6, 6 + np.round((a - 4) / 2), 7)))
  return (code.astype(np.int64) | np.where(np.signbit(y), 8, 0)).astype(np.uint8)


def fp4_model(x32, fmt, g):
  """x [..., D] float32 -> (packed bytes [..., D/2], packed mask, scale bytes [..., D/G],
  unit [..., D/G]: the group's scale value, 2**X or float32(sf g); near [..., D]: the
  scaled value is within 4 float32 ulps of an E2M1 rounding threshold).

  mxfp4 (32 values, E8M0): X = floor(log2 amax) - 2, clamped to [-127, 127] (-127 for
  amax 0); codes of x 2**-X; scale byte X + 127. nvfp4 (16 values, E4M3 x float32 g):
  r = 1 / (6 g), sf = e4m3(min(amax r, 448)), codes of x (1 / (sf g)) (0 when sf = 0),
  every step in float32. amax over finite values; a non-finite value makes its group's
  scale byte NaN (0xFF / 0x7F). Mask: a NaN code's sign bit is not compared."""
  group = 32 if fmt == "mxfp4" else 16
  x = np.asarray(x32, np.float32)
  grouped = x.reshape(x.shape[:-1] + (x.shape[-1] // group, group))
  finite = np.isfinite(grouped).all(-1)
  amax = np.where(np.isfinite(grouped), np.abs(grouped), np.float32(0)).max(-1)
  with np.errstate(invalid="ignore", over="ignore"):
    if fmt == "mxfp4":
      _, e = np.frexp(amax)
      exponent = np.clip(np.where(amax > 0, e - 1 - 2, -127), -127, 127)
      unit = np.ldexp(1.0, exponent)
      y = grouped.astype(np.float64) * np.ldexp(1.0, -exponent)[..., None]   # exact
      scale = np.where(finite, exponent + 127, 0xFF).astype(np.uint8)
    else:
      g = np.float32(g)
      r = np.float32(1) / (np.float32(6) * g)
      sf = e4m3_magnitude(np.minimum(amax * r, np.float32(448)))
      sf32 = sf.astype(np.float32)
      factor = np.where(sf32 > 0, np.float32(1) / np.where(sf32 > 0, sf32 * g, 1),
                        np.float32(0)).astype(np.float32)
      unit = (sf32 * g).astype(np.float64)
      y = grouped * factor[..., None]                                          # float32
      scale = np.where(finite, e4m3_byte(sf, False), 0x7F).astype(np.uint8)
  y = y.reshape(x.shape)
  codes = e2m1_codes(y)
  nibble_mask = np.where(np.isnan(y), 0x7, 0xF).astype(np.uint8)
  pack = lambda c: (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)
  a = np.abs(y.astype(np.float64))[..., None]
  near = (np.abs(a - E2M1_THRESHOLDS) <= 4 * np.spacing(E2M1_THRESHOLDS)).any(-1)
  return pack(codes), pack(nibble_mask), scale, unit, near


def assert_codes_close(got, want, mask, loose):
  """Packed E2M1 bytes equal under ``mask``, except that a nibble flagged in ``loose``
  [..., bytes, 2] may be the neighbouring code of the same sign."""
  nibbles = lambda b: np.stack([b & 0xF, b >> 4], -1)
  g, w, m = nibbles(got), nibbles(want), nibbles(mask)
  step = np.abs((g & 7).astype(int) - (w & 7).astype(int)) <= 1
  ok = ((g & m) == (w & m)) | (loose & step & ((g & 8) == (w & 8)))
  assert ok.all(), (np.argwhere(~ok)[:5], g[~ok][:5], w[~ok][:5])


def with_ties(rng, x, fmt, g, dtype):
  """x [..., D] float64 with ~15 % of its values moved onto E2M1 rounding thresholds or
  grid points times their group's unit, in the groups whose unit is a power of two
  (mxfp4: all, 2**X; nvfp4: where sf g is), so that the ties are exact on every back end;
  only where that does not raise the group's amax."""
  group = 32 if fmt == "mxfp4" else 16
  x32 = np.asarray(jnp.asarray(x, dtype), np.float32)
  unit = np.repeat(fp4_model(x32, fmt, g)[3], group, -1)
  unit = np.where(np.frexp(unit)[0] == 0.5, unit, 0.0)     # powers of two only
  amax = np.repeat(np.abs(np.where(np.isfinite(x32), x32, 0)).reshape(
      x.shape[:-1] + (-1, group)).max(-1), group, -1)
  t = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.5, 3.0, 6.0], x.shape)
  snapped = np.where(rng.random(x.shape) < 0.5, -1, 1) * t * unit
  pick = (rng.random(x.shape) < 0.15) & (np.abs(snapped) <= amax) & np.isfinite(x32)
  return np.where(pick, snapped, x)


# Per format (so CI's derandomized draw covers both): a fifth of the profile's examples.
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@settings(max_examples=max(5, settings.default.max_examples // 5))
@given(dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]),
       heads=st.integers(1, 3), groups=st.integers(1, 3), block_size=st.sampled_from([1, 4, 8, 16]),
       num_blocks=st.integers(1, 4), tokens=st.integers(1, 24), extra_rows=st.integers(0, 3),
       layers=st.sampled_from([None, 1, 3]), decades=st.integers(0, 12),
       global_scale=st.sampled_from(["none", "fit", "tight", "pow2"]), nonfinite=st.booleans(),
       seed=SEEDS)
def test_fp4_write_reference_equals_numpy(fmt, dtype, heads, groups, block_size, num_blocks,
                                          tokens, extra_rows, layers, decades, global_scale,
                                          nonfinite, seed):
  """reshape_and_cache_fp4: random head sizes (1-3 groups), block sizes, layer stacks
  (traced layer), input dtypes, magnitudes over up to 24 decades (zero groups, -0, E2M1 /
  E4M3 zero codes and saturation, values on E2M1 ties; optional NaN / Inf), nvfp4 global
  scales (default 1, fitted, or tight so the largest groups' sf saturates), slots with
  padding and past the cache, key rows past the slot mapping. The reference's bytes == the
  numpy model at written slots and the poisoned originals everywhere else (other slots,
  other layers)."""
  rng = np.random.default_rng(seed)
  group = 32 if fmt == "mxfp4" else 16
  head_size = group * groups
  scale_dtype = jnp.float8_e8m0fnu if fmt == "mxfp4" else jnp.float8_e4m3fn
  lead = () if layers is None else (layers,)
  data_shape = lead + (num_blocks, heads, block_size, head_size // 2)
  scale_shape = lead + (num_blocks, heads, block_size, head_size // group)
  caches = [poison(rng, data_shape, np.uint8) for _ in range(2)] + [
      poison(rng, scale_shape, scale_dtype) for _ in range(2)]
  capacity = num_blocks * block_size
  slots = adversarial_slots(rng, tokens, capacity)
  rows = tokens + extra_rows                         # key rows past the slots: not written
  kv = [spread_values(rng, (rows, heads, head_size), group, decades, dtype) for _ in range(2)]
  if nonfinite:
    kv = [add_nonfinite(rng, x, 2) for x in kv]
  globals_ = (None, None)
  if fmt == "nvfp4" and global_scale != "none":
    low = 0.2 if global_scale == "tight" else 1.0
    globals_ = tuple(np.float32(max(np.abs(np.nan_to_num(x, posinf=0, neginf=0)).max(), 1e-6)
                                / (6 * 448) * rng.uniform(low, 3)) for x in kv)
    if global_scale == "pow2":
      globals_ = tuple(np.float32(2.0 ** np.round(np.log2(g))) for g in globals_)
  kv = [with_ties(rng, x, fmt, 1.0 if g is None else g, dtype) for x, g in zip(kv, globals_)]
  key, value = (jnp.asarray(x, dtype) for x in kv)
  layer = None if layers is None else int(rng.integers(0, layers))

  fn = lambda k, v, c, s, *layer: jkv.reshape_and_cache_fp4(
      k, v, *c, s, fmt, *globals_, layer=layer[0] if layer else None)
  extra = () if layer is None else (jnp.int32(layer),)
  ref = [u8(a) for a in jax.jit(fn)(key, value, caches, jnp.asarray(slots), *extra)]
  for r, c in zip(ref, caches):
    assert r.shape == c.shape
  # numpy model: the poisoned bytes, with each valid slot's entry replaced
  want = [u8(c).copy() for c in caches]
  masks = [np.full(w.shape, 0xFF, np.uint8) for w in want]
  loose = [np.zeros(w.shape + (2,), bool) for w in want[:2]]
  written = np.zeros(lead + (num_blocks, block_size), bool)
  at = () if layer is None else (layer,)
  for i, x in enumerate((key, value)):
    g = 1.0 if globals_[i] is None else globals_[i]
    packed, packed_mask, scale, _, near = fp4_model(np.asarray(x, np.float32)[:tokens], fmt, g)
    for t, s in enumerate(slots):
      if 0 <= s < capacity:
        b, o = divmod(int(s), block_size)
        want[i][at + (b, slice(None), o)] = packed[t]
        masks[i][at + (b, slice(None), o)] = packed_mask[t]
        loose[i][at + (b, slice(None), o)] = near[t].reshape(heads, -1, 2)
        want[2 + i][at + (b, slice(None), o)] = scale[t]
        written[at + (b, o)] = True
  for i, (r, w, m) in enumerate(zip(ref, want, masks)):
    if i < 2 and fmt == "nvfp4" and jax.default_backend() != "cpu":
      # XLA's GPU code for x * (1 / (sf g)) is not always the float32 formula to the last
      # ulp (tests/test_fp4.py): within 4 ulps of an E2M1 threshold, the neighbouring code
      assert_codes_close(r, w, m, loose[i])
    else:
      np.testing.assert_array_equal(r & m, w & m)
  # untouched entries (other slots, other layers) keep every byte
  for r, c in zip(ref, caches):
    r, c = np.moveaxis(r, -2, -3), np.moveaxis(u8(c), -2, -3)   # [.., nb, bs, H, bytes]
    np.testing.assert_array_equal(r[~written], c[~written])


# ---- swap_blocks -------------------------------------------------------------------------

def numpy_swap(src, dst, pairs, block_axis):
  """vLLM's in-order loop: dst[d] = src[s] for each pair with both entries in range (< 0
  or past the end: skipped), so the later pair wins a duplicate destination."""
  src, dst = np.moveaxis(src, block_axis, 0), np.moveaxis(dst.copy(), block_axis, 0)
  for s, d in pairs:
    if 0 <= s < src.shape[0] and 0 <= d < dst.shape[0]:
      dst[d] = src[s]
  return np.moveaxis(dst, 0, block_axis)


# Per dtype (so CI's derandomized draw covers each): an eighth of the profile's examples.
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn,
                                   jnp.float8_e5m2, jnp.int8, jnp.uint8, jnp.int32])
@settings(max_examples=max(3, settings.default.max_examples // 8))
@given(block_shape=st.lists(st.integers(1, 5), min_size=0, max_size=3),
       layers=st.sampled_from([None, 1, 3]), num_src=st.integers(1, 8),
       num_dst=st.integers(1, 8), num_pairs=st.integers(1, 20), jitted=st.booleans(),
       kinds=st.sampled_from([(DEVICE, DEVICE), (DEVICE, HOST), (HOST, DEVICE), (HOST, HOST)]),
       seed=SEEDS)
def test_swap_blocks_kernel_equals_reference_equals_numpy(dtype, block_shape, layers, num_src,
                                                          num_dst, num_pairs, jitted, kinds,
                                                          seed):
  """swap_blocks: random dtypes (every bit pattern of the 1-byte types), block shapes
  (scalars per block too), layer-stacked arrays (block_axis 1), src / dst block counts,
  memory kinds, and mappings with duplicate destinations and skipped pairs (negative;
  under jit also past either end). Eager calls (mapping padded to a bucket, dst donated)
  and jitted ones; kernel == reference == numpy; src and untouched blocks unchanged."""
  rng = np.random.default_rng(seed)
  block_axis = 0 if layers is None else 1
  lead = () if layers is None else (layers,)
  src_np = np.asarray(poison(rng, lead + (num_src,) + tuple(block_shape), dtype))
  dst_np = np.asarray(poison(rng, lead + (num_dst,) + tuple(block_shape), dtype))
  low = -2 if jitted else -1
  pairs = np.stack([rng.integers(low, num_src + (3 if jitted else 0), num_pairs),
                    rng.integers(low, num_dst + (3 if jitted else 0), num_pairs)], 1)
  pairs[rng.random(num_pairs) < 0.3, 1] = rng.integers(0, num_dst)   # more duplicates
  pairs = pairs.astype(np.int32)
  want = numpy_swap(src_np, dst_np, pairs, block_axis)
  src_kind, dst_kind = kinds
  for backend in ("reference", KERNEL):
    src = jax.device_put(jnp.asarray(src_np), src_kind)
    dst = jax.device_put(jnp.asarray(dst_np), dst_kind)   # donated: a fresh one per call
    if jitted:
      out = jax.jit(lambda s, d, m: jkv.swap_blocks(s, d, m, block_axis=block_axis,
                                                     backend=backend),
                    donate_argnums=1, out_shardings=dst_kind)(src, dst, jnp.asarray(pairs))
    else:
      out = jkv.swap_blocks(src, dst, pairs, block_axis=block_axis, backend=backend)
    assert out.dtype == dst_np.dtype and out.shape == dst_np.shape, backend
    assert out.sharding.memory_kind == dst_kind.memory_kind, backend
    np.testing.assert_array_equal(bits(out), bits(want), err_msg=backend)
    np.testing.assert_array_equal(bits(src), bits(src_np), err_msg=backend)
  untouched = np.ones(num_dst, bool)
  untouched[[d for s, d in pairs if 0 <= s < num_src and 0 <= d < num_dst]] = False
  np.testing.assert_array_equal(bits(np.moveaxis(np.asarray(out), block_axis, 0)[untouched]),
                                bits(np.moveaxis(dst_np, block_axis, 0)[untouched]))


# ---- MLA byte formats --------------------------------------------------------------------

def fp8_scaled(x32, axis_size):
  """x [..., n * axis_size] float32 -> (e4m3fn bytes, byte mask, scales float32 [..., n]):
  per axis_size values scale = max(amax * float32(1 / 448), FLT_MIN) (amax over finite
  values), q = sat(x * float32(1 / scale)) to e4m3fn RNE; each step in float32."""
  x = np.asarray(x32, np.float32)
  tiles = x.reshape(x.shape[:-1] + (x.shape[-1] // axis_size, axis_size))
  amax = np.where(np.isfinite(tiles), np.abs(tiles), np.float32(0)).max(-1)
  scale = np.maximum(amax * np.float32(1 / 448), FLT_MIN).astype(np.float32)
  with np.errstate(invalid="ignore", over="ignore"):
    y = tiles * (np.float32(1) / scale)[..., None]
  byte, mask = fp8_e4m3_bytes(y.reshape(x.shape))
  return byte, mask, scale


def assert_fp8_round_trip(got, x, scale):
  """Decoded FP8 values (got) of x with per-value scale ``scale``: finite x within half
  an e4m3 ulp, |err| <= 2**-4 |x| + 2**-10 scale (the second term: subnormals, spacing
  2**-9 scale); NaN reads NaN, +-Inf read +-448 scale (saturated)."""
  got, x = np.asarray(got, np.float64), np.asarray(x, np.float64)
  scale = np.broadcast_to(np.asarray(scale, np.float64), x.shape)
  finite = np.isfinite(x)
  err = np.abs(got - x)
  bad = finite & ~(err <= 2.0 ** -4 * np.abs(x) + 2.0 ** -10 * scale)
  assert not bad.any(), (x[bad][:5], got[bad][:5], scale[bad][:5])
  assert np.isnan(got[np.isnan(x)]).all()
  inf = np.isinf(x)
  saturated = np.float32(448) * scale[inf].astype(np.float32)   # decoded in float32
  np.testing.assert_array_equal(got[inf], np.sign(x[inf]) * saturated)


def mla_inputs(rng, tokens, heads, rank, pe, tile, decades, dtype, nonfinite):
  kv_c = spread_values(rng, (tokens,) + heads + (rank,), tile, decades, dtype, zero_groups=0.2)
  if nonfinite:
    add_nonfinite(rng, kv_c, 2)
  k_pe = spread_values(rng, (tokens,) + heads + (pe,), pe, min(decades, 4), dtype, 0.1)
  return jnp.asarray(kv_c, dtype), jnp.asarray(k_pe, dtype)


def gather_all(cache, layer):
  """Every slot of ``layer``, decoded by MLACache.gather: (kv_c [S, ...], k_pe [S, ...])."""
  slots = cache.num_blocks * cache.block_size
  table = jnp.arange(cache.num_blocks, dtype=jnp.int32)[None]
  kv_c, k_pe = jax.jit(lambda c: c.gather(layer, table, jnp.array([slots])))(cache)
  return np.asarray(kv_c)[0], np.asarray(k_pe)[0]


@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(tiles=st.integers(1, 4), pe=st.integers(1, 64), dtype=st.sampled_from(
    [jnp.float32, jnp.bfloat16, jnp.float16]), tokens=st.integers(1, 20),
       num_blocks=st.integers(1, 4), block_size=st.sampled_from([1, 2, 4, 16]),
       layers=st.sampled_from([None, 1, 2]), decades=st.integers(0, 30), nonfinite=st.booleans(),
       seed=SEEDS)
def test_fp8_ds_mla_write_equals_numpy(tiles, pe, dtype, tokens, num_blocks, block_size, layers,
                                       decades, nonfinite, seed):
  """concat_and_cache_mla(..., "fp8_ds_mla"), reference and kernel: random latent ranks (128-value tiles), RoPE dims, input dtypes, tile magnitudes over up to 60
  decades (zero tiles: FLT_MIN scale; values deep in e4m3's subnormals; optional NaN /
  Inf), layer stacks, slots with padding and past the cache. The bytes == a numpy model of
  vLLM's entry [R e4m3 | R/128 float32 tile scales | P bf16], poisoned bytes elsewhere;
  MLACache.gather decodes each written entry within the e4m3 bound, k_pe exactly."""
  rng = np.random.default_rng(seed)
  rank = 128 * tiles
  entry = rank + 4 * tiles + 2 * pe
  lead = () if layers is None else (layers,)
  cache = poison(rng, lead + (num_blocks, block_size, entry), np.uint8)
  capacity = num_blocks * block_size
  slots = adversarial_slots(rng, tokens, capacity)
  kv_c, k_pe = mla_inputs(rng, tokens, (), rank, pe, 128, decades, dtype, nonfinite)
  layer = None if layers is None else int(rng.integers(0, layers))
  x = np.asarray(kv_c, np.float32)
  values, value_mask, scale = fp8_scaled(x, 128)
  rope_bytes = bf16_bits(np.asarray(k_pe, np.float32)).astype("<u2").view(np.uint8)
  entries = np.concatenate([values, scale.astype("<f4").view(np.uint8), rope_bytes], 1)
  masks = np.concatenate([value_mask, np.full((tokens, entry - rank), 0xFF, np.uint8)], 1)
  want = np.asarray(cache).reshape(lead + (capacity, entry)).copy()
  mask = np.full(want.shape, 0xFF, np.uint8)
  at = () if layer is None else (layer,)
  for t, s in enumerate(slots):
    if 0 <= s < capacity:
      want[at + (s,)], mask[at + (s,)] = entries[t], masks[t]
  for backend in ("reference", KERNEL):
    fn = lambda c, p, kc, s, *layer: jkv.concat_and_cache_mla(
        c, p, kc, s, "fp8_ds_mla", layer=layer[0] if layer else None, backend=backend)
    out = jax.jit(fn)(kv_c, k_pe, cache, jnp.asarray(slots),
                      *(() if layer is None else (jnp.int32(layer),)))
    assert out.shape == cache.shape and out.dtype == jnp.uint8
    got = np.asarray(out).reshape(lead + (capacity, entry))
    np.testing.assert_array_equal(got & mask, want & mask, err_msg=backend)
  # round trip through the cache's own decoder
  mla = jkv.MLACache.create(num_blocks, block_size, rank, pe, num_layers=layers or 1,
                            dtype=jnp.float32, kv_cache_dtype="fp8_ds_mla")
  mla = mla.replace(kv_cache=out if layers else out[None])
  dec_c, dec_pe = gather_all(mla, layer or 0)
  live = (slots >= 0) & (slots < capacity)
  assert_fp8_round_trip(dec_c[slots[live]], x[live], np.repeat(scale[live], 128, -1))
  np.testing.assert_array_equal(dec_pe[slots[live]],
                                np.asarray(k_pe.astype(jnp.bfloat16), np.float32)[live])


def numpy_rope(pe, positions, cos, sin, is_neox):
  """float64 rotation by the cache's (cos, sin) rows at the clamped positions."""
  x = np.asarray(pe, np.float64)
  pos = np.clip(positions, 0, cos.shape[0] - 1)
  c = np.asarray(cos, np.float64)[pos][:, None]
  s = np.asarray(sin, np.float64)[pos][:, None]
  half = x.shape[-1] // 2
  if is_neox:
    a, b = x[..., :half], x[..., half:]
  else:
    a, b = x[..., 0::2], x[..., 1::2]
  ra, rb = a * c - b * s, b * c + a * s
  out, size = np.empty_like(x), np.empty_like(x)
  norm = np.sqrt(a ** 2 + b ** 2)                # |pair|, for float32 error tolerances
  if is_neox:
    out[..., :half], out[..., half:] = ra, rb
    size[..., :half], size[..., half:] = norm, norm
  else:
    out[..., 0::2], out[..., 1::2] = ra, rb
    size[..., 0::2], size[..., 1::2] = norm, norm
  return out, size


def within_bf16_ulp(got, want):
  """|got - want| <= 1 unit in the last place of bfloat16 at |want|."""
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  unit = np.spacing(np.abs(w).astype(np.float32)).astype(np.float64) * 2.0 ** 16
  return (np.abs(g - w) <= unit) | (g == w)


@settings(max_examples=max(6, settings.default.max_examples // 4))
@given(rank=st.integers(1, 48), pe=st.integers(1, 6).map(lambda n: 2 * n),
       heads=st.sampled_from([None, 1, 3]), dtype=st.sampled_from(
           [jnp.float32, jnp.bfloat16, jnp.float16]), tokens=st.integers(1, 16),
       num_blocks=st.integers(1, 4), block_size=st.sampled_from([1, 2, 4, 16]),
       layers=st.integers(1, 2), rotate=st.sampled_from([None, "neox", "gptj"]),
       decades=st.integers(0, 30), nonfinite=st.booleans(), seed=SEEDS)
def test_fp8_split_write_kernel_equals_reference_equals_numpy(rank, pe, heads, dtype, tokens,
                                                              num_blocks, block_size, layers,
                                                              rotate, decades, nonfinite, seed):
  """MLACache "fp8_split" writes (write, or write_split_rope with either RoPE style and
  positions past both ends of the cos / sin cache): random ranks, head counts, input
  dtypes, entry magnitudes over up to 60 decades (all-zero entries: FLT_MIN scale;
  subnormal e4m3 values; optional NaN / Inf), traced layers, slots with padding and past
  the cache, on poisoned arrays. Kernel == reference (content and scales bit for bit, the
  bf16 RoPE part too unrotated, within 1 ulp rotated); reference == numpy model (e4m3
  content, per-entry float32 scale, bf16 RoPE part), poisoned bytes elsewhere; gather
  decodes within the e4m3 bound."""
  rng = np.random.default_rng(seed)
  head = () if heads is None else (heads,)
  cache = jkv.MLACache.create(num_blocks, block_size, rank, pe, num_layers=layers,
                              num_heads=heads, dtype=jnp.float32, kv_cache_dtype="fp8_split")
  cache = cache.replace(kv_cache=poison(rng, cache.kv_cache.shape, jnp.float8_e4m3fn),
                        rope_cache=poison(rng, cache.rope_cache.shape, jnp.bfloat16),
                        entry_scale=poison(rng, cache.entry_scale.shape, jnp.float32))
  capacity = num_blocks * block_size
  slots = adversarial_slots(rng, tokens, capacity)
  kv_c, k_pe = mla_inputs(rng, tokens, head, rank, pe, rank, decades, dtype, nonfinite)
  layer = int(rng.integers(0, layers))
  max_pos = 24
  positions = rng.integers(-3, max_pos + 4, tokens).astype(np.int32)
  cos, sin = jkv.rope.rope_cache(max_pos, pe)

  def write(backend):
    def fn(c, kv_c, k_pe, s, layer):
      if rotate is None:
        return c.write(layer, kv_c, k_pe, s, backend=backend)
      return c.write_split_rope(layer, kv_c, k_pe, s, positions, cos, sin,
                                is_neox=rotate == "neox", backend=backend)
    return jax.jit(fn)(cache, kv_c, k_pe, jnp.asarray(slots), jnp.int32(layer))

  ref, ker = write("reference"), write(KERNEL)
  np.testing.assert_array_equal(u8(ker.kv_cache), u8(ref.kv_cache))
  np.testing.assert_array_equal(bits(ker.entry_scale), bits(ref.entry_scale))
  if rotate is None:
    np.testing.assert_array_equal(bits(ker.rope_cache), bits(ref.rope_cache))
  # numpy model
  x = np.asarray(kv_c, np.float32)
  content, content_mask, scale = fp8_scaled(x, rank)
  scale = scale[..., 0]
  pe32 = np.asarray(k_pe, np.float32)
  want_content = u8(cache.kv_cache).copy()
  want_scale = bits(cache.entry_scale).copy()
  mask = np.full(want_content.shape, 0xFF, np.uint8)
  written = np.zeros((layers, num_blocks, block_size), bool)
  for t, s in enumerate(slots):
    if 0 <= s < capacity:
      b, o = divmod(int(s), block_size)
      want_content[layer, b, o], mask[layer, b, o] = content[t], content_mask[t]
      want_scale[layer, b, o] = scale[t].view(np.uint32)
      written[layer, b, o] = True
  np.testing.assert_array_equal(u8(ref.kv_cache) & mask, want_content & mask)
  np.testing.assert_array_equal(bits(ref.entry_scale), want_scale)
  rope_got = np.asarray(ref.rope_cache)
  np.testing.assert_array_equal(bits(rope_got)[~written], bits(cache.rope_cache)[~written])
  live = (slots >= 0) & (slots < capacity)
  got_rows = rope_got[layer, slots[live] // block_size, slots[live] % block_size]
  if rotate is None:
    np.testing.assert_array_equal(bits(got_rows), bf16_bits(pe32[live]))
  else:   # float32 RoPE rounded once to bf16: half a bf16 ulp + float32 error on the pair
    exact, pair = numpy_rope(pe32.reshape(tokens, -1, pe), positions, cos, sin,
                             rotate == "neox")
    exact, pair = exact.reshape(pe32.shape)[live], pair.reshape(pe32.shape)[live]
    err = np.abs(np.asarray(got_rows, np.float64) - exact)
    assert (err <= 2.0 ** -8 * np.abs(exact) + 2.0 ** -20 * pair).all()
    # kernel == reference within 1 bf16 ulp (float32 products may fuse differently), or
    # within float32 error of the pair where the rotation cancels
    ker_rows = np.asarray(ker.rope_cache)[layer, slots[live] // block_size,
                                          slots[live] % block_size]
    diff = np.abs(np.asarray(ker_rows, np.float64) - np.asarray(got_rows, np.float64))
    assert (within_bf16_ulp(ker_rows, got_rows) | (diff <= 2.0 ** -20 * pair)).all()
  for k, c in ((ker.kv_cache, cache.kv_cache), (ker.rope_cache, cache.rope_cache),
               (ker.entry_scale, cache.entry_scale)):
    np.testing.assert_array_equal(bits(k)[~written], bits(c)[~written])
  # round trip through gather (content x entry scale)
  dec_c, _ = gather_all(ref, layer)
  assert_fp8_round_trip(dec_c[slots[live]], x[live], scale[live][..., None])
