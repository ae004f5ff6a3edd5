"""Any decoder-only model, Mixture-of-Experts included (tiny random models from
transformers' own config classes): blocks and input groups found by discovery,
every linear and expert tensor quantized or named with its reason, per-expert
checkpoints under the original checkpoint's names, logits equal after loading
in a fresh process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import fp4ptq
from fp4ptq import QuantConfig
from fp4ptq.experts import LinearExperts
from fp4ptq.models import UnsupportedArchitecture
from fp4ptq.modules import NVFP4Linear

VOCAB = 128
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, head_dim=16)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_local_experts=4, n_routed_experts=4)
EXTRA = {
    "deepseek_v3": dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=1, num_key_value_heads=4,
                        head_dim=8),
    "gpt_oss": dict(layer_types=["full_attention", "sliding_attention"]),
    "phi3": dict(pad_token_id=0),
    # Llama 4: top-1 sigmoid routing applied to the experts' input, a shared expert
    "llama4_text": dict(num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=96),
    # qwen2_moe: a shared expert scaled by sigmoid(shared_expert_gate(x)), a Linear(H, 1)
    "qwen2_moe": dict(shared_expert_intermediate_size=96),
}
DENSE = ["llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3", "olmo2", "granite"]
MOE_TYPES = ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "llama4_text", "qwen2_moe"]
# The families whose smoothing folds are exact somewhere (norm -> q/k/v at least);
# olmo2 (post-norms) has none into its attention, and is covered by the "why" test.
SMOOTHABLE = {"llama", "gemma3_text", "qwen3_moe"}
# Types beyond the list, here for one feature (qwen2_moe: its shared-expert gate): RTN only, to keep time.
RTN_ONLY = {"qwen2_moe"}
CALIB = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def tiny(model_type: str) -> nn.Module:
    kwargs = {**COMMON, **(MOE if model_type in MOE_TYPES else {}), **EXTRA.get(model_type, {})}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 3 or "router" in name or name.endswith("gate.weight"):
                p.normal_(0, 0.1)   # transformers initialises some expert tensors and routers to zero
    return model


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(CALIB).logits


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every model type x method quantized and saved once; reference logits beside each."""
    root = tmp_path_factory.mktemp("any_model")
    made = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in DENSE + MOE_TYPES:
            methods = ["rtn"] + ([] if model_type in RTN_ONLY else ["gptq"]) + (["awq"] if model_type in SMOOTHABLE else [])
            for method in methods:
                scheme = "w4a4" if method == "gptq" else "w4a16"
                model = tiny(model_type)
                config = QuantConfig(method=method, scheme=scheme, four_six="mse", search_nsamples=1, awq_grid=3)
                fp4ptq.quantize(model, config, CALIB, progress=False)
                out = root / f"{model_type}-{method}"
                fp4ptq.save(model, out)
                torch.save(_logits(model), out / "expected.pt")
                made[(model_type, method)] = (out, model)
    return made


