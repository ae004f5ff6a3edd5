"""M = 2 (bf16 and fp16) and M = 1 (fp16) on layers of at most 4096 x 4096 weights, where the dispatch
keeps the GEMV (gemv6 for bf16, gemv4 for fp16): the GEMV against mma.py, 3 interleaved rounds (medians),
cuBLAS beside, outputs compared with the reference decode. ``ONLY`` picks layers (the larger ones listed
too), ``DTYPES`` bf16 and / or fp16.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/m2_small_h200.py   # $OUT/m2_small_h200.json
"""
from __future__ import annotations

import json
import os
import statistics

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

dev = torch.device("cuda")
ROUNDS = int(os.environ.get("ROUNDS", "3"))
SHAPES = {"8B.o": (4096, 4096), "Qwen2-7B.qkv": (4608, 3584), "Qwen2-7B.o": (3584, 3584),
          "Gemma-2-9B.o": (3584, 4096), "Phi-3-mini.o": (3072, 3072), "SmolLM2.qkv": (960, 576),
          "SmolLM2.gate_up": (3072, 576), "SmolLM2.down": (576, 1536), "8B.qkv": (6144, 4096),
          "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336), "70B.gate_up": (57344, 8192),
          "70B.down": (8192, 28672), "Qwen2-7B.down": (3584, 18944), "Llama-2-7B.down": (4096, 11008)}
SHAPES = {a: b for a, b in SHAPES.items() if a in os.environ.get("ONLY", "8B.o,Qwen2-7B.qkv,Qwen2-7B.o,Gemma-2-9B.o,"
                                                                "Phi-3-mini.o,SmolLM2.qkv,SmolLM2.gate_up,SmolLM2.down,"
                                                                "8B.qkv").split(",")}
DTYPES = os.environ.get("DTYPES", "bf16,fp16").split(",")  # bf16: M = 2; fp16: M = 1 and 2
res = {"env": peers.env(), "rows": []}
g = torch.Generator(device=dev).manual_seed(0)
for name, (n, k) in SHAPES.items():
    for dtype, ms in [(d, m) for d, m in ((torch.bfloat16, (2,)), (torch.float16, (1, 2)))
                      if {torch.bfloat16: "bf16", torch.float16: "fp16"}[d] in DTYPES]:
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(dtype)
        wq = nvfp4.quantize(w)
        gemv = "gemv6" if dtype == torch.bfloat16 else "gemv4"
        for m in ms:
            x = torch.randn(m, k, device=dev, generator=g).to(dtype)
            ref = x.float() @ wq.dequantize(torch.float32).T
            row = {"shape": name, "m": m, "dtype": str(dtype), "auto": gm._auto_path(m, dtype, False, k, dev, n),
                   "err": {p: float((gm.linear_w4a16(x, wq, path=p).float() - ref).norm() / ref.norm())
                           for p in (gemv, "mma")}}
            times = {}
            for _ in range(ROUNDS):
                times.setdefault("cublas", []).append(peers.bench(lambda: x @ w.t()) * 1e3)
                for p in (gemv, "mma"):
                    times.setdefault(p, []).append(peers.bench(lambda: gm.linear_w4a16(x, wq, path=p)) * 1e3)
            row["median_us"] = {a: statistics.median(b) for a, b in times.items()}
            res["rows"].append(row)
            print(json.dumps({"shape": name, "m": m, "dtype": str(dtype)[6:], "auto": row["auto"],
                              **{a: round(b, 2) for a, b in row["median_us"].items()}}), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "m2_small_h200.json"), "w") as f:
    json.dump(res, f, indent=1)
