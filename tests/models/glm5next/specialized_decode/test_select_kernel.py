# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pool select (``select_kernel.py``) against a torch reference of its
contract (the exact top-k of each row's valid columns by stock's order key,
ties at the k-th value to the lowest columns, ascending column order, -1 past
a short row's columns), and sparse attention over its indices against
attention over stock's.

CPU: the reference's own rules, the argument rules, the cluster choice, the
compile for sm_90a and sm_100a on fake tensors. GPU (``gpu``): the fuzz loop
per logits dtype, byte for byte against the reference; the edges; the
attention equivalence."""

import functools
import os
import random
from collections import Counter

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

ARCHS = ["sm_90a", "sm_100a"]
DTYPES = [torch.float32, torch.bfloat16]
K = 512  # GLM-5-Next's index_topk 2048 / index_kpool 4


# --- The reference -------------------------------------------------------


def order_keys(logits: torch.Tensor) -> torch.Tensor:
    """int64 keys whose order is the contract's: the float's bits with the
    sign bit set for a positive sign, all bits flipped for a negative one
    (IEEE totalOrder; stock's ``convert_to_uint32_v2``). BF16 keys are the
    16-bit rule's, which order as the FP32 keys of the exact upcast."""
    if logits.dtype == torch.bfloat16:
        bits = logits.view(torch.int16).to(torch.int64) & 0xFFFF
        sign, full = 0x8000, 0xFFFF
    elif logits.dtype == torch.float32:
        bits = logits.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        sign, full = 0x80000000, 0xFFFFFFFF
    else:
        raise TypeError(logits.dtype)
    return torch.where(bits & sign != 0, full - bits, bits | sign)


def reference_select(logits: torch.Tensor, ends: torch.Tensor, k: int) -> torch.Tensor:
    """The contract, computed on the device of ``logits``: for each row the
    columns below ``clamp(end, 0, width)``; all of them (then -1) if at most
    ``k``, else the ``k`` largest keys with ties to the lower column, in
    ascending column order."""
    rows, width = logits.shape
    device = logits.device
    ends = ends[:rows].to(device=device, dtype=torch.int64).clamp(0, width)
    cols = torch.arange(width, device=device)
    valid = cols[None, :] < ends[:, None]
    # Keys are >= 0: -1 puts the invalid columns below every valid one.
    keys = torch.where(valid, order_keys(logits), -1)
    # A stable sort by descending key keeps equal keys in column order.
    top = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :k]
    top = torch.sort(top, dim=1).values
    slots = torch.arange(k, device=device)
    short = torch.where(slots[None, :] < ends[:, None], slots[None, :], -1)
    if width < k:
        top = torch.nn.functional.pad(top, (0, k - width), value=-1)
    return torch.where((ends > k)[:, None], top, short).to(torch.int32)


def _f32(words: list[int]) -> torch.Tensor:
    """FP32 values of the 32-bit patterns ``words``."""
    return torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _bf16(values: torch.Tensor) -> torch.Tensor:
    """``values`` as BF16 by truncating the FP32 bits (keeps NaN signs and
    payload bits that a rounding conversion might not)."""
    bits = values.to(torch.float32).view(torch.int32) >> 16
    return bits.to(torch.int16).view(torch.bfloat16)


def test_reference_orders_as_stock_key():
    """-NaN < -inf < -1 < -denormal < -0.0 < +0.0 < +denormal < 1 < +inf <
    +NaN, in both dtypes; equal values at the k-th go to the lower ids."""
    neg_nan, pos_nan, tiny = _f32([0xFFC00000]), _f32([0x7FC00000]), _f32([0x10000])
    ladder = torch.cat(
        [
            neg_nan,
            torch.tensor([-float("inf"), -1.0]),
            -tiny,
            torch.tensor([-0.0, 0.0]),
            tiny,
            torch.tensor([1.0, float("inf")]),
            pos_nan,
        ]
    )
    for dtype in DTYPES:
        values = ladder.to(dtype) if dtype == torch.float32 else _bf16(ladder)
        keys = order_keys(values)
        assert torch.all(keys[1:] > keys[:-1]), dtype
        perm = torch.randperm(values.numel())
        shuffled = values[perm].reshape(1, -1)
        got = reference_select(shuffled, torch.tensor([values.numel()]), 3)
        want = torch.sort(torch.argsort(keys[perm], descending=True)[:3]).values
        assert got[0].tolist() == want.tolist()
    ties = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5, 2.0]])
    assert reference_select(ties, torch.tensor([6]), 2)[0].tolist() == [1, 2]
    assert reference_select(ties, torch.tensor([6]), 5)[0].tolist() == [0, 1, 2, 3, 5]
    assert reference_select(ties, torch.tensor([3]), 4)[0].tolist() == [0, 1, 2, -1]
    assert reference_select(ties, torch.tensor([-5]), 2)[0].tolist() == [-1, -1]
    assert reference_select(ties, torch.tensor([99]), 6)[0].tolist() == list(range(6))


