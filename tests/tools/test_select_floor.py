# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``tools/select_floor.py``: its floor kernel compiles for sm_90a on the
select's compile key (the select's launch and load, one cluster barrier,
the k columns' write: no radix pass), so the floor it times stays the
select's; ``--help`` imports and builds nothing."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def test_floor_kernel_is_the_selects_load_and_one_barrier(tmp_path):
    pytest.importorskip("cutlass")
    import cutlass.cute as cute

    from tools import select_floor
    from vllm.model_executor.warmup.jit_warmup_cutedsl_helper import (
        cutedsl_fake_stream,
    )

    floor = select_floor.floor_kernel()
    key = floor.CompileKey(512, torch.float32, 8, 8192)
    compiled = cute.compile(
        floor.kernel(key),
        *floor.warmup_inputs(key),
        cutedsl_fake_stream(),
        options=f"--enable-tvm-ffi --keep-ptx --dump-dir {tmp_path} --gpu-arch sm_90a",
    )
    text = compiled.__ptx__
    assert ".local" not in text
    assert "ld.global.nc.v4.b32" in text and "st.shared.v4.b32" in text
    assert len(re.findall(r"barrier\.cluster\.arrive", text)) == 1
    assert "mapa.shared::cluster" not in text  # no peer histogram read


def test_help_builds_nothing(tmp_path):
    """``--help`` prints the options and exits before the overlay, vLLM or
    the CuTe DSL is imported (a fresh overlay dir stays empty)."""
    tool = Path(__file__).resolve().parents[2] / "tools" / "select_floor.py"
    code = (
        "import runpy, sys; sys.argv = [sys.argv[1], '--help']\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "loaded = [m for m in ('vllm', 'cutlass', 'tools.bench') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-c", code, str(tool)], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr
    assert "--rows" in r.stdout and "built vllm overlay" not in r.stderr
