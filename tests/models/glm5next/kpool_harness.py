# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One decode step of GLM-5-Next's stock kpool indexer on the CPU, then its
sparse MLA index conversion, for comparing the stock tree with the hooks.

The indexer runs for real (``sparse_attn_indexer_kpool``: its stock Triton
kernels under ``TRITON_INTERPRET=1``); only DeepGEMM's paged MQA logits and the
CUDA top-k are replaced by torch references. The stage is installed as
``install()`` installs it and warmed up by its real warmup body (its kernels
compiled for ``CUTE_DSL_ARCH`` on fake tensors, once a session: ``Kernels``);
the CuTe kernels' launches (``UPDATE.run`` and the others) are replaced by
spies that check the kernel's own rule and compiled key, then compute the
result with the stock twin (``Spies``). Every launch, stock fallback, hand-over
and stream operation lands in one ``timeline``.
"""

import importlib.util
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

# Compiling on the CPU needs a target; set before cutlass compiles anything.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402

from vllm.forward_context import ForwardContext, override_forward_context  # noqa: E402
from vllm.model_executor.layers import sparse_attn_indexer  # noqa: E402
from vllm.model_executor.layers.attention.sparse_mla_attention import (  # noqa: E402
    SparseMLACommonImpl,
)
from vllm.model_executor.warmup.jit_warmup_cutedsl_helper import (  # noqa: E402
    VllmCuTeDSLJitKernel,
)
from vllm.models.glm5next.nvidia.ops import kpool_compress as kpool_ops  # noqa: E402
from vllm.utils import deep_gemm  # noqa: E402
from vllm.v1.attention.backends.mla import index_group as index_group_module  # noqa: E402
from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup  # noqa: E402
from vllm.v1.attention.backends.mla.indexer import (  # noqa: E402
    DeepSeekV32IndexerDecodeMetadata,
    DeepseekV32IndexerMetadata,
    DeepseekV32IndexerPrefillMetadata,
)
from vllm.v1.attention.backends.mla.sparse_utils import (  # noqa: E402
    triton_convert_req_index_to_global_index,
)

D = 128  # index head dim
HEADS = 4  # indexer query heads (the logits reference takes any)
POOL = 4  # index_kpool
TOPK = 128  # index_topk: 32 pools, the fewest a FusedRemap takes
WIDTH = 256  # get_sparse_topk_buffer_width: round_up(TOPK + POOL - 1, 128)
GLM_TOPK = 2048  # GLM-5-Next's index_topk: 512 pools
GLM_WIDTH = 2176  # and its top-k buffer width
BLOCK = 64  # MLA (and shared indexer) block, in tokens
PAGE = BLOCK // POOL  # indexer states per block
RING = 8  # tail ring of MTP with up to 4 speculative tokens
LAYER = "model.layers.0.self_attn.indexer.k_cache"
TAIL = "model.layers.0.self_attn.indexer.tail_cache"
MTP_LAYER = "model.layers.3.self_attn.indexer.k_cache"
MTP_TAIL = "model.layers.3.self_attn.indexer.tail_cache"

# The originals, before any test patches them.
STOCK_UPDATE = kpool_ops.kpool_decode_update_and_maybe_write_cache_batched
STOCK_EXPAND = kpool_ops.expand_pools_and_append_tail
STOCK_UPCAST = sparse_attn_indexer.as_fp32_logits
_REAL_COMPILE = VllmCuTeDSLJitKernel.compile
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


def use_mx_scales(monkeypatch, value: bool, *modules) -> None:
    """``mqa_logits_use_mx_scales()`` answers ``value`` in every module that
    imported it (the stock indexer, the fork, the kpool ops, DeepGEMM's MX
    inputs, the stage), and in ``modules`` (e.g. the stock indexer loaded by
    path)."""

    def answer() -> bool:
        return value

    targets = [m for m in list(sys.modules.values()) if m is not None]
    patched = []
    for module in [*targets, *modules]:
        try:
            current = vars(module).get("mqa_logits_use_mx_scales")
        except TypeError:
            continue
        if current is _MX_SCALES:
            monkeypatch.setattr(module, "mqa_logits_use_mx_scales", answer)
            patched.append(module.__name__)
    for name in (
        "vllm.utils.deep_gemm",
        "vllm.models.glm5next.nvidia.ops.kpool_compress",
        "vllm.models.glm5next.nvidia.sparse_indexer",
        "vllm.models.glm5next.nvidia.specialized_decode.kpool",
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


# --- DeepGEMM and CUDA top-k references ------------------------------------


def paged_logits_reference(logits_dtype=torch.bfloat16, odd_stride=False, mx=False):
    """``fp8_fp4_paged_mqa_logits`` in torch over the FP8 cache: ``sum_h w_h
    relu(q_h . k)`` per pool below the row's length. The cache's scales are
    FP32, or with ``mx`` four UE8M0 bytes (SM100)."""

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


class TopkReference:
    """``get_indexer_topk(backend)``: the ``k`` best columns below each row's
    length (ties by index), -1 beyond."""

    def __init__(self, backend):
        pass

    def __call__(self, logits, seq_lens, next_n, out, k, max_seq_len):
        ends = seq_lens.reshape(-1)
        cols = torch.arange(logits.shape[1])
        scores = logits.masked_fill(cols[None, :] >= ends[:, None], float("-inf"))
        values, ids = torch.sort(scores, dim=1, descending=True, stable=True)
        ids = torch.where(values[:, :k] == float("-inf"), -1, ids[:, :k])
        out.copy_(ids.to(out.dtype))


class _Workspace:
    """``current_workspace_manager()`` of the prefill branch (which a short
    prefill asks for, then leaves unused)."""

    @staticmethod
    def get_simultaneous(*shapes_and_dtypes):
        return [torch.empty(shape, dtype=dtype) for shape, dtype in shapes_and_dtypes]


def use_references(monkeypatch, modules, logits_fn) -> None:
    """DeepGEMM's paged logits, the CUDA top-k and the workspace manager
    replaced in each sparse indexer module of ``modules``."""
    for module in modules:
        monkeypatch.setattr(module, "fp8_fp4_paged_mqa_logits", logits_fn)
        monkeypatch.setattr(module, "get_indexer_topk", TopkReference)
        monkeypatch.setattr(module, "current_workspace_manager", _Workspace)


# --- Kernels: compiled at the stage's warmup, on fakes ---------------------

# (kernel class, compile key) -> executor: what this session compiled. The
# kernels' own caches start empty in each test, as in a new engine process.
_EXECUTORS: dict = {}


def kpool_module():
    from vllm.models.glm5next.nvidia.specialized_decode import kpool

    return kpool


def kernels() -> dict:
    kpool = kpool_module()
    return dict(
        update=kpool.UPDATE, expand=kpool.EXPAND, remap=kpool.REMAP, upcast=kpool.UPCAST
    )


def fresh_kernels(monkeypatch) -> None:
    """The kernels as in a new process (nothing compiled, no warmup yet); the
    CuTe compiles themselves run once a session (the compiled cache is
    process-wide)."""
    from vllm.models.glm5next.nvidia.specialized_decode import launch

    def compile_once(self, compile_key):
        memo = (type(self).__qualname__, compile_key)
        if memo not in _EXECUTORS:
            _REAL_COMPILE(self, compile_key)
            _EXECUTORS[memo] = self._compiled_cache[compile_key]
        self._compiled_cache[compile_key] = _EXECUTORS[memo]

    monkeypatch.setattr(VllmCuTeDSLJitKernel, "compile", compile_once)
    monkeypatch.setattr(launch, "_warmed_up", False)
    monkeypatch.setattr(launch, "_warmups_running", 0)
    for kernel in kernels().values():
        monkeypatch.setattr(kernel, "_compiled_cache", {})


def compiled_keys() -> dict[str, set]:
    return {name: set(k._compiled_cache) for name, k in kernels().items()}


# --- Spies -----------------------------------------------------------------


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
    """Each CuTe kernel's launch (``<KERNEL>.run``) replaced by a spy that
    records ``kernel:<name>``, fails the test unless the kernel's own rule
    (``*_unmet``) takes the arguments, the compile key is theirs and was
    compiled at warmup, then writes what the kernel would with the stock twin
    (the compile key's flags included). The stage's stock fallbacks are
    recorded as ``stock:<name>``, the indexer's own decode expansion as
    ``indexer:expand``."""

    def __init__(self, monkeypatch, timeline: list[str]):
        self.timeline = timeline
        kpool = kpool_module()
        self.kpool = kpool
        k = kernels()
        for name, spy in (
            ("update", self.update),
            ("expand", self.expand),
            ("remap", self.remap),
            ("upcast", self.upcast),
        ):
            monkeypatch.setattr(k[name], "run", spy)
        for name, label in (
            ("kpool_decode_update_and_maybe_write_cache_batched", "update"),
            ("as_fp32_logits", "upcast"),
            ("expand_pools_and_append_tail", "expand"),
        ):
            monkeypatch.setattr(kpool, name, self.recorded(label, getattr(kpool, name)))
        expand = self.recorded("expand", STOCK_EXPAND, "indexer")
        monkeypatch.setattr(kpool_ops, "expand_pools_and_append_tail", expand)

    def recorded(self, label, fn, by="stock"):
        def wrapper(*args, **kwargs):
            self.timeline.append(f"{by}:{label}")
            return fn(*args, **kwargs)

        return wrapper

    def _launch(self, name, kernel, key, problem):
        self.timeline.append(f"kernel:{name}")
        assert problem is None, f"{name} launched on what its rule refuses: {problem}"
        assert kernel.ready(key), f"{name} launched {key}, not compiled at warmup"

    def update(self, key, *args):
        kpool = self.kpool
        kv, tail, tail_slots, _, _, _, slots, positions = args
        self._launch("update", kpool.UPDATE, key, kpool.update_unmet(*args, POOL, D))
        assert key == kpool.KpoolUpdateKernel.CompileKey(
            tail.shape[2],
            kv.shape[1],
            kv.stride(0),
            tail.stride(0),
            tail.stride(1),
            key.mx_scales,
            key.round_scale,
            tail_slots.dtype,
            slots.dtype,
            positions.dtype,
        ), key
        with _stock_mx(key.mx_scales):
            STOCK_UPDATE(*args, POOL, D, round_scale=key.round_scale)

    def expand(self, key, pool_ids, seq_lens, out, seq_offset):
        kpool = self.kpool
        self._launch(
            "expand",
            kpool.EXPAND,
            key,
            kpool.expand_unmet(pool_ids, seq_lens, POOL, seq_offset, out),
        )
        assert key == kpool.ExpandPoolsKernel.CompileKey(
            pool_ids.shape[1], seq_lens.dtype
        ), key
        STOCK_EXPAND(pool_ids, seq_lens, POOL, seq_offset=seq_offset, out=out)

    def remap(self, key, pool_ids, positions, req_ids, table, out, counts, offset):
        kpool = self.kpool
        problem = kpool.remap_unmet(
            pool_ids,
            positions,
            POOL,
            req_ids,
            table,
            out,
            counts,
            key.block_size,
            offset,
        )
        self._launch("remap", kpool.REMAP, key, problem)
        assert (key.groups, key.width, key.positions_dtype, key.counts) == (
            pool_ids.shape[1],
            out.shape[1],
            positions.dtype,
            counts is not None,
        ), key
        logical = torch.full_like(out, -1)
        STOCK_EXPAND(
            pool_ids,
            positions,
            POOL,
            seq_offset=offset,
            out=logical[: pool_ids.shape[0]],
        )
        triton_convert_req_index_to_global_index(
            req_ids,
            table,
            logical,
            BLOCK_SIZE=key.block_size,
            BLOCK_STRIDE_ROWS=key.stride_rows,
            NUM_TOPK_TOKENS=out.shape[1],
            return_valid_counts=counts is not None,
            out=out,
            valid_counts_out=None if counts is None else counts[: out.shape[0]],
        )

    def upcast(self, key, logits, out, row_ends, *launch):
        from vllm.models.glm5next.nvidia.specialized_decode.upcast_kernel import (
            upcast_config,
        )

        kpool = self.kpool
        self._launch(
            "upcast", kpool.UPCAST, key, kpool.upcast_unmet(logits, row_ends, out)
        )
        assert key == kpool.UpcastLogitsKernel.CompileKey(), key
        assert list(launch) == [upcast_config(*logits.shape)], launch  # CTA bound
        # The columns below each row end; the kernel leaves the others.
        below = torch.arange(logits.shape[1])[None, :] < row_ends[:, None]
        out[below] = STOCK_UPCAST(logits, row_ends)[below]


# --- Streams and events ----------------------------------------------------


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


def fake_streams(monkeypatch, log: list[str]) -> None:
    compute = FakeStream(log, "compute")
    for module in (kpool_module(), index_group_module):
        monkeypatch.setattr(module, "current_stream", lambda: compute)


def make_group(
    buffer, capacity: int, log: list[str], *, recorded: bool = False
) -> SparseMLAIndexGroup:
    """A DSA layer's index group, sized like SparseMLAIndexGroupBuilder's.
    ``recorded``: its stock conversion logs ``stock:convert``."""
    group = SparseMLAIndexGroup(
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
    if recorded:
        stock = group._convert_once

        def convert_once(*args, **kwargs):
            log.append("stock:convert")
            return stock(*args, **kwargs)

        group._convert_once = convert_once
    return group


class FakeImpl:
    """What KpoolStage and install() read of a sparse MLA impl: its backend's
    ``forward_mqa`` converts decode rows through the index group, and it has
    patch 0005's flag."""

    forward_mqa = SparseMLACommonImpl.forward_mqa
    convert_decode_through_index_group = False

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


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
    step: Step
    args: dict
    metadata: dict
    mla: SimpleNamespace
    num_tokens: int
    num_blocks: int


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


def make_inputs(step: Step, *, mx: bool = False) -> Inputs:
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
        topk_backend="auto",
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
    return Inputs(step, args, metadata, mla, rows, num_blocks)


def mla_cache(inputs: Inputs, row: int = 8, dtype=torch.bfloat16) -> torch.Tensor:
    """The layer's bound MLA KV cache: ``[blocks, BLOCK, row]`` with
    ``step.stride_rows`` rows from one block to the next."""
    stride = inputs.step.stride_rows * row
    storage = torch.zeros(inputs.num_blocks * stride, dtype=dtype)
    return storage.as_strided((inputs.num_blocks, BLOCK, row), (stride, row, 1))


def make_attention(group, inputs: Inputs, *, impl=None, prefix=None, bound=True):
    """What KpoolStage and its warmup read of a Glm5NextMLAAttention whose
    indexer holds ``inputs``' caches (``bound``: its MLA KV cache too)."""
    if impl is None:
        impl = FakeImpl(
            index_group=group, group_conversion_decode_only=False, dcp_world_size=1
        )
    args = inputs.args
    mla_attn = SimpleNamespace(impl=impl)
    if bound:
        mla_attn.kv_cache = mla_cache(inputs)
    return SimpleNamespace(
        mla_attn=SimpleNamespace(mla_attn=mla_attn),
        indexer=SimpleNamespace(
            k_cache=SimpleNamespace(
                prefix=prefix or inputs.step.layer, kv_cache=args["kv_cache"]
            ),
            tail_cache=SimpleNamespace(
                prefix=inputs.step.tail, kv_cache=args["tail_kv_cache"]
            ),
            topk_tokens=args["topk_tokens"],
            topk_indices_buffer=args["topk_indices_buffer"],
            scale_fmt=args["scale_fmt"],
        ),
    )


# --- install() and the JIT warmup ------------------------------------------


def make_config(**overrides):
    """A vllm_config with what install() reads, of a supported deployment
    unless overridden (``section__field=value``)."""
    from vllm.config import CompilationMode, CUDAGraphMode

    config = SimpleNamespace(
        additional_config={"decode_backend": "latency_specialized"},
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


def fake_gpu(monkeypatch, capability: int | None) -> None:
    """The current platform as a CUDA GPU of ``capability`` (None: none)."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda", lambda: capability is not None)
    monkeypatch.setattr(
        current_platform,
        "is_device_capability",
        lambda c: capability is not None and c == capability,
    )
    monkeypatch.setattr(
        current_platform,
        "is_device_capability_family",
        lambda c: capability is not None and capability // 10 == c // 10,
    )


def install_stage(monkeypatch, attentions, *, max_rows: int = 64, warm: bool = True):
    """``install()`` on a (faked) SM90 GPU inside a model runner's JIT warmup
    registry, then the registry's warmup (the stage's real warmup body,
    compiling on fakes), as a runner does before serving. Restores
    ``SPECIALIZED_KPOOL`` and the plan after the test."""
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
    from vllm.models.glm5next.nvidia import sparse_indexer
    from vllm.models.glm5next.nvidia import specialized_decode as sd

    monkeypatch.setattr(sparse_indexer, "SPECIALIZED_KPOOL", None)
    monkeypatch.setattr(sd, "_plan", None)
    monkeypatch.delenv(sd.SELF_CHECK_ENV, raising=False)
    config = make_config(scheduler_config__max_num_seqs=max_rows)
    # The warmup's self-check launches the kernels: GPU only.
    config.additional_config[sd.SELF_CHECK_KEY] = "off"
    config.speculative_config = None  # decode_capacity: max_rows
    registry = JitWarmupRegistry(config)
    with monkeypatch.context() as gpu:
        fake_gpu(gpu, 90)
        with registry.activate():
            stage = sd.install(config, attentions)
    assert stage is not None and sparse_indexer.SPECIALIZED_KPOOL is stage
    assert stage.max_rows == max_rows and len(registry) == 1
    if warm:
        registry.warmup()
        assert sd._plan.warmed
    return stage


def watch(stage, log: list[str]) -> None:
    """Logs the stage's hand-overs: ``defer`` when ``resolve`` leaves a
    pending top-k for the index remap, ``materialize`` when a FusedRemap
    writes the logical rows of one it declines."""
    resolve, materialize = stage.resolve, stage.materialize

    def resolve_and_log(*args, **kwargs):
        handed = resolve(*args, **kwargs)
        if stage.pending is not None:
            log.append("defer")
        return handed

    def materialize_and_log(*args, **kwargs):
        log.append("materialize")
        return materialize(*args, **kwargs)

    stage.resolve, stage.materialize = resolve_and_log, materialize_and_log


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
    """Runs ``module.sparse_attn_indexer_kpool`` on copies of ``inputs``,
    then the step's conversion of its top-k rows: ``group``'s, as the sparse
    MLA layer asks for it (with ``idx_mapping``: its ``_convert_once``
    directly, as a HiSparse leader does), or ``consume(buffer)`` (a backend's
    ``forward_mqa``), which returns (physical, counts or None)."""
    from vllm.config import CUDAGraphMode

    args = {
        name: _copy(value) if isinstance(value, torch.Tensor) else value
        for name, value in inputs.args.items()
    }
    context = ForwardContext(
        no_compile_layers={},
        attn_metadata=inputs.metadata,
        slot_mapping={},
        cudagraph_runtime_mode=cudagraph_mode or CUDAGraphMode.NONE,
        dummy_run=dummy_run,
    )
    counts = None
    with override_forward_context(context):
        buffer = module.sparse_attn_indexer_kpool(**args)
        assert buffer is args["topk_indices_buffer"]
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
