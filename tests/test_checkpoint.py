"""Packed NVFP4 checkpoints: round trips, interop with compressed-tensors and
transformers, the ModelOpt export, atomic writes and bad-checkpoint errors.

Everything runs on a tiny random Llama built here (tied embeddings, GQA) and
quantized with fp4ptq's RTN (+ Four Over Six); no network, no GPU.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

import fp4ptq
from fp4ptq import checkpoint, nvfp4
from fp4ptq.checkpoint import CheckpointError
from fp4ptq.modules import NVFP4Linear

VOCAB = 256
# Most checkpoints here are saved without a tokenizer on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:save. no tokenizer given")


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def quantized_llama(scheme: str = "w4a16", four_six: str | None = "mse", seed: int = 0) -> LlamaForCausalLM:
    model = tiny_llama(seed)
    calib = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(seed))
    config = fp4ptq.QuantConfig(method="rtn", four_six=four_six, scheme=scheme, nsamples=4, seqlen=32)
    return fp4ptq.quantize(model, config, calib, progress=False)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{scheme: (in-memory model, checkpoint dir)}`` for W4A16 and W4A4, both RTN + 4/6 (MSE)."""
    out = {}
    for scheme in ("w4a16", "w4a4"):
        model = quantized_llama(scheme)
        path = tmp_path_factory.mktemp("ckpt") / scheme
        fp4ptq.save(model, path, tokenizer=tiny_tokenizer())
        out[scheme] = (model, path)
    return out


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------- #
# Round trips
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
def test_round_trip_gives_bit_identical_packed_tensors_and_identical_logits(saved, scheme):
    model, path = saved[scheme]
    loaded = fp4ptq.load(path, device="cpu")
    layers, loaded_layers = checkpoint.nvfp4_layers(model), checkpoint.nvfp4_layers(loaded)
    assert list(layers) == list(loaded_layers) and len(layers) == 14
    for name, layer in layers.items():
        other = loaded_layers[name]
        assert other.scheme == scheme and other.act_four_six == layer.act_four_six
        for buffer in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
            a, b = getattr(layer, buffer), getattr(other, buffer)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, buffer)
    assert type(loaded.lm_head) is torch.nn.Linear
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight       # tie restored
    with torch.no_grad():
        assert torch.equal(model(tokens()).logits, loaded(tokens()).logits)
    assert loaded.fp4ptq_info["layers"] == json.loads(json.dumps(model.fp4ptq_info))["layers"]


def test_load_with_another_dtype_keeps_packed_tensors_and_casts_the_rest(saved):
    model, path = saved["w4a16"]
    loaded = fp4ptq.load(path, dtype=torch.bfloat16)     # default device: CPU here (CUDA when available)
    layer = loaded.model.layers[0].mlp.down_proj
    assert layer.dtype == torch.bfloat16 and loaded.model.norm.weight.dtype == torch.bfloat16
    assert torch.equal(layer.weight_packed, model.model.layers[0].mlp.down_proj.weight_packed)
    with torch.no_grad():
        assert loaded(tokens()).logits.dtype == torch.bfloat16


def test_load_fuses_the_projection_groups_on_cuda_or_when_asked(saved):
    """``fp4ptq.load`` runs q/k/v and gate/up as one GEMM a group by default on CUDA (``fuse=True``
    anywhere), with the unfused model's logits; not on the CPU by default, and not with ``fuse=False``."""
    _, path = saved["w4a4"]

    def fused_layers(model):
        return sum(isinstance(m, NVFP4Linear) and m._fused is not None for m in model.modules())

    plain = fp4ptq.load(path)  # the CPU here
    assert plain.fp4ptq_fusion is None and fused_layers(plain) == 0
    fused = fp4ptq.load(path, fuse=True)
    assert fused.fp4ptq_fusion == {"fused": 4, "skipped": {}} and fused_layers(fused) == 10
    with torch.no_grad():
        torch.testing.assert_close(fused(tokens()).logits, plain(tokens()).logits, rtol=1e-5, atol=1e-5)
    # the default decides by device: CUDA fuses, an architecture without a table loads unfused
    assert checkpoint._fuse(plain, None, torch.device("cuda")) == {"fused": 4, "skipped": {}}
    assert checkpoint._fuse(fp4ptq.load(path), False, torch.device("cuda")) is None
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert checkpoint._fuse(other, None, torch.device("cuda")) is None
    from fp4ptq.models import UnsupportedArchitecture
    with pytest.raises(UnsupportedArchitecture):
        checkpoint._fuse(other, True, torch.device("cpu"))


