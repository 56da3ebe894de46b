"""MLA benchmark cases (issue targets): T = 16384 tokens, R = 512, P = 64, 16 query heads,
bf16 in; concat_and_cache_mla (bf16 and FP8 caches), the fused RoPE + concat + cache op,
the DeepSeek-V4 fp8_split write with RoPE, vLLM's fp8_ds_mla write and the indexer write,
each beside its jitted reference.

DESCRIPTION (below) goes into RESULTS.md with the table.
"""

from __future__ import annotations

DESCRIPTION = """T = 16384 tokens, kv_lora_rank 512, pe 64, 16 query heads, bf16 inputs,
single-head cache of 16-token blocks, scattered pages. Bytes counted = inputs read + cache
(and q_out) written. fp8_split: FP8 content + bf16 rotated RoPE + a float32 scale per
entry (644 bytes). fp8_ds_mla: vLLM's entry, FP8 kv_c with a float32 scale per 128
values + bf16 k_pe (656 bytes). FP4 indexer pool: keys [T, 128] bf16 into 64 packed bytes
+ 8 E4M3 scales per token. The indexer write: keys [T, 128] bf16 into the FP8 byte cache
(132 bytes per token)."""

import jax
import jax.numpy as jnp
import numpy as np

import jkv
from benchmarks.timing import per_call_seconds
from jkv.reference.mla import ds_mla_entry_bytes

TOKENS, RANK, PE, Q_HEADS, BLOCK = 16384, 512, 64, 16, 16


