#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Apply, check, revert and export the fork's patch set on a vLLM tree.

A TREE is the directory that CONTAINS the ``vllm/`` package: an unpacked
wheel, a site-packages directory, or a git checkout of vLLM at the base tag.

The patch set lives in the repo root (``--root``, default: this checkout):

- ``patches/series``: patch file names, one a line, applied in order;
- ``patches/NNNN-name.patch``: git-style diffs (``a/vllm/...``, ``b/vllm/...``)
  that modify stock files (new files go under ``vllm/`` instead);
- ``patches/base.json``: the pinned base, with the sha256 of every stock file
  a patch touches;
- ``vllm/``: the files the fork adds, copied to the same path in the TREE.

Contracts:

- A TREE's state is read from its files alone, nothing else records it:
  ``base`` (every touched file has its pinned hash, no added file exists),
  ``applied`` (every touched file equals the series applied to the base and
  every added file equals the fork's copy), ``wrong-base`` or
  ``half-applied``. Patched content is recovered and verified with
  ``git apply -R`` / ``git apply`` on copies in a temp dir.
- ``apply`` and ``revert`` refuse any other state before writing a byte, with
  a message naming each file (and, for a wrong base, both hashes). They
  compute every result in a temp dir, then replace files one by one by
  rename; on any error or interrupt the files already replaced are restored.
- Existing files are never written in place (new inode + rename), so a
  hard-link copy of a venv (see ``build_overlay``) never changes the venv.

Python API: ``Patchset.load``, ``inspect_tree``, ``apply``, ``revert``,
``export_diff``, ``stock_files``, ``pin``, ``find_installed_vllm``,
``build_overlay``; errors are ``PatchsetError``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.machinery
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE_DIR = REPO_ROOT / "build" / "cache"
OVERLAY_DIR = REPO_ROOT / "build" / "overlay"

_SKIP_SUFFIXES = (".pyc", ".pyo", ".orig", ".rej", "~")
_DIFF_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$")
_NOT_MODIFICATION = (
    "new file mode",
    "deleted file mode",
    "rename from",
    "copy from",
    "--- /dev/null",
    "+++ /dev/null",
)

Log = Callable[[str], None]


class PatchsetError(Exception):
    """A refusal or failure; the message names the file(s) concerned."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------
# The patch set


@dataclasses.dataclass(frozen=True)
class Patchset:
    """The fork's patch set, read from ``root`` (patches/ and vllm/)."""

    root: Path
    base: Mapping[str, object]
    patches: tuple[Path, ...]
    touches: Mapping[Path, tuple[str, ...]]  # patch -> stock paths it modifies
    added: Mapping[str, Path]  # "vllm/..." -> the fork's file under root

    @classmethod
    def load(
        cls, root: str | os.PathLike[str] = REPO_ROOT, *, require_pinned: bool = True
    ) -> Patchset:
        """Read and validate the patch set. With ``require_pinned`` (default)
        base.json must exist and pin every stock file a patch touches."""
        root = Path(root).resolve()
        pdir = root / "patches"
        patches = _read_series(pdir)
        touches = {p: patch_paths(p) for p in patches}
        base_path = pdir / "base.json"
        base: dict[str, object] = {"files": {}}
        if base_path.is_file():
            try:
                base = json.loads(base_path.read_text())
            except ValueError as e:
                raise PatchsetError(f"{base_path}: not valid JSON: {e}") from None
            if not isinstance(base.get("files"), dict):
                raise PatchsetError(f"{base_path}: no 'files' object")
        elif require_pinned:
            raise PatchsetError(
                f"{base_path}: missing; create it with "
                "`tools/patchset.py pin --wheel WHEEL`"
            )
        added = _added_files(root)
        pinned = base["files"]
        for patch, paths in touches.items():
            for rel in paths:
                if rel in added:
                    raise PatchsetError(
                        f"{patch}: modifies {rel}, which the fork also adds under "
                        f"{root / 'vllm'}; a path is either patched or added"
                    )
                if require_pinned and rel not in pinned:
                    raise PatchsetError(
                        f"{patch}: modifies {rel}, which {base_path} does not pin; "
                        "run `tools/patchset.py pin --wheel WHEEL`"
                    )
        return cls(root, base, patches, touches, added)

    @property
    def touched(self) -> tuple[str, ...]:
        """Every stock file some patch modifies, sorted."""
        return tuple(sorted({rel for paths in self.touches.values() for rel in paths}))

    @property
    def base_files(self) -> Mapping[str, str]:
        return self.base["files"]  # type: ignore[return-value]

    def digest(self) -> str:
        """sha256 over everything that defines the fork's content."""
        h = hashlib.sha256()
        for path in (
            self.root / "patches" / "base.json",
            self.root / "patches" / "series",
        ):
            h.update(path.read_bytes() if path.is_file() else b"-")
        for patch in self.patches:
            h.update(patch.name.encode() + b"\0" + patch.read_bytes())
        for rel, src in sorted(self.added.items()):
            h.update(rel.encode() + b"\0" + src.read_bytes())
        return h.hexdigest()


def _read_series(pdir: Path) -> tuple[Path, ...]:
    series = pdir / "series"
    if not series.is_file():
        raise PatchsetError(f"{series}: missing (one patch file name per line)")
    patches: list[Path] = []
    for lineno, raw in enumerate(series.read_text().splitlines(), 1):
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        patch = pdir / name
        if "/" in name or not patch.is_file():
            raise PatchsetError(f"{series}:{lineno}: no patch file {name!r} in {pdir}")
        if patch in patches:
            raise PatchsetError(f"{series}:{lineno}: {name} is listed twice")
        patches.append(patch)
    return tuple(patches)


def patch_paths(patch: Path) -> tuple[str, ...]:
    """The stock paths a patch modifies, from its ``diff --git`` headers.
    Creating, deleting, renaming or copying files is refused."""
    paths: list[str] = []
    in_header = False
    for lineno, line in enumerate(patch.read_text().splitlines(), 1):
        if line.startswith("diff --git "):
            m = _DIFF_HEADER.match(line)
            if m is None or m[1] != m[2] or not m[1].startswith("vllm/"):
                raise PatchsetError(
                    f"{patch}:{lineno}: expected 'diff --git a/vllm/X b/vllm/X' "
                    f"(same path both sides), got {line!r}"
                )
            paths.append(m[1])
            in_header = True
        elif line.startswith("@@"):
            in_header = False
        elif in_header and line.startswith(_NOT_MODIFICATION):
            raise PatchsetError(
                f"{patch}:{lineno}: {line!r}: patches may only modify stock files; "
                "put a new file under vllm/ in the repo instead"
            )
    if not paths:
        raise PatchsetError(f"{patch}: no 'diff --git a/vllm/... b/vllm/...' header")
    return tuple(dict.fromkeys(paths))


def _added_files(root: Path) -> dict[str, Path]:
    vdir = root / "vllm"
    added: dict[str, Path] = {}
    if not vdir.is_dir():
        return added
    for dirpath, dirnames, filenames in os.walk(vdir):
        dirnames[:] = sorted(
            d for d in dirnames if d != "__pycache__" and not d.startswith(".")
        )
        for name in sorted(filenames):
            if name.startswith(".") or name.endswith(_SKIP_SUFFIXES):
                continue
            path = Path(dirpath, name)
            added[path.relative_to(root).as_posix()] = path
    if "vllm/__init__.py" in added:
        raise PatchsetError(
            f"{vdir / '__init__.py'}: the repo must not ship vllm/__init__.py "
            "(it would shadow the real package); vllm/ holds only added files"
        )
    return added


# --------------------------------------------------------------------------
# git apply in a scratch dir


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    git = shutil.which("git")
    if git is None:
        raise PatchsetError("git not found on PATH (the patch set uses `git apply`)")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")
    }
    env.update(
        # Never discover a repository above the scratch dir, ignore user config.
        GIT_CEILING_DIRECTORIES=str(cwd.resolve().parent),
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        LC_ALL="C",
    )
    return subprocess.run(
        [git, *args], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )


