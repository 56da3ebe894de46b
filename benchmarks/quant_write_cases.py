"""Quantized-write benchmark cases: per-token / per-block FP8 / INT8 and FP4 writes.

DESCRIPTION (below) goes into RESULTS.md with the table.
"""

from __future__ import annotations

DESCRIPTION = """32K tokens x 8 kv heads x d128, bf16 in, block 16, scattered pages (as the plain
writes). Bytes counted = K+V read (bf16) + K+V written (cache dtype) + scales written.
Each case times the compiled kernel and the jitted jnp reference of the same op; a
torch eager per-token FP8 write (amax, divide, cast, `index_copy_`) is the peer. A per-block
write first groups its tokens by scale block: here through a table of each slot's last
writer (a scatter, no sort, the same in any token order: "tokens shuffled" rows put the
same tokens in random order); a small write into a huge cache sorts its tokens instead.
"Grouping by block only" rows time that step alone (the table's is included in the
per-block rows). FP4 rows: the
reference only (the FP4 kernel was removed, slower than it)."""

import jax
import jax.numpy as jnp
import numpy as np

import jkv
from benchmarks.timing import cuda_torch, per_call_seconds, torch_seconds
from jkv import fp4, layout as layout_lib, segments as segments_lib
from pallas_kernels import block_quant, token_quant

TOKENS, HEADS, HEAD_SIZE, BLOCK = 32768, 8, 128, 16
DTYPE = jnp.bfloat16
INPUT_BYTES = 2 * TOKENS * HEADS * HEAD_SIZE * 2


def _inputs(num_tokens, seed=7):
  rng = np.random.default_rng(seed)
  shape = (num_tokens, HEADS, HEAD_SIZE)
  return (jnp.asarray(rng.standard_normal(shape), DTYPE),
          jnp.asarray(rng.standard_normal(shape), DTYPE))


