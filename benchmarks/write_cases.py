"""Paged write benchmark cases (section "write" of RESULTS.md): a 32K-token prefill and a
256-token decode into every layout, against jkv's reference (XLA) and the peers (XLA
scatter with unique indices, torch ``index_copy_``), and one token into a 1 GiB and a
32 GiB cache (the in-place proof: equal cost).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jkv
from benchmarks.timing import cuda_torch, per_call_seconds, torch_seconds
from jkv import layout as layout_lib
from pallas_kernels import write as kernels

TOKENS, HEADS, HEAD_SIZE, BLOCK = 32768, 8, 128, 16
DTYPE = jnp.bfloat16
LAYOUTS = [("vllm", "NHD"), ("asm", "NHD"), ("flash", "NHD"), ("hnd", "NHD"),
           ("packed", "NHD"), ("packed", "HND")]
BYTES_PER_TOKEN = 4 * HEADS * HEAD_SIZE * 2   # K and V, read and written, bf16


def random_inputs(num_tokens, seed):
  rng = np.random.default_rng(seed)
  key = jnp.asarray(rng.standard_normal((num_tokens, HEADS, HEAD_SIZE)), DTYPE)
  value = jnp.asarray(rng.standard_normal((num_tokens, HEADS, HEAD_SIZE)), DTYPE)
  return key, value


def prefill_slots(num_tokens, num_blocks, seed, variants):
  """Scattered pages: consecutive tokens fill a page, pages are a random pick of blocks."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(variants):
    pages = rng.permutation(num_blocks)[: num_tokens // BLOCK]
    t = np.arange(num_tokens)
    out.append(jnp.asarray(pages[t // BLOCK] * BLOCK + t % BLOCK, jnp.int32))
  return out


def fresh(key, value, slot_sets):
  """New copies of the inputs (the timed chains donate their whole state)."""
  return jnp.copy(key), jnp.copy(value), tuple(jnp.copy(s) for s in slot_sets)


def make_caches(layout, kv_layout, num_blocks, dtype=DTYPE, seed=1):
  """Random caches; caches over 2 GiB are filled with a constant (random would need a
  float32 temporary of twice their size)."""
  k_shape, v_shape = layout_lib.cache_shapes(layout, num_blocks, BLOCK, HEADS, HEAD_SIZE, dtype,
                                             kv_layout)
  def make(shape, seed):
    if np.prod(shape) * 2 > 2 * 2**30:
      return jnp.full(shape, 0.5, dtype)
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)
  if v_shape is None:
    return (make(k_shape, seed),)
  return make(k_shape, seed), make(v_shape, seed + 1)


def time_write(layout, kv_layout, num_tokens, num_blocks, slot_sets, backend="pallas", tile=None,
               small=False):
  """Device seconds of one write of num_tokens into a fresh num_blocks cache."""
  key, value = random_inputs(num_tokens, 7)
  planes = layout_lib.planes(layout, BLOCK, HEADS, HEAD_SIZE, DTYPE, kv_layout)

  def make():
    return make_caches(layout, kv_layout, num_blocks), fresh(key, value, slot_sets)

  def step(state, i):
    caches, (k, v, slots) = state
    s = slots[i % len(slots)]
    if tile is not None:
      tb, eb, warps, arrange = tile
      caches = kernels.scatter_kv(
          k, v, caches[0], caches[1] if len(caches) > 1 else None, s, 0,
          jnp.ones((1,), jnp.float32), jnp.ones((1,), jnp.float32), key_plane=planes[0],
          value_plane=planes[1], num_blocks=num_blocks, quant_dtype=None, interpret=False,
          tokens_per_program=tb, elems_per_program=eb, num_warps=warps, arrange=arrange)
    else:
      caches = jkv.write_kv(k, v, caches[0], caches[1] if len(caches) > 1 else None, s,
                            layout=layout, kv_layout=kv_layout, backend=backend)
    return caches, (k, v, slots)

  if small:  # microsecond ops: longer chains so the slope rises above timer noise
    return per_call_seconds(make, step, n_small=20, n_large=220, repeats=11)
  return per_call_seconds(make, step)


def time_xla_scatter_nhd(num_tokens, num_blocks, slot_sets):
  """Peer: XLA scatter with unique_indices=True on [num_blocks * bs, H, D] rows."""
  key, value = random_inputs(num_tokens, 7)

  def make():
    caches = make_caches("flash", "NHD", num_blocks)
    return (tuple(c.reshape(num_blocks * BLOCK, HEADS, HEAD_SIZE) for c in caches),
            fresh(key, value, slot_sets))

  def step(state, i):
    (kc, vc), (k, v, slots) = state
    s = slots[i % len(slots)]
    kc = kc.at[s].set(k, unique_indices=True, mode="drop")
    vc = vc.at[s].set(v, unique_indices=True, mode="drop")
    return (kc, vc), (k, v, slots)

  return per_call_seconds(make, step)


def time_torch_index_copy(num_tokens, num_blocks, slot_sets):
  """Peer: torch ``index_copy_`` into [num_blocks * bs, H * D] rows (CUDA events)."""
  torch = cuda_torch()
  if torch is None:
    return None
  dev = torch.device("cuda")
  rows = num_blocks * BLOCK
  kc = torch.randn(rows, HEADS * HEAD_SIZE, device=dev, dtype=torch.bfloat16)
  vc = torch.randn_like(kc)
  k = torch.randn(num_tokens, HEADS * HEAD_SIZE, device=dev, dtype=torch.bfloat16)
  v = torch.randn_like(k)
  slots = [torch.as_tensor(np.asarray(s), device=dev, dtype=torch.int64) for s in slot_sets]
  def once(i):
    kc.index_copy_(0, slots[i % len(slots)], k)
    vc.index_copy_(0, slots[i % len(slots)], v)
  seconds = torch_seconds(once, calls=40, warmup=5)
  kc = vc = k = v = None   # frees the GPU memory (the closure above holds them)
  torch.cuda.empty_cache()
  return seconds


def run(record, sweep=False):
  """Plain (unquantized) writes; returns the 32 GiB / 1 GiB one-token time ratio.
  ``record(case, impl, seconds, num_tokens)``; ``sweep``: also kernel tile variants."""

  num_blocks = 2 * TOKENS // BLOCK
  slots = prefill_slots(TOKENS, num_blocks, 0, 4)
  for layout, kv_layout in LAYOUTS:
    case = f"prefill 32K {layout}" + (f" {kv_layout}" if layout == "packed" else "")
    record(case, "jkv pallas", time_write(layout, kv_layout, TOKENS, num_blocks, slots), TOKENS)
    record(case, "jkv reference (XLA)",
           time_write(layout, kv_layout, TOKENS, num_blocks, slots, backend="reference"), TOKENS)
  record("prefill 32K flash", "XLA scatter unique_indices",
         time_xla_scatter_nhd(TOKENS, num_blocks, slots), TOKENS)
  torch_s = time_torch_index_copy(TOKENS, num_blocks, slots)
  if torch_s is not None:
    record("prefill 32K flash", "torch index_copy_", torch_s, TOKENS)

  if sweep:
    for layout in ("flash", "vllm", "asm"):
      for tile in [(8, 1024, 4, True), (16, 1024, 4, True), (8, 1024, 2, True),
                   (4, 1024, 4, True), (8, 1024, 8, True), (8, 1024, 4, False),
                   (16, 512, 4, True), (32, 256, 4, True)]:
        try:
          s = time_write(layout, "NHD", TOKENS, num_blocks, slots, tile=tile)
          record(f"prefill 32K {layout}", f"tile {tile}", s, TOKENS)
        except Exception as err:  # a variant that does not compile is reported, not fatal
          print(f"prefill 32K {layout} tile {tile}: failed: {type(err).__name__}: {err}"[:300])

  rng = np.random.default_rng(3)
  dec_blocks = 4096
  dec_slots = [jnp.asarray(rng.permutation(dec_blocks * BLOCK)[:256], jnp.int32) for _ in range(4)]
  for layout, kv_layout in LAYOUTS:
    case = f"decode 256 {layout}" + (f" {kv_layout}" if layout == "packed" else "")
    record(case, "jkv pallas", time_write(layout, kv_layout, 256, dec_blocks, dec_slots,
                                          small=True), 256)
  record("decode 256 flash", "jkv reference (XLA)",
         time_write("flash", "NHD", 256, dec_blocks, dec_slots, backend="reference", small=True),
         256)
  if sweep:
    for layout in ("vllm", "asm"):
      for tile in [(1, 1024, 4, True), (1, 256, 4, True), (2, 512, 4, True), (4, 256, 4, True),
                   (1, 1024, 4, False), (8, 128, 4, True)]:
        s = time_write(layout, "NHD", 256, dec_blocks, dec_slots, tile=tile, small=True)
        record(f"decode 256 {layout}", f"tile {tile}", s, 256)

  # One token into a 1 GiB and a 32 GiB cache, alternated three times (median each):
  # equal cost proves the write does not copy the cache.
  one = {1: [], 32: []}
  for _ in range(3):
    for gib in (1, 32):
      nb = int(gib * 2**30) // (2 * BLOCK * HEADS * HEAD_SIZE * 2)
      s = [jnp.asarray(rng.integers(0, nb * BLOCK, 1), jnp.int32) for _ in range(4)]
      one[gib].append(time_write("flash", "NHD", 1, nb, s, small=True))
  for gib in (1, 32):
    record(f"1 token into {gib} GiB cache (median of 3)", "jkv pallas",
           float(np.median(one[gib])), 1)
  ratio = float(np.median(one[32]) / np.median(one[1]))
  print(f"32 GiB / 1 GiB one-token write time ratio: {ratio:.3f}")
  return ratio
