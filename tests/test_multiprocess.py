"""jkv across JAX processes: a simulated cluster on this machine.

Each configuration starts ``num_processes`` Python processes (``tests/multiprocess_checks.py``)
with ``devices`` CPU devices each, joined by ``jax.distributed`` through a coordinator on a
free localhost port, so one mesh spans every process; each check runs the sharded paths
(writes, the per-shard kernel under a plain jit, decode attention, block copies, per-dp
page pools, ragged attention) on caches sharded over the processes and compares them with
the same op in one process; one check moves a prefilled request's pages from a prefill
mesh to a decode mesh (other processes) and decodes there. A test per (configuration, check); the processes of a
configuration run once per test worker and are killed when they overrun or one fails.
"""

from __future__ import annotations

import functools
import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "multiprocess_checks.py"
CONFIGS = {"2x4": (2, 4), "4x2": (4, 2)}   # processes x CPU devices each
TIMEOUT_S = 600


def _environment():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), str(ROOT / "tests"),
                                                      os.environ.get("PYTHONPATH")))))
  for name in ("JKV_BACKEND", "XLA_FLAGS"):   # the checks name their back ends and devices
    env.pop(name, None)
  return env


def _free_ports(count: int) -> list[int]:
  """``count`` distinct ports the OS says are free now (bound together, then released:
  the coordinator and the transfer sockets bind them next)."""
  probes = [socket.socket() for _ in range(count)]
  try:
    for probe in probes:
      probe.bind(("localhost", 0))
    return [probe.getsockname()[1] for probe in probes]
  finally:
    for probe in probes:
      probe.close()


def _checks():
  listing = subprocess.run([sys.executable, str(SCRIPT), "--list"], cwd=ROOT,
                           env=_environment(), capture_output=True, text=True, timeout=300)
  if listing.returncode != 0:
    raise RuntimeError(f"multiprocess_checks.py --list failed:\n{listing.stderr[-4000:]}")
  return listing.stdout.split()


CHECKS = _checks()


@functools.lru_cache(maxsize=None)
def cluster_results(config: str):
  """(processes, {check: [passed, processes that reported it, report]}, a tail to show
  when a check did not report) of one run of ``config``'s processes. Every process runs
  every check; a check passes when every process reported it passed."""
  num_processes, devices = CONFIGS[config]
  port, *transfer_ports = _free_ports(1 + num_processes)
  procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(i), str(num_processes),
                             str(port), str(devices), str(transfer_ports[i])], cwd=ROOT,
                            env=_environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(num_processes)]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=TIMEOUT_S))
  except subprocess.TimeoutExpired:
    outputs.append(("", f"timed out after {TIMEOUT_S} s"))
  finally:
    for proc in procs:   # a failed or hung process must not outlive the test
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  results = {}   # check: [passed in every process that reported it, processes, report]
  for index, (stdout, _) in enumerate(outputs):
    current = None
    for line in stdout.splitlines():
      if line.startswith(("ok ", "FAIL ")):
        status, current = line.split(" ", 1)
        entry = results.setdefault(current, [True, 0, ""])
        entry[1] += 1
        if status != "ok":
          entry[0] = False
          entry[2] += f"process {index}: {line}\n"
      elif current is not None and not results[current][0]:
        results[current][2] += line + "\n"
  tail = "".join(f"\nprocess {i}: exit {proc.returncode}; stderr:\n{err[-2000:]}"
                 for i, (proc, (_, err)) in enumerate(zip(procs, outputs)))
  return num_processes, results, tail


@pytest.mark.slow   # a few minutes of processes: -m slow runs it, not CI
@pytest.mark.parametrize("config,check", [
    pytest.param(config, check, id=f"{config}/{check}",
                 marks=pytest.mark.xdist_group(f"cluster-{config}"))
    for config in CONFIGS for check in CHECKS])
def test_on_a_simulated_cluster(config, check):
  num_processes, results, tail = cluster_results(config)
  passed, reported, report = results.get(check, (False, 0, ""))
  assert reported == num_processes, \
      f"{config}/{check}: {reported} of {num_processes} processes reported{tail}"
  assert passed, report
