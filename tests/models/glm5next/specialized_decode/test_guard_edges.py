# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Each rule's edge through ``KpoolStage`` on the GPU: just inside it the
kernel runs and its bytes are stock's; just outside it the stock function
runs (the kernel is never launched), with stock's bytes of course."""

import pytest
import torch
from kpool_fuzz import differs, needs_cuda, poison

pytestmark = [pytest.mark.gpu, needs_cuda()]

DIM, POOL = 128, 4


@pytest.fixture
def spy(monkeypatch):
    """Which kernels ``KpoolStage`` launched (their keys compiled first, as at
    warmup)."""
    from vllm.models.glm5next.nvidia.specialized_decode import kpool, launch

    # Warming up here must not end lazy compiles for the tests that follow.
    monkeypatch.setattr(launch, "_warmed_up", False)
    launched: list[str] = []
    for name in ("UPDATE", "EXPAND", "REMAP", "UPCAST"):
        kernel = getattr(kpool, name)
        run = kernel.run

        def spied(key, *args, name=name, run=run):
            launched.append(name)
            run(key, *args)

        monkeypatch.setattr(kernel, "run", spied)

    def warm(kernel, key):
        with launch.warming_up():
            kernel.compile(key)

    return kpool, launched, warm


def _copy(view: torch.Tensor) -> torch.Tensor:
    base = view.as_strided(
        (view.untyped_storage().nbytes() // view.element_size(),), (1,), 0
    )
    return base.clone().as_strided(view.shape, view.stride(), view.storage_offset())


def update_case(gen, ring=8, page_pad=0, key_stride=DIM, tail_pad=0):
    device = gen.device
    g = dict(generator=gen, device=device)
    requests, tokens, page = 5, 3, 16
    page_bytes = page * (DIM + 4) + page_pad
    cache = torch.randint(0, 256, (6 * page_bytes,), dtype=torch.uint8, **g)
    kv = cache.as_strided((6, page, DIM + 4), (page_bytes, DIM + 4, 1))
    block = 2 * ring * DIM + tail_pad
    tail = torch.randn((requests + 1) * block, **g).to(torch.bfloat16)
    tail = tail.as_strided((requests + 1, 2, ring, DIM), (block, ring * DIM, DIM, 1))
    positions = (
        torch.randint(0, 999, (requests, 1), **g) + torch.arange(tokens, device=device)
    ).to(torch.int32)
    tail_slots = (
        torch.arange(1, requests + 1, device=device)[:, None] * ring
        + positions.long() % ring
    )
    slots = torch.where(
        positions % POOL == POOL - 1,
        torch.randperm(6 * page, **g)[: requests * tokens].view(requests, tokens),
        -1,
    )
    key = torch.randn(requests, tokens, key_stride, **g).to(torch.bfloat16)[..., :DIM]
    score = torch.randn(requests, tokens, DIM, **g).to(torch.bfloat16)
    ape = torch.randn(POOL, DIM, **g)
    return [kv, tail, tail_slots, key, score, ape, slots, positions]


@pytest.mark.parametrize(
    "edge,inside",
    [
        (dict(ring=4), True),
        (dict(ring=12), True),
        (dict(tail_pad=4), True),
        (dict(tail_pad=2), False),
        (dict(page_pad=4), True),
        (dict(key_stride=DIM + 4), True),
        (dict(key_stride=DIM + 2), False),
    ],
)
def test_update_edges(spy, edge, inside):
    from vllm.models.glm5next.nvidia.ops import kpool_compress

    kpool, launched, warm = spy
    gen = torch.Generator("cuda").manual_seed(11)
    args = update_case(gen, **edge)
    mx = kpool.mqa_logits_use_mx_scales()
    if inside:
        warm(kpool.UPDATE, kpool._update_key(*args, mx, True))
    # Copies of the two caches with their strides (padding included).
    ours, stock = (
        [_copy(a) if i < 2 else a for i, a in enumerate(args)] for _ in range(2)
    )
    kpool.KpoolStage.update(*ours, POOL, DIM, round_scale=True)
    kpool_compress.kpool_decode_update_and_maybe_write_cache_batched(
        *stock, POOL, DIM, round_scale=True
    )
    torch.cuda.synchronize()
    assert launched == (["UPDATE"] if inside else [])
    assert not differs("fp8 cache", stock[0], ours[0])
    assert not differs("tail", stock[1], ours[1])


@pytest.mark.parametrize(
    "edge,inside",
    [
        (dict(out_stride=2052), True),
        (dict(out_stride=2054), False),
        (dict(seq_offset=2**31 - 1), True),
        (dict(seq_offset=2**31), False),
        (dict(groups=0), True),
    ],
)
def test_expand_edges(spy, edge, inside):
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )

    kpool, launched, warm = spy
    gen = torch.Generator("cuda").manual_seed(7)
    groups = edge.get("groups", 512)
    stride = edge.get("out_stride", groups * POOL + POOL)
    offset = edge.get("seq_offset", 1)
    rows = 6
    ids = torch.randint(-1, 99999, (rows, groups), generator=gen, device="cuda")
    ids = ids.to(torch.int32)
    seq = torch.randint(0, 2**30, (rows,), generator=gen, device="cuda")
    if inside:
        warm(kpool.EXPAND, kpool.ExpandPoolsKernel.CompileKey(groups, seq.dtype))
    buffers = [poison((rows, stride), torch.int32, gen) for _ in range(2)]
    buffers[1].copy_(buffers[0])
    out_cols = groups * POOL + POOL - 1
    views = [b[:, :out_cols] for b in buffers]
    kpool.KpoolStage.expand(ids, seq, POOL, seq_offset=offset, out=views[0])
    expand_pools_and_append_tail(ids, seq, POOL, seq_offset=offset, out=views[1])
    torch.cuda.synchronize()
    assert launched == (["EXPAND"] if inside else [])
    assert not differs("out", buffers[1], buffers[0])


