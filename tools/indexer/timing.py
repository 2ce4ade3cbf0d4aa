# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-layer time of the indexer decode step, stock against the stage, in one
run (CUDA only): the layer's ``sparse_attn_indexer_kpool`` call and the top-k
conversion that consumes it (a deferred top-k moves work from one to the
other, so they are timed together), on a uniform decode batch with contexts
past the top-k.

- ``eager``: wall µs per step of ``calls`` back-to-back steps between two
  synchronizes, host included (a fresh forward context each step, as each
  forward has); median of ``repeats``, stock and stage interleaved.
- ``graph``: µs per step of ``graph_steps`` steps captured in one FULL graph,
  median over ``replays`` replays.

DeepGEMM's logits and the top-k are precomputed (``refs.Fixed``: a stored
logits tensor, a copy of stored ids), the same on both sides, so the figures
hold the indexer's own work, not the torch references'. With the opt-in
select (``Config.select``) the top-k is vLLM 0.33.0's own instead
(``WheelTopk``: the pinned wheel's ops, which the caller loads), which the
stage side replaces by the select where it runs. The driver's own
checks (the deferred-rows flag, the snapshots) are off while timing
(``Side.record``).
"""

import contextlib
import gc
import random
import statistics
import time

import torch

from tools.indexer.batches import Batch, Request, Scheduled
from tools.indexer.model import mx_scales
from tools.indexer.refs import Fixed, WheelTopk, references, select_topk
from tools.indexer.steps import Config, Run
from vllm.config import CUDAGraphMode
from vllm.forward_context import override_forward_context
from vllm.models.glm5next.nvidia import sparse_indexer

BATCHES = ((1, 1), (8, 1), (32, 1), (8, 2), (32, 2), (8, 4), (32, 4))
UNIT = "indexer decode step + its top-k conversion"
STAND_INS = "logits: a stored tensor; top-k: a copy of stored ids (both sides)"
SELECT_STAND_INS = (
    "logits: a stored tensor; top-k: vLLM 0.33.0's cooperative/persistent_topk "
    "(the wheel's binary; the stage side runs the opt-in select where it takes "
    "the rows)"
)


def _batch(run: Run, requests: int, next_n: int, context, rng) -> Batch:
    """``requests`` decoding requests of ``next_n`` tokens after contexts
    drawn from ``context`` (a range of token counts)."""
    geo, sched = run.cfg.geo, run.sched
    items = []
    for rid in range(requests):
        start = rng.randint(*context)
        req = Request(rid, start, 1 << 30, sched.free_tails.pop(), computed=start)
        need = -(-(start + next_n) // geo.block)
        req.blocks = [sched.free_blocks.pop() for _ in range(need)]
        items.append(Scheduled(req, start, next_n, False))
    return Batch(items, next_n, requests)


def _release(run: Run, batch: Batch) -> None:
    for item in batch.items:
        run.sched.free_blocks.extend(item.req.blocks)
        run.sched.free_tails.append(item.req.tail)


def _fixed(run: Run, step) -> Fixed:
    geo, backend = run.cfg.geo, run.backend
    decode = step.metadata[run.prefixes[0][0]].decode
    ends = decode.seq_lens.reshape(-1)
    rows = ends.shape[0]
    dtype = torch.bfloat16 if backend.mx else torch.float32
    logits = torch.randn(rows, geo.max_pool_len, generator=run.gen, device=run.device)
    logits = logits.to(dtype)
    ids = select_topk(logits, torch.zeros_like(ends), ends, geo.topk // 4)
    return Fixed(logits, ids)


def _eager_us(run: Run, side, layer: int, step, calls: int) -> float:
    def one():
        with override_forward_context(run.context(step, CUDAGraphMode.NONE)):
            side.layer_step(layer, run.source.positions, step.rows)

    with side.active():
        gc.disable()  # a collection inside the loop would be charged to one side
        try:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                one()
            torch.cuda.synchronize()
            return (time.perf_counter() - start) * 1e6 / calls
        finally:
            gc.enable()


def _graph_us(run: Run, side, layer: int, step, steps: int, replays: int) -> float:
    with side.active():
        graph = torch.cuda.CUDAGraph()
        ctx = run.context(step, CUDAGraphMode.FULL)
        with (
            torch.cuda.graph(graph, pool=run.pool, stream=run.stream),
            override_forward_context(ctx),
        ):
            for _ in range(steps):
                side.layer_step(layer, run.source.positions, step.rows)
    times = []
    for _ in range(replays):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    del graph
    return statistics.median(times)


def time_layers(
    backend: str,
    *,
    batches=BATCHES,
    context=(2500, 8000),
    calls: int = 30,
    repeats: int = 5,
    graph_steps: int = 10,
    replays: int = 20,
    seed: int = 0,
    cfg: Config | None = None,
) -> list[dict]:
    """Rows ``{section, mode, backend, layer, requests, next_n, rows,
    stock_us, stage_us, ratio}`` (ratio: stock / stage) for every layer."""
    cfg = cfg or Config(backend=backend, seed=seed)
    run = Run(cfg, "cuda")
    rng, rows_out = random.Random(seed), []
    with contextlib.ExitStack() as stack:
        stack.enter_context(mx_scales(run.backend.mx))
        run.stream.wait_stream(torch.cuda.current_stream())
        stack.enter_context(torch.cuda.stream(run.stream))
        run.build_stages()
        for requests, next_n in batches:
            if requests * next_n > cfg.geo.capacity:
                continue
            batch = _batch(run, requests, next_n, context, rng)
            step = run.builder.build(batch, rows=batch.tokens, tail_split="indexer")
            run.fill_inputs(step.rows)
            run.source.positions = step.positions
            fixed = _fixed(run, step)
            topk = WheelTopk(run.device) if cfg.select else fixed.topk
            with references(sparse_indexer, run.device, fixed.logits, topk):
                for side in run.sides:
                    with (
                        side.active(),
                        override_forward_context(run.context(step, CUDAGraphMode.NONE)),
                    ):
                        side.forward(run.source, step.rows)  # inputs; warm up
                    side.record = False
                for layer in range(cfg.geo.layers):
                    eager: tuple[list, list] = ([], [])
                    for _ in range(repeats):
                        for times, side in zip(eager, run.sides, strict=True):
                            times.append(_eager_us(run, side, layer, step, calls))
                    graph = [
                        _graph_us(run, side, layer, step, graph_steps, replays)
                        for side in run.sides
                    ]
                    for mode, (a, b) in (
                        ("eager", [statistics.median(t) for t in eager]),
                        ("graph", graph),
                    ):
                        rows_out.append(
                            dict(
                                section="indexer_step",
                                mode=mode,
                                backend=backend,
                                layer=layer,
                                requests=requests,
                                next_n=next_n,
                                rows=step.rows,
                                stock_us=a,
                                stage_us=b,
                                ratio=a / b,
                            )  # fmt: skip
                        )
            _release(run, batch)
            torch.cuda.empty_cache()
    return rows_out
