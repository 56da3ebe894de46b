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
"lowering" section)."""

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


def time_write(layout):
  num_blocks = 2 * TOKENS // BLOCK
  key, value = write_cases.random_inputs(TOKENS, 7)
  slot_sets = write_cases.prefill_slots(TOKENS, num_blocks, 3, 4)

  def make():
    return _caches(layout, num_blocks), write_cases.fresh(key, value, slot_sets)

  def step(state, i):
    caches, (k, v, slots) = state
    caches = jkv.write_kv(k, v, caches[0], caches[1] if len(caches) > 1 else None,
                          slots[i % len(slots)], layout=layout, layer=LAYER,
                          backend="pallas", lowering="triton")
    return caches, (k, v, slots)

  return per_call_seconds(make, step), TOKENS * write_cases.BYTES_PER_TOKEN


def time_decode(layout):
  num_blocks, table, lens = attention_cases._tables(attention_cases.BATCH,
                                                    attention_cases.CONTEXT)
  query = jax.random.normal(jax.random.key(9), (attention_cases.BATCH,
                                                attention_cases.Q_HEADS, HEAD_SIZE),
                            jnp.bfloat16)

  def make():
    return _caches(layout, num_blocks), jnp.copy(query)

  def attend(caches, q):
    return jkv.paged_attention_decode(q, caches[0], caches[1] if len(caches) > 1 else None,
                                      table, lens, layout=layout, layer=LAYER,
                                      backend="pallas", lowering="triton")

  seconds = attention_cases._chain(make, attend)
  return seconds, 2 * attention_cases.BATCH * attention_cases.CONTEXT * HEADS * HEAD_SIZE * 2


def run(record):
  names = {"max": "jkv pallas, MAX collection", "flash": "jkv pallas, flash stacked"}
  for layout in ("max", "flash"):
    seconds, nbytes = time_write(layout)
    record("write 32K, layer 3 of 8", names[layout], seconds, nbytes)
  for layout in ("max", "flash"):
    seconds, nbytes = time_decode(layout)
    record("decode 8 x 32K, 32/8 heads, layer 3 of 8", names[layout], seconds, nbytes)
