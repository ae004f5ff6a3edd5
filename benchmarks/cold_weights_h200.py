"""M = 1 and 16 with the weights cold in L2, as in decoding: every call reads another copy of the layer.

The table (``bench_kernels_h200.py``) replays 10 calls on one weight in a CUDA graph, so layers up to
about 40 MB (the 8B layers; 50 MB of L2 on the H200) are read from L2 after the first call: the read
floor of 8B.down came out at 113% of copy bandwidth (session 14). A decoding step reads each layer
once, from DRAM. Here each implementation cycles through ``R`` copies of the layer's weight (R x its
bytes >= 256 MB, five times the L2) inside the graph, so every call misses L2; per call = graph time /
calls. Timed, in interleaved rounds (medians, us): the shipped dispatch, cuBLAS bf16, tinygemm int4,
and a plain read of the same NVFP4 bytes (``read_floor_h200``'s XOR kernel, the floor), at M = 1; the
dispatch and cuBLAS at M = 16. Outputs of the copies checked against the exact product first. (The
session-20 run, ``results/cold_weights_h200.json``, also timed the TMA GEMV of commit 6119889.)

``PHASES=sweep``: the M = 1 GEMV's configs (gemv6's, or gemv7's where the dispatch runs it) swept
cold on the 8B layers, then the best three and the shipped config in interleaved rounds, cold and
warm ($OUT/cold_sweep_h200.json).

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/cold_weights_h200.py     # $OUT/cold_weights_h200.json
"""
from __future__ import annotations

import json
import os
import statistics
import time

import peers_h200 as peers
import torch
from read_floor_h200 import read_xor

from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

LAYERS = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672)}
LAYERS = {a: b for a, b in LAYERS.items() if a in os.environ.get("ONLY", ",".join(LAYERS)).split(",")}
ROUNDS = int(os.environ.get("ROUNDS", "3"))
COLD_BYTES = 256 << 20
READ_CFGS = [(2048, 8, 2, 8), (1024, 8, 4, 8), (2048, 4, 4, 16)]
M1_TARGET = {name: (0.8 if name.startswith("70B") else 0.7) for name in LAYERS}


