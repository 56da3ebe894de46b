"""group_by_scale_block (the per-block quant writes' grouping) against a numpy model, on
both of its sort paths (a packed 32-bit key, and argsort when capacity * T overflows it):
padding and out-of-range slots dropped, the last of duplicated slots kept, segments cut
at scale-block boundaries, fixed-size padding past the counts."""

import dataclasses

import jax
import numpy as np
import pytest

from jkv import segments


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
def test_group_by_scale_block_equals_numpy(capacity, num_tokens, unit, rng):
  slot_mapping = rng.integers(0, min(capacity, 64), num_tokens).astype(np.int32)
  slot_mapping[rng.random(num_tokens) < 0.2] = -1
  slot_mapping[rng.random(num_tokens) < 0.1] = capacity        # just past the cache
  got = segments.Segments(*jax.jit(
      lambda s: dataclasses.astuple(segments.group_by_scale_block(s, capacity, unit)))(
          slot_mapping))
  tokens, slots, starts, lengths = numpy_segments(slot_mapping, capacity, unit)
  kept, count = len(tokens), len(starts)
  pad = num_tokens - kept
  np.testing.assert_array_equal(got.token, tokens + [-1] * pad)
  np.testing.assert_array_equal(got.slot, slots + [-1] * pad)
  assert int(got.num_segments) == count
  np.testing.assert_array_equal(got.start, starts + [0] * (num_tokens - count))
  np.testing.assert_array_equal(got.length, lengths + [0] * (num_tokens - count))
  segment_of = np.repeat(np.arange(count), lengths).tolist()
  np.testing.assert_array_equal(got.segment, segment_of + [num_tokens - 1] * pad)
