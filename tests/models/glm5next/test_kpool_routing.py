# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The hooks of the specialized kpool decode on the real stock decode path of
``sparse_attn_indexer_kpool`` and the sparse MLA index conversion (CPU, stock
Triton kernels interpreted; see ``kpool_harness``).

Stage off: the patched indexer equals the unpatched one. Stage on (installed
as ``install()`` does and warmed up by its real warmup body): the same caches,
physical top-k and counts as stock (and the same logical top-k rows wherever a
consumer reads them), with the route each input took asserted. Every kernel
launch is checked against the kernel's own rule and the keys warmup compiled.
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("vllm")
pytest.importorskip("cutlass")

from kpool_harness import (  # noqa: E402
    BLOCK,
    GLM_TOPK,
    GLM_WIDTH,
    LAYER,
    MTP_LAYER,
    MTP_TAIL,
    POOL,
    Spies,
    Step,
    assert_same,
    compiled_keys,
    fake_streams,
    fresh_kernels,
    install_stage,
    kernels,
    load_stock_sparse_indexer,
    make_attention,
    make_group,
    make_inputs,
    paged_logits_reference,
    run_step,
    use_mx_scales,
    use_references,
    watch,
)

from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.models.glm5next.nvidia import sparse_indexer  # noqa: E402
from vllm.models.glm5next.nvidia import specialized_decode as sd  # noqa: E402
from vllm.models.glm5next.nvidia.specialized_decode import (  # noqa: E402
    kpool,
    launch,
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

UPDATE, UPCAST = "kernel:update", "kernel:upcast"
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


@pytest.fixture(scope="module")
def stock_module():
    return load_stock_sparse_indexer()


@pytest.fixture
def references(monkeypatch, stock_module):
    """DeepGEMM's logits and the CUDA top-k in both trees, and the kernels as
    in a new process."""

    def use(logits_fn):
        use_references(monkeypatch, (stock_module, sparse_indexer), logits_fn)

    use(paged_logits_reference())
    fresh_kernels(monkeypatch)
    fake_streams(monkeypatch, [])
    return use


@pytest.fixture
def sm100(monkeypatch, references, stock_module):
    """The SM100 path: MX scales in every module (stock and fork), the cache
    and logits in that format."""
    use_mx_scales(monkeypatch, True, stock_module)
    references(paged_logits_reference(mx=True))


class Stage:
    """A KpoolStage over one DSA layer holding ``inputs``' caches, installed
    and warmed up, reached through SPECIALIZED_KPOOL in planned steps."""

    def __init__(
        self, monkeypatch, inputs, *, max_rows=64, capacity=64, bound=True, warm=True
    ):
        self.log: list[str] = []
        self.spies = Spies(monkeypatch, self.log)
        fake_streams(monkeypatch, self.log)
        buffer = inputs.args["topk_indices_buffer"]
        self.group = make_group(buffer, capacity, self.log, recorded=True)
        attention = make_attention(self.group, inputs, bound=bound)
        self.stage = install_stage(
            monkeypatch, [attention], max_rows=max_rows, warm=warm
        )
        assert self.stage.fuse and self.stage.layers == {inputs.step.layer}
        watch(self.stage, self.log)

    def run(self, inputs, group=None, **kwargs):
        """``group``: the layer's (default), another, or False for none."""
        self.log.clear()
        got = run_step(
            sparse_indexer,
            inputs,
            self.group if group is None else group or None,
            log=self.log,
            **kwargs,
        )
        assert self.stage.pending is None, "a deferred top-k was not consumed"
        return got


def stock_run(stock_module, inputs, capacity=64, **kwargs):
    group = make_group(inputs.args["topk_indices_buffer"], capacity, [])
    return run_step(stock_module, inputs, group, **kwargs)


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
    """Token-ordered decode rows: the pool top-k goes straight to FusedRemap
    on the group's side stream; the logical rows stay unfilled (no consumer
    reads them)."""
    inputs = make_inputs(step)
    stage = Stage(monkeypatch, inputs)
    got = stage.run(inputs)
    want = stock_run(stock_module, inputs)
    assert got.routes == DEFERRED
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
def test_sm100_mx_scales(monkeypatch, sm100, stock_module, step):
    """SM100: the update writes MX (UE8M0) scales, compiled as such at warmup,
    and BF16 logits are upcast by the kernel."""
    inputs = make_inputs(step, mx=True)
    stage = Stage(monkeypatch, inputs)
    assert {key.mx_scales for key in compiled_keys()["update"]} == {True}
    got = stage.run(inputs)
    assert got.routes == DEFERRED
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
def test_fp32_scales_not_rounded(monkeypatch, references, stock_module, step):
    """``scale_fmt=None``: FP32 scales that are not powers of two, the
    update's compile key and stock alike."""
    inputs = make_inputs(step)
    stage = Stage(monkeypatch, inputs)
    assert {key.round_scale for key in compiled_keys()["update"]} == {False}
    got = stage.run(inputs)
    deferred = step.layout != "padded"
    assert got.routes == (
        DEFERRED if deferred else [UPDATE, UPCAST, "indexer:expand", "stock:convert"]
    )
    assert_same(got, stock_run(stock_module, inputs), logical=not deferred)


def test_fused_remap_under_piecewise_graphs(monkeypatch, references, stock_module):
    """Inside piecewise CUDA graphs the side stream waits on the compute
    stream (an event recorded in a captured segment is graph-local)."""
    inputs = make_inputs(Step([2, 2], [157, 210], seed=11))
    stage = Stage(monkeypatch, inputs)
    got = stage.run(inputs, cudagraph_mode=CUDAGraphMode.PIECEWISE)
    assert got.log == [
        UPDATE,
        UPCAST,
        "defer",
        "side.wait_stream(compute)",
        *FUSED_STREAMS[1:],
    ]
    assert_same(got, stock_run(stock_module, inputs), logical=False)


@pytest.mark.parametrize("step_stride, stride", [(96, 96), (BLOCK, None)])
def test_fused_remap_block_stride(
    monkeypatch, references, stock_module, step_stride, stride
):
    """Blocks ``stride`` rows apart (other layers' pages between them), as
    warmup read it from the bound MLA cache; None: the block size."""
    step = Step([1, 1, 1], [150, 203, 190], seed=12, stride_rows=step_stride)
    inputs = make_inputs(step)
    stage = Stage(monkeypatch, inputs)
    got = stage.run(inputs, block_stride_rows=stride)
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
def test_fused_remap_without_counts(monkeypatch, references, stock_module, step):
    """FlashMLA's mixed-batch FP8 decode converts without counts: fused too,
    in place, with stock's bytes."""
    inputs = make_inputs(step)
    stage = Stage(monkeypatch, inputs)
    got = stage.run(inputs, return_valid_counts=False)
    assert got.log == [UPDATE, UPCAST, "defer", *FUSED_STREAMS]
    want = stock_run(stock_module, inputs, return_valid_counts=False)
    assert_same(got, want, logical=False)


def _materialized_then_stock(log):
    """The logical rows are written, then recorded ready, before the stock
    conversion's side stream waits on that record."""
    assert log[:5] == MATERIALIZED
    assert log[5:8] == [
        "logical_ready.record(compute)",
        "stock:convert",
        "side.wait_event(logical_ready)",
    ]


def test_declined_by_block_stride(monkeypatch, references, stock_module):
    """A block stride warmup did not compile (the cache was bound with
    another): FusedRemap declines, materializes, and the stock conversion
    runs after the logical rows are recorded ready."""
    inputs = make_inputs(Step([1, 1, 1], [150, 203, 190], seed=14))
    stage = Stage(monkeypatch, inputs)
    got = stage.run(inputs, block_stride_rows=96)
    _materialized_then_stock(got.log)
    assert_same(got, stock_run(stock_module, inputs, block_stride_rows=96))


@pytest.mark.parametrize("counts", [True, False])
def test_idx_mapping_declines(monkeypatch, references, stock_module, counts):
    """A conversion through ``idx_mapping`` (HiSparse's leader rows) is not
    the fused kernel's: declined, materialized, stock with the mapping."""
    step = Step([1, 1, 1], [150, 203, 190], seed=15)
    inputs = make_inputs(step)
    stage = Stage(monkeypatch, inputs)
    mapping = torch.tensor([2, 0, 1], dtype=torch.int32)
    kwargs = dict(idx_mapping=mapping, return_valid_counts=counts)
    got = stage.run(inputs, **kwargs)
    _materialized_then_stock(got.log)
    assert_same(got, stock_run(stock_module, inputs, **kwargs))


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(layer_index=1), id="layer1"),
        pytest.param(dict(capacity=2), id="above-group-capacity"),
    ],
)
def test_deferred_then_materialized(monkeypatch, references, stock_module, kwargs):
    """A deferred top-k the fused remap cannot take is materialized into the
    logical rows, then converted by stock (on the compute stream)."""
    capacity = kwargs.pop("capacity", 64)
    inputs = make_inputs(Step([1, 1, 1], [150, 203, 190], pad_rows=1, seed=13))
    stage = Stage(monkeypatch, inputs, capacity=capacity)
    got = stage.run(inputs, **kwargs)
    want = stock_run(stock_module, inputs, capacity=capacity, **kwargs)
    assert got.routes == [*MATERIALIZED, "stock:convert"]
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
def test_routes(monkeypatch, references, stock_module, step, kwargs, routes):
    inputs = make_inputs(step)
    stage = Stage(monkeypatch, inputs, **kwargs)
    got = stage.run(inputs)
    assert got.routes == routes
    deferred = "defer" in routes
    assert_same(got, stock_run(stock_module, inputs), logical=not deferred)


