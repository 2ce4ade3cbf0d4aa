# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The four kernels' rules (``key_for`` in each ``*_kernel.py``), table-driven
from ``tools/guard_table.py``: every case there is refused naming its
argument or taken; the public functions raise the same ``ValueError`` before
anything compiles or launches; the compile key comes from the fields it
names and nothing else; the README's guard table is the tool's output.

On the CPU the rules take CPU tensors only where a test says so (the
``cpu_rules`` fixture). The GPU tests run each rule's edges through
``KpoolStage`` and ``FusedRemap``: just inside, the kernel runs with stock's
bytes; just outside, the stock function runs and the kernel is not
launched."""

import dataclasses

import pytest
import torch

from tools import guard_table
from tools.guard_table import BF16, DIM, F32, I32, I64, POOL, U8, T
from vllm.models.glm5next.nvidia.specialized_decode import (
    constants,
    kpool,
    remap_kernel,
)
from vllm.models.glm5next.nvidia.specialized_decode.jit import Refused

REFUSED = [case for case in guard_table.CASES if case.argument is not None]
TAKEN = [case for case in guard_table.CASES if case.argument is None]


def ids(cases):
    return [case.id for case in cases]


@pytest.fixture
def cpu_rules(monkeypatch):
    """The rules take CPU tensors as CUDA ones (the layout rules on the CPU)."""
    monkeypatch.setattr(constants, "KERNEL_DEVICE_TYPES", frozenset({"cuda", "cpu"}))


def test_readme_guard_table_is_the_rules():
    """README.md's guard table is what the rules answer for the table's
    cases (paste ``python tools/guard_table.py`` between its markers)."""
    assert guard_table.readme_table() == guard_table.markdown()


# --- Every case of the table ------------------------------------------------------


@pytest.mark.parametrize("case", REFUSED, ids=ids(REFUSED))
def test_rule_refuses(cpu_rules, case):
    """The case's broken requirement is refused naming its argument."""
    rule = guard_table.jit_kernel(case.kernel).key_for
    with pytest.raises(Refused, match=rf"^{case.argument}: expected .*, got "):
        rule(case.args())


@pytest.mark.parametrize("case", TAKEN, ids=ids(TAKEN))
def test_rule_takes(cpu_rules, case):
    """The rule takes the case's edge, with a compile key of its kernel."""
    kernel = guard_table.jit_kernel(case.kernel)
    assert isinstance(kernel.key_for(case.args()), kernel.CompileKey)


