#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# usage: cutedsl_bundle.sh [DEST]
#
# Run on the development machine (CPU, pip with access to PyPI), once,
# before prepare.sh, from anywhere:
#
#   cutedsl_bundle.sh [DEST]    the CuTe DSL bundle into DEST (default .device,
#                               relative to the repository root)
#
# The GPU machine has no CuTe DSL, so it travels as one archive: the
# nvidia-cutlass-dsl 4.8.0 wheels (-libs-base, -libs-core, -libs-cu13) and
# apache-tvm-ffi 0.1.11 (vLLM's pin, the TVM-FFI launch path of its CuTe DSL
# kernels) for CUDA 13, CPython 3.12, x86-64, installed into one directory
# and xz-compressed (~56 MiB, so that with the tree it stays under the
# 64 MiB the GPU job harness ships, docs/gpu-tier.md):
# DEST/cutedsl-4.8.0-tvmffi-0.1.11-cu13-cp312.tar.xz, and DEST/env.sh (from
# env.sh.in), which unpacks it on the GPU machine: source it there from the
# repository root. Packing takes about 5 minutes; the archive is kept in
# KPOOL_DEVICE_CACHE (default build/cache) for the next run.
# CUTEDSL_VERSION and TVM_FFI_VERSION override the versions.
set -euo pipefail
case ${1:-} in
  -h | --help) sed -n '5,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
  -*) echo "cutedsl_bundle.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
dest=${1:-.device}
version=${CUTEDSL_VERSION:-4.8.0}
tvm=${TVM_FFI_VERSION:-0.1.11}
cache=${KPOOL_DEVICE_CACHE:-build/cache}
name="cutedsl-$version-tvmffi-$tvm-cu13-cp312.tar.xz"
mkdir -p "$dest" "$cache"
if [ ! -s "$cache/$name" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$work/whl" "nvidia-cutlass-dsl==$version" "nvidia-cutlass-dsl-libs-base==$version" \
    "nvidia-cutlass-dsl-libs-core==$version" "nvidia-cutlass-dsl-libs-cu13==$version" \
    "apache-tvm-ffi==$tvm"
  python3 -m pip install -q --no-deps --no-compile --target "$work/site" --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --only-binary=:all: "$work"/whl/*.whl
  # A large dictionary is what brings the 260 MB tree to ~56 MiB (above).
  tar cf - -C "$work/site" . | xz -T1 --lzma2=preset=9e,dict=384MiB,nice=273 > "$work/$name"
  mv "$work/$name" "$cache/$name"
fi
cp "$cache/$name" "$dest/$name"
sed "s/@NAME@/$name/g" "$here/env.sh.in" > "$dest/env.sh"
ls -l "$dest"