def test_unaligned_rows_expand_stock(monkeypatch, references, stock_module):
    """Top-k rows whose stride is not 16-byte aligned: no defer (the remap
    stores 16 bytes), stock expansion into the buffer."""
    inputs = make_inputs(Step([1, 1], [150, 180], seed=21, width=133))
    stage = Stage(monkeypatch, inputs)
    got = stage.run(inputs, group=False)
    assert got.routes == [UPDATE, UPCAST, "stock:expand"]
    assert_same(got, run_step(stock_module, inputs, None))


@pytest.mark.parametrize(
    "logits",
    [
        pytest.param(dict(logits_dtype=torch.float32), id="fp32"),
        pytest.param(dict(odd_stride=True), id="odd-stride"),
    ],
)
def test_upcast_guards(monkeypatch, references, stock_module, logits):
    """SM90's FP32 logits (stock returns them) and a row stride the kernel's
    16-byte accesses cannot take go to stock."""
    references(paged_logits_reference(**logits))
    inputs = make_inputs(Step([1, 1], [150, 180], seed=17))
    stage = Stage(monkeypatch, inputs)
    got = stage.run(inputs)
    assert got.routes == [UPDATE, "stock:upcast", "defer", "kernel:remap"]
    assert_same(got, stock_run(stock_module, inputs), logical=False)


