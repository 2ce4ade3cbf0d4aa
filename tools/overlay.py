# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The patched vLLM that tests and tools import, without touching the venv.

``build_overlay`` hard-links the installed stock package into
``build/overlay/<key>/vllm`` and applies the patch set to that copy: patched
files get new inodes, so the venv never changes. The key covers the patch set,
the stock install and these tools; overlays unused for 6 h are deleted.

    python tools/overlay.py     builds (or reuses) the overlay of the vllm
                                this python has, prints its dir: put it
                                first on PYTHONPATH to import the patched tree
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.machinery
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import patchset  # noqa: E402
from tools.patchset import Patchset, PatchsetError  # noqa: E402

OVERLAY_DIR = patchset.REPO_ROOT / "build" / "overlay"
MAX_AGE_S = 6 * 3600


def find_installed_vllm() -> Path | None:
    """The stock ``vllm`` package dir on sys.path, found without importing it
    (that would pin the unpatched vllm); this repo and overlays skipped."""
    paths = [Path(entry or ".").resolve() for entry in sys.path]
    skip = {
        p.resolve() for p in (patchset.REPO_ROOT, OVERLAY_DIR, *OVERLAY_DIR.glob("*"))
    }
    paths = [str(p) for p in paths if p not in skip]
    spec = importlib.machinery.PathFinder.find_spec("vllm", paths)
    return Path(spec.origin).parent if spec and spec.origin else None


def _link(src: str, dst: str) -> None:
    """A hard link, else (another file system) a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _key(stock_pkg: Path, ps: Patchset) -> str:
    h = hashlib.sha256(f"{ps.digest} {stock_pkg}".encode())
    for path in (
        Path(__file__),
        Path(patchset.__file__),
        *sorted(stock_pkg.parent.glob("vllm-*.dist-info/RECORD")),
        *(stock_pkg.parent / rel for rel in ps.touched),
    ):
        h.update(path.read_bytes() if path.is_file() else b"-")
    return h.hexdigest()[:16]


def build_overlay(stock_pkg, cache_root=OVERLAY_DIR, ps=None, *, log=None) -> Path:
    """The dir to put first on sys.path: a patched hard-link copy of
    ``stock_pkg``, built once per key. PatchsetError if the stock install is
    not the pinned base (changed underneath, or another vLLM). ``log`` (default:
    stderr; never stdout, which callers such as guard_table.py print to)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    ps, stock_pkg = ps or Patchset.load(), Path(stock_pkg).resolve()
    final = Path(cache_root) / _key(stock_pkg, ps)
    for old in Path(cache_root).glob("*"):
        with contextlib.suppress(OSError):
            if old != final and time.time() - old.stat().st_mtime > MAX_AGE_S:
                shutil.rmtree(old)
    with contextlib.suppress(PatchsetError):
        if patchset.inspect_tree(final, ps).state == "applied":
            os.utime(final)  # its last use, for the pruning above
            return final
    shutil.rmtree(final, ignore_errors=True)
    if (st := patchset.inspect_tree(stock_pkg.parent, ps)).state == "wrong-base":
        raise PatchsetError(f"{stock_pkg}: no overlay of this vllm:\n{st.describe()}")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        shutil.copytree(stock_pkg, tmp / "vllm", copy_function=_link)
        patchset.apply(tmp, ps, log=lambda _: None)
        tmp.chmod(0o755)
        os.rename(tmp, final)  # fails if a concurrent run was first: use its
    except OSError:
        if not (final / "vllm").is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"built vllm overlay {final} (patched hard-link copy of {stock_pkg})")
    return final


def import_patched(tool: str, *, cpu: bool = False) -> str:
    """Makes ``import vllm`` give the patched vLLM in a tool's process, as the
    root conftest does: the kernel-only shim with ``KPOOL_KERNEL_ONLY=1``
    (says "kernel-only shim"), else this overlay of the installed vllm first
    on ``sys.path`` ("patched overlay"; kept where vllm is imported already).
    Without a GPU, or with ``cpu``, the stock Triton kernels run interpreted
    and the CuTe DSL compiles for sm_90a."""
    no_gpu = shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl")
    if cpu or no_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    if str(patchset.REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(patchset.REPO_ROOT))
    from tools.kernel_env.shim import install_from_env

    if install_from_env():
        return "kernel-only shim"
    if "vllm" not in sys.modules:
        if (stock := find_installed_vllm()) is None:
            sys.exit(f"{tool}: no vllm installed; use the venv or KPOOL_KERNEL_ONLY=1")
        sys.path.insert(0, str(build_overlay(stock)))
    return "patched overlay"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    stock = find_installed_vllm()
    if stock is None:
        v = Patchset.load().version
        print(
            f"overlay: error: no vllm installed for {sys.executable}; expected "
            f"vllm=={v} (patches/base.json)",
            file=sys.stderr,
        )
        return 1
    try:
        print(build_overlay(stock))
    except PatchsetError as e:
        print(f"overlay: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
