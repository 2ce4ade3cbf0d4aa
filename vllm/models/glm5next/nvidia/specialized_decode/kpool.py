# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kpool indexer's decode kernels in CuTe DSL, bit for bit with the stock
Triton kernels of ``ops/kpool_compress.py`` and ``as_fp32_logits``.

``kpool_update`` is the decode tail stash plus pool compression: one warp per
request walks its tokens in position order (a completing token reads the
stashes of the earlier ones), four dimensions per lane. The softmax, the
Hadamard butterflies (strides 1 and 2 in a lane, 4..64 across lanes), the BF16
roundings, the accurate log2 and the scales follow the stock kernel's PTX:
``ex2.approx`` of ``(s - max) * log2(e)``, FMA accumulation in pool order and
``div.full`` divisions. MX (UE8M0) scales and FP32 scales (power-of-two or
plain ``amax / 448``) are both supported.

``expand_pools`` and ``expand_and_remap`` expand pool ids into token ids (and
remap them to physical KV slots) with one 16-byte store per pool.
``upcast_logits`` is ``as_fp32_logits`` with 16-byte accesses.

Every kernel compiles once per config key (shapes are runtime values), before
the first decode step, and launches on torch's current stream with PDL.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

from vllm.forward_context import in_piecewise_cudagraph
from vllm.logger import init_logger
from vllm.model_executor.layers.sparse_attn_indexer import as_fp32_logits
from vllm.models.glm5next.nvidia.ops.kpool_compress import (
    expand_pools_and_append_tail,
    kpool_decode_update_and_maybe_write_cache_batched,
)
from vllm.models.glm5next.nvidia.specialized_decode import planned
from vllm.models.glm5next.nvidia.specialized_decode.cute_ops import (
    add,
    bits_float,
    ceil,
    div,
    exp_diff,
    flat,
    float_bits,
    fma,
    load_words,
    load_words_if,
    pack_fp8,
    round_bf16,
    store_words,
    store_words_if,
    stream,
    to_cute,
    trunc_div,
    unpack_bf16,
)
from vllm.utils.deep_gemm import mqa_logits_use_mx_scales
from vllm.utils.torch_utils import current_stream
from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

logger = init_logger(__name__)

DIM = 128  # the GLM-5-Next index head dimension
POOL = 4  # the kpool size the kernels take
FP8_MAX = 448.0
INV_SQRT_DIM = 0.08838834764831845  # 1/sqrt(128), exact in FP32
EXPAND_THREADS = 128
# Measured on the H200 (tools/bench_kpool.py --upcast-sweep): up to 4096 CTAs
# of one chunk a step beat fewer CTAs and unrolled loads; 128-thread CTAs win
# below 4M logits (short rows finish sooner), 512-thread ones above.
UPCAST_THREADS = (128, 512)
UPCAST_LARGE = 1 << 22
UPCAST_CTAS = 4096
UPCAST_UNROLL = 1
# Most pools one FusedRemap CTA maps: one thread per pool.
MAX_REMAP_GROUPS = 1024

_compiled: dict = {}
_frozen = False


def freeze(frozen: bool = True) -> None:
    """After warmup, any compile is a bug (a decode step or a CUDA graph
    capture would pay for it): make it raise."""
    global _frozen
    _frozen = frozen


def ready(key) -> bool:
    """Whether a launch with compile key ``key`` runs without compiling, or
    may still compile (before warmup has frozen the cache)."""
    return key in _compiled or not _frozen


def _kernel(key, build, args):
    """The kernel compiled for ``key`` (``build()`` traced on ``args``)."""
    compiled = _compiled.get(key)
    if compiled is None:
        if _frozen or torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"kpool kernel {key} was not compiled during warmup; compiling "
                "inside a decode step or a CUDA graph capture is not allowed"
            )
        compiled = _compiled[key] = cute.compile(build(), *args)
    return compiled


def stock_compacts_in_order(width: int) -> bool:
    """Whether the stock conversion of ``width``-wide rows with counts keeps
    the column order (one program owns each row, ``_remap_tiling``); wider
    rows compact through racing atomics, which no kernel can match."""
    padded = 1 << max(width - 1, 0).bit_length()
    return padded == width or padded <= 4096


def _check(condition: bool, argument: str, expected: str, found) -> None:
    if not condition:
        raise ValueError(f"{argument}: expected {expected}, got {found}")


# --- kpool_update -----------------------------------------------------------


def _bf16x4(words):
    """The four FP32 values of two words of packed BF16."""
    a, b = unpack_bf16(words[0])
    c, d = unpack_bf16(words[1])
    return [a, b, c, d]


