# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/readme_figures.py: every figure block of README.md and docs/*.md is
what its committed JSON gives, and names that JSON; every claim (a range
and its label in docs/*.md) is in its page as its JSON gives it; a figure
changed on either side, a label changed without its figure, and JSON that
contradicts a label are reported; the DSA layer count the per-token figures
use is transformers' GLM-5-Next config's. The README's own labels:
test_readme_figures_labels.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tools import readme_figures as rf

REPO = rf.REPO


def test_every_page_s_figures_are_their_json():
    assert rf.problems() == []


def test_a_page_named_from_the_repository_root(monkeypatch):
    monkeypatch.chdir(REPO)
    for page in ("README.md", "docs/performance.md", "docs/validation.md"):
        assert rf.problems(Path(page)) == [], page


def test_the_docs_pages_have_blocks_and_claims():
    pages = {*rf.PAGE_OF.values(), *(page for page, _, _ in rf.CLAIMS)}
    assert {"README.md", rf.PERFORMANCE, rf.VALIDATION} <= pages
    assert [p.relative_to(REPO).as_posix() for p in rf.pages()][:1] == ["README.md"]


def test_each_block_links_its_source():
    """A README block links its JSON; a docs page links or names the JSON of
    each of its blocks."""
    for name, (source, _) in rf.BLOCKS.items():
        page = rf.PAGE_OF[name]
        if page == "README.md":
            assert f"]({source})" in rf.render(name, source), name
        else:
            assert Path(source).name in (REPO / page).read_text(), name


@pytest.fixture
def copy(tmp_path):
    """A copy of the README, docs/*.md and docs/*.json under ``tmp_path``."""
    shutil.copy(rf.README, tmp_path / "README.md")
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    return tmp_path


def test_a_changed_readme_figure_is_reported(copy):
    readme = copy / "README.md"
    text = readme.read_text()
    assert "| 1 | 13.3 | 3.2 | 10.2 |" in text
    readme.write_text(
        text.replace("| 1 | 13.3 | 3.2 | 10.2 |", "| 1 | 13.3 | 3.2 | 10.9 |")
    )
    (problem,) = rf.problems(readme, copy)
    assert problem.startswith("README.md: figure block 'tail' differs")
    assert "| 1 | 13.3 | 3.2 | 10.2 |" in problem  # what it should say


def test_a_changed_json_figure_is_reported(copy):
    path = copy / "docs" / "bench-select-h200.json"
    data = json.loads(path.read_text())
    (row,) = [
        r
        for r in data["select"]
        if (r["path"], r["rows"], r["width"], r["context"], r["logits"])
        == ("sm90-flashinfer", 1, 65536, "full", "randn")
    ]
    row["select_graph_us"][0] *= 1.5
    path.write_text(json.dumps(data))
    (problem,) = rf.problems(copy / "README.md", copy)
    assert problem.startswith("README.md: figure block 'select' differs")


def test_blocks_missing_or_naming_another_source_are_reported(copy):
    readme = copy / "README.md"
    text = readme.read_text()
    text = text.replace(
        "<!-- figures: steps from docs/indexer-steps-h200.json -->",
        "<!-- figures: steps from docs/bench-h200.json -->",
    )
    start = text.index("<!-- figures: select ")
    end = text.index("<!-- /figures -->", start) + len("<!-- /figures -->")
    readme.write_text(text[:start] + text[end:])
    other = "names docs/bench-h200.json, expected docs/indexer-steps-h200.json"
    assert rf.problems(readme, copy) == [
        f"figure block 'steps': {other}",
        "README.md: no figure block 'select'",
    ]


def test_write_restores_the_blocks(copy):
    readme = copy / "README.md"
    readme.write_text(readme.read_text().replace("10.2 | 4.20", "10.9 | 4.90"))
    rf.write(readme, copy)
    assert readme.read_text() == rf.README.read_text()


def test_dsa_layers_are_transformers_glm5next_config():
    from transformers.models.glm5_next.configuration_glm5_next import (
        Glm5NextTextConfig,
    )

    config = Glm5NextTextConfig()
    assert config.num_hidden_layers == rf.LAYERS == 45
    dsa = [i for i, t in enumerate(config.layer_types) if t == "indexed_attention"]
    assert dsa == list(range(rf.FIRST_DSA_LAYER, rf.LAYERS, 4))
    assert len(dsa) == rf.DSA_LAYERS
    assert set(config.layer_types) - {"indexed_attention"} == {"linear_attention"}


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def test_a_changed_docs_table_figure_is_reported(copy):
    page = copy / rf.PERFORMANCE
    edit(page, "| expand  | 1.29 | 1.39 |", "| expand  | 1.29 | 1.93 |")
    (problem,) = rf.problems(page, copy)
    assert problem.startswith("docs/performance.md: figure block 'kernels' differs")
    assert "| expand  | 1.29 | 1.39 |" in problem


@pytest.mark.parametrize(
    "right, wrong",
    [
        # The two ranges issue 57 named, as they were.
        (
            "select is 0.85-1.06x stock's at 32-64 requests of 128K-256K pools",
            "select is 0.85-0.98x stock's at 32-64 requests of 128K-256K pools",
        ),
        ("(0.72-0.93x at 16K-64K pools,", "(0.72-0.94x at 16K-64K pools,"),
        # A label changed, its figures kept: 0.71-0.97x is from 4 rows.
        (
            "at 16K pools from 4 rows (0.71-0.97x;",
            "at 16K pools from 8 rows (0.71-0.97x;",
        ),
    ],
)
def test_a_range_its_json_does_not_give_is_reported(copy, right, wrong):
    page = copy / rf.PERFORMANCE
    edit(page, right, wrong)
    (problem,) = rf.problems(page, copy)
    assert problem.startswith("docs/performance.md: not found; from docs/")
    assert " ".join(right.split()) in problem  # what it should say


def test_a_changed_json_figure_is_reported_in_the_docs(copy):
    path = copy / "docs" / "select-clusters-h200.json"
    data = json.loads(path.read_text())
    (row,) = [
        r
        for r in data["picked_and_stock"]
        if (r["dtype"], r["rows"], r["width"]) == ("float32", 64, 65536)
    ]
    row["stock_us"] *= 1.2  # 16.06 µs: the select 0.93x -> 1.12x stock's
    path.write_text(json.dumps(data))
    found = rf.problems(copy / rf.PERFORMANCE, copy)
    assert len(found) == 2, found
    assert found[0].startswith("docs/performance.md: figure block 'clusters_table'")
    assert "0.31-1.12x stock's top-k from 64 rows" in found[1]


def test_json_that_contradicts_a_label_is_reported(copy):
    """Where the data moves a size across a label's line (slower than stock
    at next_n 2 from 32 requests and next_n 1 at 64), the label is reported,
    not only the figures."""
    path = copy / "docs" / "bench-scores-h200.json"
    data = json.loads(path.read_text())
    (row,) = [
        r
        for r in data["scores"]
        if (r["rows"], r["next_n"], r["context"]) == (32, 1, 131072)
    ]
    row["step_scores_graph_us"][1] = row["step_scores_graph_us"][0] * 1.2
    path.write_text(json.dumps(data))
    found = rf.problems(copy / rf.PERFORMANCE, copy)
    label = (
        "docs/performance.md: docs/bench-scores-h200.json contradicts a label: "
        "slower than stock at (next_n, requests) [(1, 32), (1, 64), (2, 32), (2, 64)]"
    )
    assert any(p.startswith(label) for p in found), found


def test_a_table_label_its_row_does_not_fit_is_reported(monkeypatch, copy):
    table = list(rf.SELECT_TABLE)
    table[3] = ("FP32 randn", "8 x 64K, full", table[3][2])  # 1 x 64K's row
    monkeypatch.setattr(rf, "SELECT_TABLE", table)
    (problem,) = rf.problems(copy / rf.PERFORMANCE, copy)
    assert problem == (
        "docs/performance.md: figure block 'select_table': "
        "docs/bench-select-h200.json contradicts it: the row labelled "
        "'FP32 randn', '8 x 64K, full' is ('sm90-flashinfer', 1, 65536)"
    )


def test_a_block_in_another_page_is_reported(copy):
    readme, page = copy / "README.md", copy / rf.PERFORMANCE
    text = page.read_text()
    start = text.index("<!-- figures: upcast ")
    end = text.index("<!-- /figures -->", start) + len("<!-- /figures -->")
    page.write_text(text[:start] + text[end:])
    readme.write_text(readme.read_text() + "\n" + text[start:end] + "\n")
    assert rf.problems(readme, copy) == [
        "README.md: figure block 'upcast' belongs in docs/performance.md"
    ]
    assert rf.problems(page, copy) == ["docs/performance.md: no figure block 'upcast'"]


def test_write_restores_the_docs_blocks(copy):
    page = copy / rf.PERFORMANCE
    edit(
        page, "| 1 x 4K, 1 | 17.9 | 9.4 | 7.5 | 2.38 |", "| 1 x 4K, 1 | 1 | 1 | 1 | 1 |"
    )
    rf.write(None, copy)
    assert page.read_text() == (REPO / rf.PERFORMANCE).read_text()
    assert rf.problems(None, copy) == []