def test_every_family_loads_in_a_fresh_process_with_the_fake_quantized_logits(checkpoints):
    dirs = [str(out) for out, _ in checkpoints.values()]
    script = (
        "import sys, torch, fp4ptq\n"
        f"ids = torch.tensor({CALIB.tolist()})\n"
        "bad = []\n"
        "for d in sys.argv[1:]:\n"
        "    m = fp4ptq.load(d, device='cpu', dtype=torch.float32)\n"
        "    with torch.no_grad(): out = m(ids).logits\n"
        "    if not torch.equal(out, torch.load(d + '/expected.pt')): bad.append(d)\n"
        "print('BAD', bad)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(fp4ptq.__file__).parents[1])}
    result = subprocess.run([sys.executable, "-c", script, *dirs], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "BAD []" in result.stdout, result.stdout


@pytest.mark.parametrize("model_type", DENSE + MOE_TYPES)
def test_nothing_is_left_in_high_precision_silently(checkpoints, model_type):
    _, model = checkpoints[(model_type, "rtn")]
    info = model.fp4ptq_info
    quantized = {n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert set(info["layers"]) == quantized and quantized
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            assert name in info["high_precision"], f"{name} left in high precision without a reason"
        assert not any(p.dim() == 3 for p in module.parameters(recurse=False)), f"{name} kept 3-D expert tensors"
    kept = {n: r for n, r in info["high_precision"].items() if n != "lm_head"}
    routers = [n for n, r in kept.items() if "router" in r]
    gates = [n for n, r in kept.items() if r.startswith("gate:")]
    assert len(routers) == sum(isinstance(m, LinearExperts) for m in model.modules())
    assert kept.keys() == set(routers) | set(gates)
    assert gates == ([f"model.layers.{i}.mlp.shared_expert_gate" for i in range(2)] if model_type == "qwen2_moe"
                     else [])
    # Every parameter (and stored buffer) is quantized or named with a reason: the counts add up to the float
    # model's.
    tensors = info["kept_tensors"]
    stored = _stored_tensors(model)
    assert set(tensors) == set(stored) and all(tensors.values())
    params_quantized = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, NVFP4Linear))
    params_kept = sum(t.numel() for t in stored.values())
    assert params_quantized + params_kept == sum(t.numel() for t in _stored_tensors(tiny(model_type)).values())
    reasons = " ".join(tensors.values())
    assert "token embedding" in reasons and "norm" in reasons
    if model_type == "gpt_oss":
        assert "attention sinks" in tensors["model.layers.0.self_attn.sinks"]
    if model_type == "deepseek_v3":
        assert "router" in tensors["model.layers.1.mlp.gate.e_score_correction_bias"]


def _stored_tensors(model) -> dict:
    """The model's parameters and persistent buffers (tied ones once), the NVFP4 linears' own buffers aside."""
    out, seen = {}, set()
    for mname, module in model.named_modules():
        tensors = list(module.named_parameters(recurse=False))
        if not isinstance(module, NVFP4Linear):
            tensors += [(n, b) for n, b in module.named_buffers(recurse=False)
                        if n not in module._non_persistent_buffers_set]
        for n, t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                out[f"{mname}.{n}" if mname else n] = t
    return out


@pytest.mark.parametrize("model_type", sorted(SMOOTHABLE))
def test_awq_folds_only_where_exact_and_says_why_elsewhere(checkpoints, model_type):
    _, model = checkpoints[(model_type, "awq")]
    smoothing = model.fp4ptq_info["smoothing"]
    searched = [k for k, v in smoothing.items() if "skipped" not in v]
    assert any(k.endswith("q_proj") or k.endswith("q_a_proj") for k in searched)   # norm -> attention: exact
    for record in smoothing.values():
        assert "folded_into" in record or "skipped" in record or record.get("awq_ratio") == 0.0
    for name, record in smoothing.items():
        if ".experts.0.gate_proj" in name and "folded_into" in record:
            assert record["compensated"], "the router must take the compensating scale of the experts' input"


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_the_experts_input_folds_into_its_norm_only_with_the_router_compensated(model_type):
    from fp4ptq.experts import linearize_model
    from fp4ptq.models import discover_block, find_blocks
    from fp4ptq.pipeline import capture_block_inputs

    model = tiny(model_type)
    linearize_model(model)
    _, blocks = find_blocks(model)
    inputs = capture_block_inputs(model, blocks, CALIB[:1])
    plan = discover_block(blocks[1], inputs.hidden[0], inputs.calls[1], probe=True)
    (moe,) = [g for g in plan.groups if "mlp.experts.0.gate_proj" in g.linears]
    assert moe.prev == "post_attention_layernorm" and moe.readers == ("mlp.gate",)
    assert set(moe.fused_sets) >= {("mlp.experts.0.gate_proj", "mlp.experts.0.up_proj")}
    if model_type == "deepseek_v3":   # the shared expert reads the same tensor, fused on its own
        assert ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj") in moe.fused_sets
    assert moe.fold == "norm"


def test_gemma_offset_norm_folds_as_one_plus_weight():
    from fp4ptq.models import discover_block, find_blocks
    from fp4ptq.pipeline import capture_block_inputs

    model = tiny("gemma3_text")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0, 0.3)
    _, blocks = find_blocks(model)
    inputs = capture_block_inputs(model, blocks, CALIB[:1])
    plan = discover_block(blocks[0], inputs.hidden[0], inputs.calls[0], probe=True)
    folds = {g.prev: g.fold for g in plan.groups if g.prev}
    assert folds["input_layernorm"] == "norm_offset"
    assert folds["mlp.up_proj"] == "linear"


