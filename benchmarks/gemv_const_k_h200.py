"""gemv6 / gemv7 built for the layer's K (``FP4PTQ_GEMV_CONST_K``: K/16 a compile-time constant, a
thread's rows at constant distances, immediate load offsets) against the build that takes K at run
time, at M = 1 and 2 (W4A16) and M = 1 (W4A4), on the Llama-3.1 layers and a few others: outputs
bit-equal between the builds and within the GEMV tolerance of the reference decode, then both timed
in interleaved rounds (medians, CUDA-graph replays as the table), with cuBLAS bf16.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/gemv_const_k_h200.py   # $OUT/gemv_const_k_h200.json

``KNOB=NAME`` toggles another boolean switch of ``fp4ptq.kernels.gemm`` instead (off / on in the
"runtime_k" / "const_k" columns; $OUT/gemv_<name>_h200.json; session 14's GEMV7_PREFETCH_X, since
removed, ran this way).
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

LAYERS = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672), "70B.qkv": (10240, 8192),
          "Qwen2-7B.gate_up": (37888, 3584), "Qwen2-7B.down": (3584, 18944)}
LAYERS = {a: b for a, b in LAYERS.items() if a in os.environ.get("ONLY", ",".join(LAYERS)).split(",")}
ROUNDS = int(os.environ.get("ROUNDS", "3"))
KNOB = os.environ.get("KNOB", "GEMV_CONST_K")
if not isinstance(getattr(gm, KNOB, None), bool):
    raise SystemExit(f"KNOB={KNOB!r}: not a boolean switch of fp4ptq.kernels.gemm (e.g. GEMV_CONST_K)")


def main() -> None:
    dev = torch.device("cuda")
    t0 = time.time()
    res = {"env": peers.env(), "copy_TBps": peers.copy_bw(), "rows": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in LAYERS.items():
        wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
        wb = wq.dequantize(torch.bfloat16)
        wf = wq.dequantize(torch.float32)
        byt = n * k / 2 + n * k / 16
        cases = {}
        for m in (1, 2):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            cases[f"w4a16_m{m}"] = (x, lambda x=x: gm.linear_w4a16(x, wq, path="gemv6"),
                                    x.float() @ wf.T)
        x1 = cases["w4a16_m1"][0]
        amax = x1.float().abs().amax().reshape(1)
        cases["w4a4_m1"] = (x1, lambda: gm.linear_w4a4(x1, wq, amax, path="gemv6"),
                            gm.linear_w4a4(x1, wq, amax, path="gemv4").float())
        row = {"layer": name, "n": n, "k": k, "bytes": byt, "checks": {}, "median_us": {}, "all_us": {}}
        for label, (x, fn, ref) in cases.items():
            outs = {}
            for const in (False, True):
                setattr(gm, KNOB, const)
                outs[const] = fn().clone()
            setattr(gm, KNOB, True)
            rel = float((outs[True].float() - ref).norm() / ref.norm())
            row["checks"][label] = {"bit_equal": bool(torch.equal(outs[False], outs[True])), "rel_err": rel}
            if not row["checks"][label]["bit_equal"] or not rel < 1e-2:
                raise AssertionError(f"{name} {label}: {row['checks'][label]}")
            times: dict = {}
            for _ in range(ROUNDS):
                if label != "w4a4_m1":
                    times.setdefault("cublas", []).append(peers.bench(lambda: x @ wb.t()) * 1e3)
                for const in (False, True):
                    setattr(gm, KNOB, const)
                    times.setdefault("const_k" if const else "runtime_k", []).append(peers.bench(fn) * 1e3)
            setattr(gm, KNOB, True)
            med = {a: statistics.median(b) for a, b in times.items()}
            row["median_us"][label] = med
            row["all_us"][label] = times
            print(name, label, {a: round(b, 2) for a, b in med.items()},
                  f"{100 * byt / (med['const_k'] * 1e-6) / 1e12 / res['copy_TBps']:.1f}% of copy", flush=True)
        res["rows"].append(row)
        with open(os.path.join(os.environ.get("OUT", "."), "gemv_const_k_h200.json" if KNOB == "GEMV_CONST_K"
                               else f"gemv_{KNOB.lower()}_h200.json"), "w") as f:
            json.dump(res, f, indent=1)
    print("total s", round(time.time() - t0, 1))


if __name__ == "__main__":
    main()
