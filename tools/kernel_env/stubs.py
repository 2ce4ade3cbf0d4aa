# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stand-ins of the shim's ``vllm`` (``shim.py``) for what cannot
load without vLLM: DeepGEMM, the CUDA top-k, ``vllm._custom_ops``, the
workspace manager, distributed groups, configs, the platform, and classes
named in annotations, bases and isinstance checks. The sparse MLA impl
classes are stand-ins derived as in vLLM (FlashMLA's and FlashInfer SM90's
from ``SparseMLACommonImpl``'s); the shim sets their stock flags and
``forward_mqa`` on them. Each stand-in function raises, naming itself, when
called, unless a caller (a test driver) replaced it first.
``set_mx_scales`` forces ``mqa_logits_use_mx_scales()``.

``python3 tools/kernel_env/stubs.py`` lists the stand-ins, one
``module.name`` a line.
"""

import argparse
import functools
import importlib.util
import logging
from typing import Any

_FLAGS: dict[str, bool | None] = {"mx_scales": None}


def set_mx_scales(flag: bool | None) -> None:
    """Force ``mqa_logits_use_mx_scales()``; None: as stock (SM100 family)."""
    _FLAGS["mx_scales"] = flag


def mqa_logits_use_mx_scales() -> bool:
    flag = _FLAGS["mx_scales"]
    return _capability()[0] == 10 if flag is None else flag


@functools.cache
def _capability() -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def paged_scores(module: str) -> dict[str, Any]:
    """``vllm.utils.deep_gemm``'s paged scores and their schedule, as its
    wrappers call the ``deep_gemm`` package (SM90's next_n 4 schedules one
    task per 2-CTA cluster), where the package imports (the GPU tier unpacks
    vLLM's vendored copy onto the path); else stand-ins that raise."""
    try:
        import deep_gemm
    except Exception:  # noqa: BLE001 - any failure means "not here"
        return {
            n: _unavailable(module, n)
            for n in ("fp8_fp4_paged_mqa_logits", "get_paged_mqa_logits_metadata")
        }

    def get_paged_mqa_logits_metadata(context_lens, block_size, num_sms):
        next_n = context_lens.shape[1] if context_lens.dim() == 2 else 1
        clusters = 2 if next_n == 4 and _capability()[0] == 9 else 1
        return deep_gemm.get_paged_mqa_logits_metadata(
            context_lens, block_size, num_sms // clusters
        )

    def fp8_fp4_paged_mqa_logits(
        q,
        kv_cache,
        weights,
        context_lens,
        block_tables,
        schedule_metadata,
        max_model_len,
        indices=None,
    ):
        assert indices is None, "the shim's runs take SM90's batched form"
        return deep_gemm.fp8_fp4_paged_mqa_logits(
            q,
            kv_cache,
            weights,
            context_lens,
            block_tables,
            schedule_metadata,
            max_model_len,
        )

    return {
        "get_paged_mqa_logits_metadata": get_paged_mqa_logits_metadata,
        "fp8_fp4_paged_mqa_logits": fp8_fp4_paged_mqa_logits,
    }


def init_logger(name: str) -> logging.Logger:
    """``logging.getLogger`` plus vLLM's ``debug/info/warning/error_once``."""
    logger = logging.getLogger(name)
    for level in ("debug", "info", "warning", "error"):
        once = functools.cache(getattr(logger, level))
        setattr(logger, f"{level}_once", lambda msg, *a, scope=None, f=once: f(msg, *a))
    return logger


def _unavailable(module: str, name: str):
    """A stand-in for ``module.name`` that raises when called (its
    ``__module__`` and ``__qualname__`` are the stock ones)."""

    def missing(*args: Any, **kwargs: Any):
        raise RuntimeError(
            f"{module}.{name} is not available without vLLM (the GPU tier's shim);"
            " the caller must install a stand-in"
        )

    missing.__module__, missing.__qualname__, missing.__name__ = module, name, name
    return missing


class _Platform:
    """``current_platform``: CUDA when torch sees a GPU, else a CPU stand-in."""

    def is_cuda(self) -> bool:
        return _capability() != (0, 0)

    is_cuda_alike = is_cuda

    def is_rocm(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return not self.is_cuda()

    def fp8_dtype(self):
        import torch

        return torch.float8_e4m3fn

    def is_device_capability(self, capability: int) -> bool:
        major, minor = _capability()
        return self.is_cuda() and major * 10 + minor == capability

    def is_device_capability_family(self, family: int) -> bool:
        return self.is_cuda() and _capability()[0] == family // 10


def _classes(module: str, *names: str, bases: tuple = ()) -> dict[str, type]:
    """Stand-in classes of ``module``."""
    return {name: type(name, bases, {"__module__": module}) for name in names}


def stubs() -> dict[str, dict[str, Any]]:
    """Stand-ins for what the stock and fork modules import from vLLM, by
    module. A new one is one entry here."""
    import torch
    import triton
    import triton.language as tl

    def ops(module: str, *names: str) -> dict[str, Any]:
        return {n: _unavailable(module, n) for n in names}

    def classes(module: str, *names: str, bases: tuple = ()) -> dict[str, dict]:
        return {module: _classes(module, *names, bases=bases)}

    mla = "vllm.v1.attention.backends.mla"
    attention = "vllm.model_executor.layers.attention"
    sparse_mla = _classes(f"{attention}.sparse_mla_attention", "SparseMLACommonImpl")
    impl = (sparse_mla["SparseMLACommonImpl"],)
    deep_gemm = "vllm.utils.deep_gemm"
    return {
        "vllm.logger": {"init_logger": init_logger},
        "vllm.envs": {
            "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": 512,
            "VLLM_BATCH_INVARIANT": False,
        },
        "vllm.triton_utils": {"HAS_TRITON": True, "tl": tl, "triton": triton},
        "vllm.platforms": {"current_platform": _Platform()},
        "vllm.config": {
            **_classes("vllm.config", "ParallelConfig", "VllmConfig"),
            "get_current_vllm_config_or_none": lambda: None,
        },
        "vllm.distributed": {
            **ops(
                "vllm.distributed",
                "get_dcp_group",
                "get_tp_group",
                "get_tensor_model_parallel_rank",
            ),
            # The shim's runs set up no process group.
            "model_parallel_is_initialized": lambda: False,
        },
        "vllm._custom_ops": ops(
            "vllm._custom_ops",
            "cp_gather_indexer_k_quant_cache",
            "indexer_k_quant_and_cache",
        ),
        "vllm.utils.import_utils": {
            "has_cutedsl": lambda: importlib.util.find_spec("cutlass") is not None,
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
        deep_gemm: {
            "mqa_logits_use_mx_scales": mqa_logits_use_mx_scales,
            "has_deep_gemm": lambda: False,
            **ops(deep_gemm, "fp8_fp4_mqa_logits"),
            **paged_scores(deep_gemm),
        },
        "vllm.model_executor.layers.indexer_topk": ops(
            "vllm.model_executor.layers.indexer_topk", "get_indexer_topk"
        ),
        "vllm.v1.worker.workspace": ops(
            "vllm.v1.worker.workspace", "current_workspace_manager"
        ),
        **classes("vllm.v1.attention.backend", "AttentionMetadata"),
        **classes(f"{attention}.mla_attention", "MLACommonPrefillMetadata"),
        **classes("vllm.v1.hisparse.runtime", "HiSparsePrefillStagingPlan"),
        **classes("vllm.v1.worker.ubatch_utils", "UBatchSlices"),
        **classes(
            "vllm.model_executor.layers.fusion.quant_activation", "QuantizedActivation"
        ),
        f"{attention}.sparse_mla_attention": sparse_mla,
        **classes(f"{mla}.flashmla_sparse", "FlashMLASparseImpl", bases=impl),
        **classes(
            f"{mla}.flashinfer_mla_sparse_sm90",
            "FlashInferMLASparseSM90Impl",
            bases=impl,
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    for module, names in stubs().items():
        for name in names:
            print(f"{module}.{name}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
