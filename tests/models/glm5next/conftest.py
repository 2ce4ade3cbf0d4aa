# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prints each indexer step run's outcome (steps, layers, seed, mismatches)
at the end of the test session."""

import sys


def pytest_terminal_summary(terminalreporter):
    steps = sys.modules.get("indexer_steps")
    if steps is not None and steps.REPORTS:
        terminalreporter.section("indexer steps: stage against stock")
        for line in steps.REPORTS:
            terminalreporter.write_line(line)
