# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/build_wheel.py: the fork wheel builds from the stock wheel, carries
the patch set, installs with pip into a fresh venv, and its RECORD is right
(slow: a 336 MB unpack/repack/install, deselect locally with -m 'not slow');
a wrong stock wheel is refused saying which it is; the repack's progress line
names the member being compressed."""

from __future__ import annotations

import ast
import base64
import csv
import hashlib
import os
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tools import build_wheel, patchset
from tools.patchset import PatchsetError

KPOOL = "vllm/models/glm5next/nvidia/ops/kpool_compress.py"
BASE = patchset.Patchset.load()
TAGS = "-".join(str(BASE.base["wheel"]).removesuffix(".whl").split("-")[-3:])
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory, stock_wheel, repo_ps):
    """(fork wheel, its unpacked tree) built from the cached stock wheel."""
    tmp = tmp_path_factory.mktemp("build")
    whl = build_wheel.build(
        stock_wheel,
        build_dir=tmp / "build",
        dist_dir=tmp / "dist",
        keep_unpacked=True,
        log=lambda _: None,
    )
    return whl, tmp / "build" / f"vllm-{repo_ps.base['vllm_version']}"


@pytest.fixture(scope="module")
def patched(stock_wheel, repo_ps) -> dict[str, bytes]:
    """What the fork's files must hold: patched stock files and added files."""
    base = patchset.stock_files(repo_ps, wheel=stock_wheel)
    files = patchset._patch_contents(base, repo_ps)
    files.update({rel: src.read_bytes() for rel, src in repo_ps.added.items()})
    return files


@slow
def test_wheel_name_and_metadata(built, repo_ps):
    whl, _ = built
    version = f"{repo_ps.version}+glm5next.kpool{len(repo_ps.patches)}"
    assert build_wheel.fork_version(repo_ps) == version
    assert whl.name == f"vllm-{version}-{TAGS}.whl"
    with zipfile.ZipFile(whl) as zf:
        names = set(zf.namelist())
        info = f"vllm-{version}.dist-info"
        assert {f"{info}/METADATA", f"{info}/WHEEL", f"{info}/RECORD"} <= names
        assert not any(
            n.startswith(f"vllm-{repo_ps.version}.dist-info/") for n in names
        )
        metadata = zf.read(f"{info}/METADATA").decode()
        assert re.search(rf"^Version: {re.escape(version)}$", metadata, re.M)
        assert metadata.count("\nVersion:") == 1
        assert re.findall(r"^Tag: (.+)$", zf.read(f"{info}/WHEEL").decode(), re.M) == [
            TAGS
        ]


@slow
def test_wheel_record_matches_every_member(built):
    whl, _ = built
    from wheel.wheelfile import WheelFile  # verifies RECORD hashes while reading

    with WheelFile(whl) as wf:
        for info in wf.infolist():
            with wf.open(info) as f:
                while f.read(1 << 24):
                    pass


@slow
def test_wheel_carries_the_patch_set(built, patched):
    whl, _ = built
    with zipfile.ZipFile(whl) as zf:
        for rel, data in patched.items():
            assert zf.read(rel) == data, rel
        assert not [n for n in zf.namelist() if "__pycache__" in n]


@slow
def test_full_unpack_check_revert_apply(built, repo_ps, stock_wheel):
    """The builder's full `wheel unpack` tree: applied; reverts to the exact
    stock bytes; applies again."""
    _, tree = built
    assert patchset.inspect_tree(tree, repo_ps).state == "applied"
    assert patchset.revert(tree, repo_ps, log=lambda _: None)
    stock = patchset.read_wheel_files(stock_wheel, repo_ps.touched)
    for rel, data in stock.items():
        assert (tree / rel).read_bytes() == data
    for rel in repo_ps.added:
        assert not (tree / rel).exists()
    assert patchset.apply(tree, repo_ps, log=lambda _: None)
    assert not patchset.apply(tree, repo_ps, log=lambda _: None)


def _record_problems(site: Path, dist_info: Path) -> list[str]:
    problems, listed = [], set()
    with open(dist_info / "RECORD", newline="") as f:
        for path, digest, size in csv.reader(f):
            full = (site / path).resolve()
            listed.add(full)
            if not digest:
                continue
            algo, _, want = digest.partition("=")
            data = full.read_bytes()
            got = base64.urlsafe_b64encode(hashlib.new(algo, data).digest())
            if got.rstrip(b"=").decode() != want or int(size) != len(data):
                problems.append(f"{path}: RECORD {digest} {size}, file differs")
    on_disk = {p.resolve() for p in (site / "vllm").rglob("*") if p.is_file()}
    problems += [f"{p}: not in RECORD" for p in sorted(on_disk - listed)]
    return problems


