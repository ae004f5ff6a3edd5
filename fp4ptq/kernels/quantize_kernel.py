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

Two kernels
-----------
The E2M1 / E4M3 encode helpers both use are in ``_common.py``. bf16 / fp16 inputs of 3 rows and more (from sm_80) go to
``_quantize16_kernel`` (``quantize16.py``): two elements a 32-bit register, compared with the seven
thresholds of each block's scale rounded up to the 16-bit format (exact for
16-bit inputs) and counted two at a time by packed instructions (inline PTX on
the GPU: packed float compares, or integer ones for bf16 below sm_90; the same
arithmetic in Triton under the interpreter). The thresholds
come from a small per-program table of all scale codes on large inputs (codes
of 64M elements and more, 16M under Four Over Six) and are computed per block
otherwise (seven exact fp64 products read off as 16-bit patterns).
Everything else (fp32 inputs, 1-2 rows, a scaled output in another dtype,
older GPUs) goes to ``_quantize_kernel``, which computes the thresholds per
block as described above. Both give the reference's codes and scales.

Four Over Six sums the block errors in Triton's reduction order (the 16-bit
kernel: two running sums, each square added by one fma), which can differ
from ``torch.sum``'s by an ulp; a block whose two errors are that close (a
near-tie) can then pick the other scale. The kernels are launched with FMA
contraction off so every other step (``x_hat = v * step``, ``x_hat - x``)
rounds like the reference.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import nvfp4
from ..nvfp4 import BLOCK_SIZE, NVFP4Tensor
from ._common import (Launch, _combine, _gdc_launch_dependents, cdiv, cuda_sm_count, e2m1_thresholds, e2m1_value,
                      e4m3_block_scale, global_enc_from_amax, next_pow2)
from .quantize16 import TABLE_ROWS, TABLE_WORDS, _quantize16_kernel

