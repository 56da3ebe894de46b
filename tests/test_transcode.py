"""Layout transcoding: tokens written into one layout and transcoded equal the same tokens
written directly into the other, bit for bit (NaN payloads, -0 and Inf included)."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import layout as layout_lib
from jkv.cache import PagedKVCache
from jkv.transcode import from_canonical, to_canonical, transcode, transcode_paged_kv_cache
from conftest import assert_same, bits

LAYOUTS = [("vllm", "NHD"), ("asm", "NHD"), ("flash", "NHD"), ("hnd", "NHD"),
           ("packed", "NHD"), ("packed", "HND"), ("paged5d", "NHD"), ("paged5d", "HND")]
DTYPES = [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.int8]
NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 3, 16, 2, 32   # asm with 1-byte x=16 needs bs % 16
# Tokens are written through a float "carrier" of the dtype's width and the cache bitcast:
# write_kv stores a cache of its own float dtype as is (kv_cache_dtype "auto"), but it
# quantizes real FP8 caches and refuses int8 (float8_e4m3b11fnuz is no FP8 cache dtype to
# jkv), and XLA:CPU's bfloat16 scatter quietens NaN payloads (float16's does not).
CARRIER = {1: jnp.float8_e4m3b11fnuz, 2: jnp.float16, 4: jnp.float32}


def layout_id(case):
  return "-".join(case)


def dtype_id(dtype):
  return np.dtype(dtype).name


def random_bits(rng, shape, dtype):
  """An array of dtype from uniform random bits: NaNs with payloads, -0 and Inf included."""
  width = 8 * np.dtype(dtype).itemsize
  raw = rng.integers(0, 2**width, size=shape, dtype=f"uint{width}")
  return jax.lax.bitcast_convert_type(jnp.asarray(raw), dtype)


def cache_shapes(layout, kv_layout, dtype):
  """(key_shape, value_shape) of one layer; paged5d is FlashInfer's [P, 2, ...] tensor."""
  if layout == "paged5d":
    rest = (BLOCK_SIZE, HEADS) if kv_layout == "NHD" else (HEADS, BLOCK_SIZE)
    return (NUM_BLOCKS, 2) + rest + (HEAD_SIZE,), None
  return layout_lib.cache_shapes(layout, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, dtype,
                                 kv_layout)


def random_caches(rng, layout, kv_layout, dtype, lead=()):
  k_shape, v_shape = cache_shapes(layout, kv_layout, dtype)
  return (random_bits(rng, lead + k_shape, dtype),
          None if v_shape is None else random_bits(rng, lead + v_shape, dtype))


def random_tokens(rng, dtype):
  """key, value [T, H, D] (random bits of dtype's width, as its carrier) and slots [T]
  that fill every slot of the cache once, in random order, plus two padding entries."""
  capacity = NUM_BLOCKS * BLOCK_SIZE
  slots = np.concatenate([rng.permutation(capacity), [-1, -1]]).astype(np.int32)
  slots = slots[rng.permutation(slots.size)]
  carrier = CARRIER[np.dtype(dtype).itemsize]
  shape = (slots.size, HEADS, HEAD_SIZE)
  return random_bits(rng, shape, carrier), random_bits(rng, shape, carrier), slots


