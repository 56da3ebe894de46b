"""Decode attention benchmark cases (issue 6 targets): paged decode attention at batch 8,
32K context, 32 query / 8 kv heads, d128 (bf16 cache, FP8 and INT8 caches), beside the
jitted reference and JAX's own ``jax.experimental.pallas.ops.gpu.paged_attention``; MLA
decode at batch 64, 8K context; FP4 (mxfp4 / nvfp4) caches, through the reference (their
kernel was removed: not 1.5x faster than it).

DESCRIPTION (below) goes into RESULTS.md with the table.
"""

from __future__ import annotations

DESCRIPTION = """Batch 8, every sequence 32768 tokens, 32 query / 8 kv heads, head size 128,
block 16, scattered pages; bf16 queries. Bytes counted = the K and V entries read (plus
their scales); one call per row. MLA: batch 64, 8192 tokens, 16 query heads, entries
[kv_c 512 | k_pe 64] bf16 (single-head cache), latent output; fp8_split: FP8 kv_c + bf16
k_pe + a float32 scale per entry (644 bytes); fp8_ds_mla: vLLM's 656-byte entries (FP8
kv_c, 4 float32 tile scales, bf16 k_pe). FP8 hnd / vllm / asm and fp8_split / fp8_ds_mla
"jkv pallas" on a Hopper GPU: the Mosaic GPU kernels (keys as wgmma's M, query heads as its
N); "triton lowering": the Triton ones, the default elsewhere. JAX's kernel takes its own
layout ([kv_heads, pages, page_size, head]) with the same bytes. 'key chunk' rows
(--sweep): the Triton kernel's vLLM / ASM read variants (x-vectorized keys read in chunks of D or
16 / 32 head dims, values loaded as [tile, D] or transposed, with the logits); the
defaults are the fastest: 16-dim chunks and transposed values for one-byte caches, one
chunk and [tile, D] for bf16.
Each call's cache and query pass a barrier with the previous output, so a reference's
gather is done per call."""

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import per_call_seconds
from jkv import fp4
from jkv.backend import LOWERING_ENV_VAR
from jkv.cache import PagedKVCache
from jkv.mla_cache import MLACache
from jkv.formats import ds_mla_entry_bytes
from jkv.reference.mla import ds_mla_entries

BATCH, CONTEXT, Q_HEADS, KV_HEADS, HEAD, BLOCK = 8, 32768, 32, 8, 128, 16
MLA_BATCH, MLA_CONTEXT, MLA_HEADS, RANK, PE = 64, 8192, 16, 512, 64


def _tables(batch, context, seed=0):
  width = context // BLOCK
  num_blocks = batch * width
  rng = np.random.default_rng(seed)
  table = rng.permutation(num_blocks).reshape(batch, width).astype(np.int32)
  return num_blocks, jnp.asarray(table), jnp.full((batch,), context, jnp.int32)


def _fill(shape, dtype, seed):
  """Random cache contents, made on the device (no host transfer of a GiB)."""
  key = jax.random.key(seed)
  if jnp.issubdtype(dtype, jnp.integer):
    return jax.random.randint(key, shape, -127, 128, jnp.int32).astype(dtype)
  return (jax.random.normal(key, shape, jnp.float32) * 0.5).astype(dtype)


def _chain(make, attend):
  """Device seconds of one call: every call's query and cache arrays pass through a
  barrier with the previous output, so no call can be merged with another and no work
  on the cache alone (a reference's or a peer's gather) is hoisted out of the chain and
  done once; every output is used."""

  def step(state, i):
    arrays, query, total = state
    out = attend(arrays, query)
    arrays, query, out = jax.lax.optimization_barrier((arrays, query, out))
    return arrays, query, total + out[0, 0, 0].astype(jnp.float32)

  def make_state():
    arrays, query = make()
    return arrays, query, jnp.zeros((), jnp.float32)

  return per_call_seconds(make_state, step, n_small=4, n_large=20, repeats=5)


@contextlib.contextmanager
def lowering_env(lowering):
  """$JKV_LOWERING set to ``lowering`` inside the block (``"auto"``: left as it is)."""
  if lowering == "auto":
    yield
    return
  previous = os.environ.get(LOWERING_ENV_VAR)
  os.environ[LOWERING_ENV_VAR] = lowering
  try:
    yield
  finally:
    if previous is None:
      del os.environ[LOWERING_ENV_VAR]
    else:
      os.environ[LOWERING_ENV_VAR] = previous


