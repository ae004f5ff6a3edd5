"""Small-M NVFP4 GEMM (W4A16, and W4A4 on the quantized activations) on the
tensor cores with the weight decoded in registers, written in Gluon (Triton's
explicit-layout dialect). CUDA only; bf16 or fp16 activations, M <= 64.

Why Gluon: in plain Triton the decoded weight tile reaches the MMA through
shared memory (a layout conversion per step), and the tiled GEMM stays near
cuBLAS at M = 16. Gluon lets the kernel place every value where ``mma.sync``
(m16n8k16) wants it:

* The weight is the A operand (``y^T = W x^T``: N fills the MMA's 16 rows, M
  its 8-wide columns). With ``k_width = 8`` each thread holds 8 consecutive K
  of a row, i.e. exactly one int32 word of 8 codes. The word is loaded once
  (the 8 elements share an address) and decoded by bit moves (bf16: mask,
  multiply, mask, ``decode_mul_line``; fp16: shifts and masks) into four
  16-bit-float pairs, codes ``(p, p + 4)`` in register ``p``: bf16
  ``v * 2^-126`` times ``scale * 2^100`` (``fma.rn.bf16x2`` with a -0 addend: the product, in
  PTX that sm_80 has; ptxas gives sm_90 the same HMUL2 as ``mul.rn.bf16x2``), or fp16
  ``v * 2^-14`` times ``scale`` (``mul.rn.f16x2``); both products are exact
  (see _common.py for the placements). So the tensor core sees K in the order
  0, 4, 1, 5, 2, 6, 3, 7 within every 8: the activation (B operand, 16 bytes
  per 8 K) is put in the same order with four ``prmt`` per 8 values. A dot
  product does not depend on the order of its terms, only on both operands
  agreeing.
* K is relabelled once more so that a thread's words, scale bytes and
  activations are contiguous in memory (``_layouts``): 16-byte loads, and
  every layout conversion is asserted trivial at compile time.
* Loads go through a cp.async ring in shared memory (3 steps by default; the
  activations' slots XOR-swizzled against bank conflicts), one barrier a step.
* Accumulation is fp32 in the MMA; ``2^26 / global_enc`` (``2^14`` for fp16;
  also divided by the activations' global scale for W4A4) is applied once per
  output, as in the tiled GEMM.

Products ``x * (v * scale)`` are exact in fp32 and summed in fp32, so the
result matches the tiled GEMM up to summation order. K is split over
programs (fp32 workspace + _common.py's ordered summing pass) when N alone
does not fill the GPU; on sm_90 the kernel signals that pass as it starts
and the pass launches as its programmatic dependent (``_common.split_pdl``).
The dispatch uses the kernel on a device only after ``ready`` (a self-test
there) passed.

The Triton interpreter cannot run Gluon: CPU tests emulate the decode's bit
moves, compile this kernel for sm_90 and check its instructions; the numerics
are checked on the GPU against the reference (benchmarks/mma_h200.py,
benchmarks/gpu_module_check_h200.py; results in benchmarks/results/).
"""
from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from . import rules
from ._common import Launch, cdiv, next_pow2
from ._gluon import (_DECODE_CONSTRAINTS, DECODE_SHIFTS, DECODE_SHIFTS_F16, FMA_BF16, MAG_MASK, MAG_MASK_F16, _copy,
                     _index, _layouts, _regs, _sync, decide_once, decode_line, decode_mul_lines, operands_aligned,
                     product_check, run_once, stop_using, store_output)


def _decode_asm(shifts=DECODE_SHIFTS, mag_mask=MAG_MASK, mul=FMA_BF16) -> str:
    """PTX of the decode: operands $0-$3 the four registers, $4 the word (the 8
    copies are one register), $12 the scale pair (bf16x2 ``scale * 2^100`` or
    f16x2 ``scale``); the product is exact in both (``v * scale * 2^-26`` /
    ``v * scale * 2^-14``, the latter down to fp16's smallest subnormal)."""
    lines = [decode_line(f"${p}", "$4", "$12", shifts[p], mag_mask, mul) for p in range(4)]
    return "\n".join(["{", *_regs("a, b", mul), *lines, "}"])


