# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Each kernel's rule (``*_unmet``) at its edges, the launch scoping of
``launch.py``, and what each public function hands its kernel: the compile
key and the arguments, seen by a recording executor in place of the compiled
one (CPU; no kernel runs). The rules take layouts a kernel's 16-byte or
8-byte accesses can take, with strides that are not the usual ones (page
padding, padded rows) where the rule allows them."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("vllm")
pytest.importorskip("cutlass")

from vllm.models.glm5next.nvidia.specialized_decode import (  # noqa: E402
    kpool,
    launch,
    remap_kernel,
    upcast_kernel,
)

DIM, POOL = 128, 4


def strided(shape, stride, dtype, offset=0):
    """A view of a fresh buffer with these strides, ``offset`` elements in
    (a misaligned start for offsets that are not a multiple of 16 bytes)."""
    size = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    return torch.zeros(size + 64, dtype=dtype).as_strided(shape, stride, offset)


# --- update_unmet ----------------------------------------------------------


def update_args(**changes):
    r, t, ring, page = 2, 3, 8, 16
    args = dict(
        # Pages padded by 4 bytes; tail blocks and halves padded by 4 rows' worth.
        kv_cache=strided(
            (3, page, DIM + 4), (page * (DIM + 4) + 4, DIM + 4, 1), torch.uint8
        ),
        tail_kv_cache=strided(
            (4, 2, ring, DIM), (2 * 1028 + 4, 1028, DIM, 1), torch.bfloat16
        ),
        tail_slot_mapping=torch.zeros(r, t, dtype=torch.int64),
        key=strided((r, t, DIM), (3 * 136 + 8, 136, 1), torch.bfloat16),
        slot_score=strided((r, t, DIM), (3 * 132, 132, 1), torch.bfloat16),
        ape=torch.zeros(POOL, DIM),
        slot_mapping=torch.zeros(r, t, dtype=torch.int32),
        positions=torch.zeros(r, t, dtype=torch.int32),
        pool_size=POOL,
        head_dim=DIM,
    )
    args.update(changes)
    return args


def _bf16(shape, stride, offset=0):
    return strided(shape, stride, torch.bfloat16, offset)