def written(layout, kv_layout, dtype, key, value, slots):
  """Zero caches of ``layout`` with key/value written at slots by ``jkv.write_kv``,
  as ``dtype``: (key_cache, value_cache), value_cache None for packed / paged5d."""
  carrier = CARRIER[np.dtype(dtype).itemsize]
  k_shape, v_shape = cache_shapes(layout, kv_layout, dtype)
  value_cache = None if v_shape is None else jnp.zeros(v_shape, carrier)
  caches = jkv.write_kv(key, value, jnp.zeros(k_shape, carrier), value_cache, slots,
                        layout=layout, kv_layout=kv_layout, backend="reference")
  caches = [jax.lax.bitcast_convert_type(c, dtype) for c in caches]
  return caches[0], caches[1] if len(caches) == 2 else None


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_layout_pairs(rng, dtype):
  """For every layout: to_canonical holds token ``slot`` at [slot // bs, slot % bs] and
  from_canonical inverts it. For every pair A, B: transcode(A -> B) equals the direct write
  into B, and B -> A gives A back. Every slot is written, so every element is checked."""
  key, value, slots = random_tokens(rng, dtype)
  if np.dtype(dtype).itemsize > 1:   # the premise: NaNs of many payloads among the tokens
    stored = np.asarray(jax.lax.bitcast_convert_type(key, dtype))
    assert np.unique(bits(stored)[np.isnan(stored.astype(np.float32))]).size > 2
  direct = {case: written(*case, dtype, key, value, slots) for case in LAYOUTS}
  order = np.argsort(slots)[2:]   # token of each slot; the two padding entries (-1) sort first
  canonical = [  # tokens in slot order, permuted as raw bits in numpy
      jax.lax.bitcast_convert_type(jnp.asarray(bits(t)[order].reshape(
          NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE)), dtype) for t in (key, value)]
  for case in LAYOUTS:
    assert_same(to_canonical(*direct[case], *case), canonical, str(case))
    assert_same(from_canonical(*canonical, *case), direct[case], str(case))
  for src, dst in itertools.product(LAYOUTS, LAYOUTS):
    got = transcode(*direct[src], src[0], dst[0], src_kv_layout=src[1], dst_kv_layout=dst[1])
    assert_same(got, direct[dst], f"{src} -> {dst}")
    back = transcode(*got, dst[0], src[0], src_kv_layout=dst[1], dst_kv_layout=src[1])
    assert_same(back, direct[src], f"{src} -> {dst} -> {src}")


def take_blocks(cache, ids, lead=0):
  """numpy model of a block_ids subset: block ids[i], or zeros where ids[i] is padding."""
  if cache is None:
    return None
  cache = np.asarray(cache)
  out = np.take(cache, np.maximum(ids, 0), axis=lead)
  padding = np.expand_dims(np.asarray(ids) < 0,
                           tuple(range(lead)) + tuple(range(lead + 1, cache.ndim)))
  return np.where(padding, np.zeros((), cache.dtype), out)


@pytest.mark.parametrize("src,dst,dtype", [
    (("vllm", "NHD"), ("flash", "NHD"), jnp.float32),
    (("packed", "HND"), ("asm", "NHD"), jnp.float8_e4m3fn),
    (("paged5d", "NHD"), ("vllm", "NHD"), jnp.bfloat16)],
    ids=lambda p: layout_id(p) if isinstance(p, tuple) else dtype_id(p))
def test_block_ids_subset(rng, src, dst, dtype):
  key, value, slots = random_tokens(rng, dtype)
  source, target = written(*src, dtype, key, value, slots), written(*dst, dtype, key, value, slots)
  ids = np.array([2, 0, -1, 2], np.int32)   # order kept, repeats allowed, -1: a zero block
  got = transcode(*source, src[0], dst[0], src_kv_layout=src[1], dst_kv_layout=dst[1],
                  block_ids=ids)
  assert got[0].shape[0] == ids.size
  assert_same(got, [take_blocks(c, ids) for c in target])


def test_layer_axis_and_jit(rng):
  """layer_axis=True equals the layers transcoded one by one, eagerly and under jit,
  with traced block ids."""
  src, dst = ("paged5d", "HND"), ("asm", "NHD")
  layers = [random_caches(rng, *src, jnp.bfloat16) for _ in range(2)]
  per_layer = [transcode(*c, src[0], dst[0], src_kv_layout=src[1]) for c in layers]
  want = [jnp.stack([c[i] for c in per_layer]) for i in (0, 1)]
  stacked = (jnp.stack([c[0] for c in layers]), None)
  convert = functools.partial(transcode, src_layout=src[0], dst_layout=dst[0],
                              src_kv_layout=src[1], layer_axis=True)
  assert_same(convert(*stacked), want)
  assert_same(jax.jit(convert)(*stacked), want)
  # One id past the cache reads as padding under jit (eagerly: ValueError).
  ids = jnp.array([1, NUM_BLOCKS, -1, 0], jnp.int32)
  padded = np.where(np.asarray(ids) >= NUM_BLOCKS, -1, ids)
  assert_same(jax.jit(convert)(*stacked, block_ids=ids),
              [take_blocks(c, padded, lead=1) for c in want])
  canonical = to_canonical(*stacked, *src, layer_axis=True)
  assert canonical[0].shape == (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE)
  assert_same(from_canonical(*canonical, *src, layer_axis=True), stacked)


