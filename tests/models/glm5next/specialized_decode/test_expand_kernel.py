# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``expand_pools`` against the patched ``expand_pools_and_append_tail``
writing into a row slice of a wider buffer: the whole buffer byte for byte
(columns past the expansion must stay untouched)."""

import random

import pytest
import torch
from kpool_fuzz import fuzz_cases, fuzz_seed, needs_cuda, report

pytestmark = [pytest.mark.gpu, needs_cuda()]

POOL = 4


def pool_ids_for(rows: int, groups: int, gen, rng) -> torch.Tensor:
    """Pool ids as a top-k leaves them: valid ones, -1 for rows shorter than
    the top-k, and (adversarially) ids whose int32 token ids wrap."""
    g = dict(generator=gen, device=gen.device)
    ids = torch.randint(0, rng.choice([64, 4096, 1 << 20]), (rows, groups), **g)
    holes = torch.rand(rows, groups, **g) < rng.choice([0.0, 0.1, 0.5, 1.0])
    wraps = torch.rand(rows, groups, **g) < 0.01
    huge = torch.randint(1 << 29, (1 << 31) - 1, (rows, groups), **g)
    ids = torch.where(wraps, huge, torch.where(holes, -1, ids))
    return ids.to(torch.int32)


def seq_lens_for(rows: int, gen) -> torch.Tensor:
    """Every residue mod 4, zero and negative (padding) lengths."""
    g = dict(generator=gen, device=gen.device)
    lens = torch.randint(0, 300_000, (rows,), **g)
    short = torch.randint(-9, 5, (rows,), **g)
    return torch.where(torch.rand(rows, **g) < 0.1, short, lens).to(torch.int32)


def test_expand_pools_matches_stock():
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )
    from vllm.models.glm5next.nvidia.specialized_decode.kpool import expand_pools

    seed, cases = fuzz_seed(), fuzz_cases(1000)
    device = torch.device("cuda")
    failures = []
    for i in range(cases):
        rng = random.Random(seed + i)
        gen = torch.Generator(device).manual_seed(seed + i)
        rows = rng.choice([1, 2, 7, 8, 64, 128, 256, rng.randint(1, 256)])
        groups = rng.choice([1, 31, 32, 100, 512, 1024, rng.randint(1, 1024)])
        out_cols = groups * POOL + POOL - 1
        # A wider buffer with more rows: the expansion is a row slice of it.
        width = out_cols + rng.choice([0, 1, 5, 128])
        width += -width % 4
        pool_ids = pool_ids_for(rows, groups, gen, rng)
        if rng.random() < 0.3:  # a row slice of a wider top-k buffer
            wide = torch.full((rows, groups + 64), -7, dtype=torch.int32, device=device)
            wide[:, :groups] = pool_ids
            pool_ids = wide[:, :groups]
        seq_lens = seq_lens_for(rows, gen)
        seq_offset = rng.choice([0, 1])
        poison = torch.randint(
            -(2**31), 2**31 - 1, (rows + 3, width), generator=gen, device=device
        )
        stock_out = poison.to(torch.int32)
        ours_out = stock_out.clone()
        expand_pools_and_append_tail(
            pool_ids, seq_lens, POOL, seq_offset=seq_offset, out=stock_out[:rows]
        )
        got = expand_pools(
            pool_ids, seq_lens, POOL, seq_offset=seq_offset, out=ours_out[:rows]
        )
        torch.cuda.synchronize()
        if not torch.equal(stock_out, ours_out) or got.shape != (rows, out_cols):
            bad = (stock_out != ours_out).nonzero()
            failures.append(
                f"seed {seed + i}: rows {rows} groups {groups} width {width} "
                f"offset {seq_offset}: {bad.shape[0]} ids differ, "
                f"first {bad[:1].tolist()}"
            )
    report("expand_pools", cases, seed, failures)
