"""The 16-bit quantize kernel on the H200: exactness against ``nvfp4.quantize`` on adversarial data
(every finite bf16 / fp16 bit pattern; blocks of random patterns below a random block max; static
scales that saturate, and a tiny amax whose thresholds are subnormal), then time per call against the
fp32-compare kernel it replaces, a tile sweep, and W4A4 (quantize + cuBLAS) at M = 1024 / 8192.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/quant16_h200.py   # writes $OUT/quant16_h200.json

Knobs: PHASES (check,time,sweep,sweep2,w4a4,per_sm,table,table_w4a4), BUDGET_S. "table": thresholds
computed per block against the per-program table (exactness on the adversarial data, then 3
interleaved rounds at 16 x 4096 .. 8192 x 28672; TABLE_CHECK=0 skips the check, TABLE_CHECK_VARIANT
checks another variant than "block", TABLE_DTYPE=fp16 and
TABLE_SIZES=1024x4096,..., TABLE_VARIANTS=table,tablew,tabler,block (the table stored word- / row-major; table: as the rule) and
TABLE_EMITS=packed:none,packed:mse change what is timed; variant "int": the shipped rules with bf16 counted by
integer compares, the build of sm_80-89); "table_w4a4": W4A4 end to end with each
(W4A4_SHAPES, W4A4_VARIANTS (w4a16: the W4A16 dispatch), ROUNDS); "tiny": 1-16 rows, and W4A4 at M = 1 / 2 / 16. "per_sm": the shipped programs per SM
against 9 and 10 (all the SM holds of the standard kernel at 47 registers), 3 interleaved rounds.
"""
from __future__ import annotations

import json
import statistics
import os
import time

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import quantize_kernel as qk

dev = torch.device(os.environ.get("DEV", "cuda"))
OUT = os.environ.get("OUT", ".")
PHASES = os.environ.get("PHASES", "check,time,sweep,w4a4").split(",")
T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "400"))
res = {"env": peers.env() if dev.type == "cuda" else {}, "check": [], "time": [], "sweep": [], "w4a4": []}


