"""StateSpec / StateCache: page layout against a numpy model, bit-exact round trips of every
dtype, padding and out-of-range slots, traced layers, jitted decode loops with donation,
errors."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import bits
from jkv.state_cache import StateCache, StateSpec

# A Mamba2-like layer (conv state, SSM state) plus a byte-sized state in front, so that the
# offsets need alignment: int8 [3] at 0, bf16 [3, 5] at 8, float32 [2, 3, 4] at 40, int32 []
# at 136, page 144.
MIXED = {"flag": ((3,), jnp.int8), "conv": ((3, 5), jnp.bfloat16),
         "ssm": ((2, 3, 4), jnp.float32), "count": ((), jnp.int32)}
MIXED_OFFSETS = (0, 8, 40, 136)
MIXED_PAGE_BYTES = 144

DTYPES = [jnp.int8, jnp.uint8, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz,
          jnp.float8_e8m0fnu, jnp.int16, jnp.float16, jnp.bfloat16, jnp.int32, jnp.uint32,
          jnp.float32]
DTYPES_64 = [jnp.int64, jnp.float64]


def random_values(rng, shape, dtype):
  """Random bit patterns of ``dtype`` (NaNs, infinities, subnormals included); for floats the
  first element is -0.0 and the second a NaN, with a non-default payload where one exists."""
  dtype = np.dtype(dtype)
  unsigned = f"u{dtype.itemsize}"
  raw = rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
  values = raw.view(dtype).reshape(shape)
  if jnp.issubdtype(dtype, jnp.floating):
    flat = values.reshape(-1).view(unsigned)
    flat[0] = np.array(-0.0, dtype).view(unsigned)
    nan = np.array(np.nan, dtype).view(unsigned)
    payload = nan ^ np.array(1, unsigned)
    flat[1] = payload if np.isnan(np.array(payload).view(dtype)) else nan
  return values


def random_cache(rng, spec, num_layers, num_slots):
  """A cache whose every byte (padding included) is random."""
  pages = rng.integers(0, 256, size=(num_layers, num_slots, spec.page_bytes), dtype=np.uint8)
  return StateCache(pages=jnp.asarray(pages), spec=spec)


def random_states(rng, spec, n):
  return {name: random_values(rng, (n, *spec.shape(name)), spec.dtype(name))
          for name in spec.names}


def model_write(model, spec, layer, slots, name, values):
  """The numpy model of a write: each slot's state bytes viewed as the state's array."""
  start, stop = spec.offset(name), spec.offset(name) + spec.nbytes(name)
  for slot, value in zip(slots, values):
    if 0 <= slot < model.shape[1]:
      model[layer, slot, start:stop].view(spec.dtype(name)).reshape(spec.shape(name))[...] = value


def model_read(model, spec, layer, name, slot):
  start, stop = spec.offset(name), spec.offset(name) + spec.nbytes(name)
  return model[layer, slot, start:stop].view(spec.dtype(name)).reshape(spec.shape(name))


def test_offsets_alignment_and_page_size():
  spec = StateSpec(MIXED)
  assert spec.names == ("flag", "conv", "ssm", "count")
  assert spec.offsets == MIXED_OFFSETS and spec.page_bytes == MIXED_PAGE_BYTES
  assert spec.alignment == 8
  assert [spec.nbytes(n) for n in spec.names] == [3, 30, 96, 4]
  assert spec.shape("ssm") == (2, 3, 4) and spec.dtype("conv") == np.dtype(jnp.bfloat16)
  for name in spec.names:
    assert spec.offset(name) % 8 == 0 and spec.offset(name) % spec.dtype(name).itemsize == 0
  # States never overlap, in the given order, inside the page.
  ends = [spec.offset(n) + spec.nbytes(n) for n in spec.names]
  assert all(end <= start for end, start in zip(ends, spec.offsets[1:]))
  assert ends[-1] <= spec.page_bytes
  # A caller's page (vLLM: padded to the attention page size) keeps the offsets.
  padded = StateSpec(MIXED, page_bytes=4096)
  assert padded.offsets == MIXED_OFFSETS and padded.page_bytes == 4096
  # Normalized, hashable static metadata: the same spec from its own states.
  assert StateSpec(spec.states) == spec and hash(StateSpec(spec.states)) == hash(spec)
  assert dataclasses.replace(spec, page_bytes=256).page_bytes == 256
  assert StateSpec(MIXED, page_bytes=MIXED_PAGE_BYTES) == spec
  # 8-byte states align to 8 too; one tight 2-byte state still gets an 8-byte page.
  assert StateSpec({"a": ((1,), jnp.int16), "b": ((2,), jnp.float64)}).offsets == (0, 8)
  assert StateSpec({"a": ((3,), jnp.int16)}).page_bytes == 8


def test_bad_specs_raise():
  with pytest.raises(ValueError, match="page_bytes is too small: the states need 144 bytes, "
                                       "got 136"):
    StateSpec(MIXED, page_bytes=136)
  with pytest.raises(ValueError, match="page_bytes must be a multiple of the alignment 8, "
                                       "got 150"):
    StateSpec(MIXED, page_bytes=150)
  with pytest.raises(ValueError, match="at least one state"):
    StateSpec({})
  with pytest.raises(ValueError, match=r"state 'conv' must have a shape of positive sizes, "
                                       r"got \(3, 0\)"):
    StateSpec({"conv": ((3, 0), jnp.bfloat16)})
  for dtype in (jnp.bool_, jnp.int4, jnp.float4_e2m1fn, jnp.complex64):
    with pytest.raises(TypeError, match=f"state 'x' must have a whole-byte integer or "
                                        f"floating dtype.*got {np.dtype(dtype)}"):
      StateSpec({"x": ((4,), dtype)})
  with pytest.raises(ValueError, match="distinct string names"):
    StateSpec((("a", (1,), jnp.int8), ("a", (2,), jnp.int8)))
  with pytest.raises(ValueError, match=r"name must be one of \('flag', 'conv', 'ssm', "
                                       r"'count'\), got 'cnov'"):
    StateSpec(MIXED).offset("cnov")


def test_create_is_a_pytree_of_zero_pages():
  spec = StateSpec(MIXED)
  cache = StateCache.create(spec, num_layers=3, num_slots=5)
  assert cache.pages.shape == (3, 5, MIXED_PAGE_BYTES) and cache.pages.dtype == jnp.uint8
  assert not np.asarray(cache.pages).any()
  assert (cache.num_layers, cache.num_slots) == (3, 5)
  leaves, treedef = jax.tree.flatten(cache)
  assert len(leaves) == 1 and leaves[0] is cache.pages
  assert jax.tree.unflatten(treedef, leaves).spec == spec


@pytest.mark.parametrize("dtype", DTYPES + DTYPES_64, ids=lambda d: np.dtype(d).name)
def test_round_trip_is_bit_exact(dtype, rng):
  """Every dtype, eagerly and under jit: reads give back the written bits (NaN payloads,
  -0.0 and all), zeros for padding."""
  x64 = jax.enable_x64(True) if np.dtype(dtype).itemsize == 8 else contextlib.nullcontext()
  with x64:
    spec = StateSpec({"flag": ((3,), jnp.int8), "state": ((3, 4, 5), dtype)})
    cache = random_cache(rng, spec, num_layers=2, num_slots=4)
    values = random_values(rng, (2, 3, 4, 5), dtype)
    slots = jnp.array([2, 0], jnp.int32)
    read_slots = jnp.array([0, -1, 2], jnp.int32)
    want = np.stack([values[1], np.zeros_like(values[0]), values[0]])

    eager = cache.write(1, "state", slots, values).read(1, "state", read_slots)
    assert eager.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(bits(eager), bits(want))

    round_trip = jax.jit(lambda c, s, v, r: c.write(1, "state", s, v).read(1, "state", r))
    np.testing.assert_array_equal(bits(round_trip(cache, slots, values, read_slots)),
                                  bits(want))


def test_64_bit_state_needs_x64(rng):
  cache = StateCache.create(StateSpec({"state": ((2,), np.float64)}), 1, 2)
  with pytest.raises(ValueError, match="state 'state' is float64, which needs jax_enable_x64"):
    cache.read(0, "state", jnp.array([0]))


def test_write_one_state_leaves_every_other_byte(rng):
  """Two states in one page: writing one keeps the other's bytes (and the padding, other
  slots and other layers) exactly."""
  spec = StateSpec(MIXED, page_bytes=256)
  cache = random_cache(rng, spec, num_layers=3, num_slots=5)
  before = np.asarray(cache.pages)
  conv = random_values(rng, (2, 3, 5), jnp.bfloat16)
  after = np.asarray(cache.write(1, "conv", jnp.array([4, 2]), conv).pages)
  start, stop = spec.offset("conv"), spec.offset("conv") + spec.nbytes("conv")
  changed = np.zeros(before.shape, bool)
  changed[1, [4, 2], start:stop] = True
  np.testing.assert_array_equal(after[~changed], before[~changed])
  np.testing.assert_array_equal(after[1, [4, 2], start:stop], conv.reshape(2, -1).view(np.uint8))


def test_byte_layout_matches_numpy_model(rng):
  """A run of write / write_all / reset against a numpy model of the pages built with
  ``np.ndarray.view``: the same bytes after every op; read / read_all give the model's
  arrays."""
  spec = StateSpec(MIXED, page_bytes=160)
  assert spec.offsets == MIXED_OFFSETS                        # the model's byte ranges
  num_layers, num_slots = 3, 6
  cache = random_cache(rng, spec, num_layers, num_slots)
  model = np.array(cache.pages)
  for _ in range(12):
    layer = int(rng.integers(num_layers))
    slots = rng.choice(np.arange(-1, num_slots), size=3, replace=False).astype(np.int32)
    op = rng.integers(3)
    if op == 0:
      name = str(rng.choice(spec.names))
      values = random_values(rng, (3, *spec.shape(name)), spec.dtype(name))
      cache = cache.write(layer, name, slots, values)
      model_write(model, spec, layer, slots, name, values)
    elif op == 1:
      states = random_states(rng, spec, 3)
      cache = cache.write_all(layer, slots, states)
      for name, values in states.items():
        model_write(model, spec, layer, slots, name, values)
    else:
      cache = cache.reset(slots)
      model[:, slots[slots >= 0]] = 0
    np.testing.assert_array_equal(np.asarray(cache.pages), model)
  slots = np.array([5, -1, 0, 3], np.int32)
  for layer in range(num_layers):
    states = cache.read_all(layer, slots)
    assert list(states) == list(spec.names)
    for name in spec.names:
      want = [model_read(model, spec, layer, name, s) if s >= 0
              else np.zeros(spec.shape(name), spec.dtype(name)) for s in slots]
      np.testing.assert_array_equal(bits(states[name]), bits(np.stack(want)))
      np.testing.assert_array_equal(bits(cache.read(layer, name, slots)), bits(np.stack(want)))


def test_padding_and_out_of_range_dropped_under_jit(rng):
  spec = StateSpec(MIXED)
  cache = random_cache(rng, spec, num_layers=2, num_slots=4)
  before = np.asarray(cache.pages)
  slots = jnp.array([-1, 1, 4, 11, -7], jnp.int32)          # only slot 1 is a real slot
  ssm = random_values(rng, (5, 2, 3, 4), jnp.float32)
  write = jax.jit(lambda c, layer, s, v: c.write(layer, "ssm", s, v))
  read = jax.jit(lambda c, layer, s: c.read(layer, "ssm", s))

  after = write(cache, 0, slots, ssm)
  want = before.copy()
  model_write(want, spec, 0, [1], "ssm", ssm[1:2])
  np.testing.assert_array_equal(np.asarray(after.pages), want)
  got = read(after, 0, slots)
  np.testing.assert_array_equal(bits(got[1]), bits(ssm[1]))
  assert not bits(got)[[0, 2, 3, 4]].any()

  for layer in (-1, 2, 9):                                    # traced layers out of range
    layer = jnp.int32(layer)
    np.testing.assert_array_equal(np.asarray(write(cache, layer, slots, ssm).pages), before)
    assert not bits(read(cache, layer, slots)).any()
  reset = jax.jit(lambda c, s: c.reset(s))(cache, jnp.array([-1, 3, 4], jnp.int32))
  want = before.copy()
  want[:, 3] = 0
  np.testing.assert_array_equal(np.asarray(reset.pages), want)
  no_slots = jnp.zeros((0,), jnp.int32)                      # an empty batch
  assert read(cache, 1, no_slots).shape == (0, 2, 3, 4)
  np.testing.assert_array_equal(
      np.asarray(write(cache, 1, no_slots, np.zeros((0, 2, 3, 4), np.float32)).pages), before)


def test_traced_layer_index(rng):
  """A traced layer reads and writes the layer an int would, in a jit and a fori_loop.

  (float32 values: XLA:CPU holds a bf16 array that a loop body reads as float32, which
  canonicalizes NaN payloads before they reach the cache.)
  """
  spec = StateSpec(MIXED)
  cache = random_cache(rng, spec, num_layers=3, num_slots=4)
  slots = jnp.array([3, 0], jnp.int32)
  ssm = random_values(rng, (3, 2, 2, 3, 4), jnp.float32)
  write = jax.jit(lambda c, layer, v: c.write(layer, "ssm", slots, v))
  read = jax.jit(lambda c, layer: c.read(layer, "ssm", slots))
  for layer in range(3):
    traced = write(cache, jnp.int32(layer), ssm[layer])
    eager = cache.write(layer, "ssm", slots, ssm[layer])
    np.testing.assert_array_equal(np.asarray(traced.pages), np.asarray(eager.pages))
    np.testing.assert_array_equal(bits(read(traced, jnp.int32(layer))), bits(ssm[layer]))

  def all_layers(cache, ssm):
    def body(layer, cache):
      return cache.write(layer, "ssm", slots, ssm[layer])
    cache = jax.lax.fori_loop(0, cache.num_layers, body, cache)
    return jax.vmap(lambda layer: cache.read(layer, "ssm", slots))(jnp.arange(3))

  np.testing.assert_array_equal(bits(jax.jit(all_layers)(cache, ssm)), bits(ssm))


def mamba_like_step(cache, slots, resets, x, u):
  """One decode step of a toy recurrent model, exact in bf16 / float32 for small integers:
  requests ``resets`` start (states zeroed), then every layer shifts ``x[layer]`` into its
  conv state and updates its SSM state."""
  cache = cache.reset(resets)

  def layer_body(layer, cache):
    states = cache.read_all(layer, slots)
    conv = jnp.concatenate([states["conv"][:, 1:], x[layer][:, None]], axis=1)
    feed = conv[:, 0, 0].astype(jnp.float32)[:, None, None, None]
    ssm = states["ssm"] * 0.5 + u[layer] + feed
    count = states["count"] + 1
    return cache.write_all(layer, slots, {"flag": states["flag"], "conv": conv, "ssm": ssm,
                                          "count": count})
  return jax.lax.fori_loop(0, cache.num_layers, layer_body, cache)


def mamba_like_reference(states, slots, resets, x, u):
  """The numpy twin of :func:`mamba_like_step`, on {name: [L, S, *shape]} arrays."""
  for name in states:
    states[name][:, resets[resets >= 0]] = 0
  for layer in range(states["conv"].shape[0]):
    for row, slot in enumerate(slots):
      if slot < 0:
        continue
      conv = np.concatenate([states["conv"][layer, slot, 1:], x[layer, row][None]])
      states["conv"][layer, slot] = conv
      states["ssm"][layer, slot] = (states["ssm"][layer, slot] * 0.5 + u[layer, row]
                                    + np.float32(conv[0, 0]))
      states["count"][layer, slot] += 1


@pytest.mark.parametrize("loop", ["scan", "while_loop"])
def test_decode_loop_with_donation(loop, rng):
  """A jitted decode loop (scan or while_loop over steps, fori_loop over layers) with the
  cache donated: the input's buffer is consumed, the states match a numpy reference."""
  spec = StateSpec(MIXED)
  num_layers, num_slots, batch, steps = 3, 6, 4, 5
  cache = StateCache.create(spec, num_layers, num_slots)
  every_slot = jnp.arange(num_slots, dtype=jnp.int32)
  start = {name: rng.integers(-8, 8, size=(num_layers, num_slots, *spec.shape(name)))
           .astype(spec.dtype(name)) for name in spec.names}
  for layer in range(num_layers):
    cache = cache.write_all(layer, every_slot, {n: v[layer] for n, v in start.items()})
  slots = np.stack([rng.permutation(num_slots)[:batch] for _ in range(steps)]).astype(np.int32)
  slots[rng.random(slots.shape) < 0.2] = -1                  # padding rows
  resets = np.full((steps, 2), -1, np.int32)
  resets[2, 0] = rng.integers(num_slots)                     # a new request in a used slot
  x = rng.integers(-8, 8, size=(steps, num_layers, batch, 5)).astype(jnp.bfloat16)
  u = rng.integers(-8, 8, size=(steps, num_layers, batch, 2, 3, 4)).astype(np.float32)
  inputs = tuple(jnp.asarray(a) for a in (slots, resets, x, u))

  if loop == "scan":
    def run(cache, inputs):
      return jax.lax.scan(lambda c, xs: (mamba_like_step(c, *xs), None), cache, inputs)[0]
  else:
    def run(cache, inputs):
      def body(carry):
        t, cache = carry
        return t + 1, mamba_like_step(cache, *(a[t] for a in inputs))
      return jax.lax.while_loop(lambda carry: carry[0] < steps, body, (0, cache))[1]
  donated = cache
  cache = jax.jit(run, donate_argnums=0)(donated, inputs)
  assert donated.pages.is_deleted()

  want = {name: np.array(value) for name, value in start.items()}
  for t in range(steps):
    mamba_like_reference(want, slots[t], resets[t], x[t], u[t])
  for layer in range(num_layers):
    got = cache.read_all(layer, every_slot)
    for name in spec.names:
      np.testing.assert_array_equal(bits(got[name]), bits(want[name][layer]), err_msg=name)


