# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``cutedsl/update``: ``UPDATE`` (``kpool_update``, ``LayerStep.update``)
against ``kpool_decode_update_and_maybe_write_cache_batched``: the whole FP8
cache (values, scales, untouched pages and padding) and the whole tail
cache, byte for byte, for MX scales (rounded, or round_scale=False asked)
and FP32 scales rounded or not.

CPU: the rule at its edges and on layouts; the compile for sm_90a and
sm_100a and its PTX (stock's arithmetic, the butterflies, one amax
reduction with NaNs as 0, UE8M0 bytes, 8-byte stores), and the stock Triton
kernel still lowering to that arithmetic. GPU: the fuzz loop over
``cases.update_case`` (per request: ordinary keys, FP8 saturation, the amax
floor, ties, softmax underflow, magnitudes per token, overflow, specials;
per case an edge: infinite keys, a pooled value past FP32, positions past
2^32; positions at and beyond the int32 edge; layouts that are not powers
of two), and ``LayerStep.update`` at the rule's edges."""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import draws
import pytest
import torch
from kernel_ptx import ARCHS, compile_ptx, constants, ops, waits_once
from kpool_fuzz import fuzz, launch_case, stage_with
from rule_edges import (
    declared_disagreements,
    devices_named,
    missing,
    shape_disagreements,
)

from vllm.models.glm5next.nvidia.specialized_decode.constants import DIM, POOL
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.update.launch import (
    TENSORS,
    UPDATE,
)

I16, I32, I64 = torch.int16, torch.int32, torch.int64
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def rule(a: dict) -> str | None:
    """The update's rule on shapes and scalars, as its messages state it:
    head dim 128, pool size 4; a 3-d cache; a tail of [blocks, 2, ring,
    128], the ring a multiple of 4; keys [requests, tokens, 128], scores of
    their shape; APE [4, 128]; the index tensors [requests, tokens]."""
    named = devices_named(a, TENSORS)
    if named:
        return named
    if a["head_dim"] != DIM:
        return "head_dim"
    if a["pool_size"] != POOL:
        return "pool_size"
    if a["kv_cache"].dim() != 3:
        return "kv_cache"
    tail = a["tail_kv_cache"].shape
    if len(tail) != 4 or tail[1] != 2 or tail[2] % POOL or tail[3] != DIM:
        return "tail_kv_cache"
    key = a["key"].shape
    if len(key) != 3 or key[2] != DIM:
        return "key"
    if a["slot_score"].shape != key:
        return "slot_score"
    if a["ape"].shape != (POOL, DIM):
        return "ape"
    for name in ("tail_slot_mapping", "slot_mapping", "positions"):
        if a[name].shape != key[:2]:
            return name
    return None


def test_rule_at_its_edges():
    """Each dimension of each tensor one below, at and one above its size;
    the scalars at their neighbours and the int32 edges; the type and
    device checks: refused exactly where ``rule`` says, naming the
    argument."""
    assert shape_disagreements(UPDATE, rule) == []


@pytest.mark.parametrize("name", TENSORS)
def test_a_missing_tensor_is_refused(name):
    assert missing(UPDATE, name) == []


def test_rule_on_layouts_and_dtypes():
    """The layouts of ``rule_layouts.py`` and each tensor in float64:
    refused naming the argument they declare, or taken."""
    assert declared_disagreements(UPDATE) == []


# --- Compile (CPU) ----------------------------------------------------------------

LOG2E = "0f3FB8AA3B"
# The accurate log2f (libdevice) that both kernels evaluate, by its constants.
LOG2F = {
    *("0f3DC6B27F", "0fBE2C7F30", "0f3E2FCF2A", "0fBE374E43", "0f3E520BF4"),
    *("0fBE763C8B", "0f3E93BF99", "0fBEB8AA49", "0f3EF6384A", "0fBF38AA3B"),
}
# 1/sqrt(128), the 1e-4 amax floor, 1/448, and +-448.
QUANT = {"0f3DB504F3", "0f38D1B717", "0f3B124925", "0f43E00000", "0fC3E00000"}
# (MX scales, round_scale) variants.
VARIANTS = [(True, True), (False, True), (False, False)]
# ring, page, page bytes, tail block, tail half.
LAYOUT = (8, 64, 64 * 132, 2 * 8 * 128, 8 * 128)


def update_key(mx: bool, round_scale: bool, positions=I32):
    ring, page, page_bytes, tail_block, tail_half = LAYOUT
    return UPDATE.CompileKey(
        *(ring, page, page_bytes, tail_block, tail_half),
        *(mx, round_scale, I64, I64, positions),
    )


@pytest.fixture(scope="module", params=ARCHS)
def ptx(request):
    keys = {f"mx{int(m)}-round{int(r)}": update_key(m, r) for m, r in VARIANTS}
    keys["int64-positions"] = update_key(True, True, I64)
    return {name: compile_ptx(UPDATE, key, request.param) for name, key in keys.items()}


