#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""README.md's figures, recomputed from the committed JSON each block names.

A figure block is the text between ``<!-- figures: NAME from docs/X.json -->``
and ``<!-- /figures -->``; ``BLOCKS[NAME]`` gives its text from that JSON
(its source, which the text links). ``python tools/readme_figures.py``
prints each block that differs, with the text it should have, and exits 1
(CI checks the same through ``tests/tools/test_readme_figures.py``);
``--write`` rewrites the blocks. A new block is a function here, registered
with ``@block(NAME, "docs/X.json")``, and its markers in the README.

The select's block needs the patched vLLM (its one-wave rule decides where
the stage runs the select): the overlay of the installed vLLM, or the
kernel-only shim with ``KPOOL_KERNEL_ONLY=1``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
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


def block(name: str, source: str):
    """Registers ``fn(data) -> text`` as the block ``name`` of ``source``."""

    def register(fn):
        BLOCKS[name] = (source, fn)
        return fn

    return register


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


def problems(path: Path = README, root: Path = REPO) -> list[str]:
    """Each block of ``path`` that differs from its JSON, with the text it
    should have; each registered block missing from ``path``."""
    text, out = path.read_text(), []
    found = BLOCK.findall(text)
    for name, source, body in found:
        try:
            want = render(name, source, root)
        except ValueError as e:
            out.append(str(e))
            continue
        if body.strip() != want:
            out.append(
                f"{path.name}: figure block {name!r} differs; from {source}:\n{want}"
            )
    if text.count("<!-- figures:") != len(found):
        out.append(f"{path.name}: a <!-- figures: --> marker without its block")
    missing = sorted(set(BLOCKS) - {name for name, _, _ in found})
    out += [f"{path.name}: no figure block {name!r}" for name in missing]
    return out


def write(path: Path = README, root: Path = REPO) -> None:
    def new(m):
        text = render(m[1], m[2], root)
        return f"<!-- figures: {m[1]} from {m[2]} -->\n{text}\n<!-- /figures -->"

    path.write_text(BLOCK.sub(new, path.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the blocks")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    from tools import overlay

    overlay.import_patched("readme_figures.py")
    if args.write:
        write(args.readme)
    found = problems(args.readme)
    for problem in found:
        print(problem)
    return int(bool(found))


if __name__ == "__main__":
    sys.exit(main())
