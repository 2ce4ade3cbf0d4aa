# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One decode step of GLM-5-Next's stock kpool indexer on the CPU, then its
sparse MLA index conversion, for comparing the stock tree with the hooks.

The indexer runs for real (``sparse_attn_indexer_kpool``: its stock Triton
kernels under ``TRITON_INTERPRET=1``); only DeepGEMM's paged MQA logits and the
CUDA top-k are replaced by torch references, and the CuTe kernels by spies
that run their stock twins and record the route (``Spies``).
"""

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from vllm.forward_context import ForwardContext, override_forward_context
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
)
from vllm.models.glm5next.nvidia.ops import kpool_compress as kpool_ops
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

D = 128  # index head dim
HEADS = 4  # indexer query heads (the logits reference takes any)
POOL = 4  # index_kpool
TOPK = 128  # index_topk: 32 pools, the fewest a FusedRemap takes
WIDTH = 256  # get_sparse_topk_buffer_width: round_up(TOPK + POOL - 1, 128)
BLOCK = 64  # MLA (and shared indexer) block, in tokens
PAGE = BLOCK // POOL  # indexer states per block
RING = 8  # tail ring of MTP with up to 4 speculative tokens
NUM_BLOCKS = 48
MAX_BLOCKS = 8  # block table columns: up to 512 tokens per request
MAX_POOL_LEN = MAX_BLOCKS * PAGE
LAYER = "model.layers.0.self_attn.indexer.k_cache"
TAIL = "model.layers.0.self_attn.indexer.tail_cache"
MTP_LAYER = "model.layers.3.self_attn.indexer.k_cache"
MTP_TAIL = "model.layers.3.self_attn.indexer.tail_cache"


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


# --- DeepGEMM and CUDA top-k references ------------------------------------


def paged_logits_reference(logits_dtype=torch.bfloat16, odd_stride=False):
    """``fp8_fp4_paged_mqa_logits`` in torch over the FP8 cache with FP32
    scales: ``sum_h w_h relu(q_h . k)`` per pool below the row's length."""

    def logits_fn(q, kv_cache, weights, seq_lens, block_table, schedule, **kw):
        q_values = q[0]
        batch, next_n = q_values.shape[:2]
        rows = batch * next_n
        pages = kv_cache.shape[0]
        flat = kv_cache.reshape(pages, -1)
        values = flat[:, : PAGE * D].contiguous().view(torch.float8_e4m3fn)
        scales = flat[:, PAGE * D :].contiguous().view(torch.float32)
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


# --- Spies -----------------------------------------------------------------


class Spies:
    """The CuTe entry points of ``kpool.py`` replaced by their stock twins
    (``kernel:<name>``), and its stock fallbacks wrapped (``stock:<name>``);
    ``routes`` lists each call in order."""

    def __init__(self, monkeypatch, kpool):
        self.routes: list[str] = []
        self.kpool = kpool
        stock_update = kpool.kpool_decode_update_and_maybe_write_cache_batched
        stock_upcast = kpool.as_fp32_logits
        stock_expand = kpool.expand_pools_and_append_tail

        def kpool_update(*args, mx_scales=True, round_scale=True):
            self.routes.append("kernel:update")
            assert mx_scales == kpool_ops.mqa_logits_use_mx_scales()
            stock_update(*args, D, round_scale=round_scale)

        def upcast_logits(logits, row_ends, *args, out=None, **kwargs):
            self.routes.append("kernel:upcast")
            assert out is None
            return stock_upcast(logits, row_ends)

        def expand_pools(pool_ids, seq_lens, pool_size, *, seq_offset=0, out, **kw):
            self.routes.append("kernel:expand")
            rows = pool_ids.shape[0]
            stock_expand(
                pool_ids, seq_lens, pool_size, seq_offset=seq_offset, out=out[:rows]
            )
            return out[:rows, : pool_ids.shape[1] * pool_size + pool_size - 1]

        def expand_and_remap(
            pool_ids, positions, pool_size, req_ids, block_table, out, counts, *,
            block_size, stride_rows, seq_offset=1,
        ):  # fmt: skip
            self.routes.append("kernel:remap")
            logical = torch.full_like(out, -1)
            stock_expand(
                pool_ids,
                positions,
                pool_size,
                seq_offset=seq_offset,
                out=logical[: pool_ids.shape[0]],
            )
            triton_convert_req_index_to_global_index(
                req_ids,
                block_table,
                logical,
                BLOCK_SIZE=block_size,
                BLOCK_STRIDE_ROWS=stride_rows,
                NUM_TOPK_TOKENS=out.shape[1],
                return_valid_counts=True,
                out=out,
                valid_counts_out=counts[: out.shape[0]],
            )

        def recorded(name, fn):
            def wrapper(*args, **kwargs):
                self.routes.append(f"stock:{name}")
                return fn(*args, **kwargs)

            return wrapper

        for name, fn in dict(
            kpool_update=kpool_update,
            upcast_logits=upcast_logits,
            expand_pools=expand_pools,
            expand_and_remap=expand_and_remap,
            kpool_decode_update_and_maybe_write_cache_batched=recorded(
                "update", stock_update
            ),
            as_fp32_logits=recorded("upcast", stock_upcast),
            expand_pools_and_append_tail=recorded("expand", stock_expand),
        ).items():
            assert hasattr(kpool, name), name
            monkeypatch.setattr(kpool, name, fn)


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


