"""``AutoModelForCausalLM.from_pretrained`` on NVFP4 checkpoints after ``import fp4ptq``,
and how our quantizer shares transformers' "compressed-tensors" entry."""
from __future__ import annotations

import json

import pytest
import torch

import fp4ptq
from fp4ptq import checkpoint, hf
from fp4ptq.modules import NVFP4Linear

from test_checkpoint import quantized_llama, tiny_tokenizer, tokens

pytest.importorskip("compressed_tensors")   # transformers parses the config with it
from transformers import AutoModelForCausalLM, CompressedTensorsConfig  # noqa: E402
from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:save. no tokenizer given")


@pytest.fixture(scope="module")
def w4a4(tmp_path_factory):
    model = quantized_llama("w4a4", four_six="mae")
    path = fp4ptq.save(model, tmp_path_factory.mktemp("hf") / "w4a4", tokenizer=tiny_tokenizer())
    return model, path


def test_import_fp4ptq_registers_the_quantizer():
    assert hf.is_registered()


def test_import_stays_light_and_the_hook_registers_when_transformers_loads_its_quantizers():
    import subprocess
    import sys

    code = ("import sys, fp4ptq\n"
            "assert 'transformers.quantizers.auto' not in sys.modules, 'import fp4ptq loaded the table'\n"
            "from transformers import AutoModelForCausalLM\n"
            "AutoModelForCausalLM.from_pretrained\n"         # transformers' lazy modules load it here
            "import transformers.modeling_utils\n"
            "from transformers.quantizers import auto\n"
            "print(auto.AUTO_QUANTIZER_MAPPING['compressed-tensors'].__name__)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "dispatch_quantizer"


def test_from_pretrained_builds_nvfp4_layers_with_identical_logits(w4a4):
    model, path = w4a4
    # config.json says bfloat16 (what stock compressed-tensors runs NVFP4 in); the tensors are stored in
    # the model's float32, which fp4ptq.load computes in by default.
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    layers = checkpoint.nvfp4_layers(loaded)
    assert len(layers) == 14 and isinstance(loaded.model.layers[1].mlp.down_proj, NVFP4Linear)
    assert {(m.scheme, m.act_four_six) for m in layers.values()} == {("w4a4", "mae")}
    assert type(loaded.hf_quantizer) is hf.FP4PTQHfQuantizer
    for name, layer in checkpoint.nvfp4_layers(model).items():
        assert torch.equal(layers[name].weight_packed, layer.weight_packed)
        assert torch.equal(layers[name].input_global_scale, layer.input_global_scale)
    assert loaded.fp4ptq_info["config"]["four_six"] == "mae"
    with torch.no_grad():
        expected = model(tokens()).logits
        assert torch.equal(loaded(tokens()).logits, expected)
        assert torch.equal(fp4ptq.load(path, device="cpu")(tokens()).logits, expected)


def test_from_pretrained_fuses_the_projection_groups_when_the_layers_load_onto_cuda(w4a4, monkeypatch):
    """As ``fp4ptq.load`` does by default: q/k/v and gate/up run as one GEMM a group where device_map put
    every NVFP4 layer on CUDA, one GPU or several (stood in for here), with the unfused logits; not where
    a layer stayed on the CPU or was offloaded (meta), nor on the CPU."""
    model, path = w4a4
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert loaded.fp4ptq_fusion is None and checkpoint.layers_devices(loaded) == {torch.device("cpu")}
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    for devices, fuses in (({cuda0}, True), ({cuda0, cuda1}, True), ({cuda0, torch.device("cpu")}, False),
                           ({cuda0, torch.device("meta")}, False), (set(), False)):
        monkeypatch.setattr(checkpoint, "layers_devices", lambda m, devices=devices: devices)
        assert (checkpoint.fusion_device(loaded) == torch.device("cuda")) is fuses, devices
    monkeypatch.setattr(checkpoint, "layers_devices", lambda m: {cuda0, cuda1})
    fused = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert fused.fp4ptq_fusion == {"fused": 4, "skipped": {}}
    assert sum(m._fused is not None for m in checkpoint.nvfp4_layers(fused).values()) == 10
    with torch.no_grad():
        torch.testing.assert_close(fused(tokens()).logits, model(tokens()).logits, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    assert checkpoint.layers_devices(torch.nn.Linear(2, 2)) == set()  # no NVFP4 layer


def test_a_model_from_from_pretrained_saves_back_to_the_same_tensors(w4a4, tmp_path):
    _, path = w4a4
    again = fp4ptq.save(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tmp_path / "again")
    from safetensors.torch import load_file

    first, second = load_file(str(path / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k].view(torch.uint8), second[k].view(torch.uint8)) for k in first)
    config = json.loads((again / "config.json").read_text())
    assert config["quantization_config"] == json.loads((path / "config.json").read_text())["quantization_config"]


def test_dispatch_keeps_transformers_quantizer_for_other_schemes_and_for_dequantize(w4a4):
    _, path = w4a4
    nvfp4_dict = json.loads((path / "config.json").read_text())["quantization_config"]
    assert type(hf.dispatch_quantizer(CompressedTensorsConfig.from_dict(nvfp4_dict))) is hf.FP4PTQHfQuantizer
    asked = CompressedTensorsConfig.from_dict(nvfp4_dict)
    asked.dequantize = True
    assert type(hf.dispatch_quantizer(asked)) is CompressedTensorsHfQuantizer
    fp8 = CompressedTensorsConfig(config_groups={"FP8_DYNAMIC": ["Linear"]},
                                  format="float-quantized", quantization_status="compressed")
    assert type(hf.dispatch_quantizer(fp8)) is CompressedTensorsHfQuantizer
    # The per-call way back to transformers' behaviour: dense, dequantized weights.
    dense = AutoModelForCausalLM.from_pretrained(path, quantization_config=CompressedTensorsConfig(dequantize=True))
    assert not checkpoint.nvfp4_layers(dense)


def test_unregister_and_the_context_manager_restore_transformers_entry():
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    with hf.stock_compressed_tensors():
        assert AUTO_QUANTIZER_MAPPING["compressed-tensors"] is CompressedTensorsHfQuantizer
    assert hf.is_registered()
    hf.unregister()
    try:
        assert AUTO_QUANTIZER_MAPPING["compressed-tensors"] is CompressedTensorsHfQuantizer
        hf.register()
        hf.register()                                      # idempotent
        assert hf.is_registered()
        hf.unregister()
        assert AUTO_QUANTIZER_MAPPING["compressed-tensors"] is CompressedTensorsHfQuantizer
    finally:
        hf.register()


def test_from_pretrained_reports_a_config_tensor_mismatch(w4a4, tmp_path):
    import shutil

    _, path = w4a4
    bad = shutil.copytree(path, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["ignore"].append("model.layers.0.mlp.up_proj")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(checkpoint.CheckpointError, match=r"config and tensors do not match.*up_proj"):
        AutoModelForCausalLM.from_pretrained(bad)
