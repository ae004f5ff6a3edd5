"""AWQ / SmoothQuant transforms: folded scales leave the float model's output
unchanged; the searches optimize the real NVFP4 objective; clipping never
increases the per-block output error."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from fp4ptq import nvfp4
from fp4ptq.config import QuantConfig
from fp4ptq.methods import awq, smoothing, smoothquant
from fp4ptq.models import arch_spec
from fp4ptq.pipeline import capture_block_inputs, collect_input_stats, run_block, smooth_group


def tiny_llama(kv_heads=2):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=kv_heads, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # give the norms non-trivial weights and one outlier channel
        for block in model.model.layers:
            block.input_layernorm.weight.uniform_(0.5, 1.5)
            block.input_layernorm.weight[5] = 8.0
    return model


CALIB = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("transform", ["awq", "smoothquant"])
@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
def test_folded_scales_leave_the_float_output_unchanged(transform, scheme):
    model = tiny_llama()
    with torch.no_grad():
        reference = model(CALIB).logits
    config = QuantConfig(method=transform, scheme=scheme, four_six="mse", search_nsamples=2, awq_grid=5)
    spec = arch_spec(model)
    inputs = capture_block_inputs(model, model.model.layers, CALIB)
    chosen = []
    for index, block in enumerate(model.model.layers):
        call = inputs.calls[index]
        with collect_input_stats(block, spec.groups, f"b{index}", hessian=False, keep_samples=2) as stats:
            run_block(block, inputs.hidden, call, replace=False)
        for group, st in zip(spec.groups, stats):
            chosen.append(smooth_group(block, group, st, config, call))
        run_block(block, inputs.hidden, call, replace=True)
    # Something was actually folded (not all identity), and the model is unchanged in float.
    key = "awq_ratio" if transform == "awq" else "smoothquant_alpha"
    assert any(c.get(key) not in (None, 0.0) for c in chosen)
    assert all(c["loss"] <= c["loss_unsmoothed"] for c in chosen if c.get("loss_unsmoothed") is not None)
    with torch.no_grad():
        smoothed = model(CALIB).logits
    assert torch.allclose(smoothed, reference, rtol=1e-4, atol=1e-5)


def test_fold_scales_exact_on_norm_and_linear_prev():
    model = tiny_llama()
    block = model.model.layers[0]
    x = torch.randn(3, 32)
    s = torch.rand(32) + 0.5
    with torch.no_grad():
        h = block.input_layernorm(x)
        ref = block.self_attn.q_proj(h)
        smoothing.fold_scales(block.input_layernorm, [block.self_attn.q_proj, block.self_attn.k_proj], s)
        assert torch.allclose(block.input_layernorm(x), h / s, rtol=1e-6)
        assert torch.allclose(block.self_attn.q_proj(block.input_layernorm(x)), ref, rtol=1e-5, atol=1e-6)
        s2 = torch.rand(64) + 0.5
        u = torch.randn(3, 32)
        ref = block.mlp(u)
        smoothing.fold_scales(block.mlp.up_proj, [block.mlp.down_proj], s2)
        assert torch.allclose(block.mlp(u), ref, rtol=1e-5, atol=1e-6)


def test_cannot_fold_v_into_o_under_grouped_query_attention():
    attn = tiny_llama(kv_heads=1).model.layers[0].self_attn
    assert not smoothing.can_fold(attn.v_proj, [attn.o_proj])
    with pytest.raises(smoothing.SmoothingError, match="channels differ"):
        smoothing.fold_scales(attn.v_proj, [attn.o_proj], torch.ones(32))


def test_awq_scales_formula():
    mean_abs = torch.tensor([0.1, 1.0, 4.0, 10.0])
    assert torch.equal(awq.awq_scales(mean_abs, 0.0), torch.ones(4))
    s = awq.awq_scales(mean_abs, 0.5)
    assert torch.allclose(s.max() * s.min(), torch.tensor(1.0))
    assert torch.allclose(s / s[0], (mean_abs / mean_abs[0]).sqrt())
    assert [r for r, _ in awq.awq_candidates(mean_abs, 4)] == [0.0, 0.25, 0.5, 0.75]


def test_smoothquant_scales_formula():
    act, w = torch.tensor([4.0, 1.0, 0.0]), torch.tensor([1.0, 4.0, 2.0])
    s = smoothquant.smoothquant_scales(act, w, 0.5)
    assert torch.allclose(s, torch.tensor([2.0, 0.5, 1.0]))  # sqrt(a / w); zero channel -> 1


def test_simulated_quantized_uses_the_packer_and_restores_forward():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 8)
    x = torch.randn(5, 32)
    s = torch.rand(32) + 0.5
    act_amax = (x / s).abs().max()
    with smoothing.simulated_quantized([lin], s, four_six="mse", act_amax=act_amax):
        got = lin(x)
    expected = torch.nn.functional.linear(
        nvfp4.fake_quantize(x / s, "mse", amax=act_amax), nvfp4.fake_quantize(lin.weight * s, "mse"), lin.bias)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert "forward" not in vars(lin)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_search_scales_picks_the_lowest_loss():
    candidates = [(k, torch.full((2,), float(k))) for k in (1, 2, 3)]
    key, scales, losses = smoothing.search_scales(candidates, lambda s: (float(s[0]) - 2.2) ** 2)
    assert key == 2 and torch.equal(scales, torch.full((2,), 2.0)) and set(losses) == {1, 2, 3}


@pytest.mark.parametrize("four_six", [None, "mse"])
def test_awq_clip_never_increases_the_block_output_error(four_six):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(16, 64, generator=g)
    W[0, 3] = 12.0  # an outlier that clipping may trade away
    x = torch.randn(256, 64, generator=g)
    amax = nvfp4.tensor_amax(W)
    clipped = awq.awq_clip(W, x, four_six=four_six, amax=amax)
    assert torch.all(clipped.abs() <= W.abs() + 1e-6)

    def block_err(w):
        q = nvfp4.fake_quantize(w, four_six, amax=amax)
        return torch.einsum("ogk,tgk->ogt", (q - W).view(16, 4, 16), x.view(-1, 4, 16)).pow(2).mean(-1)

    assert torch.all(block_err(clipped) <= block_err(W) * (1 + 1e-6))
    assert block_err(clipped).sum() < block_err(W).sum()


def test_simulated_group_quantizes_a_shared_input_once(monkeypatch):
    torch.manual_seed(0)
    linears = [torch.nn.Linear(32, 8) for _ in range(3)]
    x, s = torch.randn(4, 32), torch.rand(32) + 0.5
    calls = []
    real = nvfp4.fake_quantize

    def counting(t, *args, **kwargs):
        calls.append(kwargs.get("name"))
        return real(t, *args, **kwargs)

    monkeypatch.setattr(nvfp4, "fake_quantize", counting)
    with smoothing.simulated_quantized(linears, s, four_six="mse", act_amax=(x / s).abs().max()):
        outs = [lin(x) for lin in linears]
        again = linears[0](x.clone())
    assert calls.count("activation") == 2  # once for x (three linears), once for its copy
    assert torch.equal(again, outs[0])
