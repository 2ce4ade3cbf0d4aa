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
    check_vector,
    fake,
    kernel_launcher,
    layout,
    mismatch,
    sm_count,
)
from .fed import HISTOGRAM, FedSelectTopk
from .kernel import CAPACITIES, VECTOR, SelectTopk, ctas_per_sm
from .split import SplitSelectTopk

# The k a compile key takes (stock's decode top-k serves 512, 1024, 2048).
MAX_K = 4096
CLUSTERS = (1, 2, 4, 8, 16)
# Rows 16-CTA clusters take: about 7 of them fit the H200's GPCs at once.
MAX_ROWS_16 = 4
# A slice is not split below this many keys (twice as many in a 16-CTA
# cluster, whose barrier and sums cost more): smaller ones cost more in
# cluster barriers than they save in passes.
MIN_SLICE = 4096
# The widest rows the fed select takes (the bitmaps of its compile key's
# ``columns``, two of them in shared memory).
FED_COLUMNS = (32768, 65536, 131072, 262144)
# The split select's chunk: two CTAs an SM hold one each (``ctas_per_sm``).
SPLIT_CHUNK = 16384
# Whether the select runs split where the rows pass one wave of clusters
# (``split_chunk``): off until its GPU tests and timings against the
# cluster select's waves have run (docs/performance.md, "The select past
# one wave").
SPLIT_PAST_ONE_WAVE = False


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
    whose slices fit in shared memory; None where none do. (H200 sweeps
    chose these bounds: at 32 rows of 65536 pools 2 CTAs a row beat 4, at 1
    row of 16384 4 beat 2, at 1 row of 65536 8 beat 16.)"""
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


def fed_columns(width: int) -> int:
    """The fed select's ``columns`` for rows of ``width`` columns, or 0
    where it takes none that wide."""
    return next((c for c in FED_COLUMNS if width <= c), 0)


def split_parts(width: int, k: int) -> int:
    """The chunks of ``SPLIT_CHUNK`` columns the split select cuts rows of
    ``width`` columns into, or 0 where it takes none: fewer than two chunks,
    ``k`` not a multiple of 4 or wider than a chunk (a full chunk gives ``k``
    candidates), or more candidates than the merge's CTA holds."""
    parts = -(-width // SPLIT_CHUNK)
    takes = k % 4 == 0 and k <= SPLIT_CHUNK and parts * k <= CAPACITIES[-1]
    return parts if parts >= 2 and takes else 0


def split_capacity(width: int, k: int) -> int:
    """The shared keys of the split select's merge: its rows' candidates."""
    candidates = split_parts(width, k) * k
    return next((c for c in CAPACITIES if candidates <= c), 0)


def split_chunk(
    rows: int,
    width: int,
    k: int,
    dtype: torch.dtype,
    sms: int,
    split: bool | None = None,
) -> int:
    """``SPLIT_CHUNK`` where the split select runs, else 0: wherever it
    takes the width and ``k`` if ``split``; if None, where
    ``SPLIT_PAST_ONE_WAVE`` routes it, past one wave of clusters."""
    if not split_parts(width, k):
        return 0
    if split is None:
        split = SPLIT_PAST_ONE_WAVE and not one_wave(rows, width, dtype, sms)
    return SPLIT_CHUNK if split else 0


def capacity_for(width: int, k: int, dtype: torch.dtype, cluster: int, chunk: int):
    """The shared keys of a CTA: of the split select's merge where it has a
    ``chunk``, else of a ``cluster``-CTA row's slice."""
    return split_capacity(width, k) if chunk else slice_capacity(width, dtype, cluster)


def select_kernel(key: "SelectKernel.CompileKey"):
    """The device code of ``key``: the fed select where it has ``columns``,
    the split select where it has a ``chunk``."""
    if key.chunk:
        return SplitSelectTopk(key)
    return FedSelectTopk(key) if key.columns else SelectTopk(key)


def in_one_wave(rows, width, dtype, sms):
    """``one_wave`` as a warmup predicate (vLLM traces its one expression)."""
    return one_wave(rows, width, dtype, sms)


def check(logits, ends, k, out, histogram=None, chunks=None, split=None) -> None:
    """What ``SelectTopk`` (and with ``histogram``, ``FedSelectTopk``; with
    ``split``, ``SplitSelectTopk``) takes (raises ``Refused``)."""
    check_devices(
        ("logits", "ends", "out", "histogram", "chunks"),
        logits,
        ends,
        out,
        histogram,
        chunks,
        optional=("out", "histogram", "chunks"),
    )
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
        raise mismatch("k", f"an int in [1, {MAX_K}]", k)
    stride = logits.stride()
    vector = VECTOR.get(logits.dtype)
    if (
        vector is None
        or len(stride) != 2
        or stride[1] != 1
        or stride[0] % vector
        or logits.data_ptr() % 16
    ):
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
        out.dtype is not torch.int32
        or tuple(out.shape) != (rows, k)
        or out.stride(1) != 1
    ):
        expected = f"int32 [rows of logits, k = {k}], unit column stride"
        raise mismatch("out", expected, layout(out))
    if split is not None and not isinstance(split, bool):
        raise mismatch("split", "None, True or False", split)
    if split and histogram is not None:
        expected = "None or False with a histogram (the fed select)"
        raise mismatch("split", expected, split)
    if split and not split_parts(logits.shape[1], k):
        expected = (
            f"more than {SPLIT_CHUNK} columns (two chunks), k a multiple of 4 "
            f"and k x chunks at most {CAPACITIES[-1]} (the split select)"
        )
        raise mismatch("logits", expected, f"{logits.shape[1]} columns, k {k}")
    if histogram is None:
        return
    if logits.dtype is not torch.float32 or not fed_columns(logits.shape[1]):
        expected = f"fp32 logits of at most {FED_COLUMNS[-1]} columns with a histogram"
        raise mismatch("logits", expected, layout(logits))
    if (
        histogram.dtype is not torch.int32
        or histogram.dim() != 2
        or histogram.shape[0] < rows
        or histogram.shape[1] != HISTOGRAM
        or histogram.stride(1) != 1
    ):
        expected = f"int32 [>= rows of logits, {HISTOGRAM}], unit column stride"
        raise mismatch("histogram", expected, layout(histogram))


