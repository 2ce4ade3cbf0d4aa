# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``install.py``: the stage installed at model build (what it switches on,
what it logs) and the process's registry of stages, which gives each engine
its own (CPU)."""

import gc
from functools import partial

import pytest
import torch
from kpool_harness import (
    LAYER,
    FakeImpl,
    Step,
    assert_same,
    make_attention,
    make_config,
    make_group,
    make_inputs,
    stock_run,
)

from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
)
from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
from vllm.models.glm5next.nvidia import sparse_indexer
from vllm.models.glm5next.nvidia.specialized_decode import install
from vllm.models.glm5next.nvidia.specialized_decode.fused_remap import FusedRemap
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import (
    FlashInferMLASparseSM90Impl,
)
from vllm.v1.attention.backends.mla.index_group import HiSparseMLAIndexGroup

ON = {"decode_backend": "latency_specialized"}
DEFERRED = ["kernel:update", "stock:upcast", "defer", "kernel:remap"]


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


def attentions(count=2, *, group=None, **impl):
    """``count`` DSA layers of one model (one top-k buffer); ``impl`` (and
    ``group``) override the last one's impl attributes (and index group)."""
    inputs = make_inputs(Step([1], [150]))
    layers = []
    for i in range(count):
        last = i == count - 1
        index_group = group if last and group is not None else None
        index_group = index_group or make_group(inputs.buffer, 8, [])
        impl_class = impl.pop("impl_class", FakeImpl) if last else FakeImpl
        attributes = dict(index_group=index_group, dcp_world_size=1)
        attributes.update(impl if last else {})
        layers.append(
            make_attention(
                index_group,
                inputs,
                impl=impl_class(**attributes),
                prefix=f"model.layers.{i}.self_attn.indexer.k_cache",
            )
        )
    return layers


class SM90FlashInferImpl:
    """A backend whose own decode converts the logical top-k rows itself (as
    FlashInfer SM90's without patch 0005's flag)."""

    forward_mqa = FlashInferMLASparseSM90Impl.forward_mqa

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


class UnpatchedImpl:
    """The common sparse MLA decode without patch 0005's flag (a base the
    stage cannot switch to converting decode steps through the group)."""

    forward_mqa = SparseMLACommonImpl.forward_mqa

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


UPDATE_UPCAST = "update (FP32 scales), no upcast (FP32 logits, stock returns them), "
FUSED = f"{UPDATE_UPCAST}fused expand + remap"


def not_fused(why):
    return f"{UPDATE_UPCAST}expand, stock conversion ({why})"


def test_install_auto_is_stock(installed):
    assert install.install(make_config(additional_config={}), attentions()) is None
    assert sparse_indexer.SPECIALIZED_KPOOL is None
    assert installed() == []


def test_install_left_out(installed):
    extra = {**ON, "specialized_decode_skip": ["dsa_kpool"]}
    assert install.install(make_config(additional_config=extra), attentions()) is None
    assert sparse_indexer.SPECIALIZED_KPOOL is None
    assert installed() == [
        ("info", "GLM-5-Next specialized decode: dsa_kpool off (left out).")
    ]


def test_install_without_dsa_layers(installed):
    assert install.install(make_config(), []) is None
    assert sparse_indexer.SPECIALIZED_KPOOL is None
    assert installed() == [
        ("info", "GLM-5-Next specialized decode: dsa_kpool off (no DSA layers).")
    ]


def test_install_unsupported_raises(installed, fake_gpu):
    fake_gpu(None)
    with pytest.raises(ValueError, match="SM90"):
        install.install(make_config(), attentions())
    assert sparse_indexer.SPECIALIZED_KPOOL is None


