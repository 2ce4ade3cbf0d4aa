# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stage's self-check at the JIT warmup: on the deployment's own GPU,
every compiled kernel variant and its stock twin run on ``CASES`` randomized
cases each, in the deployment's layouts (cache page and stride, tail ring,
KV block size and stride, index dtypes, top-k width), with the edge values
the rules admit (NaN, +-inf, -0.0, denormals, FP8 saturation, overflowing
pools, ties, -1 and wrapping pool ids, int64 positions beyond int32,
negative block-table entries, zero and padded rows). Outputs go to scratch
buffers poisoned first; the comparison is byte for byte, with one sync at
the end. The opt-in select has no stock twin of the same bytes: its cases
compare with ``select_reference``, its contract computed by sorting.

``check(keys, seed)`` returns the first mismatch as "kernel case N (seed S):
what" or None. ``KpoolStage`` then stays off and the decode runs stock."""

import random

import torch

from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
from vllm.models.glm5next.nvidia.ops import kpool_compress
from vllm.models.glm5next.nvidia.specialized_decode import (
    expand_kernel,
    remap_kernel,
    select_kernel,
    upcast_kernel,
    update_kernel,
)
from vllm.models.glm5next.nvidia.specialized_decode.constants import DIM, POOL
from vllm.models.glm5next.nvidia.specialized_decode.jit import Refused
from vllm.v1.attention.backends.mla.sparse_utils import (
    triton_convert_req_index_to_global_index,
)

CASES = 64
SPECIALS = (float("inf"), -float("inf"), float("nan"), -0.0, 1e-40, 3e38)


def check(keys, seed: int, device, cases: int = CASES) -> str | None:
    """Runs ``cases`` cases of each (kernel, compile key) in ``keys``; the
    first case whose bytes differ from stock, or None."""
    results = []
    for kernel, key in keys:
        name = type(kernel).__name__
        for case in range(cases):
            rng = random.Random(seed + case)
            gen = torch.Generator(device).manual_seed(seed + case)
            try:
                got, want = _CASES[name](kernel, key, rng, gen)
            except _NotLaunched as error:
                return f"{name} case {case} (seed {seed + case}): {error}"
            flags = [_differs(g, w) for g, w in zip(got, want, strict=True)]
            results.append((name, key, case, torch.stack(flags).any()))
    if not results:
        return None
    bad = torch.stack([r[3] for r in results]).tolist()  # the one sync
    for (name, key, case, _), differs in zip(results, bad, strict=True):
        if differs:
            return f"{name} case {case} (seed {seed + case}) differs from stock: {key}"
    return None


class _NotLaunched(Exception):
    """A case the kernel would not launch with its key."""


def _launch(kernel, key, args) -> None:
    """Launches ``args`` as the stage would, after checking that the
    kernel's own derivation gives them ``key``."""
    try:
        derived = kernel.key_for(args)
    except Refused as error:
        raise _NotLaunched(f"refused: {error}") from error
    if derived != key:
        raise _NotLaunched(f"derives {derived}, not {key}")
    if kernel.run_if_ready(args) is None:
        raise _NotLaunched(f"{key} is not compiled")


