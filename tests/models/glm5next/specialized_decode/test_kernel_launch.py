# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How the kernels compile and launch (``jit.py``): what each public function
hands its executor, the lazy compile of ``run`` (never inside a CUDA graph
capture), the stage's ``run_if_ready`` (only what was compiled, else None for
stock) and the warmup's compiles.

CPU: the compiled executors are recorders. The seam is stock vLLM's
``compile_cutedsl``, where a compile leaves Python for the CuTe DSL compiler
(the least private one: everything of ``jit.py`` above it runs as in a
deployment, the capture check and the executor cache included), on fresh
kernel objects in place of ``kpool``'s (nothing compiled; the tests see
compiles through ``ready``). GPU: after a warmup the stage's launches compile
nothing, a key the warmup did not see runs stock in the stage and compiles
lazily in the public function, and a real capture refuses to compile."""

import sys
from types import SimpleNamespace

import pytest
import torch

from tools.guard_table import BF16, DIM, F32, I32, I64, POOL, U8, T
from tools.guard_table import build as guard_args
from vllm.model_executor.warmup import jit_warmup_cutedsl_helper
from vllm.models.glm5next.nvidia.specialized_decode import (
    constants,
    expand_kernel,
    jit,
    kpool,
    remap_kernel,
    upcast_kernel,
    update_kernel,
    warmup,
)

KERNEL_NAMES = ("UPDATE", "EXPAND", "REMAP", "UPCAST")
PACKAGE = "vllm.models.glm5next.nvidia.specialized_decode"


def build(name, **changes):
    return guard_args(name, changes)


class Executor:
    """A compiled executor's stand-in: records what it is called with."""

    def __init__(self, entry):
        self.entry, self.calls = entry, []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def recorded(monkeypatch):
    """Fresh kernels where the public functions, the stage and the warmup
    read them, compiled into ``Executor`` recorders; CPU tensors taken.
    Returns the recorders in compile order and the kernels."""
    monkeypatch.setattr(constants, "KERNEL_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    executors: list[Executor] = []

    def compile_cutedsl(entry, *fakes, **options):
        executors.append(Executor(entry))
        return executors[-1]

    monkeypatch.setattr(jit_warmup_cutedsl_helper, "compile_cutedsl", compile_cutedsl)
    kernels = (update_kernel.UPDATE, expand_kernel.EXPAND, remap_kernel.REMAP)
    fresh = {kernel: type(kernel)() for kernel in (*kernels, upcast_kernel.UPCAST)}

    def is_kernel(value):
        return isinstance(value, jit.KpoolJitKernel) and value in fresh

    # Every module-level name of the package that holds a kernel (or a tuple
    # of them), however a module imports it.
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith(PACKAGE):
            continue
        for attr, value in list(vars(module).items()):
            if is_kernel(value):
                monkeypatch.setattr(module, attr, fresh[value])
            elif isinstance(value, tuple) and any(map(is_kernel, value)):
                monkeypatch.setattr(module, attr, tuple(fresh.get(v, v) for v in value))
    kernels = dict(zip(KERNEL_NAMES, fresh.values(), strict=True))
    return SimpleNamespace(executors=executors, **kernels)


def calls(recorded) -> list:
    return [call for executor in recorded.executors for call in executor.calls]


# --- The refusal and the int32 check ---------------------------------------------


def test_refused_names_the_argument():
    """``mismatch`` is the rules' ValueError; ``layout`` says what came."""
    refusal = jit.mismatch("x", "y", 3)
    assert isinstance(refusal, jit.Refused) and isinstance(refusal, ValueError)
    assert str(refusal) == "x: expected y, got 3"
    t = torch.zeros(2, 6, dtype=I32)[:, ::2]
    assert jit.layout(t) == "torch.int32 [2, 3] strides [6, 2]"


@pytest.mark.parametrize(
    "value, ok",
    [(0, True), (2**31 - 1, True), (-(2**31), True), (2**31, False)]
    + [(-(2**31) - 1, False), (1.0, False), ("1", False), (None, False)],
)
def test_check_int32(value, ok):
    """An int32 is a Python int in [-2^31, 2^31 - 1], named when it is not."""
    if ok:
        jit.check_int32("n", value)
    else:
        with pytest.raises(jit.Refused, match="^n: expected an int32, got "):
            jit.check_int32("n", value)


def test_key_is_built_once():
    """``key`` builds each frozen key once: equal fields, the same object."""
    key = kpool.EXPAND.key(512, I64, False)
    assert kpool.EXPAND.key(512, I64, False) is key
    assert key == expand_kernel.ExpandPoolsKernel.CompileKey(512, I64, False)


# --- What each public function hands its executor ----------------------------------


def test_kpool_update_launch(recorded):
    """The eight tensors themselves, compiled lazily once per key (the
    scale format is part of it)."""
    args = build("update")
    kpool.kpool_update(*args[:9], mx_scales=False, round_scale=False)
    key = update_kernel.KpoolUpdateKernel.CompileKey(
        POOL, 64, 64 * 132, 2 * POOL * DIM, POOL * DIM, False, False, I64, I64, I32
    )
    assert recorded.UPDATE.ready(key) and len(recorded.executors) == 1
    [call] = calls(recorded)
    assert len(call) == 8 and all(a is b for a, b in zip(call, args, strict=False))
    kpool.kpool_update(*args[:9], mx_scales=False, round_scale=False)
    assert len(recorded.executors) == 1 and len(calls(recorded)) == 2
    kpool.kpool_update(*args[:9])
    mx = update_kernel.KpoolUpdateKernel.CompileKey(
        *(key.ring, key.page, key.page_bytes, key.tail_block, key.tail_half),
        *(True, True, I64, I64, I32),
    )
    assert recorded.UPDATE.ready(mx) and len(recorded.executors) == 2


@pytest.mark.parametrize("empty", ["requests", "tokens"])
def test_kpool_update_empty_batch_launches_nothing(recorded, empty):
    """No requests or no tokens: the rule takes it, nothing compiles and no
    executor is called."""
    r, t = (0, 3) if empty == "requests" else (2, 0)
    rows = dict(key=T((r, t, DIM), BF16), slot_score=T((r, t, DIM), BF16))
    indices = dict(tail_slot_mapping=T((r, t), I64), slot_mapping=T((r, t), I64))
    args = build("update", positions=T((r, t), I32), **rows, **indices)
    kpool.kpool_update(*args[:9])
    assert recorded.executors == []


def test_expand_pools_launch(recorded):
    """Pool ids, lengths, ``out`` and the offset (default 0); ``out`` back."""
    a = build("expand")
    out = kpool.expand_pools(a.pool_ids, a.seq_lens, POOL, seq_offset=5, out=a.out)
    assert out is a.out
    key = expand_kernel.ExpandPoolsKernel.CompileKey(512, I64, False)
    assert recorded.EXPAND.ready(key)
    kpool.expand_pools(a.pool_ids, a.seq_lens, POOL, out=a.out)
    assert len(recorded.executors) == 1
    assert calls(recorded) == [(a.pool_ids, a.seq_lens, a.out, o) for o in (5, 0)]
    none = build("expand", pool_ids=T((0, 512), I32), out=T((0, 2176), I32))
    out = kpool.expand_pools(none.pool_ids, none.seq_lens, POOL, out=none.out)
    assert out is none.out and len(calls(recorded)) == 2


def test_expand_and_remap_launch(recorded):
    """The tensors, counts or None, and the offset (default 1); the key says
    which conversion and the public function's int64 arithmetic."""
    a = build("remap")
    kpool.expand_and_remap(*a[:7], block_size=64, stride_rows=96, seq_offset=3)
    key = remap_kernel.ExpandRemapKernel.CompileKey
    assert recorded.REMAP.ready(key(512, 2176, 64, 96, I64, False, True))
    kpool.expand_and_remap(*a[:6], block_size=64, stride_rows=64)
    assert recorded.REMAP.ready(key(512, 2176, 64, 64, I64, False, False))
    tensors = (a.pool_ids, a.positions, a.req_ids, a.block_table, a.out)
    assert calls(recorded) == [(*tensors, a.counts, 3), (*tensors, None, 1)]
    with pytest.raises(ValueError, match="^stride_rows: expected an int32"):
        kpool.expand_and_remap(*a[:6], block_size=64, stride_rows=2**31)
    none = build("remap", pool_ids=T((0, 512), I32), req_ids=T((0,), I32))
    out = T((0, 2176), I32).make("cpu")
    kpool.expand_and_remap(*none[:5], out, block_size=64, stride_rows=64)
    assert len(recorded.executors) == 2 and len(calls(recorded)) == 2


def test_upcast_logits_launch(recorded):
    """Logits, ``out``, row ends and the CTA bound; without ``out`` an FP32
    tensor with the strides of the logits, also for no rows (no launch)."""
    a = build("upcast", logits=T((3, 1000), BF16, (1008, 1)))
    out = T((3, 1000), F32, (1008, 1)).make("cpu")
    assert kpool.upcast_logits(a.logits, a.row_ends, out=out) is out
    assert recorded.UPCAST.ready(upcast_kernel.UpcastLogitsKernel.CompileKey())
    made = kpool.upcast_logits(a.logits, a.row_ends)
    assert made.dtype == F32 and made.shape == (3, 1000) and made.stride() == (1008, 1)
    ctas = upcast_kernel.CTAS
    assert calls(recorded) == [(a.logits, o, a.row_ends, ctas) for o in (out, made)]
    empty = kpool.upcast_logits(
        torch.zeros(0, 8, dtype=BF16), torch.zeros(0, dtype=I32)
    )
    assert empty.shape == (0, 8) and empty.dtype == F32 and len(calls(recorded)) == 2


# --- run, run_if_ready, executor_for ----------------------------------------------


@pytest.fixture
def capturing(monkeypatch):
    """A CUDA graph capture as ``compile`` sees it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def test_run_does_not_compile_inside_a_capture(recorded, monkeypatch, capturing):
    """Inside a capture ``run`` of a key not compiled raises and compiles
    nothing; a compiled key launches."""
    args = build("expand")
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        recorded.EXPAND.run(args)
    assert recorded.executors == []
    other = build("expand", pool_ids=T((3, 32), I32))
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        kpool.expand_pools(other.pool_ids, other.seq_lens, POOL, out=other.out)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    recorded.EXPAND.compile(recorded.EXPAND.key_for(args))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert recorded.EXPAND.run(args) is args
    assert len(recorded.executors) == 1 and len(calls(recorded)) == 1


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_run_if_ready(recorded, monkeypatch, name):
    """The stage's launch: None, launching and compiling nothing, for a
    refused input or a key not compiled; else the launch, with what it
    allocated (``complete``), also inside a capture."""
    kernel = getattr(recorded, name)
    kind = name.lower()
    args = build(kind)
    refused = build(kind, **{guard_args(kind)._fields[0]: [0]})
    assert kernel.executor_for(refused) is None and kernel.run_if_ready(refused) is None
    assert kernel.executor_for(args) is None and kernel.run_if_ready(args) is None
    assert recorded.executors == []
    kernel.compile(kernel.key_for(args))
    [executor] = recorded.executors
    assert kernel.executor_for(args) is executor
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    done = kernel.run_if_ready(args)
    assert [tuple(kernel.executor_args(done))] == executor.calls
    if kind == "upcast":
        assert done.out is not None and done.out.dtype == F32
    else:
        assert done is args


def test_launch_of_empty_rows_calls_nothing(recorded):
    """``launch`` completes the arguments and skips the executor for no
    rows."""
    executor = Executor(None)
    args = build("upcast", logits=T((0, 8), BF16), row_ends=T((0,), I32))
    done = recorded.UPCAST.launch(executor, args)
    assert done.out.shape == (0, 8) and executor.calls == []


def test_get_warmup_keys(recorded):
    """The keys of the cases the kernel takes, each once, in order; the
    refused skipped."""
    kernel = recorded.EXPAND
    cases = [
        build("expand", int32_lengths=True),
        build("expand", pool_size=8),
        build("expand"),
        build("expand", seq_offset=0),
        build("expand", int32_lengths=True),
    ]
    keys = [kernel.key_for(cases[i]) for i in (0, 2)]
    assert kernel.get_warmup_keys(cases) == keys and kernel.get_warmup_keys() == []


# --- The warmup's compiles -----------------------------------------------------------


def _attention(device="cpu", page=64):
    """A DSA layer as the stage reads it, with an MLA impl no index group
    serves (no fused remap)."""
    i32 = dict(dtype=I32, device=device)
    indexer = SimpleNamespace(
        k_cache=SimpleNamespace(
            prefix="model.layers.0.self_attn.indexer.k_cache",
            kv_cache=torch.zeros(4, page, DIM + 4, dtype=U8, device=device),
        ),
        tail_cache=SimpleNamespace(
            prefix="model.layers.0.self_attn.indexer.tail_cache",
            kv_cache=torch.zeros(3, 2, POOL, DIM, dtype=BF16, device=device),
        ),
        topk_tokens=2048,
        topk_indices_buffer=torch.zeros(2, 2176, **i32),
        scale_fmt="ue8m0",
    )
    impl = SimpleNamespace()
    return SimpleNamespace(
        indexer=indexer, mla_attn=SimpleNamespace(mla_attn=SimpleNamespace(impl=impl))
    )


def test_warmup_compiles_the_stage_keys_without_launching(recorded):
    """``KpoolWarmup`` compiles every key of ``warmup_keys`` (the kernels'
    own ``key_for`` of the layer's inputs), launches nothing, and only then
    turns the kpool_stage on."""
    attn = _attention()
    kpool_stage = kpool.KpoolStage([attn], 8, "cpu")
    assert not kpool_stage.fuse and not kpool_stage.warmed
    keys = warmup.warmup_keys(kpool_stage, [attn])
    warmup.KpoolWarmup(kpool_stage, [attn], self_check="off").compile_many([])
    assert kpool_stage.warmed and calls(recorded) == []
    assert len(recorded.executors) == len(keys)
    assert all(kernel.ready(key) for kernel, key in keys)
    # The update in the layer's cache layout, of the indexer's int32 copy of
    # the positions and the metadata's int64 slots; the expansion of the
    # runner's int64 positions, as stock's decode casts them.
    updates = [key for kernel, key in keys if kernel is recorded.UPDATE]
    assert updates and all(
        (k.ring, k.page, k.page_bytes, k.positions_dtype) == (POOL, 64, 64 * 132, I32)
        for k in updates
    )
    assert I64 in {k.slots_dtype for k in updates}
    [expand] = [key for kernel, key in keys if kernel is recorded.EXPAND]
    assert expand == expand_kernel.ExpandPoolsKernel.CompileKey(512, I64, True)
    assert not any(kernel is recorded.REMAP for kernel, _ in keys)


def test_a_failed_warmup_leaves_the_stage_off(recorded, monkeypatch):
    """A compile that raises: the kpool_stage stays off and the log says so;
    "strict" raises."""

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    logged = []
    monkeypatch.setattr(jit_warmup_cutedsl_helper, "compile_cutedsl", broken)
    monkeypatch.setattr(
        warmup,
        "logger",
        SimpleNamespace(exception=lambda message, *args: logged.append(message % args)),
    )
    attn = _attention()
    off = kpool.KpoolStage([attn], 8, "cpu")
    warmup.KpoolWarmup(off, [attn], self_check="off").compile_many([])
    assert not off.warmed
    [message] = logged
    assert "warmup failed (no compiler); dsa_kpool stays off" in message
    with pytest.raises(RuntimeError, match="no compiler"):
        warmup.KpoolWarmup(off, [attn], self_check="strict").compile_many([])


# --- GPU: after the warmup --------------------------------------------------------


@pytest.mark.gpu
def test_after_warmup_on_the_gpu(monkeypatch):
    """After the warmup the kpool_stage's steps (other batch sizes) compile
    nothing; a key the warmup did not see runs stock in the kpool_stage (stock's
    bytes) and compiles lazily in the public function; inside a real CUDA
    graph capture a key not compiled raises."""
    from vllm.models.glm5next.nvidia.ops.kpool_compress import (
        expand_pools_and_append_tail,
    )

    device = torch.device("cuda")
    attn = _attention(device)
    kpool_stage = kpool.KpoolStage([attn], 8, device)
    warmup.KpoolWarmup(kpool_stage, [attn], self_check="off").compile_many([])
    assert kpool_stage.warmed
    compile_cutedsl = jit_warmup_cutedsl_helper.compile_cutedsl

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled after the warmup")

    monkeypatch.setattr(jit_warmup_cutedsl_helper, "compile_cutedsl", no_compile)
    i32, i64 = dict(dtype=I32, device=device), dict(dtype=I64, device=device)
    positions = torch.tensor([[3, 4], [6, 7], [-1, -1]], **i32)
    slots = torch.tensor([[5, -1], [-1, 9], [-1, -1]], **i64)
    tail_slots = torch.arange(1, 4, **i64)[:, None] * POOL + positions % POOL
    key = torch.randn(3, 2, DIM, device=device).to(BF16)
    ape = torch.zeros(POOL, DIM, device=device)
    kv, tail = attn.indexer.k_cache.kv_cache, attn.indexer.tail_cache.kv_cache
    kpool_stage.update(kv, tail, tail_slots, key, key, ape, slots, positions, POOL)
    ids = torch.randint(0, 100, (5, 512), **i32)
    seq = torch.arange(5, **i64)
    out = torch.empty(5, 2176, **i32)
    kpool_stage.expand(ids, seq, POOL, seq_offset=1, out=out, int32_lengths=True)
    logits = torch.randn(3, 1000, device=device).to(BF16)
    kpool_stage.upcast(logits, torch.full((3,), 999, **i32))
    torch.cuda.synchronize()

    # A shape the warmup did not see: stock in the kpool_stage, with stock's bytes ...
    ids96 = ids[:, :96]
    stock_out, stage_out = out.clone().fill_(7), out.clone().fill_(7)
    expand_pools_and_append_tail(ids96, seq, POOL, out=stock_out)
    kpool_stage.expand(ids96, seq, POOL, out=stage_out)
    torch.cuda.synchronize()
    assert torch.equal(stock_out, stage_out)
    # ... compiled lazily by the public function, which then gives them too.
    monkeypatch.setattr(jit_warmup_cutedsl_helper, "compile_cutedsl", compile_cutedsl)
    kpool.expand_pools(ids96, seq, POOL, out=stage_out.fill_(7))
    torch.cuda.synchronize()
    assert torch.equal(stock_out, stage_out)

    # Never inside a CUDA graph capture.
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
                kpool.expand_pools(ids[:, :64], seq, POOL, out=out)
        finally:
            graph.capture_end()
