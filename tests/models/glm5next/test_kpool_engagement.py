# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engagement matrix: for every sparse MLA backend vLLM 0.33.0 selects
for GLM-5-Next on SM90 and SM100 (its real ``CudaPlatform.get_valid_backends``
for GLM-5-Next's dimensions: head size 512, 8 or 64 local heads), and every
KV cache dtype it accepts, which pieces of the kpool stage run in a planned
decode step. docs/reference.md shows the same table (``ENGAGEMENT``), and
``test_kpool_backends.py`` installs the stage on each path's impl class.

The backend's impl class decides, through the stage's own rule
(``runtime/remap.why_not_fusable``), whether the fused remap is reached; the
counts follow the backend's decode path; the upcast does work only where the
logits are BF16 (SM100). ``cpu_shims`` stands in only for what a GPU host
with the wheel's packages answers, so every rejection is a model, dtype or
capability limit.
"""

import importlib.util
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

CAPABILITIES = ((9, 0), (10, 0))
TENSOR_PARALLEL = (8, 2)  # 8 and 32 local heads: FlashMLA's mixed-batch cut


def cpu_shims(monkeypatch) -> None:
    # platforms/cuda.py imports this extension, which links libcuda.so.1.
    if "vllm._C_stable_libtorch" not in sys.modules:
        stub = types.ModuleType("vllm._C_stable_libtorch")
        monkeypatch.setitem(sys.modules, "vllm._C_stable_libtorch", stub)
    # vllm_flash_attn/__init__.py raises ImportError when _vllm_fa{2,3}_C
    # cannot load; register the package without running it.
    spec = importlib.util.find_spec("vllm.vllm_flash_attn")
    package = types.ModuleType(spec.name)
    package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
    monkeypatch.setitem(sys.modules, spec.name, package)

    import vllm.platforms.cuda as cuda
    import vllm.utils.flashinfer as flashinfer_utils
    from vllm.v1.attention.backends.mla import (
        flashattn_mla_sparse,
        flashinfer_mla_sparse_sm90,
    )

    get_class = cuda._get_attn_backend_class

    def get_class_or_import_error(backend):
        # cutlass_mla.py allocates CUDA memory at import: RuntimeError, which
        # get_valid_backends does not catch (it takes ImportError/OSError).
        try:
            return get_class(backend)
        except RuntimeError as e:
            raise ImportError(f"needs a GPU to import: {e}") from e

    monkeypatch.setattr(cuda, "_get_attn_backend_class", get_class_or_import_error)
    # Package probes that read the current (here: no) GPU.
    for module, name, value in (
        (flashattn_mla_sparse, "flash_attn_supports_mla", True),  # FA3 on SM90
        (flashattn_mla_sparse, "_fa4_cute_mla_available", None),
        (flashinfer_utils, "has_flashinfer", True),
        (flashinfer_mla_sparse_sm90, "has_flashinfer_sm90_nope_mla", True),
    ):
        monkeypatch.setattr(module, name, lambda value=value: value)


def vllm_config(hf, tp: int) -> SimpleNamespace:
    """What the sparse backends' ``supports_combination`` read."""
    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_text_config=hf,
            get_num_attention_heads=lambda p: (
                hf.num_attention_heads // p.tensor_parallel_size
            ),
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
        ),
    )


def pieces(backend, kv_dtype: str, local_heads: int, sm: int) -> str:
    """What a planned decode step runs with ``backend``: the stage's rule on
    the backend's impl class, the counts its decode path asks for."""
    from vllm.models.glm5next.nvidia.specialized_decode.runtime.remap import (
        why_not_fusable,
    )
    from vllm.v1.attention.backends.mla.flashmla_sparse import (
        MIN_HEADS_FOR_BF16_PREFILL,
        QUANTIZED_DS_MLA_CACHE_FORMATS,
        FlashMLASparseImpl,
    )
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

    impl_cls = backend.get_impl_cls()
    impl = object.__new__(impl_cls)
    # A one-layer group of an indexer, as each GLM-5-Next DSA layer has.
    group = object.__new__(SparseMLAIndexGroup)
    vars(group).update(has_indexer=True, num_layers=1)
    update = "update (MX)" if sm == 10 else "update (FP32)"
    upcast = "upcast" if sm == 10 else "no upcast (FP32 logits)"
    if why_not_fusable(impl, group) is not None:
        return f"{update}, {upcast}, expand; stock conversion"
    counts = "with counts"
    if (
        impl_cls.forward_mqa is FlashMLASparseImpl.forward_mqa
        and kv_dtype in QUANTIZED_DS_MLA_CACHE_FORMATS
        and local_heads < MIN_HEADS_FOR_BF16_PREFILL
    ):
        counts = "without counts"  # the FP8 mixed-batch decode
    return f"{update}, {upcast}, fused remap {counts}"


