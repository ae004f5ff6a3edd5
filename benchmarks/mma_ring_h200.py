"""mma.py at M = 16: the shipped config against other tile configs, 3 interleaved rounds of CUDA-graph
replays (medians), every output (poisoned before each run) checked against the reference decode.

PROBE=ring (default; the session-12 profile, results/ncu_mma_*_m16_s12.txt: latency-bound at the ring's
wait and barrier): deeper cp.async rings (4 and 5 steps) and, on the layers whose K is split, a finer K
split (more programs an SM). PROBE=wide (session 13): 256 and 128 weight rows on 8 warps (each activation
slice copied once for more weight rows: less activation traffic from L2 a weight), rings of 3 and 4, K
split as the rule splits for that width.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/mma_ring_h200.py              # $OUT/mma_ring_h200.json
    PROBE=wide PYTHONPATH=$PWD:$PWD/.peers python benchmarks/mma_ring_h200.py   # $OUT/mma_wide_h200.json
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
M = int(os.environ.get("M", "16"))
PROBE = os.environ.get("PROBE", "ring")
if PROBE not in ("ring", "wide"):
    raise SystemExit(f"PROBE={PROBE!r}: ring or wide")
LAYERS = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672)}
assert mma.ready(dev) is None
sms = gm._sm_count(dev)
out = {"env": peers.env(), "m": M, "probe": PROBE, "rows": []}
for name, (n, k) in LAYERS.items():
    wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    _, _, words, sbits, enc = gm._weight_views(wq)
    x = torch.randn(M, k, device=dev, generator=g).bfloat16()
    ref = x.float() @ wq.dequantize(torch.float32).T
    shipped = mma.config(M, n, k, sms)
    bn, bm, bk, warps, kp, st = shipped
    cfgs = {"shipped": shipped}
    if PROBE == "ring":
        cfgs.update({"ring4": (bn, bm, bk, warps, kp, 4), "ring5": (bn, bm, bk, warps, kp, 5)})
        for f in (2, 4):  # finer K splits: K per program / f, whole K steps
            if kp // f >= 4 * bk and (kp // f) % bk == 0:
                cfgs[f"kp/{f}"] = (bn, bm, bk, warps, kp // f, st)
    else:
        for bn2 in (256, 128):
            for st2 in (3, 4):
                cfgs[f"bn{bn2}_w8_s{st2}"] = (bn2, bm, bk, 8, mma.k_split(n, k, bn2, bk, sms), st2)
    y = torch.empty(M, n, device=dev, dtype=torch.bfloat16)
    row = {"layer": name, "cfgs": cfgs, "rel_ref": {}, "errors": {}}
    fns = {"cublas_bf16": (lambda wb=wq.dequantize(torch.bfloat16): x @ wb.t())}
    for label, cfg in cfgs.items():
        try:
            got = mma.matmul(x, words, sbits, enc, None, None, torch.full_like(y, float("nan")), cfg)
            row["rel_ref"][label] = float((got.float() - ref).norm() / ref.norm())
            fns[label] = (lambda c=cfg: mma.matmul(x, words, sbits, enc, None, None, y, c))
        except Exception as exc:  # noqa: BLE001 - a config that does not build or fit
            row["errors"][label] = repr(exc)[:300]
    times = {}
    for _ in range(ROUNDS):
        for label, fn in fns.items():
            times.setdefault(label, []).append(peers.bench(fn) * 1e3)
    row["median_us"] = {a: statistics.median(b) for a, b in times.items()}
    out["rows"].append(row)
    print(json.dumps({"layer": name, "median_us": {a: round(b, 2) for a, b in row["median_us"].items()},
                      "errors": row["errors"], "worst_rel": max(row["rel_ref"].values())}), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"mma_{PROBE}_h200.json"), "w"), indent=1)
