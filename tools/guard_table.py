# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kpool kernels' rules as one table, and the README's guard table from it.

For each kernel (``KERNELS``): a builder of valid GLM-5-Next-shaped arguments
(its ``*Args``: ``update_args``, ``expand_args``, ``remap_args``,
``upcast_args``, ``select_args``) and its cases (``CASES``), each the
builder's arguments with some of them changed: a requirement broken
(``refused``: the rule, the kernel's ``key_for``, must raise ``Refused``
naming that argument) or an edge the rule takes (``taken``). Every tensor
argument also gets the cases of the type and device checks: a list, None
where it is no optional field, a tensor on the meta device.

``tests/models/glm5next/specialized_decode/test_rules.py`` runs every case;
this tool prints what the refusals expect, one row per requirement, in the
rule's order, as the README's guard table (the rows of the type and device
checks, which every tensor argument of every kernel gets, once at the top):

    python tools/guard_table.py          # print the table (markdown)

The builders make CPU tensors unless given a device. The rules refuse CPU
tensors as not CUDA: ``rules_on_cpu()`` lets them take CPU tensors while the
table is computed (the tests monkeypatch the same setting).
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BEGIN, END = "<!-- guard-table -->", "<!-- /guard-table -->"
# The rows of the type and device checks, which every tensor argument gets.
EVERY = ("every function", "every tensor argument")
DIM, POOL = 128, 4
# GLM-5-Next's decode top-k: 2048 tokens in 512 pools, rows of 17 stock tiles;
# its MLA KV cache blocks of 64 rows.
GROUPS, WIDTH, BLOCK = 512, 2176, 64
U8, I16, I32, I64 = torch.uint8, torch.int16, torch.int32, torch.int64
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


class T(NamedTuple):
    """A tensor the cases describe: zeros of ``shape`` with ``stride`` (else
    contiguous), ``offset`` elements into a buffer that starts aligned (an
    offset that is not a multiple of 16 bytes misaligns it), on the device
    the arguments are built for unless ``device`` says."""

    shape: tuple
    dtype: torch.dtype
    stride: tuple | None = None
    offset: int = 0
    device: str | None = None

    def make(self, device) -> torch.Tensor:
        stride = self.stride
        if stride is None:
            stride = torch.empty(self.shape, device="meta").stride()
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, stride, strict=True))
        size = self.offset + (span if all(self.shape) else 0) + 16
        buffer = torch.zeros(size, dtype=self.dtype, device=self.device or device)
        return buffer.as_strided(self.shape, stride, self.offset)


def padded(shape, row_stride, dtype, offset=0) -> T:
    """``shape`` with its rows ``row_stride`` elements apart (the last dim
    unit-strided, the others packed)."""
    stride = [1, row_stride]
    for n in reversed(shape[1:-1]):
        stride.append(stride[-1] * n)
    return T(shape, dtype, tuple(reversed(stride)), offset)


def _built(values: dict, device) -> dict:
    return {k: v.make(device) if isinstance(v, T) else v for k, v in values.items()}


# --- The builders: valid GLM-5-Next-shaped arguments ---------------------------

REQUESTS, TOKENS, RING, PAGE, ROWS = 2, 3, POOL, 64, 3


def _update_base() -> dict:
    r, t = REQUESTS, TOKENS
    return dict(
        kv_cache=T((4, PAGE, DIM + 4), U8),
        tail_kv_cache=T((r + 1, 2, RING, DIM), BF16),
        tail_slot_mapping=T((r, t), I64),
        key=T((r, t, DIM), BF16),
        slot_score=T((r, t, DIM), BF16),
        ape=T((POOL, DIM), F32),
        slot_mapping=T((r, t), I64),
        positions=T((r, t), I32),
        pool_size=POOL,
        head_dim=DIM,
        mx_scales=True,
        round_scale=True,
    )


def _expand_base() -> dict:
    return dict(
        pool_ids=T((ROWS, GROUPS), I32),
        seq_lens=T((ROWS,), I64),
        pool_size=POOL,
        seq_offset=1,
        out=T((ROWS, WIDTH), I32),
        int32_lengths=False,
    )


