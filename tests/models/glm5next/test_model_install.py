# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The model's side of patch 0003: vLLM's own ``Glm5NextModel`` (the patched
``common/model.py``), built on the CPU, hands ``install`` the attention
modules of its DSA layers and holds what ``install`` returns (CPU).

Driven: the model's ``__init__`` whole, every layer built by vLLM's code
(KDA layers, whose attention has no indexer, and MLA layers with their
sparse indexer), over one process group of one CPU rank (gloo). The
deployment's model config is a namespace with the fields the build reads
and a tiny ``Glm5NextTextConfig``. Stand-ins, for what a GPU host answers:
the platform's device type is ``cpu``, its sparse MLA backend Hopper's
default (``FLASHINFER_MLA_SPARSE_SM90``) and its MLA prefill backend the
CPU one. ``install`` itself is replaced by a recorder (``test_install.py``
tests it); no weights are loaded and no forward is run."""

from types import SimpleNamespace

import pytest
import torch
import transformers

from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.models.glm5next.nvidia.specialized_decode.runtime import install
from vllm.platforms import current_platform
from vllm.v1.attention import selector
from vllm.v1.attention.backends.mla.prefill import selector as prefill_selector
from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum

SPARSE_MLA = (
    "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90."
    "FlashInferMLASparseSM90Backend"
)
LAYER_TYPES = [
    "linear_attention",
    "indexed_attention",
    "linear_attention",
    "indexed_attention",
    "indexed_attention",
]


@pytest.fixture
def vllm_config(monkeypatch, one_cpu_rank):
    """A tiny GLM-5-Next deployment on one CPU rank, its platform a GPU's
    for the attention backends (see the module docstring)."""
    monkeypatch.setattr(current_platform, "device_type", "cpu")
    monkeypatch.setattr(
        current_platform, "get_attn_backend_cls", lambda *args, **kwargs: SPARSE_MLA
    )
    monkeypatch.setattr(
        current_platform,
        "get_mla_prefill_backend_cls",
        lambda *args: MLAPrefillBackendEnum.CPU.get_class(),
    )
    hf = transformers.Glm5NextTextConfig(
        vocab_size=64,
        pad_token_id=0,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        mlp_layer_types=["dense"] * len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=4,
        linear_num_heads=4,
        linear_head_dim=32,
        hc_mult=2,
        q_lora_rank=32,
        index_topk=16,
        index_kpool=4,
        index_n_heads=4,
        # What a checkpoint's config.json adds to the text config.
        mhc=True,
        mla_use_nope=True,
        indexer_rope_interleave=True,
    )
    config = VllmConfig(device_config=DeviceConfig("cpu"))
    model_config = SimpleNamespace(
        hf_config=hf,
        hf_text_config=hf,
        dtype=torch.bfloat16,
        max_model_len=512,
        rswa_window=None,
    )
    object.__setattr__(config, "model_config", model_config)
    # What VllmConfig resolves with a model config of this max_model_len.
    config.attention_config.sparse_mla_prefill_workspace_factor = 5
    try:
        with set_current_vllm_config(config):
            yield config
    finally:
        # Their choices under the stand-ins must not outlive the test.
        selector._cached_get_attn_backend.cache_clear()
        prefill_selector._auto_select_mla_prefill_backend.cache_clear()


def test_install_gets_the_dsa_layers_attentions_in_order(monkeypatch, vllm_config):
    """``install`` is called once, with the deployment's config and exactly
    the attention modules that have an indexer (the MLA layers', not the KDA
    layers'), in layer order; the model holds what it returns as
    ``specialized_decode``."""
    from vllm.models.glm5next.common.model import Glm5NextModel

    calls, stage = [], object()

    def recorder(config, attentions):
        calls.append((config, attentions))
        return stage

    monkeypatch.setattr(install, "install", recorder)
    model = Glm5NextModel(vllm_config=vllm_config, prefix="model")

    kinds = [layer.layer_kind for layer in model.layers]
    assert kinds == ["kda", "mla", "kda", "mla", "mla"]
    assert [hasattr(layer.self_attn, "indexer") for layer in model.layers] == [
        False,
        True,
        False,
        True,
        True,
    ]
    [(config, attentions)] = calls
    assert config is vllm_config
    layer_of = {id(layer.self_attn): i for i, layer in enumerate(model.layers)}
    assert [layer_of.get(id(attention)) for attention in attentions] == [1, 3, 4]
    assert all(attention.indexer is not None for attention in attentions)
    assert model.specialized_decode is stage
