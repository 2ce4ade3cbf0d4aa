# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kpool indexer's decode kernels in CuTe DSL, bit for bit with the stock
Triton kernels of ``ops/kpool_compress.py``, ``as_fp32_logits`` and the
sparse MLA index conversion: the kernels' public face (the stage that runs
them is ``runtime/``, which this module does not import).

Each function is its kernel's contract (the kernel class's docstring in
``cutedsl/<op>/launch.py``) and raises ``Refused`` (a ``ValueError``) naming
the argument its rule (``check`` there) does not take. A function compiles a
kernel variant on first use (never inside a CUDA graph capture). One is not
bit for bit: ``select_topk``, stock's set in its own stated order and tie
choice.
"""

import torch

from .constants import DIM
from .cutedsl.common.host import Refused
from .cutedsl.expand.launch import EXPAND
from .cutedsl.remap.launch import REMAP
from .cutedsl.select.launch import SELECT
from .cutedsl.upcast.launch import UPCAST
from .cutedsl.update.launch import UPDATE

__all__ = [
    "Refused",
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
    """``UpdateKernel``'s contract (``head_dim`` 128)."""
    tensors = (kv_cache, tail_kv_cache, tail_slot_mapping, key, slot_score, ape)
    tensors += (slot_mapping, positions)
    UPDATE(*tensors, pool_size, DIM, mx_scales=mx_scales, round_scale=round_scale)


def expand_pools(
    pool_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    pool_size: int,
    *,
    seq_offset: int = 0,
    out: torch.Tensor,
) -> torch.Tensor:
    """``ExpandKernel``'s contract; returns ``out``."""
    arguments = dict(pool_ids=pool_ids, seq_lens=seq_lens, pool_size=pool_size)
    return EXPAND(**arguments, seq_offset=seq_offset, out=out)


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
    """``RemapKernel``'s contract."""
    arguments = dict(pool_ids=pool_ids, positions=positions, pool_size=pool_size)
    arguments |= dict(req_ids=req_ids, block_table=block_table, out=out)
    arguments |= dict(counts=counts, block_size=block_size, stride_rows=stride_rows)
    REMAP(**arguments, seq_offset=seq_offset)


def upcast_logits(
    logits: torch.Tensor, row_ends: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``UpcastKernel``'s contract; returns the FP32 logits."""
    return UPCAST(logits=logits, row_ends=row_ends, out=out)


def select_topk(
    logits: torch.Tensor, ends: torch.Tensor, k: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``SelectKernel``'s contract; returns the int32 [rows, k] ids."""
    return SELECT(logits=logits, ends=ends, k=k, out=out)
