"""MLA benchmark cases (issue targets): T = 16384 tokens, R = 512, P = 64, 16 query heads,
bf16 in; concat_and_cache_mla (bf16 and FP8 caches), the fused RoPE + concat + cache op,
the DeepSeek-V4 fp8_split write with RoPE, vLLM's fp8_ds_mla write and the indexer write;
AITER's fused FP8 BMM + RoPE + cache at decode size (128 tokens); each beside its jitted
reference.

DESCRIPTION (below) goes into RESULTS.md with the table.
"""

from __future__ import annotations

DESCRIPTION = """T = 16384 tokens, kv_lora_rank 512, pe 64, 16 query heads, bf16 inputs,
single-head cache of 16-token blocks, scattered pages. Bytes counted = inputs read + cache
(and q_out) written. fp8_split: FP8 content + bf16 rotated RoPE + a float32 scale per entry
(644 bytes). fp8_ds_mla: vLLM's entry, FP8 kv_c with a float32 scale per 128 values + bf16
k_pe (656 bytes). FP4 indexer pool: keys [T, 128] bf16 into 64 packed bytes + 8 E4M3 scales
per token. The indexer write: keys [T, 128] bf16 into the FP8 byte cache (132 bytes per
token). The indexer write and the FP8 concat also at 256K tokens. Fused FP8 BMM + RoPE +
cache (AITER's absorbed-MLA fusion, decode size): 128 tokens, q_nope [16, 128, 128] bf16
quantized to FP8 per 128 values, times FP8 w_k [16, 512, 128], q_pe / k_rope 64 wide, one KV
head, a flat bf16 cache; bytes = q_nope, q_pe, k_nope, k_rope and w_k read, q_out (bf16),
cache rows and k_pe_out written. Every case's cache spans >= 128 MiB and its calls rotate
through >= 64 MiB of input copies (the fused RoPE case's 300 MB of inputs: one copy), past
the 50 MB L2: no call finds the last call's data in L2 (L2-resident runs read above 1.0 of
the ceiling). "XLA copy of the same bytes": an elementwise pass moving as many bytes, timed
alike (what the size allows). The FP4 indexer pool write is jnp code only (its Pallas kernel
was removed: slower than XLA). "tokens per program" rows (--sweep): the concat kernel's
tiling (the default, 16 tokens and 4 warps, is within the runs' noise of the best)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jkv
from benchmarks.timing import per_call_seconds
from jkv.formats import ds_mla_entry_bytes

TOKENS, RANK, PE, Q_HEADS, BLOCK = 16384, 512, 64, 16, 16
# Working sets past the L2 (50 MB on an H100 / H200): every cache spans at least
# CACHE_BYTES, and the calls of a chain rotate through copies of their inputs totalling at
# least INPUT_BYTES, so no call finds the previous call's inputs or cache rows in L2.
CACHE_BYTES, INPUT_BYTES = 128 << 20, 64 << 20
# The second size of the indexer write and the FP8 concat: 256K tokens move 100 MB / 450 MB
# (16K: 6 MB / 28 MB, where even an XLA copy of the same bytes reads under the ceiling).
LARGE = 262144


def _num_blocks(entry_bytes, tokens=TOKENS):
  """Cache blocks (at least 8 x the blocks written per call) spanning CACHE_BYTES."""
  return max(8 * tokens // BLOCK, -(-CACHE_BYTES // (BLOCK * entry_bytes)))


def _copies(*arrays):
  """Enough copies of the tuple ``arrays`` (fresh buffers) to span INPUT_BYTES (>= 2)."""
  nbytes = sum(x.nbytes for x in arrays)
  return tuple(tuple(jnp.copy(x) for x in arrays)
               for _ in range(max(2, -(-INPUT_BYTES // nbytes))))


def _slots(num_blocks, seed, variants=4, tokens=TOKENS):
  rng = np.random.default_rng(seed)
  t = np.arange(tokens)
  return [jnp.asarray(rng.permutation(num_blocks)[t // BLOCK] * BLOCK + t % BLOCK, jnp.int32)
          for _ in range(variants)]


def _inputs(*shapes, seed=3):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes)


def time_concat(cache_dtype, backend, tokens=TOKENS):
  num_blocks = _num_blocks((RANK + PE) * np.dtype(cache_dtype).itemsize, tokens)
  kv_c, k_pe = _inputs((tokens, RANK), (tokens, PE))
  slot_sets = _slots(num_blocks, 0, tokens=tokens)
  kv_cache_dtype = "auto" if cache_dtype == jnp.bfloat16 else "fp8"

  def make():
    return (jnp.zeros((num_blocks, BLOCK, RANK + PE), cache_dtype), _copies(kv_c, k_pe),
            tuple(jnp.copy(s) for s in slot_sets))

  def step(state, i):
    cache, inputs, slots = state
    c, pe = inputs[i % len(inputs)]
    cache = jkv.concat_and_cache_mla(c, pe, cache, slots[i % len(slots)], kv_cache_dtype,
                                     None if kv_cache_dtype == "auto" else 0.1, backend=backend)
    return cache, inputs, slots

  return per_call_seconds(make, step)


def time_fused(backend):
  """The inputs (300 MB) already exceed the L2: one copy."""
  num_blocks = _num_blocks((RANK + PE) * 2)
  q_nope, q_pe, kv_c, k_pe = _inputs((TOKENS, Q_HEADS, RANK), (TOKENS, Q_HEADS, PE),
                                     (TOKENS, RANK), (TOKENS, PE))
  cos, sin = jkv.rope.rope_cache(8192, PE, dtype=jnp.bfloat16)
  positions = jnp.asarray(np.random.default_rng(4).integers(0, 8192, TOKENS), jnp.int32)
  slot_sets = _slots(num_blocks, 1)

  def make():
    return (jnp.zeros((num_blocks, BLOCK, RANK + PE), jnp.bfloat16),
            tuple(jnp.copy(x) for x in (q_nope, q_pe, kv_c, k_pe)),
            tuple(jnp.copy(s) for s in slot_sets), jnp.zeros((), jnp.float32))

  def step(state, i):
    cache, inputs, slots, acc = state
    # Routing the inputs through a barrier with the cache makes every call's inputs a new
    # value: else XLA computes the q part (which depends on the inputs only) once for all.
    cache, inputs = jax.lax.optimization_barrier((cache, inputs))
    q_out, cache = jkv.fused_qk_rope_concat_and_cache_mla(
        *inputs, cache, slots[i % len(slots)], None, None, positions, cos, sin, is_neox=True,
        is_nope_first=True, backend=backend)
    # the barrier keeps all of q_out computed (else XLA computes only the element read)
    q_out = jax.lax.optimization_barrier(q_out)
    return cache, inputs, slots, acc + q_out[0, 0, 0].astype(jnp.float32)

  return per_call_seconds(make, step, n_small=4, n_large=24, repeats=7)


def indexer_bytes(tokens):
  """Bytes an indexer write of ``tokens`` keys moves: [T, 128] bf16 read, 132 cache bytes
  (128 FP8 values and a float32 scale) written per token."""
  return tokens * 128 * 2 + tokens * 132


def time_indexer(backend, tokens=TOKENS):
  num_blocks = _num_blocks(132, tokens)
  (k,) = _inputs((tokens, 128))
  slot_sets = _slots(num_blocks, 2, tokens=tokens)

  def make():
    return jnp.zeros((num_blocks, BLOCK, 132), jnp.uint8), _copies(k), tuple(
        jnp.copy(s) for s in slot_sets)

  def step(state, i):
    cache, inputs, slots = state
    (keys,) = inputs[i % len(inputs)]
    return (jkv.indexer_k_quant_and_cache(keys, cache, slots[i % len(slots)], backend=backend),
            inputs, slots)

  # a few microseconds per call: long chains, so the slope rises well above the noise
  return per_call_seconds(make, step, n_small=16, n_large=144)


def time_split(backend):
  """The fp8_split (DeepSeek-V4) write with RoPE: MLACache.write_split_rope."""
  num_blocks = _num_blocks(RANK + 2 * PE + 4)
  kv_c, k_pe = _inputs((TOKENS, RANK), (TOKENS, PE))
  cos, sin = jkv.rope.rope_cache(8192, PE, dtype=jnp.bfloat16)
  positions = jnp.asarray(np.random.default_rng(5).integers(0, 8192, TOKENS), jnp.int32)
  slot_sets = _slots(num_blocks, 3)
  empty = jkv.MLACache.create(num_blocks, BLOCK, RANK, PE, kv_cache_dtype="fp8_split")

  def make():
    return (jax.tree.map(jnp.copy, empty), _copies(kv_c, k_pe),
            tuple(jnp.copy(s) for s in slot_sets))

  def step(state, i):
    cache, inputs, slots = state
    c, pe = inputs[i % len(inputs)]
    cache = cache.write_split_rope(0, c, pe, slots[i % len(slots)], positions, cos, sin,
                                   backend=backend)
    return cache, inputs, slots

  return per_call_seconds(make, step)


def time_ds_mla(backend):
  """vLLM's fp8_ds_mla write: concat_and_cache_mla(..., "fp8_ds_mla") into a uint8 cache."""
  num_blocks = _num_blocks(ds_mla_entry_bytes(RANK, PE))
  kv_c, k_pe = _inputs((TOKENS, RANK), (TOKENS, PE))
  slot_sets = _slots(num_blocks, 7)

  def make():
    return (jnp.zeros((num_blocks, BLOCK, ds_mla_entry_bytes(RANK, PE)), jnp.uint8),
            _copies(kv_c, k_pe), tuple(jnp.copy(s) for s in slot_sets))

  def step(state, i):
    cache, inputs, slots = state
    c, pe = inputs[i % len(inputs)]
    cache = jkv.concat_and_cache_mla(c, pe, cache, slots[i % len(slots)], "fp8_ds_mla",
                                     backend=backend)
    return cache, inputs, slots

  return per_call_seconds(make, step)


