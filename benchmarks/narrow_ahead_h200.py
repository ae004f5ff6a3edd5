"""gemv6's config for the narrow single-segment layers (``gemm.GEMV6_NARROW_AHEAD``): each row tile
loaded one step ahead on twice the warps, against the warm-tuned session-9 config, at M = 1 and 2, on
the narrow layers of several models, with the weights cold in L2 (each call reads another of R copies,
``cold_weights_h200``) and warm (one weight, the table's timing). Outputs checked against the exact
product (and whether the two configs agree bit for bit), then 5 interleaved rounds, medians, us.

    PYTHONPATH=$PWD:$PWD/.peers:$PWD/benchmarks python benchmarks/narrow_ahead_h200.py   # $OUT/narrow_ahead_h200.json
"""
from __future__ import annotations

import json
import os
import statistics
import time

import peers_h200 as peers
import torch
from cold_weights_h200 import copies

from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

LAYERS = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "Qwen2-7B.qkv": (4608, 3584), "Qwen2-7B.o": (3584, 3584),
          "Gemma-2-9B.qkv": (8192, 3584), "Gemma-2-9B.o": (3584, 4096), "Llama-3.2-1B.qkv": (3072, 2048),
          "Llama-3.2-1B.o": (2048, 2048), "Qwen2-0.5B.qkv": (1152, 896), "SmolLM2.qkv": (960, 576),
          "SmolLM2.gate_up": (3072, 576)}
ROUNDS = int(os.environ.get("ROUNDS", "5"))


def main() -> None:
    dev = torch.device("cuda")
    t0 = time.time()
    res = {"env": peers.env(), "copy_TBps": peers.copy_bw(), "rows": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in LAYERS.items():
        assert gm._gemv6_narrow(n, k), name
        byt = n * k // 2 + n * k // 16
        r = copies(byt)
        wqs = [nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02) for _ in range(r)]
        for m in (1, 2, "w4a4"):
            x = torch.randn(1 if m == "w4a4" else m, k, device=dev, dtype=torch.bfloat16, generator=g)
            amax = x.float().abs().amax().reshape(1)
            if m == "w4a4":  # M = 1, the activations quantized under their amax first (the same GEMV after)
                def call(w, x=x, amax=amax):
                    return gm.linear_w4a4(x, w, amax)
                exact = gm.linear_w4a4(x, wqs[0], amax, path="gemv4").float()
            else:
                def call(w, x=x):
                    return gm.linear_w4a16(x, w)
                exact = x.float() @ wqs[0].dequantize(torch.float32).T
            outs = {}
            for ahead in (False, True):
                gm.GEMV6_NARROW_AHEAD = ahead
                outs[ahead] = call(wqs[0]).clone()
            gm.GEMV6_NARROW_AHEAD = True
            rel = {str(a): float((o.float() - exact).norm() / exact.norm()) for a, o in outs.items()}
            if not all(v < 1e-2 for v in rel.values()):
                raise AssertionError(f"{name} m={m}: {rel}")
            times: dict = {}
            for _ in range(ROUNDS):
                for ahead in (False, True):
                    gm.GEMV6_NARROW_AHEAD = ahead
                    label = "ahead" if ahead else "shipped_s9"
                    times.setdefault(f"cold_{label}", []).append(
                        peers.bench(lambda: [call(w) for w in wqs]) * 1e3 / r)
                    times.setdefault(f"warm_{label}", []).append(peers.bench(lambda: call(wqs[0])) * 1e3)
                gm.GEMV6_NARROW_AHEAD = True
            med = {a: statistics.median(b) for a, b in times.items()}
            row = {"layer": name, "n": n, "k": k, "m": m, "bytes": byt, "copies": r, "rel_err": rel,
                   "bit_equal": bool(torch.equal(outs[False], outs[True])), "median_us": med, "all_us": times,
                   "cold_ratio": med["cold_ahead"] / med["cold_shipped_s9"],
                   "warm_ratio": med["warm_ahead"] / med["warm_shipped_s9"]}
            res["rows"].append(row)
            print(name, m, {a: round(b, 2) for a, b in med.items()},
                  f"cold x{row['cold_ratio']:.3f} warm x{row['warm_ratio']:.3f}", flush=True)
        with open(os.path.join(os.environ.get("OUT", "."), "narrow_ahead_h200.json"), "w") as f:
            json.dump(res, f, indent=1)
    print("total s", round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
