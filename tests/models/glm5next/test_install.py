# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``runtime/install.py``: the stage installed at model build (what it
switches on, what it logs, its JIT warmup registered) and the process's
registry of stages, which gives each engine its own (CPU)."""

import gc
import inspect

import pytest
from indexer_sim import Backend, Geometry, Model, Sim, Step, assert_same, kernel_name
from kpool_hook import KpoolHook, KpoolLayerStep

from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
)
from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
from vllm.models.glm5next.nvidia import sparse_indexer
from vllm.models.glm5next.nvidia.specialized_decode.config import SELF_CHECK_SEED_ENV
from vllm.models.glm5next.nvidia.specialized_decode.runtime import install
from vllm.models.glm5next.nvidia.specialized_decode.runtime.remap import FusedRemap
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120 import (
    FlashInferMLASparseSM120Impl,
)
from vllm.v1.attention.backends.mla.index_group import (
    HiSparseMLAIndexGroup,
    SparseMLAIndexGroup,
)

ON = {"decode_backend": "latency_specialized"}
PREFIX = "GLM-5-Next specialized decode: "


@pytest.fixture
def installed(monkeypatch, fake_gpu, vllm_log):
    """An SM90 GPU, an empty registry, and the install log's lines."""
    fake_gpu(90)
    monkeypatch.setattr(sparse_indexer, "SPECIALIZED_KPOOL", None)

    def lines():
        return [
            (r.levelname.lower(), r.getMessage())
            for r in vllm_log.records
            if r.name == install.__name__
        ]

    return lines


def attentions(count=2, *, impl=None, group=None):
    """``count`` DSA layers of one model (one top-k buffer), each with the
    shared sparse MLA decode's impl and its own one-layer index group;
    ``impl`` (a factory of the impl from its group) and ``group`` replace
    the last layer's."""
    geo = Geometry(layers=count, heads=4, topk=128, max_model_len=512, max_reqs=4)
    sim = Sim(geo, Backend("sm90", False, False, "padded", "group"), "cpu", 0)
    model = Model(sim, "model")
    last = model.attentions[-1].mla_attn.mla_attn
    if group is not None:
        last.impl.index_group = group
    if impl is not None:
        last.impl = impl(last.impl.index_group)
    return model.attentions


def impl_of(attention):
    return attention.mla_attn.mla_attn.impl


class ItsOwnImpl:
    """A sparse MLA impl that is not a ``SparseMLACommonImpl``: whatever its
    ``forward_mqa``, the stage cannot tell how it converts."""

    forward_mqa = SparseMLACommonImpl.forward_mqa

    def __init__(self, group):
        self.index_group, self.dcp_world_size = group, 1


def sm120(group):
    impl = object.__new__(FlashInferMLASparseSM120Impl)
    vars(impl).update(index_group=group, dcp_world_size=1)
    return impl


def dcp(group):
    impl = object.__new__(SparseMLACommonImpl)
    vars(impl).update(index_group=group, dcp_world_size=2)
    return impl


UPCAST = "update (FP32 scales), no upcast (FP32 logits, stock returns them), "
FUSED = f"{UPCAST}fused expand + remap"


def not_fused(why: str) -> str:
    return f"{UPCAST}expand, stock conversion ({why})"


def installed_line(rows: int, backend: str, layers: list[str]) -> str:
    return (
        f"{PREFIX}dsa_kpool installed for decode-only steps of up to {rows} rows, "
        "on once the JIT warmup compiled and self-checked its kernels; attention "
        f"backend {backend}; DSA layers: "
        + "; ".join(f"model.layers.{i}.self_attn: {s}" for i, s in enumerate(layers))
        + "."
    )


def test_install_auto_is_stock(installed, make_config):
    assert install.install(make_config(additional_config={}), attentions()) is None
    assert sparse_indexer.SPECIALIZED_KPOOL is None
    assert installed() == []


def test_install_left_out(installed, make_config):
    extra = {**ON, "specialized_decode_skip": ["dsa_kpool"]}
    assert install.install(make_config(additional_config=extra), attentions()) is None
    assert sparse_indexer.SPECIALIZED_KPOOL is None
    assert installed() == [("info", f"{PREFIX}dsa_kpool off (left out).")]


def test_install_without_dsa_layers(installed, make_config):
    assert install.install(make_config(), []) is None
    assert sparse_indexer.SPECIALIZED_KPOOL is None
    assert installed() == [("info", f"{PREFIX}dsa_kpool off (no DSA layers).")]


def test_install_unsupported_raises(installed, make_config, fake_gpu):
    fake_gpu(None)
    with pytest.raises(ValueError, match="SM90"):
        install.install(make_config(), attentions())
    assert sparse_indexer.SPECIALIZED_KPOOL is None


