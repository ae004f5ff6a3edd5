"""mma.py at small M: the activations' cp.async copies as 16-byte cp.async.cg (L2 only, shipped) against
8-byte cp.async.ca (through L1, where the other programs on the SM find the same activations), with
every output checked bit for bit against the shipped copies' and against the reference decode; 3
interleaved rounds of CUDA-graph replays (medians, us). Session 13's profile
(results/ncu_mma_70b_gate_up_m16_st3_s13.txt): L2 60% busy at 43% of DRAM, L1 hit rate 19%.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/mma_xcopy_h200.py   # $OUT/mma_xcopy_h200.json
"""
import json
import os
import statistics

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import mma

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(5)
ROUNDS = int(os.environ.get("ROUNDS", "3"))
MS = [int(v) for v in os.environ.get("MS", "16,4,64").split(",")]
LAYERS = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672)}
assert mma.ready(dev) is None
out = {"env": peers.env(), "rows": []}
for M in MS:
    for name, (n, k) in LAYERS.items():
        wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
        _, _, words, sbits, enc = gm._weight_views(wq)
        x = torch.randn(M, k, device=dev, generator=g).bfloat16()
        ref = x.float() @ wq.dequantize(torch.float32).T
        y = torch.empty(M, n, device=dev, dtype=torch.bfloat16)

        def call(vec, out_y):
            mma.X_COPY_VEC = vec
            return mma.matmul(x, words, sbits, enc, None, None, out_y)

        row = {"layer": name, "m": M, "config": mma.config(M, n, k, gm._sm_count(dev))}
        base = call(8, torch.full_like(y, float("nan"))).clone()
        got = call(4, torch.full_like(y, float("nan")))
        row["equal"] = bool(torch.equal(base, got))
        row["rel_ref"] = float((got.float() - ref).norm() / ref.norm())
        fns = {"cublas_bf16": (lambda wb=wq.dequantize(torch.bfloat16): x @ wb.t()),
               "x16_cg": lambda: call(8, y), "x8_ca": lambda: call(4, y)}
        times = {}
        for _ in range(ROUNDS):
            for label, fn in fns.items():
                times.setdefault(label, []).append(peers.bench(fn) * 1e3)
        mma.X_COPY_VEC = 8
        row["median_us"] = {a: statistics.median(b) for a, b in times.items()}
        out["rows"].append(row)
        print(json.dumps({"layer": name, "m": M, "equal": row["equal"], "rel": round(row["rel_ref"], 5),
                          "median_us": {a: round(b, 2) for a, b in row["median_us"].items()}}), flush=True)
        json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "mma_xcopy_h200.json"), "w"), indent=1)
