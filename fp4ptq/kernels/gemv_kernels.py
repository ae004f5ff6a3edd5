"""The GEMV family's Triton kernels (the ``@triton.jit`` bodies and their helpers); which one runs, with
which config, and its launch: ``gemv.py`` (its docstring describes the kernels and their numerics).
Kept apart so that the launch rules read without the register-level code, and the code without the rules.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    BF16_MAG,
    FP16_MAG,
    _gdc_launch_dependents,
    _gdc_wait,
    _halves,
    _output_factor,
    _output_scale,
    _pair,
    _pair_mul,
    scale_fp32,
)


@triton.jit
def _load_blocks(w_ptr, s_ptr, n, kb, b0, ab, EVEN_K: tl.constexpr):
    """Blocks ``b0 + ab`` of rows ``n``: int64 codes (16 each) and scale bytes,
    zeros past K. The scale index goes through a select so that the byte load
    does not pick the tile's layout (the 16-byte code loads should)."""
    bidx = b0 + ab
    b_ok = bidx < kb
    sidx = tl.where(b_ok, bidx, 0)
    return _codes_and_scales(w_ptr + n[:, None] * kb + bidx[None, :], s_ptr + n[:, None] * kb + sidx[None, :],
                             b_ok[None, :], EVEN_K)


@triton.jit
def _load_tile(w_ptr, s_ptr, t, ROWS: tl.constexpr, ar, N, kb, ab, EVEN_K: tl.constexpr, KB_C: tl.constexpr):
    """Blocks ``ab`` of row tile ``t`` (``[ROWS, blocks]``; rows past N and tiles past the last read row 0).
    With ``KB_C`` (K/16 a compile-time constant, N a multiple of ROWS) the tile index is clamped to the
    last tile instead, so that a thread's rows sit at constant distances from one address (immediate load
    offsets: no address arithmetic a row)."""
    if KB_C > 0:
        b_ok = ab < KB_C
        sidx = tl.where(b_ok, ab, 0)  # the scale loads must not pick the tile's layout (see _load_blocks)
        base = _tile_offsets_t(t, ROWS, ar, N, kb, KB_C)
        rows = (ar * KB_C)[:, None]
        return _codes_and_scales(w_ptr + (base + ab)[None, :] + rows, s_ptr + (base + sidx)[None, :] + rows,
                                 b_ok[None, :], EVEN_K)
    else:
        return _load_blocks(w_ptr, s_ptr, _tile_rows(t, ROWS, ar, N), kb, 0, ab, EVEN_K)


@triton.jit
def _codes_and_scales(w_ptrs, s_ptrs, ok, EVEN_K: tl.constexpr):
    """The code words and scale bytes at ``w_ptrs`` / ``s_ptrs``; where ``ok`` is false
    (past K) zeros, unless EVEN_K says every block is inside."""
    if EVEN_K:
        return tl.load(w_ptrs), tl.load(s_ptrs)
    else:
        return tl.load(w_ptrs, mask=ok, other=0), tl.load(s_ptrs, mask=ok, other=0)