def test_install_outside_a_runner(installed, make_config):
    """Outside a model runner's warmup registry nothing compiles the
    kernels: the stage is registered but has no executors, so it plans no
    step."""
    layers = attentions()
    stage = install.install(make_config(), layers)
    buffer = layers[0].indexer.topk_indices_buffer
    assert dict(install.registry().by_buffer) == {buffer.data_ptr(): stage}
    assert sparse_indexer.SPECIALIZED_KPOOL is install.registry()
    assert stage.fuse and stage.max_rows == 256 and not stage.executors
    prefix = "model.layers.0.self_attn.indexer"
    assert (stage.steps.layer, stage.steps.max_rows) == (f"{prefix}.k_cache", 256)
    # The storage-only tail caches' metadata does not describe the step.
    tails = {f"model.layers.{i}.self_attn.indexer.tail_cache" for i in range(2)}
    assert stage.steps.ignored == tails
    assert not stage.mx_scales and not stage.select and not stage.scores
    assert installed() == [
        ("info", installed_line(256, "SparseMLACommonImpl", [FUSED, FUSED]))
    ]


def test_install_on_sm100_logs_mx_scales(installed, make_config, mx_scales):
    mx_scales(True)
    stage = install.install(make_config(), attentions(1))
    assert stage.mx_scales
    [(_, line)] = installed()
    assert line.endswith(
        "DSA layers: model.layers.0.self_attn: update (MX scales), upcast, "
        "fused expand + remap."
    )


@pytest.mark.parametrize(
    "value, rows", [(True, "every batch"), ("one_wave", "one wave of rows")]
)
def test_install_with_the_select_logs_it(
    installed, make_config, monkeypatch, value, rows
):
    from vllm.models.glm5next.nvidia.specialized_decode.runtime import stage

    monkeypatch.setattr(stage, "sm_count", lambda index: 132)
    config = make_config(additional_config={**ON, "kpool_select": value})
    built = install.install(config, attentions(1))
    assert built.select and built.sms == 132
    assert built.select_one_wave is (value == "one_wave")
    [(_, line)] = installed()
    assert line.endswith(f"{UPCAST}select (opt-in, {rows}), fused expand + remap.")


SCORED = (
    "update (FP32 scales), scores (opt-in) or DeepGEMM scores, no upcast (FP32 "
    "logits, stock returns them), "
)


@pytest.mark.parametrize(
    "extra, scores, tail",
    [
        ({}, False, f"{UPCAST}fused expand + remap."),
        ({"kpool_scores": False}, False, f"{UPCAST}fused expand + remap."),
        ({"kpool_scores": True}, True, f"{SCORED}fused expand + remap."),
        (
            {"kpool_scores": True, "kpool_select": True},
            True,
            f"{SCORED}select (opt-in, every batch), fused expand + remap.",
        ),
    ],
)
def test_install_with_the_scores_logs_it(
    installed, make_config, monkeypatch, extra, scores, tail
):
    """``kpool_scores`` reaches the stage with the deployment's next_n (1 +
    its 3 speculative tokens), and its start-up line names the scores,
    DeepGEMM's where the kernel does not take a call."""
    from vllm.models.glm5next.nvidia.specialized_decode.runtime import stage

    monkeypatch.setattr(stage, "sm_count", lambda index: 132)
    config = make_config(additional_config={**ON, **extra})
    built = install.install(config, attentions(1))
    assert built.scores is scores and built.next_n == 4
    [(_, line)] = installed()
    assert line.endswith(f"DSA layers: model.layers.0.self_attn: {tail}"), line


def test_install_with_the_scores_on_mx_scales(installed, make_config, mx_scales):
    """With MX scales the kernel takes no call: the line says DeepGEMM's."""
    mx_scales(True)
    config = make_config(additional_config={**ON, "kpool_scores": True})
    built = install.install(config, attentions(1))
    assert built.scores and built.mx_scales
    [(_, line)] = installed()
    assert line.endswith(
        "DSA layers: model.layers.0.self_attn: update (MX scales), DeepGEMM "
        "scores (MX scales), upcast, fused expand + remap."
    ), line


