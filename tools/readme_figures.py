#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The figures of README.md and docs/*.md, recomputed from the committed JSON
they cite.

A figure block is the text between ``<!-- figures: NAME from docs/X.json -->``
and ``<!-- /figures -->`` (a table, or a paragraph with its figures);
``BLOCKS[NAME]`` gives its page and its text from that JSON (its source,
which the text links or names). A claim is a phrase of a page, its figures
and the label they are of (``"0.85-1.06x stock's at 32-64 requests of
128K-256K pools"``), that must appear in the page as ``CLAIMS`` compute it
from the JSON (line breaks aside): a figure the data contradicts, or a
label changed without its figure, is reported. ``python
tools/readme_figures.py`` prints each block that differs and each claim not
found, with the text it should have, and exits 1 (CI checks the same
through ``tests/tools/test_readme_figures.py``); ``--write`` rewrites the
blocks (claims are prose: edit them by hand). A new block is a function
here, registered with ``@block(NAME, "docs/X.json", page)``, and its
markers in the page; a new claim a function registered with
``@claims(page, "docs/X.json")`` returning its phrases.

The blocks of the select's rule need the patched vLLM (its one-wave rule
decides where the stage runs the select): the overlay of the installed
vLLM, or the GPU tier's shim with ``KPOOL_KERNEL_ONLY=1``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PERFORMANCE = "docs/performance.md"
VALIDATION = "docs/validation.md"
BLOCK = re.compile(
    r"<!-- figures: ([\w-]+) from (docs/[\w.-]+\.json) -->\n(.*?)\n?<!-- /figures -->",
    re.S,
)
# GLM-5-Next's DSA layers: transformers' Glm5NextTextConfig has 45 layers,
# every fourth an indexed-attention one (the test checks it).
DSA_LAYERS = 11
# The H200's SMs, for the select's one-wave rule.
H200_SMS = 132
# The decode tail's contexts in tools/bench.py (topk_inputs: positions in
# [2**18 / 16, 2**18) tokens).
TAIL_CONTEXTS = "16K-256K tokens"

BLOCKS: dict[str, tuple[str, Callable[[dict], str]]] = {}
# The page each block is in (README.md or docs/NAME.md).
PAGE_OF: dict[str, str] = {}
# (page, sources, fn(*data) -> the phrases the page must hold).
CLAIMS: list[tuple[str, tuple[str, ...], Callable[..., list[str]]]] = []


def block(name: str, source: str, page: str = "README.md"):
    """Registers ``fn(data) -> text`` as the block ``name`` of ``source``,
    in ``page``."""

    def register(fn):
        BLOCKS[name] = (source, fn)
        PAGE_OF[name] = page
        return fn

    return register


def claims(page: str, *sources: str):
    """Registers ``fn(data, ...) -> [phrase]``: phrases of ``page`` from
    ``sources`` (their JSON, in order)."""

    def register(fn):
        CLAIMS.append((page, sources, fn))
        return fn

    return register


def pages(root: Path = REPO) -> list[Path]:
    """The pages checked: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def flat(text: str) -> str:
    """``text`` with each run of whitespace one space (line breaks aside)."""
    return " ".join(text.split())


def ratio(pair) -> float:
    """Stock time over the stage's, of a ``[stock, stage]`` pair."""
    return pair[0] / pair[1]


def span(values, fmt: str = ".2f") -> str:
    values = list(values)
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}-{high}"


def link(source: str) -> str:
    return f"[{source}]({source})"


def tail(data: dict, path: str) -> list[dict]:
    return sorted(
        (r for r in data["kernels"] if r["case"] == "tail" and r["path"] == path),
        key=lambda r: r["rows"],
    )


def run_of(data: dict) -> str:
    m = data["meta"]
    return (
        f"one {m['gpu'].removeprefix('NVIDIA ')} (torch {m['torch']}, triton "
        f"{m['triton']}, CuTe DSL 4.8.0), commit {m['commit']}, {m['date']}"
    )


def us(value: float) -> str:
    """µs at three significant digits or fewer (112, 15.5, 3.95)."""
    return f"{value:.{0 if value >= 100 else 1 if value >= 10 else 2}f}"


@block("tail", "docs/bench-h200.json")
def tail_block(data: dict) -> str:
    """The decode tail on FlashInfer SM90 by decode rows, each row's saving a
    token; the other paths' savings, the eager figures, the share of the
    tail and stock's top-k the stage removes."""
    sm90 = tail(data, "sm90-flashinfer")
    intro = (
        f"`tools/bench.py` on {run_of(data)} ({link('docs/bench-h200.json')}), "
        "graph-replayed, stock and the stage in one run: one DSA layer's decode "
        "tail (the update, the upcast where the path has one, the expansion and "
        f"conversion after a 512-pool top-k; contexts of {TAIL_CONTEXTS}) on "
        "FlashInfer SM90, Hopper's default; a token saves "
        f"{DSA_LAYERS} x the saving / rows (45 layers, every fourth a DSA layer):"
    )
    header = (
        "| decode rows | stock µs | stage µs | saving µs | stock/stage "
        "| per output token |"
    )
    lines = [intro, "", header, "| --: | --: | --: | --: | --: | --: |"]
    for r in sm90:
        stock, stage = r["graph_us"]
        saving = round(stock - stage, 1)
        token = us(DSA_LAYERS * saving / r["rows"])
        lines.append(
            f"| {r['rows']} | {stock:.1f} | {stage:.1f} | {saving:.1f} "
            f"| {ratio(r['graph_us']):.2f} | {token} µs |"
        )

    def saving(path):
        savings = (r["graph_us"][0] - r["graph_us"][1] for r in tail(data, path))
        return span(savings, ".1f")

    def topk(rows):
        (r,) = [
            r
            for r in data["select"]
            if (r["path"], r["rows"], r["width"], r["context"], r["logits"])
            == ("sm90-flashinfer", rows, 65536, "full", "randn")
        ]
        return r["select_graph_us"][0]

    def share(rows):
        (stock, stage), *_ = [r["graph_us"] for r in sm90 if r["rows"] == rows]
        return f"{100 * (stock - stage) / (stock + topk(rows)):.0f} %"

    spread = sum(max(r["eager_spread"]) > 0.10 for r in data["kernels"])
    eager = [span((r["eager_us"][side] for r in sm90), ".0f") for side in (0, 1)]
    rest = (
        f"FlashMLA FP8 saves {saving('flashmla-fp8')} µs a step, the SM100 path "
        f"(with the upcast) {saving('sm100-flashinfer')} µs. Eager, host counted, "
        f"stock's SM90 tail takes {eager[0]} µs and the stage's {eager[1]} µs "
        f"(noisy: {spread} of the {len(data['kernels'])} kernel rows spread over "
        f"10 %). Stock's top-k (FP32, 64K pools) took {topk(1):.1f} µs at 1 row "
        f"and {topk(64):.1f} at 64 in the same run: the stage removes {share(1)} "
        f"of the tail and the top-k together at 1 row, {share(64)} at 64. "
        "DeepGEMM's scores, which come first, were not timed."
    )
    return "\n".join([*lines, "", rest])


