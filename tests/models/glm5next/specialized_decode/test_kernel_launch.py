# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compilation happens at warmup only: after ``freeze`` a planned step's
launches find their kernels compiled, a launch that would compile raises, and
``KpoolStage`` sends such an input to stock instead (same bytes)."""

import pytest
import torch
from kpool_fuzz import needs_cuda

pytestmark = [pytest.mark.gpu, needs_cuda()]

DIM, POOL = 128, 4


def test_no_compile_after_warmup(monkeypatch):
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )
    from vllm.models.glm5next.nvidia.specialized_decode import kpool

    monkeypatch.setattr(kpool, "_compiled", {})
    monkeypatch.setattr(kpool, "_frozen", False)
    device = torch.device("cuda")
    mx = torch.cuda.get_device_capability()[0] == 10
    kv = torch.zeros(8, 64, DIM + 4, dtype=torch.uint8, device=device)
    tail = torch.zeros(9, 2, POOL, DIM, dtype=torch.bfloat16, device=device)
    kpool._warm_update(kv, tail, torch.int64, mx, True)
    kpool._warm_expand(512, torch.int64, device)
    kpool._warm_remap(512, 2176, 64, 64, torch.int64, device)
    kpool._warm_upcast(device)
    kpool.freeze()
    compiled = len(kpool._compiled)
    assert compiled == 5  # upcast has a small- and a large-batch config

    # A step of warmed-up shapes (other batch sizes) compiles nothing.
    ints = dict(dtype=torch.int64, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    requests, tokens = 3, 2
    positions = torch.tensor([[3, 4], [6, 7], [-1, -1]], **i32)
    slots = torch.tensor([[5, -1], [-1, 9], [-1, -1]], **ints)
    tail_slots = torch.arange(1, 4, **ints)[:, None] * POOL + positions % POOL
    key = torch.randn(requests, tokens, DIM, device=device).to(torch.bfloat16)
    ape = torch.zeros(POOL, DIM, device=device)
    kpool.kpool_update(
        kv, tail, tail_slots, key, key, ape, slots, positions, POOL, mx_scales=mx
    )
    ids = torch.randint(0, 100, (5, 512), **i32)
    out = torch.empty(5, 2176, **i32)
    counts = torch.empty(5, **i32)
    seq = torch.arange(5, **ints)
    req_ids, block_table = torch.zeros(5, **i32), torch.zeros(1, 8, **i32)
    kpool.expand_and_remap(
        ids, seq, POOL, req_ids, block_table, out, counts, block_size=64,
        stride_rows=64,
    )  # fmt: skip
    kpool.expand_pools(ids, seq, POOL, out=out)
    logits = torch.randn(3, 1000, device=device).to(torch.bfloat16)
    kpool.upcast_logits(logits, torch.full((3,), 999, **i32))
    torch.cuda.synchronize()
    assert len(kpool._compiled) == compiled

    # A shape warmup did not see: the kernel refuses to compile ...
    ids96 = ids[:, :96]
    with pytest.raises(RuntimeError, match="not compiled during warmup"):
        kpool.expand_pools(ids96, seq, POOL, out=out)
    # ... and the stage gives it to stock, with stock's bytes.
    stock_out, stage_out = out.clone().fill_(7), out.clone().fill_(7)
    expand_pools_and_append_tail(ids96, seq, POOL, out=stock_out)
    kpool.KpoolStage.expand(ids96, seq, POOL, out=stage_out)
    torch.cuda.synchronize()
    assert torch.equal(stock_out, stage_out)
    assert len(kpool._compiled) == compiled


def test_no_compile_inside_cuda_graph_capture(monkeypatch):
    from vllm.models.glm5next.nvidia.specialized_decode import kpool

    monkeypatch.setattr(kpool, "_compiled", {})
    monkeypatch.setattr(kpool, "_frozen", False)
    device = torch.device("cuda")
    ids = torch.zeros(2, 64, dtype=torch.int32, device=device)
    out = torch.empty(2, 260, dtype=torch.int32, device=device)
    seq = torch.zeros(2, dtype=torch.int32, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            with pytest.raises(RuntimeError, match="not compiled during warmup"):
                kpool.expand_pools(ids, seq, POOL, out=out)
        finally:
            graph.capture_end()
    assert not kpool._compiled
