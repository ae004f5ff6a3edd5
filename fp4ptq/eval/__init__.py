"""Evaluation: perplexity (perplexity.py), lm-eval tasks with offline data (tasks.py),
JSON / markdown / PNG reports (report.py).

Entry point for perplexity: ``from fp4ptq.eval.perplexity import perplexity``.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import fields

import torch
from torch import nn

from ..modules import NVFP4Linear
from ..nvfp4 import NVFP4Tensor


class _DecodedOnce(NVFP4Tensor):
    """An NVFP4Tensor that decodes once per dtype and then returns the same tensor."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        cache = self.__dict__.setdefault("_decoded", {})
        if dtype not in cache:
            cache[dtype] = super().dequantize(dtype)
        return cache[dtype]


@contextmanager
def decoded_weight_cache(model: nn.Module):
    """Within the context, every ``NVFP4Linear`` of ``model`` decodes its packed
    weight once instead of on every forward.

    The reference (non-Triton) path computes ``linear(x, weight.dequantize(...))``
    on each call; on a CPU the decode costs more than the matmul itself (about
    0.2 s for a 1536x576 weight on a loaded 2-core machine, ~20 s per forward of
    SmolLM2-135M). The cached decode is the same tensor the reference would
    compute, so outputs are bit-identical; the price is one float copy of every
    quantized weight while the context is open. The Triton kernels never call
    ``dequantize``, so on a GPU this changes nothing.
    """
    patched = []
    for module in model.modules():
        if isinstance(module, NVFP4Linear):
            view = module.quantized_weight()
            cached = _DecodedOnce(**{f.name: getattr(view, f.name) for f in fields(view)})
            module.quantized_weight = lambda cached=cached: cached   # instance attribute shadows the method
            patched.append(module)
    try:
        yield model
    finally:
        for module in patched:
            del module.quantized_weight


__all__ = ["decoded_weight_cache"]
