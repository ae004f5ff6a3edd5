"""The README's user path on a GPU, with the real demo model: ``fp4ptq quantize`` the SmolLM2-135M GGUF
on CUDA (RTN W4A16, and the best W4A4 recipe of the accuracy table: AWQ + Four Over Six (mse) + clipping
search, C4-train calibration, 8 x 2048 tokens), then ``fp4ptq eval --tasks wikitext`` each checkpoint and
the float model on CUDA (bfloat16, the Triton kernels), timing both commands. Then, in this process, the
whole WikiText-2 test split's token perplexity of each checkpoint loaded three ways on the GPU: bfloat16
through the kernels (q/k/v and gate/up fused, ``fp4ptq.load``'s default), bfloat16 unfused, and bfloat16
through the dispatch's exact reference backend (dequantize, then torch's matmul), so the kernels' effect
on a real model's perplexity is separated from bfloat16's.

    PYTHONPATH=$PWD python benchmarks/smollm2_gpu_eval_h200.py   # $OUT/smollm2_gpu_eval_h200.{json,md}

Knobs: GGUF (.gguf/SmolLM2-135M-Instruct.Q4_1.gguf), DATA_DIR (.evaldata: wikitext2/ and c4/c4-train/ of
the shared evaluation data), RECIPES (rtn-w4a16,rtn46-w4a4,awq46clip-w4a4), WORD_PPL (0: no lm-eval needed),
MAX_WINDOWS (the whole split), DEVICE (cuda; cpu checks the script), PHASES (float,cli,decode: the float
model's eval, each recipe's quantize + eval + in-process perplexities, the decoding path), DECODE_WINDOWS
(1), DECODE_SEQLEN (512). On the H200 one recipe takes 3-4 minutes (the reference backend's decoding of 511
tokens alone about 33 s for W4A16 and 136 s for W4A4), so a 10-minute call holds two recipes at most: pass
RECIPES.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import harness
import torch

OUT = os.environ.get("OUT", ".")
GGUF = os.environ.get("GGUF", ".gguf/SmolLM2-135M-Instruct.Q4_1.gguf")
DATA = os.environ.get("DATA_DIR", ".evaldata")
RECIPES = {
    "rtn-w4a16": ["--method", "rtn"],
    "rtn46-w4a4": ["--method", "rtn", "--four-six", "mse", "--scheme", "w4a4",
                   "--calib", os.path.join(DATA, "c4", "c4-train"), "--nsamples", os.environ.get("NSAMPLES", "8")],
    "awq46clip-w4a4": ["--method", "awq", "--four-six", "mse", "--scheme", "w4a4", "--awq-clip",
                       "--calib", os.path.join(DATA, "c4", "c4-train"), "--nsamples", os.environ.get("NSAMPLES", "8")],
}
CHOSEN = os.environ.get("RECIPES", ",".join(RECIPES)).split(",")
WORD = os.environ.get("WORD_PPL", "0") == "1"
DEVICE = os.environ.get("DEVICE", "cuda")  # (cpu, with MAX_WINDOWS, checks the script)
MAX_WINDOWS = os.environ.get("MAX_WINDOWS")  # default: the whole split
# the decoding path: DECODE_WINDOWS windows of DECODE_SEQLEN tokens teacher-forced one token a forward
DECODE_WINDOWS, DECODE_SEQLEN = int(os.environ.get("DECODE_WINDOWS", 1)), int(os.environ.get("DECODE_SEQLEN", 512))
PHASES = os.environ.get("PHASES", "float,cli,decode").split(",")


def cli(*args) -> dict:
    """Run ``python -m fp4ptq ARGS``: exit code, wall seconds and the output's last lines."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "fp4ptq", *args], capture_output=True, text=True)
    row = {"command": "fp4ptq " + " ".join(args), "rc": proc.returncode,
           "seconds": round(time.perf_counter() - started, 1),
           "tail": (proc.stdout + proc.stderr).strip().splitlines()[-25:]}
    print(json.dumps({k: row[k] for k in ("command", "rc", "seconds")}), flush=True)
    return row


