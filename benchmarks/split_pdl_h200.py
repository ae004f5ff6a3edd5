"""The summing pass of a K split (gemm.split_finish) as a programmatic dependent launch, on the H200.

Variants, each against the one before it:
  loop         the summing pass as before this change: one partial loaded a loop step, plain launch
  unrolled     every partial's load in flight at once (the adds in the same order), plain launch
  pdl_trigger  + launched as a programmatic dependent (griddepcontrol.wait) of the split kernel, which
               signals griddepcontrol.launch_dependents as it starts (mma.py, gemv6; shipped)
The committed results (results/split_pdl_h200.json, run at afca904) also have a "pdl" column: the
dependent launch without the signal, which gained nothing and is no longer built.

Correctness first: every variant's output bit-equal to ``loop`` on every timed row, and a graph-replayed
chain of dependent calls (each call's input the previous call's output) bit-equal to the eager chain.
Then interleaved rounds (medians, CUDA-graph replays of 10 calls), cuBLAS bf16 in the same rounds.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/split_pdl_h200.py   # $OUT/split_pdl_h200.json

PHASES=modules: NVFP4Linear as a model calls it (launch plans, replayed through Triton's C launcher
after their second call), square layers whose K the small-M kernels split, W4A16 and W4A4, bias:
a chain of 10 calls (x_{i+1} = y_i / 2) eager, then captured in a CUDA graph and replayed; the
replays must give the eager chain's bits.

Knobs: ROUNDS (5), PHASES ("checks,time"; "modules"), JSON.
"""
from __future__ import annotations

import json
import os
import time

import torch
import triton
import triton.language as tl

import peers_h200 as peers
from _rounds import graph_replays, interleaved, rel, weight_cache
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

dev = torch.device("cuda")
T0 = time.time()
ROUNDS = int(os.environ.get("ROUNDS", "5"))
PHASES = os.environ.get("PHASES", "checks,time").split(",")
out_path = os.path.join(os.environ.get("OUT", "."), os.environ.get("JSON", "split_pdl_h200.json"))
res = {"env": peers.env(), "split_pdl": gm.split_pdl(dev), "checks": [], "time": []}


def save():
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


@triton.jit
def _finish_loop(part_ptr, bias_ptr, y_ptr, M, N, stride_ym, SEGMENTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK: tl.constexpr, PDL: tl.constexpr):
    # the summing pass before this change: a run-time loop (M * 0 keeps the trip count unknown)
    row = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SEGMENTS + M * 0):
        acc += tl.load(part_ptr + (s * M + row) * N + n, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=ok)


SHIPPED = (gm._gemv_split_finish, gm.SPLIT_PDL)
VARIANTS = {"loop": (_finish_loop, False), "unrolled": (gm._gemv_split_finish, False),
            "pdl_trigger": (gm._gemv_split_finish, True)}


def variant(name, fn):
    gm._gemv_split_finish, gm.SPLIT_PDL = VARIANTS[name]
    try:
        return fn()
    finally:
        gm._gemv_split_finish, gm.SPLIT_PDL = SHIPPED


g = torch.Generator(device=dev).manual_seed(0)
weight = weight_cache(g, dev)  # (the same generator draws the activations: the same data as before)


# (label, M, N, K, bias, W4A4, path or None for the dispatch's)
ROWS = [("8B.qkv", 16, 6144, 4096, False, False, None), ("8B.o", 16, 4096, 4096, False, False, None),
        ("8B.gate_up", 16, 28672, 4096, False, False, None), ("8B.down", 16, 4096, 14336, False, False, None),
        ("70B.down", 16, 8192, 28672, False, False, None), ("70B.gate_up", 16, 57344, 8192, False, False, None),
        ("8B.o", 16, 4096, 4096, True, True, None), ("8B.o", 2, 4096, 4096, False, False, "mma"),
        ("8B.down", 2, 4096, 14336, False, False, None), ("8B.gate_up", 2, 28672, 4096, False, False, None),
        ("8B.qkv", 32, 6144, 4096, False, False, None), ("8B.down", 32, 4096, 14336, False, False, None),
        ("8B.k", 64, 1024, 4096, False, False, None), ("8B.o", 64, 4096, 4096, True, False, None),
        ("Phi-3-mini.o", 1, 3072, 3072, False, False, None), ("Phi-3-mini.o", 2, 3072, 3072, False, False, None),
        ("8B.k", 128, 1024, 4096, False, False, None), ("8B.o", 256, 4096, 4096, False, False, None),
        ("8B.down", 256, 4096, 14336, False, False, None), ("8B.down", 512, 4096, 14336, False, False, None)]


