# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Each kernel's rule, written once (``*_unmet``): the public functions raise
what it answers as a ValueError naming the argument, before anything is
launched; empty batches launch nothing; the README's guard table is what the
rules answer (``tools/guard_table.py``). (Routing of the inputs a rule refuses
to stock: tests/models/glm5next/test_kpool_routing.py and, on the GPU,
test_guard_edges.py.) Runs on the CPU: no kernel is reached."""

from pathlib import Path

import pytest
import torch

from tools import guard_table
from vllm.models.glm5next.nvidia.specialized_decode import kpool

README = Path(__file__).resolve().parents[4] / "README.md"


def test_readme_guard_table_is_the_rules():
    assert guard_table.readme_table(README) == guard_table.markdown(), (
        "README.md's guard table differs from the rules: paste the output of "
        "`python tools/guard_table.py` between its guard-table markers"
    )


DIM, POOL = 128, 4


def update_args(requests=2, tokens=2, ring=8, page=16):
    return dict(
        kv_cache=torch.zeros(4, page, DIM + 4, dtype=torch.uint8),
        tail_kv_cache=torch.zeros(requests + 1, 2, ring, DIM, dtype=torch.bfloat16),
        tail_slot_mapping=torch.zeros(requests, tokens, dtype=torch.int64),
        key=torch.zeros(requests, tokens, DIM, dtype=torch.bfloat16),
        slot_score=torch.zeros(requests, tokens, DIM, dtype=torch.bfloat16),
        ape=torch.zeros(POOL, DIM),
        slot_mapping=torch.zeros(requests, tokens, dtype=torch.int64),
        positions=torch.zeros(requests, tokens, dtype=torch.int32),
        pool_size=POOL,
    )


UPDATE_CASES = {
    "pool_size": dict(pool_size=8),
    "kv_cache": dict(kv_cache=torch.zeros(4, 16, DIM + 4, dtype=torch.float32)),
    "tail_kv_cache": dict(
        tail_kv_cache=torch.zeros(3, 2, 6, DIM, dtype=torch.bfloat16)
    ),
    "key": dict(key=torch.zeros(2, 2, 64, dtype=torch.bfloat16)),
    "slot_score": dict(slot_score=torch.zeros(2, 2, DIM, dtype=torch.float16)),
    "ape": dict(ape=torch.zeros(DIM, POOL).t()),
    "slot_mapping": dict(slot_mapping=torch.zeros(2, 2, dtype=torch.float32)),
    "positions": dict(positions=torch.zeros(2, 4, dtype=torch.int32)[:, ::2]),
    "tail_slot_mapping": dict(tail_slot_mapping=torch.zeros(3, 2, dtype=torch.int64)),
}


@pytest.mark.parametrize("argument", UPDATE_CASES)
def test_kpool_update_names_bad_argument(argument):
    args = update_args() | UPDATE_CASES[argument]
    with pytest.raises(ValueError, match=rf"^{argument}: expected"):
        kpool.kpool_update(**args)


def test_kpool_update_names_misaligned_argument():
    key = torch.zeros(2 * 2 * DIM + 1, dtype=torch.bfloat16)[1:].view(2, 2, DIM)
    with pytest.raises(ValueError, match=r"^key: expected .*8-byte aligned"):
        kpool.kpool_update(**update_args() | dict(key=key))


def test_kpool_update_empty_batch_launches_nothing():
    args = update_args(requests=0)
    kpool.kpool_update(**args)  # would fail to launch on the CPU
    kpool.kpool_update(**update_args(tokens=0))


EXPAND_CASES = {
    "pool_size": dict(pool_size=2),
    "pool_ids": dict(pool_ids=torch.zeros(2, 32, dtype=torch.int64)),
    "out": dict(out=torch.zeros(2, 100, dtype=torch.int32)),
    "seq_lens": dict(seq_lens=torch.zeros(2, 2, dtype=torch.int32)[:, 0]),
}


@pytest.mark.parametrize("argument", EXPAND_CASES)
def test_expand_pools_names_bad_argument(argument):
    args = (
        dict(
            pool_ids=torch.zeros(2, 32, dtype=torch.int32),
            seq_lens=torch.zeros(2, dtype=torch.int32),
            pool_size=POOL,
            out=torch.zeros(2, 132, dtype=torch.int32),
        )
        | EXPAND_CASES[argument]
    )
    pool_ids, seq_lens, pool_size = (
        args.pop(k) for k in ("pool_ids", "seq_lens", "pool_size")
    )
    with pytest.raises(ValueError, match=rf"^{argument}: expected"):
        kpool.expand_pools(pool_ids, seq_lens, pool_size, **args)


def test_expand_pools_misaligned_out():
    buffer = torch.zeros(2 * 136 + 1, dtype=torch.int32)
    out = buffer[1:].view(2, 136)  # rows 4-byte, not 16-byte, aligned
    with pytest.raises(ValueError, match=r"^out: expected .*16-byte aligned"):
        ids = torch.zeros(2, 32, dtype=torch.int32)
        kpool.expand_pools(ids, torch.zeros(2, dtype=torch.int32), POOL, out=out)


def test_expand_pools_empty_batch_launches_nothing():
    ids, lens = torch.zeros(0, 32, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    out = torch.zeros(0, 132, dtype=torch.int32)
    assert kpool.expand_pools(ids, lens, POOL, out=out) is out  # no CPU launch


REMAP_CASES = {
    "pool_ids": dict(pool_ids=torch.zeros(2, 48, dtype=torch.int32)),
    "block_size": dict(block_size=6),
    "out": dict(out=torch.zeros(2, 4224, dtype=torch.int32)),  # stock races here
    "req_ids": dict(req_ids=torch.zeros(2, dtype=torch.int64)),
    "counts": dict(counts=torch.zeros(1, dtype=torch.int32)),
    "block_table": dict(block_table=torch.zeros(2, 8, dtype=torch.int64)),
    "positions": dict(positions=torch.zeros(2, dtype=torch.float32)),
}


@pytest.mark.parametrize("argument", REMAP_CASES)
def test_expand_and_remap_names_bad_argument(argument):
    args = (
        dict(
            pool_ids=torch.zeros(2, 512, dtype=torch.int32),
            positions=torch.zeros(2, dtype=torch.int64),
            pool_size=POOL,
            req_ids=torch.zeros(2, dtype=torch.int32),
            block_table=torch.zeros(2, 8, dtype=torch.int32),
            out=torch.zeros(2, 2176, dtype=torch.int32),
            counts=torch.zeros(3, dtype=torch.int32),
            block_size=64,
            stride_rows=64,
        )
        | REMAP_CASES[argument]
    )
    with pytest.raises(ValueError, match=rf"^{argument}: expected"):
        kpool.expand_and_remap(**args)


UPCAST_CASES = {
    "logits": torch.zeros(2, 12, dtype=torch.bfloat16)[:, :10],  # stride 12
    "row_ends": torch.zeros(2, dtype=torch.int64),
}


@pytest.mark.parametrize("argument", UPCAST_CASES)
def test_upcast_logits_names_bad_argument(argument):
    logits = torch.zeros(2, 16, dtype=torch.bfloat16)
    ends = torch.zeros(2, dtype=torch.int32)
    if argument == "logits":
        logits = UPCAST_CASES[argument]
    else:
        ends = UPCAST_CASES[argument]
    with pytest.raises(ValueError, match=rf"^{argument}: expected"):
        kpool.upcast_logits(logits, ends)


def test_upcast_logits_empty_launches_nothing():
    out = kpool.upcast_logits(
        torch.zeros(0, 16, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.int32)
    )
    assert out.shape == (0, 16) and out.dtype == torch.float32
