# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host side of ``SelectTopk``: what it takes, how many CTAs a row
takes, its compile key, its launch."""

import functools
from dataclasses import dataclass

import cutlass.cute as cute
import torch

from vllm.model_executor.warmup.jit_warmup import WarmupIntRange

from ..common.host import (
    KpoolKernel,
    check_devices,
    check_int,
    check_vector,
    fake,
    kernel_launcher,
    layout,
    mismatch,
    sm_count,
    unit_columns,
)
from .kernel import CAPACITIES, VECTOR, SelectTopk, ctas_per_sm

# The k a compile key takes (stock's decode top-k serves 512, 1024, 2048).
MAX_K = 4096
CLUSTERS = (1, 2, 4, 8, 16)
# Rows 16-CTA clusters take: about 7 of them fit the H200's GPCs at once.
MAX_ROWS_16 = 4
# A slice is not split below this many keys (twice as many in a 16-CTA
# cluster, whose barrier and sums cost more): smaller ones cost more in
# cluster barriers than they save in passes.
MIN_SLICE = 4096


@functools.cache
def slice_capacity(width: int, dtype: torch.dtype, cluster: int) -> int:
    """The shared keys a CTA of a ``cluster``-CTA row holds for rows of
    ``width`` columns, or 0 where no capacity holds its slice."""
    vector = VECTOR[dtype]
    per_cta = -(-width // cluster)
    span = -(-per_cta // vector) * vector
    return next((c for c in CAPACITIES if span <= c), 0)


# Cached (as one_wave): the eager host path asks them once a layer a step.
@functools.cache
def cluster_for(rows: int, width: int, dtype: torch.dtype, sms: int) -> int | None:
    """The CTAs a row takes: the most that keep the rows' CTAs within half
    of ``sms`` and the slices at least ``MIN_SLICE`` keys, else the fewest
    whose slices fit in shared memory; None where none do."""
    fits = [c for c in CLUSTERS if slice_capacity(width, dtype, c)]
    if not fits:
        return None
    wide = [
        c
        for c in fits
        if 2 * rows * c <= sms
        and -(-width // c) >= MIN_SLICE * (2 if c == 16 else 1)
        and (c < 16 or rows <= MAX_ROWS_16)
    ]
    return max(wide) if wide else fits[0]


@functools.cache
def one_wave(rows: int, width: int, dtype: torch.dtype, sms: int) -> bool:
    """Whether the clusters of ``rows`` rows of ``width`` columns are all
    resident at once on ``sms`` SMs: past one wave, stock's top-k on FP32
    logits costs less (``kpool_select="one_wave"`` then takes it)."""
    cluster = cluster_for(rows, width, dtype, sms)
    if cluster is None:
        return False
    return rows * cluster <= sms * ctas_per_sm(slice_capacity(width, dtype, cluster))


def in_one_wave(rows, width, dtype, sms):
    """``one_wave`` as a warmup predicate (vLLM traces its one expression)."""
    return one_wave(rows, width, dtype, sms)


def check(logits, ends, k, out) -> None:
    """What ``SelectTopk`` takes (raises ``Refused``)."""
    check_devices(("logits", "ends", "out"), logits, ends, out, optional=("out",))
    check_int("k", k, 1, MAX_K, f"an int in [1, {MAX_K}]")
    if not unit_columns(logits, VECTOR, VECTOR.get(logits.dtype, 1), 16):
        expected = "fp32/bf16 [rows, width], unit column stride, 16-byte aligned rows"
        raise mismatch("logits", expected, layout(logits))
    if not slice_capacity(logits.shape[1], logits.dtype, CLUSTERS[-1]):
        ctas = f"{CLUSTERS[-1]} CTAs of {CAPACITIES[-1]} shared keys"
        expected = f"at most {CLUSTERS[-1] * CAPACITIES[-1]} columns ({ctas})"
        raise mismatch("logits", expected, logits.shape[1])
    rows = logits.shape[0]
    expected = "int32 [>= rows of logits], unit stride"
    check_vector("ends", ends, rows, expected, (torch.int32,))
    if out is not None and (
        tuple(out.shape) != (rows, k) or not unit_columns(out, (torch.int32,))
    ):
        expected = f"int32 [rows of logits, k = {k}], unit column stride"
        raise mismatch("out", expected, layout(out))


class SelectKernel(KpoolKernel["SelectKernel.CompileKey"]):
    """``get_indexer_topk(backend)(logits, lengths, next_n, out, k,
    max_seq_len)`` of GLM-5-Next's decode (vLLM's ``cooperative_topk`` /
    ``persistent_topk``) with the same set in a stated order and tie choice
    (docs/select-contract.md compares them with stock's), into ``out``
    (None: a new int32 [rows, k] tensor). Row ``r`` reads its valid columns
    ``[0, clamp(ends[r], 0, width))`` only, ordered by stock's refining key
    (``convert_to_uint32_v2``: IEEE totalOrder, ``-NaN < -inf < ... < -0.0 <
    +0.0 < ... < +NaN``; BF16 by the 16-bit key of its exact upcast, so no
    upcast). ``end <= k``: ``0, ..., end - 1, -1, ...`` (stock's bytes); else
    the keys above the ``k``-th largest ``T`` and the lowest columns equal to
    ``T``, in ascending column order. One compile key per ``k``, logits
    dtype, cluster size (``cluster_for`` the rows and width on the device's
    SMs) and shared key capacity (``slice_capacity``)."""

    @dataclass(frozen=True)
    class CompileKey:
        k: int
        dtype: torch.dtype
        cluster: int
        capacity: int

    kernel = SelectTopk

    def dispatch(  # type: ignore[override]
        self, *, k: int, dtype: torch.dtype, rows: int, width: int, sms: int
    ) -> CompileKey:
        cluster = cluster_for(rows, width, dtype, sms)
        capacity = slice_capacity(width, dtype, cluster)
        return self.CompileKey(k=k, dtype=dtype, cluster=cluster, capacity=capacity)

    def get_warmup_keys(
        self,
        vllm_config=None,
        *,
        max_rows: int | None = None,
        one_wave_only: bool = False,
        **dispatch_values,
    ) -> list[CompileKey]:
        """The keys of 1 to ``max_rows`` rows (``one_wave_only``: of those
        that fit one wave); a stage's instance, given no rows: its stage's."""
        if max_rows is None:
            return super().get_warmup_keys(vllm_config)
        when = {"_when": in_one_wave} if one_wave_only else {}
        return self._trace_dispatch(self.dispatch)(
            rows=WarmupIntRange(1, max_rows + 1), **when, **dispatch_values
        )

    def spec(
        self,
        *,
        logits: torch.Tensor,
        ends: torch.Tensor,
        k: int,
        out: torch.Tensor | None = None,
    ):
        check(logits, ends, k, out)
        rows, width = logits.shape
        if out is None:
            out = logits.new_empty((rows, k), dtype=torch.int32)
        sms = sm_count(logits.get_device())
        key = self.dispatch(k=k, dtype=logits.dtype, rows=rows, width=width, sms=sms)
        return key, (logits, ends, out) if rows else None, out

    __call__ = kernel_launcher(spec)

    def warmup_inputs(self, compile_key: CompileKey) -> tuple:
        k, rows = compile_key, cute.sym_int()
        shape = (rows, cute.sym_int())
        stride = (cute.sym_int64(divisibility=VECTOR[k.dtype]), 1)
        logits = fake(k.dtype, shape, stride, 16)
        ends = fake(torch.int32, (cute.sym_int(),), (1,))
        out = fake(torch.int32, (rows, k.k), (cute.sym_int64(), 1))
        return logits, ends, out


SELECT = SelectKernel()
