# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Torch stand-ins for what GLM-5-Next's kpool indexer calls but cannot load
on the kernel-only GPU machine, with the same input and output contracts:

- ``paged_logits``: DeepGEMM's ``fp8_fp4_paged_mqa_logits`` (decode);
- ``ragged_logits``: DeepGEMM's ``fp8_fp4_mqa_logits`` (prefill chunks);
- ``Topk``: ``get_indexer_topk(backend)`` (decode) and the
  ``torch.ops._C.top_k_per_row_prefill`` op (prefill);
- ``Ops.cp_gather_indexer_k_quant_cache`` (``vllm._custom_ops``), and
  ``Workspace`` (``current_workspace_manager()``).

Deterministic by construction. A logit is ``sum_h w_h relu(q_h . k * s)``:
each 32-wide block of the FP8 dot product is summed exactly in float64 (FP8
products have 8 significant bits; 32 of them fit 53 bits whatever the order),
scaled by its power-of-two (MX) or FP32 scale, the four blocks added in order,
then weighted and summed over heads in float64 and rounded once to the
output dtype (BF16 with MX scales, as on SM100; FP32 otherwise). The top-k
takes the ``k`` largest columns below each row's length, ties broken by the
lower column (a stable descending sort), ``-1`` past the valid ones. The
decode stand-ins are CUDA-graph safe (static shapes, no host syncs).
"""

import contextlib
import importlib.util
from types import SimpleNamespace

import torch

POOL = 4
D = 128
BLOCKS = 4  # MX scale blocks of 32 per 128-wide row
TIE_BREAK = "ties: the lower column first (stable descending sort); -1 past the valid"


def _fp8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t


def _block_scales(scales: torch.Tensor, mx: bool) -> torch.Tensor:
    """``[..., 4]`` uint8 scale bytes (or ``[...]`` int32/fp32) as float64
    per-block factors ``[..., 4]``: UE8M0 exponents with MX, else one FP32."""
    if scales.dtype != torch.uint8:
        scales = scales.contiguous().view(torch.uint8).view(*scales.shape, 4)
    if mx:
        return torch.pow(2.0, scales.double() - 127.0)
    fp32 = scales.contiguous().view(torch.float32).double()
    return fp32.expand(*scales.shape[:-1], BLOCKS)


def _scores(q, q_scales, keys, k_scales, weights) -> torch.Tensor:
    """``[R, L]`` float64 logits of ``q [R, H, D]`` against ``keys [R, L, D]``
    (FP8), with per-block scales ``[R, H, 4]`` and ``[R, L, 4]``."""
    rows, heads = q.shape[:2]
    qb = _fp8(q).float().double().view(rows, heads, BLOCKS, D // BLOCKS)
    kb = _fp8(keys).float().double().view(rows, keys.shape[1], BLOCKS, D // BLOCKS)
    dots = torch.einsum("rhbd,rlbd->rhlb", qb, kb)
    dots = dots * q_scales[:, :, None, :] * k_scales[:, None, :, :]
    per_head = torch.relu(dots[..., 0] + dots[..., 1] + dots[..., 2] + dots[..., 3])
    return (per_head * weights.double()[:, :, None]).sum(dim=1)


def _q_scales(q_scale, shape, device) -> torch.Tensor:
    if q_scale is None:
        return torch.ones(*shape, BLOCKS, dtype=torch.float64, device=device)
    return _block_scales(q_scale.reshape(shape), mx=True)


def paged_logits(q, kv_cache, weights, context_lens, block_tables, schedule, **kw):
    """``fp8_fp4_paged_mqa_logits``: ``q = (values [B, next_n, H, D], q_scale
    or None)``, ``kv_cache [blocks, page, 1, D + 4]`` uint8 (values then
    scales per block), ``context_lens [B, next_n]`` (pools), ``block_tables``
    per request or per row. Returns ``[B * next_n, max_model_len]``; columns
    past a row's length hold zeros."""
    values, q_scale = q
    batch, next_n, heads = values.shape[:3]
    rows, width = batch * next_n, kw["max_model_len"]
    mx = q_scale is not None
    blocks, page = kv_cache.shape[:2]
    flat = kv_cache.reshape(blocks, -1)
    keys = flat[:, : page * D].view(blocks, page, D)
    scales = flat[:, page * D :].view(blocks, page, 4)
    lens = context_lens.reshape(-1)[:rows]
    table = block_tables[
        torch.arange(rows, device=values.device) * block_tables.shape[0] // rows
    ]
    cols = torch.arange(width, device=values.device)
    out = torch.zeros(rows, width, dtype=torch.float64, device=values.device)
    q_rows = values.reshape(rows, heads, D)
    q_scales = _q_scales(q_scale, (rows, heads), values.device)
    chunk = max(1, (1 << 21) // max(width * heads, 1))
    for start in range(0, rows, chunk):
        sl = slice(start, min(rows, start + chunk))
        page_ids = table[sl][:, cols // page].long()
        k = keys[page_ids, cols % page]
        s = _block_scales(scales[page_ids, cols % page], mx)
        out[sl] = _scores(q_rows[sl], q_scales[sl], k, s, weights[sl])
    out = torch.where(cols[None, :] < lens[:, None], out, 0.0)
    return out.to(torch.bfloat16 if mx else torch.float32)


def ragged_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k):
    """``fp8_fp4_mqa_logits``: row ``i`` holds keys ``[ks[i], ke[i])`` of the
    gathered ``kv = (values [N, D], scales [N])`` from column 0; the tail
    holds zeros. Eager only (prefill)."""
    values, q_scale = q
    k_values, k_scales = kv
    rows, heads = values.shape[:2]
    mx = q_scale is not None
    device = values.device
    cols = torch.arange(max_seqlen_k, device=device)
    out = torch.zeros(rows, max_seqlen_k, dtype=torch.float64, device=device)
    q_scales = _q_scales(q_scale, (rows, heads), device)
    chunk = max(1, (1 << 21) // max(max_seqlen_k * heads, 1))
    last = max(k_values.shape[0] - 1, 0)
    for start in range(0, rows, chunk):
        sl = slice(start, min(rows, start + chunk))
        ids = (cu_seqlen_ks[sl, None].long() + cols).clamp(max=last)
        s = _block_scales(k_scales[ids], mx)
        out[sl] = _scores(values[sl], q_scales[sl], k_values[ids], s, weights[sl])
    valid = cols[None, :] < (cu_seqlen_ke - cu_seqlen_ks)[:, None]
    out = torch.where(valid, out, 0.0)
    return out.to(torch.bfloat16 if mx else torch.float32)


def select_topk(logits, starts, ends, k: int) -> torch.Tensor:
    """The ``k`` best columns of each row in ``[starts, ends)`` (int32, -1
    past the valid ones), ties by the lower column."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    valid = (cols[None, :] >= starts[:, None]) & (cols[None, :] < ends[:, None])
    scores = logits.float().masked_fill(~valid, float("-inf"))
    values, ids = torch.sort(scores, dim=1, descending=True, stable=True)
    ids = torch.where(values == float("-inf"), -1, ids)[:, :k].to(torch.int32)
    if ids.shape[1] < k:
        ids = torch.nn.functional.pad(ids, (0, k - ids.shape[1]), value=-1)
    return ids


class Topk:
    """``get_indexer_topk(backend)``: ``(logits, seq_lens, next_n, out, k,
    max_seq_len)``, one row per ``seq_lens`` entry."""

    def __init__(self, backend: str = "auto"):
        self.backend = backend

    def __call__(self, logits, seq_lens, next_n, out, k, max_seq_len):
        ends = seq_lens.reshape(-1)[: logits.shape[0]]
        out.copy_(select_topk(logits, torch.zeros_like(ends), ends, k))


class WheelTopk:
    """``get_indexer_topk(backend)`` as 0.33.0's ``auto`` picks it for
    GLM-5-Next's decode (``cooperative_topk`` up to 64 rows, else
    ``persistent_topk``), from the wheel's ops: ``torch.ops.load_library``
    of its ``_C_stable_libtorch.abi3.so`` first (docs/gpu-tier.md)."""

    def __init__(self, device):
        self.workspace = torch.empty(1 << 20, dtype=torch.uint8, device=device)

    def __call__(self, backend="auto"):
        def topk(logits, seq_lens, next_n, out, k, max_seq_len):
            ops = torch.ops._C
            op = ops.cooperative_topk if logits.shape[0] <= 64 else ops.persistent_topk
            op(logits, seq_lens.reshape(-1), out, self.workspace, k, max_seq_len)

        return topk


class ContractTopk(Topk):
    """``Topk`` by the opt-in select's contract (``select_reference``: stock
    CUDA's order key, so -0.0 below +0.0, ties to the lower pool), for runs
    that compare the select's sets against stock's."""

    def __call__(self, logits, seq_lens, next_n, out, k, max_seq_len):
        from vllm.models.glm5next.nvidia.specialized_decode.self_check import (
            select_reference,
        )

        ends = seq_lens.reshape(-1)[: logits.shape[0]].to(torch.int32)
        out.copy_(select_reference(logits, ends, k))


def _top_k_per_row_prefill(logits, row_starts, row_ends, out, rows, s0, s1, k):
    out[:rows].copy_(select_topk(logits[:rows], row_starts[:rows], row_ends[:rows], k))


_LIBRARY: list = []


def register_prefill_topk() -> bool:
    """Defines ``torch.ops._C.top_k_per_row_prefill`` (the reference) where
    vLLM's compiled ``_C`` is absent (the kernel-only machine, a CPU-only
    install); returns whether the reference serves it."""
    if _LIBRARY:
        return True
    if hasattr(torch.ops._C, "top_k_per_row_prefill"):
        return False
    if importlib.util.find_spec("vllm._C") is not None:
        return False  # the real op loads with vllm._C
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define(
        "top_k_per_row_prefill(Tensor logits, Tensor row_starts, Tensor row_ends, "
        "Tensor(a!) out, int num_rows, int stride0, int stride1, int k) -> ()"
    )
    lib.impl(
        "top_k_per_row_prefill", _top_k_per_row_prefill, "CompositeExplicitAutograd"
    )
    _LIBRARY.append(lib)
    return True


def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu):
    """Each request's first ``cu[b+1] - cu[b]`` pool entries, in order, from
    the paged cache ``[blocks, page, D + 4]`` into ``dst_k [N, D]`` and
    ``dst_scale [N, 4]``. Eager only."""
    blocks, page = kv_cache.shape[:2]
    flat = kv_cache.reshape(blocks, -1)
    keys = flat[:, : page * D].view(blocks, page, D)
    scales = flat[:, page * D :].view(blocks, page, 4)
    lens = (cu[1:] - cu[:-1]).long()
    total = int(cu[-1])
    req = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens)
    pos = torch.arange(total, device=cu.device) - cu[:-1].long()[req]
    ids = block_table[req, pos // page].long()
    dst_k[:total].view(torch.uint8).copy_(keys[ids, pos % page])
    dst_scale[:total].copy_(scales[ids, pos % page])


class Workspace:
    """``current_workspace_manager()``: fresh buffers of the asked shapes."""

    @staticmethod
    def get_simultaneous(*specs):
        device = Workspace.device
        return [
            torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs
        ]

    device = torch.device("cpu")


Ops = SimpleNamespace(cp_gather_indexer_k_quant_cache=cp_gather_indexer_k_quant_cache)


@contextlib.contextmanager
def references(module, device, logits=paged_logits, topk=Topk):
    """Installs the stand-ins in the indexer ``module`` (the patched
    ``nvidia/sparse_indexer``) for the duration; both sides of a comparison
    run through them. ``logits``/``topk`` may be swapped (timing)."""
    register_prefill_topk()
    Workspace.device = torch.device(device)
    names = dict(
        fp8_fp4_paged_mqa_logits=logits,
        fp8_fp4_mqa_logits=ragged_logits,
        get_indexer_topk=topk,
        current_workspace_manager=lambda: Workspace,
        ops=Ops,
    )
    saved = {name: vars(module).get(name, _MISSING) for name in names}
    vars(module).update(names)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                vars(module).pop(name, None)
            else:
                vars(module)[name] = value


_MISSING = object()


class Fixed:
    """Timing stand-ins: ``logits`` returns a precomputed tensor, ``topk``
    copies precomputed ids (both sides alike, CUDA-graph safe)."""

    def __init__(self, logits: torch.Tensor, ids: torch.Tensor):
        self.values, self.ids = logits, ids

    def logits(self, *args, **kwargs):
        return self.values

    def topk(self, backend="auto"):
        def select(logits, seq_lens, next_n, out, k, max_seq_len):
            out.copy_(self.ids[: out.shape[0], : out.shape[1]])

        return select
