# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/patchset.py on trees cut from the stock wheel and the installed
site-packages, and a git checkout: state, apply, revert (a mixed tree
completed), refusals before a byte is written, rollback, diff, the patch
set's own validation; tools/overlay.py: the test overlay."""

from __future__ import annotations

import base64
import compileall
import csv
import errno
import hashlib
import io
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tools import overlay, patchset
from tools.patchset import PatchsetError

KPOOL = "vllm/models/glm5next/nvidia/ops/kpool_compress.py"
NEW_DIR = "vllm/models/glm5next/nvidia/specialized_decode"
FORK_KPOOL = b"X = 1\n"  # conftest.FORK_FILES
DIST_INFO = f"vllm-{patchset.Patchset.load().version}.dist-info"
RECORD = f"{DIST_INFO}/RECORD"
TOOL = [sys.executable, str(patchset.REPO_ROOT / "tools" / "patchset.py")]


def quiet(_msg: str) -> None:
    pass


def cli(ps: patchset.Patchset, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [*TOOL, "--root", str(ps.root), *args]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_repo_patch_set_is_pinned_and_pin_reproduces_it(tmp_path, repo_ps, stock_wheel):
    assert set(repo_ps.base_files) == set(repo_ps.touched) and KPOOL in repo_ps.touched
    assert stock_wheel.name == patchset.default_wheel(repo_ps).name
    root = tmp_path / "fork"
    (root / "patches").mkdir(parents=True)
    for patch in (*repo_ps.patches, repo_ps.root / "patches" / "series"):
        (root / "patches" / patch.name).write_bytes(patch.read_bytes())
    with pytest.raises(PatchsetError, match="base.json: missing"):
        patchset.Patchset.load(root)
    patchset.pin(stock_wheel, root, log=quiet)
    pinned = (root / "patches" / "base.json").read_text()
    assert pinned == (repo_ps.root / "patches" / "base.json").read_text()


@pytest.mark.parametrize("kind", ["wheel_tree", "site_tree"])
def test_apply_check_revert(kind, request, fork_ps, snap):
    tree = request.getfixturevalue(kind)
    before = snap(tree)
    assert patchset.inspect_tree(tree, fork_ps).state == "base"
    assert patchset.apply(tree, fork_ps, log=quiet) is True
    assert patchset.inspect_tree(tree, fork_ps).state == "applied"
    assert b"seq_offset: int = 0" in (tree / KPOOL).read_bytes()
    for rel in fork_ps.added:
        assert (tree / rel).read_bytes() == (fork_ps.root / rel).read_bytes()
    assert (tree / KPOOL).stat().st_mode == before[KPOOL][1]  # the mode is kept

    def stats():
        return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in tree.rglob("*")}

    stats_before, messages = stats(), []
    assert patchset.apply(tree, fork_ps, log=messages.append) is False
    assert messages == [f"{tree}: already applied; nothing written"]
    assert stats() == stats_before  # not even rewritten with the same bytes

    # Imports of the fork's modules, at every optimization level.
    for level in (0, 1, 2):
        compileall.compile_dir(tree / NEW_DIR, quiet=1, optimize=level)
    assert patchset.revert(tree, fork_ps, log=messages.append) is True
    assert snap(tree) == before  # no fork file, no bytecode, RECORD as it was
    assert messages[-1] == (
        f"{tree}: revert: {len(fork_ps.touched)} stock file(s) restored, "
        f"{len(fork_ps.added)} removed, {RECORD} updated; the tree is base"
    )
    assert patchset.revert(tree, fork_ps, log=messages.append) is False
    assert messages[-1] == f"{tree}: already base; nothing written"


