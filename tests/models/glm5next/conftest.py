# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GLM-5-Next tests' setup and fixtures.

- ``CUTE_DSL_ARCH`` defaults to ``sm_90a`` here, before any test module
  imports cutlass: the CuTe kernels then compile on a machine without a GPU.
- The fixtures of the CPU harness (``kpool_harness``), imported only when a
  test asks for one (the kernel-only GPU environment has no vLLM to build
  them from).
- At the end of the session, each indexer step run's outcome (steps, layers,
  seed, mismatches).
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import logging
import sys
from functools import partial

import pytest


def pytest_terminal_summary(terminalreporter):
    steps = sys.modules.get("tools.indexer.steps")
    if steps is not None and steps.REPORTS:
        terminalreporter.section("indexer steps: stage against stock")
        for line in steps.REPORTS:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def stock_module():
    """The unpatched GLM-5-Next sparse indexer, as a module of its own."""
    from kpool_harness import load_stock_sparse_indexer

    return load_stock_sparse_indexer()


@pytest.fixture
def timeline() -> list[str]:
    """Where the spies, fake streams and hand-overs of a test record."""
    return []


@pytest.fixture
def spies(monkeypatch, timeline):
    """The kernels as a new engine process on the CPU sees them (nothing
    compiled until a warmup compiles it), launched by the stock twins."""
    from kpool_harness import Spies

    return Spies(monkeypatch, timeline)


@pytest.fixture
def mx_scales(monkeypatch):
    """``mx_scales(value, *modules)``: what ``mqa_logits_use_mx_scales()``
    answers everywhere (True: SM100)."""
    from kpool_harness import use_mx_scales

    return partial(use_mx_scales, monkeypatch)


@pytest.fixture
def references(monkeypatch, stock_module):
    """DeepGEMM's logits as a torch reference in both trees (SM90's FP32
    logits); ``references(logits_fn)`` swaps it."""
    from kpool_harness import paged_logits_reference, use_references

    from vllm.models.glm5next.nvidia import sparse_indexer

    def use(logits_fn):
        use_references(monkeypatch, (stock_module, sparse_indexer), logits_fn)

    use(paged_logits_reference())
    return use


@pytest.fixture
def sm100(mx_scales, references, stock_module):
    """The SM100 path: MX scales in every module (stock and fork), the cache
    and the BF16 logits in that format."""
    from kpool_harness import paged_logits_reference

    mx_scales(True, stock_module)
    references(paged_logits_reference(mx=True))


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(capability)``: the platform as a CUDA GPU of that compute
    capability (None: no GPU)."""
    from kpool_harness import fake_gpu as use

    return partial(use, monkeypatch)


@pytest.fixture
def install_stage(monkeypatch):
    """``install_stage(attentions, max_rows=, warm=, self_check=)``:
    ``install()`` on a faked SM90 inside a JIT warmup registry, then its
    warmup. The process's registry of stages starts empty in each test."""
    from kpool_harness import install_stage as install

    from vllm.models.glm5next.nvidia import sparse_indexer

    monkeypatch.setattr(sparse_indexer, "SPECIALIZED_KPOOL", None)
    return partial(install, monkeypatch)


@pytest.fixture
def engine(install_stage, spies, references):
    """``engine(inputs, **options)``: a ``kpool_harness.Engine`` (one DSA
    layer holding ``inputs``, its stage installed and warmed up)."""
    from kpool_harness import Engine

    return partial(Engine, install_stage, spies.timeline)


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