def time_paged(layout, backend, *, kv_cache_dtype="auto", quant="tensor", lowering="auto"):
  num_blocks, table, lens = _tables(BATCH, CONTEXT)
  cache = PagedKVCache.create(num_blocks, BLOCK, KV_HEADS, HEAD, layout=layout,
                              kv_cache_dtype=kv_cache_dtype, quant=quant, k_scale=0.05,
                              v_scale=0.05)
  storage = cache.key_cache.dtype
  query = jax.random.normal(jax.random.key(9), (BATCH, Q_HEADS, HEAD), jnp.bfloat16)

  def make():
    fields = {"key_cache": _fill(cache.key_cache.shape, storage, 1),
              "k_scale": jnp.copy(cache.k_scale), "v_scale": jnp.copy(cache.v_scale)}
    if cache.value_cache is not None:
      fields["value_cache"] = _fill(cache.value_cache.shape, storage, 2)
    if quant == "token":
      fields["k_scale"] = jnp.full(cache.k_scale.shape, 0.01, jnp.float32)
      fields["v_scale"] = jnp.full(cache.v_scale.shape, 0.01, jnp.float32)
    for name in ("k_global_scale", "v_global_scale"):   # nvfp4 (donated with the cache)
      if getattr(cache, name) is not None:
        fields[name] = jnp.copy(getattr(cache, name))
    return cache.replace(**fields), jnp.copy(query)

  # PagedKVCache.attend takes the lowering from $JKV_LOWERING (read when the chain traces)
  with lowering_env(lowering):
    seconds = _chain(make, lambda c, q: c.attend(0, q, table, lens, backend=backend))
  if quant in fp4.FORMATS:   # packed E2M1 bytes + one scale byte per group
    per_entry = HEAD // 2 + HEAD // fp4.GROUP_SIZE[quant]
  else:
    per_entry = HEAD * np.dtype(storage).itemsize + (4 if quant == "token" else 0)
  return seconds, 2 * BATCH * CONTEXT * KV_HEADS * per_entry


def time_jax_paged_attention():
  """JAX's Pallas paged attention (bf16), its layout and default tiling."""
  from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
  num_blocks, table, lens = _tables(BATCH, CONTEXT)
  shape = (KV_HEADS, num_blocks, BLOCK, HEAD)
  query = jax.random.normal(jax.random.key(9), (BATCH, Q_HEADS, HEAD), jnp.bfloat16)

  def make():
    return (_fill(shape, jnp.bfloat16, 1), _fill(shape, jnp.bfloat16, 2)), jnp.copy(query)

  seconds = _chain(make, lambda kv, q: jax_paged.paged_attention(q, kv[0], kv[1], table, lens))
  return seconds, 2 * BATCH * CONTEXT * KV_HEADS * HEAD * 2


def _ds_mla_entries(shape, seed):
  """Valid fp8_ds_mla entries uint8 ``shape`` [NB, bs, E] of random kv_c / k_pe."""
  tokens = shape[0] * shape[1]
  kv_c = _fill((tokens, RANK), jnp.bfloat16, seed)
  k_pe = _fill((tokens, PE), jnp.bfloat16, seed + 1)
  return jax.jit(ds_mla_entries)(kv_c, k_pe).reshape(shape)


def time_mla(backend, kv_cache_dtype="auto", lowering="auto"):
  """MLA decode; ``fp8_split``: FP8 content + bf16 RoPE part + a float32 scale per entry;
  ``fp8_ds_mla``: vLLM's 656-byte entries (FP8 content, 4 float32 tile scales, bf16 RoPE);
  ``lowering``: as :func:`jkv.ops.mla.mla_attention`."""
  num_blocks, table, lens = _tables(MLA_BATCH, MLA_CONTEXT, seed=3)
  cache = MLACache.create(num_blocks, BLOCK, RANK, PE, kv_cache_dtype=kv_cache_dtype)
  query = jax.random.normal(jax.random.key(8), (MLA_BATCH, MLA_HEADS, RANK + PE), jnp.bfloat16)

  def make():
    kv_cache = (_ds_mla_entries(cache.kv_cache.shape[1:], 4)[None]
                if kv_cache_dtype == "fp8_ds_mla"
                else _fill(cache.kv_cache.shape, cache.kv_cache.dtype, 4))
    fields = {"kv_cache": kv_cache, "scale": jnp.copy(cache.scale)}
    if cache.rope_cache is not None:
      fields["rope_cache"] = _fill(cache.rope_cache.shape, jnp.bfloat16, 5)
      fields["entry_scale"] = jnp.full(cache.entry_scale.shape, 0.01, jnp.float32)
    return cache.replace(**fields), jnp.copy(query)

  seconds = _chain(make, lambda c, q: c.attend(0, q, table, lens, scale=0.07, backend=backend,
                                               lowering=lowering))
  entry = {"fp8_split": RANK + 2 * PE + 4,
           "fp8_ds_mla": ds_mla_entry_bytes(RANK, PE)}.get(kv_cache_dtype, (RANK + PE) * 2)
  return seconds, MLA_BATCH * MLA_CONTEXT * entry


