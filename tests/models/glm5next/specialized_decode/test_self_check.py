# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The warmup self-check (``self_check.check``): each compile key's
executor runs ``CASES`` cases of ``cases.py`` in the key's layout and the
buffers each case lists as written are compared, byte for byte, with its
stock twin's; the first mismatch comes back as "kernel case N (seed S):
what" (the stage's warmup then keeps the stage off).

CPU (DeepGEMM's scores the step simulator's stand-in, ``cpu_deep_gemm``):
executor doubles over the real cases (the stock expansion itself; the
case's expected bytes copied, with one byte of one buffer changed in one
case, or with its zeros left out; one that writes nothing), for every
kernel and every buffer it writes; the printed seed draws the failing
case's inputs again, byte for byte; a case that derives another key or
that the rule refuses is reported, not launched; ``poisoned`` buffers
start as random bytes. GPU: the kernels of a GLM-5-Next deployment's keys
pass on this GPU, within the start-up budget, and a corrupted one is
caught with its seed."""

import contextlib
import copy
import functools
import random
import re
import sys
import time
from pathlib import Path
from unittest import mock

import draws
import pytest
import torch
from rule_edges import KEYS, SEEDS, SMS, allow_cpu, cpu_deep_gemm

from vllm.model_executor.warmup.jit_warmup import WarmupChoices
from vllm.models.glm5next.nvidia.ops import kpool_compress
from vllm.models.glm5next.nvidia.ops.kpool_compress import (
    expand_pools_and_append_tail,
)
from vllm.models.glm5next.nvidia.specialized_decode import cases, self_check
from vllm.models.glm5next.nvidia.specialized_decode.constants import POOL
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.expand.launch import (
    EXPAND,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.remap.launch import (
    REMAP,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.scores.launch import (
    SCORES,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select.kernel import (
    CAPACITIES,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select.launch import (
    CLUSTERS,
    SELECT,
    sm_count,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.upcast.launch import (
    UPCAST,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.update.launch import (
    UPDATE,
)

CPU = torch.device("cpu")
# indexer_sim (the step simulator, one directory up) for its stock twins.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def check(executors: dict, seed: int, cases: int, device=CPU) -> str | None:
    """``self_check.check`` with ``cases`` cases of each key."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(self_check, "CASES", cases)
        return self_check.check(executors, seed, device)


# The expansion of lengths in their own dtype (the stock call the case's
# expected bytes come from).
KEY = EXPAND.dispatch(groups=100, seq_lens_dtype=torch.int64, int32_lengths=False)


def stock_expansion(pool_ids, seq_lens, out, seq_offset):
    """The expansion's executor as the stock function (its arguments are
    ``ExpandKernel.spec``'s)."""
    expand_pools_and_append_tail(
        pool_ids, seq_lens[: out.shape[0]], POOL, seq_offset=seq_offset, out=out
    )


def changed(pool_ids, seq_lens, out, seq_offset):
    """The stock expansion with one bit of its last row flipped."""
    stock_expansion(pool_ids, seq_lens, out, seq_offset)
    out[-1:, :1].bitwise_xor_(1)


# Every case the self-check drew in this session, as drawn (before any
# launch), by what decides it: the drawer, the key, the states of ``rng``
# and ``gen``, the drawer's other arguments and the scales stock writes.
# Several tests draw the same cases (a base case's seed, the select's 64
# cases), and a case of many rows takes seconds of Triton's interpreter
# (the remap's and the expansion's stock twins). Drawing is deterministic:
# the replay test checks that with fresh draws (``Drawn.fresh``).
DRAWN: dict = {}


def reusing(draw, fresh=lambda: False):
    """``draw``, a case drawn before in this session (a copy of it, the
    generators left as the draw left them) unless ``fresh()``."""

    def drawn(rng, gen, key, **extra):
        scales = kpool_compress.mqa_logits_use_mx_scales()
        state = (rng.getstate(), gen.device, gen.get_state().numpy().tobytes())
        at = (draw, key, state, tuple(sorted(extra.items())), scales)
        if at in DRAWN and not fresh():
            case, rng_after, gen_after = DRAWN[at]
            rng.setstate(rng_after)
            gen.set_state(gen_after)
            return copy.deepcopy(case)  # views of one storage stay one
        case = draw(rng, gen, key, **extra)
        DRAWN[at] = (copy.deepcopy(case), rng.getstate(), gen.get_state())
        return case

    return drawn


