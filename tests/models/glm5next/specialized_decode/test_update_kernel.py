# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``kpool_update`` against ``kpool_decode_update_and_maybe_write_cache_batched``:
the whole FP8 cache (values, scales, untouched pages) and the whole tail cache,
byte for byte, for MX scales (rounded or not asked) and both FP32 roundings.

One fuzz loop draws per request how its keys and scores look (ordinary, FP8
saturation, the 1e-4 amax floor, ties across pool members, softmax underflow,
magnitudes per pool slot, FP32 overflow of the pooled sum and the Hadamard,
NaN, +-inf, -0.0 and denormals, in keys, scores, the ring and APE), and per
case an edge: infinite keys or finite keys whose pooled value overflows FP32
(stock's scale is +inf, MX byte 0xFF, and the FP8 values follow from it), or
int64 positions shifted past 2^32 (padding rows' -1 included); positions at
and beyond the int32 edge, rings, pages and blocks that are not powers of
two."""

import pytest
import torch
from kpool_fuzz import differs, fuzz

pytestmark = pytest.mark.gpu

DIM, POOL = 128, 4
# (ring, page, page padding bytes, tail block padding elements): few layouts,
# so the stock kernel compiles few variants; 12 and 48 are not powers of two.
LAYOUTS = [(4, 64, 0, 0), (8, 16, 16, 0), (16, 32, 4, 512), (12, 48, 8, 128)]
# (MX scales, round_scale): SM100's UE8M0 bytes (round_scale=False asked too:
# MX always rounds), Hopper's FP32 scales.
SCALES = [(True, True), (True, False), (False, True), (False, False)]
MODES = [
    "normal",
    "huge",
    "tiny",
    "zeros",
    "ties",
    "sharp",
    "slots",
    "overflow",
    "special",
]
SPECIALS = [float("inf"), -float("inf"), float("nan"), -0.0, 1e-40, -1e-39, 3e38]
# Per case (weights): none, infinite keys, keys whose pooled value or
# Hadamard sum overflows FP32, int64 positions shifted by multiples of 2^32.
EDGES = {"none": 7, "inf key": 1, "overflow": 1, "far": 1}
# First positions of a request: small, at the int32 edge, beyond it (int64).
STARTS = [
    (0, 5000),
    (2**31 - 6, 2**31 - 1),
    (2**32 - 3, 2**32 + 9),
    (2**40, 2**40 + 99),
]


def _specials(shape, rate: float, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(where, values): a ``rate`` share of ``shape`` replaced by specials."""
    g = dict(generator=gen, device=gen.device)
    where = torch.rand(shape, **g) < rate
    table = torch.tensor(SPECIALS, device=gen.device)
    return where, table[torch.randint(0, len(SPECIALS), shape, **g)]


def _values(modes, shape, gen):
    """Keys and scores of ``shape`` [requests, tokens, dim], request ``r``'s
    drawn as ``modes[r]`` says."""
    g = dict(generator=gen, device=gen.device)
    key, score = torch.randn(shape, **g), torch.randn(shape, **g)
    mode = torch.tensor([MODES.index(m) for m in modes], device=gen.device)
    mode = mode[:, None, None]
    scale = torch.tensor([1, 3e4, 1e-7, 0, 1, 1, 1, 3e38, 1], device=gen.device)
    key = key * scale[mode].float()
    # Magnitudes per pool slot: each token its own power of ten.
    per_token = 10.0 ** torch.randint(-30, 30, shape[:2], **g).float()[..., None]
    key = torch.where(mode == MODES.index("slots"), key * per_token, key)
    score = torch.where(mode == MODES.index("sharp"), score * 60, score)
    ties = mode == MODES.index("ties")
    key = torch.where(ties, key[:, :1], key)
    score = torch.where(ties, score[:, :1], score)
    special = mode == MODES.index("special")
    for values in (key, score):
        where, table = _specials(shape, 0.05, gen)
        values.copy_(torch.where(special & where, table, values))
    return key, score


def make_case(rng, gen):
    device = gen.device
    g = dict(generator=gen, device=device)
    requests = rng.choice([1, 2, 3, 8, 31, 64, 128, 255, 256, rng.randint(1, 256)])
    tokens = rng.randint(1, 4)
    ring, page, page_pad, tail_pad = rng.choice(LAYOUTS)
    mx, round_scale = rng.choice(SCALES)
    index_dtype = rng.choice([torch.int32, torch.int64])
    positions_dtype = rng.choice([torch.int32, torch.int64])

    # Positions in order per request; padding rows and tokens are negative.
    low, high = rng.choice(STARTS if positions_dtype == torch.int64 else STARTS[:2])
    starts = torch.randint(low, high, (requests, 1), **g)
    positions = starts + torch.arange(tokens, device=device)
    if positions_dtype == torch.int32:
        positions = positions.clamp(max=2**31 - 1)
    positions[torch.rand(requests, **g) < 0.08] = -1
    token_pad = torch.rand(requests, tokens, **g) < 0.03
    pads = torch.randint(1, 4, (requests, tokens), **g)
    positions = torch.where(token_pad, -pads, positions).to(positions_dtype)

    # Block 0 of the tail cache is never any request's: a completion with tail
    # slot -1 reads it (as stock does), and nothing may race with that read.
    tail_blocks = 1 + torch.randperm(requests + 3, **g)[:requests]
    phase = positions.long().clamp(min=0) % ring
    tail_slots = tail_blocks[:, None] * ring + phase
    tail_slots[positions < 0] = -1
    tail_slots[torch.rand(requests, tokens, **g) < 0.05] = -1

    pages = (requests * tokens) // page + 2
    free = torch.randperm(pages * page, **g)[: requests * tokens].view(requests, -1)
    completes = (positions >= 0) & (positions.long() % POOL == POOL - 1)
    writes = completes & (torch.rand(requests, tokens, **g) < 0.9)
    # Slots on non-completing tokens must be ignored.
    writes |= torch.rand(requests, tokens, **g) < 0.05
    slots = torch.where(writes, free, -1)

    modes = [rng.choice(MODES) for _ in range(requests)]
    key, score = _values(modes, (requests, tokens, DIM), gen)
    edge = rng.choices(list(EDGES), weights=list(EDGES.values()))[0]
    if edge == "inf key":  # in some pools
        for _ in range(8):
            r, t = rng.randrange(requests), rng.randrange(tokens)
            key[r, t, rng.randrange(DIM)] = rng.choice([1, -1]) * float("inf")
    elif edge == "overflow":
        key.mul_(3e38 / max(float(key.abs().nan_to_num(0, 0, 0).max()), 1e-30))
    elif edge == "far" and positions_dtype == torch.int64:
        positions = positions + (2**32) * rng.randint(1, 8)
    ape = torch.randn(POOL, DIM, **g) * rng.choice([0.0, 0.1, 1.0, 10.0])
    if rng.random() < 0.1:
        where, table = _specials((POOL, DIM), 0.02, gen)
        ape = torch.where(where, table, ape)

    page_bytes = page * (DIM + 4) + page_pad
    cache = torch.randint(0, 256, (pages * page_bytes,), dtype=torch.uint8, **g)
    tail_block = 2 * ring * DIM + tail_pad
    tail = torch.randn((requests + 4) * tail_block, **g)
    special = torch.tensor([m == "special" for m in modes], device=device)
    if special.any():
        where, table = _specials(tail.shape, 0.02, gen)
        tail = torch.where(where, table, tail)
    ring_values = tail.view(requests + 4, -1)[:, : 2 * ring * DIM]
    ring_values = ring_values.view(-1, 2, ring, DIM)
    # The stashed pool members of "ties" requests tie with the current ones.
    ties = torch.tensor([m == "ties" for m in modes], device=device)
    ring_values[tail_blocks[ties], 0] = key[ties, :1]
    ring_values[tail_blocks[ties], 1] = score[ties, :1]
    # Keys may be a view into wider per-request rows.
    spare = rng.choice([0, 1])
    key_rows = torch.randn(requests, tokens + spare, DIM, **g)
    key_rows[:, :tokens] = key
    case = dict(
        cache=cache,
        cache_view=((pages, page, DIM + 4), (page_bytes, DIM + 4, 1)),
        tail=tail.to(torch.bfloat16),
        tail_view=((requests + 4, 2, ring, DIM), (tail_block, ring * DIM, DIM, 1)),
        tail_slots=tail_slots.to(index_dtype),
        key=key_rows.to(torch.bfloat16)[:, :tokens],
        score=score.to(torch.bfloat16),
        ape=ape,
        slots=slots.to(index_dtype),
        positions=positions,
        mx=mx,
        round_scale=round_scale,
    )
    summary = (
        f"{requests} requests x {tokens} tokens, ring {ring}, page {page}+"
        f"{page_pad}B, tail pad {tail_pad}, mx {mx}, round {round_scale}, "
        f"{index_dtype} slots, {positions_dtype} positions from {low}, "
        f"modes {sorted(set(modes))}, edge {edge}"
    )
    return case, summary


def run_stock(case, cache, tail):
    from vllm.models.glm5next.nvidia.ops import kpool_compress

    # The H200 is not SM100: the stock kernel reads the MX flag from here.
    saved = kpool_compress.mqa_logits_use_mx_scales
    kpool_compress.mqa_logits_use_mx_scales = lambda: case["mx"]
    try:
        kpool_compress.kpool_decode_update_and_maybe_write_cache_batched(
            cache.as_strided(*case["cache_view"]),
            tail.as_strided(*case["tail_view"]),
            case["tail_slots"],
            case["key"],
            case["score"],
            case["ape"],
            case["slots"],
            case["positions"],
            POOL,
            DIM,
            round_scale=case["round_scale"],
        )
    finally:
        kpool_compress.mqa_logits_use_mx_scales = saved


def run_ours(case, cache, tail):
    from vllm.models.glm5next.nvidia.specialized_decode.kpool import kpool_update

    kpool_update(
        cache.as_strided(*case["cache_view"]),
        tail.as_strided(*case["tail_view"]),
        case["tail_slots"],
        case["key"],
        case["score"],
        case["ape"],
        case["slots"],
        case["positions"],
        POOL,
        mx_scales=case["mx"],
        round_scale=case["round_scale"],
    )


def check_case(case, summary) -> str | None:
    stock_cache, stock_tail = case["cache"].clone(), case["tail"].clone()
    ours_cache, ours_tail = case["cache"].clone(), case["tail"].clone()
    run_stock(case, stock_cache, stock_tail)
    run_ours(case, ours_cache, ours_tail)
    torch.cuda.synchronize()
    diffs = [
        differs("fp8 cache", stock_cache, ours_cache),
        differs("tail cache", stock_tail, ours_tail),
    ]
    diffs = [d for d in diffs if d]
    return f"{summary}: {diffs}" if diffs else None


def test_kpool_update_matches_stock():
    fuzz("kpool_update", 1000, lambda rng, gen: check_case(*make_case(rng, gen)))
