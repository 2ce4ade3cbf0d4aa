# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stage's JIT warmup: the kernel variants a planned step of its layers
can launch, compiled before CUDA graph capture, then self-checked."""

import time
from typing import Any, NamedTuple

import torch

from vllm.logger import init_logger
from vllm.model_executor.warmup.jit_warmup import VllmJitKernel, WarmupChoices

from ..config import SELF_CHECK_SEED_ENV, STAGE
from ..constants import POOL
from ..cutedsl.expand.launch import EXPAND
from ..cutedsl.remap.launch import REMAP
from ..cutedsl.select.launch import SELECT
from ..cutedsl.upcast.launch import UPCAST
from ..cutedsl.update.launch import UPDATE
from .remap import remap_layout

logger = init_logger(__name__)

# The dtypes the indexer hands the kernels: the model runner's int64
# positions (int32 where it casts them) and slot mappings.
POSITIONS, SLOTS = torch.int64, torch.int64
# The self-check's seed where the deployment gives none: one seed for every
# rank and run, so that tensor-parallel ranks check the same cases.
SELF_CHECK_SEED = 1592590337


def deployment_values(stage, attentions) -> list[tuple[Any, dict]]:
    """(kernel, its ``get_warmup_keys`` values) for what a planned step of
    ``attentions`` launches: from the stage's settings and each layer's
    bound caches and buffers."""
    values: list[tuple[Any, dict]] = []
    for attn in attentions:
        indexer = attn.indexer
        kv, tail = indexer.k_cache.kv_cache, indexer.tail_cache.kv_cache
        groups = indexer.topk_tokens // POOL
        values.append(
            (
                UPDATE,
                dict(
                    ring=tail.shape[2],
                    page=kv.shape[1],
                    page_bytes=kv.stride(0),
                    tail_block=tail.stride(0),
                    tail_half=tail.stride(1),
                    mx_scales=stage.mx_scales,
                    round_scale=indexer.scale_fmt is not None,
                    tail_slots_dtype=SLOTS,
                    slots_dtype=SLOTS,
                    # The indexer's int32 copy of the positions.
                    positions_dtype=torch.int32,
                ),
            )
        )
        values.append(
            (EXPAND, dict(groups=groups, seq_lens_dtype=POSITIONS, int32_lengths=True))
        )
        layout = remap_layout(attn)
        if stage.fuse and layout is not None:
            values.append(
                (
                    REMAP,
                    dict(
                        groups=groups,
                        width=indexer.topk_indices_buffer.shape[1],
                        block_size=layout[0],
                        stride_rows=layout[1],
                        positions_dtype=POSITIONS,
                        int32_lengths=True,
                        counts=WarmupChoices(True, False),
                    ),
                )
            )
        # DeepGEMM's logits: BF16 with MX scales (SM100), else FP32, which
        # stock returns as they are.
        logits = torch.bfloat16 if stage.mx_scales else torch.float32
        if stage.mx_scales:
            values.append((UPCAST, {}))
        if stage.select and stage.fuse:
            values.append(
                (
                    SELECT,
                    dict(
                        max_rows=stage.max_rows,
                        one_wave_only=stage.select_one_wave,
                        k=groups,
                        dtype=logits,
                        width=indexer.max_pool_len,
                        sms=stage.sms,
                    ),
                )
            )
    return values


class StageWarmup(VllmJitKernel["StageWarmup.CompileKey"]):
    """One stage's entry in the model runner's JIT warmup registry. Its keys
    are the (kernel, compile key) pairs a planned step of its layers can
    launch; the registry compiles them on fakes before CUDA graph capture,
    then the self-check (``self_check.py``, unless "off") runs each on this
    GPU against its stock twin, and the stage gets the executors only if all
    passed ("strict": a failure raises).

    One entry per stage, not one per kernel: a stage launches only what its
    own warmup compiled and checked (not another engine's keys, nor a public
    function's), and its check needs every key compiled first. The keys come
    from the deployment (read into the stage at install) and from its
    layers' bound caches, whose strides ``vllm_config`` alone does not
    give."""

    class CompileKey(NamedTuple):
        kernel: Any
        key: Any

    def __init__(self, stage, attentions, self_check: str = "on", seed=None):
        super().__init__()
        self.stage, self.attentions = stage, list(attentions)
        # The self-check's mode and seed (None: SELF_CHECK_SEED).
        self.self_check = self_check
        self.seed = SELF_CHECK_SEED if seed is None else seed

    def get_warmup_keys(self, vllm_config=None) -> list[CompileKey]:
        keys: dict = {}
        for kernel, values in deployment_values(self.stage, self.attentions):
            for key in kernel.get_warmup_keys(**values):
                keys[self.CompileKey(kernel, key)] = None
        return list(keys)

    def compile(self, compile_key: CompileKey) -> None:
        compile_key.kernel.compile(compile_key.key)

    def compile_many(self, compile_keys) -> None:
        """Compiles the keys and self-checks them; the stage gets the
        executors only where every tensor-parallel rank's warmup passed
        (``failed_ranks``), so that all ranks run the stage or all run
        stock. "strict" raises on every rank, once all have answered."""
        failure: Exception | None = None
        try:
            executors = {
                key: kernel.executor(key) for kernel, key in list(compile_keys)
            }
            passed = self.self_check == "off" or self.check(executors)
        except Exception as error:
            failure, passed = error, False
            if self.self_check != "strict":
                logger.exception(
                    "GLM-5-Next specialized decode: warmup failed (%s); %s stays "
                    "off and the decode runs stock.",
                    error,
                    STAGE,
                )
        failed, ranks = failed_ranks(passed)
        if not failed:
            self.stage.executors = executors
            return
        if self.self_check == "strict" and failure is not None:
            raise failure
        if ranks > 1:
            message = (
                f"GLM-5-Next specialized decode: the warmup failed on "
                f"tensor-parallel rank(s) {failed} of {ranks}; {STAGE} stays off "
                "on every rank and the decode runs stock."
            )
            if self.self_check == "strict":
                raise RuntimeError(message) from failure
            logger.error(message)

    def check(self, executors: dict) -> bool:
        """The self-check on this GPU: True when every compiled kernel gave
        its stock twin's bytes; else one error line (the kernel, the case,
        the seed to replay it), or in "strict" a RuntimeError."""
        from vllm.models.glm5next.nvidia.specialized_decode import self_check

        seed = self.seed
        started = time.perf_counter()
        device = self.stage.pool_buffer.device
        problem = self_check.check(executors, seed, device)
        elapsed = time.perf_counter() - started
        if problem is None:
            logger.info(
                "GLM-5-Next specialized decode: self-check passed: %d kernel "
                "variants x %d cases, seed %d, %.2f s; %s on.",
                len(executors),
                self_check.CASES,
                seed,
                elapsed,
                STAGE,
            )
            return True
        message = (
            f"GLM-5-Next specialized decode: self-check failed, {problem}; "
            f"{STAGE} stays off and the decode runs stock (replay with "
            f"{SELF_CHECK_SEED_ENV}={seed})."
        )
        if self.self_check == "strict":
            raise RuntimeError(message)
        logger.error(message)
        return False


def failed_ranks(passed: bool) -> tuple[list[int], int]:
    """The tensor-parallel ranks whose warmup failed, and how many ranks
    there are: this process's own verdict where no process group is set up,
    else every rank's, gathered over the group's CPU (gloo) group at warmup.
    Every rank of the group must call it."""
    if not torch.distributed.is_initialized():
        return ([] if passed else [0]), 1
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return ([] if passed else [0]), 1
    verdicts: list = [None] * group.world_size
    torch.distributed.all_gather_object(verdicts, passed, group=group.cpu_group)
    return [rank for rank, ok in enumerate(verdicts) if not ok], group.world_size
