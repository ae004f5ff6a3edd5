"""NVFP4 GEMMs on FP4 tensor cores (sm_100 and later) through ``tl.dot_scaled``.

``y = x @ W^T`` with W packed E2M1 codes ``[N, K/2]`` and E4M3 block scales
``[N, K/16]`` as stored, and x either NVFP4 too (W4A4: the activations are
quantized by the quantize kernel to codes + scales under their static global
scale) or bf16/fp16 (W4A16). Both block scales go to the hardware as they
are: on Blackwell a W4A4 tile is one ``tcgen05.mma ... kind::mxf4nvf4
.block_scale`` (checked in the PTX that Triton 3.6 and 3.9 emit for sm_100:
``scale_vec::4X`` / ``block16``, i.e. 16-element blocks with E4M3 scales).
The products of E2M1 values and E4M3 scales are exact and the sums fp32; the
two global scales divide the fp32 result once, as in the Hopper kernels.

No GPU here has FP4 tensor cores, so this path is guarded twice:

* ``ready(device, fmt)`` is None only on compute capability >= 10, where the
  kernel compiled and a self-test (a 96 x 80 x 160 product against the
  reference decode in fp32, partial tiles included) agreed to 1e-3. The
  verdict is cached per device and format; a failure is reported once as a
  warning and the dispatch keeps the sm_90 paths.
* Under the Triton interpreter the same kernel runs on the CPU, but the
  interpreter decodes every scale byte as E8M0 (``2^(b - 127)``). The tests
  use power-of-two E4M3 scales and hand the interpreter their E8M0 bytes
  (``_interpreter_scales``): that checks the tiling, masking, nibble order
  and global scaling, everything except the hardware's E4M3 decode.

Triton 3.6 (the H200's) compiles the W4A4 kernel for sm_100 but not the bf16 x
E2M1 one, nor either for sm_90; Triton 3.9 compiles all four (sm_90 by
decomposing to bf16 wgmma). The dispatch uses this path for W4A4 with more
than ``dispatch.GEMV_MAX_M`` rows; W4A16 takes it only when asked
(``path="dot_scaled"``): on B200 it would be a bf16 MMA after an in-register
upcast, not measured against dequantize + cuBLAS.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import nvfp4
from ..nvfp4 import BLOCK_SIZE, NVFP4Tensor
from ._common import _output_scale, cdiv

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@triton.jit
def _row_tile(ptr, rows, stride, cols, limit, EVEN_K: tl.constexpr, other):
    """``ptr[rows, cols]`` of a row-major operand; columns past ``limit`` read ``other``."""
    if EVEN_K:
        return tl.load(ptr + rows[:, None] * stride + cols[None, :])
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=(cols < limit)[None, :], other=other)


@triton.jit
def _dot_scaled_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    X_FMT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_XENC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # One [BLOCK_M, BLOCK_N] output tile; K in steps of BLOCK_K elements
    # (BLOCK_K / 2 code bytes, BLOCK_K / 16 scales). Rows past M / N are
    # clamped for the loads and masked at the store; K past the end loads
    # code 0 under scale 0.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ld = tl.where(m < M, m, 0).to(tl.int64)
    n_ld = tl.where(n < N, n, 0).to(tl.int64)
    kh = K // 2
    kb = K // 16
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        c = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # code bytes
        s = k0 // 16 + tl.arange(0, BLOCK_K // 16)  # scales
        w = _row_tile(w_ptr, n_ld, kh, c, kh, EVEN_K, 0)
        ws = _row_tile(ws_ptr, n_ld, kb, s, kb, EVEN_K, 0.0)  # fp8 scales take a float fill
        if X_FMT == "e2m1":
            x = _row_tile(x_ptr, m_ld, stride_xm, c, kh, EVEN_K, 0)
            xs = _row_tile(xs_ptr, m_ld, kb, s, kb, EVEN_K, 0.0)
            acc = tl.dot_scaled(x, xs, "e2m1", tl.trans(w), ws, "e2m1", acc)
        else:
            x = _row_tile(x_ptr, m_ld, stride_xm, k0 + tl.arange(0, BLOCK_K), K, EVEN_K, 0.0)
            acc = tl.dot_scaled(x, None, X_FMT, tl.trans(w), ws, "e2m1", acc)
    y = _output_scale(acc, wenc_ptr, xenc_ptr, 1.0, HAS_XENC)  # / (global_w * global_x)
    if HAS_BIAS:
        y += tl.load(bias_ptr + n_ld).to(tl.float32)[None, :]
    tl.store(y_ptr + m_ld[:, None] * stride_ym + n_ld[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(m < M)[:, None] & (n < N)[None, :])


def _interpreter_scales(scale: torch.Tensor) -> torch.Tensor:
    """E4M3 scales -> the E8M0 bytes the Triton interpreter decodes them as
    (it reads every scale as E8M0); only powers of two (and 0) carry over."""
    v = scale.float()
    exp = torch.log2(v.clamp_min(2.0 ** -126)).round()
    if not torch.equal(torch.where(v > 0, torch.exp2(exp), v), v):
        raise nvfp4.NVFP4Error("under the Triton interpreter dot_scaled needs power-of-two E4M3 scales")
    return (exp + 127).clamp(0, 254).to(torch.uint8)


def _config(m: int, n: int, k: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): tcgen05 tiles,
    not tuned (no sm_100 GPU here); smaller under the interpreter."""
    if INTERPRET:
        return 16, 32, 64, 1, 4, 1
    return (128 if m > 64 else 64), 128, 128, 8, 4, 3


