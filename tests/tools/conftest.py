# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures for the patch tooling tests: the stock wheel, trimmed vLLM trees
(unpacked-wheel subset, site-packages copy) and a synthetic fork whose added
files exercise new directories."""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import pytest

from tools import overlay, patchset

# A synthetic fork: the repo's patches plus added files in new directories.
FORK_FILES = {
    "vllm/models/glm5next/nvidia/specialized_decode/__init__.py": b'"""fork."""\n',
    "vllm/models/glm5next/nvidia/specialized_decode/kpool.py": b"X = 1\n",
    "vllm/models/glm5next/nvidia/specialized_decode/sub/deep.py": b"Y = 2\n",
}


@pytest.fixture(scope="session")
def repo_ps() -> patchset.Patchset:
    return patchset.Patchset.load()


@pytest.fixture(scope="session")
def stock_wheel(repo_ps) -> Path:
    """The pinned stock wheel: $KPOOL_STOCK_WHEEL, else build/cache/<wheel>
    (`make test` fetches it and sets KPOOL_REQUIRE_WHEEL=1: then it must be
    there)."""
    path = Path(os.environ.get("KPOOL_STOCK_WHEEL") or patchset.default_wheel(repo_ps))
    if not path.is_file():
        msg = f"{path}: stock wheel missing; `make test` fetches it into build/cache"
        if os.environ.get("KPOOL_REQUIRE_WHEEL") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def _needed(ps: patchset.Patchset) -> tuple[set[str], set[str]]:
    """What a test tree needs: the touched files, and the dirs added files go
    into (``vllm/<a>/<b>/`` for deep paths, else their parent)."""
    dirs = {
        "/".join(rel.split("/")[: min(3, rel.count("/"))]) + "/" for rel in ps.added
    }
    return set(ps.touched), dirs


def extract_subset(wheel: Path, dest: Path, ps: patchset.Patchset) -> Path:
    """Unpack the part of ``wheel`` the patch set needs (plus vllm/__init__.py
    and the dist-info) into ``dest``; returns ``dest``."""
    files, dirs = _needed(ps)
    prefixes = (*files, *dirs, "vllm/__init__.py", "vllm-")
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.startswith(prefixes)]
        zf.extractall(dest, members)
    return dest


def make_fork(root: Path, files=FORK_FILES) -> Path:
    shutil.copytree(patchset.REPO_ROOT / "patches", root / "patches")
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


@pytest.fixture
def fork_ps(tmp_path) -> patchset.Patchset:
    return patchset.Patchset.load(make_fork(tmp_path / "fork"))


@pytest.fixture
def wheel_tree(tmp_path, stock_wheel, repo_ps, fork_ps) -> Path:
    """A base tree unpacked from the stock wheel (the parts needed)."""
    dest = tmp_path / "wheel"
    extract_subset(stock_wheel, dest, repo_ps)
    extract_subset(stock_wheel, dest, fork_ps)
    return dest


@pytest.fixture
def site_tree(tmp_path, repo_ps, fork_ps) -> Path:
    """A copy of the installed site-packages, trimmed to the dirs the patch
    set needs, with its __pycache__ dirs and the vllm dist-info."""
    stock = overlay.find_installed_vllm()
    if stock is None:
        pytest.skip("vllm is not installed in this interpreter")
    site, dest = stock.parent, tmp_path / "site-packages"
    (files, dirs), (files2, dirs2) = _needed(repo_ps), _needed(fork_ps)
    files, dirs = files | files2, dirs | dirs2
    for rel in dirs:
        shutil.copytree(site / rel, dest / rel, dirs_exist_ok=True)
    for rel in (*files, "vllm/__init__.py"):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(site / rel, dest / rel)
    for info in site.glob("vllm-*.dist-info"):
        shutil.copytree(info, dest / info.name)
    return dest


def snapshot(root: Path) -> dict[str, object]:
    """Every file's bytes and mode, and every dir, under ``root``."""
    out: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = (path.read_bytes(), path.stat().st_mode)
    return out


@pytest.fixture
def snap():
    """``snap(root)``: a comparable snapshot of a tree (see ``snapshot``)."""
    return snapshot


@pytest.fixture
def new_fork(tmp_path):
    """``new_fork(name, files)``: a synthetic fork repo with the repo's
    patches and ``files`` ({"vllm/...": bytes}) under ``tmp_path/name``."""
    return lambda name, files=FORK_FILES: make_fork(tmp_path / name, files)


@pytest.fixture
def unpack_subset(tmp_path, stock_wheel, repo_ps):
    """``unpack_subset(name, ps)``: a fresh base tree from the stock wheel."""
    return lambda name, ps: extract_subset(
        stock_wheel, extract_subset(stock_wheel, tmp_path / name, repo_ps), ps
    )