def test_saved_directory_has_config_report_tokenizer_and_generation_config(saved):
    model, path = saved["w4a4"]
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "fp4ptq_report.json", "generation_config.json",
            "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((path / "config.json").read_text())
    assert config["fp4ptq"]["act_four_six"] == "mse" and config["fp4ptq"]["dtype"] == "float32"
    assert config["dtype"] == "bfloat16"   # what compressed-tensors runs NVFP4 in (stock loaders read it)
    assert config["architectures"] == ["LlamaForCausalLM"]
    mode = (path / "config.json").stat().st_mode & 0o777
    assert (path / "model.safetensors").stat().st_mode & 0o777 == mode and (path.stat().st_mode & 0o777) != 0o700
    report = json.loads((path / "fp4ptq_report.json").read_text())
    assert report["config"]["method"] == "rtn" and report["config"]["four_six"] == "mse"
    assert report["calibration"]["nsamples"] == 4
    layer = report["layers"]["model.layers.0.self_attn.q_proj"]
    assert 0 < layer["rel_error"] < 0.2 and 0 < layer["four_share"] < 1
    ck = report["checkpoint"]
    assert ck["format"] == "compressed-tensors" and ck["fused_global_scales"] == "shared"
    assert ck["file_bytes"] == (path / "model.safetensors").stat().st_size
    quant = sum(m.in_features * m.out_features for m in checkpoint.nvfp4_layers(model).values())
    assert ck["tensor_bytes"]["packed_weights"] == quant // 2
    # 4 bits per weight + one e4m3 scale per 16 (+ two fp32 scalars per layer)
    assert 4.5 < ck["tensor_bytes"]["bits_per_quantized_weight"] < 4.6


def test_mixed_schemes_get_one_config_group_each_and_round_trip(tmp_path):
    model = quantized_llama("w4a4", seed=5)
    down = model.model.layers[1].mlp.down_proj          # not fused: may differ in scheme
    model.model.layers[1].mlp.down_proj = NVFP4Linear.from_quantized(down.quantized_weight(), scheme="w4a16")
    path = fp4ptq.save(model, tmp_path / "mixed")
    groups = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]
    by_inputs = {g["input_activations"] is None: g["targets"] for g in groups.values()}
    assert len(groups) == 2 and by_inputs[True] == ["model.layers.1.mlp.down_proj"] and len(by_inputs[False]) == 13
    loaded = fp4ptq.load(path, device="cpu")
    mlp = loaded.model.layers[1].mlp
    assert mlp.down_proj.scheme == "w4a16" and mlp.up_proj.scheme == "w4a4"
    with torch.no_grad():
        assert torch.equal(model(tokens()).logits, loaded(tokens()).logits)
    with pytest.raises(CheckpointError, match="mixes schemes"):
        fp4ptq.save(model, tmp_path / "modelopt", format="modelopt")


