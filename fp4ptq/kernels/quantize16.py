"""The 16-bit quantize kernel (``_quantize16_kernel``): bf16 / fp16 inputs of 3 rows and more, two elements
a 32-bit register, bit-identical to ``fp4ptq.nvfp4.quantize`` like the fp32-compare kernel of
``quantize_kernel.py``, which launches both (the rule, the tiles and the table's use are there).

Each block's seven E2M1 thresholds (``quantize_kernel.py`` explains them) are rounded up to the 16-bit
format, exact for 16-bit inputs, and the elements are counted against them two at a time by packed
instructions: inline PTX on the GPU (packed float compares, or integer ones for bf16 below sm_90, where
PTX has no packed bf16 ``set`` / ``add``), the same arithmetic in Triton under the interpreter. The
thresholds come from a small per-program table of all scale codes on large inputs and are computed per
block otherwise (seven exact fp64 products read off as 16-bit patterns).

Four Over Six counts both candidates into magnitude words (the same compares, summed with E2M1 step weights:
each half the magnitude ``v``), takes each element's error as the reference does (``fl(v * step) - |x|``,
fp32) into two running sums a candidate, and turns only the kept candidate's words into the index words the
pack reads (issue 44 item 3 in benchmarks/NOTES.md: 594 instructions a block on sm_90 where 652 were).
"""
from __future__ import annotations

import struct

import triton
import triton.language as tl

from ._common import (_combine, _gdc_launch_dependents, e2m1_thresholds, e2m1_value, e4m3_block_scale, e4m3_rne,
                      global_enc_from_amax)


# ---------------------------------------------------------------------------
# The 16-bit kernel: bf16 / fp16 activations two at a time, thresholds per block or from a table
# ---------------------------------------------------------------------------
# A block's thresholds depend only on its E4M3 scale code (and on the global scale). On large inputs
# every program first writes them for all 127 codes into its own small table in global memory (16 int32
# words a code: 0-6 the thresholds rounded up to the input's 16-bit format -- an exact 16-bit |x| is
# >= T iff it is >= that -- each in both halves of the word; 7 the scale in both halves; 8 the fp32 step
# ``scale / global_enc``; stored code-major or word-major, see ``_table_at``), then gathers the words of
# each block's code instead of computing seven fp64 products per block. Each program reads its table
# after a barrier (its own writes are then visible to all its threads; one table shared by all programs
# was measured 2-20x slower, every program writing the same lines), and the grid is persistent (a few
# programs per SM looping over tiles): 8 KB of scratch a program. Elsewhere each block computes its own
# (``_row``), and every program takes a single tile.
TABLE_ROWS = tl.constexpr(128)


TABLE_WORDS = tl.constexpr(16)


@triton.jit
def _e4m3_value(code):
    """fp32 value of E4M3 codes 0..126 (int32), exactly, by bit moves."""
    e = code >> 3
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _round_up_16(t, F16: tl.constexpr):
    """Bit pattern (int32, 0..0x7F80 / 0x7C00) of the smallest bf16 (fp16) that is >= the fp32 ``t >= 0``
    (+inf when none is finite): an exact 16-bit ``|x|`` is ``>= t`` iff it is ``>=`` that value."""
    if F16:
        h = t.to(tl.float16)  # nearest
        hb = h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        up = tl.where(h.to(tl.float32) < t, hb + 1, hb)
    else:
        tb = t.to(tl.int32, bitcast=True)
        up = tl.minimum(tl.where((tb & 0xFFFF) != 0, tb + 0x10000, tb) >> 16, 0x7F80)
    return up


@triton.jit
def _pair16(t, F16: tl.constexpr):
    """``_round_up_16(t)`` in both halves of an int32 word."""
    h = _round_up_16(t, F16)
    return h | (h << 16)


@triton.jit
def _table_at(table_ptr, code, word, WORD_MAJOR: tl.constexpr):
    """Address of ``word`` of ``code``'s table row: rows of 16 words, or (``WORD_MAJOR``) word ``w``
    of every code together, so that a warp gathering one word of its blocks' codes (neighbouring
    blocks have neighbouring scales) touches one or two 128-byte lines instead of one per row."""
    if WORD_MAJOR:
        return table_ptr + word * TABLE_ROWS + code
    else:
        return table_ptr + code * TABLE_WORDS + word


@triton.jit
def _write_table(table_ptr, global_enc, F16: tl.constexpr, WORD_MAJOR: tl.constexpr):
    """Every program's prologue: the table rows of all codes, then a barrier. Each word is computed
    where it is stored, 32 rows at a time: a warp's store instruction then writes 512 contiguous bytes
    (16-byte vectors), where a row a thread stored one word of 32 rows 64 bytes apart (H200: 8192 x 4096
    38.2 -> 29.4 us, mse at 8192 x 28672 393.5 -> 382.6; results/quant16_h200_table_wide2.json). The
    values are ``e2m1_thresholds``' (its fp64 constants and directed rounding), word by word."""
    if WORD_MAJOR:  # [words, codes]: codes contiguous
        col = tl.arange(0, TABLE_WORDS)[:, None]
    else:
        col = tl.arange(0, TABLE_WORDS)[None, :]
    one = tl.where(col >= 0, 1.0, 0.0).to(tl.float64)  # fp64 constants (a bare literal would be fp32)
    mult = tl.where(col == 0, one * 0.250000014901161193847656250, tl.where(col == 1, one * 0.749999970197677612304687500,
           tl.where(col == 2, one * 1.250000059604644775390625000, tl.where(col == 3, one * 1.749999940395355224609375000,
           tl.where(col == 4, one * 2.500000119209289550781250000, tl.where(col == 5, one * 3.499999880790710449218750000,
                    one * 5.000000238418579101562500000))))))
    for r0 in tl.static_range(0, TABLE_ROWS, 32):
        if WORD_MAJOR:
            code = r0 + tl.arange(0, 32)[None, :]
        else:
            code = r0 + tl.arange(0, 32)[:, None]
        scale = tl.where(code < 127, _e4m3_value(code), 0.0)
        step = tl.math.div_rn(scale, global_enc)
        b64 = step.to(tl.float64) * mult
        b32 = b64.to(tl.float32)  # nearest, then stepped up to the smallest fp32 above (">") / at or above
        back = b32.to(tl.float64)
        bits = b32.to(tl.int32, bitcast=True)
        above = tl.where((col % 2) == 0, back > b64, back >= b64)  # ">" tests at the even words
        t = tl.where(step <= 0.0, float("inf"), tl.where(above, bits, bits + 1).to(tl.float32, bitcast=True))
        # words 0-6 the thresholds, 7 the scale (E4M3 values are exact in both formats), 8 the fp32 step
        row = tl.where(col < 7, _pair16(t, F16), tl.where(col == 7, _pair16(scale, F16),
                       tl.where(col == 8, step.to(tl.int32, bitcast=True), 0)))
        tl.store(_table_at(table_ptr, code, col, WORD_MAJOR), row)
    tl.debug_barrier()


