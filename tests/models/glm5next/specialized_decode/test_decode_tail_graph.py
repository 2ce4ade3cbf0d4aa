# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The specialized decode tail of a planned step (``kpool_update``, then the
fused remap of the deferred pool top-k: ``RemapArgs(..., int32_lengths=True)``
as ``FusedRemap`` launches it) captured once per planned batch size and
replayed with fresh inputs copied into its static buffers; every replay byte
for byte against stock's decode run eagerly on the same inputs (caches, tail
ring, physical top-k, counts)."""

import pytest
import torch
from kpool_fuzz import fuzz_cases, fuzz_seed, report

pytestmark = pytest.mark.gpu

DIM, POOL, RING, PAGE, GROUPS, WIDTH, BLOCK = 128, 4, 4, 64, 512, 2176, 64
# (requests, tokens per request): decode and MTP verify steps.
PLANS = [(1, 1), (8, 1), (64, 1), (256, 1), (16, 4), (64, 2)]


class Step:
    """Static buffers of one captured step and a refill with fresh inputs."""

    def __init__(self, requests, tokens, device):
        self.requests, self.tokens, rows = requests, tokens, requests * tokens
        self.rows, self.device = rows, device
        self.pages = rows // PAGE + 4
        self.kv = torch.empty(
            self.pages, PAGE, DIM + 4, dtype=torch.uint8, device=device
        )
        self.tail = torch.empty(
            requests + 1, 2, RING, DIM, dtype=torch.bfloat16, device=device
        )
        self.tail_slots = torch.empty(
            requests, tokens, dtype=torch.int64, device=device
        )
        self.slots = torch.empty_like(self.tail_slots)
        self.positions = torch.empty(requests, tokens, dtype=torch.int32, device=device)
        self.key = torch.empty(
            requests, tokens, DIM, dtype=torch.bfloat16, device=device
        )
        self.score = torch.empty_like(self.key)
        self.ape = torch.empty(POOL, DIM, device=device)
        self.pool_ids = torch.empty(rows, GROUPS, dtype=torch.int32, device=device)
        self.row_positions = torch.empty(rows, dtype=torch.int64, device=device)
        self.req_ids = torch.empty(rows, dtype=torch.int32, device=device)
        self.block_table = torch.empty(requests, 600, dtype=torch.int32, device=device)
        self.out = torch.empty(rows + 1, WIDTH, dtype=torch.int32, device=device)
        self.counts = torch.empty(rows + 1, dtype=torch.int32, device=device)

    def refill(self, gen):
        r, t, dev = self.requests, self.tokens, self.device
        rand = dict(generator=gen, device=dev)
        self.kv.copy_(torch.randint(0, 256, self.kv.shape, dtype=torch.uint8, **rand))
        self.tail.copy_(torch.randn(self.tail.shape, **rand))
        start = torch.randint(0, 600 * BLOCK - 8, (r, 1), **rand)
        pos = start + torch.arange(t, device=dev)
        pos[torch.rand(r, **rand) < 0.05] = -1  # padding requests
        self.positions.copy_(pos)
        block = 1 + torch.randperm(r, **rand)[:, None]
        self.tail_slots.copy_(torch.where(pos >= 0, block * RING + pos % RING, -1))
        free = torch.randperm(self.pages * PAGE, **rand)[: r * t].view(r, t)
        self.slots.copy_(torch.where((pos >= 0) & (pos % POOL == POOL - 1), free, -1))
        self.key.copy_(torch.randn(self.key.shape, **rand))
        self.score.copy_(torch.randn(self.score.shape, **rand))
        self.ape.copy_(torch.randn(POOL, DIM, **rand))
        ids = torch.randint(0, 600 * BLOCK // POOL + 64, self.pool_ids.shape, **rand)
        ids[torch.rand(ids.shape, **rand) < 0.1] = -1
        self.pool_ids.copy_(ids)
        self.row_positions.copy_(pos.reshape(-1))
        self.req_ids.copy_(torch.arange(r, device=dev).repeat_interleave(t))
        self.block_table.copy_(
            torch.randint(0, 1 << 20, self.block_table.shape, **rand)
        )

    def specialized(self, mx):
        from vllm.models.glm5next.nvidia.specialized_decode import kpool
        from vllm.models.glm5next.nvidia.specialized_decode.remap_kernel import (
            REMAP,
            RemapArgs,
        )

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
        REMAP.run(
            RemapArgs(
                self.pool_ids,
                self.row_positions,
                POOL,
                self.req_ids,
                self.block_table,
                self.out[: self.rows],
                self.counts,
                BLOCK,
                BLOCK,
                seq_offset=1,
                int32_lengths=True,
            )
        )

    def stock(self, kv, tail, mx, monkeypatch):
        """The stock decode tail on copies of the step's state."""
        from vllm.models.glm5next.nvidia.ops import kpool_compress
        from vllm.v1.attention.backends.mla.sparse_utils import (
            triton_convert_req_index_to_global_index,
        )

        monkeypatch.setattr(kpool_compress, "mqa_logits_use_mx_scales", lambda: mx)
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
        logical = torch.full(
            (self.rows, WIDTH), -1, dtype=torch.int32, device=self.device
        )
        seq = self.row_positions.to(torch.int32) + 1
        expanded = kpool_compress.expand_pools_and_append_tail(
            self.pool_ids.to(torch.int64), seq, POOL
        )
        logical[:, : expanded.shape[1]] = expanded
        return triton_convert_req_index_to_global_index(
            self.req_ids,
            self.block_table,
            logical,
            BLOCK_SIZE=BLOCK,
            NUM_TOPK_TOKENS=WIDTH,
            return_valid_counts=True,
        )


def test_decode_tail_graph_replays_match_stock(monkeypatch):
    seed, replays = fuzz_seed(), fuzz_cases(1000)
    device = torch.device("cuda")
    mx = torch.cuda.get_device_capability()[0] == 10
    gen = torch.Generator(device).manual_seed(seed)
    failures, total = [], 0
    for requests, tokens in PLANS:
        step = Step(requests, tokens, device)
        step.refill(gen)
        capture = torch.cuda.Stream(device)
        capture.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(capture):
            step.specialized(mx)  # compiles outside the capture (run's lazy compile)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=capture):
                step.specialized(mx)
        for i in range(replays):
            step.refill(gen)
            kv, tail = step.kv.clone(), step.tail.clone()
            out, counts = step.stock(kv, tail, mx, monkeypatch)
            graph.replay()
            torch.cuda.synchronize()
            total += 1
            same = (
                torch.equal(kv, step.kv)
                and torch.equal(tail.view(torch.int16), step.tail.view(torch.int16))
                and torch.equal(out, step.out[: step.rows])
                and torch.equal(counts, step.counts[: step.rows])
            )
            if not same:
                failures.append(f"{requests}x{tokens} replay {i}")
    report("decode tail graph replays", total, seed, failures)
