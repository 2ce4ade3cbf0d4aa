# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stock against specialized kpool decode kernels, in one run, as ratios.

Two sections, stock and ours side by side in the same run:

- ``graph``: the median, over ``--replays`` replays of a CUDA graph, of the
  time per launch of ``--launches`` back-to-back launches captured in it.
  Bandwidth-bound inputs rotate through copies larger than the L2. Rows that
  move a known number of bytes (the fewest: each input read once, each output
  written once) give them as a share of the roofline, torch's
  device-to-device copy of 1 and 2 GiB measured in the same run. The "decode
  tail" rows are the indexer's tail after the top-k as each backend path runs
  it, captured as one graph.
- ``eager``: the wall time per call with the host included and no graph:
  ``--eager-calls`` back-to-back calls between two synchronizes, divided by
  the count (median of ``--eager-repeats``, stock and ours interleaved).

Every kernel is compiled and warmed on its shapes before any timing. Runs with
the fork installed or in the kernel-only environment (``KPOOL_KERNEL_ONLY=1``,
tools/kernel_env). ``--dry-run`` builds every input on the CPU and checks each
call against the real signatures, calling nothing on a GPU.

    python tools/bench_kpool.py --json bench.json   # ~4 min on an H200
    python tools/bench_kpool.py --quick             # ~1 min subset
    python tools/plot_bench.py bench.json bench.png
