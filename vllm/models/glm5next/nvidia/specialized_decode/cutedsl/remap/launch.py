# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host side of ``ExpandRemap``: what it takes, its compile key, its launch."""

from dataclasses import dataclass

import cutlass.cute as cute
import torch
from cutlass import Int32

from ...constants import INT32_MAX, MAX_GROUPS, POOL
from ..common.host import (
    KpoolKernel,
    Refused,
    check_devices,
    check_int,
    check_int32,
    check_pool_ids,
    check_pool_size,
    check_vector,
    fake,
    kernel_launcher,
    layout,
    mismatch,
    unit_columns,
)
from .kernel import ExpandRemap

# The stock conversion's column tile: its rows are whole tiles.
STOCK_TILE = 128


def stock_compacts_in_order(width: int) -> bool:
    """Whether the stock conversion of ``width``-wide rows with counts keeps
    the column order (one program a row); wider rows compact through racing
    atomics (``_remap_tiling``), which no kernel can match."""
    padded = 1 << max(width - 1, 0).bit_length()
    return padded == width or padded <= 4096


def check_shape(groups: int, width: int, pool_size: int, counts: bool) -> None:
    """What ``ExpandRemap`` takes of ``groups`` pools in rows of ``width``
    columns (raises ``Refused``): the stage asks it before a step defers."""
    check_pool_size(pool_size)
    if groups % 32 or not 32 <= groups <= MAX_GROUPS:
        expected = f"a multiple of 32 pools, at most {MAX_GROUPS}"
        raise mismatch("pool_ids", expected, groups)
    if width < groups * POOL + POOL - 1 or width % STOCK_TILE:
        expected = f"a width of at least pools * 4 + 3 ({groups * POOL + POOL - 1}) "
        raise mismatch("out", expected + f"columns, a multiple of {STOCK_TILE}", width)
    if counts and not stock_compacts_in_order(width):
        expected = "a width the stock conversion with counts compacts in column "
        raise mismatch("out", expected + "order (at most 4096)", width)


def check_blocks(block_size, stride_rows) -> None:
    """What ``ExpandRemap`` takes of an MLA KV cache's layout (raises
    ``Refused``): its block arithmetic is int32 (``block_size`` is a power
    of two or a multiple of 4 that the MLA cache takes)."""
    expected = "a positive int32 multiple of 4"
    check_int("block_size", block_size, 1, INT32_MAX, expected)
    if block_size % POOL:
        raise mismatch("block_size", expected, block_size)
    check_int32("stride_rows", stride_rows)


def remap_takes(groups: int, width: int, pool_size: int = POOL, layout=None):
    """Whether ``ExpandRemap`` takes a pool top-k of ``groups`` pools for
    rows of ``width`` columns, with counts (and so without): a stage's step
    defers only such a top-k; and, where given, an MLA cache ``layout``
    (block size, rows between blocks)."""
    try:
        check_shape(groups, width, pool_size, counts=True)
        if layout is not None:
            check_blocks(*layout)
    except Refused:
        return False
    return True


