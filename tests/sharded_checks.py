"""Checks of :mod:`jkv.sharding` on 8 CPU devices, run by ``tests/test_sharding.py`` in a
fresh process (XLA reads the device count before JAX starts; pytest's JAX already has).

Usage: ``PYTHONPATH=. python tests/sharded_checks.py GROUP [GROUP ...]`` (groups: the keys
of ``GROUPS``). Prints ``ok GROUP/CHECK SECONDS`` per passing check and ``FAIL GROUP/CHECK``
with the traceback per failing one; exits 1 if any failed. ``--list`` prints every
``GROUP/CHECK`` (pytest makes a test of each).
"""

from __future__ import annotations

import os
import sys

# JKV_SHARDED_MESH="DPxTP" (e.g. "2x1", "1x2") runs the checks on the machine's own devices
# (GPUs: the kernel checks compile the Pallas kernels); default: 8 CPU devices as 2x4.
GPU_MESH = os.environ.get("JKV_SHARDED_MESH", "")
MESH_SHAPE = tuple(int(n) for n in GPU_MESH.split("x")) if GPU_MESH else (2, 4)
DEVICES = MESH_SHAPE[0] * MESH_SHAPE[1]
KERNEL = "pallas" if GPU_MESH else "interpret"
if not GPU_MESH:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={DEVICES}")
  os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jkv  # noqa: E402
from conftest import assert_same, bits, random_slots  # noqa: E402
from jkv import partitioning, sharded_ops, sharded_pools, sharding  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, LAYERS = 8, 16, 4, 32, 2
TOKENS = 24   # key / value rows of a checked write
# (layout, kv_layout, create keywords) of the checked caches.
BF16 = {"kv_cache_dtype": "auto"}
FP8_PER_HEAD = {"kv_cache_dtype": "fp8", "k_scale": "per_head", "v_scale": "per_head"}
CASES = {
    "flash-bf16": ("flash", "NHD", BF16),
    "flash-fp8": ("flash", "NHD", FP8_PER_HEAD),
    "vllm-bf16": ("vllm", "NHD", BF16),
    "vllm-fp8": ("vllm", "NHD", {"kv_cache_dtype": "fp8", "k_scale": 0.5, "v_scale": 2.0}),
    "packed-bf16": ("packed", "NHD", BF16),
    "packed-fp8": ("packed", "NHD", FP8_PER_HEAD),
    "packed-hnd-bf16": ("packed", "HND", BF16),
    "asm-fp8": ("asm", "NHD", FP8_PER_HEAD),
    "hnd-bf16": ("hnd", "NHD", BF16),
    "token-int8-flash": ("flash", "NHD", {"quant": "token", "kv_cache_dtype": "int8"}),
    "token-fp8-vllm": ("vllm", "NHD", {"quant": "token", "kv_cache_dtype": "fp8"}),
    "block-fp8-asm": ("asm", "NHD", {"quant": "block", "kv_cache_dtype": "fp8"}),
    "block32-int8-hnd": ("hnd", "NHD", {"quant": "block", "kv_cache_dtype": "int8",
                                        "scale_block_tokens": 32}),
    "max-bf16": ("max", "NHD", BF16),   # Mojo MAX's collection [nb, 2, L, bs, H, D]
    "max-fp8": ("max", "NHD", FP8_PER_HEAD),
    "max-token-fp8": ("max", "NHD", {"quant": "token", "kv_cache_dtype": "fp8",   # 2 groups
                                     "quantization_granularity": 16}),
    "mxfp4": ("hnd", "NHD", {"quant": "mxfp4"}),
    "nvfp4": ("hnd", "NHD", {"quant": "nvfp4", "k_global_scale": 0.02,
                             "v_global_scale": 0.03}),
}


def mesh_of(shape, names, axis_types=None):
  return jax.make_mesh(shape, names, axis_types=axis_types or (AxisType.Auto,) * len(shape))


def create(case, num_heads=HEADS):
  layout, kv_layout, options = CASES[case]
  options = dict(options)
  for name in ("k_scale", "v_scale"):
    if options.get(name) == "per_head":
      options[name] = jnp.linspace(0.25, 2.0, num_heads, dtype=jnp.float32)
  return jkv.PagedKVCache.create(NUM_BLOCKS, BLOCK_SIZE, num_heads, HEAD_SIZE,
                                 num_layers=LAYERS, layout=layout, kv_layout=kv_layout,
                                 dtype=jnp.bfloat16, **options)


def tokens(rng, count, num_heads=HEADS):
  """key, value [count, H, D] bf16 (some large values: FP8 saturation is exercised)."""
  return [jnp.asarray(rng.standard_normal((count, num_heads, HEAD_SIZE)) * 3, jnp.bfloat16)
          for _ in range(2)]


def sharded_slots(rng):
  """int32 [TOKENS - 2]: distinct slots over all blocks, two of them padding (the key is
  longer: vLLM's CUDA-graph padding rows)."""
  return jnp.asarray(random_slots(rng, TOKENS - 2, NUM_BLOCKS * BLOCK_SIZE))


def random_like(rng, array) -> np.ndarray:
  """Random contents for a cache array: data of its dtype, positive scales."""
  dtype = np.dtype(array.dtype)
  if dtype.kind in "iu":
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, array.shape, endpoint=True).astype(dtype)
  if dtype == jnp.float8_e8m0fnu:   # mxfp4 scales: powers of two
    return (2.0 ** rng.integers(-3, 3, array.shape)).astype(dtype)
  if dtype == jnp.float32:          # token / block / global scales
    return rng.uniform(0.01, 0.1, array.shape).astype(dtype)
  return (rng.standard_normal(array.shape) * 3).astype(np.float32).astype(dtype)


def filled(case, rng, num_heads=HEADS):
  """(cache of numpy arrays with random contents, key, value, slots) of a case; a
  ``tensor`` cache keeps the scales it was created with. Host arrays go to the devices
  by a plain transfer, sharded or not (no resharding program to compile)."""
  cache = create(case, num_heads)
  keep = ("k_scale", "v_scale") if cache.quant == "tensor" else ()
  cache = jax.tree_util.tree_map_with_path(
      lambda path, a: np.asarray(a) if path[0].name in keep else random_like(rng, a), cache)
  return (cache, *tokens(rng, TOKENS, num_heads), sharded_slots(rng))


def unsharded_write(cache, key, value, slots, backend):
  return jax.jit(lambda c, layer, k, v, s: c.write(layer, k, v, s, backend=backend))(
      cache, 1, key, value, slots)


def sharded_write_and_hlo(mesh, dp_axis, backend, sharded, key, value, slots):
  """(result, compiled HLO text) of sharded_write of layer 1 under jit, the cache donated
  (``sharded`` is consumed) and key / value split over tp."""
  key, value = (jax.device_put(x, NamedSharding(mesh, P(None, "tp"))) for x in (key, value))
  write = jax.jit(lambda c, layer, k, v, s: sharded_ops.sharded_write(
      c, layer, k, v, s, mesh, dp_axis=dp_axis, backend=backend), donate_argnums=0)
  compiled = write.lower(sharded, 1, key, value, slots).compile()
  return compiled(sharded, 1, key, value, slots), compiled.as_text()


def check_sharded_result(got, want, hlo, cache, mesh, dp_axis, limit, case):
  """got == want bit for bit, with the cache's sharding; the compiled program moves no
  collective of ``limit`` bytes or more and aliases the donated cache to its output."""
  assert not cache_sized(hlo, limit), cache_sized(hlo, limit)
  assert "input_output_alias" in hlo, "the donated cache is not aliased to the output"
  assert_same(got, want, case)
  expected = sharding.cache_sharding(cache, mesh, dp_axis=dp_axis)
  for array, spec in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    assert array.sharding.is_equivalent_to(spec, array.ndim), (array.sharding, spec)