def time_fp4_pool():
  """The DeepSeek-V4 NVFP4 indexer pool write (FP4IndexerCache.write: jnp code, no
  kernel), keys [T, 128]."""
  num_blocks = _num_blocks(64 + 8)
  (k,) = _inputs((TOKENS, 128))
  slot_sets = _slots(num_blocks, 6)
  empty = jkv.FP4IndexerCache.create(num_blocks, BLOCK, 128, global_scale=0.01)

  def make():
    return jax.tree.map(jnp.copy, empty), _copies(k), tuple(jnp.copy(s) for s in slot_sets)

  def step(state, i):
    pool, inputs, slots = state
    (keys,) = inputs[i % len(inputs)]
    return pool.write(0, keys, slots[i % len(slots)], backend="reference"), inputs, slots

  return per_call_seconds(make, step, n_small=16, n_large=144)


def time_copy(nbytes):
  """An XLA elementwise pass (+1) over nbytes / 2 bytes (nbytes moved), rotating through
  copies like the ops: what a plain copy of an op's bytes costs at that size."""
  n = nbytes // 4   # bf16 elements: read + written = nbytes

  def make():
    return _copies(jnp.arange(n, dtype=jnp.int32).astype(jnp.bfloat16))

  def step(state, i):
    state = list(state)
    (x,) = state[i % len(state)]
    state[i % len(state)] = (jax.lax.optimization_barrier(x + jnp.asarray(1, x.dtype)),)
    return tuple(state)

  return per_call_seconds(make, step, n_small=16, n_large=144)


