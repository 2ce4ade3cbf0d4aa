# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU tier's environment without vLLM (``tools/kernel_env``) gives the same stock
code as the real import of the patched vLLM tree.

The real side runs here (the root conftest puts the patched overlay first on
``sys.path``); the shim side runs in a subprocess (this file as a script)
that sees neither vllm nor quack, as on the GPU machine (``python -S`` over
a copy of site-packages without them), and installs the shim from sources
staged out of the very files the real import loaded. Every lifted statement,
lifted object and whole module, and every quack module, must be the real
import's text; both sides run the stock Triton kernels and the product's
case draws (``cases.py``, whose expected buffers the stock twins compute)
under ``TRITON_INTERPRET=1`` on the same inputs, with results equal byte for
byte. Every name the product imports from vLLM or quack resolves in the
shim, to the real import's object (same source) or to a stand-in listed in
``STAND_INS``, and the whole product imports there.
"""

import ast
import dataclasses
import importlib
import inspect
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CPU_TRITON = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
KPOOL = "vllm.models.glm5next.nvidia.ops.kpool_compress"
INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"
SPARSE_UTILS = "vllm.v1.attention.backends.mla.sparse_utils"
INDEX_GROUP = "vllm.v1.attention.backends.mla.index_group"
SPECIALIZED = "vllm.models.glm5next.nvidia.specialized_decode"
# The GPU tests' case draws (``draws.py``).
DRAWS = REPO / "tests" / "models" / "glm5next" / "specialized_decode"
COMMON = "vllm.v1.attention.ops.common"
MLA = "vllm.v1.attention.backends.mla"
SPARSE_MLA = "vllm.model_executor.layers.attention.sparse_mla_attention"
MLA_ATTENTION = "vllm.model_executor.layers.attention.mla_attention"
SPARSE_INDEXER = "vllm.models.glm5next.nvidia.sparse_indexer"
# What the shim must export whole (the TVM-FFI launch path).
EXPORTS = {
    "vllm.model_executor.warmup.jit_warmup": (
        "kernel_launcher",
        "VllmJitKernel",
        "JitWarmupRegistry",
        "WarmupChoices",
        "WarmupIntRange",
        "zip_inputs",
    ),
    "vllm.model_executor.warmup.jit_warmup_cutedsl_helper": (
        "VllmCuTeDSLJitKernel",
        "compile_cutedsl",
        "cutedsl_fake_stream",
    ),
    SPARSE_INDEXER: ("sparse_attn_indexer_kpool", "SPECIALIZED_KPOOL"),
}
# The sparse MLA impls whose forward_mqa the product identifies: stand-in
# classes derived as in vLLM, each with its stock forward_mqa lifted.
IMPLS = (
    f"{SPARSE_MLA}.SparseMLACommonImpl",
    f"{MLA}.flashmla_sparse.FlashMLASparseImpl",
    f"{MLA}.flashinfer_mla_sparse_sm90.FlashInferMLASparseSM90Impl",
)
# Stand-ins that raise, naming themselves, unless a test driver replaces them.
RAISING = (
    # No DeepGEMM here; where the GPU tier puts vLLM's vendored copy on the
    # path, vLLM's wrappers over it.
    "vllm.utils.deep_gemm.fp8_fp4_paged_mqa_logits",
    "vllm.utils.deep_gemm.get_paged_mqa_logits_metadata",
    "vllm.model_executor.layers.indexer_topk.get_indexer_topk",  # no vLLM _C
)
# What the product imports from vLLM that the shim serves with a stand-in
# (``stubs.py``), not the stock object: why each.
STAND_INS = {
    # logging.getLogger plus vLLM's *_once methods.
    "vllm.logger.init_logger": "vLLM's logger configuration is not staged",
    # Stock's reads the device and DeepGEMM; the stand-in the device
    # (forced by shim.set_mx_scales).
    "vllm.utils.deep_gemm.mqa_logits_use_mx_scales": "no DeepGEMM",
    # torch.cuda.current_stream (stock's wraps it for ROCm/XPU).
    "vllm.utils.torch_utils.current_stream": "torch_utils is not staged",
    # CUDA when torch sees a GPU.
    "vllm.platforms.current_platform": "no platform detection",
    # The warmup's rank verdicts: no process group in the shim's runs.
    "vllm.distributed.get_tp_group": "vLLM's distributed state is not staged",
    "vllm.distributed.model_parallel_is_initialized": "no process group there",
    **dict.fromkeys(RAISING, "raises unless replaced"),
    **dict.fromkeys(IMPLS, "their modules do not load there"),
}
# kpool update sizes: requests x tokens, head dim, pool, ring, page.
R, N, D, POOL, RING, PAGE = 3, 2, 128, 4, 8, 4


def _shim():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tools.kernel_env import shim, stage

    return shim, stage


def _resolve(qualname: str, stock_modules) -> object:
    """The real object of a shim ``LIFTED`` name: ``module.name[.member]``."""
    module = next(m for m in stock_modules if qualname.startswith(m + "."))
    obj = importlib.import_module(module)
    for attr in qualname[len(module) + 1 :].split("."):
        obj = getattr(obj, attr)
    return obj


def describe(obj) -> str:
    """Source of a module, function, class or Triton kernel (its ``fn``),
    from its ``def`` or ``class`` line (a decorator's wrapper reports its
    source with or without the decorator line, as the DSL was loaded);
    else repr."""
    obj = getattr(obj, "fn", obj)
    if (
        inspect.ismodule(obj)
        or inspect.isfunction(obj)
        or inspect.isclass(obj)
        or hasattr(obj, "__wrapped__")
    ):
        return re.sub(r"\A(?:[ \t]*@.*\n)+", "", inspect.getsource(obj))
    return repr(obj)


def product_modules() -> list[str]:
    """Every module of the product package."""
    root = REPO / SPECIALIZED.replace(".", "/")
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.append(".".join(parts[:-1] if path.stem == "__init__" else parts))
    return names


def product_imports() -> list[str]:
    """``module.name`` of every name the product's modules import from vLLM
    or quack (at the top or inside a function), its own package aside."""
    names = set()
    for path in (REPO / SPECIALIZED.replace(".", "/")).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            module = getattr(node, "module", None) or ""
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and module.partition(".")[0] in ("vllm", "quack")
                and not module.startswith(SPECIALIZED)
            ):
                names.update(f"{module}.{alias.name}" for alias in node.names)
    return sorted(names)


def resolve_import(qualname: str):
    """What ``from module import name`` binds (an attribute or a submodule)."""
    module, _, name = qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except AttributeError:
        return importlib.import_module(qualname)


def fields(cls) -> list[tuple[str, str]]:
    """A dataclass's fields: (name, its default's repr, or "required")."""
    return [
        (f.name, "required" if f.default is dataclasses.MISSING else repr(f.default))
        for f in dataclasses.fields(cls)
    ]


def metadata_facts(lifted) -> dict:
    """The planned-step test's metadata classes: their fields, that the
    sparse MLA metadata derives from the product's ``MLACommonMetadata``, and
    (shim side) that the product's classes are the lifted ones."""
    steps = importlib.import_module(f"{SPECIALIZED}.runtime.steps")
    sparse = importlib.import_module(SPARSE_MLA).SparseMLACommonMetadata
    accepted = steps.ACCEPTED_METADATA
    names = (
        f"{MLA}.indexer.DeepseekV32IndexerMetadata",
        f"{MLA_ATTENTION}.MLACommonMetadata",
    )
    return {
        "fields": [fields(cls) for cls in (*accepted, sparse)],
        "derives": issubclass(sparse, accepted[1]),
        "lifted": lifted is None or [lifted[n] for n in names] == list(accepted),
    }