def check_update_arithmetic(ptx: str, mx: bool, round_scale: bool):
    """What bit exactness of the update rests on, in either kernel's PTX."""
    count = ops(ptx)
    assert count["ex2.approx.f32"] >= 4, "softmax: ex2.approx (no ftz) per member"
    assert re.search(
        rf"mul\.f32[^;]*{LOG2E};(\s*\.loc[^\n]*)?\s*ex2\.approx\.f32", ptx
    ), "exp: (s - max) * log2(e) rounded, then ex2.approx"
    assert count["div.full.f32"] >= 2, "acc / denom and x / scale: div.full"
    assert count["fma.rn.f32"] >= 4, "softmax-weighted keys: an FMA chain"
    assert count["cvt.rn.bf16.f32"] >= 2, "BF16 roundings"
    assert count["cvt.rn.satfinite.e4m3x2.f32"] >= 1, "FP8 E4M3 satfinite"
    assert constants(ptx) >= QUANT, QUANT - constants(ptx)
    rounds = round_scale or mx
    assert (constants(ptx) >= LOG2F) == rounds, "accurate libdevice log2f"
    assert ("cvt.rpi" in ptx) == rounds, "ceil of the exponent"
    assert count["lg2.approx.f32"] == 0 and count["lg2.approx.ftz.f32"] == 0


@pytest.mark.parametrize("mx,round_scale", VARIANTS)
def test_update_ptx(ptx, mx, round_scale):
    """Stock's arithmetic; the four FMAs of each dimension in pool order;
    the butterflies 4..64, four values each; the amax as one integer
    reduction of |x|'s bits, NaNs dropped as fmax does; UE8M0 x4 bytes for
    MX scales; PDL; the 8-byte stores of the 8-byte aligned rows."""
    text = ptx[f"mx{int(mx)}-round{int(round_scale)}"]
    check_update_arithmetic(text, mx, round_scale)
    count = ops(text)
    assert count["fma.rn.f32"] >= 16
    assert count["shfl.sync.bfly.b32"] == 20
    assert count["redux.sync.max.s32"] == 1
    assert re.search(r"setp\.gt\.u32 [^;]*0x7f800000;", text), "NaN as 0"
    if mx:
        assert "16843009" in text or "0x01010101" in text.lower(), "UE8M0 x4 bytes"
        assert count["st.global.v2.b32"] >= 1
    waits_once(text)


def test_int64_positions_compile(ptx):
    waits_once(ptx["int64-positions"])


def stock_update_ptx(arch: str, mx: bool, round_scale: bool) -> str:
    """The stock Triton update's PTX for ``arch`` in ``LAYOUT``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm.models.glm5next.nvidia.ops import kpool_compress

    fn = kpool_compress._kpool_decode_update_batched_kernel
    ring, page, page_bytes, tail_block, tail_half = LAYOUT
    consts = dict(
        PAGE_SIZE=page,
        BUF_NUMEL_PER_PAGE=page_bytes,
        POOL_SIZE=4,
        RING=ring,
        TAIL_BLOCK_ELEMS=tail_block,
        KPOOL_HEAD=tail_half,
        HEAD_DIM=128,
        S_OFFSET_NBYTES_IN_PAGE=page * 128,
        ROUND_SCALE=round_scale or mx,
        MX_SCALE=mx,
        BLOCK_D=128,
    )
    pointers = dict(
        buf_fp8_ptr="*fp8e4nv",
        buf_fp32_ptr="*fp32",
        tail_kv_ptr="*bf16",
        key_ptr="*bf16",
        slot_score_ptr="*bf16",
        ape_ptr="*fp32",
        tail_slot_mapping_ptr="*i32",
        slot_mapping_ptr="*i32",
        positions_ptr="*i32",
    )
    signature = {
        name: "constexpr" if name in consts else pointers.get(name, "i32")
        for name in fn.arg_names
    }
    target = GPUTarget("cuda", int(arch[3:-1]), 32)
    source = ASTSource(fn=fn, signature=signature, constexprs=consts)
    return triton.compile(source, target=target).asm["ptx"]


def start_stock_ptx() -> list[subprocess.Popen]:
    """The child that compiles the stock update's PTX of every arch and
    variant into a JSON file, without TRITON_INTERPRET (interpreted kernels
    cannot be compiled); its output in a file (``run.err``)."""
    scratch = tempfile.TemporaryDirectory()
    out = Path(scratch.name, "ptx.json")
    script = (
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "from test_update import ARCHS, VARIANTS, stock_update_ptx; "
        f"open({str(out)!r}, 'w').write(json.dumps({{f'{{a}}-{{int(m)}}-{{int(r)}}': "
        "stock_update_ptx(a, m, r) for a in ARCHS for m, r in VARIANTS}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (the fixture closes it)
    command = [sys.executable, "-c", script]
    run = subprocess.Popen(command, env=env, stdout=err, stderr=err, text=True)
    run.scratch, run.out, run.err = scratch, out, err
    return [run]


# The root conftest.py starts the child once collection is done (half a
# minute of CPU: the imports, then Triton's compiles).
START_EARLY = {"stock_ptx": start_stock_ptx}
STARTED: dict = {}


@pytest.fixture(scope="module")
def stock_ptx(request, started):
    """The stock update's PTX by ``arch-mx-round``."""
    [run] = started(request.module, "stock_ptx")
    with run.scratch, run.err:
        run.wait()
        run.err.seek(0)
        assert run.returncode == 0, run.err.read()[-3000:]
        return json.loads(run.out.read_text())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mx,round_scale", VARIANTS)