# (TP, arch, KV cache dtype) -> (valid backends in priority order, what the
# picked one runs).
U90, U100 = "update (FP32), no upcast (FP32 logits)", "update (MX), upcast"
FI90 = "FLASHINFER_MLA_SPARSE_SM90,FLASH_ATTN_MLA_SPARSE,FLASHMLA_SPARSE"
ENGAGEMENT = {
    **{
        (tp, "SM90", kv): (FI90, f"{U90}, fused remap with counts")
        for tp in TENSOR_PARALLEL
        for kv in ("auto", "bfloat16")
    },
    **{
        (tp, "SM90", kv): (
            "FLASHINFER_MLA_SPARSE_SM90",
            f"{U90}, fused remap with counts",
        )
        for tp in TENSOR_PARALLEL
        for kv in ("fp8", "fp8_e4m3")
    },
    **{
        (tp, "SM90", "float16"): (
            "FLASH_ATTN_MLA_SPARSE",
            f"{U90}, fused remap with counts",
        )
        for tp in TENSOR_PARALLEL
    },
    (8, "SM90", "fp8_ds_mla"): (
        "FLASHMLA_SPARSE",
        f"{U90}, fused remap without counts",
    ),
    (2, "SM90", "fp8_ds_mla"): ("FLASHMLA_SPARSE", f"{U90}, fused remap with counts"),
    **{
        (tp, "SM100", kv): ("FLASHINFER_MLA_SPARSE", f"{U100}, fused remap with counts")
        for tp in TENSOR_PARALLEL
        for kv in ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")
    },
}


def selection(monkeypatch) -> dict:
    """``ENGAGEMENT`` as vLLM's selection and the stage's rule give it."""
    cpu_shims(monkeypatch)
    import vllm.platforms.cuda as cuda
    from vllm.config import set_current_vllm_config
    from vllm.config.cache import KV_CACHE_DTYPES
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    hf = transformers.Glm5NextTextConfig(index_kpool=4)
    head_size = hf.kv_lora_rank + hf.qk_rope_head_dim  # mla_attention.py:480
    assert head_size == 512 and hf.num_attention_heads == 64
    table = {}
    for tp in TENSOR_PARALLEL:
        heads = hf.num_attention_heads // tp
        with set_current_vllm_config(vllm_config(hf, tp)):
            for major, minor in CAPABILITIES:
                for kv in KV_CACHE_DTYPES:
                    selector = AttentionSelectorConfig(
                        head_size=head_size,
                        dtype=torch.bfloat16,
                        kv_cache_dtype=kv,
                        block_size=None,
                        use_mla=True,
                        use_sparse=True,
                    )
                    valid, _ = cuda.CudaPlatform.get_valid_backends(
                        DeviceCapability(major, minor), selector, num_heads=heads
                    )
                    if not valid:
                        continue
                    valid.sort(key=lambda c: c.priority)
                    table[(tp, f"SM{major}{minor}", kv)] = (
                        ",".join(c.backend.name for c in valid),
                        pieces(valid[0].backend_class, kv, heads, major),
                    )
    return table


class _Patches:
    """``monkeypatch``'s setattr and setitem, for a process that ends."""

    setattr = staticmethod(setattr)

    @staticmethod
    def setitem(mapping, key, value):
        mapping[key] = value


def start_selection() -> list[subprocess.Popen]:
    """``selection`` in a fresh interpreter: the selection caches what it
    probes, so other tests' imports must not decide it. Its output in files
    (a full pipe would stall a child started early)."""
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); "
        "import test_kpool_engagement as t; "
        "print(json.dumps(sorted((list(k), list(v)) for k, v in "
        "t.selection(t._Patches()).items())))"
    )
    # Closed by the fixture, once the child ended.
    out = tempfile.TemporaryFile("w+")  # noqa: SIM115
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115
    command = [sys.executable, "-c", script, str(Path(__file__).parent)]
    run = subprocess.Popen(command, stdout=out, stderr=err, text=True)
    run.out, run.err = out, err
    return [run]


# The root conftest.py starts the child once collection is done (half a
# minute of CPU: vLLM's imports and its backends' probes).
START_EARLY = {"selected": start_selection}
STARTED: dict = {}


@pytest.fixture(scope="module")
def selected(request, started):
    """The child's rows: (TP, GPU, KV cache) and (backends, what runs)."""
    [run] = started(request.module, "selected")
    with run.out, run.err:
        try:
            run.wait(timeout=600)
        finally:
            run.kill()
        run.out.seek(0), run.err.seek(0)
        assert run.returncode == 0, run.err.read()[-4000:]
        return json.loads(run.out.read().strip().splitlines()[-1])


def test_engagement_matrix(selected):
    """In a fresh interpreter (``selected``): the selection caches what it
    probes, so other tests' imports must not decide it."""
    assert {tuple(k): tuple(v) for k, v in selected} == ENGAGEMENT


def test_reference_shows_the_matrix():
    """docs/reference.md's engagement table (between its markers) has a row
    for each entry of ``ENGAGEMENT`` and no other."""
    begin, end = "<!-- engagement -->", "<!-- /engagement -->"
    doc = Path(__file__).resolve().parents[3] / "docs" / "reference.md"
    text = doc.read_text()
    assert begin in text and end in text, f"{doc}: no {begin} ... {end} table"
    table = text.split(begin, 1)[1].split(end, 1)[0].strip().splitlines()
    assert table[:2] == [
        "| GPU | TP | KV cache | backend | a planned decode step runs |",
        "| --- | --- | --- | --- | --- |",
    ], table[:2]
    want = [
        f"| {arch} | {tp} | `{kv}` | {valid.split(',')[0]} | {runs} |"
        for (tp, arch, kv), (valid, runs) in ENGAGEMENT.items()
    ]
    assert sorted(table[2:]) == sorted(want)
