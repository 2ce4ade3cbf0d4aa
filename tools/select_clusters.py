# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The select at every cluster size its rows fit, against the one
``cluster_for`` picks and stock's top-k, graph-replayed: the measurement
behind the select's rule for batches past one wave. Random normal logits,
full row ends, k 512. Writes a JSON of one row a (dtype, rows, width):
``stock_us`` (vLLM's ``get_indexer_topk("auto")`` on FP32 logits, after
``as_fp32_logits`` for BF16; absent without ``--stock-topk-so``),
``picked`` (the cluster ``cluster_for`` picks) and ``us`` (cluster ->
µs, min of ``--repeats`` replays)."""

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench import K, load_kernels  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="32,64,128,256")
    p.add_argument("--widths", default="16384,65536,262144")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stock-topk-so")
    p.add_argument("--picked-only", action="store_true", help="time no other cluster")
    p.add_argument("--json", type=Path, default=Path("select-clusters.json"))
    args = p.parse_args(argv)
    load_kernels(args.stock_topk_so)
    from triton.testing import do_bench_cudagraph

    from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select import launch

    def time_us(fn):
        fn()
        torch.cuda.synchronize()
        return min(do_bench_cudagraph(fn, rep=5) for _ in range(args.repeats)) * 1e3

    sms, k, rows_out = launch.sm_count(0), 512, []
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for width in map(int, args.widths.split(",")):
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, width, device="cuda").to(dtype)
                ends = torch.full((rows,), width, dtype=torch.int32, device="cuda")
                out = torch.empty(rows, k, dtype=torch.int32, device="cuda")
                row = dict(dtype=str(dtype)[6:], rows=rows, width=width, us={})
                row["picked"] = launch.cluster_for(rows, width, dtype, sms)
                for cluster in launch.CLUSTERS:
                    capacity = launch.slice_capacity(width, dtype, cluster)
                    if not capacity or args.picked_only and cluster != row["picked"]:
                        continue
                    key = launch.SelectKernel.CompileKey(k, dtype, cluster, capacity)
                    run = functools.partial(launch.SELECT.executor(key), x, ends, out)
                    row["us"][cluster] = time_us(run)
                if args.stock_topk_so:
                    lens, max_len = ends.view(-1, 1), 4 * width

                    def stock(x=x, ends=ends, out=out, lens=lens, max_len=max_len):
                        K.stock_topk(K.as_fp32_logits(x, ends), lens, out, k, max_len)

                    row["stock_us"] = time_us(stock)
                print(json.dumps(row), flush=True)
                rows_out.append(row)
    meta = dict(gpu=torch.cuda.get_device_name(), sms=sms, torch=torch.__version__)
    args.json.write_text(json.dumps(dict(meta=meta, rows=rows_out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
