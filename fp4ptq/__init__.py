"""fp4ptq: post-training quantization of LLMs to NVFP4 (with Four Over Six)."""
from __future__ import annotations

__version__ = "0.1.0"

from . import nvfp4  # noqa: F401
from .modules import NVFP4Linear  # noqa: F401
from .nvfp4 import NVFP4Error, NVFP4Tensor  # noqa: F401
