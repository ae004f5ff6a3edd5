"""NVFP4 GEMM (W4A16, and W4A4 on the quantized activations) for M = 64..1024
rows on Hopper's warpgroup MMA (wgmma), with the weight decoded in registers,
written in Gluon. sm_90 only; bf16 or fp16 activations, K % 128 == 0. The
dispatch uses it for 65 <= M <= 128 where wsgemm.py's 128-row tile does not run (that one is
1.20-1.62x faster on the measured Llama layers, results/wsgemm_small_m_h200.json).

Swap-AB, as in mma.py: ``y^T = W x^T``. The decoded weight tile is wgmma's
register A operand (64 weight rows a warpgroup), the activations the
shared-memory B operand (the M rows are wgmma's N, 64..256 a tile).

* A register A operand of ``warpgroup_mma`` only compiles with ``k_width = 2``
  (Triton 3.6): a thread holds the K pairs ``(2c + 8r, 2c + 8r + 1)`` of rows
  ``g`` and ``g + 8`` (``c = lane % 4``, ``g = lane // 4``, ``r`` the register
  pair). mma.py's decode turns a word of 8 codes into four pairs, codes
  ``(p, p + 4)`` in register ``p``; here one word feeds four pairs of one row
  (``r = r0 + 2 r1`` inside a 32-wide K chunk), so K is relabelled: logical
  ``32 t + 16 r1 + 8 r0 + 2 c + h`` <- code ``r0 + 2 r1 + 4 h`` of word
  ``S c + t`` of the step (``S = BK / 32`` words a thread, contiguous in
  memory). For ``r1 = 1`` the word is shifted right by 8 first, so the same
  two decode lines (codes (0, 4) and (1, 5)) serve both halves (``_decode_asm``).
* The activations are put in the same K order once per CTA: their tile is
  read in a layout where a thread holds the four 8-element chunks that mix,
  permuted in registers and stored into an NVMMA-swizzled buffer that every
  warpgroup's wgmma reads. A dot product does not depend on the order of its
  terms, only on both operands agreeing.
* Words and scale bytes go through a cp.async ring; the activations are
  prefetched in registers (v1 also had them in the ring: no faster, and
  Triton 3.6's ptxas crashes on that variant of v2).
  wgmma runs asynchronously: while step i's MMA runs, the CTA stores step
  i + 1's activations into the next of three B buffers and, with wait depth 1,
  also decodes step i + 1 after the step's one barrier (the H200 found depth 0
  as fast or faster up to M = 128: the default there). Steps go in pairs with
  their A operands in two variables, so no register of an in-flight wgmma is
  written (v1 kept one loop-carried A and gave wrong results at depth 1,
  probably for that reason).
* Numerics as mma.py: exact products ``x * (v * scale * 2^-26)`` (bf16;
  ``2^-14`` fp16) summed in fp32 by the tensor core, ``2^26 / global_enc``
  once per output; split K through _common.py's fp32 workspace and ordered sum.

Measured on the H200 (benchmarks/NOTES.md, "Kernels, sixth pass"): correct
(1.66e-3 relative error, as the tiled GEMM), 1.05-1.37x the dequantize + cuBLAS
path at M = 128, level with mma.py at M = 64, far behind cuBLAS at M >= 256:
``preferred`` is the shape rule that follows. The dispatch may use the kernel on
a device only after ``ready`` (sm_90 and a self-test there) passed. CPU tests:
tests/test_wgmma.py; GPU checks and timings: benchmarks/wgmma_h200.py
(results/wgmma_h200*.json).
"""
from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)

from . import rules
from ._common import Launch, cdiv
from ._gluon import (_DECODE_CONSTRAINTS, DECODE_SHIFTS, DECODE_SHIFTS_F16, MAG_MASK, MAG_MASK_F16, _bits, _copy,
                     _index, _layouts, _sync, decide_once, decode_line, decode_mul_line, product_check, run_once,
                     sm90_reason, stop_using, store_output)


