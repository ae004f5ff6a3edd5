"""The warp-specialized GEMM (fp4ptq/kernels/wsgemm.py) with 128- and 64-row activation tiles at
M = 64..256 on the H200, against the paths the dispatch takes there (mma.py up to 64, wgmma.py at
65..128, wsgemm's 256-row tile or dequantize + cuBLAS above) and cuBLAS bf16; and the decoder on 8
warps (two threads a row) at M = 1024. Correctness first (reference decode, odd shapes, fp16, bias,
W4A4, split tails), then interleaved rounds (medians, CUDA-graph replays).

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/wsgemm_small_m_h200.py   # $OUT/wsgemm_small_m_h200.json

Knobs: PHASES (default "checks,small,big"; "fp16" times the shipped rule with fp16 activations at M = 64
and 128 against mma.py / wgmma.py and cuBLAS fp16), MS (default 64,96,128,192,256), SHAPES_SMALL (layer names;
``SHAPES`` has the Llama-3.1 layers and other models' wide and narrow ones; at M = 65..128 the rows also time
dequantize + cuBLAS, and shapes wsgemm does not take (K % 256 != 0) run without its variants),
SMALL_DTYPE (bf16 | fp16: the activations of the "small" phase and its cuBLAS peer), ROUNDS (3), BUDGET_S
(stop timing new rows after this many seconds), JSON (file name), VARIANTS (the small-tile variants to run,
comma-separated; default all), BIG_VARIANTS (likewise at M = 1024).
"""
from __future__ import annotations

import json
import os
import time

import torch

import peers_h200 as peers
from _rounds import interleaved, rel
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import wsgemm

dev = torch.device("cuda")
T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "420"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
MS = [int(v) for v in os.environ.get("MS", "64,96,128,192,256").split(",")]
SHAPES = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672),
          # the unfused Llama-3.1-8B projections (not in the default SHAPES_SMALL)
          "8B.k": (1024, 4096), "8B.gate": (14336, 4096),
          # other models' wide layers whose 128 x 256 plan fills 0.65-0.78 of the SMs (the wide tile's rule)
          "Qwen2-7B.gate_up": (37888, 3584), "Llama-2-7B.gate_up": (22016, 4096),
          # other models' narrower layers, which wsgemm's rule leaves to wgmma.py at M = 65..128 (N under
          # MIN_N_SMALL_M, K under MIN_K, or a plan filling under MIN_WAVE_FILL; Qwen2-72B down: K % 256 != 0)
          "Qwen2-7B.qkv": (4608, 3584), "Qwen2-7B.o": (3584, 3584), "Qwen2-7B.down": (3584, 18944),
          "Gemma-2-9B.o": (3584, 4096), "Gemma-2-9B.down": (3584, 14336), "Phi-3-mini.qkv": (9216, 3072),
          "Phi-3-mini.o": (3072, 3072), "Phi-3-mini.down": (3072, 8192), "Phi-3-mini.gate_up": (16384, 3072),
          "Llama-2-7B.qkv": (12288, 4096),
          "Qwen2-72B.down": (8192, 29568), "Qwen2-72B.qkv": (10240, 8192), "70B.o": (8192, 8192)}
SMALL = os.environ.get("SHAPES_SMALL", "8B.qkv,8B.o,8B.gate_up,8B.down,70B.gate_up,70B.down").split(",")
PHASES = os.environ.get("PHASES", "checks,small,big").split(",")
# the activations (and the cuBLAS peer's weight, still in the "cublas_bf16" column) of the "small" phase
if os.environ.get("SMALL_DTYPE", "bf16") not in ("bf16", "fp16"):
    raise SystemExit(f"wsgemm_small_m_h200: SMALL_DTYPE is bf16 or fp16, got {os.environ['SMALL_DTYPE']!r}")
SMALL_DT = {"bf16": torch.bfloat16, "fp16": torch.float16}[os.environ.get("SMALL_DTYPE", "bf16")]
# (BM, BN, BK, XSTAGES, BSTAGES, decoder warps, decoder registers, launch register cap)
SMALL_VARIANTS = {
    "bm128": (128, 128, 64, 4, 2, 4, 128, 168),        # 1 CTA an SM (registers)
    "bm128_k128": (128, 128, 128, 3, 2, 4, 128, 168),  # half the ring round trips a weight
    "bm128_dec8": (128, 128, 64, 4, 2, 8, 80, 128),    # 8 decoder warps, two threads a row
    "bm64": (64, 128, 64, 4, 2, 4, 96, 128),           # one consumer warpgroup: 2 CTAs an SM
    # 64 weight rows a tile: one consumer warpgroup (64 accumulator registers a thread) at BM = 128 too
    "bm128n64": (128, 64, 64, 4, 2, 4, 96, 128),       # 2 CTAs an SM
    "bm128n64_r112": (128, 64, 64, 4, 2, 4, 80, 112),  # 2 CTAs an SM, fewer registers
    "bm64n64": (64, 64, 64, 4, 2, 4, 64, 80),          # 3 CTAs an SM
    # 256 weight rows a tile (session 26): each consumer warpgroup reads the decoded tile once a k16
    # (m64n256k16) for twice the work, 144 KB of shared-memory traffic a 128 x 256 x 64 step against
    # 2 x 88 for two 128 x 128 ones; half the tiles (wide layers only)
    "bm128n256": (128, 256, 64, 4, 2, 4, 128, 168),
    "bm128n256_x3": (128, 256, 64, 3, 2, 4, 128, 168),
}
if os.environ.get("VARIANTS"):
    SMALL_VARIANTS = {a: SMALL_VARIANTS[a] for a in os.environ["VARIANTS"].split(",")}
