# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The split select, ``SelectKernel``'s device code for a key with a
``chunk``: the select's bytes in two launches linked by PDL, one CTA a
chunk and then one CTA a row, none of them in a cluster.

1. ``ChunkSelect``: CTA ``row * parts + c`` selects the top ``k`` of chunk
   ``c`` (columns ``[c * chunk, (c + 1) * chunk)`` of the row's valid ones)
   into row ``row * parts + c`` of the ``chunks`` workspace, its columns
   counted from the chunk's first.
2. ``MergeSelect``: CTA ``row`` selects the top ``k`` of the row's
   candidates, chunk ``c``'s ``i``-th at position ``c * k + i``, reading
   each candidate's key from the logits through the workspace, and writes
   the columns they stand for.

Why these are the select's bytes: its rule is a total order (the key, then
the lower column), so a row's top ``k`` are among its chunks' top ``k``.
Positions ascend with the columns they stand for (chunk by chunk, each
chunk's in ascending order), so among equal keys the lowest position is the
lowest column, and position order is column order. A chunk holds
``min(k, its valid columns)`` candidates, and only a row's last nonempty
chunk holds fewer than ``k``: the valid candidates are positions ``[0, n)``.

Why split: past one wave of clusters every cluster of a long row holds it
in shared memory and runs its dependent passes, one CTA an SM, its warps
waiting at a cluster barrier a pass; chunks of ``chunk`` columns keep two
CTAs an SM with CTA barriers only, and the merge selects from ``parts * k``
candidates. Each CTA selects alone, so it can select lean (``LeanRows``):
after pass 0 it reads its keys twice, not once a pass and once to compact
(docs/performance.md, "The split select").
"""

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from ..common.ptx import load_words_if
from .kernel import (
    _GROUP,
    _TILE,
    BINS,
    FOUND,
    THREADS,
    WARPS,
    SelectTopk,
    _block_scan,
    _key16,
    _key32,
    _load_half,
    _load_shared4,
    _store_shared,
    _store_shared4,
    ctas_per_sm,
)

# Positions a thread reads at once: four int32 columns of the workspace (a
# chunk's ``k`` is a multiple of 4, so they never straddle two chunks).
_POSITIONS = 4
# Vectors of positions in flight per thread: each is two dependent loads
# (the columns, then the logits they name).
_MERGE_UNROLL = 2
# The merge's CTAs an SM: one, with 64 registers a thread (in 32 its
# workspace and logits addresses spill).
MERGE_CTAS_PER_SM = 1
# Whether the split's CTAs select lean (``LeanRows``), else with the
# select's own passes over every key and its compaction.
LEAN = True
# The threshold bin's keys a lean CTA copies for its later passes: a pass-0
# bin (the sign and 7 exponent bits of an FP32) holds about 28 % of a
# ``randn`` chunk's 16384 keys; 32 KiB keeps two chunk CTAs an SM.
BIN_KEYS = 8192


@cute.jit
def _parts(logits, chunk: int):
    """The chunks of a row of ``logits``' width."""
    return (logits.shape[1] + (chunk - 1)) // chunk


class LeanRows:
    """A one-CTA select over its shared keys (``SelectTopk.select_row`` with
    ``alone``) that reads them twice after the load instead of once a pass
    and once more to compact: pass 0 found, the keys of its threshold bin
    are copied (where they fit ``BIN_KEYS``) and the later passes count the
    copies only; the threshold found, one scan sets each position above it
    in one bitmap and each equal to it in another, and one scan of the
    bitmaps' words writes the columns (``write_marked``, the fed select's
    write). The same threshold and bytes as the select's: its own
    ``radix_select`` runs over the copies (a key outside the bin never
    matched a later pass's prefix), or over every key where the bin does
    not fit or the passes end at +0.0."""

    @cute.jit
    def allocate(self):
        if cutlass.const_expr(not self.lean):
            return SelectTopk.allocate(self)
        smem = cutlass.memory.SmemAllocator()
        hist = smem.allocate_tensor(Int32, cute.make_layout(2 * BINS), 16)
        totals = smem.allocate_tensor(Int32, cute.make_layout(2 * WARPS))
        found = smem.allocate_tensor(Int32, cute.make_layout(FOUND))
        keys = smem.allocate_tensor(Uint32, cute.make_layout(self.capacity), 16)
        bin_keys = smem.allocate_tensor(Uint32, cute.make_layout(BIN_KEYS), 16)
        words = cute.make_layout(self.capacity // 32)
        above = smem.allocate_tensor(Uint32, words, 16)
        equal = smem.allocate_tensor(Uint32, words, 16)
        return hist, totals, found, keys, bin_keys, above, equal

    @cute.jit
    def select_row(self, source, out, row, rank, end, tid, shared, alone):
        if cutlass.const_expr(not self.lean):
            SelectTopk.select_row(self, source, out, row, rank, end, tid, shared, alone)
        else:
            hist, totals, found, keys, bin_keys, above, equal = shared
            start, n, base = self.slice(source, row, rank, end, 1)
            if tid < BINS:
                hist[tid] = Int32(0)
            if tid < FOUND:
                found[tid] = Int32(0)
            for w in cutlass.range(tid, (n + 31) // 32, THREADS, unroll=1):
                above[w] = Uint32(0)
                equal[w] = Uint32(0)
            cute.arch.barrier()
            keys_at = Int32(keys.iterator.toint())
            self.load_slice(base, n, tid, keys_at, hist, found)
            cute.arch.barrier()
            shift = self.key_bits - self.digits[0]
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                lane = cute.arch.lane_idx()
                self.find_alone(
                    0, Uint32(0), shift, hist, 0, Int32(self.k), lane, found
                )
            cute.arch.barrier()
            digit, early = found[0], found[4]
            in_bin = hist[digit]
            # A bin taken whole: every key from it up (the select's own
            # early end, its threshold just below the bin).
            threshold = (Uint32(digit) << Uint32(shift)) - Uint32(1)
            need = Int32(0)
            if early != 1:
                at, count = keys_at, n
                if (Int32(early == 0) & Int32(in_bin <= BIN_KEYS)) == 1:
                    self.copy_bin(n, tid, keys_at, bin_keys, totals, digit, shift)
                    at, count = Int32(bin_keys.iterator.toint()), in_bin
                threshold, need, _ = self.radix_select(
                    count, tid, rank, at, hist, totals, found, True
                )
            self.mark(n, tid, keys_at, above, equal, threshold)
            self.write_marked(
                source, out, row, start, n, tid, need, totals, above, equal
            )

    @cute.jit
    def copy_bin(self, n, tid, keys_at, bin_keys, totals, digit, shift):
        """Copies the keys whose first digit is ``digit`` to ``bin_keys``: each
        thread counts its own, one CTA scan of the counts places them, a
        second read copies them (no atomics, no warp-wide step a key); then
        a CTA barrier."""
        count = Int32(0)
        for i in cutlass.range(tid * _GROUP, n, _TILE, unroll=1):
            group = _load_shared4(keys_at + i * 4)
            for j in cutlass.range_constexpr(_GROUP):
                count = count + self.in_bin(group[j], i + j, n, digit, shift)
        slot, _ = _block_scan(count, totals, 0)
        for i in cutlass.range(tid * _GROUP, n, _TILE, unroll=1):
            group = _load_shared4(keys_at + i * 4)
            for j in cutlass.range_constexpr(_GROUP):
                take = self.in_bin(group[j], i + j, n, digit, shift)
                if take == 1:
                    bin_keys[slot] = group[j]
                slot = slot + take
        cute.arch.barrier()

    @cute.jit
    def in_bin(self, key, position, n, digit, shift):
        """1 where ``position`` is below ``n`` and ``key``'s first digit is
        ``digit``, else 0."""
        return Int32(position < n) & Int32(key >> Uint32(shift) == Uint32(digit))

    @cute.jit
    def mark(self, n, tid, keys_at, above, equal, threshold):
        """Sets each position whose key is above ``threshold`` in ``above``,
        each equal to it in ``equal`` (a thread's four positions lie in one
        word), then a CTA barrier."""
        for it in cutlass.range((n + _TILE - 1) // _TILE, unroll=1):
            i = it * _TILE + tid * _GROUP
            group = _load_shared4(keys_at + i * 4)
            gt = Uint32(0)
            eq = Uint32(0)
            for j in cutlass.range_constexpr(_GROUP):
                ok = Int32(i + j < n)
                gt = gt | (Uint32(ok & Int32(group[j] > threshold)) << Uint32(j))
                eq = eq | (Uint32(ok & Int32(group[j] == threshold)) << Uint32(j))
            at = Uint32(i % 32)
            if gt != 0:
                cute.arch.atomic_or(above.iterator + i // 32, gt << at)
            if eq != 0:
                cute.arch.atomic_or(equal.iterator + i // 32, eq << at)
        cute.arch.barrier()


class ChunkSelect(LeanRows, SelectTopk):
    """Launch 1: ``SelectTopk`` of one CTA a chunk of ``chunk`` columns; its
    row ``q`` is chunk ``q % parts`` of logits row ``q // parts``."""

    def __init__(self, key):
        chunk = dataclasses.replace(key, cluster=1, capacity=key.chunk, chunk=0)
        super().__init__(chunk)
        self.chunk, self.lean = key.chunk, LEAN

    @cute.jit
    def chunk_of(self, logits, q):
        """(the logits row of chunk row ``q``, the chunk's first column)."""
        parts = _parts(logits, self.chunk)
        row = q // parts
        return row, (q - row * parts) * self.chunk

    @cute.jit
    def row_end(self, logits, ends, q):
        row, first = self.chunk_of(logits, q)
        end = SelectTopk.row_end(self, logits, ends, row)
        return cutlass.min(cutlass.max(end - first, Int32(0)), Int32(self.chunk))

    @cute.jit
    def row_base(self, logits, q):
        row, first = self.chunk_of(logits, q)
        return SelectTopk.row_base(self, logits, row) + first


class MergeSelect(LeanRows, SelectTopk):
    """Launch 2: ``SelectTopk`` of one CTA a row over the row's candidates
    (the source is ``(logits, chunks)``; a slice's base is ``(source,
    row)``)."""

    def __init__(self, key):
        super().__init__(dataclasses.replace(key, cluster=1, chunk=0))
        self.chunk, self.lean = key.chunk, LEAN

    @cute.kernel
    def kernel(
        self,
        logits: cute.Tensor,
        ends: cute.Tensor,
        chunks: cute.Tensor,
        out: cute.Tensor,
    ):
        self.select((logits, chunks), ends, out)

    @cute.jit
    def row_end(self, source, ends, row):
        """The row's valid candidates: ``k`` a full chunk, and
        ``min(k, rest)`` for the valid columns past them."""
        logits, _ = source
        end = SelectTopk.row_end(self, logits, ends, row)
        full = end // self.chunk
        rest = end - full * self.chunk
        return full * self.k + cutlass.min(rest, Int32(self.k))

    @cute.jit
    def slice(self, source, row, rank, end, parts):
        return Int32(0), end, (source, row)

    @cute.jit
    def column(self, source, row, position):
        logits, chunks = source
        c = position // self.k
        chosen = chunks[row * _parts(logits, self.chunk) + c, position - c * self.k]
        return c * self.chunk + Int32(chosen)

    @cute.jit
    def key_at(self, row_at, column):
        """The order key of the row's logit at ``column``."""
        if cutlass.const_expr(self.bf16):
            return _key16(_load_half(row_at + column))
        return _key32(load_words_if(row_at + column, 1, True)[0])

    @cute.jit
    def load_slice(self, base, n, tid, keys_at, hist, found):
        """``SelectTopk.load_slice`` over the ``n`` candidates: each
        thread reads four positions' columns from the workspace, then the
        logits they name."""
        (logits, chunks), row = base
        shift = self.key_bits - self.digits[0]
        zero = Uint32(self.zero_key)
        zeros = Int32(0)
        spare = BINS + cute.arch.lane_idx()
        row_at = logits.iterator + Int64(row) * logits.stride[0]
        first = Int64(row * _parts(logits, self.chunk)) * chunks.stride[0]
        chunks_at = chunks.iterator + first
        full = n // _POSITIONS
        step = THREADS * _MERGE_UNROLL
        for v0 in cutlass.range(tid, full, step, unroll=1):
            columns = []
            for u in cutlass.range_constexpr(_MERGE_UNROLL):
                v = v0 + u * THREADS
                p = v * _POSITIONS
                c = p // self.k
                chosen = chunks_at + Int64(c) * chunks.stride[0] + (p - c * self.k)
                words = load_words_if(chosen, _POSITIONS, v < full)
                # Past ``full`` the words are 0 and ``c`` may pass the last
                # chunk: such lanes read column 0, which they do not store.
                offset = c * self.chunk * Int32(v < full)
                columns.append([offset + Int32(w) for w in words])
            for u in cutlass.range_constexpr(_MERGE_UNROLL):
                v = v0 + u * THREADS
                group = [self.key_at(row_at, col) for col in columns[u]]
                if v < full:
                    _store_shared4(keys_at + v * _POSITIONS * 4, *group)
                    for key in group:
                        zeros = self.count_key(key, zero, shift, zeros, spare, hist)
        if tid == 0:
            # The last candidates, one at a time.
            for i in cutlass.range(full * _POSITIONS, n, unroll=1):
                key = self.key_at(row_at, self.column(base[0], row, i))
                _store_shared(keys_at + i * 4, key)
                zeros = self.count_key(key, zero, shift, zeros, spare, hist)
        self.add_zeros(zeros, zero, shift, hist, found)


class SplitSelectTopk:
    """The split select of ``key`` (``key.chunk`` columns a chunk; the
    merge's candidates in ``key.capacity`` shared keys)."""

    def __init__(self, key):
        assert key.chunk % _POSITIONS == 0 and key.k % _POSITIONS == 0, key
        self.chunks, self.merge = ChunkSelect(key), MergeSelect(key)

    @cute.jit
    def __call__(
        self,
        logits: cute.Tensor,
        ends: cute.Tensor,
        chunks: cute.Tensor,
        out: cute.Tensor,
        stream: cuda.CUstream,
    ):
        # ``chunks`` holds exactly the rows' chunks: one CTA each.
        self.chunks.kernel(logits, ends, chunks).launch(
            grid=(chunks.shape[0], 1, 1),
            block=(THREADS, 1, 1),
            stream=stream,
            use_pdl=True,
            min_blocks_per_mp=ctas_per_sm(self.chunks.capacity),
            preferred_smem_carveout=100,
        )
        self.merge.kernel(logits, ends, chunks, out).launch(
            grid=(out.shape[0], 1, 1),
            block=(THREADS, 1, 1),
            stream=stream,
            use_pdl=True,
            min_blocks_per_mp=MERGE_CTAS_PER_SM,
            preferred_smem_carveout=100,
        )