def _decode_asm(shifts=DECODE_SHIFTS, mag_mask=MAG_MASK, mul="mul.rn.bf16x2") -> str:
    """PTX of one pack of 8 A-operand elements: in the wgmma register order
    (``h``, row ``+8``, ``r0``) they are $0 = (row g, r0 = 0), $1 = (row g + 8,
    r0 = 0), $2 = (g, 1), $3 = (g + 8, 1); the word of row g is $4, of row g + 8
    $6 (inputs $4-$11 are the 8 word copies), their scale pairs $12 and $13.
    Register (row, r0) gets codes (r0, r0 + 4) of its row's word by mma.py's
    shifts for p = r0, times the scale pair (an exact product)."""
    lines = [decode_line(f"${q}", f"${4 + 2 * (q % 2)}", f"${12 + q % 2}", shifts[q // 2], mag_mask, mul)
             for q in range(4)]  # q = 2 r0 + (row g + 8)
    return "\n".join(["{", ".reg .b32 a, b;", *lines, "}"])


def _decode_mul_asm() -> str:
    """``_decode_asm``'s bf16 PTX with mma.py's multiply decode (``decode_mul_line``: 4 operations a
    register instead of 6; the words of codes 2, 3, 6, 7 come shifted right by 8 already)."""
    lines = [decode_mul_line(f"${q}", f"${4 + 2 * (q % 2)}", f"${12 + q % 2}", q // 2) for q in range(4)]
    return "\n".join(["{", ".reg .b32 a;", *lines, "}"])


# The bf16 decode by multiply (_gluon.decode_mul_line), bit-equal to the shifts (``_decode_asm()``, which the
# tests hold it against); H200 (results/muldec_tc_h200.json): 2-10% faster at M = 96 / 128 on all ten rows
# (8B k 11.09 -> 10.80 us, Qwen2-7B qkv 29.8 -> 27.1). fp16 decodes by the shifts.
_DECODE_MUL = gl.constexpr(_decode_mul_asm())
_DECODE_F16 = gl.constexpr(_decode_asm(DECODE_SHIFTS_F16, MAG_MASK_F16, "mul.rn.f16x2"))


def logical_to_actual(bk: int) -> list:
    """K relabelling of one step: entry ``kl`` is the memory K offset whose code
    (and activation) the MMA sees at logical K ``kl`` (see the module docstring)."""
    s = bk // 32
    out = []
    for kl in range(bk):
        h, c, r0, r1, t = kl & 1, (kl >> 1) & 3, (kl >> 3) & 1, (kl >> 4) & 1, kl >> 5
        out.append(8 * (s * c + t) + r0 + 2 * r1 + 4 * h)
    return out


def _x_layout(bm: int, bk: int, warps: int) -> gl.DistributedLinearLayout:
    """Register layout of an activation tile ``[BM, BK]`` (memory K order) in
    which a thread holds the four 8-element chunks ``S c + t`` (c = 0..3) of
    one row and one ``t``: exactly the elements that the relabelling mixes, so
    the permutation into logical K order moves no data between threads."""
    s = bk // 32
    regs = [[0, 1], [0, 2], [0, 4], [0, 8 * s], [0, 16 * s]]
    lanes = [[0, 8 * b] for b in _bits(s)]
    spread = lanes + [[1 << i, 0] for i in range(bm.bit_length() - 1)]  # t bits, then rows
    lane_bases = spread[:5]
    rest = spread[5:]
    while len(lane_bases) < 5:
        lane_bases.append([0, 0])
    nw = warps.bit_length() - 1
    warp_bases = rest[:nw]
    while len(warp_bases) < nw:
        warp_bases.append([0, 0])
    regs += rest[nw:]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lane_bases, warp_bases=warp_bases,
                                      block_bases=[], shape=[bm, bk])


def _layouts_wg(bn: int, bm: int, bk: int, warps: int):
    """(words, scale bytes, activations, scale copies) layouts."""
    words, scales, _, s_copy, _ = _layouts(bn, 8, bk, warps)
    return words, scales, _x_layout(bm, bk, warps), s_copy


@gluon.jit
def _spread(v):
    """``[.., t, c, r1]`` -> ``[.., t, c, r1, r0, h]``: a copy for each of r0 and h."""
    v = gl.join(v, v)  # [.., S, 4, r0]
    v = gl.join(v, v)  # [.., S, 4, r0, h]
    return v


@gluon.jit
def _a_operand(wp, sb, a_l: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, F16: gl.constexpr):
    """One step's words ``[BN, BK/8]`` and scale bytes ``[BN, BK/16]`` -> the
    decoded, scaled weight ``[BN, BK]`` in the wgmma A layout (logical K)."""
    S: gl.constexpr = BK // 32
    T: gl.constexpr = BK // 64
    # E4M3 byte << 7 is the fp16 scale * 2^-8 (subnormals included); * 2^108 -> scale * 2^100 (bf16, exact)
    s32 = (sb.to(gl.int16) << 7).to(gl.float16, bitcast=True).to(gl.float32)
    if F16:
        sc = (s32 * 256.0).to(gl.float16)
    else:
        sc = (s32 * 3.2451855365842673e32).to(gl.bfloat16)
    w = gl.permute(gl.reshape(wp, [BN, 4, S]), [0, 2, 1])  # [BN, t, c]: word S c + t
    w = gl.join(w, w >> 8)  # [BN, t, c, r1]: r1 = 1 decodes codes 2, 3, 6, 7 with the shifts of 0, 1, 4, 5
    w = gl.permute(_spread(w), [0, 1, 3, 4, 2, 5])  # [BN, t, r1, r0, c, h]
    w = gl.convert_layout(gl.reshape(w, [BN, BK]), a_l, assert_trivial=True)
    sc = gl.reshape(sc, [BN, 4, T])
    sc = gl.permute(gl.reshape(gl.join(sc, sc), [BN, 4, S]), [0, 2, 1])  # [BN, t, c]: block (S c + t) // 2
    sc = gl.join(sc, sc)
    sc = gl.permute(_spread(sc), [0, 1, 3, 4, 2, 5])
    sc = gl.convert_layout(gl.reshape(sc, [BN, BK]), a_l, assert_trivial=True)
    if F16:
        a = gl.inline_asm_elementwise(_DECODE_F16, _DECODE_CONSTRAINTS, [w, sc], gl.float16, True, 8)
    else:
        a = gl.inline_asm_elementwise(_DECODE_MUL, _DECODE_CONSTRAINTS, [w, sc], gl.bfloat16, True, 8)
    return a


@gluon.jit
def _b_store(xr, b_smem, BM: gl.constexpr, BK: gl.constexpr):
    """Activations ``[BM, BK]`` (memory K order, ``_x_layout``) -> the B buffer
    ``[BK, BM]`` in logical K order."""
    S: gl.constexpr = BK // 32
    x = gl.reshape(xr, [BM, 4, S, 2, 2, 2])  # K = 8 S c + 8 t + 4 h + 2 r1 + r0
    x = gl.reshape(gl.permute(x, [0, 2, 4, 5, 1, 3]), [BM, BK])  # [m, t, r1, r0, c, h]
    b_smem.store(gl.permute(x, [1, 0]))


@gluon.jit
def _step(i, acc, a_prev, xr, w_ring, s_ring, b_buf, w_ptr, s_ptr, x_ptr, w_off, sc_off, x_off,
          k_lo, k_last, a_l: gl.constexpr, F16: gl.constexpr, STAGES: gl.constexpr,
          BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr,
          XL: gl.constexpr, WAIT: gl.constexpr):
    """K step ``i``: decode its weight, issue its wgmma (B buffer ``i % 3``, stored
    during step ``i - 1``), store step ``i + 1``'s activations into buffer
    ``(i + 1) % 3`` while the wgmma runs, then wait until only this step's
    wgmma is in flight (``a_prev``, the previous step's A, stays live until
    then). One barrier a step: it publishes ring step ``i`` and buffer
    ``i % 3``; buffer ``(i + 1) % 3`` was last
    read by wgmma ``i - 2``, which every warpgroup finished before it."""
    async_copy.wait_group(STAGES - 2)
    _sync()
    slot = i % STAGES
    wp = w_ring.index(slot).load(WL)
    sb = s_ring.index(slot).load(SL)
    a = _a_operand(wp, sb, a_l, BN, BK, F16)
    tok = warpgroup_mma(a, b_buf.index(i % 3), acc, is_async=True)
    _b_store(xr, b_buf.index((i + 1) % 3), BM, BK)
    # the proxy fence compiles to MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S: the MEMBAR may wait for this
    # thread's outstanding memory operations, so the next loads are issued after it (v2 issued them
    # before)
    fence_async_shared()
    nxt = (i + STAGES - 1) % STAGES
    kc = gl.multiple_of(gl.minimum(k_lo + (i + STAGES - 1) * BK, k_last), BK)  # past the end: a reload
    _copy(w_ring.index(nxt), w_ptr + kc // 8 + w_off)
    _copy(s_ring.index(nxt), s_ptr + kc // 16 + sc_off)
    async_copy.commit_group()
    xr = gl.load(x_ptr + gl.multiple_of(gl.minimum(k_lo + (i + 2) * BK, k_last), BK) + x_off)  # past the end: a reload
    if WAIT == 1:
        acc, a_prev = warpgroup_mma_wait(1, deps=[tok, a_prev])
    else:  # the MMA overlaps the activation store and loads only
        acc = warpgroup_mma_wait(0, deps=[tok, a])[0]
    return acc, a, xr


@gluon.jit
def _wgmma_kernel(
    x_ptr, w_ptr, s_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr,
    M, N, KW8, KB4, stride_x8, stride_ym, K_SPLIT,
    HAS_BIAS: gl.constexpr, HAS_XENC: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr, WAIT: gl.constexpr,
    BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, WARPS: gl.constexpr,
    WL: gl.constexpr, SL: gl.constexpr, XL: gl.constexpr, SC: gl.constexpr,
):
    KW = KW8 * 8  # words a row (K / 8)
    KB = KB4 * 4  # scale bytes a row (K / 16)
    stride_xm = stride_x8 * 8
    F16: gl.constexpr = x_ptr.dtype.element_ty == gl.float16
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                    instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2,
                                              transposed=True)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    rw = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, WL))
    w_off = gl.where(rw < N, rw, 0).to(gl.int64)[:, None] * KW + gl.arange(0, BK // 8, layout=gl.SliceLayout(0, WL))[None, :]
    rc = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, SC))
    sc_off = gl.where(rc < N, rc, 0).to(gl.int64)[:, None] * KB + gl.arange(0, BK // 16, layout=gl.SliceLayout(0, SC))[None, :]
    # rows past N read row 0 and activation rows past M read row 0: computed, never stored
    xm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, XL))
    x_off = gl.where(xm < M, xm, 0).to(gl.int64)[:, None] * stride_xm + gl.arange(0, BK, layout=gl.SliceLayout(0, XL))[None, :]

    k_lo = pid_k * K_SPLIT
    k_hi = gl.minimum(k_lo + K_SPLIT, KW8 * 64)  # K; the last program's K range may be shorter
    k_last = k_hi - BK
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BK // 8], flat)
    s_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, BK // 16], flat)
    b_buf = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [3, BK, BM], b_sl)
    for i in gl.static_range(STAGES - 1):
        kc = gl.multiple_of(gl.minimum(k_lo + i * BK, k_last), BK)
        _copy(w_ring.index(i), w_ptr + kc // 8 + w_off)
        _copy(s_ring.index(i), s_ptr + kc // 16 + sc_off)
        async_copy.commit_group()
    # step 0's activations into B buffer 0 (the first step's barrier publishes them); step 1's in registers
    _b_store(gl.load(x_ptr + gl.multiple_of(k_lo, BK) + x_off), b_buf.index(0), BM, BK)
    xr = gl.load(x_ptr + gl.multiple_of(gl.minimum(k_lo + BK, k_last), BK) + x_off)
    fence_async_shared()

    acc = gl.zeros([BN, BM], gl.float32, layout=acc_l)
    a1 = gl.zeros([BN, BK], x_ptr.dtype.element_ty, layout=a_l)
    # two steps an iteration, with their A operands in two variables: a step's registers are written
    # again only after the wgmma that read them completed (a loop-carried copy could be overwritten
    # while the wgmma is in flight: v1's race)
    for j in range((k_hi - k_lo) // (2 * BK)):
        acc, a0, xr = _step(2 * j, acc, a1, xr, w_ring, s_ring, b_buf, w_ptr, s_ptr, x_ptr, w_off,
                            sc_off, x_off, k_lo, k_last, a_l, F16, STAGES, BN, BM, BK,
                            WL, SL, XL, WAIT)
        acc, a1, xr = _step(2 * j + 1, acc, a0, xr, w_ring, s_ring, b_buf, w_ptr, s_ptr, x_ptr, w_off,
                            sc_off, x_off, k_lo, k_last, a_l, F16, STAGES, BN, BM, BK,
                            WL, SL, XL, WAIT)
    acc = warpgroup_mma_wait(0, deps=[acc])
    async_copy.wait_group(0)

    no = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
    mo = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_l))
    store_output(acc, no, mo, x_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr, M, N, stride_ym, pid_k,
                 HAS_BIAS, HAS_XENC, SPLIT)


def config(m: int, n: int, k: int, sms: int = 132):
    """(BN, BM, BK, warps, K per program, ring stages, wgmma wait depth, register cap):
    ``rules.TILES``' wgmma rows, the K per program ``k_split``'s. Wait depth 1 leaves a
    step's MMA in flight during the next step's decode; a register cap of 128 (0: the
    compiler's choice) fits two CTAs of 8 warps an SM."""
    bn, bm, bk, warps, stages, wait, maxnreg, split = rules.tile("wgmma", m, n, k)
    return bn, bm, bk, warps, k_split(m, n, k, bn, bm, bk, sms, split), stages, wait, maxnreg


def k_split(m: int, n: int, k: int, bn: int, bm: int, bk: int, sms: int, split: tuple) -> int:
    """K per program: K halved while the grid has fewer than ``per_sm`` programs an SM
    (``split``: the row's ``(per_sm, least)``), keeping ``least`` K or more (an even number
    of K steps) a program; where halving stops short of one program an SM (K not divisible
    that way), ranges of whole step pairs, 512 K or more, for about ``per_sm`` programs an
    SM, the last one possibly shorter (``cdiv(K, K per program)`` programs)."""
    per_sm, least = split
    tiles = cdiv(n, bn) * cdiv(m, bm)
    parts = 1
    while tiles * parts < per_sm * sms and k % (parts * 2) == 0 and (k // (parts * 2)) % (2 * bk) == 0 \
            and k // (parts * 2) >= least:
        parts *= 2
    if tiles * parts >= sms or k // parts <= least:
        return k // parts
    per = cdiv(cdiv(k, cdiv(per_sm * sms, tiles)), 2 * bk) * 2 * bk
    return min(k, max(512, per))


def supports(m: int, n: int, k: int) -> bool:
    """Whether the kernel takes this shape: K a multiple of 128 (K steps go in pairs)."""
    return m > 0 and n > 0 and k % 128 == 0


def preferred(m: int, n: int, k: int) -> bool:
    """The shape rule for the dispatch: ``rules.RULES``' wgmma rows (65 <= M <= 128) and K % 128 == 0
    (bf16 or fp16 activations, after ``ready(device)`` answered None)."""
    return supports(m, n, k) and rules.first(rules.RULES, rules.Call(m, n, k, None, None, False), "wgmma",
                                             {"wgmma_ready": lambda c: True}) is not None


def check_config(m: int, k: int, cfg: tuple) -> Optional[str]:
    """Why ``cfg`` does not tile M rows and K (None when it does)."""
    bn, bm, bk, warps, ks, stages, wait, maxnreg = cfg
    if wait not in (0, 1) or maxnreg not in (0, 128, 168, 255):
        return "wait depth 0 or 1, register cap 0 (none), 128, 168 or 255"
    if bn != 16 * warps or warps not in (4, 8, 16) or bm not in (64, 128, 256) or bk not in (64, 128):
        return "BN must be 16 * warps (4, 8 or 16: whole warpgroups), BM 64/128/256, BK 64/128"
    if ks % (2 * bk) or k % (2 * bk) or stages not in (2, 3):
        # (4 stages returned NaN or faulted on the H200 in run v2, not understood: refused)
        return f"K per program {ks} and K={k} must be even numbers of K steps of {bk}; stages 2 or 3"
    return None


_LAYOUTS: dict = {}


def matmul(x2: torch.Tensor, words: torch.Tensor, sbits: torch.Tensor, enc: torch.Tensor,
           x_enc: Optional[torch.Tensor], bias: Optional[torch.Tensor], y: torch.Tensor,
           cfg: Optional[tuple] = None) -> torch.Tensor:
    """``y [M, N] = x2 [M, K] @ W^T`` (bf16/fp16 x, K % 128 == 0) from the packed
    weight (``words`` int32 [N, K/8], ``sbits`` uint8 [N, K/16], ``enc`` its
    global scale), as ``mma.matmul``; ``x_enc``: the activations' global scale
    (W4A4: ``x2`` is then the exact ``v * scale`` operand of the quantize kernel), or None."""
    return run_once(launches, x2, words, sbits, enc, x_enc, bias, y, cfg)


def launches(x2: torch.Tensor, words: torch.Tensor, sbits: torch.Tensor, enc: torch.Tensor,
             x_enc: Optional[torch.Tensor], bias: Optional[torch.Tensor], y: torch.Tensor,
             cfg: Optional[tuple] = None, slots=(0, 6)):
    """``matmul``'s launches for operands shaped like these (``aligned_operands`` already), as a
    callable ``run(*tensors) -> y`` taking the kernel arguments at ``slots`` (x and y; the
    activations' global scale too in a W4A4 plan; y last), as ``mma.launches``."""
    from ._common import _sm_count, split_run, split_workspace

    m, k = x2.shape
    n = words.shape[0]
    if x2.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the wgmma path takes bf16 or fp16 activations, got {x2.dtype}")
    if not supports(m, n, k):
        raise ValueError(f"the wgmma path takes K % 128 == 0, got M={m}, N={n}, K={k}")
    cfg = cfg or config(m, n, k, _sm_count(x2.device))
    reason = check_config(m, k, cfg)
    if reason:
        raise ValueError(f"wgmma: config {cfg} does not tile M={m}, K={k}: {reason}")
    bn, bm, bk, warps, ks, stages, wait, maxnreg = cfg
    key = (bn, bm, bk, warps)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = _layouts_wg(bn, bm, bk, warps)
    wl, sl, xl, sc = _LAYOUTS[key]
    splits = cdiv(k, ks)
    target = split_workspace(splits, y)
    has_bias = bias is not None
    launch = Launch(
        _wgmma_kernel, (cdiv(n, bn), cdiv(m, bm), splits),
        (x2, words, sbits, enc, x_enc.reshape(1) if x_enc is not None else enc, bias if has_bias else enc, target,
         m, n, k // 64, k // 64, x2.stride(0) // 8, y.stride(0), ks), slots,
        dict(HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, SPLIT=splits > 1, STAGES=int(stages), WAIT=int(wait),
             BN=bn, BM=bm, BK=bk, WARPS=warps, WL=wl, SL=sl, XL=xl, SC=sc, num_warps=warps,
             **({"maxnreg": int(maxnreg)} if maxnreg else {})))
    return split_run(launch, splits, y, bias)


_READY: dict = {}


def _self_test(device: torch.device) -> Optional[str]:
    """Partial row and M tiles, split K, both K steps, fp16, a shorter last K range."""
    return product_check(matmul, ((70, 200, 2048, torch.bfloat16), (300, 136, 1152, torch.bfloat16),
                                  (100, 200, 1024, torch.float16), (80, 200, 1664, torch.bfloat16)), device)


def ready(device: torch.device) -> Optional[str]:
    """None when ``device`` is an sm_90 GPU on which the kernel compiled and
    passed its self-test (decided once per device), otherwise why not (with a
    warning, once, when the self-test failed)."""
    index = _index(device)
    return decide_once(_READY, index, lambda: sm90_reason(index, "the wgmma path"), _self_test, "the wgmma path")


def disable(device: torch.device, reason: str) -> None:
    """Stop using the kernel on ``device`` (a launch failed after the self-test passed)."""
    stop_using(_READY, _index(device), reason, "the wgmma path")


__all__ = ["disable", "check_config", "config", "k_split", "launches", "logical_to_actual", "matmul", "preferred",
           "ready", "supports"]
