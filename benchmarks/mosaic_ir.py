"""Fingerprints of the Mosaic GPU kernels, to show that a host-side change leaves them as
they were:

    python -m benchmarks.mosaic_ir > before.txt   # then change the code
    python -m benchmarks.mosaic_ir > after.txt && diff before.txt after.txt

Lowers the Mosaic GPU write, decode attention and ragged attention (prefill tiles and
short items) for CUDA on any machine (no GPU needed; jax >= 0.11.2), over flash / hnd /
packed layouts (and the FP8 vllm / asm decode), pages of 16, 32, 64 and 128 tokens, 16-bit
and FP8 caches, GQA groups of 4 and 3 (two compute warpgroups in the ragged prefill, or
one) and, over an FP8 cache, fp16 queries as well as bf16 ones (three e4m3 query terms,
not two), and prints one line per kernel: the SHA-256 of its Mosaic IR after MLIR's ``canonicalize`` and ``cse`` passes,
printed without locations. Line numbers then do not count, nor do index computations that
fold away (``ref.at[a].at[b]`` against ``ref.at[a, b]``); any change to what the kernel
does does.

This hooks JAX internals (``jax.experimental.mosaic.gpu.core._mosaic_gpu_lowering_rule``
and ``jax._src.source_info_util.user_frame``, as in jax 0.12): a development tool, not
part of the library or of CI.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

import jkv
from jkv.mla_cache import MLACache
from pallas_kernels import lowering

_captured: list[str] = []


def _hook():
  """Routes every Mosaic GPU kernel through a copy that canonicalizes and keeps its IR."""
  from jax._src import source_info_util
  from jax._src.lib.mlir import ir, passmanager
  from jax.experimental.mosaic.gpu import core

  lower_kernel = core._mosaic_gpu_lowering_rule

  def capturing(ctx, *args, module, **kwargs):
    text = module.operation.get_asm(enable_debug_info=False)
    copy = ir.Module.parse(text, context=module.context)
    passmanager.PassManager.parse("builtin.module(canonicalize,cse)",
                                  context=module.context).run(copy.operation)
    _captured.append(copy.operation.get_asm(enable_debug_info=False))
    return lower_kernel(ctx, *args, module=module, **kwargs)

  core._mosaic_gpu_lowering_rule = capturing
  source_info_util.user_frame = lambda *args, **kwargs: None   # no file:line locations


def _kernels(fn, *args) -> list[str]:
  """The canonical IR of every Mosaic kernel ``fn(*args)`` lowers to, for CUDA."""
  from tests.test_cuda_lowering import gpu_target
  _captured.clear()
  with gpu_target():
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  return list(_captured)


def cases():
  """(name, fn, args) of the Mosaic kernels' calls."""
  rng = np.random.default_rng(0)
  heads, head_size = 2, 128
  query = jnp.asarray(rng.standard_normal((150, 4 * heads, head_size)), jnp.bfloat16)
  query_fp16 = query.astype(jnp.float16)
  kv_lens = jnp.asarray([200, 37, 130, 100], jnp.int32)
  cu_q_lens = jnp.asarray([0, 120, 121, 124, 150], jnp.int32)
  tokens = jnp.asarray(rng.standard_normal((40, heads, head_size)), jnp.bfloat16)
  slots = jnp.asarray(rng.permutation(1024)[:40], jnp.int32).at[3].set(-1)
  for layout, block_size in (("flash", 16), ("hnd", 16), ("packed", 16), ("flash", 128),
                             ("hnd", 64)):
    for kv_cache_dtype in ("auto", "fp8"):
      if layout == "packed" and kv_cache_dtype == "fp8":
        continue
      num_blocks = 1024 // block_size
      cache = jkv.PagedKVCache.create(
          num_blocks, block_size, heads, head_size, num_layers=2, layout=layout,
          kv_cache_dtype=kv_cache_dtype, k_scale=jnp.asarray([0.5, 2.0]),
          v_scale=jnp.asarray([1.5, 0.25]))
      table = jnp.arange(num_blocks, dtype=jnp.int32).reshape(4, -1)
      options = dict(layout=layout, kv_cache_dtype=kv_cache_dtype, layer=1,
                     backend="pallas", lowering="mosaic")
      scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)

      def ragged(c, q, table=table, options=options, scales=scales):
        return jkv.ragged_paged_attention(q, c.key_cache, c.value_cache, table, kv_lens,
                                          cu_q_lens, **options, **scales)

      def decode(c, q, table=table, options=options, scales=scales):
        return jkv.paged_attention_decode(q[:4], c.key_cache, c.value_cache, table, kv_lens,
                                          **options, **scales)

      def write(c, k, options=options):
        return jkv.write_kv(k, -k, c.key_cache, c.value_cache, slots, **options)

      name = f"{layout} page {block_size} {kv_cache_dtype}"
      yield name + " ragged", ragged, (cache, query)
      if block_size == 16 and layout != "packed":   # a group of 3: one compute warpgroup
        yield name + " ragged, group of 3", ragged, (cache, query[:, :3 * heads])
      yield name + " decode", decode, (cache, query)
      if (layout, block_size, kv_cache_dtype) == ("flash", 16, "fp8"):   # three query terms
        fp16_queries = [(name + " ragged, fp16 queries", ragged, (cache, query_fp16)),
                        (name + " decode, fp16 queries", decode, (cache, query_fp16))]
      if block_size == 16:
        yield name + " write", write, (cache, tokens)
  # Last: a fingerprint also depends on the kernels lowered before it in the process.
  yield from fp16_queries
  # Then the MLA decode: one latent head, rank 512 + 64, 16 query heads.
  mla_query = jnp.asarray(rng.standard_normal((4, 16, 576)), jnp.bfloat16)
  mla_table = jnp.arange(64, dtype=jnp.int32).reshape(4, 16)
  for kv_cache_dtype in ("fp8_split", "fp8_ds_mla"):
    cache = MLACache.create(64, 16, 512, 64, num_layers=2, kv_cache_dtype=kv_cache_dtype)

    def mla(c, q, table=mla_table):
      return c.attend(1, q, table, kv_lens, scale=0.07, backend="pallas", lowering="mosaic")

    yield f"MLA {kv_cache_dtype}", mla, (cache, mla_query)
  # Then the FP8 decode over x-vectorized keys (vLLM pages of 16 tokens, ASM of 32 and 128).
  for layout, block_size in (("vllm", 16), ("asm", 32), ("asm", 128)):
    num_blocks = 1024 // block_size
    cache = jkv.PagedKVCache.create(num_blocks, block_size, heads, head_size, num_layers=2,
                                    layout=layout, kv_cache_dtype="fp8",
                                    k_scale=jnp.asarray([0.5, 2.0]),
                                    v_scale=jnp.asarray([1.5, 0.25]))
    table = jnp.arange(num_blocks, dtype=jnp.int32).reshape(4, -1)

    def x_decode(c, q, table=table, layout=layout):
      return jkv.paged_attention_decode(q[:4], c.key_cache, c.value_cache, table, kv_lens,
                                        layout=layout, kv_cache_dtype="fp8", layer=1,
                                        k_scale=c.k_scale, v_scale=c.v_scale,
                                        backend="pallas", lowering="mosaic")

    yield f"{layout} page {block_size} fp8 decode", x_decode, (cache, query)


def main():
  if not lowering.mosaic_available():
    raise SystemExit("the Mosaic GPU kernels need jax >= 0.11.2")
  _hook()
  for name, fn, args in cases():
    for i, text in enumerate(_kernels(fn, *args)):
      print(f"{name} kernel {i}: {hashlib.sha256(text.encode()).hexdigest()[:16]}", flush=True)


if __name__ == "__main__":
  main()
