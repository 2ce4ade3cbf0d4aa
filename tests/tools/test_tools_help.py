# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every tool under ``tools/`` (each Python script and shell script, those of
``tools/kernel_env`` included; not the packages' ``__init__.py`` nor the
``env.sh.in`` template) prints its usage on ``--help`` and exits 0, doing
nothing else: no output of a run (``guard_table.py``'s table), nothing
written under ``$OUT``, no import of what only its run needs (CPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = sorted(
    path.relative_to(REPO).as_posix()
    for path in [*REPO.glob("tools/**/*.py"), *REPO.glob("tools/**/*.sh")]
    if path.name != "__init__.py"
)


def test_the_tools_are_found():
    names = {Path(tool).name for tool in TOOLS}
    assert {"bench.py", "guard_table.py", "gpu_tier.sh", "shim.py"} <= names
    assert "stock_topk.py" in names and "stubs.py" in names


def run_help(command: list[str], out: Path) -> subprocess.CompletedProcess:
    bin_dir = str(Path(sys.executable).parent)  # python3 and the venv's tools
    env = os.environ | {
        "OUT": str(out),
        "PATH": os.pathsep.join([bin_dir, os.environ["PATH"]]),
        "CUDA_VISIBLE_DEVICES": "",
    }
    return subprocess.run(
        [*command, "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "command",
    [
        *([tool] if tool.endswith(".sh") else [sys.executable, tool] for tool in TOOLS),
        [sys.executable, "-m", "tools.kernel_env.shim"],
    ],
    ids=[*TOOLS, "python -m tools.kernel_env.shim"],
)
def test_help_prints_the_usage_and_exits_0(command, tmp_path):
    proc = run_help(command, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines, f"nothing on stdout; stderr: {proc.stderr}"
    name = Path(command[-1]).stem.rpartition(".")[2]  # bench, shim, gpu_tier
    assert lines[0].startswith("usage: ") and name in lines[0], lines[0]
    assert len(lines) >= 3, proc.stdout  # the usage, then what it does
    assert not any(line.startswith("|") for line in lines), proc.stdout
    assert not (tmp_path / "out").exists()
