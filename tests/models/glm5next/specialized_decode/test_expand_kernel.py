# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pool expansion against the patched ``expand_pools_and_append_tail``,
the whole output buffer byte for byte (columns and rows past the expansion
must stay untouched), in one fuzz loop over both length arithmetics:

- ``expand_pools`` (``int32_lengths=False``): lengths computed in their own
  dtype, against stock on the same int32 or int64 lengths, into a row slice
  of a wider buffer;
- ``ExpandArgs(..., int32_lengths=True)``, the stage's decode expansion:
  int64 positions (at and beyond 2^31 - 1, far beyond it, negative)
  truncated to int32, against stock's decode itself,
  ``expand_pools_and_append_tail(pool_ids.to(torch.int64),
  positions.to(torch.int32) + 1, 4)`` (offset 1), or stock on the truncated
  lengths with the case's offset.

Pool ids: valid, -1, and ids whose int32 token ids wrap; zero pools (the
tail is still written), pool counts that are not powers of two, negative and
zero lengths, every residue mod 4."""

import pytest
import torch
from kpool_fuzz import differs, fuzz, poison

pytestmark = pytest.mark.gpu

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
    also at and beyond the int32 range (both signs)."""
    g = dict(generator=gen, device=gen.device)
    lens = torch.randint(0, 300_000, (rows,), **g)
    short = torch.randint(-9, 5, (rows,), **g)
    lens = torch.where(torch.rand(rows, **g) < 0.1, short, lens)
    if dtype == torch.int64:
        edge = torch.randint(2**31 - 6, 2**31 + 6, (rows,), **g)
        low = torch.randint(-(2**31) - 6, -(2**31) + 6, (rows,), **g)
        far = torch.randint(-(2**40), 2**40, (rows,), **g)
        pick = torch.rand(rows, **g)
        lens = torch.where(pick < 0.3, edge, torch.where(pick < 0.6, far, lens))
        lens = torch.where(pick > 0.95, low, lens)
    else:
        edge = torch.randint(2**31 - 6, 2**31, (rows,), **g)
        lens = torch.where(torch.rand(rows, **g) < 0.1, edge, lens)
    return lens.to(dtype)


def check_case(rng, gen) -> str | None:
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )
    from vllm.models.glm5next.nvidia.specialized_decode.expand_kernel import (
        EXPAND,
        ExpandArgs,
    )
    from vllm.models.glm5next.nvidia.specialized_decode.kpool import expand_pools

    device = gen.device
    int32_lengths = rng.random() < 0.5
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
    # The stage's decode expansion: int64 positions (int32 ones admitted
    # too), offset 1 (mostly).
    dtypes = [torch.int32, torch.int64] + [torch.int64] * (2 * int32_lengths)
    dtype = rng.choice(dtypes)
    seq_lens = seq_lens_for(rows, gen, dtype)
    offsets = [1, 1, 1, 0, 3, -2] if int32_lengths else [0, 1, 1, 3, -2]
    seq_offset = rng.choice(offsets)
    stock_out = poison((rows + 3, width), torch.int32, gen)
    ours_out = stock_out.clone()
    if not int32_lengths:
        expand_pools_and_append_tail(
            pool_ids, seq_lens, POOL, seq_offset=seq_offset, out=stock_out[:rows]
        )
        got = expand_pools(
            pool_ids, seq_lens, POOL, seq_offset=seq_offset, out=ours_out[:rows]
        )
    else:
        if seq_offset == 1:  # stock's decode, as it is written
            stock_out[:rows, :out_cols] = expand_pools_and_append_tail(
                pool_ids.to(torch.int64), seq_lens.to(torch.int32) + 1, POOL
            )
        else:
            expand_pools_and_append_tail(
                pool_ids,
                seq_lens.to(torch.int32),
                POOL,
                seq_offset=seq_offset,
                out=stock_out[:rows],
            )
        args = ExpandArgs(pool_ids, seq_lens, POOL, seq_offset, ours_out[:rows], True)
        got = EXPAND.run(args).out
    torch.cuda.synchronize()
    problem = differs("out", stock_out, ours_out)
    if problem or got.data_ptr() != ours_out.data_ptr():
        return (
            f"int32_lengths {int32_lengths} rows {rows} groups {groups} width "
            f"{width} {dtype} offset {seq_offset}: {problem}"
        )
    return None


def test_expand_pools_matches_stock():
    fuzz("expand_pools", 1500, check_case)
