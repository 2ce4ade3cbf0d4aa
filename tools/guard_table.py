# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kpool kernels' rules as docs/reference.md's guard table (between
``BEGIN`` and ``END``; ``test_host.py`` checks it): per kernel and argument,
what its rule takes, in its own words from its refusals at the edges the
kernel tests try (``rule_edges.py``), and what a refused input gets.
``python tools/guard_table.py`` prints it and nothing else on stdout."""

import argparse
import inspect
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- guard-table -->", "<!-- /guard-table -->"
HEADER = "| kernel | argument | it takes | a refused input gets |"
# Per kernel: its public function (which raises ``Refused``); what the
# stage runs on an input the rule refuses.
ENTRIES = dict(
    Update=("kpool_update", "`kpool_decode_update_and_maybe_write_cache_batched`"),
    Expand=("expand_pools", "`expand_pools_and_append_tail`"),
    Remap=("expand_and_remap", "the logical rows, the stock conversion"),
    Upcast=("upcast_logits", "`as_fp32_logits`"),
    Select=("select_topk", "`as_fp32_logits` and stock's top-k"),
    Scores=("SCORES", "DeepGEMM's `fp8_fp4_paged_mqa_logits`"),
)


def rows() -> tuple[list[str], list[tuple[str, str, str]]]:
    """(what every tensor argument takes, [(kernel, argument, what it
    takes)] in the kernels' and their arguments' order)."""
    sys.path.insert(0, str(REPO / "tests/models/glm5next/specialized_decode"))
    import rule_edges

    every, table = {}, {}
    with rule_edges.allow_cpu():
        for order, kernel in enumerate(rule_edges.EDGED):
            names = list(inspect.signature(kernel.spec).parameters)
            for edge in rule_edges.edges(kernel):
                try:
                    message = rule_edges.answer(kernel, edge.arguments)
                except AttributeError:  # a required tensor left None
                    message = None
                if message is None:
                    continue
                argument, takes = re.fullmatch(
                    r"(\w+): expected (.+), got .+", message, re.S
                ).groups()
                # Not the case's own values: "(2051)", "k = 512", the device.
                takes = re.sub(r" \(\d+\)| = \d+", "", takes)
                takes = re.sub(r"on \S+ as the others", "on the others' device", takes)
                if edge.kind == "type" and not edge.name.endswith(": None"):
                    every[takes] = None
                else:
                    name = type(kernel).__name__.removesuffix("Kernel")
                    table[order, names.index(argument), name, argument, takes] = None
    return list(every), [row[2:] for row in sorted(table)]


def markdown() -> str:
    every, table = rows()
    lines = [HEADER, "| --- " * 4 + "|"]
    for takes in every:
        lines.append(f"| every kernel | every tensor argument | {takes} | as below |")
    for name, argument, takes in table:
        function, stock = ENTRIES[name]
        refused = f"the stage: {stock}; `{function}`: `Refused`"
        lines.append(f"| `{function}` | `{argument}` | {takes} | {refused} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    stdout = os.dup(1)
    os.dup2(2, 1)  # whatever the imports and the stock kernels print: stderr
    try:
        sys.path.insert(0, str(REPO))
        from tools import overlay

        overlay.import_patched("guard_table.py")
        text = markdown()
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
