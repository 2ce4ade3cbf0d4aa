# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The self-check's cases: randomized inputs of each kpool kernel in one
compile key's layout, and what its stock twin makes of them; the one place
the kernels' edge values are drawn (the GPU tests take their cases here).
A ``Case`` holds the kernel's keyword arguments, every buffer the kernel may
write (whole, ``poisoned`` first) and copies of them as the stock twin
leaves them (the opt-in select: its contract, ``select_reference``)."""

import random
from dataclasses import dataclass

import torch

from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
from vllm.models.glm5next.nvidia.ops import kpool_compress
from vllm.utils.deep_gemm import fp8_fp4_paged_mqa_logits, get_paged_mqa_logits_metadata
from vllm.v1.attention.backends.mla.sparse_utils import (
    triton_convert_req_index_to_global_index,
)

from .constants import DIM, INT32_MAX, POOL
from .cutedsl.expand.launch import EXPAND
from .cutedsl.remap.launch import REMAP
from .cutedsl.scores.launch import SCORES, row_stride, sm_count
from .cutedsl.select.kernel import CAPACITIES, VECTOR
from .cutedsl.select.launch import SELECT, cluster_for, slice_capacity
from .cutedsl.upcast.kernel import GROUP_ROWS, TILE
from .cutedsl.upcast.launch import UPCAST
from .cutedsl.update.launch import UPDATE

# FP32 bit patterns (a BF16 takes each one's upper half, bit for bit): NaNs
# of both signs (CUDA's canonical 0x7FFFFFFF too), +-inf, +-0.0, the
# smallest FP32 and BF16 denormals of both signs, the largest finite BF16,
# 3e38 (its sum over a pool overflows), +-1.
SPECIALS = (
    *(0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800000, 0xFF800000),
    *(0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x00010000, 0x80010000),
    *(0x7F7F0000, 0xFF7F0000, 0x7F61B1E6, 0x3F800000, 0xBF800000),
)
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


@dataclass
class Case:
    arguments: dict
    written: tuple[torch.Tensor, ...]
    expected: tuple[torch.Tensor, ...]


def special_values(dtype: torch.dtype, device) -> torch.Tensor:
    """``SPECIALS`` as FP32 or BF16 values, bit for bit (a rounding
    conversion would drop a BF16 NaN's sign)."""
    words = torch.tensor(SPECIALS, dtype=torch.int64, device=device).to(torch.int32)
    if dtype == torch.bfloat16:
        words = (words >> 16).to(torch.int16)
    return words.view(dtype)


def specials(values: torch.Tensor, rate: float, gen) -> torch.Tensor:
    """FP32 or BF16 ``values`` with a ``rate`` share replaced by
    ``SPECIALS``, bit for bit."""
    g = dict(generator=gen, device=values.device)
    bits = _BITS[values.dtype]
    table = special_values(values.dtype, values.device).view(bits)
    picks = table[torch.randint(0, len(SPECIALS), values.shape, **g)]
    where = torch.rand(values.shape, **g) < rate
    return torch.where(where, picks, values.view(bits)).view(values.dtype)


def poisoned(shape, dtype, gen) -> torch.Tensor:
    """Random bytes as ``dtype``: an output buffer before a launch, so that
    a byte a kernel leaves unwritten cannot pass as a written one."""
    size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (size,), generator=gen, device=gen.device)
    return bits.to(torch.uint8).view(dtype).view(shape)


# How a request's keys and scores are drawn: ordinary, FP8 saturation, the
# 1e-4 amax floor, zeros, ties across the pool members (the stashed ones
# too), softmax underflow, each token its own magnitude, FP32 overflow of
# the pooled sum and the Hadamard, specials.
# (The keys' scale of each.)
MODES = dict(normal=1, huge=3e4, tiny=1e-7, zeros=0, ties=1, sharp=1, slots=1)
MODES |= dict(overflow=3e38, special=1)
# A case's edge (weights): none, infinite keys, finite keys whose pooled
# value overflows FP32 (stock's scale is +inf, MX byte 0xFF), int64
# positions shifted by multiples of 2^32 (padding rows' -1 included).
EDGES = {"none": 7, "inf key": 1, "overflow": 1, "far": 1}
# A request's first position: small, at the int32 edge, beyond it (int64).
STARTS = ((0, 5000), (2**31 - 6, 2**31 - 1), (2**32 - 3, 2**32 + 9))
STARTS += ((2**40, 2**40 + 99),)


