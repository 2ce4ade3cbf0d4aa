# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""README.md's labels against their JSON, read back from the README: each
gain cell is the DSA layers x the per-layer saving, per token and over the
cited step, a step the source did not time is a floor; every size the
opt-ins' text calls past one wave is past one wave of the select's clusters
(the patched vLLM's rule on the JSON's card) and every such size is named; a
size slower than stock within one wave is reported; every row where the
select alone is slower than stock within one wave is named as slower, and
every size named as faster is faster, in the README and in the reviewed
run; the text names the card of its JSON, whatever it is. Pins and
commits the text quotes are checked where they can be."""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil

import pytest

from tools import readme_figures as rf

REPO = rf.REPO
SCORES, SELECT = rf.bench("scores"), rf.bench("select")
FP32 = "sm90-flashinfer"
# The select's run a review read its labels from (6eb5142, 2026-12-03).
REVIEWED = "docs/bench-select-h200.json"


def load(source: str, root=REPO) -> dict:
    return json.loads((root / source).read_text())


def block_text(name: str, root=REPO) -> str:
    """The README's block ``name``, each run of whitespace one space."""
    text = (root / "README.md").read_text()
    (body,) = [body for n, _, body in rf.BLOCK.findall(text) if n == name]
    return body


@pytest.fixture
def copy(tmp_path):
    """A copy of the README, docs/*.md and docs/*.json under ``tmp_path``."""
    shutil.copy(rf.README, tmp_path / "README.md")
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    return tmp_path


def rewrite(root, source: str, change) -> None:
    path = root / source
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def step(data: dict, requests: int, next_n: int, pools: int) -> dict:
    (row,) = [
        r
        for r in data["scores"]
        if (r["rows"], r["next_n"], r["context"]) == (requests, next_n, pools)
    ]
    return row


def test_the_pins_are_vllm_0_33_0_s():
    """`pip install vllm==0.33.0` brings the torch and triton the README
    names: vLLM's pin of torch, torch's of triton."""
    assert f"torch=={rf.PINS['torch']}" in importlib.metadata.requires("vllm")
    triton = [r for r in importlib.metadata.requires("torch") if r.startswith("triton")]
    assert any(
        re.match(rf"triton(==|~=){re.escape(rf.PINS['triton'])}\b", r) for r in triton
    ), triton


@pytest.mark.parametrize("name", ["tail", "gain", "select"])
def test_a_block_names_the_card_and_commit_of_its_json(name):
    meta = load(rf.BLOCKS[name][0])["meta"]
    text = rf.flat(block_text(name))
    assert f"one {meta['gpu'].removeprefix('NVIDIA ')}" in text
    assert f"commit {rf.flat(meta['commit'])}, {meta['date']}" in text


def test_the_text_names_the_card_its_json_gives(copy):
    """The bench's figures measured on an H100 say so: no H200 in their text
    but the cited step times'."""
    h100 = "NVIDIA H100 80GB HBM3"
    for source in {rf.BENCH, *rf.SPLIT.values()}:
        rewrite(copy, source, lambda data: data["meta"].update(gpu=h100))
    cited = ("8 x H200 node", "on H200 or H100 was found")
    for name, (source, _) in rf.BLOCKS.items():
        if source in {rf.BENCH, *rf.SPLIT.values()}:
            text = rf.flat(rf.render(name, source, copy))
            assert "H200" not in re.sub("|".join(cited), "", text), name
    assert "on the H100 80GB HBM3's 132 SMs" in rf.flat(
        rf.render("select", SELECT, copy)
    )


def test_each_gain_cell_is_the_layers_saving_over_the_cited_step():
    data = load(SCORES)
    widths = data["meta"]["plan"]["step_pools"]
    lines = [ln for ln in block_text("gain").splitlines() if re.match(r"\| \d+ \(", ln)]
    assert [int(ln.split()[1]) for ln in lines] == list(rf.GAIN_REQUESTS)
    header = [ln for ln in block_text("gain").splitlines() if ln.startswith("| req")]
    contexts = [
        f"{4 * w >> 20}M" if 4 * w >= 1 << 20 else f"{4 * w >> 10}K" for w in widths
    ]
    got = [c.strip() for c in header[0].strip("|").split("|")][1:]
    assert got == [f"{contexts[0]} tokens", *contexts[1:]]
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        n = int(cells[0].split()[0])
        floor = n not in rf.STEP_MS
        ms = rf.STEP_MS[n] if not floor else rf.STEP_MS[max(rf.STEP_MS)]
        assert cells[0] == f"{n} ({'≥ ' * floor}{ms:.1f} ms)"
        for w, cell in zip(widths, cells[1:], strict=True):
            stock, stage = step(data, n, 1, w)["step_graph_us"]
            saving = rf.DSA_LAYERS * (stock - stage)
            token, share = cell.split(", ")
            assert float(token.removesuffix(" µs")) == pytest.approx(
                saving / n, rel=0.01
            )
            assert share.startswith("≤ ") == floor
            value = float(share.removeprefix("≤ ").removesuffix(" %"))
            exact = 100 * saving / (1000 * ms)
            assert abs(value - exact) <= (0.05 if exact >= 0.995 else 0.005) + 1e-9


