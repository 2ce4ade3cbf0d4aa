# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``kpool_update`` against ``kpool_decode_update_and_maybe_write_cache_batched``:
the whole FP8 cache (values, scales, untouched pages) and the whole tail cache,
byte for byte, for MX scales and both FP32 scale roundings."""

import random

import pytest
import torch
from kpool_fuzz import fuzz_cases, fuzz_seed, needs_cuda, report

pytestmark = [pytest.mark.gpu, needs_cuda()]

DIM, POOL = 128, 4
# (ring, page, page padding bytes, tail block padding elements): few layouts,
# so the stock kernel compiles few variants.
LAYOUTS = [(4, 64, 0, 0), (8, 16, 16, 0), (16, 32, 4, 512)]
# (MX scales, round_scale): SM100's UE8M0 bytes, Hopper's FP32 scales.
SCALES = [(True, True), (False, True), (False, False)]
# How a request's keys and scores are drawn: ordinary values, FP8 saturation,
# the 1e-4 amax floor, ties and softmax underflow.
MODES = ["normal", "huge", "tiny", "zeros", "ties", "sharp"]


def _values(modes: list[str], shape, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and scores of ``shape`` [requests, tokens, dim], request ``r``'s
    drawn as ``modes[r]`` says."""
    device = gen.device
    key = torch.randn(shape, generator=gen, device=device)
    score = torch.randn(shape, generator=gen, device=device)
    mode = torch.tensor([MODES.index(m) for m in modes], device=device)[:, None, None]
    scale = torch.tensor([1.0, 3e4, 1e-7, 0.0, 1.0, 1.0], device=device)[mode]
    key = key * scale
    score = torch.where(mode == MODES.index("sharp"), score * 60, score)
    ties = mode == MODES.index("ties")
    key = torch.where(ties, key[:, :1], key)
    score = torch.where(ties, score[:, :1], score)
    return key, score


def _strided(storage: torch.Tensor, shape, stride) -> torch.Tensor:
    return storage.as_strided(shape, stride)


def make_case(seed: int, device):
    rng = random.Random(seed)
    gen = torch.Generator(device).manual_seed(seed)
    g = dict(generator=gen, device=device)
    requests = rng.choice([1, 2, 3, 8, 31, 64, 128, 255, 256, rng.randint(1, 256)])
    tokens = rng.randint(1, 4)
    ring, page, page_pad, tail_pad = rng.choice(LAYOUTS)
    mx, round_scale = rng.choice(SCALES)
    index_dtype = rng.choice([torch.int32, torch.int64])

    # Positions in order per request; padding rows and tokens are negative.
    starts = torch.randint(0, 5000, (requests, 1), **g)
    positions = (starts + torch.arange(tokens, device=device)).to(torch.int32)
    positions[torch.rand(requests, **g) < 0.08] = -1
    token_pad = torch.rand(requests, tokens, **g) < 0.03
    pads = torch.randint(1, 4, (requests, tokens), dtype=torch.int32, **g)
    positions = torch.where(token_pad, -pads, positions)

    # Block 0 of the tail cache is never any request's: a completion with tail
    # slot -1 reads it (as stock does), and nothing may race with that read.
    tail_blocks = 1 + torch.randperm(requests + 3, **g)[:requests]
    tail_slots = tail_blocks[:, None] * ring + positions.clamp(min=0) % ring
    tail_slots[positions < 0] = -1
    tail_slots[torch.rand(requests, tokens, **g) < 0.05] = -1

    pages = (requests * tokens) // page + 2
    free = torch.randperm(pages * page, **g)[: requests * tokens].view(requests, -1)
    completes = (positions >= 0) & (positions % POOL == POOL - 1)
    writes = completes & (torch.rand(requests, tokens, **g) < 0.9)
    # Slots on non-completing tokens must be ignored.
    writes |= torch.rand(requests, tokens, **g) < 0.05
    slots = torch.where(writes, free, -1)

    modes = [rng.choice(MODES) for _ in range(requests)]
    key, score = _values(modes, (requests, tokens, DIM), gen)
    ape = torch.randn(POOL, DIM, **g) * rng.choice([0.0, 0.1, 1.0, 10.0])

    page_bytes = page * (DIM + 4) + page_pad
    cache = torch.randint(0, 256, (pages * page_bytes,), dtype=torch.uint8, **g)
    tail_block = 2 * ring * DIM + tail_pad
    tail = torch.randn((requests + 4) * tail_block, **g)
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
        f"seed {seed}: {requests} requests x {tokens} tokens, ring {ring}, "
        f"page {page}+{page_pad}B, tail pad {tail_pad}, mx {mx}, "
        f"round {round_scale}, {index_dtype}, modes {sorted(set(modes))}"
    )
    return case, summary


def run_stock(case, cache, tail, monkeypatch):
    from vllm.models.glm5next.nvidia.ops import kpool_compress

    # The H200 is not SM100: force the MX path the comparison needs.
    monkeypatch.setattr(kpool_compress, "mqa_logits_use_mx_scales", lambda: case["mx"])
    kpool_compress.kpool_decode_update_and_maybe_write_cache_batched(
        _strided(cache, *case["cache_view"]), _strided(tail, *case["tail_view"]),
        case["tail_slots"], case["key"], case["score"], case["ape"], case["slots"],
        case["positions"], POOL, DIM, round_scale=case["round_scale"],
    )  # fmt: skip


def run_ours(case, cache, tail):
    from vllm.models.glm5next.nvidia.specialized_decode.kpool import kpool_update

    kpool_update(
        _strided(cache, *case["cache_view"]), _strided(tail, *case["tail_view"]),
        case["tail_slots"], case["key"], case["score"], case["ape"], case["slots"],
        case["positions"], POOL, mx_scales=case["mx"], round_scale=case["round_scale"],
    )  # fmt: skip


def _differs(name, expected, got) -> str | None:
    if torch.equal(expected, got):
        return None
    where = (expected != got).nonzero()
    return f"{name}: {where.shape[0]} bytes differ, first at {where[0].item()}"


def test_kpool_update_matches_stock(monkeypatch):
    seed, cases = fuzz_seed(), fuzz_cases(1000)
    device = torch.device("cuda")
    failures = []
    for i in range(cases):
        case, summary = make_case(seed + i, device)
        stock_cache, stock_tail = case["cache"].clone(), case["tail"].clone()
        ours_cache, ours_tail = case["cache"].clone(), case["tail"].clone()
        run_stock(case, stock_cache, stock_tail, monkeypatch)
        run_ours(case, ours_cache, ours_tail)
        torch.cuda.synchronize()
        diffs = [
            _differs("fp8 cache", stock_cache, ours_cache),
            _differs("tail cache", stock_tail.view(torch.uint8),
                     ours_tail.view(torch.uint8)),
        ]  # fmt: skip
        if any(diffs):
            failures.append(f"{summary}: {[d for d in diffs if d]}")
    report("kpool_update", cases, seed, failures)
