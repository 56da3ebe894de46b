"""Shared test settings.

KERNEL is the back end the kernel tests compare against the reference: Pallas'
interpreter by default (CPU, CI), the compiled kernels with ``JKV_BACKEND=pallas``
(GPU, benchmarks/gpu_check.sh).
"""

import os
import zlib

import numpy as np
import pytest
from hypothesis import settings

# CI: a fixed, small set of examples (reproducible); by hand: HYPOTHESIS_PROFILE=thorough.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("thorough", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

KERNEL = os.environ.get("JKV_BACKEND", "").strip() or "interpret"
if KERNEL in ("auto", "reference"):
  KERNEL = "interpret"


@pytest.fixture
def rng(request):
  """Random data per test, seeded by the test's id (crc32, stable across processes, so a
  failure reproduces) mixed with ``JKV_TEST_SEED`` (default 0; set it to draw other data)."""
  seed = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("JKV_TEST_SEED", "0"))
  return np.random.default_rng(seed)


def bits(x):
  """Array bytes, for bit-exact comparisons (NaN == NaN, -0 != +0)."""
  x = np.asarray(x)
  return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(f"u{x.dtype.itemsize}")
