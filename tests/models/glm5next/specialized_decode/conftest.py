# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prints every kpool fuzz loop's outcome (cases, seed, mismatches) at the
end of the run."""

from kpool_fuzz import FUZZ_REPORT


def pytest_terminal_summary(terminalreporter):
    if FUZZ_REPORT:
        terminalreporter.section("kpool fuzz against stock")
        for line in FUZZ_REPORT:
            terminalreporter.write_line(line)