def test_apply_lists_the_fork_files_in_record(wheel_tree, fork_ps):
    """In place, ``apply`` adds a RECORD row (path, sha256, size, as pip
    writes them) for each file the fork adds, so that pip uninstalls them
    with vLLM; ``revert`` takes the rows out again."""
    before = (wheel_tree / RECORD).read_bytes().decode()
    messages = []
    patchset.apply(wheel_tree, fork_ps, log=messages.append)
    assert messages == [
        (
            f"{wheel_tree}: apply: {len(fork_ps.touched)} stock file(s) patched, "
            f"{len(fork_ps.added)} added, {RECORD} updated; the tree is applied"
        )
    ]
    after = (wheel_tree / RECORD).read_bytes().decode()
    assert after.startswith(before)
    rows = list(csv.reader(io.StringIO(after[len(before) :])))
    want = []
    for rel in fork_ps.added:
        data = (fork_ps.root / rel).read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
        want.append([rel, "sha256=" + digest.decode().rstrip("="), str(len(data))])
    assert rows == want
    patchset.revert(wheel_tree, fork_ps, log=quiet)
    assert (wheel_tree / RECORD).read_bytes().decode() == before


def test_pip_uninstall_after_apply_leaves_no_fork_file(tmp_path, stock_wheel, fork_ps):
    """A vLLM installed by pip (the touched files of the pinned wheel, in a
    fresh venv), patched in place and its fork modules imported: ``pip
    uninstall vllm`` removes everything, the fork's files included."""
    small = tmp_path / stock_wheel.name
    keep = (*fork_ps.touched, "vllm/__init__.py", f"{DIST_INFO}/METADATA")
    rows = []
    with zipfile.ZipFile(stock_wheel) as src, zipfile.ZipFile(small, "w") as dst:
        for name in (*keep, f"{DIST_INFO}/WHEEL"):
            data = src.read(name)
            dst.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
            rows.append(f"{name},sha256={digest.decode().rstrip('=')},{len(data)}\n")
        dst.writestr(f"{DIST_INFO}/RECORD", "".join(rows) + f"{DIST_INFO}/RECORD,,\n")
    venv.create(tmp_path / "venv", with_pip=True)
    py = str(tmp_path / "venv" / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}

    def pip(*args: str) -> None:
        cmd = [py, "-m", "pip", "--disable-pip-version-check", *args]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stdout + r.stderr

    pip("install", "--no-deps", "--no-index", str(small))
    site = Path(
        subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            env=env,
        ).stdout.strip()
    )
    assert patchset.apply(site, fork_ps, log=quiet) is True
    subprocess.run([py, "-m", "compileall", "-q", str(site / NEW_DIR)], check=True)
    pip("uninstall", "-y", "vllm")
    assert not (site / "vllm").exists() and not list(site.glob("vllm-*.dist-info"))


def test_git_checkout_tree(wheel_tree, fork_ps):
    def git(*args: str) -> str:
        cfg = ["-c", "user.name=t", "-c", "user.email=t@t"]
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(wheel_tree.parent)}
        cmd = ["git", *cfg, *args]
        return subprocess.run(
            cmd, cwd=wheel_tree, env=env, capture_output=True, text=True
        ).stdout

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "base")
    patchset.apply(wheel_tree, fork_ps, log=quiet)
    status = git("status", "--porcelain", "--untracked-files=all").splitlines()
    assert sorted(status) == sorted(
        [f" M {rel}" for rel in (*fork_ps.touched, RECORD)]
        + [f"?? {rel}" for rel in fork_ps.added]
    )
    patchset.revert(wheel_tree, fork_ps, log=quiet)
    assert git("status", "--porcelain", "--untracked-files=all") == ""


@pytest.mark.parametrize("applied_first", [False, True])
def test_wrong_base_is_refused_before_writing(wheel_tree, fork_ps, snap, applied_first):
    if applied_first:
        patchset.apply(wheel_tree, fork_ps, log=quiet)
    data = bytearray((wheel_tree / KPOOL).read_bytes())
    data[-2] ^= 1  # one byte
    (wheel_tree / KPOOL).write_bytes(data)
    found, pinned = patchset.sha256(bytes(data)), fork_ps.base_files[KPOOL]
    before = snap(wheel_tree)
    for op in (patchset.apply, patchset.revert):
        with pytest.raises(PatchsetError) as e:
            op(wheel_tree, fork_ps, log=quiet)
        assert f"{KPOOL}: wrong, found {found}; expected base {pinned}" in str(e.value)
        assert str(e.value).endswith("Nothing was written.")
        assert snap(wheel_tree) == before
    r = cli(fork_ps, "apply", str(wheel_tree))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"{KPOOL}: wrong, found {found}" in r.stderr and snap(wheel_tree) == before
    r = cli(fork_ps, "check", str(wheel_tree))
    assert r.returncode == 1 and r.stdout.startswith(f"{wheel_tree}: wrong-base")


