# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The post-logits chain of one DSA layer's decode, stock against the
opt-in select (``kpool_select``), in one run, as ratios.

- stock: on the SM100 path (BF16 logits) the upcast (``as_fp32_logits``);
  vLLM 0.33.0's own top-k as ``auto`` picks it (``cooperative_topk`` up to 64
  rows, else ``persistent_topk``); the -1 fill, int64 cast and expansion
  (``expand_pools_and_append_tail``) into the logical rows; the conversion
  (``triton_convert_req_index_to_global_index``) with counts.
- ours: ``select_topk`` of the logits as DeepGEMM returns them, then the
  fused expand + remap with counts.
- ``select``: the top-k alone, stock's against ours, full row ends.

Stock's top-k is the pinned wheel's ``_C_stable_libtorch.abi3.so``
(``--stock-topk-so``; docs/select-contract.md says how to stage it): the run
stops if it is missing. Graph-replayed (``do_bench_cudagraph``, per call)
and eager with the host counted (``Timer.timeit``), as tools/bench_kpool.py
times them, with a 1 GiB copy's bandwidth of the same run.

    KPOOL_KERNEL_ONLY=1 python tools/bench_select.py --stock-topk-so /tmp/c.so
"""

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools import bench_kpool as B  # noqa: E402
from tools.indexer.refs import WheelTopk  # noqa: E402

K = 512  # select_k: index_topk 2048 / index_kpool 4
BLOCK = 64
WIDTHS = (65536, 262144)
# Row ends in pools: contexts of 4K and 128K tokens, and the full width.
CONTEXTS = {"4K": 1024, "128K": 32768, "full": None}
ROWS = {1: (1, 8, 64, 256), 4: (4, 32, 256)}  # next_n: rows (requests x next_n)
PATHS = {"sm90 fp32": torch.float32, "sm100 bf16": torch.bfloat16}


def chain_inputs(rows: int, width: int, end: int, next_n: int, dtype, gen):
    """Logits (random normals), each row's end in pools (a request's next_n
    rows end one pool apart, as the indexer's 2-D seq_lens) and the
    conversion's tensors."""
    device = B.DEVICE
    requests = rows // next_n
    last = torch.full((requests, 1), end, dtype=torch.int32)
    ends = (last - next_n + 1 + torch.arange(next_n, dtype=torch.int32)).clamp(0)
    ends = ends.reshape(-1)
    positions = ends.to(torch.int64) * 4 + 2  # three tokens in the tail pool
    blocks = -(-(width * 4) // BLOCK)
    table = torch.randint(0, 1 << 20, (rows, blocks), generator=gen)
    tensors = dict(
        ends=ends,
        positions=positions,
        req_ids=torch.arange(rows, dtype=torch.int32),
        block_table=table.to(torch.int32),
        pool_topk=torch.empty(rows, K, dtype=torch.int32),
        logical=torch.full((rows, B.WIDTH), -1, dtype=torch.int32),
        physical=torch.empty(rows, B.WIDTH, dtype=torch.int32),
        counts=torch.empty(rows, dtype=torch.int32),
    )
    tensors = {name: t.to(device) for name, t in tensors.items()}
    tensors["logits"] = torch.randn(rows, width, device=device).to(dtype)
    tensors["topk"] = WheelTopk(device)()
    return tensors


def stock_topk(t, width: int):
    logits = t["logits"]
    if logits.dtype != torch.float32:
        logits = B.K.as_fp32_logits(logits, t["ends"])
    t["topk"](logits, t["ends"], 1, t["pool_topk"], K, width * 4)


def stock_chain(t, width: int):
    rows = t["ends"].numel()
    stock_topk(t, width)
    t["logical"][:rows] = -1
    seq = t["positions"].to(torch.int32) + 1
    expanded = B.K.stock_expand(t["pool_topk"].to(torch.int64), seq, 4)
    t["logical"][:rows, : expanded.shape[-1]] = expanded
    B.K.convert(
        t["req_ids"], t["block_table"], t["logical"], BLOCK_SIZE=BLOCK,
        NUM_TOPK_TOKENS=B.WIDTH, return_valid_counts=True, out=t["physical"],
        valid_counts_out=t["counts"],
    )  # fmt: skip


def ours_select(t):
    B.K.select_topk(t["logits"], t["ends"], K, out=t["pool_topk"])


def ours_chain(t):
    ours_select(t)
    B.K.expand_and_remap(
        t["pool_topk"], t["positions"], 4, t["req_ids"], t["block_table"],
        t["physical"], t["counts"], block_size=BLOCK, stride_rows=BLOCK,
    )  # fmt: skip


def same_sets(t, width: int) -> bool:
    """Whether both top-k hold the same values (the same set where no tie
    straddles the k-th value; stock's tie choice is its atomics')."""
    logits = t["logits"].float()

    def values():
        return torch.sort(torch.gather(logits, 1, t["pool_topk"].long()), 1).values

    stock_topk(t, width)
    stock = values()
    ours_select(t)
    return bool(torch.equal(stock, values()))


def cases(quick: bool):
    for path, dtype in PATHS.items():
        for width in WIDTHS[:1] if quick else WIDTHS:
            for context, end in CONTEXTS.items():
                for next_n, rows_list in ROWS.items():
                    for rows in rows_list[:2] if quick else rows_list:
                        yield path, dtype, width, context, end or width, next_n, rows


def run(args) -> list[dict]:
    B.load_kernels()
    from vllm.models.glm5next.nvidia.specialized_decode.kpool import select_topk

    B.K.select_topk = select_topk
    torch.ops.load_library(args.stock_topk_so)
    timing = B.Timing(args.graph_ms, args.eager_calls, args.eager_repeats)
    gen = torch.Generator().manual_seed(25)
    results = []
    for path, dtype, width, context, end, next_n, rows in cases(args.quick):
        t = chain_inputs(rows, width, end, next_n, dtype, gen)
        row = dict(path=path, width=width, context=context, next_n=next_n, rows=rows)
        row.update(measure(t, width, timing, select=context == "full"))
        results.append(row)
        print(line(row), flush=True)
        del t
        B.release()
    return results


def measure(t, width: int, timing, select: bool) -> dict:
    """The chain's graph and eager figures, stock's then ours; with
    ``select``, the top-k alone's graph figures too."""
    stock = lambda: stock_chain(t, width)  # noqa: E731
    ours = lambda: ours_chain(t)  # noqa: E731
    figures = dict(same_sets=same_sets(t, width))
    figures["chain_graph_us"] = [timing.graph([f])[0] for f in (stock, ours)]
    figures["chain_eager_us"] = [f[0] for f in timing.eager(stock, ours)]
    if select:
        pair = (lambda: stock_topk(t, width), lambda: ours_select(t))
        figures["select_graph_us"] = [timing.graph([f])[0] for f in pair]
    return figures


def line(r: dict) -> str:
    def pair(name):
        if name not in r:
            return f"{'':>23}"
        s, o = r[name]
        return f"{s:8.2f} {o:8.2f} {s / o:5.2f}x"

    size = f"{r['rows']:>3} rows n{r['next_n']} {r['width'] // 1024}K {r['context']:>4}"
    return (
        f"{r['path']:<10} {size} | {pair('chain_graph_us')} | "
        f"{pair('chain_eager_us')} | {pair('select_graph_us')} | "
        f"{'same' if r['same_sets'] else 'SETS DIFFER'}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stock-topk-so", required=True, help="the wheel's _C_stable .so")
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--graph-ms", type=float, default=20.0)
    p.add_argument("--eager-calls", type=int, default=200)
    p.add_argument("--eager-repeats", type=int, default=5)
    args = p.parse_args(argv)
    if not Path(args.stock_topk_so).is_file():
        print(f"--stock-topk-so: no file {args.stock_topk_so}", file=sys.stderr)
        return 2
    copy = B.copy_figures(B.Timing(args.graph_ms, 1, 1), 1 << 30)
    print(f"1 GiB copy: {copy}")
    print(
        "path       size                   | chain graph us: stock ours ratio | "
        "chain eager us (host counted) | select graph us"
    )
    results = run(args)
    if args.json:
        args.json.write_text(json.dumps(dict(copy=copy, rows=results), indent=1))
    return 0 if all(r["same_sets"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
