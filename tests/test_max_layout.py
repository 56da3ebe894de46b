"""Mojo MAX's paged collection, layout "max": one tensor [nb, 2, L, bs, H, D] holding every
layer of a block. Writes (kernel vs reference vs a numpy model), decode and ragged
attention (kernel and reference vs the flash layout's reference over the same layer),
transcoding, copy_blocks / swap_blocks on whole blocks of all layers, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import layout as layout_lib
from jkv import transcode as transcode_lib
from conftest import KERNEL, assert_same, bits, random_slots

NUM_BLOCKS, NUM_LAYERS, BLOCK, HEADS, HEAD_SIZE = 7, 3, 16, 2, 64


def random_collection(rng, dtype, num_blocks=NUM_BLOCKS, num_layers=NUM_LAYERS, block=BLOCK,
                      heads=HEADS, head_size=HEAD_SIZE):
  """A pre-filled random collection (never zeros), so untouched entries are checkable."""
  shape = layout_lib.max_shape(num_blocks, num_layers, block, heads, head_size)
  return jnp.asarray(rng.standard_normal(shape) * 2).astype(dtype)


def numpy_write(key, value, collection, slots, layer, convert):
  """Independent model: a per-token loop with plain numpy indexing."""
  out = np.array(collection)
  block = out.shape[3]
  for t, s in enumerate(np.asarray(slots)):
    if s < 0:
      continue
    b, o = divmod(int(s), block)
    out[b, 0, layer, o] = convert(np.asarray(key[t]))
    out[b, 1, layer, o] = convert(np.asarray(value[t]))
  return out


@pytest.mark.parametrize("dtype,kv_cache_dtype", [
    (jnp.bfloat16, "auto"), (jnp.float16, "auto"), (jnp.float32, "auto"),
    (jnp.float8_e4m3fn, "fp8"), (jnp.float8_e5m2, "fp8_e5m2")])
@pytest.mark.parametrize("layer", [0, 2])
def test_write_matches_reference_and_numpy(rng, dtype, kv_cache_dtype, layer):
  num_tokens, heads, head_size = 37, 3, 48   # odd sizes: a ragged last tile
  collection = random_collection(rng, dtype, heads=heads, head_size=head_size)
  key = jnp.asarray(rng.standard_normal((num_tokens, heads, head_size)), jnp.bfloat16)
  value = jnp.asarray(rng.standard_normal((num_tokens, heads, head_size)), jnp.bfloat16)
  slots = jnp.asarray(random_slots(rng, num_tokens, NUM_BLOCKS * BLOCK, padding=4))
  k_scale = jnp.asarray([0.5], jnp.float32) if kv_cache_dtype != "auto" else None
  outs = {}
  for backend in ("reference", KERNEL):
    (outs[backend],) = jkv.write_kv(key, value, collection, None, slots, layout="max",
                                    layer=layer, kv_cache_dtype=kv_cache_dtype,
                                    k_scale=k_scale, v_scale=k_scale, backend=backend)
  assert_same(outs[KERNEL], outs["reference"], "kernel vs reference")
  if kv_cache_dtype == "auto":
    want = numpy_write(key, value, collection, slots, layer,
                       lambda x: jnp.asarray(x).astype(dtype))
    assert_same(outs["reference"], jnp.asarray(want), "reference vs numpy")
  else:   # only the written (block, K|V, layer) pages changed
    written = np.zeros((NUM_BLOCKS, 2, NUM_LAYERS, BLOCK), bool)
    for s in np.asarray(slots)[np.asarray(slots) >= 0]:
      written[s // BLOCK, :, layer, s % BLOCK] = True
    same = bits(outs["reference"]) == bits(collection)
    assert same[~written].all()


def test_write_traced_layer_and_out_of_range_layer(rng):
  collection = random_collection(rng, jnp.bfloat16)
  key = value = jnp.asarray(rng.standard_normal((5, HEADS, HEAD_SIZE)), jnp.bfloat16)
  slots = jnp.asarray([3, 40, -1, 100, 17], jnp.int32)
  write = jax.jit(lambda c, layer: jkv.write_kv(key, value, c, None, slots, layout="max",
                                                layer=layer, backend=KERNEL)[0])
  want = jkv.write_kv(key, value, collection, None, slots, layout="max", layer=1,
                      backend="reference")[0]
  assert_same(write(collection, 1), want, "traced layer")
  assert_same(write(collection, NUM_LAYERS), collection, "out-of-range layer writes nothing")
  with pytest.raises(ValueError, match="layer"):
    jkv.write_kv(key, value, collection, None, slots, layout="max", layer=NUM_LAYERS)


def tables(rng, num_seqs, width, num_blocks, lens):
  """Random block tables whose entries past each length are -1."""
  table = rng.integers(0, num_blocks, (num_seqs, width)).astype(np.int32)
  for i, n in enumerate(lens):
    table[i, -(-n // BLOCK):] = -1
  return jnp.asarray(table)


@pytest.mark.parametrize("dtype,kv_cache_dtype", [
    (jnp.bfloat16, "auto"), (jnp.float16, "auto"), (jnp.float8_e4m3fn, "fp8")])
@pytest.mark.parametrize("layer", [0, 2])
def test_decode_attention_reads_the_layer(rng, dtype, kv_cache_dtype, layer):
  collection = random_collection(rng, dtype)
  # A block no table reads holds NaN: it must never be read.
  collection = collection.at[NUM_BLOCKS - 1].set(jnp.nan)
  lens = [70, 1, 33]
  table = tables(rng, 3, 5, NUM_BLOCKS - 1, lens)
  query = jnp.asarray(rng.standard_normal((3, 4, HEAD_SIZE)), jnp.bfloat16)
  scales = dict(kv_cache_dtype=kv_cache_dtype)
  if kv_cache_dtype != "auto":
    scales.update(k_scale=jnp.asarray([0.7, 1.3]), v_scale=jnp.asarray([1.1, 0.4]))
  want = jkv.paged_attention_decode(query, collection[:, 0, layer], collection[:, 1, layer],
                                    table, jnp.asarray(lens), layout="flash",
                                    backend="reference", **scales)
  for backend in ("reference", KERNEL):
    got = jkv.paged_attention_decode(query, collection, None, table, jnp.asarray(lens),
                                     layout="max", layer=layer, backend=backend, **scales)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 0 if backend == "reference" else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol, err_msg=backend)


@pytest.mark.parametrize("layer", [1, 2])
def test_ragged_attention_reads_the_layer(rng, layer):
  collection = random_collection(rng, jnp.bfloat16)
  collection = collection.at[NUM_BLOCKS - 1].set(jnp.nan)
  lens = [60, 9, 17]
  table = tables(rng, 3, 4, NUM_BLOCKS - 1, lens)
  cu_q_lens = jnp.asarray([0, 20, 21, 26], jnp.int32)   # a prefill chunk, a decode, a chunk
  query = jnp.asarray(rng.standard_normal((28, 4, HEAD_SIZE)), jnp.bfloat16)   # 2 padding
  want = jkv.ragged_paged_attention(query, collection[:, 0, layer], collection[:, 1, layer],
                                    table, jnp.asarray(lens), cu_q_lens, backend="reference")
  for backend in ("reference", KERNEL):
    got = jkv.ragged_paged_attention(query, collection, None, table, jnp.asarray(lens),
                                     cu_q_lens, layout="max", layer=layer, backend=backend)
    tol = 0 if backend == "reference" else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol, err_msg=backend)
    assert not np.asarray(got[26:], np.float32).any(), "padding rows read exactly 0"


def test_ragged_attention_with_write(rng):
  collection = random_collection(rng, jnp.bfloat16)
  lens = [40, 8]
  table = tables(rng, 2, 3, NUM_BLOCKS, lens)
  cu_q_lens = jnp.asarray([0, 4, 5], jnp.int32)
  positions = [36, 37, 38, 39, 7]
  slots = jnp.asarray([int(table[s, p // BLOCK]) * BLOCK + p % BLOCK
                       for s, p in zip([0, 0, 0, 0, 1], positions)], jnp.int32)
  query = jnp.asarray(rng.standard_normal((5, 4, HEAD_SIZE)), jnp.bfloat16)
  key = jnp.asarray(rng.standard_normal((5, HEADS, HEAD_SIZE)), jnp.bfloat16)
  value = jnp.asarray(rng.standard_normal((5, HEADS, HEAD_SIZE)), jnp.bfloat16)
  out, written, none = jkv.ragged_paged_attention_with_write(
      query, key, value, collection, None, slots, table, jnp.asarray(lens), cu_q_lens,
      layout="max", layer=1, backend=KERNEL)
  assert none is None
  (want_cache,) = jkv.write_kv(key, value, collection, None, slots, layout="max", layer=1,
                               backend="reference")
  assert_same(written, want_cache, "the write")
  want = jkv.ragged_paged_attention(query, want_cache, None, table, jnp.asarray(lens),
                                    cu_q_lens, layout="max", layer=1, backend="reference")
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             atol=2e-2, rtol=2e-2)


def test_transcode_round_trip_and_block_selection(rng):
  collection = random_collection(rng, jnp.bfloat16).at[2, 1, 0, 3].set(jnp.nan)
  key, value = transcode_lib.to_canonical(collection, None, "max", layer_axis=True)
  assert key.shape == (NUM_LAYERS, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE)
  assert_same(key, jnp.moveaxis(collection[:, 0], 1, 0), "canonical keys")
  assert_same(value, jnp.moveaxis(collection[:, 1], 1, 0), "canonical values")
  back, none = transcode_lib.from_canonical(key, value, "max", layer_axis=True)
  assert none is None
  assert_same(back, collection, "round trip, bit for bit")
  vllm_k, vllm_v = transcode_lib.transcode(collection, None, "max", "vllm", layer_axis=True)
  again, _ = transcode_lib.transcode(vllm_k, vllm_v, "vllm", "max", layer_axis=True)
  assert_same(again, collection, "max -> vllm -> max")
  picked, _ = transcode_lib.transcode(collection, None, "max", "max", layer_axis=True,
                                      block_ids=jnp.asarray([4, -1, 0]))
  assert_same(picked[0], collection[4], "block 4")
  assert not np.asarray(picked[1], np.float32).any(), "padding id: a zero block"
  assert_same(picked[2], collection[0], "block 0")


def test_copy_and_swap_move_all_layers_of_a_block(rng):
  collection = random_collection(rng, jnp.bfloat16)
  (copied,), _ = jkv.copy_blocks([collection], None, jnp.asarray([[1, 5], [3, 0]]),
                                 backend=KERNEL)
  want = collection.at[5].set(collection[1]).at[0].set(collection[3])
  assert_same(copied, want, "copy_blocks")
  other = random_collection(rng, jnp.bfloat16, num_blocks=3)
  swapped = jkv.swap_blocks(collection, other, jnp.asarray([[6, 2]]), backend=KERNEL)
  assert_same(swapped[2], collection[6], "swap_blocks: one block of every layer")


def test_errors():
  collection = jnp.zeros(layout_lib.max_shape(2, 2, 16, 2, 64), jnp.bfloat16)
  key = jnp.zeros((1, 2, 64), jnp.bfloat16)
  slots = jnp.zeros((1,), jnp.int32)
  with pytest.raises(ValueError, match="pass the layer"):
    jkv.write_kv(key, key, collection, None, slots, layout="max")
  with pytest.raises(ValueError, match="value_cache=None"):
    jkv.write_kv(key, key, collection, collection, slots, layout="max", layer=0)
  with pytest.raises(ValueError, match="NHD"):
    jkv.write_kv(key, key, collection, None, slots, layout="max", layer=0, kv_layout="HND")
  with pytest.raises(ValueError, match="NHD"):
    jkv.paged_attention_decode(jnp.zeros((1, 2, 64), jnp.bfloat16), collection, None,
                               jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32),
                               layout="max", layer=0, kv_layout="HND")
  with pytest.raises(ValueError, match="6-D"):
    jkv.write_kv(key, key, collection[:, 0], None, slots, layout="max", layer=0)
  with pytest.raises(ValueError, match="must have shape"):
    jkv.write_kv(jnp.zeros((1, 2, 32), jnp.bfloat16), jnp.zeros((1, 2, 32), jnp.bfloat16),
                 collection, None, slots, layout="max", layer=0)
  table, lens = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
  query = jnp.zeros((1, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="pass the layer"):
    jkv.paged_attention_decode(query, collection, None, table, lens, layout="max")
  with pytest.raises(ValueError, match="layer_axis=True"):
    transcode_lib.to_canonical(collection, None, "max")
  with pytest.raises(ValueError, match="NHD"):
    transcode_lib.to_canonical(collection, None, "max", "HND", layer_axis=True)


# ---- PagedKVCache over a collection ----------------------------------------------------------

def filled_caches(rng, kv_cache_dtype="auto"):
  """(flash cache, the same tokens in a MAX collection cache), 3 layers, random tokens."""
  flash = jkv.PagedKVCache.create(NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE, num_layers=NUM_LAYERS,
                                  kv_cache_dtype=kv_cache_dtype, k_scale=0.5, v_scale=0.25)
  collection = jkv.PagedKVCache.create(NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE,
                                       num_layers=NUM_LAYERS, layout="max",
                                       kv_cache_dtype=kv_cache_dtype, k_scale=0.5, v_scale=0.25)
  slots = jnp.asarray(random_slots(rng, 60, NUM_BLOCKS * BLOCK, padding=3))
  for layer in range(NUM_LAYERS):
    key = jnp.asarray(rng.standard_normal((60, HEADS, HEAD_SIZE)), jnp.bfloat16)
    value = jnp.asarray(rng.standard_normal((60, HEADS, HEAD_SIZE)), jnp.bfloat16)
    flash = flash.write(layer, key, value, slots, backend=KERNEL)
    collection = collection.write(layer, key, value, slots, backend=KERNEL)
  return flash, collection


def test_paged_cache_create_and_sizes():
  cache = jkv.PagedKVCache.create(NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE, num_layers=NUM_LAYERS,
                                  layout="max")
  assert cache.key_cache.shape == (NUM_BLOCKS, 2, NUM_LAYERS, BLOCK, HEADS, HEAD_SIZE)
  assert cache.value_cache is None
  assert (cache.num_layers, cache.num_blocks, cache.block_size, cache.num_heads,
          cache.head_size, cache.block_axis) == (NUM_LAYERS, NUM_BLOCKS, BLOCK, HEADS,
                                                 HEAD_SIZE, 0)
  assert cache.split_dims()["key_cache"] == (0, 4)
  with pytest.raises(ValueError, match="per token \\(quant 'token'\\)"):
    jkv.PagedKVCache.create(4, 16, 2, 64, layout="max", kv_cache_dtype="int8", quant="block")
  with pytest.raises(ValueError, match="kv_layout='NHD'"):
    jkv.PagedKVCache.create(4, 16, 2, 64, layout="max", kv_layout="HND")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_paged_cache_matches_the_flash_cache(rng, kv_cache_dtype):
  flash, collection = filled_caches(rng, kv_cache_dtype)
  assert_same(jkv.transcode_paged_kv_cache(flash, "max"), collection, "transcoded flash")
  assert_same(jkv.transcode_paged_kv_cache(collection, "flash"), flash, "and back")
  lens = [50, 1, 33]
  table = tables(rng, 3, 4, NUM_BLOCKS, lens)
  query = jnp.asarray(rng.standard_normal((3, 4, HEAD_SIZE)), jnp.bfloat16)
  cu_q_lens = jnp.asarray([0, 6, 7, 10], jnp.int32)
  ragged_query = jnp.asarray(rng.standard_normal((10, 4, HEAD_SIZE)), jnp.bfloat16)
  for layer in range(NUM_LAYERS):
    assert_same(collection.gather(layer, table, jnp.asarray(lens)),
                flash.gather(layer, table, jnp.asarray(lens)), f"gather {layer}")
    for backend in ("reference", KERNEL):
      want = flash.attend(layer, query, table, jnp.asarray(lens), backend="reference")
      got = collection.attend(layer, query, table, jnp.asarray(lens), backend=backend)
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                 atol=2e-2, rtol=2e-2)
      want = flash.attend_ragged(layer, ragged_query, table, jnp.asarray(lens), cu_q_lens,
                                 backend="reference")
      got = collection.attend_ragged(layer, ragged_query, table, jnp.asarray(lens), cu_q_lens,
                                     backend=backend)
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                 atol=2e-2, rtol=2e-2)


def test_paged_cache_in_a_scan_over_layers(rng):
  _, collection = filled_caches(rng)
  key = jnp.asarray(rng.standard_normal((NUM_LAYERS, 4, HEADS, HEAD_SIZE)), jnp.bfloat16)
  slots = jnp.asarray([5, 6, -1, 90], jnp.int32)

  @jax.jit
  def step(cache):
    def body(cache, layer):
      return cache.write(layer, key[layer], -key[layer], slots, backend=KERNEL), None
    return jax.lax.scan(body, cache, jnp.arange(NUM_LAYERS))[0]

  want = collection
  for layer in range(NUM_LAYERS):
    want = want.write(layer, key[layer], -key[layer], slots, backend="reference")
  assert_same(step(collection), want, "scan over layers, traced layer")


def test_paged_cache_blocks_host_tier_and_persist(rng, tmp_path):
  _, collection = filled_caches(rng)
  copied = collection.copy_blocks(jnp.asarray([[2, 6]]), backend=KERNEL)
  assert_same(copied.key_cache[6], collection.key_cache[2], "copy_blocks: every layer")
  zeroed = collection.zero_blocks(jnp.asarray([1, -1]))
  assert not np.asarray(zeroed.key_cache[1], np.float32).any()
  assert_same(zeroed.key_cache[2:], collection.key_cache[2:], "other blocks untouched")

  pool = jkv.PagePool.create(num_pages=NUM_BLOCKS, page_size=BLOCK, max_seqs=2,
                             max_pages_per_seq=3)
  pool, _ = pool.append(jnp.asarray([0, 1]), jnp.asarray([20, 9]))
  before = [collection.gather(layer, pool.block_table, pool.seq_lens)
            for layer in range(NUM_LAYERS)]
  host = jkv.HostKVCache.create(collection, num_blocks=4, max_seqs=2, max_pages_per_seq=3)
  assert host.cache.key_cache.shape == (4, 2, NUM_LAYERS, BLOCK, HEADS, HEAD_SIZE)
  pool, host = host.offload(pool, collection, [1], backend=KERNEL)
  pool, reloaded, host = host.reload(pool, jnp_copy(collection), [1], backend=KERNEL)
  for layer in range(NUM_LAYERS):
    got = reloaded.gather(layer, pool.block_table, pool.seq_lens)
    assert_same(got[0][1], before[layer][0][1], f"sequence 1 keys, layer {layer}")
    assert_same(got[1][1], before[layer][1][1], f"sequence 1 values, layer {layer}")

  jkv.save(tmp_path / "max.npz", collection)
  assert_same(jkv.load(tmp_path / "max.npz"), collection, "save / load")


def jnp_copy(cache):
  return jax.tree.map(jnp.copy, cache)
