# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``dsa_kpool`` stage of one engine: what its planned decode steps run
in place of the stock kpool indexer kernels, and the state they need.

Every switch from stock to the stage is one of these three, all made here or
by ``install``:

1. ``sparse_indexer.SPECIALIZED_KPOOL`` (patch 0002): the indexer's decode
   branch asks ``decode_step`` and, in a planned step, calls the returned
   ``LayerStep`` for the tail update, the upcast (where the deployment opts
   in, ``kpool_select``, the select there, and then no stock top-k) and the
   pool expansion;
2. each fused layer's ``SparseMLAIndexGroup._convert_once`` becomes its
   ``FusedRemap``: the group calls that attribute for every conversion and
   vLLM has no hook there, so the stage replaces it (stock again with no
   deferred top-k);
3. each fused layer's ``convert_decode_through_index_group`` (patch 0005's
   flag, default False) is set, so the backends that convert the top-k
   themselves convert decode-only steps through the group.
"""

import torch

from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
from vllm.models.glm5next.nvidia.ops.kpool_compress import (
    expand_pools_and_append_tail,
    kpool_decode_update_and_maybe_write_cache_batched,
)
from vllm.models.glm5next.nvidia.specialized_decode.constants import (
    DIM,
    MAX_GROUPS,
    POOL,
)
from vllm.models.glm5next.nvidia.specialized_decode.expand_kernel import (
    EXPAND,
    ExpandArgs,
)
from vllm.models.glm5next.nvidia.specialized_decode.fused_remap import (
    Deferred,
    FusedRemap,
    why_not_fusable,
)
from vllm.models.glm5next.nvidia.specialized_decode.remap_kernel import shape_takes
from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import (
    SELECT,
    SelectArgs,
    one_wave,
    sm_count,
)
from vllm.models.glm5next.nvidia.specialized_decode.steps import PlannedSteps
from vllm.models.glm5next.nvidia.specialized_decode.upcast_kernel import (
    UPCAST,
    UpcastArgs,
)
from vllm.models.glm5next.nvidia.specialized_decode.update_kernel import (
    UPDATE,
    UpdateArgs,
)
from vllm.utils.deep_gemm import mqa_logits_use_mx_scales

# --- Kernel or stock: each kernel's rule and readiness decide, else stock ----


def update_or_stock(*stock_args, round_scale=True) -> None:
    """``kpool_decode_update_and_maybe_write_cache_batched(*stock_args,
    round_scale=round_scale)``: its positional arguments, as the indexer
    passes them."""
    if len(stock_args) == 9:  # head_dim left to its default
        stock_args = (*stock_args, DIM)
    args = UpdateArgs(*stock_args, mqa_logits_use_mx_scales(), round_scale)
    if UPDATE.run_if_ready(args) is None:
        kpool_decode_update_and_maybe_write_cache_batched(
            *stock_args, round_scale=round_scale
        )


def upcast_or_stock(logits: torch.Tensor, row_ends: torch.Tensor) -> torch.Tensor:
    """``as_fp32_logits``, same arguments."""
    done = UPCAST.run_if_ready(UpcastArgs(logits, row_ends))
    return as_fp32_logits(logits, row_ends) if done is None else done.out


def expand_or_stock(
    pool_ids, seq_lens, pool_size, *, seq_offset=0, out=None, int32_lengths=False
) -> torch.Tensor:
    """``expand_pools_and_append_tail(pool_ids, seq_lens, pool_size,
    seq_offset=, out=)``, of ``seq_lens.to(torch.int32)`` with
    ``int32_lengths`` (the stock decode's lengths)."""
    args = ExpandArgs(pool_ids, seq_lens, pool_size, seq_offset, out, int32_lengths)
    if EXPAND.run_if_ready(args) is not None:
        return out
    if int32_lengths:
        seq_lens = seq_lens.to(torch.int32)
    return expand_pools_and_append_tail(
        pool_ids, seq_lens, pool_size, seq_offset=seq_offset, out=out
    )


def _selected(*stock_args) -> None:
    """The top-k of a step whose select already wrote the pool ids."""


class LayerStep:
    """One DSA layer's decode in a planned step: the calls of patch 0002,
    and whether this step defers its pool top-k to the layer's conversion
    (``deferring``; the indexer then leaves its logical rows unfilled).

    With the opt-in select (``kpool_select``), a deferring step offers the
    logits to it at the upcast, where they arrive with their row ends: where
    it takes them (``selected``) it writes the step's pool ids, the logits
    stay as DeepGEMM returned them (no upcast: the select reads BF16) and the
    top-k runs nothing; else the stock upcast and top-k run."""

    update = staticmethod(update_or_stock)

    def __init__(
        self, stage: "KpoolStage", remap: FusedRemap | None, k: int | None = None
    ):
        self.stage, self.remap = stage, remap
        self.deferring = remap is not None
        # The pools a row selects, where this step may run the select.
        self.select_k = k if self.deferring and stage.select else None
        self.selected = False

    def upcast(self, logits: torch.Tensor, row_ends: torch.Tensor) -> torch.Tensor:
        """``as_fp32_logits``, same arguments; the logits themselves where
        this step's select took them."""
        if self.select_k is not None and self.select(logits, row_ends):
            return logits
        return upcast_or_stock(logits, row_ends)

    def select(self, logits: torch.Tensor, ends: torch.Tensor) -> bool:
        """Runs the select of ``logits`` below ``ends`` into the step's pool
        ids where its rule takes them, warmup compiled their key, and all
        rows fit one wave (else stock's top-k is faster)."""
        rows, width = logits.shape
        stage = self.stage
        if rows > stage.max_rows or not one_wave(rows, width, logits.dtype, stage.sms):
            return False
        out = self.pool_topk(rows, self.select_k, logits.device)
        args = SelectArgs(logits, ends, self.select_k, out)
        self.selected = SELECT.run_if_ready(args) is not None
        return self.selected

    def top_k(self, stock):
        """The top-k to call: ``stock`` (``get_indexer_topk(backend)``), or
        nothing where the select ran."""
        return _selected if self.selected else stock

    def pool_topk(self, rows: int, groups: int, device) -> torch.Tensor:
        """Where the top-k select writes the step's pool ids."""
        if not self.deferring:
            return torch.empty((rows, groups), dtype=torch.int32, device=device)
        return self.stage.pool_buffer.view(-1)[: rows * groups].view(rows, groups)

    def resolve(self, pool_topk, positions, decode_metadata, buffer) -> bool:
        """Hands a deferred pool top-k to the layer's conversion, or expands
        uniform rows into ``buffer`` as the stock decode would. False: the
        stock expansion runs."""
        rows = pool_topk.shape[0]
        if self.deferring:
            self.remap.hand_over(Deferred(pool_topk, positions[:rows]))
            return True
        if positions is None or decode_metadata.requires_padding:
            return False
        expand_or_stock(
            pool_topk,
            positions[:rows],
            POOL,
            seq_offset=1,
            out=buffer[:rows],
            int32_lengths=True,
        )
        return True


class KpoolStage:
    """The kpool indexer decode kernels inside one engine's planned steps
    (stage ``dsa_kpool``), reached from the stock indexer through
    ``sparse_indexer.SPECIALIZED_KPOOL``.

    It owns all of the engine's state: which steps are planned
    (``steps``), whether its warmup compiled and checked the kernels
    (``warmed``: no step is planned before), the pool buffer deferred steps
    write, whether the opt-in select runs (``select``, with the SMs its
    one-wave rule counts), and each fused layer's ``FusedRemap`` with its
    hand-off. Where
    every DSA layer's index group can take a ``FusedRemap`` (``fuse``), the
    indexer leaves its uniform decode rows as pool ids and skips filling the
    logical top-k buffer, which no consumer reads; ``why_not_fused`` says,
    per layer, which requirement failed otherwise.
    """

    update = staticmethod(update_or_stock)
    upcast = staticmethod(upcast_or_stock)
    expand = staticmethod(expand_or_stock)

    def __init__(self, attentions, max_rows: int, device, *, select: bool = False):
        attentions = list(attentions)
        self.max_rows = max_rows
        self.warmed = False
        # The opt-in select (``kpool_select``), and the SMs its waves count.
        self.select = select
        self.sms = sm_count(torch.device(device)) if select else 0
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
                group._convert_once = remap  # switch 2 (module docstring)
                impl.convert_decode_through_index_group = True  # switch 3

    @property
    def fuse(self) -> bool:
        return bool(self.remaps)

    def planned(self) -> bool:
        """Whether the current forward pass is a planned step of this stage."""
        return (
            self.warmed
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
        return LayerStep(self, remap, topk_tokens // pool_size)

    def defers(self, layer, rows: int, groups: int, pool_size: int, width: int):
        """Whether ``rows`` decode rows of ``layer`` can hand their pool
        top-k over: a fused layer, the stage's buffer, the remap's shapes."""
        return (
            str(layer) in self.remaps
            and rows <= self.max_rows
            and shape_takes(groups, width, pool_size, counts=True)
        )

    @staticmethod
    def materialize(pending: Deferred, logical: torch.Tensor) -> None:
        """The logical top-k rows the stock indexer would have written."""
        logical.fill_(-1)
        rows = pending.pool_ids.shape[0]
        expand_or_stock(
            pending.pool_ids,
            pending.positions,
            POOL,
            seq_offset=1,
            out=logical[:rows],
            int32_lengths=True,
        )

    def engagement(self, attentions) -> list[str]:
        """What a planned step runs on each DSA layer, and why not the rest."""
        mx = mqa_logits_use_mx_scales()
        scales = "MX scales" if mx else "FP32 scales"
        upcast = "upcast" if mx else "no upcast (FP32 logits, stock returns them)"
        lines = []
        for attn, why in zip(attentions, self.why_not_fused, strict=True):
            name = str(attn.indexer.k_cache.prefix).removesuffix(".indexer.k_cache")
            if self.fuse:
                tail = "fused expand + remap"
                if self.select:
                    tail = f"select (opt-in, one wave of rows), {tail}"
            else:
                tail = f"expand, stock conversion ({why or 'another layer is not'})"
            lines.append(f"{name}: update ({scales}), {upcast}, {tail}")
        return lines