UPDATE_REFUSED = {
    "head_dim-64": (dict(head_dim=64), "head_dim"),
    "head_dim-256": (dict(head_dim=256), "head_dim"),
    "pool-2": (dict(pool_size=2), "pool_size"),
    "pool-8": (dict(pool_size=8), "pool_size"),
    "kv-bytes-stride0": (
        dict(kv_cache=torch.zeros(3, 16, 1, dtype=torch.uint8).expand(3, 16, 132)),
        "kv_cache",
    ),
    "kv-dtype": (dict(kv_cache=torch.zeros(3, 16, 132, dtype=torch.int8)), "kv_cache"),
    "kv-ndim": (dict(kv_cache=torch.zeros(3, 16 * 132, dtype=torch.uint8)), "kv_cache"),
    "kv-bytes-stride": (
        dict(kv_cache=strided((3, 16, 132), (16 * 264, 264, 2), torch.uint8)),
        "kv_cache",
    ),
    "kv-page-stride": (
        dict(kv_cache=strided((3, 16, 132), (16 * 132 + 2, 132, 1), torch.uint8)),
        "kv_cache",
    ),
    "kv-page-stride-6": (
        dict(kv_cache=strided((3, 1, 6), (6, 6, 1), torch.uint8)),
        "kv_cache",
    ),
    "kv-misaligned": (
        dict(kv_cache=strided((3, 16, 132), (16 * 132, 132, 1), torch.uint8, 2)),
        "kv_cache",
    ),
    "tail-dtype": (
        dict(tail_kv_cache=torch.zeros(4, 2, 8, DIM, dtype=torch.float16)),
        "tail_kv_cache",
    ),
    "tail-ndim": (
        dict(tail_kv_cache=torch.zeros(4, 16, DIM, dtype=torch.bfloat16)),
        "tail_kv_cache",
    ),
    "tail-halves": (
        dict(tail_kv_cache=torch.zeros(4, 3, 8, DIM, dtype=torch.bfloat16)),
        "tail_kv_cache",
    ),
    "tail-ring-6": (
        dict(tail_kv_cache=torch.zeros(4, 2, 6, DIM, dtype=torch.bfloat16)),
        "tail_kv_cache",
    ),
    "tail-ring-5": (
        dict(tail_kv_cache=torch.zeros(4, 2, 5, DIM, dtype=torch.bfloat16)),
        "tail_kv_cache",
    ),
    "tail-dim": (
        dict(tail_kv_cache=torch.zeros(4, 2, 8, 64, dtype=torch.bfloat16)),
        "tail_kv_cache",
    ),
    "tail-dim-stride": (
        dict(tail_kv_cache=_bf16((4, 2, 8, DIM), (4096, 2048, 256, 2))),
        "tail_kv_cache",
    ),
    "tail-row-stride": (
        dict(tail_kv_cache=_bf16((4, 2, 8, DIM), (2 * 8 * 132, 8 * 132, 132, 1))),
        "tail_kv_cache",
    ),
    "tail-half-stride": (
        dict(tail_kv_cache=_bf16((4, 2, 8, DIM), (2 * 1026 + 4, 1026, DIM, 1))),
        "tail_kv_cache",
    ),
    "tail-block-stride": (
        dict(tail_kv_cache=_bf16((4, 2, 8, DIM), (2 * 1024 + 2, 1024, DIM, 1))),
        "tail_kv_cache",
    ),
    "tail-misaligned": (
        dict(tail_kv_cache=_bf16((4, 2, 8, DIM), (2048, 1024, DIM, 1), 2)),
        "tail_kv_cache",
    ),
    "key-dtype": (dict(key=torch.zeros(2, 3, DIM, dtype=torch.float16)), "key"),
    "key-ndim": (dict(key=torch.zeros(6, DIM, dtype=torch.bfloat16)), "key"),
    "key-dim": (dict(key=torch.zeros(2, 3, 64, dtype=torch.bfloat16)), "key"),
    "key-dim-stride": (dict(key=_bf16((2, 3, DIM), (768, 256, 2))), "key"),
    "key-row-stride": (dict(key=_bf16((2, 3, DIM), (3 * 130, 130, 1))), "key"),
    "key-request-stride": (dict(key=_bf16((2, 3, DIM), (3 * DIM + 2, DIM, 1))), "key"),
    "key-misaligned": (dict(key=_bf16((2, 3, DIM), (3 * DIM, DIM, 1), 2)), "key"),
    "score-dtype": (
        dict(slot_score=torch.zeros(2, 3, DIM, dtype=torch.float16)),
        "slot_score",
    ),
    "score-shape": (
        dict(slot_score=torch.zeros(2, 4, DIM, dtype=torch.bfloat16)),
        "slot_score",
    ),
    "score-misaligned": (
        dict(slot_score=_bf16((2, 3, DIM), (3 * DIM, DIM, 1), 1)),
        "slot_score",
    ),
    "ape-dtype": (dict(ape=torch.zeros(POOL, DIM, dtype=torch.bfloat16)), "ape"),
    "ape-shape": (dict(ape=torch.zeros(POOL, 64)), "ape"),
    "ape-strides": (dict(ape=torch.zeros(DIM, POOL).t()), "ape"),
    "ape-misaligned": (
        dict(ape=strided((POOL, DIM), (DIM, 1), torch.float32, 2)),
        "ape",
    ),
    "slots-dtype": (
        dict(slot_mapping=torch.zeros(2, 3, dtype=torch.int16)),
        "slot_mapping",
    ),
    "slots-shape": (
        dict(slot_mapping=torch.zeros(2, 4, dtype=torch.int32)),
        "slot_mapping",
    ),
    "tail-slots": (
        dict(tail_slot_mapping=torch.zeros(3, 2, dtype=torch.int64)),
        "tail_slot_mapping",
    ),
    "positions-strided": (
        dict(positions=torch.zeros(2, 6, dtype=torch.int32)[:, ::2]),
        "positions",
    ),
}


def test_update_rule_takes():
    assert kpool.update_unmet(**update_args()) is None
    assert (
        kpool.update_unmet(
            **update_args(positions=torch.zeros(2, 3, dtype=torch.int64))
        )
        is None
    )
    ring4 = torch.zeros(4, 2, 4, DIM, dtype=torch.bfloat16)
    assert kpool.update_unmet(**update_args(tail_kv_cache=ring4)) is None
    ring12 = torch.zeros(4, 2, 12, DIM, dtype=torch.bfloat16)
    assert kpool.update_unmet(**update_args(tail_kv_cache=ring12)) is None
    kv = strided((3, 16, 132), (16 * 132 + 8, 132, 1), torch.uint8, 4)
    assert kpool.update_unmet(**update_args(kv_cache=kv)) is None
    tail = _bf16((4, 2, 8, DIM), (2 * 1032 + 8, 1032, DIM, 1), 4)
    assert kpool.update_unmet(**update_args(tail_kv_cache=tail)) is None
    key = _bf16((2, 3, DIM), (3 * 140, 140, 1), 4)
    assert kpool.update_unmet(**update_args(key=key)) is None
    ape = strided((POOL, DIM), (DIM, 1), torch.float32, 4)
    assert kpool.update_unmet(**update_args(ape=ape)) is None


