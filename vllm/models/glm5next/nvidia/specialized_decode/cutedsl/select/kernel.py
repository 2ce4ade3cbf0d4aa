# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pool top-k ("select"): the exact top ``k`` columns of each logits
row below its end, by value, in ascending column order. It stands in for
``get_indexer_topk(backend)(logits, lengths, next_n, out, k, max_seq_len)``
of GLM-5-Next's decode (vLLM's ``cooperative_topk`` / ``persistent_topk``),
with the same set and a stated order where stock's is its atomics'
(docs/select-contract.md):

- Row ``r``'s valid columns are ``[0, end)``, ``end = clamp(ends[r], 0,
  width)`` (stock reads past the row for a longer end and takes nothing for
  a negative one); nothing at or past the end is read.
- The order is that of the 32-bit key stock's top-k refines on
  (``convert_to_uint32_v2``, FlashInfer's ``ToOrdered``): the bits with the
  sign bit set for a positive sign, all bits flipped for a negative one.
  That is IEEE totalOrder: ``-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf <
  +NaN``, denormals by value. A BF16 row orders by the 16-bit key of the
  same rule, which is the FP32 key of its exact upcast (``as_fp32_logits``),
  so SM100's logits need no upcast.
- A row with ``end <= k`` takes all its valid columns: ``0, 1, ..., end - 1,
  -1, ..., -1``, stock's own bytes.
- A row with ``end > k`` takes exactly ``k`` columns: every column whose key
  is above the ``k``-th largest key ``T`` and, of those equal to ``T``, the
  lowest ids (stock: atomics' order), listed in ascending column order.

Bytes differ from stock's wherever stock's order or tie choice does: the
stage runs it only when the deployment opts in (``kpool_select``).

A cluster of ``C`` CTAs (1024 threads each) selects one row; CTA ``rank``
owns the slice ``[rank * S, (rank + 1) * S)`` of its valid columns (``S =
ceil(end / C)`` rounded up to the load vector) and reads it once from global
memory into shared memory as order keys. Radix passes of 8-bit digits (4 for
FP32, 2 for BF16) count each CTA's matching keys into its shared histogram
(pass 0 while loading). After one cluster
barrier a pass, every CTA sums the ``C`` histograms through distributed
shared memory and finds the threshold digit itself. While summing, each
thread also sums the bins of the ranks before its own, which gives the CTA
the counts above and equal to the threshold before its slice: the
compaction writes column ``c`` at ``above_c + min(equal_c, need)`` with no
further cluster barrier. On FP32 rows, a pass whose bin the set takes whole
(its count is what the set still needs: on ``randn`` logits the third pass,
mostly) ends the passes: the threshold is then just below the bin.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from quack.utils import warp_prefix_sum

from ..common.ptx import inline_ptx, load_words_if

THREADS = 1024
WARPS = THREADS // 32
# The radix digits, most significant first: 8 bits, since the cluster-wide
# histogram sum of a wider digit costs more than the pass it saves.
DIGITS = {torch.float32: (8, 8, 8, 8), torch.bfloat16: (8, 8)}
BINS = 256
# Keys a CTA holds in shared memory: the smallest entry that holds its
# slice (the compile key's ``capacity``, each a multiple of the 4096-column
# tile); 53248 keys (208 KiB) plus the histograms stay under 227 KiB.
CAPACITIES = (4096, 8192, 16384, 32768, 53248)
# 16 bytes a thread loads at once: 4 FP32 or 8 BF16 columns.
DTYPES = {torch.float32: Float32, torch.bfloat16: BFloat16}
VECTOR = {torch.float32: 4, torch.bfloat16: 8}
_KEY_BITS = {torch.float32: 32, torch.bfloat16: 16}
# Keys a thread takes from shared memory at once (one 16-byte load).
_GROUP = 4
_TILE = THREADS * _GROUP
# 16-byte row loads in flight per thread while loading the slice.
_UNROLL = 4


@inline_ptx(Uint32, pure=True)
def _key32(word):
    """The FP32 key of ``word``: sign bit set for a positive sign, every bit
    flipped for a negative one (an unsigned order of the IEEE totalOrder)."""
    code = "{ .reg .b32 m; shr.s32 m,$1,31; or.b32 m,m,0x80000000; xor.b32 $0,$1,m; }"
    return code, "=r,r", (Uint32(word),)


@inline_ptx(Uint32, pure=True)
def _key16(half):
    """The 16-bit key of the BF16 bits in the low half of ``half`` (the high
    half of the FP32 key of its exact upcast)."""
    code = (
        "{ .reg .b32 t,m; shl.b32 t,$1,16; shr.s32 m,t,31; "
        "or.b32 m,m,0x80000000; xor.b32 t,t,m; shr.b32 $0,t,16; }"
    )
    return code, "=r,r", (Uint32(half),)


@inline_ptx(Uint32, pure=True)
def _load_half(pointer):
    """The 16 bits at ``pointer``, zero-extended."""
    code = "{ .reg .b16 h; ld.global.nc.b16 h,[$1]; cvt.u32.u16 $0,h; }"
    return code, "=r,l", (pointer,)


@inline_ptx(Uint32)
def _load_peer(address, rank):
    """The 32-bit word at shared address ``address`` of cluster CTA ``rank``
    (ordered after the cluster barrier: not pure)."""
    code = (
        "{ .reg .b32 a; mapa.shared::cluster.u32 a,$1,$2; "
        "ld.shared::cluster.u32 $0,[a]; }"
    )
    return code, "=r,r,r", (Int32(address), Int32(rank))


@inline_ptx((Uint32,) * 4)
def _load_shared4(address):
    """Four words at 16-byte aligned shared address ``address``."""
    return "ld.shared.v4.b32 {$0,$1,$2,$3},[$4];", "=r,=r,=r,=r,r", (Int32(address),)


@inline_ptx()
def _store_shared4(address, a, b, c, d):
    code = "st.shared.v4.b32 [$0],{$1,$2,$3,$4};"
    words = tuple(Uint32(w) for w in (a, b, c, d))
    return code, "r,r,r,r,r,~{memory}", (Int32(address), *words)


@inline_ptx()
def _store_shared(address, word):
    return "st.shared.b32 [$0],$1;", "r,r,~{memory}", (Int32(address), Uint32(word))


@cute.jit
def _block_scan(value: Int32, totals, slot):
    """(exclusive prefix of ``value`` over the CTA's threads, CTA total),
    through ``totals[slot : slot + WARPS]``; one CTA barrier."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    inclusive = warp_prefix_sum(value)
    if lane == 31:
        totals[slot + warp] = inclusive
    cute.arch.barrier()
    warp_total = Int32(0)
    if lane < WARPS:
        warp_total = totals[slot + lane]
    warps_inclusive = warp_prefix_sum(warp_total)
    before_warp = cute.arch.shuffle_sync(warps_inclusive - warp_total, offset=warp)
    total = cute.arch.shuffle_sync(warps_inclusive, offset=31)
    return before_warp + inclusive - value, total


# --- The kernel ---------------------------------------------------------------


class SelectTopk:
    """Cluster ``row`` selects row ``row``; its CTA ``rank`` owns the slice
    from ``rank * S``."""

    def __init__(self, key):
        assert all(c % _TILE == 0 for c in CAPACITIES)
        self.k, self.cluster, self.capacity = key.k, key.cluster, key.capacity
        self.bf16 = key.dtype == torch.bfloat16
        self.vector = VECTOR[key.dtype]
        self.key_bits = _KEY_BITS[key.dtype]
        self.digits = DIGITS[key.dtype]
        # FP32 only: on BF16 a whole bin is rare before the last pass.
        self.early_exit = key.dtype == torch.float32

    @cute.jit
    def __call__(
        self,
        logits: cute.Tensor,
        ends: cute.Tensor,
        out: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.kernel(logits, ends, out).launch(
            grid=(out.shape[0] * self.cluster, 1, 1),
            block=(THREADS, 1, 1),
            cluster=(self.cluster, 1, 1),
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(self, logits: cute.Tensor, ends: cute.Tensor, out: cute.Tensor):
        block, _, _ = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        row = block // self.cluster
        rank = cute.arch.block_idx_in_cluster()
        smem = cutlass.memory.SmemAllocator()
        # Two histograms (a pass counts into one while its peers may still
        # read the other's previous pass), the warp totals of two scans, and
        # what a pass finds: the digit, the count above it, the count equal
        # to the threshold in the ranks before this one (last pass), the
        # count above it in those ranks, and whether the bin is taken whole.
        hist = smem.allocate_tensor(Int32, cute.make_layout(2 * BINS), 16)
        totals = smem.allocate_tensor(Int32, cute.make_layout(2 * WARPS))
        found = smem.allocate_tensor(Int32, cute.make_layout(5))
        keys = smem.allocate_tensor(Uint32, cute.make_layout(self.capacity), 16)
        keys_at = Int32(keys.iterator.toint())
        hist_at = Int32(hist.iterator.toint())
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        end = cutlass.min(cutlass.max(Int32(ends[row]), Int32(0)), logits.shape[1])
        if end <= self.k:
            if rank == 0:
                # Every valid column, in order, then -1 (stock's bytes).
                for i in cutlass.range(tid, self.k, THREADS, unroll=1):
                    value = Int32(-1)
                    if i < end:
                        value = i
                    out[row, i] = value
        else:
            start, n, base = self.slice(logits, row, rank, end)
            if tid < BINS:
                hist[tid] = Int32(0)
            if tid == 0:
                found[2] = Int32(0)
                found[3] = Int32(0)
            cute.arch.barrier()
            self.load_slice(base, n, tid, keys_at, hist)
            threshold, need, above_share = self.radix_select(
                n, tid, rank, keys_at, hist, hist_at, totals, found
            )
            # The count above the threshold in the ranks before this one.
            share = cute.arch.warp_redux_sync(above_share, "add")
            if cute.arch.lane_idx() == 0:
                cute.arch.atomic_add(found.iterator + 3, share)
            cute.arch.barrier()
            self.compact(
                start, n, tid, keys_at, out, row, threshold, need, found, totals
            )
            # The exit barrier: its arrive followed the last pass's reads of
            # the peers' histograms, which must outlive them.
            cute.arch.cluster_wait()

    @cute.jit
    def slice(self, logits, row, rank, end):
        """CTA ``rank``'s slice of row ``row``'s ``end`` valid columns: its
        first column, its column count and the address of its first."""
        vector = self.vector
        span = (end + self.cluster - 1) // self.cluster
        span = (span + vector - 1) // vector * vector
        start = rank * span
        n = cutlass.min(cutlass.max(end - start, Int32(0)), span)
        return start, n, logits.iterator + Int64(row) * logits.stride[0] + start

    @cute.jit
    def load_slice(self, base, n, tid, keys_at, hist):
        """Reads the slice's ``n`` columns from ``base`` once into the shared
        keys, counting pass 0's digits as it goes."""
        vector = self.vector
        shift = self.key_bits - self.digits[0]
        full = n // vector
        for v0 in cutlass.range(tid, full, THREADS * _UNROLL, unroll=1):
            loaded = []
            for u in cutlass.range_constexpr(_UNROLL):
                v = v0 + u * THREADS
                loaded.append(load_words_if(base + v * vector, 4, v < full))
            for u in cutlass.range_constexpr(_UNROLL):
                v = v0 + u * THREADS
                ok = v < full
                words = loaded[u]
                group = []
                if cutlass.const_expr(self.bf16):
                    for w in words:
                        group += [_key16(w & Uint32(0xFFFF)), _key16(w >> Uint32(16))]
                else:
                    group = [_key32(w) for w in words]
                if ok:
                    for h in cutlass.range_constexpr(vector // 4):
                        at = keys_at + (v * vector + 4 * h) * 4
                        _store_shared4(at, *group[4 * h : 4 * h + 4])
                    for key in group:
                        digit = Int32(key >> Uint32(shift))
                        cute.arch.atomic_add(hist.iterator + digit, Int32(1))
        if tid == 0:
            # The row end's last columns, one at a time.
            for i in cutlass.range(full * vector, n, unroll=1):
                if cutlass.const_expr(self.bf16):
                    key = _key16(_load_half(base + i))
                else:
                    key = _key32(load_words_if(base + i, 1, True)[0])
                _store_shared(keys_at + i * 4, key)
                digit = Int32(key >> Uint32(shift))
                cute.arch.atomic_add(hist.iterator + digit, Int32(1))

    @cute.jit
    def radix_select(self, n, tid, rank, keys_at, hist, hist_at, totals, found):
        """``(threshold, need, share)``: the top ``k`` are the keys above
        ``threshold`` and the first ``need`` equal to it; ``share`` is this
        thread's share of the count above it in the ranks before ``rank``.
        Pass by pass, ``threshold`` is the ``k``-th largest key; where a
        pass's bin is taken whole (its count is what the set still needs),
        the later passes are skipped: ``threshold`` is then just below the
        bin and ``need`` 0 (every CTA sums the same histograms, so all skip
        alike)."""
        prefix = Uint32(0)
        remaining = Int32(self.k)
        above_share = Int32(0)
        whole = Int32(0)
        passes = len(self.digits)
        for p in cutlass.range_constexpr(passes):
            bits = self.digits[p]
            shift = self.key_bits - sum(self.digits[: p + 1])
            current = (p % 2) * BINS
            if whole == 0:
                if cutlass.const_expr(p > 0):
                    high = prefix >> Uint32(shift + bits)
                    for i in cutlass.range(tid * _GROUP, n, _TILE, unroll=1):
                        # Four keys in the slice's capacity (past n: unused).
                        group = _load_shared4(keys_at + i * 4)
                        for j in cutlass.range_constexpr(_GROUP):
                            key = group[j]
                            # Nested: the DSL's ``and`` does not take two dynamic tests.
                            if i + j < n:  # noqa: SIM102
                                if key >> Uint32(shift + bits) == high:
                                    digit = Int32(
                                        (key >> Uint32(shift)) & Uint32(BINS - 1)
                                    )
                                    cute.arch.atomic_add(
                                        hist.iterator + current + digit, Int32(1)
                                    )
                # Every CTA's histogram of this pass is complete and visible.
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
                if cutlass.const_expr(p + 1 < passes):  # noqa: SIM102
                    # The other histogram: its peers read it last pass, before
                    # arriving at the barrier above.
                    if tid < BINS:
                        hist[(1 - p % 2) * BINS + tid] = Int32(0)
                digit, above, share, whole = self.merge_find(
                    p,
                    prefix,
                    shift,
                    hist_at,
                    current,
                    remaining,
                    tid,
                    rank,
                    totals,
                    found,
                )
                prefix = prefix | (Uint32(digit) << Uint32(shift))
                remaining = remaining - above
                above_share = above_share + share
        threshold, need = prefix, remaining
        if whole != 0:
            threshold, need = prefix - Uint32(1), Int32(0)
        return threshold, need, above_share

    @cute.jit
    def merge_find(
        self, p, prefix, shift, hist_at, current, remaining, tid, rank, totals, found
    ):
        """Sums the ``C`` histograms of pass ``p`` (thread ``t`` takes bin
        ``BINS - 1 - t``: a descending scan) and finds the digit whose bin
        holds the ``remaining``-th largest matching key and the count above
        it, and whether the bin is taken whole (not where its lowest key is
        0, which nothing is below). Returns them with this thread's share of
        the count above the digit (from the digit on, where whole) in the
        ranks before ``rank``; the last pass stores the count in the digit's
        bin in those ranks (``found[2]``). The last pass, or a whole bin,
        arrives at the exit barrier once done reading the peers."""
        last = p + 1 == len(self.digits)
        merged = Int32(0)
        before = Int32(0)
        if tid < BINS:
            bin_at = hist_at + (current + (BINS - 1) - tid) * 4
            for q in cutlass.range_constexpr(self.cluster):
                count = Int32(_load_peer(bin_at, q))
                merged = merged + count
                if q < rank:
                    before = before + count
        if cutlass.const_expr(last):
            cute.arch.cluster_arrive()
        above, _ = _block_scan(merged, totals, 0)
        if above < remaining and remaining <= above + merged:
            digit = (BINS - 1) - tid
            found[0] = digit
            found[1] = above
            lowest = prefix | (Uint32(digit) << Uint32(shift))
            found[4] = Int32(0)
            if cutlass.const_expr(self.early_exit):
                found[4] = Int32(above + merged == remaining) & Int32(
                    lowest > Uint32(0)
                )
            if cutlass.const_expr(last):
                found[2] = before
        cute.arch.barrier()
        digit = found[0]
        whole = found[4]
        if cutlass.const_expr(self.early_exit and not last):  # noqa: SIM102
            if whole != 0:
                cute.arch.cluster_arrive()
        share = Int32(0)
        if (BINS - 1) - tid > digit:
            share = before
        if (BINS - 1) - tid == digit:  # noqa: SIM102
            if whole != 0:
                share = before
        return digit, found[1], share, whole

    @cute.jit
    def compact(self, start, n, tid, keys_at, out, row, threshold, need, found, totals):
        """Writes the slice's columns above the threshold and its share of
        the first ``need`` equal to it, in column order, at the slots after
        the ranks before it; stops once the row's ``k`` are written."""
        above_run = found[3]
        equal_run = found[2]
        tiles = (n + _TILE - 1) // _TILE
        for t in cutlass.range(tiles, unroll=1):
            if above_run + cutlass.min(equal_run, need) < self.k:
                i0 = t * _TILE + tid * _GROUP
                group = _load_shared4(keys_at + i0 * 4)
                gt = Int32(0)
                eq = Int32(0)
                for i in cutlass.range_constexpr(_GROUP):
                    if i0 + i < n:
                        if group[i] > threshold:
                            gt = gt | Int32(1 << i)
                        if group[i] == threshold:
                            eq = eq | Int32(1 << i)
                packed = Int32(cute.arch.popc(gt)) + (Int32(cute.arch.popc(eq)) << 16)
                before, tile_total = _block_scan(packed, totals, (t & 1) * WARPS)
                above = above_run + (before & Int32(0xFFFF))
                equal = equal_run + (before >> 16)
                for i in cutlass.range_constexpr(_GROUP):
                    g = (gt >> i) & Int32(1)
                    e = (eq >> i) & Int32(1)
                    taken = g
                    if e == 1 and equal < need:
                        taken = Int32(1)
                    if taken == 1:
                        out[row, above + cutlass.min(equal, need)] = start + i0 + i
                    above = above + g
                    equal = equal + e
                above_run = above_run + (tile_total & Int32(0xFFFF))
                equal_run = equal_run + (tile_total >> 16)
