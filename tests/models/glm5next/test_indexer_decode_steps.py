# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The patched ``sparse_attn_indexer_kpool`` driven step after step as
serving runs it (``indexer_sim.Run``): the stage against stock, every byte
every layer leaves, after every step, for each backend path; and two
engines' stages in one process.

- CPU: a few interpreted steps (the stage's rules take CPU tensors, each
  launch computed by its stock twin): the SM100 path in FULL mode and the
  FlashInfer SM90 path in piecewise mode (no graphs on the CPU: each step
  eager in its mode's forward context, with the mode's padding), the opt-in
  select, two stages on the FlashMLA FP8 path; and the FlashMLA FP8 path
  through the kernel-only shim by the CLI (``tools/indexer_steps.py``).
- GPU (``tools/kernel_env/gpu_tier.sh -k indexer_steps``): 500 decode steps
  (``KPOOL_INDEXER_STEPS``) of each backend path in each mode, a fresh seed
  (``KPOOL_SEED`` replays), streams held back at every hand-off, every
  compiled kernel launched; the tail cache's stock split; two stages; the
  opt-in select.
"""

import importlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from indexer_sim import (
    BACKENDS,
    CPU_GEOMETRY,
    CPU_SCORES_GEOMETRY,
    CPU_WORK,
    MODES,
    REPORTS,
    SCORES_GEOMETRY,
    Config,
    Run,
    Workload,
    fuzz_seed,
)

REPO = Path(__file__).resolve().parents[3]
CPU_SEED = 5
HOLD = 200_000  # GPU cycles (~0.1 ms) a stream is held back at a hand-off


def cpu_config(backend: str, mode="eager", geo=CPU_GEOMETRY, **changes) -> Config:
    return Config(
        backend=backend,
        mode=mode,
        geo=geo,
        work=CPU_WORK,
        seed=CPU_SEED,
        capture=False,
        full_sizes=(2, 4),
        piecewise_sizes=(16, 64, 256),
        **changes,
    )


def check(report, decode_steps: int, topk: int = CPU_GEOMETRY.topk) -> None:
    """No mismatch; the steps ran, the stage planned and (where every layer
    fuses) deferred; the summary line kept for the session's end."""
    REPORTS.append(report.line())
    out = os.environ.get("OUT")
    if out:
        name = report.name.replace("/", "-").replace(" ", "_")
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"indexer_steps-{name}.json").write_text(
            json.dumps(report.as_dict(), indent=1)
        )
    assert report.mismatches == 0, (
        f"{report.line()} (replay with KPOOL_SEED={report.seed}):\n"
        + "\n".join(report.details)
    )
    assert report.steps["decode_steps"] >= decode_steps
    assert report.planned > 0, "the stage never ran"
    # A step defers only where a context is longer than the top-k takes.
    if not any(report.why_not_fused) and report.max_context > topk:
        assert report.deferred > 0 and report.fused > 0, report.line()


def launched(report, backend: str, select=False, scores=False) -> None:
    """Every kernel a planned step of ``backend`` takes was launched (the
    upcast: MX scales only, the FP32 logits of the others are returned as
    they are, and not where the select reads the logits as they come)."""
    kernels = ["update", "remap"] + ["upcast"] * (BACKENDS[backend].mx and not select)
    kernels += ["select"] * select + ["scores"] * scores
    assert all(report.launches[k] > 0 for k in kernels), report.line()


@pytest.mark.parametrize(
    "backend, mode", [("sm100", "full"), ("flashinfer_sm90", "piecewise")]
)
def test_indexer_steps_cpu(monkeypatch, backend, mode):
    report = Run(cpu_config(backend, mode), "cpu", monkeypatch).run()
    check(report, CPU_WORK.decode_steps)
    launched(report, backend)
    assert report.steps["prefill"] and report.steps["mixed"], report.line()
    assert report.steps[f"mode {mode}"], report.line()


def test_indexer_steps_cpu_select(monkeypatch):
    """The opt-in select: stock's top-k is ``contract_topk``'s set (an
    independent reference written from the select's contract) with each
    row's ids reversed, the spied select computes ``contract_topk``, and
    the top-k rows compare as sets: the plumbing (the GPU runs compare the
    real select)."""
    report = Run(cpu_config("sm100", select=True), "cpu", monkeypatch).run()
    check(report, CPU_WORK.decode_steps)
    launched(report, "sm100", select=True)
    assert report.name.endswith("/select")


