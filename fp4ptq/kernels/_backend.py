"""What the package's ops (``kernels/__init__.py``) and the kernel families share about backends, importing
no family and not the package: the backend names, ``BackendUnavailable``, why Triton cannot run an input,
the reference products (``nvfp4.py``) and their gradient (``_Linear``). The families that need these
(``grouped.py``, ``routing.py``) import them from here, so nothing in ``kernels/`` imports back into the
package's ``__init__``."""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional

import torch

from .. import nvfp4
from ..nvfp4 import NVFP4Tensor

BACKENDS = ("auto", "reference", "triton")

Decoder = Callable[[torch.dtype], torch.Tensor]


class BackendUnavailable(RuntimeError):
    """The requested kernel backend cannot run this input here."""


def _interpreting() -> bool:
    """Whether the Triton kernels run under the interpreter (CPU tensors).
    Triton decides when a kernel module is imported; before that, the env var."""
    built = sys.modules.get(__package__ + "._common")
    if built is not None:
        return built.INTERPRET
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_unavailable_reason(x: torch.Tensor, *, op: str = "quantize") -> Optional[str]:
    """Why the Triton backend cannot run ``op`` on ``x`` (None when it can)."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        return f"triton is not importable ({exc})"
    if not x.is_cuda and not _interpreting():
        return f"the input is on {x.device}, the Triton kernels need a CUDA device (or TRITON_INTERPRET=1)"
    if op != "quantize" and x.dtype not in (torch.bfloat16, torch.float16):
        return f"the Triton GEMMs take bf16/fp16 activations, got {x.dtype}"
    return None


def needs_grad(x: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether a layer call must keep autograd's graph: x or the bias asks for a gradient (``_Linear``)."""
    return (x.requires_grad or (bias is not None and bias.requires_grad)) and torch.is_grad_enabled()


class _Linear(torch.autograd.Function):
    """An NVFP4 layer's product where a gradient is asked for (LoRA-style training on a quantized base,
    input attributions): the Triton kernels write their outputs outside autograd, and W4A4's activation
    quantizer has no derivative, so both would drop the gradient through the layer without a word.
    The packed weight is frozen: ``dx = dy @ dequant(W)`` (in dy's dtype) and ``dbias = sum(dy)``;
    W4A4 passes dy straight through its activation quantizer where ``|x|`` is within what it
    represents (``6 * 448 / global_enc``, past which it saturates) and stops it beyond (a clipped
    straight-through estimator). Forward: ``product(x, bias)``, the caller's (the dispatch, or the
    reference), unchanged."""

    @staticmethod
    def forward(ctx, x, bias, weight, input_amax, four_six, product):
        ctx.weight = weight
        ctx.w4a4 = input_amax is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        if ctx.w4a4 and ctx.needs_input_grad[0]:  # where the quantizer does not saturate: |x| <= FP4_MAX * FP8_MAX / enc
            amax = input_amax if torch.is_tensor(input_amax) else torch.tensor(float(input_amax))
            enc = nvfp4.global_encode_scale(amax.to(device=x.device, dtype=torch.float32), four_six is not None)
            ctx.save_for_backward(x.abs() <= (nvfp4.FP4_MAX * nvfp4.FP8_MAX) / enc)
        return product(x, bias)

    @staticmethod
    def backward(ctx, dy):
        dx = dbias = None
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(dy, ctx.weight.dequantize(dy.dtype).to(dy.device))
            if ctx.w4a4:
                dx = dx * ctx.saved_tensors[0]
        if ctx.needs_input_grad[1]:
            dbias = dy.reshape(-1, dy.shape[-1]).sum(0).to(ctx.bias_dtype)
        return dx, dbias, None, None, None, None


def reference_w4a16(x: torch.Tensor, weight: NVFP4Tensor, bias: Optional[torch.Tensor],
                    decoded: Optional[Decoder] = None) -> torch.Tensor:
    """``linear_w4a16``'s reference (no autograd wrapper): x times the dequantized weight in x's dtype."""
    w_hat = decoded(x.dtype) if decoded is not None else weight.dequantize(x.dtype)
    # (a bias of another dtype is taken in x's, as the kernels read it)
    return torch.nn.functional.linear(x, w_hat, None if bias is None else bias.to(x.dtype))


def reference_w4a4(x: torch.Tensor, weight: NVFP4Tensor, input_amax, bias: Optional[torch.Tensor],
                   four_six: Optional[str], decoded: Optional[Decoder] = None) -> torch.Tensor:
    """``linear_w4a4``'s reference (no autograd wrapper)."""
    # Products of E2M1 values and E4M3-derived steps are computed in fp32 here. The fused
    # fake-quantizer equals nvfp4.quantize(...).dequantize(fp32) bit for bit (tests pin it).
    x_hat = nvfp4.fake_quantize_fused(x, four_six, amax=input_amax, dtype=torch.float32, name="activation")
    w_hat = decoded(torch.float32) if decoded is not None else weight.dequantize(torch.float32)
    y = torch.nn.functional.linear(x_hat, w_hat)
    y = y.to(x.dtype)
    return y if bias is None else y + bias.to(y.dtype)


def linear_reference(x: torch.Tensor, weight: NVFP4Tensor, bias: Optional[torch.Tensor] = None,
                     input_amax=None, four_six: Optional[str] = None) -> torch.Tensor:
    """``linear_w4a16`` (``input_amax`` None) or ``linear_w4a4`` with ``backend="reference"``, differentiable
    as they are (``_Linear``)."""
    def product(x, bias):
        if input_amax is None:
            return reference_w4a16(x, weight, bias)
        return reference_w4a4(x, weight, input_amax, bias, four_six)

    if needs_grad(x, bias):
        return _Linear.apply(x, bias, weight, input_amax, four_six, product)
    return product(x, bias)