def _update_values(modes, shape, edge, rng, gen):
    """BF16 keys and scores [requests, tokens, 128], request ``r`` drawn as
    ``modes[r]`` says, with the case's ``edge``."""
    g = dict(generator=gen, device=gen.device)
    key, score = torch.randn(shape, **g), torch.randn(shape, **g)
    names = list(MODES)
    mode = torch.tensor([names.index(m) for m in modes], device=gen.device)
    mode = mode[:, None, None]
    key = key * torch.tensor(list(MODES.values()), device=gen.device)[mode].float()
    per_token = 10.0 ** torch.randint(-30, 30, shape[:2], **g).float()[..., None]
    key = torch.where(mode == names.index("slots"), key * per_token, key)
    score = torch.where(mode == names.index("sharp"), score * 60, score)
    ties = mode == names.index("ties")
    key, score = (torch.where(ties, v[:, :1], v) for v in (key, score))
    if edge == "inf key":  # in some pools
        for _ in range(8):
            r, t = rng.randrange(shape[0]), rng.randrange(shape[1])
            key[r, t, rng.randrange(DIM)] = rng.choice([1, -1]) * float("inf")
    elif edge == "overflow":
        key.mul_(3e38 / max(float(key.abs().nan_to_num(0, 0, 0).max()), 1e-30))
    special = mode == names.index("special")
    pairs = (key.bfloat16(), score.bfloat16())
    return [torch.where(special, specials(v, 0.05, gen), v) for v in pairs]


def update_case(rng: random.Random, gen: torch.Generator, key) -> Case:
    """A decode step's tail update in ``key``'s cache layout: 1-256 requests
    of 1-4 tokens in ``MODES``, one of ``EDGES``; positions from ``STARTS``,
    padding; tail slots -1 (block 0 is read then); slot writes on pool
    completions and other tokens (ignored); specials in the tail ring and
    APE; keys a view of wider rows. Stock writes this process's scales."""
    if key.mx_scales != kpool_compress.mqa_logits_use_mx_scales():
        raise ValueError(
            f"key: expected mx_scales={kpool_compress.mqa_logits_use_mx_scales()} "
            f"(this process's scales, which stock writes), got {key.mx_scales}"
        )
    device = gen.device
    g = dict(generator=gen, device=device)
    requests = rng.choice([1, 2, 3, 8, 31, 64, 128, 255, 256, rng.randint(1, 256)])
    tokens = rng.randint(1, 4)
    wide = key.positions_dtype == torch.int64
    low, high = rng.choice(STARTS if wide else STARTS[:2])
    positions = torch.randint(low, high, (requests, 1), **g)
    positions = positions + torch.arange(tokens, device=device)
    if not wide:
        positions = positions.clamp(max=INT32_MAX)
    positions[torch.rand(requests, **g) < 0.08] = -1
    pads = torch.randint(1, 4, (requests, tokens), **g)
    positions = torch.where(torch.rand(requests, tokens, **g) < 0.03, -pads, positions)
    blocks = requests + 4
    owner = 1 + torch.randperm(requests + 3, **g)[:requests]
    tail_slots = owner[:, None] * key.ring + positions.clamp(min=0) % key.ring
    tail_slots[(positions < 0) | (torch.rand(requests, tokens, **g) < 0.05)] = -1
    pages = requests * tokens // key.page + 2
    free = torch.randperm(pages * key.page, **g)[: requests * tokens]
    completes = (positions >= 0) & (positions % POOL == POOL - 1)
    writes = completes & (torch.rand(requests, tokens, **g) < 0.9)
    writes |= torch.rand(requests, tokens, **g) < 0.05
    slots = torch.where(writes, free.view(requests, tokens), -1)
    edge = rng.choices(list(EDGES), weights=list(EDGES.values()))[0]
    if edge == "far" and wide:
        positions = positions + 2**32 * rng.randint(1, 8)
    modes = [rng.choice(list(MODES)) for _ in range(requests)]
    keys, scores = _update_values(modes, (requests, tokens, DIM), edge, rng, gen)
    ape = torch.randn(POOL, DIM, **g) * rng.choice([0.0, 0.1, 1.0, 10.0])
    if rng.random() < 0.1:
        ape = specials(ape, 0.02, gen)
    cache = torch.randint(0, 256, (pages * key.page_bytes,), dtype=torch.uint8, **g)
    tail = torch.randn(blocks * key.tail_block, **g).bfloat16()
    if "special" in modes:
        tail = specials(tail, 0.02, gen)
    tail_view = ((blocks, 2, key.ring, DIM), (key.tail_block, key.tail_half, DIM, 1))
    # The stashed pool members of "ties" requests tie with the current ones.
    ties = torch.tensor([m == "ties" for m in modes], device=device)
    ring = tail.as_strided(*tail_view)
    ring[owner[ties], 0], ring[owner[ties], 1] = keys[ties, :1], scores[ties, :1]
    rows = torch.randn(requests, tokens + rng.choice([0, 1]), DIM, **g).bfloat16()
    rows[:, :tokens] = keys
    arguments = dict(
        tail_slot_mapping=tail_slots.to(key.tail_slots_dtype),
        key=rows[:, :tokens],
        slot_score=scores,
        ape=ape,
        slot_mapping=slots.to(key.slots_dtype),
        positions=positions.to(key.positions_dtype),
    )
    arguments |= dict(pool_size=POOL, head_dim=DIM, round_scale=key.round_scale)
    cache_view = ((pages, key.page, DIM + 4), (key.page_bytes, DIM + 4, 1))
    want = (cache.clone(), tail.clone())
    kpool_compress.kpool_decode_update_and_maybe_write_cache_batched(
        want[0].as_strided(*cache_view), want[1].as_strided(*tail_view), **arguments
    )
    arguments |= dict(kv_cache=cache.as_strided(*cache_view), mx_scales=key.mx_scales)
    arguments["tail_kv_cache"] = tail.as_strided(*tail_view)
    return Case(arguments, (cache, tail), want)


