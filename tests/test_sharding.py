"""jkv.sharding on 8 CPU devices: specs of every cache pytree, sharded writes bit-exact
against unsharded ones (reference and Pallas-interpreter back ends, heads over tp, pages
over dp; under shard_map and, through the kernels' custom_partitioning rule, under plain
jit), sharded attention, block copies and swaps, no cache-sized collective in the compiled
HLO, repeated kv heads for tp > heads.

XLA fixes the CPU device count when JAX starts, and this process's JAX has started
(conftest), so the checks run in fresh processes (``tests/sharded_checks.py``): one per
group, once per test worker (the group's tests share an ``xdist_group``), and each check is
a test of its own here, named ``GROUP/CHECK``, that passes when its line says ``ok`` and
fails with that check's traceback otherwise.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "sharded_checks.py"


def _environment():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8",
             PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
  env.pop("JKV_BACKEND", None)   # the checks name their back ends
  env.pop("JKV_SHARDED_MESH", None)
  return env


def _run(*args, timeout=900):
  return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=_environment(),
                        capture_output=True, text=True, timeout=timeout)


def _checks():
  listing = _run("--list", timeout=300)
  if listing.returncode != 0:
    raise RuntimeError(f"sharded_checks.py --list failed:\n{listing.stderr[-4000:]}")
  return [tuple(line.split("/", 1)) for line in listing.stdout.split()]


CHECKS = _checks()


@functools.lru_cache(maxsize=None)
def group_results(group: str):
  """{check: (passed, report)} of one run of ``group`` (a process per group per worker)."""
  result = _run(group)
  results, current = {}, None
  for line in result.stdout.splitlines():
    if line.startswith(f"ok {group}/") or line.startswith(f"FAIL {group}/"):
      status, name = line.split(" ", 1)
      current = name.split("/", 1)[1].rsplit(" ", 1)[0] if status == "ok" else \
          name.split("/", 1)[1]
      results[current] = [status == "ok", line]
    elif current is not None:
      results[current][1] += "\n" + line
  tail = f"\nexit status {result.returncode}; stderr:\n{result.stderr[-3000:]}"
  return results, tail


# The default test run keeps the specs, the writes through the reference and write_kv; the
# kernel groups (interpret mode, seconds a check) run with -m slow (the GPU check, by hand).
QUICK_GROUPS = ("specs", "writes_reference", "write_kv")


@pytest.mark.parametrize("group,check", [
    pytest.param(group, check, id=f"{group}/{check}",
                 marks=[pytest.mark.xdist_group(group)]
                 + ([] if group in QUICK_GROUPS else [pytest.mark.slow]))
    for group, check in CHECKS])
def test_sharded(group, check):
  results, tail = group_results(group)
  assert check in results, f"{group}/{check} did not report (the run stopped?){tail}"
  passed, report = results[check]
  assert passed, report


def test_every_group_has_checks():
  assert {group for group, _ in CHECKS} == {"specs", "writes_reference", "writes_interpret",
                                            "write_kv", "plain_jit", "attend", "blocks",
                                            "repeat", "checkpoint"}
