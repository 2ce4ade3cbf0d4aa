# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GLM-5-Next tests' setup and fixtures.

- ``CUTE_DSL_ARCH`` defaults to ``sm_90a`` before any test module imports
  cutlass: the CuTe kernels then compile on a machine without a GPU.
- The simulator's fixtures (``indexer_sim``, imported only when a test asks
  for one: a GPU machine without vLLM has no stock tree to load), a
  deployment's config and a faked GPU for ``config.py`` and ``install()``.
- vLLM's process groups over one CPU rank (``one_cpu_rank``), for tests
  that build vLLM's model or runner objects.
- At the end of the session, each indexer step run's summary line.
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import importlib.util
import logging
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest


def pytest_terminal_summary(terminalreporter):
    sim = sys.modules.get("indexer_sim")
    if sim is not None and sim.REPORTS:
        terminalreporter.section("indexer steps: stage against stock")
        for line in sim.REPORTS:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def stock_module():
    """The unpatched ``nvidia/sparse_indexer.py`` of the stock install as a
    module of its own (its imports resolve to the overlay, whose other files
    give their stock results)."""
    from vllm.model_executor import custom_op
    from vllm.models.glm5next.nvidia import sparse_indexer

    path = Path(os.environ["KPOOL_STOCK_VLLM"], "models/glm5next/nvidia")
    spec = importlib.util.spec_from_file_location(
        "stock_glm5next_sparse_indexer", path / "sparse_indexer.py"
    )
    module = importlib.util.module_from_spec(spec)
    # Its custom op class registers under the patched one's name.
    name = sparse_indexer.SparseAttnIndexerKpool.name
    patched = custom_op.op_registry.pop(name)
    try:
        spec.loader.exec_module(module)
    finally:
        custom_op.op_registry[name] = patched
    return module


@pytest.fixture
def timeline() -> list[str]:
    """Where the spies, fake streams and hand-overs of a test record."""
    return []


@pytest.fixture
def spies(monkeypatch, timeline):
    """The stage's launches spied and computed by their stock twins; CPU
    tensors pass the rules (``indexer_sim.Spies``)."""
    from indexer_sim import Spies

    return Spies(monkeypatch, timeline)


@pytest.fixture
def mx_scales(monkeypatch):
    """``mx_scales(flag, *modules)``: ``mqa_logits_use_mx_scales()``
    everywhere (True: SM100)."""
    from indexer_sim import mx_scales

    return partial(mx_scales, monkeypatch)


@pytest.fixture
def references(monkeypatch, stock_module):
    """The simulator's stand-ins in both trees and the stage (FP32 logits,
    the stock top-k vLLM's torch reference); ``references(logits=, topk=)``
    swaps them."""
    from indexer_sim import paged_logits
    from indexer_sim import references as install

    from vllm.models.glm5next.nvidia import sparse_indexer

    def use(logits=paged_logits, topk=None):
        install(monkeypatch, [stock_module, sparse_indexer], "cpu", logits, topk)

    use()
    return use


@pytest.fixture
def sm100(mx_scales, stock_module):
    """The SM100 path: MX scales in every module (stock and fork)."""
    mx_scales(True, stock_module)


@pytest.fixture
def bench(monkeypatch, spies, references, stock_module):
    """``bench(step, **options)``: an ``indexer_sim.Bench``. The process's
    registry of stages starts empty."""
    from indexer_sim import Bench

    from vllm.models.glm5next.nvidia import sparse_indexer

    monkeypatch.setattr(sparse_indexer, "SPECIALIZED_KPOOL", None)
    return partial(Bench, spies, stock_module=stock_module)


def deployment(**overrides):
    """A vllm_config with what ``config.py`` and ``install()`` read, of a
    supported deployment unless overridden (``section__field=value``;
    ``model_config__index_*``: the text config's)."""
    from vllm.config import CompilationMode, CUDAGraphMode

    ns = SimpleNamespace
    config = ns(
        additional_config={"decode_backend": "latency_specialized"},
        model_config=ns(
            architectures=["Glm5NextForCausalLM"],
            hf_text_config=ns(index_topk=2048, index_kpool=4, index_head_dim=128),
        ),
        parallel_config=ns(decode_context_parallel_size=1, use_ubatching=False),
        compilation_config=ns(
            mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE
        ),
        kernel_config=ns(enable_jit_warmup=True),
        scheduler_config=ns(max_num_seqs=64, max_num_batched_tokens=8192),
        speculative_config=ns(num_speculative_tokens=3),
    )
    for name, value in overrides.items():
        section, _, attribute = name.partition("__")
        target = config if not attribute else getattr(config, section)
        if attribute.startswith("index_"):
            target = target.hf_text_config
        setattr(target, attribute or section, value)
    return config


@pytest.fixture
def one_cpu_rank(tmp_path):
    """vLLM's distributed environment and model parallel groups over one
    CPU process (gloo): tensor, pipeline, data and expert parallel size 1."""
    from warmup_ranks import cpu_ranks

    with cpu_ranks(1, 0, f"file://{tmp_path}/group"):
        yield


@pytest.fixture
def make_config():
    return deployment


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(capability)``: the platform as a CUDA GPU of that compute
    capability (None: no GPU)."""
    from vllm.platforms import current_platform

    def use(capability):
        cuda = capability is not None
        for name, answer in (
            ("is_cuda", lambda: cuda),
            ("is_device_capability", lambda c: cuda and c == capability),
            (
                "is_device_capability_family",
                lambda c: cuda and capability // 10 == c // 10,
            ),  # noqa: E501
        ):
            monkeypatch.setattr(current_platform, name, answer)

    return use


@pytest.fixture
def gpu(fake_gpu, monkeypatch):
    """An SM90 GPU unless the test picks another (``gpu(capability)``); no
    self-check setting in the environment."""
    from vllm.models.glm5next.nvidia.specialized_decode import config

    monkeypatch.delenv(config.SELF_CHECK_ENV, raising=False)
    monkeypatch.delenv(config.SELF_CHECK_SEED_ENV, raising=False)
    fake_gpu(90)
    return fake_gpu


@pytest.fixture
def vllm_log(caplog, monkeypatch):
    """``caplog`` with the records of vLLM's loggers (``vllm`` stops their
    propagation once vLLM configures its logging)."""
    vllm = logging.getLogger("vllm")
    monkeypatch.setattr(vllm, "propagate", False)
    vllm.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="vllm")
    yield caplog
    vllm.removeHandler(caplog.handler)
