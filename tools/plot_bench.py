# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Draws a ``tools/bench_kpool.py`` JSON as a PNG: the speedups (stock time
over ours) against rows, in CUDA graphs and eager, and the upcast's share of
the copy roofline, stock and ours.

    python tools/plot_bench.py bench.json docs/bench.png   # needs matplotlib

The title names the commit and the date the JSON records ("unknown" for a
JSON from before they were recorded). Reads the older JSON too (no sections,
one upcast distribution); rows that failed or were skipped are left out.
"""

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

DISTS = ("full", "random", "short")
WIDTH_COLORS = {16384: "tab:blue", 65536: "tab:orange", 262144: "tab:red"}
ROOF_TARGET = 0.9
EAGER_TARGET = 2.0


def normalize(r: dict) -> dict:
    """The structured fields of a result row, parsed from its names where an
    older JSON left them out."""
    r = dict(r)
    r.setdefault("section", "graph")
    r.setdefault("rows", int(re.match(r"\d+", r["size"]).group()))
    if "update" in r["kernel"] and "tokens" not in r:
        r["tokens"] = int(r["size"].split("x")[1])
    old_upcast = re.fullmatch(r"upcast_logits (\d+)K", r["kernel"])
    if old_upcast:  # random row ends, one width per kernel name
        r.update(kernel="upcast_logits random", dist="random")
        r["width"] = int(old_upcast.group(1)) * 1024
        if "ours_of_copy" in r:
            r["ours_roof"] = r["ours_of_copy"]
    return r


def series(rows, key) -> dict:
    """{label: sorted [(rows, row)]} grouped by ``key(row)`` (None: left out)."""
    out = defaultdict(list)
    for r in rows:
        label = key(r)
        if label is not None:
            out[label].append((r["rows"], r))
    return {k: sorted(v, key=lambda p: p[0]) for k, v in out.items()}


def kernel_label(r) -> str | None:
    if r["kernel"].startswith(("upcast", "decode tail")):
        return None
    if "tokens" in r:
        return f"{r['kernel']}, {r['tokens']} tok"
    return r["kernel"]


def tail_label(r) -> str | None:
    if not r["kernel"].startswith("decode tail"):
        return None
    return r.get("path") or r["kernel"].removeprefix("decode tail").strip() or "tail"


def eager_label(r) -> str | None:
    if r["kernel"].startswith("upcast"):
        return f"upcast_logits {r['width'] // 1024}K {r.get('dist', '')}"
    return kernel_label(r) or f"decode tail {tail_label(r)}"


def natural(label: str) -> list:
    """Sort key that puts "16K" before "256K"."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", label)]


def draw_ratios(ax, by_label, title, target=None) -> None:
    for label, points in sorted(by_label.items(), key=lambda kv: natural(kv[0])):
        ax.plot([p[0] for p in points], [p[1]["ratio"] for p in points], "o-",
                label=label, markersize=3)  # fmt: skip
    ax.axhline(1, color="black", linewidth=0.8)
    if target:
        label = f"target x{target:g}"
        ax.axhline(target, color="tab:green", linestyle=":", label=label)
    finish(ax, title, "stock / ours")


def draw_roofline(ax, rows, dist) -> None:
    for width, points in sorted(series(rows, lambda r: r["width"]).items()):
        color = WIDTH_COLORS.get(width)
        xs = [p[0] for p in points]
        ours = [100 * p[1].get("ours_roof", float("nan")) for p in points]
        stock = [100 * p[1].get("stock_roof", float("nan")) for p in points]
        tag = f"{width // 1024}K"
        ax.plot(xs, ours, "o-", color=color, label=f"ours {tag}")
        ax.plot(xs, stock, "s--", color=color, alpha=0.6, label=f"stock {tag}")
    if dist != "short":  # the target is for full and random row ends
        label = f"target {ROOF_TARGET:.0%}"
        ax.axhline(100 * ROOF_TARGET, color="tab:green", linestyle=":", label=label)
    finish(ax, f"upcast_logits, {dist} ends: % of copy BW", "% of copy roofline")
    ax.set_ylim(bottom=0)


def finish(ax, title, ylabel) -> None:
    ax.set_xscale("log", base=2)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("rows (requests)")
    ax.set_ylabel(ylabel)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)


def title(meta: dict) -> str:
    """The figure's title: what was measured (commit, date), then where."""
    return (
        f"commit {meta.get('commit', 'unknown')}, {meta.get('date', 'date unknown')}"
        f"\n{meta['gpu']}, driver {meta['driver']}, torch {meta['torch']}, triton "
        f"{meta['triton']}, CuTe DSL {meta['cutedsl']}; launch floor "
        f"{meta['launch_floor_us'] or 0:.2f} µs, copy {meta['copy_gbs']:.0f} GB/s"
    )


def plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [normalize(r) for r in data["results"] if "stock_us" in r]
    graph = [r for r in rows if r["section"] == "graph"]
    eager = [r for r in rows if r["section"] == "eager"]
    upcast = defaultdict(list)
    for r in graph:
        if "dist" in r:
            upcast[r["dist"]].append(r)
    fig, axes = plt.subplots(3, 3, figsize=(16, 13), squeeze=False)
    draw_ratios(axes[0][0], series(graph, kernel_label), "kernels, CUDA graph")
    draw_ratios(axes[0][1], series(graph, tail_label), "decode tail per path, graph")
    draw_ratios(axes[0][2], series(eager, eager_label), "eager, host included",
                EAGER_TARGET)  # fmt: skip
    for col, dist in enumerate(DISTS):
        by_width = series(upcast[dist], lambda r: f"{r['width'] // 1024}K")
        draw_ratios(axes[1][col], by_width, f"upcast_logits, {dist} ends, graph")
        draw_roofline(axes[2][col], upcast[dist], dist)
    fig.suptitle(title(data["meta"]))
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("png", type=Path)
    args = parser.parse_args()
    plot(json.loads(args.json.read_text()), args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