def check_write(case, backend, mesh, dp_axis, plain_jit=False):
  """The sharded write (sharded_write; ``plain_jit``: cache.write under a plain jit, which
  the kernels' custom_partitioning rule runs per shard) equals the unsharded one bit for
  bit, keeps the cache's sharding, moves no cache-sized data between devices and updates
  the donated cache in place."""
  rng = np.random.default_rng(sum(map(ord, case)) + (3 if plain_jit else 0))
  cache, key, value, slots = filled(case, rng)
  want = unsharded_write(cache, key, value, slots, backend)
  sharded = sharding.shard_cache(cache, mesh, dp_axis=dp_axis)
  limit = shard_bytes(sharded)
  if plain_jit:
    write = jax.jit(lambda c, layer, k, v, s: c.write(layer, k, v, s, backend=backend),
                    donate_argnums=0)
    compiled = write.lower(sharded, 1, key, value, slots).compile()
    got, hlo = compiled(sharded, 1, key, value, slots), compiled.as_text()
  else:
    got, hlo = sharded_write_and_hlo(mesh, dp_axis, backend, sharded, key, value, slots)
  check_sharded_result(got, want, hlo, cache, mesh, dp_axis, limit, case)


def write_checks(backend, cases, tp_only_cases):
  """A check per case on a (dp 2, tp 4) mesh with pages split over dp; for tp_only_cases
  also one with the cache replicated over dp (each dp replica writes every slot)."""
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  checks = {}
  for case in cases:
    checks[f"{case}-tp-dp"] = lambda case=case: check_write(case, backend, mesh, "dp")
    if case in tp_only_cases:
      checks[f"{case}-tp"] = lambda case=case: check_write(case, backend, mesh, None)
  return checks


# ---- collectives in compiled HLO ------------------------------------------------------

COLLECTIVE = re.compile(r"=\s*(.+?)\s+(all-gather|all-to-all|collective-permute|all-reduce|"
                        r"reduce-scatter)(-start)?\(")
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1,
            "f8e8m0fnu": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
            "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def collectives(hlo: str):
  """[(op, bytes, line)] of the cross-device collectives in compiled HLO text."""
  found = []
  for line in hlo.splitlines():
    match = COLLECTIVE.search(line)
    if match:
      shapes = re.findall(r"(\w+)\[([\d,]*)\]", match.group(1))
      size = sum(ITEMSIZE.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
                 for t, dims in shapes)
      found.append((match.group(2), size, line.strip()[:160]))
  return found


def shard_bytes(cache) -> int:
  """Bytes of one device's shard of the key (or packed) cache."""
  return cache.key_cache.addressable_shards[0].data.nbytes


def cache_sized(hlo: str, limit: int):
  """The collectives that move at least ``limit`` bytes."""
  return [c for c in collectives(hlo) if c[1] >= limit]


def check_detector():
  """cache_sized finds the all-gather of a cache that a program makes replicated."""
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  sharded = sharding.shard_cache(create("flash-bf16"), mesh, dp_axis="dp")
  gather = jax.jit(lambda c: jax.lax.with_sharding_constraint(
      c.key_cache * 1, NamedSharding(mesh, P())))
  hlo = gather.lower(sharded).compile().as_text()
  found = cache_sized(hlo, shard_bytes(sharded))
  assert found and all(op == "all-gather" for op, _, _ in found), collectives(hlo)


# ---- specs ----------------------------------------------------------------------------

def check_paged_specs():
  for case in CASES:
    cache = create(case)
    specs = sharding.cache_partition_spec(cache, tp_axis="tp", dp_axis="dp")
    is_spec = lambda x: isinstance(x, P)
    assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(cache), case
    assert type(specs) is type(cache) and specs.layout == cache.layout, case
    for path, array in jax.tree_util.tree_leaves_with_path(cache):
      name = path[0].name
      spec = getattr(specs, name)
      assert len(spec) == array.ndim, (case, name, spec, array.shape)
      heads_split = [d for d, e in enumerate(spec) if e == "tp"]
      blocks_split = [d for d, e in enumerate(spec) if e == "dp"]
      if name in ("key_cache", "value_cache"):
        assert len(heads_split) == 1 and array.shape[heads_split[0]] == HEADS, (case, name, spec)
        assert blocks_split == [cache.block_axis], (case, name, spec)
      elif name in ("k_scale", "v_scale") and cache.quant == "tensor":
        per_head = array.shape == (HEADS,)
        assert spec == (P("tp") if per_head else P(None)), (case, name, spec)
      elif name == "k_scale" and cache.layout == "max":   # scales [nb, 2, L, bs, H, G]
        assert tuple(spec) == ("dp", None, None, None, "tp", None), (case, name, spec)
        assert array.shape[4] == HEADS, (case, name, spec)
      elif name in ("k_scale", "v_scale"):
        assert tuple(spec) == (None, "dp", "tp") + (None,) * (array.ndim - 3), (case, name, spec)
        assert array.shape[2] == HEADS, (case, name, spec)
      else:   # nvfp4 global scales
        assert spec == P(None), (case, name, spec)
    abstract = jax.eval_shape(lambda: create(case))
    assert sharding.cache_partition_spec(abstract, dp_axis="dp") == specs, case


def check_shard_cache():
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  for case in ("vllm-fp8", "token-fp8-vllm", "block-fp8-asm", "nvfp4", "packed-hnd-bf16"):
    cache = filled(case, np.random.default_rng(1))[0]
    sharded = sharding.shard_cache(cache, mesh, dp_axis="dp")
    assert_same(sharded, cache, case)
    for array in jax.tree.leaves(sharded):
      local = array.sharding.shard_shape(array.shape)
      assert array.addressable_shards[0].data.shape == local, (case, array.shape, local)
    assert sharded.key_cache.sharding.shard_shape(sharded.key_cache.shape)[1] == NUM_BLOCKS // 2
  replicated = sharding.shard_cache(create("flash-bf16"), mesh, tp_axis=None)
  assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(replicated))


def check_other_caches():
  """ContiguousKVCache (batch over dp, heads over tp), StateCache (slots over dp) and
  PagePool (replicated): their ops under plain jit on sharded caches give the unsharded
  result and keep the sharding."""
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  rng = np.random.default_rng(2)
  contiguous = jkv.ContiguousKVCache.create(LAYERS, 32, HEADS, HEAD_SIZE, batch_size=4)
  contiguous = jax.tree_util.tree_map_with_path(
      lambda path, a: random_like(rng, a) if path[0].name == "keys" else np.asarray(a),
      contiguous.advance(jnp.array([5, 1, 9, 2])))
  specs = sharding.cache_partition_spec(contiguous, dp_axis="dp")
  assert specs.keys == P(None, "dp", None, "tp", None) and specs.position == P("dp"), specs
  new = jnp.asarray(rng.standard_normal((4, 3, HEADS, HEAD_SIZE)), jnp.bfloat16)
  update = jax.jit(lambda c, k: c.update(1, k, k, backend="reference").advance(3))
  got = update(sharding.shard_cache(contiguous, mesh, dp_axis="dp"), new)
  assert_same(got, update(contiguous, new), "ContiguousKVCache")
  assert got.keys.sharding.is_equivalent_to(NamedSharding(mesh, specs.keys), 5)

  spec = jkv.StateSpec({"conv": ((3, 8), jnp.bfloat16), "ssm": ((4, 8, 2), jnp.float32)})
  states = jkv.StateCache.create(spec, num_layers=LAYERS, num_slots=8)
  states = jax.tree.map(lambda a: random_like(rng, a), states)
  specs = sharding.cache_partition_spec(states, dp_axis="dp")
  assert specs.pages == P(None, "dp", None) and specs.spec == spec, specs
  ssm = jnp.asarray(rng.standard_normal((3, 4, 8, 2)), jnp.float32)
  write = jax.jit(lambda s: s.write(1, "ssm", jnp.array([6, 1, -1]), ssm))
  got = write(sharding.shard_cache(states, mesh, dp_axis="dp"))
  assert_same(got, write(states), "StateCache")
  assert got.pages.sharding.is_equivalent_to(NamedSharding(mesh, specs.pages), 3)

  pool = jkv.PagePool.create(num_pages=NUM_BLOCKS, page_size=BLOCK_SIZE, max_seqs=4,
                             max_pages_per_seq=4)
  specs = sharding.cache_partition_spec(pool, dp_axis="dp")
  assert all(s == P(*[None] * len(s)) for s in jax.tree.leaves(specs)), specs
  append = jax.jit(lambda p: p.append(jnp.array([0, 2]), jnp.array([20, 5])))
  assert_same(append(sharding.shard_cache(pool, mesh, dp_axis="dp")), append(pool), "PagePool")


