# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``expand_and_remap`` against the stock decode chain it fuses: the -1 fill
of the logical top-k rows, ``expand_pools_and_append_tail`` of the pool top-k
into them, and ``triton_convert_req_index_to_global_index(...,
return_valid_counts=True)``: physical indices and counts byte for byte."""

import random

import pytest
import torch
from kpool_fuzz import fuzz_cases, fuzz_seed, needs_cuda, report
from test_kpool_expand import pool_ids_for

pytestmark = [pytest.mark.gpu, needs_cuda()]

POOL = 4
# (pools, logical width): GLM-5-Next's 512 pools in 2176 columns, the extremes
# (992 pools fill 4096 columns; 1024 need the single-tile 8192), and slack.
SHAPES = [(32, 256), (96, 512), (512, 2176), (512, 2560), (992, 4096), (1024, 8192)]
# (block size, rows between blocks): stride_rows != block_size included.
BLOCKS = [(4, 4), (16, 48), (64, 64), (64, 128), (256, 256)]


def stock_chain(pool_ids, positions, req_ids, block_table, rows, width, block_size,
                stride_rows):  # fmt: skip
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
        req_ids, block_table, logical, BLOCK_SIZE=block_size,
        BLOCK_STRIDE_ROWS=stride_rows, NUM_TOPK_TOKENS=width, return_valid_counts=True,
    )  # fmt: skip


def test_expand_and_remap_matches_stock():
    from vllm.models.glm5next.nvidia.specialized_decode.kpool import (
        expand_and_remap,
        stock_compacts_in_order,
    )

    assert all(stock_compacts_in_order(width) for _, width in SHAPES)

    seed, cases = fuzz_seed(), fuzz_cases(1000)
    device = torch.device("cuda")
    failures = []
    for i in range(cases):
        rng = random.Random(seed + i)
        gen = torch.Generator(device).manual_seed(seed + i)
        g = dict(generator=gen, device=device)
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
        req_ids = torch.randint(0, requests, (rows,), **g).to(torch.int32)
        pool_ids = pool_ids_for(expanded, groups, gen, rng)
        # Pools past the request's blocks are invalid: keep some in range.
        in_range = (max_blocks * block_size) // POOL
        near = (torch.rand(expanded, groups, **g) < 0.5) & (pool_ids >= 0)
        pool_ids = torch.where(near, pool_ids % max(in_range, 1), pool_ids)
        positions = torch.randint(-3, max_blocks * block_size + 64, (rows,), **g)
        positions = positions.to(rng.choice([torch.int32, torch.int64]))
        stock_out, stock_counts = stock_chain(
            pool_ids, positions, req_ids, block_table, rows, width, block_size,
            stride_rows,
        )  # fmt: skip
        out = torch.randint(-(2**31), 2**31 - 1, (rows, width), **g).to(torch.int32)
        counts = torch.randint(-99, 99, (rows + 2,), dtype=torch.int32, **g)
        expand_and_remap(
            pool_ids, positions, POOL, req_ids, block_table, out, counts,
            block_size=block_size, stride_rows=stride_rows,
        )  # fmt: skip
        torch.cuda.synchronize()
        if not (
            torch.equal(stock_out, out) and torch.equal(stock_counts, counts[:rows])
        ):
            bad = (stock_out != out).nonzero()
            failures.append(
                f"seed {seed + i}: rows {rows}/{expanded} groups {groups} width "
                f"{width} block {block_size}x{stride_rows} blocks {max_blocks}: "
                f"{bad.shape[0]} ids differ (first {bad[:1].tolist()}), counts "
                f"equal {torch.equal(stock_counts, counts[:rows])}"
            )
    report("expand_and_remap", cases, seed, failures)