# The 16-bit kernel's element work, on int32 words holding two 16-bit floats (element 2p in the low
# half, 2p + 1 in the high half). Each helper is one inline-PTX block on the GPU (``ASM`` 1; 2: the counts
# from integer compares, ``_count_int_asm``) and the same arithmetic spelled in Triton elsewhere (``ASM`` 0:
# the interpreter cannot run PTX); tests check they agree.
def _count_asm(f16: bool) -> str:
    """``$0`` = per half ``base + #{i : $1 >= $(2+i)}`` (base 128 in bf16 / 1024 in fp16, whose low
    bits are then the count): seven packed compares (1.0 where true) summed by packed adds, exact."""
    ty = "f16x2" if f16 else "bf16x2"
    base = "0x64006400" if f16 else "0x43004300"
    lines = ["{", ".reg .b32 s, c;", f"mov.b32 c, {base};"]
    for i in range(7):
        lines.append(f"set.ge.{ty}.{ty} s, $1, ${i + 2}; add.rn.{ty} c, c, s;")
    lines += ["mov.b32 $0, c;", "}"]
    return "\n".join(lines)


def _count_int_asm(f16: bool) -> str:
    """The same count word as ``_count_asm`` from integer instructions only, for GPUs without packed bf16
    compares (sm_80-89): non-negative floats order like their bit patterns, so ``a >= t`` is bit 15 of
    ``(a | 0x8000) - t`` per half (``a`` has bit 15 clear and ``t`` is at most +inf, so no borrow
    crosses the halves), and ``prmt`` spreads that bit over its half as a mask. Three compares walk
    the seven sorted thresholds (t3, then t1 or t5, then t0 / t2 / t4 / t6) and ``lop3`` selects and
    assembles the index; a NaN half counts 0, as the packed float compare (false for NaN) gives."""
    base = "0x64006400" if f16 else "0x43004300"
    nan = "0x7C017C01" if f16 else "0x7F817F81"
    sel = "0xBB99"  # bytes 1, 1, 3, 3 with their sign replicated: bit 15 / 31 -> 0xFFFF in its half
    return "\n".join([
        "{", ".reg .b32 s, d, m3, mb, mc, mn, tb, th, tl, c, k, z;",
        "mov.b32 z, 0; or.b32 s, $1, 0x80008000;",
        f"sub.u32 d, s, $5; prmt.b32 m3, d, z, {sel};",                 # a >= t3
        "lop3.b32 tb, m3, $7, $3, 0xCA;",                                # m3 ? t5 : t1
        f"sub.u32 d, s, tb; prmt.b32 mb, d, z, {sel};",
        "lop3.b32 th, mb, $8, $6, 0xCA; lop3.b32 tl, mb, $4, $2, 0xCA;",  # mb ? t6 : t4, mb ? t2 : t0
        "lop3.b32 tb, m3, th, tl, 0xCA;",
        f"sub.u32 d, s, tb; prmt.b32 mc, d, z, {sel};",
        f"mov.b32 c, {base}; mov.b32 k, 0x00040004; lop3.b32 c, m3, k, c, 0xEA;",  # (m & k) | c
        "mov.b32 k, 0x00020002; lop3.b32 c, mb, k, c, 0xEA;",
        "mov.b32 k, 0x00010001; lop3.b32 c, mc, k, c, 0xEA;",
        f"mov.b32 k, {nan}; sub.u32 d, s, k; prmt.b32 mn, d, z, {sel};",  # a NaN half: back to the base
        f"mov.b32 k, {base}; lop3.b32 $0, c, mn, k, 0xB8;",              # (c & ~mn) | (base & mn)
        "}",
    ])


def _value_asm(f16: bool) -> str:
    """E2M1 magnitude ``v`` of a count ``c = base + i`` per half: ``max(i / 2, i - 2, 2i - 8)``
    (0, .5, 1, 1.5, 2, 3, 4, 6), three packed FMAs and two maxes, all exact."""
    if f16:  # 0.5, -512 | -1026 | 2, -2056
        ty, half, a0, b0, two, d0 = "f16x2", "0x38003800", "0xE000E000", "0xE402E402", "0x40004000", "0xE804E804"
    else:  # 0.5, -64 | -130 | 2, -264
        ty, half, a0, b0, two, d0 = "bf16x2", "0x3F003F00", "0xC280C280", "0xC302C302", "0x40004000", "0xC384C384"
    one = "0x3C003C00" if f16 else "0x3F803F80"
    return "\n".join([
        "{", ".reg .b32 a, b, d, k0, k1;",
        f"mov.b32 k0, {half}; mov.b32 k1, {a0}; fma.rn.{ty} a, $1, k0, k1;",
        f"mov.b32 k0, {one}; mov.b32 k1, {b0}; fma.rn.{ty} b, $1, k0, k1;",
        f"mov.b32 k0, {two}; mov.b32 k1, {d0}; fma.rn.{ty} d, $1, k0, k1;",
        f"max.{ty} a, a, b; max.{ty} $0, a, d;", "}",
    ])


