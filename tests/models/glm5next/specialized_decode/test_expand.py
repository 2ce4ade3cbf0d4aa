# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``cutedsl/expand``: ``EXPAND`` (``expand_pools``, ``KpoolStage.expand``)
against the patched ``expand_pools_and_append_tail``.

CPU: the rule at its edges and on layouts; the compile for sm_90a and
sm_100a and its PTX (PDL, 16-byte stores, the lengths' arithmetic in the
width each variant states). GPU: the fuzz loop over ``cases.expand_case``
(the whole output buffer: rows and columns past the expansion must keep
their random bytes), both length arithmetics (``int32_lengths``: against
stock's decode as written, ``positions.to(torch.int32) + 1``), and
``KpoolStage.expand`` at the rule's edges."""

import draws
import pytest
import torch
from kernel_ptx import ARCHS, compile_ptx, length_arithmetic, ops, waits_once
from kpool_fuzz import fuzz, launch_case, stage_with
from rule_edges import (
    declared_disagreements,
    devices_named,
    int32,
    missing,
    shape_disagreements,
)

from vllm.models.glm5next.nvidia.specialized_decode import cases
from vllm.models.glm5next.nvidia.specialized_decode.constants import POOL
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.expand.launch import (
    EXPAND,
)

I32, I64 = torch.int32, torch.int64


def rule(a: dict) -> str | None:
    """The expansion's rule on shapes and scalars, as its messages state it:
    an ``out`` to write with the pool ids' rows and at least ``pools * 4
    + 3`` columns, its rows 16-byte aligned; lengths for every row; pool
    size 4; an int32 offset."""
    if a["out"] is None:
        return "out"
    named = devices_named(a, ("pool_ids", "seq_lens", "out"))
    if named:
        return named
    if a["pool_size"] != POOL:
        return "pool_size"
    rows, groups = a["pool_ids"].shape
    out = a["out"].shape
    if out[0] != rows or out[1] < groups * POOL + POOL - 1 or a["out"].stride(0) % 4:
        return "out"
    if a["seq_lens"].shape[0] < rows:
        return "seq_lens"
    if not int32(a["seq_offset"]):
        return "seq_offset"
    return None


def test_rule_at_its_edges():
    """Each dimension of each tensor one below, at and one above its size
    and the sizes the rule bounds it by (the rows, ``pools * 4 + 3``); the
    scalars at their neighbours and the int32 edges; the type and device
    checks: refused exactly where ``rule`` says, naming the argument."""
    assert shape_disagreements(EXPAND, rule) == []


@pytest.mark.parametrize("name", ["pool_ids", "seq_lens"])
def test_a_missing_tensor_is_refused(name):
    assert missing(EXPAND, name) == []


def test_rule_on_layouts_and_dtypes():
    """The layouts of ``rule_layouts.py`` and each tensor in float64:
    refused naming the argument they declare, or taken."""
    assert declared_disagreements(EXPAND) == []


# --- Compile (CPU) ----------------------------------------------------------------

# The lengths' dtype and arithmetic of each variant, at 512 pools.
VARIANTS = {
    "int32": EXPAND.CompileKey(512, I32, False),
    "int64": EXPAND.CompileKey(512, I64, False),
    # The stage's decode expansion: int64 positions truncated to int32.
    "int32-lengths": EXPAND.CompileKey(512, I64, True),
}


@pytest.fixture(scope="module", params=ARCHS)
def ptx(request):
    return {
        name: compile_ptx(EXPAND, key, request.param) for name, key in VARIANTS.items()
    }


def test_expand_ptx(ptx):
    """PDL: one wait, one trigger; the 16-byte stores the rule's alignment
    of ``out``'s rows is there for; no spills."""
    for text in ptx.values():
        waits_once(text)
        assert ops(text)["st.global.v4.b32"] >= 1


@pytest.mark.parametrize(
    "name, bits, operands",
    [
        ("int32", "32", ["ld.global.b32", "ld.param.b32"]),
        ("int64", "64", ["cvt.s64.s32", "or.b64"]),
        ("int32-lengths", "32", ["ld.global.b32", "ld.param.b32"]),
    ],
)
def test_length_arithmetic(ptx, name, bits, operands):
    """``int32_lengths`` (stock's decode: ``positions.to(torch.int32) + 1``)
    adds the offset to the int64 length's low word, loaded alone, in 32
    bits and divides in 32 bits, as for int32 lengths; without it an int64
    length (its two words joined) and the widened offset are added and
    divided in 64 bits, as stock's expansion computes them."""
    assert length_arithmetic(ptx[name]) == (bits, operands)
    if bits == "32":
        assert "shr.s64" not in ptx[name], "no 64-bit division by 4"


def test_int32_lengths_is_the_int32_kernel(ptx):
    """The expansion of int64 lengths truncated to int32 is, instruction for
    instruction, the expansion of int32 lengths (it loads the low word)."""
    assert ops(ptx["int32-lengths"]) == ops(ptx["int32"])


# --- GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_expand_matches_stock():
    fuzz(
        "expand_pools",
        1500,
        lambda rng, gen: launch_case(EXPAND, draws.expand_case(rng, gen)),
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "groups, out_stride, lengths, inside",
    [
        (512, 2052, 0, True),
        (512, 2054, 0, False),
        (0, 4, 0, True),
        (512, 2052, 2**31 - 2, True),
        (512, 2052, 2**33 - 2, True),
    ],
)
def test_stage_at_the_rule_edges(groups, out_stride, lengths, inside):
    """``KpoolStage.expand`` (the stage's decode expansion: int64 positions,
    offset 1) just inside the rule launches the kernel, just outside runs
    stock; both give the bytes of stock's decode as written,
    ``expand_pools_and_append_tail(pool_ids.to(torch.int64),
    positions.to(torch.int32) + 1, 4)``, columns past it untouched."""
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )

    gen = torch.Generator("cuda").manual_seed(7)
    g = dict(generator=gen, device="cuda")
    rows, cols = 6, groups * POOL + POOL - 1
    ids = torch.randint(-1, 99_999, (rows, groups), dtype=I32, **g)
    high = 8 if lengths else 2**30
    positions = lengths + torch.randint(0, high, (rows,), **g)
    ours = cases.poisoned((rows, out_stride), I32, gen)
    want = ours.clone()
    want[:, :cols] = expand_pools_and_append_tail(
        ids.to(I64), positions.to(I32) + 1, POOL
    )
    key = EXPAND.dispatch(groups=groups, seq_lens_dtype=I64, int32_lengths=True)
    stage = stage_with(EXPAND, [key])
    stage.expand(ids, positions, ours[:, :cols])
    torch.cuda.synchronize()
    assert stage.launched == ([key] if inside else [])
    assert torch.equal(ours, want)
