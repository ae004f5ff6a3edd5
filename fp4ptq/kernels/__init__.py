"""The one dispatch point for NVFP4 compute ops.

Each op takes ``backend="auto" | "reference" | "triton"``. ``auto`` picks the
Triton kernels when they can run the input (a CUDA tensor, bf16/fp16
activations for the GEMMs, and a working Triton) and the ``fp4ptq.nvfp4``
reference otherwise. Asking for a backend that cannot run raises
``BackendUnavailable`` with the reason. Under ``TRITON_INTERPRET=1`` (set
before the kernel modules are imported) ``backend="triton"`` runs the same
kernels on CPU tensors: that is how the tests check them without a GPU.

Modules: ``dispatch.py`` (which path takes a call: the rules as one table), ``gemm.py`` (the launcher of
every path, the tiled GEMM and dequantize + cuBLAS), ``gemv.py`` (M = 1-2), ``mma.py`` / ``wgmma.py`` /
``wsgemm.py`` (Gluon tensor-core kernels, the last two sm_90 only), ``dot_scaled.py`` (W4A4 on the FP4
tensor cores of sm_100+), ``quantize_kernel.py`` (quantize, bit-identical to ``nvfp4.quantize``),
``grouped.py`` (a MoE layer's experts, ``moe_experts``: one grouped launch per expert projection), and
``_common.py``, which they all share and which imports none of them. ``_backend.py`` holds what these ops
and the families share about backends (``BACKENDS``, ``BackendUnavailable``, ``triton_unavailable_reason``,
the reference products): nothing in ``kernels/`` imports this package's ``__init__``.

``linear_plan`` gives the same launches decided once for a repeated input shape (``gemm.linear_plan``;
``NVFP4Linear`` keeps them per shape for eager calls): every launch site builds ``_common.Launch``
objects, which replay the compiled kernels past Triton's argument binding (Triton 3.6).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Union

import torch

from .. import nvfp4
from ..nvfp4 import NVFP4Tensor
from ._backend import (BACKENDS, BackendUnavailable, Decoder, _interpreting, _Linear, needs_grad,  # noqa: F401
                       reference_w4a4, reference_w4a16, triton_unavailable_reason)


def _pick(backend: str, x: torch.Tensor, op: str = "quantize", weight: Optional[NVFP4Tensor] = None) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    if backend == "reference":
        return "reference"
    reason = triton_unavailable_reason(x, op=op)
    if reason is None and weight is not None and (len(weight.shape) != 2 or weight.padded_k != weight.shape[-1]):
        reason = f"the Triton GEMMs need an unpadded 2-D weight, got shape {tuple(weight.shape)}"
    if backend == "triton":
        if reason is not None:
            raise BackendUnavailable(f"backend='triton' cannot run {op}: {reason}")
        return "triton"
    return "triton" if reason is None and x.is_cuda else "reference"


def _on_device_of(x: torch.Tensor):
    """Make x's GPU the current device for the launch: Triton launches on the
    current device, and a layer placed on another GPU (``device_map``) would
    otherwise run its kernels where its tensors are not. (Entering the device context costs
    several microseconds a call, so only where x is not on the current device already.)"""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def quantize(
    x: torch.Tensor,
    four_six: Optional[str] = None,
    *,
    amax: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> NVFP4Tensor:
    """Quantize a 2-D ``[M, K]`` tensor (activations or weights) to NVFP4."""
    if _pick(backend, x) == "triton":
        from . import quantize_kernel

        with _on_device_of(x):
            return quantize_kernel.quantize(x, four_six, amax=amax)
    return nvfp4.quantize(x, four_six, amax=amax)


def linear_w4a16(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    backend: str = "auto",
    decoded: Optional[Decoder] = None,
) -> torch.Tensor:
    """``y = x @ dequant(weight).T + bias`` for ``x [..., K]`` in x's dtype; differentiable in x
    and bias where they ask for it (the weight is frozen; ``_Linear``).

    decoded: optional ``dtype -> weight.dequantize(dtype)`` (e.g. a cache); only
             the reference path calls it, the Triton kernels read the packed weight."""
    if needs_grad(x, bias):
        return _Linear.apply(x, bias, weight, None, None, lambda x, bias: _w4a16(x, weight, bias, backend, decoded))
    return _w4a16(x, weight, bias, backend, decoded)


def _w4a16(x, weight, bias, backend, decoded):
    if _pick(backend, x, "linear_w4a16", weight) == "triton":
        from . import gemm

        with _on_device_of(x):
            return gemm.linear_w4a16(x, weight, bias)
    return reference_w4a16(x, weight, bias, decoded)


def linear_plan(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    bias: Optional[torch.Tensor] = None,
    input_amax: Optional[torch.Tensor] = None,
    *,
    four_six: Optional[str] = None,
    backend: str = "auto",
):
    """The launches of ``linear_w4a16`` (or, given ``input_amax``, ``linear_w4a4``) decided once for
    inputs shaped like ``x``: a callable ``plan(x) -> y`` (None for a call it cannot take), or None
    where the backend is not Triton or the path is not planned (``gemm.linear_plan``). For callers
    that repeat a call shape (eager decoding): a planned call skips the shape rules and, from its
    third call, Triton's binder."""
    if _pick(backend, x, "linear_w4a16" if input_amax is None else "linear_w4a4", weight) != "triton":
        return None
    from . import gemm

    with _on_device_of(x):
        return gemm.linear_plan(x, weight, bias, input_amax, four_six)