CACHE_CASES = [  # (quant, kv_cache_dtype, k_scale, source layout, destination layout)
    ("tensor", "auto", 1.0, ("packed", "HND"), ("vllm", "NHD")),
    ("tensor", "fp8", 0.25, ("asm", "NHD"), ("packed", "NHD")),
    ("token", "int8", 1.0, ("packed", "NHD"), ("asm", "NHD")),
    ("block", "fp8", 1.0, ("hnd", "NHD"), ("flash", "NHD"))]


@pytest.mark.parametrize("quant,kv_cache_dtype,k_scale,src,dst", CACHE_CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CACHE_CASES])
def test_paged_kv_cache(rng, quant, kv_cache_dtype, k_scale, src, dst):
  source = PagedKVCache.create(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, num_layers=2,
                               layout=src[0], kv_layout=src[1], dtype=jnp.bfloat16,
                               kv_cache_dtype=kv_cache_dtype, quant=quant, k_scale=k_scale)
  # Random data, and random scales for the modes whose scales are arrays of the cache.
  fill = {"key_cache": random_bits(rng, source.key_cache.shape, source.key_cache.dtype)}
  if source.value_cache is not None:
    fill["value_cache"] = random_bits(rng, source.value_cache.shape, source.value_cache.dtype)
  if quant != "tensor":
    for name in ("k_scale", "v_scale"):
      fill[name] = jnp.asarray(rng.uniform(0.5, 2, source.k_scale.shape), jnp.float32)
  source = source.replace(**fill)
  got = transcode_paged_kv_cache(source, *dst)
  assert (got.layout, got.kv_layout, got.quant) == (*dst, quant)
  table = jnp.array([[2, 0, 1], [1, 2, 0]], jnp.int32)
  seq_lens = jnp.array([40, 33], jnp.int32)
  for layer in jnp.arange(2):
    assert_same(got.gather(layer, table, seq_lens), source.gather(layer, table, seq_lens))
  back = transcode_paged_kv_cache(got, *src)
  assert (back.layout, back.kv_layout) == src
  assert_same(jax.tree.leaves(back), jax.tree.leaves(source))


def test_flash_with_hnd_kv_layout_is_refused():
  """("flash", "HND") would be NHD storage under an HND name: refused when a cache is created
  and as a transcoding destination (the HND flash cache is layout 'hnd')."""
  with pytest.raises(ValueError, match="pass layout='hnd'"):
    PagedKVCache.create(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, layout="flash",
                        kv_layout="HND", dtype=jnp.float32)
  cache = PagedKVCache.create(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, layout="hnd",
                              dtype=jnp.float32)
  with pytest.raises(ValueError, match="pass layout='hnd'"):
    transcode_paged_kv_cache(cache, "flash", "HND")


def zeros(*shape, dtype=jnp.float32):
  return jnp.zeros(shape, dtype)


def flash(dtype=jnp.float32, block_size=BLOCK_SIZE, head_size=HEAD_SIZE):
  shape = (NUM_BLOCKS, block_size, HEADS, head_size)
  return zeros(*shape, dtype=dtype), zeros(*shape, dtype=dtype)