BMM_TOKENS, BMM_WIDTH = 128, 128   # decode batch; q_nope's width P (the group size too)


def time_fused_bmm(backend):
  """fused_fp8_bmm_rope_cat_and_cache_mla at decode size: B = Bk = 128 tokens, 16 query
  heads, P = 128, R = 512, d_pe = 64, one KV head, a flat bf16 cache of CACHE_BYTES."""
  num_slots = CACHE_BYTES // ((RANK + PE) * 2)
  rng = np.random.default_rng(8)
  q_nope, q_pe, k_nope, k_rope = _inputs(
      (Q_HEADS, BMM_TOKENS, BMM_WIDTH), (BMM_TOKENS, Q_HEADS, PE), (BMM_TOKENS, 1, RANK),
      (BMM_TOKENS, 1, PE), seed=9)
  w_k = jnp.asarray(rng.standard_normal((Q_HEADS, RANK, BMM_WIDTH)), jnp.float8_e4m3fn)
  cos, sin = jkv.rope.rope_cache(8192, PE, dtype=jnp.bfloat16)
  positions = jnp.asarray(rng.integers(0, 8192, BMM_TOKENS), jnp.int32)
  slot_sets = [jnp.asarray(rng.permutation(num_slots)[:BMM_TOKENS], jnp.int32)
               for _ in range(4)]

  def make():
    return (jnp.zeros((num_slots, 1, RANK + PE), jnp.bfloat16),
            _copies(q_nope, w_k, q_pe, k_nope, k_rope),
            tuple(jnp.copy(s) for s in slot_sets), jnp.zeros((), jnp.float32))

  def step(state, i):
    cache, inputs, slots, acc = state
    # as time_fused: every call's inputs a new value (w_k too: no conversion of it hoisted
    # out of the chain), and every output computed
    cache, args = jax.lax.optimization_barrier((cache, inputs[i % len(inputs)]))
    q_nope, w_k, q_pe, k_nope, k_rope = args
    q_out, _, k_pe_out, _, cache = jkv.fused_fp8_bmm_rope_cat_and_cache_mla(
        q_nope, w_k, 0.01, q_pe, k_nope, k_rope, cache, slots[i % len(slots)], positions,
        cos, sin, group_size=BMM_WIDTH, is_neox=False, q_out_dtype=jnp.bfloat16,
        backend=backend)
    q_out, k_pe_out = jax.lax.optimization_barrier((q_out, k_pe_out))
    return cache, inputs, slots, acc + (q_out[0, 0, 0] + k_pe_out[0, 0, 0]).astype(jnp.float32)

  # a few microseconds per call: long chains, so the slope rises well above the noise
  return per_call_seconds(make, step, n_small=16, n_large=144)