def one_wave(rows: int, width: int, path: str = "sm90-flashinfer") -> bool:
    """Whether the stage runs the select on an H200 (the patched vLLM's rule)."""
    import torch

    from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select import launch

    dtype = {"sm90-flashinfer": torch.float32, "sm100-flashinfer": torch.bfloat16}
    return launch.one_wave(rows, width, dtype[path], H200_SMS)


def max_one_wave_rows(width: int) -> int:
    rows = 1
    while one_wave(rows + 1, width):
        rows += 1
    return rows


@block("select", "docs/bench-select-h200.json")
def select_block(data: dict) -> str:
    runs = [r for r in data["select"] if one_wave(r["rows"], r["width"], r["path"])]
    past = [r for r in data["select"] if r not in runs and r["logits"] == "randn"]
    fp32 = [r for r in runs if r["path"] == "sm90-flashinfer"]
    bf16 = [r for r in runs if r["path"] == "sm100-flashinfer"]
    randn = [r for r in fp32 if r["logits"] == "randn"]
    ends = {r["context"].split(",")[0] for r in randn}
    assert ends == {"full", "random", "short"}, ends
    wide = [
        r
        for r in randn
        if r["width"] >= 65536
        and r["rows"] <= 8
        and not r["context"].startswith("short")
    ]
    (one,) = [
        r for r in randn if (r["rows"], r["width"], r["context"]) == (1, 65536, "full")
    ]
    slow = [r for r in randn if r["width"] == 16384 or r["context"].startswith("short")]
    below_k = [r for r in fp32 if r["logits"] in ("relu 0%", "relu 0.1%")]

    def sel(rows):
        return span(ratio(r["select_graph_us"]) for r in rows)

    def chain(rows):
        return span(ratio(r["chain_graph_us"]) for r in rows)

    def path(rows, name):
        return [r for r in rows if r["path"] == name]

    m = data["meta"]
    return (
        "With `kpool_select: true` the select runs at every decode batch size; "
        '`"one_wave"` keeps stock\'s top-k for batches past one wave of its '
        f"clusters (on the H200's {H200_SMS} SMs more than "
        f"{max_one_wave_rows(65536)} rows of 64K pools, {max_one_wave_rows(262144)} "
        "of 256K). Against stock's top-k in one run "
        f"({link('docs/bench-select-h200.json')}, `tools/bench.py`, k {m['k']}, "
        f"{m['date']}), within one wave: on the SM100 path's BF16 logits, with "
        f"stock's upcast, {sel(bf16)}x; on Hopper's FP32 logits {sel(wide)}x at "
        "1-8 rows of 64K-256K pools with full or random row ends "
        f"({ratio(one['select_graph_us']):.2f}x at 1 x 64K), {sel(below_k)}x on "
        "ReLU logits with fewer than k pools above 0.0, and slower at 16K pools and "
        f"at short row ends ({sel(slow)}x); its chain with the fused remap "
        f"{chain(fp32)}x on FP32, {chain(bf16)}x on BF16. Past one wave "
        f"({min(r['rows'] for r in past)}-{max(r['rows'] for r in past)} rows) it "
        f"is {sel(path(past, 'sm100-flashinfer'))}x on BF16 and "
        f"{sel(path(past, 'sm90-flashinfer'))}x on FP32, the cost of batch "
        'invariance that `"one_wave"` avoids.'
    )


@block("scores", "docs/bench-scores-h200.json")
def scores_block(data: dict) -> str:
    """The indexer decode after the query, DeepGEMM's scores on both sides."""
    rows = {(r["rows"], r["next_n"], r["context"]): r for r in data["scores"]}

    def at(requests, pools, key="step_graph_us"):
        return rows[(requests, 1, pools)][key]

    one, small, wide = at(1, 65536), at(1, 4096), at(64, 65536)
    eager = span(ratio(r["step_eager_us"]) for r in data["scores"])
    small_rows = [r for r in data["scores"] if r["rows"] <= 4]
    m = data["meta"]
    return (
        "With DeepGEMM's scores and stock's top-k on both sides, the indexer's "
        "decode after the query (scores, top-k, expansion and conversion; "
        f"{link('docs/bench-scores-h200.json')}, `tools/bench.py`, DeepGEMM on "
        "vLLM's padding to 32 heads, "
        f"{m['date']}) takes {one[0]:.1f} µs stock and {one[1]:.1f} µs with the "
        f"stage at 1 request of 64K pools ({ratio(one):.2f}x; "
        f"{ratio(small):.2f}x at 4K pools), "
        f"{span(ratio(r['step_graph_us']) for r in small_rows)}x at 1-4 requests "
        f"of 4K-256K pools and next_n 1-2, and {ratio(wide):.2f}x at 64 requests "
        "of 64K pools, where DeepGEMM's read of the index cache "
        f"({at(64, 65536, 'scores_graph_us')[0]:.0f} µs) is most of it; eager, "
        f"host counted, {eager}x."
    )


