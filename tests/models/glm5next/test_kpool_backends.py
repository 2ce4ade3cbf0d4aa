# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stage installed on the real sparse MLA impl classes of each backend
GLM-5-Next can get, as ``install()`` installs it: each fuses or declines as
designed, a planned decode step, converted by that backend's own
``forward_mqa`` (its attention kernel stubbed), gives the physical top-k the
same backend gives with the stage off, and the warmup compiles exactly the
kernel variants the backend's steps launch (CPU; see ``kpool_harness``).

| backend (GPU, KV cache) | decode conversion with the stage |
| --- | --- |
| FLASHINFER_MLA_SPARSE (SM100) | common ``forward_mqa``: group, with counts |
| FLASHINFER_MLA_SPARSE_SM90 | own ``forward_mqa``, patch 0005's flag: group |
| FLASHMLA_SPARSE (SM90 fp8_ds_mla or bf16) | group, with or without counts |
| FLASH_ATTN_MLA_SPARSE (SM90 fp16) | patch 0005's flag: group |
"""

import importlib.util
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from kpool_harness import (
    GLM_TOPK,
    KERNELS,
    Step,
    assert_same,
    make_attention,
    make_group,
    make_inputs,
    mla_cache,
    run_step,
)
from test_kpool_engagement import ENGAGEMENT

from vllm.models.glm5next.nvidia import sparse_indexer
from vllm.models.glm5next.nvidia.specialized_decode import warmup
from vllm.models.glm5next.nvidia.specialized_decode.fused_remap import (
    converts_through_group,
)
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import (
    FlashInferMLASparseImpl,
)
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import (
    FlashInferMLASparseSM90Impl,
)
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120 import (
    FlashInferMLASparseSM120Impl,
)
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    FlashMLASparseImpl,
    FlashMLASparseMetadata,
)

STEPS = [
    pytest.param(Step([1, 1, 1], [150, 203, 190], seed=50), id="decode"),
    pytest.param(Step([2, 2], [2157, 2310], seed=51, topk=GLM_TOPK), id="glm-mtp2"),
]


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


class Backend:
    """A real impl of ``cls`` (not constructed: the attributes its
    ``forward_mqa`` reads) on a new index group of ``inputs``' buffer, its
    attention kernel replaced by a recorder of the physical top-k it is
    given."""

    def __init__(self, cls, inputs, log, **attributes):
        self.group = make_group(inputs.buffer, 64, log)
        impl = object.__new__(cls)
        impl.__dict__.update(
            {
                "index_group": self.group,
                "index_group_index": 0,
                "dcp_world_size": 1,
                "_indexer": None,
                "_topk_indices_buffer": inputs.buffer,
                **attributes,
            }
        )
        self.impl, self.seen = impl, {}
        self.kv = mla_cache(inputs)
        self.q = torch.zeros((64, 1, 8), dtype=torch.bfloat16)
        for name in (
            "_forward_mqa_kernel",
            "_bf16_flash_mla_kernel",
            "_fp8_flash_mla_kernel",
        ):
            setattr(impl, name, getattr(self, name))
        self.metadata = SimpleNamespace(
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

    def consumer(self, inputs, fp8=None):
        """The layer's decode of ``inputs``' step after its indexer wrote
        ``buffer`` (the model's top-k buffer, which the impl shares)."""
        self.metadata.__dict__.update(vars(inputs.mla))
        _fp8_metadata(self.metadata, inputs.step, fp8)

        def consume(buffer):
            self.seen.clear()
            self.impl.index_group.logical_topk_indices = buffer
            q = self.q[: inputs.num_tokens]
            if isinstance(self.impl, FlashInferMLASparseSM90Impl):
                q = (q, torch.zeros((q.shape[0], 0), dtype=q.dtype))
            self.impl.forward_mqa(q, self.kv, self.metadata, None)
            return self.seen["physical"], self.seen.get("counts")

        return consume


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


def _fp8_metadata(meta, step, kind):
    """FlashMLA's FP8 metadata: the mixed batch or separate decode."""
    fp8 = FlashMLASparseMetadata
    if kind == "mixed":
        meta.fp8_use_mixed_batch = True
        meta.fp8_extra_metadata = object.__new__(fp8.FP8KernelMetadata)
    elif kind == "separate":
        separate = object.__new__(fp8.FP8SeparatePrefillDecode)
        separate.__dict__.update(
            num_decodes=len(step.q_lens),
            num_decode_tokens=step.tokens,
            num_prefill_tokens=0,
            prefill=None,
            decode=SimpleNamespace(kernel_metadata=None),
        )
        meta.fp8_use_mixed_batch = False
        meta.fp8_extra_metadata = separate


# name: (impl class, impl attributes, FlashMLA FP8 path, counts reach the
# attention kernel, the conversion's counts, SM100)
BACKENDS = {
    "flashinfer-sm100": (FlashInferMLASparseImpl, {}, None, True, True, True),
    "flashinfer-sm90": (
        FlashInferMLASparseSM90Impl,
        _sm90(),
        None,
        False,
        True,
        False,
    ),
    "flashmla-bf16": (FlashMLASparseImpl, _flashmla("auto"), None, True, True, False),
    "flashmla-fp8-mixed": (
        FlashMLASparseImpl,
        _flashmla("fp8_ds_mla"),
        "mixed",
        False,
        False,
        False,
    ),
    "flashmla-fp8-separate": (
        FlashMLASparseImpl,
        _flashmla("fp8_ds_mla"),
        "separate",
        False,
        True,
        False,
    ),
    "flash-attn": ("flash_attn", {}, None, True, True, False),
}
# The engagement matrix's paths (arch, the backend vLLM picks, what the
# fused remap converts), each as one of BACKENDS.
PATHS = {
    ("SM100", "FLASHINFER_MLA_SPARSE", "with counts"): "flashinfer-sm100",
    ("SM90", "FLASHINFER_MLA_SPARSE_SM90", "with counts"): "flashinfer-sm90",
    ("SM90", "FLASH_ATTN_MLA_SPARSE", "with counts"): "flash-attn",
    ("SM90", "FLASHMLA_SPARSE", "without counts"): "flashmla-fp8-mixed",
    ("SM90", "FLASHMLA_SPARSE", "with counts"): "flashmla-fp8-separate",
}


@pytest.fixture
def backend_path(request, flash_attn_sparse, mx_scales, references, stock_module):
    """``backend_path(name)``: BACKENDS[name] with its impl class, its GPU's
    scales and logits in place (SM100: MX scales, BF16 logits)."""
    from kpool_harness import paged_logits_reference

    def use(name):
        cls, attributes, fp8, counts, converts, sm100 = BACKENDS[name]
        if cls == "flash_attn":
            cls = flash_attn_sparse.FlashAttnMLASparseImpl
        if sm100:
            mx_scales(True, stock_module)
            references(paged_logits_reference(mx=True))
        return SimpleNamespace(
            cls=cls,
            attributes=attributes,
            fp8=fp8,
            counts=counts,
            converts=converts,
            mx=bool(sm100),
        )

    return use


def test_every_engagement_path_has_a_backend():
    paths = {
        (arch, valid.split(",")[0], runs.rsplit("fused remap ", 1)[1])
        for (_, arch, _), (valid, runs) in ENGAGEMENT.items()
    }
    assert paths == set(PATHS)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("step", STEPS)
def test_backend_fuses(monkeypatch, engine, timeline, backend_path, name, step):
    """Every backend GLM-5-Next gets on SM90/SM100 converts a planned decode
    step through its index group: the stage fuses it (patch 0005's flag set
    on the instance where the backend reads it), and its forward_mqa gets
    the physical top-k (and counts) it gets with the stage off."""
    path = backend_path(name)
    inputs = make_inputs(step, mx=path.mx)
    assert converts_through_group(object.__new__(path.cls))
    # Stage off (no stage is installed on this buffer yet).
    stock = Backend(path.cls, inputs, [], **path.attributes)
    want = run_step(
        sparse_indexer, inputs, None, consume=stock.consumer(inputs, path.fp8)
    )
    backend = Backend(path.cls, inputs, timeline, **path.attributes)
    model = engine(inputs, group=backend.group, impl=backend.impl)
    assert model.stage.fuse and model.stage.why_not_fused == [None]
    assert vars(backend.impl)["convert_decode_through_index_group"] is True
    got = model.run(inputs, consume=backend.consumer(inputs, path.fp8))
    upcast = "kernel:upcast" if path.mx else "stock:upcast"
    assert got.routes == ["kernel:update", upcast, "defer", "kernel:remap"]
    assert_same(got, want, logical=False)
    assert (got.counts.numel() > 0) == bool(path.counts)


def _steps(layout):
    """Decode steps of 1 to 4 tokens a request in ``layout``; a non-uniform
    one (SM90: the padded layout; SM100: varlen); a short one."""
    uniform = [
        Step([1, 1], [150, 203], layout, seed=60),
        Step([2, 2], [157, 210], layout, seed=61),
        Step([3], [171], layout, seed=62),
        Step([4], [161], layout, seed=63),
    ]
    other = "padded" if layout == "native" else layout
    return [
        *uniform,
        Step([1, 3], [171, 140], other, seed=64),
        Step([2, 2], [40, 90], layout, seed=65),
    ]


@pytest.mark.parametrize("name", sorted(set(PATHS.values())))
def test_warmup_keys_are_the_launch_keys(engine, spies, backend_path, name):
    """For each path of the engagement matrix: the variants the stage's
    warmup derives for the backend's layer (``warmup.warmup_keys``) are,
    kernel by kernel, the variants its planned decode steps launch.

    The steps: uniform rows of 1 to 4 tokens (SM90 native, SM100 varlen:
    the update, the fused remap with the backend's counts), non-uniform ones
    (the update of the per-request scatter, which keeps the metadata's int64
    slots), a short context (no defer: the expansion); the upcast launches
    with SM100's BF16 logits only. One conversion asks the
    group for the other counts: the group takes either, and which one a
    FlashMLA deployment asks for depends on its KV cache dtype and heads,
    which the stage does not read, so both are compiled."""
    path = backend_path(name)
    layout = "varlen" if path.mx else "native"
    model_buffer = torch.full((64, 256), -5, dtype=torch.int32)
    first = make_inputs(_steps(layout)[0], mx=path.mx, buffer=model_buffer)
    backend = Backend(path.cls, first, spies.timeline, **path.attributes)
    model = engine(first, group=backend.group, impl=backend.impl)
    derived = {name: set() for name in KERNELS}
    for kernel, key in warmup.warmup_keys(model.stage, [model.attention]):
        derived[next(n for n, k in KERNELS.items() if k is kernel)].add(key)
    assert spies.compiled == derived
    for step in _steps(layout):
        inputs = make_inputs(step, mx=path.mx, buffer=model_buffer)
        model.run(inputs, consume=backend.consumer(inputs, path.fp8))
    model.run(first, return_valid_counts=not path.converts)
    assert spies.launched == derived


def test_stage_off_keeps_the_flag_off(
    monkeypatch, spies, references, flash_attn_sparse, timeline
):
    """Patch 0005 changes nothing until the stage sets the flag: FLASH_ATTN's
    one-layer groups and FlashInfer SM90 convert the logical rows directly."""
    monkeypatch.setattr(sparse_indexer, "SPECIALIZED_KPOOL", None)
    flash_attn = flash_attn_sparse.FlashAttnMLASparseImpl
    inputs = make_inputs(Step([1, 1, 1], [150, 203, 190], seed=52))
    for cls, attributes in ((flash_attn, {}), (FlashInferMLASparseSM90Impl, _sm90())):
        assert cls.convert_decode_through_index_group is False
        backend = Backend(cls, inputs, timeline, **attributes)
        timeline.clear()
        run_step(sparse_indexer, inputs, None, consume=backend.consumer(inputs))
        assert "stock:convert" not in timeline, cls.__name__
    # FLASH_ATTN's multi-layer groups convert decode-only steps through the
    # group already (stock).
    backend = Backend(flash_attn, inputs, timeline)
    backend.group.num_layers = 2
    timeline.clear()
    run_step(sparse_indexer, inputs, None, consume=backend.consumer(inputs))
    assert "stock:convert" in timeline


def test_mixed_batch_converts_directly(
    monkeypatch, spies, references, flash_attn_sparse, timeline
):
    """With the flag set, a batch that is not decode-only still converts
    per layer (the flag reaches decode-only steps only, the only ones that
    defer)."""
    monkeypatch.setattr(sparse_indexer, "SPECIALIZED_KPOOL", None)
    inputs = make_inputs(Step([1, 1], [150, 180], prefill=9, seed=53))
    for cls in (flash_attn_sparse.FlashAttnMLASparseImpl, FlashInferMLASparseSM90Impl):
        attributes = _sm90() if cls is FlashInferMLASparseSM90Impl else {}
        backend = Backend(cls, inputs, timeline, **attributes)
        backend.impl.convert_decode_through_index_group = True
        timeline.clear()
        run_step(sparse_indexer, inputs, None, consume=backend.consumer(inputs))
        assert "stock:convert" not in timeline, cls.__name__


@pytest.mark.parametrize(
    "cls, attributes, why",
    [
        pytest.param(
            FlashInferMLASparseImpl,
            dict(dcp_world_size=2),
            "decode context parallel",
            id="dcp",
        ),
        # FlashInfer SM120's own forward_mqa converts the logical rows itself
        # and reads no flag (unreachable today: unsupported() refuses SM120).
        pytest.param(
            FlashInferMLASparseSM120Impl,
            {},
            "FlashInferMLASparseSM120Impl converts the logical top-k rows itself",
            id="sm120",
        ),
    ],
)
def test_backend_declines(install_stage, spies, cls, attributes, why):
    """An impl the fused remap cannot serve: nothing is switched on it or
    its group; the stage's other kernels stay on."""
    inputs = make_inputs(Step([1, 1, 1], [150, 203, 190], seed=54))
    backend = Backend(cls, inputs, [], **attributes)
    attention = make_attention(backend.group, inputs, impl=backend.impl)
    stage = install_stage([attention])
    assert not stage.fuse and stage.why_not_fused == [why]
    assert "convert_decode_through_index_group" not in vars(backend.impl)
    assert "_convert_once" not in vars(backend.group)