def _remap_base() -> dict:
    return dict(
        pool_ids=T((ROWS, GROUPS), I32),
        positions=T((ROWS,), I64),
        pool_size=POOL,
        req_ids=T((ROWS,), I32),
        block_table=T((ROWS, 64), I32),
        out=T((ROWS, WIDTH), I32),
        counts=T((ROWS,), I32),
        block_size=BLOCK,
        stride_rows=BLOCK,
        seq_offset=1,
        int32_lengths=False,
    )


def _upcast_base() -> dict:
    return dict(logits=T((ROWS, 1024), BF16), row_ends=T((ROWS,), I32), out=None)


def _select_base() -> dict:
    return dict(logits=T((ROWS, 1024), F32), ends=T((ROWS,), I32), k=GROUPS, out=None)


def _args_type(name: str):
    from vllm.models.glm5next.nvidia.specialized_decode import (
        expand_kernel,
        remap_kernel,
        select_kernel,
        upcast_kernel,
        update_kernel,
    )

    return {
        "update": update_kernel.UpdateArgs,
        "expand": expand_kernel.ExpandArgs,
        "remap": remap_kernel.RemapArgs,
        "upcast": upcast_kernel.UpcastArgs,
        "select": select_kernel.SelectArgs,
    }[name]


def build(kernel: str, changes: dict | None = None, device="cpu"):
    """The kernel's ``*Args``: the builder's, with ``changes``."""
    return _args_type(kernel)(
        **_built(KERNELS[kernel].base() | (changes or {}), device)
    )


def update_args(device="cpu", **changes):
    return build("update", changes, device)


def expand_args(device="cpu", **changes):
    return build("expand", changes, device)


def remap_args(device="cpu", **changes):
    return build("remap", changes, device)


def upcast_args(device="cpu", **changes):
    return build("upcast", changes, device)


def select_args(device="cpu", **changes):
    return build("select", changes, device)


# --- The cases -----------------------------------------------------------------


class Case(NamedTuple):
    """``kernel``'s builder arguments with ``changes``: refused naming
    ``argument``, or taken (``argument`` None). ``every``: a case of the type
    and device checks, which every tensor argument gets."""

    kernel: str
    name: str
    changes: dict
    argument: str | None
    every: bool = False

    @property
    def id(self) -> str:
        return f"{self.kernel}-{self.name}"

    def args(self, device="cpu"):
        return build(self.kernel, self.changes, device)


def refused(argument: str, name: str, **changes) -> tuple:
    return name, changes, argument


def taken(name: str, **changes) -> tuple:
    return name, changes, None


