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

The cold config sweep of the M = 1 GEMV (``PHASES=sweep``, session 30) is in benchmarks/HISTORY.md.

    PYTHONPATH=$PWD PEERS_DIR=.peers python benchmarks/cold_weights_h200.py     # $OUT/cold_weights_h200.json
"""
from __future__ import annotations

import os
import statistics
import time

import harness
import torch
from read_floor_h200 import read_xor

from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

LAYERS = {a: b for a, b in harness.LLAMA_LAYERS.items() if a in harness.env_list("ONLY", ",".join(harness.LLAMA_LAYERS))}
ROUNDS = int(os.environ.get("ROUNDS", "3"))
COLD_BYTES = 256 << 20
READ_CFGS = [(2048, 8, 2, 8), (1024, 8, 4, 8), (2048, 4, 4, 16)]
M1_TARGET = {name: (0.8 if name.startswith("70B") else 0.7) for name in LAYERS}


def copies(nbytes: int) -> int:
    return max(2, -(-COLD_BYTES // nbytes))


def main() -> None:
    dev = torch.device("cuda")
    t0 = time.time()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    peers = harness.peers()
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
                times.setdefault(label, []).append(harness.graph_us(fn) / calls[label])
        med = {a: statistics.median(b) for a, b in times.items()}
        pct = {a: 100 * byt / (b * 1e-6) / 1e12 / copy for a, b in med.items() if not a.endswith("m16")}
        row = {"layer": name, "n": n, "k": k, "bytes": byt, "copies_nvfp4": r4, "copies_bf16": r16,
               "checks": checks, "median_us": med, "all_us": times, "pct_copy_nvfp4_bytes": pct,
               "m1_target_us": byt / (M1_TARGET[name] * copy * 1e12) * 1e6}
        res["rows"].append(row)
        print(name, {a: round(b, 2) for a, b in med.items()}, flush=True)
        print("   % of copy:", {a: round(b) for a, b in pct.items()}, flush=True)
        cands.clear()  # (the copies go with the next layer's assignments)
        harness.write_json(harness.out_path("cold_weights_h200.json"), res)
    print("total s", round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
