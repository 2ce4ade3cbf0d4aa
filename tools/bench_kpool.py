# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stock against specialized kpool decode kernels, in one run, as ratios.

Each figure is the median, over replays of a CUDA graph, of the time per
launch of ``--launches`` back-to-back launches captured in that graph. Inputs
of bandwidth-bound cases rotate through enough copies to exceed the L2. The
launch floor (an empty PDL kernel) and the device-to-device copy bandwidth
are measured in the same run. Runs with full vLLM or in the kernel-only
environment (``KPOOL_KERNEL_ONLY=1``, tools/kernel_env).

    python tools/bench_kpool.py --json bench.json      # then tools/plot_bench.py
"""

import argparse
import json
import os
import platform
import random
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if os.environ.get("KPOOL_KERNEL_ONLY") == "1":
    sys.path.insert(0, str(ROOT))
    from tools.kernel_env.shim import install_from_env

    install_from_env()

from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits  # noqa: E402
from vllm.models.glm5next.nvidia.ops import kpool_compress  # noqa: E402
from vllm.models.glm5next.nvidia.specialized_decode import kpool  # noqa: E402
from vllm.v1.attention.backends.mla.sparse_utils import (  # noqa: E402
    triton_convert_req_index_to_global_index,
)

DIM, POOL, GROUPS, WIDTH, BLOCK = 128, 4, 512, 2176, 64
ROWS = (1, 8, 32, 64, 128, 256)
L2_BYTES = 64 << 20
SWEEP_SIZES = [(1, 65536), (8, 16384), (8, 65536), (8, 262144), (64, 16384),
               (64, 65536), (256, 16384), (256, 262144)]  # fmt: skip


def graph_time_us(fns, launches: int, replays: int) -> float:
    """Median per-launch µs of ``launches`` calls (cycling through ``fns``)
    captured in one CUDA graph, over ``replays`` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # warm up: compile, autotune, allocate
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(launches):
                fns[i % len(fns)]()
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


# --- inputs -------------------------------------------------------------------


def update_inputs(requests: int, tokens: int, gen, device, ring=POOL, page=64):
    pages = requests * tokens // page + 2
    positions = torch.randint(0, 100_000, (requests, 1), generator=gen)
    positions = (positions + torch.arange(tokens)).to(torch.int32)
    blocks = torch.randperm(requests, generator=gen) + 1
    tail_slots = (blocks[:, None] * ring + positions % ring).to(torch.int32)
    slots = torch.full((requests, tokens), -1, dtype=torch.int32)
    completes = positions % POOL == POOL - 1
    slots[completes] = torch.randperm(pages * page, generator=gen)[
        : int(completes.sum())
    ].to(torch.int32)
    tensors = dict(
        kv_cache=torch.randint(0, 256, (pages, page, DIM + 4), dtype=torch.uint8),
        tail=torch.randn(requests + 1, 2, ring, DIM).to(torch.bfloat16),
        tail_slots=tail_slots,
        key=torch.randn(requests, tokens, DIM).to(torch.bfloat16),
        score=torch.randn(requests, tokens, DIM).to(torch.bfloat16),
        ape=torch.randn(POOL, DIM),
        slots=slots,
        positions=positions,
    )
    return {k: v.to(device) for k, v in tensors.items()}


def stock_update(t, mx):
    kpool_compress.mqa_logits_use_mx_scales = lambda: mx
    kpool_compress.kpool_decode_update_and_maybe_write_cache_batched(
        t["kv_cache"], t["tail"], t["tail_slots"], t["key"], t["score"], t["ape"],
        t["slots"], t["positions"], POOL, DIM, round_scale=True,
    )  # fmt: skip


def ours_update(t, mx):
    kpool.kpool_update(
        t["kv_cache"], t["tail"], t["tail_slots"], t["key"], t["score"], t["ape"],
        t["slots"], t["positions"], POOL, mx_scales=mx, round_scale=True,
    )  # fmt: skip


