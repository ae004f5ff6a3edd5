"""Launch plans of a layer placed on a GPU other than the current one (``device_map`` across GPUs):
W4A16 and W4A4 modules on the last GPU, called from the first, at M = 1, 16 and 512, 6 calls each,
every output equal bit for bit to the dispatch's (which enters the layer's device itself).

    PYTHONPATH=$PWD python benchmarks/multi_gpu_plan_check.py   # needs 2 GPUs; $OUT/multi_gpu_plan_check.json
"""
from __future__ import annotations

import json
import os

import torch

from fp4ptq import kernels, nvfp4
from fp4ptq.modules import NVFP4Linear


def main():
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(0)
    g = torch.Generator(device=dev).manual_seed(0)
    q = nvfp4.quantize((torch.randn(4096, 4096, device=dev, generator=g) * 0.02).bfloat16())
    res = {"layer_device": str(dev), "current_device": torch.cuda.current_device(), "rows": []}
    for scheme, kw in (("w4a16", {}), ("w4a4", dict(scheme="w4a4", input_amax=torch.tensor(3.0)))):
        mod = NVFP4Linear.from_quantized(q, dtype=torch.bfloat16, **kw).to(dev)
        for m in (1, 16, 512):
            equal = []
            for _ in range(6):
                x = torch.randn(m, 4096, device=dev, generator=g).bfloat16()
                with torch.no_grad():
                    y = mod(x)
                    if scheme == "w4a4":
                        ref = kernels.linear_w4a4(x, mod.quantized_weight(), mod.input_amax())
                    else:
                        ref = kernels.linear_w4a16(x, mod.quantized_weight())
                equal.append(bool(torch.equal(y, ref)))
            plan, _ = mod._plan(x)
            row = {"scheme": scheme, "m": m, "equal": equal, "planned": plan is not None,
                   "current_device_after": torch.cuda.current_device()}
            res["rows"].append(row)
            print(row, flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "multi_gpu_plan_check.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
