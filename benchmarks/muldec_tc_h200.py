"""The multiply decode (``mma.decode_mul_line``: a register of two bf16 codes in three integer operations
and the scale product, instead of five and the product) in the three tensor-core kernels on the H200,
against their shift decode: outputs bit-equal (the same registers, so the same sums), then times in
interleaved rounds (medians of CUDA-graph replays).

    PYTHONPATH=$PWD:$PWD/.peers:$PWD/benchmarks python benchmarks/muldec_tc_h200.py   # $OUT/muldec_tc_h200.json

Knobs: PHASES (comma-separated, default "checks,mma,wgmma,wsgemm"), ROUNDS (3), MMA_MS (mma.py's rows,
default 4,16,32,64), WG_MS (wgmma.py's, 96,128), WS_MS (wsgemm.py's, 128,256,1024), BUDGET_S (stop timing
new rows after this many seconds, 480), REPEATS (calls of each check with the attribute on, compared
bit for bit, 2), MULDEC_JSON (file name), ATTR (the module attribute compared off /
on, default MULDEC; e.g. SWAP_AB, wsgemm.py's only: PHASES=checks,wsgemm; session 27 ran it on a
CONSUMER_LOADS build since removed, results/wsgemm_consumer_loads_h200.json; other attributes' columns are
"off" / "on" instead of "shift" / "mul").
"""
from __future__ import annotations

import os
import time

import torch

from _rounds import interleaved, recorder, rel
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import mma, wgmma, wsgemm

import peers_h200 as peers

dev = torch.device("cuda")
T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "480"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
REPEATS = int(os.environ.get("REPEATS", "2"))  # calls of each check with the attribute on
PHASES = os.environ.get("PHASES", "checks,mma,wgmma,wsgemm").split(",")
MS = {"mma": [int(v) for v in os.environ.get("MMA_MS", "4,16,32,64").split(",")],
      "wgmma": [int(v) for v in os.environ.get("WG_MS", "96,128").split(",")],
      "wsgemm": [int(v) for v in os.environ.get("WS_MS", "128,256,1024").split(",")]}
ATTR = os.environ.get("ATTR", "MULDEC")
MODULES = {a: m for a, m in {"mma": mma, "wgmma": wgmma, "wsgemm": wsgemm}.items() if hasattr(m, ATTR)}
OFF, ON = ("shift", "mul") if ATTR == "MULDEC" else ("off", "on")
SHAPES = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672)}
# wgmma.py runs at M = 65..128 where wsgemm's rule does not take the layer (narrow ones)
WG_SHAPES = {"8B.k": (1024, 4096), "8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.down": (4096, 14336),
             "Qwen2-7B.qkv": (4608, 3584)}
out_path = os.path.join(os.environ.get("OUT", "."), os.environ.get("MULDEC_JSON", "muldec_tc_h200.json"))
res = {"env": peers.env(), "attr": ATTR, "ready": {}, "checks": [], "rows": []}


save, record = recorder(res, out_path, digits=4)


def with_mul(path: str, flag: bool, fn):
    """``fn`` run with ``<path module>.<ATTR>`` set to ``flag`` (read when a call builds its launch)."""
    mod = MODULES[path]

    def call():
        old = getattr(mod, ATTR)
        setattr(mod, ATTR, flag)
        try:
            return fn()
        finally:
            setattr(mod, ATTR, old)
    return call


def product(path, x, w, b=None, amax=None):
    if amax is None:
        return lambda: gm.linear_w4a16(x, w, b, path=path)
    return lambda: gm.linear_w4a4(x, w, amax, b, path=path)


for path, mod in MODULES.items():
    res["ready"][path] = mod.ready(dev)
print("ready:", res["ready"], flush=True)
g = torch.Generator(device=dev).manual_seed(0)

