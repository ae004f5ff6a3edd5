"""mma.py's K-split launches summed by each tile's last program (``mma.finish_split``, per-tile
counters) against gemm.py's second, summing launch, on the H200. Correctness first: the two must
give the same bits (the same fp32 sums in the same order), call after call (a counter left non-zero
or a race would show as a difference), plans included; then interleaved rounds (medians, CUDA-graph
replays of 10 calls, as the kernel table) at small M on Llama-3.1 layers, with cuBLAS bf16.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/split_fixup_h200.py   # $OUT/split_fixup_h200.json

Knobs: PHASES (default "checks,time"), MS (default 2,4,8,16,32,64), SHAPES (layer names), ROUNDS (3),
REPEATS (bit-equality repeats a check, default 30), BUDGET_S, JSON (file name).
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import mma

dev = torch.device("cuda")
T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "300"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
REPEATS = int(os.environ.get("REPEATS", "30"))
MS = [int(v) for v in os.environ.get("MS", "2,4,8,16,32,64").split(",")]
LAYERS = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672), "8B.k": (1024, 4096)}
SHAPES = os.environ.get("SHAPES", ",".join(LAYERS)).split(",")
PHASES = os.environ.get("PHASES", "checks,time").split(",")
out_path = os.path.join(os.environ.get("OUT", "."), os.environ.get("JSON", "split_fixup_h200.json"))
res = {"env": peers.env(), "ready": None, "checks": [], "time": []}


def save():
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


def rel(y, ref):
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def mode(fixup: bool, fn):
    """Run ``fn`` with the K-split programs summing their tiles (True) or the summing launch (False)."""
    shipped = gm.SPLIT_FIXUP
    gm.SPLIT_FIXUP = fixup
    try:
        return fn()
    finally:
        gm.SPLIT_FIXUP = shipped


def interleaved(fns: dict) -> dict:
    times = {}
    for _ in range(ROUNDS):
        for label, fn in fns.items():
            try:
                times.setdefault(label, []).append(peers.bench(fn) * 1e3)
            except Exception as exc:  # noqa: BLE001 - record and go on
                times[label] = repr(exc)[:300]
    return {a: (statistics.median(b) if isinstance(b, list) else b) for a, b in times.items()}


res["ready"] = mma.ready(dev)
print("ready:", res["ready"], f"{time.time() - T0:.1f}s", flush=True)
save()
g = torch.Generator(device=dev).manual_seed(0)

# (M, N, K, dtype, bias, W4A4): partial row tiles, uneven K ranges, 8-way splits, fp16, W4A4
CHECKS = [(5, 200, 2048, torch.bfloat16, True, False), (16, 6144, 4096, torch.bfloat16, False, False),
          (16, 4096, 14336, torch.bfloat16, True, False), (33, 1000, 2048, torch.float16, True, False),
          (64, 8192, 28672, torch.bfloat16, False, False), (2, 4096, 4096, torch.bfloat16, True, False),
          (7, 200, 1664, torch.bfloat16, False, False), (16, 4096, 4096, torch.bfloat16, True, True),
          (3, 1024, 4096, torch.float16, False, True)]
for m, n, k, dt, bias, w4a4 in (CHECKS if "checks" in PHASES else []):
    w = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    x = torch.randn(m, k, device=dev, generator=g).to(dt)
    b = torch.randn(n, device=dev, generator=g).to(dt) if bias else None
    ref = x.float() @ w.dequantize(torch.float32).T + (b.float() if bias else 0)
    amax = x.float().abs().amax()
    if w4a4:
        call = lambda: gm.linear_w4a4(x, w, amax, b, path="mma")  # noqa: E731
    else:
        call = lambda: gm.linear_w4a16(x, w, b, path="mma")  # noqa: E731
    cfg = mma.config(m, n, k)
    row = {"m": m, "n": n, "k": k, "dtype": str(dt), "bias": bias, "w4a4": w4a4, "splits": -(-k // cfg[4])}
    y_sum = mode(False, call)
    diffs = 0
    for _ in range(REPEATS):
        y_fix = mode(True, call)
        diffs += int(not torch.equal(y_fix, y_sum))
    row["fixup_runs_differing"] = diffs
    row["rel_ref"] = rel(y_fix, ref)
    if not w4a4:  # a launch plan (own counters), its replaying third call included
        x3 = x.reshape(1, m, k)
        y_auto = mode(False, lambda: gm.linear_w4a16(x, w, b))
        plan = mode(True, lambda: gm.linear_plan(x3, w, b))
        outs = [plan(x3) for _ in range(4)] if plan is not None else []
        row["plan_path"] = gm._auto_path(m, dt, False, k, dev, n)
        row["plan_runs_differing"] = sum(int(not torch.equal(o.reshape(m, n), y_auto)) for o in outs)
        row["plan_calls"] = len(outs)
    res["checks"].append(row)
    print(row, flush=True)
    save()

for name in (SHAPES if "time" in PHASES else []):
    n, k = LAYERS[name]
    w = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    wb = w.dequantize(torch.bfloat16)
    for m in MS:
        if time.time() - T0 > BUDGET:
            break
        x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
        cfg = mma.config(m, n, k)
        row = {"layer": name, "m": m, "n": n, "k": k, "splits": -(-k // cfg[4]), "path": gm._auto_path(
            m, torch.bfloat16, False, k, dev, n)}
        fns = {"summing": lambda: mode(False, lambda: gm.linear_w4a16(x, w, path="mma")),
               "fixup": lambda: mode(True, lambda: gm.linear_w4a16(x, w, path="mma")),
               "cublas": lambda: x @ wb.T}
        if row["path"] != "mma":
            fns["dispatch"] = lambda: gm.linear_w4a16(x, w)
        row.update(interleaved(fns))
        res["time"].append(row)
        print(row, f"{time.time() - T0:.0f}s", flush=True)
        save()
print("done", f"{time.time() - T0:.0f}s")
