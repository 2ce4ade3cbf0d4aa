# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``specialized_decode/__init__.py``: its configuration, requirement checks,
``planned()`` and the installation at model build (CPU)."""

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kpool_harness import fake_gpu, make_config  # noqa: E402

from vllm.config import CompilationMode, CUDAGraphMode  # noqa: E402
from vllm.forward_context import ForwardContext, override_forward_context  # noqa: E402
from vllm.model_executor.layers.attention.sparse_mla_attention import (  # noqa: E402
    SparseMLACommonImpl,
)
from vllm.models.glm5next.nvidia import specialized_decode as sd  # noqa: E402
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import (  # noqa: E402
    FlashInferMLASparseSM90Impl,
)

REPO = Path(__file__).resolve().parents[3]
INIT = REPO / "vllm/models/glm5next/nvidia/specialized_decode/__init__.py"
ALL_REQUIREMENTS = 8


@pytest.fixture
def gpu(monkeypatch):
    """The current platform as a CUDA GPU of a chosen capability."""

    def use(capability: int | None):
        fake_gpu(monkeypatch, capability)

    use(90)
    return use


def test_importable_with_logger_only():
    """The kernel-only environment provides torch and ``vllm.logger``."""
    script = textwrap.dedent(f"""
        import importlib.util, logging, sys, types
        vllm = types.ModuleType("vllm")
        vllm.__path__ = []
        log = types.ModuleType("vllm.logger")
        log.init_logger = logging.getLogger
        sys.modules.update({{"vllm": vllm, "vllm.logger": log}})
        spec = importlib.util.spec_from_file_location("sd", {str(INIT)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.STAGES == ("dsa_kpool",)
        assert not module.planned()
        loaded = sorted(m for m in sys.modules if m.startswith("vllm"))
        assert loaded == ["vllm", "vllm.logger"], loaded
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


@pytest.mark.parametrize(
    "extra", [None, {}, {"decode_backend": "auto"}, {"specialized_decode_skip": []}]
)
def test_auto_is_stock(gpu, extra):
    gpu(None)  # nothing is checked
    assert sd.specialized_decode_config(make_config(additional_config=extra)) is None


def test_supported_deployment(gpu):
    config = sd.specialized_decode_config(make_config())
    assert config == sd.DecodeConfig(stages=("dsa_kpool",))
    gpu(100)
    assert sd.unsupported(make_config()) == []
    gpu(103)
    assert sd.unsupported(make_config()) == []


@pytest.mark.parametrize(
    "bad",
    [
        {"decode_backend": "fast"},
        {"decode_backend": "latency_specialized", "specialized_decode_skip": "x"},
        {"decode_backend": "latency_specialized", "specialized_decode_skip": ["x"]},
    ],
)
def test_bad_settings(gpu, bad):
    with pytest.raises(ValueError, match="decode_backend|specialized_decode_skip"):
        sd.specialized_decode_config(make_config(additional_config=bad))


def test_left_out_stage_needs_nothing(gpu):
    gpu(None)
    extra = {
        "decode_backend": "latency_specialized",
        "specialized_decode_skip": ["dsa_kpool"],
    }
    config = sd.specialized_decode_config(make_config(additional_config=extra))
    assert config == sd.DecodeConfig(stages=())
    assert hash(config) == hash(sd.DecodeConfig(stages=()))  # a frozen value


@pytest.mark.parametrize(
    "overrides, needs",
    [
        ({}, None),
        (dict(model_config__architectures=["DeepseekV32ForCausalLM"]), "GLM-5-Next"),
        (dict(model_config__index_kpool=2), "index_kpool 2"),
        (dict(model_config__index_head_dim=64), "index_head_dim 64"),
        (dict(model_config__index_topk=None), "index_topk None"),
        (dict(parallel_config__decode_context_parallel_size=2), "context par"),
        (dict(parallel_config__use_ubatching=True), "micro-batching"),
        (dict(compilation_config__mode=CompilationMode.VLLM_COMPILE), "compile"),
        (dict(compilation_config__cudagraph_mode=CUDAGraphMode.FULL), "mixed"),
        (dict(compilation_config__cudagraph_mode=CUDAGraphMode.PIECEWISE), None),
        (dict(compilation_config__cudagraph_mode=CUDAGraphMode.NONE), None),
        (dict(kernel_config__enable_jit_warmup=False), "JIT"),
    ],
)
def test_each_requirement(gpu, overrides, needs):
    missing = sd.unsupported(make_config(**overrides))
    assert len(missing) == (needs is not None)
    assert needs is None or needs in missing[0]


@pytest.mark.parametrize("capability", [None, 80, 89, 120])
def test_gpu_requirement(gpu, capability):
    gpu(capability)
    missing = sd.unsupported(make_config())
    assert len(missing) == 1 and "SM90" in missing[0] and "SM100" in missing[0]


def test_one_error_lists_every_requirement(gpu):
    gpu(80)
    config = make_config(
        model_config__architectures=["LlamaForCausalLM"],
        model_config__index_topk=None,
        parallel_config__decode_context_parallel_size=2,
        parallel_config__use_ubatching=True,
        compilation_config__mode=CompilationMode.VLLM_COMPILE,
        compilation_config__cudagraph_mode=CUDAGraphMode.FULL,
        kernel_config__enable_jit_warmup=False,
    )
    missing = sd.unsupported(config)
    assert len(missing) == ALL_REQUIREMENTS
    with pytest.raises(ValueError) as error:
        sd.specialized_decode_config(config)
    message = str(error.value)
    assert message.startswith("decode_backend=latency_specialized needs ")
    assert all(need in message for need in missing)
    assert "specialized_decode_skip=['dsa_kpool']" in message


@pytest.mark.parametrize(
    "seqs, spec, tokens, rows",
    [(64, 3, 8192, 256), (64, None, 8192, 64), (64, 3, 128, 128), (8, 1, 8192, 16)],
)
def test_decode_capacity(seqs, spec, tokens, rows):
    config = make_config(
        scheduler_config__max_num_seqs=seqs,
        scheduler_config__max_num_batched_tokens=tokens,
    )
    if spec is None:
        config.speculative_config = None
    else:
        config.speculative_config.num_speculative_tokens = spec
    assert sd.decode_capacity(config) == rows


# --- planned() -------------------------------------------------------------


def metadata(prefills=0, decode_tokens=4):
    return SimpleNamespace(
        num_prefills=prefills,
        num_decodes=min(decode_tokens, 1),
        num_decode_tokens=decode_tokens,
    )


def context(attn_metadata, mode=CUDAGraphMode.NONE, dummy_run=False):
    return ForwardContext(
        no_compile_layers={},
        attn_metadata=attn_metadata,
        slot_mapping={},
        cudagraph_runtime_mode=mode,
        dummy_run=dummy_run,
    )


@pytest.fixture
def plan(monkeypatch):
    plan = sd._Plan(max_rows=8, layer="a", warmed=True)
    monkeypatch.setattr(sd, "_plan", plan)
    return plan


def planned_in(ctx) -> bool:
    with override_forward_context(ctx):
        return sd.planned()


@pytest.mark.parametrize(
    "mode", [CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL]
)
def test_planned_decode_steps(plan, mode):
    """Decode-only within the rows: at eager steps, at captures and at the
    breakable graphs' eager replays alike (mode plays no part)."""
    shared = metadata(decode_tokens=8)
    attn = {"a": shared, "b": shared, "tail": metadata(decode_tokens=8)}
    assert planned_in(context(attn, mode))
    # Metadata without a prefill/decode split does not count, wherever it is.
    attn["storage"] = SimpleNamespace()
    assert planned_in(context(attn, mode))
    first = {"storage": SimpleNamespace(), "a": metadata(decode_tokens=8)}
    assert planned_in(context(first, mode))
    first["b"] = metadata(prefills=1)
    assert not planned_in(context(first, mode))


def test_ignored_layers(plan):
    """The storage-only tail caches (``plan.ignored``) split a speculative
    decode step as prefills: their metadata is not read."""
    attn = {"a": metadata(), "tail": metadata(prefills=2)}
    assert not planned_in(context(attn))
    plan.ignored = frozenset({"tail"})
    assert planned_in(context(dict(attn)))


@pytest.mark.parametrize(
    "attn, dummy",
    [
        pytest.param(None, False, id="profiling"),
        pytest.param([{"a": metadata()}], False, id="micro-batches"),
        pytest.param({}, False, id="no-layers"),
        pytest.param({"mtp": metadata()}, False, id="another-model"),
        pytest.param({"a": metadata()}, True, id="dummy"),
        pytest.param({"a": metadata(), "b": metadata(prefills=1)}, False, id="mixed"),
        pytest.param({"a": metadata(prefills=2, decode_tokens=0)}, False, id="prefill"),
        pytest.param({"a": metadata(decode_tokens=9)}, False, id="above-rows"),
        pytest.param({"a": metadata(decode_tokens=0)}, False, id="no-decodes"),
    ],
)
def test_unplanned_passes(plan, attn, dummy):
    assert not planned_in(context(attn, dummy_run=dummy))


def test_planned_needs_a_warm_installed_stage(monkeypatch, plan):
    ctx = context({"a": metadata()})
    assert planned_in(ctx)
    assert not sd.planned()  # no forward context
    monkeypatch.setattr(sd, "_plan", sd._Plan(max_rows=8, layer="a"))
    assert not planned_in(ctx)
    monkeypatch.setattr(sd, "_plan", None)
    assert not planned_in(ctx)


def test_planned_once_per_forward(plan):
    """Every layer of a forward gets the first answer (host state read once);
    the next forward's context is read anew."""
    attn = {"a": metadata()}
    ctx = context(attn)
    with override_forward_context(ctx):
        assert sd.planned()
        attn["a"] = metadata(prefills=1)
        assert sd.planned()
    assert not planned_in(context(attn))


# --- install() -------------------------------------------------------------


class Recorder:
    def __init__(self):
        self.lines: list[tuple[str, str]] = []

    def info(self, fmt, *args):
        self.lines.append(("info", fmt % args))

    def warning(self, fmt, *args):
        self.lines.append(("warning", fmt % args))


@pytest.fixture
def installed(monkeypatch, gpu):
    """install() with a recorded log, SPECIALIZED_KPOOL and the plan restored."""
    pytest.importorskip("cutlass")
    from vllm.models.glm5next.nvidia import sparse_indexer

    monkeypatch.setattr(sparse_indexer, "SPECIALIZED_KPOOL", None)
    monkeypatch.setattr(sd, "_plan", None)
    log = Recorder()
    monkeypatch.setattr(sd, "logger", log)
    return SimpleNamespace(log=log, sparse_indexer=sparse_indexer)


def attentions(count=2, *, group=None, **impl):
    """``count`` DSA layers; ``impl`` (and ``group``) override the last one's
    impl attributes (and index group)."""
    from kpool_harness import FakeImpl, Step, make_attention, make_group, make_inputs

    inputs = make_inputs(Step([1], [150]))
    buffer = inputs.args["topk_indices_buffer"]
    layers = []
    for i in range(count):
        last = i == count - 1
        index_group = group if last and group is not None else make_group(buffer, 8, [])
        impl_class = impl.pop("impl_class", FakeImpl) if last else FakeImpl
        attributes = dict(
            index_group=index_group,
            group_conversion_decode_only=False,
            dcp_world_size=1,
        )
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


FUSED = (
    "update (FP32 scales), no upcast (FP32 logits, stock returns them), "
    "fused expand + remap"
)


def not_fused(why):
    return (
        "update (FP32 scales), no upcast (FP32 logits, stock returns them), "
        f"expand, stock conversion ({why})"
    )


def test_install_auto_is_stock(installed):
    assert sd.install(make_config(additional_config={}), attentions()) is None
    assert installed.sparse_indexer.SPECIALIZED_KPOOL is None
    assert sd._plan is None and installed.log.lines == []


def test_install_left_out(installed):
    extra = {
        "decode_backend": "latency_specialized",
        "specialized_decode_skip": ["dsa_kpool"],
    }
    assert sd.install(make_config(additional_config=extra), attentions()) is None
    assert installed.sparse_indexer.SPECIALIZED_KPOOL is None
    assert installed.log.lines == [
        ("info", "GLM-5-Next specialized decode: dsa_kpool off (left out).")
    ]


def test_install_without_dsa_layers(installed):
    assert sd.install(make_config(), []) is None
    assert installed.sparse_indexer.SPECIALIZED_KPOOL is None and sd._plan is None
    assert installed.log.lines == [
        ("info", "GLM-5-Next specialized decode: dsa_kpool off (no DSA layers).")
    ]


def test_install_unsupported_raises(installed, gpu):
    gpu(None)
    with pytest.raises(ValueError, match="SM90"):
        sd.install(make_config(), attentions())
    assert installed.sparse_indexer.SPECIALIZED_KPOOL is None


def test_install_without_warmup_registry(installed):
    """Outside a model runner nothing compiles the kernels: the stage is set
    but never plans a step, and the log says so."""
    stage = sd.install(make_config(), attentions())
    assert installed.sparse_indexer.SPECIALIZED_KPOOL is stage
    assert stage.fuse and stage.max_rows == 256
    assert not sd._plan.warmed
    assert sd._plan == sd._Plan(
        max_rows=256,
        layer="model.layers.0.self_attn.indexer.k_cache",
        # The storage-only tail caches' metadata does not describe the step.
        ignored=frozenset({"model.layers.0.self_attn.indexer.tail_cache"}),
    )
    [(level, line)] = installed.log.lines
    assert level == "warning"
    assert line == (
        "GLM-5-Next specialized decode: dsa_kpool off: no JIT warmup registry "
        "compiles its kernels, for decode-only steps of up to 256 rows; attention "
        f"backend FakeImpl; DSA layers: model.layers.0.self_attn: {FUSED}; "
        f"model.layers.1.self_attn: {FUSED}."
    )


def test_install_without_cuda_registers_nothing(installed, monkeypatch):
    """A platform that is not CUDA registers no warmup (the requirements are
    checked first; here they are faked as met)."""
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
    from vllm.platforms import current_platform

    monkeypatch.setattr(sd, "unsupported", lambda config: [])
    config = make_config()
    registry = JitWarmupRegistry(config)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    with registry.activate():
        stage = sd.install(config, attentions())
    assert stage is not None and len(registry) == 0
    assert installed.log.lines[0][0] == "warning"


def test_install_on_sm100_logs_mx_scales(installed, monkeypatch):
    from kpool_harness import use_mx_scales

    use_mx_scales(monkeypatch, True)
    sd.install(make_config(), attentions(1))
    [(_, line)] = installed.log.lines
    assert line.endswith(
        "DSA layers: model.layers.0.self_attn: update (MX scales), upcast, "
        "fused expand + remap."
    )


def _hisparse_group():
    from kpool_harness import make_group

    from vllm.v1.attention.backends.mla.index_group import HiSparseMLAIndexGroup

    plain = make_group(torch.zeros(4, 256, dtype=torch.int32), 8, [])
    return HiSparseMLAIndexGroup(**{f: getattr(plain, f) for f in plain.__dict__})


def _group(**changes):
    from kpool_harness import make_group

    group = make_group(torch.zeros(4, 256, dtype=torch.int32), 8, [])
    for name, value in changes.items():
        setattr(group, name, value)
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
        (dict(group=lambda: _group(has_indexer=False)), "no indexer"),
        (dict(group=lambda: _group(num_layers=2)), "more than one layer"),
        (dict(group=lambda: "none"), "not a plain SparseMLAIndexGroup"),
    ],
)
def test_install_logs_why_not_fused(installed, layer, why):
    """Fusing is all or none; the stage's other kernels stay on."""
    if "group" in layer:
        layer = dict(layer, group=layer["group"]())
    layers = attentions(**layer)
    stage = sd.install(make_config(), layers)
    assert not stage.fuse and not stage.layers
    assert stage.why_not_fused == [None, why]
    assert installed.sparse_indexer.SPECIALIZED_KPOOL is stage
    [(_, line)] = installed.log.lines
    assert line.endswith(
        "DSA layers: model.layers.0.self_attn: "
        f"{not_fused('another layer is not')}; "
        f"model.layers.1.self_attn: {not_fused(why)}."
    )
    # Nothing was installed on any group or impl.
    from vllm.models.glm5next.nvidia.specialized_decode.kpool import FusedRemap

    for attention in layers:
        impl = attention.mla_attn.mla_attn.impl
        convert = getattr(impl.index_group, "_convert_once", None)
        assert not isinstance(convert, FusedRemap)
        assert "convert_decode_through_index_group" not in vars(impl)


