"""The warp-specialized GEMM (fp4ptq/kernels/wsgemm.py) on the H200: correctness against the reference
decode, then times against cuBLAS bf16 and the dispatch's dequantize + cuBLAS path at M = 256..8192 on
Llama-3.1 8B / 70B layers, W4A4 at M = 1024, and tile variants in interleaved rounds (medians).

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/wsgemm_h200.py   # $OUT/wsgemm_h200.json

Knobs: MS (rows, default 256,512,1024,2048,8192), ROUNDS (3), VARIANTS ("" skips the variant sweep),
WS_JSON (file name), BUDGET_S (stop timing new rows after this many seconds), PHASES (comma-separated,
default "checks,rows,variants"; "split" times the split tail (``wsgemm.plan``) against whole tiles and
dequantize + cuBLAS on the shapes where the plan splits; "w4a4big" times W4A4 through wsgemm against the
cuBLAS W4A4 path at M = 1536..8192; "shortk" times it on other models' layers with K = 3072 / 3584, below
the rule's MIN_K, against dequantize + cuBLAS at M = 256 and 1024; "swap" checks and times the swapped
operands (``wsgemm.SWAP_AB``) against the activations as wgmma's A operand, W4A16 at SWAP_MS (default
256,512,1024,2048) and W4A4 at M = 1024 / 8192, on the layers SWAP_SHAPES names (default all six; SWAP_ZOO=1:
15 layers of other models instead); SWAP_CHECKS=0 skips its checks).
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

import peers_h200 as peers
from _rounds import recorder, rel
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import wsgemm

dev = torch.device("cuda")
T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "400"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
MS = [int(v) for v in os.environ.get("MS", "256,512,1024,2048,8192").split(",")]
SHAPES = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672)}
# (BM, BN, BK, XSTAGES, BSTAGES, decoder warps, decoder registers, launch register cap); run v1 (4-warp
# decoder, results/wsgemm_h200_v1.json) also timed x3b3, x5b2, 152 decoder registers (within 2% of the
# default) and BM = 128 x BN = 128 (1.26x slower)
# run v2 (scale bytes by LDG, results/wsgemm_h200_v2.json): BM = 256 x BN = 128 7-9% ahead of 128 x 256,
# 8 decoder warps (at 80 registers) 10-17% slower
# run v3 (TMA scale bytes): 128 x 256 4-6% slower, 3 or 5 TMA stages within 3%
# run v4 (TMA refills the slot of step i - 2): 5 TMA stages or 3 decoded tiles within 3%, 128 x 256 12-17%
# slower
VARIANTS = {"x4b3": (256, 128, 64, 4, 3, 4, 128, 168), "dec8": (256, 128, 64, 4, 2, 8, 80, 128),
            "dec8_r96": (256, 128, 64, 4, 2, 8, 96, 128)}
if os.environ.get("VARIANTS") == "":
    VARIANTS = {}
PHASES = os.environ.get("PHASES", "checks,rows,variants").split(",")
out_path = os.path.join(os.environ.get("OUT", "."), os.environ.get("WS_JSON", "wsgemm_h200.json"))
res = {"env": peers.env(), "default": list(wsgemm.DEFAULT_CONFIG), "ready": None, "checks": [], "rows": [],
       "w4a4": [], "variants": [], "split": [], "w4a4big": []}


save, record = recorder(res, out_path)


def interleaved(fns: dict, rounds: int = 0) -> dict:
    """Median us a call of each function, timed in ``rounds`` (default ROUNDS) interleaved rounds."""
    times = {}
    for _ in range(rounds or ROUNDS):
        for label, fn in fns.items():
            times.setdefault(label, []).append(peers.bench(fn) * 1e3)
    return {label: statistics.median(t) for label, t in times.items()}


res["ready"] = wsgemm.ready(dev)
print("ready:", res["ready"], f"{time.time() - T0:.1f}s", flush=True)
save()
g = torch.Generator(device=dev).manual_seed(0)
# correctness: odd shapes, fp16, bias, W4A4, and the six layers at M = 1024
checks = [(300, 520, 1024, torch.bfloat16, False), (129, 256, 256, torch.bfloat16, True),
          (1000, 1000, 1280, torch.float16, True), (2048, 4096, 4096, torch.bfloat16, False),
          (4100, 6144, 4096, torch.bfloat16, True),
          # split tails (plan): all tiles in 4 K ranges; 8B qkv's tail in 2 (bias) and in 4 (fp16)
          (300, 520, 4096, torch.bfloat16, True), (1024, 6144, 4096, torch.bfloat16, True),
          (768, 6144, 4096, torch.float16, True), (1000, 6100, 4096, torch.bfloat16, True)]
for m, n, k, dt, bias in (checks if "checks" in PHASES else []):
    w = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    x = torch.randn(m, k, device=dev, generator=g).to(dt)
    b = torch.randn(n, device=dev, generator=g).to(dt) if bias else None
    ref = x.float() @ w.dequantize(torch.float32).T + (b.float() if bias else 0)
    y = torch.full((m, n), float("nan"), device=dev, dtype=dt)
    try:
        gm.linear_w4a16(x, w, b, path="wsgemm", out=y)
        row = {"m": m, "n": n, "k": k, "dtype": str(dt), "bias": bias, "plan": wsgemm.plan(m, n, k),
               "rel_ref": rel(y, ref), "rel_cublas": rel(y, gm.linear_w4a16(x, w, b, path="cublas"))}
        whole = torch.full((m, n), float("nan"), device=dev, dtype=dt)
        wsgemm.matmul(x, *gm._weight_views(w)[2:], None, b, whole, split=False)
        row["rel_whole_tiles"] = rel(y, whole)
        amax = x.float().abs().amax()
        y4 = gm.linear_w4a4(x, w, amax, b, path="wsgemm")
        row["w4a4_rel_cublas"] = rel(y4, gm.linear_w4a4(x, w, amax, b, path="cublas"))
    except Exception as exc:  # noqa: BLE001 - record and go on
        row = {"m": m, "n": n, "k": k, "error": repr(exc)[:400]}
    res["checks"].append(row)
    print(json.dumps(row), flush=True)
save()

for name, (n, k) in (SHAPES.items() if "rows" in PHASES else []):
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    wq = nvfp4.quantize(w)
    for m in MS:
        if time.time() - T0 > BUDGET:
            break
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        row = {"shape": name, "m": m}
        try:
            row["rel_cublas_path"] = rel(gm.linear_w4a16(x, wq, path="wsgemm"), gm.linear_w4a16(x, wq, path="cublas"))
            row["median_us"] = interleaved({
                "cublas_bf16": lambda: x @ w.t(), "dequant_cublas": lambda: gm.linear_w4a16(x, wq, path="cublas"),
                "wsgemm": lambda: gm.linear_w4a16(x, wq, path="wsgemm")})
            row["ws_vs_cublas"] = row["median_us"]["cublas_bf16"] / row["median_us"]["wsgemm"]
            row["tflops"] = 2 * m * n * k / (row["median_us"]["wsgemm"] * 1e-6) / 1e12
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:400]
        record("rows", row)
        del x
    if name in ("8B.qkv", "8B.gate_up", "8B.down", "70B.down") and time.time() - T0 < BUDGET:
        x = torch.randn(1024, k, device=dev, dtype=torch.bfloat16, generator=g)
        amax = x.float().abs().amax()
        row = {"shape": name, "m": 1024}
        try:
            row["cublas_bf16"] = peers.bench(lambda: x @ w.t()) * 1e3
            row["w4a4_cublas_path"] = peers.bench(lambda: gm.linear_w4a4(x, wq, amax, path="cublas")) * 1e3
            row["w4a4_wsgemm"] = peers.bench(lambda: gm.linear_w4a4(x, wq, amax, path="wsgemm")) * 1e3
            row["w4a4_wsgemm_over_cublas"] = row["w4a4_wsgemm"] / row["cublas_bf16"]
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:400]
        res["w4a4"].append(row)
        print(json.dumps(row), flush=True)
        save()

shipped = wsgemm.config
for name in ("8B.gate_up", "8B.o", "8B.down", "70B.down"):
    if not VARIANTS or "variants" not in PHASES or time.time() - T0 > BUDGET:
        break
    n, k = SHAPES[name]
    wq = nvfp4.quantize(torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02)
    x = torch.randn(1024, k, device=dev, dtype=torch.bfloat16, generator=g)
    ref = gm.linear_w4a16(x, wq, path="wsgemm")
    row = {"shape": name, "m": 1024, "errors": {}}
    times = {}
    for _ in range(ROUNDS):
        for label, cfg in {"default": wsgemm.DEFAULT_CONFIG, **VARIANTS}.items():
            wsgemm.config = lambda *a, c=cfg: c
            try:
                if label not in row["errors"]:
                    row["errors"][label] = rel(gm.linear_w4a16(x, wq, path="wsgemm"), ref)
                times.setdefault(label, []).append(peers.bench(lambda: gm.linear_w4a16(x, wq, path="wsgemm")) * 1e3)
            except Exception as exc:  # noqa: BLE001
                row["errors"][label] = repr(exc)[:300]
            finally:
                wsgemm.config = shipped
    row["median_us"] = {a: statistics.median(b) for a, b in times.items()}
    res["variants"].append(row)
    print(json.dumps(row), flush=True)
    save()

def whole_fill(m, n, sms):
    """The fraction of the SMs' program slots whole tiles use over their waves."""
    bm, bn = wsgemm.DEFAULT_CONFIG[:2]
    tiles = -(-m // bm) * -(-n // bn)
    return tiles / (-(-tiles // sms) * sms)


def whole_tiles(x, wq, x_enc=None):
    y = torch.empty(x.shape[0], wq.shape[0], device=dev, dtype=x.dtype)
    return wsgemm.matmul(x, *gm._weight_views(wq)[2:], x_enc, None, y, split=False)


# the split tail: every row where plan() splits (M = 129..1536 on the six layers), 3 interleaved rounds
if "split" in PHASES:
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    todo = [(name, m) for m in (129, 256, 512, 768, 1024, 1536) for name, (n, k) in SHAPES.items()
            if wsgemm.plan(m, n, k, sms)[1] > 1]
    weights = {}
    for name, m in todo:
        if time.time() - T0 > BUDGET:
            break
        n, k = SHAPES[name]
        if name not in weights:
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
            weights[name] = (w, nvfp4.quantize(w))
        w, wq = weights[name]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        row = {"shape": name, "m": m, "plan": wsgemm.plan(m, n, k, sms), "fill_whole": whole_fill(m, n, sms),
               "preferred": wsgemm.preferred(m, n, k, sms)}
        try:
            row["rel_whole"] = rel(gm.linear_w4a16(x, wq, path="wsgemm"), whole_tiles(x, wq))
            row["median_us"] = mu = interleaved({
                "cublas_bf16": lambda: x @ w.t(), "dequant_cublas": lambda: gm.linear_w4a16(x, wq, path="cublas"),
                "wsgemm_whole": lambda: whole_tiles(x, wq),
                "wsgemm_split": lambda: gm.linear_w4a16(x, wq, path="wsgemm")})
            row["split_vs_cublas"] = mu["cublas_bf16"] / mu["wsgemm_split"]
            row["split_vs_best_other"] = min(mu["dequant_cublas"], mu["wsgemm_whole"]) / mu["wsgemm_split"]
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:400]
        res["split"].append(row)
        print(json.dumps(row), flush=True)
        save()

# W4A4 above M = 1024: wsgemm (the activations' global scale folded into its output factor) against the
# cuBLAS W4A4 path (quantize, dequantize, cuBLAS, then a pass that scales the output)
if "w4a4big" in PHASES:
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        wq = nvfp4.quantize(w)
        for m in (1536, 2048, 4096, 8192):
            if time.time() - T0 > BUDGET:
                break
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            amax = x.float().abs().amax()
            row = {"shape": name, "m": m, "plan": wsgemm.plan(m, n, k)}
            try:
                row["rel_cublas_path"] = rel(gm.linear_w4a4(x, wq, amax, path="wsgemm"),
                                             gm.linear_w4a4(x, wq, amax, path="cublas"))
                row["median_us"] = mu = interleaved({
                    "cublas_bf16": lambda: x @ w.t(),
                    "w4a4_cublas_path": lambda: gm.linear_w4a4(x, wq, amax, path="cublas"),
                    "w4a4_wsgemm": lambda: gm.linear_w4a4(x, wq, amax, path="wsgemm")})
                row["wsgemm_time_over_cublas"] = mu["w4a4_wsgemm"] / mu["cublas_bf16"]
                row["cublas_path_time_over_cublas"] = mu["w4a4_cublas_path"] / mu["cublas_bf16"]
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:400]
            res["w4a4big"].append(row)
            print(json.dumps(row), flush=True)
            save()
            del x

# K below MIN_K: Qwen2-7B, Gemma-2-9B and Phi-3-mini layers (K = 3584 / 3072, multiples of 256)
if "shortk" in PHASES:
    res["shortk"] = []
    layers = {"Qwen2-7B.qkv": (4608, 3584), "Qwen2-7B.o": (3584, 3584), "Qwen2-7B.gate_up": (37888, 3584),
              "Gemma-2-9B.qkv": (8192, 3584), "Gemma-2-9B.gate_up": (28672, 3584), "Phi-3-mini.qkv": (9216, 3072),
              "Phi-3-mini.o": (3072, 3072), "Phi-3-mini.gate_up": (16384, 3072)}
    for name, (n, k) in layers.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        wq = nvfp4.quantize(w)
        for m in (256, 1024):
            if time.time() - T0 > BUDGET:
                break
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            row = {"shape": name, "m": m, "n": n, "k": k, "plan": wsgemm.plan(m, n, k)}
            try:
                row["rel_cublas_path"] = rel(gm.linear_w4a16(x, wq, path="wsgemm"),
                                             gm.linear_w4a16(x, wq, path="cublas"))
                row["median_us"] = mu = interleaved({
                    "cublas_bf16": lambda: x @ w.t(), "dequant_cublas": lambda: gm.linear_w4a16(x, wq, path="cublas"),
                    "wsgemm": lambda: gm.linear_w4a16(x, wq, path="wsgemm")})
                row["ws_over_dequant"] = mu["dequant_cublas"] / mu["wsgemm"]
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:400]
            res["shortk"].append(row)
            print(json.dumps(row), flush=True)
            save()



