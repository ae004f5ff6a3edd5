"""NVFP4 GEMM (W4A16, and W4A4 on the quantized activations) for M = 33..1024
on Hopper, with the weight decoded inside the main loop by a warpgroup of its
own (warp specialization), written in Gluon. sm_90 only; bf16 or fp16
activations, K % 64 == 0 (scale rows padded for TMA where K % 256 != 0).

Why: above M = 128 the dispatch dequantized the weight into a bf16 copy and
called cuBLAS, which costs cuBLAS's time plus a decode pass that writes
2 bytes a weight (0.24-0.30x cuBLAS's time on Llama-3.1-8B's layers,
benchmarks/NOTES.md): 0.78-0.86x cuBLAS at M = 1024. Decoding in the GEMM's
main loop reads 0.56 bytes a weight instead and hides the decode behind the
tensor cores. wgmma.py decodes in the warps that issue the MMA, so every K
step is one serial chain (0.3x cuBLAS at M = 1024). Here two partitions run
side by side, joined by mbarrier rings:

* a decoder warpgroup issues the TMA copies (activation tile ``[BM, BK]`` and
  the weight's code words ``[BN, BK/8]``, int32 of 8 codes, two steps ahead
  into an ``XSTAGES`` ring; scale bytes ``[BN, 16]`` for 16 / (BK / 16) steps
  into two slots), decodes every word into eight 16-bit floats in natural K
  order (mma.py's decode gives codes ``(p, p + 4)`` in register ``p``, bf16 by
  its multiply: mask, multiply, mask; four ``prmt`` reorder them to
  ``(2p, 2p + 1)``) and stores the tile ``[BN, BK]``
  into a second ring (``BSTAGES`` deep) in the NVMMA-swizzled layout that
  wgmma reads;
* two consumer warpgroups (the default partition) issue the asynchronous
  wgmma ``acc[BM, BN] += X[BM, BK] @ Wdec[BN, BK]^T`` from both rings, keep
  one MMA in flight, release each step's slots when its MMA completed, and
  write the output (rounded once, re-laid out for 16-byte stores). On the
  256-row tile the operands are swapped (``SWAP``: ``acc^T += Wdec @ X^T``,
  m64n256k16), so each warpgroup reads the activation slice once a k16 instead
  of the decoded tile once per 64 rows (80 KB of operand reads a step instead of
  96: 1-8% faster, bit-equal); at M = 65..128 wide layers take 256 weight rows a
  tile (``WIDE_M_CONFIG``: m64n256k16 on the decoded tile, 10-20% faster there),
  and above M = 128 the same 128 x 256 tile replaces 256 x 128 where rounding M
  up to 128 rows saves tiles or a wave (M = 257..384 and the like: 7-28%).

Where the last wave of tiles would leave SMs idle (Llama-3.1 8B qkv at
M = 1024: 192 tiles on 132 SMs), ``plan`` cuts the tail's tiles into 2-4 K
ranges run by programs of their own, which write fp32 partial sums, added in
order (a cost model of the SMs' time picks the cut; it predicted 8B qkv's
109 -> 96 us within 1%). Where whole tiles remain too, the parts run first and
the whole-tile programs that end early add them up in the same launch
(``summing_plan``: per-tile counters, release / acquire at GPU scope);
otherwise a second launch does.

Three things the H200 runs showed (NOTES, ninth pass): the decoder must not
refill the ring slot the consumers free last (it would wait for each MMA
before the next decode); no global load may be in flight at the decoder's
proxy fence (MEMBAR.ALL.CTA waits for it), hence the scales by TMA; and
256 x 128 tiles beat 128 x 256 (half the decode a FLOP).

Numerics as mma.py: the decoded weight is ``v * scale * 2^-26`` (bf16; fp16
``v * scale * 2^-14``), exact; the tensor core sums the exact products in
fp32; ``2^26 / global_enc`` (W4A4: also ``/ global_x``) once per output, as
one correctly rounded factor, then the bias. So the result equals the other
kernels' up to the order of the fp32 sums.

Measured (table run 10, results/kernels_h200.md): 0.88-0.90x cuBLAS bf16 at
M = 1024 on five Llama-3.1 layers, W4A4 1.08-1.29x cuBLAS's time; with the
split tail 8B qkv 0.85x and, at M = 129..512, 1.07-1.64x dequantize + cuBLAS
(results/wsgemm_h200_split.json); the split tiles summed in the launch: 8B qkv at M = 1024
94.1 -> 91.2 us (0.87x cuBLAS in table run 23), 70B gate_up at M = 256 415 -> 408
(results/wsgemm_summers_h200.json). Smaller tiles below M = 129 (``config``: 128 activation rows at
M = 65..128, 64 rows on one consumer warpgroup at 33..64, two CTAs an SM) beat wgmma.py by 1.20-1.62x and
mma.py by 1.02-1.45x there (results/wsgemm_small_m_h200.json). The dispatch
uses it only where ``preferred`` (its measured rows) and after ``ready(device)``
(sm_90, a self-test on the device) answered None. CPU tests (tests/test_wsgemm.py)
run the decoder's PTX in an emulator, check the shape rule and compile the
kernel for sm_90; GPU checks and timings: benchmarks/wsgemm_h200.py.
"""
from __future__ import annotations

import functools
import heapq
import weakref
from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from . import rules
from ._common import Launch, cdiv
from ._gluon import (DECODE_SHIFTS, DECODE_SHIFTS_F16, MAG_MASK, MAG_MASK_F16, _index, _sync, aligned_operands,
                     decide_once, decode_line, decode_mul_lines, product_check, sm90_reason, stop_using)

# the four decoded registers (codes (p, p + 4) in register p) -> natural pairs (0, 1), (2, 3), (4, 5), (6, 7):
# prmt 0x5410 takes both low halves, 0x7632 both high halves (first operand in the low half)
NATURAL_PAIRS = (("r0", "r1", 0x5410), ("r2", "r3", 0x5410), ("r0", "r1", 0x7632), ("r2", "r3", 0x7632))


def decode_asm(shifts=DECODE_SHIFTS, mag_mask=MAG_MASK, mul="mul.rn.bf16x2", muldec: bool = False) -> str:
    """PTX of one word: outputs $0-$3 the 16-bit-float pairs of codes (0, 1),
    (2, 3), (4, 5), (6, 7) times the scale pair; $4-$11 the word (8 copies of
    one register), $12-$15 the scale pairs (equal)."""
    if muldec:  # bf16 by mma.py's multiply decode: 17 operations a word instead of 24, the same bits
        lines = decode_mul_lines([f"r{p}" for p in range(4)], "$4", "$12")
    else:
        lines = [decode_line(f"r{p}", "$4", "$12", shifts[p], mag_mask, mul) for p in range(4)]
    perm = [f"prmt.b32 ${q}, {a}, {b}, {sel:#06x};" for q, (a, b, sel) in enumerate(NATURAL_PAIRS)]
    return "\n".join(["{", ".reg .b32 a, b, r0, r1, r2, r3;", *lines, *perm, "}"])


