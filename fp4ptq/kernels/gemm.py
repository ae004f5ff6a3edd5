"""Triton NVFP4 GEMMs for Hopper: W4A16 (GEMV for tiny M, Gluon tensor-core kernels,
a tiled ``tl.dot`` GEMM, dequantize + cuBLAS for long prefill) and W4A4 (activations
quantized on the fly).

Paths (``path=`` of ``linear_w4a16`` / ``linear_w4a4``; None picks by shape and
dtype, see the shape rules below): ``gemv6`` packed bf16x2 GEMV with the
activation row resident in registers and persistent programs over row tiles
(M <= 2, bf16 activations, and fp16 ones with fp16x2 sums on each block's x scaled by
2^e; K split into power-of-two segments, the last one masked,
when it is not one; the next row tile prefetched on large layers, and at M = 1 on
the narrow single-segment ones (tuned with the weights cold in L2); on layers of 32M
weights and more whose K it would split, the down projections, the path runs gemv7
instead: whole rows a program, x re-read from L1 each step, no split), ``gemv5`` its
predecessor (x re-read every step), ``gemv4`` fp32 GEMV (M <= 2; fp16 where gemv5 is asked for), ``gemv``
the first GEMV (kept for comparison), ``mma`` the Gluon tensor-core kernel
(``mma.py``; 3 <= M <= 64 where wsgemm does not run, and M = 2 from 4M weights, bf16/fp16 activations,
K % 64 == 0, CUDA), ``gemm`` tiled GEMM (M <= 63 where ``mma`` cannot run),
``wgmma`` (``wgmma.py``, sm_90, 65 <= M <= 128 where wsgemm does not run), ``wsgemm`` the
warp-specialized Gluon GEMM (``wsgemm.py``, sm_90, 33 <= M <= 1024 (64-row tiles to M = 64, 128-row
tiles to 128 (256 weight rows on wide layers), then 256 with the operands swapped), W4A4 to 2048 or 8192, where its tiles fill the SMs or its split tail does,
K % 64 == 0 and K >= 4096, or 3072 on layers of 8192 rows and more, and at M = 65..128 on layers of
3072 rows and more with K >= 3072; ahead of mma.py / wgmma.py there),
``cublas`` dequantize + cuBLAS (M >= 64 where none of those runs), ``dot_scaled`` FP4
tensor cores on sm_100+ (``dot_scaled.py``; W4A4 with M > 2 picks it there once
its self-test passed). Timings: benchmarks/results/kernels_h200.md.

Weights stay in the checkpoint layout (``weight_packed [N, K/2]`` uint8, read
as int32 words of 8 codes or int64 blocks of 16; ``weight_scale [N, K/16]``
e4m3): the codes are already contiguous along K, so a thread's 16-byte load
covers 32 codes (2 blocks) and a warp's loads are coalesced. No re-layout; one
cache: where K % 256 != 0 (Qwen2-72B's down layer) wsgemm reads the scales by TMA
from a copy with rows padded to 16 bytes, kept with the weight (``wsgemm.tma_scales``).

Decoding a word by bit moves (no lookup table)
----------------------------------------------
Code ``i`` of a word sits at bits ``4i..4i+3`` (sign = bit 3, magnitude = an
E2M1 exponent/mantissa field). Codes ``i`` and ``i+4`` become one register of
two 16-bit floats with one shift pair and one masked merge (LOP3)::

    r_i = ((w << (S - 4i)) & MAG) | ((w << (12 - 4i)) & 0x80008000)

(gemv6 / gemv7 decode bf16 in three operations instead, ``_pair_mul``: the nibbles
masked, one multiply that writes two copies of each, one mask.)

``S = 9`` puts the magnitude under fp16 exponent/mantissa bits 9..11: the
half is then ``v * 2^-14`` (0.5 is the fp16 subnormal 2^-15, which fp16
arithmetic and conversions keep). ``S = 6`` does the same under bf16's
fields: ``v * 2^-126`` (0.5 is the bf16 subnormal 2^-127). The powers of two
are folded into the block scale or the output scale once.

Block scales decode by bit moves too: the E4M3 byte shifted left by 7 is the
fp16 ``scale * 2^-8`` (subnormal E4M3 scales land on fp16 subnormals).

Exactness: ``v * scale`` (2 and 4 significant bits) is exact in bf16 and
fp16, so the tiled GEMM multiplies exactly-decoded weights (the global
``1/global_enc`` is applied once to the fp32 accumulator). W4A4 feeds the
same GEMMs with ``v_x * scale_x`` activations from the quantize kernel (exact
too), so every product is an exact NVFP4 x NVFP4 product, accumulated in fp32.
The exception is ``gemv5``/``gemv6``/``gemv7``: they sum each block's 16 products in bf16 (packed
``fma.rn.bf16x2``; ~2^-9 relative per block sum, ~4e-3 on the outputs measured), or for fp16
activations in fp16 (``fma.rn.f16x2``, ~5e-4 on the outputs: ``_x_pairs_f16``), before fp32 takes
over; under the Triton interpreter those FMAs are emulated.
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import nvfp4
from ..nvfp4 import BLOCK_SIZE, NVFP4Tensor
from . import quantize_kernel
from ._ints import cdiv, next_pow2
from ._launch import Launch, cuda_sm_count, current_device
from .quantize_kernel import global_enc_from_amax, quantize_halves, signed_scaled

try:  # griddepcontrol (programmatic dependent launch), Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # pragma: no cover - an older Triton: the summing pass launches plainly (split_pdl)
    _gdc_launch_dependents = _gdc_wait = None

SIGN_MASK = tl.constexpr(-2147450880)  # 0x80008000 as int32
FP16_MAG = tl.constexpr(0x0E000E00)    # fp16 exponent/mantissa bits 9..11 of both halves
BF16_MAG = tl.constexpr(0x01C001C0)    # bf16 bits 6..8 of both halves


# --------------------------------------------------------------------------- #
# Decoding helpers
# --------------------------------------------------------------------------- #
@triton.jit
def _shl(w, amount: tl.constexpr):
    if amount >= 0:
        return w << amount
    else:
        return w >> (-amount)


@triton.jit
def _pair(w, i: tl.constexpr, S: tl.constexpr, MAG: tl.constexpr):
    """Register of 16-bit float patterns for codes i (low half) and i+4 (high)."""
    return (_shl(w, S - 4 * i) & MAG) | (_shl(w, 12 - 4 * i) & SIGN_MASK)


BF16_PAIR_BITS = tl.constexpr(-2118090304)  # 0x81C081C0 as int32: BF16_MAG | SIGN_MASK


@triton.jit
def _pair_mul(w, w8, i: tl.constexpr):
    """``_pair(w, i, 6, BF16_MAG)`` in three integer operations instead of
    four: the bf16 sign sits 6 bits above the magnitude's top, one bit above it
    in the code, so one multiply by ``2^a + 2^(a + 6)`` of the isolated nibbles
    makes two copies of each (bits a..a+3 and a+6..a+9, no carries: the four
    fields never overlap) and one mask keeps the magnitude of the first and the
    sign of the second. Codes 2, 3 (and 6, 7) need a right shift: they are
    taken as codes 0, 1 of ``w8 = w >> 8``, shared by both pairs."""
    if i < 2:
        t = w & (0x000F000F << (4 * i))
    else:
        t = w8 & (0x000F000F << (4 * (i - 2)))
    j: tl.constexpr = i % 2
    return (t * ((1 << (6 - 4 * j)) + (1 << (12 - 4 * j)))) & BF16_PAIR_BITS


@triton.jit
def _halves(r, DT: tl.constexpr):
    lo = r.to(tl.int16).to(DT, bitcast=True)
    hi = (r >> 16).to(tl.int16).to(DT, bitcast=True)
    return lo, hi


@triton.jit
def decode_word(w, DT: tl.constexpr):
    """int32 words -> eight 16-bit-float tensors (codes 0..7 of each word):
    ``v * 2^-14`` for ``DT = fp16``, ``v * 2^-126`` for ``DT = bf16``."""
    if DT == tl.float16:
        e0, e4 = _halves(_pair(w, 0, 9, FP16_MAG), DT)
        e1, e5 = _halves(_pair(w, 1, 9, FP16_MAG), DT)
        e2, e6 = _halves(_pair(w, 2, 9, FP16_MAG), DT)
        e3, e7 = _halves(_pair(w, 3, 9, FP16_MAG), DT)
    else:
        e0, e4 = _halves(_pair(w, 0, 6, BF16_MAG), DT)
        e1, e5 = _halves(_pair(w, 1, 6, BF16_MAG), DT)
        e2, e6 = _halves(_pair(w, 2, 6, BF16_MAG), DT)
        e3, e7 = _halves(_pair(w, 3, 6, BF16_MAG), DT)
    return e0, e1, e2, e3, e4, e5, e6, e7


@triton.jit
def scale_fp32(bits):
    """E4M3 bytes (uint8/int) -> ``scale * 2^-8`` as fp32 (exact)."""
    return (bits.to(tl.int16) << 7).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _assemble(e0, e1, e2, e3, e4, e5, e6, e7):
    """Eight ``[..., W]`` tensors (code i of each word) -> ``[..., W, 2, 2, 2]``
    whose row-major order is code 0..7 of each word: every ``tl.join`` appends
    the innermost dim, so join the outermost bit of the code index (i // 4) first."""
    return tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))