class _UpdateKernel:
    """One warp per request; lane ``l`` owns dimensions ``4l .. 4l + 3``."""

    def __init__(
        self, pool, ring, page, page_bytes, tail_block, tail_half, mx, round_scale
    ):
        assert pool == POOL and ring % pool == 0 and page_bytes % 4 == 0
        self.pool, self.ring, self.page, self.page_bytes = pool, ring, page, page_bytes
        self.tail_block, self.tail_half = tail_block, tail_half
        # MX scales are power-of-two UE8M0 bytes, so they always round.
        self.mx, self.round_scale = mx, round_scale or mx

    @cute.jit
    def __call__(
        self, cache: cute.Tensor, tail: cute.Tensor, tail_slots: cute.Tensor,
        key: cute.Tensor, score: cute.Tensor, ape: cute.Tensor, slots: cute.Tensor,
        positions: cute.Tensor, requests: Int32, tokens: Int32, key_req: Int32,
        key_tok: Int32, score_req: Int32, score_tok: Int32, st: cuda.CUstream,
    ):  # fmt: skip
        self.kernel(
            cache,
            tail,
            tail_slots,
            key,
            score,
            ape,
            slots,
            positions,
            tokens,
            key_req,
            key_tok,
            score_req,
            score_tok,
        ).launch(grid=(requests, 1, 1), block=(32, 1, 1), stream=st, use_pdl=True)

    @cute.kernel
    def kernel(
        self, cache: cute.Tensor, tail: cute.Tensor, tail_slots: cute.Tensor,
        key: cute.Tensor, score: cute.Tensor, ape: cute.Tensor, slots: cute.Tensor,
        positions: cute.Tensor, tokens: Int32, key_req: Int32, key_tok: Int32,
        score_req: Int32, score_tok: Int32,
    ):  # fmt: skip
        req, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        dim = lane * 4
        # APE is a weight: read it before waiting on the producers.
        bias = [[ape[p * DIM + dim + e] for e in range(4)] for p in range(self.pool)]
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        for t in cutlass.range(tokens, unroll=1):
            idx = req * tokens + t
            loc = Int64(slots[idx])
            pos = Int32(positions[idx])
            tail_slot = Int64(tail_slots[idx])
            safe_pos = max(pos, Int32(0))
            slot = safe_pos % self.pool
            block = max(tail_slot, Int64(0)) // self.ring
            base = tail.iterator + block * self.tail_block
            key_words = load_words(
                key.iterator + Int64(req) * key_req + t * key_tok + dim, 2
            )
            score_words = load_words(
                score.iterator + Int64(req) * score_req + t * score_tok + dim, 2
            )
            # The completion reads the ring before this token's own stash.
            if loc >= 0 and pos >= 0 and slot == self.pool - 1:
                self.compress(
                    cache, base, bias, _bf16x4(key_words), _bf16x4(score_words),
                    safe_pos - slot, loc, lane, dim,
                )  # fmt: skip
            if pos >= 0 and tail_slot >= 0:
                row = base + (safe_pos % self.ring) * DIM + dim
                store_words(row, key_words)
                store_words(row + self.tail_half, score_words)

    @cute.jit
    def compress(
        self, cache, base, bias, current_key, current_score, start, loc, lane, dim
    ):
        scores = []
        keys = []
        for p in cutlass.range_constexpr(self.pool):
            if cutlass.const_expr(p == self.pool - 1):
                s, k = current_score, current_key
            else:
                row = base + ((start + p) % self.ring) * DIM + dim
                s = _bf16x4(load_words(row + self.tail_half, 2))
                k = _bf16x4(load_words(row, 2))
            scores.append([add(s[e], bias[p][e]) for e in range(4)])
            keys.append(k)
        x = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
        for e in cutlass.range_constexpr(4):
            peak = Float32(-float("inf"))
            for p in cutlass.range_constexpr(self.pool):
                peak = cute.arch.fmax(peak, scores[p][e])
            denom = Float32(0.0)
            acc = Float32(0.0)
            for p in cutlass.range_constexpr(self.pool):
                prob = exp_diff(scores[p][e], peak)
                denom = add(denom, prob)
                acc = fma(prob, keys[p][e], acc)
            x[e] = round_bf16(div(acc, denom))
        # Strides 1 and 2 inside the lane: (a, b) -> (a + b, a - b).
        for stride in cutlass.range_constexpr(1, 3):
            for i in cutlass.range_constexpr(4):
                if cutlass.const_expr(i % (2 * stride) < stride):
                    a, b = x[i], x[i + stride]
                    x[i], x[i + stride] = a + b, a - b
        # Strides 4..64 pair lanes l and l ^ (stride / 4); the lower lane holds a.
        for shift in cutlass.range_constexpr(5):
            upper = (lane >> shift) & 1
            for i in cutlass.range_constexpr(4):
                other = cute.arch.shuffle_sync_bfly(x[i], offset=1 << shift)
                if upper == 1:
                    x[i] = other - x[i]
                else:
                    x[i] = x[i] + other
        amax = Float32(0.0)
        for i in cutlass.range_constexpr(4):
            x[i] = round_bf16(x[i] * Float32(INV_SQRT_DIM))
            amax = cute.arch.fmax(amax, cute.arch.fmax(x[i], -x[i]))
        for shift in cutlass.range_constexpr(5):
            amax = cute.arch.fmax(
                amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << shift)
            )
        amax = cute.arch.fmax(amax, Float32(1e-4))
        ratio = amax * Float32(1.0 / FP8_MAX)
        scale = ratio
        exponent = Int32(0)
        if cutlass.const_expr(self.round_scale):
            # exp2 of an integer is exact: build the power of two from its bits.
            exponent = Int32(ceil(cute.math.log2(ratio, fastmath=False)))
            scale = bits_float(Uint32(exponent + 127) << 23)
        y = [
            cute.arch.fmin(
                cute.arch.fmax(div(x[i], scale), Float32(-FP8_MAX)), Float32(FP8_MAX)
            )
            for i in range(4)
        ]
        page_base = cache.iterator + (loc // self.page) * self.page_bytes
        in_page = loc % self.page
        store_words(page_base + in_page * DIM + dim, (pack_fp8(*y),))
        if lane == 0:
            word = float_bits(scale)
            if cutlass.const_expr(self.mx):
                word = Uint32(exponent + 127) * Uint32(0x01010101)
            store_words(page_base + self.page * DIM + in_page * 4, (word,))


def kpool_update(
    kv_cache: torch.Tensor,
    tail_kv_cache: torch.Tensor,
    tail_slot_mapping: torch.Tensor,
    key: torch.Tensor,
    slot_score: torch.Tensor,
    ape: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    pool_size: int,
    *,
    mx_scales: bool = True,
    round_scale: bool = True,
) -> None:
    """``kpool_decode_update_and_maybe_write_cache_batched`` for ``head_dim``
    128 with the same arguments; ``mx_scales`` is what the stock kernel reads
    from ``mqa_logits_use_mx_scales()`` (UE8M0 bytes, else FP32 scales)."""
    requests, tokens = key.shape[0], key.shape[1]
    if requests == 0 or tokens == 0:
        return
    _check(pool_size == POOL, "pool_size", str(POOL), pool_size)
    _check(kv_cache.dtype == torch.uint8, "kv_cache", "uint8", kv_cache.dtype)
    _check(
        kv_cache.ndim == 3 and kv_cache.stride(0) % 4 == 0 and kv_cache.stride(2) == 1,
        "kv_cache", "[blocks, page, bytes] with 4-byte pages", kv_cache.stride(),
    )  # fmt: skip
    _check(
        tail_kv_cache.dtype == torch.bfloat16 and tail_kv_cache.ndim == 4,
        "tail_kv_cache", "bf16 [blocks, 2, ring, 128]", tail_kv_cache.shape,
    )  # fmt: skip
    ring = tail_kv_cache.shape[2]
    _check(
        ring % pool_size == 0
        and tail_kv_cache.shape[3] == DIM
        and tail_kv_cache.stride()[2:] == (DIM, 1)
        and tail_kv_cache.stride(0) % 4 == 0
        and tail_kv_cache.stride(1) % 4 == 0,
        "tail_kv_cache", "a ring of whole pools of 128 contiguous dims",
        (tuple(tail_kv_cache.shape), tail_kv_cache.stride()),
    )  # fmt: skip
    for name, t in (("key", key), ("slot_score", slot_score)):
        _check(
            t.dtype == torch.bfloat16
            and t.shape == (requests, tokens, DIM)
            and t.stride(2) == 1
            and t.stride(0) % 4 == 0
            and t.stride(1) % 4 == 0,
            name, f"bf16 [{requests}, {tokens}, 128] with unit dim stride",
            (t.dtype, tuple(t.shape), t.stride()),
        )  # fmt: skip
    _check(
        ape.dtype == torch.float32 and ape.shape == (pool_size, DIM)
        and ape.is_contiguous(),
        "ape", "a contiguous fp32 [4, 128]", (ape.dtype, tuple(ape.shape)),
    )  # fmt: skip
    for name, t in (
        ("tail_slot_mapping", tail_slot_mapping),
        ("slot_mapping", slot_mapping),
        ("positions", positions),
    ):
        _check(
            t.shape == (requests, tokens) and t.is_contiguous()
            and t.dtype in (torch.int32, torch.int64),
            name, f"a contiguous int32/int64 [{requests}, {tokens}]",
            (t.dtype, tuple(t.shape), t.stride()),
        )  # fmt: skip
    key_ = _update_key(
        kv_cache, tail_kv_cache, tail_slot_mapping, slot_mapping, positions,
        mx_scales, round_scale,
    )  # fmt: skip
    tensors = dict(
        kv_cache=(kv_cache, 4), tail_kv_cache=(tail_kv_cache, 8),
        tail_slot_mapping=(tail_slot_mapping, 4), key=(key, 8),
        slot_score=(slot_score, 8), ape=(ape, 16), slot_mapping=(slot_mapping, 4),
        positions=(positions, 4),
    )  # fmt: skip
    args = [to_cute(flat(t), align, name) for name, (t, align) in tensors.items()]
    scalars = (
        Int32(requests), Int32(tokens), Int32(key.stride(0)), Int32(key.stride(1)),
        Int32(slot_score.stride(0)), Int32(slot_score.stride(1)),
    )  # fmt: skip
    args += [*scalars, stream(key.device)]
    _kernel(key_, lambda: _UpdateKernel(*key_[1]), args)(*args)


def _update_key(
    kv_cache, tail_kv_cache, tail_slots, slots, positions, mx_scales, round_scale
):
    config = (
        POOL, tail_kv_cache.shape[2], kv_cache.shape[1], kv_cache.stride(0),
        tail_kv_cache.stride(0), tail_kv_cache.stride(1), mx_scales, round_scale,
    )  # fmt: skip
    dtypes = (tail_slots.dtype, slots.dtype, positions.dtype)
    return ("update", config, dtypes, kv_cache.device.index)


# --- expand_pools -----------------------------------------------------------


class _ExpandKernel:
    """Thread ``g`` of row ``r`` writes the four token ids of pool
    ``pool_ids[r, g]`` with one 16-byte store; CTA 0's first ``pool - 1``
    threads write the trailing incomplete pool."""

    def __init__(self, pool: int, groups: int, threads: int, pdl: bool):
        assert pool == POOL
        self.pool, self.groups, self.threads, self.pdl = pool, groups, threads, pdl

    @cute.jit
    def __call__(
        self, pool_ids: cute.Tensor, positions: cute.Tensor, out: cute.Tensor,
        rows: Int32, ids_stride: Int32, out_stride: Int32, seq_offset: Int32,
        st: cuda.CUstream,
    ):  # fmt: skip
        ctas = (self.groups + self.threads - 1) // self.threads
        args = (pool_ids, positions, out, ids_stride, out_stride, seq_offset)
        self.kernel(*args).launch(
            grid=(rows, ctas, 1), block=(self.threads, 1, 1), stream=st,
            use_pdl=self.pdl,
        )  # fmt: skip

    @cute.kernel
    def kernel(self, pool_ids, positions, out, ids_stride, out_stride, seq_offset):
        row, cta, _ = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        g = cta * self.threads + tid
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        row_out = Int64(row) * out_stride
        if g < self.groups:
            pid = Int32(pool_ids[Int64(row) * ids_stride + g])
            # int32 arithmetic wraps as the stock kernel's does.
            first = pid * self.pool
            words = [Uint32(first + o) for o in range(self.pool)]
            if pid < 0:
                words = [Uint32(0xFFFFFFFF)] * self.pool
            store_words(out.iterator + row_out + g * self.pool, words)
        if cta == 0 and tid < self.pool - 1:
            seq_len = Int32(positions[row]) + seq_offset
            tail_start = trunc_div(seq_len, self.pool) * self.pool
            value = Int32(-1)
            if tid < seq_len - tail_start:
                value = tail_start + tid
            out[row_out + self.groups * self.pool + tid] = value


def expand_pools(
    pool_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    pool_size: int,
    *,
    seq_offset: int = 0,
    out: torch.Tensor,
    threads: int = EXPAND_THREADS,
    pdl: bool = True,
) -> torch.Tensor:
    """``expand_pools_and_append_tail`` into ``out`` for int32 pool ids."""
    rows, groups = pool_ids.shape
    out_cols = groups * pool_size + pool_size - 1
    _check(pool_size == POOL, "pool_size", str(POOL), pool_size)
    _check(
        pool_ids.dtype == torch.int32 and pool_ids.stride(1) == 1,
        "pool_ids", "int32, unit column stride", (pool_ids.dtype, pool_ids.stride()),
    )  # fmt: skip
    _check(
        out.dtype == torch.int32 and out.ndim == 2 and out.stride(1) == 1
        and out.shape[0] >= rows and out.shape[1] >= out_cols,
        "out", f"int32 [>={rows}, >={out_cols}] with unit column stride",
        (out.dtype, tuple(out.shape), out.stride()),
    )  # fmt: skip
    _check(
        out.stride(0) % 4 == 0 and out.data_ptr() % 16 == 0,
        "out", "16-byte aligned rows", (out.stride(0), hex(out.data_ptr())),
    )  # fmt: skip
    _check(
        seq_lens.ndim == 1 and seq_lens.shape[0] >= rows and seq_lens.stride(0) == 1
        and seq_lens.dtype in (torch.int32, torch.int64),
        "seq_lens", f"int32/int64 [>={rows}] with unit stride",
        (seq_lens.dtype, tuple(seq_lens.shape), seq_lens.stride()),
    )  # fmt: skip
    if rows:
        args = [
            to_cute(flat(pool_ids), 4, "pool_ids"),
            to_cute(flat(seq_lens[:rows]), 4, "seq_lens"),
            to_cute(flat(out[:rows, :out_cols]), 16, "out"),
            Int32(rows), Int32(pool_ids.stride(0)), Int32(out.stride(0)),
            Int32(seq_offset), stream(out.device),
        ]  # fmt: skip
        key = _expand_key(groups, seq_lens, out.device, threads, pdl)
        _kernel(key, lambda: _ExpandKernel(*key[1]), args)(*args)
    return out[:rows, :out_cols]


def _expand_key(groups, seq_lens, device, threads=EXPAND_THREADS, pdl=True):
    return ("expand", (POOL, groups, threads, pdl), seq_lens.dtype, device.index)


# --- expand_and_remap -------------------------------------------------------


class _RemapKernel:
    """``expand_pools_and_append_tail`` and the sparse MLA index remap with
    COMPACT_TO_FRONT in one CTA per query row.

    Thread ``g`` maps pool ``pool_ids[row, g]``: its tokens share one KV block,
    so the pool is valid or invalid as a whole and every compacted offset is a
    multiple of 4 (one 16-byte store). The column order of the stock
    compaction is kept: history pools by rank, then the trailing incomplete
    pool, then -1. Rows from ``expanded`` on hold no indices (the stock path
    filled them with -1).
    """

    def __init__(self, pool, groups, width, block_size, stride_rows):
        assert pool == POOL and block_size % pool == 0 and groups % 32 == 0
        assert groups * pool + pool - 1 <= width and width % 4 == 0
        assert stock_compacts_in_order(width)
        self.pool, self.groups, self.width = pool, groups, width
        self.block_size, self.stride_rows = block_size, stride_rows
        self.warps = groups // 32

    @cute.jit
    def __call__(
        self, pool_ids: cute.Tensor, positions: cute.Tensor, req_ids: cute.Tensor,
        block_table: cute.Tensor, out: cute.Tensor, counts: cute.Tensor,
        rows: Int32, expanded: Int32, ids_stride: Int32, bt_stride: Int32,
        max_blocks: Int32, seq_offset: Int32, st: cuda.CUstream,
    ):  # fmt: skip
        self.kernel(
            pool_ids,
            positions,
            req_ids,
            block_table,
            out,
            counts,
            expanded,
            ids_stride,
            bt_stride,
            max_blocks,
            seq_offset,
        ).launch(grid=(rows, 1, 1), block=(self.groups, 1, 1), stream=st, use_pdl=True)

    @cute.jit
    def slot(self, block_table, req, bt_stride, token):
        """The physical row of logical token ``token`` (>= 0, block in range)."""
        block = token // self.block_size
        base = block_table[Int64(req) * bt_stride + block]
        return base * self.stride_rows + token % self.block_size

    @cute.kernel
    def kernel(
        self, pool_ids, positions, req_ids, block_table, out, counts, expanded,
        ids_stride, bt_stride, max_blocks, seq_offset,
    ):  # fmt: skip
        row, _, _ = cute.arch.block_idx()
        g, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        smem = cutlass.memory.SmemAllocator()
        warp_counts = smem.allocate_tensor(Int32, cute.make_layout(self.warps + 1))
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        req = req_ids[row]
        live = Int32(0)
        first = Int32(0)
        if row < expanded:
            pid = Int32(pool_ids[Int64(row) * ids_stride + g])
            # The stock expansion's int32 token ids: negative ones (wrapped
            # included) and blocks past the table are invalid.
            token = pid * self.pool
            block = token // self.block_size
            if pid >= 0 and token >= 0 and block < max_blocks:
                live = Int32(1)
                first = self.slot(block_table, req, bt_stride, token)
        ballot = cute.arch.vote_ballot_sync(live == 1)
        below = cute.arch.popc(ballot & ((Uint32(1) << lane) - Uint32(1)))
        if lane == 0:
            warp_counts[warp] = Int32(cute.arch.popc(ballot))
        cute.arch.barrier()
        prior = Int32(0)
        for w in cutlass.range(warp, unroll=1):
            prior += warp_counts[w]
        row_out = out.iterator + Int64(row) * self.width
        if live == 1:
            offset = (prior + Int32(below)) * self.pool
            store_words(row_out + offset, [Uint32(first + o) for o in range(self.pool)])
        if g == self.groups - 1:
            # The last thread knows the history total; it appends the tail.
            total = (prior + Int32(cute.arch.popc(ballot))) * self.pool
            if row < expanded:
                seq_len = Int32(positions[row]) + seq_offset
                tail_start = trunc_div(seq_len, self.pool) * self.pool
                for j in cutlass.range_constexpr(self.pool - 1):
                    token = tail_start + j
                    block = token // self.block_size
                    if j < seq_len - tail_start and block < max_blocks:
                        value = self.slot(block_table, req, bt_stride, token)
                        out[Int64(row) * self.width + total] = value
                        total += 1
            counts[row] = total
            warp_counts[self.warps] = total
        cute.arch.barrier()
        valid = warp_counts[self.warps]
        for c in cutlass.range(valid + g, self.width, self.groups, unroll=1):
            out[Int64(row) * self.width + c] = Int32(-1)


def expand_and_remap(
    pool_ids: torch.Tensor,
    positions: torch.Tensor,
    pool_size: int,
    req_ids: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    counts: torch.Tensor,
    *,
    block_size: int,
    stride_rows: int,
    seq_offset: int = 1,
) -> None:
    """``triton_convert_req_index_to_global_index(..., return_valid_counts=True)``
    of the ``expand_pools_and_append_tail`` rows of ``pool_ids``, the rest of
    the ``out.shape[0]`` rows read as -1. Writes ``out`` and ``counts``."""
    expanded, groups = pool_ids.shape
    rows, width = out.shape
    _check(pool_size == POOL, "pool_size", str(POOL), pool_size)
    _check(
        groups % 32 == 0 and 32 <= groups <= MAX_REMAP_GROUPS,
        "pool_ids", f"a multiple of 32 pools, at most {MAX_REMAP_GROUPS}", groups,
    )  # fmt: skip
    _check(
        block_size % pool_size == 0, "block_size", "a multiple of the pool size",
        block_size,
    )  # fmt: skip
    _check(
        out.dtype == torch.int32 and out.is_contiguous() and out.data_ptr() % 16 == 0
        and width % 4 == 0 and width >= groups * pool_size + pool_size - 1,
        "out", f"a contiguous 16-byte aligned int32 [rows, >={groups * 4 + 3}]",
        (out.dtype, tuple(out.shape), out.stride()),
    )  # fmt: skip
    _check(
        stock_compacts_in_order(width), "out",
        "a width the stock conversion compacts in column order", width,
    )  # fmt: skip
    _check(
        req_ids.dtype == torch.int32 and req_ids.ndim == 1
        and req_ids.shape[0] == rows and req_ids.stride(0) == 1,
        "req_ids", f"int32 [{rows}] with unit stride", (req_ids.dtype, req_ids.shape),
    )  # fmt: skip
    _check(
        counts.dtype == torch.int32 and counts.shape[0] >= rows
        and counts.stride(0) == 1,
        "counts", f"int32 [>={rows}] with unit stride", (counts.dtype, counts.shape),
    )  # fmt: skip
    _check(
        pool_ids.dtype == torch.int32 and pool_ids.stride(1) == 1,
        "pool_ids", "int32, unit column stride", (pool_ids.dtype, pool_ids.stride()),
    )  # fmt: skip
    _check(
        block_table.dtype == torch.int32 and block_table.ndim == 2
        and block_table.stride(1) == 1,
        "block_table", "int32 with unit column stride",
        (block_table.dtype, block_table.stride()),
    )  # fmt: skip
    _check(
        positions.ndim == 1 and positions.shape[0] >= expanded
        and positions.stride(0) == 1
        and positions.dtype in (torch.int32, torch.int64),
        "positions", f"int32/int64 [>={expanded}] with unit stride",
        (positions.dtype, tuple(positions.shape), positions.stride()),
    )  # fmt: skip
    if rows == 0:
        return
    # With nothing expanded the kernel reads neither: stand-ins keep the
    # launch free of allocations.
    ids = pool_ids if expanded else out
    pos = positions if positions.numel() else counts
    args = [
        to_cute(flat(ids), 4, "pool_ids"), to_cute(flat(pos), 4, "positions"),
        to_cute(req_ids, 4, "req_ids"), to_cute(flat(block_table), 4, "block_table"),
        to_cute(flat(out), 16, "out"), to_cute(counts[:rows], 4, "counts"),
        Int32(rows), Int32(expanded), Int32(ids.stride(0)),
        Int32(block_table.stride(0)), Int32(block_table.shape[1]),
        Int32(seq_offset), stream(out.device),
    ]  # fmt: skip
    key = _remap_key(groups, width, block_size, stride_rows, pos, out.device)
    _kernel(key, lambda: _RemapKernel(*key[1]), args)(*args)


def _remap_key(groups, width, block_size, stride_rows, positions, device):
    config = (POOL, groups, width, block_size, stride_rows)
    return ("remap", config, positions.dtype, device.index)


# --- upcast_logits ----------------------------------------------------------


class _UpcastKernel:
    """CTA ``(row, split)`` converts the row's 8-element chunks ``split``,
    ``split + splits``, ... below the row end; a thread takes ``unroll``
    chunks a step, their loads in flight together."""

    def __init__(self, threads: int, pdl: bool = True, unroll: int = 1):
        self.threads, self.pdl, self.unroll = threads, pdl, unroll

    @cute.jit
    def __call__(
        self, src: cute.Tensor, dst: cute.Tensor, ends: cute.Tensor, rows: Int32,
        splits: Int32, stride: Int32, st: cuda.CUstream,
    ):  # fmt: skip
        self.kernel(src, dst, ends, stride).launch(
            grid=(rows, splits, 1), block=(self.threads, 1, 1), stream=st,
            use_pdl=self.pdl,
        )  # fmt: skip

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor, ends: cute.Tensor, stride):
        row, split, _ = cute.arch.block_idx()
        _, splits, _ = cute.arch.grid_dim()
        tid, _, _ = cute.arch.thread_idx()
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        end = ends[row]
        offset = Int64(row) * stride
        step = splits * self.threads * 8
        start = (split * self.threads + tid) * 8
        for first in cutlass.range(start, end, step * self.unroll, unroll=1):
            chunks = [first + k * step for k in range(self.unroll)]
            words = [
                load_words_if(src.iterator + offset + c, 4, c + 8 <= end)
                for c in chunks
            ]
            for c, w in zip(chunks, words, strict=True):
                values = []
                for i in cutlass.range_constexpr(4):
                    lo, hi = unpack_bf16(w[i])
                    values += [float_bits(lo), float_bits(hi)]
                full = c + 8 <= end
                store_words_if(dst.iterator + offset + c, values[:4], full)
                store_words_if(dst.iterator + offset + c + 4, values[4:], full)
                if c < end and c + 8 > end:
                    for e in cutlass.range(c, end, unroll=1):
                        dst[offset + e] = Float32(src[offset + e])


