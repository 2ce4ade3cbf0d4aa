# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kpool indexer's decode kernels in CuTe DSL, bit for bit with the stock
Triton kernels of ``ops/kpool_compress.py``, ``as_fp32_logits`` and the
sparse MLA index conversion, and the stage that runs them in planned decode
steps.

Each public function takes what its kernel's rule (``*_unmet`` in the kernel
modules) admits and raises ``ValueError`` naming the argument otherwise;
``KpoolStage`` routes every input a rule refuses, or whose kernel was not
compiled at warmup, to the stock function. Kernels compile at the JIT warmup
(``launch.py``) and launch through TVM-FFI on torch's current stream, with PDL.
"""

import torch

from vllm.forward_context import in_piecewise_cudagraph
from vllm.logger import init_logger
from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
from vllm.models.glm5next.nvidia.ops.kpool_compress import (
    expand_pools_and_append_tail,
    kpool_decode_update_and_maybe_write_cache_batched,
)
from vllm.models.glm5next.nvidia.specialized_decode import planned
from vllm.models.glm5next.nvidia.specialized_decode.expand_kernel import (
    EXPAND,
    ExpandPoolsKernel,
    expand_unmet,
)
from vllm.models.glm5next.nvidia.specialized_decode.launch import warming_up
from vllm.models.glm5next.nvidia.specialized_decode.remap_kernel import (
    MAX_GROUPS,
    REMAP,
    ExpandRemapKernel,
    remap_shape_unmet,
    remap_unmet,
)
from vllm.models.glm5next.nvidia.specialized_decode.upcast_kernel import (
    UPCAST,
    UPCAST_LAUNCH,
    UpcastLogitsKernel,
    upcast_unmet,
)
from vllm.models.glm5next.nvidia.specialized_decode.update_kernel import (
    DIM,
    POOL,
    UPDATE,
    KpoolUpdateKernel,
    update_unmet,
)
from vllm.utils.deep_gemm import mqa_logits_use_mx_scales
from vllm.utils.torch_utils import current_stream
from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

logger = init_logger(__name__)


def kpool_update(
    kv_cache: torch.Tensor,
    tail_kv_cache: torch.Tensor,
    tail_slot_mapping: torch.Tensor,
    key: torch.Tensor,
    slot_score: torch.Tensor,
    ape: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    pool_size: int,
    *,
    mx_scales: bool = True,
    round_scale: bool = True,
) -> None:
    """``kpool_decode_update_and_maybe_write_cache_batched`` for ``head_dim``
    128 with the same arguments; ``mx_scales`` is what the stock kernel reads
    from ``mqa_logits_use_mx_scales()`` (UE8M0 bytes, else FP32 scales)."""
    if key.ndim >= 2 and (key.shape[0] == 0 or key.shape[1] == 0):
        return
    args = (
        kv_cache,
        tail_kv_cache,
        tail_slot_mapping,
        key,
        slot_score,
        ape,
        slot_mapping,
        positions,
    )
    _raise_if(update_unmet(*args, pool_size))
    UPDATE.run(_update_key(*args, mx_scales, round_scale), *args)


def expand_pools(
    pool_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    pool_size: int,
    *,
    seq_offset: int = 0,
    out: torch.Tensor,
) -> torch.Tensor:
    """``expand_pools_and_append_tail(..., seq_offset=, out=)`` for int32 pool
    ids: writes the ``pools * 4 + 3`` first columns of ``out`` and returns it."""
    _raise_if(expand_unmet(pool_ids, seq_lens, pool_size, seq_offset, out))
    if pool_ids.shape[0]:
        key = EXPAND.key(pool_ids.shape[1], seq_lens.dtype)
        EXPAND.run(key, pool_ids, seq_lens, out, seq_offset)
    return out


def expand_and_remap(
    pool_ids: torch.Tensor,
    positions: torch.Tensor,
    pool_size: int,
    req_ids: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    counts: torch.Tensor | None = None,
    *,
    block_size: int,
    stride_rows: int,
    seq_offset: int = 1,
) -> None:
    """``triton_convert_req_index_to_global_index(req_ids, block_table,
    logical, BLOCK_SIZE=block_size, BLOCK_STRIDE_ROWS=stride_rows,
    return_valid_counts=counts is not None, out=out, valid_counts_out=counts)``
    where ``logical`` (``out``'s shape) holds, in its first
    ``pool_ids.shape[0]`` rows, ``expand_pools_and_append_tail(pool_ids,
    positions, pool_size, seq_offset=seq_offset)`` and -1 everywhere else."""
    args = (pool_ids, positions, pool_size, req_ids, block_table, out, counts)
    _raise_if(remap_unmet(*args, block_size, seq_offset))
    if req_ids.shape[0]:
        key = _remap_key(pool_ids, positions, out, counts, block_size, stride_rows)
        REMAP.run(
            key, pool_ids, positions, req_ids, block_table, out, counts, seq_offset
        )


def upcast_logits(
    logits: torch.Tensor, row_ends: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``as_fp32_logits`` of BF16 logits: the columns below each row end in
    FP32, in ``out`` if given (else a new tensor with the strides of
    ``logits``), the other columns untouched."""
    _raise_if(upcast_unmet(logits, row_ends, out))
    return _upcast(*UPCAST_LAUNCH, logits, row_ends, out)


def _upcast(compile_key, ctas, logits, row_ends, out) -> torch.Tensor:
    """The upcast launch of arguments its rule took (allocates ``out`` if
    None, as stock does)."""
    if out is None:
        # One call less than torch.empty_strided(..., device=...): ~0.3 us
        # of an eager upcast's ~9 (measured on the CPU machine).
        out = logits.new_empty_strided(
            logits.shape, logits.stride(), dtype=torch.float32
        )
    if logits.numel():
        UPCAST.run(compile_key, logits, out, row_ends, ctas)
    return out


def _raise_if(problem: str | None) -> None:
    if problem is not None:
        raise ValueError(problem)


def _update_key(
    kv_cache,
    tail_kv_cache,
    tail_slot_mapping,
    key,
    slot_score,
    ape,
    slot_mapping,
    positions,
    mx_scales,
    round_scale,
) -> KpoolUpdateKernel.CompileKey:
    return UPDATE.key(
        tail_kv_cache.shape[2],
        kv_cache.shape[1],
        kv_cache.stride(0),
        tail_kv_cache.stride(0),
        tail_kv_cache.stride(1),
        mx_scales,
        round_scale,
        tail_slot_mapping.dtype,
        slot_mapping.dtype,
        positions.dtype,
    )


def _remap_key(
    pool_ids, positions, out, counts, block_size, stride_rows
) -> ExpandRemapKernel.CompileKey:
    return REMAP.key(
        pool_ids.shape[1],
        out.shape[1],
        block_size,
        stride_rows,
        positions.dtype,
        counts is not None,
    )


# --- Integration ------------------------------------------------------------


class FusedRemap:
    """A sparse MLA index group's ``_convert_once`` that expands a deferred
    pool top-k and remaps it in one kernel, on the group's side stream as the
    stock conversion, with or without counts. Without a deferred top-k, or
    when the kernel declines it, the stock conversion runs (declined: on the
    logical rows ``materialize`` writes first)."""

    def __init__(self, group: SparseMLAIndexGroup, stage: "KpoolStage"):
        self.group, self.stage = group, stage
        self.stock = group._convert_once
        group._convert_once = self

    def __call__(
        self,
        layer_index,
        logical,
        req_ids,
        block_table,
        block_size,
        *,
        block_stride_rows,
        return_valid_counts,
        idx_mapping=None,
    ):
        pending, self.stage.pending = self.stage.pending, None
        kwargs = dict(
            block_stride_rows=block_stride_rows,
            return_valid_counts=return_valid_counts,
        )
        if idx_mapping is not None:
            kwargs["idx_mapping"] = idx_mapping
        if pending is not None:
            fused = self._fused(
                pending,
                layer_index,
                logical,
                req_ids,
                block_table,
                block_size,
                block_stride_rows,
                return_valid_counts,
                idx_mapping,
            )
            if fused is not None:
                return fused
            # The stock conversion reads the logical rows: write them, and
            # record that they are ready now (the indexer's record came before
            # them; the side stream of the stock conversion waits on it).
            self.stage.materialize(pending, logical)
            self.group.set_logical_topk_ready(layer_index)
        return self.stock(
            layer_index, logical, req_ids, block_table, block_size, **kwargs
        )

    def _fused(
        self,
        pending,
        layer_index,
        logical,
        req_ids,
        block_table,
        block_size,
        block_stride_rows,
        return_valid_counts,
        idx_mapping,
    ):
        """The fused conversion's result, or None where it does not apply."""
        group = self.group
        rows = logical.shape[0]
        if (
            layer_index != 0
            or idx_mapping is not None
            or rows > group.physical_topk_indices.shape[0]
        ):
            return None
        pool_ids, positions, pool_size = pending
        out = group.physical_topk_indices[:rows]
        counts = group.valid_topk_counts[:rows] if return_valid_counts else None
        stride_rows = block_size if block_stride_rows is None else block_stride_rows
        if (
            remap_unmet(
                pool_ids,
                positions,
                pool_size,
                req_ids,
                block_table,
                out,
                counts,
                block_size,
                1,
            )
            is not None
        ):
            return None
        key = _remap_key(pool_ids, positions, out, counts, block_size, stride_rows)
        if not REMAP.ready(key):
            return None
        compute_stream = current_stream()
        if not in_piecewise_cudagraph():
            group.side_stream.wait_event(group.logical_topk_ready)
        else:
            group.side_stream.wait_stream(compute_stream)
        with group.side_stream:
            REMAP.run(key, pool_ids, positions, req_ids, block_table, out, counts, 1)
            group.physical_topk_ready.record(group.side_stream)
        compute_stream.wait_event(group.physical_topk_ready)
        return (out, counts) if return_valid_counts else out


class KpoolStage:
    """The kpool indexer decode kernels inside planned steps (stage
    ``dsa_kpool``), reached from the stock indexer through
    ``sparse_indexer.SPECIALIZED_KPOOL``.

    With ``fuse`` every DSA layer's index group converts through
    ``FusedRemap``: the indexer then leaves its uniform decode rows as pool ids
    (``resolve`` defers them) and skips filling the logical top-k buffer,
    which no consumer reads. ``why_not_fused`` says, per layer, which group
    requirement failed otherwise.
    """

    def __init__(self, attentions, max_rows: int, device):
        self.pending: tuple[torch.Tensor, torch.Tensor, int] | None = None
        # Whether the current decode step of a layer defers its top-k.
        self.deferring = False
        self.fuse = False
        # Indexer caches of the fused layers: others (the MTP draft's) never
        # reach a FusedRemap, so they must not defer.
        self.layers: set[str] = set()
        self.max_rows = max_rows
        self.pool_buffer = torch.empty(
            (max_rows, MAX_GROUPS), dtype=torch.int32, device=device
        )
        impls = [attn.mla_attn.mla_attn.impl for attn in attentions]
        groups = [getattr(impl, "index_group", None) for impl in impls]
        self.why_not_fused = [
            self._unfusable(impl, group)
            for impl, group in zip(impls, groups, strict=True)
        ]
        if attentions and not any(self.why_not_fused):
            self.fuse = True
            self.layers = {str(attn.indexer.k_cache.prefix) for attn in attentions}
            for impl, group in zip(impls, groups, strict=True):
                FusedRemap(group, self)
                # Decode-only steps convert through the group (patch 0005).
                impl.convert_decode_through_index_group = True

    @staticmethod
    def _unfusable(impl, group) -> str | None:
        """Why ``group`` cannot convert through a ``FusedRemap``, or None."""
        requirements = (
            (type(group) is SparseMLAIndexGroup, "not a plain SparseMLAIndexGroup"),
            (getattr(group, "has_indexer", False), "no indexer"),
            (getattr(group, "num_layers", 0) == 1, "more than one layer"),
            (getattr(impl, "dcp_world_size", 1) == 1, "decode context parallel"),
            (
                _converts_through_group(impl),
                f"{type(impl).__name__} converts the logical top-k rows itself",
            ),
        )
        return next((why for ok, why in requirements if not ok), None)

    def engagement(self, attentions) -> list[str]:
        """What a planned step runs on each DSA layer, and why not the rest."""
        scales = "MX scales" if mqa_logits_use_mx_scales() else "FP32 scales"
        upcast = (
            "upcast"
            if mqa_logits_use_mx_scales()
            else "no upcast (FP32 logits, stock returns them)"
        )
        lines = []
        for attn, why in zip(attentions, self.why_not_fused, strict=True):
            name = str(attn.indexer.k_cache.prefix).removesuffix(".indexer.k_cache")
            if self.fuse:
                tail = "fused expand + remap"
            else:
                tail = f"expand, stock conversion ({why or 'another layer is not'})"
            lines.append(f"{name}: update ({scales}), {upcast}, {tail}")
        return lines

    # --- The indexer's decode step (patch 0002's call sites) ---------------

    def decode_step(
        self,
        metadata,
        layer,
        positions,
        topk_tokens: int,
        pool_size: int,
        buffer: torch.Tensor,
    ) -> "KpoolStage | None":
        """This stage for the decode rows of ``layer``'s indexer in a planned
        step, else None (stock). Decides whether the step defers its pool
        top-k: rows that are the decode tokens in order (no prefill, padding
        or short causal fill) of a fused layer."""
        if not planned():
            return None
        groups = topk_tokens // pool_size
        self.deferring = (
            metadata.num_prefills == 0
            and positions is not None
            and not metadata.decode.requires_padding
            and metadata.max_seq_len > topk_tokens
            and self.defers(
                layer, metadata.num_decode_tokens, groups, pool_size, buffer.shape[1]
            )
        )
        return self

    def defers(self, layer, rows: int, groups: int, pool_size: int, width: int):
        """Whether ``rows`` decode rows of ``layer`` can hand their pool
        top-k over: a fused layer, the stage's buffer, the remap's shapes."""
        return (
            str(layer) in self.layers
            and rows <= self.max_rows
            and remap_shape_unmet(groups, width, pool_size, counts=True) is None
        )

    def pool_topk(self, rows: int, groups: int, device) -> torch.Tensor:
        """Where the top-k select writes the step's pool ids."""
        if not self.deferring:
            return torch.empty((rows, groups), dtype=torch.int32, device=device)
        return self.pool_buffer.view(-1)[: rows * groups].view(rows, groups)

    def resolve(self, pool_topk, positions, decode_metadata, buffer) -> bool:
        """Hands a deferred pool top-k to the layer's index remap, or expands
        uniform rows into ``buffer`` (seq_len = position + 1 added in the
        kernel). False: the stock expansion runs."""
        rows = pool_topk.shape[0]
        if self.deferring:
            self.deferring = False
            assert self.pending is None, "a deferred kpool top-k was not consumed"
            self.pending = (pool_topk, positions[:rows], POOL)
            return True
        if positions is None or decode_metadata.requires_padding:
            return False
        self.expand(pool_topk, positions[:rows], POOL, seq_offset=1, out=buffer[:rows])
        return True

    @classmethod
    def materialize(cls, pending, logical: torch.Tensor) -> None:
        """The logical top-k rows the stock indexer would have written."""
        pool_ids, positions, pool_size = pending
        logical.fill_(-1)
        cls.expand(
            pool_ids,
            positions,
            pool_size,
            seq_offset=1,
            out=logical[: pool_ids.shape[0]],
        )

    # --- Kernels or stock -----------------------------------------------------

    @staticmethod
    def update(
        kv_cache,
        tail_kv_cache,
        tail_slot_mapping,
        key,
        slot_score,
        ape,
        slot_mapping,
        positions,
        pool_size,
        head_dim=DIM,
        round_scale=True,
    ):
        args = (
            kv_cache,
            tail_kv_cache,
            tail_slot_mapping,
            key,
            slot_score,
            ape,
            slot_mapping,
            positions,
        )
        if update_unmet(*args, pool_size, head_dim) is None:
            compile_key = _update_key(*args, mqa_logits_use_mx_scales(), round_scale)
            if UPDATE.ready(compile_key):
                if key.shape[0] and key.shape[1]:
                    UPDATE.run(compile_key, *args)
                return
        kpool_decode_update_and_maybe_write_cache_batched(
            *args, pool_size, head_dim, round_scale=round_scale
        )

    @staticmethod
    def upcast(logits: torch.Tensor, row_ends: torch.Tensor) -> torch.Tensor:
        # Launches directly: the public function would check the rule again
        # (about 1.7 us of an eager upcast's ~9, on the CPU machine).
        if upcast_unmet(logits, row_ends) is None:
            compile_key, ctas = UPCAST_LAUNCH
            if UPCAST.ready(compile_key):
                return _upcast(compile_key, ctas, logits, row_ends, None)
        return as_fp32_logits(logits, row_ends)

    @staticmethod
    def expand(pool_ids, seq_lens, pool_size, *, seq_offset=0, out=None):
        if expand_unmet(pool_ids, seq_lens, pool_size, seq_offset, out) is None:
            compile_key = EXPAND.key(pool_ids.shape[1], seq_lens.dtype)
            if EXPAND.ready(compile_key):
                if pool_ids.shape[0]:
                    EXPAND.run(compile_key, pool_ids, seq_lens, out, seq_offset)
                return out
        return expand_pools_and_append_tail(
            pool_ids, seq_lens, pool_size, seq_offset=seq_offset, out=out
        )

    # --- Warmup -----------------------------------------------------------------

    def warmup(self, attentions, *, positions_dtype=torch.int64) -> list:
        """Compiles, on fake tensors, every kernel variant a planned step of
        these DSA layers can launch; returns their (kernel, compile key)."""
        keys = self.compile_keys(attentions, positions_dtype)
        with warming_up():
            for kernel, key in keys:
                kernel.compile(key)
        return keys

    def compile_keys(self, attentions, positions_dtype) -> list:
        """(kernel, compile key) of each variant these layers launch."""
        keys: dict = {}
        mx = mqa_logits_use_mx_scales()
        for attn in attentions:
            indexer = attn.indexer
            kv, tail = indexer.k_cache.kv_cache, indexer.tail_cache.kv_cache
            round_scale = indexer.scale_fmt is not None
            # Slot mappings come as the metadata's (int64) or the padded
            # layout's scatter of them; positions as the indexer's int32 copy.
            for slots in (torch.int64, torch.int32):
                key = KpoolUpdateKernel.CompileKey(
                    tail.shape[2],
                    kv.shape[1],
                    kv.stride(0),
                    tail.stride(0),
                    tail.stride(1),
                    mx,
                    round_scale,
                    slots,
                    slots,
                    torch.int32,
                )
                keys[UPDATE, key] = None
            groups = indexer.topk_tokens // POOL
            keys[EXPAND, ExpandPoolsKernel.CompileKey(groups, positions_dtype)] = None
            width = indexer.topk_indices_buffer.shape[1]
            layout = _remap_layout(attn)
            if self.fuse and layout is not None:
                for counts in (True, False):
                    if remap_shape_unmet(groups, width, POOL, counts) is not None:
                        continue  # the rule refuses it: never launched
                    key = ExpandRemapKernel.CompileKey(
                        groups, width, *layout, positions_dtype, counts
                    )
                    keys[REMAP, key] = None
        keys[UPCAST, UpcastLogitsKernel.CompileKey()] = None
        return list(keys)


def _remap_layout(attn) -> tuple[int, int] | None:
    """(block size, rows between blocks) of the MLA KV cache a DSA layer's
    index group converts for, as ``flat_kv_row_view`` reads it; None if the
    cache is not bound as a [blocks, block size, row] tensor."""
    kv = getattr(getattr(attn.mla_attn, "mla_attn", None), "kv_cache", None)
    if not isinstance(kv, torch.Tensor) or kv.ndim != 3 or kv.stride(0) % kv.shape[2]:
        return None
    return kv.shape[1], kv.stride(0) // kv.shape[2]


# The decode paths (``forward_mqa``) that convert the top-k of decode-only
# steps through the index group, where a deferred top-k is expanded: the
# shared sparse MLA decode (FlashInfer SM100; FlashAttention's with patch
# 0005's flag), FlashMLA's, and FlashInfer SM90's with patch 0005's flag.
# Any other forward_mqa may read the logical rows a deferral leaves unset.
GROUP_CONVERTING_DECODES = frozenset(
    {
        (
            "vllm.model_executor.layers.attention.sparse_mla_attention",
            "SparseMLACommonImpl.forward_mqa",
        ),
        (
            "vllm.v1.attention.backends.mla.flashmla_sparse",
            "FlashMLASparseImpl.forward_mqa",
        ),
        (
            "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90",
            "FlashInferMLASparseSM90Impl.forward_mqa",
        ),
    }
)


def _converts_through_group(impl) -> bool:
    """Whether ``impl``'s decode-only steps convert the top-k through its
    index group once the stage sets ``convert_decode_through_index_group``
    (patch 0005), by the identity of its ``forward_mqa``."""
    forward = getattr(type(impl), "forward_mqa", None)
    name = (
        getattr(forward, "__module__", None),
        getattr(forward, "__qualname__", None),
    )
    return name in GROUP_CONVERTING_DECODES and hasattr(
        type(impl), "convert_decode_through_index_group"
    )
