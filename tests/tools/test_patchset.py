# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/patchset.py: apply / check / revert / diff / pin on vLLM trees given
as an unpacked wheel, a site-packages copy and a git checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools import patchset
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


# -- the repo's patch set -----------------------------------------------------


def test_repo_patch_set_is_pinned(repo_ps, stock_wheel):
    assert repo_ps.base["vllm_version"] == "0.33.0"
    assert repo_ps.base["wheel"] == stock_wheel.name
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
    with pytest.raises(PatchsetError, match="not the pinned base") as e:
        patchset.revert(wheel_tree, fork_ps, log=quiet)
    assert f"{KPOOL}: expected base sha256 {fork_ps.base_files[KPOOL]}" in str(e.value)


def test_missing_stock_file_is_refused(wheel_tree, fork_ps):
    (wheel_tree / KPOOL).unlink()
    with pytest.raises(PatchsetError, match=f"{KPOOL}: missing"):
        patchset.apply(wheel_tree, fork_ps, log=quiet)


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
@pytest.mark.parametrize("after", [0, 1, 2, 3])
def test_interrupted_apply_leaves_tree_unchanged(
    wheel_tree, fork_ps, snap, monkeypatch, exc, after
):
    before = snap(wheel_tree)
    place, calls = patchset._place, []

    def flaky(path, data, mode):
        if len(calls) == after:
            raise exc("interrupted")
        calls.append(path)
        place(path, data, mode)

    monkeypatch.setattr(patchset, "_place", flaky)
    with pytest.raises(exc):
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


def test_git_checkout_tree(wheel_tree, fork_ps):
    git(wheel_tree, "init", "-q")
    git(wheel_tree, "add", "-A")
    git(wheel_tree, "commit", "-qm", "v0.33.0")
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


def test_cli_round_trip(wheel_tree, fork_ps, snap):
    before = snap(wheel_tree)
    root = ["--root", str(fork_ps.root)]
    r = run_cli(*root, "check", str(wheel_tree), "--expect", "base")
    assert r.returncode == 0 and "base" in r.stdout
    assert (
        run_cli(*root, "check", str(wheel_tree), "--expect", "applied").returncode == 1
    )
    r = run_cli(*root, "apply", str(wheel_tree))
    assert r.returncode == 0
    assert f"applied {len(fork_ps.patches)} patch(es)" in r.stdout
    r = run_cli(*root, "apply", str(wheel_tree))
    assert r.returncode == 0 and "already applied" in r.stdout
    assert (
        run_cli(*root, "check", str(wheel_tree), "--expect", "applied").returncode == 0
    )
    assert run_cli(*root, "revert", str(wheel_tree)).returncode == 0
    assert snap(wheel_tree) == before


def test_invalid_patch_sets(new_fork):
    root = new_fork("f1")
    (root / "patches" / "series").write_text(
        "0001-kpool-expand-seq-offset-out.patch\nnope\n"
    )
    with pytest.raises(PatchsetError, match=r"series:2: no patch file 'nope'"):
        patchset.Patchset.load(root)

    root = new_fork("f2")
    (root / "patches" / "0002-new.patch").write_text(
        "diff --git a/vllm/x.py b/vllm/x.py\nnew file mode 100644\n--- /dev/null\n"
    )
    (root / "patches" / "series").write_text(
        "0001-kpool-expand-seq-offset-out.patch\n0002-new.patch\n"
    )
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
        "import sys; from tools import patchset; p = patchset.find_installed_vllm(); "
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
        assert patchset.OVERLAY_DIR not in found.parents


def test_overlay_is_a_patched_hard_link_copy(site_tree, fork_ps, snap, tmp_path):
    stock_pkg = site_tree / "vllm"
    before = snap(site_tree)
    cache = tmp_path / "overlays"
    stale, recent = cache / "0123456789abcdef", cache / "fedcba9876543210"
    for d in (stale, recent):
        (d / "vllm").mkdir(parents=True)
    old = time.time() - patchset.OVERLAY_MAX_AGE_S - 60
    os.utime(stale, (old, old))
    overlay = patchset.build_overlay(stock_pkg, cache, fork_ps, log=quiet)
    assert not stale.exists() and recent.exists()  # unused overlays are pruned
    assert overlay.parent == cache
    assert patchset.inspect_tree(overlay, fork_ps).state == "applied"
    assert snap(site_tree) == before  # the stock install never changes
    same = (overlay / "vllm" / "__init__.py").stat().st_ino
    assert same == (stock_pkg / "__init__.py").stat().st_ino  # hard link
    assert (overlay / KPOOL).stat().st_ino != (site_tree / KPOOL).stat().st_ino
    assert (overlay / KPOOL).stat().st_nlink == 1

    ino = (overlay / KPOOL).stat().st_ino
    assert patchset.build_overlay(stock_pkg, cache, fork_ps, log=quiet) == overlay
    assert (overlay / KPOOL).stat().st_ino == ino  # cached, not rebuilt

    (fork_ps.root / NEW_DIR / "kpool.py").write_bytes(b"X = 3\n")
    changed = patchset.Patchset.load(fork_ps.root)
    other = patchset.build_overlay(stock_pkg, cache, changed, log=quiet)
    assert (
        other != overlay and (other / NEW_DIR / "kpool.py").read_bytes() == b"X = 3\n"
    )
    assert snap(site_tree) == before
