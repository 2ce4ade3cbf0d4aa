# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The patched GLM-5-Next indexer driven as serving runs it, stage against
stock, byte for byte after every step, at scale; and its per-layer timing:
the command line of ``tools.indexer`` (``steps.py``, ``timing.py``).

On the kernel-only GPU machine (after ``tools/kernel_env/prepare.sh`` here):

    source .device/env.sh && KPOOL_KERNEL_ONLY=1 \\
        python3 tools/indexer_steps.py --json $OUT/indexer_steps.json --time

Here, against the patched overlay on the CPU (a few interpreted steps):

    .venv/bin/python tools/indexer_steps.py --cpu-smoke

Default matrix: every backend path (``sm100``, ``flashmla_fp8``,
``flashinfer_sm90``) x every mode (``eager``, ``full``, ``piecewise``) with
the tail cache split as the indexer's (the stage runs in speculative steps),
plus each backend eagerly with the tail cache's stock split
(``KpoolTailMetadataBuilder``: threshold 1), plus each backend eagerly with
two engines' stages in one process (``--stages 2`` runs only those).
``--seed`` or ``KPOOL_SEED``
replays a run. Prints one summary line per run; the JSON (rewritten after
every run, so a command that runs out of time keeps what finished) holds the
reports, the timing rows (``--time``) and the stand-ins (how ties break).
Exits 1 on any mismatch. Expect roughly a minute a run on the H200 at 600
decode steps (an estimate, not measured yet): split the matrix over commands
(``--backends``) or set ``--budget-s``.

