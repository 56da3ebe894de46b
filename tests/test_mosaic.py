"""The Mosaic GPU kernels (``lowering="mosaic"``) against the reference: Pallas' GPU
interpreter on CPU, compiled with ``JKV_BACKEND=pallas`` on a GPU. They need jax >= 0.11.2
(``jax.new_ref`` and the interpreter): CI runs them in its newest-JAX pass; on older JAX
``lowering="auto"`` runs the Triton kernels, which the rest of the suite checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import backend as backend_lib, layout as layout_lib, quant
from conftest import KERNEL, assert_same, bits, random_slots
from pallas_kernels import lowering, mosaic_write
from test_quant import EDGES, SPECIALS
from test_write import random_caches

pytestmark = pytest.mark.skipif(not lowering.mosaic_available(),
                                reason="the Mosaic GPU kernels need jax >= 0.11.2")

LAYOUTS = [("flash", "NHD"), ("hnd", "NHD"), ("packed", "NHD"), ("packed", "HND")]
# (input dtype, kv_cache_dtype, heads): FP8 writes need heads * head_size % 128 == 0.
FORMATS = [(jnp.bfloat16, "auto", 3), (jnp.float32, "auto", 3), (jnp.float16, "auto", 3),
           (jnp.bfloat16, "fp8", 2), (jnp.float16, "fp8_e5m2", 2)]


def cache_dtype(input_dtype, kv_cache_dtype):
  return quant.fp8_dtype(kv_cache_dtype) or input_dtype


def inputs(rng, tokens, heads, head_size, dtype, scale=1.0):
  make = lambda: jnp.asarray(rng.standard_normal((tokens, heads, head_size)) * scale, dtype)
  return make(), make()


@pytest.mark.parametrize("layout,kv_layout", LAYOUTS)
@pytest.mark.parametrize("dtype,kv_cache_dtype,heads", FORMATS)
def test_write_matches_reference(layout, kv_layout, dtype, kv_cache_dtype, heads, rng):
  """Every layout and format, on a write with padding slots: bit for bit the reference's."""
  head_size, block_size, num_blocks, tokens = 64, 16, 9, 37
  stored = cache_dtype(dtype, kv_cache_dtype)
  kc, vc = random_caches(rng, layout, kv_layout, num_blocks, block_size, heads, head_size,
                         stored)
  key, value = inputs(rng, tokens, heads, head_size, dtype, scale=40.0)   # FP8: saturates
  slots = random_slots(rng, tokens, num_blocks * block_size, padding=4)
  kw = dict(layout=layout, kv_layout=kv_layout, kv_cache_dtype=kv_cache_dtype)
  if kv_cache_dtype != "auto":
    kw.update(k_scale=jnp.asarray(rng.uniform(0.5, 2.0, heads), jnp.float32), v_scale=0.7)
  want = jkv.write_kv(key, value, kc, vc, slots, backend="reference", **kw)
  got = jkv.write_kv(key, value, kc, vc, slots, backend=KERNEL, lowering="mosaic", **kw)
  assert_same(want, got)
  assert not np.array_equal(bits(want[0]), bits(kc))   # something was written


@pytest.mark.parametrize("tokens_per_program", [1, 2, 3, 8])
def test_tokens_per_program(tokens_per_program, rng):
  """Programs of 1 to 8 tokens over 45 tokens: windows that start at unaligned slots and a
  last window moved back to the last token, whose first tokens the program before wrote."""
  heads, head_size, block_size, num_blocks, tokens = 2, 128, 16, 8, 45
  kc, vc = random_caches(rng, "flash", "NHD", num_blocks, block_size, heads, head_size,
                         jnp.bfloat16)
  key, value = inputs(rng, tokens, heads, head_size, jnp.bfloat16)
  slots = random_slots(rng, tokens, num_blocks * block_size, padding=5)
  planes = layout_lib.planes("flash", block_size, heads, head_size, jnp.bfloat16, "NHD")
  ones = jnp.ones((1,), jnp.float32)
  got = mosaic_write.scatter_kv(key, value, kc, vc, jnp.asarray(slots), 0, ones, ones,
                                key_plane=planes[0], value_plane=planes[1],
                                num_blocks=num_blocks, quant_dtype=None,
                                interpret=KERNEL == "interpret",
                                tokens_per_program=tokens_per_program)
  assert_same(jkv.write_kv(key, value, kc, vc, slots, layout="flash", backend="reference"), got)