def test_install_warms_up_before_planning(monkeypatch, installed):
    """With the runner's JIT warmup registry active at model build, the stage
    compiles at the registry's warmup (after the KV caches are bound), for
    the runner's int64 positions, then starts planning steps."""
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
    from vllm.models.glm5next.nvidia.specialized_decode import kpool

    calls = []
    monkeypatch.setattr(
        kpool.KpoolStage,
        "warmup",
        lambda self, *args, **kwargs: calls.append((self, args, kwargs)),
    )
    config = make_config()
    config.additional_config[sd.SELF_CHECK_KEY] = "off"
    layers = attentions()
    registry = JitWarmupRegistry(config)
    with registry.activate():
        stage = sd.install(config, layers)
    assert installed.log.lines[0][0] == "info"
    assert "dsa_kpool on, compiled at JIT warmup" in installed.log.lines[0][1]
    assert len(registry) == 1 and not calls and not sd._plan.warmed
    registry.warmup()
    assert calls == [(stage, (layers,), dict(positions_dtype=torch.int64))]
    assert sd._plan.warmed
    assert sd.POSITIONS_DTYPE is torch.int64


def test_warmup_entry(monkeypatch):
    """The registry protocol of the stage's warmup entry: one key, the rows."""
    plan = sd._Plan(max_rows=12, layer="a")
    calls = []
    stage = SimpleNamespace(warmup=lambda *a, **k: calls.append((a, k)))
    entry = sd._KpoolWarmup(stage, ("x",), plan, "off")
    assert entry.get_warmup_keys() == [("dsa_kpool", 12)]
    entry.compile_many(entry.get_warmup_keys() * 2)
    assert calls == [((["x"],), dict(positions_dtype=torch.int64))] * 2
    assert plan.warmed


