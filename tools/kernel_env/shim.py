# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A minimal ``vllm`` package for a machine with torch, triton and CuTe DSL
but no vLLM: the stock code runs from its own staged source.

``install(stock_dir, repo_root)`` checks the stage (``stage.verify``), puts
its quack package on ``sys.path`` (unpacked once into the temp dir) and
registers in ``sys.modules``:

- ``stubs.stubs()``: stand-ins for what cannot load there (DeepGEMM, the
  CUDA top-k, ``vllm._custom_ops``, the platform, configs, the sparse MLA
  impl classes); a stand-in function raises, naming itself, unless a caller
  (a test driver) replaced it first;
- the ``stage.STOCK`` modules given as ``None``: the whole staged file,
  imported as that module;
- the other ``STOCK`` modules: only the listed definitions, lifted verbatim
  from the staged file with ``ast`` (decorators included, file name and line
  numbers kept, so ``inspect.getsource`` and Triton see the stock text) and
  executed in the module's namespace; a listed ``Class.member`` of a
  stand-in class is set on it (an undecorated method there is compiled with
  postponed annotations: they may name classes of its file not lifted);
- ``LAUNCHERS``: the stock ``VllmTritonJitKernel`` singletons the lifted
  code calls, each its stock ``__call__`` bound to its lifted Triton kernel.

