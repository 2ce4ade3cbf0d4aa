# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stage's JIT warmup: which kernel variants a planned step of these
layers can launch, compiled before CUDA graph capture, then the self-check.

The compile keys come from the kernels' own ``key_for``, run on arguments
shaped like each layer's decode inputs (``launch_cases``): the layer's real
caches and index-group buffers where they exist at warmup, one-row stand-ins
of the indexer's decode tensors otherwise. A case a kernel refuses is left to
stock, as the step's real input would be.
"""

import os
import secrets
import time

import torch

from vllm.logger import init_logger
from vllm.models.glm5next.nvidia.specialized_decode import (
    expand_kernel,
    remap_kernel,
    select_kernel,
    upcast_kernel,
    update_kernel,
)
from vllm.models.glm5next.nvidia.specialized_decode.constants import (
    DIM,
    POOL,
    SELF_CHECK_SEED_ENV,
    STAGE,
)
from vllm.models.glm5next.nvidia.specialized_decode.fused_remap import remap_layout
from vllm.utils.deep_gemm import mqa_logits_use_mx_scales

logger = init_logger(__name__)

KERNELS = (
    update_kernel.UPDATE,
    expand_kernel.EXPAND,
    remap_kernel.REMAP,
    upcast_kernel.UPCAST,
    select_kernel.SELECT,
)
# The model runners' positions buffer, which the indexer passes on.
POSITIONS_DTYPE = torch.int64


def launch_cases(stage, attentions) -> dict:
    """Per kernel, the arguments a planned step of ``attentions`` can launch
    it with, as the stage builds them from the indexer's decode inputs."""
    cases: dict = {kernel: [] for kernel in KERNELS}
    for attn in attentions:
        indexer = attn.indexer
        device = indexer.topk_indices_buffer.device

        def tensor(shape, dtype, device=device):
            return torch.zeros(shape, dtype=dtype, device=device)

        kv, tail = indexer.k_cache.kv_cache, indexer.tail_cache.kv_cache
        rows = tensor((1, 1, DIM), torch.bfloat16)
        # Slot mappings come as the metadata's int64 (the non-uniform
        # layout's scatter keeps their dtype); positions as the indexer's
        # int32 copy.
        slots = tensor((1, 1), torch.int64)
        cases[update_kernel.UPDATE].append(
            update_kernel.UpdateArgs(
                kv,
                tail,
                slots,
                rows,
                rows,
                tensor((POOL, DIM), torch.float32),
                slots,
                tensor((1, 1), torch.int32),
                POOL,
                DIM,
                mqa_logits_use_mx_scales(),
                indexer.scale_fmt is not None,
            )
        )
        groups = indexer.topk_tokens // POOL
        pool_ids = stage.pool_buffer[:1, :groups]
        positions = tensor((1,), POSITIONS_DTYPE)
        cases[expand_kernel.EXPAND].append(
            expand_kernel.ExpandArgs(
                pool_ids,
                positions,
                POOL,
                seq_offset=1,
                out=indexer.topk_indices_buffer[:1],
                int32_lengths=True,
            )
        )
        layout = remap_layout(attn)
        group = getattr(attn.mla_attn.mla_attn.impl, "index_group", None)
        if stage.fuse and layout is not None:
            for counts in (group.valid_topk_counts[:1], None):
                cases[remap_kernel.REMAP].append(
                    remap_kernel.RemapArgs(
                        pool_ids,
                        positions,
                        POOL,
                        tensor((1,), torch.int32),
                        tensor((1, 1), torch.int32),
                        group.physical_topk_indices[:1],
                        counts,
                        *layout,
                        seq_offset=1,
                        int32_lengths=True,
                    )
                )
        # DeepGEMM's logits: BF16 with MX scales (SM100), else FP32, which
        # the upcast refuses (stock returns them).
        logits = torch.bfloat16 if mqa_logits_use_mx_scales() else torch.float32
        cases[upcast_kernel.UPCAST].append(
            upcast_kernel.UpcastArgs(tensor((1, 8), logits), tensor((1,), torch.int32))
        )
        if stage.select and stage.fuse:
            cases[select_kernel.SELECT] += select_cases(stage, indexer, logits)
    return cases


def select_cases(stage, indexer, dtype) -> list:
    """The opt-in select's arguments at each row count of one wave
    (``LayerStep.select``): DeepGEMM's logits, ``max_pool_len`` columns
    wide; the rows share one row of storage (stride 0: the key reads shapes)."""
    width = getattr(indexer, "max_pool_len", None)
    if width is None:  # no logits width: the select stays uncompiled (stock)
        return []
    device = stage.pool_buffer.device
    row = torch.zeros((1, width), dtype=dtype, device=device)
    ends = torch.zeros((stage.max_rows,), dtype=torch.int32, device=device)
    k = indexer.topk_tokens // POOL
    return [
        select_kernel.SelectArgs(
            row.expand(rows, width), ends[:rows], k, stage.pool_buffer[:rows, :k]
        )
        for rows in range(1, stage.max_rows + 1)
        if select_kernel.one_wave(rows, width, dtype, stage.sms)
    ]


def warmup_keys(stage, attentions) -> list:
    """(kernel, compile key) of every variant ``launch_cases`` launches."""
    cases = launch_cases(stage, attentions)
    return [
        (kernel, key)
        for kernel in KERNELS
        for key in kernel.get_warmup_keys(cases[kernel])
    ]


class KpoolWarmup:
    """The JIT warmup registry's entry for one stage (the registry's kernel
    protocol: ``get_warmup_keys`` and ``compile_many``). Runs after the KV
    caches are bound, before CUDA graph capture. The stage plans steps only
    once this compiled its kernels and (unless "off") they passed the
    self-check; a failure leaves it off and says so ("strict": raises)."""

    def __init__(self, stage, attentions, self_check: str = "on"):
        self.stage, self.attentions = stage, list(attentions)
        self.self_check = self_check

    def get_warmup_keys(self) -> list[tuple[str, int]]:
        return [(STAGE, id(self.stage))]

    def compile_many(self, keys) -> None:
        try:
            compiled = self.compile()
            self.stage.warmed = self.self_check == "off" or self.check(compiled)
        except Exception as error:
            if self.self_check == "strict":
                raise
            logger.exception(
                "GLM-5-Next specialized decode: warmup failed (%s); %s stays "
                "off and the decode runs stock.",
                error,
                STAGE,
            )
            self.stage.warmed = False

    def compile(self) -> list:
        """Compiles, on fake tensors, every variant a planned step can
        launch; returns the (kernel, compile key) pairs."""
        keys = warmup_keys(self.stage, self.attentions)
        for kernel, key in keys:
            kernel.compile(key)
        return keys

    def check(self, keys) -> bool:
        """The self-check (``self_check.py``) on this GPU: True when every
        compiled kernel gave stock's bytes; else one error line (the kernel,
        the case, the seed to replay it), or in "strict" a RuntimeError."""
        from vllm.models.glm5next.nvidia.specialized_decode import self_check

        seed = int(os.environ.get(SELF_CHECK_SEED_ENV) or secrets.randbits(31))
        started = time.perf_counter()
        device = self.stage.pool_buffer.device
        problem = self_check.check(keys, seed, device)
        elapsed = time.perf_counter() - started
        if problem is None:
            logger.info(
                "GLM-5-Next specialized decode: self-check passed: %d kernel "
                "variants x %d cases, seed %d, %.2f s.",
                len(keys),
                self_check.CASES,
                seed,
                elapsed,
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
