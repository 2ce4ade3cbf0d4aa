# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pool top-k ("select"), ``SelectKernel``'s device code (its contract
is that class's docstring; docs/select-contract.md, "The select", is the
design: a cluster of CTAs a row, each holding its slice as order keys in
shared memory, radix passes summed over distributed shared memory, passes
that end early where the set is known, short rows on CTA 0 alone).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32
from quack.utils import warp_prefix_sum

from ..common.ptx import (
    block_scan,
    load_half,
    load_peer,
    load_shared4,
    load_words_if,
    order_key16,
    order_key32,
    store_shared,
    store_shared4,
)

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
VECTOR = {torch.float32: 4, torch.bfloat16: 8}
# Keys a thread takes from shared memory at once in a pass (one 16-byte
# load) and in the compaction (two, where the capacity holds them: one
# CTA-wide scan for each 8192 keys).
_GROUP = 4
_TILE = THREADS * _GROUP
_OUT_GROUP = 8
# The most keys a row's CTA 0 selects alone (a row of up to one full slice).
ALONE_KEYS = 8192
# Shared words a CTA has besides its keys: two histograms, two scans' warp
# totals and what a pass finds (``found``, see ``select_row``).
FOUND = 6
SCRATCH_WORDS = 2 * BINS + 2 * WARPS + FOUND
# An SM's shared memory and threads (Hopper and the SM100 family), and the
# shared memory the system keeps per CTA.
SM_SHARED_BYTES, SM_THREADS, CTA_RESERVED_BYTES = 228 * 1024, 2048, 1024


