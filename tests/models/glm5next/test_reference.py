# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""docs/reference.md's examples are what the code prints. Each fenced block
after a ``<!-- example: NAME -->`` line is compared, line for line, with
what the code gives for NAME's inputs here (``EXAMPLES``): a raised error as
its traceback's last line, a log record as its message. Every marked block
has its inputs here, and every input its block (CPU).

Where the inputs are not a user's own (no GPU here), each example says what
stands in: a faked GPU platform (``fake_gpu``), a deployment's config with
only what ``config.py`` reads (``make_config``), the step simulator's DSA
layers (``indexer_sim``), fake CUDA tensors (shapes and dtypes only) for a
public function's refusal, and for the self-check the rules taking CPU
tensors (``rule_edges.allow_cpu``) under an executor that writes nothing.
No example's text is edited before the comparison."""

import re
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from indexer_sim import BACKENDS, Geometry, Model, Sim

from vllm.config import CompilationMode
from vllm.models.glm5next.nvidia import sparse_indexer
from vllm.models.glm5next.nvidia.specialized_decode import config as sd
from vllm.models.glm5next.nvidia.specialized_decode import kpool, self_check
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.remap.launch import (
    REMAP,
)
from vllm.models.glm5next.nvidia.specialized_decode.runtime import install, warmup
from vllm.models.glm5next.nvidia.specialized_decode.runtime.warmup import StageWarmup

HERE = Path(__file__).resolve().parent
DOC = HERE.parents[2] / "docs" / "reference.md"
MARKER = re.compile(r"<!-- example: ([\w-]+) -->")
BLOCK = re.compile(r"<!-- example: ([\w-]+) -->\n```[a-z]*\n(.*?)\n```", re.S)
ON = {"decode_backend": "latency_specialized"}
CHECK_ENV, SEED_ENV = sd.SELF_CHECK_ENV, sd.SELF_CHECK_SEED_ENV


def examples() -> dict[str, str]:
    """NAME -> the text of its block in docs/reference.md."""
    text = DOC.read_text()
    found = BLOCK.findall(text)
    names = [name for name, _ in found]
    assert names == MARKER.findall(text), (
        "each <!-- example: NAME --> line must be followed by a fenced block"
    )
    assert len(set(names)) == len(names), f"an example name repeats: {names}"
    return dict(found)


def last_line(error: BaseException) -> str:
    """The last line of ``error``'s traceback, as Python prints it."""
    return traceback.format_exception(error)[-1].rstrip("\n")


def raised(call) -> str:
    with pytest.raises(ValueError) as error:
        call()
    return last_line(error.value)


def logged(vllm_log, module) -> list[str]:
    return [r.getMessage() for r in vllm_log.records if r.name == module.__name__]


def settings(make_config, monkeypatch, extra, environ=None, **overrides):
    """``specialized_decode_config`` of ``extra`` and ``environ``."""
    for name, value in (environ or {}).items():
        monkeypatch.setenv(name, value)
    try:
        return sd.specialized_decode_config(
            make_config(additional_config=extra, **overrides)
        )
    finally:
        for name in environ or {}:
            monkeypatch.delenv(name)


# --- The examples --------------------------------------------------------------

# A bad value of each kind: (additional_config, environment).
BAD = [
    ({"decode_backend": "fast"}, {}),
    ({**ON, "specialized_decode_skip": "dsa_kpool"}, {}),
    ({**ON, "specialized_decode_self_check": "loud"}, {}),
    ({**ON}, {CHECK_ENV: "yes"}),
    ({**ON}, {SEED_ENV: "0x1f"}),
    ({**ON, "kpool_select": "true"}, {}),
    ({**ON, "kpool_scores": "true"}, {}),
    (["decode_backend", "latency_specialized"], {}),
]


def bad_settings(make_config, monkeypatch, **_) -> list[str]:
    return [
        raised(lambda e=e, v=v: settings(make_config, monkeypatch, e, v))
        for e, v in BAD
    ]


def unknown_key(make_config, monkeypatch, vllm_log, **_) -> list[str]:
    """A hyphen for an underscore: warned, whatever the backend."""
    settings(make_config, monkeypatch, {**ON, "decode-backend": "auto"})
    return logged(vllm_log, sd)


def unknown_variable(make_config, monkeypatch, vllm_log, **_) -> list[str]:
    """The self-check's variable without its last underscore."""
    settings(make_config, monkeypatch, ON, {"VLLM_GLM5NEXT_KPOOL_SELFCHECK": "off"})
    return logged(vllm_log, sd)


