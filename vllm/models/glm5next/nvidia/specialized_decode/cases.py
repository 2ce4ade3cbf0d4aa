# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Randomized inputs of each kpool kernel and what its stock twin makes of
them: the one place the kernels' edge values and layouts are drawn. The
warmup self-check draws them in one compile key's layout (the deployment's);
the GPU tests draw the key too.

A ``Case`` holds the kernel's keyword arguments, every buffer the kernel may
write (whole: rows and columns past its outputs, poisoned, included), and
those buffers as the stock twin leaves them (computed when the case is
drawn, before any launch). The opt-in select has no stock twin of the same
bytes: its expected rows are its contract (``select_reference``)."""

import random
from dataclasses import dataclass

import torch

from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
from vllm.models.glm5next.nvidia.ops import kpool_compress
from vllm.v1.attention.backends.mla.sparse_utils import (
    triton_convert_req_index_to_global_index,
)

from .constants import DIM, POOL
from .cutedsl.expand.launch import EXPAND
from .cutedsl.remap.launch import REMAP
from .cutedsl.select.kernel import CAPACITIES, VECTOR
from .cutedsl.select.launch import CLUSTERS, SELECT, cluster_for, slice_capacity
from .cutedsl.upcast.launch import UPCAST
from .cutedsl.update.launch import UPDATE

SPECIALS = (float("inf"), -float("inf"), float("nan"), -0.0, 1e-40, -1e-39, 3e38)
# Written over every output buffer before a launch: no result is -7.
POISON = -7


@dataclass
class Case:
    arguments: dict
    written: tuple[torch.Tensor, ...]
    expected: tuple[torch.Tensor, ...]


def specials(values: torch.Tensor, rate: float, gen) -> torch.Tensor:
    """``values`` with a ``rate`` share replaced by ``SPECIALS``."""
    g = dict(generator=gen, device=values.device)
    where = torch.rand(values.shape, **g) < rate
    table = torch.tensor(SPECIALS, device=values.device)
    return torch.where(
        where, table[torch.randint(0, len(SPECIALS), values.shape, **g)], values
    )


def _poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, POISON, dtype=dtype, device=device)


# --- kpool_update --------------------------------------------------------------


def update_key(rng: random.Random):
    """A cache layout, scale format and index dtypes (rings, pages and
    paddings that are not powers of two included)."""
    ring, page = rng.choice([4, 8, 12, 16]), rng.choice([16, 32, 48, 64])
    tail_half = ring * DIM + 4 * rng.randint(0, 8)
    mx, round_scale = rng.choice(
        [(True, True), (True, False), (False, True), (False, False)]
    )
    return UPDATE.dispatch(
        ring=ring,
        page=page,
        page_bytes=page * (DIM + 4) + 4 * rng.randint(0, 4),
        tail_block=2 * tail_half + 4 * rng.randint(0, 32),
        tail_half=tail_half,
        mx_scales=mx,
        round_scale=round_scale,
        tail_slots_dtype=rng.choice([torch.int32, torch.int64]),
        slots_dtype=rng.choice([torch.int32, torch.int64]),
        positions_dtype=rng.choice([torch.int32, torch.int64]),
    )


def update_case(rng: random.Random, gen: torch.Generator, key=None) -> Case:
    """A decode step's tail update in ``key``'s cache layout (drawn if
    None): ordinary and FP8-saturating keys and scores, specials in keys,
    scores and the ring, padding rows (-1), int64 positions beyond int32."""
    key = key or update_key(rng)
    device = gen.device
    g = dict(generator=gen, device=device)
    requests, tokens = rng.randint(1, 8), rng.randint(1, 4)
    pages = requests * tokens // key.page + 2
    cache = torch.randint(0, 256, (pages * key.page_bytes,), dtype=torch.uint8, **g)
    blocks = requests + 2
    tail = torch.randn(blocks * key.tail_block, **g).to(torch.bfloat16)
    if rng.random() < 0.3:
        tail = specials(tail.float(), 0.01, gen).to(torch.bfloat16)
    wide = key.positions_dtype == torch.int64 and rng.random() < 0.3
    start = torch.randint(0, 4096, (requests, 1), **g) + (2**33 if wide else 0)
    positions = start + torch.arange(tokens, device=device)
    positions[torch.rand(requests, **g) < 0.1] = -1
    # Block 0 is no request's: a completion with tail slot -1 reads it.
    block = 1 + torch.randperm(blocks - 1, **g)[:requests, None]
    tail_slots = torch.where(
        positions >= 0, block * key.ring + positions % key.ring, -1
    )
    free = torch.randperm(pages * key.page, **g)[: requests * tokens]
    slots = torch.where(positions % POOL == POOL - 1, free.view(requests, tokens), -1)
    magnitude = 10.0 ** rng.choice([0, 4, -6, 30, 38])
    values = torch.randn(2, requests, tokens, DIM, **g) * magnitude
    if rng.random() < 0.3:
        values = specials(values, 0.02, gen)
    keys, scores = values.to(torch.bfloat16)
    arguments = dict(
        tail_slot_mapping=tail_slots.to(key.tail_slots_dtype),
        key=keys,
        slot_score=scores,
        ape=torch.randn(POOL, DIM, **g),
        slot_mapping=slots.to(key.slots_dtype),
        positions=positions.to(key.positions_dtype),
        pool_size=POOL,
        head_dim=DIM,
        round_scale=key.round_scale,
    )
    cache_view = ((pages, key.page, DIM + 4), (key.page_bytes, DIM + 4, 1))
    tail_view = ((blocks, 2, key.ring, DIM), (key.tail_block, key.tail_half, DIM, 1))
    want = (cache.clone(), tail.clone())
    stock_mx = kpool_compress.mqa_logits_use_mx_scales
    kpool_compress.mqa_logits_use_mx_scales = lambda: key.mx_scales
    try:
        kpool_compress.kpool_decode_update_and_maybe_write_cache_batched(
            want[0].as_strided(*cache_view), want[1].as_strided(*tail_view), **arguments
        )
    finally:
        kpool_compress.mqa_logits_use_mx_scales = stock_mx
    arguments.update(
        kv_cache=cache.as_strided(*cache_view),
        tail_kv_cache=tail.as_strided(*tail_view),
        mx_scales=key.mx_scales,
    )
    return Case(arguments, (cache, tail), want)


# --- expand_pools -----------------------------------------------------------------


def pool_ids(rows: int, groups: int, rng, gen, limit: int) -> torch.Tensor:
    """Pool ids below ``limit``, some -1, a few large enough to wrap the
    int32 token ids."""
    g = dict(generator=gen, device=gen.device)
    ids = torch.randint(0, max(limit, 1), (rows, groups), **g)
    ids[torch.rand(rows, groups, **g) < rng.choice([0.0, 0.1, 1.0])] = -1
    wraps = torch.rand(rows, groups, **g) < 0.01
    ids = torch.where(
        wraps, torch.randint(1 << 29, (1 << 31) - 1, (rows, groups), **g), ids
    )
    return ids.to(torch.int32)


def lengths(rows: int, dtype, gen) -> torch.Tensor:
    """Sequence lengths (or positions), negative ones and, in int64, some
    past the int32 edge."""
    g = dict(generator=gen, device=gen.device)
    values = torch.randint(-3, 1 << 18, (rows,), **g)
    if dtype == torch.int64:
        far = torch.randint(2**31 - 4, 2**33, (rows,), **g)
        values = torch.where(torch.rand(rows, **g) < 0.2, far, values)
    return values.to(dtype)


def expand_key(rng: random.Random):
    return EXPAND.dispatch(
        groups=rng.choice([0, 1, 32, 100, 128, 512, 1024]),
        seq_lens_dtype=rng.choice([torch.int32, torch.int64]),
        int32_lengths=rng.random() < 0.5,
    )


def expand_case(rng: random.Random, gen: torch.Generator, key=None) -> Case:
    """Pool ids into rows wider than the expansion, with rows past them."""
    key = key or expand_key(rng)
    device = gen.device
    rows = rng.randint(0, 16)
    stride = key.groups + rng.choice([0, 0, 3])
    ids = pool_ids(rows, stride, rng, gen, 1 << 16)[:, : key.groups]
    seq_lens = lengths(rows + rng.randint(0, 2), key.seq_lens_dtype, gen)
    width = key.groups * POOL + POOL + 4 * rng.randint(0, 2)
    out = _poisoned((rows + 2, width), torch.int32, device)
    want = out.clone()
    stock_lens = seq_lens.to(torch.int32) if key.int32_lengths else seq_lens
    kpool_compress.expand_pools_and_append_tail(
        ids, stock_lens[:rows], POOL, seq_offset=1, out=want[:rows]
    )
    arguments = dict(
        pool_ids=ids,
        seq_lens=seq_lens,
        pool_size=POOL,
        seq_offset=1,
        out=out[:rows],
        int32_lengths=key.int32_lengths,
    )
    return Case(arguments, (out,), (want,))


# --- expand_and_remap -------------------------------------------------------------


def remap_key(rng: random.Random):
    """A top-k shape, KV block layout and conversion: with counts the widths
    stock compacts in column order, without them wider rows too."""
    counts = rng.random() < 0.5
    groups = rng.choice([32, 64, 512] if counts else [32, 512, 1024])
    width = groups * POOL + POOL - 1
    width += -width % 128 + (0 if counts else 128 * rng.randint(0, 2))
    block = rng.choice([64, 64, 16, 4, 12])
    return REMAP.dispatch(
        groups=groups,
        width=width,
        block_size=block,
        stride_rows=block * rng.choice([1, 1, 2]),
        positions_dtype=rng.choice([torch.int32, torch.int64]),
        int32_lengths=rng.random() < 0.5,
        counts=counts,
    )


def remap_case(rng: random.Random, gen: torch.Generator, key=None) -> Case:
    """A conversion of expanded pools: rows past the expanded ones (-1),
    negative and past-the-table blocks, positions at the int32 edge."""
    key = key or remap_key(rng)
    device = gen.device
    g = dict(generator=gen, device=device)
    rows = rng.randint(1, 16)
    expanded = rows if rng.random() < 0.8 else rng.randint(0, rows)
    blocks = rng.choice([1, 8, 64])
    table = torch.randint(-4, 1 << 20, (rows, blocks), dtype=torch.int32, **g)
    ids = pool_ids(expanded, key.groups, rng, gen, blocks * key.block_size // POOL)
    positions = lengths(rows, key.positions_dtype, gen)
    req_ids = torch.randint(0, rows, (rows,), dtype=torch.int32, **g)
    out = _poisoned((rows + 2, key.width), torch.int32, device)
    counts = _poisoned((rows + 3,), torch.int32, device)
    want_out, want_counts = out.clone(), counts.clone()
    logical = torch.full((rows, key.width), -1, dtype=torch.int32, device=device)
    stock_positions = positions.to(torch.int32) if key.int32_lengths else positions
    if expanded:
        kpool_compress.expand_pools_and_append_tail(
            ids, stock_positions[:expanded], POOL, seq_offset=1, out=logical[:expanded]
        )
    triton_convert_req_index_to_global_index(
        req_ids,
        table,
        logical,
        BLOCK_SIZE=key.block_size,
        BLOCK_STRIDE_ROWS=key.stride_rows,
        NUM_TOPK_TOKENS=key.width,
        return_valid_counts=key.counts,
        out=want_out[:rows],
        valid_counts_out=want_counts[:rows] if key.counts else None,
    )
    arguments = dict(
        pool_ids=ids,
        positions=positions,
        pool_size=POOL,
        req_ids=req_ids,
        block_table=table,
        out=out[:rows],
        counts=counts[:rows] if key.counts else None,
        block_size=key.block_size,
        stride_rows=key.stride_rows,
        seq_offset=1,
        int32_lengths=key.int32_lengths,
    )
    return Case(arguments, (out, counts), (want_out, want_counts))


# --- upcast_logits ----------------------------------------------------------------


def upcast_case(rng: random.Random, gen: torch.Generator, key=None) -> Case:
    """BF16 logits with specials in strided rows, row ends anywhere in
    ``[0, width]``; the columns from each end on stay poisoned."""
    device = gen.device
    rows = rng.randint(1, 16)
    width = rng.choice([8, 1000, 4096, rng.randint(1, 9000)])
    stride = width + -width % 8 + 8 * rng.randint(0, 2)
    values = torch.randn(rows * stride, generator=gen, device=device) * 30
    values = specials(values, 0.01, gen).to(torch.bfloat16)
    logits = values.as_strided((rows, width), (stride, 1))
    ends = torch.randint(0, width + 1, (rows,), generator=gen, device=device)
    ends = ends.to(torch.int32)
    out = _poisoned((rows * stride,), torch.float32, device)
    want = out.clone()
    below = torch.arange(width, device=device)[None, :] < ends[:, None]
    # Only the columns below the ends: stock leaves the others unwritten.
    want.as_strided((rows, width), (stride, 1))[below] = as_fp32_logits(logits, ends)[
        below
    ]
    arguments = dict(
        logits=logits, row_ends=ends, out=out.as_strided((rows, width), (stride, 1))
    )
    return Case(arguments, (out,), (want,))


# --- select_topk ------------------------------------------------------------------


def select_reference(logits: torch.Tensor, ends: torch.Tensor, k: int):
    """The select's contract by sorting: per row the columns below
    ``clamp(end, 0, width)``, all of them then -1 if at most ``k``, else the
    ``k`` largest order keys, ties to the lower column, in ascending column
    order."""
    rows, width = logits.shape
    if logits.dtype == torch.bfloat16:
        bits, sign, full = logits.view(torch.int16).long() & 0xFFFF, 1 << 15, 0xFFFF
    else:
        bits = logits.view(torch.int32).long() & 0xFFFFFFFF
        sign, full = 1 << 31, 0xFFFFFFFF
    keys = torch.where(bits & sign != 0, full - bits, bits | sign)
    ends = ends[:rows].long().clamp(0, width)
    columns = torch.arange(width, device=logits.device)
    keys = torch.where(columns[None, :] < ends[:, None], keys, -1)
    top = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :k]
    top = torch.nn.functional.pad(torch.sort(top, dim=1).values, (0, k - top.shape[1]))
    slots = torch.arange(k, device=logits.device)
    short = torch.where(slots[None, :] < ends[:, None], slots[None, :], -1)
    return torch.where((ends > k)[:, None], top, short).to(torch.int32)


def select_shapes(key, sms: int) -> list[tuple[int, int]]:
    """(rows, width) pairs whose select key is ``key``: widths whose slices
    fill the key's capacity from just above the next smaller one to all of
    it, each with the row counts that choose its cluster size, at most 2^23
    logits a case (the fewest rows where none is that small)."""
    vector = VECTOR[key.dtype]
    capacities = (0, *CAPACITIES)
    below = capacities[capacities.index(key.capacity) - 1]
    spans = {key.capacity, below + vector, (below + key.capacity) // 2}
    shapes = []
    for span in sorted(spans):
        width = span * key.cluster
        for rows in range(1, 257):
            if (
                cluster_for(rows, width, key.dtype, sms) == key.cluster
                and slice_capacity(width, key.dtype, key.cluster) == key.capacity
            ):
                shapes.append((rows, width))
    small = [(rows, width) for rows, width in shapes if rows * width <= 1 << 23]
    return small or sorted(shapes)[:1] or [(1, key.capacity * key.cluster)]


def select_key(rng: random.Random, sms: int):
    dtype = rng.choice([torch.float32, torch.bfloat16])
    rows = rng.choice([1, 2, 8, 32, 64])
    width = rng.choice([1000, 4096, 65536, rng.randint(1, CLUSTERS[-1] * 40000)])
    width = width + -width % VECTOR[dtype]
    return SELECT.dispatch(
        k=rng.choice([512, 256, 1]), dtype=dtype, rows=rows, width=width, sms=sms
    )


def select_case(
    rng: random.Random, gen: torch.Generator, key=None, *, sms: int = 132
) -> Case:
    """Logits of ``key``'s shapes on ``sms`` SMs: ties across the threshold,
    specials, row ends at the edges of ``k`` and past the width."""
    key = key or select_key(rng, sms)
    device = gen.device
    rows, width = rng.choice(select_shapes(key, sms))
    scale = rng.choice([1e-3, 1.0, 1e4])
    values = torch.randn(rows * width, generator=gen, device=device) * scale
    if rng.random() < 0.5:  # ties across the threshold
        values = values.round()
    logits = specials(values, 0.01, gen).to(key.dtype).view(rows, width)
    edges = [0, 1, key.k - 1, key.k, key.k + 1, width, width + 7, -1]
    ends = [
        rng.choice(edges) if rng.random() < 0.5 else rng.randint(0, width)
        for _ in range(rows)
    ]
    ends = torch.tensor(ends, dtype=torch.int32, device=device)
    out = _poisoned((rows + 2, key.k), torch.int32, device)
    want = out.clone()
    want[:rows] = select_reference(logits, ends, key.k)
    arguments = dict(logits=logits, ends=ends, k=key.k, out=out[:rows])
    return Case(arguments, (out,), (want,))


CASES = {
    UPDATE: update_case,
    EXPAND: expand_case,
    REMAP: remap_case,
    UPCAST: upcast_case,
    SELECT: select_case,
}
