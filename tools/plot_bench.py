# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Draws a ``tools/bench_kpool.py`` JSON as a PNG: time per launch against
rows, stock and specialized, one panel per kernel.

    python tools/plot_bench.py bench.json docs/bench.png   # needs matplotlib
"""

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path


def rows_of(size: str) -> int:
    return int(re.match(r"\d+", size).group())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("png", type=Path)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(args.json.read_text())
    panels = defaultdict(lambda: defaultdict(list))
    for r in data["results"]:
        # Update sizes are "requests x tokens": one series per token count.
        series = r["size"].split("x")[1] if "update" in r["kernel"] else ""
        panels[r["kernel"]][series].append(
            (rows_of(r["size"]), r["stock_us"], r["ours_us"])
        )
    cols = 3
    fig, axes = plt.subplots(
        (len(panels) + cols - 1) // cols,
        cols,
        figsize=(5 * cols, 3.6 * ((len(panels) + cols - 1) // cols)),
        squeeze=False,
    )
    for ax, (kernel, by_series) in zip(axes.flat, panels.items(), strict=False):
        for series, points in sorted(by_series.items()):
            points.sort()
            xs = [p[0] for p in points]
            tag = f" ({series} tok)" if series else ""
            mark = "s" if series == "4" else "o"
            stock = [p[1] for p in points]
            ours = [p[2] for p in points]
            ax.plot(xs, stock, mark + "--", color="tab:gray", label="stock" + tag)
            ax.plot(xs, ours, mark + "-", color="tab:green", label="specialized" + tag)
        ax.set_xscale("log", base=2)
        ax.set_title(kernel)
        ax.set_xlabel("rows (requests)")
        ax.set_ylabel("µs per launch")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    meta = data["meta"]
    fig.suptitle(
        f"{meta['gpu']}, driver {meta['driver']}, torch {meta['torch']}, triton "
        f"{meta['triton']}, CuTe DSL {meta['cutedsl']}; launch floor "
        f"{meta['launch_floor_us']:.2f} µs, copy {meta['copy_gbs']:.0f} GB/s"
    )
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