"""

import argparse
import gc
import inspect
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

DIM, POOL, GROUPS, WIDTH, BLOCK = 128, 4, 512, 2176, 64
MAX_BLOCKS = 4096
L2_BYTES = 64 << 20  # above the H200's 50 MiB; rotation sets move twice this
MAX_SETS = 16
SHORT_ENDS = (1024, 4096)
DISTS = ("full", "random", "short")
# Backend path: (MX scales in the update, conversion with counts). The H200
# runs every path's kernels; only the sm100 path's update scales are MX.
PATHS = {
    "sm100-flashinfer": (True, True),
    "sm90-flashinfer": (False, True),  # then state.pack_indices, same both sides
    "flashmla-fp8": (False, False),
}
ROOF_TARGET = 0.9  # upcast, full and random ends, from 64 rows x 64K up
EAGER_TARGET = 2.0  # eager stock/ours
EAGER_WARMUP = 20


@dataclass(frozen=True)
class Plan:
    rows: tuple = (1, 8, 32, 64, 128, 256)
    tokens: tuple = (1, 4)
    upcast_rows: tuple = (1, 8, 64, 256)
    widths: tuple = (16384, 65536, 262144)
    eager_width: int = 65536
    eager_calls: int = 300
    replays: int = 50


QUICK = Plan(
    rows=(1, 64, 256), tokens=(1,), upcast_rows=(1, 64, 256),
    widths=(65536, 262144), eager_calls=100, replays=20,
)  # fmt: skip

# The kernels, stock and ours, or signature-checking stand-ins (--dry-run).
K = types.SimpleNamespace()


# --- kernels ----------------------------------------------------------------


def load_kernels(dry: bool) -> None:
    """Fills ``K``; after argument parsing so that ``--help`` needs no vLLM."""
    if os.environ.get("KPOOL_KERNEL_ONLY") == "1":
        sys.path.insert(0, str(ROOT))
        from tools.kernel_env.shim import install_from_env

        install_from_env()
    from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
    from vllm.models.glm5next.nvidia.ops import kpool_compress
    from vllm.models.glm5next.nvidia.specialized_decode import kpool
    from vllm.v1.attention.backends.mla.sparse_utils import (
        triton_convert_req_index_to_global_index,
    )

    K.compress = kpool_compress
    K.stock_update = kpool_compress.kpool_decode_update_and_maybe_write_cache_batched
    K.stock_expand = kpool_compress.expand_pools_and_append_tail
    K.as_fp32_logits = as_fp32_logits
    K.convert = triton_convert_req_index_to_global_index
    K.kpool_update = kpool.kpool_update
    K.expand_pools = kpool.expand_pools
    K.expand_and_remap = kpool.expand_and_remap
    K.upcast_logits = kpool.upcast_logits
    if dry:
        _install_fakes()


def _fake(real, result=None, check=None):
    """A stand-in that binds its arguments to ``real``'s signature (a wrong
    keyword or arity raises as the real call would) and returns a shaped
    placeholder."""
    signature = inspect.signature(real)

    def fake(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if check is not None:
            check(signature, bound.arguments)
        return result(bound.arguments) if result is not None else None

    return fake


def _expanded(a):
    rows, groups = a["pool_ids"].shape
    cols = groups * a["pool_size"] + a["pool_size"] - 1
    out = a["out"]
    if out is None:
        return torch.full((rows, cols), -1, dtype=torch.int32)
    return out[:rows, :cols]


def _upcast(a):
    out = a.get("out")
    return torch.empty(a["logits"].shape) if out is None else out


def _converted(a):
    out = a["out"] if a["out"] is not None else torch.empty_like(a["token_indices"])
    if a["return_valid_counts"]:
        return out, a["valid_counts_out"]
    return out


def _counts_none(signature, a):
    # As the real kernel would: counts=None needs the no-counts remap.
    if a["counts"] is None and signature.parameters["counts"].default is not None:
        raise TypeError("expand_and_remap has no counts=None (no-counts) mode yet")


def _install_fakes() -> None:
    K.compress = types.SimpleNamespace()
    K.stock_update = _fake(K.stock_update)
    K.stock_expand = _fake(K.stock_expand, _expanded)
    K.as_fp32_logits = _fake(K.as_fp32_logits, lambda a: torch.empty(0))
    K.convert = _fake(K.convert, _converted)
    K.kpool_update = _fake(K.kpool_update)
    K.expand_pools = _fake(K.expand_pools, _expanded)
    K.expand_and_remap = _fake(K.expand_and_remap, check=_counts_none)
    K.upcast_logits = _fake(K.upcast_logits, _upcast)


# --- timing -----------------------------------------------------------------


class Timer:
    """CUDA graph and eager timings; under ``--dry-run`` each function runs
    once (on the CPU stand-ins) and the figures are made up."""

    def __init__(self, args, plan: Plan, device):
        self.dry, self.device = args.dry_run, device
        self.launches, self.replays = args.launches, plan.replays
        self.calls, self.repeats = plan.eager_calls, args.eager_repeats
        self.fake = random.Random(0)

    def sync(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()

    def release(self) -> None:
        """Hands a finished case's cached blocks (graph pools included) back."""
        if not self.dry:
            torch.cuda.empty_cache()

    def graph(self, fns: list[Callable]) -> tuple[float, float]:
        """(median µs per launch, spread) of ``fns`` captured in a graph."""
        if self.dry:
            for fn in fns:
                fn()
            return self.fake.uniform(1, 20), 0.0
        return median_spread(graph_time_us(fns, self.launches, self.replays))

    def eager(self, stock: Callable, ours: Callable) -> list[tuple[float, float]]:
        """(median µs per call, spread) of stock and of ours, host included."""
        if self.dry:
            stock(), ours()
            return [(self.fake.uniform(20, 60), 0.0), (self.fake.uniform(5, 30), 0.0)]
        for _ in range(EAGER_WARMUP):
            stock(), ours()
        times: tuple[list, list] = ([], [])
        for _ in range(self.repeats):  # interleaved: drift hits both sides
            times[0].append(eager_time_us(stock, self.calls))
            times[1].append(eager_time_us(ours, self.calls))
        return [median_spread(t) for t in times]


