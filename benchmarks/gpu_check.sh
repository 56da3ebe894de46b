#!/usr/bin/env bash
# The GPU check loop (run through the device tool on an H100/H200):
#   bash benchmarks/gpu_check.sh            # whole suite, compiled kernels vs reference
#   bash benchmarks/gpu_check.sh --bench [--sections quant]
#                                           # ... then the benchmarks (writes $OUT/RESULTS.md)
# Uses the machine's own jax / pytest (no install): PYTHONPATH=. picks up jkv.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
export PYTHONPATH=. PYTHONUNBUFFERED=1 JKV_BACKEND=pallas
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -p no:cacheprovider -n 6 tests 2>&1 | tee "$out/gpu_tests.log" | tail -25
status=${PIPESTATUS[0]}
echo "pytest exit status: $status"
if [ "${1:-}" = "--bench" ]; then
  python3 -m jkv --layers 8 --batch 32 --steps 256 --head-size 128 --heads 8 2>&1 | tee "$out/demo.log"
  cp benchmarks/RESULTS.md "$out/RESULTS.md"   # the run replaces the sections it runs
  python3 benchmarks/run.py --results "$out/RESULTS.md" "${@:2}" 2>&1 | grep -v '^WARNING' \
    | tee "$out/bench.log"
fi
exit $status