@pytest.mark.parametrize("case", UPDATE_REFUSED)
def test_update_rule_refuses(case):
    changes, argument = UPDATE_REFUSED[case]
    problem = kpool.update_unmet(**update_args(**changes))
    assert problem is not None and problem.startswith(f"{argument}: expected "), problem


def test_update_messages():
    assert kpool.update_unmet(**update_args(head_dim=64)) == (
        "head_dim: expected 128, got 64"
    )
    assert kpool.update_unmet(**update_args(pool_size=8)) == (
        "pool_size: expected 4, got 8"
    )
    ape = torch.zeros(POOL, 64)
    assert kpool.update_unmet(**update_args(ape=ape)) == (
        "ape: expected a contiguous fp32 [4, 128], got torch.float32 [4, 64] "
        "strides [64, 1]"
    )
    slots = torch.zeros(2, 4, dtype=torch.int32)
    assert kpool.update_unmet(**update_args(slot_mapping=slots)) == (
        "slot_mapping: expected a contiguous int32/int64 [2, 3], got torch.int32 "
        "[2, 4] strides [4, 1]"
    )
    key = torch.zeros(2, 3, 64, dtype=torch.bfloat16)
    assert kpool.update_unmet(**update_args(key=key)) == (
        "key: expected bf16 [requests, tokens, 128], got torch.bfloat16 [2, 3, 64] "
        "strides [192, 64, 1]"
    )
    score = torch.zeros(2, 4, DIM, dtype=torch.bfloat16)
    assert kpool.update_unmet(**update_args(slot_score=score)) == (
        "slot_score: expected bf16 [2, 3, 128], unit dim stride, 8-byte aligned "
        "rows, got torch.bfloat16 [2, 4, 128] strides [512, 128, 1]"
    )


# --- expand_unmet ------------------------------------------------------------


def expand_args(**changes):
    args = dict(
        pool_ids=strided((3, 32), (36, 1), torch.int32),
        seq_lens=torch.zeros(3, dtype=torch.int64),
        pool_size=POOL,
        seq_offset=1,
        out=strided((3, 131), (132, 1), torch.int32),
    )
    args.update(changes)
    return args


EXPAND_REFUSED = {
    "pool-2": (dict(pool_size=2), "pool_size"),
    "pool-8": (dict(pool_size=8), "pool_size"),
    "ids-dtype": (dict(pool_ids=torch.zeros(3, 32, dtype=torch.int64)), "pool_ids"),
    "ids-stride0": (
        dict(pool_ids=torch.zeros(3, 1, dtype=torch.int32).expand(3, 32)),
        "pool_ids",
    ),
    "ids-ndim": (dict(pool_ids=torch.zeros(96, dtype=torch.int32)), "pool_ids"),
    "ids-stride": (dict(pool_ids=strided((3, 32), (64, 2), torch.int32)), "pool_ids"),
    "out-none": (dict(out=None), "out"),
    "out-dtype": (dict(out=torch.zeros(3, 132, dtype=torch.int64)), "out"),
    "out-ndim": (dict(out=torch.zeros(3 * 132, dtype=torch.int32)), "out"),
    "out-rows": (dict(out=torch.zeros(4, 132, dtype=torch.int32)), "out"),
    "out-rows-2": (dict(out=torch.zeros(2, 132, dtype=torch.int32)), "out"),
    "out-narrow": (dict(out=strided((3, 130), (132, 1), torch.int32)), "out"),
    "out-stride": (dict(out=strided((3, 131), (264, 2), torch.int32)), "out"),
    "out-row-stride": (dict(out=strided((3, 131), (134, 1), torch.int32)), "out"),
    "out-misaligned": (dict(out=strided((3, 131), (132, 1), torch.int32, 2)), "out"),
    "lens-stride0": (
        dict(seq_lens=torch.zeros(1, dtype=torch.int32).expand(3)),
        "seq_lens",
    ),
    "lens-dtype": (dict(seq_lens=torch.zeros(3, dtype=torch.int16)), "seq_lens"),
    "lens-ndim": (dict(seq_lens=torch.zeros(3, 1, dtype=torch.int32)), "seq_lens"),
    "lens-short": (dict(seq_lens=torch.zeros(2, dtype=torch.int32)), "seq_lens"),
    "lens-stride": (dict(seq_lens=torch.zeros(6, dtype=torch.int32)[::2]), "seq_lens"),
    "offset-high": (dict(seq_offset=2**31), "seq_offset"),
    "offset-low": (dict(seq_offset=-(2**31) - 1), "seq_offset"),
}


