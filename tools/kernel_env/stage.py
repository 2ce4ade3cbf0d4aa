# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stage what a GPU run without vLLM needs from the pinned vLLM install.

    python tools/kernel_env/stage.py --tree TREE [--quack DIR] [--dest .device/stock]

``TREE`` is a vLLM tree with the patch set applied, the directory that
contains ``vllm/`` (``prepare.sh`` passes the overlay ``tools.overlay``
builds). ``DIR`` is the installed ``quack`` package, vLLM's dependency
``quack-kernels`` (default: this python's).

The stock files the shim serves (``STOCK``) are copied verbatim to
``DEST/<same path>``, the quack package packed into ``DEST/quack.tar.xz``
(its ``.py`` files), and ``MANIFEST.json`` records their sha256 and the
patch set's, which ``shim.install`` verifies. A staged file that
``patches/base.json`` pins must differ from the pinned stock file (a patch
touches it), so an unpatched tree is refused; a stage made before
``patches/`` last changed is refused on load (a GPU run on it would test the
old hooks). Stdlib only.
"""

import argparse
import hashlib
import importlib.util
import io
import json
import shutil
import sys
import tarfile
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MANIFEST, QUACK = "MANIFEST.json", "quack.tar.xz"
_WARMUP = "vllm.model_executor.warmup"
_MLA = "vllm.v1.attention.backends.mla"
_ATTENTION = "vllm.model_executor.layers.attention"
# The stock modules the shim serves, one staged file each: the definitions
# it lifts from the file ("Class.member": a member of a stand-in class), or
# None to import the whole file. In import order: a module's stock imports
# resolve to the modules above it. A new name the product imports: one word.
STOCK: dict[str, str | None] = {
    f"{_WARMUP}.jit_warmup": None,
    f"{_WARMUP}.jit_warmup_cutedsl_helper": None,
    f"{_WARMUP}.jit_warmup_triton_helper": (
        "LaunchSpec _LaunchBindingPlan _launch_binding_plan"
    ),
    "vllm.config.compilation": "CompilationMode CUDAGraphMode",
    "vllm.forward_context": (
        "BatchDescriptor DPMetadata ForwardContext _forward_context "
        "get_forward_context is_forward_context_available in_piecewise_cudagraph "
        "override_forward_context"
    ),
    "vllm.compilation.breakable_cudagraph": (
        "_weak_ref_capture_arg eager_break_during_capture BreakableCUDAGraphCapture"
    ),
    "vllm.utils.deep_gemm": (
        "_UNIT_UE8M0_X4 _unit_mx_scales mqa_logits_mx_inputs native_next_n_supported"
    ),
    "vllm.v1.attention.ops.common": (
        "PackSeqTritonKernel.kernel PackSeqTritonKernel.__call__ pack_ue8m0_x4 "
        "pack_seq_triton UnpackSeqTritonKernel.kernel UnpackSeqTritonKernel.__call__ "
        "unpack_seq_triton"
    ),
    "vllm.model_executor.layers.sparse_attn_indexer": (
        "_assert_cutedsl_dcp_merge_supported _merge_dcp_topk_global "
        "_upcast_logits_kernel as_fp32_logits PrefillRowShard "
        "_reserve_row_shard_exchange_transient"
    ),
    f"{_MLA}.sparse_utils": (
        "flat_kv_row_view "
        "ConvertReqIndexToGlobalIndexKernel.sparse_mla_index_remap_kernel "
        "ConvertReqIndexToGlobalIndexKernel.__call__ _remap_tiling "
        "triton_convert_req_index_to_global_index"
    ),
    f"{_MLA}.index_group": "_create_side_stream _create_event SparseMLAIndexGroup",
    # The MLA metadata the planned-step test accepts (MLACommonPrefillMetadata
    # and MLACommonBackend, which a head_dim check calls, are not lifted).
    f"{_ATTENTION}.mla_attention": "MLACommonDecodeMetadata D MLACommonMetadata",
    # The sparse MLA impls' flags and the forward_mqa each defines, set on
    # stand-in classes derived as in vLLM (why_not_fusable's identity check).
    f"{_ATTENTION}.sparse_mla_attention": (
        "SparseMLACommonImpl.group_conversion_decode_only "
        "SparseMLACommonImpl.convert_decode_through_index_group "
        "SparseMLACommonImpl.forward_mqa SparseMLAPrefillMetadata "
        "SparseMLACommonMetadata"
    ),
    f"{_MLA}.flashmla_sparse": "FlashMLASparseImpl.forward_mqa",
    f"{_MLA}.flashinfer_mla_sparse_sm90": "FlashInferMLASparseSM90Impl.forward_mqa",
    f"{_MLA}.indexer": (
        "DeepseekV32IndexerPrefillChunkMetadata DeepseekV32IndexerPrefillMetadata "
        "DeepSeekV32IndexerDecodeMetadata DeepseekV32IndexerMetadata "
        "_kpool_tail_slot_mapping_kernel compute_kpool_tail_slot_mapping"
    ),
    "vllm.models.glm5next.common.sparse_indexer": None,
    "vllm.models.glm5next.nvidia.ops.kpool_compress": None,
    "vllm.models.glm5next.nvidia.sparse_indexer": (
        "SPECIALIZED_KPOOL _kpool_compress_insert sparse_attn_indexer_kpool"
    ),
}
STOCK_FILES = tuple(name.replace(".", "/") + ".py" for name in STOCK)
# What travels beside the 56 MiB CuTe DSL bundle must stay small.
MAX_BYTES, MAX_QUACK_BYTES = 1024 * 1024, 1024 * 1024


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


def pack(package: Path) -> bytes:
    """The ``.py`` files of ``package`` as a tar.xz under its name, the same
    bytes for the same files (sorted, no times or owners)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=6) as tar:
        for path in sorted(package.rglob("*.py")):
            data = path.read_bytes()
            info = tarfile.TarInfo(path.relative_to(package.parent).as_posix())
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def stage(
    sources: Mapping[str, Path],
    dest: Path,
    patches: Path = REPO / "patches",
    quack: Path | None = None,
) -> dict[str, str]:
    """Copy ``sources[rel]`` to ``dest/rel`` for every ``rel`` in
    ``STOCK_FILES`` (replacing ``dest/vllm``), pack the ``quack`` package
    (default: this python's); write the manifest, return its files' digests.
    Refuses (ValueError) a missing file, a staged file still equal to its
    pinned stock version, and sizes above ``MAX_BYTES`` / ``MAX_QUACK_BYTES``."""
    if quack is None:
        spec = importlib.util.find_spec("quack")
        quack = Path(spec.origin).parent if spec and spec.origin else None
    missing = [rel for rel in STOCK_FILES if not Path(sources[rel]).is_file()]
    if missing or not quack or not (quack / "utils.py").is_file():
        raise ValueError(f"not found: {missing or 'the quack package'} ({quack})")
    files = {rel: sha256(Path(sources[rel])) for rel in STOCK_FILES}
    base = patches / "base.json"
    pinned = json.loads(base.read_text())["files"] if base.is_file() else {}
    for rel, stock_sha in pinned.items():
        if files.get(rel) == stock_sha:
            raise ValueError(
                f"{sources[rel]} is the unpatched stock file (sha256 {stock_sha});"
                " stage from a tree with the patch set applied"
            )
    total = sum(Path(sources[rel]).stat().st_size for rel in STOCK_FILES)
    archive = pack(quack)
    if total > MAX_BYTES or len(archive) > MAX_QUACK_BYTES:
        raise ValueError(f"{total} bytes of sources, {len(archive)} of quack: too big")
    shutil.rmtree(dest / "vllm", ignore_errors=True)
    for rel in STOCK_FILES:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sources[rel], dest / rel)
    (dest / QUACK).write_bytes(archive)
    files[QUACK] = sha256(dest / QUACK)
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
            " (patches/ changed since); run tools/kernel_env/prepare.sh again"
        )
    files = recorded["files"]
    for rel in (*STOCK_FILES, QUACK):
        got = sha256(stock_dir / rel) if (stock_dir / rel).is_file() else "missing"
        if got != files.get(rel):
            raise ValueError(
                f"{stock_dir / rel}: sha256 {got}, manifest {files.get(rel)};"
                " run tools/kernel_env/prepare.sh again"
            )
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, required=True, help="patched tree")
    parser.add_argument("--quack", type=Path, help="the quack package (directory)")
    parser.add_argument("--dest", type=Path, default=Path(".device/stock"))
    args = parser.parse_args()
    sources = {rel: args.tree / rel for rel in STOCK_FILES}
    try:
        files = stage(sources, args.dest, quack=args.quack)
    except ValueError as e:
        sys.exit(f"stage.py: {e}")
    for rel, digest in files.items():
        print(f"{digest[:12]}  {rel}")
    print(f"staged {len(files)} files into {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
