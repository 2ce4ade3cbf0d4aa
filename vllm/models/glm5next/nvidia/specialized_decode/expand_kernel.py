# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``expand_pools_and_append_tail`` (patched: ``seq_offset``, ``out``) as a
CuTe DSL kernel for int32 pool ids: one 16-byte store per pool."""

from dataclasses import dataclass
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32
from cutlass.cute.runtime import make_fake_tensor

from vllm.models.glm5next.nvidia.specialized_decode.constants import POOL
from vllm.models.glm5next.nvidia.specialized_decode.jit import (
    INDEX_TYPES,
    KpoolJitKernel,
    TensorFields,
    check_int32,
    layout,
    mismatch,
)
from vllm.models.glm5next.nvidia.specialized_decode.ptx import (
    store_words,
    trunc_div,
)

THREADS = 128


class ExpandArgs(NamedTuple):
    """The arguments of ``expand_pools_and_append_tail`` (patched:
    ``seq_offset``, ``out``). ``int32_lengths``: ``seq_lens`` are truncated
    to int32 before the offset is added, as the stock decode's
    ``positions.to(torch.int32) + 1`` (else computed in their own dtype, as
    the stock kernel computes them)."""

    pool_ids: torch.Tensor
    seq_lens: torch.Tensor
    pool_size: int
    seq_offset: int = 0
    out: torch.Tensor | None = None
    int32_lengths: bool = False


_TENSORS = TensorFields(ExpandArgs, ("pool_ids", "seq_lens"), optional=("out",))


def _check_layouts(a: ExpandArgs) -> None:
    if a.pool_size != POOL:
        raise mismatch("pool_size", str(POOL), a.pool_size)
    # This runs before every eager launch: each tensor's strides are read
    # once, as a tuple that also stands for ndim and unit strides.
    pool_ids = a.pool_ids
    shape, ids = pool_ids.shape, pool_ids.stride()
    if pool_ids.dtype is not torch.int32 or len(ids) != 2 or ids[1] != 1:
        raise mismatch(
            "pool_ids", "int32 [rows, pools], unit column stride", layout(pool_ids)
        )
    out = a.out
    if out is None:
        raise mismatch("out", "a tensor to write (the kernel does not allocate)", None)
    size, stride = out.shape, out.stride()
    if (
        out.dtype is not torch.int32
        or len(size) != 2
        or size[0] != shape[0]
        or size[1] < shape[1] * POOL + POOL - 1
        or stride[1] != 1
        or stride[0] % 4
        or out.data_ptr() % 16
    ):
        raise mismatch(
            "out",
            "int32 [rows, >= pools * 4 + 3], unit column stride, 16-byte aligned rows",
            layout(out),
        )
    seq_lens = a.seq_lens
    if (
        seq_lens.dtype not in INDEX_TYPES
        or seq_lens.stride() != (1,)
        or seq_lens.shape[0] < shape[0]
    ):
        raise mismatch(
            "seq_lens", "int32/int64 [>= rows], unit stride", layout(seq_lens)
        )
    check_int32("seq_offset", a.seq_offset)


class _ExpandKernel:
    """Thread ``g`` of row ``r`` writes the four token ids of pool
    ``pool_ids[r, g]`` with one 16-byte store; CTA 0's first ``pool - 1``
    threads write the trailing incomplete pool (also with no pools)."""

    def __init__(self, key: "ExpandPoolsKernel.CompileKey"):
        self.groups = key.groups
        # seq_len + offset in the dtype of seq_lens, as stock computes it, or
        # in int32 of truncated lengths, as stock's decode casts positions.
        wide = key.seq_lens_dtype == torch.int64 and not key.int32_lengths
        self.width = Int64 if wide else Int32
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


class ExpandPoolsKernel(KpoolJitKernel["ExpandPoolsKernel.CompileKey", ExpandArgs]):
    """The compiled ``_ExpandKernel`` executors, one per pool count and
    length arithmetic."""

    @dataclass(frozen=True)
    class CompileKey:
        groups: int
        seq_lens_dtype: torch.dtype
        int32_lengths: bool

    def key_for(self, args: ExpandArgs) -> CompileKey:
        _TENSORS.check(args)
        _check_layouts(args)
        return self.key(
            args.pool_ids.shape[1], args.seq_lens.dtype, bool(args.int32_lengths)
        )

    def executor_args(self, args: ExpandArgs) -> tuple | None:
        if not args.pool_ids.shape[0]:
            return None
        return args.pool_ids, args.seq_lens, args.out, args.seq_offset

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
            INDEX_TYPES[compile_key.seq_lens_dtype],
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