@pytest.mark.parametrize(
    "where", ["vllm/_version.py", "vllm-0.32.0.dist-info/METADATA"]
)
def test_wrong_base_names_the_trees_version(wheel_tree, fork_ps, where):
    if where.endswith("METADATA"):
        (info,) = wheel_tree.glob("vllm-*.dist-info")
        text = (
            (info / "METADATA")
            .read_text()
            .replace("Version: 0.33.0", "Version: 0.32.0")
        )
        info.rename(wheel_tree / "vllm-0.32.0.dist-info")
        (wheel_tree / where).write_text(text)
    else:
        (wheel_tree / where).write_text("__version__ = version = '0.32.0'\n")
    (wheel_tree / KPOOL).write_bytes(b"# 0.32.0\n")
    with pytest.raises(PatchsetError) as e:
        patchset.apply(wheel_tree, fork_ps, log=quiet)
    v = fork_ps.version
    assert str(e.value).splitlines()[-3:] == [
        f"The tree says it is vLLM 0.32.0 ({where}).",
        (
            f"Install vLLM {v} with its dependencies (`pip install vllm=={v}`), then "
            "apply the patch set."
        ),
        "Nothing was written.",
    ]


def test_a_changed_file_of_the_base_version_names_both_hashes(wheel_tree, fork_ps):
    """A file of the base version changed by hand: neither its base hash nor
    its patched one (which follows from the base) is found; pip restores the
    version's files, with no other package touched."""
    data = (wheel_tree / KPOOL).read_bytes()
    (wheel_tree / KPOOL).write_bytes(data.replace(b"def ", b"def  ", 1))
    found = patchset.sha256((wheel_tree / KPOOL).read_bytes())
    base = fork_ps.base_files[KPOOL]
    r = cli(fork_ps, "check", str(wheel_tree))
    v = fork_ps.version
    assert r.returncode == 1 and r.stdout.splitlines()[1:] == [
        (
            f"  {KPOOL}: wrong, found {found}; expected base {base} or applied (that "
            "base with the patch set)"
        ),
        f"The tree says it is vLLM {v} (vllm-{v}.dist-info/METADATA).",
        (
            f"Restore vLLM {v}'s files (`pip install --force-reinstall --no-deps "
            f"vllm=={v}`), or make your change a patch."
        ),
    ]


def test_mixed_tree_is_completed(wheel_tree, fork_ps, snap, stock_wheel):
    base = snap(wheel_tree)
    patchset.apply(wheel_tree, fork_ps, log=quiet)
    applied = snap(wheel_tree)
    stock = patchset.stock_files(fork_ps, wheel=stock_wheel)
    (wheel_tree / KPOOL).write_bytes(stock[KPOOL])
    (wheel_tree / NEW_DIR / "kpool.py").unlink()

    r = cli(fork_ps, "check", str(wheel_tree), "--expect", "applied")
    assert r.returncode == 1 and r.stdout.startswith(f"{wheel_tree}: mixed")
    found, want = (patchset.sha256(d) for d in (stock[KPOOL], applied[KPOOL][0]))
    kpool = patchset.sha256(FORK_KPOOL)
    assert r.stdout.splitlines()[1:] == [
        f"  {KPOOL}: base, found {found}; expected applied {want}",
        f"  {NEW_DIR}/kpool.py: base, found no file; expected applied {kpool}",
        (
            f"Complete it with `tools/patchset.py apply {wheel_tree}`, or bring it "
            f"back to the base with `tools/patchset.py revert {wheel_tree}`."
        ),
    ]
    assert cli(fork_ps, "check", str(wheel_tree)).returncode == 1
    inode = (wheel_tree / fork_ps.touched[0]).stat().st_ino
    assert patchset.apply(wheel_tree, fork_ps, log=quiet) is True
    assert snap(wheel_tree) == applied
    assert (wheel_tree / fork_ps.touched[0]).stat().st_ino == inode  # not rewritten

    (wheel_tree / KPOOL).write_bytes(stock[KPOOL])
    assert patchset.revert(wheel_tree, fork_ps, log=quiet) is True
    assert snap(wheel_tree) == base
    assert cli(fork_ps, "check", str(wheel_tree), "--expect", "base").returncode == 0
    r = cli(fork_ps, "check", str(wheel_tree), "--expect", "applied")
    n_files = len(fork_ps.touched) + len(fork_ps.added)
    assert r.returncode == 1 and len(r.stdout.splitlines()) == 1 + n_files


