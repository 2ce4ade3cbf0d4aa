# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cold and warm compile times of the kpool kernels, as the stage's JIT
warmup compiles them (the stage's kernels' ``get_warmup_keys``) for one DSA layer of
a GLM-5-Next deployment (kpool 4, 2048-token top-k in 2176 columns, 64-token
blocks, 256 decode rows), on this GPU (without one: for ``CUTE_DSL_ARCH``,
default ``sm_90a``). Run it twice: the second process reads the CuTe DSL's
file cache (``CUTE_DSL_CACHE_DIR``).

    python tools/warm_start_kpool.py   # KPOOL_KERNEL_ONLY=1 without vLLM
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--select", action="store_true", help="with the select")
    parser.add_argument("--mx", action="store_true", help="MX scales (default: SM100)")
    args = parser.parse_args()
    from tools.indexer_steps import setup

    setup(cpu=False)
    import indexer_sim as sim
    import pytest
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    mx = args.mx or sim.deep_gemm.mqa_logits_use_mx_scales()  # as install() reads it
    geo = sim.Geometry(layers=1, max_tokens=256, max_reqs=64, mla_block_rows=64)
    backend = sim.BACKENDS["sm100" if mx else "flashinfer_sm90"]
    model = sim.Model(sim.Sim(geo, backend, device, 0), "stage")
    with pytest.MonkeyPatch.context() as patch:
        if not cuda:
            patch.setattr(sim.stage_module, "sm_count", lambda index: 132)
        stage = sim.stage_module.KpoolStage(
            model.attentions,
            geo.capacity,
            device,
            mx_scales=mx,
            select=args.select,
        )
    keys = [(k, key) for k in stage.kernels for key in k.get_warmup_keys()]
    total = 0.0
    for kernel, key in keys:
        start = time.perf_counter()
        kernel.compile(key)
        seconds = time.perf_counter() - start
        total += seconds
        print(f"compile {type(kernel).__name__:14} {seconds:6.2f} s  {key}")
    cache = os.environ.get("CUTE_DSL_CACHE_DIR", "the CuTe DSL default")
    print(
        f"compile total {total:6.2f} s for {len(keys)} kernel variants on {device}, "
        f"fused {stage.fuse} (file cache: {cache})"
    )


if __name__ == "__main__":
    main()