def run(record):
  """``record(case, impl, seconds, bytes_moved)``."""
  inputs = TOKENS * (RANK + PE) * 2
  for name, dtype, entry_bytes in (("bf16", jnp.bfloat16, 2), ("fp8", jnp.float8_e4m3fn, 1)):
    nbytes = inputs + TOKENS * (RANK + PE) * entry_bytes
    for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
      record(f"concat_and_cache_mla 16K {name} cache", impl, time_concat(dtype, backend), nbytes)
    record(f"concat_and_cache_mla 16K {name} cache", "XLA copy of the same bytes",
           time_copy(nbytes), nbytes)
  # 16K tokens move 28 MB into an FP8 cache, where an XLA copy of as many bytes reads
  # under the ceiling (H200): the FP8 write at LARGE tokens too
  case = f"concat_and_cache_mla {LARGE // 1024}K fp8 cache"
  nbytes = LARGE * (RANK + PE) * 3
  record(case, "jkv pallas", time_concat(jnp.float8_e4m3fn, "pallas", LARGE), nbytes)
  record(case, "XLA copy of the same bytes", time_copy(nbytes), nbytes)
  fused_bytes = 2 * inputs * (1 + Q_HEADS) + TOKENS * 4
  for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
    record("fused rope + concat + cache 16K, 16 q heads", impl, time_fused(backend), fused_bytes)
  split_bytes = inputs + TOKENS * (RANK + 2 * PE + 4)   # fp8 content, bf16 rope, f32 scale
  for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
    record("fp8_split write with RoPE 16K", impl, time_split(backend), split_bytes)
  ds_mla_bytes = inputs + TOKENS * ds_mla_entry_bytes(RANK, PE)
  for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
    record("fp8_ds_mla write 16K", impl, time_ds_mla(backend), ds_mla_bytes)
  for tokens in (TOKENS, LARGE):   # 16K moves 6 MB: launch latency weighs
    case = f"indexer_k_quant_and_cache {tokens // 1024}K"
    nbytes = indexer_bytes(tokens)
    for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
      record(case, impl, time_indexer(backend, tokens), nbytes)
    record(case, "XLA copy of the same bytes", time_copy(nbytes), nbytes)
  bmm_bytes = (2 * BMM_TOKENS * Q_HEADS * (BMM_WIDTH + PE) + 2 * BMM_TOKENS * (RANK + PE)
               + Q_HEADS * RANK * BMM_WIDTH                                    # inputs, w_k
               + 2 * BMM_TOKENS * (Q_HEADS * (RANK + PE) + RANK + PE + PE))    # outputs
  for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
    record("fused fp8 bmm + rope + cache, 128 tokens", impl, time_fused_bmm(backend),
           bmm_bytes)
  pool_bytes = TOKENS * 128 * 2 + TOKENS * (64 + 8)
  record("FP4 indexer pool write 16K", "jkv reference (XLA)", time_fp4_pool(), pool_bytes)


def sweep(record):
  """Tiling of the concat_and_cache_mla kernel (``--sweep``): tokens per program x warps,
  bf16 and FP8 caches."""
  from pallas_kernels import mla as kernels
  default = kernels.write_entries
  inputs = TOKENS * (RANK + PE) * 2
  try:
    for name, dtype, entry_bytes in (("bf16", jnp.bfloat16, 2), ("fp8", jnp.float8_e4m3fn, 1)):
      for tokens in (8, 16, 32, 64):
        for warps in (2, 4, 8):
          jax.clear_caches()   # the kernel's options are read at trace time
          kernels.write_entries = functools.partial(default, tokens_per_program=tokens,
                                                    num_warps=warps)
          record(f"concat_and_cache_mla 16K {name} cache",
                 f"{tokens} tokens per program, {warps} warps",
                 time_concat(dtype, "pallas"), inputs + TOKENS * (RANK + PE) * entry_bytes)
  finally:
    kernels.write_entries = default
    jax.clear_caches()
