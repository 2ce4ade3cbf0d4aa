# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The decode scores' time, graph-replayed: ``SCORES`` (cutedsl/scores)
beside DeepGEMM's ``fp8_fp4_paged_mqa_logits`` (where ``import deep_gemm``
works) at given sizes, and a copy of as many bytes as the cache rows read.
``scores_us(...)`` returns one dict a size; run as a script it prints them
(``--help``)."""

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DIM, BYTES_PER_POOL = 128, 132


def _load():
    """The kernel-only shim (``KPOOL_KERNEL_ONLY=1``) or the patched overlay
    of the installed vLLM, first on ``sys.path``; then ``SCORES``."""
    sys.path.insert(0, str(ROOT))
    if os.environ.get("KPOOL_KERNEL_ONLY") == "1":
        from tools.kernel_env.shim import install_from_env

        install_from_env()
    elif "vllm" not in sys.modules:
        from tools import overlay

        stock = overlay.find_installed_vllm()
        sys.path.insert(0, str(overlay.build_overlay(stock, log=lambda m: None)))
    from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.scores.launch import (
        SCORES,
    )

    return SCORES


@functools.cache
def _deep_gemm():
    try:
        import deep_gemm
    except Exception:  # noqa: BLE001 - any failure means "not here"
        return None
    return deep_gemm


def _inputs(entries, pools, heads, next_n, block, width, gen):
    """A step of ``entries`` entries of ``pools`` pools each, pages in a
    random order over a cache with no other pages."""
    dev = "cuda"
    pages = -(-pools // block)
    blocks = entries * pages
    cache = torch.randint(
        0,
        120,
        (blocks, block * (DIM + 4)),
        dtype=torch.uint8,
        device=dev,
        generator=gen,
    )
    scales = torch.rand(blocks, block, device=dev, generator=gen) * 1e-2
    cache[:, block * DIM :] = scales.view(torch.uint8).view(blocks, -1)
    order = torch.randperm(blocks, device=dev, generator=gen).to(torch.int32)
    q = torch.randint(0, 120, (entries, next_n, heads, DIM), dtype=torch.uint8,
                      device=dev, generator=gen).view(torch.float8_e4m3fn)  # fmt: skip
    return dict(
        q=(q, None),
        kv_cache=cache.view(blocks, block, 1, DIM + 4),
        weights=torch.randn(entries * next_n, heads, device=dev, generator=gen),
        seq_lens=torch.full((entries, next_n), pools, dtype=torch.int32, device=dev),
        block_table=order.view(entries, pages),
        max_model_len=width,
    )


def _graph_us(fn, rep_ms: float) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep_ms) * 1e3


def scores_us(
    entries: int,
    pools: int,
    heads: int = 32,
    next_n: int = 1,
    block: int = 64,
    max_model_len: int | None = None,
    rep_ms: float = 100.0,
) -> dict:
    """µs per call, graph-replayed, at ``entries`` entries of ``pools``
    pools (4 tokens each) each: ``ours``, ``deep_gemm`` (None where
    it does not import or refuses the shape), ``copy`` (a device copy of the
    cache rows' bytes: one read and one write of them)."""
    scores = _load()
    width = max_model_len or pools
    gen = torch.Generator("cuda").manual_seed(entries * 1000003 + pools)
    args = _inputs(entries, pools, heads, next_n, block, width, gen)
    row = {"entries": entries, "pools": pools, "heads": heads,
           "next_n": next_n, "block": block, "width": width}  # fmt: skip
    scores(**args)  # compiles, untimed
    row["ours"] = _graph_us(lambda: scores(**args), rep_ms)
    deep_gemm = _deep_gemm()
    row["deep_gemm"] = None
    if deep_gemm is not None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        meta = deep_gemm.get_paged_mqa_logits_metadata(
            args["seq_lens"], block, sms // 2 if next_n == 4 else sms
        )
        call = functools.partial(
            deep_gemm.fp8_fp4_paged_mqa_logits,
            args["q"], args["kv_cache"], args["weights"], args["seq_lens"],
            args["block_table"], meta, width,
        )  # fmt: skip
        try:
            call()
            row["deep_gemm"] = _graph_us(call, rep_ms)
        except RuntimeError as error:
            row["deep_gemm_refused"] = str(error).splitlines()[0][:120]
    nbytes = entries * pools * BYTES_PER_POOL
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    row["read_bytes"] = nbytes
    row["copy"] = _graph_us(lambda: dst.copy_(src), rep_ms)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--pools", type=int, nargs="+",
                        default=[4096, 65536, 262144])  # fmt: skip
    parser.add_argument("--heads", type=int, nargs="+", default=[32])
    parser.add_argument("--next-n", type=int, nargs="+", default=[1])
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    a = parser.parse_args()
    for heads in a.heads:
        for next_n in a.next_n:
            for entries in a.entries:
                for pools in a.pools:
                    row = scores_us(entries, pools, heads, next_n, a.block,
                                    rep_ms=a.rep_ms)  # fmt: skip
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
