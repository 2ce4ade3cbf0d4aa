# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The indexer's decode scores over the paged FP8 index cache on Hopper:
what DeepGEMM's ``fp8_fp4_paged_mqa_logits`` computes on SM90 (FP8 query,
its scale folded into the FP32 weights, FP32 cache scales).

For batch entry ``b``, query row ``i`` (of ``next_n``) and pool ``p`` below
``ctx = seq_lens[b, next_n - 1]``::

    logits[b * next_n + i, p] =
        sum_h relu(q[b, i, h] . k[p]) * weights[b * next_n + i, h]  * scale[p]

with the FP32 rounding of DeepGEMM's SM90 kernel, step for step:

- ``q[b, i, h] . k[p]``: four ``wgmma.m64nNk32`` e4m3 x e4m3 -> f32, pools
  on M (64 a tile), ``next_n * heads`` on N, the head dimension split in
  four 32-wide steps in order, the first not accumulating. The same
  instructions on the same operands give the same FP32 sums.
- the head sum, as the accumulator's register layout hands the heads to a
  quad of lanes: lane ``l % 4 = c`` holds heads ``8 j + 2 c`` (even) and
  ``8 j + 2 c + 1`` (odd); each is summed over ``j`` ascending as nvcc
  compiles DeepGEMM's ``sum = t(0); sum += t(j)`` with ``t(j) = relu(acc_j)
  * w_j`` (its SASS: FMUL, then FFMA): ``fma(relu(acc_0), w_0, t(1))``,
  then ``fma(relu(acc_j), w_j, sum)`` for ``j >= 2``; then ``(even + odd)
  * scale``, then the quad's four partials ``(c0 + c1) + (c2 + c3)`` (two
  butterfly shuffles). With nvcc's ``--use_fast_math`` DeepGEMM's steps
  would flush FP32 denormals (``.ftz``), which these do not: the two differ
  only where a product, a sum or a logit falls below 2^-126.
- 16 heads: as vLLM's padding of them to 32 zero heads for DeepGEMM (the
  stage hands the kernel a view of the 16 real heads of the padded query).

Columns at or past ``ctx`` (or the row width) are not written. Each
arithmetic step is one inline-PTX instruction, so LLVM neither contracts
nor re-associates it.

CTA ``(split, b)`` takes a contiguous share of entry ``b``'s tiles: a
producer warp issues their TMA copies into ``STAGES`` stages, the consumer
warpgroup runs each tile's wgmma and epilogue (docs/performance.md, "Our
scores").
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float8E4M3FN, Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from ...constants import DIM
from ..common.ptx import inline_ptx

# The consumer warpgroup (warps 0-3), then the producer warp.
CONSUMERS = 128
PRODUCER = CONSUMERS // 32
THREADS = CONSUMERS + 32
# Pools a tile: wgmma's M.
TILE = 64
# Tiles in flight a CTA: 4 x 8.25 KiB. A power of two: a tile's stage and
# phase are bits of its non-negative index (no signed division).
STAGE_BITS = 2
STAGES = 1 << STAGE_BITS
# The wgmma K step for FP8.
K_STEP = 32
# The widest N (next_n x heads) whose tiles keep the thread's weights in
# registers (N / 4 of them) and load the pool scales while the wgmma runs;
# wider ones read both from shared memory after it, which measured faster at
# N = 64 (docs/performance.md, "Our scores").
HOISTED = 32


@inline_ptx(Float32, pure=True)
def relu_mul(acc, w):
    """``fmaxf(acc, 0) * w``, each step rounded on its own."""
    code = "{ .reg .f32 r; max.f32 r,$1,0f00000000; mul.rn.f32 $0,r,$2; }"
    return code, "=f,f,f", (Float32(acc), Float32(w))


@inline_ptx(Float32, pure=True)
def relu_fma(acc, w, total):
    """``fma(fmaxf(acc, 0), w, total)``: nvcc's contraction of ``total +=
    fmaxf(acc, 0) * w``."""
    code = "{ .reg .f32 r; max.f32 r,$1,0f00000000; fma.rn.f32 $0,r,$2,$3; }"
    return code, "=f,f,f,f", (Float32(acc), Float32(w), Float32(total))


