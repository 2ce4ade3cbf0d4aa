# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``UpdateKernel``'s device code: the decode tail stash plus pool
compression. One warp per request walks its tokens in position order (a
completing token reads the stashes of the earlier ones). The softmax, the
Hadamard butterflies, the BF16 roundings, the accurate log2 and the scales
follow the stock kernel's PTX (``common/ptx.py``); positions, slots and tail
slots are widened to int64 as the stock kernel computes them.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from ...constants import DIM, POOL
from ..common import ptx

FP8_MAX = 448.0
INV_SQRT_DIM = 0.08838834764831845  # 1/sqrt(128), exact in FP32
# The biased exponent of +inf: stock's exp2 of a rounded exponent >= 128.
INF_EXPONENT = 128


class KpoolUpdate:
    """One warp per request; lane ``l`` owns dimensions ``4l .. 4l + 3``."""

    def __init__(self, key):
        assert key.ring % POOL == 0 and key.page_bytes % 4 == 0
        self.ring, self.page, self.page_bytes = key.ring, key.page, key.page_bytes
        self.tail_block, self.tail_half = key.tail_block, key.tail_half
        # MX scales are power-of-two UE8M0 bytes, so they always round.
        self.mx, self.round_scale = key.mx_scales, key.round_scale or key.mx_scales

    @cute.jit
    def __call__(
        self,
        cache: cute.Tensor,
        tail: cute.Tensor,
        tail_slots: cute.Tensor,
        key: cute.Tensor,
        score: cute.Tensor,
        ape: cute.Tensor,
        slots: cute.Tensor,
        positions: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.kernel(cache, tail, tail_slots, key, score, ape, slots, positions).launch(
            grid=(key.shape[0], 1, 1), block=(32, 1, 1), stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(
        self,
        cache: cute.Tensor,
        tail: cute.Tensor,
        tail_slots: cute.Tensor,
        key: cute.Tensor,
        score: cute.Tensor,
        ape: cute.Tensor,
        slots: cute.Tensor,
        positions: cute.Tensor,
    ):
        req, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        dim = lane * 4
        # APE is a weight: read it before waiting on the producers.
        bias = [[ape[p, dim + e] for e in range(4)] for p in range(POOL)]
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        key_row = key.iterator + Int64(req) * key.stride[0] + dim
        score_row = score.iterator + Int64(req) * score.stride[0] + dim
        for t in cutlass.range(key.shape[1], unroll=1):
            loc = Int64(slots[req, t])
            pos = Int64(positions[req, t])
            tail_slot = Int64(tail_slots[req, t])
            safe_pos = max(pos, Int64(0))
            slot = safe_pos % POOL
            block = max(tail_slot, Int64(0)) // self.ring
            base = tail.iterator + block * self.tail_block
            key_words = ptx.load_words(key_row + t * key.stride[1], 2)
            score_words = ptx.load_words(score_row + t * score.stride[1], 2)
            # The completion reads the ring before this token's own stash.
            if loc >= 0 and pos >= 0 and slot == POOL - 1:
                self.compress(
                    cache,
                    base,
                    bias,
                    _bf16x4(key_words),
                    _bf16x4(score_words),
                    safe_pos - slot,
                    loc,
                    lane,
                    dim,
                )
            if pos >= 0 and tail_slot >= 0:
                row = base + (safe_pos % self.ring) * DIM + dim
                ptx.store_words(row, key_words)
                ptx.store_words(row + self.tail_half, score_words)

    @cute.jit
    def compress(
        self, cache, base, bias, current_key, current_score, start, loc, lane, dim
    ):
        scores = []
        keys = []
        for p in cutlass.range_constexpr(POOL):
            if cutlass.const_expr(p == POOL - 1):
                s, k = current_score, current_key
            else:
                row = base + ((start + p) % self.ring) * DIM + dim
                s = _bf16x4(ptx.load_words(row + self.tail_half, 2))
                k = _bf16x4(ptx.load_words(row, 2))
            scores.append([ptx.add(s[e], bias[p][e]) for e in range(4)])
            keys.append(k)
        x = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
        for e in cutlass.range_constexpr(4):
            peak = Float32(-float("inf"))
            for p in cutlass.range_constexpr(POOL):
                peak = cute.arch.fmax(peak, scores[p][e])
            denom = Float32(0.0)
            acc = Float32(0.0)
            for p in cutlass.range_constexpr(POOL):
                prob = ptx.exp_diff(scores[p][e], peak)
                denom = ptx.add(denom, prob)
                acc = ptx.fma(prob, keys[p][e], acc)
            x[e] = ptx.round_bf16(ptx.div(acc, denom))
        # Strides 1 and 2 inside the lane: (a, b) -> (a + b, a - b).
        for stride in cutlass.range_constexpr(1, 3):
            for i in cutlass.range_constexpr(4):
                if cutlass.const_expr(i % (2 * stride) < stride):
                    a, b = x[i], x[i + stride]
                    x[i], x[i + stride] = a + b, a - b
        # Strides 4..64 pair lanes l and l ^ (stride / 4); the lower lane holds a.
        for shift in cutlass.range_constexpr(5):
            upper = (lane >> shift) & 1
            for i in cutlass.range_constexpr(4):
                other = cute.arch.shuffle_sync_bfly(x[i], offset=1 << shift)
                if upper == 1:
                    x[i] = other - x[i]
                else:
                    x[i] = x[i] + other
        # Stock's amax is a tree of fmax, which drops NaNs. The bits of |x|
        # order as its values do, so with NaNs as 0 one integer warp
        # reduction gives the same amax as five rounds of shuffles.
        magnitude = Int32(0)
        for i in cutlass.range_constexpr(4):
            x[i] = ptx.round_bf16(x[i] * Float32(INV_SQRT_DIM))
            magnitude = cutlass.max(magnitude, ptx.magnitude_bits(x[i]))
        magnitude = cute.arch.warp_redux_sync(magnitude, "max")
        amax = cute.arch.fmax(ptx.bits_float(magnitude), Float32(1e-4))
        ratio = amax * Float32(1.0 / FP8_MAX)
        scale = ratio
        exponent = Int32(0)
        if cutlass.const_expr(self.round_scale):
            # exp2 of an integer is exact, so build the power of two from its
            # bits; from 2^128 on (an infinite amax too) stock's exp2 is +inf,
            # whose biased exponent 255 is also its UE8M0 byte.
            rounded = ptx.ceil(cute.math.log2(ratio, fastmath=False))
            exponent = Int32(cute.arch.fmin(rounded, Float32(INF_EXPONENT)))
            scale = ptx.bits_float(Uint32(exponent + 127) << 23)
        y = [
            cute.arch.fmin(
                cute.arch.fmax(ptx.div(x[i], scale), Float32(-FP8_MAX)),
                Float32(FP8_MAX),
            )
            for i in range(4)
        ]
        page_base = cache.iterator + (loc // self.page) * self.page_bytes
        in_page = loc % self.page
        ptx.store_words(page_base + in_page * DIM + dim, (ptx.pack_fp8(*y),))
        if lane == 0:
            word = ptx.float_bits(scale)
            if cutlass.const_expr(self.mx):
                word = Uint32(exponent + 127) * Uint32(0x01010101)
            ptx.store_words(page_base + self.page * DIM + in_page * 4, (word,))


def _bf16x4(words):
    """The four FP32 values of two words of packed BF16."""
    a, b = ptx.unpack_bf16(words[0])
    c, d = ptx.unpack_bf16(words[1])
    return [a, b, c, d]