def topk_inputs(rows: int, gen, device):
    requests = rows
    max_blocks = 4096
    positions = torch.randint(10_000, max_blocks * BLOCK - 1, (rows,), generator=gen)
    pool_topk = torch.randint(0, 10_000 * BLOCK // POOL, (rows, GROUPS), generator=gen)
    pool_topk[torch.rand(rows, GROUPS, generator=gen) < 0.05] = -1
    tensors = dict(
        pool_topk=pool_topk.to(torch.int32),
        positions=positions,
        req_ids=torch.arange(rows, dtype=torch.int32),
        block_table=torch.randint(0, 50_000, (requests, max_blocks)).to(torch.int32),
        logical=torch.full((rows, WIDTH), -1, dtype=torch.int32),
        physical=torch.empty(rows + 1, WIDTH, dtype=torch.int32),
        counts=torch.empty(rows + 1, dtype=torch.int32),
    )
    return {k: v.to(device) for k, v in tensors.items()}


def stock_convert(t, rows):
    triton_convert_req_index_to_global_index(
        t["req_ids"], t["block_table"], t["logical"][:rows], BLOCK_SIZE=BLOCK,
        NUM_TOPK_TOKENS=WIDTH, return_valid_counts=True, out=t["physical"][:rows],
        valid_counts_out=t["counts"][:rows],
    )  # fmt: skip


def stock_tail(t, rows):
    """The indexer's decode tail after the update, as stock runs it."""
    t["logical"][:rows] = -1
    pool_ids = t["pool_topk"].to(torch.int64)
    seq = t["positions"].to(torch.int32) + 1
    expanded = kpool_compress.expand_pools_and_append_tail(pool_ids, seq, POOL)
    t["logical"][:rows, : expanded.shape[-1]] = expanded
    stock_convert(t, rows)


def ours_tail(t, rows):
    kpool.expand_and_remap(
        t["pool_topk"], t["positions"], POOL, t["req_ids"], t["block_table"],
        t["physical"][:rows], t["counts"][:rows], block_size=BLOCK, stride_rows=BLOCK,
    )  # fmt: skip


# --- cases --------------------------------------------------------------------


def cases(gen, device):
    """(kernel, size, stock fns, specialized fns, bytes moved or None) of every
    measured case."""
    # The decode tail runs the update this GPU's indexer would run.
    mx = torch.cuda.get_device_capability(device)[0] == 10
    for mx, name in ((True, "kpool_update (MX)"), (False, "kpool_update (FP32)")):
        for tokens in (1, 4):
            for rows in ROWS:
                t = update_inputs(rows, tokens, gen, device)
                yield (
                    name, f"{rows}x{tokens}",
                    [lambda t=t, mx=mx: stock_update(t, mx)],
                    [lambda t=t, mx=mx: ours_update(t, mx)], None,
                )  # fmt: skip
    for rows in ROWS:
        t = topk_inputs(rows, gen, device)
        seq = (t["positions"] + 1).to(torch.int32)
        out = t["logical"][:rows]
        yield (
            "expand_pools", f"{rows}x{GROUPS}",
            [lambda t=t, s=seq, o=out: kpool_compress.expand_pools_and_append_tail(
                t["pool_topk"], s, POOL, out=o)],
            [lambda t=t, s=seq, o=out: kpool.expand_pools(
                t["pool_topk"], s, POOL, out=o)], None,
        )  # fmt: skip
        yield (
            "expand_and_remap", f"{rows}x{GROUPS}",
            [lambda t=t, s=seq, o=out, r=rows: (
                kpool_compress.expand_pools_and_append_tail(
                    t["pool_topk"], s, POOL, out=o), stock_convert(t, r))],
            [lambda t=t, r=rows: ours_tail(t, r)], None,
        )  # fmt: skip
        update = update_inputs(rows, 1, gen, device)
        yield (
            "decode tail", f"{rows} rows",
            [lambda t=t, u=update, r=rows: (stock_update(u, mx), stock_tail(t, r))],
            [lambda t=t, u=update, r=rows: (ours_update(u, mx), ours_tail(t, r))],
            None,
        )  # fmt: skip
    for width in (16384, 65536, 262144):
        for rows in (1, 8, 64, 256):
            copies = max(1, min(8, L2_BYTES * 2 // (rows * width * 6)))
            sets = []
            for _ in range(copies):
                logits = torch.randn(rows, width, device=device).to(torch.bfloat16)
                ends = torch.randint(1, width + 1, (rows,), device=device)
                out = torch.empty(rows, width, device=device)
                sets.append((logits, ends.to(torch.int32), out))
            yield (
                f"upcast_logits {width // 1024}K", f"{rows} rows",
                [lambda s=s: as_fp32_logits(s[0], s[1]) for s in sets],
                [lambda s=s: kpool.upcast_logits(s[0], s[1], out=s[2]) for s in sets],
                # BF16 read plus FP32 written below the row ends.
                6 * sum(int(s[1].sum()) for s in sets) / len(sets),
            )  # fmt: skip


def upcast_sweep(args, device) -> None:
    """Times ``upcast_logits`` configurations, to pick its defaults."""
    for rows, width in SWEEP_SIZES:
        sets = []
        for _ in range(max(1, min(8, L2_BYTES * 2 // (rows * width * 6)))):
            logits = torch.randn(rows, width, device=device).to(torch.bfloat16)
            ends = torch.randint(1, width + 1, (rows,), device=device).to(torch.int32)
            sets.append((logits, ends, torch.empty(rows, width, device=device)))
        stock = graph_time_us([lambda s=s: as_fp32_logits(s[0], s[1]) for s in sets],
                              args.launches, args.replays)  # fmt: skip
        line = [f"upcast sweep {rows}x{width // 1024}K: stock {stock:.2f}"]
        for threads in (128, 256, 512):
            for unroll in (1, 2) if rows * width >= 1 << 24 else (1,):
                for cap in (1024, 4096):
                    fns = [
                        lambda s=s, t=threads, u=unroll, c=cap: kpool.upcast_logits(
                            s[0], s[1], t, True, c, unroll=u, out=s[2]
                        )
                        for s in sets
                    ]
                    us = graph_time_us(fns, args.launches, args.replays)
                    line.append(f"t{threads}/u{unroll}/c{cap} {us:.2f}")
        print(" | ".join(line), flush=True)


def launch_floor_us(launches, replays) -> float:
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute

    class Empty:
        @cute.jit
        def __call__(self, st: cuda.CUstream):
            self.kernel().launch(
                grid=(1, 1, 1), block=(32, 1, 1), stream=st, use_pdl=True
            )

        @cute.kernel
        def kernel(self):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

    st = lambda: cuda.CUstream(torch.cuda.current_stream().cuda_stream)  # noqa: E731
    compiled = cute.compile(Empty(), st())
    return graph_time_us([lambda: compiled(st())], launches, replays)


def copy_bandwidth_gbs() -> float:
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    us = graph_time_us([lambda: dst.copy_(src)], 5, 20)
    return 2 * src.numel() * src.element_size() / us / 1e3


def versions() -> dict:
    import triton

    try:
        import cutlass

        cutedsl = getattr(cutlass, "__version__", None)
        if cutedsl is None:
            from importlib.metadata import version

            cutedsl = version("nvidia-cutlass-dsl")
    except Exception as error:  # the report must not die on a version lookup
        cutedsl = f"unknown ({error})"
    driver = (
        torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
    )
    try:
        import subprocess

        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except Exception:
        pass
    return dict(
        gpu=torch.cuda.get_device_name(), driver=driver, torch=torch.__version__,
        triton=triton.__version__, cutedsl=cutedsl, python=platform.python_version(),
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=Path("bench.json"))
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--only", default="", help="substring of kernel names")
    parser.add_argument(
        "--upcast-sweep",
        action="store_true",
        help="also time upcast_logits configs (threads, unroll, cap)",
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    random.seed(0)
    meta = versions()
    meta["launch_floor_us"] = launch_floor_us(args.launches, args.replays)
    meta["copy_gbs"] = copy_bandwidth_gbs()
    rows = []
    if args.upcast_sweep:
        upcast_sweep(args, device)
    for kernel, size, stock, ours, moved in cases(gen, device):
        if args.only and args.only not in kernel:
            continue
        s = graph_time_us(stock, args.launches, args.replays)
        o = graph_time_us(ours, args.launches, args.replays)
        row = dict(kernel=kernel, size=size, stock_us=s, ours_us=o, ratio=s / o)
        if moved:
            row["ours_of_copy"] = moved / o / 1e3 / meta["copy_gbs"]
        rows.append(row)
        print(f"{kernel:24} {size:>10} stock {s:8.2f} µs ours {o:8.2f} µs x{s / o:.2f}",
              flush=True)  # fmt: skip
    args.json.write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
    print()
    print(" | ".join(f"{k} {v}" for k, v in meta.items() if "_" not in k))
    print(f"launch floor {meta['launch_floor_us']:.2f} µs, "
          f"copy {meta['copy_gbs']:.0f} GB/s (read + write)")  # fmt: skip
    print(
        f"| {'kernel':24} | {'size':>10} | stock µs | ours µs | stock/ours "
        "| of copy BW |"
    )
    print(f"|{'-' * 26}|{'-' * 12}|---------:|--------:|-----------:|-----------:|")
    for r in rows:
        share = f"{r['ours_of_copy']:.0%}" if "ours_of_copy" in r else ""
        print(f"| {r['kernel']:24} | {r['size']:>10} | {r['stock_us']:8.2f} | "
              f"{r['ours_us']:7.2f} | {r['ratio']:10.2f} | {share:>10} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
