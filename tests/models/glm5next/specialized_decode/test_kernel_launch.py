# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How the kernels compile and launch (``launch.py``): on fakes, at warmup
only, each engine its own keys; through TVM-FFI with torch tensors.

CPU: the compile scoping (lazy before any warmup, refused after it, allowed
again inside a second engine's warmup) and ``KpoolStage.warmup`` compiling
exactly its keys without launching. GPU: after warmup a planned step's
launches compile nothing, a key warmup did not see raises in the public
function and goes to stock in the stage (stock's bytes), and nothing compiles
inside a CUDA graph capture."""

import os
from types import SimpleNamespace

import pytest
import torch
from kpool_fuzz import needs_cuda

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

DIM, POOL = 128, 4


@pytest.fixture
def fresh(monkeypatch):
    """The launch module as in a new process, and fresh kernel caches."""
    from vllm.models.glm5next.nvidia.specialized_decode import kpool, launch

    monkeypatch.setattr(launch, "_warmed_up", False)
    monkeypatch.setattr(launch, "_warmups_running", 0)
    for kernel in (kpool.UPDATE, kpool.EXPAND, kpool.REMAP, kpool.UPCAST):
        monkeypatch.setattr(kernel, "_compiled_cache", {})
    return kpool, launch


def test_compiles_only_in_warmups_after_the_first(fresh):
    kpool, launch = fresh
    first = kpool.ExpandPoolsKernel.CompileKey(64, torch.int32)
    second = kpool.ExpandPoolsKernel.CompileKey(96, torch.int32)
    kpool.EXPAND.compile(first)  # before any warmup: lazily, for direct use
    with launch.warming_up():
        kpool.EXPAND.compile(kpool.ExpandPoolsKernel.CompileKey(32, torch.int32))
    with pytest.raises(RuntimeError, match="not compiled during warmup"):
        kpool.EXPAND.compile(second)
    assert not kpool.EXPAND.ready(second)
    with launch.warming_up():  # a second engine warms up its own keys
        kpool.EXPAND.compile(second)
    assert kpool.EXPAND.ready(first) and kpool.EXPAND.ready(second)


def _attention(device="cpu", ring=8, page=16, groups=512, width=2176, block=64):
    kv = torch.zeros(4, page, DIM + 4, dtype=torch.uint8, device=device)
    tail = torch.zeros(3, 2, ring, DIM, dtype=torch.bfloat16, device=device)
    indexer = SimpleNamespace(
        k_cache=SimpleNamespace(
            prefix="model.layers.0.self_attn.indexer.k_cache", kv_cache=kv
        ),
        tail_cache=SimpleNamespace(kv_cache=tail),
        topk_tokens=groups * POOL,
        topk_indices_buffer=torch.zeros(2, width, dtype=torch.int32, device=device),
        scale_fmt="ue8m0",
    )
    mla_kv = torch.zeros(5, block, 576, dtype=torch.bfloat16, device=device)
    mla = SimpleNamespace(mla_attn=SimpleNamespace(kv_cache=mla_kv, impl=None))
    return SimpleNamespace(indexer=indexer, mla_attn=mla)


def test_warmup_compiles_the_stage_keys_without_launching(fresh, monkeypatch):
    kpool, launch = fresh
    launched = []
    for kernel in (kpool.UPDATE, kpool.EXPAND, kpool.REMAP, kpool.UPCAST):
        monkeypatch.setattr(kernel, "run", lambda *a: launched.append(a))
    stage = kpool.KpoolStage([], 8, "cpu")
    stage.fuse = True
    attn = _attention()
    keys = stage.compile_keys([attn], torch.int64)
    assert stage.warmup([attn]) == keys
    assert not launched
    for kernel, key in keys:
        assert kernel.ready(key)
    names = {
        (type(kernel).__name__, getattr(key, "positions_dtype", None))
        for kernel, key in keys
    }
    # The update's positions are the indexer's int32 copy; expansions read the
    # runner's int64 positions.
    assert ("KpoolUpdateKernel", torch.int32) in names
    assert ("ExpandRemapKernel", torch.int64) in names
    remaps = [key for kernel, key in keys if kernel is kpool.REMAP]
    assert {key.counts for key in remaps} == {True, False}
    # After warmup nothing compiles outside one.
    with pytest.raises(RuntimeError, match="not compiled during warmup"):
        kpool.EXPAND.compile(kpool.ExpandPoolsKernel.CompileKey(7, torch.int32))


def test_warmup_skips_only_the_remap_keys_the_rule_refuses(fresh):
    """Rows wider than 4096 columns: stock with counts does not compact them
    in column order, so only the no-counts remap is compiled."""
    kpool, _ = fresh
    stage = kpool.KpoolStage([], 8, "cpu")
    stage.fuse = True
    keys = stage.compile_keys([_attention(groups=1024, width=4224)], torch.int64)
    remaps = [key for kernel, key in keys if kernel is kpool.REMAP]
    assert [key.counts for key in remaps] == [False]


@pytest.mark.gpu
@needs_cuda()
def test_no_compile_after_warmup_on_the_gpu(fresh):
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )

    kpool, launch = fresh
    device = torch.device("cuda")
    stage = kpool.KpoolStage([], 8, device)
    stage.fuse = True
    attn = _attention(device, ring=POOL, page=64)
    stage.warmup([attn])
    compiled = sum(
        len(k._compiled_cache)
        for k in (kpool.UPDATE, kpool.EXPAND, kpool.REMAP, kpool.UPCAST)
    )
    i32, i64 = (
        dict(dtype=torch.int32, device=device),
        dict(dtype=torch.int64, device=device),
    )
    # A step of warmed-up layouts (other batch sizes) compiles nothing.
    positions = torch.tensor([[3, 4], [6, 7], [-1, -1]], **i32)
    slots = torch.tensor([[5, -1], [-1, 9], [-1, -1]], **i64)
    tail_slots = torch.arange(1, 4, **i64)[:, None] * POOL + positions % POOL
    key = torch.randn(3, 2, DIM, device=device).to(torch.bfloat16)
    ape = torch.zeros(POOL, DIM, device=device)
    kv, tail = attn.indexer.k_cache.kv_cache, attn.indexer.tail_cache.kv_cache
    stage.update(
        kv, tail, tail_slots, key, key, ape, slots, positions, POOL, round_scale=True
    )
    ids = torch.randint(0, 100, (5, 512), **i32)
    out = torch.empty(5, 2176, **i32)
    counts = torch.empty(5, **i32)
    seq = torch.arange(5, **i64)
    kpool.expand_and_remap(
        ids,
        seq,
        POOL,
        torch.zeros(5, **i32),
        torch.zeros(1, 8, **i32),
        out,
        counts,
        block_size=64,
        stride_rows=64,
    )
    kpool.expand_pools(ids, seq, POOL, out=out)
    logits = torch.randn(3, 1000, device=device).to(torch.bfloat16)
    kpool.upcast_logits(logits, torch.full((3,), 999, **i32))
    torch.cuda.synchronize()
    after = sum(
        len(k._compiled_cache)
        for k in (kpool.UPDATE, kpool.EXPAND, kpool.REMAP, kpool.UPCAST)
    )
    assert after == compiled

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

    # Nor inside a CUDA graph capture, even before any warmup.
    launch._warmed_up = False
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            with pytest.raises(RuntimeError, match="not compiled during warmup"):
                kpool.expand_pools(ids[:, :64], seq, POOL, out=out)
        finally:
            graph.capture_end()
