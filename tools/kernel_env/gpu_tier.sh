#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# usage: gpu_tier.sh [--stock-topk XZ | --select-fuzz | --select-ncu [KIND]] [PYTEST ARGS]
#        gpu_tier.sh --summarize [--strict] XML...
#
# The GPU tier on a GPU machine without vLLM (torch, triton, CUDA), from
# the project root, with .device (tools/kernel_env/prepare.sh) beside it:
#
#   gpu_tier.sh [PYTEST ARGS]    the GPU tests of TESTS (-m "gpu and not stock_topk")
#   gpu_tier.sh --stock-topk XZ [PYTEST ARGS]
#       the tests marked stock_topk against vLLM's own top-k: XZ is the wheel's
#       _C_stable_libtorch.abi3.so, xz-compressed (prepare.sh --stock-topk puts
#       it in .device2/c.so.xz). Too big to go with .device under the 64 MiB
#       the GPU job harness ships with the tree (docs/gpu-tier.md), it goes
#       in a second run with only .device2, on the same machine after a
#       run with .device, whose CuTe DSL (/tmp/kpool-site) and stage
#       (/tmp/kpool-stock) it reuses. Fails if XZ is missing, if no test ran
#       or if any skipped.
#   gpu_tier.sh --select-fuzz [PYTEST ARGS]
#       the select's GPU tests (SELECT_TESTS), KPOOL_FUZZ_CASES (10000) cases
#       a fuzz loop
#   gpu_tier.sh --select-ncu [float32|bfloat16]
#       ncu sections of one select launch at 1, 8 and 64 rows of 65536 pools
#       (select_launch.py), and the stall samples of each SASS line (CSV)
#   gpu_tier.sh --summarize [--strict] XML...
#       the summary line of pytest JUnit XMLs (--strict: a skip fails too)
#
# Each test run ends with one line: passed, failed, errors and SKIPPED
# counted apart, the skip reasons, pytest's exit status. Logs and JUnit XML
# go to $OUT (else a new /tmp/kpool-gpu-tier.* dir). KPOOL_SEED replays a
# printed seed, KPOOL_FUZZ_CASES sets the cases a fuzz loop draws.
# KPOOL_GPU_TESTS / KPOOL_SELECT_TESTS override the test paths below. With
# .device/deep_gemm.tar.xz (prepare.sh --deep-gemm) it unpacks vLLM's DeepGEMM
# into /tmp/kpool-deep-gemm and sets KPOOL_DEEP_GEMM (tools/bench.py --deep-gemm).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
TESTS=${KPOOL_GPU_TESTS:-"tests/models/glm5next/specialized_decode tests/models/glm5next/test_indexer_decode_steps.py"}
SELECT_TESTS=${KPOOL_SELECT_TESTS:-tests/models/glm5next/specialized_decode/test_select.py}

usage() { sed -n '5,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$here/gpu_tier.sh"; }
die() { echo "gpu_tier.sh: $*" >&2; exit 2; }

summarize() {  # [--strict] XML...: one line; exit 1 on a failure, an error, no test
  python3 - "$@" <<'EOF'
import collections, sys, xml.etree.ElementTree as ET
strict = sys.argv[1] == "--strict"
counts, skips, missing = collections.Counter(), collections.Counter(), []
kinds = {"failure": "failed", "error": "errors", "skipped": "SKIPPED"}
for path in sys.argv[1 + strict:]:
    try:
        cases = list(ET.parse(path).getroot().iter("testcase"))
    except (OSError, ET.ParseError):
        missing.append(path)
        continue
    for case in cases:
        child = next((c for c in case if c.tag in kinds), None)
        counts[kinds[child.tag] if child is not None else "passed"] += 1
        if child is not None and child.tag == "skipped":
            reason = child.get("message", "").removeprefix("Skipped: ")
            skips[" ".join(reason.split())[:90]] += 1
line = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "errors", "SKIPPED"))
line += "".join(f" [{n}x {r}]" for r, n in skips.items())
line += "".join(f" [no JUnit XML: {path}]" for path in missing)
print(line)
bad = counts["failed"] + counts["errors"] + len(missing) + strict * counts["SKIPPED"]
sys.exit(1 if bad or not counts["passed"] else 0)
EOF
}

