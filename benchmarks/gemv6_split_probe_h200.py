"""Probe: gemv6 at M = 1 with K split on the narrow 8B layers, now that the summing pass is a
programmatic dependent that its split kernel signals (gemm.split_pdl, session 24). The shipped rule
runs 8B qkv / o as one K segment (4 rows, 4 warps, 4 programs an SM, loading ahead); a split gives
twice or four times the programs, each with a shorter serial chain, for a summing pass that now costs
less. Each config is checked against the exact product (within 1e-2), then timed warm in interleaved
rounds (CUDA-graph replays of 10 calls), the shipped dispatch in the same rounds.

    PYTHONPATH=$PWD:$PWD/.peers:$PWD/benchmarks python benchmarks/gemv6_split_probe_h200.py

Knobs: ROUNDS (3), JSON (gemv6_split_probe_h200.json).
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

dev = torch.device("cuda")
T0 = time.time()
ROUNDS = int(os.environ.get("ROUNDS", "3"))
out_path = os.path.join(os.environ.get("OUT", "."), os.environ.get("JSON", "gemv6_split_probe_h200.json"))
res = {"env": peers.env(), "split_pdl": gm.split_pdl(dev), "rows": []}
SHIPPED = gm._gemv6_config
# (rows, warps, programs an SM, K segment, loading ahead)
CONFIGS = [(4, 2, 8, 2048, True), (4, 2, 8, 2048, False), (4, 2, 4, 2048, True), (8, 2, 8, 2048, False),
           (4, 1, 16, 1024, False), (4, 1, 8, 1024, True), (4, 2, 8, 1024, True)]
LAYERS = [("8B.qkv", 6144, 4096), ("8B.o", 4096, 4096), ("Qwen2-7B.qkv", 4608, 3584)]
g = torch.Generator(device=dev).manual_seed(0)


def with_config(cfg, fn):
    gm._gemv6_config = (lambda m, n, k: cfg) if cfg is not None else SHIPPED
    try:
        return fn()
    finally:
        gm._gemv6_config = SHIPPED


for name, n, k in LAYERS:
    w = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    x = torch.randn(1, k, device=dev, generator=g).to(torch.bfloat16)
    ref = x.float() @ w.dequantize(torch.float32).T
    row = {"layer": name, "shipped_config": list(SHIPPED(1, n, k)), "errors": {}}
    fns = {"shipped": lambda: gm.linear_w4a16(x, w, path="gemv6")}
    for cfg in CONFIGS:
        if k % cfg[3]:
            continue
        label = "x".join(str(int(c)) for c in cfg)
        try:
            y = with_config(cfg, lambda: gm.linear_w4a16(x, w, path="gemv6"))
            row["errors"][label] = rel(y, ref)
        except Exception as exc:  # noqa: BLE001 - a config this kernel cannot build: record it
            row["errors"][label] = repr(exc)[:200]
            continue
        fns[label] = lambda cfg=cfg: with_config(cfg, lambda: gm.linear_w4a16(x, w, path="gemv6"))
    row["errors"]["shipped"] = rel(fns["shipped"](), ref)
    row["us"] = interleaved(fns, ROUNDS)
    res["rows"].append(row)
    print(json.dumps(row), f"{time.time() - T0:.0f}s", flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
print("done", f"{time.time() - T0:.0f}s")
