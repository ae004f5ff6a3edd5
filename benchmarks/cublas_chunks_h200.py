"""Dequantize + cuBLAS with the weight decoded a row slice at a time into one reused buffer
(``gm.CUBLAS_CHUNK_ROWS``): a slice small enough to stay in L2 between its decode and the GEMM that
reads it. Timed against the whole-weight decode and cuBLAS bf16 on the six Llama shapes for
M = 512..4096 (W4A16) and M = 1024 (W4A4), then the shipped rule re-timed in interleaved rounds.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/cublas_chunks_h200.py   # $OUT/cublas_chunks_h200.json
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

dev = torch.device("cuda")
OUT = os.environ.get("OUT", ".")
MS = [int(v) for v in os.environ.get("MS", "512,1024,2048,4096").split(",")]
CHUNKS = [int(v) for v in os.environ.get("CHUNKS", "0,2048,4096,8192").split(",")]
ROUNDS = int(os.environ.get("ROUNDS", "3"))
T0 = time.time()
res = {"env": peers.env(), "sweep": [], "final": []}


def save():
    with open(os.path.join(OUT, "cublas_chunks_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


def timed(chunk, fn):
    gm.CUBLAS_CHUNK_ROWS = chunk
    try:
        return peers.bench(fn) * 1e3
    finally:
        gm.CUBLAS_CHUNK_ROWS = 0


g = torch.Generator(device=dev).manual_seed(0)
data = {}
for name, (n, k) in peers.SHAPES.items():
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    data[name] = (w, nvfp4.quantize(w))

for name, (w, wq) in data.items():
    n, k = w.shape
    for m in MS:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        row = {"shape": name, "m": m, "cublas_bf16_us": peers.bench(lambda: x @ w.t()) * 1e3}
        whole = gm.linear_w4a16(x, wq, path="cublas")
        for chunk in CHUNKS:
            if chunk and chunk >= n:
                continue
            gm.CUBLAS_CHUNK_ROWS = chunk
            y = gm.linear_w4a16(x, wq, path="cublas")
            gm.CUBLAS_CHUNK_ROWS = 0
            row[f"chunk{chunk}_equal"] = bool(torch.equal(y, whole))
            row[f"chunk{chunk}_rel"] = float((y.float() - whole.float()).norm() / whole.float().norm())
            row[f"chunk{chunk}_us"] = timed(chunk, lambda: gm.linear_w4a16(x, wq, path="cublas"))
            if m == 1024:
                amax = x.float().abs().amax()
                row[f"w4a4_chunk{chunk}_us"] = timed(chunk, lambda: gm.linear_w4a4(x, wq, amax, path="cublas"))
        res["sweep"].append(row)
        print(json.dumps({a: (round(b, 4) if isinstance(b, float) else b) for a, b in row.items()}), flush=True)
        save()
print("sweep s", round(time.time() - T0, 1), flush=True)

# interleaved rounds at M = 1024: whole decode, each slice size, cuBLAS bf16
for name, (w, wq) in data.items():
    n, k = w.shape
    x = torch.randn(1024, k, device=dev, dtype=torch.bfloat16, generator=g)
    amax = x.float().abs().amax()
    times = {}
    for _ in range(ROUNDS):
        times.setdefault("cublas_bf16", []).append(peers.bench(lambda: x @ w.t()) * 1e3)
        for chunk in CHUNKS:
            if chunk and chunk >= n:
                continue
            times.setdefault(f"w4a16_chunk{chunk}", []).append(timed(chunk, lambda: gm.linear_w4a16(x, wq, path="cublas")))
            times.setdefault(f"w4a4_chunk{chunk}", []).append(timed(chunk, lambda: gm.linear_w4a4(x, wq, amax, path="cublas")))
    med = {a: statistics.median(b) for a, b in times.items()}
    row = {"shape": name, "m": 1024, "median_us": med, "all_us": times,
           "vs_cublas": {a: med["cublas_bf16"] / b for a, b in med.items()}}
    res["final"].append(row)
    print(json.dumps({"shape": name, **{a: round(b, 3) for a, b in row["vs_cublas"].items()}}), flush=True)
    save()
print("total s", round(time.time() - T0, 1))
save()
