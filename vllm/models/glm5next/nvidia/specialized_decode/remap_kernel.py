# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``expand_pools_and_append_tail`` and the sparse MLA index remap
(``triton_convert_req_index_to_global_index``) in one CuTe DSL kernel, with
counts (the compacted rows) or without (in place), one CTA per query row."""

from dataclasses import dataclass
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32
from cutlass.cute.runtime import make_fake_tensor

from vllm.models.glm5next.nvidia.specialized_decode.constants import (
    INT32_MAX,
    MAX_GROUPS,
    POOL,
)
from vllm.models.glm5next.nvidia.specialized_decode.jit import (
    INDEX_TYPES,
    KpoolJitKernel,
    Refused,
    TensorFields,
    check_int32,
    layout,
    mismatch,
)
from vllm.models.glm5next.nvidia.specialized_decode.ptx import (
    store_words,
    trunc_div,
)

# The stock conversion's column tile: its rows are whole tiles.
STOCK_TILE = 128


class RemapArgs(NamedTuple):
    """``triton_convert_req_index_to_global_index(req_ids, block_table,
    logical, BLOCK_SIZE=block_size, BLOCK_STRIDE_ROWS=stride_rows,
    return_valid_counts=counts is not None)`` of the logical rows that
    ``expand_pools_and_append_tail(pool_ids, positions, pool_size,
    seq_offset=seq_offset)`` writes (the rows past ``pool_ids``: -1), into
    ``out`` and ``counts``. ``int32_lengths`` as in ``ExpandArgs``."""

    pool_ids: torch.Tensor
    positions: torch.Tensor
    pool_size: int
    req_ids: torch.Tensor
    block_table: torch.Tensor
    out: torch.Tensor
    counts: torch.Tensor | None
    block_size: int
    stride_rows: int
    seq_offset: int = 1
    int32_lengths: bool = False


def stock_compacts_in_order(width: int) -> bool:
    """Whether the stock conversion of ``width``-wide rows with counts keeps
    the column order (one program owns each row, ``_remap_tiling``); wider
    rows compact through racing atomics, which no kernel can match."""
    padded = 1 << max(width - 1, 0).bit_length()
    return padded == width or padded <= 4096


def check_shape(groups: int, width: int, pool_size: int, counts: bool) -> None:
    """What the kernel takes of ``groups`` pools in rows of ``width``
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


def shape_takes(groups: int, width: int, pool_size: int, counts: bool) -> bool:
    try:
        check_shape(groups, width, pool_size, counts)
    except Refused:
        return False
    return True


_TENSORS = TensorFields(
    RemapArgs,
    ("pool_ids", "positions", "req_ids", "block_table", "out"),
    optional=("counts",),
)


def _check_layouts(a: RemapArgs) -> None:
    # This runs before every eager launch: each tensor's strides are read
    # once, as a tuple that also stands for ndim and unit strides.
    pool_ids, req_ids, out = a.pool_ids, a.req_ids, a.out
    ids = pool_ids.stride()
    if pool_ids.dtype is not torch.int32 or len(ids) != 2 or ids[1] != 1:
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
    counts = a.counts
    check_shape(pool_ids.shape[1], size[1], a.pool_size, counts is not None)
    # The kernel's block arithmetic is int32 (block_size is a power of two
    # or a multiple of 4 that the MLA cache takes).
    block_size = a.block_size
    if (
        not isinstance(block_size, int)
        or block_size % POOL
        or not 0 < block_size <= INT32_MAX
    ):
        raise mismatch("block_size", "a positive int32 multiple of 4", block_size)
    check_int32("stride_rows", a.stride_rows)
    if counts is not None and (
        counts.dtype is not torch.int32
        or counts.stride() != (1,)
        or counts.shape[0] < rows
    ):
        raise mismatch(
            "counts", "int32 [>= rows of req_ids], unit stride", layout(counts)
        )
    table = a.block_table
    blocks = table.stride()
    if table.dtype is not torch.int32 or len(blocks) != 2 or blocks[1] != 1:
        raise mismatch(
            "block_table",
            "int32 [requests, blocks], unit column stride",
            layout(table),
        )
    if pool_ids.shape[0] > rows:
        raise mismatch(
            "pool_ids", f"at most the rows of req_ids ({rows})", pool_ids.shape[0]
        )
    positions = a.positions
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
    check_int32("seq_offset", a.seq_offset)


