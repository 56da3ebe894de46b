"""Benchmark runner (run on a GPU): prints a table per section, writes RESULTS.md.

    PYTHONPATH=. python benchmarks/run.py [--sweep] [--results benchmarks/RESULTS.md]

Device time per op comes from :mod:`benchmarks.timing` (slope of unrolled chains in
one jit, or with ``--timing profiler`` the chain's summed GPU kernel durations from the
profiler; the two-GPU "sharded" section always uses slopes). Bytes counted = K+V read +
K+V written (+ nothing else: slots are noise). The copy ceiling is a device-to-device copy
timed the same way in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from benchmarks import (attention_cases, blocks_cases, lowering_cases, max_layout_cases,
                        mla_cases, prefix_cases, quant_write_cases, ragged_cases, sharded_cases,
                        transfer_cases, write_cases)
from benchmarks.timing import cuda_torch, per_call_seconds

DTYPE = jnp.bfloat16


def xla_copy_tbs(gib=2.0):
  """TB/s of an XLA elementwise pass (read + write of a bf16 array), timed like the ops."""
  n = int(gib * 2**30) // 2
  def make():
    return (jnp.arange(n, dtype=jnp.int32).astype(DTYPE),)
  def step(state, i):
    (x,) = state
    return (jax.lax.optimization_barrier(x + jnp.asarray(1, DTYPE)),)
  seconds = per_call_seconds(make, step)
  return 2 * n * 2 / seconds / 1e12


def torch_copy_tbs(gib=2.0):
  """TB/s of torch ``dst.copy_(src)`` device-to-device (read + write), CUDA events."""
  torch = cuda_torch()
  if torch is None:
    return None
  n = int(gib * 2**30) // 2
  src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
  dst = torch.empty_like(src)
  for _ in range(3):
    dst.copy_(src)
  torch.cuda.synchronize()
  times = []
  for _ in range(10):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3)
  del src, dst
  torch.cuda.empty_cache()
  return 2 * n * 2 / float(np.median(times)) / 1e12


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--sweep", action="store_true",
                      help="also time kernel tile variants (write, quant, ragged, attention)")
  parser.add_argument("--results", default=None,
                      help="markdown file whose sections this run replaces")
  parser.add_argument("--timing", choices=sorted(timing.METHODS), default="chain",
                      help="how per-call device time is measured (benchmarks/timing.py)")
  parser.add_argument("--quick", action="store_true",
                      help="quant section: the acceptance cases only, short chains")
  parser.add_argument("--sections", default=",".join(SECTIONS),
                      help=f"comma-separated subset of {SECTIONS}")
  args = parser.parse_args(argv)
  sections = args.sections.split(",")
  for name in sections:
    if name not in SECTIONS:
      parser.error(f"unknown section {name!r}; choose from {SECTIONS}")
  dev = jax.devices()[0]
  timing.METHOD = args.timing
  print(f"device {dev.device_kind}, jax {jax.__version__}, python {platform.python_version()}, "
        f"timing: {args.timing}")
  rows = []
  copies = {"XLA elementwise pass": xla_copy_tbs(), "torch copy_": torch_copy_tbs()}
  copies = {name: tbs for name, tbs in copies.items() if tbs is not None}
  for name, tbs in copies.items():
    print(f"copy {name}: {tbs:.2f} TB/s")
  ceiling_name = max(copies, key=copies.get)
  ceiling = copies[ceiling_name]
  print(f"copy ceiling = {ceiling_name} {ceiling:.2f} TB/s")

  current = {}   # the section being run: rows are written out as they come, so a run
                 # that is cut short still leaves what it measured

  def record_bytes(case, impl, seconds, nbytes, ceiling_tbs=None):
    """One row; ``ceiling_tbs``: what 'of ceiling' is relative to (default: the copy
    ceiling); ``nbytes`` 0: a time-only row."""
    if seconds <= 0:
      print(f"{case:34s} {impl:28s} below timer resolution, not recorded", flush=True)
      return
    bw = nbytes / seconds / 1e12 if nbytes else None
    frac = None if bw is None else bw / (ceiling_tbs or ceiling)
    rows.append((case, impl, seconds * 1e6, bw, frac))
    print(f"{case:34s} {impl:28s} {seconds*1e6:10.2f} us "
          + ("" if bw is None else f"{bw:6.3f} TB/s {frac:6.2f}"), flush=True)
    if args.results:
      write_results(args.results, dev.device_kind, copies, ceiling_name,
                    {current["name"]: current["text"](rows, None)}, args.timing, quiet=True)

  def record(case, impl, seconds, num_tokens):
    record_bytes(case, impl, seconds, num_tokens * write_cases.BYTES_PER_TOKEN)

  results = {}

  def finish(name, text):
    """A section's final text, written out at once: a later section cut short keeps it."""
    results[name] = text
    if args.results:
      write_results(args.results, dev.device_kind, copies, ceiling_name, {name: text},
                    args.timing, quiet=True)

  if "write" in sections:
    rows.clear()
    current.update(name="write", text=write_section_text)
    ratio = write_cases.run(record, sweep=args.sweep)
    finish("write", write_section_text(rows, ratio))
  if "quant" in sections:
    rows.clear()
    current.update(name="quant",
                   text=lambda rows, ratio: quant_section_text(rows, args.quick))
    if args.sweep:
      quant_write_cases.sweep(record_bytes)
    (quant_write_cases.run_quick if args.quick else quant_write_cases.run)(record_bytes)
    finish("quant", quant_section_text(rows, args.quick))
  if "quant-decode" in sections:
    rows.clear()
    current.update(name="quant-decode", text=quant_decode_section_text)
    ratio = quant_write_cases.run_decode(record_bytes)
    finish("quant-decode", quant_decode_section_text(rows, ratio))
  for name, (_, _, run_cases) in TABLE_SECTIONS.items():
    if name in sections:
      rows.clear()
      current.update(name=name, text=lambda rows, ratio, name=name: table_section_text(name, rows))
      if args.sweep and name in SWEEPS:
        SWEEPS[name](record_bytes)
      run_cases(record_bytes)
      finish(name, table_section_text(name, rows))
  if "sharded" in sections:
    timing.METHOD = "chain"   # the profiler would sum both GPUs' kernels
    rows.clear()
    current.update(name="sharded", text=sharded_section_text)
    scaling = sharded_cases.run(record_bytes)
    finish("sharded", sharded_section_text(rows, scaling))
  if args.results:
    try:
      from benchmarks import plot
      for path in plot.write_plots(pathlib.Path(args.results),
                                   pathlib.Path(args.results).parent / "plots", results):
        print(f"wrote {path}")
    except ImportError as error:   # matplotlib is a benchmark extra
      print(f"no plots ({error}): pip install '.[bench]', then python benchmarks/plot.py")


