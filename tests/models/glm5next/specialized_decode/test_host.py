# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``cutedsl/common/host.py`` and how every kernel launches: the refusal
(``Refused``, ``mismatch``, ``layout``, ``check_int32``, ``check_devices``);
the public functions (``kpool.py``), which raise the rule's refusal word for
word before anything compiles; ``kernel_launcher``, which compiles a key on
first use and never inside a CUDA graph capture; empty inputs, which launch
nothing; a stage's own kernel instances (``KpoolStage.kernels``), whose
``serve`` launches only a key the stage's own warmup put in
``stage.executors`` (not one a public function compiled); the keys the
warmup lists, which are the keys ``spec`` derives; the guard table of
docs/reference.md, which is the rules'; and the kernel layer, which imports
nothing of the stage (``runtime/``).

CPU: the compiles go to a recorder in place of vLLM's ``compile_cutedsl``
(where a compile leaves Python for the CuTe DSL compiler), over kernels
that compiled nothing yet; the executors are recorders. GPU: a real
capture refuses to compile; after a warmup the stage compiles nothing."""

import ast
import dataclasses
import random
import re
from pathlib import Path
from types import SimpleNamespace

import draws
import pytest
import torch
from rule_edges import KEYS, allow_cpu, answer, edges, like, on_cuda, valid

from vllm.model_executor.warmup import jit_warmup_cutedsl_helper
from vllm.models.glm5next.nvidia.specialized_decode import cases, kpool
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.common import host
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.common.host import STOCK
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.expand.launch import (
    EXPAND,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.remap.launch import (
    REMAP,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.scores.launch import (
    SCORES,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select.launch import (
    SELECT,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.upcast.launch import (
    UPCAST,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.update.launch import (
    TENSORS as UPDATE_TENSORS,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.update.launch import (
    UPDATE,
)
from vllm.models.glm5next.nvidia.specialized_decode.runtime.stage import KpoolStage

KERNELS = [UPDATE, EXPAND, REMAP, UPCAST, SELECT]
DRAWS = {UPDATE: draws.update_case, EXPAND: draws.expand_case}
DRAWS |= {REMAP: draws.remap_case, UPCAST: draws.upcast_case}
IDS = ["update", "expand", "remap", "upcast", "select"]
REPO = Path(__file__).resolve().parents[4]

# --- The refusal ------------------------------------------------------------------


def test_refused_names_the_argument():
    refusal = host.mismatch("x", "y", 3)
    assert isinstance(refusal, host.Refused) and isinstance(refusal, ValueError)
    assert str(refusal) == "x: expected y, got 3"
    t = torch.zeros(2, 6, dtype=torch.int32)[:, ::2]
    assert host.layout(t) == "torch.int32 [2, 3] strides [6, 2]"


@pytest.mark.parametrize(
    "value, ok",
    [(0, True), (2**31 - 1, True), (-(2**31), True), (2**31, False)]
    + [(-(2**31) - 1, False), (1.0, False), ("1", False), (None, False)],
)
def test_check_int32(value, ok):
    if ok:
        host.check_int32("n", value)
    else:
        with pytest.raises(host.Refused, match="^n: expected an int32, got "):
            host.check_int32("n", value)


def test_check_devices():
    """CUDA tensors on one device pass (None only where the argument is
    optional); a missing required tensor, a CPU tensor, a non-tensor, a
    tensor on another device are refused naming them."""
    names = ("a", "b", "c")
    host.check_devices(names, on_cuda(1), None, on_cuda(1), optional=("b",))
    cases = [
        (
            (on_cuda(0), None, on_cuda(0)),
            (),
            "b: expected a torch.Tensor, got NoneType",
        ),
        (
            (on_cuda(0), torch.zeros(1), None),
            ("c",),
            "b: expected a CUDA tensor, got a tensor on cpu",
        ),
        ((on_cuda(0), [1], None), ("c",), "b: expected a torch.Tensor, got list"),
        (
            (None, on_cuda(0), on_cuda(1)),
            ("a",),
            "c: expected a tensor on cuda:0 as the others, got cuda:1",
        ),
        (
            (torch.zeros(1, device="meta"), None, None),
            ("b", "c"),
            "a: expected a CUDA tensor, got a tensor on meta",
        ),
    ]
    for tensors, optional, message in cases:
        with pytest.raises(host.Refused) as refusal:
            host.check_devices(names, *tensors, optional=optional)
        assert str(refusal.value) == message


FIRST = {UPDATE: "kv_cache", EXPAND: "pool_ids", REMAP: "pool_ids"}


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_cpu_tensors_are_refused(kernel):
    """Every rule refuses CPU tensors, naming the first tensor argument: no
    kernel runs on the CPU (the rule tests put a double in its place)."""
    first = FIRST.get(kernel, "logits")
    message = answer(kernel, valid(kernel))
    assert message == f"{first}: expected a CUDA tensor, got a tensor on cpu"


# --- Launches (CPU) -----------------------------------------------------------------


class Recorder:
    """A compiled executor's stand-in: records what it is called with."""

    def __init__(self, key=None):
        self.key, self.calls = key, []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def compiles(monkeypatch):
    """The recorders compiled by ``compile_cutedsl`` (each kernel's cache
    emptied first), the rules taking CPU tensors."""
    made: list[Recorder] = []

    def compile_cutedsl(entry, *fakes, **options):
        made.append(Recorder(entry))
        return made[-1]

    monkeypatch.setattr(jit_warmup_cutedsl_helper, "compile_cutedsl", compile_cutedsl)
    for kernel in KERNELS:
        monkeypatch.setattr(kernel, "_compiled_cache", {})
    with allow_cpu():
        yield made


