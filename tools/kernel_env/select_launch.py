# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Three ``select_topk`` launches (k 512) on ``rows`` x ``width`` random
normals with full row ends, for a profiler to catch one (``gpu_tier.sh
--select-ncu``), on a GPU machine without vLLM (the shim); prints the
compile key:

    python3 tools/kernel_env/select_launch.py ROWS WIDTH float32|bfloat16
"""

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # the arguments first: --help imports nothing
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", type=int)
    parser.add_argument("width", type=int, help="pools a row")
    parser.add_argument("dtype", choices=("float32", "bfloat16"))
    ARGS = parser.parse_args()
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.kernel_env.shim import install_from_env  # noqa: E402

install_from_env()

import torch  # noqa: E402

from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select.launch import (  # noqa: E402
    SELECT,
)
from vllm.models.glm5next.nvidia.specialized_decode.kpool import select_topk  # noqa: E402


def main(rows: int, width: int, dtype: str) -> None:
    logits = torch.randn(rows, width, device="cuda").to(getattr(torch, dtype))
    ends = torch.full((rows,), width, dtype=torch.int32, device="cuda")
    out = torch.empty(rows, 512, dtype=torch.int32, device="cuda")
    print("key", SELECT.spec(logits=logits, ends=ends, k=512, out=out)[0])
    for _ in range(3):
        select_topk(logits, ends, 512, out=out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(ARGS.rows, ARGS.width, ARGS.dtype)