# --- What warmup compiled ----------------------------------------------------


def _expected_keys(inputs, *, mx=False, round_scale=True, stride=BLOCK):
    args = inputs.args
    kv, tail = args["kv_cache"], args["tail_kv_cache"]
    groups = args["topk_tokens"] // POOL
    width = args["topk_indices_buffer"].shape[1]
    layout = (tail.shape[2], kv.shape[1], kv.stride(0), tail.stride(0), tail.stride(1))
    return dict(
        update={
            kpool.KpoolUpdateKernel.CompileKey(
                *layout, mx, round_scale, slots, slots, torch.int32
            )
            for slots in (torch.int64, torch.int32)
        },
        expand={kpool.ExpandPoolsKernel.CompileKey(groups, torch.int64)},
        remap={
            kpool.ExpandRemapKernel.CompileKey(
                groups, width, BLOCK, stride, torch.int64, counts
            )
            for counts in (True, False)
        },
        upcast={kpool.UPCAST_LAUNCH[0]},
    )


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(Step([1], [150]), id="32pools"),
        pytest.param(Step([1], [2100], stride_rows=80, **GLM), id="glm"),
        pytest.param(Step([1], [150], scale_fmt=None), id="unrounded"),
    ],
)
def test_warmup_compiles_what_steps_launch(monkeypatch, references, step):
    """The stage's warmup compiles, on fakes, every key a planned step of its
    layers launches: the update for the indexer's int32 positions and both
    slot dtypes, the expansion and the fused remap (with and without counts)
    for the runner's int64 positions, both upcast sizes; nothing else."""
    inputs = make_inputs(step)
    stage = Stage(monkeypatch, inputs)
    want = _expected_keys(
        inputs, round_scale=step.scale_fmt is not None, stride=step.stride_rows
    )
    assert compiled_keys() == want
    assert len(stage.stage.compile_keys([], torch.int64)) == len(want["upcast"])
    assert sd._plan.warmed and not launch._compiles_allowed()


