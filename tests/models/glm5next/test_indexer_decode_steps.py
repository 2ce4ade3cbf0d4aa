# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The patched ``sparse_attn_indexer_kpool`` driven step after step as
serving runs it (``tools.indexer.steps``): the stage against stock, byte for
byte, after every step, for each backend path; and two engines' stages in one
process, each with its own top-k buffer, pool buffer and hand-offs.

- CPU (CI): a few steps under ``TRITON_INTERPRET=1``: the SM100 path in
  FULL mode and the FlashInfer SM90 path in piecewise mode (no graphs on the
  CPU: each step eager in its mode's forward context, with the mode's
  padding) in the test overlay, and the FlashMLA FP8 path eagerly in a
  subprocess through the kernel-only shim (``tools/kernel_env``, by the CLI
  ``tools/indexer_steps.py``) over sources staged from the overlay; and two
  stages in one process on the SM100 path. The stage is on (warmed by its
  real warmup, which compiles nothing for CPU tensors), so it defers and
  routes every kernel input to its stock twin.
- GPU (``tools/kernel_env/gpu_tier.sh -k indexer_steps``): 500 decode steps
  (``KPOOL_INDEXER_STEPS``) of each backend path in each mode, fresh seed
  (``KPOOL_SEED`` replays), each compiled kernel launched; the tail cache's
  stock metadata split, under which ``planned()`` sees speculative steps as
  prefills; and two stages in one process on each backend path.
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.indexer.batches import (
    BACKENDS,
    Batch,
    Builder,
    Request,
    Scheduled,
    Workload,
)
from tools.indexer.steps import (
    CPU_GEOMETRY,
    CPU_WORK,
    MODES,
    REPORTS,
    Config,
    Run,
    fuzz_seed,
    run,
)

REPO = Path(__file__).resolve().parents[3]
CPU_TRITON = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
CPU_SEED = 5
HOLD = 200_000  # GPU cycles (~0.1 ms) each stream is held before a conversion


def cpu_config(backend: str, mode: str = "eager", stages: int = 1) -> Config:
    return Config(
        backend=backend, mode=mode, geo=CPU_GEOMETRY, work=CPU_WORK, seed=CPU_SEED,
        stages=stages, capture=False, full_sizes=(2, 4),
        piecewise_sizes=(16, 64, 256),
    )  # fmt: skip


def _check(report, decode_steps: int) -> None:
    REPORTS.append(report.line())
    out = os.environ.get("OUT")
    if out:
        name = report.name.replace("/", "-")
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
    if not any(report.why_not_fused):  # every layer's group fuses
        assert report.deferred > 0, "no step deferred its top-k"


@pytest.mark.parametrize(
    "backend, mode", [("sm100", "full"), ("flashinfer_sm90", "piecewise")]
)
def test_indexer_steps_cpu(backend, mode):
    """Graph modes without graphs: each step eager in its mode's forward
    context, FULL steps padded with null-block requests."""
    report = run(cpu_config(backend, mode), "cpu")
    _check(report, CPU_WORK.decode_steps)
    assert report.steps["prefill"] and report.steps[f"mode {mode}"]


def test_indexer_steps_cpu_select():
    """``--select``: stock's top-k is the contract's reference and the top-k
    rows compare as sets (on the CPU the rules refuse CPU tensors, so the
    stage's kernels, the select among them, route to stock: the plumbing)."""
    import dataclasses

    report = run(dataclasses.replace(cpu_config("sm100"), select=True), "cpu")
    _check(report, CPU_WORK.decode_steps)
    assert report.name.endswith("/select")


def test_full_graph_key_names_its_host_values():
    """A FULL graph replays only for steps with its capture's host values:
    8 requests of 1 token and 4 of 2 (8 rows each, unpadded) get two graphs,
    and both capture ``max_seq_len = max_model_len``. Sharing one graph (the
    rows as key) made stage and stock diverge on the H200 after 442 steps."""
    geo = CPU_GEOMETRY
    builder = Builder(geo, BACKENDS["sm100"], [("k", "tail", "mla")], "cpu")
    steps = []
    for reqs, q in ((4, 1), (2, 2), (1, 2)):
        items = [
            Scheduled(Request(i, 40, 8, i + 1, blocks=[i + 1]), 40, q, False)
            for i in range(reqs)
        ]
        batch = Batch(items, next_n=q, num_decodes=reqs)
        pad = 2 - reqs if reqs < 2 else 0
        steps.append(builder.build(batch, rows=4, full=True, pad_reqs=pad))
    keys = [step.key for step in steps]
    assert keys[0] != keys[1] and keys[1] == keys[2], keys
    assert steps[1].host == steps[2].host, (steps[1].host, steps[2].host)
    assert steps[0].host != steps[1].host
    for step in steps:
        assert step.metadata["k"].max_seq_len == geo.max_model_len


