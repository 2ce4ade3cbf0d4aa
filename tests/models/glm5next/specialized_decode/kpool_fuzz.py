# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU fuzz plumbing of the kpool kernel tests: fresh seeds, poisoned
outputs, byte comparisons, and the per-loop outcomes the conftest prints at
the end of the run. (The tests are marked ``gpu``: the root conftest skips
them without CUDA.)"""

import os
import random
import secrets
from collections.abc import Callable

import torch

FUZZ_REPORT: list[str] = []


def fuzz_seed() -> int:
    """``KPOOL_SEED`` to replay a run, else a fresh seed every run."""
    return int(os.environ.get("KPOOL_SEED") or secrets.randbits(31))


def fuzz_cases(default: int) -> int:
    return int(os.environ.get("KPOOL_FUZZ_CASES") or default)


def report(kernel: str, cases: int, seed: int, failures: list[str]) -> None:
    """Records one fuzz loop's outcome and fails the test on any mismatch."""
    FUZZ_REPORT.append(
        f"{kernel}: {cases} cases, seed {seed}, {len(failures)} mismatches"
    )
    assert not failures, (
        f"{kernel}: {len(failures)} of {cases} cases differ from stock "
        f"(replay with KPOOL_SEED={seed}):\n" + "\n".join(failures[:10])
    )


def fuzz(
    kernel: str,
    default_cases: int,
    case: Callable[[random.Random, torch.Generator], str | None],
    device: str = "cuda",
) -> None:
    """The fuzz loop every kernel test runs: case ``i`` draws from its own
    seed (``seed + i``, printed on failure, ``KPOOL_SEED`` replays), returns
    what differed from stock or None; the outcome goes to the run's summary."""
    seed, cases = fuzz_seed(), fuzz_cases(default_cases)
    failures = []
    for i in range(cases):
        rng = random.Random(seed + i)
        gen = torch.Generator(device).manual_seed(seed + i)
        problem = case(rng, gen)
        if problem is not None:
            failures.append(f"seed {seed + i}: {problem}")
    report(kernel, cases, seed, failures)


def poison(shape, dtype, gen) -> torch.Tensor:
    """Random bits of ``dtype`` (outputs are filled with it before a run, so
    an unwritten byte cannot pass as a written one)."""
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    bits = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=gen, device=gen.device
    )
    return bits.view(dtype).view(shape)


def differs(name: str, expected: torch.Tensor, got: torch.Tensor) -> str | None:
    """Where ``got`` differs from ``expected``, byte for byte, or None."""
    a, b = expected.contiguous().view(torch.uint8), got.contiguous().view(torch.uint8)
    if torch.equal(a, b):
        return None
    where = (a != b).nonzero()
    return f"{name}: {where.shape[0]} bytes differ, first at {where[0].tolist()}"
