# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stage (``runtime/stage.py``, ``runtime/remap.py``) on the real decode
path of ``sparse_attn_indexer_kpool`` and the sparse MLA index conversion,
one step of one layer (CPU, stock Triton kernels interpreted; see
``indexer_sim``).

Stage off: the patched indexer equals the unpatched one. Stage on (built as
``install()`` builds it, warmed up by its real warmup): every byte stock
leaves (the caches, the logical buffer wherever a consumer reads it, the
physical rows and counts, the group's whole buffers), with the route each
input took asserted. The stage launches only what its warmup compiled; each
launch is computed by the kernel's stock twin.
"""

import subprocess
import sys
import tempfile
import textwrap
from functools import partial
from pathlib import Path

import pytest
import torch
from indexer_sim import (
    KERNELS,
    POISON,
    STOCK_EXPAND,
    Model,
    Step,
    assert_same,
    contract_decode_topk,
    mismatches,
    paged_logits,
)

from vllm.config import CUDAGraphMode
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.common.host import STOCK
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.expand.launch import (
    ExpandKernel,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.remap.launch import (
    RemapKernel,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.upcast.launch import (
    UpcastKernel,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.update.launch import (
    UpdateKernel,
)
from vllm.models.glm5next.nvidia.specialized_decode.runtime import stage as stage_module
from vllm.models.glm5next.nvidia.specialized_decode.runtime import steps
from vllm.models.glm5next.nvidia.specialized_decode.runtime.remap import Deferred

PACKAGE = Path(stage_module.__file__).resolve().parents[1]
LAYER = "model.layers.0.self_attn.indexer.k_cache"
MTP_LAYER = "model.layers.3.self_attn.indexer.k_cache"
# GLM-5-Next's real top-k: 512 pools, 2176-column rows, contexts above 2048.
GLM = dict(topk=2048)
FP32 = dict(scale_fmt=None)  # scales not rounded to powers of two

# Steps whose top-k rows are the decode tokens in order (they defer).
TOKEN_ROWS = [
    pytest.param(Step([1, 1, 1], [150, 203, 190]), id="decode"),
    pytest.param(Step([2, 2], [157, 210], seed=1), id="mtp2"),
    pytest.param(Step([4, 4], [161, 233], seed=2), id="mtp4"),
    pytest.param(Step([1, 1, 1], [150, 203, 190], pad_rows=3, seed=3), id="padrows"),
    pytest.param(Step([1, 3, 2], [171, 140, 255], "varlen", seed=4), id="varlen"),
    pytest.param(Step([1, 1, 1], [2100, 2403, 2190], seed=30, **GLM), id="glm"),
    pytest.param(Step([2, 2], [2157, 2310], seed=31, **GLM), id="glm-mtp2"),
    pytest.param(
        Step([1, 2], [2171, 2140], "varlen", pad_rows=1, seed=32, **GLM),
        id="glm-varlen",
    ),
]
OTHER_ROWS = [
    pytest.param(Step([1, 3, 2], [171, 140, 255], "padded", seed=5), id="padded"),
    pytest.param(Step([2, 2], [40, 90], seed=6), id="short"),
    pytest.param(Step([1, 1], [150, 180], prefill=9, seed=7), id="mixed"),
    pytest.param(Step([1, 1], [150, 180], positions=False, seed=8), id="nopositions"),
    pytest.param(Step([1, 2], [2171, 2140], "padded", seed=33, **GLM), id="glm-pad"),
    pytest.param(Step([1, 1], [1500, 2000], seed=34, **GLM), id="glm-short"),
]

UPDATE = "kernel:update"
# SM90's logits are FP32: the upcast kernel refuses them, stock returns them.
UPCAST = "stock:upcast"
DEFERRED = [UPDATE, UPCAST, "defer", "kernel:remap"]
EXPANDED = [UPDATE, UPCAST, "kernel:expand", "stock:convert"]
# Rows that need padding: the stage updates, stock does the rest.
PADDED = [UPDATE, "indexer:expand", "stock:convert"]
# A deferred top-k the fused remap declines: its logical rows, then stock.
MATERIALIZED = [UPDATE, UPCAST, "defer", "materialize", "kernel:expand"]
FUSED_STREAMS = [
    "side.wait_event(logical_ready)",
    "enter side",
    "kernel:remap",
    "physical_ready.record(side)",
    "exit side",
    "compute.wait_event(physical_ready)",
]
READY = "logical_ready.record(compute)"


def untouched(model) -> bool:
    """The logical buffer as it was before the step (no row written)."""
    return bool((model.snaps[0].logical == POISON).all())


@pytest.mark.parametrize("step", TOKEN_ROWS + OTHER_ROWS)
def test_stage_off_is_stock(bench, step):
    """``SPECIALIZED_KPOOL`` None: the patched tree writes what stock writes."""
    b = bench(step, warm=False)
    off = b.run(Model(b.sim, "off"))
    assert not [e for e in b.routes if e.startswith("kernel:")]
    assert_same(b.stock(), off, b.fwd)


@pytest.mark.parametrize("step", TOKEN_ROWS)
def test_defer_and_fused_remap(bench, step):
    """Token-ordered decode rows: the pool top-k goes straight to the
    ``FusedRemap`` on the group's side stream; the logical buffer is left
    as it was (no consumer reads it)."""
    b = bench(step)
    got = b.run()
    assert b.spies.timeline == [UPDATE, UPCAST, "defer", READY, *FUSED_STREAMS]
    assert untouched(got)
    assert_same(b.stock(), got, b.fwd)


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(Step([1, 1, 1], [150, 203, 190], seed=40), id="decode"),
        pytest.param(Step([1, 3, 2], [171, 140, 255], "varlen", seed=41), id="varlen"),
        pytest.param(
            Step([1, 2], [2171, 2140], "varlen", seed=42, **GLM), id="glm-varlen"
        ),
        pytest.param(Step([2, 2], [157, 210], scale_fmt=None, seed=43), id="unrounded"),
    ],
)
def test_sm100_mx_scales(sm100, bench, step):
    """SM100: the update writes MX (UE8M0) scales, compiled as such at warmup,
    and the BF16 logits are upcast by the kernel."""
    b = bench(step, mx=True)
    got = b.run()
    assert {key.mx_scales for key in b.spies.compiled["update"]} == {True}
    assert b.routes == [UPDATE, "kernel:upcast", "defer", "kernel:remap"]
    assert_same(b.stock(), got, b.fwd)


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(Step([2, 2], [157, 210], seed=44, **FP32), id="mtp2"),
        pytest.param(
            Step([1, 1, 1], [2100, 2403, 2190], seed=45, **FP32, **GLM), id="glm"
        ),
        pytest.param(
            Step([1, 3, 2], [171, 140, 255], "padded", seed=46, **FP32), id="padded"
        ),
    ],
)
def test_fp32_scales_not_rounded(bench, step):
    """``scale_fmt=None``: FP32 scales that are not powers of two, the
    update's compile key and stock alike."""
    b = bench(step)
    got = b.run()
    assert {key.round_scale for key in b.spies.compiled["update"]} == {False}
    assert b.routes == (PADDED if step.layout == "padded" else DEFERRED)
    assert_same(b.stock(), got, b.fwd)


# --- The opt-in select ------------------------------------------------------

SELECTED = [UPDATE, "kernel:select", "defer", "kernel:remap"]


def assert_same_sets(b, got) -> None:
    """Stock's bytes, the top-k rows as sets; and the order did change."""
    want = b.stock()
    assert_same(want, got, b.fwd, sets=True)
    assert mismatches(want, got, b.fwd.tokens), "no order changed"


@pytest.mark.parametrize("step", TOKEN_ROWS)
def test_select_opted_in(bench, references, step):
    """``kpool_select``: a deferring step's logits go to the select (no
    upcast, no stock top-k), its ascending pool ids to the fused remap.
    Stock's top-k stand-in is ``select_contract.contract_topk`` (written from
    the select's stated contract, not the product's reference) with each
    row's ids reversed, as stock's order is its own; the spied select
    computes ``contract_topk`` too (its GPU launches are compared with it
    in the step runs). Every byte as stock's, the top-k rows as sets."""
    references(topk=contract_decode_topk)
    b = bench(step, select=True)
    got = b.run()
    assert b.routes == SELECTED
    assert b.spies.launched["select"] <= b.spies.compiled["select"]
    assert_same_sets(b, got)


def test_select_of_bf16_logits(sm100, bench, references):
    """SM100: the select reads DeepGEMM's BF16 logits; nothing upcasts. The
    stock stand-in as ``test_select_opted_in``'s."""
    references(topk=contract_decode_topk)
    b = bench(Step([2, 2], [2157, 2310], seed=35, **GLM), mx=True, select=True)
    got = b.run()
    assert b.routes == SELECTED
    assert_same_sets(b, got)


def test_select_runs_past_one_wave(monkeypatch, bench, references):
    """With ``kpool_select`` true, rows whose clusters take a second wave
    still select (the stock stand-in as ``test_select_opted_in``'s)."""
    references(topk=contract_decode_topk)
    b = bench(Step([1, 1, 1], [2100, 2403, 2190], seed=36, **GLM), select=True)
    monkeypatch.setattr(stage_module, "one_wave", lambda *args: False)
    got = b.run()
    assert b.routes == SELECTED
    assert_same_sets(b, got)


def test_one_wave_select_declines_past_one_wave(monkeypatch, bench):
    """With ``kpool_select="one_wave"``, rows whose clusters take a second
    wave run stock's upcast and top-k (vLLM's torch top-k on both sides:
    stock's bytes)."""
    b = bench(Step([1, 1, 1], [2100, 2403, 2190], seed=36, **GLM), select="one_wave")
    monkeypatch.setattr(stage_module, "one_wave", lambda *args: False)
    got = b.run()
    assert b.routes == DEFERRED
    assert_same(b.stock(), got, b.fwd)


@pytest.mark.parametrize("step", OTHER_ROWS)
def test_select_only_in_deferring_steps(bench, step):
    """Steps that do not defer never select: stock's bytes (vLLM's torch
    top-k on both sides)."""
    b = bench(step, select=True)
    got = b.run()
    assert "kernel:select" not in b.routes
    assert_same(b.stock(), got, b.fwd)


# --- The opt-in scores ------------------------------------------------------


# DeepGEMM's positional arguments the scores take by name, in its order.
NAMES = ("q", "kv_cache", "weights", "seq_lens", "block_table")


class Scores:
    """The stage's scores and DeepGEMM's stand-in (``paged_logits``), each
    call's arguments recorded; ``serve`` answers ``answer``: DeepGEMM's
    logits (the kernel took the call) or ``STOCK``."""

    def __init__(self, monkeypatch, stage, answer):
        self.served, self.stock = [], []

        def serve(**arguments):
            self.served.append(arguments)
            if answer is STOCK:
                return STOCK
            rest = dict(arguments)
            return paged_logits(*[rest.pop(n) for n in NAMES], **rest)

        def deep_gemm(*args, **kwargs):
            self.stock.append((args, kwargs))
            return paged_logits(*args, **kwargs)

        monkeypatch.setattr(stage.kernels.scores, "serve", serve)
        monkeypatch.setattr(stage_module, "fp8_fp4_paged_mqa_logits", deep_gemm)


def equal(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(map(equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def stock_arguments(args, kwargs) -> dict:
    """DeepGEMM's call as the scores' keyword arguments (no schedule)."""
    return dict(zip(NAMES, args[:5], strict=True)) | kwargs


@pytest.mark.parametrize("answer", ["logits", STOCK], ids=["served", "stock"])
@pytest.mark.parametrize("step", TOKEN_ROWS[:3])
def test_scores_opted_in(monkeypatch, bench, step, answer):
    """``kpool_scores``: the step's scores go to the stage's kernel with the
    stock call's arguments (DeepGEMM's but the schedule metadata), and
    DeepGEMM runs only where the kernel answers ``STOCK``, with the same
    arguments as with the setting off; the step is stock's either way."""
    off = bench(step)
    calls = Scores(monkeypatch, off.stage, STOCK)
    off.run()
    [(args, kwargs)] = calls.stock
    assert calls.served == [] and sorted(kwargs) == ["indices", "max_model_len"]
    b = bench(step, scores=True)
    on = Scores(monkeypatch, b.stage, answer)
    got = b.run()
    [served] = on.served
    want = stock_arguments(args, kwargs)
    assert served.keys() == want.keys()
    assert all(equal(served[n], want[n]) for n in want), "not the stock call's"
    if answer is STOCK:
        [(args_on, kwargs_on)] = on.stock
        assert stock_arguments(args_on, kwargs_on) == served  # the same objects
        assert len(args_on) == 6  # and the step's schedule metadata
    else:
        assert on.stock == []
    assert_same(b.stock(), got, b.fwd)


def test_scores_take_the_real_heads_of_padded_ones(monkeypatch, bench):
    """vLLM pads GLM-5-Next's 16 index heads to 32 with zeros: the kernel
    gets views of the first 16 of the query and the weights (its key's 16
    heads), DeepGEMM, where the kernel answers ``STOCK``, the padded 32."""
    pages = dict(block=128, stride_rows=160)  # 32-pool pages, which it takes
    step = Step([2, 2], [157, 210], heads=32, index_heads=16, seed=48, **pages)
    b = bench(step, scores=True)
    assert {key.heads for key in b.spies.compiled["scores"]} == {16}
    on = Scores(monkeypatch, b.stage, STOCK)
    got = b.run()
    [served], [(args, _)] = on.served, on.stock
    (values, scales), (padded, _) = served["q"], args[0]
    assert values.shape[2] == 16 and padded.shape[2] == 32 and scales is None
    assert values.data_ptr() == padded.data_ptr()
    assert values.stride() == padded.stride()
    assert torch.equal(served["weights"], args[2][:, :16])
    assert args[2].shape[1] == 32 and not padded[:, :, 16:].float().any()
    assert_same(b.stock(), got, b.fwd)


def test_scores_not_taken_run_deepgemm(bench):
    """The simulator's 4-head queries and 16-pool pages are no key the
    warmup lists and the kernel's rule refuses: DeepGEMM's scores, stock's
    bytes."""
    b = bench(Step([2, 2], [157, 210], seed=47), scores=True)
    assert not b.spies.compiled["scores"]
    got = b.run()
    assert b.routes == DEFERRED and not b.spies.launched["scores"]
    assert_same(b.stock(), got, b.fwd)


# --- The fused remap and its declines -----------------------------------------


def test_fused_remap_under_piecewise_graphs(bench):
    """Inside piecewise CUDA graphs the side stream waits on the compute
    stream (an event recorded in a captured segment is graph-local; the
    group records none)."""
    b = bench(Step([2, 2], [157, 210], seed=11))
    got = b.run(mode=CUDAGraphMode.PIECEWISE)
    assert b.spies.timeline == [
        UPDATE,
        UPCAST,
        "defer",
        "side.wait_stream(compute)",
        *FUSED_STREAMS[1:],
    ]
    assert_same(b.stock(mode=CUDAGraphMode.PIECEWISE), got, b.fwd)


@pytest.mark.parametrize("bound, stride", [(96, 96), (64, None)])
def test_fused_remap_block_stride(bench, bound, stride):
    """Blocks ``stride`` rows apart (other layers' pages between them), as
    warmup read it from the bound MLA cache; None: the block size."""
    b = bench(Step([1, 1, 1], [150, 203, 190], seed=12, stride_rows=bound))
    got = b.run(block_stride_rows=stride)
    assert b.routes == DEFERRED
    assert_same(b.stock(block_stride_rows=stride), got, b.fwd)


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(Step([1, 1, 1], [150, 203, 190], pad_rows=1, seed=13), id="one"),
        pytest.param(Step([2, 2], [2157, 2310], seed=35, **GLM), id="glm"),
    ],
)
def test_fused_remap_without_counts(bench, step):
    """FlashMLA's mixed-batch FP8 decode converts without counts: fused too,
    in place, the group's counts untouched."""
    b = bench(step)
    got = b.run(counts=False)
    assert b.spies.timeline == [UPDATE, UPCAST, "defer", READY, *FUSED_STREAMS]
    assert (got.groups[0].valid_topk_counts == POISON).all()
    assert_same(b.stock(counts=False), got, b.fwd)


def assert_materialized_then_stock(timeline) -> None:
    """The logical rows are written, then recorded ready, before the stock
    conversion's side stream waits on that record and converts."""
    assert timeline[:10] == [
        *MATERIALIZED[:3],
        READY,
        *MATERIALIZED[3:],
        READY,
        "side.wait_event(logical_ready)",
        "enter side",
        "stock:convert",
    ]


def test_declined_by_block_stride(bench):
    """A block stride warmup did not compile (the cache was bound with
    another): the fused remap declines, materializes, and the stock
    conversion runs after the logical rows are recorded ready."""
    b = bench(Step([1, 1, 1], [150, 203, 190], seed=14))
    got = b.run(block_stride_rows=96)
    assert_materialized_then_stock(b.spies.timeline)
    assert not untouched(got)
    assert_same(b.stock(block_stride_rows=96), got, b.fwd)


@pytest.mark.parametrize(
    "options, capacity, routes",
    [
        # A later layer of a group reads the leader's physical rows.
        pytest.param(dict(layer_index=1), None, MATERIALIZED, id="layer1"),
        # Rows past the group's buffers: stock converts on the compute stream.
        pytest.param({}, 1, [*MATERIALIZED, "stock:convert"], id="above-capacity"),
    ],
)
def test_deferred_then_materialized(bench, options, capacity, routes):
    """A deferred top-k the fused remap cannot take is materialized into the
    logical rows, then converted by stock."""
    step = Step([1, 1, 1], [150, 203, 190], pad_rows=1, seed=13)
    b = bench(step, capacity=capacity)
    got = b.run(**options)
    assert b.routes == routes
    assert_same(b.stock(**options), got, b.fwd)


@pytest.mark.parametrize(
    "step, options, routes",
    [
        # SM90 non-uniform rows are [requests, max q_len]: stock from the
        # scores on.
        pytest.param(
            Step([1, 3, 2], [171, 140, 255], "padded", seed=5), {}, PADDED, id="padded"
        ),
        pytest.param(
            Step([1, 2], [2171, 2140], "padded", seed=33, **GLM),
            {},
            PADDED,
            id="glm-padded",
        ),
        # Stock fills short rows causally on CUDA; on the CPU it expands.
        pytest.param(Step([2, 2], [40, 90], seed=6), {}, EXPANDED, id="short"),
        pytest.param(
            Step([1, 1], [1500, 2000], seed=34, **GLM), {}, EXPANDED, id="glm-short"
        ),
        # The longest row exactly the top-k's 2048 tokens: stock's causal fill.
        pytest.param(
            Step([1, 1], [1500, 2047], seed=35, **GLM), {}, EXPANDED, id="glm-at-topk"
        ),
        # Rows too wide for the stock conversion to compact them in order.
        pytest.param(
            Step([1, 1], [150, 180], seed=15, width=4224), {}, EXPANDED, id="width4224"
        ),
        # 48 pools: not a multiple of 32 (no remap compiled: unbound cache).
        pytest.param(
            Step([1, 1], [250, 280], seed=16, topk=192),
            dict(bound=False),
            EXPANDED,
            id="pools48",
        ),
        # No positions: no tail update, stock from the scores on.
        pytest.param(
            Step([1, 1], [150, 180], positions=False, seed=8),
            {},
            ["indexer:expand", "stock:convert"],
            id="nopositions",
        ),
        pytest.param(
            Step([1, 1], [150, 180], seed=16, key_stride=130),
            {},
            ["stock:update", UPCAST, "defer", "kernel:remap"],
            id="unaligned-key",
        ),
    ],
)
def test_routes(bench, step, options, routes):
    b = bench(step, **options)
    got = b.run()
    assert b.routes == routes
    assert_same(b.stock(), got, b.fwd)


def test_unaligned_rows_expand_stock(bench):
    """Top-k rows whose stride is not 16-byte aligned: no defer (the remap
    stores 16 bytes), stock expansion into the buffer (no consumer
    converts these rows)."""

    def nothing(model, layer, logical, mla):
        return logical[:0], None

    b = bench(Step([1, 1], [150, 180], seed=21, width=133))
    got = b.run(consume=nothing)
    assert b.routes == [UPDATE, UPCAST, "stock:expand"]
    assert_same(b.stock(consume=nothing), got, b.fwd)


@pytest.mark.parametrize("logits", [dict(dtype=torch.float32), dict(pad=1)])
def test_upcast_guards(sm100, references, bench, logits):
    """On SM100, FP32 logits (stock returns them) and a row stride the
    kernel's 16-byte accesses cannot take go to stock."""
    references(logits=partial(paged_logits, **logits))
    b = bench(Step([1, 1], [150, 180], seed=17), mx=True)
    got = b.run()
    assert b.routes == [UPDATE, "stock:upcast", "defer", "kernel:remap"]
    assert_same(b.stock(), got, b.fwd)


# --- What warmup compiled ----------------------------------------------------


def expected_keys(b, *, mx=False, round_scale=True, stride=64) -> dict:
    """The variants a planned step of ``b``'s layer launches."""
    layer = b.engine.attentions[0].indexer
    kv, tail = layer.k_cache.kv_cache, layer.tail_cache.kv_cache
    groups, width = layer.topk_tokens // 4, b.engine.buffer.shape[1]
    layout = (tail.shape[2], kv.shape[1], kv.stride(0), tail.stride(0), tail.stride(1))
    int64 = torch.int64
    return dict(
        update={
            UpdateKernel.CompileKey(*layout, mx, round_scale, int64, int64, torch.int32)
        },
        expand={ExpandKernel.CompileKey(groups, int64, True)},
        remap={
            RemapKernel.CompileKey(groups, width, 64, stride, int64, True, counts)
            for counts in (True, False)
        },
        # SM90's logits are FP32: no upcast variant.
        upcast={UpcastKernel.CompileKey()} if mx else set(),
        select=set(),  # opt-in
        scores=set(),  # opt-in
    )


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(Step([1], [150]), id="32pools"),
        pytest.param(Step([1], [2100], stride_rows=80, **GLM), id="glm"),
        pytest.param(Step([1], [150], scale_fmt=None), id="unrounded"),
    ],
)
def test_warmup_compiles_what_steps_launch(bench, step):
    """The stage's warmup compiles, on fakes, the variants a planned step of
    its layers launches: the update for the metadata's int64 slots and the
    indexer's int32 positions, the expansion and the fused remap (with and
    without counts) for the runner's int64 positions truncated to int32 as
    stock's decode does; nothing else."""
    b = bench(step)
    assert b.spies.compiled == expected_keys(
        b, round_scale=step.scale_fmt is not None, stride=step.stride_rows
    )


