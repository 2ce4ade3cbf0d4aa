# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stage installed on the real sparse MLA impl classes of each backend
GLM-5-Next can get, as ``install()`` installs it: each fuses or declines as
designed, and a planned decode step, converted by that backend's own
``forward_mqa`` (its attention kernel stubbed), gives the physical top-k the
same backend gives with the stage off (CPU; see ``kpool_harness``).

| backend (GPU, KV cache) | decode conversion with the stage |
| --- | --- |
| FLASHINFER_MLA_SPARSE (SM100) | common ``forward_mqa``: group, with counts |
| FLASHINFER_MLA_SPARSE_SM90 | own ``forward_mqa``, patch 0005's flag: group |
| FLASHMLA_SPARSE (SM90 fp8_ds_mla or bf16) | group, with or without counts |
| FLASH_ATTN_MLA_SPARSE (SM90 fp16) | patch 0005's flag: group |
"""

import importlib.util
import os
import sys
import types
from types import SimpleNamespace

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("vllm")
pytest.importorskip("cutlass")

from kpool_harness import (  # noqa: E402
    GLM_TOPK,
    Spies,
    Step,
    assert_same,
    fake_streams,
    fresh_kernels,
    install_stage,
    load_stock_sparse_indexer,
    make_attention,
    make_group,
    make_inputs,
    mla_cache,
    paged_logits_reference,
    run_step,
    use_references,
    watch,
)

from vllm.models.glm5next.nvidia import sparse_indexer  # noqa: E402
from vllm.models.glm5next.nvidia.specialized_decode import kpool  # noqa: E402
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import (  # noqa: E402
    FlashInferMLASparseImpl,
)
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import (  # noqa: E402
    FlashInferMLASparseSM90Impl,
)
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120 import (  # noqa: E402
    FlashInferMLASparseSM120Impl,
)
from vllm.v1.attention.backends.mla.flashmla_sparse import (  # noqa: E402
    FlashMLASparseImpl,
    FlashMLASparseMetadata,
)

STEPS = [
    pytest.param(Step([1, 1, 1], [150, 203, 190], seed=50), id="decode"),
    pytest.param(Step([2, 2], [2157, 2310], seed=51, topk=GLM_TOPK), id="glm-mtp2"),
]


@pytest.fixture(scope="module")
def stock_module():
    return load_stock_sparse_indexer()


@pytest.fixture(scope="module")
def flash_attn_sparse():
    """FLASH_ATTN_MLA_SPARSE's module: it imports vllm_flash_attn, whose
    package init needs the CUDA extension; registered without running it."""
    name = "vllm.vllm_flash_attn"
    saved = {m: sys.modules[m] for m in list(sys.modules) if m.startswith(name)}
    spec = importlib.util.find_spec(name)
    package = types.ModuleType(name)
    package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
    sys.modules[name] = package
    backend = "vllm.v1.attention.backends.mla.flashattn_mla_sparse"
    try:
        from vllm.v1.attention.backends.mla import flashattn_mla_sparse

        yield flashattn_mla_sparse
    finally:
        for m in [m for m in sys.modules if m.startswith(name) or m == backend]:
            del sys.modules[m]
        sys.modules.update(saved)


@pytest.fixture
def references(monkeypatch, stock_module):
    use_references(
        monkeypatch, (stock_module, sparse_indexer), paged_logits_reference()
    )
    fresh_kernels(monkeypatch)
    fake_streams(monkeypatch, [])


class Backend:
    """A real impl of ``cls`` (not constructed: the attributes its
    ``forward_mqa`` reads), its attention kernel replaced by a recorder of
    the physical top-k it is given."""

    def __init__(self, cls, group, buffer, inputs, **attributes):
        impl = object.__new__(cls)
        impl.__dict__.update(
            {
                "index_group": group,
                "index_group_index": 0,
                "dcp_world_size": 1,
                "_indexer": None,
                "_topk_indices_buffer": buffer,
                **attributes,
            }
        )
        self.impl, self.inputs, self.seen = impl, inputs, {}
        self.kv = mla_cache(inputs)
        rows = inputs.num_tokens
        self.q = torch.zeros((rows, 1, 8), dtype=torch.bfloat16)
        for name in (
            "_forward_mqa_kernel",
            "_bf16_flash_mla_kernel",
            "_fp8_flash_mla_kernel",
        ):
            setattr(impl, name, getattr(self, name))
        mla = inputs.mla
        self.metadata = SimpleNamespace(
            num_decode_tokens=mla.num_decode_tokens,
            num_actual_tokens=mla.num_actual_tokens,
            req_id_per_token=mla.req_id_per_token,
            block_table=mla.block_table,
            block_size=mla.block_size,
            state=SimpleNamespace(
                pack_indices=lambda slots: self.seen.update(physical=slots.clone()),
                wrapper=SimpleNamespace(run=lambda *args, **kwargs: None),
            ),
        )

    def _forward_mqa_kernel(self, q, kv, physical, counts, **kwargs):
        self.seen.update(physical=physical.clone(), counts=counts.clone())
        return None, None

    def _bf16_flash_mla_kernel(self, q, kv, physical, counts, heads):
        self.seen.update(physical=physical.clone(), counts=counts.clone())
        return q, None

    def _fp8_flash_mla_kernel(self, q, kv_c_and_k_pe_cache, topk_indices, **kwargs):
        self.seen.update(physical=topk_indices.reshape(q.shape[0] * q.shape[1], -1))
        return torch.zeros((*q.shape[:2], 1, 1)), torch.zeros((1, 1, 1))

    def consume(self, buffer):
        """The layer's decode after its indexer wrote ``buffer`` (the step's
        copy of the top-k buffer, which the impl shares with the indexer)."""
        self.seen.clear()
        self.impl._topk_indices_buffer = buffer
        self.impl.index_group.logical_topk_indices = buffer
        q = self.q
        if isinstance(self.impl, FlashInferMLASparseSM90Impl):
            q = (q, torch.zeros((q.shape[0], 0), dtype=q.dtype))
        self.impl.forward_mqa(q, self.kv, self.metadata, None)
        return self.seen["physical"], self.seen.get("counts")


def _sm90(**extra):
    return dict(
        num_heads=1,
        qk_rope_head_dim=0,
        head_size=8,
        kv_lora_rank=4,
        use_fp8_kv_cache=False,
        **extra,
    )


def _flashmla(kv_cache_dtype):
    return dict(
        num_heads=1,
        q_head_size=8,
        kv_cache_dtype=kv_cache_dtype,
        need_to_return_lse_for_decode=False,
        pcp_dcp_kv_gather=False,
    )


def _metadata(backend, kind):
    """FlashMLA's FP8 metadata: the mixed batch or separate decode."""
    meta = backend.metadata
    fp8 = FlashMLASparseMetadata
    if kind == "mixed":
        meta.fp8_use_mixed_batch = True
        meta.fp8_extra_metadata = object.__new__(fp8.FP8KernelMetadata)
    elif kind == "separate":
        requests = len(backend.inputs.step.q_lens)
        separate = object.__new__(fp8.FP8SeparatePrefillDecode)
        separate.__dict__.update(
            num_decodes=requests,
            num_decode_tokens=backend.inputs.step.tokens,
            num_prefill_tokens=0,
            prefill=None,
            decode=SimpleNamespace(kernel_metadata=None),
        )
        meta.fp8_use_mixed_batch = False
        meta.fp8_extra_metadata = separate