def test_install_without_warmup_registry(installed):
    """Outside a model runner nothing compiles the kernels: the stage is
    registered but never plans a step, and the log says so."""
    layers = attentions()
    stage = install.install(make_config(), layers)
    buffer = layers[0].indexer.topk_indices_buffer
    assert dict(install.registry().by_buffer) == {buffer.data_ptr(): stage}
    assert stage.fuse and stage.max_rows == 256 and not stage.warmed
    assert (stage.steps.layer, stage.steps.max_rows) == (LAYER, 256)
    # The storage-only tail caches' metadata does not describe the step.
    assert stage.steps.ignored == {"model.layers.0.self_attn.indexer.tail_cache"}
    assert installed() == [
        (
            "warning",
            (
                "GLM-5-Next specialized decode: dsa_kpool off: no JIT warmup registry "
                "compiles its kernels, for decode-only steps of up to 256 rows; "
                "attention backend FakeImpl; DSA layers: model.layers.0.self_attn: "
                f"{FUSED}; model.layers.1.self_attn: {FUSED}."
            ),
        )
    ]


def test_install_without_cuda_registers_nothing(installed, monkeypatch):
    """A platform that is not CUDA registers no warmup (the requirements are
    checked first; here they are faked as met)."""
    from vllm.models.glm5next.nvidia.specialized_decode import config
    from vllm.platforms import current_platform

    monkeypatch.setattr(config, "unsupported", lambda vllm_config: [])
    registry = JitWarmupRegistry(make_config())
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    with registry.activate():
        stage = install.install(make_config(), attentions())
    assert stage is not None and len(registry) == 0
    assert [level for level, _ in installed()] == ["warning"]


def test_install_on_sm100_logs_mx_scales(installed, mx_scales):
    mx_scales(True)
    install.install(make_config(), attentions(1))
    [(_, line)] = installed()
    assert line.endswith(
        "DSA layers: model.layers.0.self_attn: update (MX scales), upcast, "
        "fused expand + remap."
    )


def _hisparse_group():
    plain = make_group(torch.zeros(4, 256, dtype=torch.int32), 8, [])
    return HiSparseMLAIndexGroup(**{f: getattr(plain, f) for f in plain.__dict__})


def _group(**changes):
    group = make_group(torch.zeros(4, 256, dtype=torch.int32), 8, [])
    for name, value in changes.items():
        setattr(group, name, value)
    return group


def _group_without(name):
    """A group of a vLLM whose index groups lack ``name``."""
    group = _group()
    delattr(group, name)
    return group


@pytest.mark.parametrize(
    "layer, why",
    [
        (
            dict(impl_class=UnpatchedImpl),
            "UnpatchedImpl converts the logical top-k rows itself",
        ),
        (dict(dcp_world_size=2), "decode context parallel"),
        (
            dict(impl_class=SM90FlashInferImpl),
            "SM90FlashInferImpl converts the logical top-k rows itself",
        ),
        (dict(group=_hisparse_group), "not a plain SparseMLAIndexGroup"),
        (dict(group=partial(_group, has_indexer=False)), "no indexer"),
        (dict(group=partial(_group, num_layers=2)), "more than one layer"),
        (dict(group=partial(_group_without, "has_indexer")), "no indexer"),
        (dict(group=lambda: "none"), "not a plain SparseMLAIndexGroup"),
    ],
)
def test_install_logs_why_not_fused(installed, layer, why):
    """Fusing is all or none; the stage's other kernels stay on."""
    if "group" in layer:
        layer = dict(layer, group=layer["group"]())
    layers = attentions(**layer)
    stage = install.install(make_config(), layers)
    assert not stage.fuse and stage.remaps == {}
    assert stage.why_not_fused == [None, why]
    [(_, line)] = installed()
    assert line.endswith(
        "DSA layers: model.layers.0.self_attn: "
        f"{not_fused('another layer is not')}; "
        f"model.layers.1.self_attn: {not_fused(why)}."
    )
    # Nothing was switched on any group or impl.
    for attention in layers:
        impl = attention.mla_attn.mla_attn.impl
        convert = getattr(impl.index_group, "_convert_once", None)
        assert not isinstance(convert, FusedRemap)
        assert "convert_decode_through_index_group" not in vars(impl)


