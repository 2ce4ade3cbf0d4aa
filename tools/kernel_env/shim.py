# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A minimal ``vllm`` package for a machine with torch, triton and CuTe DSL
but no vLLM: the stock kernels run from their own staged source.

``install(stock_dir, repo_root)`` registers in ``sys.modules``:

- ``vllm.models.glm5next.nvidia.ops.kpool_compress``: the whole staged file,
  imported as that module;
- the other ``STOCK`` modules: only the listed definitions, lifted verbatim
  from the staged file with ``ast`` (decorators included, original file name
  and line numbers kept, so ``inspect.getsource`` and Triton see the stock
  text) and executed in the module's namespace;
- ``sparse_utils._CONVERT_REQ_INDEX_TO_GLOBAL_INDEX_KERNEL``: the stock
  ``ConvertReqIndexToGlobalIndexKernel.__call__`` (a LaunchSpec under the stock
  ``kernel_launcher``) bound to the lifted ``sparse_mla_index_remap_kernel``;
- ``_stubs()``: stand-ins for the vLLM helpers those modules import
  (``set_mx_scales`` and ``set_piecewise`` flip two of them).

Package ``__path__``s hold the staged directory and the repository's, so the
fork's own ``vllm.models.glm5next.nvidia.specialized_decode`` imports too.
Install before anything imports ``vllm``; the real package is refused.
"""

import __future__

import ast
import functools
import importlib
import importlib.machinery
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any

from .stage import verify

# Stock modules served from the staged files: the definitions lifted from
# each ("Class.member" for a class member), or None to import the whole file.
# Order matters: a module's stock imports are resolved when it is built.
STOCK: dict[str, tuple[str, ...] | None] = {
    "vllm.model_executor.warmup.jit_warmup": ("kernel_launcher",),
    "vllm.model_executor.warmup.jit_warmup_triton_helper": (
        "LaunchSpec",
        "_LaunchBindingPlan",
        "_launch_binding_plan",
    ),
    "vllm.v1.attention.ops.common": ("pack_ue8m0_x4",),
    "vllm.model_executor.layers.sparse_attn_indexer": (
        "_upcast_logits_kernel",
        "as_fp32_logits",
    ),
    "vllm.v1.attention.backends.mla.sparse_utils": (
        "ConvertReqIndexToGlobalIndexKernel.sparse_mla_index_remap_kernel",
        "ConvertReqIndexToGlobalIndexKernel.__call__",
        "_remap_tiling",
        "triton_convert_req_index_to_global_index",
    ),
    "vllm.v1.attention.backends.mla.index_group": (
        "_create_side_stream",
        "_create_event",
        "SparseMLAIndexGroup",
    ),
    "vllm.models.glm5next.nvidia.ops.kpool_compress": None,
}

_FLAGS: dict[str, bool | None] = {"mx_scales": None, "piecewise": False}
# What install() lifted, by "module.name" (as in STOCK), for tests and debugging.
LIFTED: dict[str, Any] = {}


def set_mx_scales(flag: bool | None) -> None:
    """Force ``mqa_logits_use_mx_scales()``; None: as stock (SM100 family)."""
    _FLAGS["mx_scales"] = flag


def set_piecewise(flag: bool) -> None:
    """Set what ``in_piecewise_cudagraph()`` returns (default False)."""
    _FLAGS["piecewise"] = flag


def mqa_logits_use_mx_scales() -> bool:
    flag = _FLAGS["mx_scales"]
    return _sm100_family() if flag is None else flag


@functools.cache
def _sm100_family() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def in_piecewise_cudagraph() -> bool:
    return bool(_FLAGS["piecewise"])


def init_logger(name: str) -> logging.Logger:
    """``logging.getLogger`` plus vLLM's ``debug/info/warning/error_once``."""
    logger = logging.getLogger(name)
    for level in ("debug", "info", "warning", "error"):
        once = functools.cache(getattr(logger, level))
        setattr(logger, f"{level}_once", lambda msg, *a, scope=None, f=once: f(msg, *a))
    return logger


