# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The hooks of the specialized kpool decode on the real stock decode path of
``sparse_attn_indexer_kpool`` and the sparse MLA index conversion (CPU, stock
Triton kernels interpreted; see ``kpool_harness``).

Stage off: the patched indexer equals the unpatched one. Stage on: the same
caches, physical top-k and counts as stock (and the same logical top-k rows
wherever a consumer reads them), with the route each input took asserted.
"""

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("cutlass")

from kpool_harness import (  # noqa: E402
    LAYER,
    MTP_LAYER,
    MTP_TAIL,
    Spies,
    Step,
    fake_streams,
    load_stock_sparse_indexer,
    make_attention,
    make_group,
    make_inputs,
    paged_logits_reference,
    run_step,
    use_references,
)

from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.models.glm5next.nvidia import sparse_indexer  # noqa: E402
from vllm.models.glm5next.nvidia import specialized_decode as sd  # noqa: E402
from vllm.models.glm5next.nvidia.specialized_decode import kpool  # noqa: E402

# Steps whose top-k rows are the decode tokens in order (they defer).
TOKEN_ROWS = [
    pytest.param(Step([1, 1, 1], [150, 203, 190]), id="decode"),
    pytest.param(Step([2, 2], [157, 210], seed=1), id="mtp2"),
    pytest.param(Step([4, 4], [161, 233], seed=2), id="mtp4"),
    pytest.param(Step([1, 1, 1], [150, 203, 190], pad_rows=3, seed=3), id="padrows"),
    pytest.param(Step([1, 3, 2], [171, 140, 255], "varlen", seed=4), id="varlen"),
]
STEPS = TOKEN_ROWS + [
    pytest.param(Step([1, 3, 2], [171, 140, 255], "padded", seed=5), id="padded"),
    pytest.param(Step([2, 2], [40, 90], seed=6), id="short"),
    pytest.param(Step([1, 1], [150, 180], prefill=9, seed=7), id="mixed"),
    pytest.param(Step([1, 1], [150, 180], positions=False, seed=8), id="nopositions"),
]


@pytest.fixture(scope="module")
def stock_module():
    return load_stock_sparse_indexer()


@pytest.fixture
def references(monkeypatch, stock_module):
    """DeepGEMM's logits and the CUDA top-k, in both trees."""

    def use(logits_fn):
        use_references(monkeypatch, (stock_module, sparse_indexer), logits_fn)

    use(paged_logits_reference())
    fake_streams(monkeypatch, kpool, [])
    return use


class Stage:
    """A KpoolStage over one DSA layer, reached through SPECIALIZED_KPOOL in
    planned steps (a warmed-up plan)."""

    def __init__(self, monkeypatch, inputs, *, max_rows=64, capacity=64, plan=64):
        self.log: list[str] = []
        self.spies = Spies(monkeypatch, kpool)
        fake_streams(monkeypatch, kpool, self.log)
        buffer = inputs.args["topk_indices_buffer"]
        self.group = make_group(buffer, capacity, self.log)
        self.stage = kpool.KpoolStage(
            [make_attention(self.group, LAYER, buffer)], max_rows, "cpu"
        )
        assert self.stage.fuse and self.stage.layers == {LAYER}
        monkeypatch.setattr(sparse_indexer, "SPECIALIZED_KPOOL", self.stage)
        plan = sd._Plan(max_rows=plan, layer=LAYER, warmed=True)
        monkeypatch.setattr(sd, "_plan", plan)

    def run(self, inputs, group=None, **kwargs):
        """``group``: the layer's (default), another, or False for none."""
        self.spies.routes.clear()
        self.log.clear()
        return run_step(
            sparse_indexer,
            inputs,
            self.group if group is None else group or None,
            routes=self.spies.routes,
            log=self.log,
            **kwargs,
        )


def stock_run(stock_module, inputs, capacity=64, **kwargs):
    group = make_group(inputs.args["topk_indices_buffer"], capacity, [])
    return run_step(stock_module, inputs, group, **kwargs)


def assert_same(got, want, *, logical=True):
    assert torch.equal(got.kv_cache, want.kv_cache), "index K cache"
    assert torch.equal(got.tail.view(torch.int16), want.tail.view(torch.int16))
    assert torch.equal(got.physical, want.physical), "physical top-k"
    assert torch.equal(got.counts, want.counts), "valid counts"
    if logical:
        assert torch.equal(got.topk, want.topk), "logical top-k rows"


DEFERRED = ["kernel:update", "kernel:upcast", "kernel:remap"]
EXPANDED = ["kernel:update", "kernel:upcast", "kernel:expand"]