def _pair_const(value: float, f16: bool) -> str:
    """``value`` (exact in the 16-bit format) in both halves of a 32-bit PTX constant."""
    if f16:
        h = struct.unpack("<H", struct.pack("<e", value))[0]
        assert struct.unpack("<e", struct.pack("<H", h))[0] == value
    else:
        b = struct.unpack("<I", struct.pack("<f", value))[0]
        assert b & 0xFFFF == 0, value
        h = b >> 16
    return f"0x{h:04X}{h:04X}"


# Four Over Six counts into "magnitude words": per half the E2M1 magnitude ``v`` itself (``_value_asm``'s
# word), from which the reference's ``fl(v * step)`` is one fp32 product, and the index word ``base + i``
# of the kept scale a few packed ops.
_STEPS = (0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0)  # E2M1 magnitude gained at each of the seven thresholds


def _wcount_asm(f16: bool) -> str:
    """``$0`` = per half the E2M1 magnitude ``v`` of ``$1`` against the thresholds ``$2..$8``: the seven
    packed compares of ``_count_asm`` (1.0 where true), each weighted by the step of magnitude it crosses
    with a packed fma instead of added (the same instruction count; every sum exact)."""
    ty = "f16x2" if f16 else "bf16x2"
    lines = ["{", ".reg .b32 s, c, k;", "mov.b32 c, 0;"]
    for i, step in enumerate(_STEPS):
        lines.append(f"set.ge.{ty}.{ty} s, $1, ${i + 2}; mov.b32 k, {_pair_const(step, f16)}; "
                     f"fma.rn.{ty} c, s, k, c;")
    lines += ["mov.b32 $0, c;", "}"]
    return "\n".join(lines)


def _windex_asm(f16: bool) -> str:
    """The count word ``base + i`` (what ``_PACK_ASM`` and ``_value_asm`` read) of a magnitude word ``v``:
    ``i = min(2v, v + 2, v / 2 + 4)`` (the inverse of ``max(i / 2, i - 2, 2i - 8)``) on ``base``: three
    packed fmas and two mins. The branch that is the minimum is an integer below ``2 base``, exact; the
    others round (``v`` has halves) to at least that minimum."""
    ty = "f16x2" if f16 else "bf16x2"
    base = 1024.0 if f16 else 128.0
    k = [_pair_const(c, f16) for c in (2.0, base, 1.0, base + 2.0, 0.5, base + 4.0)]
    return "\n".join([
        "{", ".reg .b32 a, b, d, k0, k1;",
        f"mov.b32 k0, {k[0]}; mov.b32 k1, {k[1]}; fma.rn.{ty} a, $1, k0, k1;",
        f"mov.b32 k0, {k[2]}; mov.b32 k1, {k[3]}; fma.rn.{ty} b, $1, k0, k1;",
        f"mov.b32 k0, {k[4]}; mov.b32 k1, {k[5]}; fma.rn.{ty} d, $1, k0, k1;",
        f"min.{ty} a, a, b; min.{ty} $0, a, d;", "}",
    ])


# The packed word of 8 codes from four counts ($1-$4) and the four input words ($5-$8) they came
# from: each half's sign goes to bit 3 of its count's low byte (bits 4-7 of that byte are zero), then
# the low bytes are gathered (prmt) so that code e sits at bits 4e..4e+3.
_PACK_ASM = "\n".join([
    "{", ".reg .b32 t0, t1, t2, t3, a, b, z, w;",
    "shr.u32 t0, $5, 12; and.b32 t0, t0, 0x00080008; or.b32 t0, t0, $1;",
    "shr.u32 t1, $6, 12; and.b32 t1, t1, 0x00080008; or.b32 t1, t1, $2;",
    "shr.u32 t2, $7, 12; and.b32 t2, t2, 0x00080008; or.b32 t2, t2, $3;",
    "shr.u32 t3, $8, 12; and.b32 t3, t3, 0x00080008; or.b32 t3, t3, $4;",
    "prmt.b32 a, t0, t1, 0x6420; prmt.b32 b, t2, t3, 0x6420;",
    "prmt.b32 z, a, b, 0x6420; prmt.b32 w, a, b, 0x7531;",
    "shl.b32 w, w, 4; or.b32 $0, z, w;", "}",
])


def _max8_asm(f16: bool) -> str:
    """Packed max of eight words of magnitudes, then of its two halves: ``$0`` = the 16-bit pattern of
    the largest |x| of the block (patterns of non-negative floats order like their values)."""
    ty = "f16x2" if f16 else "bf16x2"
    return "\n".join([
        "{", ".reg .b32 a, b, c, d;",
        f"max.{ty} a, $1, $2; max.{ty} b, $3, $4; max.{ty} c, $5, $6; max.{ty} d, $7, $8;",
        f"max.{ty} a, a, b; max.{ty} c, c, d; max.{ty} a, a, c;",
        "shr.u32 b, a, 16; and.b32 a, a, 0xFFFF; max.u32 $0, a, b;", "}",
    ])


def _scaled_asm(f16: bool) -> str:
    """``$0`` = ``v * scale`` per half (``$1`` the magnitudes, ``$2`` the scale in both halves; exact),
    with the sign of the input word ``$3``. bf16 multiplies by an ``fma`` with a -0 addend (exactly the
    product; ``mul.bf16x2`` is sm_90 PTX, the ``fma`` sm_80, and on sm_90 ptxas emits the same HMUL2)."""
    if f16:
        prod = "mul.rn.f16x2 a, $1, $2;"
    else:
        prod = "mov.b32 z, 0x80008000; fma.rn.bf16x2 a, $1, $2, z;"
    return f"{{ .reg .b32 a, z; {prod} and.b32 $0, $3, 0x80008000; or.b32 $0, $0, a; }}"


_COUNT_BF16 = tl.constexpr(_count_asm(False))


_COUNT_F16 = tl.constexpr(_count_asm(True))


_COUNT_INT_BF16 = tl.constexpr(_count_int_asm(False))


_COUNT_INT_F16 = tl.constexpr(_count_int_asm(True))


