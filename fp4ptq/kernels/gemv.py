"""The GEMVs (M = 1-2 activation rows): packed bf16x2 / fp16x2 sums on weights decoded in registers.

* ``_gemv_resident_kernel`` (path "gemv6"): the activation row held in registers as bf16x2 pairs,
  persistent programs over row tiles, K split into power-of-two segments (the last one masked) with
  an ordered fp32 summing pass where it is more than one; the next row tile loaded ahead on large
  layers and at M = 1 on the narrow single-segment ones. fp16 activations sum in fp16x2 on each
  block's x scaled by 2^e (``_x_pairs_f16``).
* ``_gemv_stream_kernel`` (gemv7, run by path "gemv6" where ``_gemv7_config`` names the shape: layers
  of 32M weights and more whose K gemv6 would split, the down projections): whole rows a program, x
  re-read from L1 each step, no split.
* ``_gemv_blocks_kernel`` (path "gemv4"): fp32 sums; the fallback for layers of 2^31 blocks and more,
  which the 32-bit block offsets of the two above cannot address.

gemv6 / gemv7 decode bf16 in three operations (``_pair_mul``: the nibbles masked, one multiply that
writes two copies of each, one mask) and sum each block's 16 products in bf16 (``fma.rn.bf16x2``;
~2^-9 relative per block sum, ~4e-3 on the outputs measured) or, for fp16 activations, in fp16
(``fma.rn.f16x2``, ~5e-4), before fp32 takes over; under the Triton interpreter those FMAs are
emulated. Configs: the H200 sweeps named at each rule (``benchmarks/results/``).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ..nvfp4 import BLOCK_SIZE
from . import _common
from ._common import (BF16_MAG, FP16_MAG, _gdc_launch_dependents, _gdc_wait, _halves, _output_factor, _output_scale,
                      _pair, _pair_mul, cdiv, next_pow2, scale_fp32)


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #

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
    EMULATE: tl.constexpr, MULDEC: tl.constexpr, PREFETCH: tl.constexpr, KB_C: tl.constexpr = 0,
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
                               p12[:, None], p13[:, None], EMULATE, MULDEC, F16)
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


# --------------------------------------------------------------------------- #
# Host side: configs and launches
# --------------------------------------------------------------------------- #

def _gemv4_config(m: int, n: int, k: int):
    """(BLOCK_N, BLOCK_B, num_warps) of the fp32 GEMV (rows x blocks of 16 a step):
    H200 sweeps (runs 3 and 4), 8 x 128 x 4 warps for N < 16384, 16 x 64 x 2 above."""
    block_n, block_b, warps = (16, 64, 2) if n >= 16384 else (8, 128, 4)
    return block_n, min(block_b, next_pow2(max(1, k // 16))), warps


def _gemv6_config(m: int, n: int, k: int):
    """(ROWS, num_warps, programs per SM, K segment, PREFETCH) of the resident-x
    GEMV; ``_gemv6`` cuts the programs to whole waves of what the compiled
    kernel fits on an SM.

    Layers of 64M weights and more (the session-7 H200 sweep,
    results/gemv6_prefetch_h200.json: 8B.gate_up 24.2 -> 22.6 us, 70B.gate_up
    80.0 -> 77.2, 70B.down 50.4 -> 46.9): each row tile loaded one step ahead,
    4 rows on 4 warps, K in segments of its largest power-of-two divisor up to
    8192 (70B.gate_up runs as one segment), 16 programs per SM when K is split,
    else 32768 / segment up to 8. Smaller layers keep the session-4 rule
    (results/sweep_h200_s4_round*.json), where the prefetch did not pay
    (8B.down, 8B.qkv, 8B.o): segments up to 4096, warps so that each thread
    holds four blocks of a row (segment / 2048), 8 rows a step for
    single-segment layers narrower than 16384 and 4 otherwise, 8 programs per
    SM (16 when K is split). Single-segment layers of at most 8192 rows take 4 rows
    and 4 programs an SM instead (session 9, interleaved, results/gemv6_small_h200.json:
    8B.qkv 7.69 -> 7.31 us, 8B.o 6.18 -> 5.92, Qwen2-7B qkv 8.79 -> 6.52, Gemma-2-9B
    qkv 11.63 -> 8.60; Llama-2-7B qkv (12288 rows) 11.43 -> 11.71 kept the old rule).
    Smaller layers whose K is split into whole segments of 2048 or more take 8 rows
    and two blocks of a row a thread (session 11, with the three-operation decode,
    results/muldec_sweep_h200.json, then muldec_rule_h200_first.json: 8B.down 16.4 ->
    14.9 us, Phi-3-mini down 10.4 -> 9.8, Gemma-2-9B down level; with a masked last
    segment or 512-K segments it lost 2-6%: Llama-2-7B down, SmolLM2 down).
    At M = 1 the narrow single-segment layers (``_gemv6_narrow``) load each row tile
    one step ahead on twice those warps (two blocks of a row a thread), tuned on weights cold
    in L2, as decoding reads them (session 20, results/cold_sweep_h200.json, then narrow_ahead_h200.json, interleaved: 8B.qkv
    8.55 -> 6.99 us cold, 7.18 -> 7.02 warm; 8B.o 6.72 -> 5.49 cold, level warm; 5-26%
    faster cold on the 11 layers of 7 models timed, warm level or faster but SmolLM2 qkv
    (+3.6%, 0.1 us); W4A4 alike). At M = 2 it lost 15-20% on 8B qkv / o and Gemma-2-9B o,
    so M = 2 keeps the session-9 config."""
    large = n * k >= 1 << 26
    seg = _gemv6_segment(k, 8192 if large else 4096)
    kbp = next_pow2(max(1, seg // 16))
    split = k > seg
    if large:
        return 4, max(1, min(4, kbp // 32)), 16 if split else max(1, min(8, 32768 // seg)), seg, True
    if split and seg >= 2048 and k % seg == 0:
        return 8, max(1, min(8, kbp // 64)), 16, seg, False
    narrow = _gemv6_narrow(n, k)
    if narrow and m == 1:
        return 4, max(1, min(8, kbp // 64)), 4, seg, True
    rows = 4 if split or narrow or n >= 16384 else 8
    return rows, max(1, min(8, kbp // 128)), 16 if split else (4 if narrow else 8), seg, False


def _gemv6_muldec(n: int, k: int) -> bool:
    """Whether gemv6 decodes with ``_pair_mul`` (three operations a pair register)
    or the shifts (four): the multiply where K is whole segments of 2048 or more,
    except on large layers with K split. The H200 runs (interleaved rounds,
    results/muldec_h200.json, muldec_sweep_h200.json, muldec_rule_h200*.json):
    1-4% faster on every Llama-3.1 shape and the other whole-segment layers timed
    (70B qkv / o, 8B lm_head, Phi-3-mini and Gemma-2-9B down), but 2% slower on
    70B down (47.1 -> 48.1 us, its best other tile 47.8) and 3-5% slower on
    Llama-2-7B down and Qwen2-7B qkv (masked last segments) and SmolLM2 down
    (512-K segments); Qwen2-7B gate_up (masked) was 4.7% faster, Qwen2-7B o / down
    level. Those exceptions keep the shifts; why the multiply loses there is not
    known. ``GEMV6_MULDEC`` = False turns it off everywhere."""
    large = n * k >= 1 << 26
    seg = _gemv6_segment(k, 8192 if large else 4096)
    whole = k % seg == 0 and seg & (seg - 1) == 0  # no masked blocks (EVEN_K)
    return GEMV6_MULDEC and whole and seg >= 2048 and not (large and k > seg)


@functools.lru_cache(maxsize=None)
def _gemv6_segment(k: int, cap: int) -> int:
    """The K segment of gemv6: ``cdiv(K, segment)`` programs share a row, each holding
    its segment of x (a power-of-two number of blocks; the last segment, or a single
    one, masked where K ends). K a multiple of 2048: its largest power-of-two divisor
    up to ``cap``, no masking (the tuned Llama shapes). Any other K: of one masked
    segment (K <= cap), power-of-two segments from 2048 to ``cap`` with a masked last
    one, and an even split by K's power-of-two divisor (256 or more), the fewest
    segments that keep 85% of the lanes busy (else the most busy lanes): an even split
    by a small divisor cuts a row into many short segments (Qwen2-7B's K = 18944 into
    37 of 512), and one segment of a long K would not fit in registers."""
    div = k & -k  # the largest power of two dividing K
    if div >= 2048:
        return min(div, cap)
    options = [(1, 16 * next_pow2(max(1, k // 16)))] if k <= cap else []
    seg = 2048
    while seg <= cap:
        options.append((cdiv(k, seg), seg))
        seg *= 2
    if div >= 256:
        options.append((k // div, div))
    busy = [(count, size, k / (count * size)) for count, size in options]
    good = [o for o in busy if o[2] >= 0.85]
    count, size, _ = min(good) if good else max(busy, key=lambda o: (o[2], -o[0]))
    return k if count == 1 else size


_RESIDENT: dict = {}


def _resident_programs(args, grid, kwargs, device: torch.device, kernel) -> Optional[int]:
    """How many programs of this gemv6 build fit on one SM at once (registers,
    warps, shared memory), read from the compiled kernel; None if unknown.
    Cached per build. The session-4 configs were tuned where the kernel took
    127 registers (8 two-warp programs per SM, Triton 3.6); another compiler
    can allocate differently, and a grid just over a whole wave leaves a
    mostly idle second one (measured: 118 us instead of 81 on 70B.gate_up)."""
    if _common.INTERPRET or device.type != "cuda":
        return None
    key = (kernel.fn.__name__, device.index, args[0].dtype, args[6].dtype, tuple(kwargs.items()))  # fixed order
    if key not in _RESIDENT:
        try:
            compiled = kernel.warmup(*args, grid=grid, **kwargs)
            compiled._init_handles()
            props = torch.cuda.get_device_properties(device)
            warps = kwargs["num_warps"]
            regs = -(-compiled.n_regs // 8) * 8 * 32 * warps  # registers go out in 8-per-thread steps
            by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(1, regs)
            smem = compiled.metadata.shared
            by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // smem if smem else 32
            by_warps = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
            _RESIDENT[key] = max(1, min(by_regs, by_smem, by_warps, 32))
        except Exception:  # noqa: BLE001 - an introspection API that moved: keep the configured grid
            _RESIDENT[key] = None
    return _RESIDENT[key]


def _whole_wave_programs(kernel, args, grid, kwargs, device: torch.device, per_sm: int) -> int:
    """``per_sm`` programs an SM, cut to whole waves of what the compiled ``kernel``
    fits on one (``GEMV6_WHOLE_WAVES``; the persistent GEMVs)."""
    sms = _common._sm_count(device)
    if GEMV6_WHOLE_WAVES:
        fit = _resident_programs(args, grid, kwargs, device, kernel)
        if fit is not None and per_sm > fit:
            return (per_sm // fit) * fit * sms  # whole waves only
    return per_sm * sms


# gemv6 grids are cut to whole waves of resident programs (off: the configured programs per SM as given)
GEMV6_WHOLE_WAVES = True


# the streamed-x GEMV (gemv7) in the gemv6 path: "auto" where measured faster, "1" everywhere, "0" never
GEMV7 = "auto"


# the three-operation decode of a code pair (``_pair_mul``); False keeps the four-operation one
GEMV6_MULDEC = True


def _gemv7_config(m: int, n: int, k: int):
    """(ROWS, num_warps, KC blocks a step, programs per SM, PREFETCH) of the streamed-x
    GEMV for this shape, or None where gemv6 (x resident) runs. From the session-11
    H200 sweep (results/gemv7_h200.json, 96 configs a layer, then interleaved rounds):
    8 rows a tile, 8 programs an SM; where 128-block steps divide K (K a multiple of
    2048) 2 warps, 128 blocks a step and the next step loaded ahead (70B down 42.2
    us, 8B down 12.9); else 4 warps, nothing loaded ahead, and the step of 128 or
    256 blocks that pads K less, 256 on a tie (results/gemv7_masked_h200.json,
    interleaved, 128 -> 256 blocks: Qwen2-7B down 17.8 -> 16.3 and Llama-2-7B down
    11.5 -> 10.8 pad alike; Qwen2-72B down 47.3 -> 48.7 and Phi-3-medium down 21.0
    -> 24.6 pad more with 256)."""
    if GEMV7 == "0" or (GEMV7 == "auto" and not _gemv7_preferred(n, k)):
        return None
    kb = k // 16
    if kb % 128 == 0:
        return 8, 2, 128, 8, True
    return 8, 4, 256 if cdiv(kb, 256) * 2 <= cdiv(kb, 128) else 128, 8, False


def _gemv7_f16_config(n: int, k: int, cfg: tuple) -> tuple:
    """gemv7's config for fp16 activations, which pay each block's x exponent every step (``_x_pairs_f16``):
    on layers of 128M weights and more, 16 rows a tile (the exponents shared by twice the rows), 4 warps,
    4 programs an SM, nothing loaded ahead, and the step of 128 or 256 blocks that pads K less (256 on a
    tie), else ``cfg`` (bf16's). Session 21, 3 interleaved rounds of 32 configs
    (results/gemv_fp16_h200_sweep.json, us, bf16's config -> this one): 70B down 49.3 -> 41.4 (bf16 37.5),
    Qwen2-72B down 50.3 -> 45.9 (128 blocks a step; 256 would pad K more: 52.6); the smaller layers
    stayed best or level with bf16's (8B down 12.90, Llama-2-7B down 11.50 against 11.42, Qwen2-7B down
    17.03 against 16.99)."""
    if n * k < 1 << 27:
        return cfg
    kb = k // BLOCK_SIZE
    return 16, 4, 256 if cdiv(kb, 256) * 2 <= cdiv(kb, 128) else 128, 4, False


def _gemv7_preferred(n: int, k: int) -> bool:
    """Where the streamed-x GEMV replaces gemv6: layers of 32M weights and more whose K
    gemv6 would split (session 11, interleaved rounds, gemv6 -> gemv7, us: 70B down 47.0
    -> 42.3, 8B down 15.0 -> 12.9, Qwen2-7B down 21.5 -> 15.3, Llama-2-7B down 14.9 ->
    10.8, Qwen2-72B down 67.7 -> 46.5). Where K is one segment gemv6 keeps x in registers
    and stays ahead (70B gate_up 76.5 against 81.9, 8B gate_up 22.0 against 24.7) or level
    (8B qkv 7.1 / 7.0)."""
    large = n * k >= 1 << 26
    return n * k >= 1 << 25 and k > _gemv6_segment(k, 8192 if large else 4096)


def _gemv7(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc, cfg, slots=(0, 6)):
    """The streamed-x GEMV's launch (whole rows a program, no K split): a ``Launch`` called with the
    arguments at ``slots`` (x and y; the activations' global scale too in a W4A4 plan)."""
    rows, warps, kc, per_sm, prefetch = cfg
    kb = k // 16
    args = (x2, words.view(torch.int64), sbits, enc, xenc_arg, bias_arg, y, m, n, k, x2.stride(0), y.stride(0))
    kwargs = dict(HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, ROWS=rows, KC=kc, EVEN_K=kb % kc == 0,
                  ALIGNED=k % 256 == 0, EMULATE=_common.INTERPRET, MULDEC=GEMV6_MULDEC, PREFETCH=prefetch,
                  KB_C=_const_kb(n, k, rows), F16=x2.dtype == torch.float16, num_warps=warps)
    programs = _whole_wave_programs(_gemv_stream_kernel, args, (1, m), kwargs, x2.device, per_sm)
    grid = (max(1, min(cdiv(n, rows), programs)), m)
    return _common.Launch(_gemv_stream_kernel, grid, args, slots, kwargs)


# gemv6 / gemv7 built for the layer's K (K/16 a compile-time constant) where N is whole row tiles: a thread's
# rows then sit at constant distances and its loads take immediate offsets (8-10% fewer instructions a
# step, Triton 3.6 SASS); False: K a runtime argument everywhere (one build for every K)
GEMV_CONST_K = True


def _const_kb(n: int, k: int, rows: int) -> int:
    """``KB_C`` of gemv6 / gemv7: K/16 where the build may fix it (N a multiple of ``rows``), else 0."""
    return k // BLOCK_SIZE if GEMV_CONST_K and n % rows == 0 and k % BLOCK_SIZE == 0 else 0


def _gemv6_narrow(n: int, k: int) -> bool:
    """Whether gemv6 runs this layer as narrow single-segment tiles (``_gemv6_config``'s small-layer
    rule: K one segment, at most 8192 rows, under 64M weights)."""
    return n * k < 1 << 26 and n <= 8192 and _gemv6_segment(k, 4096) >= k


# gemv6 / gemv7 address a row's blocks with 32-bit offsets (row * K/16 + block): layers of up to 2^31
# blocks (34 billion weights; the largest LLM layers hold about 2 billion)
GEMV6_MAX_BLOCKS = 1 << 31


def _block_offsets_fit(n: int, k: int) -> bool:
    return n * cdiv(k, BLOCK_SIZE) < GEMV6_MAX_BLOCKS


def _gemv6(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc, *, slots=(0, 6),
           dependent=False):
    """The resident-x GEMV's launches, K in segments
    (config) through an fp32 workspace and a summing pass: a callable ``run(*tensors) -> y`` taking
    the arguments at ``slots`` (x and y; the activations' global scale too in a W4A4 plan; y last).
    Shapes ``_gemv7_config`` names run the streamed-x GEMV instead (plainly). ``dependent``: the
    GEMV launches as the programmatic dependent of the quantize launch just before it, which
    signalled it (``w4a4_pairs_gemv``; plainly, should the driver refuse that)."""
    if not _block_offsets_fit(n, k):
        raise ValueError(f"gemv6: a {n} x {k} weight has {n * cdiv(k, BLOCK_SIZE)} blocks, more than its "
                         f"32-bit offsets address ({GEMV6_MAX_BLOCKS}); use path 'gemv4' or 'mma'")
    cfg7 = _gemv7_config(m, n, k)
    if cfg7 is not None and x2.dtype == torch.float16:
        cfg7 = _gemv7_f16_config(n, k, cfg7)
    if cfg7 is not None:
        return _common.split_run(_gemv7(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc, cfg7,
                                slots), 1, y, None)
    rows, warps, per_sm, seg, prefetch = _gemv6_config(m, n, k)
    if seg % 16:
        raise ValueError(f"gemv6: K segment {seg} is not a whole number of 16-blocks")
    segments = cdiv(k, seg)
    kbp = next_pow2(max(1, seg // 16))
    if segments > 1 and kbp != seg // 16:
        raise ValueError(f"gemv6: a K segment ({seg}) must be a power-of-two number of blocks")
    tiles = cdiv(n, rows)
    split = segments > 1
    target = _common.split_workspace(segments, y)
    args = (x2, words.view(torch.int64), sbits, enc, xenc_arg, bias_arg, target, m, n, k, x2.stride(0), y.stride(0))
    kwargs = dict(HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, ROWS=rows, KBP=kbp, EVEN_K=kbp * segments == k // 16,
                  ALIGNED=k % 256 == 0, EMULATE=_common.INTERPRET, SPLIT=split, num_warps=warps, enable_fp_fusion=True,
                  PREFETCH=prefetch, MULDEC=_gemv6_muldec(n, k), KB_C=_const_kb(n, k, rows),
                  F16=x2.dtype == torch.float16, TRIGGER=split and _common.split_pdl(x2.device))
    if dependent:
        kwargs.update(WAIT=True, launch_pdl=True)
    programs = _whole_wave_programs(_gemv_resident_kernel, args, (1, m, segments), kwargs, x2.device, per_sm)
    grid = (max(1, min(tiles, cdiv(programs, segments))), m, segments)
    launch = _common.Launch(_gemv_resident_kernel, grid, args, slots, kwargs)
    run = _common.split_run(launch, segments, y, bias_arg if has_bias else None, kwargs["TRIGGER"])
    if not dependent:
        return run
    plain = lambda: _gemv6(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc, slots=slots)  # noqa: E731
    return _common.dependent_or_plain(run, plain, x2.device, "gemv6 after the quantize launch")


# W4A4 at M = 1-2: the resident-x GEMV (gemv6) as the quantize launch's programmatic dependent, its first
# row tile's weights loaded before the wait (``w4a4_pairs_gemv``; False launches it plainly).
W4A4_PDL_GEMV = True


def w4a4_pairs_gemv(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether W4A4's gemv6 launch for M rows of an [N, K] weight is the programmatic dependent of its
    quantize launch: ``W4A4_PDL_GEMV`` and ``w4a4_pdl``, on layers under 64M weights (gemv6's
    small-layer configs), not where the streamed-x GEMV (gemv7) runs. H200, session 25
    (results/w4a4_pdl_h200_v7.json, plain -> dependent, us): M = 1 8B qkv 8.89 -> 8.55, 8B o 7.71 ->
    7.31, Qwen2-7B o 7.48 -> 7.08, Phi-3-mini o (K split) 7.55 -> 7.27, fp16 + mse + bias 8B qkv 9.54 ->
    8.90; M = 2 8B qkv 12.57 -> 11.99, 8B o 10.48 -> 9.88; on the 64M-weight configs level or slower
    (8B gate_up 23.30 -> 23.19, 70B gate_up 72.64 -> 73.51), so those stay plain."""
    return W4A4_PDL_GEMV and n * k < 1 << 26 and _common.w4a4_pdl(device) and _gemv7_config(m, n, k) is None


def gemv4(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc):
    """The fp32 GEMV's launch (path "gemv4"), writing y."""
    block_n, block_b, warps = _gemv4_config(m, n, k)
    _gemv_blocks_kernel[(cdiv(n, block_n), m)](
        x2, words.view(torch.int64), sbits, enc, xenc_arg, bias_arg, y, m, n, k,  # [N, K/16] blocks
        x2.stride(0), y.stride(0), HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, BLOCK_N=block_n,
        BLOCK_B=block_b, EVEN_K=(k // 16) % block_b == 0, ALIGNED=k % 256 == 0, num_warps=warps,
    )
    return y
