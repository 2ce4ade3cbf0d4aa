# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stage the stock vLLM sources the kernel-only GPU run needs.

    python tools/kernel_env/stage.py --tree TREE [--dest .device/stock]

``TREE`` is a vLLM tree with the patch set applied, the directory that
contains ``vllm/``: an unpacked wheel or a site-packages after
``tools/patchset.py apply``, or the overlay ``tools.overlay.build_overlay``
builds (``prepare.sh`` uses that one).

The files in ``STOCK_FILES`` are copied verbatim to ``DEST/<same path>`` with
``MANIFEST.json`` (their sha256 and the patch set's), which ``shim.install``
verifies. A staged file that ``patches/base.json`` pins must differ from the
pinned stock file (a patch touches it), so an unpatched tree is refused; a
stage made before ``patches/`` last changed is refused on load (a GPU run on
it would test the old hooks). Stdlib only.
"""

import argparse
import hashlib
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MANIFEST = "MANIFEST.json"
# Everything the shim loads, verbatim. It travels to the GPU machine with the
# 56 MiB CuTe DSL bundle, so it must stay small (MAX_BYTES).
STOCK_FILES = (
    "vllm/model_executor/warmup/jit_warmup.py",
    "vllm/model_executor/warmup/jit_warmup_cutedsl_helper.py",
    "vllm/model_executor/warmup/jit_warmup_triton_helper.py",
    "vllm/config/compilation.py",
    "vllm/forward_context.py",
    "vllm/compilation/breakable_cudagraph.py",
    "vllm/utils/deep_gemm.py",
    "vllm/v1/attention/ops/common.py",
    "vllm/model_executor/layers/sparse_attn_indexer.py",
    "vllm/v1/attention/backends/mla/sparse_utils.py",
    "vllm/v1/attention/backends/mla/index_group.py",
    "vllm/v1/attention/backends/mla/indexer.py",
    "vllm/model_executor/layers/attention/sparse_mla_attention.py",
    "vllm/models/glm5next/common/sparse_indexer.py",
    "vllm/models/glm5next/nvidia/ops/kpool_compress.py",
    "vllm/models/glm5next/nvidia/sparse_indexer.py",
)
MAX_BYTES = 640 * 1024


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def patches_digest(patches: Path) -> str:
    """sha256 over every file in ``patches/`` (series, base.json, patches).
    Not ``Patchset.digest``: that covers the fork's added ``vllm/`` files too,
    which the stage does not hold, so every kernel edit would void it."""
    h = hashlib.sha256()
    for path in sorted(p for p in patches.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _pinned(patches: Path) -> dict[str, str]:
    """``{path: sha256}`` of the stock files the patch set touches, if pinned."""
    base = patches / "base.json"
    return json.loads(base.read_text())["files"] if base.is_file() else {}


def stage(
    sources: Mapping[str, Path], dest: Path, patches: Path = REPO / "patches"
) -> dict[str, str]:
    """Copy ``sources[rel]`` to ``dest/rel`` for every ``rel`` in
    ``STOCK_FILES``, replacing ``dest/vllm``; write the manifest, return it.

    Refuses (ValueError) a missing file, a staged file still equal to its
    pinned stock version, and a total above ``MAX_BYTES``.
    """
    missing = [rel for rel in STOCK_FILES if not Path(sources[rel]).is_file()]
    if missing:
        raise ValueError(f"stock files not found: {missing}")
    files = {rel: sha256(Path(sources[rel])) for rel in STOCK_FILES}
    for rel, stock_sha in _pinned(patches).items():
        if files.get(rel) == stock_sha:
            raise ValueError(
                f"{sources[rel]} is the unpatched stock file (sha256 {stock_sha});"
                " stage from a tree with the patch set applied"
            )
    total = sum(Path(sources[rel]).stat().st_size for rel in STOCK_FILES)
    if total > MAX_BYTES:
        raise ValueError(f"staged sources are {total} bytes, over {MAX_BYTES}")
    shutil.rmtree(dest / "vllm", ignore_errors=True)
    for rel in STOCK_FILES:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sources[rel], dest / rel)
    manifest = {"files": files, "bytes": total, "patches": patches_digest(patches)}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return files


def verify(stock_dir: Path, patches: Path = REPO / "patches") -> dict[str, str]:
    """Check ``stock_dir`` against its manifest and the patch set in
    ``patches``; return ``{rel: sha256}``."""
    manifest = stock_dir / MANIFEST
    if not manifest.is_file():
        raise FileNotFoundError(
            f"{manifest} not found: run tools/kernel_env/prepare.sh first"
        )
    recorded = json.loads(manifest.read_text())
    if recorded.get("patches") != patches_digest(patches):
        raise ValueError(
            f"{stock_dir} was staged from another patch set than {patches}"
            f" (digest {recorded.get('patches')}, now {patches_digest(patches)});"
            " run tools/kernel_env/prepare.sh again"
        )
    files = recorded["files"]
    for rel in STOCK_FILES:
        got = sha256(stock_dir / rel) if (stock_dir / rel).is_file() else "missing"
        if got != files.get(rel):
            raise ValueError(
                f"{stock_dir / rel}: sha256 {got}, manifest {files.get(rel)};"
                " stage again"
            )
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, required=True, help="patched tree")
    parser.add_argument("--dest", type=Path, default=Path(".device/stock"))
    args = parser.parse_args()
    try:
        files = stage({rel: args.tree / rel for rel in STOCK_FILES}, args.dest)
    except ValueError as e:
        sys.exit(f"stage.py: {e}")
    for rel, digest in files.items():
        print(f"{digest[:12]}  {rel}")
    print(f"staged {len(files)} files into {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