def _stubs() -> dict[str, dict[str, Any]]:
    """Stand-ins for what the stock and fork modules import from vLLM.
    Add one line here when the specialized decode imports something new."""
    import torch
    import triton
    import triton.language as tl

    return {
        "vllm.logger": {"init_logger": init_logger},
        "vllm.triton_utils": {"HAS_TRITON": True, "tl": tl, "triton": triton},
        "vllm.forward_context": {
            "in_piecewise_cudagraph": in_piecewise_cudagraph,
            "is_forward_context_available": lambda: False,
        },
        "vllm.utils.torch_utils": {"current_stream": torch.cuda.current_stream},
        "vllm.utils.deep_gemm": {"mqa_logits_use_mx_scales": mqa_logits_use_mx_scales},
    }


class _KernelLauncher:
    """A stock ``VllmTritonJitKernel`` minus warmup: the stock ``__call__``
    returns a LaunchSpec, and ``launch`` binds the call's inputs to kernel
    parameters with the stock ``_launch_binding_plan`` and launches, as
    ``VllmTritonJitKernel.launch`` does outside warmup."""

    bind_launch_inputs = True

    def __init__(self, kernel: Any, call: Any, binding_plan: Any) -> None:
        self.kernel, self._call, self._binding_plan = kernel, call, binding_plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(self, *args, **kwargs)

    def launch(self, launch_spec: tuple, inputs: dict[str, Any]) -> Any:
        grid, kwargs, *outputs = launch_spec
        kwargs = dict(kwargs)
        names = (tuple(self.kernel.arg_names), tuple(inputs), tuple(kwargs))
        plan = self._binding_plan(*names)
        values = tuple(inputs.values())
        for index, target in plan.input_targets:
            kwargs[target] = values[index]
        for target, source, dim in plan.stride_targets:
            kwargs[target] = kwargs[source].stride(dim)
        if grid is not None:
            self.kernel[grid](**kwargs)
        return outputs[0] if outputs else None


def _module(
    name: str, dirs: tuple[Path, ...], package: bool = False, **attrs: Any
) -> types.ModuleType:
    """Register ``name`` and its parents in ``sys.modules`` (parents, and
    ``name`` if ``package``, as packages over ``dirs``); set ``attrs`` on it."""
    parts = name.split(".")
    parent = None
    for depth in range(1, len(parts) + 1):
        full = ".".join(parts[:depth])
        module = sys.modules.get(full)
        if module is None:
            module = sys.modules[full] = types.ModuleType(full)
            module.__spec__ = importlib.machinery.ModuleSpec(full, None)
            if parent is not None:
                setattr(parent, parts[depth - 1], module)
        if (depth < len(parts) or package) and not hasattr(module, "__path__"):
            module.__path__ = [
                str(d.joinpath(*parts[:depth]))
                for d in dirs
                if d.joinpath(*parts[:depth]).is_dir()
            ]
            module.__spec__.submodule_search_locations = module.__path__
        parent = module
    vars(parent).update(attrs)
    return parent


def _find(body: list[ast.stmt], name: str) -> ast.stmt:
    for node in body:
        targets = getattr(node, "targets", [node])
        if any(getattr(t, "id", getattr(t, "name", None)) == name for t in targets):
            return node
    raise LookupError(f"stock definition {name!r} not found")


