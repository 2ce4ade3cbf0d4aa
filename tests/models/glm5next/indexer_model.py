# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One model of the indexer step driver (``indexer_steps``): GLM-5-Next's
DSA layers reduced to what the patched ``sparse_attn_indexer_kpool`` and the
sparse MLA top-k conversion touch, and the one function that knows the stage
API (``build_stage``).

Per layer a ``Side`` holds the FP8 index cache, the tail cache, a real
``SparseMLAIndexGroup`` (its stock side stream and events on CUDA), the
objects ``KpoolStage`` reads (``mla_attn.mla_attn.impl``, ``indexer``), and
snapshots of what the step's consumer read and got. All layers share one
logical top-k buffer, as vLLM's models do.
"""

import contextlib
import importlib
import inspect
import sys
from types import SimpleNamespace

import torch
from indexer_batches import Geometry

from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
)
from vllm.models.glm5next.nvidia import sparse_indexer
from vllm.v1.attention.backends.mla import index_group as index_group_module
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import (
    FlashInferMLASparseSM90Impl,
)
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl
from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup
from vllm.v1.attention.backends.mla.sparse_utils import (
    flat_kv_row_view,
    triton_convert_req_index_to_global_index,
)

POOL, D = 4, 128
# Written over the logical rows, the group's outputs and the snapshots before
# each layer: no result is ever -7.
POISON = -7


def build_stage(attentions, max_rows: int, device, *, compile_kernels: bool):
    """The stage on ``attentions`` as the model build and the JIT warmup make
    it, with planned() told it is warmed up. ``compile_kernels=False`` (CPU)
    ends the warmup without compiling anything, so each kernel declines and
    the stage routes to its stock twin. Returns (stage, undo)."""
    from vllm.models.glm5next.nvidia import specialized_decode as sd
    from vllm.models.glm5next.nvidia.specialized_decode import kpool

    stage = kpool.KpoolStage(attentions, max_rows, device)
    launch = sys.modules.get(f"{sd.__name__}.launch")
    flags = ((launch, "_warmed_up"), (kpool, "_frozen"))  # compile guards
    saved = [(m, n, getattr(m, n)) for m, n in flags if hasattr(m, n)]
    if compile_kernels:
        extra = {}
        if "max_rows" in inspect.signature(stage.warmup).parameters:
            extra["max_rows"] = max_rows
        stage.warmup(attentions, positions_dtype=torch.int64, **extra)
    elif launch is not None and hasattr(launch, "warming_up"):
        with launch.warming_up():
            pass
    if hasattr(kpool, "freeze"):
        kpool.freeze()
    previous = sd._plan
    sd._plan = sd.plan_for(attentions, max_rows)
    sd._plan.warmed = True

    def undo() -> None:
        sd._plan = previous
        for module, name, value in saved:
            setattr(module, name, value)

    return stage, undo


@contextlib.contextmanager
def mx_scales(flag: bool):
    """Force ``mqa_logits_use_mx_scales()`` in every vLLM module that binds
    it (the stage's modules are imported first, so they are among them)."""
    importlib.import_module("vllm.models.glm5next.nvidia.specialized_decode.kpool")
    saved = {
        module: module.mqa_logits_use_mx_scales
        for name, module in list(sys.modules.items())
        if name.partition(".")[0] == "vllm"
        and callable(getattr(module, "mqa_logits_use_mx_scales", None))
    }
    for module in saved:
        module.mqa_logits_use_mx_scales = lambda: flag
    try:
        yield
    finally:
        for module, fn in saved.items():
            module.mqa_logits_use_mx_scales = fn


class CpuStream:
    """A no-op stream and event for the CPU, where nothing runs async."""

    def wait_event(self, event): ...

    def wait_stream(self, stream): ...

    def record(self, stream=None): ...

    def __enter__(self):
        return self

    def __exit__(self, *exc): ...


@contextlib.contextmanager
def cpu_streams():
    """``current_stream`` of the index group and the stage: ``CpuStream``."""
    from vllm.models.glm5next.nvidia.specialized_decode import kpool

    saved = [
        (m, m.current_stream)
        for m in (index_group_module, kpool)
        if hasattr(m, "current_stream")
    ]
    for module, _ in saved:
        module.current_stream = CpuStream
    try:
        yield
    finally:
        for module, fn in saved:
            module.current_stream = fn


class _Impl:
    """What the stage reads or sets of a sparse MLA impl: the class flags it
    inherits from ``SparseMLACommonImpl`` (patch 0005 adds
    ``convert_decode_through_index_group``) and, per backend below, the stock
    ``forward_mqa`` (the stage identifies the backend by it)."""


for _flag in ("group_conversion_decode_only", "convert_decode_through_index_group"):
    if hasattr(SparseMLACommonImpl, _flag):
        setattr(_Impl, _flag, getattr(SparseMLACommonImpl, _flag))


class Sm100Impl(_Impl):
    """SM100 (FLASHINFER_MLA_SPARSE): converts through the index group."""

    forward_mqa = SparseMLACommonImpl.forward_mqa


class FlashMlaImpl(_Impl):
    """FLASHMLA_SPARSE (FP8): decode steps through the group, no counts."""

    forward_mqa = FlashMLASparseImpl.forward_mqa


class FlashInferSm90Impl(_Impl):
    """FLASHINFER_MLA_SPARSE_SM90: converts the logical rows itself, on the
    compute stream; decode-only steps through the group when its
    ``convert_decode_through_index_group`` is set (patch 0005)."""

    forward_mqa = FlashInferMLASparseSM90Impl.forward_mqa


IMPLS = {
    "group": Sm100Impl,
    "group_no_counts": FlashMlaImpl,
    "compute": FlashInferSm90Impl,
}


def _group(buffer, geo: Geometry, device) -> SparseMLAIndexGroup:
    """A DSA layer's index group as each GLM-5-Next impl's own
    ``SparseMLAIndexGroupBuilder`` sizes it: a row per logical row, plus one."""
    cuda = torch.device(device).type == "cuda"

    def event():
        return index_group_module._create_event() if cuda else CpuStream()

    def ints(*shape):
        return torch.full(shape, POISON, dtype=torch.int32, device=device)

    group = SparseMLAIndexGroup(
        logical_topk_indices=buffer,
        physical_topk_indices=ints(buffer.shape[0] + 1, buffer.shape[1]),
        valid_topk_counts=ints(buffer.shape[0] + 1),
        side_stream=index_group_module._create_side_stream(device)
        if cuda
        else CpuStream(),
        logical_topk_ready=event(),
        physical_topk_ready=event(),
        has_indexer=True,
    )
    group.register_layer()
    return group


class Side:
    """One model (see the module docstring). ``init``: the initial caches,
    copied, and the per-layer input shapes."""

    def __init__(self, name: str, geo: Geometry, backend, prefixes, init, device):
        self.name, self.geo, self.backend, self.prefixes = name, geo, backend, prefixes
        self.stage = None
        self.record = True  # keep snapshots for the comparison (not when timing)
        self.hold = 0  # GPU cycles each stream is held back before a conversion
        t, w = geo.max_tokens, geo.width

        def ints(*shape):
            return torch.full(shape, POISON, dtype=torch.int32, device=device)

        self.kv = [c.clone() for c in init["kv"]]
        self.tail = [c.clone() for c in init["tail"]]
        self.ape = init["ape"]
        self.buffer = ints(t, w)
        self.hidden = torch.zeros(t, 8, dtype=torch.bfloat16, device=device)
        # Per layer: the indexer left its logical rows unwritten (deferred).
        self.deferred = torch.zeros(geo.layers, dtype=torch.bool, device=device)
        self.forwards = torch.zeros(1, dtype=torch.int64, device=device)
        source = init["source"]
        self.inputs = [
            SimpleNamespace(**{k: torch.empty_like(v[0]) for k, v in source.items()})
            for _ in range(geo.layers)
        ]
        self.snap = [
            SimpleNamespace(logical=ints(t, w), physical=ints(t, w), counts=ints(t))
            for _ in range(geo.layers)
        ]
        self.groups = [_group(self.buffer, geo, device) for _ in prefixes]
        self.attentions, self.strides = [], []
        for layer, (k_prefix, tail_prefix, _) in enumerate(prefixes):
            # MLA rows are never read here: only the block layout matters.
            rows = torch.empty(
                geo.num_blocks, geo.mla_block_rows, 16, dtype=torch.uint8, device=device
            )[:, : geo.block]
            self.strides.append(flat_kv_row_view(rows, geo.block)[1])
            impl = IMPLS[backend.convert]()
            vars(impl).update(
                index_group=self.groups[layer], index_group_index=0, dcp_world_size=1
            )
            indexer = SimpleNamespace(
                k_cache=SimpleNamespace(prefix=k_prefix, kv_cache=self.kv[layer]),
                tail_cache=SimpleNamespace(
                    prefix=tail_prefix, kv_cache=self.tail[layer]
                ),
                topk_indices_buffer=self.buffer,
                topk_tokens=geo.topk,
                scale_fmt="ue8m0",
            )
            mla = SimpleNamespace(mla_attn=SimpleNamespace(impl=impl, kv_cache=rows))
            self.attentions.append(SimpleNamespace(mla_attn=mla, indexer=indexer))

    @contextlib.contextmanager
    def active(self):
        """This model's ``SPECIALIZED_KPOOL`` (None: stock) for the block."""
        sparse_indexer.SPECIALIZED_KPOOL = self.stage
        try:
            yield
        finally:
            sparse_indexer.SPECIALIZED_KPOOL = None

    def forward(self, source, rows: int) -> None:
        """One forward over the DSA layers; graph-capturable but for the
        indexer and ``consume`` (eager breaks under breakable graphs)."""
        for layer in range(len(self.prefixes)):
            x = self.inputs[layer]
            for name, buffer in vars(x).items():
                buffer[:rows].copy_(getattr(source, name)[layer, :rows])
            self.buffer[:rows].fill_(POISON)
            self.groups[layer].physical_topk_indices.fill_(POISON)
            self.groups[layer].valid_topk_counts.fill_(POISON)
            self.layer_step(layer, source.positions, rows)
        self.forwards += 1  # the model's work after the last break (its head)

    def layer_step(self, layer: int, positions, rows: int) -> None:
        """The layer's indexer, its ready event, then the MLA's conversion."""
        geo, x = self.geo, self.inputs[layer]
        k_prefix, tail_prefix, _ = self.prefixes[layer]
        sparse_indexer.sparse_attn_indexer_kpool(
            self.hidden[:rows], k_prefix, self.kv[layer], x.q[:rows], None,
            x.k[:rows], x.w[:rows], 128, "ue8m0", geo.topk, D, geo.max_pool_len,
            geo.max_reqs * geo.max_pool_len, self.buffer, False, False,
            x.gate[:rows], self.ape[layer], POOL, positions[:rows],
            self.tail[layer], tail_prefix, "auto", 0, 1, 1,
        )  # fmt: skip
        self.groups[layer].set_logical_topk_ready(0)
        # The model's work between the two breaks.
        self.deferred[layer] = (self.buffer[:rows] == POISON).all()
        consume(self, layer)

    def convert(self, layer: int, logical, mla):
        """The top-k conversion as the backend path's ``forward_mqa`` does:
        (physical rows, counts or None)."""
        convert, group = self.backend.convert, self.groups[layer]
        rows, stride = logical.shape[0], self.strides[layer]
        impl = self.attentions[layer].mla_attn.mla_attn.impl
        through_group = getattr(impl, "convert_decode_through_index_group", False)
        if convert == "compute" and through_group and mla.num_decode_tokens >= rows:
            convert = "group"
        if convert == "group" or (
            convert == "group_no_counts"
            and mla.num_decode_tokens == mla.num_actual_tokens == rows
        ):
            counts = convert == "group"
            out = group.convert_logical_to_physical_topk(
                0, logical, mla, block_stride_rows=stride, return_valid_counts=counts
            )
            return out if counts else (out, None)
        counts = convert == "compute"
        out = triton_convert_req_index_to_global_index(
            mla.req_id_per_token[:rows], mla.block_table, logical,
            BLOCK_SIZE=mla.block_size, BLOCK_STRIDE_ROWS=stride,
            NUM_TOPK_TOKENS=logical.shape[1], return_valid_counts=counts,
        )  # fmt: skip
        return out if counts else (out, None)


@eager_break_during_capture
def consume(side: Side, layer: int) -> None:
    """The MLA attention's use of the layer's top-k: convert, then keep what
    it read and returned for the comparison. An eager break: at piecewise
    replay it runs in the step's own forward context."""
    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, dict):
        return  # a capture's profiling forward
    mla = metadata[side.prefixes[layer][2]]
    rows = mla.num_actual_tokens
    logical = side.buffer[:rows]
    if side.hold and not torch.cuda.is_current_stream_capturing():
        # The compute stream late (what it queued last must be waited for),
        # then the side stream (the compute stream must wait for its result).
        torch.cuda._sleep(side.hold)
        with side.groups[layer].side_stream:
            torch.cuda._sleep(side.hold)
    physical, counts = side.convert(layer, logical, mla)
    if not side.record:
        return
    snap = side.snap[layer]
    snap.logical[:rows].copy_(logical)
    snap.physical[:rows].copy_(physical[:rows])
    if counts is not None:
        snap.counts[:rows].copy_(counts[:rows])
