"""gemv7 (the long-K M = 1 GEMV) with the three-operation multiply decode (shipped) against the
shift decode, on the layers gemv7 takes: outputs compared bit for bit, then 5 interleaved rounds of
CUDA-graph replays (medians). gemv6 kept the shift decode on 70B down (the multiply measured 2.7%
slower there, session 11); gemv7 was only built with the multiply.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/gemv7_muldec_h200.py   # $OUT/gemv7_muldec_h200.json
"""
import json
import os
import statistics

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(7)
ROUNDS = int(os.environ.get("ROUNDS", "5"))
LAYERS = {"70B.down": (8192, 28672), "8B.down": (4096, 14336), "Qwen2-72B.down": (8192, 29568),
          "Qwen2-7B.down": (3584, 18944), "Llama-2-7B.down": (4096, 11008)}
out = {"env": peers.env(), "copy_TBps": peers.copy_bw(), "rows": []}


def with_decode(muldec, fn):
    gm.GEMV6_MULDEC = muldec
    try:
        return fn()
    finally:
        gm.GEMV6_MULDEC = True


for name, (n, k) in LAYERS.items():
    assert gm._gemv7_config(1, n, k) is not None, name
    wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    x = torch.randn(1, k, device=dev, generator=g).bfloat16()
    fn = lambda: gm.linear_w4a16(x, wq)  # noqa: E731
    row = {"layer": name, "n": n, "k": k, "cfg": gm._gemv7_config(1, n, k),
           "equal": bool(torch.equal(with_decode(True, fn), with_decode(False, fn)))}
    times = {}
    for _ in range(ROUNDS):
        for label, md in (("multiply", True), ("shift", False)):
            times.setdefault(label, []).append(with_decode(md, lambda: peers.bench(fn)) * 1e3)
    row["median_us"] = med = {a: statistics.median(b) for a, b in times.items()}
    row["all_us"] = times
    byt = n * k / 2 + n * k / 16
    row["pct_copy"] = {a: 100 * byt / (b * 1e-6) / 1e12 / out["copy_TBps"] for a, b in med.items()}
    out["rows"].append(row)
    print(json.dumps({a: row[a] for a in ("layer", "equal", "median_us", "pct_copy")}), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "gemv7_muldec_h200.json"), "w"), indent=1)
