#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over the GPU
# tier's kernels on its fuzz inputs (padded and partially invalid batches
# included), on the kernel-only GPU machine, after tools/kernel_env/prepare.sh:
#
#   tools/kernel_env/sanitize.sh [pytest -k expression]
#
# KPOOL_FUZZ_CASES (default 16) sets the cases per fuzz loop: the sanitizer
# slows every launch. KPOOL_SANITIZE_TOOLS picks tools, KPOOL_SANITIZE_TIMEOUT
# (seconds, default 150) bounds each. Prints one summary line per tool; logs go to $OUT (or
# /tmp). Exits non-zero if any tool reported an error or a test failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck disable=SC1091
source .device/env.sh >/dev/null || exit 1
export KPOOL_KERNEL_ONLY=1 KPOOL_STOCK=${KPOOL_STOCK:-.device/stock}
export KPOOL_FUZZ_CASES=${KPOOL_FUZZ_CASES:-16}
logs=${OUT:-/tmp}
select=${1:-not graph}
status=0
for tool in ${KPOOL_SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
  log="$logs/sanitize-$tool.log"
  # API errors are off: cuda-python probes driver entry points that do not
  # exist (cuGetProcAddress), which is not a kernel's memory error.
  timeout "${KPOOL_SANITIZE_TIMEOUT:-150}" compute-sanitizer --tool "$tool" \
    --report-api-errors no --print-limit 20 --error-exitcode 99 \
    python3 -m pytest -q -p no:cacheprovider tests/models/glm5next/specialized_decode -m gpu \
    -k "$select" >"$log" 2>&1
  rc=$?
  summary=$(grep -hE "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1)
  tests=$(grep -hE "passed|failed" "$log" | tail -1)
  echo "$tool: ${summary:-no summary} | pytest: ${tests:-none} | exit $rc"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
