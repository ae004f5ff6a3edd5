"""The streamed-x GEMV (gemv7) as the dispatch runs it on the long-K layers: W4A16 and W4A4 (static
amax) at M = 1, 2, 3, with a bias, on contiguous and strided activations, against the reference in
fp32 (W4A4: the reference's own quantized activations times the dequantized weight); then the same
call in a CUDA graph, replayed, compared bit for bit with the eager call.

    PYTHONPATH=$PWD python benchmarks/gemv7_check_h200.py   # $OUT/gemv7_check_h200.json
"""
from __future__ import annotations

import json
import os

import torch

from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

dev = torch.device("cuda")
LAYERS = {"70B.down": (8192, 28672), "8B.down": (4096, 14336), "Qwen2-7B.down": (3584, 18944),
          "Llama-2-7B.down": (4096, 11008), "Qwen2-72B.down": (8192, 29568)}
g = torch.Generator(device=dev).manual_seed(0)
rows, worst = [], 0.0
for name, (n, k) in LAYERS.items():
    assert gm._gemv7_config(1, n, k) is not None, name
    wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    wf = wq.dequantize(torch.float32)
    bias = torch.randn(n, device=dev, generator=g).bfloat16()
    for m in (1, 2, 3):
        big = torch.randn(m, k + 8, device=dev, generator=g).bfloat16()
        for label, x in (("contiguous", big[:, :k].contiguous()), ("strided", big[:, 8:])):
            amax = x.float().abs().amax().reshape(1)
            y16 = gm.linear_w4a16(x, wq, bias)
            ref16 = x.float() @ wf.T + bias.float()
            y4 = gm.linear_w4a4(x, wq, amax, bias)
            xq = nvfp4.quantize(x.float(), amax=amax).dequantize(torch.float32)
            ref4 = xq @ wf.T + bias.float()
            e16 = float((y16.float() - ref16).norm() / ref16.norm())
            e4 = float((y4.float() - ref4).norm() / ref4.norm())
            worst = max(worst, e16, e4)
            rows.append({"layer": name, "m": m, "x": label, "w4a16": e16, "w4a4": e4,
                         "finite": bool(torch.isfinite(y16).all() and torch.isfinite(y4).all())})
    x = torch.randn(1, k, device=dev, generator=g).bfloat16()
    out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    eager = gm.linear_w4a16(x, wq, bias).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gm.linear_w4a16(x, wq, bias, out=out)
    graph.replay()
    torch.cuda.synchronize()
    rows.append({"layer": name, "graph_equals_eager": bool(torch.equal(out, eager))})
    print(json.dumps(rows[-1]), flush=True)
ok = worst < 1e-2 and all(r.get("finite", True) and r.get("graph_equals_eager", True) for r in rows)
print("worst", worst, "all_ok", ok)
with open(os.path.join(os.environ.get("OUT", "."), "gemv7_check_h200.json"), "w") as f:
    json.dump({"rows": rows, "worst": worst, "all_ok": ok}, f, indent=1)
