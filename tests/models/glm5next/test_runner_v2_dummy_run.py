# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The second model runner's side of patch 0004: vLLM's ``GPUModelRunner``
of ``v1/worker/gpu/model_runner.py`` (``VLLM_USE_V2_MODEL_RUNNER=1``)
marks its profiling and idle dummy forwards ``dummy_run`` and its scheduled
steps and CUDA graph captures not, as the forward context the stage reads
(``PlannedSteps`` reads ``context.dummy_run`` first) shows to the model
(CPU). ``test_runner_dummy_run.py`` does the same for the default runner.

Driven: the runner's ``_dummy_run``, ``execute_model`` (its request
bookkeeping, input and slot-mapping preparation, with the Triton kernels
interpreted) and ``capture_model`` with vLLM's ``ModelCudaGraphManager``,
over one CPU rank. The runner is vLLM's class with only the state these
read set (an engine builds it with a GPU, a model and KV caches): a
PIECEWISE deployment of 4-token graphs, one KV cache group of one layer,
no LoRA, no speculation, one pipeline stage; the model a recorder of the
forward context, its model state (the model-specific inputs and attention
metadata) a stand-in. On the CPU: no pinned memory or UVA, no CUDA graph
pool, stream or workspace to lock, and the model counts as torch-compiled,
so a PIECEWISE capture calls it directly. Not driven: a FULL capture or
replay (``torch.cuda.CUDAGraph``); and the eager warmup forward before
each capture, in ``cudagraph_utils``' own forward context (no
``dummy_run`` there: False), is not asserted."""

from contextlib import nullcontext
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
from vllm.forward_context import get_forward_context
from vllm.platforms import current_platform
from vllm.utils import torch_utils
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.worker.gpu import buffer_utils, cudagraph_utils, model_runner
from vllm.v1.worker.gpu.async_utils import StepTimingCollector
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager
from vllm.v1.worker.gpu.eplb_utils import EPLBController
from vllm.v1.worker.gpu.input_batch import InputBuffers
from vllm.v1.worker.gpu.kv_connector import NO_OP_KV_CONNECTOR
from vllm.v1.worker.gpu.lora_utils import LoraState
from vllm.v1.worker.gpu.states import RequestState

TOKENS = 16
REQS = 4
MAX_MODEL_LEN = 256
BLOCK = 16
LAYER = "model.layers.0.self_attn"


@pytest.fixture
def runner(monkeypatch, one_cpu_rank):
    """(vLLM's second runner, the forwards its model saw: (runtime mode,
    dummy_run, positions))."""
    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)
    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    monkeypatch.setattr(current_platform, "device_type", "cpu")
    monkeypatch.setattr(current_platform, "get_global_graph_pool", lambda: None)
    compilation = CompilationConfig(
        cudagraph_mode=CUDAGraphMode.PIECEWISE,
        cudagraph_capture_sizes=[4],
        max_cudagraph_capture_size=4,
    )
    config = VllmConfig(
        device_config=DeviceConfig("cpu"), compilation_config=compilation
    )
    config.scheduler_config.max_num_batched_tokens = TOKENS
    config.scheduler_config.max_num_seqs = REQS
    model_config = SimpleNamespace(
        is_encoder_decoder=False,
        multimodal_config=None,
        rswa_window=None,
        max_model_len=MAX_MODEL_LEN,
    )
    object.__setattr__(config, "model_config", model_config)
    device = torch.device("cpu")
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.bfloat16
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)],
    )
    model_state = SimpleNamespace(
        num_new_sampled_tokens_per_step=1,
        supports_mm_inputs=False,
        add_request=lambda *args: None,
        remove_request=lambda *args: None,
        apply_staged_writes=lambda: None,
        preprocess_state=lambda *args: None,
        prepare_attn=lambda *args, **kwargs: {LAYER: None},
        prepare_inputs=lambda *args: {},
        prepare_dummy_inputs=lambda *args: {},
        capture_inner_cudagraphs=lambda *args: None,
    )
    seen = []

    def model(input_ids, positions, **kwargs):
        context = get_forward_context()
        seen.append(
            (context.cudagraph_runtime_mode, context.dummy_run, positions.tolist())
        )
        return torch.zeros(input_ids.shape[0], 8)

    runner = object.__new__(model_runner.GPUModelRunner)
    with set_current_vllm_config(config):
        runner.__dict__.update(
            vllm_config=config,
            model_config=model_config,
            compilation_config=config.compilation_config,
            scheduler_config=config.scheduler_config,
            parallel_config=config.parallel_config,
            observability_config=config.observability_config,
            lora_config=None,
            device=device,
            max_num_reqs=REQS,
            max_num_tokens=TOKENS,
            max_model_len=MAX_MODEL_LEN,
            vocab_size=64,
            decode_query_len=1,
            speculator=None,
            use_aux_hidden_state_outputs=False,
            is_first_pp_rank=True,
            is_last_pp_rank=True,
            use_pp=False,
            intermediate_tensors=None,
            is_encoder_decoder=False,
            uses_inputs_embeds=False,
            supports_mm_inputs=False,
            encoder_cache=None,
            pooling_runner=None,
            pp_handler=None,
            pcp_manager=None,
            ubatch_runner=None,
            adaptive_verification=None,
            aux_output_connector=None,
            fast_prefill=None,
            sampler=None,
            dcp_size=1,
            kv_connector=NO_OP_KV_CONNECTOR,
            execute_model_state=None,
            step_timing=StepTimingCollector(),
            eplb=EPLBController(config.parallel_config, device),
            lora_state=LoraState(max_num_reqs=REQS),
            input_buffers=InputBuffers(REQS, TOKENS, device),
            req_states=RequestState(REQS, MAX_MODEL_LEN, TOKENS, 0, 64, device),
            block_tables=BlockTables(
                [BLOCK], REQS, TOKENS, [MAX_MODEL_LEN // BLOCK], device
            ),
            kv_cache_config=kv_cache_config,
            attn_groups=[[]],
            model_state=model_state,
            model=model,
            cudagraph_manager=ModelCudaGraphManager(
                config, device, CUDAGraphMode.PIECEWISE, 1
            ),
        )
        yield runner, seen


def scheduled(new=(), decoding=()):
    """A scheduler's step: ``new`` (request id, prompt) prefilled whole,
    ``decoding`` (request id, computed tokens) one token each."""
    output = SchedulerOutput.make_empty()
    for req_id, prompt in new:
        output.scheduled_new_reqs.append(
            NewRequestData(
                req_id=req_id,
                prompt_token_ids=prompt,
                mm_features=[],
                sampling_params=None,
                pooling_params=None,
                block_ids=([0],),
                num_computed_tokens=0,
                lora_request=None,
                prefill_token_ids=prompt,
            )
        )
        output.num_scheduled_tokens[req_id] = len(prompt)
    cached = output.scheduled_cached_reqs
    for req_id, computed in decoding:
        cached.req_ids.append(req_id)
        cached.num_computed_tokens.append(computed)
        cached.new_block_ids.append(None)
        output.num_scheduled_tokens[req_id] = 1
    output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
    return output


def test_profiling_and_idle_runs_are_dummy_runs(runner):
    """The profiling forward (all the tokens, eager, no attention) and an
    idle data-parallel rank's one-token forward (with attention metadata)
    are dummy runs."""
    runner, seen = runner
    runner._dummy_run(TOKENS, skip_attn=True, is_profile=True)
    runner._dummy_run(1)
    assert [(mode, dummy) for mode, dummy, _ in seen] == [
        (CUDAGraphMode.NONE, True),
        (CUDAGraphMode.NONE, True),
    ]


def test_scheduled_steps_are_not_dummy_runs(runner):
    """A scheduled prefill of a 5-token prompt and its next decode step are
    not dummy runs."""
    runner, seen = runner
    runner.execute_model(scheduled(new=[("a", [1, 2, 3, 4, 5])]))
    # What sample_tokens leaves for the next step (no sampler here): the
    # request's computed tokens advanced on the device.
    runner.postprocess_num_computed_tokens(runner.execute_model_state.input_batch)
    runner.execute_model_state = None
    runner.execute_model(scheduled(decoding=[("a", 5)]))
    assert seen == [
        (CUDAGraphMode.NONE, False, [0, 1, 2, 3, 4]),
        (CUDAGraphMode.NONE, False, [5]),
    ]


def test_capture_is_not_a_dummy_run(runner, monkeypatch):
    """``capture_model`` of the 4-token PIECEWISE graph: its capture forward
    is not a dummy run; an idle rank's one-token forward, replayed in that
    graph afterwards, is."""
    runner, seen = runner
    monkeypatch.setattr(cudagraph_utils, "graph_capture", lambda device: nullcontext())
    monkeypatch.setattr(cudagraph_utils, "has_compiled_submodule", lambda model: True)
    monkeypatch.setattr(model_runner, "lock_workspace", lambda: None)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda *args: (0, 0))
    runner.capture_model()
    runner._dummy_run(1)
    warmup, *forwards = seen  # the eager warmup before the capture
    assert warmup[0] == CUDAGraphMode.NONE
    assert [(mode, dummy) for mode, dummy, _ in forwards] == [
        (CUDAGraphMode.PIECEWISE, False),
        (CUDAGraphMode.PIECEWISE, True),
    ]