BAD_INPUTS = [  # (id, call, error, message regex)
    ("unknown-layout", lambda: transcode(*flash(), "flash", "paged"), ValueError,
     r"layout must be one of \('vllm', 'asm', 'flash', 'hnd', 'packed', 'paged5d', 'max'\), got 'paged'"),
    ("bad-kv-layout", lambda: transcode(*flash(), "flash", "packed", dst_kv_layout="NDH"),
     ValueError, "kv_layout must be one of"),
    ("flash-HND", lambda: transcode(*flash(), "flash", "hnd", src_kv_layout="HND"), ValueError,
     "layout 'flash' is NHD storage .* pass layout='hnd'"),
    ("head-size-vs-x", lambda: transcode(*flash(head_size=6), "flash", "vllm"), ValueError,
     "head_size 6 must be a multiple of x=4 for layout 'vllm'"),
    ("block-size-vs-x", lambda: transcode(*flash(jnp.int8, block_size=8), "flash", "asm"),
     ValueError, "block_size 8 must be a multiple of x=16 for layout 'asm'"),
    ("x-of-dtype", lambda: transcode(zeros(3, 2, 4, 16, 8), zeros(3, 2, 32, 16), "vllm", "flash"),
     ValueError, r"key_cache must have shape \(3, 2, 8, 16, 4\), got \(3, 2, 4, 16, 8\)"),
    ("value-shape", lambda: transcode(zeros(3, 16, 2, 32), zeros(3, 16, 2, 16), "flash", "hnd"),
     ValueError, r"value_cache must have shape \(3, 16, 2, 32\)"),
    ("layer-axis-missing", lambda: transcode(zeros(2, 3, 16, 2, 32), zeros(2, 3, 16, 2, 32),
                                             "flash", "hnd"),
     ValueError, r"key_cache of layout 'flash' must be 4-D \(layer_axis=False\), got shape"),
    ("packed-with-value", lambda: transcode(zeros(3, 16, 2, 64), zeros(3, 16, 2, 64), "packed",
                                            "flash"),
     ValueError, "keeps K and V in one tensor; pass value_cache=None"),
    ("vllm-without-value", lambda: transcode(zeros(3, 2, 8, 16, 4), None, "vllm", "flash"),
     ValueError, "layout 'vllm' needs a value_cache"),
    ("paged5d-not-kv-pair", lambda: transcode(zeros(3, 3, 16, 2, 32), None, "paged5d", "flash"),
     ValueError, r"must be \[P, 2, ...\]"),
    ("dtype-mismatch", lambda: transcode(zeros(3, 16, 2, 32), zeros(3, 16, 2, 32,
                                                                    dtype=jnp.bfloat16),
                                         "flash", "hnd"),
     TypeError, "value_cache dtype bfloat16 differs from key_cache dtype float32"),
    ("block-id-range", lambda: transcode(*flash(), "flash", "hnd", block_ids=np.array([0, 3])),
     ValueError, r"block_ids\[1\] = 3 is out of range: the cache has 3 blocks"),
    ("block-id-dtype", lambda: transcode(*flash(), "flash", "hnd", block_ids=np.array([0.0])),
     TypeError, "block_ids must be an integer array"),
    ("block-id-rank", lambda: transcode(*flash(), "flash", "hnd", block_ids=np.zeros((1, 2), int)),
     ValueError, "block_ids must be 1-D"),
    ("canonical-shape", lambda: from_canonical(zeros(3, 16, 2, 32), zeros(3, 16, 2, 16), "vllm"),
     ValueError, r"value must have shape \(3, 16, 2, 32\)"),
    ("canonical-rank", lambda: from_canonical(zeros(2, 3, 16, 2, 32), zeros(2, 3, 16, 2, 32),
                                              "vllm"),
     ValueError, r"key must be 4-D \[nb, bs, H, D\]"),
    ("cache-fp4", lambda: transcode_paged_kv_cache(PagedKVCache.create(
        NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, layout="hnd", quant="mxfp4"), "flash"),
     NotImplementedError, "quant='mxfp4'"),
    ("cache-to-paged5d", lambda: transcode_paged_kv_cache(PagedKVCache.create(
        NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE), "paged5d"),
     ValueError, "layout must be one of"),
]


@pytest.mark.parametrize("call,error,message", [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs(call, error, message):
  with pytest.raises(error, match=message):
    call()
