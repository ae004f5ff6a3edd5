"""mma.py on small layers (M = 2..16): is splitting K (partial sums + a summing launch) worth it where
the layer is small? The shipped config against the same tiles with K whole and with K split once more,
3 interleaved rounds (medians), cuBLAS bf16 beside; and W4A4 with fp16 activations at M = 1024 after the
output-scaling change (against model_zoo_h200_fp16.json's figures from before it).

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/mma_small_h200.py   # $OUT/mma_small_h200.json
"""
from __future__ import annotations

import json
import os
import statistics

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import mma

dev = torch.device("cuda")
ROUNDS = int(os.environ.get("ROUNDS", "3"))
SHAPES = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "Qwen2-7B.qkv": (4608, 3584), "Qwen2-7B.o": (3584, 3584),
          "Phi-3-mini.o": (3072, 3072), "Gemma-2-9B.o": (3584, 4096), "SmolLM2.down": (576, 1536)}
shipped = mma.config
res = {"env": peers.env(), "rows": [], "w4a4_fp16": []}
g = torch.Generator(device=dev).manual_seed(0)
for name, (n, k) in SHAPES.items():
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    wq = nvfp4.quantize(w)
    for m in (2, 8, 16):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        base = shipped(m, n, k)
        variants = {"shipped": base, "k_whole": base[:4] + (k,) + base[5:]}
        if base[4] // 2 >= base[2] and (base[4] // 2) % base[2] == 0:
            variants["k_half"] = base[:4] + (base[4] // 2,) + base[5:]
        ref = gm.linear_w4a16(x, wq, path="mma")
        row = {"shape": name, "m": m, "configs": {a: list(b) for a, b in variants.items()}, "rel_to_shipped": {}}
        times = {}
        for _ in range(ROUNDS):
            times.setdefault("cublas", []).append(peers.bench(lambda: x @ w.t()) * 1e3)
            for label, cfg in variants.items():
                mma.config = lambda *a, c=cfg: c
                try:
                    if label not in row["rel_to_shipped"]:
                        y = gm.linear_w4a16(x, wq, path="mma")
                        row["rel_to_shipped"][label] = float((y.float() - ref.float()).norm() / ref.float().norm())
                    times.setdefault(label, []).append(peers.bench(lambda: gm.linear_w4a16(x, wq, path="mma")) * 1e3)
                finally:
                    mma.config = shipped
        row["median_us"] = {a: statistics.median(b) for a, b in times.items()}
        res["rows"].append(row)
        print(json.dumps({"shape": name, "m": m, **{a: round(b, 2) for a, b in row["median_us"].items()},
                          "cfg": row["configs"]["shipped"][4]}), flush=True)
for name, (n, k) in (("Qwen2-7B.gate_up", (37888, 3584)), ("Phi-3-mini.o", (3072, 3072)), ("Llama-2-7B.qkv", (12288, 4096))):
    w = (torch.randn(n, k, device=dev, generator=g) * 0.02).half()
    wq = nvfp4.quantize(w)
    x = torch.randn(1024, k, device=dev, generator=g).half()
    amax = x.float().abs().amax()
    row = {"shape": name, "m": 1024, "cublas_fp16_us": peers.bench(lambda: x @ w.t()) * 1e3,
           "w4a16_us": peers.bench(lambda: gm.linear_w4a16(x, wq)) * 1e3,
           "w4a4_mse_us": peers.bench(lambda: gm.linear_w4a4(x, wq, amax, four_six="mse")) * 1e3}
    res["w4a4_fp16"].append(row)
    print(json.dumps({a: (round(b, 2) if isinstance(b, float) else b) for a, b in row.items()}), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "mma_small_h200.json"), "w") as f:
    json.dump(res, f, indent=1)
