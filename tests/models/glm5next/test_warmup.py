# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``runtime/warmup.py``: the stage's JIT warmup entry (``StageWarmup``, a
vLLM ``VllmJitKernel``), which gives the stage its executors only once its
kernels compiled and (unless "off") passed the self-check, and otherwise
leaves it off and says so ("strict": raises) (CPU; the self-check itself is
``specialized_decode``'s to test)."""

import logging
import re
from types import SimpleNamespace

import pytest
import torch
from indexer_sim import KERNELS, Step, assert_same, kernel_name

from vllm.model_executor.warmup.jit_warmup import VllmJitKernel
from vllm.models.glm5next.nvidia.specialized_decode import self_check
from vllm.models.glm5next.nvidia.specialized_decode.config import SELF_CHECK_SEED_ENV
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select.launch import (
    SELECT,
)
from vllm.models.glm5next.nvidia.specialized_decode.runtime import warmup
from vllm.models.glm5next.nvidia.specialized_decode.runtime.warmup import StageWarmup


@pytest.fixture
def model(bench):
    """A model's stage, its warmup not run yet, and a decode step."""
    return bench(Step([1, 1], [150, 180], seed=80), warm=False)


def warmup_lines(vllm_log):
    return [r for r in vllm_log.records if r.name == warmup.__name__]


def test_warmup_entry(model):
    """The registry protocol: the keys are (kernel, compile key) pairs of
    ``deployment_values``; ``compile_many`` compiles them and ("off": no
    self-check) gives the stage their executors, and only then does the
    stage plan steps."""
    stage, attentions = model.stage, model.engine.attentions
    entry = StageWarmup(stage, attentions, "off")
    assert isinstance(entry, VllmJitKernel)
    keys = entry.get_warmup_keys()
    want = {
        (kernel, key)
        for kernel, values in warmup.deployment_values(stage, attentions)
        for key in kernel.get_warmup_keys(**values)
    }
    assert set(keys) == want and len(keys) == len(want)
    assert {kernel_name(key) for _, key in keys} == {"update", "expand", "remap"}
    assert not stage.executors and not stage.planned()
    entry.compile_many(keys)
    assert set(stage.executors) == {key for _, key in keys}
    for kernel, key in keys:
        assert stage.executors[key] is kernel.executor(key)
    assert (torch.int64, torch.int64) == (warmup.POSITIONS, warmup.SLOTS)


@pytest.mark.parametrize(
    "mode, problem, on, level",
    [
        ("on", None, True, logging.INFO),
        ("on", "UpcastKernel case 3 (seed 80): differs", False, logging.ERROR),
        ("strict", None, True, logging.INFO),
        ("strict", "UpcastKernel case 3 (seed 80): differs", None, None),
    ],
)
def test_warmup_self_check(monkeypatch, model, vllm_log, mode, problem, on, level):
    """The self-check after the compiles (its answer given here): a failure
    keeps the stage off with one error line naming the seed, or raises."""
    seen = []

    def check(executors, seed, device):
        seen.append((len(executors), seed, device))
        return problem

    monkeypatch.setattr(self_check, "check", check)
    entry = StageWarmup(model.stage, model.engine.attentions, mode, seed=77)
    failed = (
        f"GLM-5-Next specialized decode: self-check failed, {problem}; dsa_kpool "
        f"stays off and the decode runs stock (replay with {SELF_CHECK_SEED_ENV}=77)."
    )
    if on is None:
        with pytest.raises(RuntimeError) as error:
            entry.compile_many(entry.get_warmup_keys())
        assert str(error.value) == failed and not model.stage.executors
        return
    entry.compile_many(entry.get_warmup_keys())
    variants = len(entry.get_warmup_keys())
    assert bool(model.stage.executors) is on
    assert seen == [(variants, 77, torch.device("cpu"))]
    [record] = warmup_lines(vllm_log)
    assert record.levelno == level
    if problem:
        assert record.getMessage() == failed
    else:
        assert re.fullmatch(
            "GLM-5-Next specialized decode: self-check passed: "
            rf"{variants} kernel variants x {self_check.CASES} cases, seed 77, "
            r"\d+\.\d\d s; dsa_kpool on\.",
            record.getMessage(),
        )


def test_self_check_seed(monkeypatch, model, vllm_log):
    """Without a seed to replay, the fixed default (every rank and run checks
    the same cases), a 31-bit one, printed on failure."""
    seeds = []
    monkeypatch.setattr(
        self_check, "check", lambda keys, seed, device: seeds.append(seed) or "bad"
    )
    for _ in range(2):
        entry = StageWarmup(model.stage, model.engine.attentions)
        entry.compile_many(entry.get_warmup_keys())
    assert seeds == [warmup.SELF_CHECK_SEED] * 2 and not model.stage.executors
    assert 0 <= warmup.SELF_CHECK_SEED < 2**31
    record = warmup_lines(vllm_log)[-1]
    assert record.getMessage().endswith(
        f"(replay with {SELF_CHECK_SEED_ENV}={warmup.SELF_CHECK_SEED})."
    )


def failing(monkeypatch):
    """The update's compile fails (``no ptxas``)."""

    def fail(compile_key):
        raise RuntimeError("no ptxas")

    monkeypatch.setattr(KERNELS["update"], "executor", fail)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_failed_warmup_leaves_the_stage_off(monkeypatch, model, vllm_log, mode):
    """A warmup that raises (here: a compile) leaves the stage off, logs an
    error with the traceback saying so, and the steps run stock."""
    failing(monkeypatch)
    entry = StageWarmup(model.stage, model.engine.attentions, mode)
    entry.compile_many(entry.get_warmup_keys())
    assert not model.stage.executors
    [record] = warmup_lines(vllm_log)
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert record.getMessage() == (
        "GLM-5-Next specialized decode: warmup failed (no ptxas); dsa_kpool stays "
        "off and the decode runs stock."
    )
    got = model.run()
    assert model.routes == ["indexer:expand", "stock:convert"]
    assert_same(model.stock(), got, model.fwd)


def test_failed_warmup_strict_raises(monkeypatch, model):
    failing(monkeypatch)
    entry = StageWarmup(model.stage, model.engine.attentions, "strict")
    with pytest.raises(RuntimeError, match="no ptxas"):
        entry.compile_many(entry.get_warmup_keys())
    assert not model.stage.executors


def select_keys(rows: int, width: int) -> set:
    return {
        SELECT.dispatch(k=512, dtype=torch.float32, rows=r, width=width, sms=132)
        for r in range(1, rows + 1)
    }


@pytest.mark.parametrize("one_wave", [False, True], ids=["every-batch", "one-wave"])
@pytest.mark.parametrize("width", [65536, 262144])
@pytest.mark.parametrize("max_rows", [8, 70])
def test_select_keys_are_each_row_count_it_runs(width, max_rows, one_wave):
    """The select's keys are those of every row count from 1 to the stage's
    rows; with ``kpool_select="one_wave"`` of those whose clusters fit one
    wave (``LayerStep.select`` runs no other): 1-66 rows at 65536 pools,
    1-16 at 262144, on 132 SMs."""
    stage = SimpleNamespace(
        mx_scales=False, select=True, fuse=True, max_rows=max_rows, sms=132,
        select_one_wave=one_wave,
    )  # fmt: skip
    values = dict(
        (kernel, v)
        for kernel, v in warmup.deployment_values(stage, [_layer(width)])
        if kernel is SELECT
    )[SELECT]
    assert values == dict(
        max_rows=max_rows, one_wave_only=one_wave, k=512, dtype=torch.float32,
        width=width, sms=132,
    )  # fmt: skip
    wave = (66 if width == 65536 else 16) if one_wave else max_rows
    keys = SELECT.get_warmup_keys(**values)
    assert set(keys) == select_keys(min(max_rows, wave), width)


def _layer(width: int):
    """A DSA layer as ``deployment_values`` reads it (2048-token top-k,
    ``width`` pools of logits), its MLA cache unbound."""
    tail = torch.zeros((5, 2, 8, 128), dtype=torch.bfloat16)
    indexer = SimpleNamespace(
        k_cache=SimpleNamespace(kv_cache=torch.zeros((9, 16, 132), dtype=torch.uint8)),
        tail_cache=SimpleNamespace(kv_cache=tail),
        topk_tokens=2048,
        topk_indices_buffer=torch.zeros((4, 2176), dtype=torch.int32),
        scale_fmt="ue8m0",
        max_pool_len=width,
    )
    mla = SimpleNamespace(mla_attn=SimpleNamespace(kv_cache=None))
    return SimpleNamespace(indexer=indexer, mla_attn=mla)


@pytest.mark.parametrize("select, fuse", [(False, True), (True, False)])
def test_no_select_keys_unless_opted_in_and_fused(select, fuse):
    """The select runs only in deferring steps of an opted-in stage: no key
    otherwise."""
    stage = SimpleNamespace(mx_scales=True, select=select, fuse=fuse, max_rows=8)
    kernels = [k for k, _ in warmup.deployment_values(stage, [_layer(65536)])]
    assert SELECT not in kernels and KERNELS["upcast"] in kernels


# (mode, the rank whose self-check fails or None) of each warmup the ranks run.
SCENARIOS = (("on", None), ("on", 1), ("strict", None), ("strict", 1))


def _rank_warmup(rank: int, ranks: int, init: str, out):
    """One tensor-parallel rank (a process, vLLM's groups over gloo): a
    warmup of one key for each of ``SCENARIOS``, its self-check failing on
    the scenario's rank; puts (scenario, rank, whether the stage got
    executors, the error lines or the raised message) on ``out``."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        parallel_state.init_distributed_environment(ranks, rank, init, rank, "gloo")
        parallel_state.initialize_model_parallel(ranks, backend="gloo")
    lines: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger(warmup.__name__).addHandler(handler)
    kernel = SimpleNamespace(executor=lambda key: object())
    for scenario, (mode, failing) in enumerate(SCENARIOS):
        lines.clear()
        self_check.check = lambda executors, seed, device, failing=failing: (
            "UpdateKernel case 5 (seed 9): differs" if rank == failing else None
        )
        stage = SimpleNamespace(executors={}, pool_buffer=torch.empty(0))
        try:
            StageWarmup(stage, [], mode).compile_many(
                [StageWarmup.CompileKey(kernel, "key")]
            )
        except RuntimeError as error:
            lines.append(f"raised: {error}")
        out.put((scenario, rank, bool(stage.executors), list(lines)))
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


def test_ranks_fall_back_together(tmp_path):
    """Three tensor-parallel ranks in three processes (vLLM's groups over
    gloo on the CPU): where rank 1's self-check fails, no rank runs the
    stage and every rank logs (or, "strict", raises) one line naming rank
    1; where all pass, all run it."""
    import multiprocessing

    ranks, context = 3, multiprocessing.get_context("spawn")
    out = context.Queue()
    args = (ranks, f"file://{tmp_path}/init", out)
    procs = [
        context.Process(target=_rank_warmup, args=(r, *args)) for r in range(ranks)
    ]
    for proc in procs:
        proc.start()
    got = sorted(out.get(timeout=300) for _ in range(ranks * len(SCENARIOS)))
    for proc in procs:
        proc.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * ranks
    named = (
        "the warmup failed on tensor-parallel rank(s) [1] of 3; dsa_kpool stays "
        "off on every rank and the decode runs stock."
    )
    for scenario, rank, on, lines in got:
        mode, failing = SCENARIOS[scenario]
        if failing is None:
            assert on and lines == [], (mode, rank, lines)
        elif mode == "strict":
            [line] = lines
            assert not on and line.startswith("raised: "), (rank, line)
            assert ("UpdateKernel case 5" if rank == 1 else named) in line, line
        else:
            assert not on and lines[-1].endswith(named), (rank, lines)
            assert len(lines) == (2 if rank == 1 else 1), (rank, lines)