def test_warmup_of_mx_scales(monkeypatch, sm100):
    inputs = make_inputs(Step([1], [150]), mx=True)
    Stage(monkeypatch, inputs)
    assert compiled_keys() == _expected_keys(inputs, mx=True)


def test_warmup_without_bound_cache_skips_the_remap(monkeypatch, references):
    """A layer whose MLA cache is not bound as [blocks, block, row] has no
    block layout for the remap: warmup compiles no remap, and a deferred
    top-k is then materialized for stock."""
    inputs = make_inputs(Step([1, 1], [150, 180], seed=22))
    stage = Stage(monkeypatch, inputs, bound=False)
    assert not compiled_keys()["remap"]
    assert compiled_keys()["update"] == _expected_keys(inputs)["update"]
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
            "upcast",
            Step([2, 2], [157, 210], seed=24),
            [UPDATE, "stock:upcast", "defer", "kernel:remap"],
            id="upcast",
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
def test_uncompiled_keys_run_stock(
    monkeypatch, references, stock_module, kernel, step, routes
):
    """A key warmup did not compile (here: dropped from the kernel's cache
    after warmup) is never launched: the stage gives the input to stock."""
    inputs = make_inputs(step)
    stage = Stage(monkeypatch, inputs)
    kernels()[kernel]._compiled_cache.clear()
    got = stage.run(inputs)
    assert got.routes == routes
    assert_same(got, stock_run(stock_module, inputs), logical="defer" not in routes)


def test_uncompiled_expand_materializes_through_stock(
    monkeypatch, references, stock_module
):
    inputs = make_inputs(Step([2, 2], [157, 210], seed=27))
    stage = Stage(monkeypatch, inputs)
    kernels()["expand"]._compiled_cache.clear()
    kernels()["remap"]._compiled_cache.clear()
    got = stage.run(inputs)
    assert got.routes == [UPDATE, UPCAST, "defer", "materialize", "stock:expand"] + [
        "stock:convert"
    ]
    assert_same(got, stock_run(stock_module, inputs))


def test_frozen_after_warmup(monkeypatch, references):
    """After the warmup a launch of a key it did not compile raises (no
    compile inside a decode step), where the stage sends the input to stock;
    a later engine's warmup may compile again; a CUDA graph capture never."""
    inputs = make_inputs(Step([1], [150], seed=28))
    stage = Stage(monkeypatch, inputs)
    stage.log.clear()
    ids = torch.zeros((2, 48), dtype=torch.int32)
    lengths = torch.tensor([200, 201])
    out = torch.full((2, 256), 9, dtype=torch.int32)
    key = kpool.ExpandPoolsKernel.CompileKey(48, torch.int64)
    assert not launch._compiles_allowed()
    with pytest.raises(RuntimeError, match="not compiled during warmup"):
        type(kpool.EXPAND).run(kpool.EXPAND, key, ids, lengths, out, 0)
    stage.stage.expand(ids, lengths, POOL, seq_offset=1, out=out)
    assert stage.log == ["stock:expand"]
    with launch.warming_up():
        assert launch._compiles_allowed()
        kpool.EXPAND.compile(key)
    assert kpool.EXPAND.ready(key) and not launch._compiles_allowed()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with launch.warming_up():
        assert not launch._compiles_allowed()


# --- Which steps plan, and which defer --------------------------------------


