# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One decode step of GLM-5-Next's stock kpool indexer on the CPU, then its
sparse MLA index conversion, for comparing the stock tree with the stage.

The indexer runs for real (``sparse_attn_indexer_kpool``: its stock Triton
kernels under ``TRITON_INTERPRET=1``, vLLM's torch top-k); only DeepGEMM's
paged MQA logits are replaced by a torch reference. The stage is installed by
``install()`` and warmed up by its real warmup, whose kernels compile for
``CUTE_DSL_ARCH`` on fake tensors (the kernels' caches are the process's: a
variant compiles once a session). ``Spies`` stand in for the launches: the
kernels answer ``executor_for`` only for keys this test's warmups compiled, as
in a new engine process, and a launch checks the kernel's own rule
(``key_for``) and key, then computes with the stock twin. Every launch, stock
fallback, hand-over and stream operation lands in one timeline.

``conftest.py`` turns the pieces that patch vLLM into fixtures.
"""

import importlib.util
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

from vllm.forward_context import ForwardContext, override_forward_context
from vllm.model_executor.layers import sparse_attn_indexer
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
)
from vllm.models.glm5next.nvidia.ops import kpool_compress as kpool_ops
from vllm.models.glm5next.nvidia.specialized_decode import (
    constants,
    fused_remap,
    install,
    select_kernel,
    warmup,
)
from vllm.models.glm5next.nvidia.specialized_decode import stage as stage_module
from vllm.models.glm5next.nvidia.specialized_decode.expand_kernel import EXPAND
from vllm.models.glm5next.nvidia.specialized_decode.jit import Refused
from vllm.models.glm5next.nvidia.specialized_decode.remap_kernel import REMAP
from vllm.models.glm5next.nvidia.specialized_decode.select_kernel import SELECT
from vllm.models.glm5next.nvidia.specialized_decode.self_check import (
    select_reference,
)
from vllm.models.glm5next.nvidia.specialized_decode.upcast_kernel import UPCAST
from vllm.models.glm5next.nvidia.specialized_decode.update_kernel import UPDATE
from vllm.utils import deep_gemm
from vllm.v1.attention.backends.mla import index_group as index_group_module
from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup
from vllm.v1.attention.backends.mla.indexer import (
    DeepSeekV32IndexerDecodeMetadata,
    DeepseekV32IndexerMetadata,
    DeepseekV32IndexerPrefillMetadata,
)
from vllm.v1.attention.backends.mla.sparse_utils import (
    triton_convert_req_index_to_global_index,
)

D = constants.DIM  # index head dim
POOL = constants.POOL  # index_kpool
HEADS = 4  # indexer query heads (the logits reference takes any)
TOPK = 128  # index_topk: 32 pools, the fewest a FusedRemap takes
GLM_TOPK = 2048  # GLM-5-Next's index_topk: 512 pools
GLM_WIDTH = 2176  # and its top-k buffer width
BLOCK = 64  # MLA (and shared indexer) block, in tokens
PAGE = BLOCK // POOL  # indexer states per block
RING = 8  # tail ring of MTP with up to 4 speculative tokens
LAYER = "model.layers.0.self_attn.indexer.k_cache"
TAIL = "model.layers.0.self_attn.indexer.tail_cache"
MTP_LAYER = "model.layers.3.self_attn.indexer.k_cache"
MTP_TAIL = "model.layers.3.self_attn.indexer.tail_cache"
KERNELS = {
    "update": UPDATE,
    "expand": EXPAND,
    "remap": REMAP,
    "upcast": UPCAST,
    "select": SELECT,
}

# The originals, before any test patches them.
STOCK_UPDATE = kpool_ops.kpool_decode_update_and_maybe_write_cache_batched
STOCK_EXPAND = kpool_ops.expand_pools_and_append_tail
STOCK_UPCAST = sparse_attn_indexer.as_fp32_logits
STOCK_CONVERT = triton_convert_req_index_to_global_index
_MX_SCALES = deep_gemm.mqa_logits_use_mx_scales
_MX_SCALES()  # cache the CPU's answer (False) before any test fakes a GPU


def buffer_width(topk: int) -> int:
    """``get_sparse_topk_buffer_width``: the expanded top-k, in 128 tiles."""
    return -(-(topk + POOL - 1) // 128) * 128


def load_stock_sparse_indexer():
    """The unpatched ``nvidia/sparse_indexer.py`` of the stock install, as a
    module of its own (its imports resolve to the overlay, whose other files
    keep their stock results)."""
    from vllm.model_executor import custom_op
    from vllm.models.glm5next.nvidia import sparse_indexer

    path = Path(os.environ["KPOOL_STOCK_VLLM"], "models/glm5next/nvidia")
    spec = importlib.util.spec_from_file_location(
        "stock_glm5next_sparse_indexer", path / "sparse_indexer.py"
    )
    module = importlib.util.module_from_spec(spec)
    # Its custom op class registers under the patched one's name.
    name = sparse_indexer.SparseAttnIndexerKpool.name
    patched = custom_op.op_registry.pop(name)
    try:
        spec.loader.exec_module(module)
    finally:
        custom_op.op_registry[name] = patched
    return module


# --- SM100 (MX scales) or not ----------------------------------------------


def use_mx_scales(patch, value: bool, *modules) -> None:
    """``mqa_logits_use_mx_scales()`` answers ``value`` in every module that
    imported it (the stock indexer, the fork, the kpool ops, DeepGEMM's MX
    inputs, the stage and its warmup), and in ``modules`` (e.g. the stock
    indexer loaded by path)."""
    targets = [m for m in list(sys.modules.values()) if m is not None]
    patched = []
    for module in [*targets, *modules]:
        try:
            current = vars(module).get("mqa_logits_use_mx_scales")
        except TypeError:
            continue
        if current is _MX_SCALES:
            patch.setattr(module, "mqa_logits_use_mx_scales", lambda: value)
            patched.append(module.__name__)
    for name in (
        "vllm.utils.deep_gemm",
        "vllm.models.glm5next.nvidia.ops.kpool_compress",
        "vllm.models.glm5next.nvidia.sparse_indexer",
        stage_module.__name__,
        warmup.__name__,
    ):
        assert name in patched, f"{name} reads mqa_logits_use_mx_scales"


@contextmanager
def _stock_mx(value: bool):
    """The stock update kernel's MX flag for one call (a spy's twin)."""
    saved = kpool_ops.mqa_logits_use_mx_scales
    kpool_ops.mqa_logits_use_mx_scales = lambda: value
    try:
        yield
    finally:
        kpool_ops.mqa_logits_use_mx_scales = saved


# --- DeepGEMM's logits in torch ------------------------------------------


def paged_logits_reference(logits_dtype=None, odd_stride=False, mx=False):
    """``fp8_fp4_paged_mqa_logits`` in torch over the FP8 cache: ``sum_h w_h
    relu(q_h . k)`` per pool below the row's length. The cache's scales are
    FP32, or with ``mx`` four UE8M0 bytes; the logits DeepGEMM's (BF16 with
    MX scales, SM100; FP32 elsewhere) unless ``logits_dtype`` says."""
    if logits_dtype is None:
        logits_dtype = torch.bfloat16 if mx else torch.float32

    def logits_fn(q, kv_cache, weights, seq_lens, block_table, schedule, **kw):
        q_values = q[0]
        batch, next_n = q_values.shape[:2]
        rows = batch * next_n
        pages = kv_cache.shape[0]
        flat = kv_cache.reshape(pages, -1)
        values = flat[:, : PAGE * D].contiguous().view(torch.float8_e4m3fn)
        raw = flat[:, PAGE * D :].contiguous()
        if mx:
            exponents = raw.view(pages, PAGE, 4)[..., 0].float()
            scales = torch.pow(2.0, exponents - 127)
        else:
            scales = raw.view(torch.float32)
        keys = values.float().view(pages, PAGE, D) * scales.view(pages, PAGE, 1)
        width = kw["max_model_len"]
        out = torch.full((rows, width), -1e4, dtype=torch.float32)
        ends = seq_lens.reshape(-1)
        for row in range(rows):
            length = int(ends[row])
            ids = torch.arange(length)
            # Per-request tables (native, padded) or per-token (varlen).
            table = block_table[row * block_table.shape[0] // rows]
            k = keys[table[ids // PAGE].long(), ids % PAGE]
            query = q_values.reshape(rows, -1, D)[row].float()
            scores = torch.relu(query @ k.T) * weights[row].float()[:, None]
            out[row, :length] = scores.sum(0)
        # DeepGEMM pads rows to an aligned stride; an odd one tests the guard.
        logits = torch.zeros((rows, width + int(odd_stride)), dtype=logits_dtype)
        return logits[:, :width].copy_(out)

    return logits_fn


class _Workspace:
    """``current_workspace_manager()`` of the prefill branch (which a short
    prefill asks for, then leaves unused)."""

    @staticmethod
    def get_simultaneous(*shapes_and_dtypes):
        return [torch.empty(shape, dtype=dtype) for shape, dtype in shapes_and_dtypes]


def use_references(patch, modules, logits_fn) -> None:
    """DeepGEMM's paged logits and the workspace manager replaced in each
    sparse indexer module of ``modules`` (the top-k is vLLM's own torch
    reference: the steps ask for ``topk_backend="torch"``)."""
    for module in modules:
        patch.setattr(module, "fp8_fp4_paged_mqa_logits", logits_fn)
        patch.setattr(module, "current_workspace_manager", _Workspace)


# --- The kernels: their stock twins, and the spies that launch them -------


def _lengths(lengths: torch.Tensor, int32: bool) -> torch.Tensor:
    return lengths.to(torch.int32) if int32 else lengths


def update_twin(a) -> None:
    with _stock_mx(a.mx_scales):
        STOCK_UPDATE(*a[:10], round_scale=a.round_scale)


def expand_twin(a) -> None:
    lengths = _lengths(a.seq_lens, a.int32_lengths)
    STOCK_EXPAND(a.pool_ids, lengths, a.pool_size, seq_offset=a.seq_offset, out=a.out)


def remap_twin(a) -> None:
    rows = a.pool_ids.shape[0]
    logical = torch.full_like(a.out, -1)
    if rows:
        STOCK_EXPAND(
            a.pool_ids,
            _lengths(a.positions[:rows], a.int32_lengths),
            a.pool_size,
            seq_offset=a.seq_offset,
            out=logical[:rows],
        )
    STOCK_CONVERT(
        a.req_ids,
        a.block_table,
        logical,
        BLOCK_SIZE=a.block_size,
        BLOCK_STRIDE_ROWS=a.stride_rows,
        NUM_TOPK_TOKENS=a.out.shape[1],
        return_valid_counts=a.counts is not None,
        out=a.out,
        valid_counts_out=None if a.counts is None else a.counts[: a.out.shape[0]],
    )


def upcast_twin(a) -> None:
    # The columns below each row end; the kernel leaves the others.
    below = torch.arange(a.logits.shape[1])[None, :] < a.row_ends[:, None]
    a.out[below] = STOCK_UPCAST(a.logits, a.row_ends)[below]


def select_twin(a) -> None:
    # The select's contract (it has no stock twin of the same bytes).
    a.out.copy_(select_reference(a.logits, a.ends, a.k))


def routes_of(timeline: list[str]) -> list[str]:
    """The route entries of a timeline: launches, stock fallbacks, the
    hand-over of a deferred top-k and its materialization."""
    return [
        e
        for e in timeline
        if e.startswith(("kernel:", "stock:", "indexer:"))
        or e in ("defer", "materialize")
    ]


class Spies:
    """The kernels as a new engine process on the CPU sees them.

    - ``compile`` (the warmup's) records the key in ``compiled`` and compiles
      for real (once a session: the kernels' caches are the process's);
    - ``executor_for`` answers only keys in ``compiled`` (``forget`` drops a
      kernel's, as if its warmup had not compiled them);
    - ``launch`` records ``kernel:<name>`` and the key in ``launched``, fails
      the test unless the kernel's own rule takes the arguments, their key was
      compiled and the executor is that key's, then writes what the kernel
      would with the stock twin (``twins``).

    The stage's stock fallbacks are recorded as ``stock:<name>``, the index
    group's stock conversion as ``stock:convert``, the indexer's own decode
    expansion as ``indexer:expand``; the compute stream as ``compute``.
    CPU tensors pass the kernels' device check (``KERNEL_DEVICE_TYPES``).
    """

    def __init__(self, patch, timeline: list[str]):
        self.timeline = timeline
        self.compiled: dict[str, set] = {name: set() for name in KERNELS}
        self.launched: dict[str, set] = {name: set() for name in KERNELS}
        self.twins = dict(
            update=update_twin,
            expand=expand_twin,
            remap=remap_twin,
            upcast=upcast_twin,
            select=select_twin,
        )
        patch.setattr(constants, "KERNEL_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
        for name, kernel in KERNELS.items():
            for method in ("compile", "executor_for", "launch"):
                spy = partial(getattr(self, f"_{method}"), name, kernel)
                patch.setattr(kernel, method, spy)
        for name, label in (
            ("kpool_decode_update_and_maybe_write_cache_batched", "stock:update"),
            ("as_fp32_logits", "stock:upcast"),
            ("expand_pools_and_append_tail", "stock:expand"),
        ):
            stock = getattr(stage_module, name)
            patch.setattr(stage_module, name, self.recorded(label, stock))
        expand = self.recorded("indexer:expand", STOCK_EXPAND)
        patch.setattr(kpool_ops, "expand_pools_and_append_tail", expand)
        convert = self.recorded("stock:convert", STOCK_CONVERT)
        patch.setattr(
            index_group_module, "triton_convert_req_index_to_global_index", convert
        )
        compute = FakeStream(timeline, "compute")
        for module in (fused_remap, index_group_module):
            patch.setattr(module, "current_stream", lambda: compute)

    def recorded(self, label, fn):
        def wrapper(*args, **kwargs):
            self.timeline.append(label)
            return fn(*args, **kwargs)

        return wrapper

    def forget(self, name: str) -> None:
        self.compiled[name].clear()

    def _compile(self, name, kernel, compile_key) -> None:
        self.compiled[name].add(compile_key)
        type(kernel).compile(kernel, compile_key)

    def _executor_for(self, name, kernel, args):
        try:
            compile_key = kernel.key_for(args)
        except Refused:
            return None
        if compile_key not in self.compiled[name]:
            return None
        return type(kernel).executor_for(kernel, args)

    def _launch(self, name, kernel, executor, args):
        self.timeline.append(f"kernel:{name}")
        compile_key = kernel.key_for(args)  # raises what the rule refuses
        assert compile_key in self.compiled[name], f"{name}: {compile_key} not warm"
        assert executor is type(kernel).executor_for(kernel, args), name
        self.launched[name].add(compile_key)
        if kernel.complete is not None:
            args = kernel.complete(args)
        if kernel.executor_args(args) is not None:
            self.twins[name](args)
        return args


# --- Streams, events, index groups and layers -------------------------------


class FakeStream:
    """Records the side-stream protocol of a conversion."""

    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def wait_event(self, event):
        self.log.append(f"{self.name}.wait_event({event.name})")

    def wait_stream(self, stream):
        self.log.append(f"{self.name}.wait_stream({stream.name})")

    def __enter__(self):
        self.log.append(f"enter {self.name}")

    def __exit__(self, *exc):
        self.log.append(f"exit {self.name}")


class FakeEvent:
    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def record(self, stream=None):
        self.log.append(f"{self.name}.record({stream.name if stream else ''})")


def make_group(buffer, capacity: int, log: list[str]) -> SparseMLAIndexGroup:
    """A DSA layer's index group, sized like SparseMLAIndexGroupBuilder's,
    its streams and events recorded in ``log``."""
    return SparseMLAIndexGroup(
        logical_topk_indices=buffer,
        physical_topk_indices=torch.full(
            (capacity + 1, buffer.shape[1]), -7, dtype=torch.int32
        ),
        valid_topk_counts=torch.full((capacity + 1,), -7, dtype=torch.int32),
        side_stream=FakeStream(log, "side"),
        logical_topk_ready=FakeEvent(log, "logical_ready"),
        physical_topk_ready=FakeEvent(log, "physical_ready"),
        has_indexer=True,
        num_layers=1,
    )


class FakeImpl:
    """What KpoolStage and install() read of a sparse MLA impl: its backend's
    ``forward_mqa`` converts decode rows through the index group, and it has
    patch 0005's flag."""

    forward_mqa = SparseMLACommonImpl.forward_mqa
    convert_decode_through_index_group = False

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


class Layer(SimpleNamespace):
    """A namespace a weak reference can follow (``install`` ties its stage's
    registration to the first layer's lifetime)."""

    __slots__ = ("__weakref__",)


# --- One step --------------------------------------------------------------


@dataclass
class Step:
    """A decode step: ``q_lens[b]`` tokens of request ``b`` after ``ctx[b]``
    tokens. ``layout``: "native" (uniform rows), "varlen" (one row per token,
    SM100) or "padded" (``[B, max q_len]`` rows, SM90 non-uniform)."""

    q_lens: list[int]
    ctx: list[int]
    layout: str = "native"
    pad_rows: int = 0  # CUDA graph padding rows after the tokens
    prefill: int = 0  # tokens of one short prefill after the decodes
    layer: str = LAYER
    tail: str = TAIL
    positions: bool = True
    seed: int = 0
    topk: int = TOPK  # index_topk
    width: int | None = None  # top-k buffer width (default: buffer_width)
    key_stride: int = D  # row stride of the indexer key
    scale_fmt: str | None = "ue8m0"  # the indexer's (None: FP32 scales)
    stride_rows: int = BLOCK  # MLA cache rows from one block to the next

    @property
    def tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def buffer_width(self) -> int:
        return buffer_width(self.topk) if self.width is None else self.width


@dataclass
class Inputs:
    """A step's inputs: ``args`` of the indexer (pristine: each run copies
    them), except that every run writes ``buffer``, the model's top-k buffer
    (the stages' registry knows a model by it), reset from ``args`` first."""

    step: Step
    args: dict
    metadata: dict
    mla: SimpleNamespace
    num_tokens: int
    num_blocks: int
    buffer: torch.Tensor


def _fp8_cache(gen, num_blocks: int, mx: bool) -> torch.Tensor:
    cache = torch.empty((num_blocks, PAGE, D + 4), dtype=torch.uint8)
    flat = cache.view(num_blocks, -1)
    values = (torch.randn((num_blocks, PAGE * D), generator=gen) * 100).clamp(-448, 448)
    flat[:, : PAGE * D] = values.to(torch.float8_e4m3fn).view(torch.uint8)
    exponents = torch.randint(-12, -4, (num_blocks, PAGE), generator=gen)
    if mx:  # four equal UE8M0 bytes a state
        ue8m0 = (exponents + 127).to(torch.uint8)
        flat[:, PAGE * D :] = ue8m0.repeat_interleave(4, dim=1)
    else:
        scales = torch.pow(2.0, exponents.float())
        flat[:, PAGE * D :] = scales.view(torch.uint8).view(num_blocks, PAGE * 4)
    return cache


def make_inputs(step: Step, *, mx: bool = False, buffer=None) -> Inputs:
    """``buffer``: a model's top-k buffer to run in (its first rows), as
    every forward of one model does; else a new one."""
    gen = torch.Generator().manual_seed(step.seed)
    batch = len(step.q_lens)
    decode = step.tokens
    real = decode + step.prefill
    rows = real + step.pad_rows
    reqs = batch + (1 if step.prefill else 0)
    ctx = list(step.ctx) + ([0] if step.prefill else [])
    q_lens = list(step.q_lens) + ([step.prefill] if step.prefill else [])
    longest = max(c + q for c, q in zip(ctx, q_lens, strict=True))
    max_blocks = max(8, -(-longest // BLOCK))
    num_blocks = max(48, reqs * max_blocks + 8)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: reqs * max_blocks].view(reqs, max_blocks).to(torch.int32)
    req_of = torch.repeat_interleave(torch.arange(reqs), torch.tensor(q_lens))
    pos = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx, q_lens, strict=True)])
    blocks = tables[req_of, pos // BLOCK].long()
    slots = torch.where(pos % POOL == POOL - 1, blocks * PAGE + pos % BLOCK // POOL, -1)
    tail_slots = req_of * RING + pos % RING
    positions = torch.zeros(rows, dtype=torch.int64)
    positions[:real] = pos

    key = torch.randn((rows, step.key_stride), generator=gen).bfloat16()[:, :D]
    weights = torch.rand((rows, HEADS), generator=gen)
    q = (torch.randn((rows, HEADS, D), generator=gen) * 8).to(torch.float8_e4m3fn)
    width = step.buffer_width
    args = dict(
        hidden_states=torch.zeros((rows, 8)),
        k_cache_prefix=step.layer,
        kv_cache=_fp8_cache(gen, num_blocks, mx),
        q_quant=q,
        q_scale=None,
        k=key,
        weights=weights,
        quant_block_size=128,
        scale_fmt=step.scale_fmt,
        topk_tokens=step.topk,
        head_dim=D,
        max_pool_len=max_blocks * PAGE,
        total_seq_lens=4096,
        topk_indices_buffer=torch.full((rows + 4, width), -5, dtype=torch.int32),
        skip_k_cache_insert=False,
        use_fp4_cache=False,
        gate_score=torch.randn((rows, D), generator=gen).bfloat16(),
        compress_ape=torch.randn((POOL, D), generator=gen),
        index_kpool=POOL,
        positions=positions if step.positions else None,
        tail_kv_cache=torch.randn((reqs + 2, 2, RING, D), generator=gen).bfloat16(),
        tail_prefix=step.tail,
        topk_backend="torch",  # vLLM's reference of the CUDA top-k
    )

    seq_after = torch.tensor(
        [c + q for c, q in zip(step.ctx, step.q_lens, strict=True)]
    )
    dec_pos = pos[:decode]
    q_lens_t = torch.tensor(step.q_lens, dtype=torch.int32)
    uniform = len(set(step.q_lens)) == 1
    lmax = max(step.q_lens)
    if step.layout == "native":
        assert uniform
        seq_lens = ((dec_pos + 1) // POOL).view(batch, lmax).to(torch.int32)
        table, decode_lens = tables[:batch], q_lens_t
    elif step.layout == "varlen":
        seq_lens = ((dec_pos + 1) // POOL).view(decode, 1).to(torch.int32)
        table = tables[req_of[:decode]]
        decode_lens = torch.ones(decode, dtype=torch.int32)
    else:
        assert step.layout == "padded"
        padded = torch.zeros((batch, lmax), dtype=torch.int32)
        for b, (c, n) in enumerate(zip(step.ctx, step.q_lens, strict=True)):
            padded[b, :n] = (torch.arange(c, c + n) + 1) // POOL
        seq_lens, table, decode_lens = padded, tables[:batch], q_lens_t
    decode_meta = DeepSeekV32IndexerDecodeMetadata(
        block_table=table,
        seq_lens=seq_lens,
        decode_lens=decode_lens,
        requires_padding=step.layout == "padded",
        schedule_metadata=torch.zeros(1, dtype=torch.int32),
        per_req_decode_lens=q_lens_t,
        decode_is_uniform=uniform,
        write_max_decode_len=lmax,
    )
    prefill_meta = None
    if step.prefill:
        prefill_meta = DeepseekV32IndexerPrefillMetadata(
            chunks=[], max_prefill_seq_len=step.prefill
        )

    def indexer_meta(slot_mapping):
        return DeepseekV32IndexerMetadata(
            seq_lens=torch.tensor(
                [c + q for c, q in zip(ctx, q_lens, strict=True)], dtype=torch.int32
            ),
            max_seq_len=int(max(seq_after.max(), step.prefill)),
            slot_mapping=slot_mapping,
            num_decodes=batch,
            num_decode_tokens=decode,
            num_prefills=1 if step.prefill else 0,
            num_prefill_tokens=step.prefill,
            decode=decode_meta,
            prefill=prefill_meta,
            block_table=tables,
        )

    metadata = {step.layer: indexer_meta(slots), step.tail: indexer_meta(tail_slots)}
    req_ids = torch.zeros(rows, dtype=torch.int32)
    req_ids[:real] = req_of.to(torch.int32)
    mla = SimpleNamespace(
        req_id_per_token=req_ids,
        block_table=tables,
        block_size=BLOCK,
        num_decode_tokens=decode,
        num_actual_tokens=real,
    )
    pristine = args["topk_indices_buffer"]
    buffer = pristine.clone() if buffer is None else buffer[: pristine.shape[0]]
    return Inputs(step, args, metadata, mla, rows, num_blocks, buffer)


def mla_cache(inputs: Inputs, row: int = 8, dtype=torch.bfloat16) -> torch.Tensor:
    """The layer's bound MLA KV cache: ``[blocks, BLOCK, row]`` with
    ``step.stride_rows`` rows from one block to the next."""
    stride = inputs.step.stride_rows * row
    storage = torch.zeros(inputs.num_blocks * stride, dtype=dtype)
    return storage.as_strided((inputs.num_blocks, BLOCK, row), (stride, row, 1))


def make_attention(group, inputs: Inputs, *, impl=None, prefix=None, bound=True):
    """What KpoolStage, its warmup and install() read of a
    Glm5NextMLAAttention whose indexer holds ``inputs``' caches and top-k
    buffer (``bound``: its MLA KV cache too)."""
    if impl is None:
        impl = FakeImpl(index_group=group, dcp_world_size=1)
    args = inputs.args
    mla_attn = SimpleNamespace(impl=impl)
    if bound:
        mla_attn.kv_cache = mla_cache(inputs)
    return Layer(
        mla_attn=SimpleNamespace(mla_attn=mla_attn),
        indexer=SimpleNamespace(
            k_cache=SimpleNamespace(
                prefix=prefix or inputs.step.layer, kv_cache=args["kv_cache"]
            ),
            tail_cache=SimpleNamespace(
                prefix=inputs.step.tail, kv_cache=args["tail_kv_cache"]
            ),
            topk_tokens=args["topk_tokens"],
            topk_indices_buffer=inputs.buffer,
            scale_fmt=args["scale_fmt"],
            max_pool_len=args["max_pool_len"],
        ),
    )


# --- install() and the JIT warmup ------------------------------------------


def make_config(**overrides):
    """A vllm_config with what install() reads, of a supported deployment
    unless overridden (``section__field=value``)."""
    from vllm.config import CompilationMode, CUDAGraphMode

    config = SimpleNamespace(
        additional_config={constants.BACKEND_KEY: constants.BACKEND},
        model_config=SimpleNamespace(
            architectures=["Glm5NextForCausalLM"],
            hf_text_config=SimpleNamespace(
                index_topk=2048, index_kpool=4, index_head_dim=128
            ),
        ),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=1, use_ubatching=False
        ),
        compilation_config=SimpleNamespace(
            mode=CompilationMode.NONE,
            cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        ),
        kernel_config=SimpleNamespace(enable_jit_warmup=True),
        scheduler_config=SimpleNamespace(max_num_seqs=64, max_num_batched_tokens=8192),
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
    )
    for name, value in overrides.items():
        if name == "additional_config":
            config.additional_config = value
            continue
        section, attribute = name.split("__")
        target = getattr(config, section)
        if section == "model_config" and attribute.startswith("index_"):
            target = target.hf_text_config
        setattr(target, attribute, value)
    return config


def fake_gpu(patch, capability: int | None) -> None:
    """The current platform as a CUDA GPU of ``capability`` (None: none)."""
    from vllm.platforms import current_platform

    patch.setattr(current_platform, "is_cuda", lambda: capability is not None)
    patch.setattr(
        current_platform,
        "is_device_capability",
        lambda c: capability is not None and c == capability,
    )
    patch.setattr(
        current_platform,
        "is_device_capability_family",
        lambda c: capability is not None and capability // 10 == c // 10,
    )


def install_stage(
    patch, attentions, *, max_rows=64, warm=True, self_check="off", select=False
):
    """``install()`` on a (faked) SM90 GPU of 132 SMs inside a model runner's
    JIT warmup registry, then the registry's warmup (the stage's real warmup,
    compiling on fakes; the self-check launches kernels, so "off" by
    default), as a runner does before serving; ``select``: opted in."""
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    patch.delenv(constants.SELF_CHECK_ENV, raising=False)
    # Both readers of the SM count: the stage's waves and the select's keys.
    patch.setattr(stage_module, "sm_count", lambda device: 132)
    patch.setattr(select_kernel, "sm_count", lambda device: 132)
    config = make_config(scheduler_config__max_num_seqs=max_rows)
    config.additional_config[constants.SELF_CHECK_KEY] = self_check
    config.additional_config[constants.SELECT_KEY] = select
    config.speculative_config = None  # decode_capacity: max_rows
    registry = JitWarmupRegistry(config)
    with patch.context() as gpu:
        fake_gpu(gpu, 90)
        with registry.activate():
            stage = install.install(config, attentions)
    buffer = attentions[0].indexer.topk_indices_buffer
    assert install.registry().by_buffer[buffer.data_ptr()] is stage
    assert stage.max_rows == max_rows and len(registry) == 1
    if warm:
        registry.warmup()
        assert stage.warmed
    return stage


def watch(stage, log: list[str]) -> None:
    """Logs the stage's hand-overs: ``defer`` when a step hands a layer's
    FusedRemap its pool top-k, ``materialize`` when a FusedRemap writes the
    logical rows of one it declines."""
    for remap in stage.remaps.values():
        remap.hand_over = partial(_logged, log, "defer", remap.hand_over)
    stage.materialize = partial(_logged, log, "materialize", stage.materialize)


def _logged(log, entry, fn, *args):
    log.append(entry)
    return fn(*args)


class Engine:
    """One engine's DSA layer holding ``inputs``' caches and top-k buffer:
    its index group and the stage ``install`` (the fixture) builds on it, its
    hand-overs watched. ``run`` runs a step of the patched indexer on it."""

    def __init__(
        self,
        install,
        timeline,
        inputs,
        *,
        max_rows=64,
        capacity=64,
        bound=True,
        warm=True,
        group=None,
        impl=None,
        select=False,
    ):
        self.timeline, self.inputs = timeline, inputs
        self.group = group or make_group(inputs.buffer, capacity, timeline)
        self.attention = make_attention(self.group, inputs, impl=impl, bound=bound)
        self.stage = install(
            [self.attention], max_rows=max_rows, warm=warm, select=select
        )
        watch(self.stage, timeline)

    def run(self, inputs, group=None, **kwargs):
        """``group``: the layer's (default), another, or False for none."""
        from vllm.models.glm5next.nvidia import sparse_indexer

        self.timeline.clear()
        got = run_step(
            sparse_indexer,
            inputs,
            self.group if group is None else group or None,
            log=self.timeline,
            **kwargs,
        )
        pending = [r.pending for r in self.stage.remaps.values()]
        assert pending == [None] * len(pending), "a deferred top-k was not converted"
        return got


# --- Running a step ----------------------------------------------------------


@dataclass
class Outcome:
    topk: torch.Tensor
    physical: torch.Tensor
    counts: torch.Tensor
    kv_cache: torch.Tensor
    tail: torch.Tensor
    log: list[str] = field(default_factory=list)

    @property
    def routes(self) -> list[str]:
        return routes_of(self.log)


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides (``clone`` compacts a sliced tensor)."""
    copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
    return copy.copy_(tensor)


def run_step(
    module,
    inputs: Inputs,
    group: SparseMLAIndexGroup | None,
    *,
    log: list[str] | None = None,
    layer_index: int = 0,
    return_valid_counts: bool = True,
    block_stride_rows: int | None = None,
    idx_mapping: torch.Tensor | None = None,
    consume=None,
    cudagraph_mode=None,
    dummy_run: bool = False,
) -> Outcome:
    """Runs ``module.sparse_attn_indexer_kpool`` on copies of ``inputs``
    (into ``inputs.buffer``), then the step's conversion of its top-k rows:
    ``group``'s, as the sparse MLA layer asks for it (with ``idx_mapping``:
    its ``_convert_once`` directly, as a HiSparse leader does), or
    ``consume(buffer)`` (a backend's ``forward_mqa``), which returns
    (physical, counts or None)."""
    from vllm.config import CUDAGraphMode

    args = {
        name: _copy(value) if isinstance(value, torch.Tensor) else value
        for name, value in inputs.args.items()
    }
    buffer = args["topk_indices_buffer"] = inputs.buffer
    buffer.copy_(inputs.args["topk_indices_buffer"])
    context = ForwardContext(
        no_compile_layers={},
        attn_metadata=inputs.metadata,
        slot_mapping={},
        cudagraph_runtime_mode=cudagraph_mode or CUDAGraphMode.NONE,
        dummy_run=dummy_run,
    )
    counts = None
    with override_forward_context(context):
        assert module.sparse_attn_indexer_kpool(**args) is buffer
        logical = buffer[: inputs.num_tokens]
        if consume is not None:
            physical, counts = consume(buffer)
        elif group is None:
            physical = torch.empty(0)
        elif idx_mapping is not None:
            result = group._convert_once(
                layer_index,
                logical,
                inputs.mla.req_id_per_token[: inputs.num_tokens],
                inputs.mla.block_table,
                inputs.mla.block_size,
                block_stride_rows=block_stride_rows,
                return_valid_counts=return_valid_counts,
                idx_mapping=idx_mapping,
            )
            physical, counts = result if return_valid_counts else (result, None)
        else:
            group.logical_topk_indices = buffer
            result = group.convert_logical_to_physical_topk(
                layer_index,
                logical,
                inputs.mla,
                block_stride_rows=block_stride_rows,
                return_valid_counts=return_valid_counts,
            )
            physical, counts = result if return_valid_counts else (result, None)
    return Outcome(
        topk=buffer.clone(),
        physical=physical.clone(),
        counts=counts.clone() if counts is not None else torch.empty(0),
        kv_cache=args["kv_cache"],
        tail=args["tail_kv_cache"],
        log=list(log) if log is not None else [],
    )


def stock_run(stock_module, inputs: Inputs, capacity: int = 64, **kwargs) -> Outcome:
    """The step in the unpatched tree, converted by a stock index group."""
    group = make_group(inputs.buffer, capacity, [])
    return run_step(stock_module, inputs, group, **kwargs)


def assert_same(got: Outcome, want: Outcome, *, logical: bool = True) -> None:
    """The same caches, physical top-k and counts (and logical top-k rows)."""
    assert torch.equal(got.kv_cache, want.kv_cache), "index K cache"
    assert torch.equal(got.tail.view(torch.int16), want.tail.view(torch.int16)), (
        "tail cache"
    )
    assert torch.equal(got.physical, want.physical), "physical top-k"
    assert torch.equal(got.counts, want.counts), "valid counts"
    if logical:
        assert torch.equal(got.topk, want.topk), "logical top-k rows"
