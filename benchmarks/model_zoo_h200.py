"""The dispatch on the linear layers of popular models other than Llama-3.1 (whose shapes every rule
was tuned on): per layer and M, the path picked, its time against cuBLAS bf16 on the same shape, and
its error against the reference decode; so that a shape whose K or N the rules did not foresee shows
up as a slow or wrong row.

    PYTHONPATH=$PWD PEERS_DIR=.peers python benchmarks/model_zoo_h200.py   # $OUT/model_zoo_h200.json

Where the dispatch picks the warp-specialized GEMM, the dequantize + cuBLAS path it replaced is timed
too (W4A16 and W4A4). Knobs: MS (rows), DTYPE (bf16 | fp16 activations and cuBLAS peer; the fp16 file is
model_zoo_h200_fp16.json), FOUR_SIX (the W4A4 rule, default none), MODELS (a comma-separated subset by name).

The markdown table (any machine, no GPU), merging several results files (a later file's row replaces an
earlier one's for the same model, layer, M and dtype), with ``--before`` the times of an earlier run::

    python benchmarks/model_zoo_h200.py --report benchmarks/results/model_zoo_h200_s28.json \\
        --before benchmarks/results/model_zoo_h200_s27.json > benchmarks/results/model_zoo_h200_s28.md
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import harness

MODELS = {  # name: {layer: (N out, K in)}
    "Qwen2-7B": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)},
    "Qwen2-72B": {"qkv": (10240, 8192), "gate_up": (59136, 8192), "down": (8192, 29568)},
    "Llama-2-7B": {"qkv": (12288, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)},
    "Gemma-2-9B": {"qkv": (8192, 3584), "o": (3584, 4096), "gate_up": (28672, 3584), "down": (3584, 14336)},
    "Phi-3-mini": {"qkv": (9216, 3072), "o": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192)},
    "SmolLM2-135M": {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)},
}


def run() -> None:
    import torch

    from fp4ptq import nvfp4
    from fp4ptq.kernels import dispatch
    from fp4ptq.kernels import gemm as gm

    dev = torch.device("cuda")
    ms = harness.env_list("MS", "1,2,16,64,128,1024", int)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[os.environ.get("DTYPE", "bf16")]
    four_six = os.environ.get("FOUR_SIX") or None
    models = {name: MODELS[name] for name in harness.env_list("MODELS", ",".join(MODELS))}
    t0 = time.time()
    res = {"env": harness.peers().env(), "rows": []}
    save, record = harness.recorder(res, harness.out_path(
        "model_zoo_h200" + ("_fp16" if dt == torch.float16 else "") + ".json"))
    g = torch.Generator(device=dev).manual_seed(0)
    for model, layers in models.items():
        for layer, (n, k) in layers.items():
            w = (torch.randn(n, k, device=dev, dtype=torch.float32, generator=g) * 0.02).to(dt)
            wq = nvfp4.quantize(w)
            wref = wq.dequantize(torch.float32)
            for m in ms:
                x = torch.randn(m, k, device=dev, dtype=torch.float32, generator=g).to(dt)
                amax = x.float().abs().amax()
                ref4 = nvfp4.quantize(x, four_six, amax=amax).dequantize(torch.float32) @ wref.T
                row = {"model": model, "layer": layer, "n": n, "k": k, "m": m, "dtype": str(dt), "four_six": four_six,
                       "path": dispatch.choose(m, dt, False, k, dev, n),
                       "rel_err": harness.rel(gm.linear_w4a16(x, wq), x.float() @ wref.T),
                       "w4a4_rel_err": harness.rel(gm.linear_w4a4(x, wq, amax, four_six=four_six), ref4),
                       "cublas_us": harness.graph_us(lambda: x @ w.t()),
                       "ours_us": harness.graph_us(lambda: gm.linear_w4a16(x, wq)),
                       "w4a4_us": harness.graph_us(lambda: gm.linear_w4a4(x, wq, amax, four_six=four_six))}
                row["speedup"] = row["cublas_us"] / row["ours_us"]
                if row["path"] == "wsgemm":  # what the rows before the warp-specialized kernel took
                    row["dequant_cublas_us"] = harness.graph_us(lambda: gm.linear_w4a16(x, wq, path="cublas"))
                if dispatch.choose(m, dt, True, k, dev, n) == "wsgemm":
                    row["w4a4_cublas_path_us"] = harness.graph_us(
                        lambda: gm.linear_w4a4(x, wq, amax, four_six=four_six, path="cublas"))
                record("rows", row)
            del w, wq, wref
            torch.cuda.empty_cache()
    print("total s", round(time.time() - t0, 1))


def _key(row: dict) -> tuple:
    return row["model"], row["layer"], row["m"], row.get("dtype", "torch.bfloat16")


def load_rows(paths) -> dict:
    """The rows of the results files ``paths`` by (model, layer, M, dtype), later files first."""
    rows = {}
    for path in paths:
        data = harness.read_results(path, "model_zoo_h200")
        for row in data["rows"]:
            rows[_key(row)] = row
    return rows


def table(rows: dict, before: dict) -> str:
    """The markdown table, rows ordered as measured (model, layer, then M)."""
    head = ["model", "layer", "N x K", "M", "dtype", "path", "ours (us)", "cuBLAS bf16 (us)", "x cuBLAS",
            "W4A4 (us)", "rel. error", "W4A4 rel. error"]
    if before:
        head += ["before: path", "before (us)", "ours / before"]
    cells = []
    for key, row in rows.items():
        line = [row["model"], row["layer"], f"{row['n']} x {row['k']}", row["m"],
                row.get("dtype", "torch.bfloat16").replace("torch.", ""), row["path"], f"{row['ours_us']:.1f}",
                f"{row['cublas_us']:.1f}", f"{row['speedup']:.2f}x", f"{row['w4a4_us']:.1f}",
                f"{row['rel_err']:.1e}", f"{row['w4a4_rel_err']:.1e}"]
        if before:
            old = before.get(key)
            line += ([old["path"], f"{old['ours_us']:.1f}", f"{row['ours_us'] / old['ours_us']:.2f}"] if old
                     else ["", "", ""])
        cells.append(line)
    return "\n".join(harness.md_table(head, cells)) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the markdown table of these results files")
    ap.add_argument("--before", nargs="*", default=[], help="earlier results files to compare with")
    args = ap.parse_args(argv)
    if not args.report:
        run()
        return 0
    before = load_rows(args.before) if args.before else {}
    sys.stdout.write(table(load_rows(args.report), before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