@slow
def test_pip_install_into_fresh_venv(built, repo_ps, patched, tmp_path):
    whl, _ = built
    venv.create(tmp_path / "venv", with_pip=True, system_site_packages=False)
    py = str(tmp_path / "venv" / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}

    def pip(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [py, "-m", "pip", "--disable-pip-version-check", *args],
            capture_output=True,
            text=True,
            env=env,
        )
        assert not ok or r.returncode == 0, r.stdout + r.stderr
        return r

    pip("install", "--no-deps", "--no-compile", str(whl))
    version = build_wheel.fork_version(repo_ps)
    assert f"Version: {version}" in pip("show", "vllm").stdout

    # pip check: the metadata parses; only the deps we left out are missing.
    r = pip("check", ok=False)
    lines = r.stdout.strip().splitlines()
    assert lines and all(
        re.fullmatch(
            rf"vllm {re.escape(version)} requires \S+, which is not installed\.", x
        )
        for x in lines
    ), r.stdout

    out = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    site = Path(out.stdout.strip())
    assert _record_problems(site, site / f"vllm-{version}.dist-info") == []

    # The installed tree carries the patch set (checked without importing).
    for rel, data in patched.items():
        assert (site / rel).read_bytes() == data, rel
    fn = next(
        node
        for node in ast.walk(ast.parse((site / KPOOL).read_text()))
        if isinstance(node, ast.FunctionDef)
        and node.name == "expand_pools_and_append_tail"
    )
    assert [a.arg for a in fn.args.kwonlyargs] == ["seq_offset", "out"]
    assert [ast.literal_eval(d) for d in fn.args.kw_defaults] == [0, None]
    assert patchset.inspect_tree(site, repo_ps).state == "applied"

    pip("uninstall", "-y", "vllm")
    assert not (site / "vllm").exists()
    assert not list(site.glob("vllm-*.dist-info"))


def test_setup_py_delegates(tmp_path):
    r = subprocess.run(
        [sys.executable, str(patchset.REPO_ROOT / "setup.py"), "install"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "bdist_wheel" in r.stderr
    r = subprocess.run(
        [sys.executable, str(patchset.REPO_ROOT / "setup.py"), "bdist_wheel", "--help"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "--wheel" in r.stdout


def _fake_wheel(path: Path, version: str) -> Path:
    """A zip that names itself vLLM ``version`` in its file name and dist-info."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"vllm-{version}.dist-info/METADATA", f"Version: {version}\n")
        zf.writestr(KPOOL, "# not the pinned file\n")
    return path


def test_another_version_is_named(tmp_path, repo_ps):
    v = repo_ps.version
    fake = _fake_wheel(tmp_path / f"vllm-0.32.0-{TAGS}.whl", "0.32.0")
    with pytest.raises(PatchsetError) as e:
        build_wheel.verify(repo_ps, fake)
    assert str(e.value).startswith(
        f"{fake}: this is vLLM 0.32.0 (from vllm-0.32.0.dist-info), not vLLM {v}, "
        f"the base the patch set is pinned to ({repo_ps.base_json}). Use "
        f"{repo_ps.base['wheel']} (`make fetch` downloads it into build/cache/)"
    )
    tool = str(patchset.REPO_ROOT / "tools" / "build_wheel.py")
    r = subprocess.run(
        [
            sys.executable,
            tool,
            "--wheel",
            str(fake),
            "--build-dir",
            str(tmp_path / "b"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"build_wheel: error: {fake}: this is vLLM 0.32.0")
    assert not (tmp_path / "b").exists()  # refused before unpacking


def test_another_build_of_the_base_is_named(tmp_path, repo_ps):
    fake = _fake_wheel(tmp_path / str(repo_ps.base["wheel"]), repo_ps.version)
    with pytest.raises(PatchsetError) as e:
        build_wheel.verify(repo_ps, fake)
    found = patchset.sha256_file(fake)
    assert str(e.value) == (
        f"{fake}: expected base wheel sha256 {repo_ps.base['wheel_sha256']} "
        f"({repo_ps.base_json}), found {found}: it is vLLM {repo_ps.version}, but "
        f"another build of it or a damaged download. Use {repo_ps.base['wheel']}: "
        "delete this one and run `make fetch`, or pass the pinned wheel with --wheel."
    )


def test_pack_progress_names_the_member(tmp_path, monkeypatch):
    """While one large member is compressed (no output grows), every beat
    says which member and how far the pack is."""
    tree = tmp_path / "unpacked"
    info = tree / "vllm-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Name: vllm\nVersion: 1.0\n")
    (info / "WHEEL").write_text("Wheel-Version: 1.0\nTag: py3-none-any\n")
    (tree / "vllm").mkdir()
    (tree / "vllm" / "big.so").write_bytes(os.urandom(24 << 20))
    (tree / "vllm" / "small.py").write_text("X = 1\n")
    monkeypatch.setattr(build_wheel, "HEARTBEAT_S", 0.02)
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    lines: list[str] = []
    out = build_wheel.pack(
        tree, tmp_path / "vllm-1.0-py3-none-any.whl", 0, lines.append
    )
    assert "SOURCE_DATE_EPOCH" not in os.environ
    beat = re.compile(
        r"    \.\.\. wheel pack: \d+ s, 0 of 24 MB packed \(0 of 4 files\), "
        r"compressing vllm/big\.so \(24\.0 MB\)"
    )
    assert any(beat.fullmatch(line) for line in lines), lines
    from wheel.wheelfile import WheelFile

    with WheelFile(out) as wf:
        assert wf.read("vllm/small.py") == b"X = 1\n"  # RECORD checked on read
        assert {i.date_time for i in wf.infolist()} == {(1980, 1, 1, 0, 0, 0)}