def test_warmup_of_mx_scales(sm100, bench):
    """SM100: MX scales in the update's keys, and the BF16 logits' upcast."""
    b = bench(Step([1], [150]), mx=True)
    assert b.spies.compiled == expected_keys(b, mx=True)


def test_warmup_without_bound_cache_skips_the_remap(bench):
    """A layer whose MLA cache is not bound as [blocks, block, row] has no
    block layout for the remap: warmup compiles no remap, and a deferred
    top-k is then materialized for stock."""
    b = bench(Step([1, 1], [150, 180], seed=22), bound=False)
    assert not b.spies.compiled["remap"]
    assert b.spies.compiled["update"] == expected_keys(b)["update"]
    got = b.run()
    assert b.routes == [*MATERIALIZED, "stock:convert"]
    assert_same(b.stock(), got, b.fwd)


# --- Keys warmup did not compile go to stock ---------------------------------


def compiled_caches() -> dict:
    return {name: set(kernel._compiled_cache) for name, kernel in KERNELS.items()}


@pytest.mark.parametrize(
    "kernels, step, routes",
    [
        pytest.param(
            ["update"],
            Step([2, 2], [157, 210], seed=23),
            ["stock:update", UPCAST, "defer", "kernel:remap"],
            id="update",
        ),
        pytest.param(
            ["remap"],
            Step([2, 2], [157, 210], seed=25),
            [*MATERIALIZED, "stock:convert"],
            id="remap",
        ),
        pytest.param(
            ["expand"],
            Step([2, 2], [40, 90], seed=26),
            [UPDATE, UPCAST, "stock:expand", "stock:convert"],
            id="expand",
        ),
        pytest.param(
            ["expand", "remap"],
            Step([2, 2], [157, 210], seed=27),
            [UPDATE, UPCAST, "defer", "materialize", "stock:expand", "stock:convert"],
            id="expand-remap",
        ),
    ],
)
def test_uncompiled_keys_run_stock(bench, kernels, step, routes):
    """A key the stage's warmup did not compile (here: dropped from its
    executors after warmup) is never launched: the stage gives the input
    to stock and compiles nothing."""
    b = bench(step)
    for name in kernels:
        b.spies.forget(b.stage, name)
    before = compiled_caches()
    got = b.run()
    assert b.routes == routes
    assert compiled_caches() == before
    assert_same(b.stock(), got, b.fwd)