def median_spread(times: list[float]) -> tuple[float, float]:
    """The median and the spread (p90 - p10, or max - min for fewer than 10
    samples) over the median: ratios closer to 1 than this are noise."""
    middle = statistics.median(times)
    if len(times) >= 10:
        deciles = statistics.quantiles(times, n=10)
        return middle, (deciles[-1] - deciles[0]) / middle
    return middle, (max(times) - min(times)) / middle


def graph_time_us(fns, launches: int, replays: int) -> list[float]:
    """Per-launch µs of ``launches`` calls (cycling through ``fns``) captured
    in one CUDA graph, for each of ``replays`` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # warm up on the capture stream: allocations, handles
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
    return times


def eager_time_us(fn: Callable, calls: int) -> float:
    """Wall µs per call of ``calls`` back-to-back eager calls, host included."""
    gc.disable()  # a collection inside the loop would be charged to one side
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e6 / calls
    finally:
        gc.enable()


# --- inputs -----------------------------------------------------------------


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


def topk_inputs(rows: int, gen, device):
    positions = torch.randint(10_000, MAX_BLOCKS * BLOCK - 1, (rows,), generator=gen)
    pool_topk = torch.randint(0, 10_000 * BLOCK // POOL, (rows, GROUPS), generator=gen)
    pool_topk[torch.rand(rows, GROUPS, generator=gen) < 0.05] = -1
    tensors = dict(
        pool_topk=pool_topk.to(torch.int32),
        positions=positions,  # int64, as the indexer's
        req_ids=torch.arange(rows, dtype=torch.int32),
        block_table=torch.randint(0, 50_000, (rows, MAX_BLOCKS), generator=gen).to(
            torch.int32
        ),
        logical=torch.full((rows, WIDTH), -1, dtype=torch.int32),
        physical=torch.empty(rows + 1, WIDTH, dtype=torch.int32),
        counts=torch.empty(rows + 1, dtype=torch.int32),
    )
    return {k: v.to(device) for k, v in tensors.items()}


def draw_ends(rows: int, width: int, dist: str, gen) -> torch.Tensor:
    if dist == "full":
        return torch.full((rows,), width, dtype=torch.int32)
    low, high = (0, width) if dist == "random" else SHORT_ENDS
    return torch.randint(low, high + 1, (rows,), generator=gen, dtype=torch.int32)


def upcast_sets(rows, width, dist, gen, device, budget):
    """(logits, row ends, out) sets to rotate through: enough that the bytes
    they move exceed twice the L2, within ``budget`` bytes of allocations."""
    sets = []
    wanted = 1
    while len(sets) < wanted:
        ends = draw_ends(rows, width, dist, gen)
        logits = torch.randn(rows, width, device=device, dtype=torch.bfloat16)
        out = torch.empty(rows, width, device=device)
        sets.append((logits, ends.to(device), out, upcast_bytes(ends)))
        if len(sets) == 1:
            need = math.ceil(2 * L2_BYTES / max(sets[0][3], 1))
            wanted = max(1, min(MAX_SETS, need, budget // (rows * width * 6)))
    return sets


def upcast_bytes(ends: torch.Tensor) -> int:
    # BF16 read and FP32 written below each row end, the row ends read.
    return 6 * int(ends.sum()) + 4 * ends.numel()


def expand_bytes(rows: int) -> int:
    # Pool ids and int32 seq lens read, the expanded rows written.
    return 4 * rows * GROUPS + 4 * rows + 4 * rows * (GROUPS * POOL + POOL - 1)


def remap_bytes(t, rows: int) -> int:
    """Pool ids, positions, request ids and one block-table entry per distinct
    block of a row read; the physical rows and counts written."""
    ids = t["pool_topk"].cpu()
    blocks = torch.where(ids >= 0, ids * POOL // BLOCK, -1).sort(dim=1).values
    new = torch.ones_like(blocks, dtype=torch.bool)
    new[:, 1:] = blocks[:, 1:] != blocks[:, :-1]
    distinct = int((new & (blocks >= 0)).sum()) + rows  # and the tail's block
    read = 4 * rows * GROUPS + 8 * rows + 4 * rows + 4 * distinct
    return read + 4 * rows * WIDTH + 4 * rows


# --- the calls --------------------------------------------------------------


def stock_update(t, mx):
    # The stock kernel reads its scale format from this helper.
    K.compress.mqa_logits_use_mx_scales = MX_FLAG[mx]
    K.stock_update(
        t["kv_cache"], t["tail"], t["tail_slots"], t["key"], t["score"], t["ape"],
        t["slots"], t["positions"], POOL, DIM, round_scale=True,
    )  # fmt: skip


MX_FLAG = {True: lambda: True, False: lambda: False}


def ours_update(t, mx):
    K.kpool_update(
        t["kv_cache"], t["tail"], t["tail_slots"], t["key"], t["score"], t["ape"],
        t["slots"], t["positions"], POOL, mx_scales=mx, round_scale=True,
    )  # fmt: skip


def stock_convert(t, rows, counts=True):
    K.convert(
        t["req_ids"], t["block_table"], t["logical"][:rows], BLOCK_SIZE=BLOCK,
        NUM_TOPK_TOKENS=WIDTH, return_valid_counts=counts,
        out=t["physical"][:rows],
        valid_counts_out=t["counts"][:rows] if counts else None,
    )  # fmt: skip


def stock_tail(t, rows, counts=True):
    """The indexer's decode tail after the update, as stock runs it."""
    t["logical"][:rows] = -1
    pool_ids = t["pool_topk"].to(torch.int64)
    seq = t["positions"].to(torch.int32) + 1
    expanded = K.stock_expand(pool_ids, seq, POOL)
    t["logical"][:rows, : expanded.shape[-1]] = expanded
    stock_convert(t, rows, counts)