def save():
    with open(os.path.join(OUT, "quant16_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


def patterns(dtype):
    """Every finite pattern of the 16-bit dtype, as [n, 16] (shuffled), and 2^20 blocks whose 15
    other elements are random patterns at or below a random block max (random signs)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = bits[torch.isfinite(bits.float())]
    finite = finite[torch.randperm(finite.numel(), generator=g)]
    pad = (-finite.numel()) % 16
    every = torch.cat([finite, finite[:pad]]).reshape(-1, 16)
    top = 0x7F7F if dtype == torch.bfloat16 else 0x7BFF
    bmax = torch.randint(0, top + 1, (1 << 20, 1), generator=g)
    frac = torch.rand(1 << 20, 16, generator=g)
    pat = (frac * (bmax + 1).float()).long().clamp(max=top)
    pat[:, 0] = bmax[:, 0]
    pat = pat[:, torch.randperm(16, generator=g)]
    sign = torch.randint(0, 2, pat.shape, generator=g) << 15
    below = (pat | sign).to(torch.int32).to(torch.int16).view(dtype)
    return every.to(dev), below.to(dev)


def compare(x, rule, amax, emit):
    """Mismatches of the 16-bit kernel against the reference (and 4/6 choice flips)."""
    a = None if amax is None else torch.tensor(amax, device=dev)
    ref = nvfp4.quantize(x, rule, amax=a)
    amax_t = a if a is not None else nvfp4.tensor_amax(x)
    out = {"rule": rule, "amax": amax, "emit": emit, "dtype": str(x.dtype), "blocks": x.numel() // 16}
    if emit == "packed":
        packed, scale, enc, chose = qk.launch_quantize(x, amax_t, rule)
        out["global_equal"] = bool(torch.equal(enc, ref.global_enc))
        sm = scale.view(torch.uint8) != ref.block_scale.view(torch.uint8)
        out["scale_mismatch"] = int(sm.sum())
        out["code_mismatch_bytes"] = int((packed != ref.packed).sum())
        if rule is not None:
            flips = chose != ref.chose_four
            out["four_six_flips"] = int(flips.sum())
            if out["four_six_flips"]:  # how close the two candidates' errors were there (fp64)
              try:
                blocks = x.float().reshape(-1, 16)[flips.reshape(-1)].double()
                bmax = blocks.abs().amax(-1)
                errs = []
                for target in (6.0, 4.0):
                    step = (nvfp4.block_scale(bmax.float(), ref.global_enc, target) / ref.global_enc).double()
                    x_hat = nvfp4.e2m1_rne((blocks / step.unsqueeze(-1)).float()).double() * step.unsqueeze(-1)
                    errs.append(nvfp4._block_error(x_hat, blocks, rule))
                gap = (errs[0] - errs[1]).abs() / errs[0].abs().clamp(min=1e-300)
                out["flip_max_rel_gap"] = float(gap.max())
              except Exception as e:  # noqa: BLE001
                out["flip_gap_error"] = repr(e)[:200]
            pm = (packed != ref.packed).reshape(packed.shape[0], -1, 8).any(-1)
            out["code_mismatch_outside_flips"] = int((pm & ~flips).sum())
            out["scale_mismatch_outside_flips"] = int((sm & ~flips).sum())
    else:
        scaled, enc = qk.launch_quantize(x, amax_t, rule, emit="scaled")
        expect = nvfp4.e2m1_decode(ref.codes()) * ref.block_scale.float().repeat_interleave(16, -1)
        out["global_equal"] = bool(torch.equal(enc, ref.global_enc))
        out["scaled_mismatch"] = int((scaled.float() != expect).sum())
        if rule is not None:
            # a flipped 4/6 choice changes a whole block; count the blocks instead
            bad = (scaled.float() != expect).reshape(x.shape[0], -1, 16).any(-1)
            out["scaled_mismatch_blocks"] = int(bad.sum())
    return out


if "check" in PHASES:
    for dtype in (torch.bfloat16, torch.float16):
        every, below = patterns(dtype)
        for name, x in (("every_pattern", every), ("below_block_max", below)):
            for amax in (None, 1.0, 1e-3, 3e4 if dtype == torch.float16 else 1e30, 1e-35 if dtype == torch.bfloat16 else 1e-7):
                for rule in (None, "mse", "mae", "max"):
                    for emit in ("packed", "scaled"):
                        r = compare(x, rule, amax, emit)
                        r["data"] = name
                        res["check"].append(r)
                        print(json.dumps(r), flush=True)
    save()


def bench_quant(x, amax, rule, old=False, emit="packed"):
    qk.QUANT16 = not old
    try:
        return peers.bench(lambda: qk.launch_quantize(x, amax, rule, emit=emit)) * 1e3
    finally:
        qk.QUANT16 = True


if "time" in PHASES:
    copy = peers.copy_bw()
    res["copy_TBps"] = copy
    for m, k in ((16, 4096), (128, 4096), (1024, 4096), (8192, 4096), (8192, 14336), (8192, 28672)):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        amax = x.float().abs().amax()
        byt = 2 * m * k + m * k / 2 + m * k / 16
        clone = peers.bench(lambda: x.clone()) * 1e3
        row = {"m": m, "k": k, "clone_us": clone, "copy_TBps": copy}
        for rule in (None, "mse", "mae", "max"):
            for old in (False, True):
                us = bench_quant(x, amax, rule, old)
                row[f"{'old' if old else 'new'}_{rule}_us"] = us
                row[f"{'old' if old else 'new'}_{rule}_TBps"] = byt / (us * 1e-6) / 1e12
        us = bench_quant(x, amax, None, False, "scaled")
        row["new_scaled_us"] = us
        row["old_scaled_us"] = bench_quant(x, amax, None, True, "scaled")
        res["time"].append(row)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    save()

if "sweep" in PHASES:
    for m, k in ((8192, 14336), (1024, 4096)):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        amax = x.float().abs().amax()
        byt = 2 * m * k + m * k / 2 + m * k / 16
        for tile in ((1, 128, 4), (2, 128, 4), (2, 128, 8), (4, 128, 8)):
            for per_sm in (2, 4, 8, 16):
                if time.time() - T0 > BUDGET:
                    break
                os.environ["FP4PTQ_QUANT16_TILE"] = ",".join(map(str, tile))
                os.environ["FP4PTQ_QUANT16_PER_SM"] = str(per_sm)
                for rule in (None, "mse"):
                    us = bench_quant(x, amax, rule)
                    res["sweep"].append({"m": m, "k": k, "tile": tile, "per_sm": per_sm, "rule": rule, "us": us,
                                         "TBps": byt / (us * 1e-6) / 1e12})
                    print(f"sweep {m}x{k} {tile} x{per_sm} {rule} {us:.1f}us {byt / (us * 1e-6) / 1e12:.2f}TB/s",
                          flush=True)
        os.environ.pop("FP4PTQ_QUANT16_TILE", None)
        os.environ.pop("FP4PTQ_QUANT16_PER_SM", None)
    save()

if "sweep2" in PHASES:  # programs per SM at the mid sizes (W4A4 prefill operands), packed and scaled
    for m, k in ((8192, 4096), (2048, 4096), (4096, 14336)):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        amax = x.float().abs().amax()
        for tile in ((1, 128, 4), (2, 128, 4)):
            for per_sm in (0, 1, 2, 4, 8, 16):  # 0: the shipped rule
                if time.time() - T0 > BUDGET:
                    break
                os.environ["FP4PTQ_QUANT16_TILE"] = ",".join(map(str, tile))
                if per_sm:
                    os.environ["FP4PTQ_QUANT16_PER_SM"] = str(per_sm)
                else:
                    os.environ.pop("FP4PTQ_QUANT16_PER_SM", None)
                for emit in ("packed", "scaled"):
                    us = bench_quant(x, amax, None, emit=emit)
                    res["sweep"].append({"m": m, "k": k, "tile": tile, "per_sm": per_sm, "emit": emit, "us": us})
                    print(f"sweep2 {m}x{k} {tile} x{per_sm} {emit} {us:.1f}us", flush=True)
        for emit in ("packed", "scaled"):
            res["sweep"].append({"m": m, "k": k, "old": True, "emit": emit,
                                 "us": bench_quant(x, amax, None, True, emit)})
            print(f"sweep2 {m}x{k} old {emit} {res['sweep'][-1]['us']:.1f}us", flush=True)
    os.environ.pop("FP4PTQ_QUANT16_TILE", None)
    os.environ.pop("FP4PTQ_QUANT16_PER_SM", None)
    save()

if "per_sm" in PHASES:
    res["per_sm"] = []
    for m, k in ((8192, 4096), (8192, 14336), (8192, 28672)):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        amax = x.float().abs().amax()
        byt = 2 * m * k + m * k / 2 + m * k / 16
        for rule in (None, "mse"):
            times = {}
            for _ in range(3):
                for per_sm in (0, 9, 10):  # 0: the shipped rule
                    if per_sm:
                        os.environ["FP4PTQ_QUANT16_PER_SM"] = str(per_sm)
                    else:
                        os.environ.pop("FP4PTQ_QUANT16_PER_SM", None)
                    times.setdefault(per_sm, []).append(bench_quant(x, amax, rule))
            os.environ.pop("FP4PTQ_QUANT16_PER_SM", None)
            row = {"m": m, "k": k, "rule": rule, "median_us": {p: statistics.median(t) for p, t in times.items()}}
            row["TBps"] = {p: byt / (us * 1e-6) / 1e12 for p, us in row["median_us"].items()}
            res["per_sm"].append(row)
            print("per_sm", json.dumps(row), flush=True)
    save()

def variant(name):
    """Set the quantize dispatch to one of the "table" phase's variants (env + module knobs)."""
    for key in ("FP4PTQ_QUANT16_TABLE", "FP4PTQ_QUANT16_PER_SM", "FP4PTQ_QUANT16_WORD_MAJOR"):
        os.environ.pop(key, None)
    qk.QUANT16_MIN_ROWS = DEFAULT_MIN
    qk.INT_COUNT = name == "int"  # the shipped rules, bf16 counted with integer compares (as below sm_90)
    if name in ("shipped", "int"):
        return
    qk.QUANT16_MIN_ROWS = 0
    kind, _, per_sm = name.partition("@")
    os.environ["FP4PTQ_QUANT16_TABLE"] = "1" if kind.startswith("table") else "0"
    if kind in ("tablew", "tabler"):  # the table stored word-major / row-major
        os.environ["FP4PTQ_QUANT16_WORD_MAJOR"] = "1" if kind == "tablew" else "0"
    if per_sm:
        os.environ["FP4PTQ_QUANT16_PER_SM"] = per_sm


DEFAULT_MIN = qk.QUANT16_MIN_ROWS
TABLE_DTYPE = torch.float16 if os.environ.get("TABLE_DTYPE") == "fp16" else torch.bfloat16
TABLE_SIZES = [tuple(int(v) for v in mk.split("x")) for mk in os.environ.get(
    "TABLE_SIZES", "16x4096,128x4096,1024x4096,2048x4096,8192x4096,8192x14336,8192x28672").split(",")]
if "table" in PHASES:  # thresholds per block (no table) against the per-program table, 3 interleaved rounds
    res["table_check"] = []
    check_dtypes = (torch.bfloat16, torch.float16) if os.environ.get("TABLE_CHECK", "1") == "1" else ()
    for dtype in check_dtypes:  # the per-block kernel on the adversarial data
        every, below = patterns(dtype)
        variant(os.environ.get("TABLE_CHECK_VARIANT", "block"))
        for name, x in (("every_pattern", every), ("below_block_max", below)):
            for amax in (None, 1.0, 1e-3, 3e4 if dtype == torch.float16 else 1e30, 1e-35 if dtype == torch.bfloat16 else 1e-7):
                for rule in (None, "mse", "max"):
                    for emit in ("packed", "scaled"):
                        r = compare(x, rule, amax, emit)
                        r["data"] = name
                        res["table_check"].append(r)
                        print("table_check", json.dumps(r), flush=True)
        variant("shipped")
    save()
    res["table"] = []
    names = tuple(os.environ.get("TABLE_VARIANTS", "shipped,table,block,block@4,block@12,old").split(","))
    for m, k in TABLE_SIZES:
        if time.time() - T0 > BUDGET:
            break
        x = torch.randn(m, k, device=dev, dtype=TABLE_DTYPE)
        amax = x.float().abs().amax()
        for emit, rule in [tuple(None if v == "none" else v for v in er.split(":")) for er in os.environ.get(
                "TABLE_EMITS", "packed:none,scaled:none,packed:mse").split(",")]:
            if rule and m * k < 1 << 22:
                continue
            times = {}
            for _ in range(3):
                for name in names:
                    variant("shipped" if name == "old" else name)
                    times.setdefault(name, []).append(bench_quant(x, amax, rule, name == "old", emit))
            variant("shipped")
            row = {"m": m, "k": k, "emit": emit, "rule": rule, "dtype": str(TABLE_DTYPE),
                   "median_us": {n: statistics.median(t) for n, t in times.items()}}
            res["table"].append(row)
            print("table", json.dumps(row), flush=True)
    save()


if "tiny" in PHASES:  # decode-sized activations: the 16-bit kernel (per block) against the fp32-compare one
    res["tiny"] = []
    for m, k in ((1, 4096), (2, 4096), (4, 4096), (16, 4096), (1, 14336), (1, 28672), (16, 14336)):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        amax = x.float().abs().amax()
        times = {}
        for _ in range(5):
            for emit in ("packed", "scaled"):
                for old in (False, True):
                    times.setdefault(f"{emit}_{'old' if old else 'new'}", []).append(bench_quant(x, amax, None, old, emit))
        row = {"m": m, "k": k, "median_us": {v: statistics.median(t) for v, t in times.items()}}
        res["tiny"].append(row)
        print("tiny", json.dumps(row), flush=True)
    for name in ("8B.qkv", "8B.o", "8B.down"):  # W4A4 decode end to end
        n, k = peers.SHAPES[name]
        wq = nvfp4.quantize(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02)
        for m in (1, 2, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            amax = x.float().abs().amax()
            times = {}
            for _ in range(5):
                for old in (False, True):
                    qk.QUANT16 = not old
                    times.setdefault("old" if old else "new", []).append(
                        peers.bench(lambda: gm.linear_w4a4(x, wq, amax)) * 1e3)
            qk.QUANT16 = True
            row = {"shape": name, "m": m, "w4a4_median_us": {v: statistics.median(t) for v, t in times.items()}}
            res["tiny"].append(row)
            print("tiny", json.dumps(row), flush=True)
    save()


def w4a4_cases(names):
    """(layer, M, bf16 weight, its NVFP4 weight, activations, their amax) at M = 1024 and 8192, within
    the time budget."""
    for name in names:
        n, k = peers.SHAPES[name]
        wq = nvfp4.quantize(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        for m in (1024, 8192):
            if time.time() - T0 > BUDGET:
                return
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            yield name, m, w, wq, x, x.float().abs().amax()


if "table_w4a4" in PHASES:  # W4A4 end to end (quantize + GEMM) with each quantize variant
    res["table_w4a4"] = []
    shapes = os.environ.get("W4A4_SHAPES", "8B.qkv,8B.o,8B.gate_up,8B.down,70B.down").split(",")
    for name, m, w, wq, x, amax in w4a4_cases(shapes):
        times = {}
        for _ in range(int(os.environ.get("ROUNDS", "3"))):
            times.setdefault("cublas_bf16", []).append(peers.bench(lambda: x @ w.t()) * 1e3)
            for v in os.environ.get("W4A4_VARIANTS", "shipped,block,block@4").split(","):
                if v == "w4a16":  # the W4A16 dispatch on the same weight, for the same rounds
                    times.setdefault(v, []).append(peers.bench(lambda: gm.linear_w4a16(x, wq)) * 1e3)
                    continue
                variant(v)
                times.setdefault(v, []).append(peers.bench(lambda: gm.linear_w4a4(x, wq, amax)) * 1e3)
        variant("shipped")
        row = {"shape": name, "m": m, "median_us": {v: statistics.median(t) for v, t in times.items()}}
        res["table_w4a4"].append(row)
        print("table_w4a4", json.dumps(row), flush=True)
    save()

if "w4a4" in PHASES:
    for name, m, w, wq, x, amax in w4a4_cases(("8B.qkv", "8B.o", "8B.gate_up", "8B.down")):
        row = {"shape": name, "m": m, "cublas_us": peers.bench(lambda: x @ w.t()) * 1e3}
        for old in (False, True):
            qk.QUANT16 = not old
            row[f"w4a4_{'old' if old else 'new'}_us"] = peers.bench(lambda: gm.linear_w4a4(x, wq, amax)) * 1e3
            row[f"w4a4_mse_{'old' if old else 'new'}_us"] = peers.bench(
                lambda: gm.linear_w4a4(x, wq, amax, four_six="mse")) * 1e3
        qk.QUANT16 = True
        ref = gm.linear_w4a4(x[:64], wq, amax, path="gemm").float()
        got = gm.linear_w4a4(x, wq, amax)[:64].float()
        row["rel_err_vs_tiled"] = float((got - ref).norm() / ref.norm())
        res["w4a4"].append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    save()
print("done", round(time.time() - T0), "s")