def _update_cases():
    r, t, ring = REQUESTS, TOKENS, RING
    half, page_bytes = ring * DIM, PAGE * (DIM + 4)
    yield refused("head_dim", "head_dim-64", head_dim=64)
    yield refused("head_dim", "head_dim-256", head_dim=256)
    yield refused("pool_size", "pool_size-2", pool_size=2)
    yield refused("pool_size", "pool_size-8", pool_size=8)
    kv = "kv_cache"
    yield refused(kv, "kv-dtype", kv_cache=T((4, PAGE, DIM + 4), torch.int8))
    yield refused(kv, "kv-ndim", kv_cache=T((4, PAGE * (DIM + 4)), U8))
    yield refused(
        kv,
        "kv-bytes-stride-2",
        kv_cache=T((4, PAGE, 132), U8, (2 * page_bytes, 264, 2)),
    )
    yield refused(kv, "kv-bytes-stride-0", kv_cache=T((4, PAGE, 132), U8, (PAGE, 1, 0)))
    yield refused(
        kv, "kv-page-stride-2", kv_cache=T((4, PAGE, 132), U8, (page_bytes + 2, 132, 1))
    )
    yield refused(kv, "kv-page-stride-6", kv_cache=T((4, 1, 6), U8, (6, 6, 1)))
    yield refused(kv, "kv-misaligned", kv_cache=T((4, PAGE, 132), U8, None, 2))
    tail = "tail_kv_cache"
    yield refused(tail, "tail-dtype", tail_kv_cache=T((r + 1, 2, ring, DIM), F16))
    yield refused(tail, "tail-ndim", tail_kv_cache=T((r + 1, 2 * ring, DIM), BF16))
    yield refused(tail, "tail-halves-3", tail_kv_cache=T((r + 1, 3, ring, DIM), BF16))
    yield refused(tail, "tail-ring-6", tail_kv_cache=T((r + 1, 2, 6, DIM), BF16))
    yield refused(tail, "tail-ring-5", tail_kv_cache=T((r + 1, 2, 5, DIM), BF16))
    yield refused(tail, "tail-dim-64", tail_kv_cache=T((r + 1, 2, ring, 64), BF16))
    yield refused(
        tail,
        "tail-dim-stride",
        tail_kv_cache=T((r + 1, 2, ring, DIM), BF16, (4 * half, 2 * half, 2 * DIM, 2)),
    )
    yield refused(
        tail,
        "tail-row-stride",
        tail_kv_cache=T(
            (r + 1, 2, ring, DIM), BF16, (2 * ring * 132, ring * 132, 132, 1)
        ),
    )
    yield refused(
        tail,
        "tail-half-stride",
        tail_kv_cache=T((r + 1, 2, ring, DIM), BF16, (2 * half + 4, half + 2, DIM, 1)),
    )
    yield refused(
        tail,
        "tail-block-stride",
        tail_kv_cache=T((r + 1, 2, ring, DIM), BF16, (2 * half + 2, half, DIM, 1)),
    )
    yield refused(
        tail, "tail-misaligned", tail_kv_cache=T((r + 1, 2, ring, DIM), BF16, None, 2)
    )
    yield refused("key", "key-dtype", key=T((r, t, DIM), F16))
    yield refused("key", "key-ndim", key=T((r * t, DIM), BF16))
    yield refused("key", "key-dim-64", key=T((r, t, 64), BF16))
    yield refused(
        "key", "key-dim-stride", key=T((r, t, DIM), BF16, (t * 2 * DIM, 2 * DIM, 2))
    )
    yield refused("key", "key-row-stride", key=padded((r, t, DIM), 130, BF16))
    yield refused(
        "key", "key-request-stride", key=T((r, t, DIM), BF16, (t * DIM + 2, DIM, 1))
    )
    yield refused("key", "key-misaligned", key=T((r, t, DIM), BF16, None, 2))
    score = "slot_score"
    yield refused(score, "score-dtype", slot_score=T((r, t, DIM), F16))
    yield refused(score, "score-shape", slot_score=T((r, t + 1, DIM), BF16))
    yield refused(score, "score-row-stride", slot_score=padded((r, t, DIM), 130, BF16))
    yield refused(score, "score-misaligned", slot_score=T((r, t, DIM), BF16, None, 1))
    yield refused("ape", "ape-dtype", ape=T((POOL, DIM), BF16))
    yield refused("ape", "ape-shape", ape=T((POOL, 64), F32))
    yield refused("ape", "ape-transposed", ape=T((POOL, DIM), F32, (1, POOL)))
    yield refused("ape", "ape-misaligned", ape=T((POOL, DIM), F32, None, 2))
    for name, short in (
        ("tail_slot_mapping", "tail-slots"),
        ("slot_mapping", "slots"),
        ("positions", "positions"),
    ):
        yield refused(name, f"{short}-float", **{name: T((r, t), F32)})
        yield refused(name, f"{short}-int16", **{name: T((r, t), I16)})
        yield refused(name, f"{short}-shape", **{name: T((r + 1, t), I64)})
        yield refused(name, f"{short}-strided", **{name: T((r, t), I32, (2 * t, 2))})
    yield taken("base")
    yield taken("positions-int64", positions=T((r, t), I64))
    yield taken(
        "slots-int32", slot_mapping=T((r, t), I32), tail_slot_mapping=T((r, t), I32)
    )
    yield taken("fp32-scales", mx_scales=False, round_scale=False)
    yield taken("ring-8", tail_kv_cache=T((r + 1, 2, 8, DIM), BF16))
    yield taken("ring-12", tail_kv_cache=T((r + 1, 2, 12, DIM), BF16))
    yield taken(
        "kv-pages-padded", kv_cache=T((4, PAGE, 132), U8, (page_bytes + 8, 132, 1), 4)
    )
    yield taken(
        "tail-padded",
        tail_kv_cache=T(
            (r + 1, 2, ring, DIM), BF16, (2 * half + 8, half + 4, DIM, 1), 4
        ),
    )
    yield taken(
        "key-rows-padded",
        key=padded((r, t, DIM), 140, BF16, 4),
        slot_score=padded((r, t, DIM), 132, BF16),
    )
    yield taken("ape-16-byte-offset", ape=T((POOL, DIM), F32, None, 4))
    empty = dict(
        tail_slot_mapping=T((0, t), I64),
        slot_mapping=T((0, t), I64),
        positions=T((0, t), I32),
    )
    yield taken(
        "no-requests",
        key=T((0, t, DIM), BF16),
        slot_score=T((0, t, DIM), BF16),
        **empty,
    )
    empty = dict(
        tail_slot_mapping=T((r, 0), I64),
        slot_mapping=T((r, 0), I64),
        positions=T((r, 0), I32),
    )
    yield taken(
        "no-tokens", key=T((r, 0, DIM), BF16), slot_score=T((r, 0, DIM), BF16), **empty
    )


