# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``cutedsl/scores``: ``SCORES``, the decode scores over the paged FP8
index cache (DeepGEMM's SM90 ``fp8_fp4_paged_mqa_logits``).

CPU: the rule at its edges (each argument refused by name), the CTAs an
entry takes, the compile keys the warmup lists, the compile of every key
for sm_90a and its PTX (the wgmma shape and count, the epilogue's FMAs, PDL,
no spills). GPU: randomized steps over heads {16, 32, 64}, next_n 1 to 4,
1 to 256 entries (zero, short and long contexts, block tables wider than
needed and filled past the entry's pages with ids no cache has), against a
float64 reference written here from the definition (max error relative to
the terms' magnitude, and in ulps of the value), the query and weights as
views of more heads (vLLM's zero padding), and, where ``import
deep_gemm`` works (SM90 takes next_n 1, 2 and 4, heads 32 and 64, 16 heads
zero-padded to 32 as vLLM pads them), against DeepGEMM's bytes below each
entry's context, with the share of rows whose top-512 set differs; and an
entry's bytes alone against the same entry anywhere in batches of 2 to 256
entries."""

import random

import pytest
import torch
from kernel_ptx import compile_ptx, ops, resources
from kpool_fuzz import FUZZ_REPORT, fuzz_cases, fuzz_seed
from rule_edges import (
    declared_disagreements,
    devices_named,
    missing,
    shape_disagreements,
)

from vllm.model_executor.warmup.jit_warmup import WarmupChoices
from vllm.models.glm5next.nvidia.specialized_decode.constants import DIM
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.common.host import (
    Refused,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.scores.kernel import (
    THREADS,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.scores.launch import (
    BLOCKS,
    CTAS_PER_SM,
    CTAS_PER_SM_FEW,
    FEW_TILES,
    HEADS,
    NEXT_N,
    SCORES,
    check,
    row_stride,
    splits_for,
)

FP8, F32, I32, U8 = torch.float8_e4m3fn, torch.float32, torch.int32, torch.uint8
TOPK = 512  # GLM-5-Next's index_topk 2048 / index_kpool 4
ALL_KEYS = [SCORES.CompileKey(h, n, b) for h in HEADS for n in NEXT_N for b in BLOCKS]
TMA = ".shared::cta.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"


# --- CPU: the rule, the split, the keys, the PTX ----------------------------


def _meta_args(entries=2, next_n=1, heads=32, block=64, blocks=8, width=256):
    """Arguments on the meta device of a well-formed call."""
    m = dict(device="meta")
    return dict(
        q=(torch.empty(entries, next_n, heads, DIM, dtype=FP8, **m), None),
        kv_cache=torch.empty(blocks, block * (DIM + 4), dtype=U8, **m).view(
            blocks, block, 1, DIM + 4
        ),
        weights=torch.empty(entries * next_n, heads, dtype=F32, **m),
        seq_lens=torch.empty(entries, next_n, dtype=I32, **m),
        block_table=torch.empty(entries, 5, dtype=I32, **m),
        max_model_len=width,
        out=None,
    )


def _refused_argument(args) -> str:
    with pytest.raises(Refused) as error:
        # Devices are checked first; the meta tensors stand in for CUDA.
        check(**args)
    return str(error.value).split(":")[0]


@pytest.fixture
def on_cuda(monkeypatch):
    """``check``'s device test passes meta tensors (the rule after it is what
    these tests exercise)."""
    import vllm.models.glm5next.nvidia.specialized_decode.cutedsl.scores.launch as m

    monkeypatch.setattr(m, "check_devices", lambda *a, **k: None)


def test_scores_rule_takes_the_stock_shapes(on_cuda):
    """Every head count, next_n and page size the kernel serves passes."""
    for heads in HEADS:
        for next_n in NEXT_N:
            for block in BLOCKS:
                check(**_meta_args(next_n=next_n, heads=heads, block=block))


@pytest.mark.parametrize(
    "argument,change",
    [
        ("q", lambda a: a.update(q=a["q"][0])),
        ("q", lambda a: a.update(q=(a["q"][0], torch.empty(1, device="meta")))),
        ("q", lambda a: a.update(q=(a["q"][0].to(torch.float8_e5m2), None))),
        ("q", lambda a: a.update(q=(torch.empty(2, 1, 48, DIM, dtype=FP8), None))),
        ("q", lambda a: a.update(q=(torch.empty(2, 5, 32, DIM, dtype=FP8), None))),
        ("q", lambda a: a.update(q=(torch.empty(2, 1, 32, 64, dtype=FP8), None))),
        (
            "q",
            lambda a: a.update(
                q=(torch.empty(2, DIM, 32, dtype=FP8).transpose(1, 2)[:, None], None)
            ),
        ),
        ("kv_cache", lambda a: a.update(kv_cache=a["kv_cache"].view(torch.int8))),
        (
            "kv_cache",
            lambda a: a.update(
                kv_cache=torch.empty(8, 16 * (DIM + 4), dtype=U8).view(
                    8, 16, 1, DIM + 4
                )
            ),
        ),
        (
            "kv_cache",
            lambda a: a.update(
                kv_cache=torch.empty(8, 64 * DIM + 8, dtype=U8)[:, : 64 * DIM].view(
                    8, 64, 1, DIM
                )
            ),
        ),
        (
            "kv_cache",  # pages not a 16-byte multiple apart
            lambda a: a.update(
                kv_cache=torch.empty(8, 64 * (DIM + 4) + 4, dtype=U8)[
                    :, : 64 * (DIM + 4)
                ].view(8, 64, 1, DIM + 4)
            ),
        ),
        ("weights", lambda a: a.update(weights=a["weights"].half())),
        ("weights", lambda a: a.update(weights=a["weights"][:1])),
        ("weights", lambda a: a.update(weights=torch.empty(32, 2).t())),
        ("seq_lens", lambda a: a.update(seq_lens=a["seq_lens"].long())),
        ("seq_lens", lambda a: a.update(seq_lens=a["seq_lens"].view(-1))),
        ("block_table", lambda a: a.update(block_table=a["block_table"].long())),
        ("block_table", lambda a: a.update(block_table=a["block_table"][:1])),
        ("block_table", lambda a: a.update(block_table=torch.empty(5, 2).t())),
        ("max_model_len", lambda a: a.update(max_model_len=0)),
        ("max_model_len", lambda a: a.update(max_model_len=256.0)),
        ("out", lambda a: a.update(out=torch.empty(2, 255))),
        ("out", lambda a: a.update(out=torch.empty(2, 256, dtype=torch.bfloat16))),
        ("out", lambda a: a.update(out=torch.empty(256, 2).t())),
        ("indices", lambda a: a.update(indices=torch.zeros(2, dtype=I32))),
    ],
)
def test_scores_rule_refuses_by_name(on_cuda, argument, change):
    """A call outside the rule raises ``Refused`` naming the argument."""
    args = _meta_args()
    change(args)
    assert _refused_argument(args) == argument


def rule(a: dict) -> str | None:
    """The scores' rule on shapes and scalars, as its messages state it: no
    ``indices``; a ``(values, None)`` query of [entries, next_n in NEXT_N,
    heads in HEADS, 128] FP8, each head's 128 bytes one after the other and
    the other strides positive multiples of 16 bytes; a cache of [blocks, block in
    BLOCKS, 1, 132] dense pages; weights [entries * next_n, heads]; lengths
    [entries, next_n], contiguous; a block table of entries rows; an int
    ``max_model_len`` in [1, 2^31 - 64); ``out`` (optional) of [entries *
    next_n, max_model_len], rows no closer than its width."""
    if a.get("indices") is not None:
        return "indices"
    q = a["q"]
    if not isinstance(q, tuple) or len(q) != 2 or q[1] is not None:
        return "q"
    names = ("q", "kv_cache", "weights", "seq_lens", "block_table", "out")
    named = devices_named(a | {"q": q[0]}, names, optional=("out",))
    if named:
        return named
    values, kv = q[0], a["kv_cache"]
    if (
        values.dim() != 4
        or values.shape[1] not in NEXT_N
        or values.shape[2] not in HEADS
        or values.shape[3] != DIM
        or values.stride()[2:] != (DIM, 1)
        or min(values.stride()[:2]) <= 0
        or values.stride(0) % 16
        or values.stride(1) % 16
    ):
        return "q"
    entries, next_n, heads, _ = values.shape
    if (
        kv.dim() != 4
        or kv.shape[1] not in BLOCKS
        or kv.shape[2:] != (1, DIM + 4)
        or kv.stride()[1:] != (DIM + 4, DIM + 4, 1)
        or kv.stride(0) < kv.shape[1] * (DIM + 4)
    ):
        return "kv_cache"
    if a["weights"].shape != (entries * next_n, heads):
        return "weights"
    lens = a["seq_lens"]
    if lens.shape != (entries, next_n) or not lens.is_contiguous():
        return "seq_lens"
    if a["block_table"].dim() != 2 or a["block_table"].shape[0] != entries:
        return "block_table"
    width = a["max_model_len"]
    if type(width) is not int or not 1 <= width < 2**31 - 64:
        return "max_model_len"
    out = a["out"]
    if out is not None and (
        out.shape != (entries * next_n, width) or out.stride(0) < width
    ):
        return "out"
    return None


def test_rule_at_its_edges():
    """Each dimension of each tensor (the query's values too) one below, at
    and one above its size and the head counts, page sizes and next_n the
    rule takes; ``max_model_len`` at its neighbours, 0, the int32 edges, a
    bool and a float; the type and device checks: refused exactly where
    ``rule`` says, naming the argument."""
    assert shape_disagreements(SCORES, rule) == []


@pytest.mark.parametrize(
    "name", ["q", "kv_cache", "weights", "seq_lens", "block_table"]
)
def test_a_missing_tensor_is_refused(name):
    assert missing(SCORES, name) == []


def test_rule_on_layouts_and_dtypes():
    """The layouts of ``rule_layouts.py`` and each tensor in float64:
    refused naming the argument they declare, or taken."""
    assert declared_disagreements(SCORES) == []


def test_scores_rule_wants_cuda_tensors():
    """CPU tensors are refused, naming the first."""
    args = _meta_args()
    args["q"] = (torch.empty(2, 1, 32, DIM, dtype=FP8), None)
    assert _refused_argument(args) == "q"


def test_one_zero_add_a_pair_is_one_a_sum():
    """The 16-head epilogue's ``((a + b) + 0.0) * s`` equals ``((a + 0.0) +
    (b + 0.0)) * s`` bit for bit (NaNs as NaNs) in FP32 round-to-nearest
    without flushing, over random bit patterns and every pair of signed
    zeros, denormals, infinities, NaN and opposite values."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (2, 1 << 20), generator=gen, dtype=I32)
    a, b = bits.view(F32)
    special = torch.tensor(
        [
            0.0,
            -0.0,
            1e-45,
            -1e-45,
            1e-40,
            -1e-40,
            1.0,
            -1.0,
            3e38,
            -3e38,
            float("inf"),
            float("-inf"),
            float("nan"),
        ],
    )
    pa, pb = torch.cartesian_prod(special, special).T
    a, b = torch.cat([a, pa, -pb]), torch.cat([b, pb, pb])
    scale = torch.rand(a.shape, generator=gen) * 4 - 2
    once = ((a + b) + 0.0) * scale
    each = ((a + 0.0) + (b + 0.0)) * scale
    nan = once.isnan()
    assert torch.equal(nan, each.isnan())
    assert torch.equal(once[~nan].view(I32), each[~nan].view(I32))


def test_scores_splits():
    """An entry's tiles are split over ``ctas * sms / entries`` CTAs, at
    least one, at most one a 64-pool tile of the width: ``ctas`` four where
    the step has at most ``FEW_TILES`` tiles an SM, else two."""
    few = FEW_TILES * 132 * 64  # pools of the most tiles that count as few
    assert splits_for(1, 65536, 132) == CTAS_PER_SM_FEW * 132
    assert splits_for(2, few // 2, 132) == CTAS_PER_SM_FEW * 132 // 2
    assert splits_for(2, few // 2 + 64, 132) == CTAS_PER_SM * 132 // 2
    assert splits_for(8, 65536, 132) == -(-CTAS_PER_SM * 132 // 8)
    assert splits_for(1000, 65536, 132) == 1
    assert splits_for(1, 100, 132) == 2
    assert splits_for(1, 1, 132) == 1
    assert row_stride(1) == 256 and row_stride(256) == 256 and row_stride(257) == 512


def test_scores_warmup_keys():
    """The warmup lists one key per head count, next_n and page size."""
    keys = SCORES.get_warmup_keys(
        heads=WarmupChoices(*HEADS),
        next_n=WarmupChoices(*NEXT_N),
        block=WarmupChoices(*BLOCKS),
    )
    assert sorted(keys, key=repr) == sorted(ALL_KEYS, key=repr)


@pytest.mark.parametrize("key", ALL_KEYS, ids=repr)
def test_scores_ptx(key):
    """sm_90a: four m64nNk32 e4m3 wgmmas a tile (N = next_n x heads), the
    first not accumulating; the head sum's FMAs as DeepGEMM's epilogue
    (``next_n x 4 x (heads / 8 - 1)``), with 16 heads two +0.0 adds a row;
    TMA copies (the query a row at a time); one PDL wait; no spills, two
    CTAs an SM by registers."""
    text = compile_ptx(SCORES, key, "sm_90a")
    count = ops(text)
    n = key.next_n * key.heads
    shape = f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3"
    assert count[shape] == 4, {k: v for k, v in count.items() if "wgmma" in k}
    assert count["fma.rn.f32"] == key.next_n * 4 * (key.heads // 8 - 1)
    # 16 heads: the +0.0 of vLLM's zero heads, once a pair of sums.
    zero_adds = text.count("add.rn.f32 r,r,0f00000000")
    assert zero_adds == (2 * key.next_n if key.heads == 16 else 0), zero_adds
    assert count["griddepcontrol.wait"] == 1
    assert count["griddepcontrol.launch_dependents"] == 1
    # TMA: a (heads, 128) slab of the query a row of next_n (its own strides:
    # a view of vLLM's padded heads), then a tile's pages and their scales.
    copies = sum(v for k, v in count.items() if k.startswith("cp.async.bulk.tensor"))
    assert copies == key.next_n + 2 * (64 // key.block), count
    assert count[f"cp.async.bulk.tensor.4d{TMA}"] == key.next_n * (key.next_n > 1)
    registers, spilled = resources(text, "sm_90a")
    assert spilled == 0 and registers * THREADS * 2 <= 65536, (registers, spilled)


# --- GPU: the definition and DeepGEMM's bytes --------------------------------


def _step(rng: random.Random, heads, next_n, block, entries, device, past=2**30):
    """A random decode step: FP8 queries, weights, a paged FP8 cache with
    FP32 per-pool scales (some 0, some huge), per-row lengths (MTP rows end
    one pool apart), a block table wider than needed whose tail holds ids
    past the cache."""
    gen = torch.Generator(device=device).manual_seed(rng.getrandbits(31))
    lengths = []
    for _ in range(entries):
        kind = rng.random()
        if kind < 0.05:
            lengths.append(0)
        elif kind < 0.15:
            lengths.append(rng.randint(1, 70))
        elif kind < 0.2 and entries <= 16:
            lengths.append(rng.randint(16384, 65536))
        else:
            lengths.append(rng.randint(1, 6000))
    width = max(max(lengths) + rng.randint(0, 300), 1)
    pages = [-(-n // block) for n in lengths]
    table_width = max(pages) + rng.randint(1, 5)
    blocks = sum(pages) + rng.randint(1, 7)
    order = torch.randperm(blocks, generator=gen, device=device).to(I32)
    table = torch.full((entries, table_width), past, dtype=I32, device=device)
    taken = 0
    for e, p in enumerate(pages):
        table[e, :p] = order[taken : taken + p]
        taken += p
    values = torch.randn(blocks, block, DIM, generator=gen, device=device)
    scale = values.abs().amax(-1).clamp(min=1e-4) / 448.0
    k_fp8 = (values / scale[..., None]).to(FP8)
    pick = torch.rand(blocks, block, generator=gen, device=device)
    scale = torch.where(pick < 0.01, torch.zeros_like(scale), scale)
    scale = torch.where(pick > 0.995, torch.full_like(scale, 1e20), scale)
    cache = torch.empty(blocks, block * (DIM + 4), dtype=U8, device=device)
    cache[:, : block * DIM] = k_fp8.view(U8).view(blocks, -1)
    cache[:, block * DIM :] = scale.view(U8).view(blocks, -1)
    # The query and weights as views of more heads (zero past ``heads``):
    # vLLM's padding of 16 to 32, else in half the steps 16 more.
    padded = 32 if heads < 32 else heads + 16 * (rng.random() < 0.5)
    q = torch.randn(entries, next_n, padded, DIM, generator=gen, device=device)
    q[:, :, heads:] = 0
    q = (q * 50).clamp(-448, 448).to(FP8)
    weights = torch.randn(entries * next_n, padded, generator=gen, device=device)
    weights = weights * heads**-0.5
    weights[:, heads:] = 0
    q, weights = q[:, :, :heads], weights[:, :heads]
    last = torch.tensor(lengths, dtype=I32, device=device)
    offsets = torch.arange(next_n - 1, -1, -1, dtype=I32, device=device)
    seq_lens = (last[:, None] - offsets).clamp(min=0).contiguous()
    seq_lens[:, -1] = last
    kv = cache.view(blocks, block, 1, DIM + 4)
    return dict(
        q=(q, None),
        kv_cache=kv,
        weights=weights,
        seq_lens=seq_lens,
        block_table=table,
        max_model_len=width,
    )


def _reference(args):
    """float64 logits from the definition: for entry b, row i, pool p below
    ``seq_lens[b, -1]``: sum_h relu(q[b,i,h] . k[p]) * w[b,i,h] * scale[p];
    with the magnitude sum_h |w| (|q| . |k|) |scale| each term is within."""
    q, _ = args["q"]
    kv, table, lens = args["kv_cache"], args["block_table"], args["seq_lens"]
    entries, next_n, heads, _ = q.shape
    block = kv.shape[1]
    flat = kv.view(kv.shape[0], -1)
    rows = entries * next_n
    out = torch.zeros(rows, args["max_model_len"], dtype=torch.float64, device=q.device)
    size = torch.zeros_like(out)
    w = args["weights"].double().view(entries, next_n, heads)
    for b in range(entries):
        n = int(lens[b, -1])
        if n == 0:
            continue
        pages = table[b, : -(-n // block)].long()
        k = flat[pages, : block * DIM].view(FP8).float().double().reshape(-1, DIM)[:n]
        s = flat[pages, block * DIM :].contiguous().view(F32).double().reshape(-1)[:n]
        qb = q[b].float().double().reshape(next_n * heads, DIM)
        dots = (k @ qb.T).view(n, next_n, heads)
        mags = (k.abs() @ qb.abs().T).view(n, next_n, heads)
        value = (dots.clamp(min=0) * w[b]).sum(-1) * s[:, None]
        magnitude = (mags * w[b].abs()).sum(-1) * s.abs()[:, None]
        out[b * next_n : (b + 1) * next_n, :n] = value.T
        size[b * next_n : (b + 1) * next_n, :n] = magnitude.T
    return out, size


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """FP32 bits as integers in the order of the values (for ulps)."""
    bits = x.contiguous().view(I32).long()
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def _deep_gemm():
    try:
        import deep_gemm
    except Exception as error:  # noqa: BLE001 - any failure means "not here"
        return None, f"import deep_gemm failed: {error!r}"
    return deep_gemm, None


def _deep_gemm_logits(deep_gemm, args):
    """DeepGEMM's logits, 16 heads zero-padded to 32 as vLLM pads them (its
    own contiguous copies)."""
    q, _ = args["q"]
    weights = args["weights"]
    if q.shape[2] == 16:
        q = torch.cat([q, torch.zeros_like(q)], dim=2)
        weights = torch.cat([weights, torch.zeros_like(weights)], dim=1)
    q, weights = q.contiguous(), weights.contiguous()
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    next_n = q.shape[1]
    slots = sms // 2 if next_n == 4 else sms
    meta = deep_gemm.get_paged_mqa_logits_metadata(
        args["seq_lens"], args["kv_cache"].shape[1], slots
    )
    return deep_gemm.fp8_fp4_paged_mqa_logits(
        (q, None),
        args["kv_cache"],
        weights,
        args["seq_lens"],
        args["block_table"],
        meta,
        args["max_model_len"],
    )


def _drawn(items: list, rng: random.Random) -> list:
    """``items``, or ``KPOOL_FUZZ_CASES`` of them drawn where that is fewer
    (the sanitizers' short runs)."""
    cases = fuzz_cases(len(items))
    return items if cases >= len(items) else rng.sample(items, cases)


def _steps(seed: int):
    """The steps the GPU tests draw: every head count, next_n and page size,
    entries from 1 to 256 (over 1,000 rows for DeepGEMM's next_n)."""
    rng = random.Random(seed)
    sizes = [1, 3, 8, 37, 64, 256]
    steps = [
        (key, entries)
        for index, key in enumerate(ALL_KEYS)
        for entries in (sizes[index % len(sizes)], sizes[(index + 3) % len(sizes)])
    ]
    for key, entries in _drawn(steps, rng):
        yield key, entries, rng


@pytest.mark.gpu
def test_scores_against_definition():
    """Every written column is within 2^-9 of its terms' magnitude of the
    float64 definition; nothing at or past an entry's context is written."""
    seed = fuzz_seed()
    worst, worst_rel, rows = 0.0, 0.0, 0
    for key, entries, rng in _steps(seed):
        args = _step(rng, key.heads, key.next_n, key.block, entries, "cuda")
        width = args["max_model_len"]
        out = torch.full(
            (entries * key.next_n, row_stride(width)), float("nan"), device="cuda"
        )[:, :width]
        got = SCORES(**args, out=out)
        torch.cuda.synchronize()
        ref, size = _reference(args)
        ends = args["seq_lens"][:, -1].repeat_interleave(key.next_n)
        cols = torch.arange(width, device="cuda")
        inside = cols[None, :] < ends[:, None]
        assert torch.isnan(got[~inside]).all(), (key, entries, "written past ctx")
        error = (got.double() - ref).abs()[inside]
        bound = size[inside] * 2.0**-9 + 1e-30
        assert (error <= bound).all(), (key, entries, seed)
        if error.numel():
            worst = max(worst, float((error / (size[inside] + 1e-30)).max()))
            big = ref[inside].abs() > 1e-3 * size[inside]
            if big.any():
                rel = error[big] / ref[inside].abs()[big]
                worst_rel = max(worst_rel, float(rel.max()))
        rows += entries * key.next_n
    FUZZ_REPORT.append(
        f"scores vs float64 definition: {rows} rows, seed {seed}, max error "
        f"{worst:.3g} of the magnitude, max relative {worst_rel:.3g}"
    )


@pytest.mark.gpu
def test_scores_equal_deepgemm():
    """DeepGEMM's bytes in every column a consumer reads (row ``r`` below
    its own length ``seq_lens.view(-1)[r]``, as the top-k and the upcast
    read it), over steps of >= 1,000 rows; reports the max ulps, the share
    of rows whose top-512 set differs, and the rows that differ only past
    their own length (below the entry's last), where neither is read.

    Not compared: the entries right after an entry of context 0. There
    DeepGEMM's first pages take another query (docs/performance.md, "Our
    scores"); ``test_scores_against_definition`` holds ours there."""
    deep_gemm, why = _deep_gemm()
    if deep_gemm is None:
        pytest.skip(why)
    seed = fuzz_seed()
    rows = differ_rows = topk_rows = topk_differ = beyond = after_zero = 0
    max_ulps, refused, first, by_key = 0, set(), [], {}
    for key, entries, rng in _steps(seed):
        # vLLM's block tables hold page 0 past a request's pages.
        args = _step(rng, key.heads, key.next_n, key.block, entries, "cuda", past=0)
        try:
            theirs = _deep_gemm_logits(deep_gemm, args)
        except RuntimeError as error:  # DeepGEMM's SM90 next_n and heads
            refused.add((key.heads, key.next_n, str(error).splitlines()[0][:80]))
            continue
        ours = SCORES(**args)
        torch.cuda.synchronize()
        assert ours.stride() == theirs.stride(), (ours.stride(), theirs.stride())
        ends = args["seq_lens"][:, -1].repeat_interleave(key.next_n)
        lens = args["seq_lens"].reshape(-1)
        for r in range(ours.shape[0]):
            entry = r // key.next_n
            if entry and int(args["seq_lens"][entry - 1, -1]) == 0:
                after_zero += 1
                continue
            m, n = int(lens[r]), int(ends[r])
            a, b = ours[r, :m], theirs[r, :m]
            same = a.view(I32) == b.view(I32)
            tally = by_key.setdefault((key.heads, key.next_n, key.block), [0, 0])
            tally[0] += 1
            if not bool(same.all()):
                differ_rows += 1
                tally[1] += 1
                ulps = (_ordered(a) - _ordered(b)).abs().max()
                max_ulps = max(max_ulps, int(ulps))
                if len(first) < 4:
                    col = int((~same).nonzero()[0])
                    first.append(
                        f"{key} entries {entries} row {r} col {col}: "
                        f"{float(a[col])!r} vs {float(b[col])!r}"
                    )
            elif not torch.equal(ours[r, m:n].view(I32), theirs[r, m:n].view(I32)):
                beyond += 1
            if m > TOPK:
                topk_rows += 1
                mine = set(a.topk(TOPK).indices.tolist())
                stock = set(b.topk(TOPK).indices.tolist())
                topk_differ += mine != stock
        rows += ours.shape[0]
    FUZZ_REPORT.append(
        f"scores vs DeepGEMM: {rows} rows, seed {seed}, {differ_rows} rows with "
        f"a differing byte below their length (max {max_ulps} ulps), top-{TOPK} "
        f"set differs in {topk_differ} of {topk_rows} rows; {beyond} rows differ "
        f"only past their own length; {after_zero} rows after a context-0 entry "
        f"not compared; DeepGEMM refused {sorted(refused)}; "
        f"first: {first}; (heads, next_n, block): [rows, differing] {by_key}"
    )
    assert rows >= 1000, (rows, sorted(refused))
    assert differ_rows == 0, (differ_rows, max_ulps, seed, first)


def _batch_with(target: dict, others: dict, at: int) -> dict:
    """``others``' entries with ``target``'s one entry inserted at ``at``:
    the caches side by side (the target's pages after the others'), the
    block tables padded with page 0 to one width."""
    blocks = others["kv_cache"].shape[0]
    tables = [others["block_table"], target["block_table"] + blocks]
    width = max(t.shape[1] for t in tables)
    tables = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables]

    def insert(a, b, rows=1):
        return torch.cat([a[: at * rows], b, a[at * rows :]])

    next_n = target["q"][0].shape[1]
    values = insert(others["q"][0], target["q"][0])
    return dict(
        q=(values, None),
        kv_cache=torch.cat([others["kv_cache"], target["kv_cache"]]),
        weights=insert(others["weights"], target["weights"], next_n),
        seq_lens=insert(others["seq_lens"], target["seq_lens"]).contiguous(),
        block_table=insert(tables[0], tables[1]).contiguous(),
        max_model_len=max(target["max_model_len"], others["max_model_len"]),
    )


@pytest.mark.gpu
def test_scores_bytes_do_not_depend_on_the_batch():
    """An entry's rows, below its context, are the same bytes alone and
    anywhere in batches of 2 to 256 entries (which change the CTAs an entry
    is split over and the SMs its tiles land on), for every key."""
    seed = fuzz_seed()
    rng, compared = random.Random(seed), 0
    keys = _drawn(ALL_KEYS, rng)
    for key in keys:
        target = _step(rng, key.heads, key.next_n, key.block, 1, "cuda", past=0)
        n = int(target["seq_lens"][0, -1])
        alone = SCORES(**target)[:, :n].view(I32)
        for entries in (1, 7, 63, 255):
            others = _step(rng, key.heads, key.next_n, key.block, entries, "cuda", 0)
            at = rng.randint(0, entries)
            rows = slice(at * key.next_n, (at + 1) * key.next_n)
            batch = _batch_with(target, others, at)
            got = SCORES(**batch)[rows, :n].view(I32)
            assert torch.equal(got, alone), (key, entries, at, seed)
            compared += got.numel()
    FUZZ_REPORT.append(
        f"scores batch invariance: {len(keys)} keys x 4 batches of 2-256 "
        f"entries, seed {seed}, {compared * 4} bytes compared, 0 mismatches"
    )
