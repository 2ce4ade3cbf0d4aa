# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stock against the specialized kpool decode in one run, as ratios (stock
time over ours), each figure with its spread (IQR / median): graph-replayed
(``triton.testing.do_bench_cudagraph``, per call; the upcast rotates through
input copies larger than the L2 and gives its fraction of the bandwidth of
2 GiB device-to-device copies, read plus write, timed alike) and eager
with the host counted (``torch.utils.benchmark.Timer.timeit`` of back-to-back
calls between two synchronizes, stock and ours alternated). Cases: ``--list``;
every kernel is compiled and warmed on its inputs before any timing. Writes a
JSON (``meta``; ``kernels``, ``select`` and ``scores`` rows; pairs [stock,
ours]). Runs on the patched overlay of the installed vLLM or, with
``KPOOL_KERNEL_ONLY=1``, on a GPU machine without vLLM (the GPU tier's shim:
docs/gpu-tier.md). A case that raises prints
its traceback; the others still run and the exit status is 1."""

import argparse
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
import types
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
POOL, DIM, K_POOLS, BLOCK = 4, 128, 512, 64  # select k: index_topk 2048 / 4
WIDTH = 2176  # top-k rows: 512 pools * 4 + 3 columns, in 128-column tiles
L2_BYTES, MAX_SETS = 64 << 20, 64  # above the H200's 50 MiB
SHORT, TAIL_WIDTH = 4096, 65536  # short contexts' last pool; the tail's logits
# Backend path: (MX scales in the update, upcast, conversion with counts).
PATHS = {
    "sm100-flashinfer": (True, True, True),
    "sm90-flashinfer": (False, False, True),
    "flashmla-fp8": (False, False, False),
}
SELECT_PATHS = {"sm100-flashinfer": torch.bfloat16, "sm90-flashinfer": torch.float32}
SHARES = {"relu 0%": 0.0, "relu 0.1%": 0.001, "relu 1%": 0.01, "relu 50%": 0.5}
K = types.SimpleNamespace()  # the kernels, stock and ours (``load_kernels``)


@dataclass(frozen=True)
class Plan:
    rows: tuple = (1, 8, 32, 64, 128, 256)
    tokens: tuple = (1, 4)
    upcast_rows: tuple = (1, 8, 64, 256)
    widths: tuple = (16384, 65536, 262144)
    select_rows: tuple = ((1, 1), (1, 8), (1, 64), (1, 256), (4, 4), (4, 32), (4, 256))
    ends: tuple = ("full", "random", "short")
    relu_widths: tuple = (65536, 262144)  # indexer-like logits: full ends, next_n 1
    step_rows: tuple = (1, 4, 8, 32, 64)  # requests of the step cases
    step_next_n: tuple = (1, 2)
    step_pools: tuple = (4096, 16384, 65536, 131072, 262144)
    step_heads: tuple = (32,)  # GLM-5-Next's INDEX_HEADS as vLLM pads them
    rep_ms: float = 5.0  # ms of calls a graph
    eager_calls: int = 50  # calls a timing
    eager_repeats: int = 7  # timings a side


QUICK = Plan(
    rows=(1, 64, 256),
    tokens=(1,),
    upcast_rows=(1, 64, 256),
    widths=(65536, 262144),
    select_rows=((1, 1), (1, 64), (4, 256)),
    ends=("full", "random"),
    relu_widths=(262144,),
    step_rows=(1, 64),
    step_next_n=(1,),
    step_pools=(65536,),
    rep_ms=2.0,
    eager_calls=30,
    eager_repeats=5,
)


def cases(plan: Plan) -> list[dict]:
    """Each case's fields; a select row's context says next_n where not 1."""
    P, rows = itertools.product, plan.rows
    out = [
        dict(case="update", scales=s, rows=r, tokens=t)
        for s, t, r in P(("mx", "fp32"), plan.tokens, rows)
    ]
    out += [
        dict(case="upcast", ends=e, rows=r, width=w)
        for e, w, r in P(plan.ends, plan.widths, plan.upcast_rows)
    ]
    out += [dict(case="expand", rows=r) for r in rows]
    out += [dict(case="remap", counts=c, rows=r) for c, r in P((True, False), rows)]
    out += [dict(case="tail", path=p, rows=r) for p, r in P(PATHS, rows)]
    grid = P(SELECT_PATHS, plan.widths, plan.select_rows, plan.ends)
    out += [
        dict(
            path=p,
            rows=r,
            width=w,
            context=f"{e}, next_n {n}" if n > 1 else e,
            logits="randn",
        )
        for p, w, (n, r), e in grid
    ]
    ones = [r for n, r in plan.select_rows if n == 1]
    out += [
        dict(path=p, rows=r, width=w, context="full", logits=s)
        for p, w, s, r in P(SELECT_PATHS, plan.relu_widths, SHARES, ones)
    ]
    steps = P(plan.step_heads, plan.step_next_n, plan.step_pools, plan.step_rows)
    return out + [
        dict(case="step", rows=r, next_n=n, context=c, heads=h) for h, n, c, r in steps
    ]


def name(case: dict) -> str:
    fields = [f"{k}={v}" for k, v in case.items() if k != "case"]
    return " ".join([case.get("case", "select"), *fields])


def draw_ends(requests, next_n, width, kind, dev, gen) -> torch.Tensor:
    """Row ends in pools, int32: a request's ``next_n`` rows end one pool
    apart (as stock's 2-D seq_lens), its last at the width (full), uniform in
    [1, width] (random) or in [1, min(4K, width)] (short)."""
    high = width if kind == "random" else min(SHORT, width)
    last = torch.randint(1, high + 1, (requests, 1), device=dev, generator=gen)
    last = last.fill_(width) if kind == "full" else last
    steps = torch.arange(next_n, device=dev)
    return (last - next_n + 1 + steps).clamp(min=0).view(-1).to(torch.int32)


def indexer_logits(rows, width, share, dtype, dev, gen, heads=16) -> torch.Tensor:
    """Logits as the indexer makes them, ``sum_h w_h relu(q_h . k_j + b)``
    over FP8-rounded random queries and keys, weights in [0.5, 1.5), where
    ``round(share * width)`` pools of a row score above 0 (ties aside) and
    the others exactly 0.0, a plateau that straddles the top-k threshold
    where that count is below k: a row's signed bias ``b`` is minus the
    (count + 1)-th largest of its pools' maxima over heads of ``q_h . k_j``,
    so only the pools above it have a head above 0. Dot products are made
    256 MiB at a time on ``dev``."""
    g = dict(device=dev, generator=gen)
    keys = torch.randn(width, DIM, **g).to(torch.float8_e4m3fn).float()
    q = torch.randn(rows, heads, DIM, **g).to(torch.float8_e4m3fn).float()
    w = torch.rand(rows, heads, 1, **g) + 0.5
    out = torch.empty(rows, width, dtype=dtype, device=dev)
    count = min(round(share * width), width - 1)
    chunk = max(1, (1 << 26) // (heads * width))
    for r in range(0, rows, chunk):
        dots = q[r : r + chunk] @ keys.T / math.sqrt(DIM)  # [chunk, heads, width]
        top = dots.amax(dim=1).sort(dim=1, descending=True).values
        scores = w[r : r + chunk] * (dots - top[:, count, None, None]).relu()
        out[r : r + chunk] = scores.sum(1)
    return out


def update_inputs(requests, tokens, dev, gen, page=64) -> dict:
    """The update's arguments in order: a ring of 4, int32 slots and
    positions, a cache slot where a token completes its pool."""
    g = dict(device=dev, generator=gen)
    pages = requests * tokens // page + 2
    positions = torch.randint(0, 100_000, (requests, 1), **g)
    positions = positions + torch.arange(tokens, device=dev)
    blocks = torch.randperm(requests, **g)[:, None] + 1
    free = torch.randperm(pages * page, **g)[: requests * tokens].view(requests, -1)
    return dict(
        kv_cache=torch.randint(0, 256, (pages, page, DIM + 4), dtype=torch.uint8, **g),
        tail=torch.randn(requests + 1, 2, POOL, DIM, **g).to(torch.bfloat16),
        tail_slots=(blocks * POOL + positions % POOL).to(torch.int32),
        key=torch.randn(requests, tokens, DIM, **g).to(torch.bfloat16),
        score=torch.randn(requests, tokens, DIM, **g).to(torch.bfloat16),
        ape=torch.randn(POOL, DIM, **g),
        slots=torch.where(positions % POOL == POOL - 1, free, -1).to(torch.int32),
        positions=positions.to(torch.int32),
    )


def topk_inputs(rows, dev, gen, positions=None, tokens=1 << 18) -> dict:
    """What follows the top-k: int32 pool ids below each row's complete
    pools, int64 positions (random in [tokens / 16, tokens) where not given),
    request ids, a block table, the logical and physical rows, counts."""
    g = dict(device=dev, generator=gen)
    if positions is None:
        positions = torch.randint(tokens // 16, tokens - POOL, (rows,), **g)
    pools = (positions + 1) // POOL
    table = torch.randint(0, 1 << 20, (rows, tokens // BLOCK + 1), **g)
    return dict(
        pool_topk=(torch.rand(rows, K_POOLS, **g) * pools[:, None]).to(torch.int32),
        positions=positions,
        req_ids=torch.arange(rows, dtype=torch.int32, device=dev),
        block_table=table.to(torch.int32),
        logical=torch.full((rows, WIDTH), -1, dtype=torch.int32, device=dev),
        physical=torch.empty(rows, WIDTH, dtype=torch.int32, device=dev),
        counts=torch.empty(rows, dtype=torch.int32, device=dev),
    )


# GLM-5-Next's index heads; vLLM zero-pads them to 32 for DeepGEMM, and the
# stage hands our scores views of the real ones.
INDEX_HEADS = 16


def score_inputs(requests, next_n, heads, ends, dev, gen) -> dict:
    """DeepGEMM's paged scores' arguments on SM90 (FP32 scales) for
    ``requests`` x ``next_n`` rows ending at ``ends`` pools: FP8 queries
    (their scale folded into the FP32 weights, as the indexer does), each
    request's pages of ``BLOCK`` pools in random places of the cache (a page:
    its FP8 keys, then their FP32 scales), its block table, the 2-D pool
    lengths and DeepGEMM's schedule for them. The heads past ``INDEX_HEADS``
    are zero, as vLLM pads them."""
    g = dict(device=dev, generator=gen)
    pages = -(-int(ends.max()) // BLOCK)
    table = torch.randperm(requests * pages, **g).view(requests, pages).int()
    cache = torch.randn(requests * pages, BLOCK * (DIM + 4), **g)
    cache = cache.to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.rand(requests * pages, BLOCK, **g) * 0.01 + 0.001
    cache[:, BLOCK * DIM :] = scales.view(torch.uint8)
    lens = ends.view(requests, next_n)
    q = torch.randn(requests, next_n, heads, DIM, **g)
    weights = torch.rand(requests * next_n, heads, **g) * 0.1
    q[:, :, INDEX_HEADS:], weights[:, INDEX_HEADS:] = 0, 0
    q = q.to(torch.float8_e4m3fn)
    sms = (
        torch.cuda.get_device_properties(dev).multi_processor_count
        if dev.type == "cuda"
        else 132
    )
    return dict(
        q=(q, None),
        kv_cache=cache.view(-1, BLOCK, 1, DIM + 4),
        weights=weights,
        context_lens=lens,
        block_table=table,
        schedule_meta=K.deep_gemm.get_paged_mqa_logits_metadata(
            lens, BLOCK, sms // (2 if next_n == 4 else 1)
        ),
    )


MX = (lambda: False, lambda: True)  # what the stock update reads the format from


def stock_update(u, mx):
    K.compress.mqa_logits_use_mx_scales = MX[mx]
    K.stock_update(*u.values(), POOL, DIM, round_scale=True)


def ours_update(u, mx):
    K.kpool_update(*u.values(), POOL, mx_scales=mx, round_scale=True)


def stock_remap(t, counts):
    """The stock decode after its top-k: the -1 fill, the int64 cast, the
    expansion of positions + 1, its copy into the rows, the conversion."""
    t["logical"].fill_(-1)
    seq = t["positions"].to(torch.int32) + 1
    expanded = K.stock_expand(t["pool_topk"].to(torch.int64), seq, POOL)
    t["logical"][:, : expanded.shape[1]] = expanded
    K.convert(
        t["req_ids"],
        t["block_table"],
        t["logical"],
        BLOCK_SIZE=BLOCK,
        NUM_TOPK_TOKENS=WIDTH,
        return_valid_counts=counts,
        out=t["physical"],
        valid_counts_out=t["counts"] if counts else None,
    )


def ours_remap(t, counts):
    K.expand_and_remap(
        t["pool_topk"],
        t["positions"],
        POOL,
        t["req_ids"],
        t["block_table"],
        t["physical"],
        t["counts"] if counts else None,
        block_size=BLOCK,
        stride_rows=BLOCK,
    )


def calls(fns):
    for fn in fns:
        fn()


def build(case: dict, dev, gen) -> tuple[list, dict]:
    """The case's inputs on ``dev``, its pairs [(name, stock fns, our fns)]
    (several fns: input sets to rotate through) and extra fields."""
    kind, rows, width = case.get("case", "select"), case["rows"], case.get("width")
    p = partial
    if kind == "upcast":  # input sets whose reads and writes exceed twice the L2
        sets, moved, wanted = [], [], 1  # (ours allocates its output, as stock)
        while len(sets) < wanted:
            e = draw_ends(rows, 1, width, case["ends"], dev, gen)
            x = torch.randn(rows, width, device=dev, generator=gen).bfloat16()
            sets.append((x, e))
            moved.append(6 * int(e.sum()) + 4 * rows)  # BF16 read, FP32 written, ends
            need = -(-2 * L2_BYTES // moved[0])
            wanted = min(MAX_SETS, (4 << 30) // (2 * rows * width), need)  # <= 4 GiB
        stock = [p(K.as_fp32_logits, *s) for s in sets]
        ours = [p(K.upcast_logits, *s) for s in sets]
        return [("", stock, ours)], dict(sets=len(sets), bytes=statistics.mean(moved))
    if kind == "select":  # rows / next_n requests, three tokens in each tail pool
        ends, _, n = case["context"].partition(", next_n ")
        next_n = int(n or 1)
        e = draw_ends(rows // next_n, next_n, width, ends, dev, gen)
        dtype, share = SELECT_PATHS[case["path"]], SHARES.get(case["logits"])
        if share is None:
            x = torch.randn(rows, width, device=dev, generator=gen).to(dtype)
        else:
            x = indexer_logits(rows, width, share, dtype, dev, gen)
        t = topk_inputs(rows, dev, gen, e.to(torch.int64) * POOL + 2, width * POOL)
        seq_lens, max_seq_len = e.view(-1, next_n), POOL * int(e.max()) + 3  # tokens

        def stock_topk():  # as_fp32_logits returns FP32 logits as they are
            x32, out = K.as_fp32_logits(x, e), t["pool_topk"]
            K.stock_topk(x32, seq_lens, out, K_POOLS, max_seq_len)

        ours_select = p(K.select_topk, x, e, K_POOLS, out=t["pool_topk"])
        stock = p(calls, [stock_topk, p(stock_remap, t, True)])
        ours = p(calls, [ours_select, p(ours_remap, t, True)])
        pairs = [("select", [stock_topk], [ours_select]), ("chain", [stock], [ours])]
        return pairs, {}
    # The indexer decode after the query: DeepGEMM's scores and the stock top-k
    # or the select, or (step_scores) our scores and the select.
    if kind == "step":
        n, pools = case["next_n"], case["context"]
        e = draw_ends(rows, n, pools, "full", dev, gen)
        s = score_inputs(rows, n, case["heads"], e, dev, gen)
        t = topk_inputs(rows * n, dev, gen, e.to(torch.int64) * POOL + 2, pools * POOL)
        max_seq_len, lens = POOL * pools, s["context_lens"]
        scores = p(K.deep_gemm.fp8_fp4_paged_mqa_logits, **s, max_context_len=pools)
        real = min(case["heads"], INDEX_HEADS)  # as the stage hands them on
        ours_scores = p(
            K.scores,
            q=(s["q"][0][:, :, :real], None),
            kv_cache=s["kv_cache"],
            seq_lens=lens,
            weights=s["weights"][:, :real],
            block_table=s["block_table"],
            max_model_len=pools,
        )

        def stock():  # as_fp32_logits returns SM90's FP32 scores as they are
            logits = K.as_fp32_logits(scores(), e)
            K.stock_topk(logits, lens, t["pool_topk"], K_POOLS, max_seq_len)
            stock_remap(t, True)

        def ours(select, scores=scores):
            logits = scores()
            if select:
                K.select_topk(logits, e, K_POOLS, out=t["pool_topk"])
            else:
                K.stock_topk(logits, lens, t["pool_topk"], K_POOLS, max_seq_len)
            ours_remap(t, True)

        pairs = [
            ("step", [stock], [p(ours, False)]),
            ("step_select", [stock], [p(ours, True)]),
            ("step_scores", [stock], [p(ours, True, ours_scores)]),
        ]
        return pairs, dict(alone=(scores, ours_scores))
    u = update_inputs(rows, case.get("tokens", 1), dev, gen)
    t = topk_inputs(rows, dev, gen)
    if kind == "update":
        mx = case["scales"] == "mx"
        return [("", [p(stock_update, u, mx)], [p(ours_update, u, mx)])], {}
    if kind == "expand":  # stock with the int64 ids the stock decode passes
        ids, out = t["pool_topk"], t["logical"]
        seq = t["positions"].to(torch.int32) + 1
        return [
            (
                "",
                [p(K.stock_expand, ids.long(), seq, POOL, out=out)],
                [p(K.expand_pools, ids, seq, POOL, out=out)],
            )
        ], {}
    if kind == "remap":
        c = case["counts"]
        return [("", [p(stock_remap, t, c)], [p(ours_remap, t, c)])], {}
    # The decode tail around the top-k: the update, the upcast where the path
    # has one (random ends), the expansion and conversion or the fused remap.
    mx, upcast, counts = PATHS[case["path"]]
    x = torch.randn(rows, TAIL_WIDTH, device=dev, generator=gen).to(torch.bfloat16)
    e = draw_ends(rows, 1, TAIL_WIDTH, "random", dev, gen)
    stock = [
        p(stock_update, u, mx),
        p(K.as_fp32_logits, x, e),
        p(stock_remap, t, counts),
    ]
    ours = [p(ours_update, u, mx), p(K.upcast_logits, x, e), p(ours_remap, t, counts)]
    if not upcast:
        del stock[1], ours[1]
    return [("", [p(calls, stock)], [p(calls, ours)])], {}


def graph_us(fns, rep_ms) -> tuple[float, float]:
    """µs per call: a CUDA graph of as many calls as take ``rep_ms``, each
    the next of ``fns`` (input sets in turn), replayed 10 times, each
    replay's time over its calls."""
    from triton.testing import do_bench_cudagraph

    turn = itertools.cycle(fns)
    q = do_bench_cudagraph(
        lambda: next(turn)(), rep=rep_ms, quantiles=[0.25, 0.5, 0.75]
    )
    return q[1] * 1e3, (q[2] - q[0]) / q[1]


