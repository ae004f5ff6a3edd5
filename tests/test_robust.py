"""Issue 40: our checkpoints run under stock transformers + compressed-tensors, every damaged input
gets its exit code (with a message naming what and where, no traceback, nothing lost), saves are
byte-reproducible and verified, and the checks run before any model loads.

Everything runs on tiny random Llamas built here; the only subprocesses are the stock-transformers
loader (which must never import fp4ptq), a save killed mid-write, and a CLI quantize run in a fresh process
(compared byte for byte with one in this process). The README quick start on the demo model runs only
with FP4PTQ_SLOW=1.
"""
from __future__ import annotations

import hashlib
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

import fp4ptq
from fp4ptq import checkpoint, cli
from fp4ptq.checkpoint import CheckpointError
from test_checkpoint import kill_a_save_mid_write, quantized_llama, tiny_tokenizer, tokens
from test_eval_perplexity import build_model, build_tokenizer, write_data_dir

pytestmark = pytest.mark.filterwarnings("ignore:save. no tokenizer given")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """W4A16, W4A4 and a checkpoint saved from a model whose q/k/v and gate/up run fused."""
    root = tmp_path_factory.mktemp("robust")
    out = {}
    for name, scheme, four_six in (("w4a16", "w4a16", "mse"), ("w4a4", "w4a4", None)):
        out[name] = fp4ptq.save(quantized_llama(scheme, four_six), root / name, tokenizer=tiny_tokenizer())
    fused = quantized_llama("w4a16", four_six=None, seed=2)
    report = fp4ptq.fuse_projections(fused)
    assert report["fused"] == 4
    out["fused"] = fp4ptq.save(fused, root / "fused", tokenizer=tiny_tokenizer())
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tiny Hugging Face model directory (what `fp4ptq quantize DIR` reads) and a data dir."""
    root = tmp_path_factory.mktemp("src")
    tok = build_tokenizer(root / "model")
    build_model(len(tok)).save_pretrained(root / "model")
    write_data_dir(root / "data")
    return root


def run_cli(capsys, *argv) -> tuple:
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return code, out.out, out.err


def tree_digest(path: Path) -> dict:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


# --------------------------------------------------------------------------- #
# Interop: stock transformers + compressed-tensors, in a process without fp4ptq
# --------------------------------------------------------------------------- #
STOCK = textwrap.dedent("""
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    ids = torch.tensor(json.loads(sys.argv[1]))
    out = {}
    for path in sys.argv[2:]:
        model = AutoModelForCausalLM.from_pretrained(path)          # default arguments
        with torch.no_grad():
            logits = model(ids).logits.float()
            greedy = model.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)
        out[path] = {"logits": logits.tolist(), "greedy": greedy[0].tolist(), "dtype": str(model.dtype)}
    assert not any(m == "fp4ptq" or m.startswith("fp4ptq.") for m in sys.modules), "fp4ptq was imported"
    print("RESULT " + json.dumps(out))