_VALUE_BF16 = tl.constexpr(_value_asm(False))


_VALUE_F16 = tl.constexpr(_value_asm(True))


_MAX8_BF16 = tl.constexpr(_max8_asm(False))


_MAX8_F16 = tl.constexpr(_max8_asm(True))


_SCALED_BF16 = tl.constexpr(_scaled_asm(False))


_SCALED_F16 = tl.constexpr(_scaled_asm(True))


_PACK = tl.constexpr(_PACK_ASM)


_WCOUNT_BF16 = tl.constexpr(_wcount_asm(False))


_WCOUNT_F16 = tl.constexpr(_wcount_asm(True))


_WINDEX_BF16 = tl.constexpr(_windex_asm(False))


_WINDEX_F16 = tl.constexpr(_windex_asm(True))


_C9 = tl.constexpr("=r,r,r,r,r,r,r,r,r")


@triton.jit
def _lanes(w, F16: tl.constexpr):
    """The two 16-bit floats of int32 words as fp32 (exact): (low half, high half)."""
    if F16:
        lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _from_lanes(lo, hi, F16: tl.constexpr):
    """fp32 values exact in the 16-bit format -> int32 words (inverse of ``_lanes``)."""
    if F16:
        blo = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        bhi = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16
    else:
        blo = (lo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
        bhi = hi.to(tl.int32, bitcast=True) & -65536
    return blo | bhi


@triton.jit
def _ge(a, t, F16: tl.constexpr):
    tv, _ = _lanes(t, F16)
    return (a >= tv).to(tl.int32)


@triton.jit
def _ptx8(a0, a1, a2, a3, a4, a5, a6, a7, PTX_BF16: tl.constexpr, PTX_F16: tl.constexpr, F16: tl.constexpr):
    """One int32 from eight, by the PTX block of the format."""
    if F16:
        out = tl.inline_asm_elementwise(PTX_F16, _C9, [a0, a1, a2, a3, a4, a5, a6, a7], tl.int32, True, 1)
    else:
        out = tl.inline_asm_elementwise(PTX_BF16, _C9, [a0, a1, a2, a3, a4, a5, a6, a7], tl.int32, True, 1)
    return out


@triton.jit
def _count(ax, t0, t1, t2, t3, t4, t5, t6, F16: tl.constexpr, ASM: tl.constexpr):
    if ASM == 2:  # integer compares (bf16 below sm_90)
        c = _ptx8(ax, t0, t1, t2, t3, t4, t5, t6, _COUNT_INT_BF16, _COUNT_INT_F16, F16)
    elif ASM:
        c = _ptx8(ax, t0, t1, t2, t3, t4, t5, t6, _COUNT_BF16, _COUNT_F16, F16)
    else:
        lo, hi = _lanes(ax, F16)
        base = 0x6400 if F16 else 0x4300
        clo = base + _ge(lo, t0, F16) + _ge(lo, t1, F16) + _ge(lo, t2, F16) + _ge(lo, t3, F16) \
            + _ge(lo, t4, F16) + _ge(lo, t5, F16) + _ge(lo, t6, F16)
        chi = base + _ge(hi, t0, F16) + _ge(hi, t1, F16) + _ge(hi, t2, F16) + _ge(hi, t3, F16) \
            + _ge(hi, t4, F16) + _ge(hi, t5, F16) + _ge(hi, t6, F16)
        c = clo | (chi << 16)
    return c


@triton.jit
def _magnitude(count, F16: tl.constexpr, ASM: tl.constexpr):
    """E2M1 magnitudes (16-bit floats in both halves) of a count word."""
    if ASM:
        if F16:
            v = tl.inline_asm_elementwise(_VALUE_F16, "=r,r", [count], tl.int32, True, 1)
        else:
            v = tl.inline_asm_elementwise(_VALUE_BF16, "=r,r", [count], tl.int32, True, 1)
    else:
        v = _from_lanes(e2m1_value(count & 7), e2m1_value((count >> 16) & 7), F16)
    return v


@triton.jit
def _asm1(PTX_BF16: tl.constexpr, PTX_F16: tl.constexpr, a, F16: tl.constexpr):
    """One int32 from one, by the PTX block of the format."""
    if F16:
        out = tl.inline_asm_elementwise(PTX_F16, "=r,r", [a], tl.int32, True, 1)
    else:
        out = tl.inline_asm_elementwise(PTX_BF16, "=r,r", [a], tl.int32, True, 1)
    return out


@triton.jit
def _wcount(ax, t0, t1, t2, t3, t4, t5, t6, F16: tl.constexpr, ASM: tl.constexpr):
    """Magnitude word (the E2M1 magnitude ``v`` per half) of ``ax`` against the thresholds ``t0..t6``."""
    if ASM == 1:
        w = _ptx8(ax, t0, t1, t2, t3, t4, t5, t6, _WCOUNT_BF16, _WCOUNT_F16, F16)
    else:  # the integer-compare count (bf16 below sm_90) or the Triton twin, then its magnitudes
        w = _magnitude(_count(ax, t0, t1, t2, t3, t4, t5, t6, F16, ASM), F16, ASM)
    return w


@triton.jit
def _windex(w, F16: tl.constexpr, ASM: tl.constexpr):
    """Count word (``base + i`` per half) of a magnitude word."""
    if ASM:
        c = _asm1(_WINDEX_BF16, _WINDEX_F16, w, F16)
    else:
        base = 1024 if F16 else 128
        lo, hi = _lanes(w, F16)
        ilo = tl.minimum(tl.minimum(lo * 2.0, lo + 2.0), lo * 0.5 + 4.0).to(tl.int32)
        ihi = tl.minimum(tl.minimum(hi * 2.0, hi + 2.0), hi * 0.5 + 4.0).to(tl.int32)
        c = (base + ilo) | ((base + ihi) << 16)
    return c


@triton.jit
def _pack4(c0, c1, c2, c3, w0, w1, w2, w3, ASM: tl.constexpr):
    if ASM:
        word = tl.inline_asm_elementwise(_PACK, _C9, [c0, c1, c2, c3, w0, w1, w2, w3], tl.int32, True, 1)
    else:
        word = _pair_byte(c0, w0) | (_pair_byte(c1, w1) << 8) | (_pair_byte(c2, w2) << 16) | (_pair_byte(c3, w3) << 24)
    return word


@triton.jit
def _pair_byte(c, w):
    lo = (c & 7) | ((w >> 12) & 8)
    hi = ((c >> 16) & 7) | ((w >> 28) & 8)
    return lo | (hi << 4)


@triton.jit
def _max8(a0, a1, a2, a3, a4, a5, a6, a7, F16: tl.constexpr, ASM: tl.constexpr):
    if ASM:
        top = _ptx8(a0, a1, a2, a3, a4, a5, a6, a7, _MAX8_BF16, _MAX8_F16, F16)
    else:
        m = tl.maximum(tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3)), tl.maximum(tl.maximum(a4, a5), tl.maximum(a6, a7)))
        m2 = tl.maximum(tl.maximum(a0 & 0xFFFF, a1 & 0xFFFF), tl.maximum(a2 & 0xFFFF, a3 & 0xFFFF))
        m2 = tl.maximum(m2, tl.maximum(tl.maximum(a4 & 0xFFFF, a5 & 0xFFFF), tl.maximum(a6 & 0xFFFF, a7 & 0xFFFF)))
        top = tl.maximum(m >> 16, m2)
    return top