@pytest.mark.parametrize(
    "value, level, says",
    [
        (True, "info", "selects with kpool_select at every batch size"),
        ("one_wave", "warning", "stock's past one wave of rows, which is not"),
        (False, "warning", "top-k is stock's, which is not batch-invariant"),
    ],
)
def test_batch_invariant_mode_says_what_the_top_k_is(
    installed, make_config, monkeypatch, value, level, says
):
    """Under ``VLLM_BATCH_INVARIANT=1`` one line says whether the indexer's
    decode top-k is batch-invariant (the select at every batch size) or
    not (stock's); without it, no such line."""
    import vllm.logger
    from vllm import envs
    from vllm.models.glm5next.nvidia.specialized_decode.runtime import stage

    monkeypatch.setattr(stage, "sm_count", lambda index: 132)
    config = make_config(additional_config={**ON, "kpool_select": value})
    install.install(config, attentions(1))
    assert [m for _, m in installed() if "BATCH_INVARIANT" in m] == []
    sparse_indexer.SPECIALIZED_KPOOL = None
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", True, raising=False)
    vllm.logger._print_info_once.cache_clear()
    vllm.logger._print_warning_once.cache_clear()
    install.install(config, attentions(1))
    [(got, line)] = [(lv, m) for lv, m in installed() if "BATCH_INVARIANT" in m]
    assert got == level and says in line, line


def test_sparse_mla_backends_declare_no_batch_invariance():
    """vLLM 0.33.0's selector refuses a backend without batch invariance
    under ``VLLM_BATCH_INVARIANT=1``; none of GLM-5-Next's three sparse MLA
    backends declares it, so that mode does not start GLM-5-Next there."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for name in (
        "FLASHINFER_MLA_SPARSE",
        "FLASHINFER_MLA_SPARSE_SM90",
        "FLASHMLA_SPARSE",
    ):
        backend = AttentionBackendEnum[name].get_class()
        assert backend.supports_batch_invariance() is False, name


def hisparse(group):
    return HiSparseMLAIndexGroup(**{f: getattr(group, f) for f in group.__dict__})


def changed(**changes):
    def make(group):
        for name, value in changes.items():
            setattr(group, name, value)
        return group

    return make


def without(name):
    """A group of a vLLM whose index groups lack ``name``."""

    def make(group):
        delattr(group, name)
        return group

    return make


@pytest.mark.parametrize(
    "impl, group, why",
    [
        (ItsOwnImpl, None, "ItsOwnImpl converts the logical top-k rows itself"),
        (
            sm120,
            None,
            "FlashInferMLASparseSM120Impl converts the logical top-k rows itself",
        ),
        (dcp, None, "decode context parallel"),
        (None, hisparse, "not a plain SparseMLAIndexGroup"),
        (None, changed(has_indexer=False), "no indexer"),
        (None, changed(num_layers=2), "more than one layer"),
        (None, without("has_indexer"), "no indexer"),
        (None, lambda group: "none", "not a plain SparseMLAIndexGroup"),
    ],
)
def test_install_logs_why_not_fused(installed, make_config, impl, group, why):
    """Fusing is all or none; the stage's other kernels stay on."""
    layers = attentions()
    last = impl_of(layers[-1])
    if group is not None:
        last.index_group = group(last.index_group)
    if impl is not None:
        layers[-1].mla_attn.mla_attn.impl = impl(last.index_group)
    stage = install.install(make_config(), layers)
    assert not stage.fuse and stage.remaps == {}
    assert stage.why_not_fused == [None, why]
    [(_, line)] = installed()
    assert line.endswith(
        f"DSA layers: model.layers.0.self_attn: {not_fused('another layer is not')}; "
        f"model.layers.1.self_attn: {not_fused(why)}."
    )
    for attention in layers:  # nothing was switched on any group or impl
        switched = impl_of(attention)
        assert getattr(switched.index_group, "conversion", None) is None
        assert "convert_decode_through_index_group" not in vars(switched)


def test_install_switches_the_fused_layers(installed, make_config):
    """Each fused layer's group converts through its own ``FusedRemap``
    (``SparseMLAIndexGroup.conversion``), and its impl converts decode-only
    steps through the group (patch 0005's flag, on the instance)."""
    layers = attentions()
    stage = install.install(make_config(), layers)
    assert set(stage.remaps) == {
        f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(2)
    }
    for attention in layers:
        impl = impl_of(attention)
        remap = stage.remaps[str(attention.indexer.k_cache.prefix)]
        assert isinstance(remap, FusedRemap) and impl.index_group.conversion is remap
        assert remap.group is impl.index_group and remap.stage is stage
        assert remap.pending is None
        assert vars(impl)["convert_decode_through_index_group"] is True
    assert SparseMLAIndexGroup.conversion is None
    assert SparseMLACommonImpl.convert_decode_through_index_group is False


def test_install_fuses_an_impl_without_dcp_world_size(installed, make_config):
    """An impl of a vLLM without ``dcp_world_size`` has no decode context
    parallelism: it fuses."""
    layers = attentions()
    for attention in layers:
        del impl_of(attention).dcp_world_size
    stage = install.install(make_config(), layers)
    assert stage.fuse and stage.why_not_fused == [None, None]