def check(
    pool_ids,
    positions,
    pool_size,
    req_ids,
    block_table,
    out,
    counts,
    block_size,
    stride_rows,
    seq_offset,
) -> None:
    """``RemapKernel``'s rule (raises ``Refused``)."""
    names = ("pool_ids", "positions", "req_ids", "block_table", "out", "counts")
    tensors = (pool_ids, positions, req_ids, block_table, out, counts)
    check_devices(names, *tensors, optional=("counts",))
    check_pool_ids(pool_ids)
    if req_ids.dtype is not torch.int32 or req_ids.stride() != (1,):
        raise mismatch("req_ids", "int32 [rows], unit stride", layout(req_ids))
    rows = req_ids.shape[0]
    size = out.shape
    if (
        out.dtype is not torch.int32
        or len(size) != 2
        or size[0] != rows
        or not out.is_contiguous()
        or out.data_ptr() % 16
    ):
        expected = "a contiguous 16-byte aligned int32 [rows of req_ids, width]"
        raise mismatch("out", expected, layout(out))
    check_shape(pool_ids.shape[1], size[1], pool_size, counts is not None)
    check_blocks(block_size, stride_rows)
    if counts is not None:
        expected = "int32 [>= rows of req_ids], unit stride"
        check_vector("counts", counts, rows, expected, (torch.int32,))
    if not unit_columns(block_table, (torch.int32,)):
        expected = "int32 [requests, blocks], unit column stride"
        raise mismatch("block_table", expected, layout(block_table))
    if pool_ids.shape[0] > rows:
        expected = f"at most the rows of req_ids ({rows})"
        raise mismatch("pool_ids", expected, pool_ids.shape[0])
    expected = "int32/int64 [>= rows of pool_ids], unit stride"
    check_vector("positions", positions, pool_ids.shape[0], expected)
    check_int32("seq_offset", seq_offset)


class RemapKernel(KpoolKernel["RemapKernel.CompileKey"]):
    """``triton_convert_req_index_to_global_index(req_ids, block_table,
    logical, BLOCK_SIZE=block_size, BLOCK_STRIDE_ROWS=stride_rows,
    return_valid_counts=counts is not None, out=out, valid_counts_out=counts)``
    where ``logical`` (``out``'s shape) holds, in its first
    ``pool_ids.shape[0]`` rows, ``expand_pools_and_append_tail(pool_ids,
    positions, pool_size, seq_offset=seq_offset)`` and -1 everywhere else.
    ``int32_lengths`` as ``ExpandKernel``'s. One compile key per top-k shape,
    KV block layout, positions arithmetic and conversion (with or without
    counts)."""

    @dataclass(frozen=True)
    class CompileKey:
        groups: int
        width: int
        block_size: int
        stride_rows: int
        positions_dtype: torch.dtype
        int32_lengths: bool
        counts: bool

    kernel = ExpandRemap

    def spec(
        self,
        *,
        pool_ids: torch.Tensor,
        positions: torch.Tensor,
        pool_size: int,
        req_ids: torch.Tensor,
        block_table: torch.Tensor,
        out: torch.Tensor,
        counts: torch.Tensor | None = None,
        block_size: int,
        stride_rows: int,
        seq_offset: int = 1,
        int32_lengths: bool = False,
    ):
        check(
            pool_ids,
            positions,
            pool_size,
            req_ids,
            block_table,
            out,
            counts,
            block_size,
            stride_rows,
            seq_offset,
        )
        fields = dict(groups=pool_ids.shape[1], width=out.shape[1])
        fields |= dict(block_size=block_size, stride_rows=stride_rows)
        fields |= dict(positions_dtype=positions.dtype, counts=counts is not None)
        key = self.dispatch(**fields, int32_lengths=bool(int32_lengths))
        args = None
        if req_ids.shape[0]:
            args = (pool_ids, positions, req_ids, block_table, out, counts, seq_offset)
        return key, args, out

    __call__ = kernel_launcher(spec)

    def warmup_inputs(self, compile_key: CompileKey) -> tuple:
        k, rows = compile_key, cute.sym_int()
        ids = fake(torch.int32, (cute.sym_int(), k.groups), (cute.sym_int64(), 1))
        positions = fake(k.positions_dtype, (cute.sym_int(),), (1,))
        req_ids = fake(torch.int32, (rows,), (1,))
        shape = (cute.sym_int(), cute.sym_int())
        table = fake(torch.int32, shape, (cute.sym_int64(), 1))
        out = fake(torch.int32, (rows, k.width), (k.width, 1), 16)
        counts = fake(torch.int32, (cute.sym_int(),), (1,)) if k.counts else None
        return ids, positions, req_ids, table, out, counts, Int32(0)


REMAP = RemapKernel()
