# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The warmup self-check (``self_check.py``, run by the JIT warmup entry of
``install``): kernels that give stock's bytes turn the stage on; a kernel
that differs keeps it off with one error line naming the kernel, the case
and the seed ("strict": raises); "off" skips it.

CPU: the kernels' launches are replaced by their stock twins (stock Triton
interpreted), one of them corrupted on purpose. GPU: the real kernels pass on
this GPU, within the start-up budget, and a corrupted variant is caught."""

import logging
import time
from types import SimpleNamespace

import pytest
import torch
from kpool_fuzz import needs_cuda

DIM, POOL = 128, 4


def stock_twins(kpool):
    """``run`` of each kernel singleton as its stock twin computes it."""
    from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
    from vllm.models.glm5next.nvidia.ops import kpool_compress as ops
    from vllm.v1.attention.backends.mla.sparse_utils import (
        triton_convert_req_index_to_global_index,
    )

    def update(key, kv, tail, *args):
        ops.kpool_decode_update_and_maybe_write_cache_batched(
            kv, tail, *args, POOL, DIM, round_scale=key.round_scale
        )

    def expand(key, ids, lengths, out, offset):
        ops.expand_pools_and_append_tail(ids, lengths, POOL, seq_offset=offset, out=out)

    def remap(key, ids, positions, req_ids, table, out, counts, offset):
        logical = torch.full_like(out, -1)
        if ids.shape[0]:
            ops.expand_pools_and_append_tail(
                ids, positions[: ids.shape[0]], POOL, seq_offset=offset,
                out=logical[: ids.shape[0]],
            )  # fmt: skip
        triton_convert_req_index_to_global_index(
            req_ids, table, logical, BLOCK_SIZE=key.block_size,
            BLOCK_STRIDE_ROWS=key.stride_rows, NUM_TOPK_TOKENS=out.shape[1],
            return_valid_counts=counts is not None, out=out,
            valid_counts_out=None if counts is None else counts[: out.shape[0]],
        )  # fmt: skip

    def upcast(key, logits, out, ends, ctas):
        want = as_fp32_logits(logits, ends)
        below = torch.arange(logits.shape[1])[None, :] < ends[:, None]
        out[below] = want[below]

    return {kpool.UPDATE: update, kpool.EXPAND: expand, kpool.REMAP: remap,
            kpool.UPCAST: upcast}  # fmt: skip


def keys_for(kpool):
    """One variant of each kernel, in GLM-5-Next's layouts."""
    i32, i64 = torch.int32, torch.int64
    return [
        (kpool.UPDATE, kpool.KpoolUpdateKernel.CompileKey(
            8, 16, 16 * (DIM + 4), 2 * 8 * DIM, 8 * DIM, False, True, i64, i64, i32)),
        (kpool.EXPAND, kpool.ExpandPoolsKernel.CompileKey(32, i64)),
        (kpool.REMAP, kpool.ExpandRemapKernel.CompileKey(32, 256, 64, 64, i64, True)),
        (kpool.UPCAST, kpool.UpcastLogitsKernel.CompileKey()),
    ]  # fmt: skip


@pytest.fixture
def cpu_kernels(monkeypatch):
    from vllm.models.glm5next.nvidia.ops import kpool_compress
    from vllm.models.glm5next.nvidia.specialized_decode import kpool

    monkeypatch.setattr(kpool_compress, "mqa_logits_use_mx_scales", lambda: False)
    for kernel, twin in stock_twins(kpool).items():
        monkeypatch.setattr(kernel, "run", twin)
    return kpool


def _warmup(stage, plan, mode):
    from vllm.models.glm5next.nvidia import specialized_decode as sd

    return sd._KpoolWarmup(stage, [], plan, mode)


def test_matching_kernels_turn_the_stage_on(cpu_kernels, monkeypatch):
    from vllm.models.glm5next.nvidia import specialized_decode as sd
    from vllm.models.glm5next.nvidia.specialized_decode import self_check

    kpool = cpu_kernels
    monkeypatch.setattr(self_check, "CASES", 1)
    stage = kpool.KpoolStage([], 8, "cpu")
    monkeypatch.setattr(stage, "warmup", lambda *a, **k: keys_for(kpool))
    plan = sd._Plan(max_rows=8, layer="layer")
    _warmup(stage, plan, "on").compile(("dsa_kpool", 8))
    assert plan.warmed