@pytest.mark.parametrize("layout,kv_layout", LAYOUTS)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_several_tokens_per_program_every_layout(layout, kv_layout, kv_cache_dtype, rng):
  """3 tokens per program (unaligned windows, a shifted last window) in every layout, FP8
  with per-head scales, into layer 1 of a stacked cache."""
  heads, head_size, block_size, num_blocks, tokens = 2, 64, 16, 6, 29
  stored = cache_dtype(jnp.bfloat16, kv_cache_dtype)
  kc, vc = random_caches(rng, layout, kv_layout, num_blocks, block_size, heads, head_size,
                         stored, num_layers=2)
  key, value = inputs(rng, tokens, heads, head_size, jnp.bfloat16, scale=40.0)
  slots = random_slots(rng, tokens, num_blocks * block_size, padding=4)
  quant_dtype = quant.fp8_dtype(kv_cache_dtype)
  k_scale = jnp.asarray(rng.uniform(0.5, 2.0, heads), jnp.float32)
  planes = layout_lib.planes(layout, block_size, heads, head_size, stored, kv_layout)
  got = mosaic_write.scatter_kv(key, value, kc, vc, jnp.asarray(slots), 1, 1.0 / k_scale,
                                jnp.full((1,), 1.0 / 0.7, jnp.float32), key_plane=planes[0],
                                value_plane=planes[1], num_blocks=num_blocks,
                                quant_dtype=quant_dtype, interpret=KERNEL == "interpret",
                                tokens_per_program=3)
  want = jkv.write_kv(key, value, kc, vc, slots, layout=layout, kv_layout=kv_layout,
                      kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=0.7, layer=1,
                      backend="reference")
  assert_same(want, got)


def test_layers_and_dropped_slots_under_jit(rng):
  """A traced layer of a stacked cache; under jit, slots past the layer's blocks and
  layers out of range write nothing (never into the next layer)."""
  heads, head_size, block_size, num_blocks, tokens, layers = 2, 64, 16, 6, 20, 3
  kc, vc = random_caches(rng, "hnd", "NHD", num_blocks, block_size, heads, head_size,
                         jnp.bfloat16, num_layers=layers)
  key, value = inputs(rng, tokens, heads, head_size, jnp.bfloat16)
  slots = jnp.asarray(random_slots(rng, tokens, num_blocks * block_size, padding=3))
  slots = slots.at[4].set(num_blocks * block_size).at[5].set(num_blocks * block_size + 7)

  def write(layer, backend, lowering_name):
    return jax.jit(lambda kc, vc, layer, slots: jkv.write_kv(
        key, value, kc, vc, slots, layout="hnd", layer=layer, backend=backend,
        lowering=lowering_name))(kc, vc, layer, slots)

  for layer in (0, 2, 3, -1):
    want = write(jnp.int32(layer), "reference", "auto")
    got = write(jnp.int32(layer), KERNEL, "mosaic")
    assert_same(want, got)
  assert_same(write(jnp.int32(3), KERNEL, "mosaic"), (kc, vc))   # out of range: untouched


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_keeps_nan_and_saturates(kv_cache_dtype, rng):
  heads, head_size, block_size, num_blocks, tokens = 2, 64, 16, 4, 6
  stored = quant.fp8_dtype(kv_cache_dtype)
  kc, vc = random_caches(rng, "flash", "NHD", num_blocks, block_size, heads, head_size, stored)
  key, value = inputs(rng, tokens, heads, head_size, jnp.bfloat16)
  key = key.at[0, 0, :3].set(jnp.asarray([jnp.nan, jnp.inf, -jnp.inf], jnp.bfloat16))
  value = value.at[1].set(1e6)
  slots = jnp.arange(tokens, dtype=jnp.int32) * 3
  kw = dict(layout="flash", kv_cache_dtype=kv_cache_dtype, k_scale=0.5, v_scale=2.0)
  want = jkv.write_kv(key, value, kc, vc, slots, backend="reference", **kw)
  got = jkv.write_kv(key, value, kc, vc, slots, backend=KERNEL, lowering="mosaic", **kw)
  assert_same(want, got)
  stored_key = np.asarray(got[0][0, 0, 0, :3].astype(jnp.float32))
  top = float(quant.dtype_max(stored))
  assert np.isnan(stored_key[0]) and list(stored_key[1:]) == [top, -top]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_edges_match_reference(kv_cache_dtype, rng):
  """Infinities, NaN and values around each format's largest value, at scale 1: the
  compiled kernel leaves saturation to the hardware conversion; bit for bit the
  reference's."""
  heads, head_size, block_size, num_blocks, tokens = 2, 64, 16, 4, 6
  stored = quant.fp8_dtype(kv_cache_dtype)
  kc, vc = random_caches(rng, "flash", "NHD", num_blocks, block_size, heads, head_size, stored)
  edges = np.concatenate([SPECIALS, EDGES, -EDGES])
  key = rng.standard_normal(tokens * heads * head_size).astype(np.float32)
  key[:edges.size] = edges
  key = jnp.asarray(key.reshape(tokens, heads, head_size), jnp.bfloat16)
  value = key[::-1]
  slots = jnp.arange(tokens, dtype=jnp.int32) * 2 + 1
  kw = dict(layout="flash", kv_cache_dtype=kv_cache_dtype, k_scale=1.0, v_scale=1.0)
  want = jkv.write_kv(key, value, kc, vc, slots, backend="reference", **kw)
  got = jkv.write_kv(key, value, kc, vc, slots, backend=KERNEL, lowering="mosaic", **kw)
  assert_same(want, got)


