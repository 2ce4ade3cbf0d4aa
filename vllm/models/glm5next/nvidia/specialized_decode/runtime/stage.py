# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``dsa_kpool`` stage of one engine: what its planned decode steps run
in place of the stock kpool indexer, and the state they need.

The indexer (patch 0002) asks the stage for a ``LayerStep`` at the top of
its decode branch and calls it twice: for the tail update, and from the
scores on (``decode_rows``). Each fused layer's index group converts through
its ``FusedRemap`` (patch 0005's ``conversion`` hook), which expands the
pool top-k that ``decode_rows`` deferred to it.

Every kernel launch goes through the stage's own kernel instances
(``KpoolStage.kernels``): the kernel's call, its rule, then an executor this
stage's warmup compiled and self-checked for the arguments' key; anything
else returns ``STOCK`` and the stock kernel runs.
"""

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
from ..cutedsl.common.host import STOCK, Refused
from ..cutedsl.expand.launch import ExpandKernel
from ..cutedsl.remap.launch import RemapKernel, check_shape
from ..cutedsl.select.launch import SelectKernel, one_wave, sm_count
from ..cutedsl.upcast.launch import UpcastKernel
from ..cutedsl.update.launch import UpdateKernel
from .remap import Deferred, FusedRemap, why_not_fusable
from .steps import PlannedSteps
from .warmup import StageWarmup


class StageKernels(NamedTuple):
    """A stage's instances of the kernels (``KpoolKernel(stage)``)."""

    update: UpdateKernel
    expand: ExpandKernel
    remap: RemapKernel
    upcast: UpcastKernel
    select: SelectKernel


class LayerStep:
    """One DSA layer's decode in a planned step (a ``hook.KpoolLayerStep``):
    patch 0002's calls, and whether it defers its pool top-k to the layer's
    conversion (``deferring``: the indexer then leaves its logical rows
    unfilled)."""

    def __init__(self, stage: "KpoolStage", remap: FusedRemap | None):
        self.stage, self.remap = stage, remap
        self.deferring = remap is not None

    def update(self, *stock_args, round_scale=True) -> None:
        """``kpool_decode_update_and_maybe_write_cache_batched(*stock_args,
        round_scale=round_scale)``: its positional arguments, as the indexer
        passes them."""
        stage = self.stage
        if (
            stage.kernels.update.serve(
                *stock_args, mx_scales=stage.mx_scales, round_scale=round_scale
            )
            is STOCK
        ):
            kpool_decode_update_and_maybe_write_cache_batched(
                *stock_args, round_scale=round_scale
            )

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
        """The stock decode from the scores on, for rows without padding:
        DeepGEMM's paged scores, ``as_fp32_logits``, the pool top-k
        (``get_indexer_topk(topk_backend)``, or the opt-in select), then the
        pool expansion into ``buffer``, or the hand-over of the pool ids to
        the layer's conversion (``deferring``). False: the step's rows need
        padding, and stock runs (``decode_step`` never defers such a step)."""
        if decode.requires_padding or positions is None:
            return False
        next_n = q[0].shape[1]
        seq_lens = decode.seq_lens[: q[0].shape[0]]
        logits = fp8_fp4_paged_mqa_logits(
            q,
            kv_cache,
            weights,
            seq_lens,
            decode.block_table,
            decode.schedule_metadata,
            max_model_len=max_model_len,
            indices=decode.indices,
        )
        rows, k = logits.shape[0], topk_tokens // POOL
        ends = seq_lens.view(-1)
        stage = self.stage
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

    def selected(self, logits, ends, k: int, out) -> bool:
        """Whether the opt-in select wrote the top ``k`` pools below ``ends``
        into ``out``: where the deployment opted in, the step defers (its
        pool order reaches no consumer as logical rows) and this stage's
        warmup compiled the key: at every batch size, so that a row's pools do not
        depend on its batch, or (``select_one_wave``) only where one wave of
        clusters holds the rows. It reads the logits as DeepGEMM gives them
        (BF16 or FP32: no upcast)."""
        stage = self.stage
        return (
            stage.select
            and self.deferring
            and (
                not stage.select_one_wave
                or one_wave(logits.shape[0], logits.shape[1], logits.dtype, stage.sms)
            )
            and stage.kernels.select.serve(logits=logits, ends=ends, k=k, out=out)
            is not STOCK
        )


class KpoolStage:
    """The kpool indexer decode kernels inside one engine's planned steps
    (stage ``dsa_kpool``), reached from the stock indexer through
    ``sparse_indexer.SPECIALIZED_KPOOL``.

    It owns the engine's state: which steps are planned (``steps``), its
    own instance of each kernel (``kernels``), its JIT warmup (``warmup``)
    and the executors that warmup compiled and self-checked (``executors``:
    none before, and no step is planned before), the scale format
    (``mx_scales``, read once at install), the pool buffer deferring steps
    write, whether the opt-in select runs (``select``; ``select_one_wave``:
    only where one wave holds the rows, with the SMs its rules count) and
    each fused layer's ``FusedRemap``. Where every
    DSA layer's index group can take a ``FusedRemap`` (``fuse``), the
    indexer leaves its decode rows as pool ids and skips filling the logical
    top-k buffer, which no consumer reads; ``why_not_fused`` says, per
    layer, which requirement failed otherwise.
    """

    def __init__(
        self,
        attentions,
        max_rows: int,
        device,
        *,
        mx_scales: bool,
        select: bool = False,
        select_one_wave: bool = False,
        self_check: str = "on",
        seed: int | None = None,
    ):
        attentions = list(attentions)
        self.max_rows, self.mx_scales, self.select = max_rows, mx_scales, select
        self.select_one_wave = select and select_one_wave
        self.executors: dict = {}
        self.kernels = StageKernels(
            UpdateKernel(self),
            ExpandKernel(self),
            RemapKernel(self),
            UpcastKernel(self),
            SelectKernel(self),
        )
        device = torch.device(device)
        # A CUDA tensor's device always carries its index.
        self.sms = sm_count(device.index or 0) if select else 0
        self.pool_buffer = torch.empty(
            (max_rows, MAX_GROUPS), dtype=torch.int32, device=device
        )
        tails = (getattr(attn.indexer, "tail_cache", None) for attn in attentions)
        self.steps = PlannedSteps(
            layer=str(attentions[0].indexer.k_cache.prefix) if attentions else "",
            max_rows=max_rows,
            ignored=(str(t.prefix) for t in tails if t is not None),
        )
        impls = [attn.mla_attn.mla_attn.impl for attn in attentions]
        groups = [getattr(impl, "index_group", None) for impl in impls]
        self.why_not_fused = [
            why_not_fusable(impl, group)
            for impl, group in zip(impls, groups, strict=True)
        ]
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

    # --- Launches ---------------------------------------------------------

    def upcast(self, logits: torch.Tensor, row_ends: torch.Tensor) -> torch.Tensor:
        """``as_fp32_logits``, same arguments."""
        out = self.kernels.upcast.serve(logits=logits, row_ends=row_ends)
        return as_fp32_logits(logits, row_ends) if out is STOCK else out

    def expand(self, pool_ids, positions, out) -> None:
        """``out[:, :pools * 4 + 3] = expand_pools_and_append_tail(pool_ids,
        positions.to(torch.int32) + 1, 4)``: the stock decode's expansion of
        a top-k row into the logical rows."""
        if (
            self.kernels.expand.serve(
                pool_ids=pool_ids,
                seq_lens=positions,
                pool_size=POOL,
                seq_offset=1,
                out=out,
                int32_lengths=True,
            )
            is STOCK
        ):
            expand_pools_and_append_tail(
                pool_ids, positions.to(torch.int32), POOL, seq_offset=1, out=out
            )

    def materialize(self, pending: Deferred, logical: torch.Tensor) -> None:
        """The logical top-k rows the stock indexer would have written."""
        logical.fill_(-1)
        rows = pending.pool_ids.shape[0]
        self.expand(pending.pool_ids, pending.positions, logical[:rows])

    def pool_ids(self, rows: int, k: int, device, deferring: bool) -> torch.Tensor:
        """Where a step's pool top-k goes: the stage's buffer where the step
        defers (the conversion reads it later), else a new tensor as
        stock's."""
        if not deferring:
            return torch.empty((rows, k), dtype=torch.int32, device=device)
        return self.pool_buffer.view(-1)[: rows * k].view(rows, k)

    # --- Routing ----------------------------------------------------------

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
        """The decode of ``layer``'s indexer in a planned step, else None
        (stock). The step defers its pool top-k where its rows are the
        decode tokens in order (no prefill, padding or short causal fill)
        of a fused layer, within the stage's buffer and the remap's shapes."""
        if not self.planned():
            return None
        remap = None
        if (
            metadata.num_prefills == 0
            and positions is not None
            and not metadata.decode.requires_padding
            and metadata.max_seq_len > topk_tokens
            and self.defers(
                layer,
                metadata.num_decode_tokens,
                topk_tokens // pool_size,
                pool_size,
                buffer.shape[1],
            )
        ):
            remap = self.remaps[str(layer)]
        return LayerStep(self, remap)

    def defers(self, layer, rows: int, groups: int, pool_size: int, width: int):
        """Whether ``rows`` decode rows of ``layer`` can hand their pool
        top-k over: a fused layer, the stage's buffer, the remap's shapes."""
        if str(layer) not in self.remaps or rows > self.max_rows:
            return False
        try:
            check_shape(groups, width, pool_size, counts=True)
        except Refused:
            return False
        return True

    def engagement(self, attentions) -> list[str]:
        """What a planned step runs on each DSA layer, and why not the rest."""
        scales = "MX scales" if self.mx_scales else "FP32 scales"
        upcast = (
            "upcast"
            if self.mx_scales
            else "no upcast (FP32 logits, stock returns them)"
        )
        lines = []
        for attn, why in zip(attentions, self.why_not_fused, strict=True):
            name = str(attn.indexer.k_cache.prefix).removesuffix(".indexer.k_cache")
            if self.fuse:
                tail = "fused expand + remap"
                if self.select:
                    rows = "one wave of rows" if self.select_one_wave else "every batch"
                    tail = f"select (opt-in, {rows}), {tail}"
            else:
                tail = f"expand, stock conversion ({why or 'another layer is not'})"
            lines.append(f"{name}: update ({scales}), {upcast}, {tail}")
        return lines
