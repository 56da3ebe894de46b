"""Shared test settings.

KERNEL is the back end the kernel tests compare against the reference: Pallas'
interpreter by default (CPU, CI), the compiled kernels with ``JKV_BACKEND=pallas``
(GPU, benchmarks/gpu_check.sh).
"""

import os

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
  """Fresh random data per test (seeded by the test's name, so failures reproduce)."""
  return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


def bits(x):
  """Array bytes, for bit-exact comparisons (NaN == NaN, -0 != +0)."""
  x = np.asarray(x)
  return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(f"u{x.dtype.itemsize}")
