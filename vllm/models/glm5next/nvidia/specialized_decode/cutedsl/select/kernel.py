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
  lowest ids (stock: atomics' order), listed in ascending column order. The
  bytes depend on nothing but the row: the same on every run and GPU.

Bytes differ from stock's wherever stock's order or tie choice does: the
stage runs it only when the deployment opts in (``kpool_select``).

A cluster of ``C`` CTAs (1024 threads each) selects one row, reading each
key from global memory once, with two cluster barriers:

1. CTA ``rank`` loads the slice ``[rank * S, (rank + 1) * S)`` of the valid
   columns (``S = ceil(end / C)`` rounded up to the load vector) into shared
   memory as order keys, counting their first 11 bits (the "bin") into its
   histogram. Cluster barrier.
2. Every CTA sums the ``C`` histograms through distributed shared memory
   and finds the bin ``B`` of the ``k``-th largest key: ``k - R`` keys lie
   in higher bins, the top ``R`` of bin ``B`` complete the set. It pushes
   into CTA 0's shared memory the columns of its higher bins (the "above"
   list) and, as candidates, its keys of bin ``B`` with their columns, each
   list in column order after those of the ranks before it. A CTA with more
   than ``R`` keys in ``B`` pushes only its own top ``R`` (by the contract's
   order, refined in its shared memory), which hold every candidate the
   row can take. Cluster barrier.
3. CTA 0 refines the candidates' remaining bits in its shared memory (CTA
   barriers only) to ``T`` and the count of ties the set takes, keeps the
   taken candidates in column order, and writes the merge of the two
   ascending lists.
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
# The first digit: the key's top 11 bits, counted while loading. The
# cluster-wide sum of its 2048 bins is two bins a thread.
FIRST_BITS = 11
BINS = 1 << FIRST_BITS
# The digits CTA 0 refines the candidates on, below the first.
REFINE_BITS = {torch.float32: (11, 10), torch.bfloat16: (5,)}
# Keys a CTA holds in shared memory: the smallest entry that holds its
# slice (the compile key's ``capacity``), each a multiple of the 4096-key
# tile.
CAPACITIES = (4096, 8192, 16384, 32768)
# The shared memory a CTA may take (Hopper and the SM100 family).
SHARED_LIMIT = 227 * 1024
# 16 bytes a thread loads at once: 4 FP32 or 8 BF16 columns.
DTYPES = {torch.float32: Float32, torch.bfloat16: BFloat16}
VECTOR = {torch.float32: 4, torch.bfloat16: 8}
_KEY_BITS = {torch.float32: 32, torch.bfloat16: 16}
# Keys a thread takes from shared memory at once (one 16-byte load).
_GROUP = 4
_TILE = THREADS * _GROUP
# 16-byte row loads in flight per thread while loading the slice.
_UNROLL = 4


