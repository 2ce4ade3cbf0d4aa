# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host side of ``KpoolScores``: what it takes of DeepGEMM's
``fp8_fp4_paged_mqa_logits`` arguments, how many CTAs an entry takes, its
compile key, its launch."""

from dataclasses import dataclass

import cutlass.cute as cute
import torch
from cutlass import Int32

from ...constants import DIM
from ..common.host import (
    KpoolKernel,
    check_devices,
    check_int,
    fake,
    kernel_launcher,
    layout,
    mismatch,
    sm_count,
    unit_columns,
)
from .kernel import TILE, KpoolScores

HEADS = (16, 32, 64)
NEXT_N = (1, 2, 3, 4)
BLOCKS = (32, 64)
# DeepGEMM's logits row stride: the width rounded up to 256 columns.
ROW_ALIGN = 256
# CTAs a step aims at, per SM (``splits_for``): four where the step has few
# tiles (at most FEW_TILES a SM), to hide each CTA's start; else two, since
# more concurrent streams an SM read a large cache slower.
CTAS_PER_SM, CTAS_PER_SM_FEW, FEW_TILES = 2, 4, 16


def served_heads(index_heads: int) -> int | None:
    """The heads the kernel scores for an indexer of ``index_heads`` query
    heads, which vLLM zero-pads to 32 for DeepGEMM: the real ones where the
    kernel takes that many (a view of the padded query: the zero heads add
    nothing but the sign of a zero, which the kernel keeps), else the padded
    count; None where it takes neither."""
    if index_heads in HEADS:
        return index_heads
    padded = max(index_heads, 32)
    return padded if padded in HEADS else None


def splits_for(entries: int, width: int, sms: int) -> int:
    """The CTAs an entry's tiles (of a ``width``-pool row) are split over:
    ``ceil(ctas * sms / entries)``, so that one entry keeps every SM reading."""
    tiles = -(-width // TILE)
    few = entries * tiles <= FEW_TILES * sms
    ctas = CTAS_PER_SM_FEW if few else CTAS_PER_SM
    return max(1, min(tiles, -(-ctas * sms // max(entries, 1))))


def row_stride(width: int) -> int:
    return -(-width // ROW_ALIGN) * ROW_ALIGN


def check(
    q, kv_cache, weights, seq_lens, block_table, max_model_len, out, indices=None
):
    """What ``KpoolScores`` takes (raises ``Refused``)."""
    if indices is not None:
        got = layout(indices) if isinstance(indices, torch.Tensor) else indices
        expected = "None (SM90's batched decode; the varlen form is SM100's)"
        raise mismatch("indices", expected, got)
    if not isinstance(q, tuple) or len(q) != 2:
        raise mismatch("q", "a (values, scales) tuple", type(q).__name__)
    values, scales = q
    if scales is not None:
        raise mismatch("q", "no query scales (SM90 folds them into weights)", scales)
    names = ("q", "kv_cache", "weights", "seq_lens", "block_table", "out")
    tensors = (values, kv_cache, weights, seq_lens, block_table, out)
    check_devices(names, *tensors, optional=("out",))
    if (
        values.dtype != torch.float8_e4m3fn
        or values.dim() != 4
        or values.shape[1] not in NEXT_N
        or values.shape[2] not in HEADS
        or values.shape[3] != DIM
        or values.stride()[2:] != (DIM, 1)
        or any(s <= 0 or s % 16 for s in values.stride()[:2])
        or values.data_ptr() % 16
    ):
        expected = f"fp8 e4m3 [entries, next_n in {NEXT_N}, heads in {HEADS}, {DIM}], "
        expected += "its heads' rows consecutive, entries and next_n strides positive "
        expected += "multiples of 16, 16-byte aligned"
        raise mismatch("q", expected, layout(values))
    entries, next_n, heads, _ = values.shape
    if (
        kv_cache.dtype != torch.uint8
        or kv_cache.dim() != 4
        or kv_cache.shape[1] not in BLOCKS
        or kv_cache.shape[2] != 1
        or kv_cache.shape[3] != DIM + 4
        or kv_cache.stride()[1:] != (DIM + 4, DIM + 4, 1)
        or kv_cache.stride(0) % 16
        or kv_cache.stride(0) < kv_cache.shape[1] * (DIM + 4)
        or kv_cache.data_ptr() % 16
    ):
        expected = f"uint8 [blocks, block in {BLOCKS}, 1, {DIM + 4}], dense pages "
        expected += "(FP8 rows then FP32 scales) of a 16-byte multiple, 16-byte aligned"
        raise mismatch("kv_cache", expected, layout(kv_cache))
    rows = entries * next_n
    if not unit_columns(weights, (torch.float32,)) or weights.shape != (rows, heads):
        expected = f"fp32 [entries * next_n = {rows}, heads = {heads}], unit column "
        raise mismatch("weights", expected + "stride", layout(weights))
    if (
        seq_lens.dtype != torch.int32
        or tuple(seq_lens.shape) != (entries, next_n)
        or not seq_lens.is_contiguous()
    ):
        expected = f"contiguous int32 [entries = {entries}, next_n = {next_n}]"
        raise mismatch("seq_lens", expected, layout(seq_lens))
    if not unit_columns(block_table, (torch.int32,)) or block_table.shape[0] != entries:
        expected = f"int32 [entries = {entries}, max_blocks], unit column stride"
        raise mismatch("block_table", expected, layout(block_table))
    limit = 2**31 - TILE
    expected = f"an int in [1, {limit}) (not a bool)"
    check_int("max_model_len", max_model_len, 1, limit - 1, expected)
    if out is not None and (
        tuple(out.shape) != (rows, max_model_len)
        or not unit_columns(out, (torch.float32,))
        or out.stride(0) < max_model_len
    ):
        expected = f"fp32 [entries * next_n = {rows}, max_model_len = {max_model_len}]"
        expected += ", unit column stride, rows apart by the width or more"
        raise mismatch("out", expected, layout(out))


class ScoresKernel(KpoolKernel["ScoresKernel.CompileKey"]):
    """``fp8_fp4_paged_mqa_logits(q, kv_cache, weights, seq_lens,
    block_table, schedule_metadata, max_model_len)`` of GLM-5-Next's decode
    on SM90 (FP8 query with its scale in ``weights``, FP32 cache scales, no
    ``indices``), without the schedule metadata: FP32 logits ``[entries *
    next_n, max_model_len]`` on DeepGEMM's row stride (the width rounded up
    to 256), each entry's rows written below ``seq_lens[entry, -1]`` (the
    columns past it are not). Into ``out`` if given. With 16 heads, DeepGEMM's
    call on the query and weights zero-padded to 32 (which it needs, and vLLM
    hands it): the query may be a view of the padded one (its own entry and
    next_n strides). One compile key per head count, ``next_n`` and cache
    page size."""

    @dataclass(frozen=True)
    class CompileKey:
        heads: int
        next_n: int
        block: int

    kernel = KpoolScores

    def spec(
        self,
        *,
        q: tuple,
        kv_cache: torch.Tensor,
        weights: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        max_model_len: int,
        indices: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ):
        check(q, kv_cache, weights, seq_lens, block_table, max_model_len, out, indices)
        values = q[0]
        entries, next_n, heads, _ = values.shape
        if out is None:
            shape = (entries * next_n, row_stride(max_model_len))
            out = values.new_empty(shape, dtype=torch.float32)[:, :max_model_len]
        key = self.dispatch(heads=heads, next_n=next_n, block=kv_cache.shape[1])
        splits = splits_for(entries, max_model_len, sm_count(values.get_device()))
        tensors = (values, kv_cache, weights, seq_lens, block_table, out)
        args = (*tensors, Int32(splits)) if entries else None
        return key, args, out

    __call__ = kernel_launcher(spec)

    def warmup_inputs(self, compile_key: CompileKey) -> tuple:
        heads, next_n, block = compile_key.heads, compile_key.next_n, compile_key.block
        entries = cute.sym_int()
        # Row strides of the query's entries and next_n: its own (a view of
        # vLLM's padded heads, or contiguous).
        rows = (cute.sym_int64(divisibility=16), cute.sym_int64(divisibility=16))
        shape = (entries, next_n, heads, DIM)
        q = fake(torch.float8_e4m3fn, shape, (*rows, DIM, 1), 16)
        shape = (cute.sym_int(), block, 1, DIM + 4)
        stride = (cute.sym_int64(divisibility=16), DIM + 4, DIM + 4, 1)
        kv = fake(torch.uint8, shape, stride, 16)
        weights = fake(torch.float32, (cute.sym_int(), heads), (cute.sym_int64(), 1))
        seq_lens = fake(torch.int32, (entries, next_n), (next_n, 1))
        table = fake(torch.int32, (entries, cute.sym_int()), (cute.sym_int64(), 1))
        shape = (cute.sym_int(), cute.sym_int())
        logits = fake(torch.float32, shape, (cute.sym_int64(), 1))
        return q, kv, weights, seq_lens, table, logits, Int32(1)


SCORES = ScoresKernel()
