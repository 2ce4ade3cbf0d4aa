# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How a kpool kernel decides, compiles and launches: vLLM's CuTe DSL JIT
kernel (``VllmCuTeDSLJitKernel``) with one derivation of its compile key.

Each kernel takes its public function's arguments as one ``Args`` tuple and
``key_for(args)`` is the only place its requirements are written: it returns
the frozen compile key or raises ``Refused`` (a ``ValueError`` naming the
argument, what the kernel takes and what came). Everything asks it:

- the public function: ``run(args)`` raises the refusal; compiles a missing
  key (on fake tensors, never inside a CUDA graph capture) and launches;
- the stage: ``run_if_ready(args)`` launches only a key its warmup compiled,
  else answers None and the caller runs stock;
- the warmup: ``key_for`` of arguments shaped like each layer's gives the keys
  it compiles; the self-check launches its cases through ``run_if_ready``.

Executors are compiled with ``--enable-tvm-ffi`` and launched with torch
tensors on torch's current stream.
"""

import operator
from typing import Any, Generic, NamedTuple, TypeVar

import torch
from cutlass import Int32, Int64

from vllm.model_executor.warmup.jit_warmup_cutedsl_helper import (
    VllmCuTeDSLJitKernel,
)
from vllm.models.glm5next.nvidia.specialized_decode import constants

CompileKeyT = TypeVar("CompileKeyT")
# The index dtypes the kernels read, as DSL integer types.
INDEX_TYPES = {torch.int32: Int32, torch.int64: Int64}
ArgsT = TypeVar("ArgsT", bound=NamedTuple)


class Refused(ValueError):
    """An input a kernel does not take: "argument: expected X, got Y"."""


def mismatch(argument: str, expected: str, got: Any) -> Refused:
    return Refused(f"{argument}: expected {expected}, got {got}")


def layout(tensor: torch.Tensor) -> str:
    return f"{tensor.dtype} {list(tensor.shape)} strides {list(tensor.stride())}"


class TensorFields:
    """The tensor fields of a kernel's ``Args``, which its rule checks first:
    each a ``torch.Tensor`` (or None where ``optional``), all on one device of
    a type the kernels run on (``constants.KERNEL_DEVICE_TYPES``).

    ``check`` runs before every eager launch: it reads each tensor's device
    index once, and only what fails that reads the names and builds the
    message."""

    def __init__(self, args_type, required: tuple[str, ...], optional=()) -> None:
        fields = args_type._fields
        self.names = (*required, *optional)
        self.optional = frozenset(optional)
        self._required = operator.itemgetter(*(fields.index(n) for n in required))
        self._optional = tuple(fields.index(n) for n in optional)

    def check(self, args: NamedTuple) -> None:
        # A CUDA tensor's index is >= 0; anything else (a CPU tensor, None
        # where required, a non-tensor: no get_device) takes the full check.
        try:
            values = self._required(args)
            index = values[0].get_device()
            if index >= 0:
                for value in values:
                    if value.get_device() != index:
                        break
                else:
                    for i in self._optional:
                        value = args[i]
                        if value is not None and value.get_device() != index:
                            break
                    else:
                        return
        except (AttributeError, TypeError):
            pass
        self._refuse(args)

    def _refuse(self, args: NamedTuple) -> None:
        """Raises the refusal of the first field that fails; returns where
        none does (a device type the tests add to ``KERNEL_DEVICE_TYPES``)."""
        device = None
        for name in self.names:
            value = getattr(args, name)
            if value is None and name in self.optional:
                continue
            if not isinstance(value, torch.Tensor):
                raise mismatch(name, "a torch.Tensor", type(value).__name__)
            if value.device.type not in constants.KERNEL_DEVICE_TYPES:
                raise mismatch(name, "a CUDA tensor", f"a tensor on {value.device}")
            if device is None:
                device = value.device
            elif value.device != device:
                raise mismatch(
                    name, f"a tensor on {device} as the others", value.device
                )


def check_int32(name: str, value: Any) -> None:
    if not isinstance(value, int) or not (
        constants.INT32_MIN <= value <= constants.INT32_MAX
    ):
        raise mismatch(name, "an int32", value)


class KpoolJitKernel(VllmCuTeDSLJitKernel[CompileKeyT], Generic[CompileKeyT, ArgsT]):
    """A kpool kernel: one executor per compile key, compiled on the fakes of
    ``warmup_inputs`` (no launch), launched with the tensors of
    ``executor_args``."""

    def __init__(self) -> None:
        super().__init__()
        self._keys: dict[tuple, CompileKeyT] = {}

    # --- What each kernel defines --------------------------------------------

    def key_for(self, args: ArgsT) -> CompileKeyT:
        """The compile key of ``args``; raises ``Refused`` where the kernel
        does not take them."""
        raise NotImplementedError

    def executor_args(self, args: ArgsT) -> tuple | None:
        """What the compiled executor takes for ``args`` (stream excluded),
        or None where they have nothing to compute (empty rows)."""
        raise NotImplementedError

    # ``args`` with what the launch allocates (an output the caller left
    # None), called once the kernel took them; None where it allocates
    # nothing (a method less per launch).
    complete = None

    # --- Shared -----------------------------------------------------------------

    def key(self, *fields: Any) -> CompileKeyT:
        """The frozen compile key of ``fields``, built once (building one
        costs more than the rest of an eager launch's host work)."""
        compile_key = self._keys.get(fields)
        if compile_key is None:
            compile_key = self._keys[fields] = self.CompileKey(*fields)
        return compile_key

    def compile(self, compile_key: CompileKeyT) -> None:
        if compile_key in self._compiled_cache:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{type(self).__name__} {compile_key} is not compiled; compiling "
                "inside a CUDA graph capture is not allowed (warm it up first)"
            )
        super().compile(compile_key)

    def get_warmup_keys(self, cases=()) -> list[CompileKeyT]:
        """The keys of the argument tuples in ``cases`` that the kernel
        takes (the warmup passes fakes shaped like each layer's inputs)."""
        keys: dict[CompileKeyT, None] = {}
        for args in cases:
            try:
                keys[self.key_for(args)] = None
            except Refused:
                continue
        return list(keys)

    def ready(self, compile_key: CompileKeyT) -> bool:
        """Whether ``compile_key`` launches without compiling."""
        return compile_key in self._compiled_cache

    def run(self, args: ArgsT) -> ArgsT:
        """The public function's launch: raises ``Refused`` for what the
        kernel does not take, compiles a missing key, launches; returns the
        arguments it launched with (``complete``)."""
        compile_key = self.key_for(args)
        if self.complete is not None:
            args = self.complete(args)
        launch = self.executor_args(args)
        if launch is not None:
            executor = self._compiled_cache.get(compile_key)
            if executor is None:
                executor = self._get_or_compile(compile_key)
            executor(*launch)
        return args

    def executor_for(self, args: ArgsT):
        """The compiled executor that launches ``args``, or None where the
        kernel does not take them or their key was not compiled (the stage
        then runs stock). Compiles nothing."""
        try:
            compile_key = self.key_for(args)
        except Refused:
            return None
        return self._compiled_cache.get(compile_key)

    def launch(self, executor, args: ArgsT) -> ArgsT:
        """Launches ``executor`` (from ``executor_for(args)``) on ``args``
        unless they are empty; returns them completed."""
        if self.complete is not None:
            args = self.complete(args)
        launch = self.executor_args(args)
        if launch is not None:
            executor(*launch)
        return args

    def run_if_ready(self, args: ArgsT) -> ArgsT | None:
        """The stage's launch: ``launch`` where ``executor_for`` finds one,
        else None, launching nothing, for the caller to run stock."""
        executor = self.executor_for(args)
        return None if executor is None else self.launch(executor, args)