def _slots(num_blocks, seed, variants=4):
  rng = np.random.default_rng(seed)
  t = np.arange(TOKENS)
  return [jnp.asarray(rng.permutation(num_blocks)[t // BLOCK] * BLOCK + t % BLOCK, jnp.int32)
          for _ in range(variants)]


def _inputs(*shapes, seed=3):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes)


def time_concat(cache_dtype, backend):
  num_blocks = 2 * TOKENS // BLOCK
  kv_c, k_pe = _inputs((TOKENS, RANK), (TOKENS, PE))
  slot_sets = _slots(num_blocks, 0)
  kv_cache_dtype = "auto" if cache_dtype == jnp.bfloat16 else "fp8"

  def make():
    return (jnp.zeros((num_blocks, BLOCK, RANK + PE), cache_dtype), jnp.copy(kv_c),
            jnp.copy(k_pe), tuple(jnp.copy(s) for s in slot_sets))

  def step(state, i):
    cache, c, pe, slots = state
    cache = jkv.concat_and_cache_mla(c, pe, cache, slots[i % len(slots)], kv_cache_dtype,
                                     None if kv_cache_dtype == "auto" else 0.1, backend=backend)
    return cache, c, pe, slots

  return per_call_seconds(make, step)


def time_fused(backend):
  num_blocks = 2 * TOKENS // BLOCK
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


def time_indexer(backend):
  num_blocks = 2 * TOKENS // BLOCK
  (k,) = _inputs((TOKENS, 128))
  slot_sets = _slots(num_blocks, 2)

  def make():
    return jnp.zeros((num_blocks, BLOCK, 132), jnp.uint8), jnp.copy(k), tuple(
        jnp.copy(s) for s in slot_sets)

  def step(state, i):
    cache, keys, slots = state
    return (jkv.indexer_k_quant_and_cache(keys, cache, slots[i % len(slots)], backend=backend),
            keys, slots)

  # a few microseconds per call: long chains, so the slope rises well above the noise
  return per_call_seconds(make, step, n_small=16, n_large=144)


def time_split(backend):
  """The fp8_split (DeepSeek-V4) write with RoPE: MLACache.write_split_rope."""
  num_blocks = 2 * TOKENS // BLOCK
  kv_c, k_pe = _inputs((TOKENS, RANK), (TOKENS, PE))
  cos, sin = jkv.rope.rope_cache(8192, PE, dtype=jnp.bfloat16)
  positions = jnp.asarray(np.random.default_rng(5).integers(0, 8192, TOKENS), jnp.int32)
  slot_sets = _slots(num_blocks, 3)
  empty = jkv.MLACache.create(num_blocks, BLOCK, RANK, PE, kv_cache_dtype="fp8_split")

  def make():
    return (jax.tree.map(jnp.copy, empty), jnp.copy(kv_c), jnp.copy(k_pe),
            tuple(jnp.copy(s) for s in slot_sets))

  def step(state, i):
    cache, c, pe, slots = state
    cache = cache.write_split_rope(0, c, pe, slots[i % len(slots)], positions, cos, sin,
                                   backend=backend)
    return cache, c, pe, slots

  return per_call_seconds(make, step)


def time_ds_mla(backend):
  """vLLM's fp8_ds_mla write: concat_and_cache_mla(..., "fp8_ds_mla") into a uint8 cache."""
  num_blocks = 2 * TOKENS // BLOCK
  kv_c, k_pe = _inputs((TOKENS, RANK), (TOKENS, PE))
  slot_sets = _slots(num_blocks, 7)

  def make():
    return (jnp.zeros((num_blocks, BLOCK, ds_mla_entry_bytes(RANK, PE)), jnp.uint8),
            jnp.copy(kv_c), jnp.copy(k_pe), tuple(jnp.copy(s) for s in slot_sets))

  def step(state, i):
    cache, c, pe, slots = state
    cache = jkv.concat_and_cache_mla(c, pe, cache, slots[i % len(slots)], "fp8_ds_mla",
                                     backend=backend)
    return cache, c, pe, slots

  return per_call_seconds(make, step)


def time_fp4_pool(backend):
  """The DeepSeek-V4 NVFP4 indexer pool write (FP4IndexerCache.write), keys [T, 128]."""
  num_blocks = 2 * TOKENS // BLOCK
  (k,) = _inputs((TOKENS, 128))
  slot_sets = _slots(num_blocks, 6)
  empty = jkv.FP4IndexerCache.create(num_blocks, BLOCK, 128, global_scale=0.01)

  def make():
    return jax.tree.map(jnp.copy, empty), jnp.copy(k), tuple(jnp.copy(s) for s in slot_sets)

  def step(state, i):
    pool, keys, slots = state
    return pool.write(0, keys, slots[i % len(slots)], backend=backend), keys, slots

  return per_call_seconds(make, step, n_small=16, n_large=144)


def run(record):
  """``record(case, impl, seconds, bytes_moved)``."""
  inputs = TOKENS * (RANK + PE) * 2
  for name, dtype, entry_bytes in (("bf16", jnp.bfloat16, 2), ("fp8", jnp.float8_e4m3fn, 1)):
    nbytes = inputs + TOKENS * (RANK + PE) * entry_bytes
    for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
      record(f"concat_and_cache_mla 16K {name} cache", impl, time_concat(dtype, backend), nbytes)
  fused_bytes = 2 * inputs * (1 + Q_HEADS) + TOKENS * 4
  for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
    record("fused rope + concat + cache 16K, 16 q heads", impl, time_fused(backend), fused_bytes)
  split_bytes = inputs + TOKENS * (RANK + 2 * PE + 4)   # fp8 content, bf16 rope, f32 scale
  for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
    record("fp8_split write with RoPE 16K", impl, time_split(backend), split_bytes)
  ds_mla_bytes = inputs + TOKENS * ds_mla_entry_bytes(RANK, PE)
  for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
    record("fp8_ds_mla write 16K", impl, time_ds_mla(backend), ds_mla_bytes)
  indexer_bytes = TOKENS * 128 * 2 + TOKENS * 132
  for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
    record("indexer_k_quant_and_cache 16K", impl, time_indexer(backend), indexer_bytes)
  pool_bytes = TOKENS * 128 * 2 + TOKENS * (64 + 8)
  for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
    record("FP4 indexer pool write 16K", impl, time_fp4_pool(backend), pool_bytes)
