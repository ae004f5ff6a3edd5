"""fp4ptq: post-training quantization of LLMs to NVFP4 (with Four Over Six).

Public API::

    import fp4ptq
    model = fp4ptq.quantize(model, fp4ptq.QuantConfig(method="gptq", four_six="mse"), calib)
    fp4ptq.save(model, "out/dir", tokenizer=tokenizer)
    model = fp4ptq.load("out/dir")
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

from . import nvfp4  # noqa: F401
from .modules import NVFP4Linear  # noqa: F401
from .nvfp4 import NVFP4Error, NVFP4Tensor  # noqa: F401

# Public names served lazily from their modules (keeps `import fp4ptq` light).
_LAZY = {
    "QuantConfig": "config",
    "quantize": "pipeline",
    "save": "checkpoint",
    "load": "checkpoint",
    "load_source_model": "sources",
    "fuse_projections": "fusion",
    "unfuse_projections": "fusion",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'fp4ptq' has no attribute {name!r}")


__all__ = ["NVFP4Error", "NVFP4Linear", "NVFP4Tensor", "__version__", "nvfp4", *_LAZY]

# After `import fp4ptq`, `AutoModelForCausalLM.from_pretrained(dir)` builds NVFP4Linear layers from
# NVFP4 checkpoints (fp4ptq/hf.py says how it coexists with transformers' compressed-tensors
# quantizer). FP4PTQ_TRANSFORMERS_HOOK=0 leaves transformers untouched.
import os as _os

if _os.environ.get("FP4PTQ_TRANSFORMERS_HOOK", "1") != "0":
    from . import _hook

    _hook.install()  # registers once transformers' quantizer table is imported (fp4ptq/_hook.py)
