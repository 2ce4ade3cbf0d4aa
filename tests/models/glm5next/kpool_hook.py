# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the GLM-5-Next sparse indexer (patch 0002) calls, as ``Protocol``s
the stage is held to (``test_install.py``):
``sparse_indexer.SPECIALIZED_KPOOL`` is a ``KpoolHook``
(``install.StageRegistry``) or None; its ``decode_step`` gives a
``KpoolLayerStep`` (``stage.LayerStep``) or None (stock)."""

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KpoolLayerStep(Protocol):
    """One DSA layer's decode in a planned step."""

    # The step hands its pool top-k to the layer's index conversion; the
    # indexer leaves its logical top-k rows unfilled.
    deferring: bool

    def update(self, *stock_args, round_scale: bool = True) -> None:
        """In place of ``kpool_decode_update_and_maybe_write_cache_batched(
        *stock_args, round_scale=round_scale)``."""

    def decode_rows(
        self,
        q,
        kv_cache: torch.Tensor,
        weights: torch.Tensor,
        decode,
        max_seq_len: int,
        *,
        max_model_len: int,
        topk_tokens: int,
        topk_backend: str,
        positions: torch.Tensor | None,
        buffer: torch.Tensor,
    ) -> bool:
        """The decode rows from the scores on (into ``buffer``, or handed to
        the conversion); False: the indexer runs them stock."""


@runtime_checkable
class KpoolHook(Protocol):
    """``sparse_indexer.SPECIALIZED_KPOOL``."""

    def decode_step(
        self,
        metadata,
        layer,
        positions: torch.Tensor | None,
        topk_tokens: int,
        pool_size: int,
        buffer: torch.Tensor,
    ) -> KpoolLayerStep | None:
        """The decode of ``layer``'s indexer in a planned step of the model
        that owns ``buffer`` (its top-k buffer), else None."""
