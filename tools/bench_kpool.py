# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stock against specialized kpool decode kernels, in one run, as ratios.

Two sections, stock and ours side by side in the same run:

- ``graph``: ``triton.testing.do_bench_cudagraph`` of each side: a CUDA graph
  of back-to-back calls (as many as fill ``--graph-ms``), per call, the median
  over its replays. Bandwidth-bound inputs rotate through copies larger than
  the L2, one copy a call inside the graph. Rows that move a known number of
  bytes (the fewest: each input read once, each output written once) give
  them as a share of the roofline, torch's device-to-device copy of 1 and
  2 GiB measured in the same run. The "decode tail" rows are the indexer's
  tail after the top-k as each backend path runs it, a call the whole tail.
- ``eager``: the wall time per call with the host included and no graph:
  ``torch.utils.benchmark.Timer.timeit`` of ``--eager-calls`` back-to-back
  calls between two synchronizes, ``--eager-repeats`` times a side with stock
  and ours alternated, the median per call.

Each figure comes with its spread, the interquartile range over the median:
ratios closer to 1 than that are noise. Every kernel is compiled and warmed
on its shapes before any timing. Runs with the fork installed or in the
kernel-only environment (``KPOOL_KERNEL_ONLY=1``, tools/kernel_env). The JSON
and the markdown name the commit (``--commit``, else git's HEAD) and the date.
A case that raises prints its traceback and makes the run exit 1.

    python tools/bench_kpool.py --json bench.json   # about a minute on an H200
    python tools/bench_kpool.py --quick             # a subset, faster
    python tools/plot_bench.py bench.json bench.png
"""

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.utils.benchmark as torch_benchmark
import triton.testing

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
SECTIONS = ("graph", "eager")
DEVICE = torch.device("cuda")

# (median µs per call, interquartile range over the median)
Figure = tuple[float, float]


@dataclass(frozen=True)
class Plan:
    """The shapes a run times and how long it times each."""

    rows: tuple = (1, 8, 32, 64, 128, 256)
    tokens: tuple = (1, 4)
    upcast_rows: tuple = (1, 8, 64, 256)
    widths: tuple = (16384, 65536, 262144)
    eager_width: int = 65536
    eager_calls: int = 300
    eager_repeats: int = 11
    # do_bench_cudagraph's rep: each replay averages hundreds of calls even at
    # 5 ms; its default of 20 would make the run four times as long.
    graph_ms: float = 5.0


QUICK = Plan(
    rows=(1, 64, 256), tokens=(1,), upcast_rows=(1, 64, 256),
    widths=(65536, 262144), eager_calls=100, eager_repeats=5, graph_ms=2.0,
)  # fmt: skip

# The kernels, stock and ours (``load_kernels``).
K = types.SimpleNamespace()


# --- kernels ----------------------------------------------------------------


def load_kernels() -> None:
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


# --- timing -----------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """The run's two timers, each giving a ``Figure`` per callable."""

    graph_ms: float
    eager_calls: int
    eager_repeats: int

    def graph(self, fns: list[Callable]) -> Figure:
        return graph_figure(fns, self.graph_ms)

    def eager(self, stock: Callable, ours: Callable) -> list[Figure]:
        return eager_figures([stock, ours], self.eager_calls, self.eager_repeats)


def rotating(fns: list[Callable]) -> Callable:
    """One callable that calls ``fns`` in turn, one per call: captured in a
    graph, consecutive launches read different input sets."""
    turn = itertools.cycle(fns)
    return lambda: next(turn)()


def graph_figure(fns: list[Callable], rep_ms: float) -> Figure:
    """``do_bench_cudagraph`` of ``rotating(fns)``: the graph it captures
    holds as many calls as ``rep_ms`` of them take, cycling through ``fns``,
    and each replay's time is divided by that count, so the figure is per
    call (per launch where a call is one kernel)."""
    low, median, high = triton.testing.do_bench_cudagraph(
        rotating(fns), rep=rep_ms, quantiles=[0.25, 0.5, 0.75]
    )
    return median * 1e3, (high - low) / median


def eager_figures(fns: list[Callable], calls: int, repeats: int) -> list[Figure]:
    """Wall time per call of each of ``fns``, host included: ``repeats``
    ``Timer.timeit(calls)`` (``calls`` back-to-back calls between two
    synchronizes, after a few untimed ones, garbage collection off) per
    callable, the callables alternated so that drift hits each alike; the
    median and IQR over the repeats."""
    timers = [torch_benchmark.Timer("fn()", globals=dict(fn=fn)) for fn in fns]
    runs: list[list] = [[] for _ in fns]
    for _ in range(repeats):
        for timer, run in zip(timers, runs, strict=True):
            run.append(timer.timeit(calls))
    return [measurement_figure(run) for run in runs]


def measurement_figure(run: list) -> Figure:
    merged = torch_benchmark.Measurement.merge(run)[0]  # times per call
    return merged.median * 1e6, merged.iqr / merged.median


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def release() -> None:
    """Hands a finished case's cached blocks (graph pools included) back."""
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


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
    ``--only`` skips them) and returns (stock fns, our fns, bytes per call
    or None, extra JSON fields); more than one fn a side are input sets the
    graph timing rotates through."""

    kernel: str
    size: str
    build: Callable
    fields: dict = field(default_factory=dict)


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
    the fused expand + remap. A call is the whole tail."""
    mx, counts = PATHS[path]

    def build():
        t = topk_inputs(rows, gen, device)
        u = update_inputs(rows, 1, gen, device)
        return (
            [lambda: (stock_update(u, mx), stock_tail(t, rows, counts))],
            [lambda: (ours_update(u, mx), ours_tail(t, rows, counts))],
        )

    fields = dict(rows=rows, path=path)
    return Case(f"decode tail {path}", f"{rows} rows", build, fields)


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


