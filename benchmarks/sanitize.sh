#!/usr/bin/env bash
# Memory safety: every Pallas kernel on adversarial inputs under compute-sanitizer memcheck
# (GPU, through the device tool). XLA's default (BFC) allocator is used: with
# XLA_PYTHON_CLIENT_ALLOCATOR=platform (one cudaMalloc per buffer) and --print-limit,
# compute-sanitizer itself crashed at start on 2026-11-22 (H100, 2025.3.1). Memcheck thus
# sees accesses outside XLA's arena and invalid / misaligned accesses, not an overrun into
# a neighbouring buffer of the arena; the reference comparison in sanitize.py covers
# wrong writes inside the cache.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
compute-sanitizer --tool memcheck python3 benchmarks/sanitize.py > "$out/sanitize.log" 2>&1
status=$?
grep -v "^WARNING\|host_offloader" "$out/sanitize.log" \
  | grep -E "^(ok|FAIL)|SANITIZE|ERROR SUMMARY|Invalid|Error" | head -90
echo "compute-sanitizer exit status: $status"
exit $status
