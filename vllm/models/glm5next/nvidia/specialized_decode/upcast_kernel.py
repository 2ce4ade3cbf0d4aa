# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``as_fp32_logits`` as a CuTe DSL kernel: BF16 logits below each row end
converted to FP32 with 16-byte accesses, DeepGEMM's row stride kept."""

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.runtime import make_fake_tensor

from vllm.models.glm5next.nvidia.specialized_decode.launch import (
    KpoolJitKernel,
    layout,
    mismatch,
)
from vllm.models.glm5next.nvidia.specialized_decode.ptx import (
    float_bits,
    load_words_if,
    store_words_if,
    unpack_bf16,
)

# 128-thread CTAs, one 16-byte load in flight per thread, at most 1024 CTAs:
# the row ends are device data, so the shape alone chooses, and this is the
# one configuration that is best or near it for full, random and short row
# ends alike (tools/bench_kpool.py --upcast-sweep on the H200: 256 x 256K full
# rows 108.8 us against 136.0 with 512 threads and 4096 CTAs; short rows of
# 256K pay 1.8 us against 5.8).
THREADS, UNROLL, CTAS = 128, 1, 1024
# Every (threads, unroll) upcast_config picks: the warmup compiles them all.
UPCAST_VARIANTS = ((THREADS, UNROLL),)


def upcast_unmet(
    logits: torch.Tensor, row_ends: torch.Tensor, out: torch.Tensor | None = None
) -> str | None:
    """The first requirement of ``upcast_logits`` these arguments miss, as
    "argument: expected X, got Y"; None when the kernel takes them."""
    # Each tensor attribute read costs ~0.1 us of an eager call's ~10: read
    # the strides once, and let the tuple stand for ndim and unit stride.
    stride = logits.stride()
    if (
        logits.dtype != torch.bfloat16
        or len(stride) != 2
        or stride[1] != 1
        or stride[0] % 8
        or logits.data_ptr() % 16
    ):
        return mismatch(
            "logits",
            "bf16 [rows, width], unit column stride, 16-byte aligned rows",
            layout(logits),
        )
    rows = logits.shape[0]
    if (
        row_ends.dtype != torch.int32
        or row_ends.stride() != (1,)
        or row_ends.shape[0] != rows
    ):
        return mismatch("row_ends", f"int32 [{rows}], unit stride", layout(row_ends))
    if out is not None and (
        out.dtype != torch.float32
        or out.stride() != stride
        or out.shape != logits.shape
        or out.data_ptr() % 16
    ):
        return mismatch(
            "out",
            "fp32 with the shape and strides of logits, 16-byte aligned",
            layout(out),
        )
    return None


def upcast_config(rows: int, width: int) -> tuple[int, int, int]:
    """(threads, unroll, most CTAs) of the upcast of ``rows`` x ``width``
    logits; the row ends are device data, so only the shape can choose."""
    del rows, width  # one configuration serves every shape (measured)
    return THREADS, UNROLL, CTAS


class _UpcastKernel:
    """CTA ``(row, split)`` converts the row's 8-element chunks ``split``,
    ``split + splits``, ... below the row end."""

    def __init__(self, key: "UpcastLogitsKernel.CompileKey"):
        self.threads, self.unroll = key.threads, key.unroll

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
        chunk = self.threads * 8
        splits = cutlass.min((width + chunk - 1) // chunk, cutlass.max(1, ctas // rows))
        self.kernel(src, dst, ends).launch(
            grid=(rows, splits, 1),
            block=(self.threads, 1, 1),
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor, ends: cute.Tensor):
        row, split, _ = cute.arch.block_idx()
        _, splits, _ = cute.arch.grid_dim()
        tid, _, _ = cute.arch.thread_idx()
        step = splits * self.threads * 8
        start = (split * self.threads + tid) * 8
        cute.arch.griddepcontrol_wait()
        # The dependent grid may launch once every CTA is on its last pass:
        # a CTA with two passes at most (the width says so; rows can differ
        # by one pass) lets it at once, the others on their last pass.
        # Letting it at every CTA's start made unbalanced row ends slow
        # (eager 256 x 64K random ends: 25.3 against 15.1 us on the H200;
        # likely its early CTAs sit on the SMs that short rows freed while
        # the long rows run elsewhere).
        if split * self.threads * 8 + 2 * step * self.unroll >= src.shape[1]:
            cute.arch.griddepcontrol_launch_dependents()
        end = ends[row]
        # A whole 16-byte load is safe below the row's width, and below its
        # end, which stock reads up to: the chunk that holds a row end is
        # loaded whole, and only its stores are per element.
        loadable = cutlass.max(end, src.shape[1])
        offset = Int64(row) * src.stride[0]
        for first in cutlass.range(start, end, step * self.unroll, unroll=1):
            if first + step * self.unroll >= end:
                cute.arch.griddepcontrol_launch_dependents()
            # The unrolled chunks' loads are in flight together.
            chunks = [first + k * step for k in range(self.unroll)]
            words = [
                load_words_if(src.iterator + offset + c, 4, c + 8 <= loadable)
                for c in chunks
            ]
            for c, w in zip(chunks, words, strict=True):
                full = c + 8 <= end
                values = []
                for i in cutlass.range_constexpr(4):
                    lo, hi = unpack_bf16(w[i])
                    values += [float_bits(lo), float_bits(hi)]
                store_words_if(dst.iterator + offset + c, values[:4], full)
                store_words_if(dst.iterator + offset + c + 4, values[4:], full)
                if c < end and not full:
                    if c + 8 <= loadable:
                        # Independent predicated stores: no chain of loads
                        # at the row end (a short row's whole time).
                        for i in cutlass.range_constexpr(8):
                            store_words_if(
                                dst.iterator + offset + c + i,
                                values[i : i + 1],
                                c + i < end,
                            )
                    else:  # the last chunk of a width that is not a multiple of 8
                        for e in cutlass.range(c, end, unroll=1):
                            dst[row, e] = Float32(src[row, e])


class UpcastLogitsKernel(KpoolJitKernel["UpcastLogitsKernel.CompileKey"]):
    """The compiled ``_UpcastKernel`` executors, one per CTA size and unroll."""

    @dataclass(frozen=True)
    class CompileKey:
        threads: int
        unroll: int

    @staticmethod
    def kernel(compile_key: CompileKey) -> _UpcastKernel:
        return _UpcastKernel(compile_key)

    def warmup_inputs(self, compile_key: CompileKey) -> tuple:
        rows, width = cute.sym_int(), cute.sym_int()
        stride = (cute.sym_int64(divisibility=8), 1)
        src = make_fake_tensor(BFloat16, (rows, width), stride, assumed_align=16)
        dst = make_fake_tensor(Float32, (rows, width), stride, assumed_align=16)
        ends = make_fake_tensor(Int32, (rows,), (1,), assumed_align=4)
        return src, dst, ends, Int32(CTAS)


UPCAST = UpcastLogitsKernel()
# The launch of every shape, its key built once (upcast_config chooses none
# by shape; test_upcast_config pins the two): looking the key up took about
# 1 us of an eager upcast's ~9.
UPCAST_LAUNCH = (UPCAST.key(THREADS, UNROLL), CTAS)
