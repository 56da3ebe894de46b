"""Device-time measurement for the benchmarks (GPU).

A jitted call costs ~60 us of dispatch and a fori_loop iteration ~10 us, so one op
is timed as the slope between two jitted programs that unroll ``n_small`` and
``n_large`` calls of it on a chain of donated caches: dispatch and launch of the
program cancel out, what remains is device time per op (median over repeats).
"""

from __future__ import annotations

import time

import jax
import numpy as np


def per_call_seconds(make_state, step, n_small=8, n_large=56, repeats=9):
  """Device seconds of one ``step(state, i) -> state`` call.

  make_state: () -> state pytree (fresh buffers: donated each time).
  step: traceable; ``i`` is the static index of the call in the unrolled chain.
  """
  times = {}
  for n in (n_small, n_large):
    def chain(state, n=n):
      for i in range(n):
        state = step(state, i)
      return state
    fn = jax.jit(chain, donate_argnums=0)
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