@pytest.mark.parametrize("step", STEPS)
def test_stage_off_is_stock(monkeypatch, references, stock_module, step):
    """SPECIALIZED_KPOOL None: the patched tree writes what stock writes."""
    monkeypatch.setattr(sparse_indexer, "SPECIALIZED_KPOOL", None)
    inputs = make_inputs(step)
    group = make_group(inputs.args["topk_indices_buffer"], 64, [])
    assert_same(
        run_step(sparse_indexer, inputs, group), stock_run(stock_module, inputs)
    )


@pytest.mark.parametrize("step", TOKEN_ROWS)
def test_defer_and_fused_remap(monkeypatch, references, stock_module, step):
    """Token-ordered decode rows: the pool top-k goes straight to FusedRemap;
    the logical rows stay unfilled (no consumer reads them)."""
    inputs = make_inputs(step)
    stage = Stage(monkeypatch, inputs)
    got = stage.run(inputs)
    want = stock_run(stock_module, inputs)
    assert got.routes == DEFERRED
    assert stage.stage.pending is None, "the deferred top-k is consumed once"
    assert_same(got, want, logical=False)
    rows = inputs.num_tokens
    assert (got.topk[:rows] == -5).all(), "the logical rows are not filled"
    assert got.log == [
        "side.wait_event(logical_ready)",
        "enter side",
        "physical_ready.record(side)",
        "exit side",
        "compute.wait_event(physical_ready)",
    ]


def test_fused_remap_under_piecewise_graphs(monkeypatch, references, stock_module):
    """Inside piecewise CUDA graphs the side stream waits on the compute
    stream (an event recorded in a captured segment is graph-local)."""
    inputs = make_inputs(Step([2, 2], [157, 210], seed=11))
    stage = Stage(monkeypatch, inputs)
    got = stage.run(inputs, cudagraph_mode=CUDAGraphMode.PIECEWISE)
    assert got.routes == DEFERRED
    assert got.log[0] == "side.wait_stream(compute)"
    assert_same(got, stock_run(stock_module, inputs), logical=False)


def test_fused_remap_block_stride(monkeypatch, references, stock_module):
    inputs = make_inputs(Step([1, 1, 1], [150, 203, 190], seed=12))
    stage = Stage(monkeypatch, inputs)
    got = stage.run(inputs, block_stride_rows=96)
    assert got.routes == DEFERRED
    want = stock_run(stock_module, inputs, block_stride_rows=96)
    assert_same(got, want, logical=False)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(layer_index=1), id="layer1"),
        pytest.param(dict(return_valid_counts=False), id="nocounts"),
        pytest.param(dict(capacity=2), id="above-group-capacity"),
    ],
)
def test_deferred_then_materialized(monkeypatch, references, stock_module, kwargs):
    """A deferred top-k the fused remap cannot take is materialized into the
    logical rows, then converted by stock."""
    capacity = kwargs.pop("capacity", 64)
    inputs = make_inputs(Step([1, 1, 1], [150, 203, 190], pad_rows=1, seed=13))
    stage = Stage(monkeypatch, inputs, capacity=capacity)
    got = stage.run(inputs, **kwargs)
    want = stock_run(stock_module, inputs, capacity=capacity, **kwargs)
    assert got.routes == ["kernel:update", "kernel:upcast", "kernel:expand"]
    assert stage.stage.pending is None
    assert_same(got, want)


@pytest.mark.parametrize(
    "step, kwargs, routes",
    [
        # SM90 non-uniform rows are [requests, max q_len]: stock expansion.
        pytest.param(
            Step([1, 3, 2], [171, 140, 255], "padded", seed=5),
            {},
            ["kernel:update", "kernel:upcast"],
            id="padded",
        ),
        # Stock fills short rows causally on CUDA; on the CPU it expands.
        pytest.param(Step([2, 2], [40, 90], seed=6), {}, EXPANDED, id="short"),
        pytest.param(
            Step([1, 1, 1], [150, 203, 190], seed=14),
            dict(max_rows=2),
            EXPANDED,
            id="above-stage-capacity",
        ),
        # Rows too wide for the stock conversion to compact them in order.
        pytest.param(
            Step([1, 1], [150, 180], seed=15, width=4224),
            {},
            EXPANDED,
            id="width4224",
        ),
        # No positions: no tail update, stock expansion of the seq_lens.
        pytest.param(
            Step([1, 1], [150, 180], positions=False, seed=8),
            {},
            ["kernel:upcast"],
            id="nopositions",
        ),
        pytest.param(
            Step([1, 1], [150, 180], seed=16, key_stride=130),
            {},
            ["stock:update", "kernel:upcast", "kernel:remap"],
            id="unaligned-key",
        ),
    ],
)
def test_no_defer_routes(monkeypatch, references, stock_module, step, kwargs, routes):
    inputs = make_inputs(step)
    stage = Stage(monkeypatch, inputs, **kwargs)
    got = stage.run(inputs)
    assert got.routes == routes
    deferred = "kernel:remap" in routes
    assert_same(got, stock_run(stock_module, inputs), logical=not deferred)


