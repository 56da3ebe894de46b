"""Every Pallas kernel once on adversarial inputs, for ``compute-sanitizer --tool memcheck``.

    bash benchmarks/sanitize.sh          # on the GPU (device tool); summary in $OUT

Inputs: slot mappings with padding (-1), the first slot past the cache, far out of range
(2^30), the int32 extremes and duplicates; a traced layer index past the stacked layers;
block pairs with the same. Calls are jitted with those inputs as arguments (under jit
out-of-range entries are dropped, eager calls would raise first). Each case also checks
the compiled kernel against the jnp reference on the same inputs (duplicate-free cases;
which duplicate wins is the reference's rule only for the ops that define it).
The Mosaic GPU write, decode attention and ragged attention run their own cases
(``write_kv mosaic``, ``attend mosaic``, ``ragged attend mosaic``) where this JAX has them.
Prints one line per case and ``SANITIZE CASES: n passed, m failed``.
"""

from __future__ import annotations

import itertools
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jkv
from jkv import layout as layout_lib
from jkv.formats import ds_mla_entry_bytes
from pallas_kernels import lowering

KERNEL = os.environ.get("JKV_SANITIZE_BACKEND", "pallas")   # "interpret": a CPU dry run
NB, BS, H, D = 8, 16, 2, 64
CAPACITY = NB * BS
INT32 = np.iinfo(np.int32)
BAD_SLOTS = [-1, 0, CAPACITY - 1, CAPACITY, CAPACITY + 1, 2**30, int(INT32.max),
             int(INT32.min), 17, 40, 99]
DUP_SLOTS = BAD_SLOTS[:-3] + [17, 17, 40]


def _tokens(rng, n, head_size=D):
  key = jnp.asarray(rng.standard_normal((n, H, head_size)), jnp.float32)
  return key, -key


def _same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype.itemsize == 1:
      x, y = x.view(np.uint8), y.view(np.uint8)
    if not np.array_equal(x, y, equal_nan=x.dtype.kind == "f"):
      return False
  return True


