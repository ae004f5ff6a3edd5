"""NVFP4Linear under ``torch.compile``: the layer is one opaque custom op
(``torch.ops.fp4ptq.nvfp4_linear``), so a compiled model has no graph break at
its NVFP4 layers (``fullgraph=True`` compiles) and gives the eager outputs bit
for bit; a quantized decoder breaks its graph exactly where the bf16 one does."""
import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

import fp4ptq
from fp4ptq import nvfp4
from fp4ptq.config import QuantConfig
from fp4ptq.modules import NVFP4Linear, nvfp4_linear
from static_decoding import eager_and_compiled_steps


def layer(in_features, out_features, scheme, four_six, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    b = torch.randn(out_features, generator=g) if bias else None
    return NVFP4Linear.from_quantized(nvfp4.quantize(w), b, scheme=scheme, act_four_six=four_six,
                                      input_amax=torch.tensor(3.0) if scheme == "w4a4" else None,
                                      dtype=torch.float32)


@pytest.mark.parametrize("scheme, four_six", [("w4a16", None), ("w4a4", None), ("w4a4", "mse")])
def test_a_compiled_stack_of_nvfp4_layers_is_one_graph_with_the_eager_outputs(scheme, four_six):
    torch._dynamo.reset()
    model = nn.Sequential(layer(64, 48, scheme, four_six, True, 1), nn.GELU(), layer(48, 16, scheme, four_six, False, 2))
    x = torch.randn(3, 5, 64)
    eager = model(x)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), eager)
    x2 = torch.randn(7, 64)  # another shape: the op's fake output follows it
    assert torch.equal(compiled(x2), model(x2))


def test_the_op_is_the_layer_forward():
    mod = layer(32, 24, "w4a4", "mae", True, 3)
    x = torch.randn(4, 32)
    y = nvfp4_linear(x, mod.weight_packed, mod.weight_scale, mod.weight_global_scale, mod.bias,
                     mod.input_global_scale, mod.act_four_six)
    assert torch.equal(y, mod(x))
    # (opcheck's schema test multiplies the fp8 scales in a mode CPU torch has no kernel for)
    fake = torch.library.opcheck(torch.ops.fp4ptq.nvfp4_linear.default,
                                 (x, mod.weight_packed, mod.weight_scale, mod.weight_global_scale, mod.bias,
                                  mod.input_global_scale, mod.act_four_six),
                                 test_utils=("test_faketensor", "test_autograd_registration"))
    assert all(v == "SUCCESS" for v in fake.values())


def test_a_quantized_decoder_breaks_its_graph_only_where_the_float_one_does():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    base = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    quantized = fp4ptq.quantize(copy.deepcopy(base), QuantConfig(method="rtn"), progress=False)
    assert sum(isinstance(m, NVFP4Linear) for m in quantized.modules()) == 14
    torch._dynamo.reset()
    with torch.no_grad():
        breaks_float = torch._dynamo.explain(base)(ids, use_cache=False).graph_break_count
        torch._dynamo.reset()
        breaks_nvfp4 = torch._dynamo.explain(quantized)(ids, use_cache=False).graph_break_count
        assert breaks_nvfp4 == breaks_float
        eager = quantized(ids, use_cache=False).logits
        torch._dynamo.reset()
        compiled = torch.compile(quantized, backend="aot_eager")(ids, use_cache=False).logits
    # the compiled graph may order the float ops around the layers differently: same values to rounding
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_compiled_decode_steps_with_a_static_cache_follow_the_eager_ones():
    """Decoding as transformers' compiled generate does it (a static cache written in place, one token
    a step): the compiled steps of a quantized decoder give the eager steps' logits."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = fp4ptq.quantize(AutoModelForCausalLM.from_config(config).eval(),
                            QuantConfig(method="rtn", scheme="w4a4", four_six="mse"),
                            torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2)),
                            progress=False)
    eager, compiled = eager_and_compiled_steps(model, 128)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_a_compiled_layer_still_passes_gradients_to_its_input():
    """The custom op has no backward: where the graph needs the input's gradient the layer is traced
    as in eager mode, so a compiled model gives the eager gradient (the reference path's)."""
    mod = layer(32, 24, "w4a16", None, True, 4)
    x = torch.randn(4, 32, requires_grad=True)
    mod(x).square().sum().backward()
    want = x.grad.clone()
    x.grad = None
    torch._dynamo.reset()
    torch.compile(mod, backend="aot_eager")(x).square().sum().backward()
    torch.testing.assert_close(x.grad, want)


def test_a_compiled_layer_under_autocast_gives_the_eager_bits_and_gradient():
    """An fp32 layer under autocast (mixed-precision training of an adapter on a quantized base, compiled):
    the input is taken in the autocast dtype as in eager mode (``NVFP4Linear.forward``), with and without a
    gradient."""
    mod = layer(32, 24, "w4a16", None, True, 5)
    x = torch.randn(4, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = mod(x)
    want.float().sum().backward()
    want_grad, x.grad = x.grad.clone(), None
    torch._dynamo.reset()
    compiled = torch.compile(mod, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = compiled(x)
    got.float().sum().backward()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want) and torch.equal(x.grad, want_grad)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(compiled(x), want.detach())