def evaluate(target: str, name: str) -> dict:
    out = os.path.join(OUT, "eval", name)
    row = cli("eval", target, "--tasks", "wikitext", "--data-dir", DATA, "--device", DEVICE, "--output", out,
              "--quiet", "--overwrite", *([] if WORD else ["--no-word-ppl"]),
              *(["--max-windows", MAX_WINDOWS] if MAX_WINDOWS else []))
    report = os.path.join(out, "report.json")
    if row["rc"] == 0 and os.path.isfile(report):
        with open(report) as f:
            row["report"] = json.load(f)
    return row


def token_ppl(model, tokenizer, corpus) -> dict:
    from fp4ptq.eval.perplexity import perplexity

    with torch.no_grad():
        r = perplexity(model, tokenizer, corpus=corpus, device=DEVICE, progress=False, word_perplexity=False,
                       max_windows=int(MAX_WINDOWS) if MAX_WINDOWS else None)
    return {"token_perplexity": r["token_perplexity"], "windows": r["windows"], "seconds": round(r["seconds"], 2)}


def decode_nll(model, ids: torch.Tensor) -> dict:
    """Teacher-forced decoding with the KV cache, one token a forward (one activation row a layer: the
    GEMV kernels, as in generation) over DECODE_WINDOWS windows: each step's next-token NLL and argmax."""
    from transformers import DynamicCache

    nll, top = [], []
    with torch.no_grad():
        for w in range(DECODE_WINDOWS):
            seq = ids[w * DECODE_SEQLEN:(w + 1) * DECODE_SEQLEN].to(DEVICE)
            cache = DynamicCache(config=model.config)
            for t in range(DECODE_SEQLEN - 1):
                logits = model(seq[t:t + 1].view(1, 1), past_key_values=cache, use_cache=True).logits[0, -1].float()
                nll.append(-torch.log_softmax(logits, -1)[seq[t + 1]])
                top.append(logits.argmax())
    return {"nll": torch.stack(nll).cpu(), "top": torch.stack(top).cpu()}


def agreement(a: dict, b: dict) -> dict:
    """How far two ``decode_nll`` runs agree: the share of equal argmax tokens, the per-token NLL gap."""
    diff = (a["nll"] - b["nll"]).abs()
    return {"argmax_equal": float((a["top"] == b["top"]).float().mean()),
            "nll_abs_diff_max": float(diff.max()), "nll_abs_diff_mean": float(diff.mean())}


def decode_compare(ckpt: str, tokenizer, corpus) -> dict:
    """``decode_nll`` through the kernels (fused, as ``fp4ptq.load`` gives it) and through the reference
    backend: perplexity of each and how far their per-token NLLs and argmax tokens agree."""
    import e2e_decode_h200 as e2e
    import fp4ptq

    ids = torch.tensor(tokenizer(corpus.stream, verbose=False)["input_ids"], dtype=torch.long)
    runs = {}
    for way in ("kernels, fused", "reference backend"):
        model = fp4ptq.load(ckpt, device=DEVICE, dtype=torch.bfloat16, fuse=way == "kernels, fused")
        started = time.perf_counter()
        if way == "reference backend":
            with e2e.reference_backend():
                runs[way] = decode_nll(model, ids)
        else:
            runs[way] = decode_nll(model, ids)
        runs[way]["seconds"] = round(time.perf_counter() - started, 1)
        del model
    a, b = runs["kernels, fused"], runs["reference backend"]
    row = {"tokens": int(a["nll"].numel()), "windows": DECODE_WINDOWS, "seqlen": DECODE_SEQLEN, **agreement(a, b)}
    for way, r in runs.items():
        row[way] = {"token_perplexity": float(r["nll"].mean().exp()), "seconds": r["seconds"]}
    print(os.path.basename(ckpt), "decode", json.dumps(row), flush=True)
    return row