# (a label ending in "_plain" runs unswapped: 8 decoder warps leave the swapped tile's m64n256k16 consumers too
# few registers, ptxas asks for 154 at a launch cap of 128)
BIG_VARIANTS = {"default": wsgemm.DEFAULT_CONFIG, "dec8": (256, 128, 64, 4, 2, 8, 80, 128),
                "dec8_r96": (256, 128, 64, 4, 2, 8, 96, 128), "n64": (256, 64, 64, 4, 2, 4, 128, 168),
                "default_plain": wsgemm.DEFAULT_CONFIG, "dec8_plain": (256, 128, 64, 4, 2, 8, 80, 128)}
if os.environ.get("BIG_VARIANTS"):
    BIG_VARIANTS = {a: BIG_VARIANTS[a] for a in os.environ["BIG_VARIANTS"].split(",")}
out_path = os.path.join(os.environ.get("OUT", "."), os.environ.get("JSON", "wsgemm_small_m_h200.json"))
res = {"env": peers.env(), "variants": SMALL_VARIANTS, "big_variants": BIG_VARIANTS, "ready": None,
       "checks": [], "small": [], "big": []}


def save():
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)



def with_config(cfg, fn):
    """Run ``fn`` with the dispatch's wsgemm tile set to ``cfg``."""
    shipped = wsgemm.config
    wsgemm.config = lambda *a: cfg
    try:
        return fn()
    finally:
        wsgemm.config = shipped


def ws_call(x, wq, cfg, b=None, swap=True):
    """The call with the tile ``cfg``; ``swap=False`` runs the 256-row tile unswapped (``wsgemm.SWAP_AB``)."""
    def call():
        shipped = wsgemm.SWAP_AB
        wsgemm.SWAP_AB = swap and shipped
        try:
            return with_config(cfg, lambda: gm.linear_w4a16(x, wq, b, path="wsgemm"))
        finally:
            wsgemm.SWAP_AB = shipped
    return call



res["ready"] = wsgemm.ready(dev)
print("ready:", res["ready"], f"{time.time() - T0:.1f}s", flush=True)
save()
g = torch.Generator(device=dev).manual_seed(0)

CHECKS = [(65, 520, 1024, torch.bfloat16, True), (100, 6144, 4096, torch.bfloat16, False),
          (128, 300, 1280, torch.float16, True), (64, 4096, 4096, torch.bfloat16, False),
          (128, 28672, 4096, torch.bfloat16, True), (33, 1000, 2048, torch.bfloat16, False),
          (200, 6100, 4096, torch.bfloat16, True),
          # K % 256 != 0: scale rows from wsgemm.tma_scales' padded copy, a partial last scale group
          (100, 600, 1088, torch.bfloat16, True), (128, 8192, 29568, torch.bfloat16, False)]
for label, cfg in (SMALL_VARIANTS.items() if "checks" in PHASES else []):
    for m, n, k, dt, bias in CHECKS:
        w = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
        x = torch.randn(m, k, device=dev, generator=g).to(dt)
        b = torch.randn(n, device=dev, generator=g).to(dt) if bias else None
        ref = x.float() @ w.dequantize(torch.float32).T + (b.float() if bias else 0)
        row = {"variant": label, "m": m, "n": n, "k": k, "dtype": str(dt), "bias": bias,
               "plan": wsgemm.plan(m, n, k, 132, cfg)}
        try:
            y = torch.full((m, n), float("nan"), device=dev, dtype=dt)
            wsgemm.matmul(x, *gm._weight_views(w)[2:], None, b, y, cfg=cfg)
            row["rel_ref"] = rel(y, ref)
            row["nan"] = bool(torch.isnan(y).any())
            other = "mma" if m <= 64 else ("wgmma" if m <= 128 and k % 128 == 0 else "cublas")
            row["rel_" + other] = rel(y, gm.linear_w4a16(x, w, b, path=other))
            amax = x.float().abs().amax()
            y4 = with_config(cfg, lambda: gm.linear_w4a4(x, w, amax, b, path="wsgemm"))
            row["w4a4_rel_cublas"] = rel(y4, gm.linear_w4a4(x, w, amax, b, path="cublas"))
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:400]
        res["checks"].append(row)
        print(json.dumps(row), flush=True)
