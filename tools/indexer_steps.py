# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The patched GLM-5-Next indexer driven as serving runs it, stage against
stock, byte for byte after every step, and its per-layer timing: the command
line of the indexer simulator (``tests/models/glm5next/indexer_sim.py``).

    source .device/env.sh && KPOOL_KERNEL_ONLY=1 \\
        python3 tools/indexer_steps.py --json indexer_steps.json --time
    .venv/bin/python tools/indexer_steps.py --cpu-smoke  # the overlay, CPU

Default matrix: each backend path (``sm100``, ``flashmla_fp8``,
``flashinfer_sm90``) x each mode (``eager``, ``full``, ``piecewise``), then
each backend eagerly with the tail cache's stock split, then with two
engines' stages (``--stages 2``: those alone). ``--seed`` or ``KPOOL_SEED``
replays. One summary line per run; the JSON is rewritten after each run.
Exits 1 on any mismatch. ``--select``: the stages with the opt-in select.
``--scores``: with the opt-in scores, on the SM90 paths (default backends)
in the geometry they take (``SCORES_GEOMETRY``; ``--cpu-smoke``:
``CPU_SCORES_GEOMETRY``); on CUDA stock's scores are DeepGEMM's own.

``--time``: per DSA layer, the indexer call and the conversion that consumes
it (a deferral moves work from one to the other), stock against the stage,
on uniform decode batches past the top-k: eager (wall µs per step of 30
back-to-back steps, host included, median of 5) and replayed from one FULL
graph of 10 steps (median of 20). DeepGEMM's logits and the top-k are stored
tensors on both sides; with ``--select`` the top-k is the wheel's own
(``--stock-topk-so``), which the stage replaces by the select.
"""

import argparse
import contextlib
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("sm100", "flashmla_fp8", "flashinfer_sm90")
MODES = ("eager", "full", "piecewise")
BATCHES = ((1, 1), (8, 1), (32, 1), (8, 2), (32, 2), (8, 4), (32, 4))


def setup(cpu: bool) -> str:
    """Makes the patched vLLM (``overlay.import_patched``) and the simulator
    importable; says which vLLM."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests/models/glm5next")]
    from tools import overlay

    return overlay.import_patched("indexer_steps.py", cpu=cpu)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--backends", default=None, help=f"default {','.join(BACKENDS)}")
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
    add("--scores", action="store_true", help="the stages with the opt-in scores")
    add("--stock-topk-so", type=Path, help="the wheel's _C_stable .so (--select)")
    return parser.parse_args()


def matrix(args) -> list[tuple[str, str, str, int]]:
    """(backend, mode, tail split, stages) of each run."""
    backends = args.backends.split(",")
    if args.cpu_smoke or args.stages:
        return [(b, "eager", "indexer", args.stages or 1) for b in backends]
    if args.modes or args.tail_splits:
        modes = (args.modes or ",".join(MODES)).split(",")
        splits = (args.tail_splits or "indexer").split(",")
        return [(*run, 1) for run in itertools.product(backends, modes, splits)]
    return (
        [(b, m, "indexer", 1) for b in backends for m in MODES]
        + [(b, "eager", "stock", 1) for b in backends]
        + [(b, "eager", "indexer", 2) for b in backends]
    )


