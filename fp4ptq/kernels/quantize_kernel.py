"""Triton NVFP4 quantize kernel: bit-identical to ``fp4ptq.nvfp4.quantize``.

``x [M, K]`` (fp32 / fp16 / bf16) -> packed codes ``[M, K/2]`` + e4m3 block
scales ``[M, K/16]`` under a global scale that is either given (a static,
calibrated activation amax) or computed from ``max|x|``; standard ("scale to
6") or Four Over Six (``mse`` / ``mae`` / ``max``). The same kernel can also
emit ``v * block_scale`` in the input dtype (``emit="scaled"``): the exact
operand the W4A4 GEMM multiplies (``v`` has 2 significant bits and the e4m3
scale 4, so their product is exact in bf16/fp16; ``1/global_enc`` is applied
to the GEMM output instead).

How the codes stay bit-identical without a division per element
---------------------------------------------------------------
The reference rounds ``q = fl(x / step)`` (one fp32 division) to E2M1 by
comparing ``|q|`` with the seven midpoints 0.25, 0.75, ... 5. Because
rounding is monotone, ``fl(|x| / step) > t`` holds exactly when the real
quotient exceeds the midpoint ``t+`` between ``t`` and its fp32 successor
(ties go to ``t``: every ``t`` has an even fp32 significand), i.e. when
``|x| > t+ * step``; likewise ``fl(|x|/step) >= t`` iff ``|x| >= t- * step``
with ``t-`` the midpoint to ``t``'s predecessor. ``t+-`` have 25 significant
bits and ``step`` 24, so ``t+- * step`` is exact in fp64. Comparing an fp32
``|x|`` with such a real number ``B`` equals comparing it with ``B`` rounded
down (for ``>``) or up (for ``>=``) to fp32. So per block we form seven fp32
thresholds once (fp64 products, directed rounding by a compare-and-step),
and each element costs a 3-level binary search (3 compares, 4 selects): no
per-element division, and no double rounding. Scales use the reference's order of operations
(``bmax / 6 * global_enc``, ``bmax / 4 * global_enc``, clamp 448, e4m3 RNE) with
correctly rounded division (``div_rn``; Triton's ``/`` is approximate).

Four Over Six sums the block errors in Triton's reduction order, which can
differ from ``torch.sum``'s by an ulp; a block whose two errors are that
close (a near-tie) can then pick the other scale. The kernels are launched
with FMA contraction off so every other step rounds like the reference.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import nvfp4
from ..nvfp4 import BLOCK_SIZE, NVFP4Tensor

# Four Over Six rule -> kernel constant (0: standard scale-to-6 only).
FOUR_SIX_CODES = {None: 0, "mse": 1, "mae": 2, "max": 3}
EMITS = ("packed", "scaled")


@triton.jit
def _ge_bound(b64, STRICT: tl.constexpr):
    """Smallest fp32 ``a`` with ``a > b64`` (``STRICT``) or ``a >= b64``, for a
    per-block fp64 ``b64 >= 0``: then ``|x| > B`` (or ``>= B``) is ``|x| >= a``."""
    b32 = b64.to(tl.float32)  # nearest
    back = b32.to(tl.float64)
    bits = b32.to(tl.int32, bitcast=True)
    if STRICT:
        bits = tl.where(back > b64, bits, bits + 1)
    else:
        bits = tl.where(back >= b64, bits, bits + 1)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_thresholds(step):
    """Per-block fp32 thresholds ``T0..T6`` (``[BM, NB]``) such that the E2M1
    index of ``fl(|x| / step)`` is the number of ``T_i <= |x|``; +inf for a
    zero step (the reference stores zeros there)."""
    s = step.to(tl.float64)
    # Midpoints between E2M1 neighbours, displaced by half an fp32 ulp of the
    # midpoint so ties fall to the even neighbour (see module doc):
    # ">" tests: 0.25 + 2^-26, 1.25 + 2^-24, 2.5 + 2^-23, 5 + 2^-22
    # ">=" tests: 0.75 - 2^-25, 1.75 - 2^-24, 3.5 - 2^-23
    t0 = _ge_bound(s * 0.250000014901161193847656250, True)
    t1 = _ge_bound(s * 0.749999970197677612304687500, False)
    t2 = _ge_bound(s * 1.250000059604644775390625000, True)
    t3 = _ge_bound(s * 1.749999940395355224609375000, False)
    t4 = _ge_bound(s * 2.500000119209289550781250000, True)
    t5 = _ge_bound(s * 3.499999880790710449218750000, False)
    t6 = _ge_bound(s * 5.000000238418579101562500000, True)
    zero = step <= 0.0
    inf = float("inf")
    return (tl.where(zero, inf, t0), tl.where(zero, inf, t1), tl.where(zero, inf, t2), tl.where(zero, inf, t3),
            tl.where(zero, inf, t4), tl.where(zero, inf, t5), tl.where(zero, inf, t6))


@triton.jit
def e2m1_index(ax, t0, t1, t2, t3, t4, t5, t6):
    """E2M1 magnitude index (0..7) of ``ax = |x|`` (``[BM, NB, n]``) against the
    per-block thresholds (``[BM, NB]``): a 3-level binary search by selects."""
    t0 = t0[:, :, None]
    t1 = t1[:, :, None]
    t2 = t2[:, :, None]
    t3 = t3[:, :, None]
    t4 = t4[:, :, None]
    t5 = t5[:, :, None]
    t6 = t6[:, :, None]
    c4 = ax >= t3
    c2 = ax >= tl.where(c4, t5, t1)
    c1 = ax >= tl.where(c4, tl.where(c2, t6, t4), tl.where(c2, t2, t0))
    return c4.to(tl.int32) * 4 + c2.to(tl.int32) * 2 + c1.to(tl.int32)


@triton.jit
def e2m1_value(index):
    """fp32 magnitude {0, .5, 1, 1.5, 2, 3, 4, 6} of an E2M1 index (0..7), by
    bit moves: the index under fp16 bits 9..11 is the fp16 ``v * 2^-14``."""
    half = (index << 9).to(tl.int16).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * 16384.0


@triton.jit
def e4m3_rne(v):
    """Round fp32 ``0 <= v <= 448`` to the nearest E4M3 value (ties to even).

    Returns ``(value fp32, bits int32)``. Done in integer/fp32 arithmetic so
    that it is exact everywhere (the Triton interpreter's fp8 cast is not).
    Normal range (v >= 2^-6): keep 3 mantissa bits of the fp32 pattern with
    round-half-even (a carry moves into the exponent, as it should); the E4M3
    pattern is then the fp32 pattern's top bits rebiased (127 -> 7).
    Subnormal range: multiples of 2^-9, i.e. ``RNE(v * 512)`` (2^23 trick);
    that integer is also the E4M3 pattern (8 -> 2^-6, the first normal).
    """
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # & 0xFFF00000
    normal_value = rounded.to(tl.float32, bitcast=True)
    normal_bits = (rounded >> 20) - 960  # (exp - 120) << 3 | mantissa
    sub_int = (v * 512.0 + 8388608.0) - 8388608.0  # RNE(v * 2^9), exact
    sub_value = sub_int * 0.001953125
    is_sub = v < 0.015625
    value = tl.where(is_sub, sub_value, normal_value)
    pattern = tl.where(is_sub, sub_int.to(tl.int32), normal_bits)
    return value, pattern


@triton.jit
def e4m3_block_scale(bmax, global_enc, TARGET: tl.constexpr):
    """``e4m3(min(bmax / TARGET * global_enc, 448))`` (the reference's order of
    operations): ``(value fp32, E4M3 bit pattern int32)``."""
    scale = tl.math.div_rn(bmax, TARGET) * global_enc
    return e4m3_rne(tl.minimum(scale, 448.0))


@triton.jit
def _half_error(ax, index, step, RULE: tl.constexpr):
    """Error of one half-block (``[BM, NB, 8]``) against the reference's
    ``x_hat - x``: x_hat has x's sign, so ``|x_hat - x| = |v * step - |x||``
    exactly (rounding is sign-symmetric). Reduced over the 8 elements."""
    d = e2m1_value(index) * step[:, :, None] - ax
    if RULE == 1:
        return tl.sum(d * d, axis=2)
    elif RULE == 2:
        return tl.sum(tl.abs(d), axis=2)
    else:
        return tl.max(tl.abs(d), axis=2)


@triton.jit
def _combine(a, b, RULE: tl.constexpr):
    if RULE == 3:
        return tl.maximum(a, b)
    else:
        return a + b


@triton.jit
def quantize_halves(xa, xb, global_enc, FOUR_SIX: tl.constexpr):
    """Quantize fp32 blocks given as halves ``xa, xb [BM, NB, 8]`` (elements
    0..7 and 8..15 of each block, held by one thread) under ``global_enc``.

    Returns ``(index_a, index_b int32 [BM, NB, 8] (magnitudes 0..7),
    block_scale fp32 [BM, NB], its E4M3 bits int32, chose_four bool)``,
    exactly as ``nvfp4.quantize_blocks`` picks them.
    """
    aa = tl.abs(xa)
    ab = tl.abs(xb)
    bmax = tl.maximum(tl.max(aa, axis=2), tl.max(ab, axis=2))
    scale, scale_bits = e4m3_block_scale(bmax, global_enc, 6.0)
    step = tl.math.div_rn(scale, global_enc)
    t0, t1, t2, t3, t4, t5, t6 = e2m1_thresholds(step)
    ia = e2m1_index(aa, t0, t1, t2, t3, t4, t5, t6)
    ib = e2m1_index(ab, t0, t1, t2, t3, t4, t5, t6)
    chose_four = bmax != bmax  # all False, in the per-block layout
    if FOUR_SIX != 0:
        scale4, scale4_bits = e4m3_block_scale(bmax, global_enc, 4.0)
        step4 = tl.math.div_rn(scale4, global_enc)
        u0, u1, u2, u3, u4, u5, u6 = e2m1_thresholds(step4)
        ia4 = e2m1_index(aa, u0, u1, u2, u3, u4, u5, u6)
        ib4 = e2m1_index(ab, u0, u1, u2, u3, u4, u5, u6)
        err6 = _combine(_half_error(aa, ia, step, FOUR_SIX), _half_error(ab, ib, step, FOUR_SIX), FOUR_SIX)
        err4 = _combine(_half_error(aa, ia4, step4, FOUR_SIX), _half_error(ab, ib4, step4, FOUR_SIX), FOUR_SIX)
        chose_four = err4 < err6  # ties keep the 6-scale
        pick = chose_four[:, :, None]
        ia = tl.where(pick, ia4, ia)
        ib = tl.where(pick, ib4, ib)
        scale = tl.where(chose_four, scale4, scale)
        scale_bits = tl.where(chose_four, scale4_bits, scale_bits)
    return ia, ib, scale, scale_bits, chose_four


@triton.jit
def global_enc_from_amax(amax, FOUR_SIX: tl.constexpr):
    """``6 * 448 / amax`` (``6 * 256 / amax`` with Four Over Six), 1 for amax 0,
    clamped to the fp32 max: ``nvfp4.global_encode_scale`` bit for bit."""
    numerator = 1536.0 if FOUR_SIX != 0 else 2688.0
    # torch evaluates ``numerator / amax`` as ``reciprocal(amax) * numerator``
    # (two roundings), on the CPU and on CUDA alike: do the same.
    recip = tl.math.div_rn(amax * 0.0 + 1.0, tl.where(amax > 0.0, amax, 1.0))
    enc = tl.where(amax > 0.0, recip * numerator, 1.0)
    return tl.minimum(enc, 3.4028234663852886e38)


@triton.jit
def _pack_word(index, x):
    """Codes (index | sign << 3) of 8 elements ``[BM, NB, 8]`` -> one int32
    word ``[BM, NB]``: element j in bits 4j..4j+3 (the packed byte order)."""
    code = index | ((x.to(tl.int32, bitcast=True) >> 28) & 8)  # sign bit, so -0.0 -> 0x8
    return tl.sum(code << (tl.arange(0, 8) * 4)[None, None, :], axis=2)


@triton.jit
def signed_scaled(index, x, scale):
    """``sign(x) * v * block_scale`` in fp32 for halves ``[BM, NB, 8]``: the W4A4
    operand, exact (``v`` has 2 significant bits and the e4m3 scale 4)."""
    value = e2m1_value(index) * scale[:, :, None]
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -value, value)


@triton.jit
def _quantize_kernel(
    x_ptr, amax_ptr, enc_ptr, packed_ptr, scale_ptr, chose_ptr, scaled_ptr,
    M, K, stride_xm, stride_sm,
    FOUR_SIX: tl.constexpr, EMIT_PACKED: tl.constexpr, EMIT_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCKS_K: tl.constexpr,
):
    # One program: BLOCK_M rows x BLOCKS_K blocks of 16 columns. Each block is
    # loaded as two halves of 8 so that one thread holds a whole block: the
    # block max and the per-block thresholds are computed once, in registers.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = pid_k * BLOCKS_K + tl.arange(0, BLOCKS_K)
    nblocks = K // 16
    mask2 = (rows < M)[:, None] & (blocks < nblocks)[None, :]
    mask3 = mask2[:, :, None]
    rows64 = rows.to(tl.int64)
    offs = rows64[:, None, None] * stride_xm + (blocks * 16)[None, :, None] + tl.arange(0, 8)[None, None, :]
    xa = tl.load(x_ptr + offs, mask=mask3, other=0.0).to(tl.float32)      # [BM, NB, 8]
    xb = tl.load(x_ptr + offs + 8, mask=mask3, other=0.0).to(tl.float32)  # [BM, NB, 8]

    global_enc = global_enc_from_amax(tl.load(amax_ptr), FOUR_SIX)
    if pid_m == 0 and pid_k == 0:
        tl.store(enc_ptr, global_enc)
    ia, ib, scale, scale_bits, chose_four = quantize_halves(xa, xb, global_enc, FOUR_SIX)

    sofs = rows64[:, None] * nblocks + blocks[None, :]
    if EMIT_PACKED:
        wofs = rows64[:, None] * (K // 8) + blocks[None, :] * 2  # packed bytes viewed as int32 words
        tl.store(packed_ptr + wofs, _pack_word(ia, xa), mask=mask2)
        tl.store(packed_ptr + wofs + 1, _pack_word(ib, xb), mask=mask2)
        tl.store(scale_ptr + sofs, scale_bits.to(tl.uint8), mask=mask2)
        if FOUR_SIX != 0:
            tl.store(chose_ptr + sofs, chose_four.to(tl.int8), mask=mask2)
    if EMIT_SCALED:
        qofs = rows64[:, None, None] * stride_sm + (blocks * 16)[None, :, None] + tl.arange(0, 8)[None, None, :]
        tl.store(scaled_ptr + qofs, signed_scaled(ia, xa, scale).to(scaled_ptr.dtype.element_ty), mask=mask3)
        tl.store(scaled_ptr + qofs + 8, signed_scaled(ib, xb, scale).to(scaled_ptr.dtype.element_ty), mask=mask3)


def _tile(m: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCKS_K, num_warps) for an [m, k] input: about 4K elements a program."""
    blocks_k = min(32, triton.next_power_of_2(max(1, k // 16)))
    block_m = max(1, min(triton.next_power_of_2(m), 256 // blocks_k))
    return block_m, blocks_k, 4


def launch_quantize(
    x: torch.Tensor,
    amax: torch.Tensor,
    four_six: Optional[str] = None,
    *,
    emit: str = "packed",
    out_dtype: Optional[torch.dtype] = None,
):
    """Run the kernel on a 2-D ``x [M, K]`` (K % 16 == 0, unit last stride)
    with a 0-dim/[1] fp32 ``amax`` tensor on x's device (no host sync).

    emit="packed": returns ``(packed uint8 [M, K/2], block_scale e4m3 [M, K/16],
    global_enc fp32 0-dim, chose_four bool [M, K/16] or None)``.
    emit="scaled": returns ``(v * block_scale [M, K] in out_dtype (default x's),
    global_enc)`` for the W4A4 GEMM.
    """
    if emit not in EMITS:
        raise ValueError(f"emit must be one of {EMITS}, got {emit!r}")
    if four_six not in FOUR_SIX_CODES:
        raise nvfp4.NVFP4Error(f"unknown Four Over Six rule {four_six!r}; choose one of {nvfp4.FOUR_SIX_RULES}")
    m, k = x.shape
    if k % BLOCK_SIZE:
        raise nvfp4.NVFP4Error(f"quantize kernel: last dim {k} is not a multiple of {BLOCK_SIZE}")
    if x.stride(1) != 1:
        x = x.contiguous()
    dev = x.device
    amax = amax.reshape(1).to(device=dev, dtype=torch.float32)
    enc = torch.empty((), dtype=torch.float32, device=dev)
    packed = scale = chose = scaled = None
    dummy = enc  # pointer for outputs this launch does not write
    if emit == "packed":
        packed = torch.empty(m, k // 2, dtype=torch.uint8, device=dev)
        scale = torch.empty(m, k // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=dev)
        if four_six is not None:
            chose = torch.empty(m, k // BLOCK_SIZE, dtype=torch.int8, device=dev)
    else:
        scaled = torch.empty(m, k, dtype=out_dtype or x.dtype, device=dev)
    block_m, blocks_k, warps = _tile(m, k)
    grid = (triton.cdiv(m, block_m), triton.cdiv(k // BLOCK_SIZE, blocks_k))
    if m and k:
        _quantize_kernel[grid](
            x, amax, enc,
            packed.view(torch.int32) if packed is not None else dummy,
            scale.view(torch.uint8) if scale is not None else dummy,
            chose if chose is not None else dummy,
            scaled if scaled is not None else dummy,
            m, k, x.stride(0), scaled.stride(0) if scaled is not None else 0,
            FOUR_SIX=FOUR_SIX_CODES[four_six], EMIT_PACKED=emit == "packed", EMIT_SCALED=emit == "scaled",
            BLOCK_M=block_m, BLOCKS_K=blocks_k, num_warps=warps, enable_fp_fusion=False,
        )
    else:  # nothing to launch; the global scale still follows the amax
        enc.copy_(nvfp4.global_encode_scale(amax.reshape(()), four_six is not None))
    if emit == "scaled":
        return scaled, enc
    return packed, scale, enc, None if chose is None else chose.bool()


def quantize(
    x: torch.Tensor,
    four_six: Optional[str] = None,
    *,
    amax: Optional[torch.Tensor | float] = None,
    name: str = "tensor",
) -> NVFP4Tensor:
    """Triton twin of ``nvfp4.quantize(x, four_six, amax=amax)`` for ``x [..., K]``
    (K a multiple of 16): same codes, scales and global scale."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise nvfp4.NVFP4Error(f"{name}: expected a floating-point tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE:
        raise nvfp4.NVFP4Error(
            f"{name}: last dim of shape {tuple(x.shape)} is not a multiple of {BLOCK_SIZE}; "
            "the Triton quantizer does not pad (use fp4ptq.nvfp4.quantize(..., pad=True))"
        )
    nvfp4.check_finite(x, name)
    x2 = x.detach().reshape(-1, x.shape[-1])
    if amax is None:
        amax_t = nvfp4.tensor_amax(x2) if x2.numel() else torch.zeros((), device=x.device)
    else:
        amax_t = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
    packed, scale, enc, chose = launch_quantize(x2, amax_t, four_six)
    lead = x.shape[:-1]
    return NVFP4Tensor(
        packed.reshape(*lead, -1),
        scale.reshape(*lead, -1),
        enc,
        x.shape,
        x.dtype,
        None if chose is None else chose.reshape(*lead, -1),
    )


def quantize_scaled(x: torch.Tensor, amax: torch.Tensor, four_six: Optional[str] = None, out_dtype=None):
    """``(v * block_scale [M, K], global_enc)`` of a 2-D ``x`` under a static
    ``amax``: ``fake_quantize(x) == v * block_scale / global_enc``."""
    return launch_quantize(x, amax, four_six, emit="scaled", out_dtype=out_dtype)


__all__ = ["FOUR_SIX_CODES", "launch_quantize", "quantize", "quantize_scaled"]