def swap_set(flag, fn):
    """``fn`` run with ``wsgemm.SWAP_AB`` set to ``flag`` (read when a call builds its launch)."""
    def call():
        old = wsgemm.SWAP_AB
        wsgemm.SWAP_AB = flag
        try:
            return fn()
        finally:
            wsgemm.SWAP_AB = old
    return call


# the swapped operands (``wsgemm.SWAP_AB``: the decoded weight tile as wgmma's A, the activations as B) against
# the activations as A, on the 256-row tile: checks (odd shapes, split tails, fp16, bias, W4A4), then W4A16 at
# SWAP_MS on the six layers and W4A4 at M = 1024 / 8192 in interleaved rounds
if "swap" in PHASES:
    res["swap_checks"], res["swap"] = [], []
    for m, n, k, dt, bias in (checks if os.environ.get("SWAP_CHECKS", "1") != "0" else []):
        if m <= 128:
            continue  # (the 64- / 128-row tiles are never swapped)
        w = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
        x = torch.randn(m, k, device=dev, generator=g).to(dt)
        b = torch.randn(n, device=dev, generator=g).to(dt) if bias else None
        ref = x.float() @ w.dequantize(torch.float32).T + (b.float() if bias else 0)
        row = {"m": m, "n": n, "k": k, "dtype": str(dt), "bias": bias, "plan": wsgemm.plan(m, n, k)}
        try:
            outs = {}
            for flag in (False, True):
                y = torch.full((m, n), float("nan"), device=dev, dtype=dt)
                swap_set(flag, lambda: gm.linear_w4a16(x, w, b, path="wsgemm", out=y))()
                outs[flag] = y
            row["rel_ref_swapped"] = rel(outs[True], ref)
            row["rel_ref_plain"] = rel(outs[False], ref)
            row["swapped_equal_plain"] = bool(torch.equal(outs[True], outs[False]))
            row["max_abs_swapped_vs_plain"] = float((outs[True].float() - outs[False].float()).abs().max())
            amax = x.float().abs().amax()
            y4 = swap_set(True, lambda: gm.linear_w4a4(x, w, amax, b, path="wsgemm"))()
            y4p = swap_set(False, lambda: gm.linear_w4a4(x, w, amax, b, path="wsgemm"))()
            row["w4a4_rel_cublas_swapped"] = rel(y4, gm.linear_w4a4(x, w, amax, b, path="cublas"))
            row["w4a4_swapped_equal_plain"] = bool(torch.equal(y4, y4p))
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:400]
        res["swap_checks"].append(row)
        print(json.dumps(row), flush=True)
        save()
    swap_ms = [int(v) for v in os.environ.get("SWAP_MS", "256,512,1024,2048").split(",")]
    swap_shapes = os.environ.get("SWAP_SHAPES", ",".join(SHAPES)).split(",")
    # SWAP_ZOO=1: other models' layers (K % 256 == 0; model_zoo_h200.py's list) instead of Llama-3.1's
    zoo = {"Qwen2-7B.qkv": (4608, 3584), "Qwen2-7B.gate_up": (37888, 3584), "Qwen2-7B.down": (3584, 18944),
           "Qwen2-72B.qkv": (10240, 8192), "Qwen2-72B.gate_up": (59136, 8192), "Qwen2-72B.down": (8192, 29568),
           "Llama-2-7B.qkv": (12288, 4096), "Llama-2-7B.gate_up": (22016, 4096), "Llama-2-7B.down": (4096, 11008),
           "Gemma-2-9B.qkv": (8192, 3584), "Gemma-2-9B.o": (3584, 4096), "Gemma-2-9B.gate_up": (28672, 3584),
           "Phi-3-mini.qkv": (9216, 3072), "Phi-3-mini.gate_up": (16384, 3072), "Phi-3-mini.down": (3072, 8192)}
    swap_layers = zoo if os.environ.get("SWAP_ZOO") == "1" else SHAPES
    for name, (n, k) in swap_layers.items():
        if swap_layers is SHAPES and name not in swap_shapes:
            continue
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        wq = nvfp4.quantize(w)
        for m in swap_ms + ([8192] if k == 4096 and n <= 6144 and 8192 not in swap_ms else []):
            if time.time() - T0 > BUDGET:
                break
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            amax = x.float().abs().amax()
            w4a4 = m == 8192 or (m == 1024 and name in ("8B.qkv", "8B.o", "70B.down", "Qwen2-7B.qkv", "Gemma-2-9B.o"))
            row = {"shape": name, "m": m, "plan": wsgemm.plan(m, n, k)}
            try:
                fns = {"cublas_bf16": lambda: x @ w.t()}
                if m <= 2048:
                    fns["plain"] = swap_set(False, lambda: gm.linear_w4a16(x, wq, path="wsgemm"))
                    fns["swapped"] = swap_set(True, lambda: gm.linear_w4a16(x, wq, path="wsgemm"))
                    row["rel_swapped_vs_plain"] = rel(fns["swapped"](), fns["plain"]())
                if w4a4:
                    fns["w4a4_plain"] = swap_set(False, lambda: gm.linear_w4a4(x, wq, amax, path="wsgemm"))
                    fns["w4a4_swapped"] = swap_set(True, lambda: gm.linear_w4a4(x, wq, amax, path="wsgemm"))
                    row["w4a4_rel_swapped_vs_plain"] = rel(fns["w4a4_swapped"](), fns["w4a4_plain"]())
                row["median_us"] = mu = interleaved(fns)
                for a in ("plain", "swapped", "w4a4_plain", "w4a4_swapped"):
                    if a in mu:
                        row[f"{a}_vs_cublas"] = mu["cublas_bf16"] / mu[a]
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:400]
            record("swap", row)
            del x