def public(kernel, a: dict):
    """The public function of ``kernel`` (``kpool.py``) on ``a``, or None
    where it has no parameter for what ``a`` holds (``head_dim`` is 128)."""
    if kernel is UPDATE:
        if a["head_dim"] != 128:
            return None
        tensors = [a[name] for name in UPDATE_TENSORS]
        return lambda: kpool.kpool_update(
            *tensors,
            a["pool_size"],
            mx_scales=a["mx_scales"],
            round_scale=a["round_scale"],
        )
    if kernel is EXPAND:
        return lambda: kpool.expand_pools(
            a["pool_ids"],
            a["seq_lens"],
            a["pool_size"],
            seq_offset=a["seq_offset"],
            out=a["out"],
        )
    if kernel is REMAP:
        names = (
            "pool_ids",
            "positions",
            "pool_size",
            "req_ids",
            "block_table",
            "out",
            "counts",
        )
        return lambda: kpool.expand_and_remap(
            *(a[n] for n in names),
            block_size=a["block_size"],
            stride_rows=a["stride_rows"],
            seq_offset=a["seq_offset"],
        )
    if kernel is UPCAST:
        return lambda: kpool.upcast_logits(a["logits"], a["row_ends"], out=a["out"])
    return lambda: kpool.select_topk(a["logits"], a["ends"], a["k"], out=a["out"])


# The public functions that return ``out`` (the others return None).
RETURN_OUT = (EXPAND, UPCAST, SELECT)


def own(a: dict) -> dict:
    """``a`` as the public functions pass it: they compute the lengths in
    their own dtype (``int32_lengths`` False)."""
    return a | ({"int32_lengths": False} if "int32_lengths" in a else {})