def test_sm100_uncompiled_upcast_runs_stock(sm100, bench):
    b = bench(Step([2, 2], [157, 210], seed=24), mx=True)
    b.spies.forget(b.stage, "upcast")
    got = b.run()
    assert b.routes == [UPDATE, "stock:upcast", "defer", "kernel:remap"]
    assert_same(b.stock(), got, b.fwd)


def test_stage_compiles_nothing_after_warmup(bench):
    """A shape no warmup compiled (48 pools) goes to stock at once, its
    outputs past the given columns untouched: the stage never compiles in a
    step."""
    b = bench(Step([1], [150], seed=28))
    before = compiled_caches()
    b.spies.timeline.clear()
    ids = torch.randint(0, 40, (2, 48), dtype=torch.int32)
    out = torch.full((2, 256), 9, dtype=torch.int32)
    positions = torch.tensor([200, 201])
    b.stage.expand(ids, positions, out)
    assert b.spies.timeline == ["stock:expand"] and compiled_caches() == before
    want = torch.full((2, 256), 9, dtype=torch.int32)
    lengths = positions.to(torch.int32)
    STOCK_EXPAND(ids, lengths, 4, seq_offset=1, out=want)
    assert torch.equal(out, want)


# --- Which steps plan, and which defer --------------------------------------


