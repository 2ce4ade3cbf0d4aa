# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the host side of every kpool kernel shares: vLLM's CuTe DSL JIT
kernel with the launch spec apart from the launch, the refusal of an input a
kernel does not take, and the fake tensors a key compiles on."""

import functools
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import torch
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint8
from cutlass.cute.runtime import make_fake_tensor

# Re-exported: every kernel's __call__ is kernel_launcher(spec).
from vllm.model_executor.warmup.jit_warmup import kernel_launcher as kernel_launcher
from vllm.model_executor.warmup.jit_warmup_cutedsl_helper import VllmCuTeDSLJitKernel

from ...constants import INT32_MAX, INT32_MIN, POOL

CompileKeyT = TypeVar("CompileKeyT")
# The index dtypes the kernels read, as DSL integer types.
INDEX_TYPES = {torch.int32: Int32, torch.int64: Int64}
# The dtypes of the fake tensors a key compiles on, as DSL types.
DSL_TYPES = INDEX_TYPES | {torch.bfloat16: BFloat16, torch.float32: Float32}
DSL_TYPES |= {torch.uint8: Uint8, torch.float8_e4m3fn: Float8E4M3FN}


def fake(dtype: torch.dtype, shape: tuple, stride: tuple, align: int = 4):
    """A fake tensor of torch's ``dtype`` to compile a key on."""
    return make_fake_tensor(DSL_TYPES[dtype], shape, stride, assumed_align=align)


# What a stage's kernel returns where the caller runs the stock kernel.
STOCK = object()


class Refused(ValueError):
    """An input a kernel does not take: "argument: expected X, got Y". The
    public function raises it; the stage runs the stock kernel instead."""


def mismatch(argument: str, expected: str, got: Any) -> Refused:
    return Refused(f"{argument}: expected {expected}, got {got}")


def layout(tensor: torch.Tensor) -> str:
    return f"{tensor.dtype} {list(tensor.shape)} strides {list(tensor.stride())}"


def check_devices(
    names: tuple[str, ...], *tensors: torch.Tensor | None, optional: tuple = ()
) -> None:
    """Each of ``tensors`` (``names``; None where ``optional``) is a CUDA
    tensor on one device."""
    first = None
    for name, tensor in zip(names, tensors, strict=True):
        if tensor is None and name in optional:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise mismatch(name, "a torch.Tensor", type(tensor).__name__)
        if not tensor.is_cuda:
            raise mismatch(name, "a CUDA tensor", f"a tensor on {tensor.device}")
        if first is None:
            first = tensor
        elif tensor.get_device() != first.get_device():
            expected = f"a tensor on {first.device} as the others"
            raise mismatch(name, expected, tensor.device)


@functools.cache
def sm_count(index: int) -> int:
    """The SMs of CUDA device ``index``, read once."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def check_int32(name: str, value: Any) -> None:
    if not isinstance(value, int) or not INT32_MIN <= value <= INT32_MAX:
        raise mismatch(name, "an int32", value)


def check_int(name: str, value: Any, low: int, high: int, expected: str) -> None:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not is_int or not low <= value <= high:
        raise mismatch(name, expected, value)


def check_pool_size(pool_size: Any) -> None:
    if pool_size != POOL:
        raise mismatch("pool_size", str(POOL), pool_size)


def unit_columns(tensor, dtypes, row_multiple: int = 1, align: int = 1) -> bool:
    """Whether ``tensor`` is a [rows, columns] tensor of ``dtypes`` with a
    unit column stride, a row stride that is a multiple of ``row_multiple``
    and data ``align``-byte aligned."""
    stride = tensor.stride()
    return (
        tensor.dtype in dtypes
        and len(stride) == 2
        and stride[1] == 1
        and stride[0] % row_multiple == 0
        and tensor.data_ptr() % align == 0
    )


def check_pool_ids(pool_ids: torch.Tensor) -> None:
    # An empty tensor's strides say nothing (CUDA may give [0, 1] [1, 0]).
    unit = pool_ids.dim() == 2 and (pool_ids.stride(1) == 1 or not pool_ids.numel())
    if pool_ids.dtype is not torch.int32 or not unit:
        expected = "int32 [rows, pools], unit column stride"
        raise mismatch("pool_ids", expected, layout(pool_ids))


def check_vector(name: str, tensor, rows: int, expected: str, dtypes=INDEX_TYPES):
    if tensor.dtype not in dtypes or tensor.stride() != (1,) or tensor.shape[0] < rows:
        raise mismatch(name, expected, layout(tensor))


class KernelOwner(Protocol):
    """All a kernel instance of an owner (a stage) knows of it: the keys the
    owner's warmup lists for the kernel, the keys vLLM's JIT warmup asks to
    compile (the owner compiles and self-checks them), and the executor the
    owner's verdict launches for a key (None: the caller runs stock)."""

    def warmup_keys(self, kernel: "KpoolKernel", vllm_config: Any) -> list: ...

    def warm(self, kernel: "KpoolKernel", compile_keys: list) -> None: ...

    def checked(self, compile_key: Any) -> Callable | None: ...


