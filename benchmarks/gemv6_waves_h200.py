"""gemv6 with its grid cut to whole waves of resident programs (the default,
``GEMV6_WHOLE_WAVES``) against the configured programs per SM as given, M = 1
on the six Llama shapes (CUDA-graph replays, us per call), and how many
programs of each build fit on an SM (read from the compiled kernel).

    PEERS_DIR=.peers python3 benchmarks/gemv6_waves_h200.py    # $OUT/gemv6_waves_h200.json
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

    out = {"env": peers.env(), "rows": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        wq = nvfp4.quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        ref = x.float() @ wq.dequantize(torch.float32).t()
        row = {"cfg": gm._gemv6_config(1, n, k)}
        for flag in (True, False):
            gm.GEMV6_WHOLE_WAVES = flag
            y = gm.linear_w4a16(x, wq, path="gemv6")
            row[f"whole_waves={flag}_us"] = 1000 * peers.bench(lambda: gm.linear_w4a16(x, wq, path="gemv6"))
            row[f"whole_waves={flag}_err"] = float((y.float() - ref).norm() / ref.norm())
        gm.GEMV6_WHOLE_WAVES = True
        out["rows"][name] = row
        print(name, row, flush=True)
    out["resident_programs_per_sm"] = [
        {"build": dict(key[3]), "programs": v} for key, v in gm._RESIDENT.items()]
    print(json.dumps(out["resident_programs_per_sm"]), flush=True)
    Path(os.environ.get("OUT", "."), "gemv6_waves_h200.json").write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
