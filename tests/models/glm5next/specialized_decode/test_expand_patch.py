# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""patches/0001: ``expand_pools_and_append_tail(..., *, seq_offset=0, out=None)``.

The patched function (imported from the overlay that conftest.py puts first
on sys.path) is compared with the UNPATCHED one, loaded from the installed
stock file under another module name. On the CPU this runs the Triton
kernels under ``TRITON_INTERPRET=1`` (the root conftest sets it where there
is no NVIDIA driver); with CUDA, on the GPU. Without an installed stock vllm
(the GPU tier's machine without vLLM) there is nothing to compare with: the ``stock``
fixture skips.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
from pathlib import Path

import pytest
import torch

from tools import overlay, patchset
from vllm.models.glm5next.nvidia.ops import kpool_compress as patched

REL = "vllm/models/glm5next/nvidia/ops/kpool_compress.py"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def stock():
    """The unpatched stock module, checked against its pinned sha256."""
    stock_pkg = overlay.find_installed_vllm()
    if stock_pkg is None:
        pytest.skip("the stock vllm package is not installed")
    path = stock_pkg.parent / REL
    expected = patchset.Patchset.load().base_files[REL]
    found = hashlib.sha256(path.read_bytes()).hexdigest()
    assert found == expected, f"{path}: expected base sha256 {expected}, found {found}"
    spec = importlib.util.spec_from_file_location("kpool_compress_stock", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(rows: int, n_groups: int, pool_size: int, seed: int, pid_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    pool_ids = torch.randint(0, 4096, (rows, n_groups), generator=g)
    pool_ids[torch.rand((rows, n_groups), generator=g) < 0.3] = -1
    # Every residue mod pool_size (and mod 4), including empty sequences.
    seq_lens = torch.randint(0, 20_000, (rows,), generator=g)
    seq_lens -= seq_lens % pool_size
    seq_lens += torch.arange(rows) % pool_size
    seq_lens[0] = 0
    return pool_ids.to(pid_dtype).to(DEVICE), seq_lens.to(torch.int32).to(DEVICE)


SHAPES = [(1, 1), (7, 3), (9, 5), (4, 32), (6, 33), (5, 100)]  # (rows, n_groups)


def test_the_two_modules_differ(stock):
    assert stock.__file__ != patched.__file__
    assert (
        "seq_offset"
        not in inspect.signature(stock.expand_pools_and_append_tail).parameters
    )
    params = inspect.signature(patched.expand_pools_and_append_tail).parameters
    assert params["seq_offset"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["seq_offset"].default == 0
    assert params["out"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["out"].default is None


@pytest.mark.parametrize("pool_size", [2, 4, 8])
@pytest.mark.parametrize("rows,n_groups", SHAPES)
def test_defaults_match_stock_bit_for_bit(rows, n_groups, pool_size, stock):
    pool_ids, seq_lens = _inputs(rows, n_groups, pool_size, seed=rows * 1000 + n_groups)
    before = seq_lens.clone()
    want = stock.expand_pools_and_append_tail(pool_ids, seq_lens, pool_size)
    got = patched.expand_pools_and_append_tail(pool_ids, seq_lens, pool_size)
    assert got.dtype == want.dtype == torch.int32
    assert got.shape == want.shape == (rows, n_groups * pool_size + pool_size - 1)
    assert torch.equal(got, want)
    assert torch.equal(seq_lens, before)
    explicit = patched.expand_pools_and_append_tail(
        pool_ids, seq_lens, pool_size, seq_offset=0, out=None
    )
    assert torch.equal(explicit, want)


def test_defaults_match_stock_on_int32_strided_pool_ids(stock):
    pool_ids, seq_lens = _inputs(5, 40, 4, seed=7, pid_dtype=torch.int32)
    wide = torch.full((5, 57), -3, dtype=torch.int32, device=DEVICE)
    wide[:, 10:50] = pool_ids
    view = wide[:, 10:50]  # row stride 57, not 40
    want = stock.expand_pools_and_append_tail(view, seq_lens, 4)
    assert torch.equal(patched.expand_pools_and_append_tail(view, seq_lens, 4), want)


@pytest.mark.parametrize("seq_offset", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("rows,n_groups", SHAPES)
def test_seq_offset_equals_stock_on_shifted_lens(rows, n_groups, seq_offset, stock):
    pool_ids, positions = _inputs(rows, n_groups, 4, seed=seq_offset + rows)
    want = stock.expand_pools_and_append_tail(pool_ids, positions + seq_offset, 4)
    got = patched.expand_pools_and_append_tail(
        pool_ids, positions, 4, seq_offset=seq_offset
    )
    assert torch.equal(got, want)
    if seq_offset % 4:
        unshifted = stock.expand_pools_and_append_tail(pool_ids, positions, 4)
        assert not torch.equal(got, unshifted)  # the offset is really applied


@pytest.mark.parametrize("poison", [-1, 0x5EED])
@pytest.mark.parametrize("extra_cols", [0, 5])
@pytest.mark.parametrize("seq_offset", [0, 1])
@pytest.mark.parametrize("rows,n_groups", [(1, 3), (7, 33), (5, 100)])
def test_out_row_slice_of_wider_buffer(
    rows, n_groups, seq_offset, extra_cols, poison, stock
):
    pool_ids, seq_lens = _inputs(rows, n_groups, 4, seed=rows + n_groups)
    out_cols = n_groups * 4 + 3
    buf = torch.full(
        (rows + 5, out_cols + 37), poison, dtype=torch.int32, device=DEVICE
    )
    out = buf[2 : 2 + rows, : out_cols + extra_cols]
    assert out.stride(0) != out.shape[1]
    ret = patched.expand_pools_and_append_tail(
        pool_ids, seq_lens, 4, seq_offset=seq_offset, out=out
    )
    want = stock.expand_pools_and_append_tail(pool_ids, seq_lens + seq_offset, 4)
    assert ret is out
    assert torch.equal(buf[2 : 2 + rows, :out_cols], want)
    assert bool((buf[2 : 2 + rows, out_cols:] == poison).all())  # beyond out_cols
    assert bool((buf[:2] == poison).all()) and bool((buf[2 + rows :] == poison).all())


@pytest.mark.parametrize(
    "make_out",
    [
        lambda r, c: torch.empty((r, c), dtype=torch.int64),  # dtype
        lambda r, c: torch.empty((c, r), dtype=torch.int32).t(),  # column stride
        lambda r, c: torch.empty((r + 1, c), dtype=torch.int32),  # rows
        lambda r, c: torch.empty((r, c - 1), dtype=torch.int32),  # too narrow
        lambda r, c: torch.empty((r * c,), dtype=torch.int32),  # not 2-D
    ],
    ids=["int64", "col-stride", "rows", "narrow", "1d"],
)
def test_out_layout_is_asserted(make_out):
    pool_ids, seq_lens = _inputs(3, 5, 4, seed=1)
    out = make_out(3, 5 * 4 + 3).to(DEVICE)
    with pytest.raises(AssertionError):
        patched.expand_pools_and_append_tail(pool_ids, seq_lens, 4, out=out)


def test_patched_source_is_the_overlay():
    overlay = os.environ.get("KPOOL_VLLM_OVERLAY")
    if overlay is None:
        pytest.skip("no overlay (KPOOL_KERNEL_ONLY=1 or vllm not installed)")
    assert Path(patched.__file__).is_relative_to(overlay)