@block("step_scores", "docs/bench-scores-h200.json")
def step_scores_block(data: dict) -> str:
    """The indexer decode after the query with the opt-in scores and select."""
    rows = {(r["rows"], r["next_n"], r["context"]): r for r in data["scores"]}
    pair = "step_scores_graph_us"
    one, small, wide = rows[(1, 1, 65536)], rows[(1, 1, 4096)], rows[(64, 1, 65536)]
    few = [r for r in data["scores"] if r["rows"] <= 8]
    big = [r for r in data["scores"] if r["rows"] >= 32 and r["context"] >= 131072]
    return (
        "With `kpool_scores: true` too (our scores, then the select, on "
        f"the 16 real heads; {link('docs/bench-scores-h200.json')}): "
        f"{one[pair][1]:.1f} µs "
        f"against {one[pair][0]:.1f} at 1 x 64K ({ratio(one[pair]):.2f}x; "
        f"{ratio(small[pair]):.2f}x at 4K), {span(ratio(r[pair]) for r in few)}x "
        f"at 1-8 requests, {ratio(wide[pair]):.2f}x at 64 x 64K, and "
        f"{span(ratio(r[pair]) for r in big)}x at 32-64 requests of 128K-256K "
        "pools, where the select runs past one wave of its clusters "
        '(`kpool_select: "one_wave"` keeps stock\'s top-k there).'
    )


@block("steps", "docs/indexer-steps-h200.json")
def steps_block(data: dict) -> str:
    runs = [r for r in data["runs"] if r["steps"]["decode_steps"] >= 1000]
    commits: dict[str, int] = {}
    for r in runs:
        commits[r["commit"]] = commits.get(r["commit"], 0) + 1
    newest = data["runs"][-1]["commit"]
    older = ", ".join(f"{n} on commit {c}" for c, n in commits.items() if c != newest)
    return (
        "- the patched indexer driven step after step, stage against stock, byte "
        "for byte after every step, 1,000 decode steps a run: each of the three "
        "backend paths in eager, FULL-graph and piecewise mode, with the select off "
        f"and on, {len(runs)} runs ({older}, the others on {newest}), "
        f"{sum(r['mismatches'] for r in runs)} mismatches "
        f"({link('docs/indexer-steps-h200.json')});"
    )


# --- docs/performance.md: tables (blocks) and ranges (claims) ---------------


def pools(width: int) -> str:
    """Pools as the docs write them: 4K, 64K, 256K."""
    return f"{width // 1024}K"


def floor2(value: float) -> str:
    """``value`` rounded down to two decimals: a bound "x or more" keeps."""
    return f"{math.floor(value * 100) / 100:.2f}"


def kernel_label(row: dict) -> str:
    if row["case"] == "update":
        return f"update scales={row['scales']} tokens={row['tokens']}"
    if row["case"] == "remap":
        return f"remap counts={row['counts']}"
    if row["case"] == "tail":
        return f"tail path={row['path']}"
    return f"{row['case']} "


