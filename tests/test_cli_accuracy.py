"""Issue 43 on the command line: quantize with a rotation, a keep budget and the scale searches,
then ``eval --tasks kld --baseline``; kld without a model baseline is a usage error."""
from __future__ import annotations

import json

import pytest

from fp4ptq import cli
from test_eval_perplexity import build_model, build_tokenizer, write_data_dir

pytest.importorskip("lm_eval")


def test_rotated_kept_searched_checkpoint_and_its_kld(tmp_path, capsys):
    tok = build_tokenizer(tmp_path / "src")
    build_model(len(tok)).save_pretrained(tmp_path / "src")
    write_data_dir(tmp_path / "data")
    (tmp_path / "calib.txt").write_text((tmp_path / "data" / "wikitext2" / "wiki.test.raw").read_text() * 3)
    ckpt = tmp_path / "ckpt"
    assert cli.main(["quantize", str(tmp_path / "src"), "--scheme", "w4a4", "--four-six", "mse", "--rotate", "16",
                     "--keep-budget", "1", "--keep-nsamples", "1", "--weight-scale-search",
                     "--calib", str(tmp_path / "calib.txt"), "--nsamples", "2", "--seqlen", "32",
                     "--output", str(ckpt), "-q"]) == 0
    info = json.loads((ckpt / "fp4ptq_report.json").read_text())
    assert info["rotation"]["block"] == 16 and len(info["keep"]["kept_parts"]) == 1
    assert info["keep"]["tokens"] == 32   # --keep-nsamples 1: one 32-token calibration row (default 2)
    assert "transform_config" in json.loads((ckpt / "config.json").read_text())["quantization_config"]
    common = ["--data-dir", str(tmp_path / "data"), "--seqlen", "32", "--max-windows", "2", "-q"]
    assert cli.main(["eval", str(ckpt), "--tasks", "kld", *common, "--output", str(tmp_path / "x")]) == cli.EXIT_USAGE
    assert "--tasks kld needs --baseline MODEL" in capsys.readouterr().err
    assert cli.main(["eval", str(ckpt), "--tasks", "kld", "--baseline", str(tmp_path / "src"), *common,
                     "--output", str(tmp_path / "kld")]) == 0
    models = json.loads((tmp_path / "kld" / "report.json").read_text())["models"]
    assert models[0]["results"]["kld"]["kld"] == 0.0
    result = models[1]["results"]["kld"]
    assert result["windows"] == 2 and result["kld"] > 0 and result["token_perplexity"] > 1
    assert "| kld |" in capsys.readouterr().out
    # what was evaluated comes from the quantized model's run, not the baseline's stand-in entry
    assert "- kld: 2/" in (tmp_path / "kld" / "report.md").read_text()
