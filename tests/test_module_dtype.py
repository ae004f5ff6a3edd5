"""Dtype conversions of a model (``model.half()``, ``model.to(torch.bfloat16)``, ``.double()``) and
NVFP4Linear: the packed codes, E4M3 block scales and fp32 global scales are the checkpoint's format and keep
their dtypes and bits; the bias and the layer's nominal dtype follow the conversion. Before session 30 a
conversion turned the scales into 16-bit floats (rounding the global scales) and changed every output."""
from __future__ import annotations

import pytest
import torch

from fp4ptq import nvfp4
from fp4ptq.modules import NVFP4Linear


def _module(scheme):
    g = torch.Generator().manual_seed(3)
    w = nvfp4.quantize(torch.randn(48, 96, generator=g) * 0.1)
    # a global scale that 16 bits cannot hold
    return NVFP4Linear.from_quantized(w, torch.randn(48, generator=g), scheme=scheme,
                                      input_amax=3.1234567 if scheme == "w4a4" else None, dtype=torch.float32)


@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
@pytest.mark.parametrize("convert,dtype", [(lambda m: m.half(), torch.float16),
                                           (lambda m: m.to(torch.bfloat16), torch.bfloat16),
                                           (lambda m: m.double(), torch.float64)])
def test_a_dtype_conversion_keeps_the_format_buffers(scheme, convert, dtype):
    q = _module(scheme)
    before = {name: buf.clone() for name, buf in q.named_buffers()}
    x = torch.randn(3, 96).to(dtype if dtype != torch.float64 else torch.float32)
    want = q(x)
    assert convert(q) is q
    for name, buf in q.named_buffers():
        assert buf.dtype == before[name].dtype, name
        assert torch.equal(buf.view(torch.uint8), before[name].view(torch.uint8)), name
    assert q.bias.dtype == dtype and q.dtype == dtype
    if dtype != torch.float64:  # the same layer: the same outputs (the bias is exact in the input's dtype here)
        assert torch.equal(q(x), want)
    state = q.state_dict()  # what a save writes: the format's dtypes
    assert state["weight_scale"].dtype == torch.float8_e4m3fn and state["weight_global_scale"].dtype == torch.float32


def test_device_moves_and_sharing_still_reach_the_format_buffers():
    q = _module("w4a4")
    scale = q.weight_scale
    q.share_memory()
    assert q.weight_scale.is_shared() and q.weight_global_scale.is_shared() and q.input_global_scale.is_shared()
    q.to("cpu")  # no move: the very same tensors (launch plans and fused groups key on them)
    assert q.weight_scale is scale
    q.to_empty(device="meta")
    assert q.weight_scale.device.type == "meta" and q.weight_scale.dtype == torch.float8_e4m3fn


def test_from_quantized_puts_the_bias_on_the_weights_device():
    """A bias given on the CPU for a weight elsewhere (the meta device stands in for a GPU) goes with the
    weight; before, assigning it raised a bare "incompatible tensor type"."""
    w = nvfp4.quantize(torch.randn(32, 64))
    on_meta = nvfp4.NVFP4Tensor(w.packed.to("meta"), w.block_scale.to("meta"), w.global_enc.to("meta"), w.shape,
                                w.dtype)
    q = NVFP4Linear.from_quantized(on_meta, torch.randn(32))
    assert q.bias.device.type == "meta" and q.weight_packed.device.type == "meta"
