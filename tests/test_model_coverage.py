"""Issue 39's coverage beyond RTN and GPTQ (tiny random models of every family of the issue's
list, from tests/test_any_model.py): AWQ (W4A16) and SmoothQuant (W4A4) quantize, save and load
in a fresh process with the fake-quantized logits, each group folded exactly or its reason
recorded; compressed-tensors' NVFP4 decompressor decodes every packed tensor of every family to
the layer's values; transformers' ``from_pretrained`` runs the MoE checkpoints with
``fp4ptq.load``'s logits; DeepSeek-V3's tensor names are ``save_pretrained``'s. One checkpoint
per family and method (session fixture); the fresh-process checks share one subprocess.

And a fixed subset of the causal-LM model types the installed transformers registers (the full
sweep is ``benchmarks/model_types_sweep.py``), through the sweep's own check."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import fp4ptq
from fp4ptq import QuantConfig
from fp4ptq.modules import NVFP4Linear

from test_any_model import CALIB, DENSE, MOE_TYPES, _logits, _save_pretrained_names, tiny

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = DENSE + MOE_TYPES
METHODS = {"awq": "w4a16", "smoothquant": "w4a4"}
FROM_PRETRAINED = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="session")
def smoothed(tmp_path_factory):
    """``{(family, method): (checkpoint dir, quantized model)}``, the fake-quantized logits in
    ``expected.pt`` beside each checkpoint."""
    root = tmp_path_factory.mktemp("coverage")
    made = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # 24 tiny models: a second thread only waits (and spins) on a loaded machine
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for family in FAMILIES:
                for method, scheme in METHODS.items():
                    model = tiny(family)
                    config = QuantConfig(method=method, scheme=scheme, search_nsamples=1, awq_grid=3,
                                         smoothquant_alpha=0.5)
                    fp4ptq.quantize(model, config, CALIB, progress=False)
                    out = fp4ptq.save(model, root / f"{family}-{method}")
                    torch.save(_logits(model), out / "expected.pt")
                    made[(family, method)] = (out, model)
    finally:
        torch.set_num_threads(threads)
    return made


_FRESH = """
import json, sys, torch, fp4ptq
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
ids = torch.tensor(json.loads(sys.argv[1]))
hf_dirs = set(json.loads(sys.argv[2]))
report = {}
for d in sys.argv[3:]:
    with torch.no_grad():
        ours = fp4ptq.load(d, device="cpu", dtype=torch.float32)(ids).logits
        entry = {"load": torch.equal(ours, torch.load(d + "/expected.pt"))}
        if d in hf_dirs:
            hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            entry["nvfp4_layers"] = sum(type(m).__name__ == "NVFP4Linear" for m in hf.modules())
            entry["from_pretrained"] = torch.equal(hf(ids).logits, ours)
    report[d] = entry
