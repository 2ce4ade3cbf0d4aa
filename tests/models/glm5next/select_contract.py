# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The opt-in select's contract, the tests' one executable statement of it,
written from ``cutedsl/select/kernel.py``'s docstring (not from the kernel,
nor from the self-check's ``cases.select_reference``, which the tests check
against it): per row the columns below ``clamp(end, 0, width)``; if
``end <= k``: ``0..end-1`` then -1; else exactly ``k`` columns: all whose
order key (IEEE totalOrder) is above the k-th largest key ``T`` and, of
those equal to ``T``, the lowest ids; listed ascending."""

import torch


def order_key(logits: torch.Tensor) -> torch.Tensor:
    """int64 totalOrder keys from the signed bits: ``b + 2^(n-1)`` for a
    positive sign, ``-1 - b`` (every bit of ``b`` flipped) for a negative
    one."""
    bits = logits.view(
        torch.int32 if logits.dtype == torch.float32 else torch.int16
    ).long()
    return torch.where(
        bits < 0, -1 - bits, bits + (1 << (8 * logits.element_size() - 1))
    )


def contract_topk(logits: torch.Tensor, ends: torch.Tensor, k: int) -> torch.Tensor:
    """The contract by threshold: the k-th largest key ``T`` of each long
    row (``kthvalue``), its keys above ``T``, then its first columns equal
    to ``T`` while fewer than ``k`` are taken."""
    rows, width = logits.shape
    device = logits.device
    end = ends[:rows].long().clamp(0, width)
    columns = torch.arange(width, device=device)
    keys = torch.where(columns[None, :] < end[:, None], order_key(logits), -1)
    slots = torch.arange(k, device=device)
    out = torch.where(slots[None, :] < end[:, None], slots[None, :], -1)
    if width < k:
        return out.to(torch.int32)
    # Every row, no data-dependent shape, so that a CUDA graph can hold it.
    threshold = torch.kthvalue(keys, width - k + 1, dim=1).values[:, None]
    above, tied = keys > threshold, keys == threshold
    need = k - above.sum(1, keepdim=True)
    taken = above | (tied & (tied.cumsum(1) <= need))
    ids = torch.where(taken, columns, width).sort(dim=1).values[:, :k]
    return torch.where((end > k)[:, None], ids, out).to(torch.int32)
