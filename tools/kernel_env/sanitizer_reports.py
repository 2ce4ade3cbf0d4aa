# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Whose kernel each compute-sanitizer error report is in, over the logs of
one tool's runs (``sanitize.sh``), as one line: the errors the summaries
count, those reported in our kernels (their CuTe DSL entry names hold
vllmmodelsglm5nextnvidiaspecialized_decode) apart from those in other
kernels (torch's, DeepGEMM's), naming the kernels with the most.

    python3 tools/kernel_env/sanitizer_reports.py LOG...

Exits 1 where a report is in our kernels, where a log has no summary (its
run did not end), where the summaries count errors the logs do not print
(past ``--print-limit``: whose they are is unknown) or where racecheck
stopped counting (its hazard limit). A report only in other kernels is said
apart and does not fail: it is that kernel's, or a comparison reading bytes
no kernel wrote, which the tests keep to an output our kernel allocated and
should have written, where comparing it with stock's bytes fails the test
too (docs/gpu-tier.md). Standard library only: it runs on the GPU machine
without vLLM.

The formats (CUDA 11 to 13): each line of the tool starts with
``=========``; a report is a line at the left, then indented lines (``at
FUNCTION+0xOFFSET in FILE:LINE``, older ``at 0xOFFSET in FILE:LINE:FUNCTION``,
``by thread (x,y,z) in block (x,y,z)``, ``Device Frame:FUNCTION+0x...``,
innermost first), up to a bare ``=========``. Racecheck reports ``Error:
Race reported between Write access at FUNCTION+0x...`` with one ``and Read
access at FUNCTION+0x... [N hazards]`` line a conflicting pair (a displayed
hazard), ``Warning:`` ones being warnings. Each process ends with ``ERROR
SUMMARY: N errors`` or ``RACECHECK SUMMARY: N hazards displayed (E errors,
W warnings)``."""

import argparse
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# In every CuTe DSL entry name of our kernels: the module path, dots dropped
# (kernel_cutlass_kernel_vllmmodelsglm5nextnvidiaspecialized_decodecutedsl...).
OURS = "vllmmodelsglm5nextnvidiaspecialized_decode"
# The tool's line prefix, not a longer run of "=" (pytest's section bars,
# which also end in "=").
PREFIX = re.compile(r"(?<!=)={9}(?!=)(?P<indent> *)(?P<text>.*?)\s*$")
BAR = re.compile(r" ={2,}$")
ERROR_SUMMARY = re.compile(r"^ERROR SUMMARY: (\d+) errors?")
RACE_SUMMARY = re.compile(
    r"^RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, \d+ warnings?\)"
)
HAZARD_LIMIT = "Maximum number of hazards reached"
RACE = re.compile(
    r"^(?P<level>\w+)\b.*?(?:Race reported between|Potential \w+ hazard detected)"
)
# Where an access was: the function, from each kind of location line.
LOCATIONS = (
    re.compile(r"^at (?P<at>.+)$"),
    re.compile(r"^Device Frame: ?(?P<at>.+)$"),
    re.compile(r"Race reported between \w+ access at (?P<at>.+)$"),
    re.compile(r"^and \w+ access at (?P<at>.+)$"),
    re.compile(r"^\w+ Thread \([^)]*\) at (?P<at>.+)$"),
)
# What follows a location: a race's count, an old device frame's offset.
SUFFIX = re.compile(r" (?:\[\d+ hazards?\]|\([^()]* : 0x[0-9a-fA-F]+\))$")
OLD_AT = re.compile(r"^0x[0-9a-fA-F]+ in (?P<rest>.+)$")
NEW_AT = re.compile(r"^(?P<name>.+?)\+0x[0-9a-fA-F]+(?: in .+)?$")
SOURCE = re.compile(r"^.*?:\d+:")
# A short name's most characters.
WIDTH = 120


@dataclass
class Report:
    """One error report: the kernel it names (the outermost function of its
    device frames, or the first access of a race), whether any of its
    functions is ours, and the errors it stands for (a race: one a pair)."""

    kernel: str
    ours: bool
    errors: int = 1


@dataclass
class Run:
    """One log: whether it holds a summary, the errors the summaries count,
    the error reports it prints, whether racecheck hit its hazard limit."""

    path: str
    summarized: bool = False
    errors: int = 0
    reports: list[Report] = field(default_factory=list)
    hazard_limit: bool = False

    @property
    def unprinted(self) -> int:
        return max(0, self.errors - sum(r.errors for r in self.reports))


def tool_lines(text: str):
    """(indent, text) of each line the tool wrote (after its prefix, which
    may follow pytest's progress dots on the same line)."""
    for line in text.splitlines():
        match = PREFIX.search(line)
        if match and not BAR.search(match["text"]):
            yield len(match["indent"]), match["text"]


def blocks(text: str):
    """Each report or message: its first line, then its indented lines."""
    block: list[str] = []
    for indent, line in tool_lines(text):
        if line and indent > 1 and block:
            block.append(line.strip())
            continue
        if block:
            yield block
        block = [line] if line else []
    if block:
        yield block


def function(at: str) -> str:
    """The function of a location, in the new (``NAME+0x1f0 in FILE:LINE``)
    or old (``0x1f0 in FILE:LINE:NAME``) form."""
    at = SUFFIX.sub("", at.strip())
    old = OLD_AT.match(at)
    if old:
        return SOURCE.sub("", old["rest"], count=1)
    new = NEW_AT.match(at)
    return new["name"] if new else SOURCE.sub("", at, count=1)


def functions(block: list[str]) -> list[str]:
    names = []
    for line in block:
        for pattern in LOCATIONS:
            match = pattern.search(line)
            if match:
                names.append(function(match["at"]))
                break
    return names


def report(block: list[str]) -> Report | None:
    """The error report a block is, or None (a warning, a summary, a note)."""
    header, names = block[0], functions(block)
    if not names:
        return None
    ours = any(OURS in name for name in names)
    race = RACE.match(header)
    if race:
        if race["level"].upper() != "ERROR":
            return None
        pairs = sum(line.startswith("and ") for line in block[1:])
        return Report(names[0], ours, max(pairs, 1))
    if "Warning" in header:
        return None
    return Report(names[-1], ours)


def read(path: str) -> Run:
    """A log's summaries and reports; a missing log is a run not summarized."""
    run = Run(path)
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return run
    races, errors = [], []
    for block in blocks(text):
        header = block[0]
        for pattern, counts in ((RACE_SUMMARY, races), (ERROR_SUMMARY, errors)):
            match = pattern.match(header)
            if match:
                counts.append(int(match[1]))
        run.hazard_limit |= HAZARD_LIMIT in header
        found = report(block)
        if found is not None:
            run.reports.append(found)
    # One summary a process (pytest's subprocesses have their own); a
    # racecheck log's errors are its RACECHECK SUMMARY's.
    run.summarized = bool(races or errors)
    run.errors = sum(races or errors)
    return run


def short(name: str) -> str:
    """Ours: the kernel's module and class (``cutedslselectkernelSelectTopk``);
    others: the function and its template arguments, without ``void`` and
    the parameters, at most ``WIDTH`` characters."""
    if OURS in name:
        return name.split(OURS, 1)[1].split("_", 1)[0] or name[:WIDTH]
    name = re.sub(r" \[clone [^\]]*\]$", "", re.sub(r"^void ", "", name.strip()))
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, 0, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i].rstrip()
                break
    return name if len(name) <= WIDTH else name[: WIDTH - 3] + "..."


