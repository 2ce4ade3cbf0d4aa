# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/readme_figures.py: every figure block of README.md is what its
committed JSON gives, and names that JSON; a figure changed on either side
is reported; the DSA layer count the per-token figures use is transformers'
GLM-5-Next config's."""

from __future__ import annotations

import json
import shutil

import pytest

from tools import readme_figures as rf

REPO = rf.REPO


def test_readme_figures_are_their_json():
    assert rf.problems() == []


def test_each_block_links_its_source():
    for name, (source, _) in rf.BLOCKS.items():
        assert f"]({source})" in rf.render(name, source), name


@pytest.fixture
def copy(tmp_path):
    """A copy of the README and the JSON it names, under ``tmp_path``."""
    shutil.copy(rf.README, tmp_path / "README.md")
    (tmp_path / "docs").mkdir()
    for source in {source for source, _ in rf.BLOCKS.values()}:
        shutil.copy(REPO / source, tmp_path / source)
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
    assert config.num_hidden_layers == 45
    assert config.layer_types.count("indexed_attention") == rf.DSA_LAYERS
