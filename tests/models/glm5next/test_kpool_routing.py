# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stage (``stage.py``, ``fused_remap.py``) on the real stock decode path
of ``sparse_attn_indexer_kpool`` and the sparse MLA index conversion (CPU,
stock Triton kernels interpreted; see ``kpool_harness``).

Stage off: the patched indexer equals the unpatched one. Stage on (installed
by ``install()`` and warmed up by its real warmup): the same caches, physical
top-k and counts as stock (and the same logical top-k rows wherever a consumer
reads them), with the route each input took asserted. Every kernel launch is
checked against the kernel's own rule and the keys its warmup compiled.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kpool_harness import (
    BLOCK,
    GLM_TOPK,
    GLM_WIDTH,
    LAYER,
    MTP_LAYER,
    MTP_TAIL,
    POOL,
    Step,
    assert_same,
    make_group,
    make_inputs,
    paged_logits_reference,
    run_step,
    stock_run,
)

from vllm.config import CUDAGraphMode
from vllm.models.glm5next.nvidia import sparse_indexer
from vllm.models.glm5next.nvidia.specialized_decode import steps
from vllm.models.glm5next.nvidia.specialized_decode.expand_kernel import (
    ExpandPoolsKernel,
)
from vllm.models.glm5next.nvidia.specialized_decode.remap_kernel import (
    ExpandRemapKernel,
)
from vllm.models.glm5next.nvidia.specialized_decode.stage import LayerStep
from vllm.models.glm5next.nvidia.specialized_decode.update_kernel import (
    KpoolUpdateKernel,
)