def ours_tail(t, rows, counts=True):
    K.expand_and_remap(
        t["pool_topk"], t["positions"], POOL, t["req_ids"], t["block_table"],
        t["physical"][:rows], counts=t["counts"][:rows] if counts else None,
        block_size=BLOCK, stride_rows=BLOCK,
    )  # fmt: skip


def stock_expand_remap(t, rows, seq):
    K.stock_expand(t["pool_topk"], seq, POOL, out=t["logical"][:rows])
    stock_convert(t, rows)


# --- cases ------------------------------------------------------------------


@dataclass
class Case:
    """One stock/ours pair. ``build()`` makes the inputs (lazily, so that
    ``--only`` skips them) and returns (stock fns, our fns, bytes per launch
    or None, extra JSON fields)."""

    kernel: str
    size: str
    build: Callable
    fields: dict = field(default_factory=dict)
    optional: bool = False  # may skip (a mode being added) without failing


def graph_cases(plan: Plan, gen, device, budget) -> Iterator[Case]:
    yield from update_cases(plan.rows, plan.tokens, gen, device)
    for rows in plan.rows:
        yield from topk_cases(rows, gen, device)
    for path in PATHS:
        for rows in plan.rows:
            yield tail_case(path, rows, gen, device)
    for dist in DISTS:
        for width in plan.widths:
            for rows in plan.upcast_rows:
                yield upcast_case(rows, width, dist, gen, device, budget)


def update_cases(rows_list, tokens_list, gen, device) -> Iterator[Case]:
    for mx, name in ((True, "kpool_update (MX)"), (False, "kpool_update (FP32)")):
        for tokens in tokens_list:
            for rows in rows_list:

                def build(rows=rows, tokens=tokens, mx=mx):
                    t = update_inputs(rows, tokens, gen, device)
                    return [lambda: stock_update(t, mx)], [lambda: ours_update(t, mx)]

                fields = dict(rows=rows, tokens=tokens)
                yield Case(name, f"{rows}x{tokens}", build, fields)


