"""Programmatic dependent launch (PDL) for the small-M kernels on the H200, and where the time of W4A4
at M = 1024 goes.

1. floor: a graph-replayed empty Triton kernel (1 program; 8 programs an SM), plain and as a
   programmatic dependent: the per-call cost that no GEMV can go below.
2. check: gemv6 (M = 1) and mma (M = 16) outputs with PDL and with the tile prefetch are bit-equal to
   the plain launch, alone and in a chain where each call's input is the previous call's output
   (a real dependency, replayed from a CUDA graph).
3. time: M = 1 (gemv6 plain / PDL / prefetch / both) and M = 16 (mma plain / PDL) against cuBLAS
   bf16 and tinygemm int4 in the same run.
4. w4a4: W4A4 at M = 1024 split into its launches (quantize, dequantize, cuBLAS, output scaling).

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/pdl_h200.py   # writes $OUT/pdl_h200.json
"""
from __future__ import annotations

import json
import os
import time

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import mma
from fp4ptq.kernels import quantize_kernel as qk

dev = torch.device("cuda")
OUT = os.environ.get("OUT", ".")
PHASES = os.environ.get("PHASES", "floor,check,time,w4a4").split(",")
res = {"env": peers.env(), "floor": [], "check": [], "time": [], "w4a4": []}
T0 = time.time()


def save():
    with open(os.path.join(OUT, "pdl_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


def show(row):
    print(json.dumps({a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items()}), flush=True)


def variant(pdl: bool, prefetch: bool = False):
    gm.PDL = pdl
    gm.GEMV6_PREFETCH = prefetch


@triton.jit
def _empty(x_ptr, PDL: tl.constexpr = False):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    if tl.program_id(0) == 0:
        tl.store(x_ptr, tl.load(x_ptr) + 1)


if "floor" in PHASES:
    buf = torch.zeros(1, device=dev)
    for programs in (1, 132 * 8):
        for pdl in (False, True):
            kw = {"PDL": True, "launch_pdl": True} if pdl else {}
            us = peers.bench(lambda: _empty[(programs,)](buf, num_warps=2, **kw)) * 1e3
            row = {"programs": programs, "pdl": pdl, "us": us}
            res["floor"].append(row)
            show(row)
    save()

g = torch.Generator(device=dev).manual_seed(0)
weights = {}
for name, (n, k) in peers.SHAPES.items():
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    weights[name] = (w, nvfp4.quantize(w))

VARIANTS_M1 = (("plain", False, False), ("pdl", True, False), ("prefetch", False, True), ("pdl_prefetch", True, True))
VARIANTS_M16 = (("plain", False, False), ("pdl", True, False))

if "check" in PHASES:
    for name, (w, wq) in weights.items():
        n, k = w.shape
        for m, path, variants in ((1, "gemv6", VARIANTS_M1), (16, "mma", VARIANTS_M16)):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            outs = {}
            for label, pdl, pf in variants:
                variant(pdl, pf)
                outs[label] = gm.linear_w4a16(x, wq, path=path)
            ref = x.float() @ wq.dequantize(torch.float32).T
            row = {"shape": name, "m": m, "path": path,
                   "rel_err": float((outs["plain"].float() - ref).norm() / ref.norm()),
                   "bit_equal": {a: bool(torch.equal(b, outs["plain"])) for a, b in outs.items()}}
            res["check"].append(row)
            show(row)
    # a chain through a square layer: call i reads what call i - 1 wrote (graph replay, 8 calls)
    n = 4096
    wq = nvfp4.quantize(torch.randn(n, n, device=dev, generator=g) * (1.0 / 64))
    for m, path, variants in ((1, "gemv6", VARIANTS_M1), (16, "mma", VARIANTS_M16)):
        x0 = torch.randn(m, n, device=dev, dtype=torch.bfloat16, generator=g)
        outs = {}
        for label, pdl, pf in variants:
            variant(pdl, pf)
            bufs = [x0.clone()] + [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(8)]

            def chain():
                for i in range(8):
                    gm.linear_w4a16(bufs[i], wq, path=path, out=bufs[i + 1])

            chain()
            torch.cuda.synchronize()
            for b in bufs[1:]:
                b.fill_(float("nan"))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain()
            graph.replay()
            torch.cuda.synchronize()
            outs[label] = torch.stack([b.clone() for b in bufs[1:]])
        row = {"chain": path, "m": m, "finite": bool(outs["plain"].isfinite().all()),
               "bit_equal": {a: bool(torch.equal(b, outs["plain"])) for a, b in outs.items()}}
        res["check"].append(row)
        show(row)
    variant(True)
    save()

if "time" in PHASES:
    res["copy_TBps"] = copy = peers.copy_bw()
    for name, (w, wq) in weights.items():
        n, k = w.shape
        tg = peers.make_tinygemm(w)
        for m in (1, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            row = {"shape": name, "m": m, "cublas_us": peers.bench(lambda: x @ w.t()) * 1e3}
            if m == 1 and tg is not None:
                row["tinygemm_us"] = peers.bench(lambda: tg(x)) * 1e3
            path, variants = ("gemv6", VARIANTS_M1) if m == 1 else ("mma", VARIANTS_M16)
            for label, pdl, pf in variants:
                variant(pdl, pf)
                row[f"{label}_us"] = peers.bench(lambda: gm.linear_w4a16(x, wq, path=path)) * 1e3
            if m == 1:
                byt = n * k / 2 + n * k / 16 + 2 * k + 2 * n
                row.update({f"{lab}_pct_copy": 100 * byt / (row[f"{lab}_us"] * 1e-6) / 1e12 / copy
                            for lab, _, _ in variants})
            res["time"].append(row)
            show(row)
            save()
    variant(True)

if "w4a4" in PHASES:
    variant(True)
    for name, (w, wq) in weights.items():
        n, k = w.shape
        m = 1024
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        amax = x.float().abs().amax()
        xs, x_enc = qk.quantize_scaled(x, amax, None)
        wu = gm.dequantize(wq, torch.bfloat16, unit_global=True)
        wd = gm.dequantize(wq, torch.bfloat16)
        y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        row = {"shape": name, "m": m,
               "cublas_bf16_us": peers.bench(lambda: torch.mm(x, w.t(), out=y)) * 1e3,
               "w4a16_us": peers.bench(lambda: gm.linear_w4a16(x, wq)) * 1e3,
               "w4a4_us": peers.bench(lambda: gm.linear_w4a4(x, wq, amax)) * 1e3,
               "quantize_scaled_us": peers.bench(lambda: qk.quantize_scaled(x, amax, None)) * 1e3,
               "dequant_unit_us": peers.bench(lambda: gm.dequantize(wq, torch.bfloat16, unit_global=True)) * 1e3,
               "mm_quantized_operands_us": peers.bench(lambda: torch.mm(xs, wu.t(), out=y)) * 1e3,
               "mm_x_dequant_w_us": peers.bench(lambda: torch.mm(x, wd.t(), out=y)) * 1e3,
               "mm_xs_random_w_us": peers.bench(lambda: torch.mm(xs, w.t(), out=y)) * 1e3,
               "mm_x_wu_us": peers.bench(lambda: torch.mm(x, wu.t(), out=y)) * 1e3,
               "mul_us": peers.bench(lambda: y.mul_(1.0001)) * 1e3}
        res["w4a4"].append(row)
        show(row)
        save()
print("total s", round(time.time() - T0, 1))
save()
