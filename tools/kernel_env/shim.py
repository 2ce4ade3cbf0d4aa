# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A minimal ``vllm`` package for a machine with torch, triton and CuTe DSL
but no vLLM: the stock code runs from its own staged source.

``install(stock_dir, repo_root)`` registers in ``sys.modules``:

- the ``STOCK`` modules given as ``None``: the whole staged file, imported as
  that module (``jit_warmup``, ``jit_warmup_cutedsl_helper``, the GLM-5-Next
  indexer helpers, ``kpool_compress``);
- the other ``STOCK`` modules: only the listed definitions, lifted verbatim
  from the staged file with ``ast`` (decorators included, original file name
  and line numbers kept, so ``inspect.getsource`` and Triton see the stock
  text) and executed in the module's namespace. This serves the patched
  ``sparse_attn_indexer_kpool`` with its real helpers, metadata classes,
  forward context, breakable CUDA graph capture, index group and sparse MLA
  metadata;
- ``LAUNCHERS``: the stock ``VllmTritonJitKernel`` singletons the lifted code
  calls (the remap and the pack/unpack kernels), each its stock ``__call__``
  (a LaunchSpec under the stock ``kernel_launcher``) bound to its lifted
  Triton kernel;
- class members listed for a stand-in class (``SparseMLACommonImpl``'s
  flags): lifted, then set on the stand-in;
- ``stubs.stubs()``: stand-ins for what cannot load there (DeepGEMM, the
  CUDA top-k, ``vllm._custom_ops``, the workspace manager, distributed groups,
  the platform, config objects); each one that is called raises, naming
  itself, unless a caller (the test driver) replaces it first.
  ``set_mx_scales`` forces ``mqa_logits_use_mx_scales()``.