def test_expand_rule_takes():
    assert kpool.expand_unmet(**expand_args()) is None
    for changes in (
        dict(seq_offset=2**31 - 1),
        dict(seq_offset=-(2**31)),
        dict(seq_lens=torch.zeros(4, dtype=torch.int32)),
        dict(out=strided((3, 136), (140, 1), torch.int32, 4)),
        dict(
            pool_ids=torch.zeros(3, 0, dtype=torch.int32),
            out=torch.zeros(3, 4, dtype=torch.int32),
        ),
    ):
        assert kpool.expand_unmet(**expand_args(**changes)) is None, changes


@pytest.mark.parametrize("case", EXPAND_REFUSED)
def test_expand_rule_refuses(case):
    changes, argument = EXPAND_REFUSED[case]
    problem = kpool.expand_unmet(**expand_args(**changes))
    assert problem is not None and problem.startswith(f"{argument}: expected "), problem


def test_expand_messages():
    problem = kpool.expand_unmet(**expand_args(out=None))
    assert problem.startswith("out: expected int32 [3, >=131]")
    assert problem.endswith("got None")
    lens = torch.zeros(2, dtype=torch.int32)
    problem = kpool.expand_unmet(**expand_args(seq_lens=lens))
    assert problem.startswith("seq_lens: expected int32/int64 [>=3]")
    assert problem.endswith("got torch.int32 [2] strides [1]")
    assert kpool.expand_unmet(**expand_args(seq_offset=2**31)) == (
        "seq_offset: expected an int32, got 2147483648"
    )


# --- remap: shapes and arguments --------------------------------------------


@pytest.mark.parametrize(
    "width, in_order",
    [(1, True), (128, True), (4096, True), (4224, False), (6144, False), (8192, True)],
)
def test_stock_compacts_in_order(width, in_order):
    assert remap_kernel.stock_compacts_in_order(width) is in_order


@pytest.mark.parametrize(
    "groups, width, pool, counts, argument",
    [
        (32, 256, POOL, True, None),
        (64, 384, POOL, True, None),
        (512, 2176, POOL, True, None),
        (992, 4096, POOL, True, None),
        (1024, 4224, POOL, False, None),
        (1024, 4224, POOL, True, "out"),
        (32, 256, 8, True, "pool_size"),
        (32, 256, 2, True, "pool_size"),
        (0, 128, POOL, True, "pool_ids"),
        (16, 128, POOL, True, "pool_ids"),
        (31, 128, POOL, True, "pool_ids"),
        (48, 256, POOL, True, "pool_ids"),
        (1056, 4352, POOL, False, "pool_ids"),
        (32, 128, POOL, True, "out"),
        (32, 130, POOL, True, "out"),
        (32, 192, POOL, True, "out"),
        (96, 384, POOL, True, "out"),
    ],
)
def test_remap_shape_rule(groups, width, pool, counts, argument):
    problem = kpool.remap_shape_unmet(groups, width, pool, counts)
    if argument is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(f"{argument}: "), problem


def test_remap_shape_messages():
    assert kpool.remap_shape_unmet(48, 256, POOL, True) == (
        "pool_ids: expected a multiple of 32 pools, at most 1024, got 48"
    )
    assert kpool.remap_shape_unmet(32, 130, POOL, True) == (
        "out: expected a width of at least 131 columns, a multiple of 128, got 130"
    )
    assert kpool.remap_shape_unmet(32, 4224, POOL, True) == (
        "out: expected a width the stock conversion with counts compacts in column "
        "order (at most 4096), got 4224"
    )


def remap_args(**changes):
    args = dict(
        pool_ids=strided((3, 32), (40, 1), torch.int32),
        positions=torch.zeros(3, dtype=torch.int64),
        pool_size=POOL,
        req_ids=torch.zeros(3, dtype=torch.int32),
        block_table=strided((2, 8), (12, 1), torch.int32),
        out=torch.zeros(3, 256, dtype=torch.int32),
        counts=torch.zeros(3, dtype=torch.int32),
        block_size=64,
        seq_offset=1,
    )
    args.update(changes)
    return args


