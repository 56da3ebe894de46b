"""Prefill-to-decode page transfer between two GPUs (section "transfer" of RESULTS.md): the
disaggregated step of ``tests/multiprocess_checks.py::check_prefill_to_decode`` on one host
with two GPUs, a prefill cache on the first and a decode cache on the second.

DESCRIPTION (below) goes into RESULTS.md with the table.
"""

from __future__ import annotations

DESCRIPTION = """A request's pages move from a prefill cache on GPU 0 to pages of a decode
cache on GPU 1: 32 layers x K and V x 16 tokens x 8 kv heads x d128 bf16 per page (2 MiB,
all layers of a page moved together), 256 scattered pages (a 4K-token prompt, 512 MiB).
Times are wall-clock per blocking call (median of 9): the gather on GPU 0, one
`jax.device_put` to GPU 1 and the scatter into the decode cache (donated: in place);
'of ceiling' is relative to the plain `jax.device_put` of one contiguous 512 MiB array
from GPU 0 to GPU 1 in the same run (its own row). The moved pages are checked bit for bit
against the prefill side's."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import wall_seconds

LAYERS, BLOCK, HEADS, HEAD_SIZE = 32, 16, 8, 128
NUM_BLOCKS, PAGES = 1024, 256
PAGE_BYTES = LAYERS * 2 * BLOCK * HEADS * HEAD_SIZE * 2


def run(record):
  """``record(case, impl, seconds, nbytes, ceiling_tbs=None)``; needs two GPUs."""
  if len(jax.devices()) < 2:
    print("transfer: needs two devices; skipped")
    return
  prefill_device, decode_device = jax.devices()[:2]
  shape = (LAYERS, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE)
  rng = np.random.default_rng(0)
  src_blocks = jnp.asarray(rng.permutation(NUM_BLOCKS)[:PAGES], jnp.int32)
  dst_blocks = jnp.asarray(rng.permutation(NUM_BLOCKS)[:PAGES], jnp.int32)
  prefill = [jax.device_put(jax.random.normal(jax.random.key(i), shape, jnp.float32)
                            .astype(jnp.bfloat16), prefill_device) for i in range(2)]
  decode = [jax.device_put(jnp.zeros(shape, jnp.bfloat16), decode_device) for _ in range(2)]

  take = jax.jit(lambda k, v, b: (k[:, b], v[:, b]))
  place = jax.jit(lambda k, v, pk, pv, b: (k.at[:, b].set(pk), v.at[:, b].set(pv)),
                  donate_argnums=(0, 1))
  src = jax.device_put(src_blocks, prefill_device)
  dst = jax.device_put(dst_blocks, decode_device)
  state = {"decode": decode}

  def transfer():
    pages = jax.device_put(take(*prefill, src), decode_device)
    state["decode"] = list(place(*state["decode"], *pages, dst))
    return state["decode"]

  nbytes = PAGES * PAGE_BYTES
  raw = jax.device_put(jnp.zeros((nbytes // 2,), jnp.bfloat16), prefill_device)
  raw_s = wall_seconds(lambda: jax.device_put(raw, decode_device))
  raw_tbs = nbytes / raw_s / 1e12
  record("256 pages (512 MiB), GPU 0 -> GPU 1", "jax.device_put, one contiguous array",
         raw_s, nbytes, raw_tbs)
  seconds = wall_seconds(transfer)
  record("256 pages (512 MiB), GPU 0 -> GPU 1", "gather + device_put + scatter", seconds,
         nbytes, raw_tbs)
  moved = [np.asarray(a[:, dst_blocks]) for a in state["decode"]]
  want = [np.asarray(a[:, src_blocks]) for a in prefill]
  for got, expected in zip(moved, want):
    assert (got.view(np.uint16) == expected.view(np.uint16)).all(), "pages differ"
  print("transfer: the moved pages equal the prefill side's bit for bit")