@pytest.mark.parametrize("corrupt", ["UPDATE", "EXPAND", "REMAP", "UPCAST"])
def test_a_differing_kernel_keeps_the_stage_off(cpu_kernels, monkeypatch, caplog,
                                                corrupt):  # fmt: skip
    from vllm.models.glm5next.nvidia import specialized_decode as sd
    from vllm.models.glm5next.nvidia.specialized_decode import self_check

    kpool = cpu_kernels
    monkeypatch.setattr(self_check, "CASES", 1)
    kernel = getattr(kpool, corrupt)
    twin = kernel.run
    # The argument each kernel writes (the cache, the expansion, the remap,
    # the upcast).
    written = dict(UPDATE=0, EXPAND=2, REMAP=4, UPCAST=1)[corrupt]

    def corrupted(key, *args):
        twin(key, *args)
        args[written].view(torch.uint8).bitwise_xor_(1)  # flipped bits

    monkeypatch.setattr(kernel, "run", corrupted)
    monkeypatch.setenv(sd.SELF_CHECK_SEED_ENV, "1234")
    stage = kpool.KpoolStage([], 8, "cpu")
    keys = [(k, key) for k, key in keys_for(kpool) if k is kernel]
    monkeypatch.setattr(stage, "warmup", lambda *a, **k: keys)
    plan = sd._Plan(max_rows=8, layer="layer")
    with caplog.at_level(logging.ERROR):
        _warmup(stage, plan, "on").compile(("dsa_kpool", 8))
    assert not plan.warmed, "a mismatch must keep the stage off"
    assert not sd.planned()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert f"{type(kernel).__name__} case 0 (seed 1234)" in errors[0]
    assert f"{sd.SELF_CHECK_SEED_ENV}=1234" in errors[0]
    with pytest.raises(RuntimeError, match="self-check failed"):
        _warmup(stage, plan, "strict").compile(("dsa_kpool", 8))
    # "off" skips it: the stage engages without checking.
    _warmup(stage, plan, "off").compile(("dsa_kpool", 8))
    assert plan.warmed


def test_self_check_switches(monkeypatch):
    from vllm.models.glm5next.nvidia import specialized_decode as sd

    def config(**extra):
        return SimpleNamespace(additional_config={"decode_backend": "auto", **extra})

    monkeypatch.setattr(sd, "unsupported", lambda vllm_config: [])
    on = dict(decode_backend="latency_specialized")
    assert sd.specialized_decode_config(config(**on)).self_check == "on"
    off = sd.specialized_decode_config(config(**on, **{sd.SELF_CHECK_KEY: "off"}))
    assert off.self_check == "off"
    monkeypatch.setenv(sd.SELF_CHECK_ENV, "strict")
    assert sd.specialized_decode_config(config(**on)).self_check == "strict"
    monkeypatch.setenv(sd.SELF_CHECK_ENV, "maybe")
    with pytest.raises(ValueError, match=sd.SELF_CHECK_KEY):
        sd.specialized_decode_config(config(**on))


@pytest.mark.gpu
@needs_cuda()
def test_self_check_on_this_gpu(monkeypatch):
    """Every variant of a GLM-5-Next deployment's layouts passes 64 cases;
    the time is what start-up pays; a corrupted variant is caught."""
    from test_kernel_launch import _attention

    from vllm.models.glm5next.nvidia.specialized_decode import kpool, self_check

    stage = kpool.KpoolStage([], 256, "cuda")
    stage.fuse = True
    keys = stage.warmup([_attention("cuda", ring=8, page=64)])
    self_check.check(keys, 0, torch.device("cuda"), cases=2)  # stock compiles
    torch.cuda.synchronize()
    started = time.perf_counter()
    problem = self_check.check(keys, 99, torch.device("cuda"))
    elapsed = time.perf_counter() - started
    print(f"self-check: {len(keys)} variants x {self_check.CASES} cases, "
          f"{elapsed:.3f} s, {problem or 'all equal'}")  # fmt: skip
    assert problem is None
    run = kpool.REMAP.run

    def corrupted(key, *args):
        run(key, *args)
        args[4].view(-1)[-1:] += 1

    monkeypatch.setattr(kpool.REMAP, "run", corrupted)
    problem = self_check.check(keys, 7, torch.device("cuda"))
    print(f"self-check with a corrupted remap: {problem}")
    assert problem is not None and "ExpandRemapKernel" in problem
