"""The Gluon tensor-core small-M GEMM (``fp4ptq/kernels/mma.py``) on the H200:
correctness against the reference decode, then CUDA-graph timings against
cuBLAS bf16, the tiled Triton GEMM and the current dispatch (us per call).

    PEERS_DIR=.peers python3 benchmarks/mma_h200.py   # -> $OUT/mma_h200.json
    ... | python3 benchmarks/_fmt_mma.py                # one line per shape and M

Knobs: ``MMA_MS`` (rows, default 4,8,16,32,64), ``MMA_SWEEP=0`` (defaults only),
``MMA_ROUND=2`` (the second sweep), ``MMA_SHAPES``, ``MMA_JSON``, ``BUDGET_S``.

Checks (all must pass before any timing is trusted):
* random packed bytes (every code) with random E4M3 scale bytes (subnormal,
  zero and the largest scales included) against ``NVFP4Tensor.dequantize``
  in fp32: relative Frobenius error of the bf16 output < 1e-2, at tails of
  every tile (M = 3, 13, 40; N = 1000; K = 1040 and 3088, not multiples of
  the K step);
* quantized Llama-shaped weights: error against the fp32 reference, and the
  difference to the tiled GEMM.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels_h200 import SHAPES  # noqa: E402

MS = [int(m) for m in os.environ.get("MMA_MS", "4,8,16,32,64").split(",")]
SWEEP = os.environ.get("MMA_SWEEP", "1") == "1"
# round 2 (after the first sweep): M = 16 only, warps per program x rows x ring depth, K step 128;
# round 3 (several K steps a ring slot, ``SUB``) ran at commit cfb71ef (results/mma_h200_sweep4.json; no
# faster, removed after)
ROUND = int(os.environ.get("MMA_ROUND", 1))
SHAPE_FILTER = [s for s in os.environ.get("MMA_SHAPES", "").split(",") if s]


def main() -> int:
    sys.path.insert(0, os.environ.get("PEERS_DIR", ".peers"))
    import peers_h200 as peers

    from fp4ptq import nvfp4
    from fp4ptq.kernels import gemm as gm
    from fp4ptq.kernels import mma

    t0 = time.time()
    budget = float(os.environ.get("BUDGET_S", 400))
    out = {"env": peers.env(), "checks": [], "shapes": []}
    path_out = Path(os.environ.get("OUT", ".")) / os.environ.get("MMA_JSON", "mma_h200.json")

    def save():
        path_out.write_text(json.dumps(out, indent=1))

    def rel(y, ref):
        return float((y.float() - ref).norm() / ref.norm()) if torch.isfinite(y).all() else float("nan")

    gen = torch.Generator(device="cuda").manual_seed(0)

    def run_mma(x, wq, bias=None, cfg=None):
        n, k, words, sbits, enc = gm._weight_views(wq)
        y = torch.full((x.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
        return mma.matmul(x, words, sbits, enc, None, bias, y, cfg=cfg)

    # 0. the dispatch's guard: the kernel's self-test on this GPU (None = passed, the kernel is used)
    t_ready = time.time()
    out["mma_ready"] = gm.mma_unavailable_reason(16, 4096, torch.bfloat16, torch.device("cuda"))
    out["mma_ready_s"] = time.time() - t_ready
    print("mma ready:", out["mma_ready"], "%.1fs" % out["mma_ready_s"], flush=True)

    # 1. every code, every kind of scale, ragged tiles
    for (m, n, k) in [(3, 1000, 1088), (13, 1000, 3072), (16, 4096, 4096), (40, 2048, 1152), (64, 512, 8192),
                      (1, 300, 4096)]:
        packed = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8, generator=gen)
        sb = torch.randint(0, 127, (n, k // 16), device="cuda", dtype=torch.uint8, generator=gen)  # no NaN (0x7f)
        wq = nvfp4.NVFP4Tensor(packed, sb.view(torch.float8_e4m3fn), torch.tensor(3.7, device="cuda"),
                               torch.Size((n, k)), torch.bfloat16, None)
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
        ref = x.float() @ wq.dequantize(torch.float32).t() + bias.float()
        row = {"m": m, "n": n, "k": k, "cfg": list(mma.config(m, n, k)), "err": rel(run_mma(x, wq, bias), ref),
               "gemm_err": rel(gm.linear_w4a16(x, wq, bias, path="gemm"), ref)}
        for cfg in [(64, max(8, triton_pow2(m)), 64, 4, k, 1), (128, max(8, triton_pow2(m)), 64, 2, k // 2 if (k // 2) % 64 == 0 else k, 3),
                    (64, max(8, triton_pow2(m)), 128 if k % 128 == 0 else 64, 2, k, 4)]:
            try:
                row[f"err_{cfg}"] = rel(run_mma(x, wq, bias, cfg), ref)
            except Exception as exc:  # noqa: BLE001
                row[f"err_{cfg}"] = repr(exc)[:300]
        out["checks"].append(row)
        print(row, flush=True)
    save()

    # 2. Llama shapes: quantized weights, timings
    for name, (n, k) in SHAPES.items():
        if SHAPE_FILTER and name not in SHAPE_FILTER:
            continue
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        w *= torch.logspace(-6, 0, 7, device="cuda")[torch.randint(0, 7, (n, 1), device="cuda", generator=gen)]
        wq = nvfp4.quantize(w.bfloat16())
        w = w.bfloat16()
        xs = torch.randn(max(MS), k, device="cuda", generator=gen).bfloat16()
        deq = wq.dequantize(torch.float32)
        for m in MS:
            if time.time() - t0 > budget:
                break
            x = xs[:m].contiguous()
            ref = x.float() @ deq.t()
            row = {"shape": name, "n": n, "k": k, "m": m, "weight_bytes": n * k * 9 // 16,
                   "cublas_us": 1000 * peers.bench(lambda: x @ w.t()),
                   "dispatch_us": 1000 * peers.bench(lambda: gm.linear_w4a16(x, wq)),
                   "dispatch_path": gm._auto_path(m, x.dtype, False),
                   "err": rel(run_mma(x, wq), ref)}
            if m > 2:
                row["gemm_us"] = 1000 * peers.bench(lambda: gm.linear_w4a16(x, wq, path="gemm"))
            row["mma_cfg"] = list(mma.config(m, n, k))
            row["mma_us"] = 1000 * peers.bench(lambda: run_mma(x, wq))
            if SWEEP and m in (16, 64) and (ROUND != 2 or m == 16):
                sweep = {}
                bm = max(8, triton_pow2(m))
                grid = itertools.product((64, 128), (2, 4), (64, 128), (1, 2, 4, 8), (0, 3, 4)) if m == 16 \
                    else itertools.product((64, 128), (2, 4), (64,), (1, 2, 4), (0, 3, 4))
                if ROUND == 2:
                    grid = [(bn, w_, 128, k // mma.k_split(n, k, bn, 128), st)
                            for (bn, w_) in ((32, 1), (64, 1), (64, 2), (128, 2), (128, 4), (256, 4), (256, 8))
                            for st in (2, 3, 4)] if m == 16 else []
                for bn, warps, bk, split, pf in grid:
                    if bn % (16 * warps) or k % split or (k // split) % bk:
                        continue
                    if time.time() - t0 > budget:
                        break
                    cfg = (bn, bm, bk, warps, k // split, pf)
                    try:
                        err = rel(run_mma(x, wq, cfg=cfg), ref)
                        sweep[str(cfg)] = {"us": 1000 * peers.bench(lambda: run_mma(x, wq, cfg=cfg)), "err": err}
                    except Exception as exc:  # noqa: BLE001
                        sweep[str(cfg)] = {"error": repr(exc)[:200]}
                ok = {c: v for c, v in sweep.items() if "us" in v and v["err"] < 1e-2}
                if ok:
                    best = min(ok, key=lambda c: ok[c]["us"])
                    row["best_cfg"], row["best_us"] = best, ok[best]["us"]
                row["sweep"] = sweep
            out["shapes"].append(row)
            print({a: b for a, b in row.items() if a != "sweep"}, flush=True)
            save()
    out["seconds"] = time.time() - t0
    save()
    return 0


def triton_pow2(v: int) -> int:
    p = 1
    while p < v:
        p *= 2
    return p


if __name__ == "__main__":
    raise SystemExit(main())