PACKAGE = Path(__file__).resolve().parents[3] / (
    "vllm/models/glm5next/nvidia/specialized_decode"
)
# GLM-5-Next's real top-k: 512 pools, 2176-column rows, contexts above 2048.
GLM = dict(topk=GLM_TOPK)
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
STEPS = TOKEN_ROWS + [
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


@pytest.mark.parametrize("step", STEPS)
def test_stage_off_is_stock(monkeypatch, spies, references, stock_module, step):
    """SPECIALIZED_KPOOL None: the patched tree writes what stock writes."""
    monkeypatch.setattr(sparse_indexer, "SPECIALIZED_KPOOL", None)
    inputs = make_inputs(step)
    group = make_group(inputs.buffer, 64, [])
    got = run_step(sparse_indexer, inputs, group, log=spies.timeline)
    assert not [e for e in got.routes if e.startswith("kernel:")]
    assert_same(got, stock_run(stock_module, inputs))


@pytest.mark.parametrize("step", TOKEN_ROWS)
def test_defer_and_fused_remap(engine, stock_module, step):
    """Token-ordered decode rows: the pool top-k goes straight to FusedRemap
    on the group's side stream; the logical rows stay unfilled (no consumer
    reads them)."""
    inputs = make_inputs(step)
    got = engine(inputs).run(inputs)
    want = stock_run(stock_module, inputs)
    assert got.log == [UPDATE, UPCAST, "defer", *FUSED_STREAMS]
    assert_same(got, want, logical=False)
    assert (got.topk[: inputs.num_tokens] == -5).all(), "logical rows not filled"


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
def test_sm100_mx_scales(sm100, engine, spies, stock_module, step):
    """SM100: the update writes MX (UE8M0) scales, compiled as such at warmup,
    and the BF16 logits are upcast by the kernel."""
    inputs = make_inputs(step, mx=True)
    got = engine(inputs).run(inputs)
    assert {key.mx_scales for key in spies.compiled["update"]} == {True}
    assert got.routes == [UPDATE, "kernel:upcast", "defer", "kernel:remap"]
    assert_same(got, stock_run(stock_module, inputs), logical=False)


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
def test_fp32_scales_not_rounded(engine, spies, stock_module, step):
    """``scale_fmt=None``: FP32 scales that are not powers of two, the
    update's compile key and stock alike."""
    inputs = make_inputs(step)
    got = engine(inputs).run(inputs)
    assert {key.round_scale for key in spies.compiled["update"]} == {False}
    deferred = step.layout != "padded"
    assert got.routes == (
        DEFERRED if deferred else [UPDATE, UPCAST, "indexer:expand", "stock:convert"]
    )
    assert_same(got, stock_run(stock_module, inputs), logical=not deferred)


def assert_same_sets(got, want) -> None:
    """The same caches and counts as stock, and each physical row stock's
    set (the opt-in select lists pools in ascending order, stock's top-k in
    its own)."""
    assert torch.equal(got.kv_cache, want.kv_cache), "index K cache"
    assert torch.equal(got.counts, want.counts), "valid counts"
    rows = [torch.sort(o.physical, dim=1).values for o in (got, want)]
    assert torch.equal(*rows), "physical top-k sets"
    assert not torch.equal(got.physical, want.physical), "no order changed"


SELECTED = [UPDATE, "kernel:select", "defer", "kernel:remap"]


@pytest.fixture
def contract_topk(monkeypatch, stock_module):
    """Stock's decode top-k as the select's contract picks ties (the lower
    pool; vLLM's torch reference picks any, and ReLU logits tie at 0.0)."""
    from kpool_harness import select_reference

    def topk(logits, seq_lens, next_n, out, k, max_seq_len):
        ends = seq_lens.reshape(-1).to(torch.int32)
        out.copy_(select_reference(logits, ends, k).flip(1))  # another order

    monkeypatch.setattr(stock_module, "get_indexer_topk", lambda backend: topk)


@pytest.mark.parametrize("step", TOKEN_ROWS)
def test_select_opted_in(engine, spies, stock_module, contract_topk, step):
    """``kpool_select``: a deferring step's logits go to the select at the
    upcast (no upcast, no stock top-k), its ascending pool ids to the fused
    remap: stock's caches, counts and physical sets."""
    inputs = make_inputs(step)
    got = engine(inputs, select=True).run(inputs)
    assert got.routes == SELECTED
    assert spies.launched["select"] <= spies.compiled["select"]
    assert_same_sets(got, stock_run(stock_module, inputs))


def test_select_of_bf16_logits(sm100, engine, stock_module, contract_topk):
    """SM100: the select reads DeepGEMM's BF16 logits; nothing upcasts."""
    inputs = make_inputs(Step([2, 2], [2157, 2310], seed=35, **GLM), mx=True)
    got = engine(inputs, select=True).run(inputs)
    assert got.routes == SELECTED
    assert_same_sets(got, stock_run(stock_module, inputs))


def test_select_declines_past_one_wave(monkeypatch, engine, stock_module):
    """Rows whose clusters take a second wave run stock's upcast and top-k."""
    from vllm.models.glm5next.nvidia.specialized_decode import stage

    inputs = make_inputs(Step([1, 1, 1], [2100, 2403, 2190], seed=36, **GLM))
    built = engine(inputs, select=True)
    monkeypatch.setattr(stage, "one_wave", lambda *args: False)
    got = built.run(inputs)
    assert got.routes == DEFERRED
    assert_same(got, stock_run(stock_module, inputs), logical=False)


@pytest.mark.parametrize("step", STEPS[len(TOKEN_ROWS) :])
def test_select_only_in_deferring_steps(engine, stock_module, step):
    """Steps that do not defer never select: stock's bytes."""
    inputs = make_inputs(step)
    got = engine(inputs, select=True).run(inputs)
    assert "kernel:select" not in got.routes
    want = stock_run(stock_module, inputs)
    assert_same(got, want, logical=step.layout != "padded")


def test_fused_remap_under_piecewise_graphs(engine, stock_module):
    """Inside piecewise CUDA graphs the side stream waits on the compute
    stream (an event recorded in a captured segment is graph-local)."""
    inputs = make_inputs(Step([2, 2], [157, 210], seed=11))
    got = engine(inputs).run(inputs, cudagraph_mode=CUDAGraphMode.PIECEWISE)
    assert got.log == [
        UPDATE,
        UPCAST,
        "defer",
        "side.wait_stream(compute)",
        *FUSED_STREAMS[1:],
    ]
    assert_same(got, stock_run(stock_module, inputs), logical=False)


@pytest.mark.parametrize("step_stride, stride", [(96, 96), (BLOCK, None)])
def test_fused_remap_block_stride(engine, stock_module, step_stride, stride):
    """Blocks ``stride`` rows apart (other layers' pages between them), as
    warmup read it from the bound MLA cache; None: the block size."""
    step = Step([1, 1, 1], [150, 203, 190], seed=12, stride_rows=step_stride)
    inputs = make_inputs(step)
    got = engine(inputs).run(inputs, block_stride_rows=stride)
    assert got.routes == DEFERRED
    want = stock_run(stock_module, inputs, block_stride_rows=stride)
    assert_same(got, want, logical=False)


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(Step([1, 1, 1], [150, 203, 190], pad_rows=1, seed=13), id="one"),
        pytest.param(Step([2, 2], [2157, 2310], seed=35, **GLM), id="glm"),
    ],
)
def test_fused_remap_without_counts(engine, stock_module, step):
    """FlashMLA's mixed-batch FP8 decode converts without counts: fused too,
    in place, with stock's bytes."""
    inputs = make_inputs(step)
    got = engine(inputs).run(inputs, return_valid_counts=False)
    assert got.log == [UPDATE, UPCAST, "defer", *FUSED_STREAMS]
    want = stock_run(stock_module, inputs, return_valid_counts=False)
    assert_same(got, want, logical=False)


