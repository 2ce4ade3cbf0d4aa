# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The select fed by the scores (``FedSelectTopk``): ``SelectKernel``'s
contract on FP32 logits, one CTA a row, its first radix digit taken from the
row's histogram that the opt-in scores' epilogue counted.

The histogram is a hint, checked: ``histogram[row, :256]`` counts the row's
valid columns by the top 8 bits of their order key (``_key32``) and
``histogram[row, 256]`` its +0.0 keys. The kernel reads the row's 257 words
and zeroes them (the next step's scores add to zeros). Where the 256 counts
do not sum to the row's valid columns (a stale or unwritten histogram), it
counts the first digit itself in one more read of the row. Every read after
that checks the counts it relied on (the keys above the threshold bin, the
keys in it) and, where they differ, starts over without the hint: the bytes
never depend on the histogram.

Then: while the threshold bin holds more than ``CANDIDATES`` keys, one read
of the row counts the next digit within it; once it fits, one read marks the
columns above the bin in a bitmap and copies the bin's keys and columns into
shared memory, whose remaining digits the CTA refines alone. The threshold
found, the columns above it and those equal to it are two bitmaps, and one
scan of their words writes the ``k`` columns in ascending order.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from ..common.ptx import load_words_if
from .kernel import BINS, THREADS, WARPS, SelectTopk, _key32
from .kernel import _load_shared4 as load_shared4

# The histogram's words a row: the 256 bins, then the +0.0 count.
HISTOGRAM = BINS + 1
# The threshold bin's keys the CTA refines in shared memory (a key and a
# column each).
CANDIDATES = 8192
# 16-byte row loads in flight per thread in a read of the row.
UNROLL = 4
ZERO_KEY = 0x80000000
# ``found``'s words: what a find writes (the digit, the count above its bin,
# how the passes end) and what a read counts.
DIGIT, ABOVE, SUM, TAKEN, EARLY, ZEROS, SEEN_ABOVE, SEEN_BIN = range(8)
FOUND = 8
# What a read of the row does with a key (``visit_row``).
COUNT, COLLECT, MARK = range(3)


class FedSelectTopk(SelectTopk):
    """CTA ``row`` selects row ``row`` of at most ``columns`` (the compile
    key's) valid columns."""

    def __init__(self, key):
        self.k, self.columns = key.k, key.columns
        self.words = key.columns // 32
        # What the select's own pass-0 find (``find_alone``) reads.
        self.key_bits, self.digits = 32, (8, 8, 8, 8)
        self.zero_key, self.whole_exit = ZERO_KEY, True

    @cute.jit
    def __call__(
        self,
        logits: cute.Tensor,
        ends: cute.Tensor,
        histogram: cute.Tensor,
        out: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.kernel(logits, ends, histogram, out).launch(
            grid=(out.shape[0], 1, 1),
            block=(THREADS, 1, 1),
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(
        self,
        logits: cute.Tensor,
        ends: cute.Tensor,
        histogram: cute.Tensor,
        out: cute.Tensor,
    ):
        row, _, _ = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        shared = self.allocate()
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        end = cutlass.min(cutlass.max(Int32(ends[row]), Int32(0)), logits.shape[1])
        # Every row's histogram is read once and zeroed, whatever its end.
        counted = Int32(0)
        if tid < HISTOGRAM:
            counted = histogram[row, tid]
            histogram[row, tid] = Int32(0)
        if end <= self.k:
            # Every valid column, in order, then -1 (stock's bytes).
            for i in cutlass.range(tid, self.k, THREADS, unroll=1):
                value = Int32(-1)
                if i < end:
                    value = i
                out[row, i] = value
        else:
            base = logits.iterator + Int64(row) * logits.stride[0]
            self.select_row(base, out, row, end, tid, counted, shared)

    @cute.jit
    def allocate(self):
        smem = cutlass.memory.SmemAllocator()
        hist = smem.allocate_tensor(Int32, cute.make_layout(2 * BINS), 16)
        totals = smem.allocate_tensor(Int32, cute.make_layout(2 * WARPS))
        found = smem.allocate_tensor(Int32, cute.make_layout(FOUND))
        keys = smem.allocate_tensor(Uint32, cute.make_layout(CANDIDATES), 16)
        columns = smem.allocate_tensor(Int32, cute.make_layout(CANDIDATES), 16)
        above = smem.allocate_tensor(Uint32, cute.make_layout(self.words), 16)
        equal = smem.allocate_tensor(Uint32, cute.make_layout(self.words), 16)
        return hist, totals, found, keys, columns, above, equal

    @cute.jit
    def select_row(self, base, out, row, end, tid, counted, shared):
        hist, totals, found, keys, columns, above, equal = shared
        if tid < BINS:
            hist[tid] = counted
        if tid == BINS:
            found[ZEROS] = counted
        if tid < FOUND:  # noqa: SIM102
            if tid != ZEROS:
                found[tid] = Int32(0)
        cute.arch.barrier()
        total = cute.arch.warp_redux_sync(counted, "add")
        if tid < BINS:  # noqa: SIM102
            if cute.arch.lane_idx() == 0:
                cute.arch.atomic_add(found.iterator + SUM, total)
        cute.arch.barrier()
        hinted = Int32(found[SUM] == end)
        threshold = Uint32(0)
        need = Int32(0)
        done = Int32(0)
        for attempt in cutlass.range(2, unroll=1):
            if done == 0:
                threshold, need, done = self.threshold(
                    base, end, tid, hinted & Int32(attempt == 0), shared
                )
        cute.arch.barrier()
        _, totals, _, _, _, above, equal = shared
        self.write_marked(base, out, row, 0, end, tid, need, totals, above, equal)

    @cute.jit
    def threshold(self, base, end, tid, hinted, shared):
        """``(threshold, need, 1)``: the top ``k`` are the keys above
        ``threshold`` and the first ``need`` equal to it, their columns set
        in ``above`` and ``equal``; ``(.., .., 0)`` where a read found the
        histogram's counts wrong. ``hinted``: pass 0 from the histogram's
        counts, else counted here."""
        hist, _, found, keys, columns, above, equal = shared
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        for w in cutlass.range(tid, (end + 31) // 32, THREADS, unroll=1):
            above[w] = Uint32(0)
            equal[w] = Uint32(0)
        if hinted == 0:
            if tid < BINS:
                hist[tid] = Int32(0)
            if tid == 0:
                found[ZEROS] = Int32(0)
            self.clear_seen(tid, found)
            self.visit_row(base, end, tid, shared, COUNT, 0, Uint32(0), Uint32(0))
        cute.arch.barrier()
        if warp == 0:
            self.find_alone(0, Uint32(0), 24, hist, 0, Int32(self.k), lane, found)
        cute.arch.barrier()
        digit, early, zeros = found[DIGIT], found[EARLY], found[ZEROS]
        prefix = Uint32(digit) << Uint32(24)
        remaining = Int32(self.k) - found[ABOVE]
        # Where the threshold is above +0.0 in +0.0's bin, the +0.0 keys are
        # neither counted nor copied (a plateau would fill the bin).
        skip_zero = Int32(digit == ZERO_KEY >> 24) & Int32(early == 0)
        in_bin = hist[digit] - zeros * skip_zero
        good = Int32(1)
        copied = Int32(0)
        n = Int32(0)
        for p in cutlass.range_constexpr(1, 4):
            shift = 24 - 8 * p
            if (Int32(early == 0) & good) == 1:
                if (Int32(in_bin <= CANDIDATES) & (1 - copied)) == 1:
                    # The bin's keys to shared memory, the columns above it
                    # to ``above``.
                    cut = prefix | Uint32((1 << (shift + 8)) - 1)
                    self.clear_seen(tid, found)
                    self.visit_row(
                        base, end, tid, shared, COLLECT, p, prefix, cut, skip_zero
                    )
                    taken = found[TAKEN]
                    seen = found[SEEN_ABOVE]
                    good = Int32(taken == in_bin) & Int32(seen == self.k - remaining)
                    n = cutlass.min(taken, Int32(CANDIDATES))
                    copied = Int32(1)
                current = (p % 2) * BINS
                if tid < BINS:
                    hist[current + tid] = Int32(0)
                self.clear_seen(tid, found)
                if copied == 1:
                    self.count_copied(p, prefix, n, tid, shared, current)
                else:
                    self.visit_row(
                        base, end, tid, shared, COUNT, p, prefix, prefix, skip_zero
                    )
                    good = Int32(found[SEEN_BIN] == in_bin)
                if good == 1:
                    if warp == 0:
                        self.find_alone(
                            p, prefix, shift, hist, current, remaining, lane, found
                        )
                    cute.arch.barrier()
                    digit = found[DIGIT]
                    early = found[EARLY]
                    in_bin = hist[current + digit]
                    prefix = prefix | (Uint32(digit) << Uint32(shift))
                    remaining = remaining - found[ABOVE]
        threshold, need = prefix, remaining
        if early == 1:
            threshold, need = prefix - Uint32(1), Int32(0)
        if good == 1:
            if copied == 1:
                self.mark_copied(n, tid, threshold, shared)
            else:
                self.clear_seen(tid, found)
                self.visit_row(base, end, tid, shared, MARK, 0, threshold, threshold)
                taken = found[SEEN_ABOVE]
                good = Int32(taken == self.k - need) & Int32(found[SEEN_BIN] >= need)
        cute.arch.barrier()
        return threshold, need, good

    @cute.jit
    def clear_seen(self, tid, found):
        """Zeroes what a read counts, then a CTA barrier (which also orders
        the reads of ``found`` before it)."""
        cute.arch.barrier()
        if tid == 0:
            found[TAKEN] = Int32(0)
            found[SEEN_ABOVE] = Int32(0)
            found[SEEN_BIN] = Int32(0)
        cute.arch.barrier()

    @cute.jit
    def visit_row(self, base, end, tid, shared, mode, p, low, cut, skip_zero=0):
        """One read of the row's ``end`` keys, then a CTA barrier. ``mode``
        (constexpr) is what a key does:

        - ``COUNT``: pass ``p``'s digit counted into its histogram (pass 0:
          every key, +0.0 in ``found[ZEROS]`` instead; else the keys of
          ``low``'s bin of pass ``p - 1``, in ``found[SEEN_BIN]`` too);
        - ``COLLECT``: a key above ``cut`` sets its column in ``above``
          (``found[SEEN_ABOVE]``); a key of ``low``'s bin of pass ``p - 1``
          goes to the shared keys and columns (``found[TAKEN]``);
        - ``MARK``: a key above ``low`` sets ``above``, one equal to it
          ``equal`` (``found[SEEN_BIN]``).

        ``skip_zero``: +0.0 is in no bin. A warp looks at a vector's keys
        only where one of its lanes holds a key at or above ``low``."""
        hist, _, found, _, _, _, _ = shared
        hot_low = low
        if cutlass.const_expr(mode != MARK):
            hot_low = low + Uint32(Int32(low == ZERO_KEY) & Int32(skip_zero))
        if cutlass.const_expr(mode == COUNT and p == 0):
            hot_low = Uint32(0)
        zeros = Int32(0)
        seen_above = Int32(0)
        seen_bin = Int32(0)
        full = end // 4
        step = THREADS * UNROLL
        for it in cutlass.range((full + step - 1) // step, unroll=1):
            v0 = it * step + tid
            loaded = [
                load_words_if(base + (v0 + u * THREADS) * 4, 4, v0 + u * THREADS < full)
                for u in range(UNROLL)
            ]
            for u in cutlass.range_constexpr(UNROLL):
                v = v0 + u * THREADS
                ok = Int32(v < full)
                keys = [_key32(w) for w in loaded[u]]
                hot = Int32(0)
                for key in keys:
                    hot = hot | Int32(key >= hot_low)
                if cute.arch.vote_any_sync((hot & ok) != 0):
                    zeros, seen_above, seen_bin = self.visit_vector(
                        keys,
                        v,
                        ok,
                        shared,
                        mode,
                        p,
                        low,
                        cut,
                        skip_zero,
                        zeros,
                        seen_above,
                        seen_bin,
                    )
        if tid == 0:
            # The row end's last columns, one at a time.
            for i in cutlass.range(full * 4, end, unroll=1):
                key = _key32(load_words_if(base + i, 1, True)[0])
                zeros, seen_above, seen_bin = self.visit_key(
                    key,
                    i,
                    shared,
                    mode,
                    p,
                    low,
                    cut,
                    skip_zero,
                    zeros,
                    seen_above,
                    seen_bin,
                )
        zeros = cute.arch.warp_redux_sync(zeros, "add")
        seen_above = cute.arch.warp_redux_sync(seen_above, "add")
        seen_bin = cute.arch.warp_redux_sync(seen_bin, "add")
        if cute.arch.lane_idx() == 0:
            if cutlass.const_expr(mode == COUNT and p == 0):
                cute.arch.atomic_add(hist.iterator + (ZERO_KEY >> 24), zeros)
                cute.arch.atomic_add(found.iterator + ZEROS, zeros)
            else:
                cute.arch.atomic_add(found.iterator + SEEN_ABOVE, seen_above)
                cute.arch.atomic_add(found.iterator + SEEN_BIN, seen_bin)
        cute.arch.barrier()

    @cute.jit
    def in_bin(self, key, p, low, skip_zero):
        """1 where ``key`` is in ``low``'s bin of pass ``p - 1`` (+0.0 not,
        where ``skip_zero``), else 0."""
        shift = Uint32(32 - 8 * p)
        match = Int32(key >> shift == low >> shift)
        return match & (1 - (Int32(key == ZERO_KEY) & Int32(skip_zero)))

    @cute.jit
    def count_key(self, key, take, p, hist, zeros, seen_bin):
        """Pass ``p``'s count of ``key`` where ``take`` (pass 0: +0.0 in
        ``zeros``; else in the bin, in ``seen_bin`` too)."""
        if cutlass.const_expr(p == 0):
            zero = take & Int32(key == ZERO_KEY)
            zeros = zeros + zero
            if (take - zero) == 1:
                cute.arch.atomic_add(hist.iterator + Int32(key >> Uint32(24)), Int32(1))
        else:
            seen_bin = seen_bin + take
            if take == 1:
                digit = Int32((key >> Uint32(24 - 8 * p)) & Uint32(BINS - 1))
                at = hist.iterator + (p % 2) * BINS + digit
                cute.arch.atomic_add(at, Int32(1))
        return zeros, seen_bin

    @cute.jit
    def visit_vector(
        self,
        keys,
        v,
        ok,
        shared,
        mode,
        p,
        low,
        cut,
        skip_zero,
        zeros,
        seen_above,
        seen_bin,
    ):
        """``visit_row``'s keys of vector ``v`` (columns ``4 v`` on), the
        whole warp at once: 8 lanes' 32 columns are one word of a bitmap."""
        hist, _, found, copied_keys, copied_columns, above, equal = shared
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(mode == COUNT):
            for j in cutlass.range_constexpr(4):
                take = ok
                if cutlass.const_expr(p > 0):
                    take = ok & self.in_bin(keys[j], p, low, skip_zero)
                zeros, seen_bin = self.count_key(
                    keys[j], take, p, hist, zeros, seen_bin
                )
        else:
            top = cut if cutlass.const_expr(mode == COLLECT) else low
            higher = Uint32(0)
            same = Uint32(0)
            for j in cutlass.range_constexpr(4):
                higher = higher | (Uint32(ok & Int32(keys[j] > top)) << Uint32(j))
                if cutlass.const_expr(mode == MARK):
                    same = same | (Uint32(ok & Int32(keys[j] == low)) << Uint32(j))
            seen_above = seen_above + Int32(cute.arch.popc(higher))
            self.set_bits(above, v, higher, lane)
            if cutlass.const_expr(mode == MARK):
                seen_bin = seen_bin + Int32(cute.arch.popc(same))
                self.set_bits(equal, v, same, lane)
            else:
                for j in cutlass.range_constexpr(4):
                    take = ok & self.in_bin(keys[j], p, low, skip_zero)
                    ballot = Uint32(cute.arch.vote_ballot_sync(take == 1))
                    if ballot != 0:
                        first = Int32(0)
                        if lane == 0:
                            first = cute.arch.atomic_add(
                                found.iterator + TAKEN, Int32(cute.arch.popc(ballot))
                            )
                        first = cute.arch.shuffle_sync(first, offset=0)
                        if take == 1:
                            before = ballot & cute.arch.lanemask_lt()
                            slot = first + Int32(cute.arch.popc(before))
                            if slot < CANDIDATES:
                                copied_keys[slot] = keys[j]
                                copied_columns[slot] = v * 4 + j
        return zeros, seen_above, seen_bin

    @cute.jit
    def set_bits(self, bitmap, v, nibble, lane):
        """ORs each lane's ``nibble`` (the bits of its vector ``v``'s four
        columns) into ``bitmap``: one word a group of 8 lanes."""
        bits = nibble << Uint32(4 * (lane % 8))
        for offset in cutlass.range_constexpr(3):
            bits = bits | Uint32(cute.arch.shuffle_sync_bfly(bits, offset=1 << offset))
        if lane % 8 == 0:  # noqa: SIM102
            if bits != 0:
                cute.arch.atomic_or(bitmap.iterator + v // 8, bits)

    @cute.jit
    def visit_key(
        self,
        key,
        column,
        shared,
        mode,
        p,
        low,
        cut,
        skip_zero,
        zeros,
        seen_above,
        seen_bin,
    ):
        """``visit_row``'s one key at ``column``, one thread alone."""
        hist, _, found, copied_keys, copied_columns, above, equal = shared
        bit = Uint32(1) << Uint32(column % 32)
        if cutlass.const_expr(mode == COUNT):
            take = Int32(1)
            if cutlass.const_expr(p > 0):
                take = self.in_bin(key, p, low, skip_zero)
            zeros, seen_bin = self.count_key(key, take, p, hist, zeros, seen_bin)
        else:
            top = cut if cutlass.const_expr(mode == COLLECT) else low
            if key > top:
                cute.arch.atomic_or(above.iterator + column // 32, bit)
                seen_above = seen_above + 1
            if cutlass.const_expr(mode == MARK):
                if key == low:
                    cute.arch.atomic_or(equal.iterator + column // 32, bit)
                    seen_bin = seen_bin + 1
            elif self.in_bin(key, p, low, skip_zero) == 1:
                slot = cute.arch.atomic_add(found.iterator + TAKEN, Int32(1))
                if slot < CANDIDATES:
                    copied_keys[slot] = key
                    copied_columns[slot] = column
        return zeros, seen_above, seen_bin

    @cute.jit
    def count_copied(self, p, prefix, n, tid, shared, current):
        """Pass ``p``'s count over the ``n`` shared keys of ``prefix``'s bin
        of pass ``p - 1``, then a CTA barrier."""
        hist, _, _, keys, _, _, _ = shared
        keys_at = Int32(keys.iterator.toint())
        high = prefix >> Uint32(32 - 8 * p)
        shift = Uint32(24 - 8 * p)
        for i in cutlass.range(tid * 4, n, THREADS * 4, unroll=1):
            group = load_shared4(keys_at + i * 4)
            for j in cutlass.range_constexpr(4):
                key = group[j]
                if i + j < n:  # noqa: SIM102
                    if key >> Uint32(32 - 8 * p) == high:
                        digit = Int32((key >> shift) & Uint32(BINS - 1))
                        cute.arch.atomic_add(hist.iterator + current + digit, Int32(1))
        cute.arch.barrier()

    @cute.jit
    def mark_copied(self, n, tid, threshold, shared):
        """Sets the shared keys' columns above ``threshold`` in ``above``,
        those equal to it in ``equal``."""
        _, _, _, keys, columns, above, equal = shared
        for i in cutlass.range(tid, n, THREADS, unroll=1):
            key = keys[i]
            column = columns[i]
            bit = Uint32(1) << Uint32(column % 32)
            if key > threshold:
                cute.arch.atomic_or(above.iterator + column // 32, bit)
            if key == threshold:
                cute.arch.atomic_or(equal.iterator + column // 32, bit)