def test_lowering_selection(rng, monkeypatch):
  """``lowering=`` and ``$JKV_LOWERING``: Mosaic where it has the case, Triton otherwise
  under the variable; an explicit ``lowering="mosaic"`` for a case it lacks raises."""
  heads, head_size, block_size, num_blocks, tokens = 2, 64, 16, 4, 9
  key, value = inputs(rng, tokens, heads, head_size, jnp.bfloat16)
  slots = random_slots(rng, tokens, num_blocks * block_size, padding=2)
  kc, vc = random_caches(rng, "vllm", "NHD", num_blocks, block_size, heads, head_size,
                         jnp.bfloat16)
  want = jkv.write_kv(key, value, kc, vc, slots, layout="vllm", backend="reference")
  with pytest.raises(NotImplementedError, match="no Mosaic GPU kernel"):
    jkv.write_kv(key, value, kc, vc, slots, layout="vllm", backend=KERNEL, lowering="mosaic")
  with pytest.raises(ValueError, match="lowering must be one of"):
    jkv.write_kv(key, value, kc, vc, slots, layout="vllm", lowering="cuda")
  monkeypatch.setenv("JKV_LOWERING", "mosaic")   # vllm: no Mosaic kernel, Triton runs
  assert_same(want, jkv.write_kv(key, value, kc, vc, slots, layout="vllm", backend=KERNEL))
  monkeypatch.setenv("JKV_LOWERING", "triton")
  assert backend_lib.lowering(mosaic_supported=True, mosaic_first=True) == "triton"
  monkeypatch.setenv("JKV_LOWERING", "mosaic")
  assert backend_lib.lowering(mosaic_supported=True) == "mosaic"
  monkeypatch.setenv("JKV_LOWERING", "fast")
  with pytest.raises(ValueError, match="JKV_LOWERING must be one of"):
    backend_lib.lowering(mosaic_supported=True)
  monkeypatch.delenv("JKV_LOWERING")
  assert backend_lib.lowering(mosaic_supported=True, mosaic_first=True) == "mosaic"
  assert backend_lib.lowering(mosaic_supported=True) == "triton"
  # A JAX without Pallas Triton: Mosaic where it has the case, else an error.
  assert backend_lib.lowering(mosaic_supported=True, triton_available=False) == "mosaic"
  with pytest.raises(NotImplementedError, match="no Pallas Triton"):
    backend_lib.lowering(mosaic_supported=False, triton_available=False)


