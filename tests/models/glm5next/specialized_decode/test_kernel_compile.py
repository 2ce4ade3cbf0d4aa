# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU tier of the kpool kernels: each compiles for sm_90a and sm_100a
(fake tensors, no GPU) as the warmup compiles it (``KERNEL.kernel(key)`` on
``warmup_inputs(key)``), its PTX holds what bit exactness with stock depends
on, and the stock Triton kernel still lowers to that same arithmetic (a
Triton that changes its lowering must fail here, not drift silently)."""

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import cutlass.cute as cute
import pytest

ARCHS = ["sm_90a", "sm_100a"]
LOG2E = "0f3FB8AA3B"
# The accurate log2f (libdevice) that both kernels evaluate, by its constants.
LOG2F = {
    "0f3DC6B27F",
    "0fBE2C7F30",
    "0f3E2FCF2A",
    "0fBE374E43",
    "0f3E520BF4",
    "0fBE763C8B",
    "0f3E93BF99",
    "0fBEB8AA49",
    "0f3EF6384A",
    "0fBF38AA3B",
}
# 1/sqrt(128), the 1e-4 amax floor, 1/448, and +-448.
QUANT = {"0f3DB504F3", "0f38D1B717", "0f3B124925", "0f43E00000", "0fC3E00000"}
# (MX scales, round_scale) variants of the update kernel.
VARIANTS = [(True, True), (False, True), (False, False)]
# ring, page, page bytes, tail block, tail half of the update kernel's config.
LAYOUT = (8, 64, 64 * 132, 2 * 8 * 128, 8 * 128)


def ops(ptx: str) -> Counter:
    """Instruction counts of ``ptx``, inline-asm blocks included."""
    pattern = r"(?:^|[{;])\s*(?:@!?%?\w+\s+)?([a-z][\w.:]*)"  # predicated too
    return Counter(re.findall(pattern, ptx, re.M))


def constants(ptx: str) -> set[str]:
    return set(re.findall(r"0f[0-9A-F]{8}", ptx))


def compile_ptx(kernel, args, arch: str) -> str:
    """PTX of ``kernel`` compiled as the JIT warmup compiles it (TVM-FFI, an
    environment stream, the warmup's fake tensors) for ``arch``."""
    from vllm.model_executor.warmup.jit_warmup_cutedsl_helper import (
        cutedsl_fake_stream,
    )

    with tempfile.TemporaryDirectory() as dump:
        options = f"--enable-tvm-ffi --keep-ptx --dump-dir {dump} --gpu-arch {arch}"
        compiled = cute.compile(kernel, *args, cutedsl_fake_stream(), options=options)
        return compiled.__ptx__


def cute_kernels():
    """(name, kernel, fake arguments) of every kernel and variant."""
    import torch

    from vllm.models.glm5next.nvidia.specialized_decode.expand_kernel import EXPAND
    from vllm.models.glm5next.nvidia.specialized_decode.remap_kernel import REMAP
    from vllm.models.glm5next.nvidia.specialized_decode.upcast_kernel import UPCAST
    from vllm.models.glm5next.nvidia.specialized_decode.update_kernel import UPDATE

    ring, page, page_bytes, tail_block, tail_half = LAYOUT
    i32, i64 = torch.int32, torch.int64
    update = UPDATE.CompileKey
    variants = [
        (
            UPDATE,
            f"update-mx{int(mx)}-round{int(r)}",
            update(ring, page, page_bytes, tail_block, tail_half, mx, r, i64, i64, i32),
        )
        for mx, r in VARIANTS
    ]
    positions64 = (True, True, i32, i32, i64)
    layout = (ring, page, page_bytes, tail_block, tail_half)
    remap = REMAP.CompileKey
    variants += [
        (UPDATE, "update-int64-positions", update(*layout, *positions64)),
        (EXPAND, "expand", EXPAND.CompileKey(512, i32, False)),
        (EXPAND, "expand-int64", EXPAND.CompileKey(512, i64, False)),
        # The stage's decode expansions: int64 positions truncated to int32.
        (EXPAND, "expand-int32-lengths", EXPAND.CompileKey(512, i64, True)),
        (REMAP, "remap", remap(512, 2176, 64, 64, i64, False, True)),
        (REMAP, "remap-nocounts", remap(512, 2176, 64, 64, i64, False, False)),
        (REMAP, "remap-int32-lengths", remap(512, 2176, 64, 64, i64, True, True)),
        (UPCAST, "upcast", UPCAST.CompileKey()),
    ]
    for kernel, name, key in variants:
        yield name, kernel.kernel(key), kernel.warmup_inputs(key)


@pytest.fixture(scope="module", params=ARCHS)
def ptx(request):
    return {
        name: compile_ptx(kernel, args, request.param)
        for name, kernel, args in cute_kernels()
    }


def stock_update_ptx(arch: str, mx: bool, round_scale: bool) -> str:
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
    """The update's PTX holds stock's arithmetic, its butterflies, one
    amax reduction with NaNs as 0, and UE8M0 bytes for MX scales."""
    text = ptx[f"update-mx{int(mx)}-round{int(round_scale)}"]
    check_update_arithmetic(text, mx, round_scale)
    count = ops(text)
    # The four fused-multiply-adds of each dimension, in pool order.
    assert count["fma.rn.f32"] >= 16
    assert count["shfl.sync.bfly.b32"] == 20, "butterflies 4..64, four values each"
    # The amax: one integer reduction of |x|'s bits, NaNs dropped as fmax does.
    assert count["redux.sync.max.s32"] == 1
    assert re.search(r"setp\.gt\.u32 [^;]*0x7f800000;", text), "NaN as 0"
    if mx:
        assert "16843009" in text or "0x01010101" in text.lower(), "UE8M0 x4 bytes"


@pytest.fixture(scope="module")
def stock_ptx(tmp_path_factory):
    """The stock update's PTX of every arch and variant. Compiled in a child
    without TRITON_INTERPRET: interpreted kernels cannot be compiled."""
    out = tmp_path_factory.mktemp("stock") / "ptx.json"
    script = (
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "from test_kernel_compile import ARCHS, VARIANTS, stock_update_ptx; "
        f"open({str(out)!r}, 'w').write(json.dumps({{f'{{a}}-{{int(m)}}-{{int(r)}}': "
        "stock_update_ptx(a, m, r) for a in ARCHS for m, r in VARIANTS}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mx,round_scale", VARIANTS)
def test_stock_update_lowering(stock_ptx, arch, mx, round_scale):
    """The stock Triton update still lowers to the arithmetic ours copies."""
    text = stock_ptx[f"{arch}-{int(mx)}-{int(round_scale)}"]
    check_update_arithmetic(text, mx, round_scale)


def test_every_kernel_waits_on_its_producer(ptx):
    """Every kernel waits once on its producer (PDL), lets its dependents
    launch where its design says, and spills nothing to local memory."""
    for name, text in ptx.items():
        count = ops(text)
        assert count["griddepcontrol.wait"] == 1, name
        # The upcast lets its dependents launch from a CTA on its last tile:
        # at its start where the width allows two tiles, on its first, after
        # the group's tiles are counted, or in the loop.
        triggers = 4 if name.startswith("upcast") else 1
        assert count["griddepcontrol.launch_dependents"] == triggers, name
        assert ".local" not in text, f"{name} spills to local memory"


@pytest.mark.parametrize(
    "name,store",
    [
        ("expand", "st.global.v4.b32"),
        ("remap", "st.global.v4.b32"),
        ("remap-nocounts", "st.global.v4.b32"),
        ("update-mx1-round1", "st.global.v2.b32"),
    ],
)
def test_wide_accesses(ptx, name, store):
    """The 16- and 8-byte stores the rules' alignments are there for."""
    assert ops(ptx[name])[store] >= 1, f"{name}: no {store}"


def test_upcast_accesses(ptx):
    """The upcast's 8-byte loads and 16-byte stores, two runs a tile."""
    # A thread's two runs of 4 columns a tile (the first tile and the
    # loop's): 8-byte loads, 16-byte stores that a warp lays side by side.
    count = ops(ptx["upcast"])
    assert count["ld.global.nc.v2.b32"] == count["st.global.v4.b32"] == 4
    assert count["ld.global.nc.v4.b32"] == 0


def _definitions(ptx: str) -> dict[str, list[tuple[str, list[str]]]]:
    """Each register's defining instructions (op, operands) in ``ptx``."""
    defs: dict[str, list[tuple[str, list[str]]]] = {}
    line = r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)\s+(%\w+),\s*([^;]*);"
    for op, dst, operands in re.findall(line, ptx, re.M):
        defs.setdefault(dst, []).append((op, [o.strip() for o in operands.split(",")]))
    return defs


