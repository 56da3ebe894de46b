"""The per-block quant writes' grouping against a numpy model: sort_by_scale_block on both of
its sort paths (a packed 32-bit key, and argsort when capacity * T overflows it) and
index_by_slot (a table over the slots, no sort), in engine order, shuffled, with
duplicates: padding and out-of-range slots dropped, the last of duplicated slots kept,
segments cut at scale-block boundaries, fixed-size padding past the counts. And in one
jitted step, every layer's per-block write shares one grouping."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkv
from conftest import KERNEL
from jkv import layout as layout_lib, segments


def numpy_segments(slot_mapping, capacity, unit):
  last = {}
  for t, s in enumerate(slot_mapping):
    if 0 <= s < capacity:
      last[int(s)] = t
  slots = sorted(last)
  tokens = [last[s] for s in slots]
  starts = [i for i, s in enumerate(slots) if i == 0 or s // unit != slots[i - 1] // unit]
  lengths = [end - start for start, end in zip(starts, starts[1:] + [len(slots)])]
  return tokens, slots, starts, lengths


@pytest.mark.parametrize("capacity", [64, 1 << 30])   # packed sort; argsort
@pytest.mark.parametrize("num_tokens,unit", [(1, 4), (13, 4), (40, 16), (300, 1)])
def test_sort_by_scale_block_equals_numpy(capacity, num_tokens, unit, rng):
  slot_mapping = rng.integers(0, min(capacity, 64), num_tokens).astype(np.int32)
  slot_mapping[rng.random(num_tokens) < 0.2] = -1
  slot_mapping[rng.random(num_tokens) < 0.1] = capacity        # just past the cache
  got = jax.jit(lambda s: segments.sort_by_scale_block(s, capacity, unit))(slot_mapping)
  tokens, slots, starts, lengths = numpy_segments(slot_mapping, capacity, unit)
  kept, count = len(tokens), len(starts)
  pad = num_tokens - kept
  np.testing.assert_array_equal(got.token, tokens + [-1] * pad)
  np.testing.assert_array_equal(got.slot, slots + [-1] * pad)
  assert int(got.num_segments) == count and not got.slot_is_position
  np.testing.assert_array_equal(got.start, starts + [0] * (num_tokens - count))
  np.testing.assert_array_equal(got.length, lengths + [0] * (num_tokens - count))
  full = [int(all(u * unit + i in slots for i in range(unit)))
          for u in (slots[a] // unit for a in starts)]
  np.testing.assert_array_equal(got.full, full + [0] * (num_tokens - count))


def engine_slots(num_tokens, capacity, unit, rng, padded):
  """Sequences one after another, each filling its own scale blocks (in random order) from
  a random offset: every scale block's tokens are one run (padding rows between sequences
  when ``padded``)."""
  blocks, slots = iter(rng.permutation(capacity // unit).tolist()), []
  while len(slots) < num_tokens:
    block = next(blocks, None)
    if block is None:
      break
    length = int(rng.integers(1, 2 * unit))
    offset = int(rng.integers(0, unit))
    for i in range(length):
      if offset + i == unit:
        block, offset = next(blocks, None), -i
        if block is None:
          break
      slots.append(block * unit + offset + i)
    if padded:
      slots.append(-1)
  return np.asarray((slots + [-1] * num_tokens)[:num_tokens], np.int32)


@pytest.mark.parametrize("cache", ["every_block", "compacted"])
@pytest.mark.parametrize("order", ["engine", "engine_padded", "shuffled", "duplicates"])
@pytest.mark.parametrize("num_tokens,unit", [(1, 4), (37, 4), (200, 16), (300, 128)])
def test_index_by_slot_equals_numpy(cache, order, num_tokens, unit, rng):
  """The slot table's segments hold the numpy model's (token, slot) pairs: one segment per
  scale block written, its whole range of slots, the last writer of each slot (holes -1);
  group_by_scale_block takes the table for these small caches. With at most as many scale
  blocks as tokens ("every_block"), segment s is scale block s, empty where nothing writes
  it; with more ("compacted"), the written blocks in slot order, then padding past the
  count."""
  units = (min(num_tokens, 4 * max(num_tokens // unit, 4)) if cache == "every_block"
           else num_tokens + 1)
  capacity = units * unit
  slot_mapping = engine_slots(num_tokens, capacity, unit, rng, order == "engine_padded")
  if order == "shuffled":
    slot_mapping = rng.permutation(slot_mapping)
  if order == "duplicates" and num_tokens > 2:
    slot_mapping[-1] = slot_mapping[0]
  slot_mapping[rng.random(num_tokens) < 0.1] = capacity        # just past the cache
  got = jax.jit(lambda s: segments.group_by_scale_block(s, capacity, unit))(slot_mapping)
  assert got.token.shape == (capacity,)                         # the table, not the sort
  tokens, slots, starts, lengths = numpy_segments(slot_mapping, capacity, unit)
  want = sorted(tuple(zip(tokens[a:a + n], slots[a:a + n])) for a, n in zip(starts, lengths))
  token, slot, start, length, full = (np.asarray(x) for x in (
      got.token, got.slot, got.start, got.length, got.full))
  np.testing.assert_array_equal(slot, np.arange(capacity))
  assert got.slot_is_position   # (kernels use it: they compute the slots, not load them)
  written = np.zeros(capacity, bool)
  written[slots] = True
  np.testing.assert_array_equal(token >= 0, written)
  block_written = written.reshape(units, unit).any(axis=1)
  block_full = written.reshape(units, unit).all(axis=1)
  count = int(got.num_segments)
  if cache == "every_block":
    assert count == units and start.shape == (units,)
    np.testing.assert_array_equal(start, np.arange(units) * unit)
    np.testing.assert_array_equal(length, np.where(block_written, unit, 0))
    np.testing.assert_array_equal(full, block_full)
  else:
    assert count == len(starts) and start.shape == (num_tokens,)
    np.testing.assert_array_equal(start[:count], np.flatnonzero(block_written) * unit)
    np.testing.assert_array_equal(length[:count], unit)
    np.testing.assert_array_equal(full[:count], block_full[block_written])
    for padding in (start, length, full):
      np.testing.assert_array_equal(padding[count:], 0)
  segs = sorted(tuple((int(token[i]), i) for i in range(a, a + n) if token[i] >= 0)
                for a, n in zip(start[:count], length[:count]) if n)
  assert segs == want


def _grouping_ops(hlo_text, pattern):
  """(number of instructions matching ``pattern`` in compiled HLO text, number of them that
  run inside a while loop). A loop runs the computations its body reaches through calls,
  fusions and nested loops."""
  calls, found, name = {}, {}, None
  for line in hlo_text.splitlines():
    header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if header:
      name = header.group(1)
      calls[name], found[name] = set(), 0
      continue
    if name is None:
      continue
    calls[name].update(re.findall(
        r"(?:calls|body|condition|to_apply|branch_computations)=\{?%?([\w.\-]+)", line))
    if re.search(pattern, line):
      found[name] += 1
  in_loop, todo = set(), [b for line in hlo_text.splitlines()
                          for b in re.findall(r"body=%?([\w.\-]+)", line)]
  while todo:
    computation = todo.pop()
    if computation not in in_loop:
      in_loop.add(computation)
      todo.extend(calls.get(computation, ()))
  return sum(found.values()), sum(found[c] for c in in_loop if c in found)


@pytest.mark.parametrize("backend,num_blocks", [("reference", 8), (KERNEL, 8), (KERNEL, 1024)])
@pytest.mark.parametrize("loop", ["unrolled", "scan"])
def test_grouping_runs_once_per_step_for_all_layers(backend, num_blocks, loop, rng):
  """The grouping depends on slot_mapping alone, so in one jitted step the per-block writes
  of every layer share one: XLA merges the unrolled layers' copies, and XLA:CPU hoists it
  out of a lax.scan over layers; XLA:GPU (jax 0.11.2, H100) leaves it in the loop body,
  where a scan groups once per layer (README, "per-block write"). The grouping is the sort
  (the reference; the kernel path with 1024 blocks, more than TABLE_SLOTS_PER_TOKEN slots
  per token) or the slot table's scatter (the kernel path with 8 blocks): a sort of the
  packed uint32 keys (XLA:GPU pairs them with an index, so the result may be a tuple), or a
  scatter into int32 [capacity]. The reference's re-quantization argsorts booleans per
  layer, which is not counted."""
  num_layers, tokens, heads, head_size, block_size = 3, 40, 2, 64, 16
  capacity = num_blocks * block_size
  key = jnp.asarray(rng.standard_normal((tokens, heads, head_size)), jnp.bfloat16)
  shapes = layout_lib.cache_shapes("vllm", num_blocks, block_size, heads, head_size, jnp.int8)
  caches = (jnp.zeros((num_layers,) + shapes[0], jnp.int8),
            jnp.zeros((num_layers,) + shapes[1], jnp.int8),
            jnp.ones((num_layers, num_blocks, heads)), jnp.ones((num_layers, num_blocks, heads)))
  slot_mapping = jnp.asarray(rng.permutation(capacity)[:tokens], jnp.int32)

  def write(layer_caches, slots):
    return jkv.write_quant_kv(key, key, *layer_caches, slots, granularity="block",
                              layout="vllm", backend=backend)

  def step(caches, slots):
    if loop == "scan":
      return jax.lax.scan(lambda carry, c: (carry, write(c, slots)), 0, caches)[1]
    return [write([c[i] for c in caches], slots) for i in range(num_layers)]

  hlo = jax.jit(step).lower(caches, slot_mapping).compile().as_text()
  table = backend != "reference" and capacity <= segments.TABLE_SLOTS_PER_TOKEN * tokens
  pattern = (rf"= s32\[{capacity}\]\{{0\}} scatter\(" if table
             else r"= \(?u32\[[^=]* sort\(")
  hoisted = loop == "unrolled" or jax.default_backend() == "cpu"
  assert _grouping_ops(hlo, pattern) == (1, 0 if hoisted else 1)