def upcast_logits(
    logits: torch.Tensor,
    row_ends: torch.Tensor,
    threads: int | None = None,
    pdl: bool = True,
    cap: int = UPCAST_CTAS,
    *,
    unroll: int = UPCAST_UNROLL,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``as_fp32_logits`` for BF16 logits whose row stride is 16-byte aligned;
    ``out`` (default: a new tensor with the strides of ``logits``) receives the
    columns below each row end, the rest untouched. ``threads`` per CTA
    defaults by size (``UPCAST_THREADS``)."""
    if out is None:
        out = torch.empty_strided(
            logits.shape, logits.stride(), dtype=torch.float32, device=logits.device
        )
    _check(
        out.dtype == torch.float32 and out.shape == logits.shape
        and out.stride() == logits.stride(),
        "out", "fp32 with the shape and strides of logits",
        (out.dtype, tuple(out.shape), out.stride()),
    )  # fmt: skip
    rows, width = logits.shape
    if rows == 0 or width == 0:
        return out
    _check(logits.dtype == torch.bfloat16, "logits", "bf16", logits.dtype)
    _check(
        logits.stride(1) == 1 and logits.stride(0) % 8 == 0
        and logits.data_ptr() % 16 == 0,
        "logits", "unit column stride and 16-byte aligned rows",
        (logits.stride(), hex(logits.data_ptr())),
    )  # fmt: skip
    _check(
        row_ends.dtype == torch.int32 and row_ends.numel() == rows,
        "row_ends", f"int32 with {rows} elements", (row_ends.dtype, row_ends.shape),
    )  # fmt: skip
    ends = row_ends.reshape(-1)
    _check(ends.stride(0) == 1, "row_ends", "contiguous", row_ends.stride())
    threads = threads or _upcast_threads(rows, width)
    chunk = threads * 8
    splits = min((width + chunk - 1) // chunk, max(1, cap // rows))
    args = [
        to_cute(flat(logits), 16, "logits"), to_cute(flat(out), 16, "out"),
        to_cute(ends, 4, "row_ends"),
        Int32(rows), Int32(splits), Int32(logits.stride(0)), stream(logits.device),
    ]  # fmt: skip
    key = _upcast_key(logits.device, threads, pdl, unroll)
    _kernel(key, lambda: _UpcastKernel(*key[1]), args)(*args)
    return out


def _upcast_threads(rows: int, width: int) -> int:
    return UPCAST_THREADS[rows * width >= UPCAST_LARGE]


def _upcast_key(device, threads, pdl=True, unroll=UPCAST_UNROLL):
    return ("upcast", (threads, pdl, unroll), device.index)


# --- Integration ------------------------------------------------------------


class FusedRemap:
    """A sparse MLA index group's conversion that expands a deferred pool top-k
    and remaps it in one kernel, on the group's side stream as the stock
    conversion. Installed as the group's ``_convert_once``; without a deferred
    top-k it runs the stock conversion."""

    def __init__(self, group, stage: "KpoolStage"):
        self.group, self.stage = group, stage
        self.stock = group._convert_once
        group._convert_once = self

    def __call__(
        self, layer_index, logical, req_ids, block_table, block_size, *,
        block_stride_rows, return_valid_counts, idx_mapping=None,
    ):  # fmt: skip
        pending, self.stage.pending = self.stage.pending, None
        kwargs = dict(
            block_stride_rows=block_stride_rows,
            return_valid_counts=return_valid_counts,
        )
        if idx_mapping is not None:
            kwargs["idx_mapping"] = idx_mapping
        if pending is None:
            return self.stock(
                layer_index, logical, req_ids, block_table, block_size, **kwargs
            )
        group = self.group
        rows = logical.shape[0]
        stride_rows = block_stride_rows or block_size
        if (
            layer_index != 0
            or not return_valid_counts
            or idx_mapping is not None
            or rows > group.physical_topk_indices.shape[0]
            or not _remap_takes(
                pending, logical, req_ids, block_table, block_size, stride_rows
            )
        ):
            self.stage.materialize(pending, logical)
            return self.stock(
                layer_index, logical, req_ids, block_table, block_size, **kwargs
            )
        out = group.physical_topk_indices[:rows]
        counts = group.valid_topk_counts[:rows]
        compute_stream = current_stream()
        if not in_piecewise_cudagraph():
            group.side_stream.wait_event(group.logical_topk_ready)
        else:
            group.side_stream.wait_stream(compute_stream)
        pool_ids, positions, pool_size = pending
        with group.side_stream:
            expand_and_remap(
                pool_ids, positions, pool_size, req_ids, block_table, out, counts,
                block_size=block_size, stride_rows=stride_rows,
            )  # fmt: skip
            group.physical_topk_ready.record(group.side_stream)
        compute_stream.wait_event(group.physical_topk_ready)
        return out, counts


class KpoolStage:
    """The kpool indexer decode kernels inside planned steps (stage
    ``dsa_kpool``), reached from the stock indexer through
    ``sparse_indexer.SPECIALIZED_KPOOL``.

    With ``fuse`` every DSA layer's index group converts through
    ``FusedRemap``: the indexer then leaves its uniform decode rows as pool ids
    (``defer``) and skips filling the logical top-k buffer, which no consumer
    reads. ``why_not_fused`` says which group requirement failed otherwise.
    """

    def __init__(self, attentions, max_rows: int, device):
        self.pending: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.fuse = False
        # Indexer caches of the fused layers: others (the MTP draft's) never
        # reach a FusedRemap, so they must not defer.
        self.layers: set[str] = set()
        self.max_rows = max_rows
        self.pool_buffer = torch.empty(
            (max_rows, MAX_REMAP_GROUPS), dtype=torch.int32, device=device
        )
        impls = [attn.mla_attn.mla_attn.impl for attn in attentions]
        groups = [getattr(impl, "index_group", None) for impl in impls]
        self.why_not_fused = [
            self._unfusable(impl, group)
            for impl, group in zip(impls, groups, strict=True)
        ]
        if attentions and not any(self.why_not_fused):
            self.fuse = True
            self.layers = {str(attn.indexer.k_cache.prefix) for attn in attentions}
            for group in groups:
                FusedRemap(group, self)

    @staticmethod
    def _unfusable(impl, group) -> str | None:
        """Why ``group`` cannot convert through a ``FusedRemap``, or None."""
        requirements = (
            (type(group) is SparseMLAIndexGroup, "not a plain SparseMLAIndexGroup"),
            (getattr(group, "has_indexer", False), "no indexer"),
            (getattr(group, "num_layers", 0) == 1, "more than one layer"),
            (
                not getattr(impl, "group_conversion_decode_only", True),
                "does not convert prefill rows",
            ),
            (getattr(impl, "dcp_world_size", 1) == 1, "decode context parallel"),
            (
                _converts_through_group(impl),
                f"{type(impl).__name__} reads the logical top-k rows",
            ),
        )
        return next((why for ok, why in requirements if not ok), None)

    @staticmethod
    def active() -> bool:
        return planned()

    def defers(self, layer, rows: int, topk: int, pool_size: int, width: int) -> bool:
        groups = topk // pool_size
        return (
            str(layer) in self.layers
            and pool_size == POOL
            and rows <= self.max_rows
            and groups % 32 == 0
            and groups <= MAX_REMAP_GROUPS
            and topk + pool_size - 1 <= width
            and width % 4 == 0
            and stock_compacts_in_order(width)
        )

    def pool_ids(self, rows: int, groups: int) -> torch.Tensor:
        return self.pool_buffer.view(-1)[: rows * groups].view(rows, groups)

    def defer(self, pool_ids, positions, pool_size: int) -> None:
        """Leaves the expansion of ``pool_ids`` to the layer's index remap."""
        assert self.pending is None, "a deferred kpool top-k was not consumed"
        assert pool_ids.data_ptr() == self.pool_buffer.data_ptr()
        self.pending = (pool_ids, positions, pool_size)

    @classmethod
    def materialize(cls, pending, logical: torch.Tensor) -> None:
        """The logical top-k rows the stock indexer would have written."""
        pool_ids, positions, pool_size = pending
        logical.fill_(-1)
        cls.expand(pool_ids, positions, pool_size, seq_offset=1, out=logical)

    def warmup(self, attentions, *, max_rows: int, positions_dtype=torch.int64):
        """Compiles every kernel a planned step of these DSA layers can launch
        by launching each once on scratch inputs (padding rows: nothing real is
        written), so no decode step or CUDA graph capture compiles."""
        del max_rows  # shapes are runtime values: one compile serves all rows
        device = self.pool_buffer.device
        mx = mqa_logits_use_mx_scales()
        positions = {torch.int32, positions_dtype}
        for attn in attentions:
            indexer = attn.indexer
            round_scale = getattr(indexer, "scale_fmt", "ue8m0") is not None
            kv, tail = indexer.k_cache.kv_cache, indexer.tail_cache.kv_cache
            for index_dtype in (torch.int64, torch.int32):
                _warm_update(kv, tail, index_dtype, mx, round_scale)
            groups = indexer.topk_tokens // POOL
            for dtype in positions:
                _warm_expand(groups, dtype, device)
            width = indexer.topk_indices_buffer.shape[1]
            layout = _remap_layout(attn) if self.fuse else None
            if layout is not None and self.defers(
                indexer.k_cache.prefix, 1, indexer.topk_tokens, POOL, width
            ):
                for dtype in positions:
                    _warm_remap(groups, width, *layout, dtype, device)
        _warm_upcast(device)
        torch.cuda.synchronize(device)

    @staticmethod
    def update(
        kv_cache, tail_kv_cache, tail_slot_mapping, key, slot_score, ape,
        slot_mapping, positions, pool_size, head_dim=DIM, round_scale=True,
    ):  # fmt: skip
        if not _update_takes(
            kv_cache, tail_kv_cache, tail_slot_mapping, key, slot_score, ape,
            slot_mapping, positions, pool_size, head_dim,
        ) or not ready(_update_key(
            kv_cache, tail_kv_cache, tail_slot_mapping, slot_mapping, positions,
            mqa_logits_use_mx_scales(), round_scale,
        )):  # fmt: skip
            return kpool_decode_update_and_maybe_write_cache_batched(
                kv_cache, tail_kv_cache, tail_slot_mapping, key, slot_score, ape,
                slot_mapping, positions, pool_size, head_dim, round_scale=round_scale,
            )  # fmt: skip
        kpool_update(
            kv_cache, tail_kv_cache, tail_slot_mapping, key, slot_score, ape,
            slot_mapping, positions, pool_size,
            mx_scales=mqa_logits_use_mx_scales(), round_scale=round_scale,
        )  # fmt: skip

    @staticmethod
    def upcast(logits: torch.Tensor, row_ends: torch.Tensor) -> torch.Tensor:
        if (
            logits.dtype != torch.bfloat16
            or logits.ndim != 2
            or logits.stride(1) != 1
            or logits.stride(0) % 8
            or logits.data_ptr() % 16
            or row_ends.dtype != torch.int32
            or row_ends.numel() != logits.shape[0]
            or not row_ends.is_contiguous()
            or not ready(_upcast_key(logits.device, _upcast_threads(*logits.shape)))
        ):
            return as_fp32_logits(logits, row_ends)
        return upcast_logits(logits, row_ends)

    @staticmethod
    def expand(pool_ids, seq_lens, pool_size, *, seq_offset=0, out=None):
        if (
            out is None
            or pool_size != POOL
            or pool_ids.dtype != torch.int32
            or pool_ids.stride(1) != 1
            or out.dtype != torch.int32
            or out.stride(1) != 1
            or out.stride(0) % 4
            or out.data_ptr() % 16
            or seq_lens.ndim != 1
            or seq_lens.stride(0) != 1
            or seq_lens.dtype not in (torch.int32, torch.int64)
            or not ready(_expand_key(pool_ids.shape[1], seq_lens, out.device))
        ):
            return expand_pools_and_append_tail(
                pool_ids, seq_lens, pool_size, seq_offset=seq_offset, out=out
            )
        return expand_pools(
            pool_ids, seq_lens, pool_size, seq_offset=seq_offset, out=out
        )


def _update_takes(
    kv_cache, tail_kv_cache, tail_slot_mapping, key, slot_score, ape,
    slot_mapping, positions, pool_size, head_dim,
) -> bool:  # fmt: skip
    """Whether ``kpool_update`` takes these stock arguments (else stock runs)."""
    ints = (tail_slot_mapping, slot_mapping, positions)
    return (
        head_dim == DIM
        and pool_size == POOL
        and kv_cache.dtype == torch.uint8
        and kv_cache.ndim == 3
        and kv_cache.stride(0) % 4 == 0
        and kv_cache.stride(2) == 1
        and kv_cache.data_ptr() % 4 == 0
        and tail_kv_cache.dtype == torch.bfloat16
        and tail_kv_cache.ndim == 4
        and tail_kv_cache.shape[1] == 2
        and tail_kv_cache.shape[2] % POOL == 0
        and tail_kv_cache.shape[3] == DIM
        and tail_kv_cache.stride()[2:] == (DIM, 1)
        and tail_kv_cache.stride(0) % 4 == 0
        and tail_kv_cache.stride(1) % 4 == 0
        and tail_kv_cache.data_ptr() % 8 == 0
        and all(
            t.dtype == torch.bfloat16
            and t.ndim == 3
            and t.shape == key.shape
            and t.shape[2] == DIM
            and t.stride(2) == 1
            and t.stride(0) % 4 == 0
            and t.stride(1) % 4 == 0
            and t.data_ptr() % 8 == 0
            for t in (key, slot_score)
        )
        and ape.dtype == torch.float32
        and ape.shape == (POOL, DIM)
        and ape.is_contiguous()
        and ape.data_ptr() % 16 == 0
        and all(
            t.dtype in (torch.int32, torch.int64)
            and t.shape == key.shape[:2]
            and t.is_contiguous()
            for t in ints
        )
    )


def _remap_takes(pending, logical, req_ids, block_table, block_size, stride_rows):
    """Whether ``expand_and_remap`` takes a deferred top-k's conversion."""
    pool_ids, positions, _ = pending
    groups, width = pool_ids.shape[1], logical.shape[1]
    return (
        block_size % POOL == 0
        and block_table.dtype == torch.int32
        and block_table.ndim == 2
        and block_table.stride(1) == 1
        and req_ids.dtype == torch.int32
        and req_ids.ndim == 1
        and req_ids.stride(0) == 1
        and req_ids.shape[0] == logical.shape[0]
        and positions.ndim == 1
        and positions.stride(0) == 1
        and positions.shape[0] >= pool_ids.shape[0]
        and positions.dtype in (torch.int32, torch.int64)
        and width % 4 == 0
        and stock_compacts_in_order(width)
        and ready(
            _remap_key(
                groups, width, block_size, stride_rows, positions, logical.device
            )
        )
    )


def _remap_layout(attn) -> tuple[int, int] | None:
    """(block size, rows between blocks) of the MLA KV cache a DSA layer's
    index group converts for, as ``flat_kv_row_view`` reads it; None if the
    cache is not bound as a [blocks, block size, row] tensor."""
    kv = getattr(getattr(attn.mla_attn, "mla_attn", None), "kv_cache", None)
    if not isinstance(kv, torch.Tensor) or kv.ndim != 3 or kv.stride(0) % kv.shape[2]:
        return None
    return kv.shape[1], kv.stride(0) // kv.shape[2]


def _warm_update(kv, tail, index_dtype, mx, round_scale) -> None:
    device = kv.device
    # One page and one tail block with the real caches' layouts.
    page = torch.empty(kv.stride(0), dtype=torch.uint8, device=device)
    page = page.as_strided((1, *kv.shape[1:]), kv.stride())
    block = torch.empty(tail.stride(0), dtype=tail.dtype, device=device)
    block = block.as_strided((1, *tail.shape[1:]), tail.stride())
    row = torch.zeros(1, 1, DIM, dtype=torch.bfloat16, device=device)
    padding = torch.full((1, 1), -1, dtype=index_dtype, device=device)
    kpool_update(
        page, block, padding, row, row, torch.zeros(POOL, DIM, device=device),
        padding, padding.to(torch.int32), POOL, mx_scales=mx, round_scale=round_scale,
    )  # fmt: skip


def _warm_expand(groups, dtype, device) -> None:
    ids = torch.full((1, groups), -1, dtype=torch.int32, device=device)
    out = torch.empty(1, groups * POOL + POOL, dtype=torch.int32, device=device)
    expand_pools(ids, torch.zeros(1, dtype=dtype, device=device), POOL, out=out)


def _warm_remap(groups, width, block_size, stride_rows, dtype, device) -> None:
    ids = torch.full((1, groups), -1, dtype=torch.int32, device=device)
    ints = torch.zeros(2, dtype=torch.int32, device=device)
    expand_and_remap(
        ids, torch.zeros(1, dtype=dtype, device=device), POOL, ints[:1],
        ints[:1].view(1, 1), torch.empty(1, width, dtype=torch.int32, device=device),
        ints, block_size=block_size, stride_rows=stride_rows,
    )  # fmt: skip


def _warm_upcast(device) -> None:
    logits = torch.zeros(1, 8, dtype=torch.bfloat16, device=device)
    for threads in UPCAST_THREADS:
        ends = torch.zeros(1, dtype=torch.int32, device=device)
        upcast_logits(logits, ends, threads)


def _converts_through_group(impl) -> bool:
    """Whether ``impl``'s decode steps convert the top-k through its index
    group (where a deferred top-k is expanded). vLLM 0.33.0's FlashInfer SM90
    backend converts the logical rows itself, which a deferral leaves unset."""
    from vllm.model_executor.layers.attention.sparse_mla_attention import (
        SparseMLACommonImpl,
    )
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl

    converts = (SparseMLACommonImpl.forward_mqa, FlashMLASparseImpl.forward_mqa)
    return getattr(type(impl), "forward_mqa", None) in converts