def fake_streams(monkeypatch, kpool, log: list[str]) -> None:
    compute = FakeStream(log, "compute")
    for module in (kpool, index_group_module):
        monkeypatch.setattr(module, "current_stream", lambda: compute)


def make_group(buffer, capacity: int, log: list[str]) -> SparseMLAIndexGroup:
    """A DSA layer's index group, sized like SparseMLAIndexGroupBuilder's."""
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
    ``forward_mqa`` converts decode rows through the index group."""

    forward_mqa = SparseMLACommonImpl.forward_mqa

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


def make_attention(group, prefix: str, buffer, impl_class=FakeImpl, **impl):
    """What KpoolStage reads of a Glm5NextMLAAttention."""
    impl = impl_class(
        index_group=group,
        **{"group_conversion_decode_only": False, "dcp_world_size": 1, **impl},
    )
    return SimpleNamespace(
        mla_attn=SimpleNamespace(mla_attn=SimpleNamespace(impl=impl)),
        indexer=SimpleNamespace(
            k_cache=SimpleNamespace(prefix=prefix), topk_indices_buffer=buffer
        ),
    )


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
    width: int = WIDTH
    key_stride: int = D  # row stride of the indexer key

    @property
    def tokens(self) -> int:
        return sum(self.q_lens)


@dataclass
class Inputs:
    args: dict
    metadata: dict
    mla: SimpleNamespace
    num_tokens: int


def _fp8_cache(gen) -> torch.Tensor:
    cache = torch.empty((NUM_BLOCKS, PAGE, D + 4), dtype=torch.uint8)
    flat = cache.view(NUM_BLOCKS, -1)
    values = (torch.randn((NUM_BLOCKS, PAGE * D), generator=gen) * 100).clamp(-448, 448)
    flat[:, : PAGE * D] = values.to(torch.float8_e4m3fn).view(torch.uint8)
    exponents = torch.randint(-12, -4, (NUM_BLOCKS, PAGE), generator=gen)
    scales = torch.pow(2.0, exponents.float())
    flat[:, PAGE * D :] = scales.view(torch.uint8).view(NUM_BLOCKS, PAGE * 4)
    return cache


def make_inputs(step: Step) -> Inputs:
    gen = torch.Generator().manual_seed(step.seed)
    batch = len(step.q_lens)
    decode = step.tokens
    real = decode + step.prefill
    rows = real + step.pad_rows
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    reqs = batch + (1 if step.prefill else 0)
    tables = perm[: reqs * MAX_BLOCKS].view(reqs, MAX_BLOCKS).to(torch.int32)
    ctx = list(step.ctx) + ([0] if step.prefill else [])
    q_lens = list(step.q_lens) + ([step.prefill] if step.prefill else [])
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
    args = dict(
        hidden_states=torch.zeros((rows, 8)),
        k_cache_prefix=step.layer,
        kv_cache=_fp8_cache(gen),
        q_quant=q,
        q_scale=None,
        k=key,
        weights=weights,
        quant_block_size=128,
        scale_fmt="ue8m0",
        topk_tokens=TOPK,
        head_dim=D,
        max_pool_len=MAX_POOL_LEN,
        total_seq_lens=4096,
        topk_indices_buffer=torch.full((rows + 4, step.width), -5, dtype=torch.int32),
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
        req_id_per_token=req_ids, block_table=tables, block_size=BLOCK
    )
    return Inputs(args=args, metadata=metadata, mla=mla, num_tokens=rows)


@dataclass
class Outcome:
    topk: torch.Tensor
    physical: torch.Tensor
    counts: torch.Tensor
    kv_cache: torch.Tensor
    tail: torch.Tensor
    routes: list[str]
    log: list[str]


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides (``clone`` compacts a sliced tensor)."""
    copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
    return copy.copy_(tensor)


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


def run_step(
    module,
    inputs: Inputs,
    group: SparseMLAIndexGroup | None,
    *,
    routes: list[str] | None = None,
    layer_index: int = 0,
    return_valid_counts: bool = True,
    block_stride_rows: int | None = None,
    cudagraph_mode=None,
    log: list[str] | None = None,
    dummy_run: bool = False,
) -> Outcome:
    """Runs ``module.sparse_attn_indexer_kpool`` on copies of ``inputs``,
    then ``group``'s conversion of the step's top-k rows, as the sparse MLA
    layer does."""
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
    with override_forward_context(context):
        buffer = module.sparse_attn_indexer_kpool(**args)
        assert buffer is args["topk_indices_buffer"]
        logical = buffer[: inputs.num_tokens]
        if group is not None:
            group.logical_topk_indices = buffer
            result = group.convert_logical_to_physical_topk(
                layer_index,
                logical,
                inputs.mla,
                block_stride_rows=block_stride_rows,
                return_valid_counts=return_valid_counts,
            )
            physical, counts = result if return_valid_counts else (result, None)
        else:
            physical = counts = torch.empty(0)
    return Outcome(
        topk=buffer.clone(),
        physical=physical.clone(),
        counts=counts.clone() if counts is not None else torch.empty(0),
        kv_cache=args["kv_cache"],
        tail=args["tail_kv_cache"],
        routes=list(routes) if routes is not None else [],
        log=list(log) if log is not None else [],
    )