def impl_facts() -> dict:
    """For each sparse MLA impl class: whether it derives from
    ``SparseMLACommonImpl``, which class defines its ``forward_mqa`` and that
    method's source; and what the product's identity check accepts."""
    remap = importlib.import_module(f"{SPECIALIZED}.runtime.remap")
    common = resolve_import(IMPLS[0])
    facts = {}
    for name in IMPLS:
        cls = resolve_import(name)
        method = cls.forward_mqa
        facts[name] = (issubclass(cls, common), method.__qualname__, describe(method))
    facts["accepted"] = [f.__qualname__ for f in remap.group_converting_decodes()]
    return facts


def make_inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)

    def ints(low, high, shape):
        return torch.randint(low, high, shape, generator=g, dtype=torch.int32)

    # kpool update, a tail block per request: request 0 completes a pool on
    # its second token, request 1 on its first (then stashes the next pool's
    # first token), request 2 starts anywhere and pads its second token.
    starts = [2, 4 * rng.randrange(10) + 3, rng.randrange(40)]
    pos = (torch.tensor(starts).view(R, 1) + torch.arange(N)).to(torch.int32)
    blocks = torch.tensor(rng.sample(range(4), R)).view(R, 1)
    tail_slots = (blocks * RING + pos % RING).to(torch.int32)
    slots = torch.tensor(rng.sample(range(6 * PAGE), R * N)).view(R, N)
    slots = slots.to(torch.int32)
    pos[2, 1] = tail_slots[2, 1] = slots[2, 1] = -1
    kpool = dict(
        kv_cache=ints(0, 256, (6, PAGE, D + 4)).to(torch.uint8),
        tail_kv_cache=torch.randn(4, 2, RING, D, generator=g).to(torch.bfloat16),
        tail_slot_mapping=tail_slots,
        key=(torch.randn(R, N, D, generator=g) * 3).to(torch.bfloat16),
        slot_score=torch.randn(R, N, D, generator=g).to(torch.bfloat16),
        ape=torch.randn(POOL, D, generator=g),
        slot_mapping=slots,
        positions=pos,
    )
    pool_ids = ints(-1, 200, (5, 40))
    pool_ids[pool_ids % 7 == 0] = -1
    width = 2176
    tokens = ints(-1, 40 * 64 + 300, (4, 5120))
    tokens[tokens % 5 == 0] = -1
    lens = torch.tensor([2, 4, 3], dtype=torch.int32)
    seq = torch.randn(9, 4, 16, generator=g)
    return dict(
        seed=seed,
        kpool=kpool,
        seq=seq,
        seq_bytes=ints(0, 256, (9, 40)).to(torch.uint8),
        lens=lens,
        pool_ids=pool_ids,
        seq_lens=ints(0, 800, (5,)),
        logits=torch.randn(3, 1024, generator=g).to(torch.bfloat16)[:, :1000],
        row_ends=torch.tensor([0, 997, 1000], dtype=torch.int32),
        req_id=ints(0, 3, (4,)),
        block_table=ints(0, 100, (3, 40)),
        tokens=tokens[:, :width].contiguous(),
        tokens_wide=tokens,
    )


