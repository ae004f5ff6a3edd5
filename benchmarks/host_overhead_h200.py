"""Host (Python) time of one NVFP4Linear call, the cost that eager use pays on every layer of every
token (HF's generate without CUDA graphs): per shape and M, the wall time a call of a long
back-to-back loop of eager calls (the GPU then idles between kernels, so wall = host time),
against ``F.linear`` on the bf16 weight, and a cProfile of the NVFP4 calls (top functions by own
time).

    PYTHONPATH=$PWD python benchmarks/host_overhead_h200.py   # $OUT/host_overhead_h200.json

Knobs: MS (1,16,512), CALLS (2000), PROFILE (1: the cProfile tables).
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import time

import torch

from fp4ptq import nvfp4
from fp4ptq.modules import NVFP4Linear

OUT = os.environ.get("OUT", "/tmp")
MS = [int(m) for m in os.environ.get("MS", "1,16,512").split(",")]
CALLS = int(os.environ.get("CALLS", 2000))
PROFILE = os.environ.get("PROFILE", "1") == "1"
SHAPES = {"8B.q": (4096, 4096), "8B.k": (1024, 4096), "8B.down": (4096, 14336)}
dev = torch.device("cuda")


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def profile_table(fn, calls: int, order: str = "tottime", rows: int = 25) -> str:
    """cProfile's table of ``calls`` calls of ``fn`` (sorted by ``order``, the first ``rows`` rows)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats(order).print_stats(rows)
    return text.getvalue()


def main():
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": [], "profiles": {}}
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        q = nvfp4.quantize(w)
        mods = {"w4a16": NVFP4Linear.from_quantized(q, dtype=torch.bfloat16),
                "w4a4": NVFP4Linear.from_quantized(q, scheme="w4a4", input_amax=torch.tensor(4.0), dtype=torch.bfloat16)}
        for m in MS:
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            row = {"layer": name, "n": n, "k": k, "m": m,
                   "bf16_linear_us": per_call_us(lambda: torch.nn.functional.linear(x, w), CALLS)}
            with torch.no_grad():
                for scheme, mod in mods.items():
                    row[f"{scheme}_us"] = per_call_us(lambda: mod(x), CALLS)
                    if PROFILE and name == "8B.q":
                        res["profiles"][f"{scheme} M={m}"] = profile_table(lambda: mod(x), CALLS // 4)
            res["rows"].append(row)
            print(row, flush=True)
    with open(os.path.join(OUT, "host_overhead_h200.json"), "w") as f:
        json.dump(res, f, indent=1)
    for key, table in res["profiles"].items():
        print("=====", key)
        print("\n".join(table.splitlines()[:40]))


if __name__ == "__main__":
    main()
