# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The repo's patches follow CONTRIBUTING.md, "Adding a patch": each opens
with its header (its concern, then why), each has a row in the README's
patch table, and patches/ holds no patch file outside the series."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools import patchset

PDIR = patchset.REPO_ROOT / "patches"
README = patchset.REPO_ROOT / "README.md"
TABLE = ("<!-- patches -->", "<!-- /patches -->")
PLACEHOLDERS = ("# CONCERN.", "# WHY.")  # the recipe's header template


def header_problems(text: str) -> list[str]:
    """What breaks the header rule: a ``# `` line (the concern, ending in a
    period), a lone ``#``, one or more ``#`` lines with at least one of text
    (why), a blank line, then the first ``diff --git`` line."""
    head, sep, _ = text.partition("diff --git ")
    if not sep:
        return ["no 'diff --git' line"]
    if not head.endswith("\n\n"):
        return ["expected a header, then a blank line before the first diff --git"]
    lines = head[:-2].split("\n")
    problems = []
    if not re.fullmatch(r"# \S.*\.", lines[0]):
        problems.append(f"line 1 {lines[0]!r}: expected '# <concern>.'")
    if lines[1:2] != ["#"]:
        problems.append("line 2: expected a lone '#' between concern and why")
    why = lines[2:]
    if not any(re.fullmatch(r"# \S.*", line) for line in why):
        problems.append("expected '# <why>' lines after the lone '#'")
    problems += [
        f"line {i}: {line!r}: expected '#' or '# text'"
        for i, line in enumerate(why, 3)
        if not re.fullmatch(r"#( .*)?", line)
    ]
    problems += [f"{p!r}: replace the placeholder" for p in PLACEHOLDERS if p in lines]
    return problems


def readme_rows(text: str) -> list[str]:
    """Patch names (first cell, in backticks) of the table between the
    README's markers."""
    start, end = TABLE
    if start not in text or end not in text.partition(start)[2]:
        pytest.fail(
            f"{README}: expected the patch table between a line {start} and a "
            f"line {end} (CONTRIBUTING.md, 'Adding a patch')"
        )
    block = text.partition(start)[2].partition(end)[0]
    return re.findall(r"(?m)^\|\s*`([^`]+)`\s*\|", block)


@pytest.mark.parametrize("patch", patchset.Patchset.load().patches, ids=str)
def test_patch_opens_with_concern_and_why(patch: Path):
    problems = header_problems(patch.read_text())
    assert not problems, f"{patch}: header: " + "; ".join(problems)


def test_header_rule_refuses_what_the_recipe_leaves():
    diff = "diff --git a/vllm/x.py b/vllm/x.py\n"
    assert header_problems("# Concern.\n#\n# Why: because.\n\n" + diff) == []
    assert header_problems("# Concern.\n#\n# Why.\n#\n# More.\n\n" + diff) == []
    template = "# CONCERN.\n#\n# WHY.\n\n" + diff
    assert header_problems(template) == [
        f"{p!r}: replace the placeholder" for p in PLACEHOLDERS
    ]
    assert header_problems(diff)[0].startswith("expected a header")
    assert "expected a lone '#'" in header_problems("# C.\n# Why.\n\n" + diff)[0]


def test_readme_patch_table_matches_the_series():
    series = [p.stem for p in patchset.Patchset.load().patches]
    rows = readme_rows(README.read_text())
    missing = [n for n in series if n not in rows]
    extra = [n for n in rows if n not in series]
    twice = sorted({n for n in rows if rows.count(n) > 1})
    assert not missing, (
        f"{README}: no row for {missing} in the patch table; add "
        "'| `NNNN-topic` | what it changes | why |' between the markers"
    )
    assert not extra, f"{README}: patch table rows {extra} name no patch in series"
    assert not twice, f"{README}: patch table rows {twice} appear twice"


def test_every_patch_file_is_in_the_series():
    listed = set(patchset.Patchset.load().patches)
    stray = sorted(p.name for p in PDIR.glob("*.patch") if p not in listed)
    assert not stray, (
        f"{PDIR}: {stray} not in patches/series; add them (in number order) "
        "or delete them"
    )