def test_mtp_layer_never_defers(bench):
    """The MTP draft's layers have their own top-k buffer, which no stage is
    installed on: its indexer runs stock, in its own forward and in one
    whose metadata also holds the model's layers (a planned step)."""
    model = bench(Step([1], [150]))
    mtp = bench(Step([2, 2], [157, 210], seed=18, first_layer=3), warm=False)
    draft = Model(mtp.sim, "draft")
    draft.kpool = model.registry  # the process's SPECIALIZED_KPOOL
    want = mtp.stock()
    got = mtp.run(draft)
    assert mtp.routes == ["indexer:expand", "stock:convert"]
    assert_same(want, got, mtp.fwd)
    mtp.fwd.metadata[LAYER] = mtp.fwd.metadata[MTP_LAYER]
    got = mtp.run(draft)
    assert mtp.routes == ["indexer:expand", "stock:convert"]
    assert_same(want, got, mtp.fwd)


def test_mixed_step_never_defers(monkeypatch, bench):
    """Prefill rows are the logical buffer's: even a planned step expands."""
    b = bench(Step([1, 1], [150, 180], prefill=9, seed=7))
    monkeypatch.setattr(steps.PlannedSteps, "covers", lambda self, context: True)
    got = b.run()
    assert b.routes == EXPANDED
    assert_same(b.stock(), got, b.fwd)