# SWAP_PLANS=1: 8B qkv at M = 1024 (the layer on the 0.85x line) under other tail plans than ``plan``'s,
# swapped, in 5 interleaved rounds: whole tiles, the last 60 tiles in 2 (shipped), 3 or 4 K ranges
if os.environ.get("SWAP_PLANS") == "1":
    n, k = SHAPES["8B.qkv"]
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    wq = nvfp4.quantize(w)
    x = torch.randn(1024, k, device=dev, dtype=torch.bfloat16, generator=g)
    shipped_plan, shipped_summing = wsgemm.plan, wsgemm.summing_plan
    forced = {"parts3": (132, 3, 24, 33, 0.0), "parts4": (132, 4, 16, 33, 0.0)}

    def with_plan(fixed):
        def call():
            if fixed is not None:  # (summing_plan, cached for the shipped plan, recomputed from the forced one)
                wsgemm.plan = lambda *a, **kw: fixed
                wsgemm.summing_plan = shipped_summing.__wrapped__
            try:
                return gm.linear_w4a16(x, wq, path="wsgemm")
            finally:
                wsgemm.plan, wsgemm.summing_plan = shipped_plan, shipped_summing
        return call
    fns = {"cublas_bf16": lambda: x @ w.t(), "shipped": with_plan(None),
           "whole": lambda: whole_tiles(x, wq), **{a: with_plan(b) for a, b in forced.items()}}
    ref = fns["shipped"]()
    row = {"shape": "8B.qkv", "m": 1024, "plan": shipped_plan(1024, n, k), "rel_vs_shipped": {}}
    try:
        for a in ("whole", *forced):
            row["rel_vs_shipped"][a] = rel(fns[a](), ref)
        row["median_us"] = interleaved(fns, rounds=5)
    except Exception as exc:  # noqa: BLE001
        row["error"] = repr(exc)[:400]
    res["swap_plans"] = row
    print(json.dumps(row), flush=True)
    save()

res["elapsed_s"] = time.time() - T0
save()
print("done", f"{res['elapsed_s']:.0f}s")
