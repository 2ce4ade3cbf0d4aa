# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The specialized decode tail of a planned step as a CUDA graph: the tail
update (``kpool_update``), the upcast of BF16 logits (``UPCAST``), the
decode expansion (``EXPAND``, ``int32_lengths``) and the fused remap of the
pool top-k (``REMAP``, ``int32_lengths``, with counts), as the stage launches
them, captured once per planned batch size and replayed with fresh inputs
copied into its static buffers. Every replay is compared, every byte of
every buffer the tail may write (rows past the outputs included), with
stock's decode run eagerly on the same inputs: the FP8 cache, the tail ring,
the FP32 logits below the row ends, the logical rows
(``expand_pools_and_append_tail(pool_ids.to(torch.int64),
positions.to(torch.int32) + 1, 4)``), the physical top-k and counts."""

import pytest
import torch
from kpool_fuzz import differs, fuzz_cases, fuzz_seed, report

from vllm.models.glm5next.nvidia.specialized_decode import cases, kpool
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.expand.launch import (
    EXPAND,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.remap.launch import (
    REMAP,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.upcast.launch import (
    UPCAST,
)

pytestmark = pytest.mark.gpu

DIM, POOL, RING, PAGE, GROUPS, WIDTH, BLOCK = 128, 4, 4, 64, 512, 2176, 64
COLS = GROUPS * POOL + POOL - 1
# The logits' width in pools, and their row pitch (DeepGEMM's: 16 bytes).
POOLS, PITCH = 4000, 4008
# (requests, tokens per request): decode and MTP verify steps.
PLANS = [(1, 1), (8, 1), (64, 1), (256, 1), (16, 4), (64, 2)]
I32, I64 = torch.int32, torch.int64


class Step:
    """Static buffers of one captured step, a refill with fresh inputs, the
    specialized tail and stock's."""

    def __init__(self, requests, tokens, gen):
        device = gen.device
        self.requests, self.tokens, rows = requests, tokens, requests * tokens
        self.rows = rows

        def empty(*shape, dtype=I32):
            return torch.empty(shape, dtype=dtype, device=device)

        self.pages = rows // PAGE + 4
        self.kv = empty(self.pages, PAGE, DIM + 4, dtype=torch.uint8)
        self.tail = empty(requests + 1, 2, RING, DIM, dtype=torch.bfloat16)
        self.tail_slots = empty(requests, tokens, dtype=I64)
        self.slots = empty(requests, tokens, dtype=I64)
        self.positions = empty(requests, tokens)
        self.key = empty(requests, tokens, DIM, dtype=torch.bfloat16)
        self.score = torch.empty_like(self.key)
        self.ape = empty(POOL, DIM, dtype=torch.float32)
        self.logits = empty(rows, PITCH, dtype=torch.bfloat16)
        self.ends = empty(rows)
        self.pool_ids = empty(rows, GROUPS)
        self.row_positions = empty(rows, dtype=I64)
        self.req_ids = empty(rows)
        self.block_table = empty(requests, 600)
        # The outputs, rows and columns past them included, and the random
        # bytes each replay starts from.
        self.outputs = [
            cases.poisoned((rows, PITCH), torch.float32, gen),  # FP32 logits
            cases.poisoned((rows + 1, WIDTH), I32, gen),  # logical rows
            cases.poisoned((rows + 1, WIDTH), I32, gen),  # physical rows
            cases.poisoned((rows + 1,), I32, gen),  # counts
        ]
        self.poison = [b.clone() for b in self.outputs]

    def refill(self, gen):
        r, t, device = self.requests, self.tokens, gen.device
        g = dict(generator=gen, device=device)
        self.kv.copy_(torch.randint(0, 256, self.kv.shape, dtype=torch.uint8, **g))
        self.tail.copy_(torch.randn(self.tail.shape, **g))
        start = torch.randint(0, 600 * BLOCK - 8, (r, 1), **g)
        pos = start + torch.arange(t, device=device)
        pos[torch.rand(r, **g) < 0.05] = -1  # padding requests
        self.positions.copy_(pos)
        block = 1 + torch.randperm(r, **g)[:, None]
        self.tail_slots.copy_(torch.where(pos >= 0, block * RING + pos % RING, -1))
        free = torch.randperm(self.pages * PAGE, **g)[: r * t].view(r, t)
        self.slots.copy_(torch.where((pos >= 0) & (pos % POOL == POOL - 1), free, -1))
        self.key.copy_(torch.randn(self.key.shape, **g))
        self.score.copy_(torch.randn(self.score.shape, **g))
        self.ape.copy_(torch.randn(POOL, DIM, **g))
        logits = torch.randn(self.logits.shape, **g).bfloat16()
        self.logits.copy_(cases.specials(logits, 0.01, gen))
        self.ends.copy_(torch.randint(0, POOLS + 1, (self.rows,), **g))
        ids = torch.randint(0, 600 * BLOCK // POOL + 64, self.pool_ids.shape, **g)
        ids[torch.rand(ids.shape, **g) < 0.1] = -1
        self.pool_ids.copy_(ids)
        self.row_positions.copy_(pos.reshape(-1))
        self.req_ids.copy_(torch.arange(r, device=device).repeat_interleave(t))
        self.block_table.copy_(torch.randint(0, 1 << 20, self.block_table.shape, **g))
        for output, poison in zip(self.outputs, self.poison, strict=True):
            output.copy_(poison)

    def specialized(self, mx: bool) -> None:
        """The stage's launches of a planned step (the public launches: the
        warmup's compile on first use, outside the capture)."""
        rows = self.rows
        upcast, logical, physical, counts = self.outputs
        kpool.kpool_update(
            self.kv,
            self.tail,
            self.tail_slots,
            self.key,
            self.score,
            self.ape,
            self.slots,
            self.positions,
            POOL,
            mx_scales=mx,
        )
        UPCAST(logits=self.logits[:, :POOLS], row_ends=self.ends, out=upcast[:, :POOLS])
        ids, positions = self.pool_ids, self.row_positions
        EXPAND(
            pool_ids=ids,
            seq_lens=positions,
            pool_size=POOL,
            seq_offset=1,
            out=logical[:rows],
            int32_lengths=True,
        )
        REMAP(
            pool_ids=ids,
            positions=positions,
            pool_size=POOL,
            req_ids=self.req_ids,
            block_table=self.block_table,
            out=physical[:rows],
            counts=counts[:rows],
            block_size=BLOCK,
            stride_rows=BLOCK,
            seq_offset=1,
            int32_lengths=True,
        )

    def stock(self, mx: bool, monkeypatch) -> list[torch.Tensor]:
        """Stock's decode on copies of the step's state: every buffer the
        tail writes, whole."""
        from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
        from vllm.models.glm5next.nvidia.ops import kpool_compress
        from vllm.v1.attention.backends.mla.sparse_utils import (
            triton_convert_req_index_to_global_index,
        )

        monkeypatch.setattr(kpool_compress, "mqa_logits_use_mx_scales", lambda: mx)
        kv, tail = self.kv.clone(), self.tail.clone()
        kpool_compress.kpool_decode_update_and_maybe_write_cache_batched(
            kv,
            tail,
            self.tail_slots,
            self.key,
            self.score,
            self.ape,
            self.slots,
            self.positions,
            POOL,
            DIM,
        )
        rows = self.rows
        upcast, logical, physical, counts = (b.clone() for b in self.poison)
        stock = as_fp32_logits(self.logits[:, :POOLS], self.ends)
        below = torch.arange(POOLS, device=kv.device)[None, :] < self.ends[:, None]
        upcast[:, :POOLS][below] = stock[below]  # only what stock wrote
        logical[:rows, :COLS] = kpool_compress.expand_pools_and_append_tail(
            self.pool_ids.to(I64), self.row_positions.to(I32) + 1, POOL
        )
        rows_of = torch.full((rows, WIDTH), -1, dtype=I32, device=kv.device)
        rows_of[:, :COLS] = logical[:rows, :COLS]
        out, valid = triton_convert_req_index_to_global_index(
            self.req_ids,
            self.block_table,
            rows_of,
            BLOCK_SIZE=BLOCK,
            NUM_TOPK_TOKENS=WIDTH,
            return_valid_counts=True,
        )
        physical[:rows], counts[:rows] = out, valid
        return [kv, tail, upcast, logical, physical, counts]


def test_decode_tail_graph_replays_match_stock(monkeypatch):
    seed, replays = fuzz_seed(), fuzz_cases(1000)
    device = torch.device("cuda")
    mx = torch.cuda.get_device_capability()[0] == 10
    gen = torch.Generator(device).manual_seed(seed)
    failures, total = [], 0
    for requests, tokens in PLANS:
        step = Step(requests, tokens, gen)
        step.refill(gen)
        capture = torch.cuda.Stream(device)
        capture.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(capture):
            step.specialized(mx)  # compiles outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=capture):
                step.specialized(mx)
        for i in range(replays):
            step.refill(gen)
            expected = step.stock(mx, monkeypatch)
            graph.replay()
            torch.cuda.synchronize()
            total += 1
            written = [step.kv, step.tail, *step.outputs]
            problem = differs(expected, written)
            if problem:
                failures.append(f"{requests}x{tokens} replay {i}: {problem}")
    report("decode tail graph replays", total, seed, failures)
