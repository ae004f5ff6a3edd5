"""GPU checks of two CPU-tested paths, on the H200 (no peers needed):

1. ``nvfp4.fake_quantize`` (the fused path the AWQ/SmoothQuant searches call)
   against ``quantize(...).dequantize(...)`` on CUDA (must be bit-identical), and
   the CUDA result against the CPU one (4/6 rules may flip near-ties: counted).
2. GPTQ on a 4096 x 4096 layer on the GPU: the CUDA-graph column loop against
   the eager loop (``FP4PTQ_GPTQ_GRAPHS=0``), with the weights on ``cuda:0``
   given explicitly and with the current device elsewhere when there is a
   second GPU. Codes and scales must be identical.

    python3 benchmarks/gpu_checks_h200.py     # $OUT/gpu_checks_h200.json
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch


def main() -> int:
    from fp4ptq import nvfp4
    import importlib

    gptq_mod = importlib.import_module("fp4ptq.methods.gptq")

    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "fake_quantize": {}, "gptq": {}}
    g = torch.Generator().manual_seed(0)
    x_cpu = torch.randn(4096, 576, generator=g) * torch.rand(4096, 576, generator=g).pow(3) * 4
    x_cpu[0, :16] = 0
    x_cpu[1, :16] *= 1e-6
    for dtype in (torch.float32, torch.bfloat16):
        xc = x_cpu.to(dtype)
        xg = xc.cuda()
        for rule in (None, "mse", "mae", "max"):
            for amax in (None, 3.0):
                fused = nvfp4.fake_quantize(xg, rule, amax=amax)
                twostep = nvfp4.quantize(xg, rule, amax=amax).dequantize(fused.dtype)
                cpu = nvfp4.fake_quantize(xc, rule, amax=amax)
                diff = (fused.cpu() != cpu).reshape(-1, 16).any(dim=1)
                out["fake_quantize"][f"{dtype},{rule},amax={amax}"] = {
                    "cuda_fused_equals_quantize_dequantize": bool(torch.equal(fused, twostep)),
                    "blocks_differing_from_cpu": int(diff.sum()), "blocks": int(diff.numel())}
    print(json.dumps(out["fake_quantize"], indent=1), flush=True)

    gen = torch.Generator().manual_seed(1)
    W = (torch.randn(4096, 4096, generator=gen) * 0.02).cuda()
    X = torch.randn(2048, 4096, generator=gen).cuda()
    H = X.T @ X
    devices = ["cuda:0"] + (["cuda:1"] if torch.cuda.device_count() > 1 else [])
    for dev in devices:
        Wd, Hd = W.to(dev), H.to(dev)
        for rule in (None, "mse"):
            res = {}
            for graphs in ("1", "0"):
                os.environ["FP4PTQ_GPTQ_GRAPHS"] = graphs
                torch.cuda.synchronize()
                t = time.time()
                q = gptq_mod.gptq(Wd, Hd, four_six=rule)
                torch.cuda.synchronize()
                res[graphs] = (q, time.time() - t)
            os.environ["FP4PTQ_GPTQ_GRAPHS"] = "1"
            a, b = res["1"][0], res["0"][0]
            out["gptq"][f"{dev},{rule}"] = {
                "codes_equal": bool(torch.equal(a.packed, b.packed)),
                "scales_equal": bool(torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))),
                "on_device": str(a.packed.device), "graph_s": res["1"][1], "eager_s": res["0"][1]}
    print(json.dumps(out["gptq"], indent=1), flush=True)
    Path(os.environ.get("OUT", "."), "gpu_checks_h200.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