@pytest.mark.gpu
def test_rules_answer_cuda_as_cpu(monkeypatch):
    """Every case of the table gets on CUDA tensors the answer it gets on
    CPU ones: the device check's fast path (CUDA tensors only) refuses and
    takes what its full check does."""
    on_cuda = {case.id: guard_table.refusal(case, "cuda") for case in guard_table.CASES}
    monkeypatch.setattr(constants, "KERNEL_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    on_cpu = {case.id: guard_table.refusal(case) for case in guard_table.CASES}
    differ = {k: (on_cuda[k], on_cpu[k]) for k in on_cpu if on_cuda[k] != on_cpu[k]}
    assert not differ, differ
    assert sum(answer is not None for answer in on_cuda.values()) == len(REFUSED)


@pytest.mark.parametrize("name", guard_table.KERNELS)
def test_every_requirement_has_a_refusal(name):
    """Each argument a rule reads is broken by some case, and every tensor
    argument by the type and device cases."""
    spec = guard_table.KERNELS[name]
    fields = guard_table.build(name)._fields
    refused = {case.argument for case in REFUSED if case.kernel == name}
    assert refused == set(fields) - set(spec.unchecked)
    for tensor in spec.tensors:
        names = {case.name for case in REFUSED if case.kernel == name and case.every}
        assert {f"{tensor}-list", f"{tensor}-meta"} <= names


MESSAGES = {
    "update-kv_cache-list": "kv_cache: expected a torch.Tensor, got list",
    "update-key-none": "key: expected a torch.Tensor, got NoneType",
    "remap-out-none": "out: expected a torch.Tensor, got NoneType",
    "upcast-row_ends-meta": "row_ends: expected a CUDA tensor, got a tensor on meta",
    "update-head_dim-64": "head_dim: expected 128, got 64",
    "update-pool_size-8": "pool_size: expected 4, got 8",
    "update-ape-shape": "ape: expected a contiguous fp32 [4, 128], got "
    "torch.float32 [4, 64] strides [64, 1]",
    "update-slots-shape": "slot_mapping: expected a contiguous int32/int64 "
    "[requests, tokens], got torch.int64 [3, 3] strides [3, 1]",
    "update-key-dim-64": "key: expected bf16 [requests, tokens, 128], got "
    "torch.bfloat16 [2, 3, 64] strides [192, 64, 1]",
    "update-score-shape": "slot_score: expected bf16 [requests, tokens, 128] as "
    "key, unit dim stride, 8-byte aligned rows, got torch.bfloat16 [2, 4, 128] "
    "strides [512, 128, 1]",
    "expand-out-none": "out: expected a tensor to write (the kernel does not "
    "allocate), got None",
    "expand-lens-short": "seq_lens: expected int32/int64 [>= rows], unit stride, "
    "got torch.int64 [2] strides [1]",
    "expand-offset-2^31": "seq_offset: expected an int32, got 2147483648",
    "remap-pools-48": "pool_ids: expected a multiple of 32 pools, at most 1024, got 48",
    "remap-width-2100": "out: expected a width of at least pools * 4 + 3 (2051) "
    "columns, a multiple of 128, got 2100",
    "remap-width-4224-counts": "out: expected a width the stock conversion with "
    "counts compacts in column order (at most 4096), got 4224",
    "remap-ids-more-rows": "pool_ids: expected at most the rows of req_ids (3), got 4",
    "remap-block-size-6": "block_size: expected a positive int32 multiple of 4, got 6",
    "remap-block-size-2^31": "block_size: expected a positive int32 multiple of "
    "4, got 2147483648",
    "remap-stride-rows-2^31": "stride_rows: expected an int32, got 2147483648",
    "remap-stride-rows-float": "stride_rows: expected an int32, got 64.0",
    "remap-counts-short": "counts: expected int32 [>= rows of req_ids], unit "
    "stride, got torch.int32 [2] strides [1]",
    "upcast-ends-more-rows": "row_ends: expected int32 [rows of logits], unit "
    "stride, got torch.int32 [4] strides [1]",
    "select-k-bool": "k: expected an int in [1, 4096], got True",
    "select-logits-too-wide": "logits: expected at most 851968 columns (16 CTAs "
    "of 53248 shared keys), got 851972",
    "select-ends-fewer-rows": "ends: expected int32 [>= rows of logits], unit "
    "stride, got torch.int32 [2] strides [1]",
}
BY_ID = {case.id: case for case in guard_table.CASES}


@pytest.mark.parametrize("case_id", MESSAGES)
def test_message(cpu_rules, case_id):
    """The whole message of a refusal: the argument, what the kernel takes
    (the value the requirement came to in parentheses), what came."""
    assert guard_table.refusal(BY_ID[case_id]) == MESSAGES[case_id]


@pytest.mark.parametrize("name", guard_table.KERNELS)
def test_cpu_tensors_are_refused(name):
    """Without the test setting the rules refuse CPU tensors, naming the first
    tensor argument (no kernel runs on the CPU)."""
    spec = guard_table.KERNELS[name]
    with pytest.raises(Refused) as refusal:
        guard_table.jit_kernel(name).key_for(guard_table.build(name))
    assert str(refusal.value) == (
        f"{spec.tensors[0]}: expected a CUDA tensor, got a tensor on cpu"
    )


# --- The public functions raise the rule's refusal ---------------------------------


def public_call(name: str, a):
    """The public function of kernel ``name`` called with ``a``, or None where
    the function has no parameter for what ``a`` changes (it passes
    ``head_dim`` 128 and ``int32_lengths`` False)."""
    if name == "update":
        if a.head_dim != DIM:
            return None
        return lambda: kpool.kpool_update(
            *a[:9], mx_scales=a.mx_scales, round_scale=a.round_scale
        )
    if name == "upcast":
        return lambda: kpool.upcast_logits(a.logits, a.row_ends, out=a.out)
    if name == "select":
        return lambda: kpool.select_topk(a.logits, a.ends, a.k, out=a.out)
    if a.int32_lengths:
        return None
    if name == "expand":
        return lambda: kpool.expand_pools(
            a.pool_ids, a.seq_lens, a.pool_size, seq_offset=a.seq_offset, out=a.out
        )
    return lambda: kpool.expand_and_remap(
        *a[:7],
        block_size=a.block_size,
        stride_rows=a.stride_rows,
        seq_offset=a.seq_offset,
    )


class ReachedTheCompiler(Exception):
    pass


@pytest.fixture
def no_compiles(cpu_rules, monkeypatch):
    """A compiler that raises ``ReachedTheCompiler``, over kernels that
    compiled nothing yet (an earlier test in the process may have: any launch
    then compiles first)."""
    from vllm.model_executor.warmup import jit_warmup_cutedsl_helper

    def compile_cutedsl(*args, **kwargs):
        raise ReachedTheCompiler

    monkeypatch.setattr(jit_warmup_cutedsl_helper, "compile_cutedsl", compile_cutedsl)
    for name in guard_table.KERNELS:
        monkeypatch.setattr(guard_table.jit_kernel(name), "_compiled_cache", {})


# The cases the public functions can express (they have no head_dim or
# int32_lengths parameter).
PUBLIC = [c for c in REFUSED if not {"head_dim", "int32_lengths"} & set(c.changes)]


@pytest.mark.parametrize("case", PUBLIC, ids=ids(PUBLIC))
def test_public_function_raises_the_refusal(no_compiles, case):
    """The public function raises the rule's ValueError, word for word,
    before anything compiles (so before any launch)."""
    args = case.args()
    expected = guard_table.refusal(case)
    with pytest.raises(ValueError) as refusal:
        public_call(case.kernel, args)()
    assert str(refusal.value) == expected


@pytest.mark.parametrize("name", guard_table.KERNELS)
def test_public_function_compiles_what_the_rule_takes(no_compiles, name):
    """The seam of the test above is live: the builder's arguments reach
    the compiler."""
    with pytest.raises(ReachedTheCompiler):
        public_call(name, guard_table.build(name))()


# --- The remap's shape rule (asked before a step defers) ---------------------------


@pytest.mark.parametrize(
    "width, in_order",
    [(1, True), (128, True), (4096, True), (4224, False), (6144, False), (8192, True)],
)
def test_stock_compacts_in_order(width, in_order):
    """Rows the stock conversion with counts compacts in column order: one
    program a row (up to 4096 columns, or a power of two)."""
    assert remap_kernel.stock_compacts_in_order(width) is in_order


@pytest.mark.parametrize(
    "groups, width, pool, counts, argument",
    [
        (32, 256, POOL, True, None),
        (64, 384, POOL, True, None),
        (512, 2176, POOL, True, None),
        (992, 4096, POOL, True, None),
        (1024, 4224, POOL, False, None),
        (1024, 8192, POOL, True, None),
        (1024, 4224, POOL, True, "out"),
        (32, 256, 8, True, "pool_size"),
        (32, 256, 2, True, "pool_size"),
        (0, 128, POOL, True, "pool_ids"),
        (16, 128, POOL, True, "pool_ids"),
        (31, 128, POOL, True, "pool_ids"),
        (48, 256, POOL, True, "pool_ids"),
        (1056, 4352, POOL, False, "pool_ids"),
        (32, 128, POOL, True, "out"),
        (32, 130, POOL, True, "out"),
        (32, 192, POOL, True, "out"),
        (96, 384, POOL, True, "out"),
    ],
)
def test_remap_shape_rule(groups, width, pool, counts, argument):
    """``check_shape`` refuses naming the argument; ``shape_takes`` agrees."""
    takes = remap_kernel.shape_takes(groups, width, pool, counts)
    assert takes is (argument is None)
    if argument is not None:
        with pytest.raises(Refused, match=rf"^{argument}: expected "):
            remap_kernel.check_shape(groups, width, pool, counts)


# --- The compile key: from the fields it names, built once -------------------------

TAIL = (3, 2, POOL, DIM)
KEY_FIELDS = [
    # (The base's strides kept: the ring alone changes.)
    (
        "update",
        "ring",
        dict(tail_kv_cache=T((3, 2, 8, DIM), BF16, (1024, 512, DIM, 1))),
    ),
    ("update", "page", dict(kv_cache=T((4, 16, 132), U8, (64 * 132, 132, 1)))),
    (
        "update",
        "page_bytes",
        dict(kv_cache=T((4, 64, 132), U8, (64 * 132 + 4, 132, 1))),
    ),
    ("update", "tail_block", dict(tail_kv_cache=T(TAIL, BF16, (1028, 512, DIM, 1)))),
    ("update", "tail_half", dict(tail_kv_cache=T(TAIL, BF16, (1024, 516, DIM, 1)))),
    ("update", "mx_scales", dict(mx_scales=False)),
    ("update", "round_scale", dict(round_scale=False)),
    ("update", "tail_slots_dtype", dict(tail_slot_mapping=T((2, 3), I32))),
    ("update", "slots_dtype", dict(slot_mapping=T((2, 3), I32))),
    ("update", "positions_dtype", dict(positions=T((2, 3), I64))),
    ("expand", "groups", dict(pool_ids=T((3, 256), I32))),
    ("expand", "seq_lens_dtype", dict(seq_lens=T((3,), I32))),
    ("expand", "int32_lengths", dict(int32_lengths=True)),
    ("remap", "groups", dict(pool_ids=T((3, 256), I32))),
    ("remap", "width", dict(out=T((3, 4096), I32))),
    ("remap", "block_size", dict(block_size=16)),
    ("remap", "stride_rows", dict(stride_rows=128)),
    ("remap", "positions_dtype", dict(positions=T((3,), I32))),
    ("remap", "int32_lengths", dict(int32_lengths=True)),
    ("remap", "counts", dict(counts=None)),
    ("select", "k", dict(k=1024)),
    ("select", "dtype", dict(logits=T((3, 1024), BF16))),
    ("select", "capacity", dict(logits=T((3, 5000), F32))),
    # The cluster size fixes the slice, and so the capacity, at a width.
    ("select", "cluster+capacity", dict(logits=T((3, 65536), F32, (0, 1)))),
]


@pytest.mark.parametrize(
    "name, field, changes", KEY_FIELDS, ids=[f"{k}-{f}" for k, f, _ in KEY_FIELDS]
)
def test_key_field(cpu_rules, name, field, changes):
    """Changing what a key field is read from changes that field alone."""
    rule = guard_table.jit_kernel(name).key_for
    base = dataclasses.asdict(rule(guard_table.build(name)))
    changed = dataclasses.asdict(rule(guard_table.build(name, changes)))
    assert {k for k in base if base[k] != changed[k]} == set(field.split("+"))


def test_every_key_field_has_a_case():
    """``KEY_FIELDS`` changes every field of every compile key."""
    for name in guard_table.KERNELS:
        key = guard_table.jit_kernel(name).CompileKey
        assert {f.name for f in dataclasses.fields(key)} == {
            one
            for kernel, field, _ in KEY_FIELDS
            if kernel == name
            for one in field.split("+")
        }


SAME_KEY = [
    ("update", dict(kv_cache=T((9, 64, 132), U8))),
    (
        "update",
        dict(
            key=T((5, 1, DIM), BF16),
            slot_score=T((5, 1, DIM), BF16, None, 4),
            tail_slot_mapping=T((5, 1), I64),
            slot_mapping=T((5, 1), I64),
            positions=T((5, 1), I32),
            tail_kv_cache=T((7, 2, POOL, DIM), BF16),
        ),
    ),
    ("update", dict(ape=T((POOL, DIM), F32, None, 4))),
    (
        "expand",
        dict(pool_ids=T((7, 512), I32), out=T((7, 4096), I32), seq_lens=T((7,), I64)),
    ),
    ("expand", dict(seq_offset=0, seq_lens=T((9,), I64))),
    ("remap", dict(req_ids=T((5,), I32), out=T((5, 2176), I32), counts=T((9,), I32))),
    ("remap", dict(block_table=T((1, 3), I32), seq_offset=7)),
    ("upcast", dict(logits=T((1, 8), BF16), row_ends=T((1,), I32))),
    ("upcast", dict(out=T((3, 1024), F32))),
    ("select", dict(ends=T((9,), I32), out=T((3, 512), I32))),
    ("select", dict(logits=T((9, 1000), F32, (1000, 1)), ends=T((9,), I32))),
]


@pytest.mark.parametrize("name, changes", SAME_KEY)
def test_same_layout_same_key(cpu_rules, name, changes):
    """What no key field reads (batch sizes, other fields' values, data) gives
    the same key, the very object: built once and frozen."""
    rule = guard_table.jit_kernel(name).key_for
    key = rule(guard_table.build(name))
    assert rule(guard_table.build(name, changes)) is key
    first = dataclasses.fields(key)[0].name if dataclasses.fields(key) else "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(key, first, 0)
    assert hash(key) == hash(rule(guard_table.build(name)))


# --- GPU: each rule's edges through the stage, against stock -----------------------


@pytest.fixture
def launched(monkeypatch):
    """The names of the kernels the stage launched (each kernel's ``launch``
    recorded, then run)."""
    names: list[str] = []
    for name in guard_table.KERNELS:
        kernel = guard_table.jit_kernel(name)

        def spied(executor, args, name=name, launch=kernel.launch):
            names.append(name)
            return launch(executor, args)

        monkeypatch.setattr(kernel, "launch", spied)
    return names


def warm(name: str, args) -> bool:
    """Compiles the key of ``args`` as a warmup would; False if refused."""
    kernel = guard_table.jit_kernel(name)
    try:
        key = kernel.key_for(args)
    except Refused:
        return False
    kernel.compile(key)
    return True


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _copy(view: torch.Tensor) -> torch.Tensor:
    """A copy of ``view`` with its strides and its whole storage (padding)."""
    size = view.untyped_storage().nbytes() // view.element_size()
    base = view.as_strided((size,), (1,), 0).clone()
    return base.as_strided(view.shape, view.stride(), view.storage_offset())


def _update_case(gen, ring=POOL, page_pad=0, key_stride=DIM, tail_pad=0):
    device = gen.device
    g = dict(generator=gen, device=device)
    requests, tokens, page = 5, 3, 64
    page_bytes = page * (DIM + 4) + page_pad
    cache = torch.randint(0, 256, (6 * page_bytes,), dtype=U8, **g)
    kv = cache.as_strided((6, page, DIM + 4), (page_bytes, DIM + 4, 1))
    block = 2 * ring * DIM + tail_pad
    tail = torch.randn((requests + 1) * block, **g).to(BF16)
    tail = tail.as_strided((requests + 1, 2, ring, DIM), (block, ring * DIM, DIM, 1))
    positions = torch.randint(0, 999, (requests, 1), **g) + torch.arange(
        tokens, device=device
    )
    positions = positions.to(I32)
    rows = torch.arange(1, requests + 1, device=device)[:, None]
    tail_slots = rows * ring + positions.long() % ring
    slots = torch.where(
        positions % POOL == POOL - 1,
        torch.randperm(6 * page, **g)[: requests * tokens].view(requests, tokens),
        -1,
    )
    key = torch.randn(requests, tokens, key_stride, **g).to(BF16)[..., :DIM]
    score = torch.randn(requests, tokens, DIM, **g).to(BF16)
    ape = torch.randn(POOL, DIM, **g)
    return [kv, tail, tail_slots, key, score, ape, slots, positions]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "edge, inside",
    [
        (dict(ring=4), True),
        (dict(ring=12), True),
        (dict(tail_pad=4), True),
        (dict(tail_pad=2), False),
        (dict(page_pad=4), True),
        (dict(key_stride=DIM + 4), True),
        (dict(key_stride=DIM + 2), False),
    ],
)
def test_update_edges(launched, edge, inside):
    """``KpoolStage.update`` at the update rule's edges: the kernel inside,
    stock outside, the cache and tail bytes stock's (padding included)."""
    from vllm.models.glm5next.nvidia.ops import kpool_compress
    from vllm.models.glm5next.nvidia.specialized_decode.update_kernel import (
        UpdateArgs,
    )
    from vllm.utils.deep_gemm import mqa_logits_use_mx_scales

    args = _update_case(torch.Generator("cuda").manual_seed(11), **edge)
    mx = mqa_logits_use_mx_scales()
    assert warm("update", UpdateArgs(*args, POOL, DIM, mx, True)) is inside
    ours, stock = (
        [_copy(a) if i < 2 else a for i, a in enumerate(args)] for _ in range(2)
    )
    kpool.KpoolStage.update(*ours, POOL, DIM, round_scale=True)
    kpool_compress.kpool_decode_update_and_maybe_write_cache_batched(
        *stock, POOL, DIM, round_scale=True
    )
    torch.cuda.synchronize()
    assert launched == (["update"] if inside else [])
    assert same_bytes(stock[0], ours[0]) and same_bytes(stock[1], ours[1])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "edge, inside",
    [
        (dict(out_stride=2052), True),
        (dict(out_stride=2054), False),
        (dict(seq_offset=2**31 - 1), True),
        (dict(seq_offset=2**31), False),
        (dict(groups=0), True),
        (dict(lengths=2**31 - 2), True),
        (dict(lengths=2**31 - 2, int32_lengths=True), True),
        (dict(lengths=2**33 - 2, int32_lengths=True), True),
    ],
)
def test_expand_edges(launched, edge, inside):
    """``KpoolStage.expand`` at the expand rule's edges, with int64 lengths
    past int32 too: stock's bytes (of the lengths cast to int32 where the
    stage mirrors stock's decode, ``int32_lengths``), the kernel inside."""
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )
    from vllm.models.glm5next.nvidia.specialized_decode.expand_kernel import (
        ExpandArgs,
    )

    gen = torch.Generator("cuda").manual_seed(7)
    groups = edge.get("groups", 512)
    stride = edge.get("out_stride", groups * POOL + POOL)
    offset = edge.get("seq_offset", 1)
    int32_lengths = edge.get("int32_lengths", False)
    rows = 6
    g = dict(generator=gen, device="cuda")
    ids = torch.randint(-1, 99999, (rows, groups), dtype=I32, **g)
    lengths = edge.get("lengths", 0)
    high = 8 if lengths else 2**30
    seq = lengths + torch.randint(0, high, (rows,), generator=gen, device="cuda")
    ours = torch.randint(-(2**31), 2**31 - 1, (rows, stride), dtype=I32, **g)
    stock = ours.clone()
    views = [b[:, : groups * POOL + POOL - 1] for b in (ours, stock)]
    args = ExpandArgs(ids, seq, POOL, offset, views[0], int32_lengths)
    assert warm("expand", args) is inside
    kpool.KpoolStage.expand(
        ids, seq, POOL, seq_offset=offset, out=views[0], int32_lengths=int32_lengths
    )
    stock_seq = seq.to(I32) if int32_lengths else seq
    expand_pools_and_append_tail(ids, stock_seq, POOL, seq_offset=offset, out=views[1])
    torch.cuda.synchronize()
    assert launched == (["expand"] if inside else [])
    assert torch.equal(stock, ours)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "edge, inside",
    [
        (dict(logits_stride=1008), True),
        (dict(logits_stride=1004), False),
        (dict(ends_shape=(5,)), True),
        (dict(ends_shape=(5, 1)), False),
    ],
)
def test_upcast_edges(launched, edge, inside):
    """``KpoolStage.upcast`` at the upcast rule's edges: stock's FP32 values
    below each row end, the kernel inside."""
    from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
    from vllm.models.glm5next.nvidia.specialized_decode.upcast_kernel import (
        UpcastArgs,
    )

    gen = torch.Generator("cuda").manual_seed(3)
    rows, width = 5, 1000
    stride = edge.get("logits_stride", 1008)
    storage = torch.randn(rows * stride, generator=gen, device="cuda")
    logits = storage.to(BF16).as_strided((rows, width), (stride, 1))
    ends = torch.randint(0, width + 1, (rows,), generator=gen, device="cuda")
    ends = ends.to(I32).view(edge.get("ends_shape", (rows,)))
    assert warm("upcast", UpcastArgs(logits, ends)) is inside
    got = kpool.KpoolStage.upcast(logits, ends)
    expected = as_fp32_logits(logits, ends)
    torch.cuda.synchronize()
    assert launched == (["upcast"] if inside else [])
    below = torch.arange(width, device="cuda")[None, :] < ends.view(-1)[:, None]
    assert torch.equal(got.view(I32)[below], expected.view(I32)[below])