class FakeStream:
    """CPU stand-in for a torch stream or event: logs the calls it gets."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def _log(self, *call) -> None:
        self.log.append((self.name, *(getattr(a, "name", a) for a in call)))

    def record(self, stream=None) -> None:
        self._log("record", stream)

    def wait_event(self, event) -> None:
        self._log("wait_event", event)

    def wait_stream(self, stream) -> None:
        self._log("wait_stream", stream)

    def __enter__(self):
        self.log.append((self.name, "enter"))

    def __exit__(self, *exc):
        self.log.append((self.name, "exit"))


def run_cases(inputs: dict, set_mx) -> dict:
    """Run the stock functions reachable as ``vllm.*`` and the product's case
    draws on ``inputs`` (cloned); ``set_mx(flag)`` forces
    ``mqa_logits_use_mx_scales()`` of kpool_compress."""
    kp = importlib.import_module(KPOOL)
    indexer = importlib.import_module(INDEXER)
    su = importlib.import_module(SPARSE_UTILS)
    ig = importlib.import_module(INDEX_GROUP)
    out = {}
    for mx in (True, False):
        args = {k: v.clone() for k, v in inputs["kpool"].items()}
        set_mx(mx)
        kp.kpool_decode_update_and_maybe_write_cache_batched(**args, pool_size=POOL)
        out[f"kpool_update_mx={mx}"] = (args["kv_cache"], args["tail_kv_cache"])
    set_mx(None)

    common = importlib.import_module(COMMON)
    lens = inputs["lens"]
    packed = common.pack_seq_triton(inputs["seq"], lens)
    out["pack_seq"] = (packed, common.unpack_seq_triton(packed, lens))
    packed = common.pack_seq_triton(inputs["seq_bytes"], lens, pad_value=7)
    out["pack_seq_bytes"] = (packed, common.unpack_seq_triton(packed, lens))

    pool_ids, seq_lens = inputs["pool_ids"], inputs["seq_lens"]
    out["expand"] = kp.expand_pools_and_append_tail(pool_ids, seq_lens, POOL)
    buf = torch.full((7, 200), -7, dtype=torch.int32)
    res = kp.expand_pools_and_append_tail(
        pool_ids, seq_lens - 1, POOL, seq_offset=1, out=buf[1:6, :170]
    )
    out["expand_offset_out"] = (buf, res.data_ptr() - buf.data_ptr())

    logits, row_ends = inputs["logits"], inputs["row_ends"]
    fp32 = indexer.as_fp32_logits(logits, row_ends)
    mask = torch.arange(logits.shape[1]) < row_ends[:, None]
    out["as_fp32_logits"] = (torch.where(mask, fp32, 0.0), fp32.stride())

    req_id, block_table = inputs["req_id"], inputs["block_table"]
    for name, tokens, counts in (
        ("single_tile", inputs["tokens"], True),
        ("multi_tile", inputs["tokens_wide"], True),
        ("no_counts", inputs["tokens"], False),
    ):
        out[f"remap_{name}"] = su.triton_convert_req_index_to_global_index(
            req_id,
            block_table,
            tokens,
            BLOCK_SIZE=64,
            BLOCK_STRIDE_ROWS=96,
            NUM_TOPK_TOKENS=tokens.shape[1],
            return_valid_counts=counts,
        )

    log: list = []
    tokens = inputs["tokens"]
    group = ig.SparseMLAIndexGroup(
        logical_topk_indices=tokens,
        physical_topk_indices=torch.full((5, tokens.shape[1]), -7, dtype=torch.int32),
        valid_topk_counts=torch.full((5,), -7, dtype=torch.int32),
        side_stream=FakeStream(log, "side"),
        logical_topk_ready=FakeStream(log, "logical_ready"),
        physical_topk_ready=FakeStream(log, "physical_ready"),
        has_indexer=True,
    )
    current_stream = ig.current_stream
    ig.current_stream = lambda: FakeStream(log, "compute")
    try:
        group.set_logical_topk_ready(0)
        # Layer 0 converts, layer 1 reuses it, more rows than the buffers fall
        # back to a fresh conversion.
        calls = [
            group._convert_once(
                layer,
                tokens.repeat(rep, 1),
                req_id.repeat(rep),
                block_table,
                64,
                block_stride_rows=96,
                return_valid_counts=True,
            )
            for layer, rep in ((0, 1), (1, 1), (0, 2))
        ]
        # Patch 0005's hook: the group's conversion gets the stock
        # _convert_once first, then its arguments.
        hooked: list = []

        def conversion(stock, *args, **kwargs):
            hooked.append((stock.__name__, args, sorted(kwargs.items())))
            return stock(*args, **kwargs)

        group.conversion = conversion
        metadata = mock.Mock(req_id_per_token=req_id, block_table=block_table)
        metadata.block_size = 64
        kwargs = dict(block_stride_rows=96, return_valid_counts=True)
        hooked.append(
            group.convert_logical_to_physical_topk(0, tokens, metadata, **kwargs)
        )
    finally:
        ig.current_stream = current_stream
    out["convert_once"] = (
        group.physical_topk_indices,
        group.valid_topk_counts,
        calls,
        log,
        hooked,
    )
    # What the GPU tier compares the kernels with: each kernel's case as the
    # GPU tests draw it (a key, then cases.py's case) on the CPU, its expected
    # buffers from the stock twins.
    if str(DRAWS) not in sys.path:
        sys.path.insert(0, str(DRAWS))
    draws = importlib.import_module("draws")
    for name in ("update", "expand", "remap", "upcast", "select"):
        seed = inputs["seed"]
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        extra = (132,) if name == "select" else ()
        case = getattr(draws, f"{name}_case")(rng, gen, *extra)
        out[f"case_{name}"] = (case.written, case.expected)
    return out


def assert_same(real, shim, where: str) -> None:
    """Equal structure; tensors equal byte for byte (dtype, shape, strides)."""
    if isinstance(real, torch.Tensor):
        assert isinstance(shim, torch.Tensor), where
        meta = (real.dtype, real.shape, real.stride())
        assert meta == (shim.dtype, shim.shape, shim.stride()), where
        a, b = real.contiguous().view(-1), shim.contiguous().view(-1)
        a, b = a.view(torch.uint8), b.view(torch.uint8)
        diff = (a != b).nonzero()
        assert diff.numel() == 0, f"{where}: {diff.numel()} bytes differ"
    elif isinstance(real, list | tuple):
        assert len(real) == len(shim), where
        for i, (x, y) in enumerate(zip(real, shim, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert real == shim, where


@pytest.fixture(scope="module")
def real():
    """The real patched stock modules and the product, Triton interpreted."""
    _, stage = _shim()
    with mock.patch.dict(os.environ, CPU_TRITON):
        for name in (*stage.STOCK, *product_modules()):
            importlib.import_module(name)
    kp = sys.modules[KPOOL]
    if type(kp._expand_pools_and_append_tail_kernel).__name__ != "InterpretedFunction":
        pytest.fail("vLLM's Triton kernels were imported without TRITON_INTERPRET=1")
    if (
        "seq_offset"
        not in inspect.signature(kp.expand_pools_and_append_tail).parameters
    ):
        pytest.fail(f"{kp.__file__} is not patched: no root conftest overlay?")
    return kp


def site_without_vllm(tmp: Path) -> list[str]:
    """The GPU machine's ``PYTHONPATH`` made of this venv: its site-packages
    but vllm and quack (links), and the CuTe DSL's packages dir."""
    site = Path(torch.__file__).parents[1]
    farm = tmp / "site"
    farm.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith(("vllm", "quack")) and entry.suffix != ".pth":
            (farm / entry.name).symlink_to(entry)
    return [str(farm), str(farm / "nvidia_cutlass_dsl" / "dsl_packages")]


