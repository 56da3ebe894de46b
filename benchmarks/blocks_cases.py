"""Block benchmark cases: swap_blocks across device / pinned_host, copy_blocks over all
layers, and one PagePool step inside a jitted decode loop.

DESCRIPTION (below) goes into RESULTS.md with the table.
"""

from __future__ import annotations

DESCRIPTION = """Blocks of 16 tokens x 8 kv heads x d128, bf16 (32 KiB). Swaps: 1024 scattered
blocks between a 4096-block device cache and a pinned_host cache (4096 or 16384 blocks:
equal times show nothing copies the whole cache); times are wall-clock per blocking call
(median of 21, dispatch included) for swap_blocks and for the plain `jax.device_put` of
one contiguous 32 MiB array to / from pinned_host (the baseline the 'of ceiling' column
is relative to, for these rows). copy_blocks: 1024 (src, dst) pairs x 32 layers x K and
V (2 GiB read + 2 GiB written) as 64 per-layer arrays and as two layer-stacked arrays,
device time from unrolled chains, relative to the copy ceiling; 'chained pairs' makes
every source also a destination (staged copy). PagePool: one `append` of one token for
256 sequences, device time per step inside one jit."""

import jax
import jax.numpy as jnp
import numpy as np

import jkv
from benchmarks.timing import cuda_torch, per_call_seconds, torch_seconds, wall_seconds

BLOCK_SHAPE = (16, 8, 128)
DTYPE = jnp.bfloat16
BLOCK_BYTES = int(np.prod(BLOCK_SHAPE)) * 2
PAIRS = 1024
DEVICE_BLOCKS = 4096


def _sharding(kind):
  return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def device_put_seconds():
  """(D2H, H2D) seconds of a plain device_put of PAIRS blocks (one contiguous array)."""
  x = jax.device_put(jnp.ones((PAIRS,) + BLOCK_SHAPE, DTYPE), _sharding("device"))
  d2h = wall_seconds(lambda a: jax.device_put(a, _sharding("pinned_host")), lambda: (x,),
                     repeats=21)
  x_host = jax.device_put(x, _sharding("pinned_host"))
  h2d = wall_seconds(lambda a: jax.device_put(a, _sharding("device")), lambda: (x_host,),
                     repeats=21)
  return d2h, h2d


def swap_seconds(direction, host_blocks, backend):
  rng = np.random.default_rng(1)
  host = _sharding("pinned_host")
  device = _sharding("device")
  src_kind, dst_kind = (device, host) if direction == "D2H" else (host, device)
  num_src = DEVICE_BLOCKS if direction == "D2H" else host_blocks
  num_dst = host_blocks if direction == "D2H" else DEVICE_BLOCKS
  src = jax.device_put(jnp.ones((num_src,) + BLOCK_SHAPE, DTYPE), src_kind)
  pairs = np.stack([rng.permutation(num_src)[:PAIRS], rng.permutation(num_dst)[:PAIRS]], 1)
  state = {"dst": jax.device_put(jnp.zeros((num_dst,) + BLOCK_SHAPE, DTYPE), dst_kind)}

  def make():
    return ()

  def swap():
    state["dst"] = jkv.swap_blocks(src, state["dst"], pairs, backend=backend)
    return state["dst"]

  seconds = wall_seconds(swap, make, repeats=21)
  state.clear()
  return seconds


def torch_swap_seconds():
  """Peer: vLLM's swap as torch does it per block (``copy_`` of each block, non-blocking,
  into pinned memory), issued from Python; CUDA events."""
  torch = cuda_torch()
  if torch is None:
    return None
  rng = np.random.default_rng(1)
  src = torch.ones((DEVICE_BLOCKS,) + BLOCK_SHAPE, device="cuda", dtype=torch.bfloat16)
  dst = torch.zeros((DEVICE_BLOCKS,) + BLOCK_SHAPE, dtype=torch.bfloat16).pin_memory()
  pairs = [(int(s), int(d)) for s, d in zip(rng.permutation(DEVICE_BLOCKS)[:PAIRS],
                                             rng.permutation(DEVICE_BLOCKS)[:PAIRS])]

  def once(i):
    for s, d in pairs:
      dst[d].copy_(src[s], non_blocking=True)

  return torch_seconds(once, calls=3, warmup=1, repeats=3)


