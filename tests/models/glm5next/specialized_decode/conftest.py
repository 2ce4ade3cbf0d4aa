# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prints every kpool fuzz loop's outcome (cases, seed, mismatches) at the
end of the run, and keeps each test's warmups from ending the next tests'
lazy compiles."""

import pytest
from kpool_fuzz import FUZZ_REPORT


def pytest_terminal_summary(terminalreporter):
    if FUZZ_REPORT:
        terminalreporter.section("kpool fuzz against stock")
        for line in FUZZ_REPORT:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _isolated_warmups(monkeypatch):
    """A test that warms up (which ends lazy compiles in the process) must
    not turn the next tests' first launches into errors."""
    try:
        from vllm.models.glm5next.nvidia.specialized_decode import launch
    except ImportError:
        yield
        return
    monkeypatch.setattr(launch, "_warmed_up", launch._warmed_up)
    monkeypatch.setattr(launch, "_warmups_running", launch._warmups_running)
    yield
