"""W4A4 at small M with mma.py launched as the programmatic dependent of the activations' quantize launch
(gemm.w4a4_pdl, session 25), on the H200.

Variants:
  plain  the quantize launch, then mma.py launched plainly (FP4PTQ_W4A4_PDL=0; as before this change)
  pdl    the quantize kernel signals griddepcontrol.launch_dependents as it starts; mma.py launches as its
         programmatic dependent and copies its first weight steps before griddepcontrol.wait
  rule   pdl only where gemm.w4a4_pairs (mma.py) and gemm.w4a4_pairs_gemv (gemv6, M = 1-2) pair (shipped)

Checks first: ``pdl`` bit-equal to ``plain`` on every row (5 calls each), a graph-replayed chain of 10
dependent calls (x_{i+1} = y_i / 2) bit-equal to the plain eager chain, and NVFP4Linear's launch plans
(replayed through Triton's C launcher) in a CUDA graph equal to the plain module's eager chain. Then
interleaved rounds (medians, CUDA-graph replays of 10 calls): the dispatch's call, and NVFP4Linear
with its plans, cuBLAS bf16 and W4A16 in the same rounds.

    PYTHONPATH=$PWD:$PWD/.peers:$PWD/benchmarks python benchmarks/w4a4_pdl_h200.py   # $OUT/w4a4_pdl_h200.json

Results: results/w4a4_pdl_h200_v1.json .. v7.json (the variants of each run in benchmarks/NOTES.md,
twenty-fifth pass; "rule" in v4 / v5 is mma.py's rule alone, before gemv6 was paired).

Knobs: ROUNDS (5), PHASES ("checks,time,modules"), JSON, ONLY (rows whose layer/M label is listed, e.g.
"8B.o/16,8B.down/8"), VARIANTS (timed and checked against the first; default "plain,pdl,rule"): pdl pairs
every mma.py call; rule as shipped; gemv the same as rule (the name of the v7 run, which measured gemv6's
pairing before it was shipped); *_nosplit the summing pass launched plainly; *_cap at most
ceil(programs / SMs) mma.py programs fit an SM.
"""
from __future__ import annotations

import json
import os
import time

import torch

import peers_h200 as peers
from _rounds import graph_replays, interleaved, rel, weight_cache
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import mma

dev = torch.device("cuda")
T0 = time.time()
ROUNDS = int(os.environ.get("ROUNDS", "5"))
PHASES = os.environ.get("PHASES", "checks,time,modules").split(",")
out_path = os.path.join(os.environ.get("OUT", "."), os.environ.get("JSON", "w4a4_pdl_h200.json"))
res = {"env": peers.env(), "w4a4_pdl": gm.w4a4_pdl(dev), "checks": [], "time": [], "modules": []}


def save():
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


# name: (W4A4_PDL, the pairing for every mma.py grid (else the shipped rule, gemm.w4a4_pairs), SPLIT_PDL).
# results/w4a4_pdl_h200_v2.json also has "pdl_end" (the quantize kernel signalling after its stores,
# level everywhere; measured at 848d9db) and v3 "pdl_wait0" (mma.py waiting before any copy, as slow as
# pdl where pdl loses; measured at 721cbfd): neither is built any more.
# *_cap: mma.py's ring made deep enough (shared memory) that at most ceil(programs / SMs) programs fit an SM,
# so the block scheduler cannot place more than that on one SM (a probe of the placement suspicion).
# rule / gemv: the shipped rules, W4A4's gemv6 at M = 1-2 paired too (gemm.W4A4_PDL_GEMV)
VARIANTS = {"plain": (False, True, True), "pdl": (True, True, True), "rule": (True, False, True),
            "plain_nosplit": (False, True, False), "pdl_nosplit": (True, True, False),
            "plain_cap": (False, True, True), "pdl_cap": (True, True, True), "gemv": (True, False, True)}
TIMED = os.environ.get("VARIANTS", "plain,pdl,rule").split(",")
_RULE = gm.w4a4_pairs
_CONFIG = mma.config
SMEM_SM = 228 * 1024  # shared memory an H200 SM holds


