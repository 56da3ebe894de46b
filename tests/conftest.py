"""Shared test settings and helpers (the one place for them: tests import them from here,
``tests/sharded_checks.py`` too).

KERNEL is the back end the kernel tests compare against the reference: Pallas'
interpreter by default (CPU, CI), the compiled kernels with ``JKV_BACKEND=pallas``
(GPU, benchmarks/gpu_check.sh).
"""

import os
import zlib

# Pallas' GPU interpreter runs each warpgroup of a Mosaic kernel as an XLA program that may
# take a thread of XLA's CPU execute pool beside its caller's: on a 2-core machine (CI) the
# default pool of 2 let the ragged prefill's 2-3 warpgroups hang now and then (see
# pallas_kernels/lowering.mosaic_interpret). XLA reads the pool size when JAX starts.
os.environ.setdefault("PJRT_NPROC", str(max(8, os.cpu_count() or 1)))

import jax  # noqa: E402  (after PJRT_NPROC)
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


# The default test run (the README's command, and CI's two passes) leaves out what is
# marked ``slow``; ``-m slow`` runs those (benchmarks/gpu_check.sh does). Marked slow:
# the hypothesis property modules, a few whole checks (their own ``slow`` marks), and most
# cases of the parametrized sweeps below: of sweep ``file::test: k`` the default run keeps
# every k-th case in collection order (the first, the (k+1)-th, ...), a spread of its cases.
SWEEPS = {
    "test_write.py::test_head_and_block_sizes": 12,
    "test_write.py::test_fp8_matches_reference_and_numpy": 9,
    "test_write.py::test_kernel_tiles_and_store_orders": 5,
    "test_write.py::test_auto_matches_reference_and_numpy": 5,
    "test_write.py::test_multi_layer_traced_layer_in_fori_loop": 3,
    "test_quant_write.py::test_kernel_matches_reference": 6,
    "test_quant_write.py::test_paged_cache_quant_modes": 4,
    "test_quant_write.py::test_block_kernel_on_prefill_and_interleaved_sequences": 4,
    "test_quant_write.py::test_round_trip_error_bounds": 4,
    "test_quant_write.py::test_block_reference_matches_numpy": 2,
    "test_quant_write.py::test_block_kernel_leaves_unwritten_blocks_alone": 2,
    "test_ragged_attention.py::test_kernel_matches_reference_fp8_tensor": 6,
    "test_ragged_attention.py::test_kernel_matches_reference_scaled": 4,
    "test_ragged_attention.py::test_matches_numpy_model_every_layout": 6,
    "test_ragged_attention.py::test_write_and_attend_equals_write_then_attend": 4,
    "test_ragged_attention.py::test_kernel_matches_reference_16_bit": 4,
    "test_ragged_attention.py::test_options_match_numpy_model": 3,
    "test_ragged_attention.py::test_kernel_shapes": 4,
    "test_ragged_attention.py::test_array_ops_with_write": 2,
    "test_attention.py::test_mla_fp8_entry_kernels_match_reference": 4,
    "test_attention.py::test_fp4_reference_equals_numpy": 3,
    "test_attention.py::test_kernel_matches_reference_scaled": 4,
    "test_attention.py::test_kernel_matches_reference_plain": 4,
    "test_attention.py::test_kernel_matches_reference_fp8_tensor": 3,
    "test_attention.py::test_kernel_shapes": 2,
    "test_host_cache.py::test_offload_and_reload_round_trip": 6,
    "test_mla.py::test_fused_rope_concat_and_cache": 8,
    "test_mla.py::test_concat_and_cache_mla": 4,
    "test_mla_bmm_kernel.py::test_kernel_matches_reference": 4,
    "test_models.py::test_llama_quantized_cache_within_bound": 3,
    "test_models.py::test_llama_cached_decode_equals_full_recompute": 3,
    "test_indexer.py::test_kernel_write_matches_reference": 4,
    "test_indexer.py::test_write_then_gather": 3,
    "test_indexer.py::test_kernel_gather_matches_reference": 4,
    "test_fp4.py::test_write_fp4_reference_model": 3,
    "test_blocks.py::test_fork_copy_on_write_end_to_end": 3,
    "test_blocks.py::test_swap_blocks_every_direction": 2,
    "test_blocks.py::test_copy_blocks_matches_numpy": 3,
    "test_ds_mla_kernel.py::test_kernel_matches_reference": 4,
    "test_ds_mla_kernel.py::test_kernel_tiles": 3,
    "test_transcode.py::test_layout_pairs": 2,
    "test_transcode.py::test_paged_kv_cache": 2,
    "test_page_pool.py::test_free_with_zeroing": 2,
    "test_cuda_lowering.py::test_paged_write_and_attention_kernels_lower": 2,
}


@pytest.hookimpl(tryfirst=True)   # before ``-m`` deselects
def pytest_collection_modifyitems(config, items):
  index = {}
  for item in items:
    key = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
    if key in SWEEPS:
      position = index[key] = index.get(key, -1) + 1
      if position % SWEEPS[key]:
        item.add_marker(pytest.mark.slow)


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


def assert_same(got, want, what=""):
  """Bit-identical results: arrays (shape, dtype and bytes), sequences of them (None where
  None), or pytrees of one structure (cache objects). ``what`` prefixes the message."""
  if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
    assert len(got) == len(want), f"{what}: {len(got)} results, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
      assert_same(g, w, f"{what}[{i}]")
    return
  if got is None or want is None:
    assert got is None and want is None, f"{what}: {got is None=} {want is None=}"
    return
  if not hasattr(want, "shape"):   # a pytree
    assert jax.tree.structure(got) == jax.tree.structure(want), f"{what}: pytree structure"
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
      assert_same(g, w, f"{what}{jax.tree_util.keystr(path)}")
    return
  got, want = np.asarray(got), np.asarray(want)
  assert (got.shape, got.dtype) == (want.shape, want.dtype), \
      f"{what}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
  differ = np.nonzero(bits(got).reshape(-1) != bits(want).reshape(-1))[0]
  assert differ.size == 0, (f"{what}: {differ.size} of {got.size} elements differ, the first "
                            f"at flat index {differ[0]}: {got.reshape(-1)[differ[0]]} vs "
                            f"{want.reshape(-1)[differ[0]]}")


def random_slots(rng, num_tokens, capacity, padding=2):
  """int32 [num_tokens]: distinct slots below ``capacity``, ``padding`` of them -1 (vLLM's
  padding rows)."""
  slots = rng.permutation(capacity)[:num_tokens].astype(np.int32)
  slots[rng.permutation(num_tokens)[:padding]] = -1
  return slots


def poisoned_bytes(rng, shape):
  """Random uint8 bytes, never 0: a stray write of zeros shows."""
  return jax.numpy.asarray(rng.integers(1, 256, shape, dtype=np.uint8))