def copy_blocks_seconds(stacked, backend, chained=False, layers=32):
  rng = np.random.default_rng(2)
  if chained:   # every destination is also a source (staged)
    order = rng.permutation(DEVICE_BLOCKS)[:PAIRS + 1]
    pairs = np.stack([order[:-1], order[1:]], 1)
  else:         # sources and destinations disjoint (vLLM's tests)
    order = rng.permutation(DEVICE_BLOCKS)
    pairs = np.stack([order[:PAIRS], order[PAIRS:2 * PAIRS]], 1)
  pairs = jnp.asarray(pairs, jnp.int32)
  if stacked:
    shape = (layers, DEVICE_BLOCKS) + BLOCK_SHAPE
    make = lambda: ([jnp.ones(shape, DTYPE)], [jnp.ones(shape, DTYPE)])
  else:
    shape = (DEVICE_BLOCKS,) + BLOCK_SHAPE
    make = lambda: ([jnp.ones(shape, DTYPE) for _ in range(layers)],
                    [jnp.ones(shape, DTYPE) for _ in range(layers)])

  def step(state, i):
    keys, values = state
    return jkv.copy_blocks(keys, values, pairs, block_axis=1 if stacked else 0,
                           backend=backend)

  return per_call_seconds(make, step, n_small=2, n_large=8, repeats=5)


def torch_copy_blocks_seconds(layers=32):
  """Peer: per-layer ``index_copy_(0, dst, index_select(0, src))`` for K and V."""
  torch = cuda_torch()
  if torch is None:
    return None
  rng = np.random.default_rng(2)
  order = rng.permutation(DEVICE_BLOCKS)
  src = torch.as_tensor(order[:PAIRS], device="cuda")
  dst = torch.as_tensor(order[PAIRS:2 * PAIRS], device="cuda")
  caches = [torch.ones((DEVICE_BLOCKS,) + BLOCK_SHAPE, device="cuda", dtype=torch.bfloat16)
            for _ in range(2 * layers)]

  def once(i):
    for cache in caches:
      cache.index_copy_(0, dst, cache.index_select(0, src))

  seconds = torch_seconds(once, calls=5, warmup=1, repeats=3)
  caches.clear()
  torch.cuda.empty_cache()
  return seconds


def page_pool_step_seconds(num_seqs=256):
  """Device time of one PagePool.append (one token for every sequence) in a jitted loop."""
  pool0 = jkv.PagePool.create(num_pages=num_seqs * 8 + 1, page_size=16, max_seqs=num_seqs,
                              max_pages_per_seq=8)
  seq_ids = jnp.arange(num_seqs, dtype=jnp.int32)
  ones = jnp.ones((num_seqs,), jnp.int32)

  def make():
    return jax.tree.map(jnp.copy, pool0)

  def step(pool, i):
    pool, _ = pool.append(seq_ids, ones, max_new_pages=num_seqs)   # one token: <= 1 page each
    return pool

  return per_call_seconds(make, step, n_small=8, n_large=72, repeats=9)


def run(record):
  """``record(case, impl, seconds, bytes_moved, ceiling_tbs=None)``."""
  swap_bytes = PAIRS * BLOCK_BYTES
  d2h, h2d = device_put_seconds()
  baseline = {"D2H": swap_bytes / d2h / 1e12, "H2D": swap_bytes / h2d / 1e12}
  for direction, seconds in (("D2H", d2h), ("H2D", h2d)):
    record(f"swap 1024 blocks {direction}", "jax.device_put, contiguous (baseline)", seconds,
           swap_bytes, baseline[direction])
  for direction in ("D2H", "H2D"):
    for host_blocks in (4096, 16384):
      record(f"swap 1024 blocks {direction}, host cache {host_blocks} blocks", "jkv pallas",
             swap_seconds(direction, host_blocks, "pallas"), swap_bytes, baseline[direction])
    record(f"swap 1024 blocks {direction}, host cache 4096 blocks", "jkv reference (XLA)",
           swap_seconds(direction, 4096, "reference"), swap_bytes, baseline[direction])
  torch_s = torch_swap_seconds()
  if torch_s is not None:
    record("swap 1024 blocks D2H, host cache 4096 blocks", "torch per-block copy_ (Python loop)",
           torch_s, swap_bytes, baseline["D2H"])
  copy_bytes = 2 * PAIRS * BLOCK_BYTES * 2 * 32
  for stacked in (False, True):
    case = "copy_blocks 1024 x 32 layers" + (", stacked [L, nb, ...]" if stacked else
                                             ", 64 arrays")
    record(case, "jkv pallas", copy_blocks_seconds(stacked, "pallas"), copy_bytes)
    record(case, "jkv reference (XLA)", copy_blocks_seconds(stacked, "reference"), copy_bytes)
  record("copy_blocks 1024 x 32 layers, 64 arrays, chained pairs", "jkv pallas",
         copy_blocks_seconds(False, "pallas", chained=True), copy_bytes)
  torch_s = torch_copy_blocks_seconds()
  if torch_s is not None:
    record("copy_blocks 1024 x 32 layers, 64 arrays", "torch index_select + index_copy_",
           torch_s, copy_bytes)
  record("PagePool.append, 256 sequences x 1 token", "jkv (XLA, in a jitted loop)",
         page_pool_step_seconds(), 0)
