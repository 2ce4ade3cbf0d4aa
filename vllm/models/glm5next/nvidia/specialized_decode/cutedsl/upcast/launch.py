# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host side of ``UpcastLogits``: what it takes, its compile key, its launch."""

from dataclasses import dataclass

import cutlass.cute as cute
import torch
from cutlass import Int32

from ..common.host import (
    KpoolKernel,
    check_devices,
    fake,
    kernel_launcher,
    layout,
    mismatch,
    unit_columns,
)
from .kernel import CTAS, UpcastLogits


def check(logits, ends, out) -> None:
    """What ``UpcastLogits`` takes of ``as_fp32_logits``'s arguments and an
    ``out`` to write (raises ``Refused``)."""
    check_devices(("logits", "row_ends", "out"), logits, ends, out, optional=("out",))
    if not unit_columns(logits, (torch.bfloat16,), 8, 16):
        expected = "bf16 [rows, width], unit column stride, 16-byte aligned rows"
        raise mismatch("logits", expected, layout(logits))
    rows = logits.shape[0]
    if ends.dtype != torch.int32 or ends.stride() != (1,) or ends.shape[0] != rows:
        expected = "int32 [rows of logits], unit stride"
        raise mismatch("row_ends", expected, layout(ends))
    if out is not None and (
        out.dtype != torch.float32
        or out.stride() != logits.stride()
        or out.shape != logits.shape
        or out.data_ptr() % 16
    ):
        expected = "fp32 with the shape and strides of logits, 16-byte aligned"
        raise mismatch("out", expected, layout(out))


class UpcastKernel(KpoolKernel["UpcastKernel.CompileKey"]):
    """``as_fp32_logits(logits, row_ends)`` of BF16 logits: the columns below
    each row end in FP32, in ``out`` if given (else a new tensor with the
    strides of ``logits``, as stock allocates), the other columns untouched.
    One variant serves every shape."""

    @dataclass(frozen=True)
    class CompileKey:
        pass

    kernel = UpcastLogits

    def spec(
        self,
        *,
        logits: torch.Tensor,
        row_ends: torch.Tensor,
        out: torch.Tensor | None = None,
    ):
        check(logits, row_ends, out)
        if out is None:
            shape, stride = logits.shape, logits.stride()
            out = logits.new_empty_strided(shape, stride, dtype=torch.float32)
        args = (logits, out, row_ends, CTAS) if logits.numel() else None
        return self.dispatch(), args, out

    __call__ = kernel_launcher(spec)

    def warmup_inputs(self, compile_key: CompileKey) -> tuple:
        rows, width = cute.sym_int(), cute.sym_int()
        stride = (cute.sym_int64(divisibility=8), 1)
        src = fake(torch.bfloat16, (rows, width), stride, 16)
        dst = fake(torch.float32, (rows, width), stride, 16)
        ends = fake(torch.int32, (rows,), (1,))
        return src, dst, ends, Int32(CTAS)


UPCAST = UpcastKernel()
