"""jkv.sharding on 8 CPU devices: specs of every cache pytree, sharded writes bit-exact
against unsharded ones (reference and Pallas-interpreter back ends, heads over tp, pages
over dp; under shard_map and, through the kernels' custom_partitioning rule, under plain
jit), sharded attention, block copies and swaps, no cache-sized collective in the compiled
HLO, repeated kv heads for tp > heads.

XLA fixes the CPU device count when JAX starts, and this process's JAX has started
(conftest), so each group of checks runs in a fresh process: ``tests/sharded_checks.py``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
GROUPS = ("specs", "writes_reference", "writes_interpret", "write_kv", "plain_jit", "attend",
          "blocks", "repeat")


def run_checks(group: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8",
             PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
  env.pop("JKV_BACKEND", None)   # the checks name their back ends
  return subprocess.run([sys.executable, str(ROOT / "tests" / "sharded_checks.py"), group],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("group", GROUPS)
def test_sharded_checks(group):
  result = run_checks(group)
  report = f"{result.stdout}\n{result.stderr[-4000:]}"
  assert result.returncode == 0, report
  lines = result.stdout.splitlines()
  assert lines and all(line.startswith(f"ok {group}/") for line in lines), report
