# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``tools/select_floor.py``: its floor kernel compiles for sm_90a on the
select's compile key (the select's launch and load, one cluster barrier,
the k columns' write: no radix pass), so the floor it times stays the
select's."""

import re

import pytest
import torch


def test_floor_kernel_is_the_selects_load_and_one_barrier(tmp_path):
    pytest.importorskip("cutlass")
    import cutlass.cute as cute

    from tools import select_floor
    from vllm.model_executor.warmup.jit_warmup_cutedsl_helper import (
        cutedsl_fake_stream,
    )

    floor = select_floor.FloorKernel()
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
