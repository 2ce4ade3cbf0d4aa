# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``FusedRemap`` as a real ``SparseMLAIndexGroup``'s conversion, on its side
stream and events, against the stock group converting the logical rows the
stock indexer writes: physical indices (and counts) byte for byte.

Every path that hands data between the compute stream and the side stream
runs with the compute stream held back (``torch.cuda._sleep`` after the
indexer's event record), eagerly, replayed from a captured CUDA graph and
under piecewise graphs (the side stream waits on the compute stream): the
fused conversion with and without counts, and each way it declines (an
``idx_mapping``, rows past the group's buffers, a kernel not compiled, a
block size the kernel does not take), where the stock conversion must read
the rows ``materialize`` writes, never the stale ones."""

import pytest
import torch
from kpool_fuzz import fuzz_seed, needs_cuda, report

pytestmark = [pytest.mark.gpu, needs_cuda()]

POOL, GROUPS, WIDTH, MAX_ROWS = 4, 512, 2176, 64
# Cycles the compute stream sleeps after the indexer's event record.
HOLD_BACK = 2_000_000


def make_group(device):
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

    group = SparseMLAIndexGroup(
        logical_topk_indices=torch.full(
            (MAX_ROWS * 2, WIDTH), -1, dtype=torch.int32, device=device
        ),
        physical_topk_indices=torch.empty(
            MAX_ROWS + 1, WIDTH, dtype=torch.int32, device=device
        ),
        valid_topk_counts=torch.empty(MAX_ROWS + 1, dtype=torch.int32, device=device),
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


def stock_step(group, x: Inputs, counts: bool, idx_mapping: bool):
    """What the stock indexer and the stock conversion write for these rows."""
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )

    logical = group.logical_topk_indices[: x.rows]
    logical.fill_(-1)
    expand_pools_and_append_tail(
        x.pool_ids, x.positions, POOL, seq_offset=1, out=logical
    )
    group.set_logical_topk_ready(0)
    result = group._convert_once(
        0,
        logical,
        x.req_ids,
        x.block_table,
        x.block,
        block_stride_rows=None,
        return_valid_counts=counts,
        **({"idx_mapping": x.idx_mapping} if idx_mapping else {}),
    )
    out, valid = result if counts else (result, None)
    return out.clone(), None if valid is None else valid.clone()


def hand_over(stage, x: Inputs) -> None:
    """The indexer's deferral of the step's pool top-k (the stage's API)."""
    if hasattr(stage, "resolve"):
        stage.deferring = True
        pool = stage.pool_topk(x.rows, GROUPS, x.pool_ids.device)
        pool.copy_(x.pool_ids)

        class Decode:
            requires_padding = False

        assert stage.resolve(pool, x.positions, Decode, None)
    else:  # the stage before the fix, for the record of the race
        pool = stage.pool_ids(x.rows, GROUPS)
        pool.copy_(x.pool_ids)
        stage.defer(pool, x.positions, POOL)


def fused_step(group, stage, x: Inputs, counts: bool, idx_mapping: bool):
    """The specialized path: stale logical rows, the pool top-k handed over,
    the indexer's event record, the compute stream held back, the conversion."""
    group.logical_topk_indices[: x.rows].fill_(7)  # the previous step's rows
    hand_over(stage, x)
    group.set_logical_topk_ready(0)
    torch.cuda._sleep(HOLD_BACK)
    return group._convert_once(
        0,
        group.logical_topk_indices[: x.rows],
        x.req_ids,
        x.block_table,
        x.block,
        block_stride_rows=None,
        return_valid_counts=counts,
        **({"idx_mapping": x.idx_mapping} if idx_mapping else {}),
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


@pytest.fixture
def stage_and_groups(monkeypatch):
    from vllm.models.glm5next.nvidia.specialized_decode import kpool

    device = torch.device("cuda")
    stock_group, fused_group = make_group(device), make_group(device)
    stage = kpool.KpoolStage([], MAX_ROWS, device)
    fused = kpool.FusedRemap(fused_group, stage)
    assert fused_group._convert_once is fused
    return kpool, stage, stock_group, fused_group


def _same(got, expected, counts: bool) -> bool:
    out, valid = got if counts else (got, None)
    return torch.equal(out, expected[0]) and (
        not counts or torch.equal(valid, expected[1])
    )


def _not_compiled(monkeypatch, kpool):
    """The remap kernel has no executor and may not compile one."""
    if hasattr(kpool, "REMAP"):
        from vllm.models.glm5next.nvidia.specialized_decode import launch

        monkeypatch.setattr(kpool.REMAP, "_compiled_cache", {})
        monkeypatch.setattr(launch, "_warmed_up", True)
    else:
        monkeypatch.setattr(kpool, "_compiled", {})
        monkeypatch.setattr(kpool, "_frozen", True)


@pytest.mark.parametrize("piecewise", [False, True])
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_fused_remap_streams(monkeypatch, stage_and_groups, path, piecewise):
    from vllm.v1.attention.backends.mla import index_group

    kpool, stage, stock_group, fused_group = stage_and_groups
    name, rows, block, counts, idx_mapping, compiled = path
    # Under piecewise graphs the side stream waits on the compute stream.
    for module in (kpool, index_group):
        monkeypatch.setattr(module, "in_piecewise_cudagraph", lambda: piecewise)
    device = torch.device("cuda")
    x = Inputs(rows, block, device)
    x.refill(0)
    fused_step(fused_group, stage, x, counts, idx_mapping)  # compile (eagerly)
    if not compiled:
        _not_compiled(monkeypatch, kpool)
    seed = fuzz_seed()
    failures, cases = [], 0
    for i in range(20):  # eager, the compute stream behind the side stream
        x.refill(seed + i)
        torch.cuda.synchronize()
        expected = stock_step(stock_group, x, counts, idx_mapping)
        got = fused_step(fused_group, stage, x, counts, idx_mapping)
        torch.cuda.synchronize()
        cases += 1
        if not _same(got, expected, counts):
            failures.append(f"eager case {i}")
    assert stage.pending is None, "the deferred top-k was not consumed"
    if not piecewise:  # FULL graph capture orders work by the same events
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream(device)
        capture.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture):
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=capture):
                got = fused_step(fused_group, stage, x, counts, idx_mapping)
        for i in range(20):  # replays with fresh inputs
            x.refill(seed + 100 + i)
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            expected = stock_step(stock_group, x, counts, idx_mapping)
            torch.cuda.synchronize()
            cases += 1
            if not _same(got, expected, counts):
                failures.append(f"graph replay {i}")
    report(f"FusedRemap {name} (piecewise {piecewise})", cases, seed, failures)
