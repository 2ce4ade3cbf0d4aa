# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``config.py``: the deployment's settings, the errors a user can act on
(each bad value echoed with where it came from, each unmet requirement with
the setting that changes it, misspelled keys named) and the decode capacity
(CPU)."""

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kpool_harness import make_config

from vllm.config import CompilationMode, CUDAGraphMode
from vllm.models.glm5next.nvidia.specialized_decode import config as sd
from vllm.models.glm5next.nvidia.specialized_decode.constants import (
    SELF_CHECK_ENV,
    SELF_CHECK_KEY,
)

PACKAGE = Path(sd.__file__).parent
ALL_REQUIREMENTS = 8
ON = {"decode_backend": "latency_specialized"}


@pytest.fixture
def gpu(fake_gpu, monkeypatch):
    """An SM90 GPU unless the test picks another; no self-check override."""
    monkeypatch.delenv(SELF_CHECK_ENV, raising=False)
    fake_gpu(90)
    return fake_gpu


def test_config_imports_no_vllm_at_load():
    """``constants.py`` imports nothing and ``config.py`` only ``vllm.logger``
    (the kernel-only environment provides torch and that logger)."""
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


@pytest.mark.parametrize(
    "extra", [None, {}, {"decode_backend": "auto"}, {"specialized_decode_skip": []}]
)
def test_auto_is_stock(gpu, extra):
    gpu(None)  # nothing is checked
    assert sd.specialized_decode_config(make_config(additional_config=extra)) is None


def test_supported_deployment(gpu):
    config = sd.specialized_decode_config(make_config())
    assert config == sd.DecodeConfig(stages=("dsa_kpool",))
    gpu(100)
    assert sd.unsupported(make_config()) == []
    gpu(103)
    assert sd.unsupported(make_config()) == []


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"decode_backend": "fast"},
            (
                "additional_config decode_backend='fast': expected one of "
                "['auto', 'latency_specialized']"
            ),
        ),
        (
            {**ON, "specialized_decode_skip": "dsa_kpool"},
            (
                "additional_config specialized_decode_skip='dsa_kpool': expected a "
                "list of stage names out of ['dsa_kpool']"
            ),
        ),
        (
            {**ON, "specialized_decode_skip": ["x"]},
            (
                "additional_config specialized_decode_skip=['x']: expected a list of "
                "stage names out of ['dsa_kpool']"
            ),
        ),
        (
            {**ON, SELF_CHECK_KEY: "loud"},
            (
                "additional_config specialized_decode_self_check='loud': expected one "
                "of ['on', 'off', 'strict']"
            ),
        ),
    ],
)
def test_bad_values_are_echoed_with_their_source(gpu, extra, message):
    with pytest.raises(ValueError) as error:
        sd.specialized_decode_config(make_config(additional_config=extra))
    assert str(error.value) == message


@pytest.mark.parametrize("mode", ["on", "off", "strict"])
def test_self_check_setting(gpu, monkeypatch, mode):
    """The config's mode, overridden by the environment; a bad value from the
    environment is reported as the environment's."""
    extra = {**ON, SELF_CHECK_KEY: mode}
    config = sd.specialized_decode_config(make_config(additional_config=extra))
    assert config.self_check == mode
    monkeypatch.setenv(SELF_CHECK_ENV, "off")
    config = sd.specialized_decode_config(make_config(additional_config=extra))
    assert config.self_check == "off"
    monkeypatch.setenv(SELF_CHECK_ENV, "loud")
    with pytest.raises(ValueError) as error:
        sd.specialized_decode_config(make_config(additional_config=extra))
    assert str(error.value) == (
        "environment VLLM_GLM5NEXT_KPOOL_SELF_CHECK='loud': expected one of "
        "['on', 'off', 'strict']"
    )


@pytest.mark.parametrize(
    "key, near",
    [
        ("decode-backend", "decode_backend"),
        ("Decode_Backend", "decode_backend"),
        ("specialized_decode_skips", "specialized_decode_skip"),
        ("specialised_decode_self_check", "specialized_decode_self_check"),
        ("specialized_decode_selfcheck", "specialized_decode_self_check"),
        ("decode", "decode_backend"),
        # A decode/specialized word without a valid key near it.
        ("kv_decode_speedup", None),
        ("use_specialized", None),
    ],
)
def test_unknown_keys_warn_with_the_nearest(gpu, vllm_log, key, near):
    """A key that reads like a specialized decode setting but is none warns
    (whatever the backend: the setting it meant is lost), naming the nearest
    valid key where one is close."""
    for extra in ({key: "x"}, {**ON, key: "x"}):
        vllm_log.clear()
        sd.specialized_decode_config(make_config(additional_config=extra))
        [record] = vllm_log.records
        assert record.levelno == logging.WARNING
        hint = f"; did you mean {near!r}?" if near else ""
        assert record.getMessage() == (
            f"additional_config key {key!r} is not a GLM-5-Next specialized decode "
            f"setting and is ignored{hint} (valid keys: decode_backend, "
            "specialized_decode_skip, specialized_decode_self_check, kpool_select)."
        )