def _expand_cases():
    rows, cols = ROWS, GROUPS * POOL + POOL - 1
    yield refused("pool_size", "pool_size-2", pool_size=2)
    yield refused("pool_size", "pool_size-8", pool_size=8)
    yield refused("pool_ids", "ids-int64", pool_ids=T((rows, GROUPS), I64))
    yield refused("pool_ids", "ids-ndim", pool_ids=T((rows * GROUPS,), I32))
    yield refused(
        "pool_ids",
        "ids-column-stride-2",
        pool_ids=T((rows, GROUPS), I32, (2 * GROUPS, 2)),
    )
    yield refused(
        "pool_ids", "ids-column-stride-0", pool_ids=T((rows, GROUPS), I32, (1, 0))
    )
    yield refused("out", "out-none", out=None)
    yield refused("out", "out-int64", out=T((rows, WIDTH), I64))
    yield refused("out", "out-ndim", out=T((rows * WIDTH,), I32))
    yield refused("out", "out-more-rows", out=T((rows + 1, WIDTH), I32))
    yield refused("out", "out-fewer-rows", out=T((rows - 1, WIDTH), I32))
    yield refused("out", "out-narrow", out=padded((rows, cols - 1), WIDTH, I32))
    yield refused("out", "out-column-stride", out=T((rows, cols), I32, (2 * WIDTH, 2)))
    yield refused("out", "out-row-stride", out=padded((rows, cols), WIDTH + 2, I32))
    yield refused("out", "out-misaligned", out=T((rows, WIDTH), I32, None, 2))
    yield refused("seq_lens", "lens-int16", seq_lens=T((rows,), I16))
    yield refused("seq_lens", "lens-float", seq_lens=T((rows,), F32))
    yield refused("seq_lens", "lens-ndim", seq_lens=T((rows, 1), I64))
    yield refused("seq_lens", "lens-short", seq_lens=T((rows - 1,), I64))
    yield refused("seq_lens", "lens-strided", seq_lens=T((rows,), I64, (2,)))
    yield refused("seq_lens", "lens-stride-0", seq_lens=T((rows,), I64, (0,)))
    yield refused("seq_offset", "offset-2^31", seq_offset=2**31)
    yield refused("seq_offset", "offset-below-int32", seq_offset=-(2**31) - 1)
    yield refused("seq_offset", "offset-float", seq_offset=1.0)
    yield taken("base")
    yield taken("int32-lengths", int32_lengths=True)
    yield taken("lens-int32", seq_lens=T((rows,), I32))
    yield taken("lens-longer", seq_lens=T((rows + 5,), I64))
    yield taken("offset-int32-max", seq_offset=2**31 - 1)
    yield taken("offset-int32-min", seq_offset=-(2**31))
    yield taken("out-exact-width", out=padded((rows, cols), WIDTH, I32))
    yield taken("out-rows-padded", out=padded((rows, cols), cols + 1, I32, 4))
    yield taken("ids-rows-padded", pool_ids=padded((rows, GROUPS), GROUPS + 1, I32, 1))
    yield taken("no-pools", pool_ids=T((rows, 0), I32), out=T((rows, 4), I32))
    yield taken("no-rows", pool_ids=T((0, GROUPS), I32), out=T((0, WIDTH), I32))