@contextlib.contextmanager
def _scratch(files: Mapping[str, bytes]) -> Iterator[Path]:
    """A temp dir holding ``files`` at their relative paths."""
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        work = Path(tmp, "work")
        _write_files(work, files)
        yield work


def _write_files(work: Path, files: Mapping[str, bytes]) -> None:
    for rel, data in files.items():
        path = work / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _git_apply(work: Path, patch: Path, *, reverse: bool, only: str | None) -> None:
    args = ["apply", "-p1", "--whitespace=nowarn"]
    if reverse:
        args.append("-R")
    if only is not None:
        args.append(f"--include={only}")
    r = _git([*args, str(patch)], work)
    if r.returncode != 0:
        raise PatchsetError(
            f"{patch}: git {' '.join(args)} failed:\n{r.stderr.strip()}"
        )


def _patch_contents(base: Mapping[str, bytes], ps: Patchset) -> dict[str, bytes]:
    """The touched files after applying the whole series to ``base``."""
    with _scratch(base) as work:
        for patch in ps.patches:
            _git_apply(work, patch, reverse=False, only=None)
        return {rel: (work / rel).read_bytes() for rel in ps.touched}


def _recover_base(rel: str, data: bytes, ps: Patchset) -> bytes | None:
    """Base content of ``rel`` if ``data`` is exactly the series applied to
    the pinned base (reverse-apply, check the hash, apply again); else None."""
    patches = [p for p in ps.patches if rel in ps.touches[p]]
    with _scratch({rel: data}) as work:
        try:
            for patch in reversed(patches):
                _git_apply(work, patch, reverse=True, only=rel)
            base = (work / rel).read_bytes()
            if sha256_bytes(base) != ps.base_files[rel]:
                return None
            for patch in patches:
                _git_apply(work, patch, reverse=False, only=rel)
        except PatchsetError:
            return None
        return base if (work / rel).read_bytes() == data else None