@pytest.mark.parametrize(
    "edge,inside",
    [
        (dict(logits_stride=1008), True),
        (dict(logits_stride=1004), False),
        (dict(ends_shape=(5,)), True),
        (dict(ends_shape=(5, 1)), False),
    ],
)
def test_upcast_edges(spy, edge, inside):
    from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits

    kpool, launched, warm = spy
    gen = torch.Generator("cuda").manual_seed(3)
    rows, width = 5, 1000
    stride = edge.get("logits_stride", 1008)
    storage = torch.randn(rows * stride, generator=gen, device="cuda")
    logits = storage.to(torch.bfloat16).as_strided((rows, width), (stride, 1))
    ends = torch.randint(0, width + 1, (rows,), generator=gen, device="cuda")
    ends = ends.to(torch.int32).view(edge.get("ends_shape", (rows,)))
    if inside:
        warm(kpool.UPCAST, kpool.UpcastLogitsKernel.CompileKey())
    got = kpool.KpoolStage.upcast(logits, ends)
    expected = as_fp32_logits(logits, ends)
    ends = ends.view(-1)
    torch.cuda.synchronize()
    assert launched == (["UPCAST"] if inside else [])
    below = torch.arange(width, device="cuda")[None, :] < ends[:, None]
    assert torch.equal(got.view(torch.int32)[below], expected.view(torch.int32)[below])


@pytest.mark.parametrize(
    "edge,inside",
    [
        (dict(groups=32, width=256), True),
        (dict(groups=48, width=256), False),
        (dict(groups=1024, width=8192), True),
        (dict(groups=992, width=4096, block=4), True),
        (dict(groups=512, width=2176, block=6), False),
        (dict(groups=512, width=2176, block=12), True),
    ],
)
def test_remap_edges(spy, edge, inside):
    """Through a real group: outside the rule the deferred rows are
    materialized and the stock conversion runs on them."""
    from test_fused_remap import Inputs, make_group

    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )

    kpool, launched, warm = spy
    groups, width, block = edge["groups"], edge["width"], edge.get("block", 64)
    device = torch.device("cuda")
    x = Inputs(6, block, device)
    x.pool_ids = torch.randint(
        -1, 512 * block // POOL, (6, groups), dtype=torch.int32, device=device
    )
    x.positions.copy_(torch.randint(0, 512 * block, (6,), device=device))
    x.block_table.copy_(torch.randint(0, 1 << 20, (6, 512), device=device))
    if inside:
        key = kpool.ExpandRemapKernel.CompileKey(
            groups, width, block, block, torch.int64, True
        )
        warm(kpool.REMAP, key)
        warm(kpool.EXPAND, kpool.ExpandPoolsKernel.CompileKey(groups, torch.int64))

    def group_of(width):
        group = make_group(device)
        group.logical_topk_indices = torch.full(
            (16, width), -1, dtype=torch.int32, device=device
        )
        group.physical_topk_indices = torch.empty(
            9, width, dtype=torch.int32, device=device
        )
        return group

    stock_group, fused_group = group_of(width), group_of(width)
    stage = kpool.KpoolStage([], 8, device)
    kpool.FusedRemap(fused_group, stage)
    stage.deferring = True
    pool = stage.pool_topk(x.rows, groups, device)
    pool.copy_(x.pool_ids)

    class Decode:
        requires_padding = False

    stage.resolve(pool, x.positions, Decode, None)
    fused_group.set_logical_topk_ready(0)
    got = fused_group._convert_once(
        0,
        fused_group.logical_topk_indices[: x.rows],
        x.req_ids,
        x.block_table,
        block,
        block_stride_rows=None,
        return_valid_counts=True,
    )
    logical = stock_group.logical_topk_indices[: x.rows]
    expand_pools_and_append_tail(
        x.pool_ids, x.positions, POOL, seq_offset=1, out=logical
    )
    stock_group.set_logical_topk_ready(0)
    expected = stock_group._convert_once(
        0,
        logical,
        x.req_ids,
        x.block_table,
        block,
        block_stride_rows=None,
        return_valid_counts=True,
    )
    torch.cuda.synchronize()
    assert ("REMAP" in launched) == inside
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
