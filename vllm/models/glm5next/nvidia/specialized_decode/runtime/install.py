# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Installing the stage at model build (patch 0003), and the process's
registry of installed stages (``sparse_indexer.SPECIALIZED_KPOOL``)."""

import weakref

from vllm.logger import init_logger

from ..config import STAGE, decode_capacity, decode_next_n, specialized_decode_config

logger = init_logger(__name__)


class StageRegistry:
    """``sparse_indexer.SPECIALIZED_KPOOL``, whose ``decode_step`` patch 0002
    calls (``KpoolStage.decode_step``, None without a stage): each
    engine's ``KpoolStage``, by the data pointer of its indexer top-k buffer,
    which every DSA layer of one model shares and no two models do. The
    model holds its stage (patch 0003) and the registry only refers to it,
    so a stage leaves the registry with its model."""

    def __init__(self) -> None:
        self.by_buffer: weakref.WeakValueDictionary[int, object]
        self.by_buffer = weakref.WeakValueDictionary()

    def add(self, stage, buffer) -> None:
        key = buffer.data_ptr()
        if key in self.by_buffer:
            raise RuntimeError(
                "GLM-5-Next specialized decode: a stage is already installed on "
                "this indexer top-k buffer (one stage per model)"
            )
        self.by_buffer[key] = stage

    def decode_step(self, metadata, layer, positions, topk_tokens, pool_size, buffer):
        stage = self.by_buffer.get(buffer.data_ptr())
        args = (metadata, layer, positions, topk_tokens, pool_size, buffer)
        return None if stage is None else stage.decode_step(*args)


def registry() -> StageRegistry:
    """The process's registry, created in the indexer module on first use."""
    from vllm.models.glm5next.nvidia import sparse_indexer

    if sparse_indexer.SPECIALIZED_KPOOL is None:
        sparse_indexer.SPECIALIZED_KPOOL = StageRegistry()
    return sparse_indexer.SPECIALIZED_KPOOL


def install(vllm_config, attentions):
    """Installs the ``dsa_kpool`` stage on the GLM-5-Next model's DSA
    attention layers (the main model's) when the deployment asks for it, and
    registers its JIT warmup. Returns the stage (which plans no step before
    its warmup passed), or None (stock decode)."""
    config = specialized_decode_config(vllm_config)
    if config is None:
        return None
    if STAGE not in config.stages or not attentions:
        why = "left out" if attentions else "no DSA layers"
        logger.info("GLM-5-Next specialized decode: %s off (%s).", STAGE, why)
        return None

    from vllm.utils.deep_gemm import mqa_logits_use_mx_scales

    from .stage import KpoolStage

    max_rows = decode_capacity(vllm_config)
    buffer = attentions[0].indexer.topk_indices_buffer
    options = dict(mx_scales=mqa_logits_use_mx_scales(), select=config.select)
    options |= dict(select_one_wave=config.select_one_wave, scores=config.scores)
    options |= dict(next_n=decode_next_n(vllm_config), self_check=config.self_check)
    options["seed"] = config.self_check_seed
    stage = KpoolStage(attentions, max_rows, buffer.device, **options)
    registry().add(stage, buffer)
    stage.warmup.register()
    logger.info(
        "GLM-5-Next specialized decode: %s installed for decode-only steps of "
        "up to %d rows, on once the JIT warmup compiled and self-checked its "
        "kernels; attention backend %s; DSA layers: %s.",
        STAGE,
        max_rows,
        type(attentions[0].mla_attn.mla_attn.impl).__name__,
        "; ".join(stage.engagement(attentions)),
    )
    say_batch_invariance(stage)
    return stage


def say_batch_invariance(stage) -> None:
    """Under vLLM's batch-invariant mode, says once whether the indexer's
    decode top-k is: the select at every batch size is, stock's is not."""
    from vllm.envs import VLLM_BATCH_INVARIANT

    if not VLLM_BATCH_INVARIANT:
        return
    if stage.select and not stage.select_one_wave:
        logger.info_once(
            "GLM-5-Next specialized decode: VLLM_BATCH_INVARIANT=1: the kpool "
            "indexer's decode selects with kpool_select at every batch size; a "
            "row's pools, slots and counts do not depend on its batch."
        )
    else:
        logger.warning_once(
            "GLM-5-Next specialized decode: VLLM_BATCH_INVARIANT=1, but the "
            "kpool indexer's decode top-k is stock's%s, which is not "
            "batch-invariant; set additional_config kpool_select=true for a "
            "batch-invariant select.",
            " past one wave of rows" if stage.select else "",
        )
