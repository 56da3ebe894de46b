"""``python -m jkv``: greedy decoding with a small Llama-style model on a PagedKVCache.

A random-weight Llama-style decoder (:mod:`jkv.models.llama`) prefills a batch of random
prompts (each layer's K/V of all prompt tokens in one ``PagedKVCache.write``, read back with
``PagedKVCache.gather``) and greedily decodes ``--steps`` tokens per sequence, one token
per sequence and step, the whole loop in one ``jax.jit``: every step appends pages from a
``PagePool``, writes K/V of every layer with ``PagedKVCache.write`` and reads them with
``PagedKVCache.attend`` (``lax.scan`` over steps and over layers, the cache donated). Then
it recomputes the same tokens' logits without a cache and checks the cached ones against
them (exit code 1 on a mismatch).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jkv import backend as backend_lib, fp4, layout
from jkv.cache import QUANT_MODES, PagedKVCache
from jkv.models import llama

# Allowed max |cached - full recompute logit|, as a fraction of the largest |logit|: float
# caches differ by float32 rounding only; quantized ones by their rounding (measured with
# the default sizes over seeds 0-3: up to 8% for the 8-bit modes, per-tensor FP8 and
# per-block scales the coarsest, and up to 35% for FP4, MXFP4 the coarser).
BOUNDS = {"float": 1e-4, "8-bit": 0.25, "fp4": 0.75}


def bound_kind(cache: PagedKVCache) -> str:
  """The BOUNDS entry of a cache's storage."""
  if cache.quant in fp4.FORMATS:
    return "fp4"
  return "float" if cache.cache_format().quant == "none" else "8-bit"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--steps", type=int, default=64, help="tokens decoded per sequence")
  parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
  parser.add_argument("--heads", type=int, default=4, help="kv heads")
  parser.add_argument("--q-heads", type=int, help="query heads (default 2 x kv heads)")
  parser.add_argument("--head-size", type=int, default=64)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--vocab", type=int, default=512)
  parser.add_argument("--block-size", type=int, default=16)
  parser.add_argument("--layout", default="vllm", choices=layout.LAYOUTS)
  parser.add_argument("--quant", default="tensor", choices=QUANT_MODES,
                      help="mxfp4 / nvfp4 need --layout hnd")
  parser.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e4m3fnuz, "
                      "fp8_e5m2, or int8 (quant token / block)")
  parser.add_argument("--backend", default="auto",
                      choices=("auto", "pallas", "interpret", "reference"))
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  for name in ("layers", "batch", "steps", "prompt", "heads", "q_heads", "head_size", "hidden",
               "vocab", "block_size"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

  config = llama.LlamaConfig(
      vocab_size=args.vocab, num_layers=args.layers, hidden_size=args.hidden,
      num_q_heads=args.q_heads or 2 * args.heads, num_kv_heads=args.heads,
      head_dim=args.head_size, intermediate_size=2 * args.hidden,
      max_position=args.prompt + args.steps)
  pages_per_seq = -(-(args.prompt + args.steps) // args.block_size)
  num_blocks = 1 + args.batch * pages_per_seq      # page 0 is the pool's null page

  def new_cache():
    return PagedKVCache.create(num_blocks, args.block_size, config.num_kv_heads,
                               config.head_dim, num_layers=config.num_layers,
                               layout=args.layout, dtype=jnp.dtype(config.dtype),
                               quant=args.quant, kv_cache_dtype=args.kv_cache_dtype)

  try:
    cache = new_cache()
  except ValueError as e:
    parser.error(str(e))
  params_key, prompt_key = jax.random.split(jax.random.key(args.seed))
  params = llama.init_params(config, params_key)
  prompt = jax.random.randint(prompt_key, (args.batch, args.prompt), 0, config.vocab_size)

  def run(cache):
    return llama.generate(params, config, cache, prompt, args.steps, backend=args.backend)

  jax.block_until_ready(run(cache))               # compile + warm up
  start = time.perf_counter()
  tokens, logits, cache, pool = jax.block_until_ready(run(new_cache()))
  seconds = time.perf_counter() - start

  full = llama.full_logits_of(params, config, prompt, tokens)
  error = float(jnp.max(jnp.abs(logits - full)))
  kind = bound_kind(cache)
  bound = BOUNDS[kind] * float(jnp.max(jnp.abs(full)))
  ok = error <= bound and not bool(pool.out_of_pages)
  device = jax.devices()[0]
  print(f"jkv demo: Llama-style decoder, {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_q_heads} q / {config.num_kv_heads} kv heads x {config.head_dim}, vocab "
        f"{config.vocab_size}, {config.dtype}")
  print(f"  batch {args.batch}, prompt {args.prompt} (one prefill) + {args.steps} greedy "
        f"decode steps, block {args.block_size}, pages from PagePool")
  print(f"  cache         layout {cache.layout}, quant {cache.quant}, kv_cache_dtype "
        f"{cache.kv_cache_dtype}, {cache.nbytes:,} bytes")
  print(f"  back end      {backend_lib.resolve(args.backend)} on {device.platform} "
        f"({device.device_kind})")
  print(f"  tokens/s      {args.batch * args.steps / seconds:,.0f} (prompt + decode loop in "
        f"one jit, {seconds:.3f} s)")
  print(f"  first tokens  {np.asarray(tokens[0, :8]).tolist()}")
  print(f"  check         {'OK' if ok else 'MISMATCH'}: max |cached - full recompute logit| = "
        f"{error:.3g} (bound {bound:.3g}, {kind} cache)"
        + (", OUT OF PAGES" if bool(pool.out_of_pages) else ""))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