def run_cases(plan: Plan, sections, only: str, timing: Timing, copy_gbs, budget):
    """One result row per case of ``sections`` whose kernel name holds
    ``only``, in order; a case that raised gives a row with ``error``."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    cases = dict(
        graph=lambda: graph_cases(plan, gen, DEVICE, budget),
        eager=lambda: eager_cases(plan, gen, DEVICE),
    )
    rows = []
    for section in sections:
        for case in cases[section]():
            if only in case.kernel:
                rows.append(run_case(case, section, timing, copy_gbs))
    return rows


def run_case(case: Case, section: str, timing: Timing, copy_gbs: float) -> dict:
    row = dict(section=section, kernel=case.kernel, size=case.size, **case.fields)
    head = f"{section:5} {case.kernel:30} {case.size:>9}"
    try:
        row.update(measure(case, section, timing, copy_gbs))
    except Exception as error:  # the run goes on, then exits 1 (``main``)
        traceback.print_exc()
        reason = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        print(f"{head} FAILED: {reason}", flush=True)
        return dict(row, error=reason)
    finally:
        release()
    s, o = row["stock_us"], row["ours_us"]
    roof = f" {row['ours_roof']:5.0%} of copy" if "ours_roof" in row else ""
    print(f"{head} stock {s:8.2f} µs ours {o:8.2f} µs x{s / o:5.2f}{roof}", flush=True)
    return row


def measure(case: Case, section: str, timing: Timing, copy_gbs: float) -> dict:
    stock, ours, *rest = case.build()
    for fn in (*stock, *ours):  # compile and warm every shape, untimed
        fn()
    synchronize()
    if section == "graph":
        (s, s_spread), (o, o_spread) = timing.graph(stock), timing.graph(ours)
    else:
        (s, s_spread), (o, o_spread) = timing.eager(stock[0], ours[0])
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


# --- the machine ------------------------------------------------------------


def machine_meta(timing: Timing) -> dict:
    """Versions, the launch floor and the copy roofline, on the GPU."""
    meta = versions()
    meta["launch_floor_us"] = launch_floor_us(timing)
    meta["copy"] = copy_roofline(timing, (1 << 30, 2 << 30))
    meta["copy_gbs"] = meta["copy"]["copy_gbs"]
    return meta


def copy_roofline(timing: Timing, sizes) -> dict:
    """torch's device-to-device copy (bytes read + written per second), graph
    replayed and event timed; the best is the roofline."""
    figures = {}
    for size in sizes:
        figures.update(copy_figures(timing, size))
    release()
    figures["copy_gbs"] = max(figures.values())
    return figures


def copy_figures(timing: Timing, size: int) -> dict:
    """GB/s of one copy of ``size`` bytes, in a graph and alone (each call
    event-timed after an L2 flush: ``triton.testing.do_bench``)."""
    src = torch.randn(size // 4, device=DEVICE)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)
    tag = f"{size / (1 << 30):g}GiB"
    graph_us = timing.graph([copy])[0]
    event_us = triton.testing.do_bench(copy, return_mode="median") * 1e3
    return {f"{tag}_graph_gbs": 2 * size / graph_us / 1e3,
            f"{tag}_event_gbs": 2 * size / event_us / 1e3}  # fmt: skip


def launch_floor_us(timing: Timing) -> float:
    """An empty one-warp CuTe DSL kernel with PDL, per launch in a graph."""
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

    st = lambda: cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    compiled = cute.compile(Empty(), st())
    return timing.graph([lambda: compiled(st())])[0]


def versions() -> dict:
    return dict(
        gpu=torch.cuda.get_device_name(), driver=driver_version(),
        torch=torch.__version__, triton=triton.__version__,
        cutedsl=cutedsl_version(), python=platform.python_version(),
    )  # fmt: skip


def driver_version() -> str | None:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):  # the report goes on without
        return None


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


def stamp(commit: str | None) -> dict:
    """What a run measured: ``commit``, else git's short HEAD where this tree
    is a checkout, else "unknown"; and when, in UTC."""
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return dict(commit=commit or git_head() or "unknown", date=now)


def git_head() -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):  # no git, or no .git here
        return None
    return done.stdout.strip() or None


# --- report -----------------------------------------------------------------


def target_misses(rows: list[dict]) -> list[str]:
    """One line per target: "met" only where every row it covers was
    measured and none misses it; else the misses and the rows that failed,
    or "not measured" where the run covered none."""

    def graph(r):
        return r["section"] == "graph"

    def roof_rows(r):
        return (
            graph(r) and r.get("dist") in ("full", "random")
            and r["rows"] >= 64 and r["width"] >= 65536
        )  # fmt: skip

    def ratio(r):  # with the larger side's spread: a miss within it is noise
        return f"x{r['ratio']:.2f} ±{max(r['stock_spread'], r['ours_spread']):.0%}"

    return [
        verdict("graph, ours at least as fast as stock", rows, graph,
                lambda r: r["ratio"] < 1, ratio),
        verdict(f"upcast (full, random ends; >= 64 rows x 64K) >= "
                f"{ROOF_TARGET:.0%} of copy", rows, roof_rows,
                lambda r: r["ours_roof"] < ROOF_TARGET,
                lambda r: f"{r['ours_roof']:.0%}"),
        verdict(f"eager, stock/ours >= {EAGER_TARGET:g}", rows,
                lambda r: r["section"] == "eager",
                lambda r: r["ratio"] < EAGER_TARGET, ratio),
    ]  # fmt: skip


def verdict(target: str, rows, covers, misses, figure) -> str:
    covered = [r for r in rows if covers(r)]
    failed = [r for r in covered if "error" in r]
    missed = [r for r in covered if "error" not in r and misses(r)]
    if not covered:
        return f"{target}: not measured"
    parts = []
    if missed:
        parts.append(
            "missed by " + ", ".join(f"{name(r)} ({figure(r)})" for r in missed)
        )
    if failed:
        parts.append(f"unknown, {len(failed)} failed: " + ", ".join(map(name, failed)))
    return f"{target}: " + ("; ".join(parts) or "met")


def name(r: dict) -> str:
    return f"{r['kernel']} {r['size']}"


def markdown(rows: list[dict], meta: dict) -> str:
    names = ("gpu", "driver", "torch", "triton", "cutedsl")
    copies = [f"{k[:-4]} {v:.0f}" for k, v in meta["copy"].items() if k != "copy_gbs"]
    lines = [
        f"commit {meta['commit']}, {meta['date']}",
        "",
        " | ".join(f"{k} {meta[k]}" for k in names),
        (
            f"launch floor {meta['launch_floor_us']:.2f} µs; roofline: copy "
            f"{meta['copy_gbs']:.0f} GB/s, read + write ({', '.join(copies)})"
        ),
        "",
    ]
    lines += [f"- {m}" for m in target_misses(rows)]
    lines += [f"- FAILED: {m}" for m in failures(rows)]
    graph = [table_row(r, True) for r in rows if r["section"] == "graph"]
    if any(graph):
        lines += ["", "| CUDA graph, µs per call | size | stock | ours | "]
        lines[-1] += "stock/ours | stock % roof | ours % roof |"
        lines += ["|---|---|--:|--:|--:|--:|--:|", *graph]
    eager = [table_row(r, False) for r in rows if r["section"] == "eager"]
    if any(eager):
        lines += ["", "| eager, µs per call | size | stock | ours | stock/ours |"]
        lines += ["|---|---|--:|--:|--:|", *eager]
    return "\n".join(line for line in lines if line is not None)


def failures(rows: list[dict]) -> list[str]:
    """One line per kernel and error, with the sizes it failed at."""
    grouped: dict = {}
    for r in rows:
        if "error" in r:
            key = (r["section"], r["kernel"], r["error"])
            grouped.setdefault(key, []).append(r["size"])
    return [f"{s} {k} ({', '.join(sizes)}): {why}" for (s, k, why), sizes in
            grouped.items()]  # fmt: skip


def table_row(r: dict, roofs: bool) -> str | None:
    if "error" in r:
        return None
    line = f"| {r['kernel']} | {r['size']} | {r['stock_us']:.2f} | "
    line += f"{r['ours_us']:.2f} | {r['ratio']:.2f} |"
    if roofs:
        line += "".join(
            f" {r[k]:.0%} |" if k in r else " |" for k in ("stock_roof", "ours_roof")
        )
    return line


def write_report(rows: list[dict], meta: dict, json_path: Path, md_path: Path):
    """The JSON (``meta`` and the result rows) and its markdown summary;
    returns the summary."""
    json_path.write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
    summary = markdown(rows, meta)
    md_path.write_text(summary + "\n")
    return summary


# --- main -------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--json", type=Path, default=Path("bench.json"))
    add("--md", type=Path, help="markdown summary (default: the JSON path, .md)")
    add("--commit", help="the commit measured (default: git rev-parse --short HEAD)")
    add("--quick", action="store_true", help="a subset of the shapes, faster")
    add("--graph-ms", type=float, help="ms of calls per graph (5, --quick 2)")
    add("--eager-calls", type=int, help="calls per eager timing (300, --quick 100)")
    add("--eager-repeats", type=int, help="eager timings a side (11, --quick 5)")
    add("--sections", default=",".join(SECTIONS), help="comma-separated")
    add("--only", default="", help="substring of kernel names")
    add("--mem-gib", type=float, default=6.0, help="upcast rotation sets' cap")
    args = parser.parse_args(argv)
    args.sections = args.sections.split(",")
    if unknown := set(args.sections) - set(SECTIONS):
        parser.error(f"--sections: {', '.join(sorted(unknown))} not in {SECTIONS}")
    return args


def make_plan(args) -> Plan:
    plan = QUICK if args.quick else Plan()
    overrides = dict(
        graph_ms=args.graph_ms,
        eager_calls=args.eager_calls,
        eager_repeats=args.eager_repeats,
    )
    return Plan(**{**vars(plan), **{k: v for k, v in overrides.items() if v}})


def main(argv=None) -> int:
    """Runs the plan, writes the JSON and markdown; 1 if any case raised."""
    args = parse_args(argv)
    load_kernels()
    plan = make_plan(args)
    timing = Timing(plan.graph_ms, plan.eager_calls, plan.eager_repeats)
    started = time.perf_counter()
    meta = stamp(args.commit) | machine_meta(timing)
    meta["plan"] = vars(plan) | dict(quick=args.quick)
    meta["timers"] = dict(
        graph="triton.testing.do_bench_cudagraph", spread="IQR / median",
        eager="torch.utils.benchmark.Timer.timeit, stock and ours alternated",
    )  # fmt: skip
    budget = int(args.mem_gib * (1 << 30))
    rows = run_cases(plan, args.sections, args.only, timing, meta["copy_gbs"], budget)
    meta["wall_s"] = time.perf_counter() - started
    md = args.md or args.json.with_suffix(".md")
    summary = write_report(rows, meta, args.json, md)
    print(f"\nwrote {args.json}, {md}; {meta['wall_s']:.0f} s\n\n{summary}")
    failed = [r for r in rows if "error" in r]
    if failed:
        print(f"\n{len(failed)} case(s) failed (tracebacks above)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