def _decode_mul_asm(mul: str = FMA_BF16) -> str:
    """``_decode_asm``'s bf16 PTX with the multiply decode (``decode_mul_line``): 17 operations a
    word instead of 24, the same bits."""
    return "\n".join(["{", *_regs("a, b", mul), *decode_mul_lines([f"${p}" for p in range(4)], "$4", "$12", mul),
                      "}"])


# The bf16 decode by multiply (``decode_mul_line``), bit-equal to the shifts; H200 (results/muldec_tc_h200.json,
# 3 interleaved rounds): M = 16 on the six Llama-3.1 layers 0.5-2% faster (70B down 65.4 -> 64.1 us), M = 4 / 32
# -6% to +2.4%. bf16 always decodes so (the shift decode, ``_decode_asm()``, is what the tests hold it against);
# fp16 by the shifts.
_DECODE_MUL = gl.constexpr(_decode_mul_asm())
_DECODE_F16 = gl.constexpr(_decode_asm(DECODE_SHIFTS_F16, MAG_MASK_F16, "mul.rn.f16x2"))
# 8 activations (k .. k+7 as four bf16x2: $4 = (x0, x1) .. $7 = (x6, x7)) -> the decode's pairs
# (x0, x4), (x1, x5), (x2, x6), (x3, x7): prmt picks 16-bit halves (selector bytes 0-3: first
# operand, 4-7: second; 0x5410 = both low halves, 0x7632 = both high halves).
PAIR_X_SELECTORS = ((4, 6, 0x5410), (4, 6, 0x7632), (5, 7, 0x5410), (5, 7, 0x7632))
_PAIR_X = gl.constexpr(" ".join(f"prmt.b32 ${p}, ${a}, ${b}, {sel:#06x};"
                                for p, (a, b, sel) in enumerate(PAIR_X_SELECTORS)))


@gluon.jit
def _launch_dependents():
    """griddepcontrol.launch_dependents: the kernel launched after this one as a programmatic
    dependent (_common.split_pdl: the summing pass) may start once every program got here."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], gl.int32, False, 1)


@gluon.jit
def _grid_wait():
    """griddepcontrol.wait: as a programmatic dependent (_common.w4a4_pdl: of the activations' quantize
    launch), wait until that launch has ended and its writes are visible."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], gl.int32, False, 1)


@gluon.jit
def _spread8(v):
    """``[..]`` -> ``[.., 2, 2, 2]``: eight register copies (one per code of a word)."""
    v = gl.join(v, v)
    v = gl.join(v, v)
    return gl.join(v, v)


