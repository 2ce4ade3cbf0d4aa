# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``tools/bench_select.py``'s plumbing on the CPU: the sizes it covers, the
inputs of a size, the set comparison, and the refusal without stock's
top-k binary (its timings need the GPU)."""

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("triton.testing")

from tools import bench_select as bench  # noqa: E402


def test_refuses_without_the_stock_binary(tmp_path, capsys):
    missing = tmp_path / "none.so"
    assert bench.main(["--stock-topk-so", str(missing)]) == 2
    assert f"--stock-topk-so: no file {missing}" in capsys.readouterr().err


def test_cases_cover_the_issue_sizes():
    cases = list(bench.cases(quick=False))
    assert len(cases) == len(set(cases)) == 2 * 2 * 3 * 7
    assert {c[0] for c in cases} == set(bench.PATHS)
    assert {c[2] for c in cases} == {65536, 262144}
    assert {(c[5], c[6]) for c in cases} == {
        (1, 1), (1, 8), (1, 64), (1, 256), (4, 4), (4, 32), (4, 256)
    }  # fmt: skip
    for _, _, width, context, end, _, _ in cases:
        assert end == (width if context == "full" else bench.CONTEXTS[context])


def test_inputs_of_a_request_with_next_n(monkeypatch):
    monkeypatch.setattr(bench.B, "DEVICE", torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    t = bench.chain_inputs(8, 4096, 1024, 4, torch.bfloat16, gen)
    assert t["logits"].shape == (8, 4096) and t["logits"].dtype == torch.bfloat16
    assert t["ends"].tolist() == [1021, 1022, 1023, 1024] * 2
    assert torch.equal(t["positions"], t["ends"].long() * 4 + 2)
    assert t["block_table"].shape == (8, 4096 * 4 // bench.BLOCK)
    assert t["physical"].shape == (8, bench.B.WIDTH)


def test_same_sets_compares_values_not_order(monkeypatch):
    monkeypatch.setattr(bench.B, "DEVICE", torch.device("cpu"))
    t = bench.chain_inputs(2, 4096, 4096, 1, torch.float32, torch.Generator())
    top = torch.topk(t["logits"], bench.K, dim=1).indices.to(torch.int32)

    def write(ids):
        return lambda *args: t["pool_topk"].copy_(ids)

    monkeypatch.setattr(bench, "stock_topk", write(top))
    monkeypatch.setattr(bench, "ours_select", write(torch.sort(top, 1).values))
    assert bench.same_sets(t, 4096)
    other = top.clone()
    other[:, 0] = torch.topk(t["logits"], bench.K + 1, dim=1).indices[:, -1]
    monkeypatch.setattr(bench, "ours_select", write(other))
    assert not bench.same_sets(t, 4096)
