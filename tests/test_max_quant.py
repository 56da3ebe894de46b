"""Per-token FP8 / INT8 quantization of a Mojo MAX collection (layout "max") with MAX's
``quantization_granularity``: a scale collection [nb, 2, L, bs, H, G], one scale per
(token, head, group of D / G head-dim elements).

The write is checked against the per-token write of a flash cache whose heads are the
groups (an independent, already tested op: a group quantizes exactly like a head of
D / G elements), the reads (decode and ragged attention, kernels and reference) against
the flash reference over the dequantized layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import layout as layout_lib
from conftest import KERNEL, assert_same, bits, random_slots

NUM_BLOCKS, NUM_LAYERS, BLOCK, HEADS, HEAD_SIZE = 7, 3, 16, 2, 128


def random_collection(rng, dtype, head_size=HEAD_SIZE, groups=2):
  """A pre-filled random quantized collection and scale collection (never zeros)."""
  shape = layout_lib.max_shape(NUM_BLOCKS, NUM_LAYERS, BLOCK, HEADS, head_size)
  if dtype == jnp.int8:
    collection = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
  else:
    collection = jnp.asarray(rng.standard_normal(shape) * 4).astype(dtype)
  scales = jnp.asarray(rng.uniform(0.01, 0.1, shape[:5] + (groups,)), jnp.float32)
  return collection, scales


def tokens(rng, num_tokens, head_size=HEAD_SIZE, special=(1, 2)):
  key = rng.standard_normal((num_tokens, HEADS, head_size)) * 3
  key[special[0], 0, 5] = np.inf   # a non-finite value: its group's scale is NaN
  key[special[1], 1, :] = 0.0      # an all-zero row: scale 0
  value = rng.standard_normal((num_tokens, HEADS, head_size))
  return jnp.asarray(key, jnp.bfloat16), jnp.asarray(value, jnp.bfloat16)


def as_flash_groups(collection, scales, layer, kv):
  """One plane of a layer as a per-token flash cache whose heads are the groups:
  ([nb, bs, H * G, D / G], scales [nb, H * G, bs])."""
  groups = scales.shape[-1]
  data = collection[:, kv, layer]
  data = data.reshape(data.shape[:2] + (HEADS * groups, -1))
  s = scales[:, kv, layer].reshape(NUM_BLOCKS, BLOCK, HEADS * groups)
  return data, jnp.swapaxes(s, 1, 2)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int8])
@pytest.mark.parametrize("head_size,groups", [(128, 1), (128, 2), (128, 8), (48, 3)])
def test_write_matches_reference_and_the_flash_per_token_write(rng, dtype, head_size, groups):
  layer, num_tokens = 1, 37
  collection, scales = random_collection(rng, dtype, head_size=head_size, groups=groups)
  slots = jnp.asarray(random_slots(rng, num_tokens, NUM_BLOCKS * BLOCK, padding=4))
  key, value = tokens(rng, num_tokens, head_size,
                      special=np.flatnonzero(np.asarray(slots) >= 0)[:2])
  outs = {}
  for backend in ("reference", KERNEL):
    outs[backend] = jkv.write_quant_kv(key, value, collection, None, scales, None, slots,
                                       granularity="token", layout="max", layer=layer,
                                       backend=backend)
    assert outs[backend][1] is None and outs[backend][3] is None
  assert_same(outs[KERNEL], outs["reference"], "kernel vs reference")
  got_collection, _, got_scales, _ = outs["reference"]
  # Each group is a head of D / G elements of a per-token quantized flash cache.
  for kv, src in enumerate((key, value)):
    cache, flash_scales = as_flash_groups(collection, scales, layer, kv)
    grouped = src.reshape(num_tokens, HEADS * groups, -1)
    cache, _, flash_scales, _ = jkv.write_quant_kv(
        grouped, grouped, cache, cache, flash_scales, flash_scales, slots,
        granularity="token", layout="flash", backend="reference")
    want_data, want_scales = as_flash_groups(got_collection, got_scales, layer, kv)
    assert_same(want_data, cache, f"plane {kv} data vs the flash per-token write")
    assert_same(want_scales, flash_scales, f"plane {kv} scales vs the flash per-token write")
  # Nothing else changed: other layers, other slots.
  written = np.zeros((NUM_BLOCKS, 2, NUM_LAYERS, BLOCK), bool)
  for s in np.asarray(slots)[np.asarray(slots) >= 0]:
    written[s // BLOCK, :, layer, s % BLOCK] = True
  assert (bits(got_collection) == bits(collection))[~written].all()
  assert (bits(got_scales) == bits(scales))[~written].all()
  assert np.isnan(np.asarray(got_scales)).any(), "the Inf token's group scale is NaN"


def test_other_groups_run_on_the_reference(rng):
  """Groups of fewer than 16 elements or not a power of two have no kernel: auto takes
  the reference, an explicit kernel back end raises."""
  collection, scales = random_collection(rng, jnp.float8_e4m3fn, head_size=96, groups=2)
  key, value = tokens(rng, 5, 96)
  with pytest.raises(NotImplementedError, match="no Pallas kernel"):   # 48 per group
    jkv.write_quant_kv(key, value, collection, None, scales, None, jnp.arange(5),
                       granularity="token", layout="max", layer=0, backend=KERNEL)
  collection, scales = random_collection(rng, jnp.float8_e4m3fn, groups=16)   # 8 per group
  key, value = tokens(rng, 5)
  slots = jnp.asarray([3, 40, -1, 100, 17], jnp.int32)
  got = jkv.write_quant_kv(key, value, collection, None, scales, None, slots,
                           granularity="token", layout="max", layer=0)
  want = jkv.write_quant_kv(key, value, collection, None, scales, None, slots,
                            granularity="token", layout="max", layer=0, backend="reference")
  assert_same(got, want, "auto")
  with pytest.raises(NotImplementedError, match="no Pallas kernel"):
    jkv.write_quant_kv(key, value, collection, None, scales, None, slots,
                       granularity="token", layout="max", layer=0, backend=KERNEL)
  table, lens = jnp.asarray([[1, 2]], jnp.int32), jnp.asarray([20], jnp.int32)
  query = jnp.asarray(rng.standard_normal((1, 4, HEAD_SIZE)), jnp.bfloat16)
  got = jkv.paged_attention_decode(query, collection, None, table, lens, layout="max", layer=0,
                                   k_dequant_scales=scales)
  want = jkv.paged_attention_decode(query, collection, None, table, lens, layout="max",
                                    layer=0, k_dequant_scales=scales, backend="reference")
  assert_same(got, want, "decode, auto")
  with pytest.raises(NotImplementedError, match="no Pallas kernel"):
    jkv.paged_attention_decode(query, collection, None, table, lens, layout="max", layer=0,
                               k_dequant_scales=scales, backend=KERNEL)
  with pytest.raises(NotImplementedError, match="no Pallas kernel"):
    jkv.ragged_paged_attention(query, collection, None, table, lens, jnp.asarray([0, 1]),
                               layout="max", layer=0, k_dequant_scales=scales, backend=KERNEL)


def test_write_traced_layer_in_jit(rng):
  collection, scales = random_collection(rng, jnp.float8_e4m3fn)
  key, value = tokens(rng, 6)
  slots = jnp.asarray([3, 40, -1, 100, 17, 5], jnp.int32)
  write = jax.jit(lambda c, s, layer: jkv.write_quant_kv(
      key, value, c, None, s, None, slots, granularity="token", layout="max", layer=layer,
      backend=KERNEL))
  want = jkv.write_quant_kv(key, value, collection, None, scales, None, slots,
                            granularity="token", layout="max", layer=2, backend="reference")
  assert_same(write(collection, scales, 2), want, "traced layer")
  out = write(collection, scales, NUM_LAYERS)
  assert_same((out[0], out[2]), (collection, scales), "out-of-range layer writes nothing")


def dequantized_layer(collection, scales, layer):
  """(keys, values) float32 [nb, bs, H, D] of a layer: each group times its scale (numpy)."""
  groups = scales.shape[-1]
  out = []
  for kv in range(2):
    data = np.asarray(collection[:, kv, layer], np.float32)
    s = np.asarray(scales[:, kv, layer])
    grouped = data.reshape(data.shape[:-1] + (groups, -1)) * s[..., None]
    out.append(jnp.asarray(grouped.reshape(data.shape)))
  return out


def tables(rng, num_seqs, width, num_blocks, lens):
  table = rng.integers(0, num_blocks, (num_seqs, width)).astype(np.int32)
  for i, n in enumerate(lens):
    table[i, -(-n // BLOCK):] = -1
  return jnp.asarray(table)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.int8])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("layer", [0, 2])
def test_decode_attention(rng, dtype, groups, layer):
  collection, scales = random_collection(rng, dtype, groups=groups)
  scales = scales.at[NUM_BLOCKS - 1].set(jnp.nan)   # a block no table reads
  lens = [70, 1, 33]
  table = tables(rng, 3, 5, NUM_BLOCKS - 1, lens)
  query = jnp.asarray(rng.standard_normal((3, 8, HEAD_SIZE)), jnp.bfloat16)
  keys, values = dequantized_layer(collection, scales, layer)
  want = jkv.paged_attention_decode(query, keys, values, table, jnp.asarray(lens),
                                    layout="flash", backend="reference")
  for backend in ("reference", KERNEL):
    got = jkv.paged_attention_decode(query, collection, None, table, jnp.asarray(lens),
                                     layout="max", layer=layer, k_dequant_scales=scales,
                                     backend=backend)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2e-2, rtol=2e-2, err_msg=backend)


@pytest.mark.parametrize("dtype,groups", [(jnp.float8_e4m3fn, 2), (jnp.int8, 1)])
def test_ragged_attention(rng, dtype, groups):
  layer = 1
  collection, scales = random_collection(rng, dtype, groups=groups)
  scales = scales.at[NUM_BLOCKS - 1].set(jnp.nan)   # a block no table reads
  lens = [60, 9, 17]
  table = tables(rng, 3, 4, NUM_BLOCKS - 1, lens)
  cu_q_lens = jnp.asarray([0, 20, 21, 26], jnp.int32)   # a prefill chunk, a decode, a chunk
  query = jnp.asarray(rng.standard_normal((28, 4, HEAD_SIZE)), jnp.bfloat16)   # 2 padding
  keys, values = dequantized_layer(collection, scales, layer)
  want = jkv.ragged_paged_attention(query, keys, values, table, jnp.asarray(lens), cu_q_lens,
                                    backend="reference")
  for backend in ("reference", KERNEL):
    got = jkv.ragged_paged_attention(query, collection, None, table, jnp.asarray(lens),
                                     cu_q_lens, layout="max", layer=layer,
                                     k_dequant_scales=scales, sinks=jnp.zeros(4),
                                     backend=backend)
    want_sinks = jkv.ragged_paged_attention(query, keys, values, table, jnp.asarray(lens),
                                            cu_q_lens, sinks=jnp.zeros(4), backend="reference")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want_sinks, np.float32),
                               atol=2e-2, rtol=2e-2, err_msg=backend)
    assert not np.asarray(got[26:], np.float32).any(), "padding rows read exactly 0"
  got = jkv.ragged_paged_attention(query, collection, None, table, jnp.asarray(lens),
                                   cu_q_lens, layout="max", layer=layer,
                                   k_dequant_scales=scales, backend=KERNEL)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=2e-2, rtol=2e-2)


def test_fused_write_and_ragged_attention(rng):
  """The fused write equals the write followed by the read."""
  layer = 1
  collection, scales = random_collection(rng, jnp.float8_e4m3fn, groups=2)
  lens = [60, 9, 17]
  table = tables(rng, 3, 4, NUM_BLOCKS - 1, lens)
  cu_q_lens = jnp.asarray([0, 20, 21, 26], jnp.int32)
  query = jnp.asarray(rng.standard_normal((28, 4, HEAD_SIZE)), jnp.bfloat16)

  key, value = tokens(rng, 28)
  slots = jnp.asarray(random_slots(rng, 28, (NUM_BLOCKS - 1) * BLOCK, padding=2))
  out = jkv.ragged_paged_attention_with_write(
      query, key, value, collection, None, slots, table, jnp.asarray(lens), cu_q_lens,
      layout="max", layer=layer, k_dequant_scales=scales, backend=KERNEL)
  written = jkv.write_quant_kv(key, value, collection, None, scales, None, slots,
                               granularity="token", layout="max", layer=layer, backend=KERNEL)
  assert_same(out[1:], written, "fused write")
  want = jkv.ragged_paged_attention(query, written[0], None, table, jnp.asarray(lens),
                                    cu_q_lens, layout="max", layer=layer,
                                    k_dequant_scales=written[2], backend=KERNEL)
  assert_same(out[0], want, "fused read")


def test_errors():
  collection = jnp.zeros(layout_lib.max_shape(2, 2, 16, 2, 64), jnp.float8_e4m3fn)
  scales = jnp.zeros((2, 2, 2, 16, 2, 2), jnp.float32)
  key = jnp.zeros((1, 2, 64), jnp.bfloat16)
  slots = jnp.zeros((1,), jnp.int32)
  write = lambda **kw: jkv.write_quant_kv(
      key, key, kw.pop("collection", collection), None, kw.pop("scales", scales),
      kw.pop("v_scales", None), kw.pop("slots", slots), layout="max",
      granularity=kw.pop("granularity", "token"), **dict(dict(layer=0), **kw))
  with pytest.raises(ValueError, match="holds K and V scales"):
    write(v_scales=scales)
  with pytest.raises(ValueError, match="needs its scale collection"):
    write(scales=None)
  with pytest.raises(ValueError, match="groups dividing"):
    write(scales=jnp.zeros((2, 2, 2, 16, 2, 3), jnp.float32))
  with pytest.raises(ValueError, match="groups dividing"):
    write(scales=jnp.zeros((2, 2, 2, 16, 2), jnp.float32))
  with pytest.raises(TypeError, match="float32"):
    write(scales=scales.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="quantized per token"):
    write(granularity="block")
  with pytest.raises(TypeError):
    write(collection=collection.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="duplicate"):
    jkv.write_quant_kv(jnp.zeros((2, 2, 64)), jnp.zeros((2, 2, 64)), collection, None,
                       scales, None, jnp.asarray([3, 3]), granularity="token", layout="max",
                       layer=0)
  with pytest.raises(ValueError, match="pass the layer"):
    write(layer=None)
  table, lens = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
  query = jnp.zeros((1, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="holds K and V scales"):
    jkv.paged_attention_decode(query, collection, None, table, lens, layout="max", layer=0,
                               k_dequant_scales=scales, v_dequant_scales=scales)
  with pytest.raises(ValueError, match="pass it as k_dequant_scales"):
    jkv.paged_attention_decode(query, collection, None, table, lens, layout="max", layer=0,
                               v_dequant_scales=scales)
  with pytest.raises(ValueError, match="must divide head_size"):
    jkv.PagedKVCache.create(4, 16, 2, 64, layout="max", kv_cache_dtype="int8", quant="token",
                            quantization_granularity=48)
  with pytest.raises(ValueError, match="layout='max', quant='token'"):
    jkv.PagedKVCache.create(4, 16, 2, 64, kv_cache_dtype="int8", quant="token",
                            quantization_granularity=32)


# ---- PagedKVCache over a quantized collection ------------------------------------------------

def filled_cache(rng, kv_cache_dtype="int8", granularity=64):
  cache = jkv.PagedKVCache.create(NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE, num_layers=NUM_LAYERS,
                                  layout="max", kv_cache_dtype=kv_cache_dtype, quant="token",
                                  quantization_granularity=granularity)
  slots = jnp.asarray(random_slots(rng, 60, NUM_BLOCKS * BLOCK, padding=3))
  key = jnp.asarray(rng.standard_normal((NUM_LAYERS, 60, HEADS, HEAD_SIZE)), jnp.bfloat16)

  @jax.jit
  def fill(cache):   # a scan over layers, the layer traced
    def body(cache, layer):
      return cache.write(layer, key[layer], -2 * key[layer], slots, backend=KERNEL), None
    return jax.lax.scan(body, cache, jnp.arange(NUM_LAYERS))[0]

  want = cache
  for layer in range(NUM_LAYERS):
    want = want.write(layer, key[layer], -2 * key[layer], slots, backend="reference")
  cache = fill(cache)
  assert_same(cache, want, "scan over layers vs the reference")
  return cache


def test_paged_cache_create_write_read(rng):
  cache = filled_cache(rng)
  assert cache.key_cache.shape == (NUM_BLOCKS, 2, NUM_LAYERS, BLOCK, HEADS, HEAD_SIZE)
  assert cache.k_scale.shape == (NUM_BLOCKS, 2, NUM_LAYERS, BLOCK, HEADS, 2)
  assert cache.v_scale is None and cache.value_cache is None
  assert cache.cache_format().scale_groups == 2
  assert cache.split_dims()["k_scale"] == (0, 4)
  lens = [50, 1, 33]
  table = tables(rng, 3, 4, NUM_BLOCKS, lens)
  query = jnp.asarray(rng.standard_normal((3, 4, HEAD_SIZE)), jnp.bfloat16)
  cu_q_lens = jnp.asarray([0, 6, 7, 10], jnp.int32)
  ragged_query = jnp.asarray(rng.standard_normal((10, 4, HEAD_SIZE)), jnp.bfloat16)
  for layer in range(NUM_LAYERS):
    keys, values = dequantized_layer(cache.key_cache, cache.k_scale, layer)
    got_k, got_v = cache.gather(layer, table, jnp.asarray(lens))
    want_k, want_v = (jnp.where((jnp.arange(4 * BLOCK) < jnp.asarray(lens)[:, None])
                                [:, :, None, None], x[table].reshape(3, 4 * BLOCK, HEADS, -1),
                                0).astype(jnp.bfloat16) for x in (keys, values))
    assert_same((got_k, got_v), (want_k, want_v), f"gather {layer}")
    want = jkv.paged_attention_decode(query, keys, values, table, jnp.asarray(lens),
                                      layout="flash", backend="reference")
    for backend in ("reference", KERNEL):
      got = cache.attend(layer, query, table, jnp.asarray(lens), backend=backend)
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                 atol=2e-2, rtol=2e-2)
    want = jkv.ragged_paged_attention(ragged_query, keys, values, table, jnp.asarray(lens),
                                      cu_q_lens, backend="reference")
    for backend in ("reference", KERNEL):
      got = cache.attend_ragged(layer, ragged_query, table, jnp.asarray(lens), cu_q_lens,
                                backend=backend)
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                 atol=2e-2, rtol=2e-2)


def test_paged_cache_blocks_host_tier_and_persist(rng, tmp_path):
  cache = filled_cache(rng, "fp8")
  copied = cache.copy_blocks(jnp.asarray([[2, 6]]), backend=KERNEL)
  assert_same((copied.key_cache[6], copied.k_scale[6]), (cache.key_cache[2], cache.k_scale[2]),
              "copy_blocks: data and scales of every layer")
  zeroed = cache.zero_blocks(jnp.asarray([1, -1]))
  assert not np.asarray(zeroed.k_scale[1]).any()
  assert_same(zeroed.k_scale[2:], cache.k_scale[2:], "other blocks untouched")

  pool = jkv.PagePool.create(num_pages=NUM_BLOCKS, page_size=BLOCK, max_seqs=2,
                             max_pages_per_seq=3)
  pool, _ = pool.append(jnp.asarray([0, 1]), jnp.asarray([20, 9]))
  before = [cache.gather(layer, pool.block_table, pool.seq_lens) for layer in range(NUM_LAYERS)]
  host = jkv.HostKVCache.create(cache, num_blocks=4, max_seqs=2, max_pages_per_seq=3)
  assert host.cache.k_scale.shape == (4, 2, NUM_LAYERS, BLOCK, HEADS, 2)
  pool, host = host.offload(pool, cache, [1], backend=KERNEL)
  pool, reloaded, host = host.reload(pool, jax.tree.map(jnp.copy, cache), [1], backend=KERNEL)
  for layer in range(NUM_LAYERS):
    got = reloaded.gather(layer, pool.block_table, pool.seq_lens)
    assert_same((got[0][1], got[1][1]), (before[layer][0][1], before[layer][1][1]),
                f"sequence 1, layer {layer}")
  with pytest.raises(NotImplementedError, match="to or from a MAX collection"):
    jkv.transcode_paged_kv_cache(cache, "flash")
  jkv.save(tmp_path / "max_quant.npz", cache)
  assert_same(jkv.load(tmp_path / "max_quant.npz"), cache, "save / load")