REMAP_REFUSED = {
    "ids-dtype": (dict(pool_ids=torch.zeros(3, 32, dtype=torch.int64)), "pool_ids"),
    "ids-stride0": (
        dict(pool_ids=torch.zeros(3, 1, dtype=torch.int32).expand(3, 32)),
        "pool_ids",
    ),
    "ids-ndim": (dict(pool_ids=torch.zeros(96, dtype=torch.int32)), "pool_ids"),
    "ids-stride": (dict(pool_ids=strided((3, 32), (64, 2), torch.int32)), "pool_ids"),
    "ids-rows": (dict(pool_ids=torch.zeros(4, 32, dtype=torch.int32)), "pool_ids"),
    "ids-more-rows": (
        dict(
            pool_ids=torch.zeros(4, 32, dtype=torch.int32),
            positions=torch.zeros(4, dtype=torch.int64),
        ),
        "pool_ids",
    ),
    "ids-3d": (dict(pool_ids=torch.zeros(3, 32, 1, dtype=torch.int32)), "pool_ids"),
    "out-more-rows": (dict(out=torch.zeros(4, 256, dtype=torch.int32)), "out"),
    "counts-0d": (dict(counts=torch.tensor(3, dtype=torch.int32)), "counts"),
    "req-0d": (dict(req_ids=torch.tensor(3, dtype=torch.int32)), "req_ids"),
    "out-3d": (dict(out=torch.zeros(3, 256, 1, dtype=torch.int32)), "out"),
    "table-3d": (
        dict(block_table=torch.zeros(2, 8, 1, dtype=torch.int32)),
        "block_table",
    ),
    "positions-0d": (dict(positions=torch.tensor(3, dtype=torch.int64)), "positions"),
    "req-stride0": (
        dict(req_ids=torch.zeros(1, dtype=torch.int32).expand(3)),
        "req_ids",
    ),
    "req-dtype": (dict(req_ids=torch.zeros(3, dtype=torch.int64)), "req_ids"),
    "req-ndim": (dict(req_ids=torch.zeros(3, 1, dtype=torch.int32)), "req_ids"),
    "req-stride": (dict(req_ids=torch.zeros(6, dtype=torch.int32)[::2]), "req_ids"),
    "out-dtype": (dict(out=torch.zeros(3, 256, dtype=torch.int64)), "out"),
    "out-ndim": (dict(out=torch.zeros(3 * 256, dtype=torch.int32)), "out"),
    "out-1d-rows": (dict(out=torch.zeros(3, dtype=torch.int32)), "out"),
    "out-rows": (dict(out=torch.zeros(2, 256, dtype=torch.int32)), "out"),
    "out-strided": (dict(out=strided((3, 256), (260, 1), torch.int32)), "out"),
    "out-misaligned": (dict(out=strided((3, 256), (256, 1), torch.int32, 2)), "out"),
    "out-shape": (dict(out=torch.zeros(3, 128, dtype=torch.int32)), "out"),
    "block-size-0": (dict(block_size=0), "block_size"),
    "block-size-neg": (dict(block_size=-4), "block_size"),
    "block-size-6": (dict(block_size=6), "block_size"),
    "block-size-2": (dict(block_size=2), "block_size"),
    "counts-stride0": (
        dict(counts=torch.zeros(1, dtype=torch.int32).expand(3)),
        "counts",
    ),
    "counts-dtype": (dict(counts=torch.zeros(3, dtype=torch.int64)), "counts"),
    "counts-ndim": (dict(counts=torch.zeros(3, 1, dtype=torch.int32)), "counts"),
    "counts-short": (dict(counts=torch.zeros(2, dtype=torch.int32)), "counts"),
    "counts-stride": (dict(counts=torch.zeros(6, dtype=torch.int32)[::2]), "counts"),
    "table-stride0": (
        dict(block_table=torch.zeros(2, 1, dtype=torch.int32).expand(2, 8)),
        "block_table",
    ),
    "table-dtype": (
        dict(block_table=torch.zeros(2, 8, dtype=torch.int64)),
        "block_table",
    ),
    "table-ndim": (dict(block_table=torch.zeros(16, dtype=torch.int32)), "block_table"),
    "table-stride": (
        dict(block_table=strided((2, 8), (16, 2), torch.int32)),
        "block_table",
    ),
    "positions-stride0": (
        dict(positions=torch.zeros(1, dtype=torch.int64).expand(3)),
        "positions",
    ),
    "positions-dtype": (dict(positions=torch.zeros(3, dtype=torch.int16)), "positions"),
    "positions-ndim": (
        dict(positions=torch.zeros(3, 1, dtype=torch.int64)),
        "positions",
    ),
    "positions-short": (dict(positions=torch.zeros(2, dtype=torch.int64)), "positions"),
    "positions-stride": (
        dict(positions=torch.zeros(6, dtype=torch.int64)[::2]),
        "positions",
    ),
    "offset-high": (dict(seq_offset=2**31), "seq_offset"),
    "offset-low": (dict(seq_offset=-(2**31) - 1), "seq_offset"),
}


def test_remap_rule_takes():
    assert kpool.remap_unmet(**remap_args()) is None
    for changes in (
        dict(counts=None),
        dict(counts=torch.zeros(5, dtype=torch.int32)),
        dict(positions=torch.zeros(4, dtype=torch.int32)),
        dict(pool_ids=torch.zeros(2, 32, dtype=torch.int32)),
        dict(block_size=4),
        dict(block_size=16),
        dict(seq_offset=2**31 - 1),
        dict(seq_offset=-(2**31)),
    ):
        assert kpool.remap_unmet(**remap_args(**changes)) is None, changes