def main():
    import e2e_decode_h200 as e2e
    import fp4ptq
    from fp4ptq.eval.perplexity import load_corpus
    from transformers import AutoTokenizer

    res = {"env": {k: v for k, v in e2e.env().items() if k != "sizes"},  # (sizes: the 8B model's)
           "gguf": GGUF, "recipes": {}, "float": None}
    if "float" in PHASES:
        res["float"] = evaluate(GGUF, "float")
    corpus = load_corpus("wikitext", DATA)
    for name in CHOSEN:
        ckpt = os.path.join(OUT, "ckpt", name)
        row = {"quantize": cli("quantize", GGUF, *RECIPES[name], "--device", DEVICE, "--output", ckpt,
                               "--quiet", "--overwrite")}
        if row["quantize"]["rc"] == 0 and "decode" in PHASES:
            row["decode"] = decode_compare(ckpt, AutoTokenizer.from_pretrained(ckpt), corpus)
        if row["quantize"]["rc"] == 0 and "cli" in PHASES:
            row["eval"] = evaluate(ckpt, name)
            tokenizer = AutoTokenizer.from_pretrained(ckpt)
            ways = {}
            for way in ("kernels, fused", "kernels, unfused", "reference backend"):
                model = fp4ptq.load(ckpt, device=DEVICE, dtype=torch.bfloat16, fuse=way == "kernels, fused")
                if way == "reference backend":
                    with e2e.reference_backend():
                        ways[way] = token_ppl(model, tokenizer, corpus)
                else:
                    ways[way] = token_ppl(model, tokenizer, corpus)
                ways[way]["fused_groups"] = (model.fp4ptq_fusion or {}).get("fused", 0)
                print(name, way, json.dumps(ways[way]), flush=True)
                del model
                if DEVICE.startswith("cuda"):
                    torch.cuda.empty_cache()
            row["in_process"] = ways
        res["recipes"][name] = row
        harness.write_json(harness.out_path("smollm2_gpu_eval_h200.json"), res)
    harness.write_text(harness.out_path("smollm2_gpu_eval_h200.md"), report(res))
    print(report(res))


def _ppl(row) -> str:
    try:
        return f"{row['report']['models'][0]['results']['wikitext']['token_perplexity']:.4f}"
    except (KeyError, TypeError, IndexError):
        return "n/a"


def report(res: dict) -> str:
    lines = [f"# SmolLM2-135M on the GPU through the CLI ({res['env'].get('gpu', '')})", ""]
    if res.get("float"):
        lines += ["WikiText-2 test, token perplexity over the whole split (2048-token windows), bfloat16 on CUDA.", "",
                  "| recipe | quantize (s) | eval (s) | eval ppl | kernels, fused | kernels, unfused | reference backend |",
                  "|---|---|---|---|---|---|---|",
                  f"| float (GGUF) | | {res['float']['seconds']} | {_ppl(res['float'])} | | | |"]
        for name, row in res["recipes"].items():
            if "eval" not in row:
                continue
            ev, ways = row["eval"], row.get("in_process", {})
            cells = [f"{ways[w]['token_perplexity']:.4f}" if w in ways else "n/a"
                     for w in ("kernels, fused", "kernels, unfused", "reference backend")]
            lines.append(f"| {name} | {row['quantize']['seconds']} (rc {row['quantize']['rc']}) | {ev['seconds']} "
                         f"| {_ppl(ev)} | " + " | ".join(cells) + " |")
        lines.append("")
    decoded = {n: r["decode"] for n, r in res["recipes"].items() if "decode" in r}
    if decoded:
        lines += ["Decoding path: WikiText-2 test windows teacher-forced one token a forward with the KV cache "
                  "(one activation row a layer), bfloat16.", "",
                  "| recipe | tokens | ppl, kernels (fused) | ppl, reference backend | same argmax | NLL diff mean / max |",
                  "|---|---|---|---|---|---|"]
        for name, d in decoded.items():
            lines.append(f"| {name} | {d['tokens']} | {d['kernels, fused']['token_perplexity']:.4f} | "
                         f"{d['reference backend']['token_perplexity']:.4f} | {d['argmax_equal']:.4f} | "
                         f"{d['nll_abs_diff_mean']:.2e} / {d['nll_abs_diff_max']:.2e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
