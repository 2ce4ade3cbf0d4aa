# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/build_wheel.py: the fork wheel's name, metadata, RECORD and content,
reproducibility (on a small stock wheel pinned for the test), the refusal of
a wrong stock wheel, setup.py; slow: the real wheel, pip-installed into a
fresh venv and back to the stock wheel (deselect locally with -m 'not
slow')."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tools import build_wheel, patchset

KPOOL = "vllm/models/glm5next/nvidia/ops/kpool_compress.py"
SO = "vllm/_C.abi3.so"
CONFIG = "vllm/configs/E=1,N=14336.json"  # a comma: RECORD quotes the name
NEW = "vllm/models/glm5next/nvidia/specialized_decode"  # the files the fork adds
TOOL = [sys.executable, str(patchset.REPO_ROOT / "tools" / "build_wheel.py")]


def record_problems(wheel: Path) -> list[str]:
    """What RECORD gets wrong: a member it lacks, a wrong sha256 or size."""
    with zipfile.ZipFile(wheel) as zf:
        (record,) = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
        rows = {r[0]: r[1:] for r in csv.reader(io.StringIO(zf.read(record).decode()))}
        problems = [f"{n}: not in RECORD" for n in zf.namelist() if n not in rows]
        for name, (digest, size) in rows.items():
            if name != record:
                data = zf.read(name)
                sha = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
                if digest != f"sha256={sha.decode().rstrip('=')}" or int(size) != len(
                    data
                ):
                    problems.append(f"{name}: RECORD says {digest} {size}")
    return problems


@pytest.fixture
def small(tmp_path, stock_wheel, repo_ps, new_fork):
    """(fork root, stock wheel): a fork pinned to a small stock wheel, the
    real one's touched files and dist-info plus an executable .so."""
    small = tmp_path / "stock" / stock_wheel.name
    small.parent.mkdir()
    with zipfile.ZipFile(stock_wheel) as src, zipfile.ZipFile(small, "w") as dst:
        for info in src.infolist():
            if info.filename in repo_ps.touched or ".dist-info/" in info.filename:
                dst.writestr(info, src.read(info))
        so = zipfile.ZipInfo(SO, (2026, 1, 2, 3, 4, 6))
        so.external_attr = 0o100755 << 16
        dst.writestr(so, b"\x7fELF" * 1000)
        dst.writestr(CONFIG, b"{}\n")
    root = new_fork("fork")
    patchset.pin(small, root, log=lambda _: None)
    return root, small


def test_fork_wheel_is_the_stock_wheel_with_the_patch_set(small, tmp_path):
    root, stock = small
    ps = patchset.Patchset.load(root)
    one = build_wheel.build(stock, root=root, dist_dir=tmp_path / "d1", log=print)
    two = build_wheel.build(stock, root=root, dist_dir=tmp_path / "d2", log=print)
    assert one.read_bytes() == two.read_bytes()  # reproducible
    version = f"{ps.version}+glm5next.kpool{len(ps.patches)}"
    assert build_wheel.fork_version(ps) == version
    assert one.name == stock.name.replace(f"-{ps.version}-", f"-{version}-")
    assert record_problems(one) == []
    base = patchset.stock_files(ps, wheel=stock)
    want = {**patchset.patched_files(ps, base)}
    want.update({rel: (root / rel).read_bytes() for rel in ps.added})
    with zipfile.ZipFile(one) as zf, zipfile.ZipFile(stock) as src:
        names = zf.namelist()
        assert {n for n in names if ".dist-info/" not in n} == {*want, SO, CONFIG}
        for rel, data in want.items():
            assert zf.read(rel) == data, rel
        assert zf.getinfo(SO).external_attr == 0o100755 << 16
        assert zf.getinfo(SO).date_time == (2026, 1, 2, 3, 4, 6)
        infos = [n for n in names if ".dist-info/" in n]
        assert infos == sorted(infos, key=lambda n: n.endswith("RECORD"))  # last
        assert names[-len(infos) :] == infos  # the dist-info after the package
        assert {n.split("/")[0] for n in infos} == {f"vllm-{version}.dist-info"}
        meta = zf.read(f"vllm-{version}.dist-info/METADATA").decode()
        old = src.read(f"vllm-{ps.version}.dist-info/METADATA").decode()
        assert meta == old.replace(f"Version: {ps.version}\n", f"Version: {version}\n")


def test_wrong_stock_wheels_are_named(tmp_path, repo_ps, stock_wheel):
    """Another version, or another build of the base: both versions, both sha256."""
    for version in ("0.32.0", repo_ps.version):
        other = tmp_path / version / stock_wheel.name.replace(repo_ps.version, version)
        other.parent.mkdir()
        with zipfile.ZipFile(other, "w") as zf:
            zf.writestr(f"vllm-{version}.dist-info/METADATA", f"Version: {version}\n")
        dist = tmp_path / version / "dist"
        r = subprocess.run(
            [*TOOL, "--wheel", str(other), "-d", str(dist)],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 1 and not dist.exists()  # refused before building
        assert r.stderr == (
            f"build_wheel: error: {other}: vLLM {version}, sha256 "
            f"{patchset.sha256(other.read_bytes())}; expected the pinned "
            f"{repo_ps.base['wheel']}: vLLM {repo_ps.version}, sha256 "
            f"{repo_ps.base['wheel_sha256']} (`make fetch` gets it; to move the fork "
            f'to another vLLM, see CONTRIBUTING.md, "Rebasing onto a newer vLLM")\n'
        )


def test_fetch_only_verifies_the_given_wheel(stock_wheel):
    r = subprocess.run(
        [*TOOL, "--fetch-only", "--wheel", str(stock_wheel)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and r.stdout == f"stock wheel ok: {stock_wheel}\n"


def test_setup_py_delegates_bdist_wheel_only():
    setup = [sys.executable, str(patchset.REPO_ROOT / "setup.py")]
    r = subprocess.run([*setup, "install"], capture_output=True, text=True)
    assert r.returncode == 2 and "bdist_wheel" in r.stderr
    r = subprocess.run(
        [*setup, "bdist_wheel", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "--wheel" in r.stdout and "--dist-dir" in r.stdout


@pytest.mark.slow
def test_fork_wheel_installs_into_a_fresh_venv_and_back(tmp_path, repo_ps, stock_wheel):
    """The fork wheel pip-installed over nothing, its modules imported (their
    bytecode written); the way back (the stock wheel force-reinstalled)
    leaves the base and no fork file; ``pip uninstall`` then leaves nothing.
    (pip removes the bytecode of the interpreter's default optimization
    level only, for every package.)"""
    whl = build_wheel.build(stock_wheel, dist_dir=tmp_path / "dist", log=print)
    assert record_problems(whl) == []
    venv.create(tmp_path / "venv", with_pip=True)
    py = str(tmp_path / "venv" / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([py, *args], capture_output=True, text=True, env=env)

    pip = ("-m", "pip", "--disable-pip-version-check")
    r = run(*pip, "install", "--no-deps", str(whl))
    assert r.returncode == 0, r.stdout + r.stderr
    version = build_wheel.fork_version(repo_ps)
    assert f"Version: {version}\n" in run(*pip, "show", "vllm").stdout
    missing = run(*pip, "check").stdout.splitlines()  # only the deps left out
    pattern = rf"vllm {re.escape(version)} requires \S+, which is not installed\."
    assert missing and all(re.fullmatch(pattern, line) for line in missing)
    site = Path(
        run(
            "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        ).stdout.strip()
    )
    assert patchset.inspect_tree(site, repo_ps).state == "applied"
    compiled = run("-m", "compileall", "-q", str(site / NEW))  # as imports do
    assert compiled.returncode == 0, compiled.stderr

    r = run(*pip, "install", "--force-reinstall", "--no-deps", str(stock_wheel))
    assert r.returncode == 0, r.stdout + r.stderr
    assert patchset.inspect_tree(site, repo_ps).state == "base"
    assert not (site / NEW).exists()
    assert f"Version: {repo_ps.version}\n" in run(*pip, "show", "vllm").stdout
    assert run(*pip, "uninstall", "-y", "vllm").returncode == 0
    assert not (site / "vllm").exists() and not list(site.glob("vllm-*.dist-info"))
