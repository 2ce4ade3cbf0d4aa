# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The warmup self-check (``self_check.check``): each compile key's
executor runs ``CASES`` cases of ``cases.py`` in the key's layout, every
buffer it may write compared with its stock twin's; the first mismatch
comes back as "kernel case N (seed S): what" (the stage's warmup then
keeps the stage off), and the seed replays it.

CPU: executors that are doubles (the stock expansion itself; one that
changes a byte; one that writes nothing, for every kernel), the rules
taking CPU tensors; an input the rule refuses is reported. GPU: the
kernels of a GLM-5-Next deployment's keys pass on this GPU, within the
start-up budget, and a corrupted one is caught with its seed."""

import random
import re
import time

import pytest
import torch
from rule_edges import KEYS, SEEDS, SMS, allow_cpu

from vllm.models.glm5next.nvidia.ops.kpool_compress import (
    expand_pools_and_append_tail,
)
from vllm.models.glm5next.nvidia.specialized_decode import self_check
from vllm.models.glm5next.nvidia.specialized_decode.constants import POOL
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.expand.launch import (
    EXPAND,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.remap.launch import (
    REMAP,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select.launch import (
    SELECT,
    sm_count,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.upcast.launch import (
    UPCAST,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.update.launch import (
    UPDATE,
)

CPU = torch.device("cpu")
# The expansion of lengths in their own dtype (the stock call the case's
# expected bytes come from).
KEY = EXPAND.dispatch(groups=100, seq_lens_dtype=torch.int64, int32_lengths=False)


def stock_expansion(pool_ids, seq_lens, out, seq_offset):
    """The expansion's executor as the stock function (its arguments are
    ``ExpandKernel.spec``'s)."""
    expand_pools_and_append_tail(
        pool_ids, seq_lens[: out.shape[0]], POOL, seq_offset=seq_offset, out=out
    )


def changed(pool_ids, seq_lens, out, seq_offset):
    """The stock expansion with one bit of its last row flipped."""
    stock_expansion(pool_ids, seq_lens, out, seq_offset)
    out[-1:, :1].bitwise_xor_(1)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(self_check, "sm_count", lambda index: SMS)
    with allow_cpu():
        yield


def test_stock_bytes_pass(on_cpu):
    """An executor that writes stock's bytes passes every case."""
    assert self_check.check({KEY: stock_expansion}, 20, CPU, cases=6) is None


def test_a_planted_difference_is_reported_with_its_seed(on_cpu):
    """One flipped bit: the first case with rows is reported with its
    number and seed, and that seed replays it as case 0."""
    seed = 20
    problem = self_check.check({KEY: changed}, seed, CPU, cases=6)
    match = re.fullmatch(
        r"ExpandKernel case (\d+) \(seed (\d+)\) differs from stock: (.+)", problem
    )
    assert match and int(match[2]) == seed + int(match[1]) and match[3] == str(KEY)
    replay = self_check.check({KEY: changed}, int(match[2]), CPU, cases=1)
    assert replay == f"ExpandKernel case 0 (seed {match[2]}) differs from stock: {KEY}"
    # The cases before it had no rows (nothing to differ).
    for case in range(int(match[1])):
        rng = random.Random(seed + case)
        drawn = self_check.DRAWS[EXPAND](
            rng, torch.Generator().manual_seed(seed + case), KEY
        )
        assert drawn.arguments["pool_ids"].shape[0] == 0


@pytest.mark.parametrize(
    "kernel", [UPDATE, EXPAND, REMAP, UPCAST, SELECT], ids=lambda k: type(k).__name__
)
def test_an_executor_that_writes_nothing_is_caught(on_cpu, kernel):
    """Every kernel's cases compare what it writes: an executor that
    writes nothing differs from stock (the base case's seed: rows)."""
    key = kernel.dispatch(**KEYS[kernel])
    problem = self_check.check({key: lambda *args: None}, SEEDS[kernel], CPU, cases=1)
    name = type(kernel).__name__
    assert problem == f"{name} case 0 (seed {SEEDS[kernel]}) differs from stock: {key}"


def test_a_refused_case_is_reported():
    """A case the kernel's rule refuses (here: CPU tensors, which the real
    device check refuses) is reported, not launched."""
    problem = self_check.check({KEY: changed}, 20, CPU, cases=1)
    assert problem == (
        "ExpandKernel case 0 (seed 20): refused: pool_ids: expected a CUDA "
        "tensor, got a tensor on cpu"
    )


# --- GPU ------------------------------------------------------------------------------


def deployment_keys(sms: int) -> list:
    """(kernel, key) of a GLM-5-Next deployment's variants: the update of an
    8-token ring and 64-token pages (both scale formats), the decode
    expansion, the fused remap with and without counts, the upcast, the
    select of 1-64 rows of 65536 pools (FP32 and BF16 logits)."""
    update = KEYS[UPDATE]
    keys = [
        (UPDATE, UPDATE.dispatch(**update | dict(mx_scales=mx))) for mx in (True, False)
    ]
    keys.append((EXPAND, EXPAND.dispatch(**KEYS[EXPAND])))
    remap = KEYS[REMAP]
    keys += [(REMAP, REMAP.dispatch(**remap | dict(counts=c))) for c in (True, False)]
    keys.append((UPCAST, UPCAST.dispatch()))
    for dtype in (torch.float32, torch.bfloat16):
        values = dict(max_rows=64, k=512, dtype=dtype, width=65536, sms=sms)
        keys += [(SELECT, key) for key in SELECT.get_warmup_keys(**values)]
    return keys


@pytest.mark.gpu
def test_self_check_on_this_gpu():
    """Every variant of a deployment's keys passes ``CASES`` cases on this
    GPU (the time is what start-up pays, printed); a remap whose last
    output byte is changed is caught, with a seed that replays it."""
    device = torch.device("cuda", torch.cuda.current_device())
    keys = deployment_keys(sm_count(device.index))
    executors = {key: kernel.executor(key) for kernel, key in keys}
    self_check.check(executors, 0, device, cases=2)  # the stock kernels compile
    torch.cuda.synchronize()
    started = time.perf_counter()
    problem = self_check.check(executors, 99, device)
    elapsed = time.perf_counter() - started
    print(
        f"self-check: {len(executors)} variants x {self_check.CASES} cases, "
        f"{elapsed:.3f} s, {problem or 'all equal'}"
    )
    assert problem is None
    remap = next(key for kernel, key in keys if kernel is REMAP)
    run = executors[remap]

    def corrupted(*args):
        run(*args)
        args[4].view(-1)[-1:] += 1  # out's last element

    problem = self_check.check(executors | {remap: corrupted}, 7, device)
    print(f"self-check with a corrupted remap: {problem}")
    match = re.fullmatch(
        r"RemapKernel case (\d+) \(seed (\d+)\) differs .*", problem or ""
    )
    assert match and int(match[2]) == 7 + int(match[1])