def _fail_once(monkeypatch, at: int, exc: BaseException) -> None:
    """The ``at``-th file write of the next transaction raises ``exc``."""
    real, calls = patchset._swap, []

    def flaky(path, data, mode):
        calls.append(path)
        if len(calls) == at + 1:
            raise exc
        real(path, data, mode)

    monkeypatch.setattr(patchset, "_swap", flaky)


@pytest.mark.parametrize("op", ["apply", "revert"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt(), OSError(errno.EIO, "I/O error")])
@pytest.mark.parametrize("at", ["first", "first added", "last"])
def test_failed_write_is_rolled_back(
    wheel_tree, fork_ps, snap, monkeypatch, op, exc, at
):
    if op == "revert":
        patchset.apply(wheel_tree, fork_ps, log=quiet)
    before = snap(wheel_tree)
    n = len(fork_ps.touched)
    _fail_once(monkeypatch, {"first": 0, "first added": n, "last": n + 2}[at], exc)
    expected = (
        KeyboardInterrupt if isinstance(exc, KeyboardInterrupt) else PatchsetError
    )
    with pytest.raises(expected, match="rolled back, the tree is unchanged|^$"):
        getattr(patchset, op)(wheel_tree, fork_ps, log=quiet)
    assert snap(wheel_tree) == before


def test_cli_says_rolled_back(wheel_tree, fork_ps, snap, monkeypatch, capsys):
    before = snap(wheel_tree)
    denied = PermissionError(errno.EACCES, "Permission denied", str(wheel_tree / KPOOL))
    _fail_once(monkeypatch, 2, denied)
    assert patchset.main(["--root", str(fork_ps.root), "apply", str(wheel_tree)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"patchset: error: {wheel_tree}: apply stopped at ")
    assert "Permission denied" in err and "rolled back, the tree is unchanged" in err
    assert f"this is uid {os.getuid()}" in err and snap(wheel_tree) == before

    _fail_once(monkeypatch, 0, KeyboardInterrupt())
    assert patchset.main(["--root", str(fork_ps.root), "apply", str(wheel_tree)]) == 130
    err = capsys.readouterr().err
    assert err == f"patchset: interrupted; rolled back, {wheel_tree} is unchanged\n"
    assert snap(wheel_tree) == before


def test_diff_applies_to_a_fresh_base(fork_ps, stock_wheel, unpack):
    text = patchset.export_diff(fork_ps, wheel=stock_wheel)
    heads = [line for line in text.splitlines() if line.startswith("diff --git")]
    assert heads == [
        f"diff --git a/{r} b/{r}" for r in sorted(fork_ps.touched + fork_ps.added)
    ]
    assert text.count("\nnew file mode 100644\n") == len(fork_ps.added)
    fresh = unpack("fresh")
    (fresh.parent / "fork.diff").write_text(text)
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(fresh.parent)}
    subprocess.run(["git", "apply", "../fork.diff"], cwd=fresh, env=env, check=True)
    assert patchset.inspect_tree(fresh, fork_ps).state == "applied"
    assert patchset.export_diff(fork_ps, tree=fresh) == text
    assert cli(fork_ps, "diff", "--wheel", str(stock_wheel)).stdout == text


def test_cli_output_into_head_has_no_traceback(stock_wheel):
    cmd = f"{' '.join(TOOL)} diff --wheel {stock_wheel} | head -1"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True)
    assert r.stdout.startswith("diff --git a/vllm/") and r.stderr == ""


