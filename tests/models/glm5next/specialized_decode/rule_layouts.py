# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Each kernel's layouts at the edges of its rule: the dtypes, strides and
alignments its accesses take or not, as changes of its base case's
arguments with the argument the rule must name (None: taken). ``edges()``
of ``rule_edges.py`` lists them with the shape, scalar and type edges.

A table row is ``(name, refused, {argument: change})``: a change is a dict
of ``like``'s keywords for that argument of the base case (a shape without
strides gets contiguous ones), or the value itself (None, a bool, an int)."""

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


def dense(shape) -> tuple:
    return torch.empty(shape, device="meta").stride()


def contiguous(tensor, *shape):
    """``like(tensor)`` of ``shape`` with contiguous strides."""
    return like(tensor, shape=shape, stride=dense(shape))


def rows(a: dict, table) -> list:
    """``(name, changes, refused)`` of each ``(name, refused, changes)``."""

    def change(t, v):
        if not isinstance(v, dict):
            return v
        if isinstance(t, tuple):  # the scores' query: its values change
            return (change(t[0], v), *t[1:])
        return like(t, **({"stride": dense(v["shape"])} if "shape" in v else {}) | v)

    return [(n, {k: change(a.get(k), v) for k, v in c.items()}, r) for n, r, c in table]


def update_layouts(a: dict) -> list:
    """What the kernel's 4- and 8-byte accesses take: a uint8 cache of
    4-byte aligned pages and unit byte stride; a BF16 tail whose rows are
    8-byte aligned, 128 elements apart; BF16 keys and scores of unit dim
    stride, 8-byte aligned rows; a contiguous 16-byte aligned FP32 APE;
    contiguous int32/int64 indices."""
    kv, tail, key = a["kv_cache"], a["tail_kv_cache"], a["key"]
    (blocks, _, ring, _), (requests, tokens, _) = tail.shape, key.shape
    page, half = kv.stride(0), tail.stride(1)
    c, t, k, s = "kv_cache", "tail_kv_cache", "key", "slot_score"
    indices = ("tail_slot_mapping", "slot_mapping", "positions")

    def row(n, offset=0):  # keys' or scores' rows n elements apart
        return dict(stride=(tokens * n, n, 1), offset=offset)

    def shaped(r, n):  # keys, scores and indices of r requests x n tokens
        return {x: dict(shape=(r, n, *a[x].shape[2:])) for x in (k, s, *indices)}

    table = [
        ("kv int8", c, {c: dict(dtype=torch.int8)}),
        ("kv 2-d", c, {c: dict(shape=kv.shape[:2], stride=kv.stride()[:2])}),
        ("kv byte stride 2", c, {c: dict(stride=(2 * page, 264, 2))}),
        ("kv byte stride 0", c, {c: dict(stride=(64, 1, 0))}),
        ("kv page stride + 2", c, {c: dict(stride=(page + 2, 132, 1))}),
        ("kv misaligned", c, {c: dict(offset=2)}),
        ("kv pages padded", None, {c: dict(stride=(page + 8, 132, 1), offset=4)}),
        ("tail fp16", t, {t: dict(dtype=F16)}),
        (
            "tail 3-d",
            t,
            {t: dict(shape=(blocks, 2 * ring, DIM), stride=(2 * half, DIM, 1))},
        ),
        ("tail dim stride 2", t, {t: dict(stride=(4 * half, 2 * half, 2 * DIM, 2))}),
        ("tail rows 132 apart", t, {t: dict(stride=(264 * ring, 132 * ring, 132, 1))}),
        ("tail half stride + 2", t, {t: dict(stride=(2 * half + 4, half + 2, DIM, 1))}),
        ("tail block stride + 2", t, {t: dict(stride=(2 * half + 2, half, DIM, 1))}),
        ("tail misaligned", t, {t: dict(offset=2)}),
        (
            "tail padded",
            None,
            {t: dict(stride=(2 * half + 8, half + 4, DIM, 1), offset=4)},
        ),
        ("key fp16", k, {k: dict(dtype=F16)}),
        ("key 2-d", k, {k: dict(shape=(requests * tokens, DIM))}),
        ("key dim stride 2", k, {k: dict(stride=(tokens * 2 * DIM, 2 * DIM, 2))}),
        ("key rows 130 apart", k, {k: row(130)}),
        ("key requests + 2 apart", k, {k: dict(stride=(tokens * DIM + 2, DIM, 1))}),
        ("key misaligned", k, {k: dict(offset=2)}),
        ("score fp16", s, {s: dict(dtype=F16)}),
        ("score rows 130 apart", s, {s: row(130)}),
        ("score misaligned", s, {s: dict(offset=1)}),
        ("key and score rows padded", None, {k: row(140, 4), s: row(132)}),
        ("ape bf16", "ape", {"ape": dict(dtype=BF16)}),
        ("ape transposed", "ape", {"ape": dict(stride=(1, POOL))}),
        ("ape misaligned", "ape", {"ape": dict(offset=2)}),
        ("ape 16 bytes in", None, {"ape": dict(offset=4)}),
        ("fp32 scales", None, dict(mx_scales=False, round_scale=False)),
        ("ring 12", None, {t: dict(shape=(blocks, 2, 12, DIM))}),
        ("no requests", None, shaped(0, tokens)),
        ("no tokens", None, shaped(requests, 0)),
    ]
    for n in indices:
        other = I32 if a[n].dtype == I64 else I64
        table += [
            (f"{n} float", n, {n: dict(dtype=F32)}),
            (f"{n} int16", n, {n: dict(dtype=I16)}),
            (f"{n} strided", n, {n: dict(stride=(2 * tokens, 2))}),
            (f"{n} {str(other)[6:]}", None, {n: dict(dtype=other)}),
        ]
    return rows(a, table)


def expand_layouts(a: dict) -> list:
    """Int32 pool ids of unit column stride; an int32 ``out`` of unit column
    stride, its rows 16-byte aligned; int32/int64 lengths of unit stride."""
    i, o, n = "pool_ids", "out", "seq_lens"
    (rows_, groups), width = a[i].shape, a[o].shape[1]
    cols, ids, out = groups * POOL + POOL - 1, a[i].stride(), a[o].stride()
    return rows(
        a,
        [
            ("ids int64", i, {i: dict(dtype=I64)}),
            ("ids 1-d", i, {i: dict(shape=(groups,))}),
            ("ids column stride 2", i, {i: dict(stride=(2 * groups, 2))}),
            ("ids column stride 0", i, {i: dict(stride=(1, 0))}),
            ("ids rows padded", None, {i: dict(stride=(groups + 1, 1), offset=1)}),
            ("out int64", o, {o: dict(dtype=I64)}),
            ("out 1-d", o, {o: dict(shape=(width,))}),
            ("out column stride 2", o, {o: dict(stride=(2 * width, 2))}),
            ("out row stride + 2", o, {o: dict(stride=(width + 2, 1))}),
            ("out misaligned", o, {o: dict(offset=2)}),
            ("out exact width", None, {o: dict(shape=(rows_, cols), stride=out)}),
            (
                "out rows padded",
                None,
                {o: dict(shape=(rows_, cols), stride=(cols + 1, 1), offset=4)},
            ),
            ("lens int16", n, {n: dict(dtype=I16)}),
            ("lens float", n, {n: dict(dtype=F32)}),
            ("lens 2-d", n, {n: dict(shape=(rows_, 1), stride=(1, 1))}),
            ("lens strided", n, {n: dict(stride=(2,))}),
            ("lens stride 0", n, {n: dict(stride=(0,))}),
            ("lens int32", None, {n: dict(dtype=I32)}),
            ("int32 lengths off", None, dict(int32_lengths=False)),
            (
                "no pools",
                None,
                {i: dict(shape=(rows_, 0), stride=ids), o: dict(shape=(rows_, 4))},
            ),
            (
                "no rows",
                None,
                {
                    i: dict(shape=(0, groups), stride=ids),
                    o: dict(shape=(0, width), stride=out),
                },
            ),
        ],
    )


def remap_layouts(a: dict) -> list:
    """Int32 pool ids and block table of unit column stride, int32 row ids
    and counts of unit stride, int32/int64 positions of unit stride, a
    contiguous 16-byte aligned int32 ``out``."""
    i, r, o, c = "pool_ids", "req_ids", "out", "counts"
    b, p = "block_table", "positions"
    (expanded, groups), rows_ = a[i].shape, a[r].shape[0]
    width, blocks = a[o].shape[1], a[b].shape[1]

    def pools(n, w, **more):
        return {i: dict(shape=(expanded, n)), o: dict(shape=(rows_, w))} | more

    return rows(
        a,
        [
            ("ids int64", i, {i: dict(dtype=I64)}),
            ("ids 1-d", i, {i: dict(shape=(groups,))}),
            ("ids column stride 2", i, {i: dict(stride=(2 * groups, 2))}),
            ("ids column stride 0", i, {i: dict(stride=(1, 0))}),
            ("ids rows padded", None, {i: dict(stride=(groups + 3, 1), offset=1)}),
            ("req_ids int64", r, {r: dict(dtype=I64)}),
            ("req_ids 2-d", r, {r: dict(shape=(rows_, 1))}),
            ("req_ids strided", r, {r: dict(stride=(2,))}),
            ("out int64", o, {o: dict(dtype=I64)}),
            ("out 1-d", o, {o: dict(shape=(rows_,))}),
            ("out rows padded", o, {o: dict(stride=(width + 4, 1))}),
            ("out misaligned", o, {o: dict(offset=2)}),
            ("counts int64", c, {c: dict(dtype=I64)}),
            ("counts 0-d", c, {c: dict(shape=())}),
            ("counts 2-d", c, {c: dict(shape=(rows_, 1))}),
            ("counts strided", c, {c: dict(stride=(2,))}),
            ("counts stride 0", c, {c: dict(stride=(0,))}),
            ("no counts", None, {c: None}),
            ("table int64", b, {b: dict(dtype=I64)}),
            ("table 1-d", b, {b: dict(shape=(blocks,))}),
            ("table 3-d", b, {b: dict(shape=(rows_, blocks, 1))}),
            ("table column stride 2", b, {b: dict(stride=(2 * blocks, 2))}),
            ("table column stride 0", b, {b: dict(stride=(1, 0))}),
            ("table rows padded", None, {b: dict(stride=(blocks + 3, 1), offset=1)}),
            ("positions float", p, {p: dict(dtype=F32)}),
            ("positions int16", p, {p: dict(dtype=I16)}),
            ("positions 0-d", p, {p: dict(shape=())}),
            ("positions 2-d", p, {p: dict(shape=(a[p].shape[0], 1))}),
            ("positions strided", p, {p: dict(stride=(2,))}),
            ("positions stride 0", p, {p: dict(stride=(0,))}),
            ("positions int32", None, {p: dict(dtype=I32)}),
            ("int32 lengths off", None, dict(int32_lengths=False)),
            ("32 pools, 256 columns", None, pools(32, 256)),
            ("992 pools, 4096 columns", None, pools(992, 4096)),
            ("1024 pools, 4224 columns", o, pools(1024, 4224)),
            (
                "1024 pools, 4224 columns, no counts",
                None,
                pools(1024, 4224, counts=None),
            ),
            ("1024 pools, 6144 columns", o, pools(1024, 6144)),
            ("1024 pools, 8192 columns", None, pools(1024, 8192)),
            ("block size 12", None, dict(block_size=12, stride_rows=12)),
            (
                "no rows",
                None,
                {
                    i: dict(shape=(0, groups)),
                    r: dict(shape=(0,)),
                    o: dict(shape=(0, width)),
                },
            ),
        ],
    )


def upcast_layouts(a: dict) -> list:
    """The dtypes, strides and alignments the kernel's accesses take: unit
    column stride, rows 16-byte aligned, int32 row ends of unit stride, an
    FP32 ``out`` with the logits' strides."""
    x, e, o = "logits", "row_ends", "out"
    rows_ = a[x].shape[0]

    def rows_of(width, stride, offset=0):
        shape = dict(shape=(rows_, width), stride=(stride, 1))
        return {x: shape | dict(offset=offset), o: shape | dict(offset=offset // 2)}

    return rows(
        a,
        [
            ("logits fp32", x, {x: dict(dtype=F32)}),
            ("logits 1-d", x, {x: dict(shape=(8,))}),
            ("logits column stride 2", x, {x: dict(stride=(2008, 2))}),
            ("logits column stride 0", x, {x: dict(stride=(1, 0))}),
            ("logits row stride 1004", x, rows_of(1000, 1004)),
            ("logits row stride 12", x, rows_of(12, 12)),
            ("logits misaligned", x, {x: dict(offset=4)}),
            ("row_ends int64", e, {e: dict(dtype=I64)}),
            ("row_ends 2-d", e, {e: dict(shape=(rows_, 1), stride=(1, 1))}),
            ("row_ends 0-d", e, {e: dict(shape=())}),
            ("row_ends strided", e, {e: dict(stride=(2,))}),
            ("row_ends stride 0", e, {e: dict(stride=(0,))}),
            ("out bf16", o, {o: dict(dtype=BF16)}),
            ("out other strides", o, {o: dict(stride=(a[o].stride(0) + 8, 1))}),
            ("out misaligned", o, {o: dict(offset=2)}),
            ("out left out", None, {o: None}),
            ("rows padded, 16-byte offsets", None, rows_of(1000, 1008, offset=8)),
            ("row stride = width", None, rows_of(1000, 1000)),
            ("width 1001", None, rows_of(1001, 1008)),
            ("no rows", None, {x: dict(shape=(0, 8)), e: dict(shape=(0,)), o: None}),
        ],
    )


def select_layouts(a: dict) -> list:
    """FP32/BF16 logits of unit column stride, rows 16-byte aligned; int32
    ends of unit stride; an int32 ``out`` of unit column stride."""
    x, e, o = "logits", "ends", "out"
    (rows_, width), k = a[x].shape, a["k"]
    return rows(
        a,
        [
            ("logits fp16", x, {x: dict(dtype=F16)}),
            ("logits bf16", None, {x: dict(dtype=BF16)}),
            ("logits 1-d", x, {x: dict(shape=(width,))}),
            ("logits column stride 2", x, {x: dict(stride=(2 * width, 2))}),
            ("logits row stride + 2", x, {x: dict(stride=(width + 2, 1))}),
            ("logits rows padded", None, {x: dict(stride=(width + 4, 1))}),
            ("logits misaligned", x, {x: dict(offset=2)}),
            (
                "logits bf16 row stride + 4 (8 bytes)",
                x,
                {x: dict(dtype=BF16, stride=(width + 4, 1))},
            ),
            (
                "logits bf16 rows padded (16 bytes)",
                None,
                {x: dict(dtype=BF16, stride=(width + 8, 1))},
            ),
            ("logits bf16 8 bytes in", x, {x: dict(dtype=BF16, offset=4)}),
            ("ends int64", e, {e: dict(dtype=I64)}),
            ("ends 2-d", e, {e: dict(shape=(rows_, 1), stride=(1, 1))}),
            ("ends strided", e, {e: dict(stride=(2,))}),
            ("out int64", o, {o: dict(dtype=I64)}),
            ("out column stride 2", o, {o: dict(stride=(2 * k, 2))}),
            ("out columns of a wider buffer", None, {o: dict(stride=(k + 64, 1))}),
            ("k 1024, out of 1024", None, {"k": 1024, o: dict(shape=(rows_, 1024))}),
            ("out left out", None, {o: None}),
            (
                "no rows",
                None,
                {x: dict(shape=(0, width), stride=a[x].stride()), o: None},
            ),
        ],
    )


def scores_layouts(a: dict) -> list:
    """A contiguous FP8 e4m3 query, 16-byte aligned; a uint8 cache of dense
    pages (132-byte rows) 16-byte aligned and a 16-byte multiple apart; FP32
    weights and an FP32 ``out`` of unit column stride; contiguous int32
    lengths; an int32 block table of unit column stride; no ``indices``."""
    q, c, w, n, b, o = "q", "kv_cache", "weights", "seq_lens", "block_table", "out"
    values, kv = a[q][0], a[c]
    entries, next_n, heads, dim = values.shape
    blocks, block, _, row = kv.shape
    page, width = kv.stride(0), a[o].shape[1]
    rows_ = entries * next_n
    pages = dict(shape=kv.shape)
    return rows(
        a,
        [
            ("q e5m2", q, {q: dict(dtype=torch.float8_e5m2)}),
            ("q int8", q, {q: dict(dtype=torch.int8)}),
            (
                "q rows + 16 apart (padded heads)",
                None,
                {
                    q: dict(
                        stride=(next_n * (heads * dim + 16), heads * dim + 16, dim, 1)
                    )
                },
            ),
            (
                "q rows + 8 apart",
                q,
                {q: dict(stride=(next_n * (heads * dim + 8), heads * dim + 8, dim, 1))},
            ),
            (
                "q heads 144 apart",
                q,
                {q: dict(stride=(next_n * heads * 144, heads * 144, 144, 1))},
            ),
            ("q contiguous", None, {q: dict(stride=dense(values.shape))}),
            (
                "q and weights: views of twice their heads",
                None,
                {
                    q: dict(stride=(next_n * 2 * heads * dim, 2 * heads * dim, dim, 1)),
                    w: dict(stride=(2 * heads, 1)),
                },
            ),
            ("q next_n stride 0", q, {q: dict(stride=(heads * dim, 0, dim, 1))}),
            ("q 8 bytes in", q, {q: dict(offset=8)}),
            ("q 16 bytes in", None, {q: dict(offset=16)}),
            ("kv int8", c, {c: dict(dtype=torch.int8)}),
            ("kv 3-d", c, {c: dict(shape=(blocks, block, row), stride=(page, row, 1))}),
            ("kv rows 136 apart", c, {c: pages | dict(stride=(page, 136, 136, 1))}),
            (
                "kv pages + 4 apart",
                c,
                {c: pages | dict(stride=(page + 4, row, row, 1))},
            ),
            (
                "kv pages + 16 apart",
                None,
                {c: pages | dict(stride=(page + 16, row, row, 1))},
            ),
            (
                "kv pages overlapping",
                c,
                {c: pages | dict(stride=(page - 16, row, row, 1))},
            ),
            ("kv 4 bytes in", c, {c: dict(offset=4)}),
            ("kv 16 bytes in", None, {c: dict(offset=16)}),
            ("weights bf16", w, {w: dict(dtype=BF16)}),
            ("weights column stride 2", w, {w: dict(stride=(2 * heads, 2))}),
            ("weights rows padded", None, {w: dict(stride=(heads + 4, 1), offset=1)}),
            ("seq_lens int64", n, {n: dict(dtype=I64)}),
            ("seq_lens strided", n, {n: dict(stride=(2 * next_n, 2))}),
            ("seq_lens 1-d", n, {n: dict(shape=(rows_,))}),
            ("table int64", b, {b: dict(dtype=I64)}),
            ("table column stride 2", b, {b: dict(stride=(2 * a[b].shape[1], 2))}),
            (
                "table rows padded",
                None,
                {b: dict(stride=(a[b].shape[1] + 3, 1), offset=1)},
            ),
            ("out bf16", o, {o: dict(dtype=BF16)}),
            ("out column stride 2", o, {o: dict(stride=(2 * width, 2))}),
            ("out rows overlapping", o, {o: dict(stride=(width - 1, 1))}),
            ("out rows padded", None, {o: dict(stride=(width + 256, 1))}),
            ("out left out", None, {o: None}),
            (
                "indices given",
                "indices",
                {"indices": torch.zeros(rows_, dtype=I32, device=a[n].device)},
            ),
            (
                "no entries",
                None,
                {
                    q: dict(shape=(0, next_n, heads, dim)),
                    w: dict(shape=(0, heads)),
                    n: dict(shape=(0, next_n)),
                    b: dict(shape=(0, a[b].shape[1])),
                    o: dict(shape=(0, width)),
                },
            ),
        ],
    )


LAYOUTS = {
    "UpdateKernel": update_layouts,
    "ExpandKernel": expand_layouts,
    "RemapKernel": remap_layouts,
    "UpcastKernel": upcast_layouts,
    "SelectKernel": select_layouts,
    "ScoresKernel": scores_layouts,
}
