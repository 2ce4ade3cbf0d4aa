# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Session setup, run by pytest before any test module is imported.

- No NVIDIA driver: ``TRITON_INTERPRET=1`` and ``CUDA_VISIBLE_DEVICES=""``
  by default, so the stock Triton kernels run on the CPU (vLLM turns Triton
  off on a GPU-less machine unless ``CUDA_VISIBLE_DEVICES`` is empty).
- The PATCHED vllm first on ``sys.path`` and ``PYTHONPATH``: the overlay
  ``tools.overlay.build_overlay`` makes of the installed stock vllm
  (exported as ``KPOOL_VLLM_OVERLAY``; the stock dir as ``KPOOL_STOCK_VLLM``).
  With ``KPOOL_KERNEL_ONLY=1`` (the GPU machine without vLLM), the
  kernel-only shim over the staged stock sources instead.
- Tests marked ``gpu`` or ``stock_topk`` (vLLM's own top-k, loaded from the
  wheel's binary) skip with a reason where CUDA is unavailable.
- A test module's ``START_EARLY`` subprocesses (fixture name -> a function
  that starts them, a list of ``Popen``) start once collection is done, if
  a test of the session uses that fixture: pytest runs on one core, and CI
  has two, so they run on the other while the tests before theirs run.
  They run niced (``nice`` 5, 10, 15, 19 in the order the session needs
  them), so that the tests, and the subprocess needed next, come first,
  until their fixture waits for them.
  The fixture takes them with the ``started`` fixture (from the module's
  ``STARTED``, by fixture name: the pid that started them, the list); any
  not taken are killed at the end.
"""

import contextlib
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools import overlay  # noqa: E402
from tools.kernel_env.shim import install_from_env  # noqa: E402

if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def _setup_vllm() -> str:
    if install_from_env():
        return "vllm: the kernel-only shim over the staged stock sources"
    stock = overlay.find_installed_vllm()
    if stock is None:
        return "vllm overlay: none (vllm is not installed)"
    if "vllm" in sys.modules:
        # A later pytest.main in this process (mutmut runs several, and forks
        # after them) imports this file again: the vllm imported is then the
        # overlay this file built and exported the first time. It stays; a
        # new build could differ (mutmut writes files next to the mutants).
        built = Path(os.environ.get("KPOOL_VLLM_OVERLAY", "/nonexistent"))
        imported = Path(sys.modules["vllm"].__file__ or "").resolve()
        if imported.parent != (built / "vllm").resolve():
            raise RuntimeError(
                f"vllm was imported before conftest.py: {sys.modules['vllm']}"
            )
        return f"vllm overlay: {built} (imported by an earlier run here)"
    built = overlay.build_overlay(stock, log=lambda m: print(m, file=sys.stderr))
    sys.path.insert(0, str(built))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(built), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    os.environ.update(KPOOL_VLLM_OVERLAY=str(built), KPOOL_STOCK_VLLM=str(stock))
    return f"vllm overlay: {built} (patched hard-link copy of {stock})"


_HEADER = _setup_vllm()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "stock_topk: needs vLLM's own top-k (KPOOL_STOCK_TOPK_SO)"
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    env = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    return [_HEADER, f"kernel env: {env}"]


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:  # nothing will wait for them
        return
    order = 0
    for item in session.items:
        module = getattr(item, "module", None)
        for name, start in getattr(module, "START_EARLY", {}).items():
            if name in item.fixturenames and name not in module.STARTED:
                module.STARTED[name] = (os.getpid(), runs := start())
                for run in runs:
                    with contextlib.suppress(ProcessLookupError):  # ended
                        os.setpriority(os.PRIO_PROCESS, run.pid, min(5 * order + 5, 19))
                order += 1


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef, request) -> None:
    """A fixture about to wait for its subprocesses started early: they run
    at the tests' priority from now on, where this process may raise it."""
    module = getattr(request, "module", None)
    pid, runs = getattr(module, "STARTED", {}).get(fixturedef.argname, (0, ()))
    for run in runs if pid == os.getpid() else ():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.setpriority(os.PRIO_PROCESS, run.pid, 0)


@pytest.fixture(scope="session")
def started():
    """``started(module, name)``: the subprocesses ``module.START_EARLY[name]``
    started after collection, or started now (none were, or the process that
    started them is the one this one forked from)."""

    def take(module, name: str) -> list:
        pid, runs = module.STARTED.pop(name, (None, None))
        return runs if pid == os.getpid() else module.START_EARLY[name]()

    return take


def pytest_sessionfinish(session: pytest.Session) -> None:
    for module in {getattr(item, "module", None) for item in session.items}:
        for pid, runs in getattr(module, "STARTED", {}).values():
            for run in runs if pid == os.getpid() else ():  # not a fork's
                run.kill()
                run.wait()


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    cuda = [i for i in items if any(map(i.get_closest_marker, ("gpu", "stock_topk")))]
    if cuda and not __import__("torch").cuda.is_available():
        reason = "needs CUDA: torch.cuda.is_available() is False"
        for item in cuda:
            item.add_marker(pytest.mark.skip(reason=reason))
