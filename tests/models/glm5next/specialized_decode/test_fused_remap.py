# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``FusedRemap`` (``runtime/remap.py``) as a real ``SparseMLAIndexGroup``'s
conversion (patch 0005's hook), on its side stream and events, against the
stock group converting the logical rows stock's decode writes: the group's
whole physical rows and counts buffers, byte for byte.

Two engines run side by side, each a ``KpoolStage`` with one fused layer
(its own group, pool buffer and hand-off) fed its own inputs, their steps
interleaved: both defer, then both convert. A stage that read the other's
pool buffer or hand-off would convert the other's pool ids.

Every hand-off between the compute stream and the side stream runs with the
other stream held back (``torch.cuda._sleep``): the compute stream after
each deferral's ready event (the side stream must wait for it), the side
stream before each eager conversion (the compute stream, which copies the
result at once, must wait for it). Eagerly, replayed from a captured CUDA
graph and under piecewise graphs (the side stream waits on the compute
stream): the fused conversion with and without counts, and each way it
declines (rows past the group's buffers, a key the stage's warmup did not
compile, a block size the kernel does not take), where the stock conversion
must read the rows ``materialize`` writes, never the stale ones."""

from types import SimpleNamespace

import pytest
import torch
from kpool_fuzz import fuzz_cases, fuzz_seed, report

from vllm.models.glm5next.nvidia.specialized_decode import cases
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.remap.launch import (
    REMAP,
)

pytestmark = pytest.mark.gpu

POOL, GROUPS, WIDTH, MAX_ROWS = 4, 512, 2176, 64
COLS = GROUPS * POOL + POOL - 1
LAYER = "model.layers.0.self_attn"
# Cycles a stream is held back at each hand-off.
HOLD_BACK = 2_000_000


def make_group(device, gen):
    """A layer's index group whose physical rows (``MAX_ROWS + 1``) are
    fewer than its logical ones, so that a step can have rows past them;
    its outputs random bytes."""
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

    group = SparseMLAIndexGroup(
        logical_topk_indices=torch.full(
            (2 * MAX_ROWS, WIDTH), -1, dtype=torch.int32, device=device
        ),
        physical_topk_indices=cases.poisoned((MAX_ROWS + 1, WIDTH), torch.int32, gen),
        valid_topk_counts=cases.poisoned((MAX_ROWS + 1,), torch.int32, gen),
        side_stream=torch.cuda.Stream(device),
        logical_topk_ready=torch.cuda.Event(),
        physical_topk_ready=torch.cuda.Event(),
        has_indexer=True,
    )
    group.register_layer()
    return group


class Inputs:
    """One decode step's pool top-k, positions and block table, in static
    buffers a captured graph reads."""

    def __init__(self, rows: int, block: int, device):
        self.rows, self.block = rows, block
        self.pool_ids = torch.empty(rows, GROUPS, dtype=torch.int32, device=device)
        self.positions = torch.empty(rows, dtype=torch.int64, device=device)
        self.req_ids = torch.arange(rows, dtype=torch.int32, device=device)
        self.block_table = torch.empty(rows, 512, dtype=torch.int32, device=device)

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

    def metadata(self):
        """What the group's conversion reads of the attention metadata."""
        return SimpleNamespace(
            req_id_per_token=self.req_ids,
            block_table=self.block_table,
            block_size=self.block,
        )


class Engine:
    """One engine: a ``KpoolStage`` on one DSA layer whose index group fuses
    (the stage sets the group's conversion to the layer's ``FusedRemap``),
    the stock group it is compared with, and its own inputs."""

    def __init__(self, rows: int, block: int, device, gen):
        from vllm.model_executor.layers.attention.sparse_mla_attention import (
            SparseMLACommonImpl,
        )
        from vllm.models.glm5next.nvidia.specialized_decode.runtime.stage import (
            KpoolStage,
        )

        self.group, self.stock_group = make_group(device, gen), make_group(device, gen)
        self.stock_group.physical_topk_indices.copy_(self.group.physical_topk_indices)
        self.stock_group.valid_topk_counts.copy_(self.group.valid_topk_counts)
        # The shared sparse MLA decode (SM100's), which converts through the
        # group; unconstructed: no method of it is called.
        impl = SparseMLACommonImpl.__new__(SparseMLACommonImpl)
        vars(impl).update(index_group=self.group, index_group_index=0, dcp_world_size=1)
        indexer = SimpleNamespace(
            k_cache=SimpleNamespace(prefix=f"{LAYER}.indexer.k_cache"),
            tail_cache=None,
            topk_indices_buffer=self.group.logical_topk_indices,
            topk_tokens=POOL * GROUPS,
        )
        attn = SimpleNamespace(
            indexer=indexer,
            mla_attn=SimpleNamespace(mla_attn=SimpleNamespace(impl=impl)),
        )
        self.stage = KpoolStage([attn], MAX_ROWS, device, mx_scales=False)
        self.remap = self.stage.remaps[f"{LAYER}.indexer.k_cache"]
        assert self.group.conversion is self.remap and self.remap.stage is self.stage
        self.x = Inputs(rows, block, device)
        self.launched = []

    def compile(self, counts: bool, block: int) -> None:
        """The stage's warmup of the remap key of ``block``-token blocks
        (each launch recorded)."""
        key = REMAP.dispatch(
            groups=GROUPS,
            width=WIDTH,
            block_size=block,
            stride_rows=block,
            positions_dtype=torch.int64,
            int32_lengths=True,
            counts=counts,
        )
        executor = REMAP.executor(key)

        def launch(*args):
            self.launched.append(key)
            executor(*args)

        self.stage.executors = {key: launch}


def _convert(group, x: Inputs, counts: bool):
    """The sparse MLA decode's conversion of the layer's rows through its
    group, copied on the compute stream as the decode reads it next."""
    logical = group.logical_topk_indices[: x.rows]
    result = group.convert_logical_to_physical_topk(
        0, logical, x.metadata(), block_stride_rows=None, return_valid_counts=counts
    )
    out, valid = result if counts else (result, None)
    return out.clone(), None if valid is None else valid.clone()


def stock_step(engine: Engine, counts: bool):
    """What stock's decode and the stock conversion write for these rows:
    ``expand_pools_and_append_tail(pool_ids.to(torch.int64),
    positions.to(torch.int32) + 1, 4)`` into -1 rows, then the group's
    conversion; with the group's whole buffers."""
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )

    group, x = engine.stock_group, engine.x
    logical = group.logical_topk_indices[: x.rows]
    logical.fill_(-1)
    logical[:, :COLS] = expand_pools_and_append_tail(
        x.pool_ids.to(torch.int64), x.positions.to(torch.int32) + 1, POOL
    )
    group.set_logical_topk_ready(0)
    result = _convert(group, x, counts)
    return (
        *result,
        group.physical_topk_indices.clone(),
        group.valid_topk_counts.clone(),
    )


