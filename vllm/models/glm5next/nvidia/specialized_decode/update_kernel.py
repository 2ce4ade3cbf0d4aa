# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``kpool_decode_update_and_maybe_write_cache_batched`` as a CuTe DSL kernel:
the decode tail stash plus pool compression.

One warp per request walks its tokens in position order (a completing token
reads the stashes of the earlier ones), four dimensions per lane. The softmax,
the Hadamard butterflies (strides 1 and 2 in a lane, 4..64 across lanes), the
BF16 roundings, the accurate log2 and the scales follow the stock kernel's
PTX: ``ex2.approx`` of ``(s - max) * log2(e)``, FMA accumulation in pool order
and ``div.full`` divisions. Positions, slots and tail slots are widened to
int64 as the stock kernel computes them.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32
from cutlass.cute.runtime import make_fake_tensor

from vllm.models.glm5next.nvidia.specialized_decode.constants import DIM, POOL
from vllm.models.glm5next.nvidia.specialized_decode.jit import (
    INDEX_TYPES,
    KpoolJitKernel,
    TensorFields,
    layout,
    mismatch,
)
from vllm.models.glm5next.nvidia.specialized_decode.ptx import (
    add,
    bits_float,
    ceil,
    div,
    exp_diff,
    float_bits,
    fma,
    load_words,
    magnitude_bits,
    pack_fp8,
    round_bf16,
    store_words,
    unpack_bf16,
)

FP8_MAX = 448.0
INV_SQRT_DIM = 0.08838834764831845  # 1/sqrt(128), exact in FP32
# The biased exponent of +inf: stock's exp2 of a rounded exponent >= 128.
INF_EXPONENT = 128


class UpdateArgs(NamedTuple):
    """The arguments of ``kpool_decode_update_and_maybe_write_cache_batched``
    and what the stock kernel reads besides them: ``mx_scales`` is its
    ``mqa_logits_use_mx_scales()``."""

    kv_cache: torch.Tensor
    tail_kv_cache: torch.Tensor
    tail_slot_mapping: torch.Tensor
    key: torch.Tensor
    slot_score: torch.Tensor
    ape: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    pool_size: int
    head_dim: int = DIM
    mx_scales: bool = True
    round_scale: bool = True


_TENSORS = TensorFields(UpdateArgs, UpdateArgs._fields[:8])
_INDICES = ("tail_slot_mapping", "slot_mapping", "positions")


def _check_layouts(a: UpdateArgs) -> None:
    """What the kernel's 4- and 8-byte accesses and its warp per request
    take; each tensor's layout is read once (this runs before every eager
    launch)."""
    if a.head_dim != DIM:
        raise mismatch("head_dim", str(DIM), a.head_dim)
    if a.pool_size != POOL:
        raise mismatch("pool_size", str(POOL), a.pool_size)
    kv_cache, tail = a.kv_cache, a.tail_kv_cache
    cache = kv_cache.stride()
    if (
        kv_cache.dtype is not torch.uint8
        or len(cache) != 3
        or cache[2] != 1
        or cache[0] % 4
        or kv_cache.data_ptr() % 4
    ):
        raise mismatch(
            "kv_cache",
            "uint8 [blocks, page, bytes], 4-byte aligned pages",
            layout(kv_cache),
        )
    shape, stride = tail.shape, tail.stride()
    if (
        tail.dtype is not torch.bfloat16
        or len(shape) != 4
        or shape[1] != 2
        or shape[2] % POOL
        or shape[3] != DIM
        or stride[3] != 1
        or stride[2] != DIM
        or stride[1] % 4
        or stride[0] % 4
        or tail.data_ptr() % 8
    ):
        raise mismatch(
            "tail_kv_cache",
            "bf16 [blocks, 2, ring, 128], ring a multiple of 4, 8-byte aligned rows",
            layout(tail),
        )
    rows = a.key.shape
    if a.key.dtype is not torch.bfloat16 or len(rows) != 3 or rows[2] != DIM:
        raise mismatch("key", "bf16 [requests, tokens, 128]", layout(a.key))
    for name in ("key", "slot_score"):
        t = getattr(a, name)
        stride = t.stride()
        if (
            t.dtype is not torch.bfloat16
            or t.shape != rows
            or stride[2] != 1
            or stride[1] % 4
            or stride[0] % 4
            or t.data_ptr() % 8
        ):
            raise mismatch(
                name,
                "bf16 [requests, tokens, 128] as key, unit dim stride, "
                "8-byte aligned rows",
                layout(t),
            )
    ape = a.ape
    if (
        ape.dtype is not torch.float32
        or ape.shape != (POOL, DIM)
        or ape.stride() != (DIM, 1)
        or ape.data_ptr() % 16
    ):
        raise mismatch("ape", "a contiguous fp32 [4, 128]", layout(ape))
    tokens = rows[:2]
    for name in _INDICES:
        t = getattr(a, name)
        if t.dtype not in INDEX_TYPES or t.shape != tokens or not t.is_contiguous():
            raise mismatch(
                name, "a contiguous int32/int64 [requests, tokens]", layout(t)
            )