def empty(kernel) -> dict:
    """The base case's arguments with no rows (no requests for the
    update)."""
    a = valid(kernel)
    rows = {
        UPDATE: ("tail_slot_mapping", "key", "slot_score", "slot_mapping", "positions"),
        EXPAND: ("pool_ids", "out"),
        REMAP: ("pool_ids", "req_ids", "out"),
        UPCAST: ("logits", "row_ends", "out"),
        SELECT: ("logits", "out"),
    }[kernel]
    return a | {n: like(a[n], shape=(0, *a[n].shape[1:])) for n in rows}


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_public_function_compiles_on_first_use(compiles, kernel):
    """The public function compiles its key once (the first call), then
    launches the executor with ``spec``'s arguments, the caller's tensors
    themselves, and returns ``out`` where the kernel has one. (It computes
    the lengths in their own dtype: ``int32_lengths`` False.)"""
    a = valid(kernel)
    call = public(kernel, a)
    key, args, out = kernel.spec(**own(a))
    for _ in range(2):
        assert call() is (out if kernel in RETURN_OUT else None)
    [executor] = compiles
    assert list(kernel._compiled_cache) == [key]
    assert len(executor.calls) == 2
    assert all(x is y for x, y in zip(executor.calls[0], args, strict=True))


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_empty_inputs_launch_nothing(compiles, kernel):
    """No rows: the rule takes them, nothing compiles, no executor runs, in
    the public function and in the stage."""
    a = empty(kernel)
    key, args, out = kernel.spec(**a)
    assert args is None
    got = public(kernel, a)()
    assert compiles == [] and got is (out if kernel in RETURN_OUT else None)
    stage = KpoolStage([], 8, "cpu", mx_scales=True)
    stage.executors = {key: Recorder()}
    assert of_stage(stage, kernel).serve(**a) is out
    assert stage.executors[key].calls == [] and compiles == []


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_no_compile_inside_a_capture(compiles, monkeypatch, kernel):
    """Inside a CUDA graph capture a key not compiled raises and compiles
    nothing; a compiled one launches."""
    a = valid(kernel)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        public(kernel, a)()
    assert compiles == [] and kernel._compiled_cache == {}
    key = kernel.spec(**own(a))[0]
    kernel._compiled_cache[key] = Recorder()
    public(kernel, a)()
    assert len(kernel._compiled_cache[key].calls) == 1 and compiles == []


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_stage_launches_only_its_own_executors(compiles, kernel):
    """A stage's kernel launches a key only with the executor in
    ``stage.executors`` (its warmup's): a key a public function compiled (in
    the kernel's process-wide cache) is STOCK to the stage, and it compiles
    nothing; a refused input is STOCK whatever the stage holds."""
    a = own(valid(kernel))
    key, args, out = kernel.spec(**a)
    public(kernel, a)()
    [compiled] = compiles
    stage = KpoolStage([], 8, "cpu", mx_scales=True)
    served = of_stage(stage, kernel)
    assert served.serve(**a) is STOCK and len(compiles) == 1
    mine = Recorder()
    stage.executors = {key: mine}
    assert served.serve(**a) is out
    assert len(mine.calls) == 1 and len(compiled.calls) == 1
    assert all(x is y for x, y in zip(mine.calls[0], args, strict=True))
    refused = next(
        e for e in edges(kernel) if e.kind == "type" and e.name.endswith("list")
    )
    assert served.serve(**refused.arguments) is STOCK and len(mine.calls) == 1


def of_stage(stage, kernel):
    """``stage``'s own instance of ``kernel``."""
    [mine] = [k for k in stage.kernels if type(k) is type(kernel)]
    assert mine is not kernel and mine.owner is stage
    return mine


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_public_function_raises_the_refusal(compiles, kernel):
    """For every edge the rule refuses (a missing tensor aside), the public
    function raises its ``Refused``, word for word, before any compile; for
    every edge it takes, it reaches the compiler (or, with no rows, nothing)."""
    problems = []
    for edge in edges(kernel):
        call = public(kernel, edge.arguments)
        if call is None or edge.name.endswith(": None"):
            continue
        message = answer(kernel, edge.arguments)
        compiles.clear()
        kernel._compiled_cache.clear()
        try:
            call()
        except host.Refused as refusal:
            if message is None or str(refusal) != message or compiles:
                problems.append(f"{edge.name}: raised {refusal}, rule: {message}")
            continue
        if message is not None:
            problems.append(f"{edge.name}: not refused, rule: {message}")
    assert problems == []


