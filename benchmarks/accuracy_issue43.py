"""Issue 43's rows: rotations x {RTN, GPTQ + 4/6, AWQ + 4/6}, keep budgets, scale searches (CPU or a GPU).

Token perplexity and mean next-token KL to the float model over the WikiText-2 *test* windows of
``fp4ptq.eval.perplexity`` (seqlen 2048, the first ``--windows``; 0 = all), W4A16 and W4A4; C4 *train*
calibration from the evaluation-data folder. On a GPU the models run in float32 with TF32 off. The float
model's log-probabilities are kept (and in ``--cache``) up to 4 GB, else recomputed per window.
Config names ``PART+PART/SCHEME``: ``rtn``, ``gptq46``, ``awq46``, ``awqgptq46`` (``46`` = Four Over Six
"mse", ``46mae`` / ``46max``), ``clip`` (AWQ clipping), ``ao`` (GPTQ act-order), ``rotN`` / ``rotNx``
(block-Hadamard rotation, block N; x: not the residual stream), ``ws`` (weight-scale search), ``keepP`` /
``keepPl`` (P% by block / by linear); ``fp`` is the float model. Resumable: configs in the JSON (same settings) are skipped.

    python benchmarks/accuracy_issue43.py --windows 3 --configs fp,rtn/w4a16,rot128+rtn/w4a16
    python benchmarks/accuracy_issue43.py --device cuda --model smol.gguf --windows 0 --nsamples 8 \
        --calib-seqlen 2048 --search-nsamples 2 --configs ... --out $OUT/accuracy_issue43_smollm2-135m_h200
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fp4ptq
from fp4ptq import QuantConfig
from fp4ptq.calib import get_calibration
from fp4ptq.eval import decoded_weight_cache
from fp4ptq.eval.perplexity import load_corpus
from fp4ptq.sources import load_source_model

import harness

KEEP_REFERENCE_BYTES = 4e9   # the float model's log-probabilities are kept up to this size


def parse_config(name: str, args) -> dict:
    """QuantConfig kwargs for a config name (module docstring)."""
    parts, _, scheme = name.partition("/")
    kw = dict(scheme=scheme, nsamples=args.nsamples, seqlen=args.calib_seqlen, search_nsamples=args.search_nsamples,
              awq_grid=args.awq_grid, keep_nsamples=args.keep_nsamples, keep_unit="block")
    for part in parts.split("+"):
        if m := re.fullmatch(r"(rtn|gptq|awq|awqgptq)(46(mse|mae|max)?)?", part):
            kw["method"] = "awq+gptq" if m[1] == "awqgptq" else m[1]
            kw["four_six"] = (m[3] or "mse") if m[2] else None
        elif part == "clip":
            kw["awq_clip"] = True
        elif part.startswith("rot"):
            kw["rotate"] = int(part[3:].rstrip("x"))
            kw["rotate_residual"] = not part.endswith("x")
        elif part == "ao":
            kw["gptq_act_order"] = True
        elif part == "ws":
            kw["weight_scale_search"] = True
        elif part.startswith("keep"):
            kw["keep_budget"] = part[4:].removesuffix("l") + "%"
            kw["keep_unit"] = "linear" if part.endswith("l") else "block"
        else:
            raise SystemExit(f"unknown config part {part!r} in {name!r}")
    return kw


@torch.inference_mode()
def evaluate(model, windows: list, reference) -> dict:
    """Token perplexity and mean KL(p_float || p_model) over the windows (``reference(i)``: the float
    model's log-probabilities of window i, or None for the float model itself)."""
    nll = kl = 0.0
    tokens = 0
    with decoded_weight_cache(model):   # each packed weight decoded once (bit-identical outputs)
        for i, window in enumerate(windows):
            logp = F.log_softmax(model(input_ids=window[None], use_cache=False).logits[0, :-1].float(), -1)
            nll -= float(logp.gather(-1, window[1:, None]).sum())
            if reference is not None:
                ref = reference(i)
                kl += float((ref.exp() * (ref - logp)).sum())
            tokens += window.numel() - 1
    return {"token_ppl": math.exp(nll / tokens), "kld": kl / tokens if reference is not None else 0.0,
            "tokens": tokens}


def table(report: dict) -> str:
    res = report["results"]
    s = report["settings"]
    lines = [f"# {s['model']}: issue 43 rows ({s.get('device', 'CPU')})", "",
             f"- Eval: {s['eval']}; {s['windows']} windows ({s['tokens']} scored tokens)",
             f"- Calibration: {s['calibration']}", "- Commands: " + "; ".join(f"`{c}`" for c in report["commands"]), ""]
    rows = []
    fp = res.get("fp", {}).get("token_ppl")
    for name, r in res.items():
        scheme = name.partition("/")[2] or "-"
        rtn = res.get(f"rtn/{scheme}")
        gap = kgap = ""
        if fp and rtn and name != f"rtn/{scheme}" and scheme != "-":
            gap = f"{100 * (rtn['token_ppl'] - r['token_ppl']) / (rtn['token_ppl'] - fp):.1f}%"
            kgap = f"{100 * (rtn['kld'] - r['kld']) / rtn['kld']:.1f}%"
        kept = f"{r['kept']} ({r['extra_bytes']})" if r.get("kept") is not None else ""
        rows.append([name, scheme, f"{r['token_ppl']:.3f}", f"{r['kld']:.4f}", gap, kgap, kept,
                     f"{r.get('quantize_s', 0):.0f}"])
    lines += harness.md_table(["config", "scheme", "token ppl", "KL to FP", "RTN ppl gap closed", "RTN KL closed",
                               "kept bf16 (extra bytes)", "quantize s"], rows)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", required=True)
    p.add_argument("--model", default=None, help="GGUF / HF model (default: the demo SmolLM2-135M-Instruct)")
    p.add_argument("--name", default="smollm2-135m")
    p.add_argument("--windows", type=int, default=3, help="WikiText-2 test windows of 2048 tokens; 0 = all")
    p.add_argument("--nsamples", type=int, default=4)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--search-nsamples", type=int, default=1)
    p.add_argument("--awq-grid", type=int, default=10)
    p.add_argument("--keep-nsamples", type=int, default=1, help="calibration rows the keep-budget sensitivity uses")
    p.add_argument("--data-dir", default=str(harness.EVALDATA))
    p.add_argument("--out", default=None)
    p.add_argument("--cache", default=None, help="folder keeping the float model's log-probabilities between runs")
    p.add_argument("--device", default="cpu", help="where quantization and evaluation run (cpu, cuda)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new config after this many seconds (the JSON keeps what finished)")
    args = p.parse_args(argv)
    run_started = time.perf_counter()
    device = torch.device(args.device)
    out = Path(args.out or harness.RESULTS / f"accuracy_issue43_{args.name}_{'cpu' if device.type == 'cpu' else 'gpu'}")
    calib_dir = Path(args.data_dir) / "c4" / "c4-train"
    settings = {"model": args.name, "windows": args.windows,
                "eval": "WikiText-2 test (raw), seqlen 2048, non-overlapping windows from the start; token perplexity "
                        "and mean KL(p_FP || p_quantized) over the same next-token positions",
                "calibration": f"C4 train documents, {args.nsamples} x {args.calib_seqlen} tokens, seed 0; AWQ search "
                               f"on {args.search_nsamples} sequence(s), grid {args.awq_grid}; keep budgets by block, "
                               f"sensitivity on {args.keep_nsamples} x 512 tokens"}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls stay fp32, as on the CPU
        settings["device"] = f"{torch.cuda.get_device_name(device)}, float32, TF32 off"
    path = out.parent / f"{out.name}.json"   # (not with_suffix: model names hold dots)
    report = json.loads(path.read_text()) if path.exists() else {"settings": settings, "commands": [], "results": {}}
    if {k: v for k, v in report["settings"].items() if k != "tokens"} != settings:
        raise SystemExit(f"{path} was made with other settings; use another --out")
    report["commands"].append("python benchmarks/accuracy_issue43.py " + " ".join(sys.argv[1:]))
    names = [n for n in args.configs.split(",") if n and n not in report["results"]]
    base, tokenizer, _ = load_source_model(args.model, dtype=torch.float32)
    base = base.to(device)
    corpus = load_corpus("wikitext", args.data_dir)
    ids = torch.tensor(tokenizer(corpus.stream, verbose=False)["input_ids"], dtype=torch.long, device=device)
    count = args.windows or ids.numel() // 2048
    windows = [ids[i * 2048:(i + 1) * 2048] for i in range(count)]
    cache = Path(args.cache) / f"reference_{args.name}_{args.windows}.pt" if args.cache else None

    @torch.inference_mode()
    def float_logp(i):
        return F.log_softmax(base(input_ids=windows[i][None], use_cache=False).logits[0, :-1].float(), -1)

    if len(windows) * 2047 * base.config.vocab_size * 4 > KEEP_REFERENCE_BYTES:
        reference = float_logp   # one float forward per window instead of holding them all
    else:
        if cache is not None and cache.exists():   # the float model's log-probabilities, kept between runs
            kept = torch.load(cache)
        else:
            kept = [float_logp(i) for i in range(len(windows))]
            if cache is not None:
                torch.save(kept, cache)
        reference = kept.__getitem__
    report["settings"]["tokens"] = sum(w.numel() - 1 for w in windows)
    calib = get_calibration(str(calib_dir), tokenizer, args.nsamples, args.calib_seqlen, 0)
    for name in names:
        if args.budget_s is not None and time.perf_counter() - run_started > args.budget_s:
            print(f"time budget of {args.budget_s} s spent: stopping before {name}", flush=True)
            break
        started = time.perf_counter()
        if name == "fp":   # from the kept log-probabilities: no second pass
            nll = -sum(float(reference(i).gather(-1, w[1:, None]).sum()) for i, w in enumerate(windows))
            entry = {"token_ppl": math.exp(nll / report["settings"]["tokens"]), "kld": 0.0,
                     "tokens": report["settings"]["tokens"]}
        else:
            model = copy.deepcopy(base)
            config = QuantConfig(**parse_config(name, args))
            fp4ptq.quantize(model, config, calib, device=device, progress=False)
            quantize_s = time.perf_counter() - started
            entry = evaluate(model, windows, reference)
            entry["quantize_s"] = round(quantize_s, 1)
            keep = model.fp4ptq_info.get("keep")
            if keep:
                entry.update(kept=keep["kept_parts"], extra_bytes=keep["extra_bytes"])
            del model
        entry["seconds"] = round(time.perf_counter() - started, 1)
        report["results"][name] = entry
        print(name, entry, flush=True)
        harness.write_json(str(path), report)
        harness.write_text(str(out.parent / f"{out.name}.md"), table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
