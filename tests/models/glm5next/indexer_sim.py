# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The indexer simulator: the ``dsa_kpool`` stage against stock, every byte
a step of ``sparse_attn_indexer_kpool`` and its top-k conversion leaves:
``Run`` step after step (eager, FULL and piecewise graphs, two stages,
streams held back), ``Bench`` one step of one layer (the CPU routing tests).
DeepGEMM's scores are the simulator's own: vLLM's torch ones take no MX or
query scales, read a ``next_n > 1`` cache per token and give ``-inf`` past a
row's end (``PAST_END`` here, which a top-k that read it would pick)."""

import contextlib
import importlib.util
import os
import random
import secrets
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from types import SimpleNamespace as NS
from unittest import mock

import indexer_batches as batches
import torch
from indexer_batches import BACKENDS, POOL, Backend, D, Geometry, Workload
from select_contract import contract_topk

from vllm.compilation import breakable_cudagraph as breakable
from vllm.config import CUDAGraphMode
from vllm.forward_context import (
    BatchDescriptor,
    ForwardContext,
    get_forward_context,
    override_forward_context,
)
from vllm.model_executor.layers import sparse_attn_indexer as stock_layers
from vllm.model_executor.layers.attention import sparse_mla_attention
from vllm.models.glm5next.nvidia import sparse_indexer
from vllm.models.glm5next.nvidia.ops import kpool_compress as kpool_ops
from vllm.models.glm5next.nvidia.specialized_decode import cases, kpool
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.common import host
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.scores import (
    launch as scores_launch,
)
from vllm.models.glm5next.nvidia.specialized_decode.runtime import install, remap
from vllm.models.glm5next.nvidia.specialized_decode.runtime import (
    stage as stage_module,
)
from vllm.utils import deep_gemm
from vllm.v1.attention.backends.mla import flashinfer_mla_sparse_sm90 as fi_sm90
from vllm.v1.attention.backends.mla import flashmla_sparse, sparse_utils
from vllm.v1.attention.backends.mla import index_group as groups

# Written over every buffer a layer's step may write, before it: no result
# is ever -7, so a byte left as it was shows.
POISON = -7
PAST_END = 1e30  # logits past a row's end: any top-k that read them picks them
# The stock functions, before any test patches them.
STOCK_UPDATE = kpool_ops.kpool_decode_update_and_maybe_write_cache_batched
STOCK_EXPAND = kpool_ops.expand_pools_and_append_tail
STOCK_UPCAST = stock_layers.as_fp32_logits
STOCK_CONVERT = sparse_utils.triton_convert_req_index_to_global_index
STOCK_MX = deep_gemm.mqa_logits_use_mx_scales
KERNELS = dict(update=kpool.UPDATE, expand=kpool.EXPAND, remap=kpool.REMAP)
KERNELS |= dict(upcast=kpool.UPCAST, select=kpool.SELECT, scores=scores_launch.SCORES)
# The stock sparse MLA impl of each backend path (the stage tells backends
# apart by their class's ``forward_mqa``).
IMPLS = dict(
    group=sparse_mla_attention.SparseMLACommonImpl,
    group_no_counts=flashmla_sparse.FlashMLASparseImpl,
    compute=fi_sm90.FlashInferMLASparseSM90Impl,
)
# What ``differences`` compares, in its order.
FIELDS = ("index cache", "tail cache", "logical top-k", "physical top-k")
FIELDS += ("counts", "pool ids")
kernel_name = lambda key: next(
    n for n, k in KERNELS.items() if isinstance(key, k.CompileKey)
)
ints = lambda shape, device: torch.full(shape, POISON, dtype=torch.int32, device=device)


def _scale(raw: torch.Tensor, mx: bool) -> torch.Tensor:
    """Per-32-block float64 factors of four scale bytes: UE8M0 with MX, else FP32."""
    if mx:
        return torch.pow(2.0, raw.double() - 127.0)
    return raw.contiguous().view(torch.float32).double().expand(*raw.shape[:-1], 4)


