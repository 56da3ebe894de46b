"""copy_blocks and swap_blocks (kernel vs reference vs a numpy model; every memory-kind
direction) and copy-on-write with PagePool end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import layout as layout_lib
from conftest import KERNEL, bits

BACKENDS = ["reference", KERNEL]
DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
HOST = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


def random_array(rng, shape, dtype):
  """Fresh random data of any dtype (bytes for the 1-byte types: every bit pattern)."""
  if np.dtype(dtype).itemsize == 1:
    return jnp.asarray(rng.integers(0, 256, shape, dtype=np.uint8)).view(dtype)
  return jnp.asarray(rng.standard_normal(shape), dtype)


def numpy_copy(cache, pairs):
  """Independent model: read all sources, then write destinations in order."""
  cache = np.array(cache)
  pairs = [(int(s), int(d)) for s, d in np.asarray(pairs) if s >= 0 and d >= 0]
  blocks = [cache[s].copy() for s, _ in pairs]
  for (_, d), block in zip(pairs, blocks):
    cache[d] = block
  return cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,dtype", [("vllm", jnp.bfloat16), ("asm", jnp.float8_e4m3fn),
                                          ("flash", jnp.float32), ("packed", jnp.int8),
                                          ("hnd", jnp.float8_e4m3fnuz)])
def test_copy_blocks_matches_numpy(layout, dtype, backend, rng):
  layers, nb = 3, 12
  shapes = layout_lib.cache_shapes(layout, nb, 16, 2, 64, dtype)
  keys = [random_array(rng, shapes[0], dtype) for _ in range(layers)]
  values = None if shapes[1] is None else [random_array(rng, shapes[1], dtype)
                                           for _ in range(layers)]
  # a swap (3 <-> 4: both read before written), a chain (5 -> 6 -> 7), a skipped pair, a
  # duplicate destination (the later pair wins) and a plain pair
  pairs = jnp.array([[3, 4], [4, 3], [5, 6], [6, 7], [-1, 2], [1, 9], [2, 9], [0, 11]],
                    jnp.int32)
  k_out, v_out = jkv.copy_blocks(keys, values, pairs, backend=backend)
  assert isinstance(k_out, list) and (v_out is None or isinstance(v_out, list))
  for got, old in zip(k_out + (v_out or []), keys + (values or [])):
    np.testing.assert_array_equal(bits(got), bits(numpy_copy(old, pairs)))
  jitted = jax.jit(lambda k, v, p: jkv.copy_blocks(k, v, p, backend=backend))(keys, values, pairs)
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves((k_out, v_out))):
    np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_stacked_layers_with_scales(backend, rng):
  """Layer-stacked caches and scale arrays of other block sizes move together (block_axis=1);
  random pairs (many sources are also destinations) against the numpy model."""
  layers, nb = 2, 37
  arrays = [random_array(rng, (layers, nb, 5, 3, 24), jnp.bfloat16),
            random_array(rng, (layers, nb, 5, 3, 24), jnp.bfloat16),
            random_array(rng, (layers, nb, 3, 5), jnp.float32),
            random_array(rng, (layers, nb, 3), jnp.float8_e8m0fnu)]
  pairs = jnp.asarray(np.stack([rng.integers(-1, nb, 40), rng.integers(-1, nb, 40)], 1),
                      jnp.int32)
  out, _ = jkv.copy_blocks(arrays, None, pairs, block_axis=1, backend=backend)
  for got, old in zip(out, arrays):
    want = np.stack([numpy_copy(np.asarray(old)[l], pairs) for l in range(layers)])
    np.testing.assert_array_equal(bits(got), bits(want))


def test_copy_blocks_errors_and_no_copy(rng):
  kc = jnp.zeros((8, 16, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"block_mapping\[1, 1\] = 8 is out of range"):
    jkv.copy_blocks([kc], [kc], jnp.array([[0, 1], [2, 8]]))
  with pytest.raises(ValueError, match=r"block_mapping must be \[num_pairs, 2\]"):
    jkv.copy_blocks([kc], [kc], jnp.array([[0, 1, 2]]))
  with pytest.raises(TypeError, match="block_mapping must be an integer array"):
    jkv.copy_blocks([kc], [kc], jnp.array([[0.0, 1.0]]))
  with pytest.raises(ValueError, match=r"every cache must have shape \(8,\)"):
    jkv.copy_blocks([kc], [kc[:4]], jnp.array([[0, 1]]))
  with pytest.raises(ValueError, match="block_axis 4 is not an axis of cache 0"):
    jkv.copy_blocks([kc], None, jnp.array([[0, 1]]), block_axis=4)
  big = jnp.asarray(rng.standard_normal((512, 16, 4, 128)), jnp.float32)
  # The compiled kernel and the reference work in place (Pallas' interpreter copies its
  # aliased operands by design, so it is not measured here).
  for backend in ["reference"] + (["pallas"] if KERNEL == "pallas" else []):
    fn = jax.jit(lambda k, v: jkv.copy_blocks([k], [v], jnp.array([[1, 2], [3, 4]]),
                                              backend=backend), donate_argnums=(0, 1))
    memory = fn.lower(big, big).compile().memory_analysis()
    if memory is not None:
      assert memory.temp_size_in_bytes < big.nbytes // 4, (backend, memory)


def numpy_swap(src, dst, pairs, block_axis):
  """Independent model of swap_blocks: pairs in order, later ones win."""
  src, dst = np.moveaxis(np.array(src), block_axis, 0), np.moveaxis(np.array(dst), block_axis, 0)
  for s, d in np.asarray(pairs):
    if s >= 0 and d >= 0:
      dst[d] = src[s]
  return np.moveaxis(dst, 0, block_axis)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("src_kind,dst_kind", [(DEVICE, HOST), (HOST, DEVICE), (DEVICE, DEVICE),
                                               (HOST, HOST)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.uint8])
def test_swap_blocks_every_direction(src_kind, dst_kind, dtype, backend, rng):
  # The expected values come from the data before it is placed: np.asarray of a host
  # array keeps a zero-copy view in the array, and such a buffer cannot be donated.
  src_before = np.asarray(random_array(rng, (2, 11, 16, 3, 40), dtype))
  dst_before = np.asarray(random_array(rng, (2, 29, 16, 3, 40), dtype))
  src = jax.device_put(jnp.asarray(src_before), src_kind)
  dst = jax.device_put(jnp.asarray(dst_before), dst_kind)
  pairs = np.array([[3, 28], [10, 0], [4, 7], [5, 7], [-1, 3], [0, -1], [2, 13]])
  out = jkv.swap_blocks(src, dst, pairs, block_axis=1, backend=backend)
  assert out.sharding.memory_kind == dst_kind.memory_kind
  assert dst.is_deleted()                          # eager calls donate dst
  np.testing.assert_array_equal(bits(out), bits(numpy_swap(src_before, dst_before, pairs, 1)))
  np.testing.assert_array_equal(bits(src), bits(src_before))
  # under jit (caller donates), with a device mapping
  dst = jax.device_put(jnp.asarray(dst_before), dst_kind)
  step = jax.jit(lambda s, d, m: jkv.swap_blocks(s, d, m, block_axis=1, backend=backend),
                 donate_argnums=1, out_shardings=dst_kind)
  out = step(src, dst, jnp.asarray(pairs, jnp.int32))
  np.testing.assert_array_equal(bits(out), bits(numpy_swap(src_before, dst_before, pairs, 1)))


def test_swap_blocks_buckets_and_errors(rng):
  from jkv.ops import blocks as blocks_ops
  assert [blocks_ops.bucket_size(n) for n in (0, 1, 16, 17, 100, 1024)] == [16, 16, 16, 32,
                                                                          128, 1024]
  src = jax.device_put(jnp.asarray(rng.standard_normal((8, 4, 2)), jnp.float32), DEVICE)
  dst = jax.device_put(jnp.asarray(rng.standard_normal((6, 4, 2)), jnp.float32), DEVICE)
  blocks_ops._eager_swap.cache_clear()
  for n in (3, 5, 9):            # one bucket: one compiled program
    pairs = np.stack([rng.integers(0, 8, n), rng.integers(0, 6, n)], 1)
    want = numpy_swap(src, dst, pairs, 0)
    dst = jkv.swap_blocks(src, dst, pairs, backend="reference")
    np.testing.assert_array_equal(np.asarray(dst), want)
  (swap,) = [blocks_ops._eager_swap(dst.sharding, 0, "reference")]
  assert swap._cache_size() == 1
  with pytest.raises(ValueError, match=r"block_mapping\[0, 0\] = 8 is out of range: source "
                                       "has 8 blocks"):
    jkv.swap_blocks(src, dst, np.array([[8, 0]]))
  with pytest.raises(ValueError, match=r"block_mapping\[0, 1\] = 6 is out of range: "
                                       "destination has 6 blocks"):
    jkv.swap_blocks(src, dst, np.array([[7, 6]]))
  with pytest.raises(TypeError, match="one dtype"):
    jkv.swap_blocks(src, dst.astype(jnp.bfloat16), np.array([[0, 0]]))
  with pytest.raises(ValueError, match="must agree except on block axis 0"):
    jkv.swap_blocks(src, dst[:, :3], np.array([[0, 0]]))
  with pytest.raises(ValueError, match=r"block_mapping must be 2-D"):
    jkv.swap_blocks(src, dst, np.array([0, 0]))
  with pytest.raises(ValueError, match="src and dst are one array"):
    jkv.swap_blocks(dst, dst, np.array([[0, 1]]))
  with pytest.raises(TypeError, match="got a bool array: store it as uint8"):
    jkv.copy_blocks([jnp.zeros((4, 2), bool)], None, np.array([[0, 1]]))
  with pytest.raises(ValueError, match=r"block_mapping\[0, 1\] = 1099511627776 does not fit"):
    jkv.copy_blocks([src], None, [[0, 2**40]])


@pytest.mark.parametrize("backend", ["reference", KERNEL])
def test_block_moves_of_nothing(backend, rng):
  """No pairs (a traced [0, 2] mapping under jit) or no blocks: the caches come back."""
  src = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
  dst = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
  no_pairs = jnp.zeros((0, 2), jnp.int32)
  swap = jax.jit(lambda s, d, m: jkv.swap_blocks(s, d, m, backend=backend))
  np.testing.assert_array_equal(swap(src, dst, no_pairs), dst)
  np.testing.assert_array_equal(swap(jnp.zeros((0, 8)), dst, jnp.array([[0, 0]])), dst)
  copy = jax.jit(lambda c, m: jkv.copy_blocks([c], None, m, backend=backend)[0][0])
  np.testing.assert_array_equal(copy(src, no_pairs), src)
  assert copy(jnp.zeros((0, 8)), jnp.array([[0, 0]])).shape == (0, 8)
  # An empty list or 1-D array (a step with nothing to move) is no pairs, eagerly too.
  for empty in ([], np.array([]), jnp.zeros((0,), jnp.int32)):
    np.testing.assert_array_equal(jkv.swap_blocks(src, dst, empty, backend=backend), dst)
    np.testing.assert_array_equal(
        jkv.copy_blocks([src], None, empty, backend=backend)[0][0], src)


@pytest.mark.parametrize("mode", [dict(layout="flash", dtype=jnp.float32),
                                  dict(layout="vllm", quant="token", kv_cache_dtype="fp8",
                                       dtype=jnp.float32),
                                  dict(layout="hnd", quant="mxfp4", dtype=jnp.float32)])
def test_fork_copy_on_write_end_to_end(mode, rng):
  """PagePool fork + append gives copy pairs; PagedKVCache.copy_blocks applies them; then the
  child's new token lands in its own copy and the parent reads back unchanged."""
  bs, heads, head_size = 4, 2, 64
  pool = jkv.PagePool.create(num_pages=10, page_size=bs, max_seqs=2, max_pages_per_seq=4)
  cache = jkv.PagedKVCache.create(10, bs, heads, head_size, num_layers=2, **mode)
  prompt = jnp.asarray(rng.standard_normal((6, heads, head_size)), jnp.float32)
  pool, _ = pool.append(jnp.array([0]), jnp.array([6]))
  slots = pool.slot_mapping(jnp.zeros(6, jnp.int32), jnp.arange(6))
  for layer in range(2):
    cache = cache.write(layer, prompt, prompt, slots)
  pool = pool.fork(jnp.array([0]), jnp.array([1]))
  pool, copies = pool.append(jnp.array([1]), jnp.array([1]))
  assert int(copies[0, 0]) == int(pool.block_table[0, 1]) and int(copies[0, 1]) > 0
  cache = cache.copy_blocks(copies)
  token = jnp.asarray(rng.standard_normal((1, heads, head_size)), jnp.float32) * 3
  slot = pool.slot_mapping(jnp.array([1]), jnp.array([6]))
  for layer in range(2):
    cache = cache.write(layer, token, token, slot)
  for layer in range(2):
    k, _ = cache.gather(layer, pool.block_table, pool.seq_lens)
    np.testing.assert_array_equal(bits(k[0, :6]), bits(k[1, :6]))   # shared prefix, copied page
    assert not np.asarray(k[0, 6:]).any()                            # the parent never saw it
    want = np.concatenate([np.asarray(prompt), np.asarray(token)])
    tolerance = 0.5 if mode.get("quant") == "mxfp4" else 2**-4
    assert np.all(np.abs(np.asarray(k[1, :7]) - want) <= tolerance * np.abs(want).max())
  with pytest.raises(NotImplementedError, match="block scale spans 2 blocks"):
    jkv.PagedKVCache.create(8, bs, heads, head_size, quant="block", kv_cache_dtype="int8",
                            scale_block_tokens=8).copy_blocks(jnp.array([[0, 1]]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,nans", [
    (jnp.bfloat16, [0x7F81, 0xFFC1, 0x7FFF, 0xFF80 + 0x21]),   # signalling, negative payloads
    (jnp.float8_e5m2, [0x7D, 0x7E, 0xFD, 0xFF]),
    (jnp.float32, [0x7F800001, 0xFFC00123])])