def test_olmo2_post_norm_groups_are_quantized_unsmoothed_with_the_reason():
    model = tiny("olmo2")
    fp4ptq.quantize(model, QuantConfig(method="awq", search_nsamples=1, awq_grid=3), CALIB, progress=False)
    record = model.fp4ptq_info["smoothing"]["model.layers.0.self_attn.q_proj"]
    assert "residual stream" in record["skipped"]
    assert isinstance(model.model.layers[0].self_attn.q_proj, NVFP4Linear)


def test_a_wrong_table_fails_loudly(monkeypatch):
    from fp4ptq import models

    wrong = models.ArchSpec(layers="model.layers", groups=(
        models.InputGroup(("self_attn.q_proj", "self_attn.k_proj"), "input_layernorm", "self_attn", fused=True),
    ))
    monkeypatch.setitem(models.ARCHITECTURES, "llama", wrong)
    with pytest.raises(UnsupportedArchitecture, match="table disagrees"):
        fp4ptq.quantize(tiny("llama"), QuantConfig(), progress=False)


def _save_pretrained_names(model_type: str, tmp_path) -> set:
    from safetensors import safe_open

    tiny(model_type).save_pretrained(tmp_path / "plain")
    with safe_open(str(tmp_path / "plain" / "model.safetensors"), "pt") as handle:
        return set(handle.keys())


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_checkpoint_names_are_save_pretrained_names_with_the_packed_triple(checkpoints, model_type, tmp_path):
    from safetensors import safe_open

    out, model = checkpoints[(model_type, "rtn")]
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        ours = set(handle.keys())
    expected = set()
    for name in _save_pretrained_names(model_type, tmp_path):
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{base}.weight_packed" in ours:
            expected |= {f"{base}.weight_packed", f"{base}.weight_scale", f"{base}.weight_global_scale"}
        else:
            expected.add(name)
    assert ours == expected
    assert any(".experts.3." in n and n.endswith("weight_packed") for n in ours)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    router = "block_sparse_moe.gate" if model_type == "mixtral" else "mlp.gate"
    assert f"model.layers.0.{router}" in config["ignore"]


PACKED = ("weight_packed", "weight_scale", "weight_global_scale")


def test_llama4_checkpoint_names_are_the_per_expert_names_vllm_loads(checkpoints, tmp_path):
    """transformers 5.25 has no weight conversion for Llama 4: its save_pretrained writes the experts
    as 3-D ``feed_forward.experts.gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]``. NVFP4 stores
    each expert projection as a tensor of its own, under the per-expert names vLLM's Llama 4 loader maps
    (``FusedMoE.make_expert_params_mapping`` with ``gate_proj``/``up_proj``/``down_proj``:
    ``experts.E.gate_proj.weight_packed``); every other name is save_pretrained's, the router's
    ``.weight`` included (vLLM builds it unquantized), and the router is in ``ignore``."""
    from safetensors import safe_open

    out, model = checkpoints[("llama4_text", "gptq")]
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        ours = set(handle.keys())
    experts = model.config.num_local_experts
    expected = set()
    for name in _save_pretrained_names("llama4_text", tmp_path):
        base, leaf = name.rsplit(".", 1)
        if leaf in ("gate_up_proj", "down_proj") and base.endswith(".experts"):
            projections = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
            expected |= {f"{base}.{e}.{p}.{t}" for e in range(experts) for p in projections for t in PACKED}
            expected |= {f"{base}.{e}.{p}.input_global_scale" for e in range(experts) for p in projections}
        elif leaf == "weight" and f"{base}.weight_packed" in ours:
            expected |= {f"{base}.{t}" for t in PACKED + ("input_global_scale",)}
        else:
            expected.add(name)
    assert ours == expected
    assert "model.layers.1.feed_forward.router.weight" in ours
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert [n for n in ignore if "router" in n] == [f"model.layers.{i}.feed_forward.router" for i in range(2)]
    layer = model.model.layers[0].feed_forward
    assert type(layer.router).__name__ == "Llama4Router" and not isinstance(layer.router, NVFP4Linear)
    for e in layer.experts:   # gate and up of one expert share a global scale (engines fuse them into w13)
        assert torch.equal(e.gate_proj.weight_global_scale, e.up_proj.weight_global_scale)


