# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Each kernel's layouts at the edges of its rule: the dtypes, strides and
alignments its accesses take or not, as changes of its base case's
arguments with the argument the rule must name (None: taken). ``edges()``
of ``rule_edges.py`` lists them with the shape, scalar and type edges."""

import torch

from vllm.models.glm5next.nvidia.specialized_decode.constants import DIM, POOL

I16, I32, I64 = torch.int16, torch.int32, torch.int64
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def span(shape, stride) -> int:
    """The elements a tensor of ``shape`` and ``stride`` spans."""
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))


def like(tensor, *, shape=None, stride=None, dtype=None, offset=0, device=None):
    """A tensor with ``tensor``'s shape, strides, dtype and device unless
    given, ``offset`` elements into a fresh buffer (zeros) that starts
    aligned: a view, so that any strides are taken as they are."""
    shape = tuple(tensor.shape if shape is None else shape)
    stride = tuple(tensor.stride() if stride is None else stride)
    size = offset + (span(shape, stride) if all(shape) else 0) + 1
    dtype = tensor.dtype if dtype is None else dtype
    buffer = torch.zeros(size, dtype=dtype, device=device or tensor.device)
    return buffer.as_strided(shape, stride, offset)


def contiguous(tensor, *shape):
    """``like(tensor)`` of ``shape`` with contiguous strides."""
    return like(tensor, shape=shape, stride=torch.empty(shape, device="meta").stride())


def update_layouts(a: dict) -> list:
    """(name, changes, the argument refused or None): what the kernel's 4-
    and 8-byte accesses take: a uint8 cache of 4-byte aligned pages and unit
    byte stride; a BF16 tail whose rows are 8-byte aligned, 128 elements
    apart; BF16 keys and scores of unit dim stride, 8-byte aligned rows; a
    contiguous 16-byte aligned FP32 APE; contiguous int32/int64 indices."""
    kv, tail, key, score, ape = (
        a[n] for n in ("kv_cache", "tail_kv_cache", "key", "slot_score", "ape")
    )
    (blocks, _, ring, _), (requests, tokens, _) = tail.shape, key.shape
    page_bytes, half = kv.stride(0), tail.stride(1)

    def strides(t, *stride, offset=0):
        return like(t, stride=stride, offset=offset)

    def rows(t, row, offset=0):
        return strides(t, tokens * row, row, 1, offset=offset)

    found = [
        ("kv int8", dict(kv_cache=like(kv, dtype=torch.int8)), "kv_cache"),
        (
            "kv 2-d",
            dict(kv_cache=like(kv, shape=kv.shape[:2], stride=kv.stride()[:2])),
            "kv_cache",
        ),
        (
            "kv byte stride 2",
            dict(kv_cache=strides(kv, 2 * page_bytes, 264, 2)),
            "kv_cache",
        ),
        ("kv byte stride 0", dict(kv_cache=strides(kv, 64, 1, 0)), "kv_cache"),
        (
            "kv page stride + 2",
            dict(kv_cache=strides(kv, page_bytes + 2, 132, 1)),
            "kv_cache",
        ),
        ("kv misaligned", dict(kv_cache=like(kv, offset=2)), "kv_cache"),
        (
            "kv pages padded",
            dict(kv_cache=strides(kv, page_bytes + 8, 132, 1, offset=4)),
            None,
        ),
        ("tail fp16", dict(tail_kv_cache=like(tail, dtype=F16)), "tail_kv_cache"),
        (
            "tail 3-d",
            dict(
                tail_kv_cache=like(
                    tail, shape=(blocks, 2 * ring, DIM), stride=(2 * half, DIM, 1)
                )
            ),
            "tail_kv_cache",
        ),
        (
            "tail dim stride 2",
            dict(tail_kv_cache=strides(tail, 4 * half, 2 * half, 2 * DIM, 2)),
            "tail_kv_cache",
        ),
        (
            "tail rows 132 apart",
            dict(tail_kv_cache=strides(tail, 2 * ring * 132, ring * 132, 132, 1)),
            "tail_kv_cache",
        ),
        (
            "tail half stride + 2",
            dict(tail_kv_cache=strides(tail, 2 * half + 4, half + 2, DIM, 1)),
            "tail_kv_cache",
        ),
        (
            "tail block stride + 2",
            dict(tail_kv_cache=strides(tail, 2 * half + 2, half, DIM, 1)),
            "tail_kv_cache",
        ),
        ("tail misaligned", dict(tail_kv_cache=like(tail, offset=2)), "tail_kv_cache"),
        (
            "tail padded",
            dict(tail_kv_cache=strides(tail, 2 * half + 8, half + 4, DIM, 1, offset=4)),
            None,
        ),
        ("key fp16", dict(key=like(key, dtype=F16)), "key"),
        (
            "key 2-d",
            dict(key=like(key, shape=(requests * tokens, DIM), stride=(DIM, 1))),
            "key",
        ),
        (
            "key dim stride 2",
            dict(key=strides(key, tokens * 2 * DIM, 2 * DIM, 2)),
            "key",
        ),
        ("key rows 130 apart", dict(key=rows(key, 130)), "key"),
        (
            "key requests + 2 apart",
            dict(key=strides(key, tokens * DIM + 2, DIM, 1)),
            "key",
        ),
        ("key misaligned", dict(key=like(key, offset=2)), "key"),
        ("score fp16", dict(slot_score=like(score, dtype=F16)), "slot_score"),
        ("score rows 130 apart", dict(slot_score=rows(score, 130)), "slot_score"),
        ("score misaligned", dict(slot_score=like(score, offset=1)), "slot_score"),
        (
            "key and score rows padded",
            dict(key=rows(key, 140, 4), slot_score=rows(score, 132)),
            None,
        ),
        ("ape bf16", dict(ape=like(ape, dtype=BF16)), "ape"),
        ("ape transposed", dict(ape=strides(ape, 1, POOL)), "ape"),
        ("ape misaligned", dict(ape=like(ape, offset=2)), "ape"),
        ("ape 16 bytes in", dict(ape=like(ape, offset=4)), None),
        ("fp32 scales", dict(mx_scales=False, round_scale=False), None),
        (
            "ring 12",
            dict(
                tail_kv_cache=like(
                    tail,
                    shape=(blocks, 2, 12, DIM),
                    stride=(24 * DIM, 12 * DIM, DIM, 1),
                )
            ),
            None,
        ),
        ("no requests", _requests(a, 0, tokens), None),
        ("no tokens", _requests(a, requests, 0), None),
    ]
    for name in ("tail_slot_mapping", "slot_mapping", "positions"):
        t = a[name]
        found += [
            (f"{name} float", {name: like(t, dtype=F32)}, name),
            (f"{name} int16", {name: like(t, dtype=I16)}, name),
            (f"{name} strided", {name: strides(t, 2 * tokens, 2)}, name),
            (
                f"{name} {'int32' if t.dtype == I64 else 'int64'}",
                {name: like(t, dtype=I32 if t.dtype == I64 else I64)},
                None,
            ),
        ]
    return found


def _requests(a: dict, requests: int, tokens: int) -> dict:
    """Keys, scores and index tensors of ``requests`` x ``tokens``."""
    shaped = {}
    for name in ("key", "slot_score", "tail_slot_mapping", "slot_mapping", "positions"):
        t = a[name]
        size = (requests, tokens, *t.shape[2:])
        shaped[name] = like(
            t, shape=size, stride=torch.empty(size, device="meta").stride()
        )
    return shaped


def expand_layouts(a: dict) -> list:
    """(name, changes, the argument refused or None): int32 pool ids of unit
    column stride; an int32 ``out`` of unit column stride, its rows 16-byte
    aligned; int32/int64 lengths of unit stride."""
    ids, lens, out = a["pool_ids"], a["seq_lens"], a["out"]
    rows, groups = ids.shape
    cols = groups * POOL + POOL - 1
    width = out.shape[1]
    return [
        ("ids int64", dict(pool_ids=like(ids, dtype=I64)), "pool_ids"),
        ("ids 1-d", dict(pool_ids=like(ids, shape=(groups,), stride=(1,))), "pool_ids"),
        (
            "ids column stride 2",
            dict(pool_ids=like(ids, stride=(2 * groups, 2))),
            "pool_ids",
        ),
        ("ids column stride 0", dict(pool_ids=like(ids, stride=(1, 0))), "pool_ids"),
        (
            "ids rows padded",
            dict(pool_ids=like(ids, stride=(groups + 1, 1), offset=1)),
            None,
        ),
        ("out int64", dict(out=like(out, dtype=I64)), "out"),
        ("out 1-d", dict(out=like(out, shape=(width,), stride=(1,))), "out"),
        ("out column stride 2", dict(out=like(out, stride=(2 * width, 2))), "out"),
        ("out row stride + 2", dict(out=like(out, stride=(width + 2, 1))), "out"),
        ("out misaligned", dict(out=like(out, offset=2)), "out"),
        ("out exact width", dict(out=like(out, shape=(rows, cols))), None),
        (
            "out rows padded",
            dict(out=like(out, shape=(rows, cols), stride=(cols + 1, 1), offset=4)),
            None,
        ),
        ("lens int16", dict(seq_lens=like(lens, dtype=torch.int16)), "seq_lens"),
        ("lens float", dict(seq_lens=like(lens, dtype=torch.float32)), "seq_lens"),
        (
            "lens 2-d",
            dict(seq_lens=like(lens, shape=(rows, 1), stride=(1, 1))),
            "seq_lens",
        ),
        ("lens strided", dict(seq_lens=like(lens, stride=(2,))), "seq_lens"),
        ("lens stride 0", dict(seq_lens=like(lens, stride=(0,))), "seq_lens"),
        ("lens int32", dict(seq_lens=like(lens, dtype=I32)), None),
        ("int32 lengths off", dict(int32_lengths=False), None),
        (
            "no pools",
            dict(
                pool_ids=like(ids, shape=(rows, 0)),
                out=like(out, shape=(rows, 4), stride=(4, 1)),
            ),
            None,
        ),
        (
            "no rows",
            dict(
                pool_ids=like(ids, shape=(0, groups)), out=like(out, shape=(0, width))
            ),
            None,
        ),
    ]


def remap_layouts(a: dict) -> list:
    """(name, changes, the argument refused or None): int32 pool ids and
    block table of unit column stride, int32 row ids and counts of unit
    stride, int32/int64 positions of unit stride, a contiguous 16-byte
    aligned int32 ``out``."""
    ids, pos, req, table = a["pool_ids"], a["positions"], a["req_ids"], a["block_table"]
    out, counts = a["out"], a["counts"]
    rows, (expanded, groups) = req.shape[0], ids.shape
    width, blocks = out.shape[1], table.shape[1]

    def shape(t, *size):
        return like(t, shape=size, stride=torch.empty(size, device="meta").stride())

    def pools(n, w, **more):
        return dict(pool_ids=shape(ids, expanded, n), out=shape(out, rows, w)) | more

    return [
        ("ids int64", dict(pool_ids=like(ids, dtype=I64)), "pool_ids"),
        ("ids 1-d", dict(pool_ids=shape(ids, groups)), "pool_ids"),
        (
            "ids column stride 2",
            dict(pool_ids=like(ids, stride=(2 * groups, 2))),
            "pool_ids",
        ),
        ("ids column stride 0", dict(pool_ids=like(ids, stride=(1, 0))), "pool_ids"),
        (
            "ids rows padded",
            dict(pool_ids=like(ids, stride=(groups + 3, 1), offset=1)),
            None,
        ),
        ("req_ids int64", dict(req_ids=like(req, dtype=I64)), "req_ids"),
        ("req_ids 2-d", dict(req_ids=shape(req, rows, 1)), "req_ids"),
        ("req_ids strided", dict(req_ids=like(req, stride=(2,))), "req_ids"),
        ("out int64", dict(out=like(out, dtype=I64)), "out"),
        ("out 1-d", dict(out=shape(out, rows)), "out"),
        ("out rows padded", dict(out=like(out, stride=(width + 4, 1))), "out"),
        ("out misaligned", dict(out=like(out, offset=2)), "out"),
        ("counts int64", dict(counts=like(counts, dtype=I64)), "counts"),
        ("counts 0-d", dict(counts=shape(counts)), "counts"),
        ("counts 2-d", dict(counts=shape(counts, rows, 1)), "counts"),
        ("counts strided", dict(counts=like(counts, stride=(2,))), "counts"),
        ("counts stride 0", dict(counts=like(counts, stride=(0,))), "counts"),
        ("no counts", dict(counts=None), None),
        ("table int64", dict(block_table=like(table, dtype=I64)), "block_table"),
        ("table 1-d", dict(block_table=shape(table, blocks)), "block_table"),
        ("table 3-d", dict(block_table=shape(table, rows, blocks, 1)), "block_table"),
        (
            "table column stride 2",
            dict(block_table=like(table, stride=(2 * blocks, 2))),
            "block_table",
        ),
        (
            "table column stride 0",
            dict(block_table=like(table, stride=(1, 0))),
            "block_table",
        ),
        (
            "table rows padded",
            dict(block_table=like(table, stride=(blocks + 3, 1), offset=1)),
            None,
        ),
        (
            "positions float",
            dict(positions=like(pos, dtype=torch.float32)),
            "positions",
        ),
        ("positions int16", dict(positions=like(pos, dtype=torch.int16)), "positions"),
        ("positions 0-d", dict(positions=shape(pos)), "positions"),
        ("positions 2-d", dict(positions=shape(pos, pos.shape[0], 1)), "positions"),
        ("positions strided", dict(positions=like(pos, stride=(2,))), "positions"),
        ("positions stride 0", dict(positions=like(pos, stride=(0,))), "positions"),
        ("positions int32", dict(positions=like(pos, dtype=I32)), None),
        ("int32 lengths off", dict(int32_lengths=False), None),
        ("32 pools, 256 columns", pools(32, 256), None),
        ("992 pools, 4096 columns", pools(992, 4096), None),
        ("1024 pools, 4224 columns", pools(1024, 4224), "out"),
        ("1024 pools, 4224 columns, no counts", pools(1024, 4224, counts=None), None),
        ("1024 pools, 6144 columns", pools(1024, 6144), "out"),
        ("1024 pools, 8192 columns", pools(1024, 8192), None),
        ("block size 12", dict(block_size=12, stride_rows=12), None),
        (
            "no rows",
            dict(
                pool_ids=shape(ids, 0, groups),
                req_ids=shape(req, 0),
                out=shape(out, 0, width),
            ),
            None,
        ),
    ]


def upcast_layouts(a: dict) -> list:
    """(name, changes, the argument refused or None): the dtypes, strides
    and alignments the kernel's accesses take: unit column stride, rows
    16-byte aligned, int32 row ends of unit stride, an FP32 ``out`` with
    the logits' strides."""
    logits, ends, out = a["logits"], a["row_ends"], a["out"]
    rows = logits.shape[0]

    def rows_of(width, stride, offset=0):
        shape = dict(shape=(rows, width), stride=(stride, 1))
        return dict(
            logits=like(logits, **shape, offset=offset),
            out=like(out, **shape, offset=offset // 2),
        )

    empty = like(logits, shape=(0, 8), stride=(8, 1))
    return [
        ("logits fp32", dict(logits=like(logits, dtype=torch.float32)), "logits"),
        ("logits 1-d", dict(logits=like(logits, shape=(8,), stride=(1,))), "logits"),
        (
            "logits column stride 2",
            dict(logits=like(logits, stride=(2008, 2))),
            "logits",
        ),
        ("logits column stride 0", dict(logits=like(logits, stride=(1, 0))), "logits"),
        ("logits row stride 1004", rows_of(1000, 1004), "logits"),
        ("logits row stride 12", rows_of(12, 12), "logits"),
        ("logits misaligned", dict(logits=like(logits, offset=4)), "logits"),
        ("row_ends int64", dict(row_ends=like(ends, dtype=torch.int64)), "row_ends"),
        (
            "row_ends 2-d",
            dict(row_ends=like(ends, shape=(rows, 1), stride=(1, 1))),
            "row_ends",
        ),
        ("row_ends 0-d", dict(row_ends=like(ends, shape=(), stride=())), "row_ends"),
        ("row_ends strided", dict(row_ends=like(ends, stride=(2,))), "row_ends"),
        ("row_ends stride 0", dict(row_ends=like(ends, stride=(0,))), "row_ends"),
        ("out bf16", dict(out=like(out, dtype=torch.bfloat16)), "out"),
        (
            "out other strides",
            dict(out=like(out, stride=(out.stride(0) + 8, 1))),
            "out",
        ),
        ("out misaligned", dict(out=like(out, offset=2)), "out"),
        ("out left out", dict(out=None), None),
        ("rows padded, 16-byte offsets", rows_of(1000, 1008, offset=8), None),
        ("row stride = width", rows_of(1000, 1000), None),
        ("width 1001", rows_of(1001, 1008), None),
        (
            "no rows",
            dict(logits=empty, row_ends=like(ends, shape=(0,)), out=None),
            None,
        ),
    ]


def select_layouts(a: dict) -> list:
    """(name, changes, the argument refused or None): FP32/BF16 logits of
    unit column stride, rows 16-byte aligned; int32 ends of unit stride; an
    int32 ``out`` of unit column stride."""
    logits, ends, out = a["logits"], a["ends"], a["out"]
    rows, width = logits.shape
    k = a["k"]
    return [
        ("logits fp16", dict(logits=like(logits, dtype=torch.float16)), "logits"),
        ("logits bf16", dict(logits=like(logits, dtype=BF16)), None),
        (
            "logits 1-d",
            dict(logits=like(logits, shape=(width,), stride=(1,))),
            "logits",
        ),
        (
            "logits column stride 2",
            dict(logits=like(logits, stride=(2 * width, 2))),
            "logits",
        ),
        (
            "logits row stride + 2",
            dict(logits=like(logits, stride=(width + 2, 1))),
            "logits",
        ),
        ("logits rows padded", dict(logits=like(logits, stride=(width + 4, 1))), None),
        ("logits misaligned", dict(logits=like(logits, offset=2)), "logits"),
        (
            "logits bf16 row stride + 4 (8 bytes)",
            dict(logits=like(logits, dtype=BF16, stride=(width + 4, 1))),
            "logits",
        ),
        (
            "logits bf16 rows padded (16 bytes)",
            dict(logits=like(logits, dtype=BF16, stride=(width + 8, 1))),
            None,
        ),
        (
            "logits bf16 8 bytes in",
            dict(logits=like(logits, dtype=BF16, offset=4)),
            "logits",
        ),
        ("ends int64", dict(ends=like(ends, dtype=torch.int64)), "ends"),
        ("ends 2-d", dict(ends=like(ends, shape=(rows, 1), stride=(1, 1))), "ends"),
        ("ends strided", dict(ends=like(ends, stride=(2,))), "ends"),
        ("out int64", dict(out=like(out, dtype=torch.int64)), "out"),
        ("out column stride 2", dict(out=like(out, stride=(2 * k, 2))), "out"),
        (
            "out columns of a wider buffer",
            dict(out=like(out, stride=(k + 64, 1))),
            None,
        ),
        ("k 1024, out of 1024", dict(k=1024, out=contiguous(out, rows, 1024)), None),
        ("out left out", dict(out=None), None),
        ("no rows", dict(logits=like(logits, shape=(0, width)), out=None), None),
    ]


LAYOUTS = {
    "UpdateKernel": update_layouts,
    "ExpandKernel": expand_layouts,
    "RemapKernel": remap_layouts,
    "UpcastKernel": upcast_layouts,
    "SelectKernel": select_layouts,
}