@pytest.mark.parametrize("case", ["mixed", "not-warmed", "dummy", "above-plan"])
def test_unplanned_steps_run_stock(bench, case):
    step = Step([1, 1], [150, 180], prefill=9 if case == "mixed" else 0, seed=19)
    b = bench(
        step, max_rows=1 if case == "above-plan" else None, warm=case != "not-warmed"
    )
    got = b.run(dummy_run=case == "dummy")
    assert b.routes == ["indexer:expand", "stock:convert"]
    assert_same(b.stock(), got, b.fwd)


def test_no_forward_context_is_unplanned(bench):
    stage = bench(Step([1], [150])).stage
    assert not stage.planned()
    assert stage.decode_step(None, LAYER, None, 128, 4, None) is None


def test_defers_rule(bench):
    """``defers``: a fused layer, at most ``max_rows`` rows, the remap's
    shapes (pools a multiple of 32, at least 32, a wide enough width the
    stock conversion with counts compacts in order)."""
    stage = bench(Step([1], [150]), max_rows=8).stage
    assert stage.defers(LAYER, 8, 32, 4, 256)
    assert stage.defers(LAYER, 1, 512, 4, 2176)
    # With counts the widest in-order width is 4096 columns: 992 pools.
    assert stage.defers(LAYER, 1, 992, 4, 4096)
    assert not stage.defers(LAYER, 1, 1024, 4, 4224)
    assert not stage.defers(MTP_LAYER, 1, 32, 4, 256)
    assert not stage.defers(LAYER, 9, 32, 4, 256)
    assert not stage.defers(LAYER, 1, 48, 4, 256)
    assert not stage.defers(LAYER, 1, 16, 4, 256)
    assert not stage.defers(LAYER, 1, 1056, 4, 4352)
    assert not stage.defers(LAYER, 1, 32, 4, 130)
    assert not stage.defers(LAYER, 1, 32, 4, 4224)
    assert not stage.defers(LAYER, 1, 32, 8, 256)