@triton.jit
def _scaled(mag, scale2, w, F16: tl.constexpr, ASM: tl.constexpr):
    if ASM:
        if F16:
            s = tl.inline_asm_elementwise(_SCALED_F16, "=r,r,r,r", [mag, scale2, w], tl.int32, True, 1)
        else:
            s = tl.inline_asm_elementwise(_SCALED_BF16, "=r,r,r,r", [mag, scale2, w], tl.int32, True, 1)
    else:
        mlo, mhi = _lanes(mag, F16)
        slo, _ = _lanes(scale2, F16)
        s = _from_lanes(mlo * slo, mhi * slo, F16) | (w & -2147450880)  # 0x80008000
    return s


@triton.jit
def _split4(t):
    """[BM, NB, 4] held by one thread -> its four [BM, NB] slices."""
    a, b = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], 2, 2)))  # a: 0, 2; b: 1, 3
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _bf16_pair_above(t64):
    """The smallest bf16 above ``t64`` in both halves of a word, for an fp64 ``t64`` that is no bf16
    value and either at least 2^-126 (the smallest normal bf16) or +inf: the bf16 truncation of
    ``t64`` (the top 16 bits of its fp64 pattern, re-biased: ``(hi >> 13) - (896 << 7)``) plus one,
    +inf from the largest finite bf16 on."""
    hi = (t64.to(tl.int64, bitcast=True) >> 32).to(tl.int32)
    h = tl.minimum((hi >> 13) - 114687, 0x7F80)
    return h * 65537


@triton.jit
def _f16_pair_above(t64):
    """The smallest fp16 above ``t64`` in both halves of a word, for an fp64 ``t64 > 0`` that is no
    fp16 value (or +inf): from 2^-14 on the fp16 truncation of ``t64`` (its fp64 pattern's high word,
    re-biased: ``(hi >> 10) - (1008 << 10)``) plus one, +inf from the largest finite fp16 on; below,
    the subnormal ``floor(t64 * 2^24) + 1`` (times 2^-24; ``t64 * 2^24`` is exact and no integer)."""
    hi = (t64.to(tl.int64, bitcast=True) >> 32).to(tl.int32)
    normal = tl.minimum((hi >> 10) - 1032191, 0x7C00)
    h = tl.where(t64 < 6.103515625e-05, (t64 * 16777216.0).to(tl.int32) + 1, normal)
    return h * 65537


@triton.jit
def _pair_above(t64, F16: tl.constexpr):
    if F16:
        pair = _f16_pair_above(t64)
    else:
        pair = _bf16_pair_above(t64)
    return pair


@triton.jit
def _row(table_ptr, code, scale, global_enc, F16: tl.constexpr, TABLE: tl.constexpr, FAST: tl.constexpr,
         WORD_MAJOR: tl.constexpr):
    """The seven 16-bit thresholds (in both halves of a word) of each block's scale code (E4M3 bits
    ``code``, value ``scale``): the program's table row (``TABLE``), or the same values computed
    in registers. ``FAST`` (fp16, or bf16 under a global scale below 2^112, so that every bf16
    threshold of a non-zero scale is at least 2^-126): the threshold ``t+- * step`` is exact in fp64
    (25 + 24 significant bits) and never a 16-bit value (its significand is a product of odd numbers of
    25 and more bits), so the 16-bit value at or above it is read off the fp64 pattern. Otherwise the
    table's own arithmetic (fp32 thresholds by directed rounding, then rounded up)."""
    if TABLE:
        return (tl.load(_table_at(table_ptr, code, 0, WORD_MAJOR)), tl.load(_table_at(table_ptr, code, 1, WORD_MAJOR)),
                tl.load(_table_at(table_ptr, code, 2, WORD_MAJOR)), tl.load(_table_at(table_ptr, code, 3, WORD_MAJOR)),
                tl.load(_table_at(table_ptr, code, 4, WORD_MAJOR)), tl.load(_table_at(table_ptr, code, 5, WORD_MAJOR)),
                tl.load(_table_at(table_ptr, code, 6, WORD_MAJOR)))
    elif FAST:
        step = tl.math.div_rn(scale, global_enc)
        s = tl.where(step > 0.0, step.to(tl.float64), float("inf"))  # a zero scale: +inf thresholds
        # the constants of e2m1_thresholds: midpoints displaced by half an fp32 ulp (ties to even)
        return (_pair_above(s * 0.250000014901161193847656250, F16),
                _pair_above(s * 0.749999970197677612304687500, F16),
                _pair_above(s * 1.250000059604644775390625000, F16),
                _pair_above(s * 1.749999940395355224609375000, F16),
                _pair_above(s * 2.500000119209289550781250000, F16),
                _pair_above(s * 3.499999880790710449218750000, F16),
                _pair_above(s * 5.000000238418579101562500000, F16))
    else:
        t0, t1, t2, t3, t4, t5, t6 = e2m1_thresholds(tl.math.div_rn(scale, global_enc))
        return (_pair16(t0, F16), _pair16(t1, F16), _pair16(t2, F16), _pair16(t3, F16), _pair16(t4, F16),
                _pair16(t5, F16), _pair16(t6, F16))


