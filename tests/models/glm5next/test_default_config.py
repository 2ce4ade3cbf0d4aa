# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stage's requirement check on the ``VllmConfig`` that vLLM 0.33.0's own
code builds for GLM-5-Next (``EngineArgs.create_engine_config``, as ``vllm
serve`` does), on a platform that answers as an SM90 or SM100 GPU: the plain
command meets every requirement, with compilation mode NONE and breakable
FULL_AND_PIECEWISE CUDA graphs; ``-O0`` meets them too but turns the CUDA
graphs off; ``VLLM_USE_BREAKABLE_CUDAGRAPH=0`` brings torch.compile, which
the check names (CPU: the model's ``config.json`` only, no weights)."""

import copy
import json
import os

import pytest

from vllm.config import CompilationMode, CUDAGraphMode
from vllm.config.vllm import DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES
from vllm.engine.arg_utils import EngineArgs
from vllm.models.glm5next.nvidia.specialized_decode import config as sd
from vllm.models.glm5next.nvidia.specialized_decode.constants import (
    ARCHITECTURES,
    DIM,
    POOL,
)
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability, PlatformEnum

ON = {"decode_backend": "latency_specialized"}
BREAKABLE = "VLLM_USE_BREAKABLE_CUDAGRAPH"
# GLM-5-Next's config.json, as transformers' defaults give the rest; only the
# indexer's pool size is not transformers' default.
TEXT = {"index_kpool": POOL, "index_head_dim": DIM}
CHECKPOINTS = {
    "Glm5NextForCausalLM": {"model_type": "glm5_next_text", **TEXT},
    "Glm5NextForConditionalGeneration": {
        "model_type": "glm5_next",
        "text_config": TEXT,
    },
}
COMPILE = (
    "no torch.compile of the model (compilation_config mode NONE: vLLM's default "
    "for GLM-5-Next, with breakable CUDA graphs, unless "
    "VLLM_USE_BREAKABLE_CUDAGRAPH=0; else -cc.mode=none; found VLLM_COMPILE)"
)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model_config(request, tmp_path_factory):
    """vLLM's ``ModelConfig`` of a GLM-5-Next checkpoint's ``config.json``,
    built on this machine's own platform (vLLM inspects the model class)."""
    path = tmp_path_factory.mktemp(request.param)
    config = {"architectures": [request.param], **CHECKPOINTS[request.param]}
    (path / "config.json").write_text(json.dumps(config))
    return EngineArgs(model=str(path), skip_tokenizer_init=True).create_model_config()


@pytest.fixture(params=[90, 100])
def engine_config(request, model_config, fake_gpu, monkeypatch):
    """``engine_config(**engine_args)``: the ``VllmConfig`` that
    ``create_engine_config`` builds for the checkpoint with those arguments,
    the backend on, the platform answering as a CUDA GPU of the parameter's
    compute capability. vLLM's writes to the environment stay in a copy."""
    fake_gpu(request.param)
    capability = DeviceCapability(*divmod(request.param, 10))
    for name, value in (
        ("_enum", PlatformEnum.CUDA),
        ("device_type", "cuda"),
        ("dispatch_key", "CUDA"),
        ("get_device_capability", lambda device_id=0: capability),
        ("support_static_graph_mode", lambda: True),
        ("support_hybrid_kv_cache", lambda: True),
    ):
        monkeypatch.setattr(current_platform, name, value)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    os.environ.pop(BREAKABLE, None)
    for name in (sd.SELF_CHECK_ENV, sd.SELF_CHECK_SEED_ENV):
        os.environ.pop(name, None)

    def build(**engine_args):
        args = EngineArgs(model=model_config.model, additional_config=ON, **engine_args)
        model = copy.deepcopy(model_config)  # the engine config changes it
        model.enforce_eager = args.enforce_eager
        monkeypatch.setattr(args, "create_model_config", lambda: model)
        return args.create_engine_config()

    return build


def test_glm5next_runs_breakable_cuda_graphs_by_default():
    assert set(ARCHITECTURES) <= DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES


def test_the_default_command_meets_every_requirement(engine_config):
    """``vllm serve`` with the backend on and nothing else: mode NONE (no
    torch.compile), FULL_AND_PIECEWISE through breakable CUDA graphs (FULL
    graphs of decode batches), JIT warmup; the check passes."""
    config = engine_config()
    compilation = config.compilation_config
    assert compilation.mode == CompilationMode.NONE
    assert compilation.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert os.environ[BREAKABLE] == "1"  # set by vLLM for these architectures
    assert config.kernel_config.enable_jit_warmup
    assert sd.unsupported(config) == []
    assert sd.specialized_decode_config(config).stages == (sd.STAGE,)


def test_o0_passes_but_turns_the_cuda_graphs_off(engine_config):
    config = engine_config(optimization_level=0)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert sd.unsupported(config) == []


def test_without_breakable_graphs_the_check_names_torch_compile(engine_config):
    """``VLLM_USE_BREAKABLE_CUDAGRAPH=0`` gives vLLM's torch.compile, which the
    check refuses, naming what brings mode NONE back; ``-cc.mode=none`` then
    keeps FULL graphs of decode batches."""
    os.environ[BREAKABLE] = "0"
    config = engine_config()
    assert config.compilation_config.mode == CompilationMode.VLLM_COMPILE
    assert sd.unsupported(config) == [COMPILE]
    config = engine_config(compilation_config={"mode": CompilationMode.NONE})
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert sd.unsupported(config) == []


def test_enforce_eager_misses_the_jit_warmup(engine_config):
    config = engine_config(enforce_eager=True)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert sd.unsupported(config) == [
        "JIT kernel warmup (kernel_config enable_jit_warmup=True)"
    ]