def pool_ids(rows: int, groups: int, rng, gen, limit: int | None = None):
    """int32 pool ids as a top-k leaves them: below ``limit`` (drawn if
    None), -1 for rows shorter than the top-k, and a few whose int32 token
    ids wrap."""
    g = dict(generator=gen, device=gen.device)
    limit = limit or rng.choice([64, 4096, 1 << 20])
    ids = torch.randint(0, max(limit, 1), (rows, groups), **g)
    holes = torch.rand(rows, groups, **g) < rng.choice([0.0, 0.1, 0.5, 1.0])
    huge = torch.randint(1 << 29, INT32_MAX, (rows, groups), **g)
    ids = torch.where(torch.rand(rows, groups, **g) < 0.01, huge, ids)
    return torch.where(holes, -1, ids).to(torch.int32)


def lengths(rows: int, dtype, gen) -> torch.Tensor:
    """Sequence lengths (or positions): every residue mod 4, zero and
    negative ones; near 2^31 - 1; in int64 also at and beyond the int32
    range, of both signs, and far beyond it."""
    g = dict(generator=gen, device=gen.device)
    values = torch.randint(0, 300_000, (rows,), **g)
    short = torch.randint(-9, 5, (rows,), **g)
    pick = torch.rand(rows, **g)
    values = torch.where(pick < 0.1, short, values)
    if dtype == torch.int64:
        edge = torch.randint(2**31 - 6, 2**31 + 6, (rows,), **g)
        low = torch.randint(-(2**31) - 6, -(2**31) + 6, (rows,), **g)
        far = torch.randint(-(2**40), 2**40, (rows,), **g)
        values = torch.where(pick > 0.7, edge, torch.where(pick > 0.4, far, values))
        values = torch.where(pick > 0.95, low, values)
    else:
        edge = torch.randint(2**31 - 6, 2**31, (rows,), **g)
        values = torch.where(pick > 0.9, edge, values)
    return values.to(dtype)


