# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU fuzz plumbing of the kpool kernel tests: fresh seeds, the CUDA skip,
and the per-loop outcomes the conftest prints at the end of the run."""

import os
import secrets

import pytest
import torch

FUZZ_REPORT: list[str] = []


def needs_cuda():
    return pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (the GPU tier: tools/kernel_env/gpu_tier.sh)",
    )


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
