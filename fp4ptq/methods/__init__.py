"""Quantization methods as plain functions over tensors.

Rounding (return an ``NVFP4Tensor``): ``rtn``, ``gptq``.
Transforms (return per-channel scales, folded by ``smoothing.fold_scales``):
``awq`` (with an optional clipping search) and ``smoothquant``.
"""
from .awq import awq_candidates, awq_clip, awq_scales
from .gptq import gptq, hessian_update
from .rtn import rtn
from .smoothing import fold_scales, search_scales, simulated_quantized
from .smoothquant import smoothquant_candidates, smoothquant_scales

__all__ = [
    "awq_candidates", "awq_clip", "awq_scales", "fold_scales", "gptq", "hessian_update", "rtn",
    "search_scales", "simulated_quantized", "smoothquant_candidates", "smoothquant_scales",
]