@pytest.mark.parametrize("case", REMAP_REFUSED)
def test_remap_rule_refuses(case):
    changes, argument = REMAP_REFUSED[case]
    problem = kpool.remap_unmet(**remap_args(**changes))
    assert problem is not None and problem.startswith(f"{argument}: "), problem


def test_remap_messages():
    ids = torch.zeros(4, 32, dtype=torch.int32)
    out = torch.zeros(4, 256, dtype=torch.int32)
    req = torch.zeros(4, dtype=torch.int32)
    args = remap_args(pool_ids=ids, out=out, req_ids=req, counts=None)
    problem = kpool.remap_unmet(**args)
    assert problem.startswith("positions: expected int32/int64 [>=4]"), problem
    assert problem.endswith("got torch.int64 [3] strides [1]")
    ids5 = torch.zeros(5, 32, dtype=torch.int32)
    args = remap_args(pool_ids=ids5, out=out, req_ids=req, counts=None)
    assert kpool.remap_unmet(**args) == "pool_ids: expected at most 4 rows, got 5"
    problem = kpool.remap_unmet(**remap_args(block_size=6))
    assert problem.startswith("block_size: expected") and problem.endswith("got 6")
    counts = torch.zeros(2, dtype=torch.int32)
    problem = kpool.remap_unmet(**remap_args(counts=counts))
    assert problem.startswith("counts: expected int32 [>=3]"), problem


# --- upcast_unmet and its configuration --------------------------------------


def upcast_args(**changes):
    args = dict(
        logits=strided((3, 100), (104, 1), torch.bfloat16),
        row_ends=torch.zeros(3, dtype=torch.int32),
        out=strided((3, 100), (104, 1), torch.float32),
    )
    args.update(changes)
    return args


UPCAST_REFUSED = {
    "dtype": (dict(logits=torch.zeros(3, 104), out=None), "logits"),
    "ndim": (dict(logits=torch.zeros(312, dtype=torch.bfloat16), out=None), "logits"),
    "column-stride": (
        dict(logits=strided((3, 100), (208, 2), torch.bfloat16), out=None),
        "logits",
    ),
    "row-stride": (
        dict(logits=strided((3, 100), (100, 1), torch.bfloat16), out=None),
        "logits",
    ),
    "row-stride-12": (
        dict(logits=strided((3, 12), (12, 1), torch.bfloat16), out=None),
        "logits",
    ),
    "misaligned": (
        dict(logits=strided((3, 100), (104, 1), torch.bfloat16, 4), out=None),
        "logits",
    ),
    "column-stride0": (
        dict(logits=torch.zeros(3, 1, dtype=torch.bfloat16).expand(3, 104), out=None),
        "logits",
    ),
    "ends-stride0": (
        dict(row_ends=torch.zeros(1, dtype=torch.int32).expand(3)),
        "row_ends",
    ),
    "ends-dtype": (dict(row_ends=torch.zeros(3, dtype=torch.int64)), "row_ends"),
    "ends-ndim": (dict(row_ends=torch.zeros(3, 1, dtype=torch.int32)), "row_ends"),
    "ends-rows": (dict(row_ends=torch.zeros(4, dtype=torch.int32)), "row_ends"),
    "ends-stride": (dict(row_ends=torch.zeros(6, dtype=torch.int32)[::2]), "row_ends"),
    "out-dtype": (dict(out=strided((3, 100), (104, 1), torch.bfloat16)), "out"),
    "out-shape": (dict(out=strided((3, 96), (104, 1), torch.float32)), "out"),
    "out-strides": (dict(out=strided((3, 100), (112, 1), torch.float32)), "out"),
    "out-misaligned": (dict(out=strided((3, 100), (104, 1), torch.float32, 2)), "out"),
}


def test_upcast_rule_takes():
    assert kpool.upcast_unmet(**upcast_args()) is None
    assert kpool.upcast_unmet(**upcast_args(out=None)) is None
    logits = strided((3, 100), (104, 1), torch.bfloat16, 8)
    out = strided((3, 100), (104, 1), torch.float32, 4)
    assert kpool.upcast_unmet(logits, torch.zeros(3, dtype=torch.int32), out) is None


@pytest.mark.parametrize("case", UPCAST_REFUSED)
def test_upcast_rule_refuses(case):
    changes, argument = UPCAST_REFUSED[case]
    problem = kpool.upcast_unmet(**upcast_args(**changes))
    assert problem is not None and problem.startswith(f"{argument}: expected "), problem


def test_upcast_config():
    """The launch built once at import is the one upcast_config picks for
    every shape."""
    picked = {
        upcast_kernel.upcast_config(rows, width)
        for rows in (1, 3, 256, 4096)
        for width in (8, 1000, 1 << 16)
    }
    assert picked == {kpool.UPCAST_LAUNCH[1]}
    assert kpool.UPCAST_LAUNCH[0] == kpool.UpcastLogitsKernel.CompileKey()


