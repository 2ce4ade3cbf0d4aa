# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One model of the indexer step driver (``tools.indexer.steps``): GLM-5-Next's
DSA layers reduced to what the patched ``sparse_attn_indexer_kpool`` and the
sparse MLA top-k conversion touch, and the one function that knows the stage
API (``build_stage``).

Per layer a ``Side`` holds the FP8 index cache, the tail cache, a real
``SparseMLAIndexGroup`` (its stock side stream and events on CUDA), the
objects ``KpoolStage`` reads (``mla_attn.mla_attn.impl``: the stock sparse
MLA impl class of the backend path, ``indexer``), and snapshots of what the
step's consumer read and got. All layers share one logical top-k buffer, as
vLLM's models do.
"""

import contextlib
import importlib
import sys
from types import SimpleNamespace

import torch

from tools.indexer.batches import Geometry
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
# The stage's modules that bind ``mqa_logits_use_mx_scales`` at import.
STAGE_MODULES = ("kpool", "warmup", "install")


def build_stage(attentions, max_rows: int, device, stages, select: bool = False):
    """The stage on ``attentions`` as ``install()`` and the JIT warmup make
    it: a ``KpoolStage`` added to ``stages`` (the process's ``KpoolStages``
    registry, which the caller sets as ``sparse_indexer.SPECIALIZED_KPOOL``)
    by the indexer top-k buffer, every kernel variant its warmup derives
    compiled (``KpoolWarmup.compile``; on the CPU the rules refuse CPU
    tensors, so nothing compiles and each kernel routes to its stock twin),
    then ``warmed``; ``select``: with the opt-in select. The self-check is
    left to its own test."""
    from vllm.models.glm5next.nvidia.specialized_decode.stage import KpoolStage
    from vllm.models.glm5next.nvidia.specialized_decode.warmup import KpoolWarmup

    stage = KpoolStage(attentions, max_rows, device, select=select)
    stages.add(stage, attentions[0].indexer.topk_indices_buffer)
    KpoolWarmup(stage, attentions, self_check="off").compile()
    stage.warmed = True
    return stage


@contextlib.contextmanager
def count_launches(counter):
    """Counts, per kernel class, the stage's launches of compiled kernels
    (``KpoolJitKernel.launch``, which ``run_if_ready`` and ``FusedRemap``
    call) into ``counter``: a stage whose keys drifted from its warmup's
    routes every input to stock without a word, and shows here as 0."""
    from vllm.models.glm5next.nvidia.specialized_decode.warmup import KERNELS

    for kernel in KERNELS:
        name = type(kernel).__name__

        def launch(executor, args, launch=kernel.launch, name=name):
            counter[name] += 1
            return launch(executor, args)

        kernel.launch = launch
    try:
        yield
    finally:
        for kernel in KERNELS:
            del kernel.launch


@contextlib.contextmanager
def mx_scales(flag: bool):
    """Force ``mqa_logits_use_mx_scales()`` in every vLLM module that binds
    it (the stage's modules are imported first, so they are among them)."""
    for name in STAGE_MODULES:
        importlib.import_module(
            f"vllm.models.glm5next.nvidia.specialized_decode.{name}"
        )
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
    """``current_stream`` of the index group and the fused remap:
    ``CpuStream``."""
    from vllm.models.glm5next.nvidia.specialized_decode import fused_remap

    modules = (index_group_module, fused_remap)
    saved = [(module, module.current_stream) for module in modules]
    for module in modules:
        module.current_stream = CpuStream
    try:
        yield
    finally:
        for module, fn in saved:
            module.current_stream = fn


# The stock sparse MLA impl of each backend path, by its conversion (the
# stage identifies a backend by its class's ``forward_mqa`` and reads the
# flags patch 0005 adds to ``SparseMLACommonImpl``): SM100's FlashInfer
# (the shared forward_mqa; through the index group, counts), FLASHMLA_SPARSE
# FP8 (decode steps through the group, no counts) and FlashInfer SM90 (the
# logical rows on the compute stream; decode-only steps through the group
# once its ``convert_decode_through_index_group`` is set).
IMPLS = {
    "group": SparseMLACommonImpl,
    "group_no_counts": FlashMLASparseImpl,
    "compute": FlashInferMLASparseSM90Impl,
}


def sparse_mla_impl(convert: str, group):
    """The stock impl of the backend path that converts as ``convert`` says
    (``IMPLS``), unconstructed (no method of it is called), with what the
    stage and the conversion read of it: its index group."""
    cls = IMPLS[convert]
    impl = cls.__new__(cls)
    vars(impl).update(index_group=group, index_group_index=0, dcp_world_size=1)
    return impl


def index_group(logical, device, physical_rows=None) -> SparseMLAIndexGroup:
    """A DSA layer's index group over the ``logical`` top-k rows, as each
    GLM-5-Next impl's own ``SparseMLAIndexGroupBuilder`` sizes it (a physical
    row per logical row, plus one, unless ``physical_rows``); the stock side
    stream and events on CUDA, ``CpuStream`` on the CPU."""
    cuda = torch.device(device).type == "cuda"
    rows = logical.shape[0] + 1 if physical_rows is None else physical_rows

    def event():
        return index_group_module._create_event() if cuda else CpuStream()

    def ints(*shape):
        return torch.full(shape, POISON, dtype=torch.int32, device=device)

    group = SparseMLAIndexGroup(
        logical_topk_indices=logical,
        physical_topk_indices=ints(rows, logical.shape[1]),
        valid_topk_counts=ints(rows),
        side_stream=index_group_module._create_side_stream(device)
        if cuda
        else CpuStream(),
        logical_topk_ready=event(),
        physical_topk_ready=event(),
        has_indexer=True,
    )
    group.register_layer()
    return group


def dsa_layer(
    prefix: str,
    impl,
    buffer,
    topk: int,
    kv=None,
    tail=None,
    mla_kv=None,
    max_pool_len=None,
):
    """A DSA layer (``Glm5NextMLAAttention``) as the stage and its warmup read
    it: ``prefix`` its attention's (``model.layers.N.self_attn``), the
    indexer's caches, top-k buffer and width, its logits' width in pools,
    the sparse MLA impl and its KV cache (``[blocks, block size, row]``, for
    the remap's block layout)."""
    return SimpleNamespace(
        indexer=SimpleNamespace(
            k_cache=SimpleNamespace(prefix=f"{prefix}.indexer.k_cache", kv_cache=kv),
            tail_cache=SimpleNamespace(
                prefix=f"{prefix}.indexer.tail_cache", kv_cache=tail
            ),
            topk_indices_buffer=buffer,
            topk_tokens=topk,
            scale_fmt="ue8m0",
            max_pool_len=max_pool_len,
        ),
        mla_attn=SimpleNamespace(mla_attn=SimpleNamespace(impl=impl, kv_cache=mla_kv)),
    )


class Side:
    """One model (see the module docstring). ``init``: the initial caches,
    copied, and the per-layer input shapes."""

    def __init__(self, name: str, geo: Geometry, backend, prefixes, init, device):
        self.name, self.geo, self.backend, self.prefixes = name, geo, backend, prefixes
        self.stage = None  # its KpoolStage (build_stage)
        self.kpool = None  # its SPECIALIZED_KPOOL: None (stock) or the registry
        # Called between the indexer and the conversion of each layer (the
        # two-stage run interleaves the other stage's layer there).
        self.between = None
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
        self.groups = [index_group(self.buffer, device) for _ in prefixes]
        self.attentions, self.strides = [], []
        for layer, (k_prefix, tail_prefix, _) in enumerate(prefixes):
            # MLA rows are never read here: only the block layout matters.
            rows = torch.empty(
                geo.num_blocks, geo.mla_block_rows, 16, dtype=torch.uint8, device=device
            )[:, : geo.block]
            self.strides.append(flat_kv_row_view(rows, geo.block)[1])
            impl = sparse_mla_impl(backend.convert, self.groups[layer])
            attn = dsa_layer(
                k_prefix.removesuffix(".indexer.k_cache"), impl, self.buffer,
                geo.topk, self.kv[layer], self.tail[layer], rows, geo.max_pool_len,
            )  # fmt: skip
            assert attn.indexer.tail_cache.prefix == tail_prefix
            self.attentions.append(attn)

    @contextlib.contextmanager
    def active(self):
        """This model's ``SPECIALIZED_KPOOL`` for the block (None: stock;
        the stages' registry, which dispatches by the top-k buffer)."""
        previous, sparse_indexer.SPECIALIZED_KPOOL = (
            sparse_indexer.SPECIALIZED_KPOOL,
            self.kpool,
        )
        try:
            yield
        finally:
            sparse_indexer.SPECIALIZED_KPOOL = previous

    def forward(self, source, rows: int) -> None:
        """One forward over the DSA layers; graph-capturable but for the
        indexer and ``consume`` (eager breaks under breakable graphs)."""
        for layer in range(len(self.prefixes)):
            self.forward_layer(source, layer, rows)
        self.forwards += 1  # the model's work after the last break (its head)

    def forward_layer(self, source, layer: int, rows: int) -> None:
        """The layer's inputs copied in, its outputs poisoned, its step."""
        x = self.inputs[layer]
        for name, buffer in vars(x).items():
            buffer[:rows].copy_(getattr(source, name)[layer, :rows])
        self.buffer[:rows].fill_(POISON)
        self.groups[layer].physical_topk_indices.fill_(POISON)
        self.groups[layer].valid_topk_counts.fill_(POISON)
        self.layer_step(layer, source.positions, rows)

    def layer_step(self, layer: int, positions, rows: int) -> None:
        """The layer's indexer, its ready event, then the MLA's conversion
        (the timed unit of ``tools.indexer.timing``)."""
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
        if self.record:  # the driver's own check: not in the timed step
            self.deferred[layer] = (self.buffer[:rows] == POISON).all()
        if self.between is not None:
            self.between(layer)
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