def _differs(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    a = got.contiguous().view(torch.uint8)
    b = want.contiguous().view(torch.uint8)
    return (a != b).any()


def _specials(values: torch.Tensor, rate: float, gen) -> torch.Tensor:
    g = dict(generator=gen, device=values.device)
    where = torch.rand(values.shape, **g) < rate
    table = torch.tensor(SPECIALS, device=values.device)
    return torch.where(
        where, table[torch.randint(0, len(SPECIALS), values.shape, **g)], values
    )


def _update(kernel, key, rng, gen):
    """Update cases in the key's cache layout (a few pages and tail blocks
    with the deployment's strides)."""
    device = gen.device
    g = dict(generator=gen, device=device)
    requests, tokens = rng.randint(1, 8), rng.randint(1, 4)
    pages = requests * tokens // key.page + 2
    page_elems = key.page_bytes
    cache = torch.randint(0, 256, (pages * page_elems,), dtype=torch.uint8, **g)
    blocks = requests + 2
    tail = torch.randn(blocks * key.tail_block, **g).to(torch.bfloat16)
    if rng.random() < 0.3:
        tail = _specials(tail.float(), 0.01, gen).to(torch.bfloat16)
    wide = key.positions_dtype == torch.int64 and rng.random() < 0.3
    start = torch.randint(0, 4096, (requests, 1), **g) + (2**33 if wide else 0)
    positions = start + torch.arange(tokens, device=device)
    positions[torch.rand(requests, **g) < 0.1] = -1
    block = 1 + torch.randperm(blocks - 1, **g)[:requests, None]
    tail_slots = torch.where(
        positions >= 0, block * key.ring + positions % key.ring, -1
    )
    free = torch.randperm(pages * key.page, **g)[: requests * tokens]
    slots = torch.where(positions % POOL == POOL - 1, free.view(requests, tokens), -1)
    magnitude = 10.0 ** rng.choice([0, 4, -6, 30, 38])
    values = torch.randn(2, requests, tokens, DIM, **g) * magnitude
    if rng.random() < 0.3:
        values = _specials(values, 0.02, gen)
    keys, scores = values.to(torch.bfloat16)
    ape = torch.randn(POOL, DIM, **g)
    args = (
        tail_slots.to(key.tail_slots_dtype),
        keys,
        scores,
        ape,
        slots.to(key.slots_dtype),
        positions.to(key.positions_dtype),
    )
    cache_shape = ((pages, key.page, DIM + 4), (key.page_bytes, DIM + 4, 1))
    tail_shape = ((blocks, 2, key.ring, DIM), (key.tail_block, key.tail_half, DIM, 1))
    caches = []
    for _ in range(2):
        c, t = cache.clone(), tail.clone()
        caches.append((c, t, c.as_strided(*cache_shape), t.as_strided(*tail_shape)))
    flags = (POOL, DIM, key.mx_scales, key.round_scale)
    _launch(
        kernel, key, update_kernel.UpdateArgs(caches[0][2], caches[0][3], *args, *flags)
    )
    kpool_compress.kpool_decode_update_and_maybe_write_cache_batched(
        caches[1][2], caches[1][3], *args, POOL, DIM, round_scale=key.round_scale
    )
    return (caches[0][0], caches[0][1]), (caches[1][0], caches[1][1])


def _pool_ids(rows, groups, rng, gen, limit):
    g = dict(generator=gen, device=gen.device)
    ids = torch.randint(0, max(limit, 1), (rows, groups), **g)
    ids[torch.rand(rows, groups, **g) < rng.choice([0.0, 0.1, 1.0])] = -1
    wraps = torch.rand(rows, groups, **g) < 0.01
    ids = torch.where(
        wraps, torch.randint(1 << 29, (1 << 31) - 1, (rows, groups), **g), ids
    )
    return ids.to(torch.int32)


def _lengths(rows, dtype, gen):
    g = dict(generator=gen, device=gen.device)
    lengths = torch.randint(-3, 1 << 18, (rows,), **g)
    if dtype == torch.int64:
        far = torch.randint(2**31 - 4, 2**33, (rows,), **g)
        lengths = torch.where(torch.rand(rows, **g) < 0.2, far, lengths)
    return lengths.to(dtype)


def _expand(kernel, key, rng, gen):
    rows = rng.randint(1, 16)
    ids = _pool_ids(rows, key.groups, rng, gen, 1 << 16)
    lengths = _lengths(rows, key.seq_lens_dtype, gen)
    width = key.groups * POOL + POOL + 4 * rng.randint(0, 2)
    outs = [
        torch.full((rows, width), -7, dtype=torch.int32, device=gen.device)
        for _ in range(2)
    ]
    _launch(
        kernel,
        key,
        expand_kernel.ExpandArgs(ids, lengths, POOL, 1, outs[0], key.int32_lengths),
    )
    if key.int32_lengths:
        lengths = lengths.to(torch.int32)
    kpool_compress.expand_pools_and_append_tail(
        ids, lengths, POOL, seq_offset=1, out=outs[1]
    )
    return (outs[0],), (outs[1],)


def _remap(kernel, key, rng, gen):
    device = gen.device
    g = dict(generator=gen, device=device)
    rows = rng.randint(1, 16)
    expanded = rows if rng.random() < 0.8 else rng.randint(0, rows)
    blocks = rng.choice([1, 8, 64])
    table = torch.randint(-4, 1 << 20, (rows, blocks), dtype=torch.int32, **g)
    ids = _pool_ids(expanded, key.groups, rng, gen, blocks * key.block_size // POOL)
    positions = _lengths(rows, key.positions_dtype, gen)
    req_ids = torch.randint(0, rows, (rows,), dtype=torch.int32, **g)
    out = torch.full((rows, key.width), -7, dtype=torch.int32, device=device)
    counts = torch.full((rows,), -7, dtype=torch.int32, device=device)
    args = remap_kernel.RemapArgs(
        ids,
        positions,
        POOL,
        req_ids,
        table,
        out,
        counts if key.counts else None,
        key.block_size,
        key.stride_rows,
        1,
        key.int32_lengths,
    )
    _launch(kernel, key, args)
    logical = torch.full((rows, key.width), -1, dtype=torch.int32, device=device)
    if key.int32_lengths:
        positions = positions.to(torch.int32)
    if expanded:
        kpool_compress.expand_pools_and_append_tail(
            ids, positions[:expanded], POOL, seq_offset=1, out=logical[:expanded]
        )
    stock = triton_convert_req_index_to_global_index(
        req_ids,
        table,
        logical,
        BLOCK_SIZE=key.block_size,
        BLOCK_STRIDE_ROWS=key.stride_rows,
        NUM_TOPK_TOKENS=key.width,
        return_valid_counts=key.counts,
    )
    if key.counts:
        return (out, counts), stock
    return (out,), (stock,)


def _upcast(kernel, key, rng, gen):
    device = gen.device
    rows, width = rng.randint(1, 16), rng.choice([8, 1000, 4096, rng.randint(1, 9000)])
    stride = width + -width % 8 + 8 * rng.randint(0, 2)
    values = _specials(
        torch.randn(rows * stride, generator=gen, device=device) * 30, 0.01, gen
    )
    logits = values.to(torch.bfloat16).as_strided((rows, width), (stride, 1))
    ends = torch.randint(0, width + 1, (rows,), generator=gen, device=device)
    ends = ends.to(torch.int32)
    out = torch.empty_strided(
        (rows, width), (stride, 1), dtype=torch.float32, device=device
    )
    _launch(kernel, key, upcast_kernel.UpcastArgs(logits, ends, out))
    want = as_fp32_logits(logits, ends)
    below = torch.arange(width, device=device)[None, :] < ends[:, None]
    return (out.view(torch.int32)[below],), (want.view(torch.int32)[below],)


def select_reference(logits: torch.Tensor, ends: torch.Tensor, k: int):
    """The select's contract (``select_kernel``) by sorting: per row the
    columns below ``clamp(end, 0, width)``, all of them then -1 if at most
    ``k``, else the ``k`` largest order keys, ties to the lower column, in
    ascending column order. The select has no stock twin of the same bytes."""
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


def _select_shapes(key, sms: int) -> list[tuple[int, int]]:
    """(rows, width) pairs whose select key is ``key``: widths whose slices
    fill the key's capacity from just above the next smaller one to all of
    it, each with the row counts that choose its cluster size, at most 2^23
    logits a case (the fewest rows where none is that small)."""
    vector = 4 if key.dtype == torch.float32 else 8
    capacities = (0, *select_kernel.CAPACITIES)
    below = capacities[capacities.index(key.capacity) - 1]
    spans = {key.capacity, below + vector, (below + key.capacity) // 2}
    shapes = []
    for span in sorted(spans):
        width = span * key.cluster
        for rows in range(1, 257):
            if (
                select_kernel.cluster_for(rows, width, key.dtype, sms) == key.cluster
                and select_kernel.slice_capacity(width, key.dtype, key.cluster)
                == key.capacity
            ):
                shapes.append((rows, width))
    small = [(rows, width) for rows, width in shapes if rows * width <= 1 << 23]
    return small or sorted(shapes)[:1] or [(1, key.capacity * key.cluster)]


def _select(kernel, key, rng, gen):
    device = gen.device
    rows, width = rng.choice(_select_shapes(key, select_kernel.sm_count(device)))
    scale = rng.choice([1e-3, 1.0, 1e4])
    values = torch.randn(rows * width, generator=gen, device=device) * scale
    if rng.random() < 0.5:  # ties across the threshold
        values = values.round()
    logits = _specials(values, 0.01, gen).to(key.dtype).view(rows, width)
    edges = [0, 1, key.k - 1, key.k, key.k + 1, width, width + 7, -1]
    ends = [
        rng.choice(edges) if rng.random() < 0.5 else rng.randint(0, width)
        for _ in range(rows)
    ]
    ends = torch.tensor(ends, dtype=torch.int32, device=device)
    out = torch.empty((rows, key.k), dtype=torch.int32, device=device)
    _launch(kernel, key, select_kernel.SelectArgs(logits, ends, key.k, out))
    return (out,), (select_reference(logits, ends, key.k),)


_CASES = {
    type(update_kernel.UPDATE).__name__: _update,
    type(expand_kernel.EXPAND).__name__: _expand,
    type(remap_kernel.REMAP).__name__: _remap,
    type(upcast_kernel.UPCAST).__name__: _upcast,
    type(select_kernel.SELECT).__name__: _select,
}