""")


def test_stock_transformers_runs_every_kind_of_checkpoint_with_default_arguments(ckpts):
    pytest.importorskip("compressed_tensors")
    ids = tokens()
    env = {**os.environ, "FP4PTQ_TRANSFORMERS_HOOK": "0"}
    env.pop("PYTHONPATH", None)   # nothing of this worktree on the path: transformers alone
    run = subprocess.run([sys.executable, "-c", STOCK, json.dumps(ids.tolist()), *map(str, ckpts.values())],
                         capture_output=True, text=True, timeout=300, env=env, cwd="/")
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.split("RESULT ", 1)[1])
    for name, path in ckpts.items():
        stock = results[str(path)]
        assert stock["dtype"] == "torch.bfloat16", name
        ours = fp4ptq.load(path, device="cpu", dtype=torch.bfloat16)
        with torch.no_grad():
            expected = ours(ids).logits.float()
            greedy = ours.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)
        # bf16 tolerance: the same dequantized weights, other bf16 matmul kernels
        assert stock["greedy"] == greedy[0].tolist(), name
        if name.startswith("w4a4"):
            # the same activation codes and scales (the test below), but compressed-tensors rounds the
            # dequantized activations to bf16 before its matmul: same tokens, logits close on average
            # (measured: max |diff| 0.064, mean 0.008, logits ~0.13 on average)
            error = (torch.tensor(stock["logits"]) - expected).abs().mean() / expected.abs().mean()
            assert error < 0.1, (name, error)
        else:   # the same dequantized bf16 weights: bf16 tolerance (measured: identical)
            torch.testing.assert_close(torch.tensor(stock["logits"]), expected, rtol=0.02, atol=0.02)


def test_compressed_tensors_quantizes_activations_to_our_codes_and_scales():
    """Why stock W4A4 logits are close rather than equal: compressed-tensors' own activation quantizer
    (the scheme our checkpoints declare, dynamic local block scales under the stored input global scale)
    gives nvfp4.py's codes and scales on bf16 activations, bit for bit; it then rounds the dequantized
    activation to bf16 before its matmul, where fp4ptq keeps the exact products, and that rounding
    difference compounds through the layers."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    from fp4ptq import nvfp4

    args = preset_name_to_scheme("NVFP4", ["Linear"]).input_activations
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(128, 256, generator=g) * torch.rand(128, 1, generator=g) * 3).to(torch.bfloat16)
    x[0, :16] = 0.0                                                    # an all-zero block
    amax = torch.tensor(8.0)
    enc = nvfp4.global_encode_scale(amax, False).reshape(1)
    scale, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Linear(1, 1), global_scale=enc)
    theirs = fake_quantize(x=x, scale=scale, zero_point=zp, args=args, global_scale=enc)
    ours = nvfp4.quantize(x, None, amax=amax)
    nonzero = x.float().abs().reshape(128, 16, 16).amax(-1) > 0       # (an all-zero block: their scale is
    theirs_scale = scale.float().reshape(ours.block_scale.shape)      # FP8's smallest, ours 0; both decode to 0)
    assert torch.equal(theirs_scale[nonzero], ours.block_scale.float()[nonzero])
    assert torch.equal(theirs, ours.dequantize(torch.bfloat16))


