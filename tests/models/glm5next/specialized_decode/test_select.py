# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``cutedsl/select``: ``SELECT`` (``select_topk``, the opt-in select)
against its contract, computed from the contract alone
(``select_contract.contract_topk``), and against vLLM's own decode top-k.

The contract (``select/kernel.py``): per row the columns below
``clamp(end, 0, width)``; if ``end <= k``: ``0..end-1`` then -1; else
exactly ``k`` columns: all whose order key (IEEE totalOrder: the bits with
the sign bit set for a positive sign, all bits flipped for a negative one;
BF16 on 16 bits) is above the k-th largest key ``T`` and, of those equal to
``T``, the lowest ids; listed ascending.

CPU: ``contract_topk`` against hand-made rows, and ``cases.select_reference``
(the self-check's) against ``contract_topk`` on random and adversarial rows;
the rule at its edges and on layouts; the cluster choice; the keys the
warmup lists and those ``select_shapes`` draws; the compile for sm_90a and
sm_100a and its PTX. GPU: the fuzz loop over ``cases.select_case``
against ``contract_topk`` (the whole output buffer), the edges, sparse
attention over the select's order; with ``KPOOL_STOCK_TOPK_SO``, vLLM
0.33.0's ``cooperative_topk`` / ``persistent_topk`` (the wheel's binary,
``tools/kernel_env/stock_topk.py``): the same sets where no tie straddles
the threshold, and the NaN rows measured."""

import random
import sys
from collections import Counter
from pathlib import Path

import draws
import pytest
import torch
from kernel_ptx import compile_ptx, entry_resources, ops, resources
from kpool_fuzz import FUZZ_REPORT, fuzz, fuzz_seed, launch_case, report
from rule_edges import (
    SMS,
    declared_disagreements,
    devices_named,
    missing,
    shape_disagreements,
)

from vllm.models.glm5next.nvidia.specialized_decode import cases
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select import (
    launch as select,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select.kernel import (
    CAPACITIES,
    THREADS,
    VECTOR,
    ctas_per_sm,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select.launch import (
    CLUSTERS,
    MAX_K,
    SELECT,
    SPLIT_CHUNK,
    cluster_for,
    one_wave,
    slice_capacity,
    split_capacity,
    split_chunk,
    split_parts,
)

# select_contract.py (one directory up: the simulator's too).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from select_contract import contract_topk, order_key  # noqa: E402

F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32
K = 512  # GLM-5-Next's index_topk 2048 / index_kpool 4
WIDEST = 16 * 53248

# --- The contract -------------------------------------------------------------------


def straddles(logits: torch.Tensor, ends: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: whether columns equal to the k-th largest key are left out
    (a tie straddles the threshold: the set then depends on the tie
    choice)."""
    rows, width = logits.shape
    end = ends[:rows].long().clamp(0, width)
    keys = torch.where(
        torch.arange(width, device=logits.device)[None, :] < end[:, None],
        order_key(logits),
        -1,
    )
    found = torch.zeros(rows, dtype=torch.bool, device=logits.device)
    long = (end > k).nonzero().view(-1)
    if long.numel():
        row_keys = keys[long]
        threshold = torch.kthvalue(row_keys, width - k + 1, dim=1).values[:, None]
        found[long] = (row_keys >= threshold).sum(1) > k
    return found


def words(values, dtype=F32) -> torch.Tensor:
    """FP32 or BF16 values of 32-bit patterns (a BF16 takes the upper half)."""
    bits = torch.tensor(values, dtype=torch.int64).to(torch.int32)
    return bits.view(F32) if dtype == F32 else (bits >> 16).to(torch.int16).view(BF16)


# -NaN < -inf < -1 < -denormal < -0.0 < +0.0 < +denormal < 1 < +inf < +NaN
LADDER = [0xFFC00000, 0xFF800000, 0xBF800000, 0x80010000, 0x80000000]
LADDER += [0x00000000, 0x00010000, 0x3F800000, 0x7F800000, 0x7FC00000]


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_order_key_is_total_order(dtype):
    keys = order_key(words(LADDER, dtype))
    assert torch.all(keys[1:] > keys[:-1])
    assert torch.equal(order_key(words([0xFFFFFFFF], dtype)), torch.tensor([0]))


def test_contract_topk_by_hand():
    """Hand-made rows: the ladder's largest; ties to the lower ids, listed
    ascending; short rows; ends clamped to [0, width]."""
    ladder = words(LADDER)
    perm = [3, 9, 0, 5, 7, 1, 8, 2, 6, 4]
    shuffled = ladder[perm][None, :]
    # The three largest keys: +NaN (at 1), +inf (at 6), 1.0 (at 4).
    assert contract_topk(shuffled, torch.tensor([10]), 3).tolist() == [[1, 4, 6]]
    ties = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5, 2.0]])
    assert contract_topk(ties, torch.tensor([6]), 2).tolist() == [[1, 2]]
    assert contract_topk(ties, torch.tensor([6]), 5).tolist() == [[0, 1, 2, 3, 5]]
    assert contract_topk(ties, torch.tensor([3]), 4).tolist() == [[0, 1, 2, -1]]
    assert contract_topk(ties, torch.tensor([-5]), 2).tolist() == [[-1, -1]]
    assert contract_topk(ties, torch.tensor([99]), 6).tolist() == [list(range(6))]
    assert contract_topk(ties, torch.tensor([5]), 3).tolist() == [[1, 2, 3]]
    zeros = words([0x80000000, 0x00000000, 0x80000000, 0x00000000])[None, :]
    assert contract_topk(zeros, torch.tensor([4]), 2).tolist() == [[1, 3]]


