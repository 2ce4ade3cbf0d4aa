# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``indexer_batches.Builder``: the metadata the GPU tier lays by hand
(``laid``: a GPU machine without vLLM has no vLLM builders) is what vLLM's own
builders build (``built``) from the same ``CommonAttentionMetadata``, field
for field, over a serving run's batches of every backend path, eager and
FULL-graph padded (CPU), but for what the simulator does not read
(``UNREAD``)."""

import dataclasses
import random

import pytest
import torch
from indexer_batches import BACKENDS, Builder, Geometry, Scheduler, Workload

# DeepGEMM's scheduler metadata: its schedule op has no CPU kernel, and the
# simulator's logits stand-ins do not read it.
UNREAD = {"schedule_metadata"}


def differences(built, laid, where: str) -> list[str]:
    """Where two metadata values differ (dataclasses by field, tensors by
    value and shape)."""
    if dataclasses.is_dataclass(built) and not isinstance(built, type):
        found = []
        for f in dataclasses.fields(built):
            if f.name in UNREAD:
                continue
            a, b = getattr(built, f.name), getattr(laid, f.name, "<missing>")
            found += differences(a, b, f"{where}.{f.name}")
        return found
    if isinstance(built, torch.Tensor):
        same = (
            isinstance(laid, torch.Tensor)
            and built.shape == laid.shape
            and torch.equal(built.cpu().long(), laid.cpu().long())
        )
        return [] if same else [f"{where}: {built} != {laid}"]
    if isinstance(built, (list, tuple)):
        if not isinstance(laid, (list, tuple)) or len(built) != len(laid):
            return [f"{where}: {len(built)} items != {laid!r}"]
        pairs = enumerate(zip(built, laid, strict=True))
        return [d for i, (a, b) in pairs for d in differences(a, b, f"{where}[{i}]")]
    return [] if built == laid else [f"{where}: {built!r} != {laid!r}"]


@pytest.mark.parametrize(
    "name, deep_gemm",
    [(name, False) for name in sorted(BACKENDS)] + [("flashmla_fp8", True)],
)
def test_laid_metadata_is_what_vllm_builds(monkeypatch, name, deep_gemm):
    """``deep_gemm``: the padded path where DeepGEMM's SM90 kernel scores
    (a step of at most 3 tokens a request goes flat)."""
    geo = Geometry(layers=1, max_tokens=256, max_reqs=16)
    builder = Builder(geo, BACKENDS[name], "cpu", deep_gemm)
    found, steps, layouts, widths = [], 0, set(), set()
    built = builder.built

    def both(common):
        got = built(common)
        want = builder.laid(common)
        for part, a, b in zip(("indexer", "tail"), got, want, strict=True):
            found.extend(differences(a, b, f"step {steps} {part}"))
        return got

    monkeypatch.setattr(builder, "built", both)
    sched = Scheduler(geo, Workload(decode_steps=40, phase=5), random.Random(7))
    while sched.decode_steps < 40 and steps < 200:
        batch = sched.schedule()
        if batch.items:
            full = batch.kind == "decode" and batch.uniform and steps % 3 == 0
            step = builder.build(
                batch, rows=batch.tokens, full=full, pad_reqs=2 if full else 0
            )
            layouts.add(step.layout)
            decode = next(iter(step.metadata.values())).decode
            if step.layout in ("native", "padded"):
                widths.add(decode.seq_lens.view(decode.seq_lens.shape[0], -1).shape[1])
            sched.commit(batch)
        steps += 1
    assert found == [], found[:5]
    if deep_gemm:  # both layouts reached, DeepGEMM's next_n only
        assert layouts >= {"padded", "flat"} and widths <= {1, 2, 4}, (layouts, widths)


@pytest.mark.parametrize("geo", [Geometry(), Geometry(topk=128, max_reqs=4)])
def test_every_run_selects(geo):
    """A run's first prompt is past the top-k, however few steps it takes:
    a short GPU run whose contexts all stayed within it would select
    nothing, and its stage would launch neither select nor remap."""
    for seed in range(300):
        sched = Scheduler(geo, Workload(), random.Random(seed))
        sched.schedule()
        assert sched.running[0].prompt > geo.topk, seed
