# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Three launches of the select's auto key on ``rows`` x ``width`` random
normals with full row ends, for a profiler to catch one (select_gpu.sh's
ncu part), in the kernel-only environment:

    python3 tools/kernel_env/select_launch.py ROWS WIDTH float32|bfloat16
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.kernel_env.shim import install_from_env  # noqa: E402

install_from_env()

import torch  # noqa: E402

from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import (  # noqa: E402
    SELECT,
    SelectArgs,
)


def main(rows: int, width: int, dtype: str) -> None:
    logits = torch.randn(rows, width, device="cuda").to(getattr(torch, dtype))
    ends = torch.full((rows,), width, dtype=torch.int32, device="cuda")
    out = torch.empty(rows, 512, dtype=torch.int32, device="cuda")
    args = SelectArgs(logits, ends, 512, out)
    print("key", SELECT.key_for(args))
    for _ in range(3):
        SELECT.run(args)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