def _logits(q, q_scale, weights, width: int, ends, gather):
    """``sum_h w_h relu(q_h . k)`` of FP8 ``q [R, H, D]`` and the keys that
    ``gather(rows, cols)`` gives, in float64: each 32-wide block's dot product
    is exact whatever the order of its sums."""
    (rows, heads), mx = q.shape[:2], q_scale is not None
    if mx:
        raw = q_scale.reshape(rows, heads).contiguous().view(torch.uint8)
        q_scale = _scale(raw.view(rows, heads, 4), True)
    cols = torch.arange(width, device=q.device)
    out = torch.full((rows, width), PAST_END, dtype=torch.float64, device=q.device)
    step = max(1, (1 << 20) // (max(width, 1) * heads))
    for start in range(0, rows, step):
        sl = slice(start, start + step)
        keys, scales = gather(sl, cols)
        qb = q[sl].float().double().view(-1, heads, 4, D // 4)
        kb = keys.float().double().view(*keys.shape[:2], 4, D // 4)
        dots = torch.einsum("rhbd,rlbd->rhlb", qb, kb) * _scale(scales, mx)[:, None]
        if mx:
            dots = dots * q_scale[sl][:, :, None]
        score = (torch.relu(dots.sum(-1)) * weights[sl].double()[:, :, None]).sum(1)
        out[sl] = torch.where(cols < ends[sl, None], score, PAST_END)
    return out


def paged_logits(q, kv_cache, weights, lens, tables, schedule=None, **kw):
    """DeepGEMM's ``fp8_fp4_paged_mqa_logits`` (``tables`` per request or per
    row): BF16 logits with MX scales (SM100), else FP32; ``dtype`` overrides,
    ``pad`` widens the row stride past ``max_model_len``."""
    values, q_scale = q
    rows, (blocks, page) = values.shape[0] * values.shape[1], kv_cache.shape[:2]
    flat = kv_cache.reshape(blocks, -1)
    keys = flat[:, : page * D].view(torch.float8_e4m3fn).view(blocks, page, D)
    scales = flat[:, page * D :].view(blocks, page, 4)
    table = tables[torch.arange(rows, device=values.device) * tables.shape[0] // rows]

    def gather(sl, cols):
        ids, slots = table[sl][:, cols // page].long(), cols % page
        return keys[ids, slots], scales[ids, slots]

    width, ends = kw["max_model_len"], lens.reshape(-1)[:rows]
    out = _logits(values.reshape(rows, -1, D), q_scale, weights, width, ends, gather)
    dtype = kw.get("dtype") or (torch.float32 if q_scale is None else torch.bfloat16)
    shape = (rows, width + kw.get("pad", 0))
    return torch.empty(shape, dtype=dtype, device=out.device)[:, :width].copy_(out)


def ragged_logits(q, kv, weights, ks, ke, max_seqlen_k):
    """DeepGEMM's ``fp8_fp4_mqa_logits``: row ``i`` scores keys ``[ks[i],
    ke[i])`` from column 0."""
    (values, q_scale), (k_values, k_scales) = q, kv
    raw = k_scales.contiguous().view(torch.uint8).view(-1, 4)

    def gather(sl, cols):
        ids = (ks[sl, None].long() + cols).clamp(max=max(len(k_values) - 1, 0))
        return k_values[ids], raw[ids]

    out = _logits(values, q_scale, weights, max_seqlen_k, ke - ks, gather)
    return out.to(torch.float32 if q_scale is None else torch.bfloat16)


def deep_gemm_logits(q, kv_cache, weights, lens, tables, schedule=None, **kw):
    """DeepGEMM's own SM90 paged logits with its schedule for this GPU (the
    kernel-only shim's metadata has none): what ``kpool_scores`` matches."""
    if q[1] is not None or kw.get("indices") is not None:
        raise ValueError("deep_gemm_logits: SM90's call (no MX scales, no indices)")
    arguments = dict(q=q, kv_cache=kv_cache, weights=weights, seq_lens=lens)
    arguments |= dict(block_table=tables, max_model_len=kw["max_model_len"])
    try:
        return cases.deep_gemm_scores(arguments)
    except RuntimeError as error:  # the kernel-only shim without the package
        raise RuntimeError(
            f"{error}: the scores runs compare with vLLM's vendored DeepGEMM "
            "(tools/kernel_env/prepare.sh --deep-gemm, then gpu_tier.sh)"
        ) from error


def stable_topk(logits, starts, ends, k: int) -> torch.Tensor:
    """The ``k`` best columns of each row in ``[starts, ends)``, ties to the
    lower column, -1 past the valid ones."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    valid = (cols >= starts[:, None]) & (cols < ends[:, None])
    scores = logits.float().masked_fill(~valid, float("-inf"))
    values, ids = torch.sort(scores, dim=1, descending=True, stable=True)
    ids = torch.where(values == float("-inf"), -1, ids)[:, :k].to(torch.int32)
    return torch.nn.functional.pad(ids, (0, k - ids.shape[1]), value=-1)


def _stable_decode_topk(logits, seq_lens, next_n, out, k, max_seq_len):
    ends = seq_lens.reshape(-1)[: logits.shape[0]].to(torch.int32)
    out.copy_(stable_topk(logits, torch.zeros_like(ends), ends, k))


def _contract_decode_topk(logits, seq_lens, next_n, out, k, max_seq_len):
    ids = contract_topk(logits, seq_lens.reshape(-1).to(torch.int32), k)
    last = (ids >= 0).sum(1, keepdim=True) - 1
    flip = (last - torch.arange(k, device=ids.device)).clamp(min=0)
    out.copy_(torch.where(ids >= 0, ids.gather(1, flip), -1))


# ``get_indexer_topk(backend)`` stand-ins: ``stable_topk``, deterministic, so
# both sides pick the same ties (CUDA, the kernel-only shim); beside the
# select, ``contract_topk``'s set with each row's ids reversed (stock's order
# is its own; rows compare as sets).
stable_decode_topk = lambda backend=None: _stable_decode_topk
contract_decode_topk = lambda backend=None: _contract_decode_topk


def _gather(kv_cache, dst_k, dst_scale, block_table, cu) -> None:
    """``cp_gather_indexer_k_quant_cache``: each request's first entries."""
    blocks, page = kv_cache.shape[:2]
    flat = kv_cache.reshape(blocks, -1)
    lens, total = (cu[1:] - cu[:-1]).long(), int(cu[-1])
    req = torch.repeat_interleave(torch.arange(len(lens), device=cu.device), lens)
    pos = torch.arange(total, device=cu.device) - cu[:-1].long()[req]
    ids, slot = block_table[req, pos // page].long(), pos % page
    keys = flat[:, : page * D].view(blocks, page, D)
    dst_k[:total].view(torch.uint8).copy_(keys[ids, slot])
    dst_scale[:total].copy_(flat[:, page * D :].view(blocks, page, 4)[ids, slot])


def _prefill_topk(logits, starts, ends, out, rows, s0, s1, k) -> None:
    out[:rows].copy_(stable_topk(logits[:rows], starts[:rows], ends[:rows], k))


_LIBRARY: list = []
# ``current_workspace_manager()``: fresh buffers of the asked shapes.
Workspace = NS(device=torch.device("cpu"))
Workspace.get_simultaneous = lambda *specs: [
    torch.empty(s, dtype=t, device=Workspace.device) for s, t in specs
]


def references(patch, modules, device, logits=paged_logits, topk=None) -> None:
    """The stand-ins in the indexer ``modules`` and the stage (``topk`` as
    ``get_indexer_topk``); the prefill top-k op where vLLM's ``_C`` is absent."""
    if not (_LIBRARY or hasattr(torch.ops._C, "top_k_per_row_prefill")) and (
        importlib.util.find_spec("vllm._C") is None
    ):
        lib = torch.library.Library("_C", "FRAGMENT")
        lib.define(
            "top_k_per_row_prefill(Tensor logits, Tensor row_starts, Tensor "
            "row_ends, Tensor(a!) out, int num_rows, int stride0, int stride1, "
            "int k) -> ()"
        )
        lib.impl("top_k_per_row_prefill", _prefill_topk, "CompositeExplicitAutograd")
        _LIBRARY.append(lib)
    Workspace.device = torch.device(device)
    names = dict(fp8_fp4_paged_mqa_logits=logits)
    names |= {} if topk is None else dict(get_indexer_topk=topk)
    indexer = names | dict(
        fp8_fp4_mqa_logits=ragged_logits,
        current_workspace_manager=lambda: Workspace,
        ops=NS(cp_gather_indexer_k_quant_cache=_gather),
    )
    for module, values in [*((m, indexer) for m in modules), (stage_module, names)]:
        for name, value in values.items():
            patch.setattr(module, name, value, raising=False)


def mx_scales(patch, flag: bool, *modules) -> None:
    """``mqa_logits_use_mx_scales()`` answers ``flag`` wherever imported."""
    vllm = [m for n, m in list(sys.modules.items()) if n.partition(".")[0] == "vllm"]
    for module in [*vllm, *modules]:
        if getattr(module, "mqa_logits_use_mx_scales", None) is STOCK_MX:
            patch.setattr(module, "mqa_logits_use_mx_scales", lambda: flag)


class Fake:
    """A CUDA stream or event on the CPU: each use logged."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def __getattr__(self, use: str):
        if use.startswith("_"):
            raise AttributeError(use)
        on = lambda *args: ", ".join(a.name for a in args)
        return lambda *args: self.log.append(f"{self.name}.{use}({on(*args)})")

    def __enter__(self):
        self.log.append(f"enter {self.name}")

    def __exit__(self, *exc):
        self.log.append(f"exit {self.name}")


def stock_convert(req_ids, table, logical, block, stride, counts, **out):
    sizes = dict(BLOCK_SIZE=block, BLOCK_STRIDE_ROWS=stride)
    sizes |= dict(NUM_TOPK_TOKENS=logical.shape[1], return_valid_counts=counts)
    return STOCK_CONVERT(req_ids, table, logical, **sizes, **out)


def twin(name: str, key, *args) -> None:
    """Writes what the executor of ``key`` would, by the stock twin."""
    if name == "update":
        mx = lambda: key.mx_scales
        with mock.patch.object(kpool_ops, "mqa_logits_use_mx_scales", mx):
            STOCK_UPDATE(*args, POOL, D, round_scale=key.round_scale)
    elif name in ("expand", "remap"):
        ids, lengths, *rest = args
        out, offset = (rest[0], rest[1]) if name == "expand" else (rest[2], rest[4])
        logical = out if name == "expand" else torch.full_like(out, -1)
        lengths = lengths[: len(ids)]
        lengths = lengths.to(torch.int32) if key.int32_lengths else lengths
        if len(ids):
            STOCK_EXPAND(ids, lengths, POOL, seq_offset=offset, out=logical[: len(ids)])
        if name == "remap":  # rest: request ids, block table, out, counts, offset
            valid = rest[3][: len(out)] if key.counts else None
            sizes = (key.block_size, key.stride_rows, key.counts)
            stock_convert(*rest[:2], logical, *sizes, out=out, valid_counts_out=valid)
    elif name == "upcast":
        logits, out, ends, _ = args
        below = torch.arange(logits.shape[1], device=logits.device) < ends[:, None]
        out[below] = STOCK_UPCAST(logits, ends)[below]
    elif name == "scores":
        q, kv, weights, lens, tables, out, _ = args
        width = out.shape[1]
        logits = paged_logits((q, None), kv, weights, lens, tables, max_model_len=width)
        ends = lens[:, -1].repeat_interleave(q.shape[1])
        below = torch.arange(width, device=out.device) < ends[:, None]
        out.view(torch.int32)[below] = logits.view(torch.int32)[below]
    else:  # the select
        logits, ends, out = args
        out.copy_(contract_topk(logits, ends, key.k))


def any_device(names, *tensors, optional=()) -> None:
    """``host.check_devices`` that takes CPU tensors."""
    first = None
    for name, tensor in zip(names, tensors, strict=True):
        if tensor is None and name in optional:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise host.mismatch(name, "a torch.Tensor", type(tensor).__name__)
        first = tensor if first is None else first
        if tensor.device != first.device:
            raise host.mismatch(name, f"a tensor on {first.device}", tensor.device)


class Spies:
    """The stage's launches as ``watch`` wraps them. With ``compute`` (the
    CPU) the stock twin writes what the executor would, CPU tensors pass, the
    SM count is an H100's, and ``timeline`` gets every route and stream use."""

    def __init__(self, patch, timeline: list, compute: bool = True):
        self.timeline, self.compute, self.launches = timeline, compute, Counter()
        self.compiled, self.launched = ({n: set() for n in KERNELS} for _ in "cl")
        if not compute:
            return
        for kernel in KERNELS.values():
            launch = sys.modules[type(kernel).__module__]
            patch.setattr(launch, "check_devices", any_device)
        select = sys.modules[type(kpool.SELECT).__module__]
        for module in (stage_module, select, scores_launch):
            patch.setattr(module, "sm_count", lambda index: 132)
        update = "kpool_decode_update_and_maybe_write_cache_batched"
        expand = "expand_pools_and_append_tail"
        for name, module, label in (
            (update, stage_module, "stock:update"),
            ("as_fp32_logits", stage_module, "stock:upcast"),
            (expand, stage_module, "stock:expand"),
            (expand, kpool_ops, "indexer:expand"),
            ("triton_convert_req_index_to_global_index", groups, "stock:convert"),
        ):
            patch.setattr(module, name, self.logged(label, getattr(module, name)))
        compute_stream = Fake(timeline, "compute")
        for module in (remap, groups):
            patch.setattr(module, "current_stream", lambda: compute_stream)

    def logged(self, entry: str, fn):
        def wrapper(*args, **kwargs):
            self.timeline.append(entry)
            return fn(*args, **kwargs)

        return wrapper

    def watch(self, stage) -> None:
        for key, executor in list(stage.executors.items()):
            name = kernel_name(key)
            self.compiled[name].add(key)

            def spy(*args, key=key, name=name, executor=executor):
                self.timeline.append(f"kernel:{name}")
                self.launched[name].add(key)
                self.launches[name] += 1
                twin(name, key, *args) if self.compute else executor(*args)

            stage.executors[key] = spy
        for fused in stage.remaps.values():
            fused.hand_over = self.logged("defer", fused.hand_over)
        stage.materialize = self.logged("materialize", stage.materialize)

    def forget(self, stage, name: str) -> None:
        """As if ``stage``'s warmup had not compiled kernel ``name``."""
        for key in [k for k in stage.executors if kernel_name(k) == name]:
            del stage.executors[key]


class Sim:
    """A configuration's initial caches (FP8 keys scaled ``2^-12 .. 2^-5``;
    MX: four equal UE8M0 bytes, as the update writes them), inputs, scheduler
    and metadata builder (``deep_gemm``: the rows DeepGEMM's scores take)."""

    def __init__(
        self, geo, backend, device, seed: int, timeline=None, work=None, deep_gemm=False
    ):
        self.geo, self.backend, self.device = geo, backend, torch.device(device)
        self.timeline = [] if timeline is None else timeline
        self.gen = g = torch.Generator(self.device).manual_seed(seed)
        self.sched = batches.Scheduler(geo, work or Workload(), random.Random(seed))
        self.builder = batches.Builder(geo, backend, self.device, deep_gemm)
        dev, n, t, page = self.device, geo.layers, geo.max_tokens, geo.page
        randn = lambda *shape: torch.randn(shape, generator=g, device=dev)
        self.kv = []
        for _ in range(n):
            fp8 = (randn(geo.num_blocks, page * D) * 100).clamp(-448, 448)
            e = torch.randint(-12, -4, (geo.num_blocks, page), generator=g, device=dev)
            ue8m0 = (e + 127).to(torch.uint8).repeat_interleave(4, 1)
            fp32 = torch.pow(2.0, e.float()).view(torch.uint8)
            keys = fp8.to(torch.float8_e4m3fn).view(torch.uint8)
            scales = ue8m0 if backend.mx else fp32
            self.kv.append(torch.cat([keys, scales], 1).view(-1, page, D + 4))
        tail = (geo.max_reqs + 1, 2, geo.ring, D)
        self.tail = [randn(*tail).bfloat16() for _ in range(n)]
        self.ape = [randn(POOL, D) for _ in range(n)]
        self.source = NS(
            q=torch.zeros((n, t, geo.heads, D), device=dev).to(torch.float8_e4m3fn),
            k=torch.zeros((n, t, geo.key_stride), dtype=torch.bfloat16, device=dev),
            w=torch.zeros((n, t, geo.heads), device=dev),
            gate=torch.zeros((n, t, D), dtype=torch.bfloat16, device=dev),
        )

    def fill(self, rows: int) -> None:
        """Fresh inputs for ``rows`` rows (query and weight heads past the
        indexer's own zero, as vLLM pads them)."""
        real, gen, dev = self.geo.index_heads or self.geo.heads, self.gen, self.device
        for name, x in vars(self.source).items():
            values = torch.randn(x[:, :rows].shape, generator=gen, device=dev)
            if name in ("q", "w"):
                values[:, :, real:] = 0
            x[:, :rows] = (values * (8 if name == "q" else 1)).to(x.dtype)


class Model:
    """One engine's DSA layers: ``module`` the indexer it runs, ``kpool`` its
    ``SPECIALIZED_KPOOL`` (None: stock), ``options`` how it converts
    (``counts``, ``layer_index``, ``block_stride_rows``, ``consume``), ``hold``
    GPU cycles a stream is held back at a hand-off, ``between(layer)`` what
    runs between a layer's indexer and conversion; per layer an index group
    and ``snaps``: what its consumer saw (``flags``: deferred, rows converted)."""

    def __init__(
        self, sim: Sim, name: str, *, module=None, impl=None, capacity=None, bound=True
    ):
        geo, dev, log = sim.geo, sim.device, sim.timeline
        self.sim, self.name, self.module = sim, name, module or sparse_indexer
        self.kpool = self.stage = self.between = None
        self.options, self.hold, self.record = {}, 0, True
        self.kv, self.tail = [c.clone() for c in sim.kv], [c.clone() for c in sim.tail]
        t, w, cuda = geo.max_tokens, geo.width, dev.type == "cuda"
        self.buffer = ints((t, w), dev)
        self.hidden = torch.zeros((t, 8), dtype=torch.bfloat16, device=dev)
        self.forwards = torch.zeros(1, dtype=torch.int64, device=dev)
        rows = (geo.capacity if capacity is None else capacity) + 1
        snap = dict(logical=(t, w), physical=(t, w), counts=(t,), flags=(2,))
        # What the stage reads of each layer's indexer besides its caches.
        every_indexer = dict(topk_indices_buffer=self.buffer, topk_tokens=geo.topk)
        every_indexer |= dict(scale_fmt=geo.scale_fmt, max_pool_len=geo.max_pool_len)
        every_indexer["n_head"] = geo.index_heads or geo.heads
        event = lambda name: groups._create_event() if cuda else Fake(log, name)
        # The MLA cache as bound: [blocks, block, row], blocks
        # ``mla_block_rows`` rows apart (the fused remap's layout).
        mla_shape = (geo.num_blocks, geo.mla_block_rows, 16)
        self.groups, self.inputs, self.snaps, self.attentions = [], [], [], []
        for layer, (k_prefix, tail_prefix, _) in enumerate(geo.prefixes):
            group = groups.SparseMLAIndexGroup(
                logical_topk_indices=self.buffer,
                physical_topk_indices=ints((rows, w), dev),
                valid_topk_counts=ints((rows,), dev),
                side_stream=groups._create_side_stream(dev) if cuda else event("side"),
                logical_topk_ready=event("logical_ready"),
                physical_topk_ready=event("physical_ready"),
                has_indexer=True,
            )
            group.register_layer()
            source = vars(sim.source).items()
            self.inputs.append(NS(**{k: v[0].clone() for k, v in source}))
            self.snaps.append(NS(**{k: ints(s, dev) for k, s in snap.items()}))
            if impl is None:  # no method of it runs: what the stage reads of one
                cls = IMPLS[sim.backend.convert]
                made = cls.__new__(cls)
                state = dict(index_group=group, index_group_index=0, dcp_world_size=1)
                vars(made).update(state)
            mla_kv = torch.empty(mla_shape, dtype=torch.uint8, device=dev)
            mla_kv = mla_kv[:, : geo.block] if bound else None
            mla = NS(impl=impl(group) if impl else made, kv_cache=mla_kv)
            k_cache = NS(prefix=k_prefix, kv_cache=self.kv[layer])
            tail_cache = NS(prefix=tail_prefix, kv_cache=self.tail[layer])
            indexer = NS(k_cache=k_cache, tail_cache=tail_cache, **every_indexer)
            self.groups.append(group)
            self.attentions.append(NS(indexer=indexer, mla_attn=NS(mla_attn=mla)))

    def active(self):
        kpool, module = self.kpool, self.module
        return mock.patch.object(module, "SPECIALIZED_KPOOL", kpool, create=True)

    def run(self, fwd, mode=CUDAGraphMode.NONE, dummy_run=False):
        forward = context(fwd, mode, dummy_run=dummy_run)
        with self.active(), override_forward_context(forward):
            self.forward(fwd)
        return self

    def forward(self, fwd) -> None:
        for layer in range(self.sim.geo.layers):
            self.forward_layer(fwd, layer)
        self.forwards += 1  # the model's work after the last break (its head)

    def forward_layer(self, fwd, layer: int) -> None:
        for name, buffer in vars(self.inputs[layer]).items():
            buffer[: fwd.rows].copy_(getattr(self.sim.source, name)[layer, : fwd.rows])
        group, pool = self.groups[layer], [self.stage.pool_buffer] if self.stage else []
        written = (group.physical_topk_indices, group.valid_topk_counts, *pool)
        for buffer in (self.buffer, *written, *vars(self.snaps[layer]).values()):
            buffer.fill_(POISON)
        self.layer_step(layer, fwd)

    def layer_step(self, layer: int, fwd) -> None:
        """The unit ``tools/indexer_steps.py --time`` times."""
        index(self, layer, fwd)
        self.groups[layer].set_logical_topk_ready(0)
        if self.record:
            self.snaps[layer].flags[0] = (self.buffer == POISON).all()
        if self.between is not None:
            self.between(layer)
        consume(self, layer)

    def convert(self, layer: int, logical, mla):
        """As the backend path's ``forward_mqa`` converts: (rows, counts or None)."""
        o, group, rows = self.options, self.groups[layer], logical.shape[0]
        if "consume" in o:
            return o["consume"](self, layer, logical, mla)
        path = self.sim.backend.convert
        impl = self.attentions[layer].mla_attn.mla_attn.impl
        through = path == "group" or (
            path == "group_no_counts"
            and mla.num_decode_tokens == mla.num_actual_tokens == rows
        )
        # Patch 0005: FlashInfer SM90's decode-only steps through the group.
        if path == "compute" and impl.convert_decode_through_index_group:
            through = mla.num_decode_tokens >= rows
        counts = o.get("counts", path != "group_no_counts")
        stride = o.get("block_stride_rows", self.sim.geo.mla_block_rows)
        if through:
            args = (o.get("layer_index", 0), logical, mla)
            sizes = dict(block_stride_rows=stride, return_valid_counts=counts)
            out = group.convert_logical_to_physical_topk(*args, **sizes)
        else:
            req_ids, table = mla.req_id_per_token[:rows], mla.block_table
            out = stock_convert(req_ids, table, logical, mla.block_size, stride, counts)
        return out if counts else (out, None)


@breakable.eager_break_during_capture
def index(model: Model, layer: int, fwd) -> None:
    """The layer's indexer call, the compute stream held back first: a
    conversion that does not wait for the indexer's rows reads the poison."""
    geo, x, rows, sim = model.sim.geo, model.inputs[layer], fwd.rows, model.sim
    k_prefix, tail_prefix, _ = geo.prefixes[layer]
    if model.hold and not torch.cuda.is_current_stream_capturing():
        torch.cuda._sleep(model.hold)
    positions = None if fwd.positions is None else fwd.positions[:rows]
    # ``sparse_attn_indexer_kpool``'s arguments, in its order.
    inputs = (model.hidden[:rows], k_prefix, model.kv[layer], x.q[:rows], None)
    inputs += (x.k[:rows, :D], x.w[:rows], 128, geo.scale_fmt, geo.topk, D)
    inputs += (geo.max_pool_len, geo.max_reqs * geo.max_pool_len, model.buffer)
    inputs += (False, False, x.gate[:rows], sim.ape[layer], POOL, positions)
    inputs += (model.tail[layer], tail_prefix, "torch", 0, 1, 1)
    model.module.sparse_attn_indexer_kpool(*inputs)


@breakable.eager_break_during_capture
def consume(model: Model, layer: int) -> None:
    """The MLA attention's conversion of the layer's top-k, what it read and
    got kept. An eager break: at piecewise replay it runs in the step's own
    forward context."""
    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, dict):
        return  # a capture's profiling forward
    mla, group = metadata[model.sim.geo.prefixes[layer][2]], model.groups[layer]
    if model.hold and not torch.cuda.is_current_stream_capturing():
        # The side stream late: a consumer that does not wait for its
        # physical rows reads the poison.
        with group.side_stream:
            torch.cuda._sleep(model.hold)
    rows = mla.num_actual_tokens
    physical, counts = model.convert(layer, model.buffer[:rows], mla)
    if model.record:
        snap = model.snaps[layer]
        snap.logical.copy_(model.buffer)
        snap.physical[: len(physical)].copy_(physical)
        if counts is not None:
            snap.counts[: len(counts)].copy_(counts)
        snap.flags[1].fill_(rows)  # device values: a FULL replay sets its capture's


def context(fwd, mode=CUDAGraphMode.NONE, metadata="step", dummy_run=False):
    return ForwardContext(
        no_compile_layers={},
        slot_mapping={},
        cudagraph_runtime_mode=mode,
        attn_metadata=fwd.metadata if metadata == "step" else metadata,
        batch_descriptor=BatchDescriptor(num_tokens=fwd.rows),
        dummy_run=dummy_run,
    )


def build_stage(
    model: Model, registry, *, max_rows=None, select=False, scores=False, warm=True
):
    """``model``'s stage as ``install()`` builds it (self-check off), added to
    ``registry`` by its top-k buffer; ``warm``: its warmup keys compiled."""
    geo = model.sim.geo
    options = dict(mx_scales=model.sim.backend.mx, next_n=geo.spec + 1, scores=scores)
    options |= dict(select=select is not False, select_one_wave=select == "one_wave")
    rows = geo.capacity if max_rows is None else max_rows
    stage = stage_module.KpoolStage(
        model.attentions, rows, model.buffer.device, self_check="off", **options
    )
    registry.add(stage, model.buffer)
    model.stage, model.kpool = stage, registry
    if warm:
        for kernel, keys in [(k, k.get_warmup_keys()) for k in stage.kernels]:
            if keys:
                kernel.compile_many(keys)
        assert stage.executors, "the stage's warmup compiled nothing"


def differences(stock: Model, stage: Model, layer: int, tokens: int, sets=False):
    """Device flags (no sync), per ``FIELDS``: whether ``stage`` left other
    bytes than ``stock``; then whether it deferred, and whether no consumer
    read its logical rows (fused). A deferring stage leaves the logical
    buffer as it was but for rows a conversion materialized; the group's
    buffers past the rows converted, and the pool buffer past the step's
    pool ids, stay as they were. ``sets``: top-k rows compare as sets."""
    a, b = stock.snaps[layer], stage.snaps[layer]
    pool = stage.stage.pool_buffer.view(-1) if stage.stage else b.flags[:0]
    deferred = b.flags[0] == 1
    fused = deferred & (b.logical == POISON).all()
    row = torch.arange(len(a.logical), device=a.logical.device)[:, None]
    want = torch.where(deferred & ((row >= tokens) | fused), POISON, a.logical)

    def differ(x, y, rows=False):
        if rows and sets:
            x, y = torch.sort(x, 1).values, torch.sort(y, 1).values
        return (x.view(torch.uint8) != y.view(torch.uint8)).any()

    def strays(name: str):  # bytes of either group's buffer past its rows
        found = []
        for model, snap in ((stock, a), (stage, b)):
            buffer = getattr(model.groups[layer], name)
            rows = torch.arange(len(buffer), device=buffer.device)
            past = (rows >= snap.flags[1]).view(-1, *[1] * (buffer.dim() - 1))
            found.append((past & (buffer != POISON)).any())
        return found[0] | found[1]

    return [
        differ(stock.kv[layer], stage.kv[layer]),
        differ(stock.tail[layer], stage.tail[layer]),
        differ(want, b.logical, rows=True),
        differ(a.physical, b.physical, True) | strays("physical_topk_indices"),
        differ(a.counts, b.counts) | strays("valid_topk_counts"),
        (pool[tokens * (stage.sim.geo.topk // POOL) :] != POISON).any(),
        deferred,
        fused,
    ]


def flags(stock: Model, where, tokens: int, sets=False) -> list[list[int]]:
    """``differences`` of each ``(stage model, layer)`` of ``where``, one sync."""
    found = [torch.stack(differences(stock, s, i, tokens, sets)) for s, i in where]
    return torch.stack(found).tolist()


def mismatches(stock: Model, stage: Model, tokens: int, sets=False) -> list[str]:
    where = [(stage, i) for i in range(stage.sim.geo.layers)]
    found = enumerate(flags(stock, where, tokens, sets))
    return [
        f"layer {i} {name}"
        for i, values in found
        for name, differs in zip(FIELDS, values, strict=False)
        if differs
    ]


def assert_same(stock: Model, stage: Model, fwd, sets=False) -> None:
    assert not mismatches(stock, stage, fwd.tokens, sets)


MODES = ("eager", "full", "piecewise")
STAND_INS = (
    "metadata: vLLM's builders (by hand in the kernel-only shim); "
    "DeepGEMM's paged and ragged MQA logits, the prefill top-k, the K gather and "
    "the workspace: torch references (indexer_sim), both sides; the decode top-k: "
    "vLLM's torch reference on the CPU, a stable sort (ties to the lower pool) on "
    "CUDA and in the kernel-only shim, contract_topk's set with the select"
)
REPORTS: list[str] = []  # every run's summary line, for the session's summary
# A few interpreted CPU steps: a 128-token top-k (32 pools, the fewest the
# fused remap takes); prompts past it, mostly found in the cache.
CPU_GEOMETRY = Geometry(
    layers=2, heads=4, topk=128, max_model_len=512, max_reqs=4, max_tokens=256
)
CPU_WORK = Workload(decode_steps=5, prompt=(120, 220), output=(4, 40), arrival=0.6)
CPU_WORK = replace(CPU_WORK, nonuniform=0.5, phase=1, cached=(100, 200))
# The opt-in scores' runs: GLM-5-Next's 16 heads as vLLM pads them to 32 for
# DeepGEMM (the stage scores the 16), pages of 64 pools (256-token blocks;
# DeepGEMM takes 32 or 64), MLA blocks laid further apart than their rows.
SCORES_GEOMETRY = Geometry(heads=32, index_heads=16, block=256, mla_block_rows=320)
CPU_SCORES_GEOMETRY = replace(
    CPU_GEOMETRY, heads=32, index_heads=16, block=128, mla_block_rows=160
)


def scores_reach(cfg) -> bool:
    geo = cfg.geo
    heads = scores_launch.served_heads(geo.index_heads or geo.heads)
    fits = heads is not None and heads <= geo.heads and geo.page in scores_launch.BLOCKS
    return fits and not BACKENDS[cfg.backend].mx


def fuzz_seed() -> int:
    """``KPOOL_SEED`` to replay a run, else a fresh seed every run."""
    return int(os.environ.get("KPOOL_SEED") or secrets.randbits(31))


@dataclass
class Config:
    backend: str = "sm100"  # indexer_batches.BACKENDS
    mode: str = "eager"  # MODES
    geo: Geometry = field(default_factory=Geometry)
    work: Workload = field(default_factory=Workload)
    seed: int = 0
    stages: int = 1  # 2: two engines' stages, their layers interleaved
    # False (CPU): graph modes run each step eagerly in their forward context.
    capture: bool = True
    hold_cycles: int = 0  # CUDA: each stream held back at each hand-off
    select: bool = False  # opt-in; stock's top-k: contract_topk's, rows as sets
    scores: bool = False  # opt-in (SM90, SCORES_GEOMETRY); stock's on CUDA: DeepGEMM
    full_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32)  # requests
    piecewise_sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
    max_reported: int = 20

    @property
    def name(self) -> str:
        stages, select = "/2 stages" * (self.stages == 2), "/select" * self.select
        opted = select + "/scores" * self.scores
        return f"{self.backend}/{self.mode}/tail-{self.work.tail_split}{stages}{opted}"


@dataclass
class Report:
    name: str
    seed: int
    layers: int
    steps: Counter = field(default_factory=Counter)
    compared: int = 0  # buffers compared
    deferred: int = 0  # layer-steps whose indexer left the logical buffer as it was
    fused: int = 0  # ... and no consumer read it (the fused remap took them)
    planned: int = 0  # steps the stage planned
    mismatches: int = 0
    details: list[str] = field(default_factory=list)
    max_context: int = 0
    requests: int = 0
    why_not_fused: list = field(default_factory=list)
    launches: Counter = field(default_factory=Counter)  # per kernel

    def line(self) -> str:
        s = self.steps
        return (
            f"indexer steps {self.name}: {s['total']} steps ({s['decode_steps']} "
            f"with decodes: {s['decode']} decode-only, {s['mixed']} mixed; "
            f"{s['prefill']} prefill-only), {self.layers} layers, {self.requests} "
            f"requests, contexts up to {self.max_context}, {s['full_replay']} FULL "
            f"and {s['piecewise_replay']} piecewise replays, {self.planned} planned, "
            f"{self.deferred} deferred and {self.fused} fused layer-steps, kernel "
            f"launches {dict(sorted(self.launches.items()))}, {self.compared} "
            f"buffers compared, seed {self.seed}, {self.mismatches} mismatches"
        )

    def as_dict(self) -> dict:
        return vars(self) | dict(
            steps=dict(self.steps), launches=dict(self.launches), summary=self.line()
        )


class Run:
    """One configuration's models fed the same steps, compared after each:
    ``stock`` and one or two stages. With two, one leads each step and, per
    layer, between its indexer and conversion the other's layer step runs and
    its pool buffer is poisoned: a stage that read the other's buffer (or
    hand-off) differs from stock."""

    def __init__(self, cfg: Config, device, patch):
        if cfg.stages not in (1, 2) or (cfg.stages == 2 and cfg.mode != "eager"):
            raise ValueError(f"stages {cfg.stages} in mode {cfg.mode}: 1, or 2 eager")
        if cfg.scores and not scores_reach(cfg):
            raise ValueError(
                f"scores on {cfg.backend} with {cfg.geo.index_heads or cfg.geo.heads} "
                f"heads in {cfg.geo.heads} and pages of "
                f"{cfg.geo.page} pools: the kernel takes FP32 scales (SM90 paths), "
                f"heads in {scores_launch.HEADS}, pages in {scores_launch.BLOCKS}"
            )
        self.cfg, self.patch, self.device = cfg, patch, torch.device(device)
        cuda = self.device.type == "cuda"
        # CUDA, opted-in scores: stock's are DeepGEMM's (``deep_gemm_logits``).
        backend, work, scored = BACKENDS[cfg.backend], cfg.work, cuda and cfg.scores
        self.sim = Sim(cfg.geo, backend, device, cfg.seed, work=work, deep_gemm=scored)
        names = ("stock", "stage", "stage 2")[: 1 + cfg.stages]
        self.sides = [Model(self.sim, name) for name in names]
        for side in self.sides:
            side.hold = cfg.hold_cycles if cuda else 0
        self.spies = Spies(patch, self.sim.timeline, compute=not cuda)
        self.registry = install.StageRegistry()  # the stages' SPECIALIZED_KPOOL
        self.graphs, self.hosts, self.stats = {}, {}, Counter()
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        self.stream = torch.cuda.Stream(self.device) if cuda else None

    def setup(self, stack: contextlib.ExitStack, watch: bool = True) -> None:
        """The stand-ins, the run's stream, each stage (``watch``: spied)."""
        mx_scales(self.patch, self.sim.backend.mx)
        topk = contract_decode_topk if self.cfg.select else None
        # CUDA: a deterministic top-k; the kernel-only shim has no vLLM one.
        cuda = self.stream is not None
        if not topk and (cuda or hasattr(sys.modules["vllm"], "__kernel_env__")):
            topk = stable_decode_topk
        # Stock's scores are DeepGEMM's where ours are compared with its bytes.
        logits = deep_gemm_logits if self.sim.builder.deep_gemm else paged_logits
        references(self.patch, [sparse_indexer], self.device, logits, topk)
        if cuda:  # after the initial state's stream
            self.stream.wait_stream(torch.cuda.current_stream())
            stack.enter_context(torch.cuda.stream(self.stream))
        opted = dict(select=self.cfg.select, scores=self.cfg.scores)
        for side in self.sides[1:]:
            build_stage(side, self.registry, **opted)
            if watch:
                self.spies.watch(side.stage)

    def run(self) -> Report:
        cfg = self.cfg
        report = Report(cfg.name, cfg.seed, cfg.geo.layers, steps=self.stats)
        report.launches = self.spies.launches
        with contextlib.ExitStack() as stack:
            self.setup(stack)
            why = (s.stage.why_not_fused for s in self.sides[1:])
            report.why_not_fused = sum(why, [])
            index = 0
            while self.sim.sched.decode_steps < cfg.work.decode_steps:
                self.step(index, report)
                index += 1
        report.requests = self.sim.sched.rids
        return report

    def how(self, batch) -> tuple[str, int, int]:
        """(mode, hidden rows, padding requests) of ``batch``."""
        cfg, tokens = self.cfg, batch.tokens
        if cfg.mode == "full" and batch.kind == "decode" and batch.uniform:
            q = batch.items[0].q_len
            sizes = [s for s in cfg.full_sizes if s >= len(batch.items)]
            if sizes and sizes[0] * q <= cfg.geo.capacity:
                return "full", sizes[0] * q, sizes[0] - len(batch.items)
        if cfg.mode == "piecewise":
            sizes = [s for s in cfg.piecewise_sizes if s >= tokens]
            if sizes and sizes[0] <= cfg.geo.max_tokens:
                return "piecewise", sizes[0], 0
        return "eager", tokens, 0

    def run_side(self, side: Model, fwd, how: str) -> None:
        key, stage = (side.name, how, fwd.key), side is not self.sides[0]
        mode = CUDAGraphMode["NONE" if how == "eager" else how.upper()]
        if how == "full" and self.hosts.setdefault(key, fwd.host) != fwd.host:
            raise AssertionError(
                f"FULL graph {key} captured with host values {self.hosts[key]}, "
                f"replayed for {fwd.host}: the graph key misses one"
            )
        graph = self.graphs.get(key)
        if how == "eager" or not self.cfg.capture:
            side.run(fwd, mode)
            return
        if graph is None:
            if how == "full":
                side.run(fwd, mode)  # the step itself, which warms up
                graph = torch.cuda.CUDAGraph()
                capture = torch.cuda.graph(graph, pool=self.pool, stream=self.stream)
            else:  # as vLLM captures: a profiling forward, whose breaks write nothing
                graph = capture = breakable.BreakableCUDAGraphCapture(pool=self.pool)
            self.graphs[key] = graph
            forward = context(fwd, mode, "step" if how == "full" else None)
            with side.active(), override_forward_context(forward), capture:
                side.forward(fwd)
            self.stats[f"{how}_capture"] += stage
            if how == "full":
                return
        if how == "full":
            graph.replay()
        else:
            with side.active(), override_forward_context(context(fwd, mode)):
                graph.replay()
        self.stats[f"{how}_replay"] += stage

    def interleave(self, other: Model, fwd, layer: int) -> None:
        with other.active(), override_forward_context(context(fwd)):
            other.forward_layer(fwd, layer)
        other.stage.pool_buffer.fill_(POISON)

    def step(self, index: int, report: Report) -> None:
        cfg, sim, s = self.cfg, self.sim, self.stats
        batch = sim.sched.schedule()
        how, rows, pad = self.how(batch)
        options = dict(full=how == "full", pad_reqs=pad, tail_split=cfg.work.tail_split)
        fwd = sim.builder.build(batch, rows=rows, **options)
        sim.fill(rows)
        sim.timeline.clear()
        decodes = int(batch.num_decodes > 0)
        s.update({"total": 1, batch.kind: 1, "decode_steps": decodes, f"mode {how}": 1})
        s.update({f"layout {fwd.layout}": 1, f"next_n {batch.next_n}": decodes})
        ends = (i.start + i.q_len for i in batch.items)
        report.max_context = max(report.max_context, *ends)
        with override_forward_context(context(fwd)):
            report.planned += self.sides[1].stage.planned()
        sides = self.sides
        if cfg.stages == 2:  # each step the other stage leads
            lead, other = sides[1 + index % 2], sides[2 - index % 2]
            lead.between = lambda layer: self.interleave(other, fwd, layer)
            sides = [sides[0], lead]
        for side in sides:
            self.run_side(side, fwd, how)
        if cfg.stages == 2:
            lead.between = None
            other.forwards += 1
        self.compare(fwd, index, report)
        sim.sched.commit(batch)

    def compare(self, fwd, index: int, report: Report) -> None:
        where = [(s, i) for s in self.sides[1:] for i in range(self.cfg.geo.layers)]
        found = flags(self.sides[0], where, fwd.tokens, self.cfg.select)
        for (side, layer), values in zip(where, found, strict=True):
            *diffs, deferred, fused = values
            report.deferred += deferred
            report.fused += fused
            report.compared += len(diffs)
            for name in (name for name, d in zip(FIELDS, diffs, strict=True) if d):
                report.mismatches += 1
                if len(report.details) < self.cfg.max_reported:
                    report.details.append(
                        f"step {index} ({fwd.kind}, {fwd.layout} rows, {fwd.rows} "
                        f"rows) {side.name} layer {layer}: {name} differs"
                    )


@dataclass
class Step:
    """A decode step: ``q_lens[b]`` tokens of request ``b`` after ``ctx[b]``,
    in ``layout`` rows ("native": uniform, "varlen": a row per token
    (SM100), "padded": ``[B, max q_len]`` rows (SM90 non-uniform), "flat"),
    ``pad_rows`` CUDA graph padding rows, a ``prefill`` of that many tokens
    after the decodes; the rest: the layer's ``Geometry`` (``width``: its
    ``buffer_width``, ``stride_rows``: its ``mla_block_rows``)."""

    q_lens: list[int]
    ctx: list[int]
    layout: str = "native"
    pad_rows: int = 0
    prefill: int = 0
    positions: bool = True
    seed: int = 0
    topk: int = 128
    width: int = 0  # 0: vLLM's for topk
    key_stride: int = D
    scale_fmt: str | None = "ue8m0"
    stride_rows: int = 64
    first_layer: int = 0
    block: int = 64  # tokens a cache page
    heads: int = 4  # the indexer op's (``Geometry.heads``)
    index_heads: int = 0  # the model's, zero-padded to ``heads`` (0: all)
    tokens = property(lambda s: sum(s.q_lens) + s.prefill)

    def geometry(self) -> Geometry:
        longest = max(c + q for c, q in zip(self.ctx, self.q_lens, strict=True))
        same = "topk key_stride scale_fmt first_layer block heads index_heads"
        sizes = dict(layers=1, max_model_len=max(512, -(-longest // 64) * 64))
        sizes |= dict(max_reqs=len(self.q_lens) + 2, mla_block_rows=self.stride_rows)
        rows = self.tokens + self.pad_rows + 4
        sizes |= dict(max_tokens=rows, buffer_width=self.width)
        return Geometry(**sizes, **{name: getattr(self, name) for name in same.split()})

    def backend(self, mx: bool) -> Backend:
        other = "flat" if self.layout == "flat" else "padded"
        return Backend("step", mx, self.layout == "varlen", other, "group")


class Bench:
    """One step of one DSA layer (CPU), from the same caches and inputs each
    time: ``run`` on the engine (its stage built, warmed up and spied) or
    another model, ``stock`` on a fresh model of ``stock_module``. ``model``:
    ``build_stage``'s options, the rest the engine ``Model``'s."""

    def __init__(
        self, spies, step, stock_module=None, *, mx=False, registry=None, **model
    ):
        names = ("max_rows", "select", "scores", "warm")
        staged = {name: model.pop(name) for name in names if name in model}
        geo, backend = step.geometry(), step.backend(mx)
        self.sim = Sim(geo, backend, "cpu", step.seed, spies.timeline)
        self.spies, self.stock_module, self.model = spies, stock_module, model
        self.batch = None
        self.use(step)
        self.engine = Model(self.sim, "stage", **model)
        self.registry = install.StageRegistry() if registry is None else registry
        build_stage(self.engine, self.registry, **staged)
        self.stage = self.engine.stage
        spies.watch(self.stage)

    def use(self, step: Step) -> None:
        """``step`` the next step (it fits the first one's geometry)."""
        if self.batch is not None:
            self.sim.sched.release(self.batch)
        self.batch = self.sim.sched.fixed(step.q_lens, step.ctx, step.prefill)
        self.fwd = self.sim.builder.build(self.batch, rows=step.tokens + step.pad_rows)
        self.fwd.positions = self.fwd.positions if step.positions else None
        self.sim.fill(self.fwd.rows)

    def run(self, model=None, *, mode=CUDAGraphMode.NONE, dummy_run=False, **options):
        """``model`` (the engine) run on the step with ``options``; fails on a
        hand-off left pending."""
        model = model or self.engine
        for caches, initial in ((model.kv, self.sim.kv), (model.tail, self.sim.tail)):
            for cache, init in zip(caches, initial, strict=True):
                cache.copy_(init)
        model.options = options
        self.spies.timeline.clear()
        model.run(self.fwd, mode, dummy_run=dummy_run)
        assert all(r.pending is None for r in self.stage.remaps.values())
        return model

    def stock(self, **options) -> Model:
        capacity = self.model.get("capacity")
        model = Model(self.sim, "stock", module=self.stock_module, capacity=capacity)
        return self.run(model, **options)

    @property
    def routes(self) -> list[str]:
        starts = ("kernel:", "stock:", "indexer:", "defer", "materialize")
        return [e for e in self.spies.timeline if e.startswith(starts)]