def test_the_contexts_the_data_lacks_are_said():
    text = rf.flat(block_text("gain"))
    assert "32K was not measured" in text
    assert 8192 not in load(SCORES)["meta"]["plan"]["step_pools"]


def test_a_step_time_the_source_gave_is_no_floor(monkeypatch):
    monkeypatch.setattr(rf, "STEP_MS", {**rf.STEP_MS, 64: 20.0})
    text = rf.render("gain", SCORES)
    assert "| 64 (20.0 ms) |" in text
    assert "≤" not in text and "a floor" not in text


SIZES = re.compile(r"(\d+)(?:-(\d+))? requests of (\d+[KM])(?:-(\d+[KM]))? tokens")


def named_sizes(phrase: str, plan: dict) -> set[tuple[int, int, int]]:
    """(requests, pools, next_n) of a phrase like ``64 requests of 512K-1M
    tokens (next_n 2: 32-64 requests of 512K-1M tokens)``."""
    requests, pools = plan["step_rows"], plan["step_pools"]
    contexts = [rf.tokens(w) for w in pools]
    first, _, second = phrase.partition("(next_n 2:")
    out = set()
    for next_n, part in ((1, first), (2, second)):
        for a, b, c, d in SIZES.findall(part):
            ns = requests[requests.index(int(a)) : requests.index(int(b or a)) + 1]
            ts = contexts[contexts.index(c) : contexts.index(d or c) + 1]
            out |= {(n, pools[contexts.index(t)], next_n) for n in ns for t in ts}
    return out


PAST = re.compile(
    r"saves [\d.-]+ µs a layer within one wave of its clusters \(all (\d+) sizes "
    r"there, [\d.-]+x stock's step\); past one wave it is slower than stock, "
    r"[\d.-]+x \([\d.-]+ µs a layer more\), at (.+?)(?:, and faster, [\d.-]+x, at "
    r"(.+?))?(?:\. `|; our)"
)


@pytest.mark.parametrize(
    "setting, key",
    [(0, "step_select_graph_us"), (1, "step_scores_graph_us")],
    ids=["kpool_select", "kpool_scores"],
)
def test_what_the_opt_ins_call_past_one_wave_is_past_it(setting, key):
    """The reviewed case first: 32 requests of 128K pools at next_n 1 are
    within one wave on the H200, so no label past one wave may hold them."""
    data = load(SCORES)
    plan, sms = data["meta"]["plan"], rf.sms_of(data)
    assert rf.one_wave(32, 131072, FP32, sms)

    def past(r):
        return not rf.step_one_wave(r, sms)

    found = PAST.findall(rf.flat(block_text("opt_in")))
    assert len(found) == 2, found
    within, slower, faster = found[setting]
    rows = {(r["rows"], r["context"], r["next_n"]): r for r in data["scores"]}
    slower, faster = named_sizes(slower, plan), named_sizes(faster, plan)
    assert (32, 131072, 1) not in slower | faster
    assert slower | faster == {k for k, r in rows.items() if past(r)}
    assert int(within) == sum(not past(r) for r in rows.values())
    assert all(rows[k][key][0] < rows[k][key][1] for k in slower)
    assert all(rows[k][key][0] >= rows[k][key][1] for k in faster)


def test_a_size_slower_than_stock_within_one_wave_is_reported(copy):
    def slower(data):
        row = step(data, 32, 1, 131072)
        row["step_select_graph_us"][1] = row["step_select_graph_us"][0] * 1.1

    rewrite(copy, SCORES, slower)
    label = (
        f"README.md: figure block 'opt_in': {SCORES} "
        "contradicts it: step_select_graph_us: slower than stock within one wave"
    )
    assert rf.problems(copy / "README.md", copy) == [label]