def expand_case(rng: random.Random, gen: torch.Generator, key) -> Case:
    """Pool ids (some a column slice of a wider buffer) expanded into a row
    slice of a wider buffer; ``int32_lengths`` against stock's decode as
    written (``positions.to(torch.int32) + 1``) at offset 1."""
    rows = rng.choice([0, 1, 2, 7, 8, 64, 128, 256, rng.randint(1, 256)])
    cols = key.groups * POOL + POOL - 1
    width = cols + rng.choice([0, 1, 5, 128])
    width += -width % 4
    ids = pool_ids(rows, key.groups + rng.choice([0, 0, 64]), rng, gen)[:, : key.groups]
    seq_lens = lengths(rows + rng.randint(0, 2), key.seq_lens_dtype, gen)
    offsets = [1, 1, 1, 0, 3, -2] if key.int32_lengths else [0, 1, 1, 3, -2]
    seq_offset = rng.choice(offsets)
    out = poisoned((rows + 3, width), torch.int32, gen)
    want = out.clone()
    lens = seq_lens[:rows]
    expand = kpool_compress.expand_pools_and_append_tail
    if key.int32_lengths and seq_offset == 1 and rows:
        want[:rows, :cols] = expand(ids.long(), lens.to(torch.int32) + 1, POOL)
    elif rows:
        lens = lens.to(torch.int32) if key.int32_lengths else lens
        expand(ids, lens, POOL, seq_offset=seq_offset, out=want[:rows])
    arguments = dict(pool_ids=ids, seq_lens=seq_lens, pool_size=POOL, out=out[:rows])
    arguments |= dict(seq_offset=seq_offset, int32_lengths=key.int32_lengths)
    return Case(arguments, (out,), (want,))


