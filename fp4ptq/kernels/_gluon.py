"""The helpers the Gluon tensor-core kernels share (``mma.py``, ``wgmma.py``, ``wsgemm.py``): the PTX of the
in-register decode of 8 codes into four 16-bit-float pairs, mma.py's load layouts (which wgmma.py reuses for
its words and scale bytes), the cp.async copy and CTA barrier of this Triton version, the epilogue of mma.py
and wgmma.py, the operands' alignment, and each kernel's once-per-device guard (an sm_90 check, a self-test
against the reference decode, and the record of a kernel that stopped being used).

This module imports no kernel family; every family imports it.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

# A word of 8 codes -> four 16-bit-float pairs, register p = codes (p, p + 4). Code i sits at bits
# 4i..4i+3 (sign = bit 3). bf16: its magnitude goes to bits 6..8 of its half (shift 6 - 4i), the half
# is then ``v * 2^-126``; fp16: bits 9..11 (shift 9 - 4i), ``v * 2^-14``. The sign goes to bit 15
# (shift 12 - 4i); code i + 4 lands 16 bits higher with the same shifts.
DECODE_SHIFTS = ((6, 12), (2, 8), (-2, 4), (-6, 0))  # bf16: (magnitude, sign) shift of register p
MAG_MASK = 0x01C001C0
DECODE_SHIFTS_F16 = ((9, 12), (5, 8), (1, 4), (-3, 0))
MAG_MASK_F16 = 0x0E000E00
SIGN_MASK = 0x80008000


def _shift(dst: str, amount: int, src: str = "$4") -> str:
    if amount == 0:
        return f"mov.b32 {dst}, {src};"
    op = "shl.b32" if amount > 0 else "shr.u32"
    return f"{op} {dst}, {src}, {abs(amount)};"


# The scale product of mma.py's own bf16 decode: an fma with a -0 addend (``z``), which is the product itself
# (signed zeros included). PTX has bf16x2 fma from sm_80 but bf16x2 mul only from sm_90, and ptxas emits the
# same HMUL2 for both on sm_90, so the kernel builds for sm_80-89 (A100, A10, L40S) with the same sm_90 code.
# wgmma.py and wsgemm.py run on sm_90 only and keep the mul.
FMA_BF16 = "fma.rn.bf16x2"
NEG_ZERO_PAIR = 0x80008000


def _product(dst: str, a: str, scale: str, mul: str) -> str:
    if mul == FMA_BF16:
        return f"{FMA_BF16} {dst}, {a}, {scale}, z;"
    return f"{mul} {dst}, {a}, {scale};"


def _regs(names: str, mul: str) -> list:
    """The scratch register declarations of a decode block (and the -0 pair of the fma product)."""
    if mul == FMA_BF16:
        return [f".reg .b32 {names}, z;", f"mov.b32 z, {NEG_ZERO_PAIR:#010x};"]
    return [f".reg .b32 {names};"]


def decode_line(dst: str, word: str, scale: str, shifts: tuple, mag_mask: int, mul: str) -> str:
    """PTX of one decoded register ``dst``: the magnitude and sign of two codes of ``word`` moved
    by ``shifts`` = (magnitude shift, sign shift) into a 16-bit-float pair, times ``scale``."""
    mag, sign = shifts
    return (f"{_shift('a', mag, word)} {_shift('b', sign, word)} and.b32 a, a, {mag_mask:#010x}; "
            f"and.b32 b, b, {SIGN_MASK:#010x}; or.b32 a, a, b; {_product(dst, 'a', scale, mul)}")


def decode_mul_line(dst: str, word: str, scale: str, q: int, mul: str = "mul.rn.bf16x2") -> str:
    """PTX of one decoded bf16 register in three integer operations instead of five (_common.py's
    ``_pair_mul``): codes ``q`` and ``q + 4`` of ``word`` (q = 0, 1) isolated, one multiply by
    ``2^(6 - 4q) + 2^(12 - 4q)`` makes two copies of each nibble (the four fields never overlap, so
    no carries), one mask keeps the magnitude of the first copy (bits 6..8) and the sign of the
    second (bit 15); then times ``scale`` (``mul``; ``FMA_BF16`` takes the block's -0 pair ``z``, see
    ``_regs``). The same bits as ``decode_line`` with ``DECODE_SHIFTS[q]``; codes 2, 3 (6, 7) are codes
    0, 1 of the word shifted right by 8."""
    return (f"and.b32 a, {word}, {0x000F000F << (4 * q):#010x}; "
            f"mul.lo.u32 a, a, {(1 << (6 - 4 * q)) + (1 << (12 - 4 * q)):#x}; "
            f"and.b32 a, a, {MAG_MASK | SIGN_MASK:#010x}; {_product(dst, 'a', scale, mul)}")


def decode_mul_lines(dsts, word: str, scale: str, mul: str = "mul.rn.bf16x2") -> list:
    """``decode_mul_line`` for the four registers ``dsts`` (codes (p, p + 4), p = 0..3) of ``word``:
    one ``shr`` into ``b`` gives codes 2, 3 as codes 0, 1 (``a``, ``b`` scratch registers)."""
    return [f"shr.u32 b, {word}, 8;"] + [decode_mul_line(d, word if p < 2 else "b", scale, p % 2, mul)
                                          for p, d in enumerate(dsts)]


# the decode's operand constraints: four 32-bit outputs, the word's 8 copies and 4 scale pairs
_DECODE_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 12))


def _bits(n: int) -> list:
    return [1 << i for i in range(n.bit_length() - 1)]


def _layouts(bn: int, bm: int, bk: int, warps: int):
    """Load layouts of one step's words ``[BN, BK/8]``, scale bytes ``[BN, BK/16]``
    and activations ``[BK, BM]``: each is the MMA operand layout (see
    ``mma._operands``) with K relabelled so that a thread's words (4 * BK/128 of
    a row), scale bytes and activations are contiguous in memory, i.e. one
    16-byte load each. The thread that holds word ``p = S*c + s`` of a step
    (``S = BK/32``, ``c`` its lane's K group, ``s`` the repeat) feeds the MMA
    the K range ``32 s + 8 c + (0..7)``: the same permutation of K on both
    operands (and a permutation of K changes no dot product)."""
    s, t = bk // 32, bk // 64
    rows = [[16 * warps * b, 0] for b in _bits(bn // (16 * warps))]
    warp_rows = [[16 * b, 0] for b in _bits(warps)]
    lane_rows = [[1, 0], [2, 0], [4, 0]]
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, b] for b in _bits(s)] + [[8, 0]] + rows, lane_bases=[[0, s], [0, 2 * s]] + lane_rows,
        warp_bases=warp_rows, block_bases=[], shape=[bn, bk // 8])
    scales = gl.DistributedLinearLayout(
        reg_bases=[[0, b] for b in _bits(t)] + [[8, 0]] + rows, lane_bases=[[0, t], [0, 2 * t]] + lane_rows,
        warp_bases=warp_rows, block_bases=[], shape=[bn, bk // 16])
    acts = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0]] + [[8 * b, 0] for b in _bits(s)] + [[0, 8 * b] for b in _bits(bm // 8)],
        lane_bases=[[8 * s, 0], [16 * s, 0], [0, 1], [0, 2], [0, 4]], warp_bases=[[0, 0] for _ in _bits(warps)],
        block_bases=[], shape=[bk, bm])
    # cp.async copies: 4 scale bytes / 8 activations a thread, coalesced (the ring buffers hand
    # the data to the threads that use it: one barrier a step)
    lanes_s = min(32, bk // 64)
    s_copy = gl.BlockedLayout([1, 4], [32 // lanes_s, lanes_s], [warps, 1], [1, 0])
    x_copy = gl.BlockedLayout([8, 1], [min(32, bk // 8), max(1, 32 // (bk // 8))], [1, warps], [0, 1])
    return words, scales, acts, s_copy, x_copy


# cp.async global -> shared: ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared`` before
if hasattr(async_copy, "async_load"):
    @gluon.jit
    def _copy(smem, pointers):
        async_copy.async_load(smem, pointers)
else:  # pragma: no cover - the H200's Triton 3.6
    @gluon.jit
    def _copy(smem, pointers):
        async_copy.async_copy_global_to_shared(smem, pointers)

# a CTA-wide barrier: ``barrier`` from Triton 3.7 on, ``thread_barrier`` before
if hasattr(gl, "barrier"):
    @gluon.jit
    def _sync():
        gl.barrier()
else:  # pragma: no cover - the H200's Triton 3.6
    @gluon.jit
    def _sync():
        gl.thread_barrier()


@gluon.jit
def store_output(acc, no, mo, x_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr, M, N, stride_ym, pid_k,
                 HAS_BIAS: gl.constexpr, HAS_XENC: gl.constexpr, SPLIT: gl.constexpr):
    """The epilogue of mma.py's and wgmma.py's kernels: the fp32 accumulator ``[BN, BM]`` (weight
    rows ``no``, activation rows ``mo``) times ``2^26 / global_enc`` (``2^14`` for fp16 activations;
    W4A4: also divided by the activations' global scale), one correctly rounded factor; then fp32
    partials ``[splits, M, N]`` for _common._gemv_split_finish to sum in order, or + bias into y."""
    enc = gl.load(wenc_ptr)
    if HAS_XENC:
        enc = enc * gl.load(xenc_ptr)
    if x_ptr.dtype.element_ty == gl.float16:
        y = acc * gl.div_rn(enc * 0.0 + 16384.0, enc)
    else:
        y = acc * gl.div_rn(enc * 0.0 + 67108864.0, enc)
    ok = (no < N)[:, None] & (mo < M)[None, :]
    if SPLIT:
        gl.store(y_ptr + (pid_k * M + mo[None, :]).to(gl.int64) * N + no[:, None], y, mask=ok)
    else:
        if HAS_BIAS:
            y += gl.load(bias_ptr + gl.where(no < N, no, 0)).to(gl.float32)[:, None]
        gl.store(y_ptr + mo[None, :].to(gl.int64) * stride_ym + no[:, None], y.to(y_ptr.dtype.element_ty), mask=ok)


def operands_aligned(x2: torch.Tensor, sbits: torch.Tensor) -> bool:
    """Whether the activations have 16-byte aligned rows of unit stride and the scale bytes are
    16-byte aligned (the kernels' 16-byte loads and cp.async copies)."""
    return x2.stride(1) == 1 and x2.stride(0) % 8 == 0 and x2.data_ptr() % 16 == 0 and sbits.data_ptr() % 16 == 0


def aligned_operands(x2: torch.Tensor, sbits: torch.Tensor):
    """The activations with 16-byte aligned rows of unit stride and the scale bytes 16-byte
    aligned (``operands_aligned``), copied only if not."""
    if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    if sbits.data_ptr() % 16:
        sbits = sbits.clone()
    return x2, sbits


def run_once(launches_of, x2, words, sbits, enc, x_enc, bias, y, cfg=None):
    """One call of a kernel module's ``launches`` (mma.py's, wgmma.py's) on aligned operands."""
    x2, sbits = aligned_operands(x2, sbits)
    return launches_of(x2, words, sbits, enc, x_enc, bias, y, cfg)(x2, y)


def product_check(fn, cases, device: torch.device) -> Optional[str]:
    """Run ``fn(x, words, sbits, enc, None, None, y)`` (a ``matmul`` of mma.py's, wgmma.py's or
    wsgemm.py's signature) on random NVFP4 products ``(m, n, k, dtype)`` and compare with
    the reference decode: None, or the first relative error over 1e-2 (NaN included)."""
    from .. import nvfp4
    from ._common import _weight_views

    g = torch.Generator(device=device).manual_seed(0)
    for m, n, k, dtype in cases:
        w = nvfp4.quantize(torch.randn(n, k, device=device, generator=g))
        x = torch.randn(m, k, device=device, generator=g).to(dtype)
        y = fn(x, *_weight_views(w)[2:], None, None, torch.full((m, n), float("nan"), device=device, dtype=dtype))
        ref = x.float() @ w.dequantize(torch.float32).T
        err = float((y.float() - ref).norm() / ref.norm())
        if not err < 1e-2:
            return f"self-test error {err:.2e} at M={m}, N={n}, K={k} ({dtype}) against the reference decode"
    return None


def _index(device: torch.device) -> int:
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def sm90_reason(index: int, label: str) -> Optional[str]:
    """Why GPU ``index`` cannot run a Hopper-only kernel (wgmma.py, wsgemm.py): None on an sm_90 NVIDIA GPU."""
    if index < 0 or getattr(torch.version, "hip", None) or torch.cuda.get_device_capability(index) != (9, 0):
        return f"{label} needs an sm_90 (Hopper) NVIDIA GPU"
    return None


def decide_once(cache: dict, index: int, unsupported, self_test, label: str) -> Optional[str]:
    """The once-per-device answer of a Gluon kernel's guard (mma.py's, wgmma.py's, wsgemm.py's):
    ``unsupported()`` (why the GPU cannot run it, or None), else its ``self_test`` there, kept in
    ``cache``; a failed self-test warns once. Inside a CUDA graph capture nothing is decided
    (the self-test reads its result on the host): that call is refused, the next eager one tests."""
    if index in cache:
        return cache[index]
    reason = unsupported()
    if reason is not None:
        cache[index] = reason
        return reason
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "not self-tested yet (first use inside a CUDA graph capture; warm up eagerly first)"
    try:
        with torch.cuda.device(index):  # Triton launches on the current device
            cache[index] = self_test(torch.device("cuda", index))
    except Exception as exc:  # noqa: BLE001 - a Triton whose Gluon lowers this differently: fall back
        cache[index] = f"did not compile or run: {exc!r}"[:300]
    if cache[index] is not None:
        warnings.warn(f"fp4ptq: {label} is not used on cuda:{index}: {cache[index]}", stacklevel=3)
    return cache[index]


def stop_using(cache: dict, index: int, reason: str, label: str) -> None:
    """Record that a Gluon kernel is not to be used on a device any more (a launch failed)."""
    cache[index] = reason
    warnings.warn(f"fp4ptq: {label} is not used on cuda:{index} any more: {reason}", stacklevel=4)


__all__ = ["DECODE_SHIFTS", "DECODE_SHIFTS_F16", "FMA_BF16", "MAG_MASK", "MAG_MASK_F16", "SIGN_MASK",
           "aligned_operands", "decide_once", "decode_line", "decode_mul_line", "decode_mul_lines",
           "operands_aligned", "product_check", "run_once", "sm90_reason", "stop_using", "store_output"]
