# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused expand + remap against the stock decode chain it fuses: the -1
fill of the logical top-k rows, ``expand_pools_and_append_tail`` of the pool
top-k into them, and ``triton_convert_req_index_to_global_index`` with counts
(the compacted rows) or without (in place): physical indices and counts byte
for byte, outputs poisoned first. One fuzz loop over both length arithmetics:

- ``expand_and_remap`` (``int32_lengths=False``): positions + 1 in their own
  dtype, the stock chain on the same int32 or int64 positions (``seq_offset
  1``);
- ``RemapArgs(..., int32_lengths=True)``, the ``FusedRemap`` of a deferred
  decode step: int64 positions (at and beyond 2^31 - 1, far beyond it,
  negative) against stock's decode itself,
  ``expand_pools_and_append_tail(pool_ids.to(torch.int64),
  positions.to(torch.int32) + 1, 4)``, then the conversion.

Rows past the expanded ones (CUDA-graph padding) read as -1; negative block
table entries, block sizes and strides that are not powers of two."""

import pytest
import torch
from kpool_fuzz import differs, fuzz, poison
from test_expand_kernel import pool_ids_for, seq_lens_for

pytestmark = pytest.mark.gpu

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
    int32_lengths,
):
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )
    from vllm.v1.attention.backends.mla.sparse_utils import (
        triton_convert_req_index_to_global_index,
    )

    logical = torch.full((rows, width), -1, dtype=torch.int32, device=pool_ids.device)
    expanded = pool_ids.shape[0]
    if expanded and int32_lengths:  # stock's decode, as it is written
        cols = pool_ids.shape[1] * POOL + POOL - 1
        logical[:expanded, :cols] = expand_pools_and_append_tail(
            pool_ids.to(torch.int64), positions[:expanded].to(torch.int32) + 1, POOL
        )
    elif expanded:
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


def check_case(rng, gen) -> str | None:
    from vllm.models.glm5next.nvidia.specialized_decode.kpool import expand_and_remap
    from vllm.models.glm5next.nvidia.specialized_decode.remap_kernel import (
        REMAP,
        RemapArgs,
    )

    device = gen.device
    g = dict(generator=gen, device=device)
    counts = rng.random() < 0.5
    int32_lengths = rng.random() < 0.5
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
    # The fused remap's positions are the model runner's (int64).
    dtype = torch.int64 if int32_lengths else rng.choice([torch.int32, torch.int64])
    positions = torch.randint(-3, max_blocks * block_size + 64, (rows,), **g)
    if rng.random() < (0.5 if dtype == torch.int64 else 0.2):  # the int32 edge
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
        int32_lengths,
    )
    stock_out, stock_counts = stock if counts else (stock, None)
    out = poison((rows, width), torch.int32, gen)
    got_counts = poison((rows + 2,), torch.int32, gen) if counts else None
    if int32_lengths:
        args = (pool_ids, positions, POOL, req_ids, block_table, out, got_counts)
        REMAP.run(RemapArgs(*args, block_size, stride_rows, 1, int32_lengths=True))
    else:
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
            f"int32_lengths {int32_lengths} counts {counts} rows {rows}/{expanded} "
            f"groups {groups} width {width} block {block_size}x{stride_rows} "
            f"blocks {max_blocks} {dtype}: {problems}"
        )
    return None


def test_expand_and_remap_matches_stock():
    fuzz("expand_and_remap", 1500, check_case)
