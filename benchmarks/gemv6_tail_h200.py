"""Is gemv6 (M = 1) held back by its last, partial round of row tiles? Each program walks row tiles
grid-stride, so when the tiles of a K segment are not a multiple of the programs that share it, some
programs take one tile more than the rest (70B down: 2048 tiles a segment over 283 programs, 7.24 on
average, 8 at most). Timed here: each layer at its own N and at N cut or grown so that every program
takes the same number of tiles; if the tail costs time, the time per row drops where the tiles divide
evenly. 3 interleaved rounds (medians).

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/gemv6_tail_h200.py   # $OUT/gemv6_tail_h200.json
"""
from __future__ import annotations

import json
import os
import statistics

import torch
import triton

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

dev = torch.device("cuda")
ROUNDS = int(os.environ.get("ROUNDS", "3"))
LAYERS = {"70B.down": (8192, 28672), "70B.gate_up": (57344, 8192), "8B.down": (4096, 14336),
          "8B.gate_up": (28672, 4096)}
res = {"env": peers.env(), "copy_TBps": peers.copy_bw(), "rows": []}
sms = torch.cuda.get_device_properties(dev).multi_processor_count
g = torch.Generator(device=dev).manual_seed(0)


def grid_of(n, k):
    """(programs a segment, max tiles a program, mean tiles a program) as the launcher cuts them."""
    rows, warps, per_sm, seg, _ = gm._gemv6_config(1, n, k)
    fits = [v for v in gm._RESIDENT.values() if v is not None]
    fit = min(fits) if fits else per_sm
    per = (per_sm // fit) * fit if per_sm > fit else per_sm
    segments = triton.cdiv(k, seg)
    tiles = triton.cdiv(n, rows)
    p = max(1, min(tiles, triton.cdiv(per * sms, segments)))
    return p, triton.cdiv(tiles, p), tiles / p, rows


for name, (n0, k) in LAYERS.items():
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
    w0 = nvfp4.quantize(torch.randn(n0, k, device=dev, generator=g) * 0.02)
    gm._RESIDENT.clear()
    gm.linear_w4a16(x, w0, path="gemv6")
    p, most, mean, rows = grid_of(n0, k)
    ns = {n0}
    for t in (int(mean), most):  # every program the same number of tiles, just under and at the max
        ns.add(p * t * rows)
    ws = {n: nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02) for n in sorted(ns)}
    times = {n: [] for n in ws}
    for _ in range(ROUNDS):
        for n, wq in ws.items():
            gm._RESIDENT.clear()
            times[n].append(peers.bench(lambda: gm.linear_w4a16(x, wq, path="gemv6")) * 1e3)
    for n in ws:
        p_, most_, mean_, _ = grid_of(n, k)
        byt = n * k / 2 + n * k / 16
        us = statistics.median(times[n])
        row = {"layer": name, "n": n, "k": k, "programs_a_segment": p_, "max_tiles": most_, "mean_tiles": mean_,
               "us": us, "ns_per_row": 1e3 * us / n, "pct_copy": 100 * byt / (us * 1e-6) / 1e12 / res["copy_TBps"],
               "all_us": times[n]}
        res["rows"].append(row)
        print(json.dumps({a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items() if a != "all_us"}),
              flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "gemv6_tail_h200.json"), "w") as f:
    json.dump(res, f, indent=1)