def named(counts: Counter, top: int) -> str:
    if not counts:
        return ""
    most = [f"{n} {kernel}" for kernel, n in counts.most_common(top)]
    if len(counts) > top:
        most.append(f"{len(counts) - top} more kernels")
    return " [" + ", ".join(most) + "]"


def summary_line(runs: list[Run], top: int = 3) -> str:
    """The errors the summaries count, the runs summarized, those in our
    kernels and in others (the ``top`` kernels of each with the most), and
    what is not attributed."""
    ours, others = Counter(), Counter()
    for run in runs:
        for found in run.reports:
            (ours if found.ours else others)[short(found.kernel)] += found.errors
    summarized = sum(run.summarized for run in runs)
    errors = sum(run.errors for run in runs)
    line = (
        f"{errors} error{'s' * (errors != 1)} reported ({summarized} of "
        f"{len(runs)} runs summarized): {sum(ours.values())} in our kernels"
        f"{named(ours, top)}, {sum(others.values())} in other kernels"
        f"{named(others, top)}"
    )
    unprinted = sum(run.unprinted for run in runs)
    if unprinted:
        line += f"; {unprinted} not printed (past --print-limit), kernels unknown"
    if any(run.hazard_limit for run in runs):
        line += "; racecheck hit its hazard limit, more went uncounted"
    return line


def failed(runs: list[Run]) -> bool:
    """A report in ours, a run not summarized, or errors not attributed."""
    return any(
        not run.summarized
        or run.unprinted
        or run.hazard_limit
        or any(found.ours for found in run.reports)
        for run in runs
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("logs", nargs="+", metavar="LOG", help="a run's log")
    parser.add_argument(
        "--top", type=int, default=3, metavar="N", help="kernels named a side (3)"
    )
    args = parser.parse_args(argv)
    runs = [read(path) for path in args.logs]
    print(summary_line(runs, args.top))
    return 1 if failed(runs) else 0


if __name__ == "__main__":
    sys.exit(main())
