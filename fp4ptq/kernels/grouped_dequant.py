"""The prefill path of the grouped MoE GEMM (W4A16): dequantize the experts that received pairs, then
torch's grouped GEMM.

When every active expert has many rows (prefill), the grouped kernel's in-loop decode runs 2-4x behind a
bf16 grouped GEMM (``results/moe_sweep_h200.json``), while decoding each expert's weight once costs about
one write of it in bf16. ``grouped_mm_dequantized`` does that: one launch (``dequantize_experts``) decodes
the stacked weight ``[E, N, K/2]`` codes, ``[E, N, K/16]`` block scales and ``[E]`` global scales to
``[E, N, K]`` in the activation dtype, skipping the experts without pairs (read from ``Routing.offsets``
on the device: no host synchronization, capturable in a CUDA graph), then ``torch._grouped_mm`` multiplies
the sorted rows by their experts' weights. Workspace: the decoded weight, E * N * K * 2 bytes (Qwen3-30B-A3B
w13: 805 MB; Mixtral-8x7B w13: 1.88 GB), freed to torch's caching allocator after the call.

Numerics: each weight is decoded as ``nvfp4.py`` dequantizes it (``fp32(v) * (fp32(scale) / global_enc)``
rounded once to the activation dtype; the kernel body is ``_common._dequant_kernel``'s), which is what the
reference (``grouped_linear_reference``) multiplies by: the output equals the reference up to the grouped
GEMM's fp32 summation order (a bias is added after, in the activation dtype).

Where it runs (``takes_dequant``): W4A16 with bf16 activations (``torch._grouped_mm`` takes bf16) on a CUDA
device of compute capability 9.0 or more (where it was measured) with ``torch._grouped_mm``, for launches
of 128-row tiles (``DEQUANT_MIN_BLOCK_M``); W4A4 keeps the grouped kernel (after the ``quantize_pairs``
prologue).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _capability, _dequant_kernel, cdiv

# From the H200 sweep (``benchmarks/bench_moe_h200.py --sweep``, ``results/moe_sweep_h200.json``): dequantize
# + torch._grouped_mm beat the grouped kernel only on 128-row tiles (4096 tokens: Qwen3-30B-A3B w13 / w2
# 758 / 408 us against the kernel's best 1523 / 1207; Mixtral 3682 / 1778 against 9606 / 4266) and lost on
# shorter ones (256 tokens: Mixtral's 64-row tiles 1345 / 665 against 748 / 426, Qwen3's 16-row tiles
# 568 / 295 against 220 / 119).
DEQUANT_MIN_BLOCK_M = 128


def takes_dequant(x: torch.Tensor, routing, weight) -> bool:
    """Whether ``grouped_linear``'s rule sends this launch to the dequantize + grouped GEMM path."""
    return (routing.block_m >= DEQUANT_MIN_BLOCK_M and weight.input_enc is None and x.is_cuda
            and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and _capability(x.device) >= (9, 0))


@triton.jit
def _dequant_experts_kernel(w_ptr, s_ptr, wenc_ptr, offsets_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr,
                            BLOCK_B: tl.constexpr, OUT_BF16: tl.constexpr):
    """Expert ``program_id(2)``'s ``[N, K]`` slice of ``_common._dequant_kernel``'s work, or nothing where
    the expert has no pairs (its output slice is left as it was)."""
    e = tl.program_id(2)
    if tl.load(offsets_ptr + e + 1) == tl.load(offsets_ptr + e):
        return
    e64 = e.to(tl.int64)
    _dequant_kernel(w_ptr + e64 * N * (K // 8), s_ptr + e64 * N * (K // 16), wenc_ptr + e, out_ptr + e64 * N * K,
                    N, K, BLOCK_N, BLOCK_B, OUT_BF16)


def dequantize_experts(weight, offsets: torch.Tensor, dtype: torch.dtype,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """``[E, N, K]`` in ``dtype``: expert e's weight of the ``grouped.StackedWeight`` decoded as
    ``weight.expert(e).dequantize(dtype)`` bit for bit where ``offsets[e + 1] > offsets[e]`` (int32
    ``[E + 1]``, a ``Routing``'s), the other experts' slices left unwritten (``out`` as given, else
    uninitialized). One launch."""
    e, n, k = weight.num_experts, weight.out_features, weight.in_features
    if offsets.shape != (e + 1,):
        raise ValueError(f"dequantize_experts: offsets must be [{e + 1}], got {tuple(offsets.shape)}")
    out = out if out is not None else torch.empty((e, n, k), dtype=dtype, device=weight.packed.device)
    if not (e and n and k):
        return out
    words = weight.packed.contiguous().view(torch.int32)
    sbits = weight.scale.contiguous().view(torch.uint8)
    block_n, block_b = 32, min(16, triton.next_power_of_2(max(1, k // 16)))
    bf16 = dtype == torch.bfloat16
    _dequant_experts_kernel[(cdiv(n, block_n), cdiv(k // 16, block_b), e)](
        words, sbits, weight.enc, offsets, out.view(torch.int16) if bf16 else out, n, k,
        BLOCK_N=block_n, BLOCK_B=block_b, OUT_BF16=bf16, num_warps=4, enable_fp_fusion=False)
    return out


def grouped_mm_dequantized(x: torch.Tensor, routing, weight, gather: bool) -> torch.Tensor:
    """``grouped_linear`` (W4A16) as the active experts dequantized to x's dtype, then
    ``torch._grouped_mm`` over the sorted rows: ``y [P, N]``; rows of pairs of no expert (after
    ``offsets[E]``) hold whatever the grouped GEMM left there."""
    if weight.input_enc is not None:
        raise ValueError("grouped_mm_dequantized: W4A4 weights keep the grouped kernel (after the quantize_pairs prologue)")
    w = dequantize_experts(weight, routing.offsets, x.dtype)
    rows = x[routing.token.long()] if gather else x
    y = torch._grouped_mm(rows, w.transpose(-2, -1), offs=routing.offsets[1:])
    if weight.bias is not None:  # each sorted row's expert: the number of experts whose rows end at or before it
        row = torch.arange(routing.pairs, device=x.device, dtype=torch.int32)
        expert = torch.searchsorted(routing.offsets[1:], row, right=True).clamp_(max=weight.num_experts - 1)
        y = y + weight.bias.to(y.dtype)[expert]
    return y


__all__ = ["DEQUANT_MIN_BLOCK_M", "dequantize_experts", "grouped_mm_dequantized", "takes_dequant"]
