"""The three-operation pair decode (mask, multiply, mask: ``gemm._pair_mul`` in gemv6, ``mma._DECODE_MUL``
in the M <= 64 tensor-core kernel) against the four-operation shift decode it replaces, on the six
Llama-3.1 shapes: outputs compared bit for bit, then timed in interleaved rounds (medians) with cuBLAS
bf16 and tinygemm int4 of the same run. M = 1: gemv6 (W4A16) and the W4A4 dispatch (quantize kernel +
gemv6). The committed results/muldec_h200.json was measured at commit 7ce5c79, where
mma.py (M = 16) also had the decode behind ``mma.MULDEC`` and this script timed it ("mma_m16"
keys); it was level there and was taken out again. Since then ``_gemv6_muldec`` keeps the shifts on
some layers (70B down among the six), so "mul" there now means the shipped rule with the knob on.

Phase "sweep" (``PHASES=sweep SWEPT=70B.down``): gemv6 configs (rows, warps, programs an SM, K segment,
prefetch) with the new decode, then the shipped rule under both decodes and the three best configs in
interleaved rounds. Phase "rule" (``PHASES=rule``): the shipped rule (decode and config) against the
session-10 one (gemv6 only, shift decode, 4-row tiles with four blocks of a row a thread where K is
split; the shipped rule runs the long-K layers on gemv7 since commit "gemv7: ... rule") on the
Llama-3.1 shapes and other models' layers, interleaved rounds, outputs checked against the reference.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/muldec_h200.py   # $OUT/muldec_h200.json
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import time

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

dev = torch.device("cuda")
OUT = os.environ.get("OUT", ".")
ROUNDS = int(os.environ.get("ROUNDS", "5"))
T0 = time.time()
PHASES = os.environ.get("PHASES", "compare").split(",")
res = {"env": peers.env(), "copy_TBps": peers.copy_bw(), "rows": [], "sweep": [], "final": []}
shipped_config = gm._gemv6_config


def save():
    name = {"compare": "muldec_h200.json", "sweep": "muldec_sweep_h200.json"}.get(PHASES[0], "muldec_rule_h200.json")
    with open(os.path.join(OUT, name), "w") as f:
        json.dump(res, f, indent=1)


def decode(new: bool, fn, cfg=None):
    """``fn`` under the shift (False) or multiply decode; with ``cfg``, gemv6 alone under that config
    (the session-10 path: no streamed-x GEMV)."""
    gm.GEMV6_MULDEC = new
    if cfg is not None:
        gm._gemv6_config, gm.GEMV7 = (lambda m, n, k: cfg), "0"
    try:
        return fn()
    finally:
        gm.GEMV6_MULDEC, gm._gemv6_config, gm.GEMV7 = True, shipped_config, "auto"


g = torch.Generator(device=dev).manual_seed(0)
for name, (n, k) in (peers.SHAPES.items() if "compare" in PHASES else ()):
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    wq = nvfp4.quantize(w)
    x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
    amax = x1.float().abs().amax().reshape(1)
    byt = n * k / 2 + n * k / 16 + 2 * k + 2 * n
    calls = {
        "gemv6": lambda: gm.linear_w4a16(x1, wq, path="gemv6"),
        "w4a4_m1": lambda: gm.linear_w4a4(x1, wq, amax),
    }
    row = {"shape": name, "n": n, "k": k, "bytes": byt, "same_bits": {}, "rel_err": {}}
    ref1 = x1.float() @ wq.dequantize(torch.float32).T
    for label, fn in calls.items():
        old, new = decode(False, fn), decode(True, fn)
        row["same_bits"][label] = bool(torch.equal(old, new))
        if label != "w4a4_m1":
            row["rel_err"][label] = float((new.float() - ref1).norm() / ref1.norm())
    tg = peers.make_tinygemm(w)
    times = {}
    for _ in range(ROUNDS):
        times.setdefault("cublas_m1", []).append(peers.bench(lambda: x1 @ w.t()) * 1e3)
        times.setdefault("tinygemm_m1", []).append(peers.bench(lambda: tg(x1)) * 1e3)
        for label, fn in calls.items():
            for new in (False, True):
                times.setdefault(f"{label}_{'mul' if new else 'shift'}", []).append(
                    decode(new, lambda: peers.bench(fn)) * 1e3)
    row["median_us"] = {a: statistics.median(b) for a, b in times.items()}
    row["all_us"] = times
    med = row["median_us"]
    row["pct_copy_m1"] = {a: 100 * byt / (med[a] * 1e-6) / 1e12 / res["copy_TBps"]
                          for a in ("gemv6_shift", "gemv6_mul", "tinygemm_m1", "w4a4_m1_shift", "w4a4_m1_mul")}
    row["speedup"] = {"gemv6_mul_over_shift": med["gemv6_shift"] / med["gemv6_mul"],
                      "w4a4_mul_over_shift": med["w4a4_m1_shift"] / med["w4a4_m1_mul"],
                      "gemv6_mul_vs_cublas": med["cublas_m1"] / med["gemv6_mul"],
                      "gemv6_mul_vs_tinygemm": med["tinygemm_m1"] / med["gemv6_mul"]}
    res["rows"].append(row)
    print(json.dumps({"shape": name, "same": row["same_bits"], **{a: round(b, 2) for a, b in med.items()},
                      **{a: round(b, 3) for a, b in row["speedup"].items()}}), flush=True)
    save()
print("total s", round(time.time() - T0, 1))
save()

for name in (os.environ.get("SWEPT", "70B.down").split(",") if "sweep" in PHASES else ()):
    n, k = peers.SHAPES[name]
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    wq = nvfp4.quantize(w)
    x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
    byt = n * k / 2 + n * k / 16 + 2 * k + 2 * n
    fn = lambda: gm.linear_w4a16(x1, wq, path="gemv6")  # noqa: E731
    ref = decode(False, fn)
    segs = sorted({shipped_config(1, n, k)[3], 4096, 8192} & {s for s in (2048, 4096, 8192) if s <= k})
    for seg, rows, warps, per_sm, pf in itertools.product(segs, (4, 8), (2, 4), (8, 16), (True, False)):
        cfg = (rows, warps, per_sm, seg, pf)
        try:
            same = bool(torch.equal(decode(True, fn, cfg), ref))
            us = decode(True, lambda: peers.bench(fn), cfg) * 1e3
        except Exception as exc:  # noqa: BLE001 - a config that does not build
            res["sweep"].append({"shape": name, "cfg": cfg, "error": repr(exc)[:200]})
            continue
        res["sweep"].append({"shape": name, "cfg": cfg, "us": us, "same_bits_as_shipped": same})
        print(json.dumps(res["sweep"][-1]), flush=True)
    best = sorted((r for r in res["sweep"] if r["shape"] == name and "us" in r), key=lambda r: r["us"])[:3]
    cands = [("shipped_shift", False, None), ("shipped_mul", True, None)] + [
        (str(tuple(r["cfg"])) + "_mul", True, tuple(r["cfg"])) for r in best]
    times = {}
    for _ in range(ROUNDS):
        times.setdefault("cublas", []).append(peers.bench(lambda: x1 @ w.t()) * 1e3)
        for label, new, cfg in cands:
            times.setdefault(label, []).append(decode(new, lambda: peers.bench(fn), cfg) * 1e3)
    row = {"shape": name, "bytes": byt, "median_us": {a: statistics.median(b) for a, b in times.items()},
           "all_us": times}
    row["pct_copy"] = {a: 100 * byt / (b * 1e-6) / 1e12 / res["copy_TBps"] for a, b in row["median_us"].items()}
    res["final"].append(row)
    print(json.dumps({"shape": name, **{a: round(b, 2) for a, b in row["median_us"].items()}}), flush=True)
    print(json.dumps({"shape": name, **{a: round(b, 1) for a, b in row["pct_copy"].items()}}), flush=True)
    save()


def session10_rule(m, n, k):
    """gemv6's config before session 11 (split layers under 64M weights: 4 rows, segment / 2048 warps)."""
    rows, warps, per_sm, seg, pf = shipped_config(m, n, k)
    if n * k < 1 << 26 and k > seg:
        return 4, max(1, min(8, (seg // 16) // 128)), 16, seg, False
    return rows, warps, per_sm, seg, pf


RULE_SHAPES = dict(peers.SHAPES, **{
    "70B.qkv": (10240, 8192), "70B.o": (8192, 8192), "8B.lm_head": (128256, 4096),
    "Qwen2-7B.qkv": (4608, 3584), "Qwen2-7B.o": (3584, 3584), "Qwen2-7B.gate_up": (37888, 3584),
    "Qwen2-7B.down": (3584, 18944), "Llama-2-7B.down": (4096, 11008), "Gemma-2-9B.down": (3584, 14336),
    "Phi-3-mini.down": (3072, 8192), "Qwen2-72B.down": (8192, 29568), "SmolLM2.down": (576, 1536)})
for name, (n, k) in (RULE_SHAPES.items() if "rule" in PHASES else ()):
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    wq = nvfp4.quantize(w)
    x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
    byt = n * k / 2 + n * k / 16 + 2 * k + 2 * n
    fn = lambda: gm.linear_w4a16(x1, wq, path="gemv6")  # noqa: E731
    ref = x1.float() @ wq.dequantize(torch.float32).T
    old_cfg = session10_rule(1, n, k)
    old, new = decode(False, fn, old_cfg), fn()
    times = {}
    for _ in range(ROUNDS):
        times.setdefault("cublas", []).append(peers.bench(lambda: x1 @ w.t()) * 1e3)
        times.setdefault("session10", []).append(decode(False, lambda: peers.bench(fn), old_cfg) * 1e3)
        times.setdefault("shipped", []).append(peers.bench(fn) * 1e3)
    med = {a: statistics.median(b) for a, b in times.items()}
    row = {"shape": name, "n": n, "k": k, "bytes": byt, "old_cfg": old_cfg, "new_cfg": shipped_config(1, n, k),
           "new_muldec": gm._gemv6_muldec(n, k), "median_us": med, "all_us": times,
           "rel_err": {"session10": float((old.float() - ref).norm() / ref.norm()),
                       "shipped": float((new.float() - ref).norm() / ref.norm())},
           "pct_copy": {a: 100 * byt / (b * 1e-6) / 1e12 / res["copy_TBps"] for a, b in med.items()},
           "shipped_over_session10": med["session10"] / med["shipped"]}
    res["final"].append(row)
    print(json.dumps({"shape": name, **{a: round(b, 2) for a, b in med.items()},
                      "x": round(row["shipped_over_session10"], 3), "err": row["rel_err"]}), flush=True)
    save()
print("total s", round(time.time() - T0, 1))
