# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``upcast_logits`` against ``as_fp32_logits``: every column below each row
end byte for byte; columns at and past the end are left untouched."""

import pytest
import torch
from kpool_fuzz import fuzz, needs_cuda

pytestmark = [pytest.mark.gpu, needs_cuda()]


def check_case(rng, gen) -> str | None:
    from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
    from vllm.models.glm5next.nvidia.specialized_decode.kpool import upcast_logits

    device = gen.device
    rows = rng.choice([1, 2, 3, 64, 256, rng.randint(1, 256)])
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
    ends[torch.rand(rows, generator=gen, device=device) < 0.2] = width
    ends = ends.to(torch.int32)

    expected = as_fp32_logits(logits, ends)
    poison = torch.randint(
        -(2**31), 2**31 - 1, (rows, stride), generator=gen, device=device
    ).to(torch.int32)
    out_rows = poison.clone().view(torch.float32)
    got = upcast_logits(logits, ends, out=out_rows[:, :width])
    torch.cuda.synchronize()
    cols = torch.arange(width, device=device)
    below = cols[None, :] < ends[:, None].long()
    exp_bits, got_bits = expected.view(torch.int32), got.view(torch.int32)
    # Nothing at or past a row end, nor in the row padding, is written.
    beyond = torch.ones(rows, stride, dtype=torch.bool, device=device)
    beyond[:, :width] = ~below
    kept = torch.equal(out_rows.view(torch.int32)[beyond], poison[beyond])
    if not (torch.equal(exp_bits[below], got_bits[below]) and kept):
        bad = int((exp_bits[below] != got_bits[below]).sum())
        return (
            f"rows {rows} width {width} stride {stride}: {bad} values differ, "
            f"untouched past the end {kept}"
        )
    return None


def test_upcast_logits_matches_stock():
    fuzz("upcast_logits", 1000, check_case)
