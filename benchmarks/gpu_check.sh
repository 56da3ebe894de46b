#!/usr/bin/env bash
# The GPU check loop (run through the device tool on an H100/H200). One device command may
# run 10 minutes, so run the pieces as separate calls:
#   bash benchmarks/gpu_check.sh                            # whole suite, compiled kernels vs reference
#   JKV_LOWERING=triton bash benchmarks/gpu_check.sh --part 0/3   # the default suite's test
#       files 0, 3, 6, ... (then 1/3, 2/3): a lowering's suite in calls of under 10 minutes
#   JKV_LOWERING=mosaic bash benchmarks/gpu_check.sh --part 0/3 slow   # its tests marked slow
#   bash benchmarks/gpu_check.sh --bench-only --sections write   # demo + plain-write benchmarks
#   bash benchmarks/gpu_check.sh --bench-only --sections quant   # FP8 quantized writes (~9 min)
#   bash benchmarks/gpu_check.sh --bench-only --sections quant-int8   # INT8 + FP4 (~6 min)
#   bash benchmarks/gpu_check.sh --bench-only --sections quant-decode,blocks   # ~3 min
#   bash benchmarks/gpu_check.sh --bench-only --sections quant-layers          # per-block, 1 vs 8 layers a step
#   bash benchmarks/gpu_check.sh --bench-only --sections quant-asm-pa          # 128 / 256-token scale blocks
#   bash benchmarks/gpu_check.sh --bench-only --sections mla                   # MLA / indexer
#   bash benchmarks/gpu_check.sh --bench-only --sections attention             # decode attention
# The benchmarks write $OUT/RESULTS.md: benchmarks/RESULTS.md with the sections run replaced
# (rows are written as they are measured, so a cut run keeps what it measured).
# Uses the machine's own jax / pytest (no install): PYTHONPATH=. picks up jkv.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
export PYTHONPATH=. PYTHONUNBUFFERED=1 JKV_BACKEND=pallas XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
status=0
if [ "${1:-}" == "--part" ]; then
  part=${2%/*} parts=${2#*/} marks=${3:-not slow}
  # (LC_ALL=C: the same files in a part on every machine)
  files=$(LC_ALL=C ls tests/test_*.py | awk -v k="$part" -v n="$parts" '(NR - 1) % n == k')
  echo "part $2 -m '$marks' (JKV_LOWERING=${JKV_LOWERING:-auto}):" $files
  python3 -m pytest -q -p no:cacheprovider -n 14 -m "$marks" $files 2>&1 \
    | tee "$out/gpu_tests_part$part.log" | tail -25
  status=${PIPESTATUS[0]}
  echo "pytest exit status: $status"
elif [ "${1:-}" != "--bench-only" ]; then
  python3 -m pytest -q -p no:cacheprovider -n 8 -m "slow or not slow" tests 2>&1 | tee "$out/gpu_tests.log" | tail -25
  status=${PIPESTATUS[0]}
  echo "pytest exit status: $status"
else
  if [[ " ${*:2} " == *" write "* ]]; then
    python3 -m jkv --layers 8 --batch 32 --steps 256 --head-size 128 --heads 8 2>&1 | tee "$out/demo.log"
  fi
  cp benchmarks/RESULTS.md "$out/RESULTS.md"   # the run replaces the sections it runs
  python3 benchmarks/run.py --results "$out/RESULTS.md" "${@:2}" 2>&1 | grep --line-buffered -v '^WARNING' \
    | tee "$out/bench.log"
fi
exit $status