def test_defaults_are_stocks():
    """A default of a public function (and of the launch under it) is the
    default of the stock function it mirrors: a caller that leaves it out
    gets stock's behaviour."""
    import inspect

    from vllm.models.glm5next.nvidia.ops import kpool_compress

    def default(function, name):
        return inspect.signature(function).parameters[name].default

    update = kpool_compress.kpool_decode_update_and_maybe_write_cache_batched
    expand = kpool_compress.expand_pools_and_append_tail
    assert default(kpool.kpool_update, "round_scale") == default(update, "round_scale")
    for ours in (kpool.expand_pools, EXPAND.spec):
        assert default(ours, "seq_offset") == default(expand, "seq_offset"), ours


def fake_differs(fake, real) -> str | None:
    """How a warmup fake (``make_fake_tensor``, or an ``Int32`` scalar) does
    not describe ``real``, the argument ``spec`` derived: its element type,
    rank, a static size or stride, a dynamic one's divisibility, its stated
    alignment."""
    if not isinstance(real, torch.Tensor):
        ok = type(fake).__name__ == "Int32" and isinstance(real, int)
        return None if ok else f"{type(fake).__name__} for {real!r}"
    names = str(fake.element_type).lower(), str(real.dtype).split(".")[1]
    if names[0] != names[1].replace("_", ""):
        return f"element {names[0]} for {names[1]}"
    if len(fake.shape) != real.dim():
        return f"rank {len(fake.shape)} for {real.dim()}"
    align = fake._assumed_align
    if not isinstance(align, int) or real.data_ptr() % align:
        return f"alignment {align} for address {real.data_ptr():#x}"
    pairs = [("size", fake.shape, real.shape), ("stride", fake.stride, real.stride())]
    for what, fakes, reals in pairs:
        for dim, (f, r) in enumerate(zip(fakes, reals, strict=True)):
            static = isinstance(f, int)
            if (f != r) if static else (r % f.divisibility):
                return f"{what} {f} for {r} in dimension {dim}"
    return None


def fakes_differ(kernel, arguments: dict) -> list[str]:
    """How the fakes of the key ``spec`` derives for ``arguments`` do not
    describe the arguments it derives (nothing where it launches
    nothing)."""
    with allow_cpu():
        key, args, _ = kernel.spec(**arguments)
    if args is None:  # no rows: nothing to launch
        return []
    fakes = kernel.warmup_inputs(key)
    if len(fakes) != len(args):
        return [f"{len(fakes)} fakes for {len(args)} arguments"]
    problems = []
    for i, (fake, real) in enumerate(zip(fakes, args, strict=True)):
        if fake is None and real is None:
            continue
        problem = "no fake" if fake is None else fake_differs(fake, real)
        if problem:
            problems.append(f"argument {i}: {problem}")
    return problems


def no_expected_bytes(monkeypatch):
    """The stock twins ``cases.py`` computes a case's expected bytes with
    (Triton's interpreter on the CPU: most of a large case's draw) as
    no-ops. They write only the expected buffers and draw nothing from
    ``rng`` or ``gen``: the arguments are drawn byte for byte as without
    them, for a test that reads only the arguments."""

    def expand(*args, out=None, **kwargs):
        return torch.zeros((), dtype=torch.int32)  # broadcast over the slice

    monkeypatch.setattr(cases.kpool_compress, "expand_pools_and_append_tail", expand)
    update = "kpool_decode_update_and_maybe_write_cache_batched"
    monkeypatch.setattr(cases.kpool_compress, update, lambda *a, **k: None)
    convert = "triton_convert_req_index_to_global_index"
    monkeypatch.setattr(cases, convert, lambda *a, **k: None)


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_warmup_fakes_describe_drawn_arguments(kernel, monkeypatch):
    """The fakes a key compiles on (``warmup_inputs``) describe the arguments
    ``spec`` derives for that key from four drawn cases (freshly allocated
    buffers: their base pointers aligned; the least-aligned arguments the
    rules take are the next test's). (On the GPU TVM-FFI refuses arguments
    that do not fit; the CPU cannot launch, so this is where it shows.)"""
    no_expected_bytes(monkeypatch)  # only the arguments are read here
    problems = []
    for seed in range(4):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        if kernel is SELECT:
            shape = rng.choice([(1, 1000), (3, 4096), (2, 65536)])
            dtype = rng.choice([torch.float32, torch.bfloat16])
            key = SELECT.dispatch(
                k=64, dtype=dtype, rows=shape[0], width=shape[1], sms=8
            )
            case = cases.select_case(rng, gen, key, sms=8)
        else:
            case = DRAWS[kernel](rng, gen)
        found = fakes_differ(kernel, case.arguments)
        problems += [f"seed {seed} ({draws.about(case)}): {p}" for p in found]
    assert problems == []