@gluon.jit
def _load_step(w_ptr, s_ptr, x_ptr, k0, w_off, s_off, x_off):
    return gl.load(w_ptr + k0 // 8 + w_off), gl.load(s_ptr + k0 // 16 + s_off), gl.load(x_ptr + k0 + x_off)


@gluon.jit
def _operands(wp, sb, xp, a_l: gl.constexpr, b_l: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr,
              BK: gl.constexpr):
    """One step's loads -> the MMA's A (decoded, scaled weight ``[BN, BK]``) and
    B (activations ``[BK, BM]``), both in K order ``32 s + 8 c + j`` with the
    pairs of every 8 as (0, 4), (1, 5), (2, 6), (3, 7). No data moves between
    threads (the layout conversions are asserted trivial)."""
    S: gl.constexpr = BK // 32
    T: gl.constexpr = BK // 64
    # E4M3 byte << 7 is the fp16 scale * 2^-8 (subnormals included); * 2^108 -> scale * 2^100, exact in
    # bf16; * 2^8 -> the scale itself in fp16
    s32 = (sb.to(gl.int16) << 7).to(gl.float16, bitcast=True).to(gl.float32)
    if xp.dtype == gl.float16:
        sc = (s32 * 256.0).to(gl.float16)
    else:
        sc = (s32 * 3.2451855365842673e32).to(gl.bfloat16)
    w = gl.permute(gl.reshape(wp, [BN, 4, S]), [0, 2, 1])  # [BN, s, c]
    w = gl.convert_layout(gl.reshape(_spread8(w), [BN, BK]), a_l, assert_trivial=True)
    sc = gl.reshape(sc, [BN, 4, T])
    sc = gl.permute(gl.reshape(gl.join(sc, sc), [BN, 4, S]), [0, 2, 1])  # block of (s, c): T c + s // 2
    sc = gl.convert_layout(gl.reshape(_spread8(sc), [BN, BK]), a_l, assert_trivial=True)
    if xp.dtype == gl.float16:
        a = gl.inline_asm_elementwise(_DECODE_F16, _DECODE_CONSTRAINTS, [w, sc], gl.float16, True, 8)
    else:
        a = gl.inline_asm_elementwise(_DECODE_MUL, _DECODE_CONSTRAINTS, [w, sc], gl.bfloat16, True, 8)
    xt = gl.reshape(gl.permute(gl.reshape(xp, [4, S, 8, BM]), [1, 0, 2, 3]), [BK, BM])
    xt = gl.convert_layout(xt, b_l, assert_trivial=True)
    b = gl.inline_asm_elementwise(_PAIR_X, "=r,=r,=r,=r,r,r,r,r", [xt], xp.dtype, True, 8)
    return a, b


@gluon.jit
def _mma_kernel(
    x_ptr, w_ptr, s_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr,
    M, N, KW8, KB4, stride_x8, stride_ym, K_SPLIT,
    HAS_BIAS: gl.constexpr, HAS_XENC: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
    BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, WARPS: gl.constexpr,
    WL: gl.constexpr, SL: gl.constexpr, XL: gl.constexpr, SC: gl.constexpr, XC: gl.constexpr,
    TRIGGER: gl.constexpr = False, WAIT: gl.constexpr = False,
):
    if TRIGGER:  # K split (_common.split_pdl): the summing pass, a programmatic dependent, may launch now
        _launch_dependents()
    # WAIT (_common.w4a4_pdl): launched as the programmatic dependent of the quantize launch that writes the
    # activations (and their global scale): the ring's first weight and scale copies are issued before
    # griddepcontrol.wait, everything that reads x, x_enc or writes y after it. (The quantize kernel
    # writes no weights, and it started after every earlier launch had ended.) Built for the ring only.
    # Row strides passed in units that make their alignment known to the compiler (K % 64 == 0,
    # activation rows a multiple of 8 elements): 16-byte loads and cp.async copies.
    KW = KW8 * 8  # words a row (K / 8)
    KB = KB4 * 4  # scale bytes a row (K / 16)
    stride_xm = stride_x8 * 8
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    rw = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, WL))
    rs = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, SL))
    w_off = gl.where(rw < N, rw, 0).to(gl.int64)[:, None] * KW + gl.arange(0, BK // 8, layout=gl.SliceLayout(0, WL))[None, :]
    s_off = gl.where(rs < N, rs, 0).to(gl.int64)[:, None] * KB + gl.arange(0, BK // 16, layout=gl.SliceLayout(0, SL))[None, :]
    xm = gl.arange(0, BM, layout=gl.SliceLayout(0, XL))
    x_off = gl.where(xm < M, xm, 0)[None, :] * stride_xm + gl.arange(0, BK, layout=gl.SliceLayout(1, XL))[:, None]
    # rows past N read row 0 and activation rows past M read row 0: computed, never stored

    k_lo = pid_k * K_SPLIT
    k_hi = gl.minimum(k_lo + K_SPLIT, KW8 * 64)  # K; the last program's K range may be shorter (whole steps)
    k_last = k_hi - BK
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    if STAGES >= 2:  # cp.async ring of STAGES steps in shared memory
        flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BK // 8], flat)
        s_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, BK // 16], flat)
        # activations K-major, 16-byte chunks XOR-swizzled by column: the 8 columns a warp reads at once
        # fall in 8 different bank groups (unswizzled, every 256-byte column starts in bank 0: 16-way conflicts)
        k_major: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[0, 1])
        x_ring = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BK, BM], k_major)
        rc = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, SC))
        sc_off = gl.where(rc < N, rc, 0).to(gl.int64)[:, None] * KB + gl.arange(0, BK // 16, layout=gl.SliceLayout(0, SC))[None, :]
        xc = gl.arange(0, BM, layout=gl.SliceLayout(0, XC))
        xc_off = gl.where(xc < M, xc, 0)[None, :] * stride_xm + gl.arange(0, BK, layout=gl.SliceLayout(1, XC))[:, None]
        for i in gl.static_range(STAGES - 1):
            kc = gl.multiple_of(gl.minimum(k_lo + i * BK, k_last), BK)
            _copy(w_ring.index(i), w_ptr + kc // 8 + w_off)
            _copy(s_ring.index(i), s_ptr + kc // 16 + sc_off)
            if not WAIT:
                _copy(x_ring.index(i), x_ptr + kc + xc_off)
                async_copy.commit_group()
        if WAIT:  # the weight steps above are uncommitted: they join the first commit group below
            _grid_wait()
            for i in gl.static_range(STAGES - 1):
                kc = gl.multiple_of(gl.minimum(k_lo + i * BK, k_last), BK)
                _copy(x_ring.index(i), x_ptr + kc + xc_off)
                async_copy.commit_group()
        for i in range((k_hi - k_lo) // BK):
            async_copy.wait_group(STAGES - 2)
            _sync()  # step i is in; every thread is done with step i - 1's slot
            slot = i % STAGES
            wp = w_ring.index(slot).load(WL)
            sb = s_ring.index(slot).load(SL)
            xp = x_ring.index(slot).load(XL)
            nxt = (i + STAGES - 1) % STAGES
            kc = gl.multiple_of(gl.minimum(k_lo + (i + STAGES - 1) * BK, k_last), BK)  # past the end: a reload
            _copy(w_ring.index(nxt), w_ptr + kc // 8 + w_off)
            _copy(s_ring.index(nxt), s_ptr + kc // 16 + sc_off)
            _copy(x_ring.index(nxt), x_ptr + kc + xc_off)
            async_copy.commit_group()
            a, b = _operands(wp, sb, xp, a_l, b_l, BN, BM, BK)
            acc = mma_v2(a, b, acc)
        async_copy.wait_group(0)
    elif STAGES == 0:  # register prefetch: the next step's loads are in flight during this step's math
        wp, sb, xp = _load_step(w_ptr, s_ptr, x_ptr, k_lo, w_off, s_off, x_off)
        for k0 in range(k_lo, k_last + BK, BK):
            wn, sn, xn = _load_step(w_ptr, s_ptr, x_ptr, gl.minimum(k0 + BK, k_last), w_off, s_off, x_off)
            a, b = _operands(wp, sb, xp, a_l, b_l, BN, BM, BK)
            acc = mma_v2(a, b, acc)
            wp, sb, xp = wn, sn, xn
    else:
        for k0 in range(k_lo, k_last + BK, BK):
            wp, sb, xp = _load_step(w_ptr, s_ptr, x_ptr, k0, w_off, s_off, x_off)
            a, b = _operands(wp, sb, xp, a_l, b_l, BN, BM, BK)
            acc = mma_v2(a, b, acc)

    no = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    mo = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    store_output(acc, no, mo, x_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr, M, N, stride_ym, pid_k,
                 HAS_BIAS, HAS_XENC, SPLIT)


MAX_M = 64


def config(m: int, n: int, k: int, sms: int = 132):
    """(BN, BM, BK, warps, K per program, stages) for M <= 64 rows; stages: 0 register
    prefetch of one step, 1 none, >= 2 a cp.async ring of that many steps. The tile is
    ``rules.TILES``' mma rows (the session-5 H200 sweep behind them is named there), BM
    M rounded up to a power of two (8 or more), the K per program ``k_split``'s."""
    bn, bk, warps, stages, split = rules.tile("mma", m, n, k)
    return bn, max(8, next_pow2(m)), bk, warps, k_split(n, k, bn, bk, sms, split), stages


def k_split(n: int, k: int, bn: int, bk: int, sms: int, split: tuple) -> int:
    """K per program: K halved until ``cdiv(N, BN)`` row tiles times the splits give
    about ``per_sm`` programs per SM (``split``: the row's ``(per_sm, least)``), keeping
    ``least`` K or more (whole K steps) a program. Where halving stops short of one
    program an SM (K not divisible that way: Qwen2-72B's K = 29568 ran on 64 programs)
    and K > ``least``, K is cut into ranges of whole K steps instead, 512 K or more, for
    about ``per_sm`` programs an SM; the last range may be shorter (``cdiv(K, K per
    program)`` programs)."""
    per_sm, least = split
    tiles = cdiv(n, bn)
    parts = 1
    while tiles * parts < per_sm * sms and k % (parts * 2) == 0 and (k // (parts * 2)) % bk == 0 \
            and k // (parts * 2) >= least:
        parts *= 2
    if tiles * parts >= sms or k <= least:  # (K = 576 layers: the summing launch costs more than it saves)
        return k // parts
    per = cdiv(cdiv(k, cdiv(per_sm * sms, tiles)), bk) * bk
    return min(k, max(512, per))


def programs(m: int, n: int, k: int, sms: int = 132) -> int:
    """The grid size of the kernel's launch for M rows of an [N, K] weight under ``config``."""
    bn, _, _, _, k_split, _ = config(m, n, k, sms)
    return cdiv(n, bn) * cdiv(k, k_split)


def supports(m: int, n: int, k: int) -> bool:
    """Whether the kernel takes this shape: M <= 64 and K a multiple of 64."""
    return 0 < m <= MAX_M and k % 64 == 0 and n > 0


_LAYOUTS: dict = {}


def matmul(x2: torch.Tensor, words: torch.Tensor, sbits: torch.Tensor, enc: torch.Tensor,
           x_enc: Optional[torch.Tensor], bias: Optional[torch.Tensor], y: torch.Tensor,
           cfg: Optional[tuple] = None, dependent: bool = False) -> torch.Tensor:
    """``y [M, N] = x2 [M, K] @ W^T`` (bf16 x, M <= 64, K % 64 == 0) from the
    packed weight (``words`` int32 [N, K/8], ``sbits`` uint8 [N, K/16], ``enc``
    its global scale); ``x_enc``: the activations' global scale (W4A4), or None.
    ``dependent``: see ``launches``; taken only where the operands need no copy (a copy launched
    now would be read before the wait), else the plain launch."""
    if dependent and operands_aligned(x2, sbits):
        return launches(x2, words, sbits, enc, x_enc, bias, y, cfg, dependent=True)(x2, y)
    return run_once(launches, x2, words, sbits, enc, x_enc, bias, y, cfg)


def launches(x2: torch.Tensor, words: torch.Tensor, sbits: torch.Tensor, enc: torch.Tensor,
             x_enc: Optional[torch.Tensor], bias: Optional[torch.Tensor], y: torch.Tensor,
             cfg: Optional[tuple] = None, slots=(0, 6), dependent: bool = False):
    """``matmul``'s launches for operands shaped like these (``aligned_operands`` already), as a
    callable ``run(*tensors) -> y`` taking the kernel arguments at ``slots`` (x and y; the
    activations' global scale too in a W4A4 plan; y last). ``dependent``: the kernel launches as
    the programmatic dependent of the launch just before it, which must be the activations'
    quantize launch signalling it (``_common.w4a4_pdl``); it copies its first weight steps before
    ``griddepcontrol.wait`` (plainly, should the driver refuse that: ``_common.dependent_or_plain``)."""
    from ._common import _sm_count, dependent_or_plain, split_pdl, split_run, split_workspace

    m, k = x2.shape
    n = words.shape[0]
    if x2.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the mma path takes bf16 or fp16 activations, got {x2.dtype}")
    if not supports(m, n, k):
        raise ValueError(f"the mma path takes M <= {MAX_M} and K % 64 == 0, got M={m}, K={k}")
    bn, bm, bk, warps, k_split, stages = cfg or config(m, n, k, _sm_count(x2.device))
    if k_split % bk or bn % (16 * warps) or bm < m:
        raise ValueError(f"mma: config {(bn, bm, bk, warps, k_split)} does not tile M={m}, K={k}")
    key = (bn, bm, bk, warps)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = _layouts(bn, bm, bk, warps)
    wl, sl, xl, sc, xc = _LAYOUTS[key]
    splits = cdiv(k, k_split)
    target = split_workspace(splits, y)
    has_bias = bias is not None
    trigger = splits > 1 and split_pdl(x2.device)
    wait = bool(dependent) and stages >= 2  # (the register-prefetch modes read x from their first load)
    launch = Launch(
        _mma_kernel, (cdiv(n, bn), splits),
        (x2, words, sbits, enc, x_enc if x_enc is not None else enc, bias if has_bias else enc, target,
         m, n, k // 64, k // 64, x2.stride(0) // 8, y.stride(0), k_split), slots,
        dict(HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, SPLIT=splits > 1, STAGES=int(stages),
             BN=bn, BM=bm, BK=bk, WARPS=warps, WL=wl, SL=sl, XL=xl, SC=sc, XC=xc,
             TRIGGER=trigger, num_warps=warps,
             **(dict(WAIT=True, launch_pdl=True) if wait else {})))
    run = split_run(launch, splits, y, bias, trigger)
    if not wait:
        return run
    return dependent_or_plain(run, lambda: launches(x2, words, sbits, enc, x_enc, bias, y, cfg, slots), x2.device,
                              "mma.py after the quantize launch")


_READY: dict = {}


def _self_test(device: torch.device) -> Optional[str]:
    """Small products against the reference decode: a partial row tile with
    split K and 128-wide K steps (M = 5), 64-wide steps with M = 40, fp16,
    a shorter last K range."""
    cases = ((5, 200, 2048, torch.bfloat16), (40, 200, 1152, torch.bfloat16), (13, 200, 1024, torch.float16),
             (7, 200, 1664, torch.bfloat16))  # K ranges of 512, 512, 512 and 128
    return product_check(matmul, cases, device)


def _device_reason(index: int) -> Optional[str]:
    """Why this GPU cannot run the kernel at all (None when it can)."""
    if getattr(torch.version, "hip", None):
        return "the mma path is NVIDIA PTX (mma.sync, cp.async): not on ROCm"
    if torch.cuda.get_device_capability(index) < (8, 0):
        return "the mma path needs mma.sync (sm_80 or later)"
    return None


def ready(device: torch.device) -> Optional[str]:
    """None when ``device`` can run the kernel and it compiled and passed its
    self-test there (decided once per device), otherwise why not (with a
    warning, once, when the self-test failed). The tiled GEMM takes this
    call when the first use is inside a CUDA graph capture."""
    index = _index(device)
    return decide_once(_READY, index, lambda: _device_reason(index), _self_test, "the Gluon tensor-core path")


def disable(device: torch.device, reason: str) -> None:
    """Stop using the kernel on ``device`` (a launch failed after the self-test passed)."""
    stop_using(_READY, _index(device), reason, "the Gluon tensor-core path")


__all__ = ["MAX_M", "config", "disable", "k_split", "launches", "matmul", "programs", "ready", "supports"]
