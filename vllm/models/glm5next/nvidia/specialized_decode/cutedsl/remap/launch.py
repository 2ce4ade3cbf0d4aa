# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host side of ``ExpandRemap``: what it takes, its compile key, its
launch."""

from dataclasses import dataclass

import cutlass.cute as cute
import torch
from cutlass import Int32
from cutlass.cute.runtime import make_fake_tensor

from vllm.model_executor.warmup.jit_warmup import kernel_launcher

from ...constants import INT32_MAX, MAX_GROUPS, POOL
from ..common.host import (
    INDEX_TYPES,
    KpoolKernel,
    check_devices,
    check_int32,
    layout,
    mismatch,
)
from .kernel import ExpandRemap

# The stock conversion's column tile: its rows are whole tiles.
STOCK_TILE = 128


def stock_compacts_in_order(width: int) -> bool:
    """Whether the stock conversion of ``width``-wide rows with counts keeps
    the column order (one program owns each row, ``_remap_tiling``); wider
    rows compact through racing atomics, which no kernel can match."""
    padded = 1 << max(width - 1, 0).bit_length()
    return padded == width or padded <= 4096


def check_shape(groups: int, width: int, pool_size: int, counts: bool) -> None:
    """What ``ExpandRemap`` takes of ``groups`` pools in rows of ``width``
    columns (raises ``Refused``): the stage asks it before a step defers."""
    if pool_size != POOL:
        raise mismatch("pool_size", str(POOL), pool_size)
    if groups % 32 or not 32 <= groups <= MAX_GROUPS:
        raise mismatch(
            "pool_ids", f"a multiple of 32 pools, at most {MAX_GROUPS}", groups
        )
    if width < groups * POOL + POOL - 1 or width % STOCK_TILE:
        raise mismatch(
            "out",
            f"a width of at least pools * 4 + 3 ({groups * POOL + POOL - 1}) "
            f"columns, a multiple of {STOCK_TILE}",
            width,
        )
    if counts and not stock_compacts_in_order(width):
        raise mismatch(
            "out",
            "a width the stock conversion with counts compacts "
            "in column order (at most 4096)",
            width,
        )


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
    """What ``ExpandRemap`` takes (raises ``Refused``)."""
    check_devices(
        ("pool_ids", "positions", "req_ids", "block_table", "out", "counts"),
        pool_ids,
        positions,
        req_ids,
        block_table,
        out,
        counts,
        optional=("counts",),
    )
    ids = pool_ids.stride()
    # An empty tensor's strides say nothing (CUDA may give [0, 1] [1, 0]).
    unit = len(ids) == 2 and (ids[1] == 1 or not pool_ids.numel())
    if pool_ids.dtype is not torch.int32 or not unit:
        raise mismatch(
            "pool_ids", "int32 [rows, pools], unit column stride", layout(pool_ids)
        )
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
        raise mismatch(
            "out",
            "a contiguous 16-byte aligned int32 [rows of req_ids, width]",
            layout(out),
        )
    check_shape(pool_ids.shape[1], size[1], pool_size, counts is not None)
    # The kernel's block arithmetic is int32 (block_size is a power of two
    # or a multiple of 4 that the MLA cache takes).
    if (
        not isinstance(block_size, int)
        or block_size % POOL
        or not 0 < block_size <= INT32_MAX
    ):
        raise mismatch("block_size", "a positive int32 multiple of 4", block_size)
    check_int32("stride_rows", stride_rows)
    if counts is not None and (
        counts.dtype is not torch.int32
        or counts.stride() != (1,)
        or counts.shape[0] < rows
    ):
        raise mismatch(
            "counts", "int32 [>= rows of req_ids], unit stride", layout(counts)
        )
    blocks = block_table.stride()
    if block_table.dtype is not torch.int32 or len(blocks) != 2 or blocks[1] != 1:
        raise mismatch(
            "block_table",
            "int32 [requests, blocks], unit column stride",
            layout(block_table),
        )
    if pool_ids.shape[0] > rows:
        raise mismatch(
            "pool_ids", f"at most the rows of req_ids ({rows})", pool_ids.shape[0]
        )
    if (
        positions.dtype not in INDEX_TYPES
        or positions.stride() != (1,)
        or positions.shape[0] < pool_ids.shape[0]
    ):
        raise mismatch(
            "positions",
            "int32/int64 [>= rows of pool_ids], unit stride",
            layout(positions),
        )
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
        key = self.dispatch(
            groups=pool_ids.shape[1],
            width=out.shape[1],
            block_size=block_size,
            stride_rows=stride_rows,
            positions_dtype=positions.dtype,
            int32_lengths=bool(int32_lengths),
            counts=counts is not None,
        )
        args = None
        if req_ids.shape[0]:
            args = (pool_ids, positions, req_ids, block_table, out, counts, seq_offset)
        return key, args, out

    __call__ = kernel_launcher(spec)

    def warmup_inputs(self, compile_key: CompileKey) -> tuple:
        k = compile_key
        rows = cute.sym_int()
        ids = make_fake_tensor(
            Int32, (cute.sym_int(), k.groups), (cute.sym_int64(), 1), assumed_align=4
        )
        positions = make_fake_tensor(
            INDEX_TYPES[k.positions_dtype], (cute.sym_int(),), (1,), assumed_align=4
        )
        req_ids = make_fake_tensor(Int32, (rows,), (1,), assumed_align=4)
        table = make_fake_tensor(
            Int32,
            (cute.sym_int(), cute.sym_int()),
            (cute.sym_int64(), 1),
            assumed_align=4,
        )
        out = make_fake_tensor(Int32, (rows, k.width), (k.width, 1), assumed_align=16)
        counts = None
        if k.counts:
            counts = make_fake_tensor(Int32, (cute.sym_int(),), (1,), assumed_align=4)
        return ids, positions, req_ids, table, out, counts, Int32(0)


REMAP = RemapKernel()
