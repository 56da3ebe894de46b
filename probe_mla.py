"""Probe: MLA decode 64 x 8K, 16 heads, by format, with kernel option overrides."""
import functools, os, sys
import jax, jax.numpy as jnp
from benchmarks import attention_cases as ac
from benchmarks.timing import profiled_seconds
from pallas_kernels import attention as attention_kernels
from jkv.mla_cache import MLACache

fmt = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "time"
variants = [dict()] + [dict(eval(f"dict({v})")) for v in sys.argv[3:]]
orig = attention_kernels.paged_attention_decode
num_blocks, table, lens = ac._tables(ac.MLA_BATCH, ac.MLA_CONTEXT, seed=3)
cache = MLACache.create(num_blocks, ac.BLOCK, ac.RANK, ac.PE, kv_cache_dtype=fmt)
query = jax.random.normal(jax.random.key(8), (ac.MLA_BATCH, ac.MLA_HEADS, ac.RANK + ac.PE), jnp.bfloat16)
kv = (ac._ds_mla_entries(cache.kv_cache.shape[1:], 4)[None] if fmt == "fp8_ds_mla"
      else ac._fill(cache.kv_cache.shape, cache.kv_cache.dtype, 4))
fields = {"kv_cache": kv}
if cache.rope_cache is not None:
  fields["rope_cache"] = ac._fill(cache.rope_cache.shape, jnp.bfloat16, 5)
  fields["entry_scale"] = jnp.full(cache.entry_scale.shape, 0.01, jnp.float32)
cache = cache.replace(**fields)
entry = {"fp8_split": ac.RANK + 2 * ac.PE + 4, "fp8_ds_mla": 656}.get(fmt, (ac.RANK + ac.PE) * (1 if fmt == "fp8" else 2))
nbytes = ac.MLA_BATCH * ac.MLA_CONTEXT * entry
for opts in variants:
  attention_kernels.paged_attention_decode = functools.partial(orig, **opts)
  def step(q):
    out = cache.attend(0, q, table, lens, scale=0.07, backend="pallas")
    return q.at[..., :ac.RANK].add(out * 0)
  if mode == "ncu":
    f = jax.jit(step)
    s = f(query); s = f(s); jax.block_until_ready(s)
    break
  try:
    sec, per = profiled_seconds(step, query, calls=10)
    print(f"{fmt} {opts}: {sec*1e6:.1f} us  {nbytes/sec/1e12:.2f} TB/s  kernels {{{', '.join(f'{k[:40]}: {v*1e6:.1f}' for k, v in per.items())}}}", flush=True)
  except Exception as e:
    print(f"{fmt} {opts}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