save()
ok = {label: all("error" not in r and not r["nan"] and r["rel_ref"] < 1e-2 and r["w4a4_rel_cublas"] < 1e-2
                 for r in res["checks"] if r["variant"] == label) for label in SMALL_VARIANTS}
res["checks_ok"] = ok
print("checks ok:", ok, flush=True)

for name in (SMALL if "small" in PHASES else []):
    n, k = SHAPES[name]
    w = torch.randn(n, k, device=dev, dtype=SMALL_DT, generator=g) * 0.02
    wq = nvfp4.quantize(w)
    for m in MS:
        if time.time() - T0 > BUDGET:
            break
        x = torch.randn(m, k, device=dev, dtype=SMALL_DT, generator=g)
        fns = {"cublas_bf16": lambda: x @ w.t(), "dispatch": lambda: gm.linear_w4a16(x, wq)}
        if m <= 64:
            fns["mma"] = lambda: gm.linear_w4a16(x, wq, path="mma")
        elif m <= 128:
            fns["wgmma"] = lambda: gm.linear_w4a16(x, wq, path="wgmma")
            fns["dequant_cublas"] = lambda: gm.linear_w4a16(x, wq, path="cublas")
        else:
            fns["ws_default"] = ws_call(x, wq, wsgemm.DEFAULT_CONFIG)
            fns["dequant_cublas"] = lambda: gm.linear_w4a16(x, wq, path="cublas")
        for label, cfg in SMALL_VARIANTS.items():
            if ok.get(label) and wsgemm.supports(m, n, k):
                fns["ws_" + label] = ws_call(x, wq, cfg)
        row = {"shape": name, "m": m, "dtype": str(SMALL_DT), "dispatch_path": gm._auto_path(m, SMALL_DT, False, k, dev, n),
               "plans": {lb: wsgemm.plan(m, n, k, 132, c) for lb, c in SMALL_VARIANTS.items()},
               "median_us": interleaved(fns, ROUNDS)}
        t = row["median_us"]
        best = min(((v, lb) for lb, v in t.items() if lb.startswith("ws_") and isinstance(v, float)), default=None)
        if best is not None:
            row["best_ws"] = best[1]
            row["best_ws_vs_cublas"] = t["cublas_bf16"] / best[0]
            row["best_ws_vs_dispatch"] = t["dispatch"] / best[0]
        res["small"].append(row)
        print(json.dumps({"shape": name, "m": m, "dispatch": row["dispatch_path"],
                          "us": {a: (round(b, 2) if isinstance(b, float) else b) for a, b in t.items()}}), flush=True)
        save()
        del x

for name in (SMALL if "fp16" in PHASES else []):  # the shipped rule with fp16 activations
    n, k = SHAPES[name]
    wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    w16 = wq.dequantize(torch.float16)
    for m in (64, 128):
        x = torch.randn(m, k, device=dev, dtype=torch.float16, generator=g)
        old = "mma" if m <= 64 else "wgmma"
        row = {"shape": name, "m": m, "dtype": "fp16", "dispatch_path": gm._auto_path(m, x.dtype, False, k, dev, n),
               "rel_ref": rel(gm.linear_w4a16(x, wq), x.float() @ wq.dequantize(torch.float32).T)}
        row["median_us"] = interleaved({"cublas_fp16": lambda: x @ w16.t(), "dispatch": lambda: gm.linear_w4a16(x, wq),
                                        old: lambda: gm.linear_w4a16(x, wq, path=old)}, ROUNDS)
        res.setdefault("fp16", []).append(row)
        print(json.dumps(row), flush=True)
        save()

for name in (("8B.qkv", "8B.o", "8B.gate_up", "70B.down") if "big" in PHASES else []):
    if time.time() - T0 > BUDGET:
        break
    n, k = SHAPES[name]
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    wq = nvfp4.quantize(w)
    x = torch.randn(1024, k, device=dev, dtype=torch.bfloat16, generator=g)
    ref = gm.linear_w4a16(x, wq, path="wsgemm")
    row = {"shape": name, "m": 1024, "errors": {}}
    for label, cfg in BIG_VARIANTS.items():
        try:
            row["errors"][label] = rel(ws_call(x, wq, cfg, swap=not label.endswith("_plain"))(), ref)
        except Exception as exc:  # noqa: BLE001
            row["errors"][label] = repr(exc)[:300]
    fns = {"cublas_bf16": lambda: x @ w.t()}
    fns.update({label: ws_call(x, wq, cfg, swap=not label.endswith("_plain")) for label, cfg in BIG_VARIANTS.items()
                if isinstance(row["errors"][label], float) and row["errors"][label] < 1e-5})
    row["median_us"] = interleaved(fns, ROUNDS)
    res["big"].append(row)
    print(json.dumps(row), flush=True)
    save()
res["total_s"] = time.time() - T0
save()
print(f"done in {res['total_s']:.0f}s", flush=True)