def test_unsupported_cases_fall_back(rng, monkeypatch):
  """Cases the Mosaic kernel does not take: auto and ``$JKV_LOWERING=mosaic`` run Triton
  (equal to the reference), an explicit ``lowering="mosaic"`` raises."""
  heads, block_size, num_blocks, tokens = 3, 16, 4, 9
  slots = random_slots(rng, tokens, num_blocks * block_size, padding=2)
  flash = lambda d, dtype: random_caches(rng, "flash", "NHD", num_blocks, block_size, heads, d,
                                         dtype)
  cases = {   # rows of 3 x 24 bf16 = 144 bytes: not whole 128-byte lines
      "rows": (*inputs(rng, tokens, heads, 24, jnp.bfloat16), *flash(24, jnp.bfloat16),
               dict(layout="flash")),
      # FP8 rows of 3 x 64: not a multiple of 128 elements
      "fp8 rows": (*inputs(rng, tokens, heads, 64, jnp.bfloat16),
                   *flash(64, jnp.float8_e4m3fn), dict(layout="flash", kv_cache_dtype="fp8")),
      # key bf16, value float32
      "dtypes": (inputs(rng, tokens, heads, 64, jnp.bfloat16)[0],
                 inputs(rng, tokens, heads, 64, jnp.float32)[0], *flash(64, jnp.bfloat16),
                 dict(layout="flash")),
      # FlashInfer's one [P, 2, ps, H, D] tensor: V starts half a block in
      "paged5d": (*inputs(rng, tokens, heads, 64, jnp.bfloat16),
                  jnp.asarray(rng.standard_normal((num_blocks, 2, block_size, heads, 64)),
                              jnp.bfloat16), None, dict(layout="paged5d")),
  }
  for name, (key, value, kc, vc, kw) in cases.items():
    want = jkv.write_kv(key, value, kc, vc, slots, backend="reference", **kw)
    with pytest.raises(NotImplementedError, match="no Mosaic GPU kernel"):
      jkv.write_kv(key, value, kc, vc, slots, backend=KERNEL, lowering="mosaic", **kw)
    monkeypatch.setenv("JKV_LOWERING", "mosaic")
    assert_same(want, jkv.write_kv(key, value, kc, vc, slots, backend=KERNEL, **kw), name)
    monkeypatch.delenv("JKV_LOWERING")


def test_shared_memory_bound():
  """Shapes whose one-token tiles pass the shared memory a program may take are not the
  kernel's (they could not compile); the measured shapes take 8 tokens per program."""
  big = layout_lib.planes("flash", 16, 256, 256, jnp.bfloat16, "NHD")   # 2 x 128 KiB tiles
  assert not mosaic_write.supported(*big, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, None)
  wide = layout_lib.planes("flash", 16, 128, 256, jnp.float8_e4m3fn, "NHD")   # + scale rows
  assert mosaic_write.supported(*wide, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, None)
  assert not mosaic_write.supported(*wide, jnp.bfloat16, jnp.bfloat16, jnp.float8_e4m3fn,
                                    jnp.float8_e4m3fn)
  usual = layout_lib.planes("flash", 16, 8, 128, jnp.bfloat16, "NHD")
  assert mosaic_write.supported(*usual, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, None)
  for quantized in (False, True):
    assert mosaic_write.default_tokens_per_program(32768, 8, 128, 2, quantized) == 8
  assert mosaic_write.default_tokens_per_program(32768, 32, 256, 4, False) == 1
  assert mosaic_write.default_tokens_per_program(256, 8, 128, 2, False) == 1


@pytest.mark.skipif(KERNEL != "pallas", reason="buffer pointers: compiled on a GPU")
def test_donated_write_is_in_place(rng):
  """The donated caches come back in the same device buffers, with no cache-sized temp."""
  kc, vc = random_caches(rng, "flash", "NHD", 4096, 16, 8, 128, jnp.bfloat16)
  key = jnp.asarray(rng.standard_normal((8, 8, 128)), jnp.bfloat16)
  slots = jnp.arange(8, dtype=jnp.int32) * 16
  write = jax.jit(lambda kc, vc, k, s: jkv.write_kv(k, k, kc, vc, s, layout="flash",
                                                    lowering="mosaic"), donate_argnums=(0, 1))
  memory = write.lower(kc, vc, key, slots).compile().memory_analysis()
  assert memory.temp_size_in_bytes < kc.nbytes // 4
  pointers = (kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer())
  out = write(kc, vc, key, slots)
  assert (out[0].unsafe_buffer_pointer(), out[1].unsafe_buffer_pointer()) == pointers