def test_pool_ids_buffer(bench):
    """A deferring step's pool top-k lives in the stage's buffer (the remap
    reads it after the indexer returns); others get a fresh tensor."""
    stage = bench(Step([1], [150]), max_rows=8).stage
    fresh = stage.pool_ids(3, 32, "cpu", deferring=False)
    assert fresh.shape == (3, 32) and fresh.dtype == torch.int32
    assert fresh.data_ptr() != stage.pool_buffer.data_ptr()
    held = stage.pool_ids(3, 32, "cpu", deferring=True)
    assert held.shape == (3, 32) and held.is_contiguous()
    assert held.data_ptr() == stage.pool_buffer.data_ptr()
    assert stage.pool_buffer.shape == (8, 1024)


# --- The hand-off ------------------------------------------------------------


def test_hand_off_is_converted_once(bench):
    """A second hand-over before the conversion raises, and keeps the
    first."""
    remap = bench(Step([1, 1], [150, 180], seed=20)).stage.remaps[LAYER]
    first = Deferred(torch.zeros((2, 32), dtype=torch.int32), torch.zeros(2))
    remap.hand_over(first)
    with pytest.raises(RuntimeError, match="was not converted"):
        remap.hand_over(Deferred(first.pool_ids, first.positions))
    assert remap.pending is first