def topk_cases(rows: int, gen, device) -> Iterator[Case]:
    def expand():
        t = topk_inputs(rows, gen, device)
        seq, out = (t["positions"] + 1).to(torch.int32), t["logical"][:rows]
        return (
            [lambda: K.stock_expand(t["pool_topk"], seq, POOL, out=out)],
            [lambda: K.expand_pools(t["pool_topk"], seq, POOL, out=out)],
            expand_bytes(rows),
        )

    def remap():
        t = topk_inputs(rows, gen, device)
        seq = (t["positions"] + 1).to(torch.int32)
        return (
            [lambda: stock_expand_remap(t, rows, seq)],
            [lambda: ours_tail(t, rows)],
            remap_bytes(t, rows),
        )

    size = f"{rows}x{GROUPS}"
    yield Case("expand_pools", size, expand, dict(rows=rows))
    yield Case("expand_and_remap", size, remap, dict(rows=rows))


def tail_case(path: str, rows: int, gen, device) -> Case:
    """stock: update, -1 fill, int64 cast, positions + 1, expansion into a
    temporary, its copy into the top-k rows, the conversion; ours: update and
    the fused expand + remap. Both as one graph."""
    mx, counts = PATHS[path]

    def build():
        t = topk_inputs(rows, gen, device)
        u = update_inputs(rows, 1, gen, device)
        return (
            [lambda: (stock_update(u, mx), stock_tail(t, rows, counts))],
            [lambda: (ours_update(u, mx), ours_tail(t, rows, counts))],
        )

    fields = dict(rows=rows, path=path)
    return Case(f"decode tail {path}", f"{rows} rows", build, fields, not counts)


def upcast_case(rows, width, dist, gen, device, budget) -> Case:
    def build():
        sets = upcast_sets(rows, width, dist, gen, device, budget)
        extra = dict(sets=len(sets), footprint=sum(s[3] for s in sets))
        return (
            [lambda s=s: K.as_fp32_logits(s[0], s[1]) for s in sets],
            [lambda s=s: K.upcast_logits(s[0], s[1], out=s[2]) for s in sets],
            statistics.mean(s[3] for s in sets),
            extra,
        )

    fields = dict(rows=rows, width=width, dist=dist)
    return Case(f"upcast_logits {dist}", f"{rows}x{width // 1024}K", build, fields)


def eager_cases(plan: Plan, gen, device) -> Iterator[Case]:
    """Every kernel alone, as the indexer calls it eagerly (ours allocates its
    upcast output as stock does), and the sm100 decode tail."""
    yield from update_cases(plan.rows, (1,), gen, device)
    for rows in plan.rows:
        yield from topk_cases(rows, gen, device)
    width = plan.eager_width
    for rows in plan.rows:

        def upcast(rows=rows):
            logits = torch.randn(rows, width, device=device, dtype=torch.bfloat16)
            ends = draw_ends(rows, width, "random", gen).to(device)
            return (
                [lambda: K.as_fp32_logits(logits, ends)],
                [lambda: K.upcast_logits(logits, ends)],
            )

        fields = dict(rows=rows, width=width, dist="random")
        yield Case("upcast_logits random", f"{rows}x{width // 1024}K", upcast, fields)
    for rows in plan.rows:
        yield tail_case("sm100-flashinfer", rows, gen, device)


# --- running ----------------------------------------------------------------


def run_case(case: Case, section: str, timer: Timer, copy_gbs: float) -> dict:
    row = dict(section=section, kernel=case.kernel, size=case.size, **case.fields)
    head = f"{section:5} {case.kernel:30} {case.size:>9}"
    try:
        row.update(measure(case, section, timer, copy_gbs))
    except Exception as error:  # the run goes on; the summary lists it
        reason = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        print(f"{head} skipped: {reason}", flush=True)
        return dict(row, skipped=reason, optional=case.optional)
    finally:
        timer.release()
    s, o = row["stock_us"], row["ours_us"]
    roof = f" {row['ours_roof']:5.0%} of copy" if "ours_roof" in row else ""
    print(f"{head} stock {s:8.2f} µs ours {o:8.2f} µs x{s / o:5.2f}{roof}", flush=True)
    return row


