# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused expand + remap as a sparse MLA index group's conversion
(``SparseMLAIndexGroup.conversion``, patch 0005): which groups can take it,
and the conversion itself (``FusedRemap``)."""

from typing import NamedTuple

import torch

from vllm.forward_context import in_piecewise_cudagraph
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
)
from vllm.utils.torch_utils import current_stream
from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

from ..constants import POOL
from ..cutedsl.common.host import Refused


def group_converting_decodes() -> tuple:
    """The ``forward_mqa`` of the decode paths that convert the top-k of
    decode-only steps through the index group (patch 0005's flag sends
    FlashInfer SM90's and FlashAttention's there). Any other may read the
    logical rows a deferral leaves unset."""
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import (
        FlashInferMLASparseSM90Impl,
    )
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl

    impls = (SparseMLACommonImpl, FlashMLASparseImpl, FlashInferMLASparseSM90Impl)
    return tuple(impl.forward_mqa for impl in impls)


def why_not_fusable(impl, group) -> str | None:
    """Why ``group`` (of ``impl``) cannot convert through a ``FusedRemap``,
    or None."""
    requirements = (
        (type(group) is SparseMLAIndexGroup, "not a plain SparseMLAIndexGroup"),
        (getattr(group, "has_indexer", False), "no indexer"),
        (getattr(group, "num_layers", 0) == 1, "more than one layer"),
        (getattr(impl, "dcp_world_size", 1) == 1, "decode context parallel"),
        (
            isinstance(impl, SparseMLACommonImpl)
            and type(impl).forward_mqa in group_converting_decodes(),
            f"{type(impl).__name__} converts the logical top-k rows itself",
        ),
    )
    return next((why for ok, why in requirements if not ok), None)


def remap_layout(attn) -> tuple[int, int] | None:
    """(block size, rows between blocks) of the MLA KV cache a DSA layer's
    index group converts for, as ``flat_kv_row_view`` reads it; None if the
    cache is not bound as a [blocks, block size, row] tensor."""
    kv = getattr(getattr(attn.mla_attn, "mla_attn", None), "kv_cache", None)
    if not isinstance(kv, torch.Tensor) or kv.ndim != 3 or kv.stride(0) % kv.shape[2]:
        return None
    return kv.shape[1], kv.stride(0) // kv.shape[2]


class Deferred(NamedTuple):
    """A decode step's pool top-k that the indexer left to the conversion:
    the pool ids and the rows' positions (``seq_len - 1``)."""

    pool_ids: torch.Tensor
    positions: torch.Tensor


class FusedRemap:
    """A sparse MLA index group's ``conversion`` that expands a deferred pool
    top-k and remaps it in one kernel (``RemapKernel``), on the group's side
    stream as the stock conversion. Without a deferred top-k, or when the
    kernel declines it, the stock conversion runs (declined: on the logical
    rows ``materialize`` writes first). It holds its layer's hand-off, which
    a step fills (``hand_over``) and the conversion empties."""

    def __init__(self, group: SparseMLAIndexGroup, stage):
        self.group, self.stage = group, stage
        self.pending: Deferred | None = None

    def hand_over(self, deferred: Deferred) -> None:
        if self.pending is not None:
            # Not an assert: under python -O the logical rows stay unfilled.
            raise RuntimeError(
                "GLM-5-Next kpool: a deferred top-k of this layer was not "
                "converted before the next step deferred another; the sparse "
                "MLA decode did not call its index group's conversion"
            )
        self.pending = deferred

    def __call__(
        self,
        stock,
        layer_index: int,
        logical: torch.Tensor,
        req_ids: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        *,
        block_stride_rows: int | None,
        return_valid_counts: bool,
    ):
        pending, self.pending = self.pending, None
        mapping = (req_ids, block_table, block_size)
        if pending is not None:
            if layer_index == 0:
                stride = block_size if block_stride_rows is None else block_stride_rows
                rows, counts = logical.shape[0], return_valid_counts
                fused = self.fused(pending, rows, *mapping, stride, counts)
                if fused is not None:
                    return fused
            # The stock conversion reads the logical rows: write them, and
            # record that they are ready now (the indexer's record came before
            # them; the side stream of the stock conversion waits on it).
            self.stage.materialize(pending, logical)
            self.group.set_logical_topk_ready(layer_index)
        return stock(
            layer_index,
            logical,
            *mapping,
            block_stride_rows=block_stride_rows,
            return_valid_counts=return_valid_counts,
        )

    def fused(
        self, pending, rows, req_ids, block_table, block_size, stride_rows, counts
    ):
        """The fused conversion's result, or None where the stage's remap
        does not take it (the caller converts stock)."""
        group = self.group
        if rows > group.physical_topk_indices.shape[0]:
            return None
        arguments = dict(
            pool_ids=pending.pool_ids,
            positions=pending.positions,
            pool_size=POOL,
            req_ids=req_ids,
            block_table=block_table,
            out=group.physical_topk_indices[:rows],
            counts=group.valid_topk_counts[:rows] if counts else None,
            block_size=block_size,
            stride_rows=stride_rows,
            seq_offset=1,
            int32_lengths=True,
        )
        # The kernel's call in its two halves (``kernel_launcher``'s): the
        # spec decides before the side stream is ordered, so that a refused
        # or unchecked key leaves the streams as stock's conversion finds them.
        kernel = self.stage.kernels.remap
        try:
            spec = kernel.spec(**arguments)
        except Refused:
            return None
        if self.stage.checked(spec[0]) is None:
            return None
        compute_stream = current_stream()
        if not in_piecewise_cudagraph():
            group.side_stream.wait_event(group.logical_topk_ready)
        else:
            group.side_stream.wait_stream(compute_stream)
        with group.side_stream:
            out = kernel.launch(spec, {})
            group.physical_topk_ready.record(group.side_stream)
        compute_stream.wait_event(group.physical_topk_ready)
        return (out, arguments["counts"]) if counts else out
