"""The short-K wide-layer rule of wsgemm (``MIN_K_WIDE`` / ``MIN_N_WIDE``: K = 3072-3584 on layers of
8192 rows and more take the warp-specialized GEMM) re-timed where session 23's one-pass model-zoo run
put Gemma-2-9B gate_up at M = 1024 3.7% behind dequantize + cuBLAS. Both paths on the same data, bits
of neither changed, in interleaved rounds (medians of CUDA-graph replays of 10 calls).

    PYTHONPATH=$PWD:$PWD/.peers:$PWD/benchmarks python benchmarks/shortk_rule_h200.py   # $OUT/shortk_rule_h200.json

Knobs: ROUNDS (5), MS (512,768,1024).
"""
from __future__ import annotations

import json
import os
import time

import torch

import peers_h200 as peers
from _rounds import interleaved, rel
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

dev = torch.device("cuda")
T0 = time.time()
ROUNDS = int(os.environ.get("ROUNDS", "5"))
MS = [int(v) for v in os.environ.get("MS", "512,768,1024").split(",")]
LAYERS = [("Gemma-2-9B.gate_up", 28672, 3584), ("Gemma-2-9B.qkv", 8192, 3584), ("Qwen2-7B.gate_up", 37888, 3584),
          ("Phi-3-mini.gate_up", 16384, 3072)]
res = {"env": peers.env(), "rows": []}
g = torch.Generator(device=dev).manual_seed(0)
for name, n, k in LAYERS:
    w = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    wb = w.dequantize(torch.bfloat16)
    for m in MS:
        x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
        ref = x.float() @ w.dequantize(torch.float32).T
        row = {"layer": name, "m": m, "dispatch": gm._auto_path(m, x.dtype, False, k, dev, n),
               "err_wsgemm": rel(gm.linear_w4a16(x, w, path="wsgemm"), ref),
               "err_cublas": rel(gm.linear_w4a16(x, w, path="cublas"), ref)}
        row.update(interleaved({"wsgemm": lambda: gm.linear_w4a16(x, w, path="wsgemm"),
                                "dequant_cublas": lambda: gm.linear_w4a16(x, w, path="cublas"),
                                "cublas_bf16": lambda: x @ wb.T}, ROUNDS))
        res["rows"].append(row)
        print(row, f"{time.time() - T0:.0f}s", flush=True)
        with open(os.path.join(os.environ.get("OUT", "."), "shortk_rule_h200.json"), "w") as f:
            json.dump(res, f, indent=1)
print("done", f"{time.time() - T0:.0f}s")