@pytest.mark.parametrize("value", [True, False])
def test_select_is_opt_in(gpu, value):
    """``kpool_select`` (default false) turns on the select, a bool only."""
    assert (
        sd.specialized_decode_config(make_config(additional_config=ON)).select is False
    )
    extra = {**ON, "kpool_select": value}
    config = sd.specialized_decode_config(make_config(additional_config=extra))
    assert config.select is value


@pytest.mark.parametrize("value", ["true", 1, None])
def test_select_takes_a_bool(gpu, value):
    extra = {**ON, "kpool_select": value}
    with pytest.raises(ValueError) as error:
        sd.specialized_decode_config(make_config(additional_config=extra))
    assert str(error.value) == (
        f"additional_config kpool_select={value!r}: expected true or false"
    )


def test_other_keys_do_not_warn(gpu, vllm_log):
    extra = {**ON, "enable_hisparse": True, 3: "x", SELF_CHECK_KEY: "off"}
    extra["specialized_decode_skip"] = []
    sd.specialized_decode_config(make_config(additional_config=extra))
    assert vllm_log.records == []


def test_left_out_stage_needs_nothing(gpu):
    gpu(None)
    extra = {**ON, "specialized_decode_skip": ["dsa_kpool"]}
    config = sd.specialized_decode_config(make_config(additional_config=extra))
    assert config == sd.DecodeConfig(stages=())
    assert hash(config) == hash(sd.DecodeConfig(stages=()))  # a frozen value


COMPILE = CompilationMode.VLLM_COMPILE
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
        (dict(model_config__index_head_dim=64), "index_head_dim 64)"),
        (dict(model_config__index_topk=None), "(found index_topk None,"),
        (
            dict(parallel_config__decode_context_parallel_size=2),
            (
                "no decode context parallelism (--decode-context-parallel-size 1; "
                "found 2)"
            ),
        ),
        (
            dict(parallel_config__use_ubatching=True),
            "no micro-batching (leave out --enable-dbo and ubatch_size)",
        ),
        (
            dict(compilation_config__mode=COMPILE),
            (
                "no torch.compile of the model (compilation_config mode NONE, e.g. "
                f"-O0; found {COMPILE!s})"
            ),
        ),
        (
            dict(compilation_config__cudagraph_mode=CUDAGraphMode.FULL),
            (
                "no FULL CUDA graphs of mixed prefill-decode batches "
                "(compilation_config cudagraph_mode FULL_DECODE_ONLY or PIECEWISE; "
                f"found {CUDAGraphMode.FULL!s})"
            ),
        ),
        (dict(compilation_config__cudagraph_mode=CUDAGraphMode.PIECEWISE), None),
        (dict(compilation_config__cudagraph_mode=CUDAGraphMode.NONE), None),
        (
            dict(kernel_config__enable_jit_warmup=False),
            "JIT kernel warmup (kernel_config enable_jit_warmup=True)",
        ),
    ],
)
def test_each_requirement_names_its_setting(gpu, overrides, needs):
    missing = sd.unsupported(make_config(**overrides))
    assert len(missing) == (needs is not None)
    assert needs is None or needs in missing[0]


@pytest.mark.parametrize("capability", [None, 80, 89, 120])
def test_gpu_requirement(gpu, capability):
    gpu(capability)
    assert sd.unsupported(make_config()) == [
        "an NVIDIA SM90 (Hopper) or SM100-family (Blackwell) GPU"
    ]


def test_one_error_lists_every_requirement(gpu):
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
    missing = sd.unsupported(config)
    assert len(missing) == ALL_REQUIREMENTS
    with pytest.raises(ValueError) as error:
        sd.specialized_decode_config(config)
    assert str(error.value) == (
        f"decode_backend=latency_specialized needs: {'; '.join(missing)}. Or "
        "leave the stages out with additional_config "
        "specialized_decode_skip=['dsa_kpool'], or use decode_backend=auto."
    )


@pytest.mark.parametrize(
    "seqs, spec, tokens, rows",
    [(64, 3, 8192, 256), (64, None, 8192, 64), (64, 3, 128, 128), (8, 1, 8192, 16)],
)
def test_decode_capacity(seqs, spec, tokens, rows):
    config = make_config(
        scheduler_config__max_num_seqs=seqs,
        scheduler_config__max_num_batched_tokens=tokens,
    )
    if spec is None:
        config.speculative_config = None
    else:
        config.speculative_config.num_speculative_tokens = spec
    assert sd.decode_capacity(config) == rows
