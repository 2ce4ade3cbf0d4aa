# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host side of ``ExpandPools``: what it takes, its compile key, its launch."""

from dataclasses import dataclass

import cutlass.cute as cute
import torch
from cutlass import Int32

from ...constants import POOL
from ..common.host import (
    KpoolKernel,
    check_devices,
    check_int32,
    check_pool_ids,
    check_pool_size,
    check_vector,
    fake,
    kernel_launcher,
    layout,
    mismatch,
    unit_columns,
)
from .kernel import ExpandPools


def check(pool_ids, seq_lens, pool_size, seq_offset, out) -> None:
    """``ExpandKernel``'s rule (raises ``Refused``): int32 pool ids, one row
    of lengths each, an ``out`` to write whose rows are 16-byte aligned."""
    if out is None:
        raise mismatch("out", "a tensor to write (the kernel does not allocate)", None)
    check_devices(("pool_ids", "seq_lens", "out"), pool_ids, seq_lens, out)
    check_pool_size(pool_size)
    check_pool_ids(pool_ids)
    rows, groups = pool_ids.shape
    if (
        not unit_columns(out, (torch.int32,), 4, 16)
        or out.shape[0] != rows
        or out.shape[1] < groups * POOL + POOL - 1
    ):
        expected = "int32 [rows, >= pools * 4 + 3], unit column stride, 16-byte "
        raise mismatch("out", expected + "aligned rows", layout(out))
    check_vector("seq_lens", seq_lens, rows, "int32/int64 [>= rows], unit stride")
    check_int32("seq_offset", seq_offset)


class ExpandKernel(KpoolKernel["ExpandKernel.CompileKey"]):
    """``expand_pools_and_append_tail(pool_ids, seq_lens, pool_size,
    seq_offset=, out=)`` into ``out``'s first ``pools * 4 + 3`` columns, for
    int32 pool ids. ``int32_lengths``: ``seq_lens`` are truncated to int32
    before the offset is added, as the stock decode's ``positions.to(
    torch.int32) + 1`` (else computed in their own dtype, as the stock kernel
    computes them)."""

    @dataclass(frozen=True)
    class CompileKey:
        groups: int
        seq_lens_dtype: torch.dtype
        int32_lengths: bool

    kernel = ExpandPools

    def spec(
        self,
        *,
        pool_ids: torch.Tensor,
        seq_lens: torch.Tensor,
        pool_size: int,
        seq_offset: int = 0,
        out: torch.Tensor | None = None,
        int32_lengths: bool = False,
    ):
        check(pool_ids, seq_lens, pool_size, seq_offset, out)
        fields = dict(seq_lens_dtype=seq_lens.dtype, int32_lengths=bool(int32_lengths))
        key = self.dispatch(groups=pool_ids.shape[1], **fields)
        args = (pool_ids, seq_lens, out, seq_offset) if pool_ids.shape[0] else None
        return key, args, out

    __call__ = kernel_launcher(spec)

    def warmup_inputs(self, compile_key: CompileKey) -> tuple:
        rows = cute.sym_int()
        # The pool count is the key's: zero pools have no static extent.
        ids = fake(torch.int32, (rows, cute.sym_int()), (cute.sym_int64(), 1))
        lengths = fake(compile_key.seq_lens_dtype, (cute.sym_int(),), (1,))
        shape = (rows, cute.sym_int())
        out = fake(torch.int32, shape, (cute.sym_int64(divisibility=4), 1), 16)
        return ids, lengths, out, Int32(0)


EXPAND = ExpandKernel()