def capped_config(m, n, k, sms=132):
    """mma.config with a ring of at least SMEM_SM / (cap + 1/2) bytes, cap = ceil(programs / SMs)."""
    bn, bm, bk, warps, k_split, stages = _CONFIG(m, n, k, sms)
    cap = -(-(-(-n // bn) * -(-k // k_split)) // sms)
    per_stage = bn * bk // 2 + bn * bk // 16 + bk * bm * 2
    return bn, bm, bk, warps, k_split, max(stages, -(-int(SMEM_SM / (cap + 0.5)) // per_stage))


def variant(name, fn):
    pdl, every, split = VARIANTS[name]
    shipped = gm.W4A4_PDL, gm.w4a4_pairs, gm.SPLIT_PDL, gm.W4A4_PDL_GEMV
    gm.W4A4_PDL, gm.SPLIT_PDL, gm.W4A4_PDL_GEMV = pdl, split, name in ("gemv", "rule")
    gm.w4a4_pairs = (lambda m, n, k, device: gm.w4a4_pdl(device)) if every else _RULE
    mma.config = capped_config if name.endswith("_cap") else _CONFIG
    try:
        return fn()
    finally:
        gm.W4A4_PDL, gm.w4a4_pairs, gm.SPLIT_PDL, gm.W4A4_PDL_GEMV = shipped
        mma.config = _CONFIG


g = torch.Generator(device=dev).manual_seed(0)
weight = weight_cache(g, dev)  # (the same generator draws the activations: the same data as before)


SHAPES = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.down": (8192, 28672), "70B.gate_up": (57344, 8192), "Qwen2-7B.o": (3584, 3584),
          "8B.k": (1024, 4096), "Phi-3-mini.o": (3072, 3072), "Qwen2-7B.qkv": (4608, 3584),
          "Gemma-2-9B.o": (3584, 4096), "SmolLM2.qkv": (960, 576), "Phi-3-mini.qkv": (9216, 3072)}
# (layer, M, bias, dtype, Four Over Six)
ROWS = [(name, 16, False, torch.bfloat16, None) for name in SHAPES] + [
    ("8B.o", 3, False, torch.bfloat16, None), ("8B.qkv", 3, False, torch.bfloat16, None),
    ("8B.o", 8, False, torch.bfloat16, None), ("8B.down", 8, False, torch.bfloat16, None),
    ("8B.o", 32, False, torch.bfloat16, None), ("8B.qkv", 32, False, torch.bfloat16, None),
    ("8B.o", 64, False, torch.bfloat16, None), ("8B.gate_up", 2, False, torch.bfloat16, None),
    ("8B.o", 16, True, torch.bfloat16, None), ("8B.o", 16, False, torch.float16, None),
    ("8B.o", 16, False, torch.bfloat16, "mse"), ("8B.down", 16, True, torch.float16, "mse"),
    ("8B.k", 8, False, torch.bfloat16, None), ("Phi-3-mini.o", 8, False, torch.bfloat16, None),
    ("Qwen2-7B.o", 4, False, torch.bfloat16, None), ("Qwen2-7B.o", 16, True, torch.float16, "mse"),
    ("8B.k", 16, False, torch.bfloat16, None), ("8B.k", 32, False, torch.bfloat16, None),
    ("Phi-3-mini.o", 16, False, torch.bfloat16, None), ("Qwen2-7B.qkv", 16, False, torch.bfloat16, None),
    ("Gemma-2-9B.o", 16, False, torch.bfloat16, None), ("SmolLM2.qkv", 16, False, torch.bfloat16, None),
    ("Phi-3-mini.qkv", 16, False, torch.bfloat16, None)] + [
    (name, m, False, torch.bfloat16, None) for m in (1, 2) for name in ("8B.qkv", "8B.o", "8B.gate_up", "70B.gate_up",
                                                                         "Qwen2-7B.o", "Phi-3-mini.o", "8B.down")] + [
    ("8B.qkv", 1, True, torch.float16, "mse"), ("8B.o", 1, False, torch.bfloat16, "mse")]


def call_of(name, m, bias, dtype, four_six):
    n, k = SHAPES[name]
    w, _ = weight(n, k)
    x = torch.randn(m, k, device=dev, generator=g).to(dtype)
    b = torch.randn(n, device=dev, generator=g).to(dtype) if bias else None
    amax = x.float().abs().amax()
    return x, w, (lambda: gm.linear_w4a4(x, w, amax, b, four_six=four_six))


def label(name, m, bias, dtype, four_six):
    n, k = SHAPES[name]
    path = gm._auto_path(m, dtype, True, k, dev, n)
    return {"layer": name, "m": m, "bias": bias, "dtype": str(dtype).replace("torch.", ""), "four_six": four_six,
            "path": path, "mma_programs": mma.programs(m, n, k, gm._sm_count(dev)),
            "mma_steps": (lambda c: c[4] // c[2])(mma.config(m, n, k, gm._sm_count(dev))),
            "paired": gm.w4a4_pairs(m, n, k, dev) if path == "mma" else variant("gemv", lambda: gm.w4a4_pairs_gemv(
                m, n, k, dev)) if path == "gemv6" else False}


ONLY = os.environ.get("ONLY")
if ONLY:
    ROWS = [r for r in ROWS if f"{r[0]}/{r[1]}" in ONLY.split(",")]

if "checks" in PHASES:
    for row_args in ROWS:
        x, w, call = call_of(*row_args)
        base = variant("plain", call)
        row = label(*row_args)
        for v in TIMED[1:]:
            row[f"{v}_equal"] = all(torch.equal(variant(v, call), base) for _ in range(5))
        row["rel_ref"] = rel(base, x.float() @ w.dequantize(torch.float32).T) if not row_args[2] else None
        res["checks"].append(row)
        print(row, flush=True)
    for m in (16, 3, 32):  # chains on 8B.o-sized square layers
        w, _ = weight(4096, 4096)
        x0 = torch.randn(m, 4096, device=dev, generator=g).to(torch.bfloat16)
        amax = torch.tensor(4.0, device=dev)

        def chain(x0=x0, w=w, amax=amax):
            x = x0
            for _ in range(10):
                x = gm.linear_w4a4(x, w, amax) * 0.5
            return x

        eager = variant("plain", chain)
        outs = variant("pdl", lambda chain=chain: graph_replays(chain))
        row = {"chain_m": m, "replays_equal": sum(int(torch.equal(o, eager)) for o in outs), "replays": len(outs),
               "eager_pdl_equal": bool(torch.equal(variant("pdl", chain), eager)),
               "finite": bool(torch.isfinite(eager).all())}
        res["checks"].append(row)
        print(row, flush=True)
    save()


def module_pair(n, k, m, dtype, four_six, bias):
    """(plain module, pdl module, input): NVFP4Linear W4A4 on the same weight, each with the plans it built
    (and replays) under its variant."""
    from fp4ptq.modules import NVFP4Linear

    wq = nvfp4.quantize((torch.randn(n, k, device=dev, generator=g) * 0.02).to(dtype))
    b = torch.randn(n, device=dev, generator=g).to(dtype) if bias else None
    x = torch.randn(1, m, k, device=dev, generator=g).to(dtype)
    mods = []
    for v in ("plain", "pdl"):
        mod = NVFP4Linear.from_quantized(wq, b, scheme="w4a4", act_four_six=four_six,
                                         input_amax=torch.tensor(8.0, device=dev))
        for _ in range(3):  # plans built under the variant, then replayed through the C launcher
            variant(v, lambda mod=mod: mod(x))
        mods.append(mod)
    return mods[0], mods[1], x


if "modules" in PHASES:
    for n, m, dtype, four_six, bias in [(4096, 16, torch.bfloat16, None, True), (4096, 3, torch.bfloat16, None, False),
                                        (4096, 32, torch.float16, "mse", True), (6144, 16, torch.bfloat16, None, False)]:
        k = 4096
        plain, pdl, x = module_pair(n, k, m, dtype, four_six, bias)
        if n == k:
            def chain_of(mod, x=x):
                def chain():
                    h = x
                    for _ in range(10):
                        h = mod(h) * 0.5
                    return h
                return chain

            eager = chain_of(plain)()
            same = sum(int(torch.equal(o, eager)) for o in graph_replays(chain_of(pdl)))
        else:
            eager = plain(x)
            same = sum(int(torch.equal(o, eager)) for o in graph_replays(lambda pdl=pdl, x=x: pdl(x)))
        row = {"module": f"{n}x{k}", "m": m, "dtype": str(dtype), "four_six": four_six, "bias": bias,
               "path": gm._auto_path(m, dtype, True, k, dev, n), "replays_equal": same,
               "finite": bool(torch.isfinite(eager).all())}
        row.update({f"us_{a}": b for a, b in interleaved({"plain": lambda: plain(x), "pdl": lambda: pdl(x)},
                                                          ROUNDS).items()})
        res["modules"].append(row)
        print(row, flush=True)
        save()

if "time" in PHASES:
    for row_args in ROWS:
        x, w, call = call_of(*row_args)
        _, wb = weight(*SHAPES[row_args[0]])
        xb = x.to(torch.bfloat16)
        fns = {v: (lambda call=call, v=v: variant(v, call)) for v in TIMED}
        fns.update({"w4a16": lambda x=x, w=w: gm.linear_w4a16(x, w), "cublas_bf16": lambda: xb @ wb.T})
        row = {**label(*row_args), **interleaved(fns, ROUNDS)}
        res["time"].append(row)
        print({a: (round(b, 2) if isinstance(b, float) else b) for a, b in row.items()}, f"{time.time() - T0:.0f}s",
              flush=True)
        save()
print("done", f"{time.time() - T0:.0f}s")