def _remap_cases():
    rows = ROWS
    ids = "pool_ids"
    yield refused(ids, "ids-int64", pool_ids=T((rows, GROUPS), I64))
    yield refused(ids, "ids-ndim", pool_ids=T((rows * GROUPS,), I32))
    yield refused(ids, "ids-3d", pool_ids=T((rows, GROUPS, 1), I32))
    yield refused(
        ids, "ids-column-stride-2", pool_ids=T((rows, GROUPS), I32, (2 * GROUPS, 2))
    )
    yield refused(ids, "ids-column-stride-0", pool_ids=T((rows, GROUPS), I32, (1, 0)))
    yield refused("req_ids", "req-int64", req_ids=T((rows,), I64))
    yield refused("req_ids", "req-0d", req_ids=T((), I32))
    yield refused("req_ids", "req-ndim", req_ids=T((rows, 1), I32))
    yield refused("req_ids", "req-strided", req_ids=T((rows,), I32, (2,)))
    yield refused("req_ids", "req-stride-0", req_ids=T((rows,), I32, (0,)))
    yield refused("out", "out-int64", out=T((rows, WIDTH), I64))
    yield refused("out", "out-ndim", out=T((rows * WIDTH,), I32))
    yield refused("out", "out-3d", out=T((rows, WIDTH, 1), I32))
    yield refused("out", "out-1d-rows", out=T((rows,), I32))
    yield refused("out", "out-more-rows", out=T((rows + 1, WIDTH), I32))
    yield refused("out", "out-fewer-rows", out=T((rows - 1, WIDTH), I32))
    yield refused("out", "out-rows-padded", out=padded((rows, WIDTH), WIDTH + 4, I32))
    yield refused("out", "out-misaligned", out=T((rows, WIDTH), I32, None, 2))
    yield refused("pool_size", "pool_size-8", pool_size=8)
    yield refused("pool_size", "pool_size-2", pool_size=2)
    for pools in (0, 16, 31, 48, 1056):
        yield refused(
            ids,
            f"pools-{pools}",
            pool_ids=T((rows, pools), I32),
            out=T((rows, 4352), I32),
            counts=None,
        )
    yield refused("out", "width-below-pools", out=T((rows, 2048), I32))
    yield refused("out", "width-2100", out=T((rows, 2100), I32))
    yield refused("out", "width-2178", out=T((rows, 2178), I32))
    # Wider rows with counts compact through racing atomics in stock.
    yield refused(
        "out",
        "width-4224-counts",
        pool_ids=T((rows, 1024), I32),
        out=T((rows, 4224), I32),
    )
    yield refused(
        "out",
        "width-6144-counts",
        pool_ids=T((rows, 1024), I32),
        out=T((rows, 6144), I32),
    )
    bs = "block_size"
    yield refused(bs, "block-size-0", block_size=0)
    yield refused(bs, "block-size-negative", block_size=-4)
    yield refused(bs, "block-size-2", block_size=2)
    yield refused(bs, "block-size-6", block_size=6)
    yield refused(bs, "block-size-float", block_size=64.0)
    yield refused(bs, "block-size-2^31", block_size=2**31)
    yield refused(bs, "block-size-2^40", block_size=2**40)
    yield refused("stride_rows", "stride-rows-2^31", stride_rows=2**31)
    yield refused("stride_rows", "stride-rows-below-int32", stride_rows=-(2**31) - 1)
    yield refused("stride_rows", "stride-rows-float", stride_rows=64.0)
    yield refused("counts", "counts-int64", counts=T((rows,), I64))
    yield refused("counts", "counts-0d", counts=T((), I32))
    yield refused("counts", "counts-ndim", counts=T((rows, 1), I32))
    yield refused("counts", "counts-short", counts=T((rows - 1,), I32))
    yield refused("counts", "counts-strided", counts=T((rows,), I32, (2,)))
    yield refused("counts", "counts-stride-0", counts=T((rows,), I32, (0,)))
    table = "block_table"
    yield refused(table, "table-int64", block_table=T((rows, 64), I64))
    yield refused(table, "table-ndim", block_table=T((rows * 64,), I32))
    yield refused(table, "table-3d", block_table=T((rows, 64, 1), I32))
    yield refused(
        table, "table-column-stride-2", block_table=T((rows, 64), I32, (128, 2))
    )
    yield refused(
        table, "table-column-stride-0", block_table=T((rows, 64), I32, (1, 0))
    )
    yield refused(ids, "ids-more-rows", pool_ids=T((rows + 1, GROUPS), I32))
    yield refused(
        ids,
        "ids-more-rows-positions",
        pool_ids=T((rows + 1, GROUPS), I32),
        positions=T((rows + 1,), I64),
    )
    pos = "positions"
    yield refused(pos, "positions-float", positions=T((rows,), F32))
    yield refused(pos, "positions-int16", positions=T((rows,), I16))
    yield refused(pos, "positions-0d", positions=T((), I64))
    yield refused(pos, "positions-ndim", positions=T((rows, 1), I64))
    yield refused(pos, "positions-short", positions=T((rows - 1,), I64))
    yield refused(pos, "positions-strided", positions=T((rows,), I64, (2,)))
    yield refused(pos, "positions-stride-0", positions=T((rows,), I64, (0,)))
    yield refused("seq_offset", "offset-2^31", seq_offset=2**31)
    yield refused("seq_offset", "offset-below-int32", seq_offset=-(2**31) - 1)
    yield taken("base")
    yield taken("int32-lengths", int32_lengths=True)
    yield taken("no-counts", counts=None)
    yield taken("counts-longer", counts=T((rows + 2,), I32))
    yield taken("positions-int32", positions=T((rows,), I32))
    yield taken("positions-longer", positions=T((rows + 2,), I64))
    yield taken("graph-padding-rows", pool_ids=T((rows - 1, GROUPS), I32))
    yield taken("ids-rows-padded", pool_ids=padded((rows, GROUPS), GROUPS + 3, I32, 1))
    yield taken("table-rows-padded", block_table=padded((rows, 64), 67, I32, 1))
    yield taken("pools-32", pool_ids=T((rows, 32), I32), out=T((rows, 256), I32))
    yield taken(
        "pools-992-width-4096", pool_ids=T((rows, 992), I32), out=T((rows, 4096), I32)
    )
    yield taken(
        "pools-1024-width-4224-no-counts",
        pool_ids=T((rows, 1024), I32),
        out=T((rows, 4224), I32),
        counts=None,
    )
    yield taken(
        "pools-1024-width-8192", pool_ids=T((rows, 1024), I32), out=T((rows, 8192), I32)
    )
    yield taken("block-size-4", block_size=4)
    yield taken("block-size-12", block_size=12, stride_rows=12)
    yield taken("block-size-int32-max", block_size=2**31 - 4)
    yield taken("stride-rows-int32-max", stride_rows=2**31 - 1)
    yield taken("stride-rows-int32-min", stride_rows=-(2**31))
    yield taken("offset-int32-max", seq_offset=2**31 - 1)
    yield taken("offset-int32-min", seq_offset=-(2**31))
    yield taken(
        "no-rows",
        pool_ids=T((0, GROUPS), I32),
        req_ids=T((0,), I32),
        out=T((0, WIDTH), I32),
    )