def test_the_old_past_one_wave_label_is_reported(copy):
    readme = copy / "README.md"
    marker = f"<!-- figures: opt_in from {SCORES} -->\n"
    old = (
        "0.81-1.05x at 32-64 requests of 128K-256K pools, where the select runs "
        "past one wave of its clusters\n"
    )
    readme.write_text(readme.read_text().replace(marker, marker + old))
    (problem,) = rf.problems(readme, copy)
    assert problem.startswith("README.md: figure block 'opt_in' differs")


def fp32_within(data: dict) -> list[dict]:
    sms = rf.sms_of(data)
    return [
        r
        for r in data["select"]
        if r["path"] == FP32 and rf.one_wave(r["rows"], r["width"], r["path"], sms)
    ]


def fp32_text(text: str) -> tuple[str, str]:
    """The FP32 part of the select block: what it calls faster, slower."""
    fp32 = rf.flat(text).split("on Hopper's FP32 logits it is")[1]
    fp32 = fp32.split(". Its chain")[0]
    faster, slower = fp32.split("; slower than stock ")
    return faster, slower


def slower_name(r: dict) -> str:
    if r["width"] == 16384:
        return "at 16K pools"
    if r["context"].startswith("short"):
        return "at short row ends"
    return f"at {rf.select_size(r)}"


def check_select(text: str, data: dict) -> None:
    """Every FP32 row within one wave where the select alone is slower is
    named as slower; every size named as faster is faster at every row end
    and logits (those with fewer than k positive aside)."""
    faster, slower = fp32_text(text)
    rows = fp32_within(data)
    for r in rows:
        if round(rf.ratio(r["select_graph_us"]), 2) < 1:
            assert slower_name(r) in slower, (r, slower)
    named = re.findall(r"((?:\d+(?:, | and ))*\d+) rows of (\d+)K pools", faster)
    assert named, faster
    for counts, width in named:
        for n in map(int, re.split(r", | and ", counts)):
            size = [
                r
                for r in rows
                if (r["rows"], r["width"]) == (n, 1024 * int(width))
                and not r["context"].startswith("short")
                and r["logits"] not in rf.BELOW_K
            ]
            assert size and all(rf.ratio(r["select_graph_us"]) > 1 for r in size), size
    bf16 = rf.flat(text).split("BF16 logits (with stock's upcast) it is")[1]
    if bf16.startswith(" faster at every size"):
        sms = rf.sms_of(data)
        assert all(
            rf.ratio(r["select_graph_us"]) > 1
            for r in data["select"]
            if r["path"] == "sm100-flashinfer"
            and rf.one_wave(r["rows"], r["width"], r["path"], sms)
        )


def test_every_row_where_the_select_alone_is_slower_is_named():
    """In the README, and in the reviewed run, the rows the review named among
    them: 32 rows (next_n 4) of 64K pools with random ends, 64 of 64K and 8
    of 256K, all within one wave."""
    check_select(block_text("select"), load(SELECT))
    data = load(REVIEWED)
    text = rf.wrap(rf.select_block(data))
    check_select(text, data)
    _, slower = fp32_text(text)
    for name in (
        "at 32 rows (next_n 4) of 64K pools with random ends (0.79x",
        "at 64 rows of 64K pools (0.95-0.97x",
        "at 8 rows of 256K pools (0.95-0.99x)",
    ):
        assert name in slower


@pytest.mark.parametrize(
    "rows, width, factor, named",
    [
        (1, 262144, 1.25, "at 1 row of 256K pools"),  # faster, made slower
        (8, 262144, 0.5, None),  # slower, made faster
    ],
)
def test_the_select_labels_follow_the_data(copy, rows, width, factor, named):
    def change(data):
        for r in data["select"]:
            if (r["path"], r["rows"], r["width"]) == (FP32, rows, width) and r[
                "context"
            ] in ("full", "random"):
                r["select_graph_us"][1] = r["select_graph_us"][0] * factor

    rewrite(copy, SELECT, change)
    data = load(SELECT, copy)
    text = rf.render("select", SELECT, copy)
    check_select(text, data)
    faster, slower = fp32_text(text)
    size = f"at {rows} row{'s' * (rows > 1)} of {width // 1024}K pools"
    assert (size in slower) == (named is not None)
    (problem,) = rf.problems(copy / "README.md", copy)
    assert problem.startswith("README.md: figure block 'select' differs")


def test_a_card_without_an_sm_count_is_reported(copy):
    rewrite(copy, SELECT, lambda data: data["meta"].update(gpu="NVIDIA B200"))
    found = rf.problems(copy / "README.md", copy)
    assert any("no SM count for 'NVIDIA B200'" in p for p in found), found
