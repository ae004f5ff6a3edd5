"""The streamed-x GEMV (gemv7: whole rows a program, x re-read from L1 each step, no K split) against
gemv6 (x resident, K split into segments where it does not fit) at M = 1: a config sweep (rows, warps,
KC blocks a step, programs an SM, loading ahead) per layer, then gemv6 as shipped and the three best
gemv7 configs in interleaved rounds (medians) with cuBLAS bf16; every output checked against the
reference decode.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/gemv7_h200.py   # $OUT/gemv7_h200.json
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import time

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

dev = torch.device("cuda")
OUT = os.environ.get("OUT", ".")
ROUNDS = int(os.environ.get("ROUNDS", "3"))
BUDGET = float(os.environ.get("BUDGET_S", "420"))
LAYERS = {"70B.down": (8192, 28672), "8B.down": (4096, 14336), "Qwen2-7B.down": (3584, 18944),
          "Llama-2-7B.down": (4096, 11008), "Qwen2-72B.down": (8192, 29568), "70B.gate_up": (57344, 8192),
          "8B.gate_up": (28672, 4096), "8B.qkv": (6144, 4096)}
LAYERS = {a: b for a, b in LAYERS.items() if a in os.environ.get("ONLY", ",".join(LAYERS)).split(",")}
SWEEP_ROWS = tuple(int(r) for r in os.environ.get("SWEEP_ROWS", "4,8").split(","))  # rows a tile swept
T0 = time.time()
res = {"env": peers.env(), "copy_TBps": peers.copy_bw(), "sweep": [], "final": []}
shipped = gm._gemv7_config


def save():
    with open(os.path.join(OUT, "gemv7_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


def with_cfg(cfg, fn):
    gm.GEMV7, gm._gemv7_config = ("1", lambda m, n, k: cfg) if cfg is not None else ("0", shipped)
    try:
        return fn()
    finally:
        gm.GEMV7, gm._gemv7_config = "auto", shipped


g = torch.Generator(device=dev).manual_seed(0)
for li, (name, (n, k)) in enumerate(LAYERS.items()):
    wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
    ref = x.float() @ wq.dequantize(torch.float32).T
    wb = wq.dequantize(torch.bfloat16)
    byt = n * k / 2 + n * k / 16
    fn = lambda: gm.linear_w4a16(x, wq, path="gemv6")  # noqa: E731
    stop = T0 + BUDGET * 0.7 * (li + 1) / len(LAYERS)
    for rows, warps, kc, pf, per_sm in itertools.product(SWEEP_ROWS, (2, 4, 8), (128, 256, 512), (True, False), (4, 8, 16)):
        if kc < 32 * warps or time.time() > stop:
            continue
        cfg = (rows, warps, kc, per_sm, pf)
        try:
            y = with_cfg(cfg, fn)
            err = float((y.float() - ref).norm() / ref.norm())
            us = with_cfg(cfg, lambda: peers.bench(fn)) * 1e3
        except Exception as exc:  # noqa: BLE001 - a config that does not build
            res["sweep"].append({"layer": name, "cfg": cfg, "error": repr(exc)[:200]})
            continue
        res["sweep"].append({"layer": name, "cfg": cfg, "us": us, "rel_err": err})
    ok = sorted((r for r in res["sweep"] if r["layer"] == name and "us" in r and r["rel_err"] < 1e-2),
                key=lambda r: r["us"])
    print(name, "best", [(r["cfg"], round(r["us"], 2)) for r in ok[:4]], flush=True)
    cands = [("gemv6", None)] + [(str(tuple(r["cfg"])), tuple(r["cfg"])) for r in ok[:3]]
    times = {}
    for _ in range(ROUNDS):
        times.setdefault("cublas", []).append(peers.bench(lambda: x @ wb.t()) * 1e3)
        for label, cfg in cands:
            times.setdefault(label, []).append(with_cfg(cfg, lambda: peers.bench(fn)) * 1e3)
    med = {a: statistics.median(b) for a, b in times.items()}
    row = {"layer": name, "n": n, "k": k, "bytes": byt, "median_us": med, "all_us": times,
           "rel_err_gemv6": float((with_cfg(None, fn).float() - ref).norm() / ref.norm()),
           "pct_copy": {a: 100 * byt / (b * 1e-6) / 1e12 / res["copy_TBps"] for a, b in med.items()}}
    res["final"].append(row)
    print(json.dumps({"layer": name, **{a: round(b, 2) for a, b in med.items()}}), flush=True)
    save()
print("total s", round(time.time() - T0, 1))
save()