# Four Over Six rule -> kernel constant (0: standard scale-to-6 only).
FOUR_SIX_CODES = {None: 0, "mse": 1, "mae": 2, "max": 3}
EMITS = ("packed", "scaled")


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
    BLOCK_M: tl.constexpr, BLOCKS_K: tl.constexpr, TRIGGER: tl.constexpr = False,
):
    if TRIGGER:  # (_common.w4a4_pdl) the GEMM after this launch, its programmatic dependent, may start now
        _gdc_launch_dependents()
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
    blocks_k = min(32, next_pow2(max(1, k // 16)))
    block_m = max(1, min(next_pow2(m), 256 // blocks_k))
    return block_m, blocks_k, 4


def _tile16(m: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCKS_K, num_warps) of the 16-bit kernel's tile: a thread holds one block of 16
    elements, 128 blocks a tile."""
    blocks_k = min(128, next_pow2(max(1, k // 16)))
    block_m = max(1, min(next_pow2(m), 128 // blocks_k))
    return block_m, blocks_k, 4


def _programs(device: torch.device, n_tiles: int, max_per_sm: int = 8, tiles_each: int = 8) -> int:
    """Persistent grid size: about ``tiles_each`` tiles a program (each program first builds its own
    table, which costs about as much as a few tiles), between 2 and ``max_per_sm`` programs per SM (8 and
    8 for codes; 4 and 16 for the scaled W4A4 operand, whose stores are four times the bytes: H200 sweeps
    in benchmarks/NOTES.md). Under the interpreter 64, which only sets how many tiles a program
    loops over."""
    if device.type != "cuda":
        return min(n_tiles, 64)
    sms = cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return min(n_tiles, max(2 * sms, min(max_per_sm * sms, n_tiles // tiles_each)))


# Thresholds from the per-program table, or computed per block in registers (7 exact fp64 products
# read off as 16-bit patterns; bf16 under global scales of 2^112 and more: the table's own arithmetic). The table costs each program a prologue (127 rows, 8 KB of stores and a barrier), so it
# wants few programs with many tiles each; without it every program takes one tile. H200, 3 interleaved
# rounds (`PHASES=table python3 benchmarks/quant16_h200.py`, results/quant16_h200_table.json and
# quant16_h200_table_wide2.json), us, per block / table: codes 1024 x 4096 5.6 / 7.4 (the fp32-compare
# kernel 8.4), 8192 x 4096 30.0 / 29.4, 8192 x 14336 96.9 / 96.7, 8192 x 28672 194.5 / 186.0; Four Over Six
# (mse) 1024 x 4096 12.8 / 14.3, 8192 x 4096 66.9 / 61.0, 8192 x 28672 434.8 / 382.6; the scaled W4A4
# operand ahead per block at every size (8192 x 28672 249.3 / 261.8). fp16 (quant16_h200_table_fp16.json,
# the row-a-thread table then) alike. So codes take the table from 32768 tiles (64M elements), from 8192
# under Four Over Six; the scaled operand never.
QUANT16_TABLE_MIN_TILES = 32768
QUANT16_TABLE_MIN_TILES_FOUR_SIX = 8192


def _use_table(n_tiles: int, emit: str, four_six: Optional[str] = None) -> bool:
    least = QUANT16_TABLE_MIN_TILES_FOUR_SIX if four_six else QUANT16_TABLE_MIN_TILES
    return emit == "packed" and n_tiles >= least


def _word_major(four_six: Optional[str]) -> bool:
    """The table's layout: word-major ([word][code]) for the standard codes, row-major under Four Over
    Six (H200, 3 interleaved rounds, results/quant16_h200_table_wordmajor.json, us, row / word-major:
    codes 8192 x 14336 96.4 / 90.8 = 78% of copy, 8192 x 28672 185.6 / 179.9; mse 195.3 / 200.8 and
    383.1 / 391.9)."""
    return four_six is None


# Below this many rows the fp32-compare kernel takes 16-bit inputs too: with thresholds per block the
# 16-bit kernel is ahead from 4 rows on and level or behind below (H200, 5 interleaved rounds,
# results/quant16_h200_tiny.json, us, 16-bit / fp32-compare: 16 x 4096 2.38 / 2.94, 4 x 4096 2.33 /
# 2.42, 1 x 4096 2.32 / 2.31, the scaled operand 2.30 / 2.18; W4A4 at M = 1 on 8B.qkv 9.27 / 9.10, at
# M = 16 14.1 / 14.9).
QUANT16_MIN_ROWS = 3


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def quant16_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the 16-bit kernel's PTX runs on ``device``: sm_80 and later (``max`` / ``fma`` on
    ``bf16x2`` and ``f16x2``; bf16's packed compares and adds, sm_90 PTX, are integer compares below
    sm_90: ``_asm_kind``); NVIDIA only (inline PTX). Under the interpreter its Triton twin runs anywhere."""
    if INTERPRET:
        return True
    if device.type != "cuda" or getattr(torch.version, "hip", None):
        return False
    return tuple(torch.cuda.get_device_capability(device)) >= (8, 0)


def _asm_kind(device: torch.device, dtype: torch.dtype) -> int:
    """The 16-bit kernel's ``ASM``: 0 its Triton twin (the interpreter), 1 packed float compares, 2 the
    integer compares of ``_count_int_asm`` (bf16 below sm_90, which has no packed bf16 ``set``/``add``)."""
    if INTERPRET:
        return 0
    below_sm90 = device.type == "cuda" and tuple(torch.cuda.get_device_capability(device)) < (9, 0)
    if dtype == torch.bfloat16 and below_sm90:
        return 2
    return 1


def _words(x: torch.Tensor) -> Optional[torch.Tensor]:
    """The int32 view of a 2-D 16-bit ``x`` (pairs of elements), or None where there is none."""
    if x.dtype not in (torch.bfloat16, torch.float16) or x.stride(1) != 1 or x.stride(0) % 2 or x.storage_offset() % 2:
        return None
    return x.view(torch.int32) if x.shape[1] else None


def launch_quantize(
    x: torch.Tensor,
    amax: torch.Tensor,
    four_six: Optional[str] = None,
    *,
    emit: str = "packed",
    out_dtype: Optional[torch.dtype] = None,
    trigger: bool = False,
):
    """Run the kernel on a 2-D ``x [M, K]`` (K % 16 == 0, unit last stride)
    with a 0-dim/[1] fp32 ``amax`` tensor on x's device (no host sync).

    emit="packed": returns ``(packed uint8 [M, K/2], block_scale e4m3 [M, K/16],
    global_enc fp32 0-dim, chose_four bool [M, K/16] or None)``.
    emit="scaled": returns ``(v * block_scale [M, K] in out_dtype (default x's),
    global_enc)`` for the W4A4 GEMM.

    bf16 / fp16 inputs of 3 rows and more go to the 16-bit kernel (two elements a register,
    thresholds per block or from a per-program table; sm_80 and later); fp32 inputs, 1-2 rows, a
    scaled output in another dtype and older GPUs to the fp32-compare one. Both give the reference's
    codes and scales. ``trigger``: see ``quantize_launches`` (for W4A4's GEMM launched right after, as a
    programmatic dependent).
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
    amax = amax.reshape(1).to(device=x.device, dtype=torch.float32)
    words = None
    if _takes_quant16(x, emit, out_dtype):
        words = _words(x)
        if words is None:  # an odd row stride or offset: the int32 view needs pairs
            x = x.contiguous()
            words = _words(x)
    if x.numel() == 0:  # nothing to launch; the global scale still follows the amax
        enc = nvfp4.global_encode_scale(amax.reshape(()), four_six is not None).to(x.device)
        return _returned(_outputs(*x.shape, x.dtype, x.device, four_six, emit, out_dtype, enc))
    return quantize_launches(x, words, amax, four_six, emit, out_dtype, trigger)(x if words is None else words, amax)


def _takes_quant16(x: torch.Tensor, emit: str, out_dtype: Optional[torch.dtype]) -> bool:
    """Whether ``launch_quantize`` gives ``x`` to the 16-bit kernel (see there)."""
    return (x.shape[0] >= QUANT16_MIN_ROWS and x.shape[1] > 0
            and x.dtype in (torch.bfloat16, torch.float16)
            and (emit == "packed" or out_dtype in (None, x.dtype)) and quant16_supported(x.device, x.dtype))


def _outputs(m: int, k: int, dtype: torch.dtype, dev: torch.device, four_six: Optional[str], emit: str,
             out_dtype: Optional[torch.dtype], enc: Optional[torch.Tensor] = None):
    """``launch_quantize``'s output tensors for an [m, k] input of ``dtype`` on ``dev`` (fresh; ``enc``
    the 0-dim global scale)."""
    if enc is None:
        enc = torch.empty((), dtype=torch.float32, device=dev)
    if emit == "scaled":
        return torch.empty(m, k, dtype=out_dtype or dtype, device=dev), enc
    chose = torch.empty(m, k // BLOCK_SIZE, dtype=torch.int8, device=dev) if four_six is not None else None
    return (torch.empty(m, k // 2, dtype=torch.uint8, device=dev),
            torch.empty(m, k // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=dev), enc, chose)


def _returned(outs: tuple) -> tuple:
    """``launch_quantize``'s return value from ``_outputs``' tensors (the 4/6 choices as bool)."""
    if len(outs) == 2:
        return outs
    packed, scale, enc, chose = outs
    return packed, scale, enc, None if chose is None else chose.bool()


def quantize_launches(x: torch.Tensor, words: Optional[torch.Tensor], amax: torch.Tensor, four_six: Optional[str],
                      emit: str, out_dtype: Optional[torch.dtype], trigger: bool = False):
    """``launch_quantize``'s launch for inputs shaped like ``x`` (``words``: its int32 view for the 16-bit
    kernel, or None for the fp32-compare one; ``amax`` fp32 [1] on x's device) as a callable
    ``run(x or words, amax)`` that allocates the outputs, launches, and returns what ``launch_quantize``
    does (the amax too is read at each call: a layer's static scale can change between calls).
    ``trigger``: the kernel signals ``griddepcontrol.launch_dependents`` as it starts, so that the
    GEMM launched next as its programmatic dependent (``_common.w4a4_pdl``) may start early."""
    m, k = x.shape
    dev, dtype = x.device, x.dtype
    sstride = k if emit == "scaled" else 0  # (the scaled output is a fresh [M, K] tensor)
    kwargs = dict(FOUR_SIX=FOUR_SIX_CODES[four_six], EMIT_PACKED=emit == "packed", EMIT_SCALED=emit == "scaled",
                  TRIGGER=bool(trigger), enable_fp_fusion=False)
    table_size = 0
    if words is not None:
        block_m, blocks_k, warps = _tile16(m, k)
        n_ktiles = cdiv(k // BLOCK_SIZE, blocks_k)
        n_tiles = cdiv(m, block_m) * n_ktiles
        use_table = _use_table(n_tiles, emit, four_six)
        if use_table:
            grid = (_programs(dev, n_tiles, *((8, 8) if emit == "packed" else (4, 16))),)
            table_size = grid[0] * TABLE_ROWS.value * TABLE_WORDS.value
        else:  # a tile a program, 8 programs an SM (4 and 12 were no faster, same run)
            grid = (_programs(dev, n_tiles, 8, 1),)
        kernel = _quantize16_kernel
        args = (words, amax, None, None, None, None, None, None, m, k, words.stride(0), sstride // 2, n_tiles, n_ktiles)
        kwargs.update(F16=dtype == torch.float16, ASM=_asm_kind(dev, dtype), BLOCK_M=block_m, BLOCKS_K=blocks_k,
                      TABLE=use_table, WORD_MAJOR=use_table and _word_major(four_six), num_warps=warps)
        slots = (0, 1, 2, 3, 4, 5, 6, 7)  # words, amax, table, enc, and the four outputs (enc where one is not written)
    else:
        block_m, blocks_k, warps = _tile(m, k)
        grid = (cdiv(m, block_m), cdiv(k // BLOCK_SIZE, blocks_k))
        kernel = _quantize_kernel
        args = (x, amax, None, None, None, None, None, m, k, x.stride(0), sstride)
        kwargs.update(BLOCK_M=block_m, BLOCKS_K=blocks_k, num_warps=warps)
        slots = (0, 1, 2, 3, 4, 5, 6)  # x, amax, enc, and the four outputs
    launch = Launch(kernel, grid, args, slots, kwargs)

    def run(xin: torch.Tensor, amax: torch.Tensor):
        outs = _outputs(m, k, dtype, dev, four_six, emit, out_dtype)
        if emit == "scaled":
            scaled, enc = outs
            targets = (enc, enc, enc, scaled.view(torch.int32) if words is not None else scaled)
        else:
            packed, scale, enc, chose = outs
            targets = (packed.view(torch.int32), scale.view(torch.uint8), chose if chose is not None else enc, enc)
        if words is not None:
            table = torch.empty(table_size, dtype=torch.int32, device=dev) if table_size else enc
            launch(xin, amax, table, enc, *targets)
        else:
            launch(xin, amax, enc, *targets)
        return _returned(outs)
    return run


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


def quantize_scaled(x: torch.Tensor, amax: torch.Tensor, four_six: Optional[str] = None, out_dtype=None,
                    trigger: bool = False):
    """``(v * block_scale [M, K], global_enc)`` of a 2-D ``x`` under a static
    ``amax``: ``fake_quantize(x) == v * block_scale / global_enc`` (``trigger``: see
    ``quantize_launches``)."""
    return launch_quantize(x, amax, four_six, emit="scaled", out_dtype=out_dtype, trigger=trigger)


__all__ = ["FOUR_SIX_CODES", "launch_quantize", "quantize", "quantize_scaled"]