def _close(a, b):
  """Float outputs (attention) to 16-bit tolerance, NaN where NaN."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    if not np.allclose(x, y, rtol=3e-2, atol=3e-2, equal_nan=True):
      return False
  return True


def _check(name, op, args, compare=True):
  """Runs op(*args, backend) jitted on the kernel (and the reference); True when equal
  (compare True: bit for bit; "close": to 16-bit tolerance; False: memory only)."""
  kernel = jax.jit(lambda *a: op(*a, KERNEL))(*args)
  jax.block_until_ready(kernel)
  if not compare:
    return True
  reference = jax.jit(lambda *a: op(*a, "reference"))(*args)
  return _close(kernel, reference) if compare == "close" else _same(kernel, reference)


def _filled(cache, rng, write):
  """``cache`` with every slot of both layers written (reference) with random entries."""
  slots = jnp.arange(CAPACITY, dtype=jnp.int32)
  for layer in range(2):
    cache = write(cache, layer, rng, slots)
  return cache


def read_cases(rng):
  """Decode attention and the indexer gather on bad block tables (-1, past the cache,
  2^30, int32 extremes), empty / full / past-the-table lengths, a layer past the stack."""
  table = jnp.asarray([[0, 7, -1, 3], [NB, 2**30, 5, int(INT32.min)],
                       [int(INT32.max), 1, 2, 6]], jnp.int32)
  lens_ok = jnp.asarray([0, 3 * BS + 5, 4 * BS], jnp.int32)
  lens_past = jnp.asarray([4 * BS + 7, 2**30, 1], jnp.int32)   # past the table's pages
  query = jnp.asarray(rng.standard_normal((3, 2 * H, D)), jnp.bfloat16)
  # (layout, kv_cache_dtype, quant, MAX's quantization_granularity)
  for layout, kv_dtype, quant, group in (
      ("vllm", "auto", "tensor", None), ("flash", "fp8", "tensor", None),
      ("vllm", "fp8", "tensor", None), ("vllm", "int8", "token", None),
      ("hnd", "int8", "token", None), ("asm", "fp8", "block", None),
      ("packed", "auto", "tensor", None), ("max", "fp8", "tensor", None),
      ("max", "int8", "token", None), ("max", "fp8", "token", D // 2)):
    cache = jkv.PagedKVCache.create(NB, BS, H, D, num_layers=2, layout=layout,
                                    kv_cache_dtype=kv_dtype, quant=quant, dtype=jnp.bfloat16,
                                    quantization_granularity=group)
    cache = _filled(cache, rng, lambda c, layer, rng, s: c.write(
        layer, *_tokens(rng, CAPACITY), s, backend="reference"))
    def op(c, q, t, n, lay, backend):
      return c.attend(lay, q, t, n, backend=backend)
    name = f"attend {layout} {kv_dtype} {quant}" + (f" groups of {group}" if group else "")
    yield from _layer_cases(name, op, cache, query, table, lens_ok, lens_past)
    yield from _ragged_cases(rng, name, cache, table)
    # The Mosaic GPU decode (jax >= 0.11.2) takes the bf16 packed case here (its FP8 path
    # needs head_size % 128 == 0; tests/test_mosaic_attention.py covers it on NaN caches).
    if lowering.mosaic_available() and layout == "packed":
      def op(c, q, t, n, lay, backend, layout=layout, kv_dtype=kv_dtype):
        return jkv.paged_attention_decode(
            q, c.key_cache, c.value_cache, t, n, layout=layout, kv_cache_dtype=kv_dtype,
            k_scale=c.k_scale, v_scale=c.v_scale, layer=lay, backend=backend,
            lowering="auto" if backend == "reference" else "mosaic")
      name = f"attend mosaic {layout} {kv_dtype}"
      yield from _layer_cases(name, op, cache, query, table, lens_ok, lens_past)
      yield from _ragged_cases(rng, name, cache, table, layout=layout)   # its prefill tiles
  if lowering.mosaic_available():
    yield from _mosaic_fp8_cases(rng, table, lens_ok, lens_past)
  for kv_dtype, rank in (("auto", 64), ("fp8", 64), ("fp8_split", 64), ("fp8_ds_mla", 128)):
    mla_query = jnp.asarray(rng.standard_normal((3, 4, rank + 16)), jnp.bfloat16)
    cache = jkv.MLACache.create(NB, BS, rank, 16, num_layers=2, kv_cache_dtype=kv_dtype)
    cache = _filled(cache, rng, lambda c, layer, rng, s, rank=rank: c.write(
        layer, jnp.asarray(rng.standard_normal((CAPACITY, rank)), jnp.float32),
        jnp.asarray(rng.standard_normal((CAPACITY, 16)), jnp.float32), s, backend="reference"))
    def op(c, q, t, n, backend):
      return c.attend(1, q, t, n, scale=0.1, backend=backend)
    yield f"MLA attend {kv_dtype}", op, (cache, mla_query, table, lens_ok), "close"
    yield f"MLA attend {kv_dtype} lengths past the table", op, (cache, mla_query, table,
                                                                lens_past), False
  if lowering.mosaic_available():   # the Mosaic GPU MLA decode: rank 128, RoPE part 64
    yield from _mosaic_mla_cases(rng, table, lens_ok, lens_past)
  cache = jkv.IndexerKCache.create(NB, BS, 64, quant_block_size=32, num_layers=2)
  cache = _filled(cache, rng, lambda c, layer, rng, s: c.write(
      layer, jnp.asarray(rng.standard_normal((CAPACITY, 64)), jnp.float32), s,
      backend="reference"))
  dst_k = jnp.full((40, 64), 7, jnp.uint8)
  dst_scale = jnp.full((40, 2), 3.0, jnp.float32)
  cu_seq_lens = jnp.asarray([0, 9, 30, 37], jnp.int32)
  def op(kv, k, s, t, cu, lay, backend):
    return jkv.cp_gather_indexer_k_quant_cache(kv, k, s, t, cu, layer=lay, backend=backend)
  for layer in (1, 2):
    yield (f"cp_gather_indexer_k_quant_cache layer {layer}", op,
           (cache.kv_cache, dst_k, dst_scale, table, cu_seq_lens, jnp.int32(layer)), True)


def _layer_cases(name, op, cache, query, table, lens_ok, lens_past):
  """An attention case ``op(cache, query, table, lens, layer, backend)`` at layer 1 (checked
  against the reference), then with lengths past the table and a layer past the stack."""
  yield name, op, (cache, query, table, lens_ok, jnp.int32(1)), "close"
  yield name + " lengths past the table", op, (cache, query, table, lens_past,
                                               jnp.int32(1)), False
  yield name + " layer past the stack", op, (cache, query, table, lens_ok, jnp.int32(2)), False


def _mosaic_fp8_cases(rng, table, lens_ok, lens_past):
  """The Mosaic GPU FP8 kernels (head_size 128 only): decode and ragged attention (prefill
  tiles and decode rows) over a flash e4m3 cache with per-head scales, on the bad tables;
  bf16 queries (two e4m3 terms) and fp16 ones (three); decode over vLLM and ASM e4m3
  caches (x-vectorized keys)."""
  head_size = 128
  cache = jkv.PagedKVCache.create(NB, BS, H, head_size, num_layers=2, kv_cache_dtype="fp8",
                                  k_scale=jnp.asarray([0.5, 2.0]),
                                  v_scale=jnp.asarray([1.5, 0.25]))
  cache = _filled(cache, rng, lambda c, layer, rng, s: c.write(
      layer, *_tokens(rng, CAPACITY, head_size), s, backend="reference"))
  def op(c, q, t, n, lay, backend):
    return jkv.paged_attention_decode(
        q, c.key_cache, c.value_cache, t, n, layout="flash", kv_cache_dtype="fp8",
        k_scale=c.k_scale,
        v_scale=c.v_scale, layer=lay, backend=backend,
        lowering="auto" if backend == "reference" else "mosaic")
  for query_dtype, suffix in ((jnp.bfloat16, ""), (jnp.float16, " fp16 queries")):
    query = jnp.asarray(rng.standard_normal((3, 2 * H, head_size)), query_dtype)
    name = "attend mosaic flash fp8 d128" + suffix
    yield from _layer_cases(name, op, cache, query, table, lens_ok, lens_past)
    yield from _ragged_cases(rng, name, cache, table, layout="flash", query_dtype=query_dtype)
  for layout in ("vllm", "asm"):   # x-vectorized keys: pallas_kernels.mosaic_fp8_x_decode
    x_cache = jkv.PagedKVCache.create(NB, BS, H, head_size, num_layers=2, layout=layout,
                                      kv_cache_dtype="fp8", k_scale=jnp.asarray([0.5, 2.0]),
                                      v_scale=jnp.asarray([1.5, 0.25]))
    x_cache = _filled(x_cache, rng, lambda c, layer, rng, s: c.write(
        layer, *_tokens(rng, CAPACITY, head_size), s, backend="reference"))

    def x_op(c, q, t, n, lay, backend, layout=layout):
      return jkv.paged_attention_decode(
          q, c.key_cache, c.value_cache, t, n, layout=layout, kv_cache_dtype="fp8",
          k_scale=c.k_scale, v_scale=c.v_scale, layer=lay, backend=backend,
          lowering="auto" if backend == "reference" else "mosaic")
    query = jnp.asarray(rng.standard_normal((3, 2 * H, head_size)), jnp.bfloat16)
    yield from _layer_cases(f"attend mosaic {layout} fp8 d128", x_op, x_cache, query, table,
                            lens_ok, lens_past)


def _mosaic_mla_cases(rng, table, lens_ok, lens_past):
  """The Mosaic GPU MLA decode over an ``fp8_split`` cache (rank 128, RoPE part 64) and an
  ``fp8_ds_mla`` one (rank 512, RoPE part 64)."""
  for kv_dtype, rank in (("fp8_split", 128), ("fp8_ds_mla", 512)):
    cache = jkv.MLACache.create(NB, BS, rank, 64, num_layers=2, kv_cache_dtype=kv_dtype)
    cache = _filled(cache, rng, lambda c, layer, rng, s, rank=rank: c.write(
        layer, jnp.asarray(rng.standard_normal((CAPACITY, rank)), jnp.float32),
        jnp.asarray(rng.standard_normal((CAPACITY, 64)), jnp.float32), s,
        backend="reference"))
    query = jnp.asarray(rng.standard_normal((3, 4, rank + 64)), jnp.bfloat16)

    def op(c, q, t, n, lay, backend):
      return c.attend(lay, q, t, n, scale=0.1, backend=backend,
                      lowering="auto" if backend == "reference" else "mosaic")
    name = f"attend mosaic MLA {kv_dtype}"
    yield from _layer_cases(name, op, cache, query, table, lens_ok, lens_past)


def _ragged_cases(rng, name, cache, table, layout=None, query_dtype=jnp.bfloat16):
  """Ragged attention on the same bad tables: a 40-row prefill chunk (long tiles), a
  decode row, a 20-row chunk; then lengths past the table, chunks longer than their
  context, cu_q_lens going backwards and num_seqs past the table (memory only).
  ``layout``: the array op over the cache's arrays in that layout, its prefill tiles and
  its decode row on the Mosaic GPU kernels. ``query_dtype``: the queries'."""
  kv_ok = jnp.asarray([3 * BS + 5, 4 * BS, 4 * BS], jnp.int32)
  kv_past = jnp.asarray([4 * BS + 7, 2**30, 1], jnp.int32)
  cu_ok = jnp.asarray([0, 40, 41, 61], jnp.int32)
  cu_bad = jnp.asarray([0, 50, 45, 64], jnp.int32)
  query = jnp.asarray(rng.standard_normal((64, 2 * H, cache.head_size)), query_dtype)
  def op(c, q, t, n, cu, s, backend):
    if layout is None:
      return c.attend_ragged(1, q, t, n, cu, num_seqs=s, backend=backend)
    return jkv.ragged_paged_attention(
        q, c.key_cache, c.value_cache, t, n, cu, num_seqs=s, layout=layout, layer=1,
        kv_cache_dtype=c.kv_cache_dtype, k_scale=c.k_scale, v_scale=c.v_scale,
        backend=backend, lowering="auto" if backend == "reference" else "mosaic")
  three = jnp.int32(3)
  yield "ragged " + name, op, (cache, query, table, kv_ok, cu_ok, three), "close"
  yield "ragged " + name + " lengths past the table", op, (cache, query, table, kv_past,
                                                            cu_ok, three), False
  yield "ragged " + name + " cu_q_lens backwards", op, (cache, query, table, kv_ok, cu_bad,
                                                         three), False
  yield "ragged " + name + " num_seqs past the table", op, (cache, query, table, kv_ok,
                                                             cu_ok, jnp.int32(2**30)), False


