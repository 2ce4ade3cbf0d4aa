#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Run HERE (CPU, full vLLM installed) before a GPU call: stages the patched
# stock sources into .device/stock and checks that .device holds the CuTe DSL
# bundle (../shared/device/cutedsl-bundle.sh .device makes it).
#
#   tools/kernel_env/prepare.sh           # PYTHON: a python with the pinned vllm
#   KPOOL_TREE=DIR tools/kernel_env/prepare.sh   # stage from a patched tree
#
# The pinned vllm is the version in patches/base.json. The patched tree is the
# overlay tools/overlay.py builds (a hard-link copy of the installed vllm with
# the patch set applied, cached in build/overlay).
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}

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
    print(overlay.build_overlay(stock, log=lambda m: print(m, file=sys.stderr)))
except patchset.PatchsetError as e:
    sys.exit(f"prepare.sh: {e}")
')
fi
"$py" tools/kernel_env/stage.py --tree "$tree" --dest .device/stock

if ! ls .device/cutedsl-*.tar.xz >/dev/null 2>&1 || [ ! -f .device/env.sh ]; then
  echo "prepare.sh: no CuTe DSL bundle in .device; run ../shared/device/cutedsl-bundle.sh .device" >&2
  exit 1
fi
du -sh .device/* | sed 's/^/prepare.sh: /'
total=$(du -sm .device | cut -f1)
if [ "$total" -ge 63 ]; then
  echo "prepare.sh: .device is ${total} MiB; the tree that travels must stay under 64 MiB" >&2
  exit 1
fi
echo "prepare.sh: ready; on the GPU machine run tools/kernel_env/gpu_tier.sh (carry .device)"
