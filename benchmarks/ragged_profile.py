"""One ragged attention call of each benchmark shape, for ``ncu`` (GPU):

  ncu --kernel-name regex:jkv_ragged --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis python3 benchmarks/ragged_profile.py

Shapes as :mod:`benchmarks.ragged_cases` (prefill bf16 and FP8, decode 64 x 2K, mixed).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from benchmarks.ragged_cases import HEAD, MIXED, PREFILL, Q_HEADS, _batch, _cache, _filled


def main():
  for kv_lens, q_lens, dtype in ((*PREFILL, "auto"), (*PREFILL, "fp8"),
                                 ([2048] * 64, [1] * 64, "auto"), (*MIXED, "auto")):
    num_blocks, table, lens, cu = _batch(kv_lens, q_lens)
    cache = _filled(_cache(num_blocks, dtype))
    query = jax.random.normal(jax.random.key(9), (int(cu[-1]), Q_HEADS, HEAD), jnp.bfloat16)
    attend = jax.jit(lambda c, q: c.attend_ragged(0, q, table, lens, cu, backend="pallas"))
    jax.block_until_ready(attend(cache, query))
    print(f"ran {len(kv_lens)} sequences, kv {kv_lens[0]}, q {q_lens[0]}, {dtype}", flush=True)


if __name__ == "__main__":
  main()
  os._exit(0)   # skips interpreter teardown, which crashed under ncu (H200, 2026-11-25)