def _lift(module: types.ModuleType, path: Path, names: tuple[str, ...]) -> dict:
    """Execute the stock definitions ``names`` of ``path`` in ``module``'s
    namespace, after binding the names they use from the file's own imports
    (vLLM's from ``sys.modules``, the others imported). Returns
    ``{name: object}``; a static method comes back as its function. Each
    object but a dunder member is also set on ``module`` under its own name."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = {}
    for name in names:
        *owner, attr = name.split(".")
        body = tree.body
        for cls in owner:
            body = _find(body, cls).body
        nodes[name] = _find(body, attr)
    used = {
        n.id for v in nodes.values() for n in ast.walk(v) if isinstance(n, ast.Name)
    }
    flags = 0
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            flags |= sum(getattr(__future__, a.name).compiler_flag for a in node.names)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            _bind_imports(module, node, used)
    lifted = {}
    for name, node in nodes.items():
        code = compile(ast.Module([node], []), str(path), "exec", flags, True)
        scope: dict[str, Any] = {}
        exec(code, vars(module), scope)
        attr = name.rpartition(".")[2]
        obj = lifted[name] = scope[attr]
        if isinstance(obj, staticmethod):
            obj = lifted[name] = obj.__func__
        if not attr.startswith("__"):
            setattr(module, attr, obj)
    return lifted


def _bind_imports(module: types.ModuleType, node: ast.stmt, used: set[str]) -> None:
    """Bind the names of one import statement that the lifted code uses."""
    aliases = [a for a in node.names if (a.asname or a.name).split(".")[0] in used]
    source = getattr(node, "module", None) or node.names[0].name
    if not aliases:
        return
    if source.split(".")[0] != "vllm":
        exec(compile(ast.Module([node], []), "<import>", "exec"), vars(module))
        return
    for alias in aliases:
        if isinstance(node, ast.ImportFrom) and hasattr(
            sys.modules.get(source), alias.name
        ):
            value = getattr(sys.modules[source], alias.name)
            setattr(module, alias.asname or alias.name, value)


def install(stock_dir: str | os.PathLike, repo_root: str | os.PathLike) -> None:
    """Register the shim ``vllm`` (see the module docstring). Idempotent."""
    stock, repo = Path(stock_dir).resolve(), Path(repo_root).resolve()
    vllm = sys.modules.get("vllm")
    if vllm is not None:
        if getattr(vllm, "__kernel_env__", None) == (stock, repo):
            return
        raise RuntimeError(f"{vllm!r} is already imported: install the shim first")
    verify(stock)
    try:
        _build(stock, repo)
    except BaseException:
        for name in [m for m in sys.modules if m.partition(".")[0] == "vllm"]:
            del sys.modules[name]
        LIFTED.clear()
        raise


def _build(stock: Path, repo: Path) -> None:
    dirs = (stock, repo)
    _module("vllm", dirs, package=True)
    for name, attrs in _stubs().items():
        _module(name, dirs, **attrs)
    for name, names in STOCK.items():
        path = stock.joinpath(*name.split(".")).with_suffix(".py")
        if names is None:
            _module(name.rpartition(".")[0], dirs, package=True)
            bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
            try:  # keep the staged dir as its manifest says
                importlib.import_module(name)
            finally:
                sys.dont_write_bytecode = bytecode
            continue
        module = _module(name, dirs, __file__=str(path))
        for key, obj in _lift(module, path, names).items():
            LIFTED[f"{name}.{key}"] = obj
    utils = "vllm.v1.attention.backends.mla.sparse_utils"
    owner = f"{utils}.ConvertReqIndexToGlobalIndexKernel"
    sys.modules[utils]._CONVERT_REQ_INDEX_TO_GLOBAL_INDEX_KERNEL = _KernelLauncher(
        LIFTED[f"{owner}.sparse_mla_index_remap_kernel"],
        LIFTED[f"{owner}.__call__"],
        LIFTED[
            "vllm.model_executor.warmup.jit_warmup_triton_helper._launch_binding_plan"
        ],
    )
    sys.modules["vllm"].__kernel_env__ = (stock, repo)


def install_from_env() -> bool:
    """Install when ``KPOOL_KERNEL_ONLY=1``, from ``KPOOL_STOCK`` (default
    ``.device/stock`` under the repository). Returns whether it installed."""
    if os.environ.get("KPOOL_KERNEL_ONLY") != "1":
        return False
    repo = Path(__file__).resolve().parents[2]
    install(os.environ.get("KPOOL_STOCK") or repo / ".device/stock", repo)
    return True


def main() -> None:
    """Preflight on the GPU machine: install from the environment and print
    what loaded (``python3 -m tools.kernel_env.shim``)."""
    import torch
    import triton

    from tools.kernel_env import shim

    if not shim.install_from_env():
        sys.exit("set KPOOL_KERNEL_ONLY=1 (and KPOOL_STOCK) to install the shim")
    stock, _ = sys.modules["vllm"].__kernel_env__
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    print(
        f"kernel env: stock {stock}, torch {torch.__version__}, triton "
        f"{triton.__version__}, {device}, mqa_logits_use_mx_scales "
        f"{shim.mqa_logits_use_mx_scales()}, {len(shim.LIFTED)} lifted"
    )


if __name__ == "__main__":
    main()
