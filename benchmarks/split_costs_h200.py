"""Where a K-split call's time goes, kernel by kernel, on the H200: the torch profiler's CUDA time of
each kernel of a call (medians over REPS calls), for the split layers of the kernel table, so that the
summing launch's share is measured rather than inferred from a whole call. Also the call as a whole
(CUDA-graph replays, as the table) and, for wsgemm, the same layer with whole tiles only.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/split_costs_h200.py   # $OUT/split_costs_h200.json

Knobs: REPS (20), JSON (file name).
"""
from __future__ import annotations

import json
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import mma, wsgemm

dev = torch.device("cuda")
REPS = int(os.environ.get("REPS", "20"))
out_path = os.path.join(os.environ.get("OUT", "."), os.environ.get("JSON", "split_costs_h200.json"))
# (label, layer, M, path, wsgemm split)
CASES = [("8B.qkv M=1024 wsgemm split", (6144, 4096), 1024, "wsgemm", True),
         ("8B.qkv M=1024 wsgemm whole tiles", (6144, 4096), 1024, "wsgemm", False),
         ("8B.down M=256 wsgemm split", (4096, 14336), 256, "wsgemm", True),
         ("8B.o M=16 mma", (4096, 4096), 16, "mma", None),
         ("8B.qkv M=16 mma", (6144, 4096), 16, "mma", None),
         ("8B.down M=16 mma", (4096, 14336), 16, "mma", None),
         ("70B.down M=16 mma", (8192, 28672), 16, "mma", None),
         ("8B.k M=64 mma", (1024, 4096), 64, "mma", None),
         ("8B.qkv M=1024 cuBLAS bf16", (6144, 4096), 1024, "cublas_bf16", None)]
res = {"env": peers.env(), "ready": {"mma": mma.ready(dev), "wsgemm": wsgemm.ready(dev)}, "cases": []}
g = torch.Generator(device=dev).manual_seed(0)
for label, (n, k), m, path, split in CASES:
    w = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
    if path == "cublas_bf16":
        wb = w.dequantize(torch.bfloat16)
        call = lambda: x @ wb.T  # noqa: E731
    elif path == "wsgemm":
        y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        call = lambda: wsgemm.matmul(x, *gm._weight_views(w)[2:], None, None, y, split=split)  # noqa: E731
    else:
        call = lambda: gm.linear_w4a16(x, w, path=path)  # noqa: E731
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            call()
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time > 0:
            per.setdefault(e.name[:60], []).append(e.device_time)
    row = {"case": label, "m": m, "n": n, "k": k, "path": path,
           "kernels_us": {a: round(statistics.median(b), 2) for a, b in per.items()},
           "kernel_calls": {a: len(b) for a, b in per.items()},
           "graph_call_us": round(peers.bench(call) * 1e3, 2)}
    res["cases"].append(row)
    print(row, flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