def test_stock_update_lowering(stock_ptx, arch, mx, round_scale):
    """The stock Triton update still lowers to the arithmetic ours copies (a
    Triton that changes its lowering must fail here, not drift silently)."""
    check_update_arithmetic(
        stock_ptx[f"{arch}-{int(mx)}-{int(round_scale)}"], mx, round_scale
    )


# --- GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_update_matches_stock():
    fuzz(
        "kpool_update",
        1000,
        lambda rng, gen: launch_case(UPDATE, draws.update_case(rng, gen)),
    )


def _step(gen, ring, page_pad, key_stride, tail_pad):
    """A decode step's update arguments (5 requests x 3 tokens) in a layout
    of the rule's edges; the caches as views of their whole buffers."""
    g = dict(generator=gen, device=gen.device)
    requests, tokens, page = 5, 3, 64
    page_bytes = page * (DIM + 4) + page_pad
    cache = torch.randint(0, 256, (6 * page_bytes,), dtype=torch.uint8, **g)
    block = 2 * ring * DIM + tail_pad
    tail = torch.randn((requests + 1) * block, **g).bfloat16()
    positions = torch.randint(0, 999, (requests, 1), **g)
    positions = (positions + torch.arange(tokens, device=gen.device)).to(I32)
    owner = torch.arange(1, requests + 1, device=gen.device)[:, None]
    free = torch.randperm(6 * page, **g)[: requests * tokens].view(requests, tokens)
    args = (
        cache.as_strided((6, page, DIM + 4), (page_bytes, DIM + 4, 1)),
        tail.as_strided((requests + 1, 2, ring, DIM), (block, ring * DIM, DIM, 1)),
        owner * ring + positions.long() % ring,
        torch.randn(requests, tokens, key_stride, **g).bfloat16()[..., :DIM],
        torch.randn(requests, tokens, DIM, **g).bfloat16(),
        torch.randn(POOL, DIM, **g),
        torch.where(positions % POOL == POOL - 1, free, -1),
        positions,
    )
    return (cache, tail), args


@pytest.mark.gpu
@pytest.mark.parametrize("mx", [False, True])
@pytest.mark.parametrize(
    "edge, inside",
    [
        (dict(ring=4), True),
        (dict(ring=12), True),
        (dict(tail_pad=4), True),
        (dict(tail_pad=2), False),
        (dict(page_pad=4), True),
        (dict(key_stride=DIM + 4), True),
        (dict(key_stride=DIM + 2), False),
    ],
)
def test_stage_at_the_rule_edges(monkeypatch, mx, edge, inside):
    """``LayerStep.update`` just inside the rule launches the kernel, just
    outside runs stock; the whole cache and tail buffers (padding included)
    are stock's."""
    from vllm.models.glm5next.nvidia.ops import kpool_compress
    from vllm.models.glm5next.nvidia.specialized_decode.runtime.stage import (
        LayerStep,
    )

    layout = dict(ring=4, page_pad=0, key_stride=DIM, tail_pad=0) | edge
    monkeypatch.setattr(kpool_compress, "mqa_logits_use_mx_scales", lambda: mx)
    gen = torch.Generator("cuda").manual_seed(11)
    (cache, tail), args = _step(gen, **layout)
    ours = [b.clone() for b in (cache, tail)]
    views = [
        b.as_strided(a.shape, a.stride()) for b, a in zip(ours, args, strict=False)
    ]
    keys = []
    if inside:
        keys = [
            UPDATE.spec(
                **dict(zip(TENSORS, args, strict=True)), pool_size=POOL, mx_scales=mx
            )[0]
        ]
    stage = stage_with(UPDATE, keys, mx_scales=mx)
    LayerStep(stage, None).update(*views, *args[2:], POOL, DIM, round_scale=True)
    kpool_compress.kpool_decode_update_and_maybe_write_cache_batched(
        *args, POOL, DIM, round_scale=True
    )
    torch.cuda.synchronize()
    assert stage.launched == keys
    assert torch.equal(ours[0], cache)
    assert torch.equal(ours[1].view(I16), tail.view(I16))
