# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU fuzz plumbing of the kpool kernel tests: a fresh seed every run
(``KPOOL_SEED`` replays one; case ``i`` draws from ``seed + i``), the cases
a loop runs (``KPOOL_FUZZ_CASES``), the byte comparison of whole buffers,
and the loops' outcomes the conftest prints at the end of the run. (The
tests are marked ``gpu``: the root conftest skips them without CUDA.)"""

import os
import random
import secrets
from collections.abc import Callable

import torch
from draws import about

FUZZ_REPORT: list[str] = []


def fuzz_seed() -> int:
    return int(os.environ.get("KPOOL_SEED") or secrets.randbits(31))


def fuzz_cases(default: int) -> int:
    return int(os.environ.get("KPOOL_FUZZ_CASES") or default)


def report(name: str, cases: int, seed: int, failures: list[str]) -> None:
    """Records one loop's outcome and fails the test on any mismatch."""
    FUZZ_REPORT.append(
        f"{name}: {cases} cases, seed {seed}, {len(failures)} mismatches"
    )
    assert not failures, (
        f"{name}: {len(failures)} of {cases} cases differ (replay one with "
        "KPOOL_SEED=<its seed> KPOOL_FUZZ_CASES=1):\n" + "\n".join(failures[:10])
    )


def fuzz(
    name: str,
    default_cases: int,
    check: Callable[[random.Random, torch.Generator], str | None],
    device: str = "cuda",
) -> None:
    """Runs ``check`` (what differed, or None) on each case's own seed."""
    seed, cases = fuzz_seed(), fuzz_cases(default_cases)
    failures = []
    for i in range(cases):
        rng = random.Random(seed + i)
        gen = torch.Generator(device).manual_seed(seed + i)
        problem = check(rng, gen)
        if problem is not None:
            failures.append(f"seed {seed + i}: {problem}")
    report(name, cases, seed, failures)


def differs(expected, written) -> str | None:
    """Where the ``written`` buffers differ from the ``expected`` ones, byte
    for byte over each whole buffer, or None."""
    for i, (want, got) in enumerate(zip(expected, written, strict=True)):
        a = want.reshape(-1).view(torch.uint8)
        b = got.reshape(-1).view(torch.uint8)
        if not torch.equal(a, b):
            where = (a != b).nonzero().view(-1)
            return (
                f"buffer {i} {list(got.shape)}: {where.numel()} bytes differ, "
                f"first at byte {int(where[0])} of {a.numel()}"
            )
    return None


def launch_case(kernel, case) -> str | None:
    """Launches ``case`` through ``kernel``'s own launch (the public
    functions': compiled on first use) and compares every buffer it may
    write with stock's; the launch returns ``out`` where there is one."""
    got = kernel(**case.arguments)
    torch.cuda.synchronize()
    problem = differs(case.expected, case.written)
    out = case.arguments.get("out")
    if problem is None and out is not None and got is not out:
        problem = "the launch did not return out"
    return None if problem is None else f"{about(case)}: {problem}"


def stage_with(kernel, keys, device="cuda", mx_scales=True):
    """A ``KpoolStage`` of no layers whose warmup compiled ``keys`` of
    ``kernel``; each launch of one is recorded in ``stage.launched``."""
    from vllm.models.glm5next.nvidia.specialized_decode.runtime.stage import (
        KpoolStage,
    )

    stage = KpoolStage([], 8, device, mx_scales=mx_scales)
    stage.launched = []

    def recorded(key, executor):
        def launch(*args):
            stage.launched.append(key)
            executor(*args)

        return launch

    stage.executors = {key: recorded(key, kernel.executor(key)) for key in keys}
    return stage
