# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The changing batch of a serving run as GLM-5-Next's DSA layers see it, and
each step's attention metadata as vLLM 0.33.0's builders lay it out.

``Scheduler``: requests arrive (a random-walk concurrency target), prefill in
chunks that start pool-aligned (the stock kpool prefill write assumes it),
decode with speculative tokens (``next_n`` cycling 1..4 in phases; uniform or
not; a random number of drafts accepted, so positions rewind), cross pool,
block and top-k boundaries, and finish, freeing their blocks for reuse.

``Builder``: the indexer metadata (``DeepseekV32IndexerMetadata``, the tail
cache's, and the sparse MLA layers' ``SparseMLACommonMetadata``) in
persistent device buffers, so captured CUDA graphs read each step's values.
Decode rows per backend path: ``varlen`` (SM100, one row per token),
``native`` (SM90, uniform ``next_n`` in 1, 2, 4), ``flat`` (SM90 flattening:
``next_n`` 3, adaptive verification), ``padded`` (SM90 native
``[B, max q_len]`` rows with ``requires_padding``; vLLM 0.33.0 reaches it
through zero-length graph padding, here real non-uniform requests fill it).
Decode-class requests (``q_len <= next_n``, short prefill extends included)
come first. FULL graph batches pad with null-block requests of the same
``q_len`` and capture-time ``max_seq_len = max_model_len``. The tail metadata splits as
``KpoolTailMetadataBuilder`` does (``tail_split="stock"``: threshold 1, so
speculative steps count as prefills there) or as the indexer's
(``"indexer"``).
"""

import random
from dataclasses import dataclass, field

import torch

from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonMetadata,
)
from vllm.v1.attention.backends.mla.indexer import (
    DeepSeekV32IndexerDecodeMetadata,
    DeepseekV32IndexerMetadata,
    DeepseekV32IndexerPrefillChunkMetadata,
    DeepseekV32IndexerPrefillMetadata,
    compute_kpool_tail_slot_mapping,
)

POOL = 4


@dataclass(frozen=True)
class Geometry:
    """Model and cache sizes (GLM-5-Next: kpool 4, index head dim 128)."""

    layers: int = 3
    heads: int = 16  # indexer query heads
    topk: int = 2048  # index_topk, in tokens
    block: int = 64  # tokens per KV block (MLA and indexer caches)
    ring: int = 8  # tail ring: the tail cache's block size
    max_model_len: int = 8192
    max_reqs: int = 32  # max_num_seqs
    max_tokens: int = 2048  # max_num_batched_tokens
    spec: int = 3  # speculative tokens: next_n up to spec + 1
    mla_block_rows: int = 96  # MLA KV rows between blocks (>= block)

    @property
    def page(self) -> int:
        return self.block // POOL

    @property
    def width(self) -> int:  # get_sparse_topk_buffer_width
        return -(-(self.topk + POOL - 1) // 128) * 128

    @property
    def max_blocks(self) -> int:
        return self.max_model_len // self.block

    @property
    def max_pool_len(self) -> int:
        return self.max_model_len // POOL

    @property
    def num_blocks(self) -> int:  # block 0 is the null block
        return self.max_reqs * self.max_blocks + 1

    @property
    def capacity(self) -> int:  # decode rows: index group and stage buffers
        return min(self.max_tokens, self.max_reqs * (self.spec + 1))


@dataclass(frozen=True)
class Backend:
    """A backend path: ``mx`` (MX scales, BF16 logits: SM100 family),
    ``varlen`` decode rows, SM90 ``nonuniform`` rows ("padded" or "flat"),
    ``convert``: "group" (index group, counts, side stream), "group_no_counts"
    (FLASHMLA_SPARSE FP8 decode; mixed steps convert on the compute stream)
    or "compute" (FlashInfer SM90: compute stream, counts)."""

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
    tail_split: str = "stock"


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
    def decode_tokens(self) -> int:
        return sum(i.q_len for i in self.items[: self.num_decodes])

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
        self.free_tails = list(range(geo.max_reqs, 0, -1))
        self.running: list[Request] = []
        self.target = rng.randint(1, geo.max_reqs)
        self.decode_steps, self.rids = 0, 0
        self.finished = 0

    def next_n(self) -> int:
        return 1 + (self.decode_steps // self.work.phase) % (self.geo.spec + 1)

    def _arrive(self) -> None:
        geo, rng = self.geo, self.rng
        if rng.random() < 0.05:
            self.target = rng.randint(1, geo.max_reqs)
        self.target = min(max(1, self.target + rng.choice((-1, 0, 1))), geo.max_reqs)
        while len(self.running) < geo.max_reqs and (
            not self.running
            or (len(self.running) < self.target and rng.random() < self.work.arrival)
        ):
            low, high = self.work.prompt
            if low <= geo.topk < high and rng.random() < 0.5:  # within the top-k
                high = geo.topk
            prompt = rng.randint(low, high)
            limit = geo.max_model_len - prompt - geo.spec - 1
            output = max(1, min(rng.randint(*self.work.output), limit))
            tail = self.free_tails.pop()
            self.running.append(Request(self.rids, prompt, output, tail))
            self.rids += 1

    def schedule(self) -> Batch:
        """The next step's requests, decode-class first."""
        self._arrive()
        geo, rng, n = self.geo, self.rng, self.next_n()
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
            if chunk <= 0:
                continue
            budget -= chunk
            item = Scheduled(req, req.computed, chunk, True)
            (decodes if chunk <= n else prefills).append(item)
        for item in decodes + prefills:
            need = -(-(item.start + item.q_len) // geo.block)
            while len(item.req.blocks) < need:
                item.req.blocks.append(self.free_blocks.pop())
        return Batch(decodes + prefills, n, len(decodes))

    def commit(self, batch: Batch) -> None:
        """Advance past ``batch``: prefill chunks land whole, decodes keep a
        random number of their drafts; finished requests free their blocks."""
        geo = self.geo
        if batch.num_decodes:
            self.decode_steps += 1
        for item in batch.items:
            req = item.req
            accepted = item.q_len if item.prefill else self.rng.randint(1, item.q_len)
            req.computed = item.start + accepted
            req.generated += 0 if item.prefill else accepted
            if req.generated >= req.output or (
                req.computed + geo.spec + 1 > geo.max_model_len
            ):
                self.running.remove(req)
                self.free_blocks.extend(req.blocks)
                self.free_tails.append(req.tail)
                self.finished += 1


@dataclass
class Step:
    """One step's forward inputs: ``metadata`` for the forward context
    (indexer, tail and MLA entries), ``positions`` of its ``rows``."""

    metadata: dict
    mla: SparseMLACommonMetadata
    positions: torch.Tensor
    rows: int  # hidden-state rows (padded in graph modes)
    tokens: int  # scheduled tokens the metadata covers
    kind: str
    layout: str
    key: tuple
    # The host values a capture bakes into its graph: a FULL graph replays
    # only for steps with the same ones.
    host: tuple = ()


def _split(q_lens: list[int], threshold: int) -> int:
    """Leading decode requests, as ``split_decodes_and_prefills``."""
    for index, q in enumerate(q_lens):
        if q > threshold:
            return index
    return len(q_lens)


class Builder:
    """Per-step metadata for ``prefixes`` (one entry per DSA layer)."""

    def __init__(self, geo: Geometry, backend: Backend, prefixes, device):
        self.geo, self.backend, self.prefixes = geo, backend, prefixes
        self.device = torch.device(device)
        t, r, i32 = geo.max_tokens, geo.max_reqs, torch.int32

        def buf(*shape, dtype=i32):
            return torch.zeros(shape, dtype=dtype, device=self.device)

        self.positions = buf(t, dtype=torch.int64)
        self.slots = buf(t, dtype=torch.int64)
        self.base_slots = torch.full((t,), -1, dtype=torch.int64, device=self.device)
        self.tail_slots = buf(t, dtype=torch.int64)
        self.query_start = buf(r + 1)
        self.seq_lens = buf(r)
        self.block_table = buf(r, geo.max_blocks)
        self.tail_table = buf(r, 1)
        self.req_ids = buf(t)
        self.dec_seq = buf(t)
        self.dec_table = buf(t, geo.max_blocks)
        self.dec_lens = buf(t)
        self.per_req = buf(t)
        self.indices = buf(t)
        self.schedule = buf(1)

    def _put(self, buffer: torch.Tensor, values) -> torch.Tensor:
        host = torch.as_tensor(values, dtype=buffer.dtype)
        view = buffer[: host.shape[0]]
        view.copy_(host.view(view.shape) if host.dim() == view.dim() else host)
        return view

    def build(
        self, batch: Batch, *, rows: int, full: bool = False, pad_reqs: int = 0,
        tail_split="stock",
    ):  # fmt: skip
        """Metadata of ``batch`` for ``rows`` hidden rows. ``full``: a FULL
        graph batch, padded with ``pad_reqs`` null requests of its ``q_len``,
        with capture-time ``max_seq_len`` and a graph key that names every
        host value its capture bakes in (padded requests, ``q_len``, layout):
        vLLM keys by token count because its ``q_len`` is fixed per
        deployment, while this batch cycles ``next_n``."""
        geo = self.geo
        items = [(i.start, i.q_len, i.req) for i in batch.items]
        q_pad = batch.items[0].q_len if full else 0
        items += [(None, q_pad, None)] * pad_reqs
        q_lens = [q for _, q, _ in items]
        num_decodes = batch.num_decodes + pad_reqs
        tokens = sum(q_lens)
        seq_lens = [0 if s is None else s + q for s, q, _ in items]
        positions, slots, req_ids = [], [], []
        table = torch.zeros(len(items), geo.max_blocks, dtype=torch.int32)
        tails = torch.zeros(len(items), 1, dtype=torch.int32)
        for index, (start, q, req) in enumerate(items):
            req_ids += [index] * q
            if req is None:
                positions += [0] * q
                slots += [-1] * q
                continue
            table[index, : len(req.blocks)] = torch.tensor(req.blocks)
            tails[index, 0] = req.tail
            for pos in range(start, start + q):
                positions.append(pos)
                done = pos % POOL == POOL - 1
                block = req.blocks[pos // geo.block]
                slots.append(block * geo.page + pos % geo.block // POOL if done else -1)
        query_start = [0]
        for q in q_lens:
            query_start.append(query_start[-1] + q)
        pos_view = self._put(self.positions, positions)
        self._put(self.slots, slots)
        self._put(self.req_ids, req_ids)
        qsl = self._put(self.query_start, query_start)
        seq = self._put(self.seq_lens, seq_lens)
        bt = self._put(self.block_table, table)
        tail_bt = self._put(self.tail_table, tails)
        tail_slots = compute_kpool_tail_slot_mapping(
            self.base_slots[:tokens], tail_bt, qsl, pos_view, tokens, len(items),
            geo.ring, out=self.tail_slots[:tokens],
        )  # fmt: skip
        max_seq = geo.max_model_len if full else max(seq_lens)
        decode, layout = None, "none"
        if num_decodes:
            decode, layout = self._decode(items[:num_decodes], seq_lens, bt)
        prefill = self._prefill(items, num_decodes, seq_lens, bt)
        indexer = DeepseekV32IndexerMetadata(
            seq_lens=seq, max_seq_len=max_seq, slot_mapping=self.slots[:tokens],
            num_decodes=num_decodes, num_decode_tokens=sum(q_lens[:num_decodes]),
            num_prefills=len(items) - num_decodes,
            num_prefill_tokens=sum(q_lens[num_decodes:]),
            decode=decode, prefill=prefill, block_table=bt,
        )  # fmt: skip
        tail_decodes = num_decodes if tail_split == "indexer" else _split(q_lens, 1)
        tail = DeepseekV32IndexerMetadata(
            seq_lens=seq, max_seq_len=max_seq, slot_mapping=tail_slots,
            num_decodes=tail_decodes, num_decode_tokens=sum(q_lens[:tail_decodes]),
            num_prefills=len(items) - tail_decodes,
            num_prefill_tokens=sum(q_lens[tail_decodes:]), positions=pos_view,
        )  # fmt: skip
        mla = SparseMLACommonMetadata(
            num_reqs=len(items), max_query_len=max(q_lens), max_seq_len=max_seq,
            num_actual_tokens=tokens, query_start_loc=qsl,
            slot_mapping=self.slots[:tokens], num_decodes=num_decodes,
            num_decode_tokens=indexer.num_decode_tokens,
            num_prefills=indexer.num_prefills, block_table=bt,
            req_id_per_token=self.req_ids, block_size=geo.block,
            topk_tokens=geo.topk,
        )  # fmt: skip
        metadata = {}
        for k_prefix, tail_prefix, mla_prefix in self.prefixes:
            metadata.update({k_prefix: indexer, tail_prefix: tail, mla_prefix: mla})
        key = (len(items), q_pad, layout) if full else (rows,)
        host = (
            rows, tokens, tuple(q_lens), num_decodes, indexer.num_decode_tokens,
            max_seq, tail_decodes, layout,
        )  # fmt: skip
        return Step(
            metadata, mla, self.positions[:rows], rows, tokens, batch.kind, layout,
            key, host,
        )  # fmt: skip

    def _decode(self, items, seq_lens, bt):
        """Decode rows per layout (see the module docstring)."""
        backend = self.backend
        d = [q for _, q, _ in items]
        b, t, lmax = len(d), sum(d), max(d)
        uniform = min(d) == lmax
        if backend.varlen:
            layout = "varlen"
        elif uniform and lmax in (1, 2, 4):
            layout = "native"
        elif uniform:
            layout = "flat"
        else:
            layout = backend.nonuniform
        per_req = self._put(self.per_req, d)
        indices = None
        if layout in ("varlen", "flat"):
            rows, table = [], []
            for index, ((_, q, _), length) in enumerate(
                zip(items, seq_lens, strict=False)
            ):
                rows += [max(length - q + j + 1, 0) // POOL for j in range(q)]
                table += [index] * q
            seq = self._put(self.dec_seq, rows).view(t, 1)
            block_table = self.dec_table[:t]
            block_table.copy_(bt[torch.tensor(table, device=bt.device)])
            decode_lens = self._put(self.dec_lens, [1] * t)
            if layout == "varlen":
                indices = self._put(self.indices, table)
        else:
            width = lmax if layout == "padded" else d[0]
            grid = [
                [
                    max(length - q + j + 1, 0) // POOL if j < q else 0
                    for j in range(width)
                ]
                for (_, q, _), length in zip(items, seq_lens, strict=False)
            ]
            seq = self._put(self.dec_seq, [v for row in grid for v in row])
            seq = seq.view(b, width)
            block_table = bt[:b]
            decode_lens = self._put(self.dec_lens, d)
        metadata = DeepSeekV32IndexerDecodeMetadata(
            block_table=block_table, seq_lens=seq, decode_lens=decode_lens,
            requires_padding=layout == "padded", schedule_metadata=self.schedule,
            per_req_decode_lens=per_req, decode_is_uniform=uniform,
            write_max_decode_len=lmax, indices=indices,
        )  # fmt: skip
        return metadata, layout

    def _prefill(self, items, num_decodes, seq_lens, bt):
        """One chunk over every prefill request (short prompts: none)."""
        if num_decodes == len(items):
            return None
        device = self.device
        lens = seq_lens[num_decodes:]
        pools = [length // POOL for length in lens]
        cu = [0]
        for p in pools:
            cu.append(cu[-1] + p)
        ks, ke = [], []
        first = sum(q for _, q, _ in items[:num_decodes])
        for index, (start, q, _) in enumerate(items[num_decodes:]):
            ks += [cu[index]] * q
            ke += [cu[index] + (pos + 1) // POOL for pos in range(start, start + q)]
        chunks = []
        if cu[-1]:
            to_seq = torch.repeat_interleave(
                torch.arange(len(pools)), torch.tensor(pools)
            )

            def ints(values):
                return torch.tensor(values, dtype=torch.int32, device=device)

            cu_t = ints(cu)
            chunks.append(
                DeepseekV32IndexerPrefillChunkMetadata(
                    block_table=bt[num_decodes:],
                    cu_seqlen_ks=ints(ks),
                    cu_seqlen_ke=ints(ke),
                    cu_seq_lens=cu_t,
                    token_to_seq=to_seq.to(device=device, dtype=torch.int32),
                    total_seq_lens=cu[-1],
                    max_seqlen_k=max(pools),
                    token_start=first,
                    token_end=first + len(ks),
                    num_reqs=len(pools),
                    local_cu_seq_lens=cu_t,
                    local_total_seq_lens=cu[-1],
                    max_local_total_seq_lens=cu[-1],
                )  # fmt: skip
            )
        return DeepseekV32IndexerPrefillMetadata(chunks, max_prefill_seq_len=max(lens))