def mla_write_cases(rng):
  """MLA, fp8_split and indexer writes on bad slots."""
  slots = jnp.asarray(BAD_SLOTS, jnp.int32)
  n = len(BAD_SLOTS)
  kv_c = jnp.asarray(rng.standard_normal((n, 64)), jnp.float32)
  k_pe = jnp.asarray(rng.standard_normal((n, 16)), jnp.float32)
  for kv_dtype in ("auto", "fp8", "fp8_split"):
    cache = jkv.MLACache.create(NB, BS, 64, 16, num_layers=2, kv_cache_dtype=kv_dtype)
    def op(c, a, b, s, lay, backend):
      return c.write(lay, a, b, s, backend=backend)
    # fp8_split: the bf16 RoPE part may differ by an ulp (fused products)
    compare = "close" if kv_dtype == "fp8_split" else True
    for layer in (1, 2):
      yield f"MLACache.write {kv_dtype} layer {layer}", op, (cache, kv_c, k_pe, slots,
                                                             jnp.int32(layer)), compare
  ds_mla = jnp.full((2, NB, BS, ds_mla_entry_bytes(128, 16)), 3, jnp.uint8)
  kv_c_128 = jnp.asarray(rng.standard_normal((n, 128)), jnp.float32)
  def op(a, b, kc, s, lay, backend):
    return jkv.concat_and_cache_mla(a, b, kc, s, "fp8_ds_mla", layer=lay, backend=backend)
  for layer in (1, 2):
    yield f"concat_and_cache_mla fp8_ds_mla layer {layer}", op, (
        kv_c_128, k_pe, ds_mla, slots, jnp.int32(layer)), True
  # The entry kernel with RoPE (fused_qk_rope_concat_and_cache_mla): positions past the
  # cos / sin rows (clamped), both pair orders, a bf16 and an FP8 cache of two layers.
  # ("close": the rotation's products may round an ulp apart; the FP8 cache is checked for
  # memory only, as an ulp may move a value by an FP8 step: tests/test_mla.py bounds both.)
  q_nope_r = jnp.asarray(rng.standard_normal((n, 2, 64)), jnp.bfloat16)
  q_pe_r = jnp.asarray(rng.standard_normal((n, 2, 16)), jnp.bfloat16)
  rope_cos, rope_sin = jkv.rope.rope_cache(64, 16, dtype=jnp.float32)
  rope_positions = jnp.asarray(BAD_SLOTS, jnp.int32)
  for cache_dtype, is_neox, compare in ((jnp.bfloat16, True, "close"),
                                        (jnp.float8_e4m3fn, False, False)):
    entries = jnp.full((2, NB, BS, 64 + 16), 3, cache_dtype)
    k_scale = None if cache_dtype == jnp.bfloat16 else 0.5
    def op(qn, qp, a, b, kc, s, p, lay, backend, k_scale=k_scale, is_neox=is_neox):
      return jkv.fused_qk_rope_concat_and_cache_mla(
          qn, qp, a, b, kc, s, k_scale, None, p, rope_cos, rope_sin, is_neox=is_neox,
          layer=lay, backend=backend)
    yield (f"fused_qk_rope_concat_and_cache_mla {np.dtype(cache_dtype).name}", op,
           (q_nope_r, q_pe_r, kv_c, k_pe, entries, slots, rope_positions, jnp.int32(1)),
           compare)
  q_nope = jnp.asarray(rng.standard_normal((4, n, 32)), jnp.bfloat16)
  w_k = jnp.asarray(rng.standard_normal((4, 48, 32)), jnp.float8_e4m3fn)
  q_pe = jnp.asarray(rng.standard_normal((n, 4, 16)), jnp.bfloat16)
  k_nope = jnp.asarray(rng.standard_normal((n, 2, 48)), jnp.bfloat16)
  k_rope = jnp.asarray(rng.standard_normal((n, 2, 16)), jnp.bfloat16)
  flat = jnp.full((CAPACITY, 2, 64), 3, jnp.bfloat16)
  positions = jnp.asarray(BAD_SLOTS, jnp.int32)    # clamped to the cos / sin rows
  cos, sin = jkv.rope.rope_cache(64, 16, dtype=jnp.bfloat16)
  def op(qn, w, qp, kn, kr, kc, s, p, backend):
    return jkv.fused_fp8_bmm_rope_cat_and_cache_mla(
        qn, w, 0.5, qp, kn, kr, kc, s, p, cos, sin, group_size=16, num_decode_toks_for_zeros=3,
        backend=backend)
  # "close": the BMM sums in another order than the reference's einsum
  yield "fused_fp8_bmm_rope_cat_and_cache_mla", op, (
      q_nope, w_k, q_pe, k_nope, k_rope, flat, slots, positions), "close"
  k = jnp.asarray(rng.standard_normal((n, 64)), jnp.float32)
  indexer = jkv.IndexerKCache.create(NB, BS, 64, quant_block_size=32, num_layers=2)
  def op(c, k, s, lay, backend):
    return c.write(lay, k, s, backend=backend)
  for layer in (1, 2):
    yield f"IndexerKCache.write layer {layer}", op, (indexer, k, slots, jnp.int32(layer)), True


