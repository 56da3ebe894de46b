#!/usr/bin/env bash
# Memory safety: every Pallas kernel on adversarial inputs under compute-sanitizer memcheck
# (GPU, through the device tool). `JKV_SANITIZE_ONLY="substring|substring"` selects cases.
#
# compute-sanitizer 2025.3.1 (H100, 2026-11) crashed (segmentation fault of the tool,
# exit 139, no report) in some cases when XLA replayed its command buffers (CUDA graphs)
# or compiled a slow module under the tool. So: command buffers are off, and every
# executable is compiled first by a run without the tool into JAX's persistent
# compilation cache, which the sanitized run loads instead of compiling.
#
# XLA's default (BFC) allocator is used: with XLA_PYTHON_CLIENT_ALLOCATOR=platform (one
# cudaMalloc per buffer) compute-sanitizer crashed at start on 2026-11-22. Memcheck thus
# sees accesses outside XLA's arena and invalid / misaligned accesses, not an overrun into
# a neighbouring buffer of the arena; the reference comparison in sanitize.py covers
# wrong writes inside the cache.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/jkv_sanitize_cache}"
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
python3 benchmarks/sanitize.py > "$out/sanitize_compile.log" 2>&1
echo "compile pass (no sanitizer): $(grep '^SANITIZE CASES' "$out/sanitize_compile.log")"
compute-sanitizer --tool memcheck python3 benchmarks/sanitize.py > "$out/sanitize.log" 2>&1
status=$?
grep -v "^WARNING\|host_offloader" "$out/sanitize.log" \
  | grep -E "^(ok|FAIL)|SANITIZE|ERROR SUMMARY|Invalid|Error" | head -120
echo "compute-sanitizer exit status: $status"
exit $status
