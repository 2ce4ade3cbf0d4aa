# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM 0.33.0's own decode top-k on the GPU, from the pinned wheel's binary:
``torch.ops.load_library`` of its ``vllm/_C_stable_libtorch.abi3.so`` (the
path in ``KPOOL_STOCK_TOPK_SO``; it uses only stable-ABI symbols, so it
loads on the GPU machine's torch) registers ``torch.ops._C.cooperative_topk``
and ``persistent_topk``.

``StockTopk`` is ``get_indexer_topk("auto")`` as 0.33.0 resolves it for
GLM-5-Next's decode (``indexer_topk.py``): ``cooperative_topk`` up to
``AUTO_COOPERATIVE_MAX_ROWS`` rows, else ``persistent_topk``, each called as
``op(logits, seq_lens.reshape(-1), out, workspace, k, max_seq_len)`` with a
uint8 workspace of ``RADIX_TOPK_WORKSPACE_SIZE`` bytes. FP32 logits only.

``python3 tools/kernel_env/stock_topk.py [SO]`` loads the binary and prints
the ops it registered (a check that it loads beside the machine's torch)."""

import argparse
import os
import sys

import torch

ENV = "KPOOL_STOCK_TOPK_SO"
OPS = ("cooperative_topk", "persistent_topk")
AUTO_COOPERATIVE_MAX_ROWS = 64
RADIX_TOPK_WORKSPACE_SIZE = 1024 * 1024


def load(path: str | None = None) -> bool:
    """Loads the ops from ``path`` (default: ``KPOOL_STOCK_TOPK_SO``) once;
    False where no path is given."""
    path = path or os.environ.get(ENV)
    if not path:
        return False
    if not hasattr(torch.ops._C, "cooperative_topk"):
        torch.ops.load_library(path)
    return True


class StockTopk:
    """``op(logits, seq_lens, out, k, max_seq_len)``: the top ``k`` columns
    of each row below its length into ``out`` (int32 [rows, k]), by ``op``
    ("cooperative" or "persistent"; None: as "auto" picks by the rows)."""

    def __init__(self, device, op: str | None = None):
        self.op = op
        self.workspace = torch.empty(
            RADIX_TOPK_WORKSPACE_SIZE, dtype=torch.uint8, device=device
        )

    def __call__(self, logits, seq_lens, out, k: int, max_seq_len: int):
        op = self.op or (
            "cooperative"
            if logits.shape[0] <= AUTO_COOPERATIVE_MAX_ROWS
            else "persistent"
        )
        getattr(torch.ops._C, f"{op}_topk")(
            logits, seq_lens.reshape(-1), out, self.workspace, k, max_seq_len
        )
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "so", nargs="?", help=f"the wheel's _C_stable_libtorch.abi3.so (default: {ENV})"
    )
    args = parser.parse_args(argv)
    if not load(args.so):
        parser.error(f"no binary: give SO or set {ENV}")
    ops = [op for op in OPS if hasattr(torch.ops._C, op)]
    print(f"{args.so or os.environ[ENV]}: torch.ops._C {', '.join(ops) or 'none'}")
    return 0 if len(ops) == len(OPS) else 1


if __name__ == "__main__":
    sys.exit(main())
