# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mutation testing of the kpool stage's host code and hooks (`make mutate`).

Cosmic Ray makes the mutants: its `init` over copies of the target files
(build/mutate/src, taken from the patched test overlay), its operators filter,
and a scope filter of ours (tools/mutate.toml: whole files, named functions, or
the lines a patch adds; never type annotations). The results go to its session
DB (build/mutate/session.sqlite; `cr-report` reads it).

Running the tests is ours, for speed: importing torch, vLLM and CuTe DSL takes
longer than most mutants' tests. One process imports everything, runs the
configured CPU tests once (the baseline) under coverage with a context per
test, and keeps which tests execute each line. Each mutant then runs in a
fork of that process: the mutated definitions are applied to the live modules
(function code objects swapped, constants and class attributes rebound; the
files are never written), and pytest runs only the tests that execute the
mutated line, fastest first, stopping at the first failure. Killed: a test
failed (or the mutant did not even define); survived: they all passed.

    python tools/mutate.py                 # all mutants, 2 workers
    python tools/mutate.py --filter kpool  # mutants of matching paths only
    python tools/mutate.py --survivors     # the last run's survivors again
    python tools/mutate.py --plant bug.patch [-k EXPR]  # a hand-made mutant

`--plant` applies a unified diff of one target file (paths as in the repo,
`a/vllm/...`) the same way and runs every configured test (no coverage
selection), printing pytest's summary: a planted bug's failing tests.

Exit status: 0 when every survivor is listed as equivalent in the config.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
# The conftest.py files are not loaded again: this process already did what
# the root one does (the overlay, the CPU environment), and a second session
# in one process would re-run it. CUDA-only tests are left out instead of
# skipped by it.
PYTEST_ARGS = (
    "-q",
    "--no-header",
    "-p",
    "no:cacheprovider",
    "--noconftest",
    "-m",
    "not gpu and not slow",
)
CONFIG = REPO / "tools" / "mutate.toml"
WORK = REPO / "build" / "mutate"


# --- Configuration -------------------------------------------------------


@dataclass
class Target:
    path: str  # in the patched tree, e.g. vllm/models/.../kpool.py
    functions: tuple[str, ...] = ()
    patch: str | None = None

    @property
    def module(self) -> str:
        parts = Path(self.path).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@dataclass
class Equivalent:
    file: str
    operator: str
    before: str
    after: str
    reason: str


@dataclass
class Config:
    tests: list[str]
    targets: list[Target]
    equivalents: list[Equivalent]
    exclude_operators: list[str]
    timeout: float


def load_config(path: Path = CONFIG) -> Config:
    data = tomllib.loads(path.read_text())
    ours = data["kpool-mutate"]
    cosmic = data["cosmic-ray"]
    return Config(
        tests=list(ours["tests"]),
        targets=[
            Target(t["path"], tuple(t.get("functions", ())), t.get("patch"))
            for t in ours["target"]
        ],
        equivalents=[Equivalent(**e) for e in ours.get("equivalent", [])],
        exclude_operators=list(
            cosmic.get("filters", {})
            .get("operators-filter", {})
            .get("exclude-operators", [])
        ),
        timeout=float(cosmic.get("timeout", 240.0)),
    )


# --- The process every mutant forks from ---------------------------------


