# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``RemapKernel``'s device code: the pool expansion and the sparse MLA
index remap in one kernel, one CTA per query row."""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32

from ...constants import POOL
from ..common.ptx import store_words, trunc_div


class ExpandRemap:
    """CTA ``row`` converts query row ``row``; thread ``g`` maps pool
    ``pool_ids[row, g]``. The four tokens of a pool share one KV block, so the
    pool is valid or invalid as a whole: one 16-byte store of slots, at its
    own columns (no counts) or at a compacted offset, a multiple of 4, in the
    stock compaction's column order (history pools by rank, the trailing
    incomplete pool, then -1). Rows from ``pool_ids.shape[0]`` on (graph
    padding, -1 in the stock logical rows) hold no indices."""

    def __init__(self, key):
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
        args = (pool_ids, positions, req_ids, block_table, out, counts, seq_offset)
        self.kernel(*args).launch(
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
