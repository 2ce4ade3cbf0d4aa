# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``expand_pools`` against the patched ``expand_pools_and_append_tail``
writing into a row slice of a wider buffer: the whole buffer byte for byte
(columns past the expansion must stay untouched)."""

import pytest
import torch
from kpool_fuzz import differs, fuzz, needs_cuda, poison

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


def seq_lens_for(rows: int, gen, dtype=torch.int32) -> torch.Tensor:
    """Every residue mod 4, zero and negative (padding) lengths; int64 ones
    also at and beyond the int32 range."""
    g = dict(generator=gen, device=gen.device)
    lens = torch.randint(0, 300_000, (rows,), **g)
    short = torch.randint(-9, 5, (rows,), **g)
    lens = torch.where(torch.rand(rows, **g) < 0.1, short, lens)
    if dtype == torch.int64:
        edge = torch.randint(2**31 - 6, 2**31 + 6, (rows,), **g)
        far = torch.randint(-(2**40), 2**40, (rows,), **g)
        pick = torch.rand(rows, **g)
        lens = torch.where(pick < 0.3, edge, torch.where(pick < 0.6, far, lens))
    else:
        edge = torch.randint(2**31 - 6, 2**31, (rows,), **g)
        lens = torch.where(torch.rand(rows, **g) < 0.1, edge, lens)
    return lens.to(dtype)


def check_case(rng, gen) -> str | None:
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )
    from vllm.models.glm5next.nvidia.specialized_decode.kpool import expand_pools

    device = gen.device
    rows = rng.choice([1, 2, 7, 8, 64, 128, 256, rng.randint(1, 256)])
    groups = rng.choice([0, 1, 31, 32, 100, 512, 1024, rng.randint(1, 1024)])
    out_cols = groups * POOL + POOL - 1
    # A wider buffer with more rows: the expansion is a row slice of it.
    width = out_cols + rng.choice([0, 1, 5, 128])
    width += -width % 4
    pool_ids = pool_ids_for(rows, groups, gen, rng)
    if rng.random() < 0.3:  # a row slice of a wider top-k buffer
        wide = torch.full((rows, groups + 64), -7, dtype=torch.int32, device=device)
        wide[:, :groups] = pool_ids
        pool_ids = wide[:, :groups]
    dtype = rng.choice([torch.int32, torch.int64])
    seq_lens = seq_lens_for(rows, gen, dtype)
    seq_offset = rng.choice([0, 1, 1, 3, -2])
    stock_out = poison((rows + 3, width), torch.int32, gen)
    ours_out = stock_out.clone()
    expand_pools_and_append_tail(
        pool_ids, seq_lens, POOL, seq_offset=seq_offset, out=stock_out[:rows]
    )
    got = expand_pools(
        pool_ids, seq_lens, POOL, seq_offset=seq_offset, out=ours_out[:rows]
    )
    torch.cuda.synchronize()
    problem = differs("out", stock_out, ours_out)
    if problem or got.data_ptr() != ours_out.data_ptr():
        return (
            f"rows {rows} groups {groups} width {width} {dtype} offset "
            f"{seq_offset}: {problem}"
        )
    return None


def test_expand_pools_matches_stock():
    fuzz("expand_pools", 1000, check_case)


def test_zero_pools_write_the_tail():
    """No pools: the three tail columns are still written, as stock does."""

    def zero(rng, gen):
        from vllm.models.glm5next.nvidia.ops.kpool_compress import (
            expand_pools_and_append_tail,
        )
        from vllm.models.glm5next.nvidia.specialized_decode.kpool import (
            expand_pools,
        )

        rows = rng.randint(1, 256)
        dtype = rng.choice([torch.int32, torch.int64])
        pool_ids = torch.empty(rows, 0, dtype=torch.int32, device=gen.device)
        seq_lens = seq_lens_for(rows, gen, dtype)
        stock_out = poison((rows, 4), torch.int32, gen)
        ours_out = stock_out.clone()
        expand_pools_and_append_tail(
            pool_ids, seq_lens, POOL, seq_offset=1, out=stock_out
        )
        expand_pools(pool_ids, seq_lens, POOL, seq_offset=1, out=ours_out)
        torch.cuda.synchronize()
        problem = differs("out", stock_out, ours_out)
        return f"rows {rows} {dtype}: {problem}" if problem else None

    fuzz("expand_pools zero pools", 50, zero)
