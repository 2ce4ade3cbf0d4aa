# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The deployment's choice: ``additional_config`` and the environment read
into a ``DecodeConfig``, and what a deployment must have to run the
``dsa_kpool`` stage. docs/reference.md tables the settings and the order
they are checked in. vLLM is imported inside the functions.
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
# kpool_select's values: off, every batch size, one wave of clusters.
SELECT_VALUES = (False, True, "one_wave")
SCORES_KEY = "kpool_scores"
CONFIG_KEYS = (BACKEND_KEY, SKIP_KEY, SELF_CHECK_KEY, SELECT_KEY, SCORES_KEY)
ENV_VARS = (SELF_CHECK_ENV, SELF_CHECK_SEED_ENV)


@dataclass(frozen=True)
class DecodeConfig:
    backend: str = "auto"
    # The stages this deployment runs, in STAGES order.
    stages: tuple[str, ...] = STAGES
    # The warmup self-check's mode and seed (None: the warmup's own).
    self_check: str = "on"
    self_check_seed: int | None = None
    # The opt-in pool select in place of stock's top-k (not stock's bytes),
    # at every batch size or (select_one_wave) where one wave holds its rows.
    select: bool = False
    select_one_wave: bool = False
    # The opt-in decode scores in place of DeepGEMM's (SM90, FP32 scales;
    # stock's bytes but where docs/reference.md says).
    scores: bool = False
    # The settings given (config keys and environment variables), by name.
    given: tuple[str, ...] = ()


def read_settings(extra: dict, environ) -> DecodeConfig:
    """Every setting of ``extra`` (``additional_config``) and ``environ``,
    checked; raises ``ValueError`` for a bad value, echoed with its source."""
    warn_unknown_keys(extra)
    warn_unknown_variables(environ)
    given = tuple(k for k in CONFIG_KEYS if k in extra)
    given += tuple(v for v in ENV_VARS if environ.get(v))
    backend = extra.get(BACKEND_KEY, "auto")
    if backend not in BACKENDS:
        raise _bad(BACKEND_KEY, backend, f"one of {list(BACKENDS)}")
    skip = extra.get(SKIP_KEY, [])
    if not isinstance(skip, list | tuple) or not all(name in STAGES for name in skip):
        raise _bad(SKIP_KEY, skip, f"a list of stage names out of {list(STAGES)}")
    # Both checked; the variable, where set, overrides the key.
    modes = {}
    if environ.get(SELF_CHECK_ENV):
        modes[SELF_CHECK_ENV] = environ[SELF_CHECK_ENV]
    if SELF_CHECK_KEY in extra:
        modes[SELF_CHECK_KEY] = extra[SELF_CHECK_KEY]
    for name, value in modes.items():
        if value not in SELF_CHECK_MODES:
            raise _bad(name, value, f"one of {list(SELF_CHECK_MODES)}")
    mode = next(iter(modes.values()), "on")
    seed = read_seed(environ.get(SELF_CHECK_SEED_ENV) or None)
    select = extra.get(SELECT_KEY, False)
    if not any(
        select is v if isinstance(v, bool) else select == v for v in SELECT_VALUES
    ):
        raise _bad(SELECT_KEY, select, 'true, false or "one_wave"')
    # A bool only: 1 or "true" would pass a truth test.
    scores = extra.get(SCORES_KEY, False)
    if not isinstance(scores, bool):
        raise _bad(SCORES_KEY, scores, "true or false")
    if len(set(modes.values())) > 1 and backend == BACKEND:
        logger.warning(
            "GLM-5-Next specialized decode: the self-check is %r from "
            "environment %s, which overrides additional_config %s=%r.",
            mode,
            SELF_CHECK_ENV,
            SELF_CHECK_KEY,
            extra[SELF_CHECK_KEY],
        )
    return DecodeConfig(
        backend=backend,
        stages=tuple(name for name in STAGES if name not in skip),
        self_check=mode,
        self_check_seed=seed,
        select=select is not False,
        select_one_wave=select == "one_wave",
        scores=scores,
        given=given,
    )


# A 31-bit seed, written as plain ASCII digits (no sign, space or "_").
SEED_DIGITS = re.compile(r"[0-9]+")
SEED_LIMIT = 2**31


def read_seed(text: str | None) -> int | None:
    """The self-check seed of ``VLLM_GLM5NEXT_KPOOL_SELF_CHECK_SEED`` (None:
    not set): decimal ASCII digits of a value below 2**31, else ValueError."""
    if text is None:
        return None
    # int() of a long string is slow or refused: count the digits first.
    digits = len(text.lstrip("0"))
    if SEED_DIGITS.fullmatch(text) and digits <= 10 and int(text) < SEED_LIMIT:
        return int(text)
    raise _bad(SELF_CHECK_SEED_ENV, text, f"a decimal integer in [0, {SEED_LIMIT - 1}]")


# The most characters of a value an error or warning echoes.
ECHO_LIMIT = 80


def echo(value) -> str:
    """``repr(value)``, cut to ``ECHO_LIMIT`` characters with "..." where
    longer: a 5,000-digit seed must not fill the log."""
    text = repr(value)
    return text if len(text) <= ECHO_LIMIT else text[: ECHO_LIMIT - 3] + "..."


def _bad(name: str, value, expected: str) -> ValueError:
    """A bad setting's error: ``value`` echoed (cut) with its source."""
    source = "environment" if name in ENV_VARS else "additional_config"
    return ValueError(f"{source} {name}={echo(value)}: expected {expected}")