def eager_us(stock, ours, plan: Plan) -> list[tuple[float, float]]:
    """µs per call, host counted: ``eager_repeats`` timings of
    ``eager_calls`` calls a side (the fns in turn), the sides alternated so
    that drift hits both alike."""
    from torch.utils.benchmark import Timer

    sides = (itertools.cycle(f) for f in (stock, ours))
    timers = [Timer("next(turn)()", globals=dict(turn=turn)) for turn in sides]
    runs: list[list[float]] = [[], []]
    for _ in range(plan.eager_repeats):
        for timer, run in zip(timers, runs, strict=True):
            run.append(timer.timeit(plan.eager_calls).median * 1e6)
    quartiles = [statistics.quantiles(r, n=4, method="inclusive") for r in runs]
    return [(q2, (q3 - q1) / q2) for q1, q2, q3 in quartiles]


def measure(case: dict, plan: Plan, dev, copy_gbs: float) -> dict:
    """The case's row: its fields, each pair's figures and spreads [stock,
    ours], the upcast's fractions of the copy's GB/s."""
    gen = torch.Generator(dev).manual_seed(zlib.crc32(name(case).encode()))
    pairs, extra = build(case, dev, gen)
    for _, stock, ours in pairs:
        for fn in (*stock, *ours):  # compiles and warms, untimed
            fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    row = dict(case)
    for pair, stock, ours in pairs:
        figures = {"graph": [graph_us(stock, plan.rep_ms), graph_us(ours, plan.rep_ms)]}
        if pair not in ("select", "scores"):
            figures["eager"] = eager_us(stock, ours, plan)
        for timer, (s, o) in figures.items():
            key = f"{pair}_{timer}" if pair else timer
            row[f"{key}_us"], row[f"{key}_spread"] = [s[0], o[0]], [s[1], o[1]]
    if "alone" in extra:  # the scores alone: [DeepGEMM, ours]
        alone = extra.pop("alone")
        row["scores_graph_us"] = [graph_us([fn], plan.rep_ms)[0] for fn in alone]
    if "bytes" in extra:  # bytes / µs = MB/s
        row["roof"] = [extra["bytes"] / us / 1e3 / copy_gbs for us in row["graph_us"]]
    return row | extra


