# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The decode scores alone, graph-replayed: ``SCORES`` (cutedsl/scores)
beside DeepGEMM's ``fp8_fp4_paged_mqa_logits`` (where ``import deep_gemm``
works) and a copy of the cache rows' bytes, on the GPU machine
(docs/gpu-tier.md; ``KPOOL_KERNEL_ONLY=1``).

One CUDA graph holds ``sets`` calls, each on its own inputs, enough sets to
cycle 256 MB: "cold" takes them in turn, so each call reads its rows from
HBM as a decode step does (each layer's cache once a step); "warm" repeats
the first, which the L2 holds up to ~50 MB. GLM-5-Next's 16 index heads
come as serving hands them (``--index-heads``): DeepGEMM gets vLLM's zero
padding to ``--heads``, ours views of the real ones, as the stage passes
them; ``same`` says whether ours wrote DeepGEMM's bytes. Prints one JSON
line a size and the time of a 1 GiB copy (docs/scores-cold-h200.json)."""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
DIM, BYTES_PER_POOL, CYCLE = 128, 132, 256 * 2**20


def _load():
    """``SCORES`` from the patched vLLM (the kernel-only shim on the GPU
    machine), and DeepGEMM where it imports."""
    from tools.overlay import import_patched

    import_patched("scores_timing.py")
    from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.scores.launch import (
        SCORES,
    )

    try:
        import deep_gemm
    except Exception:  # noqa: BLE001 - any failure means "not here"
        deep_gemm = None
    return SCORES, deep_gemm


def _inputs(entries, pools, heads, next_n, block, gen, real):
    """``entries`` entries of ``pools`` pools, pages in a random order; the
    query's and weights' heads past ``real`` zero."""
    pages = -(-pools // block)
    blocks = entries * pages
    u8 = dict(dtype=torch.uint8, device="cuda", generator=gen)
    cache = torch.randint(0, 120, (blocks, block * (DIM + 4)), **u8)
    scales = torch.rand(blocks, block, device="cuda", generator=gen) * 1e-2
    cache[:, block * DIM :] = scales.view(torch.uint8).view(blocks, -1)
    order = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32)
    q = torch.randint(0, 120, (entries, next_n, heads, DIM), **u8)
    weights = torch.randn(entries * next_n, heads, device="cuda", generator=gen)
    q[:, :, real:], weights[:, real:] = 0, 0
    return dict(
        q=(q.view(torch.float8_e4m3fn), None),
        kv_cache=cache.view(blocks, block, 1, DIM + 4),
        weights=weights,
        seq_lens=torch.full((entries, next_n), pools, dtype=torch.int32, device="cuda"),
        block_table=order.view(entries, pages),
        max_model_len=pools,
    )


def _us(calls, rep_ms) -> float:
    """µs a call of ``calls``, replayed from one CUDA graph."""
    from triton.testing import do_bench_cudagraph

    def run():
        for call in calls:
            call()

    return do_bench_cudagraph(run, rep=rep_ms) * 1e3 / len(calls)


def _real(a: dict, real: int) -> dict:
    """``a`` as the stage hands it to ``SCORES``: the first ``real`` heads."""
    (q, scales), weights = a["q"], a["weights"]
    return a | dict(q=(q[:, :, :real], scales), weights=weights[:, :real])


def row(scores, deep_gemm, entries, pools, heads, next_n, block, rep_ms, real):
    nbytes = entries * pools * BYTES_PER_POOL
    sets = max(1, min(64, -(-CYCLE // nbytes)))
    gen = torch.Generator("cuda").manual_seed(entries * 1000003 + pools)
    inputs = [
        _inputs(entries, pools, heads, next_n, block, gen, real) for _ in range(sets)
    ]
    out = dict(
        entries=entries,
        pools=pools,
        heads=heads,
        index_heads=real,
        next_n=next_n,
        block=block,
        sets=sets,
        mb=nbytes / 2**20,
    )
    handed = [_real(a, real) for a in inputs]
    ours = [lambda a=a: scores(**a) for a in handed]
    first = ours[0]()  # compiles, untimed
    out["ours_warm"], out["ours_cold"] = _us(ours[:1] * sets, rep_ms), _us(ours, rep_ms)
    if deep_gemm is not None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        slots = sms // 2 if next_n == 4 else sms

        def theirs(a):
            meta = deep_gemm.get_paged_mqa_logits_metadata(a["seq_lens"], block, slots)
            return lambda: deep_gemm.fp8_fp4_paged_mqa_logits(
                a["q"],
                a["kv_cache"],
                a["weights"],
                a["seq_lens"],
                a["block_table"],
                meta,
                pools,
            )

        calls = [theirs(a) for a in inputs]
        try:
            bits = calls[0]().view(torch.int32)[:, :pools]
            out["same"] = torch.equal(bits, first.view(torch.int32)[:, :pools])
            out["dg_warm"] = _us(calls[:1] * sets, rep_ms)
            out["dg_cold"] = _us(calls, rep_ms)
        except RuntimeError as error:
            out["dg_refused"] = str(error).splitlines()[0][:120]
    sources = [
        torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(sets)
    ]
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out["copy_cold"] = _us([lambda s=s: dst.copy_(s) for s in sources], rep_ms)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, nargs="+", default=[1, 4, 8, 32, 64])
    parser.add_argument("--pools", type=int, nargs="+", default=[4096, 65536, 262144])
    parser.add_argument("--heads", type=int, nargs="+", default=[32])
    parser.add_argument(
        "--index-heads", type=int, default=16, help="the real heads of --heads (0: all)"
    )
    parser.add_argument("--next-n", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument(
        "--max-bytes",
        type=float,
        default=600e6,
        help="skip sizes of more cache-row bytes",
    )
    parser.add_argument("--rep-ms", type=float, default=50.0)
    a = parser.parse_args()
    scores, deep_gemm = _load()
    for heads in a.heads:
        for next_n in a.next_n:
            for entries in a.entries:
                for pools in a.pools:
                    if entries * pools * BYTES_PER_POOL > a.max_bytes:
                        continue
                    real = min(a.index_heads or heads, heads)
                    r = row(
                        scores,
                        deep_gemm,
                        entries,
                        pools,
                        heads,
                        next_n,
                        a.block,
                        a.rep_ms,
                        real,
                    )
                    print(json.dumps(r), flush=True)
                    torch.cuda.empty_cache()
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    print(json.dumps({"copy_1gib_us": _us([lambda: dst.copy_(src)], a.rep_ms)}))


if __name__ == "__main__":
    main()
