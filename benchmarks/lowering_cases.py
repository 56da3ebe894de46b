"""Lowering benchmark cases (section "lowering" of RESULTS.md): the Mosaic GPU kernels
against the Triton kernels, timed from the profiler (every kernel of the call, the XLA
fusions around the kernels included):

* the paged write, same shapes as the "write" section (8 heads x 128, bf16 input, page
  16), and one token into a 1 GiB and a 16 GiB cache through the Mosaic kernel (equal
  cost: in place);
* decode attention over a flash cache, page 16, 32 query / 8 kv heads, d128: 8 x 32K
  and 64 x 2K (bf16 and FP8 e4m3 caches), as in the "attention" section."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jkv
from benchmarks import write_cases as wc
from benchmarks.timing import profiled_seconds

DESCRIPTION = ("The paged write and decode attention lowered through Mosaic GPU "
               "(`lowering=\"mosaic\"`; write: TMA loads of the tokens' rows, a TMA store "
               "per token; attention: TMA page tiles, wgmma, online softmax; over an FP8 "
               "cache with the keys as wgmma's M, S^T = K Q^T and O^T = V^T P^T) and through "
               "Triton, on the same inputs. Device time is the sum of the call's GPU kernels "
               "in the profiler, 20 calls. Bytes: write, K and V read and written (FP8: bf16 "
               "read, FP8 written); attention, the K and V cache entries read.")


def _time(layout, kv_layout, num_tokens, num_blocks, slots, lowering, kv_cache_dtype="auto"):
  cache_dtype = jnp.bfloat16 if kv_cache_dtype == "auto" else jnp.float8_e4m3fn
  key, value = wc.random_inputs(num_tokens, 7)

  def write(caches):
    return tuple(jkv.write_kv(key, value, caches[0], caches[1] if len(caches) > 1 else None,
                              slots, layout=layout, kv_layout=kv_layout,
                              kv_cache_dtype=kv_cache_dtype, lowering=lowering))

  caches = wc.make_caches(layout, kv_layout, num_blocks, cache_dtype)
  seconds, _ = profiled_seconds(jax.jit(write, donate_argnums=0), caches)
  return seconds


def _time_decode(batch, context, kv_cache_dtype, lowering):
  """(seconds, bytes) of decode attention over a flash cache of ``batch`` sequences of
  ``context`` tokens (page 16, 32 / 8 heads, d128)."""
  heads, q_heads, head_size, block = 8, 32, 128, 16
  width = context // block
  num_blocks = batch * width
  table = jnp.asarray(np.random.default_rng(0).permutation(num_blocks).reshape(batch, width),
                      jnp.int32)
  lens = jnp.full((batch,), context, jnp.int32)
  dtype = jnp.bfloat16 if kv_cache_dtype == "auto" else jnp.float8_e4m3fn
  shape = (num_blocks, block, heads, head_size)
  caches = tuple((jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 0.5).astype(dtype)
                 for seed in (1, 2))
  query = jax.random.normal(jax.random.key(9), (batch, q_heads, head_size), jnp.bfloat16)
  scales = {} if kv_cache_dtype == "auto" else dict(k_scale=0.05, v_scale=0.05)

  def step(state):   # the output is the next call's query: no call is dropped or merged
    key_cache, value_cache, query = state
    out = jkv.paged_attention_decode(query, key_cache, value_cache, table, lens, layout="flash",
                                     kv_cache_dtype=kv_cache_dtype, lowering=lowering, **scales)
    return key_cache, value_cache, out

  seconds, _ = profiled_seconds(jax.jit(step, donate_argnums=0), caches + (query,))
  return seconds, 2 * batch * context * heads * head_size * np.dtype(dtype).itemsize


def run(record):
  """``record(case, impl, seconds, nbytes)``; returns the 16 GiB / 1 GiB one-token ratio."""
  fp8_bytes = 3 * wc.HEADS * wc.HEAD_SIZE * 2   # bf16 K and V read, FP8 written
  rng = np.random.default_rng(3)
  dec_blocks = 4096
  dec = jnp.asarray(rng.permutation(dec_blocks * wc.BLOCK)[:256], jnp.int32)
  for lowering in ("triton", "mosaic"):
    record("decode 256 flash", lowering, _time("flash", "NHD", 256, dec_blocks, dec, lowering),
           256 * wc.BYTES_PER_TOKEN)
  num_blocks = 2 * wc.TOKENS // wc.BLOCK
  for tokens in (1024, 4096, 16384):   # where auto's threshold comes from
    part = wc.prefill_slots(tokens, num_blocks, 0, 1)[0]
    for lowering in ("triton", "mosaic"):
      record(f"prefill {tokens // 1024}K flash", lowering,
             _time("flash", "NHD", tokens, num_blocks, part, lowering),
             tokens * wc.BYTES_PER_TOKEN)
  slots = wc.prefill_slots(wc.TOKENS, num_blocks, 0, 1)[0]
  for layout, kv_layout in [("flash", "NHD"), ("hnd", "NHD"), ("packed", "NHD"),
                            ("packed", "HND")]:
    case = f"prefill 32K {layout}" + (f" {kv_layout}" if layout == "packed" else "")
    for lowering in ("triton", "mosaic"):
      record(case, lowering, _time(layout, kv_layout, wc.TOKENS, num_blocks, slots, lowering),
             wc.TOKENS * wc.BYTES_PER_TOKEN)
  for lowering in ("triton", "mosaic"):
    record("prefill 32K flash FP8", lowering,
           _time("flash", "NHD", wc.TOKENS, num_blocks, slots, lowering, "fp8"),
           wc.TOKENS * fp8_bytes)
  for batch, context, kv_cache_dtype, case in (
      (8, 32768, "auto", "decode attention 8 x 32K bf16"),
      (8, 32768, "fp8", "decode attention 8 x 32K FP8"),
      (64, 2048, "auto", "decode attention 64 x 2K bf16"),
      (64, 2048, "fp8", "decode attention 64 x 2K FP8")):
    for lowering in ("triton", "mosaic"):
      record(case, lowering, *_time_decode(batch, context, kv_cache_dtype, lowering))
  one = {}
  for gib in (1, 16):
    nb = int(gib * 2**30) // (2 * wc.BLOCK * wc.HEADS * wc.HEAD_SIZE * 2)
    token_slot = jnp.asarray(rng.integers(0, nb * wc.BLOCK, 1), jnp.int32)
    one[gib] = _time("flash", "NHD", 1, nb, token_slot, "mosaic")
    record(f"1 token into {gib} GiB cache", "mosaic", one[gib], wc.BYTES_PER_TOKEN)
  ratio = one[16] / one[1]
  print(f"16 GiB / 1 GiB one-token Mosaic write time ratio: {ratio:.3f}")
  return ratio


REPEATS = 3
MEDIAN_DESCRIPTION = (
    "Decode attention over a flash cache (page 16, 32 query / 8 kv heads, d128, bf16), each "
    f"row the median of {REPEATS} independent measurements (fresh caches and a fresh "
    "compile each) of the summed GPU kernel time in the profiler over 20 calls; the spread "
    "((max - min) / median) is in the implementation column. `auto` is what a call without "
    "`lowering=` runs on this GPU. Bytes: the K and V cache entries read.")


def run_median(record):
  """``record(case, impl, seconds, nbytes)``: the decode rows, each the median of REPEATS
  measurements with their spread (issue 28: a target met or missed for real)."""
  for batch, context, case, lowerings in (
      (64, 2048, "decode attention 64 x 2K bf16", ("triton", "mosaic", "auto")),
      (8, 32768, "decode attention 8 x 32K bf16", ("triton", "mosaic", "auto"))):
    for lowering in lowerings:
      runs = [_time_decode(batch, context, "auto", lowering) for _ in range(REPEATS)]
      seconds = [s for s, _ in runs]
      median = float(np.median(seconds))
      spread = (max(seconds) - min(seconds)) / median
      record(case, f"{lowering} (median of {REPEATS}, spread {spread:.1%})", median, runs[0][1])
