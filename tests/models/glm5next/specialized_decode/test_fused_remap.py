# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``FusedRemap`` as a real ``SparseMLAIndexGroup``'s conversion, on its side
stream and events, against the stock group converting the logical rows the
stock indexer writes: physical indices and counts byte for byte, eagerly and
replayed from a captured CUDA graph with fresh inputs."""

import random

import pytest
import torch
from kpool_fuzz import fuzz_seed, needs_cuda, report

pytestmark = [pytest.mark.gpu, needs_cuda()]

POOL, GROUPS, WIDTH, BLOCK, MAX_ROWS = 4, 512, 2176, 64, 64


def make_group():
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

    device = torch.device("cuda")
    group = SparseMLAIndexGroup(
        logical_topk_indices=torch.full((MAX_ROWS, WIDTH), -1, dtype=torch.int32,
                                        device=device),
        physical_topk_indices=torch.empty(MAX_ROWS + 1, WIDTH, dtype=torch.int32,
                                          device=device),
        valid_topk_counts=torch.empty(MAX_ROWS + 1, dtype=torch.int32, device=device),
        side_stream=torch.cuda.Stream(device),
        logical_topk_ready=torch.cuda.Event(),
        physical_topk_ready=torch.cuda.Event(),
        has_indexer=True,
    )  # fmt: skip
    group.register_layer()
    return group


class Inputs:
    """One decode step's pool top-k, positions and block table, in static
    buffers a captured graph reads."""

    def __init__(self, rows: int, device):
        self.rows = rows
        self.pool_ids = torch.empty(rows, GROUPS, dtype=torch.int32, device=device)
        self.positions = torch.empty(rows, dtype=torch.int64, device=device)
        self.req_ids = torch.arange(rows, dtype=torch.int32, device=device)
        self.block_table = torch.empty(rows, 512, dtype=torch.int32, device=device)

    def refill(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(
            0, 512 * BLOCK // POOL + 64, (self.rows, GROUPS), generator=gen
        )
        ids[torch.rand(self.rows, GROUPS, generator=gen) < 0.1] = -1
        self.pool_ids.copy_(ids)
        self.positions.copy_(
            torch.randint(-2, 512 * BLOCK + 8, (self.rows,), generator=gen)
        )
        self.block_table.copy_(
            torch.randint(0, 1 << 20, (self.rows, 512), generator=gen)
        )


def stock_step(group, x: Inputs):
    """What the stock indexer and the stock conversion do for these rows."""
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )

    logical = group.logical_topk_indices[: x.rows]
    logical.fill_(-1)
    expand_pools_and_append_tail(
        x.pool_ids, x.positions, POOL, seq_offset=1, out=logical
    )
    group.set_logical_topk_ready(0)
    out, counts = group._convert_once(
        0, logical, x.req_ids, x.block_table, BLOCK, block_stride_rows=None,
        return_valid_counts=True,
    )  # fmt: skip
    return out.clone(), counts.clone()


def fused_step(group, stage, x: Inputs):
    """The specialized path: the pool top-k handed over, then converted."""
    pool_ids = stage.pool_ids(x.rows, GROUPS)
    pool_ids.copy_(x.pool_ids)
    stage.defer(pool_ids, x.positions, POOL)
    group.set_logical_topk_ready(0)
    return group._convert_once(
        0, group.logical_topk_indices[: x.rows], x.req_ids, x.block_table, BLOCK,
        block_stride_rows=None, return_valid_counts=True,
    )  # fmt: skip


@pytest.mark.parametrize("piecewise", [False, True])
def test_fused_remap_eager_and_graph(monkeypatch, piecewise):
    from vllm.models.glm5next.nvidia.specialized_decode import kpool

    # Under piecewise graphs the side stream waits on the compute stream.
    monkeypatch.setattr(kpool, "in_piecewise_cudagraph", lambda: piecewise)
    seed = fuzz_seed()
    device = torch.device("cuda")
    stock_group, fused_group = make_group(), make_group()
    stage = kpool.KpoolStage([], MAX_ROWS, device)
    fused = kpool.FusedRemap(fused_group, stage)
    assert fused_group._convert_once is fused
    failures, cases = [], 0
    rng = random.Random(seed)
    for rows in (1, 7, MAX_ROWS):
        x = Inputs(rows, device)
        for i in range(20):  # eager
            x.refill(rng.randrange(1 << 30))
            expected = stock_step(stock_group, x)
            out, counts = fused_step(fused_group, stage, x)
            torch.cuda.synchronize()
            cases += 1
            if not (torch.equal(out, expected[0]) and torch.equal(counts, expected[1])):
                failures.append(f"eager rows {rows} case {i}")
        assert stage.pending is None, "the deferred top-k was not consumed"
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream(device)
        capture.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture):
            fused_step(fused_group, stage, x)  # warm, outside the graph
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=capture):
                out, counts = fused_step(fused_group, stage, x)
        for i in range(50):  # replays with fresh inputs
            x.refill(rng.randrange(1 << 30))
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            expected = stock_step(stock_group, x)
            torch.cuda.synchronize()
            cases += 1
            if not (torch.equal(out, expected[0]) and torch.equal(counts, expected[1])):
                failures.append(f"graph rows {rows} replay {i}")
    report(f"FusedRemap (piecewise {piecewise})", cases, seed, failures)
