# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``dsa_kpool`` stage of one engine: what its planned decode steps run
in place of the stock kpool indexer (patch 0002's calls), and the state
they need. Every launch goes through the stage's own kernel instances
(``KpoolKernel``'s docstring): anything its warmup did not compile and
self-check returns ``STOCK``, and the stock kernel runs."""

from typing import NamedTuple

import torch

from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.indexer_topk import get_indexer_topk
from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
from vllm.models.glm5next.nvidia.ops.kpool_compress import (
    expand_pools_and_append_tail,
    kpool_decode_update_and_maybe_write_cache_batched,
)
from vllm.utils.deep_gemm import fp8_fp4_paged_mqa_logits

from ..constants import MAX_GROUPS, POOL
from ..cutedsl.common.host import STOCK
from ..cutedsl.expand.launch import ExpandKernel
from ..cutedsl.remap.launch import RemapKernel, remap_takes
from ..cutedsl.scores.launch import ScoresKernel, served_heads
from ..cutedsl.select.launch import SelectKernel, one_wave, sm_count
from ..cutedsl.upcast.launch import UpcastKernel
from ..cutedsl.update.launch import UpdateKernel
from .remap import Deferred, FusedRemap, why_not_fusable
from .steps import PlannedSteps
from .warmup import StageWarmup


class StageKernels(NamedTuple):
    """A stage's instances of the kernels: ``kind(stage)`` of each field's
    ``KpoolKernel`` class."""

    update: UpdateKernel
    expand: ExpandKernel
    remap: RemapKernel
    upcast: UpcastKernel
    select: SelectKernel
    scores: ScoresKernel


class LayerStep:
    """One DSA layer's decode in a planned step, deferring to ``remap`` where
    given: its pool top-k goes to the layer's index conversion, and the
    indexer leaves its logical top-k rows unfilled (``deferring``)."""

    def __init__(self, stage: "KpoolStage", remap: FusedRemap | None):
        self.stage, self.remap = stage, remap
        self.deferring = remap is not None

    def update(self, *stock_args, round_scale=True) -> None:
        update, mx = self.stage.kernels.update, self.stage.mx_scales
        if update.serve(*stock_args, mx_scales=mx, round_scale=round_scale) is STOCK:
            stock = kpool_decode_update_and_maybe_write_cache_batched
            stock(*stock_args, round_scale=round_scale)

    def decode_rows(
        self,
        q,
        kv_cache: torch.Tensor,
        weights: torch.Tensor,
        decode,
        max_seq_len: int,
        *,
        max_model_len: int,
        topk_tokens: int,
        topk_backend: str,
        positions: torch.Tensor | None,
        buffer: torch.Tensor,
    ) -> bool:
        """The stock decode from the scores on: the scores,
        ``as_fp32_logits``, the pool top-k (or the opt-in select), then the
        expansion into ``buffer`` or the hand-over to the layer's conversion.
        False: the indexer runs the rows stock (rows that need padding)."""
        if decode.requires_padding or positions is None:
            return False
        next_n = q[0].shape[1]
        seq_lens = decode.seq_lens[: q[0].shape[0]]
        rows, k = q[0].shape[0] * next_n, topk_tokens // POOL
        logits = self.scores(q, kv_cache, weights, seq_lens, decode, max_model_len)
        ends, stage = seq_lens.view(-1), self.stage
        pool_ids = stage.pool_ids(rows, k, logits.device, self.deferring)
        if not self.selected(logits, ends, k, pool_ids):
            logits = stage.upcast(logits, ends)
            get_indexer_topk(topk_backend)(
                logits, seq_lens, next_n, pool_ids, k, max_seq_len
            )
        if self.deferring:
            self.remap.hand_over(Deferred(pool_ids, positions[:rows]))
        else:
            stage.expand(pool_ids, positions[:rows], buffer[:rows])
        return True

    def scores(self, q, kv_cache, weights, seq_lens, decode, max_model_len: int):
        """DeepGEMM's ``fp8_fp4_paged_mqa_logits`` of the step, or where the
        deployment opted in (``kpool_scores``) and the kernel takes the call,
        the opt-in scores (DeepGEMM's logits below each entry's context, all
        that the step reads of them)."""
        heads, table = self.stage.scores_heads, decode.block_table
        keywords = dict(max_model_len=max_model_len, indices=decode.indices)
        if heads is not None:
            ours = dict(q=q, weights=weights)
            if heads < q[0].shape[2]:
                # The real heads of vLLM's zero-padded ones (``served_heads``).
                ours = dict(q=(q[0][:, :, :heads], q[1]), weights=weights[:, :heads])
            ours |= dict(kv_cache=kv_cache, seq_lens=seq_lens, block_table=table)
            logits = self.stage.kernels.scores.serve(**ours, **keywords)
            if logits is not STOCK:
                return logits
        args = (q, kv_cache, weights, seq_lens, table, decode.schedule_metadata)
        return fp8_fp4_paged_mqa_logits(*args, **keywords)

    def selected(self, logits, ends, k: int, out) -> bool:
        """Whether the opt-in select (rather than stock's top-k) wrote the top
        ``k`` pools below ``ends`` into ``out`` (no upcast): where the
        deployment opted in, the step defers (its pool order reaches no
        consumer as logical rows), (``select_one_wave``) one wave of clusters
        holds the rows and the kernel takes the call."""
        stage, (rows, width) = self.stage, logits.shape
        if not stage.select or not self.deferring:
            return False
        if stage.select_one_wave and not one_wave(rows, width, logits.dtype, stage.sms):
            return False
        select = stage.kernels.select
        return select.serve(logits=logits, ends=ends, k=k, out=out) is not STOCK


class KpoolStage:
    """The kpool indexer decode kernels inside one engine's planned steps
    (stage ``dsa_kpool``), reached through ``sparse_indexer.SPECIALIZED_KPOOL``.
    It owns the engine's state: the planned ``steps``, its kernels (it is
    their ``host.KernelOwner``), its warmup and the executors that warmup
    compiled and self-checked (none before: no step is planned), the pool
    buffer deferring steps write, and each fused layer's ``FusedRemap``.
    Where every DSA layer's index group can take one (``fuse``), the indexer
    leaves its decode rows as pool ids for the conversion; else
    ``why_not_fused`` says why, per layer."""

    def __init__(
        self,
        attentions,
        max_rows: int,
        device,
        *,
        mx_scales: bool,
        select: bool = False,
        select_one_wave: bool = False,
        scores: bool = False,
        next_n: int = 1,
        self_check: str = "on",
        seed: int | None = None,
    ):
        attentions = list(attentions)
        self.max_rows, self.mx_scales, self.select = max_rows, mx_scales, select
        self.select_one_wave = select and select_one_wave
        self.scores, self.next_n = scores, next_n
        # The heads the opt-in scores compute (``served_heads``); None where
        # the warmup lists no scores key: a step then calls DeepGEMM.
        fp32 = scores and not mx_scales
        heads = {attn.indexer.n_head for attn in attentions} if fp32 else set()
        self.scores_heads = served_heads(heads.pop()) if len(heads) == 1 else None
        # The warmup's verdict, replaced whole by each (empty: off).
        self.executors: dict = {}
        kinds = StageKernels.__annotations__.values()
        self.kernels = StageKernels._make(kind(self) for kind in kinds)
        device = torch.device(device)
        # A CUDA tensor's device always carries its index.
        self.sms = sm_count(device.index or 0) if select else 0
        shape = (max_rows, MAX_GROUPS)
        self.pool_buffer = torch.empty(shape, dtype=torch.int32, device=device)
        tails = (getattr(attn.indexer, "tail_cache", None) for attn in attentions)
        self.steps = PlannedSteps(
            layer=str(attentions[0].indexer.k_cache.prefix) if attentions else "",
            max_rows=max_rows,
            ignored=(str(t.prefix) for t in tails if t is not None),
        )
        impls = [attn.mla_attn.mla_attn.impl for attn in attentions]
        groups = [getattr(impl, "index_group", None) for impl in impls]
        self.why_not_fused = list(map(why_not_fusable, impls, groups))
        self.remaps: dict[str, FusedRemap] = {}
        if attentions and not any(self.why_not_fused):
            for attn, impl, group in zip(attentions, impls, groups, strict=True):
                remap = FusedRemap(group, self)
                self.remaps[str(attn.indexer.k_cache.prefix)] = remap
                group.conversion = remap
                impl.convert_decode_through_index_group = True
        self.warmup = StageWarmup(self, attentions, self_check, seed)

    @property
    def fuse(self) -> bool:
        return bool(self.remaps)

    def warmup_keys(self, kernel, vllm_config=None) -> list:
        return self.warmup.keys(kernel, vllm_config)

    def warm(self, kernel, compile_keys: list) -> None:
        self.warmup.compiled(kernel, compile_keys)

    def checked(self, compile_key):
        """The executor of ``compile_key`` in the warmup's last passing
        verdict, else None (stock runs). Every launch of the stage asks here."""
        return self.executors.get(compile_key)

    def upcast(self, logits: torch.Tensor, row_ends: torch.Tensor) -> torch.Tensor:
        """``as_fp32_logits``, same arguments."""
        out = self.kernels.upcast.serve(logits=logits, row_ends=row_ends)
        return as_fp32_logits(logits, row_ends) if out is STOCK else out

    def expand(self, pool_ids, positions, out) -> None:
        """``out[:, :pools * 4 + 3] = expand_pools_and_append_tail(pool_ids,
        positions.to(torch.int32) + 1, 4)``: the stock decode's expansion."""
        arguments = dict(pool_ids=pool_ids, seq_lens=positions, pool_size=POOL)
        arguments |= dict(seq_offset=1, out=out, int32_lengths=True)
        if self.kernels.expand.serve(**arguments) is STOCK:
            expand_pools_and_append_tail(
                pool_ids, positions.to(torch.int32), POOL, seq_offset=1, out=out
            )

    def materialize(self, pending: Deferred, logical: torch.Tensor) -> None:
        """The logical top-k rows the stock indexer would have written."""
        logical.fill_(-1)
        self.expand(*pending, logical[: pending.pool_ids.shape[0]])

    def pool_ids(self, rows: int, k: int, device, deferring: bool) -> torch.Tensor:
        """Where a step's pool top-k goes: the stage's buffer where the step
        defers (the conversion reads it later), else a new tensor as stock's."""
        if not deferring:
            return torch.empty((rows, k), dtype=torch.int32, device=device)
        return self.pool_buffer.view(-1)[: rows * k].view(rows, k)

    def planned(self) -> bool:
        """Whether the current forward pass is a planned step of this stage."""
        return (
            bool(self.executors)
            and is_forward_context_available()
            and self.steps.covers(get_forward_context())
        )

    def decode_step(
        self,
        metadata,
        layer,
        positions,
        topk_tokens: int,
        pool_size: int,
        buffer: torch.Tensor,
    ) -> LayerStep | None:
        """``layer``'s decode in a planned step, else None (stock). It defers
        its pool top-k where its rows are the decode tokens in order (no
        prefill, padding or short causal fill) and ``defers`` says it can."""
        if not self.planned():
            return None
        remap, rows, width = None, metadata.num_decode_tokens, buffer.shape[1]
        if (
            metadata.num_prefills == 0
            and positions is not None
            and not metadata.decode.requires_padding
            and metadata.max_seq_len > topk_tokens
            and self.defers(layer, rows, topk_tokens // pool_size, pool_size, width)
        ):
            remap = self.remaps[str(layer)]
        return LayerStep(self, remap)

    def defers(self, layer, rows: int, groups: int, pool_size: int, width: int):
        """Whether ``rows`` decode rows of ``layer`` can hand their pool
        top-k over: a fused layer, the stage's buffer, the remap's shapes."""
        if str(layer) not in self.remaps or rows > self.max_rows:
            return False
        return remap_takes(groups, width, pool_size)

    def engagement(self, attentions) -> list[str]:
        """What a planned step runs on each DSA layer, and why not the rest."""
        scales = "MX scales" if self.mx_scales else "FP32 scales"
        upcast = "no upcast (FP32 logits, stock returns them)"
        upcast = "upcast" if self.mx_scales else upcast
        if self.scores:
            # The kernel takes FP32 scales only: with MX scales DeepGEMM's run.
            scores = "scores (opt-in) or DeepGEMM scores"
            if self.mx_scales:
                scores = "DeepGEMM scores (MX scales)"
            upcast = f"{scores}, {upcast}"
        fused = "fused expand + remap"
        if self.select:
            rows = "one wave of rows" if self.select_one_wave else "every batch"
            fused = f"select (opt-in, {rows}), {fused}"
        lines = []
        for attn, why in zip(attentions, self.why_not_fused, strict=True):
            name = str(attn.indexer.k_cache.prefix).removesuffix(".indexer.k_cache")
            why = why or "another layer is not"
            tail = fused if self.fuse else f"expand, stock conversion ({why})"
            lines.append(f"{name}: update ({scales}), {upcast}, {tail}")
        return lines