def prepare_process() -> Path:
    """The environment of the CPU tests (conftest.py's), then the patched
    overlay first on sys.path. Returns the overlay root."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    # One thread: forked children must not inherit a live OpenMP pool.
    os.environ["OMP_NUM_THREADS"] = "1"
    # Each mutant starts a pytest session: skip scanning every installed
    # distribution for plugins (the CPU tests use none).
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    os.chdir(REPO)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import torch

    import conftest  # noqa: F401  (builds the overlay, puts it first)

    torch.set_num_threads(1)
    try:  # no monitor thread in a process that forks
        import tqdm

        tqdm.tqdm.monitor_interval = 0
    except ImportError:
        pass
    return Path(os.environ["KPOOL_VLLM_OVERLAY"])


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
            continue
        if raw.startswith("@@"):
            match = re.match(r"@@ -\d+(?:,\d+)? \+(\d+)", raw)
            new_line = int(match.group(1)) if match else 0
            continue
        if current != path or not new_line:
            continue
        if raw.startswith("+"):
            assert lines[new_line - 1] == raw[1:], (
                f"{patch.name}: line {new_line} of {path} is not the patch's"
            )
            wanted.add(new_line)
            new_line += 1
        elif raw.startswith(" "):
            new_line += 1
    if not wanted:
        raise SystemExit(f"{patch.name} adds no line to {path}")
    return wanted


def _function_lines(tree: ast.Module, names: tuple[str, ...]) -> set[int]:
    """The body lines of the module's functions and of ``Class.method``s
    named in ``names``."""
    wanted: set[int] = set()
    found = set()
    functions = [(getattr(node, "name", ""), node) for node in tree.body]
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            functions += [
                (f"{node.name}.{getattr(m, 'name', '')}", m) for m in node.body
            ]
    for name, node in functions:
        if isinstance(node, ast.FunctionDef) and name in names:
            found.add(name)
            wanted.update(range(node.body[0].lineno, node.end_lineno + 1))
    missing = set(names) - found
    if missing:
        raise SystemExit(f"functions not found: {sorted(missing)}")
    return wanted


def _annotation_spans(tree: ast.Module) -> list[tuple[tuple[int, int], tuple]]:
    """(start, end) positions of every annotation (not behaviour)."""
    spans = []
    for node in ast.walk(tree):
        annotations = []
        if isinstance(node, ast.arg) and node.annotation is not None:
            annotations.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        for a in annotations:
            spans.append(((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)))
    return spans


def scope_lines(target: Target, source: str) -> tuple[set[int], list]:
    tree = ast.parse(source)
    if target.patch:
        lines = _patch_lines(REPO / "patches" / target.patch, target.path, source)
    elif target.functions:
        lines = _function_lines(tree, target.functions)
    else:
        lines = set(range(1, len(source.splitlines()) + 1))
    return lines, _annotation_spans(tree)


def _inside(pos: tuple[int, int], spans) -> bool:
    return any(start <= pos < end for start, end in spans)


# --- Cosmic Ray: the mutants ------------------------------------------------


def _survivors_of_last_run(src: Path) -> set[tuple[str, str, int]]:
    """(copy path, operator, occurrence) of the last run's survivors, when
    the sources it mutated are the ones mutated now."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome

    db = WORK / "session.sqlite"
    if not db.exists():
        raise SystemExit("--survivors: no previous run in build/mutate")
    found = set()
    with use_db(str(db), WorkDB.Mode.open) as work_db:
        for item, result in work_db.completed_work_items:
            if result.test_outcome == TestOutcome.SURVIVED:
                m = item.mutations[0]
                found.add((str(m.module_path), m.operator_name, m.occurrence))
    return found


def init_session(
    config: Config, overlay: Path, only: str | None, survivors_only: bool = False
):
    """Copies the targets under build/mutate/src and lets Cosmic Ray list
    their mutants into build/mutate/session.sqlite; skips those out of
    scope or of excluded operators. Returns (db path, {copy: (target,
    source, lines)})."""
    from cosmic_ray.commands import init
    from cosmic_ray.tools.filters.operators_filter import OperatorsFilter
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    src = WORK / "src"
    previous = _survivors_of_last_run(src) if survivors_only else None
    old_sources = {}
    if previous is not None:
        for target in config.targets:
            copy = src / target.path
            old_sources[str(copy)] = copy.read_text() if copy.exists() else None
    shutil.rmtree(src, ignore_errors=True)
    copies = {}
    for target in config.targets:
        if only and only not in target.path:
            continue
        source = (overlay / target.path).read_text()
        copy = src / target.path
        if previous is not None and old_sources.get(str(copy)) not in (None, source):
            raise SystemExit(f"--survivors: {target.path} changed since the last run")
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(source)
        lines, annotations = scope_lines(target, source)
        copies[str(copy)] = (target, source, lines, annotations)
    db = WORK / "session.sqlite"
    db.unlink(missing_ok=True)
    with use_db(str(db), WorkDB.Mode.create) as work_db:
        init([Path(p) for p in copies], work_db, {})
        OperatorsFilter()._skip_filtered(work_db, config.exclude_operators)
        for item in list(work_db.pending_work_items):
            mutation = item.mutations[0]
            target, _, lines, annotations = copies[str(mutation.module_path)]
            start = tuple(mutation.start_pos)
            why = None
            spec = (str(mutation.module_path), mutation.operator_name)
            if previous is not None and (*spec, mutation.occurrence) not in previous:
                why = "not a survivor of the last run"
            elif start[0] not in lines:
                why = "out of scope"
            elif _inside(start, annotations):
                why = "annotation"
            if why:
                work_db.set_result(
                    item.job_id,
                    WorkResult(output=why, worker_outcome=WorkerOutcome.SKIPPED),
                )
    return db, copies


