# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The shell commands of README.md, CONTRIBUTING.md and docs/*.md are safe to
paste: a block that writes under ``$OUT`` sets it first (unset, ``$OUT/x``
is ``/x``), and each ``tools/bench.py`` command line is one its parser
takes (a case selection that needs a flag the line lacks is refused)."""

import re
import shlex
from pathlib import Path

import pytest

from tools import bench

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted(REPO.glob("docs/*.md"))]
BLOCK = re.compile(r"^```(?:bash|sh)\n(.*?)^```", re.M | re.S)
USES_OUT = re.compile(r"\$\{?OUT\b(?!:-)")
SETS_OUT = re.compile(r"^\s*(?:export\s+)?OUT=", re.M)


def blocks() -> list[tuple[str, str]]:
    """(page and block number, the block's text, continuation lines joined)."""
    return [
        (f"{page.relative_to(REPO)}#{n}", text.replace("\\\n", " "))
        for page in PAGES
        for n, text in enumerate(BLOCK.findall(page.read_text()))
    ]


@pytest.mark.parametrize("where, text", blocks(), ids=[w for w, _ in blocks()])
def test_a_block_that_writes_under_out_sets_it_first(where, text):
    use = USES_OUT.search(text)
    if use is None:
        return
    sets = SETS_OUT.search(text)
    assert sets is not None and sets.start() < use.start(), (
        f"{where}: uses $OUT without setting it first"
    )


def bench_lines() -> list[tuple[str, list[str]]]:
    return [
        (where, shlex.split(line.split("tools/bench.py", 1)[1], comments=True))
        for where, text in blocks()
        for line in text.splitlines()
        if "tools/bench.py" in line
    ]


def test_the_bench_commands_are_found():
    assert len(bench_lines()) >= 3


@pytest.mark.parametrize(
    "where, args", bench_lines(), ids=[w for w, _ in bench_lines()]
)
def test_each_bench_command_parses(where, args, tmp_path):
    """The wheel's top-k binary stood in for by a file (the parser checks it
    is one)."""
    so = tmp_path / "topk.so"
    so.write_bytes(b"")
    args = [str(so) if a.endswith("stock-topk.so") else a for a in args]
    parsed = bench.parse_args(args)
    assert parsed.selected, f"{where}: {args} selects no case"