class _UpdateKernel:
    """One warp per request; lane ``l`` owns dimensions ``4l .. 4l + 3``."""

    def __init__(self, key: "KpoolUpdateKernel.CompileKey"):
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
            key_words = load_words(key_row + t * key.stride[1], 2)
            score_words = load_words(score_row + t * score.stride[1], 2)
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
                store_words(row, key_words)
                store_words(row + self.tail_half, score_words)

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
                s = _bf16x4(load_words(row + self.tail_half, 2))
                k = _bf16x4(load_words(row, 2))
            scores.append([add(s[e], bias[p][e]) for e in range(4)])
            keys.append(k)
        x = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
        for e in cutlass.range_constexpr(4):
            peak = Float32(-float("inf"))
            for p in cutlass.range_constexpr(POOL):
                peak = cute.arch.fmax(peak, scores[p][e])
            denom = Float32(0.0)
            acc = Float32(0.0)
            for p in cutlass.range_constexpr(POOL):
                prob = exp_diff(scores[p][e], peak)
                denom = add(denom, prob)
                acc = fma(prob, keys[p][e], acc)
            x[e] = round_bf16(div(acc, denom))
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
            x[i] = round_bf16(x[i] * Float32(INV_SQRT_DIM))
            magnitude = cutlass.max(magnitude, magnitude_bits(x[i]))
        magnitude = cute.arch.warp_redux_sync(magnitude, "max")
        amax = cute.arch.fmax(bits_float(magnitude), Float32(1e-4))
        ratio = amax * Float32(1.0 / FP8_MAX)
        scale = ratio
        exponent = Int32(0)
        if cutlass.const_expr(self.round_scale):
            # exp2 of an integer is exact, so build the power of two from its
            # bits; from 2^128 on (an infinite amax too) stock's exp2 is +inf,
            # whose biased exponent 255 is also its UE8M0 byte.
            rounded = ceil(cute.math.log2(ratio, fastmath=False))
            exponent = Int32(cute.arch.fmin(rounded, Float32(INF_EXPONENT)))
            scale = bits_float(Uint32(exponent + 127) << 23)
        y = [
            cute.arch.fmin(
                cute.arch.fmax(div(x[i], scale), Float32(-FP8_MAX)), Float32(FP8_MAX)
            )
            for i in range(4)
        ]
        page_base = cache.iterator + (loc // self.page) * self.page_bytes
        in_page = loc % self.page
        store_words(page_base + in_page * DIM + dim, (pack_fp8(*y),))
        if lane == 0:
            word = float_bits(scale)
            if cutlass.const_expr(self.mx):
                word = Uint32(exponent + 127) * Uint32(0x01010101)
            store_words(page_base + self.page * DIM + in_page * 4, (word,))


def _bf16x4(words):
    """The four FP32 values of two words of packed BF16."""
    a, b = unpack_bf16(words[0])
    c, d = unpack_bf16(words[1])
    return [a, b, c, d]


class KpoolUpdateKernel(KpoolJitKernel["KpoolUpdateKernel.CompileKey", UpdateArgs]):
    """The compiled ``_UpdateKernel`` executors, one per cache layout, scale
    format and index dtypes."""

    @dataclass(frozen=True)
    class CompileKey:
        ring: int
        page: int
        page_bytes: int  # kv_cache.stride(0)
        tail_block: int  # tail_kv_cache.stride(0)
        tail_half: int  # tail_kv_cache.stride(1)
        mx_scales: bool
        round_scale: bool
        tail_slots_dtype: torch.dtype
        slots_dtype: torch.dtype
        positions_dtype: torch.dtype

    def key_for(self, args: UpdateArgs) -> CompileKey:
        _TENSORS.check(args)
        _check_layouts(args)
        kv, tail = args.kv_cache, args.tail_kv_cache
        return self.key(
            tail.shape[2],
            kv.shape[1],
            kv.stride(0),
            tail.stride(0),
            tail.stride(1),
            bool(args.mx_scales),
            bool(args.round_scale),
            args.tail_slot_mapping.dtype,
            args.slot_mapping.dtype,
            args.positions.dtype,
        )

    def executor_args(self, args: UpdateArgs) -> tuple | None:
        rows = args.key.shape
        return args[:8] if rows[0] and rows[1] else None

    @staticmethod
    def kernel(compile_key: CompileKey) -> _UpdateKernel:
        return _UpdateKernel(compile_key)

    def warmup_inputs(self, compile_key: CompileKey) -> tuple:
        requests, tokens = cute.sym_int(), cute.sym_int()
        rows = (requests, tokens)

        def indices(dtype):
            return make_fake_tensor(
                INDEX_TYPES[dtype], rows, (cute.sym_int64(), 1), assumed_align=4
            )

        def rows_of_dims():
            return make_fake_tensor(
                BFloat16,
                (*rows, DIM),
                (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1),
                assumed_align=8,
            )

        k = compile_key
        cache = make_fake_tensor(
            Uint8,
            (cute.sym_int(), k.page, cute.sym_int()),
            (cute.sym_int64(divisibility=4), cute.sym_int64(), 1),
            assumed_align=4,
        )
        tail = make_fake_tensor(
            BFloat16,
            (cute.sym_int(), 2, k.ring, DIM),
            (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), DIM, 1),
            assumed_align=8,
        )
        ape = make_fake_tensor(Float32, (POOL, DIM), (DIM, 1), assumed_align=16)
        return (
            cache,
            tail,
            indices(k.tail_slots_dtype),
            rows_of_dims(),
            rows_of_dims(),
            ape,
            indices(k.slots_dtype),
            indices(k.positions_dtype),
        )


UPDATE = KpoolUpdateKernel()
