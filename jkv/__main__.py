"""``python -m jkv``: greedy decoding with a small Llama-style model on a PagedKVCache.

A random-weight Llama-style decoder (:mod:`jkv.models.llama`) prefills a batch of random
prompts (each layer's K/V of all prompt tokens in one ``PagedKVCache.write``, read back with
``PagedKVCache.gather``) and greedily decodes ``--steps`` tokens per sequence, one token
per sequence and step, the whole loop in one ``jax.jit``: every step appends pages from a
``PagePool``, writes K/V of every layer with ``PagedKVCache.write`` and reads them with
``PagedKVCache.attend`` (``lax.scan`` over steps and over layers, the cache donated). Then
it recomputes the same tokens' logits without a cache and checks the cached ones against
them (exit code 1 on a mismatch).

``--engine``: continuous batching instead (:mod:`jkv.models.engine`): ``--requests``
requests with prompts of random lengths (1 to 2 x ``--prompt`` tokens) and random numbers
of new tokens (1 to ``--steps``) arrive in a queue; every step packs the decoding requests
and chunks of the prompts being prefilled into one ragged batch of ``--token-budget`` rows
over ``--max-seqs`` sequence slots, one jitted step with ragged paged attention; finished
requests free their pages for waiting ones. It prints tokens/s and the step mix and checks
every request's logits against a cache-free recompute. ``--shared-prefix N`` starts every
prompt with one N-token "system prompt"; ``--prefix-caching`` lets requests reuse cached
pages of it (``PagePool.match_prefix``) and prints the prompt tokens the cache saved;
``--host-prefix-blocks N`` adds a host tier of N pinned_host blocks for evicted pages.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jkv import backend as backend_lib, fp4, layout
from jkv.cache import QUANT_MODES, PagedKVCache
from jkv.models import engine as engine_lib, llama

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


def make_cache(args, config, num_blocks: int) -> PagedKVCache:
  """An empty cache of the command line's layout and format for the model's layers."""
  return PagedKVCache.create(num_blocks, args.block_size, config.num_kv_heads, config.head_dim,
                             num_layers=config.num_layers, layout=args.layout,
                             dtype=jnp.dtype(config.dtype), quant=args.quant,
                             kv_cache_dtype=args.kv_cache_dtype)


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
  parser.add_argument("--engine", action="store_true",
                      help="continuous batching with chunked prefill (ragged attention)")
  parser.add_argument("--requests", type=int, default=16, help="--engine: requests")
  parser.add_argument("--max-seqs", type=int, default=8, help="--engine: sequence slots")
  parser.add_argument("--token-budget", type=int, default=32,
                      help="--engine: query rows per step")
  parser.add_argument("--shared-prefix", type=int, default=0,
                      help="--engine: tokens of a system prompt every prompt starts with")
  parser.add_argument("--prefix-caching", action="store_true",
                      help="--engine: reuse cached prompt pages across requests")
  parser.add_argument("--host-prefix-blocks", type=int, default=0,
                      help="--engine --prefix-caching: pinned_host blocks that keep evicted "
                           "cached pages")
  args = parser.parse_args(argv)
  for name in ("layers", "batch", "steps", "prompt", "heads", "q_heads", "head_size", "hidden",
               "vocab", "block_size", "requests", "max_seqs", "token_budget"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

  if args.engine and args.token_budget < args.max_seqs:
    parser.error(f"--token-budget ({args.token_budget}) must be >= --max-seqs "
                 f"({args.max_seqs}): every decoding request takes a row each step")
  config = llama.LlamaConfig(
      vocab_size=args.vocab, num_layers=args.layers, hidden_size=args.hidden,
      num_q_heads=args.q_heads or 2 * args.heads, num_kv_heads=args.heads,
      head_dim=args.head_size, intermediate_size=2 * args.hidden,
      max_position=(2 * args.prompt + args.shared_prefix if args.engine else args.prompt)
      + args.steps)
  if args.engine:
    return run_engine(args, parser, config)
  pages_per_seq = -(-(args.prompt + args.steps) // args.block_size)
  num_blocks = 1 + args.batch * pages_per_seq      # page 0 is the pool's null page

  new_cache = functools.partial(make_cache, args, config, num_blocks)
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


def run_engine(args, parser, config) -> int:
  """``--engine``: the continuous-batching loop (module docstring)."""
  if args.shared_prefix < 0:
    parser.error(f"--shared-prefix must be >= 0, got {args.shared_prefix}")
  if args.host_prefix_blocks < 0 or (args.host_prefix_blocks and not args.prefix_caching):
    parser.error("--host-prefix-blocks needs --prefix-caching and must be >= 0")
  max_len = args.shared_prefix + 2 * args.prompt + args.steps
  pages_per_seq = -(-max_len // args.block_size)
  num_blocks = 1 + args.max_seqs * pages_per_seq    # page 0 is the pool's null page
  new_cache = functools.partial(make_cache, args, config, num_blocks)
  try:
    new_cache()
  except ValueError as e:
    parser.error(str(e))
  params = llama.init_params(config, jax.random.key(args.seed))
  rng = np.random.default_rng(args.seed)

  def new_engine():   # a fresh cache: each engine donates its own
    return engine_lib.Engine(params, config, new_cache(), max_seqs=args.max_seqs,
                             token_budget=args.token_budget, max_pages_per_seq=pages_per_seq,
                             prefix_caching=args.prefix_caching,
                             host_prefix_blocks=args.host_prefix_blocks, backend=args.backend)

  warm = new_engine()   # compiles the step (static shapes: every later step reuses it)
  warm.add(engine_lib.Request(np.zeros(2, np.int32), 2))
  warm.run()
  system = rng.integers(0, config.vocab_size, args.shared_prefix)
  requests = [engine_lib.Request(
      np.concatenate([system, rng.integers(0, config.vocab_size,
                                           rng.integers(1, 2 * args.prompt + 1))]).astype(np.int32),
      int(rng.integers(1, args.steps + 1))) for _ in range(args.requests)]
  engine = new_engine()
  for request in requests:
    engine.add(request)
  seconds = engine.run(progress=sys.stderr.isatty())
  prompt_tokens = sum(len(r.prompt) for r in requests)
  new_tokens = sum(len(r.generated) for r in requests)
  error = engine.check(requests)
  full_scale = max(float(np.max(np.abs(np.stack(r.logits)))) for r in requests)
  kind = bound_kind(engine.cache)
  bound = BOUNDS[kind] * full_scale
  ok = error <= bound and not bool(engine.pool.out_of_pages)
  device = jax.devices()[0]
  print(f"jkv engine: Llama-style decoder, {config.num_layers} layers, hidden "
        f"{config.hidden_size}, {config.num_q_heads} q / {config.num_kv_heads} kv heads x "
        f"{config.head_dim}, vocab {config.vocab_size}, {config.dtype}")
  print(f"  requests      {len(requests)} (prompts {args.shared_prefix} shared + 1-"
        f"{2 * args.prompt} tokens, 1-{args.steps} new tokens), {args.max_seqs} slots, "
        f"{args.token_budget} rows a step, block {args.block_size}")
  print(f"  cache         layout {engine.cache.layout}, quant {engine.cache.quant}, "
        f"kv_cache_dtype {engine.cache.kv_cache_dtype}, {engine.cache.nbytes:,} bytes")
  print(f"  back end      {backend_lib.resolve(args.backend)} on {device.platform} "
        f"({device.device_kind})")
  print(f"  tokens/s      {(prompt_tokens + new_tokens) / seconds:,.0f} ({prompt_tokens} prompt "
        f"+ {new_tokens} generated tokens in {seconds:.3f} s, {engine.steps} steps)")
  print(f"  step mix      {engine.decode_rows / engine.steps:.1f} decode rows + "
        f"{engine.prefill_rows / engine.steps:.1f} prefill rows a step on average; "
        f"{engine.mixed_steps} of {engine.steps} steps mixed prefill and decode")
  if args.prefix_caching:
    print(f"  prefix cache  {engine.cached_tokens} of {engine.prompt_tokens} prompt tokens found "
          f"cached (hit rate {engine.cached_tokens / engine.prompt_tokens:.0%}): "
          f"{engine.cached_tokens} prefill tokens saved"
          + (f", {engine.host_prefix.reloaded} pages back from the host tier"
             if engine.host_prefix is not None else ""))
  print(f"  check         {'OK' if ok else 'MISMATCH'}: max |engine - full recompute logit| = "
        f"{error:.3g} (bound {bound:.3g}, {kind} cache)"
        + (", OUT OF PAGES" if bool(engine.pool.out_of_pages) else ""))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