def run(record):
  """``record(case, impl, seconds, bytes_moved)``."""
  case = "decode 8 x 32K, 32/8 heads, d128"
  for layout in ("hnd", "flash", "vllm"):
    record(f"{case}, bf16 {layout}", "jkv pallas", *time_paged(layout, "pallas"))
  try:
    record(f"{case}, bf16", "jax.experimental paged_attention", *time_jax_paged_attention())
  except Exception as error:   # a peer that does not run here is reported, not fatal
    print(f"jax paged_attention failed: {type(error).__name__}: {error}")
  record(f"{case}, bf16 hnd", "jkv reference (XLA)", *time_paged("hnd", "reference"))
  record(f"{case}, fp8 hnd", "jkv pallas", *time_paged("hnd", "pallas", kv_cache_dtype="fp8"))
  for layout in ("vllm", "asm"):   # auto: Mosaic on Hopper
    record(f"{case}, fp8 {layout}", "jkv pallas",
           *time_paged(layout, "pallas", kv_cache_dtype="fp8"))
    record(f"{case}, fp8 {layout}", "jkv pallas, triton lowering",
           *time_paged(layout, "pallas", kv_cache_dtype="fp8", lowering="triton"))
  record(f"{case}, fp8 hnd", "jkv reference (XLA)",
         *time_paged("hnd", "reference", kv_cache_dtype="fp8"))
  for layout in ("hnd", "vllm"):
    record(f"{case}, int8 per-token {layout}", "jkv pallas",
           *time_paged(layout, "pallas", kv_cache_dtype="int8", quant="token"))
  for fmt in fp4.FORMATS:   # no kernel: what reading an FP4 cache costs
    record(f"{case}, {fmt} hnd", "jkv reference (XLA)",
           *time_paged("hnd", "reference", quant=fmt))
  mla = "MLA decode 64 x 8K, 16 heads, 512+64"
  record(mla, "jkv pallas", *time_mla("pallas"))
  record(mla, "jkv reference (XLA)", *time_mla("reference"))
  for kv_cache_dtype in ("fp8_split", "fp8_ds_mla"):
    for backend in ("pallas", "reference"):
      record(f"{mla}, {kv_cache_dtype}",
             "jkv pallas" if backend == "pallas" else "jkv reference (XLA)",
             *time_mla(backend, kv_cache_dtype))
  for kv_cache_dtype in ("fp8_split", "fp8_ds_mla"):   # auto: Mosaic on Hopper
    record(f"{mla}, {kv_cache_dtype}", "jkv pallas, triton lowering",
           *time_mla("pallas", kv_cache_dtype, "triton"))


def sweep(record):
  """vLLM / ASM read variants of the Triton decode kernel (``--sweep``): x-vectorized keys in
  chunks of ``key_chunk`` head dims (D: one chunk), values (and logits) transposed; the
  Mosaic MLA kernel with 3 stages."""
  from pallas_kernels import attention as kernels
  default = kernels.paged_attention_decode
  case = "decode 8 x 32K, 32/8 heads, d128"
  try:
    for layout, dtype, quant in (("vllm", "fp8", "tensor"), ("vllm", "auto", "tensor"),
                                 ("asm", "fp8", "tensor"), ("vllm", "int8", "token")):
      for key_chunk in (HEAD, 16, 32):
        for transposed_values in (False, True):
          jax.clear_caches()   # the kernel's options are read at trace time
          kernels.paged_attention_decode = functools.partial(
              default, key_chunk=key_chunk, transposed_values=transposed_values)
          values = "transposed" if transposed_values else "as [tile, D]"
          name = {"auto": "bf16", "int8": "int8 per-token"}.get(dtype, dtype)
          record(f"{case}, {name} {layout}",
                 f"key chunk {'D' if key_chunk == HEAD else key_chunk}, values {values}",
                 *time_paged(layout, "pallas", kv_cache_dtype=dtype, quant=quant,
                             lowering="triton"))
  finally:
    kernels.paged_attention_decode = default
    jax.clear_caches()
  _sweep_mla_stages(record)


def _sweep_mla_stages(record):
  """The Mosaic fp8_split MLA kernel with 3 stages in flight (2 by default): about 216 KB
  of shared memory at rank 512, so the kernel's limit is raised to Hopper's 227 KiB."""
  from pallas_kernels import mosaic_mla as kernel
  default, limit = kernel.mla_decode, kernel._SMEM_LIMIT
  try:
    jax.clear_caches()
    kernel.mla_decode = functools.partial(default, stages=3)
    kernel._SMEM_LIMIT = 227 * 1024
    record("MLA decode 64 x 8K, 16 heads, 512+64, fp8_split", "jkv pallas, 3 stages",
           *time_mla("pallas", "fp8_split", "mosaic"))
  except Exception as error:   # a GPU or JAX without the Mosaic kernel
    print(f"fp8_split with 3 stages failed: {type(error).__name__}: {error}"[:400])
  finally:
    kernel.mla_decode, kernel._SMEM_LIMIT = default, limit
    jax.clear_caches()
