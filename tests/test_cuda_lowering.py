"""Every Pallas kernel lowers for a CUDA GPU, checked on any machine (CI has no GPU).

The CPU suite runs the kernels in Pallas' interpreter, which accepts operations the
Triton lowering rejects (slicing a vector, say). Here each op runs with
``backend="pallas"`` through ``jit(...).trace(...).lower(lowering_platforms=("cuda",))``:
Pallas lowers every kernel to Triton IR exactly as on a GPU, so a kernel that cannot
lower fails here, not on the device. Nothing is compiled or run; the GPU suite
(``JKV_BACKEND=pallas``) checks what the kernels compute. FP4 caches have no kernel
(tests/test_fp4.py checks that ``backend="pallas"`` raises for them).
"""

import contextlib
import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import jkv
from jkv import layout as layout_lib, quant
from jkv.cache import ContiguousKVCache, PagedKVCache
from jkv.mla_cache import MLACache
from pallas_kernels import lowering

KERNEL_CALL = "xla.gpu.triton"   # the custom call that carries a lowered Pallas kernel
# What each test below asserts it lowered (pallas_call names); the last test checks that
# together they name every kernel in pallas_kernels/.
WRITE_KERNELS = {"tensor": {"jkv_scatter_kv"}, "token": {"jkv_token_quant"},
                 "block": {"jkv_block_quant_requant", "jkv_block_quant_write"}}
# Scale blocks of several chunks (asm_pa 128 / 256): a program walks each block's chunks.
CHUNKED_BLOCK_KERNELS = {"jkv_block_quant_walk_write", "jkv_block_quant_requant"}
ATTENTION = {"jkv_paged_attention_decode"}
RAGGED = {"jkv_ragged_paged_attention"}
MLA_ENTRIES = {"auto": "jkv_mla_entries", "fp8": "jkv_mla_entries",
               "fp8_split": "jkv_mla_split", "fp8_ds_mla": "jkv_ds_mla_entries"}
FUSED_BMM = {"jkv_mla_fp8_bmm_rope_cache"}
INDEXER = ("jkv_indexer_k_quant_and_cache", "jkv_cp_gather_indexer_k_quant_cache")
BLOCKS = {"jkv_copy_blocks"}
SCATTER = {"jkv_scatter_kv"}
MOSAIC_CALL = "mosaic_gpu_v2"   # the custom call that carries a lowered Mosaic GPU kernel
MOSAIC = {"jkv_scatter_kv_mosaic"}
MOSAIC_ATTENTION = {"jkv_paged_attention_decode_mosaic"}
MOSAIC_FP8_ATTENTION = {"jkv_paged_attention_decode_fp8_mosaic"}   # FP8 caches' decode
MOSAIC_FP8_X_ATTENTION = {"jkv_paged_attention_decode_fp8_x_mosaic"}   # FP8 vllm / asm
MOSAIC_RAGGED = {"jkv_ragged_prefill_mosaic"}
MOSAIC_MLA = {"fp8_split": "jkv_mla_decode_fp8_split_mosaic",     # MLA decode
              "fp8_ds_mla": "jkv_mla_decode_fp8_ds_mla_mosaic"}


@pytest.fixture(autouse=True)
def triton_unless_asked(monkeypatch):
  """The kernels lower through Triton here whatever ``$JKV_LOWERING`` says (a GPU run of
  the suite under ``JKV_LOWERING=mosaic``); the Mosaic tests pass ``lowering="mosaic"``."""
  monkeypatch.setenv("JKV_LOWERING", "triton")


def gpu_target():
  """A context naming the GPU the lowering targets: jax >= 0.12 asks for one when no GPU is
  present (an abstract H100 on a one-device abstract mesh); earlier versions need none."""
  if not hasattr(jax.sharding, "AbstractDevice") or not hasattr(jax.sharding,
                                                                "use_abstract_mesh"):
    return contextlib.nullcontext()
  try:
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                         platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  except TypeError:   # an AbstractMesh without abstract devices (jax < 0.12)
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(mesh)


