"""What each Triton-lowered kernel compiles to on Hopper, on any machine (no GPU needed).

Every case lowers one op for CUDA as the GPU does (Pallas -> Triton IR, through an abstract
H100), compiles each kernel's Triton IR for ``sm_90a`` with the pip ``triton`` package (its
own ptxas) at the kernel's ``num_warps`` / ``num_stages``, and counts in the SASS: registers,
local memory (spills), shared memory, and the global loads and stores by width. A store of
one byte per instruction where the cache has 16 contiguous bytes per token is what such a
report finds: Triton vectorizes an access only where its pointer analysis proves the
contiguity (see :meth:`jkv.layout.Plane.flat_elem_offset`).

The counts are static (an instruction in a loop counts once). The GPU compiles with
jaxlib's own Triton, not pip's, and the two disagree (the per-block vLLM write: 96
registers from pip Triton 3.9, 124 on the H100): ``--deviceless`` compiles each case with
jaxlib's own XLA GPU compiler instead, as the GPU machine does (:mod:`benchmarks.deviceless`;
needs the GPU machine's jax and its CUDA plugin), and its counts are the device's.

Needs jax >= 0.12 (abstract GPU targets; ``--deviceless``: the device's jax, 0.11.2) and
``pip install triton``; run from the repo root:

  python -m benchmarks.sass_report [--deviceless] [--results benchmarks/SASS.md] [CASE ...]

Cases: the ``quant_profile`` ones (the issue-28 misses), plus ``write-<layout>-<format>``
for 32K-token writes, ``decode-<layout>-<dtype>`` for 8 x 32K decode attention,
``ragged-{prefill,mixed}-<dtype>`` (the ``ragged`` section's batches, Triton kernel),
``mla-concat-<dtype>`` and ``indexer-write`` (the ``mla`` section's writes).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

import jkv
from benchmarks import attention_cases, mla_cases, quant_profile, ragged_cases
from benchmarks import quant_write_cases as quant_cases

# The width suffix of a global access's SASS opcode, in bits (none: 32).
WIDTHS = {"128": "128", "64": "64", "U16": "16", "S16": "16", "U8": "8", "S8": "8"}


def _write(layout, kv_cache_dtype, quant):
  num_blocks = 2 * quant_cases.TOKENS // quant_cases.BLOCK
  key, value = quant_cases._inputs(quant_cases.TOKENS)
  slots = quant_cases._slots(quant_cases.TOKENS, num_blocks, 0, variants=1)[0]
  cache = jax.eval_shape(lambda: jkv.PagedKVCache.create(
      num_blocks, quant_cases.BLOCK, key.shape[1], key.shape[2], layout=layout,
      kv_cache_dtype=kv_cache_dtype, quant=quant))
  return (lambda c, k, v, s: c.write(0, k, v, s, backend="pallas")), (cache, key, value, slots)


def _decode(layout, kv_cache_dtype):
  num_blocks, table, lens = attention_cases._tables(attention_cases.BATCH,
                                                    attention_cases.CONTEXT)
  cache = jax.eval_shape(lambda: jkv.PagedKVCache.create(
      num_blocks, attention_cases.BLOCK, attention_cases.KV_HEADS, attention_cases.HEAD,
      layout=layout, kv_cache_dtype=kv_cache_dtype))
  query = jax.ShapeDtypeStruct((attention_cases.BATCH, attention_cases.Q_HEADS,
                                attention_cases.HEAD), jnp.bfloat16)
  return (lambda c, q: c.attend(0, q, table, lens, backend="pallas")), (cache, query)


def _ragged(batch, kv_cache_dtype):
  num_blocks, table, lens, cu = ragged_cases._batch(*batch)
  cache = jax.eval_shape(lambda: ragged_cases._cache(num_blocks, kv_cache_dtype))
  query = jax.ShapeDtypeStruct((int(cu[-1]), ragged_cases.Q_HEADS, ragged_cases.HEAD),
                               jnp.bfloat16)
  return ((lambda c, q: c.attend_ragged(0, q, table, lens, cu, backend="pallas")),
          (cache, query))


def _mla_write(kv_cache_dtype):
  tokens, rank, pe = mla_cases.TOKENS, mla_cases.RANK, mla_cases.PE
  dtype = jnp.bfloat16 if kv_cache_dtype == "auto" else jnp.float8_e4m3fn
  num_blocks = mla_cases._num_blocks((rank + pe) * jnp.dtype(dtype).itemsize, tokens)
  cache = jax.ShapeDtypeStruct((num_blocks, mla_cases.BLOCK, rank + pe), dtype)
  kv_c, k_pe = mla_cases._inputs((tokens, rank), (tokens, pe))
  slots = mla_cases._slots(num_blocks, 0, variants=1, tokens=tokens)[0]
  scale = None if kv_cache_dtype == "auto" else 0.1
  return (lambda c, a, b, s: jkv.concat_and_cache_mla(a, b, c, s, kv_cache_dtype, scale,
                                                      backend="pallas")), (cache, kv_c, k_pe,
                                                                           slots)


def _indexer_write():
  tokens = mla_cases.TOKENS
  cache = jax.ShapeDtypeStruct((mla_cases._num_blocks(132, tokens), mla_cases.BLOCK, 132),
                               jnp.uint8)
  (keys,) = mla_cases._inputs((tokens, 128))
  slots = mla_cases._slots(cache.shape[0], 2, variants=1, tokens=tokens)[0]
  return (lambda c, k, s: jkv.indexer_k_quant_and_cache(k, c, s, backend="pallas")), (
      cache, keys, slots)


def _cases():
  cases = dict(quant_profile.CASES)
  for layout in ("vllm", "asm", "flash", "hnd", "packed"):
    cases[f"write-{layout}-bf16"] = lambda l=layout: _write(l, "auto", "tensor")
  for layout in ("vllm", "asm", "flash"):
    for fmt, quant in (("fp8", "tensor"), ("fp8-token", "token"), ("int8-block", "block")):
      dtype = "int8" if fmt.startswith("int8") else "fp8"
      cases[f"write-{layout}-{fmt}"] = lambda l=layout, d=dtype, q=quant: _write(l, d, q)
  for layout in ("vllm", "asm", "flash", "hnd"):
    for dtype in ("auto", "fp8"):
      cases[f"decode-{layout}-{dtype}"] = lambda l=layout, d=dtype: _decode(l, d)
  for name, batch in (("prefill", ragged_cases.PREFILL), ("mixed", ragged_cases.MIXED)):
    for dtype in ("auto", "fp8"):
      cases[f"ragged-{name}-{dtype}"] = lambda b=batch, d=dtype: _ragged(b, d)
  for dtype in ("auto", "fp8"):
    cases[f"mla-concat-{dtype}"] = lambda d=dtype: _mla_write(d)
  cases["indexer-write"] = _indexer_write
  return cases


def lowered_kernels(fn, args):
  """[(kernel name, Triton IR text, num_warps, num_stages)] of fn(*args) lowered for CUDA."""
  from jax._src.pallas.triton import pallas_call_registration as registration
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
  from test_cuda_lowering import gpu_target   # the abstract H100 the lowering targets
  modules, lower = [], registration.lowering.lower_jaxpr_to_triton_module

  def capture(*a, **k):
    result = lower(*a, **k)
    modules.append(result.module.operation.get_asm())
    return result

  registration.lowering.lower_jaxpr_to_triton_module = capture
  try:
    with gpu_target():
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = lower
  configs = collections.defaultdict(list)
  for name, stages, warps in re.findall(
      r'name = "(jkv_\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text):
    configs[name].append((int(warps), int(stages)))
  kernels = []
  for module in modules:
    name = re.search(r"tt\.func public @(\w+)", module).group(1)
    warps, stages = configs[name].pop(0)
    kernels.append((name, module, warps, stages))
  return kernels


def compile_sass(ir_text, warps, stages, workdir):
  """(resource usage dict, SASS text) of Triton IR compiled for sm_90a."""
  import triton
  from triton.backends.compiler import GPUTarget
  path = pathlib.Path(workdir) / "kernel.ttir"
  path.write_text(ir_text)
  compiled = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
  cubin = pathlib.Path(workdir) / "kernel.cubin"
  cubin.write_bytes(compiled.asm["cubin"])
  tools = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
  usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], check=True,
                         capture_output=True, text=True).stdout
  sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], check=True,
                        capture_output=True, text=True).stdout
  resources = dict(re.findall(r"(REG|LOCAL):(\d+)", usage))
  resources["SHARED"] = compiled.metadata.shared   # static + dynamic
  return resources, sass


def deviceless_kernels(fn, args, workdir):
  """[(kernel name, num_warps, resource usage dict, SASS text)] of the Pallas kernels of
  fn(*args) as jaxlib's own XLA GPU compiler builds them for an H100, with no GPU
  (:mod:`benchmarks.deviceless`): the device's registers and SASS."""
  import triton
  from benchmarks import deviceless
  serialized, text = deviceless.compile_serialized(fn, args)
  warps = collections.defaultdict(list)   # per kernel name, in lowering order
  for name, count in re.findall(r'name = "(jkv_\w+)", num_stages = \d+ : i32, '
                                r'num_warps = (\d+)', text):
    warps[name].append(int(count))
  tools = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
  kernels = []
  for index, image in enumerate(deviceless.cubins(serialized)):
    cubin = pathlib.Path(workdir) / f"kernel{index}.cubin"
    cubin.write_bytes(image)
    usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], check=True,
                           capture_output=True, text=True).stdout
    # XLA names a kernel's second copy NAME__1, its third NAME__2, ...
    function = re.search(r"Function (\w+?)(?:__(\d+))?:", usage)
    if function is None or function.group(1) not in warps:   # XLA's own kernels
      continue
    name, copy = function.group(1), int(function.group(2) or 0)
    sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
    kernels.append((name, warps[name][copy], dict(re.findall(r"(REG|LOCAL|SHARED):(\d+)",
                                                             usage)), sass))
  missing = set(warps) - {kernel[0] for kernel in kernels}
  if missing:
    raise RuntimeError(f"no cubin found for {sorted(missing)}")
  return kernels