def length_arithmetic(ptx: str) -> tuple[str, list[str]]:
    """The width of the trailing pool's division by 4 (``trunc_div``: sign
    shift by 31 or 63, then by 30 or 62) and the ops that define the two
    operands of the add of length and offset it divides."""
    pattern = (
        r"shr\.s(32|64)\s+(%\w+),\s*(%\w+),\s*(?:31|63);"
        r"\s*shr\.u\1\s+%\w+,\s*\2,\s*(?:30|62);"
    )
    [(bits, _, dividend)] = re.findall(pattern, ptx)
    defs = _definitions(ptx)
    [(add, operands)] = [d for d in defs[dividend] if d[0].startswith("add.")]
    assert add == f"add.s{bits}"
    return bits, sorted(op for operand in operands for op, _ in defs[operand])


@pytest.mark.parametrize(
    "name, bits, operands",
    [
        ("expand", "32", ["ld.global.b32", "ld.param.b32"]),
        ("expand-int64", "64", ["cvt.s64.s32", "or.b64"]),
        ("expand-int32-lengths", "32", ["ld.global.b32", "ld.param.b32"]),
        ("remap", "64", ["cvt.s64.s32", "or.b64"]),
        ("remap-int32-lengths", "32", ["ld.global.b32", "ld.param.b32"]),
    ],
)
def test_length_arithmetic(ptx, name, bits, operands):
    """``int32_lengths`` (stock's decode: ``positions.to(torch.int32) + 1``)
    adds the offset to the int64 length's low word, loaded alone, in 32 bits
    and divides in 32 bits, as for int32 lengths; without it an int64 length
    (its two words joined) and the widened offset are added and divided in
    64 bits, as stock's expansion computes them."""
    assert length_arithmetic(ptx[name]) == (bits, operands)
    if bits == "32":
        assert "shr.s64" not in ptx[name], "no 64-bit division by 4"


def test_int32_lengths_is_the_int32_kernel(ptx):
    """The expansion of int64 lengths truncated to int32 is, instruction for
    instruction, the expansion of int32 lengths (it loads the low word)."""
    assert ops(ptx["expand-int32-lengths"]) == ops(ptx["expand"])


def test_remap_compiles_to_the_int32_edge():
    """The remap rule's bounds are the compiler's: the largest int32 block
    size and row stride compile; one past int32, either does not (the
    kernel's block arithmetic is int32), which is why the rule refuses it."""
    import torch

    from vllm.models.glm5next.nvidia.specialized_decode.remap_kernel import REMAP

    def compile_remap(block_size, stride_rows):
        key = REMAP.CompileKey(
            32, 256, block_size, stride_rows, torch.int64, False, False
        )
        return compile_ptx(REMAP.kernel(key), REMAP.warmup_inputs(key), "sm_90a")

    assert "griddepcontrol.wait" in compile_remap(2**31 - 4, 2**31 - 1)
    for block_size, stride_rows in ((2**31, 64), (64, 2**31)):
        with pytest.raises(Exception, match="TYPE_UNSTABLE_JOIN"):
            compile_remap(block_size, stride_rows)
