"""gemv7's configs for fp16 activations at M = 1 (rows a tile, warps, blocks a step, programs an SM, loading
ahead: 32 configs and the shipped one), on the long-K layers it takes; each output checked against the
exact fp32 product (2e-3), then 3 interleaved rounds, medians, us.

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/gemv7_fp16_sweep_h200.py   # $OUT/gemv_fp16_h200_sweep.json
"""
from __future__ import annotations

import itertools
import json
import os
import statistics

import peers_h200 as peers
import torch

from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

LAYERS = {"8B.down": (4096, 14336), "70B.down": (8192, 28672), "Llama-2-7B.down": (4096, 11008),
          "Qwen2-7B.down": (3584, 18944), "Qwen2-72B.down": (8192, 29568)}
ROUNDS = int(os.environ.get("ROUNDS", "3"))


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shipped, f16_shipped = gm._gemv7_config, gm._gemv7_f16_config
    res = {"env": peers.env(), "layers": {}}
    for name, (n, k) in LAYERS.items():
        wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
        x = torch.randn(1, k, device=dev, generator=g).half()
        exact = x.float() @ wq.dequantize(torch.float32).T
        bf16_cfg = shipped(1, n, k)
        f16_cfg = gm._gemv7_f16_config(n, k, bf16_cfg)
        cfgs = [bf16_cfg] + [c for c in itertools.product((8, 16), (2, 4), (128, 256), (4, 8), (True, False))
                             if c != bf16_cfg]
        times: dict = {}
        for _ in range(ROUNDS):
            for c in cfgs:
                gm._gemv7_config = lambda m_, n_, k_, c=c: c
                gm._gemv7_f16_config = lambda n_, k_, cfg: cfg  # the config as given
                try:
                    y = gm.linear_w4a16(x, wq, path="gemv6")
                    err = float((y.float() - exact).norm() / exact.norm())
                    if err > 2e-3:
                        raise AssertionError(f"{name} {c}: {err}")
                    times.setdefault(c, []).append(peers.bench(lambda: gm.linear_w4a16(x, wq, path="gemv6")) * 1e3)
                finally:
                    gm._gemv7_config, gm._gemv7_f16_config = shipped, f16_shipped
        med = sorted((statistics.median(a), c) for c, a in times.items())
        res["layers"][name] = {"n": n, "k": k, "bf16_config": bf16_cfg, "fp16_config": f16_cfg,
                               "median_us": {str(c): statistics.median(a) for c, a in times.items()},
                               "all_us": {str(c): a for c, a in times.items()}}
        print(name, "bf16 config", bf16_cfg, round(statistics.median(times[bf16_cfg]), 2), "fp16 config", f16_cfg,
              round(statistics.median(times[f16_cfg]), 2), "best", [(round(a, 2), c) for a, c in med[:3]], flush=True)
        with open(os.path.join(os.environ.get("OUT", "."), "gemv_fp16_h200_sweep.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