def access_widths(sass, opcodes):
  """'bits x count' of the SASS instructions with these opcodes (LDG, LDGSTS: cp.async; STG),
  by access width."""
  counts = collections.Counter()
  for instruction in re.findall(rf"\b(?:{'|'.join(opcodes)})\.E[.\w]*", sass):
    counts[WIDTHS.get(instruction.rsplit(".", 1)[-1], "32")] += 1
  return ", ".join(f"{bits}b x{counts[bits]}" for bits in ("128", "64", "32", "16", "8")
                   if counts[bits]) or "-"


def report(names, deviceless=False):
  cases = _cases()
  rows = []
  for name in names or cases:
    fn, args = cases[name]()
    with tempfile.TemporaryDirectory() as workdir:
      if deviceless:
        kernels = deviceless_kernels(fn, args, workdir)
      else:
        kernels = [(kernel, warps, *compile_sass(ir_text, warps, stages, workdir))
                   for kernel, ir_text, warps, stages in lowered_kernels(fn, args)]
    for kernel, warps, resources, sass in kernels:
      rows.append((name, kernel, warps, resources["REG"], resources["LOCAL"],
                   resources["SHARED"], access_widths(sass, ("LDG", "LDGSTS")),
                   access_widths(sass, ("STG",))))
      print(" | ".join(map(str, rows[-1])), flush=True)
  return rows


