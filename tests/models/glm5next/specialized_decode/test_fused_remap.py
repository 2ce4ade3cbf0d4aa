# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``FusedRemap`` as a real ``SparseMLAIndexGroup``'s conversion, on its side
stream and events, against the stock group converting the logical rows
stock's decode writes: physical indices (and counts) byte for byte.

Two engines run side by side, each a ``KpoolStage`` with one fused layer (its
own group, pool buffer and per-layer hand-off) fed its own inputs, their
steps interleaved: both defer, then both convert. A stage that read the
other's pool buffer or hand-off would convert the other's pool ids.

Every hand-off between the compute stream and the side stream runs with the
other stream held back (``torch.cuda._sleep``): the compute stream after
each indexer's event record (the side stream must wait for it), the side
stream before each eager conversion (the compute stream, which copies the
result at once, must wait for it). Eagerly, replayed from a captured CUDA graph and
under piecewise graphs (the side stream waits on the compute stream): the
fused conversion with and without counts, and each way it declines (an
``idx_mapping``, rows past the group's buffers, a kernel not compiled, a
block size the kernel does not take), where the stock conversion must read
the rows ``materialize`` writes, never the stale ones."""

from types import SimpleNamespace

import pytest
import torch
from kpool_fuzz import fuzz_cases, fuzz_seed, report

from tools.indexer import model

pytestmark = pytest.mark.gpu

POOL, GROUPS, WIDTH, MAX_ROWS = 4, 512, 2176, 64
LAYER = "model.layers.0.self_attn"
# Cycles a stream is held back at each hand-off.
HOLD_BACK = 2_000_000
POISON = -7


def make_group(device):
    """A layer's index group whose physical rows (``MAX_ROWS + 1``) are
    fewer than its logical ones, so a step can have rows past them."""
    logical = torch.full((MAX_ROWS * 2, WIDTH), -1, dtype=torch.int32, device=device)
    return model.index_group(logical, device, physical_rows=MAX_ROWS + 1)


class Inputs:
    """One decode step's pool top-k, positions and block table, in static
    buffers a captured graph reads."""

    def __init__(self, rows: int, block: int, device):
        self.rows, self.block = rows, block
        self.pool_ids = torch.empty(rows, GROUPS, dtype=torch.int32, device=device)
        self.positions = torch.empty(rows, dtype=torch.int64, device=device)
        self.req_ids = torch.arange(rows, dtype=torch.int32, device=device)
        self.block_table = torch.empty(rows, 512, dtype=torch.int32, device=device)
        self.idx_mapping = torch.arange(rows, dtype=torch.int32, device=device)

    def refill(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        tokens = 512 * self.block
        ids = torch.randint(0, tokens // POOL + 64, (self.rows, GROUPS), generator=gen)
        ids[torch.rand(self.rows, GROUPS, generator=gen) < 0.1] = -1
        self.pool_ids.copy_(ids)
        self.positions.copy_(torch.randint(-2, tokens + 8, (self.rows,), generator=gen))
        self.block_table.copy_(
            torch.randint(0, 1 << 20, (self.rows, 512), generator=gen)
        )


class Engine:
    """One engine: a ``KpoolStage`` on one DSA layer whose index group fuses
    (the stage installs the layer's ``FusedRemap``), the stock group it is
    compared with, and its own inputs."""

    def __init__(self, rows: int, block: int, device):
        from vllm.models.glm5next.nvidia.specialized_decode.stage import KpoolStage

        self.group, self.stock_group = make_group(device), make_group(device)
        # The shared sparse MLA decode converts through the group.
        impl = model.sparse_mla_impl("group", self.group)
        attn = model.dsa_layer(LAYER, impl, self.group.logical_topk_indices, 4 * GROUPS)
        self.stage = KpoolStage([attn], MAX_ROWS, device)
        self.remap = self.stage.remaps[f"{LAYER}.indexer.k_cache"]
        assert self.group._convert_once is self.remap and self.remap.stage is self.stage
        self.x = Inputs(rows, block, device)


def _convert(group, logical, x: Inputs, counts: bool, idx_mapping: bool):
    return group._convert_once(
        0,
        logical,
        x.req_ids,
        x.block_table,
        x.block,
        block_stride_rows=None,
        return_valid_counts=counts,
        **({"idx_mapping": x.idx_mapping} if idx_mapping else {}),
    )


def _copy(result, counts: bool):
    """The conversion's result as the compute stream reads it next."""
    out, valid = result if counts else (result, None)
    return out.clone(), None if valid is None else valid.clone()


def stock_step(engine: Engine, counts: bool, idx_mapping: bool):
    """What stock's decode and the stock conversion write for these rows:
    ``expand_pools_and_append_tail(pool_ids.to(torch.int64),
    positions.to(torch.int32) + 1, 4)`` into -1 rows, then the group."""
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )

    group, x = engine.stock_group, engine.x
    logical = group.logical_topk_indices[: x.rows]
    logical.fill_(-1)
    logical[:, : GROUPS * POOL + POOL - 1] = expand_pools_and_append_tail(
        x.pool_ids.to(torch.int64), x.positions.to(torch.int32) + 1, POOL
    )
    group.set_logical_topk_ready(0)
    return _copy(_convert(group, logical, x, counts, idx_mapping), counts)