def _two_stages(run_: Run) -> None:
    """Two engines' stages: their own pool buffers and fused remaps, in one
    registry that dispatches each model's layers by its top-k buffer."""
    a, b = (side.stage for side in run_.sides[1:])
    assert a is not b
    assert a.pool_buffer.data_ptr() != b.pool_buffer.data_ptr()
    for side in run_.sides[1:]:
        buffer = side.attentions[0].indexer.topk_indices_buffer
        assert run_.registry.by_buffer[buffer.data_ptr()] is side.stage
        for remap in side.stage.remaps.values():
            assert remap.stage is side.stage and remap.pending is None


def test_indexer_steps_cpu_two_stages():
    """Two stages in one process, per layer interleaved: between one stage's
    defer and its conversion the other's whole layer step runs and its pool
    buffer is poisoned; both match stock."""
    run_ = Run(cpu_config("sm100", stages=2), "cpu")
    report = run_.run()
    _check(report, CPU_WORK.decode_steps)
    _two_stages(run_)


def test_indexer_steps_cpu_kernel_only(tmp_path):
    """The same through the kernel-only shim, by the CLI
    (``tools/indexer_steps.py``): the lifted indexer and its helpers run."""
    from tools.kernel_env import stage

    modules = {rel: rel[:-3].replace("/", ".") for rel in stage.STOCK_FILES}
    sources = {
        rel: Path(importlib.import_module(m).__file__) for rel, m in modules.items()
    }
    stage.stage(sources, tmp_path / "stock")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | CPU_TRITON
    env |= {"KPOOL_KERNEL_ONLY": "1", "KPOOL_STOCK": str(tmp_path / "stock")}
    out = tmp_path / "result.json"
    command = [sys.executable, str(REPO / "tools/indexer_steps.py"), "--cpu-smoke"]
    command += ["--backends", "flashmla_fp8", "--seed", str(CPU_SEED)]
    command += ["--json", str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["meta"]["vllm"] == "kernel-only shim", result["meta"]
    assert result["meta"]["foreign_vllm_modules"] == []
    assert len(result["runs"]) == 1
    for report in result["runs"]:
        assert report["mismatches"] == 0, report["details"]
        assert report["planned"] > 0 and report["deferred"] > 0, report["summary"]
        assert not any(report["why_not_fused"]), report["why_not_fused"]


def _launched(report, backend: str) -> None:
    """Every kernel a planned step of ``backend`` takes was launched: the
    warmup compiled the keys the steps derive (upcast: MX scales only; the
    FP32 logits of the others are returned as they are)."""
    kernels = ["KpoolUpdateKernel", "ExpandRemapKernel"]
    kernels += ["UpcastLogitsKernel"] if BACKENDS[backend].mx else []
    assert all(report.launches[k] > 0 for k in kernels), report.line()
    assert report.fused > 0, "no top-k went through the fused remap"


def _gpu_steps(divisor: int = 1) -> int:
    return int(os.environ.get("KPOOL_INDEXER_STEPS") or 500) // divisor


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_steps_match_stock(backend, mode):
    """Each backend path in each mode, streams held back at each conversion."""
    steps = _gpu_steps()
    work = Workload(decode_steps=steps, tail_split="indexer")
    cfg = Config(backend, mode, work=work, seed=fuzz_seed(), hold_cycles=HOLD)
    report = run(cfg, "cuda")
    _check(report, steps)
    if mode != "eager":
        assert report.steps[f"{mode}_replay"] > 0, report.line()
    _launched(report, backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_steps_stock_tail_split(backend):
    """``KpoolTailMetadataBuilder``'s own split (threshold 1): the stage runs
    only where no request has speculative tokens."""
    steps = _gpu_steps(5)
    work = Workload(decode_steps=steps, tail_split="stock")
    report = run(Config(backend, "eager", work=work, seed=fuzz_seed()), "cuda")
    _check(report, steps)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_steps_two_stages(backend):
    """Two engines' stages in one process (``Config(stages=2)``): steps of
    the two interleave per layer, the other stage's pool buffer poisoned
    between a stage's defer and its conversion, streams held back; both
    stages match stock byte for byte and each launched its kernels."""
    steps = _gpu_steps(5)
    work = Workload(decode_steps=steps, tail_split="indexer")
    cfg = Config(backend, work=work, seed=fuzz_seed(), hold_cycles=HOLD, stages=2)
    run_ = Run(cfg, "cuda")
    report = run_.run()
    _check(report, steps)
    _launched(report, backend)
    _two_stages(run_)
