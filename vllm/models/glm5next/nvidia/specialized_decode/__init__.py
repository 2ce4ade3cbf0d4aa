# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5-Next specialized decode on NVIDIA GPUs: CuTe DSL kernels for the kpool
sparse indexer's decode path (``kpool.py``), enabled by
``additional_config={"decode_backend": "latency_specialized"}``.

The stages are named (``STAGES``); a deployment leaves one out with
``additional_config={"specialized_decode_skip": ["dsa_kpool"]}``. The default
``decode_backend="auto"`` runs the stock decode. A deployment that asks for a
stage it cannot run gets one ``ValueError`` listing every unmet requirement.

The stages run only in planned steps (``planned()``): decode-only forward
passes whose rows the stages' buffers hold, once their kernels are compiled.

This module imports nothing of vLLM but its logger at import time (the
kernel-only environment loads it); vLLM is imported inside the functions.
"""

import os
import secrets
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)

BACKEND = "latency_specialized"
STAGES = ("dsa_kpool",)
# The additional_config key listing the stages a deployment leaves out.
SKIP_KEY = "specialized_decode_skip"
# The additional_config key of the warmup self-check: "on" (default: a
# mismatch keeps the stage off), "off" (skipped) or "strict" (a mismatch
# raises). The environment variable, when set, overrides it; a second one
# replays a logged seed.
SELF_CHECK_KEY = "specialized_decode_self_check"
SELF_CHECK_ENV = "VLLM_GLM5NEXT_KPOOL_SELF_CHECK"
SELF_CHECK_SEED_ENV = "VLLM_GLM5NEXT_KPOOL_SELF_CHECK_SEED"
SELF_CHECK_MODES = ("on", "off", "strict")

ARCHITECTURES = ("Glm5NextForCausalLM", "Glm5NextForConditionalGeneration")
INDEX_KPOOL = 4
INDEX_HEAD_DIM = 128
# The kernels' positions dtype: the model runners' int64 positions buffer.
POSITIONS_DTYPE = torch.int64


@dataclass(frozen=True)
class DecodeConfig:
    # The stages this deployment runs, in STAGES order.
    stages: tuple[str, ...]
    # The warmup self-check: "on", "off" or "strict" (SELF_CHECK_KEY).
    self_check: str = "on"


@dataclass
class _Plan:
    """Host state of the installed stage that ``planned()`` reads."""

    # Decode rows the stage's buffers hold.
    max_rows: int
    # A DSA layer's indexer cache of the model the stage is installed on: its
    # metadata tells that model's forward passes from the MTP draft's.
    layer: str
    # Layers whose metadata does not describe the step: the storage-only tail
    # caches split with threshold 1 (KpoolTailMetadataBuilder), so a
    # speculative decode step reads as prefills there.
    ignored: frozenset[str] = frozenset()
    # Set once the stage's kernels are compiled (JIT warmup).
    warmed: bool = False
    # ``planned()`` of the last forward context (a weak reference to it).
    context: Any = None
    answer: bool = False


_plan: _Plan | None = None


def specialized_decode_config(vllm_config) -> DecodeConfig | None:
    """The specialized decode settings, or None for the stock decode.

    Raises ValueError for an unknown backend or stage name, or, when a stage
    is on, for a deployment missing any requirement (all listed at once).
    """
    extra = vllm_config.additional_config
    extra = extra if isinstance(extra, dict) else {}
    backend = extra.get("decode_backend", "auto")
    if backend == "auto":
        return None
    if backend != BACKEND:
        raise ValueError(f"Supported decode_backend values are auto/{BACKEND}")
    skip = extra.get(SKIP_KEY, [])
    if not isinstance(skip, list | tuple) or not all(name in STAGES for name in skip):
        raise ValueError(
            f"{SKIP_KEY} takes a list of stage names out of {list(STAGES)}, "
            f"got {skip!r}"
        )
    stages = tuple(name for name in STAGES if name not in skip)
    self_check = os.environ.get(SELF_CHECK_ENV) or extra.get(SELF_CHECK_KEY, "on")
    if self_check not in SELF_CHECK_MODES:
        raise ValueError(
            f"{SELF_CHECK_KEY} (or {SELF_CHECK_ENV}) takes one of "
            f"{list(SELF_CHECK_MODES)}, got {self_check!r}"
        )
    if stages:
        missing = unsupported(vllm_config)
        if missing:
            raise ValueError(
                f"decode_backend={BACKEND} needs {'; '.join(missing)}. "
                f"Leave the stages out with {SKIP_KEY}={list(stages)}."
            )
    return DecodeConfig(stages=stages, self_check=self_check)


def unsupported(vllm_config) -> list[str]:
    """Every requirement of the ``dsa_kpool`` stage this deployment misses."""
    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    text = model.hf_text_config
    kpool = getattr(text, "index_kpool", None)
    head_dim = getattr(text, "index_head_dim", None)
    parallel = vllm_config.parallel_config
    compilation = vllm_config.compilation_config
    cudagraph_mode = compilation.cudagraph_mode
    requirements = {
        # The kernels are compiled for sm_90a and the SM100 family.
        "an NVIDIA SM90 (Hopper) or SM100-family (Blackwell) GPU": (
            current_platform.is_cuda()
            and (
                current_platform.is_device_capability(90)
                or current_platform.is_device_capability_family(100)
            )
        ),
        f"the GLM-5-Next model ({' or '.join(ARCHITECTURES)})": bool(
            set(model.architectures or ()) & set(ARCHITECTURES)
        ),
        f"the kpool sparse indexer with index_kpool {INDEX_KPOOL} and "
        f"index_head_dim {INDEX_HEAD_DIM} (found index_topk "
        f"{getattr(text, 'index_topk', None)}, index_kpool {kpool}, "
        f"index_head_dim {head_dim})": (
            getattr(text, "index_topk", None) is not None
            and kpool == INDEX_KPOOL
            and head_dim == INDEX_HEAD_DIM
        ),
        # A deferred top-k skips the stock DCP merge and filtered conversion.
        "no decode context parallelism": parallel.decode_context_parallel_size == 1,
        # The deferred top-k is one slot per process; micro-batches interleave.
        "no micro-batching (DBO)": not parallel.use_ubatching,
        # The routing is host code run at each eager step and capture; a
        # compiled forward would trace one decision into every step.
        "no torch.compile of the model (compilation mode NONE, the default "
        "with GLM-5-Next's breakable CUDA graphs)": (
            compilation.mode == CompilationMode.NONE
        ),
        # A FULL graph replays its capture's routing, which must be decode's.
        "no FULL CUDA graphs of mixed prefill-decode batches": (
            cudagraph_mode is None or cudagraph_mode.mixed_mode() != CUDAGraphMode.FULL
        ),
        # Decode steps and graph captures must never compile a kernel.
        "JIT kernel warmup (kernel_config.enable_jit_warmup)": bool(
            vllm_config.kernel_config.enable_jit_warmup
        ),
    }
    return [need for need, ok in requirements.items() if not ok]


def decode_capacity(vllm_config) -> int:
    """Decode rows of one step: max_num_seqs x (1 + speculative tokens), at
    most max_num_batched_tokens (as the sparse MLA index groups are sized)."""
    scheduler = vllm_config.scheduler_config
    spec = vllm_config.speculative_config
    num_spec = (spec.num_speculative_tokens or 0) if spec is not None else 0
    return min(
        scheduler.max_num_batched_tokens, scheduler.max_num_seqs * (1 + num_spec)
    )


def planned() -> bool:
    """Whether the current forward pass is a planned step: a warmed-up stage,
    a forward of the model it is installed on that is not a (non-capture)
    dummy or profiling run, every attention metadata decode-only, at most
    ``max_rows`` decode rows.

    Reads host state only, once per forward context. A FULL CUDA graph capture
    gets the answer of the decode steps that replay it; breakable graphs rerun
    the indexer eagerly at replay, in the step's own forward context.
    """
    plan = _plan
    if plan is None or not plan.warmed:
        return False
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return False
    context = get_forward_context()
    if plan.context is None or plan.context() is not context:
        plan.context = weakref.ref(context)
        plan.answer = _plans(context, plan)
    return plan.answer


def _plans(context, plan: _Plan) -> bool:
    # Warmup and idle dummy runs are not steps (patched set_forward_context).
    if context.dummy_run:
        return False
    metadata = context.attn_metadata
    # None: profiling run; a list: micro-batches; no layer of the model: the
    # MTP draft's forward, whose kernels the warmup did not see.
    if not isinstance(metadata, dict) or plan.layer not in metadata:
        return False
    decodes = False
    described = (m for name, m in metadata.items() if name not in plan.ignored)
    for layer_metadata in {id(m): m for m in described}.values():
        prefills = getattr(layer_metadata, "num_prefills", None)
        if prefills is None:
            continue  # no prefill/decode split (e.g. a storage-only cache)
        tokens = getattr(layer_metadata, "num_decode_tokens", 0)
        if prefills > 0 or tokens > plan.max_rows:
            return False
        decodes = decodes or tokens > 0
    return decodes


def install(vllm_config, attentions) -> Any:
    """Installs the ``dsa_kpool`` stage on the GLM-5-Next model's DSA
    attention layers (``Glm5NextMLAAttention`` with an indexer, the main model
    only) when the deployment asks for it: builds the ``KpoolStage``, sets
    ``sparse_indexer.SPECIALIZED_KPOOL``, registers its kernels for the JIT
    warmup and logs what is on. Returns the stage, or None (stock decode).
    """
    global _plan
    config = specialized_decode_config(vllm_config)
    if config is None:
        return None
    if "dsa_kpool" not in config.stages or not attentions:
        logger.info(
            "GLM-5-Next specialized decode: dsa_kpool off (%s).",
            "left out" if attentions else "no DSA layers",
        )
        return None

    from vllm.models.glm5next.nvidia import sparse_indexer
    from vllm.models.glm5next.nvidia.specialized_decode.kpool import KpoolStage

    max_rows = decode_capacity(vllm_config)
    device = attentions[0].indexer.topk_indices_buffer.device
    stage = KpoolStage(attentions, max_rows, device)
    _plan = plan_for(attentions, max_rows)
    sparse_indexer.SPECIALIZED_KPOOL = stage
    warmup = _KpoolWarmup(stage, attentions, _plan, config.self_check)
    warmed_up = _register_warmup(warmup)
    (logger.info if warmed_up else logger.warning)(
        "GLM-5-Next specialized decode: dsa_kpool %s, for decode-only steps of "
        "up to %d rows; attention backend %s; DSA layers: %s.",
        "on, compiled at JIT warmup"
        if warmed_up
        else "off: no JIT warmup registry compiles its kernels",
        max_rows,
        type(attentions[0].mla_attn.mla_attn.impl).__name__,
        "; ".join(stage.engagement(attentions)),
    )
    return stage


def plan_for(attentions, max_rows: int) -> _Plan:
    """The plan of a stage on ``attentions`` (not yet warmed up)."""
    tails = (getattr(attn.indexer, "tail_cache", None) for attn in attentions)
    return _Plan(
        max_rows=max_rows,
        layer=str(attentions[0].indexer.k_cache.prefix),
        ignored=frozenset(str(t.prefix) for t in tails if t is not None),
    )


class _KpoolWarmup:
    """The JIT warmup registry's entry for the stage (the registry's kernel
    protocol: ``get_warmup_keys`` and ``compile_many``). Runs after the KV
    caches are bound, before CUDA graph capture."""

    def __init__(self, stage, attentions, plan: _Plan, self_check: str = "on"):
        self.stage, self.attentions, self.plan = stage, list(attentions), plan
        self.self_check = self_check

    def get_warmup_keys(self) -> list[tuple[str, int]]:
        return [("dsa_kpool", self.plan.max_rows)]

    def compile_many(self, keys) -> None:
        for key in keys:
            self.compile(key)

    def compile(self, key) -> None:
        # Compiles on fakes; any later compile raises (launch.warming_up).
        keys = self.stage.warmup(self.attentions, positions_dtype=POSITIONS_DTYPE)
        self.plan.warmed = self.self_check == "off" or self.check(keys)

    def check(self, keys) -> bool:
        """The warmup self-check (``self_check.py``) on this GPU: True when
        every compiled kernel gave stock's bytes. Else one error line (the
        kernel, the case, the seed to replay it) and the stage stays off, or,
        "strict", a RuntimeError."""
        from vllm.models.glm5next.nvidia.specialized_decode import self_check

        seed = int(os.environ.get(SELF_CHECK_SEED_ENV) or secrets.randbits(31))
        started = time.perf_counter()
        device = self.stage.pool_buffer.device
        problem = self_check.check(keys, seed, device)
        elapsed = time.perf_counter() - started
        if problem is None:
            logger.info(
                "GLM-5-Next specialized decode: self-check passed: %d kernel "
                "variants x %d cases, seed %d, %.2f s.",
                len(keys),
                self_check.CASES,
                seed,
                elapsed,
            )
            return True
        message = (
            f"GLM-5-Next specialized decode: self-check failed, {problem}; "
            f"dsa_kpool stays off and the decode runs stock (replay with "
            f"{SELF_CHECK_SEED_ENV}={seed})."
        )
        if self.self_check == "strict":
            raise RuntimeError(message)
        logger.error(message)
        return False


def _register_warmup(warmup: _KpoolWarmup) -> bool:
    """Registers the stage's kernels with the model runner's JIT warmup; False
    where none collects them (no CUDA, or a model built outside a runner), and
    the stage then never plans a step."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return False
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    if JitWarmupRegistry._active.get() is None:
        return False
    JitWarmupRegistry.register(warmup)  # type: ignore[arg-type]
    return True