# (path, m, n, k, dtype, bias, w4a4): partial tiles, split K, bias, W4A4, fp16 (which keeps the shifts)
CHECKS = [("mma", 16, 6144, 4096, torch.bfloat16, False, False), ("mma", 5, 1000, 1088, torch.bfloat16, True, False),
          ("mma", 64, 4096, 14336, torch.bfloat16, True, False), ("mma", 2, 8192, 28672, torch.bfloat16, False, False),
          ("mma", 16, 4096, 4096, torch.bfloat16, True, True), ("mma", 13, 4096, 4096, torch.float16, False, False),
          ("wgmma", 128, 1024, 4096, torch.bfloat16, False, False), ("wgmma", 100, 200, 1024, torch.bfloat16, True, False),
          ("wgmma", 70, 2048, 2048, torch.bfloat16, False, True),
          ("wsgemm", 128, 28672, 4096, torch.bfloat16, False, False), ("wsgemm", 300, 520, 1024, torch.bfloat16, True, False),
          ("wsgemm", 1024, 6144, 4096, torch.bfloat16, True, False), ("wsgemm", 1000, 6100, 4096, torch.bfloat16, True, False),
          ("wsgemm", 1024, 4096, 4096, torch.bfloat16, False, True), ("wsgemm", 256, 4096, 14336, torch.float16, True, False)]
for path, m, n, k, dt, bias, w4a4 in (CHECKS if "checks" in PHASES else []):
    if path not in MODULES:
        continue
    w = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    x = torch.randn(m, k, device=dev, generator=g).to(dt)
    b = torch.randn(n, device=dev, generator=g).to(dt) if bias else None
    amax = x.float().abs().amax() if w4a4 else None
    row = {"path": path, "m": m, "n": n, "k": k, "dtype": str(dt), "bias": bias, "w4a4": w4a4}
    try:
        outs = [with_mul(path, flag, product(path, x, w, b, amax))() for flag in [False] + [True] * REPEATS]
        row[f"{ON}_equal_{OFF}"] = bool(torch.equal(outs[0], outs[1]))
        row[f"{ON}_repeat_equal"] = all(torch.equal(outs[1], o) for o in outs[2:])  # call after call
        ref = product("cublas", x, w, b, amax)()
        row["rel_mul_vs_cublas_path"] = rel(outs[1], ref)
        if not w4a4:
            row["rel_mul_vs_exact"] = rel(outs[1], x.float() @ w.dequantize(torch.float32).T + (b.float() if bias else 0))
    except Exception as exc:  # noqa: BLE001 - record and go on
        row["error"] = repr(exc)[:400]
    record("checks", row)

for path in ("mma", "wgmma", "wsgemm"):
    if path not in PHASES or path not in MODULES:
        continue
    shapes = WG_SHAPES if path == "wgmma" else SHAPES
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        wq = nvfp4.quantize(w)
        for m in MS[path]:
            if time.time() - T0 > BUDGET:
                break
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            row = {"path": path, "shape": name, "m": m, "dispatch": gm._auto_path(m, torch.bfloat16, False, k, dev, n)}
            try:
                fns = {"cublas_bf16": lambda: x @ w.t(),
                       OFF: with_mul(path, False, product(path, x, wq)),
                       ON: with_mul(path, True, product(path, x, wq))}
                if (path == "mma" and m == 16) or (path == "wsgemm" and m == 1024 and n <= 6144):
                    amax = x.float().abs().amax()
                    fns[f"w4a4_{OFF}"] = with_mul(path, False, product(path, x, wq, amax=amax))
                    fns[f"w4a4_{ON}"] = with_mul(path, True, product(path, x, wq, amax=amax))
                row["bit_equal"] = bool(torch.equal(fns[OFF](), fns[ON]()))
                row["median_us"] = mu = interleaved(fns, ROUNDS)
                row[f"{ON}_over_{OFF}"] = mu[ON] / mu[OFF]
                row[f"{ON}_vs_cublas"] = mu["cublas_bf16"] / mu[ON]
                if f"w4a4_{ON}" in mu:
                    row[f"w4a4_{ON}_over_{OFF}"] = mu[f"w4a4_{ON}"] / mu[f"w4a4_{OFF}"]
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:400]
            record("rows", row)

res["elapsed_s"] = time.time() - T0
save()
print("done", f"{res['elapsed_s']:.0f}s")