def loosened(arguments: dict) -> list[tuple[str, dict]]:
    """``arguments`` with one tensor less aligned: its base pointer 1 to 16
    bytes further (in whole elements), or one of its non-unit strides 1 to
    16 bytes longer (with every tensor of the same shape and strides: the
    upcast's ``out`` follows its logits)."""
    found = []
    for name, value in arguments.items():
        if not isinstance(value, torch.Tensor) or not value.numel():
            continue
        steps = range(1, 16 // value.element_size() + 1)
        for offset in steps:
            changed = arguments | {name: like(value, offset=offset)}
            found.append((f"{name} {offset * value.element_size()} bytes in", changed))
        for dim, stride in enumerate(value.stride()):
            if stride == 1:
                continue
            for more in steps:
                strides = list(value.stride())
                strides[dim] += more
                layout = (value.shape, value.stride())
                changed = dict(arguments)
                for other, tensor in arguments.items():
                    if (
                        isinstance(tensor, torch.Tensor)
                        and (tensor.shape, tensor.stride()) == layout
                    ):
                        changed[other] = like(tensor, stride=strides)
                label = f"{name} stride {dim} + {more * value.element_size()} bytes"
                found.append((label, changed))
    return found


def base_cases(kernel) -> list[tuple[str, dict]]:
    """(dtype, arguments) of the kernel's base case (``rule_edges``), and
    for the select also of BF16 logits (the base case's are FP32)."""
    found = [("", valid(kernel))]
    if kernel is SELECT:
        key = SELECT.dispatch(**KEYS[SELECT] | dict(dtype=torch.bfloat16))
        gen = torch.Generator().manual_seed(17)
        case = cases.select_case(random.Random(17), gen, key, sms=132)
        found.append(("bf16 ", case.arguments))
    return found


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_warmup_fakes_describe_the_least_aligned_arguments(kernel):
    """For every argument set the rule takes among the base case's (and the
    select's also with BF16 logits) with one tensor's base pointer 1 to 16
    bytes further or one of its strides 1 to 16 bytes longer, the fakes of
    the key ``spec`` derives describe the arguments it derives: the stand-ins
    a key compiles on claim no more alignment than the rule asks."""
    problems, taken = [], 0
    for dtype, arguments in base_cases(kernel):
        for name, changed in loosened(arguments):
            with allow_cpu():
                if answer(kernel, changed) is not None:
                    continue
            taken += 1
            problems += [f"{dtype}{name}: {p}" for p in fakes_differ(kernel, changed)]
    assert taken > 0
    assert problems == []


def test_warmup_keys_are_what_spec_derives():
    """Each kernel's ``get_warmup_keys`` of a deployment's values lists the
    key ``spec`` derives for tensors of those shapes (the remap's with and
    without counts)."""
    from vllm.model_executor.warmup.jit_warmup import WarmupChoices

    with allow_cpu():
        for kernel in (UPDATE, EXPAND, UPCAST):
            assert kernel.get_warmup_keys(**KEYS[kernel]) == [
                kernel.spec(**valid(kernel))[0]
            ]
        values = KEYS[REMAP] | dict(counts=WarmupChoices(True, False))
        a = valid(REMAP)
        derived = [REMAP.spec(**a)[0], REMAP.spec(**a | dict(counts=None))[0]]
        assert sorted(map(repr, REMAP.get_warmup_keys(**values))) == sorted(
            map(repr, derived)
        )


def _attention(mx_page=64):
    """A DSA layer as the stage and its warmup read it (an MLA impl no index
    group serves: no fused remap): a 64-token page, an 8-token tail ring,
    2048 top-k tokens in a 2176-column buffer."""
    indexer = SimpleNamespace(
        k_cache=SimpleNamespace(
            prefix="model.layers.0.self_attn.indexer.k_cache",
            kv_cache=torch.zeros(4, mx_page, 132, dtype=torch.uint8),
        ),
        tail_cache=SimpleNamespace(
            prefix="model.layers.0.self_attn.indexer.tail_cache",
            kv_cache=torch.zeros(3, 2, 8, 128, dtype=torch.bfloat16),
        ),
        topk_tokens=2048,
        topk_indices_buffer=torch.zeros(2, 2176, dtype=torch.int32),
        scale_fmt="ue8m0",
        max_pool_len=65536,
    )
    impl = SimpleNamespace()
    return SimpleNamespace(
        indexer=indexer, mla_attn=SimpleNamespace(mla_attn=SimpleNamespace(impl=impl))
    )


def test_stage_warmup_keys_are_what_spec_derives():
    """A stage's kernels list, for a layer, the keys ``spec`` derives for
    the arguments a planned step hands the kernels: the update of the
    layer's caches with the indexer's int32 positions and int64 slots, the
    expansion of the runner's int64 positions as int32 (stock's decode),
    the upcast of MX-scaled BF16 logits."""
    attn = _attention()
    stage = KpoolStage([attn], 8, "cpu", mx_scales=True)
    # The scores are off (their keys: test_warmup.py).
    publics = (*KERNELS, SCORES)
    listed = [
        (public, key)
        for public, kernel in zip(publics, stage.kernels, strict=True)
        for key in kernel.get_warmup_keys()
    ]
    kv, tail = attn.indexer.k_cache.kv_cache, attn.indexer.tail_cache.kv_cache
    rows = torch.zeros(3, 1, 128, dtype=torch.bfloat16)
    i64 = torch.zeros(3, 1, dtype=torch.int64)
    update = dict(kv_cache=kv, tail_kv_cache=tail, tail_slot_mapping=i64, key=rows)
    update |= dict(slot_score=rows, ape=torch.zeros(4, 128), slot_mapping=i64)
    update |= dict(positions=i64.int(), pool_size=4, mx_scales=True)
    expand = dict(
        pool_ids=torch.zeros(3, 512, dtype=torch.int32), seq_lens=i64.view(-1)
    )
    expand |= dict(
        pool_size=4, seq_offset=1, out=torch.zeros(3, 2176, dtype=torch.int32)
    )
    logits = torch.zeros(3, 1024, dtype=torch.bfloat16)
    upcast = dict(logits=logits, row_ends=torch.zeros(3, dtype=torch.int32))
    with allow_cpu():
        derived = [
            (UPDATE, UPDATE.spec(**update)[0]),
            (EXPAND, EXPAND.spec(**expand, int32_lengths=True)[0]),
            (UPCAST, UPCAST.spec(**upcast)[0]),
        ]
    assert listed == derived


# --- The compile keys and the refusals' words ---------------------------------------

# Each kernel's key fields, by the argument each is read from.
KEY_FIELDS = {
    UPDATE: dict(
        kv_cache={"page", "page_bytes"},
        tail_kv_cache={"ring", "tail_block", "tail_half"},
        tail_slot_mapping={"tail_slots_dtype"},
        slot_mapping={"slots_dtype"},
        positions={"positions_dtype"},
        mx_scales={"mx_scales"},
        round_scale={"round_scale"},
    ),
    EXPAND: dict(
        pool_ids={"groups"},
        seq_lens={"seq_lens_dtype"},
        int32_lengths={"int32_lengths"},
    ),
    REMAP: dict(
        pool_ids={"groups"},
        out={"width"},
        block_size={"block_size"},
        stride_rows={"stride_rows"},
        positions={"positions_dtype"},
        int32_lengths={"int32_lengths"},
        counts={"counts"},
    ),
    UPCAST: {},
    SELECT: dict(
        k={"k"},
        logits={"dtype", "cluster", "capacity"},
    ),
}


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_key_fields(kernel):
    """Over every edge the rule takes, the compile key differs from the
    base case's only in the fields read from the arguments the edge
    changes (batch sizes and other arguments give the same key), and every
    field changes at some edge; keys are frozen."""
    found = edges(kernel)
    base = found[0].arguments
    fields = [f.name for f in dataclasses.fields(kernel.CompileKey)]
    changed_fields, problems = set(), []
    with allow_cpu():
        base_key = kernel.spec(**base)[0]
        for edge in found[1:]:
            if "None" in edge.name or answer(kernel, edge.arguments) is not None:
                continue
            key = kernel.spec(**edge.arguments)[0]
            changed = [n for n in base if edge.arguments[n] is not base[n]]
            allowed = set().union(*(KEY_FIELDS[kernel].get(n, set()) for n in changed))
            differ = {f for f in fields if getattr(key, f) != getattr(base_key, f)}
            changed_fields |= differ
            if not differ <= allowed:
                problems.append(f"{edge.name}: {sorted(differ - allowed)} changed")
    assert problems == []
    assert changed_fields == set(fields)
    if fields:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(base_key, fields[0], None)


MESSAGES = {
    (UPDATE, "key: list"): "key: expected a torch.Tensor, got list",
    (UPDATE, "head_dim=127"): "head_dim: expected 128, got 127",
    (UPDATE, "pool_size=5"): "pool_size: expected 4, got 5",
    (UPDATE, "ape[1]=127"): "ape: expected a contiguous fp32 [4, 128], got "
    "torch.float32 [4, 127] strides [128, 1]",
    (
        UPDATE,
        "positions: meta",
    ): "positions: expected a CUDA tensor, got a tensor on meta",
    (EXPAND, "out: None"): "out: expected a tensor to write (the kernel does not "
    "allocate), got None",
    (EXPAND, "seq_offset=2147483648"): "seq_offset: expected an int32, got 2147483648",
    (REMAP, "pool_ids[1]=511"): "pool_ids: expected a multiple of 32 pools, at most "
    "1024, got 511",
    (REMAP, "out[1]=4224 contiguous"): "out: expected a width the stock conversion "
    "with counts compacts in column order (at most 4096), got 4224",
    (REMAP, "block_size=2147483648"): "block_size: expected a positive int32 "
    "multiple of 4, got 2147483648",
    (REMAP, "stride_rows=64.0"): "stride_rows: expected an int32, got 64.0",
    (UPCAST, "row_ends: another device"): "row_ends: expected a tensor on cpu as "
    "the others, got cuda:1",
    (SELECT, "k=True"): "k: expected an int in [1, 4096], got True",
    (SELECT, "logits[1]=851969"): "logits: expected at most 851968 columns (16 CTAs "
    "of 53248 shared keys), got 851969",
}


@pytest.mark.parametrize("kernel, name", list(MESSAGES))
def test_message(kernel, name):
    """The whole message of a refusal: the argument, what the kernel takes
    (the value the requirement came to, in parentheses), what came."""
    [edge] = [e for e in edges(kernel) if e.name == name]
    with allow_cpu():
        assert answer(kernel, edge.arguments) == MESSAGES[kernel, name]


# --- The guard table ------------------------------------------------------------------


def test_guard_table_is_the_rules():
    """docs/reference.md's guard table is what ``tools/guard_table.py``
    prints from the rules at their edges."""
    from tools import guard_table

    reference = REPO / "docs" / "reference.md"
    how = (
        "paste the output of `python tools/guard_table.py` between "
        f"{guard_table.BEGIN} and {guard_table.END} in docs/reference.md"
    )
    if not reference.is_file():
        pytest.fail(f"docs/reference.md is absent: {how}")
    text = reference.read_text()
    if guard_table.BEGIN not in text:
        pytest.fail(f"docs/reference.md has no guard table: {how}")
    committed = text.split(guard_table.BEGIN, 1)[1].split(guard_table.END, 1)[0]
    assert committed.strip() == guard_table.markdown(), how


# --- The layers -----------------------------------------------------------------------

PACKAGE = REPO / "vllm/models/glm5next/nvidia/specialized_decode"


def imports(path: Path) -> set[str]:
    """The modules ``path`` (a file of ``PACKAGE``) imports, relative imports
    resolved, at any depth of the file (a function's imports too)."""
    parts = ["vllm", *path.relative_to(REPO / "vllm").with_suffix("").parts][:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return found


def test_the_kernels_import_no_runtime():
    """The kernel layer (``kpool.py``, ``cutedsl/``, ``cases.py``,
    ``self_check.py``, the settings and constants) imports nothing of
    ``runtime/``, the stage above it: a stage hands its kernels what they
    need (``KernelOwner``)."""
    runtime = "vllm.models.glm5next.nvidia.specialized_decode.runtime"
    files = [p for p in PACKAGE.rglob("*.py") if "runtime" not in p.parts]
    assert PACKAGE / "kpool.py" in files and len(files) > 20
    found = {
        f"{path.relative_to(PACKAGE)}: {module}"
        for path in files
        for module in imports(path)
        if module == runtime or module.startswith(runtime + ".")
    }
    assert found == set()


# --- GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_rules_answer_cuda_as_cpu(kernel):
    """Every edge gets on CUDA tensors (the product's device check) the
    answer it gets on CPU ones (the tests' double, which stands in for
    nothing else). Where the tensor on another device comes first, the
    message quotes the others' device: each side's is named alike."""

    def answers(device):
        found = edges(kernel, device)
        said = [answer(kernel, e.arguments) for e in found if "None" not in e.name]
        values = found[0].arguments.values()  # the base case's
        base = next(v.device for v in values if isinstance(v, torch.Tensor))
        return [
            m and re.sub(rf"(on \S+ as the others|got {base}$)", "<the device>", m)
            for m in said
        ]

    with allow_cpu():
        on_cpu = answers("cpu")
    assert answers("cuda") == on_cpu


@pytest.mark.gpu
def test_after_the_warmup_on_the_gpu(monkeypatch):
    """A stage whose warmup compiled its keys compiles nothing more; a key
    it did not compile runs stock in the stage (stock's bytes) and compiles
    lazily in the public function (the same bytes); inside a real CUDA graph
    capture a key not compiled raises."""
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )

    device = torch.device("cuda")
    key = EXPAND.dispatch(groups=512, seq_lens_dtype=torch.int64, int32_lengths=True)
    stage = KpoolStage([], 8, device, mx_scales=False)
    stage.executors = {key: EXPAND.executor(key)}
    compile_cutedsl = jit_warmup_cutedsl_helper.compile_cutedsl

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled after the warmup")

    monkeypatch.setattr(jit_warmup_cutedsl_helper, "compile_cutedsl", no_compile)
    gen = torch.Generator(device).manual_seed(3)
    ids = torch.randint(
        -1, 9999, (5, 512), dtype=torch.int32, generator=gen, device=device
    )
    positions = torch.arange(5, dtype=torch.int64, device=device) * 1000
    out = torch.full((5, 2176), -7, dtype=torch.int32, device=device)
    stage.expand(ids, positions, out)  # compiled: launches, compiles nothing
    ids96 = ids[:, :96]  # a key the warmup did not see
    want, got = out.clone().fill_(-7), out.clone().fill_(-7)
    expand_pools_and_append_tail(ids96.long(), positions.int() + 1, 4, out=want)
    stage.expand(ids96, positions, got)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    monkeypatch.setattr(jit_warmup_cutedsl_helper, "compile_cutedsl", compile_cutedsl)
    EXPAND(
        pool_ids=ids96,
        seq_lens=positions,
        pool_size=4,
        seq_offset=1,
        out=got.fill_(-7),
        int32_lengths=True,
    )
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
                kpool.expand_pools(ids[:, :64], positions, 4, out=out)
        finally:
            graph.capture_end()
