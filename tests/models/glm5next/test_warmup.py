# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``warmup.py``: the stage's JIT warmup entry, which turns the stage on only
once its kernels compiled and (unless "off") passed the self-check, and
otherwise leaves it off and says so ("strict": raises) (CPU; the self-check
itself is ``specialized_decode/test_self_check.py``'s)."""

import logging
import re

import pytest
import torch
from kpool_harness import Step, make_inputs

from vllm.models.glm5next.nvidia.specialized_decode import self_check, warmup
from vllm.models.glm5next.nvidia.specialized_decode.constants import (
    SELF_CHECK_SEED_ENV,
)
from vllm.models.glm5next.nvidia.specialized_decode.update_kernel import UPDATE

ENTRY_KEY = "dsa_kpool"


@pytest.fixture
def model(engine):
    """A model's installed stage, its warmup not run yet, and a decode step."""
    return engine(make_inputs(Step([1, 1], [150, 180], seed=80)), warm=False)


def entry(model, mode):
    return warmup.KpoolWarmup(model.stage, [model.attention], mode)


def warmup_lines(vllm_log):
    return [r for r in vllm_log.records if r.name == warmup.__name__]


def test_warmup_entry(model, spies):
    """The registry protocol: one key per stage; compiling it compiles the
    variants ``warmup_keys`` derives for the layers, then turns the stage on
    ("off": no self-check)."""
    warm = entry(model, "off")
    assert warm.get_warmup_keys() == [(ENTRY_KEY, id(model.stage))]
    assert not model.stage.warmed and not model.stage.planned()
    warm.compile_many(warm.get_warmup_keys())
    assert model.stage.warmed
    derived = warmup.warmup_keys(model.stage, [model.attention])
    assert set().union(*spies.compiled.values()) == {key for _, key in derived}
    assert warmup.POSITIONS_DTYPE is torch.int64


@pytest.mark.parametrize(
    "mode, problem, warmed, level",
    [
        ("on", None, True, logging.INFO),
        ("on", "UpcastLogitsKernel case 3", False, logging.ERROR),
        ("strict", None, True, logging.INFO),
        ("strict", "UpcastLogitsKernel case 3", None, None),
    ],
)
def test_warmup_self_check(
    monkeypatch, model, spies, vllm_log, mode, problem, warmed, level
):
    """The self-check after the compiles (its answer given here): a failure
    keeps the stage off with one error line naming the seed, or raises."""
    seen = []

    def check(keys, seed, device):
        seen.append((len(keys), seed, device))
        return problem

    monkeypatch.setattr(self_check, "check", check)
    monkeypatch.setenv(SELF_CHECK_SEED_ENV, "77")
    failed = (
        f"GLM-5-Next specialized decode: self-check failed, {problem}; dsa_kpool "
        "stays off and the decode runs stock (replay with "
        f"{SELF_CHECK_SEED_ENV}=77)."
    )
    if warmed is None:
        with pytest.raises(RuntimeError) as error:
            entry(model, mode).compile_many([(ENTRY_KEY, id(model.stage))])
        assert str(error.value) == failed and not model.stage.warmed
        return
    entry(model, mode).compile_many([(ENTRY_KEY, id(model.stage))])
    variants = sum(len(keys) for keys in spies.compiled.values())
    assert model.stage.warmed is warmed
    assert seen == [(variants, 77, torch.device("cpu"))]
    [record] = warmup_lines(vllm_log)
    assert record.levelno == level
    if problem:
        assert record.getMessage() == failed
    else:
        assert re.fullmatch(
            "GLM-5-Next specialized decode: self-check passed: "
            rf"{variants} kernel variants x {self_check.CASES} cases, seed 77, "
            r"\d+\.\d\d s\.",
            record.getMessage(),
        )


def test_self_check_seed(monkeypatch, model, vllm_log):
    """Without a seed to replay, a fresh 31-bit one, printed on failure."""
    seeds, bits = [], []
    monkeypatch.setattr(
        self_check, "check", lambda keys, seed, device: seeds.append(seed) or "bad"
    )
    monkeypatch.delenv(SELF_CHECK_SEED_ENV, raising=False)
    monkeypatch.setattr(warmup.secrets, "randbits", lambda n: bits.append(n) or 12345)
    entry(model, "on").compile_many([(ENTRY_KEY, id(model.stage))])
    assert bits == [31] and seeds == [12345] and not model.stage.warmed
    [record] = warmup_lines(vllm_log)
    assert record.getMessage().endswith(f"(replay with {SELF_CHECK_SEED_ENV}=12345).")


@pytest.mark.parametrize("mode", ["on", "off"])
def test_failed_warmup_leaves_the_stage_off(monkeypatch, model, vllm_log, mode):
    """A warmup that raises (here: a compile) leaves the stage off, logs an
    error with the traceback saying so, and the steps run stock."""

    def fail(compile_key):
        raise RuntimeError("no ptxas")

    monkeypatch.setattr(UPDATE, "compile", fail)
    entry(model, mode).compile_many([(ENTRY_KEY, id(model.stage))])
    assert not model.stage.warmed
    [record] = warmup_lines(vllm_log)
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert record.getMessage() == (
        "GLM-5-Next specialized decode: warmup failed (no ptxas); dsa_kpool stays "
        "off and the decode runs stock."
    )
    got = model.run(model.inputs)
    assert got.routes == ["indexer:expand", "stock:convert"]


def test_failed_warmup_strict_raises(monkeypatch, model):
    def fail(compile_key):
        raise RuntimeError("no ptxas")

    monkeypatch.setattr(UPDATE, "compile", fail)
    with pytest.raises(RuntimeError, match="no ptxas"):
        entry(model, "strict").compile_many([(ENTRY_KEY, id(model.stage))])
    assert not model.stage.warmed


def _select_stage(max_rows: int):
    from types import SimpleNamespace

    pool_buffer = torch.zeros((max_rows, 2048), dtype=torch.int32)
    return SimpleNamespace(pool_buffer=pool_buffer, max_rows=max_rows, sms=132)


@pytest.mark.parametrize("width", [65536, 262144])
@pytest.mark.parametrize("max_rows", [8, 70])
def test_select_cases_are_each_row_count_of_one_wave(width, max_rows):
    """Every row count from 1 to the stage's rows whose clusters fit one wave
    (``LayerStep.select`` runs no other), at ``max_pool_len``, writing the
    stage's pool buffer: one wave is 1-66 rows at 65536 pools, 1-16 at
    262144."""
    from types import SimpleNamespace

    stage = _select_stage(max_rows)
    indexer = SimpleNamespace(max_pool_len=width, topk_tokens=2048)
    cases = warmup.select_cases(stage, indexer, torch.float32)
    wave = 66 if width == 65536 else 16
    assert [case.logits.shape[0] for case in cases] == list(
        range(1, min(max_rows, wave) + 1)
    )
    for case in cases:
        rows = case.logits.shape[0]
        assert case.logits.shape == (rows, width) and case.k == 512
        assert case.ends.shape == (rows,) and case.ends.dtype is torch.int32
        assert case.out.data_ptr() == stage.pool_buffer.data_ptr()
        assert case.out.shape == (rows, 512)
    del indexer.max_pool_len  # no logits width: nothing compiles, stock runs
    assert warmup.select_cases(stage, indexer, torch.float32) == []


def test_layer_step_selects_up_to_the_stages_rows(monkeypatch):
    """The select takes a step of exactly the stage's rows, not one more."""
    from types import SimpleNamespace

    from vllm.models.glm5next.nvidia.specialized_decode import stage as stage_module

    taken = []
    monkeypatch.setattr(
        stage_module.SELECT, "run_if_ready", lambda args: taken.append(args) or args
    )
    stage = SimpleNamespace(**vars(_select_stage(max_rows=4)), select=True)
    step = stage_module.LayerStep(stage, remap=object(), k=512)
    ends = torch.zeros(5, dtype=torch.int32)
    assert step.select(torch.zeros((4, 65536)), ends[:4]) and step.selected
    assert taken[-1].out.shape == (4, 512)
    step = stage_module.LayerStep(stage, remap=object(), k=512)
    assert not step.select(torch.zeros((5, 65536)), ends) and not step.selected
    assert len(taken) == 1
