# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The patched vLLM the tests import: an overlay of the installed stock one.

``find_installed_vllm`` locates the stock ``vllm`` package on ``sys.path``
without importing it. ``build_overlay`` makes a copy of it, as hard links,
under ``build/overlay/<key>/vllm`` and applies the patch set to the copy
(``tools/patchset.py``): patched files get new inodes, so the stock install
is never modified. The root ``conftest.py`` puts the overlay first on
``sys.path``; ``tools/kernel_env/prepare.sh`` stages from it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from tools import patchset
from tools.patchset import Log, Patchset, PatchsetError

REPO_ROOT = patchset.REPO_ROOT
OVERLAY_DIR = REPO_ROOT / "build" / "overlay"
OVERLAY_MAX_AGE_S = 6 * 3600
# What the overlay's content depends on besides the patch set and the stock
# package: the code that builds it.
_TOOLS = (Path(__file__), Path(patchset.__file__))


def find_installed_vllm(exclude: Iterable[str | os.PathLike[str]] = ()) -> Path | None:
    """The stock ``vllm`` package dir on ``sys.path``, found WITHOUT importing
    it; this repo's root, its overlays and ``exclude`` are skipped."""
    skipped = {REPO_ROOT, *(Path(p).resolve() for p in exclude)}
    paths = []
    for entry in sys.path:
        try:
            resolved = Path(entry or os.getcwd()).resolve()
        except OSError:
            continue
        if resolved in skipped or OVERLAY_DIR in resolved.parents:
            continue
        paths.append(entry or os.getcwd())
    spec = importlib.machinery.PathFinder.find_spec("vllm", paths)
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        return None  # not installed, or only a namespace portion
    return Path(spec.origin).parent


def _link_copy(src: Path, dst: Path) -> str:
    """Copy a tree as hard links, else symlinks, else real copies."""
    for flag, how in (("-al", "hard links"), ("-as", "symlinks")):
        r = subprocess.run(["cp", flag, str(src), str(dst)], capture_output=True)
        if r.returncode == 0:
            return how
        shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return "a full copy"


def _prune_overlays(cache_root: Path, keep: Path) -> None:
    if not cache_root.is_dir():
        return
    now = time.time()
    for old in cache_root.iterdir():
        with contextlib.suppress(OSError):
            if old != keep and now - old.stat().st_mtime > OVERLAY_MAX_AGE_S:
                shutil.rmtree(old)


def _overlay_key(stock_pkg: Path, ps: Patchset) -> str:
    """Changes with the patch set, the stock package (its path, dist-info
    RECORD and the touched files) and the tools that build the overlay."""
    h = hashlib.sha256(ps.digest().encode())
    h.update(str(stock_pkg).encode())
    for path in (*_TOOLS, *sorted(stock_pkg.parent.glob("vllm-*.dist-info/RECORD"))):
        h.update(path.read_bytes())
    for rel in ps.touched:
        with contextlib.suppress(FileNotFoundError):
            h.update((stock_pkg.parent / rel).read_bytes())
    return h.hexdigest()[:16]


def build_overlay(
    stock_pkg: str | os.PathLike[str],
    cache_root: str | os.PathLike[str] = OVERLAY_DIR,
    ps: Patchset | None = None,
    *,
    log: Log = print,
) -> Path:
    """A patched copy of the installed stock package, cached under
    ``cache_root/<key>/vllm`` (see ``_overlay_key``). Files are hard links to
    the stock ones until the patch set replaces them, so the stock install is
    never modified. Overlays unused for ``OVERLAY_MAX_AGE_S`` are deleted.
    Returns the dir to put on ``sys.path``; PatchsetError if the stock
    package is not the pinned base."""
    ps = ps or Patchset.load()
    stock_pkg = Path(stock_pkg).resolve()
    final = Path(cache_root) / _overlay_key(stock_pkg, ps)
    _prune_overlays(Path(cache_root), keep=final)
    if (final / "vllm").is_dir():
        with contextlib.suppress(PatchsetError):
            if patchset.inspect_tree(final, ps).state == "applied":
                os.utime(final)  # last use, for pruning
                return final
        shutil.rmtree(final)
    st = patchset.inspect_tree(stock_pkg.parent, ps)
    if st.state not in ("base", "applied"):
        raise PatchsetError(f"{stock_pkg}: no overlay of this vllm: {st.describe()}")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        how = _link_copy(stock_pkg, tmp / "vllm")
        patchset.apply(tmp, ps, log=lambda _: None)
        tmp.chmod(0o755)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "vllm").is_dir():
                raise
            shutil.rmtree(tmp)  # a concurrent run built it first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"built vllm overlay {final} ({how} of {stock_pkg}, patch set applied)")
    return final
