# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The indexer simulator's batches: a serving run's requests as GLM-5-Next's
DSA layers see them (``Scheduler``), and each step's attention metadata as
vLLM 0.33.0's builders lay it out (``Builder``), in persistent buffers that
captured CUDA graphs read.

Requests arrive (a random-walk concurrency target), some with a cached
prompt prefix, prefill in pool-aligned chunks (the stock kpool prefill write
assumes it), decode ``next_n`` tokens (cycling 1..spec+1 in phases, uniform
or not, a random number of drafts accepted: positions rewind) and finish,
freeing their blocks. Decode rows per backend path: ``varlen`` (SM100, a
row per token), ``native`` (SM90, uniform ``next_n`` of 1, 2 or 4),
``flat`` (uniform 3), else the backend's non-uniform layout (``flat``, or
``padded``: ``[B, max q_len]`` rows that need padding). FULL graph batches
pad with null-block requests of their ``q_len`` and capture-time
``max_seq_len``. The tail metadata splits as ``KpoolTailMetadataBuilder``
(``tail_split="stock"``: threshold 1) or as the indexer's.
"""

import random
from dataclasses import dataclass, field

import torch

from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonMetadata,
)
from vllm.v1.attention.backends.mla import indexer as meta

POOL = 4


@dataclass(frozen=True)
class Geometry:
    """Model and cache sizes (GLM-5-Next: kpool 4, index head dim 128)."""

    layers: int = 3
    heads: int = 16  # indexer query heads
    topk: int = 2048  # index_topk, in tokens
    block: int = 64  # tokens per KV block (MLA and indexer caches)
    ring: int = 8  # the tail cache's block size
    max_model_len: int = 8192
    max_reqs: int = 32  # max_num_seqs
    max_tokens: int = 2048  # max_num_batched_tokens
    spec: int = 3  # speculative tokens: next_n up to spec + 1
    mla_block_rows: int = 96  # MLA KV rows from one block to the next
    key_stride: int = 128  # row stride of the indexer key input
    scale_fmt: str | None = "ue8m0"  # the indexer's (None: unrounded scales)
    buffer_width: int = 0  # the top-k buffer's (0: vLLM's for topk)
    first_layer: int = 0  # the model's first DSA layer number

    @property
    def page(self) -> int:
        return self.block // POOL

    @property
    def width(self) -> int:  # get_sparse_topk_buffer_width
        return self.buffer_width or -(-(self.topk + POOL - 1) // 128) * 128

    @property
    def max_pool_len(self) -> int:
        return self.max_model_len // POOL

    @property
    def num_blocks(self) -> int:  # block 0 is the null block
        return self.max_reqs * self.max_model_len // self.block + 1

    @property
    def capacity(self) -> int:  # decode rows: index group and stage buffers
        return min(self.max_tokens, self.max_reqs * (self.spec + 1))

    @property
    def prefixes(self) -> list[tuple[str, ...]]:
        """Per DSA layer: its indexer cache, tail cache and MLA layer."""
        names = ("indexer.k_cache", "indexer.tail_cache", "attn")
        first = self.first_layer
        layers = range(first, first + self.layers)
        return [tuple(f"model.layers.{i}.self_attn.{n}" for n in names) for i in layers]


@dataclass(frozen=True)
class Backend:
    """A backend path: ``mx`` (MX scales, BF16 logits: SM100), ``varlen``
    decode rows, the non-uniform layout, ``convert``: "group" (the index
    group, counts), "group_no_counts" (FLASHMLA_SPARSE FP8: decode-only
    steps through the group, mixed ones on the compute stream, no counts)
    or "compute" (FlashInfer SM90: the compute stream with counts, the group
    once patch 0005's flag is set)."""

    name: str
    mx: bool
    varlen: bool
    nonuniform: str
    convert: str


BACKENDS = {
    "sm100": Backend("sm100", True, True, "flat", "group"),
    "flashmla_fp8": Backend("flashmla_fp8", False, False, "padded", "group_no_counts"),
    "flashinfer_sm90": Backend("flashinfer_sm90", False, False, "flat", "compute"),
}


@dataclass
class Workload:
    decode_steps: int = 500  # steps with decode tokens to run
    prompt: tuple[int, int] = (16, 4096)
    output: tuple[int, int] = (8, 512)
    arrival: float = 0.2  # chance per step of an arrival below the target
    nonuniform: float = 0.35  # share of decode steps with mixed q_len
    phase: int = 40  # decode steps per next_n phase
    tail_split: str = "indexer"
    cached: tuple[int, int] = (0, 0)  # prompt tokens in the cache at arrival


@dataclass
class Request:
    rid: int
    prompt: int
    output: int
    tail: int
    computed: int = 0
    generated: int = 0
    blocks: list[int] = field(default_factory=list)


@dataclass
class Scheduled:
    req: Request
    start: int
    q_len: int
    prefill: bool


@dataclass
class Batch:
    items: list[Scheduled]
    next_n: int
    num_decodes: int  # leading decode-class requests (q_len <= next_n)

    @property
    def tokens(self) -> int:
        return sum(i.q_len for i in self.items)

    @property
    def kind(self) -> str:
        if self.num_decodes == len(self.items):
            return "decode"
        return "mixed" if self.num_decodes else "prefill"

    @property
    def uniform(self) -> bool:
        return len({i.q_len for i in self.items[: self.num_decodes]}) <= 1


class Scheduler:
    """The request stream of one run (see the module docstring)."""

    def __init__(self, geo: Geometry, work: Workload, rng: random.Random):
        self.geo, self.work, self.rng = geo, work, rng
        self.free_blocks = list(range(geo.num_blocks - 1, 0, -1))
        rng.shuffle(self.free_blocks)
        self.free_tails = list(range(geo.max_reqs, 0, -1))
        self.running: list[Request] = []
        self.target = rng.randint(1, geo.max_reqs)
        self.decode_steps = self.rids = 0

    def request(self, prompt: int, output: int, cached: int = 0) -> Request:
        self.rids += 1
        tail = self.free_tails.pop()
        return Request(self.rids - 1, prompt, output, tail, min(cached, prompt - 1))

    def arrive(self) -> None:
        geo, rng, work = self.geo, self.rng, self.work
        if rng.random() < 0.05:
            self.target = rng.randint(1, geo.max_reqs)
        self.target = min(max(1, self.target + rng.choice((-1, 0, 1))), geo.max_reqs)
        while len(self.running) < geo.max_reqs and (
            not self.running
            or (len(self.running) < self.target and rng.random() < work.arrival)
        ):
            low, high = work.prompt
            if low <= geo.topk < high and rng.random() < 0.5:  # within the top-k
                high = geo.topk
            prompt = rng.randint(low, high)
            limit = geo.max_model_len - prompt - geo.spec - 1
            output = max(1, min(rng.randint(*work.output), limit))
            cached = rng.randint(*work.cached) // POOL * POOL
            self.running.append(self.request(prompt, output, cached))

    def allocate(self, items: list[Scheduled]) -> None:
        for item in items:
            need = -(-(item.start + item.q_len) // self.geo.block)
            while len(item.req.blocks) < need:
                item.req.blocks.append(self.free_blocks.pop())

    def schedule(self) -> Batch:
        """The next step's requests, decode-class first."""
        self.arrive()
        geo, rng = self.geo, self.rng
        n = 1 + (self.decode_steps // self.work.phase) % (geo.spec + 1)  # next_n
        uniform = rng.random() >= self.work.nonuniform
        decodes, prefills = [], []
        budget = geo.max_tokens - n * sum(r.computed >= r.prompt for r in self.running)
        for req in self.running:
            if req.computed >= req.prompt:
                q = n if uniform else rng.randint(1, n)
                decodes.append(Scheduled(req, req.computed, q, False))
                continue
            chunk = min(req.prompt - req.computed, budget)
            if chunk < req.prompt - req.computed:
                chunk -= chunk % POOL  # the next chunk starts pool-aligned
            if chunk > 0:
                budget -= chunk
                item = Scheduled(req, req.computed, chunk, True)
                (decodes if chunk <= n else prefills).append(item)
        self.allocate(decodes + prefills)
        return Batch(decodes + prefills, n, len(decodes))

    def fixed(self, q_lens, ctx, prefill: int = 0) -> Batch:
        """Decodes of ``q_lens[b]`` tokens after ``ctx[b]``, then a prefill
        of ``prefill`` tokens (0: none)."""
        pairs = zip(q_lens, ctx, strict=True)
        items = [Scheduled(self.request(c, 1 << 30), c, q, False) for q, c in pairs]
        if prefill:
            items.append(Scheduled(self.request(prefill, 1), 0, prefill, True))
        self.allocate(items)
        return Batch(items, max(q_lens), len(q_lens))

    def release(self, batch: Batch) -> None:
        """Frees ``batch``'s requests' blocks and tail blocks."""
        for item in batch.items:
            self.free_blocks.extend(item.req.blocks)
            self.free_tails.append(item.req.tail)

    def commit(self, batch: Batch) -> None:
        """Advance past ``batch``: prefill chunks land whole, decodes keep a
        random number of their drafts; finished requests free their blocks."""
        self.decode_steps += batch.num_decodes > 0
        for item in batch.items:
            req = item.req
            accepted = item.q_len if item.prefill else self.rng.randint(1, item.q_len)
            req.computed = item.start + accepted
            req.generated += 0 if item.prefill else accepted
            full = req.computed + self.geo.spec + 1 > self.geo.max_model_len
            if req.generated >= req.output or full:
                self.running.remove(req)
                self.release(Batch([item], 0, 0))


@dataclass
class Forward:
    """One step's forward inputs: ``metadata`` for the forward context
    (indexer, tail and MLA entries), ``positions`` of its ``rows``."""

    metadata: dict
    positions: torch.Tensor | None
    rows: int  # hidden-state rows (padded in graph modes)
    tokens: int  # scheduled tokens the metadata covers
    kind: str
    layout: str
    key: tuple  # the CUDA graph it replays
    host: tuple  # the host values a FULL graph's capture bakes in


class Builder:
    """Per-step metadata for every DSA layer of ``geo``."""

    def __init__(self, geo: Geometry, backend: Backend, device):
        self.geo, self.backend, self.device = geo, backend, torch.device(device)
        t, r, blocks = geo.max_tokens, geo.max_reqs, geo.max_model_len // geo.block

        def buf(*shape, dtype=torch.int32, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=self.device)

        self.positions, self.slots = (
            buf(t, dtype=torch.int64),
            buf(t, dtype=torch.int64),
        )
        self.base_slots = buf(t, dtype=torch.int64, fill=-1)
        self.tail_slots = buf(t, dtype=torch.int64)
        self.query_start, self.seq_lens = buf(r + 1), buf(r)
        self.block_table, self.tail_table = buf(r, blocks), buf(r, 1)
        self.req_ids, self.dec_seq, self.dec_lens = buf(t), buf(t), buf(t)
        self.dec_table, self.per_req = buf(t, blocks), buf(t)
        self.indices, self.schedule = buf(t), buf(1)

    def put(self, buffer: torch.Tensor, values) -> torch.Tensor:
        host = torch.as_tensor(values, dtype=buffer.dtype)
        view = buffer[: host.shape[0]]
        return view.copy_(host.view(view.shape) if host.dim() == view.dim() else host)

    def build(self, batch: Batch, *, rows: int, full=False, pad_reqs=0,
              tail_split="indexer") -> Forward:  # fmt: skip
        """Metadata of ``batch`` for ``rows`` hidden rows. ``full``: a FULL
        graph batch, padded with ``pad_reqs`` null requests of its ``q_len``,
        with capture-time ``max_seq_len`` and a graph key naming every host
        value its capture bakes in (vLLM keys by token count because its
        ``q_len`` is fixed per deployment; this batch cycles ``next_n``)."""
        geo = self.geo
        q_pad = batch.items[0].q_len if full else 0
        items = [(i.start, i.q_len, i.req) for i in batch.items]
        items += [(None, q_pad, None)] * pad_reqs
        q_lens = [q for _, q, _ in items]
        decodes, tokens, reqs = batch.num_decodes + pad_reqs, sum(q_lens), len(items)
        seq_lens = [0 if s is None else s + q for s, q, _ in items]
        positions, slots, req_ids = [], [], []
        table = torch.zeros(reqs, geo.max_model_len // geo.block, dtype=torch.int32)
        tails = torch.zeros(reqs, 1, dtype=torch.int32)
        for index, (start, q, req) in enumerate(items):
            req_ids += [index] * q
            if req is None:
                positions, slots = positions + [0] * q, slots + [-1] * q
                continue
            table[index, : len(req.blocks)] = torch.tensor(req.blocks)
            tails[index, 0] = req.tail
            for pos in range(start, start + q):
                positions.append(pos)
                block = (
                    req.blocks[pos // geo.block] * geo.page + pos % geo.block // POOL
                )
                slots.append(block if pos % POOL == POOL - 1 else -1)
        pos = self.put(self.positions, positions)
        self.put(self.slots, slots)
        self.put(self.req_ids, req_ids)
        qsl = self.put(self.query_start, [sum(q_lens[:i]) for i in range(reqs + 1)])
        seq, bt = self.put(self.seq_lens, seq_lens), self.put(self.block_table, table)
        tail_slots = meta.compute_kpool_tail_slot_mapping(
            self.base_slots[:tokens], self.put(self.tail_table, tails), qsl, pos,
            tokens, reqs, geo.ring, out=self.tail_slots[:tokens],
        )  # fmt: skip
        max_seq = geo.max_model_len if full else max(seq_lens)
        decode, layout = None, "none"
        if decodes:
            decode, layout = self.decode(items[:decodes], seq_lens, bt)
        tail_decodes = decodes
        if tail_split == "stock":  # split_decodes_and_prefills at threshold 1
            tail_decodes = next((i for i, q in enumerate(q_lens) if q > 1), reqs)

        def split(n: int, **more):
            return meta.DeepseekV32IndexerMetadata(
                seq_lens=seq, max_seq_len=max_seq, num_decodes=n,
                num_decode_tokens=sum(q_lens[:n]), num_prefills=reqs - n,
                num_prefill_tokens=sum(q_lens[n:]), **more,
            )  # fmt: skip

        indexer = split(
            decodes, slot_mapping=self.slots[:tokens], decode=decode, block_table=bt,
            prefill=self.prefill(items, decodes, seq_lens, bt),
        )  # fmt: skip
        tail = split(tail_decodes, slot_mapping=tail_slots, positions=pos)
        mla = SparseMLACommonMetadata(
            num_reqs=reqs, max_query_len=max(q_lens), max_seq_len=max_seq,
            num_actual_tokens=tokens, query_start_loc=qsl,
            slot_mapping=self.slots[:tokens], num_decodes=decodes,
            num_decode_tokens=indexer.num_decode_tokens,
            num_prefills=indexer.num_prefills, block_table=bt,
            req_id_per_token=self.req_ids, block_size=geo.block, topk_tokens=geo.topk,
        )  # fmt: skip
        metadata = {}
        for names in geo.prefixes:
            metadata.update(zip(names, (indexer, tail, mla), strict=True))
        host = (rows, tokens, tuple(q_lens), decodes, max_seq, tail_decodes, layout)
        key = (reqs, q_pad, layout) if full else (rows,)
        return Forward(
            metadata, self.positions[:rows], rows, tokens, batch.kind, layout, key, host
        )

    def decode(self, items, seq_lens, bt):
        """Decode rows per layout (see the module docstring)."""
        d = [q for _, q, _ in items]
        t, lmax, uniform = sum(d), max(d), min(d) == max(d)
        layout = self.backend.nonuniform
        if self.backend.varlen:
            layout = "varlen"
        elif uniform:
            layout = "native" if lmax in (1, 2, 4) else "flat"
        # Each row's context in pools: token j of a request ending at L.
        grid = [
            [max(L - q + j + 1, 0) // POOL for j in range(q)]
            for (_, q, _), L in zip(items, seq_lens, strict=False)
        ]
        indices = None
        if layout in ("varlen", "flat"):
            rows = [index for index, q in enumerate(d) for _ in range(q)]
            seq = self.put(self.dec_seq, sum(grid, [])).view(t, 1)
            table = self.dec_table[:t]
            table.copy_(bt[torch.tensor(rows, device=bt.device)])
            lens = self.put(self.dec_lens, [1] * t)
            indices = self.put(self.indices, rows) if layout == "varlen" else None
        else:
            padded = sum((row + [0] * (lmax - len(row)) for row in grid), [])
            seq = self.put(self.dec_seq, padded).view(len(d), lmax)
            table, lens = bt[: len(d)], self.put(self.dec_lens, d)
        decode = meta.DeepSeekV32IndexerDecodeMetadata(
            block_table=table, seq_lens=seq, decode_lens=lens,
            requires_padding=layout == "padded", schedule_metadata=self.schedule,
            per_req_decode_lens=self.put(self.per_req, d), decode_is_uniform=uniform,
            write_max_decode_len=lmax, indices=indices,
        )  # fmt: skip
        return decode, layout

    def prefill(self, items, decodes: int, seq_lens, bt):
        """One chunk over every prefill request (short ones: none)."""
        if decodes == len(items):
            return None
        lens = seq_lens[decodes:]
        pools = [length // POOL for length in lens]
        cu = [sum(pools[:i]) for i in range(len(pools) + 1)]
        ks, ke = [], []
        for index, (start, q, _) in enumerate(items[decodes:]):
            ks += [cu[index]] * q
            ke += [cu[index] + (pos + 1) // POOL for pos in range(start, start + q)]
        first, chunks = sum(q for _, q, _ in items[:decodes]), []
        if cu[-1]:

            def tensor(values):
                return torch.tensor(values, dtype=torch.int32, device=self.device)

            ints = tensor(cu)
            seqs = [index for index, p in enumerate(pools) for _ in range(p)]
            chunks.append(
                meta.DeepseekV32IndexerPrefillChunkMetadata(
                    block_table=bt[decodes:],
                    cu_seqlen_ks=tensor(ks),
                    cu_seqlen_ke=tensor(ke),
                    cu_seq_lens=ints,
                    token_to_seq=tensor(seqs),
                    total_seq_lens=cu[-1],
                    max_seqlen_k=max(pools),
                    token_start=first,
                    token_end=first + len(ks),
                    num_reqs=len(pools),
                    local_cu_seq_lens=ints,
                    local_total_seq_lens=cu[-1],
                    max_local_total_seq_lens=cu[-1],
                )  # fmt: skip
            )
        return meta.DeepseekV32IndexerPrefillMetadata(
            chunks, max_prefill_seq_len=max(lens)
        )
