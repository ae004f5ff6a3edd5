"""M=1 W4A16 GEMV: ``gemv5`` reading x as scalars vs as 8-byte words
(``GEMV5_X_WORDS``), beside cuBLAS bf16 and tinygemm int4, on the Llama-3.1
8B/70B linear shapes (CUDA-graph replays, the peers script's ``bench``).
Checks both variants give identical outputs, and their error against fp32 math.

    PEERS_DIR=.peers python3 benchmarks/gemv_xwords_h200.py    # JSON to $OUT/gemv_xwords_h200.json
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels_h200 import SHAPES  # noqa: E402


def main() -> int:
    sys.path.insert(0, os.environ.get("PEERS_DIR", ".peers"))
    import peers_h200 as peers

    from fp4ptq import nvfp4
    from fp4ptq.kernels import gemm as gm

    copy_tbs = peers.copy_bw() if hasattr(peers, "copy_bw") else None
    out = {"copy_bw": copy_tbs, "env": peers.env(), "rows": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
        wq = nvfp4.quantize(w)
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        ref = x.float() @ wq.dequantize(torch.float32).t()
        row = {"shape": name, "n": n, "k": k, "weight_bytes": n * k // 2 + n * k // 16}
        ys = {}
        for flag in (False, True):
            gm.GEMV5_X_WORDS = flag
            key = "gemv5_xwords" if flag else "gemv5_scalar"
            try:
                ys[key] = gm.linear_w4a16(x, wq, path="gemv5")
                row[key + "_us"] = 1000 * peers.bench(lambda: gm.linear_w4a16(x, wq, path="gemv5"))
                row[key + "_err"] = float((ys[key].float() - ref).norm() / ref.norm())
            except Exception as exc:  # noqa: BLE001
                row[key + "_error"] = repr(exc)[:300]
        gm.GEMV5_X_WORDS = True
        if len(ys) == 2:
            row["identical"] = bool(torch.equal(ys["gemv5_scalar"], ys["gemv5_xwords"]))
        row["cublas_us"] = 1000 * peers.bench(lambda: x @ w.t())
        try:
            tiny = peers.make_tinygemm(w)
            row["tinygemm_us"] = 1000 * peers.bench(lambda: tiny(x))
        except Exception as exc:  # noqa: BLE001
            row["tinygemm_error"] = repr(exc)[:200]
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    path = Path(os.environ.get("OUT", ".")) / "gemv_xwords_h200.json"
    path.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
