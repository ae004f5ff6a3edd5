"""The fp4ptq command line end to end, in-process (``fp4ptq.cli.main(argv)``), on a tiny
random Llama and tiny files written here: quantize -> inspect -> eval (--data-dir),
and the error paths with their messages and exit codes."""
from __future__ import annotations

import json
import math

import pytest

from fp4ptq import cli
from test_eval_perplexity import build_model, build_tokenizer, write_data_dir

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    tok = build_tokenizer(root / "src")
    build_model(len(tok)).save_pretrained(root / "src")
    write_data_dir(root / "data")
    # A local calibration file (the CLI's --calib PATH) for the calibrated recipe.
    (root / "calib.txt").write_text((root / "data" / "wikitext2" / "wiki.test.raw").read_text() * 3)
    return root


def _finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def test_quantize_inspect_eval_end_to_end(work, capsys):
    ckpt, insp, rep = work / "ckpt-rtn", work / "inspect", work / "report"
    assert cli.main(["quantize", str(work / "src"), "--output", str(ckpt), "--device", "cpu", "-q"]) == 0
    out = capsys.readouterr().out
    assert "quantized 14 linears" in out and str(ckpt) in out
    assert (ckpt / "config.json").is_file() and (ckpt / "fp4ptq_report.json").is_file()

    assert cli.main(["inspect", str(ckpt), "--output", str(insp)]) == 0
    summary = json.loads((insp / "inspect.json").read_text())
    assert len(summary["layers"]) == 14 and summary["totals"]["quantized_layers"] == 14
    first = summary["layers"][0]
    assert first["name"] == "model.layers.0.mlp.down_proj" and first["shape"] == [64, 128]
    # packed codes [64, 64] u8 + e4m3 block scales [64, 8] + fp32 global scale [1]
    assert first["bytes"] == 64 * 64 + 64 * 8 + 4
    assert summary["layers"][-1]["name"].startswith("model.layers.1.")
    assert all(0 < layer["rel_error"] < 0.2 for layer in summary["layers"])
    assert (insp / "inspect.png").stat().st_size > 0 and "| layer | shape |" in (insp / "inspect.md").read_text()

    argv = ["eval", str(ckpt), "--tasks", "wikitext,arc_easy", "--data-dir", str(work / "data"), "--seqlen", "32",
            "--limit", "4", "--baseline", str(work / "src"), "--output", str(rep), "--device", "cpu", "-q"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "| task | metric | src | ckpt-rtn | Δ vs src |" in out and "evaluated ckpt-rtn:" in out
    report = json.loads((rep / "report.json").read_text())
    assert report["reference"] == 0 and [m["name"] for m in report["models"]] == ["src", "ckpt-rtn"]
    assert report["models"][1]["kind"] == "fp4ptq checkpoint" and report["models"][1]["quantization"]["method"] == "rtn"
    for model in report["models"]:
        wiki, arc = model["results"]["wikitext"], model["results"]["arc_easy"]
        assert wiki["windows"] == wiki["windows_available"] > 0 and wiki["seqlen"] == 32
        assert _finite(wiki["token_perplexity"]) and _finite(wiki["word_perplexity"])
        assert arc["samples"] == 4 and arc["source"].endswith("ARC-Easy-Test.jsonl")
        assert 0.0 <= arc["metrics"]["acc"] <= 1.0 and 0.0 <= arc["metrics"]["acc_norm"] <= 1.0
    assert (rep / "report.md").is_file() and (rep / "report.png").stat().st_size > 0


def test_calibrated_w4a4_recipe_and_report_reuse(work, capsys):
    ckpt = work / "ckpt-awq"
    argv = ["quantize", str(work / "src"), "--method", "awq", "--four-six", "mse", "--scheme", "w4a4",
            "--calib", str(work / "calib.txt"), "--nsamples", "4", "--seqlen", "32", "--awq-clip",
            "--output", str(ckpt), "-q"]
    assert cli.main(argv) == 0
    info = json.loads((ckpt / "fp4ptq_report.json").read_text())
    assert info["config"]["method"] == "awq" and info["config"]["four_six"] == "mse"
    assert info["config"]["awq_clip"] is True and info["config"]["gptq_act_order"] is False
    assert {r["scheme"] for r in info["layers"].values()} == {"w4a4"}
    assert all(0.0 <= r["four_share"] <= 1.0 for r in info["layers"].values())

    base = work / "base-report"
    common = ["--tasks", "wikitext", "--data-dir", str(work / "data"), "--seqlen", "32", "--no-word-ppl", "-q"]
    assert cli.main(["eval", str(work / "src"), *common, "--output", str(base)]) == 0
    # A report.json as --baseline is reused: its numbers come back unchanged, nothing re-evaluated.
    assert cli.main(["eval", str(ckpt), *common, "--baseline", str(base / "report.json"),
                     "--output", str(work / "vs")]) == 0
    first = json.loads((base / "report.json").read_text())["models"][0]
    report = json.loads((work / "vs" / "report.json").read_text())
    assert report["models"][0]["results"] == first["results"]
    assert report["models"][1]["results"]["wikitext"]["word_perplexity"] is None

    # The same checkpoint evaluated on another task in a separate run joins its column.
    assert cli.main(["eval", str(ckpt), "--tasks", "arc_easy", "--data-dir", str(work / "data"), "--limit", "2",
                     "-q", "--output", str(work / "arc")]) == 0
    assert cli.main(["compare", str(base), str(work / "vs"), str(work / "arc"), "--output", str(work / "cmp")]) == 0
    compared = json.loads((work / "cmp" / "report.json").read_text())
    assert [m["name"] for m in compared["models"]] == ["src", "ckpt-awq"]
    assert set(compared["models"][1]["results"]) == {"wikitext", "arc_easy"}
    assert compared["settings"]["tasks"] == "wikitext,arc_easy"
    assert "Δ vs src" in capsys.readouterr().out


@pytest.mark.parametrize("argv_tail, code, message", [
    (["--tasks", "wikitext", "--data-dir", "{work}/no-such-dir"], cli.EXIT_MISSING, "no-such-dir does not exist"),
    (["--tasks", "wikitext,mmlu_pro"], cli.EXIT_USAGE, "unknown task(s) mmlu_pro"),
    (["--tasks", "boolq", "--data-dir", "{work}/data"], cli.EXIT_MISSING, "boolq/val.jsonl"),
    (["--tasks", "wikitext", "--limit", "0"], cli.EXIT_USAGE, "--limit must be >= 1"),
])
def test_eval_errors_fail_fast_with_their_message(work, capsys, argv_tail, code, message):
    argv = ["eval", str(work / "src"), *[a.format(work=work) for a in argv_tail], "--output", str(work / "never")]
    assert cli.main(argv) == code
    assert message in capsys.readouterr().err
    assert not (work / "never").exists()


def test_existing_output_is_never_overwritten(work, capsys):
    out = work / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli.main(["quantize", str(work / "src"), "--output", str(out), "-q"]) == cli.EXIT_EXISTS
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "mine"
    assert cli.main(["eval", str(work / "src"), "--output", str(out), "-q"]) == cli.EXIT_EXISTS


def test_usage_and_missing_model_exit_codes(work, capsys):
    assert cli.main(["--help"]) == 0
    assert "exit codes:" in capsys.readouterr().out
    assert cli.main(["quantize", "--method", "bogus"]) == cli.EXIT_USAGE
    assert cli.main(["quantize", str(work / "nope.gguf"), "--output", str(work / "x"), "-q"]) == cli.EXIT_MISSING
    assert "nope.gguf does not exist" in capsys.readouterr().err
    assert cli.main(["inspect", str(work / "src")]) == cli.EXIT_MISSING
    assert "fp4ptq_report.json not found" in capsys.readouterr().err


def test_recipe_names_carry_the_options_that_change_the_result():
    from fp4ptq import QuantConfig

    clip = QuantConfig(method="awq", four_six="mse", scheme="w4a4", awq_clip=True)
    assert cli._recipe_slug(clip) == "awq-clip-46mse-w4a4"
    assert cli._recipe_text(clip.to_dict()) == "awq + clip, 4/6 mse, w4a4"
    assert cli._recipe_slug(QuantConfig(method="gptq", gptq_act_order=True)) == "gptq-act-order-w4a16"
    # An option the method does not use is not named.
    assert cli._recipe_slug(QuantConfig(method="rtn", awq_clip=True)) == "rtn-w4a16"


def test_inspect_plot_groups_layers_by_block_and_projection(tmp_path):
    """The inspect plot draws each projection kind against its decoder block (one line a kind, the
    blocks in order whatever the table's order), a second panel for the 4/6 share where there is one,
    and one bar a layer where a name has no block index."""
    from fp4ptq.eval import report

    def layer(name, err=0.1, four=None):
        return {"name": name, "rel_error": err, "four_share": four}

    layers = [layer("model.layers.1.mlp.down_proj", 0.2, 0.4), layer("model.layers.0.mlp.down_proj", 0.1, 0.5),
              layer("model.layers.0.self_attn.q_proj", 0.3, 0.6)]
    series = report.inspect_series(layers)
    assert list(series) == ["mlp.down_proj", "self_attn.q_proj"]
    assert [(b, l["rel_error"]) for b, l in series["mlp.down_proj"]] == [(0, 0.1), (1, 0.2)]
    two_stacks = report.inspect_series([layer("model.layers.0.mlp.up_proj"), layer("vision.layers.3.fc1")])
    assert sorted(two_stacks) == ["model.layers.mlp.up_proj", "vision.layers.fc1"]
    assert report.inspect_series(layers + [layer("lm_head")]) is None
    for name, rows in (("blocks", layers), ("bars", layers + [layer("lm_head")]), ("no46", [layer("layers.0.fc")])):
        png = report.inspect_plot({"checkpoint": str(tmp_path / name), "layers": rows}, tmp_path / f"{name}.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