def test_unaligned_rows_expand_stock(monkeypatch, references, stock_module):
    """Top-k rows whose stride is not 16-byte aligned: no defer (the remap
    stores 16 bytes), stock expansion into the buffer."""
    inputs = make_inputs(Step([1, 1], [150, 180], seed=21, width=133))
    stage = Stage(monkeypatch, inputs)
    got = stage.run(inputs, group=False)
    assert got.routes == ["kernel:update", "kernel:upcast", "stock:expand"]
    want = run_step(stock_module, inputs, None)
    assert_same(got, want)


@pytest.mark.parametrize(
    "logits",
    [
        pytest.param(dict(logits_dtype=torch.float32), id="fp32"),
        pytest.param(dict(odd_stride=True), id="odd-stride"),
    ],
)
def test_upcast_guards(monkeypatch, references, stock_module, logits):
    references(paged_logits_reference(**logits))
    inputs = make_inputs(Step([1, 1], [150, 180], seed=17))
    stage = Stage(monkeypatch, inputs)
    got = stage.run(inputs)
    assert got.routes == ["kernel:update", "stock:upcast", "kernel:remap"]
    assert_same(got, stock_run(stock_module, inputs), logical=False)


def test_mtp_layer_never_defers(monkeypatch, references, stock_module):
    """The MTP draft's forward is not planned; and in a planned one, its
    indexer is not among the stage's layers: its top-k is expanded into its
    buffer and its (stock) group converts it."""
    step = Step([2, 2], [157, 210], layer=MTP_LAYER, tail=MTP_TAIL, seed=18)
    inputs = make_inputs(step)
    stage = Stage(monkeypatch, make_inputs(Step([1], [150])))
    mtp_group = make_group(inputs.args["topk_indices_buffer"], 64, [])
    want = stock_run(stock_module, inputs)
    got = stage.run(inputs, group=mtp_group)
    assert got.routes == []
    assert_same(got, want)
    # A forward whose metadata also holds the model's layers is planned.
    inputs.metadata[LAYER] = inputs.metadata[MTP_LAYER]
    mtp_group = make_group(inputs.args["topk_indices_buffer"], 64, [])
    got = stage.run(inputs, group=mtp_group)
    assert got.routes == EXPANDED
    assert_same(got, want)


def test_mixed_step_never_defers(monkeypatch, references, stock_module):
    """Prefill rows are the logical buffer's: even an active stage expands."""
    inputs = make_inputs(Step([1, 1], [150, 180], prefill=9, seed=7))
    stage = Stage(monkeypatch, inputs)
    monkeypatch.setattr(kpool.KpoolStage, "active", staticmethod(lambda: True))
    got = stage.run(inputs)
    assert got.routes == EXPANDED
    assert_same(got, stock_run(stock_module, inputs))


@pytest.mark.parametrize(
    "case", ["mixed", "not-warmed", "dummy", "above-plan", "no-context"]
)
def test_unplanned_steps_run_stock(monkeypatch, references, stock_module, case):
    step = Step([1, 1], [150, 180], prefill=9 if case == "mixed" else 0, seed=19)
    inputs = make_inputs(step)
    stage = Stage(monkeypatch, inputs, plan=1 if case == "above-plan" else 64)
    if case == "not-warmed":
        sd._plan.warmed = False
    if case == "no-context":
        assert not kpool.KpoolStage.active()
        return
    got = stage.run(inputs, dummy_run=case == "dummy")
    assert got.routes == []
    assert_same(got, stock_run(stock_module, inputs))


def test_defer_is_consumed_once(monkeypatch, references):
    inputs = make_inputs(Step([1, 1], [150, 180], seed=20))
    stage = Stage(monkeypatch, inputs)
    ids = stage.stage.pool_ids(2, 32)
    stage.stage.defer(ids, torch.zeros(2, dtype=torch.int64), 4)
    with pytest.raises(AssertionError, match="not consumed"):
        stage.stage.defer(ids, torch.zeros(2, dtype=torch.int64), 4)
