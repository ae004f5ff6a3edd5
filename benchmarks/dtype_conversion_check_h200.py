"""``model.cuda().to(torch.bfloat16)`` on NVFP4 layers built in fp32 on the CPU, against layers built in bf16 and
moved: the format buffers (E4M3 block scales, fp32 global scales) keep their dtypes and bits through the
conversion (``NVFP4Linear._apply``), so both give the same bits through the kernels, W4A16 and W4A4 (a global
scale 16 bits cannot hold), M = 1 / 16 / 512.

    PYTHONPATH=$PWD python benchmarks/dtype_conversion_check_h200.py   # $OUT/dtype_conversion_check_h200.json
"""
from __future__ import annotations

import json
import os

import torch

from fp4ptq import nvfp4
from fp4ptq.modules import NVFP4Linear


def main() -> None:
    torch.manual_seed(0)
    w = nvfp4.quantize(torch.randn(4096, 4096) * 0.02)
    bias = torch.randn(4096).bfloat16().float()  # exact in bf16
    rows = []
    for scheme in ("w4a16", "w4a4"):
        amax = 3.1234567 if scheme == "w4a4" else None
        built = NVFP4Linear.from_quantized(w, bias, scheme=scheme, input_amax=amax, dtype=torch.bfloat16).cuda()
        converted = NVFP4Linear.from_quantized(w, bias, scheme=scheme, input_amax=amax, dtype=torch.float32)
        converted = converted.cuda().to(torch.bfloat16)
        buffers = {n: str(t.dtype) for n, t in converted.named_buffers()}
        for m in (1, 16, 512):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                same = torch.equal(built(x), converted(x))
            rows.append({"scheme": scheme, "m": m, "equal": same, "buffers": buffers})
            print(rows[-1], flush=True)
    ok = all(r["equal"] for r in rows)
    print("all equal", ok)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "dtype_conversion_check_h200.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows, "all_ok": ok}, f, indent=1)


if __name__ == "__main__":
    main()