def kernels_lowered(fn, *args):
  """Lowers fn(*args) for CUDA; returns the set of names of the Pallas kernels in it."""
  with gpu_target():
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  names = re.findall(r'name = "(jkv_\w+)"', text)
  assert len(names) == text.count(KERNEL_CALL), "a kernel call without a jkv name"
  return set(names)


def bf16(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


TOKENS, HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 40, 4, 128, 16, 16

PAGED_CASES = [
    # layout, quant, kv_cache_dtype, other PagedKVCache.create keywords
    ("vllm", "tensor", "auto", {}), ("asm", "tensor", "fp8", {}),
    ("flash", "tensor", "fp8_e5m2", {}), ("hnd", "tensor", "auto", {}),
    ("packed", "tensor", "fp8", {}),
    ("vllm", "token", "int8", {}), ("asm", "token", "fp8_e4m3fnuz", {}),
    ("flash", "token", "fp8", {}),
    ("vllm", "block", "fp8", {}), ("asm", "block", "int8", {}),
    ("flash", "block", "int8", {}), ("asm", "block", "fp8", {"scale_block_tokens": 128}),
    # Mojo MAX's collection per token, with scale groups (quantization_granularity)
    ("max", "token", "int8", {}), ("max", "token", "fp8", {"quantization_granularity": 32}),
]


@pytest.mark.parametrize("layout,quant,kv_cache_dtype,options", PAGED_CASES)
def test_paged_write_and_attention_kernels_lower(layout, quant, kv_cache_dtype, options, rng):
  cache = PagedKVCache.create(NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE, num_layers=2, layout=layout,
                              kv_cache_dtype=kv_cache_dtype, quant=quant, **options)
  unit = options.get("scale_block_tokens")
  key, value = bf16(rng, TOKENS, HEADS, HEAD_SIZE), bf16(rng, TOKENS, HEADS, HEAD_SIZE)
  slots = jnp.asarray(rng.permutation(NUM_BLOCKS * BLOCK)[:TOKENS], jnp.int32)
  written = kernels_lowered(lambda c, k, v, s: c.write(1, k, v, s, backend="pallas"),
                            cache, key, value, slots)
  if unit is not None:
    assert written == CHUNKED_BLOCK_KERNELS
  elif quant == "block" and layout in ("flash", "hnd", "packed"):
    # 40 tokens into 16 blocks is decode-sized: scatter planes re-quantize in the write.
    assert written == {"jkv_block_quant_write"}
  else:
    assert written == WRITE_KERNELS[quant]
  query = bf16(rng, 3, 2 * HEADS, HEAD_SIZE)
  table = jnp.asarray(rng.permutation(NUM_BLOCKS)[:9].reshape(3, 3), jnp.int32)
  lens = jnp.asarray([0, 17, 48], jnp.int32)
  assert kernels_lowered(lambda c, q, t, n: c.attend(1, q, t, n, backend="pallas"),
                         cache, query, table, lens) == ATTENTION
  rows = bf16(rng, 20, 2 * HEADS, HEAD_SIZE)
  cu_q_lens = jnp.asarray([0, 0, 1, 17], jnp.int32)
  ragged = lambda c, q, t, n, cu: c.attend_ragged(1, q, t, n, cu, sinks=jnp.zeros(2 * HEADS),
                                                  sliding_window=40, backend="pallas")
  assert kernels_lowered(ragged, cache, rows, table, lens, cu_q_lens) == RAGGED


@pytest.mark.parametrize("layout,kv_cache_dtype", [("vllm", "fp8"), ("asm", "auto")])
def test_decode_read_variants_lower(layout, kv_cache_dtype, monkeypatch, rng):
  """The decode kernel's vLLM / ASM read variants (keys in x-vector chunks, values
  accumulated transposed; ``benchmarks/run.py --sweep`` times them) lower for CUDA."""
  from pallas_kernels import attention as attention_kernels
  monkeypatch.setattr(attention_kernels, "paged_attention_decode", functools.partial(
      attention_kernels.paged_attention_decode, key_chunk=16, transposed_values=True))
  cache = PagedKVCache.create(NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE, layout=layout,
                              kv_cache_dtype=kv_cache_dtype)
  query = bf16(rng, 3, 2 * HEADS, HEAD_SIZE)
  table = jnp.asarray(rng.permutation(NUM_BLOCKS)[:9].reshape(3, 3), jnp.int32)
  lens = jnp.asarray([0, 17, 48], jnp.int32)
  jax.clear_caches()
  try:
    assert kernels_lowered(lambda c, q, t, n: c.attend(0, q, t, n, backend="pallas"),
                           cache, query, table, lens) == ATTENTION
  finally:
    jax.clear_caches()


@pytest.mark.parametrize("layout,kv_layout", [("packed", "HND"),
                                              ("paged5d", "NHD"), ("paged5d", "HND")])
def test_other_write_layouts_lower(layout, kv_layout, rng):
  if layout == "paged5d":
    shape = (NUM_BLOCKS, 2) + ((BLOCK, HEADS) if kv_layout == "NHD" else (HEADS, BLOCK))
    caches = (jnp.zeros(shape + (HEAD_SIZE,), jnp.bfloat16), None)
  else:
    k_shape, v_shape = layout_lib.cache_shapes(layout, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE,
                                               jnp.bfloat16, kv_layout)
    caches = (jnp.zeros(k_shape, jnp.bfloat16),
              None if v_shape is None else jnp.zeros(v_shape, jnp.bfloat16))
  key = bf16(rng, TOKENS, HEADS, HEAD_SIZE)
  slots = jnp.asarray(rng.permutation(NUM_BLOCKS * BLOCK)[:TOKENS], jnp.int32)
  write = lambda k, kc, vc, s: jkv.write_kv(k, k, kc, vc, s, layout=layout, kv_layout=kv_layout,
                                            backend="pallas")
  assert kernels_lowered(write, key, *caches, slots) == SCATTER


@pytest.mark.parametrize("kv_cache_dtype,num_heads", [("auto", None), ("fp8", None),
                                                      ("auto", 2), ("fp8_split", None),
                                                      ("fp8_ds_mla", None)])
def test_mla_kernels_lower(kv_cache_dtype, num_heads, rng):
  rank, pe, query_heads = 512, 64, 16
  cache = MLACache.create(NUM_BLOCKS, BLOCK, rank, pe, num_layers=2, num_heads=num_heads,
                          kv_cache_dtype=kv_cache_dtype, scale=0.05)
  heads = () if num_heads is None else (num_heads,)
  kv_c, k_pe = bf16(rng, TOKENS, *heads, rank), bf16(rng, TOKENS, *heads, pe)
  slots = jnp.asarray(rng.permutation(NUM_BLOCKS * BLOCK)[:TOKENS], jnp.int32)
  entries = MLA_ENTRIES[kv_cache_dtype]
  assert kernels_lowered(lambda c, a, b, s: c.write(1, a, b, s, backend="pallas"),
                         cache, kv_c, k_pe, slots) == {entries}
  query = bf16(rng, 3, query_heads, rank + pe)
  table = jnp.asarray(rng.permutation(NUM_BLOCKS)[:9].reshape(3, 3), jnp.int32)
  lens = jnp.asarray([0, 17, 48], jnp.int32)
  assert kernels_lowered(lambda c, q, t, n: c.attend(1, q, t, n, scale=0.07, backend="pallas"),
                         cache, query, table, lens) == ATTENTION
  positions = jnp.arange(TOKENS, dtype=jnp.int32)
  cos = sin = jnp.asarray(rng.standard_normal((64, pe // 2)), jnp.float32)
  if kv_cache_dtype == "fp8_split":
    rope = lambda c, a, b, s: c.write_split_rope(1, a, b, s, positions, cos, sin,
                                                 backend="pallas")
    assert kernels_lowered(rope, cache, kv_c, k_pe, slots) == {entries}
  elif kv_cache_dtype in ("auto", "fp8"):
    q_nope, q_pe = bf16(rng, TOKENS, query_heads, rank), bf16(rng, TOKENS, query_heads, pe)
    rope = lambda c, a, b, s: c.write_rope(1, q_nope, q_pe, a, b, s, positions, cos, sin,
                                           backend="pallas")
    assert kernels_lowered(rope, cache, kv_c, k_pe, slots) == {entries}


def test_fused_fp8_bmm_rope_cache_lowers(rng):
  heads, batch, rank, nope, pe = 16, 8, 512, 128, 64
  q_nope = bf16(rng, heads, batch, nope)
  w_k = jnp.asarray(rng.standard_normal((heads, rank, nope)), jnp.float8_e4m3fn)
  kv_cache = jnp.zeros((NUM_BLOCKS * BLOCK, 1, rank + pe), jnp.bfloat16)
  cos = sin = jnp.asarray(rng.standard_normal((64, pe // 2)), jnp.float32)

  def op(q, w, cache):
    return jkv.fused_fp8_bmm_rope_cat_and_cache_mla(
        q, w, jnp.ones((1,), jnp.float32), bf16(rng, batch, heads, pe), bf16(rng, batch, 1, rank),
        bf16(rng, batch, 1, pe), cache, jnp.arange(batch, dtype=jnp.int32),
        jnp.arange(batch, dtype=jnp.int32), cos, sin, backend="pallas")

  assert kernels_lowered(op, q_nope, w_k, kv_cache) == FUSED_BMM


def test_indexer_kernels_lower(rng):
  head_dim = 128
  cache = jnp.zeros((NUM_BLOCKS, BLOCK, head_dim + 4), jnp.uint8)
  k = bf16(rng, TOKENS, head_dim)
  slots = jnp.asarray(rng.permutation(NUM_BLOCKS * BLOCK)[:TOKENS], jnp.int32)
  write = lambda k, c, s: jkv.indexer_k_quant_and_cache(k, c, s, backend="pallas")
  assert kernels_lowered(write, k, cache, slots) == {INDEXER[0]}
  table = jnp.asarray(rng.permutation(NUM_BLOCKS)[:9].reshape(3, 3), jnp.int32)
  cu_seq_lens = jnp.asarray([0, 10, 27, 40], jnp.int32)
  gather = lambda c, t, cu: jkv.cp_gather_indexer_k_quant_cache(
      c, jnp.zeros((TOKENS, head_dim), jnp.uint8), jnp.zeros((TOKENS, 1), jnp.float32), t, cu,
      backend="pallas")
  assert kernels_lowered(gather, cache, table, cu_seq_lens) == {INDEXER[1]}


def test_block_copy_and_swap_kernels_lower(rng):
  caches = [jnp.zeros((NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE), jnp.bfloat16) for _ in range(4)]
  pairs = jnp.asarray([[0, 3], [5, 1], [-1, -1]], jnp.int32)
  copy = lambda k, v, p: jkv.copy_blocks(k, v, p, backend="pallas")
  assert kernels_lowered(copy, caches[:2], caches[2:], pairs) == BLOCKS
  swap = lambda a, b, p: jkv.swap_blocks(a, b, p, backend="pallas")
  assert kernels_lowered(swap, caches[0], caches[1], pairs) == BLOCKS


def test_contiguous_update_lowers(rng):
  cache = ContiguousKVCache.create(2, 64, HEADS, HEAD_SIZE, batch_size=2)
  new = bf16(rng, 2, 5, HEADS, HEAD_SIZE)
  assert kernels_lowered(lambda c, k: c.update(1, k, k, backend="pallas"), cache,
                         new) == SCATTER


@pytest.mark.skipif(not lowering.mosaic_available(),
                    reason="the Mosaic GPU kernels need jax >= 0.11.2 (CI's newest-JAX pass)")
@pytest.mark.parametrize("layout,kv_layout,kv_cache_dtype", [
    ("flash", "NHD", "auto"), ("hnd", "NHD", "fp8"), ("packed", "NHD", "fp8_e5m2"),
    ("packed", "HND", "auto")])
def test_mosaic_write_lowers_in_place(layout, kv_layout, kv_cache_dtype, rng):
  """The Mosaic GPU write lowers for CUDA (Mosaic's own passes run here, its checks of
  copy sizes and layouts included), and its custom call aliases the caches, which the
  donating jit passes through: updated in place."""
  dtype = quant.fp8_dtype(kv_cache_dtype) or jnp.bfloat16
  k_shape, v_shape = layout_lib.cache_shapes(layout, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE, dtype,
                                             kv_layout)
  caches = [jnp.zeros(k_shape, dtype)] + ([] if v_shape is None else [jnp.zeros(v_shape, dtype)])
  key = bf16(rng, TOKENS, HEADS, HEAD_SIZE)
  slots = jnp.asarray(rng.permutation(NUM_BLOCKS * BLOCK)[:TOKENS], jnp.int32)

  def write(caches, k, s):
    return jkv.write_kv(k, k, caches[0], caches[1] if len(caches) > 1 else None, s,
                        layout=layout, kv_layout=kv_layout, kv_cache_dtype=kv_cache_dtype,
                        backend="pallas", lowering="mosaic")

  with gpu_target():
    text = jax.jit(write, donate_argnums=0).trace(caches, key, slots).lower(
        lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if MOSAIC_CALL in line]
  assert len(calls) == 1 and KERNEL_CALL not in text
  assert all(name.encode() in calls[0].encode() for name in MOSAIC)
  assert calls[0].count("stablehlo.output_operand_alias<") == len(caches)
  assert text.count("tf.aliasing_output") == len(caches)


@pytest.mark.skipif(not lowering.mosaic_available(),
                    reason="the Mosaic GPU kernels need jax >= 0.11.2 (CI's newest-JAX pass)")
@pytest.mark.parametrize("layout,kv_layout,kv_cache_dtype,block_size,group", [
    ("flash", "NHD", "auto", 16, 4), ("hnd", "NHD", "fp8", 128, 4),
    ("packed", "HND", "fp8_e5m2", 8, 4), ("hnd", "NHD", "fp8", 16, 32),
    ("vllm", "NHD", "fp8", 16, 4), ("asm", "NHD", "fp8_e5m2", 32, 4),
    ("asm", "NHD", "fp8", 128, 4), ("vllm", "NHD", "fp8", 16, 64)])
def test_mosaic_decode_attention_lowers(layout, kv_layout, kv_cache_dtype, block_size, group,
                                        rng):
  """The Mosaic GPU decode attention lowers for CUDA (its TMA boxes, wgmma operands and
  register layouts pass Mosaic's checks here), as one Mosaic custom call and no Triton:
  the FP8 kernel (the keys as wgmma's M) over FP8 caches, its vLLM / ASM variant over
  x-vectorized keys; FP8 groups of 32 and 64 query heads (output rows 128 and 256 bytes
  apart, a store jax 0.12 plans only unoptimized)."""
  dtype = quant.fp8_dtype(kv_cache_dtype) or jnp.bfloat16
  k_shape, v_shape = layout_lib.cache_shapes(layout, NUM_BLOCKS, block_size, HEADS, HEAD_SIZE,
                                             dtype, kv_layout)
  caches = [jnp.zeros(k_shape, dtype), None if v_shape is None else jnp.zeros(v_shape, dtype)]
  query = bf16(rng, 2, group * HEADS, HEAD_SIZE)
  table = jnp.zeros((2, NUM_BLOCKS // 2), jnp.int32)
  lens = jnp.asarray([3, 70], jnp.int32)
  scales = {} if kv_cache_dtype == "auto" else dict(k_scale=0.5, v_scale=2.0)

  def attend(q, kc, vc, t, s):
    return jkv.paged_attention_decode(q, kc, vc, t, s, layout=layout, kv_layout=kv_layout,
                                      kv_cache_dtype=kv_cache_dtype, backend="pallas",
                                      lowering="mosaic", **scales)

  with gpu_target():
    text = jax.jit(attend).trace(query, *caches, table, lens).lower(
        lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if MOSAIC_CALL in line]
  assert len(calls) == 1 and KERNEL_CALL not in text
  names = (MOSAIC_ATTENTION if kv_cache_dtype == "auto" else MOSAIC_FP8_X_ATTENTION
           if layout in ("vllm", "asm") else MOSAIC_FP8_ATTENTION)
  assert all(name.encode() in calls[0].encode() for name in names)


@pytest.mark.skipif(not lowering.mosaic_available(),
                    reason="the Mosaic GPU kernels need jax >= 0.11.2 (CI's newest-JAX pass)")
@pytest.mark.parametrize("kv_cache_dtype,block_size,q_heads,num_heads", [
    ("fp8_split", 16, 16, None), ("fp8_split", 8, 8, None), ("fp8_split", 128, 1, None),
    ("fp8_split", 16, 8, 2), ("fp8_ds_mla", 16, 16, None), ("fp8_ds_mla", 128, 1, None),
    ("fp8_ds_mla", 8, 3, None)])
def test_mosaic_mla_decode_lowers(kv_cache_dtype, block_size, q_heads, num_heads):
  """The Mosaic GPU MLA decode over an fp8_split cache (rank 512, RoPE 64; one latent head,
  or two) or an fp8_ds_mla one lowers for CUDA as one Mosaic custom call, no Triton."""
  from jkv.mla_cache import MLACache
  cache = MLACache.create(32, block_size, 512, 64, num_layers=2, num_heads=num_heads,
                          dtype=jnp.bfloat16, kv_cache_dtype=kv_cache_dtype)
  query = jnp.zeros((3, q_heads, 576), jnp.bfloat16)
  table = jnp.zeros((3, 8), jnp.int32)
  lens = jnp.asarray([3, 70, 0], jnp.int32)

  def attend(c, q, t, n):
    return c.attend(1, q, t, n, scale=0.1, backend="pallas", lowering="mosaic")

  with gpu_target():
    text = jax.jit(attend).trace(cache, query, table, lens).lower(
        lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if MOSAIC_CALL in line]
  assert len(calls) == 1 and KERNEL_CALL not in text
  assert MOSAIC_MLA[kv_cache_dtype].encode() in calls[0].encode()


@pytest.mark.skipif(not lowering.mosaic_available(),
                    reason="the Mosaic GPU kernels need jax >= 0.11.2 (CI's newest-JAX pass)")
@pytest.mark.parametrize("layout,kv_layout,block_size,group", [
    ("flash", "NHD", 16, 4), ("packed", "HND", 128, 3)])
def test_mosaic_ragged_prefill_lowers(layout, kv_layout, block_size, group, rng):
  """The Mosaic GPU kernels of ragged attention lower for CUDA (their warpgroups' barriers,
  TMA boxes and wgmma operands pass Mosaic's checks here): a Mosaic custom call for the
  prefill tiles and one for the short items (the decode kernel with its causal limit), no
  Triton launch."""
  k_shape, v_shape = layout_lib.cache_shapes(layout, NUM_BLOCKS, block_size, HEADS, HEAD_SIZE,
                                             jnp.bfloat16, kv_layout)
  caches = [bf16(rng, *k_shape), None if v_shape is None else bf16(rng, *v_shape)]
  query = bf16(rng, 100, group * HEADS, HEAD_SIZE)
  table = jnp.asarray(rng.permutation(NUM_BLOCKS)[:8].reshape(2, 4), jnp.int32)
  lens = jnp.asarray([4 * block_size - 3, 10], jnp.int32)
  cu_q_lens = jnp.asarray([0, 50, 52], jnp.int32)

  def attend(q, kc, vc, t, n, cu):
    return jkv.ragged_paged_attention(q, kc, vc, t, n, cu, layout=layout, kv_layout=kv_layout,
                                      backend="pallas", lowering="mosaic")

  with gpu_target():
    text = jax.jit(attend).trace(query, *caches, table, lens, cu_q_lens).lower(
        lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if MOSAIC_CALL in line]
  assert len(calls) == 2 and KERNEL_CALL not in text
  for names in (MOSAIC_RAGGED, MOSAIC_ATTENTION):
    assert sum(all(name.encode() in call.encode() for name in names) for call in calls) == 1


def test_every_kernel_is_lowered_above():
  """The names the tests above assert cover every named kernel in pallas_kernels/ (a new
  kernel must be added to them)."""
  source = pathlib.Path(__file__).parent.parent / "pallas_kernels"
  named = set()
  for path in source.glob("*.py"):
    named.update(re.findall(r'"(jkv_\w+)"', path.read_text()))   # (kernel names only)
  asserted = set().union(*WRITE_KERNELS.values(), CHUNKED_BLOCK_KERNELS, ATTENTION, RAGGED,
                         MLA_ENTRIES.values(), FUSED_BMM, INDEXER, BLOCKS, SCATTER, MOSAIC,
                         MOSAIC_ATTENTION, MOSAIC_FP8_ATTENTION, MOSAIC_FP8_X_ATTENTION,
                         MOSAIC_RAGGED, MOSAIC_MLA.values())
  assert named == asserted


def test_a_kernel_that_cannot_lower_fails_here():
  """The check is real: slicing a vector runs in the interpreter but has no Triton
  lowering."""

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * jax.lax.iota(jnp.int32, 16)[3]

  def call(x, interpret=False):
    return lowering.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.int32),
                                grid=(), input_output_aliases={}, interpret=interpret)(x)

  x = jnp.arange(16, dtype=jnp.int32)
  np.testing.assert_array_equal(call(x, interpret=True), x * 3)
  with pytest.raises(NotImplementedError, match="Unimplemented primitive in Pallas Triton"):
    kernels_lowered(call, x)


@pytest.mark.skipif(not lowering.mosaic_available(),
                    reason="the Mosaic GPU kernels need jax >= 0.11.2 (CI's newest-JAX pass)")
def test_a_mosaic_kernel_that_cannot_lower_fails_here():
  """Mosaic GPU's checks run here too: a TMA copy longer than 256 elements along a dim."""
  from pallas_kernels.lowering import plgpu

  def kernel(x_ref, out_ref, smem, barrier):
    plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, 1)], smem, barrier.at[0])
    plgpu.barrier_wait(barrier.at[0])
    plgpu.copy_smem_to_gmem(smem, out_ref.at[pl.ds(0, 1)])
    plgpu.wait_smem_to_gmem(0)

  def call(x, out):
    scratch = [plgpu.SMEM((1, 1024), jnp.float32), plgpu.Barrier(num_barriers=1)]
    return lowering.mosaic_in_place(kernel, (x,), [out], grid=1, scratch=scratch,
                                    interpret=False, name="jkv_test_cannot_lower")

  x = jnp.zeros((4, 1024), jnp.float32)
  with gpu_target(), pytest.raises(ValueError, match="at most|<=256 elements"):
    jax.jit(call).trace(x, x).lower(lowering_platforms=("cuda",))
