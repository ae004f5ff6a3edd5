"""AWQ (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization", Sec. 3.2-3.3)
on the NVFP4 format.

Per input channel ``s = mean|x|^ratio`` (normalized so that
``max(s) * min(s) = 1``), with ``ratio`` picked from a grid in [0, 1) by the
error of the block output when the scaled weights go through the real NVFP4
packer (Four Over Six included). ``ratio = 0`` (no scaling) is on the grid, so
the chosen scales never do worse than no scaling on that objective. The scales
are folded by ``smoothing.fold_scales``.

Optional clipping search (AWQ Sec. 3.3 "clip"): per NVFP4 block (row x 16
columns) shrink the clipping range ``r * max|w|`` to minimize that block's
contribution to the layer output error on calibration inputs.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from .. import nvfp4
from ..nvfp4 import BLOCK_SIZE


def awq_scales(act_mean_abs: torch.Tensor, ratio: float) -> torch.Tensor:
    """``s = mean|x|^ratio`` per input channel, normalized by ``sqrt(max(s) * min(s))``.
    act_mean_abs: [in] fp32 mean |x| over calibration tokens."""
    s = act_mean_abs.float().clamp(min=1e-4).pow(ratio)
    return s / (s.max() * s.min()).sqrt()


def awq_candidates(act_mean_abs: torch.Tensor, n_grid: int) -> Iterator[tuple]:
    """``(ratio, scales)`` for ``ratio = k / n_grid``, k = 0 .. n_grid-1."""
    for k in range(n_grid):
        ratio = k / n_grid
        yield ratio, awq_scales(act_mean_abs, ratio)


@torch.no_grad()
def awq_clip(
    W: torch.Tensor,
    x: torch.Tensor,
    *,
    four_six: Optional[str] = None,
    amax: Optional[torch.Tensor | float] = None,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    max_elements: int = 1 << 25,
) -> torch.Tensor:
    """Clip each NVFP4 block of ``W: [out, in]`` to ``+-r * max|w_block|``,
    ``r`` from ``1, 1 - 1/n_grid, ...`` down to ``1 - max_shrink``, minimizing
    ``mean_t ((Q(W_c) - W)_block . x_t,block)^2`` over tokens ``x: [tokens, in]``.

    The global scale stays that of the unclipped weight (``amax``), so the
    clipped weight rounds onto the same grid as the stored tensor. Returns the
    clipped weight (fp32); ``r = 1`` (no clipping) is always a candidate.
    """
    out_features, in_features = W.shape
    n_groups = in_features // BLOCK_SIZE
    Wf = W.detach().float()
    amax = nvfp4.tensor_amax(Wf) if amax is None else torch.as_tensor(amax, dtype=torch.float32)
    xg = x.detach().float().reshape(-1, n_groups, BLOCK_SIZE)           # [T, g, 16]
    rows = max(1, max_elements // max(1, n_groups * xg.shape[0]))       # rows per chunk
    ratios = [1.0 - k / n_grid for k in range(int(max_shrink * n_grid) + 1)]
    clipped = torch.empty_like(Wf)
    for r0 in range(0, out_features, rows):
        w = Wf[r0 : r0 + rows].view(-1, n_groups, BLOCK_SIZE)          # [o, g, 16]
        bmax = w.abs().amax(-1, keepdim=True)                           # [o, g, 1]
        best_err = torch.full(w.shape[:2], float("inf"), device=w.device)
        best = w.clone()
        for r in ratios:
            w_c = torch.maximum(torch.minimum(w, r * bmax), -r * bmax)
            q = nvfp4.fake_quantize(w_c.reshape(w.shape[0], -1), four_six, amax=amax).view_as(w)
            # err[o, g] = mean over tokens of (sum_k (q - w)[o, g, k] x[t, g, k])^2
            err = torch.einsum("ogk,tgk->ogt", q - w, xg).pow(2).mean(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better[..., None], w_c, best)
        clipped[r0 : r0 + rows] = best.reshape(-1, in_features)
    return clipped


__all__ = ["awq_candidates", "awq_clip", "awq_scales"]