def _upcast_cases():
    rows = ROWS
    yield refused("logits", "logits-fp32", logits=T((rows, 1024), F32))
    yield refused("logits", "logits-ndim", logits=T((rows * 1024,), BF16))
    yield refused(
        "logits", "logits-column-stride-2", logits=T((rows, 1000), BF16, (2008, 2))
    )
    yield refused(
        "logits", "logits-column-stride-0", logits=T((rows, 1000), BF16, (1, 0))
    )
    yield refused(
        "logits", "logits-row-stride-1004", logits=padded((rows, 1000), 1004, BF16)
    )
    yield refused("logits", "logits-row-stride-12", logits=padded((rows, 12), 12, BF16))
    yield refused("logits", "logits-misaligned", logits=T((rows, 1024), BF16, None, 4))
    ends = "row_ends"
    yield refused(ends, "ends-int64", row_ends=T((rows,), I64))
    yield refused(ends, "ends-ndim", row_ends=T((rows, 1), I32))
    yield refused(ends, "ends-0d", row_ends=T((), I32))
    yield refused(ends, "ends-more-rows", row_ends=T((rows + 1,), I32))
    yield refused(ends, "ends-strided", row_ends=T((rows,), I32, (2,)))
    yield refused(ends, "ends-stride-0", row_ends=T((rows,), I32, (0,)))
    yield refused("out", "out-bf16", out=T((rows, 1024), BF16))
    yield refused("out", "out-shape", out=padded((rows, 1000), 1024, F32))
    yield refused("out", "out-strides", out=padded((rows, 1024), 1032, F32))
    yield refused("out", "out-misaligned", out=T((rows, 1024), F32, None, 2))
    yield taken("base")
    yield taken("out", out=T((rows, 1024), F32))
    yield taken(
        "rows-padded",
        logits=padded((rows, 1000), 1008, BF16, 8),
        out=padded((rows, 1000), 1008, F32, 4),
    )
    yield taken("row-stride-1000", logits=T((rows, 1000), BF16))
    yield taken("width-1001", logits=padded((rows, 1001), 1008, BF16))
    yield taken("no-rows", logits=T((0, 1024), BF16), row_ends=T((0,), I32))


