"""Paged writes: kernel (interpret on CPU / compiled on GPU) vs reference vs a numpy model."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from jkv import layout as layout_lib
from jkv.cache import PagedKVCache
from conftest import KERNEL, assert_same, bits, random_slots

LAYOUTS = [("vllm", "NHD"), ("asm", "NHD"), ("flash", "NHD"), ("hnd", "NHD"),
           ("packed", "NHD"), ("packed", "HND")]
FP8 = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn,
       "fp8_e4m3fnuz": jnp.float8_e4m3fnuz, "fp8_e5m2": jnp.float8_e5m2}


def random_caches(rng, layout, kv_layout, num_blocks, block_size, heads, head_size, dtype,
                  num_layers=None):
  """Pre-filled random caches (never zeros), so untouched entries are checkable."""
  k_shape, v_shape = layout_lib.cache_shapes(layout, num_blocks, block_size, heads, head_size,
                                             dtype, kv_layout)
  lead = () if num_layers is None else (num_layers,)
  make = lambda shape: jnp.asarray(rng.standard_normal(lead + shape) * 2).astype(dtype)
  return make(k_shape), None if v_shape is None else make(v_shape)


def numpy_write(key, value, kc, vc, slots, layout, kv_layout, quantize):
  """Independent model: per-token loop with plain numpy indexing."""
  kc, vc = np.array(kc), None if vc is None else np.array(vc)
  key, value = np.asarray(key), np.asarray(value)
  d = key.shape[2]
  for t, s in enumerate(np.asarray(slots)):
    if s < 0:
      continue
    b, o = divmod(int(s), int(layout_lib.blocks_of(layout, kc.shape, kv_layout)[1]))
    k, v = quantize(key[t], 0), quantize(value[t], 1)
    if layout in ("vllm", "asm"):
      x = kc.shape[-1]
      kc[b, :, :, o, :] = k.reshape(k.shape[0], d // x, x)
      if layout == "vllm":
        vc[b, :, :, o] = v
      else:
        vc[b, :, o // x, :, o % x] = v
    elif layout == "flash":
      kc[b, o], vc[b, o] = k, v
    elif layout == "hnd":
      kc[b, :, o], vc[b, :, o] = k, v
    elif kv_layout == "NHD":
      kc[b, o, :, :d], kc[b, o, :, d:] = k, v
    else:
      kc[b, :, o, :d], kc[b, :, o, d:] = k, v
  return (kc,) if vc is None else (kc, vc)


def run_both(key, value, kc, vc, slots, layout, kv_layout, **kwargs):
  outs = {}
  for backend in ("reference", KERNEL):
    outs[backend] = jkv.write_kv(key, value, kc, vc, slots, layout=layout, kv_layout=kv_layout,
                                 backend=backend, **kwargs)
  return outs["reference"], outs[KERNEL]


@pytest.mark.parametrize("layout,kv_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_auto_matches_reference_and_numpy(layout, kv_layout, dtype, rng):
  heads, head_size, block_size, num_blocks, tokens = 3, 64, 16, 9, 37
  kc, vc = random_caches(rng, layout, kv_layout, num_blocks, block_size, heads, head_size, dtype)
  key = jnp.asarray(rng.standard_normal((tokens, heads, head_size)), dtype)
  value = jnp.asarray(rng.standard_normal((tokens, heads, head_size)), dtype)
  slots = random_slots(rng, tokens, num_blocks * block_size)
  ref, ker = run_both(key, value, kc, vc, slots, layout, kv_layout)
  assert_same(ref, ker)
  model = numpy_write(key, value, kc, vc, slots, layout, kv_layout, lambda x, _: x)
  assert_same(ref, [jnp.asarray(m) for m in model])
  assert not np.array_equal(bits(ref[0]), bits(kc))  # something was written


@pytest.mark.parametrize("layout,kv_layout", LAYOUTS)
@pytest.mark.parametrize("head_size,block_size", list(itertools.product([64, 80, 128, 256],
                                                                        [8, 16, 32])))
def test_head_and_block_sizes(layout, kv_layout, head_size, block_size, rng):
  heads, num_blocks, tokens = 2, 5, 19
  kc, vc = random_caches(rng, layout, kv_layout, num_blocks, block_size, heads, head_size,
                         jnp.bfloat16)
  key = jnp.asarray(rng.standard_normal((tokens, heads, head_size)), jnp.bfloat16)
  value = jnp.asarray(rng.standard_normal((tokens, heads, head_size)), jnp.bfloat16)
  slots = random_slots(rng, tokens, num_blocks * block_size, padding=3)
  ref, ker = run_both(key, value, kc, vc, slots, layout, kv_layout)
  assert_same(ref, ker)


@pytest.mark.parametrize("layout,kv_layout", LAYOUTS)
@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_fp8_matches_reference_and_numpy(layout, kv_layout, kv_cache_dtype, in_dtype, rng):
  heads, head_size, block_size, num_blocks, tokens = 4, 128, 16, 6, 29
  fp8 = FP8[kv_cache_dtype]
  kc, vc = random_caches(rng, layout, kv_layout, num_blocks, block_size, heads, head_size, fp8)
  key = jnp.asarray(rng.standard_normal((tokens, heads, head_size)) * 4, in_dtype)
  key = key.at[:, 0, :4].set(-1e-6)  # quantizes to -0.0: the sign must survive
  value = jnp.asarray(rng.standard_normal((tokens, heads, head_size)), in_dtype)
  per_head = layout in ("flash", "hnd")
  k_scale = jnp.asarray(rng.uniform(0.01, 0.1, heads) if per_head else [0.02], jnp.float32)
  v_scale = jnp.float32(2.0 / float(jnp.finfo(fp8).max))  # |value| > 2 saturates
  slots = random_slots(rng, tokens, num_blocks * block_size)
  ref, ker = run_both(key, value, kc, vc, slots, layout, kv_layout, kv_cache_dtype=kv_cache_dtype,
                      k_scale=k_scale, v_scale=v_scale)
  assert_same(ref, ker)
  max_value = float(jnp.finfo(fp8).max)
  inv = [1 / np.asarray(k_scale, np.float64), 1 / np.float64(v_scale)]

  def quantize(x, which):
    scale = inv[which] if np.ndim(inv[which]) == 0 else inv[which][:, None]
    y = np.asarray(x, np.float64) * scale
    return np.clip(y, -max_value, max_value).astype(fp8)

  model = numpy_write(key, value, kc, vc, slots, layout, kv_layout, quantize)
  for r, m in zip(ref, model):  # float64 model: equal up to one FP8 step at rounding ties
    diff = np.abs(np.asarray(r, np.float32) - m.astype(np.float32))
    assert np.max(diff / np.maximum(np.abs(m.astype(np.float32)), 2.0**-6)) <= 0.25
  values = np.asarray(ref[-1], np.float32)
  assert np.nanmax(np.abs(values)) == max_value  # saturated, not NaN
  assert not np.isnan(values).any()


@pytest.mark.parametrize("layout,kv_layout", LAYOUTS)
def test_out_of_range_slots(layout, kv_layout, rng):
  heads, head_size, block_size, num_blocks, tokens = 2, 64, 8, 4, 6
  kc, vc = random_caches(rng, layout, kv_layout, num_blocks, block_size, heads, head_size,
                         jnp.float32)
  key = jnp.asarray(rng.standard_normal((tokens, heads, head_size)), jnp.float32)
  slots = np.array([3, num_blocks * block_size, -1, 7, 2**31 - 1, 0], np.int32)
  with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 32 is out of range"):
    jkv.write_kv(key, key, kc, vc, slots, layout=layout, kv_layout=kv_layout, backend=KERNEL)
  for wide in (2**32 + 3, -(2**40)):  # int64 slots that would wrap to valid int32 slots
    with pytest.raises(ValueError, match=rf"slot_mapping\[0\] = {wide} does not fit in int32"):
      jkv.write_kv(key[:2], key[:2], kc, vc, np.array([wide, 1], np.int64), layout=layout,
                   kv_layout=kv_layout, backend=KERNEL)
  outs = {}
  for backend in ("reference", KERNEL):  # under jit: dropped, never out of bounds
    write = jax.jit(lambda k, kc, vc, s: jkv.write_kv(k, k, kc, vc, s, layout=layout,
                                                      kv_layout=kv_layout, backend=backend))
    outs[backend] = write(key, kc, vc, slots)
  assert_same(outs["reference"], outs[KERNEL])
  valid = np.where((slots >= 0) & (slots < num_blocks * block_size), slots, -1)
  assert_same(outs["reference"], run_both(key, key, kc, vc, valid, layout, kv_layout)[0])


def test_vllm_names_and_argument_order(rng):
  heads, head_size, block_size, num_blocks, tokens = 2, 64, 16, 4, 10
  slots = random_slots(rng, tokens, num_blocks * block_size)
  key = jnp.asarray(rng.standard_normal((tokens, heads, head_size)), jnp.bfloat16)
  for asm in (False, True):
    kc, vc = random_caches(rng, "asm" if asm else "vllm", "NHD", num_blocks, block_size, heads,
                           head_size, jnp.bfloat16)
    got = jkv.reshape_and_cache(key, key, kc, vc, slots, "auto", None, None, asm, backend=KERNEL)
    want = jkv.write_kv(key, key, kc, vc, slots, layout="asm" if asm else "vllm",
                        backend="reference")
    assert_same(got, want)
  for kv_layout, layout in (("NHD", "flash"), ("HND", "hnd")):
    kc, vc = random_caches(rng, layout, "NHD", num_blocks, block_size, heads, head_size,
                           jnp.float8_e4m3fn)
    got = jkv.reshape_and_cache_flash(key, key, kc, vc, slots, "fp8", jnp.ones(heads), 0.5,
                                      kv_layout, backend=KERNEL)
    want = jkv.write_kv(key, key, kc, vc, slots, layout=layout, kv_cache_dtype="fp8",
                        k_scale=jnp.ones(heads), v_scale=0.5, backend="reference")
    assert_same(got, want)
  for kv_layout in ("NHD", "HND"):
    kv, _ = random_caches(rng, "packed", kv_layout, num_blocks, block_size, heads, head_size,
                          jnp.bfloat16)
    got = jkv.reshape_and_cache_packed(key, key, kv, slots, kv_layout=kv_layout, backend=KERNEL)
    want = jkv.write_kv(key, key, kv, None, slots, layout="packed", kv_layout=kv_layout,
                        backend="reference")
    assert_same((got,), want)


def test_slot_mapping_shorter_than_key_uses_leading_tokens(rng):
  kc, vc = random_caches(rng, "flash", "NHD", 4, 8, 2, 64, jnp.float32)
  key = jnp.asarray(rng.standard_normal((12, 2, 64)), jnp.float32)
  slots = np.array([5, 9, 0], np.int32)
  got = jkv.reshape_and_cache_flash(key, key, kc, vc, slots, backend=KERNEL)
  want = jkv.reshape_and_cache_flash(key[:3], key[:3], kc, vc, slots, backend="reference")
  assert_same(got, want)


def test_eager_errors(rng):
  kc, vc = random_caches(rng, "vllm", "NHD", 4, 16, 2, 64, jnp.bfloat16)
  key = jnp.ones((3, 2, 64), jnp.bfloat16)
  slots = np.array([0, 1, 2], np.int32)
  with pytest.raises(ValueError, match=r"have num_heads=2, head_size=64; the key_cache "
                     r"\(4, 1, 8, 16, 8\) holds num_heads=1, head_size=64"):
    jkv.reshape_and_cache(jnp.ones((3, 2, 64)), jnp.ones((3, 2, 64)), kc[:, :1], vc, slots)
  with pytest.raises(ValueError, match=r"value must have shape \(3, 2, 64\)"):
    jkv.reshape_and_cache(key, key[:2], kc, vc, slots)
  with pytest.raises(TypeError, match="slot_mapping must be an integer array"):
    jkv.reshape_and_cache(key, key, kc, vc, slots.astype(np.float32))
  with pytest.raises(TypeError, match="kv_cache_dtype='auto'"):
    kc8, vc8 = random_caches(rng, "vllm", "NHD", 4, 16, 2, 64, jnp.float8_e4m3fn)
    jkv.reshape_and_cache(key, key, kc8, vc8, slots)
  with pytest.raises(TypeError, match="must have dtype float8_e5m2"):
    jkv.reshape_and_cache(key, key, kc8, vc8, slots, "fp8_e5m2")
  with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
    jkv.reshape_and_cache(key, key, kc, vc, slots, "int4")
  with pytest.raises(ValueError, match="slot_mapping has 4 entries but key has only 3"):
    jkv.reshape_and_cache(key, key, kc, vc, np.arange(4, dtype=np.int32))
  with pytest.raises(ValueError, match="backend must be one of"):
    jkv.reshape_and_cache(key, key, kc, vc, slots, backend="cuda")
  with pytest.raises(ValueError, match="kv_layout must be one of"):
    jkv.reshape_and_cache_flash(key, key, kc, vc, slots, kv_layout="NDH")


def test_empty_write_returns_caches(rng):
  kc, vc = random_caches(rng, "flash", "NHD", 2, 8, 2, 64, jnp.float32)
  out = jkv.reshape_and_cache_flash(jnp.ones((0, 2, 64)), jnp.ones((0, 2, 64)), kc, vc,
                                    np.zeros(0, np.int32), backend=KERNEL)
  assert_same(out, (kc, vc))


@pytest.mark.parametrize("layout,kv_layout", LAYOUTS)
def test_multi_layer_traced_layer_in_fori_loop(layout, kv_layout, rng):
  layers, heads, head_size, block_size, num_blocks, tokens = 3, 2, 64, 8, 6, 11
  kc, vc = random_caches(rng, layout, kv_layout, num_blocks, block_size, heads, head_size,
                         jnp.bfloat16, num_layers=layers)
  keys = jnp.asarray(rng.standard_normal((layers, tokens, heads, head_size)), jnp.bfloat16)
  slots = jnp.asarray(random_slots(rng, tokens, num_blocks * block_size))

  def run(backend):
    def body(layer, caches):
      return jkv.write_kv(keys[layer], -keys[layer], caches[0], caches[-1] if vc is not None
                          else None, slots, layout=layout, kv_layout=kv_layout, layer=layer,
                          backend=backend)
    init = (kc,) if vc is None else (kc, vc)
    return jax.jit(lambda c: jax.lax.fori_loop(0, layers, body, c))(init)

  ref, ker = run("reference"), run(KERNEL)
  assert_same(ref, ker)
  for layer in range(layers):  # each layer got its own tokens
    one = jkv.write_kv(keys[layer], -keys[layer], kc[layer], None if vc is None else vc[layer],
                       slots, layout=layout, kv_layout=kv_layout, backend="reference")
    assert_same([r[layer] for r in ref], one)


def test_traced_layer_out_of_range_writes_nothing(rng):
  kc, vc = random_caches(rng, "flash", "NHD", 4, 8, 2, 64, jnp.float32, num_layers=2)
  key = jnp.ones((3, 2, 64), jnp.float32)
  for backend in ("reference", KERNEL):
    write = jax.jit(lambda layer: jkv.write_kv(key, key, kc, vc, jnp.arange(3), layout="flash",
                                               layer=layer, backend=backend))
    for layer in (-1, 2, 7):
      assert_same(write(layer), (kc, vc))
  with pytest.raises(ValueError, match=r"layer must be in \[0, 2\), got 2"):
    jkv.write_kv(key, key, kc, vc, jnp.arange(3), layout="flash", layer=2)


@pytest.mark.parametrize("layout,kv_layout", LAYOUTS)
def test_paged_cache_pytree_write_gather(layout, kv_layout, rng):
  heads, head_size, block_size = 2, 64, 8
  kv_cache_dtype = "fp8" if layout in ("vllm", "flash") else "auto"
  cache = PagedKVCache.create(16, block_size, heads, head_size, num_layers=2, layout=layout,
                              kv_layout=kv_layout, dtype=jnp.float32,
                              kv_cache_dtype=kv_cache_dtype, k_scale=0.05, v_scale=0.05)
  block_table = jnp.asarray(rng.permutation(16)[:8].reshape(2, 4), jnp.int32)
  seq_lens = jnp.asarray([19, 32], jnp.int32)
  seq_ids = jnp.concatenate([jnp.zeros(19, jnp.int32), jnp.ones(32, jnp.int32)])
  positions = jnp.concatenate([jnp.arange(19), jnp.arange(32)]).astype(jnp.int32)
  slots = jkv.pages.slot_mapping(block_table, seq_ids, positions, block_size)
  key = jnp.asarray(rng.standard_normal((51, heads, head_size)), jnp.float32)
  value = jnp.asarray(rng.standard_normal((51, heads, head_size)), jnp.float32)
  step = jax.jit(lambda c, k, v, s: c.write(1, k, v, s, backend=KERNEL), donate_argnums=0)
  cache = step(cache, key, value, slots)
  k, v = cache.gather(1, block_table, seq_lens)
  tol = 0.07 if kv_cache_dtype == "fp8" else 0  # e4m3: half a step of 2^-3 relative
  for got, want in ((k, key), (v, value)):
    np.testing.assert_allclose(got[0, :19], want[:19], rtol=tol, atol=tol * 0.05)
    np.testing.assert_allclose(got[1, :32], want[19:], rtol=tol, atol=tol * 0.05)
    assert not np.asarray(got[0, 19:]).any()  # past seq_lens: zeros
  k0, _ = cache.gather(0, block_table, seq_lens)
  assert not np.asarray(k0).any()  # other layer untouched
  with pytest.raises(ValueError, match="block_table has entries outside"):
    cache.gather(0, block_table.at[0, 0].set(99), seq_lens)


@pytest.mark.parametrize("backend", ["reference"] + (["pallas"] if KERNEL == "pallas" else []))
def test_donated_write_does_not_copy_the_cache(backend, rng):
  """The compiled write aliases the donated cache: same buffer in and out, no cache-sized temp.

  (Pallas' interpreter is not checked: it is a CPU test vehicle, not an in-place path.)
  """
  # float32: XLA:CPU computes bf16 scatters in float32 (a converted temp, not a copy).
  kc, vc = random_caches(rng, "vllm", "NHD", 512, 16, 4, 128, jnp.float32)
  key = jnp.asarray(rng.standard_normal((8, 4, 128)), jnp.float32)
  slots = jnp.arange(8, dtype=jnp.int32) * 16
  write = jax.jit(lambda kc, vc, k, s: jkv.reshape_and_cache(k, k, kc, vc, s, backend=backend),
                  donate_argnums=(0, 1))
  compiled = write.lower(kc, vc, key, slots).compile()
  memory = compiled.memory_analysis()
  cache_bytes = kc.nbytes
  if memory is not None:
    assert memory.temp_size_in_bytes < cache_bytes // 4, memory
  hlo = compiled.as_text()
  assert "input_output_alias" in hlo or "may-alias" in hlo or "must-alias" in hlo
  if jax.default_backend() != "cpu":
    pointers = (kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer())
    out = write(kc, vc, key, slots)
    assert (out[0].unsafe_buffer_pointer(), out[1].unsafe_buffer_pointer()) == pointers


@pytest.mark.parametrize("layout,kv_layout", LAYOUTS)
@pytest.mark.parametrize("tile", [(16, 128), (32, 256), (8, 1024)])
def test_kernel_tiles_and_store_orders(layout, kv_layout, tile, rng):
  """Prefill-sized tiles (incl. the x-chunk / token-group store orders) on a ragged write."""
  from pallas_kernels import write as kernels
  heads, head_size, block_size, num_blocks, tokens = 2, 128, 16, 8, 45
  kc, vc = random_caches(rng, layout, kv_layout, num_blocks, block_size, heads, head_size,
                         jnp.bfloat16)
  key = jnp.asarray(rng.standard_normal((tokens, heads, head_size)), jnp.bfloat16)
  slots = random_slots(rng, tokens, num_blocks * block_size, padding=5)
  planes = layout_lib.planes(layout, block_size, heads, head_size, jnp.bfloat16, kv_layout)
  ones = jnp.ones((1,), jnp.float32)
  got = kernels.scatter_kv(key, -key, kc, vc, jnp.asarray(slots), 0, ones, ones,
                           key_plane=planes[0], value_plane=planes[1], num_blocks=num_blocks,
                           quant_dtype=None, interpret=KERNEL == "interpret",
                           tokens_per_program=tile[0], elems_per_program=tile[1])
  want = jkv.write_kv(key, -key, kc, vc, slots, layout=layout, kv_layout=kv_layout,
                      backend="reference")
  assert_same(got, want)


def test_paged_cache_is_a_pytree(rng):
  """Through tree_map, scan carries and device_put, with static metadata kept."""
  import chex
  cache = PagedKVCache.create(4, 8, 2, 64, num_layers=2, layout="asm", dtype=jnp.bfloat16)
  leaves, treedef = jax.tree.flatten(cache)
  assert len(leaves) == 4  # key, value, k_scale, v_scale
  doubled = jax.tree.map(lambda a: a + 1, cache)
  chex.assert_trees_all_equal_shapes_and_dtypes(cache, doubled)
  assert doubled.layout == "asm" and doubled.block_size == 8
  key = jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.bfloat16)

  def body(cache, slot):
    return cache.write(1, key[:1], key[:1], slot[None], backend=KERNEL), None

  scanned, _ = jax.lax.scan(body, jax.device_put(cache), jnp.arange(3, dtype=jnp.int32))
  k, _ = scanned.gather(1, jnp.asarray([[0]], jnp.int32), jnp.asarray([3], jnp.int32))
  chex.assert_shape(k, (1, 8, 2, 64))
  chex.assert_trees_all_equal(k[0, :3], jnp.broadcast_to(key[0], (3, 2, 64)))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3fnuz", "fp8_e5m2"])
def test_fp8_write_keeps_nan_and_saturates_inf(kv_cache_dtype, rng):
  """NaN stays NaN and +-Inf saturate to +-max in the kernel too (Triton's min / max would
  drop a NaN in the clip)."""
  fp8 = FP8[kv_cache_dtype]
  kc, vc = random_caches(rng, "flash", "NHD", 2, 16, 2, 64, fp8)
  key = rng.standard_normal((3, 2, 64)).astype(np.float32)
  key[0, 0, 5], key[1, 1, 7], key[2, 0, 9] = np.nan, np.inf, -np.inf
  slots = jnp.array([1, 2, 3], jnp.int32)
  outs = [jkv.reshape_and_cache_flash(key, key, kc, vc, slots, kv_cache_dtype=kv_cache_dtype,
                                      backend=b) for b in ("reference", KERNEL)]
  for out in outs:
    k = np.asarray(out[0]).astype(np.float32)
    assert np.isnan(k[0, 1, 0, 5]) and np.isnan(k).sum() == 1
    assert k[0, 2, 1, 7] == float(jnp.finfo(fp8).max) and k[0, 3, 0, 9] == -float(jnp.finfo(fp8).max)
  nan = np.isnan(np.asarray(outs[0][0]).astype(np.float32))
  np.testing.assert_array_equal(bits(outs[0][0])[~nan], bits(outs[1][0])[~nan])