def test_install_warms_up_before_planning(installed, make_config, monkeypatch):
    """With a model runner's JIT warmup registry active at model build, the
    stage registers its own instance of each kernel, its warmup holding the
    deployment's self-check mode and seed; the registry's warmup (after the
    KV caches are bound) asks each for ``get_warmup_keys(vllm_config)``,
    compiles them and gives the stage their executors once the last kernel
    with keys compiled."""
    config = make_config()
    config.additional_config["specialized_decode_self_check"] = "off"
    monkeypatch.setenv(SELF_CHECK_SEED_ENV, "77")
    layers = attentions()
    registry = JitWarmupRegistry(config)
    with registry.activate():
        stage = install.install(config, layers)
    assert list(registry._registrations) == list(stage.kernels)
    assert not stage.executors and not stage.planned()
    assert all(kernel.owner is stage for kernel in stage.kernels)
    assert stage.warmup.self_check == "off" and stage.warmup.seed == 77
    registry.warmup()
    keys = [k for kernel in stage.kernels for k in kernel.get_warmup_keys(config)]
    assert set(stage.executors) == set(keys)
    assert {kernel_name(key) for key in stage.executors} == {
        "update",
        "expand",
        "remap",
    }


def test_the_hook_is_what_patch_0002_reads(installed, make_config):
    """``SPECIALIZED_KPOOL`` after an install is a ``KpoolHook``, a stage's
    ``LayerStep`` a ``KpoolLayerStep``, each method with the protocol's
    parameters (the names patch 0002 passes by keyword)."""
    from vllm.models.glm5next.nvidia.specialized_decode.runtime.stage import (
        LayerStep,
    )

    stage = install.install(make_config(), attentions())
    assert isinstance(sparse_indexer.SPECIALIZED_KPOOL, KpoolHook)
    assert isinstance(LayerStep(stage, None), KpoolLayerStep)
    for implemented, declared in (
        (install.StageRegistry.decode_step, KpoolHook.decode_step),
        (LayerStep.update, KpoolLayerStep.update),
        (LayerStep.decode_rows, KpoolLayerStep.decode_rows),
    ):
        got = inspect.signature(implemented).parameters.values()
        want = inspect.signature(declared).parameters.values()
        assert [(p.name, p.kind) for p in got] == [(p.name, p.kind) for p in want]


# --- The registry: one stage per model -----------------------------------------


def test_one_stage_per_buffer(installed, make_config):
    """A second stage on a model's top-k buffer is refused; the registry
    refers to the stages weakly: one leaves it with its model (the layers
    and the stage the model holds)."""
    layers = attentions(1)
    stage = install.install(make_config(), layers)
    stages = install.registry()
    buffer = layers[0].indexer.topk_indices_buffer
    with pytest.raises(RuntimeError, match="already installed on this indexer"):
        stages.add(stage, buffer)
    other = install.install(make_config(), attentions(1))
    assert len(stages.by_buffer) == 2
    del other  # the other model (its layers went with it)
    gc.collect()
    assert dict(stages.by_buffer) == {buffer.data_ptr(): stage}
    del layers, stage
    gc.collect()
    assert dict(stages.by_buffer) == {}


def test_two_engines_keep_their_own_state(installed, bench):
    """Two engines in one process, with the same layer names: the registry
    routes each model's indexer (by its top-k buffer) to its own stage; each
    step defers into its own stage's pool buffer, its own layer's
    ``FusedRemap`` takes the hand-off and converts it, and reads nothing of
    the other's."""
    registry = install.registry()
    steps = dict(
        a=Step([1, 1, 1], [150, 203, 190], seed=70), b=Step([2, 2], [157, 210], seed=71)
    )
    benches = {name: bench(step, registry=registry) for name, step in steps.items()}
    stages = {name: b.stage for name, b in benches.items()}
    buffers = {name: b.engine.buffer.data_ptr() for name, b in benches.items()}
    assert dict(registry.by_buffer) == {buffers[n]: stages[n] for n in stages}
    assert stages["a"].pool_buffer.data_ptr() != stages["b"].pool_buffer.data_ptr()
    read = []
    for stage in stages.values():
        for key, spy in list(stage.executors.items()):
            if kernel_name(key) == "remap":
                stage.executors[key] = lambda *args, spy=spy: (
                    read.append(args) or spy(*args)
                )
    for name, other in (("a", "b"), ("b", "a")):
        stages[other].pool_buffer.fill_(-9)
        read.clear()
        b = benches[name]
        got = b.run()
        assert b.routes == ["kernel:update", "stock:upcast", "defer", "kernel:remap"]
        [args] = read
        assert args[0].data_ptr() == stages[name].pool_buffer.data_ptr()
        assert args[4].data_ptr() == b.engine.groups[0].physical_topk_indices.data_ptr()
        assert (stages[other].pool_buffer == -9).all(), f"{name} wrote {other}'s"
        assert_same(b.stock(), got, b.fwd)
