# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The select's latency floor on this GPU: a kernel with the select's
launch (clusters, PDL, shared memory), its one read of each row into shared
memory with the first digit's count, one cluster barrier and the write of
``k`` columns, and nothing else, timed graph-replayed beside the select at
the same sizes. Prints one line a size: floor µs, select µs."""

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@functools.cache
def floor_kernel():
    """A ``SelectKernel`` whose device code is the floor (``FloorTopk``),
    from the kernel-only shim or the patched overlay, imported once (the
    first call may build the overlay)."""
    from tools.bench import load_kernels

    load_kernels(None)
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select import (
        kernel as select_kernel,
    )
    from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select.launch import (
        SelectKernel,
    )

    class FloorTopk(select_kernel.SelectTopk):
        """The select's load and first count, one cluster barrier, ``k``
        columns written by CTA 0: what any one-read design pays."""

        @cute.kernel
        def kernel(self, logits: cute.Tensor, ends: cute.Tensor, out: cute.Tensor):
            block, _, _ = cute.arch.block_idx()
            tid, _, _ = cute.arch.thread_idx()
            row = block // self.cluster
            rank = cute.arch.block_idx_in_cluster()
            hist, _, found, keys = self.allocate()
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
            end = cutlass.min(cutlass.max(Int32(ends[row]), Int32(0)), logits.shape[1])
            _, n, base = self.slice(logits, row, rank, end, self.cluster)
            if tid < select_kernel.BINS:
                hist[tid] = Int32(0)
            if tid < select_kernel.FOUND:
                found[tid] = Int32(0)
            cute.arch.barrier()
            self.load_slice(base, n, tid, Int32(keys.iterator.toint()), hist, found)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if rank == 0:
                for i in cutlass.range(tid, self.k, select_kernel.THREADS, unroll=1):
                    out[row, i] = hist[i % select_kernel.BINS] + i
            cute.arch.barrier()

    class FloorKernel(SelectKernel):
        kernel = FloorTopk

    return FloorKernel()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,64")
    p.add_argument("--widths", default="16384,65536,262144")
    p.add_argument("--k", type=int, default=512)
    args = p.parse_args()  # --help ends here, before any import or build
    import torch
    from triton.testing import do_bench_cudagraph

    floor = floor_kernel()
    from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select.launch import (
        SELECT,
        sm_count,
    )

    sms = sm_count(0)
    for dtype in (torch.float32, torch.bfloat16):
        for width in map(int, args.widths.split(",")):
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, width, device="cuda").to(dtype)
                e = torch.full((rows,), width, dtype=torch.int32, device="cuda")
                out = torch.empty(rows, args.k, dtype=torch.int32, device="cuda")
                key = SELECT.dispatch(
                    k=args.k, dtype=dtype, rows=rows, width=width, sms=sms
                )
                given = dict(logits=x, ends=e, k=args.k, out=out)
                fns = [functools.partial(f, **given) for f in (floor, SELECT)]
                for fn in fns:
                    fn()
                torch.cuda.synchronize()
                us = [do_bench_cudagraph(fn, rep=5) * 1e3 for fn in fns]
                print(
                    f"{str(dtype)[6:]:9} {rows:4} x {width:6} cluster {key.cluster:2}"
                    f" floor {us[0]:6.2f} us  select {us[1]:6.2f} us"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
