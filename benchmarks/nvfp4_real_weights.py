"""Quantize every linear of SmolLM2-135M with the reference packer and report,
per Four Over Six rule, the share of blocks choosing 4 and the relative
Frobenius error ||W - W_hat|| / ||W|| (mean over layers, and over all weights).

    python benchmarks/nvfp4_real_weights.py [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from fp4ptq import nvfp4
from fp4ptq.sources import load_source_model

RULES = (None, "mse", "mae", "max")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    model, _, src = load_source_model(None, dtype=torch.float32)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    stats = {str(r): {"rel_error": [], "four_share": [], "sq_err": 0.0} for r in RULES}
    total_sq = 0.0
    for name, mod in tqdm(linears.items(), desc="layers"):
        w = mod.weight.detach()
        total_sq += float(w.double().pow(2).sum())
        for rule in RULES:
            q = nvfp4.quantize(w, rule, name=name)
            s = stats[str(rule)]
            s["rel_error"].append(nvfp4.quantization_error(w, q))
            s["four_share"].append(q.four_share())
            s["sq_err"] += float((q.dequantize(torch.float32) - w).double().pow(2).sum())
    rows = []
    for rule in RULES:
        s = stats[str(rule)]
        rows.append({
            "four_six": rule or "off",
            "layers": len(s["rel_error"]),
            "mean_rel_error": sum(s["rel_error"]) / len(s["rel_error"]),
            "overall_rel_error": (s["sq_err"] / total_sq) ** 0.5,
            "mean_four_share": sum(s["four_share"]) / len(s["four_share"]),
        })
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nvfp4_real_weights.json").write_text(json.dumps({"model": src.as_dict(), "rows": rows}, indent=2))
    lines = ["| 4/6 rule | layers | mean rel. error | overall rel. error | mean share of blocks choosing 4 |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['four_six']} | {r['layers']} | {r['mean_rel_error']:.5f} | "
                     f"{r['overall_rel_error']:.5f} | {r['mean_four_share']:.3f} |")
    table = "\n".join(lines)
    (out / "nvfp4_real_weights.md").write_text(
        "# SmolLM2-135M-Instruct linear weights, NVFP4 reference packer\n\n"
        "Command: `python benchmarks/nvfp4_real_weights.py`\n\n" + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
