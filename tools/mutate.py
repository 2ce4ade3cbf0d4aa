# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mutation testing of the kpool stage's host code and hooks (`make mutate`).

mutmut 3 does the work: it generates the mutants, runs the tests once to learn
which tests call each function (and once more to check that they pass again
in the same process), then runs each mutant in a fork of that warmed-up
process against those tests only, fastest first, stopping at the first
failure. This file only adapts it to a patch set:

- The code under test is the patched overlay (tools/patchset.py), not files in
  this repo. mutmut imports what it mutates from its own `mutants/` dir, so
  that dir is laid out as a hard-link copy of the overlay's `vllm/` in which
  mutmut writes the mutated target files (build/overlay/mutate/mutants).
- The scope is finer than a file: some functions of a kernel module (its host
  rules, not the kernels), or only the lines a patch adds to a stock file.
  mutmut mutates only the lines it is given as "covered"; this passes it the
  lines in scope (tools/mutate.toml, [[target]]).
- The survivors that are equivalent mutants are listed with their reasons in
  tools/mutate.toml ([[equivalent]]); any other survivor, or a mutant no test
  reaches, fails the run.

    python tools/mutate.py               # a fresh run of every mutant in scope
    python tools/mutate.py 'GLOB' ...    # re-run these mutants (mutmut names,
                                         # as printed) of the last run
    python tools/mutate.py --cold NAME   # ... each in a fork of a process
                                         # that has run no test

A fork of the warmed-up process has its caches filled: a mutant of a line
that runs only on a cache miss survives there; `--cold` (mutmut's fork
server, several times slower a mutant) tells such a survivor from a gap.