def check_errors():
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  expectations = [
      (lambda: sharding.shard_cache(create("flash-bf16", num_heads=2), mesh),
       "repeat_kv_heads(cache, 2)"),
      (lambda: sharding.shard_cache(create("flash-bf16", num_heads=6), mesh),
       "must split evenly over the 4 devices of mesh axis 'tp'"),
      (lambda: sharding.shard_cache(create("flash-bf16"), mesh, tp_axis="model"),
       "mesh axis 'model' is not an axis of the mesh"),
      (lambda: sharding.shard_cache(create("flash-bf16"), mesh, dp_axis="tp"),
       "tp_axis and dp_axis must name different mesh axes"),
      (lambda: sharding.cache_partition_spec({"key": jnp.zeros(2)}),
       "cache must be one of"),
      (lambda: sharding.kv_head_repeats(3, 4), "must divide one another"),
      (lambda: sharded_ops.sharded_write(create("flash-bf16"), 1, *tokens(
          np.random.default_rng(0), 2, num_heads=2), jnp.array([0, 1]), mesh),
       "key must have the cache's 4 kv heads"),
      (lambda: sharded_ops.sharded_write(create("flash-bf16"), 1, *tokens(
          np.random.default_rng(0), 2), jnp.array([0, 999]), mesh),
       "slot_mapping[1] = 999 is out of range"),
      (lambda: sharded_ops.sharded_write(create("flash-bf16"), 2, *tokens(
          np.random.default_rng(0), 2), jnp.array([0, 1]), mesh), "layer must be in [0, 2)"),
  ]
  for call, message in expectations:
    try:
      call()
    except (ValueError, TypeError) as error:
      assert message in str(error), (message, str(error))
    else:
      raise AssertionError(f"no error; expected {message!r}")
  assert sharding.kv_head_repeats(8, 4) == 1 and sharding.kv_head_repeats(2, 8) == 4


# ---- localised slots, array-level writes, explicit meshes -----------------------------

def check_localize():
  slots = jnp.array([0, 63, 64, 127, -1, 200, 70], jnp.int32)
  assert partitioning.localize_slot_mapping(slots, 0, 64).tolist() == [0, 63, -1, -1, -1, -1, -1]
  assert partitioning.localize_slot_mapping(slots, 1, 64).tolist() == [-1, -1, 0, 63, -1, -1, 6]


def check_write_kv(case, stacked, backend):
  """jkv.write_kv of a case's raw arrays (one layer of them unless ``stacked``), pages over
  dp: bit-exact, no cache-sized collective."""
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  cache, key, value, slots = filled(case, np.random.default_rng(3))
  caches = tuple(c if stacked else c[1] for c in (cache.key_cache, cache.value_cache)
                 if c is not None)
  options = dict(layout=cache.layout, kv_layout=cache.kv_layout,
                 kv_cache_dtype=cache.kv_cache_dtype, k_scale=cache.k_scale,
                 v_scale=cache.v_scale, layer=1 if stacked else None, backend=backend)
  second = lambda c: c[1] if len(c) == 2 else None
  want = jax.jit(lambda c, k, v, s: jkv.write_kv(k, v, c[0], second(c), s, **options))(
      caches, key, value, slots)
  sharding_ = NamedSharding(mesh, sharding.kv_cache_partition_spec(
      cache.layout, cache.kv_layout, stacked=stacked, dp_axis="dp"))
  sharded = jax.device_put(caches, sharding_)
  limit = sharded[0].addressable_shards[0].data.nbytes
  write = jax.jit(lambda c, k, v, s: sharded_ops.sharded_write_kv(
      k, v, c[0], second(c), s, mesh, dp_axis="dp", **options), donate_argnums=0)
  compiled = write.lower(sharded, key, value, slots).compile()
  hlo = compiled.as_text()
  assert not cache_sized(hlo, limit), cache_sized(hlo, limit)
  assert "input_output_alias" in hlo, "the donated caches are not aliased to the outputs"
  got = compiled(sharded, key, value, slots)
  assert_same(got, want, f"write_kv {case}")
  for array in got:
    assert array.sharding.is_equivalent_to(sharding_, array.ndim), array.sharding


def check_explicit_mesh():
  """A mesh of Explicit axes (jax.make_mesh's default), under jax.set_mesh."""
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"), (AxisType.Explicit, AxisType.Explicit))
  cache, key, value, slots = filled("flash-fp8", np.random.default_rng(4))
  want = unsharded_write(cache, key, value, slots, "reference")
  with jax.set_mesh(mesh):
    sharded = sharding.shard_cache(cache, mesh, dp_axis="dp")
    limit = shard_bytes(sharded)
    got, hlo = sharded_write_and_hlo(mesh, "dp", "reference", sharded, key, value, slots)
    assert not cache_sized(hlo, limit), cache_sized(hlo, limit)
  assert_same(got, want, "explicit mesh")


def check_eager():
  """An eager call (numpy int64 slots) equals the unsharded write."""
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  cache, key, value, slots = filled("packed-fp8", np.random.default_rng(8))
  want = unsharded_write(cache, key, value, slots, "reference")
  got = sharded_ops.sharded_write(sharding.shard_cache(cache, mesh, dp_axis="dp"), 1, key, value,
                               np.asarray(slots, np.int64), mesh, dp_axis="dp",
                               backend="reference")
  assert_same(got, want, "eager")


# ---- repeated kv heads (tp > kv heads) -------------------------------------------------

