#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# usage: prepare.sh [--stock-topk | --deep-gemm]
#
# Run on the development machine (CPU, the pinned vllm installed), before a
# run on the GPU machine, from anywhere:
#
#   prepare.sh                  stage the patched stock sources and quack into
#                               .device/stock; check .device (the CuTe DSL bundle
#                               of tools/kernel_env/cutedsl_bundle.sh) and its size
#   prepare.sh --stock-topk     also the wheel's top-k binary, xz-compressed,
#                               into .device2/c.so.xz (for gpu_tier.sh --stock-topk)
#   prepare.sh --deep-gemm      also vLLM's vendored DeepGEMM (vllm/third_party/
#                               deep_gemm, its JIT headers and binary), xz-compressed,
#                               into .device/deep_gemm.tar.xz (about 6 MB: the step
#                               benchmark and the scores tests; gpu_tier.sh unpacks it)
#
# PYTHON: a python with the pinned vllm (patches/base.json), default python3;
# KPOOL_TREE=DIR stages from that patched tree instead of the overlay that
# tools/overlay.py builds (a hard-link copy of the installed vllm with the
# patch set applied). .device and .device2 must be git-ignored (.device2 is
# added to the git exclude file when missing): they go to the GPU machine
# beside the tree, each with the tree under 64 MiB, the most the GPU job
# harness ships with the tree (docs/gpu-tier.md).
set -euo pipefail
case ${1:-} in
  -h | --help) sed -n '5,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
  "" | --stock-topk | --deep-gemm) ;;
  *) echo "prepare.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
limit=$((64 * 1024 * 1024))
tree_bytes=$(git ls-files -co --exclude-standard -z |
  { xargs -0 stat -c %s -- 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}')
fits() {  # DIR: the tree and DIR, as they go to the GPU machine, stay under the limit
  local total=$(($(du -sb "$1" | cut -f1) + tree_bytes))
  echo "prepare.sh: $1 plus the tree: $((total / 1024)) KiB of $((limit / 1024))"
  [ "$total" -lt "$limit" ] || { echo "prepare.sh: $1 is too big to travel" >&2; exit 1; }
}

tree=${KPOOL_TREE:-}
if [ -z "$tree" ]; then
  tree=$("$py" -c '
import sys
from tools import overlay, patchset
stock = overlay.find_installed_vllm()
if stock is None:
    v = patchset.Patchset.load().version
    sys.exit(f"prepare.sh: no vllm installed for {sys.executable}; expected vllm=={v}"
             " (patches/base.json): set PYTHON to a python that has it, or KPOOL_TREE")
try:
    print(overlay.build_overlay(stock))
except patchset.PatchsetError as e:
    sys.exit(f"prepare.sh: {e}")
')
fi
"$py" tools/kernel_env/stage.py --tree "$tree" --dest .device/stock
if ! compgen -G ".device/cutedsl-*.tar.xz" >/dev/null || [ ! -f .device/env.sh ]; then
  echo "prepare.sh: no CuTe DSL bundle in .device; run tools/kernel_env/cutedsl_bundle.sh" >&2
  exit 1
fi
fits .device

if [ "${1:-}" = --deep-gemm ]; then
  site=$("$py" -c 'import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))')
  tar cf - -C "$site/vllm/third_party" --exclude=__pycache__ deep_gemm |
    xz -6 -T2 >.device/deep_gemm.tar.xz.part
  mv .device/deep_gemm.tar.xz.part .device/deep_gemm.tar.xz
  fits .device
fi
if [ "${1:-}" = --stock-topk ]; then
  git check-ignore -q .device2/c.so.xz ||
    echo /.device2/ >>"$(git rev-parse --git-path info/exclude)"
  wheel=$("$py" -c 'from tools import patchset as p; print(p.default_wheel(p.Patchset.load()))')
  [ -f "$wheel" ] || { echo "prepare.sh: $wheel not found (make test fetches it)" >&2; exit 1; }
  mkdir -p .device2
  unzip -p "$wheel" vllm/_C_stable_libtorch.abi3.so | xz -6 -T2 >.device2/c.so.xz.part
  mv .device2/c.so.xz.part .device2/c.so.xz
  fits .device2
fi
echo "prepare.sh: ready; on the GPU machine, with .device: tools/kernel_env/gpu_tier.sh"
[ "${1:-}" != --stock-topk ] ||
  echo "prepare.sh: then, with .device2: tools/kernel_env/gpu_tier.sh --stock-topk .device2/c.so.xz"