# --------------------------------------------------------------------------
# Tree state


@dataclasses.dataclass(frozen=True)
class FileState:
    path: str
    added: bool  # a file the fork adds (else a stock file a patch modifies)
    state: str  # base | applied | missing | unknown | differs
    found_sha256: str | None
    expected_sha256: str  # the pinned base hash, or the fork copy's hash


@dataclasses.dataclass(frozen=True)
class TreeState:
    tree: Path
    state: str  # base | applied | wrong-base | half-applied
    files: tuple[FileState, ...]
    base_content: Mapping[str, bytes]
    patched_content: Mapping[str, bytes]
    base_name: str

    def describe(self) -> str:
        if self.state == "wrong-base":
            lines = [f"{self.tree}: not {self.base_name}; nothing was written:"]
            for f in self.files:
                if f.state == "missing" and not f.added:
                    lines.append(
                        f"  {f.path}: missing (expected base sha256 "
                        f"{f.expected_sha256})"
                    )
                elif f.state == "unknown":
                    lines.append(
                        f"  {f.path}: expected base sha256 {f.expected_sha256}, "
                        f"found {f.found_sha256} (neither the base nor the patched "
                        "content)"
                    )
            return "\n".join(lines)
        if self.state == "half-applied":
            head = (
                f"{self.tree}: half-applied patch set; refusing, nothing was "
                "written. Restore the stock files (unpack the wheel again or "
                "`pip install --force-reinstall --no-deps vllm==<base>`), then "
                "apply. Files:"
            )
            lines = [head]
            for f in self.files:
                what = {
                    (False, "base"): "stock file, not patched",
                    (False, "applied"): "stock file, patched",
                    (True, "missing"): "added file, missing",
                    (True, "applied"): "added file, present",
                    (True, "differs"): (
                        f"added file, differs from the fork's copy (found sha256 "
                        f"{f.found_sha256}, fork {f.expected_sha256})"
                    ),
                }[(f.added, f.state)]
                lines.append(f"  {f.path}: {what}")
            return "\n".join(lines)
        n_touched = sum(not f.added for f in self.files)
        return (
            f"{self.tree}: {self.state} ({n_touched} patched file(s), "
            f"{len(self.files) - n_touched} added file(s))"
        )

    def require(self, *states: str) -> None:
        if self.state not in states:
            raise PatchsetError(self.describe())


