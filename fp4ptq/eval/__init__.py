"""Evaluation: perplexity (perplexity.py), lm-eval tasks with offline data (tasks.py),
JSON / markdown / PNG reports (report.py).

Entry point for perplexity: ``from fp4ptq.eval.perplexity import perplexity``.
"""
from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from ..modules import NVFP4Linear


@contextmanager
def decoded_weight_cache(model: nn.Module):
    """Within the context, every ``NVFP4Linear`` of ``model`` keeps its decoded
    weight (``decode_cache=True``, even where ``FP4PTQ_DECODE_CACHE=0``); on exit
    each layer's own setting comes back, and copies it would not keep are dropped.

    ``NVFP4Linear`` caches on its own by default (see its ``decode_cache``); this
    context only forces it on, for callers that want to say so. The cached decode
    is the tensor the reference path would compute, so outputs are bit-identical.
    On CUDA nothing is decoded or cached (the Triton kernels read packed weights).
    """
    layers = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    before = [m.decode_cache for m in layers]
    for module in layers:
        module.decode_cache = True
    try:
        yield model
    finally:
        for module, setting in zip(layers, before):
            module.decode_cache = setting
            if not module._caches_decode():
                module.clear_decode_cache()


__all__ = ["decoded_weight_cache"]