def test_a_router_beside_experts_left_unlinearized_stays_in_high_precision(monkeypatch):
    """Router detection does not depend on the experts being linearized: with Llama 4's experts
    refused (as an unknown layout would be), their 3-D tensors and the Linear(H, E) router both stay
    in high precision, each with its reason."""
    from fp4ptq import experts

    def refuse(module):
        raise experts.UnsupportedExperts(f"{type(module).__name__}: refused by the test")

    monkeypatch.setattr(experts, "_layout", refuse)
    model = tiny("llama4_text")
    fp4ptq.quantize(model, QuantConfig(), progress=False)
    high = model.fp4ptq_info["high_precision"]
    assert "router" in high["model.layers.0.feed_forward.router"]
    assert "refused by the test" in high["model.layers.0.feed_forward.experts"]
    assert type(model.model.layers[0].feed_forward.router).__name__ == "Llama4Router"
    kept = model.fp4ptq_info["kept_tensors"]
    assert "refused by the test" in kept["model.layers.0.feed_forward.experts.gate_up_proj"]


def test_qwen2_moe_shared_expert_gate_stays_in_high_precision_and_in_ignore(checkpoints):
    out, model = checkpoints[("qwen2_moe", "rtn")]
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    for i in range(2):
        mlp = model.model.layers[i].mlp
        assert type(mlp.shared_expert_gate) is nn.Linear and f"model.layers.{i}.mlp.shared_expert_gate" in ignore
        assert isinstance(mlp.shared_expert.gate_proj, NVFP4Linear)   # the shared expert itself: like a dense MLP
    reason = model.fp4ptq_info["high_precision"]["model.layers.0.mlp.shared_expert_gate"]
    assert reason.startswith("gate:") and "sigmoid" in reason


def test_gate_and_up_of_one_expert_share_a_global_scale(checkpoints):
    _, model = checkpoints[("qwen3_moe", "gptq")]
    experts = model.model.layers[0].mlp.experts
    scales = [e.gate_proj.weight_global_scale for e in experts]
    for e in experts:
        assert torch.equal(e.gate_proj.weight_global_scale, e.up_proj.weight_global_scale)
    assert len({float(s) for s in scales}) > 1   # one scale per expert, not one per layer


def test_compressed_tensors_decodes_every_expert_tensor(checkpoints):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    out, model = checkpoints[("mixtral", "gptq")]
    qcfg = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    group = qcfg.config_groups["group_0"]
    tensors = load_file(str(out / "model.safetensors"))
    decoded_any = 0
    for name, module in model.named_modules():
        if isinstance(module, NVFP4Linear) and ".experts." in name:
            file_name = name.replace(".mlp.", ".block_sparse_moe.")   # Mixtral's checkpoint names
            local = {k[len(file_name) + 1:]: v for k, v in tensors.items() if k.startswith(file_name + ".")}
            decoded = NVFP4PackedCompressor.decompress(local, group)["weight"]
            assert torch.equal(decoded, module.dequantized_weight(torch.bfloat16)), name
            decoded_any += 1
    assert decoded_any == 2 * 4 * 3   # 2 layers x 4 experts x (w1, w3, w2)