@pytest.mark.parametrize(
    "mode, problem, warmed, level",
    [
        ("on", None, True, "info"),
        ("on", "upcast_logits case 3", False, "error"),
        ("strict", None, True, "info"),
        ("strict", "upcast_logits case 3", None, None),
    ],
)
def test_warmup_self_check(monkeypatch, mode, problem, warmed, level):
    """The self-check after the compiles (its kernels run on the GPU only;
    here its answer is given): a failure keeps the stage off, or raises."""
    from vllm.models.glm5next.nvidia.specialized_decode import self_check

    seen = []
    monkeypatch.setattr(
        self_check, "check", lambda keys, seed, device: seen.append(seed) or problem
    )
    monkeypatch.setenv(sd.SELF_CHECK_SEED_ENV, "77")
    monkeypatch.setattr(sd.secrets, "randbits", lambda bits: 1 / 0)
    clock = iter([3.0, 7.5])
    monkeypatch.setattr(sd.time, "perf_counter", lambda: next(clock))
    log = Recorder()
    log.error = lambda fmt, *args: log.lines.append(("error", fmt % args))
    monkeypatch.setattr(sd, "logger", log)
    plan = sd._Plan(max_rows=12, layer="a")
    stage = SimpleNamespace(
        warmup=lambda *a, **k: ["k1", "k2"], pool_buffer=torch.zeros(1)
    )
    entry = sd._KpoolWarmup(stage, (), plan, mode)
    if warmed is None:
        with pytest.raises(RuntimeError, match="self-check failed, upcast_logits"):
            entry.compile_many([("dsa_kpool", 12)])
        assert not plan.warmed
        return
    entry.compile_many([("dsa_kpool", 12)])
    assert plan.warmed is warmed and seen == [77]
    [(logged, line)] = log.lines
    assert logged == level
    if problem:
        assert line == (
            "GLM-5-Next specialized decode: self-check failed, upcast_logits case "
            "3; dsa_kpool stays off and the decode runs stock (replay with "
            f"{sd.SELF_CHECK_SEED_ENV}=77)."
        )
    else:
        assert line.startswith(
            "GLM-5-Next specialized decode: self-check passed: 2 kernel variants x "
        )
        assert line.endswith(", seed 77, 4.50 s.")


