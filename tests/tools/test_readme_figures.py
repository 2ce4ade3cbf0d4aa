# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/readme_figures.py: every figure block of README.md and docs/*.md is
what its committed JSON gives, and names that JSON; the bench's figures name
one JSON, and need only the fields tools/bench.py writes; every claim (a
range and its label in docs/*.md) is in its page as its JSON gives it; a
figure changed on either side, a label changed without its figure, and JSON
that contradicts a label are reported; the DSA layer count the per-token
figures use is transformers' GLM-5-Next config's. The tests take the figures
they change from the pages, so that they hold after a rerun. The README's
own labels: test_readme_figures_labels.py."""

from __future__ import annotations

import inspect
import json
import re
import shutil
from pathlib import Path

import pytest

from tools import readme_figures as rf

REPO = rf.REPO
# The JSON of tools other than tools/bench.py, and the fed select's run (a
# design measured and dropped, docs/performance.md).
OTHERS = {
    "docs/indexer-steps-h200.json",
    "docs/select-clusters-h200.json",
    "docs/scores-cold-h200.json",
    "docs/bench-step-fed-h200.json",
}


def load(source: str, root: Path = REPO) -> dict:
    return json.loads((root / source).read_text())


@pytest.fixture
def copy(tmp_path):
    """A copy of the README, docs/*.md and docs/*.json under ``tmp_path``."""
    shutil.copy(rf.README, tmp_path / "README.md")
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    return tmp_path


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


def test_the_bench_figures_name_one_json():
    """Every block and claim but the other tools' names the bench's JSON, or
    (until the bench's run holds them) the JSON SPLIT gives its part; so do
    the pages' markers."""
    bench = {rf.BENCH, *rf.SPLIT.values()}
    named = {source for source, _ in rf.BLOCKS.values()}
    named |= {source for _, sources, _ in rf.CLAIMS for source in sources}
    assert named - OTHERS == bench
    text = "".join(page.read_text() for page in rf.pages())
    assert {source for _, source, _ in rf.BLOCK.findall(text)} - OTHERS == bench


def test_a_split_part_is_of_a_later_run_than_the_bench_s():
    """SPLIT holds only parts the bench's JSON lacks or has from an earlier
    run: once the full bench is rerun, SPLIT must be emptied."""
    bench = load(rf.BENCH)
    for part, source in rf.SPLIT.items():
        data = load(source)
        assert data[part] and rf.bench(part) == source
        assert part not in bench or data["meta"]["date"] > bench["meta"]["date"]


# What tools/bench.py writes: its meta, and a select and a step case's row
# (``measure``: each pair's graph and eager figures and spreads; the select
# alone graph-replayed only; the scores alone, graph-replayed, no spread).
META = "gpu torch triton commit date copy copy_gbs plan stock_topk_so deep_gemm wall_s"
CASE = {
    "select": "path rows width context logits",
    "scores": "case rows next_n context heads scores_graph_us",
}
PAIRS = {
    "select": ("select", "chain"),
    "scores": ("step", "step_select", "step_scores"),
}


def written(part: str) -> set[str]:
    fields = set(CASE[part].split())
    for pair in PAIRS[part]:
        for timer in ("graph",) if pair == "select" else ("graph", "eager"):
            fields |= {f"{pair}_{timer}_us", f"{pair}_{timer}_spread"}
    return fields


def test_the_bench_figures_need_only_what_tools_bench_writes(copy):
    """No fed select (``step_fed_*``), no select of an earlier commit
    (``select_graph_us_before``) and no meta tools/bench.py does not write."""
    from tools import bench

    build = inspect.getsource(bench.build)
    assert re.findall(r'\("(step\w*)", \[stock\]', build) == list(PAIRS["scores"])
    assert re.findall(r'\("(select|chain)", \[', build) == list(PAIRS["select"])
    for source in {rf.BENCH, *rf.SPLIT.values()}:
        data = load(source, copy)
        data["meta"] = {k: data["meta"][k] for k in META.split() if k in data["meta"]}
        for part in {"select", "scores"} & data.keys():
            keep = written(part)
            data[part] = [{k: v for k, v in r.items() if k in keep} for r in data[part]]
        (copy / source).write_text(json.dumps(data))
    assert rf.problems(None, copy) == []


def a_row(page: Path, name: str) -> str:
    """The first row of block ``name``'s first table in ``page``."""
    (body,) = [b for n, _, b in rf.BLOCK.findall(page.read_text()) if n == name]
    lines = body.splitlines()
    return lines[1 + next(i for i, ln in enumerate(lines) if ln.startswith("| --"))]


def change(page: Path, row: str) -> None:
    """``row`` of ``page`` with its last figure 0.00."""
    edit(page, row, row.rsplit("|", 2)[0] + "| 0.00 |")


def test_a_changed_readme_figure_is_reported(copy):
    readme = copy / "README.md"
    row = a_row(readme, "tail")
    change(readme, row)
    (problem,) = rf.problems(readme, copy)
    assert problem.startswith("README.md: figure block 'tail' differs")
    assert row in problem  # what it should say


def test_a_changed_json_figure_is_reported(copy):
    path = copy / rf.bench("select")
    data = json.loads(path.read_text())
    (row,) = [
        r
        for r in data["select"]
        if (r["path"], r["rows"], r["width"], r["context"], r["logits"])
        == ("sm90-flashinfer", 1, 65536, "full", "randn")
    ]
    row["select_graph_us"][1] *= 1.5  # the select's: the tail block has stock's
    path.write_text(json.dumps(data))
    (problem,) = rf.problems(copy / "README.md", copy)
    assert problem.startswith("README.md: figure block 'select' differs")


def test_blocks_missing_or_naming_another_source_are_reported(copy):
    readme = copy / "README.md"
    text = readme.read_text()
    text = text.replace(
        "<!-- figures: steps from docs/indexer-steps-h200.json -->",
        f"<!-- figures: steps from {rf.BENCH} -->",
    )
    start = text.index("<!-- figures: select ")
    end = text.index("<!-- /figures -->", start) + len("<!-- /figures -->")
    readme.write_text(text[:start] + text[end:])
    other = f"names {rf.BENCH}, expected docs/indexer-steps-h200.json"
    assert rf.problems(readme, copy) == [
        f"figure block 'steps': {other}",
        "README.md: no figure block 'select'",
    ]


def test_write_restores_the_blocks_and_their_markers(copy):
    """A figure changed, and a marker naming another JSON than its block's."""
    readme = copy / "README.md"
    change(readme, a_row(readme, "tail"))
    edit(readme, "steps from docs/indexer-steps-h200.json", f"steps from {rf.BENCH}")
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
    row = a_row(page, "kernels")
    change(page, row)
    (problem,) = rf.problems(page, copy)
    assert problem.startswith("docs/performance.md: figure block 'kernels' differs")
    assert row in problem


def edit_claim(page: Path, pattern: str, new: str) -> str:
    """``pattern``'s one match in ``page`` (a space: any whitespace) with its
    group ``new``; the match as it was, whitespace flattened."""
    text = page.read_text()
    (m,) = re.finditer(pattern.replace(" ", r"\s+"), text)
    page.write_text(text[: m.start(1)] + new + text[m.end(1) :])
    return rf.flat(m[0])


@pytest.mark.parametrize(
    "pattern, new",
    [
        # The two ranges a review found wrong, and a label changed, its figures
        # kept (they are from 4 rows).
        (r"select is ([\d.-]+)x stock's at 32-64 requests of 128K-256K pools", "0.9"),
        (r"\(([\d.-]+)x at 16K-64K pools,", "0.72-0.94"),
        (r"at 16K pools from (4) rows \(", "8"),
    ],
)
def test_a_range_its_json_does_not_give_is_reported(copy, pattern, new):
    page = copy / rf.PERFORMANCE
    right = edit_claim(page, pattern, new)
    (problem,) = rf.problems(page, copy)
    assert problem.startswith("docs/performance.md: not found; from docs/")
    assert right in problem  # what it should say


def test_the_claims_alone_with_the_passage_to_edit(copy):
    """``near`` (``--claims``): a claim not found with the page's passage most
    like it; a block that differs not reported."""
    page = copy / rf.PERFORMANCE
    change(page, a_row(page, "kernels"))
    pattern = r"at 16K pools from 4 rows \(([\d.-]+)x;"
    edit_claim(page, pattern, "0.11-0.22")
    (problem,) = rf.problems(page, copy, near=True)
    assert problem.startswith("docs/performance.md: not found; from docs/")
    assert "\n  nearest: 'at 16K pools from 4 rows (0.11-0.22x;" in problem


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
    path = copy / rf.bench("scores")
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
        f"docs/performance.md: {rf.bench('scores')} contradicts a label: "
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
        f"{rf.bench('select')} contradicts it: the row labelled "
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
    change(page, a_row(page, "chain_table"))
    rf.write(None, copy)
    assert page.read_text() == (REPO / rf.PERFORMANCE).read_text()
    assert rf.problems(None, copy) == []
