# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``runtime/warmup.py``: the stage's JIT warmup (``StageWarmup``) through
vLLM's registry, which gives the stage its executors only once its kernels
compiled and (unless "off") passed the self-check, and otherwise leaves it
off and says so ("strict": raises) (CPU; the self-check itself is
``specialized_decode``'s to test)."""

import dataclasses
import functools
import json
import logging
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from indexer_sim import KERNELS, Step, assert_same, kernel_name, twin

from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
from vllm.models.glm5next.nvidia.specialized_decode import self_check
from vllm.models.glm5next.nvidia.specialized_decode.config import SELF_CHECK_SEED_ENV
from vllm.models.glm5next.nvidia.specialized_decode.constants import POOL
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.remap.launch import (
    REMAP,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.scores.launch import (
    SCORES,
)
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


def warm(stage, mode: str = "off", seed=None) -> StageWarmup:
    """The stage's warmup (``mode``, ``seed``) run by vLLM's JIT warmup
    registry, as a model runner runs it."""
    stage.warmup = StageWarmup(stage, stage.warmup.attentions, mode, seed)
    registry = JitWarmupRegistry(None)
    with registry.activate():
        stage.warmup.register()
    registry.warmup()
    return stage.warmup


def test_the_registry_compiles_the_stage_kernels_keys(model):
    """Each of the stage's kernels gives the keys of ``deployment_values``
    for its kind; the registry compiles them and ("off": no self-check) the
    stage gets their executors, the public kernels' compiles, and only then
    plans steps."""
    stage, attentions = model.stage, model.engine.attentions
    want = {
        key
        for kernel, values in warmup.deployment_values(stage, attentions)
        for key in kernel.get_warmup_keys(**values)
    }
    keys = [key for kernel in stage.kernels for key in kernel.get_warmup_keys()]
    assert set(keys) == want and len(keys) == len(want)
    assert {kernel_name(key) for key in keys} == {"update", "expand", "remap"}
    assert not stage.executors and not stage.planned()
    warm(stage)
    assert set(stage.executors) == want
    for key in keys:
        assert stage.executors[key] is KERNELS[kernel_name(key)].executor(key)
    assert (torch.int64, torch.int64) == (warmup.POSITIONS, warmup.SLOTS)


def test_the_stage_waits_for_its_last_kernel(model):
    """The stage gets no executor before its last kernel with keys compiled
    (the registry compiles one kernel after another)."""
    stage = model.stage
    keyed = [(k, k.get_warmup_keys()) for k in stage.kernels]
    keyed = [(k, keys) for k, keys in keyed if keys]
    assert len(keyed) == 3
    for kernel, keys in keyed[:-1]:
        kernel.compile_many(keys)
        assert not stage.executors
    keyed[-1][0].compile_many(keyed[-1][1])
    assert len(stage.executors) == sum(len(keys) for _, keys in keyed)


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
    failed = (
        f"GLM-5-Next specialized decode: self-check failed, {problem}; dsa_kpool "
        f"stays off and the decode runs stock (replay with {SELF_CHECK_SEED_ENV}=77)."
    )
    if on is None:
        with pytest.raises(RuntimeError) as error:
            warm(model.stage, mode, seed=77)
        assert str(error.value) == failed and not model.stage.executors
        return
    entry = warm(model.stage, mode, seed=77)
    variants = len(entry.executors)
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


def test_self_check_seed_is_a_constant(monkeypatch, model, vllm_log, ranks):
    """Without a seed to replay, the self-check's seed is ``SEED``, the same
    in every process (each fresh rank process's self-check got this
    process's), printed on failure."""
    assert [ranks[rank][0]["seeds"] for rank in range(3)] == [[warmup.SEED]] * 3
    seeds = []
    monkeypatch.setattr(
        self_check, "check", lambda keys, seed, device: seeds.append(seed) or "bad"
    )
    for _ in range(2):
        warm(model.stage, "on")
    assert seeds == [warmup.SEED, warmup.SEED] and not model.stage.executors
    record = warmup_lines(vllm_log)[-1]
    assert record.getMessage().endswith(
        f"(replay with {SELF_CHECK_SEED_ENV}={warmup.SEED})."
    )


def test_a_later_compile_launches_only_once_checked(monkeypatch, model):
    """The stage launches what its warmup's last verdict checked, a table of
    its own: a later ``compile_many`` on one of its kernels (a key the first
    verdict did not check) reaches no launch before its self-check, a
    passing one gives the stage a new table with it, and a failing one
    turns the whole stage off (the steps run stock)."""
    stage, remap = model.stage, model.stage.kernels.remap
    answers, launching = [None, None, "RemapKernel case 0 (seed 0) differs"], []

    def check(executors, seed, device):
        launching.append((set(executors), dict(stage.executors)))
        return answers[len(launching) - 1]

    monkeypatch.setattr(self_check, "check", check)
    warm(stage, "on")
    first = stage.executors
    [key, *_] = remap.get_warmup_keys()
    assert first and first is not stage.warmup.executors and stage.checked(key)
    monkeypatch.setattr(type(remap), "executor", lambda self, key: Recorder())
    later = dataclasses.replace(key, block_size=2 * key.block_size)
    remap.compile_many([later])
    checked, launched = launching[-1]
    assert later in checked and later not in launched and launched == first
    assert stage.executors is not first and set(stage.executors) == {*first, later}
    assert stage.checked(later) is stage.warmup.executors[later]
    remap.compile_many([dataclasses.replace(key, block_size=4 * key.block_size)])
    assert stage.executors == {} and stage.checked(key) is None
    got = model.run()
    assert model.routes == ["indexer:expand", "stock:convert"]
    assert_same(model.stock(), got, model.fwd)


class Recorder:
    """An executor that records its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def failing(monkeypatch):
    """The update's compile fails (``no ptxas``)."""

    def fail(kernel, compile_key):
        raise RuntimeError("no ptxas")

    monkeypatch.setattr(type(KERNELS["update"]), "executor", fail)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_failed_warmup_leaves_the_stage_off(monkeypatch, model, vllm_log, mode):
    """A warmup that raises (here: a compile) leaves the stage off, logs an
    error with the traceback saying so, and the steps run stock."""
    failing(monkeypatch)
    warm(model.stage, mode)
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
    with pytest.raises(RuntimeError, match="no ptxas"):
        warm(model.stage, "strict")
    assert not model.stage.executors


def select_keys(rows: int, width: int) -> set:
    return {
        SELECT.dispatch(k=512, dtype=torch.float32, rows=r, width=width, sms=132)
        for r in range(1, rows + 1)
    }


def select_values(width: int, max_rows: int, one_wave: bool) -> dict:
    """The select's warmup values ``deployment_values`` derives for a stage
    of ``max_rows`` rows on 132 SMs and one layer of ``width`` pools."""
    stage = SimpleNamespace(
        mx_scales=False,
        select=True,
        fuse=True,
        max_rows=max_rows,
        sms=132,
        select_one_wave=one_wave,
        scores=False,
    )
    return dict(
        (kernel, v)
        for kernel, v in warmup.deployment_values(stage, [_layer(width)])
        if kernel is SELECT
    )[SELECT]


@pytest.mark.parametrize("one_wave", [False, True], ids=["every-batch", "one-wave"])
@pytest.mark.parametrize("width", [65536, 262144])
@pytest.mark.parametrize("max_rows", [8, 70])
def test_select_keys_are_each_row_count_it_runs(width, max_rows, one_wave):
    """The select's keys are those of every row count from 1 to the stage's
    rows; with ``kpool_select="one_wave"`` of those whose clusters fit one
    wave (``LayerStep.selected`` runs no other): 1-66 rows at 65536 pools,
    1-16 at 262144, on 132 SMs."""
    values = select_values(width, max_rows, one_wave)
    assert values == dict(
        max_rows=max_rows,
        one_wave_only=one_wave,
        k=512,
        dtype=torch.float32,
        width=width,
        sms=132,
    )
    wave = (66 if width == 65536 else 16) if one_wave else max_rows
    keys = SELECT.get_warmup_keys(**values)
    assert set(keys) == select_keys(min(max_rows, wave), width)


@pytest.mark.parametrize("width", [16384, 65536, 131072, 262144])
def test_select_warms_a_full_batch_at_every_cluster_threshold(width):
    """A stage of ``max_rows`` rows warms the key of a full batch for every
    ``max_rows`` up to past one wave, those where a new cluster size starts
    included (17 rows of 16384 pools, 5 of 262144 on 132 SMs): a batch
    without its key would run stock's top-k and not be batch-invariant."""
    thresholds = []
    for max_rows in range(1, 90):
        values = select_values(width, max_rows, one_wave=False)
        keys = set(SELECT.get_warmup_keys(**values))
        assert keys == select_keys(max_rows, width), max_rows
        if max_rows > 1 and not select_keys(max_rows - 1, width) >= keys:
            thresholds.append(max_rows)
    assert thresholds, "no row count starts a new cluster size"


def _layer(width: int, page: int = 16, heads: int = 16):
    """A DSA layer as ``deployment_values`` reads it (2048-token top-k,
    ``width`` pools of logits, ``page``-pool cache pages, ``heads`` index
    heads), its MLA cache unbound."""
    tail = torch.zeros((5, 2, 8, 128), dtype=torch.bfloat16)
    kv = torch.zeros((9, page, 132), dtype=torch.uint8)
    indexer = SimpleNamespace(
        k_cache=SimpleNamespace(kv_cache=kv),
        n_head=heads,
        tail_cache=SimpleNamespace(kv_cache=tail),
        topk_tokens=2048,
        topk_indices_buffer=torch.zeros((4, 2176), dtype=torch.int32),
        scale_fmt="ue8m0",
        max_pool_len=width,
    )
    mla = SimpleNamespace(mla_attn=SimpleNamespace(kv_cache=None))
    return SimpleNamespace(indexer=indexer, mla_attn=mla)


def _fused_layer(pools: int, block: int = 64):
    """``_layer`` of ``pools`` pools a row (its top-k tokens / 4), its MLA
    cache bound as the fused remap reads it ([blocks, block, row])."""
    layer = _layer(65536)
    layer.indexer.topk_tokens = pools * POOL
    kv = torch.zeros((3, block, 8), dtype=torch.uint8)
    layer.mla_attn.mla_attn.kv_cache = kv
    return layer


def test_a_layer_the_remap_refuses_stays_on_stock(spies, monkeypatch, vllm_log):
    """A fused stage of 512-pool layers and one of 500 pools (not a multiple
    of 32: the remap refuses it, so its steps never defer): the warmup lists
    the fused remap's keys (with and without counts) and the select's of the
    512-pool layers alone, the expansion's of both; none of the remap for a
    layer whose MLA cache blocks it refuses (62 tokens: its steps defer, run
    the select and convert stock). The self-check takes every remap key it
    lists (the stock twins' bytes, on the CPU), and the stage goes on."""
    settings = dict(mx_scales=False, select=True, fuse=True, max_rows=8, sms=132)
    settings |= dict(select_one_wave=False, scores=False)
    stage = SimpleNamespace(
        **settings, executors={}, pool_buffer=torch.zeros(1), kernels=[REMAP]
    )
    layers = [_fused_layer(512), _fused_layer(500), _fused_layer(512, block=62)]
    layers.append(_fused_layer(512))
    values = warmup.deployment_values(stage, layers)
    assert [kernel for kernel, _ in values].count(SELECT) == 3
    keys = {
        kernel: [
            key for k, v in values if k is kernel for key in k.get_warmup_keys(**v)
        ]
        for kernel in (REMAP, KERNELS["expand"])
    }
    remap = {(key.groups, key.block_size, key.counts) for key in keys[REMAP]}
    assert remap == {(512, 64, True), (512, 64, False)}
    assert {key.groups for key in keys[KERNELS["expand"]]} == {512, 500}
    # Seed 2's case is one row (the stock conversion runs in Triton's
    # interpreter here).
    entry = StageWarmup(stage, layers, "on", seed=2)
    monkeypatch.setattr(
        type(REMAP), "executor", lambda self, key: functools.partial(twin, "remap", key)
    )
    monkeypatch.setattr(self_check, "CASES", 1)
    entry.compiled(REMAP, entry.keys(REMAP))
    assert set(stage.executors) == set(keys[REMAP])
    [record] = warmup_lines(vllm_log)
    assert "self-check passed" in record.getMessage()


@pytest.mark.parametrize("select, fuse", [(False, True), (True, False)])
def test_no_select_keys_unless_opted_in_and_fused(select, fuse):
    """The select runs only in deferring steps of an opted-in stage: no key
    otherwise."""
    stage = SimpleNamespace(
        mx_scales=True,
        select=select,
        fuse=fuse,
        max_rows=8,
        scores=False,
    )
    kernels = [k for k, _ in warmup.deployment_values(stage, [_layer(65536)])]
    assert SELECT not in kernels and KERNELS["upcast"] in kernels


def scores_keys(stage, layer) -> list:
    return [
        key
        for kernel, values in warmup.deployment_values(stage, [layer])
        if kernel is SCORES
        for key in kernel.get_warmup_keys(**values)
    ]


@pytest.mark.parametrize(
    "heads, served", [(8, 32), (16, 16), (32, 32), (64, 64)], ids=str
)
@pytest.mark.parametrize("spec, next_n", [(0, [1]), (1, [1, 2]), (3, [1, 2, 3, 4])])
def test_scores_keys_are_each_next_n_it_runs(heads, served, spec, next_n):
    """``kpool_scores``: a key for the indexer's own heads where the kernel
    takes them (16: the stage hands it the real ones of vLLM's padded 32),
    else the 32 vLLM pads them to; each next_n from 1 to 1 + the
    speculative tokens; the page."""
    stage = SimpleNamespace(
        mx_scales=False,
        select=False,
        fuse=True,
        max_rows=8,
        scores=True,
        next_n=1 + spec,
    )
    keys = scores_keys(stage, _layer(65536, page=64, heads=heads))
    assert sorted(keys, key=repr) == [SCORES.CompileKey(served, n, 64) for n in next_n]


def test_scores_keys_stop_at_what_the_kernels_take(monkeypatch):
    """No next_n past ``NEXT_N`` (a stage of 6), none DeepGEMM does not take
    (SM90's 3: the indexer flattens those steps), no key of a page or a
    head count the kernel does not take: those steps run DeepGEMM."""
    stage = SimpleNamespace(
        mx_scales=False,
        select=False,
        fuse=True,
        max_rows=8,
        scores=True,
        next_n=6,
    )
    keys = scores_keys(stage, _layer(65536, page=32))
    assert [key.next_n for key in keys] == [1, 2, 3, 4]
    monkeypatch.setattr(warmup, "native_next_n_supported", lambda n: n in (1, 2, 4))
    assert [key.next_n for key in scores_keys(stage, _layer(65536, page=32))] == [
        1,
        2,
        4,
    ]
    assert scores_keys(stage, _layer(65536, page=16)) == []
    assert scores_keys(stage, _layer(65536, page=64, heads=128)) == []


@pytest.mark.parametrize("mx, scores", [(True, True), (False, False)])
def test_no_scores_keys_with_mx_scales_or_off(mx, scores):
    """The scores take FP32 scales (SM90): no key with MX scales, nor unless
    opted in."""
    stage = SimpleNamespace(
        mx_scales=mx,
        select=False,
        fuse=True,
        max_rows=8,
        scores=scores,
        next_n=4,
    )
    assert scores_keys(stage, _layer(65536, page=64)) == []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_ranks(world: int = 3, tp: int = 3) -> list[subprocess.Popen]:
    """``warmup_ranks.py`` in ``world`` processes, TP groups of ``tp`` over
    gloo on the CPU (3: one TP group); their output in files (a full pipe
    would stall a rank started early)."""
    port, script = free_port(), Path(__file__).with_name("warmup_ranks.py")
    runs = []
    for rank in range(world):
        # Closed by the fixture, once the rank ended.
        out = tempfile.TemporaryFile("w+")  # noqa: SIM115
        err = tempfile.TemporaryFile("w+")  # noqa: SIM115
        command = [sys.executable, script, str(rank), str(world), str(port), str(tp)]
        runs.append(subprocess.Popen(command, stdout=out, stderr=err, text=True))
        runs[-1].out, runs[-1].err = out, err
    return runs


# The root conftest.py starts the ranks once collection is done (they take
# a minute of CPU, mostly vLLM's import, once a rank).
START_EARLY = {"ranks": start_ranks, "group_ranks": lambda: start_ranks(4, 2)}
STARTED: dict = {}


def lines_of(runs) -> dict:
    """Each rank's JSON line, by rank (at most 5 minutes, so that a rank that
    waits for one that left fails the test rather than hangs it)."""
    found = {}
    try:
        for rank, run in enumerate(runs):
            run.wait(timeout=300)
            run.out.seek(0), run.err.seek(0)
            assert run.returncode == 0, run.err.read()[-3000:]
            found[rank] = json.loads(run.out.read().strip().splitlines()[-1])
    finally:
        for run in runs:
            run.kill()
            run.out.close(), run.err.close()
    return found


@pytest.fixture(scope="module")
def ranks(request, started):
    """Each rank's results of ``SCENARIOS``, by rank: 3 ranks, one TP group."""
    found = lines_of(started(request.module, "ranks"))
    return {rank: line["results"] for rank, line in found.items()}


@pytest.fixture(scope="module")
def group_ranks(request, started):
    """Each rank's JSON line, by rank: 4 ranks, TP 2 x PP 2."""
    return lines_of(started(request.module, "group_ranks"))


def scenario(ranks, index: int) -> list[dict]:
    return [ranks[rank][index] for rank in range(3)]


OFF = "dsa_kpool stays off on every TP rank (failed: rank {} of 3)"


def test_tp_ranks_that_all_pass_run_the_stage(ranks):
    """Every rank passes its self-check: the stage on every rank, one info
    line each saying so."""
    for result in scenario(ranks, 0):
        assert result["on"] and result["raised"] is None
        [(level, line)] = result["lines"]
        assert level == "INFO" and line.endswith(
            "; dsa_kpool on (all 3 TP ranks passed)."
        )


def test_one_failing_tp_rank_turns_the_stage_off_on_every_rank(ranks):
    """Rank 1's self-check fails: every rank runs stock, each with one error
    line naming rank 1 (rank 1's own: its failure and seed)."""
    results = scenario(ranks, 1)
    assert [r["on"] for r in results] == [False, False, False]
    lines = [r["lines"] for r in results]
    passed = (
        "GLM-5-Next specialized decode: this rank's warmup passed; "
        f"{OFF.format(1)} and the decode runs stock."
    )
    assert lines[0] == lines[2] == [["ERROR", passed]]
    failed = (
        "GLM-5-Next specialized decode: self-check failed, UpcastKernel case "
        f"3 (seed {warmup.SEED + 3}) differs from stock: key; {OFF.format(1)} "
        f"and the decode runs stock (replay with {SELF_CHECK_SEED_ENV}="
        f"{warmup.SEED})."
    )
    assert lines[1] == [["ERROR", failed]]


def test_a_tp_rank_whose_compile_fails_turns_the_stage_off_everywhere(ranks):
    """Rank 0's compile raises: every rank runs stock; rank 0 says why."""
    results = scenario(ranks, 2)
    assert [r["on"] for r in results] == [False, False, False]
    failed = (
        "GLM-5-Next specialized decode: warmup failed (no ptxas); "
        f"{OFF.format(0)} and the decode runs stock."
    )
    assert results[0]["lines"] == [["ERROR", failed]]
    assert all(OFF.format(0) in r["lines"][0][1] for r in results)


def test_strict_raises_on_every_tp_rank(ranks):
    """ "strict", rank 2's self-check fails: every rank raises (none waits
    for rank 2 in a later collective), the stage off everywhere."""
    results = scenario(ranks, 3)
    assert [r["on"] for r in results] == [False, False, False]
    raised = [r["raised"] for r in results]
    assert all(e.startswith("RuntimeError: ") and OFF.format(2) in e for e in raised)
    assert "self-check failed, UpcastKernel case 3" in raised[2]


def test_off_runs_the_stage_without_a_self_check_on_every_tp_rank(ranks):
    """ "off": no self-check (rank 1's would fail), the stage on everywhere."""
    assert [r["on"] for r in scenario(ranks, 4)] == [True, True, True]


def test_strict_raises_on_every_tp_rank_when_a_compile_fails(ranks):
    """ "strict", rank 1's compile raises: rank 1 raises its error, the
    others a RuntimeError naming rank 1, once the ranks agreed (none left
    waiting in the exchange)."""
    raised = [r["raised"] for r in scenario(ranks, 5)]
    assert raised[1] == "RuntimeError: no ptxas"
    assert all(OFF.format(1) in raised[rank] for rank in (0, 2))


def test_each_tp_group_agrees_on_its_own(group_ranks):
    """TP 2 x PP 2: the ranks agree over their own TP group's CPU group, not
    the world: a failing rank turns the stage off in its TP group alone,
    and the lines count that group's ranks (the world's gathers would pair
    ranks of other groups, or size the exchange wrong)."""
    assert [group_ranks[r]["group"] for r in range(4)] == [
        [0, 1],
        [0, 1],
        [2, 3],
        [2, 3],
    ]
    for index, failing, off in ((0, 1, (0, 1)), (1, 2, (2, 3))):
        results = [group_ranks[r]["results"][index] for r in range(4)]
        assert [r["raised"] for r in results] == [None] * 4
        assert [r["on"] for r in results] == [r not in off for r in range(4)]
        where = f"on every TP rank (failed: rank {failing % 2} of 2)"
        for rank, result in enumerate(results):
            [(level, line)] = result["lines"]
            if rank in off:
                assert level == "ERROR" and where in line
            else:
                assert level == "INFO" and line.endswith(" (all 2 TP ranks passed).")
