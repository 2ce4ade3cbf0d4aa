#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# The GPU tier on the kernel-only GPU machine (torch, triton, CuTe DSL; no
# vLLM), from the project root, after tools/kernel_env/prepare.sh here:
#
#   tools/kernel_env/gpu_tier.sh [extra pytest args]
#
# which is: source .device/env.sh && KPOOL_KERNEL_ONLY=1 KPOOL_STOCK=.device/stock
#           python3 -m pytest -q tests/models/glm5next/specialized_decode \
#               tests/models/glm5next/test_indexer_decode_steps.py -m gpu [args]
# specialized_decode/: one fuzz loop per kernel (test_update_kernel.py,
# test_expand_kernel.py, test_remap_kernel.py, test_upcast_kernel.py), the
# FusedRemap runs (test_fused_remap.py), the decode tail's graph replays
# (test_decode_tail_graph.py), the self-check and the rules' edges; then the
# indexer step driver (tools/indexer, through test_indexer_decode_steps.py;
# -k indexer_steps alone; KPOOL_INDEXER_STEPS decode steps a run, 500).
# KPOOL_SEED replays a printed seed, KPOOL_FUZZ_CASES sets the cases a loop.
# The stock kernels come from .device/stock through tools/kernel_env/shim.py
# (the root conftest installs it). With $OUT set, the log and a JUnit XML go
# there. The timing: tools/indexer_steps.py --time-only (tools/kernel_env/README.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck disable=SC1091
source .device/env.sh || exit 1
export KPOOL_KERNEL_ONLY=1 KPOOL_STOCK=${KPOOL_STOCK:-.device/stock}
tests=(tests/models/glm5next/specialized_decode tests/models/glm5next/test_indexer_decode_steps.py)
args=(-q "${tests[@]}" -m gpu "$@")
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  python3 -m tools.kernel_env.shim | tee "$OUT/kernel_env.txt"
  python3 -m pytest "${args[@]}" --junitxml="$OUT/gpu_tier.xml" 2>&1 | tee "$OUT/gpu_tier.log"
  exit "${PIPESTATUS[0]}"
fi
python3 -m tools.kernel_env.shim
exec python3 -m pytest "${args[@]}"
