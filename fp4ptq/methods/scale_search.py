"""Global-scale searches: what tensor max the fp32 global scale is derived from.

NVFP4's global scale only decides where the E4M3 block scales land on their
grid (and, below the true max, which values saturate), so a tensor can round
better with a global scale from ``c * amax`` than from ``amax`` itself.
ModelOpt and llm-compressor (its "expanded MSE" observer, 0.8-1.8x) search it;
here each search states its objective in one line:

* ``search_weight_amax``: ``argmin_c ||W - fq(W; c * amax)||^2`` over the whole
  tensor (a fused group: over its rows together, one scale shared), with the
  Four Over Six choice inside ``fq``;
* ``search_input_amax``: W4A4's static input scale,
  ``argmin_c sum_l ||x W_l^T - fq(x; c * amax) Wq_l^T||^2`` on calibration
  inputs ``x`` with the already-rounded weights ``Wq_l`` of the linears that read ``x``.

``c = 1`` is always a candidate, so a search never does worse than the plain
amax on its own objective.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import nvfp4

# Multipliers of the tensor max tried for weights (1.0 first: ties keep the plain amax).
WEIGHT_SCALE_SWEEP = (1.0, 0.8, 0.85, 0.9, 0.95, 1.05, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.8)
# ... and for W4A4's static input scale (below 1 clips the rare largest activations).
INPUT_SCALE_SWEEP = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)


@torch.no_grad()
def search_weight_amax(
    weights: Sequence[torch.Tensor],
    amax: torch.Tensor,
    *,
    four_six: Optional[str] = None,
    sweep: Sequence[float] = WEIGHT_SCALE_SWEEP,
) -> tuple:
    """``(best amax, best multiplier, {multiplier: squared error})`` for one global scale shared by
    ``weights`` (each ``[out_i, in]``), starting from their max ``amax``."""
    amax = torch.as_tensor(amax, dtype=torch.float32).reshape(())
    errors = {}
    for c in sweep:
        a = amax * c
        errors[c] = sum(float((nvfp4.fake_quantize(w.float(), four_six, amax=a) - w.float()).pow(2).sum())
                        for w in weights)
    best = min(errors, key=lambda c: (errors[c], c != 1.0))
    return amax * best, best, errors


@torch.no_grad()
def search_input_amax(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    quantized: Sequence[torch.Tensor],
    amax: torch.Tensor,
    *,
    four_six: Optional[str] = None,
    sweep: Sequence[float] = INPUT_SCALE_SWEEP,
) -> tuple:
    """``(best amax, best multiplier, {multiplier: output squared error})`` of the static input scale
    for calibration inputs ``x [tokens, in]`` read by linears with float weights ``weights`` and
    dequantized weights ``quantized`` (each ``[out_i, in]``)."""
    amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(())
    xf = x.float()
    references = [xf @ w.float().T for w in weights]
    errors = {}
    for c in sweep:
        x_hat = nvfp4.fake_quantize(xf, four_six, amax=amax * c)
        errors[c] = sum(float((x_hat @ q.float().T - r).pow(2).sum()) for q, r in zip(quantized, references))
    best = min(errors, key=lambda c: (errors[c], c != 1.0))
    return amax * best, best, errors


__all__ = ["INPUT_SCALE_SWEEP", "WEIGHT_SCALE_SWEEP", "search_input_amax", "search_weight_amax"]