print("REPORT", json.dumps(report))
"""


def test_awq_and_smoothquant_load_in_a_fresh_process_with_the_fake_quantized_logits(smoothed):
    """Every family x {AWQ W4A16, SmoothQuant W4A4}: ``fp4ptq.load`` in a new process gives the
    fake-quantized model's logits exactly; for the MoE families of FROM_PRETRAINED,
    ``AutoModelForCausalLM.from_pretrained`` too (packed layers, the same logits as ``fp4ptq.load``)."""
    dirs = {key: str(out) for key, (out, _) in smoothed.items()}
    hf_dirs = [dirs[(family, "awq")] for family in FROM_PRETRAINED] + \
              [dirs[(family, "smoothquant")] for family in FROM_PRETRAINED]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", _FRESH, json.dumps(CALIB.tolist()), json.dumps(hf_dirs),
                             *dirs.values()], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("REPORT ")]
    report = json.loads(line[len("REPORT "):])
    assert [key for key, d in dirs.items() if not report[d]["load"]] == []
    for d in hf_dirs:
        assert report[d]["from_pretrained"], d
        assert report[d]["nvfp4_layers"] > 0, d


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_input_group_is_folded_exactly_or_says_why_not(smoothed, method):
    """Each quantized linear's smoothing record: a scale folded into its producer (a norm or a
    linear), a searched ratio of 0, or the reason no fold is exact; every family folds somewhere
    (norm -> attention or MLP) and leaves a reason where it cannot (o_proj under GQA, post-norms)."""
    for family in FAMILIES:
        _, model = smoothed[(family, method)]
        info = model.fp4ptq_info
        smoothing = info["smoothing"]
        assert set(smoothing) <= set(info["layers"]), family
        folded = [k for k, v in smoothing.items() if "folded_into" in v]
        why = {k: v["skipped"] for k, v in smoothing.items() if "skipped" in v}
        assert folded, f"{family}: {method} folded no group"
        assert why and all(isinstance(r, str) and r for r in why.values()), family
        for name, record in smoothing.items():
            assert "folded_into" in record or "skipped" in record or record.get("awq_ratio") == 0.0, \
                (family, name, record)
        assert all(isinstance(m, NVFP4Linear) for n, m in model.named_modules() if n in why), family


def test_compressed_tensors_decodes_every_packed_tensor_of_every_family(smoothed):
    """compressed-tensors' own NVFP4 decompressor, on every packed triple of every checkpoint (dense
    and expert layers, W4A16 and W4A4), gives the loaded layer's dequantized weight bit for bit."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    from fp4ptq.models import checkpoint_names

    for (family, method), (out, model) in smoothed.items():
        qcfg = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
        (group,) = qcfg.config_groups.values()
        tensors = load_file(str(out / "model.safetensors"))
        layers = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
        names = checkpoint_names(model, [f"{n}.weight_packed" for n in layers])
        packed = {k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")}
        assert packed == {v.removesuffix(".weight_packed") for v in names.values()}, (family, method)
        for name, module in layers.items():
            base = names[f"{name}.weight_packed"].removesuffix(".weight_packed")
            local = {k[len(base) + 1:]: v for k, v in tensors.items() if k.startswith(base + ".weight")}
            decoded = NVFP4PackedCompressor.decompress(local, group)["weight"]
            assert torch.equal(decoded, module.dequantized_weight(torch.bfloat16)), (family, method, name)


def test_deepseek_v3_names_are_save_pretrained_names_with_the_packed_triple(smoothed, tmp_path):
    from safetensors import safe_open

    out, _ = smoothed[("deepseek_v3", "awq")]
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        ours = set(handle.keys())
    plain = _save_pretrained_names("deepseek_v3", tmp_path)
    packed = {n.removesuffix(".weight_packed") for n in ours if n.endswith(".weight_packed")}
    assert {f"{b}.weight" for b in packed} <= plain
    triple = {f"{b}.{t}" for b in packed for t in ("weight_packed", "weight_scale", "weight_global_scale")}
    assert ours == (plain - {f"{b}.weight" for b in packed}) | triple
    for part in ("self_attn.q_a_proj", "self_attn.kv_b_proj", "mlp.experts.3.down_proj", "mlp.shared_experts.up_proj"):
        assert f"model.layers.1.{part}.weight_packed" in ours, part


# A fixed subset of the registered causal-LM types not in test_any_model, through the sweep's own
# per-type check (RTN: quantize, save, load, the same logits): dense families, an MoE one (OLMoE),
# one whose model code reads a quantized linear's ``weight`` (HunYuan-MoE) and one whose blocks
# return a tuple the model unpacks (RWKV). All types: ``python benchmarks/model_types_sweep.py``.
SWEEP_SUBSET = ["cohere", "gemma2", "stablelm", "starcoder2", "olmoe", "hunyuan_v1_moe", "rwkv"]


@pytest.mark.parametrize("model_type", SWEEP_SUBSET)
def test_registered_model_types_quantize_save_and_load(model_type):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from model_types_sweep import check_type
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny models (see ``smoothed``)
    try:
        result = check_type(model_type, methods=("rtn",))   # (GPTQ: the full sweep and test_any_model)
    finally:
        torch.set_num_threads(threads)
    assert result["ok"], result
    routers = [name for name, why in result["kept"].items() if why.startswith("MoE router")]
    if model_type in ("olmoe", "hunyuan_v1_moe"):   # HunYuan's router sits one level down: mlp.gate.wg
        assert len(routers) == 2, result["kept"]   # one a layer, kept in high precision


def test_a_quantized_linear_reads_as_its_decoded_weight_without_holding_it():
    """HunYuan-MoE and Ergo read ``linear.weight.dtype`` in their forward: NVFP4Linear's ``weight`` is
    the decoded weight (shape, dtype, device), never a parameter or buffer (checkpoints keep the packed
    triple only), and cannot be assigned."""
    from fp4ptq.nvfp4 import quantize as nvfp4_quantize

    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    layer = NVFP4Linear.from_quantized(nvfp4_quantize(w), dtype=torch.float32)
    assert torch.equal(layer.weight, layer.dequantized_weight()) and layer.weight.dtype == torch.float32
    assert set(layer.state_dict()) == {"weight_packed", "weight_scale", "weight_global_scale"}
    assert not any(n.endswith("weight") for n, _ in layer.named_parameters())
    with pytest.raises((AttributeError, KeyError)):
        layer.weight = torch.nn.Parameter(w)
    with pytest.raises(AttributeError):
        layer.weight = w
