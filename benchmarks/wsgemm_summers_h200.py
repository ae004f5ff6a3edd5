"""wsgemm's split tiles summed inside the launch by the whole-tile programs that end early
(``wsgemm.summing_plan``) against gemm.py's summing launch, on the H200. Correctness first: both must
give the same bits (the same fp32 partials added in the same order), call after call (a counter left
non-zero or a race would show), in launch plans too; then interleaved rounds (medians, CUDA-graph
replays of 10 calls, as the kernel table), with cuBLAS bf16 in the same rounds.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/wsgemm_summers_h200.py   # $OUT/wsgemm_summers_h200.json

Knobs: PHASES (default "checks,time"), ROUNDS (3), REPEATS (bit-equality repeats a check, 20), JSON.
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
from fp4ptq.kernels import wsgemm

dev = torch.device("cuda")
T0 = time.time()
ROUNDS = int(os.environ.get("ROUNDS", "3"))
REPEATS = int(os.environ.get("REPEATS", "20"))
PHASES = os.environ.get("PHASES", "checks,time").split(",")
out_path = os.path.join(os.environ.get("OUT", "."), os.environ.get("JSON", "wsgemm_summers_h200.json"))
res = {"env": peers.env(), "ready": None, "checks": [], "time": []}


def save():
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)



def summers(on: bool, fn):
    shipped = wsgemm.SUMMERS
    wsgemm.SUMMERS = on
    try:
        return fn()
    finally:
        wsgemm.SUMMERS = shipped



def plan_of(m, n, k):
    cfg = wsgemm.config(m, n, k)
    sp = wsgemm.summing_plan(m, n, k, 132, cfg)
    return {"plan": wsgemm.plan(m, n, k, 132, cfg)[:4], "summers": None if sp is None else sp[2]}


res["ready"] = wsgemm.ready(dev)
print("ready:", res["ready"], f"{time.time() - T0:.1f}s", flush=True)
save()
g = torch.Generator(device=dev).manual_seed(0)

# (M, N, K, dtype, bias, W4A4): 8B qkv at 1024 (12 summers) and 768 (84), 8B gate_up at 512, 70B gate_up at
# 256, partial row / column tiles, fp16, W4A4
CHECKS = [(1024, 6144, 4096, torch.bfloat16, False, False), (1024, 6144, 4096, torch.bfloat16, True, False),
          (768, 6144, 4096, torch.float16, True, False), (512, 28672, 4096, torch.bfloat16, False, False),
          (256, 57344, 8192, torch.bfloat16, True, False), (1000, 6100, 4096, torch.bfloat16, True, False),
          (1024, 6144, 4096, torch.bfloat16, True, True), (8192, 6144, 4096, torch.bfloat16, False, True)]
for m, n, k, dt, bias, w4a4 in (CHECKS if "checks" in PHASES else []):
    w = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    x = torch.randn(m, k, device=dev, generator=g).to(dt)
    b = torch.randn(n, device=dev, generator=g).to(dt) if bias else None
    ref = x.float() @ w.dequantize(torch.float32).T + (b.float() if bias else 0)
    amax = x.float().abs().amax()
    if w4a4:
        call = lambda: gm.linear_w4a4(x, w, amax, b, path="wsgemm")  # noqa: E731
    else:
        call = lambda: gm.linear_w4a16(x, w, b, path="wsgemm")  # noqa: E731
    row = {"m": m, "n": n, "k": k, "dtype": str(dt), "bias": bias, "w4a4": w4a4, **plan_of(m, n, k)}
    y_launch = summers(False, call)
    differing = 0
    for _ in range(REPEATS):
        y_in = summers(True, call)
        differing += int(not torch.equal(y_in, y_launch))
    row["runs_differing"] = differing
    row["rel_ref"] = rel(y_in, ref)
    row["nan"] = bool(torch.isnan(y_in).any())
    if not w4a4:  # a launch plan (its own counters), its replaying calls included
        x3 = x.reshape(1, m, k)
        plan = summers(True, lambda: gm.linear_plan(x3, w, b))
        outs = [plan(x3) for _ in range(4)] if plan is not None else []
        row["plan_path"] = gm._auto_path(m, dt, False, k, dev, n)
        y_auto = summers(False, lambda: gm.linear_w4a16(x, w, b))
        row["plan_runs_differing"] = sum(int(not torch.equal(o.reshape(m, n), y_auto)) for o in outs)
        row["plan_calls"] = len(outs)
    res["checks"].append(row)
    print(row, flush=True)
    save()

# (label, M, N, K, W4A4)
TIMED = [("8B.qkv", 1024, 6144, 4096, False), ("8B.qkv", 768, 6144, 4096, False),
         ("8B.gate_up", 512, 28672, 4096, False), ("70B.gate_up", 256, 57344, 8192, False),
         ("8B.qkv", 1024, 6144, 4096, True), ("8B.qkv", 8192, 6144, 4096, True)]
for name, m, n, k, w4a4 in (TIMED if "time" in PHASES else []):
    w = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    wb = w.dequantize(torch.bfloat16)
    x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
    amax = x.float().abs().amax()
    if w4a4:
        call = lambda: gm.linear_w4a4(x, w, amax, path="wsgemm")  # noqa: E731
    else:
        call = lambda: gm.linear_w4a16(x, w, path="wsgemm")  # noqa: E731
    row = {"layer": name, "m": m, "n": n, "k": k, "w4a4": w4a4, **plan_of(m, n, k)}
    row.update(interleaved({"summing_launch": lambda: summers(False, call), "in_launch": lambda: summers(True, call),
                            "cublas_bf16": lambda: x @ wb.T}, ROUNDS))
    res["time"].append(row)
    print(row, f"{time.time() - T0:.0f}s", flush=True)
    save()
print("done", f"{time.time() - T0:.0f}s")