def time_layers(sim, backend: str, geo, select: bool, seed: int) -> list[dict]:
    """Per layer and batch: ``{mode, backend, layer, requests, next_n, rows,
    stock_us, stage_us, ratio}`` (ratio: stock / stage)."""
    import pytest
    import torch

    from tools.kernel_env.stock_topk import StockTopk
    from vllm.models.glm5next.nvidia import sparse_indexer

    rng, out, device = random.Random(seed), [], torch.device("cuda")
    with pytest.MonkeyPatch.context() as patch, contextlib.ExitStack() as stack:
        run = sim.Run(sim.Config(backend, geo=geo, select=select), device, patch)
        run.setup(stack, watch=False)
        wheel = StockTopk(device)  # get_indexer_topk("auto") of the wheel
        for requests, next_n in BATCHES:
            if requests * next_n > geo.capacity:
                continue
            ctx = [rng.randint(2500, 8000 - next_n) for _ in range(requests)]
            batch = run.sim.sched.fixed([next_n] * requests, ctx)
            fwd = run.sim.builder.build(batch, rows=batch.tokens)
            run.sim.fill(fwd.rows)
            ends = fwd.metadata[geo.prefixes[0][0]].decode.seq_lens.reshape(-1)
            dtype = torch.bfloat16 if run.sim.backend.mx else torch.float32
            logits = torch.randn(len(ends), geo.max_pool_len, device=device)
            ids = sim.stable_topk(logits, torch.zeros_like(ends), ends, geo.topk // 4)
            logits = logits.to(dtype)

            def stored(*args, logits=logits, **kwargs):
                return logits

            def copy(logits, seq_lens, next_n, out, k, max_seq_len, ids=ids):
                out.copy_(ids[: out.shape[0], : out.shape[1]])

            def auto(logits, seq_lens, next_n, out, k, max_seq_len):
                wheel(logits, seq_lens, out, k, max_seq_len)

            topk = (lambda b=None: auto) if select else lambda b=None: copy
            sim.references(patch, [sparse_indexer], device, stored, topk)
            for side in run.sides:
                side.run(fwd)  # the inputs in place; warm
                side.record = False
            for layer in range(geo.layers):
                eager = [[eager_us(s, layer, fwd) for s in run.sides] for _ in range(5)]
                medians = [statistics.median(t) for t in zip(*eager, strict=True)]
                graph = [graph_us(run, s, layer, fwd) for s in run.sides]
                for mode, (a, b) in (("eager", medians), ("graph", graph)):
                    out.append(
                        dict(
                            mode=mode,
                            backend=backend,
                            layer=layer,
                            requests=requests,
                            next_n=next_n,
                            rows=fwd.rows,
                            stock_us=a,
                            stage_us=b,
                            ratio=a / b,
                        )
                    )
            run.sim.sched.release(batch)
            torch.cuda.empty_cache()
    return out


def eager_us(side, layer: int, fwd, calls: int = 30) -> float:
    """µs per step of ``calls`` back-to-back steps, host counted, as
    ``tools/bench.py`` times eager calls (``torch.utils.benchmark.Timer``:
    synchronized at both ends, no garbage collection inside)."""
    from indexer_sim import context
    from torch.utils.benchmark import Timer

    from vllm.forward_context import override_forward_context

    def step():
        with override_forward_context(context(fwd)):
            side.layer_step(layer, fwd)

    with side.active():
        return Timer("step()", globals=dict(step=step)).timeit(calls).median * 1e6


def graph_us(run, side, layer: int, fwd, steps: int = 10, replays: int = 20) -> float:
    import torch
    from indexer_sim import context

    from vllm.config import CUDAGraphMode
    from vllm.forward_context import override_forward_context

    graph = torch.cuda.CUDAGraph()
    with (
        side.active(),
        override_forward_context(context(fwd, CUDAGraphMode.FULL)),
        torch.cuda.graph(graph, pool=run.pool, stream=run.stream),
    ):
        for _ in range(steps):
            side.layer_step(layer, fwd)
    times = []
    for _ in range(replays):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    return statistics.median(times)


def main() -> int:
    args = arguments()
    if args.scores and (args.time or args.time_only):
        sys.exit("--time stores both sides' scores; tools/bench.py times ours")
    where = setup(args.cpu_smoke)
    import dataclasses

    import indexer_sim as sim
    import pytest
    import torch
    import triton

    seed = sim.fuzz_seed() if args.seed is None else args.seed
    device = "cpu" if args.cpu_smoke else "cuda"
    if args.backends is None:  # the opt-in scores take FP32 scales only (SM90)
        fp32 = [b for b in BACKENDS if not sim.BACKENDS[b].mx]
        args.backends = ",".join(fp32 if args.scores else BACKENDS)
    if args.cpu_smoke:
        geo = sim.CPU_SCORES_GEOMETRY if args.scores else sim.CPU_GEOMETRY
    else:
        geo = sim.SCORES_GEOMETRY if args.scores else sim.Geometry()
        geo = dataclasses.replace(geo, layers=args.layers)
    work = dict(decode_steps=args.decode_steps)
    if args.cpu_smoke:
        work = {k: v for k, v in vars(sim.CPU_WORK).items() if k != "tail_split"}
    meta = dict(
        vllm=where,
        seed=seed,
        device=device,
        torch=torch.__version__,
        triton=triton.__version__,
        geometry=vars(geo) | {"width": geo.width},
        stand_ins=sim.STAND_INS,
    )
    if device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    print(f"indexer steps on {device} ({where}), seed {seed}", flush=True)
    runs, timing, failed, start = [], [], False, time.time()

    def dump() -> None:  # after every run: a timed-out command keeps the rest
        meta["wall_s"] = time.time() - start
        if args.json:
            result = dict(meta=meta, runs=runs, timing=timing)
            args.json.write_text(json.dumps(result, indent=1, default=str))

    for backend, mode, split, stages in [] if args.time_only else matrix(args):
        if args.budget_s and time.time() - start > args.budget_s:
            name = f"{backend}/{mode}/tail-{split}/{stages} stages"
            print(f"budget spent: {name} not run")
            meta.setdefault("not_run", []).append(name)
            continue
        cfg = sim.Config(
            backend,
            mode,
            geo=geo,
            seed=seed,
            stages=stages,
            select=args.select,
            scores=args.scores,
            work=sim.Workload(tail_split=split, **work),
            hold_cycles=args.hold_cycles,
            capture=not args.cpu_smoke,
        )
        with pytest.MonkeyPatch.context() as patch:
            report = sim.Run(cfg, device, patch).run()
        print(report.line(), *(f"\n    {d}" for d in report.details), flush=True)
        failed |= report.mismatches > 0
        runs.append(report.as_dict())
        dump()
    if args.time or args.time_only:
        if args.select and not (args.stock_topk_so and args.stock_topk_so.is_file()):
            sys.exit("--time with --select: --stock-topk-so names no file")
        if args.select:
            from tools.kernel_env import stock_topk

            stock_topk.load(str(args.stock_topk_so))
        meta["timing_unit"] = "indexer decode step + its top-k conversion"
        for backend in args.backends.split(","):
            timing += time_layers(sim, backend, geo, args.select, seed)
            dump()
        for row in timing:
            print(
                f"{row['backend']} layer {row['layer']} {row['mode']} "
                f"{row['requests']}x{row['next_n']}: stock {row['stock_us']:.1f} us, "
                f"stage {row['stage_us']:.1f} us ({row['ratio']:.2f}x)"
            )
    if where == "kernel-only shim":
        local = (str(sys.modules["vllm"].__kernel_env__[0]), str(ROOT))
        meta["foreign_vllm_modules"] = [
            name
            for name, module in sys.modules.items()
            if name.partition(".")[0] == "vllm"
            and getattr(module, "__file__", None)
            and not str(module.__file__).startswith(local)
        ]
    dump()
    verdict = "MISMATCHES" if failed else "0 mismatches"
    print(f"indexer steps: {len(runs)} runs, seed {seed}, {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