@triton.jit
def _row_step(table_ptr, code, scale, global_enc, TABLE: tl.constexpr, WORD_MAJOR: tl.constexpr):
    """The fp32 step ``scale / global_enc`` of each block (table word 8, or computed)."""
    if TABLE:
        step = tl.load(_table_at(table_ptr, code, 8, WORD_MAJOR)).to(tl.float32, bitcast=True)
    else:
        step = tl.math.div_rn(scale, global_enc)
    return step


@triton.jit
def _row_scale(table_ptr, code, scale, F16: tl.constexpr, TABLE: tl.constexpr, WORD_MAJOR: tl.constexpr):
    """Each block's scale in both 16-bit halves of a word (table word 7, or converted; exact)."""
    if TABLE:
        s2 = tl.load(_table_at(table_ptr, code, 7, WORD_MAJOR))
    else:
        s2 = _pair16(scale, F16)
    return s2


@triton.jit
def _block_counts(a0, a1, a2, a3, a4, a5, a6, a7, table_ptr, code, scale, global_enc, F16: tl.constexpr,
                  ASM: tl.constexpr, TABLE: tl.constexpr, FAST: tl.constexpr, WORD_MAJOR: tl.constexpr):
    """The counts of a block's eight words against its code's thresholds."""
    t0, t1, t2, t3, t4, t5, t6 = _row(table_ptr, code, scale, global_enc, F16, TABLE, FAST, WORD_MAJOR)
    return (_count(a0, t0, t1, t2, t3, t4, t5, t6, F16, ASM), _count(a1, t0, t1, t2, t3, t4, t5, t6, F16, ASM),
            _count(a2, t0, t1, t2, t3, t4, t5, t6, F16, ASM), _count(a3, t0, t1, t2, t3, t4, t5, t6, F16, ASM),
            _count(a4, t0, t1, t2, t3, t4, t5, t6, F16, ASM), _count(a5, t0, t1, t2, t3, t4, t5, t6, F16, ASM),
            _count(a6, t0, t1, t2, t3, t4, t5, t6, F16, ASM), _count(a7, t0, t1, t2, t3, t4, t5, t6, F16, ASM))


@triton.jit
def _block_wcounts(a0, a1, a2, a3, a4, a5, a6, a7, table_ptr, code, scale, global_enc, F16: tl.constexpr,
                   ASM: tl.constexpr, TABLE: tl.constexpr, FAST: tl.constexpr, WORD_MAJOR: tl.constexpr):
    """The magnitude words of a block's eight words under its code's thresholds."""
    t0, t1, t2, t3, t4, t5, t6 = _row(table_ptr, code, scale, global_enc, F16, TABLE, FAST, WORD_MAJOR)
    return (_wcount(a0, t0, t1, t2, t3, t4, t5, t6, F16, ASM), _wcount(a1, t0, t1, t2, t3, t4, t5, t6, F16, ASM),
            _wcount(a2, t0, t1, t2, t3, t4, t5, t6, F16, ASM), _wcount(a3, t0, t1, t2, t3, t4, t5, t6, F16, ASM),
            _wcount(a4, t0, t1, t2, t3, t4, t5, t6, F16, ASM), _wcount(a5, t0, t1, t2, t3, t4, t5, t6, F16, ASM),
            _wcount(a6, t0, t1, t2, t3, t4, t5, t6, F16, ASM), _wcount(a7, t0, t1, t2, t3, t4, t5, t6, F16, ASM))


@triton.jit
def _error_step(acc, d, RULE: tl.constexpr):
    """One element's error ``d`` into a running error: ``fma(d, d, acc)`` / ``acc + |d|`` / ``max(acc, |d|)``."""
    if RULE == 1:
        return tl.fma(d, d, acc)
    elif RULE == 2:
        return acc + tl.abs(d)
    else:
        return tl.maximum(acc, tl.abs(d))


@triton.jit
def _word_error(acc_lo, acc_hi, w, ax, step, F16: tl.constexpr, RULE: tl.constexpr):
    """Both halves of a magnitude word ``w`` and its ``|x|`` word into the running errors: ``v * step`` is
    the reference's ``x_hat`` (one fp32 product), minus ``|x|`` its ``x_hat - x`` up to sign."""
    wlo, whi = _lanes(w, F16)
    alo, ahi = _lanes(ax, F16)
    return _error_step(acc_lo, wlo * step - alo, RULE), _error_step(acc_hi, whi * step - ahi, RULE)


@triton.jit
def _block_error(w0, w1, w2, w3, w4, w5, w6, w7, a0, a1, a2, a3, a4, a5, a6, a7, step, F16: tl.constexpr,
                 RULE: tl.constexpr):
    """A candidate's block error from its magnitude words: two running fp32 errors (the low and the
    high halves, 8 elements each) combined at the end. The per-element ``x_hat - x`` is the
    reference's; only the order of the sum (and the squares' rounding, one fma each) differ from
    ``torch.sum``'s, so the 4/6 choice differs from the reference only at near-ties."""
    lo = step * 0.0
    hi = lo
    lo, hi = _word_error(lo, hi, w0, a0, step, F16, RULE)
    lo, hi = _word_error(lo, hi, w1, a1, step, F16, RULE)
    lo, hi = _word_error(lo, hi, w2, a2, step, F16, RULE)
    lo, hi = _word_error(lo, hi, w3, a3, step, F16, RULE)
    lo, hi = _word_error(lo, hi, w4, a4, step, F16, RULE)
    lo, hi = _word_error(lo, hi, w5, a5, step, F16, RULE)
    lo, hi = _word_error(lo, hi, w6, a6, step, F16, RULE)
    lo, hi = _word_error(lo, hi, w7, a7, step, F16, RULE)
    return _combine(lo, hi, RULE)


