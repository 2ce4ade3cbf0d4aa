#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The figures of README.md and docs/*.md, recomputed from the committed JSON
they cite: the benchmark's from one, ``BENCH`` (a run of tools/bench.py).

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
blocks and their markers; ``--claims`` prints the claims not found alone,
each with the page's passage most like it: claims are prose, edited by hand
(after a rerun: docs/gpu-tier.md). A new block is a function registered
with ``@block(NAME, "docs/X.json", page)`` and its markers in the page; a
new claim a function registered with ``@claims(page, "docs/X.json")``.

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
from collections import Counter
from collections.abc import Callable
from difflib import SequenceMatcher
from functools import partial
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
# GLM-5-Next's layers (transformers' Glm5NextTextConfig; the test checks it):
# 45, of which every fourth from layer 3 (3, 7, ..., 43) is a DSA
# (indexed-attention) layer, which runs the indexer and so the stage; the
# other 34 are KDA linear attention.
LAYERS = 45
DSA_LAYERS = 11
FIRST_DSA_LAYER = 3
# The SMs of the card a JSON's meta names, for the select's one-wave rule.
SMS = {"NVIDIA H200": 132, "NVIDIA H100 80GB HBM3": 132}
# The select's paths: FlashInfer SM90's FP32 logits, SM100's BF16.
FP32, BF16 = "sm90-flashinfer", "sm100-flashinfer"
# vLLM 0.33.0's torch and triton (its wheel's requirements and torch's; the
# test checks them): `pip install vllm==0.33.0` brings these, the GPU runs
# used the versions their JSON's meta gives.
PINS = {"torch": "2.14.0", "triton": "3.8.0"}
# tools/bench.py's JSON (meta; kernels, select, scores): every bench figure's.
BENCH = "docs/bench-h200.json"
# Until BENCH's run has them: parts from later partial runs (a test checks).
SPLIT = {part: f"docs/bench-{part}-h200.json" for part in ("select", "scores")}
# The decode tail's contexts in tools/bench.py (topk_inputs: positions in
# [2**18 / 16, 2**18) tokens).
TAIL_CONTEXTS = "16K-256K tokens"

# The time of a decode step, of which the README gives the stage's saving as
# a share: an estimate. No engine ran GLM-5-Next on a GPU here, and no public
# GLM-5-Next (GLM-5.3-Flash) figure on H200 or H100 was found; this is
# GLM-5.2-FP8's mean TPOT (744B parameters, 40B active, DSA attention) on one
# 8 x H200 node, vLLM, TP 8, its serve recipe with no speculative decoding, by
# concurrent requests, from a sweep of 20 requests a level (the PR's table;
# its performance-summary.json, self-hosted/vllm/benchmark-output/
# glm52-200k-throughput/, gives 10.29, 12.96 and 13.28 ms). With one token a
# request a step, TPOT is the step's time.
STEP_SOURCE = "https://github.com/aarora79/agentic-coding-harness-benchmarks/pull/51"
STEP_MS = {1: 10.3, 8: 13.0, 16: 13.3}
# The batches and the contexts (pools, tokens / 4) the README's table gives.
GAIN_REQUESTS = (1, 8, 64)

BLOCKS: dict[str, tuple[str, Callable[[dict], str]]] = {}
# The page each block is in (README.md or docs/NAME.md).
PAGE_OF: dict[str, str] = {}
# (page, sources, fn(*data) -> the phrases the page must hold).
CLAIMS: list[tuple[str, tuple[str, ...], Callable[..., list[str]]]] = []


def bench(part: str) -> str:
    """The JSON of ``part`` of the bench (kernels, select, scores)."""
    return SPLIT.get(part, BENCH)


def k_of(data: dict) -> int:
    """The top-k's k in pools: the JSON's meta's, else tools/bench.py's."""
    from tools.bench import K_POOLS

    return data["meta"].get("k", K_POOLS)


def block(name: str, source: str, page: str = "README.md"):
    """Registers ``fn(data) -> text``: block ``name`` of ``source`` in ``page``."""

    def register(fn):
        BLOCKS[name] = (source, fn)
        PAGE_OF[name] = page
        return fn

    return register


def claims(page: str, *sources: str):
    """Registers ``fn(*data) -> [phrase]``: ``page``'s phrases from ``sources``."""

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


def ratio_span(rows, key: str = "select_graph_us") -> str:
    return span(ratio(r[key]) for r in rows)


def saved(row: dict, key: str = "step_graph_us") -> float:
    """µs a layer the stage saves: stock's time less the stage's."""
    stock, stage = row[key]
    return stock - stage


def where(rows: list[dict], /, **fields) -> list[dict]:
    """The ``rows`` with these ``fields``."""
    return [r for r in rows if all(r[k] == v for k, v in fields.items())]


def only(rows: list[dict], /, **fields) -> dict:
    """The one row of ``rows`` with these ``fields``."""
    (row,) = where(rows, **fields)
    return row


def table(head: str, rows, left: int = 1) -> str:
    """A table of ``head``'s columns, the first ``left`` aligned left."""
    align = "|" + " --- |" * left + " --: |" * (head.count(" | ") + 1 - left)
    return "\n".join([f"| {head} |", align, *(f"| {' | '.join(r)} |" for r in rows)])


def card(data: dict) -> str:
    return data["meta"]["gpu"].removeprefix("NVIDIA ")


def span(values, fmt: str = ".2f") -> str:
    values = list(values)
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}-{high}"


def link(source: str) -> str:
    return f"[{source}]({source})"


def us(value: float) -> str:
    """µs at three significant digits or fewer (112, 15.5, 3.95)."""
    return f"{value:.{0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2}f}"


def percent(value: float) -> str:
    """A share at two significant digits (0.96, 1.0, 12)."""
    return f"{value:#.2g}".rstrip(".") + " %"


