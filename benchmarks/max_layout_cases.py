"""Mojo MAX collection benchmark cases (section "max-layout"): the write and decode
attention over a collection [nb, 2, L, bs, H, D] beside the same ops over layer-stacked
flash caches [L, nb, bs, H, D] (Triton kernels both: the Mosaic GPU kernels take stacked
caches only).

DESCRIPTION (below) goes into RESULTS.md with the table.
"""

from __future__ import annotations

DESCRIPTION = """8 layers, block 16, 8 kv heads, head size 128, bf16; every op on layer 3.
Write: 32K tokens, scattered pages; bytes = K+V read + written. Decode: batch 8 x 32K
tokens, 32 query heads, one call per row; bytes = the K and V entries read. "flash
stacked" is the same op over `[L, nb, bs, H, D]` K and V caches with the Triton kernel
(the MAX collection has no Mosaic GPU kernel; the flash write's Mosaic kernel is in the
"lowering" section).
Per token FP8 (e4m3): MAX's `quantization_granularity` 64 (2 scales per token and head, the
scale collection `[nb, 2, L, bs, H, 2]`) beside stacked flash caches with one scale per token
and head (`[L, nb, H, bs]` each); bytes count the FP8 entries and their float32 scales
(write: + the bf16 input read)."""

import jax
import jax.numpy as jnp

import jkv
from benchmarks import attention_cases, write_cases
from benchmarks.timing import per_call_seconds
from jkv import layout as layout_lib

LAYERS, LAYER = 8, 3
TOKENS, HEADS, HEAD_SIZE, BLOCK = (write_cases.TOKENS, write_cases.HEADS,
                                   write_cases.HEAD_SIZE, write_cases.BLOCK)


def _caches(layout, num_blocks):
  """A constant-filled collection (one array) or stacked flash K and V."""
  if layout == "max":
    return (jnp.full(layout_lib.max_shape(num_blocks, LAYERS, BLOCK, HEADS, HEAD_SIZE), 0.5,
                     jnp.bfloat16),)
  shape = (LAYERS, num_blocks, BLOCK, HEADS, HEAD_SIZE)
  return jnp.full(shape, 0.5, jnp.bfloat16), jnp.full(shape, 0.25, jnp.bfloat16)


def _write_seconds(arrays_of, write):
  """Device seconds of one 32K-token write into layer 3: ``arrays_of(num_blocks)`` makes
  the cache arrays, ``write(arrays, key, value, slot_mapping)`` returns them updated."""
  num_blocks = 2 * TOKENS // BLOCK
  key, value = write_cases.random_inputs(TOKENS, 7)
  slot_sets = write_cases.prefill_slots(TOKENS, num_blocks, 3, 4)

  def make():
    return arrays_of(num_blocks), write_cases.fresh(key, value, slot_sets)

  def step(state, i):
    arrays, (k, v, slots) = state
    return write(arrays, k, v, slots[i % len(slots)]), (k, v, slots)

  return per_call_seconds(make, step)


def _decode_seconds(arrays_of, attend):
  """Device seconds of one decode over 8 x 32K tokens: ``attend(arrays, query, block_tables,
  seq_lens)`` over ``arrays_of(num_blocks)``."""
  num_blocks, table, lens = attention_cases._tables(attention_cases.BATCH,
                                                    attention_cases.CONTEXT)
  query = jax.random.normal(jax.random.key(9), (attention_cases.BATCH,
                                                attention_cases.Q_HEADS, HEAD_SIZE),
                            jnp.bfloat16)

  def make():
    return arrays_of(num_blocks), jnp.copy(query)

  return attention_cases._chain(make, lambda arrays, q: attend(arrays, q, table, lens))


def time_write(layout):
  def write(caches, k, v, slots):
    return jkv.write_kv(k, v, caches[0], caches[1] if len(caches) > 1 else None, slots,
                        layout=layout, layer=LAYER, backend="pallas", lowering="triton")

  seconds = _write_seconds(lambda num_blocks: _caches(layout, num_blocks), write)
  return seconds, TOKENS * write_cases.BYTES_PER_TOKEN


