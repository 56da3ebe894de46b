"""The Mosaic GPU decode attention (``lowering="mosaic"``) against the reference: Pallas' GPU
interpreter on CPU, compiled with ``JKV_BACKEND=pallas`` on a GPU (jax >= 0.11.2: CI's
newest-JAX pass). Every cache entry the sequences do not own holds NaN, so a kernel that
reads past a length, or multiplies a stale value row by a zero probability, fails."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import layout as layout_lib, quant
from jkv.ops import attention as attention_ops
from conftest import KERNEL
from pallas_kernels import lowering, mosaic_attention, mosaic_fp8_decode, mosaic_fp8_x_decode

pytestmark = pytest.mark.skipif(not lowering.mosaic_available(),
                                reason="the Mosaic GPU kernels need jax >= 0.11.2")

LAYOUTS = [("flash", "NHD"), ("hnd", "NHD"), ("packed", "NHD"), ("packed", "HND")]
# (query dtype, kv_cache_dtype)
FORMATS = [(jnp.bfloat16, "auto"), (jnp.float16, "auto"), (jnp.bfloat16, "fp8"),
           (jnp.float16, "fp8_e5m2")]


def poisoned_cache(rng, layout, kv_layout, num_blocks, block_size, heads, head_size, dtype,
                   kv_cache_dtype, table, lens, k_scale, v_scale, num_layers=1, layer=0):
  """Caches ([num_layers, ...]) full of NaN except the entries at positions < lens of each
  sequence in ``layer``, written with random K / V through the reference write."""
  cache_dtype = quant.fp8_dtype(kv_cache_dtype) or dtype
  k_shape, v_shape = layout_lib.cache_shapes(layout, num_blocks, block_size, heads, head_size,
                                             cache_dtype, kv_layout)
  nan = lambda shape: jnp.full((num_layers,) + shape, jnp.nan, cache_dtype)
  key_cache, value_cache = nan(k_shape), None if v_shape is None else nan(v_shape)
  slots = [int(table[s, p // block_size]) * block_size + p % block_size
           for s in range(len(lens)) for p in range(int(lens[s]))]
  tokens = len(slots)
  kv = lambda: jnp.asarray(rng.standard_normal((tokens, heads, head_size)), dtype)
  caches = jkv.write_kv(kv(), kv(), key_cache, value_cache, jnp.asarray(slots, jnp.int32),
                        layout=layout, kv_layout=kv_layout, kv_cache_dtype=kv_cache_dtype,
                        k_scale=k_scale, v_scale=v_scale, layer=layer, backend="reference")
  return caches[0], caches[1] if len(caches) > 1 else None


def check(rng, layout="flash", kv_layout="NHD", dtype=jnp.bfloat16, kv_cache_dtype="auto",
          block_size=16, lens=(37, 200, 0), width=16, num_blocks=60, q_heads=8, heads=2,
          head_size=128, num_layers=1, layer=0, num_splits=None, bad_blocks=False,
          query_scale=1.0):
  table = rng.permutation(num_blocks)[:len(lens) * width].reshape(len(lens), width)
  fp8 = kv_cache_dtype != "auto"
  k_scale = jnp.asarray(rng.uniform(0.5, 2, heads) if fp8 else np.ones(heads), jnp.float32)
  v_scale = jnp.asarray(rng.uniform(0.5, 2, heads) if fp8 else np.ones(heads), jnp.float32)
  key_cache, value_cache = poisoned_cache(
      rng, layout, kv_layout, num_blocks, block_size, heads, head_size, dtype, kv_cache_dtype,
      table, lens, k_scale, v_scale, num_layers, layer)
  if bad_blocks:   # under jit, blocks outside the cache are masked, as in the reference
    table = table.copy()
    table[0, 1], table[1, 0] = -1, num_blocks + 5
  query = jnp.asarray(rng.standard_normal((len(lens), q_heads, head_size)) * query_scale,
                      dtype)
  table, lens = jnp.asarray(table, jnp.int32), jnp.asarray(lens, jnp.int32)
  options = dict(layout=layout, kv_layout=kv_layout, kv_cache_dtype=kv_cache_dtype,
                 k_scale=k_scale if fp8 else None, v_scale=v_scale if fp8 else None)

  def attend(query, key_cache, value_cache, table, lens, layer, **kw):
    return jkv.paged_attention_decode(query, key_cache, value_cache, table, lens, layer=layer,
                                      **options, **kw)

  want = jax.jit(lambda *a: attend(*a, backend="reference"))(
      query, key_cache, value_cache, table, lens, layer)
  if num_splits is None:
    got = jax.jit(lambda *a: attend(*a, backend=KERNEL, lowering="mosaic"))(
        query, key_cache, value_cache, table, lens, layer)
  else:   # the kernel's own entry, to pin the split count
    key_plane, value_plane = layout_lib.planes(layout, block_size, heads, head_size,
                                               key_cache.dtype, kv_layout)
    got = attention_ops.mosaic_decode_kernel(key_cache.dtype, key_plane).paged_attention_decode(
        query, key_cache, value_cache, k_scale, v_scale, jnp.int32(layer), table, lens,
        key_plane=key_plane, value_plane=value_plane, num_blocks=num_blocks,
        scale=head_size ** -0.5, interpret=KERNEL == "interpret", num_splits=num_splits)
  assert got.dtype == dtype and bool(jnp.isfinite(got).all())
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("layout,kv_layout", LAYOUTS)
@pytest.mark.parametrize("dtype,kv_cache_dtype", FORMATS)
def test_decode_matches_reference(layout, kv_layout, dtype, kv_cache_dtype, rng):
  check(rng, layout, kv_layout, dtype, kv_cache_dtype)


@pytest.mark.parametrize("block_size,lens,width,num_splits,kv_cache_dtype", [
    (8, (1, 128, 9), 16, None, "auto"),      # 8 pages a tile
    (32, (64, 300, 33), 10, 3, "auto"),      # 2 pages a tile, a split ending mid-sequence
    (64, (65, 640, 1), 10, 2, "auto"),       # a page a tile
    (128, (5, 1280, 129), 10, 4, "auto"),    # two tiles a page
    (8, (2300, 17, 0), 300, 1, "auto"),      # a split's page list past 256 words (in parts)
    # The FP8 kernel (keys as wgmma's M), the same geometries
    (8, (1, 128, 9), 16, None, "fp8"),
    (32, (64, 300, 33), 10, 3, "fp8"),
    (64, (65, 640, 1), 10, 2, "fp8_e5m2"),
    (128, (5, 1280, 129), 10, 4, "fp8"),
    (8, (2300, 17, 0), 300, 1, "fp8"),
])
def test_page_sizes_and_splits(block_size, lens, width, num_splits, kv_cache_dtype, rng):
  check(rng, "hnd" if block_size in (32, 128) else "flash", block_size=block_size, lens=lens,
        width=width, num_blocks=max(60, 3 * width), num_splits=num_splits,
        kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("q_heads,heads,head_size,kv_cache_dtype", [
    (2, 2, 64, "auto"), (16, 2, 128, "auto"), (64, 1, 128, "auto"),
    (2, 2, 128, "fp8"), (6, 2, 128, "fp8"), (16, 2, 128, "fp8"), (24, 1, 128, "fp8_e5m2"),
    (64, 1, 128, "fp8")])
def test_query_groups(q_heads, heads, head_size, kv_cache_dtype, rng):
  """MHA (one query row of 64), GQA 8 and 64 query heads per kv head (the whole tile);
  over FP8 caches (the group as wgmma's N: 1, 3, 8, 24 and 64 heads in 8, 8, 8, 24 and 64
  columns)."""
  check(rng, lens=(3, 256, 100), q_heads=q_heads, heads=heads, head_size=head_size,
        kv_cache_dtype=kv_cache_dtype)


def test_layer_and_blocks_outside_the_cache(rng):
  """A traced layer of a stack (the other layers all NaN), and, under jit, block ids
  outside the cache inside a sequence's length: masked, as the reference does."""
  check(rng, "hnd", num_layers=3, layer=2, lens=(77, 150, 16))
  check(rng, "flash", kv_cache_dtype="fp8", num_layers=2, layer=1, lens=(1000, 31, 512),
        width=64, num_blocks=200)
  check(rng, "flash", lens=(77, 150, 16), bad_blocks=True)