def test_unquantized_tensors_keep_the_source_dtype_and_dtype_overrides(src, tmp_path, capsys):
    from safetensors import safe_open

    model_dir = tmp_path / "bf16-src"
    shutil.copytree(src / "model", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = "bfloat16"                                # a source stored in bf16
    (model_dir / "config.json").write_text(json.dumps(config))
    for out, extra, want in ((tmp_path / "a", [], torch.bfloat16), (tmp_path / "b", ["--dtype", "float32"], torch.float32)):
        code, stdout, _ = run_cli(capsys, "quantize", model_dir, "-o", out, "--device", "cpu", "-q", *extra)
        assert code == 0 and f"unquantized ones in {str(want).removeprefix('torch.')}" in stdout
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert f.get_tensor("model.embed_tokens.weight").dtype == want
            assert f.get_tensor("model.layers.0.mlp.up_proj.weight_scale").dtype == torch.float8_e4m3fn
        saved = json.loads((out / "config.json").read_text())
        assert saved["dtype"] == "bfloat16" and saved["fp4ptq"]["dtype"] == str(want).removeprefix("torch.")


# --------------------------------------------------------------------------- #
# Damaged inputs: exit 5 with the file and field named, no traceback, nothing lost
# --------------------------------------------------------------------------- #
def test_packed_tensors_without_quantization_config_exit_5_for_every_command(ckpts, src, tmp_path, capsys):
    bad = shutil.copytree(ckpts["w4a16"], tmp_path / "noconfig")
    config = json.loads((bad / "config.json").read_text())
    del config["quantization_config"]
    (bad / "config.json").write_text(json.dumps(config))
    before = tree_digest(bad)
    for argv in (["quantize", bad, "-o", tmp_path / "q"],
                 ["eval", bad, "--data-dir", src / "data", "--seqlen", "32", "-o", tmp_path / "e"],
                 ["inspect", bad, "-o", tmp_path / "i"]):
        code, _, err = run_cli(capsys, *argv, *(["--device", "cpu"] if argv[0] != "inspect" else []))
        assert code == cli.EXIT_UNSUPPORTED, (argv[0], err)
        assert "config.json has no quantization_config" in err and "weight_packed" in err, err
        assert not (tmp_path / argv[argv.index("-o") + 1].name).exists()
    assert tree_digest(bad) == before
    with pytest.raises(CheckpointError, match="no quantization_config"):
        fp4ptq.load(bad, device="cpu")


def _edit_header(file: Path, edit) -> None:
    """Rewrite a safetensors header with ``edit(header)`` (same data section)."""
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


def test_a_header_field_missing_names_the_file_and_the_field(ckpts, tmp_path, capsys):
    bad = shutil.copytree(ckpts["w4a16"], tmp_path / "nodtype")
    file = bad / "model.safetensors"
    _edit_header(file, lambda h: h["model.norm.weight"].pop("dtype"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors header: tensor "
                                              r"'model\.norm\.weight': field 'dtype' is missing"):
        fp4ptq.load(bad, device="cpu")
    code, _, err = run_cli(capsys, "inspect", bad, "-o", tmp_path / "i")
    assert code == cli.EXIT_UNSUPPORTED and "field 'dtype' is missing" in err and str(file) in err


def test_swapped_tensor_offsets_are_caught_by_the_recorded_hashes(ckpts, tmp_path, capsys):
    bad = shutil.copytree(ckpts["w4a16"], tmp_path / "swapped")
    a, b = "model.layers.0.self_attn.q_proj.weight_packed", "model.layers.0.self_attn.o_proj.weight_packed"

    def swap(header):
        header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    _edit_header(bad / "model.safetensors", swap)
    checkpoint.validate(ckpts["w4a16"])   # the original passes
    with pytest.raises(CheckpointError, match=r"integrity check failed.*2 tensor\(s\).*o_proj\.weight_packed"):
        fp4ptq.load(bad, device="cpu", verify=True)
    with pytest.raises(CheckpointError, match="integrity check failed"):
        fp4ptq.load(bad, device="cpu")   # verified by default
    fp4ptq.load(bad, device="cpu", verify=False)   # what every loader did before: accepted silently
    code, _, err = run_cli(capsys, "inspect", bad, "-o", tmp_path / "i")
    assert code == cli.EXIT_UNSUPPORTED and "integrity check failed" in err


INDEX_DAMAGE = {
    "not JSON": lambda: "{not json",
    "a list": lambda: "[]",
    "weight_map a list": lambda: json.dumps({"weight_map": ["model.safetensors"]}),
    "weight_map an int": lambda: json.dumps({"weight_map": 3}),
    "a shard an int": lambda: json.dumps({"weight_map": {"model.norm.weight": 7}}),
}


@pytest.mark.parametrize("damage", sorted(INDEX_DAMAGE))
def test_a_damaged_index_exits_5_naming_the_file_and_the_field(ckpts, tmp_path, capsys, damage):
    bad = shutil.copytree(ckpts["w4a16"], tmp_path / "index")
    index = bad / "model.safetensors.index.json"
    index.write_text(INDEX_DAMAGE[damage]())
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json"):
        fp4ptq.load(bad, device="cpu")
    code, _, err = run_cli(capsys, "inspect", bad, "-o", tmp_path / "i")
    assert code == cli.EXIT_UNSUPPORTED and str(index) in err, err
    assert ("weight_map" in err) == damage.startswith(("weight_map", "a shard")), err


@pytest.mark.parametrize("field,value", [("layers", []), ("high_precision", 3), ("layers", {"x": 1}),
                                         ("checkpoint", "x"), ("config", {"method": 1})])
def test_a_report_field_of_the_wrong_type_exits_5_naming_it(ckpts, tmp_path, capsys, field, value):
    bad = shutil.copytree(ckpts["w4a16"], tmp_path / "report")
    report = json.loads((bad / "fp4ptq_report.json").read_text())
    report[field] = value
    (bad / "fp4ptq_report.json").write_text(json.dumps(report))
    code, _, err = run_cli(capsys, "inspect", bad, "-o", tmp_path / "i")
    assert code == cli.EXIT_UNSUPPORTED, err
    assert "fp4ptq_report.json: field" in err and field in err and "bug" not in err, err


VERIFY_BYPASS = {
    "report deleted": lambda report: None,
    "hashes dropped": lambda report: report["checkpoint"].pop("tensor_xxh3_128"),
    "checkpoint a list": lambda report: report.__setitem__("checkpoint", []),
    "config hash dropped": lambda report: report["checkpoint"].pop("config_quantization_sha256"),
}


@pytest.mark.parametrize("bypass", sorted(VERIFY_BYPASS))
def test_verify_cannot_be_bypassed_by_removing_the_record(ckpts, tmp_path, capsys, bypass):
    """Swapped offsets plus a deleted report / dropped hashes: with config.json's fp4ptq record present,
    that is damage (exit 5), not a checkpoint of another tool."""
    bad = shutil.copytree(ckpts["w4a16"], tmp_path / "bypass")
    a, b = "model.layers.0.self_attn.q_proj.weight_packed", "model.layers.0.self_attn.o_proj.weight_packed"

    def swap(header):
        header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    _edit_header(bad / "model.safetensors", swap)
    file = bad / "fp4ptq_report.json"
    report = json.loads(file.read_text())
    if VERIFY_BYPASS[bypass](report) is None and bypass == "report deleted":
        file.unlink()
    else:
        file.write_text(json.dumps(report))
    with pytest.raises(CheckpointError, match=r"fp4ptq_report\.json"):
        fp4ptq.load(bad, device="cpu", verify=True)
    code, _, err = run_cli(capsys, "inspect", bad, "-o", tmp_path / "i")
    assert code == cli.EXIT_UNSUPPORTED and "fp4ptq_report.json" in err and "not written by" not in err, err


def test_editing_config_fields_outside_quantization_passes_verification(ckpts, src, tmp_path, capsys):
    """A user raising max_position_embeddings is not locked out; an edited quantization field is caught,
    and --no-verify is the escape hatch for eval and inspect."""
    edited = shutil.copytree(ckpts["w4a16"], tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text())
    config["max_position_embeddings"] *= 2
    config["use_cache"] = False
    (edited / "config.json").write_text(json.dumps(config))
    assert checkpoint.validate(edited)["verified"]
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["observer"] = "mse"
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantization fields of config.json differ"):
        fp4ptq.load(edited, device="cpu", verify=True)
    argv = ["eval", edited, "--data-dir", src / "data", "--seqlen", "32", "--max-windows", "1", "--no-word-ppl",
            "--device", "cpu", "-q"]
    code, _, err = run_cli(capsys, *argv, "-o", tmp_path / "e1")
    assert code == cli.EXIT_UNSUPPORTED and "--no-verify" in err, err
    code, _, err = run_cli(capsys, *argv, "-o", tmp_path / "e2", "--no-verify")
    assert code == 0, err
    code, out, _ = run_cli(capsys, "inspect", edited, "-o", tmp_path / "i", "--no-verify")
    assert code == 0 and "hashes not checked (--no-verify)" in out


def test_quantize_refuses_an_output_that_is_inside_or_holds_the_source(src, tmp_path, capsys):
    model_dir = shutil.copytree(src / "model", tmp_path / "parent" / "model")
    before = tree_digest(tmp_path / "parent")
    for output, relation in ((model_dir, "is"), (model_dir / "q", "lies inside"), (tmp_path / "parent", "holds")):
        code, _, err = run_cli(capsys, "quantize", model_dir, "-o", output, "--overwrite", "--device", "cpu")
        assert code == cli.EXIT_USAGE, err
        assert f"-o/--output {output} {relation} the source model {model_dir}" in err and "loading" not in err
    assert tree_digest(tmp_path / "parent") == before


def test_a_gguf_source_stores_bf16():
    from fp4ptq.sources import SourceModel, _stored_dtype

    assert _stored_dtype(SourceModel("x.gguf", "gguf", "/nowhere", "x.gguf"), {}) == "bfloat16"


def test_a_nan_in_a_source_weight_exits_5_naming_the_tensor(src, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    model_dir = shutil.copytree(src / "model", tmp_path / "nan")
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "quantize", model_dir, "-o", tmp_path / "out", "--device", "cpu", "-q")
    assert code == cli.EXIT_UNSUPPORTED
    assert "model.layers.1.mlp.down_proj.weight (1 NaN, 0 Inf)" in err and str(model_dir) in err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- #
# --ignore of one member of a fused group; checks before the model loads
# --------------------------------------------------------------------------- #
def test_ignoring_one_member_of_a_fused_group_keeps_the_group_and_says_so(src, tmp_path, capsys):
    out = tmp_path / "ign"
    code, _, err = run_cli(capsys, "quantize", src / "model", "-o", out, "--device", "cpu", "-q",
                           "--ignore", "lm_head", "--ignore", "model.layers.0.self_attn.k_proj")
    assert code == 0, err
    assert "also keeping 2 layer(s) in high precision, e.g. model.layers.0.self_attn.q_proj, " \
           "model.layers.0.self_attn.v_proj" in err
    report = json.loads((out / "fp4ptq_report.json").read_text())
    assert {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"} <= set(report["high_precision"])
    assert report["checkpoint"]["fused_global_scales"] == "shared"
    code, _, err = run_cli(capsys, "quantize", src / "model", "-o", tmp_path / "x", "--device", "cpu",
                           "--ignore", "model.layers.0.attn.q")
    assert code == cli.EXIT_USAGE and "--ignore model.layers.0.attn.q matches no linear layer" in err
    assert "loading" not in err   # checked on a meta-device skeleton, before the weights load


def test_the_python_api_keeps_a_partly_ignored_fused_group_whole(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    config = fp4ptq.QuantConfig(ignore=("model.layers.0.mlp.up_proj",))
    with pytest.warns(UserWarning, match=r"also keeping 1 layer\(s\) in high precision, e.g. model.layers.0.mlp.gate_proj"):
        fp4ptq.quantize(model, config, progress=False)
    assert {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"} <= set(model.fp4ptq_info["high_precision"])
    fp4ptq.save(model, tmp_path / "c")   # no "fused group not shared" refusal at save


def test_cheap_checks_run_before_the_model_loads(src, tmp_path, capsys):
    code, _, err = run_cli(capsys, "quantize", src / "model", "-o", tmp_path / "o", "--device", "cpu",
                           "--method", "gptq", "--calib", tmp_path / "missing.txt")
    assert code == cli.EXIT_MISSING and "missing.txt" in err and "loading" not in err
    code, _, err = run_cli(capsys, "quantize", src / "model", "-o", tmp_path / "o", "--device", "cpu",
                           "--calib", tmp_path / "missing.txt")   # RTN would not use it: still checked
    assert code == cli.EXIT_MISSING and "loading" not in err
    code, _, err = run_cli(capsys, "eval", tmp_path / "nowhere", "-o", tmp_path / "e", "--device", "cpu")
    assert code == cli.EXIT_MISSING and "loading" not in err


def test_a_model_with_nothing_quantizable_says_why_at_save():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=40, intermediate_size=72, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    fp4ptq.quantize(model, fp4ptq.QuantConfig(), progress=False)
    with pytest.raises(CheckpointError, match="no layer could be quantized: all 8 linears stay in high precision"):
        fp4ptq.save(model, "/nonexistent/never-written")


# --------------------------------------------------------------------------- #
# Leftovers and overwrites
# --------------------------------------------------------------------------- #
def test_leftovers_of_a_killed_save_are_removed_by_the_next_run_with_a_line(tmp_path, caplog):
    target = tmp_path / "ckpt"
    assert kill_a_save_mid_write(target, signal.SIGTERM) == -signal.SIGTERM
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".ckpt.partial-"), leftovers
    # a kill between the two renames: the earlier checkpoint set aside, the target missing
    earlier = fp4ptq.save(quantized_llama("w4a16", seed=5), tmp_path / "other")
    digest = tree_digest(earlier)
    os.rename(earlier, tmp_path / ".ckpt.replaced-0badf00d")
    with caplog.at_level("WARNING", logger="fp4ptq"):
        with pytest.raises(CheckpointError, match="already exists"):   # it is back, and not overwritten
            fp4ptq.save(quantized_llama("w4a16"), target)
    lines = "\n".join(r.getMessage() for r in caplog.records)
    assert f"put back {target} from .ckpt.replaced-0badf00d" in lines
    assert f"removed {tmp_path / leftovers[0]}" in lines and "left by an interrupted save" in lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and tree_digest(target) == digest


def test_a_live_concurrent_save_keeps_its_partial_directory(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    live = tmp_path / f".ckpt.partial-{os.getpid()}-0123abcd"
    gone = tmp_path / f".ckpt.partial-{int(dead.stdout)}-4567abcd"
    for path in (live, gone):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"x")
    lines = checkpoint.clean_leftovers(tmp_path / "ckpt")   # (in name order: the pids decide which comes first)
    assert sorted(lines) == sorted([f"left {live} alone: a save by running process {os.getpid()} is writing it",
                                    f"removed {gone} (0.0 MiB), left by an interrupted save"])
    assert live.is_dir() and not gone.exists()


def test_overwrite_refuses_a_directory_that_is_not_a_model_output(src, tmp_path, capsys):
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    code, _, err = run_cli(capsys, "quantize", src / "model", "-o", precious, "--overwrite", "--device", "cpu")
    assert code == cli.EXIT_EXISTS and "not an fp4ptq output" in err and "loading" not in err
    code, _, err = run_cli(capsys, "eval", src / "model", "-o", precious, "--overwrite", "--device", "cpu")
    assert code == cli.EXIT_EXISTS and "no report.json" in err
    with pytest.raises(CheckpointError, match="not a model directory"):
        fp4ptq.save(quantized_llama("w4a16"), precious, overwrite=True)
    assert [p.name for p in precious.iterdir()] == ["thesis.tex"]


# --------------------------------------------------------------------------- #
# Byte-reproducible checkpoints
# --------------------------------------------------------------------------- #
def test_two_quantize_runs_give_byte_identical_directories(src, tmp_path, capsys):
    """One CLI run in this process, one in a fresh one (the metadata-order bug was per process:
    safetensors writes ``__metadata__`` in a hash-map order seeded per process, 1 in 6 orders alike for
    3 keys), so the header is also checked to be sorted."""
    first, second = tmp_path / "one", tmp_path / "two"
    argv = ["quantize", str(src / "model"), "--device", "cpu", "-q", "-o"]
    assert run_cli(capsys, *argv, first)[0] == 0
    env = {**os.environ, "PYTHONPATH": str(Path(fp4ptq.__file__).parent.parent)}
    run = subprocess.run([sys.executable, "-m", "fp4ptq", *argv, str(second)], capture_output=True, text=True,
                         timeout=300, env=env, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert tree_digest(first) == tree_digest(second)
    raw = (first / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert list(header["__metadata__"]) == sorted(header["__metadata__"]) and list(header) == sorted(header)
    report = json.loads((first / "fp4ptq_report.json").read_text())
    assert "elapsed_s" not in report and report["checkpoint"]["tensor_xxh3_128"].keys() == header.keys() - {"__metadata__"}


# --------------------------------------------------------------------------- #
# Property: random header/config mutations give the exact logits or a CheckpointError
# --------------------------------------------------------------------------- #
def _mutations():
    from hypothesis import strategies as st

    values = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.text(max_size=4),
                       st.lists(st.integers(0, 300), max_size=3), st.just({}))
    where = st.sampled_from(["header", "config", "quant", "group", "index", "report", "record"])
    kind = st.sampled_from(["remove", "rename", "retype", "offsets", "shape"])
    return st.tuples(where, kind, st.integers(0, 10**6), values)


def _mutate(path: Path, mutation) -> None:
    where, kind, pick, value = mutation
    if where == "header":
        def edit(header):
            names = sorted(n for n in header if n != "__metadata__")
            name = names[pick % len(names)]
            entry = header[name]
            field = sorted(entry)[pick // len(names) % len(entry)]
            if kind == "remove":
                del entry[field]
            elif kind == "rename":
                header[name + "_x" if pick % 2 else names[(pick + 1) % len(names)]] = header.pop(name)
            elif kind == "retype":
                entry[field] = value
            elif kind == "offsets":
                other = header[names[(pick + 1) % len(names)]]
                entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
            else:
                entry["shape"] = list(reversed(entry["shape"])) if pick % 2 else [*entry["shape"], 1]
        _edit_header(path / "model.safetensors", edit)
        return
    if where == "index":   # a sharded layout's index (the one shard): the map, an entry or the whole file
        names = sorted(json.loads((path / "fp4ptq_report.json").read_text())["checkpoint"]["tensor_xxh3_128"])
        index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}
        if kind == "remove":
            del index["weight_map"][names[pick % len(names)]]
        elif kind == "rename":
            index["weight_map"] = {n + "_x" if i == pick % len(names) else n: f for i, (n, f) in
                                   enumerate(index["weight_map"].items())}
        elif kind == "retype":
            index["weight_map"][names[pick % len(names)]] = value
        elif kind == "offsets":
            index["weight_map"] = value
        else:
            index = value
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        return
    file = path / ("fp4ptq_report.json" if where in ("report", "record") else "config.json")
    data = json.loads(file.read_text())
    node = {"report": lambda: data, "record": lambda: data["checkpoint"], "config": lambda: data,
            "quant": lambda: data["quantization_config"],
            "group": lambda: data["quantization_config"]["config_groups"]["group_0"]["weights"]}[where]()
    key = sorted(node)[pick % len(node)]
    if kind == "remove":
        del node[key]
    elif kind == "rename":
        node[key + "_x"] = node.pop(key)
    else:
        node[key] = value
    file.write_text(json.dumps(data))


def test_random_header_and_config_mutations_give_exact_logits_or_a_checkpoint_error(ckpts, tmp_path_factory):
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, example, given, settings

    source = ckpts["w4a4"]
    with torch.no_grad():
        expected = fp4ptq.load(source, device="cpu")(tokens()).logits

    @settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(_mutations())
    @example(("index", "offsets", 0, [3]))                 # weight_map a list
    @example(("index", "shape", 0, "{"))                   # the index a string
    @example(("report", "retype", 5, []))                  # a report field retyped
    @example(("record", "remove", 9, None))                # one of the record's fields (hashes) removed
    def check(mutation):
        path = shutil.copytree(source, tmp_path_factory.mktemp("mut") / "c")
        _mutate(path, mutation)
        try:
            model = fp4ptq.load(path, device="cpu", verify=True)
        except CheckpointError:
            return
        with torch.no_grad():
            assert torch.equal(model(tokens()).logits, expected), mutation

    check()
    assert hypothesis


# --------------------------------------------------------------------------- #
# The README quick start, then stock transformers (slow: FP4PTQ_SLOW=1 and the demo model)
# --------------------------------------------------------------------------- #
STOCK_GREEDY = textwrap.dedent("""
    import json, sys, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])          # default arguments
    ids = tokenizer(sys.argv[2], return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert not any(m == "fp4ptq" or m.startswith("fp4ptq.") for m in sys.modules), "fp4ptq was imported"
    print("RESULT " + json.dumps(out[0].tolist()))
""")


@pytest.mark.slow
def test_the_quick_start_checkpoint_generates_the_same_text_under_stock_transformers(tmp_path, demo_gguf):
    """`fp4ptq quantize` of the demo (the README's quick start, in its own process), then the same greedy
    text from stock transformers + compressed-tensors in a process that never imports fp4ptq and from
    fp4ptq.load. Minutes on a busy 2-core CPU (11 measured at load 15), hence off the default run."""
    if os.environ.get("FP4PTQ_SLOW") != "1":
        pytest.skip("set FP4PTQ_SLOW=1 to run the quick start end to end (minutes)")
    pytest.importorskip("compressed_tensors")
    out, prompt = tmp_path / "quick", "The capital of France is"
    env = {**os.environ, "PYTHONPATH": str(Path(fp4ptq.__file__).parent.parent)}
    run = subprocess.run([sys.executable, "-m", "fp4ptq", "quantize", "-o", str(out), "-q"],
                         capture_output=True, text=True, timeout=900, env=env, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    stock_env = {**os.environ, "FP4PTQ_TRANSFORMERS_HOOK": "0"}
    stock_env.pop("PYTHONPATH", None)
    run = subprocess.run([sys.executable, "-c", STOCK_GREEDY, str(out), prompt],
                         capture_output=True, text=True, timeout=900, env=stock_env, cwd="/", check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    stock = json.loads(run.stdout.split("RESULT ", 1)[1])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    ours = fp4ptq.load(out, device="cpu")   # verified; computes in the stored dtype (bf16 for the GGUF demo)
    with torch.no_grad():
        greedy = ours.generate(tokenizer(prompt, return_tensors="pt").input_ids, max_new_tokens=16, do_sample=False)
    assert tokenizer.decode(stock) == tokenizer.decode(greedy[0]), (tokenizer.decode(stock), tokenizer.decode(greedy[0]))


# --------------------------------------------------------------------------- #
# Newcomer polish
# --------------------------------------------------------------------------- #
def test_task_groups_expand_and_unknown_names_list_them():
    assert cli._parse_tasks("wikitext,c4,arc") == ["wikitext", "c4", "arc_easy", "arc_challenge"]
    assert cli._parse_tasks("arc_easy,ai2_arc") == ["arc_easy", "arc_challenge"]
    with pytest.raises(cli.CLIError, match=r"lambada: name lambada_openai.*arc \(arc_easy\+arc_challenge\)"):
        cli._parse_tasks("lambada")


def test_inspect_files_get_the_umask_mode(ckpts, tmp_path, capsys):
    old = os.umask(0o022)
    try:
        code, out, _ = run_cli(capsys, "inspect", ckpts["w4a16"], "-o", tmp_path / "i")
    finally:
        os.umask(old)
    assert code == 0 and "tensors match their recorded hashes" in out
    assert {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "i").iterdir()} == {
        "inspect.json": 0o644, "inspect.md": 0o644, "inspect.png": 0o644}


def test_lm_eval_runs_quiet_without_git_noise(src, tmp_path, capfd, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.chdir(tmp_path)   # outside any git repository
    out = tmp_path / "rep"
    code = cli.main(["eval", str(src / "model"), "--tasks", "arc_easy", "--data-dir", str(src / "data"),
                     "--limit", "2", "-o", str(out), "--device", "cpu", "-q"])
    captured = capfd.readouterr()
    assert code == 0, captured.err
    assert "fatal:" not in captured.err and "it/s]" not in captured.err, captured.err[-2000:]
