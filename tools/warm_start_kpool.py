# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cold and warm compile times of the kpool kernels, as the stage's JIT
warmup compiles them (``warmup.warmup_keys``: the keys each kernel derives
from arguments shaped like a layer's decode inputs) for one DSA layer of a
GLM-5-Next deployment (kpool 4, 2048-token top-k in 2176 columns, 64-token
blocks). Run it twice: the second process reads the CuTe DSL's file cache
(``CUTE_DSL_CACHE_DIR``).

    python tools/warm_start_kpool.py   # KPOOL_KERNEL_ONLY=1 on a kernel-only box
"""

import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TOPK, WIDTH, BLOCK, ROWS = 2048, 2176, 64, 256


def layer(device):
    """One DSA layer as the stage and its warmup read it: the indexer's
    caches and top-k buffer, the sparse MLA impl (the shared decode, through
    its index group) and its KV cache layout."""
    from tools.indexer import model

    buffer = torch.zeros(ROWS, WIDTH, dtype=torch.int32, device=device)
    impl = model.sparse_mla_impl("group", model.index_group(buffer, device))
    return model.dsa_layer(
        "model.layers.0.self_attn",
        impl,
        buffer,
        TOPK,
        kv=torch.zeros(64, 64, 132, dtype=torch.uint8, device=device),
        tail=torch.zeros(65, 2, 4, 128, dtype=torch.bfloat16, device=device),
        mla_kv=torch.zeros(16, BLOCK, 656, dtype=torch.uint8, device=device),
    )


def main() -> None:
    sys.path.insert(0, str(ROOT))
    if os.environ.get("KPOOL_KERNEL_ONLY") == "1":
        from tools.kernel_env.shim import install_from_env

        install_from_env()
    from vllm.models.glm5next.nvidia.specialized_decode import warmup
    from vllm.models.glm5next.nvidia.specialized_decode.stage import KpoolStage

    device = torch.device("cuda")
    attentions = [layer(device)]
    stage = KpoolStage(attentions, ROWS, device)
    keys = warmup.warmup_keys(stage, attentions)
    torch.cuda.synchronize()
    total = 0.0
    for kernel, key in keys:
        start = time.perf_counter()
        kernel.compile(key)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        total += seconds
        print(f"compile {type(kernel).__name__:20} {seconds:6.2f} s  {key}")
    cache = os.environ.get("CUTE_DSL_CACHE_DIR", "the CuTe DSL default")
    print(f"compile total {total:6.2f} s for {len(keys)} kernel variants, fused "
          f"{stage.fuse} (file cache: {cache})")  # fmt: skip


if __name__ == "__main__":
    main()
