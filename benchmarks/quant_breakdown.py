"""Per-kernel device times of the quantized-format cases, read from the profiler (GPU):
what each call spends in the write or attention kernel, its re-quantization pass and
XLA's grouping kernels, and the same for launch-parameter variants.

  python -m benchmarks.quant_breakdown [CASE ...]

CASE (all of :data:`benchmarks.quant_profile.CASES` by default):

- a name of :data:`benchmarks.quant_profile.CASES` (``block-vllm``, ``asm-pa``,
  ``decode-vllm-fp8``, ...): the op as ``auto`` / the defaults run it;
- ``block:LAYOUT:CHUNK:HEADS:WARPS[:UNIT[:SPLIT]]``: a per-block FP8 write of 32K tokens
  (pages of UNIT tokens, UNIT tokens per scale block, default 16) with those
  :func:`pallas_kernels.block_quant.block_quant` launch parameters (SPLIT 1: ``split_kv``,
  K and V written by programs of their own; 0: by one; omitted: the default);
- ``params:LAYOUT:NAME=VALUE[,NAME=VALUE...]``: a per-block FP8 write of 32K tokens with
  any integer launch keywords of :func:`pallas_kernels.block_quant.block_quant` (e.g.
  ``params:vllm:max_programs=4096,requant_segments_per_program=32``);
- ``planes:KEY:VALUE``: a per-block FP8 write of 32K tokens whose key and value planes come
  from different layouts (plane kinds ``KX`` / ``VD``: vllm's, ``VASM``: asm's value,
  ``NHD``: flash's, ``HND``: hnd's), to tell which plane's stores cost the time (e.g.
  ``planes:KX:NHD`` against ``planes:NHD:NHD``);
- ``decode:TILE_PAGES:SPLITS:WARPS:STAGES``: ``decode-vllm-fp8`` on the Triton kernel with
  those :func:`pallas_kernels.attention.paged_attention_decode` parameters (0: the
  default; ``decode-vllm-fp8`` itself runs what ``auto`` picks: the Mosaic GPU kernel on
  Hopper).

Prints each case's summed kernel time per call, then every kernel's. The figures in
``benchmarks/NOTES_quant.md`` come from it. To compare two trees (``git archive`` copies),
``cd`` into each and run it there: ``python -m`` puts the current directory before
``PYTHONPATH`` on ``sys.path``, so ``PYTHONPATH=OTHER_TREE`` from this one times this one.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp

from benchmarks import attention_cases, quant_profile, quant_write_cases as cases, timing
from jkv import layout as layout_lib, segments
from pallas_kernels import attention, block_quant


def show(name, step, state):
  """Prints the profiler's per-call kernel times of ``state = step(state)``."""
  total, per_kernel = timing.profiled_seconds(step, state, calls=10)
  print(f"== {name}: {total * 1e6:.2f} us", flush=True)
  for kernel, seconds in sorted(per_kernel.items(), key=lambda item: -item[1]):
    print(f"   {seconds * 1e6:8.2f} us  {kernel[:100]}", flush=True)


def show_variant(name, layout, unit=cases.BLOCK, **kernel_args):
  """:func:`show` of a per-block FP8 write with ``kernel_args`` for ``block_quant``; the
  slots are data (the jitted step's argument), so the grouping runs on them as in a
  model's step (closed over, they would be a constant XLA may fold)."""
  op, make_arrays, key, value, slot_sets = cases.kernel_variant(
      "block", layout, jnp.float8_e4m3fn, unit, page=unit, **kernel_args)
  write = jax.jit(lambda state: (op(key, value, *state), state[1]), donate_argnums=0)
  show(name, write, (make_arrays(), slot_sets[0]))


def block_variant(layout, chunk, heads, warps, unit=cases.BLOCK, split_kv=None):
  split = {None: "", 0: ", K / V together", 1: ", K / V split"}[split_kv]
  show_variant(f"block {layout} unit {unit}, chunk {chunk}, {heads} heads, {warps} warps{split}",
               layout, unit, tokens_per_chunk=chunk, heads_per_program=heads, num_warps=warps,
               split_kv=None if split_kv is None else bool(split_kv))