# TMA global -> shared: ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared`` before
if hasattr(tma, "async_load"):
    @gluon.jit
    def _tma_load(desc, coord, bar, smem):
        tma.async_load(desc, coord, bar, smem)
else:  # pragma: no cover - the H200's Triton 3.6
    @gluon.jit
    def _tma_load(desc, coord, bar, smem):
        tma.async_copy_global_to_shared(desc, coord, bar, smem)


# The decoder's bf16 decode by multiply (_gluon.decode_mul_line), bit-equal to the shifts (``decode_asm()``, which
# the tests hold it against); fp16 by the shifts. 2 fewer operations a word (about 6% of the decoder's step) made
# whole steps faster, so the decoder's work sets their pace (how is not settled: taking the TMA copies and 4
# barriers off its step instead measured +-6%, results/wsgemm_consumer_loads_h200.json). H200
# (results/muldec_tc_h200.json, 3 interleaved rounds): 17 of 18 rows 1.6-11% faster (M = 128: 8B gate_up 73.3 ->
# 65.1 us, 70B gate_up 276 -> 251; M = 1024: 8B qkv 91.9 -> 89.1, 8B down 190.6 -> 183.2), 70B gate_up at M = 1024
# +1.3%.
_DECODE_MUL = gl.constexpr(decode_asm(muldec=True))
_DECODE_F16 = gl.constexpr(decode_asm(DECODE_SHIFTS_F16, MAG_MASK_F16, "mul.rn.f16x2"))
_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 12))


@gluon.jit
def _spread(v, n: gl.constexpr):
    """``[BN, C]`` -> ``[BN, C * n]``: every element repeated ``n`` times in a row (n = 8 or 16)."""
    v = gl.join(v, v)
    v = gl.join(v, v)
    v = gl.join(v, v)
    if n == 16:
        v = gl.join(v, v)
    return gl.reshape(v, [v.shape[0], v.shape[1] * n])