def _materialized_then_stock(log):
    """The logical rows are written, then recorded ready, before the stock
    conversion's side stream waits on that record and converts."""
    assert log[:9] == [
        *MATERIALIZED,
        "logical_ready.record(compute)",
        "side.wait_event(logical_ready)",
        "enter side",
        "stock:convert",
    ]


def test_declined_by_block_stride(engine, stock_module):
    """A block stride warmup did not compile (the cache was bound with
    another): FusedRemap declines, materializes, and the stock conversion
    runs after the logical rows are recorded ready."""
    inputs = make_inputs(Step([1, 1, 1], [150, 203, 190], seed=14))
    got = engine(inputs).run(inputs, block_stride_rows=96)
    _materialized_then_stock(got.log)
    assert_same(got, stock_run(stock_module, inputs, block_stride_rows=96))


@pytest.mark.parametrize("counts", [True, False])
def test_idx_mapping_declines(engine, stock_module, counts):
    """A conversion through ``idx_mapping`` (HiSparse's leader rows) is not
    the fused kernel's: declined, materialized, stock with the mapping."""
    inputs = make_inputs(Step([1, 1, 1], [150, 203, 190], seed=15))
    mapping = torch.tensor([2, 0, 1], dtype=torch.int32)
    kwargs = dict(idx_mapping=mapping, return_valid_counts=counts)
    got = engine(inputs).run(inputs, **kwargs)
    _materialized_then_stock(got.log)
    assert_same(got, stock_run(stock_module, inputs, **kwargs))


@pytest.mark.parametrize(
    "kwargs, routes",
    [
        # A later layer of a group reads the leader's physical rows.
        pytest.param(dict(layer_index=1), MATERIALIZED, id="layer1"),
        # Rows past the group's buffers: stock converts on the compute stream.
        pytest.param(
            dict(capacity=2), [*MATERIALIZED, "stock:convert"], id="above-capacity"
        ),
    ],
)
def test_deferred_then_materialized(engine, stock_module, kwargs, routes):
    """A deferred top-k the fused remap cannot take is materialized into the
    logical rows, then converted by stock."""
    kwargs = dict(kwargs)  # the parametrize dict lives for the whole process
    capacity = kwargs.pop("capacity", 64)
    inputs = make_inputs(Step([1, 1, 1], [150, 203, 190], pad_rows=1, seed=13))
    got = engine(inputs, capacity=capacity).run(inputs, **kwargs)
    want = stock_run(stock_module, inputs, capacity=capacity, **kwargs)
    assert got.routes == routes
    assert_same(got, want)


