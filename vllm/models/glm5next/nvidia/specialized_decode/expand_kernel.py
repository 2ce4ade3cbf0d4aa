# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``expand_pools_and_append_tail`` (patched: ``seq_offset``, ``out``) as a
CuTe DSL kernel for int32 pool ids: one 16-byte store per pool."""

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32
from cutlass.cute.runtime import make_fake_tensor

from vllm.models.glm5next.nvidia.specialized_decode.launch import (
    KpoolJitKernel,
    layout,
    mismatch,
)
from vllm.models.glm5next.nvidia.specialized_decode.ptx import (
    store_words,
    trunc_div,
)

POOL = 4
THREADS = 128
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_LENGTH_DTYPES = {torch.int32: Int32, torch.int64: Int64}


def expand_unmet(
    pool_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    pool_size: int,
    seq_offset: int,
    out: torch.Tensor | None,
) -> str | None:
    """The first requirement of ``expand_pools`` these stock arguments miss,
    as "argument: expected X, got Y"; None when the kernel takes them."""
    if pool_size != POOL:
        return mismatch("pool_size", str(POOL), pool_size)
    shape = pool_ids.shape
    if pool_ids.dtype is not torch.int32 or len(shape) != 2 or pool_ids.stride(1) != 1:
        return mismatch(
            "pool_ids", "int32 [rows, pools], unit column stride", layout(pool_ids)
        )
    rows, cols = shape[0], shape[1] * POOL + POOL - 1
    if out is None:
        return mismatch("out", f"int32 [{rows}, >={cols}]", None)
    size, stride = out.shape, out.stride()
    if (
        out.dtype is not torch.int32
        or len(size) != 2
        or size[0] != rows
        or size[1] < cols
        or stride[1] != 1
        or stride[0] % 4
        or out.data_ptr() % 16
    ):
        return mismatch(
            "out",
            f"int32 [{rows}, >={cols}], unit column stride, 16-byte aligned rows",
            layout(out),
        )
    if (
        seq_lens.dtype not in _LENGTH_DTYPES
        or seq_lens.dim() != 1
        or seq_lens.shape[0] < rows
        or seq_lens.stride(0) != 1
    ):
        return mismatch(
            "seq_lens", f"int32/int64 [>={rows}], unit stride", layout(seq_lens)
        )
    if not INT32_MIN <= seq_offset <= INT32_MAX:
        return mismatch("seq_offset", "an int32", seq_offset)
    return None


class _ExpandKernel:
    """Thread ``g`` of row ``r`` writes the four token ids of pool
    ``pool_ids[r, g]`` with one 16-byte store; CTA 0's first ``pool - 1``
    threads write the trailing incomplete pool (also with no pools)."""

    def __init__(self, key: "ExpandPoolsKernel.CompileKey"):
        self.groups = key.groups
        # seq_len + offset is computed in the dtype of seq_lens, as stock does.
        self.width = Int64 if key.seq_lens_dtype == torch.int64 else Int32
        self.ctas = max(1, (self.groups + THREADS - 1) // THREADS)

    @cute.jit
    def __call__(
        self,
        pool_ids: cute.Tensor,
        seq_lens: cute.Tensor,
        out: cute.Tensor,
        seq_offset: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(pool_ids, seq_lens, out, seq_offset).launch(
            grid=(pool_ids.shape[0], self.ctas, 1),
            block=(THREADS, 1, 1),
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(self, pool_ids, seq_lens, out, seq_offset):
        row, cta, _ = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        g = cta * THREADS + tid
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        row_out = out.iterator + Int64(row) * out.stride[0]
        if g < self.groups:
            pid = Int32(pool_ids[row, g])
            # int32 arithmetic wraps as the stock kernel's store truncates.
            first = pid * POOL
            words = [Uint32(first + o) for o in range(POOL)]
            if pid < 0:
                words = [Uint32(0xFFFFFFFF)] * POOL
            store_words(row_out + g * POOL, words)
        if cta == 0 and tid < POOL - 1:
            width = self.width
            seq_len = width(seq_lens[row]) + width(seq_offset)
            tail_start = trunc_div(seq_len, POOL, width) * POOL
            value = Int32(-1)
            if width(tid) < seq_len - tail_start:
                value = Int32(tail_start + tid)  # stock's store truncates too
            out[row, self.groups * POOL + tid] = value


class ExpandPoolsKernel(KpoolJitKernel["ExpandPoolsKernel.CompileKey"]):
    """The compiled ``_ExpandKernel`` executors, one per pool count and
    ``seq_lens`` dtype."""

    @dataclass(frozen=True)
    class CompileKey:
        groups: int
        seq_lens_dtype: torch.dtype

    @staticmethod
    def kernel(compile_key: CompileKey) -> _ExpandKernel:
        return _ExpandKernel(compile_key)

    def warmup_inputs(self, compile_key: CompileKey) -> tuple:
        rows = cute.sym_int()
        # The pool count is the key's: zero pools have no static extent.
        ids = make_fake_tensor(
            Int32, (rows, cute.sym_int()), (cute.sym_int64(), 1), assumed_align=4
        )
        lengths = make_fake_tensor(
            _LENGTH_DTYPES[compile_key.seq_lens_dtype],
            (cute.sym_int(),),
            (1,),
            assumed_align=4,
        )
        out = make_fake_tensor(
            Int32,
            (rows, cute.sym_int()),
            (cute.sym_int64(divisibility=4), 1),
            assumed_align=16,
        )
        return ids, lengths, out, Int32(0)


EXPAND = ExpandPoolsKernel()