def _slots(num_tokens, num_blocks, seed, variants=4, page=BLOCK, shuffled=False):
  """Consecutive tokens fill a page of ``page`` slots (a multiple of BLOCK, aligned);
  pages are a random pick. ``shuffled``: the tokens in random order."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(variants):
    pages = rng.permutation(num_blocks * BLOCK // page)[: -(-num_tokens // page)]
    t = np.arange(num_tokens)
    slots = pages[t // page] * page + t % page
    out.append(jnp.asarray(rng.permutation(slots) if shuffled else slots, jnp.int32))
  return out


QUICK = False   # --quick: shorter chains and fewer repeats (a short device slot)


def _time(make_arrays, op, key, value, slot_sets, small=False, chain=None):
  """Device seconds of one ``op``; chain: (n_small, n_large, repeats) instead of the
  defaults."""
  def make():
    return make_arrays(), (jnp.copy(key), jnp.copy(value), tuple(jnp.copy(s) for s in slot_sets))

  def step(state, i):
    arrays, (k, v, slots) = state
    # The barrier ties each call's slots to the previous call's caches: without it XLA
    # computes work on the slots alone (the per-block grouping) once per slot set, not
    # once per call, and the slope leaves it out.
    slot_mapping, arrays = jax.lax.optimization_barrier((slots[i % len(slots)], arrays))
    return op(k, v, arrays, slot_mapping), (k, v, slots)

  if chain:
    return per_call_seconds(make, step, *chain)
  if QUICK and not small:
    return per_call_seconds(make, step, n_small=4, n_large=24, repeats=5)
  if small:   # (longer chains took minutes to compile with a grouping per call)
    return per_call_seconds(make, step, n_small=8, n_large=88, repeats=11)
  return per_call_seconds(make, step)


def _scaled_arrays(layout, num_blocks, dtype, granularity, unit=BLOCK, num_layers=None):
  """() -> (key_cache, value_cache, k_scales, v_scales), zero caches and unit scales, with a
  leading num_layers dim when given."""
  k_shape, v_shape = layout_lib.cache_shapes(layout, num_blocks, BLOCK, HEADS, HEAD_SIZE, dtype)
  if granularity == "token":
    scales = (num_blocks, HEADS, BLOCK)
  else:
    scales = (num_blocks * BLOCK // unit, HEADS)
  if num_layers is not None:
    k_shape, v_shape, scales = ((num_layers,) + shape for shape in (k_shape, v_shape, scales))
  def make():
    return (jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype),
            jnp.ones(scales, jnp.float32), jnp.ones(scales, jnp.float32))
  return make


def _decode_slots(num_tokens, num_blocks, seed, variants=4):
  """One token per sequence, each into its own block at offset 1..BLOCK-1 (a block that
  already holds tokens: a growing scale re-quantizes them)."""
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.permutation(num_blocks)[:num_tokens] * BLOCK
                      + rng.integers(1, BLOCK, num_tokens), jnp.int32) for _ in range(variants)]


def time_scaled(granularity, layout, dtype, backend, num_tokens=TOKENS, num_blocks=None,
                unit=BLOCK, small=False, seed=0, decode=False, chain=None, page=BLOCK,
                shuffled=False):
  num_blocks = num_blocks or 2 * TOKENS // BLOCK
  key, value = _inputs(num_tokens)
  slot_sets = (_decode_slots(num_tokens, num_blocks, seed) if decode
               else _slots(num_tokens, num_blocks, seed, page=page, shuffled=shuffled))

  def op(k, v, arrays, slots):
    return jkv.write_quant_kv(k, v, *arrays, slots, granularity=granularity, layout=layout,
                              tokens_per_scale_block=unit if granularity == "block" else None,
                              backend=backend)

  return _time(_scaled_arrays(layout, num_blocks, dtype, granularity, unit), op, key, value,
               slot_sets, small=small, chain=chain)


LAYERS_DESCRIPTION = """One step of a model writes every layer with the same `slot_mapping`: the
per-block write's grouping (the slot table, or the sort) depends on the slots alone, so XLA
computes it once for all layers of a step that unrolls them, as here (on the GPU it stays
in the body of a `lax.scan` over layers: `tests/test_segments.py` checks the compiled
HLO). Each row
times one jitted step of per-block INT8 writes of 32K tokens x 8 kv heads x d128 (bf16 in,
block 16, scattered pages, as above) into 1 or 8 layers of stacked caches; bytes and
device time are the whole step's, so 'of ceiling' with 8 layers is the per-layer cost with
the grouping shared."""


def time_layers(layout, dtype, num_layers, backend="pallas", num_tokens=TOKENS):
  """Device seconds of one step writing the same ``num_tokens`` tokens (per block) into
  ``num_layers`` layers of stacked caches, one ``slot_mapping`` for all layers."""
  num_blocks = 2 * num_tokens // BLOCK
  key, value = _inputs(num_tokens)

  def op(k, v, arrays, slots):
    for layer in range(num_layers):
      arrays = jkv.write_quant_kv(k, v, *arrays, slots, granularity="block", layout=layout,
                                  layer=layer, backend=backend)
    return arrays

  # 8 layers: chains of 4 and 24 steps already span 32 and 192 writes.
  return _time(_scaled_arrays(layout, num_blocks, dtype, "block", num_layers=num_layers), op,
               key, value, _slots(num_tokens, num_blocks, 0),
               chain=(4, 24, 7) if num_layers > 1 else None)


def run_layers(record):
  """Per-block INT8 writes of one step into 1 and 8 layers (the grouping shared)."""
  step_bytes = INPUT_BYTES + INPUT_BYTES // 2 + 2 * (TOKENS // BLOCK) * HEADS * 4
  for layout in ("vllm", "asm", "flash"):
    for num_layers in (1, 8):
      record(f"per-block int8 32K {layout}, {num_layers} layer{'s' * (num_layers > 1)} "
             "per step", "jkv pallas", time_layers(layout, jnp.int8, num_layers),
             num_layers * step_bytes)


ASM_PA_DESCRIPTION = """AITER's `reshape_and_cache_with_block_quant_for_asm_pa`: one scale per
128 / 256 tokens (`ori_block_size`) of the ASM layout's 16-token blocks. 32K tokens x 8 kv
heads x d128, bf16 in. Pages of `ori_block_size` tokens (the engine's page, as in AITER's
test: each scale block's tokens one run) or scattered 16-token pages (a scale block gets a
few pages per write, holes between them). Bytes as above (scales: one per
128 / 256 tokens). Short chains (their compiles are long): 2 calls under the profiler,
slopes of 2 vs 10 calls over 5 repeats otherwise."""

ASM_PA_CHAIN = (2, 10, 5)


def run_asm_pa(record):
  """Per-block writes with 128 / 256-token scale blocks (asm_pa), and the reference."""
  cache_bytes = INPUT_BYTES // 2
  for unit in (128, 256):
    total = INPUT_BYTES + cache_bytes + 2 * (TOKENS // unit) * HEADS * 4
    for name, dtype in (("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)):
      backends = (("pallas", "jkv pallas"),) + (
          (("reference", "jkv reference (XLA)"),) if (unit, name) == (128, "int8") else ())
      for backend, impl in backends:
        # Scattered 16-token pages (holes in scale blocks) for one size (compiles are long).
        for page in (unit, BLOCK) if (unit, backend) == (128, "pallas") else (unit,):
          record(f"per-block {name} 32K asm_pa {unit}, {page}-token pages", impl,
                 time_scaled("block", "asm", dtype, backend, unit=unit, chain=ASM_PA_CHAIN,
                             page=page), total)


def time_fp4(fmt):
  """The FP4 write (jnp reference: there is no FP4 kernel)."""
  num_blocks = 2 * TOKENS // BLOCK
  key, value = _inputs(TOKENS)
  data, scales = jkv.fp4_cache_shapes(num_blocks, BLOCK, HEADS, HEAD_SIZE, fmt)

  def make():
    return (jnp.zeros(data, jnp.uint8), jnp.zeros(data, jnp.uint8),
            jnp.zeros(scales, fp4.SCALE_DTYPE[fmt]), jnp.zeros(scales, fp4.SCALE_DTYPE[fmt]))

  def op(k, v, arrays, slots):
    return jkv.reshape_and_cache_fp4(k, v, *arrays, slots, fmt, backend="reference")

  return _time(make, op, key, value, _slots(TOKENS, num_blocks, 0))


def time_segments(grouping):
  """Device time of grouping 32K tokens (in engine order) by block: "table"
  (:func:`jkv.segments.index_by_slot`) or "sort" (:func:`jkv.segments.sort_by_scale_block`)."""
  slot_sets = _slots(TOKENS, 2 * TOKENS // BLOCK, 0)
  group = {"table": segments_lib.index_by_slot,
           "sort": segments_lib.sort_by_scale_block}[grouping]

  def make():
    return (tuple(jnp.copy(s) for s in slot_sets), jnp.zeros((TOKENS,), jnp.int32))

  def step(state, i):
    slots, acc = state
    # The barrier makes every call's input distinct (only 4 slot sets repeat along the
    # chain; without it XLA computes each set's grouping once).
    slot_mapping = jax.lax.optimization_barrier((slots[i % len(slots)], acc))[0]
    seg = group(slot_mapping, 2 * TOKENS, BLOCK)
    return slots, acc + seg.token[:TOKENS] + seg.start[0] + seg.length[0]

  return per_call_seconds(make, step)


def time_torch_pertoken_fp8():
  """Peer: torch eager per-token FP8 write into a flash (token-major) cache: amax,
  divide, cast, ``index_copy_``; CUDA events."""
  torch = cuda_torch()
  if torch is None or not hasattr(torch, "float8_e4m3fn"):
    return None
  dev = torch.device("cuda")
  rows = 2 * TOKENS
  # index_copy_ has no FP8 kernel: the cache is uint8 and takes the FP8 bits.
  caches = [torch.zeros(rows, HEADS, HEAD_SIZE, device=dev, dtype=torch.uint8)
            for _ in range(2)]
  scales = [torch.ones(rows, HEADS, device=dev) for _ in range(2)]
  inputs = [torch.randn(TOKENS, HEADS, HEAD_SIZE, device=dev, dtype=torch.bfloat16)
            for _ in range(2)]
  slots = [torch.as_tensor(np.asarray(s), device=dev, dtype=torch.int64)
           for s in _slots(TOKENS, rows // BLOCK, 0)]

  def once(i):
    for x, cache, scale in zip(inputs, caches, scales):
      xf = x.float()
      s = xf.abs().amax(-1) / 448.0
      q = (xf / s.clamp(min=1e-12).unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
      q = q.view(torch.uint8)
      cache.index_copy_(0, slots[i % len(slots)], q)
      scale.index_copy_(0, slots[i % len(slots)], s)

  seconds = torch_seconds(once, calls=20)
  caches = scales = inputs = None   # frees the GPU memory (the closure above holds them)
  torch.cuda.empty_cache()
  return seconds


def kernel_variant(granularity, layout, dtype, unit=BLOCK, page=BLOCK, **kernel_args):
  """A kernel launch parameter variant, called directly: ``(op, make_arrays, key, value,
  slot_sets)`` of 32K tokens in pages of ``page`` slots, ``op(key, value, arrays, slots)
  -> arrays``; unit: tokens per scale block (per-block)."""
  num_blocks = 2 * TOKENS // BLOCK
  key, value = _inputs(TOKENS)
  slot_sets = _slots(TOKENS, num_blocks, 0, page=page)
  planes = layout_lib.planes(layout, BLOCK, HEADS, HEAD_SIZE, dtype)

  def op(k, v, arrays, slots):
    common = dict(key_plane=planes[0], value_plane=planes[1], num_blocks=num_blocks,
                  scales_block_major=True, interpret=False, **kernel_args)
    if granularity == "token":
      return token_quant.token_quant(k, v, *arrays, slots, 0, **common)
    seg = segments_lib.group_by_scale_block(slots, num_blocks * BLOCK, unit)
    return block_quant.block_quant(k, v, *arrays, seg, 0, unit_size=unit, **common)

  return (op, _scaled_arrays(layout, num_blocks, dtype, granularity, unit), key, value,
          slot_sets)


def time_kernel_variant(granularity, layout, dtype, unit=BLOCK, **kernel_args):
  """A kernel launch parameter variant (``--sweep``): :func:`kernel_variant`, timed."""
  op, make_arrays, key, value, slot_sets = kernel_variant(granularity, layout, dtype, unit,
                                                          **kernel_args)
  return _time(make_arrays, op, key, value, slot_sets)


SWEEP = {
    "block": [dict(tokens_per_chunk=c, heads_per_program=hb, num_warps=w, max_programs=p)
              for c, hb, w, p in ((16, 2, 4, 2048), (16, 4, 4, 2048), (16, 8, 8, 2048),
                                  (8, 4, 4, 2048), (8, 8, 4, 2048), (4, 8, 4, 2048),
                                  (16, 2, 4, 4096))],
}


def sweep(record):
  """Launch-parameter variants of the per-block kernels (32K, INT8). (The per-token
  kernel's tiles came from sweeps of the same kind: see ``token_quant``'s defaults.)"""
  total = INPUT_BYTES + INPUT_BYTES // 2
  for granularity, variants in SWEEP.items():
    for layout in ("vllm", "asm", "flash"):
      for args in variants:
        try:
          s = time_kernel_variant(granularity, layout, jnp.int8, **args)
          record(f"sweep {granularity} int8 {layout}", str(args), s, total)
        except Exception as err:  # a variant that does not compile is reported, not fatal
          print(f"sweep {granularity} {layout} {args}: failed: {type(err).__name__}: {err}"[:300])


def run_quick(record):
  """The cases the acceptance figures need, with short chains (``--quick``)."""
  global QUICK
  QUICK = True
  cache_bytes = INPUT_BYTES // 2
  token_bytes = INPUT_BYTES + cache_bytes + 2 * TOKENS * HEADS * 4
  block_bytes = INPUT_BYTES + cache_bytes + 2 * (TOKENS // BLOCK) * HEADS * 4
  names = {jnp.float8_e4m3fn: "fp8", jnp.int8: "int8"}
  impls = {"pallas": "jkv pallas", "reference": "jkv reference (XLA)"}
  for granularity, layout, dtype, backend in (
      ("token", "flash", jnp.float8_e4m3fn, "pallas"),
      ("token", "flash", jnp.float8_e4m3fn, "reference"),
      ("token", "flash", jnp.int8, "pallas"), ("token", "vllm", jnp.float8_e4m3fn, "pallas"),
      ("block", "asm", jnp.float8_e4m3fn, "pallas"),
      ("block", "asm", jnp.float8_e4m3fn, "reference")):
    record(f"per-{granularity} {names[dtype]} 32K {layout}", impls[backend],
           time_scaled(granularity, layout, dtype, backend),
           token_bytes if granularity == "token" else block_bytes)


def run_decode(record):
  """Decode-sized block-quant writes and the in-place check; returns the 16 GiB / 1 GiB
  one-token time ratio."""
  # Decode: 256 tokens, each into its own partly filled block (the scale may grow and
  # re-quantize the block).
  decode_bytes = 2 * 256 * HEADS * HEAD_SIZE * 3
  for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
    record("per-block int8 decode 256", impl,
           time_scaled("block", "vllm", jnp.int8, backend, num_tokens=256, num_blocks=4096,
                       small=True, seed=5, decode=True), decode_bytes)
  # One token into a 1 GiB and a 16 GiB block-quantized cache, alternated: equal cost
  # proves the write copies neither the cache nor its scales.
  one = {1: [], 16: []}
  for _ in range(3):
    for gib in one:
      nb = int(gib * 2**30) // (2 * BLOCK * HEADS * HEAD_SIZE)
      one[gib].append(time_scaled("block", "flash", jnp.int8, "pallas", num_tokens=1,
                                  num_blocks=nb, small=True, seed=gib, decode=True))
  for gib in one:
    record(f"per-block int8: 1 token into {gib} GiB cache (median of 3)", "jkv pallas",
           float(np.median(one[gib])), 2 * HEADS * HEAD_SIZE * 3)
  return float(np.median(one[16]) / np.median(one[1]))


def run(record, dtypes=("fp8",)):
  """The 32K-token cases of the given cache dtypes ("fp8", "int8"); with "int8" also the
  grouping-only rows and the FP4 references (one device call each: the ``quant`` and
  ``quant-int8`` sections). ``record(case, impl, seconds, bytes_moved)``."""
  cache_bytes = INPUT_BYTES // 2      # one byte per element, K and V
  token_scales = 2 * TOKENS * HEADS * 4
  block_scales = 2 * (TOKENS // BLOCK) * HEADS * 4
  for name in dtypes:
    dtype = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}[name]
    for layout in ("vllm", "flash"):
      case = f"per-token {name} 32K {layout}"
      for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
        record(case, impl, time_scaled("token", layout, dtype, backend),
               INPUT_BYTES + cache_bytes + token_scales)
    if name == "fp8":
      torch_s = time_torch_pertoken_fp8()
      if torch_s is not None:
        record("per-token fp8 32K flash", "torch eager (amax, cast, index_copy_)", torch_s,
               INPUT_BYTES + cache_bytes + token_scales)
    for layout in ("vllm", "asm", "flash"):
      case = f"per-block {name} 32K {layout}"
      for backend, impl in (("pallas", "jkv pallas"), ("reference", "jkv reference (XLA)")):
        record(case, impl, time_scaled("block", layout, dtype, backend),
               INPUT_BYTES + cache_bytes + block_scales)
    record(f"per-block {name} 32K vllm, tokens shuffled", "jkv pallas",
           time_scaled("block", "vllm", dtype, "pallas", shuffled=True),
           INPUT_BYTES + cache_bytes + block_scales)
  if "int8" not in dtypes:
    return
  record("per-block 32K: grouping by block only, slot table", "XLA scatters",
         time_segments("table"), 0)
  record("per-block 32K: grouping by block only, sort", "XLA sort", time_segments("sort"), 0)
  for fmt in fp4.FORMATS:
    fp4_bytes = INPUT_BYTES + INPUT_BYTES // 8 + 2 * TOKENS * HEADS * HEAD_SIZE // fp4.GROUP_SIZE[fmt]
    record(f"{fmt} 32K", "jkv reference (XLA)", time_fp4(fmt), fp4_bytes)
