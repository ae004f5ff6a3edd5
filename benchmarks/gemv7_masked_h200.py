"""gemv7 on layers whose K the 128-block steps do not divide: 4 warps with 128-block steps ("old")
against 256-block steps ("new"), 5 interleaved rounds (medians), outputs checked. (The shipped rule
takes whichever pads K less, 256 on a tie, from this run.)

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/gemv7_masked_h200.py   # $OUT/gemv7_masked_h200.json
"""
import json, os, statistics, torch, peers_h200 as peers
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
dev = torch.device("cuda"); g = torch.Generator(device=dev).manual_seed(1)
shipped = gm._gemv7_config
old = lambda m, n, k: (8, 4, 128, 8, False) if (k // 16) % 128 else shipped(m, n, k)
new = lambda m, n, k: (8, 4, 256, 8, False) if (k // 16) % 128 else shipped(m, n, k)
out = []
for name, (n, k) in {"Qwen2-7B.down": (3584, 18944), "Llama-2-7B.down": (4096, 11008), "Qwen2-72B.down": (8192, 29568),
                     "Phi-3-medium.down": (5120, 17920), "Mixtral.w2": (4096, 14336)}.items():
    wq = nvfp4.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02)
    x = torch.randn(1, k, device=dev, generator=g).bfloat16()
    ref = x.float() @ wq.dequantize(torch.float32).T
    fn = lambda: gm.linear_w4a16(x, wq, path="gemv6")
    t = {"old": [], "new": []}
    errs = {}
    for _ in range(5):
        for lab, cfg in (("old", old), ("new", new)):
            gm._gemv7_config = cfg
            y = fn(); errs[lab] = float((y.float() - ref).norm() / ref.norm())
            t[lab].append(peers.bench(fn) * 1e3)
    gm._gemv7_config = shipped
    row = {"layer": name, "n": n, "k": k, "old_cfg": old(1, n, k), "new_cfg": new(1, n, k),
           "median_us": {a: statistics.median(b) for a, b in t.items()}, "all_us": t, "rel_err": errs}
    out.append(row); print(json.dumps({a: row[a] for a in ("layer", "median_us", "rel_err")}), flush=True)
json.dump(out, open(os.path.join(os.environ["OUT"], "gemv7_masked_h200.json"), "w"), indent=1)