@block("kernels", "docs/bench-h200.json", PERFORMANCE)
def kernels_block(data: dict) -> str:
    """Each kernel's ratio by decode rows, graph-replayed and eager."""
    groups: dict[str, dict[int, dict]] = {}
    for r in data["kernels"]:
        if r["case"] != "upcast":
            groups.setdefault(kernel_label(r), {})[r["rows"]] = r
    rows = sorted({n for g in groups.values() for n in g})
    tables = []
    for timer in ("graph", "eager"):
        lines = [
            f"| {timer}: stock / ours | {' | '.join(map(str, rows))} |",
            "| --- |" + " --: |" * len(rows),
        ]
        for label, g in groups.items():
            cells = " | ".join(f"{ratio(g[n][f'{timer}_us']):.2f}" for n in rows)
            lines.append(f"| {label} | {cells} |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


@block("upcast", "docs/bench-h200.json", PERFORMANCE)
def upcast_block(data: dict) -> str:
    """The upcast's ratio by rows, row ends and pools, with ours' share of
    the copy's bandwidth."""
    groups: dict[tuple, dict[int, dict]] = {}
    for r in data["kernels"]:
        if r["case"] == "upcast":
            groups.setdefault((r["ends"], r["width"]), {})[r["rows"]] = r
    rows = sorted({n for g in groups.values() for n in g})
    head = " | ".join([f"rows {rows[0]}", *map(str, rows[1:])])
    lines = [
        f"| upcast, graph: stock / ours (ours' share of the copy) | {head} |",
        "| --- |" + " --: |" * len(rows),
    ]
    for (ends, width), g in groups.items():
        cells = " | ".join(
            f"{ratio(g[n]['graph_us']):.2f} ({100 * g[n]['roof'][1]:.0f} %)"
            for n in rows
        )
        lines.append(f"| ends {ends}, {width} pools | {cells} |")
    return "\n".join(lines)


@claims(PERFORMANCE, "docs/bench-h200.json")
def kernel_claims(data: dict) -> list[str]:
    kernels = data["kernels"]

    def case(name, **fields):
        return [
            r
            for r in kernels
            if r["case"] == name and all(r[k] == v for k, v in fields.items())
        ]

    spread = max(max(r["graph_spread"]) for r in kernels)
    noisy = sum(max(r["eager_spread"]) > 0.10 for r in kernels)
    copy = data["meta"]["copy"]
    sm100 = case("tail", path="sm100-flashinfer")
    wide = [
        r
        for r in case("upcast", ends="full")
        if (r["rows"], r["width"]) in ((256, 65536), (64, 262144))
    ]
    return [
        (
            f"[bench-h200.json](bench-h200.json) ({len(kernels)} kernel rows, "
            f"{len(data['select'])} select rows)"
        ),
        f"(under {5 * math.ceil(20 * spread)} % in every graph row of this run)",
        (
            f"{noisy} of the {len(kernels)} kernel rows have a spread above 10 % on "
            "one side"
        ),
        (
            f"{copy['kernel']:,.0f} GB/s counting read and write (`copy_`'s memcpy: "
            f"{copy['memcpy']:,.0f} GB/s)"
        ),
        f"**The update** ({span(ratio(r['graph_us']) for r in case('update'))}x)",
        (
            f"**The SM100 tail** falls from {ratio(sm100[0]['graph_us']):.1f}x at one "
            f"row to {ratio(sm100[-1]['graph_us']):.1f}x at {sm100[-1]['rows']}"
        ),
        (
            "**The upcast** at 256 x 64K and 64 x 256K full rows "
            f"({span(ratio(r['graph_us']) for r in wide)}x) is at "
            f"{span((100 * r['roof'][1] for r in wide), '.0f')} % of the copy"
        ),
    ]


FP32, BF16 = "sm90-flashinfer", "sm100-flashinfer"
RELU = ("relu 0%", "relu 0.1%", "relu 1%", "relu 50%")


def select_row(
    data: dict, path: str, rows: int, width: int, context="full", logits="randn"
) -> dict:
    """The select's row of ``path``, ``rows`` x ``width`` pools."""
    (row,) = [
        r
        for r in data["select"]
        if (r["path"], r["rows"], r["width"], r["context"], r["logits"])
        == (path, rows, width, context, logits)
    ]
    return row


# The select table's rows: logits and size as labelled, and the JSON row
# (path, rows, width[, row ends[, logits]]) each is.
SELECT_TABLE = [
    ("FP32 (SM90) randn", "1 x 16K, full", (FP32, 1, 16384)),
    ("FP32 randn", "1 x 16K, short (to 4K)", (FP32, 1, 16384, "short")),
    ("FP32 randn", "64 x 16K, full", (FP32, 64, 16384)),
    ("FP32 randn", "1 x 64K, full", (FP32, 1, 65536)),
    ("FP32 randn", "8 x 64K, full", (FP32, 8, 65536)),
    ("FP32 randn", "64 x 64K, full", (FP32, 64, 65536)),
    ("FP32 randn", "1 x 64K, random", (FP32, 1, 65536, "random")),
    ("FP32 randn", "1 x 64K, short", (FP32, 1, 65536, "short")),
    ("FP32 randn", "8 x 64K, short", (FP32, 8, 65536, "short")),
    ("FP32 randn", "1 x 256K, full", (FP32, 1, 262144)),
    ("FP32 randn", "8 x 256K, full", (FP32, 8, 262144)),
    ("FP32 randn", "1 x 256K, short", (FP32, 1, 262144, "short")),
    ("FP32 ReLU, 0 % positive", "1 x 64K", (FP32, 1, 65536, "full", "relu 0%")),
    ("FP32 ReLU, 0.1 % positive", "1 x 64K", (FP32, 1, 65536, "full", "relu 0.1%")),
    ("FP32 ReLU, 1 % positive", "1 x 64K", (FP32, 1, 65536, "full", "relu 1%")),
    ("FP32 ReLU, 0 % positive", "64 x 64K", (FP32, 64, 65536, "full", "relu 0%")),
    ("FP32 ReLU, 0 % positive", "1 x 256K", (FP32, 1, 262144, "full", "relu 0%")),
    ("FP32 ReLU, 50 % positive", "64 x 64K", (FP32, 64, 65536, "full", "relu 50%")),
    ("BF16 (SM100) randn", "1 x 16K, full", (BF16, 1, 16384)),
    ("BF16 randn", "1 x 16K, short", (BF16, 1, 16384, "short")),
    ("BF16 randn", "1 x 64K, full", (BF16, 1, 65536)),
    ("BF16 randn", "64 x 64K, full", (BF16, 64, 65536)),
    ("BF16 randn", "1 x 64K, short", (BF16, 1, 65536, "short")),
    ("BF16 ReLU, 0 % positive", "1 x 64K", (BF16, 1, 65536, "full", "relu 0%")),
    ("BF16 ReLU, 0 % positive", "256 x 64K", (BF16, 256, 65536, "full", "relu 0%")),
]


def select_label_is_its_row(logits: str, size: str, key: tuple) -> None:
    """A table label that another row's figures would fit raises."""
    path, rows, width, ends, name = (*key, *("full", "randn")[len(key) - 3 :])
    shown = name.replace("relu ", "ReLU, ").replace("%", " % positive")
    labelled = size.split(", ")[1].split(" ")[0] if "," in size else "full"
    assert (
        logits.startswith({FP32: "FP32", BF16: "BF16"}[path])
        and logits.endswith(shown)
        and size.split(",")[0] == f"{rows} x {pools(width)}"
        and labelled == ends
    ), f"the row labelled {logits!r}, {size!r} is {key}"


@block("select_table", "docs/bench-select-h200.json", PERFORMANCE)
def select_table_block(data: dict) -> str:
    """A selection of the select's rows: µs of the select alone (stock, the
    previous commit's build, this one), then ratios."""
    lines = [
        (
            "| logits | rows x pools, row ends | stock | 31e6ca5 | now | select x "
            "| chain x | eager chain x |"
        ),
        "| --- | --- |" + " --: |" * 6,
    ]
    for logits, size, key in SELECT_TABLE:
        select_label_is_its_row(logits, size, key)
        r = select_row(data, *key)
        stock, now = r["select_graph_us"]
        times = (stock, r["select_graph_us_before"][1], now)
        cells = [f"{us:.2f}" for us in times] + [
            f"{ratio(r[k]):.2f}"
            for k in ("select_graph_us", "chain_graph_us", "chain_eager_us")
        ]
        lines.append(f"| {logits} | {size} | {' | '.join(cells)} |")
    return "\n".join(lines)


# The one-wave table's rows: path, logits and row ends as labelled, and the
# JSON rows each covers (next_n 1 and 4 together).
ONE_WAVE_TABLE = [
    ("SM90, FP32", "randn, full", FP32, ("randn",), "full"),
    ("SM90, FP32", "randn, random", FP32, ("randn",), "random"),
    ("SM90, FP32", "randn, short", FP32, ("randn",), "short"),
    ("SM90, FP32", "ReLU (0-50 % positive), full", FP32, RELU, "full"),
    ("SM100, BF16", "randn, full", BF16, ("randn",), "full"),
    ("SM100, BF16", "randn, random", BF16, ("randn",), "random"),
    ("SM100, BF16", "randn, short", BF16, ("randn",), "short"),
    ("SM100, BF16", "ReLU, full", BF16, RELU, "full"),
]


def staged(data: dict, path: str | None = None) -> list[dict]:
    """The select's rows where the stage runs it (``one_wave``)."""
    return [
        r
        for r in data["select"]
        if one_wave(r["rows"], r["width"], r["path"])
        and (path is None or r["path"] == path)
    ]


def ends_of(row: dict) -> str:
    return row["context"].split(",")[0]


@block("one_wave_table", "docs/bench-select-h200.json", PERFORMANCE)
def one_wave_table_block(data: dict) -> str:
    """The select's ranges over the sizes where the stage runs it."""
    lines = [
        "| path | logits, row ends | select alone | chain | eager chain |",
        "| --- | --- | --: | --: | --: |",
    ]
    for path, label, name, logits, ends in ONE_WAVE_TABLE:
        rows = [
            r
            for r in staged(data, name)
            if r["logits"] in logits and ends_of(r) == ends
        ]
        cells = " | ".join(
            span(ratio(r[k]) for r in rows)
            for k in ("select_graph_us", "chain_graph_us", "chain_eager_us")
        )
        lines.append(f"| {path} | {label} | {cells} |")
    return "\n".join(lines)


@claims(PERFORMANCE, "docs/bench-select-h200.json")
def select_claims(data: dict) -> list[str]:
    fp32, bf16 = staged(data, FP32), staged(data, BF16)
    randn = [r for r in fp32 if r["logits"] == "randn"]
    short = [r for r in randn if ends_of(r) == "short"]
    small = [r for r in randn if r["width"] == 16384 and ends_of(r) != "short"]
    from_4 = [r for r in small if r["rows"] >= 4]
    (one_random,) = [r for r in small if (r["rows"], r["context"]) == (1, "random")]
    sizes = [
        r
        for r in fp32
        if (r["rows"], r["width"]) in ((64, 65536), (8, 262144))
        and ends_of(r) != "short"
        and r["logits"] not in ("relu 0%", "relu 0.1%")
    ]
    slower = [r for r in sizes if ratio(r["select_graph_us"]) < 1]

    def faster(rows):
        return {ratio(r["select_graph_us"]) > 1 for r in rows}

    def sel(rows):
        return span(ratio(r["select_graph_us"]) for r in rows)

    assert faster(bf16) == {True}, "BF16: the select slower than stock somewhere"
    assert faster(from_4) == {False}, "16K pools from 4 rows: not all slower"
    assert faster(r for r in sizes if r in randn) == {False}, "64 x 64K, 8 x 256K"
    relu = {r["logits"] for r in slower} - {"randn"}
    assert relu == {"relu 1%", "relu 50%"}, f"slower on ReLU logits: {relu}"
    small64 = select_row(data, FP32, 64, 16384)
    one, eight = select_row(data, FP32, 1, 65536), select_row(data, FP32, 8, 65536)
    before = [ratio(r["select_graph_us_before"]) for r in short]
    return [
        f"All {len(data['select'])} rows of one run ({data['meta']['date'][:16]})",
        f"On FP32 it is at short row ends ({sel(short)}x:",
        (
            f"at 16K pools from 4 rows ({sel(from_4)}x; "
            f"{ratio(one_random['select_graph_us']):.2f}x at 1 row of random ends)"
        ),
        (
            f"by a few percent at 64 x 64K and 8 x 256K ({sel(slower)}x, also on "
            "ReLU logits with 1-50 % positive)"
        ),
        (
            "The chain stays "
            f"{floor2(min(ratio(r['chain_graph_us']) for r in fp32 + bf16))}x or "
            "more everywhere the stage runs it"
        ),
        (
            f"FP32 short ends {span(before)}x stock before, {sel(short)}x now; 64 x "
            f"16K {small64['select_graph_us_before'][1]:.2f} to "
            f"{small64['select_graph_us'][1]:.2f} µs"
        ),
        (
            f"timed 31e6ca5's select at {one['select_graph_us_before'][1]:.2f} µs at "
            f"1 x 64K and {eight['select_graph_us_before'][1]:.2f} at 8 x 64K, and "
            f"this commit's at {one['select_graph_us'][1]:.2f} and "
            f"{eight['select_graph_us'][1]:.2f}"
        ),
    ]


def step_row(data: dict, rows: int, next_n: int, pools: int) -> dict:
    """The step case of ``rows`` requests of ``next_n`` tokens and ``pools``."""
    (row,) = [
        r
        for r in data["scores"]
        if (r["rows"], r["next_n"], r["context"]) == (rows, next_n, pools)
    ]
    return row


# The step table's sizes: requests, next_n, pools.
STEP_TABLE = [
    (1, 1, 4096),
    (8, 1, 4096),
    (64, 1, 4096),
    (1, 1, 65536),
    (8, 1, 65536),
    (64, 1, 65536),
    (1, 1, 262144),
    (64, 1, 262144),
    (1, 2, 65536),
    (64, 2, 262144),
]


@block("step_table", "docs/bench-scores-h200.json", PERFORMANCE)
def step_table_block(data: dict) -> str:
    """The indexer decode after the query, DeepGEMM's scores on both sides:
    stock, the stage, the stage with the select."""
    lines = [
        (
            "| rows x next_n | pools | DeepGEMM alone | stock | stage | stage, select "
            "| stock/stage | stock/select | eager stock/stage |"
        ),
        "| --- | --: | --: | --: | --: | --: | --: | --: | --: |",
    ]
    for rows, next_n, width in STEP_TABLE:
        r = step_row(data, rows, next_n, width)
        step, select = r["step_graph_us"], r["step_select_graph_us"]
        cells = [f"{us:.1f}" for us in (r["scores_graph_us"][0], *step, select[1])]
        cells += [f"{ratio(p):.2f}" for p in (step, select, r["step_eager_us"])]
        lines.append(f"| {rows} x {next_n} | {pools(width)} | {' | '.join(cells)} |")
    return "\n".join(lines)


@block("chain_table", "docs/bench-scores-h200.json", PERFORMANCE)
def chain_table_block(data: dict) -> str:
    """Every step size: stock, the stage with the select, with our scores too,
    and each scores kernel alone."""
    lines = [
        (
            "| requests x pools, next_n | stock µs | select µs | ours µs | stock/ours "
            "| eager stock/ours | DeepGEMM alone | ours alone |"
        ),
        "| --- |" + " --: |" * 7,
    ]
    order = sorted(data["scores"], key=lambda r: (r["next_n"], r["context"], r["rows"]))
    for r in order:
        ours = r["step_scores_graph_us"]
        cells = [f"{us:.1f}" for us in (ours[0], r["step_select_graph_us"][1], ours[1])]
        cells += [f"{ratio(ours):.2f}", f"{ratio(r['step_scores_eager_us']):.2f}"]
        cells += [f"{us:.1f}" for us in r["scores_graph_us"]]
        size = f"{r['rows']} x {pools(r['context'])}, {r['next_n']}"
        lines.append(f"| {size} | {' | '.join(cells)} |")
    return "\n".join(lines)


@claims(PERFORMANCE, "docs/bench-scores-h200.json")
def scores_claims(data: dict) -> list[str]:
    rows = data["scores"]
    pair = "step_scores_graph_us"

    def chain(selected):
        return span(ratio(r[pair]) for r in selected)

    one = step_row(data, 1, 1, 65536)
    big = [r for r in rows if r["rows"] >= 32 and r["context"] >= 131072]
    slower = [r for r in big if ratio(r[pair]) < 1]
    where = {(r["next_n"], r["rows"]) for r in slower}
    assert where == {(2, 32), (2, 64), (1, 64)}, (
        f"slower than stock at (next_n, requests) {sorted(where)}, not next_n 2 "
        "from 32 requests and next_n 1 at 64"
    )
    behind = [
        100 * (r["scores_graph_us"][1] / r["scores_graph_us"][0] - 1) for r in slower
    ]
    assert min(behind) > 0, "our scores alone not behind DeepGEMM's everywhere"
    assert not any(one_wave(r["rows"] * r["next_n"], r["context"]) for r in slower), (
        "slower than stock within one wave, not past it"
    )
    past = [r for r in big if not one_wave(r["rows"] * r["next_n"], r["context"])]
    within = " and ".join(
        f"{r['rows']} x {pools(r['context'])} at next_n {r['next_n']}"
        for r in big
        if r not in past
    )

    def sizes(requests, widths):
        return chain(r for r in rows if requests(r["rows"]) and widths(r["context"]))

    return [
        (
            f"the chain is {sizes(lambda n: n <= 4, lambda w: w <= 131072)}x "
            f"({sizes(lambda n: n <= 4, lambda w: w == 4096)}x at 1-4 x 4K, "
            f"{sizes(lambda n: n == 1, lambda w: w == 65536)}x at 1 x 64K); "
            f"{sizes(lambda n: n == 8, lambda w: w <= 16384)}x at 8 requests up "
            "to 16K"
        ),
        (
            f"At 1 x 64K it costs our scores ({one['scores_graph_us'][1]:.1f} µs) + "
            f"{one[pair][1] - one['scores_graph_us'][1]:.1f} µs"
        ),
        (
            "Slower than stock at 32-64 requests of 128K-256K pools "
            f"({chain(slower)}x; next_n 2 from 32 requests, next_n 1 at 64)"
        ),
        (
            "the step with DeepGEMM's scores and the select is "
            f"{span(ratio(r['step_select_graph_us']) for r in slower)}x there"
        ),
        f"our scores alone {span(behind, '.1f')} % behind DeepGEMM's",
        # The select past one wave, in the step.
        (
            "the step with the select is "
            f"{span(ratio(r['step_select_graph_us']) for r in big)}x stock's at 32-64 "
            "requests of 128K-256K pools "
            f"({span(ratio(r['step_select_graph_us']) for r in past)}x past one "
            f"wave, every size there but {within}"
        ),
    ]


@claims(PERFORMANCE, "docs/bench-step-fed-h200.json")
def fed_claims(data: dict) -> list[str]:
    """The select fed by our scores, measured against our scores with the
    cluster select (``step_fed`` against ``step_scores``)."""
    rows = data["scores"]
    slower = [
        r for r in rows if r["step_fed_graph_us"][1] >= r["step_scores_graph_us"][1]
    ]
    r = step_row(data, 1, 1, 65536)
    fed, ours = r["step_fed_graph_us"][1], r["step_scores_graph_us"][1]
    sizes = f"{len(slower)} of the {len(rows)} sizes measured"
    return [
        f"slower than our scores with the cluster select at {sizes}",
        f"1 x 64K {fed:.1f} µs against {ours:.1f}",
    ]


def cluster_rows(data: dict) -> dict[tuple, dict[int, tuple[float, float]]]:
    """(logits, rows) -> pools -> (stock µs, the picked cluster's µs)."""
    out: dict[tuple, dict[int, tuple[float, float]]] = {}
    for r in data["picked_and_stock"]:
        (us,) = r["us"].values()
        name = {"float32": "FP32", "bfloat16": "BF16"}[r["dtype"]]
        out.setdefault((name, r["rows"]), {})[r["width"]] = (r["stock_us"], us)
    return out


@block("clusters_table", "docs/select-clusters-h200.json", PERFORMANCE)
def clusters_table_block(data: dict) -> str:
    """Stock's top-k and the select past one wave, by rows and pools."""
    groups = cluster_rows(data)
    widths = sorted({w for g in groups.values() for w in g})
    head = " | ".join(
        [f"{pools(widths[0])} pools: stock / select µs", *map(pools, widths[1:])]
    )
    lines = [f"| logits | rows | {head} |", "| --- | --: |" + " --: |" * len(widths)]
    for (name, rows), g in groups.items():
        cells = " | ".join(f"{g[w][0]:.1f} / {g[w][1]:.1f}" for w in widths)
        lines.append(f"| {name} | {rows} | {cells} |")
    return "\n".join(lines)


@claims(PERFORMANCE, "docs/select-clusters-h200.json")
def clusters_claims(data: dict) -> list[str]:
    groups = cluster_rows(data)

    def ratios(name, rows=lambda n: True, widths=lambda w: True):
        return [
            s / o
            for (logits, n), g in groups.items()
            for w, (s, o) in g.items()
            if logits == name and rows(n) and widths(w)
        ]

    # Where the picked cluster was not the fastest: (rows, width) -> (the
    # fastest cluster, how much faster it was on each dtype).
    faster: dict[tuple, tuple[set, list]] = {}
    for r in data["every_cluster"]:
        best = min(r["us"], key=r["us"].get)
        if int(best) != r["picked"]:
            clusters, gains = faster.setdefault((r["rows"], r["width"]), (set(), []))
            clusters.add(best)
            gains.append(r["us"][str(r["picked"])] - r["us"][best])
    exceptions = " and ".join(
        f"{rows} x {pools(width)} ({'/'.join(sorted(c, key=int))} CTAs a row "
        f"{span(gains, '.1f')} µs faster)"
        for (rows, width), (c, gains) in sorted(faster.items(), reverse=True)
    )
    bf16_wide = ratios("BF16", lambda n: n >= 128, lambda w: w == 262144)
    assert max(bf16_wide) < 1, "BF16 not behind at 128-256 rows of 256K"
    assert min(ratios("BF16", lambda n: n <= 64)) > 1, "BF16 behind up to 64 rows"
    return [
        f"(the JSON's `every_cluster`), except {exceptions}.",
        (
            f"On FP32 logits (SM90) the select is "
            f"{span(ratios('FP32', lambda n: n >= 64))}x stock's top-k from 64 rows "
            f"({span(ratios('FP32', lambda n: n >= 64, lambda w: w <= 65536))}x at "
            "16K-64K pools, "
            f"{span(ratios('FP32', lambda n: n >= 64, lambda w: w == 262144))}x at "
            "256K)"
        ),
        f"up to 64 rows and at 64K, {span(bf16_wide)}x at 128-256 rows of 256K",
    ]


def read_us(row: dict) -> float:
    """One read of the row's bytes: half a copy of as many."""
    return row["copy_cold"] / 2


@block("cold_table", "docs/scores-cold-h200.json", PERFORMANCE)
def cold_table_block(data: dict) -> str:
    """Our scores and DeepGEMM's read cold, against one read of the bytes."""
    before = {(r["entries"], r["pools"], r["next_n"]): r for r in data["before"]}
    lines = [
        (
            "| requests x pools, next_n | MB read | ours µs | before (32 heads) "
            "| DeepGEMM µs | DeepGEMM/ours | read µs | ours vs read |"
        ),
        "| --- |" + " --: |" * 7,
    ]
    for r in data["rows"]:
        b = before[(r["entries"], r["pools"], r["next_n"])]
        ours, dg, read = r["ours_cold"], r["dg_cold"], read_us(r)
        cells = [
            f"{r['mb']:.1f}",
            f"{ours:.2f}",
            f"{b['ours_cold']:.2f}",
            f"{dg:.2f}",
            f"{dg / ours:.2f}",
            f"{read:.2f}",
            f"{100 * (ours / read - 1):+.0f} %",
        ]
        size = f"{r['entries']} x {pools(r['pools'])}, {r['next_n']}"
        lines.append(f"| {size} | {' | '.join(cells)} |")
    return "\n".join(lines)


@claims(PERFORMANCE, "docs/scores-cold-h200.json")
def cold_claims(data: dict) -> list[str]:
    rows = data["rows"]
    gate = {id(r): r["dg_cold"] / r["ours_cold"] for r in rows}

    def closest(next_n):
        low = min(gate[id(r)] for r in rows if r["next_n"] == next_n)
        near = [
            r
            for r in rows
            if r["next_n"] == next_n and f"{gate[id(r)]:.2f}" == f"{low:.2f}"
        ]
        sizes = " and ".join(f"{r['entries']} x {pools(r['pools'])}" for r in near)
        return sizes, f"{low:.2f}x"

    (n1, x1), (n2, x2) = closest(1), closest(2)
    (last,) = [
        r for r in rows if (r["entries"], r["pools"], r["next_n"]) == (64, 65536, 2)
    ]
    before = {(r["entries"], r["pools"], r["next_n"]): r for r in data["before"]}
    failed = [
        b["dg_cold"] / b["ours_cold"]
        for (entries, width, next_n), b in before.items()
        if next_n == 2 and width == 65536 and entries >= 4
    ]
    passed = [
        b["dg_cold"] / b["ours_cold"]
        for (entries, width, next_n), b in before.items()
        if next_n == 2 and not (width == 65536 and entries >= 4)
    ]
    assert max(failed) < 1 <= min(passed), "the 32-head run's failures moved"
    return [
        (
            f"({span(gate.values())}x DeepGEMM; the closest {n1} at next_n 1, {x1}, "
            f"and {n2} at next_n 2, {x2}; DeepGEMM's {last['dg_cold']:.1f} µs at 64 x "
            f"64K next_n 2 is {last['dg_cold'] - last['dg_warm']:.0f} µs above its "
            f"warm figure in the same run, so its {gate[id(last)]:.2f}x there is one "
            "reading)"
        ),
        (
            "The 32-head run failed the speed gate at next_n 2 at 64K pools from 4 "
            f"requests up ({span(failed)}x DeepGEMM in that run"
        ),
        read_claim(rows),
    ]


def read_claim(rows: list[dict]) -> str:
    """Where one read bounds the time (66 MB or more), the sizes within
    10 % of it and the others, by next_n."""
    bound = [r for r in rows if r["mb"] >= 64]
    parts: dict[bool, list[str]] = {True: [], False: []}
    for next_n in (1, 2):
        for within in (True, False):
            over = sorted(
                (
                    (100 * (r["ours_cold"] / read_us(r) - 1), r)
                    for r in bound
                    if r["next_n"] == next_n
                    and (100 * (r["ours_cold"] / read_us(r) - 1) < 10) == within
                ),
                key=lambda pair: pair[0],
            )
            named = [
                f"{r['entries']} x {pools(r['pools'])} ({pct:+.0f} %)"
                for pct, r in over
            ]
            if named:
                listed = ", ".join(named[:-1]) + " and " * (len(named) > 1) + named[-1]
                parts[within].append(f"{listed} at next_n {next_n}")
    return (
        "Within 10 % of one read where it bounds the time "
        f"({min(r['mb'] for r in bound):.0f} MB or more): "
        f"{'; '.join(parts[True])}; not {', nor '.join(parts[False])}."
    )


@claims(VALIDATION, "docs/scores-cold-h200.json")
def cold_validation_claims(data: dict) -> list[str]:
    rows = data["rows"]
    same = sum(r["same"] for r in rows)
    at = f"all {len(rows)}" if same == len(rows) else f"{same} of {len(rows)}"
    return [f"`same` true at {at} sizes"]


# --- docs/validation.md -------------------------------------------------------

# The step runs' backend paths and modes, as validation.md names them; a
# path's note goes on its first row.
STEP_PATHS = {
    "sm100": ("SM100 FlashInfer", ""),
    "flashmla_fp8": ("FlashMLA FP8", " (no counts)"),
    "flashinfer_sm90": ("FlashInfer SM90", ""),
}
STEP_MODES = {"eager": "eager", "full": "FULL graphs", "piecewise": "piecewise"}
NUMBERS = "Zero One Two Three Four Five Six Seven Eight Nine Ten Eleven Twelve"


def step_runs(data: dict) -> dict[tuple[str, str, bool], dict]:
    """The 1,000-step runs by (path, mode, select)."""
    out = {}
    for r in data["runs"]:
        path, mode, tail, *rest = r["name"].split("/")
        if tail == "tail-indexer" and rest in ([], ["select"]):
            out[path, mode, rest == ["select"]] = r
    return out


@block("steps_table", "docs/indexer-steps-h200.json", VALIDATION)
def steps_table_block(data: dict) -> str:
    """The commit each step run of a path, mode and select setting ran."""
    runs = step_runs(data)
    lines = [
        "| backend path | mode | select off | select on |",
        "| --- | --- | --- | --- |",
    ]
    for path, (name, note) in STEP_PATHS.items():
        for n, (mode, label) in enumerate(STEP_MODES.items()):
            commits = [runs[path, mode, select]["commit"] for select in (False, True)]
            title = name + (note if n == 0 else "")
            lines.append(f"| {title} | {label} | {' | '.join(commits)} |")
    return "\n".join(lines)


@claims(VALIDATION, "docs/indexer-steps-h200.json")
def steps_claims(data: dict) -> list[str]:
    runs = step_runs(data)
    others = [r for r in data["runs"] if r not in runs.values()]
    steps = {r["steps"]["decode_steps"] for r in runs.values()}
    assert steps == {1000}, f"the path and mode runs took {steps} decode steps"
    assert sum(r["mismatches"] for r in data["runs"]) == 0, "a run mismatched"
    (short,) = {r["steps"]["decode_steps"] for r in others}
    commits: dict[str, int] = {}
    for r in data["runs"]:
        commits[r["commit"]] = commits.get(r["commit"], 0) + 1
    (newest,) = {data["runs"][-1]["commit"]}
    (older, count), *rest = [(c, n) for c, n in commits.items() if c != newest]
    assert not rest, rest
    return [
        (
            f"stages in one process, {short} steps. {NUMBERS.split()[count]} runs are "
            f"of commit {older}"
        ),
        f"the others of {newest}",
    ]


def wrap(text: str) -> str:
    """Paragraphs at the README's width; tables as they are."""
    return "\n\n".join(
        part
        if part.startswith("|")
        else textwrap.fill(
            part,
            76,
            subsequent_indent="  " if part.startswith("- ") else "",
            break_long_words=False,
            break_on_hyphens=False,
        )
        for part in text.split("\n\n")
    )


def render(name: str, source: str, root: Path = REPO) -> str:
    """The text of block ``name`` from ``source``; ValueError where the block
    is unknown or names another source."""
    if name not in BLOCKS:
        raise ValueError(f"figure block {name!r}: expected one of {sorted(BLOCKS)}")
    want, fn = BLOCKS[name]
    if source != want:
        raise ValueError(f"figure block {name!r}: names {source}, expected {want}")
    return wrap(fn(json.loads((root / source).read_text())))


def page_name(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.name


def problems(path: Path | None = None, root: Path = REPO) -> list[str]:
    """Each block of ``path`` (default: every page) that differs from its
    JSON, with the text it should have; each registered block missing from
    its page or found in another; each claim of the page not in it, with
    the phrase it should be."""
    if path is None:
        return [p for page in pages(root) for p in problems(page, root)]
    page, text, out = page_name(path, root), path.read_text(), []
    found = BLOCK.findall(text)
    for name, source, body in found:
        try:
            want = render(name, source, root)
        except ValueError as e:
            out.append(str(e))
            continue
        except AssertionError as e:
            out.append(f"{page}: figure block {name!r}: {source} contradicts it: {e}")
            continue
        if PAGE_OF[name] != page:
            out.append(f"{page}: figure block {name!r} belongs in {PAGE_OF[name]}")
        elif body.strip() != want:
            out.append(f"{page}: figure block {name!r} differs; from {source}:\n{want}")
    if text.count("<!-- figures:") != len(found):
        out.append(f"{page}: a <!-- figures: --> marker without its block")
    mine = {name for name, where in PAGE_OF.items() if where == page}
    missing = sorted(mine - {name for name, _, _ in found})
    out += [f"{page}: no figure block {name!r}" for name in missing]
    flat_text = flat(text)
    for where, sources, fn in CLAIMS:
        if where != page:
            continue
        data = [json.loads((root / source).read_text()) for source in sources]
        try:
            phrases = fn(*data)
        except AssertionError as e:
            out.append(f"{page}: {', '.join(sources)} contradicts a label: {e}")
            continue
        for phrase in phrases:
            if flat(phrase) not in flat_text:
                out.append(
                    f"{page}: not found; from {', '.join(sources)}: {flat(phrase)!r}"
                )
    return out


def write(path: Path | None = None, root: Path = REPO) -> None:
    """Rewrites the blocks of ``path`` (default: every page) from their JSON."""
    if path is None:
        for page in pages(root):
            write(page, root)
        return

    def new(m):
        text = render(m[1], m[2], root)
        return f"<!-- figures: {m[1]} from {m[2]} -->\n{text}\n<!-- /figures -->"

    text = path.read_text()
    if BLOCK.search(text):
        path.write_text(BLOCK.sub(new, text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the blocks")
    parser.add_argument(
        "--page", type=Path, help="one page (default: README.md and docs/*.md)"
    )
    args = parser.parse_args(argv)
    from tools import overlay

    overlay.import_patched("readme_figures.py")
    if args.write:
        write(args.page)
    found = problems(args.page)
    for problem in found:
        print(problem)
    return int(bool(found))


if __name__ == "__main__":
    sys.exit(main())
