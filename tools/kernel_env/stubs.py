# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stand-ins of the kernel-only ``vllm`` (``shim.py``) for what cannot
load without vLLM: DeepGEMM, the CUDA top-k, ``vllm._custom_ops``, the
workspace manager, distributed groups, configs, the platform, the sparse
MLA impl classes whose ``forward_mqa`` identity the stage checks (FlashMLA's
and FlashInfer SM90's derive from ``SparseMLACommonImpl``'s, as in vLLM, so
they inherit its lifted flags), and the MLA metadata bases the lifted
``SparseMLACommonMetadata`` derives from (``mla_attention.py`` is not staged:
``MLACommonMetadata`` here has the stock dataclass's fields, which
``tests/tools/test_kernel_env.py`` checks). Each stand-in function raises,
naming itself, when called, unless a caller (the test driver,
``tools/indexer/refs.py``) replaced it first. ``set_mx_scales`` forces
``mqa_logits_use_mx_scales()``.
"""

import dataclasses
import functools
import importlib.util
import logging
from typing import Any, Generic, TypeVar

_MLA = "vllm.v1.attention.backends.mla"

_FLAGS: dict[str, bool | None] = {"mx_scales": None}


def set_mx_scales(flag: bool | None) -> None:
    """Force ``mqa_logits_use_mx_scales()``; None: as stock (SM100 family)."""
    _FLAGS["mx_scales"] = flag


def mqa_logits_use_mx_scales() -> bool:
    flag = _FLAGS["mx_scales"]
    return _sm100_family() if flag is None else flag


@functools.cache
def _sm100_family() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def init_logger(name: str) -> logging.Logger:
    """``logging.getLogger`` plus vLLM's ``debug/info/warning/error_once``."""
    logger = logging.getLogger(name)
    for level in ("debug", "info", "warning", "error"):
        once = functools.cache(getattr(logger, level))
        setattr(logger, f"{level}_once", lambda msg, *a, scope=None, f=once: f(msg, *a))
    return logger


def _unavailable(module: str, qualname: str):
    """A stand-in for ``module.qualname`` that raises when called (its
    ``__module__`` and ``__qualname__`` are the stock ones)."""

    def missing(*args: Any, **kwargs: Any):
        raise RuntimeError(
            f"{module}.{qualname} is not available in the kernel-only "
            "environment; the caller must install a stand-in "
            "(tools/indexer/refs.py)"
        )

    missing.__module__, missing.__qualname__ = module, qualname
    missing.__name__ = qualname.rpartition(".")[2]
    return missing


