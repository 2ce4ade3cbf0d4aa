#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Check, apply, revert or export the fork's patch set on a vLLM TREE.

TREE is the dir that contains vllm/ (unpacked wheel, site-packages, checkout).
The fork: patches/series (diffs of stock files), patches/base.json (the pinned
wheel, the sha256 of each stock file a patch modifies), vllm/ (added files).
The series goes through one `git apply` in a scratch dir, never in TREE: git
unlinks what it patches and restores nothing on failure. TREE's files are then
replaced one by one by new inodes (an overlay is a hard-link copy of a venv),
and on any error or interrupt the files already replaced are restored.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import csv
import dataclasses
import errno
import hashlib
import io
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO_ROOT / "build" / "cache"
CLI = "tools/patchset.py"
TOPIC = r"[a-z0-9]+(?:-[a-z0-9]+)*"
PATCH_NAME = re.compile(rf"\d{{4}}-{TOPIC}\.patch")
NOT_A_CHANGE = ("new file", "deleted file", "rename ", "copy ", "--- /dev", "+++ /dev")
REBASE = 'see CONTRIBUTING.md, "Rebasing onto a newer vLLM"'


class PatchsetError(Exception):
    """A refusal; the message names the file, what was found and expected."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclasses.dataclass(frozen=True)
class Patchset:
    """The fork in ``root``: patches in series order, the stock files they
    modify (``touched``) and the files it adds (``added``), relative paths."""

    root: Path
    patches: tuple[Path, ...]
    touched: tuple[str, ...]
    added: tuple[str, ...]
    base: dict  # patches/base.json
    base_files: dict[str, str]  # touched file -> its pinned sha256
    version: str  # the pinned vLLM version
    digest: str  # sha256 over base.json, the patches and the added files

    @classmethod
    def load(cls, root: str | os.PathLike[str] = REPO_ROOT, *, pinned=True) -> Patchset:
        """Read and validate; ``pinned``: base.json pins every touched file."""
        root = Path(root).resolve()
        patches = _read_series(root / "patches")
        touched = tuple(sorted({rel for p in patches for rel in _modified(p)}))
        added = tuple(sorted(_added_files(root)))
        base_json, base = root / "patches" / "base.json", {"files": {}}
        if base_json.is_file():
            base = json.loads(base_json.read_text())
        elif pinned:
            raise PatchsetError(f"{base_json}: missing; run `{CLI} pin --wheel WHEEL`")
        for rel in touched:
            if rel in added or (pinned and rel not in base["files"]):
                why = "vllm/ adds it too" if rel in added else f"{base_json} lacks it"
                raise PatchsetError(f"a patch modifies {rel}, but {why}")
        h = hashlib.sha256()
        for path in (base_json, *patches, *(root / rel for rel in added)):
            data = path.read_bytes() if path.is_file() else b""
            h.update(str(path.relative_to(root)).encode() + b"\0" + data + b"\0")
        version, digest = base.get("vllm_version", "?"), h.hexdigest()
        return cls(root, patches, touched, added, base, base["files"], version, digest)


def _added_files(root: Path):
    for path in root.glob("vllm/**/*"):
        rel = path.relative_to(root).as_posix()
        if rel == "vllm/__init__.py":
            raise PatchsetError(f"{path}: would shadow the stock vllm/__init__.py")
        hidden = any(part[0] == "." or part == "__pycache__" for part in rel.split("/"))
        if path.is_file() and not hidden and not rel.endswith((".pyc", "~", ".rej")):
            yield rel


def _read_series(pdir: Path) -> tuple[Path, ...]:
    series, patches = pdir / "series", []
    for n, line in enumerate(series.read_text().splitlines(), 1):
        if not (name := line.split("#", 1)[0].strip()):
            continue
        where = f"{series}:{n}: {name}"
        if not PATCH_NAME.fullmatch(name) or not (pdir / name).is_file():
            raise PatchsetError(f"{where}: expected an NNNN-topic.patch file in {pdir}")
        if patches and name[:4] <= patches[-1].name[:4]:
            raise PatchsetError(f"{where}: not numbered above {patches[-1].name}")
        patches.append(pdir / name)
    if stray := {p.name for p in pdir.glob("*.patch")} - {p.name for p in patches}:
        raise PatchsetError(f"{pdir}: {', '.join(sorted(stray))}: not in {series}")
    return tuple(patches)


def _modified(patch: Path) -> list[str]:
    """The stock paths ``patch`` modifies; it may not add, delete or rename."""
    paths, in_header = [], False
    for n, line in enumerate(patch.read_text().splitlines(), 1):
        if line.startswith("diff --git "):
            a, _, b = line[11:].partition(" ")
            if a[2:] != b[2:] or not a.startswith("a/vllm/") or b[:2] != "b/":
                raise PatchsetError(
                    f"{patch}:{n}: expected diff --git a/vllm/X b/vllm/X"
                )
            paths.append(b[2:])
        elif in_header and line.startswith(NOT_A_CHANGE):
            raise PatchsetError(f"{patch}:{n}: {line}: patches only modify files")
        in_header = line.startswith("diff --git ") or in_header and line[:2] != "@@"
    if not paths:
        raise PatchsetError(f"{patch}: no 'diff --git' line")
    return paths


def next_patch_name(topic: str, root: str | os.PathLike[str] = REPO_ROOT) -> str:
    """NNNN-TOPIC.patch, NNNN one above every patch file in patches/."""
    if not re.fullmatch(TOPIC, topic):
        raise PatchsetError(f"{topic!r}: expected lowercase words joined by '-'")
    names = [p.name for p in Path(root, "patches").glob("*.patch")]
    top = max((int(n[:4]) for n in names if PATCH_NAME.fullmatch(n)), default=0)
    return f"{top + 1:04d}-{topic}.patch"


def _git(args: list[str], cwd: Path, stdin: str = "") -> subprocess.CompletedProcess:
    """git in ``cwd`` only (no repo above it), without the user's config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env |= {"GIT_CEILING_DIRECTORIES": str(cwd.parent), "GIT_CONFIG_NOSYSTEM": "1"}
    env |= {"GIT_CONFIG_GLOBAL": os.devnull}
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, input=stdin, capture_output=True, text=True
    )


