# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``expand_pools_and_append_tail`` (patched: ``seq_offset``, ``out``) for
int32 pool ids: one 16-byte store per pool."""

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64, Uint32

from ...constants import POOL
from ..common.ptx import store_words, trunc_div

THREADS = 128


class ExpandPools:
    """Thread ``g`` of row ``r`` writes the four token ids of pool
    ``pool_ids[r, g]`` with one 16-byte store; CTA 0's first ``pool - 1``
    threads write the trailing incomplete pool (also with no pools)."""

    def __init__(self, key):
        self.groups = key.groups
        # seq_len + offset in the dtype of seq_lens, as stock computes it, or
        # in int32 of truncated lengths, as stock's decode casts positions.
        wide = key.seq_lens_dtype == torch.int64 and not key.int32_lengths
        self.width = Int64 if wide else Int32
        self.ctas = max(1, (self.groups + THREADS - 1) // THREADS)

    @cute.jit
    def __call__(
        self,
        pool_ids: cute.Tensor,
        seq_lens: cute.Tensor,
        out: cute.Tensor,
        seq_offset: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(pool_ids, seq_lens, out, seq_offset).launch(
            grid=(pool_ids.shape[0], self.ctas, 1),
            block=(THREADS, 1, 1),
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(self, pool_ids, seq_lens, out, seq_offset):
        row, cta, _ = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        g = cta * THREADS + tid
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        row_out = out.iterator + Int64(row) * out.stride[0]
        if g < self.groups:
            pid = Int32(pool_ids[row, g])
            # int32 arithmetic wraps as the stock kernel's store truncates.
            first = pid * POOL
            words = [Uint32(first + o) for o in range(POOL)]
            if pid < 0:
                words = [Uint32(0xFFFFFFFF)] * POOL
            store_words(row_out + g * POOL, words)
        if cta == 0 and tid < POOL - 1:
            width = self.width
            seq_len = width(seq_lens[row]) + width(seq_offset)
            tail_start = trunc_div(seq_len, POOL, width) * POOL
            value = Int32(-1)
            if width(tid) < seq_len - tail_start:
                value = Int32(tail_start + tid)  # stock's store truncates too
            out[row, self.groups * POOL + tid] = value