def _tree_root(tree: str | os.PathLike[str]) -> Path:
    path = Path(tree).absolute()
    if not (path / "vllm").is_dir():
        hint = ""
        if path.name == "vllm" and (path / "__init__.py").is_file():
            hint = f"; did you mean its parent {path.parent}?"
        raise PatchsetError(
            f"{path}: no vllm/ directory here; TREE is the directory that contains "
            f"vllm/ (an unpacked wheel, a site-packages, a vLLM checkout){hint}"
        )
    return path


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise PatchsetError(f"{path}: is a directory, expected a file") from None


def inspect_tree(tree: str | os.PathLike[str], ps: Patchset | None = None) -> TreeState:
    """Classify every file the patch set touches or adds, and the TREE."""
    ps = ps or Patchset.load()
    root = _tree_root(tree)
    files: list[FileState] = []
    base_content: dict[str, bytes] = {}
    for rel in ps.touched:
        expected = ps.base_files[rel]
        data = _read_or_none(root / rel)
        if data is None:
            files.append(FileState(rel, False, "missing", None, expected))
            continue
        found = sha256_bytes(data)
        if found == expected:
            state = "base"
            base_content[rel] = data
        elif (recovered := _recover_base(rel, data, ps)) is not None:
            state = "applied"
            base_content[rel] = recovered
        else:
            state = "unknown"
        files.append(FileState(rel, False, state, found, expected))
    for rel, src in ps.added.items():
        want = src.read_bytes()
        data = _read_or_none(root / rel)
        state = "missing" if data is None else "applied" if data == want else "differs"
        found = None if data is None else sha256_bytes(data)
        files.append(FileState(rel, True, state, found, sha256_bytes(want)))

    touched = {f.state for f in files if not f.added}
    added = {f.state for f in files if f.added}
    patched: dict[str, bytes] = {}
    if touched & {"missing", "unknown"}:
        overall = "wrong-base"
    else:
        patched = _patch_contents(base_content, ps)
        if touched <= {"base"} and added <= {"missing"}:
            overall = "base"
        elif touched <= {"applied"} and added <= {"applied"}:
            overall = "applied"
        else:
            overall = "half-applied"
    base_name = f"the pinned base vLLM {ps.base.get('vllm_version', '?')} "
    base_name += f"({ps.root / 'patches' / 'base.json'})"
    files.sort(key=lambda f: (f.added, f.path))
    return TreeState(root, overall, tuple(files), base_content, patched, base_name)


# --------------------------------------------------------------------------
# Writing: one file at a time by rename, rolled back on any failure


def _atomic_write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.patchset-{os.getpid()}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _place(path: Path, data: bytes, mode: int) -> None:
    """One step of a transaction (tests interrupt it here)."""
    _atomic_write(path, data, mode)


def _remove(path: Path) -> None:
    """One step of a transaction (tests interrupt it here)."""
    path.unlink()