def adversarial_rows(gen: torch.Generator, dtype, k: int, width: int):
    """(logits, ends) of rows that tell a wrong reference apart: plateaus
    across the threshold (all equal, few levels, ReLU's exact zeros), NaNs
    of both signs, +-inf, +-0.0, denormals, the largest key just at a row's
    end, ends at 0, 1, k-1, k, k+1, width-1, width, past it, negative."""
    g = dict(generator=gen)
    rows = []
    special = cases.special_values(dtype, "cpu")
    for end in (0, 1, k - 1, k, k + 1, width - 1, width, width + 5, -3, 2**31 - 1):
        normal = torch.randn(width, **g)
        rows += [
            (normal, end),
            (torch.zeros(width), end),
            (torch.full((width,), 1.5), end),
            (torch.randint(0, 3, (width,), **g).float(), end),
            ((torch.randn(width, **g) - 1).relu(), end),
        ]
    plain = [(v.to(dtype) if dtype == F32 else _truncated(v), e) for v, e in rows]
    for _ in range(40):  # specials over normals and plateaus
        base = (
            torch.randn(width, **g).round()
            if len(plain) % 2
            else torch.randn(width, **g)
        )
        values = _truncated(base) if dtype == BF16 else base
        values = cases.specials(values, 0.3, gen)
        plain.append((values, int(torch.randint(-2, width + 3, (1,), **g))))
    for end in (k + 1, width // 2, width - 1):  # the largest key at the end
        values = (
            _truncated(torch.randn(width, **g))
            if dtype == BF16
            else torch.randn(width, **g)
        )
        values[end:] = special[2]  # CUDA's +NaN, the largest key
        plain.append((values, end))
    logits = torch.stack([v for v, _ in plain])
    ends = torch.tensor([e for _, e in plain], dtype=I32)
    return logits, ends


def _truncated(values: torch.Tensor) -> torch.Tensor:
    return (values.float().view(torch.int32) >> 16).to(torch.int16).view(BF16)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("k, width", [(1, 7), (4, 9), (8, 64), (8, 8), (16, 17)])
def test_select_reference_is_the_contract(dtype, k, width):
    """``cases.select_reference`` (the self-check's expected rows) equals
    ``contract_topk`` on the adversarial rows."""
    gen = torch.Generator().manual_seed(1000 * k + width)
    logits, ends = adversarial_rows(gen, dtype, k, width)
    got = cases.select_reference(logits, ends, k)
    want = contract_topk(logits, ends, k)
    bad = (got != want).any(1).nonzero().view(-1).tolist()
    assert not bad, f"rows {bad[:5]}: {got[bad[0]].tolist()} != {want[bad[0]].tolist()}"


@pytest.mark.parametrize("seed", range(6))
def test_select_reference_on_drawn_cases(seed):
    """... and on what ``draws.select_case`` draws (its expected rows are
    ``select_reference``'s; the buffer's other bytes are the random ones it
    starts with)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    case = draws.select_case(rng, gen, SMS)
    logits, ends, k = (case.arguments[n] for n in ("logits", "ends", "k"))
    rows = logits.shape[0]
    assert torch.equal(case.expected[0][:rows, :k], contract_topk(logits, ends, k))


# --- The rule (CPU) -------------------------------------------------------------------


def rule(a: dict) -> str | None:
    """The select's rule on shapes and scalars, as its messages state it: an
    int k in [1, 4096] (no bool); at most ``WIDEST`` columns in rows
    16-byte aligned; an end per row at least; ``out`` (optional) of [rows,
    k]."""
    named = devices_named(a, ("logits", "ends", "out"), optional=("out",))
    if named:
        return named
    k = a["k"]
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
        return "k"
    rows, width = a["logits"].shape
    if width > WIDEST or a["logits"].stride(0) % VECTOR[a["logits"].dtype]:
        return "logits"
    if a["ends"].shape[0] < rows:
        return "ends"
    if a["out"] is not None and tuple(a["out"].shape) != (rows, k):
        return "out"
    return None


def test_rule_at_its_edges():
    """Each dimension of each tensor one below, at and one above its size
    and the sizes the rule bounds it by (the rows, k, the widest row); k at
    1 and 4096 and past them; the type and device checks: refused exactly
    where ``rule`` says, naming the argument."""
    assert shape_disagreements(SELECT, rule) == []


@pytest.mark.parametrize("name", ["logits", "ends"])
def test_a_missing_tensor_is_refused(name):
    assert missing(SELECT, name) == []


def test_rule_on_layouts_and_dtypes():
    """The layouts of ``rule_layouts.py`` and each tensor in float64:
    refused naming the argument they declare, or taken."""
    assert declared_disagreements(SELECT) == []


# --- The cluster choice, the warmup's keys, the cases' shapes (CPU) ---------------


def test_cluster_for_rows_and_width():
    """Most CTAs a row while the rows' CTAs fill at most half the SMs and
    slices keep 4096 keys (16-CTA clusters: 8192, at most 4 rows); the fewest that
    fit in shared memory past that; and which row counts fit one wave."""
    assert slice_capacity(1, F32, 8) == CAPACITIES[0]
    assert slice_capacity(65536, F32, 8) == 8192
    assert slice_capacity(65536 + 4, F32, 8) == 16384
    assert slice_capacity(262144, BF16, 16) == 16384
    assert slice_capacity(8 * 4096 + 8, BF16, 8) == 8192  # rounded to 8 columns
    assert slice_capacity(8 * 4096, BF16, 8) == 4096
    assert slice_capacity(65536, F32, 1) == 0
    assert slice_capacity(WIDEST + 1, F32, 16) == 0
    choices = {
        (1, 600): 1,
        (256, 4096): 1,
        (1, 16384): 4,
        (16, 16384): 4,
        (17, 16384): 2,
        (1, 32768): 8,
        (1, 65536): 8,
        (4, 131072): 16,
        (5, 131072): 8,
        (8, 65536): 8,
        (16, 65536): 4,
        (32, 65536): 2,
        (64, 65536): 2,
        (256, 65536): 2,
        (1, 262144): 16,
        (4, 262144): 16,
        (5, 262144): 8,
        (16, 262144): 8,
        (256, 262144): 8,
        (1, WIDEST): 16,
    }
    for (rows, width), cluster in choices.items():
        assert cluster_for(rows, width, F32, SMS) == cluster, (rows, width)
    assert cluster_for(1, WIDEST + 4, F32, SMS) is None
    # 2 CTAs of 128 KiB a row (1 an SM) at 65536 pools: 66 rows a wave; 8 at
    # 262144 pools: 16 rows.
    assert one_wave(64, 65536, F32, SMS) and not one_wave(67, 65536, F32, SMS)
    assert one_wave(16, 262144, BF16, SMS) and not one_wave(17, 262144, BF16, SMS)
    assert one_wave(256, 4096, F32, SMS)  # 16 KiB CTAs, 2 an SM
    assert not one_wave(1, WIDEST + 4, F32, SMS)


def test_key_follows_the_devices_sm_count():
    """``spec`` derives the cluster size from the SMs of the logits' device,
    as the warmup's keys do: 8 CTAs a row at 1 x 65536 pools on 132 SMs, 4
    on 8."""
    from rule_edges import allow_cpu

    logits, ends = torch.zeros(1, 65536), torch.zeros(1, dtype=I32)
    with allow_cpu():
        assert SELECT.spec(logits=logits, ends=ends, k=K)[0].cluster == 8
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(select, "sm_count", lambda index: 8)
            assert SELECT.spec(logits=logits, ends=ends, k=K)[0].cluster == 4


def test_sm_count_reads_the_device_index(monkeypatch):
    properties = {
        i: type("P", (), {"multi_processor_count": 100 + i}) for i in range(4)
    }
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties.__getitem__)
    select.sm_count.cache_clear()
    try:
        assert [select.sm_count(i) for i in (0, 3, 0)] == [100, 103, 100]
    finally:
        select.sm_count.cache_clear()


WIDTHS = (1000, 1024, 16384 + 8, 65536, 100000, 262144, WIDEST)


@pytest.mark.parametrize("routed", [False, True], ids=["cluster", "split-routed"])
@pytest.mark.parametrize("one_wave_only", [False, True])
def test_warmup_keys_are_what_spec_derives(one_wave_only, routed, monkeypatch):
    """``get_warmup_keys(max_rows=R, ...)`` lists the keys ``spec`` derives
    for 1 to R rows of the width (``one_wave_only``: of those that fit one
    wave), each once; with the split select routed past one wave
    (``SPLIT_PAST_ONE_WAVE``), its keys among them."""
    from rule_edges import allow_cpu

    monkeypatch.setattr(select, "SPLIT_PAST_ONE_WAVE", routed)
    split = set()
    for dtype in (F32, BF16):
        for width in WIDTHS:
            listed = SELECT.get_warmup_keys(
                max_rows=80,
                one_wave_only=one_wave_only,
                k=K,
                dtype=dtype,
                width=width,
                sms=SMS,
            )
            derived = {}
            with allow_cpu():
                for rows in range(1, 81):
                    if not one_wave_only or one_wave(rows, width, dtype, SMS):
                        logits = torch.zeros(1, width, dtype=dtype).expand(rows, -1)
                        ends = torch.zeros(rows, dtype=I32)
                        derived[SELECT.spec(logits=logits, ends=ends, k=K)[0]] = None
            assert listed == list(derived), (dtype, width)
            split |= {key for key in listed if key.chunk}
    # Routed, past one wave of 80 rows: 64K-pool and wider rows.
    assert bool(split) == (routed and not one_wave_only), split


def test_select_shapes_derive_every_key():
    """Each key a warmup can compile (1-256 rows, 4K-1M-token widths and
    odd ones) has ``select_shapes`` that derive it: the self-check draws
    every key it checks."""
    keys = set()
    for dtype in (F32, BF16):
        for width in WIDTHS:
            for rows in range(1, 257):
                keys.add(
                    SELECT.dispatch(k=K, dtype=dtype, rows=rows, width=width, sms=SMS)
                )
    assert {key.cluster for key in keys} == set(CLUSTERS)
    for key in keys:
        shapes = cases.select_shapes(key, SMS)
        assert shapes, key
        for rows, width in shapes:
            got = SELECT.dispatch(k=K, dtype=key.dtype, rows=rows, width=width, sms=SMS)
            assert got == key, (key, rows, width)


def _split_keys() -> set:
    """The split select's keys of every width it takes up to ``WIDEST`` (one
    a capacity), FP32 and BF16."""
    keys = set()
    for dtype in (F32, BF16):
        for width in range(SPLIT_CHUNK, WIDEST + 1, SPLIT_CHUNK // 2):
            key = SELECT.dispatch(
                k=K, dtype=dtype, rows=1, width=width, sms=SMS, split=True
            )
            if key.chunk:
                keys.add(key)
    return keys


def test_split_widths_derive_every_split_key():
    """Each split key has ``cases.split_widths`` that derive it and that the
    rule takes, up to the widest row (the self-check and the fuzz loop draw
    every one)."""
    from rule_edges import allow_cpu

    keys = _split_keys()
    assert {key.capacity for key in keys} == {4096, 8192, 16384, 32768}
    widest = set()
    for key in keys:
        widths = cases.split_widths(key, random.Random(key.capacity))
        assert widths, key
        widest.add(max(widths))
        for width in widths:
            logits = torch.zeros(1, width + -width % 8, dtype=key.dtype)[:, :width]
            ends = torch.zeros(1, dtype=I32)
            with allow_cpu():
                got = SELECT.spec(logits=logits, ends=ends, k=K, split=True)[0]
            assert got == key, (key, width)
    assert WIDEST in widest


# --- The split select (CPU) -----------------------------------------------------------


def test_split_routing():
    """The split select takes rows of two chunks and more whose candidates
    (``k`` a chunk) one CTA holds, ``k`` a multiple of 4; routed
    (``split=None``) only past one wave with ``SPLIT_PAST_ONE_WAVE``, which
    is off: asked for (``split=True``), wherever it takes the shape."""
    assert split_parts(SPLIT_CHUNK, K) == 0
    assert split_parts(SPLIT_CHUNK + 1, K) == 2
    assert split_parts(262144, K) == 16 and split_capacity(262144, K) == 8192
    assert split_parts(WIDEST, K) == 52 and split_capacity(WIDEST, K) == 32768
    assert split_parts(262144, 4096) == 0  # 16 x 4096 candidates
    assert split_parts(262144, 2048) == 16 and split_capacity(262144, 2048) == 32768
    assert split_parts(65536, K - 2) == 0
    assert not select.SPLIT_PAST_ONE_WAVE
    assert split_chunk(256, 262144, K, F32, SMS) == 0
    assert split_chunk(1, 262144, K, F32, SMS, True) == SPLIT_CHUNK
    assert split_chunk(256, 262144, K, F32, SMS, False) == 0
    assert split_chunk(256, SPLIT_CHUNK, K, F32, SMS, True) == 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(select, "SPLIT_PAST_ONE_WAVE", True)
        assert split_chunk(16, 262144, K, F32, SMS) == 0  # one wave
        assert split_chunk(17, 262144, K, F32, SMS) == SPLIT_CHUNK
        key = SELECT.dispatch(k=K, dtype=F32, rows=17, width=262144, sms=SMS)
        assert key == SELECT.CompileKey(K, F32, 1, 8192, chunk=SPLIT_CHUNK)
        # The fed select keeps its own key.
        fed = SELECT.dispatch(k=K, dtype=F32, rows=17, width=262144, sms=SMS, fed=True)
        assert fed.chunk == 0 and fed.columns == 262144


def split_model(logits, ends, k: int, chunk: int) -> torch.Tensor:
    """The split select's two launches on the contract alone:
    ``contract_topk`` of each chunk of ``chunk`` columns, then of the row's
    candidates (chunk ``c``'s at positions ``c * k`` on), each position
    mapped back to the column it stands for."""
    rows, width = logits.shape
    parts = -(-width // chunk)
    end = ends[:rows].long().clamp(0, width)
    firsts = torch.arange(parts) * chunk
    padded = logits.new_zeros((rows, parts * chunk))
    padded[:, :width] = logits  # bit for bit (NaN payloads too)
    chunk_ends = (end[:, None] - firsts[None]).clamp(0, chunk).to(I32)
    picked = contract_topk(
        padded.view(rows * parts, chunk), chunk_ends.view(-1), k
    ).view(rows, parts, k)
    valid = (picked >= 0).view(rows, -1)
    candidates = (picked.long() + firsts[None, :, None]).view(rows, -1)
    n = valid.sum(1)
    # The valid candidates are positions [0, n), n as the merge counts them.
    assert torch.equal(valid, torch.arange(parts * k)[None] < n[:, None])
    full = end // chunk
    assert torch.equal(n, full * k + (end - full * chunk).clamp(max=k))
    # Gathered as bits: torch's CPU gather of BF16 does not keep NaNs' bits.
    bits = logits.view(torch.int32 if logits.dtype == F32 else torch.int16)
    values = bits.gather(1, candidates.clamp(0, width - 1)).view(logits.dtype)
    positions = contract_topk(values, n.to(I32), k).long()
    mapped = candidates.gather(1, positions.clamp(min=0))
    return torch.where(positions >= 0, mapped, -1).to(I32)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(
    "k, chunk, width",
    [(4, 16, 17), (4, 16, 64), (8, 32, 100), (8, 32, 259), (16, 64, 1000)],
)
def test_split_model_is_the_contract(dtype, k, chunk, width):
    """Why the split select's bytes are the select's: on the adversarial
    rows (plateaus across the threshold, specials, every edge of the ends)
    and on drawn ones, the contract's top ``k`` of each chunk, then of
    their candidates, is the contract's top ``k`` of the row."""
    gen = torch.Generator().manual_seed(width * k + chunk)
    logits, ends = adversarial_rows(gen, dtype, k, width)
    rng = random.Random(width)
    drawn = [cases._select_values(8, width, dtype, rng, gen) for _ in range(12)]
    logits = torch.cat([logits, *drawn])
    chunk_ends = [0, chunk - 1, chunk, chunk + 1, chunk + k, 2 * chunk, width]
    more = [rng.choice(chunk_ends + [rng.randint(0, width)]) for _ in range(96)]
    ends = torch.cat([ends, torch.tensor(more, dtype=I32)])
    want = contract_topk(logits, ends, k)
    got = split_model(logits, ends, k, chunk)
    bad = (got != want).any(1).nonzero().view(-1).tolist()
    assert not bad, f"rows {bad[:5]}"


def test_split_model_at_the_kernels_chunk():
    """... at ``SPLIT_CHUNK`` and k 512, 3 chunks and a few columns."""
    width = 2 * SPLIT_CHUNK + 5
    gen = torch.Generator().manual_seed(3)
    logits, ends = adversarial_rows(gen, F32, K, width)
    assert torch.equal(
        split_model(logits, ends, K, SPLIT_CHUNK), contract_topk(logits, ends, K)
    )


# --- Compile (CPU) ----------------------------------------------------------------

# (arch, cluster size, shared key capacity): the builds 64K-256K-pool widths
# take at 1 to 256 rows.
BUILDS = [
    ("sm_90a", 8, 8192),
    ("sm_90a", 2, 32768),
    ("sm_90a", 16, 16384),
    ("sm_100a", 8, 32768),
    ("sm_100a", 1, 4096),
]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch,cluster,capacity", BUILDS)
def test_select_ptx(arch, cluster, capacity, dtype):
    """PDL; no spills; 16-byte row loads; the keys (sign-extended masks,
    then xor); shared histogram counts; the slice resident in shared
    memory; the peers' histograms through distributed shared memory; the
    cluster barriers, one a pass and the exit's split arrive / wait (none
    in a 1-CTA build: CTA barriers); a BF16 row end's single columns."""
    text = compile_ptx(SELECT, SELECT.CompileKey(K, dtype, cluster, capacity), arch)
    count = ops(text)
    assert (
        count["griddepcontrol.wait"] == count["griddepcontrol.launch_dependents"] == 1
    )
    assert ".local" not in text, "spills to local memory"
    # As many CTAs an SM as one_wave counts on: ptxas is asked for them.
    ctas = ctas_per_sm(capacity)
    assert (".minnctapersm 2" in text) == (ctas == 2)
    registers, spilled = resources(text, arch)
    assert registers * THREADS * ctas <= 65536 and spilled == 0, (registers, spilled)
    assert "ld.global.nc.v4.b32" in text
    assert "shr.s32 m," in text and "or.b32 m,m,0x80000000" in text
    assert "red.shared.add" in text or "atom.shared.add" in text
    assert "st.shared.v4.b32" in text and "ld.shared.v4.b32" in text
    passes = 4 if dtype == F32 else 2
    if cluster == 1:
        assert "barrier.cluster" not in text and "mapa" not in text
    else:
        assert "mapa.shared::cluster.u32" in text
        # One barrier a pass; the exit's wait, and its arrive after the last
        # pass or after each earlier one where the passes end early.
        assert text.count("barrier.cluster.arrive") == 2 * passes
        assert text.count("barrier.cluster.wait") == passes + 1
    if dtype == BF16:
        assert "ld.global.nc.b16" in text


@pytest.mark.parametrize("columns", select.FED_COLUMNS)
def test_fed_select_ptx(columns):
    """The fed select: PDL; no spills within one 1024-thread CTA's 64
    registers; 16-byte row loads; the keys; the histogram's words read and
    zeroed; shared counts and bitmap words; no cluster."""
    key = SELECT.CompileKey(K, F32, 1, 0, columns)
    text = compile_ptx(SELECT, key, "sm_90a")
    count = ops(text)
    assert (
        count["griddepcontrol.wait"] == count["griddepcontrol.launch_dependents"] == 1
    )
    assert ".local" not in text, "spills to local memory"
    registers, spilled = resources(text, "sm_90a")
    assert registers * THREADS <= 65536 and spilled == 0, (registers, spilled)
    assert "ld.global.nc.v4.b32" in text
    assert "shr.s32 m," in text and "or.b32 m,m,0x80000000" in text
    assert "atom.shared.or.b32" in text or "red.shared.or.b32" in text
    assert "vote.sync.any.pred" in text and "vote.sync.ballot.b32" in text
    assert "barrier.cluster" not in text and "mapa" not in text


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "passes"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_split_select_ptx(arch, dtype, lean, monkeypatch):
    """The split select: two kernels, each with PDL; the chunks' two CTAs an
    SM (32 registers), the merge's one, neither spilling; the chunks' 16-byte
    row loads; the merge's 16-byte reads of the workspace and single
    gathers of the logits; no cluster. Lean (``split.LEAN``): the bitmaps'
    shared ORs, no compaction's global store a key; else the select's own
    passes and compaction."""
    from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select import split

    monkeypatch.setattr(split, "LEAN", lean)
    key = SELECT.CompileKey(K, dtype, 1, split_capacity(262144, K), chunk=SPLIT_CHUNK)
    text = compile_ptx(SELECT, key, arch)
    assert ("atom.shared.or.b32" in text or "red.shared.or.b32" in text) == lean
    count = ops(text)
    assert text.count(".entry") == 2
    assert (
        count["griddepcontrol.wait"] == count["griddepcontrol.launch_dependents"] == 2
    )
    assert ".local" not in text, "spills to local memory"
    assert ".minnctapersm 2" in text and ".minnctapersm 1" in text
    used = entry_resources(text, arch)
    chunk = next(v for name, v in used.items() if "ChunkSelect" in name)
    merge = next(v for name, v in used.items() if "MergeSelect" in name)
    assert chunk[0] <= 32 and chunk[1] == 0, chunk
    assert merge[0] <= 64 and merge[1] == 0, merge
    assert "ld.global.nc.v4.b32" in text
    assert "barrier.cluster" not in text and "mapa" not in text
    gather = "ld.global.nc.b32" if dtype == F32 else "ld.global.nc.b16"
    assert gather in text


# --- GPU: the contract ----------------------------------------------------------------


def _cluster_keys(sms: int) -> list:
    """A key of each cluster size on ``sms`` SMs (the fuzz loop's first
    cases: a short run, as the sanitizer's, launches all five)."""
    keys = {}
    for width in (4096, 65536, 262144):
        for rows in (1, 2, 4, 8, 16, 64):
            key = SELECT.dispatch(k=K, dtype=F32, rows=rows, width=width, sms=sms)
            keys.setdefault(key.cluster, key)
    return [keys[c] for c in CLUSTERS if c in keys]


def _check(case, clusters: Counter, allocate: bool) -> str | None:
    logits, ends, k = (case.arguments[n] for n in ("logits", "ends", "k"))
    rows = logits.shape[0]
    clusters[SELECT.spec(**case.arguments)[0].cluster] += 1
    clusters[str(logits.dtype)[6:]] += 1
    want = case.expected[0].clone()
    want[:rows, :k] = contract_topk(logits, ends, k)
    if not torch.equal(want, case.expected[0]):
        return f"{draws.about(case)}: select_reference differs from the contract"
    got = SELECT(**case.arguments)
    torch.cuda.synchronize()
    if got is not case.arguments["out"] or not torch.equal(case.written[0], want):
        bad = (case.written[0] != want).any(1).nonzero().view(-1)
        return f"{draws.about(case)}: rows {bad[:8].tolist()} differ"
    if allocate:
        made = SELECT(logits=logits, ends=ends, k=k)
        if made.shape != (rows, k) or not torch.equal(made, want[:rows, :k]):
            return f"{draws.about(case)}: the allocated output differs"
    return None


@pytest.mark.gpu
def test_select_matches_the_contract():
    """Every byte of the output buffer (rows and columns past ``out``
    included) against ``contract_topk``; the first cases take each cluster
    size in turn; 1 in 10 also allocates its output."""
    from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select.launch import (
        sm_count,
    )

    sms = sm_count(torch.cuda.current_device())
    firsts, clusters = _cluster_keys(sms), Counter()
    drawn = [0]

    def check(rng, gen):
        first = firsts[drawn[0]] if drawn[0] < len(firsts) else None
        drawn[0] += 1
        if first is None:
            case = draws.select_case(rng, gen, sms)
        else:
            case = cases.select_case(rng, gen, first, sms=sms)
        return _check(case, clusters, rng.random() < 0.1)

    try:
        fuzz("select_topk", 4000, check)
    finally:
        FUZZ_REPORT.append(
            "select_topk cases by cluster size and dtype: "
            f"{dict(sorted(clusters.items(), key=str))}"
        )
    assert set(clusters) >= {key.cluster for key in firsts[: drawn[0]]}


def aligned_rows(values: torch.Tensor) -> torch.Tensor:
    """``values`` on the GPU in rows 16-byte aligned, as DeepGEMM's are."""
    rows, width = values.shape
    stride = -(-width // 8) * 8
    padded = torch.zeros(rows, stride, dtype=values.dtype, device="cuda")
    return padded[:, :width].copy_(values)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [K + 1, 65536, 262144, WIDEST])
def test_select_edges(dtype, width):
    """Ends 0, 1, k-1, k, k+1 and full on all-zero, all -0.0, alternating
    signed zeros and all-specials rows, at each cluster size's widths."""
    ends_list = [0, 1, K - 1, K, K + 1, width]
    rows = len(ends_list)
    special = cases.special_values(dtype, "cuda")
    signed = torch.zeros(rows, width, dtype=dtype, device="cuda")
    signed[:, 1::2] = -0.0
    values = {
        "zeros": torch.zeros(rows, width, dtype=dtype, device="cuda"),
        "neg_zeros": torch.full((rows, width), -0.0, dtype=dtype, device="cuda"),
        "signed_zeros": signed,
        "specials": special[torch.arange(rows * width, device="cuda") % len(special)],
    }
    ends = torch.tensor(ends_list, dtype=I32, device="cuda")
    for name, value in values.items():
        logits = aligned_rows(value.view(rows, width))
        got = SELECT(logits=logits, ends=ends, k=K)
        assert torch.equal(got, contract_topk(logits, ends, K)), name


# Batch sizes of the invariance test: one row, small batches, one wave and
# past it (132 SMs: 66 rows of 64K FP32 pools, 16 of 256K), the largest.
BATCHES = (1, 2, 3, 8, 17, 64, 67, 100, 131, 200, 256)
PROBES = 6


def _probe_rows(dtype, width: int, gen: torch.Generator):
    """``PROBES`` rows of a request each: random normals (two of them with a
    plateau of equal values across the threshold), ends full, random, short
    and at most ``K``; positions; a block table row each."""
    g = dict(device="cuda", generator=gen)
    logits = torch.randn(PROBES, width, **g).to(dtype)
    logits[1, : width // 2] = 1.0
    logits[4, ::3] = 0.0
    ends = torch.tensor([width, width, K, width // 3, 1 + width // 7, width - 5])
    ends = ends.to(I32).cuda()
    pages = 4 * width // 64 + 1
    table = torch.randint(0, 1 << 20, (PROBES, pages), **g).to(I32)
    return logits, ends, table


def _select_and_remap(logits, ends, table, split=None):
    """The opt-in select (``split``: the split select's argument) and the
    fused remap of the rows (the stage's chain after the scores): pool ids,
    physical slots, counts."""
    from vllm.models.glm5next.nvidia.specialized_decode import kpool

    rows = logits.shape[0]
    pool_ids = kpool.select_topk(logits, ends, K, split=split)
    positions = ends.long() * 4 + 2
    width = K * 4 + 3
    slots = torch.full((rows, -(-width // 128) * 128), 7, dtype=I32, device="cuda")
    counts = torch.full((rows,), 7, dtype=I32, device="cuda")
    req_ids = torch.arange(rows, dtype=I32, device="cuda")
    kpool.expand_and_remap(
        pool_ids,
        positions,
        4,
        req_ids,
        table,
        slots,
        counts,
        block_size=64,
        stride_rows=64,
    )
    return pool_ids, slots, counts


@pytest.mark.gpu
@pytest.mark.parametrize("split", [None, True], ids=["routed", "split"])
def test_select_and_remap_bytes_do_not_depend_on_the_batch(split):
    """``PROBES`` rows at random places of batches of 1 to 256 rows beside
    random neighbours (FP32 and BF16, 16K to 256K pools; the split select,
    asked for: from 64K): every byte of their pool ids, slots and counts
    equals what they get alone, and alone their pool ids are the
    contract's."""
    seed = fuzz_seed()
    gen = torch.Generator("cuda").manual_seed(seed)
    rng = random.Random(seed)
    batches = compared = 0
    failures = []
    widths = (65536, 262144) if split else (16384, 65536, 262144)
    for dtype in (F32, BF16):
        for width in widths:
            logits, ends, table = _probe_rows(dtype, width, gen)
            alone = [
                _select_and_remap(
                    logits[i : i + 1], ends[i : i + 1], table[i : i + 1], split
                )
                for i in range(PROBES)
            ]
            want = contract_topk(logits, ends, K)
            for i, (ids, _, _) in enumerate(alone):
                if not torch.equal(ids[0], want[i]):
                    failures.append(f"{dtype} {width} probe {i}: not the contract")
            for batch in BATCHES:
                batches += 1
                places = rng.sample(range(batch), min(batch, PROBES))
                probes = rng.sample(range(PROBES), len(places))
                x = torch.randn(batch, width, device="cuda", generator=gen).to(dtype)
                e = torch.randint(
                    1, width + 1, (batch,), device="cuda", generator=gen
                ).to(I32)
                t = torch.randint(
                    0, 1 << 20, (batch, table.shape[1]), device="cuda", generator=gen
                ).to(I32)
                for place, probe in zip(places, probes, strict=True):
                    x[place], e[place], t[place] = (
                        logits[probe],
                        ends[probe],
                        table[probe],
                    )
                got = _select_and_remap(x, e, t, split)
                for place, probe in zip(places, probes, strict=True):
                    for name, out, ref in zip(
                        ("ids", "slots", "counts"), got, alone[probe], strict=True
                    ):
                        a, b = (
                            o.view(torch.uint8) for o in (out[place : place + 1], ref)
                        )
                        compared += a.numel()
                        if not torch.equal(a, b):
                            failures.append(
                                f"{dtype} {width} batch {batch} row "
                                f"{place} (probe {probe}): {name} differ"
                            )
    FUZZ_REPORT.append(
        f"select batch invariance ({'split' if split else 'routed'}): {batches} "
        f"batches of 1-256 rows, seed {seed}, "
        f"{compared} bytes compared, {len(failures)} mismatches"
    )
    assert not failures, "\n".join(failures[:10])


@pytest.mark.gpu
def test_fed_select_bytes_do_not_depend_on_the_batch():
    """The fed select: ``PROBES`` FP32 rows of 16K to 256K pools at random
    places of batches of 1 to 256 rows beside random neighbours, fed the
    counts of their logits (half the batches: none, so that each row counts
    its own first digit): every probe's pool ids are the contract's, which
    they are alone."""
    seed = fuzz_seed()
    gen = torch.Generator("cuda").manual_seed(seed)
    rng = random.Random(seed)
    batches = 0
    failures = []
    for width in (16384, 65536, 262144):
        logits, ends, _ = _probe_rows(F32, width, gen)
        want = contract_topk(logits, ends, K)
        for batch in BATCHES:
            batches += 1
            places = rng.sample(range(batch), min(batch, PROBES))
            probes = rng.sample(range(PROBES), len(places))
            x = torch.randn(batch, width, device="cuda", generator=gen)
            e = torch.randint(1, width + 1, (batch,), device="cuda", generator=gen)
            e = e.to(I32)
            for place, probe in zip(places, probes, strict=True):
                x[place], e[place] = logits[probe], ends[probe]
            histogram = cases.select_histogram(x, e.long())
            if rng.random() < 0.5:
                histogram.zero_()
            got = SELECT(logits=x, ends=e, k=K, histogram=histogram)
            for place, probe in zip(places, probes, strict=True):
                if not torch.equal(got[place], want[probe]):
                    failures.append(f"{width} batch {batch} row {place}: differ")
    FUZZ_REPORT.append(
        f"fed select batch invariance: {batches} batches of 1-256 rows, seed "
        f"{seed}, {len(failures)} mismatches"
    )
    assert not failures, "\n".join(failures[:10])


def whole_bin_rows(dtype, width: int, gen: torch.Generator) -> torch.Tensor:
    """One row a radix pass ``p``: its ``K`` largest keys share their first
    ``8 (p + 1)`` bits, which no other key has, and the others share the
    first ``8 p`` bits with them: pass ``p`` is the first whose bin the set
    takes whole (the last pass's bin: ``K`` equal keys). Keys become the
    values of their bits (positive: the key minus the sign bit), in random
    columns."""
    bits = 32 if dtype == F32 else 16
    base = 0xC1525354 >> (32 - bits)  # a positive value's key, about 3.3
    rows = []
    for p in range(bits // 8):
        low = bits - 8 * (p + 1)  # the bits below pass p's digit
        prefix = base >> low
        lows = torch.randint(0, 1 << low, (width,), generator=gen)
        keys = (
            torch.where(torch.arange(width) < K, prefix << low, (prefix - 1) << low)
            | lows
        )
        rows.append(keys[torch.randperm(width, generator=gen)] - (1 << (bits - 1)))
    values = torch.stack(rows)
    if dtype == F32:
        return values.to(torch.int32).view(F32)
    return values.to(torch.int16).view(BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [K + 1, 65536, 262144])
def test_select_whole_bins(dtype, width):
    """Rows whose set is taken whole at each radix pass (FP32: the passes
    after it skipped), at each cluster size's widths, in 16-byte aligned
    rows: the contract's columns."""
    gen = torch.Generator().manual_seed(width)
    logits = aligned_rows(whole_bin_rows(dtype, width, gen))
    ends = torch.full((logits.shape[0],), width, dtype=I32, device="cuda")
    got = SELECT(logits=logits, ends=ends, k=K)
    assert torch.equal(got, contract_topk(logits, ends, K))


def zero_plateau_rows(dtype, width: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of +0.0 whose threshold pass 0 finds at +0.0: ``K // 4``
    normals above it, with none, ``K // 2`` or all other keys of its pass-0
    bin (the smallest positives) beside them, -0.0 and negatives below;
    and one row whose threshold lies among those smallest positives (the
    passes go on). In random columns."""
    bits = 32 if dtype == F32 else 16
    tiny = torch.randint(1, 1 << (bits - 8), (width,), generator=gen)
    normal = torch.randn(width, generator=gen).abs() + 1
    normal = normal.view(torch.int32).long() >> (32 - bits)
    rows = []
    for smallest in (0, K // 2, width, 2 * K):
        keys = torch.zeros(width, dtype=torch.long)
        keys[: K // 4] = normal[: K // 4]
        last = min(width, K // 4 + smallest)
        keys[K // 4 : last] = tiny[K // 4 : last]
        if smallest != width:  # -0.0 and negatives past the positives
            keys[last::3] = 1 << (bits - 1)
            keys[last + 1 :: 3] = -normal[last + 1 :: 3]
        rows.append(keys[torch.randperm(width, generator=gen)])
    values = torch.stack(rows)
    if dtype == F32:
        return values.to(torch.int32).view(F32)
    return values.to(torch.int16).view(BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [K + 1, 65536, 262144])
def test_select_zero_plateaus(dtype, width):
    """Rows whose threshold is +0.0 (the passes end after pass 0) or one of
    the smallest positives beside it, with full ends (a cluster a row) and
    ends within one CTA's keys (CTA 0 alone): the contract's columns."""
    gen = torch.Generator().manual_seed(width + 1)
    values = zero_plateau_rows(dtype, width, gen)
    rows = values.shape[0]
    logits = aligned_rows(torch.cat([values, values]))
    ends = [width] * rows + [min(width, 3000 + 997 * r) for r in range(rows)]
    ends = torch.tensor(ends, dtype=I32, device="cuda")
    got = SELECT(logits=logits, ends=ends, k=K)
    assert torch.equal(got, contract_topk(logits, ends, K))


@pytest.mark.gpu
def test_fed_select_matches_the_contract():
    """The fed select (one CTA a row, its first digit from the histogram):
    every byte of the output buffer against ``contract_topk`` and the
    histogram's rows zeroed (the row past them and the columns past 257
    untouched), over every ``columns`` key; the histograms the scores
    count, none, stale or lying (``cases.fed_histogram``)."""
    from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select.launch import (
        sm_count,
    )

    sms = sm_count(torch.cuda.current_device())
    keys = [SELECT.CompileKey(K, F32, 1, 0, c) for c in select.FED_COLUMNS]

    def check(rng, gen):
        case = cases.select_case(rng, gen, rng.choice(keys), sms=sms)
        logits, ends = case.arguments["logits"], case.arguments["ends"]
        want = contract_topk(logits, ends, K)
        if not torch.equal(case.expected[0][: logits.shape[0], :K], want):
            return f"{draws.about(case)}: select_reference differs from the contract"
        return launch_case(SELECT, case)

    fuzz("fed select", 2000, check)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [K + 1, 65536, 262144])
def test_fed_select_edges(width):
    """The fed select on the rows of the select's edge tests (whole bins at
    each pass, +0.0 plateaus, all-special and signed-zero rows), fed the
    histogram the scores would count and none: the contract's columns, the
    histogram zeroed."""
    gen = torch.Generator().manual_seed(width + 2)
    special = cases.special_values(F32, "cpu")
    signed = torch.zeros(2, width)
    signed[:, 1::2] = -0.0
    rows = [
        whole_bin_rows(F32, width, gen),
        zero_plateau_rows(F32, width, gen),
        special[torch.randint(0, special.numel(), (2, width), generator=gen)],
        signed,
        torch.full((1, width), 1.5),
    ]
    logits = aligned_rows(torch.cat(rows))
    n = logits.shape[0]
    ends = torch.tensor(
        [width, K + 1, 3000, width - 1] * (n // 4) + [width] * (n % 4),
        dtype=I32,
        device="cuda",
    )
    want = contract_topk(logits, ends, K)
    for counted in (True, False):
        histogram = cases.select_histogram(logits, ends.long().clamp(0, width))
        if not counted:
            histogram.zero_()
        got = SELECT(logits=logits, ends=ends, k=K, histogram=histogram)
        assert torch.equal(got, want), counted
        assert not histogram.any()


@pytest.mark.gpu
def test_fed_select_behind_the_scores_stream():
    """The fed select on a side stream reads the histogram the compute
    stream is still writing, the hand-over an event: the select waits for
    it (the histogram and logits written after a long kernel on the compute
    stream) and its bytes are the contract's."""
    gen = torch.Generator().manual_seed(5)
    width = 65536
    values = torch.randn(4, width, generator=gen)
    ends = torch.tensor([width, 9000, K + 1, width - 7], dtype=I32, device="cuda")
    logits = torch.zeros(4, width, device="cuda")
    histogram = torch.zeros(4, 257, dtype=I32, device="cuda")
    side = torch.cuda.Stream()
    ready = torch.cuda.Event()
    busy = torch.zeros(1 << 26, device="cuda")
    for _ in range(20):  # the compute stream runs behind
        busy.mul_(1.0001)
    logits.copy_(aligned_rows(values))
    histogram.copy_(cases.select_histogram(logits, ends.long()))
    ready.record()
    with torch.cuda.stream(side):
        side.wait_event(ready)
        got = SELECT(logits=logits, ends=ends, k=K, histogram=histogram)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(got, contract_topk(logits, ends, K))
    assert not histogram.any()


def sparse_attention(q, kv, index, scale):
    """Attention of each query row over the KV rows ``index[row]`` lists
    (-1: none), in FP32: softmax(q . kv[index] * scale) @ kv[index]."""
    valid = index >= 0
    rows = kv[index.clamp(min=0).long()]  # [rows, k, dim]
    scores = torch.einsum("rhd,rkd->rhk", q, rows) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("rhk,rkd->rhd", scores.softmax(-1), rows)


# --- GPU: the split select ------------------------------------------------------------


@pytest.mark.gpu
def test_split_select_matches_the_contract():
    """The split select (``split=True``): every byte of the output buffer
    against ``contract_topk`` over every split key (FP32 and BF16, each
    merge capacity), its workspace poisoned or allocated; the first cases
    take each key in turn."""
    from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select.launch import (
        sm_count,
    )

    sms = sm_count(torch.cuda.current_device())
    keys = sorted(_split_keys(), key=str)
    seen = Counter()
    drawn = [0]

    def check(rng, gen):
        key = keys[drawn[0]] if drawn[0] < len(keys) else rng.choice(keys)
        drawn[0] += 1
        case = cases.select_case(rng, gen, key, sms=sms)
        if SELECT.spec(**case.arguments)[0] != key:
            return f"{draws.about(case)}: does not derive {key}"
        seen[f"{str(key.dtype)[6:]} {key.capacity}"] += 1
        logits, ends = case.arguments["logits"], case.arguments["ends"]
        want = contract_topk(logits, ends, K)
        if not torch.equal(case.expected[0][: logits.shape[0], :K], want):
            return f"{draws.about(case)}: select_reference differs from the contract"
        return launch_case(SELECT, case)

    try:
        fuzz("split select", 1000, check)
    finally:
        FUZZ_REPORT.append(f"split select cases by dtype and capacity: {dict(seen)}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [SPLIT_CHUNK + 1, 65536, 262144 + 3, WIDEST])
def test_split_select_edges(dtype, width):
    """The split select on the select's edge rows: all-zero, all -0.0,
    signed zeros, all specials, whole bins at each pass, +0.0 plateaus;
    ends at 0, 1, k-1, k, k+1, a chunk's end and past it, full: the
    contract's columns."""
    gen = torch.Generator().manual_seed(width + 3)
    special = cases.special_values(dtype, "cpu")
    signed = torch.zeros(2, width, dtype=dtype)
    signed[:, 1::2] = -0.0
    rows = [
        torch.zeros(2, width, dtype=dtype),
        torch.full((2, width), -0.0, dtype=dtype),
        signed,
        special[torch.arange(2 * width) % len(special)].view(2, width),
        whole_bin_rows(dtype, width, gen),
        zero_plateau_rows(dtype, width, gen),
    ]
    logits = aligned_rows(torch.cat(rows))
    n = logits.shape[0]
    edges = [0, 1, K - 1, K, K + 1, SPLIT_CHUNK, SPLIT_CHUNK + 1, width]
    varied = torch.tensor([edges[r % len(edges)] for r in range(n)], dtype=I32)
    for ends in (varied.cuda(), torch.full((n,), width, dtype=I32, device="cuda")):
        got = SELECT(logits=logits, ends=ends, k=K, split=True)
        assert torch.equal(got, contract_topk(logits, ends, K))


@pytest.mark.gpu
def test_split_select_in_a_cuda_graph():
    """The split select captured in a CUDA graph with its workspace and
    output given (no allocation, no compile in the capture): each replay
    over new logits and ends is the contract's."""
    gen = torch.Generator("cuda").manual_seed(11)
    rows, width = 40, 65536 + 7
    logits = aligned_rows(torch.zeros(rows, width))
    ends = torch.zeros(rows, dtype=I32, device="cuda")
    out = torch.empty(rows, K, dtype=I32, device="cuda")
    chunks = torch.empty(rows * split_parts(width, K), K, dtype=I32, device="cuda")
    arguments = dict(logits=logits, ends=ends, k=K, out=out, chunks=chunks, split=True)
    SELECT(**arguments)  # compiled here, before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        SELECT(**arguments)
    for _ in range(3):
        logits.copy_(torch.randn(rows, width, device="cuda", generator=gen))
        ends.copy_(torch.randint(0, width + 9, (rows,), device="cuda", generator=gen))
        graph.replay()
        assert torch.equal(out, contract_topk(logits, ends, K))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_attention_over_the_select_equals_another_order(dtype):
    """Sparse attention over the select's tokens equals attention over the
    same set in another order (a stock top-k's: atomics' order, here a
    random permutation of each row) within FP32 rounding; a different set
    is visibly different."""
    gen = torch.Generator("cuda").manual_seed(25)
    rows, width, heads, dim = 16, 65536, 8, 64
    logits = torch.randn(rows, width, device="cuda", generator=gen).to(dtype)
    ends = torch.randint(K + 1, width, (rows,), device="cuda", generator=gen)
    ends[:2] = torch.tensor([width, 100])
    ends = ends.to(I32)
    ours = SELECT(logits=logits, ends=ends, k=K)
    assert torch.equal(ours, contract_topk(logits, ends, K))
    perm = torch.argsort(torch.rand(rows, K, device="cuda", generator=gen), dim=1)
    q = torch.randn(rows, heads, dim, device="cuda", generator=gen)
    kv = torch.randn(width, dim, device="cuda", generator=gen)
    a = sparse_attention(q, kv, ours, dim**-0.5)
    b = sparse_attention(q, kv, torch.gather(ours, 1, perm), dim**-0.5)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    other = ours.clone()
    other[:, 0] = (other[:, 0] + 1) % width
    assert (a - sparse_attention(q, kv, other, dim**-0.5)).abs().max() > 1e-4


# --- GPU: vLLM's own top-k ----------------------------------------------------------


@pytest.fixture
def stock_topk():
    """vLLM 0.33.0's decode top-k from the wheel's binary, or a skip."""
    from tools.kernel_env import stock_topk

    if not stock_topk.load():
        pytest.skip(
            f"{stock_topk.ENV} is not set: vLLM's own top-k needs the pinned "
            "wheel's vllm/_C_stable_libtorch.abi3.so (unpacked from the "
            "wheel, e.g. build/cache/vllm-0.33.0-*.whl) at that path"
        )
    return stock_topk.StockTopk


NAN = {"+": (0x7FC00000, 0x7FFFFFFF), "-": (0xFFC00000, 0xFFFFFFFF)}


def _logits(rows, width, kind, dtype, gen):
    """(logits, their exact FP32 upcast: stock's input): normals, rounded
    (ties), ReLU plateaus of exact 0.0, or normals with NaNs of one sign
    ("+nan", "-nan") or both ("nan")."""
    g = dict(generator=gen, device=gen.device)
    values = torch.randn(rows, width, **g)
    if kind == "ties":
        values = values.round()
    elif kind == "relu":
        values = (values - 2.5).relu()
    for sign in {"+nan": "+", "-nan": "-", "nan": "+-"}.get(kind, ""):
        count = max(1, int(rows * width * 0.01 * float(torch.rand(1, **g))))
        where = torch.randint(0, rows * width, (count,), **g)
        table = torch.tensor(NAN[sign], dtype=torch.int64, device=gen.device)
        picks = table.to(I32)[torch.randint(0, 2, (count,), **g)]
        values.view(-1).view(I32)[where] = picks
    if dtype == F32:
        return values, values
    logits = _truncated(values)
    return logits, (logits.view(torch.int16).to(I32) << 16).view(F32)


SHAPES = [
    *((1, 16384), (8, 65536), (64, 65536), (65, 65536)),
    *((256, 16384), (1, 262144), (4, 262144)),
]


def _stock_ends(rows, width, gen):
    """Row ends stock reads: in [0, width] (stock reads past a longer row,
    and persistent takes a negative end as huge), full rows and short."""
    g = dict(generator=gen, device=gen.device)
    ends = torch.randint(0, width + 1, (rows,), **g)
    pick = torch.rand(rows, **g)
    ends = torch.where(pick < 0.3, width, ends)
    short = torch.randint(0, K + 2, (rows,), **g)
    return torch.where(pick > 0.9, short, ends).to(I32)


def _runs(kinds, gen):
    """(label, logits, their FP32 upcast, ends, stock's ids) of each shape,
    kind and dtype, and stock op: ``cooperative_topk`` to 64 rows (also
    ``persistent_topk`` there), else ``persistent_topk``, as "auto" picks."""
    from tools.kernel_env.stock_topk import StockTopk

    for rows, width in SHAPES:
        for kind in kinds:
            for dtype in (F32, BF16):
                logits, values = _logits(rows, width, kind, dtype, gen)
                ends = _stock_ends(rows, width, gen)
                for op in ("cooperative", "persistent")[rows > 64 :]:
                    stock = cases.poisoned((rows, K), I32, gen)
                    StockTopk(gen.device, op)(values, ends, stock, K, int(ends.max()))
                    label = f"{op} {rows}x{width} {kind} {str(dtype)[6:]}"
                    yield label, logits, values, ends, stock


def _agreement(ours, stock, values, ends):
    """Per row: stock's ids as a set are ours; the keys at stock's ids are
    the keys at ours (the same set up to the choice among equal keys);
    stock's ids are distinct columns below the end (-1 only past a short
    row's end)."""
    rows, width = values.shape
    keys = order_key(values)

    def keys_at(ids):
        at = torch.gather(keys, 1, ids.clamp(0, width - 1).long())
        return torch.where(ids >= 0, at, -1).sort(1).values

    ranked = stock.sort(1).values
    end = ends.long().clamp(0, width)[:, None]
    slots = torch.arange(K, device=ends.device)[None, :]
    # Sorted, a row's -1s come first: then its ids below the end.
    ids = (ranked >= 0) & (ranked < end)
    valid = torch.where(slots < K - end.clamp(max=K), ranked == -1, ids)
    distinct = (ranked[:, 1:] != ranked[:, :-1]) | (ranked[:, 1:] < 0)
    return (
        (ranked == ours.sort(1).values).all(1),
        (keys_at(stock) == keys_at(ours)).all(1),
        valid.all(1) & distinct.all(1),
    )


@pytest.mark.gpu
@pytest.mark.stock_topk
def test_sets_equal_stock_topk(stock_topk):
    """On rows without NaN where no tie straddles the threshold, the
    select's set is stock's, over FP32 and BF16-upcast logits (normals,
    rounded ones, ReLU plateaus of exact 0.0); where a tie straddles, the
    keys at stock's ids are the keys at ours; stock's ids are distinct
    columns below the end."""
    seed = fuzz_seed()
    gen = torch.Generator("cuda").manual_seed(seed)
    counts, failures = Counter(), []
    for label, logits, values, ends, stock in _runs(("normal", "ties", "relu"), gen):
        counts["runs"] += 1
        ours = SELECT(logits=logits, ends=ends, k=K)
        tie = straddles(values, ends, K)
        same_set, same_keys, valid = _agreement(ours, stock, values, ends)
        counts["rows, no tie across the threshold"] += int((~tie).sum())
        counts["rows with a tie across it"] += int(tie.sum())
        counts["of those, another set of equal keys"] += int((tie & ~same_set).sum())
        bad = (~valid | ~same_keys | (~tie & ~same_set)).nonzero().view(-1)
        if bad.numel():
            failures.append(f"{label}: rows {bad[:8].tolist()}")
    print("select vs stock top-k:", dict(counts))
    report("select vs stock top-k, sets", counts["runs"], seed, failures)


@pytest.mark.gpu
@pytest.mark.stock_topk
def test_nan_rows_against_stock_topk(stock_topk):
    """Rows holding NaNs, measured against stock. Stated: the select gives
    the contract's ids; stock gives distinct ids below each end; on rows
    whose NaNs are all positive stock's set is ours where no tie straddles
    the threshold, and holds the same keys where one does. Counted and
    printed: the rows holding negative NaNs, on how many stock gives another
    set (its coarse bins may rank a -NaN at the top, while its order key,
    and ours, rank it lowest), of other keys, and with every id it has that
    ours has not a -NaN."""
    seed = fuzz_seed()
    gen = torch.Generator("cuda").manual_seed(seed)
    counts, failures = Counter(), []
    for label, logits, values, ends, stock in _runs(("+nan", "-nan", "nan"), gen):
        counts["runs"] += 1
        ours = SELECT(logits=logits, ends=ends, k=K)
        if not torch.equal(ours, contract_topk(logits, ends, K)):
            failures.append(f"{label}: not the contract's ids")
        columns = torch.arange(values.shape[1], device="cuda")[None, :]
        nan = values.isnan() & (columns < ends.long()[:, None])
        negative = nan & (values.view(I32) < 0)
        minus, plus = negative.any(1), nan.any(1) & ~negative.any(1)
        tie = straddles(values, ends, K)
        same_set, same_keys, valid = _agreement(ours, stock, values, ends)
        counts["+NaN rows"] += int(plus.sum())
        counts["-NaN rows"] += int(minus.sum())
        counts["-NaN rows, stock's set differs"] += int((minus & ~same_set).sum())
        counts["... of other keys"] += int((minus & ~same_keys).sum())
        for row in (minus & ~same_set).nonzero().view(-1).tolist():
            extra = set(stock[row].tolist()) - set(ours[row].tolist())
            counts["... stock's extra ids all -NaN"] += all(
                bool(negative[row, c]) for c in extra
            )
        bad = ~valid | (plus & ~same_keys) | (plus & ~tie & ~same_set)
        if bad.any():
            failures.append(f"{label}: rows {bad.nonzero().view(-1)[:8].tolist()}")
    print("NaN rows vs stock top-k:", dict(counts))
    report("select vs stock top-k, NaN rows", counts["runs"], seed, failures)


@pytest.mark.gpu
@pytest.mark.stock_topk
@pytest.mark.parametrize("op", ["cooperative", "persistent"])
def test_attention_over_the_select_equals_stock(stock_topk, op):
    """Sparse attention over the select's tokens and over stock's (random
    normals: no tie at the k-th value) agrees within FP32 rounding."""
    gen = torch.Generator("cuda").manual_seed(2025)
    heads, dim = 8, 64
    for rows, width in [(1, 65536), (8, 65536), (64, 65536), (4, 262144)]:
        logits = torch.randn(rows, width, device="cuda", generator=gen)
        ends = torch.randint(K + 1, width + 1, (rows,), device="cuda", generator=gen)
        ends[0] = width
        ends = ends.to(I32)
        stock = torch.empty(rows, K, dtype=I32, device="cuda")
        stock_topk(logits.device, op)(logits, ends, stock, K, width)
        ours = SELECT(logits=logits, ends=ends, k=K)
        assert torch.equal(torch.sort(stock, dim=1).values, ours), (rows, width)
        q = torch.randn(rows, heads, dim, device="cuda", generator=gen)
        kv = torch.randn(width, dim, device="cuda", generator=gen)
        torch.testing.assert_close(
            sparse_attention(q, kv, ours, dim**-0.5),
            sparse_attention(q, kv, stock, dim**-0.5),
            rtol=1e-5,
            atol=1e-6,
        )
