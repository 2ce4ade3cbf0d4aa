# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Device helpers of the kpool decode kernels, in this order: inline PTX,
memory access (global, shared and a cluster peer's shared memory), bit casts
and packing, the order keys of FP32 and BF16 bits, FP32 and integer
arithmetic as Triton emits it (every operation whose rounding matters is one
instruction, which LLVM can neither contract nor re-associate), a CTA scan."""

import functools

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, Uint64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from quack.utils import warp_prefix_sum

# Triton's `tl.exp` multiplies by log2(e) rounded to FP32 (0x3FB8AA3B).
LOG2E_F32_HEX = "0f3FB8AA3B"


def inline_ptx(result=None, *, pure=False):
    """Turns ``f(*args) -> (code, constraints, operands)`` into one inline-PTX op.

    ``result`` is a DSL numeric type, a tuple of them, or None. Impure ops
    (``pure=False``) keep their order relative to every other impure op, which
    is what loads of data written in the same kernel need. Pointer operands
    pass their 64-bit address ("l").
    """

    def wrap(fn):
        @dsl_user_op
        @functools.wraps(fn)
        def op(*args, loc=None, ip=None, **kwargs):
            code, constraints, operands = fn(*args, **kwargs)
            values = []
            for value in operands:
                if hasattr(value, "toint"):  # a pointer
                    value = value.toint(loc=loc, ip=ip)
                values.append(value.ir_value(loc=loc, ip=ip))
            if result is None:
                ir_type = None
            elif isinstance(result, tuple):
                ir_type = llvm.StructType.get_literal([t.mlir_type for t in result])
            else:
                ir_type = result.mlir_type
            value = llvm.inline_asm(
                ir_type,
                values,
                code,
                constraints,
                has_side_effects=not pure,
                is_align_stack=False,
                asm_dialect=llvm.AsmDialect.AD_ATT,
                loc=loc,
                ip=ip,
            )
            if result is None:
                return None
            if isinstance(result, tuple):
                return tuple(
                    t(llvm.extractvalue(t.mlir_type, value, [i], loc=loc, ip=ip))
                    for i, t in enumerate(result)
                )
            return result(value)

        return op

    return wrap


def _registers(count: int, first: int) -> tuple[str, str]:
    """The vector suffix and register list of a ``count``-word access."""
    names = ",".join(f"${first + i}" for i in range(count))
    return (f".v{count}", "{" + names + "}") if count > 1 else ("", names)


def load_words(pointer, count: int):
    """``count`` 32-bit words at ``pointer`` (one vector load, ordered with the
    kernel's stores: the data may have been written earlier in the kernel)."""

    @inline_ptx((Uint32,) * count)
    def load(pointer):
        vector, registers = _registers(count, 0)
        code = f"ld.global{vector}.b32 {registers}, [${count}];"
        return code, ",".join(["=r"] * count + ["l", "~{memory}"]), (pointer,)

    return load(pointer)


def load_words_if(pointer, count: int, when):
    """``count`` words at ``pointer`` if ``when``, else zeros: a predicated
    load of data nothing writes during the kernel, which the compiler may
    schedule freely (several in flight per thread)."""

    @inline_ptx((Uint32,) * count, pure=True)
    def load(pointer, when):
        vector, registers = _registers(count, 0)
        zero = " ".join(f"mov.b32 ${i},0;" for i in range(count))
        code = (
            f"{{ .reg .pred p; setp.ne.b32 p,${count + 1},0; {zero} "
            f"@p ld.global.nc{vector}.b32 {registers}, [${count}]; }}"
        )
        return code, ",".join(["=r"] * count + ["l", "r"]), (pointer, Int32(when))

    return load(pointer, when)


@inline_ptx()
def store_words_if(pointer, words, when):
    """``store_words`` predicated on ``when``."""
    vector, registers = _registers(len(words), 1)
    flag = len(words) + 1
    code = (
        f"{{ .reg .pred p; setp.ne.b32 p,${flag},0; "
        f"@p st.global{vector}.b32 [$0], {registers}; }}"
    )
    constraints = "l" + ",r" * len(words) + ",r,~{memory}"
    words = tuple(Uint32(w) for w in words)
    return code, constraints, (pointer, *words, Int32(when))


@inline_ptx()
def store_words(pointer, words):
    """``words`` (1, 2 or 4 of them) as one vector store at ``pointer``."""
    vector, registers = _registers(len(words), 1)
    constraints = "l" + ",r" * len(words) + ",~{memory}"
    words = tuple(Uint32(w) for w in words)
    return f"st.global{vector}.b32 [$0], {registers};", constraints, (pointer, *words)


@inline_ptx(Uint32, pure=True)
def load_half(pointer):
    """The 16 bits at ``pointer``, zero-extended (a load of data nothing
    writes during the kernel)."""
    code = "{ .reg .b16 h; ld.global.nc.b16 h,[$1]; cvt.u32.u16 $0,h; }"
    return code, "=r,l", (pointer,)


@inline_ptx(Uint32)
def load_peer(address, rank):
    """The 32-bit word at shared address ``address`` of cluster CTA ``rank``
    (ordered after the cluster barrier: not pure)."""
    code = (
        "{ .reg .b32 a; mapa.shared::cluster.u32 a,$1,$2; "
        "ld.shared::cluster.u32 $0,[a]; }"
    )
    return code, "=r,r,r", (Int32(address), Int32(rank))


@inline_ptx((Uint32,) * 4)
def load_shared4(address):
    """Four words at 16-byte aligned shared address ``address``."""
    return "ld.shared.v4.b32 {$0,$1,$2,$3},[$4];", "=r,=r,=r,=r,r", (Int32(address),)


@inline_ptx()
def store_shared4(address, a, b, c, d):
    """Four words at 16-byte aligned shared address ``address``."""
    code = "st.shared.v4.b32 [$0],{$1,$2,$3,$4};"
    words = tuple(Uint32(w) for w in (a, b, c, d))
    return code, "r,r,r,r,r,~{memory}", (Int32(address), *words)


@inline_ptx()
def store_shared(address, word):
    """One word at shared address ``address``."""
    return "st.shared.b32 [$0],$1;", "r,r,~{memory}", (Int32(address), Uint32(word))


def float_bits(value) -> Uint32:
    return Uint32(llvm.bitcast(T.i32(), Float32(value).ir_value()))


def bits_float(bits) -> Float32:
    return Float32(llvm.bitcast(T.f32(), Uint32(bits).ir_value()))


@inline_ptx((Float32, Float32), pure=True)
def unpack_bf16(word):
    """The FP32 values of the low and high BF16 halves of ``word`` (exact)."""
    return "shl.b32 $0,$2,16; and.b32 $1,$2,0xffff0000;", "=f,=f,r", (Uint32(word),)


@inline_ptx(Uint32, pure=True)
def pack_fp8(a, b, c, d):
    """FP8 E4M3 (round to nearest, saturating) of four values, ``a`` in the
    lowest byte: Triton's conversion of an FP32 store into an FP8 buffer."""
    code = (
        "{ .reg .b16 lo,hi; cvt.rn.satfinite.e4m3x2.f32 lo,$2,$1; "
        "cvt.rn.satfinite.e4m3x2.f32 hi,$4,$3; mov.b32 $0,{lo,hi}; }"
    )
    return code, "=r,f,f,f,f", tuple(Float32(v) for v in (a, b, c, d))


@inline_ptx(Uint32, pure=True)
def order_key32(word):
    """The FP32 key of ``word``: sign bit set for a positive sign, every bit
    flipped for a negative one (an unsigned order of the IEEE totalOrder)."""
    code = "{ .reg .b32 m; shr.s32 m,$1,31; or.b32 m,m,0x80000000; xor.b32 $0,$1,m; }"
    return code, "=r,r", (Uint32(word),)


@inline_ptx(Uint32, pure=True)
def order_key16(half):
    """The 16-bit key of the BF16 bits in the low half of ``half`` (the high
    half of the FP32 key of its exact upcast)."""
    code = (
        "{ .reg .b32 t,m; shl.b32 t,$1,16; shr.s32 m,t,31; "
        "or.b32 m,m,0x80000000; xor.b32 t,t,m; shr.b32 $0,t,16; }"
    )
    return code, "=r,r", (Uint32(half),)


@inline_ptx(Float32, pure=True)
def add(a, b):
    """``a + b`` rounded on its own (never contracted into an FMA)."""
    return "add.f32 $0,$1,$2;", "=f,f,f", (Float32(a), Float32(b))


@inline_ptx(Float32, pure=True)
def fma(a, b, c):
    """``a * b + c`` with one rounding: Triton's contraction of ``c += a * b``."""
    return "fma.rn.f32 $0,$1,$2,$3;", "=f,f,f,f", (Float32(a), Float32(b), Float32(c))


@inline_ptx(Float32, pure=True)
def div(a, b):
    """Triton's FP32 ``/``: the approximate ``div.full.f32``."""
    return "div.full.f32 $0,$1,$2;", "=f,f,f", (Float32(a), Float32(b))


@inline_ptx(Float32, pure=True)
def exp_diff(score, peak):
    """Triton's ``tl.exp(score - peak)``: ``ex2.approx`` of the difference
    times log2(e), each step rounded on its own."""
    code = (
        "{ .reg .f32 d; sub.f32 d,$1,$2; "
        f"mul.f32 d,d,{LOG2E_F32_HEX}; ex2.approx.f32 $0,d; }}"
    )
    return code, "=f,f,f", (Float32(score), Float32(peak))


@inline_ptx(Float32, pure=True)
def round_bf16(value):
    """``value`` rounded to BF16 (nearest even) and widened back to FP32."""
    code = (
        "{ .reg .b16 h; .reg .b32 w; cvt.rn.bf16.f32 h,$1; "
        "cvt.u32.u16 w,h; shl.b32 $0,w,16; }"
    )
    return code, "=f,f", (Float32(value),)


@inline_ptx(Int32, pure=True)
def magnitude_bits(value):
    """The bits of ``|value|``, 0 for a NaN: an integer whose order is that
    of the magnitudes, as ``fmax`` (which drops NaNs) orders them."""
    code = (
        "{ .reg .pred nan; and.b32 $0,$1,0x7fffffff; "
        "setp.gt.u32 nan,$0,0x7f800000; @nan mov.b32 $0,0; }"
    )
    return code, "=r,r", (float_bits(value),)


@inline_ptx(Float32, pure=True)
def ceil(value):
    return "cvt.rpi.f32.f32 $0,$1;", "=f,f", (Float32(value),)


def trunc_div(value, divisor: int, width: type = Int32):
    """``value // divisor`` rounded toward zero, as Triton (C) divides signed
    integers; the DSL's ``//`` floors. ``divisor`` is a power of two and
    ``width`` (Int32 or Int64) the type of the division."""
    assert divisor > 0 and divisor & (divisor - 1) == 0, divisor
    shift = divisor.bit_length() - 1
    value = width(value)
    if shift == 0:
        return value
    bits, unsigned = (64, Uint64) if width is Int64 else (32, Uint32)
    # Bias negative values by divisor - 1 so the arithmetic shift truncates.
    bias = width(unsigned(value >> (bits - 1)) >> (bits - shift))
    return (value + bias) >> shift


@cute.jit
def block_scan(value: Int32, totals, slot, warps: int):
    """(exclusive prefix of ``value`` over the CTA's ``warps`` warps' threads,
    CTA total), through ``totals[slot : slot + warps]``; one CTA barrier."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    inclusive = warp_prefix_sum(value)
    if lane == 31:
        totals[slot + warp] = inclusive
    cute.arch.barrier()
    warp_total = Int32(0)
    if lane < warps:
        warp_total = totals[slot + lane]
    warps_inclusive = warp_prefix_sum(warp_total)
    before_warp = cute.arch.shuffle_sync(warps_inclusive - warp_total, offset=warp)
    total = cute.arch.shuffle_sync(warps_inclusive, offset=31)
    return before_warp + inclusive - value, total