def test_mtp_layer_never_defers(monkeypatch, references, stock_module):
    """The MTP draft's forward is not planned; and in a planned one, its
    indexer is not among the stage's layers: its top-k is expanded into its
    buffer and its (stock) group converts it."""
    step = Step([2, 2], [157, 210], layer=MTP_LAYER, tail=MTP_TAIL, seed=18)
    inputs = make_inputs(step)
    stage = Stage(monkeypatch, make_inputs(Step([1], [150])))
    mtp_group = make_group(inputs.args["topk_indices_buffer"], 64, stage.log)
    want = stock_run(stock_module, inputs)
    got = stage.run(inputs, group=mtp_group)
    assert got.routes == ["indexer:expand"]
    assert_same(got, want)
    # A forward whose metadata also holds the model's layers is planned.
    inputs.metadata[LAYER] = inputs.metadata[MTP_LAYER]
    mtp_group = make_group(inputs.args["topk_indices_buffer"], 64, stage.log)
    got = stage.run(inputs, group=mtp_group)
    assert got.routes == [UPDATE, UPCAST, "kernel:expand"]
    assert_same(got, want)


def test_mixed_step_never_defers(monkeypatch, references, stock_module):
    """Prefill rows are the logical buffer's: even a planned step expands."""
    inputs = make_inputs(Step([1, 1], [150, 180], prefill=9, seed=7))
    stage = Stage(monkeypatch, inputs)
    monkeypatch.setattr(kpool, "planned", lambda: True)
    got = stage.run(inputs)
    assert got.routes == EXPANDED
    assert_same(got, stock_run(stock_module, inputs))


@pytest.mark.parametrize(
    "case", ["mixed", "not-warmed", "dummy", "above-plan", "no-context"]
)
def test_unplanned_steps_run_stock(monkeypatch, references, stock_module, case):
    step = Step([1, 1], [150, 180], prefill=9 if case == "mixed" else 0, seed=19)
    inputs = make_inputs(step)
    stage = Stage(
        monkeypatch,
        inputs,
        max_rows=1 if case == "above-plan" else 64,
        warm=case != "not-warmed",
    )
    if case == "no-context":
        assert not sd.planned()
        assert stage.stage.decode_step(None, LAYER, None, 128, POOL, None) is None
        return
    got = stage.run(inputs, dummy_run=case == "dummy")
    assert got.routes == ["indexer:expand", "stock:convert"]
    assert_same(got, stock_run(stock_module, inputs))


def test_defers_rule(monkeypatch, references):
    """``defers``: a fused layer, at most ``max_rows`` rows, the remap's
    shapes (pools a multiple of 32, at least 32, a wide enough width the
    stock conversion with counts compacts in order)."""
    inputs = make_inputs(Step([1], [150]))
    stage = Stage(monkeypatch, inputs, max_rows=8).stage
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


def test_pool_topk_buffer(monkeypatch, references):
    """A deferring step's pool top-k lives in the stage's buffer (the remap
    reads it after the indexer returns); others get a fresh tensor."""
    inputs = make_inputs(Step([1], [150]))
    stage = Stage(monkeypatch, inputs, max_rows=8).stage
    fresh = stage.pool_topk(3, 32, "cpu")
    assert fresh.shape == (3, 32) and fresh.dtype == torch.int32
    assert fresh.data_ptr() != stage.pool_buffer.data_ptr()
    stage.deferring = True
    held = stage.pool_topk(3, 32, "cpu")
    assert held.shape == (3, 32) and held.is_contiguous()
    assert held.data_ptr() == stage.pool_buffer.data_ptr()
    assert stage.pool_buffer.shape == (8, 1024)


def test_defer_is_consumed_once(monkeypatch, references):
    inputs = make_inputs(Step([1, 1], [150, 180], seed=20))
    stage = Stage(monkeypatch, inputs).stage
    ids = stage.pool_buffer[:2, :32]
    positions = torch.zeros(3, dtype=torch.int64)
    meta = inputs.metadata[LAYER].decode
    stage.deferring = True
    assert stage.resolve(ids, positions, meta, None)
    assert not stage.deferring
    pool_ids, kept, pool = stage.pending
    assert pool_ids is ids and kept.shape == (2,) and pool == POOL
    stage.deferring = True
    with pytest.raises(AssertionError, match="not consumed"):
        stage.resolve(ids, positions, meta, None)