def auto_ignores(make_config, monkeypatch, vllm_log, **_) -> list[str]:
    """Settings that only matter with latency_specialized, under auto."""
    extra = {"kpool_select": True, "specialized_decode_self_check": "strict"}
    assert settings(make_config, monkeypatch, extra, {SEED_ENV: "7"}) is None
    return logged(vllm_log, sd)


def requirements(make_config, monkeypatch, gpu, **_) -> list[str]:
    """An A100 (SM80) with decode context parallelism 2, compilation mode
    VLLM_COMPILE (vLLM's with ``VLLM_USE_BREAKABLE_CUDAGRAPH=0``) and
    ``enforce_eager`` (which turns JIT warmup off)."""
    gpu(80)
    overrides = dict(
        parallel_config__decode_context_parallel_size=2,
        compilation_config__mode=CompilationMode.VLLM_COMPILE,
        kernel_config__enable_jit_warmup=False,
    )
    return [raised(lambda: settings(make_config, monkeypatch, ON, **overrides))]


def attentions(backend: str, layers: int = 2):
    """The DSA layers of the step simulator's model on ``backend``'s sparse
    MLA impl (``indexer_sim``)."""
    geo = Geometry(layers=layers, heads=4, topk=128, max_model_len=512, max_reqs=4)
    return Model(Sim(geo, BACKENDS[backend], "cpu", 0), "model").attentions


def installed(make_config, monkeypatch, vllm_log, **_) -> list[str]:
    """``install()`` on a two-layer model whose sparse MLA impl is FlashInfer
    SM90's (Hopper's default), 64 sequences of 1 + 3 speculative tokens."""
    monkeypatch.setattr(sparse_indexer, "SPECIALIZED_KPOOL", None)
    assert install.install(make_config(), attentions("flashinfer_sm90")) is not None
    return logged(vllm_log, install)


def self_check_failed(vllm_log, **_) -> list[str]:
    """The warmup's self-check of the fused remap's key of a GLM-5-Next
    deployment (512 pools, 2176 columns, 64-token blocks) whose executor
    writes nothing, seed 7. The rules take CPU tensors here
    (``rule_edges.allow_cpu``: no GPU), the drawn cases and stock's bytes
    are ``cases.py``'s, the message ``StageWarmup.finish``'s (one
    process: no TP group)."""
    helpers = str(HERE / "specialized_decode")
    if helpers not in sys.path:
        sys.path.insert(0, helpers)
    from rule_edges import KEYS, allow_cpu

    key = REMAP.dispatch(**KEYS[REMAP])

    class WritesNothing:
        def executor(self, key):
            return lambda *args: None

    kernel = WritesNothing()
    stage = SimpleNamespace(pool_buffer=torch.empty(0), executors={}, kernels=[kernel])
    # Case 0 fails, and is the one reported: its 63 others (stock's chain
    # under Triton's interpreter here, minutes) are not drawn.
    with allow_cpu(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(self_check, "CASES", 1)
        StageWarmup(stage, [], "on", seed=7).compiled(kernel, [key])
    assert not stage.executors
    return logged(vllm_log, warmup)


def refused(**_) -> list[str]:
    """``upcast_logits`` given FP32 logits (SM90's) for BF16, on fake CUDA
    tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = torch.empty(8, 65536, dtype=torch.float32, device="cuda")
        ends = torch.empty(8, dtype=torch.int32, device="cuda")
        with pytest.raises(kpool.Refused) as error:
            kpool.upcast_logits(logits, ends)
    assert isinstance(error.value, ValueError)
    return [last_line(error.value)]


EXAMPLES = {
    "bad-settings": bad_settings,
    "unknown-key": unknown_key,
    "unknown-variable": unknown_variable,
    "auto-ignores": auto_ignores,
    "requirements": requirements,
    "installed": installed,
    "self-check-failed": self_check_failed,
    "refused": refused,
}


def test_every_example_has_its_inputs():
    assert sorted(examples()) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_is_what_the_code_prints(name, gpu, make_config, monkeypatch, vllm_log):
    printed = EXAMPLES[name](
        make_config=make_config, monkeypatch=monkeypatch, vllm_log=vllm_log, gpu=gpu
    )
    assert printed, f"{name}: the code printed nothing"
    assert examples().get(name) == "\n".join(printed), (
        f"docs/reference.md, example {name}: expected the code's text\n"
        + "\n".join(printed)
    )
