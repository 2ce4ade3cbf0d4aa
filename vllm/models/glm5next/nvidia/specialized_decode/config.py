# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The deployment's choice: ``additional_config`` and the environment read
into a ``DecodeConfig``, and what a deployment must have to run the
``dsa_kpool`` stage.

- ``decode_backend``: ``"auto"`` (default) runs the stock decode,
  ``"latency_specialized"`` the stages;
- ``specialized_decode_skip``: stage names to leave out;
- ``specialized_decode_self_check``: ``"on"`` / ``"off"`` / ``"strict"``,
  overridden by ``VLLM_GLM5NEXT_KPOOL_SELF_CHECK``;
- ``VLLM_GLM5NEXT_KPOOL_SELF_CHECK_SEED``: the self-check's seed (an
  integer; default a fresh one each warmup);
- ``kpool_select``: ``true`` runs the stage's own pool top-k (the same set
  as stock's, in ascending pool order: not stock's bytes), default
  ``false``.

Every setting is read and checked first, whatever the backend: a bad value
raises a ``ValueError`` that echoes it and says where it came from. Then,
with ``latency_specialized``, the requirements (one error lists every one
missed); under ``auto`` one warning names the settings that are set but
only matter with ``latency_specialized``. A key that looks like a setting
but is none (``decode-backend``, ``select_kpool``) warns with the nearest
valid key. vLLM is imported inside the functions.
"""

import difflib
import os
import re
from dataclasses import dataclass

from vllm.logger import init_logger

from .constants import ARCHITECTURES, DIM, POOL

logger = init_logger(__name__)

BACKEND_KEY = "decode_backend"
BACKEND = "latency_specialized"
BACKENDS = ("auto", BACKEND)
# The stages, by name; a deployment leaves some out with SKIP_KEY.
STAGE = "dsa_kpool"
STAGES = (STAGE,)
SKIP_KEY = "specialized_decode_skip"
SELF_CHECK_KEY = "specialized_decode_self_check"
SELF_CHECK_ENV = "VLLM_GLM5NEXT_KPOOL_SELF_CHECK"
SELF_CHECK_SEED_ENV = "VLLM_GLM5NEXT_KPOOL_SELF_CHECK_SEED"
SELF_CHECK_MODES = ("on", "off", "strict")
SELECT_KEY = "kpool_select"
CONFIG_KEYS = (BACKEND_KEY, SKIP_KEY, SELF_CHECK_KEY, SELECT_KEY)
ENV_VARS = (SELF_CHECK_ENV, SELF_CHECK_SEED_ENV)


@dataclass(frozen=True)
class DecodeConfig:
    backend: str = "auto"
    # The stages this deployment runs, in STAGES order.
    stages: tuple[str, ...] = STAGES
    # The warmup self-check: "on", "off" or "strict", and its seed (None: a
    # fresh one each warmup).
    self_check: str = "on"
    self_check_seed: int | None = None
    # The opt-in pool select in place of stock's top-k (not stock's bytes).
    select: bool = False
    # The settings given (config keys and environment variables), by name.
    given: tuple[str, ...] = ()


def read_settings(extra: dict, environ) -> DecodeConfig:
    """Every setting of ``extra`` (``additional_config``) and ``environ``,
    checked; raises ``ValueError`` for a bad value, echoed with its source."""
    warn_unknown_keys(extra)
    given = tuple(k for k in CONFIG_KEYS if k in extra)
    given += tuple(v for v in ENV_VARS if environ.get(v))
    backend = extra.get(BACKEND_KEY, "auto")
    if backend not in BACKENDS:
        raise _bad(BACKEND_KEY, backend, f"one of {list(BACKENDS)}")
    skip = extra.get(SKIP_KEY, [])
    if not isinstance(skip, list | tuple) or not all(name in STAGES for name in skip):
        raise _bad(SKIP_KEY, skip, f"a list of stage names out of {list(STAGES)}")
    if environ.get(SELF_CHECK_ENV):
        mode, source = environ[SELF_CHECK_ENV], f"environment {SELF_CHECK_ENV}"
    else:
        mode = extra.get(SELF_CHECK_KEY, "on")
        source = f"additional_config {SELF_CHECK_KEY}"
    if mode not in SELF_CHECK_MODES:
        raise ValueError(f"{source}={mode!r}: expected one of {list(SELF_CHECK_MODES)}")
    seed = environ.get(SELF_CHECK_SEED_ENV) or None
    if seed is not None:
        try:
            seed = int(seed)
        except ValueError:
            raise ValueError(
                f"environment {SELF_CHECK_SEED_ENV}={seed!r}: expected an integer"
            ) from None
    select = extra.get(SELECT_KEY, False)
    if not isinstance(select, bool):
        raise _bad(SELECT_KEY, select, "true or false")
    return DecodeConfig(
        backend=backend,
        stages=tuple(name for name in STAGES if name not in skip),
        self_check=mode,
        self_check_seed=seed,
        select=select,
        given=given,
    )


def _bad(key: str, value, expected: str) -> ValueError:
    return ValueError(f"additional_config {key}={value!r}: expected {expected}")


def specialized_decode_config(vllm_config, environ=os.environ) -> DecodeConfig | None:
    """The specialized decode settings, or None for the stock decode.

    Raises ValueError for a bad value (echoed, with its source) or, when a
    stage is on, for a deployment missing any requirement (all listed at
    once, each with the setting that changes it).
    """
    extra = vllm_config.additional_config
    config = read_settings(extra if isinstance(extra, dict) else {}, environ)
    if config.backend == "auto":
        ignored = [name for name in config.given if name != BACKEND_KEY]
        if ignored:
            logger.warning(
                "GLM-5-Next specialized decode: %s only take effect with "
                "additional_config %s=%s; ignored under %s=auto.",
                ", ".join(ignored),
                BACKEND_KEY,
                BACKEND,
                BACKEND_KEY,
            )
        return None
    if config.stages:
        missing = unsupported(vllm_config)
        if missing:
            raise ValueError(
                f"{BACKEND_KEY}={BACKEND} needs: {'; '.join(missing)}. Or leave "
                f"the stages out with additional_config {SKIP_KEY}="
                f"{list(config.stages)}, or use {BACKEND_KEY}=auto."
            )
    return config


def _words(key: str) -> frozenset[str]:
    return frozenset(w for w in re.split(r"[^a-z0-9]+", key) if w)


def warn_unknown_keys(extra: dict) -> None:
    """Warns for each key of ``extra`` that reads like a specialized decode
    setting (close to a valid key, the same words in another order, or a
    ``decode``/``specialized``/``kpool`` word) but is none, naming the
    nearest valid key."""
    for key in extra:
        if key in CONFIG_KEYS or not isinstance(key, str):
            continue
        normal = key.lower().replace("-", "_").replace("specialised", "specialized")
        near = [k for k in CONFIG_KEYS if _words(k) == _words(normal)]
        near = near or difflib.get_close_matches(normal, CONFIG_KEYS, n=1, cutoff=0.6)
        if near or _words(normal) & {"decode", "specialized", "kpool"}:
            logger.warning(
                "additional_config key %r is not a GLM-5-Next specialized "
                "decode setting and is ignored%s (valid keys: %s).",
                key,
                f"; did you mean {near[0]!r}?" if near else "",
                ", ".join(CONFIG_KEYS),
            )


def unsupported(vllm_config) -> list[str]:
    """Every requirement of the ``dsa_kpool`` stage this deployment misses,
    each naming the setting that changes it."""
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
        f"the GLM-5-Next model (architectures {' or '.join(ARCHITECTURES)}; "
        f"found {list(model.architectures or ())})": bool(
            set(model.architectures or ()) & set(ARCHITECTURES)
        ),
        f"the kpool sparse indexer of the model config: index_kpool {POOL} and "
        f"index_head_dim {DIM} with an index_topk (found index_topk "
        f"{getattr(text, 'index_topk', None)}, index_kpool {kpool}, "
        f"index_head_dim {head_dim})": (
            getattr(text, "index_topk", None) is not None
            and kpool == POOL
            and head_dim == DIM
        ),
        # A deferred top-k skips the stock DCP merge and filtered conversion.
        "no decode context parallelism (--decode-context-parallel-size 1; "
        f"found {parallel.decode_context_parallel_size})": (
            parallel.decode_context_parallel_size == 1
        ),
        # Micro-batches would interleave the layers' hand-offs.
        "no micro-batching (leave out --enable-dbo and ubatch_size)": (
            not parallel.use_ubatching
        ),
        # The routing is host code run at each eager step and capture; a
        # compiled forward would trace one decision into every step. vLLM
        # gives GLM-5-Next mode NONE with breakable CUDA graphs by default;
        # -O0 would also turn the CUDA graphs off.
        "no torch.compile of the model (compilation_config mode NONE: vLLM's "
        "default for GLM-5-Next, with breakable CUDA graphs, unless "
        "VLLM_USE_BREAKABLE_CUDAGRAPH=0; else -cc.mode=none; found "
        f"{CompilationMode(compilation.mode).name})": (
            compilation.mode == CompilationMode.NONE
        ),
        # A FULL graph replays its capture's routing, which must be decode's.
        "no FULL CUDA graphs of mixed prefill-decode batches (compilation_config "
        "cudagraph_mode FULL_AND_PIECEWISE, the default, FULL_DECODE_ONLY or "
        f"PIECEWISE; found {cudagraph_mode!s})": (
            cudagraph_mode is None or cudagraph_mode.mixed_mode() != CUDAGraphMode.FULL
        ),
        # Decode steps and graph captures must never compile a kernel.
        "JIT kernel warmup (kernel_config enable_jit_warmup=True)": bool(
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