def hand_over(engine: Engine) -> None:
    """The indexer's deferral in a planned step (``LayerStep.decode_rows``
    of a deferring step): the pool top-k into the stage's pool buffer,
    handed to the layer's conversion; then its ready event, the compute
    stream held back. The logical rows hold the previous step's."""
    from vllm.models.glm5next.nvidia.specialized_decode.runtime.remap import (
        Deferred,
    )

    x, group = engine.x, engine.group
    group.logical_topk_indices[: x.rows].fill_(7)
    pool = engine.stage.pool_ids(x.rows, GROUPS, x.pool_ids.device, True)
    assert pool.data_ptr() == engine.stage.pool_buffer.data_ptr()
    pool.copy_(x.pool_ids)
    engine.remap.hand_over(Deferred(pool, x.positions))
    group.set_logical_topk_ready(0)
    torch.cuda._sleep(HOLD_BACK)


def fused_steps(engines, counts: bool):
    """Both engines defer, then both convert, each conversion's side stream
    held back (outside a capture) and its result copied at once."""
    for engine in engines:
        hand_over(engine)
    results = []
    for engine in engines:
        group = engine.group
        if not torch.cuda.is_current_stream_capturing():
            with torch.cuda.stream(group.side_stream):
                torch.cuda._sleep(HOLD_BACK)
        result = _convert(group, engine.x, counts)
        results.append((*result, group.physical_topk_indices, group.valid_topk_counts))
    return results


