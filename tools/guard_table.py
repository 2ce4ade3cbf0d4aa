# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The README's guard table, from the kernels' own rules.

Each kernel's rule (``*_unmet`` in ``specialized_decode/*_kernel.py``) is
asked about canonical GLM-5-Next arguments with one requirement broken at a
time; each row is what the rule answers. ``KpoolStage`` sends any such input
to the stock function, and the public function raises the same message.

    python tools/guard_table.py          # print the table (markdown)

``tests/models/glm5next/specialized_decode/test_kernel_guards.py`` checks the
README's table against this output. Runs where vLLM imports (CPU is fine).
"""

import sys
from pathlib import Path

import torch

DIM, POOL = 128, 4
BEGIN, END = "<!-- guard-table -->", "<!-- /guard-table -->"


def update_args(**changes):
    i64 = dict(dtype=torch.int64)
    args = dict(
        kv_cache=torch.zeros(4, 16, DIM + 4, dtype=torch.uint8),
        tail_kv_cache=torch.zeros(3, 2, 8, DIM, dtype=torch.bfloat16),
        tail_slot_mapping=torch.zeros(2, 2, **i64),
        key=torch.zeros(2, 2, DIM, dtype=torch.bfloat16),
        slot_score=torch.zeros(2, 2, DIM, dtype=torch.bfloat16),
        ape=torch.zeros(POOL, DIM),
        slot_mapping=torch.zeros(2, 2, **i64),
        positions=torch.zeros(2, 2, dtype=torch.int32),
        pool_size=POOL,
    )
    return args | changes


def expand_args(**changes):
    args = dict(
        pool_ids=torch.zeros(2, 512, dtype=torch.int32),
        seq_lens=torch.zeros(2, dtype=torch.int64),
        pool_size=POOL,
        seq_offset=1,
        out=torch.zeros(2, 2176, dtype=torch.int32),
    )
    return args | changes


def remap_args(**changes):
    args = dict(
        pool_ids=torch.zeros(2, 512, dtype=torch.int32),
        positions=torch.zeros(2, dtype=torch.int64),
        pool_size=POOL,
        req_ids=torch.zeros(2, dtype=torch.int32),
        block_table=torch.zeros(2, 8, dtype=torch.int32),
        out=torch.zeros(2, 2176, dtype=torch.int32),
        counts=torch.zeros(3, dtype=torch.int32),
        block_size=64,
        seq_offset=1,
    )
    return args | changes


def upcast_args(**changes):
    args = dict(
        logits=torch.zeros(2, 16, dtype=torch.bfloat16),
        row_ends=torch.zeros(2, dtype=torch.int32),
    )
    return args | changes


def _misaligned(shape, dtype, by=1):
    """A tensor of ``shape`` whose data starts ``by`` elements off alignment."""
    n = torch.Size(shape).numel()
    return torch.zeros(n + by, dtype=dtype)[by:].view(shape)


def _cases():
    """(entry point, rule, arguments, broken argument) of each row."""
    from vllm.models.glm5next.nvidia.specialized_decode import (
        expand_kernel,
        remap_kernel,
        upcast_kernel,
        update_kernel,
    )

    bf16, i32 = torch.bfloat16, torch.int32
    update = ("KpoolStage.update", update_kernel.update_unmet)
    yield *update, update_args(pool_size=8), "pool_size"
    yield *update, update_args(kv_cache=torch.zeros(4, 16, 132)), "kv_cache"
    tail = torch.zeros(3, 2, 6, DIM, dtype=bf16)
    yield *update, update_args(tail_kv_cache=tail), "tail_kv_cache"
    yield *update, update_args(key=torch.zeros(2, 2, 64, dtype=bf16)), "key"
    key = _misaligned((2, 2, DIM), bf16)
    yield *update, update_args(key=key, slot_score=key), "key"
    score = torch.zeros(2, 2, DIM, dtype=torch.float16)
    yield *update, update_args(slot_score=score), "slot_score"
    yield *update, update_args(ape=torch.zeros(DIM, POOL).t()), "ape"
    ints = torch.zeros(2, 2, dtype=torch.float32)
    yield *update, update_args(tail_slot_mapping=ints), "tail_slot_mapping"
    yield *update, update_args(slot_mapping=ints), "slot_mapping"
    strided = torch.zeros(2, 4, dtype=i32)[:, ::2]
    yield *update, update_args(positions=strided), "positions"

    expand = ("KpoolStage.expand", expand_kernel.expand_unmet)
    yield *expand, expand_args(pool_size=2), "pool_size"
    ids = torch.zeros(2, 512, dtype=torch.int64)
    yield *expand, expand_args(pool_ids=ids), "pool_ids"
    yield *expand, expand_args(out=None), "out"
    yield *expand, expand_args(out=_misaligned((2, 2176), i32)), "out"
    yield *expand, expand_args(seq_lens=torch.zeros(2, 2, dtype=i32)[:, 0]), "seq_lens"
    yield *expand, expand_args(seq_offset=2**31), "seq_offset"

    remap = ("FusedRemap (expand_and_remap)", remap_kernel.remap_unmet)
    ids = torch.zeros(2, 512, dtype=torch.int64)
    yield *remap, remap_args(pool_ids=ids), "pool_ids"
    yield *remap, remap_args(req_ids=torch.zeros(2, 1, dtype=i32)), "req_ids"
    yield *remap, remap_args(out=_misaligned((2, 2176), i32)), "out"
    yield *remap, remap_args(pool_size=8), "pool_size"
    yield *remap, remap_args(pool_ids=torch.zeros(2, 48, dtype=i32)), "pool_ids"
    yield *remap, remap_args(out=torch.zeros(2, 2100, dtype=i32)), "out"
    # Wider rows with counts compact through racing atomics in stock.
    yield (
        *remap,
        remap_args(
            pool_ids=torch.zeros(2, 1024, dtype=i32),
            out=torch.zeros(2, 4224, dtype=i32),
        ),
        "out",
    )
    yield *remap, remap_args(block_size=6), "block_size"
    yield *remap, remap_args(counts=torch.zeros(1, dtype=i32)), "counts"
    table = torch.zeros(2, 8, dtype=torch.int64)
    yield *remap, remap_args(block_table=table), "block_table"
    yield *remap, remap_args(pool_ids=torch.zeros(3, 512, dtype=i32)), "pool_ids"
    positions = torch.zeros(2, dtype=torch.float32)
    yield *remap, remap_args(positions=positions), "positions"
    yield *remap, remap_args(seq_offset=-(2**31) - 1), "seq_offset"

    upcast = ("KpoolStage.upcast", upcast_kernel.upcast_unmet)
    logits = torch.zeros(2, 12, dtype=bf16)[:, :10]
    yield *upcast, upcast_args(logits=logits), "logits"
    yield *upcast, upcast_args(row_ends=torch.zeros(2, dtype=torch.int64)), "row_ends"


def rows() -> list[tuple[str, str, str]]:
    """(entry point, argument, expected) of each guard, in rule order."""
    table = []
    for entry, rule, args, argument in _cases():
        message = rule(**args)
        assert message is not None, (entry, argument, "the rule took it")
        named, _, rest = message.partition(": expected ")
        assert named == argument, (entry, argument, message)
        expected = rest.rsplit(", got ", 1)[0]
        if (entry, argument, expected) not in table:
            table.append((entry, argument, expected))
    return table


def markdown() -> str:
    lines = ["| entry point | argument | the kernel takes |", "| --- | --- | --- |"]
    lines += [f"| `{e}` | `{a}` | {x} |" for e, a, x in rows()]
    return "\n".join(lines)


def readme_table(readme: Path) -> str:
    text = readme.read_text()
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(markdown())