``--select`` runs the stages with the opt-in select (``kpool_select``):
stock's top-k is then its contract's reference (``refs.ContractTopk``) and
the physical and logical top-k rows compare as sets (the select's order is
ascending pools); caches and counts still byte for byte.
"""

import argparse
import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("sm100", "flashmla_fp8", "flashinfer_sm90")
MODES = ("eager", "full", "piecewise")


def _setup(cpu: bool) -> str:
    """Makes the patched vLLM importable: the kernel-only shim when
    ``KPOOL_KERNEL_ONLY=1``, else the test overlay of the installed vllm."""
    if cpu or shutil.which("nvidia-smi") is None:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    sys.path.insert(0, str(ROOT))
    if os.environ.get("KPOOL_KERNEL_ONLY") == "1":
        from tools.kernel_env.shim import install_from_env

        install_from_env()
        return "kernel-only shim"
    from tools import overlay

    stock = overlay.find_installed_vllm()
    if stock is None:
        sys.exit("indexer_steps.py: no vllm installed; set KPOOL_KERNEL_ONLY=1")
    sys.path.insert(0, str(overlay.build_overlay(stock)))
    return "patched overlay"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--backends", default=",".join(BACKENDS))
    add("--modes", default=None, help="default: the matrix in the docstring")
    add("--tail-splits", default=None, help="stock,indexer (with --modes)")
    add("--decode-steps", type=int, default=600)
    add("--layers", type=int, default=3)
    add("--seed", type=int, default=None)
    add("--json", type=Path, default=None)
    add("--time", action="store_true", help="also time each layer's step")
    add("--time-only", action="store_true")
    add("--cpu-smoke", action="store_true", help="a few interpreted CPU steps")
    add("--budget-s", type=float, default=0, help="start no run after this")
    add("--hold-cycles", type=int, default=200_000, help="stream hold-back (GPU)")
    add("--stages", type=int, default=None, help="2: the two-stage runs alone")
    add("--select", action="store_true", help="the stages with the opt-in select")
    add(
        "--stock-topk-so",
        type=Path,
        default=None,
        help="the wheel's _C_stable .so: --time with --select times against it",
    )
    return parser.parse_args()


def _matrix(args) -> list[tuple[str, str, str, int]]:
    """(backend, mode, tail split, stages) of each run."""
    backends = args.backends.split(",")
    if args.cpu_smoke:
        return [(b, "eager", "indexer", args.stages or 1) for b in backends]
    if args.stages:
        return [(b, "eager", "indexer", args.stages) for b in backends]
    if args.modes or args.tail_splits:
        modes = (args.modes or ",".join(MODES)).split(",")
        splits = (args.tail_splits or "indexer").split(",")
        return [(*run, 1) for run in itertools.product(backends, modes, splits)]
    return (
        [(b, m, "indexer", 1) for b in backends for m in MODES]
        + [(b, "eager", "stock", 1) for b in backends]
        + [(b, "eager", "indexer", 2) for b in backends]
    )


def main() -> int:
    args = _args()
    where = _setup(args.cpu_smoke)
    import torch
    import triton

    from tools.indexer.batches import Geometry, Workload
    from tools.indexer.refs import TIE_BREAK
    from tools.indexer.steps import CPU_GEOMETRY, CPU_WORK, Config, fuzz_seed, run

    seed = fuzz_seed() if args.seed is None else args.seed
    device = "cpu" if args.cpu_smoke else "cuda"
    geo = Geometry(layers=args.layers)
    work = dict(decode_steps=args.decode_steps)
    if args.cpu_smoke:
        geo = CPU_GEOMETRY
        work = {k: v for k, v in vars(CPU_WORK).items() if k != "tail_split"}
    meta = dict(
        vllm=where, seed=seed, device=device, torch=torch.__version__,
        triton=triton.__version__, geometry=vars(geo) | {"width": geo.width},
        tie_break=TIE_BREAK,
        stand_ins="DeepGEMM paged/ragged MQA logits, the decode and prefill "
        "top-k, cp_gather_indexer_k_quant_cache and the workspace manager: "
        "torch references (tools/indexer/refs.py), both sides",
    )  # fmt: skip
    if device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    print(f"indexer steps on {device} ({where}), seed {seed}; stand-ins: "
          f"{meta['stand_ins']}; top-k {TIE_BREAK}", flush=True)  # fmt: skip
    runs, timing, failed, start = [], [], False, time.time()

    def dump() -> None:  # after every run: a timed-out command keeps the rest
        meta["wall_s"] = time.time() - start
        if args.json:
            result = dict(meta=meta, runs=runs, timing=timing)
            args.json.write_text(json.dumps(result, indent=1, default=str))

    for backend, mode, split, stages in [] if args.time_only else _matrix(args):
        if args.budget_s and time.time() - start > args.budget_s:
            name = f"{backend}/{mode}/tail-{split}/{stages} stages"
            print(f"budget spent: {name} not run")
            meta.setdefault("not_run", []).append(name)
            continue
        cfg = Config(backend, mode, geo=geo, seed=seed,
                     work=Workload(tail_split=split, **work), stages=stages,
                     hold_cycles=args.hold_cycles, select=args.select)  # fmt: skip
        report = run(cfg, device)
        print(report.line(), flush=True)
        for detail in report.details:
            print("   ", detail)
        failed |= report.mismatches > 0
        runs.append(report.as_dict())
        dump()
    if args.time or args.time_only:
        from tools.indexer.timing import SELECT_STAND_INS, STAND_INS, UNIT, time_layers

        if args.select:
            if args.stock_topk_so is None or not args.stock_topk_so.is_file():
                sys.exit("--time with --select: --stock-topk-so names no file")
            torch.ops.load_library(str(args.stock_topk_so))
        stand_ins = SELECT_STAND_INS if args.select else STAND_INS
        meta |= dict(timing_unit=UNIT, timing_stand_ins=stand_ins)
        for backend in args.backends.split(","):
            cfg = Config(backend, geo=geo, select=args.select)
            rows = time_layers(backend, seed=seed, cfg=cfg)
            timing += rows
            dump()
            for row in rows:
                print(
                    f"{row['backend']} layer {row['layer']} {row['mode']} "
                    f"{row['requests']}x{row['next_n']}: stock {row['stock_us']:.1f} "
                    f"us, stage {row['stage_us']:.1f} us ({row['ratio']:.2f}x)"
                )
    meta["foreign_vllm_modules"] = [
        name
        for name, module in sys.modules.items()
        if name.partition(".")[0] == "vllm"
        and where == "kernel-only shim"
        and getattr(module, "__file__", None)
        and not str(module.__file__).startswith(
            (str(sys.modules["vllm"].__kernel_env__[0]), str(ROOT))
        )
    ]
    dump()
    print(f"indexer steps: {len(runs)} runs, seed {seed}, "
          f"{'MISMATCHES' if failed else '0 mismatches'}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
