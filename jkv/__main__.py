"""``python -m jkv``: a jitted decode loop streaming K/V into a multi-layer PagedKVCache.

A batch of sequences with scattered pages; every step writes one token per sequence
into every layer (``lax.scan`` over steps, ``fori_loop`` over layers with a traced
layer index), the cache donated to the jit. Then it reads every sequence back with
``PagedKVCache.gather`` and checks it against a plain contiguous reference.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jkv import backend as backend_lib
from jkv import pages
from jkv.cache import PagedKVCache


def token_kv(step, layer, batch, num_heads, head_size):
  """Deterministic K/V of one step and layer: [batch, H, D] each."""
  k = jax.random.normal(jax.random.fold_in(jax.random.key(step), layer),
                        (2, batch, num_heads, head_size), jnp.float32)
  return k[0], k[1]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--steps", type=int, default=64)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--head-size", type=int, default=64)
  parser.add_argument("--block-size", type=int, default=16)
  parser.add_argument("--layout", default="vllm")
  parser.add_argument("--backend", default="auto")
  args = parser.parse_args(argv)

  blocks_per_seq = -(-args.steps // args.block_size)
  num_blocks = 2 * args.batch * blocks_per_seq
  rng = np.random.default_rng(0)
  block_table = jnp.asarray(
      rng.permutation(num_blocks)[: args.batch * blocks_per_seq].reshape(args.batch, -1), jnp.int32)
  cache = PagedKVCache.create(num_blocks, args.block_size, args.heads, args.head_size,
                              num_layers=args.layers, layout=args.layout, dtype=jnp.float32)
  backend = args.backend

  def decode(cache, block_table):
    def step(cache, t):
      seq_lens = jnp.full((args.batch,), t, jnp.int32)
      slots = pages.decode_slot_mapping(block_table, seq_lens, args.block_size)

      def layer_body(layer, cache):
        k, v = token_kv(t, layer, args.batch, args.heads, args.head_size)
        return cache.write(layer, k, v, slots, backend=backend)

      return jax.lax.fori_loop(0, args.layers, layer_body, cache), None

    cache, _ = jax.lax.scan(step, cache, jnp.arange(args.steps))
    return cache

  run = jax.jit(decode, donate_argnums=0)
  jax.block_until_ready(run(cache, block_table))  # compile + warm up
  cache = PagedKVCache.create(num_blocks, args.block_size, args.heads, args.head_size,
                              num_layers=args.layers, layout=args.layout, dtype=jnp.float32)
  start = time.perf_counter()
  cache = jax.block_until_ready(run(cache, block_table))
  seconds = time.perf_counter() - start

  seq_lens = jnp.full((args.batch,), args.steps, jnp.int32)
  worst = 0.0
  for layer in range(args.layers):
    k, v = cache.gather(layer, block_table, seq_lens)
    ref = [token_kv(t, layer, args.batch, args.heads, args.head_size) for t in range(args.steps)]
    ref_k = jnp.stack([r[0] for r in ref], axis=1)
    ref_v = jnp.stack([r[1] for r in ref], axis=1)
    worst = max(worst, float(jnp.max(jnp.abs(k[:, : args.steps] - ref_k))),
                float(jnp.max(jnp.abs(v[:, : args.steps] - ref_v))))
  ok = worst == 0.0
  device = jax.devices()[0]
  print(f"jkv demo: {args.layers} layers x {args.batch} sequences x {args.steps} decode steps, "
        f"layout {args.layout}, {args.heads} kv heads x {args.head_size}, block {args.block_size}")
  print(f"  back end      {backend_lib.resolve(backend)} on {device.platform} ({device.device_kind})")
  print(f"  cache bytes   {cache.nbytes:,}")
  print(f"  steps/s       {args.steps / seconds:,.1f} ({args.steps * args.batch / seconds:,.0f} "
        f"tokens/s, whole loop in one jit)")
  print(f"  read back     {'OK' if ok else 'MISMATCH'}: max |gathered - contiguous reference| = "
        f"{worst}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