@pytest.mark.parametrize("layout,block_size,dtype,kv_cache_dtype,lens,width,num_splits", [
    ("vllm", 16, jnp.bfloat16, "fp8", (37, 200, 0), 16, None),
    ("vllm", 16, jnp.float16, "fp8_e5m2", (37, 200, 0), 16, None),
    ("vllm", 16, jnp.bfloat16, "fp8", (2300, 17, 0), 300, 1),   # page list past 256 words
    ("asm", 16, jnp.bfloat16, "fp8", (1, 128, 9), 16, None),
    ("asm", 32, jnp.float16, "fp8_e5m2", (64, 300, 33), 10, 3),  # 2 pages a tile
    ("asm", 64, jnp.bfloat16, "fp8", (65, 640, 1), 10, 2),       # a page a tile
    ("asm", 128, jnp.bfloat16, "fp8", (5, 1280, 129), 10, 4),    # two tiles a page
])
def test_x_vectorized_fp8(layout, block_size, dtype, kv_cache_dtype, lens, width, num_splits,
                          rng):
  """FP8 vLLM / ASM caches (x-vectorized keys, token-fastest values) on their own kernel,
  :mod:`pallas_kernels.mosaic_fp8_x_decode`: page sizes, splits ending mid-sequence."""
  check(rng, layout, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
        lens=lens, width=width, num_blocks=max(60, 3 * width), num_splits=num_splits)


