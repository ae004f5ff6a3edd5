"""wsmma.py (experimental: one-warp consumers fed by a TMA loader on mbarrier rings) at small M against
mma.py: outputs checked bit for bit against mma.py at the same K split and against the reference
decode, then 3 interleaved rounds of CUDA-graph replays (medians, us) on the Llama-3.1 layers.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/wsmma_h200.py   # $OUT/wsmma_h200.json
"""
import json
import os
import statistics
import time

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import mma, wsmma

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(5)
ROUNDS = int(os.environ.get("ROUNDS", "3"))
MS = [int(v) for v in os.environ.get("MS", "16").split(",")]
LAYERS = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672)}
assert mma.ready(dev) is None
sms = gm._sm_count(dev)
out = {"env": peers.env(), "checks": [], "rows": []}
path = os.path.join(os.environ.get("OUT", "."), "wsmma_h200.json")
T0 = time.time()


def save():
    json.dump(out, open(path, "w"), indent=1)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


for m, n, k, dt, bias in ((16, 1000, 4096, torch.bfloat16, False), (3, 6144, 4096, torch.bfloat16, True),
                          (16, 57344, 8192, torch.bfloat16, False), (5, 900, 2304, torch.float16, True),
                          (16, 8192, 28672, torch.bfloat16, False)):
    wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    _, _, words, sbits, enc = gm._weight_views(wq)
    x = torch.randn(m, k, device=dev, generator=g).to(dt)
    b = torch.randn(n, device=dev, generator=g).to(dt) if bias else None
    ref = x.float() @ wq.dequantize(torch.float32).T + (b.float() if bias else 0)
    row = {"m": m, "n": n, "k": k, "dtype": str(dt), "bias": bias}
    try:
        cfg = wsmma.config(m, n, k, sms)
        row["cfg"] = cfg
        got = wsmma.matmul(x, words, sbits, enc, None, b, torch.full((m, n), float("nan"), device=dev, dtype=dt))
        torch.cuda.synchronize()
        row["ran"] = True
        row["rel_ref"] = rel(got, ref)
        same = mma.matmul(x, words, sbits, enc, None, b, torch.full((m, n), float("nan"), device=dev, dtype=dt),
                          (128, 16, 64, 4, cfg[2] * 64, 3))
        row["equal_mma_same_split"] = bool(torch.equal(got, same))
        row["rel_mma"] = rel(got, same)
    except Exception as exc:  # noqa: BLE001 - record and go on
        row["error"] = repr(exc)[:500]
    out["checks"].append(row)
    print(json.dumps(row), flush=True)
    save()
    if "error" in row or not row["rel_ref"] < 1e-2:
        raise SystemExit("wsmma check failed; no timing")

for M in MS:
    for name, (n, k) in LAYERS.items():
        wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
        _, _, words, sbits, enc = gm._weight_views(wq)
        x = torch.randn(M, k, device=dev, generator=g).bfloat16()
        ref = x.float() @ wq.dequantize(torch.float32).T
        y = torch.empty(M, n, device=dev, dtype=torch.bfloat16)
        cons, stages, per, regs = wsmma.config(M, n, k, sms)
        steps = k // 64
        cfgs = {"default": (cons, stages, per, regs)}
        t4 = -(-n // 256)
        for waves in (2, 4):  # K ranges for about this many programs an SM
            p = max(4, -(-steps // max(1, round(waves * sms / t4))))
            p = min(steps, -(-p // 4) * 4)
            cfgs.setdefault(f"ranges_{p}", (4, stages, p, regs))
        fns = {"cublas_bf16": (lambda wb=wq.dequantize(torch.bfloat16): x @ wb.t()),
               "mma": lambda: mma.matmul(x, words, sbits, enc, None, None, y)}
        row = {"layer": name, "m": M, "cfgs": cfgs, "rel_ref": {}, "errors": {}}
        def call(c, out_y, mul=True):
            wsmma.MUL_DECODE = mul
            try:
                return wsmma.matmul(x, words, sbits, enc, None, None, out_y, c)
            finally:
                wsmma.MUL_DECODE = True

        for label, cfg in list(cfgs.items()) + [("default_shift_decode", cfgs["default"])]:
            mul = "shift" not in label
            try:
                got = call(cfg, torch.full_like(y, float("nan")), mul)
                row["rel_ref"][label] = rel(got, ref)
                fns[label] = (lambda c=cfg, u=mul: call(c, y, u))
            except Exception as exc:  # noqa: BLE001
                row["errors"][label] = repr(exc)[:300]
        times = {}
        for _ in range(ROUNDS):
            for label, fn in fns.items():
                times.setdefault(label, []).append(peers.bench(fn) * 1e3)
        row["median_us"] = {a: statistics.median(b) for a, b in times.items()}
        out["rows"].append(row)
        print(json.dumps({"layer": name, "m": M, "median_us": {a: round(b, 2) for a, b in row["median_us"].items()},
                          "errors": row["errors"], "worst_rel": max(row["rel_ref"].values(), default=None)}), flush=True)
        save()
print(f"done {time.time() - T0:.0f}s")