def _write_all(work: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_bytes(data)


def _git_apply(patches, files: dict[str, bytes], reverse=False) -> dict | str:
    """``files`` with ``patches`` applied (reverse: undone) by one `git apply`
    of their concatenation, in a scratch dir; else what git said."""
    stdin = "".join(p.read_text().rstrip("\n") + "\n" for p in patches)
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        _write_all(work := Path(tmp, "work"), files)
        args = ["apply", *(f"--include={rel}" for rel in files), *["-R"] * reverse]
        if files and (r := _git(args, work, stdin)).returncode:
            return r.stderr.strip()
        return {rel: (work / rel).read_bytes() for rel in files}


def patched_files(ps: Patchset, base: dict[str, bytes]) -> dict[str, bytes]:
    """``base`` (touched files) with the series applied; else the culprit."""
    if isinstance(out := _git_apply(ps.patches, base), dict):
        return out
    for i, patch in enumerate(ps.patches):
        if isinstance(err := _git_apply(ps.patches[: i + 1], base), str):
            msg = "does not apply to the base with the patches before it"
            raise PatchsetError(f"{patch}: {msg}; git apply says:\n{err}")
    raise PatchsetError(f"the series does not apply:\n{out}")


def tree_version(tree: Path) -> tuple[str, str] | None:
    """(vLLM version, the file that says so), if TREE records one."""
    says = re.compile(r"^(__version__ = (version = )?['\"]|Version: )([^'\"\s]+)", re.M)
    for path in [tree / "vllm/_version.py", *tree.glob("vllm-*.dist-info/METADATA")]:
        if path.is_file() and (m := says.search(path.read_text(errors="replace"))):
            return m[3], str(path.relative_to(tree))
    return None


@dataclasses.dataclass(frozen=True)
class TreeState:
    tree: Path
    state: str  # base | applied | mixed | wrong-base
    files: dict[str, str]  # touched or added file -> base | applied | wrong
    found: dict[str, str | None]  # file -> its sha256 in TREE, None if absent
    base: dict[str, bytes]  # touched file -> its base content, where known
    fork: dict[str, bytes]  # file -> its content with the patch set, where known
    ps: Patchset

    def describe(self, want: str | None = None) -> str:
        """The state, a line per file that is neither base nor applied (or
        not ``want``): what was found and expected; for a mixed tree or a
        wrong base, what to do."""
        v = self.ps.version
        lines = [f"{self.tree}: {self.state} (base: vLLM {v})"]
        for rel, state in self.files.items():
            if state == "wrong" or want not in (None, state):
                base = self.ps.base_files.get(rel, "no file")
                # The patched file's hash follows from its base's bytes,
                # unknown where the tree holds neither.
                fork = (
                    f"applied {sha256(self.fork[rel])}"
                    if rel in self.fork
                    else "applied (that base with the patch set)"
                )
                exp = {"base": f"base {base}", "applied": fork}
                exp = exp.get(want) or " or ".join(exp.values())
                found = self.found[rel] or "no file"
                lines.append(f"  {rel}: {state}, found {found}; expected {exp}")
        tree = shlex.quote(str(self.tree))
        if self.state == "mixed":
            lines.append(
                f"Complete it with `{CLI} apply {tree}`, or bring it back to "
                f"the base with `{CLI} revert {tree}`."
            )
        if self.state != "wrong-base":
            return "\n".join(lines)
        tv = tree_version(self.tree)
        if tv:
            lines.append(f"The tree says it is vLLM {tv[0]} ({tv[1]}).")
        if tv and tv[0].split("+")[0] != v:
            lines.append(
                f"Install vLLM {v} with its dependencies (`pip install "
                f"vllm=={v}`), then apply the patch set."
            )
        else:
            lines.append(
                f"Restore vLLM {v}'s files (`pip install --force-reinstall "
                f"--no-deps vllm=={v}`), or make your change a patch."
            )
        return "\n".join(lines)


def inspect_tree(tree: str | os.PathLike[str], ps: Patchset | None = None) -> TreeState:
    """Classify each file the patch set touches or adds, then TREE."""
    ps, root = ps or Patchset.load(), Path(tree).absolute()
    if not (root / "vllm").is_dir():
        raise PatchsetError(f"{root}: no vllm/ here; TREE is the dir containing vllm/")
    data = {}
    for rel in (*ps.touched, *ps.added):
        data[rel] = (root / rel).read_bytes() if (root / rel).is_file() else None
    found = {rel: d and sha256(d) for rel, d in data.items()}
    base = {rel: data[rel] for rel in ps.touched if found[rel] == ps.base_files[rel]}
    # The base of the others: the series undone, at once, else file by file.
    others = {rel: data[rel] for rel in ps.touched if rel not in base and data[rel]}
    undone = _git_apply(ps.patches, others, reverse=True)
    if isinstance(undone, str):
        tries = [_git_apply(ps.patches, {r: d}, True) for r, d in others.items()]
        undone = {r: d for t in tries if isinstance(t, dict) for r, d in t.items()}
    base.update({r: d for r, d in undone.items() if sha256(d) == ps.base_files[r]})
    fork = patched_files(ps, base)
    fork.update({rel: (ps.root / rel).read_bytes() for rel in ps.added})
    files = {}
    for rel, d in data.items():
        files[rel] = "base" if found[rel] == ps.base_files.get(rel) else "wrong"
        if d is not None and d == fork.get(rel):
            files[rel] = "applied"
    kinds = set(files.values()) or {"base"}
    state = "mixed" if len(kinds) > 1 else kinds.pop()
    state = "wrong-base" if "wrong" in files.values() else state
    return TreeState(root, state, files, found, base, fork, ps)


def _swap(path: Path, data: bytes | None, mode: int) -> None:
    """Put ``data`` at ``path`` as a new inode, by rename (None: remove it)."""
    if data is None:
        return path.unlink()
    tmp = path.with_name(f".{path.name}.patchset-{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _drop_empty_dirs(root: Path, removed) -> None:
    """After a revert, the bytecode of removed files and the dirs left empty go."""
    for path in (root / rel for rel in removed):
        for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
            pyc.unlink()
    dirs = {
        d for rel in removed for d in (root / rel).parents if root / "vllm" in d.parents
    }
    for d in sorted(dirs, key=lambda d: -len(d.parts)):
        for empty in (d / "__pycache__", d):
            with contextlib.suppress(OSError):
                empty.rmdir()


def _commit(root: Path, verb: str, changes: dict[str, tuple[bytes | None, int]]):
    """Make ``changes`` (file -> (data, None: remove; mode, 0: keep)); on any
    exception undo what was done, then re-raise (OSError as PatchsetError)."""
    undo, new_dirs, rel = [], [], ""
    try:
        for rel, (data, mode) in changes.items():
            path = root / rel
            old = path.read_bytes() if path.exists() else None
            old_mode = stat.S_IMODE(path.stat().st_mode) if old is not None else 0o644
            new_dirs += reversed([d for d in path.parents if not d.exists()])
            path.parent.mkdir(parents=True, exist_ok=True)
            _swap(path, data, mode or old_mode)
            undo.append((path, old, old_mode))
    except BaseException as exc:
        for path, old, old_mode in reversed(undo):
            _swap(path, old, old_mode)  # if this fails, exc shows as its context
        for d in reversed(new_dirs):
            d.rmdir()
        if not isinstance(exc, OSError):
            raise
        hint = exc.errno in (errno.EACCES, errno.EPERM) and (
            f"; expected write access to {root / 'vllm'}: run as its owner "
            f"(this is uid {os.getuid()}), or {verb} a tree you own"
        )
        raise PatchsetError(
            f"{root}: {verb} stopped at {rel}: {exc}; rolled back, the tree is "
            f"unchanged{hint or ''}"
        ) from exc


def _record(tree: Path) -> str | None:
    """The RECORD of TREE's one vLLM dist-info (pip's list of the files it
    removes on uninstall), relative to TREE; None where there is none."""
    found = sorted(tree.glob("vllm-*.dist-info/RECORD"))
    return found[0].relative_to(tree).as_posix() if len(found) == 1 else None


def _record_with(text: str, added: dict[str, bytes | None]) -> str:
    """RECORD ``text`` without rows for the files of ``added``, then a row
    for each that exists (data not None), as pip writes them, with the line
    ends ``text`` has (pip's are CRLF, a wheel's often LF)."""
    end = "\r\n" if "\r\n" in text else "\n"
    lines = [
        line
        for line in text.splitlines(keepends=True)
        if next(csv.reader([line]), [""])[0] not in added
    ]
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += end
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator=end)
    for rel, data in added.items():
        if data is not None:
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
            writer.writerow([rel, f"sha256={digest.decode().rstrip('=')}", len(data)])
    return "".join(lines) + rows.getvalue()


def _bring_to(want: str, tree, ps: Patchset | None, log) -> bool:
    st = inspect_tree(tree, ps := ps or Patchset.load())
    if st.state == "wrong-base":
        raise PatchsetError(f"{st.describe()}\nNothing was written.")
    if not (todo := [rel for rel, state in st.files.items() if state != want]):
        log(f"{st.tree}: already {want}; nothing written")
        return False
    verb, new = ("apply", st.fork) if want == "applied" else ("revert", st.base)
    mode = {
        rel: stat.S_IMODE((ps.root / rel).stat().st_mode) | 0o644 for rel in ps.added
    }
    changes = {rel: (new.get(rel), mode.get(rel, 0)) for rel in todo}
    # pip uninstalls what RECORD lists: the fork's files go with vLLM.
    if record := _record(st.tree):
        text = (st.tree / record).read_bytes().decode()
        rows = _record_with(text, {rel: new.get(rel) for rel in ps.added})
        if rows != text:
            changes[record] = (rows.encode(), 0)
    _commit(st.tree, verb, changes)
    _drop_empty_dirs(st.tree, [rel for rel in todo if rel not in new])
    removed = sum(new.get(rel) is None for rel in todo)
    touched = sum(rel in ps.base_files for rel in todo)
    added = len(todo) - removed - touched
    done = (
        f"{touched} stock file(s) patched, {added} added"
        if want == "applied"
        else f"{touched} stock file(s) restored, {removed} removed"
    )
    if record in changes:
        done += f", {record} updated"
    log(f"{st.tree}: {verb}: {done}; the tree is {want}")
    return True


def apply(tree: str | os.PathLike[str], ps: Patchset | None = None, *, log=print):
    """Bring every file of TREE to the patch set (completes a mixed tree).
    False if applied already; PatchsetError on a wrong base (before a byte
    is written) or a failed write (rolled back)."""
    return _bring_to("applied", tree, ps, log)


def revert(tree: str | os.PathLike[str], ps: Patchset | None = None, *, log=print):
    """Bring every file of TREE back to the base; as ``apply``."""
    return _bring_to("base", tree, ps, log)


def default_wheel(ps: Patchset) -> Path:
    return CACHE_DIR / ps.base["wheel"]


def wheel_files(wheel: Path, names) -> dict[str, bytes]:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return {name: zf.read(name) for name in names}
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise PatchsetError(f"{wheel}: {e}") from None


def wheel_version(wheel: Path) -> str:
    with contextlib.suppress(OSError, ValueError, zipfile.BadZipFile):
        with zipfile.ZipFile(wheel) as zf:
            infos = [n for n in zf.namelist() if re.match(r"vllm-.+\.dist-info/", n)]
        return min(infos).split("/")[0][5:-10]
    raise PatchsetError(f"{wheel}: not a readable vLLM wheel (no vllm-*.dist-info)")


def check_wheel(ps: Patchset, wheel: Path) -> Path:
    """Refuse any wheel but the pinned one, naming both versions and hashes."""
    if not wheel.is_file():
        raise PatchsetError(f"{wheel}: no such wheel; `make fetch` gets the pinned one")
    if (found := sha256(wheel.read_bytes())) != (pinned := ps.base["wheel_sha256"]):
        raise PatchsetError(
            f"{wheel}: vLLM {wheel_version(wheel)}, sha256 {found}; expected the "
            f"pinned {ps.base['wheel']}: vLLM {ps.version}, sha256 {pinned} "
            f"(`make fetch` gets it; to move the fork to another vLLM, {REBASE})"
        )
    return wheel


def stock_files(ps: Patchset, *, tree=None, wheel=None) -> dict[str, bytes]:
    """The touched files' base content, from TREE (any state but wrong-base)
    or a vLLM wheel of the base version (default: the pinned one, cached)."""
    if tree is not None:
        if (st := inspect_tree(tree, ps)).state == "wrong-base":
            raise PatchsetError(st.describe())
        return st.base
    return wheel_files(check_wheel(ps, Path(wheel or default_wheel(ps))), ps.touched)


def export_diff(ps: Patchset | None = None, *, tree=None, wheel=None) -> str:
    """The whole fork as one git diff against the base, for upstream review:
    the patched stock files, and the added files as new files."""
    base = stock_files(ps := ps or Patchset.load(), tree=tree, wheel=wheel)
    fork = patched_files(ps, base)
    fork.update({rel: (ps.root / rel).read_bytes() for rel in ps.added})
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        (work := Path(tmp, "work")).mkdir()
        _git(["init", "-q"], work)
        trees = []
        for files in (base, fork):
            _write_all(work, files)
            _git(["add", "-A"], work)
            trees.append(_git(["write-tree"], work).stdout.strip())
        opts = ["--no-color", "--no-ext-diff", "--no-renames", "--src-prefix=a/"]
        return _git(["diff", *opts, "--dst-prefix=b/", *trees], work).stdout


PLACEHOLDERS = ("# CONCERN.", "# WHY.")  # CONTRIBUTING.md's header template


def header_problems(text: str) -> list[str]:
    """What breaks CONTRIBUTING.md's rule for a patch's header: a
    '# <concern>.' line, a lone '#', '# <why>' lines, a blank line, then the
    first 'diff --git' line, the template's placeholders replaced."""
    head, sep, _ = text.partition("diff --git ")
    if not sep or not head.endswith("\n\n"):
        return ["expected a header, then a blank line before the first diff --git"]
    lines = head[:-2].split("\n")
    problems = [f"{p!r}: replace the placeholder" for p in PLACEHOLDERS if p in lines]
    if not re.fullmatch(r"# \S.*\.", lines[0]):
        problems.append(f"line 1 {lines[0]!r}: expected '# <concern>.'")
    if lines[1:2] != ["#"]:
        problems.append("line 2: expected a lone '#' between concern and why")
    why = lines[2:]
    if not any(re.fullmatch(r"# \S.*", line) for line in why) or not all(
        re.fullmatch(r"#( .*)?", line) for line in why
    ):
        problems.append("expected '# <why>' lines after the lone '#'")
    return problems


def pin(wheel: str | os.PathLike[str], root=REPO_ROOT, *, log=print) -> dict:
    """Rewrite patches/base.json from WHEEL, once every patch has its header
    and the series applies to WHEEL."""
    ps, wheel = Patchset.load(root, pinned=False), Path(wheel)
    for patch in ps.patches:
        if problems := header_problems(patch.read_text()):
            raise PatchsetError(
                f"{patch}: header: {'; '.join(problems)} (CONTRIBUTING.md, "
                '"Adding a patch"); patches/base.json is unchanged'
            )
    patched_files(ps, files := wheel_files(wheel, ps.touched))
    base = {
        "vllm_version": wheel_version(wheel),
        "wheel": wheel.name,
        "wheel_sha256": sha256(wheel.read_bytes()),
        "files": {rel: sha256(files[rel]) for rel in ps.touched},
    }
    (ps.root / "patches" / "base.json").write_text(json.dumps(base, indent=2) + "\n")
    log(f"patches/base.json: pinned {wheel.name} and {len(files)} stock file(s)")
    return base


def quiet_broken_pipe() -> int:
    """Stdout's reader has gone (``| head -1``): exit without a traceback."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=CLI, description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="the fork repo")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("check", help="print TREE's state; exit 1 unless as expected")
    p.add_argument("tree")
    p.add_argument("--expect", choices=["base", "applied"], help="default: either")
    sub.add_parser("apply", help="bring TREE to the patch set").add_argument("tree")
    sub.add_parser("revert", help="bring TREE back to the base").add_argument("tree")
    p = sub.add_parser("diff", help="print the fork as one diff against the base")
    p.add_argument("tree", nargs="?", help="stock files from this TREE")
    p.add_argument("--wheel", help="stock files from this wheel (default: cached)")
    sub.add_parser("new", help="print the next free patch name").add_argument("topic")
    p = sub.add_parser("pin", help="rewrite patches/base.json from a stock wheel")
    p.add_argument("--wheel", required=True)
    args, rc = parser.parse_args(argv), 0
    try:
        if args.cmd == "new":
            print(next_patch_name(args.topic, args.root))
        elif args.cmd == "pin":
            pin(args.wheel, args.root)
        elif args.cmd == "diff":
            ps = Patchset.load(args.root)
            sys.stdout.write(export_diff(ps, tree=args.tree, wheel=args.wheel))
        elif args.cmd == "check":
            st = inspect_tree(args.tree, Patchset.load(args.root))
            want = args.expect or ("applied" if st.state == "mixed" else None)
            print(st.describe(want))
            rc = int(st.state not in ([want] if want else ["base", "applied"]))
        else:
            run = apply if args.cmd == "apply" else revert
            run(args.tree, Patchset.load(args.root))
        sys.stdout.flush()
    except PatchsetError as e:
        print(f"patchset: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        done = "nothing written"
        if args.cmd in ("apply", "revert"):
            done = f"rolled back, {args.tree} is unchanged"
        print(f"patchset: interrupted; {done}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return quiet_broken_pipe()
    return rc


if __name__ == "__main__":
    sys.exit(main())
