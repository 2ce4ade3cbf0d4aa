# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``expand_and_remap`` against the stock decode chain it fuses: the -1 fill
of the logical top-k rows, ``expand_pools_and_append_tail`` of the pool top-k
into them, and ``triton_convert_req_index_to_global_index`` with counts (the
compacted rows) or without (in place): physical indices and counts byte for
byte, outputs poisoned first."""

import pytest
import torch
from kpool_fuzz import differs, fuzz, needs_cuda, poison
from test_expand_kernel import pool_ids_for, seq_lens_for

pytestmark = [pytest.mark.gpu, needs_cuda()]

POOL = 4
# (pools, logical width): GLM-5-Next's 512 pools in 2176 columns, the extremes
# (992 pools fill 4096 columns; 1024 need 8192, a single tile with counts) and
# slack; widths are whole stock tiles of 128 columns.
SHAPES = [(32, 256), (96, 512), (512, 2176), (512, 2560), (992, 4096), (1024, 8192)]
# (block size, rows between blocks): not powers of two and stride_rows !=
# block_size included.
BLOCKS = [(4, 4), (12, 12), (16, 48), (48, 52), (64, 64), (64, 128), (256, 256)]


def stock_chain(
    pool_ids,
    positions,
    req_ids,
    block_table,
    rows,
    width,
    block_size,
    stride_rows,
    counts,
):
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )
    from vllm.v1.attention.backends.mla.sparse_utils import (
        triton_convert_req_index_to_global_index,
    )

    logical = torch.full((rows, width), -1, dtype=torch.int32, device=pool_ids.device)
    expanded = pool_ids.shape[0]
    if expanded:
        expand_pools_and_append_tail(
            pool_ids, positions[:expanded], POOL, seq_offset=1, out=logical[:expanded]
        )
    return triton_convert_req_index_to_global_index(
        req_ids,
        block_table,
        logical,
        BLOCK_SIZE=block_size,
        BLOCK_STRIDE_ROWS=stride_rows,
        NUM_TOPK_TOKENS=width,
        return_valid_counts=counts,
    )


def check_case(rng, gen, *, counts=None, positions_dtype=None) -> str | None:
    from vllm.models.glm5next.nvidia.specialized_decode.kpool import expand_and_remap

    device = gen.device
    g = dict(generator=gen, device=device)
    counts = rng.random() < 0.5 if counts is None else counts
    rows = rng.choice([1, 2, 8, 64, 255, 256, rng.randint(1, 256)])
    # Rows from `expanded` on (CUDA-graph padding) read as -1.
    expanded = rows if rng.random() < 0.7 else rng.randint(0, rows)
    # Few (groups, width) and block layouts: each is a stock compile.
    groups, width = rng.choice(SHAPES)
    block_size, stride_rows = rng.choice(BLOCKS)
    requests = rng.randint(1, 64)
    max_blocks = rng.choice([1, 8, 100, 5000])
    block_table = torch.randint(
        0, 10_000, (requests, max_blocks + rng.choice([0, 3])), **g
    ).to(torch.int32)[:, :max_blocks]
    if rng.random() < 0.2:  # negative entries map to negative slots
        block_table[torch.rand(block_table.shape, **g) < 0.1] *= -1
    req_ids = torch.randint(0, requests, (rows,), **g).to(torch.int32)
    pool_ids = pool_ids_for(expanded, groups, gen, rng)
    # Pools past the request's blocks are invalid: keep some in range.
    in_range = (max_blocks * block_size) // POOL
    near = (torch.rand(expanded, groups, **g) < 0.5) & (pool_ids >= 0)
    pool_ids = torch.where(near, pool_ids % max(in_range, 1), pool_ids)
    dtype = positions_dtype or rng.choice([torch.int32, torch.int64])
    positions = torch.randint(-3, max_blocks * block_size + 64, (rows,), **g)
    if positions_dtype or rng.random() < 0.2:  # the int32 edge, and beyond
        positions = seq_lens_for(rows, gen, dtype).long() - 1
    positions = positions.to(dtype)
    stock = stock_chain(
        pool_ids,
        positions,
        req_ids,
        block_table,
        rows,
        width,
        block_size,
        stride_rows,
        counts,
    )
    stock_out, stock_counts = stock if counts else (stock, None)
    out = poison((rows, width), torch.int32, gen)
    got_counts = poison((rows + 2,), torch.int32, gen) if counts else None
    expand_and_remap(
        pool_ids,
        positions,
        POOL,
        req_ids,
        block_table,
        out,
        got_counts,
        block_size=block_size,
        stride_rows=stride_rows,
    )
    torch.cuda.synchronize()
    problems = [differs("out", stock_out, out)]
    if counts:
        problems.append(differs("counts", stock_counts, got_counts[:rows]))
    problems = [p for p in problems if p]
    if problems:
        return (
            f"counts {counts} rows {rows}/{expanded} groups {groups} width {width} "
            f"block {block_size}x{stride_rows} blocks {max_blocks} {dtype}: {problems}"
        )
    return None


def test_expand_and_remap_matches_stock():
    fuzz("expand_and_remap", 1000, check_case)


@pytest.mark.parametrize("counts", [True, False])
def test_int64_positions_beyond_int32(counts):
    """The tail of int64 positions past 2^31 is computed in int64 and
    truncated to the int32 logical rows, as stock's expansion stores it."""

    def case(rng, gen):
        return check_case(rng, gen, counts=counts, positions_dtype=torch.int64)

    fuzz(f"expand_and_remap int64 positions counts {counts}", 200, case)
