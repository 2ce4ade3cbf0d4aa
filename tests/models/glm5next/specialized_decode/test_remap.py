# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``cutedsl/remap``: ``REMAP`` (``expand_and_remap``, ``FusedRemap``)
against the stock decode chain it fuses: the -1 fill of the logical top-k
rows, ``expand_pools_and_append_tail`` of the pool top-k into them, and
``triton_convert_req_index_to_global_index`` with counts (compacted rows) or
without (in place).

CPU: the rule at its edges and on layouts, its shape rule (``check_shape``,
asked before a step defers) and the widths stock compacts in column order;
the compile for sm_90a and sm_100a and its PTX (PDL, 16-byte stores, the
lengths' arithmetic), and the int32 edge of its block arithmetic. GPU: the
fuzz loop over ``cases.remap_case`` (the whole output and counts buffers,
rows past the outputs included), and ``FusedRemap`` of a real index group
at the rule's edges."""

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
from vllm.models.glm5next.nvidia.specialized_decode.constants import (
    INT32_MAX,
    MAX_GROUPS,
    POOL,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.common.host import (
    Refused,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.remap.launch import (
    REMAP,
    check_shape,
    stock_compacts_in_order,
)

I32, I64 = torch.int32, torch.int64
TENSORS = ("pool_ids", "positions", "req_ids", "block_table", "out", "counts")


def in_column_order(width: int) -> bool:
    """Stock's conversion with counts keeps the column order where one
    program owns a row: up to 4096 columns, or a power of two."""
    return width <= 4096 or width & (width - 1) == 0


def shape_rule(groups: int, width: int, pool_size, counts: bool) -> str | None:
    """``check_shape`` as its messages state it: pool size 4; a multiple of
    32 pools, at most ``MAX_GROUPS``; a width of at least ``pools * 4 + 3``
    columns in whole stock tiles of 128, in column order with counts."""
    if pool_size != POOL:
        return "pool_size"
    if groups % 32 or not 32 <= groups <= MAX_GROUPS:
        return "pool_ids"
    if width < groups * POOL + POOL - 1 or width % 128:
        return "out"
    if counts and not in_column_order(width):
        return "out"
    return None


def rule(a: dict) -> str | None:
    """The remap's rule on shapes and scalars, as its messages state it:
    a contiguous ``out`` with a row per ``req_ids`` row, ``shape_rule``, a
    positive int32 block size that is a multiple of 4, an int32 row
    stride, counts for every row, at most as many pool id rows as rows, a
    position for each, an int32 offset."""
    named = devices_named(a, TENSORS, optional=("counts",))
    if named:
        return named
    rows, out = a["req_ids"].shape[0], a["out"]
    if out.shape[0] != rows or not out.is_contiguous():
        return "out"
    expanded, groups = a["pool_ids"].shape
    counts = a["counts"] is not None
    named = shape_rule(groups, out.shape[1], a["pool_size"], counts)
    if named:
        return named
    block = a["block_size"]
    if not isinstance(block, int) or block % POOL or not 0 < block <= INT32_MAX:
        return "block_size"
    if not int32(a["stride_rows"]):
        return "stride_rows"
    if counts and a["counts"].shape[0] < rows:
        return "counts"
    if expanded > rows:
        return "pool_ids"
    if a["positions"].shape[0] < expanded:
        return "positions"
    if not int32(a["seq_offset"]):
        return "seq_offset"
    return None


def test_rule_at_its_edges():
    """Each dimension of each tensor one below, at and one above its size
    and the sizes the rule bounds it by (the rows, 32 and 1024 pools,
    ``pools * 4 + 3`` columns, 4096, 4224 and 8192 columns); the scalars at
    their neighbours and the int32 edges; the type and device checks:
    refused exactly where ``rule`` says, naming the argument."""
    assert shape_disagreements(REMAP, rule) == []


@pytest.mark.parametrize("name", [n for n in TENSORS if n != "counts"])
def test_a_missing_tensor_is_refused(name):
    assert missing(REMAP, name) == []


def test_rule_on_layouts_and_dtypes():
    """The layouts of ``rule_layouts.py`` and each tensor in float64:
    refused naming the argument they declare, or taken."""
    assert declared_disagreements(REMAP) == []


@pytest.mark.parametrize("width", [1, 128, 4096, 4224, 6144, 8192, 12288, 16384])
def test_stock_compacts_in_order(width):
    assert stock_compacts_in_order(width) is in_column_order(width)


@pytest.mark.parametrize(
    "groups, width, pool, counts",
    [
        (32, 256, POOL, True),
        (64, 384, POOL, True),
        (512, 2176, POOL, True),
        (992, 4096, POOL, True),
        (1024, 4224, POOL, False),
        (1024, 8192, POOL, True),
        (1024, 4224, POOL, True),
        (32, 256, 8, True),
        (32, 256, 2, True),
        (0, 128, POOL, True),
        (16, 128, POOL, True),
        (31, 128, POOL, True),
        (48, 256, POOL, True),
        (1056, 4352, POOL, False),
        (32, 128, POOL, True),
        (32, 130, POOL, True),
        (32, 192, POOL, True),
        (96, 384, POOL, True),
    ],
)
def test_shape_rule(groups, width, pool, counts):
    """``check_shape`` refuses naming the argument ``shape_rule`` names."""
    named = shape_rule(groups, width, pool, counts)
    if named is None:
        check_shape(groups, width, pool, counts)
    else:
        with pytest.raises(Refused, match=rf"^{named}: expected "):
            check_shape(groups, width, pool, counts)


# --- Compile (CPU) ----------------------------------------------------------------

VARIANTS = {
    "counts": REMAP.CompileKey(512, 2176, 64, 64, I64, False, True),
    "no-counts": REMAP.CompileKey(512, 2176, 64, 64, I64, False, False),
    "int32-lengths": REMAP.CompileKey(512, 2176, 64, 64, I64, True, True),
}


@pytest.fixture(scope="module", params=ARCHS)
def ptx(request):
    return {
        name: compile_ptx(REMAP, key, request.param) for name, key in VARIANTS.items()
    }


def test_remap_ptx(ptx):
    """PDL: one wait, one trigger; 16-byte stores of the contiguous,
    16-byte aligned ``out``; no spills."""
    for text in ptx.values():
        waits_once(text)
        assert ops(text)["st.global.v4.b32"] >= 1


@pytest.mark.parametrize(
    "name, bits, operands",
    [
        ("counts", "64", ["cvt.s64.s32", "or.b64"]),
        ("int32-lengths", "32", ["ld.global.b32", "ld.param.b32"]),
    ],
)
def test_length_arithmetic(ptx, name, bits, operands):
    """The expansion's arithmetic as ``EXPAND``'s: 64 bits for int64
    positions, 32 bits (the low word) for ``int32_lengths``."""
    assert length_arithmetic(ptx[name]) == (bits, operands)


def test_compiles_to_the_int32_edge():
    """The rule's bounds are the compiler's: the largest int32 block size and
    row stride compile; one past int32, either does not (the kernel's block
    arithmetic is int32), which is why the rule refuses it."""

    def compile_remap(block_size, stride_rows):
        key = REMAP.CompileKey(32, 256, block_size, stride_rows, I64, False, False)
        return compile_ptx(REMAP, key, "sm_90a")

    assert "griddepcontrol.wait" in compile_remap(2**31 - 4, 2**31 - 1)
    for block_size, stride_rows in ((2**31, 64), (64, 2**31)):
        with pytest.raises(Exception, match="TYPE_UNSTABLE_JOIN"):
            compile_remap(block_size, stride_rows)


# --- GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_remap_matches_stock():
    fuzz(
        "expand_and_remap",
        1500,
        lambda rng, gen: launch_case(REMAP, draws.remap_case(rng, gen)),
    )


def _group(width: int, poison: torch.Tensor, counts: torch.Tensor):
    """A layer's index group on the GPU: 16 logical rows, 9 physical ones
    (``poison`` and ``counts`` copied in)."""
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

    device = poison.device
    group = SparseMLAIndexGroup(
        logical_topk_indices=torch.full((16, width), -1, dtype=I32, device=device),
        physical_topk_indices=poison.clone(),
        valid_topk_counts=counts.clone(),
        side_stream=torch.cuda.Stream(device),
        logical_topk_ready=torch.cuda.Event(),
        physical_topk_ready=torch.cuda.Event(),
        has_indexer=True,
    )
    group.register_layer()
    return group


@pytest.mark.gpu
@pytest.mark.parametrize(
    "groups, width, block, inside",
    [
        (32, 256, 64, True),
        (48, 256, 64, False),
        (1024, 8192, 64, True),
        (992, 4096, 4, True),
        (512, 2176, 6, False),
        (512, 2176, 12, True),
    ],
)
def test_fused_remap_at_the_rule_edges(groups, width, block, inside):
    """A ``FusedRemap`` of a real index group at the rule's edges: inside,
    the kernel converts the handed-over pool top-k; outside, the logical
    rows are written and the stock conversion runs. Both leave the stock
    group's whole physical rows and counts buffers (9 rows for 6)."""
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )
    from vllm.models.glm5next.nvidia.specialized_decode.runtime.remap import (
        Deferred,
        FusedRemap,
    )

    gen = torch.Generator("cuda").manual_seed(5)
    g = dict(generator=gen, device="cuda")
    rows = 6
    pool_ids = torch.randint(-1, 512 * block // POOL, (rows, groups), **g).to(I32)
    positions = torch.randint(0, 512 * block, (rows,), **g)
    req_ids = torch.arange(rows, dtype=I32, device="cuda")
    table = torch.randint(0, 1 << 20, (rows, 512), **g).to(I32)
    poison = cases.poisoned((9, width), I32, gen)
    counts = cases.poisoned((9,), I32, gen)
    stock_group, fused_group = (
        _group(width, poison, counts),
        _group(width, poison, counts),
    )
    keys = []
    if inside:
        fields = dict(groups=groups, width=width, block_size=block, stride_rows=block)
        keys = [
            REMAP.dispatch(
                **fields, positions_dtype=I64, int32_lengths=True, counts=True
            )
        ]
    stage = stage_with(REMAP, keys)
    remap = FusedRemap(fused_group, stage)
    convert = dict(block_stride_rows=block, return_valid_counts=True)
    remap.hand_over(Deferred(pool_ids, positions))
    fused_group.set_logical_topk_ready(0)
    logical = fused_group.logical_topk_indices[:rows]
    remap(fused_group._convert_once, 0, logical, req_ids, table, block, **convert)
    logical = stock_group.logical_topk_indices[:rows]
    logical[:, : groups * POOL + POOL - 1] = expand_pools_and_append_tail(
        pool_ids.to(I64), positions.to(I32) + 1, POOL
    )
    stock_group.set_logical_topk_ready(0)
    stock_group._convert_once(0, logical, req_ids, table, block, **convert)
    torch.cuda.synchronize()
    assert stage.launched == keys
    assert torch.equal(
        fused_group.physical_topk_indices, stock_group.physical_topk_indices
    )
    assert torch.equal(fused_group.valid_topk_counts, stock_group.valid_topk_counts)