class _RemapKernel:
    """CTA ``row`` converts query row ``row``; thread ``g`` maps pool
    ``pool_ids[row, g]``. The four tokens of a pool share one KV block, so the
    pool is valid or invalid as a whole: one 16-byte store of slots, at its
    own columns (no counts) or at a compacted offset, a multiple of 4, in the
    stock compaction's column order (history pools by rank, the trailing
    incomplete pool, then -1). Rows from ``pool_ids.shape[0]`` on (graph
    padding, -1 in the stock logical rows) hold no indices."""

    def __init__(self, key: "ExpandRemapKernel.CompileKey"):
        assert key.groups % 32 == 0 and key.block_size % POOL == 0
        self.groups, self.width = key.groups, key.width
        self.block_size, self.stride_rows = key.block_size, key.stride_rows
        self.counts, self.warps = key.counts, key.groups // 32
        # The tail in the dtype of positions, as stock's expansion computes it,
        # or in int32 of truncated positions, as stock's decode casts them.
        wide = key.positions_dtype == torch.int64 and not key.int32_lengths
        self.wide = Int64 if wide else Int32

    @cute.jit
    def __call__(
        self,
        pool_ids: cute.Tensor,
        positions: cute.Tensor,
        req_ids: cute.Tensor,
        block_table: cute.Tensor,
        out: cute.Tensor,
        counts: cute.Tensor | None,
        seq_offset: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(
            pool_ids, positions, req_ids, block_table, out, counts, seq_offset
        ).launch(
            grid=(req_ids.shape[0], 1, 1),
            block=(self.groups, 1, 1),
            stream=stream,
            use_pdl=True,
        )

    @cute.jit
    def slot(self, block_table, req, token, max_blocks):
        """(1 if valid else 0, physical row) of logical token ``token``, as
        stock maps it: -1 and blocks past the table are invalid."""
        valid = Int32(0)
        value = Int32(0)
        if token >= 0:
            block = token // self.block_size
            if block < max_blocks:
                valid = Int32(1)
                value = block_table[req, block] * self.stride_rows + (
                    token % self.block_size
                )
        return valid, value

    @cute.jit
    def tail(self, block_table, req, seq_len, max_blocks):
        """(1 if valid else 0, physical row) of each of the trailing
        incomplete pool's three possible tokens, computed in the dtype of
        positions as stock's expansion."""
        wide = self.wide
        tail_start = trunc_div(seq_len, POOL, wide) * POOL
        valid = [Int32(0)] * (POOL - 1)
        value = [Int32(0)] * (POOL - 1)
        for j in cutlass.range_constexpr(POOL - 1):
            if wide(j) < seq_len - tail_start:
                token = Int32(tail_start + j)
                valid[j], value[j] = self.slot(block_table, req, token, max_blocks)
        return valid, value

    @cute.kernel
    def kernel(
        self, pool_ids, positions, req_ids, block_table, out, counts, seq_offset
    ):
        row, _, _ = cute.arch.block_idx()
        g, _, _ = cute.arch.thread_idx()
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        req = req_ids[row]
        max_blocks = block_table.shape[1]
        expanded = row < pool_ids.shape[0]
        live = Int32(0)
        first = Int32(0)
        # The thread that appends the trailing pool loads its block-table
        # entries here, beside its own pool's, before any store: after a
        # store they would wait for it (out may alias the table) and for
        # each other, a chain of dependent loads.
        tail_thread = self.groups - 1 if cutlass.const_expr(self.counts) else 0
        tail_valid = [Int32(0)] * (POOL - 1)
        tail_value = [Int32(0)] * (POOL - 1)
        seq_len = self.wide(0)
        if expanded and g == tail_thread:
            seq_len = self.wide(positions[row]) + self.wide(seq_offset)
        if expanded:
            pid = Int32(pool_ids[row, g])
            # The stock expansion's int32 token ids (wrapped ones included).
            valid, value = self.slot(block_table, req, pid * POOL, max_blocks)
            if pid >= 0 and valid == 1:
                live, first = Int32(1), value
            if g == tail_thread:
                tail_valid, tail_value = self.tail(
                    block_table, req, seq_len, max_blocks
                )
        row_out = out.iterator + Int64(row) * self.width
        if cutlass.const_expr(self.counts):
            self.compacted(
                out, counts, row, g, live, first, tail_valid, tail_value, row_out
            )
        else:
            self.in_place(g, live, first, tail_valid, tail_value, row_out)

    @cute.jit
    def in_place(self, g, live, first, tail_valid, tail_value, row_out):
        words = [Uint32(0xFFFFFFFF)] * POOL
        if live == 1:
            words = [Uint32(first + o) for o in range(POOL)]
        store_words(row_out + g * POOL, words)
        if g == 0:
            # The trailing pool's three columns and the first -1 column.
            tail = [Uint32(0xFFFFFFFF)] * POOL
            for j in cutlass.range_constexpr(POOL - 1):
                if tail_valid[j] == 1:
                    tail[j] = Uint32(tail_value[j])
            store_words(row_out + self.groups * POOL, tail)
        for c in cutlass.range(
            (self.groups + 1 + g) * POOL, self.width, self.groups * POOL, unroll=1
        ):
            store_words(row_out + c, [Uint32(0xFFFFFFFF)] * POOL)

    @cute.jit
    def compacted(
        self, out, counts, row, g, live, first, tail_valid, tail_value, row_out
    ):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        smem = cutlass.memory.SmemAllocator()
        # Each warp's live pools, then the trailing pool's valid tokens: one
        # barrier gives every thread its offset and the row's valid total.
        warp_counts = smem.allocate_tensor(Int32, cute.make_layout(self.warps + 1))
        ballot = cute.arch.vote_ballot_sync(live == 1)
        below = cute.arch.popc(ballot & ((Uint32(1) << lane) - Uint32(1)))
        if lane == 0:
            warp_counts[warp] = Int32(cute.arch.popc(ballot))
        if g == self.groups - 1:
            warp_counts[self.warps] = tail_valid[0] + tail_valid[1] + tail_valid[2]
        cute.arch.barrier()
        # Lane w holds warp w's count: the pools of the warps before this
        # one and of all warps, each a butterfly sum (at most 32 warps).
        count = Int32(0)
        if lane < self.warps:
            count = warp_counts[lane]
        earlier = Int32(0)
        if lane < warp:
            earlier = count
        history = cute.arch.warp_reduction(count, lambda a, b: a + b)
        prior = cute.arch.warp_reduction(earlier, lambda a, b: a + b)
        if live == 1:
            offset = (prior + Int32(below)) * POOL
            store_words(row_out + offset, [Uint32(first + o) for o in range(POOL)])
        valid_total = history * POOL + warp_counts[self.warps]
        if g == self.groups - 1:
            # The last thread appends the tail after the history pools.
            total = history * POOL
            for j in cutlass.range_constexpr(POOL - 1):
                if tail_valid[j] == 1:
                    out[row, total] = tail_value[j]
                    total += 1
            counts[row] = valid_total
        for c in cutlass.range(valid_total + g, self.width, self.groups, unroll=1):
            out[row, c] = Int32(-1)


class ExpandRemapKernel(KpoolJitKernel["ExpandRemapKernel.CompileKey", RemapArgs]):
    """The compiled ``_RemapKernel`` executors, one per top-k shape, KV block
    layout, positions arithmetic and conversion (with or without counts)."""

    @dataclass(frozen=True)
    class CompileKey:
        groups: int
        width: int
        block_size: int
        stride_rows: int
        positions_dtype: torch.dtype
        int32_lengths: bool
        counts: bool

    def key_for(self, args: RemapArgs) -> CompileKey:
        _TENSORS.check(args)
        _check_layouts(args)
        return self.key(
            args.pool_ids.shape[1],
            args.out.shape[1],
            args.block_size,
            args.stride_rows,
            args.positions.dtype,
            bool(args.int32_lengths),
            args.counts is not None,
        )

    def executor_args(self, args: RemapArgs) -> tuple | None:
        a = args
        if not a.req_ids.shape[0]:
            return None
        return (
            a.pool_ids,
            a.positions,
            a.req_ids,
            a.block_table,
            a.out,
            a.counts,
            a.seq_offset,
        )

    @staticmethod
    def kernel(compile_key: CompileKey) -> _RemapKernel:
        return _RemapKernel(compile_key)

    def warmup_inputs(self, compile_key: CompileKey) -> tuple:
        k = compile_key
        rows = cute.sym_int()
        ids = make_fake_tensor(
            Int32, (cute.sym_int(), k.groups), (cute.sym_int64(), 1), assumed_align=4
        )
        positions = make_fake_tensor(
            INDEX_TYPES[k.positions_dtype],
            (cute.sym_int(),),
            (1,),
            assumed_align=4,
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


REMAP = ExpandRemapKernel()