Afterwards, in build/overlay/mutate: `mutmut results`, `mutmut show NAME`,
`mutmut browse` (the run's own pyproject.toml there configures mutmut).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "tools" / "mutate.toml"
# Under build/overlay: the mutated tree is an overlay too, and the tests that
# look for the stock vllm on sys.path skip what is in there (as the overlay).
RUN = REPO / "build" / "overlay" / "mutate"
# mutmut's exit codes that are not a test gap: killed (1, 3: a pytest error)
# and timeouts (SIGXCPU in its forms): a mutant that hangs the tests is caught.
NOT_A_GAP = {"killed", "timeout"}


def load_config(path: Path = CONFIG) -> dict:
    return tomllib.loads(path.read_text())


# --- Scope: which lines of a target are mutated ----------------------------


def _patch_lines(patch: Path, path: str, source: str) -> set[int]:
    """Lines of ``source`` that ``patch`` adds to ``path`` (by the hunks' new
    line numbers, checked against the text)."""
    lines = source.splitlines()
    wanted: set[int] = set()
    current = None
    new_line = 0
    for raw in patch.read_text().splitlines():
        if raw.startswith("+++ "):
            current = raw[4:].strip().removeprefix("b/")
        elif raw.startswith("@@"):
            match = re.match(r"@@ -\d+(?:,\d+)? \+(\d+)", raw)
            new_line = int(match.group(1)) if match else 0
        elif current == path and new_line and raw[:1] in ("+", " "):
            if raw.startswith("+"):
                if lines[new_line - 1] != raw[1:]:
                    raise SystemExit(f"{patch.name}: line {new_line} of {path} differs")
                wanted.add(new_line)
            new_line += 1
    if not wanted:
        raise SystemExit(f"{patch.name} adds no line to {path}")
    return wanted


def _function_lines(source: str, names: list[str]) -> set[int]:
    """The body lines of the module's functions and ``Class.method``s named
    in ``names``."""
    tree = ast.parse(source)
    functions = [(getattr(node, "name", ""), node) for node in tree.body]
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            functions += [
                (f"{node.name}.{getattr(m, 'name', '')}", m) for m in node.body
            ]
    wanted: set[int] = set()
    found = set()
    for name, node in functions:
        if isinstance(node, ast.FunctionDef) and name in names:
            found.add(name)
            wanted.update(range(node.body[0].lineno, node.end_lineno + 1))
    if missing := set(names) - found:
        raise SystemExit(f"functions not found: {sorted(missing)}")
    return wanted


def scope(config: dict, overlay: Path) -> dict[str, set[int]]:
    """{path in the patched tree: the lines to mutate} of every [[target]];
    a path may be a glob (of the patched tree) and must match a file."""
    lines: dict[str, set[int]] = {}
    for target in config["target"]:
        paths = sorted(p.relative_to(overlay) for p in overlay.glob(target["path"]))
        if not paths:
            raise SystemExit(f"tools/mutate.toml: no file matches {target['path']}")
        for rel in map(str, paths):
            source = (overlay / rel).read_text()
            if "patch" in target:
                patch = REPO / "patches" / target["patch"]
                wanted = _patch_lines(patch, rel, source)
            elif "functions" in target:
                wanted = _function_lines(source, target["functions"])
            else:
                wanted = set(range(1, len(source.splitlines()) + 1))
            lines.setdefault(rel, set()).update(wanted)
    return lines


# --- The run dir ----------------------------------------------------------


def prepare_env() -> tuple[Path, Path]:
    """The CPU tests' environment and the patched overlay. The root
    conftest.py, which sets them up for a plain pytest run, is not in the run
    dir (it would put its own overlay ahead of mutants/); the tests' own
    conftest.py files are. Returns (overlay, stock vllm)."""
    # Last: the tests import tools/ (mutants/, the patched vllm, goes first).
    sys.path.append(str(REPO))
    from tools import overlay as overlays

    stock = overlays.find_installed_vllm()
    if stock is None:
        raise SystemExit("vllm is not installed in this environment (make venv)")
    overlay = overlays.build_overlay(stock, log=lambda m: print(m, file=sys.stderr))
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    # The mutants are forks of one process: no OpenMP pool may be live in it.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    # Each mutant starts a pytest session: skip scanning every installed
    # distribution for plugins (the CPU tests use none).
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    os.environ["KPOOL_STOCK_VLLM"] = str(stock)
    # The mutated tree is the tests' overlay (test_expand_patch checks it).
    os.environ["KPOOL_VLLM_OVERLAY"] = str(RUN / "mutants")
    return overlay, stock


def _toml_value(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value).lower() if isinstance(value, bool) else str(value)


def lay_out(config: dict, overlay: Path, lines: dict[str, set[int]]) -> None:
    """The run dir: mutmut's config, the target files it reads, and mutants/
    prefilled with the rest of the patched vllm and the tests."""
    shutil.rmtree(RUN, ignore_errors=True)
    RUN.mkdir(parents=True)
    tables = {
        "mutmut": {**config["mutmut"], "source_paths": sorted(lines)},
        # This repo's pytest settings (markers), for the copies of the tests.
        "pytest.ini_options": tomllib.loads((REPO / "pyproject.toml").read_text())[
            "tool"
        ]["pytest"]["ini_options"],
    }
    (RUN / "pyproject.toml").write_text(
        "".join(
            f"[tool.{name}]\n"
            + "".join(f"{k} = {_toml_value(v)}\n" for k, v in table.items())
            for name, table in tables.items()
        )
    )
    # Hard links (as the overlay's are): 9000 files in a second. mutmut
    # writes only the target files, which are unlinked here first, so the
    # overlay and the stock install it links to are never written.
    (RUN / "mutants").mkdir()
    subprocess.run(
        ["cp", "-al", str(overlay / "vllm"), str(RUN / "mutants" / "vllm")],
        check=True,
    )
    for rel in lines:
        (RUN / "mutants" / rel).unlink()
        (RUN / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(overlay / rel, RUN / rel)
    # The tests themselves, not copies: they find the repo's files (README,
    # patches) from their resolved path, and a test edited to kill a survivor
    # is seen by a re-run. (mutmut copies a tests/ of its dir into mutants/;
    # there is none.)
    (RUN / "mutants" / "tests").symlink_to(REPO / "tests")


# --- Running mutmut and judging its survivors --------------------------------


def run_mutmut(
    lines: dict[str, set[int]], names: list[str], workers: int, cold: bool
) -> None:
    os.chdir(RUN)
    import mutmut.__main__ as mm
    from mutmut.configuration import ProcessIsolation, config
    from mutmut.state import state

    if cold:
        config().process_isolation = ProcessIsolation.FORKSERVER

    # mutmut's own line filter (mutate_only_covered_lines) keeps only the
    # lines its coverage run saw executed; the scope here is set in its place:
    # the same dict, keyed by the file's absolute path under mutants/.
    if not names:
        state()._covered_lines = {
            str((RUN / "mutants" / rel).absolute()): wanted
            for rel, wanted in lines.items()
        }
    try:
        mm._run(names, workers)
    except SystemExit as stop:
        if stop.code:
            raise


def _changed_line(diff: str) -> tuple[str, str]:
    """The first removed and added lines of a mutant's diff, stripped."""
    removed = [ln[1:].strip() for ln in diff.splitlines() if ln[:1] == "-"]
    added = [ln[1:].strip() for ln in diff.splitlines() if ln[:1] == "+"]
    removed = [ln for ln in removed if not ln.startswith("--")]
    added = [ln for ln in added if not ln.startswith("++")]
    return (removed or [""])[0], (added or [""])[0]


def report(started: float) -> int:
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code
    from mutmut.utils.file_utils import walk_mutatable_files

    # Read again: equivalents may be added to the config during a long run.
    equivalents = load_config().get("equivalent", [])
    used: set[int] = set()
    counts: dict[str, int] = {}
    unexplained = 0
    print("\n== mutate: mutants not killed")
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        for name, code in sorted(data.exit_code_by_key.items()):
            status = status_by_exit_code[code]
            counts[status] = counts.get(status, 0) + 1
            if status in NOT_A_GAP:
                continue
            before, after = _changed_line(get_diff_for_mutant(name, path=path))
            match = [
                i
                for i, e in enumerate(equivalents)
                if status == "survived"
                and str(path).endswith(e["file"])
                and (e["before"].strip(), e["after"].strip()) == (before, after)
            ]
            used.update(match)
            unexplained += not match
            tag = "equivalent" if match else status.upper()
            print(f"-- {tag}: {name}\n   - {before}\n   + {after}")
            if match:
                print(f"   why: {equivalents[match[0]]['reason']}")
    for i, e in enumerate(equivalents):
        if i not in used:  # the code moved on: the entry can go
            print(f"-- listed, matched no survivor: {e['file']}: {e['before']}")
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    print(
        f"\n== mutate summary: {sum(counts.values())} mutants: {summary}; "
        f"{unexplained} not explained; {time.monotonic() - started:.0f} s"
    )
    return 1 if unexplained else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="re-run these mutants (globs)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--cold", action="store_true", help="with names: in unwarmed forks"
    )
    args = parser.parse_args(argv)
    if args.cold and not args.names:
        parser.error("--cold re-runs named mutants")
    started = time.monotonic()
    config = load_config()
    overlay, _ = prepare_env()
    lines = scope(config, overlay)
    if args.names:
        if not (RUN / "mutants").is_dir():
            raise SystemExit("no previous run in build/overlay/mutate")
    else:
        lay_out(config, overlay, lines)
    run_mutmut(lines, args.names, args.workers, args.cold)
    return report(started)


if __name__ == "__main__":
    sys.exit(main())