def tokens(width: int) -> str:
    """The context of ``width`` pools of 4 keys, in tokens: 16K, 512K, 1M."""
    n = 4 * width
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def join(parts: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return ", ".join(parts[:-1]) + " and " * (len(parts) > 1) + parts[-1]


def runs_of(values: list, measured: list) -> str:
    """``values`` (a sorted subset of ``measured``) as runs: ``32-64``, ``1 and 8``."""
    runs: list[list] = []
    for v in values:
        if runs and measured.index(v) == measured.index(runs[-1][-1]) + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return join([f"{r[0]}" + (f"-{r[-1]}" if len(r) > 1 else "") for r in runs])


@block("tail", BENCH)
def tail_block(data: dict) -> str:
    """The decode tail by decode rows on FlashInfer SM90, then the other paths,
    the eager figures and the share of the tail and top-k the stage removes."""
    m, tails = data["meta"], where(data["kernels"], case="tail")
    sm90 = sorted(where(tails, path=FP32), key=lambda r: r["rows"])
    intro = (
        f"`tools/bench.py` on one {card(data)} (torch {m['torch']}, triton "
        f"{m['triton']}, CuTe DSL 4.8.0), commit {m['commit']}, {m['date']} "
        f"({link(BENCH)}), "
        "graph-replayed, stock and the stage in one run: one DSA layer's decode "
        "tail (the update, the upcast where the path has one, the expansion and "
        f"conversion after a {k_of(data)}-pool top-k; contexts of {TAIL_CONTEXTS}) "
        "on FlashInfer SM90, Hopper's default:"
    )
    rows = []
    for r in sm90:
        stock, stage = r["graph_us"]
        cells = [f"{x:.1f}" for x in (stock, stage, stock - stage)]
        rows.append([str(r["rows"]), *cells, f"{ratio(r['graph_us']):.2f}"])

    saving = lambda p: span((saved(r, "graph_us") for r in where(tails, path=p)), ".1f")
    topk = lambda rows: select_row(data, FP32, rows, 65536)["select_graph_us"][0]

    def share(rows):
        (stock, stage), *_ = [r["graph_us"] for r in sm90 if r["rows"] == rows]
        return f"{100 * (stock - stage) / (stock + topk(rows)):.0f} %"

    update = [saved(r, "graph_us") for r in where(data["kernels"], case="update")]
    spread = sum(max(r["eager_spread"]) > 0.10 for r in data["kernels"])
    eager = [span((r["eager_us"][side] for r in sm90), ".0f") for side in (0, 1)]
    rest = (
        f"Of that the update, before the query, saves {span(update, '.1f')} µs. "
        f"FlashMLA FP8 saves {saving('flashmla-fp8')} µs a layer, the SM100 path "
        f"(with the upcast) {saving('sm100-flashinfer')} µs, measured on the "
        f"{card(data)}: no SM100 GPU ran it. "
        f"Eager, host counted, stock's SM90 tail takes {eager[0]} µs and the "
        f"stage's {eager[1]} µs (noisy: {spread} of the {len(data['kernels'])} "
        "kernel rows spread over 10 %). Stock's top-k (FP32, 64K pools) took "
        f"{topk(1):.1f} µs at 1 row and {topk(64):.1f} at 64 in the same run: the "
        f"stage removes {share(1)} of the tail and the top-k together at 1 row, "
        f"{share(64)} at 64."
    )
    head = "decode rows | stock µs | stage µs | saving µs | stock/stage"
    return "\n".join([intro, "", table(head, rows, left=0), "", rest])


def one_wave(rows: int, width: int, path: str, sms: int) -> bool:
    """Whether the stage runs the select on ``sms`` SMs: the patched vLLM's rule."""
    import torch

    from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select import launch

    dtype = {FP32: torch.float32, BF16: torch.bfloat16}
    return launch.one_wave(rows, width, dtype[path], sms)


def step_one_wave(row: dict, sms: int) -> bool:
    """Whether the step ``row``'s rows (requests x next_n) are one wave."""
    return one_wave(row["rows"] * row["next_n"], row["context"], FP32, sms)


def max_one_wave_rows(width: int, sms: int) -> int:
    rows = 1
    while one_wave(rows + 1, width, FP32, sms):
        rows += 1
    return rows


def sms_of(data: dict) -> int:
    """The SMs of the card the JSON's meta names, which ``SMS`` must have."""
    gpu = data["meta"]["gpu"]
    if gpu not in SMS:
        raise ValueError(f"no SM count for {gpu!r}: add it to SMS ({sorted(SMS)})")
    return SMS[gpu]


def step_ms(requests: int) -> tuple[float, bool]:
    """The cited step time for ``requests``, and whether it is only a floor."""
    if requests in STEP_MS:
        return STEP_MS[requests], False
    return STEP_MS[max(n for n in STEP_MS if n < requests)], True


def step_sizes(rows: list[dict], data: dict) -> str:
    """The sizes of step ``rows``: ``64 requests of 512K-1M tokens (next_n
    2: 32-64 requests of 512K-1M tokens)``."""
    plan, parts = data["meta"]["plan"], []
    steps, contexts = plan["step_rows"], [tokens(w) for w in plan["step_pools"]]
    for next_n in sorted({r["next_n"] for r in rows}):
        by: dict[tuple, list[int]] = {}
        for n in steps:
            widths = sorted(r["context"] for r in where(rows, next_n=next_n, rows=n))
            if widths:
                by.setdefault(tuple(map(tokens, widths)), []).append(n)
        text = join(
            [
                f"{runs_of(ns, steps)} requests of {runs_of(ts, contexts)} tokens"
                for ts, ns in by.items()
            ]
        )
        parts.append(text if next_n == 1 else f"(next_n {next_n}: {text})")
    return " ".join(parts)


@block("gain", bench("scores"))
def gain_block(data: dict) -> str:
    """What a decode step saves, per output token and as a share of a cited
    decode step, with the figures' limits."""
    m, plan = data["meta"], data["meta"]["plan"]
    widths = plan["step_pools"]
    cells = {(n, w): step_row(data, n, 1, w) for n in GAIN_REQUESTS for w in widths}
    every = [step_row(data, n, 1, w) for n in plan["step_rows"] for w in widths]
    assert min(saved(r) for r in every) > 0, "the stage slower than stock somewhere"
    rows, shares = [], []
    for n in GAIN_REQUESTS:
        ms, floor = step_ms(n)
        row = [f"{n} ({'≥ ' * floor}{ms:.1f} ms)"]
        for w in widths:
            step_us = DSA_LAYERS * saved(cells[n, w])
            shares.append(100 * step_us / (1000 * ms))
            row.append(f"{us(step_us / n)} µs, {'≤ ' * floor}{percent(shares[-1])}")
        rows.append(row)
    head = " | ".join([f"{tokens(widths[0])} tokens", *map(tokens, widths[1:])])
    gpu = card(data)
    layers = f"{FIRST_DSA_LAYER}, {FIRST_DSA_LAYER + 4}, …, {LAYERS - 2}"
    steps = [DSA_LAYERS * saved(r) for r in every]
    stock = span((r["step_graph_us"][0] for r in every), ".1f")
    intro = (
        f"**A decode step is {span(steps, '.0f')} µs shorter, about "
        f"{percent(min(shares)).removesuffix(' %')}-{percent(max(shares))} of it**, "
        f"at {GAIN_REQUESTS[0]}-{GAIN_REQUESTS[-1]} requests of "
        f"{tokens(widths[0])}-{tokens(widths[-1])} tokens: an estimate on paper, as "
        "no vLLM engine ran on a GPU. One DSA layer's indexer decode "
        "after the query (the scores, the top-k, the expansion and conversion; "
        "DeepGEMM's scores and stock's top-k on both sides, FlashInfer SM90, "
        f"Hopper's default, CUDA graphs) took {stock} µs stock and "
        f"{span((saved(r) for r in every), '.1f')} µs less with the stage on one {gpu} "
        f"({link(bench('scores'))}, `tools/bench.py`). GLM-5-Next has "
        f"{DSA_LAYERS} such layers ({layers} of its {LAYERS}; the other "
        f"{LAYERS - DSA_LAYERS} are KDA linear attention), so a decode step is "
        f"{DSA_LAYERS} x that shorter, for every request in it. Each cell: that "
        f"saving per output token ({DSA_LAYERS} x the saving / requests), then as a "
        "share of a decode step:"
    )
    cited = sorted(STEP_MS)
    top = cited[-1]
    (n_big,) = [n for n in GAIN_REQUESTS if step_ms(n)[1]] or [None]
    big = step_row(data, max(plan["step_rows"]), 1, widths[-1])
    source = (
        "The step times are GLM-5.2-FP8's mean time per output token on one "
        "8 x H200 node (vLLM, TP 8; its serve recipe sets no speculative "
        "decoding), a larger model of GLM-5-Next's family with its DSA attention "
        f"(744B parameters, 40B active), at {join([str(n) for n in cited])} "
        "concurrent requests: "
        f"{join([f'{STEP_MS[n]:.1f}' for n in cited])} ms (<{STEP_SOURCE}>). No "
        "public GLM-5-Next figure on H200 or H100 was found"
        + f", nor one of {n_big} requests: the {STEP_MS[top]:.1f} ms of {top} is "
        "a floor there, so the share is a ceiling"
        * bool(n_big)
        + ". GLM-5-Next, the smaller model, likely steps faster, which would raise "
        "the share; the source gives no prompt lengths, and at long contexts a "
        "step takes longer (stock's indexer alone takes "
        f"{DSA_LAYERS} x {big['step_graph_us'][0]:.1f} µs = "
        f"{DSA_LAYERS * big['step_graph_us'][0] / 1000:.1f} ms a step at "
        f"{big['rows']} x {tokens(big['context'])} tokens), which would lower it."
    )
    unmeasured = [t for t in ("32K",) if t not in map(tokens, widths)]
    versions = (
        f"- Measured on commit {m['commit']}, {m['date']}, with torch {m['torch']} "
        f"and triton {m['triton']} on a GPU machine without vLLM: `pip install "
        f"vllm==0.33.0` brings torch {PINS['torch']} and triton {PINS['triton']}, "
        "with which none of it ran."
    )
    since = (
        "- Each table below gives its commit too. The kernels changed after each "
        "(the update, expansion, remap, select and scores kernels all did); a "
        "rerun at HEAD is pending."
    )
    contexts = (
        f"- Contexts of {join([tokens(w) for w in widths])} tokens "
        f"({pools(widths[0])}-{pools(widths[-1])} pools of 4 keys, every request's "
        "rows full)"
        + (f"; {join(unmeasured)} was not measured" if unmeasured else "")
        + ". One token a request a step (next_n 1; the JSON has next_n 2 too)."
    )
    paths = (
        "- FlashInfer SM90 only, and the update before the query is not in them "
        "(its saving is below). The SM100 path's figures below were measured on "
        f"the {gpu}: no SM100 GPU (B200) ran."
    )
    split = [since] if SPLIT else []  # tables of several runs
    limits = ["Beside these figures:", "", versions, *split, contexts, paths]
    gains = table(f"requests (step time) | {head}", rows)
    return "\n".join([intro, "", gains, "", source, "", *limits])


@block("opt_in", bench("scores"))
def opt_in_block(data: dict) -> str:
    """The step with the opt-ins, within and past one wave of the select's
    clusters: where each saves and where it is slower than stock."""
    sms = sms_of(data)

    def verdict(key: str) -> str:
        rows = data["scores"]
        inside = [r for r in rows if step_one_wave(r, sms)]
        past = [r for r in rows if not step_one_wave(r, sms)]
        slower = [r for r in past if saved(r, key) < 0]
        faster = [r for r in past if saved(r, key) >= 0]
        assert min(saved(r, key) for r in inside) > 0, (
            f"{key}: slower than stock within one wave"
        )
        text = (
            f"saves {span((saved(r, key) for r in inside), '.1f')} µs a layer "
            f"within one wave of its clusters (all {len(inside)} sizes there, "
            f"{ratio_span(inside, key)}x stock's step); past one wave it "
            f"is slower than stock, {ratio_span(slower, key)}x "
            f"({span((-saved(r, key) for r in slower), '.1f')} µs a layer more), at "
            f"{step_sizes(slower, data)}"
        )
        if faster:
            text += (
                f", and faster, {ratio_span(faster, key)}x, at "
                f"{step_sizes(faster, data)}"
            )
        return text

    return (
        f"The opt-ins in the same run ({link(bench('scores'))}), on "
        "the same step (next_n 1 and 2): "
        "`kpool_select: true`, the select at every batch size, "
        f"{verdict('step_select_graph_us')}. "
        '`kpool_select: "one_wave"` runs stock\'s top-k past one wave, as the '
        "default does there. `kpool_scores: true` with `kpool_select: true` (our "
        f"scores, then the select) {verdict('step_scores_graph_us')}; our scores "
        "with stock's top-k were not timed."
    )


def select_size(r: dict) -> str:
    n4 = " (next_n 4)" if "next_n 4" in r["context"] else ""
    return f"{r['rows']} row{'s' * (r['rows'] > 1)}{n4} of {pools(r['width'])} pools"


def logits_of(row: dict) -> str:
    if (name := row["logits"]) == "randn":
        return "random logits"
    return f"ReLU logits with {name.removeprefix('relu ').replace('%', ' %')} positive"


def r2(r: dict, key: str = "select_graph_us") -> float:
    """The ratio as the text gives it: 1.00 is level, below it slower."""
    return round(ratio(r[key]), 2)


def slower_group(label: str, group: list[dict]) -> str:
    """``label`` and its range, the attribute its slower rows share where its
    faster or level rows lack it, and those rows."""
    slow = [r for r in group if r2(r) < 1]
    others = [r for r in group if r not in slow]
    qualifier = ""
    for value, word in ((ends_of, "{} ends"), (logits_of, "{}")):
        shared = {value(r) for r in slow}
        if others and len(shared) == 1 and not {value(r) for r in others} & shared:
            qualifier += " with " + word.format(*shared)
    notes, slow_logits = [], {s["logits"] for s in slow}
    for r in others:
        own = [
            f"with {ends_of(r)} ends" if ends_of(r) not in map(ends_of, slow) else "",
            f"on {logits_of(r)}" if r["logits"] not in slow_logits else "",
        ]
        own = [o for o in own if o] or [f"at {select_size(r)} with {ends_of(r)} ends"]
        notes.append(f"{r2(r):.2f}x {' '.join(own)}")
    detail = "; ".join([f"{ratio_span(slow)}x", *notes])
    return f"{label}{qualifier} ({detail})"


BELOW_K = ("relu 0%", "relu 0.1%")


def within_wave(rows: list[dict], name: str) -> str:
    """Where the select alone is faster and slower than stock's top-k."""

    def size(r):
        return r["width"], r["rows"], r["context"].partition(",")[2]

    slow = [r for r in rows if r2(r) <= 1]
    if not slow:
        return f"{name} faster at every size ({ratio_span(rows)}x)"
    small = min(r["width"] for r in rows)
    short = [r for r in rows if r["width"] > small and ends_of(r) == "short"]
    groups = [
        (f"at {pools(small)} pools", where(rows, width=small)),
        ("at short row ends", short),
    ]
    grouped = [r for _, g in groups for r in g]
    ordered = sorted(slow, key=lambda r: (r["width"], r["rows"]))
    for key in dict.fromkeys(size(r) for r in ordered if r not in grouped):
        members = [
            r
            for r in rows
            if size(r) == key
            and r not in grouped
            and (r2(r) <= 1 or r["logits"] not in BELOW_K)
        ]
        groups.append((f"at {select_size(members[0])}", members))
        grouped += members
    below = [r for r in rows if r["logits"] in BELOW_K and r not in grouped]
    rest = [r for r in rows if r not in grouped and r not in below]
    assert all(r2(r) > 1 for r in below + rest), "a slower row left out"
    widths: dict[int, list[str]] = {}
    for width, n in sorted({(r["width"], r["rows"]) for r in rest}):
        widths.setdefault(width, []).append(str(n))
    faster = join([f"{join(ns)} rows of {pools(w)} pools" for w, ns in widths.items()])
    one = where(rest, rows=1, width=65536, context="full", logits="randn")
    one_x = "".join(f"; {r2(r):.2f}x at 1 x 64K" for r in one)
    below_k = (
        f" and on ReLU logits with fewer than k pools above 0.0 ({ratio_span(below)}x)"
    )
    return (
        f"{name} faster at {faster} ({ratio_span(rest)}x{one_x})"
        + below_k * bool(below)
        + "; slower than stock "
        + join([slower_group(label, g) for label, g in groups])
    )


@block("select", bench("select"))
def select_block(data: dict) -> str:
    """The select alone against stock's top-k: within one wave, where it is
    faster and slower, its chain, and past one wave."""
    sms, m, gpu = sms_of(data), data["meta"], card(data)
    inside = staged(data)
    fp32, bf16 = where(inside, path=FP32), where(inside, path=BF16)
    past = [r for r in data["select"] if r not in inside and r["logits"] == "randn"]

    def chain(rows):
        values = [ratio(r["chain_graph_us"]) for r in rows]
        return f"{span(values)}x" + ("" if min(values) > 1 else " (slower at some)")

    def beyond(name):
        rows = where(past, path=name)
        sizes = f"{sum(r2(r) < 1 for r in rows)} of its {len(rows)} sizes"
        return f"{ratio_span(rows)}x (slower than stock at {sizes})"

    return (
        "The select alone against stock's top-k (k "
        f"{k_of(data)}; {link(bench('select'))}, `tools/bench.py`, commit "
        f"{m['commit']}, {m['date']}, one {gpu}; rows are requests x next_n, "
        "a pool is 4 tokens). `kpool_select: true` runs it at every decode batch "
        'size, `"one_wave"` only within one wave of its clusters (on the '
        f"{gpu}'s {sms} SMs up to {max_one_wave_rows(65536, sms)} rows of 64K pools, "
        f"{max_one_wave_rows(262144, sms)} of 256K), stock's top-k past it. Within "
        "one wave, for both: "
        + within_wave(
            bf16, "on the SM100 path's BF16 logits (with stock's upcast) it is"
        )
        + "; "
        + within_wave(fp32, "on Hopper's FP32 logits it is")
        + ". Its chain with the fused remap, which a step runs, is "
        f"{chain(fp32)} on FP32 and {chain(bf16)} on BF16 there. Past one wave "
        f"(`true` only; {min(r['rows'] for r in past)}-{max(r['rows'] for r in past)} "
        f"rows, random logits) the select alone is {beyond('sm90-flashinfer')} on "
        f"FP32 and {beyond('sm100-flashinfer')} on BF16: the cost of batch "
        'invariance that `"one_wave"` avoids.'
    )


@block("steps", "docs/indexer-steps-h200.json")
def steps_block(data: dict) -> str:
    runs = [r for r in data["runs"] if r["steps"]["decode_steps"] >= 1000]
    commits = Counter(r["commit"] for r in runs)
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


def kernel_label(row: dict) -> str:
    fields = {"update": "scales tokens", "remap": "counts", "tail": "path"}
    names = fields.get(row["case"], "").split()
    return f"{row['case']} " + " ".join(f"{k}={row[k]}" for k in names)


def kernel_table(kernels: list[dict], label, cell, head: str, first: str = "") -> str:
    """``cell(row)`` of ``kernels`` by ``label(row)`` and by decode rows."""
    groups: dict = {}
    for r in kernels:
        groups.setdefault(label(r), {})[r["rows"]] = r
    rows = sorted({n for g in groups.values() for n in g})
    lines = [[k, *(cell(g[n]) for n in rows)] for k, g in groups.items()]
    return table(" | ".join([head, first + str(rows[0]), *map(str, rows[1:])]), lines)


@block("kernels", BENCH, PERFORMANCE)
def kernels_block(data: dict) -> str:
    """Each kernel's ratio by decode rows, graph-replayed and eager."""
    kernels = [r for r in data["kernels"] if r["case"] != "upcast"]

    def ratios(timer):
        cell = lambda r: f"{ratio(r[timer + '_us']):.2f}"
        return kernel_table(kernels, kernel_label, cell, f"{timer}: stock / ours")

    return "\n\n".join([ratios("graph"), ratios("eager")])


@block("upcast", BENCH, PERFORMANCE)
def upcast_block(data: dict) -> str:
    """The upcast's ratio by rows, row ends and pools; ours' share of the copy."""
    upcasts = where(data["kernels"], case="upcast")
    label = lambda r: f"ends {r['ends']}, {r['width']} pools"
    cell = lambda r: f"{ratio(r['graph_us']):.2f} ({100 * r['roof'][1]:.0f} %)"
    head = "upcast, graph: stock / ours (ours' share of the copy)"
    return kernel_table(upcasts, label, cell, head, "rows ")


@claims(PERFORMANCE, BENCH)
def kernel_claims(data: dict) -> list[str]:
    kernels = data["kernels"]
    n, selects = len(kernels), len(data["select"])
    spread = max(max(r["graph_spread"]) for r in kernels)
    noisy = sum(max(r["eager_spread"]) > 0.10 for r in kernels)
    m, copy = data["meta"], data["meta"]["copy"]
    sm100 = where(kernels, case="tail", path=BF16)
    full = where(kernels, case="upcast", ends="full")
    wide = [r for r in full if (r["rows"], r["width"]) in ((256, 65536), (64, 262144))]
    return [
        f"Stock against the stage on one {m['gpu']}, as ratios",
        f"on the code of commit {m['commit']}, {m['date'][:10]}",
        f"{link(Path(BENCH).name)} ({n} kernel rows, {selects} select rows)",
        f"(under {5 * math.ceil(20 * spread)} % in every graph row of this run)",
        f"{noisy} of the {n} kernel rows have a spread above 10 % on one side",
        (
            f"{copy['kernel']:,.0f} GB/s counting read and write (`copy_`'s memcpy: "
            f"{copy['memcpy']:,.0f} GB/s)"
        ),
        f"**The update** ({ratio_span(where(kernels, case='update'), 'graph_us')}x)",
        (
            f"**The SM100 tail** falls from {ratio(sm100[0]['graph_us']):.1f}x at one "
            f"row to {ratio(sm100[-1]['graph_us']):.1f}x at {sm100[-1]['rows']}"
        ),
        (
            "**The upcast** at 256 x 64K and 64 x 256K full rows "
            f"({ratio_span(wide, 'graph_us')}x) is at "
            f"{span((100 * r['roof'][1] for r in wide), '.0f')} % of the copy"
        ),
    ]


RELU = ("relu 0%", "relu 0.1%", "relu 1%", "relu 50%")


def select_row(
    data: dict, path: str, rows: int, width: int, context="full", logits="randn"
) -> dict:
    """The select's row of ``path``, ``rows`` x ``width`` pools."""
    fields = dict(path=path, rows=rows, width=width, context=context, logits=logits)
    return only(data["select"], **fields)


# The select's and its chain's times, graph-replayed and eager.
SELECT_KEYS = ("select_graph_us", "chain_graph_us", "chain_eager_us")
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


@block("select_table", bench("select"), PERFORMANCE)
def select_table_block(data: dict) -> str:
    """A selection of the select's rows: µs of the select alone, then ratios."""
    rows = []
    for logits, size, key in SELECT_TABLE:
        select_label_is_its_row(logits, size, key)
        r = select_row(data, *key)
        cells = [f"{us:.2f}" for us in r["select_graph_us"]]
        cells += [f"{ratio(r[k]):.2f}" for k in SELECT_KEYS]
        rows.append([logits, size, *cells])
    head = "logits | rows x pools, row ends | stock | select | select x"
    return table(f"{head} | chain x | eager chain x", rows, left=2)


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
    """The select's rows where the stage runs it (``one_wave``) on the card."""
    return [
        r
        for r in data["select"]
        if one_wave(r["rows"], r["width"], r["path"], sms_of(data))
        and (path is None or r["path"] == path)
    ]


def ends_of(row: dict) -> str:
    return row["context"].split(",")[0]


@block("one_wave_table", bench("select"), PERFORMANCE)
def one_wave_table_block(data: dict) -> str:
    """The select's ranges over the sizes where the stage runs it."""
    lines = []
    for path, label, name, logits, ends in ONE_WAVE_TABLE:
        at = [r for r in staged(data, name) if ends_of(r) == ends]
        rows = [r for r in at if r["logits"] in logits]
        lines.append([path, label, *(ratio_span(rows, k) for k in SELECT_KEYS)])
    head = "path | logits, row ends | select alone | chain | eager chain"
    return table(head, lines, left=2)


@claims(PERFORMANCE, bench("select"))
def select_claims(data: dict) -> list[str]:
    fp32, bf16 = staged(data, FP32), staged(data, BF16)
    randn = where(fp32, logits="randn")
    short = [r for r in randn if ends_of(r) == "short"]
    small = [r for r in randn if r["width"] == 16384 and ends_of(r) != "short"]
    from_4 = [r for r in small if r["rows"] >= 4]
    one_random = only(small, rows=1, context="random")
    big = [r for r in fp32 if (r["rows"], r["width"]) in ((64, 65536), (8, 262144))]
    sizes = [r for r in big if ends_of(r) != "short" and r["logits"] not in BELOW_K]
    slower = [r for r in sizes if ratio(r["select_graph_us"]) < 1]

    faster = lambda rows: {ratio(r["select_graph_us"]) > 1 for r in rows}
    assert faster(bf16) == {True}, "BF16: the select slower than stock somewhere"
    assert faster(from_4) == {False}, "16K pools from 4 rows: not all slower"
    assert faster(r for r in sizes if r in randn) == {False}, "64 x 64K, 8 x 256K"
    relu = {r["logits"] for r in slower} - {"randn"}
    assert relu == {"relu 1%", "relu 50%"}, f"slower on ReLU logits: {relu}"
    # Rounded down, so that "x or more" holds.
    chain = math.floor(min(ratio(r["chain_graph_us"]) for r in fp32 + bf16) * 100)
    date, name = data["meta"]["date"][:16], Path(bench("select")).name
    return [
        f"All {len(data['select'])} rows of one run ({date}) are in {link(name)}",
        f"On FP32 it is at short row ends ({ratio_span(short)}x:",
        (
            f"at 16K pools from 4 rows ({ratio_span(from_4)}x; "
            f"{ratio(one_random['select_graph_us']):.2f}x at 1 row of random ends)"
        ),
        (
            f"by a few percent at 64 x 64K and 8 x 256K ({ratio_span(slower)}x, "
            "also on ReLU logits with 1-50 % positive)"
        ),
        f"The chain stays {chain / 100:.2f}x or more everywhere the stage runs it",
    ]


def step_row(data: dict, rows: int, next_n: int, pools: int) -> dict:
    """The step case of ``rows`` requests of ``next_n`` tokens and ``pools``."""
    return only(data["scores"], rows=rows, next_n=next_n, context=pools)


# The step table's sizes: requests, next_n, pools.
STEP_TABLE = [
    *((n, 1, width) for width in (4096, 65536) for n in (1, 8, 64)),
    *((n, 1, 262144) for n in (1, 64)),
    (1, 2, 65536),
    (64, 2, 262144),
]


@block("step_table", bench("scores"), PERFORMANCE)
def step_table_block(data: dict) -> str:
    """The indexer decode after the query with DeepGEMM's scores on both sides."""
    lines = []
    for rows, next_n, width in STEP_TABLE:
        r = step_row(data, rows, next_n, width)
        step, select = r["step_graph_us"], r["step_select_graph_us"]
        cells = [f"{us:.1f}" for us in (r["scores_graph_us"][0], *step, select[1])]
        cells += [f"{ratio(p):.2f}" for p in (step, select, r["step_eager_us"])]
        lines.append([f"{rows} x {next_n}", pools(width), *cells])
    head = "rows x next_n | pools | DeepGEMM alone | stock | stage | stage, select"
    return table(f"{head} | stock/stage | stock/select | eager stock/stage", lines)


@block("chain_table", bench("scores"), PERFORMANCE)
def chain_table_block(data: dict) -> str:
    """Every step size: stock, the select, our scores too, each scores alone."""
    lines = []
    order = sorted(data["scores"], key=lambda r: (r["next_n"], r["context"], r["rows"]))
    for r in order:
        ours = r["step_scores_graph_us"]
        cells = [f"{us:.1f}" for us in (ours[0], r["step_select_graph_us"][1], ours[1])]
        cells += [f"{ratio(ours):.2f}", f"{ratio(r['step_scores_eager_us']):.2f}"]
        cells += [f"{us:.1f}" for us in r["scores_graph_us"]]
        lines.append([f"{r['rows']} x {pools(r['context'])}, {r['next_n']}", *cells])
    head = "requests x pools, next_n | stock µs | select µs | ours µs | stock/ours"
    return table(f"{head} | eager stock/ours | DeepGEMM alone | ours alone", lines)


@claims(PERFORMANCE, bench("scores"))
def scores_claims(data: dict) -> list[str]:
    rows = data["scores"]
    pair, select = "step_scores_graph_us", "step_select_graph_us"
    one = step_row(data, 1, 1, 65536)
    ours, chain = one["scores_graph_us"][1], one[pair][1]
    big = [r for r in rows if r["rows"] >= 32 and r["context"] >= 131072]
    slower = [r for r in big if ratio(r[pair]) < 1]
    where = {(r["next_n"], r["rows"]) for r in slower}
    assert where == {(2, 32), (2, 64), (1, 64)}, (
        f"slower than stock at (next_n, requests) {sorted(where)}, not next_n 2 "
        "from 32 requests and next_n 1 at 64"
    )
    # Our scores' time over DeepGEMM's.
    behind = [100 * (ratio(r["scores_graph_us"][::-1]) - 1) for r in slower]
    assert min(behind) > 0, "our scores alone not behind DeepGEMM's everywhere"
    past = [r for r in big if not step_one_wave(r, sms_of(data))]
    assert all(r in past for r in slower), "slower than stock within one wave"
    within = " and ".join(
        f"{r['rows']} x {pools(r['context'])} at next_n {r['next_n']}"
        for r in big
        if r not in past
    )

    def sizes(requests, widths):
        chosen = [r for r in rows if requests(r["rows"]) and widths(r["context"])]
        return ratio_span(chosen, pair)

    return [
        (
            f"the chain is {sizes(lambda n: n <= 4, lambda w: w <= 131072)}x "
            f"({sizes(lambda n: n <= 4, lambda w: w == 4096)}x at 1-4 x 4K, "
            f"{sizes(lambda n: n == 1, lambda w: w == 65536)}x at 1 x 64K); "
            f"{sizes(lambda n: n == 8, lambda w: w <= 16384)}x at 8 requests up "
            "to 16K"
        ),
        f"At 1 x 64K it costs our scores ({ours:.1f} µs) + {chain - ours:.1f} µs",
        (
            "Slower than stock at 32-64 requests of 128K-256K pools "
            f"({ratio_span(slower, pair)}x; next_n 2 from 32 requests, next_n 1 at 64)"
        ),
        (
            "the step with DeepGEMM's scores and the select is "
            f"{ratio_span(slower, select)}x there"
        ),
        f"our scores alone {span(behind, '.1f')} % behind DeepGEMM's",
        # The select past one wave, in the step.
        (
            f"the step with the select is {ratio_span(big, select)}x stock's at 32-64 "
            f"requests of 128K-256K pools ({ratio_span(past, select)}x past one "
            f"wave, every size there but {within}"
        ),
    ]


@claims(PERFORMANCE, "docs/bench-step-fed-h200.json")
def fed_claims(data: dict) -> list[str]:
    """The select fed by our scores (``step_fed``) against ``step_scores``."""
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
    lines = [
        [name, str(rows), *(f"{g[w][0]:.1f} / {g[w][1]:.1f}" for w in widths)]
        for (name, rows), g in groups.items()
    ]
    return table(f"logits | rows | {head}", lines)


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


def over_read(row: dict) -> float:
    """% our scores take over one read."""
    return 100 * (row["ours_cold"] / read_us(row) - 1)


def cold_size(row: dict) -> tuple[int, int, int]:
    return row["entries"], row["pools"], row["next_n"]


@block("cold_table", "docs/scores-cold-h200.json", PERFORMANCE)
def cold_table_block(data: dict) -> str:
    """Our scores and DeepGEMM's read cold, against one read of the bytes."""
    before = {cold_size(r): r for r in data["before"]}
    lines = []
    for r in data["rows"]:
        ours, dg = r["ours_cold"], r["dg_cold"]
        times = (ours, before[cold_size(r)]["ours_cold"], dg, dg / ours, read_us(r))
        size = f"{r['entries']} x {pools(r['pools'])}, {r['next_n']}"
        cells = [f"{x:.2f}" for x in times]
        lines.append([size, f"{r['mb']:.1f}", *cells, f"{over_read(r):+.0f} %"])
    head = "requests x pools, next_n | MB read | ours µs | before (32 heads)"
    head += " | DeepGEMM µs | DeepGEMM/ours | read µs | ours vs read"
    return table(head, lines)


@claims(PERFORMANCE, "docs/scores-cold-h200.json")
def cold_claims(data: dict) -> list[str]:
    rows = data["rows"]
    gate = {id(r): r["dg_cold"] / r["ours_cold"] for r in rows}

    def closest(next_n):
        at = where(rows, next_n=next_n)
        low = min(gate[id(r)] for r in at)
        near = [r for r in at if f"{gate[id(r)]:.2f}" == f"{low:.2f}"]
        sizes = " and ".join(f"{r['entries']} x {pools(r['pools'])}" for r in near)
        return sizes, f"{low:.2f}x"

    (n1, x1), (n2, x2) = closest(1), closest(2)
    last = only(rows, entries=64, pools=65536, next_n=2)
    before = {cold_size(r): r for r in data["before"]}
    failed, passed = [], []
    for (entries, width, next_n), b in before.items():
        if next_n == 2:
            group = failed if width == 65536 and entries >= 4 else passed
            group.append(b["dg_cold"] / b["ours_cold"])
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
    """Where one read bounds the time, the sizes within 10 % of it and not."""
    bound = [r for r in rows if r["mb"] >= 64]
    parts: dict[bool, list[str]] = {True: [], False: []}
    for next_n in (1, 2):
        for within in (True, False):
            at = where(bound, next_n=next_n)
            over = [r for r in at if (over_read(r) < 10) == within]
            named = [
                f"{r['entries']} x {pools(r['pools'])} ({over_read(r):+.0f} %)"
                for r in sorted(over, key=over_read)
            ]
            if named:
                parts[within].append(f"{join(named)} at next_n {next_n}")
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
    lines = []
    for path, (name, note) in STEP_PATHS.items():
        for n, (mode, label) in enumerate(STEP_MODES.items()):
            commits = [runs[path, mode, select]["commit"] for select in (False, True)]
            lines.append([name + (note if n == 0 else ""), label, *commits])
    return table("backend path | mode | select off | select on", lines, left=4)


@claims(VALIDATION, "docs/indexer-steps-h200.json")
def steps_claims(data: dict) -> list[str]:
    runs = step_runs(data)
    others = [r for r in data["runs"] if r not in runs.values()]
    steps = {r["steps"]["decode_steps"] for r in runs.values()}
    assert steps == {1000}, f"the path and mode runs took {steps} decode steps"
    assert sum(r["mismatches"] for r in data["runs"]) == 0, "a run mismatched"
    (short,) = {r["steps"]["decode_steps"] for r in others}
    commits = Counter(r["commit"] for r in data["runs"])
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


# Text at the README's width, words and hyphenated words whole.
fill = partial(textwrap.fill, width=76, break_long_words=False, break_on_hyphens=False)


def wrap(text: str) -> str:
    """Paragraphs and list items at the README's width; tables as they are."""

    def paragraph(part: str) -> str:
        if part.startswith("|"):
            return part
        if part.startswith("- "):
            items = part[2:].split("\n- ")
            return "\n".join(fill("- " + i, subsequent_indent="  ") for i in items)
        return fill(part)

    return "\n\n".join(paragraph(part) for part in text.split("\n\n"))


def render(name: str, source: str, root: Path = REPO) -> str:
    """The text of block ``name`` from ``source``, which must be its JSON."""
    if name not in BLOCKS:
        raise ValueError(f"figure block {name!r}: expected one of {sorted(BLOCKS)}")
    want, fn = BLOCKS[name]
    if source != want:
        raise ValueError(f"figure block {name!r}: names {source}, expected {want}")
    return wrap(fn(json.loads((root / source).read_text())))


def problems(path: Path | None = None, root: Path = REPO, near=False) -> list[str]:
    """What ``path`` (default: every page) gets wrong: blocks that differ from
    their JSON, are missing or belong elsewhere, and claims not found (with
    ``near``: the claims alone, each with the page's passage most like it)."""
    if path is None:
        return [p for page in pages(root) for p in problems(page, root, near)]
    path = path.resolve()  # a page named from the working directory
    text, out = path.read_text(), []
    page = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
    found = [] if near else BLOCK.findall(text)
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
    if text.count("<!-- figures:") != len(found) and not near:
        out.append(f"{page}: a <!-- figures: --> marker without its block")
    mine = {name for name, where in PAGE_OF.items() if where == page and not near}
    missing = sorted(mine - {name for name, _, _ in found})
    out += [f"{page}: no figure block {name!r}" for name in missing]
    flat_text = flat(text)
    for where, sources, fn in CLAIMS:
        if where != page:
            continue
        data = [json.loads((root / source).read_text()) for source in sources]
        named = ", ".join(sources)
        try:
            phrases = fn(*data)
        except AssertionError as e:
            out.append(f"{page}: {named} contradicts a label: {e}")
            continue
        for phrase in phrases:
            if flat(phrase) not in flat_text:
                out.append(f"{page}: not found; from {named}: {flat(phrase)!r}")
                if near:
                    out[-1] += f"\n  nearest: {nearest(phrase, flat_text)!r}"
    return out


def nearest(phrase: str, text: str) -> str:
    """The run of ``text``'s words as long as ``phrase``'s most like it."""
    want, words = flat(phrase).split(), text.split()
    runs = [words[i : i + len(want)] for i in range(len(words) - len(want) + 1)]
    like = lambda run: (SequenceMatcher(None, want, run).ratio(), run[0] == want[0])
    return " ".join(max(runs or [words], key=like))


def write(path: Path | None = None, root: Path = REPO) -> None:
    """Rewrites the blocks of ``path`` (default: every page) from their JSON."""
    if path is None:
        for page in pages(root):
            write(page, root)
        return

    def new(m):  # the marker names the block's JSON as BLOCKS has it
        name, source = m[1], BLOCKS.get(m[1], (m[2],))[0]
        text = render(name, source, root)
        return f"<!-- figures: {name} from {source} -->\n{text}\n<!-- /figures -->"

    text = path.read_text()
    if BLOCK.search(text):
        path.write_text(BLOCK.sub(new, text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--write", action="store_true", help="rewrite the blocks")
    add("--claims", action="store_true", help="claims not found, and where")
    add("--page", type=Path, help="one page (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    from tools import overlay

    overlay.import_patched("readme_figures.py")
    if args.write:
        write(args.page)
    found = problems(args.page, near=args.claims)
    for problem in found:
        print(problem)
    return int(bool(found))


if __name__ == "__main__":
    sys.exit(main())
