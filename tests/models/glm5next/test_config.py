# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``config.py``: the deployment's settings and the messages a user acts on,
as the exact strings they read. Every setting and environment variable is
read and checked first, whatever the backend (a bad value echoed with where
it came from); then, with ``latency_specialized``, the requirements (all
listed in one error, each with the setting that changes it); under
``auto`` one warning names the given settings that only matter with
``latency_specialized``; a key that reads like a setting but is none warns
with the nearest valid key (CPU)."""

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm.config import CompilationMode, CUDAGraphMode
from vllm.models.glm5next.nvidia.specialized_decode import config as sd

PACKAGE = Path(sd.__file__).parent
ON = {"decode_backend": "latency_specialized"}
CHECK_ENV, SEED_ENV = (
    "VLLM_GLM5NEXT_KPOOL_SELF_CHECK",
    "VLLM_GLM5NEXT_KPOOL_SELF_CHECK_SEED",
)
VALID_KEYS = (
    "decode_backend, specialized_decode_skip, specialized_decode_self_check, "
    "kpool_select, kpool_scores"
)
GPU = "an NVIDIA SM90 (Hopper) or SM100-family (Blackwell) GPU"


def read(make_config, extra, **overrides):
    return sd.specialized_decode_config(
        make_config(additional_config=extra, **overrides)
    )


def messages(vllm_log) -> list[tuple[int, str]]:
    return [
        (r.levelno, r.getMessage()) for r in vllm_log.records if r.name == sd.__name__
    ]


def test_names():
    assert (sd.BACKEND_KEY, sd.BACKEND, sd.STAGE) == (
        "decode_backend",
        "latency_specialized",
        "dsa_kpool",
    )
    assert tuple(VALID_KEYS.split(", ")) == sd.CONFIG_KEYS
    assert sd.ENV_VARS == (CHECK_ENV, SEED_ENV)


def test_config_imports_no_vllm_at_load():
    """``constants.py`` imports nothing and ``config.py`` only ``vllm.logger``
    (the GPU tier's shim provides torch and that logger)."""
    script = textwrap.dedent(f"""
        import importlib.util, logging, sys, types
        package = "vllm.models.glm5next.nvidia.specialized_decode"
        names = ["vllm", "vllm.models", "vllm.models.glm5next",
                 "vllm.models.glm5next.nvidia", package]
        for name in names:
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].__path__ = []
        log = types.ModuleType("vllm.logger")
        log.init_logger = logging.getLogger
        sys.modules["vllm.logger"] = log
        for name in ("constants", "config"):
            path = {str(PACKAGE)!r} + "/" + name + ".py"
            spec = importlib.util.spec_from_file_location(package + "." + name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        assert module.DecodeConfig(stages=()).self_check == "on"
        loaded = sorted(m for m in sys.modules if m.startswith("vllm"))
        assert loaded == sorted(names + ["vllm.logger", package + ".constants",
                                         package + ".config"]), loaded
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_supported_deployment(gpu, make_config, vllm_log):
    assert read(make_config, ON) == sd.DecodeConfig(
        backend="latency_specialized", stages=("dsa_kpool",), given=("decode_backend",)
    )
    assert messages(vllm_log) == []
    for capability in (100, 103):
        gpu(capability)
        assert sd.unsupported(make_config()) == []


# --- auto ------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, {"decode_backend": "auto"}])
def test_auto_is_stock(gpu, make_config, vllm_log, extra):
    gpu(None)  # no requirement is checked
    assert read(make_config, extra) is None
    assert messages(vllm_log) == []


class Hashable:
    """A non-dict ``additional_config`` vLLM accepts (``SupportsHash``)."""

    def compute_hash(self) -> str:
        return "0"

    def __repr__(self) -> str:
        return "Hashable()"


@pytest.mark.parametrize(
    "extra, echoed",
    [
        (None, "None (NoneType)"),
        ("latency_specialized", "'latency_specialized' (str)"),
        (
            ["decode_backend", "latency_specialized"],
            "['decode_backend', 'latency_specialized'] (list)",
        ),
        (Hashable(), "Hashable() (Hashable)"),
        (["x"] * 100, "[" + "'x', " * 15 + "'... (list)"),
    ],
)
def test_a_non_dict_additional_config_is_refused_by_name(
    gpu, make_config, vllm_log, extra, echoed
):
    """Not read as ``{}`` (stock, the settings it meant lost): refused,
    naming ``additional_config`` and what it must be, its value cut."""
    gpu(None)
    with pytest.raises(ValueError) as error:
        read(make_config, extra)
    assert str(error.value) == (
        f"additional_config={echoed}: expected a dict of settings, a JSON "
        'object such as {"decode_backend": "latency_specialized"}'
    )
    assert messages(vllm_log) == []


def ignored(names: str) -> str:
    verb = "take" if ", " in names else "takes"
    return (
        f"GLM-5-Next specialized decode: {names} {verb} effect only with "
        "additional_config decode_backend=latency_specialized; ignored under "
        "decode_backend=auto."
    )


def test_the_ignored_settings_warning_agrees_with_their_number():
    assert ignored("kpool_select").startswith(
        "GLM-5-Next specialized decode: kpool_select takes effect only with "
    )
    assert ignored("kpool_select, kpool_scores").startswith(
        "GLM-5-Next specialized decode: kpool_select, kpool_scores take effect "
    )


@pytest.mark.parametrize(
    "extra, environ, names",
    [
        ({"kpool_select": True}, {}, "kpool_select"),
        ({"kpool_scores": False}, {}, "kpool_scores"),
        (
            {"decode_backend": "auto", "specialized_decode_skip": []},
            {},
            "specialized_decode_skip",
        ),
        (
            {"kpool_select": False, "specialized_decode_self_check": "off"},
            {},
            "specialized_decode_self_check, kpool_select",
        ),
        (
            {"kpool_scores": True, "kpool_select": "one_wave"},
            {},
            "kpool_select, kpool_scores",
        ),
        ({}, {CHECK_ENV: "strict"}, CHECK_ENV),
        (
            {"specialized_decode_skip": ["dsa_kpool"]},
            {SEED_ENV: "5", CHECK_ENV: "off"},
            f"specialized_decode_skip, {CHECK_ENV}, {SEED_ENV}",
        ),
    ],
)
def test_auto_warns_once_for_what_it_ignores(
    gpu, make_config, monkeypatch, vllm_log, extra, environ, names
):
    """Under ``auto``, the given settings that only matter with
    ``latency_specialized``, config keys then environment variables, in one
    warning (no GPU needed)."""
    gpu(None)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert read(make_config, extra) is None
    assert messages(vllm_log) == [(logging.WARNING, ignored(names))]


# --- Bad values, before anything else ------------------------------------------

BAD = [
    pytest.param(
        {"decode_backend": "fast"},
        {},
        "additional_config decode_backend='fast': expected one of "
        "['auto', 'latency_specialized']",
        id="backend",
    ),
    pytest.param(
        {"specialized_decode_skip": "all"},
        {},
        "additional_config specialized_decode_skip='all': expected a list of stage "
        "names out of ['dsa_kpool']",
        id="skip-str",
    ),
    pytest.param(
        {"specialized_decode_skip": ["x"]},
        {},
        "additional_config specialized_decode_skip=['x']: expected a list of stage "
        "names out of ['dsa_kpool']",
        id="skip-name",
    ),
    pytest.param(
        {"specialized_decode_self_check": "loud"},
        {},
        "additional_config specialized_decode_self_check='loud': expected one of "
        "['on', 'off', 'strict']",
        id="self-check",
    ),
    pytest.param(
        {"specialized_decode_self_check": "on"},
        {CHECK_ENV: "yes"},
        "environment VLLM_GLM5NEXT_KPOOL_SELF_CHECK='yes': expected one of "
        "['on', 'off', 'strict']",
        id="self-check-env",
    ),
    pytest.param(
        {"specialized_decode_self_check": "loud"},
        {CHECK_ENV: "off"},
        "additional_config specialized_decode_self_check='loud': expected one of "
        "['on', 'off', 'strict']",
        id="self-check-overridden",
    ),
    *(
        pytest.param(
            {},
            {SEED_ENV: seed},
            f"environment VLLM_GLM5NEXT_KPOOL_SELF_CHECK_SEED={seed!r}: expected a "
            "decimal integer in [0, 2147483647]",
            id=f"seed-{name}",
        )
        for name, seed in [
            ("word", "abc"),
            ("negative", "-7"),
            ("plus", "+7"),
            ("underscore", "1_000"),
            ("spaces", " 7 "),
            ("newline", "7\n"),
            ("hex", "0x1f"),
            ("arabic-indic", "\u0667"),
            ("fullwidth", "\uff17"),
            ("2**31", "2147483648"),
            ("10**23", str(10**23)),
        ]
    ),
    pytest.param(
        {},
        {SEED_ENV: "9" * 5000},
        f"environment VLLM_GLM5NEXT_KPOOL_SELF_CHECK_SEED='{'9' * 76}...: expected"
        " a decimal integer in [0, 2147483647]",
        id="seed-5000-digits-cut",
    ),
    pytest.param(
        {"kpool_select": "y" * 78},
        {},
        f"additional_config kpool_select='{'y' * 78}': expected true, false or "
        '"one_wave"',
        id="select-80-characters-whole",
    ),
    pytest.param(
        {"kpool_select": "y" * 79},
        {},
        f"additional_config kpool_select='{'y' * 76}...: expected true, false or "
        '"one_wave"',
        id="select-81-characters-cut",
    ),
    pytest.param(
        {"specialized_decode_skip": list(range(1000))},
        {},
        "additional_config specialized_decode_skip=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, "
        "10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21...: expected a list of "
        "stage names out of ['dsa_kpool']",
        id="skip-long-list-cut",
    ),
    pytest.param(
        {"kpool_select": "yes"},
        {},
        "additional_config kpool_select='yes': expected true, false or \"one_wave\"",
        id="select-str",
    ),
    pytest.param(
        {"kpool_select": 1},
        {},
        'additional_config kpool_select=1: expected true, false or "one_wave"',
        id="select-int",
    ),
    pytest.param(
        {"kpool_select": None},
        {},
        'additional_config kpool_select=None: expected true, false or "one_wave"',
        id="select-none",
    ),
    *(
        pytest.param(
            {"kpool_scores": value},
            {},
            f"additional_config kpool_scores={value!r}: expected true or false",
            id=f"scores-{name}",
        )
        for name, value in [
            ("yes", "yes"),
            ("str-true", "true"),
            ("one-wave", "one_wave"),
            ("int", 1),
            ("zero", 0),
            ("none", None),
            ("list", [True]),
        ]
    ),
]


@pytest.mark.parametrize("backend", [{}, ON])
@pytest.mark.parametrize("extra, environ, message", BAD)
def test_bad_values_first_whatever_the_backend(
    gpu, make_config, monkeypatch, backend, extra, environ, message
):
    """A bad value is an error under ``auto`` too, and comes before the
    requirements (here: no GPU, every one missed)."""
    gpu(None)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    extra = {**backend, **extra}
    overrides = dict(compilation_config__mode=CompilationMode.VLLM_COMPILE)
    with pytest.raises(ValueError) as error:
        read(make_config, extra, **overrides)
    assert str(error.value) == message


def test_settings_are_checked_in_order(gpu, make_config, monkeypatch):
    """With every setting bad, the errors come in the order of the settings:
    the backend, the skipped stages, the self-check (the environment's over
    the config's), its seed, the select, the scores."""
    extra = {
        "decode_backend": "fast",
        "specialized_decode_skip": "all",
        "specialized_decode_self_check": "loud",
        "kpool_select": "yes",
        "kpool_scores": "yes",
    }
    monkeypatch.setenv(CHECK_ENV, "yes")
    monkeypatch.setenv(SEED_ENV, "abc")
    seen = []
    for fix in (
        ("decode_backend", "latency_specialized"),
        ("specialized_decode_skip", []),
        (CHECK_ENV, None),
        ("specialized_decode_self_check", "on"),
        (SEED_ENV, None),
        ("kpool_select", True),
        ("kpool_scores", True),
    ):
        with pytest.raises(ValueError) as error:
            read(make_config, extra)
        seen.append(str(error.value).split("=")[0])
        if fix[1] is None:
            monkeypatch.delenv(fix[0])
        else:
            extra[fix[0]] = fix[1]
    assert seen == [
        "additional_config decode_backend",
        "additional_config specialized_decode_skip",
        f"environment {CHECK_ENV}",
        "additional_config specialized_decode_self_check",
        f"environment {SEED_ENV}",
        "additional_config kpool_select",
        "additional_config kpool_scores",
    ]
    config = read(make_config, extra)
    assert config.select is True and config.scores is True


# --- Each setting's good values ------------------------------------------------


@pytest.mark.parametrize("mode", ["on", "off", "strict"])
def test_self_check_setting(gpu, make_config, monkeypatch, mode):
    """The config's mode, overridden by the environment."""
    extra = {**ON, "specialized_decode_self_check": mode}
    assert read(make_config, extra).self_check == mode
    monkeypatch.setenv(CHECK_ENV, "off")
    config = read(make_config, extra)
    assert config.self_check == "off"
    assert config.given == (
        "decode_backend",
        "specialized_decode_self_check",
        CHECK_ENV,
    )


@pytest.mark.parametrize(
    "value, seed",
    [("123", 123), ("0", 0), ("007", 7), ("2147483647", 2**31 - 1), ("", None)],
)
def test_self_check_seed(gpu, make_config, monkeypatch, value, seed):
    """ASCII decimal digits of a 31-bit value; empty: not given."""
    monkeypatch.setenv(SEED_ENV, value)
    config = read(make_config, ON)
    assert config.self_check_seed == seed
    assert (SEED_ENV in config.given) is bool(value)


def override(mode: str, key: str) -> tuple[int, str]:
    return (
        logging.WARNING,
        (
            f"GLM-5-Next specialized decode: the self-check is {mode!r} from "
            f"environment {CHECK_ENV}, which overrides additional_config "
            f"specialized_decode_self_check={key!r}."
        ),
    )


def test_an_overriding_variable_is_named(gpu, make_config, monkeypatch, vllm_log):
    """The variable over a different key's value: one warning naming both,
    with ``latency_specialized`` (under ``auto`` the warning of what is
    ignored says it); the same value: none."""
    monkeypatch.setenv(CHECK_ENV, "strict")
    extra = {**ON, "specialized_decode_self_check": "off"}
    assert read(make_config, extra).self_check == "strict"
    assert messages(vllm_log) == [override("strict", "off")]
    vllm_log.clear()
    read(make_config, {**extra, "specialized_decode_self_check": "strict"})
    assert messages(vllm_log) == []
    read(make_config, {**extra, "decode_backend": "auto"})
    names = f"specialized_decode_self_check, {CHECK_ENV}"
    assert messages(vllm_log) == [(logging.WARNING, ignored(names))]


@pytest.mark.parametrize(
    "value, select, one_wave",
    [(True, True, False), (False, False, False), ("one_wave", True, True)],
)
def test_select_is_opt_in(gpu, make_config, value, select, one_wave):
    """``kpool_select`` (default false) turns on the select at every batch
    size (true) or only where one wave holds the rows ("one_wave")."""
    assert read(make_config, ON).select is False
    config = read(make_config, {**ON, "kpool_select": value})
    assert (config.select, config.select_one_wave) == (select, one_wave)


@pytest.mark.parametrize("value", [True, False])
def test_scores_is_opt_in(gpu, make_config, value):
    """``kpool_scores`` (default false) turns on the stage's decode scores,
    apart from the select."""
    assert read(make_config, ON).scores is False
    config = read(make_config, {**ON, "kpool_scores": value})
    assert config.scores is value and config.select is False
    assert config.given == ("decode_backend", "kpool_scores")


def test_left_out_stage_needs_nothing(gpu, make_config):
    gpu(None)
    config = read(make_config, {**ON, "specialized_decode_skip": ["dsa_kpool"]})
    assert config.stages == () and config.backend == "latency_specialized"
    assert hash(config) == hash(sd.DecodeConfig(**vars(config)))  # a frozen value


# --- Keys that are no setting ----------------------------------------------------


@pytest.mark.parametrize(
    "key, near",
    [
        ("select_kpool", "kpool_select"),
        ("decode-backend", "decode_backend"),
        ("Decode_Backend", "decode_backend"),
        ("specialized_decode_skips", "specialized_decode_skip"),
        ("specialised_decode_self_check", "specialized_decode_self_check"),
        ("specialized_decode_selfcheck", "specialized_decode_self_check"),
        ("decode", "decode_backend"),
        ("kpool-select", "kpool_select"),
        ("kpool_score", "kpool_scores"),
        ("scores_kpool", "kpool_scores"),
        ("kpool-scores", "kpool_scores"),
        ("KPOOL_SCORES", "kpool_scores"),
        ("self_check", "specialized_decode_self_check"),
        ("self-check", "specialized_decode_self_check"),
        ("selfcheck", "specialized_decode_self_check"),
        ("decode_skip", "specialized_decode_skip"),
        # A decode/specialized/kpool word without a valid key near it.
        ("kv_decode_speedup", None),
        ("use_specialized", None),
        ("kpool", None),
    ],
)
@pytest.mark.parametrize("backend", [{}, ON])
def test_unknown_keys_warn_with_the_nearest(
    gpu, make_config, vllm_log, backend, key, near
):
    """A key that reads like a specialized decode setting but is none warns,
    whatever the backend (the setting it meant is lost), naming the nearest
    valid key where one is close."""
    read(make_config, {**backend, key: "x"})
    hint = f"; did you mean {near!r}?" if near else ""
    assert messages(vllm_log) == [
        (
            logging.WARNING,
            (
                f"additional_config key {key!r} is not a GLM-5-Next specialized decode "
                f"setting and is ignored{hint} (valid keys: {VALID_KEYS})."
            ),
        )
    ]


def test_a_long_unknown_key_is_cut_in_its_warning(gpu, make_config, vllm_log):
    key = "kpool_" + "z" * 200
    read(make_config, {key: "x"})
    ((level, message),) = messages(vllm_log)
    assert message == (
        f"additional_config key 'kpool_{'z' * 70}... is not a GLM-5-Next "
        f"specialized decode setting and is ignored (valid keys: {VALID_KEYS})."
    )


VALID_VARIABLES = f"{CHECK_ENV}, {SEED_ENV}"


@pytest.mark.parametrize(
    "name, near",
    [
        ("VLLM_GLM5NEXT_KPOOL_SELFCHECK", CHECK_ENV),
        ("VLLM_GLM5NEXT_KPOOL_SELF_CHEK", CHECK_ENV),
        ("VLLM_GLM5_NEXT_KPOOL_SELF_CHECK", CHECK_ENV),
        ("VLLM_GLM5NEXT_KPOOL_SEED", SEED_ENV),
        ("VLLM_GLM5NEXT_KPOOL_SELF_CHECK_SEEDS", SEED_ENV),
        ("VLLM_KPOOL_SELF_CHECK", CHECK_ENV),
        ("VLLM_GLM5NEXT_FAST", None),
    ],
)
@pytest.mark.parametrize("backend", [{}, ON])
def test_unknown_variables_warn_with_the_nearest(
    gpu, make_config, monkeypatch, vllm_log, backend, name, near
):
    """A ``VLLM_`` variable named like this stage's (``GLM5NEXT`` or
    ``KPOOL`` in it) but none of them warns, whatever the backend, naming
    the nearest valid variable where one is close."""
    monkeypatch.setenv(name, "on")
    read(make_config, backend)
    hint = f"; did you mean {near}?" if near else ""
    assert messages(vllm_log) == [
        (
            logging.WARNING,
            (
                f"environment variable {name} is not a GLM-5-Next specialized decode "
                f"variable and is ignored{hint} (valid variables: {VALID_VARIABLES})."
            ),
        )
    ]


def test_other_variables_do_not_warn(gpu, make_config, monkeypatch, vllm_log):
    for name in ("VLLM_USE_BREAKABLE_CUDAGRAPH", "KPOOL_SEED", "VLLM_GLM_FAST"):
        monkeypatch.setenv(name, "1")
    read(make_config, ON)
    assert messages(vllm_log) == []


def test_other_keys_do_not_warn(gpu, make_config, vllm_log):
    extra = {
        **ON,
        "enable_hisparse": True,
        3: "x",
        "specialized_decode_self_check": "off",
    }
    extra["specialized_decode_skip"] = []
    read(make_config, extra)
    assert messages(vllm_log) == []


# --- Requirements ----------------------------------------------------------------

ARCHS = "architectures Glm5NextForCausalLM or Glm5NextForConditionalGeneration"


@pytest.mark.parametrize(
    "overrides, needs",
    [
        ({}, None),
        (
            dict(model_config__architectures=["DeepseekV32ForCausalLM"]),
            f"the GLM-5-Next model ({ARCHS}; found ['DeepseekV32ForCausalLM'])",
        ),
        (
            dict(model_config__index_kpool=2),
            (
                "the kpool sparse indexer of the model config: index_kpool 4 and "
                "index_head_dim 128 with an index_topk (found index_topk 2048, "
                "index_kpool 2, index_head_dim 128)"
            ),
        ),
        (
            dict(model_config__index_head_dim=64),
            (
                "the kpool sparse indexer of the model config: index_kpool 4 and "
                "index_head_dim 128 with an index_topk (found index_topk 2048, "
                "index_kpool 4, index_head_dim 64)"
            ),
        ),
        (
            dict(model_config__index_topk=None),
            (
                "the kpool sparse indexer of the model config: index_kpool 4 and "
                "index_head_dim 128 with an index_topk (found index_topk None, "
                "index_kpool 4, index_head_dim 128)"
            ),
        ),
        (
            dict(parallel_config__decode_context_parallel_size=2),
            "no decode context parallelism (--decode-context-parallel-size 1; found 2)",
        ),
        (
            dict(parallel_config__use_ubatching=True),
            "no micro-batching (leave out --enable-dbo and ubatch_size)",
        ),
        (
            dict(kernel_config__enable_jit_warmup=False),
            "JIT kernel warmup (kernel_config enable_jit_warmup=True)",
        ),
    ],
)
def test_each_requirement_names_its_setting(gpu, make_config, overrides, needs):
    assert sd.unsupported(make_config(**overrides)) == ([needs] if needs else [])


@pytest.mark.parametrize("mode", list(CompilationMode))
def test_every_compile_mode(gpu, make_config, mode):
    """Every compilation mode of vLLM 0.33.0 against "no torch.compile":
    only NONE passes, and the error names the mode found."""
    missing = sd.unsupported(make_config(compilation_config__mode=mode))
    found = {"NONE": None, "STOCK_TORCH_COMPILE": "STOCK_TORCH_COMPILE"}
    found |= {"DYNAMO_TRACE_ONCE": "DYNAMO_TRACE_ONCE", "VLLM_COMPILE": "VLLM_COMPILE"}
    assert set(found) == {m.name for m in CompilationMode}
    if found[mode.name] is None:
        assert missing == []
    else:
        assert missing == [
            (
                "no torch.compile of the model (compilation_config mode NONE: "
                "vLLM's default for GLM-5-Next, with breakable CUDA graphs, unless "
                "VLLM_USE_BREAKABLE_CUDAGRAPH=0; else -cc.mode=none; found "
                f"{found[mode.name]})"
            )
        ]


@pytest.mark.parametrize("mode", [None, *CUDAGraphMode])
def test_every_cudagraph_mode(gpu, make_config, mode):
    """Only FULL graphs of mixed prefill-decode batches are refused."""
    missing = sd.unsupported(make_config(compilation_config__cudagraph_mode=mode))
    if mode is CUDAGraphMode.FULL:
        assert missing == [
            (
                "no FULL CUDA graphs of mixed prefill-decode batches "
                "(compilation_config cudagraph_mode FULL_AND_PIECEWISE, the default, "
                "FULL_DECODE_ONLY or PIECEWISE; found FULL)"
            )
        ]
    else:
        assert missing == []


@pytest.mark.parametrize("capability", [None, 80, 89, 120])
def test_gpu_requirement(gpu, make_config, capability):
    gpu(capability)
    assert sd.unsupported(make_config()) == [GPU]


def test_one_error_lists_every_requirement(gpu, make_config):
    gpu(80)
    config = make_config(
        model_config__architectures=["LlamaForCausalLM"],
        model_config__index_topk=None,
        parallel_config__decode_context_parallel_size=2,
        parallel_config__use_ubatching=True,
        compilation_config__mode=CompilationMode.VLLM_COMPILE,
        compilation_config__cudagraph_mode=CUDAGraphMode.FULL,
        kernel_config__enable_jit_warmup=False,
    )
    with pytest.raises(ValueError) as error:
        sd.specialized_decode_config(config)
    assert str(error.value) == (
        f"decode_backend=latency_specialized needs: {GPU}; the GLM-5-Next model "
        f"({ARCHS}; found ['LlamaForCausalLM']); the kpool sparse indexer of the "
        "model config: index_kpool 4 and index_head_dim 128 with an index_topk "
        "(found index_topk None, index_kpool 4, index_head_dim 128); no decode "
        "context parallelism (--decode-context-parallel-size 1; found 2); no "
        "micro-batching (leave out --enable-dbo and ubatch_size); no torch.compile "
        "of the model (compilation_config mode NONE: vLLM's default for GLM-5-Next, "
        "with breakable CUDA graphs, unless VLLM_USE_BREAKABLE_CUDAGRAPH=0; else "
        "-cc.mode=none; found VLLM_COMPILE); no FULL CUDA graphs of mixed "
        "prefill-decode batches (compilation_config cudagraph_mode "
        "FULL_AND_PIECEWISE, the default, FULL_DECODE_ONLY or PIECEWISE; found "
        "FULL); JIT kernel "
        "warmup (kernel_config enable_jit_warmup=True). Or leave the stages out "
        "with additional_config specialized_decode_skip=['dsa_kpool'], or use "
        "decode_backend=auto."
    )


@pytest.mark.parametrize(
    "seqs, spec, tokens, rows",
    [
        (64, 3, 8192, 256),
        (64, None, 8192, 64),
        (64, 0, 8192, 64),
        (64, 3, 128, 128),
        (8, 1, 8192, 16),
    ],
)
def test_decode_capacity(make_config, seqs, spec, tokens, rows):
    config = make_config(
        scheduler_config__max_num_seqs=seqs,
        scheduler_config__max_num_batched_tokens=tokens,
    )
    if spec is None:
        config.speculative_config = None
    else:
        config.speculative_config.num_speculative_tokens = spec
    assert sd.decode_capacity(config) == rows
