# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``as_fp32_logits``: BF16 logits below each row end converted to FP32
(8-byte loads, 16-byte stores that a warp lays side by side), DeepGEMM's row
stride kept, the tiles of long rows spread over the CTAs of short ones."""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from quack.utils import warp_prefix_sum

from ..common.ptx import float_bits, load_words_if, store_words_if, unpack_bf16

# 256-thread CTAs of 2048-element tiles, at most 512 CTAs whatever the shape
# (the row ends are device data): a grid's fixed cost grows with its CTAs
# even where they have nothing to do, and rows that end far below the width
# are the usual decode step (the width is max_model_len). docs/performance.md
# has the measurements behind the bound.
THREADS, CTAS = 256, 512
TILE = THREADS * 8
TILE_SHIFT = TILE.bit_length() - 1
# The tiles of each group of this many rows (a warp's lanes) past their
# first tile are dealt out over the group's CTAs.
GROUP_ROWS = 32


class UpcastLogits:
    """Converts the logits in tiles of ``TILE`` columns of one row, below the
    row end. CTA ``(row, split)`` first takes its row's tile ``split``, as
    stock does; the tiles past each row's first ``splits`` are then dealt out
    in row order over the CTAs of the row's group of ``GROUP_ROWS`` rows, so
    that a long row does not keep its CTAs busy while short rows' idle."""

    def __init__(self, key):
        del key  # one variant serves every shape

    @cute.jit
    def __call__(
        self,
        src: cute.Tensor,
        dst: cute.Tensor,
        ends: cute.Tensor,
        ctas: Int32,
        stream: cuda.CUstream,
    ):
        rows, width = src.shape
        splits = cutlass.min((width + TILE - 1) // TILE, cutlass.max(1, ctas // rows))
        self.kernel(src, dst, ends).launch(
            grid=(rows, splits, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor, ends: cute.Tensor):
        row, split, _ = cute.arch.block_idx()
        rows, splits, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        group = row - row % GROUP_ROWS
        cute.arch.griddepcontrol_wait()
        # The dependent grid may launch once every CTA is on its last tile:
        # at once where the width gives each CTA about two tiles at most (a
        # row's first, then one of the rest; one more where ends run into the
        # row padding), so that short rows do not wait for the ends' load.
        if 2 * splits * TILE >= src.shape[1]:
            cute.arch.griddepcontrol_launch_dependents()
        # Lane l of every warp holds the end of the group's row l: one load.
        lane_end = Int32(
            load_words_if(ends.iterator + group + lane, 1, group + lane < rows)[0]
        )
        end = cute.arch.shuffle_sync(lane_end, offset=row - group)
        # Else here if this CTA's row has no tile for it past the first (the
        # other CTAs' triggers, which come later, decide): before the tile,
        # since a short row's whole time is that tile.
        if (split + splits) * TILE >= end:
            cute.arch.griddepcontrol_launch_dependents()
        # Each lane's row's tiles past the first splits: ceil(end / TILE) -
        # splits, without overflow near 2^31.
        count = Int32(0)
        if lane_end > splits * TILE:
            count = ((lane_end - 1) >> TILE_SHIFT) + 1 - splits
        more = cute.arch.vote_ballot_sync(count > 0) != 0
        lane_first, rest = Int32(0), Int32(0)
        # Between the first tile's loads and its stores, if any row has more
        # tiles, the group's tiles before each row: the scan overlaps the
        # loads in flight.
        loaded = self.load_tile(src, row, split * TILE, end)
        if more:
            lane_first, rest = self.scan(count)
        self.store_tile(src, dst, row, split * TILE, end, loaded)
        # (Without more tiles every CTA of the group let the dependent grid
        # launch above: its row's tiles past the first were none.)
        if more:
            self.rest_tiles(src, dst, lane_end, lane_first, rest, group)

    @cute.jit
    def scan(self, count: Int32):
        """The group's tiles past the rows' first before each lane's row,
        and in all its rows."""
        upto = warp_prefix_sum(count)
        return upto - count, cute.arch.shuffle_sync(upto, offset=GROUP_ROWS - 1)

    @cute.jit
    def rest_tiles(self, src, dst, lane_end, lane_first, rest, group):
        """The group's CTA ``cta`` takes its tiles past the rows' first
        ``cta``, ``cta + ctas``, ...: every CTA has as many as the others,
        give or take one, so one with one at most lets the dependent grid
        launch now, the others on their last."""
        row, split, _ = cute.arch.block_idx()
        rows, splits, _ = cute.arch.grid_dim()
        cta = (row - group) * splits + split
        ctas = cutlass.min(GROUP_ROWS, rows - group) * splits
        if cta + ctas >= rest:
            cute.arch.griddepcontrol_launch_dependents()
        owner = self.owner(lane_first, cta)
        for t in cutlass.range(cta, rest, ctas, unroll=1):
            if t + ctas >= rest:
                cute.arch.griddepcontrol_launch_dependents()
            t_row = group + owner
            first = (
                splits + t - cute.arch.shuffle_sync(lane_first, offset=owner)
            ) * TILE
            t_end = cute.arch.shuffle_sync(lane_end, offset=owner)
            loaded = self.load_tile(src, t_row, first, t_end)
            # The next tile's row, found while this tile's loads fly.
            owner = self.owner(lane_first, t + ctas)
            self.store_tile(src, dst, t_row, first, t_end, loaded)

    @cute.jit
    def owner(self, lane_first: Int32, tile: Int32) -> Int32:
        """The lane of the row that holds the group's tile ``tile``: the last
        whose first tile is at most ``tile`` (rows without tiles share the
        next row's first tile; lanes past the rows start at the total)."""
        taken = cute.arch.vote_ballot_sync(lane_first <= tile)
        return Int32(31) - Int32(cute.arch.clz(taken))

    @cute.jit
    def load_tile(self, src: cute.Tensor, row: Int32, first: Int32, end: Int32):
        """The words of the tile of ``row`` from column ``first`` below
        ``end``: each thread two runs of 4 columns, so that a warp's 16-byte
        stores cover 512 contiguous bytes (one 16-byte load a thread would
        make each warp store fill half of each of 32 sectors)."""
        tid, _, _ = cute.arch.thread_idx()
        # A whole load is safe below the row's width, and below its end,
        # which stock reads up to: the run that holds a row end is loaded
        # whole, and only its stores are per element.
        below = cutlass.min(end, cutlass.max(end, src.shape[1]) - 3)
        offset = Int64(row) * src.stride[0]
        return [
            load_words_if(src.iterator + offset + c, 2, c < below)
            for c in (first + tid * 4, first + (THREADS + tid) * 4)
        ]

    @cute.jit
    def store_tile(self, src, dst, row, first, end, loaded):
        tid, _, _ = cute.arch.thread_idx()
        loadable = cutlass.max(end, src.shape[1])
        offset = Int64(row) * src.stride[0]
        runs = (first + tid * 4, first + (THREADS + tid) * 4)
        for c, w in zip(runs, loaded, strict=True):
            full = c + 4 <= end
            values = []
            for i in cutlass.range_constexpr(2):
                lo, hi = unpack_bf16(w[i])
                values += [float_bits(lo), float_bits(hi)]
            store_words_if(dst.iterator + offset + c, values, full)
            if c < end and not full:
                if c + 4 <= loadable:
                    # Independent predicated stores: no chain of loads at
                    # the row end (a short row's whole time).
                    for i in cutlass.range_constexpr(4):
                        store_words_if(
                            dst.iterator + offset + c + i,
                            values[i : i + 1],
                            c + i < end,
                        )
                else:  # the last run of a width that is not a multiple of 4
                    for e in cutlass.range(c, end, unroll=1):
                        dst[row, e] = Float32(src[row, e])
