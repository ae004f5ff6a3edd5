"""Two dispatch rules re-timed after the summing pass became a programmatic dependent of its split
kernel (session 24, results/split_pdl_h200*.json), since both weighed a split's summing cost:

1. m2: at M = 2 the narrow single-segment layers take gemv6 (one segment, no summing pass) and the
   others mma.py (K split, summing pass). gemv6 against mma.py on the narrow layers, W4A16 and W4A4
   (gemv6 quantizes the activations in its prologue, mma.py after a quantize launch).
2. ksplit: mma.py's K split at M = 16 (``mma.k_split``: about three programs an SM, 1024 K or more a
   program), halved and doubled against the rule's.

Outputs checked against the exact product (within 1e-2); interleaved rounds, medians of CUDA-graph
replays of 10 calls.

    PYTHONPATH=$PWD:$PWD/.peers:$PWD/benchmarks python benchmarks/split_rules_h200.py   # $OUT/split_rules_h200.json

Knobs: ROUNDS (5), PHASES ("m2,ksplit"), DTYPES (the m2 activations: "bf16"; "bf16,fp16"), JSON.
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
from fp4ptq.kernels import mma

dev = torch.device("cuda")
T0 = time.time()
ROUNDS = int(os.environ.get("ROUNDS", "5"))
PHASES = os.environ.get("PHASES", "m2,ksplit").split(",")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
M2_DTYPES = [DTYPES[d] for d in os.environ.get("DTYPES", "bf16").split(",")]
res = {"env": peers.env(), "split_pdl": gm.split_pdl(dev), "m2": [], "ksplit": []}
g = torch.Generator(device=dev).manual_seed(0)


def save():
    with open(os.path.join(os.environ.get("OUT", "."), os.environ.get("JSON", "split_rules_h200.json")), "w") as f:
        json.dump(res, f, indent=1)


def layer(n, k, m, dtype=torch.bfloat16):
    w = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    x = torch.randn(m, k, device=dev, generator=g).to(dtype)
    return w, x, x.float() @ w.dequantize(torch.float32).T


M2_LAYERS = [("8B.qkv", 6144, 4096), ("8B.o", 4096, 4096), ("Gemma-2-9B.o", 3584, 4096),
             ("Qwen2-7B.qkv", 4608, 3584), ("Qwen2-7B.o", 3584, 3584)]
for (name, n, k), dtype in [(lay, dt) for dt in M2_DTYPES for lay in M2_LAYERS] if "m2" in PHASES else []:
    w, x, ref = layer(n, k, 2, dtype)
    amax = x.float().abs().amax()
    fns = {p: (lambda p=p: gm.linear_w4a16(x, w, path=p)) for p in ("gemv6", "mma")}
    fns.update({f"{p}_w4a4": (lambda p=p: gm.linear_w4a4(x, w, amax, path=p)) for p in ("gemv6", "mma")})
    row = {"layer": name, "m": 2, "dtype": str(dtype), "dispatch": gm._auto_path(2, x.dtype, False, k, dev, n),
           **{f"err_{p}": rel(f(), ref) for p, f in fns.items()}, **interleaved(fns, ROUNDS)}
    res["m2"].append(row)
    print(row, f"{time.time() - T0:.0f}s", flush=True)
    save()

KSPLIT_LAYERS = [("8B.qkv", 6144, 4096), ("8B.o", 4096, 4096), ("8B.down", 4096, 14336), ("8B.k", 1024, 4096)]
for name, n, k in KSPLIT_LAYERS if "ksplit" in PHASES else []:
    w, x, ref = layer(n, k, 16)
    words, sbits, enc = gm._weight_views(w)[2:]
    bn, bm, bk, warps, ks, stages = mma.config(16, n, k)
    fns, row = {}, {"layer": name, "m": 16, "config": [bn, bm, bk, warps, ks, stages]}
    for label, kk in (("rule", ks), ("half", ks // 2), ("double", min(k, ks * 2))):
        if kk % bk or kk < bk:
            continue
        cfg = (bn, bm, bk, warps, kk, stages)
        call = (lambda cfg=cfg: mma.matmul(x, words, sbits, enc, None, None,
                                           torch.empty(16, n, device=dev, dtype=torch.bfloat16), cfg))
        row[f"err_{label}"] = rel(call(), ref)
        row[f"k_per_program_{label}"] = kk
        fns[label] = call
    row.update(interleaved(fns, ROUNDS))
    res["ksplit"].append(row)
    print(row, f"{time.time() - T0:.0f}s", flush=True)
    save()
print("done", f"{time.time() - T0:.0f}s")