setup() {  # the CuTe DSL on PYTHONPATH, the shim on, KPOOL_STOCK: this run's stage or the last one's
  local site=/tmp/kpool-site
  if [ -f .device/env.sh ]; then
    # shellcheck disable=SC1091
    source .device/env.sh || die "could not unpack the CuTe DSL bundle"
    [ -f .device/stock/MANIFEST.json ] || die "no .device/stock: run prepare.sh here"
    rm -rf /tmp/kpool-stock && cp -r .device/stock /tmp/kpool-stock  # for a later run
    stock=.device/stock
  elif compgen -G "$site/.cutedsl-*" >/dev/null && [ -f /tmp/kpool-stock/MANIFEST.json ]; then
    export PYTHONPATH="$PWD:$site:$site/nvidia_cutlass_dsl/dsl_packages" PYTHONUNBUFFERED=1
    stock=/tmp/kpool-stock
  else
    die "no .device here and no earlier run with .device on this machine: bring .device"
  fi
  if [ -f .device/deep_gemm.tar.xz ]; then  # prepare.sh --deep-gemm
    rm -rf /tmp/kpool-deep-gemm && mkdir -p /tmp/kpool-deep-gemm &&
      tar xJf .device/deep_gemm.tar.xz -C /tmp/kpool-deep-gemm ||
      die "could not unpack .device/deep_gemm.tar.xz"
  fi
  if [ -d /tmp/kpool-deep-gemm/deep_gemm ]; then  # importable; its JIT needs nvcc
    export KPOOL_DEEP_GEMM=/tmp/kpool-deep-gemm CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
    export PYTHONPATH="$PYTHONPATH:$KPOOL_DEEP_GEMM"
  fi
  export KPOOL_KERNEL_ONLY=1 KPOOL_STOCK=${KPOOL_STOCK:-$stock}
  logs=${OUT:-$(mktemp -d /tmp/kpool-gpu-tier.XXXXXX)}
  mkdir -p "$logs"
  python3 -m tools.kernel_env.shim | tee "$logs/kernel_env.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || die "the shim or the product does not import"
}

run_tests() {  # NAME STRICT PYTEST-ARGS...: pytest with log and JUnit XML, then the line
  local name=$1 strict=$2 rc line status
  shift 2
  python3 -m pytest -p no:cacheprovider -q "$@" --junitxml="$logs/$name.xml" 2>&1 |
    tee "$logs/$name.log"
  rc=${PIPESTATUS[0]}
  line=$(summarize $strict "$logs/$name.xml")
  status=$?
  echo "$name: $line (pytest exit $rc; logs in $logs)"
  [ "$rc" -eq 0 ] && [ "$status" -eq 0 ]
}

cd "$here/../.."
case ${1:-} in
  -h | --help) usage ;;
  --summarize) shift && summarize "$@" ;;
  --stock-topk)
    xz=${2:-}
    [ -n "$xz" ] && [ -f "$xz" ] || die "--stock-topk: no file '$xz' (prepare.sh --stock-topk, then bring .device2)"
    shift 2
    setup
    xz -dc "$xz" >/tmp/kpool-stock-topk.so || die "could not unpack $xz"
    export KPOOL_STOCK_TOPK_SO=/tmp/kpool-stock-topk.so
    # shellcheck disable=SC2086
    run_tests stock_topk --strict $TESTS -m stock_topk "$@" ;;
  --select-fuzz)
    shift
    setup
    export KPOOL_FUZZ_CASES=${KPOOL_FUZZ_CASES:-10000}
    # shellcheck disable=SC2086
    run_tests select_fuzz "" $SELECT_TESTS -m "gpu and not stock_topk" "$@" ;;
  --select-ncu)
    kind=${2:-float32}
    case $kind in float32 | bfloat16) ;; *) die "--select-ncu: '$kind', not float32 or bfloat16" ;; esac
    setup
    status=0
    for rows in 1 8 64; do
      # Three launches, the sections and the stall samples of each SASS
      # line (--page source, CSV: where the warps wait).
      rep="$logs/select_ncu_${kind}_${rows}x65536"
      timeout 240 ncu --clock-control none -k regex:Select -c 3 --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --section LaunchStats \
        --section SourceCounters --warp-sampling-interval 0 -f -o "$rep" \
        python3 tools/kernel_env/select_launch.py "$rows" 65536 "$kind" >"$rep.log" 2>&1 &&
        ncu -i "$rep.ncu-rep" >"$rep.txt" 2>&1 &&
        ncu -i "$rep.ncu-rep" --page source --print-source sass --csv >"$rep.csv" 2>&1 ||
        status=1
      echo "select ncu, $rows rows of 65536 $kind pools ($rep.txt, $rep.csv):"
      grep -E "^key" "$rep.log"
      grep -E "Duration|Warp Cycles Per Issued|Achieved Occupancy" "$rep.txt" || tail -3 "$rep.log"
    done
    exit $status ;;
  *)  # anything else is pytest's (-k EXPR, --tb=short, ...); a wrong mode fails there
    setup
    # shellcheck disable=SC2086
    run_tests gpu_tier "" $TESTS -m "gpu and not stock_topk" "$@" ;;
esac
