"""Device-time measurement for the benchmarks (GPU).

A jitted call costs ~60 us of dispatch and a fori_loop iteration ~10 us, so one op
is timed as the slope between two jitted programs that unroll ``n_small`` and
``n_large`` calls of it on a chain of donated caches: dispatch and launch of the
program cancel out, what remains is device time per op (median over repeats).

``METHOD = "profiler"`` (``benchmarks/run.py --timing profiler``) times the same chain of
``n_small`` calls from the profiler instead: the summed durations of the GPU kernels it
launches, per call. Steadier than wall-clock slopes (which move 10-15% between runs);
gaps between kernels do not count.
"""

from __future__ import annotations

import time

import jax
import numpy as np


METHOD = "chain"   # how per_call_seconds times: "chain" (slopes) or "profiler" (kernel sums)
METHODS = {"chain": "slope of two unrolled chains of calls in one jit (wall clock)",
           "profiler": "the GPU kernels' summed durations (profiler) over a chain of calls "
                       "in one jit, per call"}


def _chain(step, n):
  """jit of ``n`` unrolled ``step`` calls on a donated state."""
  def chain(state):
    for i in range(n):
      state = step(state, i)
    return state
  return jax.jit(chain, donate_argnums=0)


def per_call_seconds(make_state, step, n_small=8, n_large=56, repeats=9):
  """Device seconds of one ``step(state, i) -> state`` call (by :data:`METHOD`).

  make_state: () -> state pytree (fresh buffers: donated each time).
  step: traceable; ``i`` is the static index of the call in the unrolled chain.
  """
  if METHOD == "profiler":
    seconds, _ = profiled_seconds(_chain(step, n_small), make_state(), calls=3)
    return seconds / n_small
  times = {}
  for n in (n_small, n_large):
    fn = _chain(step, n)
    state = make_state()
    state = fn(state)  # compile + warm up
    jax.block_until_ready(state)
    samples = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      state = fn(state)
      jax.block_until_ready(state)
      samples.append(time.perf_counter() - t0)
    times[n] = float(np.median(samples))
    del state
  return max(times[n_large] - times[n_small], 0.0) / (n_large - n_small)


def wall_seconds(fn, make=lambda: (), repeats=9):
  """Median wall seconds of a blocking ``fn(*make())`` (fresh arguments each time, made
  outside the timed span), after one warm-up call: for transfers that a chain in one jit
  cannot hold (across memories or devices)."""
  jax.block_until_ready(fn(*make()))
  samples = []
  for _ in range(repeats):
    args = make()
    jax.block_until_ready(args)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - t0)
  return float(np.median(samples))


def cuda_torch():
  """The torch module when it is installed and sees a CUDA GPU (for the peers), else None."""
  try:
    import torch
  except ImportError:
    return None
  return torch if torch.cuda.is_available() else None


def torch_seconds(once, calls=20, warmup=3, repeats=5):
  """Seconds per ``once(i)`` (torch work on the current CUDA stream), CUDA events around
  ``calls`` back-to-back calls, median over repeats."""
  import torch
  for i in range(warmup):
    once(i)
  torch.cuda.synchronize()
  times = []
  for _ in range(repeats):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
      once(i)
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3 / calls)
  return float(np.median(times))


def profiled_seconds(fn, state, calls=20):
  """Device seconds per ``state = fn(state)`` call, read from the profiler: the GPU
  kernels' own durations (every kernel the call launches, summed), so neither dispatch nor
  launch gaps count and a few calls give a steady figure. ``fn`` is jitted (donating its
  state, as the timed ops are in place); returns ``(seconds, {kernel name: seconds})``."""
  import collections
  import glob
  import gzip
  import json
  import tempfile

  state = fn(state)   # compile + warm up
  jax.block_until_ready(state)
  trace_dir = tempfile.mkdtemp(prefix="jkv_trace_")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(calls):
      state = fn(state)
    jax.block_until_ready(state)
  del state
  # The profiler writes the Chrome-format trace twice (its own and the Perfetto one).
  path = sorted(glob.glob(f"{trace_dir}/**/*.json.gz", recursive=True))[0]
  events = json.load(gzip.open(path))
  events = events["traceEvents"] if isinstance(events, dict) else events
  gpu_pids = {e["pid"] for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"
              and "GPU" in str(e.get("args", {}).get("name", ""))}
  per_kernel = collections.defaultdict(float)
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in gpu_pids:
      per_kernel[e["name"]] += e["dur"] * 1e-6 / calls
  if not per_kernel:
    raise RuntimeError("the profile holds no GPU kernels (is this a GPU?)")
  return sum(per_kernel.values()), dict(per_kernel)