def _group(width: int, device):
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

    group = SparseMLAIndexGroup(
        logical_topk_indices=torch.full((16, width), -1, dtype=I32, device=device),
        physical_topk_indices=torch.empty(9, width, dtype=I32, device=device),
        valid_topk_counts=torch.empty(9, dtype=I32, device=device),
        side_stream=torch.cuda.Stream(device),
        logical_topk_ready=torch.cuda.Event(),
        physical_topk_ready=torch.cuda.Event(),
        has_indexer=True,
    )
    group.register_layer()
    return group


@pytest.mark.gpu
@pytest.mark.parametrize(
    "edge, inside",
    [
        (dict(groups=32, width=256), True),
        (dict(groups=48, width=256), False),
        (dict(groups=1024, width=8192), True),
        (dict(groups=992, width=4096, block=4), True),
        (dict(groups=512, width=2176, block=6), False),
        (dict(groups=512, width=2176, block=12), True),
    ],
)
def test_remap_edges(launched, edge, inside):
    """A ``FusedRemap`` of a real index group at the remap rule's edges:
    inside, the kernel converts the handed-over pool top-k; outside, the
    logical rows are written and the stock conversion runs. Both give the
    stock group's physical rows and counts."""
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )
    from vllm.models.glm5next.nvidia.specialized_decode.fused_remap import Deferred
    from vllm.models.glm5next.nvidia.specialized_decode.remap_kernel import (
        RemapArgs,
    )

    groups, width, block = edge["groups"], edge["width"], edge.get("block", 64)
    stride = edge.get("stride", block)
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(5)
    g = dict(generator=gen, device=device)
    rows = 6
    pool_ids = torch.randint(-1, 512 * block // POOL, (rows, groups), **g).to(I32)
    positions = torch.randint(0, 512 * block, (rows,), **g)
    req_ids = torch.arange(rows, dtype=I32, device=device)
    table = torch.randint(0, 1 << 20, (rows, 512), **g).to(I32)
    stock_group, fused_group = _group(width, device), _group(width, device)
    remap = kpool.FusedRemap(fused_group, kpool.KpoolStage([], 8, device))
    out, counts = fused_group.physical_topk_indices, fused_group.valid_topk_counts
    out, counts = out[:rows], counts[:rows]
    args = RemapArgs(
        pool_ids, positions, POOL, req_ids, table, out, counts, block, stride, 1, True
    )
    assert warm("remap", args) is inside
    remap.hand_over(Deferred(pool_ids, positions))
    fused_group.set_logical_topk_ready(0)
    convert = dict(block_stride_rows=stride, return_valid_counts=True)
    logical = fused_group.logical_topk_indices[:rows]
    got = remap(0, logical, req_ids, table, block, **convert)
    logical = stock_group.logical_topk_indices[:rows]
    expand_pools_and_append_tail(
        pool_ids, positions.to(I32), POOL, seq_offset=1, out=logical
    )
    stock_group.set_logical_topk_ready(0)
    expected = stock_group._convert_once(0, logical, req_ids, table, block, **convert)
    torch.cuda.synchronize()
    assert ("remap" in launched) is inside
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.gpu
@pytest.mark.parametrize("name", guard_table.KERNELS)
def test_one_device(monkeypatch, name):
    """A tensor on another device than the first one is refused naming it
    (a second device here: the meta device, let through the type check)."""
    monkeypatch.setattr(constants, "KERNEL_DEVICE_TYPES", frozenset({"cuda", "meta"}))
    spec = guard_table.KERNELS[name]
    base = spec.base()
    rule = guard_table.jit_kernel(name).key_for
    rule(guard_table.build(name, device="cuda"))
    for tensor in spec.tensors[1:]:
        like = T((3, 1024), F32) if base[tensor] is None else base[tensor]
        args = guard_table.build(name, {tensor: like._replace(device="meta")}, "cuda")
        with pytest.raises(Refused) as refusal:
            rule(args)
        assert str(refusal.value) == (
            f"{tensor}: expected a tensor on cuda:0 as the others, got meta"
        )