def _transaction(
    root: Path, writes: Mapping[str, tuple[bytes, int | None]], removes: Iterable[str]
) -> None:
    undo: list[Callable[[], None]] = []
    try:
        for rel, (data, mode) in writes.items():
            target = root / rel
            old = _read_or_none(target)
            if old is None:
                parents = (target.parent, *target.parent.parents)
                for d in reversed([d for d in parents if not d.exists()]):
                    d.mkdir()
                    undo.append(d.rmdir)
                _place(target, data, 0o644 if mode is None else mode)
                undo.append(target.unlink)
            else:
                old_mode = stat.S_IMODE(target.stat().st_mode)
                _place(target, data, old_mode if mode is None else mode)
                undo.append(lambda t=target, o=old, m=old_mode: _atomic_write(t, o, m))
        for rel in removes:
            target = root / rel
            old, old_mode = target.read_bytes(), stat.S_IMODE(target.stat().st_mode)
            _remove(target)
            undo.append(lambda t=target, o=old, m=old_mode: _atomic_write(t, o, m))
    except BaseException as exc:
        failed = []
        for action in reversed(undo):
            try:
                action()
            except OSError as e:
                failed.append(str(e))
        if failed:
            raise PatchsetError(
                f"{root}: writing failed ({exc!r}) and the rollback failed too, "
                "the tree may be half-applied: " + "; ".join(failed)
            ) from exc
        raise


def _tidy_removed(root: Path, removed: Iterable[str]) -> None:
    """Drop bytecode of removed modules and the directories apply created."""
    dirs: set[Path] = set()
    for rel in removed:
        path = root / rel
        cache = path.parent / "__pycache__"
        for pyc in cache.glob(f"{path.stem}.*.pyc") if cache.is_dir() else ():
            pyc.unlink()
        for d in (path.parent, *path.parent.parents):
            if d == root / "vllm" or root / "vllm" not in d.parents:
                break
            dirs.add(d)
    for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        cache = d / "__pycache__"
        if cache.is_dir() and not any(cache.iterdir()):
            cache.rmdir()
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()


def apply(
    tree: str | os.PathLike[str], ps: Patchset | None = None, *, log: Log = print
) -> bool:
    """Apply the patch set to TREE. True if files were written, False if TREE
    was already applied; PatchsetError (nothing written) for any other state."""
    ps = ps or Patchset.load()
    st = inspect_tree(tree, ps)
    if st.state == "applied":
        log(f"{st.tree}: patch set already applied; nothing written")
        return False
    st.require("base")
    writes: dict[str, tuple[bytes, int | None]] = {
        rel: (st.patched_content[rel], None) for rel in ps.touched
    }
    for rel, src in ps.added.items():
        writes[rel] = (src.read_bytes(), stat.S_IMODE(src.stat().st_mode) | 0o644)
    _transaction(st.tree, writes, ())
    log(
        f"{st.tree}: applied {len(ps.patches)} patch(es) to {len(ps.touched)} "
        f"file(s), added {len(ps.added)} file(s)"
    )
    return True


def revert(
    tree: str | os.PathLike[str], ps: Patchset | None = None, *, log: Log = print
) -> bool:
    """Restore TREE's base content and remove the added files. True if files
    were written, False if TREE was at the base already; PatchsetError
    (nothing written) unless TREE is fully applied or fully base."""
    ps = ps or Patchset.load()
    st = inspect_tree(tree, ps)
    if st.state == "base":
        log(f"{st.tree}: already at the base; nothing written")
        return False
    st.require("applied")
    writes = {rel: (st.base_content[rel], None) for rel in ps.touched}
    _transaction(st.tree, writes, sorted(ps.added))
    _tidy_removed(st.tree, ps.added)
    log(
        f"{st.tree}: reverted {len(ps.touched)} file(s), removed "
        f"{len(ps.added)} added file(s)"
    )
    return True


# --------------------------------------------------------------------------
# Stock sources, upstream diff, pinning


def default_wheel(
    ps: Patchset, cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR
) -> Path:
    return Path(cache_dir) / str(ps.base["wheel"])


def read_wheel_files(
    wheel: str | os.PathLike[str], paths: Iterable[str]
) -> dict[str, bytes]:
    """The named members of a wheel (a zip), without unpacking the rest."""
    wheel = Path(wheel)
    if not wheel.is_file():
        raise PatchsetError(f"{wheel}: no such wheel")
    out: dict[str, bytes] = {}
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for rel in paths:
            if rel not in names:
                raise PatchsetError(f"{wheel}: has no {rel}")
            out[rel] = zf.read(rel)
    return out