@triton.jit
def _join4(t0, t1, t2, t3):
    """Four [BM, NB] slices -> [BM, NB, 4] held by one thread (inverse of ``_split4``)."""
    return tl.reshape(tl.join(tl.join(t0, t2), tl.join(t1, t3)), (t0.shape[0], t0.shape[1], 4))


@triton.jit
def _tile_offsets(tm, tk, M, nblocks, BLOCK_M: tl.constexpr, BLOCKS_K: tl.constexpr):
    """Rows, blocks and mask of the tile at (tile row ``tm``, tile column ``tk``); a tile past the
    last one has every row past M, so it is masked off whole."""
    rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = tk * BLOCKS_K + tl.arange(0, BLOCKS_K)
    mask = (rows < M)[:, None] & (blocks < nblocks)[None, :]
    return rows.to(tl.int64), blocks, mask


@triton.jit
def _load_tile(x_ptr, rows64, blocks, mask, stride_xw):
    offs = rows64[:, None, None] * stride_xw + (blocks * 8)[None, :, None] + tl.arange(0, 4)[None, None, :]
    wa = tl.load(x_ptr + offs, mask=mask[:, :, None], other=0)
    wb = tl.load(x_ptr + offs + 4, mask=mask[:, :, None], other=0)
    return wa, wb


