"""fp16 activations in the resident-x / streamed-x GEMVs (gemv6 / gemv7 with fp16x2 sums), against the
paths fp16 took before (gemv4, fp32 FMAs, and mma.py at M = 1 above 6144 x 4096 and at M = 2 from 4M
weights), the same GEMV on the same data in bf16, and cuBLAS fp16 on the dequantized weight.

Checks first, on the GPU's own PTX (the CPU tests run emulated twins): every layer's fp16 output
against the exact fp32 product of the dequantized weight (relative Frobenius error; the GEMV's bound is
2e-3 in fp16, 1e-2 in bf16), and rows that reach 3e4 and 65504, rows of 1e-3 and of fp16 subnormals,
blocks mixing 1e4 and 1e-3, all-zero blocks (per row, as tests/test_kernels.py). Then ROUNDS
interleaved rounds of CUDA-graph-replayed calls (``peers_h200.bench``), medians, us.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/gemv_fp16_h200.py   # $OUT/gemv_fp16_h200.json
"""
from __future__ import annotations

import json
import os
import statistics
import time

import peers_h200 as peers
import torch

from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

LAYERS = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672), "Qwen2-7B.qkv": (4608, 3584),
          "Qwen2-7B.down": (3584, 18944), "Llama-2-7B.down": (4096, 11008), "Qwen2-72B.down": (8192, 29568), "SmolLM2.qkv": (960, 576)}
LAYERS = {a: b for a, b in LAYERS.items() if a in os.environ.get("ONLY", ",".join(LAYERS)).split(",")}
ROUNDS = int(os.environ.get("ROUNDS", "5"))
MS = [int(m) for m in os.environ.get("MS", "1,2").split(",")]


def old_fp16_path(m: int, n: int, k: int) -> str:
    """What ``_auto_path`` gave fp16 activations at M <= 2 before gemv6 took them."""
    return "mma" if (m == 2 and n * k >= 1 << 22) or n * k > 6144 * 4096 else "gemv4"


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def extremes_check(dev: torch.device) -> dict:
    """The CPU test's extreme rows, through gemv6 and gemv7 on the GPU."""
    n, k = 24, 1040
    g = torch.Generator().manual_seed(7)
    wq = nvfp4.quantize(torch.randn(n, k, generator=g) * 1e-3).to(dev)
    x = torch.randn(6, k, generator=g)
    x[0] *= 3e4 / x[0].abs().max()
    x[1] *= 1e-3
    x[2, :512], x[2, 512:] = 0.0, x[2, 512:] * 1e4
    x[3, ::2] *= 1e-4
    x[4] = 0.0
    x[4, 7] = 65504.0
    x[5] *= 1e-6
    xh = x.half().to(dev)
    ref = xh.float() @ wq.dequantize(torch.float32).T
    out = {}
    for gemv7 in ("0", "1"):
        gm.GEMV7 = gemv7
        saved = gm._gemv7_config
        if gemv7 == "1":
            gm._gemv7_config = lambda m_, n_, k_: (4, 1, 16, 1, True)
        try:
            y = torch.cat([gm.linear_w4a16(xh[r:r + 2], wq, path="gemv6") for r in range(0, 6, 2)]).float()
            yb = torch.cat([gm.linear_w4a16(xh[r:r + 2].bfloat16(), wq, path="gemv6")
                            for r in range(0, 6, 2)]).float()
        finally:
            gm._gemv7_config = saved
            gm.GEMV7 = "auto"
        rows = [{"fp16": rel(y[r], ref[r]), "bf16": rel(yb[r], ref[r])} for r in range(5)]
        sub_ok = bool(((y[5] - ref[5]).abs() <= ref[5].abs() * 2**-10 + 2**-24).all())
        ok = bool(torch.isfinite(y).all()) and sub_ok and all(
            r["fp16"] < 2e-3 and 4 * r["fp16"] < r["bf16"] for r in rows)
        out["gemv7" if gemv7 == "1" else "gemv6"] = {"rows": rows, "subnormal_row_ok": sub_ok, "ok": ok}
        if not ok:
            raise AssertionError(f"extremes, gemv7={gemv7}: {out}")
    return out


def main() -> None:
    dev = torch.device("cuda")
    t0 = time.time()
    res = {"env": peers.env(), "copy_TBps": peers.copy_bw(), "extremes": extremes_check(dev), "rows": []}
    print("extremes", json.dumps(res["extremes"]), flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in LAYERS.items():
        wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
        w16 = wq.dequantize(torch.float16)
        for m in MS:
            x = torch.randn(m, k, device=dev, generator=g).half()
            xb = x.bfloat16()
            exact = x.float() @ wq.dequantize(torch.float32).T
            old = old_fp16_path(m, n, k)
            auto = gm._auto_path(m, torch.float16, False, k, dev, n)
            calls = {
                "fp16_gemv6": lambda x=x: gm.linear_w4a16(x, wq, path="gemv6"),
                f"fp16_old_{old}": lambda x=x, old=old: gm.linear_w4a16(x, wq, path=old),
                "fp16_auto": lambda x=x: gm.linear_w4a16(x, wq),
                "bf16_gemv6": lambda xb=xb: gm.linear_w4a16(xb, wq, path="gemv6"),
                "cublas_fp16": lambda x=x: x @ w16.t(),
            }
            errs = {a: rel(c(), exact if a != "bf16_gemv6" else xb.float() @ wq.dequantize(torch.float32).T)
                    for a, c in calls.items()}
            if errs["fp16_gemv6"] > 2e-3 or errs["bf16_gemv6"] > 1e-2:
                raise AssertionError(f"{name} m={m}: {errs}")
            times: dict = {}
            for _ in range(ROUNDS):
                for a, c in calls.items():
                    times.setdefault(a, []).append(peers.bench(c) * 1e3)
            med = {a: statistics.median(b) for a, b in times.items()}
            row = {"layer": name, "n": n, "k": k, "m": m, "auto_path": auto, "old_path": old,
                   "gemv7": gm._gemv7_config(m, n, k) is not None, "rel_err": errs, "median_us": med,
                   "all_us": times, "old_over_gemv6": med[f"fp16_old_{old}"] / med["fp16_gemv6"],
                   "fp16_over_bf16": med["fp16_gemv6"] / med["bf16_gemv6"]}
            res["rows"].append(row)
            print(name, m, auto, {a: round(b, 2) for a, b in med.items()},
                  {a: f"{b:.1e}" for a, b in errs.items()},
                  f"old/new x{row['old_over_gemv6']:.2f} fp16/bf16 x{row['fp16_over_bf16']:.3f}", flush=True)
        with open(os.path.join(os.environ.get("OUT", "."), "gemv_fp16_h200.json"), "w") as f:
            json.dump(res, f, indent=1)
    print("total s", round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
