# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Installing the stage at model build (patch 0003), and the process's
registry of installed stages (``sparse_indexer.SPECIALIZED_KPOOL``).

Each engine gets its own ``KpoolStage``; the registry tells them apart by
the indexer's top-k buffer, which every DSA layer of one model shares and no
two models do. The model holds its stage (patch 0003) and the registry only
refers to it, so a stage leaves the registry with its model.
"""

import weakref

from vllm.logger import init_logger
from vllm.models.glm5next.nvidia.specialized_decode.config import (
    decode_capacity,
    specialized_decode_config,
)
from vllm.models.glm5next.nvidia.specialized_decode.constants import STAGE

logger = init_logger(__name__)


class KpoolStages:
    """The installed stages of this process, by the data pointer of their
    model's indexer top-k buffer (``sparse_indexer.SPECIALIZED_KPOOL``)."""

    def __init__(self) -> None:
        self.by_buffer: weakref.WeakValueDictionary[int, object] = (
            weakref.WeakValueDictionary()
        )

    def add(self, stage, buffer) -> None:
        key = buffer.data_ptr()
        if key in self.by_buffer:
            raise RuntimeError(
                "GLM-5-Next specialized decode: a stage is already installed on "
                "this indexer top-k buffer (one stage per model)"
            )
        self.by_buffer[key] = stage

    def decode_step(self, metadata, layer, positions, topk_tokens, pool_size, buffer):
        """Patch 0002's call: the stage of the model ``buffer`` belongs to
        decides (None: stock)."""
        stage = self.by_buffer.get(buffer.data_ptr())
        if stage is None:
            return None
        return stage.decode_step(
            metadata, layer, positions, topk_tokens, pool_size, buffer
        )


def registry() -> KpoolStages:
    """The process's registry, created in the indexer module on first use."""
    from vllm.models.glm5next.nvidia import sparse_indexer

    if sparse_indexer.SPECIALIZED_KPOOL is None:
        sparse_indexer.SPECIALIZED_KPOOL = KpoolStages()
    return sparse_indexer.SPECIALIZED_KPOOL


def install(vllm_config, attentions):
    """Installs the ``dsa_kpool`` stage on the GLM-5-Next model's DSA
    attention layers (``Glm5NextMLAAttention`` with an indexer, the main model
    only) when the deployment asks for it: builds the ``KpoolStage``, adds it
    to the registry, registers its warmup and logs what is on. Returns the
    stage, or None (stock decode)."""
    config = specialized_decode_config(vllm_config)
    if config is None:
        return None
    if STAGE not in config.stages or not attentions:
        logger.info(
            "GLM-5-Next specialized decode: %s off (%s).",
            STAGE,
            "left out" if attentions else "no DSA layers",
        )
        return None

    from vllm.models.glm5next.nvidia.specialized_decode.stage import KpoolStage
    from vllm.models.glm5next.nvidia.specialized_decode.warmup import KpoolWarmup

    max_rows = decode_capacity(vllm_config)
    buffer = attentions[0].indexer.topk_indices_buffer
    stage = KpoolStage(attentions, max_rows, buffer.device, select=config.select)
    registry().add(stage, buffer)
    registered = _register_warmup(KpoolWarmup(stage, attentions, config.self_check))
    (logger.info if registered else logger.warning)(
        "GLM-5-Next specialized decode: %s %s, for decode-only steps of up to "
        "%d rows; attention backend %s; DSA layers: %s.",
        STAGE,
        "on, compiled at JIT warmup"
        if registered
        else "off: no JIT warmup registry compiles its kernels",
        max_rows,
        type(attentions[0].mla_attn.mla_attn.impl).__name__,
        "; ".join(stage.engagement(attentions)),
    )
    return stage


def _register_warmup(warmup) -> bool:
    """Registers the stage's warmup with the model runner's JIT warmup;
    False where none collects it (no CUDA, or a model built outside a
    runner), and the stage then never plans a step."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return False
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    if JitWarmupRegistry._active.get() is None:
        return False
    JitWarmupRegistry.register(warmup)  # type: ignore[arg-type]
    return True