def remap_case(rng: random.Random, gen: torch.Generator, key) -> Case:
    """The stock decode chain the fused remap replaces: -1 rows, the pool
    expansion into the first ``pool_ids.shape[0]`` (fewer rows: CUDA-graph
    padding), the conversion. Block tables as column slices, negative
    entries, pools past the table; positions at the int32 edge."""
    device = gen.device
    g = dict(generator=gen, device=device)
    rows = rng.choice([1, 2, 8, 64, 255, 256, rng.randint(1, 256)])
    expanded = rows if rng.random() < 0.7 else rng.randint(0, rows)
    requests, blocks = rng.randint(1, 64), rng.choice([1, 8, 100, 5000])
    table = torch.randint(0, 10_000, (requests, blocks + rng.choice([0, 3])), **g)
    table = table.to(torch.int32)[:, :blocks]
    if rng.random() < 0.2:  # negative entries map to negative slots
        table[torch.rand(table.shape, **g) < 0.1] *= -1
    req_ids = torch.randint(0, requests, (rows,), **g).to(torch.int32)
    ids = pool_ids(expanded, key.groups, rng, gen)
    near = (torch.rand(ids.shape, **g) < 0.5) & (ids >= 0)
    ids = torch.where(near, ids % max(blocks * key.block_size // POOL, 1), ids)
    dtype = key.positions_dtype
    positions = torch.randint(-3, blocks * key.block_size + 64, (rows,), **g)
    if rng.random() < (0.5 if dtype == torch.int64 else 0.2):
        positions = lengths(rows, dtype, gen).long() - 1
    positions = positions.to(dtype)
    logical = torch.full((rows, key.width), -1, dtype=torch.int32, device=device)
    cols, lens = key.groups * POOL + POOL - 1, positions[:expanded]
    expand = kpool_compress.expand_pools_and_append_tail
    if expanded and key.int32_lengths:  # stock's decode, as it is written
        logical[:expanded, :cols] = expand(ids.long(), lens.to(torch.int32) + 1, POOL)
    elif expanded:
        expand(ids, lens, POOL, seq_offset=1, out=logical[:expanded])
    out = poisoned((rows + 2, key.width), torch.int32, gen)
    counts = poisoned((rows + 3,), torch.int32, gen)
    want_out, want_counts = out.clone(), counts.clone()
    valid = want_counts[:rows] if key.counts else None
    layout = (key.block_size, key.stride_rows, key.width)  # BLOCK_SIZE, ...
    triton_convert_req_index_to_global_index(
        *(req_ids, table, logical, *layout),
        return_valid_counts=key.counts,
        out=want_out[:rows],
        valid_counts_out=valid,
    )
    arguments = dict(pool_ids=ids, positions=positions, pool_size=POOL)
    arguments |= dict(req_ids=req_ids, block_table=table, out=out[:rows])
    arguments |= dict(counts=counts[:rows] if key.counts else None)
    arguments |= dict(block_size=key.block_size, stride_rows=key.stride_rows)
    arguments |= dict(seq_offset=1, int32_lengths=key.int32_lengths)
    return Case(arguments, (out, counts), (want_out, want_counts))


def upcast_case(rng: random.Random, gen: torch.Generator, key) -> Case:
    """BF16 logits with specials in padded rows (rows across the CTA groups,
    widths 1 to 70,000); row ends at 0, the width, a few tiles in, anywhere,
    negative, and past the width into the padding (stock converts there too,
    but not past its last row). Stock's output is read only where it wrote."""
    device = gen.device
    g = dict(generator=gen, device=device)
    rows = [0, 1, 2, 3, GROUP_ROWS, GROUP_ROWS + 1, 256, rng.randint(1, 256), 1500]
    rows = rng.choice(rows)
    width = rng.choice([1, 7, 8, 1000, 16384, 65536, rng.randint(1, 70_000)])
    width = max(1, min(width, (1 << 24) // max(rows, 1)))
    stride = width + -width % 8 + rng.choice([0, 8, 64])
    values = (torch.randn(rows * stride, **g) * 30).bfloat16()
    values = specials(values, rng.choice([0.0, 0.001, 0.01]), gen)
    draw = torch.rand(rows, **g)
    ends = torch.randint(0, width + 1, (rows,), **g)
    ends[draw < 0.2] = width
    short = torch.randint(0, 3 * TILE, (rows,), **g).clamp(max=width)
    ends = torch.where((draw >= 0.2) & (draw < 0.4), short, ends)
    ends[draw > 0.97] = -torch.randint(1, 2**31, (1,), **g)
    last = torch.arange(rows, device=device) == rows - 1
    past = (draw > 0.93) & (draw <= 0.97) & ~last
    if stride > width:
        over = torch.randint(1, stride - width + 1, (rows,), **g)
        ends = torch.where(past, width + over, ends)
    ends = ends.to(torch.int32)
    logits = values.as_strided((rows, width), (stride, 1))
    out = poisoned((rows * stride,), torch.float32, gen)
    want = out.clone()
    if rows:
        stock = as_fp32_logits(logits, ends)
        below = torch.arange(stride, device=device)[None, :] < ends[:, None]
        at = below.view(-1).nonzero().view(-1)
        span = (rows - 1) * stride + width  # stock's own storage
        want[at] = stock.as_strided((span,), (1,)).index_select(0, at)
    view = out.as_strided((rows, width), (stride, 1))
    return Case(dict(logits=logits, row_ends=ends, out=view), (out,), (want,))


def select_reference(logits: torch.Tensor, ends: torch.Tensor, k: int):
    """``SelectKernel``'s contract (its docstring), by sorting: the
    self-check's expected rows, and the product's one host statement of the
    select's order key (the device's: ``order_key32``/``order_key16`` of
    ``cutedsl/common/ptx.py``). The tests hold it against their own
    statement of the contract (``select_contract.py``)."""
    rows, width = logits.shape
    full = (1 << 8 * logits.element_size()) - 1  # 0xFFFF or 0xFFFFFFFF
    sign = (full + 1) >> 1
    bits = logits.view(_BITS[logits.dtype]).long() & full
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
    for width in sorted(span * key.cluster for span in spans):
        if slice_capacity(width, key.dtype, key.cluster) == key.capacity:
            for rows in range(1, 257):
                if cluster_for(rows, width, key.dtype, sms) == key.cluster:
                    shapes.append((rows, width))
    small = [(rows, width) for rows, width in shapes if rows * width <= 1 << 23]
    return small or sorted(shapes)[:1] or [(1, key.capacity * key.cluster)]


SELECT_KINDS = ("normal", "ties", "equal", "relu", "zeros", "lowbits", "special")


def _select_values(rows: int, width: int, dtype, rng, gen) -> torch.Tensor:
    """Logits of one kind: normals of some scale; few distinct values
    (ties across the threshold); all equal; ReLU's plateaus of exact 0.0;
    +0.0 among the smallest positives and -0.0; keys that differ in their
    lowest bits; and specials sprinkled."""
    g = dict(generator=gen, device=gen.device)
    shape = (rows, width)
    kind = rng.choice(SELECT_KINDS)
    if kind == "ties":
        levels = torch.randn(rng.choice([1, 2, 3, 17]), **g)
        values = levels[torch.randint(0, levels.numel(), shape, **g)]
    elif kind == "equal":
        value = rng.choice([0.0, -0.0, 1.5, -2.0])
        values = torch.full(shape, value, device=gen.device)
    elif kind == "relu":
        values = (torch.randn(shape, **g) - rng.choice([0.0, 2.0, 3.5])).relu()
    elif kind == "zeros":  # +0.0, its pass-0 bin's smallest positives, -0.0
        tiny = torch.randint(1, 1 << 24, shape, **g, dtype=torch.int32)
        pick = torch.rand(shape, **g)
        rate = rng.choice([0.0, 0.002, 0.01, 0.5])
        values = torch.where(pick < rate, tiny.view(torch.float32), 0.0)
        values = torch.where(pick > 1 - rng.choice([0.0, 0.3]), -0.0, values)
    elif kind == "lowbits":  # one sign and exponent
        unit = 1 if dtype == torch.float32 else 1 << 16
        noise = torch.randint(0, rng.choice([2, 16, 256]), shape, **g) * unit
        values = (noise + rng.choice([0x3F800000, -0x40800000])).to(torch.int32)
        values = values.view(torch.float32)
    else:
        values = torch.randn(shape, **g) * rng.choice([1e-3, 1.0, 1e4])
    if dtype == torch.bfloat16:  # truncated: the BF16 keys stay distinct
        values = (values.view(torch.int32) >> 16).to(torch.int16).view(dtype)
    rate = rng.choice([0.0, 0.001, 0.05, 0.5] if kind == "special" else [0.0, 0.001])
    return specials(values, rate, gen)


def select_case(rng: random.Random, gen: torch.Generator, key, *, sms: int) -> Case:
    """A case of ``key`` on ``sms`` SMs, in one of its ``select_shapes``."""
    rows, width = rng.choice(select_shapes(key, sms))
    return select_rows_case(rng, gen, key, rows, width)


def select_rows_case(rng, gen: torch.Generator, key, rows: int, width: int) -> Case:
    """Logits of ``rows`` x ``width`` in padded rows whose padding (+NaN, the
    largest key) must never count; row ends at 0, 1, k-1, k, k+1, the width
    and past it, negative, anywhere; ``out`` a column slice of a wider
    buffer."""
    device, k, vector = gen.device, key.k, VECTOR[key.dtype]
    pitch = width + -width % vector + vector * rng.choice([0, 0, 1, 16])
    storage = special_values(key.dtype, device)[2:3].repeat(rows, pitch)
    storage[:, :width] = _select_values(rows, width, key.dtype, rng, gen)
    edges = [0, 1, k - 1, k, k + 1, width - 1, width, width + 5, -3, INT32_MAX]
    ends = [
        rng.choice(edges) if rng.random() < 0.5 else rng.randint(0, width)
        for _ in range(rows + rng.randint(0, 2))
    ]
    ends = torch.tensor(ends, dtype=torch.int32, device=device)
    out = poisoned((rows + 2, k + rng.choice([0, 32])), torch.int32, gen)
    want = out.clone()
    logits = storage[:, :width]
    want[:rows, :k] = select_reference(logits, ends, k)
    arguments = dict(logits=logits, ends=ends, k=k, out=out[:rows, :k])
    return Case(arguments, (out,), (want,))


def deep_gemm_scores(arguments: dict) -> torch.Tensor:
    """The stock call of a scores case's ``arguments``: DeepGEMM's
    ``fp8_fp4_paged_mqa_logits`` with its schedule metadata for this GPU
    (the CPU tests put a stand-in here)."""
    seq_lens, kv_cache = arguments["seq_lens"], arguments["kv_cache"]
    sms = sm_count(seq_lens.get_device())
    metadata = get_paged_mqa_logits_metadata(seq_lens, kv_cache.shape[1], sms)
    a = arguments
    args = (a["q"], kv_cache, a["weights"], seq_lens, a["block_table"], metadata)
    return fp8_fp4_paged_mqa_logits(*args, max_model_len=a["max_model_len"])


def _fp8(shape, gen) -> torch.Tensor:
    """Finite FP8 e4m3 values of both signs (bytes 0-119, a random sign)."""
    g = dict(generator=gen, device=gen.device)
    magnitude = torch.randint(0, 120, shape, **g, dtype=torch.uint8)
    sign = torch.randint(0, 2, shape, **g, dtype=torch.uint8) << 7
    return (magnitude | sign).view(torch.float8_e4m3fn)


def _paged_cache(contexts: list[int], block: int, width: int, rng, gen):
    """A paged index cache ``[blocks, block, 1, 132]`` (each page: ``block``
    FP8 rows, then their FP32 scales, some 0) holding ``contexts`` pools,
    and a block table of ``width`` pools' pages or more (vLLM's covers
    ``max_model_len``): each entry's pages in a random order, then other ids
    of the cache."""
    g = dict(generator=gen, device=gen.device)
    pages = [-(-n // block) for n in contexts]
    blocks = sum(pages) + rng.randint(1, 7)
    cache = _fp8((blocks, block * (DIM + 4)), gen).view(torch.uint8)
    scales = torch.rand(blocks, block, **g) * rng.choice([1e-4, 1e-2, 1.0])
    scales[torch.rand(blocks, block, **g) < 0.05] = 0
    cache[:, block * DIM :] = scales.view(torch.uint8).view(blocks, -1)
    columns = -(-width // block) + rng.randint(0, 4)
    table = torch.randint(0, blocks, (len(contexts), columns), **g).to(torch.int32)
    order = torch.randperm(blocks, **g).to(torch.int32)
    taken = 0
    for entry, count in enumerate(pages):
        table[entry, :count] = order[taken : taken + count]
        taken += count
    return cache.view(blocks, block, 1, DIM + 4), table


def scores_case(rng: random.Random, gen: torch.Generator, key) -> Case:
    """A decode step in ``key``'s layout: 1-16 entries of FP8 queries and
    FP32 weights (the upper half of the heads zero, as vLLM pads them, in
    some), contexts of 1 to 6000 pools whose next_n rows end one pool apart,
    ``max_model_len`` a bit above the longest, ``out`` on DeepGEMM's row
    stride. Fewer than 32 heads come as the stage hands them on: views of
    the first heads of vLLM's zero-padded 32, which DeepGEMM scores. Stock's
    bytes below each entry's context, the rest untouched."""
    g = dict(generator=gen, device=gen.device)
    entries = rng.choice([1, 2, 3, 8, 16, rng.randint(1, 16)])
    # Never 0: DeepGEMM's SM90 kernel scores some pages of the entry after a
    # context-0 one with that entry's query and weights (its stock twin is
    # wrong there; ours is not).
    limits = [70, 600, 4000, 6000]
    contexts = [rng.randint(1, rng.choice(limits)) for _ in range(entries)]
    next_n, heads, padded = key.next_n, key.heads, max(key.heads, 32)
    width = max(contexts) + rng.randint(0, 300)
    kv_cache, table = _paged_cache(contexts, key.block, width, rng, gen)
    q = _fp8((entries, next_n, padded, DIM), gen)
    weights = torch.randn(entries * next_n, padded, **g) * heads**-0.5
    zero = heads if heads < padded else heads // 2 if rng.random() < 0.3 else padded
    q.view(torch.uint8)[:, :, zero:] = 0  # +0.0
    weights[:, zero:] = 0
    last = torch.tensor(contexts, dtype=torch.int32, device=gen.device)
    ahead = torch.arange(next_n - 1, -1, -1, dtype=torch.int32, device=gen.device)
    seq_lens = (last[:, None] - ahead).clamp(min=0).contiguous()
    arguments = dict(q=(q, None), kv_cache=kv_cache, weights=weights)
    arguments |= dict(seq_lens=seq_lens, block_table=table, max_model_len=width)
    stock = deep_gemm_scores(arguments).view(torch.int32)
    arguments |= dict(q=(q[:, :, :heads], None), weights=weights[:, :heads])
    out = poisoned((entries * next_n, row_stride(width)), torch.float32, gen)
    want = out.clone()
    ends = last.clamp(max=width).repeat_interleave(next_n)
    below = torch.arange(width, device=gen.device)[None, :] < ends[:, None]
    # Read below the contexts only: DeepGEMM leaves the rest of its output
    # as allocated, and torch.where over it reads bytes no kernel wrote
    # (compute-sanitizer's initcheck reports each read).
    want.view(torch.int32)[:, :width][below] = stock[below]
    arguments["out"] = out[:, :width]
    return Case(arguments, (out,), (want,))


CASES = {UPDATE: update_case, EXPAND: expand_case, REMAP: remap_case}
CASES |= {UPCAST: upcast_case, SELECT: select_case, SCORES: scores_case}
