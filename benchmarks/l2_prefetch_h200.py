"""L2 prefetch in the small-M kernels (``prefetch.global.L2`` / ``cp.async.bulk.prefetch.L2.global``
of the code words and scales a few steps ahead, no registers or shared memory held): gemv7 / gemv6
at M = 1 (``gemm.GEMV7_L2_AHEAD`` / ``GEMV6_L2_AHEAD``) and mma.py at M = 16 (``mma.MMA_L2_AHEAD``),
each against its build without, on the Llama-3.1 layers and Qwen2-7B down. Outputs bit-equal to
the build without (the hint changes no arithmetic) and within the kernels' tolerance of the
reference decode; then every variant timed in interleaved rounds (medians; CUDA-graph replays as
the table), with cuBLAS bf16.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/l2_prefetch_h200.py   # $OUT/l2_prefetch_h200.json

``ONLY=8B.down,...`` picks layers, ``GEMV_VARIANTS`` / ``MMA_VARIANTS`` the (ahead, op) pairs as
``2:1,4:2``, ``ROUNDS`` the rounds.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import mma

LAYERS = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672), "Qwen2-7B.down": (3584, 18944)}
LAYERS = {a: b for a, b in LAYERS.items() if a in os.environ.get("ONLY", ",".join(LAYERS)).split(",")}
ROUNDS = int(os.environ.get("ROUNDS", "3"))


def _pairs(text: str) -> list:
    return [tuple(int(v) for v in p.split(":")) for p in text.split(",") if p]


GEMV_VARIANTS = [(0, 1)] + _pairs(os.environ.get("GEMV_VARIANTS", "1:1,2:1,4:1,2:2"))
MMA_VARIANTS = [(0, 1)] + _pairs(os.environ.get("MMA_VARIANTS", "1:1,2:1,4:1,2:2"))


def _set_gemv(ahead: int, op: int) -> None:
    gm.GEMV7_L2_AHEAD = gm.GEMV6_L2_AHEAD = ahead
    gm.GEMV_L2_OP = op


def _set_mma(ahead: int, op: int) -> None:
    mma.MMA_L2_AHEAD, mma.MMA_L2_OP = ahead, op


def main() -> None:
    dev = torch.device("cuda")
    t0 = time.time()
    res = {"env": peers.env(), "copy_TBps": peers.copy_bw(), "rows": []}
    g = torch.Generator(device=dev).manual_seed(0)
    out = os.path.join(os.environ.get("OUT", "."), "l2_prefetch_h200.json")
    for name, (n, k) in LAYERS.items():
        wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
        wb = wq.dequantize(torch.bfloat16)
        wf = wq.dequantize(torch.float32)
        byt = n * k / 2 + n * k / 16
        row = {"layer": name, "n": n, "k": k, "bytes": byt, "checks": {}, "median_us": {}, "all_us": {}}
        for label, m, path, setter, variants in (("m1", 1, "gemv6", _set_gemv, GEMV_VARIANTS),
                                                  ("m16", 16, "mma", _set_mma, MMA_VARIANTS)):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            ref = x.float() @ wf.T
            fns, outs = {}, {}
            for ahead, op in variants:
                key = f"ahead{ahead}_op{op}" if ahead else "off"

                def fn(ahead=ahead, op=op):
                    setter(ahead, op)
                    return gm.linear_w4a16(x, wq, path=path)
                fns[key] = fn
                outs[key] = fn().clone()
            setter(0, 1)
            checks = {key: {"bit_equal": bool(torch.equal(o, outs["off"])),
                            "rel_err": float((o.float() - ref).norm() / ref.norm())} for key, o in outs.items()}
            row["checks"][label] = checks
            bad = {a: b for a, b in checks.items() if not b["bit_equal"] or not b["rel_err"] < 1e-2}
            if bad:
                raise AssertionError(f"{name} {label}: {bad}")
            times: dict = {}
            for _ in range(ROUNDS):
                times.setdefault("cublas", []).append(peers.bench(lambda: x @ wb.t()) * 1e3)
                for key, fn in fns.items():
                    times.setdefault(key, []).append(peers.bench(fn) * 1e3)
            setter(0, 1)
            med = {a: statistics.median(b) for a, b in times.items()}
            row["median_us"][label] = med
            row["all_us"][label] = times
            print(name, label, {a: round(b, 2) for a, b in med.items()},
                  f"off {100 * byt / (med['off'] * 1e-6) / 1e12 / res['copy_TBps']:.1f}% of copy,",
                  f"best {min(v for a, v in med.items() if a != 'cublas'):.2f}", flush=True)
        res["rows"].append(row)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    print("total s", round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