@pytest.mark.parametrize(
    "step, kwargs, routes",
    [
        # SM90 non-uniform rows are [requests, max q_len]: stock expansion.
        pytest.param(
            Step([1, 3, 2], [171, 140, 255], "padded", seed=5),
            {},
            [UPDATE, UPCAST, "indexer:expand", "stock:convert"],
            id="padded",
        ),
        pytest.param(
            Step([1, 2], [2171, 2140], "padded", seed=33, **GLM),
            {},
            [UPDATE, UPCAST, "indexer:expand", "stock:convert"],
            id="glm-padded",
        ),
        # Stock fills short rows causally on CUDA; on the CPU it expands.
        pytest.param(Step([2, 2], [40, 90], seed=6), {}, EXPANDED, id="short"),
        pytest.param(
            Step([1, 1], [1500, 2000], seed=34, **GLM), {}, EXPANDED, id="glm-short"
        ),
        # Rows too wide for the stock conversion to compact them in order.
        pytest.param(
            Step([1, 1], [150, 180], seed=15, width=4224),
            {},
            EXPANDED,
            id="width4224",
        ),
        # 48 pools: not a multiple of 32 (no remap compiled: unbound cache).
        pytest.param(
            Step([1, 1], [250, 280], seed=16, topk=192),
            dict(bound=False),
            EXPANDED,
            id="pools48",
        ),
        # No positions: no tail update, stock expansion of the seq_lens.
        pytest.param(
            Step([1, 1], [150, 180], positions=False, seed=8),
            {},
            [UPCAST, "indexer:expand", "stock:convert"],
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
def test_routes(engine, stock_module, step, kwargs, routes):
    inputs = make_inputs(step)
    got = engine(inputs, **kwargs).run(inputs)
    assert got.routes == routes
    deferred = "defer" in routes
    assert_same(got, stock_run(stock_module, inputs), logical=not deferred)


def test_unaligned_rows_expand_stock(engine, stock_module):
    """Top-k rows whose stride is not 16-byte aligned: no defer (the remap
    stores 16 bytes), stock expansion into the buffer."""
    inputs = make_inputs(Step([1, 1], [150, 180], seed=21, width=133))
    got = engine(inputs).run(inputs, group=False)
    assert got.routes == [UPDATE, UPCAST, "stock:expand"]
    assert_same(got, run_step(stock_module, inputs, None))


@pytest.mark.parametrize(
    "logits",
    [
        pytest.param(dict(logits_dtype=torch.float32), id="fp32"),
        pytest.param(dict(odd_stride=True), id="odd-stride"),
    ],
)
def test_upcast_guards(sm100, references, engine, stock_module, logits):
    """On SM100, FP32 logits (stock returns them) and a row stride the
    kernel's 16-byte accesses cannot take go to stock."""
    references(paged_logits_reference(mx=True, **logits))
    inputs = make_inputs(Step([1, 1], [150, 180], seed=17), mx=True)
    got = engine(inputs).run(inputs)
    assert got.routes == [UPDATE, "stock:upcast", "defer", "kernel:remap"]
    assert_same(got, stock_run(stock_module, inputs), logical=False)


# --- What warmup compiled ----------------------------------------------------


def _expected_keys(inputs, *, mx=False, round_scale=True, stride=BLOCK):
    args = inputs.args
    kv, tail = args["kv_cache"], args["tail_kv_cache"]
    groups = args["topk_tokens"] // POOL
    width = inputs.buffer.shape[1]
    layout = (tail.shape[2], kv.shape[1], kv.stride(0), tail.stride(0), tail.stride(1))
    return dict(
        update={
            KpoolUpdateKernel.CompileKey(
                *layout, mx, round_scale, torch.int64, torch.int64, torch.int32
            )
        },
        expand={ExpandPoolsKernel.CompileKey(groups, torch.int64, True)},
        remap={
            ExpandRemapKernel.CompileKey(
                groups, width, BLOCK, stride, torch.int64, True, counts
            )
            for counts in (True, False)
        },
        # SM90's logits are FP32: no upcast variant.
        upcast=set(),
        # The select is opt-in (kpool_select).
        select=set(),
    )


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(Step([1], [150]), id="32pools"),
        pytest.param(Step([1], [2100], stride_rows=80, **GLM), id="glm"),
        pytest.param(Step([1], [150], scale_fmt=None), id="unrounded"),
    ],
)
def test_warmup_compiles_what_steps_launch(engine, spies, step):
    """The stage's warmup compiles, on fakes, the variants a planned step of
    its layers launches: the update for the metadata's int64 slots and the
    indexer's int32 positions, the expansion and the fused remap (with and without
    counts) for the runner's int64 positions truncated to int32 as stock's
    decode does; nothing else."""
    inputs = make_inputs(step)
    engine(inputs)
    want = _expected_keys(
        inputs, round_scale=step.scale_fmt is not None, stride=step.stride_rows
    )
    assert spies.compiled == want


def test_warmup_of_mx_scales(sm100, engine, spies):
    """SM100: MX scales in the update's keys, and the BF16 logits' upcast."""
    from vllm.models.glm5next.nvidia.specialized_decode.upcast_kernel import (
        UpcastLogitsKernel,
    )

    inputs = make_inputs(Step([1], [150]), mx=True)
    engine(inputs)
    want = _expected_keys(inputs, mx=True)
    assert spies.compiled == dict(want, upcast={UpcastLogitsKernel.CompileKey()})


def test_warmup_without_bound_cache_skips_the_remap(engine, spies):
    """A layer whose MLA cache is not bound as [blocks, block, row] has no
    block layout for the remap: warmup compiles no remap, and a deferred
    top-k is then materialized for stock."""
    inputs = make_inputs(Step([1, 1], [150, 180], seed=22))
    stage = engine(inputs, bound=False)
    assert not spies.compiled["remap"]
    assert spies.compiled["update"] == _expected_keys(inputs)["update"]
    got = stage.run(inputs)
    assert got.routes == [*MATERIALIZED, "stock:convert"]


# --- Keys warmup did not compile go to stock ---------------------------------


@pytest.mark.parametrize(
    "kernel, step, routes",
    [
        pytest.param(
            "update",
            Step([2, 2], [157, 210], seed=23),
            ["stock:update", UPCAST, "defer", "kernel:remap"],
            id="update",
        ),
        pytest.param(
            "remap",
            Step([2, 2], [157, 210], seed=25),
            [*MATERIALIZED, "stock:convert"],
            id="remap",
        ),
        pytest.param(
            "expand",
            Step([2, 2], [40, 90], seed=26),
            [UPDATE, UPCAST, "stock:expand", "stock:convert"],
            id="expand",
        ),
    ],
)
def test_uncompiled_keys_run_stock(engine, spies, stock_module, kernel, step, routes):
    """A key warmup did not compile (here: forgotten after warmup, as if it
    had not compiled it) is never launched: the stage gives the input to
    stock, and compiles nothing."""
    inputs = make_inputs(step)
    stage = engine(inputs)
    spies.forget(kernel)
    got = stage.run(inputs)
    assert got.routes == routes
    assert not spies.compiled[kernel]
    assert_same(got, stock_run(stock_module, inputs), logical="defer" not in routes)


def test_sm100_uncompiled_upcast_runs_stock(sm100, engine, spies, stock_module):
    inputs = make_inputs(Step([2, 2], [157, 210], seed=24), mx=True)
    stage = engine(inputs)
    spies.forget("upcast")
    got = stage.run(inputs)
    assert got.routes == [UPDATE, "stock:upcast", "defer", "kernel:remap"]
    assert_same(got, stock_run(stock_module, inputs), logical=False)


def test_uncompiled_expand_materializes_through_stock(engine, spies, stock_module):
    inputs = make_inputs(Step([2, 2], [157, 210], seed=27))
    stage = engine(inputs)
    spies.forget("expand")
    spies.forget("remap")
    got = stage.run(inputs)
    assert got.routes == [
        UPDATE,
        UPCAST,
        "defer",
        "materialize",
        "stock:expand",
        "stock:convert",
    ]
    assert_same(got, stock_run(stock_module, inputs))


def test_stage_compiles_nothing_after_warmup(engine, spies, timeline):
    """A shape no warmup compiled (48 pools) goes to stock at once: the
    stage never compiles in a step."""
    inputs = make_inputs(Step([1], [150], seed=28))
    stage = engine(inputs).stage
    compiled = {name: set(keys) for name, keys in spies.compiled.items()}
    timeline.clear()
    ids = torch.zeros((2, 48), dtype=torch.int32)
    out = torch.full((2, 256), 9, dtype=torch.int32)
    stage.expand(ids, torch.tensor([200, 201]), POOL, seq_offset=1, out=out)
    assert timeline == ["stock:expand"] and spies.compiled == compiled


# --- Which steps plan, and which defer --------------------------------------


def test_mtp_layer_never_defers(engine, stock_module):
    """The MTP draft's layers have their own top-k buffer, which no stage is
    installed on: its indexer runs stock, in its own forward and in one
    whose metadata also holds the model's layers (a planned step)."""
    step = Step([2, 2], [157, 210], layer=MTP_LAYER, tail=MTP_TAIL, seed=18)
    inputs = make_inputs(step)
    model = engine(make_inputs(Step([1], [150])))
    mtp_group = make_group(inputs.buffer, 64, model.timeline)
    want = stock_run(stock_module, inputs)
    got = model.run(inputs, group=mtp_group)
    assert got.routes == ["indexer:expand", "stock:convert"]
    assert_same(got, want)
    inputs.metadata[LAYER] = inputs.metadata[MTP_LAYER]
    with_model = model.run(inputs, group=mtp_group)
    assert with_model.routes == ["indexer:expand", "stock:convert"]
    assert_same(with_model, want)


def test_mixed_step_never_defers(monkeypatch, engine, stock_module):
    """Prefill rows are the logical buffer's: even a planned step expands."""
    inputs = make_inputs(Step([1, 1], [150, 180], prefill=9, seed=7))
    model = engine(inputs)
    monkeypatch.setattr(steps.PlannedSteps, "covers", lambda self, context: True)
    got = model.run(inputs)
    assert got.routes == EXPANDED
    assert_same(got, stock_run(stock_module, inputs))


@pytest.mark.parametrize(
    "case", ["mixed", "not-warmed", "dummy", "above-plan", "no-context"]
)
def test_unplanned_steps_run_stock(engine, stock_module, case):
    step = Step([1, 1], [150, 180], prefill=9 if case == "mixed" else 0, seed=19)
    inputs = make_inputs(step)
    model = engine(
        inputs,
        max_rows=1 if case == "above-plan" else 64,
        warm=case != "not-warmed",
    )
    if case == "no-context":
        assert not model.stage.planned()
        assert model.stage.decode_step(None, LAYER, None, 128, POOL, None) is None
        return
    got = model.run(inputs, dummy_run=case == "dummy")
    assert got.routes == ["indexer:expand", "stock:convert"]
    assert_same(got, stock_run(stock_module, inputs))


def test_defers_rule(engine):
    """``defers``: a fused layer, at most ``max_rows`` rows, the remap's
    shapes (pools a multiple of 32, at least 32, a wide enough width the
    stock conversion with counts compacts in order)."""
    stage = engine(make_inputs(Step([1], [150])), max_rows=8).stage
    assert stage.defers(LAYER, 8, 32, POOL, 256)
    assert stage.defers(LAYER, 1, 512, POOL, GLM_WIDTH)
    # With counts the widest in-order width is 4096 columns: 992 pools.
    assert stage.defers(LAYER, 1, 992, POOL, 4096)
    assert not stage.defers(LAYER, 1, 1024, POOL, 4224)
    assert not stage.defers(MTP_LAYER, 1, 32, POOL, 256)
    assert not stage.defers(LAYER, 9, 32, POOL, 256)
    assert not stage.defers(LAYER, 1, 48, POOL, 256)
    assert not stage.defers(LAYER, 1, 16, POOL, 256)
    assert not stage.defers(LAYER, 1, 1056, POOL, 4352)
    assert not stage.defers(LAYER, 1, 32, POOL, 130)
    assert not stage.defers(LAYER, 1, 32, POOL, 4224)
    assert not stage.defers(LAYER, 1, 32, 8, 256)


def test_pool_topk_buffer(engine):
    """A deferring step's pool top-k lives in the stage's buffer (the remap
    reads it after the indexer returns); others get a fresh tensor."""
    stage = engine(make_inputs(Step([1], [150])), max_rows=8).stage
    fresh = LayerStep(stage, None).pool_topk(3, 32, "cpu")
    assert fresh.shape == (3, 32) and fresh.dtype == torch.int32
    assert fresh.data_ptr() != stage.pool_buffer.data_ptr()
    held = LayerStep(stage, stage.remaps[LAYER]).pool_topk(3, 32, "cpu")
    assert held.shape == (3, 32) and held.is_contiguous()
    assert held.data_ptr() == stage.pool_buffer.data_ptr()
    assert stage.pool_buffer.shape == (8, 1024)


# --- The hand-off ------------------------------------------------------------


def test_hand_off_is_converted_once(engine):
    """A deferring step hands its layer's FusedRemap the pool ids and the
    rows' positions; a second hand-over before the conversion raises."""
    inputs = make_inputs(Step([1, 1], [150, 180], seed=20))
    stage = engine(inputs).stage
    remap = stage.remaps[LAYER]
    ids = stage.pool_buffer[:2, :32]
    positions = torch.zeros(3, dtype=torch.int64)
    meta = inputs.metadata[LAYER].decode
    assert LayerStep(stage, remap).resolve(ids, positions, meta, None)
    pending = remap.pending
    assert pending.pool_ids is ids and pending.positions.shape == (2,)
    with pytest.raises(RuntimeError, match="was not converted"):
        LayerStep(stage, remap).resolve(ids, positions, meta, None)
    assert remap.pending is pending


def test_hand_off_check_survives_python_O():
    """The check is not an assert: ``python -O`` keeps it. (The subprocess
    loads ``fused_remap.py`` with its vLLM imports stubbed: under ``-O``
    every import compiles its source anew.)"""
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

        class SparseMLAIndexGroup:
            def _convert_once(self, *args, **kwargs):
                raise AssertionError("not converted here")

        package = "vllm.models.glm5next.nvidia.specialized_decode"
        load("vllm.forward_context", in_piecewise_cudagraph=None)
        load("vllm.utils.torch_utils", current_stream=None)
        load("vllm.v1.attention.backends.mla.index_group",
             SparseMLAIndexGroup=SparseMLAIndexGroup)
        load(package + ".remap_kernel", REMAP=None, RemapArgs=None)
        load(package + ".constants", {str(PACKAGE / "constants.py")!r})
        fused = load(package + ".fused_remap", {str(PACKAGE / "fused_remap.py")!r})

        assert not __debug__, "not under -O"
        remap = fused.FusedRemap(SparseMLAIndexGroup(), stage=None)
        deferred = fused.Deferred(pool_ids=None, positions=None)
        remap.hand_over(deferred)
        try:
            remap.hand_over(deferred)
        except RuntimeError as error:
            print("refused:", error)
            sys.exit(0 if remap.pending is deferred else "replaced")
        sys.exit("a second hand-over was taken")
    """)
    child = subprocess.run(
        [sys.executable, "-O", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stdout + child.stderr[-4000:]
    assert "refused: GLM-5-Next kpool: a deferred top-k" in child.stdout
