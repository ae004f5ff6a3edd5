"""Gradients through NVFP4 layers (``kernels._Linear``): the packed weight is frozen, x and the bias get
theirs. Before session 30 the Triton kernels (every CUDA call) and W4A4's activation quantizer (everywhere)
returned outputs outside autograd, so the gradient through the layer was dropped without a word (a residual
stream still carried one around it). The Triton path is checked under the interpreter in test_kernels.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fp4ptq import kernels, nvfp4
from fp4ptq.modules import NVFP4Linear


def _layer(n=48, k=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return nvfp4.quantize(torch.randn(n, k, generator=g) * 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_gradients_are_dy_times_the_decoded_weight(dtype):
    w = _layer()
    x = torch.randn(2, 3, 96).to(dtype).requires_grad_()
    bias = torch.randn(48).to(dtype).requires_grad_()
    y = kernels.linear_w4a16(x, w, bias)
    with torch.no_grad():
        assert torch.equal(y, kernels.linear_w4a16(x, w, bias))  # the same forward bits
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(x.grad, dy @ w.dequantize(dtype))
    assert torch.equal(bias.grad, dy.reshape(-1, 48).sum(0))


@pytest.mark.parametrize("four_six", [None, "mse"])
def test_w4a4_passes_the_gradient_straight_through_inside_the_quantizers_range(four_six):
    """Where |x| is past what the activation quantizer represents under its static amax (6 * 448 /
    global_enc: the amax itself, 1.75 x with Four Over Six's global scale) the gradient stops."""
    w = _layer()
    amax = torch.tensor(1.5)
    x = (torch.randn(4, 96) * 1.5).requires_grad_()
    y = kernels.linear_w4a4(x, w, amax, four_six=four_six)
    with torch.no_grad():
        assert torch.equal(y, kernels.linear_w4a4(x, w, amax, four_six=four_six))
    dy = torch.randn_like(y)
    y.backward(dy)
    limit = 1.5 * (1.75 if four_six else 1.0)
    inside = x.detach().abs() <= limit
    assert 0 < int((~inside).sum()) < x.numel()  # both sides of the range are exercised
    assert torch.equal(x.grad, (dy @ w.dequantize(torch.float32)) * inside)
    assert torch.equal(x.grad[~inside], torch.zeros(int((~inside).sum())))


def test_w4a4_takes_a_python_float_amax_with_a_gradient_too():
    w = _layer()
    x = torch.randn(4, 96).requires_grad_()
    y = kernels.linear_w4a4(x, w, 2.0)
    y.sum().backward()
    with torch.no_grad():
        assert torch.equal(y, kernels.linear_w4a4(x, w, torch.tensor(2.0)))
    assert x.grad is not None


def test_no_graph_where_no_gradient_is_asked_for():
    w = _layer()
    x = torch.randn(4, 96)
    assert kernels.linear_w4a16(x, w).grad_fn is None
    x.requires_grad_()
    with torch.no_grad():
        assert kernels.linear_w4a16(x, w).grad_fn is None
        assert kernels.linear_w4a4(x, w, torch.tensor(2.0)).grad_fn is None


@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
def test_an_adapter_before_a_quantized_layer_learns(scheme):
    """LoRA-style: a trainable layer in front of a frozen NVFP4Linear gets the gradient that flows
    through it (here the only path, so a dropped one would leave it without any), and it is
    ``dy @ dequant(W)`` pushed through the adapter."""
    torch.manual_seed(0)
    w = _layer()
    q = NVFP4Linear.from_quantized(w, torch.randn(48), scheme=scheme, input_amax=8.0 if scheme == "w4a4" else None,
                                   dtype=torch.float32)
    adapter = nn.Linear(96, 96)
    x = torch.randn(5, 96)
    h = adapter(x)
    h.retain_grad()
    y = q(h)
    y.square().sum().backward()
    assert adapter.weight.grad is not None and adapter.weight.grad.abs().sum() > 0
    torch.testing.assert_close(h.grad, (2 * y.detach()) @ w.dequantize(torch.float32), rtol=0, atol=1e-5)
    assert all(p.grad is None for p in q.parameters())  # the quantized layer itself stays frozen


@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
def test_autocast_gives_the_layer_16_bit_inputs_as_it_does_linear(scheme):
    """Under autocast (mixed-precision training or inference with an fp32 model) an fp32 input is cast
    to the autocast dtype, as ``F.linear`` does there: on CUDA that is what the kernels take (an fp32
    input would fall back to the reference decode). The output is the module's on the cast input, and
    the gradient reaches the fp32 input."""
    w = _layer()
    q = NVFP4Linear.from_quantized(w, torch.randn(48), scheme=scheme, input_amax=4.0 if scheme == "w4a4" else None,
                                   dtype=torch.float32)
    x = torch.randn(3, 96).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = q(x)
    assert y.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(y, q(x.detach().bfloat16()))
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32 and x.grad.abs().sum() > 0