def start_python_O() -> list[subprocess.Popen]:
    """The hand-off check under ``python -O``. (The subprocess loads
    ``runtime/remap.py`` with its vLLM imports stubbed: under ``-O`` every
    import compiles its source anew.) Its output in files (a full pipe would
    stall a child started early)."""
    script = textwrap.dedent(f"""
        import importlib.util, sys, types

        def load(name, path=None, **attributes):
            if path is None:
                module = types.ModuleType(name)
            else:
                spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec)
            module.__dict__.update(attributes)
            sys.modules[name] = module
            if path is not None:
                spec.loader.exec_module(module)
            return module

        package = "vllm.models.glm5next.nvidia.specialized_decode"
        load("vllm.forward_context", in_piecewise_cudagraph=None)
        load("vllm.model_executor.layers.attention.sparse_mla_attention",
             SparseMLACommonImpl=type("SparseMLACommonImpl", (), {{}}))
        load("vllm.utils.torch_utils", current_stream=None)
        load("vllm.v1.attention.backends.mla.index_group",
             SparseMLAIndexGroup=type("SparseMLAIndexGroup", (), {{}}))
        load(package + ".cutedsl.common.host", Refused=ValueError)
        load(package + ".constants", {str(PACKAGE / "constants.py")!r})
        remap = load(package + ".runtime.remap",
                     {str(PACKAGE / "runtime" / "remap.py")!r})

        assert not __debug__, "not under -O"
        fused = remap.FusedRemap(group=None, stage=None)
        deferred = remap.Deferred(pool_ids=None, positions=None)
        fused.hand_over(deferred)
        try:
            fused.hand_over(deferred)
        except RuntimeError as error:
            print("refused:", error)
            sys.exit(0 if fused.pending is deferred else "replaced")
        sys.exit("a second hand-over was taken")
    """)
    # Closed by the fixture, once the child ended.
    out = tempfile.TemporaryFile("w+")  # noqa: SIM115
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115
    command = [sys.executable, "-O", "-c", script]
    run = subprocess.Popen(command, stdout=out, stderr=err, text=True)
    run.out, run.err = out, err
    return [run]


