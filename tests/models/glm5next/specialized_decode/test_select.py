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
from kernel_ptx import compile_ptx, ops, resources
from kpool_fuzz import FUZZ_REPORT, fuzz, fuzz_seed, report
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
    cluster_for,
    one_wave,
    slice_capacity,
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


@pytest.mark.parametrize("one_wave_only", [False, True])
def test_warmup_keys_are_what_spec_derives(one_wave_only):
    """``get_warmup_keys(max_rows=R, ...)`` lists the keys ``spec`` derives
    for 1 to R rows of the width (``one_wave_only``: of those that fit one
    wave), each once."""
    from rule_edges import allow_cpu

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


def _select_and_remap(logits, ends, table):
    """The opt-in select and the fused remap of the rows (the stage's chain
    after the scores): pool ids, physical slots, counts."""
    from vllm.models.glm5next.nvidia.specialized_decode import kpool

    rows = logits.shape[0]
    pool_ids = kpool.select_topk(logits, ends, K)
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
def test_select_and_remap_bytes_do_not_depend_on_the_batch():
    """``PROBES`` rows at random places of batches of 1 to 256 rows beside
    random neighbours (FP32 and BF16, 16K to 256K pools): every byte of
    their pool ids, slots and counts equals what they get alone, and alone
    their pool ids are the contract's."""
    seed = fuzz_seed()
    gen = torch.Generator("cuda").manual_seed(seed)
    rng = random.Random(seed)
    batches = compared = 0
    failures = []
    for dtype in (F32, BF16):
        for width in (16384, 65536, 262144):
            logits, ends, table = _probe_rows(dtype, width, gen)
            alone = [
                _select_and_remap(logits[i : i + 1], ends[i : i + 1], table[i : i + 1])
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
                got = _select_and_remap(x, e, t)
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
        f"select batch invariance: {batches} "
        f"batches of 1-256 rows, seed {seed}, "
        f"{compared} bytes compared, {len(failures)} mismatches"
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


def sparse_attention(q, kv, index, scale):
    """Attention of each query row over the KV rows ``index[row]`` lists
    (-1: none), in FP32: softmax(q . kv[index] * scale) @ kv[index]."""
    valid = index >= 0
    rows = kv[index.clamp(min=0).long()]  # [rows, k, dim]
    scores = torch.einsum("rhd,rkd->rhk", q, rows) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("rhk,rkd->rhd", scores.softmax(-1), rows)


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
        # Random bytes, as _runs' outputs: an id stock leaves unwritten
        # cannot pass as one it wrote.
        stock = cases.poisoned((rows, K), I32, gen)
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