def test_self_check_seed(monkeypatch):
    """Without a seed to replay, a fresh 31-bit one, printed on failure."""
    from vllm.models.glm5next.nvidia.specialized_decode import self_check

    seeds, bits = [], []
    monkeypatch.setattr(
        self_check, "check", lambda keys, seed, device: seeds.append(seed) or "bad"
    )
    monkeypatch.delenv(sd.SELF_CHECK_SEED_ENV, raising=False)
    monkeypatch.setattr(sd.secrets, "randbits", lambda n: bits.append(n) or 12345)
    log = Recorder()
    log.error = lambda fmt, *args: log.lines.append(("error", fmt % args))
    monkeypatch.setattr(sd, "logger", log)
    stage = SimpleNamespace(warmup=lambda *a, **k: [], pool_buffer=torch.zeros(1))
    plan = sd._Plan(max_rows=1, layer="a")
    sd._KpoolWarmup(stage, (), plan).compile(("dsa_kpool", 1))
    assert bits == [31] and seeds == [12345] and not plan.warmed
    assert log.lines[0][1].endswith(f"(replay with {sd.SELF_CHECK_SEED_ENV}=12345).")


@pytest.mark.parametrize("mode", ["on", "off", "strict"])
def test_self_check_setting(monkeypatch, gpu, mode):
    extra = {"decode_backend": "latency_specialized", sd.SELF_CHECK_KEY: mode}
    config = sd.specialized_decode_config(make_config(additional_config=extra))
    assert config.self_check == mode
    monkeypatch.setenv(sd.SELF_CHECK_ENV, "off")
    config = sd.specialized_decode_config(make_config(additional_config=extra))
    assert config.self_check == "off"
    monkeypatch.setenv(sd.SELF_CHECK_ENV, "sometimes")
    with pytest.raises(ValueError, match="takes one of"):
        sd.specialized_decode_config(make_config(additional_config=extra))
