"""The W4A4 dequantize + cuBLAS path on the H200: its outputs against the reference backend, and its time,
with the product kept in fp32 until the global scales divide it (shipped) and as before that change (the
cuBLAS product rounded to 16 bits, then scaled: ``BEFORE``).

(1) Exactness, ``path="cublas"`` forced, bf16 and fp16 activations, SmolLM2 and Llama-3.1-8B layers at a
few row counts: the share of outputs bit-equal to ``kernels.linear_w4a4(backend="reference")`` and the
largest difference in units of the output's last place, for both products. (2) Time, CUDA-graph replays
(``peers_h200.bench``), interleaved rounds, medians: the automatic dispatch on the rows where it takes
dequantize + cuBLAS for W4A4 (M = 8192 beyond the warp-specialized GEMM's reach), shipped and before,
beside cuBLAS bf16 on a bf16 weight of the same shape.

    PYTHONPATH=$PWD:$PWD/.peers python3 benchmarks/w4a4_cublas_h200.py   # $OUT/w4a4_cublas_h200.json

Knobs: ROUNDS (3), TIME_SHAPES (8B.gate_up,8B.down,70B.gate_up,70B.down), TIME_MS (8192).
"""
from __future__ import annotations

import json
import os
import statistics

import torch

import peers_h200 as peers
from fp4ptq import kernels, nvfp4
from fp4ptq.kernels import gemm as gm

OUT = os.environ.get("OUT", "/tmp")
ROUNDS = int(os.environ.get("ROUNDS", 3))
dev = torch.device("cuda")
SHIPPED = gm._mm_fp32


def before(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The product as the path computed it before: cuBLAS's fp32 sums rounded into bf16."""
    return torch.mm(a, b)


def variant(name: str) -> None:
    gm._mm_fp32 = SHIPPED if name == "shipped" else before


def ulps(y: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |y - ref| in units of ref's last place (at least the format's smallest normal's)."""
    finfo = torch.finfo(ref.dtype)
    unit = finfo.eps * ref.float().abs().clamp_min(finfo.tiny)
    return float(((y.float() - ref.float()).abs() / unit).max())


def exactness() -> list:
    rows = []
    cases = [("SmolLM2.gate_up", 1536, 576, (96, 512, 4096)), ("SmolLM2.down", 576, 1536, (96, 4096)),
             ("8B.o", 4096, 4096, (256, 2048)), ("8B.down", 4096, 14336, (512,))]
    g = torch.Generator(device=dev).manual_seed(0)
    for name, n, k, ms in cases:
        wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
        for dtype in (torch.bfloat16, torch.float16):
            for m in ms:
                x = torch.randn(m, k, device=dev, generator=g).to(dtype)
                amax = x.float().abs().amax() * 0.7  # saturates the largest activations, as calibration can
                ref = kernels.linear_w4a4(x, wq, amax, backend="reference")
                row = {"layer": name, "n": n, "k": k, "m": m, "dtype": str(dtype).split(".")[-1],
                       "auto_path": kernels.auto_path(m, n, k, dtype, dev, w4a4=True)}
                for v in ("shipped", "before"):
                    variant(v)
                    y = gm.linear_w4a4(x, wq, amax, path="cublas")
                    row[v] = {"equal": float((y == ref).float().mean()), "max_ulps": ulps(y, ref),
                              "finite": bool(torch.isfinite(y).all())}
                variant("shipped")
                rows.append(row)
                print("exact", json.dumps(row), flush=True)
    return rows


def timing() -> list:
    rows = []
    shapes = os.environ.get("TIME_SHAPES", "8B.gate_up,8B.down,70B.gate_up,70B.down").split(",")
    for name in shapes:
        n, k = peers.SHAPES[name]
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wq = nvfp4.quantize(w)
        for m in (int(v) for v in os.environ.get("TIME_MS", "8192").split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            amax = x.float().abs().amax()
            path = kernels.auto_path(m, n, k, x.dtype, dev, w4a4=True)
            times = {}
            for _ in range(ROUNDS):
                times.setdefault("cublas_bf16", []).append(peers.bench(lambda: x @ w.t()) * 1e3)
                for v in ("shipped", "before"):
                    variant(v)
                    times.setdefault(v, []).append(peers.bench(lambda: gm.linear_w4a4(x, wq, amax)) * 1e3)
                variant("shipped")
            med = {v: statistics.median(t) for v, t in times.items()}
            row = {"layer": name, "m": m, "path": path, "median_us": med,
                   "vs_cublas": {v: med[v] / med["cublas_bf16"] for v in ("shipped", "before")},
                   "shipped_over_before": med["shipped"] / med["before"]}
            rows.append(row)
            print("time", json.dumps(row), flush=True)
            del x
        del w, wq
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    probe = torch.ones(16, 16, device=dev, dtype=torch.bfloat16)
    try:
        out_dtype = torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError) as exc:
        out_dtype = repr(exc)[:200]
    res = {"env": peers.env(), "mm_out_dtype_fp32": out_dtype, "exact": exactness(), "time": timing()}
    with open(os.path.join(OUT, "w4a4_cublas_h200.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("| layer | M | path | cuBLAS bf16 (us) | W4A4 shipped (us) | before (us) | shipped / before |")
    print("|---|---|---|---|---|---|---|")
    for r in res["time"]:
        t = r["median_us"]
        print(f"| {r['layer']} | {r['m']} | {r['path']} | {t['cublas_bf16']:.1f} | {t['shipped']:.1f} "
              f"({r['vs_cublas']['shipped']:.2f}x) | {t['before']:.1f} ({r['vs_cublas']['before']:.2f}x) "
              f"| {r['shipped_over_before']:.3f} |")


if __name__ == "__main__":
    main()
