# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The benchmark's plumbing on the CPU, in seconds: ``tools/bench_kpool.py``'s
``main`` on a tiny plan, every kernel replaced by a stand-in that binds its
arguments to the real function's signature (a wrong keyword or arity raises,
as the real call would), the CUDA-graph timer by a CPU one, and the eager
timer (``torch.utils.benchmark``) as it is. Checks the stamped JSON and
markdown, that a raising case fails the run, and the plot's title."""

import inspect
import json
import re
import time
import types

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("cutlass")
triton_testing = pytest.importorskip("triton.testing")

from tools import bench_kpool as bench  # noqa: E402
from tools import plot_bench  # noqa: E402

TINY = bench.Plan(
    rows=(1, 2), tokens=(1,), upcast_rows=(1,), widths=(16384,),
    eager_width=16384, eager_calls=5, eager_repeats=3, graph_ms=1.0,
)  # fmt: skip
META = dict(
    gpu="CPU stand-ins", driver=None, torch=torch.__version__, triton="-",
    cutedsl="-", python="-", launch_floor_us=0.5, copy={"copy_gbs": 100.0},
    copy_gbs=100.0,
)  # fmt: skip
ROW_KEYS = {"section", "kernel", "size", "rows", "stock_us", "ours_us", "ratio",
            "stock_spread", "ours_spread"}  # fmt: skip
ROOF_KEYS = {"bytes", "stock_gbs", "ours_gbs", "stock_roof", "ours_roof"}


def stand_in(real, result=None):
    signature = inspect.signature(real)

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return result(bound.arguments) if result else None

    return call


def expanded(a):  # stock_tail copies the stock expansion into its rows
    rows, groups = a["pool_ids"].shape
    cols = groups * a["pool_size"] + a["pool_size"] - 1
    return torch.full((rows, cols), -1, dtype=torch.int32)


def cpu_graph_bench(fn, rep, quantiles):
    """do_bench_cudagraph's contract on the CPU: ms per call of ``fn``."""
    start = time.perf_counter()
    for _ in range(4):
        fn()
    ms = (time.perf_counter() - start) * 1e3 / 4
    return [ms * (1 + q - 0.5) for q in quantiles]


@pytest.fixture
def cpu_bench(monkeypatch):
    """``bench`` with the real kernels loaded, then stood in for on the CPU."""
    bench.load_kernels()
    real = vars(bench.K)
    results = dict(stock_expand=expanded)
    kernels = {
        k: stand_in(f, results.get(k)) for k, f in real.items() if k != "compress"
    }
    kernels["compress"] = types.SimpleNamespace()  # stock_update sets a flag on it
    monkeypatch.setattr(bench, "K", types.SimpleNamespace(**kernels))
    monkeypatch.setattr(bench, "load_kernels", lambda: None)
    monkeypatch.setattr(bench, "machine_meta", lambda timing: dict(META))
    monkeypatch.setattr(bench, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(bench, "QUICK", TINY)
    monkeypatch.setattr(triton_testing, "do_bench_cudagraph", cpu_graph_bench)
    return bench


def run(tmp_path, *extra) -> tuple[int, dict, str]:
    out = tmp_path / "bench.json"
    argv = ["--quick", "--json", str(out), "--mem-gib", "0.001", *extra]
    status = bench.main(argv)
    return status, json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_tiny_plan_writes_stamped_json_and_markdown(cpu_bench, tmp_path):
    status, data, md = run(tmp_path, "--commit", "abc1234")
    assert status == 0
    meta, rows = data["meta"], data["results"]
    assert meta["commit"] == "abc1234"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", meta["date"])
    # graph: 4 update, 4 top-k, 6 decode tail, 3 upcast; eager: 4, 4, 2, 2.
    sections = [r["section"] for r in rows]
    assert (sections.count("graph"), sections.count("eager")) == (17, 12)
    assert all(r.keys() >= ROW_KEYS and "error" not in r for r in rows)
    for r in rows:
        assert r["ratio"] == pytest.approx(r["stock_us"] / r["ours_us"])
        moved = r["kernel"].startswith(("expand", "upcast"))  # bytes known
        moves_bytes = r["section"] == "graph" and moved
        assert (r.keys() >= ROOF_KEYS) == moves_bytes, r
    upcast = [r for r in rows if r["section"] == "graph" and "dist" in r]
    assert {r["dist"] for r in upcast} == set(bench.DISTS)
    assert all(r["sets"] > 1 for r in upcast)  # rotated through input sets
    assert md.startswith(f"commit abc1234, {meta['date']}\n")
    assert "| CUDA graph, µs per call |" in md and "| eager, µs per call |" in md
    assert "of copy: not measured" in md  # TINY has no 64-row upcast
    assert "FAILED" not in md
    assert plot_bench.title(meta).startswith(f"commit abc1234, {meta['date']}\n")


def test_a_raising_case_fails_the_run_and_no_target_is_met(
    cpu_bench, tmp_path, monkeypatch, capsys
):
    real = bench.K.expand_pools

    def expand_pools(pool_ids, *args, **kwargs):
        if pool_ids.shape[0] == 2:
            raise RuntimeError("expansion exploded")
        return real(pool_ids, *args, **kwargs)

    monkeypatch.setattr(bench.K, "expand_pools", expand_pools)
    status, data, md = run(tmp_path, "--only", "expand_pools")
    assert status == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: expansion exploded" in err
    failed = [r for r in data["results"] if "error" in r]
    assert [(r["section"], r["size"]) for r in failed] == [
        ("graph", "2x512"),
        ("eager", "2x512"),
    ]
    assert failed[0]["error"] == "RuntimeError: expansion exploded"
    targets = [line for line in md.splitlines() if line.startswith("- ")]
    graph, eager = targets[0], targets[2]
    for line in (graph, eager):
        assert "unknown, 1 failed: expand_pools 2x512" in line
        assert not line.endswith("met")
    assert "- FAILED: graph expand_pools (2x512): RuntimeError" in md


def test_graph_figure_rotates_inside_one_timed_callable(monkeypatch):
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]

    def do_bench_cudagraph(fn, rep, quantiles):
        for _ in range(7):  # what its capture would record, in order
            fn()
        return [0.001, 0.002, 0.004]

    monkeypatch.setattr(triton_testing, "do_bench_cudagraph", do_bench_cudagraph)
    median, spread = bench.graph_figure(fns, 5.0)
    assert calls == [0, 1, 2, 0, 1, 2, 0]
    assert (median, spread) == pytest.approx((2.0, 1.5))  # µs per call