@pytest.mark.parametrize("q_heads,heads,dtype,kv_cache_dtype", [
    (2, 2, jnp.bfloat16, "fp8"), (6, 2, jnp.float16, "fp8_e5m2"), (16, 2, jnp.bfloat16, "fp8"),
    (64, 1, jnp.bfloat16, "fp8")])
def test_x_vectorized_fp8_groups_layers_and_bad_blocks(q_heads, heads, dtype, kv_cache_dtype,
                                                       rng):
  """The vLLM / ASM FP8 kernel's query groups (1, 3, 8 and 64 heads as wgmma's N), a traced
  layer of a stack (the others all NaN) and, under jit, blocks outside the cache (masked)
  with pages of 16, 32 and 128 tokens (4 pages a tile, 2, two tiles a page)."""
  check(rng, "vllm", dtype=dtype, kv_cache_dtype=kv_cache_dtype, lens=(3, 256, 100),
        q_heads=q_heads, heads=heads)
  if q_heads == 16:
    check(rng, "vllm", kv_cache_dtype="fp8", num_layers=2, layer=1, lens=(1000, 31, 512),
          width=64, num_blocks=200)
    for block_size in (16, 32, 128):
      check(rng, "asm", kv_cache_dtype="fp8", block_size=block_size, lens=(77, 150, 16),
            width=max(2, 160 // block_size), bad_blocks=True)


@pytest.mark.parametrize("dtype,kv_cache_dtype,row_exponents", [
    (jnp.bfloat16, "fp8", [-20, -4, 0, 3, -9, 1, 2, -1]),
    (jnp.float16, "fp8_e5m2", [-5, -4, 0, 3, -2, 1, 2, -1])])   # fp16: its normal range
def test_fp8_query_rows_of_any_size(dtype, kv_cache_dtype, row_exponents, rng):
  """Over an FP8 cache the query meets the keys as e4m3 terms per row (two for bf16, three
  for fp16), scaled by a power of two per row: rows whose sizes differ by up to 2^23, with
  elements spread over 2^-8 .. 2^2 of their row, still give the reference's result (one
  e4m3 term would not: 2^-4)."""
  row = 2.0 ** np.array(row_exponents, np.float32)[:, None]
  spread = 2.0 ** rng.uniform(-8, 2, (8, 128))
  check(rng, "flash", dtype=dtype, kv_cache_dtype=kv_cache_dtype, lens=(250, 17, 64),
        query_scale=row * spread)


@pytest.mark.parametrize("dtype,terms,exact_from", [(jnp.bfloat16, 2, 2.0 ** -2),
                                                    (jnp.float16, 3, 2.0)])
def test_query_terms_sum_to_the_scaled_query(dtype, terms, exact_from, rng):
  """The e4m3 terms the FP8 kernels split the query into sum to ``query * c`` exactly for
  elements of ``|query * c| >= exact_from``, and within e4m3's smallest subnormal step
  (2^-9) below it; ``c`` is a power of two per row with the row's largest at most 448.
  (fp16 in two terms, as before, misses by up to 2^-9 of an element: this test fails.)"""
  row = 2.0 ** rng.integers(-12, 12, (16, 1))
  query = jnp.asarray(rng.standard_normal((16, 128)) * 2.0 ** rng.uniform(-10, 0, (16, 128))
                      * row, dtype)
  parts = mosaic_attention.query_terms(query)
  # In XLA under jit, as the MLA kernel splits its query (on a GPU, without the barrier
  # against folding the e4m3 round trip, every later term came out zero).
  in_xla = jax.jit(functools.partial(mosaic_attention.query_terms, xla=True))(query)
  for part, xla_part in zip(parts, in_xla, strict=True):
    np.testing.assert_array_equal(np.asarray(xla_part, np.float32), np.asarray(part, np.float32))
  assert len(parts) == terms == mosaic_attention.query_term_count(dtype)
  c = np.asarray(mosaic_attention.query_row_scale(query))[:, None]
  scaled = np.asarray(query, np.float32) * c
  assert np.all(np.log2(c) == np.round(np.log2(c)))
  assert np.all(np.abs(scaled).max(axis=1) <= 448) and np.all(np.abs(scaled).max(axis=1) > 224)
  total = sum(np.asarray(part, np.float32) for part in parts)
  large = np.abs(scaled) >= exact_from
  assert large.mean() > 0.3 and (~large).mean() > 0.05
  np.testing.assert_array_equal(total[large], scaled[large])
  assert np.max(np.abs(total - scaled)) <= 2.0 ** -10


@pytest.mark.parametrize("layout,kv_cache_dtype,mosaic", [
    ("flash", "auto", "16-bit"), ("flash", "fp8", "fp8"), ("flash", "fp8_e5m2", "fp8"),
    ("flash", "int8", None), ("vllm", "fp8", "x-vectorized"), ("vllm", "auto", None)])
def test_auto_picks_mosaic_on_hopper(layout, kv_cache_dtype, mosaic, rng, monkeypatch):
  """``lowering="auto"`` on a Hopper GPU (faked) runs the Mosaic kernel over 16-bit caches
  and FP8 ones with per-tensor scales (measured faster there: FP8 on its own kernel, the
  keys as wgmma's M; FP8 vLLM pages on theirs), Triton for per-token INT8 and 16-bit vLLM
  pages (no Mosaic kernel)."""
  class Picked(Exception):
    pass

  def picker(kernel):
    def picked(*args, **kwargs):
      raise Picked(kernel)
    return picked

  monkeypatch.delenv("JKV_LOWERING", raising=False)   # auto's own choice (GPU runs set it)
  monkeypatch.setattr(jkv.backend, "hopper", lambda: True)
  monkeypatch.setattr(mosaic_attention, "paged_attention_decode", picker("16-bit"))
  monkeypatch.setattr(mosaic_fp8_decode, "paged_attention_decode", picker("fp8"))
  monkeypatch.setattr(mosaic_fp8_x_decode, "paged_attention_decode", picker("x-vectorized"))
  heads, head_size, block_size = 2, 128, 16
  options, cache_dtype = {}, jnp.bfloat16
  if kv_cache_dtype == "int8":   # per-token scales [H, nb * bs]
    scales = jnp.ones((heads, 4 * block_size), jnp.float32)
    options, cache_dtype = dict(k_dequant_scales=scales, v_dequant_scales=scales), jnp.int8
  elif kv_cache_dtype != "auto":
    options = dict(kv_cache_dtype=kv_cache_dtype, k_scale=jnp.ones((heads,), jnp.float32),
                   v_scale=jnp.ones((heads,), jnp.float32))
    cache_dtype = quant.fp8_dtype(kv_cache_dtype)
  k_shape, v_shape = layout_lib.cache_shapes(layout, 4, block_size, heads, head_size,
                                             cache_dtype)
  caches = jnp.zeros(k_shape, cache_dtype), jnp.zeros(v_shape, cache_dtype)
  query = jnp.asarray(rng.standard_normal((1, 8, head_size)), jnp.bfloat16)
  table, lens = jnp.asarray([[0, 1]], jnp.int32), jnp.asarray([20], jnp.int32)
  call = lambda: jkv.paged_attention_decode(query, *caches, table, lens, layout=layout,
                                            backend=KERNEL, **options)
  if mosaic:
    with pytest.raises(Picked, match=mosaic):
      call()
  else:
    assert call().shape == query.shape


def test_selection(rng, monkeypatch):
  """Cases the kernel does not take raise under ``lowering="mosaic"`` and run Triton under
  ``$JKV_LOWERING=mosaic``; ``supported`` names them."""
  planes = layout_lib.planes("flash", 16, 2, 128, jnp.bfloat16, "NHD")
  ok = dict(quant="none", alibi=False, soft_cap=False, window=False)
  assert mosaic_attention.supported(*planes, jnp.bfloat16, jnp.bfloat16, 4, **ok)
  assert not mosaic_attention.supported(*planes, jnp.float32, jnp.float32, 4, **ok)
  assert not mosaic_attention.supported(*planes, jnp.bfloat16, jnp.bfloat16, 4,
                                        **dict(ok, alibi=True))
  assert not mosaic_attention.supported(*planes, jnp.bfloat16, jnp.bfloat16, 128, **ok)
  fp8 = dict(ok, quant="tensor")
  assert mosaic_attention.supported(*planes, jnp.bfloat16, jnp.float8_e4m3fn, 4, **fp8)
  narrow = layout_lib.planes("flash", 16, 2, 64, jnp.float8_e4m3fn, "NHD")
  assert not mosaic_attention.supported(*narrow, jnp.bfloat16, jnp.float8_e4m3fn, 4, **fp8)
  small = layout_lib.planes("flash", 4, 2, 128, jnp.bfloat16, "NHD")
  assert not mosaic_attention.supported(*small, jnp.bfloat16, jnp.bfloat16, 4, **ok)
  vllm = layout_lib.planes("vllm", 16, 2, 128, jnp.bfloat16, "NHD")
  assert not mosaic_attention.supported(*vllm, jnp.bfloat16, jnp.bfloat16, 4, **ok)
  # The FP8 kernel (the keys as wgmma's M): FP8 caches with per-tensor scales, head size 128
  fp8_planes = layout_lib.planes("flash", 16, 2, 128, jnp.float8_e4m3fn, "NHD")
  assert mosaic_fp8_decode.supported(*fp8_planes, jnp.bfloat16, jnp.float8_e4m3fn, 4, **fp8)
  assert mosaic_fp8_decode.supported(*fp8_planes, jnp.float16, jnp.float8_e5m2, 64, **fp8)
  assert not mosaic_fp8_decode.supported(*fp8_planes, jnp.bfloat16, jnp.float8_e4m3fn, 128,
                                         **fp8)
  assert not mosaic_fp8_decode.supported(*planes, jnp.bfloat16, jnp.bfloat16, 4, **ok)
  assert not mosaic_fp8_decode.supported(*narrow, jnp.bfloat16, jnp.float8_e4m3fn, 4, **fp8)
  assert not mosaic_fp8_decode.supported(*fp8_planes, jnp.bfloat16, jnp.float8_e4m3fn, 4,
                                         **dict(fp8, window=True))
  # The FP8 vLLM / ASM kernel: x-vectorized keys; vLLM values in 16-token pages only
  for layout, block_size, taken in (("vllm", 16, True), ("asm", 32, True), ("vllm", 32, False),
                                    ("asm", 8, False)):
    x_planes = layout_lib.planes(layout, block_size, 2, 128, jnp.float8_e4m3fn, "NHD")
    assert mosaic_fp8_x_decode.supported(*x_planes, jnp.bfloat16, jnp.float8_e4m3fn, 4,
                                         **fp8) == taken
    assert not mosaic_fp8_decode.supported(*x_planes, jnp.bfloat16, jnp.float8_e4m3fn, 4,
                                           **fp8)
  assert not mosaic_fp8_x_decode.supported(*fp8_planes, jnp.bfloat16, jnp.float8_e4m3fn, 4,
                                           **fp8)
  x_planes = layout_lib.planes("vllm", 16, 2, 128, jnp.float8_e4m3fn, "NHD")
  assert not mosaic_fp8_x_decode.supported(*x_planes, jnp.bfloat16, jnp.float8_e4m3fn, 4,
                                           **dict(fp8, alibi=True))
  assert not mosaic_fp8_x_decode.supported(*x_planes, jnp.bfloat16, jnp.float8_e4m3fn, 65,
                                           **fp8)
  assert not mosaic_fp8_x_decode.supported(*x_planes, jnp.bfloat16, jnp.float8_e4m3fn, 4,
                                           **dict(fp8, quant="token"))
  assert not mosaic_fp8_x_decode.supported(*vllm, jnp.bfloat16, jnp.bfloat16, 4, **ok)
  int8_planes = layout_lib.planes("vllm", 16, 2, 128, jnp.int8, "NHD")
  assert not mosaic_fp8_x_decode.supported(*int8_planes, jnp.bfloat16, jnp.int8, 4, **fp8)
  narrow_x = layout_lib.planes("vllm", 16, 2, 64, jnp.float8_e4m3fn, "NHD")
  assert not mosaic_fp8_x_decode.supported(*narrow_x, jnp.bfloat16, jnp.float8_e4m3fn, 4,
                                           **fp8)

  key_cache = jnp.asarray(rng.standard_normal((8, 16, 2, 64)), jnp.bfloat16)
  query = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.bfloat16)
  table, lens = jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([20, 7], jnp.int32)
  slopes = jnp.linspace(0.1, 0.5, 4)
  args = (query, key_cache, key_cache, table, lens)
  with pytest.raises(NotImplementedError, match="no Mosaic GPU kernel"):
    jkv.paged_attention_decode(*args, layout="flash", alibi_slopes=slopes, backend=KERNEL,
                               lowering="mosaic")
  with pytest.raises(ValueError, match="lowering must be one of"):
    jkv.paged_attention_decode(*args, layout="flash", lowering="cuda")
  want = jkv.paged_attention_decode(*args, layout="flash", alibi_slopes=slopes,
                                    backend="reference")
  monkeypatch.setenv("JKV_LOWERING", "mosaic")   # ALiBi: Triton runs
  got = jkv.paged_attention_decode(*args, layout="flash", alibi_slopes=slopes, backend=KERNEL)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=2e-2, rtol=2e-2)
