# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``cutedsl/upcast``: ``UPCAST`` (``upcast_logits``) against
``as_fp32_logits``.

CPU: the rule at its edges and on layouts; the compile for sm_90a and
sm_100a and its PTX (PDL, 8-byte loads and 16-byte stores). GPU: the fuzz
loop over ``cases.upcast_case`` (every byte of the output buffer: what stock
wrote below each row end, past the width into the row padding where an end
lies there, and the random bytes everywhere else), the output it allocates,
and ``KpoolStage.upcast`` at the rule's edges."""

import draws
import pytest
import torch
from kernel_ptx import ARCHS, compile_ptx, ops, waits_once
from kpool_fuzz import fuzz, launch_case, stage_with
from rule_edges import (
    declared_disagreements,
    devices_named,
    missing,
    shape_disagreements,
)

from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.upcast.launch import (
    UPCAST,
)


def rule(a: dict) -> str | None:
    """The upcast's rule on shapes, as its messages state it: logits rows
    16-byte aligned, one row end per logits row, ``out`` (optional) of the
    logits' shape and strides."""
    named = devices_named(a, ("logits", "row_ends", "out"), optional=("out",))
    if named:
        return named
    logits, out = a["logits"], a["out"]
    if logits.stride(0) % 8:
        return "logits"
    if a["row_ends"].shape[0] != logits.shape[0]:
        return "row_ends"
    if out is not None and (
        out.shape != logits.shape or out.stride() != logits.stride()
    ):
        return "out"
    return None


def test_rule_at_its_edges():
    """Each dimension of each tensor one below, at and one above its size
    and the sizes the rule bounds it by; the type and device checks:
    refused exactly where ``rule`` says, naming the argument."""
    assert shape_disagreements(UPCAST, rule) == []


@pytest.mark.parametrize("name", ["logits", "row_ends"])
def test_a_missing_tensor_is_refused(name):
    assert missing(UPCAST, name) == []


def test_rule_on_layouts_and_dtypes():
    """The layouts of ``rule_layouts.py`` and each tensor in float64:
    refused naming the argument they declare, or taken."""
    assert declared_disagreements(UPCAST) == []


# --- Compile (CPU) ----------------------------------------------------------------


@pytest.fixture(scope="module", params=ARCHS)
def ptx(request):
    return compile_ptx(UPCAST, UPCAST.dispatch(), request.param)


def test_upcast_ptx(ptx):
    """PDL: one wait; the dependents may launch from a CTA on its last tile:
    at its start where the width allows two tiles, on its first, after the
    group's tiles are counted, or in the loop. A thread's two runs of 4
    columns a tile (the first tile's and the loop's): 8-byte loads, 16-byte
    stores that a warp lays side by side."""
    waits_once(ptx, triggers=4)
    count = ops(ptx)
    assert count["ld.global.nc.v2.b32"] == count["st.global.v4.b32"] == 4
    assert count["ld.global.nc.v4.b32"] == 0


# --- GPU ----------------------------------------------------------------------------


def _allocated(case) -> str | None:
    """Without ``out``, a new FP32 tensor with the strides of the logits,
    stock's values below each row end (past the width too)."""
    logits, ends = case.arguments["logits"], case.arguments["row_ends"]
    rows, width = logits.shape
    if not rows:
        return None
    got = UPCAST(logits=logits, row_ends=ends)
    torch.cuda.synchronize()
    if got.dtype != torch.float32 or got.stride() != logits.stride():
        return f"allocated {got.dtype} strides {got.stride()}"
    stride = logits.stride(0)
    below = torch.arange(stride, device=ends.device)[None, :] < ends[:, None]
    at = below.view(-1).nonzero().view(-1)
    span = (rows - 1) * stride + width
    values = got.as_strided((span,), (1,)).index_select(0, at)
    want = case.expected[0].index_select(0, at)
    if not torch.equal(values.view(torch.int32), want.view(torch.int32)):
        return "allocated output differs below the row ends"
    return None


@pytest.mark.gpu
def test_upcast_matches_stock():
    def check(rng, gen):
        case = draws.upcast_case(rng, gen)
        problem = launch_case(UPCAST, case)
        if problem is None and rng.random() < 0.1:
            problem = _allocated(case)
        return problem

    fuzz("upcast_logits", 1000, check)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "stride, ends_shape, inside",
    [
        (1008, (5,), True),
        (1000, (5,), True),
        (1004, (5,), False),
        (1008, (5, 1), False),
    ],
)
def test_stage_at_the_rule_edges(stride, ends_shape, inside):
    """``KpoolStage.upcast`` just inside the rule launches the kernel, just
    outside runs ``as_fp32_logits``: stock's values below each row end."""
    from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits

    gen = torch.Generator("cuda").manual_seed(3)
    rows, width = 5, 1000
    values = torch.randn(rows * stride, generator=gen, device="cuda").bfloat16()
    logits = values.as_strided((rows, width), (stride, 1))
    ends = torch.randint(0, width + 1, (rows,), generator=gen, device="cuda")
    ends = ends.to(torch.int32).view(ends_shape)
    stage = stage_with(UPCAST, [UPCAST.dispatch()])
    got = stage.upcast(logits, ends)
    want = as_fp32_logits(logits, ends)
    torch.cuda.synchronize()
    assert stage.launched == ([UPCAST.dispatch()] if inside else [])
    below = torch.arange(width, device="cuda")[None, :] < ends.view(-1)[:, None]
    assert torch.equal(got.view(torch.int32)[below], want.view(torch.int32)[below])