def matmul(x2: torch.Tensor, x_scale: Optional[torch.Tensor], x_enc: Optional[torch.Tensor], weight: NVFP4Tensor,
           bias: Optional[torch.Tensor], out_dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x2 @ dequant(weight).T`` (+ bias) in ``out_dtype``. NVFP4 x: ``x2`` the packed
    codes ``[M, K/2]`` uint8, ``x_scale`` its E4M3 scales ``[M, K/16]``, ``x_enc``
    its global scale; bf16/fp16 x: ``x2 [M, K]``, ``x_scale = x_enc = None``."""
    n, k = weight.shape[0], weight.shape[-1]
    if len(weight.shape) != 2 or weight.padded_k != k or k % BLOCK_SIZE:
        raise nvfp4.NVFP4Error(f"dot_scaled GEMM needs an unpadded 2-D weight with K % 16 == 0; got "
                               f"{tuple(weight.shape)}")
    if x2.is_cuda and not INTERPRET and torch.cuda.get_device_capability(x2.device)[0] < 10:
        major, minor = torch.cuda.get_device_capability(x2.device)
        raise nvfp4.NVFP4Error(f"the dot_scaled path needs FP4 tensor cores (sm_100 or later); {x2.device} is "
                               f"sm_{major}{minor}: use the default dispatch")
    fp4_x = x_scale is not None
    m = x2.shape[0]
    if x2.shape[1] != (k // 2 if fp4_x else k):
        raise ValueError(f"activation of shape {tuple(x2.shape)} does not match the NVFP4 weight {tuple(weight.shape)}")
    if not fp4_x and x2.dtype not in FORMATS:
        raise nvfp4.NVFP4Error(f"dot_scaled GEMM takes NVFP4, bf16 or fp16 activations, got {x2.dtype}")
    x2 = x2.contiguous()
    y = torch.empty(m, n, dtype=out_dtype, device=x2.device) if out is None else out
    if y.shape != (m, n) or y.dtype != out_dtype or y.stride(1) != 1:
        raise ValueError(f"out must be a [{m}, {n}] {out_dtype} tensor with unit last stride")
    if m == 0 or n == 0:
        return y
    w = weight.packed.contiguous()
    ws = weight.block_scale.contiguous()
    xs = x_scale.contiguous() if fp4_x else None
    if INTERPRET:
        ws = _interpreter_scales(ws)
        xs = _interpreter_scales(xs) if fp4_x else None
    enc = weight.global_enc.reshape(1).to(torch.float32)
    bm, bn, bk, group, warps, stages = _config(m, n, k)
    grid = (cdiv(m, bm) * cdiv(n, bn),)
    _dot_scaled_kernel[grid](
        x2, xs if fp4_x else enc, w, ws, enc, x_enc.reshape(1) if fp4_x else enc,
        bias.contiguous() if bias is not None else enc, y, m, n, k, x2.stride(0), y.stride(0),
        X_FMT="e2m1" if fp4_x else FORMATS[x2.dtype], HAS_BIAS=bias is not None, HAS_XENC=fp4_x,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, EVEN_K=k % bk == 0, num_warps=warps,
        num_stages=stages,
    )
    return y


_READY: dict = {}


def _self_test(device: torch.device, fmt: str) -> Optional[str]:
    """Run a small product with partial tiles against the reference decode."""
    g = torch.Generator(device=device).manual_seed(0)
    w = nvfp4.quantize(torch.randn(80, 160, device=device, generator=g))
    x = torch.randn(96, 160, device=device, generator=g)
    wref = w.dequantize(torch.float32)
    if fmt == "e2m1":
        amax = x.abs().amax()
        xq = nvfp4.quantize(x, amax=amax)
        y = matmul(xq.packed, xq.block_scale, xq.global_enc, w, None, torch.float32)
        ref = xq.dequantize(torch.float32) @ wref.T
    else:
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float16
        xd = x.to(dtype)
        y = matmul(xd, None, None, w, None, torch.float32)
        ref = xd.float() @ wref.T
    err = float((y - ref).norm() / ref.norm())
    return None if err < 1e-3 else f"self-test error {err:.2e} against the reference decode"


def ready(device: torch.device, fmt: str) -> Optional[str]:
    """None when the FP4 tensor-core path can run ``fmt`` activations on
    ``device`` (compiled and self-tested once); otherwise why not."""
    if device.type != "cuda":
        return f"the input is on {device}"
    key = (device.index if device.index is not None else torch.cuda.current_device(), fmt)
    if key not in _READY:
        major, minor = torch.cuda.get_device_capability(key[0])
        if major < 10:
            _READY[key] = f"sm_{major}{minor} has no FP4 tensor cores (tl.dot_scaled needs sm_100 or later)"
            return _READY[key]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():  # the self-test syncs: not inside a graph capture
            return "not self-tested yet (first use inside a CUDA graph capture; warm up eagerly first)"
        try:
            _READY[key] = _self_test(torch.device("cuda", key[0]), fmt)
        except Exception as exc:  # noqa: BLE001 - a compiler without this lowering: fall back
            _READY[key] = f"did not compile or run: {exc!r}"[:300]
        if _READY[key] is not None:
            warnings.warn(f"fp4ptq: the tl.dot_scaled NVFP4 path is not used on cuda:{key[0]} ({fmt} activations): "
                          f"{_READY[key]}", stacklevel=2)
    return _READY[key]


__all__ = ["matmul", "ready"]
