"""gemv6 (M = 1) with and without the row tile loaded one step ahead (PREFETCH), swept over (ROWS,
warps, programs per SM, K segment) on the four large Llama shapes, then the best configs re-timed in
interleaved rounds against the shipped rule, with cuBLAS bf16 and tinygemm int4 in the same run; and
mma.py at M = 16 in interleaved rounds. (The committed results/gemv6_prefetch_h200.json was measured
at commit 26c4bb3, where every variant also ran as a programmatic dependent launch ("+pdl" keys);
that launch mode was removed after this run: see NOTES, session 7.)

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/gemv6_prefetch_h200.py   # $OUT/gemv6_prefetch_h200.json
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
BUDGET = float(os.environ.get("BUDGET_S", "420"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
T0 = time.time()
shipped_config = gm._gemv6_config
res = {"env": peers.env(), "copy_TBps": peers.copy_bw(), "sweep": [], "final": []}


def save():
    with open(os.path.join(OUT, "gemv6_prefetch_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


def run_with(cfg, prefetch, fn):
    gm._gemv6_config = (lambda m, n, k: tuple(cfg) + (prefetch,)) if cfg is not None else shipped_config
    try:
        return fn()
    finally:
        gm._gemv6_config = shipped_config


def segments(k):
    seg = shipped_config(1, 1, k)[3]
    out = [seg]
    if seg >= 4096 and k % (seg // 2) == 0:
        out.append(seg // 2)
    if k % (seg * 2) == 0 and seg * 2 <= 8192:
        out.append(seg * 2)
    return out


g = torch.Generator(device=dev).manual_seed(0)
data = {}
for name, (n, k) in peers.SHAPES.items():
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
    wq = nvfp4.quantize(w)
    data[name] = (w, wq, x, n * k / 2 + n * k / 16 + 2 * k + 2 * n)

SWEPT = os.environ.get("SWEPT", "8B.gate_up,70B.gate_up,8B.down,70B.down").split(",")
for si, name in enumerate(SWEPT):
    w, wq, x, byt = data[name]
    n, k = w.shape
    stop = T0 + BUDGET * 0.6 * (si + 1) / len(SWEPT)
    ref = run_with(None, False, lambda: gm.linear_w4a16(x, wq, path="gemv6"))
    for seg, rows, warps, per_sm, prefetch in itertools.product(segments(k), (2, 4, 8), (1, 2, 4), (4, 8, 16),
                                                                (False, True)):
        if (seg // 16) // (32 * warps) < 1 or time.time() > stop:
            continue
        cfg = (rows, warps, per_sm, seg)
        try:
            y = run_with(cfg, prefetch, lambda: gm.linear_w4a16(x, wq, path="gemv6"))
            ok = float((y.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
            us = run_with(cfg, prefetch, lambda: peers.bench(lambda: gm.linear_w4a16(x, wq, path="gemv6"))) * 1e3
        except Exception as exc:  # noqa: BLE001 - a config that does not build
            res["sweep"].append({"shape": name, "cfg": cfg, "prefetch": prefetch, "error": repr(exc)[:200]})
            continue
        res["sweep"].append({"shape": name, "cfg": cfg, "prefetch": prefetch, "us": us, "ok": ok})
    rows_ = [r for r in res["sweep"] if r["shape"] == name and "us" in r]
    best = sorted(rows_, key=lambda r: r["us"])[:5]
    print(name, "best", [(r["cfg"], r["prefetch"], round(r["us"], 2), r["ok"]) for r in best], flush=True)
    save()

# interleaved rounds: the shipped rule and the 3 best swept configs, with the peers
for name, (w, wq, x, byt) in data.items():
    n, k = w.shape
    rows_ = sorted([r for r in res["sweep"] if r["shape"] == name and "us" in r and r["ok"]], key=lambda r: r["us"])
    cands = [("shipped", None, False)] + [(f"{r['cfg']}{'+pf' if r['prefetch'] else ''}", tuple(r["cfg"]),
                                           r["prefetch"]) for r in rows_[:3]]
    tg = peers.make_tinygemm(w)
    times = {}
    for _ in range(ROUNDS):
        times.setdefault("cublas", []).append(peers.bench(lambda: x @ w.t()) * 1e3)
        times.setdefault("tinygemm", []).append(peers.bench(lambda: tg(x)) * 1e3)
        for label, cfg, pf in cands:
            times.setdefault(label, []).append(
                run_with(cfg, pf, lambda: peers.bench(lambda: gm.linear_w4a16(x, wq, path="gemv6"))) * 1e3)
    row = {"shape": name, "bytes": byt, "median_us": {a: statistics.median(b) for a, b in times.items()},
           "all_us": times}
    row["pct_copy"] = {a: 100 * byt / (b * 1e-6) / 1e12 / res["copy_TBps"] for a, b in row["median_us"].items()}
    res["final"].append(row)
    print(json.dumps({"shape": name, **{a: round(b, 2) for a, b in row["median_us"].items()}}), flush=True)
    print(json.dumps({"shape": name, **{a: round(b, 1) for a, b in row["pct_copy"].items()}}), flush=True)
    save()
print("total s", round(time.time() - T0, 1))
save()

# M = 16 through mma.py, interleaved rounds
res["m16"] = []
for name, (w, wq, _, _) in data.items():
    n, k = w.shape
    x = torch.randn(16, k, device=dev, dtype=torch.bfloat16, generator=g)
    times = {}
    for _ in range(ROUNDS):
        times.setdefault("cublas", []).append(peers.bench(lambda: x @ w.t()) * 1e3)
        times.setdefault("mma", []).append(peers.bench(lambda: gm.linear_w4a16(x, wq, path="mma")) * 1e3)
    row = {"shape": name, "median_us": {a: statistics.median(b) for a, b in times.items()}, "all_us": times}
    res["m16"].append(row)
    print(json.dumps({"shape": name, "m": 16, **{a: round(b, 2) for a, b in row["median_us"].items()}}), flush=True)
    save()
print("total s", round(time.time() - T0, 1))
save()
