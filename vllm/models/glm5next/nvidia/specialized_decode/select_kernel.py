# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pool top-k ("select") as a CuTe DSL kernel: the exact top ``k``
columns of each logits row below its end, by value, in ascending column
order. It stands in for ``get_indexer_topk(backend)(logits, lengths,
next_n, out, k, max_seq_len)`` of GLM-5-Next's decode (vLLM's
``cooperative_topk`` / ``persistent_topk``), with the same set and a stated
order where stock's is its atomics' (docs/select-contract.md):

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
further cluster barrier.
"""

import functools
from dataclasses import dataclass
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.cute.runtime import make_fake_tensor

from vllm.models.glm5next.nvidia.specialized_decode.jit import (
    KpoolJitKernel,
    TensorFields,
    layout,
    mismatch,
)
from vllm.models.glm5next.nvidia.specialized_decode.ptx import (
    inline_ptx,
    load_words_if,
)

THREADS = 1024
WARPS = THREADS // 32
# The radix digits, most significant first: 8 bits, since the cluster-wide
# histogram sum of a wider digit costs more than the pass it saves.
DIGITS = {torch.float32: (8, 8, 8, 8), torch.bfloat16: (8, 8)}
BINS = 256
# The k a compile key takes (stock's decode top-k serves 512, 1024, 2048).
MAX_K = 4096
# Keys a CTA holds in shared memory: the smallest entry that holds its
# slice (the compile key's ``capacity``, each a multiple of the 4096-column
# tile); 53248 keys (208 KiB) plus the histograms stay under 227 KiB.
CAPACITIES = (4096, 8192, 16384, 32768, 53248)
CLUSTERS = (1, 2, 4, 8, 16)
# Rows 16-CTA clusters take: about 7 of them fit the H200's GPCs at once.
MAX_ROWS_16 = 4
# A slice is not split below this many keys: smaller ones cost more in
# cluster barriers than they save in passes.
MIN_SLICE = 8192
# 16 bytes a thread loads at once: 4 FP32 or 8 BF16 columns.
_DTYPES = {torch.float32: Float32, torch.bfloat16: BFloat16}
_VECTOR = {torch.float32: 4, torch.bfloat16: 8}
_KEY_BITS = {torch.float32: 32, torch.bfloat16: 16}
# Keys a thread takes from shared memory at once (one 16-byte load).
_GROUP = 4
_TILE = THREADS * _GROUP
# 16-byte row loads in flight per thread while loading the slice.
_UNROLL = 4


class SelectArgs(NamedTuple):
    """The top ``k`` columns of each row of ``logits`` below ``ends[row]``
    into ``out`` (None: a new int32 [rows, k] tensor)."""

    logits: torch.Tensor
    ends: torch.Tensor
    k: int
    out: torch.Tensor | None = None


_TENSORS = TensorFields(SelectArgs, ("logits", "ends"), optional=("out",))


@functools.cache
def slice_capacity(width: int, dtype: torch.dtype, cluster: int) -> int:
    """The shared keys a CTA of a ``cluster``-CTA row holds for rows of
    ``width`` columns, or 0 where no capacity holds its slice."""
    vector = _VECTOR[dtype]
    per_cta = -(-width // cluster)
    span = -(-per_cta // vector) * vector
    return next((c for c in CAPACITIES if span <= c), 0)


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# Cached (as one_wave): the eager host path asks them once a layer a step.
@functools.cache
def cluster_for(rows: int, width: int, dtype: torch.dtype, sms: int) -> int | None:
    """The CTAs a row takes: the most that keep the rows' CTAs within half
    of ``sms`` and the slices at least ``MIN_SLICE`` keys, else the fewest
    whose slices fit in shared memory; None where none do. (The H200 sweep
    in docs/select-contract.md chose these bounds: at 32 rows of 65536
    pools 2 CTAs a row beat 4.)"""
    fits = [c for c in CLUSTERS if slice_capacity(width, dtype, c)]
    if not fits:
        return None
    wide = [
        c
        for c in fits
        if 2 * rows * c <= sms
        and -(-width // c) >= MIN_SLICE
        and (c < 16 or rows <= MAX_ROWS_16)
    ]
    return max(wide) if wide else fits[0]


# An SM's shared memory and threads (Hopper and the SM100 family), and the
# shared memory the system keeps per CTA.
SM_SHARED_BYTES = 228 * 1024
SM_THREADS = 2048
CTA_RESERVED_BYTES = 1024


@functools.cache
def one_wave(rows: int, width: int, dtype: torch.dtype, sms: int) -> bool:
    """Whether the clusters of ``rows`` rows of ``width`` columns are all
    resident at once on ``sms`` SMs. The stage runs the select only then:
    a second wave costs the select more than stock's top-k, whose CTAs a row
    follow the row's end (docs/select-contract.md has the figures)."""
    cluster = cluster_for(rows, width, dtype, sms)
    if cluster is None:
        return False
    capacity = slice_capacity(width, dtype, cluster)
    shared = 4 * (capacity + 2 * BINS + 2 * WARPS + 4) + CTA_RESERVED_BYTES
    per_sm = min(SM_THREADS // THREADS, SM_SHARED_BYTES // shared)
    return rows * cluster <= sms * per_sm


def sm_count(device: torch.device) -> int:
    """The SMs of ``device`` (without an index: the current one), read once;
    0 for a device that is not CUDA."""
    if device.type != "cuda":
        return 0
    index = device.index
    return _sm_count(torch.cuda.current_device() if index is None else index)


def _check_layouts(a: SelectArgs) -> None:
    logits, ends, k, out = a
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
        raise mismatch("k", f"an int in [1, {MAX_K}]", k)
    stride = logits.stride()
    vector = _VECTOR.get(logits.dtype)
    if (
        vector is None
        or len(stride) != 2
        or stride[1] != 1
        or stride[0] % vector
        or logits.data_ptr() % 16
    ):
        raise mismatch(
            "logits",
            "fp32/bf16 [rows, width], unit column stride, 16-byte aligned rows",
            layout(logits),
        )
    if not slice_capacity(logits.shape[1], logits.dtype, CLUSTERS[-1]):
        raise mismatch(
            "logits",
            f"at most {CLUSTERS[-1] * CAPACITIES[-1]} columns "
            f"({CLUSTERS[-1]} CTAs of {CAPACITIES[-1]} shared keys)",
            logits.shape[1],
        )
    rows = logits.shape[0]
    if ends.dtype is not torch.int32 or ends.stride() != (1,) or ends.shape[0] < rows:
        raise mismatch("ends", "int32 [>= rows of logits], unit stride", layout(ends))
    if out is not None and (
        out.dtype is not torch.int32
        or tuple(out.shape) != (rows, k)
        or out.stride(1) != 1
    ):
        raise mismatch(
            "out", f"int32 [rows of logits, k = {k}], unit column stride", layout(out)
        )


# --- Device helpers ----------------------------------------------------------


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
def _inclusive_scan(value: Int32) -> Int32:
    """The sum of ``value`` over lanes ``0 .. lane`` of the warp."""
    lane = cute.arch.lane_idx()
    for o in cutlass.range_constexpr(5):
        below = cute.arch.shuffle_sync_up(value, offset=1 << o, mask_and_clamp=0)
        if lane >= (1 << o):
            value = value + below
    return value


@cute.jit
def _block_scan(value: Int32, totals, slot):
    """(exclusive prefix of ``value`` over the CTA's threads, CTA total),
    through ``totals[slot : slot + WARPS]``; one CTA barrier."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    inclusive = _inclusive_scan(value)
    if lane == 31:
        totals[slot + warp] = inclusive
    cute.arch.barrier()
    warp_total = Int32(0)
    if lane < WARPS:
        warp_total = totals[slot + lane]
    warps_inclusive = _inclusive_scan(warp_total)
    before_warp = cute.arch.shuffle_sync(warps_inclusive - warp_total, offset=warp)
    total = cute.arch.shuffle_sync(warps_inclusive, offset=31)
    return before_warp + inclusive - value, total


# --- The kernel ---------------------------------------------------------------


class _SelectKernel:
    """Cluster ``row`` selects row ``row``; its CTA ``rank`` owns the slice
    from ``rank * S``."""

    def __init__(self, key: "SelectTopkKernel.CompileKey"):
        assert all(c % _TILE == 0 for c in CAPACITIES)
        self.k, self.cluster, self.capacity = key.k, key.cluster, key.capacity
        self.bf16 = key.dtype == torch.bfloat16
        self.vector = _VECTOR[key.dtype]
        self.key_bits = _KEY_BITS[key.dtype]
        self.digits = DIGITS[key.dtype]

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
        # to the threshold in the ranks before this one (last pass), and the
        # count above it in those ranks.
        hist = smem.allocate_tensor(Int32, cute.make_layout(2 * BINS), 16)
        totals = smem.allocate_tensor(Int32, cute.make_layout(2 * WARPS))
        found = smem.allocate_tensor(Int32, cute.make_layout(4))
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
            vector = self.vector
            span = (end + self.cluster - 1) // self.cluster
            span = (span + vector - 1) // vector * vector
            start = rank * span
            n = cutlass.min(cutlass.max(end - start, Int32(0)), span)
            base = logits.iterator + Int64(row) * logits.stride[0] + start
            if tid < BINS:
                hist[tid] = Int32(0)
            if tid == 0:
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
        """The row's ``k``-th largest key (``threshold``), how many columns
        equal to it the top ``k`` takes (``need``), and this thread's share
        of the count above it in the ranks before ``rank``."""
        prefix = Uint32(0)
        remaining = Int32(self.k)
        above_share = Int32(0)
        passes = len(self.digits)
        for p in cutlass.range_constexpr(passes):
            bits = self.digits[p]
            shift = self.key_bits - sum(self.digits[: p + 1])
            current = (p % 2) * BINS
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
                                digit = Int32((key >> Uint32(shift)) & Uint32(BINS - 1))
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
            digit, above, share = self.merge_find(
                p, hist_at, current, remaining, tid, rank, totals, found
            )
            prefix = prefix | (Uint32(digit) << Uint32(shift))
            remaining = remaining - above
            above_share = above_share + share
        return prefix, remaining, above_share

    @cute.jit
    def merge_find(self, p, hist_at, current, remaining, tid, rank, totals, found):
        """Sums the ``C`` histograms of pass ``p`` (thread ``t`` takes bin
        ``BINS - 1 - t``: a descending scan) and finds the digit whose bin
        holds the ``remaining``-th largest matching key and the count above
        it. Returns them with this thread's share of the count above the
        digit in the ranks before ``rank``; the last pass stores the count in
        the digit's bin in those ranks (``found[2]``)."""
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
            # Done reading the peers: the exit barrier's arrive.
            cute.arch.cluster_arrive()
        above, _ = _block_scan(merged, totals, 0)
        if above < remaining and remaining <= above + merged:
            found[0] = (BINS - 1) - tid
            found[1] = above
            if cutlass.const_expr(last):
                found[2] = before
        cute.arch.barrier()
        digit = found[0]
        share = Int32(0)
        if (BINS - 1) - tid > digit:
            share = before
        return digit, found[1], share

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


class SelectTopkKernel(KpoolJitKernel["SelectTopkKernel.CompileKey", SelectArgs]):
    """The compiled ``_SelectKernel`` executors, one per ``k``, logits dtype,
    cluster size (``cluster_for`` the rows and width) and shared key
    capacity (``slice_capacity``)."""

    @dataclass(frozen=True)
    class CompileKey:
        k: int
        dtype: torch.dtype
        cluster: int
        capacity: int

    def key_for(self, args: SelectArgs) -> CompileKey:
        _TENSORS.check(args)
        _check_layouts(args)
        logits = args.logits
        rows, width = logits.shape
        dtype = logits.dtype
        # The SMs the warmup derived its keys from (the stage asks the same).
        # CPU tensors (0 SMs: the fewest CTAs that fit) reach here only in
        # the CPU rule tests.
        cluster = cluster_for(rows, width, dtype, sm_count(logits.device))
        return self.key(args.k, dtype, cluster, slice_capacity(width, dtype, cluster))

    def complete(self, args: SelectArgs) -> SelectArgs:
        if args.out is not None:
            return args
        logits = args.logits
        out = logits.new_empty((logits.shape[0], args.k), dtype=torch.int32)
        return args._replace(out=out)

    def executor_args(self, args: SelectArgs) -> tuple | None:
        if not args.logits.shape[0]:
            return None
        return args.logits, args.ends, args.out

    @staticmethod
    def kernel(compile_key: CompileKey) -> _SelectKernel:
        return _SelectKernel(compile_key)

    def warmup_inputs(self, compile_key: CompileKey) -> tuple:
        vector = _VECTOR[compile_key.dtype]
        rows = cute.sym_int()
        logits = make_fake_tensor(
            _DTYPES[compile_key.dtype],
            (rows, cute.sym_int()),
            (cute.sym_int64(divisibility=vector), 1),
            assumed_align=16,
        )
        ends = make_fake_tensor(Int32, (cute.sym_int(),), (1,), assumed_align=4)
        out = make_fake_tensor(
            Int32, (rows, compile_key.k), (cute.sym_int64(), 1), assumed_align=4
        )
        return logits, ends, out


SELECT = SelectTopkKernel()


def select_topk(
    logits: torch.Tensor,
    ends: torch.Tensor,
    k: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The exact top ``k`` columns of each row of ``logits`` below
    ``ends[row]`` (the module docstring states the contract), into ``out``
    if given, else a new int32 [rows, k] tensor, which it returns."""
    return SELECT.run(SelectArgs(logits, ends, k, out)).out