def _route_away_from(model, expert: int) -> None:
    """Every router sends expert ``expert``'s tokens to expert 0 instead."""
    for layer in model.model.layers:
        gate = layer.mlp.gate
        forward = gate.forward

        def patched(x, forward=forward):
            logits, weights, index = forward(x)
            return logits, weights, torch.where(index == expert, torch.zeros_like(index), index)

        gate.forward = patched


def test_an_expert_without_routed_tokens_is_named_and_rounded_without_nan(tmp_path):
    model = tiny("qwen3_moe")
    _route_away_from(model, 3)
    config = QuantConfig(method="gptq", scheme="w4a4", moe_calib="routed")
    with pytest.warns(UserWarning, match=r"model\.layers\.0\.mlp\.experts\.3 received no calibration token"):
        fp4ptq.quantize(model, config, CALIB, progress=False)
    info = model.fp4ptq_info["layers"]
    assert info["model.layers.0.mlp.experts.3.gate_proj"]["note"].startswith("no routed calibration token")
    for module in model.modules():
        if isinstance(module, NVFP4Linear):
            assert torch.isfinite(module.weight_global_scale).all() and torch.isfinite(module.input_global_scale).all()
            assert torch.isfinite(module.weight_scale.float()).all()
    fp4ptq.save(model, tmp_path / "ckpt")
    assert torch.isfinite(_logits(model)).all()


def test_all_and_routed_calibration_give_experts_different_hessians():
    packed = {}
    for mode in ("all", "routed"):
        model = tiny("qwen3_moe")
        fp4ptq.quantize(model, QuantConfig(method="gptq", moe_calib=mode), CALIB, progress=False)
        packed[mode] = model.model.layers[0].mlp.experts[1].down_proj.weight_packed.clone()
        assert model.fp4ptq_info["calibration"]["moe_calib"] == mode
    assert not torch.equal(packed["all"], packed["routed"])


def test_a_module_neither_linear_nor_expert_is_kept_and_named():
    model = tiny("llama")
    model.model.layers[0].mlp.add_module("conv", nn.Conv1d(64, 64, 1))
    fp4ptq.quantize(model, QuantConfig(), progress=False)
    assert "Conv1d" in model.fp4ptq_info["high_precision"]["model.layers.0.mlp.conv"]


def test_an_encoder_decoder_model_is_refused_with_exit_5(tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=64,
                                                d_kv=16))
    with pytest.raises(UnsupportedArchitecture, match="encoder-decoder"):
        fp4ptq.quantize(model, QuantConfig(), progress=False)
    from fp4ptq.cli import _exit_code_for

    assert _exit_code_for(UnsupportedArchitecture("x")) == 5


def test_inspect_groups_experts_with_min_mean_max(checkpoints, tmp_path):
    from fp4ptq.cli import main

    out, _ = checkpoints[("qwen3_moe", "rtn")]
    assert main(["inspect", str(out), "--output", str(tmp_path / "inspect")]) == 0
    summary = json.loads((tmp_path / "inspect" / "inspect.json").read_text())
    rows = {row["name"]: row for row in summary["layers"]}
    row = rows["model.layers.0.mlp.experts.*.gate_proj"]
    errors = [e["rel_error"] for e in summary["expert_layers"] if e["name"].endswith("gate_proj")
              and e["name"].startswith("model.layers.0.")]
    assert row["experts"] == 4 == len(errors)
    assert row["rel_error_min"] == min(errors) and row["rel_error_max"] == max(errors)
    assert abs(row["rel_error"] - sum(errors) / 4) < 1e-12
    shares = [e["four_share"] for e in summary["expert_layers"] if e["name"].endswith("gate_proj")
              and e["name"].startswith("model.layers.0.")]
    assert None not in shares and 0 < row["four_share"] < 1   # four_six="mse": the 4/6 share, mean over experts
    assert abs(row["four_share"] - sum(shares) / 4) < 1e-12
    text = (tmp_path / "inspect" / "inspect.md").read_text()
    assert "(4 experts)" in text and "model.layers.0.mlp.gate (MoE router" in text
    # every kept tensor is listed with its reason
    assert set(summary["kept_tensors"]) == set(_stored_tensors(checkpoints[("qwen3_moe", "rtn")][1]))
    # (the markdown collapses names that differ only in their layer or expert index, with their count)
    assert "model.layers.*.post_attention_layernorm.weight (2)" in text and "model.embed_tokens.weight" in text


