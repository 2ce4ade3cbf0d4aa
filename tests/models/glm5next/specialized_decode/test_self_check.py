# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The warmup self-check (``self_check.py``, run by the stage's warmup entry):
kernels that give stock's bytes turn the stage on; a kernel that differs
keeps it off with one error line naming the kernel, the case and the seed
("strict": raises); "off" skips it.

CPU: an SM100 stage's own warmup variants, launched through the harness's
spies (their stock twins, stock Triton interpreted), one of them corrupted on
purpose. GPU: the real kernels of a GLM-5-Next deployment's layouts pass on
this GPU, within the start-up budget, and a corrupted variant is caught."""

import logging
import time
from functools import partial

import pytest
import torch

DIM, POOL = 128, 4
CORRUPTED = {  # the argument each kernel writes
    "update": "kv_cache",
    "expand": "out",
    "remap": "out",
    "upcast": "out",
}


@pytest.fixture
def model(sm100, engine, monkeypatch):
    """A warmed-up SM100 stage (every kernel has a variant) whose self-check
    runs one case a variant."""
    from kpool_harness import Step, make_inputs

    from vllm.models.glm5next.nvidia.specialized_decode import self_check

    monkeypatch.setattr(self_check, "CASES", 1)
    monkeypatch.setattr(self_check, "check", partial(self_check.check, cases=1))
    monkeypatch.setenv("VLLM_GLM5NEXT_KPOOL_SELF_CHECK_SEED", "1234")
    return engine(make_inputs(Step([1], [150]), mx=True))


@pytest.fixture
def select_model(sm100, engine, monkeypatch):
    """``model`` with the opt-in select (its self-check cases ask the SMs)."""
    from kpool_harness import Step, make_inputs

    from vllm.models.glm5next.nvidia.specialized_decode import (
        select_kernel,
        self_check,
    )

    monkeypatch.setattr(self_check, "check", partial(self_check.check, cases=3))
    monkeypatch.setattr(select_kernel, "sm_count", lambda device: 132)
    monkeypatch.setenv("VLLM_GLM5NEXT_KPOOL_SELF_CHECK_SEED", "1234")
    return engine(make_inputs(Step([1], [150]), mx=True), select=True)


def test_select_is_checked_against_its_contract(select_model, spies):
    """Opted in, the self-check launches every select variant the warmup
    compiled against ``select_reference``; a select that differs from it
    keeps the stage off."""
    for launched in spies.launched.values():
        launched.clear()
    assert _self_check(select_model, "on")
    assert spies.launched["select"] == spies.compiled["select"] != set()
    twin = spies.twins["select"]

    def off_by_one(a):
        twin(a)
        a.out[:, -1] += 1

    spies.twins["select"] = off_by_one
    assert not _self_check(select_model, "on")


def test_select_cases_derive_every_key():
    """Each select key a warmup can compile (1-256 rows, GLM-5-Next widths
    of 4K-1M tokens and odd ones) has self-check shapes that derive it."""
    from vllm.models.glm5next.nvidia.specialized_decode import select_kernel
    from vllm.models.glm5next.nvidia.specialized_decode.self_check import (
        _select_shapes,
    )

    sms, keys = 132, set()
    for dtype in (torch.float32, torch.bfloat16):
        for width in (1000, 1024, 16384 + 8, 65536, 100000, 262144, 851968):
            for rows in range(1, 257):
                cluster = select_kernel.cluster_for(rows, width, dtype, sms)
                capacity = select_kernel.slice_capacity(width, dtype, cluster)
                keys.add(select_kernel.SELECT.CompileKey(512, dtype, cluster, capacity))
    assert {key.cluster for key in keys} == {1, 2, 4, 8, 16}
    for key in keys:
        shapes = _select_shapes(key, sms)
        assert shapes, key
        for rows, width in shapes:
            assert select_kernel.cluster_for(rows, width, key.dtype, sms) == key.cluster
            got = select_kernel.slice_capacity(width, key.dtype, key.cluster)
            assert got == key.capacity, (key, rows, width)


def _self_check(model, mode):
    from vllm.models.glm5next.nvidia.specialized_decode import warmup

    model.stage.warmed = False
    entry = warmup.KpoolWarmup(model.stage, [model.attention], mode)
    entry.compile_many(entry.get_warmup_keys())
    return model.stage.warmed


def test_matching_kernels_turn_the_stage_on(model, spies, vllm_log):
    """Every variant the warmup compiled is launched by the self-check, with
    the key its case derives, and matches stock: the stage goes on."""
    for launched in spies.launched.values():
        launched.clear()
    assert _self_check(model, "on")
    assert spies.launched == spies.compiled
    launched = {name for name, keys in spies.launched.items() if keys}
    assert launched == {"update", "expand", "remap", "upcast"}
    passed = [r.getMessage() for r in vllm_log.records if "self-check" in r.msg]
    variants = sum(len(keys) for keys in spies.compiled.values())
    assert passed[0].startswith(
        "GLM-5-Next specialized decode: self-check passed: "
        f"{variants} kernel variants x 1 cases, seed 1234, "
    )


@pytest.mark.parametrize("corrupt", sorted(CORRUPTED))
def test_a_differing_kernel_keeps_the_stage_off(
    model, spies, vllm_log, monkeypatch, corrupt
):
    from kpool_harness import KERNELS

    from vllm.models.glm5next.nvidia.specialized_decode import warmup

    kernel = KERNELS[corrupt]
    derive = warmup.warmup_keys
    monkeypatch.setattr(
        warmup,
        "warmup_keys",
        lambda *layers: [(k, key) for k, key in derive(*layers) if k is kernel],
    )
    twin = spies.twins[corrupt]

    def corrupted(args):
        twin(args)
        getattr(args, CORRUPTED[corrupt]).view(torch.uint8).bitwise_xor_(1)

    spies.twins[corrupt] = corrupted
    assert not _self_check(model, "on"), "a mismatch must keep the stage off"
    errors = [r.getMessage() for r in vllm_log.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert f"{type(kernel).__name__} case 0 (seed 1234) differs" in errors[0]
    assert "VLLM_GLM5NEXT_KPOOL_SELF_CHECK_SEED=1234" in errors[0]
    with pytest.raises(RuntimeError, match="self-check failed"):
        _self_check(model, "strict")
    # "off" skips it: the stage engages without checking.
    assert _self_check(model, "off")


def _deployment_keys(device) -> list:
    """(kernel, key) of every variant of a GLM-5-Next deployment's layouts
    (512 pools, 2176-column rows, 64-token blocks, an 8-token tail ring), as
    the kernels' own rules derive them; the upcast is SM100's (an H200's
    warmup leaves FP32 logits to stock)."""
    from vllm.models.glm5next.nvidia.specialized_decode import (
        expand_kernel,
        remap_kernel,
        upcast_kernel,
        update_kernel,
    )

    def zeros(*shape, dtype=torch.int32):
        return torch.zeros(shape, dtype=dtype, device=device)

    rows = zeros(1, 1, DIM, dtype=torch.bfloat16)
    update = update_kernel.UpdateArgs(
        zeros(4, 64, DIM + 4, dtype=torch.uint8),
        zeros(3, 2, 8, DIM, dtype=torch.bfloat16),
        zeros(1, 1, dtype=torch.int64),
        rows,
        rows,
        zeros(POOL, DIM, dtype=torch.float32),
        zeros(1, 1, dtype=torch.int64),
        zeros(1, 1),
        POOL,
        DIM,
        mx_scales=False,
    )
    pools, positions = zeros(1, 512), zeros(1, dtype=torch.int64)
    expand = expand_kernel.ExpandArgs(pools, positions, POOL, 1, zeros(1, 2176), True)
    remaps = [
        remap_kernel.RemapArgs(
            pools,
            positions,
            POOL,
            zeros(1),
            zeros(1, 1),
            zeros(1, 2176),
            counts,
            64,
            64,
            1,
            True,
        )
        for counts in (zeros(1), None)
    ]
    upcast = upcast_kernel.UpcastArgs(zeros(1, 8, dtype=torch.bfloat16), zeros(1))
    cases = [
        (update_kernel.UPDATE, update),
        (expand_kernel.EXPAND, expand),
        *((remap_kernel.REMAP, remap) for remap in remaps),
        (upcast_kernel.UPCAST, upcast),
    ]
    return [(kernel, kernel.key_for(args)) for kernel, args in cases]


@pytest.mark.gpu
def test_self_check_on_this_gpu(monkeypatch):
    """Every variant of a GLM-5-Next deployment's layouts passes 64 cases;
    the time is what start-up pays; a corrupted variant is caught."""
    from vllm.models.glm5next.nvidia.specialized_decode import self_check
    from vllm.models.glm5next.nvidia.specialized_decode.remap_kernel import REMAP

    device = torch.device("cuda")
    keys = _deployment_keys(device)
    for kernel, key in keys:
        kernel.compile(key)
    self_check.check(keys, 0, device, cases=2)  # stock compiles
    torch.cuda.synchronize()
    started = time.perf_counter()
    problem = self_check.check(keys, 99, device)
    elapsed = time.perf_counter() - started
    print(f"self-check: {len(keys)} variants x {self_check.CASES} cases, "
          f"{elapsed:.3f} s, {problem or 'all equal'}")  # fmt: skip
    assert problem is None
    launch = REMAP.launch

    def corrupted(executor, args):
        done = launch(executor, args)
        args.out.view(-1)[-1:] += 1
        return done

    monkeypatch.setattr(REMAP, "launch", corrupted)
    problem = self_check.check(keys, 7, device)
    print(f"self-check with a corrupted remap: {problem}")
    assert problem is not None and "ExpandRemapKernel" in problem