def test_donated_write_does_not_copy_the_pages(rng):
  """The compiled, donated write aliases the pages: no page-sized temporary."""
  spec = StateSpec(MIXED, page_bytes=1024)
  cache = random_cache(rng, spec, num_layers=4, num_slots=64)
  slots = jnp.array([5, 17, -1], jnp.int32)
  states = random_states(rng, spec, 3)
  write = jax.jit(lambda c, layer, s, v: c.write_all(layer, s, v), donate_argnums=0)
  compiled = write.lower(cache, jnp.int32(2), slots, states).compile()
  memory = compiled.memory_analysis()
  if memory is not None:
    assert memory.temp_size_in_bytes < cache.pages.nbytes // 4, memory
  hlo = compiled.as_text()
  assert "input_output_alias" in hlo or "may-alias" in hlo or "must-alias" in hlo


def test_bad_inputs_raise(rng):
  spec = StateSpec(MIXED)
  cache = random_cache(rng, spec, num_layers=2, num_slots=4)
  slots = jnp.array([0, 3], jnp.int32)
  conv = random_values(rng, (2, 3, 5), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"layer must be in \[0, 2\), got 2"):
    cache.read(2, "conv", slots)
  with pytest.raises(ValueError, match=r"layer must be in \[0, 2\), got -1"):
    cache.write(-1, "conv", slots, conv)
  with pytest.raises(TypeError, match="layer must be an integer array, got dtype float32"):
    cache.read(1.0, "conv", slots)
  with pytest.raises(ValueError, match=r"layer must be 0-D integer, got shape \(2,\)"):
    cache.read(jnp.array([0, 1]), "conv", slots)
  with pytest.raises(ValueError, match=r"slots\[1\] = 4 is out of range: the state cache has "
                                       r"4 slots"):
    cache.write(0, "conv", jnp.array([0, 4]), conv)
  with pytest.raises(ValueError, match=r"slots\[0\] = 9 is out of range"):
    cache.reset(jnp.array([9]))
  with pytest.raises(ValueError, match=r"slots\[0\] = 9 is out of range"):
    cache.read_all(0, np.array([9, 0]))
  with pytest.raises(ValueError, match="does not fit in int32"):
    cache.read(0, "conv", np.array([2**40]))
  with pytest.raises(ValueError, match=r"slots must be 1-D \[n\], got shape \(2, 1\)"):
    cache.read(0, "conv", jnp.zeros((2, 1), jnp.int32))
  with pytest.raises(TypeError, match="slots must be an integer array, got dtype float32"):
    cache.read(0, "conv", jnp.array([0.0, 1.0]))
  with pytest.raises(ValueError, match=r"values for state 'conv' must have shape \(2, 3, 5\), "
                                       r"got \(2, 5, 3\)"):
    cache.write(0, "conv", slots, conv.reshape(2, 5, 3))
  with pytest.raises(TypeError, match="values for state 'conv' must be an array of dtype "
                                      "bfloat16, got float32"):
    cache.write(0, "conv", slots, conv.astype(np.float32))
  with pytest.raises(TypeError, match="values for state 'conv' must be an array of dtype "
                                      "bfloat16, got list"):
    cache.write(0, "conv", slots, conv.tolist())
  with pytest.raises(ValueError, match="name must be one of .* got 'cnov'"):
    cache.read(0, "cnov", slots)
  states = random_states(rng, spec, 2)
  with pytest.raises(ValueError, match=r"values must have the keys \('flag', 'conv', 'ssm', "
                                       r"'count'\), got \('flag', 'conv', 'ssm'\)"):
    cache.write_all(0, slots, {n: states[n] for n in ("flag", "conv", "ssm")})
  with pytest.raises(TypeError, match=r"values\['ssm'\] must be an array of dtype float32, "
                                      r"got bfloat16"):
    cache.write_all(0, slots, {**states, "ssm": states["ssm"].astype(jnp.bfloat16)})
  with pytest.raises(ValueError, match=r"values\['count'\] must have shape \(2,\)"):
    cache.write_all(0, slots, {**states, "count": states["count"][:1]})
  # Shapes and dtypes are checked at trace time too.
  with pytest.raises(TypeError, match="values for state 'conv' must be an array of dtype"):
    jax.jit(lambda c, v: c.write(0, "conv", slots, v))(cache, conv.astype(np.float32))
