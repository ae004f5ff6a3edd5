"""Profile input for Nsight Compute: our W4A16 kernels (``--paths``, default
``gemv6`` and ``gemv5``; ``mma``, ``gemm``, ``wsgemm`` and ``cublas_path`` (dequantize + cuBLAS) for M > 2) beside torch's tinygemm
int4 and cuBLAS bf16 on one shape (default Llama-70B gate+up, N=57344, K=8192)
and ``--m`` activation rows (default 1), each launched ``--reps`` times.

    ncu --clock-control none --kernel-name regex:'gemv|tinygemm|bf16x2|resident' --launch-skip 6 \\
        --launch-count 3 --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/ncu_gemv.py
(``PEERS_DIR`` names the folder holding ``peers_h200.py``, default ``.peers``.)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=57344)
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--paths", default="gemv6,gemv5,tinygemm,cublas")
    parser.add_argument("--mma-stages", type=int, default=None,
                        help="override the ring depth of mma.py's config")
    args = parser.parse_args()
    sys.path.insert(0, os.environ.get("PEERS_DIR", ".peers"))
    import peers_h200 as peers

    from fp4ptq import nvfp4
    from fp4ptq.kernels import gemm as gm

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(args.n, args.k, device="cuda", generator=gen).bfloat16() * 0.02
    wq = nvfp4.quantize(w)
    x = torch.randn(args.m, args.k, device="cuda", generator=gen).bfloat16()
    fns = {"tinygemm": lambda: tiny(x), "cublas": lambda: x @ w.t()}
    for p in ("gemv4", "gemv5", "gemv6", "mma", "gemm", "wsgemm", "cublas_path"):
        fns[p] = lambda p=p: gm.linear_w4a16(x, wq, path="cublas" if p == "cublas_path" else p)
    if args.mma_stages is not None:
        from fp4ptq.kernels import mma

        shipped = mma.config
        mma.config = lambda *a, **kw: shipped(*a, **kw)[:5] + (args.mma_stages,)
    labels = args.paths.split(",")
    tiny = peers.make_tinygemm(w) if "tinygemm" in labels else None
    print(f"gemv6 config {gm._gemv6_config(1, args.n, args.k)}", flush=True)
    for label in labels:
        fn = fns[label]
        for _ in range(args.reps):
            fn()
        torch.cuda.synchronize()
        print(f"{label}: {args.reps} launches", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