@pytest.mark.parametrize("model_type", ["qwen3_moe", "llama4_text"])
def test_calibrating_every_expert_does_not_change_what_flows_to_the_next_block(model_type):
    """Discovery's forward runs every expert on every token (``calibrate_all``) and its output is the
    real routed one, bit for bit; and under ``moe_calib="all"`` the hidden states the pipeline hands
    to block 1 are those the quantized block 0 produces in a plain forward."""
    from fp4ptq.experts import linearize_model
    from fp4ptq.models import _calibrate_all, find_blocks
    from fp4ptq.pipeline import capture_block_inputs

    model = tiny(model_type)
    linearize_model(model)
    _, blocks = find_blocks(model)
    inputs = capture_block_inputs(model, blocks, CALIB[:1])
    args, kwargs = inputs.calls[0]
    with torch.no_grad():
        routed = blocks[0](inputs.hidden[0], *args, **kwargs)
        with _calibrate_all(blocks[0], True):
            everything = blocks[0](inputs.hidden[0], *args, **kwargs)
    assert torch.equal(routed, everything)

    handed = []
    hook = blocks[1].register_forward_pre_hook(lambda m, a, kw: handed.append(a[0] if a else kw["hidden_states"]),
                                               with_kwargs=True)
    fp4ptq.quantize(model, QuantConfig(scheme="w4a4", moe_calib="all"), CALIB[:1], progress=False)
    during = handed[0]   # block 1's first call in the run: discovery, on the first propagated sequence
    handed.clear()
    with torch.no_grad():
        model(CALIB[:1])
    hook.remove()
    assert during.shape[0] == 1 and torch.equal(during, handed[0][:1])


def test_expert_statistics_peak_does_not_grow_with_the_number_of_experts(monkeypatch):
    """Experts are streamed: the per-expert calibration statistics alive at once (count and bytes of
    their tensors) are the same for 4 and for 32 experts of equal size on the same tokens (W4A4 RTN:
    activation statistics; GPTQ's Hessians live in the same objects, one expert at a time)."""
    from fp4ptq import moe, stats

    def peak(num_experts: int) -> tuple:
        alive, top = {}, [0, 0]

        class Tracked(stats.InputStats):
            def update(self, x):
                super().update(x)
                held = [self.absmax, self.abs_sum, self.hessian, *self.samples]
                alive[id(self)] = sum(t.numel() * t.element_size() for t in held if t is not None)
                top[0] = max(top[0], len(alive))
                top[1] = max(top[1], sum(alive.values()))

            def __del__(self):
                alive.pop(id(self), None)

        monkeypatch.setattr(moe, "InputStats", Tracked)
        config = AutoConfig.for_model("qwen3_moe", **{**COMMON, "num_hidden_layers": 1, "moe_intermediate_size": 32,
                                                      "num_experts": num_experts, "num_experts_per_tok": 2})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        fp4ptq.quantize(model, QuantConfig(scheme="w4a4", moe_calib="all"), CALIB[:1], progress=False)
        experts = model.model.layers[0].mlp.experts
        assert len(experts) == num_experts and isinstance(experts[-1].down_proj, NVFP4Linear)
        return tuple(top)

    small, large = peak(4), peak(32)
    assert small == large and 1 <= small[0] <= 2 and small[1] > 0, (small, large)


def test_cli_moe_calib_option_reaches_the_config(tmp_path):
    from fp4ptq.cli import build_parser

    args = build_parser().parse_args(["quantize", "--moe-calib", "routed"])
    assert args.moe_calib == "routed"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quantize", "--moe-calib", "some"])