@triton.jit
def _gemv_blocks_kernel(
    x_ptr, w_ptr, s_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, HAS_XENC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, EVEN_K: tl.constexpr, ALIGNED: tl.constexpr,
):
    # GEMV v4. Program: BLOCK_N weight rows x all K for one activation row,
    # BLOCK_B blocks (16 codes = one int64, and its scale byte) a step. The
    # tile is wide along K (warps split K, rows repeat in each thread's
    # registers), so each thread has BLOCK_N 16-byte weight loads in flight
    # and reuses every x value it loads for BLOCK_N rows.
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n = tl.where(n_ok, n, 0).to(tl.int64)
    kb = K // 16
    if ALIGNED:  # K % 256 == 0: rows start on 16-byte (codes) and 16-byte (scales) boundaries
        kb = tl.multiple_of(kb, 16)
    ab = tl.arange(0, BLOCK_B)
    acc = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
    xrow = x_ptr + row * stride_xm
    for b0 in range(0, kb, BLOCK_B):
        blk, sb = _load_blocks(w_ptr, s_ptr, n, kb, b0, ab, EVEN_K)
        bidx = tl.where(b0 + ab < kb, b0 + ab, 0)  # x of a masked block is read in bounds, times code 0
        part = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
        for h in tl.static_range(2):  # the block's two words: codes 0..7, 8..15
            w = (blk >> (32 * h)).to(tl.int32)
            xs = xrow + bidx * 16 + 8 * h
            for i in tl.static_range(4):
                lo, hi = _halves(_pair(w, i, 9, FP16_MAG), tl.float16)  # codes i, i+4 as v * 2^-14
                part += lo.to(tl.float32) * tl.load(xs + i).to(tl.float32)[None, :]
                part += hi.to(tl.float32) * tl.load(xs + i + 4).to(tl.float32)[None, :]
        acc += part * scale_fp32(sb)
    y = tl.sum(acc, axis=1)  # [BN]
    y = _output_scale(y, wenc_ptr, xenc_ptr, 4194304.0, HAS_XENC)  # 2^14 (codes) * 2^8 (scales)
    if HAS_BIAS:
        y += tl.load(bias_ptr + n).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _bf16x2_fma(a, b, c, EMULATE: tl.constexpr):
    """``a * b + c`` on int32 registers holding two bf16 each (one
    ``fma.rn.bf16x2``: one rounding to bf16 per lane). ``EMULATE`` (the Triton
    interpreter, which runs no PTX): the same in fp32, then rounded to bf16."""
    if EMULATE:
        lo = _bf16_lane(a, 0) * _bf16_lane(b, 0) + _bf16_lane(c, 0)
        hi = _bf16_lane(a, 1) * _bf16_lane(b, 1) + _bf16_lane(c, 1)
        return (_bf16_bits(lo) & 0xFFFF) | (_bf16_bits(hi) << 16)
    else:
        return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _bf16_lane(r, LANE: tl.constexpr):
    """fp32 value of the low (0) or high (1) bf16 of int32 ``r`` (exact)."""
    if LANE == 0:
        return (r << 16).to(tl.float32, bitcast=True)
    else:
        return (r & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(v):
    """fp32 -> bf16 bit pattern (round half to even) in the low 16 bits of an int32."""
    bits = v.to(tl.int32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def _f16x2_fma(a, b, c, EMULATE: tl.constexpr):
    """``a * b + c`` on int32 registers holding two fp16 each (one ``fma.rn.f16x2``: one
    rounding to fp16 per lane, subnormals kept). ``EMULATE``: the same in fp32, then
    rounded to fp16."""
    if EMULATE:
        lo = _f16_lane(a, 0) * _f16_lane(b, 0) + _f16_lane(c, 0)
        hi = _f16_lane(a, 1) * _f16_lane(b, 1) + _f16_lane(c, 1)
        return _f16_bits(lo) | (_f16_bits(hi) << 16)
    else:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _f16_lane(r, LANE: tl.constexpr):
    """fp32 value of the low (0) or high (1) fp16 of int32 ``r`` (exact)."""
    if LANE == 0:
        return r.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return (r >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_bits(v):
    """fp32 -> fp16 bit pattern (round half to even) in the low 16 bits of an int32."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _scaled_block_sums(part, sb, F16: tl.constexpr = False):
    """fp32 ``(lane 0 + lane 1) * scale * 2^-8`` of each block's two bf16 (``F16``: fp16)
    partial sums (``part``, one int32 a block) and its E4M3 scale byte."""
    if F16:
        return (_f16_lane(part, 0) + _f16_lane(part, 1)) * scale_fp32(sb)
    return (_bf16_lane(part, 0) + _bf16_lane(part, 1)) * scale_fp32(sb)


@triton.jit
def _x_pair(x_lo, x_hi):
    """Two fp32 activations (bf16 values) -> one int32 holding bf16(x_lo * 2^64)
    (low half) and bf16(x_hi * 2^64) (high half): exact below 2^64."""
    xl = _bf16_bits(x_lo * 18446744073709551616.0) & 0xFFFF
    xh = _bf16_bits(x_hi * 18446744073709551616.0) << 16
    return xl | xh


@triton.jit
def _word_pair(lo, hi, i: tl.constexpr):
    """bf16x2 x register of lane ``i`` (0..3) of two int64 words of 4 bf16 each:
    ``_x_pair(lo[i], hi[i])``."""
    return _x_pair(_bf16_lane(((lo >> (16 * i)) & 0xFFFF).to(tl.int32), 0),
                   _bf16_lane(((hi >> (16 * i)) & 0xFFFF).to(tl.int32), 0))


@triton.jit
def _x_words(xw, bidx, b_ok, h: tl.constexpr):
    """Half ``h`` of blocks ``bidx`` of the activation row as its two int64 words:
    elements 0..3 of the half and 4..7 (zeros where ``b_ok`` is false)."""
    lo = tl.load(xw + bidx * 4 + 2 * h, mask=b_ok, other=0)
    hi = tl.load(xw + bidx * 4 + 2 * h + 1, mask=b_ok, other=0)
    return lo, hi


@triton.jit
def _x_pairs_from_words(xw, bidx, b_ok, h: tl.constexpr):
    """bf16x2 x registers of half ``h`` of blocks ``bidx``: four ``[KBP]`` int32,
    pair i = (x[16b + 8h + i], x[16b + 8h + i + 4]) * 2^64, from the block's
    int64 words 2h (elements 0..3 of the half) and 2h + 1 (elements 4..7)."""
    lo, hi = _x_words(xw, bidx, b_ok, h)
    return _word_pair(lo, hi, 0), _word_pair(lo, hi, 1), _word_pair(lo, hi, 2), _word_pair(lo, hi, 3)


# the two pairings of _x_pair_prmt; 0x5F80 is bf16 2^64. The product is an fma with a -0 addend (x * 2^64 + -0 is
# x * 2^64, signed zeros included): PTX has bf16x2 fma from sm_80 but bf16x2 mul only from sm_90, and on sm_90
# ptxas emits the same HMUL2 for both (the gemv7 build's SASS is unchanged)
_X_PAIR_LOW = tl.constexpr("{ .reg .b32 t, c, z; prmt.b32 t, $1, $2, 0x5410; mov.b32 c, 0x5F805F80; "
                           "mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, t, c, z; }")


_X_PAIR_HIGH = tl.constexpr("{ .reg .b32 t, c, z; prmt.b32 t, $1, $2, 0x7632; mov.b32 c, 0x5F805F80; "
                            "mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, t, c, z; }")


@triton.jit
def _x_pair_prmt(a, b, SEL: tl.constexpr, EMULATE: tl.constexpr):
    """``_x_pair`` of the 16-bit halves that ``prmt.b32 a, b, SEL`` picks (0x5410: both low,
    0x7632: both high) of two int32 of two bf16 each, in two instructions: the byte
    permute, then times 2^64 (``fma.rn.bf16x2`` with a -0 addend; exact below 2^64, zeros
    and subnormals included; inf above, as ``_x_pair``)."""
    if EMULATE:
        if SEL == 0x5410:
            return _x_pair(_bf16_lane(a, 0), _bf16_lane(b, 0))
        else:
            return _x_pair(_bf16_lane(a, 1), _bf16_lane(b, 1))
    elif SEL == 0x5410:
        return tl.inline_asm_elementwise(_X_PAIR_LOW, "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_X_PAIR_HIGH, "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _x_pairs_stream(xw, bidx, b_ok, h: tl.constexpr, EMULATE: tl.constexpr):
    """``_x_pairs_from_words`` in two instructions a pair (``_x_pair_prmt``), for a GEMV
    that re-reads x every step."""
    lo, hi = _x_words(xw, bidx, b_ok, h)
    lo0, lo1 = lo.to(tl.int32), (lo >> 32).to(tl.int32)
    hi0, hi1 = hi.to(tl.int32), (hi >> 32).to(tl.int32)
    return (_x_pair_prmt(lo0, hi0, 0x5410, EMULATE), _x_pair_prmt(lo0, hi0, 0x7632, EMULATE),
            _x_pair_prmt(lo1, hi1, 0x5410, EMULATE), _x_pair_prmt(lo1, hi1, 0x7632, EMULATE))


# fp16 activations (gemv6 / gemv7 with F16): the products run in fp16x2 (``fma.rn.f16x2``: 2^-11
# relative a rounding, against bf16's 2^-8), the codes decoded as v * 2^-14 (``_pair(w, i, 9,
# FP16_MAG)``: the multiply decode has no fp16 twin, the fields would overlap), and each block's x
# scaled by 2^e so that its largest |x| lands in [2^15, 2^16) (e at most 15, so blocks whose largest
# |x| is under 1 stay below): exact, and no block sum can overflow (8 products of at most 6 * 2^-14 *
# 2^16 = 24 a lane); products stay normal fp16 down to |x| of 2^-15 times the block max, and the
# smaller ones (fp16 subnormals) are off by at most 2^-25, under 2^-29 of the block's largest product.
# The block's fp32 sum is multiplied back by 2^-e.
_F16_X_PAIR_LOW = tl.constexpr("{ .reg .b32 t; prmt.b32 t, $1, $2, 0x5410; mul.rn.f16x2 $0, t, $3; }")


_F16_X_PAIR_HIGH = tl.constexpr("{ .reg .b32 t; prmt.b32 t, $1, $2, 0x7632; mul.rn.f16x2 $0, t, $3; }")


@triton.jit
def _f16_x_pair(a, b, SEL: tl.constexpr, mul, EMULATE: tl.constexpr):
    """The fp16 halves that ``prmt.b32 a, b, SEL`` picks (0x5410: both low, 0x7632: both high) of two
    int32 of two fp16 each, times ``mul`` (two fp16 powers of two): exact (no overflow, no rounding)."""
    if EMULATE:
        f = _f16_lane(mul, 0)
        if SEL == 0x5410:
            return _f16_bits(_f16_lane(a, 0) * f) | (_f16_bits(_f16_lane(b, 0) * f) << 16)
        else:
            return _f16_bits(_f16_lane(a, 1) * f) | (_f16_bits(_f16_lane(b, 1) * f) << 16)
    elif SEL == 0x5410:
        return tl.inline_asm_elementwise(_F16_X_PAIR_LOW, "=r,r,r,r", [a, b, mul], dtype=tl.int32, is_pure=True,
                                         pack=1)
    else:
        return tl.inline_asm_elementwise(_F16_X_PAIR_HIGH, "=r,r,r,r", [a, b, mul], dtype=tl.int32, is_pure=True,
                                         pack=1)


@triton.jit
def _max8(a, b, c, d, e, f, g, h):
    return tl.maximum(tl.maximum(tl.maximum(a, b), tl.maximum(c, d)), tl.maximum(tl.maximum(e, f), tl.maximum(g, h)))


@triton.jit
def _x_pairs_f16(xw, bidx, b_ok, EMULATE: tl.constexpr):
    """fp16 activations of blocks ``bidx`` as the eight fp16x2 pair registers of
    ``_x_pairs_from_words`` (pair i of half h = x[16b + 8h + i], x[16b + 8h + i + 4]), each block's
    scaled by 2^e (e = clamp(30 - E, 0, 15), E the biased exponent of its largest |x|), and the fp32
    2^-e of each block (pairs of zeros where ``b_ok`` is false)."""
    lo0, hi0 = _x_words(xw, bidx, b_ok, 0)
    lo1, hi1 = _x_words(xw, bidx, b_ok, 1)
    a0, a1, b0, b1 = lo0.to(tl.int32), (lo0 >> 32).to(tl.int32), hi0.to(tl.int32), (hi0 >> 32).to(tl.int32)
    c0, c1, d0, d1 = lo1.to(tl.int32), (lo1 >> 32).to(tl.int32), hi1.to(tl.int32), (hi1 >> 32).to(tl.int32)
    # the largest |x| of the block (the patterns of |x| order as the values do): low and high halves apart
    lo = _max8(a0 & 0x7FFF, a1 & 0x7FFF, b0 & 0x7FFF, b1 & 0x7FFF, c0 & 0x7FFF, c1 & 0x7FFF, d0 & 0x7FFF,
               d1 & 0x7FFF)
    hi = _max8(a0 & 0x7FFF0000, a1 & 0x7FFF0000, b0 & 0x7FFF0000, b1 & 0x7FFF0000, c0 & 0x7FFF0000,
               c1 & 0x7FFF0000, d0 & 0x7FFF0000, d1 & 0x7FFF0000)
    big = tl.maximum(lo, hi >> 16)
    e = tl.minimum(tl.maximum(30 - (big >> 10), 0), 15)
    mul = (e + 15) * 0x04000400  # fp16 2^e in both halves
    xf = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return (_f16_x_pair(a0, b0, 0x5410, mul, EMULATE), _f16_x_pair(a0, b0, 0x7632, mul, EMULATE),
            _f16_x_pair(a1, b1, 0x5410, mul, EMULATE), _f16_x_pair(a1, b1, 0x7632, mul, EMULATE),
            _f16_x_pair(c0, d0, 0x5410, mul, EMULATE), _f16_x_pair(c0, d0, 0x7632, mul, EMULATE),
            _f16_x_pair(c1, d1, 0x5410, mul, EMULATE), _f16_x_pair(c1, d1, 0x7632, mul, EMULATE), xf)


@triton.jit
def _block_products(cur, p00, p01, p02, p03, p10, p11, p12, p13, EMULATE: tl.constexpr, MULDEC: tl.constexpr,
                    F16: tl.constexpr = False):
    """A tile's blocks (int64 of 16 codes) times the x pair registers of
    ``_x_pairs_from_words``, shaped to broadcast against the tile: per block, eight
    ``fma.rn.bf16x2`` summing its 16 products ``v * x * 2^-62`` in two bf16 lanes
    (``MULDEC``: ``_pair_mul``'s decode). ``F16``: ``fma.rn.f16x2`` on the codes as
    ``v * 2^-14`` and ``_x_pairs_f16``'s pairs: products ``v * x * 2^(e - 14)``."""
    zero = tl.zeros(cur.shape, dtype=tl.int32)
    w = cur.to(tl.int32)  # codes 0..7 of each block
    if F16:
        part = _f16x2_fma(_pair(w, 0, 9, FP16_MAG), p00, zero, EMULATE)
        part = _f16x2_fma(_pair(w, 1, 9, FP16_MAG), p01, part, EMULATE)
        part = _f16x2_fma(_pair(w, 2, 9, FP16_MAG), p02, part, EMULATE)
        part = _f16x2_fma(_pair(w, 3, 9, FP16_MAG), p03, part, EMULATE)
        w = (cur >> 32).to(tl.int32)  # codes 8..15
        part = _f16x2_fma(_pair(w, 0, 9, FP16_MAG), p10, part, EMULATE)
        part = _f16x2_fma(_pair(w, 1, 9, FP16_MAG), p11, part, EMULATE)
        part = _f16x2_fma(_pair(w, 2, 9, FP16_MAG), p12, part, EMULATE)
        part = _f16x2_fma(_pair(w, 3, 9, FP16_MAG), p13, part, EMULATE)
    elif MULDEC:
        w8 = w >> 8
        part = _bf16x2_fma(_pair_mul(w, w8, 0), p00, zero, EMULATE)
        part = _bf16x2_fma(_pair_mul(w, w8, 1), p01, part, EMULATE)
        part = _bf16x2_fma(_pair_mul(w, w8, 2), p02, part, EMULATE)
        part = _bf16x2_fma(_pair_mul(w, w8, 3), p03, part, EMULATE)
        w = (cur >> 32).to(tl.int32)  # codes 8..15
        w8 = w >> 8
        part = _bf16x2_fma(_pair_mul(w, w8, 0), p10, part, EMULATE)
        part = _bf16x2_fma(_pair_mul(w, w8, 1), p11, part, EMULATE)
        part = _bf16x2_fma(_pair_mul(w, w8, 2), p12, part, EMULATE)
        part = _bf16x2_fma(_pair_mul(w, w8, 3), p13, part, EMULATE)
    else:
        part = _bf16x2_fma(_pair(w, 0, 6, BF16_MAG), p00, zero, EMULATE)
        part = _bf16x2_fma(_pair(w, 1, 6, BF16_MAG), p01, part, EMULATE)
        part = _bf16x2_fma(_pair(w, 2, 6, BF16_MAG), p02, part, EMULATE)
        part = _bf16x2_fma(_pair(w, 3, 6, BF16_MAG), p03, part, EMULATE)
        w = (cur >> 32).to(tl.int32)  # codes 8..15
        part = _bf16x2_fma(_pair(w, 0, 6, BF16_MAG), p10, part, EMULATE)
        part = _bf16x2_fma(_pair(w, 1, 6, BF16_MAG), p11, part, EMULATE)
        part = _bf16x2_fma(_pair(w, 2, 6, BF16_MAG), p12, part, EMULATE)
        part = _bf16x2_fma(_pair(w, 3, 6, BF16_MAG), p13, part, EMULATE)
    return part


@triton.jit
def _gemv_resident_kernel(
    x_ptr, w_ptr, s_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, HAS_XENC: tl.constexpr,
    ROWS: tl.constexpr, KBP: tl.constexpr, EVEN_K: tl.constexpr, ALIGNED: tl.constexpr,
    EMULATE: tl.constexpr, SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr = False, MULDEC: tl.constexpr = False, KB_C: tl.constexpr = 0, F16: tl.constexpr = False,
    TRIGGER: tl.constexpr = False, WAIT: tl.constexpr = False,
):
    # GEMV v6. The whole activation row lives in registers, as the bf16x2 pairs
    # gemv5 builds per step (8 int32 per 16-code block): loaded and packed
    # once per program, then the program walks row tiles (grid-stride, about
    # a few programs per SM) and reads nothing but weights in its loop. The
    # tile is [ROWS, KBP] blocks (KBP = K/16 rounded up to a power of two,
    # masked); each thread holds whole blocks of every row of the tile, so x
    # pairs are reused across ROWS rows with no shared-memory traffic. gemv5's
    # limit was L1 (ncu: 90.7% L1/TEX, x re-read per step and per row tile).
    # SPLIT: K is cut into segments of KBP blocks (grid axis 2; the last one
    # masked where K ends unless EVEN_K);
    # each program writes its scaled partial sums to the fp32 workspace at
    # ``y_ptr`` ([segments, M, N]) and ``_gemv_split_finish`` adds them up.
    # PREFETCH: each row tile's weights are loaded one loop step ahead (the
    # first before x is loaded and packed), so a tile's loads are in flight
    # while the previous tile is decoded (the H200 sweep: large layers only).
    # F16 (fp16 x): fp16x2 products on each block's x scaled by
    # 2^e (``_x_pairs_f16``), the block sums multiplied back by 2^-e.
    # TRIGGER (SPLIT, _common.split_pdl): the summing pass, a programmatic dependent, may launch now.
    # WAIT (w4a4_pairs_gemv): launched as the programmatic dependent of the quantize launch that writes x
    # (and x_enc): the first row tile's weights (PREFETCH) are loaded before griddepcontrol.wait, x after.
    if TRIGGER:
        _gdc_launch_dependents()
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    row = tl.program_id(1).to(tl.int64)
    kb = K // 16
    if ALIGNED:
        kb = tl.multiple_of(kb, 16)
    if KB_C > 0:
        kb = KB_C
    if SPLIT:
        seg = tl.program_id(2)
        ab = seg * KBP + tl.arange(0, KBP)
    else:
        ab = tl.arange(0, KBP)
    b_ok = ab < kb
    bidx = tl.where(b_ok, ab, 0)
    ar = tl.arange(0, ROWS)
    if PREFETCH:
        blk, sb = _load_tile(w_ptr, s_ptr, pid, ROWS, ar, N, kb, ab, EVEN_K, KB_C)
    if WAIT:
        _gdc_wait()
    xrow = x_ptr + row * stride_xm
    if F16:
        xw = xrow.to(tl.pointer_type(tl.int64))
        p00, p01, p02, p03, p10, p11, p12, p13, xf = _x_pairs_f16(xw, bidx, b_ok, EMULATE)
        factor = _output_factor(wenc_ptr, xenc_ptr, 4194304.0, HAS_XENC)  # 2^22
    else:
        xw = xrow.to(tl.pointer_type(tl.int64))
        p00, p01, p02, p03 = _x_pairs_from_words(xw, bidx, b_ok, 0)
        p10, p11, p12, p13 = _x_pairs_from_words(xw, bidx, b_ok, 1)
        factor = _output_factor(wenc_ptr, xenc_ptr, 1.1805916207174113e21, HAS_XENC)  # 2^70
    for t in range(pid, tl.cdiv(N, ROWS), nprog):
        n = t * ROWS + ar
        n_ok = n < N
        n = tl.where(n_ok, n, 0).to(tl.int64)
        if PREFETCH:  # this tile's blocks came one step ago; the next tile's go in flight now
            cur, csb = blk, sb
            blk, sb = _load_tile(w_ptr, s_ptr, t + nprog, ROWS, ar, N, kb, ab, EVEN_K, KB_C)
        elif KB_C > 0:
            cur, csb = _load_tile(w_ptr, s_ptr, t, ROWS, ar, N, kb, ab, EVEN_K, KB_C)
        else:
            cur, csb = _load_blocks(w_ptr, s_ptr, n, kb, 0, ab, EVEN_K)  # ab already holds the segment's blocks
        part = _block_products(cur, p00[None, :], p01[None, :], p02[None, :], p03[None, :], p10[None, :], p11[None, :],
                              p12[None, :], p13[None, :], EMULATE, MULDEC, F16)
        acc = _scaled_block_sums(part, csb, F16)
        if F16:
            acc = acc * xf[None, :]  # sum v * x * scale * 2^-22
        y = tl.sum(acc, axis=1) * factor  # acc = sum v * x * scale * 2^-70
        if SPLIT:
            tl.store(y_ptr + (seg * M + row) * N + n, y, mask=n_ok)
        else:
            if HAS_BIAS:
                y += tl.load(bias_ptr + n).to(tl.float32)
            tl.store(y_ptr + row * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _tile_offsets_t(t, ROWS: tl.constexpr, ar, N, kb, KB_C: tl.constexpr):
    """Row offsets (row * K/16) of row tile ``t``: ``_tile_rows`` times K/16, or with ``KB_C`` (K/16 a
    compile-time constant, N a multiple of ROWS) a scalar tile offset, the tile index clamped to the last
    tile, so that a thread's ROWS rows sit at constant distances (immediate load offsets)."""
    if KB_C > 0:
        return tl.minimum(t, N // ROWS - 1) * (ROWS * KB_C)
    else:
        return _tile_rows(t, ROWS, ar, N) * kb


@triton.jit
def _load_blocks_t(w_ptr, s_ptr, roff, kb, b0, ab, EVEN_K: tl.constexpr, KB_C: tl.constexpr = 0,
                   ROWS: tl.constexpr = 1):
    """``_load_blocks`` transposed (``[KC, ROWS]``, K first) for ``_gemv_stream_kernel``, rows
    given as offsets ``roff = row * K/16`` (int32). The block index goes through a select,
    so that no load sees contiguous blocks: every operand of a step then takes a
    one-block-a-thread layout along K with all ROWS rows of a block in one thread, which
    x's words share (no layout conversions). Masked past K unless EVEN_K."""
    bidx = b0 + ab
    ok = bidx < kb
    idx = tl.where(ok, bidx, 0)
    if KB_C > 0:  # roff is the tile's scalar offset; each row a constant further
        rows = (tl.arange(0, ROWS) * KB_C)[None, :]
        return _codes_and_scales(w_ptr + (roff + idx)[:, None] + rows, s_ptr + (roff + idx)[:, None] + rows,
                                 ok[:, None], EVEN_K)
    else:
        offs = roff[None, :] + idx[:, None]
        return _codes_and_scales(w_ptr + offs, s_ptr + offs, ok[:, None], EVEN_K)


@triton.jit
def _gemv_stream_kernel(
    x_ptr, w_ptr, s_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, HAS_XENC: tl.constexpr,
    ROWS: tl.constexpr, KC: tl.constexpr, EVEN_K: tl.constexpr, ALIGNED: tl.constexpr,
    EMULATE: tl.constexpr, PREFETCH: tl.constexpr, KB_C: tl.constexpr = 0,
    F16: tl.constexpr = False,
):
    # GEMV v7, for long K. gemv6 keeps x resident, so a K that does not fit in a
    # program's registers is split into segments, each program walks a few row
    # tiles of one segment and pays the x prologue and a 4-row reduction over
    # its threads per few blocks, then a second launch adds the segments (the
    # H200 profile of 70B down: 4.7 instructions a weight, 3.6 on gate_up).
    # Here a program walks whole rows: each step is one chunk of KC blocks of
    # its current row tile (tile t, chunk c, advanced without divisions), x's
    # chunk re-read as 8-byte words (L1 hits) and paired in two instructions a
    # pair, shared by the tile's ROWS rows (the tile is [KC, ROWS], K first: a
    # thread holds every row of its blocks); the block products are summed into
    # a [KC, ROWS] fp32 accumulator across chunks and reduced over the threads
    # once per tile. PREFETCH: the next step's codes and scales are loaded
    # before this step's decode. EVEN_K: KC divides K/16 (no masks). F16: fp16 x
    # as in gemv6 (each block's x scaled by 2^e, every step).
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    row = tl.program_id(1).to(tl.int64)
    kb = K // 16
    if ALIGNED:
        kb = tl.multiple_of(kb, 16)
    if KB_C > 0:
        kb = KB_C
    chunks = tl.cdiv(kb, KC)
    ab = tl.arange(0, KC)
    ar = tl.arange(0, ROWS)
    xw = (x_ptr + row * stride_xm).to(tl.pointer_type(tl.int64))
    if F16:
        factor = _output_factor(wenc_ptr, xenc_ptr, 4194304.0, HAS_XENC)  # 2^22
    else:
        factor = _output_factor(wenc_ptr, xenc_ptr, 1.1805916207174113e21, HAS_XENC)  # 2^70
    mine = tl.cdiv(tl.cdiv(N, ROWS) - pid, nprog)  # row tiles this program walks
    t = pid
    c = 0
    roff = _tile_offsets_t(t, ROWS, ar, N, kb, KB_C)
    if PREFETCH:
        blk, sb = _load_blocks_t(w_ptr, s_ptr, roff, kb, 0, ab, EVEN_K, KB_C, ROWS)
    acc = tl.zeros((KC, ROWS), dtype=tl.float32)
    for _ in range(0, mine * chunks):
        b0 = c * KC
        last = c == chunks - 1
        t_next = tl.where(last, t + nprog, t)
        c_next = tl.where(last, 0, c + 1)
        roff_next = _tile_offsets_t(t_next, ROWS, ar, N, kb, KB_C)
        if PREFETCH:  # this step's blocks came one step ago; the next step's go in flight now
            cur, csb = blk, sb
            blk, sb = _load_blocks_t(w_ptr, s_ptr, roff_next, kb, c_next * KC, ab, EVEN_K, KB_C, ROWS)
        else:
            cur, csb = _load_blocks_t(w_ptr, s_ptr, roff, kb, b0, ab, EVEN_K, KB_C, ROWS)
        bidx = b0 + ab
        b_ok = bidx < kb
        bidx = tl.where(b_ok, bidx, 0)
        if F16:
            p00, p01, p02, p03, p10, p11, p12, p13, xf = _x_pairs_f16(xw, bidx, b_ok, EMULATE)
        else:
            p00, p01, p02, p03 = _x_pairs_stream(xw, bidx, b_ok, 0, EMULATE)
            p10, p11, p12, p13 = _x_pairs_stream(xw, bidx, b_ok, 1, EMULATE)
        part = _block_products(cur, p00[:, None], p01[:, None], p02[:, None], p03[:, None], p10[:, None], p11[:, None],
                               p12[:, None], p13[:, None], EMULATE, True, F16)
        if F16:
            acc += _scaled_block_sums(part, csb, F16) * xf[:, None]
        else:
            acc += _scaled_block_sums(part, csb)
        if last:  # the tile's last chunk: reduce, store, start the next tile at zero
            n = t * ROWS + ar
            n_ok = n < N
            y = tl.sum(acc, axis=0) * factor  # acc = sum v * x * scale * 2^-70
            if HAS_BIAS:
                y += tl.load(bias_ptr + tl.where(n_ok, n, 0)).to(tl.float32)
            tl.store(y_ptr + row * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
            acc = tl.zeros((KC, ROWS), dtype=tl.float32)
        t, c, roff = t_next, c_next, roff_next


@triton.jit
def _tile_rows(t, ROWS: tl.constexpr, ar, N):
    """Rows of row tile ``t``, those past N (and every row of a tile past the last)
    replaced by row 0: loaded, never stored. int32: the launchers take only layers
    whose block count N * K / 16 fits (``_block_offsets_fit``), and 32-bit row
    offsets save gemv6/gemv7 a 64-bit multiply a row a step."""
    n = t * ROWS + ar
    return tl.where(n < N, n, 0)

