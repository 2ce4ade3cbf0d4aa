# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stage's JIT warmup (``StageWarmup``) and the values its kernels' keys
come from (``deployment_values``)."""

import time
from typing import Any

import torch

from vllm.logger import init_logger
from vllm.model_executor.warmup.jit_warmup import WarmupChoices
from vllm.utils.deep_gemm import native_next_n_supported

from ..config import SELF_CHECK_SEED_ENV, STAGE
from ..constants import POOL
from ..cutedsl.expand.launch import EXPAND
from ..cutedsl.remap.launch import REMAP, remap_takes
from ..cutedsl.scores.launch import BLOCKS, NEXT_N, SCORES, served_heads
from ..cutedsl.select.launch import SELECT
from ..cutedsl.upcast.launch import UPCAST
from ..cutedsl.update.launch import UPDATE
from .remap import remap_layout

logger = init_logger(__name__)

# The self-check's seed unless VLLM_GLM5NEXT_KPOOL_SELF_CHECK_SEED gives one:
# a constant, so that every rank (and every start) checks the same cases.
SEED = 0

# The dtypes the indexer hands the kernels: the model runner's int64
# positions (int32 where it casts them) and slot mappings.
POSITIONS, SLOTS = torch.int64, torch.int64


def deployment_values(stage, attentions) -> list[tuple[Any, dict]]:
    """(kernel, its ``get_warmup_keys`` values) for what a planned step of
    ``attentions`` launches: from the stage's settings and each layer's
    bound caches and buffers. The fused remap and the select run only in
    steps that defer, so only for a layer whose shapes the remap takes (any
    other runs stock there, the stage staying on)."""
    values: list[tuple[Any, dict]] = []
    for attn in attentions:
        indexer = attn.indexer
        kv, tail = indexer.k_cache.kv_cache, indexer.tail_cache.kv_cache
        groups = indexer.topk_tokens // POOL
        update = dict(ring=tail.shape[2], page=kv.shape[1], page_bytes=kv.stride(0))
        update |= dict(tail_block=tail.stride(0), tail_half=tail.stride(1))
        scale = indexer.scale_fmt is not None
        update |= dict(mx_scales=stage.mx_scales, round_scale=scale)
        # The indexer's int32 copy of the positions.
        update |= dict(tail_slots_dtype=SLOTS, slots_dtype=SLOTS)
        update |= dict(positions_dtype=torch.int32)
        values.append((UPDATE, update))
        expand = dict(groups=groups, seq_lens_dtype=POSITIONS, int32_lengths=True)
        values.append((EXPAND, expand))
        width = indexer.topk_indices_buffer.shape[1]
        defers = stage.fuse and remap_takes(groups, width)
        layout = remap_layout(attn)
        if defers and layout is not None and remap_takes(groups, width, layout=layout):
            remap = dict(groups=groups, width=width)
            remap |= dict(block_size=layout[0], stride_rows=layout[1])
            remap |= dict(positions_dtype=POSITIONS, int32_lengths=True)
            values.append((REMAP, remap | dict(counts=WarmupChoices(True, False))))
        # DeepGEMM's logits: BF16 with MX scales (SM100), else FP32, which
        # stock returns as they are.
        logits = torch.bfloat16 if stage.mx_scales else torch.float32
        if stage.mx_scales:
            values.append((UPCAST, {}))
        # FP32 scales: SM90 (the SM100 family's scores take MX scales only),
        # whose wgmma the scores kernel is built on.
        if stage.scores and not stage.mx_scales:
            values += scores_values(stage, indexer, kv)
        if stage.select and defers:
            select = dict(max_rows=stage.max_rows, one_wave_only=stage.select_one_wave)
            select |= dict(k=groups, dtype=logits, width=indexer.max_pool_len)
            values.append((SELECT, select | dict(sms=stage.sms)))
    return values


def scores_values(stage, indexer, kv) -> list[tuple[Any, dict]]:
    """The opt-in scores' values of a layer, where the kernel takes its
    heads and page size (else none: DeepGEMM runs): each ``next_n`` from 1
    to the stage's that the kernel and DeepGEMM take (another runs
    DeepGEMM, or never reaches it)."""
    heads, block = served_heads(indexer.n_head), kv.shape[1]
    if heads is None or block not in BLOCKS:
        return []
    # The indexer's metadata flattens a step of a next_n DeepGEMM does not
    # take (SM90: 3) into single rows; its self-check twin would refuse it.
    next_n = range(1, stage.next_n + 1)
    next_n = [n for n in next_n if n in NEXT_N and native_next_n_supported(n)]
    values = dict(heads=heads, next_n=WarmupChoices(*next_n), block=block)
    return [(SCORES, values)]


def failed_ranks(failed: bool) -> tuple[list[int], int]:
    """(the tensor-parallel ranks whose warmup failed, the group's size),
    this rank's ``failed`` among them, gathered over the TP group's CPU group
    (no device sync); without a TP group, rank 0 alone."""
    from vllm.distributed import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return ([0] if failed else []), 1
    group = get_tp_group()
    if group.world_size == 1:
        return ([group.rank_in_group] if failed else []), 1
    flags = [torch.zeros(1, dtype=torch.int32) for _ in range(group.world_size)]
    mine = torch.tensor([int(failed)], dtype=torch.int32)
    torch.distributed.all_gather(flags, mine, group=group.cpu_group)
    return [rank for rank, flag in enumerate(flags) if flag.item()], group.world_size


class StageWarmup:
    """One stage's JIT warmup, in the model runner's registry: each of the
    stage's kernels is an entry (``register``) whose ``keys`` come from the
    deployment and the layers' bound caches, compiled before CUDA graph
    capture (``compiled``) into the warmup's own table. Once every kernel
    with keys compiled, the self-check (unless "off") runs each key against
    its stock twin, and the stage's executors become a copy of the table
    only if every tensor-parallel rank passed, else none: the verdict is the
    stage's, not each kernel's. A later compile takes a new verdict over the
    whole table."""

    def __init__(self, stage, attentions, self_check: str = "on", seed=None):
        self.stage, self.attentions = stage, list(attentions)
        self.self_check, self.seed = self_check, SEED if seed is None else seed
        # What this warmup compiled (key -> executor).
        self.executors: dict = {}
        self.done: set = set()
        # The stage's kernels that have keys (traced once, at the first
        # compile: the select's trace covers every layer and row count).
        self.keyed: list | None = None
        self.error: Exception | None = None

    def register(self) -> None:
        for kernel in self.stage.kernels:
            kernel.register_warmup()

    def keys(self, kernel, vllm_config=None) -> list:
        """``kernel``'s keys (one of the stage's kernels): from the public
        kernel's ``get_warmup_keys`` on the deployment's values."""
        keys: dict = {}
        for public, values in deployment_values(self.stage, self.attentions):
            if type(public) is type(kernel):
                keys.update(dict.fromkeys(public.get_warmup_keys(**values)))
        return list(keys)

    def compiled(self, kernel, keys: list) -> None:
        """Compiles ``kernel``'s ``keys`` (a compile error is this rank's
        failure); after the stage's last kernel with keys, ``finish``."""
        try:
            if self.error is None:
                for key in keys:
                    self.executors[key] = kernel.executor(key)
        except Exception as raised:
            self.error = raised
        self.done.add(kernel)
        if self.keyed is None:
            self.keyed = [k for k in self.stage.kernels if self.keys(k)]
        if all(k in self.done for k in self.keyed):
            self.finish()

    def finish(self) -> None:
        """Self-checks the compiled keys (unless "off") and applies the TP
        ranks' verdict (the class's docstring); each rank logs one line.
        "strict": a failure raises on every rank, once the ranks agreed."""
        executors, problem, error = dict(self.executors), None, self.error
        elapsed = 0.0
        if error is None and self.self_check != "off":
            try:
                from .. import self_check

                started = time.perf_counter()
                device = self.stage.pool_buffer.device
                problem = self_check.check(executors, self.seed, device)
                elapsed = time.perf_counter() - started
            except Exception as raised:
                error = raised
        failed, ranks = failed_ranks(error is not None or problem is not None)
        if not failed:
            if self.self_check != "off":
                logger.info(
                    "GLM-5-Next specialized decode: self-check passed: %d kernel "
                    "variants x %d cases, seed %d, %.2f s; %s on%s.",
                    len(executors),
                    self_check.CASES,
                    self.seed,
                    elapsed,
                    STAGE,
                    f" (all {ranks} TP ranks passed)" if ranks > 1 else "",
                )
            self.stage.executors = executors
            return
        # Off, whatever an earlier verdict gave it.
        self.stage.executors = {}
        line = self.failure(problem, error, failed, ranks)
        if self.self_check == "strict":
            raise error or RuntimeError(line)
        logger.error(line, exc_info=error)

    def failure(self, problem, error, failed: list[int], ranks: int) -> str:
        """The line of a warmup after which the stage stays off: this rank's
        error or self-check failure, else the TP ranks that failed."""
        prefix, where = "GLM-5-Next specialized decode: ", ""
        if ranks > 1:
            listed = ", ".join(map(str, failed))
            where = f" on every TP rank (failed: rank {listed} of {ranks})"
        off = f"{STAGE} stays off{where} and the decode runs stock"
        if error is not None:
            return f"{prefix}warmup failed ({error}); {off}."
        if problem is not None:
            replay = f"replay with {SELF_CHECK_SEED_ENV}={self.seed}"
            return f"{prefix}self-check failed, {problem}; {off} ({replay})."
        return f"{prefix}this rank's warmup passed; {off}."
