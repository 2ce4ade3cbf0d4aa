# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How the kpool kernels compile and launch: vLLM's CuTe DSL JIT kernels
(``VllmCuTeDSLJitKernel``), compiled with ``--enable-tvm-ffi`` on fake
tensors for a frozen compile key at the JIT warmup, and launched with torch
tensors on torch's current stream.

Compiling is allowed inside a warmup (``warming_up()``) and, for direct use
before any engine warmed up (tests, benchmarks), lazily. After the first
warmup a launch whose key was not compiled raises instead of compiling inside
a decode step; each engine warms up its own keys.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from vllm.model_executor.warmup.jit_warmup_cutedsl_helper import (
    VllmCuTeDSLJitKernel,
)

CompileKeyT = TypeVar("CompileKeyT")

_warmups_running = 0
_warmed_up = False


@contextmanager
def warming_up() -> Iterator[None]:
    """A JIT warmup: the kernels may compile inside it, and not after it."""
    global _warmups_running, _warmed_up
    _warmups_running += 1
    try:
        yield
    finally:
        _warmups_running -= 1
        _warmed_up = True


def _compiles_allowed() -> bool:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return _warmups_running > 0 or not _warmed_up


class KpoolJitKernel(VllmCuTeDSLJitKernel[CompileKeyT]):
    """A kpool kernel: one executor per compile key, compiled on the fakes of
    ``warmup_inputs`` (no launch), never inside a decode step or a capture."""

    def __init__(self) -> None:
        super().__init__()
        self._keys: dict[tuple, CompileKeyT] = {}

    def key(self, *fields: Any) -> CompileKeyT:
        """The frozen compile key of ``fields``, built once: building one
        costs more than the rest of an eager launch's host work."""
        compile_key = self._keys.get(fields)
        if compile_key is None:
            compile_key = self._keys[fields] = self.CompileKey(*fields)  # type: ignore[attr-defined]
        return compile_key

    def compile(self, compile_key: CompileKeyT) -> None:
        if compile_key in self._compiled_cache:
            return
        if not _compiles_allowed():
            raise RuntimeError(
                f"{type(self).__name__} {compile_key} was not compiled during "
                "warmup; compiling inside a decode step or a CUDA graph capture "
                "is not allowed"
            )
        super().compile(compile_key)

    def get_warmup_keys(self, compile_keys: Any = ()) -> list[CompileKeyT]:
        return list(compile_keys)

    def ready(self, compile_key: CompileKeyT) -> bool:
        """Whether ``compile_key`` launches without compiling."""
        return compile_key in self._compiled_cache

    def run(self, compile_key: CompileKeyT, *args: Any) -> None:
        """Launches the executor of ``compile_key`` (compiling it first where
        that is allowed) with torch tensors and Python scalars."""
        executor = self._compiled_cache.get(compile_key)
        if executor is None:
            executor = self._get_or_compile(compile_key)
        executor(*args)


def mismatch(argument: str, expected: str, got: Any) -> str:
    """A guard's message: which argument, what the kernel takes, what came."""
    return f"{argument}: expected {expected}, got {got}"


def layout(tensor: torch.Tensor) -> str:
    return f"{tensor.dtype} {list(tensor.shape)} strides {list(tensor.stride())}"