# --- Argument rules and the cluster choice (CPU) -------------------------


@pytest.fixture
def cpu_kernels():
    """Lets the rules take CPU tensors (they never launch here)."""
    from vllm.models.glm5next.nvidia.specialized_decode import jit

    old = jit.constants.KERNEL_DEVICE_TYPES
    jit.constants.KERNEL_DEVICE_TYPES = frozenset({"cuda", "cpu"})
    yield
    jit.constants.KERNEL_DEVICE_TYPES = old


def test_cpu_tensors_are_refused():
    from vllm.models.glm5next.nvidia.specialized_decode import jit
    from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import (
        SELECT,
        SelectArgs,
    )

    ends = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(jit.Refused, match="^logits: expected a CUDA tensor"):
        SELECT.key_for(SelectArgs(torch.zeros(4, 256), ends, K))


def test_rules_name_the_argument(cpu_kernels):
    from vllm.models.glm5next.nvidia.specialized_decode import jit
    from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import (
        CAPACITIES,
        MAX_K,
        SELECT,
        SelectArgs,
    )

    def refused(args, name, expected, got=None):
        with pytest.raises(jit.Refused, match=f"^{name}: expected {expected}") as e:
            SELECT.key_for(args)
        if got is not None:  # the message ends with what the argument was
            assert str(e.value).endswith(f", got {got}"), e.value

    logits = torch.zeros(4, 256)
    ends = torch.zeros(4, dtype=torch.int32)
    assert SELECT.key_for(SelectArgs(logits, ends, K)) == SELECT.CompileKey(
        K, torch.float32, 1, CAPACITIES[0]
    )
    key = SELECT.key_for(SelectArgs(logits.bfloat16(), ends, K))
    assert key.dtype is torch.bfloat16
    for k in (1, MAX_K):  # the bounds are taken
        assert SELECT.key_for(SelectArgs(logits, ends, k)).k == k
    refused(SelectArgs(logits, ends, 0), "k", "an int in", 0)
    refused(SelectArgs(logits, ends, MAX_K + 1), "k", "an int in", MAX_K + 1)
    refused(SelectArgs(logits, ends, True), "k", "an int in")
    refused(SelectArgs(logits.half(), ends, K), "logits", "fp32/bf16")
    refused(SelectArgs(logits[:, 1:], ends, K), "logits", "fp32/bf16")
    refused(
        SelectArgs(logits.t(), ends, K), "logits", "fp32/bf16", jit.layout(logits.t())
    )
    refused(SelectArgs(torch.zeros(4, 250)[:, :200], ends, K), "logits", "fp32")
    widest = 16 * CAPACITIES[-1]
    SELECT.key_for(SelectArgs(torch.zeros(1, widest).expand(4, -1), ends, K))
    refused(
        SelectArgs(torch.zeros(1, widest + 4).expand(4, -1), ends, K),
        "logits",
        f"at most {widest} columns",
    )
    refused(SelectArgs(logits, ends.long(), K), "ends", "int32")
    refused(SelectArgs(logits, ends[:3], K), "ends", "int32", jit.layout(ends[:3]))
    refused(SelectArgs(logits, ends[::2], K), "ends", "int32")
    refused(SelectArgs(logits, ends.view(2, 2), K), "ends", "int32")
    out = torch.zeros(4, K, dtype=torch.int32)
    SELECT.key_for(SelectArgs(logits, ends, K, out))
    wide = torch.zeros(4, K + 64, dtype=torch.int32)
    SELECT.key_for(SelectArgs(logits, ends, K, wide[:, :K]))  # a column slice
    refused(SelectArgs(logits, ends, K, out.long()), "out", "int32")
    refused(SelectArgs(logits, ends, K, out[:, : K - 1]), "out", "int32")
    refused(SelectArgs(logits, ends, K, out[:3]), "out", "int32", jit.layout(out[:3]))
    refused(SelectArgs(logits, ends, K, wide[:, ::2][:, :K]), "out", "int32")


