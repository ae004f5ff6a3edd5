"""Run-to-run determinism of every GEMM path the dispatch picks: the same input through the same
layer again and again must give the same bits. Between calls the caching allocator's free memory
is filled with random bytes (a kernel that read its output buffer, a workspace or a tile past its
end before writing would then change its result), and other kernels run.

    PYTHONPATH=$PWD python benchmarks/determinism_h200.py   # $OUT/determinism_h200.json

Knobs: MS (1,2,16,512), TRIALS (30), SHAPES (a comma-separated subset of ``SHAPES``'s names; default the
seven Llama-3.1 layers).
"""
from __future__ import annotations

import json
import os

import torch

from fp4ptq import nvfp4
from fp4ptq.kernels import gemm

OUT = os.environ.get("OUT", "/tmp")
MS = [int(m) for m in os.environ.get("MS", "1,2,16,512").split(",")]
TRIALS = int(os.environ.get("TRIALS", 30))
SHAPES = {"8B.q": (4096, 4096), "8B.k": (1024, 4096), "8B.gate": (14336, 4096), "8B.down": (4096, 14336),
          "8B.qkv": (6144, 4096), "8B.gate_up": (28672, 4096), "70B.down": (8192, 28672),
          # K % 256 != 0 (the padded scale copy of the warp-specialized GEMM); a wide K = 3072 layer
          "Qwen2-72B.down": (8192, 29568), "Phi-3-mini.qkv": (9216, 3072)}
DEFAULT_SHAPES = "8B.q,8B.k,8B.gate,8B.down,8B.qkv,8B.gate_up,70B.down"
_unknown = set(os.environ.get("SHAPES", DEFAULT_SHAPES).split(",")) - set(SHAPES)
if _unknown:
    raise SystemExit(f"SHAPES: unknown layer(s) {sorted(_unknown)}; known: {', '.join(SHAPES)}")
SHAPES = {name: SHAPES[name] for name in os.environ.get("SHAPES", DEFAULT_SHAPES).split(",")}
dev = torch.device("cuda")


def garbage(nbytes: int = 1 << 28) -> None:
    """Fill that much of the allocator's memory with random bytes, then free it for the next tensors."""
    blob = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    blob.random_(0, 256)
    del blob


def main():
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        q = nvfp4.quantize(w)
        del w
        for m in MS:
            x = (torch.randn(m, k, device=dev, generator=g) * torch.rand(1, k, device=dev, generator=g) * 4).to(torch.bfloat16)
            amax = x.float().abs().amax() * 0.7  # some activations beyond the static scale, as in use
            for scheme, fn in (("w4a16", lambda: gemm.linear_w4a16(x, q)),
                               ("w4a4", lambda: gemm.linear_w4a4(x, q, amax))):
                first = fn().clone()
                bad, worst = 0, 0.0
                for t in range(TRIALS):
                    if t % 2:
                        garbage()
                    y = fn()
                    if not torch.equal(y.view(torch.int16), first.view(torch.int16)):
                        bad += 1
                        worst = max(worst, float((y.float() - first.float()).abs().max()))
                row = {"layer": name, "n": n, "k": k, "m": m, "scheme": scheme,
                       "path": gemm._auto_path(m, torch.bfloat16, scheme == "w4a4", k, dev, n),
                       "trials": TRIALS, "mismatching_trials": bad, "max_abs_diff": worst,
                       "finite": bool(torch.isfinite(first.float()).all())}
                rows.append(row)
                print(row, flush=True)
        torch.cuda.empty_cache()
    bad = [r for r in rows if r["mismatching_trials"] or not r["finite"]]
    print(f"{len(rows)} cases, {len(bad)} not deterministic or not finite")
    with open(os.path.join(OUT, "determinism_h200.json"), "w") as f:
        json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