@contextlib.contextmanager
def stock_on_cpu():
    """Stock's update writes the scales of ``KEYS[UPDATE]`` (as a process
    whose stage has them) and DeepGEMM's scores are ``cpu_deep_gemm``."""
    with (
        mock.patch.object(cases, "deep_gemm_scores", cpu_deep_gemm),
        draws.stock_scales(KEYS[UPDATE]["mx_scales"]),
    ):
        yield


@pytest.fixture
def on_cpu(monkeypatch):
    """The rules take CPU tensors, the SMs are ``SMS``, stock is
    ``stock_on_cpu``'s; the self-check reuses the cases drawn before
    (``DRAWN``)."""
    monkeypatch.setattr(self_check, "sm_count", lambda index: SMS)
    reused = {kernel: reusing(draw) for kernel, draw in cases.CASES.items()}
    monkeypatch.setattr(self_check, "DRAWS", reused)
    with allow_cpu(), stock_on_cpu():
        yield


def test_stock_bytes_pass(on_cpu):
    """An executor that writes stock's bytes passes every case."""
    assert check({KEY: stock_expansion}, 20, 6) is None


class Drawn:
    """The cases the self-check draws, recorded as the real drawers return
    them (``self_check.DRAWS`` wrapped): each case, its arguments' bytes and
    its written buffers as drawn (before any launch). ``stock()`` is an
    executor double that leaves the current case's buffers as stock does."""

    def __init__(self, monkeypatch):
        self.cases: list[cases.Case] = []
        self.inputs: list[dict] = []
        self.before: list[list[torch.Tensor]] = []
        # True: every case drawn anew, none from ``DRAWN``.
        self.fresh = False
        wrapped = {kernel: self.recorder(draw) for kernel, draw in cases.CASES.items()}
        monkeypatch.setattr(self_check, "DRAWS", wrapped)

    def recorder(self, draw):
        draw = reusing(draw, lambda: self.fresh)

        def drawn(*args, **kwargs):
            case = draw(*args, **kwargs)
            self.cases.append(case)
            self.inputs.append({n: snapshot(v) for n, v in case.arguments.items()})
            self.before.append([w.clone() for w in case.written])
            return case

        return drawn

    def stock(self, corrupt=None):
        """Copies each expected buffer into its written one; then
        ``corrupt(case number, case)`` changes what it wants."""

        def run(*args):
            number, case = len(self.cases) - 1, self.cases[-1]
            for got, want in zip(case.written, case.expected, strict=True):
                got.copy_(want)
            if corrupt is not None:
                corrupt(number, case)

        return run


def snapshot(value):
    """A tensor as (dtype, shape, strides, offset, its whole storage's
    bytes), a tuple (the scores' query) as a list of its items' snapshots;
    any other value as it is."""
    if isinstance(value, tuple):
        return [snapshot(item) for item in value]
    if not isinstance(value, torch.Tensor):
        return value
    storage = torch.empty(0, dtype=torch.uint8).set_(value.untyped_storage())
    layout = (value.dtype, value.shape, value.stride(), value.storage_offset())
    return (*layout, storage.clone())


def same(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, tuple):
        return a[:4] == b[:4] and torch.equal(a[4], b[4])
    return a == b


@pytest.fixture
def drawn(on_cpu, monkeypatch):
    return Drawn(monkeypatch)


def flip_byte(buffer: torch.Tensor, at: int) -> None:
    """One bit of byte ``at`` (negative: from the end) of ``buffer``."""
    buffer.view(torch.uint8).view(-1)[at : at + 1 or None].bitwise_xor_(1)


def corrupt_last_byte(number, case):
    flip_byte(case.written[0], -1)


# (kernel, buffer): every buffer of every kernel; the update writes its
# cache and its tail ring, the remap its output and its counts.
BUFFERS = [(UPDATE, 0), (UPDATE, 1), (EXPAND, 0), (REMAP, 0), (REMAP, 1)]
BUFFERS += [(UPCAST, 0), (SELECT, 0), (SCORES, 0)]


@pytest.mark.parametrize(
    "kernel, buffer", BUFFERS, ids=[f"{type(k).__name__}-{b}" for k, b in BUFFERS]
)
def test_one_byte_of_one_buffer_is_caught(drawn, kernel, buffer):
    """An executor that writes stock's bytes but one, in one of the buffers
    it writes (the others right), is reported with the case's number and
    seed; the same executor without the change passes."""
    key, seed = kernel.dispatch(**KEYS[kernel]), SEEDS[kernel]
    assert check({key: drawn.stock()}, seed, 1) is None

    def corrupt(number, case):
        flip_byte(case.written[buffer], -1)

    problem = check({key: drawn.stock(corrupt)}, seed, 1)
    name = type(kernel).__name__
    assert problem == f"{name} case 0 (seed {seed}) differs from stock: {key}"


