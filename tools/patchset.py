#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Apply, check, revert and export the fork's patch set on a vLLM tree.

A TREE is the directory that CONTAINS the ``vllm/`` package: an unpacked
wheel, a site-packages directory, or a git checkout of vLLM at the base tag.

The patch set lives in the repo root (``--root``, default: this checkout):

- ``patches/series``: patch file names ``NNNN-topic.patch``, one a line,
  applied in order; the numbers increase down the file (``new TOPIC`` prints
  the next free name);
- ``patches/NNNN-topic.patch``: git-style diffs (``a/vllm/...``,
  ``b/vllm/...``) that modify stock files (new files go under ``vllm/``);
- ``patches/base.json``: the pinned base, with the sha256 of every stock file
  a patch touches;
- ``vllm/``: the files the fork adds, copied to the same path in the TREE.

Contracts:

- A TREE's state is read from its files alone, nothing else records it:
  ``base`` (every touched file has its pinned hash, no added file exists),
  ``applied`` (every touched file equals the series applied to the base and
  every added file equals the fork's copy), ``wrong-base`` or
  ``half-applied``.
- The series is applied by ONE ``git apply`` of the patches concatenated,
  which writes nothing unless every hunk applies, on copies of the touched
  files in a temp dir (reversed with ``-R`` to recover a patched file's base).
  Only when it fails are the patches tried one by one, to name the culprit.
- ``apply`` and ``revert`` refuse any other state before writing a byte, with
  a message naming each file, what was found, what was expected and what to
  do (the TREE's own vLLM version included, when it records one).
- The TREE itself is written here, not by ``git apply``: git unlinks every
  target before it creates any, restores nothing when a write fails or is
  interrupted, and takes file modes from the patch. Here each file is
  replaced by rename, keeping its mode; on any error or interrupt the files
  already replaced are restored and the error says the tree is unchanged.
  Existing files are never written in place (new inode + rename), so a
  hard-link copy of a venv (``tools/overlay.py``) never changes the venv.

Python API: ``Patchset.load``, ``inspect_tree``, ``apply``, ``revert``,
``export_diff``, ``stock_files``, ``pin``, ``next_patch_name``,
``tree_version``, ``wheel_version``; errors are ``PatchsetError``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE_DIR = REPO_ROOT / "build" / "cache"
CLI = "tools/patchset.py"

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
_TOPIC = r"[a-z0-9]+(?:-[a-z0-9]+)*"
_PATCH_NAME = re.compile(rf"^(\d{{4}})-({_TOPIC})\.patch$")
_VERSION_PY = re.compile(r"^__version__\s*=(?:\s*version\s*=)?\s*['\"]([^'\"]+)", re.M)
_METADATA_VERSION = re.compile(rb"^Version:[ \t]*(\S+)", re.M)
_REBASE_DOC = 'CONTRIBUTING.md, "Rebasing onto a newer vLLM"'

Log = Callable[[str], None]


class PatchsetError(Exception):
    """A refusal or failure; the message names the file(s) concerned, what
    was found and expected, and what to do."""


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
                f"{base_path}: missing; create it with `{CLI} pin --wheel WHEEL`"
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
                        f"run `{CLI} pin --wheel WHEEL`"
                    )
        return cls(root, base, patches, touches, added)

    @property
    def touched(self) -> tuple[str, ...]:
        """Every stock file some patch modifies, sorted."""
        return tuple(sorted({rel for paths in self.touches.values() for rel in paths}))

    @property
    def base_files(self) -> Mapping[str, str]:
        return self.base["files"]  # type: ignore[return-value]

    @property
    def version(self) -> str:
        """The pinned base's vLLM version (``vllm_version`` in base.json)."""
        return str(self.base.get("vllm_version", "?"))

    @property
    def base_json(self) -> Path:
        return self.root / "patches" / "base.json"

    def digest(self) -> str:
        """sha256 over everything that defines the fork's content."""
        h = hashlib.sha256()
        for path in (self.base_json, self.root / "patches" / "series"):
            h.update(path.read_bytes() if path.is_file() else b"-")
        for patch in self.patches:
            h.update(patch.name.encode() + b"\0" + patch.read_bytes())
        for rel, src in sorted(self.added.items()):
            h.update(rel.encode() + b"\0" + src.read_bytes())
        return h.hexdigest()


def _numbers_in_use(pdir: Path) -> list[int]:
    return [int(m[1]) for p in pdir.glob("*.patch") if (m := _PATCH_NAME.match(p.name))]


def _read_series(pdir: Path) -> tuple[Path, ...]:
    """The series' patches, in order. Refuses a name that is not
    ``NNNN-topic.patch``, a missing file, and a number that does not increase
    down the series (a repeated number included)."""
    series = pdir / "series"
    if not series.is_file():
        raise PatchsetError(f"{series}: missing (one patch file name per line)")
    patches: list[Path] = []
    lines: dict[str, int] = {}
    for lineno, raw in enumerate(series.read_text().splitlines(), 1):
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        where = f"{series}:{lineno}: {name}"
        m = _PATCH_NAME.match(name)
        if m is None:
            raise PatchsetError(
                f"{where}: expected a name NNNN-topic.patch (four digits, then "
                f"lowercase words joined by '-'); `{CLI} new TOPIC` prints the "
                "next free one"
            )
        if not (pdir / name).is_file():
            raise PatchsetError(f"{where}: no such patch file in {pdir}")
        if name in lines:
            raise PatchsetError(f"{where}: listed twice (line {lines[name]} too)")
        prev = patches[-1].name if patches else None
        if prev is not None and int(m[1]) <= int(prev[:4]):
            how = "repeats the number of" if m[1] == prev[:4] else "comes after"
            free = f"{max(_numbers_in_use(pdir)) + 1:04d}-{m[2]}.patch"
            raise PatchsetError(
                f"{where}: {how} {prev} (line {lines[prev]}); expected numbers "
                f"that increase down the series. Rename this one (e.g. `git mv "
                f"patches/{name} patches/{free}`) and fix this line."
            )
        lines[name] = lineno
        patches.append(pdir / name)
    return tuple(patches)


def next_patch_name(topic: str, root: str | os.PathLike[str] = REPO_ROOT) -> str:
    """``NNNN-TOPIC.patch``, NNNN one above every number in use in
    ``patches/`` (in the series or not yet). The series must be valid."""
    if re.fullmatch(_TOPIC, topic) is None:
        raise PatchsetError(
            f"TOPIC {topic!r}: expected lowercase words joined by '-', "
            "e.g. 'forward-context-dummy-run'"
        )
    pdir = Path(root) / "patches"
    _read_series(pdir)
    return f"{max(_numbers_in_use(pdir), default=0) + 1:04d}-{topic}.patch"


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


def _git(
    args: list[str], cwd: Path, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
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
        [git, *args],
        cwd=cwd,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
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


def _git_apply(
    work: Path, patches: Sequence[Path], *, reverse: bool = False, only: str = ""
) -> str | None:
    """Apply ``patches`` in ``work`` with one ``git apply`` of their
    concatenation, so that nothing is written unless every hunk applies
    (``-R`` undoes the whole stream: the last patch first). None on success,
    else git's stderr."""
    args = ["apply", "-p1", "--whitespace=nowarn"]
    args += ["-R"] if reverse else []
    args += [f"--include={only}"] if only else []
    texts = [p.read_text() for p in patches]
    r = _git(args, work, "".join(t if t.endswith("\n") else t + "\n" for t in texts))
    return None if r.returncode == 0 else r.stderr.strip()


def _patch_contents(base: Mapping[str, bytes], ps: Patchset) -> dict[str, bytes]:
    """The touched files after applying the whole series to ``base``."""
    with _scratch(base) as work:
        if (err := _git_apply(work, ps.patches)) is not None:
            raise PatchsetError(_name_failing_patch(work, ps, err))
        return {rel: (work / rel).read_bytes() for rel in ps.touched}


def _name_failing_patch(work: Path, ps: Patchset, err: str) -> str:
    """The message for a series that does not apply: the first patch that
    fails once the ones before it are applied (``work`` is scratch)."""
    for patch in ps.patches:
        if (one := _git_apply(work, [patch])) is not None:
            return (
                f"{patch}: does not apply to the base with the patches before it "
                f"in the series applied; git apply says:\n{one}"
            )
    return f"{ps.root / 'patches' / 'series'}: the series does not apply:\n{err}"


def _recover_base(rel: str, data: bytes, ps: Patchset) -> bytes | None:
    """Base content of ``rel`` if ``data`` is exactly the series applied to
    the pinned base (reverse-apply, check the hash, apply again); else None."""
    patches = [p for p in ps.patches if rel in ps.touches[p]]
    with _scratch({rel: data}) as work:
        if _git_apply(work, patches, reverse=True, only=rel) is not None:
            return None
        base = (work / rel).read_bytes()
        if sha256_bytes(base) != ps.base_files[rel]:
            return None
        if _git_apply(work, patches, only=rel) is not None:
            return None
        return base if (work / rel).read_bytes() == data else None


# --------------------------------------------------------------------------
# Versions a tree or a wheel records


def _public(version: str) -> str:
    return version.split("+", 1)[0]


def tree_version(tree: str | os.PathLike[str]) -> tuple[str, str] | None:
    """(vLLM version, where it was read) as TREE records it:
    ``vllm/_version.py``, else a ``vllm-*.dist-info/METADATA``; None if
    neither says (a source checkout that was never built)."""
    root = Path(tree)
    with contextlib.suppress(OSError):
        if m := _VERSION_PY.search((root / "vllm" / "_version.py").read_text()):
            return m[1], "vllm/_version.py"
    for meta in sorted(root.glob("vllm-*.dist-info/METADATA")):
        with contextlib.suppress(OSError):
            if m := _METADATA_VERSION.search(meta.read_bytes().split(b"\n\n")[0]):
                return m[1].decode(), meta.relative_to(root).as_posix()
    return None


def _open_wheel(wheel: Path) -> zipfile.ZipFile:
    if not wheel.is_file():
        raise PatchsetError(f"{wheel}: no such wheel")
    try:
        return zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise PatchsetError(f"{wheel}: not a wheel (expected a zip file: {e})") from e


def wheel_version(wheel: str | os.PathLike[str]) -> tuple[str, str]:
    """(vLLM version, where it was read) of a wheel: its dist-info dir."""
    with _open_wheel(Path(wheel)) as zf:
        infos = {n.split("/")[0] for n in zf.namelist() if n.startswith("vllm-")}
    infos = {n for n in infos if n.endswith(".dist-info")}
    if not infos:
        raise PatchsetError(f"{wheel}: no vllm-*.dist-info; not a vLLM wheel")
    info = min(infos)
    return info.removeprefix("vllm-").removesuffix(".dist-info"), info


def check_wheel_version(ps: Patchset, wheel: str | os.PathLike[str]) -> None:
    """Refuse a wheel of another vLLM version than the base, naming both."""
    found, source = wheel_version(wheel)
    if _public(found) != ps.version:
        raise PatchsetError(
            f"{wheel}: this is vLLM {found} (from {source}), not vLLM {ps.version}, "
            f"the base the patch set is pinned to ({ps.base_json}). Use "
            f"{ps.base['wheel']} (`make fetch` downloads it into build/cache/); "
            f"to move the fork to vLLM {found}, see {_REBASE_DOC}."
        )


# --------------------------------------------------------------------------
# Tree state


@dataclasses.dataclass(frozen=True)
class FileState:
    path: str
    added: bool  # a file the fork adds (else a stock file a patch modifies)
    state: str  # base | applied | missing | unknown | differs
    found_sha256: str | None
    expected_sha256: str  # the pinned base hash, or the fork copy's hash

    def describe(self) -> str:
        """This file's line in a state report."""
        return {
            (False, "base"): "stock file, not patched",
            (False, "applied"): "stock file, patched",
            (False, "missing"): (
                f"stock file, missing (expected base sha256 {self.expected_sha256})"
            ),
            (False, "unknown"): (
                f"stock file, changed: expected base sha256 {self.expected_sha256}, "
                f"found {self.found_sha256}, which is neither the base nor the "
                "patch set applied to it"
            ),
            (True, "missing"): "added file, missing",
            (True, "applied"): "added file, present",
            (True, "differs"): (
                f"added file, differs from the fork's copy (found sha256 "
                f"{self.found_sha256}, fork {self.expected_sha256})"
            ),
        }[(self.added, self.state)]


def _lines(files: Iterable[FileState]) -> list[str]:
    """A line per file, except that added files sharing a dir and a state
    (present, missing) share one line, naming them."""
    lines: list[str] = []
    groups: dict[tuple[str, str], list[str]] = {}
    for f in files:
        if f.added and f.state != "differs":
            parent, _, name = f.path.rpartition("/")
            groups.setdefault((parent, f.describe()), []).append(name)
        else:
            lines.append(f"  {f.path}: {f.describe()}")
    for (parent, what), names in groups.items():
        if len(names) == 1:
            lines.append(f"  {parent}/{names[0]}: {what}")
        else:
            what = what.replace("added file,", f"{len(names)} added files,")
            lines.append(f"  {parent}/: {what}: {' '.join(names)}")
    return lines


@dataclasses.dataclass(frozen=True)
class TreeState:
    tree: Path
    state: str  # base | applied | wrong-base | half-applied
    files: tuple[FileState, ...]
    base_content: Mapping[str, bytes]
    patched_content: Mapping[str, bytes]
    ps: Patchset = dataclasses.field(repr=False, compare=False)
    version: tuple[str, str] | None = None  # (version, where), see tree_version

    def describe(self) -> str:
        """One line for ``base`` and ``applied``; for the other states what
        was found (file by file), what was expected and what to do."""
        n = sum(not f.added for f in self.files)
        v, m = self.ps.version, len(self.files) - n
        if self.state == "base":
            return (
                f"{self.tree}: base: stock vLLM {v}, the patch set not applied "
                f"({n} stock file(s) to patch, {m} file(s) to add)"
            )
        if self.state == "applied":
            return (
                f"{self.tree}: applied: vLLM {v} with the patch set "
                f"({n} stock file(s) patched, {m} file(s) added)"
            )
        head, shown, todo = self._problem()
        return "\n".join([f"{head}; nothing was written. Files:", *_lines(shown), todo])

    def _problem(self) -> tuple[str, Sequence[FileState], str]:
        """(what was found, the files to list, what to do) for a refusal."""
        v, wheel, tree = self.ps.version, self.ps.base["wheel"], self.tree
        bad = [
            f for f in self.files if not f.added and f.state in ("missing", "unknown")
        ]
        present = [f for f in self.files if f.added and f.state != "missing"]
        again = (
            f"put the stock vLLM {v} files back (a site-packages: `pip install "
            f"--force-reinstall --no-deps vllm=={v}`; an unpacked wheel: unpack "
            f"{wheel} again; a vLLM checkout: `git checkout v{v} -- vllm`)"
            + ", delete the added files marked present or differs above" * bool(present)
            + f", then run `{CLI} apply {tree}`"
        )
        if self.state == "half-applied":
            head = f"{tree}: half-applied: part of the patch set is here, part is not"
            todo = (
                f"to get a clean tree, {again}. An added file that differs holds "
                "edits: copy it away first to keep them."
            )
            return head, self.files, f"What to do: {todo}"
        if self.version and _public(self.version[0]) != v:
            found, source = self.version
            head = (
                f"{tree}: this is vLLM {found} (from {source}), not vLLM {v}, the "
                f"base the patch set is pinned to ({self.ps.base_json})"
            )
            todo = (
                f"apply it to a vLLM {v} tree (`pip install --no-deps vllm=={v}`, "
                f"or unpack {wheel}); to move the fork to vLLM {found}, see "
                f"{_REBASE_DOC}."
            )
            return head, bad, f"What to do: {todo}"
        n_ok = sum(f.state == "applied" for f in self.files if not f.added)
        if n_ok or present:
            head = (
                f"{tree}: the patch set is applied here ({n_ok} stock file(s) "
                f"patched), but {len(bad)} stock file(s) changed since: neither the "
                f"pinned base vLLM {v} nor the patch set applied to it"
            )
            todo = (
                'to keep the change, make it a patch (CONTRIBUTING.md, "Adding a '
                f'patch"); to drop it, {again}.'
            )
            return head, [*bad, *present], f"What to do: {todo}"
        says = "The tree records no version (no vllm/_version.py or dist-info). "
        if self.version:
            says = (
                f"The tree says it is vLLM {self.version[0]} (from "
                f"{self.version[1]}): these files changed after it was installed, "
                f"or it is another build of {v}. "
            )
        head = (
            f"{tree}: not the pinned base vLLM {v} ({self.ps.base_json}): "
            f"{len(bad)} stock file(s) differ from it and from the patch set "
            "applied to it"
        )
        return head, bad, f"{says}What to do: {again}."

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


def _touched_state(rel: str, data: bytes | None, ps: Patchset):
    """(FileState, base content or None) of one stock file the series touches."""
    expected = ps.base_files[rel]
    if data is None:
        return FileState(rel, False, "missing", None, expected), None
    found = sha256_bytes(data)
    if found == expected:
        return FileState(rel, False, "base", found, expected), data
    if (recovered := _recover_base(rel, data, ps)) is not None:
        return FileState(rel, False, "applied", found, expected), recovered
    return FileState(rel, False, "unknown", found, expected), None


def inspect_tree(tree: str | os.PathLike[str], ps: Patchset | None = None) -> TreeState:
    """Classify every file the patch set touches or adds, and the TREE."""
    ps = ps or Patchset.load()
    root = _tree_root(tree)
    files: list[FileState] = []
    base_content: dict[str, bytes] = {}
    for rel in ps.touched:
        fs, base = _touched_state(rel, _read_or_none(root / rel), ps)
        files.append(fs)
        if base is not None:
            base_content[rel] = base
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
    files.sort(key=lambda f: (f.added, f.path))
    version = tree_version(root)
    return TreeState(root, overall, tuple(files), base_content, patched, ps, version)


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


def _write_one(
    target: Path, data: bytes, mode: int | None, undo: list[Callable[[], None]]
) -> None:
    """Replace (or create, with its missing parent dirs) ``target``,
    appending to ``undo`` each step's undo as soon as the step is done."""
    if target.exists():
        old, old_mode = target.read_bytes(), stat.S_IMODE(target.stat().st_mode)
        _place(target, data, old_mode if mode is None else mode)
        undo.append(lambda: _atomic_write(target, old, old_mode))
        return
    parents = (target.parent, *target.parent.parents)
    for d in reversed([d for d in parents if not d.exists()]):
        d.mkdir()
        undo.append(d.rmdir)
    _place(target, data, 0o644 if mode is None else mode)
    undo.append(target.unlink)


def _transaction(
    root: Path,
    verb: str,
    writes: Mapping[str, tuple[bytes, int | None]],
    removes: Iterable[str],
) -> None:
    """Write and remove files under ``root``; on any exception undo what was
    done, then re-raise (an OSError as a PatchsetError saying so)."""
    undo: list[Callable[[], None]] = []
    rel = ""
    try:
        for rel, (data, mode) in writes.items():
            _write_one(root / rel, data, mode, undo)
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
                f"{root}: {verb} failed at {rel} ({exc!r}) and the rollback failed "
                f"too; the tree may be half-applied (`{CLI} check {root}` tells): "
                + "; ".join(failed)
            ) from exc
        if isinstance(exc, OSError):
            raise PatchsetError(_write_error(root, verb, rel, exc)) from exc
        raise


def _write_error(root: Path, verb: str, rel: str, exc: OSError) -> str:
    where = exc.filename or root / rel
    msg = (
        f"{root}: {verb} stopped at {rel}: {exc.strerror or exc} ({where}); "
        "rolled back, the tree is unchanged. "
    )
    if exc.errno in (errno.EACCES, errno.EPERM):
        owner = next(d for d in (root / rel).parents if d.exists()).stat().st_uid
        return msg + (
            f"Expected write access to {root / 'vllm'} and below (owned by uid "
            f"{owner}; this process runs as uid {os.getuid()}): run as the owner "
            f"(e.g. with sudo), or {verb} a tree you own, such as a venv of your "
            "own or an unpacked wheel."
        )
    if exc.errno == errno.EROFS:
        return msg + f"The file system is read-only: {verb} a writable copy."
    return msg + "Fix the cause above and run the command again."


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
    was already applied; PatchsetError (nothing written) for any other state
    or a failed write (rolled back)."""
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
    _transaction(st.tree, "apply", writes, ())
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
    (nothing written) unless TREE is fully applied or fully base, or for a
    failed write (rolled back)."""
    ps = ps or Patchset.load()
    st = inspect_tree(tree, ps)
    if st.state == "base":
        log(f"{st.tree}: already at the base; nothing written")
        return False
    st.require("applied")
    writes = {rel: (st.base_content[rel], None) for rel in ps.touched}
    _transaction(st.tree, "revert", writes, sorted(ps.added))
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
    out: dict[str, bytes] = {}
    with _open_wheel(wheel) as zf:
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
    patched), a wheel of the base version, or the base wheel in
    ``cache_dir``; hashes verified."""
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
                "base wheel into the cache with `make fetch`"
            )
    check_wheel_version(ps, wheel)
    files = read_wheel_files(wheel, ps.touched)
    for rel, data in files.items():
        found = sha256_bytes(data)
        if found != ps.base_files[rel]:
            raise PatchsetError(
                f"{wheel}: {rel}: expected base sha256 {ps.base_files[rel]}, found "
                f"{found}. The wheel is vLLM {ps.version} but not the pinned build "
                f"{ps.base['wheel']} ({ps.base_json}); use that one (`make fetch` "
                "puts it in build/cache/)."
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
    out = ps.base_json
    out.write_text(json.dumps(data, indent=2) + "\n")
    log(f"{out}: pinned {wheel.name} and {len(files)} stock file(s)")
    return data


# --------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=CLI,
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
    p = sub.add_parser("new", help="print the next free patch name, NNNN-TOPIC.patch")
    p.add_argument("topic", help="lowercase words joined by '-'")
    return parser


def _check(tree: str, expect: str | None, ps: Patchset) -> int:
    st = inspect_tree(tree, ps)
    print(st.describe())
    if st.state in ("base", "applied"):
        for f in st.files:
            print(f"  {f.state:8} {f.path}")
    wanted = (expect,) if expect else ("base", "applied")
    if st.state in wanted:
        return 0
    if expect is not None:
        todo = {
            ("applied", "base"): f"run `{CLI} apply {st.tree}`",
            ("base", "applied"): f"run `{CLI} revert {st.tree}`",
        }.get((expect, st.state), "see 'What to do' above")
        print(
            f"patchset: check: expected {expect}, found {st.state}: {todo}",
            file=sys.stderr,
        )
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.cmd == "pin":
            pin(args.wheel, args.root)
            return 0
        if args.cmd == "new":
            print(next_patch_name(args.topic, args.root))
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
            return _check(args.tree, args.expect, ps)
    except PatchsetError as e:
        print(f"patchset: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        done = "nothing was written"
        if args.cmd in ("apply", "revert"):
            done = f"rolled back, {args.tree} is unchanged"
        print(f"patchset: interrupted; {done}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
