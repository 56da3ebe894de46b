"""Lowering benchmark cases (section "lowering" of RESULTS.md): the paged write's Mosaic
GPU kernel against its Triton kernel, same shapes as the "write" section (8 heads x 128,
bf16 input, page 16), timed from the profiler (every kernel of the call, the Mosaic path's
one XLA fusion that lays out its slots and scales included), and one token into a 1 GiB
and a 16 GiB cache through the Mosaic kernel (equal cost: in place)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jkv
from benchmarks import write_cases as wc
from benchmarks.timing import profiled_seconds

DESCRIPTION = ("The paged write lowered through Mosaic GPU (`lowering=\"mosaic\"`: TMA loads "
               "of the tokens' rows, a TMA store per token) and through Triton, on the same "
               "inputs. Device time is the sum of the call's GPU kernels in the profiler, 20 "
               "calls. Bytes: K and V read and written (FP8: bf16 read, FP8 written).")


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
  one = {}
  for gib in (1, 16):
    nb = int(gib * 2**30) // (2 * wc.BLOCK * wc.HEADS * wc.HEAD_SIZE * 2)
    token_slot = jnp.asarray(rng.integers(0, nb * wc.BLOCK, 1), jnp.int32)
    one[gib] = _time("flash", "NHD", 1, nb, token_slot, "mosaic")
    record(f"1 token into {gib} GiB cache", "mosaic", one[gib], wc.BYTES_PER_TOKEN)
  ratio = one[16] / one[1]
  print(f"16 GiB / 1 GiB one-token Mosaic write time ratio: {ratio:.3f}")
  return ratio
