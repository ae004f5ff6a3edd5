"""The weight global-scale search: what tensor max the fp32 global scale is derived from.

NVFP4's global scale only decides where the E4M3 block scales land on their
grid (and, below the true max, which values saturate), so a tensor can round
better with a global scale from ``c * amax`` than from ``amax`` itself.
ModelOpt and llm-compressor (its "expanded MSE" observer, 0.8-1.8x) search it;
here ``search_weight_amax`` minimizes ``||W - fq(W; c * amax)||^2`` over the whole
tensor (a fused group: over its rows together, one scale shared), with the Four
Over Six choice inside ``fq``. ``c = 1`` is always a candidate, so the search never
does worse than the plain amax on its own objective.

W4A4's static input scale had a search of its own (by the layers' output error on
calibration inputs, 0.2-1x of the amax); it never helped where measured (SmolLM2
RTN W4A4 35.69 against 35.68, Qwen2.5-Coder-0.5B KL 0.166 against 0.157) and was
removed under issue 43's rule (an option stays only where it helps); its code is in
git history (``benchmarks/NOTES.md`` names the commit).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import nvfp4

# Multipliers of the tensor max tried for weights (1.0 first: ties keep the plain amax).
WEIGHT_SCALE_SWEEP = (1.0, 0.8, 0.85, 0.9, 0.95, 1.05, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.8)


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


__all__ = ["WEIGHT_SCALE_SWEEP", "search_weight_amax"]