@pytest.mark.parametrize("at", [0, 37, self_check.CASES - 1])
def test_one_case_of_all_is_caught(drawn, at):
    """Of the select's ``CASES`` cases (the default count), only case ``at``
    has one byte changed, in the middle of its output: the report names
    that case and its seed."""
    key = SELECT.dispatch(**KEYS[SELECT])

    def corrupt(number, case):
        if number == at:
            flip_byte(case.written[0], case.written[0].numel() * 2)

    problem = self_check.check({key: drawn.stock(corrupt)}, 5, CPU)
    assert len(drawn.cases) == self_check.CASES
    want = f"SelectKernel case {at} (seed {5 + at}) differs from stock: {key}"
    assert problem == want


REPLAYS = [(SELECT, 41), (EXPAND, 2), (UPDATE, 1), (REMAP, 1), (UPCAST, 6)]
REPLAYS += [(SCORES, 2)]


@pytest.mark.parametrize(
    "kernel, at", REPLAYS, ids=[type(k).__name__ for k, _ in REPLAYS]
)
def test_the_printed_seed_replays_the_case(drawn, kernel, at):
    """The seed a failure prints draws the failing case again: the
    self-check run with that seed reports it as case 0, its inputs the same
    bytes (each tensor's whole storage) and its expected bytes the same."""
    key, seed = kernel.dispatch(**KEYS[kernel]), SEEDS[kernel]

    def corrupt(number, case):
        if number == at:
            flip_byte(case.written[0], -1)

    problem = check({key: drawn.stock(corrupt)}, seed, at + 1)
    pattern = rf"\w+ case {at} \(seed (\d+)\) differs from stock: .+"
    match = re.fullmatch(pattern, problem or "")
    assert match, problem
    failing, expected = drawn.inputs[at], drawn.cases[at].expected
    stock = drawn.stock(corrupt_last_byte)
    drawn.fresh = True  # the replay draws anew
    replay = check({key: stock}, int(match[1]), 1)
    assert replay == problem.replace(f"case {at} ", "case 0 ")
    again = drawn.inputs[-1]
    assert [n for n in failing if not same(failing[n], again[n])] == []
    pairs = zip(expected, drawn.cases[-1].expected, strict=True)
    assert all(same(snapshot(a), snapshot(b)) for a, b in pairs)


def skips_zeros(drawn):
    """An executor that writes stock's bytes except the values equal to
    zero (in each buffer's own dtype), which it leaves as they were."""

    def run(*args):
        case = drawn.cases[-1]
        for got, want in zip(case.written, case.expected, strict=True):
            bits = BITS[got.element_size()]
            kept = torch.where(want != 0, want.view(bits), got.view(bits))
            got.view(bits).copy_(kept)

    return run


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def zeros_over_other_bytes(case, before) -> int:
    """The values equal to zero that stock writes over other bytes."""
    found = 0
    for want, old in zip(case.expected, before, strict=True):
        bits = BITS[want.element_size()]
        found += int(((want == 0) & (want.view(bits) != old.view(bits))).sum())
    return found


@pytest.mark.parametrize(
    "kernel", [UPDATE, EXPAND, REMAP, SELECT, SCORES], ids=lambda k: type(k).__name__
)
def test_a_kernel_that_skips_writing_zeros_is_caught(drawn, kernel):
    """An executor that writes stock's bytes but leaves out the values
    equal to zero: of seeds 0, 1, ... (one case each, in the base case's
    key) until one where stock writes zeros over other bytes, it differs
    from stock exactly there."""
    key = kernel.dispatch(**KEYS[kernel])
    name = type(kernel).__name__
    for seed in range(20):
        problem = check({key: skips_zeros(drawn)}, seed, 1)
        if zeros_over_other_bytes(drawn.cases[-1], drawn.before[-1]):
            break
        assert problem is None, seed
    else:
        pytest.fail("stock wrote no zero over other bytes in 20 cases")
    assert problem == f"{name} case 0 (seed {seed}) differs from stock: {key}"