@pytest.fixture(scope="module")
def shim_side(real, tmp_path_factory):
    """Stage the files the real import loaded; run the shim side on them."""
    _, stage = _shim()
    tmp = tmp_path_factory.mktemp("kernel_env")
    modules = {rel: rel[:-3].replace("/", ".") for rel in stage.STOCK_FILES}
    sources = {rel: Path(sys.modules[m].__file__) for rel, m in modules.items()}
    stage.stage(
        sources, tmp / "stock", quack=Path(sys.modules["quack"].__file__).parent
    )
    seed = random.randrange(2**31)
    torch.save(make_inputs(seed), tmp / "inputs.pt")
    path = os.pathsep.join(site_without_vllm(tmp))
    proc = subprocess.run(
        [sys.executable, "-S", __file__, str(tmp)],
        env=os.environ | CPU_TRITON | {"PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return seed, torch.load(tmp / "result.pt", weights_only=False)


def test_sources_equal(real, shim_side):
    """Every lifted definition is the stock statement of the module the real
    import loads (and, for functions, classes and kernels, the real object's
    source); every whole module and quack module is the real module's text."""
    shim, stage = _shim()
    _, result = shim_side
    lifted = {
        f"{m}.{n}" for m, names in stage.STOCK.items() for n in (names or "").split()
    }
    assert result["sources"].keys() == lifted == result["statements"].keys()
    for qualname in sorted(lifted):
        module = next(m for m in stage.STOCK if qualname.startswith(m + "."))
        text = inspect.getsource(importlib.import_module(module))
        name = qualname[len(module) + 1 :]
        statement = shim.definition_source(text, name)
        assert statement == result["statements"][qualname], qualname
        obj = _resolve(qualname, stage.STOCK)
        if hasattr(obj, "fn") or inspect.isfunction(obj) or inspect.isclass(obj):
            assert describe(obj) == result["sources"][qualname], qualname
    whole = [m for m, names in stage.STOCK.items() if names is None]
    assert result["modules"].keys() == set(whole)
    for name in whole:
        module = importlib.import_module(name)
        assert inspect.getsource(module) == result["modules"][name], name
    kernels = {k: describe(v) for k, v in vars(real).items() if hasattr(v, "fn")}
    assert kernels == result["kpool_kernels"]
    assert "quack.utils" in result["quack"]
    for name, text in result["quack"].items():
        assert Path(importlib.import_module(name).__file__).read_text() == text, name


def test_outputs_equal(real, shim_side):
    """Same inputs, byte-equal caches, tails, outputs, counts and case
    buffers."""
    seed, result = shim_side
    inputs = torch.load(result["inputs"], weights_only=False)
    stock = real.mqa_logits_use_mx_scales

    def set_mx(flag):
        real.mqa_logits_use_mx_scales = stock if flag is None else lambda: flag

    try:
        got = run_cases(inputs, set_mx)
    finally:
        set_mx(None)
    assert got.keys() == result["outputs"].keys()
    for name, value in got.items():
        assert_same(value, result["outputs"][name], f"{name} (seed {seed})")


def test_forced_mx_scales_reach_the_kernel(shim_side):
    """MX on writes four equal UE8M0 bytes (the fp32 scale's exponent) where
    MX off writes the fp32 scale; nothing else differs. On the CPU the shim's
    default is off, as stock's off the SM100 family."""
    seed, result = shim_side
    assert result["default_mx"] is False
    inputs = torch.load(result["inputs"], weights_only=False)["kpool"]
    mx, _ = result["outputs"]["kpool_update_mx=True"]
    fp32, _ = result["outputs"]["kpool_update_mx=False"]
    done = (inputs["positions"] % POOL == POOL - 1) & (inputs["slot_mapping"] >= 0)
    assert done.any(), f"no pool completes (seed {seed})"
    mx, fp32 = mx.view(mx.shape[0], -1), fp32.view(fp32.shape[0], -1)
    changed = torch.zeros_like(mx, dtype=torch.bool)
    for loc in inputs["slot_mapping"][done].tolist():
        page, col = divmod(loc, PAGE)
        at = slice(PAGE * D + 4 * col, PAGE * D + 4 * col + 4)
        exponent = (fp32[page, at].view(torch.int32) >> 23) & 0xFF
        assert mx[page, at].tolist() == [exponent.item()] * 4, f"seed {seed}"
        changed[page, at] = True
    assert torch.equal(mx[~changed], fp32[~changed]), f"seed {seed}"


def test_whole_modules_and_the_indexer_load(shim_side):
    """``jit_warmup`` and its CuTe DSL helper load whole (the TVM-FFI launch
    path), and the patched indexer with them."""
    _, result = shim_side
    assert result["exports"] == {module: [] for module in EXPORTS}


def test_product_imports_resolve_to_stock(real, shim_side):
    """Each name the product imports from vLLM or quack resolves in the
    shim: to the real import's object, source for source, or to a listed
    stand-in; the raising stand-ins raise, naming themselves."""
    _, result = shim_side
    served = result["product_imports"]
    assert list(served) == product_imports()
    missing = {k: v for k, v in served.items() if v.startswith("missing: ")}
    assert not missing, missing
    assert set(STAND_INS) <= set(served), set(STAND_INS) - set(served)
    for qualname, source in served.items():
        if qualname not in STAND_INS:
            assert source == describe(resolve_import(qualname)), qualname
    assert result["raising"] == {name: True for name in RAISING}


def test_metadata_and_impls_as_in_vllm(real, shim_side):
    """The planned-step test's metadata classes are the lifted stock classes
    with the stock fields, the sparse MLA metadata derived from the same
    ``MLACommonMetadata``; the impl stand-ins derive as vLLM's, each with the
    stock ``forward_mqa`` of the class that defines it, and the product's
    identity check accepts the same methods."""
    _, result = shim_side
    assert result["metadata"] == metadata_facts(None)
    assert result["metadata"]["derives"] and result["metadata"]["lifted"]
    assert result["impls"] == impl_facts()


def test_no_real_vllm_in_the_shim_process(shim_side):
    """Every ``vllm`` module there is the shim's, a staged file or the repo's;
    quack is the staged one; the whole product imports, from the repo."""
    _, result = shim_side
    assert result["foreign"] == [], "real vllm modules loaded beside the shim"
    assert Path(result["quack_file"]).parents[1].name.startswith("kpool-quack-")
    specialized = result["specialized"]
    assert isinstance(specialized, dict), specialized  # else: the import error
    assert sorted(specialized) == product_modules()
    assert all(f.startswith(str(REPO / "vllm")) for f in specialized.values())


def _shim_main(tmp: str) -> None:
    """The subprocess: install the shim first, then run the cases."""
    shim, stage = _shim()
    tmp_dir = Path(tmp)
    stock = (tmp_dir / "stock").resolve()
    shim.install(stock, REPO)
    inputs = torch.load(tmp_dir / "inputs.pt", weights_only=False)
    kp = importlib.import_module(KPOOL)
    result = {
        "inputs": str(tmp_dir / "inputs.pt"),
        "default_mx": shim.mqa_logits_use_mx_scales(),
        "sources": {k: describe(v) for k, v in shim.LIFTED.items()},
        "statements": dict(shim.LIFTED_SOURCE),
        "modules": {
            name: inspect.getsource(sys.modules[name])
            for name, names in stage.STOCK.items()
            if names is None
        },
        "kpool_kernels": {
            k: describe(v) for k, v in vars(kp).items() if hasattr(v, "fn")
        },
    }
    try:  # what the GPU tier imports: every module of the product
        result["specialized"] = {
            name: importlib.import_module(name).__file__ for name in product_modules()
        }
    except Exception as e:
        result["specialized"] = f"{type(e).__name__}: {e}"
    result["outputs"] = run_cases(inputs, shim.set_mx_scales)
    result["exports"] = {
        module: [name for name in names if not hasattr(sys.modules[module], name)]
        for module, names in EXPORTS.items()
    }
    result["product_imports"] = {}
    for qualname in product_imports():
        try:
            obj = resolve_import(qualname)
            served = "stand-in" if qualname in STAND_INS else describe(obj)
        except Exception as e:
            served = f"missing: {type(e).__name__}: {e}"
        result["product_imports"][qualname] = served
    result["raising"] = {}
    for name in RAISING:
        with pytest.raises(RuntimeError, match=name.replace(".", r"\.")):
            resolve_import(name)()
        result["raising"][name] = True
    result["metadata"] = metadata_facts(shim.LIFTED)
    result["impls"] = impl_facts()
    quack = sys.modules["quack"]
    result["quack_file"] = quack.__file__
    result["quack"] = {
        name: Path(module.__file__).read_text()
        for name, module in sys.modules.items()
        if name.partition(".")[0] == "quack" and getattr(module, "__file__", None)
    }
    result["foreign"] = [
        name
        for name, module in sys.modules.items()
        if name.partition(".")[0] == "vllm"
        and getattr(module, "__file__", None)
        and not module.__file__.startswith((str(stock), str(REPO)))
    ]
    torch.save(result, tmp_dir / "result.pt")


if __name__ == "__main__":
    _shim_main(*sys.argv[1:])


def test_verify_refuses_a_stage_from_another_patch_set(tmp_path):
    """A stage made before patches/ changed is refused: a GPU run on it would
    test the old hooks."""
    _, stage = _shim()
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "series").write_text("0001-a.patch\n")
    (patches / "0001-a.patch").write_text("one hunk\n")
    sources = {}
    for rel in stage.STOCK_FILES:
        source = tmp_path / "tree" / rel
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(f"# {rel}\n")
        sources[rel] = source
    stage.stage(sources, tmp_path / "stock", patches)
    files = {*stage.STOCK_FILES, stage.QUACK}
    assert stage.verify(tmp_path / "stock", patches).keys() == files
    (patches / "0001-a.patch").write_text("one hunk, edited\n")
    with pytest.raises(ValueError, match="another patch set"):
        stage.verify(tmp_path / "stock", patches)


def test_bundle_writes_the_archive_and_its_env_sh(tmp_path):
    """``cutedsl_bundle.sh DEST`` with the archive in its cache (no download):
    DEST holds the archive and an ``env.sh`` that unpacks that archive from
    ``.device`` and puts it on ``PYTHONPATH``."""
    name = "cutedsl-4.8.0-tvmffi-0.1.11-cu13-cp312.tar.xz"
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / name).write_bytes(b"archive")
    script = REPO / "tools/kernel_env/cutedsl_bundle.sh"
    env = os.environ | {"KPOOL_DEVICE_CACHE": str(tmp_path / "cache")}
    subprocess.run(
        [str(script), str(tmp_path / "dest")], env=env, check=True, capture_output=True
    )
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == [name, "env.sh"]
    assert (tmp_path / "dest" / name).read_bytes() == b"archive"
    text = (tmp_path / "dest" / "env.sh").read_text()
    assert "@NAME@" not in text and f"tar xJf .device/{name} " in text
    assert 'export PYTHONPATH="$PWD:$_kpool_site:' in text


