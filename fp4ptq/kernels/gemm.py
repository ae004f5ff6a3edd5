"""The tiled Triton GEMM, the dequantize launch, and the launcher of every W4A16 / W4A4 path.

``linear_w4a16`` / ``linear_w4a4`` (``path=None``) take the path ``dispatch.choose`` names for the
shape, dtype and device and launch it: a GEMV (``gemv.py``), a Gluon tensor-core kernel (``mma.py``,
``wgmma.py``, ``wsgemm.py``), ``tl.dot_scaled`` on sm_100+ (``dot_scaled.py``, W4A4), the tiled GEMM
here (``tl.dot`` on exactly decoded weight tiles), or dequantize + cuBLAS. W4A4 first quantizes the
activations (``quantize_kernel.py``) to exact ``v * scale`` operands; every product is then an exact
NVFP4 x NVFP4 product, summed in fp32, and the global scales divide the fp32 result once.
``linear_plan`` decides the launches once for a repeated input shape.

Weights stay in the checkpoint layout (``weight_packed [N, K/2]`` uint8, read as int32 words of 8
codes or int64 blocks of 16; ``weight_scale [N, K/16]`` e4m3); see ``_common`` for the decode.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import nvfp4
from ..nvfp4 import NVFP4Tensor
from . import _common, dispatch, dot_scaled, gemv, quantize_kernel, rules
from ._common import (_dequant_kernel, _output_scale, _weight_in_place, _weight_views, cdiv, decode_tile,
                      next_pow2)


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #

@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, s_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, HAS_XENC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, BF16_DIRECT: tl.constexpr, DOT_FP32: tl.constexpr,
):
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
        acc = tl.dot(x, tl.trans(wt), acc)
    if BF16_DIRECT:
        y = _output_scale(acc, wenc_ptr, xenc_ptr, 67108864.0, HAS_XENC)  # 2^26
    else:
        y = _output_scale(acc, wenc_ptr, xenc_ptr, 16384.0, HAS_XENC)  # 2^14
    if HAS_BIAS:
        y += tl.load(bias_ptr + n_ld).to(tl.float32)[None, :]
    ptrs = y_ptr + m_ld[:, None] * stride_ym + n_ld[None, :]
    tl.store(ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------- #
# Host side
# --------------------------------------------------------------------------- #

# The W4A4 dequantize + cuBLAS path keeps cuBLAS's fp32 sums until the global scales divide them: an fp32
# [rows, N] product beside the output. Above this many bytes of it the rows go in chunks (whole multiples
# of 128 rows), so a long prefill holds at most this much more memory; 2 GiB leaves every shape timed on
# the H200 in one piece (70B gate_up at M = 8192 is 1.75 GiB, results/w4a4_cublas_h200.json), and a chunk
# then is a GEMM at least that large.
W4A4_CUBLAS_FP32_BYTES = 2 << 30


# bf16 weights decoded straight into bf16 (see decode_tile; exact on the H200, all codes and
# subnormal scales checked in runs 3-4); never under the interpreter, which flushes bf16 subnormals.
BF16_DIRECT = not _common.INTERPRET


def _gemm_config(m: int, n: int, k: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages[, SWAP_AB]) by
    shape: ``rules.TILES``' gemm rows (the best of the H200 sweeps)."""
    return rules.tile("gemm", m, n, k)


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
            out: Optional[torch.Tensor] = None, picked: bool = False, dependent: bool = False):
    """``x2 [M, K] @ dequant(weight).T`` (/ x_enc) + bias -> [M, N] in x2's dtype
    (written into ``out`` when given: tests poison it first).
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
        path = dispatch.choose(m, x2.dtype, x_enc is not None, k, x2.device, n)
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
        if x_enc is not None:
            raise ValueError("the dot_scaled path takes W4A4 activations as codes + scales (linear_w4a4)")
        return dot_scaled.matmul(x2, None, None, weight, bias, x2.dtype, out=y)
    if path == "mma":
        if not auto:  # the shape rules only pick it where it can run
            reason = dispatch.mma_unavailable_reason(m, k, x2.dtype, x2.device)
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
    if path in dispatch.GLUON_SM90_K:  # "wgmma" (65 <= M <= 128), "wsgemm" (the warp-specialized GEMM)
        if not auto:
            reason = dispatch.gluon_sm90_reason(path, m, n, k, x2.dtype, x2.device)
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
    if path == "gemv6" and x2.dtype == torch.bfloat16:
        reason = dispatch.gemv_bf16_reason(x2.device)
        if reason is not None:  # (the shape rules send these calls to the tiled GEMM there)
            raise ValueError(f"path {path!r}: {reason}")
    if path == "gemv6":
        if x2.data_ptr() % 8 or x2.stride(0) % 4:  # x is read as 8-byte words
            x2 = x2.clone(memory_format=torch.contiguous_format)
        return gemv._gemv6(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc,
                           dependent=dependent)(x2, y)
    if path == "gemv4":
        return gemv.gemv4(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc)
    if path != "gemm":
        raise ValueError(f"unknown GEMM path {path!r}")
    bm, bn, bk, group, warps, stages = _gemm_config(m, n, k)
    grid = (cdiv(m, bm) * cdiv(n, bn),)
    _gemm_kernel[grid](
        x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, x2.stride(0), y.stride(0),
        HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
        EVEN_K=k % bk == 0, BF16_DIRECT=BF16_DIRECT and x2.dtype == torch.bfloat16,
        DOT_FP32=_common.INTERPRET and x2.dtype == torch.bfloat16,
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
    ``path``: None (by shape), "gemv4", "gemv6", "mma", "wgmma", "wsgemm", "gemm",
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
        path = dispatch.choose(x2.shape[0], x2.dtype, True, x2.shape[-1], x2.device, weight.shape[0])
    if path == "dot_scaled":  # codes + scales of x, then one scaled MMA per tile
        if x2.dtype not in (torch.bfloat16, torch.float16):
            raise nvfp4.NVFP4Error(f"W4A4 takes bf16/fp16 activations, got {x2.dtype}")
        xp, xsc, x_enc, _ = quantize_kernel.launch_quantize(x2, input_amax, four_six, emit="packed")
        y = dot_scaled.matmul(xp, xsc, x_enc, weight, bias, x2.dtype, out=out)
    else:
        # the GEMM launches as the quantize launch's programmatic dependent where it reads the weight's own
        # buffers (a copy made between the two would be read before its wait)
        pair = (requested is None and _weight_in_place(weight)
                and dispatch.w4a4_pairs_path(path, x2.shape[0], weight.shape[0], x2.shape[1], x2.device))
        xs, x_enc = quantize_kernel.quantize_scaled(x2, input_amax, four_six, trigger=pair)
        # an automatic choice stays one (a failed mma launch can fall back)
        y = _matmul(xs, weight, bias, x_enc, path=path, out=out, picked=requested is None, dependent=pair)
    return y.reshape(*lead, y.shape[-1])


__all__ = ["dequantize", "linear_w4a16", "linear_w4a4"]


# --------------------------------------------------------------------------- #
# _common.Launch plans: a layer's launches decided once for inputs shaped alike
# --------------------------------------------------------------------------- #

def linear_plan(x: torch.Tensor, weight: NVFP4Tensor, bias: Optional[torch.Tensor] = None,
                input_amax: Optional[torch.Tensor] = None, four_six: Optional[str] = None):
    """The launches of ``linear_w4a16(x, weight, bias)`` (or, given ``input_amax``, ``linear_w4a4(x,
    weight, input_amax, bias, four_six=four_six)``) decided once for inputs shaped like ``x`` (shape,
    strides, dtype, device): a callable ``plan(x) -> y`` (W4A4: ``plan(x, input_amax)``, the amax of
    that call), which returns None for a call it cannot take (another device current, an activation
    address the kernels' vector loads cannot use, an amax not fp32 on x's device: the dispatch then
    takes that call), or None where the path is not planned (gemv4, the tiled GEMM and
    dequantize + cuBLAS; W4A4 on FP4 tensor cores; operands the dispatch would copy). A plan holds views of the weight's buffers and its launches (``Launch``), which
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
    path = dispatch.choose(m, x2.dtype, w4a4, k, device, n)
    if path == "wsgemm" and (k // 16) % 16:
        # its scales come from wsgemm.tma_scales' padded copy, which a plan would keep: an in-place write to
        # the weight after the plan was built would not reach it (plans read the buffers themselves); the
        # dispatch asks tma_scales on every call, which copies again after such a write
        return None
    y = torch.empty(m, n, dtype=x2.dtype, device=device)
    bias_arg = bias if bias is not None else enc
    quantize = qwords = None
    if w4a4:
        if (path == "dot_scaled" or four_six not in quantize_kernel.FOUR_SIX_CODES
                or input_amax.device != device or input_amax.dtype != torch.float32):
            return None  # on FP4 tensor cores; an amax the dispatch converts
        amax = input_amax.reshape(1)
        if quantize_kernel._takes_quant16(x2, "scaled", None):
            qwords = quantize_kernel._words(x2)
            if qwords is None:
                return None
        # the GEMM as the quantize launch's programmatic dependent (the weight views are its own buffers here)
        pair = dispatch.w4a4_pairs_path(path, m, n, k, device)
        quantize = quantize_kernel.quantize_launches(x2, qwords, amax, four_six, "scaled", None, pair)
        x_enc, slots = torch.empty(1, dtype=torch.float32, device=device), (0, 4, 6)
        x2 = torch.empty(m, k, dtype=x2.dtype, device=device)  # the quantized operand: a fresh tensor
    else:
        x_enc, slots, pair = None, (0, 6), False
    if path == "gemv6" and x2.stride(0) % 4 == 0:
        align = 8  # x read as 8-byte words
        run = gemv._gemv6(x2, words, sbits, enc, x_enc if w4a4 else enc, bias_arg, y, m, n, k, bias is not None, x_enc,
                     slots=slots, dependent=pair)
    elif path in ("mma", "wgmma", "wsgemm") and x2.stride(0) % 8 == 0:
        align = 16  # 16-byte copies (TMA for wsgemm) of x
        module = importlib.import_module(f".{path}", __package__)
        # wsgemm: its split tiles' counters, and the weight's scale tensor for tma_scales' padded copy
        own = dict(own_counters=True, scale_owner=weight.block_scale) if path == "wsgemm" else {}
        if pair:  # (mma.py only: dispatch.w4a4_pairs_path)
            own = dict(dependent=True)
        run = module.launches(x2, words, sbits, enc, x_enc, bias, y, slots=slots, **own)
    else:
        return None
    if quantize is not None:  # the GEMM reads the fresh quantized operand; x itself goes to the quantize
        align = 4             # kernel, as int32 words or fp32-compared
    index, on_cuda, shape, dtype = device.index, device.type == "cuda", (m, n), x2.dtype

    def plan(x: torch.Tensor, input_amax: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        x2 = x.view(-1, k)
        if x2.data_ptr() % align or (on_cuda and _common.current_device() != index):
            return None
        if quantize is None:
            return run(x2, torch.empty(shape, dtype=dtype, device=device)).view(*lead, n)
        if input_amax.device != device or input_amax.dtype != torch.float32:
            return None
        xs, x_enc = quantize(x2.view(torch.int32) if qwords is not None else x2, input_amax.reshape(1))
        return run(xs, x_enc.reshape(1), torch.empty(shape, dtype=dtype, device=device)).view(*lead, n)
    return plan