NEW_FILE = "diff --git a/vllm/x.py b/vllm/x.py\nnew file mode 100644\n--- /dev/null\n"
SERIES = (patchset.REPO_ROOT / "patches" / "series").read_text().split()
INVALID = {  # series, files in patches/, what the message says
    "name": (["5-topic.patch"], {}, "5-topic.patch: expected an NNNN-topic.patch"),
    "missing": ([*SERIES, "0009-nope.patch"], {}, "0009-nope.patch: expected"),
    "numbers": (
        [SERIES[1], SERIES[0]],
        {},
        f"{SERIES[0]}: not numbered above {SERIES[1]}",
    ),
    "stray": (SERIES, {"0099-stray.patch": NEW_FILE}, "0099-stray.patch: not in"),
    "new file": (
        [*SERIES, "0099-new.patch"],
        {"0099-new.patch": NEW_FILE},
        "0099-new.patch:2: new file mode 100644: patches only modify files",
    ),
    "unpinned": (
        SERIES,
        {"base.json": '{"files": {}}'},
        "modifies vllm/.*, but .* lacks it",
    ),
}


@pytest.mark.parametrize("case", INVALID)
def test_invalid_patch_sets_are_named(new_fork, case):
    series, files, message = INVALID[case]
    root = new_fork("fork")
    (root / "patches" / "series").write_text("".join(f"{n}\n" for n in series))
    for name, text in files.items():
        (root / "patches" / name).write_text(text)
    with pytest.raises(PatchsetError, match=message):
        patchset.Patchset.load(root)


def test_the_fork_may_not_add_vllm_init(new_fork):
    with pytest.raises(PatchsetError, match="would shadow the stock vllm/__init__.py"):
        patchset.Patchset.load(new_fork("shadow", {"vllm/__init__.py": b""}))


def test_new_prints_the_next_free_name(fork_ps):
    top = max(int(p.name[:4]) for p in fork_ps.patches)
    assert (
        patchset.next_patch_name("short-topic", fork_ps.root)
        == f"{top + 1:04d}-short-topic.patch"
    )
    r = cli(fork_ps, "new", "Short Topic")
    assert r.returncode == 1 and "expected lowercase words joined by '-'" in r.stderr


def test_a_failing_patch_is_named(fork_ps, wheel_tree, snap, stock_wheel):
    """A second patch on a file the series patched: applied and reverted with
    the series; made not to apply, it is named with git's words."""
    first = patchset.patched_files(
        fork_ps, patchset.stock_files(fork_ps, wheel=stock_wheel)
    )
    second = first[KPOOL].replace(b"seq_offset: int = 0,", b"seq_offset: int = 0,  # 2")
    mk = wheel_tree.parent / "mk"
    for side, data in (("a", first[KPOOL]), ("b", second)):
        (mk / side / KPOOL).parent.mkdir(parents=True)
        (mk / side / KPOOL).write_bytes(data)
    git = ["git", "diff", "--no-index", "--src-prefix=", "--dst-prefix="]
    diff = subprocess.run(
        [*git, f"a/{KPOOL}", f"b/{KPOOL}"], cwd=mk, capture_output=True, text=True
    ).stdout
    name = patchset.next_patch_name("kpool-twice", fork_ps.root)
    (fork_ps.root / "patches" / name).write_text(
        f"# Twice.\n#\n# Why: a test.\n\n{diff}"
    )
    with open(fork_ps.root / "patches" / "series", "a") as f:
        f.write(f"{name}\n")
    ps = patchset.Patchset.load(fork_ps.root)
    before = snap(wheel_tree)
    assert (
        patchset.apply(wheel_tree, ps, log=quiet)
        and (wheel_tree / KPOOL).read_bytes() == second
    )
    assert patchset.revert(wheel_tree, ps, log=quiet) and snap(wheel_tree) == before

    (fork_ps.root / "patches" / name).write_text(
        diff.replace("int = 0,\n", "int = 7,\n")
    )
    with pytest.raises(PatchsetError) as e:
        patchset.apply(wheel_tree, patchset.Patchset.load(fork_ps.root), log=quiet)
    assert str(e.value).startswith(f"{fork_ps.root / 'patches' / name}: does not apply")
    assert f"patch failed: {KPOOL}" in str(e.value) and snap(wheel_tree) == before