def _select_cases():
    rows, k = ROWS, GROUPS
    widest = 16 * 53248
    yield refused("k", "k-0", k=0)
    yield refused("k", "k-4097", k=4097)
    yield refused("k", "k-bool", k=True)
    yield refused("logits", "logits-fp16", logits=T((rows, 1024), F16))
    yield refused("logits", "logits-ndim", logits=T((rows * 1024,), F32))
    yield refused(
        "logits", "logits-column-stride-2", logits=T((rows, 1000), F32, (2008, 2))
    )
    yield refused(
        "logits", "logits-row-stride-1002", logits=padded((rows, 1000), 1002, F32)
    )
    yield refused("logits", "logits-misaligned", logits=T((rows, 1024), F32, None, 2))
    yield refused(
        "logits", "logits-too-wide", logits=T((rows, widest + 4), F32, (0, 1))
    )
    yield refused("ends", "ends-int64", ends=T((rows,), I64))
    yield refused("ends", "ends-ndim", ends=T((rows, 1), I32))
    yield refused("ends", "ends-fewer-rows", ends=T((rows - 1,), I32))
    yield refused("ends", "ends-strided", ends=T((rows,), I32, (2,)))
    yield refused("out", "out-int64", out=T((rows, k), I64))
    yield refused("out", "out-k-1", out=T((rows, k - 1), I32))
    yield refused("out", "out-rows", out=T((rows + 1, k), I32))
    yield refused("out", "out-column-stride-2", out=T((rows, k), I32, (2 * k, 2)))
    yield taken("base")
    yield taken("bf16", logits=T((rows, 1024), BF16))
    yield taken("out", out=padded((rows, k), k + 64, I32))
    yield taken("rows-padded", logits=padded((rows, 1000), 1008, F32))
    yield taken("widest", logits=T((rows, widest), F32, (0, 1)))
    yield taken("more-ends", ends=T((rows + 5,), I32))
    yield taken("no-rows", logits=T((0, 1024), F32), ends=T((0,), I32))


class Kernel(NamedTuple):
    """A kernel's row in the table: its public function and the stage's
    stock-or-kernel path (``entry``), its builder, its tensor arguments (and
    which may be None), the arguments no requirement reads, its cases."""

    name: str
    entry: str
    base: Any
    tensors: tuple[str, ...]
    optional: tuple[str, ...]
    unchecked: tuple[str, ...]
    cases: Any


KERNELS = {
    k.name: k
    for k in (
        Kernel(
            "update",
            "`kpool_update`, `KpoolStage.update`",
            _update_base,
            tuple(_update_base())[:8],
            (),
            ("mx_scales", "round_scale"),
            _update_cases,
        ),
        Kernel(
            "expand",
            "`expand_pools`, `KpoolStage.expand`",
            _expand_base,
            ("pool_ids", "seq_lens", "out"),
            ("out",),
            ("int32_lengths",),
            _expand_cases,
        ),
        Kernel(
            "remap",
            "`expand_and_remap`, `FusedRemap`",
            _remap_base,
            ("pool_ids", "positions", "req_ids", "block_table", "out", "counts"),
            ("counts",),
            ("int32_lengths",),
            _remap_cases,
        ),
        Kernel(
            "upcast",
            "`upcast_logits`, `KpoolStage.upcast`",
            _upcast_base,
            ("logits", "row_ends", "out"),
            ("out",),
            (),
            _upcast_cases,
        ),
        Kernel(
            "select",
            "`select_topk`, `KpoolStage` (opt-in select)",
            _select_base,
            ("logits", "ends", "out"),
            ("out",),
            (),
            _select_cases,
        ),
    )
}


