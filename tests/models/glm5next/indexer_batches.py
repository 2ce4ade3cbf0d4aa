# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The indexer simulator's batches: a serving run's requests (``Scheduler``)
and each step's attention metadata as vLLM 0.33.0's builders build it
(``Builder``). Prefills come in pool-aligned chunks (the stock kpool prefill
write assumes it); decodes accept some of their drafts (positions rewind)."""

from dataclasses import dataclass, field, replace
from types import SimpleNamespace as NS
from unittest import mock

import torch

from vllm.model_executor.layers.attention import sparse_mla_attention
from vllm.v1.attention.backends.mla import indexer as meta

# The kernel-only shim (the GPU tier without vLLM) serves the metadata
# classes but not vLLM's builders: there ``laid`` lays the metadata by hand.
VLLM_BUILDERS = hasattr(meta, "DeepseekV32IndexerMetadataBuilder")
if VLLM_BUILDERS:
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import CircularBufferSpec, MLAAttentionSpec
else:
    CommonAttentionMetadata = NS

POOL, D = 4, 128


@dataclass(frozen=True)
class Geometry:
    """Model and cache sizes (GLM-5-Next: kpool 4, index head dim 128)."""

    layers: int = 3
    heads: int = 16  # indexer query heads (as the indexer op gets them)
    index_heads: int = 0  # the model's own, zero-padded to ``heads`` (0: all)
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

    page = property(lambda g: g.block // POOL)
    max_pool_len = property(lambda g: g.max_model_len // POOL)
    # Block 0 is the null block.
    num_blocks = property(lambda g: g.max_reqs * g.max_model_len // g.block + 1)
    # Decode rows: the index group's and the stage's buffers.
    capacity = property(lambda g: min(g.max_tokens, g.max_reqs * (g.spec + 1)))
    # get_sparse_topk_buffer_width
    width = property(lambda g: g.buffer_width or -(-(g.topk + POOL - 1) // 128) * 128)

    @property
    def prefixes(self) -> list[tuple[str, ...]]:
        """Per DSA layer: its indexer cache, tail cache and MLA layer."""
        names = ("indexer.k_cache", "indexer.tail_cache", "attn")
        layers = range(self.first_layer, self.first_layer + self.layers)
        return [tuple(f"model.layers.{i}.self_attn.{n}" for n in names) for i in layers]


@dataclass(frozen=True)
class Backend:
    """A backend path: ``mx`` (MX scales, BF16 logits: SM100), ``varlen``
    decode rows, the non-uniform layout, ``convert``: "group" (the index
    group, counts), "group_no_counts" (FLASHMLA_SPARSE FP8: decode-only steps
    through the group, no counts) or "compute" (FlashInfer SM90: the compute
    stream with counts; the group once patch 0005's flag is set)."""

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
    tail_split: str = "indexer"  # "stock": KpoolTailMetadataBuilder's own
    cached: tuple[int, int] = (0, 0)  # prompt tokens in the cache at arrival


@dataclass
class Request:
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
    tokens = property(lambda b: sum(i.q_len for i in b.items))
    uniform = property(lambda b: len({i.q_len for i in b.items[: b.num_decodes]}) < 2)
    kind = property(lambda b: kind_of(b.num_decodes, len(b.items)))


kind_of = lambda d, reqs: "decode" if d == reqs else "mixed" if d else "prefill"


class Scheduler:
    """Arrivals toward a random-walk concurrency target, some with a cached
    prefix; ``next_n`` 1..spec+1 in phases, uniform or not."""

    def __init__(self, geo: Geometry, work: Workload, rng):
        self.geo, self.work, self.rng = geo, work, rng
        self.free_blocks = list(range(geo.num_blocks - 1, 0, -1))
        rng.shuffle(self.free_blocks)
        self.free_tails, self.running = list(range(geo.max_reqs, 0, -1)), []
        self.target = rng.randint(1, geo.max_reqs)
        self.decode_steps = self.rids = 0

    def request(self, prompt: int, output: int, cached: int = 0) -> Request:
        self.rids += 1
        return Request(prompt, output, self.free_tails.pop(), min(cached, prompt - 1))

    def schedule(self) -> Batch:
        """New arrivals, then the next step's requests, decode-class first."""
        geo, rng, work = self.geo, self.rng, self.work
        if rng.random() < 0.05:
            self.target = rng.randint(1, geo.max_reqs)
        self.target = min(max(1, self.target + rng.choice((-1, 0, 1))), geo.max_reqs)
        while len(self.running) < geo.max_reqs and (
            not self.running
            or (len(self.running) < self.target and rng.random() < work.arrival)
        ):
            low, high = work.prompt
            if low <= geo.topk < high:
                # The first prompt past the top-k, so that every run, however
                # short, selects; later ones within it half the time.
                if not self.rids:
                    low = geo.topk + 1
                elif rng.random() < 0.5:
                    high = geo.topk
            prompt = rng.randint(low, high)
            limit = geo.max_model_len - prompt - geo.spec - 1
            output = max(1, min(rng.randint(*work.output), limit))
            cached = rng.randint(*work.cached) // POOL * POOL
            self.running.append(self.request(prompt, output, cached))
        n = 1 + (self.decode_steps // work.phase) % (geo.spec + 1)  # next_n
        uniform = rng.random() >= work.nonuniform
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
        return self.allocate(Batch(decodes + prefills, n, len(decodes)))

    def allocate(self, batch: Batch) -> Batch:
        for item in batch.items:
            need = -(-(item.start + item.q_len) // self.geo.block)
            while len(item.req.blocks) < need:
                item.req.blocks.append(self.free_blocks.pop())
        return batch

    def fixed(self, q_lens, ctx, prefill: int = 0) -> Batch:
        """Decodes of ``q_lens[b]`` tokens after ``ctx[b]``, then a prefill
        of ``prefill`` tokens (0: none)."""
        pairs = zip(q_lens, ctx, strict=True)
        items = [Scheduled(self.request(c, 1 << 30), c, q, False) for q, c in pairs]
        if prefill:
            items.append(Scheduled(self.request(prefill, 1), 0, prefill, True))
        return self.allocate(Batch(items, max(q_lens), len(q_lens)))

    def release(self, batch: Batch) -> None:
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


# The indexer's prefill/decode split (the MLA metadata has the first three),
# and what the MLA metadata takes of the common metadata as it is.
SPLIT = ("num_decodes", "num_decode_tokens", "num_prefills", "num_prefill_tokens")
MLA_COMMON = ("num_reqs", "max_query_len", "max_seq_len", "num_actual_tokens")
MLA_COMMON += ("query_start_loc", "slot_mapping")


class Builder:
    """Per-step metadata of every DSA layer: the indexer's and the tail's by
    vLLM's builders from a ``CommonAttentionMetadata`` in persistent buffers
    (captured graphs read them), the sparse MLA metadata by hand. No DeepGEMM
    on the CPU: its schedule op has no CPU kernel (the stand-ins do not read
    it). vLLM 0.33.0 never pads non-uniform decodes: ``padded`` (the
    builder's ``requires_padding`` path) answers native for every ``next_n``
    and splits with ``require_uniform=False``; with ``deep_gemm`` (its SM90
    kernel takes ``next_n`` 1, 2 or 4) native only for those."""

    def __init__(self, geo: Geometry, backend: Backend, device, deep_gemm=False):
        self.geo, self.backend, self.deep_gemm = geo, backend, deep_gemm
        self.device = dev = torch.device(device)
        t, r, blocks = geo.max_tokens, geo.max_reqs, geo.max_model_len // geo.block

        def buf(*shape, dtype=torch.int32, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=dev)

        self.positions, self.slots = (buf(t, dtype=torch.int64) for _ in "ps")
        self.tail_slots = buf(t, dtype=torch.int64, fill=-1)
        self.query_start, self.seq_lens, self.req_ids = buf(r + 1), buf(r), buf(t)
        self.block_table, self.tail_table = buf(r, blocks), buf(r, 1)
        # Where ``laid`` puts what the builders keep in their own buffers.
        ints = {name: buf(t) for name in ("seq", "lens", "per_req", "indices")}
        longs = {name: buf(t, dtype=torch.int64) for name in ("slots", "tail")}
        self.out = NS(**ints, **longs, table=buf(t, blocks), schedule=buf(1))
        if not VLLM_BUILDERS:
            return
        sizes = ("decode_context", "tensor", "prefill_context")
        parallel = {f"{name}_parallel_size": 1 for name in sizes}
        spec = dict(num_speculative_tokens=geo.spec)
        adaptive = backend.nonuniform == "flat"
        attention = dict(resolve_indexer_kv_dtype=lambda default: default)
        config = NS(
            scheduler_config=NS(max_num_batched_tokens=t, max_num_seqs=r),
            parallel_config=NS(**parallel, cp_kv_cache_interleave_size=1),
            speculative_config=NS(**spec, enable_adaptive_verification=adaptive),
            model_config=NS(max_model_len=geo.max_model_len),
            compilation_config=NS(cudagraph_mode=None),
            attention_config=NS(sparse_mla_prefill_workspace_factor=5, **attention),
            **spec,
        )
        kv = dict(num_kv_heads=1, head_size=D + 4, dtype=torch.uint8)
        kv = MLAAttentionSpec(block_size=geo.block, tokens_per_state=POOL, **kv)
        tail = dict(num_kv_heads=2, head_size=D, head_size_v=0, dtype=torch.bfloat16)
        tail = CircularBufferSpec(block_size=geo.ring, dcp_sharded=False, **tail)
        names = [list(n) for n in zip(*geo.prefixes, strict=True)]
        with self.platform():
            self.indexer = meta.DeepseekV32IndexerMetadataBuilder(
                kv, names[0], config, dev, block_table_width=blocks
            )
            self.tail = meta.KpoolTailMetadataBuilder(tail, names[1], config, dev)

    def platform(self):
        """The builders' platform answers for the backend path."""
        varlen, split = self.backend.varlen, meta.split_decodes_and_prefills
        answers = dict(
            _supports_varlen_paged_mqa_logits=lambda: varlen,
            _supports_flattened_device_query_lens=lambda: not varlen,
            _supports_native_decode=self.native,
            num_compute_units=lambda index: 132,
        )
        if self.device.type == "cpu":
            answers["has_deep_gemm"] = lambda: False
        if self.backend.nonuniform == "padded":
            answers["split_decodes_and_prefills"] = lambda common, **kw: split(
                common, **kw | dict(require_uniform=False)
            )
        return mock.patch.multiple(meta, **answers)

    def native(self, next_n: int) -> bool:
        """``_supports_native_decode``: the backend path's answer."""
        if self.backend.varlen or next_n in (1, 2, 4):
            return True
        return self.backend.nonuniform == "padded" and not self.deep_gemm

    def built(self, common):
        """The indexer's and the tail's metadata by vLLM's builders (the
        tail's: its own group's block table, a block a request, and slots)."""
        reqs, tokens = common.num_reqs, common.num_actual_tokens
        table, slots = self.tail_table[:reqs], self.tail_slots[:tokens]
        tail = replace(common, block_table_tensor=table, slot_mapping=slots)
        with self.platform():
            return self.indexer.build(0, common), self.tail.build(0, tail)

    def laid(self, common):
        """What ``built`` gives, laid by hand (the kernel-only shim), the
        decode rows in ``out``'s persistent buffers (FULL graphs read them)."""
        geo, out, q = self.geo, self.out, common.query_start_loc_cpu.diff().tolist()
        reqs, tokens = common.num_reqs, common.num_actual_tokens
        decodes = next((i for i, x in enumerate(q) if x > geo.spec + 1), reqs)
        seq, bt = common.seq_lens.tolist(), common.block_table_tensor
        pos, slots = common.positions[:tokens], common.slot_mapping
        last = (pos % POOL == POOL - 1) & (slots >= 0)
        state = slots // geo.block * geo.page + slots % geo.block // POOL
        out.slots[:tokens] = torch.where(last, state, -1)

        def split(d: int, slot_mapping, **more):
            more |= dict(num_decodes=d, num_decode_tokens=sum(q[:d]))
            more |= dict(num_prefills=reqs - d, num_prefill_tokens=sum(q[d:]))
            more |= dict(seq_lens=common.seq_lens, max_seq_len=common.max_seq_len)
            return meta.DeepseekV32IndexerMetadata(slot_mapping=slot_mapping, **more)

        tail_out = out.tail[:tokens]
        args = (self.tail_table[:reqs], common.query_start_loc, pos, tokens, reqs)
        tail_slots = meta.compute_kpool_tail_slot_mapping(
            torch.full_like(tail_out, -1), *args, geo.ring, out=tail_out
        )
        ones = next((i for i, x in enumerate(q) if x > 1), reqs)
        tail = split(ones, tail_slots, positions=pos)
        decode = self.laid_decode(q[:decodes], seq, bt) if decodes else None
        prefill = self.laid_prefill(q, seq, decodes, bt) if decodes < reqs else None
        indexer = split(
            decodes, out.slots[:tokens], block_table=bt, decode=decode, prefill=prefill
        )
        return indexer, tail

    def laid_decode(self, d, seq, bt):
        """The builder's decode rows: native (``[B, max q_len]``, padded
        when not uniform), else a row per token (varlen: with indices)."""
        out, lmax = self.out, max(d)
        padded = self.backend.nonuniform == "padded"
        native = not self.backend.varlen and padded and self.native(lmax)
        rows_of = [lmax] * len(d) if native else d  # rows a request
        rows = [i for i, n in enumerate(rows_of) for _ in range(n)]
        ends = [
            max(seq[i] - n + j + 1, 0) for i, n in enumerate(rows_of) for j in range(n)
        ]
        values = self.put(out.seq, ends).view(len(d) if native else len(rows), -1)
        if native:
            table, lens = bt[: len(d)], self.put(out.lens, d)
        else:
            rows_t = torch.tensor(rows, device=bt.device)
            table = out.table[: len(rows)].copy_(bt[rows_t])
            lens = self.put(out.lens, [1] * len(rows))
        fields = dict(block_table=table, seq_lens=values.floor_divide_(POOL))
        fields |= dict(decode_lens=lens, requires_padding=native and min(d) != lmax)
        fields |= dict(schedule_metadata=out.schedule, write_max_decode_len=lmax)
        fields |= dict(per_req_decode_lens=self.put(out.per_req, d))
        fields |= dict(decode_is_uniform=min(d) == lmax)
        fields["indices"] = self.put(out.indices, rows) if self.backend.varlen else None
        return meta.DeepSeekV32IndexerDecodeMetadata(**fields)

    def laid_prefill(self, q, seq, decodes: int, bt):
        """One chunk over every prefill request (none without a pool)."""
        pools = [length // POOL for length in seq[decodes:]]
        cu = [sum(pools[:i]) for i in range(len(pools) + 1)]
        ks, ke, chunks, first = [], [], [], sum(q[:decodes])
        pairs = zip(seq[decodes:], q[decodes:], strict=True)
        for index, (length, n) in enumerate(pairs):
            ks += [cu[index]] * n
            ke += [cu[index] + (p + 1) // POOL for p in range(length - n, length)]
        if cu[-1]:
            tensor = lambda v: torch.tensor(v, dtype=torch.int32, device=self.device)
            ints, seqs = tensor(cu), [i for i, p in enumerate(pools) for _ in range(p)]
            chunk = dict(cu_seq_lens=ints, local_cu_seq_lens=ints, num_reqs=len(pools))
            chunk |= dict(cu_seqlen_ks=tensor(ks), cu_seqlen_ke=tensor(ke))
            chunk |= dict(token_to_seq=tensor(seqs), max_seqlen_k=max(pools))
            chunk |= dict(token_start=first, token_end=first + len(ks))
            totals = "total_seq_lens local_total_seq_lens max_local_total_seq_lens"
            chunk |= dict.fromkeys(totals.split(), cu[-1])  # one chunk
            chunk["block_table"] = bt[decodes : len(seq)]
            chunks.append(meta.DeepseekV32IndexerPrefillChunkMetadata(**chunk))
        return meta.DeepseekV32IndexerPrefillMetadata(
            chunks, max_prefill_seq_len=max(seq[decodes:])
        )

    def put(self, buffer: torch.Tensor, values) -> torch.Tensor:
        host = torch.as_tensor(values, dtype=buffer.dtype)
        view = buffer[: host.shape[0]]
        return view.copy_(host.view(view.shape) if host.dim() == view.dim() else host)

    def build(
        self, batch: Batch, *, rows: int, full=False, pad_reqs=0, tail_split="indexer"
    ):
        """One step's forward inputs for ``rows`` hidden rows: ``metadata``
        (indexer, tail and MLA), ``positions``, ``tokens``, ``kind``, decode
        ``layout``, the CUDA graph ``key`` and the ``host`` values a FULL
        capture bakes in. ``full``: padded with ``pad_reqs`` null requests of
        its ``q_len``, capture-time ``max_seq_len``, a key naming every host
        value (vLLM's ``q_len`` is fixed; this one cycles ``next_n``).
        ``tail_split="indexer"``: the tail metadata split as the indexer's."""
        geo, b = self.geo, self.geo.block
        q_pad = batch.items[0].q_len if full else 0
        items = [(i.start, i.q_len, i.req) for i in batch.items]
        items += [(0, q_pad, None)] * pad_reqs
        q_lens = [q for _, q, _ in items]
        tokens, reqs = sum(q_lens), len(items)
        seq_lens = [s + q for s, q, _ in items]  # padding: q_pad tokens, no more
        positions, slots, req_ids = [], [], []
        table = torch.zeros(reqs, geo.max_model_len // b, dtype=torch.int32)
        tails = torch.zeros(reqs, 1, dtype=torch.int32)
        for index, (start, q, req) in enumerate(items):
            req_ids += [index] * q
            if req is None:
                positions, slots = positions + [0] * q, slots + [-1] * q
                continue
            table[index, : len(req.blocks)] = torch.tensor(req.blocks)
            tails[index, 0] = req.tail
            positions += range(start, start + q)
            slots += [req.blocks[p // b] * b + p % b for p in range(start, start + q)]
        cu = [sum(q_lens[:i]) for i in range(reqs + 1)]
        max_seq = geo.max_model_len if full else max(seq_lens)
        common = CommonAttentionMetadata(
            query_start_loc=self.put(self.query_start, cu),
            query_start_loc_cpu=torch.tensor(cu, dtype=torch.int32),
            seq_lens=self.put(self.seq_lens, seq_lens),
            seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
            num_reqs=reqs,
            num_actual_tokens=tokens,
            max_query_len=max(q_lens),
            max_seq_len=max_seq,
            block_table_tensor=self.put(self.block_table, table),
            slot_mapping=self.put(self.slots, slots),
            positions=self.put(self.positions, positions),
        )
        self.put(self.tail_table, tails)
        indexer, tail = (self.built if VLLM_BUILDERS else self.laid)(common)
        split = {name: getattr(indexer, name) for name in SPLIT}
        if tail_split == "indexer":
            tail = replace(tail, **split)
        decodes, layout, d = indexer.num_decodes, "none", indexer.decode
        if d is not None:
            layout = "varlen" if d.indices is not None else "padded"
            if d.indices is None and not d.requires_padding:
                layout = "native" if d.seq_lens.shape[0] == decodes else "flat"
        self.put(self.req_ids, req_ids)
        # The sparse MLA metadata: the common fields and the indexer's split.
        mla = {name: getattr(common, name) for name in MLA_COMMON}
        mla |= {name: split[name] for name in SPLIT[:3]}
        mla |= dict(block_size=geo.block, topk_tokens=geo.topk)
        mla = sparse_mla_attention.SparseMLACommonMetadata(
            **mla, block_table=common.block_table_tensor, req_id_per_token=self.req_ids
        )
        metadata = {}
        for names in geo.prefixes:
            metadata.update(zip(names, (indexer, tail, mla), strict=True))
        host = (rows, tokens, tuple(q_lens), decodes, max_seq, tail.num_decodes, layout)
        fwd = NS(metadata=metadata, rows=rows, host=host, tokens=tokens, layout=layout)
        fwd.positions, fwd.kind = self.positions[:rows], kind_of(decodes, reqs)
        fwd.key = (reqs, q_pad, layout) if full else (rows,)
        return fwd