def auto_path(rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *, w4a4: bool = False) -> str:
    """The path the automatic dispatch takes for ``rows`` activation rows of ``dtype`` times an ``n x k``
    NVFP4 weight on ``device``: a path of ``dispatch.RULES`` ("gemv6", "gemv4", "mma", "wgmma", "wsgemm",
    "dot_scaled", "gemm", "cublas"), or "reference" off CUDA / under the interpreter. Its
    first answer for a Gluon path may run that kernel's self-test on the device."""
    device = torch.device(device)
    if device.type != "cuda" or _interpreting():
        return "reference"
    from . import dispatch

    return dispatch.choose(rows, dtype, w4a4, k, device, n)


def linear_w4a4(
    x: torch.Tensor,
    weight: NVFP4Tensor,
    input_amax: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    four_six: Optional[str] = None,
    backend: str = "auto",
    decoded: Optional[Decoder] = None,
) -> torch.Tensor:
    """W4A4: quantize ``x`` per 16-block under the static ``input_amax`` (with
    Four Over Six if asked), then ``y = dequant(xq) @ dequant(weight).T + bias``.
    ``decoded`` as in ``linear_w4a16`` (called with fp32). Differentiable in x (a clipped
    straight-through estimator for the activation quantizer) and bias (``_Linear``)."""
    if needs_grad(x, bias):
        return _Linear.apply(x, bias, weight, input_amax, four_six,
                             lambda x, bias: _w4a4(x, weight, input_amax, bias, four_six, backend, decoded))
    return _w4a4(x, weight, input_amax, bias, four_six, backend, decoded)


def _w4a4(x, weight, input_amax, bias, four_six, backend, decoded):
    if _pick(backend, x, "linear_w4a4", weight) == "triton":
        from . import gemm

        with _on_device_of(x):
            return gemm.linear_w4a4(x, weight, input_amax, bias, four_six=four_six)
    return reference_w4a4(x, weight, input_amax, bias, four_six, decoded)


def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w13, w2,
                gate: Union[str, Callable] = "silu", *, backend: str = "auto") -> torch.Tensor:
    """A Mixture-of-Experts layer's NVFP4 experts (``grouped.StackedWeight`` w13: gate over up rows, and
    w2) in one grouped launch per projection, reading only the experts that received tokens
    (``grouped.py``); ``gate``: "silu" (SwiGLU, fused) or the layer's ``gate(g, u)`` (``grouped.moe``);
    ``backend`` as the other ops (the reference is the loop over experts)."""
    from . import grouped

    with _on_device_of(hidden):
        return grouped.moe(hidden, top_k_index, top_k_weights, w13, w2, gate, backend=backend)


__all__ = ["BACKENDS", "BackendUnavailable", "auto_path", "linear_plan", "linear_w4a16", "linear_w4a4", "moe_experts",
           "needs_grad", "quantize", "triton_unavailable_reason"]