def _same(got, expected, counts: bool) -> bool:
    """The rows the decode read, and the group's whole buffers (the counts'
    only where the conversion has them: without counts neither writes it)."""
    same = torch.equal(got[0], expected[0]) and torch.equal(got[2], expected[2])
    return same and (
        not counts
        or (torch.equal(got[1], expected[1]) and torch.equal(got[3], expected[3]))
    )


# (name, rows, block size, counts, compiled): how a conversion fuses or
# declines.
PATHS = [
    ("fused with counts", 7, 64, True, True),
    ("fused without counts", 7, 64, False, True),
    ("declined: rows past the buffers", MAX_ROWS + 3, 64, True, True),
    ("declined: not compiled", 7, 64, False, False),
    ("declined: block size 6", 7, 6, False, True),
]
FUSED = {"fused with counts", "fused without counts"}


@pytest.mark.parametrize("piecewise", [False, True])
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_fused_remap_streams(monkeypatch, path, piecewise):
    from vllm.models.glm5next.nvidia.specialized_decode.runtime import remap
    from vllm.v1.attention.backends.mla import index_group

    name, rows, block, counts, compiled = path
    # Under piecewise graphs the side stream waits on the compute stream.
    for module in (remap, index_group):
        monkeypatch.setattr(module, "in_piecewise_cudagraph", lambda: piecewise)
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(1)
    engines = [Engine(rows, block, device, gen) for _ in range(2)]
    a, b = engines
    assert a.stage.pool_buffer.data_ptr() != b.stage.pool_buffer.data_ptr()
    for engine in engines:
        if compiled:  # (block size 6: the 64-token key; the rule refuses 6)
            engine.compile(counts, block if block % POOL == 0 else 64)
    seed, steps = fuzz_seed(), fuzz_cases(20)
    failures, cases_run = [], 0
    for i in range(steps):  # eager, each stream behind the other at a hand-off
        for j, engine in enumerate(engines):
            engine.x.refill(seed + 2 * i + j)
        torch.cuda.synchronize()
        expected = [stock_step(e, counts) for e in engines]
        got = fused_steps(engines, counts)
        torch.cuda.synchronize()
        for label, g, e in zip("ab", got, expected, strict=True):
            cases_run += 1
            if not _same(g, e, counts):
                failures.append(f"eager step {i} engine {label}")
    fused = steps if name in FUSED else 0
    assert [len(e.launched) for e in engines] == [fused, fused]
    assert a.remap.pending is None and b.remap.pending is None
    if not piecewise:  # FULL graph capture orders work by the same events
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream(device)
        capture.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture):
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=capture):
                got = fused_steps(engines, counts)
        for i in range(steps):  # replays with fresh inputs
            for j, engine in enumerate(engines):
                engine.x.refill(seed + 100 + 2 * i + j)
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            expected = [stock_step(e, counts) for e in engines]
            torch.cuda.synchronize()
            for label, g, e in zip("ab", got, expected, strict=True):
                cases_run += 1
                if not _same(g, e, counts):
                    failures.append(f"graph replay {i} engine {label}")
        assert a.remap.pending is None and b.remap.pending is None
    report(f"FusedRemap {name} (piecewise {piecewise})", cases_run, seed, failures)