# The root conftest.py starts the child once collection is done (seconds of
# CPU: torch's import).
START_EARLY = {"python_O": start_python_O}
STARTED: dict = {}


@pytest.fixture(scope="module")
def python_O(request, started):
    """The child's (exit status, stdout, stderr)."""
    [run] = started(request.module, "python_O")
    with run.out, run.err:
        try:
            run.wait(timeout=300)
        finally:
            run.kill()
        run.out.seek(0), run.err.seek(0)
        return run.returncode, run.out.read(), run.err.read()


def test_hand_off_check_survives_python_O(python_O):
    """The check is not an assert: ``python -O`` keeps it (``python_O``)."""
    returncode, stdout, stderr = python_O
    assert returncode == 0, stdout + stderr[-4000:]
    assert "refused: GLM-5-Next kpool: a deferred top-k" in stdout


# --- The comparison sees every byte -----------------------------------------------


def extra_row(name, key, *args):
    """The remap also writes the row after its rows (the group's extra)."""
    if name == "remap":
        out = args[4]
        out.as_strided((len(out) + 1, out.shape[1]), out.stride())[-1, 0] = 5


def extra_count(name, key, *args):
    """The remap also writes the count after its rows'."""
    if name == "remap":
        args[5].as_strided((len(args[4]) + 1,), (1,))[-1] = 3


def tail_byte(name, key, *args):
    if name == "update":
        args[1].view(torch.int16).view(-1)[0] += 1


@pytest.mark.parametrize(
    "wrong, field",
    [
        (extra_row, "physical top-k"),
        (extra_count, "counts"),
        (tail_byte, "tail cache"),
    ],
)
def test_a_stray_byte_is_a_mismatch(monkeypatch, bench, wrong, field):
    """A launch that writes one byte more than its stock twin (past its
    rows, or in a cache) makes the step differ from stock."""
    import indexer_sim

    twin = indexer_sim.twin

    def spoiled(name, key, *args):
        twin(name, key, *args)
        wrong(name, key, *args)

    b = bench(Step([1, 1, 1], [150, 203, 190]))
    monkeypatch.setattr(indexer_sim, "twin", spoiled)
    assert mismatches(b.stock(), b.run(), b.fwd.tokens) == [f"layer 0 {field}"]


def test_a_select_past_its_rows_is_a_mismatch(monkeypatch, bench, references):
    """A select that writes the pool buffer past the step's pool ids differs
    from stock (the stock stand-in as ``test_select_opted_in``'s)."""
    import indexer_sim

    twin = indexer_sim.twin

    def spoiled(name, key, *args):
        twin(name, key, *args)
        if name == "select":
            out = args[2]
            out.as_strided((len(out) + 1, out.shape[1]), out.stride())[-1, 0] = 5

    references(topk=contract_decode_topk)
    b = bench(Step([1, 1, 1], [150, 203, 190]), select=True)
    monkeypatch.setattr(indexer_sim, "twin", spoiled)
    got = b.run()
    assert b.routes == SELECTED
    assert mismatches(b.stock(), got, b.fwd.tokens, sets=True) == ["layer 0 pool ids"]
