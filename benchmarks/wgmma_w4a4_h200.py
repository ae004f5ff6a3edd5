"""W4A4 through the wgmma kernel (65 <= M <= 128) on the H200: the dispatch's output against the
tiled GEMM (same exact operands, fp32 sums) and the reference decode, then time per call against the
path it replaces (quantize + dequantize + cuBLAS) and cuBLAS bf16.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/wgmma_w4a4_h200.py   # writes $OUT/wgmma_w4a4_h200.json
"""
from __future__ import annotations

import json
import os

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import wgmma

dev = torch.device("cuda")
res = {"env": peers.env(), "ready": None, "rows": []}
res["ready"] = wgmma.ready(dev)
print("wgmma ready:", res["ready"], flush=True)
g = torch.Generator(device=dev).manual_seed(0)
for name, (n, k) in peers.SHAPES.items():
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    wq = nvfp4.quantize(w)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=g)
    for m in (65, 100, 128):
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
            amax = x.float().abs().amax() * 0.9
            row = {"shape": name, "m": m, "dtype": str(dtype),
                   "auto_path": gm._auto_path(m, dtype, True, k, dev, n)}
            got = gm.linear_w4a4(x, wq, amax, bias, four_six="mse")
            tiled = gm.linear_w4a4(x, wq, amax, bias, four_six="mse", path="gemm")
            xq = nvfp4.quantize(x, "mse", amax=amax).dequantize(torch.float32)
            ref = xq @ wq.dequantize(torch.float32).T + bias.float()
            row["rel_err_vs_tiled"] = float((got.float() - tiled.float()).norm() / tiled.float().norm())
            row["rel_err_vs_reference"] = float((got.float() - ref).norm() / ref.norm())
            if m == 128 or dtype == torch.bfloat16 and m == 65:
                row["w4a4_us"] = peers.bench(lambda: gm.linear_w4a4(x, wq, amax)) * 1e3
                row["w4a4_cublas_us"] = peers.bench(lambda: gm.linear_w4a4(x, wq, amax, path="cublas")) * 1e3
                row["cublas_bf16_us"] = peers.bench(lambda: x @ w.t().to(dtype)) * 1e3
            res["rows"].append(row)
            print(json.dumps({a: (round(b, 5) if isinstance(b, float) else b) for a, b in row.items()}), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "wgmma_w4a4_h200.json"), "w") as f:
    json.dump(res, f, indent=1)