# --- launch.py --------------------------------------------------------------


@pytest.fixture
def fresh(monkeypatch):
    """No warmup yet, empty caches; compiles recorded, not run."""
    compiled = []

    def compile_fake(self, compile_key):
        compiled.append(compile_key)
        self._compiled_cache[compile_key] = Executor()

    from vllm.model_executor.warmup.jit_warmup_cutedsl_helper import (
        VllmCuTeDSLJitKernel,
    )

    monkeypatch.setattr(VllmCuTeDSLJitKernel, "compile", compile_fake)
    monkeypatch.setattr(launch, "_warmed_up", False)
    monkeypatch.setattr(launch, "_warmups_running", 0)
    for kernel in (kpool.UPDATE, kpool.EXPAND, kpool.REMAP, kpool.UPCAST):
        monkeypatch.setattr(kernel, "_compiled_cache", {})
    return compiled


class Executor:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def test_mismatch_and_layout():
    assert launch.mismatch("x", "y", 3) == "x: expected y, got 3"
    t = torch.zeros(2, 6, dtype=torch.int32)[:, ::2]
    assert launch.layout(t) == "torch.int32 [2, 3] strides [6, 2]"


def test_compile_scoping(fresh, monkeypatch):
    """Lazily before any warmup; inside warmups; never after one or while a
    CUDA graph is being captured."""
    assert launch._compiles_allowed()
    key = kpool.EXPAND.key(32, torch.int32)
    kpool.EXPAND.compile(key)
    kpool.EXPAND.compile(key)  # cached: compiled once
    assert fresh == [key]
    with launch.warming_up():
        with launch.warming_up():
            assert launch._warmups_running == 2
        assert launch._compiles_allowed()
    assert launch._warmups_running == 0 and launch._warmed_up
    assert not launch._compiles_allowed()
    other = kpool.EXPAND.key(64, torch.int32)
    with pytest.raises(RuntimeError, match="was not compiled during warmup"):
        kpool.EXPAND.compile(other)
    with pytest.raises(RuntimeError, match="not compiled during warmup"):
        kpool.EXPAND.run(other, 1, 2)
    assert not kpool.EXPAND.ready(other) and kpool.EXPAND.ready(key)
    with pytest.raises(ZeroDivisionError), launch.warming_up():
        1 / 0  # noqa: B018
    launch._compiles_allowed()
    assert launch._warmups_running == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with launch.warming_up():
        assert not launch._compiles_allowed()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with launch.warming_up():
        assert launch._compiles_allowed()


def test_run_launches_the_keys_executor(fresh):
    key = kpool.EXPAND.key(32, torch.int64)
    assert kpool.EXPAND.key(32, torch.int64) is key
    assert key == kpool.ExpandPoolsKernel.CompileKey(32, torch.int64)
    assert kpool.EXPAND.get_warmup_keys([key, key]) == [key, key]
    assert kpool.EXPAND.get_warmup_keys() == []
    kpool.EXPAND.run(key, "a", 1)  # compiled lazily (before any warmup)
    assert fresh == [key]
    kpool.EXPAND.run(key, "b")
    assert kpool.EXPAND._compiled_cache[key].calls == [("a", 1), ("b",)]
    assert fresh == [key]


# --- The public functions: key and arguments to the executor ---------------


