"""The TMA GEMV (``fp4ptq/kernels/gemv_tma.py``: weight tiles copied by TMA into a shared-memory ring,
several tiles in flight a program) against the shipped M = 1 GEMV (gemv6 / gemv7, the dispatch) and
cuBLAS bf16, on the Llama-3.1 layers.

Per layer: every config of a small sweep (rows, warps, blocks a step, ring stages, programs an SM;
those whose rings do not fit an SM's shared memory left out) is checked against the exact product
(relative Frobenius error < 1e-2) and against the shipped GEMV (share of bit-equal outputs), timed
once, then the best three, the shipped GEMV and cuBLAS in interleaved rounds (medians; CUDA-graph
replays of 10 calls, ``peers_h200.bench``, as the table).

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/gemv_tma_h200.py      # $OUT/gemv_tma_h200.json

``ONLY=8B.qkv,...`` picks layers, ``ROUNDS`` the interleaved rounds (3), ``MS=1,2`` the rows.
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import time

import peers_h200 as peers
import torch

from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import gemv_tma

LAYERS = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672)}
LAYERS = {a: b for a, b in LAYERS.items() if a in os.environ.get("ONLY", ",".join(LAYERS)).split(",")}
ROUNDS = int(os.environ.get("ROUNDS", "3"))
MS = [int(v) for v in os.environ.get("MS", "1").split(",")]
SMEM = 220 * 1024  # an SM's shared memory less the reserve, rounded down


def sweep(n: int, k: int) -> list:
    """(rows, warps, kc, stages, per_sm) configs for this shape whose rings fit an SM: the whole K a
    step where it is at most 256 blocks, else steps of 128 blocks (and 256 where they divide K); the
    70B layers (at their targets already: the control) on 2-warp 8-row tiles only."""
    kb = k // 16
    kcs = [kb] if kb <= 256 else ([128, 256] if kb % 256 == 0 else [128])
    large = n * k >= 1 << 27
    out = []
    for rows, warps, kc, stages, per_sm in itertools.product((4, 8), (2, 4), kcs, (2, 3, 4), (2, 4, 8)):
        if (warps == 4 and rows * kc < 1024) or (large and (rows, warps) != (8, 2)):
            continue
        if stages * per_sm * rows * kc * 9 > SMEM:
            continue
        out.append((rows, warps, kc, stages, per_sm))
    return out


def main() -> None:
    dev = torch.device("cuda")
    t0 = time.time()
    res = {"env": peers.env(), "copy_TBps": peers.copy_bw(), "rows": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in LAYERS.items():
        wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
        wb = wq.dequantize(torch.bfloat16)
        wf = wq.dequantize(torch.float32)
        _, _, words, sbits, enc = gm._weight_views(wq)
        byt = n * k / 2 + n * k / 16
        for m in MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            exact = x.float() @ wf.T
            shipped = gm.linear_w4a16(x, wq).clone()
            row = {"layer": name, "n": n, "k": k, "m": m, "bytes": byt, "configs": []}
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            fns = {}
            for cfg in sweep(n, k):
                try:
                    run = gemv_tma.launch(x, words, sbits, enc, enc, enc, y, m, n, k, False, None, cfg)
                    y.fill_(float("nan"))
                    run(x, y)
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - a config this Triton will not build: recorded
                    row["configs"].append({"cfg": cfg, "error": repr(exc)[:200]})
                    continue
                rel = float((y.float() - exact).norm() / exact.norm())
                same = float((y == shipped).float().mean())
                if not rel < 1e-2:
                    raise AssertionError(f"{name} m={m} {cfg}: relative error {rel}")
                fn = (lambda run=run: run(x, y))
                us = peers.bench(fn) * 1e3
                fns[cfg] = fn
                row["configs"].append({"cfg": cfg, "rel_err": rel, "bit_equal_share": same, "us": us})
            timed = sorted((c for c in row["configs"] if "us" in c), key=lambda c: c["us"])
            best = [tuple(c["cfg"]) for c in timed[:3]]
            times: dict = {}
            for _ in range(ROUNDS):
                times.setdefault("cublas", []).append(peers.bench(lambda: x @ wb.t()) * 1e3)
                times.setdefault("shipped", []).append(peers.bench(lambda: gm.linear_w4a16(x, wq)) * 1e3)
                for cfg in best:
                    times.setdefault(str(cfg), []).append(peers.bench(fns[cfg]) * 1e3)
            med = {a: statistics.median(b) for a, b in times.items()}
            row["median_us"] = med
            row["all_us"] = times
            row["copy_share"] = {a: byt / (b * 1e-6) / 1e12 / res["copy_TBps"] for a, b in med.items()}
            res["rows"].append(row)
            print(name, m, {a: round(b, 2) for a, b in med.items()},
                  {a: f"{100 * b:.0f}%" for a, b in row["copy_share"].items()}, flush=True)
            print("  errors:", [c for c in row["configs"] if "error" in c][:2], flush=True)
            with open(os.path.join(os.environ.get("OUT", "."), "gemv_tma_h200.json"), "w") as f:
                json.dump(res, f, indent=1)
    print("total s", round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