@gluon.jit
def _issue_loads(x_desc, w_desc, x_ring, w_ring, ready, x_empty, j, kstep, off_m, off_n):
    """TMA copies of K step ``kstep``'s activation tile and code words into ring slot ``j % XSTAGES``
    (``j`` counts this program's steps), once the consumers released the slot's previous activations
    (the decoder, the slot's only other reader, read its words two or more steps ago)."""
    XSTAGES: gl.constexpr = w_ring.type.shape[0]
    BK: gl.constexpr = w_ring.type.shape[2] * 8
    s = j % XSTAGES
    mbarrier.wait(x_empty.index(s), ((j // XSTAGES) & 1) ^ 1)  # fresh barriers count as phase 1 completed
    mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    _tma_load(x_desc, [off_m, kstep * BK], ready.index(s), x_ring.index(s))
    _tma_load(w_desc, [off_n, kstep * (BK // 8)], ready.index(s), w_ring.index(s))


@gluon.jit
def _issue_scales(s_desc, s_ring, s_ready, g, g0, off_n):
    """TMA copy of scale group ``g0 + g`` (the ``[BN, 16]`` scale bytes of ``16 / (BK / 16)`` K steps;
    ``g`` counts this program's groups) into scale slot ``g % 2``; that slot's previous group was read
    (and fenced) steps before."""
    G16: gl.constexpr = s_ring.type.shape[2]
    slot = g % 2
    mbarrier.expect(s_ready.index(slot), s_desc.block_type.nbytes)
    _tma_load(s_desc, [off_n, (g0 + g) * G16], s_ready.index(slot), s_ring.index(slot))


@gluon.jit
def _decode_step(w_slot, s_slice, b_ring, b_ready, b_empty, i):
    """Decode one K step: the code words of ring slot ``w_slot`` ``[BN, BK/8]`` times the scale bytes
    ``s_slice`` ``[BN, BK/16]`` into decoded slot ``i % BSTAGES`` (``i`` counts the program's steps), once
    the consumers released it; then one proxy fence and the slot's arrival."""
    BSTAGES: gl.constexpr = b_ring.type.shape[0]
    BK: gl.constexpr = b_ring.type.shape[2]
    F16: gl.constexpr = b_ring.dtype == gl.float16
    BN: gl.constexpr = b_ring.type.shape[1]
    DW: gl.constexpr = gl.num_warps()  # this partition's warps
    # TPR threads a row (two where the partition has more threads than the tile has rows: 8 warps on
    # 128 rows; one otherwise, BN / (32 DW) rows a thread), each with BK/8/TPR words, BK/16/TPR scale bytes
    TPR: gl.constexpr = (32 * DW + BN - 1) // BN
    wl: gl.constexpr = gl.BlockedLayout([1, BK // 8 // TPR], [32 // TPR, TPR], [DW, 1], [1, 0])
    sl: gl.constexpr = gl.BlockedLayout([1, BK // 16 // TPR], [32 // TPR, TPR], [DW, 1], [1, 0])
    dl: gl.constexpr = gl.BlockedLayout([1, BK // TPR], [32 // TPR, TPR], [DW, 1], [1, 0])
    wv = w_slot.load(wl)
    sb = s_slice.load(sl)
    # E4M3 byte << 7 is the fp16 scale * 2^-8 (subnormals included); * 2^108 -> scale * 2^100
    # (bf16, exact), * 2^8 -> the scale itself (fp16)
    s32 = (sb.to(gl.int16) << 7).to(gl.float16, bitcast=True).to(gl.float32)
    w8 = gl.convert_layout(_spread(wv, 8), dl, assert_trivial=True)
    if F16:
        sc = gl.convert_layout(_spread((s32 * 256.0).to(gl.float16), 16), dl, assert_trivial=True)
        dec = gl.inline_asm_elementwise(_DECODE_F16, _CONSTRAINTS, [w8, sc], gl.float16, True, 8)
    else:
        sc = gl.convert_layout(_spread((s32 * 3.2451855365842673e32).to(gl.bfloat16), 16), dl, assert_trivial=True)
        dec = gl.inline_asm_elementwise(_DECODE_MUL, _CONSTRAINTS, [w8, sc], gl.bfloat16, True, 8)
    b = i % BSTAGES
    mbarrier.wait(b_empty.index(b), ((i // BSTAGES) & 1) ^ 1)
    b_ring.index(b).store(dec)
    # one fence a step: the stores before the wgmma (async proxy) reads them, and this step's
    # reads of the word and scale slots before their next TMA writes
    fence_async_shared()
    mbarrier.arrive(b_ready.index(b))


@gluon.jit
def _decoder(x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, x_empty, s_ready, b_ring, b_ready, b_empty, off_m,
             off_n, k0, k_steps):
    XSTAGES: gl.constexpr = w_ring.type.shape[0]
    BK: gl.constexpr = w_ring.type.shape[2] * 8
    G: gl.constexpr = 16 // (BK // 16)  # K steps a scale group covers
    # Everything this partition reads comes by TMA: no global load is outstanding at the proxy fences
    # (they compile to MEMBAR.ALL.CTA, which would wait for it)
    # this program's K steps k0 .. k0 + k_steps - 1 (k0 a multiple of G: whole scale groups)
    g0 = k0 // G
    _issue_scales(s_desc, s_ring, s_ready, 0, g0, off_n)
    for j in gl.static_range(XSTAGES - 2):
        if j < k_steps:
            _issue_loads(x_desc, w_desc, x_ring, w_ring, ready, x_empty, j, k0 + j, off_m, off_n)
    for g in range(gl.cdiv(k_steps, G)):
        if (g + 1) * G < k_steps:
            _issue_scales(s_desc, s_ring, s_ready, g + 1, g0, off_n)
        mbarrier.wait(s_ready.index(g % 2), (g // 2) & 1)
        for j in gl.static_range(G):
            i = g * G + j
            if i < k_steps:
                s = i % XSTAGES
                mbarrier.wait(ready.index(s), (i // XSTAGES) & 1)
                sb = s_ring.index(g % 2).slice(j * (BK // 16), BK // 16, dim=1)
                _decode_step(w_ring.index(s), sb, b_ring, b_ready, b_empty, i)
                # step i + XSTAGES - 2 into the slot of step i - 2, whose activations the consumers released
                # when MMA i - 2 completed, which they wait for after issuing MMA i - 1 (decoded before):
                # this wait does not hold up the next decode. (Refilling the slot of step i - 1 here, run v3,
                # waited for MMA i - 1 every step, so step i + 1's decode started only when MMA i did;
                # before step i's decode it would deadlock.)
                if i + XSTAGES - 2 < k_steps:
                    _issue_loads(x_desc, w_desc, x_ring, w_ring, ready, x_empty, i + XSTAGES - 2,
                                 k0 + i + XSTAGES - 2, off_m, off_n)


@gluon.jit
def _consumer(x_ring, ready, x_empty, b_ring, b_ready, b_empty, k_steps, BM: gl.constexpr, BN: gl.constexpr,
              XSTAGES: gl.constexpr, BSTAGES: gl.constexpr, WARPS: gl.constexpr, SWAP: gl.constexpr):
    # the accumulator [BM, BN] (activation rows x weight rows), or with SWAP [BN, BM] (the decoded weight
    # tile is wgmma's A operand, the activations its B, BM wide); (a layout cannot be returned by a
    # function in Triton 3.6, hence the arithmetic on SWAP)
    ROWS: gl.constexpr = BM + SWAP * (BN - BM)
    COLS: gl.constexpr = BN + SWAP * (BM - BN)
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                    instr_shape=[16, COLS, 16])
    acc = gl.zeros([ROWS, COLS], gl.float32, layout=acc_l)
    for i in range(k_steps):
        s = i % XSTAGES
        b = i % BSTAGES
        mbarrier.wait(ready.index(s), (i // XSTAGES) & 1)
        mbarrier.wait(b_ready.index(b), (i // BSTAGES) & 1)
        if SWAP:  # acc^T [BN, BM] += Wdec [BN, BK] @ X[BM, BK]^T: each warpgroup reads the whole
            # activation tile once a k16 (m64nBMk16) instead of the decoded tile once per 64 rows
            acc = warpgroup_mma(b_ring.index(b), x_ring.index(s).permute((1, 0)), acc, is_async=True)
        else:
            acc = warpgroup_mma(x_ring.index(s), b_ring.index(b).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])  # step i - 1's MMA is complete: release its slots
        p = (i + XSTAGES - 1) % XSTAGES
        q = (i + BSTAGES - 1) % BSTAGES
        mbarrier.arrive(x_empty.index(p), pred=i > 0)
        mbarrier.arrive(b_empty.index(q), pred=i > 0)
    acc = warpgroup_mma_wait(0, deps=[acc])
    return (acc,)  # the default partition returns a tuple of tensors


@gluon.jit
def _epilogue(acc, wenc_ptr, xenc_ptr, bias_ptr, y_ptr, part_ptr, M, N, stride_ym, n0, off_m, off_n, part, is_part,
              HAS_BIAS: gl.constexpr, HAS_XENC: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
              WARPS: gl.constexpr, SWAP: gl.constexpr):
    """A tile's output: ``acc * 2^26 / global_enc`` (fp16: ``2^14``; W4A4: also ``/ global_x``), then
    either the split part's fp32 partial sum or the output (+ bias) rounded once."""
    if SWAP:
        _epilogue_swapped(acc, wenc_ptr, xenc_ptr, bias_ptr, y_ptr, part_ptr, M, N, stride_ym, n0, off_m, off_n,
                          part, is_part, HAS_BIAS, HAS_XENC, BM, BN, WARPS)
    else:
        _epilogue_rows(acc, wenc_ptr, xenc_ptr, bias_ptr, y_ptr, part_ptr, M, N, stride_ym, n0, off_m, off_n, part,
                       is_part, HAS_BIAS, HAS_XENC, BM, BN, WARPS)


@gluon.jit
def _scaled_acc(acc, wenc_ptr, xenc_ptr, HAS_XENC: gl.constexpr, F16: gl.constexpr):
    """``acc * 2^26 / global_enc`` (fp16: ``2^14``; W4A4: over ``global_enc * global_x``), one rounded factor."""
    enc = gl.load(wenc_ptr)
    if HAS_XENC:
        enc = enc * gl.load(xenc_ptr)
    if F16:
        y = acc * gl.div_rn(enc * 0.0 + 16384.0, enc)
    else:
        y = acc * gl.div_rn(enc * 0.0 + 67108864.0, enc)
    return y


@gluon.jit
def _epilogue_rows(acc, wenc_ptr, xenc_ptr, bias_ptr, y_ptr, part_ptr, M, N, stride_ym, n0, off_m, off_n, part,
                   is_part, HAS_BIAS: gl.constexpr, HAS_XENC: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                   WARPS: gl.constexpr):
    """``_epilogue`` of the accumulator ``[BM, BN]``."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                    instr_shape=[16, BN, 16])
    y = _scaled_acc(acc, wenc_ptr, xenc_ptr, HAS_XENC, y_ptr.dtype.element_ty == gl.float16)
    mo = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_l))
    no = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_l))
    if is_part:
        # an fp32 partial sum, scaled, without the bias (added once by the summing launch); a thread's
        # pairs of 4-byte outputs fill whole 32-byte sectors, so the accumulator layout stores it
        ns = N - n0
        ok = (mo < M)[:, None] & (no < N)[None, :]
        prow = (part * M + mo).to(gl.int64) * ns
        gl.store(part_ptr + prow[:, None] + (no - n0)[None, :], y, mask=ok)
    else:
        if HAS_BIAS:
            y += gl.load(bias_ptr + gl.where(no < N, no, 0)).to(gl.float32)[None, :]
        # rounded once into the output dtype, then re-laid out so a thread stores 8 consecutive outputs (16
        # bytes) and a warp whole rows: the accumulator layout stores 4-byte pairs (half of each sector wasted)
        out_l: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BN, BN // 8], [WARPS, 1], [1, 0])
        yo = gl.convert_layout(y.to(y_ptr.dtype.element_ty), out_l)
        mo_s = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, out_l))
        no_s = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, out_l))
        ok_s = (mo_s < M)[:, None] & (no_s < N)[None, :]
        gl.store(y_ptr + mo_s[:, None].to(gl.int64) * stride_ym + no_s[None, :], yo, mask=ok_s)


@gluon.jit
def _epilogue_swapped(acc, wenc_ptr, xenc_ptr, bias_ptr, y_ptr, part_ptr, M, N, stride_ym, n0, off_m, off_n, part,
                      is_part, HAS_BIAS: gl.constexpr, HAS_XENC: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                      WARPS: gl.constexpr):
    """``_epilogue`` of the transposed accumulator ``[BN, BM]`` (weight rows x activation rows)."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                    instr_shape=[16, BM, 16])
    y = _scaled_acc(acc, wenc_ptr, xenc_ptr, HAS_XENC, y_ptr.dtype.element_ty == gl.float16)
    no = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
    mo = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_l))
    if is_part:
        # the fp32 partial sum, as in _epilogue_rows; a thread's pairs are now two activation rows apart
        # in memory, but the lanes of a store instruction still fill whole 32-byte sectors (8 weight rows
        # of 4 bytes each), so it is stored from the accumulator layout, 4 bytes a lane
        ns = N - n0
        ok = (no < N)[:, None] & (mo < M)[None, :]
        prow = (part * M + mo).to(gl.int64) * ns
        gl.store(part_ptr + prow[None, :] + (no - n0)[:, None], y, mask=ok)
    else:
        if HAS_BIAS:
            y += gl.load(bias_ptr + gl.where(no < N, no, 0)).to(gl.float32)[:, None]
        # rounded once, then re-laid out so a thread holds 8 consecutive weight rows of one activation row
        # (16 bytes of the output row) and a warp 2 whole 256-byte runs
        out_l: gl.constexpr = gl.BlockedLayout([8, 1], [BN // 8, 256 // BN], [1, WARPS], [0, 1])
        yo = gl.convert_layout(y.to(y_ptr.dtype.element_ty), out_l)
        no_s = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, out_l))
        mo_s = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, out_l))
        ok_s = (no_s < N)[:, None] & (mo_s < M)[None, :]
        gl.store(y_ptr + mo_s[None, :].to(gl.int64) * stride_ym + no_s[:, None], yo, mask=ok_s)



@gluon.jit
def _rings(x_desc, w_desc, s_desc, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, XSTAGES: gl.constexpr,
           BSTAGES: gl.constexpr):
    """The shared-memory rings and their mbarriers (initialized and fenced)."""
    dtype: gl.constexpr = x_desc.dtype
    x_ring = gl.allocate_shared_memory(dtype, [XSTAGES, BM, BK], x_desc.layout)
    w_ring = gl.allocate_shared_memory(gl.int32, [XSTAGES, BN, BK // 8], w_desc.layout)
    s_ring = gl.allocate_shared_memory(gl.uint8, [2, BN, 16], s_desc.layout)
    s_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], dtype)
    b_ring = gl.allocate_shared_memory(dtype, [BSTAGES, BN, BK], b_layout)
    ready = gl.allocate_shared_memory(gl.int64, [XSTAGES, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [XSTAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [BSTAGES, 1], mbarrier.MBarrierLayout())
    b_empty = gl.allocate_shared_memory(gl.int64, [BSTAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(XSTAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(x_empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(s_ready.index(i), count=1)
    for i in gl.static_range(BSTAGES):
        mbarrier.init(b_ready.index(i), count=1)
        mbarrier.init(b_empty.index(i), count=1)
    fence_async_shared()
    return x_ring, w_ring, s_ring, s_ready, b_ring, ready, x_empty, b_ready, b_empty


@gluon.jit
def _item(w, full_tiles, splits, k_chunk, k_steps, num_m, n_parts, BM: gl.constexpr, BN: gl.constexpr,
          PARTS_FIRST: gl.constexpr):
    """Work item ``w``: a whole tile, or K range ``part`` of ``splits`` of a split tile (the tail that
    would leave SMs idle in the last wave; ``k_chunk`` steps, whole scale groups), whose fp32 partial
    outputs are summed by a second launch or, with ``PARTS_FIRST``, by the programs ``summing_plan``
    names. Split tiles are whole weight-tile columns from column ``n0`` on (``plan``), numbered from
    ``full_tiles`` on. Items: the whole tiles, then the ``n_parts`` parts; with ``PARTS_FIRST`` the parts
    come first, so that they are done while the whole tiles run. The row tiles of one weight tile are
    consecutive items, so they run side by side and its codes come from HBM once. Returns (off_m, off_n,
    first K step, K steps, part, split, tile)."""
    if PARTS_FIRST:
        is_part = w < n_parts
        r = gl.where(is_part, w, 0)
        t = gl.where(is_part, full_tiles + r // splits, w - n_parts)
    else:
        is_part = w >= full_tiles
        r = gl.maximum(w - full_tiles, 0)
        t = gl.where(is_part, full_tiles + r // splits, w)
    part = gl.where(is_part, r % splits, 0)
    k0 = part * k_chunk
    ks = gl.minimum(k_steps - k0, gl.where(is_part, k_chunk, k_steps))
    return (t % num_m) * BM, (t // num_m) * BN, k0, ks, part, is_part, t


@gluon.jit
def _sum_split_tiles(j, n_summers, full_tiles, n_split, num_m, part_ptr, count_ptr, bias_ptr, y_ptr, M, N,
                     stride_ym, n0, SPLITS: gl.constexpr, HAS_BIAS: gl.constexpr, BM: gl.constexpr,
                     BN: gl.constexpr, WARPS: gl.constexpr):
    """A summing program's second job (``summing_plan``): split tiles ``j``, ``j + n_summers``, ... (of
    ``n_split``, numbered from ``full_tiles``), each once its ``SPLITS`` parts have counted themselves
    done (an acquire poll of its counter; the parts are items before this one, so they were started
    first and finish without waiting on anything): their fp32 partials added in part order (``.cg``
    loads from L2), + bias, rounded once into y (the bits of _common.py's summing launch), up to 128 rows at
    a time (every part's loads of a chunk issued together: 16 loads of 16 bytes a part and thread, one L2
    round trip a chunk); then the counter is set back to 0 for the next launch."""
    ROWS: gl.constexpr = BM if BM < 128 else 128
    sum_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
    ns = N - n0
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, sum_l))
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, sum_l))
    plane = M.to(gl.int64) * ns
    for s in range(j, n_split, n_summers):
        t = full_tiles + s
        off_m = (t % num_m) * BM
        no = (t // num_m) * BN + cols
        while gl.atomic_add(count_ptr + s, 0, sem="acquire", scope="gpu") < SPLITS:
            pass
        if HAS_BIAS:
            b = gl.load(bias_ptr + gl.where(no < N, no, 0)).to(gl.float32)[None, :]
        for r0 in gl.static_range(0, BM, ROWS):
            mo = off_m + r0 + rows
            ok = (mo < M)[:, None] & (no < N)[None, :]
            at = mo[:, None].to(gl.int64) * ns + (no - n0)[None, :]
            total = gl.zeros([ROWS, BN], gl.float32, layout=sum_l)
            for q in gl.static_range(SPLITS):
                total += gl.load(part_ptr + q * plane + at, mask=ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += b
            gl.store(y_ptr + mo[:, None].to(gl.int64) * stride_ym + no[None, :], total.to(y_ptr.dtype.element_ty),
                     mask=ok)
        gl.atomic_xchg(count_ptr + s, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _ws_kernel(x_desc, w_desc, s_desc, wenc_ptr, xenc_ptr, bias_ptr, y_ptr, part_ptr, M, N, stride_ym, k_steps,
               full_tiles, splits, k_chunk, n0, n_parts, count_ptr, sum_ptr, n_summers,
               HAS_BIAS: gl.constexpr, HAS_XENC: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
               BK: gl.constexpr, XSTAGES: gl.constexpr, BSTAGES: gl.constexpr, WARPS: gl.constexpr,
               DEC_WARPS: gl.constexpr, DEC_REGS: gl.constexpr, SUM_SPLITS: gl.constexpr, SWAP: gl.constexpr = False):
    # one program an item (``_item``); with SUM_SPLITS (the split count; 0: a second launch sums) the split
    # tiles are summed in this launch
    pid = gl.program_id(0)
    num_m = gl.cdiv(M, BM)
    off_m, off_n, k0, ks, part, is_part, t = _item(pid, full_tiles, splits, k_chunk, k_steps, num_m, n_parts,
                                                   BM, BN, SUM_SPLITS > 0)
    x_ring, w_ring, s_ring, s_ready, b_ring, ready, x_empty, b_ready, b_empty = _rings(
        x_desc, w_desc, s_desc, BM, BN, BK, XSTAGES, BSTAGES)
    acc = gl.warp_specialize([
        (_consumer, (x_ring, ready, x_empty, b_ring, b_ready, b_empty, ks, BM, BN, XSTAGES, BSTAGES, WARPS, SWAP)),
        (_decoder, (x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, x_empty, s_ready, b_ring, b_ready, b_empty,
                    off_m, off_n, k0, ks)),
    ], [DEC_WARPS], [DEC_REGS])[0]
    _epilogue(acc, wenc_ptr, xenc_ptr, bias_ptr, y_ptr, part_ptr, M, N, stride_ym, n0, off_m, off_n, part, is_part,
              HAS_BIAS, HAS_XENC, BM, BN, WARPS, SWAP)
    if SUM_SPLITS > 0:
        if is_part:
            # this part's partial is stored (every thread's stores before the barrier): count it done,
            # one thread, release at GPU scope
            _sync()
            gl.atomic_add(count_ptr + (t - full_tiles), 1, sem="release", scope="gpu")
        else:
            j = gl.load(sum_ptr + pid)
            if j >= 0:
                _sum_split_tiles(j, n_summers, full_tiles, (num_m * gl.cdiv(N, BN)) - full_tiles, num_m,
                                 part_ptr, count_ptr, bias_ptr, y_ptr, M, N, stride_ym, n0, SUM_SPLITS, HAS_BIAS, BM,
                                 BN, WARPS)


# The tiles of ``rules.TILES``' wsgemm rows (BM, BN, BK, XSTAGES, BSTAGES, decoder warps, decoder registers,
# register cap a thread at launch): 256 x 128 from M = 129, 128 x 128 at 65..128, 64 x 128 below, and the
# 128 x 256 tile where its plan's span is the shorter (``config``); the measurements are named there
DEFAULT_CONFIG, SMALL_M_CONFIG, TINY_M_CONFIG = rules.WS_256x128, rules.WS_128x128, rules.WS_64x128
WIDE_M_CONFIG = rules.WS_128x256
WIDE_SMALL_M = True


def _steps(m: int, n: int, k: int, sms: int, cfg: tuple) -> float:
    """The span of ``plan``'s schedule for tile ``cfg``, in that tile's K steps (the summing counted)."""
    bm, bn, bk = cfg[:3]
    return cdiv(m, bm) * cdiv(n, bn) * (k // bk) / (sms * plan(m, n, k, sms, cfg)[4])


def config(m: int, n: int, k: int, sms: int = 132) -> tuple:
    """The tile by M (``rules.TILES``' wsgemm rows: 256 activation rows x 128 weight rows x 64 K from M = 129,
    two consumer warpgroups of 128 x 128 fp32 accumulators; 128 rows at M = 65..128 and 64 rows, one consumer
    warpgroup and two CTAs an SM, below; a 4-step TMA ring and 2 decoded tiles); 128 x 256 (``WIDE_M_CONFIG``)
    instead where its plan's span, at the row's cost a K step, is under ``rules.WS_WIDE_GAIN`` of the row's
    tile's."""
    narrow, cost = rules.tile("wsgemm", m, n, k)
    if cost and WIDE_SMALL_M and \
            cost * _steps(m, n, k, sms, WIDE_M_CONFIG) < rules.WS_WIDE_GAIN * _steps(m, n, k, sms, narrow):
        return WIDE_M_CONFIG
    return narrow


# on layers narrower than this, M = 33..128 keeps mma.py / wgmma.py (``rules.RULES``)
MIN_N_SMALL_M = rules.WSGEMM_MIN_N_SMALL_M

# The split tail (``plan``). Costs in K steps of one SM: a program's ring fill and epilogue cost about
# PROGRAM_STEPS steps beside its own; the summing launch about SUM_STEPS plus one step per SUM_BYTES_A_STEP
# bytes it and the partial stores move (H200: a 256 x 128 x 64 step takes about 0.85 us on an SM, the
# summing kernel streams about 3 TB/s and costs 2-3 us to launch). A split part keeps at least
# MIN_PART_STEPS steps and whole scale groups (256 K).
PROGRAM_STEPS = 4
SUM_STEPS = 3
SUM_BYTES_A_STEP = 2.5e6
MIN_PART_STEPS = 16
MAX_SPLITS = 4
MIN_SPLIT_GAIN = 0.95  # split only where the model predicts 5% less time


def _span(tiles: int, full: int, parts: int, chunk: int, steps: int, sms: int, over: float) -> float:
    """When the last SM finishes (in K steps): programs start in grid order, each on the SM that is free
    first; ``full`` whole tiles, then ``parts`` programs for each of the other tiles; every program
    costs ``over`` steps beside its own."""
    per_sm, extra = divmod(full, sms)
    heap = [(per_sm + (i < extra)) * (steps + over) for i in range(sms)]
    heapq.heapify(heap)
    split = [chunk] * (parts - 1) + [steps - chunk * (parts - 1)]
    for _ in range(tiles - full):
        for c in split:
            heapq.heapreplace(heap, heap[0] + c + over)
    return max(heap)


@functools.lru_cache(maxsize=1024)
def plan(m: int, n: int, k: int, sms: int = 132, cfg: tuple = DEFAULT_CONFIG) -> tuple:
    """How the tiles go to programs: ``(full_tiles, splits, k_chunk, nt0, fill)``. The tiles of weight
    columns ``nt0`` on are cut into ``splits`` K ranges of ``k_chunk`` steps each (summed in fp32 by a
    second launch) when the cost model above predicts 5% less time than whole tiles, whose last
    wave would leave SMs idle (Llama-3.1 8B qkv at M = 1024: 192 tiles on 132 SMs). ``fill``: the
    work over the SMs' time with the summing counted as SM time (for whole tiles, the wave fill)."""
    bm, bn, bk = cfg[:3]
    num_m, n_tiles = cdiv(m, bm), cdiv(n, bn)
    tiles, steps = num_m * n_tiles, k // bk
    group = max(1, 256 // bk)  # K steps a scale group covers
    best, best_summing = (tiles, 1, steps, n_tiles), 0.0  # whole tiles
    best_cost = MIN_SPLIT_GAIN * _span(tiles, tiles, 1, steps, steps, sms, PROGRAM_STEPS)
    for full_waves in sorted({max(0, tiles // sms - 1), tiles // sms}):
        nt0 = min(n_tiles, full_waves * sms // num_m)
        full = nt0 * num_m
        for splits in range(2, MAX_SPLITS + 1):
            chunk = cdiv(cdiv(steps, splits), group) * group
            parts = cdiv(steps, chunk)
            if full == tiles or parts < 2 or chunk < MIN_PART_STEPS:
                continue
            # the partial sums written and read in fp32, the output written once
            moved = m * (min(n, n_tiles * bn) - nt0 * bn) * (8 * parts + 2)
            summing = SUM_STEPS + moved / SUM_BYTES_A_STEP
            cost = _span(tiles, full, parts, chunk, steps, sms, PROGRAM_STEPS) + summing
            if cost < best_cost:
                best, best_summing, best_cost = (full, parts, chunk, nt0), summing, cost
    full, parts, chunk, nt0 = best
    fill = tiles * steps / (sms * (_span(tiles, full, parts, chunk, steps, sms, 0) + best_summing))
    return full, parts, chunk, nt0, fill


# bytes a program adds up (fp32 partials read, the output written) in the time of one K step: about 70 GB/s
# an SM (a guess on the safe side; 8B qkv at M = 1024 left 36 K steps for 5 tiles, and the sums hid in them)
SUMMER_BYTES_A_STEP = 6e4


@functools.lru_cache(maxsize=1024)
def summing_plan(m: int, n: int, k: int, sms: int = 132, cfg: tuple = DEFAULT_CONFIG) -> Optional[tuple]:
    """Where ``plan`` splits tiles and also keeps whole ones, the split tiles can be summed in the same
    launch by whole-tile programs that would otherwise leave their SM idle at the end: the parts run
    first (item order), the whole tiles after, and the whole tiles that end earliest (in the cost
    model's schedule: programs start in item order on the SM that is free first, each costing its steps
    + ``PROGRAM_STEPS``) each add up a share of the split tiles once their parts are done. Llama-3.1 8B
    qkv at M = 1024: 120 half-tile parts and 12 whole tiles start together; those 12 end half a tile
    before the other 120 whole tiles, time for 5 split tiles each. Returns ``(n_parts, table, summers)``,
    ``table[item]`` the summing index of a whole-tile item (``summers`` of them) or -1; None where no
    such programs have the idle time (no split, no whole tiles, or too little time: the summing launch)."""
    full, parts, chunk, _, _ = plan(m, n, k, sms, cfg)
    bm, bn, bk = cfg[:3]
    tiles, steps = cdiv(m, bm) * cdiv(n, bn), k // bk
    n_split = tiles - full
    if parts < 2 or full == 0 or n_split == 0:
        return None
    split = [chunk] * (parts - 1) + [steps - chunk * (parts - 1)]
    costs = [c + PROGRAM_STEPS for _ in range(n_split) for c in split] + [steps + PROGRAM_STEPS] * full
    n_parts = n_split * parts
    heap = [(0.0, sm) for sm in range(sms)]
    last = {}
    for item, cost in enumerate(costs):
        start, sm = heapq.heappop(heap)
        heapq.heappush(heap, (start + cost, sm))
        last[sm] = (item, start + cost)
    span = max(end for end, _ in heap)
    idle = sorted(((span - end, item) for item, end in last.values() if item >= n_parts), reverse=True)
    tile_steps = bm * bn * (4 * parts + 2) / SUMMER_BYTES_A_STEP
    for count in range(min(len(idle), n_split), 0, -1):  # (more programs than split tiles would idle)
        if idle[count - 1][0] >= cdiv(n_split, count) * tile_steps:
            table = [-1] * len(costs)
            for j, (_, item) in enumerate(sorted(idle[:count], key=lambda e: e[1])):
                table[item] = j
            return n_parts, tuple(table), count
    return None


_COUNTERS: dict = {}  # device index -> (int32 zeros, entries handed out)
_SHARED: dict = {}    # device index -> int32 zeros of the plan-less (one-off) calls
_TABLES: dict = {}    # (device index, summing plan) -> the table on the device


def _summing_state(device: torch.device, n_split: int, table: tuple, own: bool):
    """(counters, table on the device) for a launch that sums its split tiles, or None inside a CUDA
    graph capture that would need new ones (zeros written only when the graph runs; the caller then takes
    the summing launch). Counters are zero and left zero by every launch that completes (a summing
    program resets each tile's). ``own``: a slice no other launch plan uses (a layer's plan, so plans may
    run on different streams at once); otherwise the device's shared ones (the one-off eager calls, one
    at a time on a device)."""
    index = _index(device)
    capturing = torch.cuda.is_current_stream_capturing()
    on_device = _TABLES.get((index, table))
    if on_device is None:
        if capturing:
            return None
        on_device = _TABLES[(index, table)] = torch.tensor(table, dtype=torch.int32, device=device)
    if not own:
        buf = _SHARED.get(index)
        if buf is None or buf.numel() < n_split:
            if capturing:
                return None
            buf = _SHARED[index] = torch.zeros(max(n_split, 4096), dtype=torch.int32, device=device)
        return buf[:n_split], on_device
    chunk, used = _COUNTERS.get(index, (None, 0))
    if chunk is None or used + n_split > chunk.numel():
        if capturing:
            return None
        chunk, used = torch.zeros(max(1 << 14, n_split), dtype=torch.int32, device=device), 0
    _COUNTERS[index] = (chunk, used + n_split)
    return chunk[used:used + n_split], on_device


def preferred(m: int, n: int, k: int, sms: int = 132, w4a4: bool = False) -> bool:
    """The shape rule for the dispatch (after ``ready(device)`` answered None): K % 64 == 0 and a wsgemm row
    of ``rules.RULES`` (M, N and K ranges, W4A4; where the row asks, ``fills``: the plan for ``sms`` SMs
    splits the last wave or fills ``rules.WSGEMM_MIN_FILL`` of the SMs). The measurements behind each row
    are named there."""
    return supports(m, n, k) and rules.first(
        rules.RULES, rules.Call(m, n, k, None, None, w4a4), "wsgemm",
        {"wsgemm_fills": lambda c: fills(m, n, k, sms), "wsgemm_ready": lambda c: True}) is not None


def fills(m: int, n: int, k: int, sms: int = 132) -> bool:
    """Whether the plan of M's tile for ``sms`` SMs splits the last wave's tiles or fills at least
    ``rules.WSGEMM_MIN_FILL`` of the SMs with whole tiles."""
    _, splits, _, _, fill = plan(m, n, k, sms, config(m, n, k, sms))
    return splits > 1 or fill >= rules.WSGEMM_MIN_FILL


def supports(m: int, n: int, k: int) -> bool:
    """Whether the kernel takes this shape: K a multiple of 64 (whole K steps; where K % 256 != 0 the
    scale rows are read from a padded copy, ``tma_scales``, and the last scale group is partial)."""
    return m > 0 and n > 0 and k > 0 and k % 64 == 0


# ``tma_scales``' copies, one a scale tensor: {id: (a weak reference to it, its version counter, its data
# pointer, the copy)}; an entry goes when its tensor does (weakref.finalize). (Not a WeakKeyDictionary:
# its lookups compare keys with ``==``, which tensors answer elementwise.)
_PADDED_SCALES: dict = {}


def tma_scales(sbits: torch.Tensor, owner: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The scale bytes ``sbits`` ``[N, K/16]`` (uint8) as TMA reads them: rows at 16-byte strides from a
    16-byte aligned start. Where K % 256 != 0 their rows are not (Qwen2-72B's down layer, K = 29568:
    1848 bytes), so this is a copy whose rows are padded to the next multiple of 16 bytes (a view of its
    first K/16 columns; the padding is never read: TMA fills past column K/16 with zeros). With ``owner``
    (the weight's scale tensor, which ``sbits`` views) the copy is kept while ``owner`` lives, one a
    weight rather than one a launch plan, and made again after an in-place write to ``owner`` (its
    version counter; an inference tensor has none, so it gets a fresh copy each time). A CUDA graph
    captured while the copy was kept reads that copy on replay: capture again after writing such a
    weight's scales in place (launch plans, which would keep it too, are not built for these layers)."""
    n, kb = sbits.shape
    if sbits.stride(1) == 1 and sbits.stride(0) % 16 == 0 and sbits.data_ptr() % 16 == 0:
        return sbits
    if kb % 16 == 0:
        return sbits.contiguous()
    version = None if owner is None or owner.is_inference() else owner._version
    hit = _PADDED_SCALES.get(id(owner)) if version is not None else None
    mine = hit is not None and hit[0]() is owner
    if mine and hit[1:3] == (version, sbits.data_ptr()):
        return hit[3]
    padded = torch.zeros(n, cdiv(kb, 16) * 16, dtype=torch.uint8, device=sbits.device)[:, :kb]
    padded.copy_(sbits)
    if version is not None:
        if not mine:
            weakref.finalize(owner, _PADDED_SCALES.pop, id(owner), None)
        _PADDED_SCALES[id(owner)] = (weakref.ref(owner), version, sbits.data_ptr(), padded)
    return padded


# The operands swapped (``SWAP``): the decoded weight tile as wgmma's A operand and the activation tile as its
# B (m64n256k16 on the 256 x 128 tile), so a warpgroup reads the [256, 64] activation slice once a step
# instead of the decoded [128, 64] tile once per 64 activation rows: 80 KB of wgmma operand reads a step
# instead of 96 (the decoder, its rings and the TMA copies unchanged). H200 (results/wsgemm_h200_swap.json,
# six Llama-3.1 layers at M = 256..2048, W4A4 at 1024 / 8192, 3 interleaved rounds): outputs bit-equal to
# the unswapped build on every row and check; 23 of 29 rows 1-8% faster (8B o at M = 1024 57.7 -> 54.5 us,
# 8B down at 512 108.9 -> 100.4, W4A4 8B qkv at 8192 779 -> 738), the other 6 within 1.5% either way.


def swapped(cfg: tuple) -> bool:
    """Whether a tile runs with its operands swapped: where it has more activation rows than weight
    rows (only there do the operand reads shrink)."""
    return cfg[0] > cfg[1]


def consumer_warps(bm: int, bn: int) -> int:
    """The consumer partition's warps: one warpgroup where the accumulator tile has at most 8192
    elements (64 fp32 registers a thread: 64 x 128 or 128 x 64), two otherwise (each 64 or 128 rows)."""
    return 4 if bm * bn <= 8192 else 8


def check_config(cfg: tuple) -> Optional[str]:
    bm, bn, bk, xs, bs, dec_warps, dec_regs, maxnreg = cfg
    if bm not in (64, 128, 256) or bn not in (64, 128, 256) or bk not in (64, 128) or dec_warps not in (4, 8):
        return "BM 64, 128 or 256, BN 64, 128 or 256, BK 64 or 128, 4 or 8 decoder warps"
    if xs < 3 or bs < 2:
        return "the TMA ring needs at least 3 stages (2 steps ahead), the decoded ring 2"
    smem = xs * (bm * bk * 2 + bn * bk // 2) + bs * bn * bk * 2 + 2 * bn * 16
    if smem > 220 * 1024:
        return f"{smem} bytes of shared memory (at most 220 KB)"
    return None


@functools.lru_cache(maxsize=64)
def _smem_layout(rows: int, cols: int, dtype):
    """The TMA tile's shared layout (built once: Gluon's layout objects cost tens of us each in eager calls)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)


def matmul(x2: torch.Tensor, words: torch.Tensor, sbits: torch.Tensor, enc: torch.Tensor,
           x_enc: Optional[torch.Tensor], bias: Optional[torch.Tensor], y: torch.Tensor,
           cfg: Optional[tuple] = None, swap: Optional[bool] = None,
           scale_owner: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y [M, N] = x2 [M, K] @ W^T`` (bf16/fp16 x, K % 64 == 0) from the packed
    weight (``words`` int32 [N, K/8], ``sbits`` uint8 [N, K/16], ``enc`` its
    global scale), as ``mma.matmul``; ``x_enc``: the activations' global scale
    (W4A4: ``x2`` is then the exact ``v * scale`` operand of the quantize kernel), or None.
    ``swap``: the operands swapped (None: ``swapped``; True / False for comparisons); ``scale_owner``: the
    weight's scale tensor that ``sbits`` views (``tma_scales`` keeps a padded copy with it)."""
    x2, sbits = aligned_operands(x2, sbits)
    return launches(x2, words, sbits, enc, x_enc, bias, y, cfg, swap=swap, scale_owner=scale_owner)(x2, y)


def launches(x2: torch.Tensor, words: torch.Tensor, sbits: torch.Tensor, enc: torch.Tensor,
             x_enc: Optional[torch.Tensor], bias: Optional[torch.Tensor], y: torch.Tensor,
             cfg: Optional[tuple] = None, slots=(0, 6), own_counters: bool = False,
             swap: Optional[bool] = None, scale_owner: Optional[torch.Tensor] = None):
    """``matmul``'s launches for operands shaped like these (``aligned_operands`` already), as a
    callable ``run(*tensors) -> y`` taking x, (in a W4A4 plan, ``slots`` (0, 4, 6): the activations'
    global scale,) and y: the weight's TMA descriptors are built once, x's for each call. Split tiles
    are summed in the launch where ``summing_plan`` allows (tile counters of the
    plan's own with ``own_counters``), otherwise by a second launch. Scale rows TMA cannot read where
    they are (K % 256 != 0) come from ``tma_scales``' padded copy, kept with ``scale_owner``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m, k = x2.shape
    n = words.shape[0]
    if x2.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the warp-specialized path takes bf16 or fp16 activations, got {x2.dtype}")
    if not supports(m, n, k):
        raise ValueError(f"the warp-specialized path takes K % 64 == 0, got M={m}, N={n}, K={k}")
    from ._common import _sm_count, split_finish

    cfg = cfg or config(m, n, k, _sm_count(x2.device))
    reason = check_config(cfg)
    if reason:
        raise ValueError(f"wsgemm: config {cfg}: {reason}")
    bm, bn, bk, xs, bs, dec_warps, dec_regs, maxnreg = cfg
    warps = consumer_warps(bm, bn)
    swap = swapped(cfg) if swap is None else bool(swap)
    if swap and bn % (16 * warps):
        raise ValueError(f"wsgemm: config {cfg}: swapped operands need {16 * warps} weight rows or a multiple "
                         f"(16 a consumer warp), got {bn}")
    if words.stride(1) != 1 or words.data_ptr() % 16 or (words.stride(0) * 4) % 16:
        words = words.contiguous()
    sbits = tma_scales(sbits, scale_owner)
    x_layout = _smem_layout(bm, bk, gl.float16 if x2.dtype == torch.float16 else gl.bfloat16)
    w_desc = TensorDescriptor.from_tensor(words, [bn, bk // 8], _smem_layout(bn, bk // 8, gl.int32))
    s_desc = TensorDescriptor.from_tensor(sbits, [bn, 16], _smem_layout(bn, 16, gl.uint8))
    has_bias = bias is not None
    tiles = cdiv(m, bm) * cdiv(n, bn)
    sms = _sm_count(x2.device)
    full, splits, chunk, nt0, _ = plan(m, n, k, sms, cfg)
    n0 = nt0 * bn
    summing = summing_plan(m, n, k, sms, cfg) if splits > 1 else None
    state = _summing_state(x2.device, tiles - full, summing[1], own_counters) if summing else None
    if state is None:
        summing = None
    n_parts, _, n_summers = summing if summing else (0, None, 1)
    counters, table = state if state else (enc, enc)
    # the split tiles' fp32 partial sums [splits, M, N - n0], summed in order into y[:, n0:] in the launch
    # (``summing``) or by a second one
    part_shape = (splits, m, n - n0)
    launch = Launch(
        _ws_kernel, (full + (tiles - full) * splits,),
        (None, w_desc, s_desc, enc, x_enc.reshape(1) if x_enc is not None else enc, bias if has_bias else enc, y,
         None, m, n, y.stride(0), k // bk, full, splits, chunk, n0, n_parts, counters, table, n_summers),
        tuple(slots) + (7,),
        dict(HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, BM=bm, BN=bn, BK=bk, XSTAGES=xs, BSTAGES=bs,
             WARPS=warps, DEC_WARPS=dec_warps, DEC_REGS=dec_regs, SUM_SPLITS=splits if summing else 0, SWAP=swap,
             num_warps=warps, maxnreg=maxnreg))
    finish = split_finish(splits, y[:, n0:], bias[n0:] if has_bias else None) if splits > 1 and not summing else None

    def run(x2, *tensors):
        y = tensors[-1]
        part = torch.empty(part_shape, dtype=torch.float32, device=y.device) if splits > 1 else enc
        launch(TensorDescriptor.from_tensor(x2, [bm, bk], x_layout), *tensors, part)
        if finish:
            finish(part, y[:, n0:])
        return y
    return run


_READY: dict = {}
_LABEL = "the warp-specialized path"


def _self_test(device: torch.device) -> Optional[str]:
    """Partial row and column tiles, one K step, fp16, tiles split by K (``plan``: the 10 tiles of
    300 x 520 x 4096 in 4 ranges of 16 steps on any GPU of 40 SMs or more), the 64- and 128-row
    tiles of M <= 128 (one consumer warpgroup; fp16), the 128 x 256 tile (at M = 300 too), and K % 256 != 0 (K = 1088:
    scale rows of 68 bytes read from ``tma_scales``' padded copy, a last scale group of one K step)."""
    err = product_check(matmul, ((300, 520, 1024, torch.bfloat16), (129, 256, 256, torch.bfloat16),
                                 (200, 300, 1280, torch.float16), (300, 520, 4096, torch.bfloat16),
                                 (40, 520, 1024, torch.bfloat16), (100, 300, 1280, torch.float16),
                                 (300, 200, 1088, torch.bfloat16), (100, 300, 1088, torch.float16)), device)
    if err is None:  # the 128 x 256 tile (wide layers only, so on a small shape by name): one row tile at
        # M = 65..128, several above (``config``: M = 257..384 and the like)
        err = product_check(functools.partial(matmul, cfg=WIDE_M_CONFIG),
                            ((100, 600, 1024, torch.bfloat16), (70, 300, 1280, torch.float16),
                             (300, 600, 1024, torch.bfloat16)), device)
    return err


def ready(device: torch.device) -> Optional[str]:
    """None when ``device`` is an sm_90 GPU on which the kernel compiled and
    passed its self-test (decided once per device), otherwise why not (with a
    warning, once, when the self-test failed)."""
    index = _index(device)
    return decide_once(_READY, index, lambda: sm90_reason(index, _LABEL), _self_test, _LABEL)


def disable(device: torch.device, reason: str) -> None:
    """Stop using the kernel on ``device`` (a launch failed after the self-test passed)."""
    stop_using(_READY, _index(device), reason, _LABEL)


__all__ = ["WIDE_M_CONFIG", "WIDE_SMALL_M", "swapped", "summing_plan", "DEFAULT_CONFIG", "MIN_N_SMALL_M", "SMALL_M_CONFIG", "TINY_M_CONFIG", "check_config", "fills", "config", "decode_asm", "disable", "launches", "matmul",
           "plan", "preferred", "ready", "supports"]
