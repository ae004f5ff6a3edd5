"""Does the gemv6 rule (prefetch derived on 8B/70B gate_up and 70B down) hold on large layers it was not
swept on, and do K's that are not multiples of 2048 (Qwen2, Llama-2) gain from the masked-segment
rule? M = 1: the shipped rule, the session-4 rule (no prefetch, K segments up to 4096), the shipped rule
with K cut only by its power-of-two divisor ("pow2_segments", before the masked-segment rule), and
cuBLAS bf16; 3 interleaved rounds (medians), outputs compared.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/gemv6_rule_check_h200.py   # $OUT/gemv6_rule_check_h200.json
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
SHAPES = {"70B.qkv": (10240, 8192), "70B.o": (8192, 8192), "8B.lm_head": (128256, 4096),
          "70B.lm_head": (128256, 8192), "Qwen2-7B.gate_up": (37888, 3584), "Qwen2-7B.down": (3584, 18944),
          "8B.gate_up": (28672, 4096), "Qwen2-7B.qkv": (4608, 3584), "Qwen2-7B.o": (3584, 3584),
          "Llama-2-7B.down": (4096, 11008), "Qwen2-72B.down": (8192, 29568)}
SHAPES = {a: b for a, b in SHAPES.items() if a in os.environ.get("ONLY", ",".join(SHAPES)).split(",")}
ROUNDS = int(os.environ.get("ROUNDS", "3"))
shipped = gm._gemv6_config
shipped_segment = gm._gemv6_segment


def pow2_segment(k, cap):
    div = k & -k
    return k if div < 256 else min(div, cap)


def session4_rule(m, n, k):
    seg = k & -k
    seg = k if seg < 256 else min(seg, 4096)
    kbp = triton.next_power_of_2(max(1, seg // 16))
    split = k // seg > 1
    return 4 if split or n >= 16384 else 8, max(1, min(8, kbp // 128)), 16 if split else 8, seg, False


res = {"env": peers.env(), "copy_TBps": peers.copy_bw(), "rows": []}
g = torch.Generator(device=dev).manual_seed(0)
for name, (n, k) in SHAPES.items():
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    wq = nvfp4.quantize(w)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
    ref = x.float() @ wq.dequantize(torch.float32).T
    row = {"shape": name, "n": n, "k": k, "shipped_cfg": shipped(1, n, k), "session4_cfg": session4_rule(1, n, k)}
    gm._gemv6_segment = pow2_segment
    row["pow2_segments_cfg"] = shipped(1, n, k)
    gm._gemv6_segment = shipped_segment
    times = {}
    for _ in range(ROUNDS):
        times.setdefault("cublas", []).append(peers.bench(lambda: x @ w.t()) * 1e3)
        for label, rule, segment in (("shipped", shipped, shipped_segment), ("session4", session4_rule, None),
                                     ("pow2_segments", shipped, pow2_segment)):
            if label == "pow2_segments" and row["pow2_segments_cfg"] == row["shipped_cfg"]:
                continue
            gm._gemv6_config = rule
            gm._gemv6_segment = segment or shipped_segment
            try:
                y = gm.linear_w4a16(x, wq, path="gemv6")
                row[f"{label}_rel_err"] = float((y.float() - ref).norm() / ref.norm())
                times.setdefault(label, []).append(peers.bench(lambda: gm.linear_w4a16(x, wq, path="gemv6")) * 1e3)
            finally:
                gm._gemv6_config = shipped
                gm._gemv6_segment = shipped_segment
    byt = n * k / 2 + n * k / 16 + 2 * k + 2 * n
    row["median_us"] = {a: statistics.median(b) for a, b in times.items()}
    row["pct_copy"] = {a: 100 * byt / (b * 1e-6) / 1e12 / res["copy_TBps"] for a, b in row["median_us"].items()}
    row["all_us"] = times
    res["rows"].append(row)
    print(json.dumps({a: (round(b, 4) if isinstance(b, float) else b) for a, b in row.items() if a != "all_us"}),
          flush=True)
    del w, wq
    torch.cuda.empty_cache()
with open(os.path.join(os.environ.get("OUT", "."), "gemv6_rule_check_h200.json"), "w") as f:
    json.dump(res, f, indent=1)