def test_kpool_update_launch(fresh):
    args = update_args()
    del args["head_dim"], args["pool_size"]
    tensors = tuple(args.values())
    kpool.kpool_update(*tensors, POOL, mx_scales=False, round_scale=False)
    [key] = fresh
    assert key == kpool.KpoolUpdateKernel.CompileKey(
        8,
        16,
        16 * 132 + 4,
        2 * 1028 + 4,
        1028,
        False,
        False,
        torch.int64,
        torch.int32,
        torch.int32,
    )
    [call] = kpool.UPDATE._compiled_cache[key].calls
    assert all(a is b for a, b in zip(call, tensors, strict=True))
    kpool.kpool_update(*tensors, POOL)
    assert fresh[1].mx_scales and fresh[1].round_scale
    with pytest.raises(ValueError, match="pool_size: expected 4, got 8"):
        kpool.kpool_update(*tensors, 8)
    empty = dict(args)
    for name in ("key", "slot_score"):
        empty[name] = torch.zeros(0, 3, DIM, dtype=torch.bfloat16)
    kpool.kpool_update(*empty.values(), 8)  # an empty batch: not even checked
    for name in ("key", "slot_score"):
        empty[name] = torch.zeros(2, 0, DIM, dtype=torch.bfloat16)
    kpool.kpool_update(*empty.values(), 8)
    flat = dict(empty, key=torch.zeros(0, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="^key: expected"):
        kpool.kpool_update(*flat.values(), POOL)  # 1-D: not a batch at all
    flat = dict(empty, key=torch.zeros(0, DIM, dtype=torch.bfloat16))
    kpool.kpool_update(*flat.values(), POOL)  # 2-D and empty: nothing to do
    assert len(fresh) == 2


def test_expand_pools_launch(fresh):
    args = expand_args()
    out = kpool.expand_pools(
        args["pool_ids"], args["seq_lens"], POOL, seq_offset=5, out=args["out"]
    )
    assert out is args["out"]
    [key] = fresh
    assert key == kpool.ExpandPoolsKernel.CompileKey(32, torch.int64)
    [call] = kpool.EXPAND._compiled_cache[key].calls
    assert call[:3] == (args["pool_ids"], args["seq_lens"], args["out"])
    assert call[3] == 5
    with pytest.raises(ValueError, match="^out: expected"):
        kpool.expand_pools(args["pool_ids"], args["seq_lens"], POOL, out=None)
    kpool.expand_pools(args["pool_ids"], args["seq_lens"], POOL, out=args["out"])
    assert kpool.EXPAND._compiled_cache[key].calls[1][3] == 0  # the default
    none = torch.zeros(0, 32, dtype=torch.int32)
    empty = torch.zeros(0, 132, dtype=torch.int32)
    assert kpool.expand_pools(none, args["seq_lens"], POOL, out=empty) is empty
    assert len(fresh) == 1


def test_expand_and_remap_launch(fresh):
    args = remap_args()
    kpool.expand_and_remap(
        args["pool_ids"],
        args["positions"],
        POOL,
        args["req_ids"],
        args["block_table"],
        args["out"],
        args["counts"],
        block_size=64,
        stride_rows=96,
        seq_offset=3,
    )
    [key] = fresh
    assert key == kpool.ExpandRemapKernel.CompileKey(32, 256, 64, 96, torch.int64, True)
    [call] = kpool.REMAP._compiled_cache[key].calls
    expected = ("pool_ids", "positions", "req_ids", "block_table", "out", "counts")
    assert all(a is args[n] for a, n in zip(call, expected, strict=False))
    assert call[6] == 3
    kpool.expand_and_remap(
        args["pool_ids"],
        args["positions"],
        POOL,
        args["req_ids"],
        args["block_table"],
        args["out"],
        block_size=64,
        stride_rows=64,
    )
    assert fresh[1] == kpool.ExpandRemapKernel.CompileKey(
        32, 256, 64, 64, torch.int64, False
    )
    assert kpool.REMAP._compiled_cache[fresh[1]].calls[0][6] == 1
    with pytest.raises(ValueError, match="^block_size: expected"):
        kpool.expand_and_remap(
            args["pool_ids"],
            args["positions"],
            POOL,
            args["req_ids"],
            args["block_table"],
            args["out"],
            block_size=6,
            stride_rows=6,
        )
    none = torch.zeros(0, dtype=torch.int32)
    kpool.expand_and_remap(
        torch.zeros(0, 32, dtype=torch.int32),
        args["positions"],
        POOL,
        none,
        args["block_table"],
        torch.zeros(0, 256, dtype=torch.int32),
        block_size=64,
        stride_rows=64,
    )
    assert len(fresh) == 2


def test_upcast_logits_launch(fresh):
    args = upcast_args()
    out = kpool.upcast_logits(args["logits"], args["row_ends"], out=args["out"])
    assert out is args["out"]
    [key] = fresh
    assert key == kpool.UpcastLogitsKernel.CompileKey()
    [call] = kpool.UPCAST._compiled_cache[key].calls
    assert call[:3] == (args["logits"], args["out"], args["row_ends"])
    assert list(call[3:]) == [upcast_kernel.upcast_config(3, 100)]
    made = kpool.upcast_logits(args["logits"], args["row_ends"])
    assert made.dtype == torch.float32 and made.shape == (3, 100)
    assert made.stride() == (104, 1)
    with pytest.raises(ValueError, match="^row_ends: expected"):
        kpool.upcast_logits(args["logits"], torch.zeros(3, dtype=torch.int64))
    empty = torch.zeros(0, 8, dtype=torch.bfloat16)
    made = kpool.upcast_logits(empty, torch.zeros(0, dtype=torch.int32))
    assert made.shape == (0, 8) and made.dtype == torch.float32
    assert len(fresh) == 1


def test_no_warmup_is_running_between_tests():
    """The warmup counter is back to zero whenever none runs (also after one
    raised): a process not inside a warmup refuses compiles after its first."""
    launch._compiles_allowed()
    assert launch._warmups_running == 0
