# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures for the patch tooling tests: the pinned stock wheel, small vLLM
trees cut from it or from the installed site-packages, and a synthetic fork
(the repo's patches, added files in new dirs)."""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import pytest

from tools import overlay, patchset

NEW_DIR = "vllm/models/glm5next/nvidia/specialized_decode"
FORK_FILES = {
    f"{NEW_DIR}/__init__.py": b'"""fork."""\n',
    f"{NEW_DIR}/kpool.py": b"X = 1\n",
    f"{NEW_DIR}/sub/__init__.py": b"",
    f"{NEW_DIR}/sub/deep.py": b"Y = 2\n",
}


def make_fork(root: Path, files: dict[str, bytes] = FORK_FILES) -> Path:
    shutil.copytree(patchset.REPO_ROOT / "patches", root / "patches")
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def snapshot(root: Path) -> dict[str, object]:
    """Every dir, and every file's bytes and mode, under ``root``."""
    return {
        p.relative_to(root).as_posix(): "dir"
        if p.is_dir()
        else (p.read_bytes(), p.stat().st_mode)
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="session")
def repo_ps() -> patchset.Patchset:
    return patchset.Patchset.load()


@pytest.fixture(scope="session")
def stock_wheel(repo_ps) -> Path:
    """$KPOOL_STOCK_WHEEL, else the cached pinned wheel (`make test` fetches it
    and sets KPOOL_REQUIRE_WHEEL=1: then it must be there)."""
    path = Path(os.environ.get("KPOOL_STOCK_WHEEL") or patchset.default_wheel(repo_ps))
    if not path.is_file():
        msg = f"{path}: stock wheel missing; `make fetch` puts it in build/cache"
        if os.environ.get("KPOOL_REQUIRE_WHEEL") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture
def fork_ps(tmp_path) -> patchset.Patchset:
    return patchset.Patchset.load(make_fork(tmp_path / "fork"))


@pytest.fixture
def unpack(tmp_path, stock_wheel, repo_ps):
    """``unpack(name)``: a base tree of the touched files, vllm/__init__.py and
    the dist-info, from the stock wheel."""

    def unpack(name: str = "wheel") -> Path:
        with zipfile.ZipFile(stock_wheel) as zf:
            keep = (*repo_ps.touched, "vllm/__init__.py", "vllm-")
            zf.extractall(
                tmp_path / name, [n for n in zf.namelist() if n.startswith(keep)]
            )
        return tmp_path / name

    return unpack


@pytest.fixture
def wheel_tree(unpack) -> Path:
    return unpack()


@pytest.fixture
def site_tree(tmp_path, repo_ps) -> Path:
    """The installed site-packages, trimmed: the touched files, the dir the
    fork adds to (with its __pycache__ dirs), vllm/__init__.py, the dist-info."""
    if (stock := overlay.find_installed_vllm()) is None:
        pytest.skip("vllm is not installed in this interpreter")
    site, dest = stock.parent, tmp_path / "site-packages"
    shutil.copytree(site / "vllm/models/glm5next", dest / "vllm/models/glm5next")
    for rel in (*repo_ps.touched, "vllm/__init__.py"):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(site / rel, dest / rel)
    for info in site.glob("vllm-*.dist-info"):
        shutil.copytree(info, dest / info.name)
    return dest


@pytest.fixture
def snap():
    """``snap(root)``: see ``snapshot``."""
    return snapshot


@pytest.fixture
def new_fork(tmp_path):
    """``new_fork(name, files)``: the repo's patches plus ``files`` under vllm/."""
    return lambda name, files=FORK_FILES: make_fork(tmp_path / name, files)