def test_key_for_takes_the_devices_sm_count(cpu_kernels, monkeypatch):
    """The key's cluster size comes from the logits' device's SMs, as the
    warmup's keys do: 8 CTAs a row at 1 x 65536 pools on 132 SMs, the fewest
    that fit (2) where there are none (a CPU tensor)."""
    from vllm.models.glm5next.nvidia.specialized_decode import select_kernel
    from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import (
        SELECT,
        SelectArgs,
    )

    args = SelectArgs(torch.zeros(1, 65536), torch.zeros(1, dtype=torch.int32), K)
    assert select_kernel.sm_count(torch.device("cpu")) == 0
    assert SELECT.key_for(args).cluster == 2
    monkeypatch.setattr(select_kernel, "sm_count", lambda device: 132)
    assert SELECT.key_for(args).cluster == 8


def test_sm_count_reads_the_device_index(monkeypatch):
    from vllm.models.glm5next.nvidia.specialized_decode import select_kernel

    monkeypatch.setattr(select_kernel, "_sm_count", lambda index: 100 + index)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert select_kernel.sm_count(torch.device("cuda")) == 105  # the current one
    assert select_kernel.sm_count(torch.device("cuda", 0)) == 100
    assert select_kernel.sm_count(torch.device("cuda", 3)) == 103


def test_cluster_for_rows_and_width():
    """Most CTAs a row while the rows' CTAs fill at most half the SMs and
    slices keep 8192 keys (16-CTA clusters: at most 4 rows); the fewest that
    fit in shared memory past that. And which row counts fit one wave."""
    from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import (
        CAPACITIES,
        cluster_for,
        one_wave,
        slice_capacity,
    )

    f32, bf16 = torch.float32, torch.bfloat16
    assert slice_capacity(1, f32, 8) == CAPACITIES[0]
    assert slice_capacity(65536, f32, 8) == 8192
    assert slice_capacity(65536 + 4, f32, 8) == 16384
    assert slice_capacity(262144, bf16, 16) == 16384
    assert slice_capacity(8 * 4096 + 8, bf16, 8) == 8192  # rounded to 8 columns
    assert slice_capacity(8 * 4096, bf16, 8) == 4096
    assert slice_capacity(65536, f32, 1) == 0
    assert slice_capacity(16 * CAPACITIES[-1] + 1, f32, 16) == 0
    sms = 132
    choices = {
        (1, 600): 1,
        (256, 4096): 1,
        (1, 65536): 8,
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
        (1, 16 * CAPACITIES[-1]): 16,
    }
    for (rows, width), cluster in choices.items():
        assert cluster_for(rows, width, f32, sms) == cluster, (rows, width)
    assert cluster_for(1, 16 * CAPACITIES[-1] + 4, f32, sms) is None
    # 2 CTAs of 128 KiB a row (1 an SM) at 65536 pools: 66 rows a wave; 8 at
    # 262144 pools: 16 rows.
    assert one_wave(64, 65536, f32, sms) and not one_wave(67, 65536, f32, sms)
    assert one_wave(16, 262144, bf16, sms) and not one_wave(17, 262144, bf16, sms)
    assert one_wave(256, 4096, f32, sms)  # 16 KiB CTAs, 2 an SM
    assert not one_wave(1, 16 * CAPACITIES[-1] + 4, f32, sms)


# --- Compile (CPU) -------------------------------------------------------

