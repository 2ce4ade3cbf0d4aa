# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The repo's patches follow CONTRIBUTING.md, "Adding a patch": each opens
with a header (its concern, then why; ``patchset.header_problems``, which
``pin`` also enforces), every patch file is in the series, and
docs/reference.md's table of patches (whichever table lists them) matches it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools import patchset

PDIR = patchset.REPO_ROOT / "patches"
REFERENCE = patchset.REPO_ROOT / "docs" / "reference.md"
PATCHES = patchset.Patchset.load().patches


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_opens_with_concern_and_why(patch: Path):
    problems = patchset.header_problems(patch.read_text())
    assert not problems, f"{patch}: header: " + "; ".join(problems)


def test_header_rule_refuses_what_the_recipe_leaves():
    problems, diff = patchset.header_problems, "diff --git a/vllm/x.py b/vllm/x.py\n"
    assert problems("# Concern.\n#\n# Why: because.\n#\n# More.\n\n" + diff) == []
    assert problems("# CONCERN.\n#\n# WHY.\n\n" + diff)[:2] == [
        f"{p!r}: replace the placeholder" for p in patchset.PLACEHOLDERS
    ]
    assert problems(diff)[0].startswith("expected a header")
    assert "expected a lone '#'" in problems("# C.\n# Why.\n\n" + diff)[0]


def test_every_patch_file_is_in_the_series():
    stray = sorted({p.name for p in PDIR.glob("*.patch")} - {p.name for p in PATCHES})
    assert not stray, f"{PDIR}: {stray} not in patches/series; list or delete them"


def patch_tables(markdown: str) -> list[list[str]]:
    """The first cells (``NNNN-topic``, backticks, .patch optional) of each
    markdown table whose first column names patches."""
    tables = re.findall(r"(?m)(?:^\|.*\n?)+", markdown)
    cells = [
        re.findall(r"(?m)^\|\s*`(\d{4}-[^`]+?)(?:\.patch)?`\s*\|", t) for t in tables
    ]
    return [names for names in cells if names]


def test_patch_tables_find_the_names():
    text = (
        "x\n| patch | why |\n| --- | --- |\n| `0001-a` | b |\n| `0002-c.patch` | d |\n"
    )
    assert patch_tables(text + "\n| other | table |\n") == [["0001-a", "0002-c"]]


@pytest.mark.parametrize("doc", [REFERENCE], ids=lambda p: p.name)
def test_the_table_of_patches_matches_the_series(doc: Path):
    tables = patch_tables(doc.read_text())
    assert tables, (
        f"{doc}: no table lists the patches; expected one whose first column is "
        "each patch's name in backticks, e.g. | `0001-topic` | what | why |"
    )
    series = sorted(p.stem for p in PATCHES)
    for names in tables:
        assert sorted(names) == series, f"{doc}: a table lists {names}, not {series}"
