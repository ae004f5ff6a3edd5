"""The dispatch on the linear layers of popular models other than Llama-3.1 (whose shapes every rule
was tuned on): per layer and M, the path picked, its time against cuBLAS bf16 on the same shape, and
its error against the reference decode; so that a shape whose K or N the rules did not foresee shows
up as a slow or wrong row.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/model_zoo_h200.py   # $OUT/model_zoo_h200.json

Where the dispatch picks the warp-specialized GEMM, the dequantize + cuBLAS path it replaced is timed
too (W4A16 and W4A4). Knobs: MS (rows), DTYPE (bf16 | fp16 activations and cuBLAS peer; the fp16 file is model_zoo_h200_fp16.json),
FOUR_SIX (the W4A4 rule, default none), MODELS (a comma-separated subset by name).
"""
from __future__ import annotations

import json
import os
import time

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

dev = torch.device("cuda")
MS = [int(v) for v in os.environ.get("MS", "1,2,16,64,128,1024").split(",")]
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}[os.environ.get("DTYPE", "bf16")]
FOUR_SIX = os.environ.get("FOUR_SIX") or None
MODELS = {  # name: {layer: (N out, K in)}
    "Qwen2-7B": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)},
    "Qwen2-72B": {"qkv": (10240, 8192), "gate_up": (59136, 8192), "down": (8192, 29568)},
    "Llama-2-7B": {"qkv": (12288, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)},
    "Gemma-2-9B": {"qkv": (8192, 3584), "o": (3584, 4096), "gate_up": (28672, 3584), "down": (3584, 14336)},
    "Phi-3-mini": {"qkv": (9216, 3072), "o": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192)},
    "SmolLM2-135M": {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)},
}
if os.environ.get("MODELS"):  # a comma-separated subset of the models by name
    MODELS = {name: MODELS[name] for name in os.environ["MODELS"].split(",")}
T0 = time.time()
res = {"env": peers.env(), "rows": []}
g = torch.Generator(device=dev).manual_seed(0)
for model, layers in MODELS.items():
    for layer, (n, k) in layers.items():
        w = (torch.randn(n, k, device=dev, dtype=torch.float32, generator=g) * 0.02).to(DT)
        wq = nvfp4.quantize(w)
        wref = wq.dequantize(torch.float32)
        for m in MS:
            x = torch.randn(m, k, device=dev, dtype=torch.float32, generator=g).to(DT)
            ref = x.float() @ wref.T
            y = gm.linear_w4a16(x, wq)
            amax = x.float().abs().amax()
            y4 = gm.linear_w4a4(x, wq, amax, four_six=FOUR_SIX)
            ref4 = nvfp4.quantize(x, FOUR_SIX, amax=amax).dequantize(torch.float32) @ wref.T
            row = {"model": model, "layer": layer, "n": n, "k": k, "m": m,
                   "dtype": str(DT), "four_six": FOUR_SIX,
                   "path": gm._auto_path(m, DT, False, k, dev, n),
                   "rel_err": float((y.float() - ref).norm() / ref.norm()),
                   "w4a4_rel_err": float((y4.float() - ref4).norm() / ref4.norm()),
                   "cublas_us": peers.bench(lambda: x @ w.t()) * 1e3,
                   "ours_us": peers.bench(lambda: gm.linear_w4a16(x, wq)) * 1e3,
                   "w4a4_us": peers.bench(lambda: gm.linear_w4a4(x, wq, amax, four_six=FOUR_SIX)) * 1e3}
            row["speedup"] = row["cublas_us"] / row["ours_us"]
            if row["path"] == "wsgemm":  # what the rows before the warp-specialized kernel took
                row["dequant_cublas_us"] = peers.bench(lambda: gm.linear_w4a16(x, wq, path="cublas")) * 1e3
            if gm._auto_path(m, DT, True, k, dev, n) == "wsgemm":
                row["w4a4_cublas_path_us"] = peers.bench(
                    lambda: gm.linear_w4a4(x, wq, amax, four_six=FOUR_SIX, path="cublas")) * 1e3
            res["rows"].append(row)
            print(f"{model:13s} {layer:8s} {n:6d}x{k:<6d} M={m:<5d} {row['path']:7s} err {row['rel_err']:.1e} "
                  f"w4a4 err {row['w4a4_rel_err']:.1e}  cuBLAS {row['cublas_us']:8.1f}  ours {row['ours_us']:8.1f} "
                  f"({row['speedup']:.2f}x)  w4a4 {row['w4a4_us']:8.1f}  [dequant+cuBLAS "
                  f"{row.get('dequant_cublas_us', float('nan')):7.1f}, w4a4 {row.get('w4a4_cublas_path_us', float('nan')):7.1f}]",
                  flush=True)
        del w, wq, wref
        torch.cuda.empty_cache()
name = "model_zoo_h200" + ("_fp16" if DT == torch.float16 else "") + ".json"
with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
    json.dump(res, f, indent=1)
print("total s", round(time.time() - T0, 1))