def stock_files(
    ps: Patchset | None = None,
    *,
    tree: str | os.PathLike[str] | None = None,
    wheel: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR,
) -> dict[str, bytes]:
    """The pinned base content of every touched file, from TREE (base or
    patched), a wheel, or the base wheel in ``cache_dir``; hashes verified."""
    ps = ps or Patchset.load()
    if tree is not None:
        st = inspect_tree(tree, ps)
        if st.state == "wrong-base":
            raise PatchsetError(st.describe())
        return dict(st.base_content)
    if wheel is None:
        wheel = default_wheel(ps, cache_dir)
        if not wheel.is_file():
            raise PatchsetError(
                f"{wheel}: no stock source; pass TREE or --wheel WHEEL, or fetch the "
                "base wheel into the cache with `make wheel`"
            )
    files = read_wheel_files(wheel, ps.touched)
    for rel, data in files.items():
        found = sha256_bytes(data)
        if found != ps.base_files[rel]:
            raise PatchsetError(
                f"{wheel}: {rel}: expected base sha256 {ps.base_files[rel]}, "
                f"found {found}"
            )
    return files


def export_diff(
    ps: Patchset | None = None,
    *,
    tree: str | os.PathLike[str] | None = None,
    wheel: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR,
) -> str:
    """The whole fork as one git diff against the base: patched stock files
    and added files (as new files), ``a/vllm/...`` / ``b/vllm/...`` paths."""
    ps = ps or Patchset.load()
    base = stock_files(ps, tree=tree, wheel=wheel, cache_dir=cache_dir)
    fork = _patch_contents(base, ps)
    fork.update({rel: src.read_bytes() for rel, src in ps.added.items()})
    with tempfile.TemporaryDirectory(prefix="patchset-diff-") as tmp:
        work = Path(tmp, "work")
        work.mkdir()
        trees = []
        for files in (base, fork):
            _write_files(work, files)
            for cmd in (["init", "-q"], ["add", "-A"], ["write-tree"]):
                r = _git(cmd, work)
                if r.returncode != 0:
                    raise PatchsetError(f"git {' '.join(cmd)} failed: {r.stderr}")
            trees.append(r.stdout.strip())
        diff_opts = ["--no-color", "--no-ext-diff", "--no-renames"]
        prefixes = ["--src-prefix=a/", "--dst-prefix=b/"]
        r = _git(["diff", *diff_opts, *prefixes, *trees], work)
        if r.returncode != 0:
            raise PatchsetError(f"git diff failed: {r.stderr}")
        return r.stdout


def pin(
    wheel: str | os.PathLike[str],
    root: str | os.PathLike[str] = REPO_ROOT,
    *,
    log: Log = print,
) -> dict[str, object]:
    """Rewrite ``patches/base.json`` from WHEEL: its version, name, sha256 and
    the sha256 of every stock file the series touches (after checking that
    the series applies to them)."""
    ps = Patchset.load(root, require_pinned=False)
    wheel = Path(wheel)
    m = re.match(r"^vllm-([^-]+)-.+\.whl$", wheel.name)
    if m is None:
        raise PatchsetError(f"{wheel}: not a vllm wheel file name")
    files = read_wheel_files(wheel, ps.touched)
    _patch_contents(files, ps)  # raises, naming the patch, if it does not apply
    data: dict[str, object] = {
        "vllm_version": m[1],
        "wheel": wheel.name,
        "wheel_sha256": sha256_file(wheel),
        "files": {rel: sha256_bytes(files[rel]) for rel in sorted(files)},
    }
    out = ps.root / "patches" / "base.json"
    out.write_text(json.dumps(data, indent=2) + "\n")
    log(f"{out}: pinned {wheel.name} and {len(files)} stock file(s)")
    return data


# --------------------------------------------------------------------------
# The installed stock package and a patched overlay of it


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


