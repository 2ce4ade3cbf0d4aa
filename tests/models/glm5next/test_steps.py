# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``runtime/steps.py``: which forward passes are planned steps of a stage
(``PlannedSteps``), and ``KpoolStage.planned()`` on top of it (CPU)."""

from types import SimpleNamespace

import pytest

from vllm.config import CUDAGraphMode
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata
from vllm.models.glm5next.nvidia.specialized_decode.runtime.stage import KpoolStage
from vllm.models.glm5next.nvidia.specialized_decode.runtime.steps import (
    ACCEPTED_METADATA,
    PlannedSteps,
)
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseMetadata
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadata


def metadata(prefills=0, decode_tokens=4, cls=DeepseekV32IndexerMetadata):
    """An attention metadata of ``cls`` with the prefill/decode split."""
    value = object.__new__(cls)
    value.__dict__.update(
        num_prefills=prefills,
        num_decodes=min(decode_tokens, 1),
        num_decode_tokens=decode_tokens,
    )
    return value


def context(attn_metadata, mode=CUDAGraphMode.NONE, dummy_run=False):
    return ForwardContext(
        no_compile_layers={},
        attn_metadata=attn_metadata,
        slot_mapping={},
        cudagraph_runtime_mode=mode,
        dummy_run=dummy_run,
    )


@pytest.fixture
def steps():
    return PlannedSteps(layer="a", max_rows=8, ignored={"tail"})


def test_accepted_metadata_are_vllms():
    """The accepted types are vLLM's classes (isinstance: the sparse MLA
    backends' metadata derive from ``MLACommonMetadata``)."""
    assert (DeepseekV32IndexerMetadata, MLACommonMetadata) == ACCEPTED_METADATA
    assert issubclass(FlashMLASparseMetadata, MLACommonMetadata)


@pytest.mark.parametrize(
    "mode", [CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL]
)
def test_planned_decode_steps(steps, mode):
    """Decode-only within the rows: at eager steps, at captures and at the
    breakable graphs' eager replays alike (mode plays no part); the sparse
    MLA layers' metadata (an MLACommonMetadata) counts too."""
    shared = metadata(decode_tokens=8)
    mla = metadata(decode_tokens=8, cls=FlashMLASparseMetadata)
    attn = {"a": shared, "b": shared, "mla": mla}
    assert steps.covers(context(attn, mode))
    attn["mla"] = metadata(prefills=1, cls=FlashMLASparseMetadata)
    assert not steps.covers(context(attn, mode))


def test_a_layer_without_tokens_leaves_a_decode_step_planned(steps):
    """A layer whose metadata holds neither prefills nor decode tokens,
    wherever it comes, does not unplan a step another layer decodes in."""
    empty = metadata(decode_tokens=0)
    assert steps.covers(context({"a": metadata(), "b": empty}))
    assert steps.covers(context({"b": empty, "a": metadata()}))


def test_one_decode_token_is_planned(steps):
    """Batch 1 without speculation: one decode token is a planned step."""
    assert steps.covers(context({"a": metadata(decode_tokens=1)}))


@pytest.mark.parametrize(
    "unknown",
    [
        pytest.param(SimpleNamespace(), id="no-split"),
        pytest.param(SimpleNamespace(**vars(metadata())), id="decode-only-split"),
    ],
)
def test_unknown_metadata_makes_the_step_unplanned(steps, unknown):
    """Any metadata type but the named ones, even one that reads as
    decode-only: the stage cannot tell what it describes, so the step is not
    planned; on an ignored layer (a tail cache) it is not read."""
    attn = {"a": metadata(), "other": unknown}
    assert not steps.covers(context(attn))
    assert steps.covers(context({"a": metadata(), "tail": unknown}))


def test_ignored_layers(steps):
    """The storage-only tail caches (``ignored``) split a speculative decode
    step as prefills: their metadata is not read."""
    attn = {"a": metadata(), "tail": metadata(prefills=2)}
    assert steps.covers(context(attn))
    assert not PlannedSteps(layer="a", max_rows=8).covers(context(attn))


@pytest.mark.parametrize(
    "attn, dummy",
    [
        pytest.param(None, False, id="profiling"),
        pytest.param([{"a": metadata()}], False, id="micro-batches"),
        pytest.param({}, False, id="no-layers"),
        pytest.param({"mtp": metadata()}, False, id="another-model"),
        pytest.param({"a": metadata()}, True, id="dummy"),
        pytest.param({"a": metadata(), "b": metadata(prefills=1)}, False, id="mixed"),
        pytest.param({"b": metadata(prefills=1), "a": metadata()}, False, id="mixed2"),
        pytest.param({"a": metadata(prefills=2, decode_tokens=0)}, False, id="prefill"),
        pytest.param({"a": metadata(decode_tokens=9)}, False, id="above-rows"),
        pytest.param({"a": metadata(decode_tokens=0)}, False, id="no-decodes"),
    ],
)
def test_unplanned_passes(steps, attn, dummy):
    assert not steps.covers(context(attn, dummy_run=dummy))


def test_planned_once_per_forward(steps):
    """Every layer of a forward gets the first answer (host state read once,
    though the metadata changed since); another live context is read
    anew."""
    attn = {"a": metadata()}
    ctx = context(attn)
    assert steps.covers(ctx)
    attn["a"] = metadata(prefills=1)
    assert steps.covers(ctx)
    assert not steps.covers(context(attn))


def test_a_freed_context_is_not_taken_for_the_next(steps):
    """50 forwards alternating a planned decode step and a mixed one, each
    context freed before the next is made (which CPython then allocates
    where the freed one was: asserted for most): each gets its own
    answer."""
    answers, reused, ctx = [], 0, None
    for step in range(50):
        planned = step % 2 == 0
        attn = {"a": metadata(prefills=0 if planned else 1)}
        freed, ctx = id(ctx), None
        ctx = context(attn)
        reused += id(ctx) == freed
        answers.append(steps.covers(ctx) == planned)
    assert reused > 25
    assert answers == [True] * 50


def test_stage_plans_only_once_warm():
    """``KpoolStage.planned()``: a planned step in the current forward
    context, once the stage's warmup set its executors."""
    stage = KpoolStage([], 8, "cpu", mx_scales=False)
    stage.steps = PlannedSteps(layer="a", max_rows=8)
    assert not stage.planned()  # no forward context
    with override_forward_context(context({"a": metadata()})):
        assert not stage.planned()
        stage.executors = {"key": "executor"}
        assert stage.planned()