class _Platform:
    """``current_platform``: CUDA when torch sees a GPU, else a CPU stand-in."""

    def is_cuda(self) -> bool:
        import torch

        return torch.cuda.is_available()

    is_cuda_alike = is_cuda

    def is_rocm(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return not self.is_cuda()

    def fp8_dtype(self):
        import torch

        return torch.float8_e4m3fn

    def is_device_capability(self, capability: int) -> bool:
        import torch

        major, minor = torch.cuda.get_device_capability() if self.is_cuda() else (0, 0)
        return self.is_cuda() and major * 10 + minor == capability

    def is_device_capability_family(self, family: int) -> bool:
        import torch

        return self.is_cuda() and torch.cuda.get_device_capability()[0] == family // 10


def _classes(
    module: str, *names: str, methods: tuple[str, ...] = (), bases: tuple = ()
) -> dict:
    """Stand-in classes of ``module`` (annotations, isinstance checks, and
    ``methods`` whose identity the stage checks: they raise if called)."""
    return {
        name: type(
            name,
            bases,
            {"__module__": module}
            | {m: _unavailable(module, f"{name}.{m}") for m in methods},
        )
        for name in names
    }


def _mla_metadata(attention_metadata: type) -> dict:
    """``mla_attention``'s metadata classes: ``MLACommonMetadata`` with the
    stock dataclass's fields (no ``__post_init__``: its head-size check
    needs the MLA backend), the decode and prefill metadata as bases."""
    import torch

    module = "vllm.model_executor.layers.attention.mla_attention"
    d = TypeVar("D")

    @dataclasses.dataclass
    class MLACommonMetadata(attention_metadata, Generic[d]):  # type: ignore[misc]
        num_reqs: int
        max_query_len: int
        max_seq_len: int
        num_actual_tokens: int
        query_start_loc: torch.Tensor
        slot_mapping: torch.Tensor
        num_decodes: int
        num_decode_tokens: int
        num_prefills: int
        causal: bool = True
        head_dim: int | None = None
        prefill: Any = None
        decode: Any = None

    MLACommonMetadata.__module__ = module
    return {
        "MLACommonMetadata": MLACommonMetadata,
        **_classes(module, "MLACommonDecodeMetadata", "MLACommonPrefillMetadata"),
    }


def stubs() -> dict[str, dict[str, Any]]:
    """Stand-ins for what the stock and fork modules import from vLLM.
    Add one line here when the specialized decode imports something new."""
    import torch
    import triton
    import triton.language as tl

    def has_cutedsl() -> bool:
        return importlib.util.find_spec("cutlass") is not None

    def ops(module: str, *names: str) -> dict[str, Any]:
        return {n: _unavailable(module, n) for n in names}

    def classes(module: str, *names: str, methods: tuple[str, ...] = ()):
        return {module: _classes(module, *names, methods=methods)}

    forward = ("forward_mqa",)
    backend = _classes("vllm.v1.attention.backend", "AttentionMetadata")
    sparse_mla = _classes(
        "vllm.model_executor.layers.attention.sparse_mla_attention",
        "SparseMLACommonImpl",
        methods=forward,
    )
    common = (sparse_mla["SparseMLACommonImpl"],)

    return {
        "vllm.logger": {"init_logger": init_logger},
        "vllm.envs": {"VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": 512},
        "vllm.triton_utils": {"HAS_TRITON": True, "tl": tl, "triton": triton},
        "vllm.platforms": {"current_platform": _Platform()},
        "vllm.config": {
            **_classes("vllm.config", "ParallelConfig", "VllmConfig"),
            "get_current_vllm_config_or_none": lambda: None,
        },
        "vllm.distributed": ops(
            "vllm.distributed",
            "get_dcp_group",
            "get_tp_group",
            "get_tensor_model_parallel_rank",
        ),
        "vllm._custom_ops": ops(
            "vllm._custom_ops",
            "cp_gather_indexer_k_quant_cache",
            "indexer_k_quant_and_cache",
        ),
        "vllm.utils.import_utils": {
            "has_cutedsl": has_cutedsl,
            "has_deep_gemm": lambda: False,
        },
        "vllm.utils.torch_utils": {
            "current_stream": torch.cuda.current_stream,
            # vLLM's is torch.ops._C.weak_ref_tensor; a strong reference only
            # keeps graph-pool memory alive longer.
            "weak_ref_tensor": lambda tensor: tensor,
            "LayerNameType": str,
            "_resolve_layer_name": lambda name: getattr(name, "value", name),
        },
        "vllm.utils.deep_gemm": {
            "mqa_logits_use_mx_scales": mqa_logits_use_mx_scales,
            "has_deep_gemm": lambda: False,
            **ops(
                "vllm.utils.deep_gemm", "fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits"
            ),
        },
        "vllm.model_executor.layers.indexer_topk": ops(
            "vllm.model_executor.layers.indexer_topk", "get_indexer_topk"
        ),
        "vllm.v1.worker.workspace": ops(
            "vllm.v1.worker.workspace", "current_workspace_manager"
        ),
        "vllm.v1.attention.backend": backend,
        "vllm.model_executor.layers.attention.mla_attention": _mla_metadata(
            backend["AttentionMetadata"]
        ),
        **classes("vllm.v1.hisparse.runtime", "HiSparsePrefillStagingPlan"),
        **classes("vllm.v1.worker.ubatch_utils", "UBatchSlices"),
        **classes(
            "vllm.model_executor.layers.fusion.quant_activation",
            "QuantizedActivation",
        ),
        # The sparse MLA impls whose forward_mqa the stage identifies.
        "vllm.model_executor.layers.attention.sparse_mla_attention": sparse_mla,
        f"{_MLA}.flashmla_sparse": _classes(
            f"{_MLA}.flashmla_sparse",
            "FlashMLASparseImpl",
            methods=forward,
            bases=common,
        ),
        f"{_MLA}.flashinfer_mla_sparse_sm90": _classes(
            f"{_MLA}.flashinfer_mla_sparse_sm90",
            "FlashInferMLASparseSM90Impl",
            methods=forward,
            bases=common,
        ),
    }