def specialized_decode_config(vllm_config, environ=os.environ) -> DecodeConfig | None:
    """The specialized decode settings, or None for the stock decode; raises
    ValueError for a bad value or missed requirements (all listed at once)."""
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        # vLLM also takes an object with compute_hash(); its settings, if
        # any, cannot be read here, so it is refused rather than ignored.
        raise ValueError(
            f"additional_config={echo(extra)} ({type(extra).__name__}): expected "
            "a dict of settings, a JSON object such as "
            f'{{"{BACKEND_KEY}": "{BACKEND}"}}'
        )
    config = read_settings(extra, environ)
    if config.backend == "auto":
        ignored = [name for name in config.given if name != BACKEND_KEY]
        if ignored:
            logger.warning(
                "GLM-5-Next specialized decode: %s %s effect only with "
                "additional_config %s=%s; ignored under %s=auto.",
                ", ".join(ignored),
                "takes" if len(ignored) == 1 else "take",
                BACKEND_KEY,
                BACKEND,
                BACKEND_KEY,
            )
        return None
    if config.stages and (missing := unsupported(vllm_config)):
        raise ValueError(
            f"{BACKEND_KEY}={BACKEND} needs: {'; '.join(missing)}. Or leave "
            f"the stages out with additional_config {SKIP_KEY}="
            f"{list(config.stages)}, or use {BACKEND_KEY}=auto."
        )
    return config


def _words(key: str) -> frozenset[str]:
    return frozenset(w for w in re.split(r"[^a-z0-9]+", key) if w)


# Words every setting name shares; a name made of these alone is near none.
GENERIC = frozenset({"decode", "specialized", "kpool", "glm5next", "vllm"})


def nearest(name: str, valid: tuple[str, ...]) -> str | None:
    """The valid name ``name`` (lower case, ``_`` between words) most likely
    meant: the same words in another order, two or more of one's words (not
    only generic ones), its words run together, else the closest spelling."""
    words, joined = _words(name), name.replace("_", "")
    for near in (
        [k for k in valid if _words(k) == words],
        [k for k in valid if len(words) > 1 and words - GENERIC and words < _words(k)],
        [k for k in valid if len(joined) >= 8 and k.replace("_", "").endswith(joined)],
        difflib.get_close_matches(name, valid, n=1, cutoff=0.6),
    ):
        if near:
            return near[0]
    return None


def warn_unknown_keys(extra: dict) -> None:
    """Warns for each key of ``extra`` that reads like a specialized decode
    setting (near a valid key, or with a ``decode``/``specialized``/``kpool``
    word) but is none, naming the nearest valid key."""
    for key in extra:
        if key in CONFIG_KEYS or not isinstance(key, str):
            continue
        normal = key.lower().replace("-", "_").replace("specialised", "specialized")
        near = nearest(normal, CONFIG_KEYS)
        if near or _words(normal) & {"decode", "specialized", "kpool"}:
            logger.warning(
                "additional_config key %s is not a GLM-5-Next specialized "
                "decode setting and is ignored%s (valid keys: %s).",
                echo(key),
                f"; did you mean {near!r}?" if near else "",
                ", ".join(CONFIG_KEYS),
            )


def _tail(variable: str) -> str:
    """A variable's name after ``VLLM_`` and ``GLM5NEXT_``, lower case."""
    return re.sub(r"^vllm_(glm5_?next_)?", "", variable.lower())


def warn_unknown_variables(environ) -> None:
    """Warns for each environment variable named like this stage's
    (``VLLM_`` with ``GLM5NEXT`` or ``KPOOL``) but none of them, naming the
    nearest."""
    for name in environ:
        upper = name.upper()
        ours = "GLM5NEXT" in upper.replace("_", "") or "KPOOL" in upper
        if name in ENV_VARS or not upper.startswith("VLLM_") or not ours:
            continue
        # Compared after the prefix, which every one of them shares.
        tails = {_tail(v): v for v in ENV_VARS}
        near = tails.get(nearest(_tail(name), tuple(tails)))
        logger.warning(
            "environment variable %s is not a GLM-5-Next specialized decode "
            "variable and is ignored%s (valid variables: %s).",
            name,
            f"; did you mean {near}?" if near else "",
            ", ".join(ENV_VARS),
        )


def unsupported(vllm_config) -> list[str]:
    """Every requirement of the ``dsa_kpool`` stage this deployment misses,
    each naming the setting that changes it."""
    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    architectures = list(model.architectures or ())
    text = model.hf_text_config
    topk = getattr(text, "index_topk", None)
    kpool = getattr(text, "index_kpool", None)
    head_dim = getattr(text, "index_head_dim", None)
    parallel = vllm_config.parallel_config
    dcp = parallel.decode_context_parallel_size
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
        f"found {architectures})": bool(set(architectures) & set(ARCHITECTURES)),
        f"the kpool sparse indexer of the model config: index_kpool {POOL} and "
        f"index_head_dim {DIM} with an index_topk (found index_topk {topk}, "
        f"index_kpool {kpool}, index_head_dim {head_dim})": (
            topk is not None and kpool == POOL and head_dim == DIM
        ),
        # A deferred top-k skips the stock DCP merge and filtered conversion.
        "no decode context parallelism (--decode-context-parallel-size 1; "
        f"found {dcp})": dcp == 1,
        # Micro-batches would interleave the layers' hand-offs.
        "no micro-batching (leave out --enable-dbo and ubatch_size)": (
            not parallel.use_ubatching
        ),
        # The routing is host code run at each eager step and capture; a
        # compiled forward would trace one decision into every step.
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
    rows = scheduler.max_num_seqs * decode_next_n(vllm_config)
    return min(scheduler.max_num_batched_tokens, rows)


def decode_next_n(vllm_config) -> int:
    """The most query rows a decode request has in one step (its ``next_n``):
    1 + the speculative tokens."""
    spec = vllm_config.speculative_config
    return 1 + ((spec.num_speculative_tokens or 0) if spec is not None else 0)
