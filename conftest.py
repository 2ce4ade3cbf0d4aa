# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Session setup, run by pytest before any test module is imported.

- No NVIDIA driver (no ``nvidia-smi``, no ``/dev/nvidiactl``): defaults
  ``TRITON_INTERPRET=1`` and ``CUDA_VISIBLE_DEVICES=""`` so the stock Triton
  kernels run on the CPU (vLLM turns Triton off on a GPU-less machine unless
  ``CUDA_VISIBLE_DEVICES`` is the empty string).
- Makes the PATCHED vllm importable: ``tools.overlay.build_overlay`` builds
  (once per patch set / stock install, cached in ``build/overlay/<key>/``) a
  hard-link copy of the installed stock ``vllm`` with the patch set applied.
  Its dir is prepended to ``sys.path`` and ``PYTHONPATH`` and exported as
  ``KPOOL_VLLM_OVERLAY``; the stock package dir as ``KPOOL_STOCK_VLLM``.
  Skipped with ``KPOOL_KERNEL_ONLY=1`` (the kernel-only GPU machine has its
  own import shim) and when vllm is not installed.
- Tests marked ``gpu`` skip with a reason when CUDA is unavailable.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools import overlay  # noqa: E402

NO_NVIDIA_DRIVER = shutil.which("nvidia-smi") is None and not os.path.exists(
    "/dev/nvidiactl"
)
if NO_NVIDIA_DRIVER:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def _setup_overlay() -> str:
    if os.environ.get("KPOOL_KERNEL_ONLY") == "1":
        from tools.kernel_env.shim import install_from_env

        install_from_env()
        return "vllm: the kernel-only shim over the staged stock sources"
    stock = overlay.find_installed_vllm()
    if stock is None:
        return "vllm overlay: none (vllm is not installed)"
    if "vllm" in sys.modules:
        raise RuntimeError(
            "vllm was imported before conftest.py could put the patched overlay "
            f"first on sys.path ({sys.modules['vllm'].__file__})"
        )
    built = overlay.build_overlay(stock, log=lambda m: print(m, file=sys.stderr))
    sys.path.insert(0, str(built))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(built), *([old] if old else [])])
    os.environ["KPOOL_VLLM_OVERLAY"] = str(built)
    os.environ["KPOOL_STOCK_VLLM"] = str(stock)
    return f"vllm overlay: {built} (patched hard-link copy of {stock})"


_HEADER = _setup_overlay()


def pytest_report_header(config: pytest.Config) -> list[str]:
    env = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    return [_HEADER, f"kernel env: {env}"]


def _cuda_unavailable() -> str | None:
    try:
        import torch
    except ImportError:
        return "needs CUDA: torch is not installed"
    if not torch.cuda.is_available():
        return "needs CUDA: torch.cuda.is_available() is False"
    return None


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    reason = _cuda_unavailable() if gpu_items else None
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