def time_decode(layout):
  def attend(caches, q, table, lens):
    return jkv.paged_attention_decode(q, caches[0], caches[1] if len(caches) > 1 else None,
                                      table, lens, layout=layout, layer=LAYER,
                                      backend="pallas", lowering="triton")

  seconds = _decode_seconds(lambda num_blocks: _caches(layout, num_blocks), attend)
  return seconds, 2 * attention_cases.BATCH * attention_cases.CONTEXT * HEADS * HEAD_SIZE * 2


GROUPS = 2   # MAX's quantization_granularity HEAD_SIZE / GROUPS = 64


def _quant_arrays(layout, num_blocks):
  """FP8 caches and scales: the collection and its scale collection [nb, 2, L, bs, H, G],
  or stacked flash K, V and their per-token scales [L, nb, H, bs]."""
  fp8 = jnp.float8_e4m3fn
  if layout == "max":
    shape = layout_lib.max_shape(num_blocks, LAYERS, BLOCK, HEADS, HEAD_SIZE)
    return (attention_cases._fill(shape, fp8, 1), None,
            jnp.full(shape[:5] + (GROUPS,), 0.01, jnp.float32), None)
  shape = (LAYERS, num_blocks, BLOCK, HEADS, HEAD_SIZE)
  scales = (LAYERS, num_blocks, HEADS, BLOCK)
  return (attention_cases._fill(shape, fp8, 1), attention_cases._fill(shape, fp8, 2),
          jnp.full(scales, 0.01, jnp.float32), jnp.full(scales, 0.01, jnp.float32))


def time_quant_write(layout):
  def write(arrays, k, v, slots):
    return jkv.write_quant_kv(k, v, *arrays, slots, granularity="token", layout=layout,
                              layer=LAYER, backend="pallas")

  seconds = _write_seconds(lambda num_blocks: _quant_arrays(layout, num_blocks), write)
  groups = GROUPS if layout == "max" else 1
  return seconds, TOKENS * 2 * HEADS * (HEAD_SIZE * (2 + 1) + 4 * groups)


def time_quant_decode(layout):
  def attend(arrays, q, table, lens):
    key_cache, value_cache, k_scales, v_scales = arrays
    return jkv.paged_attention_decode(q, key_cache, value_cache, table, lens, layout=layout,
                                      layer=LAYER, k_dequant_scales=k_scales,
                                      v_dequant_scales=v_scales, asm_layout=True,
                                      backend="pallas", lowering="triton")

  seconds = _decode_seconds(lambda num_blocks: _quant_arrays(layout, num_blocks), attend)
  groups = GROUPS if layout == "max" else 1
  return seconds, (2 * attention_cases.BATCH * attention_cases.CONTEXT * HEADS
                   * (HEAD_SIZE + 4 * groups))


def run(record):
  names = {"max": "jkv pallas, MAX collection", "flash": "jkv pallas, flash stacked"}
  for layout in ("max", "flash"):
    seconds, nbytes = time_write(layout)
    record("write 32K, layer 3 of 8", names[layout], seconds, nbytes)
  for layout in ("max", "flash"):
    seconds, nbytes = time_decode(layout)
    record("decode 8 x 32K, 32/8 heads, layer 3 of 8", names[layout], seconds, nbytes)
  names = {"max": "jkv pallas, MAX collection, FP8, 2 scale groups",
           "flash": "jkv pallas, flash stacked, FP8 per token"}
  for layout in ("max", "flash"):
    seconds, nbytes = time_quant_write(layout)
    record("FP8 per-token write 32K, layer 3 of 8", names[layout], seconds, nbytes)
  for layout in ("max", "flash"):
    seconds, nbytes = time_quant_decode(layout)
    record("FP8 per-token decode 8 x 32K, 32/8 heads, layer 3 of 8", names[layout], seconds,
           nbytes)