@inline_ptx(Float32, pure=True)
def add_mul(a, b, scale):
    """``(a + b) * scale``, two roundings."""
    code = "{ .reg .f32 r; add.rn.f32 r,$1,$2; mul.rn.f32 $0,r,$3; }"
    return code, "=f,f,f,f", (Float32(a), Float32(b), Float32(scale))


@inline_ptx(Float32, pure=True)
def add_zero_mul(a, b, scale):
    """``((a + b) + 0.0) * scale``: bit for bit ``add_mul(a + 0.0, b + 0.0,
    scale)``. Adding +0.0 changes only a -0.0 (to +0.0), and under
    round-to-nearest a sum is -0.0 only where both terms are."""
    code = (
        "{ .reg .f32 r; add.rn.f32 r,$1,$2; add.rn.f32 r,r,0f00000000; "
        "mul.rn.f32 $0,r,$3; }"
    )
    return code, "=f,f,f,f", (Float32(a), Float32(b), Float32(scale))


@inline_ptx(Float32, pure=True)
def add(a, b):
    return "add.rn.f32 $0,$1,$2;", "=f,f,f", (Float32(a), Float32(b))


class KpoolScores:
    """The scores of one compile key: ``heads`` (16, 32 or 64), ``next_n``
    (1 to 4) and ``block`` (pools a cache page: 32 or 64)."""

    def __init__(self, key):
        self.heads, self.next_n, self.block = key.heads, key.next_n, key.block
        self.n = self.next_n * self.heads
        self.pages = TILE // self.block  # pages a tile

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        kv: cute.Tensor,
        weights: cute.Tensor,
        seq_lens: cute.Tensor,
        block_table: cute.Tensor,
        logits: cute.Tensor,
        splits: Int32,
        stream: cuda.CUstream,
    ):
        # q: (B, next_n, heads, DIM) FP8, its heads' rows consecutive (a view
        # of vLLM's zero-padded heads takes the real ones); kv: (blocks, block,
        # 1, DIM + 4) bytes, the page's FP8 rows then its FP32 scales.
        entries = q.shape[0]
        blocks = kv.shape[0]
        page = kv.stride[0]
        m_q = cute.make_tensor(
            q.iterator,
            cute.make_layout(
                (self.heads, DIM, self.next_n, entries),
                stride=(DIM, 1, q.stride[1], q.stride[0]),
            ),
        )
        m_k = cute.make_tensor(
            cute.recast_ptr(kv.iterator, dtype=Float8E4M3FN),
            cute.make_layout((self.block, DIM, blocks), stride=(DIM, 1, page)),
        )
        m_scale = cute.make_tensor(
            cute.recast_ptr(kv.iterator + self.block * DIM, dtype=Float32),
            cute.make_layout((self.block, blocks), stride=(1, page // 4)),
        )
        atom = warpgroup.make_smem_layout_atom(
            warpgroup.SmemLayoutAtomKind.K_SW128, Float8E4M3FN
        )
        rows_layout = cute.tile_to_shape(
            atom, (self.heads, DIM, self.next_n), order=(0, 1, 2)
        )
        page_layout = cute.tile_to_shape(
            atom, (self.block, DIM, STAGES * self.pages), order=(0, 1, 2)
        )
        scale_layout = cute.make_layout((self.block, STAGES * self.pages))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, g_q = cpasync.make_tiled_tma_atom(
            g2s, m_q, cute.select(rows_layout, mode=[0, 1]), (self.heads, DIM)
        )
        tma_k, g_k = cpasync.make_tiled_tma_atom(
            g2s, m_k, cute.select(page_layout, mode=[0, 1]), (self.block, DIM)
        )
        tma_s, g_s = cpasync.make_tiled_tma_atom(
            g2s, m_scale, cute.select(scale_layout, mode=[0]), (self.block,)
        )
        self.kernel(
            tma_q, g_q, tma_k, g_k, tma_s, g_s, weights, seq_lens, block_table, logits
        ).launch(
            grid=(splits, entries, 1),
            block=(THREADS, 1, 1),
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        g_q: cute.Tensor,
        tma_k: cute.CopyAtom,
        g_k: cute.Tensor,
        tma_s: cute.CopyAtom,
        g_s: cute.Tensor,
        weights: cute.Tensor,
        seq_lens: cute.Tensor,
        block_table: cute.Tensor,
        logits: cute.Tensor,
    ):
        tid, _, _ = cute.arch.thread_idx()
        split, entry, _ = cute.arch.block_idx()
        splits, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        s_rows, s_q, s_pages, s_tiles, s_scale, s_w, bars = self.allocate()
        if warp == PRODUCER:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_s)
        if tid == 0:
            # A stage's "full" (the TMA bytes), its "empty" (every consumer
            # thread done reading it), the query's.
            for i in cutlass.range_constexpr(STAGES):
                cute.arch.mbarrier_init(bars + i, 1)
                cute.arch.mbarrier_init(bars + STAGES + i, CONSUMERS)
            cute.arch.mbarrier_init(bars + 2 * STAGES, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        # The query, the weights, the lengths and the cache are the previous
        # kernels' outputs.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        # The pools scored: the last row's context, within the row width.
        ctx = cutlass.min(seq_lens[entry, self.next_n - 1], logits.shape[1])
        tiles = (ctx + TILE - 1) // TILE
        per = (tiles + splits - 1) // splits
        first = split * per
        last = cutlass.min(first + per, tiles)
        if first < last:
            pages_used = cutlass.min(
                (ctx + self.block - 1) // self.block, block_table.shape[1]
            )
            q_smem, q_gmem = cpasync.tma_partition(
                tma_q,
                0,
                cute.make_layout(1),
                cute.group_modes(s_rows, 0, 2),
                cute.group_modes(g_q, 0, 2),
            )
            k_smem, k_gmem = cpasync.tma_partition(
                tma_k,
                0,
                cute.make_layout(1),
                cute.group_modes(s_pages, 0, 2),
                cute.group_modes(g_k, 0, 2),
            )
            s_smem, s_gmem = cpasync.tma_partition(
                tma_s,
                0,
                cute.make_layout(1),
                cute.group_modes(s_scale, 0, 1),
                cute.group_modes(g_s, 0, 1),
            )
            if warp == PRODUCER:
                self.produce(
                    tma_q,
                    q_smem,
                    q_gmem,
                    tma_k,
                    k_gmem,
                    k_smem,
                    tma_s,
                    s_gmem,
                    s_smem,
                    bars,
                    block_table,
                    entry,
                    pages_used,
                    first,
                    last,
                )
            else:
                # The weights of the entry's rows, (next_n, heads) in order.
                row0 = entry * self.next_n
                for c in cutlass.range(tid, self.n, CONSUMERS, unroll=1):
                    s_w[c] = weights[row0 + c // self.heads, c % self.heads]
                cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMERS)
                self.tiles(
                    s_q, s_tiles, s_scale, s_w, bars, logits, entry, ctx, first, last
                )

    def allocate(self):
        smem = cutlass.memory.SmemAllocator()
        atom = warpgroup.make_smem_layout_atom(
            warpgroup.SmemLayoutAtomKind.K_SW128, Float8E4M3FN
        )
        q_layout = cute.tile_to_shape(atom, (self.n, DIM), order=(0, 1))
        rows_layout = cute.tile_to_shape(
            atom, (self.heads, DIM, self.next_n), order=(0, 1, 2)
        )
        page_layout = cute.tile_to_shape(
            atom, (self.block, DIM, STAGES * self.pages), order=(0, 1, 2)
        )
        tile_layout = cute.tile_to_shape(atom, (TILE, DIM, STAGES), order=(0, 1, 2))
        # The swizzle goes on the pointer, as wgmma's descriptors want it.
        # The query as the TMA writes it, a (heads, DIM) slab a query row, and
        # as the wgmma reads it: the same bytes, (next_n x heads, DIM).
        s_rows = smem.allocate_tensor(
            Float8E4M3FN, rows_layout.outer, 1024, swizzle=rows_layout.inner
        )
        s_q = cute.make_tensor(s_rows.iterator, q_layout.outer)
        s_pages = smem.allocate_tensor(
            Float8E4M3FN, page_layout.outer, 1024, swizzle=page_layout.inner
        )
        # The tiles' view of the same pages: a (TILE, DIM) stage is
        # ``pages`` consecutive (block, DIM) pages in the swizzled layout.
        s_tiles = cute.make_tensor(s_pages.iterator, tile_layout.outer)
        s_scale = smem.allocate_tensor(
            Float32, cute.make_layout((self.block, STAGES * self.pages)), 128
        )
        s_w = smem.allocate_tensor(Float32, cute.make_layout(self.n), 16)
        bars = smem.allocate_array(cutlass.Int64, 2 * STAGES + 1)
        return s_rows, s_q, s_pages, s_tiles, s_scale, s_w, bars

    @cute.jit
    def produce(
        self,
        tma_q,
        q_smem,
        q_gmem,
        tma_k,
        k_gmem,
        k_smem,
        tma_s,
        s_gmem,
        s_smem,
        bars,
        block_table,
        entry,
        pages_used,
        first,
        last,
    ):
        """The producer warp: the query, then each tile's copies into its
        stage, once the consumers released the stage's previous tile."""
        lane = cute.arch.lane_idx()
        query = bars + 2 * STAGES
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(query, self.n * DIM)
        for i in cutlass.range_constexpr(self.next_n):
            cute.copy(tma_q, q_gmem[None, i, entry], q_smem[None, i], tma_bar_ptr=query)
        window = Int32(0)
        for t in cutlass.range(first, last, unroll=1):
            i = t - first
            if i >= STAGES:
                empty = bars + STAGES + (i & (STAGES - 1))
                cute.arch.mbarrier_wait(empty, ((i >> STAGE_BITS) - 1) & 1)
            window = self.issue(
                tma_k,
                k_gmem,
                k_smem,
                tma_s,
                s_gmem,
                s_smem,
                bars,
                block_table,
                entry,
                pages_used,
                first,
                t,
                window,
            )

    @cute.jit
    def issue(
        self,
        tma_k,
        k_gmem,
        k_smem,
        tma_s,
        s_gmem,
        s_smem,
        bars,
        block_table,
        entry,
        pages_used,
        first,
        t,
        window,
    ):
        """The producer issues tile ``t``'s copies into its stage. Lane ``j`` holds
        the page of the CTA's ``j``-th page slot of the current 32 in
        ``window`` (one coalesced load per 32 pages); page slots past the
        entry's pages read page 0, as DeepGEMM does (those pools are past
        ``ctx``)."""
        lane = cute.arch.lane_idx()
        stage = (t - first) & (STAGES - 1)
        for p in cutlass.range_constexpr(self.pages):
            slot = (t - first) * self.pages + p
            if slot % 32 == 0:
                index = first * self.pages + slot + lane
                window = Int32(0)
                if index < pages_used:
                    window = block_table[entry, index]
            page = cute.arch.shuffle_sync(window, offset=slot % 32)
            if p == 0 and lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(bars + stage, TILE * (DIM + 4))
            # The whole warp: the TMA copy elects its issuing lane.
            cute.copy(
                tma_k,
                k_gmem[None, page],
                k_smem[None, stage * self.pages + p],
                tma_bar_ptr=bars + stage,
            )
            cute.copy(
                tma_s,
                s_gmem[None, page],
                s_smem[None, stage * self.pages + p],
                tma_bar_ptr=bars + stage,
            )
        return window

    @cute.jit
    def tiles(self, s_q, s_tiles, s_scale, s_w, bars, logits, entry, ctx, first, last):
        """The consumer warpgroup: each tile's wgmma, the release of its
        stage, its epilogue."""
        tid, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        mma = sm90_utils.make_trivial_tiled_mma(
            Float8E4M3FN,
            Float8E4M3FN,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Float32,
            (1, 1, 1),
            (TILE, self.n),
        )
        thr = mma.get_slice(tid)
        frag_k = mma.make_fragment_A(thr.partition_A(s_tiles))
        frag_q = mma.make_fragment_B(thr.partition_B(s_q))
        acc = cute.make_rmem_tensor(thr.partition_shape_C((TILE, self.n)), Float32)
        # The accumulator rows of this thread: pools r0 and r0 + 8 of a tile.
        r0 = warp * 16 + lane // 4
        r1 = r0 + 8
        weights = self.thread_weights(s_w)
        cute.arch.mbarrier_wait(bars + 2 * STAGES, 0)
        for t in cutlass.range(first, last, unroll=1):
            stage = (t - first) & (STAGES - 1)
            cute.arch.mbarrier_wait(bars + stage, ((t - first) >> STAGE_BITS) & 1)
            warpgroup.fence()
            # A fresh atom a tile: its accumulate flag changes inside the loop.
            atom = cute.make_mma_atom(mma.op)
            for k in cutlass.range_constexpr(DIM // K_STEP):
                atom.set(warpgroup.Field.ACCUMULATE, k != 0)
                cute.gemm(
                    atom, acc, frag_k[None, None, k, stage], frag_q[None, None, k], acc
                )
            warpgroup.commit_group()
            if cutlass.const_expr(self.n > HOISTED):
                warpgroup.wait_group(0)
            scale0 = s_scale[r0 % self.block, stage * self.pages + r0 // self.block]
            scale1 = s_scale[r1 % self.block, stage * self.pages + r1 // self.block]
            if cutlass.const_expr(self.n <= HOISTED):
                warpgroup.wait_group(0)
            # This thread is done with the stage (its arrive releases the
            # reads above): the producer refills it once all have arrived.
            cute.arch.mbarrier_arrive(bars + STAGES + stage)
            self.epilogue(
                acc, s_w, weights, scale0, scale1, logits, entry, t * TILE + r0, ctx
            )

    def thread_weights(self, s_w):
        """This thread's weights, ``[row][j][parity]`` for head ``8 j + 2 *
        (lane % 4) + parity`` of each row, in registers (None: wider than
        ``HOISTED``, read from ``s_w`` each tile)."""
        if self.n > HOISTED:
            return None
        groups = self.heads // 8
        return [
            [[self.weight(s_w, None, i, j, p) for p in range(2)] for j in range(groups)]
            for i in range(self.next_n)
        ]

    def weight(self, s_w, weights, i, j, parity):
        """Row ``i``'s weight of head ``8 j + 2 * (lane % 4) + parity``."""
        if weights is not None:
            return weights[i][j][parity]
        quad = cute.arch.lane_idx() % 4
        return s_w[i * self.heads + 8 * j + 2 * quad + parity]

    @cute.jit
    def epilogue(self, acc, s_w, weights, scale0, scale1, logits, entry, pool0, ctx):
        lane = cute.arch.lane_idx()
        quad = lane % 4
        groups = self.heads // 8
        for i in cutlass.range_constexpr(self.next_n):
            base = i * self.heads // 2  # the row's first accumulator
            sums = [Float32(0.0)] * 4
            for e in cutlass.range_constexpr(4):
                first = acc[base + e], self.weight(s_w, weights, i, 0, e % 2)
                for j in cutlass.range_constexpr(1, groups):
                    w = self.weight(s_w, weights, i, j, e % 2)
                    value = acc[base + 4 * j + e]
                    if j == 1:
                        # nvcc fuses the first product into the second add.
                        sums[e] = relu_fma(*first, relu_mul(value, w))
                    else:
                        sums[e] = relu_fma(value, w, sums[e])
            # Stock pads 16 heads to 32 zero ones; their terms fma(0, 0,
            # sum) add +0.0 to each sum, which turns a -0.0 into +0.0: once
            # a pair here, the same bits.
            pair = add_zero_mul if cutlass.const_expr(self.heads == 16) else add_mul
            v0 = pair(sums[0], sums[1], scale0)
            v1 = pair(sums[2], sums[3], scale1)
            for offset in cutlass.range_constexpr(2):
                v0 = add(v0, cute.arch.shuffle_sync_bfly(v0, offset=1 << offset))
                v1 = add(v1, cute.arch.shuffle_sync_bfly(v1, offset=1 << offset))
            row = Int64(entry * self.next_n + i)
            if quad == 0 and pool0 < ctx:
                logits[row, pool0] = v0
            if quad == 1 and pool0 + 8 < ctx:
                logits[row, pool0 + 8] = v1
