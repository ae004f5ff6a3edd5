"""Round to nearest: the NVFP4 packer applied directly to a weight."""
from __future__ import annotations

from typing import Optional

import torch

from .. import nvfp4
from ..nvfp4 import NVFP4Tensor


def rtn(
    W: torch.Tensor,
    *,
    four_six: Optional[str] = None,
    amax: Optional[torch.Tensor | float] = None,
    name: str = "weight",
) -> NVFP4Tensor:
    """Quantize ``W: [out, in]`` to NVFP4 by round-to-nearest.

    ``amax`` sets the global scale (give the max over a fused group so q/k/v or
    gate/up share one); ``four_six`` picks 4 or 6 per block with that rule.
    """
    return nvfp4.quantize(W, four_six, amax=amax, name=name)


__all__ = ["rtn"]