# --- Applying a mutated source to the live modules --------------------------


class Unsupported(Exception):
    """A change this applier cannot make to a live module."""


def _key(node: ast.stmt, index: int):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return ("def", node.name)
    if isinstance(node, ast.Assign) and all(
        isinstance(t, ast.Name) for t in node.targets
    ):
        return ("assign", tuple(t.id for t in node.targets))
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return ("assign", (node.target.id,))
    return ("stmt", index)


def _decorators(node) -> str:
    return ast.dump(ast.Module(getattr(node, "decorator_list", []), []))


def _live_function(owner, name: str):
    obj = vars(owner)[name]
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    elif isinstance(obj, property):
        obj = obj.fget
    while getattr(obj, "__code__", None) is None or obj.__code__.co_name != name:
        obj = obj.__wrapped__
    return obj


def _fresh_function(node, globals_: dict, filename: str, in_class: bool):
    """``node`` (a def, decorators left out) compiled and defined in the
    module's globals; inside a class body when it is a method (so that a
    zero-argument super() gets its __class__ cell)."""
    bare = type(node)(**{**vars(node), "decorator_list": []})
    body = [bare]
    if in_class:
        body = [
            ast.ClassDef(
                name="_Mutant",
                bases=[],
                keywords=[],
                body=body,
                decorator_list=[],
                lineno=node.lineno,
                col_offset=0,
                end_lineno=node.end_lineno,
                end_col_offset=0,
            )
        ]
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    scratch: dict = {}
    exec(compile(module, filename, "exec"), globals_, scratch)
    return vars(scratch["_Mutant"])[node.name] if in_class else scratch[node.name]


def _apply_body(old_body, new_body, old_src, new_src, globals_, owner, filename):
    in_class = isinstance(owner, type)
    old = {_key(n, i): n for i, n in enumerate(old_body)}
    applied = 0
    for index, node in enumerate(new_body):
        key = _key(node, index)
        before = old.get(key)
        if before is None:
            raise Unsupported(f"a new statement: {key}")
        if ast.get_source_segment(old_src, before) == ast.get_source_segment(
            new_src, node
        ) and _decorators(before) == _decorators(node):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if _decorators(before) != _decorators(node):
                raise Unsupported(f"decorators of {node.name}")
            fresh = _fresh_function(node, globals_, filename, in_class)
            live = _live_function(owner, node.name)
            live.__code__ = fresh.__code__
            live.__defaults__ = fresh.__defaults__
            live.__kwdefaults__ = fresh.__kwdefaults__
            applied += 1
        elif (
            isinstance(node, ast.ClassDef)
            and not in_class
            and (
                ast.dump(ast.Module(before.decorator_list, []))
                != ast.dump(ast.Module(node.decorator_list, []))
            )
        ):
            module = ast.Module(body=[node], type_ignores=[])
            exec(compile(module, filename, "exec"), globals_)
            applied += 1
        elif isinstance(node, ast.ClassDef):
            cls = vars(owner)[node.name]
            changed_fields = any(
                not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and ast.get_source_segment(old_src, o)
                != ast.get_source_segment(new_src, n)
                for o, n in zip(before.body, node.body, strict=False)
            )
            if hasattr(cls, "__dataclass_fields__") and changed_fields:
                if in_class:
                    raise Unsupported(f"a field of nested dataclass {node.name}")
                module = ast.Module(body=[node], type_ignores=[])
                exec(compile(module, filename, "exec"), globals_)
                applied += 1
            else:
                applied += _apply_body(
                    before.body, node.body, old_src, new_src, globals_, cls, filename
                )
        elif key[0] == "assign":
            module = ast.Module(body=[node], type_ignores=[])
            code = compile(module, filename, "exec")
            if in_class:
                scratch: dict = {}
                exec(code, globals_, scratch)
                for name in key[1]:
                    setattr(owner, name, scratch[name])
            else:
                exec(code, globals_)
            applied += 1
        else:
            raise Unsupported(f"statement {index} of {getattr(owner, '__name__', '')}")
    return applied


