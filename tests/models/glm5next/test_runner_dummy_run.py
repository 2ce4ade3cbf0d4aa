# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The model runner's side of patch 0004: vLLM's own ``GPUModelRunner``
(the patched ``gpu_model_runner.py``) marks its warmup, profiling and idle
dummy forwards ``dummy_run`` and its CUDA graph captures not, as the
forward context the stage reads (``PlannedSteps`` reads
``context.dummy_run`` first) shows to the model (CPU).

The runner is vLLM's class with only the state its dummy run reads set (an
engine would build it with a GPU, a model and KV caches): a PIECEWISE
deployment of 4-token graphs, no LoRA, no speculation, one pipeline stage;
the model a recorder of the forward context. On the CPU there is no device
to synchronize and no pinned memory: ``torch.accelerator.synchronize`` does
nothing and ``PIN_MEMORY`` is False. The FULL-graph capture (attention
metadata built from KV caches) is not driven here; the line it runs is the
same ``set_forward_context(..., dummy_run=not is_graph_capturing)``."""

from types import SimpleNamespace

import pytest
import torch

from vllm.config import (
    CompilationConfig,
    CUDAGraphMode,
    DeviceConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.forward_context import BatchDescriptor, get_forward_context
from vllm.utils import torch_utils
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

TOKENS = 16


@pytest.fixture
def runner(monkeypatch):
    """(vLLM's runner, the forwards its model saw: (runtime mode,
    dummy_run))."""
    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *args: None)
    monkeypatch.setattr(
        gpu_model_runner, "get_pp_group", lambda: SimpleNamespace(is_first_rank=True)
    )
    compilation = CompilationConfig(
        cudagraph_mode=CUDAGraphMode.PIECEWISE,
        cudagraph_capture_sizes=[4],
        max_cudagraph_capture_size=4,
    )
    config = VllmConfig(
        device_config=DeviceConfig("cpu"), compilation_config=compilation
    )
    model_config = SimpleNamespace(is_encoder_decoder=False, multimodal_config=None)
    object.__setattr__(config, "model_config", model_config)
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.PIECEWISE, 1)
    seen = []

    def model(input_ids, **kwargs):
        context = get_forward_context()
        seen.append((context.cudagraph_runtime_mode, context.dummy_run))
        return torch.zeros(input_ids.shape[0], 8)

    runner = object.__new__(GPUModelRunner)
    runner.__dict__.update(
        vllm_config=config,
        compilation_config=config.compilation_config,
        scheduler_config=config.scheduler_config,
        parallel_config=config.parallel_config,
        model_config=model_config,
        device=torch.device("cpu"),
        uniform_decode_query_len=1,
        max_num_tokens=TOKENS,
        input_batch=SimpleNamespace(lora_id_to_lora_request={}),
        cudagraph_dispatcher=dispatcher,
        dcp_world_size=1,
        lora_config=None,
        lookback_token_ids=None,
        is_pooling_model=False,
        supports_mm_inputs=False,
        enable_prompt_embeds=False,
        input_ids=SimpleNamespace(gpu=torch.zeros(TOKENS, dtype=torch.int64)),
        uses_mrope=False,
        positions=torch.zeros(TOKENS, dtype=torch.int64),
        is_padding=torch.zeros(TOKENS, dtype=torch.bool),
        prepare_inputs_event=None,
        use_aux_hidden_state_outputs=False,
        speculative_config=None,
        layerwise_nvtx_hooks_registered=False,
        model=model,
    )
    with set_current_vllm_config(config):
        yield runner, seen


def test_capture_is_not_a_dummy_run(runner):
    """``_warmup_and_capture`` of a 4-token decode graph: its eager warmup
    forward is a dummy run, its capture forward is not (so a FULL graph
    records the routing of the decode steps that replay it)."""
    runner, seen = runner
    descriptor = BatchDescriptor(num_tokens=4, uniform=True)
    runner._warmup_and_capture(descriptor, CUDAGraphMode.PIECEWISE, num_warmups=1)
    assert seen == [(CUDAGraphMode.NONE, True), (CUDAGraphMode.PIECEWISE, False)]


def test_profiling_and_idle_runs_are_dummy_runs(runner):
    """The profiling forward (all the tokens, eager) and an idle data-parallel
    rank's one-token forward (replayed in its piecewise graph) are dummy
    runs."""
    runner, seen = runner
    runner._dummy_run(TOKENS, is_profile=True)
    runner._dummy_run(1)
    assert seen == [(CUDAGraphMode.NONE, True), (CUDAGraphMode.PIECEWISE, True)]
