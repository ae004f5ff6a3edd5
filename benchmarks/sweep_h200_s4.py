"""Session-4 sweeps on the H200, peers measured in the same run (CUDA-graph replays, us per call):

1. ``gemv6`` (x resident in registers, persistent row tiles) over (ROWS, warps,
   programs per SM) at M = 1 on the six Llama shapes, beside ``gemv5``, cuBLAS
   bf16 and tinygemm int4; then M = 2 with the best config.
2. W4A4 at M = 1: activations quantized inside ``gemv6`` (fused) vs the quantize
   kernel + GEMV (outputs must be identical).
3. Tiled GEMM at M = 16 over tiles, ``SWAP_AB`` included.
4. Dequantize + cuBLAS at M = 1024 / 8192 with the dequantize of slice i + 1
   overlapped under the GEMM of slice i (``CUBLAS_CHUNKS``; outputs identical).
5. Quantize-kernel tiles.

    PEERS_DIR=.peers ROUND=2 python3 benchmarks/sweep_h200_s4.py  # $OUT/sweep_h200_s4_round2.json

Round 1 swept (ROWS, warps, programs per SM) with K whole; round 2 adds K
segments (split-K through an fp32 workspace) and runs W4A4 on the best config;
round 3 added a software-pipelined row loop (5th element: ``tl.range``
num_stages; slower, so that option was removed from the kernel after the run:
re-running round 3 now times the stages-1 variant three times); round 4 times
the shipped tiles over programs per SM and a register cap (5th element:
``maxnreg``, 0 = none); round 5 re-swept rows, warps and programs per SM on a variant whose scale
loads took the code loads' layout (index ``(ab // 4) * 4 + ab % 4``: no
conversion in the loop, 72 instead of 127 registers under Triton 3.6); it was
not faster at the best configs and was not kept, so round 5 now re-times the
shipped kernel.
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


ROUND = int(os.environ.get("ROUND", 2))


def main() -> int:
    sys.path.insert(0, os.environ.get("PEERS_DIR", ".peers"))
    import peers_h200 as peers

    from fp4ptq import nvfp4
    from fp4ptq.kernels import gemm as gm
    from fp4ptq.kernels import quantize_kernel as qk

    t0 = time.time()
    budget = float(os.environ.get("BUDGET_S", 420))
    phases = os.environ.get("PHASES", "gemv6,w4a4,m16,overlap,quant").split(",")
    out = {"copy_TBps": peers.copy_bw(), "env": peers.env(), "gemv6": [], "w4a4": [], "m16": [], "overlap": [],
           "quant": []}
    path_out = Path(os.environ.get("OUT", ".")) / f"sweep_h200_s4_round{ROUND}.json"

    def save():
        path_out.write_text(json.dumps(out, indent=1))

    def left():
        return budget - (time.time() - t0)

    def rel(y, ref):
        return float((y.float() - ref).norm() / ref.norm()) if torch.isfinite(y).all() else float("nan")

    gen = torch.Generator(device="cuda").manual_seed(0)

    def weight(n, k):
        # per-row magnitudes over 6 decades: normal and subnormal e4m3 block scales
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        w *= torch.logspace(-6, 0, 7, device="cuda")[torch.randint(0, 7, (n, 1), device="cuda", generator=gen)]
        return w.bfloat16()

    orig6 = gm._gemv6_config
    gm.GEMV6_WHOLE_WAVES = False  # the configs' programs per SM as given (rounds 1-5 ran before the wave cut)
    best6 = {}
    if "gemv6" in phases:
        for name, (n, k) in SHAPES.items():
            if ROUND == 1:  # (ROWS, warps, programs per SM), whole K
                cfgs = [c + (k,) for c in itertools.product((1, 2, 4, 8), (2, 4, 8, 16), (2, 4, 8))
                        if not (c[0] == 1 and c[2] < 4) and not (c[0] == 8 and c[1] == 16)]
            elif ROUND == 2:  # + K segments (powers of two dividing K, >= 2048, or K itself)
                segs = [g for g in (2048, 4096, 8192) if k % g == 0 and g < k] + [k]
                cfgs = [c + (1,) for c in itertools.product((2, 4, 8), (1, 2, 4, 8), (4, 8), segs)
                        if (c[3] // 16) // 32 >= c[1] and (c[3] // 16) // (32 * c[1]) <= 8]
                cfgs.append(orig6(1, n, k))
            elif ROUND == 4:  # the shipped rule's tiles, programs per SM x register cap (maxnreg)
                base = orig6(1, n, k)
                cfgs = [base[:2] + (p,) + base[3:] + (r,) for p in (8, 12, 14, 16, 24) for r in (0, 64)]
            elif ROUND == 5:  # after the scale-load layout fix: rows x warps x programs per SM, the rule's segment
                base = orig6(1, n, k)
                cfgs = [(r, w, p, base[3]) for r in (2, 4, 8) for w in sorted({base[1], base[1] * 2})
                        for p in (8, 12, 14, 16, 24)]
            else:  # round 3: + software-pipelined row loop (tl.range num_stages), more programs per SM
                segs = {4096: [4096], 8192: [4096, 8192], 14336: [2048], 28672: [4096, 2048]}[k]
                cfgs = [c for c in itertools.product((4, 8), (1, 2, 4), (8, 16), segs, (1, 2, 3))
                        if 2 <= (c[3] // 16) // (32 * c[1]) <= 8]
                cfgs.append(orig6(1, n, k))
            w = weight(n, k)
            wq = nvfp4.quantize(w)
            x = torch.randn(2, k, device="cuda", generator=gen).bfloat16()
            ref = x.float() @ wq.dequantize(torch.float32).t()
            row = {"shape": name, "n": n, "k": k, "weight_bytes": n * k * 9 // 16,
                   "cublas_us": 1000 * peers.bench(lambda: x[:1] @ w.t()),
                   "gemv5_us": 1000 * peers.bench(lambda: gm.linear_w4a16(x[:1], wq, path="gemv5")),
                   "gemv5_err": rel(gm.linear_w4a16(x[:1], wq, path="gemv5"), ref[:1])}
            try:
                tiny = peers.make_tinygemm(w)
                row["tinygemm_us"] = 1000 * peers.bench(lambda: tiny(x[:1]))
            except Exception as exc:  # noqa: BLE001
                row["tinygemm_error"] = repr(exc)[:200]
            sweep = {}
            for cfg in cfgs:
                if left() < 0.5 * budget:
                    break
                gm._gemv6_config = lambda *a, c=cfg[:4] + (False,): c  # no prefetch (before session 7)
                gm.GEMV6_MAXNREG = (cfg[4] or None) if ROUND == 4 else None
                try:
                    y = torch.full((1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    gm.linear_w4a16(x[:1], wq, path="gemv6", out=y)
                    err = rel(y, ref[:1])
                    us = 1000 * peers.bench(lambda: gm.linear_w4a16(x[:1], wq, path="gemv6"))
                    sweep[str(cfg)] = {"us": us, "err": err}
                except Exception as exc:  # noqa: BLE001
                    sweep[str(cfg)] = {"error": repr(exc)[:300]}
            gm._gemv6_config = orig6
            gm.GEMV6_MAXNREG = None
            ok = {c: v for c, v in sweep.items() if "us" in v and v["err"] < 1e-2}
            if ok:
                best = min(ok, key=lambda c: ok[c]["us"])
                row["gemv6_best_cfg"], row["gemv6_best_us"] = best, ok[best]["us"]
                cfg = tuple(json.loads(best.replace("(", "[").replace(")", "]")))[:4] + (False,)
                best6[name] = cfg
                gm._gemv6_config = lambda *a, c=cfg: c
                y2 = torch.full((2, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                gm.linear_w4a16(x, wq, path="gemv6", out=y2)
                row["m2_gemv6_err"] = rel(y2, ref)
                row["m2_gemv6_us"] = 1000 * peers.bench(lambda: gm.linear_w4a16(x, wq, path="gemv6"))
                row["m2_gemv5_us"] = 1000 * peers.bench(lambda: gm.linear_w4a16(x, wq, path="gemv5"))
                row["m2_cublas_us"] = 1000 * peers.bench(lambda: x @ w.t())
                gm._gemv6_config = orig6
            row["gemv6_default_cfg"] = str(orig6(1, n, k))
            row["gemv6_default"] = sweep.get(row["gemv6_default_cfg"])
            row["sweep"] = sweep
            out["gemv6"].append(row)
            print(json.dumps({k_: v for k_, v in row.items() if k_ != "sweep"}), flush=True)
            save()
            del w, wq

    if "w4a4" in phases:
        for name, (n, k) in SHAPES.items():
            if left() < 0.35 * budget:
                break
            wq = nvfp4.quantize(weight(n, k))
            x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
            amax = (x.float().abs().amax() * 0.9).reshape(1)
            row = {"shape": name, "cfg": str(best6.get(name, orig6(1, n, k)))}
            gm._gemv6_config = lambda *a, c=best6.get(name, orig6(1, n, k)): c
            for rule in (None, "mse"):
                xh = nvfp4.fake_quantize(x.float(), rule, amax=amax)
                ref = xh @ wq.dequantize(torch.float32).t()
                gm.W4A4_FUSED = True
                yf = gm.linear_w4a4(x, wq, amax, four_six=rule, path="gemv6")
                row[f"fused_{rule}_us"] = 1000 * peers.bench(lambda: gm.linear_w4a4(x, wq, amax, four_six=rule,
                                                                                     path="gemv6"))
                gm.W4A4_FUSED = False
                ys = gm.linear_w4a4(x, wq, amax, four_six=rule, path="gemv6")
                row[f"separate_{rule}_us"] = 1000 * peers.bench(lambda: gm.linear_w4a4(x, wq, amax, four_six=rule,
                                                                                        path="gemv6"))
                row[f"gemv5_{rule}_us"] = 1000 * peers.bench(lambda: gm.linear_w4a4(x, wq, amax, four_six=rule,
                                                                                     path="gemv5"))
                gm.W4A4_FUSED = True
                row[f"identical_{rule}"] = bool(torch.equal(yf, ys))
                row[f"err_{rule}"] = rel(yf, ref)
            gm._gemv6_config = orig6
            out["w4a4"].append(row)
            print(json.dumps(row), flush=True)
            save()

    if "m16" in phases:
        orig = gm._gemm_config
        cfgs = [(16, 64, 128, 1, 4, 4, 0), (16, 32, 256, 1, 2, 4, 0), (16, 64, 256, 1, 4, 3, 0),
                (16, 64, 128, 1, 4, 4, 1), (16, 128, 128, 1, 4, 3, 1), (16, 64, 256, 1, 4, 3, 1),
                (16, 128, 256, 1, 8, 3, 1), (16, 256, 128, 1, 8, 3, 1), (16, 128, 64, 1, 4, 5, 1)]
        for name, (n, k) in SHAPES.items():
            if left() < 0.25 * budget:
                break
            w = weight(n, k)
            wq = nvfp4.quantize(w)
            x = torch.randn(16, k, device="cuda", generator=gen).bfloat16()
            ref = x.float() @ wq.dequantize(torch.float32).t()
            row = {"shape": name, "cublas_us": 1000 * peers.bench(lambda: x @ w.t()), "cfgs": {}}
            for cfg in cfgs:
                gm._gemm_config = lambda *a, c=cfg: c
                try:
                    err = rel(gm.linear_w4a16(x, wq, path="gemm"), ref)
                    row["cfgs"][str(cfg)] = {"us": 1000 * peers.bench(lambda: gm.linear_w4a16(x, wq, path="gemm")),
                                             "err": err}
                except Exception as exc:  # noqa: BLE001
                    row["cfgs"][str(cfg)] = {"error": repr(exc)[:300]}
            gm._gemm_config = orig
            out["m16"].append(row)
            print(json.dumps(row), flush=True)
            save()
            del w, wq

    if "overlap" in phases:
        for name, (n, k) in SHAPES.items():
            for m in (1024, 8192):
                if left() < 0.12 * budget:
                    break
                w = weight(n, k)
                wq = nvfp4.quantize(w)
                x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
                row = {"shape": name, "M": m, "cublas_us": 1000 * peers.bench(lambda: x @ w.t())}
                base = None
                for chunks in (1, 2, 4):
                    gm.CUBLAS_CHUNKS = chunks
                    y = gm.linear_w4a16(x, wq, path="cublas")
                    base = y if base is None else base
                    row[f"chunks{chunks}_identical"] = bool(torch.equal(y, base))
                    row[f"chunks{chunks}_us"] = 1000 * peers.bench(lambda: gm.linear_w4a16(x, wq, path="cublas"))
                gm.CUBLAS_CHUNKS = 1
                out["overlap"].append(row)
                print(json.dumps(row), flush=True)
                save()
                del w, wq, x

    if "quant" in phases:
        orig_tile = qk._tile
        for m, k in ((8192, 4096), (8192, 14336)):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            amax = x.float().abs().amax()
            for tile in ((8, 32, 4), (4, 32, 4), (8, 32, 8), (2, 64, 4), (4, 64, 8), (1, 64, 2), (16, 16, 4),
                         (8, 16, 2), (2, 32, 2)):
                if left() < 0.02 * budget:
                    break
                qk._tile = lambda *a, c=tile: c
                row = {"m": m, "k": k, "tile": tile}
                for rule in (None, "mse"):
                    us = 1000 * peers.bench(lambda: qk.launch_quantize(x, amax, rule))
                    row[f"{rule}_us"] = us
                    row[f"{rule}_TBps"] = (2 * m * k + m * k * 9 / 16) / (us * 1e-6) / 1e12
                out["quant"].append(row)
                print(json.dumps(row), flush=True)
            qk._tile = orig_tile
            save()
    out["wall_s"] = time.time() - t0
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