@pytest.mark.parametrize(
    "kernel", [UPDATE, EXPAND, REMAP, SELECT, SCORES], ids=lambda k: type(k).__name__
)
def test_each_written_buffer_has_expected_bytes_of_its_own(kernel):
    """In each kernel's base case every buffer the case lists as written has
    its expected bytes in storage of their own, and they differ from the
    buffer's: an executor that writes nothing cannot pass, whichever
    buffer it is."""
    extra = {"sms": SMS} if kernel is SELECT else {}
    seed, key = SEEDS[kernel], kernel.dispatch(**KEYS[kernel])
    gen = torch.Generator().manual_seed(seed)
    with stock_on_cpu():
        case = cases.CASES[kernel](random.Random(seed), gen, key, **extra)
    assert len(case.written) == len(case.expected)
    for got, want in zip(case.written, case.expected, strict=True):
        ptr = want.untyped_storage().data_ptr()
        assert ptr != got.untyped_storage().data_ptr()
        assert not torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def stock_twin(key):
    """An executor double that computes what ``key``'s kernel writes by its
    stock twin, from the arguments ``spec`` derives (``indexer_sim.twin``,
    the CPU step simulator's: written from the launch arguments, not from
    ``cases.py``)."""
    from indexer_sim import kernel_name, twin

    return functools.partial(twin, kernel_name(key), key)


@pytest.mark.parametrize(
    "kernel", [UPDATE, EXPAND, REMAP, SELECT, SCORES], ids=lambda k: type(k).__name__
)
def test_stock_twins_on_the_launch_arguments_pass(on_cpu, kernel):
    """Each case's expected bytes are what the stock twin writes when it is
    handed the arguments the kernel is launched with (two cases of the base
    case's key and seed): the cases' reference is stock's, and ``spec``
    hands the kernel the case's buffers. (Not the upcast: the simulator's
    twin writes no column past the width, where a row end in the padding
    has stock convert too.)"""
    key = kernel.dispatch(**KEYS[kernel])
    assert check({key: stock_twin(key)}, SEEDS[kernel], 2) is None