def check_chunks(chunks, chunk_rows: int, k: int) -> None:
    """The split select's workspace: ``chunk_rows`` (rows x chunks) rows of
    ``k`` int32 columns, each row 16-byte aligned."""
    if (
        chunks.dtype is not torch.int32
        or chunks.dim() != 2
        or chunks.shape[0] < chunk_rows
        or chunks.shape[1] != k
        or chunks.stride(1) != 1
        or chunks.stride(0) % 4
        or chunks.data_ptr() % 16
    ):
        expected = f"int32 [>= rows x chunks ({chunk_rows}), k = {k}]"
        expected += ", unit column stride, rows 16-byte aligned"
        raise mismatch("chunks", expected, layout(chunks))


class SelectKernel(KpoolKernel["SelectKernel.CompileKey"]):
    """``get_indexer_topk(backend)(logits, lengths, next_n, out, k,
    max_seq_len)`` of GLM-5-Next's decode (vLLM's ``cooperative_topk`` /
    ``persistent_topk``) with the same set in a stated order and tie choice
    (stock's are its atomics'; docs/select-contract.md compares them), into
    ``out`` (None: a new int32 [rows, k] tensor). Row ``r`` reads its valid
    columns ``[0, clamp(ends[r], 0, width))`` only, ordered by stock's
    refining key (``convert_to_uint32_v2``: IEEE totalOrder, ``-NaN < -inf <
    ... < -0.0 < +0.0 < ... < +NaN``; BF16 by the 16-bit key of its exact
    upcast, so no upcast). ``end <= k``: ``0, ..., end - 1, -1, ...``
    (stock's bytes); else the keys above the ``k``-th largest ``T`` and the
    lowest columns equal to ``T``, in ascending column order. One compile
    key per ``k``, logits dtype, cluster size (``cluster_for`` the rows and
    width on the device's SMs) and shared key capacity
    (``slice_capacity``).

    With ``histogram`` (the stage's, the opt-in scores' counts of each
    row's first digit; FP32 rows of at most ``FED_COLUMNS[-1]`` columns):
    the fed select (``fed.py``), the same bytes whatever the counts hold, and
    each row's 257 words zeroed. One compile key per ``k`` and bitmap
    ``columns`` (``fed_columns``).

    With ``split`` (True, or None where ``split_chunk`` routes it): the split
    select (``split.py``), the same bytes in two launches, through
    ``chunks``, an int32 [rows x ``split_parts``, k] workspace (None: a new
    one). One compile key per ``k``, logits dtype and the merge's shared
    key capacity (``split_capacity``)."""

    @dataclass(frozen=True)
    class CompileKey:
        k: int
        dtype: torch.dtype
        cluster: int
        capacity: int
        # The fed select's bitmap columns (``fed_columns``); 0: the select.
        columns: int = 0
        # The split select's chunk (``split_chunk``); 0: not split.
        chunk: int = 0

    kernel = staticmethod(select_kernel)

    def dispatch(  # type: ignore[override]
        self,
        *,
        k: int,
        dtype: torch.dtype,
        rows: int,
        width: int,
        sms: int,
        fed: bool = False,
        split: bool | None = None,
    ) -> CompileKey:
        # The fed select: one CTA a row, whatever the rows; the split
        # select: one CTA a chunk, then one a row.
        chunk = 0 if fed else split_chunk(rows, width, k, dtype, sms, split)
        cluster = 1 if fed or chunk else cluster_for(rows, width, dtype, sms)
        capacity = 0 if fed else capacity_for(width, k, dtype, cluster, chunk)
        return self.CompileKey(
            k=k,
            dtype=dtype,
            cluster=cluster,
            capacity=capacity,
            columns=fed_columns(width) if fed else 0,
            chunk=chunk,
        )

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
        histogram: torch.Tensor | None = None,
        chunks: torch.Tensor | None = None,
        split: bool | None = None,
    ):
        check(logits, ends, k, out, histogram, chunks, split)
        rows, width = logits.shape
        if out is None:
            out = logits.new_empty((rows, k), dtype=torch.int32)
        sms = sm_count(logits.get_device())
        fed = histogram is not None
        key = self.dispatch(
            k=k,
            dtype=logits.dtype,
            rows=rows,
            width=width,
            sms=sms,
            fed=fed,
            split=split,
        )
        if fed:
            args = (logits, ends, histogram, out)
        elif key.chunk:
            chunk_rows = rows * split_parts(width, k)
            if chunks is None:
                chunks = logits.new_empty((chunk_rows, k), dtype=torch.int32)
            check_chunks(chunks, chunk_rows, k)
            # The first launch's grid: one CTA a row of ``chunks``.
            args = (logits, ends, chunks[:chunk_rows], out)
        else:
            args = (logits, ends, out)
        return key, args if rows else None, out

    __call__ = kernel_launcher(spec)

    def warmup_inputs(self, compile_key: CompileKey) -> tuple:
        k, rows = compile_key, cute.sym_int()
        shape = (rows, cute.sym_int())
        stride = (cute.sym_int64(divisibility=VECTOR[k.dtype]), 1)
        logits = fake(k.dtype, shape, stride, 16)
        ends = fake(torch.int32, (cute.sym_int(),), (1,))
        out = fake(torch.int32, (rows, k.k), (cute.sym_int64(), 1))
        if k.chunk:
            stride = (cute.sym_int64(divisibility=4), 1)
            chunks = fake(torch.int32, (cute.sym_int(), k.k), stride, 16)
            return logits, ends, chunks, out
        if not k.columns:
            return logits, ends, out
        histogram = fake(
            torch.int32, (cute.sym_int(), HISTOGRAM), (cute.sym_int64(), 1)
        )
        return logits, ends, histogram, out


SELECT = SelectKernel()