# (impl class, impl attributes, FlashMLA FP8 path, counts reach the kernel)
BACKENDS = {
    "flashinfer-sm100": (FlashInferMLASparseImpl, {}, None, True),
    "flashinfer-sm90": (FlashInferMLASparseSM90Impl, _sm90(), None, False),
    "flashmla-bf16": (FlashMLASparseImpl, _flashmla("auto"), None, True),
    "flashmla-fp8-mixed": (FlashMLASparseImpl, _flashmla("fp8_ds_mla"), "mixed", 0),
    "flashmla-fp8-separate": (
        FlashMLASparseImpl,
        _flashmla("fp8_ds_mla"),
        "separate",
        False,
    ),
    "flash-attn": ("flash_attn", {}, None, True),
}


def _impl_class(cls, flash_attn_sparse):
    return flash_attn_sparse.FlashAttnMLASparseImpl if cls == "flash_attn" else cls


def _run(monkeypatch, inputs, cls, attributes, fp8, stage_on):
    """One step of the backend with the stage installed (``stage_on``) or
    off; returns the outcome, the backend and the stage (or None)."""
    log: list[str] = []
    buffer = inputs.args["topk_indices_buffer"]
    group = make_group(buffer, 64, log, recorded=stage_on)
    backend = Backend(cls, group, buffer, inputs, **attributes)
    _metadata(backend, fp8)
    stage = None
    if stage_on:
        Spies(monkeypatch, log)
        fake_streams(monkeypatch, log)
        attention = make_attention(group, inputs, impl=backend.impl)
        stage = install_stage(monkeypatch, [attention])
        watch(stage, log)
    else:
        monkeypatch.setattr(sparse_indexer, "SPECIALIZED_KPOOL", None)
    log.clear()
    got = run_step(sparse_indexer, inputs, None, log=log, consume=backend.consume)
    return got, backend, stage


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("step", STEPS)
def test_backend_fuses(monkeypatch, references, flash_attn_sparse, name, step):
    """Every backend GLM-5-Next gets on SM90/SM100 converts a planned decode
    step through its index group: the stage fuses it (patch 0005's flag set
    on the instance where the backend reads it), and its forward_mqa gets
    the physical top-k (and counts) it gets with the stage off."""
    cls, attributes, fp8, counts = BACKENDS[name]
    cls = _impl_class(cls, flash_attn_sparse)
    inputs = make_inputs(step)
    assert kpool._converts_through_group(object.__new__(cls))
    with monkeypatch.context() as off:
        fresh_kernels(off)
        want, _, _ = _run(off, inputs, cls, attributes, fp8, stage_on=False)
    got, backend, stage = _run(monkeypatch, inputs, cls, attributes, fp8, True)
    assert stage.fuse and stage.why_not_fused == [None]
    assert vars(backend.impl)["convert_decode_through_index_group"] is True
    assert got.routes == ["kernel:update", "kernel:upcast", "defer", "kernel:remap"]
    assert_same(got, want, logical=False)
    assert (got.counts.numel() > 0) == bool(counts)