def candidate_slots(k: int, cluster: int) -> int:
    """CTA 0's candidate entries: at most ``k`` from each rank, rounded to
    the 4-key group."""
    return -(-cluster * k // _GROUP) * _GROUP


def shared_bytes(k: int, cluster: int, capacity: int) -> int:
    """The shared memory of a CTA: two histograms, the scans' warp totals,
    what the passes find, the above and taken lists, the candidates (key
    and column) and the slice's keys, with each allocation's alignment."""
    words = 2 * BINS + 4 * WARPS + 8 + 2 * k + 2 * candidate_slots(k, cluster)
    return 4 * (words + capacity) + 9 * 16


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


@inline_ptx(Uint32, pure=True)
def _peer_address(address, rank):
    """Shared address ``address`` of cluster CTA ``rank``."""
    return "mapa.shared::cluster.u32 $0,$1,$2;", "=r,r,r", (Int32(address), Int32(rank))


@inline_ptx((Uint32, Uint32))
def _load_peer2(address, rank):
    """The two words at 8-byte aligned shared address ``address`` of cluster
    CTA ``rank`` (ordered after the cluster barrier: not pure)."""
    code = (
        "{ .reg .b32 a; mapa.shared::cluster.u32 a,$2,$3; "
        "ld.shared::cluster.v2.u32 {$0,$1},[a]; }"
    )
    return code, "=r,=r,r,r", (Int32(address), Int32(rank))


@inline_ptx()
def _store_peer(address, word):
    """``word`` at the cluster shared address ``address`` (``_peer_address``)."""
    code = "st.shared::cluster.u32 [$0],$1;"
    return code, "r,r,~{memory}", (Uint32(address), Uint32(word))


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
def _count(hist, digit: Int32, valid: Int32):
    """Adds one to ``hist[digit]`` for each lane with ``valid`` set: one
    atomic for the warp where its valid lanes share the digit (the plateaus
    of ReLU's exact zeros), else one a lane."""
    ballot = cute.arch.vote_ballot_sync(valid != 0)
    if ballot != 0:
        first = cute.arch.popc((ballot & (Int32(0) - ballot)) - 1)
        lead = cute.arch.shuffle_sync(digit, offset=first)
        if cute.arch.vote_any_sync((Int32(digit != lead) & valid) != 0):
            if valid != 0:
                cute.arch.atomic_add(hist.iterator + digit, Int32(1))
        elif cute.arch.lane_idx() == first:
            cute.arch.atomic_add(hist.iterator + lead, cute.arch.popc(ballot))


@cute.jit
def _block_scan(values, totals, slot):
    """(exclusive prefixes of ``values`` over the CTA's threads, CTA totals),
    through ``totals[slot : slot + len(values) * WARPS]``; one CTA barrier."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    inclusive = [warp_prefix_sum(v) for v in values]
    if lane == 31:
        for i in cutlass.range_constexpr(len(values)):
            totals[slot + i * WARPS + warp] = inclusive[i]
    cute.arch.barrier()
    before, total = [], []
    for i in cutlass.range_constexpr(len(values)):
        warp_total = Int32(0)
        if lane < WARPS:
            warp_total = totals[slot + i * WARPS + lane]
        warps_inclusive = warp_prefix_sum(warp_total)
        before_warp = cute.arch.shuffle_sync(warps_inclusive - warp_total, offset=warp)
        before.append(before_warp + inclusive[i] - values[i])
        total.append(cute.arch.shuffle_sync(warps_inclusive, offset=31))
    return before, total


@cute.jit
def _lower_bound(array, length, value, steps: cutlass.Constexpr):
    """The count of entries of the ascending ``array[:length]`` below ``value``."""
    lo = Int32(0)
    hi = length
    for _ in cutlass.range_constexpr(steps):
        if lo < hi:
            mid = (lo + hi) // 2
            if array[mid] < value:
                lo = mid + 1
            else:
                hi = mid
    return lo


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
        self.shift = self.key_bits - FIRST_BITS
        self.refine_bits = REFINE_BITS[key.dtype]
        self.slots = candidate_slots(key.k, key.cluster)
        self.steps = key.k.bit_length()

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
        # The first digit's histogram (its peers read it), the refining
        # passes' own, the warp totals of two scans of two values, what the
        # passes find, CTA 0's lists (the above columns, the taken
        # candidates, the candidates' keys and columns), the slice's keys.
        hist = smem.allocate_tensor(Int32, cute.make_layout(BINS), 16)
        local = smem.allocate_tensor(Int32, cute.make_layout(BINS), 16)
        totals = smem.allocate_tensor(Int32, cute.make_layout(4 * WARPS), 16)
        found = smem.allocate_tensor(Int32, cute.make_layout(12), 16)
        above_cols = smem.allocate_tensor(Int32, cute.make_layout(self.k), 16)
        taken_cols = smem.allocate_tensor(Int32, cute.make_layout(self.k), 16)
        cand_keys = smem.allocate_tensor(Uint32, cute.make_layout(self.slots), 16)
        cand_cols = smem.allocate_tensor(Int32, cute.make_layout(self.slots), 16)
        keys = smem.allocate_tensor(Uint32, cute.make_layout(self.capacity), 16)
        keys_at = Int32(keys.iterator.toint())
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
            vector = self.vector
            span = (end + self.cluster - 1) // self.cluster
            span = (span + vector - 1) // vector * vector
            start = rank * span
            n = cutlass.min(cutlass.max(end - start, Int32(0)), span)
            base = logits.iterator + Int64(row) * logits.stride[0] + start
            for b in cutlass.range_constexpr(BINS // THREADS):
                hist[b * THREADS + tid] = Int32(0)
                local[b * THREADS + tid] = Int32(0)
            cute.arch.barrier()
            self.load_slice(base, n, tid, keys_at, hist)
            # Every CTA's histogram is complete and visible.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            self.merge(tid, rank, Int32(hist.iterator.toint()), totals, found)
            self.push(
                start,
                n,
                tid,
                keys_at,
                local,
                totals,
                found,
                above_cols,
                cand_keys,
                cand_cols,
            )
            # CTA 0 holds every column the row takes; its peers are done
            # reading each other's histograms.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if rank == 0:
                threshold, keep = self.refine(
                    Int32(cand_keys.iterator.toint()),
                    found[5],
                    self.k - found[1],
                    tid,
                    local,
                    found,
                )
                self.write(
                    tid,
                    row,
                    out,
                    threshold,
                    keep,
                    totals,
                    found,
                    above_cols,
                    taken_cols,
                    cand_keys,
                    cand_cols,
                )

    @cute.jit
    def load_slice(self, base, n, tid, keys_at, hist):
        """Reads the slice's ``n`` columns from ``base`` once into the shared
        keys, counting their first digits as it goes."""
        vector = self.vector
        full = n // vector
        for v0 in cutlass.range(0, full, THREADS * _UNROLL, unroll=1):
            loaded = []
            for u in cutlass.range_constexpr(_UNROLL):
                v = v0 + u * THREADS + tid
                loaded.append(load_words_if(base + v * vector, 4, v < full))
            for u in cutlass.range_constexpr(_UNROLL):
                v = v0 + u * THREADS + tid
                ok = Int32(v < full)
                words = loaded[u]
                group = []
                if cutlass.const_expr(self.bf16):
                    for w in words:
                        group += [_key16(w & Uint32(0xFFFF)), _key16(w >> Uint32(16))]
                else:
                    group = [_key32(w) for w in words]
                if ok != 0:
                    for h in cutlass.range_constexpr(vector // 4):
                        at = keys_at + (v * vector + 4 * h) * 4
                        _store_shared4(at, *group[4 * h : 4 * h + 4])
                for key in group:
                    _count(hist, Int32(key >> Uint32(self.shift)), ok)
        if tid == 0:
            # The row end's last columns, one at a time.
            for i in cutlass.range(full * vector, n, unroll=1):
                if cutlass.const_expr(self.bf16):
                    key = _key16(_load_half(base + i))
                else:
                    key = _key32(load_words_if(base + i, 1, True)[0])
                _store_shared(keys_at + i * 4, key)
                digit = Int32(key >> Uint32(self.shift))
                cute.arch.atomic_add(hist.iterator + digit, Int32(1))

    @cute.jit
    def merge(self, tid, rank, hist_at, totals, found):
        """Sums the ``C`` first-digit histograms (thread ``t`` takes bins
        ``BINS - 1 - 2t`` and ``BINS - 2 - 2t``: a descending scan) and finds
        the bin of the ``k``-th largest key. Stores in ``found``: the bin,
        the count above it, the count above it in the ranks before this one
        (this rank's first slot in the above list), this rank's first slot
        in the candidates, this rank's count in the bin and the candidates'
        count."""
        low = BINS - 2 - 2 * tid
        counts = []
        merged_high, merged_low = Int32(0), Int32(0)
        before_high, before_low = Int32(0), Int32(0)
        for q in cutlass.range_constexpr(self.cluster):
            low_count, high_count = _load_peer2(hist_at + low * 4, q)
            # Descending: the high bin first.
            counts.append((Int32(high_count), Int32(low_count)))
            merged_high = merged_high + Int32(high_count)
            merged_low = merged_low + Int32(low_count)
            if q < rank:
                before_high = before_high + Int32(high_count)
                before_low = before_low + Int32(low_count)
        merged = (merged_high, merged_low)
        before = (before_high, before_low)
        (above, above_before), _ = _block_scan(
            (merged[0] + merged[1], before[0] + before[1]), totals, 0
        )
        for j in cutlass.range_constexpr(2):
            if above < self.k:  # noqa: SIM102
                if self.k <= above + merged[j]:
                    self.found_bin(
                        found, low + 1 - j, above, above_before, counts, j, rank
                    )
            above = above + merged[j]
            above_before = above_before + before[j]
        cute.arch.barrier()

    @cute.jit
    def found_bin(self, found, digit, above, above_before, counts, j, rank):
        """Stores what ``merge`` found: bin ``digit`` with ``above`` keys
        above it, this rank's counts and its candidates' slot. Each rank
        pushes all its keys of the bin where they fit CTA 0's candidates,
        else at most ``need`` (its own top ``need``)."""
        need = self.k - above
        total, capped_total = Int32(0), Int32(0)
        before, capped_before = Int32(0), Int32(0)
        mine = Int32(0)
        for q in cutlass.range_constexpr(self.cluster):
            count = counts[q][j]
            capped = cutlass.min(count, need)
            total = total + count
            capped_total = capped_total + capped
            if q < rank:
                before = before + count
                capped_before = capped_before + capped
            if q == rank:
                mine = count
        found[0] = digit
        found[1] = above
        found[2] = above_before
        found[3] = before
        found[4] = mine
        found[5] = total
        found[6] = Int32(0)
        if total > self.slots:
            found[3] = capped_before
            found[5] = capped_total
            found[6] = Int32(1)
        # The whole bin is taken: the refine has nothing to do.
        found[10] = Int32(total == need) & Int32(digit > 0)

    @cute.jit
    def refine(self, keys_at, count, need, tid, local, found):
        """``(threshold, keep)`` of the top ``need`` of the ``count`` shared
        keys at ``keys_at`` whose first digit is ``found[0]``: the set is
        those above ``threshold`` and the first ``keep`` equal to it. It
        refines digit by digit; where the digit's bin is taken whole it
        stops there, with ``threshold`` just below the bin and ``keep`` 0.
        ``local`` is zero on entry and on return."""
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        done = FIRST_BITS
        prefix = Uint32(found[0]) << Uint32(self.shift)
        whole = found[10]
        tiles = (count + _TILE - 1) // _TILE
        for p in cutlass.range_constexpr(len(self.refine_bits)):
            bits = self.refine_bits[p]
            shift = self.key_bits - done - bits
            if whole == 0:
                high = prefix >> Uint32(shift + bits)
                for t in cutlass.range(tiles, unroll=1):
                    i0 = t * _TILE + tid * _GROUP
                    group = _load_shared4(keys_at + i0 * 4)
                    for j in cutlass.range_constexpr(_GROUP):
                        key = group[j]
                        valid = Int32(i0 + j < count) & Int32(
                            key >> Uint32(shift + bits) == high
                        )
                        digit = Int32((key >> Uint32(shift)) & Uint32((1 << bits) - 1))
                        _count(local, digit, valid)
                cute.arch.barrier()
                if warp == 0:
                    self.find(local, bits, prefix, shift, need, lane, found)
                cute.arch.barrier()
                prefix = prefix | (Uint32(found[7]) << Uint32(shift))
                need = need - found[9]
                whole = found[8]
            done += bits
        threshold, keep = prefix, need
        if whole != 0:
            threshold, keep = prefix - Uint32(1), Int32(0)
        return threshold, keep

    @cute.jit
    def find(self, local, bits: cutlass.Constexpr, prefix, shift, need, lane, found):
        """Warp 0: the bin of ``local`` (``2^bits`` bins, read descending,
        each lane a run of them) that holds the ``need``-th largest; it
        stores the bin, the count above it, and whether the bin is taken
        whole, and zeroes the bins."""
        bins = 1 << bits
        per = max(1, bins // 32)
        values = []
        total = Int32(0)
        for j in cutlass.range_constexpr(per):
            b = bins - 1 - lane * per - j
            value = Int32(0)
            if b >= 0:
                value = local[b]
                local[b] = Int32(0)
            values.append(value)
            total = total + value
        inclusive = warp_prefix_sum(total)
        running = inclusive - total
        if running < need:  # noqa: SIM102
            if need <= inclusive:
                for j in cutlass.range_constexpr(per):
                    if running < need:  # noqa: SIM102
                        if need <= running + values[j]:
                            digit = bins - 1 - lane * per - j
                            found[7] = digit
                            found[9] = running
                            lowest = prefix | (Uint32(digit) << Uint32(shift))
                            found[8] = Int32(running + values[j] == need) & Int32(
                                lowest > Uint32(0)
                            )
                    running = running + values[j]

    @cute.jit
    def offsets(self, counts, totals, warp, lane):
        """Each warp's counts (one Int32 each) summed over the warps before
        it, through ``totals``; one CTA barrier."""
        fields = len(counts)
        if lane == 0:
            for f in cutlass.range_constexpr(fields):
                totals[f * WARPS + warp] = counts[f]
        cute.arch.barrier()
        before = []
        for f in cutlass.range_constexpr(fields):
            value = Int32(0)
            if lane < warp:
                value = totals[f * WARPS + lane]
            before.append(cute.arch.warp_redux_sync(value, "add"))
        return before

    @cute.jit
    def push(
        self,
        start,
        n,
        tid,
        keys_at,
        local,
        totals,
        found,
        above_cols,
        cand_keys,
        cand_cols,
    ):
        """Pushes into CTA 0 the slice's columns above the bin, in column
        order from this rank's first slot, and its candidates: all its keys
        of the bin, or where all the ranks' do not fit CTA 0's candidates
        and it has more than the ``need`` the set takes from the bin, its own
        top ``need`` (those above its ``need``-th largest, then the first
        ties). Warp ``w`` takes the ``w``-th run of the slice: one pass
        counts, one CTA barrier, one pass pushes."""
        digit = Uint32(found[0])
        need = self.k - found[1]
        mine = found[4]
        threshold, keep = Uint32(0), mine
        if found[6] != 0:  # noqa: SIM102
            if mine > need:
                threshold, keep = self.refine(keys_at, n, need, tid, local, found)
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        run = ((n + WARPS - 1) // WARPS + 127) // 128 * 128
        lo = warp * run
        hi = cutlass.min(lo + run, n)
        counted = [Int32(0), Int32(0), Int32(0)]
        for i0 in cutlass.range(lo, hi, 128, unroll=1):
            i = i0 + lane * _GROUP
            masks = self.classify(keys_at, i, hi, digit, threshold)[:3]
            for f in cutlass.range_constexpr(3):
                counted[f] = counted[f] + cute.arch.popc(masks[f])
        totals_w = [cute.arch.warp_redux_sync(c, "add") for c in counted]
        above_run, more_run, tied_run = self.offsets(totals_w, totals, warp, lane)
        above_at = _peer_address(Int32(above_cols.iterator.toint()) + found[2] * 4, 0)
        first = found[3]
        key_at = _peer_address(Int32(cand_keys.iterator.toint()) + first * 4, 0)
        col_at = _peer_address(Int32(cand_cols.iterator.toint()) + first * 4, 0)
        for i0 in cutlass.range(lo, hi, 128, unroll=1):
            i = i0 + lane * _GROUP
            a, g, e, group = self.classify(keys_at, i, hi, digit, threshold)
            packed = (
                cute.arch.popc(a)
                + (cute.arch.popc(g) << 10)
                + (cute.arch.popc(e) << 20)
            )
            inclusive = warp_prefix_sum(packed)
            before = inclusive - packed
            warp_total = cute.arch.shuffle_sync(inclusive, offset=31)
            above = above_run + (before & Int32(0x3FF))
            more = more_run + ((before >> 10) & Int32(0x3FF))
            tied = tied_run + (before >> 20)
            for j in cutlass.range_constexpr(_GROUP):
                column = start + i + j
                if (a >> j) & 1 == 1:
                    _store_peer(above_at + Uint32(above * 4), column)
                    above = above + 1
                gj = (g >> j) & 1
                ej = (e >> j) & 1
                taken = gj
                if ej == 1 and tied < keep:
                    taken = Int32(1)
                if taken == 1:
                    slot = Uint32((more + cutlass.min(tied, keep)) * 4)
                    _store_peer(key_at + slot, group[j])
                    _store_peer(col_at + slot, column)
                more = more + gj
                tied = tied + ej
            above_run = above_run + (warp_total & Int32(0x3FF))
            more_run = more_run + ((warp_total >> 10) & Int32(0x3FF))
            tied_run = tied_run + (warp_total >> 20)

    @cute.jit
    def classify(self, keys_at, i, hi, digit, threshold):
        """Masks of the four keys from ``i`` (below ``hi``): above the bin;
        in it and above ``threshold``; in it and equal to ``threshold``; and
        the keys."""
        # Past ``hi`` (nothing counts) a safe address.
        at = i
        if at >= hi:
            at = Int32(0)
        group = _load_shared4(keys_at + at * 4)
        a, g, e = Int32(0), Int32(0), Int32(0)
        for j in cutlass.range_constexpr(_GROUP):
            key = group[j]
            if i + j < hi:
                d = key >> Uint32(self.shift)
                if d > digit:
                    a = a | Int32(1 << j)
                if d == digit:
                    if key > threshold:
                        g = g | Int32(1 << j)
                    if key == threshold:
                        e = e | Int32(1 << j)
        return a, g, e, group

    @cute.jit
    def write(
        self,
        tid,
        row,
        out,
        threshold,
        keep,
        totals,
        found,
        above_cols,
        taken_cols,
        cand_keys,
        cand_cols,
    ):
        """CTA 0: keeps the candidates the set takes (those above
        ``threshold``, the first ``keep`` equal to it) in column order, as
        ``push`` does, and writes the merge of them and the above list."""
        need = self.k - found[1]
        count = found[5]
        keys_at = Int32(cand_keys.iterator.toint())
        cols_at = Int32(cand_cols.iterator.toint())
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        run = ((count + WARPS - 1) // WARPS + 127) // 128 * 128
        lo = warp * run
        hi = cutlass.min(lo + run, count)
        digit = Uint32(found[0])
        counted = [Int32(0), Int32(0)]
        for i0 in cutlass.range(lo, hi, 128, unroll=1):
            _, g, e, _ = self.classify(
                keys_at, i0 + lane * _GROUP, hi, digit, threshold
            )
            counted[0] = counted[0] + cute.arch.popc(g)
            counted[1] = counted[1] + cute.arch.popc(e)
        totals_w = [cute.arch.warp_redux_sync(c, "add") for c in counted]
        more_run, tied_run = self.offsets(totals_w, totals, warp, lane)
        for i0 in cutlass.range(lo, hi, 128, unroll=1):
            i = i0 + lane * _GROUP
            _, g, e, _ = self.classify(keys_at, i, hi, digit, threshold)
            packed = cute.arch.popc(g) + (cute.arch.popc(e) << 16)
            inclusive = warp_prefix_sum(packed)
            before = inclusive - packed
            warp_total = cute.arch.shuffle_sync(inclusive, offset=31)
            more = more_run + (before & Int32(0xFFFF))
            tied = tied_run + (before >> 16)
            columns = _load_shared4(cols_at + i * 4)
            for j in cutlass.range_constexpr(_GROUP):
                gj = (g >> j) & 1
                ej = (e >> j) & 1
                taken = gj
                if ej == 1 and tied < keep:
                    taken = Int32(1)
                if taken == 1:
                    taken_cols[more + cutlass.min(tied, keep)] = Int32(columns[j])
                more = more + gj
                tied = tied + ej
            more_run = more_run + (warp_total & Int32(0xFFFF))
            tied_run = tied_run + (warp_total >> 16)
        cute.arch.barrier()
        above = found[1]
        for i in cutlass.range(tid, above, THREADS, unroll=1):
            column = above_cols[i]
            out[row, i + _lower_bound(taken_cols, need, column, self.steps)] = column
        for i in cutlass.range(tid, need, THREADS, unroll=1):
            column = taken_cols[i]
            out[row, i + _lower_bound(above_cols, above, column, self.steps)] = column
