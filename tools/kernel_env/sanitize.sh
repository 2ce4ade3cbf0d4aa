#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# usage: sanitize.sh [TOOL...]
#
# compute-sanitizer over the kernels' fuzz loops on a GPU machine without
# vLLM, from the project root, with .device (tools/kernel_env/prepare.sh)
# beside it:
#
#   sanitize.sh [TOOL...]    memcheck racecheck initcheck synccheck (default: all)
#
# Each tool runs one pytest per kernel test module (MODULES), drawing fewer
# fuzz cases where the tool is slow (CASES), each run bounded (BOUND, seconds)
# so that it ends with the tool's own summary. Prints one line per tool
# (sanitizer_reports.py): the errors the summaries count, how many are in
# our kernels and how many in other kernels (torch's, DeepGEMM's), naming
# the kernels with the most; then the tests' outcome (gpu_tier.sh
# --summarize) and each run's exit status (99: the tool reported errors;
# 124: out of its bound). KPOOL_SANITIZE_K selects tests (pytest -k,
# default "not graph and not deepgemm": DeepGEMM's kernels are stock's,
# not ours); KPOOL_SANITIZE_MODULES overrides the modules,
# KPOOL_SANITIZE_BOUND every run's bound, KPOOL_SANITIZE_CASES every fuzz
# loop's cases (5 take the select's five cluster sizes in turn),
# KPOOL_SANITIZE_PRINT_LIMIT the
# reports a run prints (default 10000; 0: all). Logs and JUnit XML go to
# $OUT (else a new /tmp dir). Exits non-zero if a report is in our kernels,
# if errors went unprinted (whose kernels they are is unknown), if a test
# failed or if a run did not end; reports only in other kernels are said
# apart and do not fail it.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
d=tests/models/glm5next/specialized_decode
MODULES=${KPOOL_SANITIZE_MODULES:-"$d/test_update.py $d/test_expand.py $d/test_remap.py $d/test_upcast.py $d/test_select.py $d/test_scores.py"}
declare -A CASES=([memcheck]=16 [synccheck]=16 [initcheck]=6 [racecheck]=2)
declare -A BOUND=([memcheck]=90 [synccheck]=90 [initcheck]=90 [racecheck]=180)
bound=${KPOOL_SANITIZE_BOUND:-}
print_limit=${KPOOL_SANITIZE_PRINT_LIMIT:-10000}
case ${1:-} in -h | --help) sed -n '5,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;; esac
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck initcheck synccheck)
for tool in "${tools[@]}"; do
  [ -n "${CASES[$tool]:-}" ] || { echo "sanitize.sh: unknown tool $tool (--help)" >&2; exit 2; }
done
cd "$here/../.."
# shellcheck disable=SC1091
source .device/env.sh >/dev/null || exit 1
rm -rf /tmp/kpool-stock && cp -r .device/stock /tmp/kpool-stock  # for gpu_tier.sh --stock-topk
export KPOOL_KERNEL_ONLY=1 KPOOL_STOCK=${KPOOL_STOCK:-.device/stock}
logs=${OUT:-$(mktemp -d /tmp/kpool-sanitize.XXXXXX)}
mkdir -p "$logs"
status=0
for tool in "${tools[@]}"; do
  codes="" runs=() xmls=()
  # shellcheck disable=SC2086
  for module in $MODULES; do
    name="$tool-$(basename "$module" .py)"
    # API errors are off: cuda-python probes driver entry points that do not
    # exist (cuGetProcAddress), which is not a kernel's memory error. Device
    # backtraces only: the device frames name the kernel, and host frames
    # would make a log of many reports large.
    KPOOL_FUZZ_CASES=${KPOOL_SANITIZE_CASES:-${CASES[$tool]}} timeout "${bound:-${BOUND[$tool]}}" compute-sanitizer \
      --tool "$tool" --report-api-errors no --print-limit "$print_limit" \
      --show-backtrace device --error-exitcode 99 \
      python3 -m pytest -q -p no:cacheprovider "$module" -m "gpu and not stock_topk" \
      -k "${KPOOL_SANITIZE_K:-not graph and not deepgemm}" --junitxml="$logs/$name.xml" >"$logs/$name.log" 2>&1
    rc=$?
    # 99 is the tool's errors, which sanitizer_reports.py attributes; any
    # other failure (124: out of its bound) fails the run.
    [ "$rc" -eq 0 ] || [ "$rc" -eq 99 ] || status=1
    codes="$codes $rc" runs+=("$logs/$name.log") xmls+=("$logs/$name.xml")
  done
  reports=$(python3 "$here/sanitizer_reports.py" "${runs[@]}") || status=1
  tests=$("$here/gpu_tier.sh" --summarize "${xmls[@]}") || status=1
  echo "$tool: $reports | pytest: $tests | exit:$codes"
done
echo "sanitize.sh: logs in $logs"
exit $status
