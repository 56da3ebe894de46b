"""Ragged paged attention benchmark cases (the ragged attention issue's targets): a chunked
prefill, decode-only batches, a mixed step and an FP8 prefill, beside what they replace
(gather the pages + XLA attention, gather + cuDNN through ``jax.nn.dot_product_attention``,
``paged_attention_decode``) and a dense bf16 matmul measured in the same run.

DESCRIPTION (below) goes into RESULTS.md with the table.
"""

from __future__ import annotations

DESCRIPTION = """32 query / 8 kv heads, head size 128, block 16, scattered pages, bf16
queries, flash (NHD) cache. Prefill: 4 sequences x 2048 new tokens over 6144 cached (kv
8192); causal FLOPs only (4 * rows * keys seen * head size per head). **Prefill and mixed
rows: the TB/s column holds TFLOP/s and 'of ceiling' is of the dense 8192^3 bf16 matmul rate
measured in the same run** (its own row). Decode rows: bytes = K and V entries read, 'of
ceiling' of the copy ceiling. Mixed step: 60 decodes over 2048 + 2 chunks of 512 over 3584
cached, one ragged call against paged_attention_decode for the decodes plus gather + cuDNN
for the chunks (two rows, summed in the last). "jkv ragged pallas": the default (a launch
for the prefill tiles and one for the decodes, both on Mosaic GPU on a Hopper GPU, for
16-bit and FP8 caches); "triton prefill": both launches on Triton; "one launch": both
kinds of program in one Triton kernel. Device time per call from chains of calls in one
jit (the timing method is stamped above), each call's cache and query behind a barrier
with the previous output (a gather cannot be hoisted out of the chain)."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.attention_cases import _chain, _fill
from benchmarks.timing import per_call_seconds
from jkv import layout as layout_lib
from jkv.cache import PagedKVCache
from pallas_kernels import ragged_attention as kernels

Q_HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16


def _cache(num_blocks, kv_cache_dtype="auto"):
  return PagedKVCache.create(num_blocks, BLOCK, KV_HEADS, HEAD, layout="flash",
                             kv_cache_dtype=kv_cache_dtype, k_scale=0.05, v_scale=0.05)


def _batch(kv_lens, q_lens, seed=0):
  """(num_blocks, block_table, kv_lens, cu_q_lens) of sequences at scattered pages."""
  kv_lens = np.asarray(kv_lens, np.int32)
  width = int(-(-kv_lens.max() // BLOCK))
  num_blocks = len(kv_lens) * width
  table = np.random.default_rng(seed).permutation(num_blocks).reshape(len(kv_lens), width)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return num_blocks, jnp.asarray(table, jnp.int32), jnp.asarray(kv_lens), jnp.asarray(cu)


def _filled(cache):
  storage = cache.key_cache.dtype
  return cache.replace(key_cache=_fill(cache.key_cache.shape, storage, 1),
                       value_cache=_fill(cache.value_cache.shape, storage, 2),
                       k_scale=jnp.copy(cache.k_scale), v_scale=jnp.copy(cache.v_scale))


def causal_flops(kv_lens, q_lens):
  """4 * D * Hq * sum over rows of the keys the row sees."""
  total = 0
  for kv, q in zip(kv_lens, q_lens):
    seen = np.arange(kv - q, kv) + 1
    total += int(seen.sum())
  return 4 * HEAD * Q_HEADS * total


def time_ragged(kv_lens, q_lens, kv_cache_dtype="auto", backend="pallas", **tuning):
  """Device seconds of one ``attend_ragged`` call; ``tuning``: keywords of the kernel call
  (:func:`pallas_kernels.ragged_attention.ragged_paged_attention`), which is then called
  directly."""
  num_blocks, table, lens, cu = _batch(kv_lens, q_lens)
  cache = _cache(num_blocks, kv_cache_dtype)
  query = jax.random.normal(jax.random.key(9), (int(cu[-1]), Q_HEADS, HEAD), jnp.bfloat16)
  planes = layout_lib.planes("flash", BLOCK, KV_HEADS, HEAD, cache.key_cache.dtype)

  def attend(c, q):
    if not tuning:
      return c.attend_ragged(0, q, table, lens, cu, backend=backend)
    return kernels.ragged_paged_attention(
        c.cache_format(), q, c.key_cache, c.value_cache, *c.read_scales(), jnp.int32(0),
        table, lens, cu, jnp.int32(len(kv_lens)), key_plane=planes[0], value_plane=planes[1],
        num_blocks=num_blocks, scale=HEAD ** -0.5, alibi_slopes=None, logits_soft_cap=None,
        sliding_window=None, sinks=None, interpret=False, **tuning)

  return _chain(lambda: (_filled(cache), jnp.copy(query)), attend)


def time_decode(kv_lens, kv_cache_dtype="auto"):
  num_blocks, table, lens, _ = _batch(kv_lens, [1] * len(kv_lens))
  cache = _cache(num_blocks, kv_cache_dtype)
  query = jax.random.normal(jax.random.key(9), (len(kv_lens), Q_HEADS, HEAD), jnp.bfloat16)
  return _chain(lambda: (_filled(cache), jnp.copy(query)),
                lambda c, q: c.attend(0, q, table, lens, backend="pallas"))


def time_gather_dense(kv_lens, q_lens, implementation):
  """Gather the sequences' pages (cache.gather), then jax.nn.dot_product_attention with a
  bottom-right causal mask (every sequence has the same kv and q lengths here)."""
  num_blocks, table, lens, cu = _batch(kv_lens, q_lens)
  cache = _cache(num_blocks)
  batch, kv, q_len = len(kv_lens), int(kv_lens[0]), int(q_lens[0])
  query = jax.random.normal(jax.random.key(9), (batch, q_len, Q_HEADS, HEAD), jnp.bfloat16)
  mask = (jnp.arange(kv)[None, :] <= (kv - q_len + jnp.arange(q_len))[:, None])[None, None]

  def attend(c, q):
    keys, values = c.gather(0, table, lens)
    keys, values = keys.astype(jnp.bfloat16), values.astype(jnp.bfloat16)
    return jax.nn.dot_product_attention(q, keys, values, mask=mask,
                                        implementation=implementation)

  return _chain(lambda: (_filled(cache), jnp.copy(query)), attend)


def matmul_tflops(n=8192):
  """Dense bf16 matmul rate: a chain of x = x @ b (each product needs the last; b scaled
  so values stay O(1)), TFLOP/s and seconds per product."""
  a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  b = (jax.random.normal(jax.random.key(2), (n, n), jnp.float32) * n ** -0.5).astype(
      jnp.bfloat16)

  def step(x, i):
    return jnp.dot(x, b)

  seconds = per_call_seconds(lambda: jnp.copy(a), step, n_small=4, n_large=20, repeats=5)
  return 2 * n ** 3 / seconds / 1e12, seconds


PREFILL = ([8192] * 4, [2048] * 4)
MIXED = ([2048] * 60 + [4096] * 2, [1] * 60 + [512] * 2)


def run(record):
  """``record(case, impl, seconds, amount, ceiling_tbs=None)``."""
  tflops, seconds = matmul_tflops()
  record("dense bf16 matmul 8192^3", "XLA (cuBLAS)", seconds, 2 * 8192 ** 3, tflops)
  prefill = "prefill 4 x 2048 over 6144 cached"
  flops = causal_flops(*PREFILL)
  record(prefill, "jkv ragged pallas", time_ragged(*PREFILL), flops, tflops)
  record(f"{prefill}, fp8 cache", "jkv ragged pallas",
         time_ragged(*PREFILL, kv_cache_dtype="fp8"), flops, tflops)
  record(f"{prefill}, fp8 cache", "jkv ragged pallas, triton prefill",
         time_ragged(*PREFILL, kv_cache_dtype="fp8", prefill_lowering="triton"), flops, tflops)
  for implementation in ("cudnn", "xla"):
    try:
      record(prefill, f"gather + {implementation} attention",
             time_gather_dense(*PREFILL, implementation), flops, tflops)
    except Exception as error:   # a peer that does not run here is reported, not fatal
      print(f"gather + {implementation} failed: {type(error).__name__}: {error}"[:400])
  record(prefill, "jkv ragged pallas, one launch", time_ragged(*PREFILL, one_launch=True),
         flops, tflops)
  record(prefill, "jkv ragged pallas, triton prefill",
         time_ragged(*PREFILL, prefill_lowering="triton"), flops, tflops)
  for batch, context in ((8, 32768), (64, 2048)):
    case = f"decode {batch} x {context // 1024}K"
    nbytes = 2 * batch * context * KV_HEADS * HEAD * 2
    record(case, "jkv ragged pallas", time_ragged([context] * batch, [1] * batch), nbytes)
    record(case, "jkv ragged pallas, one launch",
           time_ragged([context] * batch, [1] * batch, one_launch=True), nbytes)
    record(case, "jkv paged_attention_decode", time_decode([context] * batch), nbytes)
  mixed = "mixed: 60 decodes over 2K + 2 x 512 over 3584"
  mixed_flops = causal_flops(*MIXED)
  record(mixed, "jkv ragged pallas", time_ragged(*MIXED), mixed_flops, tflops)
  record(mixed, "jkv ragged pallas, one launch", time_ragged(*MIXED, one_launch=True),
         mixed_flops, tflops)
  record(mixed, "jkv ragged pallas, triton prefill",
         time_ragged(*MIXED, prefill_lowering="triton"), mixed_flops, tflops)
  decode_s = time_decode([2048] * 60)
  record(mixed, "paged_attention_decode (60 decodes)", decode_s, mixed_flops, tflops)
  try:
    chunks_s = time_gather_dense([4096] * 2, [512] * 2, "cudnn")
    record(mixed, "gather + cudnn (2 chunks)", chunks_s, mixed_flops, tflops)
    record(mixed, "decode + gather + cudnn (sum)", decode_s + chunks_s, mixed_flops, tflops)
  except Exception as error:
    print(f"gather + cudnn failed: {type(error).__name__}: {error}"[:400])


def sweep(record):
  """Prefill tilings of the long programs (rows, K/V tile tokens, warps, stages)."""
  tflops, _ = matmul_tflops()
  flops = causal_flops(*PREFILL)
  for rows, tile, warps, stages in ((128, 32, 4, 3), (128, 32, 4, 2), (128, 64, 4, 2),
                                    (128, 64, 8, 3), (256, 32, 8, 3), (64, 32, 4, 3)):
    try:
      for dtype in ("auto", "fp8"):
        s = time_ragged(*PREFILL, kv_cache_dtype=dtype, long_block_rows=rows,
                        long_tile_tokens=tile, num_warps=warps, num_stages=stages)
        record("prefill 4 x 2048 over 6144 cached" + (", fp8 cache" if dtype == "fp8" else ""),
               f"rows {rows} tile {tile} w{warps} s{stages}", s, flops, tflops)
    except Exception as error:
      print(f"variant {(rows, tile, warps, stages)} failed: {type(error).__name__}: {error}"[:300])