def test_find_installed_vllm_does_not_import_it():
    code = "import sys; from tools import overlay; p = overlay.find_installed_vllm(); "
    code += "assert 'vllm' not in sys.modules; print(p)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=patchset.REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    found = Path(r.stdout.strip())
    assert (found / "__init__.py").is_file() and found != patchset.REPO_ROOT / "vllm"


def test_overlay_is_a_patched_hard_link_copy(site_tree, fork_ps, snap, tmp_path, capfd):
    stock_pkg, cache = site_tree / "vllm", tmp_path / "overlays"
    before = snap(site_tree)
    built = overlay.build_overlay(stock_pkg, cache, fork_ps)  # the default log
    out, err = capfd.readouterr()
    assert out == "" and f"built vllm overlay {built}" in err  # never on stdout
    assert patchset.inspect_tree(built, fork_ps).state == "applied"
    assert snap(site_tree) == before  # the stock install never changes
    init = (built / "vllm/__init__.py").stat()
    assert init.st_ino == (stock_pkg / "__init__.py").stat().st_ino  # a hard link
    assert (built / KPOOL).stat().st_nlink == 1
    ino = (built / KPOOL).stat().st_ino
    assert overlay.build_overlay(stock_pkg, cache, fork_ps) == built  # cached
    assert (built / KPOOL).stat().st_ino == ino and capfd.readouterr() == ("", "")

    (fork_ps.root / NEW_DIR / "kpool.py").write_bytes(b"X = 3\n")
    changed = patchset.Patchset.load(fork_ps.root)
    other = overlay.build_overlay(stock_pkg, cache, changed, log=quiet)
    assert other != built and (other / NEW_DIR / "kpool.py").read_bytes() == b"X = 3\n"

    (site_tree / KPOOL).write_bytes(b"# edited\n")  # the stock install, changed
    with pytest.raises(PatchsetError, match=f"{stock_pkg}: no overlay of this vllm:"):
        overlay.build_overlay(stock_pkg, cache, changed, log=quiet)


def test_pin_refuses_the_header_templates_placeholders(new_fork, stock_wheel):
    """CONTRIBUTING.md's recipe writes a header of placeholders; ``pin``
    refuses a patch that still has them, naming it, and pins nothing."""
    root = new_fork("fork")
    first = (root / "patches" / SERIES[0]).read_text()
    name = patchset.next_patch_name("new-topic", root)
    diff = first[first.index("diff --git ") :]
    (root / "patches" / name).write_text("# CONCERN.\n#\n# WHY.\n\n" + diff)
    with open(root / "patches" / "series", "a") as f:
        f.write(f"{name}\n")
    pinned = (root / "patches" / "base.json").read_bytes()
    r = subprocess.run(
        [*TOOL, "--root", str(root), "pin", "--wheel", str(stock_wheel)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and r.stderr == (
        f"patchset: error: {root / 'patches' / name}: header: '# CONCERN.': "
        "replace the placeholder; '# WHY.': replace the placeholder "
        '(CONTRIBUTING.md, "Adding a patch"); patches/base.json is unchanged\n'
    )
    assert (root / "patches" / "base.json").read_bytes() == pinned


def test_overlay_runs_as_a_script():
    """``python tools/overlay.py`` prints the overlay's dir (applied) and
    nothing else on stdout; where the python has no vllm it says so."""
    tool = str(patchset.REPO_ROOT / "tools" / "overlay.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, tool], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.splitlines()
    assert patchset.inspect_tree(line).state == "applied"
    r = subprocess.run(
        [sys.executable, "-S", tool], capture_output=True, text=True, env=env
    )
    assert r.returncode == 1 and r.stderr.startswith(
        f"overlay: error: no vllm installed for {sys.executable}; expected vllm=="
    )