def test_block_moves_keep_nan_payloads(dtype, nans, backend, rng):
  """The kernels move bits: NaN payloads (signalling, signed) survive in copied and in
  untouched blocks (floats are copied as unsigned integers). The reference moves values:
  XLA:CPU turns bfloat16 / float8_e5m2 NaNs into its canonical NaN, still NaN."""
  width = np.dtype(dtype).itemsize
  unsigned = np.dtype(f"u{width}")
  words = rng.integers(0, 2 ** (8 * width), (2, 6, 4, 8), dtype=np.uint64).astype(unsigned)
  words.reshape(-1)[rng.permutation(words.size)[:words.size // 3]] = rng.choice(
      np.array(nans, unsigned), words.size // 3)
  cache = jax.lax.bitcast_convert_type(jnp.asarray(words), dtype)
  pairs = np.array([[0, 3], [3, 0], [5, 1], [-1, 2]], np.int32)
  (copied,), _ = jkv.copy_blocks([cache], None, pairs, block_axis=1, backend=backend)
  want = words.copy()
  for src, dst in pairs[:3]:
    want[:, dst] = words[:, src]
  same_bits(copied, want, dtype, backend)
  dst_words = rng.integers(0, 2 ** (8 * width), (2, 9, 4, 8), dtype=np.uint64).astype(unsigned)
  dst_words[:, 4] = nans[0]
  swapped = jkv.swap_blocks(cache, jax.lax.bitcast_convert_type(jnp.asarray(dst_words), dtype),
                            np.array([[5, 7], [1, 0]], np.int32), block_axis=1, backend=backend)
  want = dst_words.copy()
  want[:, 7], want[:, 0] = words[:, 5], words[:, 1]
  same_bits(swapped, want, dtype, backend)


def same_bits(got, want_words, dtype, backend):
  """Bit for bit; for the reference with canonicalizing dtypes on CPU, NaN for NaN."""
  if backend == "reference" and jax.default_backend() == "cpu" and dtype in (
      jnp.bfloat16, jnp.float8_e5m2):
    want = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(want_words), dtype), np.float32)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)   # NaN == NaN here
  else:
    np.testing.assert_array_equal(bits(got), want_words)