def markdown(rows, deviceless=False):
  import triton
  if deviceless:
    compiler = (f"`--deviceless`: jaxlib {jax.__version__}'s own XLA GPU compile for an H100 "
                "(sm_90a), as the GPU machine's")
    shared = "static shared bytes (a launch adds the dynamic part)"
  else:
    compiler = f"jax {jax.__version__}, pip triton {triton.__version__} (sm_90a)"
    shared = "shared bytes per program"
  lines = [f"Generated on {datetime.date.today()} by `python -m benchmarks.sass_report`, "
           f"{compiler}. Static counts of SASS instructions (a loop body counts once); "
           f"registers per thread, local (spilled) bytes and {shared}.", "",
           "| case | kernel | warps | registers | local bytes | shared bytes | global loads "
           "(bits x count; cp.async included) | global stores (bits x count) |",
           "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
  lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def main():
  os.environ.setdefault("JKV_LOWERING", "triton")   # the Triton kernels, whatever auto picks
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # Triton's default, said aloud
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("cases", nargs="*")
  parser.add_argument("--results", help="write the table to this markdown file")
  parser.add_argument("--deviceless", action="store_true",
                      help="compile with jaxlib's XLA GPU compiler, as the GPU machine does "
                           "(benchmarks.deviceless), not pip triton")
  options = parser.parse_args()
  if options.deviceless:   # before any array is made (see benchmarks.deviceless)
    jax.config.update("jax_platforms", "cpu")
  rows = report(options.cases, options.deviceless)
  if options.results:
    pathlib.Path(options.results).write_text("# Triton kernels' SASS (static)\n\n"
                                             + markdown(rows, options.deviceless))


if __name__ == "__main__":
  main()