OVERLAY_MAX_AGE_S = 6 * 3600


def _prune_overlays(cache_root: Path, keep: Path) -> None:
    if not cache_root.is_dir():
        return
    now = time.time()
    for old in cache_root.iterdir():
        with contextlib.suppress(OSError):
            if old != keep and now - old.stat().st_mtime > OVERLAY_MAX_AGE_S:
                shutil.rmtree(old)


def build_overlay(
    stock_pkg: str | os.PathLike[str],
    cache_root: str | os.PathLike[str] = OVERLAY_DIR,
    ps: Patchset | None = None,
    *,
    log: Log = print,
) -> Path:
    """A patched copy of the installed stock package, cached under
    ``cache_root/<key>/vllm`` (key: the patch set, the stock package and this
    tool). Files are hard links to the stock ones until the patch set
    replaces them, so the stock install is never modified. Overlays unused
    for ``OVERLAY_MAX_AGE_S`` are deleted. Returns the dir to put on
    ``sys.path``."""
    ps = ps or Patchset.load()
    stock_pkg = Path(stock_pkg).resolve()
    h = hashlib.sha256(ps.digest().encode())
    h.update(str(stock_pkg).encode() + Path(__file__).read_bytes())
    for record in sorted(stock_pkg.parent.glob("vllm-*.dist-info/RECORD")):
        h.update(record.read_bytes())
    for rel in ps.touched:
        h.update(_read_or_none(stock_pkg.parent / rel) or b"-")
    final = Path(cache_root) / h.hexdigest()[:16]
    _prune_overlays(Path(cache_root), keep=final)
    if (final / "vllm").is_dir():
        with contextlib.suppress(PatchsetError):
            if inspect_tree(final, ps).state == "applied":
                os.utime(final)  # last use, for pruning
                return final
        shutil.rmtree(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        how = _link_copy(stock_pkg, tmp / "vllm")
        apply(tmp, ps, log=lambda _: None)
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


# --------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/patchset.py",
        description="Apply, check, revert and export the fork's patch set. TREE is "
        "the dir that contains vllm/ (unpacked wheel, site-packages, vLLM checkout).",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=REPO_ROOT,
        help="the fork repo (default: %(default)s)",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("apply", help="apply the patch set to TREE").add_argument("tree")
    p = sub.add_parser("check", help="print TREE's state; exit 1 unless base/applied")
    p.add_argument("tree")
    p.add_argument("--expect", choices=["base", "applied"], help="exit 1 otherwise")
    sub.add_parser("revert", help="restore TREE's base content").add_argument("tree")
    p = sub.add_parser("diff", help="print the whole fork as a git diff vs the base")
    p.add_argument(
        "tree", nargs="?", help="stock files from this TREE (base or applied)"
    )
    p.add_argument("--wheel", help="stock files from this wheel")
    p.add_argument(
        "--cache-dir", default=DEFAULT_CACHE_DIR, help="default: %(default)s"
    )
    p = sub.add_parser("pin", help="rewrite patches/base.json from the base wheel")
    p.add_argument("--wheel", required=True)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "pin":
            pin(args.wheel, args.root)
            return 0
        ps = Patchset.load(args.root)
        if args.cmd == "apply":
            apply(args.tree, ps)
        elif args.cmd == "revert":
            revert(args.tree, ps)
        elif args.cmd == "diff":
            if args.tree and args.wheel:
                parser.error("diff: give TREE or --wheel, not both")
            sys.stdout.write(
                export_diff(
                    ps, tree=args.tree, wheel=args.wheel, cache_dir=args.cache_dir
                )
            )
        else:
            st = inspect_tree(args.tree, ps)
            print(st.describe())
            if st.state in ("base", "applied"):
                for f in st.files:
                    print(f"  {f.state:8} {f.path}")
            wanted = (args.expect,) if args.expect else ("base", "applied")
            return 0 if st.state in wanted else 1
    except PatchsetError as e:
        print(f"patchset: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