def _type_and_device_cases(kernel: Kernel):
    base = kernel.base()
    for name in kernel.tensors:
        like = base[name] if isinstance(base[name], T) else T((ROWS, 1024), F32)
        yield Case(kernel.name, f"{name}-list", {name: [0, 0]}, name, True)
        if name not in kernel.optional:
            yield Case(kernel.name, f"{name}-none", {name: None}, name, True)
        on_meta = like._replace(device="meta")
        yield Case(kernel.name, f"{name}-meta", {name: on_meta}, name, True)


def _cases() -> list[Case]:
    cases = []
    for kernel in KERNELS.values():
        cases += _type_and_device_cases(kernel)
        cases += [Case(kernel.name, *case) for case in kernel.cases()]
    ids = [case.id for case in cases]
    assert len(set(ids)) == len(ids), "case names repeat"
    return cases


CASES = _cases()


# --- The table -------------------------------------------------------------------


@contextlib.contextmanager
def rules_on_cpu() -> Iterator[None]:
    """The rules take CPU tensors as they take CUDA ones (their device check
    reads ``constants.KERNEL_DEVICE_TYPES``)."""
    from vllm.models.glm5next.nvidia.specialized_decode import constants

    before = constants.KERNEL_DEVICE_TYPES
    constants.KERNEL_DEVICE_TYPES = before | {"cpu"}
    try:
        yield
    finally:
        constants.KERNEL_DEVICE_TYPES = before


def jit_kernel(name: str):
    """The kernel's ``KpoolJitKernel`` (its rule: ``key_for``)."""
    from vllm.models.glm5next.nvidia.specialized_decode import (
        expand_kernel,
        remap_kernel,
        select_kernel,
        upcast_kernel,
        update_kernel,
    )

    return {
        "update": update_kernel.UPDATE,
        "expand": expand_kernel.EXPAND,
        "remap": remap_kernel.REMAP,
        "upcast": upcast_kernel.UPCAST,
        "select": select_kernel.SELECT,
    }[name]


def refusal(case: Case, device="cpu") -> str | None:
    """What the rule answers for ``case``: the ``Refused`` message, or None
    where it takes the arguments."""
    from vllm.models.glm5next.nvidia.specialized_decode.jit import Refused

    try:
        jit_kernel(case.kernel).key_for(case.args(device))
    except Refused as refusal:
        return str(refusal)
    return None


def expected(message: str) -> str:
    """What a refusal says the kernel takes, without the value the
    requirement came to for the case's shapes (a rule quotes it in
    parentheses after the symbol: ``pools * 4 + 3 (2051)``)."""
    text = message.split(": expected ", 1)[1].rsplit(", got ", 1)[0]
    return re.sub(r" \(\d+\)", "", text)


def rows() -> list[tuple[str, str, str]]:
    """(entry point, argument, the kernel takes) of each requirement, in
    the order of the cases; the type and device checks once, first."""
    table: dict[tuple[str, str, str], None] = {}
    every: dict[tuple[str, str, str], None] = {}
    with rules_on_cpu():
        for case in CASES:
            if case.argument is None:
                continue
            message = refusal(case)
            assert message is not None and message.startswith(
                f"{case.argument}: expected "
            ), (case.id, message)
            takes = expected(message)
            if case.every:
                every[EVERY + (takes,)] = None
            else:
                entry = KERNELS[case.kernel].entry
                table[entry, f"`{case.argument}`", takes] = None
    return [*every, *table]


def markdown() -> str:
    lines = ["| entry point | argument | the kernel takes |", "| --- | --- | --- |"]
    lines += [f"| {e} | {a} | {x} |" for e, a, x in rows()]
    return "\n".join(lines)


def readme_table(readme: Path = README) -> str:
    text = readme.read_text()
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def _import_patched_vllm() -> None:
    """Makes the patched vLLM importable as the tests import it: the
    kernel-only shim with ``KPOOL_KERNEL_ONLY=1``, else the overlay."""
    import os

    sys.path.insert(0, str(REPO))
    if os.environ.get("KPOOL_KERNEL_ONLY") == "1":
        from tools.kernel_env.shim import install_from_env

        install_from_env()
        return
    from tools import overlay

    stock = overlay.find_installed_vllm()
    if stock is None:
        sys.exit("guard_table.py: no vllm installed; set KPOOL_KERNEL_ONLY=1")
    sys.path.insert(0, str(overlay.build_overlay(stock)))


if __name__ == "__main__":
    _import_patched_vllm()
    print(markdown())
