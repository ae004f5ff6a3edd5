"""NVFP4 Triton kernels on the H200: correctness first, then timings beside the peers.

On the GPU machine (the peers script and GemLite carried in .peers/, see
BENCHMARKS.md)::

    PEERS_DIR=.peers python benchmarks/bench_kernels_h200.py      # writes $OUT/kernels_h200.json

Here, from the JSON that came back::

    python benchmarks/bench_kernels_h200.py --report benchmarks/results/kernels_h200.json
    # -> kernels_h200.md (tables, targets met / not met) and kernels_h200_speedup.png

Every implementation (ours and the peers) is timed by replaying a CUDA graph
of 10 calls (``peers_h200.bench``): host overhead out, as engines run decode.
Correctness: the quantize kernel against ``nvfp4.quantize`` on the GPU (codes,
scales, global scale; 4/6 near-tie flips counted), all 16 codes through every
decode, and each GEMM against an fp32 matmul of the dequantized weight on
random data with the output poisoned (NaN) first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback

import harness
from harness import LLAMA_LAYERS as SHAPES
from harness import rel as _rel

MS = (1, 16, 128, 1024, 8192)
TARGET_MS = (1, 16, 1024, 8192)  # the rows the targets read, re-timed in ROUNDS interleaved rounds
ROUNDS = int(os.environ.get("ROUNDS", 3))
QUANT_SHAPES = ((16, 4096), (128, 4096), (1024, 4096), (8192, 4096), (8192, 14336), (8192, 28672))
CHECK_PATHS = ("gemv6", "mma", "gemm")  # forced paths checked on every code and on an odd shape


# --------------------------------------------------------------------------- #
# GPU run
# --------------------------------------------------------------------------- #
def correctness(res, gm, qk):
    import torch

    from fp4ptq import nvfp4

    dev = "cuda"
    out = {}
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(2048, 4096, device=dev, generator=g) * torch.rand(2048, 4096, device=dev, generator=g).pow(4) * 3)
    x = x.bfloat16()
    x[0, :16] = 0
    x[1, :16] *= 1e-7
    for rule in (None, "mse", "mae", "max"):
        for amax in (None, 1.0):
            q = qk.quantize(x, rule, amax=amax)
            r = nvfp4.quantize(x, rule, amax=amax)
            flips = 0 if rule is None else int((q.chose_four != r.chose_four).sum())
            out[f"quantize[{rule},amax={amax}]"] = {
                "global_equal": bool(torch.equal(q.global_enc, r.global_enc)),
                "scale_mismatch": int((q.block_scale.view(torch.uint8) != r.block_scale.view(torch.uint8)).sum()),
                "code_mismatch": int((q.codes() != r.codes()).sum()),
                "four_six_flips": flips,
                "blocks": q.block_scale.numel(),
            }
    # every code under normal and subnormal scales, through every decode
    codes = torch.arange(16, dtype=torch.uint8, device=dev).repeat(64, 16)  # [64, 256]
    sc = torch.tensor([448.0, 1.0, 0.015625, 0.001953125, 0.005859375, 3.0, 0.5, 96.0], device=dev)
    scales = sc.repeat_interleave(8).unsqueeze(1).expand(64, 16).to(torch.float8_e4m3fn).contiguous()
    w = nvfp4.NVFP4Tensor(nvfp4.pack_codes(codes), scales, torch.tensor(7.5, device=dev), torch.Size((64, 256)),
                          torch.bfloat16)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        out[f"all_codes.dequantize[{dt}]"] = bool(torch.equal(gm.dequantize(w, dt), w.dequantize(dt)))
    xa = torch.randn(16, 256, device=dev, generator=g)
    ref = xa @ w.dequantize(torch.float32).T
    for dt in (torch.bfloat16, torch.float16):
        for path in CHECK_PATHS:
            if path in ("gemv6", "mma") and dt != torch.bfloat16:
                continue
            for rows in ((1,) if path.startswith("gemv") else (1, 16)):
                try:
                    out[f"all_codes.{path}[{dt},M={rows}]"] = _rel(
                        gm.linear_w4a16(xa[:rows].to(dt), w, path=path), ref[:rows])
                except Exception as e:  # noqa: BLE001
                    out[f"all_codes.{path}[{dt},M={rows}]"] = f"FAILED {e!r}"[:300]
    # the same through W4A4 (x = v * scale in bf16) and with a bias, on an odd shape (partial tiles)
    wq = nvfp4.quantize(torch.randn(1000, 2112, device=dev, generator=g) * 0.02)  # K % 128 != 0, N % 64 != 0
    xb = torch.randn(16, 2112, device=dev, generator=g)
    bias = torch.randn(1000, device=dev, generator=g).bfloat16()
    refb = xb @ wq.dequantize(torch.float32).T + bias.float()
    for path in CHECK_PATHS:
        for rows in ((1, 2) if path.startswith("gemv") else (7, 16)):
            try:
                out[f"odd_shape.{path}[M={rows}]"] = _rel(gm.linear_w4a16(xb[:rows].bfloat16(), wq, bias, path=path),
                                                          refb[:rows])
                amax = xb.abs().amax()
                xh = nvfp4.quantize(xb[:rows].bfloat16(), None, amax=amax).dequantize(torch.float32)
                out[f"odd_shape.w4a4.{path}[M={rows}]"] = _rel(
                    gm.linear_w4a4(xb[:rows].bfloat16(), wq, amax, bias, path=path),
                    xh @ wq.dequantize(torch.float32).T + bias.float())
            except Exception as e:  # noqa: BLE001
                out[f"odd_shape.{path}[M={rows}]"] = f"FAILED {e!r}"[:300]
    res["correctness"] = out
    print(json.dumps(out, indent=1), flush=True)


def main_gpu():
    import torch

    peers = harness.peers()

    from fp4ptq import nvfp4
    from fp4ptq.kernels import gemm as gm
    from fp4ptq.kernels import quantize_kernel as qk

    budget = float(os.environ.get("BUDGET_S", 480))
    t0 = time.time()
    res = {"env": peers.env(), "rows": [], "quant_rows": []}
    save, _ = harness.recorder(res, harness.out_path("kernels_h200.json"))

    res["copy_TBps"] = peers.copy_bw()
    res["bf16_TFLOPs_8192"] = peers.bf16_peak()
    print(f"copy {res['copy_TBps']:.2f} TB/s  bf16 {res['bf16_TFLOPs_8192']:.0f} TFLOP/s", flush=True)
    correctness(res, gm, qk)
    save()
    try:
        import gemlite

        cfg = os.path.join(os.environ.get("PEERS_DIR", ".peers"), "gemlite", "configs", "h100.json")
        if os.path.exists(cfg):
            gemlite.load_config(cfg)
        have_gemlite = True
    except Exception as e:  # noqa: BLE001
        res["gemlite"] = f"import failed: {e!r}"
        have_gemlite = False
    dev = "cuda"
    torch.manual_seed(0)

    phases = os.environ.get("PHASES", "quant").split(",")

    # ---- main table ----
    table_ms = [int(v) for v in os.environ.get("TABLE_MS", ",".join(map(str, MS))).split(",")]
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wq = nvfp4.quantize(w)
        wref = wq.dequantize(torch.float32)
        impls = {"cublas_bf16": lambda x, w=w: x @ w.t()}
        try:
            impls["tinygemm_int4_g128"] = peers.make_tinygemm(w)
        except Exception as e:  # noqa: BLE001
            res["rows"].append({"shape": name, "impl": "tinygemm_int4_g128", "error": repr(e)[:300]})
        if have_gemlite:
            try:
                impls["gemlite_int4_g64"] = peers.make_gemlite_int4(w)
            except Exception as e:  # noqa: BLE001
                res["rows"].append({"shape": name, "impl": "gemlite_int4_g64", "error": repr(e)[:300]})
        for m in table_ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            rows_chk = min(m, 64)  # error checked on the first rows (fp32 references are slow)
            ref = x[:rows_chk].float() @ wref.T
            amax = x.float().abs().amax() * 0.9  # a static activation amax (some saturation)
            ours = {"ours_w4a16": lambda x=x: gm.linear_w4a16(x, wq)}
            if m <= 2:
                ours["ours_w4a4_mse"] = lambda x=x: gm.linear_w4a4(x, wq, amax, four_six="mse")
            if m < 1024:  # (runs 1-9: 0.27-0.41x cuBLAS from M = 1024; slow to time at M = 8192)
                ours["ours_w4a16_gemm"] = lambda x=x: gm.linear_w4a16(x, wq, path="gemm")
            if 32 < m <= 2048:  # (its 64- / 128-row tiles below M = 129)
                ours["ours_w4a16_wsgemm"] = lambda x=x: gm.linear_w4a16(x, wq, path="wsgemm")
            if m <= 64:
                ours["ours_w4a16_mma"] = lambda x=x: gm.linear_w4a16(x, wq, path="mma")
            elif m <= 128:
                ours["ours_w4a16_wgmma"] = lambda x=x: gm.linear_w4a16(x, wq, path="wgmma")
            if m > 16:
                ours["ours_w4a16_cublas"] = lambda x=x: gm.linear_w4a16(x, wq, path="cublas")
            ours["ours_w4a4"] = lambda x=x: gm.linear_w4a4(x, wq, amax)
            if 128 <= m < 1024:
                ours["ours_w4a4_gemm"] = lambda x=x: gm.linear_w4a4(x, wq, amax, path="gemm")
            if m >= 128:
                ours["ours_w4a4_cublas"] = lambda x=x: gm.linear_w4a4(x, wq, amax, path="cublas")
            if m >= 1024:
                ours["ours_w4a4_mse"] = lambda x=x: gm.linear_w4a4(x, wq, amax, four_six="mse")
            w4a4_ref = None
            for label, fn in list(impls.items()) + list(ours.items()):
                if time.time() - t0 > budget:
                    break
                if label.startswith("tinygemm") and m > 128 or label.startswith("gemlite") and m > 1024:
                    continue
                try:
                    if label.startswith("ours"):
                        y = fn()[:rows_chk]
                        if "w4a4" in label:
                            if w4a4_ref is None:
                                xh = nvfp4.quantize(x[:rows_chk], None, amax=amax).dequantize(torch.float32)
                                w4a4_ref = xh @ wref.T
                            rr = w4a4_ref
                            if "mse" in label:
                                xh = nvfp4.quantize(x[:rows_chk], "mse", amax=amax).dequantize(torch.float32)
                                rr = xh @ wref.T
                            err = _rel(y, rr)
                        else:
                            err = _rel(y, ref)
                        ms = peers.bench(fn)
                        wbytes = 0.5 + 1 / 16
                    else:
                        y = fn(x)[:rows_chk]
                        err = _rel(y, x[:rows_chk].float() @ w.float().T)
                        ms = peers.bench(lambda fn=fn, x=x: fn(x))
                        wbytes = {"cublas_bf16": 2.0, "tinygemm_int4_g128": 0.5 + 4 / 128,
                                  "gemlite_int4_g64": 0.5 + 4 / 64}[label]
                    byt = wbytes * n * k + 2 * m * k + 2 * m * n
                    row = {"shape": name, "N": n, "K": k, "M": m, "impl": label, "ms": ms,
                           "TBps": byt / (ms * 1e-3) / 1e12, "TFLOPs": 2 * m * n * k / (ms * 1e-3) / 1e12,
                           "rel_err": err}
                    res["rows"].append(row)
                    print(f"{name:12} {m:5} {label:22} {ms*1e3:9.1f}us {row['TBps']:5.2f}TB/s "
                          f"{row['TFLOPs']:6.1f}TF err {err:.1e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    res["rows"].append({"shape": name, "M": m, "impl": label, "error": repr(e)[:300]})
                    traceback.print_exc(limit=3)
            if m in TARGET_MS and ROUNDS > 1 and time.time() - t0 <= budget:
                # the rows the targets read, again in interleaved rounds: peers and ours alike move a
                # few % between passes (cuBLAS bf16 itself 45-51 us on 8B.o at M = 1024 across runs)
                fns = {"cublas_bf16": lambda x=x, f=impls["cublas_bf16"]: f(x), "ours_w4a16": ours["ours_w4a16"],
                       "ours_w4a4": ours["ours_w4a4"]}
                if m <= 16 and "tinygemm_int4_g128" in impls:
                    fns["tinygemm_int4_g128"] = lambda x=x, f=impls["tinygemm_int4_g128"]: f(x)
                rounds = {label: [] for label in fns}
                try:
                    for _ in range(ROUNDS):
                        for label, fn in fns.items():
                            rounds[label].append(peers.bench(fn))
                    for label, ms_list in rounds.items():
                        res.setdefault("interleaved", []).append(
                            {"shape": name, "M": m, "impl": label, "ms_rounds": ms_list, "ms": statistics.median(ms_list)})
                    print(f"{name:12} {m:5} interleaved x{ROUNDS}: " + " ".join(
                        f"{label} {statistics.median(v)*1e3:.1f}us" for label, v in rounds.items()), flush=True)
                except Exception as e:  # noqa: BLE001
                    res.setdefault("interleaved", []).append({"shape": name, "M": m, "error": repr(e)[:300]})
            del x
        del w, wq, wref, impls
        torch.cuda.empty_cache()
        save()

    # ---- quantize kernel on activations ----
    for m, k in QUANT_SHAPES if "quant" in phases else ():
        if time.time() - t0 > budget + 40:
            break
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        amax = x.float().abs().amax()
        for rule in (None, "mse", "mae", "max"):
            try:
                ms = peers.bench(lambda: qk.launch_quantize(x, amax, rule))
                byt = 2 * m * k + m * k / 2 + m * k / 16
                res["quant_rows"].append({"M": m, "K": k, "rule": rule, "ms": ms, "TBps": byt / (ms * 1e-3) / 1e12})
                print(f"quantize {m}x{k} {rule} {ms*1e3:.1f}us {byt/(ms*1e-3)/1e12:.2f}TB/s", flush=True)
            except Exception as e:  # noqa: BLE001
                res["quant_rows"].append({"M": m, "K": k, "rule": rule, "error": repr(e)[:300]})
        ms = peers.bench(lambda: x.clone())
        res["quant_rows"].append({"M": m, "K": k, "rule": "copy(clone)", "ms": ms,
                                  "TBps": 4 * m * k / (ms * 1e-3) / 1e12})
    res["total_s"] = time.time() - t0
    save()
    print(f"total {res['total_s']:.0f}s")


# --------------------------------------------------------------------------- #
# Report (here, from the JSON)
# --------------------------------------------------------------------------- #
def _floor_section(floor_path, get, copy):
    """Lines comparing each layer's M = 1 time and target with the plain read of its NVFP4 bytes
    (``read_floor_h200.py``'s result beside the table's JSON, a separate run), if that file exists."""
    if not os.path.exists(floor_path):
        return []
    with open(floor_path) as f:
        floors = {r["layer"]: r for r in json.load(f)["layers"]}
    lines = ["", "## M = 1 against a plain read of the same bytes", "",
             f"From `{os.path.basename(floor_path)}` (another run): the fastest streaming read of each layer's "
             "NVFP4 bytes (no decode) in the same timing. A target below this floor is out of reach of any kernel "
             "in this timing.", "",
             "| shape | read floor (us) | floor % of copy | M = 1 target (us) | ours M = 1 (us, this run) | ours / floor |",
             "|---|---|---|---|---|---|"]
    for name in SHAPES:
        fl, r = floors.get(name), get.get((name, 1, "ours_w4a16"))
        if not fl or not r:
            continue
        need = 0.8 if name.startswith("70B") else 0.7
        target_us = fl["bytes"] / (need * copy * 1e12) * 1e6
        below = " (below the floor)" if target_us < fl["floor_us"] else ""
        lines.append(f"| {name} | {fl['floor_us']:.2f} | {fl['floor_pct_copy']:.0f}% | {target_us:.2f}{below} | "
                     f"{r['ms'] * 1e3:.2f} | {r['ms'] * 1e3 / fl['floor_us']:.2f} |")
    return lines


def report(path):
    with open(path) as f:
        res = json.load(f)
    base = os.path.splitext(path)[0]
    rows = [r for r in res["rows"] if "ms" in r]
    get = {(r["shape"], r["M"], r["impl"]): r for r in rows}
    copy = res["copy_TBps"]
    lines = [f"# NVFP4 Triton kernels on the H200 ({res['env'].get('gpu')}, torch {res['env'].get('torch')}, "
             f"triton {res['env'].get('triton')})", "",
             f"Measured in the same run: copy bandwidth {copy:.2f} TB/s (read + write), cuBLAS bf16 "
             f"{res['bf16_TFLOPs_8192']:.0f} TFLOP/s (8192^3). Every time is the median of a replayed CUDA graph "
             "of 10 calls (us per call). `ours_w4a16` is what the dispatch picks for that M; `ours_w4a4` "
             "includes quantizing the activations (static amax).", ""]
    if res.get("provenance"):
        lines += [res["provenance"], ""]
    impls = ["cublas_bf16", "tinygemm_int4_g128", "gemlite_int4_g64", "ours_w4a16", "ours_w4a16_gemv",
             "ours_w4a16_gemv4", "ours_w4a16_gemv5", "ours_w4a16_gemv6", "ours_w4a16_mma", "ours_w4a16_streamk",
             "ours_w4a16_streamk_r96", "ours_w4a16_wgmma",
             "ours_w4a16_wsgemm", "ours_w4a16_gemm",
             "ours_w4a16_cublas", "ours_w4a4",
             "ours_w4a4_gemm", "ours_w4a4_cublas", "ours_w4a4_mse"]
    present = [i for i in impls if any(r["impl"] == i for r in rows)]
    lines += ["## Time per call (us); speedup over cuBLAS bf16 in brackets", "",
              "| shape (N x K) | M | " + " | ".join(present) + " |",
              "|---|---|" + "---|" * len(present)]
    for name, (n, k) in SHAPES.items():
        for m in MS:
            base_r = get.get((name, m, "cublas_bf16"))
            cells = []
            for i in present:
                r = get.get((name, m, i))
                if r is None:
                    cells.append("")
                elif base_r and i != "cublas_bf16":
                    cells.append(f"{r['ms']*1e3:.1f} ({base_r['ms']/r['ms']:.2f}x)")
                else:
                    cells.append(f"{r['ms']*1e3:.1f}")
            if any(cells):
                lines.append(f"| {name} ({n}x{k}) | {m} | " + " | ".join(cells) + " |")
    inter = [r for r in res.get("interleaved", []) if "ms" in r]
    if inter:  # the target rows' interleaved medians replace the single pass in the targets below
        n_rounds = max(len(r["ms_rounds"]) for r in inter)
        lines += ["", f"## Target rows re-timed in {n_rounds} interleaved rounds (median us; single pass above)", "",
                  "| shape | M | cuBLAS bf16 | ours W4A16 | ours W4A4 | tinygemm int4 |", "|---|---|---|---|---|---|"]
        iget = {(r["shape"], r["M"], r["impl"]): r for r in inter}
        for name in SHAPES:
            for m in TARGET_MS:
                cells = [iget.get((name, m, i)) for i in ("cublas_bf16", "ours_w4a16", "ours_w4a4", "tinygemm_int4_g128")]
                if any(cells):
                    lines.append(f"| {name} | {m} | " + " | ".join(f"{c['ms']*1e3:.1f}" if c else "" for c in cells) + " |")
        for key, r in iget.items():
            single = get.get(key)
            if single:
                get[key] = dict(single, ms=r["ms"], TBps=single["TBps"] * single["ms"] / r["ms"])
    lines += ["", "## Targets", "", "Read from the interleaved medians where the run has them.", "",
              "| target | shape | figure | met |", "|---|---|---|---|"]

    def t(target, shape, figure, ok):
        lines.append(f"| {target} | {shape} | {figure} | {'met' if ok else 'NOT met'} |")

    def untimed(target, shape):  # a target row the run did not reach (its time budget, BUDGET_S, ran out)
        lines.append(f"| {target} | {shape} | not timed in this run (time budget) | not checked |")

    for name in SHAPES:
        r = get.get((name, 1, "ours_w4a16"))
        c = get.get((name, 1, "cublas_bf16"))
        tg = get.get((name, 1, "tinygemm_int4_g128"))
        if not r:
            untimed("M=1 bandwidth", name)
        if r:
            frac = r["TBps"] / copy
            need = 0.8 if name.startswith("70B") else 0.7
            t(f"M=1 bandwidth >= {need:.0%} of copy", name, f"{r['TBps']:.2f} TB/s = {frac:.0%}", frac >= need)
            if c:
                t("M=1 >= 3x cuBLAS (issue) / 2.7x (BENCHMARKS.md)", name, f"{c['ms']/r['ms']:.2f}x",
                  c["ms"] / r["ms"] >= 2.7)
            if tg:
                t("M=1 >= 1.7x tinygemm (issue) / 1.5x (BENCHMARKS.md)", name, f"{tg['ms']/r['ms']:.2f}x",
                  tg["ms"] / r["ms"] >= 1.5)
    for name in SHAPES:
        r, c = get.get((name, 16, "ours_w4a16")), get.get((name, 16, "cublas_bf16"))
        if r and c:
            t("M=16 >= 2.5x cuBLAS", name, f"{c['ms']/r['ms']:.2f}x", c["ms"] / r["ms"] >= 2.5)
        else:
            untimed("M=16 >= 2.5x cuBLAS", name)
    for m in (1024, 8192):
        for name in SHAPES:
            r, c = get.get((name, m, "ours_w4a16")), get.get((name, m, "cublas_bf16"))
            if r and c:
                t(f"M={m} W4A16 >= 0.85x cuBLAS", name, f"{c['ms']/r['ms']:.2f}x", c["ms"] / r["ms"] >= 0.85)
            else:
                untimed(f"M={m} W4A16 >= 0.85x cuBLAS", name)
            r = get.get((name, m, "ours_w4a4"))
            if r and c:
                t(f"M={m} W4A4 (quantize+GEMM) within 1.3x of cuBLAS", name, f"{r['ms']/c['ms']:.2f}x time",
                  r["ms"] / c["ms"] <= 1.3)
    q = [r for r in res["quant_rows"] if "ms" in r]
    qget = {(r["M"], r["K"], r["rule"]): r for r in q}
    for m, k in QUANT_SHAPES:
        s, r = qget.get((m, k, None)), qget.get((m, k, "mse"))
        if s and m * k >= 64 << 20:
            t("quantize >= 75% of copy bandwidth (M*K >= 64M)", f"{m}x{k}", f"{s['TBps']/copy:.0%}",
              s["TBps"] / copy >= 0.75)
            if r:
                t("quantize 4/6 (mse) <= 15% slower", f"{m}x{k}", f"{r['ms']/s['ms']-1:+.0%}",
                  r["ms"] / s["ms"] <= 1.15)
    lines += _floor_section(os.path.join(os.path.dirname(path), "read_floor_h200.json"), get, copy)
    lines += ["", "## Quantize kernel (bf16 activations -> packed codes + e4m3 scales, static amax)", "",
              "| M x K | standard TB/s (% of copy) | mse | mae | max | clone TB/s | mse vs standard |",
              "|---|---|---|---|---|---|---|"]
    for m, k in QUANT_SHAPES:
        s = qget.get((m, k, None))
        if not s:
            continue
        cells = [f"{s['TBps']:.2f} ({s['TBps']/copy:.0%})"]
        for rule in ("mse", "mae", "max"):
            r = qget.get((m, k, rule))
            cells.append(f"{r['TBps']:.2f}" if r else "")
        cl = qget.get((m, k, "copy(clone)"))
        cells.append(f"{cl['TBps']:.2f}" if cl else "")
        r = qget.get((m, k, "mse"))
        cells.append(f"{r['ms']/s['ms']-1:+.0%} time" if r else "")
        lines.append(f"| {m} x {k} | " + " | ".join(cells) + " |")
    lines += ["", "## Correctness on the GPU", "", "```", json.dumps(res.get("correctness", {}), indent=1), "```"]
    errs = [r for r in rows if r["impl"].startswith("ours")]
    worst = max((r["rel_err"] for r in errs), default=float("nan"))
    lines += ["", f"Worst relative Frobenius error of our GEMMs over all rows: {worst:.2e} "
              "(W4A16 vs fp32 matmul of the dequantized weight; W4A4 vs fp32 matmul of the "
              "dequantized activations and weight).", ""]
    if res.get("chosen_configs"):
        lines += [f"Configs chosen by the sweep: `{res['chosen_configs']}`", ""]
    failed = [r for r in res["rows"] if "error" in r]
    if failed:
        lines += ["Errors:", ""] + [f"- {r.get('shape')} M={r.get('M')} {r['impl']}: {r['error'][:160]}"
                                    for r in failed] + [""]
    harness.write_text(base + ".md", "\n".join(lines))
    plt = harness.pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), sharex=True)
    for ax, name in zip(axes.flat, SHAPES):
        for impl in ("tinygemm_int4_g128", "gemlite_int4_g64", "ours_w4a16", "ours_w4a4"):
            pts = [(m, get[(name, m, "cublas_bf16")]["ms"] / get[(name, m, impl)]["ms"]) for m in MS
                   if (name, m, impl) in get and (name, m, "cublas_bf16") in get]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_title(f"{name} {SHAPES[name][0]}x{SHAPES[name][1]}")
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("speedup over cuBLAS bf16")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("NVFP4 kernels on the H200: speedup over cuBLAS bf16 vs M (CUDA-graph replay)")
    fig.tight_layout()
    fig.savefig(base + "_speedup.png", dpi=110)
    print("wrote", base + ".md", base + "_speedup.png")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report", help="write markdown + PNG from a kernels_h200.json")
    args = ap.parse_args()
    if args.report:
        report(args.report)
    else:
        main_gpu()