def hand_over(engine: Engine) -> None:
    """The indexer's deferral in a planned step (patch 0002's calls on the
    stage's ``LayerStep``): the top-k into the stage's pool buffer, handed
    to the layer's conversion; then its ready event, the compute stream held
    back."""
    from vllm.models.glm5next.nvidia.specialized_decode.stage import LayerStep

    x, group = engine.x, engine.group
    group.logical_topk_indices[: x.rows].fill_(7)  # the previous step's rows
    group.physical_topk_indices.fill_(POISON)
    group.valid_topk_counts.fill_(POISON)
    step = LayerStep(engine.stage, engine.remap)
    assert step.deferring
    pool = step.pool_topk(x.rows, GROUPS, x.pool_ids.device)
    assert pool.data_ptr() == engine.stage.pool_buffer.data_ptr()
    pool.copy_(x.pool_ids)
    assert step.resolve(
        pool, x.positions, SimpleNamespace(requires_padding=False), None
    )
    assert engine.remap.pending is not None
    group.set_logical_topk_ready(0)
    torch.cuda._sleep(HOLD_BACK)


def fused_steps(engines, counts: bool, idx_mapping: bool):
    """Both engines defer, then both convert, each conversion's side stream
    held back and its result copied on the compute stream at once."""
    for engine in engines:
        hand_over(engine)
    results = []
    for engine in engines:
        x, group = engine.x, engine.group
        if not torch.cuda.is_current_stream_capturing():  # not in the graph
            with torch.cuda.stream(group.side_stream):
                torch.cuda._sleep(HOLD_BACK)
        logical = group.logical_topk_indices[: x.rows]
        results.append(_copy(_convert(group, logical, x, counts, idx_mapping), counts))
    return results


def _same(got, expected, counts: bool) -> bool:
    return torch.equal(got[0], expected[0]) and (
        not counts or torch.equal(got[1], expected[1])
    )


# (name, rows, block size, counts, idx_mapping, kernel compiled): how a
# conversion fuses or declines.
PATHS = [
    ("fused with counts", 7, 64, True, False, True),
    ("fused without counts", 7, 64, False, False, True),
    ("declined: idx_mapping", 7, 64, True, True, True),
    ("declined: rows past the buffers", MAX_ROWS + 3, 64, True, False, True),
    ("declined: not compiled", 7, 64, False, False, False),
    ("declined: block size 6", 7, 6, False, False, True),
]
FUSED = {"fused with counts", "fused without counts"}


@pytest.mark.parametrize("piecewise", [False, True])
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_fused_remap_streams(monkeypatch, path, piecewise):
    from vllm.models.glm5next.nvidia.specialized_decode import fused_remap
    from vllm.models.glm5next.nvidia.specialized_decode.remap_kernel import REMAP
    from vllm.v1.attention.backends.mla import index_group

    name, rows, block, counts, idx_mapping, compiled = path
    # Under piecewise graphs the side stream waits on the compute stream.
    for module in (fused_remap, index_group):
        monkeypatch.setattr(module, "in_piecewise_cudagraph", lambda: piecewise)
    device = torch.device("cuda")
    engines = [Engine(rows, block, device) for _ in range(2)]
    a, b = engines
    assert a.stage.pool_buffer.data_ptr() != b.stage.pool_buffer.data_ptr()
    for i, engine in enumerate(engines):
        engine.x.refill(i)
    ask = REMAP.executor_for

    def compiling(args):  # the warmup of what the conversion asks for
        for key in REMAP.get_warmup_keys([args]):
            REMAP.compile(key)
        return ask(args)

    with monkeypatch.context() as m:
        m.setattr(REMAP, "executor_for", compiling)
        fused_steps(engines, counts, idx_mapping)
    if not compiled:
        monkeypatch.setattr(REMAP, "executor_for", lambda args: None)
    launch, launches = REMAP.launch, []

    def counted(executor, args):
        launches.append(args.out.data_ptr())
        return launch(executor, args)

    monkeypatch.setattr(REMAP, "launch", counted)
    seed = fuzz_seed()
    failures, cases = [], 0
    steps = fuzz_cases(20)
    for i in range(steps):  # eager, each stream behind the other at a hand-off
        for j, engine in enumerate(engines):
            engine.x.refill(seed + 2 * i + j)
        torch.cuda.synchronize()
        expected = [stock_step(e, counts, idx_mapping) for e in engines]
        got = fused_steps(engines, counts, idx_mapping)
        torch.cuda.synchronize()
        for label, g, e in zip("ab", got, expected, strict=True):
            cases += 1
            if not _same(g, e, counts):
                failures.append(f"eager case {i} engine {label}")
    fused = 2 * steps if name in FUSED else 0
    assert len(launches) == fused, f"{len(launches)} fused conversions, not {fused}"
    assert a.remap.pending is None and b.remap.pending is None
    if not piecewise:  # FULL graph capture orders work by the same events
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream(device)
        capture.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture):
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=capture):
                got = fused_steps(engines, counts, idx_mapping)
        for i in range(steps):  # replays with fresh inputs
            for j, engine in enumerate(engines):
                engine.x.refill(seed + 100 + 2 * i + j)
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            expected = [stock_step(e, counts, idx_mapping) for e in engines]
            torch.cuda.synchronize()
            for label, g, e in zip("ab", got, expected, strict=True):
                cases += 1
                if not _same(g, e, counts):
                    failures.append(f"graph replay {i} engine {label}")
        assert a.remap.pending is None and b.remap.pending is None
    report(f"FusedRemap {name} (piecewise {piecewise})", cases, seed, failures)