def test_indexer_steps_cpu_scores(monkeypatch):
    """The opt-in scores with the select, on an SM90 path in piecewise mode,
    in the geometry they take (32 heads, pages of 32 pools): the spied
    scores compute the simulator's DeepGEMM stand-in, as stock's side does
    (the plumbing: the GPU runs compare the real kernel with DeepGEMM)."""
    geo = CPU_SCORES_GEOMETRY
    config = cpu_config("flashinfer_sm90", "piecewise", geo, select=True, scores=True)
    report = Run(config, "cpu", monkeypatch).run()
    check(report, CPU_WORK.decode_steps)
    launched(report, "flashinfer_sm90", select=True, scores=True)
    assert report.name.endswith("/select/scores")


@pytest.mark.parametrize(
    "backend, geo, wrong",
    [
        ("sm100", CPU_SCORES_GEOMETRY, "sm100"),
        ("flashmla_fp8", CPU_GEOMETRY, "pages of 16 pools"),
        ("flashmla_fp8", replace(CPU_GEOMETRY, heads=8, block=128), "8 heads"),
    ],
)
def test_indexer_steps_scores_name_what_they_cannot_take(
    monkeypatch, backend, geo, wrong
):
    """A scores run the kernel could never reach (MX scales, heads, pages)
    is refused, not run on stock's scores alone."""
    with pytest.raises(ValueError, match=wrong):
        Run(cpu_config(backend, geo=geo, scores=True), "cpu", monkeypatch)


def test_indexer_steps_cpu_two_stages(monkeypatch):
    """Two stages in one process, per layer interleaved: between one stage's
    indexer and its conversion the other's whole layer step runs and its
    pool buffer is poisoned; both match stock."""
    run = Run(cpu_config("flashmla_fp8", stages=2), "cpu", monkeypatch)
    check(run.run(), CPU_WORK.decode_steps)
    two_stages(run)


def two_stages(run: Run) -> None:
    """Two engines' stages: their own pool buffers and fused remaps, in one
    registry that dispatches each model's layers by its top-k buffer."""
    a, b = (side.stage for side in run.sides[1:])
    assert a is not b and a.pool_buffer.data_ptr() != b.pool_buffer.data_ptr()
    for side in run.sides[1:]:
        assert run.registry.by_buffer[side.buffer.data_ptr()] is side.stage
        for remap in side.stage.remaps.values():
            assert remap.stage is side.stage and remap.pending is None


@pytest.mark.parametrize("options", [[], ["--select", "--scores"]])
def test_indexer_steps_cpu_kernel_only(tmp_path, options):
    """The same through the kernel-only shim, by the CLI
    (``tools/indexer_steps.py``): the lifted indexer and its helpers run;
    and with the opt-in select and scores, whose runs the GPU tier's
    DeepGEMM comparison takes this way."""
    from tools.kernel_env import stage

    modules = {rel: rel[:-3].replace("/", ".") for rel in stage.STOCK_FILES}
    sources = {
        rel: Path(importlib.import_module(m).__file__) for rel, m in modules.items()
    }
    stage.stage(sources, tmp_path / "stock")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env |= {"KPOOL_KERNEL_ONLY": "1", "KPOOL_STOCK": str(tmp_path / "stock")}
    out = tmp_path / "result.json"
    command = [sys.executable, str(REPO / "tools/indexer_steps.py"), "--cpu-smoke"]
    command += ["--backends", "flashmla_fp8", "--seed", str(CPU_SEED)]
    command += ["--json", str(out), *options]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["meta"]["vllm"] == "kernel-only shim", result["meta"]
    assert result["meta"]["foreign_vllm_modules"] == []
    [report] = result["runs"]
    assert report["mismatches"] == 0, report["details"]
    assert report["planned"] > 0 and report["fused"] > 0, report["summary"]
    for kernel in ("select", "scores") if options else ():
        assert report["launches"].get(kernel), report["summary"]


