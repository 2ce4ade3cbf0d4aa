# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``upcast_logits`` against ``as_fp32_logits``: every column below each row
end byte for byte (past the width into the row padding, as stock does, where
an end lies there; negative ends convert nothing); columns at and past the
end are left untouched. Without ``out``, the new tensor has the strides of
``logits``, as stock's. Row counts across the CTA groups, widths from 1 to
70,000 (not multiples of the tile), row padding, NaN, +-inf, +-0.0 and
denormals."""

import pytest
import torch
from kpool_fuzz import fuzz

pytestmark = pytest.mark.gpu


def check_case(rng, gen) -> str | None:
    from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
    from vllm.models.glm5next.nvidia.specialized_decode.kpool import upcast_logits
    from vllm.models.glm5next.nvidia.specialized_decode.upcast_kernel import (
        GROUP_ROWS,
        TILE,
    )

    device = gen.device
    # The tiles past each row's first are dealt out within groups of
    # GROUP_ROWS rows: one group, several, a last group of one row.
    rows = rng.choice(
        [1, 2, 3, GROUP_ROWS, GROUP_ROWS + 1, 256, rng.randint(1, 256), 1500]
    )
    width = rng.choice([1, 7, 8, 1000, 16384, 65536, rng.randint(1, 70_000)])
    if rows * width > 1 << 24:
        width = (1 << 24) // rows
    stride = width + -width % 8 + rng.choice([0, 8, 64])
    storage = torch.randn(rows * stride, generator=gen, device=device) * 30
    special = torch.tensor(
        [float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-40],
        device=device,
    )
    picks = torch.randint(0, rows * stride, (64,), generator=gen, device=device)
    storage[picks] = special[torch.arange(64, device=device) % 6]
    logits = storage.to(torch.bfloat16).as_strided((rows, width), (stride, 1))
    ends = torch.randint(0, width + 1, (rows,), generator=gen, device=device)
    draw = torch.rand(rows, generator=gen, device=device)
    ends[draw < 0.2] = width
    # Short rows, the usual decode step: ends a few tiles into a wide row.
    short = torch.randint(0, 3 * TILE, (rows,), generator=gen, device=device)
    ends = torch.where((draw >= 0.2) & (draw < 0.4), short.clamp(max=width), ends)
    ends[draw > 0.97] = -torch.randint(1, 2**31, (1,), generator=gen, device=device)
    # Stock converts up to the end even past the width, into the row padding
    # (never past the last row: stock's output ends at its width).
    past = (
        (draw > 0.93) & (draw <= 0.97) & (torch.arange(rows, device=device) < rows - 1)
    )
    if stride > width:
        over = torch.randint(
            1, stride - width + 1, (rows,), generator=gen, device=device
        )
        ends = torch.where(past, width + over, ends)
    ends = ends.to(torch.int32)

    expected = as_fp32_logits(logits, ends)
    poison = torch.randint(
        -(2**31), 2**31 - 1, (rows, stride), generator=gen, device=device
    ).to(torch.int32)
    out_rows = poison.clone().view(torch.float32)
    if rng.random() < 0.1:  # upcast_logits allocates
        new = upcast_logits(logits, ends)
        torch.cuda.synchronize()
        below = torch.arange(width, device=device)[None, :] < ends[:, None].long()
        same = torch.equal(
            new.view(torch.int32)[below], expected.view(torch.int32)[below]
        )
        if new.stride() != expected.stride() or not same:
            return f"rows {rows} width {width} stride {stride}: allocated out differs"
        return None
    got = upcast_logits(logits, ends, out=out_rows[:, :width])
    torch.cuda.synchronize()
    # Both outputs over whole rows (stock's padding read where it wrote).
    exp_rows = poison.clone()
    exp_rows[:, :width] = expected.view(torch.int32)
    if rows > 1 and stride > width:
        exp_rows[:-1, width:] = expected.view(torch.int32).as_strided(
            (rows - 1, stride - width), (stride, 1), expected.storage_offset() + width
        )
    got_rows = out_rows.view(torch.int32)
    below = torch.arange(stride, device=device)[None, :] < ends[:, None].long()
    same = torch.equal(exp_rows[below], got_rows[below])
    # Nothing at or past a row end is written.
    kept = torch.equal(got_rows[~below], poison[~below])
    if got.data_ptr() != out_rows.data_ptr():
        return "upcast_logits did not return out"
    if not (same and kept):
        bad = int((exp_rows[below] != got_rows[below]).sum())
        return (
            f"rows {rows} width {width} stride {stride}: {bad} values differ, "
            f"untouched past the end {kept}"
        )
    return None


def test_upcast_logits_matches_stock():
    fuzz("upcast_logits", 1000, check_case)
