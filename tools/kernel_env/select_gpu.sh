#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# The opt-in select's GPU checks that issue 25 asks for, on the kernel-only
# GPU machine after tools/kernel_env/prepare.sh, from the project root:
#
#   tools/kernel_env/select_gpu.sh [fuzz|sanitize|ncu|steps|stock]...
#
# (default: all but stock)
#
# - fuzz: test_select_kernel.py's fuzz loops, KPOOL_FUZZ_CASES (10000) a dtype;
# - sanitize: memcheck over 12 fuzz cases a dtype, racecheck over 5;
# - ncu: one select launch at 1, 8 and 64 rows of 64K FP32 pools and 1 of BF16
#   (--clock-control none), the sections that say where its time goes;
# - steps: tools/indexer_steps.py --select, KPOOL_INDEXER_STEPS (1000) decode
#   steps a run, every backend path and mode;
# - stock: the set and attention comparisons with vLLM's own top-k,
#   tools/bench_select.py and the per-layer indexer step timing against it;
#   needs KPOOL_STOCK_TOPK_SO (docs/gpu-tier.md says how to stage the
#   wheel's binary).
# Logs go to $OUT (or /tmp). Exits non-zero if any part failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck disable=SC1091
source .device/env.sh >/dev/null || exit 1
export KPOOL_KERNEL_ONLY=1 KPOOL_STOCK=${KPOOL_STOCK:-.device/stock}
logs=${OUT:-/tmp}
test=tests/models/glm5next/specialized_decode/test_select_kernel.py
status=0
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(fuzz sanitize ncu steps)

for part in "${parts[@]}"; do
  case $part in
    fuzz)
      KPOOL_FUZZ_CASES=${KPOOL_FUZZ_CASES:-10000} timeout 600 python3 -m pytest -q \
        -p no:cacheprovider "$test" -m gpu -k "matches_reference or edges or empty" \
        >"$logs/select_fuzz.log" 2>&1 || status=1
      grep -E "select_topk|passed|failed" "$logs/select_fuzz.log" ;;
    sanitize)
      # racecheck instruments every shared-memory access of 1024 threads: a
      # few cases (the first five take each cluster size) and a longer bound.
      KPOOL_SANITIZE_TOOLS=memcheck KPOOL_FUZZ_CASES=${KPOOL_SANITIZE_CASES:-12} \
        tools/kernel_env/sanitize.sh select_matches || status=1
      KPOOL_SANITIZE_TOOLS=racecheck KPOOL_FUZZ_CASES=${KPOOL_RACECHECK_CASES:-5} \
        KPOOL_SANITIZE_TIMEOUT=${KPOOL_RACECHECK_TIMEOUT:-420} \
        tools/kernel_env/sanitize.sh select_matches || status=1 ;;
    ncu)
      for spec in "1 65536 float32" "8 65536 float32" "64 65536 float32" "1 65536 bfloat16"; do
        # shellcheck disable=SC2086
        set -- $spec
        log="$logs/select_ncu_${1}x${2}_$3.txt"
        timeout 120 ncu --clock-control none -k regex:Select -c 1 \
          --section SpeedOfLight --section WarpStateStats --section Occupancy \
          --section LaunchStats python3 tools/kernel_env/select_launch.py "$1" "$2" "$3" \
          >"$log" 2>&1 || status=1
        grep -E "^key|Duration|Warp Cycles Per Issued|Achieved Occupancy" "$log"
      done ;;
    steps)
      timeout 600 python3 tools/indexer_steps.py --select \
        --decode-steps "${KPOOL_INDEXER_STEPS:-1000}" --budget-s 500 \
        --json "$logs/indexer_steps_select.json" || status=1 ;;
    stock)
      if [ -z "${KPOOL_STOCK_TOPK_SO:-}" ]; then
        echo "stock: set KPOOL_STOCK_TOPK_SO (docs/gpu-tier.md)"; status=1; continue
      fi
      timeout 300 python3 -m pytest -q -p no:cacheprovider "$test" -m gpu -k stock_topk \
        || status=1
      timeout 500 python3 tools/bench_select.py --stock-topk-so "$KPOOL_STOCK_TOPK_SO" \
        --json "$logs/bench_select.json" || status=1
      timeout 500 python3 tools/indexer_steps.py --select --time-only \
        --stock-topk-so "$KPOOL_STOCK_TOPK_SO" --json "$logs/timing_select.json" \
        || status=1 ;;
    *) echo "unknown part $part (fuzz, sanitize, ncu, steps, stock)"; status=1 ;;
  esac
done
exit $status
