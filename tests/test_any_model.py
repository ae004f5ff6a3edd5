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
}
DENSE = ["llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3", "olmo2", "granite"]
MOE_TYPES = ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"]
# The families whose smoothing folds are exact somewhere (norm -> q/k/v at least);
# olmo2 (post-norms) has none into its attention, and is covered by the "why" test.
SMOOTHABLE = {"llama", "gemma3_text", "qwen3_moe"}
CALIB = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def tiny(model_type: str) -> nn.Module:
    kwargs = dict(COMMON, **(MOE if model_type in MOE_TYPES else {}), **EXTRA.get(model_type, {}))
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
            methods = ["rtn", "gptq"] + (["awq"] if model_type in SMOOTHABLE else [])
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
        if type(module) is nn.Linear:
            assert name in info["high_precision"], f"{name} left in high precision without a reason"
        assert not any(p.dim() == 3 for p in module.parameters(recurse=False)), f"{name} kept 3-D expert tensors"
    kept = {n: r for n, r in info["high_precision"].items() if n != "lm_head"}
    if model_type in MOE_TYPES:
        routers = [n for n, r in kept.items() if "router" in r]
        assert len(routers) == sum(isinstance(m, LinearExperts) for m in model.modules())
    else:
        assert kept == {}
    params_quantized = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, NVFP4Linear))
    params_kept = sum(p.numel() for n, p in model.named_parameters() if any(n.startswith(k + ".") for k in kept))
    assert params_quantized > 10 * params_kept


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
    text = (tmp_path / "inspect" / "inspect.md").read_text()
    assert "(4 experts)" in text and "model.layers.0.mlp.gate (MoE router" in text


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
