# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stage on the real sparse MLA impl classes of each backend GLM-5-Next
can get: each fuses or declines as designed, a planned decode step,
converted by that backend's own ``forward_mqa`` (its attention kernel
replaced by a recorder), leaves every byte the same backend leaves with the
stage off, and the warmup compiles exactly the kernel variants the
backend's steps launch (CPU; see ``indexer_sim``).

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
from indexer_sim import KERNELS, Model, Step, assert_same, kernel_name
from test_kpool_engagement import ENGAGEMENT

from vllm.models.glm5next.nvidia.specialized_decode.runtime.remap import (
    why_not_fusable,
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
    pytest.param(Step([2, 2], [2157, 2310], seed=51, topk=2048), id="glm-mtp2"),
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
    """Real impls of ``cls`` (not constructed: the attributes their
    ``forward_mqa`` reads), their attention kernel replaced by a recorder of
    the physical top-k (and counts) it is given. ``impl`` makes one on a
    model's index group; ``consume`` is a model's conversion through it."""

    def __init__(self, cls, fp8=None, **attributes):
        self.cls, self.fp8, self.attributes, self.seen = cls, fp8, attributes, {}

    def impl(self, group):
        impl = object.__new__(self.cls)
        vars(impl).update(
            index_group=group,
            index_group_index=0,
            dcp_world_size=1,
            _indexer=None,
            _topk_indices_buffer=group.logical_topk_indices,
        )
        vars(impl).update(self.attributes)
        for name in ("_forward_mqa_kernel", "_bf16_flash_mla_kernel"):
            setattr(impl, name, self.record)
        impl._fp8_flash_mla_kernel = self.record_fp8
        return impl

    def record(self, q, kv, physical, counts, *args, **kwargs):
        self.seen.update(physical=physical.clone(), counts=counts.clone())
        return q, None

    def record_fp8(self, q, kv_c_and_k_pe_cache, topk_indices, **kwargs):
        self.seen.update(physical=topk_indices.reshape(q.shape[0] * q.shape[1], -1))
        return torch.zeros((*q.shape[:2], 1, 1)), torch.zeros((1, 1, 1))

    def consume(self, model, layer, logical, mla):
        """The layer's decode after its indexer wrote the model's buffer."""
        attention = model.attentions[layer].mla_attn.mla_attn
        metadata = SimpleNamespace(
            **vars(mla),
            state=SimpleNamespace(
                pack_indices=lambda slots: self.seen.update(physical=slots.clone()),
                wrapper=SimpleNamespace(run=lambda *args, **kwargs: None),
            ),
        )
        fp8_metadata(metadata, self.fp8)
        q = torch.zeros((logical.shape[0], 1, 8), dtype=torch.bfloat16)
        if isinstance(attention.impl, FlashInferMLASparseSM90Impl):
            q = (q, torch.zeros((q.shape[0], 0), dtype=q.dtype))
        self.seen.clear()
        attention.impl.forward_mqa(q, attention.kv_cache, metadata, None)
        return self.seen["physical"], self.seen.get("counts")


def sm90(**extra):
    return dict(
        num_heads=1,
        qk_rope_head_dim=0,
        head_size=8,
        kv_lora_rank=4,
        use_fp8_kv_cache=False,
        **extra,
    )


def flashmla(kv_cache_dtype):
    return dict(
        num_heads=1,
        q_head_size=8,
        kv_cache_dtype=kv_cache_dtype,
        need_to_return_lse_for_decode=False,
        pcp_dcp_kv_gather=False,
    )


def fp8_metadata(meta, kind) -> None:
    """FlashMLA's FP8 metadata: the mixed batch or separate decode."""
    fp8 = FlashMLASparseMetadata
    if kind == "mixed":
        meta.fp8_use_mixed_batch = True
        meta.fp8_extra_metadata = object.__new__(fp8.FP8KernelMetadata)
    elif kind == "separate":
        separate = object.__new__(fp8.FP8SeparatePrefillDecode)
        separate.__dict__.update(
            num_decodes=meta.num_decodes,
            num_decode_tokens=meta.num_decode_tokens,
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
    "flashinfer-sm90": (FlashInferMLASparseSM90Impl, sm90(), None, False, True, False),
    "flashmla-bf16": (FlashMLASparseImpl, flashmla("auto"), None, True, True, False),
    "flashmla-fp8-mixed": (
        FlashMLASparseImpl,
        flashmla("fp8_ds_mla"),
        "mixed",
        False,
        False,
        False,
    ),
    "flashmla-fp8-separate": (
        FlashMLASparseImpl,
        flashmla("fp8_ds_mla"),
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
def backend_path(flash_attn_sparse, mx_scales, stock_module):
    """``backend_path(name)``: BACKENDS[name] with its impl class and its
    GPU's scales (SM100: MX scales, BF16 logits)."""

    def use(name):
        cls, attributes, fp8, counts, converts, mx = BACKENDS[name]
        if cls == "flash_attn":
            cls = flash_attn_sparse.FlashAttnMLASparseImpl
        if mx:
            mx_scales(True, stock_module)
        return SimpleNamespace(
            cls=cls,
            attributes=attributes,
            fp8=fp8,
            counts=counts,
            converts=converts,
            mx=mx,
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
def test_backend_fuses(bench, backend_path, name, step):
    """Every backend GLM-5-Next gets on SM90/SM100 converts a planned decode
    step through its index group: the stage fuses it (patch 0005's flag set
    on the instance where the backend reads it), and its ``forward_mqa``
    gets the physical top-k (and counts) it gets with the stage off."""
    path = backend_path(name)
    stock, backend = (Backend(path.cls, path.fp8, **path.attributes) for _ in "ab")
    b = bench(step, mx=path.mx, impl=backend.impl)
    impl = b.engine.attentions[0].mla_attn.mla_attn.impl
    assert b.stage.fuse and b.stage.why_not_fused == [None]
    assert vars(impl)["convert_decode_through_index_group"] is True
    off = b.run(Model(b.sim, "off", impl=stock.impl), consume=stock.consume)
    got = b.run(consume=backend.consume)
    upcast = "kernel:upcast" if path.mx else "stock:upcast"
    assert b.routes == ["kernel:update", upcast, "defer", "kernel:remap"]
    assert (got.snaps[0].counts[0] >= 0).item() == path.counts
    assert_same(off, got, b.fwd)


def steps_of(layout: str) -> list[Step]:
    """Decode steps of 1 to 4 tokens a request in ``layout``, a non-uniform
    one (SM90: the padded layout; SM100: varlen), a short one."""
    other = "padded" if layout == "native" else layout
    return [
        Step([1, 1], [150, 203], layout, seed=60),
        Step([2, 2], [157, 210], layout, seed=61),
        Step([3], [171], layout, seed=62),
        Step([4], [161], layout, seed=63),
        Step([1, 3], [171, 140], other, seed=64),
        Step([2, 2], [40, 90], layout, seed=65),
    ]


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_warmup_keys_are_the_launch_keys(bench, backend_path, name):
    """For each backend (the engagement matrix's paths and FlashMLA's BF16
    cache): the variants the stage's warmup derives for the backend's layer
    (its kernels' ``get_warmup_keys``) are, kernel by kernel, the variants
    its planned decode steps launch.

    The steps: uniform rows of 1 to 4 tokens (SM90 native, SM100 varlen:
    the update, the fused remap with the backend's counts), non-uniform ones
    (the update of the per-request scatter, which keeps the metadata's int64
    slots), a short context (no defer: the expansion); the upcast launches
    with SM100's BF16 logits only. One conversion asks the group for the
    other counts: the group takes either, and which one a FlashMLA
    deployment asks for depends on its KV cache dtype and heads, which the
    stage does not read, so both are compiled, for every backend."""
    path = backend_path(name)
    layout = "varlen" if path.mx else "native"
    backend = Backend(path.cls, path.fp8, **path.attributes)
    b = bench(Step([4, 4, 4], [500, 500, 500], layout), mx=path.mx, impl=backend.impl)
    derived = {name: set() for name in KERNELS}
    for kernel in b.stage.kernels:
        for key in kernel.get_warmup_keys():
            derived[kernel_name(key)].add(key)
    assert b.spies.compiled == derived
    assert {key.counts for key in derived["remap"]} == {True, False}
    stock = Backend(path.cls, path.fp8, **path.attributes)
    for step in steps_of(layout):
        b.use(step)
        got = b.run(consume=backend.consume)
        want = Model(b.sim, "stock", module=b.stock_module, impl=stock.impl)
        assert_same(b.run(want, consume=stock.consume), got, b.fwd)
    b.use(steps_of(layout)[0])
    got = b.run(counts=not path.converts)
    assert_same(b.stock(counts=not path.converts), got, b.fwd)
    assert b.spies.launched == derived


def test_stage_off_keeps_the_flag_off(bench, flash_attn_sparse):
    """Patch 0005 changes nothing until the stage sets the flag: FLASH_ATTN's
    one-layer groups and FlashInfer SM90 convert the logical rows directly;
    FLASH_ATTN's multi-layer groups convert decode-only steps through the
    group already (stock)."""
    flash_attn = flash_attn_sparse.FlashAttnMLASparseImpl
    b = bench(Step([1, 1, 1], [150, 203, 190], seed=52), warm=False)
    for cls, attributes, layers in (
        (flash_attn, {}, 1),
        (FlashInferMLASparseSM90Impl, sm90(), 1),
        (flash_attn, {}, 2),
    ):
        assert cls.convert_decode_through_index_group is False
        models = []
        for name, module in (("stock", b.stock_module), ("off", None)):
            backend = Backend(cls, **attributes)
            model = Model(b.sim, name, module=module, impl=backend.impl)
            model.groups[0].num_layers = layers
            models.append(b.run(model, consume=backend.consume))
        assert ("stock:convert" in b.routes) == (layers > 1), cls.__name__
        assert_same(*models, b.fwd)


def test_mixed_batch_converts_directly(bench, flash_attn_sparse):
    """With the flag set, a batch that is not decode-only still converts
    per layer (the flag reaches decode-only steps only, the only ones that
    defer)."""
    b = bench(Step([1, 1], [150, 180], prefill=9, seed=53), warm=False)
    for cls in (flash_attn_sparse.FlashAttnMLASparseImpl, FlashInferMLASparseSM90Impl):
        attributes = sm90() if cls is FlashInferMLASparseSM90Impl else {}
        backend = Backend(cls, **attributes)
        off = Model(b.sim, "off", impl=backend.impl)
        off.attentions[
            0
        ].mla_attn.mla_attn.impl.convert_decode_through_index_group = True
        b.run(off, consume=backend.consume)
        assert "stock:convert" not in b.routes, cls.__name__


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
        # (unreachable today: unsupported() refuses SM120).
        pytest.param(
            FlashInferMLASparseSM120Impl,
            {},
            "FlashInferMLASparseSM120Impl converts the logical top-k rows itself",
            id="sm120",
        ),
    ],
)
def test_backend_declines(bench, cls, attributes, why):
    """An impl the fused remap cannot serve: nothing is switched on it or
    its group; the stage's other kernels stay on."""
    b = bench(
        Step([1, 1, 1], [150, 203, 190], seed=54), impl=Backend(cls, **attributes).impl
    )
    impl = b.engine.attentions[0].mla_attn.mla_attn.impl
    assert not b.stage.fuse and b.stage.why_not_fused == [why]
    assert why_not_fusable(impl, impl.index_group) == why
    assert "convert_decode_through_index_group" not in vars(impl)
    assert impl.index_group.conversion is None
    assert b.stage.executors, "the other kernels stay on"
