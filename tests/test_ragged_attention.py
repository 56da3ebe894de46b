"""Ragged paged attention: the kernel (interpret on CPU, compiled with JKV_BACKEND=pallas) and
the reference against an independent numpy model on ragged batches that mix decodes,
prefill chunks over cached context, pure prefills, empty sequences and padding rows; every
layout and cache format, every option, traced ``num_seqs``, the fused write, and the
one-row-per-sequence case against decode attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from pallas_kernels import ragged_attention as kernels
from tests.conftest import KERNEL
from tests.test_attention import LAYOUTS, build

BACKENDS = ("reference", KERNEL)


def numpy_ragged(query, keys, values, kv_lens, cu_q_lens, num_seqs, *, scale, alibi=None,
                 soft_cap=None, window=None, sinks=None):
  """One (row, head) at a time, float64: row j of sequence s at p = kv_len - q_len + j
  sees keys max(0, p - W + 1)..p of the sequence's written K / V."""
  query = np.asarray(query, np.float64)
  rows, num_q_heads, _ = query.shape
  group = num_q_heads // keys.shape[2]
  out = np.zeros((rows, num_q_heads, values.shape[-1]))
  for s in range(num_seqs):
    first_row, end_row = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
    for row in range(first_row, end_row):
      p = int(kv_lens[s]) - (end_row - first_row) + row - first_row
      first = 0 if window is None else max(0, p - window + 1)
      for h in range(num_q_heads):
        k = keys[s, first:p + 1, h // group].astype(np.float64)
        v = values[s, first:p + 1, h // group].astype(np.float64)
        logits = scale * (k @ query[row, h])
        if soft_cap is not None:
          logits = soft_cap * np.tanh(logits / soft_cap)
        if alibi is not None:
          logits = logits + alibi[h] * (np.arange(first, p + 1) - p)
        peak = logits.max() if sinks is None else max(logits.max(), sinks[h])
        e = np.exp(logits - peak)
        denominator = e.sum() + 1e-6 + (0.0 if sinks is None else np.exp(sinks[h] - peak))
        out[row, h] = e @ v / denominator
  return out


# (kv_len, q_len) per sequence: a decode, a chunk over cached context, an empty sequence,
# a pure prefill, a long chunk that crosses pages, a decode at a page boundary.
MIX = ((37, 1), (70, 23), (5, 0), (19, 19), (96, 40), (33, 1))


def ragged_batch(rng, mix=MIX, num_q_heads=4, head_size=64, dtype=jnp.float32, padding=5,
                 **build_options):
  kv_lens = [kv for kv, _ in mix]
  q_lens = np.array([q for _, q in mix])
  cache, table, lens, keys, values = build(rng, batch=len(mix), width=6, num_blocks=40,
                                           lens=kv_lens, head_size=head_size, dtype=dtype,
                                           **build_options)
  cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  rows = int(cu_q_lens[-1]) + padding
  query = jnp.asarray(rng.standard_normal((rows, num_q_heads, head_size)), dtype)
  return cache, table, lens, jnp.asarray(cu_q_lens), query, keys, values


def assert_close(got, expected, atol):
  got = np.asarray(got, np.float32)
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, np.asarray(expected, np.float32), atol=atol, rtol=atol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,kv_layout", [(layout, "NHD") for layout in LAYOUTS]
                         + [("packed", "HND")])
def test_matches_numpy_model_every_layout(rng, backend, layout, kv_layout):
  cache, table, lens, cu, query, keys, values = ragged_batch(rng, layout=layout,
                                                             kv_layout=kv_layout)
  out = cache.attend_ragged(0, query, table, lens, cu, backend=backend)
  expected = numpy_ragged(query, keys, values, lens, cu, len(MIX), scale=64 ** -0.5)
  assert out.shape == query.shape and out.dtype == query.dtype
  assert_close(out, expected, 2e-5)
  assert np.all(np.asarray(out[int(cu[-1]):]) == 0)   # padding rows read exactly 0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("layout", ["flash", "hnd", "packed", "vllm"])
def test_kernel_matches_reference_16_bit(rng, layout, dtype):
  cache, table, lens, cu, query, _, _ = ragged_batch(rng, layout=layout, dtype=dtype)
  expected = cache.attend_ragged(0, query, table, lens, cu, backend="reference")
  got = cache.attend_ragged(0, query, table, lens, cu, backend=KERNEL)
  assert got.dtype == dtype
  assert_close(got, expected, 3e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [{"alibi": True}, {"soft_cap": 4.0}, {"window": 21},
                                     {"sinks": True}, {"scale": 0.05},
                                     {"window": 9, "alibi": True, "soft_cap": 8.0,
                                      "sinks": True}])
def test_options_match_numpy_model(rng, backend, options):
  cache, table, lens, cu, query, keys, values = ragged_batch(rng, layout="flash",
                                                             num_q_heads=8)
  alibi = rng.uniform(-0.3, 0, 8).astype(np.float32) if options.get("alibi") else None
  sinks = rng.uniform(-1, 3, 8).astype(np.float32) if options.get("sinks") else None
  scale = options.get("scale", 64 ** -0.5)
  out = cache.attend_ragged(0, query, table, lens, cu, alibi_slopes=alibi, sinks=sinks,
                            logits_soft_cap=options.get("soft_cap"), scale=options.get("scale"),
                            sliding_window=options.get("window"), backend=backend)
  expected = numpy_ragged(query, keys, values, lens, cu, len(MIX), scale=scale, alibi=alibi,
                          soft_cap=options.get("soft_cap"), window=options.get("window"),
                          sinks=sinks)
  assert_close(out, expected, 2e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3fnuz", "fp8_e5m2"])
@pytest.mark.parametrize("layout", ["flash", "hnd", "packed", "vllm"])
def test_kernel_matches_reference_fp8_tensor(rng, layout, kv_cache_dtype):
  cache, table, lens, cu, query, _, _ = ragged_batch(
      rng, layout=layout, dtype=jnp.bfloat16, kv_cache_dtype=kv_cache_dtype, k_scale=0.05,
      v_scale=jnp.asarray([0.02, 0.04], jnp.float32))
  expected = cache.attend_ragged(0, query, table, lens, cu, backend="reference")
  got = cache.attend_ragged(0, query, table, lens, cu, backend=KERNEL)
  assert_close(got, expected, 3e-2)
  # The reference reads what the cache holds: the dequantized entries, as gather returns.
  keys, values = cache.gather(0, table, lens)
  expected = numpy_ragged(query, np.asarray(keys, np.float32), np.asarray(values, np.float32),
                          lens, cu, len(MIX), scale=64 ** -0.5)
  assert_close(cache.attend_ragged(0, query, table, lens, cu, backend="reference"), expected,
               1e-2)


@pytest.mark.parametrize("magnitude", [2.0 ** 40, 2.0 ** -40])
def test_fp8_kernel_with_a_query_outside_f16(rng, magnitude):
  """A bf16 query far outside f16's range meets per-tensor FP8 keys (in f16, after a power
  of two: common.f16_query) and gives the reference's result."""
  cache, table, lens, cu, query, _, _ = ragged_batch(
      rng, dtype=jnp.bfloat16, kv_cache_dtype="fp8", k_scale=0.05, v_scale=0.03)
  query = (query.astype(jnp.float32) * magnitude).astype(jnp.bfloat16)
  scale = 64 ** -0.5 / magnitude
  expected = cache.attend_ragged(0, query, table, lens, cu, scale=scale, backend="reference")
  got = cache.attend_ragged(0, query, table, lens, cu, scale=scale, backend=KERNEL)
  assert_close(got, expected, 3e-2)


@pytest.mark.parametrize("quant,kv_cache_dtype,unit", [
    ("token", "int8", None), ("token", "fp8", None), ("block", "fp8", None),
    ("block", "int8", 32)])
@pytest.mark.parametrize("layout", ["asm", "flash"])
def test_kernel_matches_reference_scaled(rng, layout, quant, kv_cache_dtype, unit):
  cache, table, lens, cu, query, _, _ = ragged_batch(
      rng, layout=layout, dtype=jnp.bfloat16, quant=quant, kv_cache_dtype=kv_cache_dtype,
      scale_block_tokens=unit)
  expected = cache.attend_ragged(0, query, table, lens, cu, backend="reference")
  got = cache.attend_ragged(0, query, table, lens, cu, backend=KERNEL)
  assert_close(got, expected, 3e-2)


def test_fp4_cache_reads_through_the_reference(rng):
  cache, table, lens, cu, query, _, _ = ragged_batch(rng, layout="hnd", dtype=jnp.bfloat16,
                                                     quant="nvfp4")
  keys, values = cache.gather(0, table, lens)
  expected = numpy_ragged(query, np.asarray(keys, np.float32), np.asarray(values, np.float32),
                          lens, cu, len(MIX), scale=64 ** -0.5)
  assert_close(cache.attend_ragged(0, query, table, lens, cu), expected, 2e-2)
  with pytest.raises(NotImplementedError):
    cache.attend_ragged(0, query, table, lens, cu, backend="pallas")


@pytest.mark.parametrize("num_q_heads,num_heads,head_size,block_size", [
    (1, 1, 64, 16),     # MHA
    (8, 1, 80, 8),      # MQA, head size not a power of two
    (6, 2, 32, 1),      # group of 3, block size 1
    (40, 8, 128, 32)])  # group of 5
def test_kernel_shapes(rng, num_q_heads, num_heads, head_size, block_size):
  mix = ((40, 1), (64, 30), (7, 7), (50, 2))
  kv_lens = [kv for kv, _ in mix]
  width = -(-64 // block_size)
  cache, table, lens, keys, values = build(rng, layout="hnd", batch=len(mix), width=width,
                                           num_blocks=len(mix) * width + 3, lens=kv_lens,
                                           num_heads=num_heads, head_size=head_size,
                                           block_size=block_size)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum([q for _, q in mix])]), jnp.int32)
  query = jnp.asarray(rng.standard_normal((int(cu[-1]) + 3, num_q_heads, head_size)),
                      jnp.float32)
  got = cache.attend_ragged(0, query, table, lens, cu, backend=KERNEL)
  expected = numpy_ragged(query, keys, values, lens, cu, len(mix), scale=head_size ** -0.5)
  assert_close(got, expected, 2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_num_seqs_traced_under_jit(rng, backend):
  cache, table, lens, cu, query, keys, values = ragged_batch(rng, layout="flash")

  @jax.jit
  def run(cache, num_seqs):
    return cache.attend_ragged(0, query, table, lens, cu, num_seqs=num_seqs, backend=backend)

  for num_seqs in (2, 4, len(MIX)):
    out = run(cache, jnp.int32(num_seqs))
    expected = numpy_ragged(query, keys, values, lens, cu, num_seqs, scale=64 ** -0.5)
    assert_close(out, expected, 2e-5)
    assert np.all(np.asarray(out[int(cu[num_seqs]):]) == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_row_per_sequence_is_decode_attention(rng, backend):
  mix = tuple((kv, 1) for kv in (1, 17, 64, 96, 50))
  cache, table, lens, cu, query, _, _ = ragged_batch(rng, mix=mix, layout="vllm", padding=0,
                                                     num_q_heads=8)
  ragged = cache.attend_ragged(0, query, table, lens, cu, backend=backend)
  decode = cache.attend(0, query, table, lens, backend=backend)
  assert_close(ragged, decode, 2e-6)


@pytest.mark.parametrize("mix", [((12, 12),), ((19, 19), (0, 0), (12, 5))])
def test_first_rows_in_the_long_pass(rng, mix):
  """The batch's first rows belong to a prefill (the long pass), short multi-token rows."""
  cache, table, lens, cu, query, keys, values = ragged_batch(rng, mix=mix, layout="flash",
                                                             padding=0)
  got = cache.attend_ragged(0, query, table, lens, cu, backend=KERNEL)
  assert_close(got, numpy_ragged(query, keys, values, lens, cu, len(mix), scale=0.125), 2e-5)


@pytest.mark.slow   # a stress shape: -m slow runs it, not CI
def test_many_long_tiles_and_splits(rng):
  """Long sequences over several prefill tiles, and short ones over split contexts (the
  kernel's two kinds of program with explicit tiling, in one launch or two)."""
  mix = ((96, 96), (90, 3), (96, 1), (60, 45))
  cache, table, lens, cu, query, keys, values = ragged_batch(rng, mix=mix, layout="flash",
                                                             num_q_heads=4)
  fmt = cache.cache_format()
  key_plane, value_plane = jkv.layout.planes("flash", 16, 2, 64, jnp.float32)
  expected = numpy_ragged(query, keys, values, lens, cu, len(mix), scale=0.125)
  for rows, tile, splits, one_launch in ((16, 16, 1, True), (32, 32, 3, False),
                                        (64, 64, 2, True), (128, 64, 2, False)):
    out = kernels.ragged_paged_attention(
        fmt, query, cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale,
        jnp.int32(0), table, lens, cu, jnp.int32(len(mix)), key_plane=key_plane,
        value_plane=value_plane, num_blocks=40, scale=0.125, alibi_slopes=None,
        logits_soft_cap=None, sliding_window=None, sinks=None,
        interpret=KERNEL == "interpret", long_block_rows=rows, long_tile_tokens=tile,
        short_tile_tokens=tile, num_splits=splits, one_launch=one_launch)
    assert_close(out, expected, 2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,quant,kv_cache_dtype", [
    ("flash", "tensor", "auto"), ("packed", "tensor", "fp8"), ("vllm", "token", "int8"),
    ("hnd", "block", "fp8")])
def test_write_and_attend_equals_write_then_attend(rng, backend, layout, quant,
                                                   kv_cache_dtype):
  mix = ((37, 1), (70, 23), (5, 0), (19, 19))
  cache, table, lens, cu, query, _, _ = ragged_batch(
      rng, mix=mix, layout=layout, dtype=jnp.bfloat16, quant=quant,
      kv_cache_dtype=kv_cache_dtype, **({"k_scale": 0.05, "v_scale": 0.03}
                                        if kv_cache_dtype == "fp8" and quant == "tensor"
                                        else {}))
  rows = query.shape[0]
  key = jnp.asarray(rng.standard_normal((rows, 2, 64)), jnp.bfloat16)
  value = jnp.asarray(rng.standard_normal((rows, 2, 64)), jnp.bfloat16)
  # The step's new tokens: the last q_len positions of every sequence, padding rows -1.
  slots = np.full(rows, -1, np.int32)
  table_np = np.asarray(table)
  for s, (kv, q) in enumerate(mix):
    for j in range(q):
      p = kv - q + j
      slots[int(cu[s]) + j] = table_np[s, p // 16] * 16 + p % 16
  slots = jnp.asarray(slots)
  out, fused = jax.jit(lambda c: c.write_and_attend_ragged(0, query, key, value, slots, table,
                                                           lens, cu, backend=backend))(cache)
  # Both jitted: XLA may compile the reference's scale arithmetic differently eagerly.
  written = jax.jit(lambda c: c.write(0, key, value, slots, backend=backend))(cache)
  expected = written.attend_ragged(0, query, table, lens, cu, backend=backend)
  for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(written)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  assert_close(out, expected, 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_array_ops_with_write(rng, backend):
  """The array-level fused op: plain flash caches and AITER per-token scale shapes (asm
  layout) equal the pytree path."""
  mix = ((37, 1), (70, 23), (19, 19))
  for layout, quant, dtype in (("flash", "tensor", "auto"), ("asm", "token", "int8")):
    cache, table, lens, cu, query, _, _ = ragged_batch(rng, mix=mix, layout=layout,
                                                       dtype=jnp.bfloat16, quant=quant,
                                                       kv_cache_dtype=dtype)
    rows = query.shape[0]
    key = jnp.asarray(rng.standard_normal((rows, 2, 64)), jnp.bfloat16)
    value = jnp.asarray(rng.standard_normal((rows, 2, 64)), jnp.bfloat16)
    slots = jnp.asarray(np.where(np.arange(rows) < int(cu[-1]),
                                 rng.permutation(40 * 16)[:rows], -1), jnp.int32)
    out_c, cache2 = cache.write_and_attend_ragged(0, query, key, value, slots, table, lens, cu,
                                                  backend=backend)
    scales = {} if quant == "tensor" else {"k_dequant_scales": cache.k_scale[0],
                                           "v_dequant_scales": cache.v_scale[0],
                                           "asm_layout": True}
    result = jkv.ragged_paged_attention_with_write(
        query, key, value, cache.key_cache[0], cache.value_cache[0], slots, table, lens, cu,
        layout=layout, kv_cache_dtype=dtype, backend=backend, **scales)
    assert_close(result[0], out_c, 1e-6)
    np.testing.assert_array_equal(np.asarray(result[1]).view(np.uint8),
                                  np.asarray(cache2.key_cache[0]).view(np.uint8))
    if quant == "token":
      np.testing.assert_array_equal(result[3], cache2.k_scale[0])


def test_layer_index_traced_in_scan(rng):
  cache, table, lens, cu, query, keys, values = ragged_batch(rng, layout="hnd", num_layers=2)
  # build writes the same K / V to every layer: layer 1's values negated tell them apart.
  cache = cache.replace(value_cache=cache.value_cache.at[1].set(-cache.value_cache[1]))

  def body(carry, layer):
    return carry, cache.attend_ragged(layer, query, table, lens, cu, backend=KERNEL)

  _, outs = jax.lax.scan(body, 0, jnp.arange(2, dtype=jnp.int32))
  expected = numpy_ragged(query, keys, values, lens, cu, len(MIX), scale=0.125)
  assert_close(outs[0], expected, 2e-5)
  assert_close(outs[1], -expected, 2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_entries_past_num_seqs_are_ignored(rng, backend):
  """cu_q_lens entries past num_seqs may hold anything (a traced num_seqs leaves them)."""
  cache, table, lens, cu, query, keys, values = ragged_batch(rng, layout="flash")
  stale = cu.at[4:].set(0)
  out = cache.attend_ragged(0, query, table, lens, stale, num_seqs=3, backend=backend)
  assert_close(out, numpy_ragged(query, keys, values, lens, cu, 3, scale=0.125), 2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_rows_or_no_sequences(rng, backend):
  """No query rows gives [0, Hq, D]; no sequences (block_tables [0, W], cu_q_lens [0])
  makes every row padding: zeros, in the query's dtype, eagerly and under jit."""
  cache, table, lens, cu, query, _, _ = ragged_batch(rng, layout="flash", dtype=jnp.bfloat16)
  query = jnp.full(query.shape, jnp.nan, query.dtype)   # never read
  run = jax.jit(lambda c, q, t, k, u: c.attend_ragged(0, q, t, k, u, backend=backend))
  for attend in (lambda *a: cache.attend_ragged(0, *a, backend=backend),
                 lambda *a: run(cache, *a)):
    out = attend(query[:0], table, lens, jnp.zeros_like(cu))
    assert out.shape == (0,) + query.shape[1:] and out.dtype == query.dtype
    out = attend(query, table[:0], lens[:0], cu[:1])
    assert out.shape == query.shape and out.dtype == query.dtype
    assert not np.asarray(out, np.float32).any()


def test_bad_row_starts_under_jit_read_nothing(rng):
  """Under jit, rows before cu_q_lens[0] and rows of a sequence starting before row 0 are
  never read or written out of bounds; kernel and reference agree (padding rows 0)."""
  cache, table, lens, _, query, _, _ = ragged_batch(rng, layout="flash",
                                                    mix=((20, 2), (30, 3), (40, 40)))
  run = jax.jit(lambda c, cu, backend: c.attend_ragged(0, query, table, lens, cu,
                                                       backend=backend),
                static_argnums=2)
  for cu in ([2, 3, 5, 6], [-20, 30, 33, 33]):
    cu = jnp.asarray(cu, jnp.int32)
    expected = run(cache, cu, "reference")
    got = run(cache, cu, KERNEL)
    assert_close(got, expected, 2e-5)
    assert not np.asarray(got[int(cu[-1]):]).any()


def test_validation_errors(rng):
  cache, table, lens, cu, query, _, _ = ragged_batch(rng, layout="flash")
  with pytest.raises(ValueError, match="cu_q_lens\\[0\\] must be 0"):
    cache.attend_ragged(0, query, table, lens, cu + 1)
  with pytest.raises(ValueError, match="non-decreasing"):
    cache.attend_ragged(0, query, table, lens, cu.at[2].set(0))
  with pytest.raises(ValueError, match="exceeds the"):
    cache.attend_ragged(0, query[:10], table, lens, cu)
  with pytest.raises(ValueError, match="kv_lens counts the cached and the new"):
    cache.attend_ragged(0, query, table, lens.at[1].set(3), cu)
  with pytest.raises(ValueError, match="num_seqs = 9 is out of range"):
    cache.attend_ragged(0, query, table, lens, cu, num_seqs=9)
  with pytest.raises(ValueError, match="cu_q_lens must have shape"):
    cache.attend_ragged(0, query, table, lens, cu[:-1])
  with pytest.raises(ValueError, match="sinks must have shape"):
    cache.attend_ragged(0, query, table, lens, cu, sinks=jnp.zeros(3))
  with pytest.raises(ValueError, match="query must be"):
    cache.attend_ragged(0, query[:, :3], table, lens, cu)