def ctas_per_sm(capacity: int) -> int:
    """The CTAs of a ``capacity``-key build an SM holds at once: two where
    their shared memory fits (the build then asks ptxas for two: 32
    registers a thread), else one."""
    shared = 4 * (capacity + SCRATCH_WORDS) + CTA_RESERVED_BYTES
    return min(SM_THREADS // THREADS, SM_SHARED_BYTES // shared)


# 16-byte row loads in flight per thread while loading the slice (BF16's
# eight keys a load take the registers of two more: the build keeps to 32
# registers where two CTAs share an SM).
_UNROLL = {torch.float32: 4, torch.bfloat16: 2}


# --- The kernel ---------------------------------------------------------------


class SelectTopk:
    """Cluster ``row`` selects row ``row``; its CTA ``rank`` owns the slice
    from ``rank * S`` (CTA 0 the whole row where it fits ``ALONE_KEYS``)."""

    def __init__(self, key):
        assert all(c % _TILE == 0 for c in CAPACITIES)
        self.k, self.cluster, self.capacity = key.k, key.cluster, key.capacity
        self.bf16 = key.dtype == torch.bfloat16
        self.vector = VECTOR[key.dtype]
        self.digits = DIGITS[key.dtype]
        self.key_bits = sum(self.digits)
        self.unroll = _UNROLL[key.dtype]
        # The key of +0.0, where ReLU-weighted logits have their plateaus.
        self.zero_key = 1 << (self.key_bits - 1)
        self.alone_keys = min(ALONE_KEYS, self.capacity)
        whole = self.capacity % (THREADS * _OUT_GROUP) == 0
        self.out_group = _OUT_GROUP if whole else _GROUP
        # FP32 only: on BF16 a whole bin is rare before the last pass.
        self.whole_exit = key.dtype == torch.float32

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
            min_blocks_per_mp=ctas_per_sm(self.capacity),
            # Set, so that the build asks no device for its shared memory.
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(self, logits: cute.Tensor, ends: cute.Tensor, out: cute.Tensor):
        self.select(logits, ends, out)

    @cute.jit
    def select(self, logits, ends: cute.Tensor, out: cute.Tensor):
        """Row ``row`` of ``out``: the top ``k`` of ``logits``'s row."""
        block, _, _ = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        row = block // self.cluster
        rank = cute.arch.block_idx_in_cluster()
        shared = self.allocate()
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        end = self.row_end(logits, ends, row)
        if end <= self.k:
            if rank == 0:
                # Every valid column, in order, then -1 (stock's bytes).
                for i in cutlass.range(tid, self.k, THREADS, unroll=1):
                    value = Int32(-1)
                    if i < end:
                        value = i
                    out[row, i] = value
        elif cutlass.const_expr(self.cluster == 1):
            self.select_row(logits, out, row, rank, end, tid, shared, True)
        elif end <= self.alone_keys:
            # The cluster's other CTAs exit: nothing reads their memory.
            if rank == 0:
                self.select_row(logits, out, row, rank, end, tid, shared, True)
        else:
            self.select_row(logits, out, row, rank, end, tid, shared, False)

    @cute.jit
    def row_end(self, logits, ends, row):
        """Row ``row``'s valid columns: ``clamp(ends[row], 0, width)``."""
        return cutlass.min(cutlass.max(Int32(ends[row]), Int32(0)), logits.shape[1])

    @cute.jit
    def row_base(self, logits, row):
        """The address of row ``row``'s first column."""
        return logits.iterator + Int64(row) * logits.stride[0]

    @cute.jit
    def allocate(self):
        """The CTA's shared memory: two histograms (a pass counts into one
        while its peers may still read the other's previous pass), the warp
        totals of two scans, ``found`` (see ``select_row``) and the slice's
        keys."""
        smem = cutlass.memory.SmemAllocator()
        hist = smem.allocate_tensor(Int32, cute.make_layout(2 * BINS), 16)
        totals = smem.allocate_tensor(Int32, cute.make_layout(2 * WARPS))
        found = smem.allocate_tensor(Int32, cute.make_layout(FOUND))
        keys = smem.allocate_tensor(Uint32, cute.make_layout(self.capacity), 16)
        return hist, totals, found, keys

    @cute.jit
    def select_row(self, logits, out, row, rank, end, tid, shared, alone):
        """The top ``k`` of row ``row``'s ``end`` (> ``k``) valid columns
        from this CTA's slice: of the whole row where ``alone`` (constexpr),
        else of the cluster's. ``found`` holds what a pass finds: the
        threshold digit, the count above its bin, the count equal to the
        threshold in the ranks before this one, the count above it in those
        ranks, how the passes ended early (1: a whole bin; 2: at +0.0), and
        this CTA's count of +0.0 keys."""
        hist, totals, found, keys = shared
        parts = 1 if alone else self.cluster
        start, n, base = self.slice(logits, row, rank, end, parts)
        if tid < BINS:
            hist[tid] = Int32(0)
        if tid < FOUND:
            found[tid] = Int32(0)
        cute.arch.barrier()
        keys_at = Int32(keys.iterator.toint())
        self.load_slice(base, n, tid, keys_at, hist, found)
        threshold, need, above_share = self.radix_select(
            n, tid, rank, keys_at, hist, totals, found, alone
        )
        # The count above the threshold in the ranks before this one.
        share = cute.arch.warp_redux_sync(above_share, "add")
        if cute.arch.lane_idx() == 0:
            cute.arch.atomic_add(found.iterator + 3, share)
        cute.arch.barrier()
        self.compact(start, n, tid, keys_at, out, row, threshold, need, found, totals)
        if cutlass.const_expr(not alone):
            # The exit barrier: its arrive followed the last pass's reads of
            # the peers' shared memory, which must outlive them.
            cute.arch.cluster_wait()

    @cute.jit
    def slice(self, logits, row, rank, end, parts):
        """CTA ``rank``'s slice of row ``row``'s ``end`` valid columns split
        in ``parts``: its first column, its column count and the address of
        its first."""
        vector = self.vector
        span = (end + parts - 1) // parts
        span = (span + vector - 1) // vector * vector
        start = rank * span
        n = cutlass.min(cutlass.max(end - start, Int32(0)), span)
        return start, n, self.row_base(logits, row) + start

    @cute.jit
    def load_slice(self, base, n, tid, keys_at, hist, found):
        """Reads the slice's ``n`` columns from ``base`` once into the shared
        keys, counting pass 0's digits as it goes (``count_at``), and the
        +0.0 keys into ``found[5]``."""
        vector = self.vector
        shift = self.key_bits - self.digits[0]
        zero = Uint32(self.zero_key)
        zeros = Int32(0)
        spare = BINS + cute.arch.lane_idx()
        full = n // vector
        for v0 in cutlass.range(tid, full, THREADS * self.unroll, unroll=1):
            loaded = []
            for u in cutlass.range_constexpr(self.unroll):
                v = v0 + u * THREADS
                loaded.append(load_words_if(base + v * vector, 4, v < full))
            for u in cutlass.range_constexpr(self.unroll):
                v = v0 + u * THREADS
                ok = v < full
                words = loaded[u]
                group = []
                if cutlass.const_expr(self.bf16):
                    for w in words:
                        group += [
                            order_key16(w & Uint32(0xFFFF)),
                            order_key16(w >> Uint32(16)),
                        ]
                else:
                    group = [order_key32(w) for w in words]
                if ok:
                    for h in cutlass.range_constexpr(vector // 4):
                        at = keys_at + (v * vector + 4 * h) * 4
                        store_shared4(at, *group[4 * h : 4 * h + 4])
                    for key in group:
                        zeros = self.count_key(key, zero, shift, zeros, spare, hist)
        if tid == 0:
            # The row end's last columns, one at a time.
            for i in cutlass.range(full * vector, n, unroll=1):
                if cutlass.const_expr(self.bf16):
                    key = order_key16(load_half(base + i))
                else:
                    key = order_key32(load_words_if(base + i, 1, True)[0])
                store_shared(keys_at + i * 4, key)
                zeros = self.count_key(key, zero, shift, zeros, spare, hist)
        self.add_zeros(zeros, zero, shift, hist, found)

    @cute.jit
    def count_key(self, key, zero, shift, zeros, spare, hist):
        """Counts ``key`` into pass 0's histogram as the load does
        (``count_at``); returns ``zeros``."""
        zeros, at = self.count_at(key, zero, shift, zeros, spare)
        cute.arch.atomic_add(hist.iterator + at, Int32(1))
        return zeros

    @cute.jit
    def add_zeros(self, zeros, zero, shift, hist, found):
        """Adds the warp's +0.0 keys (``zeros``, a lane's count) to their bin
        and to ``found[5]``, a warp at once."""
        zeros = cute.arch.warp_redux_sync(zeros, "add")
        if cute.arch.lane_idx() == 0:  # noqa: SIM102
            if zeros > 0:
                cute.arch.atomic_add(
                    hist.iterator + Int32(zero >> Uint32(shift)), zeros
                )
                cute.arch.atomic_add(found.iterator + 5, zeros)

    @cute.jit
    def count_at(self, key, zero, shift, zeros, spare):
        """``(zeros, bin)``: +0.0 keys are counted in ``zeros`` (the load
        adds them to their bin a warp at once: a plateau's keys would all
        hit one bin) and go to the lane's ``spare`` bin of the other
        histogram (cleared before pass 1 counts into it); other keys to their
        pass-0 bin. Branch-free: a branch costs the load loop its registers."""
        is_zero = Int32(key == zero)
        digit = Int32(key >> Uint32(shift))
        return zeros + is_zero, digit + (spare - digit) * is_zero

    @cute.jit
    def sync(self, alone):
        """Every count of the pass is complete and visible: a CTA barrier
        where ``alone``, else a cluster barrier."""
        if cutlass.const_expr(alone):
            cute.arch.barrier()
        else:
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def radix_select(self, n, tid, rank, keys_at, hist, totals, found, alone):
        """``(threshold, need, share)``: the top ``k`` are the keys above
        ``threshold`` and the first ``need`` equal to it; ``share`` is this
        thread's share of the count above it in the ranks before ``rank``.
        Pass by pass, ``threshold`` is the ``k``-th largest key; where the
        passes end early (every CTA sums the same histograms, so all end
        alike) it is just below a bin taken whole (``need`` 0) or +0.0."""
        prefix = Uint32(0)
        remaining = Int32(self.k)
        above_share = Int32(0)
        early = Int32(0)
        passes = len(self.digits)
        for p in cutlass.range_constexpr(passes):
            bits = self.digits[p]
            shift = self.key_bits - sum(self.digits[: p + 1])
            current = (p % 2) * BINS
            if early == 0:
                if cutlass.const_expr(p > 0):
                    high = prefix >> Uint32(shift + bits)
                    for i in cutlass.range(tid * _GROUP, n, _TILE, unroll=1):
                        # Four keys in the slice's capacity (past n: unused).
                        group = load_shared4(keys_at + i * 4)
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
                self.sync(alone)
                if cutlass.const_expr(p + 1 < passes):  # noqa: SIM102
                    # The other histogram: its last readers (this CTA's, or
                    # its peers') were done before the barrier above.
                    if tid < BINS:
                        hist[(1 - p % 2) * BINS + tid] = Int32(0)
                share = Int32(0)
                if cutlass.const_expr(alone):
                    # Warp 0 scans the CTA's counts, the CTA waits once.
                    if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                        self.find_alone(
                            p, prefix, shift, hist, current, remaining, tid, found
                        )
                    cute.arch.barrier()
                    digit, above, early = found[0], found[1], found[4]
                else:
                    digit, above, share, early = self.merge_find(
                        p,
                        prefix,
                        shift,
                        hist,
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
        if early == 1:
            threshold, need = prefix - Uint32(1), Int32(0)
        return threshold, need, above_share

    @cute.jit
    def merge_find(
        self, p, prefix, shift, hist, current, remaining, tid, rank, totals, found
    ):
        """Sums the cluster's histograms of pass ``p`` (thread ``t`` takes
        bin ``BINS - 1 - t``: a descending scan) and finds the digit whose bin
        holds the ``remaining``-th largest matching key and the count above
        it, and whether the passes end here (``early_end``; +0.0's count is
        summed by its bin's thread). Returns them with this thread's share
        of the count above the threshold in the ranks before ``rank``; the
        last pass, or +0.0, stores the count equal to it in those ranks
        (``found[2]``). The last pass, or an early end, arrives at the exit
        barrier once done reading the peers."""
        last = p + 1 == len(self.digits)
        bin_digit = (BINS - 1) - tid
        zero_digit = self.zero_key >> shift
        merged = Int32(0)
        before = Int32(0)
        zeros = Int32(0)
        zeros_before = Int32(0)
        if tid < BINS:
            hist_at = Int32(hist.iterator.toint())
            bin_at = hist_at + (current + bin_digit) * 4
            for q in cutlass.range_constexpr(self.cluster):
                count = Int32(load_peer(bin_at, q))
                merged = merged + count
                if q < rank:
                    before = before + count
            if cutlass.const_expr(p == 0):  # noqa: SIM102
                if bin_digit == zero_digit:
                    zeros_at = Int32(found.iterator.toint()) + 5 * 4
                    for q in cutlass.range_constexpr(self.cluster):
                        count = Int32(load_peer(zeros_at, q))
                        zeros = zeros + count
                        if q < rank:
                            zeros_before = zeros_before + count
        if cutlass.const_expr(last):
            cute.arch.cluster_arrive()
        above, _ = block_scan(merged, totals, 0, WARPS)
        if tid < BINS:  # noqa: SIM102
            if above < remaining and remaining <= above + merged:
                found[0] = bin_digit
                found[1] = above
                early = self.early_end(
                    p, prefix, shift, bin_digit, above, merged, remaining, zeros
                )
                if early == 2:
                    found[1] = above + merged - zeros
                    found[2] = zeros_before
                found[4] = early
                if cutlass.const_expr(last):
                    found[2] = before
        cute.arch.barrier()
        digit = found[0]
        early = found[4]
        if cutlass.const_expr(not last):  # noqa: SIM102
            if early != 0:
                cute.arch.cluster_arrive()
        share = Int32(0)
        if bin_digit > digit:
            share = before
        if bin_digit == digit:
            if early == 1:
                share = before
            if early == 2:
                share = before - zeros_before
        return digit, found[1], share, early

    @cute.jit
    def find_alone(self, p, prefix, shift, hist, current, remaining, lane, found):
        """What ``merge_find`` finds (``found[0]``, ``[1]``, ``[4]``), for a
        CTA alone, in warp 0 (a 1024-thread scan costs the pass more): lane
        ``l`` takes the 8 bins below ``BINS - 8 l``; the lane whose bins hold
        the ``remaining``-th largest key walks them down."""
        low = (BINS - 8) - 8 * lane
        at = Int32(hist.iterator.toint()) + (current + low) * 4
        counts = [Int32(c) for c in load_shared4(at) + load_shared4(at + 16)]
        lane_sum = counts[0]
        for j in cutlass.range_constexpr(1, 8):
            lane_sum = lane_sum + counts[j]
        run = warp_prefix_sum(lane_sum) - lane_sum
        # Nested: the DSL's ``and`` does not take two dynamic tests.
        if run < remaining:  # noqa: SIM102
            if remaining <= run + lane_sum:
                digit = Int32(0)
                above = Int32(0)
                merged = Int32(0)
                for j in cutlass.range_constexpr(7, -1, -1):
                    c = counts[j]
                    hit = Int32(run < remaining) & Int32(remaining <= run + c)
                    if hit != 0:
                        digit = low + j
                        above = run
                        merged = c
                    run = run + c
                found[0] = digit
                found[1] = above
                zeros = Int32(0)
                if cutlass.const_expr(p == 0):
                    zeros = found[5]
                early = self.early_end(
                    p, prefix, shift, digit, above, merged, remaining, zeros
                )
                if early == 2:
                    found[1] = above + merged - zeros
                found[4] = early

    @cute.jit
    def early_end(self, p, prefix, shift, digit, above, merged, remaining, zeros):
        """How the passes end at pass ``p``'s threshold bin ``digit`` (``above``
        keys above it, ``merged`` in it, ``zeros`` of them +0.0): 0, they go
        on; 1, the bin is taken whole (FP32), unless its lowest key is 0,
        which nothing is below; 2, pass 0's bin is +0.0's and the set needs
        more than the bin's other keys, which are above +0.0: the threshold
        is +0.0."""
        early = Int32(0)
        if cutlass.const_expr(self.whole_exit):
            lowest = prefix | (Uint32(digit) << Uint32(shift))
            early = Int32(above + merged == remaining) & Int32(lowest > Uint32(0))
        if cutlass.const_expr(p == 0):
            at_zero = (
                Int32(early == 0)
                & Int32(digit == self.zero_key >> shift)
                & Int32(remaining > above + merged - zeros)
            )
            early = early + 2 * at_zero
        return early

    @cute.jit
    def compact(self, start, n, tid, keys_at, out, row, threshold, need, found, totals):
        """Writes the slice's columns above the threshold and its share of
        the first ``need`` equal to it, in column order, at the slots after
        the ranks before it; stops once the row's ``k`` are written."""
        group = self.out_group
        tile = THREADS * group
        above_run = found[3]
        equal_run = found[2]
        tiles = (n + tile - 1) // tile
        for t in cutlass.range(tiles, unroll=1):
            if above_run + cutlass.min(equal_run, need) < self.k:
                i0 = t * tile + tid * group
                # Past n (masked below) but within the capacity.
                at = keys_at + cutlass.min(i0, self.capacity - group) * 4
                words = []
                for h in cutlass.range_constexpr(group // 4):
                    words += list(load_shared4(at + 16 * h))
                gt = Int32(0)
                eq = Int32(0)
                for i in cutlass.range_constexpr(group):
                    if i0 + i < n:
                        if words[i] > threshold:
                            gt = gt | Int32(1 << i)
                        if words[i] == threshold:
                            eq = eq | Int32(1 << i)
                packed = Int32(cute.arch.popc(gt)) + (Int32(cute.arch.popc(eq)) << 16)
                before, tile_total = block_scan(packed, totals, (t & 1) * WARPS, WARPS)
                above = above_run + (before & Int32(0xFFFF))
                equal = equal_run + (before >> 16)
                for i in cutlass.range_constexpr(group):
                    g = (gt >> i) & Int32(1)
                    e = (eq >> i) & Int32(1)
                    taken = g
                    if e == 1 and equal < need:
                        taken = Int32(1)
                    if taken == 1:
                        column = start + i0 + i
                        out[row, above + cutlass.min(equal, need)] = column
                    above = above + g
                    equal = equal + e
                above_run = above_run + (tile_total & Int32(0xFFFF))
                equal_run = equal_run + (tile_total >> 16)
