# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kpool indexer's decode kernels in CuTe DSL, bit for bit with the stock
Triton kernels of ``ops/kpool_compress.py``, ``as_fp32_logits`` and the
sparse MLA index conversion, and the stage that runs them in planned decode
steps (``KpoolStage``, ``FusedRemap``).

Each function takes what its kernel's rule (``key_for`` in its
``*_kernel.py``) admits and raises ``ValueError`` naming the argument
otherwise; the stage sends such inputs, and any whose kernel its warmup did
not compile, to the stock function. A function compiles a kernel variant on
first use (never inside a CUDA graph capture); launches go through TVM-FFI on
torch's current stream, with PDL.

One function is not bit for bit: ``select_topk`` (``select_kernel.py``), the
pool top-k, gives the set of stock's decode top-k in its own stated order
and tie choice; the stage runs it only where the deployment opts in
(``kpool_select``).
"""

import torch

from vllm.models.glm5next.nvidia.specialized_decode.constants import DIM
from vllm.models.glm5next.nvidia.specialized_decode.expand_kernel import (
    EXPAND,
    ExpandArgs,
)
from vllm.models.glm5next.nvidia.specialized_decode.fused_remap import FusedRemap
from vllm.models.glm5next.nvidia.specialized_decode.remap_kernel import (
    REMAP,
    RemapArgs,
)
from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import select_topk
from vllm.models.glm5next.nvidia.specialized_decode.stage import KpoolStage
from vllm.models.glm5next.nvidia.specialized_decode.upcast_kernel import (
    UPCAST,
    UpcastArgs,
)
from vllm.models.glm5next.nvidia.specialized_decode.update_kernel import (
    UPDATE,
    UpdateArgs,
)

__all__ = [
    "FusedRemap",
    "KpoolStage",
    "expand_and_remap",
    "expand_pools",
    "kpool_update",
    "select_topk",
    "upcast_logits",
]


def kpool_update(
    kv_cache: torch.Tensor,
    tail_kv_cache: torch.Tensor,
    tail_slot_mapping: torch.Tensor,
    key: torch.Tensor,
    slot_score: torch.Tensor,
    ape: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    pool_size: int,
    *,
    mx_scales: bool = True,
    round_scale: bool = True,
) -> None:
    """``kpool_decode_update_and_maybe_write_cache_batched`` for ``head_dim``
    128 with the same arguments; ``mx_scales`` is what the stock kernel reads
    from ``mqa_logits_use_mx_scales()`` (UE8M0 bytes, else FP32 scales)."""
    UPDATE.run(
        UpdateArgs(
            kv_cache,
            tail_kv_cache,
            tail_slot_mapping,
            key,
            slot_score,
            ape,
            slot_mapping,
            positions,
            pool_size,
            DIM,
            mx_scales,
            round_scale,
        )
    )


def expand_pools(
    pool_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    pool_size: int,
    *,
    seq_offset: int = 0,
    out: torch.Tensor,
) -> torch.Tensor:
    """``expand_pools_and_append_tail(..., seq_offset=, out=)`` for int32 pool
    ids: writes the ``pools * 4 + 3`` first columns of ``out`` and returns it."""
    EXPAND.run(ExpandArgs(pool_ids, seq_lens, pool_size, seq_offset, out))
    return out


def expand_and_remap(
    pool_ids: torch.Tensor,
    positions: torch.Tensor,
    pool_size: int,
    req_ids: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    counts: torch.Tensor | None = None,
    *,
    block_size: int,
    stride_rows: int,
    seq_offset: int = 1,
) -> None:
    """``triton_convert_req_index_to_global_index(req_ids, block_table,
    logical, BLOCK_SIZE=block_size, BLOCK_STRIDE_ROWS=stride_rows,
    return_valid_counts=counts is not None, out=out, valid_counts_out=counts)``
    where ``logical`` (``out``'s shape) holds, in its first
    ``pool_ids.shape[0]`` rows, ``expand_pools_and_append_tail(pool_ids,
    positions, pool_size, seq_offset=seq_offset)`` and -1 everywhere else."""
    REMAP.run(
        RemapArgs(
            pool_ids,
            positions,
            pool_size,
            req_ids,
            block_table,
            out,
            counts,
            block_size,
            stride_rows,
            seq_offset,
        )
    )


def upcast_logits(
    logits: torch.Tensor, row_ends: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``as_fp32_logits`` of BF16 logits: the columns below each row end in
    FP32, in ``out`` if given (else a new tensor with the strides of
    ``logits``), the other columns untouched."""
    return UPCAST.run(UpcastArgs(logits, row_ends, out)).out