def apply_source(module: ModuleType, old_src: str, new_src: str) -> None:
    """Makes ``module`` (loaded from ``old_src``) behave as ``new_src``."""
    filename = module.__file__
    applied = _apply_body(
        ast.parse(old_src).body,
        ast.parse(new_src).body,
        old_src,
        new_src,
        vars(module),
        module,
        filename,
    )
    if not applied:
        raise Unsupported("no definition changed")


# --- The baseline: which tests reach which lines ---------------------------


@dataclass
class Baseline:
    passed: dict[str, float] = field(default_factory=dict)  # nodeid -> seconds
    failed: list[str] = field(default_factory=list)
    lines: dict[str, dict[int, set[str]]] = field(default_factory=dict)


class _BaselinePlugin:
    def __init__(self, cov, result: Baseline):
        self.cov, self.result = cov, result

    def pytest_runtest_protocol(self, item, nextitem):
        self.cov.switch_context(item.nodeid)

    def pytest_runtest_logreport(self, report):
        if report.failed or (report.when == "call" and report.skipped):
            if report.nodeid not in self.result.failed:
                self.result.failed.append(report.nodeid)
        elif report.when == "call":
            self.result.passed[report.nodeid] = report.duration
        elif report.when == "setup" and report.skipped:
            self.result.failed.append(report.nodeid)


def run_baseline(config: Config, overlay: Path, targets: list[Target]) -> Baseline:
    import coverage
    import pytest

    files = {str(overlay / t.path): t.path for t in targets}
    cov = coverage.Coverage(
        data_file=None, include=list(files), config_file=False, branch=False
    )
    result = Baseline()
    cov.start()
    try:
        code = pytest.main(
            [*config.tests, *PYTEST_ARGS], plugins=[_BaselinePlugin(cov, result)]
        )
    finally:
        cov.stop()
    if code not in (0, 1):
        raise SystemExit(f"the baseline pytest run failed to run (exit {code})")
    data = cov.get_data()
    for path, rel in files.items():
        by_line = data.contexts_by_lineno(path)
        result.lines[rel] = {
            line: {c for c in contexts if c in result.passed}
            for line, contexts in by_line.items()
        }
    for nodeid in result.failed:
        result.passed.pop(nodeid, None)
    return result


# --- Running one mutant in a fork ------------------------------------------


@dataclass
class Job:
    job_id: str
    target: Target
    operator: str
    line: int
    source: str
    mutated: str
    tests: list[str]
    diff: str = ""


def _child(job: Job, out_path: str) -> None:
    """In the forked child: apply, run the tests, exit with pytest's code
    (100: the mutant broke its module's definitions: killed)."""
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    code = 3
    try:
        module = sys.modules[job.target.module]
        try:
            apply_source(module, job.source, job.mutated)
        except Unsupported as error:
            print(f"UNSUPPORTED: {error}")
            os._exit(101)
        except Exception as error:  # noqa: BLE001  (the mutant breaks the module)
            print(f"the mutant does not define: {error!r}")
            os._exit(100)
        import pytest

        code = pytest.main([*job.tests, "-x", *PYTEST_ARGS])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code))


@dataclass
class Outcome:
    job: Job
    status: str  # killed, survived, incompetent, timeout, unsupported
    seconds: float
    output: str


def run_jobs(jobs: list[Job], workers: int, timeout: float, report) -> list[Outcome]:
    pending = list(jobs)
    running: dict[int, tuple[Job, float, str]] = {}
    outcomes: list[Outcome] = []
    tmp = tempfile.mkdtemp(prefix="kpool-mutate-")
    try:
        while pending or running:
            while pending and len(running) < workers:
                job = pending.pop(0)
                out = os.path.join(tmp, f"{job.job_id}.log")
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(job, out)
                running[pid] = (job, time.monotonic(), out)
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                now = time.monotonic()
                for child, (job, start, out) in list(running.items()):
                    if now - start > timeout:
                        os.kill(child, signal.SIGKILL)
                select.select([], [], [], 0.05)
                continue
            job, start, out = running.pop(pid)
            seconds = time.monotonic() - start
            output = Path(out).read_text(errors="replace")[-4000:]
            os.unlink(out)
            if os.WIFSIGNALED(status):
                kind = "timeout" if seconds > timeout else "incompetent"
            else:
                code = os.WEXITSTATUS(status)
                kind = {0: "survived", 1: "killed", 100: "killed", 101: "unsupported"}
                kind = kind.get(code, "incompetent")
            outcome = Outcome(job, kind, seconds, output)
            outcomes.append(outcome)
            report(outcome, len(outcomes), len(jobs))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return outcomes


