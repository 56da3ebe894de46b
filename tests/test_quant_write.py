"""Per-token and per-block FP8 / INT8 writes: kernel vs reference (bit-exact), reference vs
independent numpy models, error bounds, multi-phase block quantization, NaN / Inf policy,
PagedKVCache quantized modes, bad inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import layout as layout_lib, segments
from jkv.cache import PagedKVCache
from conftest import KERNEL, assert_same, bits
from pallas_kernels import block_quant

SCALED = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3fnuz": jnp.float8_e4m3fnuz,
          "fp8_e5m2": jnp.float8_e5m2, "int8": jnp.int8}
QMAX = {np.dtype(jnp.float8_e4m3fn): 448.0, np.dtype(jnp.float8_e4m3fnuz): 240.0,
        np.dtype(jnp.float8_e5m2): 57344.0, np.dtype(jnp.int8): 127.0}
# Largest relative error of one rounding, as a fraction of the scale's amax.
BOUND = {np.dtype(jnp.float8_e4m3fn): 2**-4, np.dtype(jnp.float8_e4m3fnuz): 2**-4,
         np.dtype(jnp.float8_e5m2): 2**-3, np.dtype(jnp.int8): 1 / 127}


def caches_and_scales(rng, layout, num_blocks, block_size, heads, head_size, dtype, scale_shape,
                      num_layers=None):
  """Random (never zero) caches and positive scales, so untouched entries are checkable."""
  k_shape, v_shape = layout_lib.cache_shapes(layout, num_blocks, block_size, heads, head_size,
                                             dtype)
  lead = () if num_layers is None else (num_layers,)
  def cache(shape):
    if np.dtype(dtype) == np.dtype(jnp.int8):
      return jnp.asarray(rng.integers(-127, 128, lead + shape), jnp.int8)
    return jnp.asarray(rng.standard_normal(lead + shape) * 20).astype(dtype)
  scales = lambda: jnp.asarray(rng.uniform(0.002, 0.03, lead + scale_shape), jnp.float32)
  return cache(k_shape), None if v_shape is None else cache(v_shape), scales(), scales()


def np_round(y, dtype):
  """float32 -> stored value (numpy / ml_dtypes; independent of jkv.quant)."""
  y = np.asarray(y, np.float32)
  if np.dtype(dtype) == np.dtype(jnp.int8):
    return np.nan_to_num(np.clip(y, -127, 127), nan=0.0).astype(np.int8)
  m = QMAX[np.dtype(dtype)]
  return np.clip(y, -m, m).astype(dtype)


def entry(cache, layout, which, block, offset, head_size):
  """Cache entry of one token as float32 [H, D] (numpy indexing per layout)."""
  c = np.asarray(cache)
  if layout in ("vllm", "asm") and which == 0:
    e = c[block, :, :, offset, :]
    return e.reshape(e.shape[0], head_size)
  if layout == "vllm":
    return c[block, :, :, offset]
  if layout == "asm":
    x = c.shape[-1]
    return c[block, :, offset // x, :, offset % x]
  if layout == "flash":
    return c[block, offset]
  if layout == "hnd":
    return c[block, :, offset]
  raise ValueError(layout)


def assert_codes_close(got, want, min_equal=0.98):
  """Stored codes equal up to one step (a float32 division may differ by an ulp on
  XLA:CPU, moving a value across a rounding boundary), and mostly identical."""
  got, want = np.asarray(got), np.asarray(want)
  if got.dtype == np.int8:
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
  else:
    a, b = got.view(np.uint8).astype(np.int32), want.view(np.uint8).astype(np.int32)
    diff = np.where((a ^ b) & 0x80, 2 * (a != b), np.abs(a - b))
    diff = np.where(((a & 0x7F) == 0) & ((b & 0x7F) == 0), 0, diff)   # +0 / -0
  assert diff.max() <= 1, diff.max()
  assert (diff == 0).mean() >= min_equal, (diff == 0).mean()


def write(granularity, layout, backend, key, value, kc, vc, ks, vs, slots, block_major=True,
          unit=None, layer=None):
  return jkv.write_quant_kv(key, value, kc, vc, ks, vs, slots, granularity=granularity,
                            layout=layout, scales_block_major=block_major,
                            tokens_per_scale_block=unit, layer=layer, backend=backend)


def scale_shape(granularity, num_blocks, block_size, heads, block_major, unit=None):
  if granularity == "token":
    return (num_blocks, heads, block_size) if block_major else (heads, num_blocks * block_size)
  units = num_blocks * block_size // (unit or block_size)
  return (units, heads) if block_major else (heads, units)


# ---- kernel == reference ------------------------------------------------------------------

KERNEL_CASES = [
    # granularity, layout, kv_cache_dtype, in_dtype, head_size, block_size, block_major, unit
    ("token", "vllm", "fp8", jnp.bfloat16, 128, 16, False, None),
    ("token", "asm", "int8", jnp.float16, 64, 16, True, None),
    ("token", "vllm", "fp8_e4m3fnuz", jnp.float32, 80, 16, False, None),
    ("token", "flash", "fp8_e5m2", jnp.bfloat16, 64, 32, True, None),
    ("token", "packed", "int8", jnp.float32, 64, 16, True, None),
    ("block", "vllm", "int8", jnp.bfloat16, 128, 16, False, None),
    ("block", "asm", "fp8", jnp.float16, 64, 16, True, None),
    ("block", "vllm", "fp8_e4m3fnuz", jnp.bfloat16, 80, 16, True, None),
    ("block", "hnd", "fp8", jnp.float32, 64, 128, True, None),
    ("block", "packed", "int8", jnp.float16, 64, 16, False, None),
    ("block", "asm", "int8", jnp.bfloat16, 64, 16, True, 128),
    ("block", "vllm", "fp8", jnp.float32, 64, 16, False, 256),
    # scale blocks the default chunk (16; 64 from 128 tokens) does not divide
    ("block", "flash", "int8", jnp.float32, 32, 24, True, None),
    ("block", "hnd", "fp8", jnp.bfloat16, 32, 16, False, 160),
    ("block", "vllm", "fp8_e5m2", jnp.float16, 32, 12, True, None),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "-".join(map(str, c[:3] + c[4:])))
def test_kernel_matches_reference(case, rng):
  granularity, layout, name, in_dtype, head_size, block_size, block_major, unit = case
  dtype = SCALED[name]
  heads, num_tokens = 3, 45
  num_blocks = max(8, 2 * (unit or 0) // block_size)
  shape = scale_shape(granularity, num_blocks, block_size, heads, block_major, unit)
  kc, vc, ks, vs = caches_and_scales(rng, layout, num_blocks, block_size, heads, head_size, dtype,
                                     shape)
  capacity = num_blocks * block_size
  slots = rng.permutation(capacity)[:num_tokens].astype(np.int32)
  slots[:5] = rng.integers(0, capacity, 5) if granularity == "block" else slots[:5]  # duplicates
  slots[[7, 20]] = -1
  scale = np.where(rng.uniform(size=(num_tokens, 1, 1)) < 0.5, 0.1, 4.0)  # some scales grow
  key = jnp.asarray(rng.standard_normal((num_tokens, heads, head_size)) * scale, in_dtype)
  value = jnp.asarray(rng.standard_normal((num_tokens, heads, head_size)) * scale, in_dtype)
  ref = write(granularity, layout, "reference", key, value, kc, vc, ks, vs, slots, block_major, unit)
  got = write(granularity, layout, KERNEL, key, value, kc, vc, ks, vs, slots, block_major, unit)
  assert_same(got, ref)
  # Under jit, out-of-range slots are dropped (never written out of bounds).
  bad = slots.copy()
  bad[[3, 9]] = [capacity, capacity + 1000]
  fn = jax.jit(functools.partial(write, granularity, layout, KERNEL, block_major=block_major,
                                 unit=unit))
  got = fn(key, value, kc, vc, ks, vs, jnp.asarray(bad))
  ref = write(granularity, layout, "reference", key, value, kc, vc, ks, vs,
              np.where(bad >= capacity, -1, bad), block_major, unit)
  assert_same(got, ref)


def slot_pattern(pattern, num_tokens, capacity, unit, rng):
  """Slot mapping int32 [num_tokens] of sequences filling their own pages (of ``unit``
  slots, in random order) from a random offset in the first: "prefill" one after another,
  "interleaved" the first two token by token. Padded with -1."""
  pages = iter(rng.permutation(capacity // unit).tolist())   # scale-block sized pages
  sequences, used = [], 0
  while used < num_tokens:
    page, offset, seq = next(pages, None), int(rng.integers(0, unit)), []
    for _ in range(int(rng.integers(1, 3 * unit))):
      if page is None:
        break
      seq.append(page * unit + offset)
      offset += 1
      if offset == unit:
        page, offset = next(pages, None), 0
    sequences.append(seq)
    used += len(seq)
    if page is None:
      break
  if pattern in ("prefill", "padded", "reversed", "duplicates"):
    slots = [s for seq in sequences for s in seq]
  else:
    a, b = sequences[0], sequences[1] if len(sequences) > 1 else []
    slots = [s for pair in zip(a, b) for s in pair] + a[len(b):] + b[len(a):]
  if pattern == "padded":   # padding rows between the sequences
    slots = [s for seq in sequences for s in seq + [-1]]
  if pattern == "reversed":
    slots = slots[::-1]
  slots = (slots + [-1] * num_tokens)[:num_tokens]
  if pattern == "duplicates":   # two slots written again at the end (the last write wins)
    slots[-2:] = slots[num_tokens // 3:num_tokens // 3 + 2]
  return np.asarray(slots, np.int32)


PATTERNS = ["prefill", "padded", "interleaved", "reversed", "duplicates"]


def check_block_pattern(pattern, layout, name, unit, rng, block_size=16):
  """A per-block write of ``slot_pattern(pattern)`` tokens (2.5 scale blocks' worth) into a
  cache of 8 scale blocks whose scales grow: the kernel gives the reference's bits."""
  dtype, heads, head_size = SCALED[name], 3, 64
  unit_size = unit or block_size
  num_blocks = 8 * unit_size // block_size
  num_tokens = 5 * unit_size // 2
  shape = scale_shape("block", num_blocks, block_size, heads, True, unit)
  kc, vc, ks, vs = caches_and_scales(rng, layout, num_blocks, block_size, heads, head_size, dtype,
                                     shape)
  slots = slot_pattern(pattern, num_tokens, num_blocks * block_size, unit_size, rng)
  scale = np.where(rng.uniform(size=(num_tokens, 1, 1)) < 0.5, 0.1, 4.0)
  key, value = (jnp.asarray(rng.standard_normal((num_tokens, heads, head_size)) * scale,
                            jnp.bfloat16) for _ in range(2))
  ref = write("block", layout, "reference", key, value, kc, vc, ks, vs, slots, True, unit)
  got = write("block", layout, KERNEL, key, value, kc, vc, ks, vs, slots, True, unit)
  assert_same(got, ref)


@pytest.mark.parametrize("grouping", ["table", "sort"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("layout,name,unit", [("vllm", "int8", None), ("asm", "fp8", 128),
                                              ("flash", "fp8_e5m2", None),
                                              ("packed", "int8", 32)])
def test_block_kernel_on_prefill_and_interleaved_sequences(grouping, pattern, layout, name, unit,
                                                           rng, monkeypatch, request):
  """Sequences filling their pages from mid-page, one after another (with or without
  padding rows between them), two sequences interleaved token by token (a scale block's
  tokens spread over the batch), the prefill reversed, a token written twice; into a cache
  whose scales grow. Both groupings: the slot table (this cache is small) and the sort
  (forced, as for a small write into a huge cache)."""
  if grouping == "sort":   # (traces cached under the other grouping are dropped)
    monkeypatch.setattr(segments, "TABLE_SLOTS_PER_TOKEN", 0)
    jax.clear_caches()
    request.addfinalizer(jax.clear_caches)
  check_block_pattern(pattern, layout, name, unit, rng)


def fill_interpreted_outputs(monkeypatch, request, value: float):
  """Pallas' interpreter (Triton lowering) starts a kernel's float outputs that alias no
  input as NaN; on the GPU they hold whatever the memory held. Start them as ``value``
  instead, so a kernel that reads an output entry it never wrote is seen doing so (the
  block-quant grown flags: NaN reads as "not grown", a finite value >= 0 as "grown"). No
  effect on compiled kernels."""
  from jax._src.pallas import hlo_interpreter
  original = hlo_interpreter._initialize_output_vals

  def initialize(block_mappings_output, input_args, input_output_aliases):
    aliased = {out for _, out in input_output_aliases}
    return [x if i in aliased or not jnp.issubdtype(x.dtype, jnp.floating)
            else jnp.full_like(x, value)
            for i, x in enumerate(original(block_mappings_output, input_args,
                                           input_output_aliases))]

  monkeypatch.setattr(hlo_interpreter, "_initialize_output_vals", initialize)
  jax.clear_caches()   # (and again after: no trace keeps the patched interpreter)
  request.addfinalizer(jax.clear_caches)


@pytest.mark.parametrize("split_kv", [None, True])
@pytest.mark.parametrize("layout,name,unit", [("vllm", "fp8", None), ("asm", "int8", 128),
                                              ("flash", "fp8", None)])
def test_block_kernel_leaves_unwritten_blocks_alone(layout, name, unit, split_kv, rng,
                                                    monkeypatch, request):
  """A write of at least as many tokens as the cache has scale blocks, into 3 of its 8
  (the slot table's grouping then holds every block, the 5 others as empty segments):
  blocks never written keep scale 0 (a segment not skipped would set the floor's scale)
  and their entries, the written ones grow their positive scales; as the reference.
  Interpreted, the kernels' unwritten outputs start as 0.5 rather than NaN: the empty
  segments' grown flags, never written, then read as an old scale that grew (the GPU's
  garbage can), so the re-quantization pass must skip them by their length."""
  fill_interpreted_outputs(monkeypatch, request, 0.5)
  if split_kv:
    monkeypatch.setattr(block_quant, "block_quant",
                        functools.partial(block_quant.block_quant, split_kv=True))
  dtype, heads, head_size, block_size, units = SCALED[name], 3, 64, 16, 8
  unit_size = unit or block_size
  num_blocks = units * unit_size // block_size
  kc, vc, _, _ = caches_and_scales(rng, layout, num_blocks, block_size, heads, head_size,
                                   dtype, (units, heads))
  written = rng.permutation(units)[:3]
  live = np.zeros((units, 1), bool)
  live[written] = True
  ks, vs = (jnp.asarray(np.where(live, rng.uniform(0.002, 0.03, (units, heads)), 0.0),
                        jnp.float32) for _ in range(2))
  # Each written block gets a run of its slots from a random offset (older tokens stay).
  slots = np.concatenate([b * unit_size + np.arange(rng.integers(unit_size // 2, unit_size))
                          for b in written]).astype(np.int32)
  slots = np.concatenate([slots, [-1, -1]]).astype(np.int32)
  assert slots.size >= units
  num_tokens = slots.size
  key, value = (jnp.asarray(rng.standard_normal((num_tokens, heads, head_size)) * 4.0,
                            jnp.bfloat16) for _ in range(2))
  ref = write("block", layout, "reference", key, value, kc, vc, ks, vs, slots, True, unit)
  got = write("block", layout, KERNEL, key, value, kc, vc, ks, vs, slots, True, unit)
  assert_same(got, ref)
  unwritten = np.flatnonzero(~live[:, 0])
  for scales in got[2:]:
    np.testing.assert_array_equal(np.asarray(scales)[unwritten], 0.0)


@pytest.mark.parametrize("pattern", ["prefill", "padded", "interleaved"])
@pytest.mark.parametrize("layout,name,block_size,unit", [("vllm", "int8", 32, None),
                                                         ("asm", "fp8", 128, 128)])
def test_block_kernel_chunks_inside_larger_blocks(pattern, layout, name, block_size, unit,
                                                  rng):
  """Kernel chunks (16 tokens; 64 for 128-token scale blocks) that start inside a larger
  block: the slot table's runs into the value plane from offsets 16 / 64, filled (a
  prefill) or with holes."""
  check_block_pattern(pattern, layout, name, unit, rng, block_size=block_size)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("layout,name", [("vllm", "fp8"), ("asm", "int8")])
def test_block_requant_groups(group, layout, name, rng, monkeypatch):
  """1, 4 or 8 segments per re-quantization program give the reference's bits (13
  segments: the last program's group is partly past them; grouped programs take every
  head, 3 of 4 lanes here), into a cache whose scales grow in some blocks and not in
  others."""
  monkeypatch.setattr(block_quant, "block_quant", functools.partial(
      block_quant.block_quant, requant_segments_per_program=group))
  jax.clear_caches()
  check_growing_blocks(layout, name, rng)
  jax.clear_caches()


@pytest.mark.parametrize("in_write", [True, False])
@pytest.mark.parametrize("layout,name", [("flash", "int8"), ("hnd", "fp8"), ("packed", "int8"),
                                         ("flash", "fp8_e4m3fnuz"), ("vllm", "int8")])
def test_block_requant_in_write(in_write, layout, name, rng, monkeypatch, request):
  """A grown block's older tokens re-quantized in the write kernel itself (the default of
  decode-sized writes into flash / HND / packed planes) or by the pass after it (prefills,
  token-fastest planes), either forced: the reference's bits, blocks that grow and blocks
  that do not."""
  monkeypatch.setattr(block_quant, "block_quant", functools.partial(
      block_quant.block_quant, requant_in_write=in_write))
  jax.clear_caches()
  request.addfinalizer(jax.clear_caches)
  check_growing_blocks(layout, name, rng)


def check_growing_blocks(layout, name, rng):
  """13 of 16 blocks, each given 1-16 tokens from a random offset (a decode-like tail or a
  page) of magnitude 0.01 or 4: kernel == reference, some scales grew and some did not."""
  dtype, heads, head_size, block_size = SCALED[name], 3, 64, 16
  num_blocks = 16
  shape = scale_shape("block", num_blocks, block_size, heads, True)
  kc, vc, ks, vs = caches_and_scales(rng, layout, num_blocks, block_size, heads, head_size, dtype,
                                     shape)
  # 13 blocks, each given 1-16 tokens from a random offset (a decode-like tail or a page).
  blocks = rng.permutation(num_blocks)[:13]
  slots = []
  for b in blocks:
    first = int(rng.integers(0, block_size))
    slots += [int(b) * block_size + o for o in range(first, block_size)]
  slots = np.asarray(slots + [-1, -1], np.int32)
  scale = np.where(rng.uniform(size=(slots.size, 1, 1)) < 0.5, 0.01, 4.0)
  key, value = (jnp.asarray(rng.standard_normal((slots.size, heads, head_size)) * scale,
                            jnp.bfloat16) for _ in range(2))
  ref = write("block", layout, "reference", key, value, kc, vc, ks, vs, slots, True)
  got = write("block", layout, KERNEL, key, value, kc, vc, ks, vs, slots, True)
  assert_same(got, ref)
  grew = np.asarray(ref[2]) != np.asarray(ks)
  assert grew.any() and not grew.all()   # both kinds of block are exercised


@pytest.mark.parametrize("pattern", ["padded", "duplicates"])
@pytest.mark.parametrize("layout,name,unit,split_kv", [("vllm", "fp8", None, True),
                                                       ("packed", "fp8", None, True),
                                                       ("asm", "int8", 128, False)])
def test_block_kernel_other_kv_split(pattern, layout, name, unit, split_kv, rng, monkeypatch,
                                     request):
  """The ``split_kv`` launch choice the default does not take: K and V written by programs
  of their own (grid axis 2) for scale blocks of one chunk (separate caches and a packed
  one), both by one program for scale blocks of 128 (asm_pa); the reference's bits."""
  monkeypatch.setattr(block_quant, "block_quant", functools.partial(
      block_quant.block_quant, split_kv=split_kv))
  jax.clear_caches()   # (and again after, pass or fail: no trace keeps the patched call)
  request.addfinalizer(jax.clear_caches)
  check_block_pattern(pattern, layout, name, unit, rng)


@pytest.mark.parametrize("granularity", ["token", "block"])
def test_traced_layer(granularity, rng):
  """Stacked layers: a traced layer index writes only its layer; out of range writes nothing."""
  dtype, heads, head_size, num_blocks, bs = jnp.float8_e4m3fn, 2, 64, 6, 16
  shape = scale_shape(granularity, num_blocks, bs, heads, True)
  kc, vc, ks, vs = caches_and_scales(rng, "vllm", num_blocks, bs, heads, head_size, dtype, shape,
                                     num_layers=3)
  slots = jnp.asarray(rng.permutation(num_blocks * bs)[:20], jnp.int32)
  key = jnp.asarray(rng.standard_normal((20, heads, head_size)), jnp.bfloat16)
  fn = jax.jit(lambda layer, *a: write(granularity, "vllm", KERNEL, key, key, *a, slots,
                                       layer=layer))
  got = fn(jnp.int32(1), kc, vc, ks, vs)
  ref = write(granularity, "vllm", "reference", key, key, kc, vc, ks, vs, slots, layer=1)
  assert_same(got, ref)
  for i in (0, 2):
    np.testing.assert_array_equal(bits(got[0][i]), bits(kc[i]))
    np.testing.assert_array_equal(bits(got[2][i]), bits(ks[i]))
  assert_same(fn(jnp.int32(3), kc, vc, ks, vs), (kc, vc, ks, vs))


@pytest.mark.parametrize("num_tokens", [1, 3, 20])
@pytest.mark.parametrize("block_major", [True, False])
@pytest.mark.parametrize("granularity", ["token", "block"])
@pytest.mark.parametrize("backend", ["reference", KERNEL])
def test_layer_equals_unstacked(backend, granularity, block_major, num_tokens, rng):
  """A write into layer 1 of stacked caches and scales == the same write into layer 1's own
  arrays, both scale orders (head-major scales with a layer index once came out
  transposed, or failed to broadcast, in the reference); 3 tokens over 3 heads would hide
  a transpose from the shapes. Blocks partly written before, so some scales grow."""
  dtype, heads, head_size, num_blocks, bs = jnp.int8, 3, 32, 6, 16
  shape = scale_shape(granularity, num_blocks, bs, heads, block_major)
  kc, vc, ks, vs = caches_and_scales(rng, "flash", num_blocks, bs, heads, head_size, dtype, shape,
                                     num_layers=2)
  slots = jnp.asarray(rng.permutation(num_blocks * bs)[:num_tokens], jnp.int32)
  key = jnp.asarray(rng.standard_normal((num_tokens, heads, head_size))
                    * rng.choice([0.1, 4.0], (num_tokens, heads, 1)), jnp.float32)
  value = key[::-1]
  got = write(granularity, "flash", backend, key, value, kc, vc, ks, vs, slots, block_major,
              layer=1)
  want = write(granularity, "flash", "reference", key, value, kc[1], vc[1], ks[1], vs[1], slots,
               block_major)
  for stacked, alone, before in zip(got, want, (kc, vc, ks, vs)):
    np.testing.assert_array_equal(bits(stacked[1]), bits(alone))
    np.testing.assert_array_equal(bits(stacked[0]), bits(before[0]))


# ---- reference == numpy models --------------------------------------------------------------

def numpy_token_quant(key, value, kc, vc, ks, vs, slots, layout, block_major):
  """Independent per-token model (AITER csrc/kernels/cache_kernels.cu, per (t, h))."""
  kc, vc, ks, vs = (np.array(a) for a in (kc, vc, ks, vs))
  dtype, qmax = kc.dtype, QMAX[np.dtype(kc.dtype)]
  bs = layout_lib.blocks_of(layout, kc.shape)[1]
  out = {}
  for t, s in enumerate(slots):
    if s < 0:
      continue
    b, o = divmod(int(s), bs)
    for which, (src, scales) in enumerate(((key, ks), (value, vs))):
      x = np.asarray(src[t], np.float32)
      scale = np.abs(x).max(-1) / np.float32(qmax)                       # [H]
      inv = np.float32(1) / np.maximum(scale, np.float32(1e-12))
      q = np_round(x * inv[:, None], dtype)
      out[(which, b, o)] = q
      if block_major:
        scales[b, :, o] = scale
      else:
        scales[:, s] = scale
  return out, ks, vs


@pytest.mark.parametrize("layout,name,block_major", [("vllm", "fp8", False), ("asm", "int8", True),
                                                     ("flash", "fp8_e4m3fnuz", True)])
def test_token_reference_matches_numpy(layout, name, block_major, rng):
  dtype = SCALED[name]
  heads, head_size, num_blocks, bs = 4, 128, 6, 16
  shape = scale_shape("token", num_blocks, bs, heads, block_major)
  kc, vc, ks, vs = caches_and_scales(rng, layout, num_blocks, bs, heads, head_size, dtype, shape)
  slots = rng.permutation(num_blocks * bs)[:40].astype(np.int32)
  slots[5] = -1
  key = np.asarray(rng.standard_normal((40, heads, head_size)) * 3, np.float32)
  value = np.asarray(rng.standard_normal((40, heads, head_size)), np.float32)
  got = write("token", layout, "reference", key, value, kc, vc, ks, vs, slots, block_major)
  entries, ks_want, vs_want = numpy_token_quant(key, value, kc, vc, ks, vs, slots, layout,
                                                block_major)
  np.testing.assert_allclose(np.asarray(got[2]), ks_want, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(got[3]), vs_want, rtol=1e-6)
  got_q = [entry(got[w], layout, w, b, o, head_size) for (w, b, o) in entries]
  assert_codes_close(np.stack(got_q), np.stack(list(entries.values())))
  # Untouched slots keep their old contents.
  written = {(b, o) for (_, b, o) in entries}
  for b in range(num_blocks):
    for o in range(bs):
      if (b, o) not in written:
        for w, cache in ((0, kc), (1, vc)):
          np.testing.assert_array_equal(bits(entry(got[w], layout, w, b, o, head_size)),
                                        bits(entry(cache, layout, w, b, o, head_size)))


def numpy_block_quant(key, value, kc, vc, ks, vs, slots, layout, block_major, unit):
  """Independent per-block model: the DESIGN.md rules, one scale block at a time."""
  kc, vc, ks, vs = (np.array(a) for a in (kc, vc, ks, vs))
  dtype, qmax = kc.dtype, np.float32(QMAX[np.dtype(kc.dtype)])
  bs = layout_lib.blocks_of(layout, kc.shape)[1]
  head_size = key.shape[2]
  last = {}
  for t, s in enumerate(slots):   # last token of a duplicated slot wins
    if s >= 0:
      last[int(s)] = t
  by_unit = {}
  for s, t in sorted(last.items()):
    by_unit.setdefault(s // unit, []).append((s, t))
  for u, members in by_unit.items():
    for which, (src, cache, scales) in enumerate(((key, kc, ks), (value, vc, vs))):
      x = np.stack([np.asarray(src[t], np.float32) for _, t in members])   # [n, H, D]
      amax = np.maximum(np.abs(x).max(axis=(0, 2)), np.float32(1e-6))
      s_new = amax / qmax
      s_old = scales[u].copy() if block_major else scales[:, u].copy()
      fresh = members[0][0] % unit == 0
      s = s_new if fresh else np.where(s_new > s_old, s_new, s_old)
      inv = np.float32(1) / s
      if not fresh:
        grown = s_new > s_old
        new_slots = {m for m, _ in members}
        for slot in range(u * unit, (u + 1) * unit):
          if slot in new_slots:
            continue
          b, o = divmod(slot, bs)
          old = entry(cache, layout, which, b, o, head_size).astype(np.float32)
          requant = np_round(old * s_old[:, None] * inv[:, None], dtype)
          put(cache, layout, which, b, o, np.where(grown[:, None], requant, old.astype(dtype)))
      for (slot, _), row in zip(members, x):
        b, o = divmod(slot, bs)
        put(cache, layout, which, b, o, np_round(row * inv[:, None], dtype))
      if block_major:
        scales[u] = s
      else:
        scales[:, u] = s
  return kc, vc, ks, vs


def put(cache, layout, which, block, offset, q):
  if layout in ("vllm", "asm") and which == 0:
    x = cache.shape[-1]
    cache[block, :, :, offset, :] = q.reshape(q.shape[0], -1, x)
  elif layout == "vllm":
    cache[block, :, :, offset] = q
  elif layout == "asm":
    x = cache.shape[-1]
    cache[block, :, offset // x, :, offset % x] = q
  elif layout == "flash":
    cache[block, offset] = q
  else:
    cache[block, :, offset] = q


@pytest.mark.parametrize("layout,name,block_major,unit", [
    ("vllm", "int8", False, 16), ("asm", "fp8", True, 16), ("hnd", "fp8_e4m3fnuz", True, 32),
    ("asm", "int8", True, 128)])
def test_block_reference_matches_numpy(layout, name, block_major, unit, rng):
  dtype = SCALED[name]
  heads, head_size, bs = 2, 64, 16
  num_blocks = 2 * unit // bs * 2
  shape = scale_shape("block", num_blocks, bs, heads, block_major, unit)
  kc, vc, ks, vs = caches_and_scales(rng, layout, num_blocks, bs, heads, head_size, dtype, shape)
  slots = rng.permutation(num_blocks * bs)[:50].astype(np.int32)
  slots[:4] = slots[10:14]   # duplicates: the later token wins
  slots[30] = -1
  key = np.asarray(rng.standard_normal((50, heads, head_size)) * 3, np.float32)
  value = np.asarray(rng.standard_normal((50, heads, head_size)) * 0.5, np.float32)
  got = write("block", layout, "reference", key, value, kc, vc, ks, vs, slots, block_major, unit)
  want = numpy_block_quant(key, value, kc, vc, ks, vs, slots, layout, block_major, unit)
  np.testing.assert_allclose(np.asarray(got[2]), want[2], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(got[3]), want[3], rtol=1e-6)
  assert_codes_close(got[0], want[0], min_equal=0.99)
  assert_codes_close(got[1], want[1], min_equal=0.99)


# ---- error bounds and multi-phase block quantization ------------------------------------------

def dequantized(cache, scales, granularity, layout, heads, head_size, block_size, slots, unit):
  """float32 [T, 2, H, D] dequantized entries of the given slots (numpy)."""
  out = []
  for s in slots:
    b, o = divmod(int(s), block_size)
    rows = []
    for which in range(2):
      q = entry(cache[which], layout, which, b, o, head_size).astype(np.float32)
      sc = np.asarray(scales[which])
      scale = sc[b, :, o] if granularity == "token" else sc[int(s) // unit]
      rows.append(q * scale[:, None])
    out.append(rows)
  return np.asarray(out)


@pytest.mark.parametrize("granularity", ["token", "block"])
@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3fnuz", "fp8_e5m2", "int8"])
def test_round_trip_error_bounds(granularity, name, rng):
  """|dequantized - x| <= BOUND * amax of the scale's group (one rounding; INT8 truncates,
  so the amax element itself may lose a whole step: up to float32 rounding of x * inv)."""
  dtype = SCALED[name]
  heads, head_size, bs, num_blocks = 2, 64, 16, 4
  shape = scale_shape(granularity, num_blocks, bs, heads, True)
  kc, vc, ks, vs = caches_and_scales(rng, "asm" if name != "fp8_e5m2" else "flash", num_blocks,
                                     bs, heads, head_size, dtype, shape)
  layout = "asm" if name != "fp8_e5m2" else "flash"
  slots = np.arange(num_blocks * bs, dtype=np.int32)   # every block fresh, full
  x = rng.standard_normal((2, slots.size, heads, head_size)) * np.exp(
      rng.uniform(-4, 4, (2, slots.size, heads, 1)))
  x = x.astype(np.float32)
  out = write(granularity, layout, KERNEL, x[0], x[1], kc, vc, ks, vs, slots)
  deq = dequantized(out[:2], out[2:], granularity, layout, heads, head_size, bs, slots, bs)
  x = np.moveaxis(x, 0, 1)                                            # [T, 2, H, D]
  if granularity == "token":
    amax = np.abs(x).max(-1, keepdims=True)
  else:
    per_block = np.abs(x).reshape(num_blocks, bs, 2, heads, head_size).max(axis=(1, 4))
    amax = np.repeat(per_block, bs, axis=0)[..., None]
  assert np.all(np.abs(deq - x) <= BOUND[np.dtype(dtype)] * amax * (1 + 1e-5))


@pytest.mark.slow   # AITER's multi-phase scenario, 10-35 s a case: -m slow runs it, not CI
@pytest.mark.parametrize("name,block_size,unit", [("int8", 16, 16), ("fp8", 16, 16),
                                                  ("fp8", 128, 128), ("int8", 16, 128)])
def test_multi_phase_block_quant(name, block_size, unit, rng):
  """AITER's scenario: prefill, two chunks that grow the scale (re-quantizing older
  tokens), decode tokens. Kernel == reference after every phase; dequantized values stay
  within one rounding step (of the final scale) per phase since they were written."""
  dtype = SCALED[name]
  heads, head_size, batch, max_tokens = 2, 64, 2, 2 * max(unit, 128)
  num_blocks = batch * max_tokens // block_size
  shape = scale_shape("block", num_blocks, block_size, heads, True, unit)
  kc = jnp.zeros(layout_lib.cache_shapes("asm", num_blocks, block_size, heads, head_size, dtype)[0],
                 dtype)
  vc = jnp.zeros(layout_lib.cache_shapes("asm", num_blocks, block_size, heads, head_size, dtype)[1],
                 dtype)
  ks = vs = jnp.ones(shape, jnp.float32)
  state_ref = state_kernel = (kc, vc, ks, vs)
  written, rounded = {}, {}
  phases = [(0, 37, 1.0), (37, 10, 2.0), (47, 10, 4.0), (57, 1, 1.0), (58, 1, 8.0)]
  for phase, (start, count, magnitude) in enumerate(phases):
    slots = np.concatenate([b * max_tokens + np.arange(start, start + count)
                            for b in range(batch)]).astype(np.int32)
    kv = (rng.standard_normal((2, slots.size, heads, head_size)) * magnitude).astype(np.float32)
    state_ref = write("block", "asm", "reference", kv[0], kv[1], *state_ref, slots, unit=unit)
    state_kernel = write("block", "asm", KERNEL, kv[0], kv[1], *state_kernel, slots, unit=unit)
    assert_same(state_kernel, state_ref)
    for i, s in enumerate(slots):
      written[int(s)] = kv[:, i]
      rounded[int(s)] = len(phases) - phase
  slots = np.array(sorted(written))
  deq = dequantized(state_ref[:2], state_ref[2:], "block", "asm", heads, head_size, block_size,
                    slots, unit)
  want = np.stack([written[int(s)] for s in slots])
  final_scale = np.stack([np.asarray(state_ref[2 + w])[slots // unit] for w in range(2)], axis=1)
  # Each write or re-quantization rounds once, by at most one BOUND step of the scale at
  # the time (<= the final scale); a token is rounded at most once per phase from its own.
  rounds = np.stack([np.asarray(rounded[int(s)]) for s in slots])[:, None, None, None]
  bound = rounds * BOUND[np.dtype(dtype)] * QMAX[np.dtype(dtype)] * final_scale[..., None]
  assert np.all(np.abs(deq - want) <= bound * (1 + 1e-5))
  # The scale of a block only grows after its first write.
  assert np.all(np.asarray(state_ref[2]) >= 1e-6 / QMAX[np.dtype(dtype)])


# ---- NaN / Inf policy ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_nan_inf_per_token_poisons_only_its_row(name, rng):
  dtype = SCALED[name]
  heads, head_size, bs, num_blocks = 2, 64, 16, 2
  shape = scale_shape("token", num_blocks, bs, heads, True)
  kc, vc, ks, vs = caches_and_scales(rng, "vllm", num_blocks, bs, heads, head_size, dtype, shape)
  x = rng.standard_normal((4, heads, head_size)).astype(np.float32)
  x[1, 0, 3] = np.nan
  x[2, 1, 5] = np.inf
  slots = np.array([0, 1, 2, 3], np.int32)
  clean = write("token", "vllm", KERNEL, np.where(np.isfinite(x), x, 0), x, kc, vc, ks, vs, slots)
  out = write("token", "vllm", KERNEL, x, x, kc, vc, ks, vs, slots)
  scales = np.asarray(out[2])
  assert np.isnan(scales[0, 0, 1]) and np.isnan(scales[0, 1, 2])
  # Other (token, head) rows are exactly what a clean write gives.
  finite = np.isfinite(scales)
  np.testing.assert_array_equal(scales[finite], np.asarray(clean[2])[finite])
  deq = dequantized(out[:2], out[2:], "token", "vllm", heads, head_size, bs, slots, bs)
  assert np.isnan(deq[1, 0, 0]).all() and np.isnan(deq[2, 0, 1]).all()
  assert np.isfinite(deq[0]).all() and np.isfinite(deq[3]).all()
  assert np.isfinite(deq[1, 0, 1]).all() and np.isfinite(deq[2, 0, 0]).all()


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_nan_inf_per_block_never_touch_the_shared_scale(name, rng):
  dtype = SCALED[name]
  heads, head_size, bs, num_blocks = 2, 64, 16, 2
  shape = scale_shape("block", num_blocks, bs, heads, True)
  kc, vc, ks, vs = caches_and_scales(rng, "asm", num_blocks, bs, heads, head_size, dtype, shape)
  x = rng.standard_normal((bs, heads, head_size)).astype(np.float32)
  dirty = x.copy()
  dirty[3, 0, 7] = np.nan
  dirty[5, 1, 9] = np.inf
  dirty[6, 1, 10] = -np.inf
  slots = np.arange(bs, dtype=np.int32)
  clean = write("block", "asm", KERNEL, x, x, kc, vc, ks, vs, slots)
  out = write("block", "asm", KERNEL, dirty, dirty, kc, vc, ks, vs, slots)
  np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(clean[2]))   # shared scale
  deq = dequantized(out[:2], out[2:], "block", "asm", heads, head_size, bs, slots, bs)
  want = dequantized(clean[:2], clean[2:], "block", "asm", heads, head_size, bs, slots, bs)
  touched = np.zeros(deq.shape, bool)
  touched[3, :, 0, 7] = touched[5, :, 1, 9] = touched[6, :, 1, 10] = True
  np.testing.assert_array_equal(deq[~touched], want[~touched])
  qmax_value = QMAX[np.dtype(dtype)] * np.asarray(out[2])[0, 1]
  if name == "int8":   # no NaN in INT8: stored 0
    assert (deq[3, :, 0, 7] == 0).all()
  else:
    assert np.isnan(deq[3, :, 0, 7]).all()
  np.testing.assert_allclose(deq[5, :, 1, 9], qmax_value, rtol=1e-6)     # +Inf saturates
  np.testing.assert_allclose(deq[6, :, 1, 10], -qmax_value, rtol=1e-6)


@pytest.mark.parametrize("unit", [16, 32])
@pytest.mark.parametrize("layout", ["vllm", "asm", "flash"])
@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_per_block_non_finite_amax_matches_reference(layout, name, unit, rng):
  """The kernels' block amax skips NaN and Inf as the reference's does. Scale block 0: head 0
  holds a NaN only, head 1 an Inf only; block 1: head 0 nothing finite at all (amax 0),
  head 1 a NaN and an Inf; block 2 is clean. Scale blocks of one 16-token chunk (the write
  kernel) and of two (the walk kernel). (Compiled, the kernels' max skips NaN by itself and
  maps Inf to NaN first: lowering.abs_or_nan.)"""
  dtype = SCALED[name]
  heads, head_size, bs = 2, 64, 16
  num_blocks = 4 * unit // bs
  shape = scale_shape("block", num_blocks, bs, heads, True, unit)
  kc, vc, ks, vs = caches_and_scales(rng, layout, num_blocks, bs, heads, head_size, dtype,
                                     shape)
  x = rng.standard_normal((3 * unit, heads, head_size)).astype(np.float32)
  x[2, 0, 5] = np.nan
  x[unit - 7, 1, 7] = -np.inf
  x[unit:2 * unit, 0] = np.where(rng.random((unit, head_size)) < 0.5, np.nan, np.inf)
  x[unit + 3, 1, 0], x[2 * unit - 4, 1, 1] = np.inf, np.nan
  slots = np.arange(3 * unit, dtype=np.int32)
  value = -x[::-1].copy()
  got = write("block", layout, KERNEL, x, value, kc, vc, ks, vs, slots, unit=unit)
  want = write("block", layout, "reference", x, value, kc, vc, ks, vs, slots, unit=unit)
  assert_same(got, want)
  assert np.isfinite(np.asarray(got[2])).all() and np.isfinite(np.asarray(got[3])).all()


# ---- AITER names, PagedKVCache modes, donation, errors ---------------------------------------

def test_aiter_names_and_argument_order(rng):
  heads, head_size, bs, nb = 2, 64, 16, 16
  kc, vc, ks, vs = caches_and_scales(rng, "asm", nb, bs, heads, head_size, jnp.int8, (nb, heads, bs))
  key = jnp.asarray(rng.standard_normal((2, 8, heads, head_size)), jnp.bfloat16)
  slots = jnp.arange(16, dtype=jnp.int32) + 32
  out = jkv.reshape_and_cache_with_pertoken_quant(key[0], key[1], kc, vc, ks, vs, slots[:8],
                                                  asm_layout=True, backend="reference")
  assert_same(out, write("token", "asm", "reference", key[0], key[1], kc, vc, ks, vs, slots[:8]))
  kc, vc, ks, vs = caches_and_scales(rng, "vllm", nb, bs, heads, head_size, jnp.int8, (heads, nb))
  out = jkv.reshape_and_cache_with_block_quant(key, key, kc, vc, ks, vs, slots,
                                               backend="reference")   # 4-D [batch, seq, H, D]
  flat = key.reshape(16, heads, head_size)
  assert_same(out, write("block", "vllm", "reference", flat, flat, kc, vc, ks, vs, slots,
                         block_major=False))
  kc, vc, ks, vs = caches_and_scales(rng, "asm", nb, bs, heads, head_size, jnp.int8,
                                     (nb * bs // 128, heads))
  out = jkv.reshape_and_cache_with_block_quant_for_asm_pa(key, key, kc, vc, ks, vs, slots,
                                                          ori_block_size=128, backend="reference")
  assert_same(out, write("block", "asm", "reference", flat, flat, kc, vc, ks, vs, slots, unit=128))


MODES = [("token", "fp8", "vllm", None), ("token", "int8", "flash", None),
         ("block", "fp8", "asm", None), ("block", "int8", "hnd", 32),
         ("block", "fp8_e4m3fnuz", "packed", None), ("mxfp4", "auto", "hnd", None),
         ("nvfp4", "auto", "hnd", None)]


@pytest.mark.parametrize("mode,kv_cache_dtype,layout,unit", MODES)
def test_paged_cache_quant_modes(mode, kv_cache_dtype, layout, unit, rng):
  """create -> two jitted, donated writes (kernel; FP4: the reference, no kernel) -> gather
  == the reference path, and close to what was written."""
  heads, head_size, bs, nb, layers = 2, 64, 16, 8, 2
  cache = PagedKVCache.create(nb, bs, heads, head_size, num_layers=layers, layout=layout,
                              kv_cache_dtype=kv_cache_dtype, dtype=jnp.float32, quant=mode,
                              scale_block_tokens=unit, k_global_scale=0.01, v_global_scale=0.02)
  assert cache.head_size == head_size and cache.num_heads == heads and cache.block_size == bs
  step = jax.jit(lambda c, layer, k, v, s, backend: c.write(layer, k, v, s, backend=backend),
                 donate_argnums=0, static_argnames="backend")
  table = np.array([[0, 1, 2], [5, 4, 7]], np.int32)
  lens = np.array([40, 33], np.int32)
  slots = np.concatenate([np.concatenate([table[b, p // bs:p // bs + 1] * bs + p % bs
                                          for p in range(lens[b])]) for b in range(2)])
  kv = (rng.standard_normal((2, slots.size, heads, head_size)) * 2).astype(np.float32)
  caches = {}
  for backend in ("reference", KERNEL):
    if backend != "reference" and mode in ("mxfp4", "nvfp4"):   # FP4: no kernel
      caches[backend] = caches["reference"]
      continue
    c = jax.tree.map(jnp.copy, cache)
    first = slots.size // 2
    c = step(c, jnp.int32(1), kv[0][:first], kv[1][:first], slots[:first], backend)
    c = step(c, jnp.int32(1), kv[0][first:], kv[1][first:], slots[first:], backend)
    caches[backend] = c
  assert_same(jax.tree.leaves(caches[KERNEL]), jax.tree.leaves(caches["reference"]))
  k, v = caches[KERNEL].gather(1, table, lens)
  assert k.shape == (2, 3 * bs, heads, head_size) and k.dtype == jnp.float32
  want = np.zeros((2, 2, 3 * bs, heads, head_size), np.float32)
  i = 0
  for b in range(2):
    want[:, b, :lens[b]] = kv[:, i:i + lens[b]]
    i += lens[b]
  # Two roundings at most (a write, one re-quantization), each within BOUND of its scale's
  # amax (<= the global max); FP4: E2M1 keeps 1 mantissa bit, saturation costs up to 1/4.
  if mode in ("mxfp4", "nvfp4"):
    tolerance = 0.5
  else:
    tolerance = 2 * BOUND[np.dtype(caches[KERNEL].key_cache.dtype)]
  for got, w in zip((k, v), want):
    assert np.all(np.abs(np.asarray(got) - w) <= tolerance * np.abs(w).max() + 1e-6)
    for b in range(2):
      assert (np.asarray(got)[b, lens[b]:] == 0).all()
  # Layer 0 untouched.
  for a, b in zip(jax.tree.leaves(caches[KERNEL]), jax.tree.leaves(cache)):
    if a.ndim > 1:
      np.testing.assert_array_equal(bits(a[0]), bits(b[0]))


@pytest.mark.parametrize("granularity", ["token", "block"])
def test_donated_quant_write_does_not_copy(granularity, rng):
  backend = "pallas" if jax.default_backend() == "gpu" else "reference"
  heads, head_size, bs, nb = 4, 128, 16, 512
  shape = scale_shape(granularity, nb, bs, heads, True)
  kc, vc, ks, vs = caches_and_scales(rng, "vllm", nb, bs, heads, head_size, jnp.int8, shape)
  key = jnp.asarray(rng.standard_normal((8, heads, head_size)), jnp.float32)
  slots = jnp.arange(8, dtype=jnp.int32) * 16 + 3
  fn = jax.jit(lambda kc, vc, ks, vs: write(granularity, "vllm", backend, key, key, kc, vc, ks, vs,
                                            slots), donate_argnums=(0, 1, 2, 3))
  compiled = fn.lower(kc, vc, ks, vs).compile()
  memory = compiled.memory_analysis()
  if memory is not None:
    assert memory.temp_size_in_bytes < kc.nbytes // 4, memory
  hlo = compiled.as_text()
  assert "input_output_alias" in hlo or "may-alias" in hlo or "must-alias" in hlo
  if jax.default_backend() == "gpu":
    pointers = [a.unsafe_buffer_pointer() for a in (kc, vc, ks, vs)]
    out = fn(kc, vc, ks, vs)
    assert [a.unsafe_buffer_pointer() for a in out] == pointers


def test_bad_inputs(rng):
  heads, head_size, bs, nb = 2, 64, 16, 4
  kc, vc, ks, vs = caches_and_scales(rng, "vllm", nb, bs, heads, head_size, jnp.int8,
                                     (heads, nb * bs))
  key = jnp.ones((3, heads, head_size), jnp.float32)
  slots = jnp.array([0, 1, 2], jnp.int32)
  token = jkv.reshape_and_cache_with_pertoken_quant
  with pytest.raises(TypeError, match="key_cache must be a float8_e4m3fn"):
    token(key, key, kc.astype(jnp.bfloat16), vc.astype(jnp.bfloat16), ks, vs, slots)
  with pytest.raises(ValueError, match=r"k_dequant_scales must have shape \(2, 64\)"):
    token(key, key, kc, vc, ks[:, :10], vs, slots)
  with pytest.raises(TypeError, match="v_dequant_scales must be float32"):
    token(key, key, kc, vc, ks, vs.astype(jnp.bfloat16), slots)
  with pytest.raises(ValueError, match="duplicate slots"):
    token(key, key, kc, vc, ks, vs, jnp.array([5, 6, 5], jnp.int32))
  with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 64 is out of range"):
    token(key, key, kc, vc, ks, vs, jnp.array([0, 64, 1], jnp.int32))
  with pytest.raises(TypeError, match="value_cache dtype"):
    token(key, key, kc, vc.view(jnp.float8_e4m3fn), ks, vs, slots)
  with pytest.raises(ValueError, match="ori_block_size must be 128 or 256"):
    jkv.reshape_and_cache_with_block_quant_for_asm_pa(key, key, kc, vc, ks, vs, slots,
                                                      ori_block_size=64)
  with pytest.raises(ValueError, match="tokens_per_scale_block 24 must be a multiple"):
    jkv.write_quant_kv(key, key, kc, vc, ks, vs, slots, granularity="block", layout="vllm",
                       tokens_per_scale_block=24)
  with pytest.raises(ValueError, match="granularity must be"):
    jkv.write_quant_kv(key, key, kc, vc, ks, vs, slots, granularity="row", layout="vllm")
  with pytest.raises(ValueError, match="quant must be one of"):
    PagedKVCache.create(4, 16, 2, 64, quant="group")
  with pytest.raises(ValueError, match="needs kv_cache_dtype 'int8' or one of"):
    PagedKVCache.create(4, 16, 2, 64, quant="token")
  with pytest.raises(ValueError, match="stores packed E2M1 in layout 'hnd'"):
    PagedKVCache.create(4, 16, 2, 64, quant="mxfp4", layout="flash")


@pytest.mark.parametrize("quant", ["token", "block"])
def test_scaled_cache_can_be_donated(quant):
  """create gives k_scale and v_scale their own buffers: a whole cache can be donated."""
  cache = PagedKVCache.create(4, 16, 2, 16, quant=quant, kv_cache_dtype="int8",
                              dtype=jnp.float32)
  write = jax.jit(lambda c, k: c.write(0, k, k, jnp.arange(3), backend="reference"),
                  donate_argnums=0)
  new = write(cache, jnp.ones((3, 2, 16), jnp.float32))
  assert float(new.k_scale.max()) > 0 and float(new.v_scale.max()) > 0
