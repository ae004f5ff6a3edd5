"""The Gluon wgmma W4A16 GEMM (``fp4ptq/kernels/wgmma.py``) on the H200:
correctness against the reference decode, then CUDA-graph timings against
cuBLAS bf16 and the current dispatch (us per call), M = 64..1024.

    PEERS_DIR=.peers python3 benchmarks/wgmma_h200.py   # -> $OUT/wgmma_h200.json

Knobs: ``WG_MS`` (rows, default 64,128,256,1024), ``WG_SWEEP=0`` (default
config only), ``WG_CHECKS=0`` (no correctness checks), ``WG_DIAG=1`` (the proxy
fence's cost and the register cap on two shapes, nothing else), ``WG_NCU=1`` (three
launches of the default at 8B.gate_up, M = ``WG_NCU_M`` (128), for Nsight Compute),
``WG_SHAPES`` (names from bench_kernels_h200.SHAPES), ``WG_JSON``, ``BUDGET_S`` (stop
timing after this many seconds). Runs so far: results/wgmma_h200_v1..v3.json and
results/wgmma_h200_diag.json (benchmarks/NOTES.md, "Kernels, sixth pass").

Checks (all must pass before a timing is trusted): random packed bytes (every
code) with random E4M3 scale bytes (subnormal, zero and the largest included)
against ``NVFP4Tensor.dequantize`` in fp32, relative Frobenius error of the
output < 1e-2, with tails of every tile (M, N not multiples of the tile, split
K), fp16 and a bias; every swept config is checked on its shape before it is
timed. A failed first check prints the K permutation the kernel applied
(identity activations), to debug the relabelling.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels_h200 import SHAPES  # noqa: E402

MS = [int(m) for m in os.environ.get("WG_MS", "64,128,256,1024").split(",")]
SWEEP = os.environ.get("WG_SWEEP", "1") == "1"
SHAPE_FILTER = [s for s in os.environ.get("WG_SHAPES", "").split(",") if s]


def sweep_configs(m: int, n: int, k: int, default: tuple, sms: int) -> list:
    """A few variants around the default (run v2's best and the register-capped ones):
    (BN, BM, BK, ring stages, wgmma wait depth, register cap; 128 fits two CTAs an SM)."""
    from fp4ptq.kernels import wgmma

    if m <= 64:
        plan = [(128, 64, 128, 3, 0, 128), (128, 64, 64, 3, 1, 128), (64, 64, 128, 3, 0, 0)]
    elif m <= 128:
        plan = [(128, 64, 128, 3, 0, 0), (128, 128, 128, 3, 0, 0), (128, 128, 128, 2, 1, 0),
                (128, 128, 64, 3, 0, 128)]
    else:
        plan = [(128, 128, 128, 2, 1, 0), (128, 128, 128, 3, 0, 0), (128, 128, 64, 3, 0, 128),
                (128, 256, 64, 2, 1, 0)]
    out = []
    for bn, bm, bk, stages, wait, maxnreg in plan:
        cfg = (bn, bm, bk, bn // 16, wgmma.k_split(m, n, k, bn, bm, bk, sms), stages, wait, maxnreg)
        if cfg != default and cfg not in out and wgmma.check_config(m, k, cfg) is None:
            out.append(cfg)
    return out


def main() -> int:
    sys.path.insert(0, os.environ.get("PEERS_DIR", ".peers"))
    import peers_h200 as peers

    from fp4ptq import nvfp4
    from fp4ptq.kernels import gemm as gm
    from fp4ptq.kernels import wgmma

    t0 = time.time()
    budget = float(os.environ.get("BUDGET_S", 400))
    out = {"env": peers.env(), "checks": [], "shapes": []}
    path_out = Path(os.environ.get("OUT", ".")) / os.environ.get("WG_JSON", "wgmma_h200.json")
    sms = gm._sm_count(torch.device("cuda"))

    def save():
        path_out.write_text(json.dumps(out, indent=1))

    def rel(y, ref):
        return float((y.float() - ref).norm() / ref.norm()) if torch.isfinite(y).all() else float("nan")

    gen = torch.Generator(device="cuda").manual_seed(0)

    def run_wg(x, wq, bias=None, cfg=None):
        n, k, words, sbits, enc = gm._weight_views(wq)
        y = torch.full((x.shape[0], n), float("nan"), device="cuda", dtype=x.dtype)
        return wgmma.matmul(x, words, sbits, enc, None, bias, y, cfg=cfg)

    if os.environ.get("WG_NCU") == "1":  # one kernel for Nsight Compute: 8B.gate_up, M = 128, the default
        n, k = SHAPES["8B.gate_up"]
        wq = nvfp4.quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
        x = torch.randn(int(os.environ.get("WG_NCU_M", 128)), k, device="cuda", generator=gen).bfloat16()
        for _ in range(3):
            run_wg(x, wq)
        torch.cuda.synchronize()
        return 0
    if os.environ.get("WG_DIAG") == "1":
        diag(out, save, peers, nvfp4, gm, wgmma, run_wg, rel, gen, sms)
        return 0

    # 0. the guard: sm_90 + the kernel's self-test on this GPU
    t_ready = time.time()
    try:
        out["wgmma_ready"] = wgmma.ready(torch.device("cuda"))
    except Exception as exc:  # noqa: BLE001
        out["wgmma_ready"] = repr(exc)[:500]
    out["wgmma_ready_s"] = time.time() - t_ready
    print("wgmma ready:", out["wgmma_ready"], "%.1fs" % out["wgmma_ready_s"], flush=True)

    # 1. every code, every kind of scale, ragged tiles (WG_CHECKS=0: skipped, for a run split into
    # one process a shape: a kernel fault ends its process only)
    first = True
    checks = [] if os.environ.get("WG_CHECKS", "1") == "0" else [
        (64, 1000, 1152, torch.bfloat16), (300, 1000, 3072, torch.bfloat16), (128, 4096, 4096, torch.bfloat16),
        (1024, 512, 8192, torch.bfloat16), (77, 2048, 1152, torch.float16), (256, 384, 2048, torch.float16)]
    for (m, n, k, dtype) in checks:
        packed = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8, generator=gen)
        sb = torch.randint(0, 127, (n, k // 16), device="cuda", dtype=torch.uint8, generator=gen)  # no NaN (0x7f)
        wq = nvfp4.NVFP4Tensor(packed, sb.view(torch.float8_e4m3fn), torch.tensor(3.7, device="cuda"),
                               torch.Size((n, k)), torch.bfloat16, None)
        x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
        bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
        ref = x.float() @ wq.dequantize(torch.float32).t() + bias.float()
        row = {"m": m, "n": n, "k": k, "dtype": str(dtype), "cfg": list(wgmma.config(m, n, k, sms))}
        try:
            row["err"] = rel(run_wg(x, wq, bias), ref)
        except Exception as exc:  # noqa: BLE001
            row["err"] = repr(exc)[:1500]
        if dtype == torch.bfloat16:
            row["gemm_err"] = rel(gm.linear_w4a16(x, wq, bias, path="gemm"), ref)
        for cfg in sweep_configs(m, n, k, tuple(row["cfg"]), sms)[:6]:
            try:
                row[f"err_{cfg}"] = rel(run_wg(x, wq, bias, cfg), ref)
            except Exception as exc:  # noqa: BLE001
                row[f"err_{cfg}"] = repr(exc)[:300]
        out["checks"].append(row)
        print(row, flush=True)
        if first and not (isinstance(row["err"], float) and row["err"] < 1e-2):
            diagnose(out, nvfp4, gm, wgmma)
        first = False
    save()
    if checks and not any(isinstance(r["err"], float) and r["err"] < 1e-2 for r in out["checks"]):
        print("no check passed: no timings", flush=True)
        return 1

    # 2. Llama shapes: quantized weights, timings
    for name, (n, k) in SHAPES.items():
        if SHAPE_FILTER and name not in SHAPE_FILTER:
            continue
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        wq = nvfp4.quantize(w.bfloat16())
        w = w.bfloat16()
        xs = torch.randn(max(MS), k, device="cuda", generator=gen).bfloat16()
        deq = wq.dequantize(torch.float32)
        for m in MS:
            if time.time() - t0 > budget:
                break
            x = xs[:m].contiguous()
            ref = x.float() @ deq.t()
            row = {"shape": name, "n": n, "k": k, "m": m,
                   "cublas_us": 1000 * peers.bench(lambda: x @ w.t()),
                   "dispatch_us": 1000 * peers.bench(lambda: gm.linear_w4a16(x, wq)),
                   "dispatch_path": gm._auto_path(m, x.dtype, False, k, x.device, n)}
            cfg0 = wgmma.config(m, n, k, sms)
            row["cfg"] = list(cfg0)
            try:
                row["err"] = rel(run_wg(x, wq), ref)
                row["wgmma_us"] = 1000 * peers.bench(lambda: run_wg(x, wq))
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:500]
            if SWEEP:
                sweep = {}
                for cfg in sweep_configs(m, n, k, cfg0, sms):
                    if time.time() - t0 > budget:
                        break
                    try:
                        err = rel(run_wg(x, wq, cfg=cfg), ref)
                        sweep[str(cfg)] = {"err": err}
                        if err < 1e-2:
                            sweep[str(cfg)]["us"] = 1000 * peers.bench(lambda: run_wg(x, wq, cfg=cfg))
                    except Exception as exc:  # noqa: BLE001
                        sweep[str(cfg)] = {"error": repr(exc)[:200]}
                ok = {c: v for c, v in sweep.items() if "us" in v}
                if ok:
                    best = min(ok, key=lambda c: ok[c]["us"])
                    row["best_cfg"], row["best_us"] = best, ok[best]["us"]
                row["sweep"] = sweep
            out["shapes"].append(row)
            print({a: (round(b, 2) if isinstance(b, float) else b) for a, b in row.items() if a != "sweep"},
                  flush=True)
            save()
    out["seconds"] = time.time() - t0
    save()
    print_table(out)
    return 0


def diag(out, save, peers, nvfp4, gm, wgmma, run_wg, rel, gen, sms):
    """What the proxy fence costs (``wgmma._FENCE = False``: timing only, the result is
    not guaranteed without it) and the register cap, on two shapes at M = 64, 128, 1024."""
    out["diag"] = []
    for name in ("8B.gate_up", "70B.down"):
        n, k = SHAPES[name]
        wq = nvfp4.quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
        deq = wq.dequantize(torch.float32)
        for m in (64, 128, 1024):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            ref = x.float() @ deq.t()
            cfgs = [wgmma.config(m, n, k, sms)]
            bm = 64 if m <= 64 else 128
            cfgs.append((128, bm, 64, 8, wgmma.k_split(m, n, k, 128, bm, 64, sms), 3, 1, 128))
            for cfg in cfgs:
                for fence in (True, False):
                    wgmma._FENCE = fence
                    try:
                        row = {"shape": name, "m": m, "cfg": list(cfg), "fence": fence,
                               "err": rel(run_wg(x, wq, cfg=cfg), ref),
                               "us": 1000 * peers.bench(lambda: run_wg(x, wq, cfg=cfg))}
                    except Exception as exc:  # noqa: BLE001
                        row = {"shape": name, "m": m, "cfg": list(cfg), "fence": fence, "error": repr(exc)[:300]}
                    wgmma._FENCE = True
                    out["diag"].append(row)
                    print(row, flush=True)
                    save()


def diagnose(out, nvfp4, gm, wgmma):
    """Identity activations (M = K = 128): row m of the output is column pi(m) of
    the weight; record pi (the identity when the relabelling is right)."""
    n, k = 128, 128
    codes = torch.randint(1, 8, (n, k), device="cuda", dtype=torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    sb = torch.full((n, k // 16), 0x38, device="cuda", dtype=torch.uint8)  # scale 1.0
    wq = nvfp4.NVFP4Tensor(packed, sb.view(torch.float8_e4m3fn), torch.tensor(1.0, device="cuda"),
                           torch.Size((n, k)), torch.bfloat16, None)
    deq = wq.dequantize(torch.float32)
    x = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    _, _, words, sbits, enc = gm._weight_views(wq)
    y = torch.zeros(k, n, device="cuda", dtype=torch.bfloat16)
    try:
        wgmma.matmul(x, words, sbits, enc, None, None, y, cfg=(128, 64, 64, 8, 128, 3, 0, 0))
        d = (y.float()[:, None, :] - deq.t()[None, :, :]).abs().sum(-1)  # [m, k']
        out["diagnose_pi"] = d.argmin(1).tolist()
        out["diagnose_min"] = d.min(1).values.tolist()
        out["diagnose_y0"] = y[0, :16].float().tolist()
        out["diagnose_w0"] = deq[:16, 0].tolist()
    except Exception as exc:  # noqa: BLE001
        out["diagnose_error"] = repr(exc)[:1500]
    print({a: b for a, b in out.items() if a.startswith("diagnose")}, flush=True)


def print_table(out):
    print("| shape | M | cuBLAS bf16 | dispatch (path) | wgmma default | best swept (cfg) | err |")
    print("|---|---|---|---|---|---|---|")
    for r in out["shapes"]:
        cb = r["cublas_us"]

        def f(v):
            return f"{v:.1f} ({cb / v:.2f}x)" if isinstance(v, float) else "-"

        print(f"| {r['shape']} | {r['m']} | {cb:.1f} | {f(r['dispatch_us'])} {r['dispatch_path']} | "
              f"{f(r.get('wgmma_us'))} | {f(r.get('best_us'))} {r.get('best_cfg', '')} | {r.get('err', r.get('error'))} |")


if __name__ == "__main__":
    raise SystemExit(main())