def test_stage_off_keeps_the_flag_off(monkeypatch, references, flash_attn_sparse):
    """Patch 0005 changes nothing until the stage sets the flag: FLASH_ATTN's
    one-layer groups and FlashInfer SM90 convert the logical rows directly."""
    for cls in (flash_attn_sparse.FlashAttnMLASparseImpl, FlashInferMLASparseSM90Impl):
        assert cls.convert_decode_through_index_group is False
    inputs = make_inputs(Step([1, 1, 1], [150, 203, 190], seed=52))
    for cls, attributes in (
        (flash_attn_sparse.FlashAttnMLASparseImpl, {}),
        (FlashInferMLASparseSM90Impl, _sm90()),
    ):
        log: list[str] = []
        buffer = inputs.args["topk_indices_buffer"]
        group = make_group(buffer, 64, log, recorded=True)
        backend = Backend(cls, group, buffer, inputs, **attributes)
        monkeypatch.setattr(sparse_indexer, "SPECIALIZED_KPOOL", None)
        run_step(sparse_indexer, inputs, None, log=log, consume=backend.consume)
        assert "stock:convert" not in log, cls.__name__
    # FLASH_ATTN's multi-layer groups convert decode-only steps through the
    # group already (stock).
    log = []
    buffer = inputs.args["topk_indices_buffer"]
    group = make_group(buffer, 64, log, recorded=True)
    group.num_layers = 2
    backend = Backend(flash_attn_sparse.FlashAttnMLASparseImpl, group, buffer, inputs)
    run_step(sparse_indexer, inputs, None, log=log, consume=backend.consume)
    assert "stock:convert" in log


def test_mixed_batch_converts_directly(monkeypatch, references, flash_attn_sparse):
    """With the flag set, a batch that is not decode-only still converts
    per layer (the flag reaches decode-only steps only, the only ones that
    defer)."""
    for cls in (flash_attn_sparse.FlashAttnMLASparseImpl, FlashInferMLASparseSM90Impl):
        inputs = make_inputs(Step([1, 1], [150, 180], prefill=9, seed=53))
        log: list[str] = []
        buffer = inputs.args["topk_indices_buffer"]
        group = make_group(buffer, 64, log, recorded=True)
        attributes = _sm90() if cls is FlashInferMLASparseSM90Impl else {}
        backend = Backend(cls, group, buffer, inputs, **attributes)
        backend.impl.convert_decode_through_index_group = True
        monkeypatch.setattr(sparse_indexer, "SPECIALIZED_KPOOL", None)
        run_step(sparse_indexer, inputs, None, log=log, consume=backend.consume)
        assert "stock:convert" not in log, cls.__name__


@pytest.mark.parametrize(
    "attributes, why",
    [
        (dict(dcp_world_size=2), "decode context parallel"),
    ],
)
def test_backend_declines(monkeypatch, references, attributes, why):
    inputs = make_inputs(Step([1, 1, 1], [150, 203, 190], seed=54))
    buffer = inputs.args["topk_indices_buffer"]
    group = make_group(buffer, 64, [])
    backend = Backend(FlashInferMLASparseImpl, group, buffer, inputs, **attributes)
    attention = make_attention(group, inputs, impl=backend.impl)
    stage = install_stage(monkeypatch, [attention])
    assert not stage.fuse and stage.why_not_fused == [why]
    assert "convert_decode_through_index_group" not in vars(backend.impl)
    assert group._convert_once.__func__ is type(group)._convert_once


def test_sm120_flashinfer_declines(monkeypatch, references):
    """FlashInfer SM120's own forward_mqa converts the logical rows itself
    (and reads no flag): never fused (unreachable today: unsupported()
    refuses SM120 GPUs)."""
    inputs = make_inputs(Step([1, 1, 1], [150, 203, 190], seed=55))
    buffer = inputs.args["topk_indices_buffer"]
    group = make_group(buffer, 64, [])
    backend = Backend(FlashInferMLASparseSM120Impl, group, buffer, inputs)
    attention = make_attention(group, inputs, impl=backend.impl)
    stage = install_stage(monkeypatch, [attention])
    assert not stage.fuse
    assert stage.why_not_fused == [
        "FlashInferMLASparseSM120Impl converts the logical top-k rows itself"
    ]
    assert "convert_decode_through_index_group" not in vars(backend.impl)
