# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/patchset.py: apply / check / revert / diff / pin / new on vLLM trees
given as an unpacked wheel, a site-packages copy and a git checkout; the
messages of every refusal (what was found, what was expected, what to do);
tools/overlay.py: the test overlay."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tools import overlay, patchset
from tools.patchset import PatchsetError

KPOOL = "vllm/models/glm5next/nvidia/ops/kpool_compress.py"
CLI = [sys.executable, str(patchset.REPO_ROOT / "tools" / "patchset.py")]
NEW_DIR = "vllm/models/glm5next/nvidia/specialized_decode"


def quiet(_msg: str) -> None:
    pass


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(cwd.parent)}
    cfg = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=m"]
    r = subprocess.run(
        ["git", *cfg, *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True)


def make_patch(tmp: Path, rel: str, old: bytes, new: bytes, header: str) -> str:
    """A one-file patch in the series' format (``a/vllm/...``, ``b/vllm/...``)."""
    for side, data in (("a", old), ("b", new)):
        (tmp / side / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / side / rel).write_bytes(data)
    r = subprocess.run(
        ["git", "diff", "--no-index", "--src-prefix=", "--dst-prefix="]
        + [f"a/{rel}", f"b/{rel}"],
        cwd=tmp,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1, r.stderr
    return f"# {header}\n#\n# Why: a test.\n\n{r.stdout}"


def set_series(root: Path, *names: str) -> None:
    (root / "patches" / "series").write_text("".join(f"{n}\n" for n in names))


# -- the repo's patch set -----------------------------------------------------


def test_repo_patch_set_is_pinned(repo_ps, stock_wheel):
    assert repo_ps.version == repo_ps.base["vllm_version"]
    assert repo_ps.base["wheel"] == stock_wheel.name
    assert stock_wheel.name.startswith(f"vllm-{repo_ps.version}-")
    assert patchset.wheel_version(stock_wheel)[0] == repo_ps.version
    assert KPOOL in repo_ps.touched
    assert set(repo_ps.base_files) == set(repo_ps.touched)
    assert "vllm/__init__.py" not in repo_ps.added
    base = patchset.stock_files(repo_ps, wheel=stock_wheel)
    patched = patchset._patch_contents(base, repo_ps)
    assert all(patched[rel] != base[rel] for rel in repo_ps.touched)
    assert b"seq_offset: int = 0" in patched[KPOOL]


def test_pin_reproduces_base_json(tmp_path, repo_ps, stock_wheel):
    root = tmp_path / "fork"
    (root / "patches").mkdir(parents=True)
    for patch in repo_ps.patches:
        (root / "patches" / patch.name).write_bytes(patch.read_bytes())
    (root / "patches" / "series").write_bytes(
        (patchset.REPO_ROOT / "patches" / "series").read_bytes()
    )
    with pytest.raises(PatchsetError, match="base.json: missing"):
        patchset.Patchset.load(root)
    patchset.pin(stock_wheel, root, log=quiet)
    assert (root / "patches" / "base.json").read_bytes() == (
        patchset.REPO_ROOT / "patches" / "base.json"
    ).read_bytes()


def test_apply_check_revert_repo_patch_set(wheel_tree, repo_ps, snap):
    before = snap(wheel_tree)
    assert patchset.inspect_tree(wheel_tree, repo_ps).state == "base"
    assert patchset.apply(wheel_tree, repo_ps, log=quiet) is True
    st = patchset.inspect_tree(wheel_tree, repo_ps)
    assert st.state == "applied", st.describe()
    for rel, src in repo_ps.added.items():
        assert (wheel_tree / rel).read_bytes() == src.read_bytes()
    assert patchset.revert(wheel_tree, repo_ps, log=quiet) is True
    assert snap(wheel_tree) == before


# -- a synthetic fork with added files in new dirs ----------------------------


@pytest.mark.parametrize("kind", ["wheel", "site-packages"])
def test_apply_check_revert(kind, request, fork_ps, snap):
    tree = request.getfixturevalue("wheel_tree" if kind == "wheel" else "site_tree")
    before = snap(tree)
    assert not (tree / NEW_DIR).exists()
    st = patchset.inspect_tree(tree, fork_ps)
    assert st.state == "base" and {f.state for f in st.files} == {"base", "missing"}

    assert patchset.apply(tree, fork_ps, log=quiet) is True
    st = patchset.inspect_tree(tree, fork_ps)
    assert st.state == "applied", st.describe()
    assert (tree / KPOOL).read_bytes() == st.patched_content[KPOOL]
    for rel, src in fork_ps.added.items():
        assert (tree / rel).read_bytes() == src.read_bytes()
    # The stock file's mode is kept.
    assert (tree / KPOOL).stat().st_mode == before[KPOOL][1]

    # Bytecode left by an import of the added modules goes with them.
    cache = tree / NEW_DIR / "sub" / "__pycache__"
    cache.mkdir()
    (cache / "deep.cpython-311.pyc").write_bytes(b"pyc")
    assert patchset.revert(tree, fork_ps, log=quiet) is True
    assert snap(tree) == before
    assert patchset.inspect_tree(tree, fork_ps).state == "base"


def test_apply_twice_says_already_applied(wheel_tree, fork_ps, snap):
    assert patchset.apply(wheel_tree, fork_ps, log=quiet)
    stats = {p: p.stat() for p in wheel_tree.rglob("*")}
    before = snap(wheel_tree)
    messages: list[str] = []
    assert patchset.apply(wheel_tree, fork_ps, log=messages.append) is False
    assert messages == [f"{wheel_tree}: patch set already applied; nothing written"]
    assert snap(wheel_tree) == before
    for path, st in stats.items():  # not even rewritten with the same bytes
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == (
            st.st_ino,
            st.st_mtime_ns,
        )


def test_revert_of_base_tree_writes_nothing(wheel_tree, fork_ps, snap):
    before = snap(wheel_tree)
    messages: list[str] = []
    assert patchset.revert(wheel_tree, fork_ps, log=messages.append) is False
    assert "already at the base" in messages[0]
    assert snap(wheel_tree) == before


@pytest.mark.parametrize("applied_first", [False, True])
def test_wrong_base_is_refused(wheel_tree, fork_ps, snap, applied_first):
    if applied_first:
        patchset.apply(wheel_tree, fork_ps, log=quiet)
    path = wheel_tree / KPOOL
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01  # one byte
    path.write_bytes(bytes(data))
    found = patchset.sha256_bytes(bytes(data))
    expected = fork_ps.base_files[KPOOL]
    before = snap(wheel_tree)
    for op in (patchset.apply, patchset.revert):
        with pytest.raises(PatchsetError) as e:
            op(wheel_tree, fork_ps, log=quiet)
        msg = str(e.value)
        assert KPOOL in msg and expected in msg and found in msg
        assert f"expected base sha256 {expected}, found {found}" in msg
        assert snap(wheel_tree) == before
    r = run_cli("--root", str(fork_ps.root), "apply", str(wheel_tree))
    assert r.returncode == 1 and expected in r.stderr and found in r.stderr
    assert snap(wheel_tree) == before


def test_patched_other_base_is_refused(wheel_tree, fork_ps):
    """A file that is the series applied to ANOTHER base (a byte changed far
    from every hunk) reverse-applies cleanly but is still not our base."""
    patchset.apply(wheel_tree, fork_ps, log=quiet)
    path = wheel_tree / KPOOL
    data = path.read_bytes()
    assert data.startswith(b"# SPDX-License-Identifier: Apache-2.0")
    path.write_bytes(data.replace(b"# SPDX", b"# spdx", 1))
    with pytest.raises(PatchsetError, match="neither the pinned base") as e:
        patchset.revert(wheel_tree, fork_ps, log=quiet)
    assert f"expected base sha256 {fork_ps.base_files[KPOOL]}" in str(e.value)


def test_hand_edit_in_applied_tree_says_how_to_recover(
    wheel_tree, fork_ps, snap, stock_wheel
):
    """Found: which file changed and that the rest is applied; expected: the
    base or the patch set on it; what to do: make it a patch, or restore and
    apply again. Following the hint gives an applied tree."""
    patchset.apply(wheel_tree, fork_ps, log=quiet)
    (wheel_tree / KPOOL).write_bytes((wheel_tree / KPOOL).read_bytes() + b"# mine\n")
    before = snap(wheel_tree)
    r = run_cli("--root", str(fork_ps.root), "apply", str(wheel_tree))
    v = fork_ps.version
    n = len(fork_ps.touched) - 1
    assert r.returncode == 1 and snap(wheel_tree) == before
    assert "Traceback" not in r.stderr
    head = f"the patch set is applied here ({n} stock file(s) patched), but 1 stock"
    assert head in r.stderr
    assert "file(s) changed since: neither the pinned base" in r.stderr
    assert f"{KPOOL}: stock file, changed: expected base sha256" in r.stderr
    assert "neither the base nor the patch set applied to it" in r.stderr
    assert 'make it a patch (CONTRIBUTING.md, "Adding a patch")' in r.stderr
    assert f"pip install --force-reinstall --no-deps vllm=={v}`" in r.stderr
    assert f"unpack {fork_ps.base['wheel']} again" in r.stderr
    assert f"{NEW_DIR}/: 2 added files, present: __init__.py kpool.py\n" in r.stderr
    assert f"{NEW_DIR}/sub/deep.py: added file, present\n" in r.stderr
    assert "delete the added files marked present" in r.stderr
    assert f"then run `tools/patchset.py apply {wheel_tree}`" in r.stderr
    assert "<base>" not in r.stderr and "stock file, patched" not in r.stderr

    # Follow it: unpack the stock files again, delete the added files, apply.
    base = patchset.stock_files(fork_ps, wheel=stock_wheel)
    for rel, data in base.items():
        (wheel_tree / rel).write_bytes(data)
    shutil.rmtree(wheel_tree / NEW_DIR)
    assert patchset.apply(wheel_tree, fork_ps, log=quiet)


def _as_version(tree: Path, version: str, source: str) -> None:
    """Make ``tree`` record ``version`` in ``source`` and change its stock
    files (as another release's would be)."""
    if source == "dist-info":
        (info,) = tree.glob("vllm-*.dist-info")
        meta = info / "METADATA"
        text = re.sub(r"(?m)^Version: .*$", f"Version: {version}", meta.read_text())
        meta.write_text(text)
        info.rename(tree / f"vllm-{version}.dist-info")
    else:
        (tree / "vllm" / "_version.py").write_text(
            f"__version__ = version = '{version}'\n"
        )
    for rel in patchset.Patchset.load().touched:
        (tree / rel).write_bytes(b"# another release\n" + (tree / rel).read_bytes())


@pytest.mark.parametrize("source", ["dist-info", "_version.py"])
def test_other_vllm_version_is_named(wheel_tree, fork_ps, snap, source):
    _as_version(wheel_tree, "0.32.0", source)
    before = snap(wheel_tree)
    where = (
        "vllm-0.32.0.dist-info/METADATA"
        if source == "dist-info"
        else "vllm/_version.py"
    )
    v = fork_ps.version
    r = run_cli("--root", str(fork_ps.root), "apply", str(wheel_tree))
    assert r.returncode == 1 and snap(wheel_tree) == before
    assert (
        f"{wheel_tree}: this is vLLM 0.32.0 (from {where}), not vLLM {v}, the base "
        f"the patch set is pinned to ({fork_ps.base_json}); nothing was written"
    ) in r.stderr
    assert f"{KPOOL}: stock file, changed: expected base sha256" in r.stderr
    assert f"apply it to a vLLM {v} tree (`pip install --no-deps vllm=={v}`" in r.stderr
    assert 'see CONTRIBUTING.md, "Rebasing onto a newer vLLM"' in r.stderr


def test_other_vllm_version_wheel_is_named(tmp_path, fork_ps, stock_wheel):
    """A 0.32.0 wheel (the dist-info says so; its stock files differ)."""
    fake = tmp_path / stock_wheel.name.replace(fork_ps.version, "0.32.0")
    with zipfile.ZipFile(stock_wheel) as src, zipfile.ZipFile(fake, "w") as dst:
        for rel in fork_ps.touched:
            dst.writestr(rel, b"# 0.32.0\n" + src.read(rel))
        dst.writestr("vllm-0.32.0.dist-info/METADATA", "Name: vllm\nVersion: 0.32.0\n")
    assert patchset.wheel_version(fake) == ("0.32.0", "vllm-0.32.0.dist-info")
    with pytest.raises(PatchsetError) as e:
        patchset.stock_files(fork_ps, wheel=fake)
    assert str(e.value) == (
        f"{fake}: this is vLLM 0.32.0 (from vllm-0.32.0.dist-info), not vLLM "
        f"{fork_ps.version}, the base the patch set is pinned to "
        f"({fork_ps.base_json}). Use {fork_ps.base['wheel']} (`make fetch` "
        "downloads it into build/cache/); to move the fork to vLLM 0.32.0, see "
        'CONTRIBUTING.md, "Rebasing onto a newer vLLM".'
    )


def test_missing_stock_file_is_refused(wheel_tree, fork_ps):
    (wheel_tree / KPOOL).unlink()
    with pytest.raises(PatchsetError, match=f"{KPOOL}: stock file, missing") as e:
        patchset.apply(wheel_tree, fork_ps, log=quiet)
    msg = str(e.value)
    assert "not the pinned base" in msg and "The tree says it is vLLM" in msg
    assert f"then run `tools/patchset.py apply {wheel_tree}`" in msg


def _unpatch(tree, ps):
    base = patchset.stock_files(ps, tree=tree)
    (tree / KPOOL).write_bytes(base[KPOOL])


HALF = {
    "stock file reverted": (_unpatch, f"{KPOOL}: stock file, not patched"),
    "added file deleted": (
        lambda t, ps: (t / NEW_DIR / "kpool.py").unlink(),
        f"{NEW_DIR}/kpool.py: added file, missing",
    ),
    "added file edited": (
        lambda t, ps: (t / NEW_DIR / "kpool.py").write_bytes(b"X = 2\n"),
        f"{NEW_DIR}/kpool.py: added file, differs from the fork's copy",
    ),
}


@pytest.mark.parametrize("case", list(HALF))
def test_half_applied_tree_is_refused(wheel_tree, fork_ps, snap, case):
    patchset.apply(wheel_tree, fork_ps, log=quiet)
    damage, expected_line = HALF[case]
    damage(wheel_tree, fork_ps)
    before = snap(wheel_tree)
    for op in (patchset.apply, patchset.revert):
        with pytest.raises(PatchsetError, match="half-applied") as e:
            op(wheel_tree, fork_ps, log=quiet)
        assert expected_line in str(e.value)
        assert snap(wheel_tree) == before
    r = run_cli("--root", str(fork_ps.root), "check", str(wheel_tree))
    assert r.returncode == 1 and expected_line in r.stdout
    v = fork_ps.version
    assert f"--force-reinstall --no-deps vllm=={v}`" in r.stdout  # not vllm==<base>
    assert "<base>" not in r.stdout
    assert f"then run `tools/patchset.py apply {wheel_tree}`" in r.stdout


def test_base_tree_with_one_added_file_is_half_applied(wheel_tree, fork_ps, snap):
    target = wheel_tree / NEW_DIR / "__init__.py"
    target.parent.mkdir()
    target.write_bytes(fork_ps.added[f"{NEW_DIR}/__init__.py"].read_bytes())
    before = snap(wheel_tree)
    with pytest.raises(PatchsetError) as e:
        patchset.apply(wheel_tree, fork_ps, log=quiet)
    msg = str(e.value)
    assert (
        "half-applied" in msg and f"{NEW_DIR}/__init__.py: added file, present" in msg
    )
    assert f"{NEW_DIR}/kpool.py: added file, missing" in msg
    assert snap(wheel_tree) == before


class Interrupt(KeyboardInterrupt):
    pass


@pytest.mark.parametrize("exc", [Interrupt, OSError])
@pytest.mark.parametrize("after", [0, 1, 2, 3, "first added", "last"])
def test_interrupted_apply_leaves_tree_unchanged(
    wheel_tree, fork_ps, snap, monkeypatch, exc, after
):
    """Stock files replaced, and added files in dirs apply created (the
    first added file goes into a new dir), are all undone."""
    n_writes = len(fork_ps.touched) + len(fork_ps.added)
    after = {"first added": len(fork_ps.touched), "last": n_writes - 1}.get(
        after, after
    )
    before = snap(wheel_tree)
    place, calls = patchset._place, []

    def flaky(path, data, mode):
        if len(calls) == after:
            raise exc("interrupted")
        calls.append(path)
        place(path, data, mode)

    monkeypatch.setattr(patchset, "_place", flaky)
    raised = PatchsetError if exc is OSError else exc
    with pytest.raises(raised):
        patchset.apply(wheel_tree, fork_ps, log=quiet)
    assert len(calls) == after
    assert snap(wheel_tree) == before
    monkeypatch.undo()
    assert patchset.apply(wheel_tree, fork_ps, log=quiet) is True


@pytest.mark.parametrize("step,after", [("_place", 0), ("_remove", 0), ("_remove", 2)])
def test_interrupted_revert_leaves_tree_applied(
    wheel_tree, fork_ps, snap, monkeypatch, step, after
):
    patchset.apply(wheel_tree, fork_ps, log=quiet)
    before = snap(wheel_tree)
    real, calls = getattr(patchset, step), []

    def flaky(*args):
        if len(calls) == after:
            raise Interrupt
        calls.append(args)
        real(*args)

    monkeypatch.setattr(patchset, step, flaky)
    with pytest.raises(Interrupt):
        patchset.revert(wheel_tree, fork_ps, log=quiet)
    assert snap(wheel_tree) == before
    assert patchset.inspect_tree(wheel_tree, fork_ps).state == "applied"


def _deny(monkeypatch, after: int) -> None:
    """Make the transaction's ``after``-th write fail as on a tree owned by
    someone else (what a non-root user applying to a site-packages gets)."""
    place, calls = patchset._place, []

    def denied(path, data, mode):
        if len(calls) == after:
            tmp = path.with_name(f".{path.name}.patchset-1.tmp")
            raise PermissionError(errno.EACCES, "Permission denied", str(tmp))
        calls.append(path)
        place(path, data, mode)

    monkeypatch.setattr(patchset, "_place", denied)


@pytest.mark.parametrize("op", ["apply", "revert"])
def test_permission_denied_says_rolled_back(
    wheel_tree, fork_ps, snap, monkeypatch, capsys, op
):
    """No traceback: what failed (the file, the OS error), that the tree is
    unchanged, what was expected (write access) and what to do."""
    if op == "revert":
        patchset.apply(wheel_tree, fork_ps, log=quiet)
    before = snap(wheel_tree)
    _deny(monkeypatch, after=2)
    assert patchset.main(["--root", str(fork_ps.root), op, str(wheel_tree)]) == 1
    err = capsys.readouterr().err
    assert snap(wheel_tree) == before
    third = sorted({*fork_ps.touched})[2]
    assert err.startswith(f"patchset: error: {wheel_tree}: {op} stopped at {third}:")
    assert "Permission denied" in err and f".{Path(third).name}.patchset-1.tmp" in err
    assert "rolled back, the tree is unchanged" in err
    assert f"Expected write access to {wheel_tree / 'vllm'} and below" in err
    assert f"this process runs as uid {os.getuid()}" in err
    assert "run as the owner" in err and "Traceback" not in err


def test_interrupted_cli_says_rolled_back(
    wheel_tree, fork_ps, snap, monkeypatch, capsys
):
    before = snap(wheel_tree)

    def interrupted(path, data, mode):
        raise KeyboardInterrupt

    monkeypatch.setattr(patchset, "_place", interrupted)
    assert patchset.main(["--root", str(fork_ps.root), "apply", str(wheel_tree)]) == 130
    err = capsys.readouterr().err
    assert err == f"patchset: interrupted; rolled back, {wheel_tree} is unchanged\n"
    assert snap(wheel_tree) == before


def test_git_checkout_tree(wheel_tree, fork_ps):
    git(wheel_tree, "init", "-q")
    git(wheel_tree, "add", "-A")
    git(wheel_tree, "commit", "-qm", f"v{fork_ps.version}")
    patchset.apply(wheel_tree, fork_ps, log=quiet)
    status = git(wheel_tree, "status", "--porcelain", "--untracked-files=all")
    assert sorted(status.splitlines()) == sorted(
        [f" M {rel}" for rel in fork_ps.touched]
        + [f"?? {rel}" for rel in fork_ps.added]
    )
    assert patchset.inspect_tree(wheel_tree, fork_ps).state == "applied"
    patchset.revert(wheel_tree, fork_ps, log=quiet)
    assert git(wheel_tree, "status", "--porcelain", "--untracked-files=all") == ""


def test_tree_must_contain_vllm(wheel_tree, fork_ps):
    with pytest.raises(PatchsetError, match="did you mean its parent"):
        patchset.apply(wheel_tree / "vllm", fork_ps, log=quiet)
    with pytest.raises(PatchsetError, match="no vllm/ directory"):
        patchset.inspect_tree(wheel_tree / "vllm" / "models", fork_ps)


# -- upstream diff ------------------------------------------------------------


def test_diff_applies_to_a_fresh_base(fork_ps, stock_wheel, unpack_subset, snap):
    text = patchset.export_diff(fork_ps, wheel=stock_wheel)
    headers = [line for line in text.splitlines() if line.startswith("diff --git")]
    expected = sorted([*fork_ps.touched, *fork_ps.added])
    assert headers == [f"diff --git a/{rel} b/{rel}" for rel in expected]
    assert text.count("\nnew file mode 100644\n") == len(fork_ps.added)

    fresh = unpack_subset("fresh", fork_ps)
    (fresh.parent / "fork.diff").write_text(text)
    git_env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(fresh.parent)}
    subprocess.run(
        ["git", "apply", "-p1", str(fresh.parent / "fork.diff")],
        cwd=fresh,
        env=git_env,
        check=True,
    )
    assert patchset.inspect_tree(fresh, fork_ps).state == "applied"

    # The same diff from a TREE (applied or base) and from the CLI.
    assert patchset.export_diff(fork_ps, tree=fresh) == text
    r = run_cli("--root", str(fork_ps.root), "diff", "--wheel", str(stock_wheel))
    assert r.returncode == 0 and r.stdout == text


def test_repo_diff_has_every_added_file(repo_ps, stock_wheel):
    text = patchset.export_diff(repo_ps, wheel=stock_wheel)
    for rel in repo_ps.added:
        assert f"diff --git a/{rel} b/{rel}\nnew file mode" in text
    assert f"diff --git a/{KPOOL} b/{KPOOL}\nindex " in text


def test_diff_needs_a_stock_source(repo_ps, tmp_path):
    with pytest.raises(PatchsetError, match="no stock source"):
        patchset.export_diff(repo_ps, cache_dir=tmp_path)


# -- CLI, validation, overlay -------------------------------------------------


def _check_finds(root, tree, expect, found, state_line, fix):
    """``check --expect EXPECT`` on a tree in state FOUND: exit 1, the state
    report, and a message that names the command to run."""
    r = run_cli(*root, "check", str(tree), "--expect", expect)
    assert r.returncode == 1
    assert r.stdout.startswith(f"{tree}: {found}: {state_line}")
    assert r.stderr == (
        f"patchset: check: expected {expect}, found {found}: run "
        f"`tools/patchset.py {fix} {tree}`\n"
    )


def test_cli_round_trip(wheel_tree, fork_ps, snap):
    before = snap(wheel_tree)
    root = ["--root", str(fork_ps.root)]
    r = run_cli(*root, "check", str(wheel_tree), "--expect", "base")
    assert r.returncode == 0 and "base" in r.stdout
    version = fork_ps.version
    _check_finds(
        root, wheel_tree, "applied", "base", f"stock vLLM {version}, ", "apply"
    )
    r = run_cli(*root, "apply", str(wheel_tree))
    assert r.returncode == 0
    assert f"applied {len(fork_ps.patches)} patch(es)" in r.stdout
    r = run_cli(*root, "apply", str(wheel_tree))
    assert r.returncode == 0 and "already applied" in r.stdout
    assert (
        run_cli(*root, "check", str(wheel_tree), "--expect", "applied").returncode == 0
    )
    _check_finds(root, wheel_tree, "base", "applied", f"vLLM {version} with", "revert")
    assert run_cli(*root, "revert", str(wheel_tree)).returncode == 0
    assert snap(wheel_tree) == before


def test_invalid_patch_sets(new_fork):
    root = new_fork("f1")
    set_series(root, "0001-kpool-expand-seq-offset-out.patch", "0002-nope.patch")
    with pytest.raises(
        PatchsetError, match=r"series:2: 0002-nope.patch: no such patch"
    ):
        patchset.Patchset.load(root)

    root = new_fork("f2")
    (root / "patches" / "0002-new.patch").write_text(
        "diff --git a/vllm/x.py b/vllm/x.py\nnew file mode 100644\n--- /dev/null\n"
    )
    set_series(root, "0001-kpool-expand-seq-offset-out.patch", "0002-new.patch")
    with pytest.raises(PatchsetError, match="0002-new.patch:2: .*put a new file"):
        patchset.Patchset.load(root)

    root = new_fork("f3", {"vllm/__init__.py": b""})
    with pytest.raises(PatchsetError, match="must not ship vllm/__init__.py"):
        patchset.Patchset.load(root)

    root = new_fork("f4")
    base = json.loads((root / "patches" / "base.json").read_text())
    base["files"] = {}
    (root / "patches" / "base.json").write_text(json.dumps(base))
    with pytest.raises(PatchsetError, match=f"modifies {KPOOL}, which .* does not pin"):
        patchset.Patchset.load(root)


def test_find_installed_vllm_does_not_import_it():
    code = (
        "import sys; from tools import overlay; p = overlay.find_installed_vllm(); "
        "assert 'vllm' not in sys.modules; print(p)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=patchset.REPO_ROOT,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert r.returncode == 0, r.stderr
    if r.stdout.strip() != "None":
        found = Path(r.stdout.strip())
        assert (found / "__init__.py").is_file()
        assert found != patchset.REPO_ROOT / "vllm"  # not the repo's added files
        assert overlay.OVERLAY_DIR not in found.parents


def test_overlay_is_a_patched_hard_link_copy(site_tree, fork_ps, snap, tmp_path):
    stock_pkg = site_tree / "vllm"
    before = snap(site_tree)
    cache = tmp_path / "overlays"
    stale, recent = cache / "0123456789abcdef", cache / "fedcba9876543210"
    for d in (stale, recent):
        (d / "vllm").mkdir(parents=True)
    old = time.time() - overlay.OVERLAY_MAX_AGE_S - 60
    os.utime(stale, (old, old))
    built = overlay.build_overlay(stock_pkg, cache, fork_ps, log=quiet)
    assert not stale.exists() and recent.exists()  # unused overlays are pruned
    assert built.parent == cache
    assert patchset.inspect_tree(built, fork_ps).state == "applied"
    assert snap(site_tree) == before  # the stock install never changes
    same = (built / "vllm" / "__init__.py").stat().st_ino
    assert same == (stock_pkg / "__init__.py").stat().st_ino  # hard link
    assert (built / KPOOL).stat().st_ino != (site_tree / KPOOL).stat().st_ino
    assert (built / KPOOL).stat().st_nlink == 1

    ino = (built / KPOOL).stat().st_ino
    assert overlay.build_overlay(stock_pkg, cache, fork_ps, log=quiet) == built
    assert (built / KPOOL).stat().st_ino == ino  # cached, not rebuilt

    (fork_ps.root / NEW_DIR / "kpool.py").write_bytes(b"X = 3\n")
    changed = patchset.Patchset.load(fork_ps.root)
    other = overlay.build_overlay(stock_pkg, cache, changed, log=quiet)
    assert other != built and (other / NEW_DIR / "kpool.py").read_bytes() == b"X = 3\n"
    assert snap(site_tree) == before


def test_overlay_of_a_changed_stock_install_is_refused(site_tree, fork_ps, tmp_path):
    (site_tree / KPOOL).write_bytes(b"# edited\n" + (site_tree / KPOOL).read_bytes())
    with pytest.raises(PatchsetError) as e:
        overlay.build_overlay(site_tree / "vllm", tmp_path / "o", fork_ps, log=quiet)
    msg = str(e.value)
    assert msg.startswith(f"{site_tree / 'vllm'}: no overlay of this vllm: ")
    assert f"not the pinned base vLLM {fork_ps.version}" in msg
    assert not list((tmp_path / "o").glob("*"))


# -- the series: numbering, one git apply, new ----------------------------------


def test_series_numbers_must_increase(new_fork):
    """What following the old recipe gave: a second patch with the last
    number, appended to the series."""
    root = new_fork("f")
    names = (root / "patches" / "series").read_text().split()
    top = int(names[-1][:4])
    dup, free = f"{top:04d}-short-topic.patch", f"{top + 1:04d}-short-topic.patch"
    shutil.copy(root / "patches" / names[0], root / "patches" / dup)
    set_series(root, *names, dup)
    last = len(names) + 1
    with pytest.raises(PatchsetError) as e:
        patchset.Patchset.load(root)
    assert str(e.value) == (
        f"{root / 'patches' / 'series'}:{last}: {dup}: repeats the number of "
        f"{names[-1]} (line {last - 1}); expected numbers that increase down the "
        f"series. Rename this one (e.g. `git mv patches/{dup} patches/{free}`) "
        "and fix this line."
    )
    set_series(root, names[1], names[0])
    with pytest.raises(PatchsetError, match=f"series:2: {names[0]}: comes after"):
        patchset.Patchset.load(root)
    set_series(root, names[0], names[0])
    with pytest.raises(PatchsetError, match=r"series:2: .*listed twice \(line 1"):
        patchset.Patchset.load(root)
    set_series(root, "5-topic.patch")
    with pytest.raises(PatchsetError, match=r"series:1: 5-topic.patch: expected a"):
        patchset.Patchset.load(root)


def test_new_prints_the_next_free_name(new_fork):
    root = new_fork("f")
    top = max(int(p.name[:4]) for p in (root / "patches").glob("*.patch"))
    assert patchset.next_patch_name("short-topic", root) == (
        f"{top + 1:04d}-short-topic.patch"
    )
    (root / "patches" / f"{top + 3:04d}-unlisted.patch").write_text("x")
    r = run_cli("--root", str(root), "new", "short-topic")
    assert r.returncode == 0 and r.stdout == f"{top + 4:04d}-short-topic.patch\n"
    r = run_cli("--root", str(root), "new", "Short Topic")
    assert r.returncode == 1 and "expected lowercase words joined by '-'" in r.stderr


def test_one_git_apply_for_the_series(fork_ps, wheel_tree, tmp_path, snap):
    """Two patches on one file: applied, recovered and reverted through one
    `git apply` each way; a patch that does not apply is named."""
    base = patchset.stock_files(fork_ps, tree=wheel_tree)
    first = patchset._patch_contents(base, fork_ps)[KPOOL]
    second = first.replace(b"seq_offset: int = 0,", b"seq_offset: int = 0,  # 2")
    root = fork_ps.root
    name = patchset.next_patch_name("kpool-twice", root)
    patch = make_patch(tmp_path / "mk", KPOOL, first, second, "Twice.")
    (root / "patches" / name).write_text(patch)
    set_series(root, *(p.name for p in fork_ps.patches), name)
    ps = patchset.Patchset.load(root)
    before = snap(wheel_tree)
    assert patchset.apply(wheel_tree, ps, log=quiet)
    assert (wheel_tree / KPOOL).read_bytes() == second
    assert patchset.inspect_tree(wheel_tree, ps).state == "applied"
    assert patchset.revert(wheel_tree, ps, log=quiet)
    assert snap(wheel_tree) == before

    (root / "patches" / name).write_text(patch.replace("int = 0,\n", "int = 7,\n"))
    with pytest.raises(PatchsetError) as e:
        patchset.apply(wheel_tree, patchset.Patchset.load(root), log=quiet)
    msg = str(e.value)
    assert msg.startswith(f"{root / 'patches' / name}: does not apply to the base")
    assert f"patch failed: {KPOOL}" in msg
    assert snap(wheel_tree) == before