def test_tools_print_help():
    """``--help`` prints the usage and runs nothing."""
    for tool in ("indexer_steps.py", "warm_start_kpool.py", "scores_timing.py"):
        proc = subprocess.run(
            [sys.executable, str(REPO / "tools" / tool), "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc
        assert "import" not in proc.stderr, proc.stderr


def test_full_graph_key_names_its_host_values(monkeypatch):
    """A FULL graph replays only for steps with its capture's host values:
    4 requests of 1 token and 2 of 2 (4 rows each, unpadded) get two graphs;
    all capture ``max_seq_len = max_model_len``."""
    run = Run(cpu_config("sm100", "full"), "cpu", monkeypatch)
    sched, builder = run.sim.sched, run.sim.builder
    steps = []
    for reqs, q in ((4, 1), (2, 2), (1, 2)):
        batch = sched.fixed([q] * reqs, [40] * reqs)
        steps.append(builder.build(batch, rows=4, full=True, pad_reqs=int(reqs == 1)))
        sched.release(batch)
    keys = [step.key for step in steps]
    assert keys[0] != keys[1] and keys[1] == keys[2], keys
    assert steps[1].host == steps[2].host and steps[0].host != steps[1].host
    for step in steps:
        assert step.metadata[CPU_GEOMETRY.prefixes[0][0]].max_seq_len == 512


def gpu_steps(divisor: int = 1) -> int:
    return int(os.environ.get("KPOOL_INDEXER_STEPS") or 500) // divisor


def gpu_run(monkeypatch, backend, mode="eager", split="indexer", divisor=1, **cfg):
    steps = gpu_steps(divisor)
    work = Workload(decode_steps=steps, tail_split=split)
    config = Config(backend, mode, work=work, seed=fuzz_seed(), **cfg)
    run = Run(config, "cuda", monkeypatch)
    report = run.run()
    check(report, steps, config.geo.topk)
    return run, report


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_steps_match_stock(monkeypatch, backend, mode):
    """Each backend path in each mode, streams held back at each hand-off."""
    _, report = gpu_run(monkeypatch, backend, mode, hold_cycles=HOLD)
    if mode != "eager":
        assert report.steps[f"{mode}_replay"] > 0, report.line()
    launched(report, backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_steps_stock_tail_split(monkeypatch, backend):
    """``KpoolTailMetadataBuilder``'s own split (threshold 1): the stage runs
    only where no request has speculative tokens."""
    gpu_run(monkeypatch, backend, split="stock", divisor=5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_steps_two_stages(monkeypatch, backend):
    """Two engines' stages in one process (``Config(stages=2)``), streams
    held back; both match stock and each launched its kernels."""
    run, report = gpu_run(monkeypatch, backend, divisor=5, hold_cycles=HOLD, stages=2)
    launched(report, backend)
    two_stages(run)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_steps_select(monkeypatch, backend, mode):
    """The opt-in select on the GPU, each backend path in each mode, streams
    held back: stock's top-k is ``contract_topk``'s set (an independent
    reference written from the select's contract, ties to the lower pool)
    with each row's ids reversed; the real select's rows compare with it as
    sets, every other byte as stock's."""
    _, report = gpu_run(monkeypatch, backend, mode, hold_cycles=HOLD, select=True)
    launched(report, backend, select=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if not BACKENDS[b].mx])
def test_indexer_steps_scores(monkeypatch, backend, mode):
    """The opt-in scores and select on each SM90 path in each mode, streams
    held back (``SCORES_GEOMETRY``: 32 heads, pages of 64 pools): stock's
    scores are DeepGEMM's own (vLLM's vendored copy, which the GPU tier
    unpacks), its top-k ``contract_topk``'s set in another order; the
    stage's rows, from our scores through the select, compare as sets, every
    other byte as stock's. Equal sets need our scores' bytes to be DeepGEMM's
    wherever the select reads them."""
    _, report = gpu_run(
        monkeypatch,
        backend,
        mode,
        hold_cycles=HOLD,
        select=True,
        scores=True,
        geo=SCORES_GEOMETRY,
    )
    launched(report, backend, select=True, scores=True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in BACKENDS if not BACKENDS[b].mx])
def test_indexer_steps_scores_without_select(monkeypatch, backend):
    """The opt-in scores alone, eager: both sides' top-k is the same stable
    sort, so every byte compares, the logical rows included."""
    _, report = gpu_run(
        monkeypatch,
        backend,
        divisor=5,
        hold_cycles=HOLD,
        scores=True,
        geo=SCORES_GEOMETRY,
    )
    launched(report, backend, scores=True)
