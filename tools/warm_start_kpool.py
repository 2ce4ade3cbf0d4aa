# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cold and warm compile times of the kpool kernels, as ``KpoolStage.warmup``
compiles them for a GLM-5-Next deployment (kpool 4, 2048-token top-k in 2176
columns, 64-token pages and blocks). Run it twice: the second process reads
the CuTe DSL's file cache (``CUTE_DSL_CACHE_DIR``).

    python tools/warm_start_kpool.py   # KPOOL_KERNEL_ONLY=1 on a kernel-only box
"""

import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if os.environ.get("KPOOL_KERNEL_ONLY") == "1":
    sys.path.insert(0, str(ROOT))
    from tools.kernel_env.shim import install_from_env

    install_from_env()

from vllm.models.glm5next.nvidia.specialized_decode import kpool  # noqa: E402


def main() -> None:
    device = torch.device("cuda")
    mx = torch.cuda.get_device_capability()[0] == 10
    kv = torch.zeros(64, 64, 132, dtype=torch.uint8, device=device)
    tail = torch.zeros(65, 2, 4, 128, dtype=torch.bfloat16, device=device)
    steps = [
        *[
            (f"update ({dtype}, mx {mx})", lambda d=dtype: kpool._warm_update(
                kv, tail, d, mx, True))
            for dtype in (torch.int64, torch.int32)
        ],
        *[
            (f"expand ({dtype})", lambda d=dtype: kpool._warm_expand(512, d, device))
            for dtype in (torch.int32, torch.int64)
        ],
        *[
            (f"remap ({dtype})", lambda d=dtype: kpool._warm_remap(
                512, 2176, 64, 64, d, device))
            for dtype in (torch.int32, torch.int64)
        ],
        ("upcast", lambda: kpool._warm_upcast(device)),
    ]  # fmt: skip
    torch.cuda.synchronize()
    total = 0.0
    for name, step in steps:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        total += seconds
        print(f"compile {name:28} {seconds:6.2f} s")
    cache = os.environ.get("CUTE_DSL_CACHE_DIR", "the CuTe DSL default")
    print(f"compile total {total:6.2f} s for {len(kpool._compiled)} kernels "
          f"(file cache: {cache})")  # fmt: skip


if __name__ == "__main__":
    main()