# --- Putting it together ----------------------------------------------------


def _changed_line(source: str, mutated: str) -> tuple[int, str, str]:
    old, new = source.splitlines(), mutated.splitlines()
    for number, (a, b) in enumerate(zip(old, new, strict=False), start=1):
        if a != b:
            return number, a.strip(), b.strip()
    return 0, "", ""


def _reaching(baseline: Baseline, path: str, source: str, line: int) -> set[str]:
    """The tests whose baseline run executed ``line``; for a line no test
    executes (a signature's defaults, a decorator, a statement's later line,
    a module constant: run at import) those of its enclosing definition, or
    else of the whole file."""
    lines = baseline.lines.get(path, {})
    if lines.get(line):
        return lines[line]
    tree = ast.parse(source)
    spans = [(1, len(source.splitlines()))]
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if first <= line <= node.end_lineno:
                spans.append((first, node.end_lineno))
    start, end = min(spans, key=lambda span: span[1] - span[0])
    found = set().union(*(t for n, t in lines.items() if start <= n <= end))
    if not found:
        found = set().union(*lines.values())
    return found


def _explained(config: Config, outcome: Outcome) -> Equivalent | None:
    job = outcome.job
    _, before, after = _changed_line(job.source, job.mutated)
    for eq in config.equivalents:
        if (
            job.target.path.endswith(eq.file)
            and re.fullmatch(eq.operator, job.operator)
            and eq.before.strip() == before
            and eq.after.strip() == after
        ):
            return eq
    return None


def mutate(args) -> int:
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    config = load_config()
    config.tests = args.tests or config.tests
    started = time.monotonic()
    overlay = prepare_process()
    WORK.mkdir(parents=True, exist_ok=True)
    db, copies = init_session(config, overlay, args.filter, args.survivors)
    targets = [t for t, *_ in copies.values()]
    print(f"== mutate: baseline of {len(config.tests)} test files", flush=True)
    baseline = run_baseline(config, overlay, targets)
    if baseline.failed:
        print(
            f"== mutate: WARNING: {len(baseline.failed)} tests fail or skip "
            "unmutated; left out:",
            *baseline.failed,
            sep="\n   ",
        )
    print(
        f"== mutate: baseline {len(baseline.passed)} tests passed in "
        f"{sum(baseline.passed.values()):.0f} s",
        flush=True,
    )

    jobs: list[Job] = []
    skipped = invalid = 0
    no_test: list[Job] = []
    with use_db(str(db), WorkDB.Mode.open) as work_db:
        skipped = sum(
            1
            for _, result in work_db.results
            if result.worker_outcome == WorkerOutcome.SKIPPED
        )
        for item in work_db.pending_work_items:
            mutation = item.mutations[0]
            target, source, _, _ = copies[str(mutation.module_path)]
            operator = get_operator(mutation.operator_name)(**mutation.operator_args)
            mutated = mutate_code(source, operator, mutation.occurrence)
            if mutated is None:
                continue
            try:
                compile(mutated, target.path, "exec")
            except SyntaxError:
                invalid += 1  # e.g. the bare `*` of a signature as an operator
                continue
            line, _, _ = _changed_line(source, mutated)
            reaching = _reaching(baseline, target.path, source, line)
            tests = sorted(reaching, key=lambda t: baseline.passed[t])
            job = Job(
                item.job_id,
                target,
                mutation.operator_name,
                line,
                source,
                mutated,
                tests,
                "\n".join(
                    difflib.unified_diff(
                        source.splitlines(),
                        mutated.splitlines(),
                        f"a/{target.path}",
                        f"b/{target.path}",
                        n=0,
                        lineterm="",
                    )
                ),
            )
            (jobs if tests else no_test).append(job)
    if args.limit:
        jobs = jobs[: args.limit]
    print(
        f"== mutate: {len(jobs) + len(no_test)} mutants in scope "
        f"({len(no_test)} reached by no test), {skipped} skipped "
        f"(out of scope, annotations, excluded operators), {invalid} not valid "
        f"Python; {args.workers} workers",
        flush=True,
    )

    def progress(outcome: Outcome, done: int, total: int) -> None:
        if outcome.status != "killed" or done % 50 == 0:
            job = outcome.job
            print(
                f"   [{done}/{total}] {outcome.status:<11} {job.target.path}:"
                f"{job.line} {job.operator} ({outcome.seconds:.1f} s)",
                flush=True,
            )

    outcomes = run_jobs(jobs, args.workers, config.timeout, progress)
    outcomes += [Outcome(job, "survived", 0.0, "reached by no test") for job in no_test]

    statuses = {
        "killed": TestOutcome.KILLED,
        "timeout": TestOutcome.KILLED,
        "survived": TestOutcome.SURVIVED,
        "incompetent": TestOutcome.INCOMPETENT,
        "unsupported": TestOutcome.INCOMPETENT,
    }
    with use_db(str(db), WorkDB.Mode.open) as work_db:
        for outcome in outcomes:
            work_db.set_result(
                outcome.job.job_id,
                WorkResult(
                    worker_outcome=WorkerOutcome.NORMAL,
                    test_outcome=statuses[outcome.status],
                    output=outcome.output,
                    diff=outcome.job.diff,
                ),
            )

    # Read again: equivalents may be added to the config during a long run.
    config.equivalents = load_config().equivalents
    counts: dict[str, int] = defaultdict(int)
    for outcome in outcomes:
        counts[outcome.status] += 1
    survivors = [o for o in outcomes if o.status == "survived"]
    unexplained = 0
    print("\n== mutate: surviving mutants")
    for outcome in sorted(survivors, key=lambda o: (o.job.target.path, o.job.line)):
        job = outcome.job
        equivalent = _explained(config, outcome)
        _, before, after = _changed_line(job.source, job.mutated)
        tag = "equivalent" if equivalent else "SURVIVED"
        unexplained += equivalent is None
        print(f"-- {tag}: {job.target.path}:{job.line} {job.operator}")
        print(f"   - {before}\n   + {after}")
        if equivalent:
            print(f"   why: {equivalent.reason}")
        elif not job.tests:
            print("   reached by no test")
    for kind in ("incompetent", "unsupported"):
        for outcome in outcomes:
            if outcome.status == kind:
                job = outcome.job
                last = (outcome.output.strip().splitlines() or [""])[-1]
                print(f"-- {kind}: {job.target.path}:{job.line} {job.operator}")
                print(f"   {last}")
    total = len(outcomes)
    print(
        f"\n== mutate summary: {total} mutants, {counts['killed'] + counts['timeout']}"
        f" killed ({counts['timeout']} by timeout), {len(survivors)} survived "
        f"({len(survivors) - unexplained} equivalent, {unexplained} unexplained), "
        f"{counts['incompetent']} incompetent, {counts['unsupported']} unsupported; "
        f"{skipped} skipped; {time.monotonic() - started:.0f} s"
    )
    print(f"== mutate: results in {db.relative_to(REPO)} (cr-report reads it)")
    return 1 if unexplained or counts["incompetent"] or counts["unsupported"] else 0