def test_special_values_are_the_specials_bit_for_bit():
    """``special_values``: each of ``SPECIALS`` once, as its FP32 bits and
    as the upper half of them in BF16 (written out here from the integers)."""
    fp32 = cases.special_values(torch.float32, CPU).view(torch.int32).tolist()
    assert fp32 == [w - (1 << 32) if w >= 1 << 31 else w for w in cases.SPECIALS]
    bf16 = cases.special_values(torch.bfloat16, CPU).view(torch.int16).tolist()
    upper = [w >> 16 for w in cases.SPECIALS]
    assert bf16 == [h - (1 << 16) if h >= 1 << 15 else h for h in upper]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_specials_draws_every_special(dtype):
    """``specials`` at rate 1 over 4096 values: every one of
    ``special_values``, and nothing else."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    gen = torch.Generator().manual_seed(0)
    drawn = cases.specials(torch.ones(4096, dtype=dtype), 1.0, gen).view(bits)
    table = cases.special_values(dtype, CPU).view(bits)
    assert set(drawn.tolist()) == set(table.tolist())


def floats(*bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize(
    "row, end, k, want",
    [
        # -0.0 below +0.0: +0.0 wins though it comes later.
        pytest.param((0x80000000, 0x00000000, 0x80000000), 3, 1, [1], id="zeros"),
        # The smallest key (-NaN, all bits set) still beats the columns past
        # the end (here +inf): ties to the lower columns.
        pytest.param((0xFFFFFFFF,) * 3 + (0x7F800000,), 3, 2, [0, 1], id="past-end"),
    ],
)
def test_select_reference_at_its_order_edges(row, end, k, want):
    """``select_reference`` (the select's expected rows) at the ends of its
    order, written out here."""
    ends = torch.tensor([end], dtype=torch.int32)
    got = cases.select_reference(floats(*row), ends, k)
    assert got.tolist() == [want]


def test_outputs_start_as_random_bytes():
    """``poisoned``: every byte value, none much more often than another;
    another draw for the next one."""
    gen = torch.Generator().manual_seed(3)
    first = cases.poisoned((4096, 4), torch.int32, gen).view(torch.uint8).view(-1)
    counts = torch.bincount(first.long(), minlength=256)
    assert counts.min() > 0 and counts.max() < 3 * first.numel() // 256
    second = cases.poisoned((4096, 4), torch.int32, gen).view(torch.uint8).view(-1)
    assert (first != second).float().mean() > 0.9


def test_cases_of_another_key_are_reported_not_launched(drawn):
    """A select key no rows and width derive (16 CTAs of the smallest
    capacity): its cases derive another key, and the self-check reports
    that without launching the executor."""
    key = SELECT.CompileKey(512, torch.float32, CLUSTERS[-1], CAPACITIES[0])
    launched = []
    problem = check({key: lambda *a: launched.append(a)}, 3, 1)
    [case] = drawn.cases
    with allow_cpu():
        derived = SELECT.spec(**case.arguments)[0]
    assert derived != key
    assert problem == f"SelectKernel case 0 (seed 3): derives {derived}, not {key}"
    assert launched == []


@pytest.mark.parametrize(
    "kernel", [UPDATE, EXPAND, REMAP, SELECT, SCORES], ids=lambda k: type(k).__name__
)
def test_an_executor_that_writes_nothing_is_caught(on_cpu, kernel):
    """Every kernel's cases compare what it writes: an executor that
    writes nothing differs from stock (the base case's seed: rows)."""
    key = kernel.dispatch(**KEYS[kernel])
    problem = check({key: lambda *args: None}, SEEDS[kernel], 1)
    name = type(kernel).__name__
    assert problem == f"{name} case 0 (seed {SEEDS[kernel]}) differs from stock: {key}"


def test_a_refused_case_is_reported():
    """A case the kernel's rule refuses (here: CPU tensors, which the real
    device check refuses) is reported, not launched."""
    problem = check({KEY: changed}, 20, 1)
    assert problem == (
        "ExpandKernel case 0 (seed 20): refused: pool_ids: expected a CUDA "
        "tensor, got a tensor on cpu"
    )


# --- GPU ------------------------------------------------------------------------------


def deployment_keys(sms: int) -> list:
    """(kernel, key) of a GLM-5-Next deployment's variants: the update of an
    8-token ring and 64-token pages (both scale formats), the decode
    expansion, the fused remap with and without counts, the upcast, the
    select of 1-64 rows of 65536 pools (FP32 and BF16 logits), the scores
    of the 16 heads (views of vLLM's padded 32) at each next_n DeepGEMM's
    SM90 kernel takes, of 64-pool pages."""
    update = KEYS[UPDATE]
    keys = [
        (UPDATE, UPDATE.dispatch(**update | dict(mx_scales=mx))) for mx in (True, False)
    ]
    keys.append((EXPAND, EXPAND.dispatch(**KEYS[EXPAND])))
    remap = KEYS[REMAP]
    keys += [(REMAP, REMAP.dispatch(**remap | dict(counts=c))) for c in (True, False)]
    keys.append((UPCAST, UPCAST.dispatch()))
    for dtype in (torch.float32, torch.bfloat16):
        values = dict(max_rows=64, k=512, dtype=dtype, width=65536, sms=sms)
        keys += [(SELECT, key) for key in SELECT.get_warmup_keys(**values)]
    values = dict(heads=16, next_n=WarmupChoices(1, 2, 4), block=64)
    keys += [(SCORES, key) for key in SCORES.get_warmup_keys(**values)]
    return keys


def check_deployments(executors: dict, seed: int, device) -> str | None:
    """``self_check.check`` as deployments run it: each scale format's
    update keys with stock writing that format (a process has one), every
    other key once, with the first."""
    others = {
        k: e for k, e in executors.items() if not isinstance(k, UPDATE.CompileKey)
    }
    for mx in (True, False):
        updates = {
            k: e
            for k, e in executors.items()
            if isinstance(k, UPDATE.CompileKey) and k.mx_scales == mx
        }
        with draws.stock_scales(mx):
            problem = self_check.check(updates | others, seed, device)
        if problem is not None:
            return problem
        others = {}
    return None


@pytest.mark.gpu
def test_self_check_on_this_gpu():
    """Every variant of a deployment's keys passes ``CASES`` cases on this
    GPU (the time is what start-up pays, printed); a remap whose last
    output byte is changed is caught, with a seed that replays it."""
    device = torch.device("cuda", torch.cuda.current_device())
    keys = deployment_keys(sm_count(device.index))
    executors = {key: kernel.executor(key) for kernel, key in keys}
    with pytest.MonkeyPatch.context() as patch:  # the stock kernels compile
        patch.setattr(self_check, "CASES", 2)
        check_deployments(executors, 0, device)
    torch.cuda.synchronize()
    started = time.perf_counter()
    problem = check_deployments(executors, 99, device)
    elapsed = time.perf_counter() - started
    print(
        f"self-check: {len(executors)} variants x {self_check.CASES} cases, "
        f"{elapsed:.3f} s, {problem or 'all equal'}"
    )
    assert problem is None
    remap = next(key for kernel, key in keys if kernel is REMAP)
    run = executors[remap]

    def corrupted(*args):
        run(*args)
        args[4].view(-1)[-1:] += 1  # out's last element

    problem = check_deployments(executors | {remap: corrupted}, 7, device)
    print(f"self-check with a corrupted remap: {problem}")
    match = re.fullmatch(
        r"RemapKernel case (\d+) \(seed (\d+)\) differs .*", problem or ""
    )
    assert match and int(match[2]) == 7 + int(match[1])
