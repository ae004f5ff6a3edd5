"""Gradients through ``NVFP4Linear`` on the GPU, as a LoRA-style fine-tune would ask for them
(``kernels._Linear``): for the rows that reach each dispatch path (the GEMVs, mma.py, the warp-specialized
GEMM, dequantize + cuBLAS), bf16 and fp16, W4A16 and W4A4, after the layer has built its launch plans:

* the forward with x requiring a gradient gives the bits of the forward without one;
* x's gradient equals ``dy @ dequant(W)`` (W4A4: masked where |x| is past the quantizer's range), the
  bias's ``sum(dy)``, both bit for bit;
* an adapter in front of the layer gets a gradient (none was dropped);
* an fp32 layer under ``torch.autocast("cuda", bfloat16)`` gives the bits of its bf16 call (the kernels), and
  its fp32 input's gradient is ``dy @ dequant(W)`` taken in bf16, bit for bit.

    PYTHONPATH=$PWD python benchmarks/autograd_check_h200.py   # $OUT/autograd_check_h200.json
"""
from __future__ import annotations

import json
import os

import torch

from fp4ptq import kernels, nvfp4
from fp4ptq.modules import NVFP4Linear

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
SHAPES = {"8B.qkv": (6144, 4096), "8B.down": (4096, 14336)}
MS = [int(m) for m in os.environ.get("MS", "1,2,16,64,128,512").split(",")]


def main() -> None:
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
        for dtype in (torch.bfloat16, torch.float16):
            for scheme in ("w4a16", "w4a4"):
                amax = 3.0 if scheme == "w4a4" else None
                layer = NVFP4Linear.from_quantized(w, torch.randn(n, device=dev, generator=g), scheme=scheme,
                                                   input_amax=amax, dtype=dtype)
                layer.bias.requires_grad_(True)
                w_hat = w.dequantize(dtype)
                for m in MS:
                    x0 = (torch.randn(m, k, device=dev, generator=g) * 1.5).to(dtype)
                    with torch.no_grad():
                        for _ in range(3):  # the launch plans are built by now
                            plain = layer(x0)
                    x = x0.clone().requires_grad_()
                    adapter = torch.nn.Linear(k, k, bias=False, device=dev, dtype=dtype)
                    torch.nn.init.eye_(adapter.weight)
                    y = layer(adapter(x))
                    dy = torch.randn(y.shape, device=dev, generator=g).to(dtype)
                    y.backward(dy)
                    want = dy @ w_hat
                    if scheme == "w4a4":
                        enc = nvfp4.global_encode_scale(torch.tensor(amax, device=dev), False)
                        want = want * (x0.abs() <= 6.0 * 448.0 / enc)
                    want_x = want @ adapter.weight.detach()  # through the identity adapter
                    bias_ok = bool(torch.equal(layer.bias.grad, dy.sum(0)))
                    layer.bias.grad = None
                    row = {"layer": name, "dtype": str(dtype), "scheme": scheme, "m": m,
                           "path": kernels.auto_path(m, n, k, dtype, dev, w4a4=scheme == "w4a4"),
                           "forward_bits_equal": bool(torch.equal(y.detach(), plain)),
                           "x_grad_equal": bool(torch.equal(x.grad, want_x)), "bias_grad_equal": bias_ok,
                           "adapter_grad_nonzero": bool(adapter.weight.grad.abs().sum() > 0)}
                    rows.append(row)
                    print(row, flush=True)
    # an fp32 layer under autocast: the bf16 call's bits (the kernels, not the fp32 reference decode)
    n, k = SHAPES["8B.qkv"]
    w = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    for scheme in ("w4a16", "w4a4"):
        layer = NVFP4Linear.from_quantized(w, torch.randn(n, device=dev, generator=g), scheme=scheme,
                                           input_amax=3.0 if scheme == "w4a4" else None, dtype=torch.float32)
        for m in MS:
            x = torch.randn(m, k, device=dev, generator=g).requires_grad_()
            with torch.no_grad():
                want = layer(x.detach().bfloat16())
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(x)
            y.float().sum().backward()
            # dy = ones in bf16, dx = dy @ dequant(W) in bf16 (W4A4: masked past the quantizer's range), then fp32
            want_x = torch.ones(m, n, device=dev, dtype=torch.bfloat16) @ w.dequantize(torch.bfloat16)
            if scheme == "w4a4":
                enc = nvfp4.global_encode_scale(torch.tensor(3.0, device=dev), False)
                want_x = want_x * (x.detach().bfloat16().abs() <= 6.0 * 448.0 / enc)
            row = {"layer": "8B.qkv fp32 module", "dtype": "autocast bf16", "scheme": scheme, "m": m,
                   "path": kernels.auto_path(m, n, k, torch.bfloat16, dev, w4a4=scheme == "w4a4"),
                   "forward_bits_equal": bool(y.dtype == torch.bfloat16 and torch.equal(y.detach(), want)),
                   "x_grad_equal": bool(x.grad.dtype == torch.float32 and torch.equal(x.grad, want_x.float())),
                   "bias_grad_equal": True,  # (the bias does not ask for one here)
                   "adapter_grad_nonzero": bool(x.grad.abs().sum() > 0)}
            rows.append(row)
            print(row, flush=True)
    bad = [r for r in rows if not all(r[key] for key in ("forward_bits_equal", "x_grad_equal", "bias_grad_equal",
                                                         "adapter_grad_nonzero"))]
    print(f"{len(rows)} cases, {len(bad)} failing")
    with open(os.path.join(OUT, "autograd_check_h200.json"), "w") as f:
        json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows,
                   "all_ok": not bad}, f, indent=1)


if __name__ == "__main__":
    main()