Package ``__path__``s hold the staged directory and the repository's, so the
fork's own ``vllm.models.glm5next.nvidia.specialized_decode`` imports too.
Install before anything imports ``vllm``; the real package is refused.
"""

import __future__

import ast
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

from .stage import verify
from .stubs import init_logger, mqa_logits_use_mx_scales, set_mx_scales
from .stubs import stubs as _stubs

__all__ = [
    "init_logger",
    "install",
    "install_from_env",
    "mqa_logits_use_mx_scales",
    "set_mx_scales",
]

_WARMUP = "vllm.model_executor.warmup"
_MLA = "vllm.v1.attention.backends.mla"
_INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"
# Stock modules served from the staged files: the definitions lifted from
# each ("Class.member" for a class member), or None to import the whole file.
# Order matters: a module's stock imports are resolved when it is built.
STOCK: dict[str, tuple[str, ...] | None] = {
    f"{_WARMUP}.jit_warmup": None,
    f"{_WARMUP}.jit_warmup_cutedsl_helper": None,
    f"{_WARMUP}.jit_warmup_triton_helper": (
        "LaunchSpec",
        "_LaunchBindingPlan",
        "_launch_binding_plan",
    ),
    "vllm.config.compilation": ("CompilationMode", "CUDAGraphMode"),
    "vllm.forward_context": (
        "BatchDescriptor",
        "DPMetadata",
        "ForwardContext",
        "_forward_context",
        "get_forward_context",
        "is_forward_context_available",
        "in_piecewise_cudagraph",
        "override_forward_context",
    ),
    "vllm.compilation.breakable_cudagraph": (
        "_weak_ref_capture_arg",
        "eager_break_during_capture",
        "BreakableCUDAGraphCapture",
    ),
    "vllm.utils.deep_gemm": (
        "_UNIT_UE8M0_X4",
        "_unit_mx_scales",
        "mqa_logits_mx_inputs",
    ),
    "vllm.v1.attention.ops.common": (
        "PackSeqTritonKernel.kernel",
        "PackSeqTritonKernel.__call__",
        "pack_ue8m0_x4",
        "pack_seq_triton",
        "UnpackSeqTritonKernel.kernel",
        "UnpackSeqTritonKernel.__call__",
        "unpack_seq_triton",
    ),
    _INDEXER: (
        "_assert_cutedsl_dcp_merge_supported",
        "_merge_dcp_topk_global",
        "_upcast_logits_kernel",
        "as_fp32_logits",
        "PrefillRowShard",
        "_reserve_row_shard_exchange_transient",
    ),
    f"{_MLA}.sparse_utils": (
        "flat_kv_row_view",
        "ConvertReqIndexToGlobalIndexKernel.sparse_mla_index_remap_kernel",
        "ConvertReqIndexToGlobalIndexKernel.__call__",
        "_remap_tiling",
        "triton_convert_req_index_to_global_index",
    ),
    f"{_MLA}.index_group": (
        "_create_side_stream",
        "_create_event",
        "SparseMLAIndexGroup",
    ),
    # Members lifted onto the module's stand-in class (the impl flags the
    # stage reads and sets; patch 0005 adds the second), and the sparse MLA
    # metadata (the planned-step test accepts MLACommonMetadata's kind).
    "vllm.model_executor.layers.attention.sparse_mla_attention": (
        "SparseMLACommonImpl.group_conversion_decode_only",
        "SparseMLACommonImpl.convert_decode_through_index_group",
        "SparseMLAPrefillMetadata",
        "SparseMLACommonMetadata",
    ),
    f"{_MLA}.indexer": (
        "DeepseekV32IndexerPrefillChunkMetadata",
        "DeepseekV32IndexerPrefillMetadata",
        "DeepSeekV32IndexerDecodeMetadata",
        "DeepseekV32IndexerMetadata",
        "_kpool_tail_slot_mapping_kernel",
        "compute_kpool_tail_slot_mapping",
    ),
    "vllm.models.glm5next.common.sparse_indexer": None,
    "vllm.models.glm5next.nvidia.ops.kpool_compress": None,
    "vllm.models.glm5next.nvidia.sparse_indexer": (
        "SPECIALIZED_KPOOL",
        "_kpool_compress_insert",
        "sparse_attn_indexer_kpool",
    ),
}
# Names a stock package re-exports from a STOCK module (as its __init__ does).
EXPORTS = {
    "vllm.config.compilation": ("vllm.config", ("CompilationMode", "CUDAGraphMode"))
}
# Stock kernel singletons: "module.NAME" -> (class, its Triton kernel member).
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
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            targets = getattr(node, "targets", [node])
        if any(getattr(t, "id", getattr(t, "name", None)) == name for t in targets):
            return node
    raise LookupError(f"stock definition {name!r} not found")


def find_definition(tree: ast.Module, qualname: str) -> ast.stmt:
    """The statement defining ``qualname`` ("name" or "Class.member")."""
    *owner, attr = qualname.split(".")
    body = tree.body
    for cls in owner:
        body = _find(body, cls).body
    return _find(body, attr)


def definition_source(text: str, qualname: str) -> str:
    """The source lines of ``qualname``'s definition in ``text``, its
    decorators included."""
    node = find_definition(ast.parse(text), qualname)
    first = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
    return "\n".join(text.splitlines()[first - 1 : node.end_lineno])


def _lift(module: types.ModuleType, path: Path, names: tuple[str, ...]) -> dict:
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
        code = compile(ast.Module([node], []), str(path), "exec", flags, True)
        scope: dict[str, Any] = {}
        exec(code, vars(module), scope)
        attr = name.rpartition(".")[2]
        obj = lifted[name] = scope[attr]
        if isinstance(obj, staticmethod):
            obj = lifted[name] = obj.__func__
        if "." not in name:
            setattr(module, attr, obj)
        LIFTED_SOURCE[f"{module.__name__}.{name}"] = definition_source(text, name)
    return lifted


def _bind_imports(
    module: types.ModuleType, node: ast.stmt, used: set[str], vllm_only: bool = False
) -> None:
    """Bind the names of one import statement that the lifted code uses."""
    aliases = [a for a in node.names if (a.asname or a.name).split(".")[0] in used]
    source = getattr(node, "module", None) or node.names[0].name
    if not aliases or (node.level if isinstance(node, ast.ImportFrom) else 0):
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


def install(stock_dir: str | os.PathLike, repo_root: str | os.PathLike) -> None:
    """Register the shim ``vllm`` (see the module docstring). Idempotent."""
    stock, repo = Path(stock_dir).resolve(), Path(repo_root).resolve()
    vllm = sys.modules.get("vllm")
    if vllm is not None:
        if getattr(vllm, "__kernel_env__", None) == (stock, repo):
            return
        raise RuntimeError(f"{vllm!r} is already imported: install the shim first")
    verify(stock, repo / "patches")
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
    binding_plan = f"{_WARMUP}.jit_warmup_triton_helper._launch_binding_plan"
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
            module = _module(name, dirs, __file__=str(path))
            for key, obj in _lift(module, path, names).items():
                LIFTED[f"{name}.{key}"] = obj
                owner, _, member = key.rpartition(".")
                stand_in = getattr(module, owner, None) if owner else None
                if isinstance(stand_in, type) and owner not in names:
                    setattr(stand_in, member, obj)
        for launcher, (owner, kernel) in LAUNCHERS.items():
            where, _, attr = launcher.rpartition(".")
            if where == name:
                setattr(
                    sys.modules[name],
                    attr,
                    _KernelLauncher(
                        LIFTED[f"{name}.{owner}.{kernel}"],
                        LIFTED[f"{name}.{owner}.__call__"],
                        LIFTED[binding_plan],
                    ),
                )
        if name in EXPORTS:
            target, exported = EXPORTS[name]
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


def main() -> None:
    """Preflight on the GPU machine: install from the environment and print
    what loaded (``python3 -m tools.kernel_env.shim``)."""
    import torch
    import triton

    from tools.kernel_env import shim

    if not shim.install_from_env():
        sys.exit("set KPOOL_KERNEL_ONLY=1 (and KPOOL_STOCK) to install the shim")
    stock, _ = sys.modules["vllm"].__kernel_env__
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "no CUDA"
    importlib.import_module("vllm.models.glm5next.nvidia.specialized_decode.kpool")
    print(
        f"kernel env: stock {stock}, torch {torch.__version__}, triton "
        f"{triton.__version__}, {name}, mqa_logits_use_mx_scales "
        f"{shim.mqa_logits_use_mx_scales()}, {len(shim.LIFTED)} lifted, "
        f"{sum(n is None for n in STOCK.values())} whole modules"
    )


if __name__ == "__main__":
    main()