Package ``__path__``s hold the staged directory and the repository's, so the
fork's own ``vllm.models.glm5next.nvidia.specialized_decode`` imports too.
Install before anything imports ``vllm`` or ``quack``.
"""

import __future__

import argparse
import ast
import contextlib
import importlib
import importlib.machinery
import os
import shutil
import sys
import tarfile
import tempfile
import types
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: python tools/kernel_env/shim.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "tools.kernel_env"

from .stage import QUACK, STOCK, verify
from .stubs import init_logger, mqa_logits_use_mx_scales, set_mx_scales
from .stubs import stubs as _stubs

__all__ = [
    "init_logger",
    "install",
    "install_from_env",
    "mqa_logits_use_mx_scales",
    "set_mx_scales",
]

# Names a stock package re-exports from a STOCK module (as its __init__ does).
EXPORTS = {
    "vllm.config.compilation": ("vllm.config", ("CompilationMode", "CUDAGraphMode"))
}
# Stock kernel singletons: "module.NAME" -> (class, its Triton kernel member).
_MLA = "vllm.v1.attention.backends.mla"
LAUNCHERS = {
    f"{_MLA}.sparse_utils._CONVERT_REQ_INDEX_TO_GLOBAL_INDEX_KERNEL": (
        "ConvertReqIndexToGlobalIndexKernel",
        "sparse_mla_index_remap_kernel",
    ),
    "vllm.v1.attention.ops.common._PACK_SEQ_TRITON_KERNEL": (
        "PackSeqTritonKernel",
        "kernel",
    ),
    "vllm.v1.attention.ops.common._UNPACK_SEQ_TRITON_KERNEL": (
        "UnpackSeqTritonKernel",
        "kernel",
    ),
}
_BINDING_PLAN = (
    "vllm.model_executor.warmup.jit_warmup_triton_helper._launch_binding_plan"
)
# What install() lifted, by "module.name" (as in STOCK), for tests and
# debugging; LIFTED_SOURCE holds each one's statement text from the staged file.
LIFTED: dict[str, Any] = {}
LIFTED_SOURCE: dict[str, str] = {}


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


def _module(name: str, dirs: tuple[Path, ...], package: bool = False, **attrs: Any):
    """Register ``name`` and its parents in ``sys.modules`` (parents, and
    ``name`` if ``package``, as packages over ``dirs``); set ``attrs`` on it."""
    parts, parent = name.split("."), None
    for depth in range(1, len(parts) + 1):
        full = ".".join(parts[:depth])
        module = sys.modules.get(full)
        if module is None:
            module = sys.modules[full] = types.ModuleType(full)
            module.__spec__ = importlib.machinery.ModuleSpec(full, None)
            if parent is not None:
                setattr(parent, parts[depth - 1], module)
        if (depth < len(parts) or package) and not hasattr(module, "__path__"):
            where = [d.joinpath(*parts[:depth]) for d in dirs]
            module.__path__ = [str(d) for d in where if d.is_dir()]
            module.__spec__.submodule_search_locations = module.__path__
        parent = module
    vars(parent).update(attrs)
    return parent


def find_definition(tree: ast.Module, qualname: str) -> ast.stmt:
    """The statement defining ``qualname`` ("name" or "Class.member")."""
    body: list[ast.stmt] = tree.body
    for part in qualname.split("."):
        for node in body:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else None
            targets = targets or getattr(node, "targets", [node])
            if any(getattr(t, "id", getattr(t, "name", None)) == part for t in targets):
                found, body = node, getattr(node, "body", [])
                break
        else:
            raise LookupError(f"stock definition {qualname!r} not found")
    return found


def definition_source(text: str, qualname: str) -> str:
    """The source lines of ``qualname``'s definition in ``text``, its
    decorators included."""
    node = find_definition(ast.parse(text), qualname)
    first = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
    return "\n".join(text.splitlines()[first - 1 : node.end_lineno])


def _lift(module: types.ModuleType, path: Path, names: list[str]) -> dict:
    """Execute the stock definitions ``names`` of ``path`` in ``module``'s
    namespace, after binding the names they use from the file's own imports
    (vLLM's from ``sys.modules``, the others imported). Returns
    ``{name: object}``; a static method comes back as its function. Each
    top-level definition is also set on ``module`` under its own name."""
    text = path.read_text()
    tree = ast.parse(text, str(path))
    nodes = {name: find_definition(tree, name) for name in names}
    used = {
        n.id for v in nodes.values() for n in ast.walk(v) if isinstance(n, ast.Name)
    }
    flags = 0
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            flags |= sum(getattr(__future__, a.name).compiler_flag for a in node.names)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            _bind_imports(module, node, used)
        elif isinstance(node, ast.If | ast.Try):
            # vLLM imports under a top-level if/try (``ops`` on CUDA): bound to
            # their stand-ins; other imports there are not run.
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import | ast.ImportFrom):
                    _bind_imports(module, inner, used, vllm_only=True)
    lifted = {}
    for name, node in nodes.items():
        method = isinstance(node, ast.FunctionDef) and not node.decorator_list
        late = __future__.annotations.compiler_flag if "." in name and method else 0
        code = compile(ast.Module([node], []), str(path), "exec", flags | late, True)
        scope: dict[str, Any] = {}
        exec(code, vars(module), scope)
        obj = scope[name.rpartition(".")[2]]
        lifted[name] = obj.__func__ if isinstance(obj, staticmethod) else obj
        if "." not in name:
            setattr(module, name, obj)
        LIFTED_SOURCE[f"{module.__name__}.{name}"] = definition_source(text, name)
    return lifted


def _bind_imports(
    module: types.ModuleType, node: ast.stmt, used: set[str], vllm_only: bool = False
) -> None:
    """Bind the names of one import statement that the lifted code uses."""
    aliases = [a for a in node.names if (a.asname or a.name).split(".")[0] in used]
    source = getattr(node, "module", None) or node.names[0].name
    if not aliases or getattr(node, "level", 0):
        return
    if source.split(".")[0] != "vllm":
        if not vllm_only:
            exec(compile(ast.Module([node], []), "<import>", "exec"), vars(module))
        return
    for alias in aliases:
        if isinstance(node, ast.ImportFrom):
            value = getattr(sys.modules.get(source), alias.name, None)
        elif alias.asname:  # import vllm.envs as envs
            value = sys.modules.get(alias.name)
        else:  # import vllm.x binds the package
            value = sys.modules.get("vllm")
        if value is not None:
            setattr(module, alias.asname or alias.name.split(".")[0], value)


def _unpack_quack(archive: Path, digest: str) -> Path:
    """The directory holding the staged quack package, unpacked once per
    archive digest into the temp dir."""
    site = Path(tempfile.gettempdir()) / f"kpool-quack-{digest[:16]}"
    if not (site / "quack" / "utils.py").is_file():
        partial = Path(tempfile.mkdtemp(prefix="kpool-quack-"))
        with tarfile.open(archive) as tar:
            tar.extractall(partial, filter="data")
        with contextlib.suppress(OSError):  # another process unpacked it first
            partial.rename(site)
        shutil.rmtree(partial, ignore_errors=True)
    return site


def install(stock_dir: str | os.PathLike, repo_root: str | os.PathLike) -> None:
    """Register the shim ``vllm`` (see the module docstring). Idempotent."""
    stock, repo = Path(stock_dir).resolve(), Path(repo_root).resolve()
    vllm = sys.modules.get("vllm")
    if vllm is not None and getattr(vllm, "__kernel_env__", None) == (stock, repo):
        return
    if vllm is not None or "quack" in sys.modules:
        raise RuntimeError("vllm or quack is already imported: install the shim first")
    files = verify(stock, repo / "patches")
    sys.path.insert(0, str(_unpack_quack(stock / QUACK, files[QUACK])))
    try:
        _build(stock, repo)
    except BaseException:
        for name in [m for m in sys.modules if m.partition(".")[0] == "vllm"]:
            del sys.modules[name]
        LIFTED.clear()
        LIFTED_SOURCE.clear()
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
        else:
            module, lifted = _module(name, dirs, __file__=str(path)), names.split()
            for key, obj in _lift(module, path, lifted).items():
                LIFTED[f"{name}.{key}"] = obj
                owner, _, member = key.rpartition(".")
                stand_in = getattr(module, owner, None) if owner else None
                if isinstance(stand_in, type) and owner not in lifted:
                    if isinstance(obj, types.FunctionType):
                        obj.__qualname__ = key  # as defined in its class
                    setattr(stand_in, member, obj)
        for launcher, (owner, kernel) in LAUNCHERS.items():
            where, _, attr = launcher.rpartition(".")
            if where == name:
                kernel_fn = LIFTED[f"{name}.{owner}.{kernel}"]
                call = LIFTED[f"{name}.{owner}.__call__"]
                launch = _KernelLauncher(kernel_fn, call, LIFTED[_BINDING_PLAN])
                setattr(sys.modules[name], attr, launch)
        target, exported = EXPORTS.get(name, ("", ()))
        for attr in exported:
            setattr(sys.modules[target], attr, getattr(sys.modules[name], attr))
    sys.modules["vllm"].__kernel_env__ = (stock, repo)


def install_from_env() -> bool:
    """Install when ``KPOOL_KERNEL_ONLY=1``, from ``KPOOL_STOCK`` (default
    ``.device/stock`` under the repository). Returns whether it installed."""
    if os.environ.get("KPOOL_KERNEL_ONLY") != "1":
        return False
    repo = Path(__file__).resolve().parents[2]
    install(os.environ.get("KPOOL_STOCK") or repo / ".device/stock", repo)
    return True


def main(argv: list[str] | None = None) -> None:
    """Preflight on the GPU machine: install from the environment, import
    the whole product and print what loaded."""
    parser = argparse.ArgumentParser(
        prog="python3 -m tools.kernel_env.shim",
        description=f"{main.__doc__} Needs KPOOL_KERNEL_ONLY=1 and KPOOL_STOCK.",
    )
    parser.parse_args(argv)
    import torch
    import triton

    if not install_from_env():
        sys.exit("set KPOOL_KERNEL_ONLY=1 (and KPOOL_STOCK) to install the shim")
    stock, repo = sys.modules["vllm"].__kernel_env__
    product = "vllm.models.glm5next.nvidia.specialized_decode"
    for path in sorted((repo / product.replace(".", "/")).rglob("*.py")):
        parts = path.relative_to(repo).with_suffix("").parts
        importlib.import_module(
            ".".join(parts[: -1 if path.stem == "__init__" else None])
        )
    cuda = torch.cuda.is_available()
    print(
        f"kernel env: stock {stock}, torch {torch.__version__}, triton "
        f"{triton.__version__}, {torch.cuda.get_device_name() if cuda else 'no CUDA'}"
        f", quack {sys.modules['quack'].__file__}, mqa_logits_use_mx_scales "
        f"{mqa_logits_use_mx_scales()}, {len(LIFTED)} lifted"
    )


if __name__ == "__main__":
    main()