class KpoolKernel(VllmCuTeDSLJitKernel[CompileKeyT], Generic[CompileKeyT]):
    """A kpool decode kernel in vLLM's CuTe DSL protocol. ``spec(**arguments)``
    checks the arguments against the kernel's rule (raising ``Refused``) and
    returns ``(compile key, executor arguments or None where there is
    nothing to compute, output)``; ``__call__`` is ``kernel_launcher(spec)``.
    The module's instance (``owner`` None) serves the public functions and
    compiles a missing key (never inside a CUDA graph capture). An owner's
    instance (a stage's) launches only the executors its owner's verdict
    holds (``checked``), else returns ``STOCK`` (``serve`` also on a refusal):
    the caller runs the stock kernel. All instances share the executors."""

    compiled: dict

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.compiled = {}

    def __init__(self, owner: KernelOwner | None = None):
        super().__init__()
        self._compiled_cache = type(self).compiled
        self.owner = owner

    def dispatch(self, **fields) -> CompileKeyT:
        """The compile key of a call whose spec derived ``fields`` from its
        arguments (kernels whose key is no more than that)."""
        return self.CompileKey(**fields)

    def get_warmup_keys(self, vllm_config=None, **dispatch_values) -> list:
        """The keys of every combination of ``dispatch_values`` (each a value,
        a ``WarmupChoices`` or a ``WarmupIntRange``; ``_when`` a predicate),
        as vLLM's JIT warmup traces ``dispatch``. An owner's instance, given
        none: the keys its owner's warmup lists."""
        if self.owner is not None and not dispatch_values:
            return self.owner.warmup_keys(self, vllm_config)
        return self._trace_dispatch(self.dispatch)(**dispatch_values)

    def compile(self, compile_key: CompileKeyT) -> None:
        if compile_key in self._compiled_cache:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{type(self).__name__} {compile_key} is not compiled; compiling "
                "inside a CUDA graph capture is not allowed (warm it up first)"
            )
        super().compile(compile_key)

    def compile_many(self, compile_keys) -> None:
        """Compiles ``compile_keys``; an owner's instance hands them to its
        owner, whose warmup compiles and self-checks them."""
        if self.owner is None:
            return super().compile_many(compile_keys)
        self.owner.warm(self, list(compile_keys))

    def executor(self, compile_key: CompileKeyT):
        """``compile_key``'s compiled executor, compiled here if missing."""
        return self._get_or_compile(compile_key)

    def launch(self, launch_spec, _inputs):
        compile_key, args, out = launch_spec
        if self.owner is not None:
            executor = self.owner.checked(compile_key)
            if executor is None:
                return STOCK
        elif args is not None:
            executor = self._get_or_compile(compile_key)
        if args is not None:
            executor(*args)
        return out

    def serve(self, *args, **kwargs):
        """An owner's launch: the kernel's output, or ``STOCK`` where its rule
        refuses the arguments or its owner's verdict does not hold their key
        (the caller runs the stock kernel)."""
        try:
            return self(*args, **kwargs)
        except Refused:
            return STOCK
