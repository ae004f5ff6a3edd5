"""The three-operation pair decode (mask, multiply, mask: ``gemm._pair_mul`` in gemv6, ``mma._DECODE_MUL``
in the M <= 64 tensor-core kernel) against the four-operation shift decode it replaces, on the six
Llama-3.1 shapes: outputs compared bit for bit, then timed in interleaved rounds (medians) with cuBLAS
bf16 and tinygemm int4 of the same run. M = 1: gemv6 (W4A16) and the W4A4 dispatch (quantize kernel +
gemv6); M = 16: mma.py.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/muldec_h200.py   # $OUT/muldec_h200.json
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
OUT = os.environ.get("OUT", ".")
ROUNDS = int(os.environ.get("ROUNDS", "5"))
T0 = time.time()
res = {"env": peers.env(), "copy_TBps": peers.copy_bw(), "rows": []}


def save():
    with open(os.path.join(OUT, "muldec_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


def decode(new: bool, fn):
    gm.GEMV6_MULDEC, mma.MULDEC = new, new
    try:
        return fn()
    finally:
        gm.GEMV6_MULDEC, mma.MULDEC = True, True


g = torch.Generator(device=dev).manual_seed(0)
for name, (n, k) in peers.SHAPES.items():
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    wq = nvfp4.quantize(w)
    x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
    x16 = torch.randn(16, k, device=dev, dtype=torch.bfloat16, generator=g)
    amax = x1.float().abs().amax().reshape(1)
    byt = n * k / 2 + n * k / 16 + 2 * k + 2 * n
    calls = {
        "gemv6": lambda: gm.linear_w4a16(x1, wq, path="gemv6"),
        "w4a4_m1": lambda: gm.linear_w4a4(x1, wq, amax),
        "mma_m16": lambda: gm.linear_w4a16(x16, wq, path="mma"),
    }
    row = {"shape": name, "n": n, "k": k, "bytes": byt, "same_bits": {}, "rel_err": {}}
    ref1 = x1.float() @ wq.dequantize(torch.float32).T
    ref16 = x16.float() @ wq.dequantize(torch.float32).T
    for label, fn in calls.items():
        old, new = decode(False, fn), decode(True, fn)
        row["same_bits"][label] = bool(torch.equal(old, new))
        if label != "w4a4_m1":
            ref = ref16 if label == "mma_m16" else ref1
            row["rel_err"][label] = float((new.float() - ref).norm() / ref.norm())
    tg = peers.make_tinygemm(w)
    times = {}
    for _ in range(ROUNDS):
        times.setdefault("cublas_m1", []).append(peers.bench(lambda: x1 @ w.t()) * 1e3)
        times.setdefault("tinygemm_m1", []).append(peers.bench(lambda: tg(x1)) * 1e3)
        times.setdefault("cublas_m16", []).append(peers.bench(lambda: x16 @ w.t()) * 1e3)
        for label, fn in calls.items():
            for new in (False, True):
                times.setdefault(f"{label}_{'mul' if new else 'shift'}", []).append(
                    decode(new, lambda: peers.bench(fn)) * 1e3)
    row["median_us"] = {a: statistics.median(b) for a, b in times.items()}
    row["all_us"] = times
    med = row["median_us"]
    row["pct_copy_m1"] = {a: 100 * byt / (med[a] * 1e-6) / 1e12 / res["copy_TBps"]
                          for a in ("gemv6_shift", "gemv6_mul", "tinygemm_m1", "w4a4_m1_shift", "w4a4_m1_mul")}
    row["speedup"] = {"gemv6_mul_over_shift": med["gemv6_shift"] / med["gemv6_mul"],
                      "mma_mul_over_shift": med["mma_m16_shift"] / med["mma_m16_mul"],
                      "w4a4_mul_over_shift": med["w4a4_m1_shift"] / med["w4a4_m1_mul"],
                      "gemv6_mul_vs_cublas": med["cublas_m1"] / med["gemv6_mul"],
                      "gemv6_mul_vs_tinygemm": med["tinygemm_m1"] / med["gemv6_mul"],
                      "mma_mul_vs_cublas_m16": med["cublas_m16"] / med["mma_m16_mul"]}
    res["rows"].append(row)
    print(json.dumps({"shape": name, "same": row["same_bits"], **{a: round(b, 2) for a, b in med.items()},
                      **{a: round(b, 3) for a, b in row["speedup"].items()}}), flush=True)
    save()
print("total s", round(time.time() - T0, 1))
save()
