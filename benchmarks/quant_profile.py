"""One call of each quantized-format kernel of issue 28's targets, for ``ncu`` (GPU):

  ncu --kernel-name regex:jkv_ --launch-skip 0 --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
      --section LaunchStats python3 benchmarks/quant_profile.py [CASE ...]

Cases (all by default): ``block-vllm``, ``block-asm``, ``block-flash`` (per-block FP8 writes
of 32K tokens, as the ``quant`` rows of RESULTS.md), ``asm-pa`` (128-token scale blocks
over 128-token pages, the ``quant-asm-pa`` rows), ``decode-vllm-fp8`` (decode 8 x 32K over
an FP8 vLLM-layout cache, as ``auto`` runs it: on a Hopper GPU the Mosaic GPU kernel, which
ncu does not profile here; ``JKV_LOWERING=triton`` for the Triton one) and ``mla-ds`` (MLA
decode 64 x 8K over an ``fp8_ds_mla`` cache; both as the ``attention`` rows),
``indexer-16k`` / ``indexer-256k`` (the indexer write of the ``mla`` rows, 16K / 256K
tokens), ``copy-16k`` / ``copy-256k`` (the rows' "XLA copy of the same bytes": an
elementwise pass over them; its input comes from the host, so its kernel is the case's one
launch: profile it alone with ``--kernel-name regex:.``). Each runs its op once, compiled
and outside any timing chain, so the profiler sees each kernel launch once.
``CASES[name]()`` gives the jitted function and its arguments.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jkv
from benchmarks import attention_cases, mla_cases, quant_write_cases as quant_cases
from jkv.mla_cache import MLACache


def _write(layout, unit=quant_cases.BLOCK, page=quant_cases.BLOCK):
  num_blocks = 2 * quant_cases.TOKENS // quant_cases.BLOCK
  key, value = quant_cases._inputs(quant_cases.TOKENS)
  slots = quant_cases._slots(quant_cases.TOKENS, num_blocks, 0, variants=1, page=page)[0]
  arrays = quant_cases._scaled_arrays(layout, num_blocks, jnp.float8_e4m3fn, "block", unit)()
  write = jax.jit(lambda k, v, a, s: jkv.write_quant_kv(
      k, v, *a, s, granularity="block", layout=layout, tokens_per_scale_block=unit,
      backend="pallas"), donate_argnums=2)
  return write, (key, value, arrays, slots)


def _decode_vllm_fp8():
  num_blocks, table, lens = attention_cases._tables(attention_cases.BATCH,
                                                    attention_cases.CONTEXT)
  cache = jkv.PagedKVCache.create(num_blocks, attention_cases.BLOCK, attention_cases.KV_HEADS,
                                  attention_cases.HEAD, layout="vllm", kv_cache_dtype="fp8",
                                  k_scale=0.05, v_scale=0.05)
  cache = cache.replace(key_cache=attention_cases._fill(cache.key_cache.shape,
                                                        cache.key_cache.dtype, 1),
                        value_cache=attention_cases._fill(cache.value_cache.shape,
                                                          cache.value_cache.dtype, 2))
  query = jax.random.normal(jax.random.key(9), (attention_cases.BATCH, attention_cases.Q_HEADS,
                                                attention_cases.HEAD), jnp.bfloat16)
  attend = jax.jit(lambda c, q: c.attend(0, q, table, lens, backend="pallas"))
  return attend, (cache, query)


def _mla_ds():
  rank, pe = attention_cases.RANK, attention_cases.PE
  num_blocks, table, lens = attention_cases._tables(attention_cases.MLA_BATCH,
                                                    attention_cases.MLA_CONTEXT, seed=3)
  cache = MLACache.create(num_blocks, attention_cases.BLOCK, rank, pe,
                          kv_cache_dtype="fp8_ds_mla")
  cache = cache.replace(kv_cache=attention_cases._ds_mla_entries(cache.kv_cache.shape[1:],
                                                                 4)[None])
  query = jax.random.normal(jax.random.key(8), (attention_cases.MLA_BATCH,
                                                attention_cases.MLA_HEADS, rank + pe),
                            jnp.bfloat16)
  attend = jax.jit(lambda c, q: c.attend(0, q, table, lens, scale=0.07, backend="pallas"))
  return attend, (cache, query)


def _indexer(tokens):
  num_blocks = mla_cases._num_blocks(132, tokens)
  (keys,) = mla_cases._inputs((tokens, 128))
  slots = mla_cases._slots(num_blocks, 2, variants=1, tokens=tokens)[0]
  cache = jnp.zeros((num_blocks, mla_cases.BLOCK, 132), jnp.uint8)
  write = jax.jit(lambda k, c, s: jkv.indexer_k_quant_and_cache(k, c, s, backend="pallas"),
                  donate_argnums=1)
  return write, (keys, cache, slots)


def _copy(tokens):
  """mla_cases.time_copy's pass over the indexer write's bytes (bf16 read and written)."""
  n = mla_cases.indexer_bytes(tokens) // 4
  x = jax.device_put(np.arange(n).astype(jnp.bfloat16))
  return jax.jit(lambda x: x + jnp.asarray(1, x.dtype)), (x,)


CASES = {
    "block-vllm": lambda: _write("vllm"),
    "block-asm": lambda: _write("asm"),
    "block-flash": lambda: _write("flash"),
    "asm-pa": lambda: _write("asm", unit=128, page=128),
    "decode-vllm-fp8": _decode_vllm_fp8,
    "mla-ds": _mla_ds,
    "indexer-16k": lambda: _indexer(mla_cases.TOKENS),
    "indexer-256k": lambda: _indexer(mla_cases.LARGE),
    "copy-16k": lambda: _copy(mla_cases.TOKENS),
    "copy-256k": lambda: _copy(mla_cases.LARGE),
}


def main(names):
  for name in names or CASES:
    fn, args = CASES[name]()
    jax.block_until_ready(fn(*args))
    print(f"ran {name}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
  os._exit(0)   # skips interpreter teardown, which crashed under ncu (H200, 2026-11-25)
