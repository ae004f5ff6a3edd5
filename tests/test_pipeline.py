"""fp4ptq.quantize on tiny random models built here (no downloads): every method
in both schemes with and without 4/6, fused global scales, calibrated static
input scales from the quantized propagation, hooks removed, clear errors."""
import copy
import warnings

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import fp4ptq
from fp4ptq import nvfp4
from fp4ptq.config import METHODS, QuantConfig
from fp4ptq.models import UnsupportedArchitecture
from fp4ptq.modules import NVFP4Linear
from fp4ptq.nvfp4 import NVFP4Error
from fp4ptq.pipeline import CalibrationError

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def tiny(config_cls=LlamaConfig, seed=0, **overrides):
    """A 2-block random decoder with hidden 32 (MHA: v -> o smoothing folds)."""
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    kwargs.update(overrides)
    return AutoModelForCausalLM.from_config(config_cls(**kwargs)).eval()


CALIB = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
BASE = tiny()


def run(config, model=None, calib=CALIB, **kwargs):
    model = copy.deepcopy(BASE) if model is None else model
    return fp4ptq.quantize(model, config, calib, progress=False, **kwargs)


@pytest.mark.parametrize("four_six", [None, "mse"])
@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
@pytest.mark.parametrize("method", METHODS)
def test_every_method_and_scheme_quantizes_all_block_linears(method, scheme, four_six):
    config = QuantConfig(method=method, scheme=scheme, four_six=four_six, search_nsamples=2, awq_grid=4,
                         smoothquant_alphas=(0.5, 0.8), awq_clip=method.startswith("awq"))
    model = run(config)
    info = model.fp4ptq_info
    for i in range(2):
        for name in LINEARS:
            full = f"model.layers.{i}.{name}"
            module = model.get_submodule(full)
            assert isinstance(module, NVFP4Linear) and module.scheme == scheme
            assert module.act_four_six == (four_six if scheme == "w4a4" else None)
            entry = info["layers"][full]
            assert entry["shape"] == [module.out_features, module.in_features] and entry["scheme"] == scheme
            assert 0 < entry["rel_error"] < 0.3
            assert (entry["four_share"] is None) == (four_six is None)
    assert info["high_precision"] == {"lm_head": "ignored by QuantConfig.ignore"}
    assert info["config"] == config.to_dict()
    assert info["calibration"] == {"source": "tensor", "nsamples": 4, "seqlen": 16, "seed": None}
    with torch.no_grad():
        ref, out = BASE(CALIB).logits, model(CALIB).logits
    assert torch.isfinite(out).all()
    assert float((out - ref).norm() / ref.norm()) < 0.2


def test_rtn_w4a16_needs_no_data_and_matches_the_packer():
    model = run(QuantConfig(four_six="mae"), calib=None)
    assert model.fp4ptq_info["calibration"]["source"] is None
    w = BASE.model.layers[1].mlp.down_proj.weight
    expected = nvfp4.quantize(w, "mae")
    got = model.model.layers[1].mlp.down_proj
    assert torch.equal(got.weight_packed, expected.packed)
    assert torch.equal(got.weight_scale.float(), expected.block_scale.float())


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_fused_groups_share_one_global_scale(method):
    model = run(QuantConfig(method=method, four_six="mse"))
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        assert all(torch.equal(m.weight_global_scale, qkv[0].weight_global_scale) for m in qkv)
        assert torch.equal(mlp.gate_proj.weight_global_scale, mlp.up_proj.weight_global_scale)
    layer = BASE.model.layers[0].self_attn
    amax = max(float(m.weight.detach().abs().max()) for m in (layer.q_proj, layer.k_proj, layer.v_proj))
    assert torch.allclose(model.model.layers[0].self_attn.q_proj.weight_global_scale,
                          nvfp4.global_encode_scale(amax, four_six=True).reshape(1))


def test_w4a4_input_scales_come_from_the_quantized_propagation():
    model = run(QuantConfig(scheme="w4a4"))
    # Block 1's inputs must be block 0's *quantized* outputs: rebuild them.
    captured = {}
    handle = model.model.layers[1].input_layernorm.register_forward_hook(
        lambda m, a, out: captured.setdefault("x", []).append(out))
    try:
        with torch.no_grad():
            for row in CALIB:
                model(row[None])
    finally:
        handle.remove()
    amax = max(float(x.abs().max()) for x in captured["x"])
    q_proj = model.model.layers[1].self_attn.q_proj
    assert torch.allclose(q_proj.input_amax(), torch.tensor(amax), rtol=1e-6)


def test_w4a4_rtn_block0_input_scale_is_the_float_input_amax():
    model = run(QuantConfig(scheme="w4a4", four_six="mse"))
    with torch.no_grad():
        x = BASE.model.layers[0].input_layernorm(BASE.model.embed_tokens(CALIB))
    assert torch.allclose(model.model.layers[0].self_attn.k_proj.input_amax(), x.abs().max(), rtol=1e-6)


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_hooks_are_removed_after_the_run_and_after_an_error():
    model = copy.deepcopy(BASE)
    before = _hook_count(model)
    run(QuantConfig(method="awq+gptq", scheme="w4a4", search_nsamples=2, awq_grid=2), model=model)
    assert _hook_count(model) == before
    bad = copy.deepcopy(BASE)
    with torch.no_grad():
        bad.model.layers[1].post_attention_layernorm.weight[3] = float("nan")
    with pytest.raises(NVFP4Error):
        run(QuantConfig(method="gptq"), model=bad)
    assert _hook_count(bad) == before