def _quantized_caches(rng, k_shape, v_shape, dtype, scales_shape):
  """(key cache, value cache, k scales, v scales): random stored values and scales of
  1e-3, so every block-scale write grows its scale and re-quantizes the block's older
  tokens (the per-block write's re-quantization runs)."""
  def stored(shape):
    return jnp.asarray(rng.integers(-100, 101, shape), jnp.float32).astype(dtype)
  return (stored(k_shape), stored(v_shape), jnp.full(scales_shape, 1e-3, jnp.float32),
          jnp.full(scales_shape, 1e-3, jnp.float32))


def cases(rng):
  slots = jnp.asarray(BAD_SLOTS, jnp.int32)
  dups = jnp.asarray(DUP_SLOTS, jnp.int32)
  key, value = _tokens(rng, len(BAD_SLOTS))
  for layout in layout_lib.LAYOUTS:
    for dtype, kv_dtype in ((jnp.bfloat16, "auto"), (jnp.float8_e4m3fn, "fp8")):
      k_shape, v_shape = layout_lib.cache_shapes(layout, NB, BS, H, D, dtype)
      k_cache = jnp.full((2,) + k_shape, 3, dtype)
      v_cache = None if v_shape is None else jnp.full((2,) + v_shape, 3, dtype)
      for layer in (1, 2):     # 2: past the stacked layers (traced): nothing written
        def op(k, v, kc, vc, s, lay, backend, layout=layout, kv_dtype=kv_dtype):
          return jkv.write_kv(k, v, kc, vc, s, layout=layout, kv_cache_dtype=kv_dtype,
                              layer=lay, backend=backend)
        yield (f"write_kv {layout} {kv_dtype} layer {layer}", op,
               (key, value, k_cache, v_cache, slots, jnp.int32(layer)), True)
      yield (f"write_kv {layout} {kv_dtype} duplicates", op,
             (key, value, k_cache, v_cache, dups, jnp.int32(0)), False)
  for dtype, kv_dtype in ((jnp.bfloat16, "auto"), (jnp.float8_e4m3fn, "fp8")):
    # Mojo MAX's collection [nb, 2, L, bs, H, D] of 2 layers (layer 2: past them).
    collection = jnp.full(layout_lib.max_shape(NB, 2, BS, H, D), 3, dtype)
    def op(k, v, c, s, lay, backend, kv_dtype=kv_dtype):
      return jkv.write_kv(k, v, c, None, s, layout="max", kv_cache_dtype=kv_dtype, layer=lay,
                          backend=backend)
    for layer in (1, 2):
      yield (f"write_kv max {kv_dtype} layer {layer}", op,
             (key, value, collection, slots, jnp.int32(layer)), True)
    yield (f"write_kv max {kv_dtype} duplicates", op,
           (key, value, collection, dups, jnp.int32(0)), False)
  for dtype, groups in ((jnp.int8, 1), (jnp.float8_e4m3fn, 2)):
    # A per-token quantized collection with its scale collection [nb, 2, L, bs, H, G].
    collection = jnp.full(layout_lib.max_shape(NB, 2, BS, H, D), 3, dtype)
    scales = jnp.full((NB, 2, 2, BS, H, groups), 0.5, jnp.float32)
    def op(k, v, c, sc, s, lay, backend):
      return jkv.write_quant_kv(k, v, c, None, sc, None, s, granularity="token",
                                layout="max", layer=lay, backend=backend)
    for layer in (1, 2):
      yield (f"write_quant_kv max {np.dtype(dtype).name} {groups} groups layer {layer}", op,
             (key, value, collection, scales, slots, jnp.int32(layer)), True)
  if lowering.mosaic_available():   # the Mosaic GPU write (jax >= 0.11.2): bf16 input
    key16, value16 = key.astype(jnp.bfloat16), value.astype(jnp.bfloat16)
    for layout in ("flash", "hnd", "packed"):
      for dtype, kv_dtype in ((jnp.bfloat16, "auto"), (jnp.float8_e4m3fn, "fp8")):
        k_shape, v_shape = layout_lib.cache_shapes(layout, NB, BS, H, D, dtype)
        k_cache = jnp.full((2,) + k_shape, 3, dtype)
        v_cache = None if v_shape is None else jnp.full((2,) + v_shape, 3, dtype)
        def op(k, v, kc, vc, s, lay, backend, layout=layout, kv_dtype=kv_dtype):
          return jkv.write_kv(k, v, kc, vc, s, layout=layout, kv_cache_dtype=kv_dtype,
                              layer=lay, backend=backend,
                              lowering="auto" if backend == "reference" else "mosaic")
        for layer in (1, 2):
          yield (f"write_kv mosaic {layout} {kv_dtype} layer {layer}", op,
                 (key16, value16, k_cache, v_cache, slots, jnp.int32(layer)), True)
        yield (f"write_kv mosaic {layout} {kv_dtype} duplicates", op,
               (key16, value16, k_cache, v_cache, dups, jnp.int32(0)), False)
  for granularity in ("token", "block"):
    for layout in ("vllm", "asm", "flash"):
      for dtype in (jnp.int8, jnp.float8_e4m3fn):
        k_shape, v_shape = layout_lib.cache_shapes(layout, NB, BS, H, D, dtype)
        scales = (NB, H, BS) if granularity == "token" else (NB, H)
        arrays = _quantized_caches(rng, k_shape, v_shape, dtype, scales)
        def op(k, v, kc, vc, ks, vs, s, backend, granularity=granularity, layout=layout):
          return jkv.write_quant_kv(k, v, kc, vc, ks, vs, s, granularity=granularity,
                                    layout=layout, backend=backend)
        name = f"write_quant_kv {granularity} {layout} {np.dtype(dtype).name}"
        yield name, op, (key, value) + arrays + (slots,), True
        yield name + " duplicates", op, (key, value) + arrays + (dups,), granularity == "block"
  for dtype in (jnp.int8, jnp.float8_e4m3fn):   # one scale per 128 tokens: chunked passes
    k_shape, v_shape = layout_lib.cache_shapes("asm", NB, BS, H, D, dtype)
    arrays = _quantized_caches(rng, k_shape, v_shape, dtype, (CAPACITY // 128, H))
    def op(k, v, kc, vc, ks, vs, s, backend):
      return jkv.reshape_and_cache_with_block_quant_for_asm_pa(k, v, kc, vc, ks, vs, s,
                                                               backend=backend)
    name = f"reshape_and_cache_with_block_quant_for_asm_pa {np.dtype(dtype).name}"
    # Slot 0 left out: a write at a scale block's first slot starts it afresh (no re-quant).
    yield name, op, (key, value) + arrays + (jnp.where(slots == 0, 5, slots),), True
    yield name + " duplicates", op, (key, value) + arrays + (jnp.where(dups == 0, 5, dups),), True
  pairs = jnp.asarray([[1, 2], [-1, 3], [NB, 0], [0, NB], [2**30, 1], [int(INT32.max), 2],
                       [3, int(INT32.min)], [2, 1], [4, 5], [4, 5], [5, 4]], jnp.int32)
  caches = [jnp.asarray(rng.standard_normal((2, NB, BS, H, D)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((2, NB, H, BS)), jnp.float32)]
  def op(caches, p, backend):
    return jkv.copy_blocks(caches, None, p, block_axis=1, backend=backend)
  yield "copy_blocks (chains, out of range pairs)", op, (caches, pairs), True
  for src_kind, dst_kind in (("device", "pinned_host"), ("pinned_host", "device")):
    shard = lambda kind: jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)
    src = jax.device_put(jnp.asarray(rng.standard_normal((NB, BS, H, D)), jnp.bfloat16),
                         shard(src_kind))
    dst = jax.device_put(jnp.zeros((NB + 3, BS, H, D), jnp.bfloat16), shard(dst_kind))
    def op(s, d, p, backend):
      return jkv.swap_blocks(s, d, p, backend=backend)
    yield f"swap_blocks {src_kind} -> {dst_kind}", op, (src, dst, pairs), True


def main():
  rng = np.random.default_rng(0)
  passed = failed = 0
  # Substrings separated by "|": run the cases whose names hold one of them only.
  only = os.environ.get("JKV_SANITIZE_ONLY", "").split("|")
  for name, op, args, compare in itertools.chain(cases(rng), mla_write_cases(rng),
                                                 read_cases(rng)):
    if not any(part in name for part in only):
      continue
    try:
      ok = _check(name, op, args, compare)
    except Exception:                                  # reported, and counted as failed
      traceback.print_exc()
      ok = False
    passed += ok
    failed += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name}{'' if compare else ' (memory only)'}", flush=True)
  print(f"SANITIZE CASES: {passed} passed, {failed} failed")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