SECTIONS = ("write", "quant", "quant-int8", "quant-decode", "quant-layers", "quant-asm-pa",
            "blocks", "mla", "attention", "ragged", "sharded", "transfer", "prefix", "lowering",
            "decode-median", "max-layout")
# Tile / variant sweeps (--sweep) of table sections, run before the section's cases.
SWEEPS = {"ragged": ragged_cases.sweep, "attention": attention_cases.sweep,
          "mla": mla_cases.sweep}
TABLE_HEAD = ["| case | implementation | device time (us) | TB/s | of ceiling |",
              "| --- | --- | ---: | ---: | ---: |"]


def _table(rows):
  def num(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"
  return TABLE_HEAD + [f"| {c} | {i} | {us:.2f} | {num(bw, 3 if bw and bw < 0.1 else 2)} | "
                       f"{num(frac)} |" for c, i, us, bw, frac in rows]


def write_section_text(rows, ratio):
  return ["## Paged writes (unquantized)", "",
          "Bytes counted per write = K+V read + K+V written; 32K = 32768 tokens x 8 kv heads x "
          "128, bf16, block 16, scattered pages.", ""] + _table(rows) + [
          "", f"One-token write, 32 GiB cache / 1 GiB cache time ratio: **{_ratio(ratio)}**"]


def _ratio(ratio):
  return "not measured (run cut short)" if ratio is None else f"{ratio:.3f}"


def quant_section_text(rows, quick=False):
  how = (" `--quick`: the acceptance cases only, chains of 4 and 24 calls, 5 repeats."
         if quick else "")
  return ["## Quantized writes (per-token, per-block FP8)", "",
          quant_write_cases.DESCRIPTION.replace("\n", " ") + how, ""] + _table(rows)


def quant_decode_section_text(rows, ratio):
  return ["## Quantized writes, decode-sized (per-block INT8)", "",
          "256 tokens, each into its own partly filled block (a growing scale re-quantizes "
          "the block); then one token into a 1 GiB and a 16 GiB cache, alternated three "
          "times.", ""] + _table(rows) + [
          "", f"Per-block INT8 one-token write, 16 GiB cache / 1 GiB cache time ratio: "
          f"**{_ratio(ratio)}**"]


# Sections that are one table under a title and a cases module's description, in
# SECTIONS order: name -> (title, description, run(record)).
TABLE_SECTIONS = {
    "max-layout": ("Mojo MAX collection: all layers of a block in one tensor",
                   max_layout_cases.DESCRIPTION, max_layout_cases.run),
    "quant-int8": ("Quantized writes (per-token, per-block INT8; FP4)",
                   "As the FP8 section above (a section of its own to fit one device call).",
                   lambda record: quant_write_cases.run(record, dtypes=("int8",))),
    "quant-layers": ("Quantized writes in a multi-layer step (per-block INT8, grouping shared)",
                     quant_write_cases.LAYERS_DESCRIPTION, quant_write_cases.run_layers),
    "quant-asm-pa": ("Quantized writes, 128 / 256-token scale blocks (asm_pa)",
                     quant_write_cases.ASM_PA_DESCRIPTION, quant_write_cases.run_asm_pa),
    "blocks": ("Blocks: swap_blocks, copy_blocks, PagePool", blocks_cases.DESCRIPTION,
               blocks_cases.run),
    "mla": ("MLA and indexer cache writes", mla_cases.DESCRIPTION, mla_cases.run),
    "attention": ("Decode attention (reading the cache)", attention_cases.DESCRIPTION,
                  attention_cases.run),
    "ragged": ("Ragged paged attention (chunked prefill + decode)", ragged_cases.DESCRIPTION,
               ragged_cases.run),
    "prefix": ("Prefix caching: admitting 256 requests of 2K tokens", prefix_cases.DESCRIPTION,
               prefix_cases.run),
    "transfer": ("Prefill-to-decode page transfer between two GPUs", transfer_cases.DESCRIPTION,
                 transfer_cases.run),
    "lowering": ("Lowerings: paged write and decode attention, Mosaic GPU and Triton",
                 lowering_cases.DESCRIPTION, lowering_cases.run),
    "decode-median": ("Decode attention, median of 3 runs (profiler device time)",
                      lowering_cases.MEDIAN_DESCRIPTION, lowering_cases.run_median),
}


def table_section_text(name, rows):
  title, description, _ = TABLE_SECTIONS[name]
  return [f"## {title}", "", description.replace("\n", " "), ""] + _table(rows)


def sharded_section_text(rows, scaling=None):
  lines = ["## Sharded: 1 GPU vs 2 GPUs (data parallel)", "",
           sharded_cases.DESCRIPTION.replace("\n", " "), ""] + _table(rows) + [""]
  for op, ratio in (scaling or {}).items():
    lines.append(f"{op}: aggregate throughput on 2 GPUs / 1 GPU = "
                 f"**{'not measured' if ratio is None else f'{ratio:.2f}x'}**")
  return lines


def write_results(path, device, copies, ceiling_name, sections, method="chain", quiet=False):
  """Replaces the given sections of the results file (kept between HTML comment markers);
  sections not run this time stay as they were, with their own device, date and timing
  ``method`` (:data:`benchmarks.timing.METHODS`; "sharded" always "chain")."""
  ceiling = copies[ceiling_name]
  today = datetime.date.today().isoformat()
  try:
    with open(path) as f:
      text = f.read()
  except FileNotFoundError:
    text = ""
  header = ("# jkv benchmark results\n\nEach section is written by `benchmarks/run.py "
            "--sections NAME` (device time per op = slope of unrolled chains in one jit, "
            "unless the section's first line names another method; the copy ceiling is "
            "measured in the same run, the same way).\n")
  if not text.startswith("# jkv benchmark results"):
    text = header
  for name, lines in sections.items():
    stamp = (f"Run on {today}: device **{device}**, jax {jax.__version__}. Copies (bytes read "
             "+ written): " + ", ".join(f"{n} {t:.2f} TB/s" for n, t in copies.items())
             + f"; ceiling **{ceiling_name}, {ceiling:.2f} TB/s**. Rows timed in one jit: "
             + timing.METHODS["chain" if name == "sharded" else method] + ".")
    body = "\n".join([f"<!-- section: {name} -->", lines[0], "", stamp] + lines[1:]
                      + [f"<!-- end: {name} -->"])
    start, end = f"<!-- section: {name} -->", f"<!-- end: {name} -->"
    if start in text and end in text:
      text = text[:text.index(start)] + body + text[text.index(end) + len(end):]
    else:   # a new section goes after the last one before it in SECTIONS order
      before = [f"<!-- end: {n} -->" for n in SECTIONS[:SECTIONS.index(name)]
                if f"<!-- end: {n} -->" in text] if name in SECTIONS else []
      if before:
        at = text.index(before[-1]) + len(before[-1])
        text = text[:at] + "\n\n" + body + text[at:]
      else:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
  with open(path, "w") as f:
    f.write(text)
  if not quiet:
    print(f"wrote {path}")


if __name__ == "__main__":
  sys.exit(main())
