"""Sharded benchmark cases (issue 7): a prefill write and a decode attention on one GPU,
and the 2x larger problem on two GPUs (pages and sequences over a data-parallel axis,
``jkv.sharded_write`` / ``jkv.sharded_attend``); aggregate throughput scaling.

DESCRIPTION (below) goes into RESULTS.md with the table.
"""

from __future__ import annotations

DESCRIPTION = """Per GPU: a prefill write of 32768 tokens x 8 kv heads x 128 (bf16, flash
layout, block 16, scattered pages of the GPU's own page range) and a decode attention of 8
sequences x 32768 tokens, 32 / 8 heads (hnd layout). Two GPUs: twice the tokens, sequences
and cache, split over a data-parallel mesh axis ((dp 2, tp 1): each GPU holds half the
pages, writes its own tokens and attends for its own sequences). Bytes = the whole problem's (aggregate);
scaling = aggregate throughput on 2 GPUs / on 1."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jkv
from benchmarks.attention_cases import _fill
from benchmarks.timing import per_call_seconds

TOKENS, HEADS, HEAD, BLOCK = 32768, 8, 128, 16
SEQS, CONTEXT, Q_HEADS = 8, 32768, 32
BACKEND = "pallas"


def _mesh(devices: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:devices]).reshape(devices, 1), ("dp", "tp"))


def time_write(devices: int):
  mesh = _mesh(devices)
  blocks_per_gpu = 2 * TOKENS // BLOCK
  tokens = devices * TOKENS
  rng = np.random.default_rng(0)
  # each GPU's tokens go to scattered pages of its own page range
  slots = np.concatenate([
      (g * blocks_per_gpu + rng.permutation(blocks_per_gpu)[np.arange(TOKENS) // BLOCK]) * BLOCK
      + np.arange(TOKENS) % BLOCK for g in range(devices)]).astype(np.int32)
  cache = jkv.PagedKVCache.create(devices * blocks_per_gpu, BLOCK, HEADS, HEAD, layout="flash")
  rows = NamedSharding(mesh, P("dp"))   # each GPU holds its own tokens
  key, value = (jax.device_put(_fill((tokens, HEADS, HEAD), jnp.bfloat16, s), rows)
                for s in (5, 6))
  slots = jax.device_put(jnp.asarray(slots), rows)

  def make():
    return jkv.shard_cache(cache.replace(key_cache=jnp.zeros_like(cache.key_cache),
                                         value_cache=jnp.zeros_like(cache.value_cache),
                                         k_scale=jnp.copy(cache.k_scale),
                                         v_scale=jnp.copy(cache.v_scale)),
                           mesh, dp_axis="dp")

  def step(state, i):
    return jkv.sharded_write(state, 0, key, value, slots, mesh, dp_axis="dp",
                             split_tokens=True, backend=BACKEND)

  seconds = per_call_seconds(make, step, n_small=4, n_large=20, repeats=5)
  return seconds, 4 * tokens * HEADS * HEAD * 2


def time_attend(devices: int):
  mesh = _mesh(devices)
  seqs = devices * SEQS
  width = CONTEXT // BLOCK
  per_gpu = SEQS * width
  rng = np.random.default_rng(1)
  table = np.concatenate([g * per_gpu + rng.permutation(per_gpu).reshape(SEQS, width)
                          for g in range(devices)]).astype(np.int32)
  lens = jnp.full((seqs,), CONTEXT, jnp.int32)
  cache = jkv.PagedKVCache.create(devices * per_gpu, BLOCK, HEADS, HEAD, layout="hnd")
  query_sharding = NamedSharding(mesh, P("dp", "tp"))
  query = jax.device_put(jax.random.normal(jax.random.key(2), (seqs, Q_HEADS, HEAD),
                                           jnp.bfloat16), query_sharding)
  table = jnp.asarray(table)

  def make():
    filled = cache.replace(key_cache=_fill(cache.key_cache.shape, jnp.bfloat16, 1),
                           value_cache=_fill(cache.value_cache.shape, jnp.bfloat16, 2),
                           k_scale=jnp.copy(cache.k_scale), v_scale=jnp.copy(cache.v_scale))
    return (jkv.shard_cache(filled, mesh, dp_axis="dp"), jnp.copy(query),
            jnp.zeros((), jnp.float32))

  def step(state, i):
    sharded, q, total = state
    out = jkv.sharded_attend(sharded, 0, q, table, lens, mesh, dp_axis="dp", backend=BACKEND)
    sharded, q, out = jax.lax.optimization_barrier((sharded, q, out))
    return sharded, q, total + out[0, 0, 0].astype(jnp.float32)

  seconds = per_call_seconds(make, step, n_small=4, n_large=20, repeats=5)
  return seconds, 2 * seqs * CONTEXT * HEADS * HEAD * 2


def run(record):
  """``record(case, impl, seconds, bytes_moved)``; returns {op: 2-GPU scaling} (None when
  fewer than two GPUs)."""
  scaling = {}
  for op, timer in (("prefill write", time_write), ("decode attention", time_attend)):
    seconds = {}
    for devices in (1, 2):
      if devices > jax.device_count():
        continue
      seconds[devices], nbytes = timer(devices)
      record(f"{op}, {devices} GPU{'s' if devices > 1 else ''}", "jkv pallas, sharded",
             seconds[devices], nbytes)
    scaling[op] = 2 * seconds[1] / seconds[2] if seconds.get(2, 0) > 0 else None
  return scaling