def measure(case: Case, section: str, timer: Timer, copy_gbs: float) -> dict:
    stock, ours, *rest = case.build()
    for fn in (*stock, *ours):  # compile and warm every shape, untimed
        fn()
    timer.sync()
    if section == "graph":
        (s, s_spread), (o, o_spread) = timer.graph(stock), timer.graph(ours)
    else:
        (s, s_spread), (o, o_spread) = timer.eager(stock[0], ours[0])
    row = dict(rest[1] if len(rest) > 1 else {}, stock_us=s, ours_us=o)
    row.update(ratio=s / o, stock_spread=s_spread, ours_spread=o_spread)
    # Bytes over an eager wall time would measure the host: graph rows only.
    if rest and rest[0] and section == "graph":
        row.update(roofline(rest[0], s, o, copy_gbs))
    return row


def roofline(moved: float, stock_us: float, ours_us: float, copy_gbs: float):
    stock_gbs, ours_gbs = moved / stock_us / 1e3, moved / ours_us / 1e3
    return dict(
        bytes=moved, stock_gbs=stock_gbs, ours_gbs=ours_gbs,
        stock_roof=stock_gbs / copy_gbs, ours_roof=ours_gbs / copy_gbs,
    )  # fmt: skip


def copy_roofline(timer: Timer, sizes) -> dict:
    """torch's device-to-device copy (bytes read + written per second), graph
    replayed and event timed; the best is the roofline."""
    figures = {}
    for size in sizes:
        figures.update(copy_figures(timer, size))
    if not timer.dry:
        torch.cuda.empty_cache()
    figures["copy_gbs"] = max(figures.values())
    return figures


