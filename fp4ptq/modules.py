"""NVFP4Linear: an ``nn.Linear`` replacement holding packed NVFP4 weights.

Its buffers are exactly the compressed-tensors checkpoint tensors, so its
``state_dict`` is what goes to disk:

    weight_packed        uint8           [out, in/2]
    weight_scale         float8_e4m3fn   [out, in/16]
    weight_global_scale  float32         [1]   (global_enc, a divisor)
    input_global_scale   float32         [1]   (W4A4 only: 6*448/input_amax)

``forward`` calls only ``fp4ptq.kernels`` (Triton on CUDA, reference elsewhere).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import kernels, nvfp4
from .nvfp4 import BLOCK_SIZE, NVFP4Tensor

SCHEMES = ("w4a16", "w4a4")


class NVFP4Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        scheme: str = "w4a16",
        act_four_six: Optional[str] = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r}; choose one of {SCHEMES}")
        if in_features % BLOCK_SIZE:
            raise ValueError(
                f"NVFP4Linear: in_features={in_features} is not a multiple of {BLOCK_SIZE}; "
                "keep this layer in high precision"
            )
        if act_four_six is not None and act_four_six not in nvfp4.FOUR_SIX_RULES:
            raise ValueError(f"unknown Four Over Six rule {act_four_six!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = scheme
        self.act_four_six = act_four_six if scheme == "w4a4" else None
        self.dtype = dtype
        self.register_buffer(
            "weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            "weight_scale",
            torch.zeros(out_features, in_features // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device),
        )
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        if scheme == "w4a4":
            self.register_buffer("input_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        else:
            self.input_global_scale = None
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    # ------------------------------------------------------------------ #
    @classmethod
    def from_quantized(
        cls,
        weight: NVFP4Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        scheme: str = "w4a16",
        input_amax: Optional[torch.Tensor | float] = None,
        act_four_six: Optional[str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> "NVFP4Linear":
        """Build from a quantized weight ``[out, in]`` (and, for W4A4, the
        calibrated input amax)."""
        out_features, in_features = weight.shape
        if weight.padded_k != in_features:
            raise ValueError("NVFP4Linear cannot hold a padded weight; keep the layer in high precision")
        dtype = dtype or weight.dtype
        mod = cls(
            in_features, out_features, bias is not None, scheme=scheme, act_four_six=act_four_six,
            dtype=dtype, device=weight.packed.device,
        )
        mod.weight_packed.copy_(weight.packed)
        mod.weight_scale.copy_(weight.block_scale)
        mod.weight_global_scale.copy_(weight.global_enc.reshape(1))
        if scheme == "w4a4":
            if input_amax is None:
                raise ValueError("scheme 'w4a4' needs the calibrated input_amax")
            mod.input_global_scale.copy_(nvfp4.input_global_scale_from_amax(input_amax).reshape(1))
        if bias is not None:
            mod.bias.data = bias.detach().to(dtype).clone()
        return mod

    def quantized_weight(self) -> NVFP4Tensor:
        """A view of the packed weight as an ``NVFP4Tensor`` (no copy)."""
        return NVFP4Tensor(
            self.weight_packed,
            self.weight_scale,
            self.weight_global_scale.reshape(()),
            torch.Size((self.out_features, self.in_features)),
            self.dtype,
        )

    def dequantized_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return self.quantized_weight().dequantize(dtype or self.dtype)

    def input_amax(self) -> Optional[torch.Tensor]:
        if self.input_global_scale is None:
            return None
        return nvfp4.activation_amax_from_global(self.input_global_scale)

    # ------------------------------------------------------------------ #
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.quantized_weight()
        if self.scheme == "w4a4":
            return kernels.linear_w4a4(x, weight, self.input_amax(), self.bias, four_six=self.act_four_six)
        return kernels.linear_w4a16(x, weight, self.bias)

    def extra_repr(self) -> str:
        extra = f", act_four_six={self.act_four_six}" if self.act_four_six else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scheme={self.scheme}{extra}"
        )
