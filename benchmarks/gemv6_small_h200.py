"""gemv6 (M = 1) on the small single-segment layers: the session-9 rule (4 rows, 4 programs an SM)
against the session-4 one (8 rows, 8 an SM) on Llama-3.1 8B qkv / o and the other models' layers
narrower than 16384 whose K is one segment, in interleaved rounds (medians); outputs compared.
``COMPARE=prefetch``: the shipped rule against the same with the narrow layers' tiles loaded one step
ahead (which takes the constant-K build; $OUT/gemv6_small_prefetch_h200.json). The configuration sweep
that found the rule: ``SWEPT="8B.qkv,8B.o" python benchmarks/gemv6_prefetch_h200.py``
(results/gemv6_small_sweep_h200.json).

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/gemv6_small_h200.py   # $OUT/gemv6_small_h200.json
"""
from __future__ import annotations

import json
import os
import statistics

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

dev = torch.device("cuda")
ROUNDS = int(os.environ.get("ROUNDS", "3"))
LAYERS = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "Qwen2-7B.qkv": (4608, 3584), "Qwen2-7B.o": (3584, 3584),
          "Gemma-2-9B.qkv": (8192, 3584), "Gemma-2-9B.o": (3584, 4096), "Phi-3-mini.qkv": (9216, 3072),
          "Phi-3-mini.o": (3072, 3072), "Llama-2-7B.qkv": (12288, 4096), "SmolLM2.qkv": (960, 576),
          "SmolLM2.gate_up": (3072, 576)}
new_config = gm._gemv6_config


def session4_config(m, n, k):
    rows, warps, per_sm, seg, prefetch = shipped(m, n, k)
    if n * k < 1 << 26 and k <= seg and n < 16384:  # the session-4 rule for these layers
        return 8, warps, 8, seg, prefetch
    return rows, warps, per_sm, seg, prefetch


def prefetch_config(m, n, k):  # COMPARE=prefetch: the narrow layers' tiles loaded one step ahead
    rows, warps, per_sm, seg, prefetch = shipped(m, n, k)
    return rows, warps, per_sm, seg, prefetch or gm._gemv6_narrow(n, k)


COMPARE = os.environ.get("COMPARE", "session4")
shipped = new_config
old_config = session4_config
if COMPARE == "prefetch":  # old: as shipped; new: the narrow layers load ahead
    old_config, new_config = shipped, prefetch_config


def run_with(cfg, fn):
    gm._gemv6_config = cfg
    try:
        return fn()
    finally:
        gm._gemv6_config = shipped


res = {"env": peers.env(), "rows": []}
g = torch.Generator(device=dev).manual_seed(0)
for name, (n, k) in LAYERS.items():
    wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    x = torch.randn(1, k, device=dev, generator=g).bfloat16()
    ref = x.float() @ wq.dequantize(torch.float32).T
    ys = {lab: run_with(cfg, lambda: gm.linear_w4a16(x, wq, path="gemv6")) for lab, cfg in
          (("old", old_config), ("new", new_config))}
    times = {}
    for _ in range(ROUNDS):
        for lab, cfg in (("old", old_config), ("new", new_config)):
            times.setdefault(lab, []).append(
                run_with(cfg, lambda: peers.bench(lambda: gm.linear_w4a16(x, wq, path="gemv6"))) * 1e3)
    row = {"layer": name, "n": n, "k": k, "old_cfg": old_config(1, n, k), "new_cfg": new_config(1, n, k),
           "median_us": {lab: statistics.median(t) for lab, t in times.items()},
           "rel_err": {lab: float((y.float() - ref).norm() / ref.norm()) for lab, y in ys.items()}}
    row["new_over_old"] = row["median_us"]["new"] / row["median_us"]["old"]
    res["rows"].append(row)
    print(json.dumps(row), flush=True)
out_name = "gemv6_small_prefetch_h200.json" if COMPARE == "prefetch" else "gemv6_small_h200.json"
with open(os.path.join(os.environ.get("OUT", "."), out_name), "w") as f:
    json.dump(res, f, indent=1)