def copy_figures(timer: Timer, size: int) -> dict:
    src = torch.randn(size // 4, device=timer.device)
    dst = torch.empty_like(src)
    tag = f"{size / (1 << 30):g}GiB"
    us = timer.graph([lambda: dst.copy_(src)])[0]
    figures = {f"{tag}_graph_gbs": 2 * size / us}
    if not timer.dry:
        figures[f"{tag}_event_gbs"] = 2 * size / event_time_us(dst, src)
    return {k: v / 1e3 for k, v in figures.items()}


def event_time_us(dst, src, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        start, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def upcast_sweep(timer: Timer, device, budget, copy_gbs: float) -> None:
    """Times the upcast kernel with each bound on its CTAs, for each row-end
    distribution, against stock and as % of the copy, to choose
    ``upcast_config``. Prints one line per shape and distribution."""
    from vllm.models.glm5next.nvidia.specialized_decode import upcast_kernel as U

    sizes = [(1, 65536), (8, 65536), (8, 262144), (32, 65536), (64, 16384),
             (64, 65536), (64, 262144), (128, 65536), (128, 262144), (256, 16384),
             (256, 65536), (256, 262144)]  # fmt: skip
    bounds = (256, 384, 512, 768, 1024)
    key = U.UPCAST_LAUNCH[0]
    gen = torch.Generator().manual_seed(1)
    for dist in DISTS:
        for rows, width in sizes:
            sets = upcast_sets(rows, width, dist, gen, device, budget)
            moved = sum(s[3] for s in sets) / len(sets)
            stock = timer.graph(
                [lambda s=s: K.as_fp32_logits(s[0], s[1]) for s in sets]
            )[0]
            timed = []
            for ctas in bounds:
                fns = [
                    lambda s=s, c=ctas: U.UPCAST.run(key, s[0], s[2], s[1], c)
                    for s in sets
                ]
                timed.append((timer.graph(fns)[0], ctas))
            timed.sort()
            best = timed[0]
            cur = next(t for t in timed if t[1] == U.upcast_config(rows, width))
            pct = 100 * moved / (best[0] * 1e3) / copy_gbs
            print(
                f"sweep {dist} {rows}x{width // 1024}K: stock {stock:.2f} | best "
                f"c{best[1]} {best[0]:.2f} ({pct:.0f}% copy) | "
                f"current {cur[0]:.2f} | "
                + " ".join(f"c{c}:{us:.2f}" for us, c in timed),
                flush=True,
            )


def launch_floor_us(timer: Timer) -> float | None:
    if timer.dry:
        return None
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
    return timer.graph([lambda: compiled(st())])[0]


def versions(dry: bool) -> dict:
    import triton

    driver = None
    try:
        import subprocess

        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except Exception:  # the report must not die on a version lookup
        pass
    return dict(
        gpu="dry run (CPU)" if dry else torch.cuda.get_device_name(), driver=driver,
        torch=torch.__version__, triton=triton.__version__, cutedsl=cutedsl_version(),
        python=platform.python_version(),
    )  # fmt: skip


def cutedsl_version() -> str:
    try:
        import cutlass

        found = getattr(cutlass, "__version__", None)
        if found is None:
            from importlib.metadata import version

            found = version("nvidia-cutlass-dsl")
        return str(found)
    except Exception as error:  # the report must not die on a version lookup
        return f"unknown ({error})"


# --- report -----------------------------------------------------------------


def target_misses(rows: list[dict]) -> list[str]:
    """Lines naming every measured row that misses a target."""
    done = [r for r in rows if "skipped" not in r]
    slower = [r for r in done if r["section"] == "graph" and r["ratio"] < 1]
    roof = [
        r for r in done
        if r["section"] == "graph" and r.get("dist") in ("full", "random")
        and r["rows"] >= 64 and r["width"] >= 65536 and r["ours_roof"] < ROOF_TARGET
    ]  # fmt: skip
    eager = [r for r in done if r["section"] == "eager" and r["ratio"] < EAGER_TARGET]

    def names(rs, figure):
        return ", ".join(f"{r['kernel']} {r['size']} ({figure(r)})" for r in rs)

    def ratio(r):  # with the larger side's spread: a miss within it is noise
        return f"x{r['ratio']:.2f} ±{max(r['stock_spread'], r['ours_spread']):.0%}"

    return [
        "graph, ours at least as fast as stock: " + (names(slower, ratio) or "met"),
        f"upcast (full, random ends; >= 64 rows x 64K) >= {ROOF_TARGET:.0%} of copy: "
        + (names(roof, lambda r: f"{r['ours_roof']:.0%}") or "met"),
        f"eager, stock/ours >= {EAGER_TARGET:g}: " + (names(eager, ratio) or "met"),
    ]


def markdown(rows: list[dict], meta: dict) -> str:
    names = ("gpu", "driver", "torch", "triton", "cutedsl")
    copies = [f"{k[:-4]} {v:.0f}" for k, v in meta["copy"].items() if k != "copy_gbs"]
    lines = [
        " | ".join(f"{k} {meta[k]}" for k in names),
        (
            f"launch floor {meta['launch_floor_us'] or 0:.2f} µs; roofline: copy "
            f"{meta['copy_gbs']:.0f} GB/s, read + write ({', '.join(copies)})"
        ),
    ]
    lines += [f"- {m}" for m in target_misses(rows)]
    lines += [f"- skipped: {m}" for m in skipped(rows)]
    graph = [table_row(r, True) for r in rows if r["section"] == "graph"]
    if any(graph):
        lines += ["", "| CUDA graph, µs per launch | size | stock | ours | "]
        lines[-1] += "stock/ours | stock % roof | ours % roof |"
        lines += ["|---|---|--:|--:|--:|--:|--:|", *graph]
    eager = [table_row(r, False) for r in rows if r["section"] == "eager"]
    if any(eager):
        lines += ["", "| eager, µs per call | size | stock | ours | stock/ours |"]
        lines += ["|---|---|--:|--:|--:|", *eager]
    return "\n".join(line for line in lines if line is not None)


def skipped(rows: list[dict]) -> list[str]:
    """One line per kernel and reason, with the sizes it skipped."""
    grouped: dict = {}
    for r in rows:
        if "skipped" in r:
            key = (r["section"], r["kernel"], r["skipped"])
            grouped.setdefault(key, []).append(r["size"])
    return [f"{s} {k} ({', '.join(sizes)}): {why}" for (s, k, why), sizes in
            grouped.items()]  # fmt: skip


def table_row(r: dict, roofs: bool) -> str | None:
    if "skipped" in r:
        return None
    line = f"| {r['kernel']} | {r['size']} | {r['stock_us']:.2f} | "
    line += f"{r['ours_us']:.2f} | {r['ratio']:.2f} |"
    if roofs:
        line += "".join(
            f" {r[k]:.0%} |" if k in r else " |" for k in ("stock_roof", "ours_roof")
        )
    return line


# --- main -------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--json", type=Path, default=Path("bench.json"))
    add("--md", type=Path, help="markdown summary (default: the JSON path, .md)")
    add("--quick", action="store_true", help="a ~1 minute subset")
    add("--dry-run", action="store_true", help="CPU stand-ins; touches no GPU")
    add("--launches", type=int, default=20, help="launches per CUDA graph")
    add("--replays", type=int, help="graph replays (default 50, --quick 20)")
    add("--eager-calls", type=int, help="calls per timing (300, --quick 100)")
    add("--eager-repeats", type=int, default=3, help="eager timings, median")
    add("--sections", default="graph,eager", help="comma-separated")
    add("--only", default="", help="substring of kernel names")
    add("--mem-gib", type=float, default=6.0, help="upcast rotation sets' cap")
    add("--upcast-sweep", action="store_true", help="time upcast_logits configs")
    return parser.parse_args()


def make_plan(args) -> Plan:
    plan = QUICK if args.quick else Plan()
    overrides = dict(replays=args.replays, eager_calls=args.eager_calls)
    return Plan(**{**vars(plan), **{k: v for k, v in overrides.items() if v}})


def main() -> int:
    args = parse_args()
    load_kernels(args.dry_run)
    plan = make_plan(args)
    device = torch.device("cpu" if args.dry_run else "cuda")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    timer = Timer(args, plan, device)
    # Stand-ins allocate on the CPU: keep the rotation sets small there.
    budget = int((0.25 if args.dry_run else args.mem_gib) * (1 << 30))
    started = time.perf_counter()
    meta = versions(args.dry_run)
    meta["launch_floor_us"] = launch_floor_us(timer)
    sizes = (1 << 20, 2 << 20) if args.dry_run else (1 << 30, 2 << 30)
    meta["copy"] = copy_roofline(timer, sizes)
    meta["copy_gbs"] = meta["copy"]["copy_gbs"]
    meta["plan"] = vars(plan) | dict(launches=args.launches, quick=args.quick)
    if args.upcast_sweep:  # a tuning run: the sweep alone
        upcast_sweep(timer, device, budget, meta["copy_gbs"])
        return 0
    sections = dict(
        graph=lambda: graph_cases(plan, gen, device, budget),
        eager=lambda: eager_cases(plan, gen, device),
    )
    rows = []
    for section in args.sections.split(","):
        for case in sections[section]():
            if args.only in case.kernel:
                rows.append(run_case(case, section, timer, meta["copy_gbs"]))
    meta["wall_s"] = time.perf_counter() - started
    args.json.write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
    summary = markdown(rows, meta)
    (args.md or args.json.with_suffix(".md")).write_text(summary + "\n")
    print(f"\nwrote {args.json}; {meta['wall_s']:.0f} s\n")
    print(summary)
    failed = [r for r in rows if "skipped" in r and not r["optional"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