def copies(nbytes: int) -> int:
    return max(2, -(-COLD_BYTES // nbytes))


def gemv_launch(x1, w, y, cfg):
    """The M = 1 GEMV of the dispatch (gemv6, or gemv7 on the layers it takes) on weight ``w`` with its
    config replaced by ``cfg`` (gemv6: rows, warps, per_sm, segment, prefetch; gemv7: rows, warps, kc,
    per_sm, prefetch; None: the shipped one): ``run(x1, y)``."""
    n, k, words, sbits, enc = gm._weight_views(w)
    saved = gm._gemv6_config, gm._gemv7_config
    if cfg is not None:
        if gm._gemv7_config(1, n, k) is not None:
            gm._gemv7_config = lambda m, n_, k_: cfg
        else:
            gm._gemv6_config = lambda m, n_, k_: cfg
    try:
        return gm._gemv6(x1, words, sbits, enc, enc, enc, y, 1, n, k, False, None)
    finally:
        gm._gemv6_config, gm._gemv7_config = saved


def sweep_configs(n: int, k: int) -> list:
    if gm._gemv7_config(1, n, k) is not None:
        return [(rows, warps, kc, per_sm, True) for rows in (4, 8, 16) for warps in (2, 4) for kc in (64, 128)
                for per_sm in (4, 8, 16)]
    seg = gm._gemv6_config(1, n, k)[3]
    return [(rows, warps, per_sm, seg, pre) for rows in (2, 4, 8) for warps in (1, 2, 4) for per_sm in (4, 8, 16)
            for pre in (False, True)]


def sweep() -> None:
    dev = torch.device("cuda")
    t0 = time.time()
    res = {"env": peers.env(), "copy_TBps": peers.copy_bw(), "cold_bytes": COLD_BYTES, "rows": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in LAYERS.items():
        if not name.startswith("8B") or name == "8B.gate_up":
            continue
        byt = n * k // 2 + n * k // 16
        r4 = copies(byt)
        wqs = [nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02) for _ in range(r4)]
        x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
        y1 = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        exact = x1.float() @ wqs[0].dequantize(torch.float32).T
        shipped = gm.linear_w4a16(x1, wqs[0]).clone()
        row = {"layer": name, "n": n, "k": k, "bytes": byt, "copies": r4, "configs": []}
        fns = {}
        for cfg in [None] + sweep_configs(n, k):
            try:
                runs = [gemv_launch(x1, w, y1, cfg) for w in wqs]
                y1.fill_(float("nan"))
                runs[0](x1, y1)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a config that does not build or launch: recorded
                row["configs"].append({"cfg": cfg, "error": repr(exc)[:200]})
                continue
            rel = float((y1.float() - exact).norm() / exact.norm())
            if not rel < 1e-2:
                raise AssertionError(f"{name} {cfg}: relative error {rel}")
            fns[cfg] = runs
            us = peers.bench(lambda runs=runs: [r(x1, y1) for r in runs]) * 1e3 / r4
            row["configs"].append({"cfg": cfg, "rel_err": rel, "equal_shipped": bool(torch.equal(y1, shipped)),
                                   "cold_us": us})
        timed = sorted((c for c in row["configs"] if "cold_us" in c and c["cfg"] is not None),
                       key=lambda c: c["cold_us"])
        best = [None] + [tuple(c["cfg"]) for c in timed[:3]]
        times: dict = {}
        for _ in range(ROUNDS):
            for cfg in best:
                runs = fns[cfg]
                times.setdefault(f"cold {cfg}", []).append(
                    peers.bench(lambda runs=runs: [r(x1, y1) for r in runs]) * 1e3 / r4)
                times.setdefault(f"warm {cfg}", []).append(peers.bench(lambda runs=runs: runs[0](x1, y1)) * 1e3)
        row["median_us"] = {a: statistics.median(b) for a, b in times.items()}
        row["all_us"] = times
        res["rows"].append(row)
        print(name, {a: round(b, 2) for a, b in row["median_us"].items()}, flush=True)
        print("   errors:", [c for c in row["configs"] if "error" in c][:3], flush=True)
        with open(os.path.join(os.environ.get("OUT", "."), "cold_sweep_h200.json"), "w") as f:
            json.dump(res, f, indent=1)
    print("total s", round(time.time() - t0, 1))


def main() -> None:
    if os.environ.get("PHASES") == "sweep":
        sweep()
        return
    dev = torch.device("cuda")
    t0 = time.time()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    res = {"env": peers.env(), "copy_TBps": peers.copy_bw(), "cold_bytes": COLD_BYTES, "rows": []}
    copy = res["copy_TBps"]
    g = torch.Generator(device=dev).manual_seed(0)
    scratch = torch.empty(32 * sms, dtype=torch.int64, device=dev)
    for name, (n, k) in LAYERS.items():
        byt = n * k // 2 + n * k // 16
        r4, r16 = copies(byt), copies(n * k * 2)
        wqs = [nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02) for _ in range(r4)]
        wbs = [wqs[i % r4].dequantize(torch.bfloat16) for i in range(r16)]
        tgs = [peers.make_tinygemm(wbs[i % r16]) for i in range(copies(n * k // 2))]
        bufs = [torch.randint(-(1 << 62), 1 << 62, (byt // 8,), dtype=torch.int64, device=dev, generator=g)
                for _ in range(r4)]
        x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
        x16 = torch.randn(16, k, device=dev, dtype=torch.bfloat16, generator=g)
        checks = {}
        for i in (0, r4 - 1):
            exact = x1.float() @ wqs[i].dequantize(torch.float32).T
            got = gm.linear_w4a16(x1, wqs[i]).float()
            checks[f"shipped_copy{i}"] = float((got - exact).norm() / exact.norm())
        cands = {
            "shipped_m1": lambda: [gm.linear_w4a16(x1, w) for w in wqs],
            "cublas_m1": lambda: [x1 @ w.t() for w in wbs],
            "tinygemm_m1": lambda: [f(x1) for f in tgs],
            "shipped_m16": lambda: [gm.linear_w4a16(x16, w) for w in wqs],
            "cublas_m16": lambda: [x16 @ w.t() for w in wbs],
        }
        calls = {"shipped_m1": r4, "cublas_m1": r16, "tinygemm_m1": len(tgs), "shipped_m16": r4, "cublas_m16": r16}
        for cfg in READ_CFGS:
            cands[f"read{cfg}"] = (lambda c=cfg: [read_xor(b, c, sms, scratch) for b in bufs])
            calls[f"read{cfg}"] = r4
        if not all(v < 1e-2 for v in checks.values()):
            raise AssertionError(f"{name}: {checks}")
        times: dict = {}
        for _ in range(ROUNDS):
            for label, fn in cands.items():
                times.setdefault(label, []).append(peers.bench(fn) * 1e3 / calls[label])
        med = {a: statistics.median(b) for a, b in times.items()}
        pct = {a: 100 * byt / (b * 1e-6) / 1e12 / copy for a, b in med.items() if not a.endswith("m16")}
        row = {"layer": name, "n": n, "k": k, "bytes": byt, "copies_nvfp4": r4, "copies_bf16": r16,
               "checks": checks, "median_us": med, "all_us": times, "pct_copy_nvfp4_bytes": pct,
               "m1_target_us": byt / (M1_TARGET[name] * copy * 1e12) * 1e6}
        res["rows"].append(row)
        print(name, {a: round(b, 2) for a, b in med.items()}, flush=True)
        print("   % of copy:", {a: round(b) for a, b in pct.items()}, flush=True)
        cands.clear()  # (the copies go with the next layer's assignments)
        with open(os.path.join(os.environ.get("OUT", "."), "cold_weights_h200.json"), "w") as f:
            json.dump(res, f, indent=1)
    print("total s", round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