def test_the_gpu_tier_needs_nothing_outside_the_repository():
    """What builds the bundle is in tools/kernel_env/; no other file of the
    repository points outside it (``../shared``) for it."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    this = Path(__file__).resolve().relative_to(REPO).as_posix()
    pointing = [
        rel
        for rel in tracked
        if rel not in ("", this)
        and (REPO / rel).is_file()
        and b"../shared" in (REPO / rel).read_bytes()
    ]
    assert pointing == []
    assert (REPO / "tools/kernel_env/env.sh.in").is_file()


def _path() -> str:
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])


def test_summary_line_counts_skips_apart(tmp_path):
    """``gpu_tier.sh --summarize``: passed, failed, errors and SKIPPED from a
    real pytest JUnit XML, skip reasons counted; a failure, an error, no test
    or (``--strict``) a skip fails."""
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_fail(): assert False\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError\n"
        "def test_error(broken): pass\n"
        "@pytest.mark.skip(reason='needs CUDA: no')\n"
        "def test_skip_a(): pass\n"
        "def test_skip_b(): pytest.skip('needs CUDA: no')\n"
        "def test_skip_c(): pytest.skip('other')\n"
    )
    xml = tmp_path / "x.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            os.devnull,
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_x.py"),
            f"--junitxml={xml}",
        ],
        capture_output=True,
        cwd=tmp_path,
    )
    tier = str(REPO / "tools/kernel_env/gpu_tier.sh")

    def summarize(*args):
        proc = subprocess.run(
            [tier, "--summarize", *args],
            env=os.environ | {"PATH": _path()},
            capture_output=True,
            text=True,
        )
        return proc.returncode, proc.stdout.strip()

    assert summarize(str(xml)) == (
        1,
        "1 passed, 1 failed, 1 errors, 3 SKIPPED [2x needs CUDA: no] [1x other]",
    )
    missing = str(tmp_path / "none.xml")
    assert summarize(str(xml), missing)[1].endswith(f"[no JUnit XML: {missing}]")
    ok = tmp_path / "ok.xml"
    ok.write_text(
        '<testsuites><testsuite><testcase name="a"/><testcase name="b">'
        '<skipped message="why"/></testcase></testsuite></testsuites>'
    )
    assert summarize(str(ok)) == (0, "1 passed, 0 failed, 0 errors, 1 SKIPPED [1x why]")
    assert summarize("--strict", str(ok))[0] == 1