@triton.jit
def decode_tile(words, sbits, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr,
                BF16_DIRECT: tl.constexpr):
    """``words int32 [BN, BK/8]``, ``sbits [BN, BK/16]`` -> ``v * scale * 2^-c``
    in DT ``[BN, BK]``, K order, exact (c = 14, or 26 with ``BF16_DIRECT``).

    fp16 placement: ``(v * 2^-14) * scale`` in fp16 is exact (its smallest
    value 2^-24 is fp16's smallest subnormal); for bf16 it is then converted
    (exactly). ``BF16_DIRECT`` decodes straight into bf16 (``v * 2^-126``) and
    multiplies by ``scale * 2^100``: one conversion fewer, but it relies on
    bf16 arithmetic keeping the subnormal 2^-127 (code 0.5), which the
    benchmark checks on the GPU (the Triton interpreter flushes it)."""
    w3 = tl.reshape(words, (BLOCK_N, BLOCK_K // 16, 2))
    sf = scale_fp32(sbits)  # scale * 2^-8
    if BF16_DIRECT:
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_word(w3, tl.bfloat16)
        sf = (sf * 3.2451855365842673e32).to(tl.bfloat16)[:, :, None]  # (scale * 2^-8) * 2^108 = scale * 2^100
    else:
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_word(w3, tl.float16)
        sf = (sf * 256.0).to(tl.float16)[:, :, None]  # scale
    full = _assemble(e0 * sf, e1 * sf, e2 * sf, e3 * sf, e4 * sf, e5 * sf, e6 * sf, e7 * sf)
    return tl.reshape(full, (BLOCK_N, BLOCK_K)).to(tl.float32).to(DT)


@triton.jit
def _pow2_over(enc, POW2: tl.constexpr):
    """``POW2 / enc`` for an fp32 scalar ``enc``, correctly rounded."""
    return tl.math.div_rn(enc * 0.0 + POW2, enc)


@triton.jit
def _output_factor(wenc_ptr, xenc_ptr, POW2: tl.constexpr, HAS_XENC: tl.constexpr):
    """``POW2 / (global_enc_w (* global_enc_x))``: one correctly rounded fp32 scalar."""
    enc = tl.load(wenc_ptr)
    if HAS_XENC:
        enc = enc * tl.load(xenc_ptr)
    return _pow2_over(enc, POW2)


@triton.jit
def _output_scale(y, wenc_ptr, xenc_ptr, POW2: tl.constexpr, HAS_XENC: tl.constexpr):
    """``y * POW2 / global_enc_w (/ global_enc_x)`` in fp32: one correctly
    rounded scalar ``POW2 / global_enc`` per program, one multiply per output."""
    return y * _output_factor(wenc_ptr, xenc_ptr, POW2, HAS_XENC)


# --------------------------------------------------------------------------- #
# GEMV: M <= 4, fp32 FMAs on fp16-decoded weights
# --------------------------------------------------------------------------- #
@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, HAS_XENC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, EVEN_K: tl.constexpr,
):
    # Program: BLOCK_N weight rows x all K for one activation row; BLOCK_W
    # words (8 codes each) per step along K. Everything stays 2-D [BN, BW] in
    # one layout (no reshapes): x is loaded per code position j as [BW].
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n = tl.where(n_ok, n, 0).to(tl.int64)  # clamp: loads stay in bounds, the store is masked
    kw = K // 8
    kb = K // 16
    aw = tl.arange(0, BLOCK_W)
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    xrow = x_ptr + row * stride_xm
    for w0 in range(0, kw, BLOCK_W):
        widx = w0 + aw
        if EVEN_K:
            words = tl.load(w_ptr + n[:, None] * kw + widx[None, :])
            sb = tl.load(s_ptr + n[:, None] * kb + (widx // 2)[None, :])
            xs = xrow + widx * 8
            x0 = tl.load(xs).to(tl.float32)
            x1 = tl.load(xs + 1).to(tl.float32)
            x2 = tl.load(xs + 2).to(tl.float32)
            x3 = tl.load(xs + 3).to(tl.float32)
            x4 = tl.load(xs + 4).to(tl.float32)
            x5 = tl.load(xs + 5).to(tl.float32)
            x6 = tl.load(xs + 6).to(tl.float32)
            x7 = tl.load(xs + 7).to(tl.float32)
        else:
            w_ok = widx < kw
            words = tl.load(w_ptr + n[:, None] * kw + widx[None, :], mask=w_ok[None, :], other=0)
            sb = tl.load(s_ptr + n[:, None] * kb + (widx // 2)[None, :], mask=w_ok[None, :], other=0)
            xs = xrow + widx * 8
            x0 = tl.load(xs, mask=w_ok, other=0.0).to(tl.float32)
            x1 = tl.load(xs + 1, mask=w_ok, other=0.0).to(tl.float32)
            x2 = tl.load(xs + 2, mask=w_ok, other=0.0).to(tl.float32)
            x3 = tl.load(xs + 3, mask=w_ok, other=0.0).to(tl.float32)
            x4 = tl.load(xs + 4, mask=w_ok, other=0.0).to(tl.float32)
            x5 = tl.load(xs + 5, mask=w_ok, other=0.0).to(tl.float32)
            x6 = tl.load(xs + 6, mask=w_ok, other=0.0).to(tl.float32)
            x7 = tl.load(xs + 7, mask=w_ok, other=0.0).to(tl.float32)
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_word(words, tl.float16)
        part = e0.to(tl.float32) * x0[None, :]
        part += e1.to(tl.float32) * x1[None, :]
        part += e2.to(tl.float32) * x2[None, :]
        part += e3.to(tl.float32) * x3[None, :]
        part += e4.to(tl.float32) * x4[None, :]
        part += e5.to(tl.float32) * x5[None, :]
        part += e6.to(tl.float32) * x6[None, :]
        part += e7.to(tl.float32) * x7[None, :]
        acc += part * scale_fp32(sb)
    y = tl.sum(acc, axis=1)  # [BN]
    y = _output_scale(y, wenc_ptr, xenc_ptr, 4194304.0, HAS_XENC)  # 2^14 (codes) * 2^8 (scales)
    if HAS_BIAS:
        y += tl.load(bias_ptr + n).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


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
def _gemv_bf16x2_kernel(
    x_ptr, w_ptr, s_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, HAS_XENC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, EVEN_K: tl.constexpr, ALIGNED: tl.constexpr,
    EMULATE: tl.constexpr, X_WORDS: tl.constexpr,
):
    # GEMV v5: v4's tiling with packed bf16x2 math. A word's codes i and i+4
    # decode by bit moves into one register of two bf16 (v * 2^-126, exact:
    # 0.5 is the bf16 subnormal 2^-127); x_i, x_i+4 are packed the same way as
    # bf16(x * 2^64) (exact, no overflow below 2^64); one fma.rn.bf16x2 per two
    # weights accumulates the block's 16 products (v * x * 2^-62, normal) in
    # bf16 (8 a lane), then fp32 takes over: acc += (lane0 + lane1) * scale.
    # The bf16 block sums round at ~2^-9 relative: < 1e-2 on the output.
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n = tl.where(n_ok, n, 0).to(tl.int64)
    kb = K // 16
    if ALIGNED:
        kb = tl.multiple_of(kb, 16)
    ab = tl.arange(0, BLOCK_B)
    acc = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
    xrow = x_ptr + row * stride_xm
    xwords = xrow.to(tl.pointer_type(tl.int64))
    for b0 in range(0, kb, BLOCK_B):
        blk, sb = _load_blocks(w_ptr, s_ptr, n, kb, b0, ab, EVEN_K)
        bidx = tl.where(b0 + ab < kb, b0 + ab, 0)  # x of a masked block is read in bounds, times code 0
        part = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.int32)  # two bf16 zeros
        for h in tl.static_range(2):
            w = (blk >> (32 * h)).to(tl.int32)
            if X_WORDS:
                # x as 8-byte words (4 bf16 each): 4 vector loads per block instead of 16
                # scalar ones, whose lanes 32 bytes apart saturated L1 (ncu: 90.7%).
                xa = tl.load(xwords + bidx * 4 + 2 * h)       # x[16b + 8h + 0..3]
                xb = tl.load(xwords + bidx * 4 + 2 * h + 1)   # x[16b + 8h + 4..7]
            else:
                xs = xrow + bidx * 16 + 8 * h
            for i in tl.static_range(4):
                if X_WORDS:
                    xp = _word_pair(xa, xb, i)
                else:
                    xp = _x_pair(tl.load(xs + i).to(tl.float32), tl.load(xs + i + 4).to(tl.float32))
                part = _bf16x2_fma(_pair(w, i, 6, BF16_MAG), xp[None, :], part, EMULATE)
        acc += _scaled_block_sums(part, sb)
    y = tl.sum(acc, axis=1)
    # acc = sum v * x * scale * 2^-62 * 2^-8
    y = _output_scale(y, wenc_ptr, xenc_ptr, 1.1805916207174113e21, HAS_XENC)  # 2^70
    if HAS_BIAS:
        y += tl.load(bias_ptr + n).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


# --------------------------------------------------------------------------- #
# GEMV v6: x resident in registers, persistent programs over row tiles
# --------------------------------------------------------------------------- #
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
def _x_pairs_from_values(v, KBP: tl.constexpr):
    """``[KBP, 8]`` fp32 (one half of each block, bf16-exact values) -> the four
    bf16x2 pair registers of ``_x_pairs_from_words``."""
    bits = _bf16_bits(v * 18446744073709551616.0) & 0xFFFF
    lo, hi = tl.split(tl.permute(tl.reshape(bits, (KBP, 2, 4)), (0, 2, 1)))  # elements i, i + 4
    packed = tl.reshape(lo | (hi << 16), (KBP, 2, 2))  # [b, u, c]: pair i = 2u + c
    even, odd = tl.split(packed)
    p0, p2 = tl.split(even)
    p1, p3 = tl.split(odd)
    return p0, p1, p2, p3


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
    EMULATE: tl.constexpr, QUANT_X: tl.constexpr, FOUR_SIX: tl.constexpr, SPLIT: tl.constexpr,
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
    # QUANT_X (W4A4): x is quantized here under the static amax at
    # ``xenc_ptr`` (the quantize kernel's code, the same bits) before packing.
    # SPLIT: K is cut into segments of KBP blocks (grid axis 2; the last one
    # masked where K ends unless EVEN_K);
    # each program writes its scaled partial sums to the fp32 workspace at
    # ``y_ptr`` ([segments, M, N]) and ``_gemv_split_finish`` adds them up.
    # PREFETCH: each row tile's weights are loaded one loop step ahead (the
    # first before x is loaded and packed), so a tile's loads are in flight
    # while the previous tile is decoded (the H200 sweep: large layers only).
    # F16 (fp16 x, not QUANT_X): fp16x2 products on each block's x scaled by
    # 2^e (``_x_pairs_f16``), the block sums multiplied back by 2^-e.
    # TRIGGER (SPLIT, split_pdl): the summing pass, a programmatic dependent, may launch now.
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
    if QUANT_X:
        offs = bidx[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
        m3 = b_ok[None, :, None]
        xa = tl.load(xrow + offs, mask=m3, other=0.0).to(tl.float32)      # [1, KBP, 8]
        xb = tl.load(xrow + offs + 8, mask=m3, other=0.0).to(tl.float32)
        x_enc = global_enc_from_amax(tl.load(xenc_ptr), FOUR_SIX)
        ia, ib, scale, _bits, _four = quantize_halves(xa, xb, x_enc, FOUR_SIX)
        va = tl.reshape(signed_scaled(ia, xa, scale), (KBP, 8))
        vb = tl.reshape(signed_scaled(ib, xb, scale), (KBP, 8))
        p00, p01, p02, p03 = _x_pairs_from_values(va, KBP)
        p10, p11, p12, p13 = _x_pairs_from_values(vb, KBP)
        factor = _pow2_over(tl.load(wenc_ptr) * x_enc, 1.1805916207174113e21)  # 2^70 / (enc_w * enc_x)
    elif F16:
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


@triton.jit
def _gemv_split_finish(part_ptr, bias_ptr, y_ptr, M, N, stride_ym, SEGMENTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``y[m, n] = sum_s part[s, m, n] (+ bias)`` in fp32, in segment order, cast to y's dtype. The
    segments are unrolled, so every partial's load is in flight at once (the adds keep their order).
    ``PDL``: launched as a programmatic dependent of the split kernel, so it may be resident before
    that kernel ends; ``griddepcontrol.wait`` holds it until the partials are written and visible."""
    if PDL:
        _gdc_wait()
    row = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SEGMENTS):
        acc += tl.load(part_ptr + (s * M + row) * N + n, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------- #
# Tiled GEMM: tl.dot on exactly decoded bf16/fp16 weight tiles
# --------------------------------------------------------------------------- #
@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, s_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, HAS_XENC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, BF16_DIRECT: tl.constexpr, DOT_FP32: tl.constexpr, SWAP_AB: tl.constexpr,
):
    # SWAP_AB (small M): accumulate y^T = W x^T so the decoded weight tile is
    # the MMA's A operand (registers) and the activations the small B operand.
    pid = tl.program_id(0)
    grid_m = (M + BLOCK_M - 1) // BLOCK_M
    grid_n = (N + BLOCK_N - 1) // BLOCK_N
    # grouped order: GROUP_M row-tiles share each weight tile while it is in L2
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    m_ld = tl.where(m_ok, m, 0).to(tl.int64)
    n_ld = tl.where(n_ok, n, 0).to(tl.int64)
    kw = K // 8
    kb = K // 16
    ak = tl.arange(0, BLOCK_K)
    aw = tl.arange(0, BLOCK_K // 8)
    ab = tl.arange(0, BLOCK_K // 16)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr + m_ld[:, None] * stride_xm + (k0 + ak)[None, :])
            words = tl.load(w_ptr + n_ld[:, None] * kw + (k0 // 8 + aw)[None, :])
            sb = tl.load(s_ptr + n_ld[:, None] * kb + (k0 // 16 + ab)[None, :])
        else:
            x = tl.load(x_ptr + m_ld[:, None] * stride_xm + (k0 + ak)[None, :],
                        mask=(k0 + ak < K)[None, :], other=0.0)
            words = tl.load(w_ptr + n_ld[:, None] * kw + (k0 // 8 + aw)[None, :],
                            mask=(k0 // 8 + aw < kw)[None, :], other=0)
            sb = tl.load(s_ptr + n_ld[:, None] * kb + (k0 // 16 + ab)[None, :],
                         mask=(k0 // 16 + ab < kb)[None, :], other=0)
        wt = decode_tile(words, sb, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty, BF16_DIRECT)
        if DOT_FP32:  # Triton interpreter: its bf16 dot multiplies the raw uint16 patterns
            x = x.to(tl.float32)
            wt = wt.to(tl.float32)
        if SWAP_AB:
            acc = tl.dot(wt, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(wt), acc)
    if SWAP_AB:
        acc = tl.trans(acc)
    if BF16_DIRECT:
        y = _output_scale(acc, wenc_ptr, xenc_ptr, 67108864.0, HAS_XENC)  # 2^26
    else:
        y = _output_scale(acc, wenc_ptr, xenc_ptr, 16384.0, HAS_XENC)  # 2^14
    if HAS_BIAS:
        y += tl.load(bias_ptr + n_ld).to(tl.float32)[None, :]
    ptrs = y_ptr + m_ld[:, None] * stride_ym + n_ld[None, :]
    tl.store(ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------- #
# Dequantize (bit-identical to NVFP4Tensor.dequantize) for the cuBLAS path
# --------------------------------------------------------------------------- #
@triton.jit
def _dequant_kernel(w_ptr, s_ptr, wenc_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                    OUT_BF16: tl.constexpr):
    # out[n, k] = dtype(fp32(v) * (fp32(scale) / global_enc)), exactly as the reference.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    kb = K // 16
    ok = (n < N)[:, None] & (blk < kb)[None, :]
    n64 = n.to(tl.int64)
    widx = tl.program_id(1) * BLOCK_B * 2 + tl.arange(0, BLOCK_B * 2)
    words = tl.load(w_ptr + n64[:, None] * (K // 8) + widx[None, :], mask=(n < N)[:, None] & (widx < K // 8)[None, :],
                    other=0)
    sb = tl.load(s_ptr + n64[:, None] * kb + blk[None, :], mask=ok, other=0)
    step = tl.math.div_rn(scale_fp32(sb) * 256.0, tl.load(wenc_ptr) + tl.zeros((BLOCK_N, BLOCK_B), tl.float32))
    w3 = tl.reshape(words, (BLOCK_N, BLOCK_B, 2))
    e0, e1, e2, e3, e4, e5, e6, e7 = decode_word(w3, tl.float16)
    st = step[:, :, None] * 16384.0  # also undoes the fp16 placement (exact)
    full = _assemble(e0.to(tl.float32) * st, e1.to(tl.float32) * st, e2.to(tl.float32) * st,
                     e3.to(tl.float32) * st, e4.to(tl.float32) * st, e5.to(tl.float32) * st,
                     e6.to(tl.float32) * st, e7.to(tl.float32) * st)
    vals = tl.reshape(full, (BLOCK_N, BLOCK_B * 16))
    k = tl.program_id(1) * BLOCK_B * 16 + tl.arange(0, BLOCK_B * 16)
    optr = out_ptr + n64[:, None] * K + k[None, :]
    omask = (n < N)[:, None] & (k < K)[None, :]
    if OUT_BF16:
        # fp32 -> bf16 round-half-even on the bit pattern (exact everywhere,
        # also under the Triton interpreter whose bf16 cast truncates)
        bits = vals.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(optr, bits.to(tl.int16), mask=omask)
    else:
        tl.store(optr, vals.to(out_ptr.dtype.element_ty), mask=omask)


# --------------------------------------------------------------------------- #
# Host side
# --------------------------------------------------------------------------- #
def _weight_in_place(weight: NVFP4Tensor) -> bool:
    """Whether ``_weight_views`` and the kernels' 16-byte loads use the weight's own codes and scales
    without copying them."""
    packed, scale = weight.packed, weight.block_scale
    return (packed.is_contiguous() and packed.data_ptr() % 16 == 0 and scale.is_contiguous()
            and scale.data_ptr() % 16 == 0)


def _weight_views(weight: NVFP4Tensor):
    n, k = weight.shape[0], weight.shape[-1]
    if len(weight.shape) != 2 or weight.padded_k != k or k % BLOCK_SIZE:
        raise nvfp4.NVFP4Error(
            f"Triton NVFP4 GEMM needs an unpadded 2-D weight with K % 16 == 0; got shape "
            f"{tuple(weight.shape)} (packed K {weight.padded_k})"
        )
    packed = weight.packed.contiguous()
    if packed.data_ptr() % 16:  # e.g. a view into a loaded file: the word views need aligned storage
        packed = packed.clone()
    words = packed.view(torch.int32)  # [N, K/8]: 8 codes a word, K order
    sbits = weight.block_scale.contiguous().view(torch.uint8)  # [N, K/16]
    enc = weight.global_enc.reshape(1).to(torch.float32)
    return n, k, words, sbits, enc


# Shape rules (see benchmarks/NOTES.md, Kernels): the largest M for the GEMV
# (and which GEMV: "gemv6" for bf16 and fp16 activations; with "gemv5", bf16
# only, fp16 takes the fp32 "gemv4"), and the smallest M from which
# dequantize + cuBLAS beats the fused GEMM.
GEMV_MAX_M = int(os.environ.get("FP4PTQ_GEMV_MAX_M", 2))
GEMV_PATH = os.environ.get("FP4PTQ_GEMV_PATH", "gemv6")
# gemv5 reads x as 8-byte words (4 vector loads per 16-code block) rather than 16 scalar loads.
GEMV5_X_WORDS = os.environ.get("FP4PTQ_GEMV5_X_WORDS", "1") == "1"
# register cap of the gemv6 kernel (None: the compiler's; a cap of 64 spilled and ran 1.5-2.5x slower)
GEMV6_MAXNREG = int(os.environ.get("FP4PTQ_GEMV6_MAXNREG", 0)) or None
# W4A4 on the gemv6 path with the activations quantized inside the GEMV (one launch). Off:
# the quantize prologue's registers (143) cost more occupancy than the launch it saves
# (session-4 H200 sweep: 1.1-1.5x slower than the quantize kernel + gemv6 on every shape).
W4A4_FUSED = os.environ.get("FP4PTQ_W4A4_FUSED", "0") == "1"
CUBLAS_MIN_M = int(os.environ.get("FP4PTQ_CUBLAS_MIN_M", 64))
# M in (GEMV_MAX_M, MMA_MAX_M] with bf16/fp16 activations: the Gluon tensor-core kernel (mma.py) on CUDA
# (session-5 H200 sweeps, results/mma_h200_sweep*.json and kernels_h200.md: 1.2-1.9x cuBLAS at M = 16,
# ahead of the tiled GEMM and of dequantize + cuBLAS up to M = 64). 0 turns it off.
MMA_MAX_M = int(os.environ.get("FP4PTQ_MMA_MAX_M", 64))
# The Gluon wgmma kernel (wgmma.py) for 65 <= M <= 128 where wsgemm does not run, W4A16 and W4A4 (session-6 H200 run,
# results/wgmma_h200_v3.json: 1.05-1.37x dequantize + cuBLAS on six Llama-3.1 layers at M = 128, behind it
# from M = 256). FP4PTQ_WGMMA=0 turns it off.
WGMMA = os.environ.get("FP4PTQ_WGMMA", "1") != "0"
# The warp-specialized Gluon kernel (wsgemm.py) from M = 33 where its tiles fill the SMs or its split
# tail does (wsgemm.preferred; results/wsgemm_h200_rule.json, wsgemm_h200_split.json, and at M = 33..128
# with 64- / 128-row tiles ahead of mma.py and wgmma.py, wsgemm_small_m_h200.json). FP4PTQ_WSGEMM=0
# turns it off.
WSGEMM = os.environ.get("FP4PTQ_WSGEMM", "1") != "0"
# The least M it takes (wsgemm.MIN_M, 33, where this is lower): 129 gives mma.py / wgmma.py back M <= 128.
WSGEMM_MIN_M = int(os.environ.get("FP4PTQ_WSGEMM_MIN_M", 0))
CUBLAS_MIN_M_W4A4 = int(os.environ.get("FP4PTQ_CUBLAS_MIN_M_W4A4", 64))
# The W4A4 dequantize + cuBLAS path keeps cuBLAS's fp32 sums until the global scales divide them: an fp32
# [rows, N] product beside the output. Above this many bytes of it the rows go in chunks (whole multiples
# of 128 rows), so a long prefill holds at most this much more memory; 2 GiB leaves every shape timed on
# the H200 in one piece (70B gate_up at M = 8192 is 1.75 GiB, results/w4a4_cublas_h200.json), and a chunk
# then is a GEMM at least that large.
W4A4_CUBLAS_FP32_BYTES = int(os.environ.get("FP4PTQ_W4A4_CUBLAS_FP32_BYTES", 2 << 30))
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read when the kernels are built, as Triton does
# bf16 weights decoded straight into bf16 (see decode_tile; exact on the H200, all codes and
# subnormal scales checked in runs 3-4); never under the interpreter, which flushes bf16 subnormals.
BF16_DIRECT = os.environ.get("FP4PTQ_BF16_DIRECT", "1") == "1" and not INTERPRET


def _gemm_config(m: int, n: int, k: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages[, SWAP_AB]) by
    shape: the best of the H200 sweeps (benchmarks/results/kernels_h200*.json; M <= 16
    from run 4, with BF16_DIRECT)."""
    if m <= 16:
        return (16, 64, 128, 1, 4, 4) if n >= 16384 else (16, 32, 256, 1, 2, 4)
    if m <= 64:
        return 64, 64, 128, 8, 4, 4
    return 128, 128, 128, 8, 8, 3


def _gemv4_config(m: int, n: int, k: int):
    """(BLOCK_N, BLOCK_B, num_warps) of the v4/v5 GEMVs (rows x blocks of 16 a step):
    H200 sweeps (runs 3 and 4), 8 x 128 x 4 warps for N < 16384, 16 x 64 x 2 above."""
    block_n, block_b, warps = (16, 64, 2) if n >= 16384 else (8, 128, 4)
    return block_n, min(block_b, next_pow2(max(1, k // 16))), warps


def _gemv5_config(m: int, n: int, k: int):
    """(BLOCK_N, BLOCK_B, num_warps) of the packed-bf16x2 GEMV. With x read as
    words (``X_WORDS``) 8 rows x 64 blocks x 2 warps won on both gate_up shapes
    of the session-3 H200 sweep (results/gemv5_sweep_xwords_h200.json); below
    N = 16384 (and for scalar x) v4's configs stay: they tie there."""
    if GEMV5_X_WORDS and n >= 16384:
        return 8, min(64, next_pow2(max(1, k // 16))), 2
    return _gemv4_config(m, n, k)


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
    one step ahead on twice those warps (two blocks of a row a thread;
    ``GEMV6_NARROW_AHEAD``), tuned on weights cold in L2, as decoding reads them (session
    20, results/cold_sweep_h200.json, then narrow_ahead_h200.json, interleaved: 8B.qkv
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
    if narrow and GEMV6_NARROW_AHEAD and m == 1:
        return 4, max(1, min(8, kbp // 64)), 4, seg, True
    rows = 4 if split or narrow or n >= 16384 else 8
    return rows, max(1, min(8, kbp // 128)), 16 if split else (4 if narrow else 8), seg, False


# the narrow single-segment layers' gemv6 config loads ahead on more warps ("0": the warm-tuned session-9 config)
GEMV6_NARROW_AHEAD = os.environ.get("FP4PTQ_GEMV6_NARROW_AHEAD", "1") == "1"


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


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a grid-stride loop with more than one program
    return cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


_RESIDENT: dict = {}


def _resident_programs(args, grid, kwargs, device: torch.device, kernel) -> Optional[int]:
    """How many programs of this gemv6 build fit on one SM at once (registers,
    warps, shared memory), read from the compiled kernel; None if unknown.
    Cached per build. The session-4 configs were tuned where the kernel took
    127 registers (8 two-warp programs per SM, Triton 3.6); another compiler
    can allocate differently, and a grid just over a whole wave leaves a
    mostly idle second one (measured: 118 us instead of 81 on 70B.gate_up)."""
    if INTERPRET or device.type != "cuda":
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
    sms = _sm_count(device)
    if GEMV6_WHOLE_WAVES:
        fit = _resident_programs(args, grid, kwargs, device, kernel)
        if fit is not None and per_sm > fit:
            return (per_sm // fit) * fit * sms  # whole waves only
    return per_sm * sms


# gemv6 grids are cut to whole waves of resident programs (off: the configured programs per SM as given)
GEMV6_WHOLE_WAVES = os.environ.get("FP4PTQ_GEMV6_WHOLE_WAVES", "1") == "1"
# the streamed-x GEMV (gemv7) in the gemv6 path: "auto" where measured faster, "1" everywhere, "0" never
GEMV7 = os.environ.get("FP4PTQ_GEMV7", "auto")
if GEMV7 not in ("auto", "0", "1"):
    raise ValueError(f"FP4PTQ_GEMV7={GEMV7!r}: use auto (where measured faster), 1 (always) or 0 (never)")
# the three-operation decode of a code pair (``_pair_mul``); "0" keeps the four-operation one
GEMV6_MULDEC = os.environ.get("FP4PTQ_GEMV6_MULDEC", "1") == "1"


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
                  ALIGNED=k % 256 == 0, EMULATE=INTERPRET, MULDEC=GEMV6_MULDEC, PREFETCH=prefetch,
                  KB_C=_const_kb(n, k, rows), F16=x2.dtype == torch.float16, num_warps=warps)
    programs = _whole_wave_programs(_gemv_stream_kernel, args, (1, m), kwargs, x2.device, per_sm)
    grid = (max(1, min(cdiv(n, rows), programs)), m)
    return Launch(_gemv_stream_kernel, grid, args, slots, kwargs)


# gemv6 / gemv7 built for the layer's K (K/16 a compile-time constant) where N is whole row tiles: a thread's
# rows then sit at constant distances and its loads take immediate offsets (8-10% fewer instructions a
# step, Triton 3.6 SASS); "0": K a runtime argument everywhere (one build for every K)
GEMV_CONST_K = os.environ.get("FP4PTQ_GEMV_CONST_K", "1") == "1"


def _const_kb(n: int, k: int, rows: int) -> int:
    """``KB_C`` of gemv6 / gemv7: K/16 where the build may fix it (N a multiple of ``rows``), else 0."""
    return k // BLOCK_SIZE if GEMV_CONST_K and n % rows == 0 and k % BLOCK_SIZE == 0 else 0


def _gemv6_narrow(n: int, k: int) -> bool:
    """Whether gemv6 runs this layer as narrow single-segment tiles (``_gemv6_config``'s small-layer
    rule: K one segment, at most 8192 rows, under 64M weights)."""
    return n * k < 1 << 26 and n <= 8192 and _gemv6_segment(k, 4096) >= k


# at M = 1, gemv6's narrow single-segment tiles that load nothing ahead (GEMV6_NARROW_AHEAD off) keep the
# run-time-K build
GEMV6_NARROW_RUNTIME_K = True


def _gemv6_kb_c(m: int, n: int, k: int, rows: int, segments: int, prefetch: bool) -> int:
    """``KB_C`` of a gemv6 launch: the constant-K build except, at M = 1, on narrow single-segment layers
    whose tiles load nothing ahead (8B qkv / o: 7.20 -> 7.30 and 5.85 -> 5.93 us with it, interleaved,
    results/gemv_const_k_h200.json; 2-12% faster on the other layers, and at M = 2 on these too:
    11.01 -> 10.68, 8.92 -> 8.51). Since session 20 those tiles load ahead at M = 1
    (``GEMV6_NARROW_AHEAD``), so the exception applies only with that switch off."""
    if GEMV6_NARROW_RUNTIME_K and m == 1 and segments == 1 and not prefetch and _gemv6_narrow(n, k):
        return 0
    return _const_kb(n, k, rows)


# gemv6 / gemv7 address a row's blocks with 32-bit offsets (row * K/16 + block): layers of up to 2^31
# blocks (34 billion weights; the largest LLM layers hold about 2 billion)
GEMV6_MAX_BLOCKS = 1 << 31


def _block_offsets_fit(n: int, k: int) -> bool:
    return n * cdiv(k, BLOCK_SIZE) < GEMV6_MAX_BLOCKS


def _gemv6(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc, *, amax=None,
           four_six=None, slots=(0, 6), dependent=False):
    """The resident-x GEMV's launches (``amax``: quantize x in the kernel, W4A4), K in segments
    (config) through an fp32 workspace and a summing pass: a callable ``run(*tensors) -> y`` taking
    the arguments at ``slots`` (x and y; the activations' global scale too in a W4A4 plan; y last).
    Shapes ``_gemv7_config`` names run the streamed-x GEMV instead (plainly). ``dependent``: the
    GEMV launches as the programmatic dependent of the quantize launch just before it, which
    signalled it (``w4a4_pairs_gemv``; plainly, should the driver refuse that)."""
    if not _block_offsets_fit(n, k):
        raise ValueError(f"gemv6: a {n} x {k} weight has {n * cdiv(k, BLOCK_SIZE)} blocks, more than its "
                         f"32-bit offsets address ({GEMV6_MAX_BLOCKS}); use path 'gemv4' or 'mma'")
    if amax is None:
        cfg7 = _gemv7_config(m, n, k)
        if cfg7 is not None and x2.dtype == torch.float16:
            cfg7 = _gemv7_f16_config(n, k, cfg7)
        if cfg7 is not None:
            return split_run(_gemv7(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc, cfg7,
                                    slots), 1, y, None)
    rows, warps, per_sm, seg, prefetch = _gemv6_config(m, n, k)
    if seg % 16:
        raise ValueError(f"gemv6: K segment {seg} is not a whole number of 16-blocks")
    segments = cdiv(k, seg)
    kbp = next_pow2(max(1, seg // 16))
    if segments > 1 and kbp != seg // 16:
        raise ValueError(f"gemv6: a K segment ({seg}) must be a power-of-two number of blocks")
    tiles = cdiv(n, rows)
    quant = amax is not None
    split = segments > 1
    target = split_workspace(segments, y)
    args = (x2, words.view(torch.int64), sbits, enc, amax if quant else xenc_arg, bias_arg, target, m, n, k,
            x2.stride(0), y.stride(0))
    kwargs = dict(HAS_BIAS=has_bias, HAS_XENC=x_enc is not None or quant, ROWS=rows, KBP=kbp,
                  EVEN_K=kbp * segments == k // 16, ALIGNED=k % 256 == 0, EMULATE=INTERPRET, QUANT_X=quant,
                  FOUR_SIX=quantize_kernel.FOUR_SIX_CODES[four_six], SPLIT=split, num_warps=warps,
                  enable_fp_fusion=not quant, PREFETCH=prefetch, MULDEC=_gemv6_muldec(n, k),
                  KB_C=_gemv6_kb_c(m, n, k, rows, segments, prefetch), F16=x2.dtype == torch.float16 and not quant,
                  TRIGGER=split and split_pdl(x2.device))
    if dependent:
        kwargs.update(WAIT=True, launch_pdl=True)
    if GEMV6_MAXNREG and not INTERPRET:
        kwargs["maxnreg"] = GEMV6_MAXNREG
    programs = _whole_wave_programs(_gemv_resident_kernel, args, (1, m, segments), kwargs, x2.device, per_sm)
    grid = (max(1, min(tiles, cdiv(programs, segments))), m, segments)
    launch = Launch(_gemv_resident_kernel, grid, args, slots, kwargs)
    run = split_run(launch, segments, y, bias_arg if has_bias else None, kwargs["TRIGGER"])
    if not dependent:
        return run
    return dependent_or_plain(run, lambda: _gemv6(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias,
                                                  x_enc, amax=amax, four_six=four_six, slots=slots),
                              x2.device, "gemv6 after the quantize launch")


# The summing pass of a K split launches as a programmatic dependent of the split kernel (sm_90 on)
# where that kernel is mma.py's or gemv6's: they signal ``griddepcontrol.launch_dependents`` as they
# start, so the pass is resident before they end and waits in ``griddepcontrol.wait`` for the
# partials. Likewise W4A4's mma.py launch after the activations' quantize launch (``w4a4_pdl``): the
# quantize kernel signals as it starts and mma.py copies its first weight steps before it waits.
# A dependent is only ever paired with the launch just before it, which is ours and writes nothing
# the dependent reads before its wait; every other launch keeps the plain stream order (session 7
# measured PDL on the GEMVs themselves and removed it). A pass whose split kernel does not signal
# (wgmma.py, wsgemm.py) gains nothing from it (H200, session 24) and launches plainly. Where the
# driver refuses a dependent launch, the plain launch takes the call and none is tried again on that
# GPU (``dependent_or_plain``).
SPLIT_PDL = os.environ.get("FP4PTQ_SPLIT_PDL", "1") == "1"
W4A4_PDL = os.environ.get("FP4PTQ_W4A4_PDL", "1") == "1"
_PDL_FAILED: dict = {}  # device index -> why a dependent launch failed there (no more are tried)


def _pdl_possible(device: torch.device) -> bool:
    """Whether launches on ``device`` may be programmatic dependents: an NVIDIA GPU of sm_90 or later,
    a Triton with griddepcontrol, not the interpreter, and no dependent launch refused there yet."""
    if INTERPRET or _gdc_wait is None or device.type != "cuda" or torch.version.hip:
        return False
    if _device_index(device) in _PDL_FAILED:
        return False
    return _capability(device) >= (9, 0)


def split_pdl(device: torch.device) -> bool:
    """Whether a split kernel on ``device`` signals its summing pass and the pass launches as its
    programmatic dependent (``FP4PTQ_SPLIT_PDL`` and ``_pdl_possible``)."""
    return SPLIT_PDL and _pdl_possible(device)


def w4a4_pdl(device: torch.device) -> bool:
    """Whether W4A4's activation quantize launch may signal mma.py, which then launches as its
    programmatic dependent (``FP4PTQ_W4A4_PDL`` and ``_pdl_possible``; ``w4a4_pairs`` decides per shape)."""
    return W4A4_PDL and _pdl_possible(device)


def w4a4_pairs(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether W4A4's mma.py launch for M rows of an [N, K] weight is the programmatic dependent of its
    quantize launch: ``w4a4_pdl``, and mma.py's grid (``mma.config``) is one where that measured faster.
    An empirical rule (H200, session 25, results/w4a4_pdl_h200_v*.json, plain -> dependent, us):
    grids of at most about one program an SM gained (Qwen2-7B qkv at M = 16, 144 programs: 12.91 ->
    12.19; 8B k at M = 32, 128: 9.81 -> 9.31; SmolLM2 qkv, 15: 6.96 -> 6.16), so did programs of at most
    4 K steps (Qwen2-7B o, 392 programs: 10.76 -> 9.70; Phi-3-mini o, 288: 9.84 -> 8.71) and grids whose
    warps fill the SMs (70B gate_up, 448 programs of 4 warps: 127.6 -> 123.1; 70B down, 512: -0.5 to
    -0.8); grids of 224-384 programs of 8-16 steps lost up to 41% (8B down at M = 16: 21.7 -> 30.6; 8B o
    10.5 -> 11.8; Gemma-2-9B o 10.5 -> 11.7) and stay plain. The likely cause (v6): the early-launched
    programs are placed unevenly while the quantize programs still hold the SMs; with at most a fair
    share of programs fitting an SM the dependent launch was faster on those grids too."""
    if not w4a4_pdl(device):
        return False
    from . import mma

    sms = _sm_count(device)
    bn, _, bk, warps, k_split, _ = mma.config(m, n, k, sms)
    programs = cdiv(n, bn) * cdiv(k, k_split)  # (mma.programs)
    # at most 1.1 programs an SM, at most 4 K steps a program, or at least 13 warps an SM (of the 16 the
    # 128-register builds can hold)
    return programs * 10 <= sms * 11 or k_split // bk <= 4 or programs * warps >= sms * 13


# W4A4 at M = 1-2: the resident-x GEMV (gemv6) as the quantize launch's programmatic dependent, its first
# row tile's weights loaded before the wait (``w4a4_pairs_gemv``; "0" launches it plainly).
W4A4_PDL_GEMV = os.environ.get("FP4PTQ_W4A4_PDL_GEMV", "1") == "1"


def w4a4_pairs_gemv(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether W4A4's gemv6 launch for M rows of an [N, K] weight is the programmatic dependent of its
    quantize launch: ``FP4PTQ_W4A4_PDL_GEMV`` and ``w4a4_pdl``, on layers under 64M weights (gemv6's
    small-layer configs), not where the streamed-x GEMV (gemv7) runs. H200, session 25
    (results/w4a4_pdl_h200_v7.json, plain -> dependent, us): M = 1 8B qkv 8.89 -> 8.55, 8B o 7.71 ->
    7.31, Qwen2-7B o 7.48 -> 7.08, Phi-3-mini o (K split) 7.55 -> 7.27, fp16 + mse + bias 8B qkv 9.54 ->
    8.90; M = 2 8B qkv 12.57 -> 11.99, 8B o 10.48 -> 9.88; on the 64M-weight configs level or slower
    (8B gate_up 23.30 -> 23.19, 70B gate_up 72.64 -> 73.51), so those stay plain."""
    return W4A4_PDL_GEMV and n * k < 1 << 26 and w4a4_pdl(device) and _gemv7_config(m, n, k) is None


def _w4a4_pairs_path(path: str, m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether W4A4's GEMM on ``path`` is its quantize launch's programmatic dependent (the dispatch's
    and the plans' one decision): mma.py by ``w4a4_pairs``, gemv6 by ``w4a4_pairs_gemv``."""
    if path == "mma":
        return w4a4_pairs(m, n, k, device)
    return path == "gemv6" and w4a4_pairs_gemv(m, n, k, device)


def _device_index(device: torch.device) -> int:
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else current_device()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def dependent_or_plain(dependent, plain, device: torch.device, what: str):
    """``call(*args)``: ``dependent(*args)`` (a programmatic dependent launch) while such launches work
    on ``device``, else ``plain(*args)`` (the same work launched plainly; a callable, or a function
    of no arguments that builds it, called once). If the dependent launch raises and the plain one
    then succeeds, the driver refused the dependent launch: a warning names the error, and no
    dependent launch is tried on that GPU again. If the plain one raises too, its error propagates
    (the fault was not the dependent launch's). Inside a CUDA graph capture a failed launch has
    already invalidated the capture: dependent launches are switched off on that GPU and the error
    says to capture again (the next capture launches plainly)."""
    index = _device_index(device)
    built = []

    def run_plain(*args):
        if not built:
            built.append(plain())
        return built[0](*args)

    def call(*args):
        if index in _PDL_FAILED:
            return run_plain(*args)
        try:
            return dependent(*args)
        except Exception as exc:  # noqa: BLE001 - e.g. a driver without programmatic dependent launch
            if _capturing():
                _PDL_FAILED[index] = f"{what}, inside a CUDA graph capture: {exc!r}"[:300]
                raise RuntimeError(f"fp4ptq: a programmatic dependent launch failed inside a CUDA graph capture "
                                   f"({_PDL_FAILED[index]}); such launches are off on cuda:{index} from now on: "
                                   "capture again") from exc
            result = run_plain(*args)
            if index not in _PDL_FAILED:
                _PDL_FAILED[index] = f"{what}: {exc!r}"[:300]
                warnings.warn(f"fp4ptq: programmatic dependent launches are not used on cuda:{index} any more "
                              f"({_PDL_FAILED[index]}); the plain launches take their calls", stacklevel=2)
            return result
    return call


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple:
    return _capability_of(device.index if device.index is not None else current_device())


def split_workspace(splits: int, y: torch.Tensor) -> torch.Tensor:
    """Where a split-K launch writes: fp32 partial sums ``[splits, M, N]`` when K is
    split, ``y`` itself otherwise."""
    m, n = y.shape
    return torch.empty(splits, m, n, dtype=torch.float32, device=y.device) if splits > 1 else y


def split_finish(splits: int, y: torch.Tensor, bias: Optional[torch.Tensor], dependent: bool = False):
    """The summing pass of a split-K launch as a callable ``finish(target, y)``: ``y = sum of the
    ``split_workspace``'s partial sums in split order (+ bias)``; ``dependent``: launched as a
    programmatic dependent of the split kernel, which signals it (``split_pdl``)."""
    m, n = y.shape
    block = 1024
    pdl = bool(dependent)
    launch = Launch(_gemv_split_finish, (cdiv(n, block), m), (None, bias, None, m, n, y.stride(0)),
                    (0, 1, 2) if bias is None else (0, 2),
                    dict(SEGMENTS=splits, HAS_BIAS=bias is not None, BLOCK=block, PDL=pdl, launch_pdl=pdl, num_warps=4))
    if bias is not None:
        return launch

    def finish(target, y):
        launch(target, y, y)  # (no bias: y stands in for its pointer)
    return finish


def split_run(launch: Launch, splits: int, y: torch.Tensor, bias: Optional[torch.Tensor], dependent: bool = False):
    """``run(*tensors) -> y`` of a ``launch`` whose last slot is its output (y last among the tensors):
    written into y directly, or, K split, into a fresh ``split_workspace`` summed into y (+ bias);
    ``dependent``: the launch signals the summing pass, which launches as its programmatic dependent
    (plainly, should the driver refuse that: ``dependent_or_plain``)."""
    if splits == 1:
        def run(*tensors):
            launch(*tensors)
            return tensors[-1]
        return run
    finish = split_finish(splits, y, bias, dependent)
    if dependent:
        finish = dependent_or_plain(finish, lambda: split_finish(splits, y, bias), y.device, "the split-K summing pass")

    def run_split(*tensors):
        y = tensors[-1]
        target = split_workspace(splits, y)
        launch(*tensors[:-1], target)
        finish(target, y)
        return y
    return run_split


def _gemv_config(m: int, n: int, k: int):
    """(BLOCK_N, BLOCK_W, num_warps): one-warp programs of 4 rows for wide
    layers, 4-warp programs of 16 rows for narrow ones (H200 sweeps)."""
    block_w = min(64, next_pow2(max(1, k // 8)))
    return (4, block_w, 1) if n > 4096 else (16, block_w, 4)


def dequantize(weight: NVFP4Tensor, dtype: torch.dtype, *, unit_global: bool = False) -> torch.Tensor:
    """Triton twin of ``weight.dequantize(dtype)`` (bit-identical) for 2-D
    weights; ``unit_global=True`` leaves out ``1/global_enc``: ``v * scale``, exact."""
    n, k, words, sbits, enc = _weight_views(weight)
    if unit_global:
        enc = torch.ones_like(enc)
    out = torch.empty(n, k, dtype=dtype, device=words.device)
    block_n, block_b = 32, min(16, next_pow2(max(1, k // 16)))
    grid = (cdiv(n, block_n), cdiv(k // 16, block_b))
    if n and k:
        _dequant_kernel[grid](words, sbits, enc, out.view(torch.int16) if dtype == torch.bfloat16 else out, n, k,
                              BLOCK_N=block_n, BLOCK_B=block_b, OUT_BF16=dtype == torch.bfloat16, num_warps=4,
                              enable_fp_fusion=False)
    return out


def mma_unavailable_reason(m: int, k: int, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why the Gluon tensor-core kernel (path "mma") cannot take this input (None when it can)."""
    if INTERPRET or device.type != "cuda":
        return "the mma path is a Gluon kernel: CUDA only, the Triton interpreter cannot run it"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the mma path takes bf16 or fp16 activations, got {dtype}"
    if not 0 < m <= 64 or k % 64:
        return f"the mma path takes 1 <= M <= 64 rows and K % 64 == 0, got M={m}, K={k}"
    try:
        from . import mma
    except Exception as exc:  # noqa: BLE001 - Gluon missing or changed in this Triton
        return f"Triton's Gluon dialect is not usable here ({exc})"
    return mma.ready(device)  # the GPU's support (sm_80 on, bf16 and fp16), compile and self-test: once a device


# K multiple each sm_90 Gluon kernel takes: wgmma.py's K steps go in pairs of 64; wsgemm.py's steps are 64
# (its scale bytes come by TMA from rows padded to 16-byte strides where K % 256 != 0: wsgemm.tma_scales)
_GLUON_SM90_K = {"wgmma": 128, "wsgemm": 64}


def _gluon_sm90_reason(path: str, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why the sm_90 Gluon kernel of ``path`` ("wgmma": wgmma.py, "wsgemm": wsgemm.py) cannot take
    this input (None when it can): CUDA, bf16/fp16 activations, its K multiple, then the module's
    ``ready`` (sm_90, compile and self-test: decided once per device)."""
    if INTERPRET or device.type != "cuda":
        return f"the {path} path is a Gluon kernel: CUDA only, the Triton interpreter cannot run it"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the {path} path takes bf16 or fp16 activations, got {dtype}"
    if m <= 0 or n <= 0 or k % _GLUON_SM90_K[path]:
        return f"the {path} path takes K % {_GLUON_SM90_K[path]} == 0, got M={m}, N={n}, K={k}"
    try:
        module = importlib.import_module(f".{path}", __package__)
    except Exception as exc:  # noqa: BLE001 - Gluon missing or changed in this Triton
        return f"Triton's Gluon dialect is not usable here ({exc})"
    return module.ready(device)


def wgmma_unavailable_reason(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why the Gluon wgmma kernel (path "wgmma") cannot take this input (None when it can)."""
    return _gluon_sm90_reason("wgmma", m, n, k, dtype, device)


def wsgemm_unavailable_reason(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why the warp-specialized Gluon kernel (path "wsgemm") cannot take this input (None when it can)."""
    return _gluon_sm90_reason("wsgemm", m, n, k, dtype, device)


def gemv_bf16_reason(device: Optional[torch.device]) -> Optional[str]:
    """Why the GEMVs cannot take bf16 activations on ``device`` (None when they can): their block sums
    (and W4A4's quantization inside gemv6, whose operand is bf16 pairs whatever x's dtype) are
    ``fma.rn.bf16x2``, which PTX has from sm_80; below it (T4, RTX 20: sm_75) the dispatch gives those
    calls to the tiled GEMM (M <= 2), and W4A4 quantizes in its own launch."""
    if device is None or device.type != "cuda" or INTERPRET or torch.version.hip:
        return None
    major, minor = _capability(device)
    if (major, minor) < (8, 0):
        return f"the GEMVs' bf16 arithmetic (fma.rn.bf16x2) needs sm_80 or later; this GPU is sm_{major}{minor}"
    return None


def _auto_path(m: int, dtype: torch.dtype, w4a4: bool, k: int = 0, device: Optional[torch.device] = None,
               n: int = 0) -> str:
    """The path the shape rules pick for M rows of ``dtype`` activations (N, K, device: for "mma").
    "mma" also takes M = 2 on layers of 4M weights and more (session-5 H200 runs: bf16 70B.gate_up
    120 us against gemv6's 152, results/mma_h200_m2.json; session 7, results/m2_small_h200.json,
    interleaved: 8B.o 9.2 against gemv6's 10.4 (bf16) and gemv4's 13.4 (fp16), Phi-3-mini o (9.4M)
    8.3 against 9.5; SmolLM2's 0.6-1.8M-weight layers keep the GEMV), except bf16 on the layers
    ``_gemv6_narrow`` names, where the constant-K gemv6 came out ahead (session 14,
    results/m2_constk_h200.json: 8B.o 8.47 against 9.40, 8B.qkv 10.68 / 11.94, Gemma-2-9B o 8.20 /
    9.15, Qwen2-7B qkv 10.78 / 11.24, Qwen2-7B o 8.87 / 8.99; mma.py still ahead on the split-K,
    streamed and wide layers: 8B.down 16.84 / 18.25, Phi-3-mini o 8.29 / 9.13). Since the summing
    pass became its split kernel's programmatic dependent (session 24, results/split_rules_h200*.json,
    interleaved), bf16 W4A16 at M = 2 takes mma.py on the narrow layers too (gemv6 / mma.py: 8B o 8.52 /
    8.41, Gemma-2-9B o 8.26 / 8.09, Qwen2-7B qkv 10.79 / 10.20, Qwen2-7B o 8.93 / 8.34, 8B qkv 10.63 /
    10.79; mma.py's fp32 products also land 2x closer to the exact product), while fp16 (gemv6 ahead
    0.5-6%) and W4A4 (mixed, -4% to +5%) keep gemv6 there. fp16 takes the same
    paths as bf16 otherwise (session 21, results/gemv_fp16_h200.json: gemv6 / gemv7 1.27-1.69x the paths fp16
    took before at M = 1, 1.12-1.21x mma.py at M = 2 on the narrow layers); where ``GEMV_PATH`` is
    "gemv5" (bf16 only) fp16 keeps gemv4, and mma.py at M = 1 on layers of more than 6144 x 4096
    (70B.gate_up 126 us against gemv4's 146)."""
    def mma_ok() -> bool:  # asked only where mma would be picked (its first use runs the self-test)
        return device is not None and MMA_MAX_M >= m and mma_unavailable_reason(m, k, dtype, device) is None

    def sm90_ok(path: str, enabled: bool, preferred) -> bool:  # its measured rows first: the guard
        if not enabled or device is None or device.type != "cuda" or INTERPRET:  # runs the self-test
            return False
        try:
            module = importlib.import_module(f".{path}", __package__)
        except Exception:  # noqa: BLE001 - Gluon missing or changed in this Triton (the guard says so)
            return False
        return preferred(module) and _gluon_sm90_reason(path, m, n, k, dtype, device) is None

    if m <= GEMV_MAX_M:
        if dtype == torch.bfloat16 and gemv_bf16_reason(device) is not None:
            return "gemm"  # (sm_75)
        gemv = GEMV_PATH if dtype == torch.bfloat16 or GEMV_PATH in ("gemv", "gemv6") else "gemv4"
        if gemv == "gemv6" and not _block_offsets_fit(n, k):
            gemv = "gemv4"
        # M = 2 on gemv6's narrow layers: bf16 W4A16 takes mma.py since its summing pass became a
        # programmatic dependent (session 24); fp16 and W4A4 keep the GEMV
        narrow_gemv = gemv == "gemv6" and _gemv6_narrow(n, k) and (dtype != torch.bfloat16 or w4a4)
        m2_mma = m == 2 and n * k >= 1 << 22 and not narrow_gemv
        if (m2_mma or (gemv == "gemv4" and n * k > 6144 * 4096)) and mma_ok():
            return "mma"
        return gemv
    # wsgemm first where its rule admits the shape (M = 33..64 with its 64-row tile ahead of mma.py,
    # 65..128 with its 128-row tile ahead of wgmma.py: results/wsgemm_small_m_h200.json)
    if sm90_ok("wsgemm", WSGEMM,  # (the SM count asked only for its rows)
               lambda mod: max(mod.MIN_M, WSGEMM_MIN_M) <= m and mod.supports(m, n, k)
               and mod.preferred(m, n, k, _sm_count(device), w4a4)):
        return "wsgemm"
    if mma_ok():
        return "mma"
    if sm90_ok("wgmma", WGMMA, lambda mod: mod.preferred(m, n, k)):
        return "wgmma"
    return "cublas" if m >= (CUBLAS_MIN_M_W4A4 if w4a4 else CUBLAS_MIN_M) else "gemm"


_MM_OUT_DTYPE: Optional[bool] = None  # whether torch.mm takes out_dtype on CUDA (torch 2.8+): found once


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 16-bit operands as fp32: cuBLAS's fp32 sums returned unrounded (``out_dtype``, torch
    2.8+ on CUDA); elsewhere the operands are widened (exact) and multiplied in fp32. Whether ``out_dtype``
    is there is asked once; a failure of the product itself (out of memory) is raised, not hidden."""
    global _MM_OUT_DTYPE
    if a.is_cuda and _MM_OUT_DTYPE is not False:
        if _MM_OUT_DTYPE:
            return torch.mm(a, b, out_dtype=torch.float32)
        try:
            y = torch.mm(a, b, out_dtype=torch.float32)
        except torch.cuda.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError, NotImplementedError):  # no such argument, or not for these dtypes
            _MM_OUT_DTYPE = False
        else:
            _MM_OUT_DTYPE = True
            return y
    return torch.mm(a.float(), b.float())


def _row_chunks(m: int, n: int) -> list:
    """Row ranges of an ``[m, n]`` fp32 product of at most ``W4A4_CUBLAS_FP32_BYTES`` each (whole multiples
    of 128 rows, at least 128 a range; one range where it fits)."""
    rows = max(128, W4A4_CUBLAS_FP32_BYTES // (4 * max(n, 1)) // 128 * 128)
    return [(r, min(r + rows, m)) for r in range(0, m, rows)] if m > rows else [(0, m)]


def _matmul(x2: torch.Tensor, weight: NVFP4Tensor, bias, x_enc=None, *, path: Optional[str] = None,
            out: Optional[torch.Tensor] = None, amax: Optional[torch.Tensor] = None,
            four_six: Optional[str] = None, picked: bool = False, dependent: bool = False):
    """``x2 [M, K] @ dequant(weight).T`` (/ x_enc) + bias -> [M, N] in x2's dtype
    (written into ``out`` when given: tests poison it first). ``amax`` (path
    "gemv6" only): x is raw and quantized inside the GEMV (W4A4, ``four_six``).
    ``dependent`` (paths "mma" and "gemv6"): launched as the programmatic dependent of the quantize
    launch just before, which signalled it (``linear_w4a4``: ``w4a4_pairs``, ``w4a4_pairs_gemv``)."""
    n, k, words, sbits, enc = _weight_views(weight)
    m = x2.shape[0]
    if x2.shape[1] != k:
        raise ValueError(f"activation has K={x2.shape[1]}, the NVFP4 weight {tuple(weight.shape)} needs {k}")
    if x2.dtype not in (torch.bfloat16, torch.float16):
        raise nvfp4.NVFP4Error(f"Triton NVFP4 GEMM takes bf16/fp16 activations, got {x2.dtype}")
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    auto = path is None or picked  # picked: the caller's shape rules chose ``path``
    if path is None:
        path = _auto_path(m, x2.dtype, x_enc is not None, k, x2.device, n)
    if amax is not None and path != "gemv6":
        raise ValueError(f"quantizing activations inside the GEMM is the gemv6 path's, not {path!r}'s")
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device) if out is None else out
    if y.shape != (m, n) or y.dtype != x2.dtype or y.stride(1) != 1:
        raise ValueError(f"out must be a [{m}, {n}] {x2.dtype} tensor with unit last stride")
    if m == 0 or n == 0:
        return y
    has_bias = bias is not None
    bias_arg = bias.contiguous() if has_bias else enc
    xenc_arg = x_enc.reshape(1) if x_enc is not None else enc
    if path == "cublas":
        if x_enc is None:
            # exactly the reference: F.linear on the bit-identical dequantized weight
            w = dequantize(weight, x2.dtype)
            if has_bias:  # (a bias of another dtype, e.g. an fp32 layer's under autocast, in x's as addmm needs)
                return torch.addmm(bias.to(x2.dtype), x2, w.t(), out=y)
            return torch.mm(x2, w.t(), out=y)
        # W4A4: exact v*scale operands (bf16 holds them exactly for fp16 activations too), fp32
        # sums in cuBLAS kept in fp32, divided by global_w * global_x in fp32, then rounded once into
        # x's dtype, as the reference: no fp16 overflow (a product reaches (6 * 448)^2) and no
        # rounding of the product to 16 bits before the global scales (which moved about a
        # quarter of the outputs by one unit and SmolLM2's W4A4 perplexity by 0.2%)
        factor = torch.reciprocal(enc * x_enc.reshape(1))  # fp32, computed in fp32
        wt = dequantize(weight, torch.bfloat16, unit_global=True).t()
        xb = x2.to(torch.bfloat16)
        for r0, r1 in _row_chunks(m, n):
            torch.mul(_mm_fp32(xb[r0:r1], wt), factor, out=y[r0:r1])
        return y.add_(bias) if has_bias else y
    if path == "dot_scaled":  # FP4 tensor cores (sm_100+); bf16/fp16 x here, NVFP4 x from linear_w4a4
        from . import dot_scaled  # (it imports this module's output scaling)

        if x_enc is not None:
            raise ValueError("the dot_scaled path takes W4A4 activations as codes + scales (linear_w4a4)")
        return dot_scaled.matmul(x2, None, None, weight, bias, x2.dtype, out=y)
    if path == "mma":
        if not auto:  # the shape rules only pick it where it can run
            reason = mma_unavailable_reason(m, k, x2.dtype, x2.device)
            if reason is not None:
                raise ValueError(reason)
        from . import mma

        try:
            return mma.matmul(x2, words, sbits, enc, x_enc.reshape(1) if x_enc is not None else None,
                              bias_arg if has_bias else None, y, dependent=dependent)
        except Exception as exc:  # noqa: BLE001 - e.g. a config its self-test did not build
            if not auto:
                raise
            mma.disable(x2.device, f"failed at M={m}, N={n}, K={k}: {exc!r}"[:300])
            path = "gemm"  # the tiled GEMM takes every shape
    if path in _GLUON_SM90_K:  # "wgmma" (65 <= M <= 128), "wsgemm" (the warp-specialized GEMM)
        if not auto:
            reason = _gluon_sm90_reason(path, m, n, k, x2.dtype, x2.device)
            if reason is not None:
                raise ValueError(reason)
        module = importlib.import_module(f".{path}", __package__)
        owner = dict(scale_owner=weight.block_scale) if path == "wsgemm" else {}
        try:
            return module.matmul(x2, words, sbits, enc, x_enc, bias_arg if has_bias else None, y, **owner)
        except Exception as exc:  # noqa: BLE001 - e.g. a config its self-test did not build
            if not auto:
                raise
            module.disable(x2.device, f"failed at M={m}, N={n}, K={k}: {exc!r}"[:300])
            return _matmul(x2, weight, bias, x_enc, path="cublas", out=y)  # what M > 64 took before
    if path in ("gemv6", "gemv5") and (x2.dtype == torch.bfloat16 or amax is not None):
        reason = gemv_bf16_reason(x2.device)
        if reason is not None:  # (the shape rules send these calls to the tiled GEMM there)
            raise ValueError(f"path {path!r}: {reason}")
    if path == "gemv6":
        if amax is None:
            if x2.data_ptr() % 8 or x2.stride(0) % 4:  # x is read as 8-byte words
                x2 = x2.clone(memory_format=torch.contiguous_format)
        return _gemv6(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc, amax=amax,
                      four_six=four_six, dependent=dependent and amax is None)(x2, y)
    if path in ("gemv4", "gemv5"):
        block_n, block_b, warps = (_gemv4_config if path == "gemv4" else _gemv5_config)(m, n, k)
        kern = _gemv_blocks_kernel if path == "gemv4" else _gemv_bf16x2_kernel
        extra = {} if path == "gemv4" else {
            "EMULATE": INTERPRET,
            # x read as 8-byte words of bf16 bit patterns: bf16 x with 8-byte aligned rows
            "X_WORDS": (GEMV5_X_WORDS and x2.dtype == torch.bfloat16 and x2.data_ptr() % 8 == 0
                        and x2.stride(0) % 4 == 0),
        }
        kern[(cdiv(n, block_n), m)](
            x2, words.view(torch.int64), sbits, enc, xenc_arg, bias_arg, y, m, n, k,  # [N, K/16] blocks
            x2.stride(0), y.stride(0), HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, BLOCK_N=block_n,
            BLOCK_B=block_b, EVEN_K=(k // 16) % block_b == 0, ALIGNED=k % 256 == 0, num_warps=warps, **extra,
        )
        return y
    if path == "gemv":
        block_n, block_w, warps = _gemv_config(m, n, k)
        grid = (cdiv(n, block_n), m)
        _gemv_kernel[grid](
            x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, x2.stride(0), y.stride(0),
            HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, BLOCK_N=block_n, BLOCK_W=block_w,
            EVEN_K=(k // 8) % block_w == 0, num_warps=warps,
        )
        return y
    if path != "gemm":
        raise ValueError(f"unknown GEMM path {path!r}")
    bm, bn, bk, group, warps, stages, *rest = _gemm_config(m, n, k)
    swap = bool(rest and rest[0])
    grid = (cdiv(m, bm) * cdiv(n, bn),)
    _gemm_kernel[grid](
        x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, x2.stride(0), y.stride(0),
        HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
        EVEN_K=k % bk == 0, BF16_DIRECT=BF16_DIRECT and x2.dtype == torch.bfloat16,
        DOT_FP32=INTERPRET and x2.dtype == torch.bfloat16, SWAP_AB=swap,
        num_warps=warps, num_stages=stages,
    )
    return y


def _check_operands(x: torch.Tensor, weight: NVFP4Tensor, bias: Optional[torch.Tensor]) -> None:
    """The kernels read every operand where x is: a weight or bias elsewhere (another GPU, the CPU) would be
    read through a pointer of the wrong device, so it is refused with the devices named; so is a bias that is
    not N values (they read N from its pointer)."""
    where = x.device
    for name, t in (("weight", weight.packed), ("block scales", weight.block_scale), ("global scale", weight.global_enc),
                    ("bias", bias)):
        if t is not None and t.device != where:
            raise ValueError(f"NVFP4 layer: the activations are on {where}, its {name} on {t.device}; "
                             f"move them to one device")
    if bias is not None and bias.shape != (weight.shape[0],):  # (the kernels read N values from its pointer)
        raise ValueError(f"NVFP4 layer: a bias of shape {tuple(bias.shape)} for {weight.shape[0]} outputs")


def linear_w4a16(x: torch.Tensor, weight: NVFP4Tensor, bias: Optional[torch.Tensor] = None, *,
                 path: Optional[str] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [..., K] @ dequant(weight).T + bias`` in x's dtype (bf16/fp16).
    ``path``: None (by shape), "gemv", "gemv4", "gemv5", "gemv6", "mma", "wgmma", "wsgemm", "gemm",
    "cublas" or "dot_scaled" (FP4 tensor cores, sm_100+); ``out``: [M, N]."""
    _check_operands(x, weight, bias)
    lead = x.shape[:-1]
    y = _matmul(x.reshape(-1, x.shape[-1]), weight, bias, path=path, out=out)
    return y.reshape(*lead, y.shape[-1])


def linear_w4a4(x: torch.Tensor, weight: NVFP4Tensor, input_amax: torch.Tensor, bias: Optional[torch.Tensor] = None,
                *, four_six: Optional[str] = None, path: Optional[str] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W4A4: quantize ``x`` under the static ``input_amax`` (+ Four Over Six) to
    ``v * scale`` (exact, x's dtype), then the W4A16 GEMM divides the fp32
    result by both global scales: exact NVFP4 x NVFP4 products, fp32 sums."""
    from . import dot_scaled  # (it imports this module's output scaling)

    _check_operands(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not torch.is_tensor(input_amax):
        input_amax = torch.tensor(float(input_amax))
    input_amax = input_amax.to(device=x.device, dtype=torch.float32)
    if four_six not in quantize_kernel.FOUR_SIX_CODES:
        raise nvfp4.NVFP4Error(f"unknown Four Over Six rule {four_six!r}; choose one of {nvfp4.FOUR_SIX_RULES}")
    requested = path
    if path is None:
        path = _auto_path(x2.shape[0], x2.dtype, True, x2.shape[-1], x2.device, weight.shape[0])
        if (W4A4_FUSED and path != "gemv6" and x2.shape[0] <= GEMV_MAX_M and GEMV_PATH == "gemv6"
                and _block_offsets_fit(weight.shape[0], x2.shape[-1]) and gemv_bf16_reason(x2.device) is None):
            path = "gemv6"  # fused: fp16 activations too (the quantized operand is bf16-exact)
        elif x2.shape[0] > GEMV_MAX_M and dot_scaled.ready(x2.device, "e2m1") is None:
            path = "dot_scaled"  # sm_100+: NVFP4 x NVFP4 on FP4 tensor cores
    if path == "dot_scaled":  # codes + scales of x, then one scaled MMA per tile
        if x2.dtype not in (torch.bfloat16, torch.float16):
            raise nvfp4.NVFP4Error(f"W4A4 takes bf16/fp16 activations, got {x2.dtype}")
        xp, xsc, x_enc, _ = quantize_kernel.launch_quantize(x2, input_amax, four_six, emit="packed")
        y = dot_scaled.matmul(xp, xsc, x_enc, weight, bias, x2.dtype, out=out)
    elif path == "gemv6" and W4A4_FUSED and gemv_bf16_reason(x2.device) is None:  # quantize inside the GEMV
        if x2.shape[-1] % BLOCK_SIZE:
            raise nvfp4.NVFP4Error(f"W4A4: activation last dim {x2.shape[-1]} is not a multiple of {BLOCK_SIZE}")
        y = _matmul(x2, weight, bias, path=path, out=out, amax=input_amax.reshape(1), four_six=four_six)
    else:
        # the GEMM launches as the quantize launch's programmatic dependent where it reads the weight's own
        # buffers (a copy made between the two would be read before its wait)
        pair = (requested is None and _weight_in_place(weight)
                and _w4a4_pairs_path(path, x2.shape[0], weight.shape[0], x2.shape[1], x2.device))
        xs, x_enc = quantize_kernel.quantize_scaled(x2, input_amax, four_six, trigger=pair)
        # an automatic choice stays one (a failed mma launch can fall back)
        y = _matmul(xs, weight, bias, x_enc, path=path, out=out, picked=requested is None, dependent=pair)
    return y.reshape(*lead, y.shape[-1])


__all__ = ["dequantize", "linear_w4a16", "linear_w4a4"]


# --------------------------------------------------------------------------- #
# Launch plans: a layer's launches decided once for inputs shaped alike
# --------------------------------------------------------------------------- #
def linear_plan(x: torch.Tensor, weight: NVFP4Tensor, bias: Optional[torch.Tensor] = None,
                input_amax: Optional[torch.Tensor] = None, four_six: Optional[str] = None):
    """The launches of ``linear_w4a16(x, weight, bias)`` (or, given ``input_amax``, ``linear_w4a4(x,
    weight, input_amax, bias, four_six=four_six)``) decided once for inputs shaped like ``x`` (shape,
    strides, dtype, device): a callable ``plan(x) -> y`` (W4A4: ``plan(x, input_amax)``, the amax of
    that call), which returns None for a call it cannot take (another device current, an activation
    address the kernels' vector loads cannot use, an amax not fp32 on x's device: the dispatch then
    takes that call), or None where the path is not planned (gemv4 / gemv5, the tiled GEMM and
    dequantize + cuBLAS; W4A4 quantized inside the GEMV or on FP4 tensor cores; operands the dispatch
    would copy). A plan holds views of the weight's buffers and its launches (``Launch``), which
    replay without Triton's binder from the plan's third call; it gives the dispatch's bits. Eager
    decoding calls every layer once a token with the same shapes: ``NVFP4Linear`` keeps its plans
    (``modules.py``)."""
    _check_operands(x, weight, bias)
    n, k, words, sbits, enc = _weight_views(weight)
    lead = x.shape[:-1]
    if (words.data_ptr() != weight.packed.data_ptr() or sbits.data_ptr() % 16 or enc.dtype != weight.global_enc.dtype
            or x.shape[-1] != k or x.dtype not in (torch.bfloat16, torch.float16) or n == 0 or x.numel() == 0):
        return None  # operands the dispatch would copy on every call (or nothing to launch)
    try:
        x2 = x.view(-1, k)  # (what each call does: inputs shaped alike are views alike)
    except RuntimeError:
        return None
    m = x2.shape[0]
    if x2.stride(1) != 1 or (bias is not None and not bias.is_contiguous()):
        return None
    device = x.device
    w4a4 = input_amax is not None
    path = _auto_path(m, x2.dtype, w4a4, k, device, n)
    if path == "wsgemm" and (k // 16) % 16:
        # its scales come from wsgemm.tma_scales' padded copy, which a plan would keep: an in-place write to
        # the weight after the plan was built would not reach it (plans read the buffers themselves); the
        # dispatch asks tma_scales on every call, which copies again after such a write
        return None
    y = torch.empty(m, n, dtype=x2.dtype, device=device)
    bias_arg = bias if bias is not None else enc
    quantize = qwords = None
    if w4a4:
        from . import dot_scaled

        if (W4A4_FUSED and m <= GEMV_MAX_M and GEMV_PATH == "gemv6" and gemv_bf16_reason(device) is None) \
                or four_six not in quantize_kernel.FOUR_SIX_CODES \
                or input_amax.device != device or input_amax.dtype != torch.float32 \
                or (m > GEMV_MAX_M and dot_scaled.ready(device, "e2m1") is None):
            return None  # quantized inside the GEMV or on FP4 tensor cores; an amax the dispatch converts
        amax = input_amax.reshape(1)
        if quantize_kernel._takes_quant16(x2, "scaled", None):
            qwords = quantize_kernel._words(x2)
            if qwords is None:
                return None
        # the GEMM as the quantize launch's programmatic dependent (the weight views are its own buffers here)
        pair = _w4a4_pairs_path(path, m, n, k, device)
        quantize = quantize_kernel.quantize_launches(x2, qwords, amax, four_six, "scaled", None, pair)
        x_enc, slots = torch.empty(1, dtype=torch.float32, device=device), (0, 4, 6)
        x2 = torch.empty(m, k, dtype=x2.dtype, device=device)  # the quantized operand: a fresh tensor
    else:
        x_enc, slots, pair = None, (0, 6), False
    if path == "gemv6" and x2.stride(0) % 4 == 0:
        align = 8  # x read as 8-byte words
        run = _gemv6(x2, words, sbits, enc, x_enc if w4a4 else enc, bias_arg, y, m, n, k, bias is not None, x_enc,
                     slots=slots, dependent=pair)
    elif path in ("mma", "wgmma", "wsgemm") and x2.stride(0) % 8 == 0:
        align = 16  # 16-byte copies (TMA for wsgemm) of x
        module = importlib.import_module(f".{path}", __package__)
        # wsgemm: its split tiles' counters, and the weight's scale tensor for tma_scales' padded copy
        own = dict(own_counters=True, scale_owner=weight.block_scale) if path == "wsgemm" else {}
        if pair:  # (mma.py only: _w4a4_pairs_path)
            own = dict(dependent=True)
        run = module.launches(x2, words, sbits, enc, x_enc, bias, y, slots=slots, **own)
    else:
        return None
    if quantize is not None:  # the GEMM reads the fresh quantized operand; x itself goes to the quantize
        align = 4             # kernel, as int32 words or fp32-compared
    index, on_cuda, shape, dtype = device.index, device.type == "cuda", (m, n), x2.dtype

    def plan(x: torch.Tensor, input_amax: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        x2 = x.view(-1, k)
        if x2.data_ptr() % align or (on_cuda and current_device() != index):
            return None
        if quantize is None:
            return run(x2, torch.empty(shape, dtype=dtype, device=device)).view(*lead, n)
        if input_amax.device != device or input_amax.dtype != torch.float32:
            return None
        xs, x_enc = quantize(x2.view(torch.int32) if qwords is not None else x2, input_amax.reshape(1))
        return run(xs, x_enc.reshape(1), torch.empty(shape, dtype=dtype, device=device)).view(*lead, n)
    return plan