def run(selected: list[dict], plan: Plan, dev, copy_gbs: float) -> list[dict]:
    """The rows of ``selected``, in order; one that raised holds ``error``."""
    rows = []
    for case in selected:
        try:
            row = measure(case, plan, dev, copy_gbs)
        except Exception as error:  # the others still run; main exits 1
            traceback.print_exc()
            row = dict(case, error=f"{type(error).__name__}: {error}"[:300])
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()  # the case's buffers and graph pools
        rows.append(row)
        said = [
            f"{k[:-3]} x{v[0] / v[1]:.2f} ±{max(row[k[:-2] + 'spread']):.0%}"
            for k, v in row.items()
            if k.endswith("_us") and v[1] and k != "scores_graph_us"
        ]
        if row.get("scores_graph_us"):
            said.append(
                "scores: DeepGEMM {:.1f} us, ours {:.1f} us".format(
                    *row["scores_graph_us"]
                )
            )
        said = ["FAILED " + row["error"].split("\n")[0]] if "error" in row else said
        print(f"{name(case):64} {' | '.join(said)}", flush=True)
    return rows


def copy_gbs(rep_ms, size=2 << 30) -> dict:
    """GB/s (read plus write) of device-to-device copies of ``size`` bytes:
    ``copy_`` (a memcpy) and an elementwise kernel's (``neg`` into another
    buffer: an H200's SMs move more than its memcpy does)."""
    src = torch.empty(size // 4, device="cuda")
    dst = torch.empty_like(src)
    copies = dict(
        memcpy=partial(dst.copy_, src), kernel=partial(torch.neg, src, out=dst)
    )
    gbs = {k: 2 * size / graph_us([f], rep_ms)[0] / 1e3 for k, f in copies.items()}
    del src, dst, copies
    torch.cuda.empty_cache()
    return gbs


def load_kernels(stock_topk_so: str | None, deep_gemm: str | None = None) -> None:
    """Fills ``K``, from the kernel-only shim or else the patched overlay of
    the installed vLLM, put first on ``sys.path``; with ``deep_gemm``, the
    folder holding vLLM's vendored ``deep_gemm`` package."""
    sys.path.insert(0, str(ROOT))
    from tools import overlay

    overlay.import_patched("bench.py")
    from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
    from vllm.models.glm5next.nvidia.ops import kpool_compress
    from vllm.models.glm5next.nvidia.specialized_decode import kpool
    from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.scores import (
        launch as scores,
    )
    from vllm.v1.attention.backends.mla.sparse_utils import (
        triton_convert_req_index_to_global_index,
    )

    K.compress, K.as_fp32_logits = kpool_compress, as_fp32_logits
    K.stock_update = kpool_compress.kpool_decode_update_and_maybe_write_cache_batched
    K.stock_expand = kpool_compress.expand_pools_and_append_tail
    K.convert = triton_convert_req_index_to_global_index
    for fn in ("kpool_update", "expand_pools", "expand_and_remap", "upcast_logits"):
        setattr(K, fn, getattr(kpool, fn))
    K.select_topk = kpool.select_topk
    K.scores = scores.SCORES
    if deep_gemm:  # vLLM's vendored DeepGEMM, from the folder that holds it
        sys.path.insert(0, deep_gemm)
        import deep_gemm as dg

        K.deep_gemm = dg
    if stock_topk_so:  # vLLM's own top-k as "auto" picks it, from the wheel
        from tools.kernel_env import stock_topk

        stock_topk.load(stock_topk_so)
        K.stock_topk = stock_topk.StockTopk(torch.device("cuda"))


def part(row: dict) -> str:
    """The JSON part of a row: ``select`` (the top-k cases), ``scores`` (the
    indexer decode after the query) or ``kernels``."""
    kind = row.get("case", "select")
    return (
        kind
        if kind in ("select", "scores")
        else {"step": "scores"}.get(kind, "kernels")
    )


def write_json(path: Path, meta: dict, rows: list[dict]) -> None:
    parts: dict = {}
    for row in rows:
        parts.setdefault(part(row), []).append(row)
    path.write_text(json.dumps(dict(meta=meta, **parts), indent=1))


def git_head() -> str:
    try:
        git = ["git", "-C", str(ROOT), "describe", "--always", "--dirty"]
        out = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    except OSError:  # no git there
        out = ""
    return out or "unknown"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--json", type=Path, default=Path("bench.json"), help="the results")
    add("--quick", action="store_true", help="a short subset")
    add("--cases", default="", metavar="REGEX", help="the cases whose name matches")
    add("--list", action="store_true", help="print the case names and stop")
    add(
        "--stock-topk-so",
        default=os.environ.get("KPOOL_STOCK_TOPK_SO"),
        help="the wheel's _C_stable_libtorch.abi3.so (KPOOL_STOCK_TOPK_SO)",
    )
    add(
        "--deep-gemm",
        default=os.environ.get("KPOOL_DEEP_GEMM"),
        help="the folder holding vLLM's vendored deep_gemm (KPOOL_DEEP_GEMM)",
    )
    add("--commit", help="what was measured (default: git describe --dirty)")
    args = p.parse_args(argv)
    args.plan = QUICK if args.quick else Plan()
    args.selected = [c for c in cases(args.plan) if re.search(args.cases, name(c))]
    so = args.stock_topk_so
    topk = any(part(c) in ("select", "scores") for c in args.selected)
    if topk and not (args.list or so and Path(so).is_file()):
        p.error(
            f"the select and step cases need --stock-topk-so (not a file: {so})"
            " or --cases"
        )
    steps = any(part(c) == "scores" for c in args.selected)
    if steps and not (args.list or args.deep_gemm):
        p.error("the step cases need --deep-gemm (vLLM's vendored DeepGEMM) or --cases")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(map(name, args.selected)))
        return 0
    if not torch.cuda.is_available():
        sys.exit("tools/bench.py: the timing needs a CUDA GPU (--list does not)")
    load_kernels(args.stock_topk_so, args.deep_gemm)
    import triton

    started, dev = time.perf_counter(), torch.device("cuda")
    copy = copy_gbs(args.plan.rep_ms)
    meta = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        commit=args.commit or git_head(),
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        copy=copy,
        copy_gbs=max(copy.values()),
        plan=vars(args.plan),
        stock_topk_so=args.stock_topk_so,
        deep_gemm=args.deep_gemm,
    )
    said = ", ".join(f"{k} {v:.0f}" for k, v in copy.items())
    print(f"{meta['gpu']}, copy GB/s: {said}; x: stock time over ours ±spread")
    rows = run(args.selected, args.plan, dev, meta["copy_gbs"])
    meta["wall_s"] = round(time.perf_counter() - started)
    write_json(args.json, meta, rows)
    failed = sum("error" in r for r in rows)
    print(f"wrote {args.json}: {meta['wall_s']} s, {failed} of {len(rows)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