def test_install_switches_the_fused_layers(installed):
    """Each fused layer's group converts through its own FusedRemap, and
    its impl converts decode-only steps through the group (stage.py's
    switches 2 and 3)."""
    layers = attentions()
    stage = install.install(make_config(), layers)
    assert set(stage.remaps) == {
        f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(2)
    }
    for attention in layers:
        impl = attention.mla_attn.mla_attn.impl
        remap = stage.remaps[str(attention.indexer.k_cache.prefix)]
        assert impl.index_group._convert_once is remap and remap.stage is stage
        assert remap.group is impl.index_group and remap.pending is None
        assert vars(impl)["convert_decode_through_index_group"] is True


def test_install_fuses_an_impl_without_dcp_world_size(installed):
    """An impl of a vLLM without ``dcp_world_size`` has no decode context
    parallelism: it fuses."""
    layers = attentions()
    for attention in layers:
        del attention.mla_attn.mla_attn.impl.dcp_world_size
    stage = install.install(make_config(), layers)
    assert stage.fuse and stage.why_not_fused == [None, None]


def test_install_warms_up_before_planning(installed, spies):
    """With the runner's JIT warmup registry active at model build, the stage
    compiles at the registry's warmup (after the KV caches are bound), then
    starts planning steps."""
    from vllm.models.glm5next.nvidia.specialized_decode import warmup

    config = make_config()
    config.additional_config["specialized_decode_self_check"] = "off"
    layers = attentions()
    registry = JitWarmupRegistry(config)
    with registry.activate():
        stage = install.install(config, layers)
    [(level, line)] = installed()
    assert level == "info" and "dsa_kpool on, compiled at JIT warmup" in line
    assert len(registry) == 1 and not stage.warmed
    assert spies.compiled == {name: set() for name in spies.compiled}
    registry.warmup()
    assert stage.warmed
    derived = {key for _, key in warmup.warmup_keys(stage, layers)}
    assert set().union(*spies.compiled.values()) == derived


# --- The registry: one stage per model -------------------------------------


def test_one_stage_per_buffer(installed):
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


def test_two_engines_keep_their_own_state(installed, engine, spies, stock_module):
    """Two engines in one process, with the same layer names: the registry
    routes each model's indexer (by its top-k buffer) to its own stage; each
    step defers into its own stage's pool buffer, its own layer's FusedRemap
    takes the hand-off and converts it, and reads nothing of the other's."""
    inputs = {
        "a": make_inputs(Step([1, 1, 1], [150, 203, 190], seed=70)),
        "b": make_inputs(Step([2, 2], [157, 210], seed=71)),
    }
    engines = {name: engine(inputs[name]) for name in inputs}
    stages = {name: e.stage for name, e in engines.items()}
    assert dict(install.registry().by_buffer) == {
        inputs[n].buffer.data_ptr(): stages[n] for n in inputs
    }
    assert stages["a"].pool_buffer.data_ptr() != stages["b"].pool_buffer.data_ptr()
    handed, read = [], []
    for name, stage in stages.items():
        remap = stage.remaps[LAYER]
        remap.hand_over = _recorded(handed, name, remap.hand_over)
    spies.twins["remap"] = _recorded(read, None, spies.twins["remap"])
    for name, other in (("a", "b"), ("b", "a")):
        stages[other].pool_buffer.fill_(-9)
        handed.clear(), read.clear()
        got = engines[name].run(inputs[name])
        assert got.routes == DEFERRED
        assert handed == [name]
        [args] = read
        assert args.pool_ids.data_ptr() == stages[name].pool_buffer.data_ptr()
        physical = engines[name].group.physical_topk_indices
        assert args.out.data_ptr() == physical.data_ptr()
        assert (stages[other].pool_buffer == -9).all(), f"{name} wrote {other}'s"
        assert_same(got, stock_run(stock_module, inputs[name]), logical=False)


def _recorded(log, entry, fn):
    """``fn`` of one argument, logging ``entry`` (None: the argument)."""

    def wrapper(argument):
        log.append(argument if entry is None else entry)
        return fn(argument)

    return wrapper
