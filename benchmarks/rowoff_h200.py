"""gemv6 / gemv7 with 32-bit row offsets against the build before (64-bit), at M = 1 through the
dispatch: outputs compared bit for bit, then 5 interleaved rounds of CUDA-graph replays (medians).
The build before is ``fp4ptq/kernels/_gemm_before.py``, an untracked copy of the previous gemm.py
(``git show HEAD~1:fp4ptq/kernels/gemm.py > fp4ptq/kernels/_gemm_before.py`` before the run).

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/rowoff_h200.py   # $OUT/rowoff_h200.json
"""
import json
import os
import statistics

import torch

import peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm

try:
    from fp4ptq.kernels import _gemm_before as before
except ImportError:
    raise SystemExit("rowoff_h200.py compares against fp4ptq/kernels/_gemm_before.py, which is not there: "
                     "git show <commit>:fp4ptq/kernels/gemm.py > fp4ptq/kernels/_gemm_before.py first") from None

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(3)
ROUNDS = int(os.environ.get("ROUNDS", "5"))
LAYERS = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
          "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672), "Qwen2-72B.down": (8192, 29568),
          "Qwen2-7B.down": (3584, 18944), "Llama-2-7B.down": (4096, 11008), "SmolLM2.gate_up": (3072, 576)}
W4A4 = ("8B.down", "70B.down", "70B.gate_up")
out = {"env": peers.env(), "rows": []}
for name, (n, k) in LAYERS.items():
    wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    x = torch.randn(1, k, device=dev, generator=g).bfloat16()
    amax = x.float().abs().amax() * 1.5
    fns = {"before": lambda: before.linear_w4a16(x, wq), "after": lambda: gm.linear_w4a16(x, wq)}
    if name in W4A4:
        fns.update({"w4a4_before": lambda: before.linear_w4a4(x, wq, amax),
                    "w4a4_after": lambda: gm.linear_w4a4(x, wq, amax)})
    row = {"layer": name, "n": n, "k": k, "path": gm._auto_path(1, torch.bfloat16, False, k, dev, n),
           "gemv7": gm._gemv7_config(1, n, k)}
    ref = x.float() @ wq.dequantize(torch.float32).T
    row["equal"] = bool(torch.equal(fns["before"](), fns["after"]()))
    row["rel_ref"] = float((fns["after"]().float() - ref).norm() / ref.norm())
    if name in W4A4:
        row["equal_w4a4"] = bool(torch.equal(fns["w4a4_before"](), fns["w4a4_after"]()))
    times = {}
    for _ in range(ROUNDS):
        for label, fn in fns.items():
            times.setdefault(label, []).append(peers.bench(fn) * 1e3)
    row["median_us"] = {a: statistics.median(b) for a, b in times.items()}
    row["all_us"] = times
    row["after_over_before"] = row["median_us"]["after"] / row["median_us"]["before"]
    out["rows"].append(row)
    print(json.dumps({a: row[a] for a in ("layer", "path", "equal", "rel_ref", "median_us", "after_over_before")}),
          flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "rowoff_h200.json"), "w"), indent=1)