def call_of(m, n, k, bias, w4a4, path):
    w, _ = weight(n, k)
    x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
    b = torch.randn(n, device=dev, generator=g).to(torch.bfloat16) if bias else None
    amax = x.float().abs().amax()
    if w4a4:
        return x, (lambda: gm.linear_w4a4(x, w, amax, b, path=path))
    return x, (lambda: gm.linear_w4a16(x, w, b, path=path))


if "checks" in PHASES:
    for name, m, n, k, bias, w4a4, path in ROWS:
        x, call = call_of(m, n, k, bias, w4a4, path)
        w, _ = weight(n, k)
        ref = x.float() @ w.dequantize(torch.float32).T
        row = {"layer": name, "m": m, "bias": bias, "w4a4": w4a4, "path": path or gm._auto_path(m, x.dtype, w4a4, k, dev, n)}
        base = variant("loop", call)
        for v in VARIANTS:
            same = all(torch.equal(variant(v, call), base) for _ in range(5))
            row[f"{v}_equal"] = same
        row["rel_ref"] = rel(base, ref) if not bias else None
        res["checks"].append(row)
        print(row, flush=True)
    # a chain of dependent calls in a replayed graph: x_{i+1} = y_i on square layers whose K is split
    # (8B.o through mma.py / wsgemm, Phi-3-mini o through gemv6)
    for m, path, n in ((16, None, 4096), (2, "mma", 4096), (64, None, 4096), (1, "gemv6", 3072)):
        w, _ = weight(n, n)
        x0 = torch.randn(m, n, device=dev, generator=g).to(torch.bfloat16)

        def chain(x0=x0, path=path, w=w):
            x = x0
            for _ in range(10):
                x = gm.linear_w4a16(x, w, path=path) * 0.5
            return x

        eager = variant("loop", chain)
        outs = variant("pdl_trigger", lambda chain=chain: graph_replays(chain))
        row = {"chain_m": m, "variant": "pdl_trigger", "replays_equal": sum(int(torch.equal(o, eager)) for o in outs),
               "replays": len(outs), "finite": bool(torch.isfinite(eager).all())}
        res["checks"].append(row)
        print(row, flush=True)
    save()

if "modules" in PHASES:
    from fp4ptq.modules import NVFP4Linear

    for n, m, scheme, dtype in [(4096, 16, "w4a16", torch.bfloat16), (4096, 2, "w4a16", torch.bfloat16),
                                (4096, 16, "w4a4", torch.bfloat16), (4096, 8, "w4a16", torch.float16),
                                (3072, 1, "w4a16", torch.bfloat16), (3072, 1, "w4a4", torch.bfloat16),
                                (4096, 64, "w4a16", torch.bfloat16)]:
        wq = nvfp4.quantize((torch.randn(n, n, device=dev, generator=g) * 0.02).to(dtype))
        bias = torch.randn(n, device=dev, generator=g).to(dtype)
        mod = NVFP4Linear.from_quantized(wq, bias, scheme=scheme,
                                         input_amax=torch.tensor(8.0, device=dev) if scheme == "w4a4" else None)
        x0 = torch.randn(1, m, n, device=dev, generator=g).to(dtype)

        def chain(x0=x0, mod=mod):
            x = x0
            for _ in range(10):
                x = mod(x) * 0.5
            return x

        eager = [chain() for _ in range(3)]  # (plans built, then replayed through the C launcher)
        same = sum(int(torch.equal(o, eager[-1])) for o in graph_replays(chain))
        row = {"module": f"{n}x{n}", "m": m, "scheme": scheme, "dtype": str(dtype), "split_pdl": gm.split_pdl(dev),
               "path": gm._auto_path(m, dtype, scheme == "w4a4", n, dev, n),
               "eager_repeats_equal": all(torch.equal(e, eager[0]) for e in eager), "replays_equal": same,
               "finite": bool(torch.isfinite(eager[0]).all())}
        res.setdefault("modules", []).append(row)
        print(row, flush=True)
    save()

if "time" in PHASES:
    for name, m, n, k, bias, w4a4, path in ROWS:
        x, call = call_of(m, n, k, bias, w4a4, path)
        _, wb = weight(n, k)
        fns = {v: (lambda v=v: variant(v, call)) for v in VARIANTS}
        fns["cublas_bf16"] = lambda: x @ wb.T
        row = {"layer": name, "m": m, "bias": bias, "w4a4": w4a4,
               "path": path or gm._auto_path(m, x.dtype, w4a4, k, dev, n), **interleaved(fns, ROUNDS)}
        res["time"].append(row)
        print({a: (round(b, 2) if isinstance(b, float) else b) for a, b in row.items()}, f"{time.time() - T0:.0f}s",
              flush=True)
        save()
print("done", f"{time.time() - T0:.0f}s")