# (arch, cluster size, shared key capacity): the builds the 64K-256K-pool
# widths take at 1 to 256 rows.
BUILDS = [
    ("sm_90a", 8, 8192),
    ("sm_90a", 2, 32768),
    ("sm_90a", 16, 16384),
    ("sm_100a", 8, 32768),
    ("sm_100a", 1, 4096),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch,cluster,capacity", BUILDS)
def test_select_compiles(arch, cluster, capacity, dtype):
    import tempfile

    cute = pytest.importorskip("cutlass.cute")
    from vllm.model_executor.warmup.jit_warmup_cutedsl_helper import (
        cutedsl_fake_stream,
    )
    from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import SELECT

    key = SELECT.CompileKey(K, dtype, cluster, capacity)
    with tempfile.TemporaryDirectory() as dump:
        options = f"--enable-tvm-ffi --keep-ptx --dump-dir {dump} --gpu-arch {arch}"
        text = cute.compile(
            SELECT.kernel(key),
            *SELECT.warmup_inputs(key),
            cutedsl_fake_stream(),
            options=options,
        ).__ptx__
    assert text.count("griddepcontrol.wait") == 1
    assert text.count("griddepcontrol.launch_dependents") == 1
    assert ".local" not in text, "spills to local memory"
    assert "ld.global.nc.v4.b32" in text
    # The keys (sign-extended masks, then xor), the shared histogram counts,
    # the slice resident in shared memory.
    assert "shr.s32 m," in text and "or.b32 m,m,0x80000000" in text
    passes = 4 if dtype == torch.float32 else 2
    assert "red.shared.add" in text or "atom.shared.add" in text
    assert "st.shared.v4.b32" in text and "ld.shared.v4.b32" in text
    # The peers' histograms through distributed shared memory; the cluster
    # barriers, one a pass and the exit's split arrive / wait.
    assert "mapa.shared::cluster.u32" in text
    assert text.count("barrier.cluster.arrive") == passes + 1
    assert text.count("barrier.cluster.wait") == passes + 1
    if dtype == torch.bfloat16:
        assert "ld.global.nc.b16" in text, "a row end's single columns"


# --- GPU -----------------------------------------------------------------

# The cluster choice's edges (1 CTA below 16384 columns; 16 CTAs from 131072
# at few rows), odd widths, and the widest the kernel takes.
WIDTHS = [1, 7, 511, 512, 513, 4096, 5000, 16384, 65536, 131072 + 8, 262144]
WIDEST = 16 * 53248


def _special(dtype) -> torch.Tensor:
    """NaNs of both signs, infinities, zeros of both signs, denormals (FP32
    and BF16 ones), the extremes."""
    words = [
        0x7FC00000,  # +NaN
        0xFFC00000,  # -NaN
        0x7FFFFFFF,  # +NaN, CUDA's canonical
        0xFFFFFFFF,  # -NaN
        0x7F800000,  # +inf
        0xFF800000,  # -inf
        0x00000000,  # +0.0
        0x80000000,  # -0.0
        0x00000001,  # smallest +denormal (FP32)
        0x80000001,
        0x00010000,  # smallest +denormal (BF16)
        0x80010000,
        0x7F7F0000,  # largest finite BF16
        0xFF7F0000,
        0x3F800000,  # 1.0
        0xBF800000,
    ]
    values = _f32(words)
    return values if dtype == torch.float32 else _bf16(values)


def _rows(rows: int, width: int, dtype, gen: torch.Generator, rng: random.Random):
    """``rows`` rows of one distribution that stresses the select: normals
    of some scale, few distinct values (ties across the threshold), all
    equal, keys differing in the low bits only, special values sprinkled."""
    g = dict(generator=gen, device=gen.device)
    shape = (rows, width)
    kind = rng.choice(["normal", "ties", "equal", "lowbits", "special", "mixed"])
    if kind == "normal":
        values = torch.randn(shape, **g) * rng.choice([1e-3, 1.0, 1e4])
    elif kind == "ties":
        levels = torch.randn(rng.choice([1, 2, 3, 17]), **g)
        values = levels[torch.randint(0, levels.numel(), shape, **g)]
    elif kind == "equal":
        values = torch.full(
            shape, rng.choice([0.0, -0.0, 1.5, -2.0]), device=g["device"]
        )
    elif kind == "lowbits":
        # One exponent and sign; keys differ in the lowest bits only.
        base = rng.choice([0x3F800000, 0xBF800000])
        span, unit = (
            (rng.choice([2, 16]), 1 << 16)
            if dtype != torch.float32
            else (
                rng.choice([4, 256]),
                1,
            )
        )
        noise = torch.randint(0, span, shape, **g) * unit
        values = (noise + base).to(torch.int32).view(torch.float32)
    else:
        values = torch.randn(shape, **g)
    out = values.float() if dtype == torch.float32 else _bf16(values)
    if kind in ("special", "mixed"):
        special = _special(dtype).to(gen.device)
        count = max(1, int(rows * width * rng.choice([0.001, 0.05, 0.5])))
        where = torch.randint(0, rows * width, (count,), **g)
        out.view(-1)[where] = special[torch.randint(0, special.numel(), (count,), **g)]
    return out


def _ends(rows: int, width: int, rng: random.Random) -> list[int]:
    edges = [0, 1, K - 1, K, K + 1, width, width - 1, width + 5, -3, 2**31 - 1]
    return [
        rng.choice(edges) if rng.random() < 0.5 else rng.randint(0, width)
        for _ in range(rows)
    ]


def _shape(dtype, clusters: Counter, rng: random.Random, device) -> tuple[int, int]:
    """(rows, width) of a case, at most 2^23 logits (the reference sorts them).
    The first cases take each cluster size in turn, so that a short run (the
    sanitizer's dozen cases) launches all five; the rest are drawn freely."""
    from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import (
        CLUSTERS,
        cluster_for,
        sm_count,
    )

    drawn = sum(clusters.values())
    if drawn < len(CLUSTERS):
        sms = sm_count(device)
        shapes = [
            (rows, width)
            for width in WIDTHS + [WIDEST]
            for rows in (1, 2, 3, 4, 8, 16, 33, 64, 256)
            if rows * width <= 2**23
            and cluster_for(rows, width, dtype, sms) == CLUSTERS[drawn]
        ]
        return rng.choice(shapes)
    width = rng.choice(WIDTHS + [rng.randint(1, 70000), WIDEST])
    rows = rng.choice([1, 2, 3, 8, 16, 33, 64, 256, rng.randint(1, 256)])
    return max(1, min(rows, 2**23 // width)), width


def _check_case(
    dtype, clusters: Counter, rng: random.Random, gen: torch.Generator
) -> str | None:
    from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import (
        SELECT,
        SelectArgs,
    )

    device = gen.device
    rows, width = _shape(dtype, clusters, rng, device)
    vector = 4 if dtype == torch.float32 else 8
    pitch = width + (-width % vector) + vector * rng.choice([0, 0, 1, 16])
    storage = torch.empty(rows, pitch, dtype=dtype, device=device)
    storage[:, :width] = _rows(rows, width, dtype, gen, rng)
    # Columns past the width (the pitch's padding) must never count: +NaN.
    storage[:, width:] = _special(dtype).to(device)[0]
    logits = storage[:, :width]
    ends = torch.tensor(_ends(rows, width, rng), dtype=torch.int32, device=device)
    wide = torch.full((rows, K + 32), -7, dtype=torch.int32, device=device)
    args = SelectArgs(logits, ends, K, wide[:, :K] if rng.random() < 0.5 else None)
    clusters[SELECT.key_for(args).cluster] += 1
    got = SELECT.run(args).out
    want = reference_select(logits, ends, K)
    if args.out is not None and not torch.all(wide[:, K:] == -7):
        return f"rows {rows} width {width}: wrote past out's k columns"
    if not torch.equal(got, want):
        bad = (got != want).any(dim=1).nonzero().flatten()
        r = int(bad[0])
        return (
            f"rows {rows} width {width} pitch {pitch}: {bad.numel()} rows "
            f"differ, first row {r} (end {int(ends[r])})"
        )
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_select_matches_reference(dtype):
    from kpool_fuzz import fuzz

    clusters: Counter = Counter()
    name = f"select_topk {str(dtype).removeprefix('torch.')}"
    try:
        fuzz(name, 2000, functools.partial(_check_case, dtype, clusters))
    finally:
        print(name, "cases by cluster size:", dict(sorted(clusters.items())))
    assert set(clusters) == {1, 2, 4, 8, 16}, clusters


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [K + 1, 65536, 262144, WIDEST])
def test_select_edges(dtype, width):
    """Ends 0, 1, k-1, k, k+1 and full on all-equal, signed-zero and special
    rows, at each cluster size's widths."""
    from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import (
        select_topk,
    )

    ends_list = [0, 1, K - 1, K, K + 1, width]
    rows = len(ends_list)
    special = _special(dtype).cuda()
    cases = {
        "zeros": torch.zeros(rows, width, dtype=dtype, device="cuda"),
        "neg_zeros": torch.full((rows, width), -0.0, dtype=dtype, device="cuda"),
        "special": special[torch.arange(rows * width, device="cuda") % 16].view(
            rows, width
        ),
    }
    signed = torch.zeros(rows, width, dtype=dtype, device="cuda")
    signed[:, 1::2] = -0.0
    cases["signed_zeros"] = signed
    ends = torch.tensor(ends_list, dtype=torch.int32, device="cuda")
    stride = -(-width // 8) * 8  # DeepGEMM's rows are 16-byte aligned
    for name, values in cases.items():
        logits = torch.zeros(rows, stride, dtype=dtype, device="cuda")[:, :width]
        logits.copy_(values)
        got = select_topk(logits, ends, K)
        assert torch.equal(got, reference_select(logits, ends, K)), name


@pytest.mark.gpu
def test_select_empty_rows():
    from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import (
        select_topk,
    )

    logits = torch.zeros(0, 4096, device="cuda")
    out = select_topk(logits, torch.zeros(0, dtype=torch.int32, device="cuda"), K)
    assert out.shape == (0, K)


def sparse_attention(q, kv, index, scale):
    """Attention of each query row over the KV rows ``index[row]`` lists
    (-1: none), in FP32: softmax(q . kv[index] * scale) @ kv[index]."""
    valid = index >= 0
    rows = kv[index.clamp(min=0).long()]  # [rows, k, dim]
    scores = torch.einsum("rhd,rkd->rhk", q, rows) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("rhk,rkd->rhd", scores.softmax(-1), rows)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_attention_over_select_equals_stock_order(dtype):
    """Sparse attention over the select's tokens equals attention over the
    same set in another order (a stock top-k's: atomics' order, here a
    random permutation of each row) within FP32 rounding: the order changes
    nothing but the summation order."""
    from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import (
        select_topk,
    )

    gen = torch.Generator("cuda").manual_seed(25)
    rows, width, heads, dim = 16, 65536, 8, 64
    logits = torch.randn(rows, width, device="cuda", generator=gen).to(dtype)
    ends = torch.randint(K + 1, width, (rows,), device="cuda", generator=gen)
    ends[:2] = torch.tensor([width, 100])
    ends = ends.to(torch.int32)
    ours = select_topk(logits, ends, K)
    assert torch.equal(ours, reference_select(logits, ends, K))
    perm = torch.argsort(torch.rand(rows, K, device="cuda", generator=gen), dim=1)
    stock_order = torch.gather(ours, 1, perm)
    q = torch.randn(rows, heads, dim, device="cuda", generator=gen)
    kv = torch.randn(width, dim, device="cuda", generator=gen)
    a = sparse_attention(q, kv, ours, dim**-0.5)
    b = sparse_attention(q, kv, stock_order, dim**-0.5)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # A different set is visibly different: the test can fail.
    other = ours.clone()
    other[:, 0] = (other[:, 0] + 1) % width
    c = sparse_attention(q, kv, other, dim**-0.5)
    assert (a - c).abs().max() > 1e-4


def _stock_topk():
    """vLLM 0.33.0's own ``cooperative_topk``/``persistent_topk`` from the
    pinned wheel's ``_C_stable_libtorch.abi3.so`` (``KPOOL_STOCK_TOPK_SO``:
    the GPU tier stages it, docs/select-contract.md says how), or a skip."""
    path = os.environ.get("KPOOL_STOCK_TOPK_SO")
    if not path:
        pytest.skip("KPOOL_STOCK_TOPK_SO: the wheel's top-k ops are not staged")
    if not hasattr(torch.ops._C, "cooperative_topk"):
        torch.ops.load_library(path)
    return torch.ops._C


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["cooperative_topk", "persistent_topk"])
def test_select_sets_and_attention_equal_stock_topk(op):
    """The select's set is stock's (random normals: no tie at the k-th
    value), and sparse attention over each agrees within FP32 rounding."""
    ops = _stock_topk()
    from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import (
        select_topk,
    )

    gen = torch.Generator("cuda").manual_seed(2025)
    workspace = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    heads, dim = 8, 64
    for rows, width in [(1, 65536), (8, 65536), (64, 65536), (4, 262144)]:
        logits = torch.randn(rows, width, device="cuda", generator=gen)
        ends = torch.randint(K + 1, width + 1, (rows,), device="cuda", generator=gen)
        ends[0] = width
        ends = ends.to(torch.int32)
        stock = torch.empty(rows, K, dtype=torch.int32, device="cuda")
        getattr(ops, op)(logits, ends, stock, workspace, K, width)
        ours = select_topk(logits, ends, K)
        assert torch.equal(torch.sort(stock, dim=1).values, ours), (rows, width)
        q = torch.randn(rows, heads, dim, device="cuda", generator=gen)
        kv = torch.randn(width, dim, device="cuda", generator=gen)
        torch.testing.assert_close(
            sparse_attention(q, kv, ours, dim**-0.5),
            sparse_attention(q, kv, stock, dim**-0.5),
            rtol=1e-5,
            atol=1e-6,
        )