def test_nan_activation_error_names_the_layer():
    bad = copy.deepcopy(BASE)
    with torch.no_grad():
        bad.model.layers[1].post_attention_layernorm.weight[3] = float("inf")
    with pytest.raises(NVFP4Error, match=r"model\.layers\.1\.mlp\.gate_proj .*NaN.*Inf"):
        run(QuantConfig(method="gptq"), model=bad)


def test_in_features_not_multiple_of_16_stays_high_precision_with_a_warning():
    model = tiny(intermediate_size=40)
    with pytest.warns(UserWarning, match=r"model\.layers\.0\.mlp\.down_proj.*multiple of 16"):
        run(QuantConfig(method="gptq", scheme="w4a4"), model=model)
    high = model.fp4ptq_info["high_precision"]
    assert "in_features=40" in high["model.layers.0.mlp.down_proj"]
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert isinstance(model.model.layers[0].mlp.up_proj, NVFP4Linear)


def test_lm_head_quantized_when_not_ignored():
    model = run(QuantConfig(method="gptq", scheme="w4a4", ignore=()))
    assert isinstance(model.lm_head, NVFP4Linear)
    assert "lm_head" in model.fp4ptq_info["layers"] and model.fp4ptq_info["high_precision"] == {}


def test_ignore_pattern_keeps_matching_layers():
    model = run(QuantConfig(ignore=("lm_head", "*.self_attn.o_proj")), calib=None)
    assert type(model.model.layers[1].self_attn.o_proj) is nn.Linear
    assert model.fp4ptq_info["high_precision"]["model.layers.1.self_attn.o_proj"].startswith("ignored")


@pytest.mark.parametrize(
    "config_cls, extra",
    [(Qwen2Config, {}), (Qwen3Config, {"head_dim": 16}), (MistralConfig, {"sliding_window": 8}),
     (LlamaConfig, {"num_key_value_heads": 1})],
)
def test_other_architectures_and_grouped_query_attention(config_cls, extra):
    model = tiny(config_cls, **extra)
    base = copy.deepcopy(model)
    run(QuantConfig(method="awq", scheme="w4a4", four_six="mse", search_nsamples=2, awq_grid=4), model=model)
    assert all(isinstance(model.model.layers[1].get_submodule(n), NVFP4Linear) for n in LINEARS)
    if extra.get("num_key_value_heads") == 1:  # v -> o cannot fold under GQA
        assert "skipped" in model.fp4ptq_info["smoothing"]["model.layers.0.self_attn.o_proj"]
    with torch.no_grad():
        ref, out = base(CALIB).logits, model(CALIB).logits
    assert float((out - ref).norm() / ref.norm()) < 0.2


def test_a_model_without_a_table_names_every_module_it_cannot_quantize():
    # GPT-2 has no table and computes its projections with transformers' Conv1D, not
    # nn.Linear: discovery finds its blocks, and each Conv1D is reported, not dropped silently.
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    fp4ptq.quantize(model, QuantConfig(), progress=False)
    high = model.fp4ptq_info["high_precision"]
    for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        assert "Conv1D" in high[f"transformer.h.0.{name}"]


def test_missing_calibration_is_a_clear_error():
    with pytest.raises(CalibrationError, match="needs calibration data.*tokenizer"):
        run(QuantConfig(method="gptq"), calib=None)
    with pytest.raises(CalibrationError, match="LongTensor"):
        run(QuantConfig(method="gptq"), calib=CALIB.float())
    with pytest.raises(CalibrationError, match=r"\[0, 128\)"):
        run(QuantConfig(method="gptq"), calib=CALIB + 200)


def test_calibration_built_from_config_with_the_tokenizer(tmp_path):
    (tmp_path / "doc.txt").write_text("some calibration text for the tiny model. " * 40)

    class CharTokenizer:
        eos_token_id = 0

        def __call__(self, text, **kwargs):
            return {"input_ids": [1 + ord(c) % 127 for c in text]}

    config = QuantConfig(method="gptq", calib=str(tmp_path), nsamples=3, seqlen=16, seed=5)
    model = run(config, calib=None, tokenizer=CharTokenizer())
    assert model.fp4ptq_info["calibration"] == {"source": str(tmp_path), "nsamples": 3, "seqlen": 16, "seed": 5}


def test_deterministic_and_blocks_return_to_their_device():
    config = QuantConfig(method="awq+gptq", scheme="w4a4", four_six="mse", search_nsamples=2, awq_grid=4)
    a, b = run(config, device="cpu"), run(config)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x.float(), y.float()), name
    assert {p.device.type for p in a.state_dict().values()} == {"cpu"}


def test_progress_bar_and_no_warnings_for_a_clean_model():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp4ptq.quantize(copy.deepcopy(BASE), QuantConfig(method="gptq"), CALIB, progress=True)
