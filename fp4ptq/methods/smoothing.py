"""Per-channel smoothing scales: folding them into the model (the one shared
function AWQ and SmoothQuant use), simulating the quantized result for their
searches, and the search loop itself.

For an input channel j feeding linears ``W`` and produced by ``prev``:

    y = W x = (W diag(s)) (diag(s)^-1 x)

so dividing ``prev``'s output channel j by ``s_j`` and multiplying column j of
every consuming linear by ``s_j`` leaves the float output unchanged, while
moving magnitude between activations and weights before rounding.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

from .. import nvfp4


class SmoothingError(ValueError):
    """Scales cannot be folded into the given modules."""


def can_fold(prev: nn.Module, linears: Sequence[nn.Module]) -> bool:
    """Whether ``prev``'s output channels map one to one onto the readers' inputs
    (false e.g. for v_proj -> o_proj under grouped-query attention). Readers are
    linears or other modules with a ``weight [out, in]`` (an MoE router)."""
    channels = {lin.weight.shape[1] for lin in linears}
    if len(channels) != 1:
        return False
    (n,) = channels
    if isinstance(prev, nn.Linear):
        return prev.out_features == n
    weight = getattr(prev, "weight", None)  # RMSNorm / LayerNorm: weight [n] (bias [n])
    return isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.numel() == n


@torch.no_grad()
def fold_scales(prev: nn.Module, linears: Sequence[nn.Module], scales: torch.Tensor, *, kind: str = "auto") -> None:
    """Fold ``scales: [in]`` in place: ``prev``'s output channels divided by
    ``scales``, each reader's input columns multiplied by them (math in fp32).

    kind: "linear" (prev's rows), "norm" (a norm computing ``w * x_hat``: ``w / s``),
    "norm_offset" (a norm computing ``(1 + w) * x_hat``, as Gemma's: ``(1 + w) / s - 1``),
    or "auto" ("linear" for an nn.Linear, else "norm")."""
    if not can_fold(prev, linears):
        raise SmoothingError(
            f"cannot fold scales of {scales.numel()} channels from {type(prev).__name__} into "
            f"{[tuple(lin.weight.shape) for lin in linears]}: output/input channels differ"
        )
    nvfp4.check_finite(scales, "smoothing scales")
    if not bool((scales > 0).all()):
        raise SmoothingError("smoothing scales must be positive")
    if kind == "auto":
        kind = "linear" if isinstance(prev, nn.Linear) else "norm"
    s = scales.detach().float()
    w = prev.weight
    if kind == "linear":
        # prev.weight: [n, k]: output rows scaled.
        w.copy_((w.float() / s.to(w.device)[:, None]).to(w.dtype))
    elif kind == "norm":
        w.copy_((w.float() / s.to(w.device)).to(w.dtype))
    elif kind == "norm_offset":
        w.copy_(((1.0 + w.float()) / s.to(w.device) - 1.0).to(w.dtype))
    else:
        raise SmoothingError(f"unknown fold kind {kind!r}")
    bias = getattr(prev, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias.copy_((bias.float() / s.to(bias.device)).to(bias.dtype))
    for lin in linears:
        # lin.weight: [out, n]: input columns scaled.
        lin.weight.copy_((lin.weight.float() * s.to(lin.weight.device)[None, :]).to(lin.weight.dtype))


def group_weight_amax(linears: Sequence[nn.Linear], scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """max |W diag(scales)| over all the linears (the shared global-scale source)."""
    amax = torch.zeros((), dtype=torch.float32, device=linears[0].weight.device)
    for lin in linears:
        w = lin.weight.detach().float()
        if scales is not None:
            w = w * scales.float()[None, :]
        amax = torch.maximum(amax, w.abs().amax())
    return amax


@contextlib.contextmanager
def simulated_quantized(
    linears: Sequence[nn.Linear],
    scales: torch.Tensor,
    *,
    four_six: Optional[str],
    act_amax: Optional[torch.Tensor] = None,
    weight_fn: Optional[Callable[[nn.Linear, torch.Tensor], torch.Tensor]] = None,
) -> Iterator[None]:
    """Within the block, each linear computes what it would after folding
    ``scales`` and quantizing: ``fq(x / s) @ fq(W diag(s))^T + b`` (activations
    fake-quantized only when ``act_amax``, the amax of ``x / s``, is given).

    The weights go through the real NVFP4 packer (``nvfp4.fake_quantize``,
    Four Over Six included) with the group's shared global scale; ``weight_fn``
    may replace that step (e.g. a clipping search). Restored on exit.

    The linears share their input, so its (costly) fake-quantization is done
    once per input tensor and reused by the next linear called on it."""
    s = scales.detach().float()
    amax = group_weight_amax(linears, s)
    shared_input = _LastInput(s, four_six, act_amax)
    patched = []
    try:
        for lin in linears:
            w_scaled = lin.weight.detach().float() * s[None, :]
            w_q = weight_fn(lin, w_scaled) if weight_fn else nvfp4.fake_quantize(w_scaled, four_six, amax=amax)
            w_q = w_q.to(lin.weight.dtype)
            lin.forward = _simulated_forward(lin, w_q, shared_input)
            patched.append(lin)
        yield
    finally:
        for lin in patched:
            del lin.forward  # back to the class's forward


class _LastInput:
    """``fq(x / s)`` (or ``x / s`` without activation quantization) of the last
    input seen, recomputed only when a different tensor comes in."""

    def __init__(self, s: torch.Tensor, four_six, act_amax) -> None:
        self.s, self.four_six, self.act_amax = s, four_six, act_amax
        self.x, self.version, self.value = None, None, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # The same tensor object, not modified in place since (holding it keeps it alive).
        if x is not self.x or x._version != self.version:
            x_s = (x.float() / self.s).to(x.dtype)
            if self.act_amax is not None:
                x_s = nvfp4.fake_quantize(x_s, self.four_six, amax=self.act_amax, name="activation")
            self.x, self.version, self.value = x, x._version, x_s
        return self.value


def _simulated_forward(lin: nn.Linear, w_q: torch.Tensor, shared_input: _LastInput):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(shared_input(x), w_q, lin.bias)

    return forward


def search_scales(
    candidates: Iterable[tuple],
    loss_fn: Callable[[torch.Tensor], float],
) -> tuple:
    """Evaluate ``loss_fn(scales)`` for each ``(key, scales)`` candidate and
    return ``(best_key, best_scales, {key: loss})``; the first of equal losses wins."""
    best_key, best_scales, best_loss, losses = None, None, float("inf"), {}
    for key, scales in candidates:
        loss = float(loss_fn(scales))
        losses[key] = loss
        if loss < best_loss:
            best_key, best_scales, best_loss = key, scales, loss
    if best_scales is None:
        raise SmoothingError(f"scale search found no finite loss (losses: {losses})")
    return best_key, best_scales, losses


__all__ = [
    "SmoothingError", "can_fold", "fold_scales", "group_weight_amax", "search_scales", "simulated_quantized",
]
