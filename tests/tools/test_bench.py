# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``tools/bench.py`` on the CPU: its command line without vLLM or a GPU,
the cases it covers, the indexer-like logits' shares, every case's inputs
taken by both sides (stock's kernels run under the Triton interpreter, ours
through each kernel's own rule and compile-key dispatch, ``spec``), the
JSON of a small run through the timing core, and the figures it prints and
writes from known timings (stock over ours, IQR over median)."""

import itertools
import json
import os
import subprocess
import sys
import time
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from tools import bench

CPU = torch.device("cpu")
# The CLI with vllm unimportable: ``import vllm`` raises.
NO_VLLM = (
    "import runpy, sys; sys.modules['vllm'] = None; sys.argv[0] = 'bench.py'; "
    "runpy.run_path('tools/bench.py', run_name='__main__')"
)
ROWS = {1, 8, 32, 64, 128, 256}
SELECT = {"path", "rows", "width", "context", "logits"}


def cli(*args):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("KPOOL_STOCK_TOPK_SO", None)
    return subprocess.run(
        [sys.executable, "-c", NO_VLLM, *args],
        cwd=bench.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_help_and_list_need_neither_vllm_nor_a_gpu():
    done = cli("--help")
    assert done.returncode == 0 and "usage: bench.py" in done.stdout, done.stderr
    done = cli("--list")
    assert done.returncode == 0, done.stderr
    names = [bench.name(c) for c in bench.cases(bench.Plan())]
    assert done.stdout.split("\n")[:-1] == names
    done = cli("--cases", "select")  # the select needs the wheel's top-k
    assert done.returncode == 2 and "--stock-topk-so" in done.stderr


def test_the_cases_cover_the_decode_sizes():
    cases = bench.cases(bench.Plan())
    names = [bench.name(c) for c in cases]
    assert len(set(names)) == len(names)

    def grid(kind, *keys):
        return {tuple(c[k] for k in keys) for c in cases if c.get("case") == kind}

    P = itertools.product
    update = set(P(("mx", "fp32"), (1, 4), ROWS))
    assert grid("update", "scales", "tokens", "rows") == update
    widths, ends = (16384, 65536, 262144), ("full", "random", "short")
    upcast = set(P((1, 8, 64, 256), widths, ends))
    assert grid("upcast", "rows", "width", "ends") == upcast
    assert grid("expand", "rows") == set(P(ROWS))
    assert grid("remap", "counts", "rows") == set(P((True, False), ROWS))
    paths = ("sm100-flashinfer", "sm90-flashinfer", "flashmla-fp8")
    assert grid("tail", "path", "rows") == set(P(paths, ROWS))
    select = [c for c in cases if "case" not in c]
    assert all(c.keys() == SELECT for c in select)
    randn = {
        (c["path"], c["rows"], c["width"], c["context"])
        for c in select
        if c["logits"] == "randn"
    }
    n1 = set(P((1, 8, 64, 256), ends))
    n4 = {(r, f"{e}, next_n 4") for r, e in P((4, 32, 256), ends)}
    assert randn == {(p, r, w, e) for p, w, (r, e) in P(paths[:2], widths, n1 | n4)}
    relu = {(c["path"], c["logits"]) for c in select if c["logits"] != "randn"}
    assert relu == set(P(paths[:2], ("relu 0%", "relu 0.1%", "relu 1%", "relu 50%")))
    quick = bench.cases(bench.QUICK)
    assert 0 < len(quick) < len(cases) / 3 and all(c in cases for c in quick)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_logits_have_the_positive_shares(dtype):
    gen = torch.Generator().manual_seed(0)
    for share in (0.0, 0.001, 0.01, 0.5):
        x = bench.indexer_logits(3, 8192, share, dtype, CPU, gen)
        assert x.dtype == dtype and x.shape == (3, 8192)
        assert (x > 0).sum(1).tolist() == [round(share * 8192)] * 3, share
        assert bool(((x > 0) | (x == 0)).all())  # the others exactly 0.0
    assert x[x > 0].unique().numel() > 500  # not a few values repeated


def stock_topk(logits, seq_lens, out, k, max_seq_len):
    """Stands in for the wheel's top-k (``stock_topk.StockTopk``), with the
    arguments the stock decode passes it: FP32 logits, int32 lengths
    [requests, next_n], the longest in tokens."""
    assert logits.dtype == torch.float32 and seq_lens.dtype == torch.int32
    assert seq_lens.dim() == 2 and seq_lens.numel() == logits.shape[0]
    assert max_seq_len >= 4 * int(seq_lens.max()) and out.dtype == torch.int32
    out.copy_(logits.topk(k, dim=1).indices)


@pytest.fixture
def spec_only(monkeypatch):
    """The kernels loaded, ours reduced to each one's ``spec`` (its rule
    and compile key, no launch: CuTe DSL kernels cannot run here); the
    (kernel, compile key) pairs they were called with."""
    pytest.importorskip("cutlass")
    bench.load_kernels(None)
    from vllm.models.glm5next.nvidia.specialized_decode import kpool
    from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select import launch

    seen = []
    for name in ("UPDATE", "EXPAND", "REMAP", "UPCAST", "SELECT"):
        kernel = getattr(kpool, name)
        module = sys.modules[type(kernel).__module__]
        monkeypatch.setattr(module, "check_devices", lambda *args, **kwargs: None)

        def spec(*args, kernel=kernel, name=name, **arguments):
            key, _, out = kernel.spec(*args, **arguments)
            seen.append((name, key))
            return out

        monkeypatch.setattr(kpool, name, spec)
    monkeypatch.setattr(launch, "sm_count", lambda index: 132)
    kernel = bench.K.scores
    scores = sys.modules[type(kernel).__module__]
    monkeypatch.setattr(scores, "check_devices", lambda *args, **kwargs: None)
    monkeypatch.setattr(scores, "sm_count", lambda index: 132)

    def scores_spec(**arguments):
        key, _, out = kernel.spec(**arguments)
        seen.append(("SCORES", key))
        return out

    monkeypatch.setattr(bench.K, "scores", scores_spec)

    flag = bench.K.compress.mqa_logits_use_mx_scales  # the stock update sets it
    monkeypatch.setattr(bench.K.compress, "mqa_logits_use_mx_scales", flag)
    monkeypatch.setattr(bench.K, "stock_topk", stock_topk, raising=False)
    monkeypatch.setattr(bench, "TAIL_WIDTH", 4096)
    monkeypatch.setattr(bench.K, "deep_gemm", deep_gemm_torch(), raising=False)
    return seen


def deep_gemm_torch():
    """DeepGEMM's paged scores as vLLM's torch reference computes them
    (``fp8_paged_mqa_logits_torch``), its schedule none."""
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import (
        fp8_paged_mqa_logits_torch,
    )

    def scores(
        q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len
    ):
        assert q[1] is None and schedule_meta is None
        return fp8_paged_mqa_logits_torch(
            q[0], kv_cache, weights, context_lens, block_table, max_context_len
        )

    return SimpleNamespace(
        get_paged_mqa_logits_metadata=lambda *args: None,
        fp8_fp4_paged_mqa_logits=scores,
    )


def test_both_sides_take_every_case_s_inputs(spec_only):
    plan = bench.Plan(
        rows=(2,),
        upcast_rows=(2,),
        widths=(4096,),
        select_rows=((1, 2), (4, 4)),
        ends=("full", "random", "short"),
        relu_widths=(4096,),
        step_rows=(2,),
        step_next_n=(1, 2),
        step_pools=(4096,),
    )
    kernels = dict(update="UPDATE", expand="EXPAND", remap="REMAP", upcast="UPCAST")
    for case in bench.cases(plan):
        spec_only.clear()
        pairs, extra = bench.build(case, CPU, torch.Generator().manual_seed(0))
        for _, stock, ours in pairs:
            for fn in (*stock, *ours):
                fn()
        keys = dict(spec_only)
        if case.get("case") == "tail":
            mx, upcast, counts = bench.PATHS[case["path"]]
            assert keys["UPDATE"].mx_scales == mx and ("UPCAST" in keys) == upcast
            assert keys["REMAP"].counts == counts
            assert bench.K.compress.mqa_logits_use_mx_scales() == mx  # stock's
        elif case.get("case") == "step":  # DeepGEMM's or our scores
            assert keys.keys() == {"SELECT", "REMAP", "SCORES"} and keys["REMAP"].counts
            assert keys["SELECT"].dtype == torch.float32
            scores_key = keys["SCORES"]
            # GLM-5-Next's 16 heads of the 32 vLLM pads them to, as the stage.
            assert (scores_key.heads, scores_key.next_n) == (16, case["next_n"])
            assert scores_key.block == bench.BLOCK
            for scores in extra["alone"]:
                assert scores().shape == (2 * case["next_n"], 4096)
        elif "case" in case:
            assert keys.keys() == {kernels[case["case"]]}, case
        else:
            assert keys.keys() == {"SELECT", "REMAP"} and keys["REMAP"].counts
            assert keys["SELECT"].dtype == bench.SELECT_PATHS[case["path"]]
        if case.get("case") == "upcast":
            assert extra["sets"] > 1 and extra["bytes"] > 0


def test_a_small_run_writes_each_row_s_figures(monkeypatch, tmp_path, capsys):
    """The run on the CPU: the eager timer as it is, the graph timer's
    contract (ms per call, quartiles) stood in for."""
    triton_testing = pytest.importorskip("triton.testing")

    def graph(fn, rep, quantiles):
        start = time.perf_counter()
        for _ in range(4):
            fn()
        ms = (time.perf_counter() - start) * 1e3 / 4
        return [ms * 0.9, ms, ms * 1.2]

    def build(case, dev, gen):
        if case["rows"] == 2:
            raise RuntimeError("exploded")
        add = partial(torch.add, torch.ones(64, 64), 1)
        if case.get("case") == "step":  # the scores alone beside the pairs
            return [("step_scores", [add], [add])], dict(alone=(add, add))
        if "case" in case:
            return [("", [add, add], [add])], dict(bytes=1e6)
        return [("select", [add], [add]), ("chain", [add], [add])], {}

    monkeypatch.setattr(triton_testing, "do_bench_cudagraph", graph)
    monkeypatch.setattr(bench, "build", build)
    select = dict(path="sm90-flashinfer", rows=1, width=4096, context="full")
    selected = [
        dict(select, logits="randn"),
        dict(case="upcast", ends="full", rows=1, width=4096),
        dict(case="expand", rows=2),
        dict(case="step", rows=1, next_n=1, context=4096, heads=32),
    ]
    plan = bench.Plan(rep_ms=1.0, eager_calls=3, eager_repeats=3)
    rows = bench.run(selected, plan, CPU, copy_gbs=100.0)
    bench.write_json(tmp_path / "bench.json", dict(gpu="cpu"), rows)
    data = json.loads((tmp_path / "bench.json").read_text())
    (select,), (upcast, failed) = data["select"], data["kernels"]
    (step,) = data["scores"]  # [DeepGEMM, ours] alone: no spread
    assert len(step["scores_graph_us"]) == 2 and "scores_graph_spread" not in step
    assert all(v > 0 for v in step["step_scores_graph_us"])
    us = {"select_graph_us", "chain_graph_us", "chain_eager_us"}
    assert select.keys() == SELECT | us | {k[:-2] + "spread" for k in us}
    timed = {"graph_us", "eager_us", "graph_spread", "eager_spread"}
    assert upcast.keys() == {"case", "ends", "rows", "width", "roof", "bytes"} | timed
    for key in (*us, "graph_us", "eager_us", "roof"):
        pair = (select | upcast)[key]
        assert len(pair) == 2 and all(v > 0 for v in pair), key
    assert upcast["roof"][1] == pytest.approx(1e6 / upcast["graph_us"][1] / 1e5)
    assert failed == dict(case="expand", rows=2, error="RuntimeError: exploded")
    err = capsys.readouterr()
    assert "Traceback" in err.err and "FAILED RuntimeError: exploded" in err.out
    assert "scores: DeepGEMM" in err.out


# Known timings a side: the graph timer's quantiles (ms, by the quantile
# asked for) and the eager timer's medians (µs, one a timing).
GRAPH_MS = {
    "stock": {0.25: 0.8, 0.5: 1.0, 0.75: 1.4},
    "ours": {0.25: 0.15, 0.5: 0.25, 0.75: 0.35},
}
EAGER_US = {"stock": [70, 10, 60, 20, 50, 30, 40], "ours": [3, 9, 4, 8, 5, 7, 6]}


def test_the_ratio_is_stock_over_ours_and_the_spread_iqr_over_median(
    monkeypatch, tmp_path, capsys
):
    """Known quantiles on both sides through the bench's own timers' wrappers,
    ``run`` and ``write_json``: the printed ratio is stock time over ours,
    each written spread (q3 - q1) / median of its own side, and the printed
    spread the larger of the two."""
    triton_testing = pytest.importorskip("triton.testing")
    from torch.utils import benchmark

    def graph(fn, rep, quantiles):
        side = fn()  # the case's fns name their side
        return [GRAPH_MS[side][q] for q in quantiles]

    class Timer:
        def __init__(self, stmt, globals):
            self.call, self.medians = eval(f"lambda: {stmt}", globals), None

        def timeit(self, number):
            side = self.call()
            if self.medians is None:
                self.medians = iter(EAGER_US[side])
            return SimpleNamespace(median=next(self.medians) * 1e-6)

    monkeypatch.setattr(triton_testing, "do_bench_cudagraph", graph)
    monkeypatch.setattr(benchmark, "Timer", Timer)
    sides = [lambda: "stock"], [lambda: "ours"]
    monkeypatch.setattr(bench, "build", lambda *_: ([("", *sides)], {}))
    plan = bench.Plan(eager_calls=1, eager_repeats=7)
    rows = bench.run([dict(case="expand", rows=1)], plan, CPU, copy_gbs=1.0)
    bench.write_json(tmp_path / "bench.json", {}, rows)
    (row,) = json.loads((tmp_path / "bench.json").read_text())["kernels"]
    # Graph: medians 1000 and 250 µs; IQRs 600 and 200 µs.
    assert row["graph_us"] == pytest.approx([1000.0, 250.0])
    assert row["graph_spread"] == pytest.approx([0.6, 0.8])  # not 0.75, 1.33
    # Eager, inclusive quartiles of the seven: (25, 40, 55) and (4.5, 6, 7.5).
    assert row["eager_us"] == pytest.approx([40.0, 6.0])
    assert row["eager_spread"] == pytest.approx([0.75, 0.5])  # not 1.2, 0.67
    line = capsys.readouterr().out.strip()
    assert line.endswith("graph x4.00 ±80% | eager x6.67 ±75%"), line
