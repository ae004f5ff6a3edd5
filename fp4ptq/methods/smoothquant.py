"""SmoothQuant (Xiao et al., 2023, "SmoothQuant: Accurate and Efficient
Post-Training Quantization for LLMs", Sec. 4, Eq. 4) scales.

Per input channel ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``: migrates
activation outliers into the weights (meant for W4A4). ``alpha`` is given or
searched on the block-output loss; scales are folded by ``smoothing.fold_scales``.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch
from torch import nn


def weight_channel_absmax(linears: Sequence[nn.Linear]) -> torch.Tensor:
    """max |W[:, j]| over the rows of all ``linears`` (which share an input): [in] fp32."""
    return torch.stack([lin.weight.detach().float().abs().amax(0) for lin in linears]).amax(0)


def smoothquant_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = max|X|^alpha / max|W|^(1-alpha)`` per channel ([in] fp32), guarded
    against zero channels (which get ``s = 1``)."""
    a = act_absmax.float()
    w = weight_absmax.float().to(a.device)
    s = a.clamp(min=1e-5).pow(alpha) / w.clamp(min=1e-5).pow(1.0 - alpha)
    return torch.where((a > 0) & (w > 0), s, torch.ones_like(s))


def smoothquant_candidates(
    act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alphas: Iterable[float]
) -> Iterator[tuple]:
    """``(alpha, scales)`` for each alpha."""
    for alpha in alphas:
        yield float(alpha), smoothquant_scales(act_absmax, weight_absmax, float(alpha))


__all__ = ["smoothquant_candidates", "smoothquant_scales", "weight_channel_absmax"]