# --- A hand-made mutant -------------------------------------------------------


def plant(args) -> int:
    config = load_config()
    config.tests = args.tests or config.tests
    patch = Path(args.plant).resolve()
    text = patch.read_text()
    match = re.search(r"^\+\+\+ b/(\S+)", text, re.M)
    if not match:
        raise SystemExit(f"{patch}: no '+++ b/<path>' header")
    rel = match.group(1)
    target = next((t for t in config.targets if t.path == rel), Target(rel))
    overlay = prepare_process()
    source = (overlay / rel).read_text()
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "file.py"
        copy.write_text(source)
        subprocess.run(
            ["patch", "-s", "-p0", str(copy), str(patch)],
            check=True,
            stdin=subprocess.DEVNULL,
        )
        mutated = copy.read_text()
    import importlib

    importlib.import_module(target.module)
    module = sys.modules[target.module]
    apply_source(module, source, mutated)
    import pytest

    extra = ["-k", args.k] if args.k else []
    return pytest.main([*config.tests, *extra, *PYTEST_ARGS])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--filter", help="only targets whose path contains this")
    parser.add_argument("--limit", type=int, default=0, help="at most N mutants")
    parser.add_argument(
        "--survivors", action="store_true", help="only the last run's survivors"
    )
    parser.add_argument("--plant", help="run the tests with this diff applied")
    parser.add_argument("-k", help="with --plant: pytest -k expression")
    parser.add_argument(
        "--tests", nargs="+", help="these test files instead of the config's"
    )
    args = parser.parse_args(argv)
    return plant(args) if args.plant else mutate(args)


if __name__ == "__main__":
    sys.exit(main())