def check_repeat(case, mesh_shape, names, dp_axis, backend):
  """2 kv heads on a tp of 8 (each repeated 4x) or 4 (2x): repeated head i of the sharded
  write holds exactly the bytes of head i // repeats of the unsharded, unrepeated write."""
  mesh = mesh_of(mesh_shape, names)
  tp, heads = mesh.shape["tp"], 2
  repeats = sharding.kv_head_repeats(heads, tp)
  cache, key, value, slots = filled(case, np.random.default_rng(7), num_heads=heads)
  want = unsharded_write(cache, key, value, slots, backend)
  repeated = jax.tree.map(np.asarray, sharding.repeat_kv_heads(cache, repeats))
  assert repeated.num_heads == tp
  got, _ = sharded_write_and_hlo(
      mesh, dp_axis, backend, sharding.shard_cache(repeated, mesh, dp_axis=dp_axis),
      sharding.repeat_kv_heads(key, repeats), sharding.repeat_kv_heads(value, repeats), slots)
  specs = sharding.cache_partition_spec(cache)
  for (path, array), spec in zip(jax.tree_util.tree_leaves_with_path(got),
                                 jax.tree.leaves(specs)):
    name = path[0].name
    original = np.asarray(getattr(want, name))
    if "tp" not in spec:   # per-tensor and global scales stay as they are
      assert (bits(array) == bits(original)).all(), (case, name)
      continue
    axis = list(spec).index("tp")
    assert array.shape[axis] == heads * repeats, (case, name, array.shape)
    for head in range(heads * repeats):
      copy = np.take(np.asarray(array), head, axis=axis)
      assert (bits(copy) == bits(np.take(original, head // repeats, axis=axis))).all(), \
          (case, name, head)


# ---- decode attention ------------------------------------------------------------------

BATCH, WIDTH, Q_HEADS = 4, 2, 8   # 4 sequences of up to 2 blocks, 2 query heads per kv head


def attention_inputs(rng, dp: int):
  """(query f32 [B, Hq, D], block_table [B, W], seq_lens [B]): with dp shards, sequence b
  reads pages of shard b // (B / dp) only (its own pool's pages)."""
  per_shard = NUM_BLOCKS // dp
  rows = []
  for shard in range(dp):
    blocks = shard * per_shard + rng.permutation(per_shard)
    rows.append(blocks[:BATCH // dp * WIDTH].reshape(BATCH // dp, WIDTH))
  table = np.concatenate(rows).astype(np.int32)
  lens = rng.integers(1, WIDTH * BLOCK_SIZE + 1, BATCH).astype(np.int32)
  query = rng.standard_normal((BATCH, Q_HEADS, HEAD_SIZE)).astype(np.float32)
  return jnp.asarray(query), jnp.asarray(table), jnp.asarray(lens)


def check_attend(case, backend, dp_axis, options=()):
  """sharded_attend on a (dp 2, tp 4) mesh equals the unsharded attend (float32 output,
  same math per head; only the context split may differ) and moves no cache-sized data."""
  options = dict(options)
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  rng = np.random.default_rng(sum(map(ord, case)) + 7)
  cache = filled(case, rng)[0]
  query, table, lens = attention_inputs(rng, 2 if dp_axis else 1)
  if options.pop("alibi", False):
    options["alibi_slopes"] = jnp.asarray(rng.uniform(-0.2, 0, Q_HEADS), jnp.float32)
  want = jax.jit(lambda c, q: c.attend(1, q, table, lens, backend=backend, **options))(
      cache, query)
  sharded = sharding.shard_cache(cache, mesh, dp_axis=dp_axis)
  query_spec = NamedSharding(mesh, P(dp_axis, "tp"))
  attend = jax.jit(lambda c, q: sharded_ops.sharded_attend(
      c, 1, q, table, lens, mesh, dp_axis=dp_axis, backend=backend, **options))
  compiled = attend.lower(sharded, jax.device_put(query, query_spec)).compile()
  assert not cache_sized(compiled.as_text(), shard_bytes(sharded))
  got = compiled(sharded, jax.device_put(query, query_spec))
  assert got.sharding.is_equivalent_to(query_spec, 3), got.sharding
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def check_plain_jit_attend(case, dp_axis, options=()):
  """cache.attend under a plain jit on a sharded cache (the kernel's custom_partitioning
  rule: heads over tp; with pages over dp each shard attends over its own pages and the
  softmax partials are combined across dp, so a sequence may read pages of every shard)
  equals the unsharded attend to float32 rounding and moves no cache-sized data."""
  options = dict(options)
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  rng = np.random.default_rng(sum(map(ord, case)) + 13)
  cache = filled(case, rng)[0]
  query, table, lens = attention_inputs(rng, 1)   # pages of every dp shard
  if options.pop("alibi", False):
    options["alibi_slopes"] = jnp.asarray(rng.uniform(-0.2, 0, Q_HEADS), jnp.float32)
  attend = lambda c, q, t, l: c.attend(1, q, t, l, backend=KERNEL, **options)
  want = jax.jit(attend)(cache, query, table, lens)
  sharded = sharding.shard_cache(cache, mesh, dp_axis=dp_axis)
  heads = NamedSharding(mesh, P(None, "tp"))   # the output stays split by heads
  compiled = jax.jit(attend, out_shardings=heads).lower(sharded, query, table, lens).compile()
  assert not cache_sized(compiled.as_text(), shard_bytes(sharded)), \
      cache_sized(compiled.as_text(), shard_bytes(sharded))
  got = compiled(sharded, query, table, lens)
  assert float(np.abs(np.asarray(want)).max()) > 0
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def check_decode(case, backend):
  """Three decode steps (write one token per sequence, then attend) on the sharded cache
  (pages and sequences over dp, heads over tp) equal the unsharded steps: the caches bit
  for bit, the attention outputs to float32 rounding."""
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  rng = np.random.default_rng(11)
  cache = create(case)
  query, table, lens = attention_inputs(rng, 2)
  lens = jnp.asarray(rng.integers(1, WIDTH * BLOCK_SIZE - 3, BATCH), jnp.int32)
  # a copy: shard_cache may keep a buffer that needs no move (donated below)
  sharded = sharding.shard_cache(jax.tree.map(jnp.copy, cache), mesh, dp_axis="dp")

  def step(cache, key, value, query, lens, on_mesh):
    slots = jkv.pages.decode_slot_mapping(table, lens, BLOCK_SIZE)
    if on_mesh:   # each dp shard's sequences write its own pages: split the rows
      cache = sharded_ops.sharded_write(cache, 0, key, value, slots, mesh, dp_axis="dp",
                                     split_tokens=True, backend=backend)
      out = sharded_ops.sharded_attend(cache, 0, query, table, lens + 1, mesh, dp_axis="dp",
                                    backend=backend)
    else:
      cache = cache.write(0, key, value, slots, backend=backend)
      out = cache.attend(0, query, table, lens + 1, backend=backend)
    return cache, out

  steps = [jax.jit(step, static_argnums=5, donate_argnums=0) for _ in range(2)]
  for t in range(3):
    key, value = tokens(rng, BATCH)
    query = jnp.asarray(rng.standard_normal((BATCH, Q_HEADS, HEAD_SIZE)), jnp.float32)
    cache, want = steps[0](cache, key, value, query, lens, False)
    sharded, got = steps[1](sharded, key, value, query, lens, True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    lens = lens + 1
  assert_same(jax.device_get(sharded), jax.device_get(cache), case)


def check_pool_decode(backend):
  """A decode loop in one jit (lax.scan, cache donated): one PagePool per dp shard hands
  out its shard's pages, every step appends a token per sequence, writes it with
  sharded_write(split_tokens=True) and attends with sharded_attend. Equals the same loop
  on the unsharded cache (caches bit for bit, outputs to float32 rounding); no page is
  held twice and no pool runs out."""
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  dp = MESH_SHAPE[0]
  seqs, pages_per_shard, steps = 2, 8, 20
  cache = jkv.PagedKVCache.create(dp * pages_per_shard, BLOCK_SIZE, HEADS, HEAD_SIZE,
                                  num_layers=1, layout="flash", dtype=jnp.bfloat16)
  pool = jkv.PagePool.create(pages_per_shard, BLOCK_SIZE, seqs, 2)
  rng = np.random.default_rng(5)
  keys = jnp.asarray(rng.standard_normal((steps, dp * seqs, HEADS, HEAD_SIZE)), jnp.bfloat16)
  queries = jnp.asarray(rng.standard_normal((steps, dp * seqs, Q_HEADS, HEAD_SIZE)),
                        jnp.float32)
  ids = jnp.tile(jnp.arange(seqs, dtype=jnp.int32), (dp, 1))

  def decode(cache, pools, on_mesh):
    def step(carry, inputs):
      cache, pools = carry
      key, query = inputs
      positions = pools.seq_lens
      pools, _ = sharded_pools.pools_append(pools, ids, jnp.ones_like(ids))
      slots = sharded_pools.pools_slot_mapping(pools, ids, positions)
      table, lens = sharded_pools.pools_block_table(pools)
      if on_mesh:
        cache = sharded_ops.sharded_write(cache, 0, key, key * 2, slots, mesh, dp_axis="dp",
                                       split_tokens=True, backend=backend)
        out = sharded_ops.sharded_attend(cache, 0, query, table, lens, mesh, dp_axis="dp",
                                      backend=backend)
      else:
        cache = cache.write(0, key, key * 2, slots, backend=backend)
        out = cache.attend(0, query, table, lens, backend=backend)
      return (cache, pools), out
    return jax.lax.scan(step, (cache, pools), (keys, queries))

  run = jax.jit(decode, static_argnums=2, donate_argnums=(0, 1))
  pools = sharded_pools.shard_pools(pool, mesh)
  (got_cache, got_pools), got = run(sharding.shard_cache(jax.tree.map(jnp.copy, cache), mesh,
                                                         dp_axis="dp"), pools, True)
  unsharded_pools = jax.tree.map(lambda x: jnp.broadcast_to(x, (dp,) + x.shape), pool)
  (want_cache, _), want = run(cache, unsharded_pools, False)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
  assert float(np.abs(np.asarray(want)).max()) > 0
  assert_same(jax.device_get(got_cache), jax.device_get(want_cache), "pool decode")
  assert not np.asarray(got_pools.out_of_pages).any()
  assert (np.asarray(got_pools.seq_lens) == steps).all()
  # the pools' global tables read back every sequence's keys in order
  table, lens = sharded_pools.pools_block_table(got_pools)
  gathered, _ = want_cache.gather(0, np.asarray(table), np.asarray(lens))
  assert (bits(gathered[:, :steps]) == bits(np.swapaxes(np.asarray(keys), 0, 1))).all()
  table = np.asarray(got_pools.block_table)
  for shard in range(dp):   # each shard's sequences hold distinct, non-null pages
    held = table[shard][table[shard] > 0]
    assert held.size == seqs * 2 and np.unique(held).size == held.size, table[shard]


# ---- kernel writes under plain jit -----------------------------------------------------

def check_plain_jit_write_kv():
  """jkv.write_kv (array level, stacked packed HND cache, per-head FP8 scales split over tp)
  under a plain jit: equals the unsharded write, no cache-sized collective."""
  rng = np.random.default_rng(4)
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  cache, key, value, slots = filled("packed-fp8", rng)
  spec = sharding.kv_cache_partition_spec("packed", "NHD", stacked=True, dp_axis="dp")
  kv = jax.device_put(cache.key_cache, NamedSharding(mesh, spec))
  scale = jax.device_put(cache.k_scale, NamedSharding(mesh, P("tp")))
  write = jax.jit(lambda c, k, v, s, sc: jkv.write_kv(
      k, v, c, None, s, layout="packed", kv_cache_dtype="fp8", k_scale=sc, v_scale=sc,
      layer=0, backend=KERNEL))
  compiled = write.lower(kv, key, value, slots, scale).compile()
  assert not cache_sized(compiled.as_text(), kv.addressable_shards[0].data.nbytes)
  got = compiled(kv, key, value, slots, scale)
  want = jax.jit(lambda c, k, v, s, sc: jkv.write_kv(
      k, v, c, None, s, layout="packed", kv_cache_dtype="fp8", k_scale=sc, v_scale=sc,
      layer=0, backend=KERNEL))(cache.key_cache, key, value, slots, cache.k_scale)
  assert_same(got, want, "write_kv packed fp8")


# ---- MLA and indexer caches -------------------------------------------------------------

RANK, PE = 24, 8   # a small MLA entry (the kernels pad dims to powers of two)


def mla_cache(rng, kv_cache_dtype="auto", num_heads=None):
  cache = jkv.MLACache.create(NUM_BLOCKS, BLOCK_SIZE, RANK, PE, num_layers=LAYERS,
                              num_heads=num_heads, dtype=jnp.float32,
                              kv_cache_dtype=kv_cache_dtype, scale=0.5)
  return jax.tree.map(lambda a: np.asarray(a) if a.dtype == np.float32 and a.ndim == 1
                      else random_like(rng, a), cache)


def check_mla_specs():
  """MLA, indexer and FP4 indexer caches: pages over dp, nothing over tp."""
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  rng = np.random.default_rng(6)
  caches = [mla_cache(rng), mla_cache(rng, "fp8_split", num_heads=2),
            jkv.IndexerKCache.create(NUM_BLOCKS, BLOCK_SIZE, 64, quant_block_size=32,
                                     num_layers=LAYERS),
            jkv.FP4IndexerCache.create(NUM_BLOCKS, BLOCK_SIZE, 32, num_layers=LAYERS)]
  for cache in caches:
    specs = sharding.cache_partition_spec(cache, dp_axis="dp")
    for path, array in jax.tree_util.tree_leaves_with_path(cache):
      spec = tuple(getattr(specs, path[0].name))
      want = (None,) * array.ndim if array.ndim == 1 else (None, "dp") + (None,) * (array.ndim - 2)
      assert spec == want, (type(cache).__name__, path[0].name, spec)
    sharded = sharding.shard_cache(cache, mesh, dp_axis="dp")
    assert_same(jax.device_get(sharded), jax.device_get(cache), type(cache).__name__)


def paged_step_results(step, cache, slots, limit_field):
  """(unsharded, sharded) results of ``step(cache, slots)`` under a plain jit, the second on
  the cache paged over dp (donated); asserts its program moves no collective as large as
  one device's shard of the ``limit_field`` array."""
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  want = jax.jit(step)(cache, slots)
  sharded = sharding.shard_cache(cache, mesh, dp_axis="dp")
  compiled = jax.jit(step, donate_argnums=0).lower(sharded, slots).compile()
  limit = getattr(sharded, limit_field).addressable_shards[0].data.nbytes
  assert not cache_sized(compiled.as_text(), limit), cache_sized(compiled.as_text(), limit)
  return want, compiled(sharded, slots)


def check_plain_jit_mla(kv_cache_dtype, num_heads):
  """MLACache.write (concat kernel), write_rope (fused RoPE kernel) and attend (MLA kernel,
  partials combined across page shards) under a plain jit on a cache paged over dp: equal
  to the unsharded calls (cache bit for bit, outputs to float32 rounding), no cache-sized
  collective."""
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  rng = np.random.default_rng(21 + (num_heads or 0))
  cache = mla_cache(rng, kv_cache_dtype, num_heads)
  heads = () if num_heads is None else (num_heads,)
  kv_c = jnp.asarray(rng.standard_normal((TOKENS,) + heads + (RANK,)), jnp.float32)
  k_pe = jnp.asarray(rng.standard_normal((TOKENS,) + heads + (PE,)), jnp.float32)
  q_nope = jnp.asarray(rng.standard_normal((TOKENS, 4, RANK)), jnp.float32)
  q_pe = jnp.asarray(rng.standard_normal((TOKENS, 4, PE)), jnp.float32)
  slots = jnp.asarray(rng.permutation(NUM_BLOCKS * BLOCK_SIZE)[:TOKENS].astype(np.int32))
  positions = jnp.asarray(rng.integers(0, 64, TOKENS).astype(np.int32))
  cos, sin = jkv.rope.rope_cache(64, PE)
  query, table, lens = attention_inputs(rng, 1)
  query = jnp.asarray(rng.standard_normal((BATCH, 4, RANK + PE)), jnp.float32)

  def step(cache, slots):
    cache = cache.write(1, kv_c, k_pe, slots, backend=KERNEL)
    q_out, cache = cache.write_rope(0, q_nope, q_pe, kv_c, k_pe, slots, positions, cos, sin,
                                    backend=KERNEL)
    return cache, q_out, cache.attend(1, query, table, lens, scale=0.2, backend=KERNEL)

  want, got = paged_step_results(step, cache, slots, "kv_cache")
  assert_same(jax.device_get(got[0]), jax.device_get(want[0]), f"mla {kv_cache_dtype}")
  assert_same(got[1], want[1], "q_out")
  assert float(np.abs(np.asarray(want[2])).max()) > 0
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=2e-5, atol=2e-5)
  spec = sharding.cache_sharding(cache, mesh, dp_axis="dp")
  assert got[0].kv_cache.sharding.is_equivalent_to(spec.kv_cache, 4 + len(heads))


def check_plain_jit_split():
  """MLACache "fp8_split" writes (the split kernel, with and without RoPE) and attention
  under a plain jit on a cache paged over dp: bit for bit the unsharded writes, attention to
  float32 rounding, no cache-sized collective."""
  rng = np.random.default_rng(41)
  cache = mla_cache(rng, "fp8_split", num_heads=2)
  kv_c = jnp.asarray(rng.standard_normal((TOKENS, 2, RANK)) * 5, jnp.float32)
  k_pe = jnp.asarray(rng.standard_normal((TOKENS, 2, PE)), jnp.float32)
  slots = jnp.asarray(rng.permutation(NUM_BLOCKS * BLOCK_SIZE)[:TOKENS].astype(np.int32))
  positions = jnp.asarray(rng.integers(0, 64, TOKENS).astype(np.int32))
  cos, sin = jkv.rope.rope_cache(64, PE)

  query = jnp.asarray(rng.standard_normal((BATCH, 4, RANK + PE)), jnp.float32)
  _, table, lens = attention_inputs(rng, 1)

  def step(cache, slots):
    cache = cache.write(0, kv_c, k_pe, slots, backend=KERNEL)
    cache = cache.write_split_rope(1, kv_c, k_pe, slots, positions, cos, sin, backend=KERNEL)
    return cache, cache.attend(1, query, table, lens, scale=0.2, backend=KERNEL)

  want, got = paged_step_results(step, cache, slots, "rope_cache")
  assert_same(jax.device_get(got[0]), jax.device_get(want[0]), "fp8_split")
  assert float(np.abs(np.asarray(want[1])).max()) > 0
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=2e-5, atol=2e-5)


def check_plain_jit_indexer():
  """IndexerKCache.write (kernel) under a plain jit on a cache paged over dp equals the
  unsharded write bit for bit, no cache-sized collective."""
  rng = np.random.default_rng(31)
  cache = jkv.IndexerKCache.create(NUM_BLOCKS, BLOCK_SIZE, 64, quant_block_size=32,
                                   num_layers=LAYERS)
  cache = jax.tree.map(lambda a: random_like(rng, a), cache)
  k = jnp.asarray(rng.standard_normal((TOKENS, 64)), jnp.float32)
  slots = sharded_slots(rng)[:TOKENS]
  write = lambda c, s: c.write(1, k[:s.shape[0]], s, backend=KERNEL)
  want, got = paged_step_results(write, cache, slots, "kv_cache")
  assert_same(jax.device_get(got), jax.device_get(want), "indexer")


def check_plain_jit_indexer_gather():
  """cp_gather_indexer_k_quant_cache (kernel) under a plain jit on an indexer cache paged
  over dp (each page shard gathers the rows of its blocks; rows are combined bit for bit,
  rows of no shard keep dst's random bytes): equals the unsharded gather, float32 and
  byte scales, no cache-sized collective."""
  rng = np.random.default_rng(37)
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  cache = jkv.IndexerKCache.create(NUM_BLOCKS, BLOCK_SIZE, 64, quant_block_size=32,
                                   num_layers=LAYERS)
  cache = jax.tree.map(lambda a: random_like(rng, a), cache)
  sharded = sharding.shard_cache(cache, mesh, dp_axis="dp")
  table = rng.permutation(NUM_BLOCKS)[:6].reshape(3, 2).astype(np.int32)
  table[1, 1] = -1
  cu_seq_lens = np.array([0, 20, 33, 50], np.int32)   # rows 50.. past the sequences
  limit = sharded.kv_cache.addressable_shards[0].data.nbytes
  for scale_dtype, scale_width in ((np.float32, 2), (np.uint8, 8)):
    dst_k = rng.integers(0, 256, (56, 64)).astype(np.uint8)
    dst_scale = rng.integers(0, 256, (56, 8)).astype(np.uint8).view(scale_dtype)
    assert dst_scale.shape[1] == scale_width
    gather = lambda c, k, s, t, cu: jkv.cp_gather_indexer_k_quant_cache(
        c.kv_cache, k, s, t, cu, layer=1, backend=KERNEL)
    want = jax.jit(gather)(cache, dst_k, dst_scale, table, cu_seq_lens)
    compiled = jax.jit(gather).lower(sharded, dst_k, dst_scale, table, cu_seq_lens).compile()
    hlo = compiled.as_text()
    assert not cache_sized(hlo, limit), cache_sized(hlo, limit)
    got = compiled(sharded, dst_k, dst_scale, table, cu_seq_lens)
    assert_same(jax.device_get(got), jax.device_get(want), f"indexer gather {scale_dtype}")
    assert not np.array_equal(np.asarray(want[0]), dst_k)   # something gathered


# ---- block copies and swaps --------------------------------------------------------------

def shard_pairs(rng, count, src_blocks, dst_blocks, dp):
  """int32 [count, 2] (src, dst) global pairs, each inside one dp page shard; duplicate
  destinations and skipped (-1) pairs included."""
  shard = rng.integers(0, dp, count)
  src = shard * (src_blocks // dp) + rng.integers(0, src_blocks // dp, count)
  dst = shard * (dst_blocks // dp) + rng.integers(0, dst_blocks // dp, count)
  pairs = np.stack([src, dst], axis=1).astype(np.int32)
  pairs[count // 2] = pairs[0][::-1] if src_blocks == dst_blocks else pairs[0]
  pairs[-1] = (shard[1] * (src_blocks // dp) + (pairs[1, 0] + 1) % (src_blocks // dp),
               pairs[1, 1])         # a later pair with the same destination wins
  pairs[2] = -1
  pairs[3, 0] = -1
  return pairs


def check_copy_blocks(case, backend, dp_axis):
  """sharded_copy_blocks equals cache.copy_blocks bit for bit, keeps the sharding, moves
  no cache-sized data between devices and aliases the donated cache."""
  rng = np.random.default_rng(sum(map(ord, case)) + 7)
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  dp = MESH_SHAPE[0] if dp_axis else 1
  cache = filled(case, rng)[0]
  pairs = shard_pairs(rng, 10, NUM_BLOCKS, NUM_BLOCKS, dp)
  want = jax.jit(lambda c, m: c.copy_blocks(m, backend=backend))(cache, pairs)
  sharded = sharding.shard_cache(cache, mesh, dp_axis=dp_axis)
  limit = shard_bytes(sharded)
  copy = jax.jit(lambda c, m: sharded_ops.sharded_copy_blocks(c, m, mesh, dp_axis=dp_axis,
                                                           backend=backend), donate_argnums=0)
  compiled = copy.lower(sharded, pairs).compile()
  hlo = compiled.as_text()
  got = compiled(sharded, pairs)
  check_sharded_result(got, want, hlo, cache, mesh, dp_axis, limit, case)


def check_plain_jit_copy(case, dp_axis):
  """cache.copy_blocks under a plain jit on a sharded cache (the copy kernels' partitioning
  rule runs them per page shard, pairs localised): equals the unsharded copy bit for bit,
  keeps the sharding, moves no cache-sized data and aliases the donated cache; eagerly, a
  pair across page shards raises."""
  rng = np.random.default_rng(sum(map(ord, case)) + 13)
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  dp = MESH_SHAPE[0] if dp_axis else 1
  cache = filled(case, rng)[0]
  pairs = shard_pairs(rng, 10, NUM_BLOCKS, NUM_BLOCKS, dp)
  copy = lambda c, m: c.copy_blocks(m, backend=KERNEL)
  want = jax.jit(copy)(cache, pairs)
  sharded = sharding.shard_cache(cache, mesh, dp_axis=dp_axis)
  limit = shard_bytes(sharded)
  if dp > 1:
    crossing = np.array([[0, NUM_BLOCKS - 1]], np.int32)
    try:
      sharded.copy_blocks(crossing, backend=KERNEL)
    except ValueError as error:
      assert "crosses data-parallel page shards" in str(error), error
    else:
      raise AssertionError("an eager pair across page shards was accepted")
  compiled = jax.jit(copy, donate_argnums=0).lower(sharded, pairs).compile()
  got = compiled(sharded, pairs)
  check_sharded_result(got, want, compiled.as_text(), cache, mesh, dp_axis, limit, case)


def check_plain_jit_swap(case):
  """jkv.swap_blocks of every block array under a plain jit, device cache -> 2x larger
  device cache, both paged over dp (per page shard through the partitioning rule): equals
  the unsharded swap bit for bit, moves no cache-sized data, aliases the donated dst and
  leaves src unchanged."""
  rng = np.random.default_rng(sum(map(ord, case)) + 17)
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  src = filled(case, rng)[0]
  names = src.block_array_names()
  dst = {n: random_like(rng, jnp.concatenate([getattr(src, n)] * 2, axis=1)) for n in names}
  src = {n: np.asarray(getattr(src, n)) for n in names}
  pairs = shard_pairs(rng, 10, NUM_BLOCKS, 2 * NUM_BLOCKS, MESH_SHAPE[0])
  swap = lambda s, d, m: {n: jkv.swap_blocks(s[n], d[n], m, block_axis=1, backend=KERNEL)
                          for n in names}
  want = jax.jit(swap)(src, dst, pairs)
  spec = lambda a: NamedSharding(mesh, P(None, "dp", *(None,) * (a.ndim - 2)))
  sharded_src, sharded_dst = ({n: jax.device_put(a, spec(a)) for n, a in x.items()}
                              for x in (src, dst))
  limit = min(a.addressable_shards[0].data.nbytes for a in sharded_dst.values())
  compiled = jax.jit(swap, donate_argnums=1).lower(sharded_src, sharded_dst, pairs).compile()
  hlo = compiled.as_text()
  assert not cache_sized(hlo, limit), cache_sized(hlo, limit)
  assert "input_output_alias" in hlo, "the donated dst is not aliased to the output"
  got = compiled(sharded_src, sharded_dst, pairs)
  assert_same(jax.device_get(got), jax.device_get(want), case)
  assert_same(jax.device_get(sharded_src), src, f"{case} src")
  for n, array in got.items():
    assert array.sharding.is_equivalent_to(spec(array), array.ndim), (n, array.sharding)


def check_swap_blocks(case, backend, memory_kind):
  """sharded_swap_blocks from a device cache into a 2x larger cache (``memory_kind``:
  device, or pinned_host for a host tier), pages over dp: equals jkv.swap_blocks of every
  block array; dst keeps its sharding and memory kind; src is unchanged."""
  rng = np.random.default_rng(sum(map(ord, case)) + 11)
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  dp = MESH_SHAPE[0]
  src = filled(case, rng)[0]
  big = jkv.PagedKVCache.create(2 * NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, num_layers=LAYERS,
                                layout=src.layout, kv_layout=src.kv_layout,
                                kv_cache_dtype=src.kv_cache_dtype, dtype=jnp.bfloat16,
                                quant=src.quant, scale_block_tokens=src.scale_block_tokens)
  dst = jax.tree_util.tree_map_with_path(
      lambda path, a: np.asarray(getattr(src, path[0].name)) if path[0].name not in
      src.block_array_names() else random_like(rng, a), big)
  pairs = shard_pairs(rng, 10, NUM_BLOCKS, 2 * NUM_BLOCKS, dp)
  names = src.block_array_names()
  want = dst.replace(**{n: jkv.swap_blocks(jnp.asarray(getattr(src, n)),
                                           jnp.asarray(getattr(dst, n)), pairs, block_axis=1,
                                           backend="reference") for n in names})
  sharded_src = sharding.shard_cache(src, mesh, dp_axis="dp")
  dst_sharding = jax.tree.map(lambda s: s.with_memory_kind(memory_kind),
                              sharding.cache_sharding(dst, mesh, dp_axis="dp"))
  sharded_dst = jax.device_put(dst, dst_sharding)
  swap = jax.jit(lambda s, d, m: sharded_ops.sharded_swap_blocks(s, d, m, mesh, dp_axis="dp",
                                                              backend=backend),
                 donate_argnums=1)
  got = swap(sharded_src, sharded_dst, pairs)
  assert_same(jax.device_get(got), jax.device_get(want), case)
  assert_same(jax.device_get(sharded_src), src, f"{case} src")
  for array, spec in zip(jax.tree.leaves(got), jax.tree.leaves(dst_sharding)):
    assert array.sharding.is_equivalent_to(spec, array.ndim), (array.sharding, spec)
    assert array.sharding.memory_kind == memory_kind, (array.sharding.memory_kind, memory_kind)


def check_block_errors():
  """Pairs across dp page shards: ValueError eagerly, skipped under jit."""
  mesh = mesh_of(MESH_SHAPE, ("dp", "tp"))
  cache = sharding.shard_cache(filled("flash-bf16", np.random.default_rng(2))[0], mesh,
                               dp_axis="dp")
  crossing = np.array([[1, 2], [0, NUM_BLOCKS // 2 + 1]], np.int32)
  if MESH_SHAPE[0] > 1:   # with one dp shard every pair stays inside it
    try:
      sharded_ops.sharded_copy_blocks(cache, crossing, mesh, dp_axis="dp", backend="reference")
    except ValueError as error:
      assert "block_mapping[1] = (0, 5) crosses data-parallel page shards" in str(error), error
    else:
      raise AssertionError("a pair across dp shards was accepted")
  try:
    sharded_ops.sharded_swap_blocks(cache, cache, np.array([[NUM_BLOCKS, 0]]), mesh, dp_axis="dp")
  except ValueError as error:
    assert "block_mapping[0, 0] = 8 is out of range: source has 8 blocks" in str(error), error
  else:
    raise AssertionError("an out-of-range pair was accepted")
  got = jax.jit(lambda c, m: sharded_ops.sharded_copy_blocks(c, m, mesh, dp_axis="dp",
                                                          backend="reference"))(cache, crossing)
  kept = crossing[:1] if MESH_SHAPE[0] > 1 else crossing
  want = jax.device_get(cache).copy_blocks(kept, backend="reference")
  assert_same(jax.device_get(got), want, "crossing pair skipped under jit")
  local = partitioning.localize_block_mapping(jnp.asarray(crossing), 1, NUM_BLOCKS // 2)
  assert np.asarray(local).tolist() == [[-1, -1], [-1, -1]], local
  local = partitioning.localize_block_mapping(jnp.asarray([[5, 6], [-1, 7]]), 1, 4)
  assert np.asarray(local).tolist() == [[1, 2], [-1, -1]], local


GROUPS = {
    "specs": lambda: {"paged": check_paged_specs, "mla": check_mla_specs,
                      "shard_cache": check_shard_cache,
                      "other_caches": check_other_caches, "errors": check_errors,
                      "localize": check_localize, "collective_detector": check_detector},
    "writes_reference": lambda: write_checks(
        "reference", ("flash-bf16", "flash-fp8", "vllm-fp8", "packed-fp8", "packed-hnd-bf16",
                      "asm-fp8", "token-fp8-vllm", "block32-int8-hnd", "mxfp4", "nvfp4"),
        ("flash-bf16",)),
    "writes_interpret": lambda: write_checks(
        KERNEL, ("flash-bf16", "flash-fp8", "vllm-bf16", "vllm-fp8", "packed-bf16",
                      "token-int8-flash", "max-fp8", "max-token-fp8"), ("flash-bf16",)),
    "write_kv": lambda: {
        "vllm-fp8-unstacked-reference": lambda: check_write_kv("vllm-fp8", False, "reference"),
        f"packed-hnd-stacked-{KERNEL}": lambda: check_write_kv("packed-hnd-bf16", True,
                                                               KERNEL),
        "explicit_mesh": check_explicit_mesh, "eager": check_eager},
    "attend": lambda: {
        "flash-bf16-tp-dp-reference": lambda: check_attend("flash-bf16", "reference", "dp"),
        f"flash-bf16-tp-{KERNEL}": lambda: check_attend("flash-bf16", KERNEL, None,
                                                        {"alibi": True}),
        f"vllm-fp8-tp-dp-{KERNEL}": lambda: check_attend("vllm-fp8", KERNEL, "dp"),
        f"packed-hnd-bf16-tp-dp-{KERNEL}": lambda: check_attend("packed-hnd-bf16",
                                                                KERNEL, "dp"),
        f"token-int8-flash-tp-dp-{KERNEL}": lambda: check_attend("token-int8-flash",
                                                                 KERNEL, "dp"),
        "nvfp4-tp-dp-reference": lambda: check_attend("nvfp4", "reference", "dp"),
        f"max-bf16-tp-dp-{KERNEL}": lambda: check_attend("max-bf16", KERNEL, "dp"),
        f"max-token-fp8-tp-dp-{KERNEL}": lambda: check_attend("max-token-fp8", KERNEL, "dp"),
        f"decode-flash-fp8-{KERNEL}": lambda: check_decode("flash-fp8", KERNEL),
        "pool-per-dp-shard-decode-reference": lambda: check_pool_decode("reference"),
        f"pool-per-dp-shard-decode-{KERNEL}": lambda: check_pool_decode(KERNEL)},
    "plain_jit": lambda: {
        **{f"copy-{case}-tp{'-dp' if dp_axis else ''}-{KERNEL}":
           lambda case=case, dp_axis=dp_axis: check_plain_jit_copy(case, dp_axis)
           for case, dp_axis in (("flash-bf16", "dp"), ("token-fp8-vllm", "dp"),
                                 ("packed-hnd-bf16", None), ("mxfp4", "dp"))},
        **{f"swap-{case}-dp-{KERNEL}": lambda case=case: check_plain_jit_swap(case)
           for case in ("vllm-fp8", "block-fp8-asm", "nvfp4")},
        **{f"{case}-tp-dp-{KERNEL}": lambda case=case: check_write(
            case, KERNEL, mesh_of(MESH_SHAPE, ("dp", "tp")), "dp", plain_jit=True)
           for case in ("flash-bf16", "vllm-fp8", "packed-hnd-bf16", "asm-fp8",
                        "token-int8-flash", "token-fp8-vllm", "block-fp8-asm",
                        "block32-int8-hnd")},
        f"flash-fp8-tp-{KERNEL}": lambda: check_write(
            "flash-fp8", KERNEL, mesh_of(MESH_SHAPE, ("dp", "tp")), None, plain_jit=True),
        f"write_kv-packed-fp8-{KERNEL}": check_plain_jit_write_kv,
        f"attend-flash-bf16-tp-dp-{KERNEL}": lambda: check_plain_jit_attend("flash-bf16", "dp"),
        f"attend-vllm-fp8-tp-dp-alibi-{KERNEL}": lambda: check_plain_jit_attend(
            "vllm-fp8", "dp", {"alibi": True}),
        f"attend-token-int8-flash-tp-dp-{KERNEL}": lambda: check_plain_jit_attend(
            "token-int8-flash", "dp", {"sliding_window": 20}),
        f"attend-block-fp8-asm-tp-dp-{KERNEL}": lambda: check_plain_jit_attend(
            "block-fp8-asm", "dp"),
        f"attend-packed-hnd-bf16-tp-{KERNEL}": lambda: check_plain_jit_attend(
            "packed-hnd-bf16", None, {"logits_soft_cap": 5.0}),
        f"mla-auto-{KERNEL}": lambda: check_plain_jit_mla("auto", None),
        f"mla-fp8-2-heads-{KERNEL}": lambda: check_plain_jit_mla("fp8", 2),
        f"mla-fp8-split-{KERNEL}": check_plain_jit_split,
        f"indexer-{KERNEL}": check_plain_jit_indexer,
        f"indexer-gather-{KERNEL}": check_plain_jit_indexer_gather},
    "blocks": lambda: {
        f"copy-flash-bf16-tp-dp-{KERNEL}": lambda: check_copy_blocks("flash-bf16", KERNEL, "dp"),
        f"copy-token-fp8-vllm-tp-dp-{KERNEL}": lambda: check_copy_blocks("token-fp8-vllm",
                                                                         KERNEL, "dp"),
        "copy-nvfp4-tp-dp-reference": lambda: check_copy_blocks("nvfp4", "reference", "dp"),
        f"copy-packed-hnd-bf16-tp-{KERNEL}": lambda: check_copy_blocks("packed-hnd-bf16",
                                                                       KERNEL, None),
        f"swap-vllm-fp8-device-{KERNEL}": lambda: check_swap_blocks("vllm-fp8", KERNEL,
                                                                    "device"),
        f"swap-token-int8-flash-host-{KERNEL}": lambda: check_swap_blocks(
            "token-int8-flash", KERNEL, "pinned_host"),
        "swap-block-fp8-asm-device-reference": lambda: check_swap_blocks(
            "block-fp8-asm", "reference", "device"),
        "swap-mxfp4-host-reference": lambda: check_swap_blocks("mxfp4", "reference",
                                                               "pinned_host"),
        "errors": check_block_errors},
    "checkpoint": lambda: {
        **{case: functools.partial(check_checkpoint_round_trip, case)
           for case in ("flash-bf16", "vllm-fp8", "token-int8-flash", "mxfp4")},
        "pool": check_checkpoint_pool, "errors": check_checkpoint_errors},
    "repeat": lambda: {
        f"flash-fp8-tp8-{KERNEL}": lambda: check_repeat("flash-fp8", (8,), ("tp",), None,
                                                        KERNEL),
        "token-int8-tp4-dp": lambda: check_repeat("token-int8-flash", (2, 4), ("dp", "tp"),
                                                  "dp", "reference"),
        "nvfp4-tp4-dp": lambda: check_repeat("nvfp4", (2, 4), ("dp", "tp"), "dp",
                                             "reference")},
}


def _checkpoint_dir():
  """A fresh checkpoint path in a temporary directory removed when the process exits."""
  import atexit
  import shutil
  import tempfile
  parent = tempfile.mkdtemp(prefix="jkv_ckpt_")
  atexit.register(shutil.rmtree, parent, ignore_errors=True)
  return os.path.join(parent, "ckpt")


def _on(cache, mesh):
  """``cache`` (numpy arrays) laid out on ``mesh`` (pages over dp, heads over tp), or on
  one device for mesh None."""
  if mesh is None:
    return jax.tree.map(lambda a: jax.device_put(a, jax.devices()[0]), cache)
  return jkv.shard_cache(jax.tree.map(jnp.asarray, cache), mesh, dp_axis="dp")


def check_checkpoint_round_trip(case):
  """save_sharded on a (dp 2, tp 4) mesh, load_sharded onto (dp 4, tp 2), (dp 8) and one
  device: the same bytes, on the template's shardings."""
  rng = np.random.default_rng(7)
  cache = filled(case, rng)[0]
  directory = _checkpoint_dir()
  jkv.save_sharded(directory, _on(cache, mesh_of((2, 4), ("dp", "tp"))))
  for target in (mesh_of((4, 2), ("dp", "tp")), mesh_of((8, 1), ("dp", "tp")), None):
    like = _on(jax.tree.map(np.zeros_like, cache), target)
    loaded = jkv.load_sharded(directory, like)
    for got, want, template in zip(jax.tree.leaves(loaded), jax.tree.leaves(cache),
                                   jax.tree.leaves(like)):
      assert got.sharding == template.sharding, (got.sharding, template.sharding)
      np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)))


def check_checkpoint_pool():
  """A prefix-caching PagePool (replicated) round-trips and still matches its prompt."""
  pool = jkv.PagePool.create(16, 4, 2, 4, prefix_caching=True)
  prompt = jnp.arange(9, dtype=jnp.int32)[None]
  pool, _ = pool.append([0], [9])
  pool = pool.cache_pages([0], prompt).free([0])
  mesh = mesh_of((2, 4), ("dp", "tp"))
  replicated = jax.device_put(pool, NamedSharding(mesh, P()))
  directory = _checkpoint_dir()
  jkv.save_sharded(directory, replicated)
  loaded = jkv.load_sharded(directory, replicated)
  for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(pool)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert int(loaded.match_prefix([1], prompt, [9])[1][0]) == 8


def check_checkpoint_errors():
  """Swapped array bytes fail their fingerprint; a template of another shape, class or
  static field is refused; an existing directory is kept unless overwrite=True."""
  import shutil
  rng = np.random.default_rng(8)
  mesh = mesh_of((2, 4), ("dp", "tp"))
  first, second = (_on(filled("flash-fp8", rng)[0], mesh) for _ in range(2))
  directory, other = _checkpoint_dir(), _checkpoint_dir()
  jkv.save_sharded(directory, first)
  jkv.save_sharded(other, second)
  for name, like, match in (
      ("shape", _on(create("flash-fp8", num_heads=8), mesh), "like has"),
      ("class", jkv.PagePool.create(8, 16, 2, 2), "holds a PagedKVCache"),
      ("static", _on(jax.tree.map(np.asarray, first).replace(layout="hnd"), mesh),
       "like has")):
    try:
      jkv.load_sharded(directory, like)
    except ValueError as error:
      assert match in str(error), (name, error)
    else:
      raise AssertionError(f"a template of another {name} was accepted")
  try:
    jkv.save_sharded(directory, first)
  except Exception:   # orbax refuses to replace a checkpoint
    pass
  else:
    raise AssertionError("save_sharded replaced a checkpoint without overwrite=True")
  jkv.save_sharded(directory, first, overwrite=True)
  shutil.rmtree(os.path.join(directory, "arrays"))
  shutil.copytree(os.path.join(other, "arrays"), os.path.join(directory, "arrays"))
  try:
    jkv.load_sharded(directory, first)
  except ValueError as error:
    assert "fingerprint" in str(error), error
  else:
    raise AssertionError("another checkpoint's array bytes were accepted")


def main(groups) -> int:
  assert jax.device_count() >= DEVICES, f"JAX sees {jax.device_count()} devices, not {DEVICES}"
  failed = 0
  for group in groups:
    for name, check in GROUPS[group]().items():
      start = time.perf_counter()
      try:
        check()
      except Exception:   # report every failing check, then fail the run
        failed += 1
        print(f"FAIL {group}/{name}\n{traceback.format_exc()}", flush=True)
      else:
        print(f"ok {group}/{name} {time.perf_counter() - start:.2f}", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  if sys.argv[1:] == ["--list"]:   # one GROUP/CHECK per line (tests/test_sharding.py)
    print("\n".join(f"{group}/{name}" for group, checks in GROUPS.items()
                    for name in checks()))
    sys.exit(0)
  unknown = set(sys.argv[1:]) - set(GROUPS)
  if not sys.argv[1:] or unknown:
    sys.exit(f"usage: sharded_checks.py --list | GROUP [GROUP ...]; groups: {', '.join(GROUPS)}")
  sys.exit(main(sys.argv[1:]))
