"""mma.py at small M: the shipped cp.async ring against the x-segment mode (STAGES < 0: the activations
copied into shared memory -STAGES K steps at a time, two barriers a segment; each warp loads its own
weight rows straight into registers one step ahead, with no barrier a step). Every output is checked
against the reference decode and, bit for bit, against the shipped config's (same MMAs in the same
order); then 3 interleaved rounds of CUDA-graph replays (medians, us).

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/mma_xseg_h200.py   # $OUT/mma_xseg_h200.json
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
MS = [int(v) for v in os.environ.get("MS", "16,4").split(",")]
LAYERS = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672)}
assert mma.ready(dev) is None
sms = gm._sm_count(dev)
out = {"env": peers.env(), "rows": []}


def variants(m, n, k):
    shipped = mma.config(m, n, k, sms)
    bn, bm, bk, warps, kp, st = shipped
    cfgs = {"shipped": (shipped, 128)}
    for nbn, nw, nbk, segs, cap in ((bn, warps, bk, 8, 128), (bn, warps, bk, 4, 128), (bn, warps, bk, 16, 128),
                                    (bn, warps, bk, 8, 0), (bn, warps, 64, 16, 128), (2 * bn, 2 * warps, bk, 8, 128),
                                    (64, 2, bk, 8, 128)):
        c = (nbn, bm, nbk, nw, mma.k_split(n, k, nbn, nbk, sms), -segs)
        cfgs[f"xseg{segs}_bn{nbn}_w{nw}_bk{nbk}" + ("" if cap else "_nocap")] = (c, cap)
    return cfgs


for M in MS:
    for name, (n, k) in LAYERS.items():
        wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
        _, _, words, sbits, enc = gm._weight_views(wq)
        x = torch.randn(M, k, device=dev, generator=g).bfloat16()
        ref = x.float() @ wq.dequantize(torch.float32).T
        y = torch.empty(M, n, device=dev, dtype=torch.bfloat16)
        row = {"layer": name, "m": M, "cfgs": {}, "rel_ref": {}, "equal_shipped": {}, "errors": {}}
        fns = {"cublas_bf16": (lambda wb=wq.dequantize(torch.bfloat16): x @ wb.t())}
        base = None

        def call(cfg, cap, out_y):
            mma.XSEG_MAXNREG = cap
            return mma.matmul(x, words, sbits, enc, None, None, out_y, cfg)

        for label, (cfg, cap) in variants(M, n, k).items():
            row["cfgs"][label] = [cfg, cap]
            try:
                got = call(cfg, cap, torch.full_like(y, float("nan")))
                torch.cuda.synchronize()
                row["rel_ref"][label] = float((got.float() - ref).norm() / ref.norm())
                if base is None:
                    base = got
                row["equal_shipped"][label] = bool(torch.equal(got, base))
                fns[label] = (lambda c=cfg, cp=cap: call(c, cp, y))
            except Exception as exc:  # noqa: BLE001 - a config that does not build or fit
                row["errors"][label] = repr(exc)[:300]
        times = {}
        for _ in range(ROUNDS):
            for label, fn in fns.items():
                times.setdefault(label, []).append(peers.bench(fn) * 1e3)
        row["median_us"] = {a: statistics.median(b) for a, b in times.items()}
        out["rows"].append(row)
        print(json.dumps({"layer": name, "m": M, "median_us": {a: round(b, 2) for a, b in row["median_us"].items()},
                          "errors": row["errors"], "worst_rel": max(row["rel_ref"].values()),
                          "unequal": [a for a, b in row["equal_shipped"].items() if not b]}), flush=True)
        json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "mma_xseg_h200.json"), "w"), indent=1)