@triton.jit
def _quantize16_tile(
    wa, wb, rows64, blocks, mask2, table_ptr, global_enc, packed_ptr, scale_ptr, chose_ptr, scaled_ptr,
    K, stride_sw,
    F16: tl.constexpr, FOUR_SIX: tl.constexpr, EMIT_PACKED: tl.constexpr, EMIT_SCALED: tl.constexpr,
    ASM: tl.constexpr, TABLE: tl.constexpr, FAST: tl.constexpr, WORD_MAJOR: tl.constexpr,
):
    w0, w1, w2, w3 = _split4(wa)
    w4, w5, w6, w7 = _split4(wb)
    a0 = w0 & 0x7FFF7FFF
    a1 = w1 & 0x7FFF7FFF
    a2 = w2 & 0x7FFF7FFF
    a3 = w3 & 0x7FFF7FFF
    a4 = w4 & 0x7FFF7FFF
    a5 = w5 & 0x7FFF7FFF
    a6 = w6 & 0x7FFF7FFF
    a7 = w7 & 0x7FFF7FFF
    mbits = _max8(a0, a1, a2, a3, a4, a5, a6, a7, F16, ASM)
    if F16:
        bmax = mbits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        bmax = (mbits << 16).to(tl.float32, bitcast=True)
    scale, code = e4m3_block_scale(bmax, global_enc, 6.0)
    chose_four = code < 0  # all False, in the per-block layout
    if FOUR_SIX == 0:
        c0, c1, c2, c3, c4, c5, c6, c7 = _block_counts(a0, a1, a2, a3, a4, a5, a6, a7, table_ptr, code, scale,
                                                       global_enc, F16, ASM, TABLE, FAST, WORD_MAJOR)
    else:
        # Both candidates as magnitude words (the counts' compares, their sums weighted by E2M1 steps: no
        # separate magnitudes), each error one fp32 product, difference and accumulate an element, then the index
        # words of the kept scale only. bmax / 4 is a correctly rounded product (div_rn(bmax, 4) rounds
        # the same real number).
        scale4, code4 = e4m3_rne(tl.minimum(bmax * 0.25 * global_enc, 448.0))
        c0, c1, c2, c3, c4, c5, c6, c7 = _block_wcounts(a0, a1, a2, a3, a4, a5, a6, a7, table_ptr, code, scale,
                                                        global_enc, F16, ASM, TABLE, FAST, WORD_MAJOR)
        d0, d1, d2, d3, d4, d5, d6, d7 = _block_wcounts(a0, a1, a2, a3, a4, a5, a6, a7, table_ptr, code4, scale4,
                                                        global_enc, F16, ASM, TABLE, FAST, WORD_MAJOR)
        step6 = _row_step(table_ptr, code, scale, global_enc, TABLE, WORD_MAJOR)
        step4 = _row_step(table_ptr, code4, scale4, global_enc, TABLE, WORD_MAJOR)
        err6 = _block_error(c0, c1, c2, c3, c4, c5, c6, c7, a0, a1, a2, a3, a4, a5, a6, a7, step6, F16, FOUR_SIX)
        err4 = _block_error(d0, d1, d2, d3, d4, d5, d6, d7, a0, a1, a2, a3, a4, a5, a6, a7, step4, F16, FOUR_SIX)
        chose_four = err4 < err6  # ties keep the 6-scale
        c0 = tl.where(chose_four, d0, c0)
        c1 = tl.where(chose_four, d1, c1)
        c2 = tl.where(chose_four, d2, c2)
        c3 = tl.where(chose_four, d3, c3)
        c4 = tl.where(chose_four, d4, c4)
        c5 = tl.where(chose_four, d5, c5)
        c6 = tl.where(chose_four, d6, c6)
        c7 = tl.where(chose_four, d7, c7)
        code = tl.where(chose_four, code4, code)
        scale = tl.where(chose_four, scale4, scale)

    nblocks = K // 16
    sofs = rows64[:, None] * nblocks + blocks[None, :]
    if EMIT_PACKED:
        if FOUR_SIX == 0:
            words = tl.join(_pack4(c0, c1, c2, c3, w0, w1, w2, w3, ASM), _pack4(c4, c5, c6, c7, w4, w5, w6, w7, ASM))
        else:  # index words from the kept magnitude words
            words = tl.join(_pack4(_windex(c0, F16, ASM), _windex(c1, F16, ASM), _windex(c2, F16, ASM),
                                   _windex(c3, F16, ASM), w0, w1, w2, w3, ASM),
                            _pack4(_windex(c4, F16, ASM), _windex(c5, F16, ASM), _windex(c6, F16, ASM),
                                   _windex(c7, F16, ASM), w4, w5, w6, w7, ASM))
        wofs = (rows64[:, None] * (K // 8) + blocks[None, :] * 2)[:, :, None] + tl.arange(0, 2)[None, None, :]
        tl.store(packed_ptr + wofs, words, mask=mask2[:, :, None])
        tl.store(scale_ptr + sofs, code.to(tl.uint8), mask=mask2)
        if FOUR_SIX != 0:
            tl.store(chose_ptr + sofs, chose_four.to(tl.int8), mask=mask2)
    if EMIT_SCALED:
        s2 = _row_scale(table_ptr, code, scale, F16, TABLE, WORD_MAJOR)
        q = (rows64[:, None] * stride_sw + blocks[None, :] * 8)[:, :, None] + tl.arange(0, 4)[None, None, :]
        if FOUR_SIX == 0:
            qa = _join4(_scaled(_magnitude(c0, F16, ASM), s2, w0, F16, ASM), _scaled(_magnitude(c1, F16, ASM), s2, w1, F16, ASM),
                        _scaled(_magnitude(c2, F16, ASM), s2, w2, F16, ASM), _scaled(_magnitude(c3, F16, ASM), s2, w3, F16, ASM))
            qb = _join4(_scaled(_magnitude(c4, F16, ASM), s2, w4, F16, ASM), _scaled(_magnitude(c5, F16, ASM), s2, w5, F16, ASM),
                        _scaled(_magnitude(c6, F16, ASM), s2, w6, F16, ASM), _scaled(_magnitude(c7, F16, ASM), s2, w7, F16, ASM))
        else:  # the kept magnitude words
            qa = _join4(_scaled(c0, s2, w0, F16, ASM), _scaled(c1, s2, w1, F16, ASM), _scaled(c2, s2, w2, F16, ASM),
                        _scaled(c3, s2, w3, F16, ASM))
            qb = _join4(_scaled(c4, s2, w4, F16, ASM), _scaled(c5, s2, w5, F16, ASM), _scaled(c6, s2, w6, F16, ASM),
                        _scaled(c7, s2, w7, F16, ASM))
        tl.store(scaled_ptr + q, qa, mask=mask2[:, :, None])
        tl.store(scaled_ptr + q + 4, qb, mask=mask2[:, :, None])


@triton.jit
def _quantize16_kernel(
    x_ptr, amax_ptr, table_ptr, enc_ptr, packed_ptr, scale_ptr, chose_ptr, scaled_ptr,
    M, K, stride_xw, stride_sw, n_tiles, n_ktiles,
    F16: tl.constexpr, FOUR_SIX: tl.constexpr, EMIT_PACKED: tl.constexpr, EMIT_SCALED: tl.constexpr,
    ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCKS_K: tl.constexpr, TABLE: tl.constexpr,
    WORD_MAJOR: tl.constexpr, TRIGGER: tl.constexpr = False,
):
    if TRIGGER:  # (_common.w4a4_pdl) the GEMM after this launch, its programmatic dependent, may start now
        _gdc_launch_dependents()
    # Persistent: program p takes tiles p, p + P, ... of BLOCK_M rows x BLOCKS_K blocks; a thread
    # holds whole blocks as 8 int32 words (two 16-byte loads), each word two 16-bit floats. The
    # next tile's words are loaded before this tile's math, so memory and math overlap.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    global_enc = global_enc_from_amax(tl.load(amax_ptr), FOUR_SIX)
    if pid == 0:
        tl.store(enc_ptr, global_enc)
    nblocks = K // 16
    # tile t = tm * n_ktiles + tk; stepping t by nprog steps (tm, tk) without a division
    tm = pid // n_ktiles
    tk = pid % n_ktiles
    dm = nprog // n_ktiles
    dk = nprog % n_ktiles
    rows64, blocks, mask2 = _tile_offsets(tm, tk, M, nblocks, BLOCK_M, BLOCKS_K)
    wa, wb = _load_tile(x_ptr, rows64, blocks, mask2, stride_xw)
    if TABLE:
        table_ptr += pid * (TABLE_ROWS * TABLE_WORDS)
        _write_table(table_ptr, global_enc, F16, WORD_MAJOR)
    for t in range(pid, n_tiles, nprog):
        tk += dk
        wrap = tk >= n_ktiles
        tm += dm + wrap.to(tl.int32)
        tk = tl.where(wrap, tk - n_ktiles, tk)
        nrows64, nblk, nmask = _tile_offsets(tm, tk, M, nblocks, BLOCK_M, BLOCKS_K)
        na, nb = _load_tile(x_ptr, nrows64, nblk, nmask, stride_xw)
        if TABLE or F16:  # (fp16 reads every threshold off the fp64 product, subnormals included)
            _quantize16_tile(wa, wb, rows64, blocks, mask2, table_ptr, global_enc, packed_ptr, scale_ptr, chose_ptr,
                             scaled_ptr, K, stride_sw, F16, FOUR_SIX, EMIT_PACKED, EMIT_SCALED, ASM, TABLE, F16,
                             WORD_MAJOR)
        elif global_enc < 5.192296858534828e33:  # 2^112: every bf16 threshold is normal (see _row)
            _quantize16_tile(wa, wb, rows64, blocks, mask2, table_ptr, global_enc, packed_ptr, scale_ptr, chose_ptr,
                             scaled_ptr, K, stride_sw, F16, FOUR_SIX, EMIT_PACKED, EMIT_SCALED, ASM, TABLE, True,
                             WORD_MAJOR)
        else:
            _quantize16_tile(wa, wb, rows64, blocks, mask2, table_ptr, global_enc, packed_ptr, scale_ptr, chose_ptr,
                             scaled_ptr, K, stride_sw, F16, FOUR_SIX, EMIT_PACKED, EMIT_SCALED, ASM, TABLE, False,
                             WORD_MAJOR)
        wa = na
        wb = nb
        rows64 = nrows64
        blocks = nblk
        mask2 = nmask