def params_variant(layout, assignments):
  """``params:LAYOUT:NAME=VALUE,...``: integer launch keywords of ``block_quant``."""
  kernel_args = {name: int(value) for name, value in
                 (item.split("=") for item in assignments.split(","))}
  show_variant(f"block {layout}, {assignments}", layout, **kernel_args)


# The layout (and its plane: 0 key, 1 value) each plane kind of ``planes:KEY:VALUE`` is from.
PLANE_SOURCES = {"KX": ("vllm", 0), "VD": ("vllm", 1), "VASM": ("asm", 1), "NHD": ("flash", 0),
                 "HND": ("hnd", 0)}


def plane_variant(key_kind, value_kind):
  """``(write, state)``: a per-block FP8 write of 32K tokens (scattered 16-token pages, as
  ``block-vllm``) into a key cache of ``key_kind``'s plane and a value cache of
  ``value_kind``'s, through :func:`pallas_kernels.block_quant.block_quant` directly."""
  dtype, block, heads, head_size = (jnp.float8_e4m3fn, cases.BLOCK, cases.HEADS,
                                    cases.HEAD_SIZE)
  num_blocks = 2 * cases.TOKENS // block
  key, value = cases._inputs(cases.TOKENS)
  slots = cases._slots(cases.TOKENS, num_blocks, 0, variants=1, page=block)[0]
  planes, shapes = [], []
  for kind in (key_kind, value_kind):
    layout, which = PLANE_SOURCES[kind]
    planes.append(layout_lib.planes(layout, block, heads, head_size, dtype)[which])
    shapes.append(layout_lib.cache_shapes(layout, num_blocks, block, heads, head_size,
                                          dtype)[which])

  def write(state):
    arrays, slot_mapping = state
    grouped = segments.group_by_scale_block(slot_mapping, num_blocks * block, block)
    return block_quant.block_quant(key, value, *arrays, grouped, 0, key_plane=planes[0],
                                   value_plane=planes[1], num_blocks=num_blocks,
                                   unit_size=block, scales_block_major=True,
                                   interpret=False), slot_mapping

  scales = jnp.ones((num_blocks, heads), jnp.float32)
  arrays = (jnp.zeros(shapes[0], dtype), jnp.zeros(shapes[1], dtype), scales, scales + 0)
  return jax.jit(write, donate_argnums=0), (arrays, slots)


def decode_variant(tile_pages, splits, warps, stages):
  default = attention.paged_attention_decode
  try:
    jax.clear_caches()   # the kernel's options are read at trace time
    attention.paged_attention_decode = functools.partial(
        default, tile_pages=tile_pages or None, num_splits=splits or None,
        num_warps=warps or 4, num_stages=stages or None)
    with attention_cases.lowering_env("triton"):   # the Triton kernel (auto: Mosaic)
      case("decode-vllm-fp8", f"decode vllm fp8, tile pages {tile_pages}, splits {splits}, "
                              f"{warps} warps, {stages} stages")
  finally:
    attention.paged_attention_decode = default
    jax.clear_caches()


def case(name, label=None):
  fn, args = quant_profile.CASES[name]()
  if len(args) == 4:   # a write: (key, value, donated arrays, slots)
    key, value, arrays, slots = args
    show(label or name, lambda a: fn(key, value, a, slots), arrays)
  else:                # an attention: (cache, query); the state keeps the last output
    cache, query = args
    show(label or name, lambda state: (state[0], fn(cache, state[0])), (query, query))


def main(names):
  for name in names or quant_profile.CASES:
    kind, *params = name.split(":")
    try:
      if kind == "block":
        block_variant(params[0], *map(int, params[1:]))
      elif kind == "params":
        params_variant(*params)
      elif kind == "planes":
        show(f"block fp8, key plane {params[0]}, value plane {params[1]}",
             *plane_variant(*params))
      elif kind == "decode":
        decode_variant(*map(int, params))
      else:
        case(name)
    except Exception as error:   # a variant that does not compile is reported, not fatal
      print(f"{name}: failed: {type(error).__name__}: {error}"[:300], flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
  os._exit(0)   # as quant_profile: skips interpreter teardown