def test_sharding_respects_max_shard_size_and_writes_an_index(tmp_path):
    model = quantized_llama("w4a16", seed=2)
    path = fp4ptq.save(model, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((path / checkpoint.INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and not (path / checkpoint.SINGLE_FILE).exists()
    for shard in shards:
        with safe_open(str(path / shard), "pt") as handle:
            sizes = [handle.get_tensor(k).numel() * handle.get_tensor(k).element_size() for k in handle.keys()]
        assert sum(sizes) <= 20_000 or len(sizes) == 1   # a tensor larger than the limit gets its own shard
    loaded = fp4ptq.load(path, device="cpu")
    with torch.no_grad():
        assert torch.equal(model(tokens()).logits, loaded(tokens()).logits)


# --------------------------------------------------------------------------- #
# compressed-tensors interop
# --------------------------------------------------------------------------- #
def test_quantization_config_keys_are_compressed_tensors_own(saved):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    for scheme, preset in (("w4a16", "NVFP4A16"), ("w4a4", "NVFP4")):
        ours = json.loads((saved[scheme][1] / "config.json").read_text())["quantization_config"]
        parsed = QuantizationConfig.model_validate(ours)
        # Every key we write is one compressed-tensors has, with the value it reads back.
        assert parsed.model_dump(mode="json") == {k: v for k, v in ours.items()}, ct.__version__
        # The group is exactly the package's own preset for this scheme (the package's own dump).
        preset_group = preset_name_to_scheme(preset, ["Linear"]).model_dump(mode="json")
        group = dict(ours["config_groups"]["group_0"])
        assert group.pop("format") == "nvfp4-pack-quantized"
        preset_group.pop("format")
        assert group == preset_group
        assert ours["ignore"] == ["lm_head"] and ours["format"] == "nvfp4-pack-quantized"


@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
def test_compressed_tensors_decompressor_gives_our_dequantized_weights_bit_for_bit(saved, scheme):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    model, path = saved[scheme]
    qcfg = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    group = qcfg.config_groups["group_0"]
    tensors = load_file(str(path / "model.safetensors"))
    for name, layer in checkpoint.nvfp4_layers(model).items():
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        decoded = NVFP4PackedCompressor.decompress(local, group)["weight"]
        # The decompressor's default output dtype is bf16 (its unpack default).
        assert decoded.dtype == torch.bfloat16
        assert torch.equal(decoded, layer.dequantized_weight(torch.bfloat16)), name


def test_transformers_own_compressed_tensors_quantizer_reads_our_checkpoint(saved):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model, path = saved["w4a16"]
    with fp4ptq.hf.stock_compressed_tensors():
        dense = AutoModelForCausalLM.from_pretrained(path, quantization_config=CompressedTensorsConfig(dequantize=True))
    for name, layer in checkpoint.nvfp4_layers(model).items():
        weight = dense.get_submodule(name).weight
        assert type(dense.get_submodule(name)) is torch.nn.Linear
        assert torch.equal(weight, layer.dequantized_weight(torch.bfloat16).to(weight.dtype)), name


def write_with_compressed_tensors(path: Path) -> None:
    """A tiny Llama quantized, compressed and saved by compressed-tensors itself
    (the llm-compressor flow: observers -> ModelCompressor -> save_pretrained + update_config)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    model = tiny_llama(seed=3).to(torch.bfloat16)
    qcfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("NVFP4A16", ["Linear"])},
                              ignore=["lm_head"])
    apply_quantization_config(model, qcfg, show_progress=False)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        weight = module.weight.data.float()
        global_scale = generate_gparam(weight.min(), weight.max())
        blocks = weight.unflatten(-1, (-1, 16))
        scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), module.quantization_scheme.weights,
                                     global_scale=global_scale)
        module.weight_scale.data.copy_(scale)
        module.weight_global_scale.data.copy_(global_scale)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="nvfp4-pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))


def test_checkpoint_written_by_compressed_tensors_loads_with_identical_outputs(tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    path = tmp_path / "ct"
    write_with_compressed_tensors(path)
    ours = fp4ptq.load(path, device="cpu")
    assert len(checkpoint.nvfp4_layers(ours)) == 14 and ours.model.layers[0].mlp.up_proj.dtype == torch.bfloat16
    files = load_file(str(path / "model.safetensors"))
    for name, layer in checkpoint.nvfp4_layers(ours).items():
        assert torch.equal(layer.weight_packed, files[f"{name}.weight_packed"])
    # Reference: transformers + compressed-tensors decompress the same files to dense bf16 weights.
    with fp4ptq.hf.stock_compressed_tensors():
        dense = AutoModelForCausalLM.from_pretrained(path, quantization_config=CompressedTensorsConfig(dequantize=True))
    with torch.no_grad():
        assert torch.equal(ours(tokens()).logits, dense(tokens()).logits)


# --------------------------------------------------------------------------- #
# ModelOpt export
# --------------------------------------------------------------------------- #
def test_modelopt_export_decodes_to_the_same_weights(saved, tmp_path):
    model, _ = saved["w4a4"]
    path = fp4ptq.save(model, tmp_path / "modelopt", format="modelopt")
    hf_quant = json.loads((path / "hf_quant_config.json").read_text())
    assert hf_quant["producer"]["name"] == "fp4ptq"
    assert hf_quant["quantization"] == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                        "exclude_modules": ["lm_head"]}
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    tensors = load_file(str(path / "model.safetensors"))
    for name, layer in checkpoint.nvfp4_layers(model).items():
        packed, block_scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
        weight_scale_2, input_scale = tensors[f"{name}.weight_scale_2"], tensors[f"{name}.input_scale"]
        assert f"{name}.weight_packed" not in tensors and weight_scale_2.dtype == torch.float32
        assert torch.equal(packed, layer.weight_packed)                       # same nibble order
        assert torch.equal(block_scale.view(torch.uint8), layer.weight_scale.view(torch.uint8))
        # ModelOpt decodes with multipliers: q * block_scale * weight_scale_2.
        codes = nvfp4.e2m1_decode(nvfp4.unpack_codes(packed)).view(layer.out_features, -1, 16)
        decoded = (codes * block_scale.float().unsqueeze(-1)).flatten(1) * weight_scale_2
        ours = layer.dequantized_weight(torch.float32)
        # One fp32 reciprocal apart from our divisor form: within 2 ulp.
        assert torch.allclose(decoded, ours, rtol=2.0 ** -22, atol=0), name
        amax = layer.input_amax()
        assert torch.allclose(input_scale, amax / (6 * 448), rtol=2.0 ** -22)


def test_modelopt_tensors_convert_back_through_compressed_tensors(saved, tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter

    model, _ = saved["w4a4"]
    path = fp4ptq.save(model, tmp_path / "modelopt", format="modelopt")
    converted = ModelOptNvfp4Converter(ignore=["lm_head"], targets=["re:.*_proj$"]).process(
        load_file(str(path / "model.safetensors")))
    for name, layer in checkpoint.nvfp4_layers(model).items():
        assert torch.equal(converted[f"{name}.weight_packed"], layer.weight_packed)
        assert torch.allclose(converted[f"{name}.weight_global_scale"].reshape(1), layer.weight_global_scale,
                              rtol=2.0 ** -22)


def test_modelopt_export_of_w4a16_names_its_algorithm(saved, tmp_path):
    model, _ = saved["w4a16"]
    path = fp4ptq.save(model, tmp_path / "modelopt", format="modelopt")
    assert json.loads((path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "W4A16_NVFP4"
    assert not any(k.endswith("input_scale") for k in load_file(str(path / "model.safetensors")))
    with pytest.raises(CheckpointError, match="ModelOpt export"):
        fp4ptq.load(path, device="cpu")


# --------------------------------------------------------------------------- #
# Safe writes
# --------------------------------------------------------------------------- #
def test_existing_non_empty_directory_is_an_error_unless_overwrite(saved, tmp_path):
    model, _ = saved["w4a16"]
    target = tmp_path / "out"
    target.mkdir()
    fp4ptq.save(model, target)                  # an empty directory is fine
    before = (target / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(CheckpointError, match="overwrite=True"):
        fp4ptq.save(model, target)
    assert (target / "model.safetensors").stat().st_mtime_ns == before
    (target / "stale.txt").write_text("from an older run")
    fp4ptq.save(model, target, overwrite=True)
    assert not (target / "stale.txt").exists() and (target / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]      # no partial / replaced dirs left


def test_unknown_format_and_unquantized_model_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        fp4ptq.save(tiny_llama(), tmp_path / "x", format="gguf")
    with pytest.raises(CheckpointError, match="no NVFP4Linear"):
        fp4ptq.save(tiny_llama(), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_fused_layers_must_share_one_global_scale(tmp_path):
    model = tiny_llama()
    for name in (f"model.layers.0.self_attn.{p}_proj" for p in "qkv"):
        linear = model.get_submodule(name)
        layer = NVFP4Linear.from_quantized(nvfp4.quantize(linear.weight.data))   # each its own amax
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, layer)
    with pytest.raises(CheckpointError, match=r"share one weight global scale.*self_attn"):
        fp4ptq.save(model, tmp_path / "x")
    path = fp4ptq.save(model, tmp_path / "x", check_fused_scales=False)
    report = json.loads((path / "fp4ptq_report.json").read_text())
    assert report["checkpoint"]["fused_global_scales"].startswith("NOT shared")
    assert report["layers"]["model.layers.0.self_attn.q_proj"]["rel_error"] is None   # no fp4ptq_info
    loaded = fp4ptq.load(path, device="cpu")
    with torch.no_grad():
        assert torch.equal(model(tokens()).logits, loaded(tokens()).logits)


KILLED_SAVE = textwrap.dedent("""
    import sys, time, torch
    import safetensors.torch
    sys.path.insert(0, {tests!r})
    from test_checkpoint import quantized_llama
    import fp4ptq

    real_save_file = safetensors.torch.save_file
    def slow_save_file(*args, **kwargs):   # write one shard, then hang until killed
        real_save_file(*args, **kwargs)
        print("SHARD WRITTEN", flush=True)
        time.sleep(120)
    safetensors.torch.save_file = slow_save_file
    fp4ptq.save(quantized_llama("w4a16"), {target!r}, max_shard_size="20KB")
""")


def kill_a_save_mid_write(target: Path, sig: int) -> int:
    """Run a save into ``target`` in a child process, send it ``sig`` once a shard is written; its
    return code."""
    script = KILLED_SAVE.format(tests=str(Path(__file__).parent), target=str(target))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in child.stdout:
            if "SHARD WRITTEN" in line:
                break
        else:
            pytest.fail(f"the child never wrote a shard: {child.stderr.read()[-2000:]}")
        os.kill(child.pid, sig)
    finally:
        child.wait(timeout=60)
    return child.returncode


def test_a_save_killed_mid_write_leaves_no_complete_looking_directory(tmp_path):
    target = tmp_path / "ckpt"
    assert kill_a_save_mid_write(target, signal.SIGKILL) == -signal.SIGKILL
    assert not target.exists()
    leftovers = list(tmp_path.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".ckpt.partial-")
    assert any(leftovers[0].glob("*.safetensors")) and not (leftovers[0] / "config.json").exists()
    with pytest.raises(CheckpointError, match="not a directory"):
        fp4ptq.load(target)
    fp4ptq.save(quantized_llama("w4a16"), target)        # a later save is not blocked by the leftover
    assert (target / "config.json").is_file()


# --------------------------------------------------------------------------- #
# Bad checkpoints
# --------------------------------------------------------------------------- #
def rewrite(path: Path, edit) -> None:
    """Apply ``edit(tensors) -> tensors`` to a single-file checkpoint."""
    file = path / "model.safetensors"
    save_file(edit(load_file(str(file))), str(file), metadata={"format": "pt"})


def edit_config(path: Path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


Q = "model.layers.1.self_attn.q_proj"


def drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def replace(name, value):
    return lambda t: {**t, name: value(t[name])}


BAD_TENSORS = {
    "missing scale": (drop(f"{Q}.weight_scale"), r"missing tensor.*q_proj\.weight_scale"),
    "missing norm": (drop("model.norm.weight"), r"missing tensor.*model\.norm\.weight"),
    "fp32 block scales": (replace(f"{Q}.weight_scale", lambda v: v.float()), r"weight_scale is F32.*float8_e4m3fn"),
    "wrong packed shape": (replace(f"{Q}.weight_packed", lambda v: v[:, :-2].contiguous()),
                           r"weight_packed has shape \[64, 30\].*\[64, 32\]"),
    "unexpected tensor": (lambda t: {**t, "model.extra.weight": torch.zeros(3)}, r"unexpected tensor.*model\.extra"),
    "int embedding": (replace("model.embed_tokens.weight", lambda v: v.to(torch.int32)),
                      r"embed_tokens\.weight is I32"),
    "packed weights the config does not quantize": (
        lambda t: {**{k: v for k, v in t.items() if k != "lm_head.weight"},
                   "lm_head.weight_packed": torch.zeros(VOCAB, 32, dtype=torch.uint8)},
        r"packed weights for \['lm_head'\] which the config does not quantize"),
    "w4a16 file with an input scale": (lambda t: {**t, f"{Q}.input_global_scale": torch.ones(1)},
                                       r"W4A16 in the config but the files hold an input_global_scale"),
}


BAD_CONFIGS = {
    "8-bit weights": (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=8),
                     r"weights\.num_bits = 8"),
    "w4a4 claimed": (lambda c: c["quantization_config"]["config_groups"]["group_0"].update(
        input_activations=dict(checkpoint.CT_INPUT_ARGS)), r"W4A4 in the config but no input_global_scale"),
    "layer ignored": (lambda c: c["quantization_config"]["ignore"].append(Q),
                      r"packed weights for \['model\.layers\.1\.self_attn\.q_proj'\]"),
    "extra target": (lambda c: c["quantization_config"]["ignore"].clear(),
                     r"config quantizes \['lm_head'\] but the files have no weight_packed"),
    "other method": (lambda c: c["quantization_config"].update(quant_method="gptq"), r"quant_method 'gptq'"),
    "kv cache": (lambda c: c["quantization_config"].update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    "not quantized": (lambda c: c.pop("quantization_config"), "no quantization_config"),
    "unknown model type": (lambda c: c.update(model_type="not-a-model"), r"unsupported model type"),
}


BAD_CHECKPOINTS = {
    **{f"tensors: {case}": (rewrite, edit, message) for case, (edit, message) in BAD_TENSORS.items()},
    **{f"config: {case}": (edit_config, edit, message) for case, (edit, message) in BAD_CONFIGS.items()},
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_tensors_and_mismatched_configs_raise_a_clear_error(saved, tmp_path, case):
    apply, edit, message = BAD_CHECKPOINTS[case]
    path = copy_checkpoint(saved["w4a16"][1], tmp_path / "bad")
    apply(path, edit)
    with pytest.raises(CheckpointError, match=message):
        fp4ptq.load(path, device="cpu")


def test_truncated_and_missing_files_are_detected_not_crashed_into(saved, tmp_path):
    path = copy_checkpoint(saved["w4a16"][1], tmp_path / "bad")
    file = path / "model.safetensors"
    size = file.stat().st_size
    with open(file, "r+b") as handle:
        handle.truncate(size - 100)
    with pytest.raises(CheckpointError, match=r"truncated: the header says the file holds \d+ bytes.*100 missing"):
        fp4ptq.load(path, device="cpu")
    with open(file, "r+b") as handle:
        handle.truncate(50)
    with pytest.raises(CheckpointError, match="truncated"):
        fp4ptq.load(path, device="cpu")
    file.write_bytes(struct.pack("<Q", 5) + b"{oops")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        fp4ptq.load(path, device="cpu")
    file.unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        fp4ptq.load(path, device="cpu")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        fp4ptq.load(path, device="cpu")


def test_a_shard_missing_from_a_sharded_checkpoint_is_named(tmp_path):
    path = fp4ptq.save(quantized_llama("w4a16", seed=4), tmp_path / "sharded", max_shard_size="20KB")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"lists shard\(s\) \['{shard.name}'\]"):
        fp4ptq.load(path, device="cpu")