class _OldExpert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class _OldSparseMoe(nn.Module):
    """The per-expert nn.Linear form of earlier transformers releases (Mixtral's sparse block)."""

    def __init__(self, hidden: int = 64, inter: int = 32, experts: int = 4, top_k: int = 1) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(_OldExpert(hidden, inter) for _ in range(experts))

    def forward(self, hidden_states):
        b, t, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        weights, chosen = torch.topk(self.gate(x).softmax(-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.view(b, t, h)


def _old_form_model() -> nn.Module:
    model = tiny("granite")   # a family without a table (llama's would rightly refuse the changed MLP)
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.mlp = _OldSparseMoe()
    return model


@pytest.mark.parametrize("mode", ["all", "routed"])
def test_the_older_per_expert_linear_form_is_calibrated_and_quantized(mode, tmp_path):
    model = _old_form_model()
    # expert 3 of every layer is never routed to: "all" still calibrates it, "routed" falls back to RTN
    for layer in model.model.layers:
        gate = layer.mlp.gate
        gate.forward = lambda x, f=gate.forward: f(x).index_fill(-1, torch.tensor([3]), -1e9)
    config = QuantConfig(method="awq", scheme="w4a4", moe_calib=mode, search_nsamples=1, awq_grid=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp4ptq.quantize(model, config, CALIB, progress=False)
    info = model.fp4ptq_info
    high = info["high_precision"]
    assert "router" in high["model.layers.0.mlp.gate"]
    for e in range(4):
        for proj in ("w1", "w2", "w3"):
            module = model.get_submodule(f"model.layers.0.mlp.experts.{e}.{proj}")
            assert isinstance(module, NVFP4Linear)
            assert torch.isfinite(module.input_global_scale).all() and torch.isfinite(module.weight_global_scale).all()
    w1, w3 = model.model.layers[0].mlp.experts[3].w1, model.model.layers[0].mlp.experts[3].w3
    assert torch.equal(w1.weight_global_scale, w3.weight_global_scale)
    unrouted = [str(w.message) for w in caught if "received no calibration token" in str(w.message)]
    note = info["layers"]["model.layers.0.mlp.experts.3.w1"].get("note")
    if mode == "routed":
        assert unrouted and "model.layers.0.mlp.experts.3" in unrouted[0] and note.startswith("no routed")
    else:
        assert not unrouted and note is None
    assert torch.isfinite(_logits(model)).all()


def test_routed_awq_over_several_batches_searches_on_each_experts_tokens(monkeypatch):
    # an expert's routed tokens differ in number from batch to batch: its down search runs on token rows
    from fp4ptq import stats

    monkeypatch.setattr(stats, "TOKENS_PER_CALL", 16)   # one sequence a batch
    model = tiny("qwen3_moe")
    calib = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))
    fp4ptq.quantize(model, QuantConfig(method="awq", moe_calib="routed", search_nsamples=4, awq_grid=3), calib,
                    progress=False)
    searched = [k for k, v in model.fp4ptq_info["smoothing"].items() if ".down_proj" in k and "loss" in v]
    assert searched and torch.isfinite(_logits(model)).all()


def test_blocks_whose_recorded_arguments_do_not_batch_run_a_sequence_a_call():
    """BLOOM's blocks take an ALiBi table recorded for one sequence ([heads, 1, T]): GPTQ over two
    calibration sequences runs them one at a time (probed once on the first block) and finishes,
    and so does a model whose code reads an attribute of a block while its inputs are recorded
    (BigBird's ``attention_type``)."""
    for model_type in ("bloom", "big_bird"):
        model = tiny(model_type)
        fp4ptq.quantize(model, QuantConfig(method="gptq"), CALIB, progress=False)
        assert any(isinstance(m, NVFP4Linear) for m in model.modules()), model_type
        assert torch.isfinite(_logits(model)).all(), model_type
