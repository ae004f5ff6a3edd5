"""CPU micro-benchmark of the reference quantizer (fp4ptq.nvfp4.quantize):
elements per second for standard NVFP4 and each Four Over Six rule, so later
changes (and the Triton kernels) have a baseline.

    python benchmarks/bench_nvfp4_cpu.py [--rows 4096 --cols 4096 --repeat 3]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from fp4ptq import nvfp4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.cols, dtype=torch.bfloat16)
    rows = []
    for rule in (None, "mse", "mae", "max"):
        nvfp4.quantize(x[:64], rule)  # warm-up
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            nvfp4.quantize(x, rule)
            times.append(time.perf_counter() - t0)
        best = min(times)
        rows.append({"four_six": rule or "off", "seconds": best, "elements_per_s": x.numel() / best})
    meta = {"shape": [args.rows, args.cols], "dtype": "bfloat16", "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nvfp4_cpu_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"reference quantizer, {args.rows}x{args.cols} bf16, {meta['threads']} threads (best of {args.repeat})")
    print("| 4/6 | s | Melem/s |\n|---|---|---|")
    for r in rows:
        print(f"| {r['four_six']} | {r['seconds']:.3f} | {r['elements_per_s'] / 1e6:.1f} |")


if __name__ == "__main__":
    main()
