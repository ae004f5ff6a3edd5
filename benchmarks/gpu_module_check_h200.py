"""``NVFP4Linear`` on the GPU as a model calls it: SmolLM2-135M's layer shapes
(q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536), activations
``[batch, tokens, K]`` for batch x tokens from 1 to 4096 rows, and Llama-3.1 8B's qkv layer
at 129 to 2048 rows, bf16 and fp16, W4A16 and W4A4,
through the automatic dispatch (which picks gemv6, the Gluon mma, wgmma or warp-specialized
kernel, the tiled GEMM or dequantize + cuBLAS by rows) against the PyTorch reference
backend. Records the path each call took and the relative error (< 1e-2).
Then fp16 timings on two Llama shapes (M = 1, 2, 16): the dispatch (the Gluon
kernel) against the fp16 paths it replaced (gemv4, the tiled GEMM) and cuBLAS fp16.

    python3 benchmarks/gpu_module_check_h200.py   # $OUT/gpu_module_check_h200.json
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch


def main() -> int:
    from fp4ptq import kernels, nvfp4
    from fp4ptq.kernels import gemm as gm
    from fp4ptq.modules import NVFP4Linear

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = {"q_o": (576, 576), "k_v": (192, 576), "gate_up": (1536, 576), "down": (576, 1536)}
    batches = [(1, 1), (1, 2), (2, 2), (1, 3), (4, 4), (1, 16), (2, 8), (8, 8), (2, 32), (1, 65), (4, 32), (4, 128),
               (8, 512)]
    # and a Llama-3.1 8B qkv layer at the rows where the warp-specialized kernel takes it, whole tiles and
    # split tails (129, 300, 1024), W4A4 beyond (2048)
    cases = [(name, n, k, batches) for name, (n, k) in shapes.items()]
    cases.append(("8B.qkv", 6144, 4096, [(1, 129), (2, 150), (4, 256), (2, 1024)]))
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": [], "warnings": []}
    worst = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, n, k, batch_list in cases:
            for dtype, scheme in [(dt, sc) for dt in (torch.bfloat16, torch.float16) for sc in ("w4a16", "w4a4")]:
                w = torch.randn(n, k, device=dev, generator=g) * 0.05
                bias = torch.randn(n, device=dev, generator=g).to(dtype)
                wq = nvfp4.quantize(w.to(dtype))
                amax = torch.tensor(3.0, device=dev)
                mod = NVFP4Linear.from_quantized(wq, bias, scheme=scheme, input_amax=amax if scheme == "w4a4" else None)
                for b, t in batch_list:
                    x = torch.randn(b, t, k, device=dev, generator=g).to(dtype)
                    y = mod(x)
                    if scheme == "w4a4":
                        ref = kernels.linear_w4a4(x.float(), wq, mod.input_amax(), bias.float(), backend="reference")
                    else:
                        ref = kernels.linear_w4a16(x.float(), wq, bias.float(), backend="reference")
                    err = float((y.float() - ref).norm() / ref.norm())
                    worst = max(worst, err)
                    path = gm._auto_path(b * t, x.dtype, scheme == "w4a4", k, dev, n)
                    row = {"layer": name, "n": n, "k": k, "dtype": str(dtype), "scheme": scheme, "batch": b,
                           "tokens": t, "rows": b * t,
                           "path": path, "shape_ok": list(y.shape) == [b, t, n], "rel_err": err}
                    out["rows"].append(row)
                    print(row, flush=True)
        out["warnings"] = [str(w.message)[:300] for w in caught]
    out["worst_rel_err"] = worst
    # fp16 timings (CUDA-graph replays, us per call)
    import sys
    sys.path.insert(0, os.environ.get("PEERS_DIR", ".peers"))
    import peers_h200 as peers

    out["fp16_us"] = []
    for name, (n, k) in {"8B.qkv": (6144, 4096), "70B.gate_up": (57344, 8192)}.items():
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).half()
        wq = nvfp4.quantize(w)
        for m in (1, 2, 16):
            x = torch.randn(m, k, device=dev, generator=g).half()
            row = {"shape": name, "m": m, "dispatch_path": gm._auto_path(m, x.dtype, False, k, dev, n),
                   "dispatch": 1000 * peers.bench(lambda: gm.linear_w4a16(x, wq)),
                   "cublas_fp16": 1000 * peers.bench(lambda: x @ w.t())}
            row["old_path"] = "gemv4" if m <= 2 else "gemm"
            row["old"] = 1000 * peers.bench(lambda: gm.linear_w4a16(x, wq, path=row["old_path"]))
            out["fp16_us"].append(row)
            print(row, flush=True)
    out["all_ok"] = worst < 1e-2 and all(r["shape_ok"] for r in out["rows"])
    print("worst", worst, "all_ok", out["all_ok"], "paths", sorted({r["path"] for r in out["rows"]}), flush=True)
    Path(os.environ.get("OUT", "."), "gpu_module_check_h200.json").write_text(json.dumps(out, indent=1))
    return 0 if out["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
