"""``fp4ptq.fuse_projections`` on the H200, on the Llama-3.1-8B-shaped model of ``e2e_decode_h200.py``
(random weights, RTN W4A16 and W4A4): (1) block 0's fused groups against their layers run alone
(relative error of each layer's slice, and whether it is bit-equal), M = 1, 2, 16, 128, 512; (2) the
hidden states after blocks 1, 2, 4, 8, 16, 32 and the logits, fused against unfused, next to the same
comparison between the unfused model and itself with the embeddings nudged by one bf16 ulp (how far
rounding differences grow through this random-weight model); (3) the host and GPU time of block 0's
q/k/v and gate/up calls, fused and alone (enqueue of back-to-back calls, and wall time with a
synchronize), interleaved rounds, medians.

    PYTHONPATH=$PWD python benchmarks/fusion_check_h200.py   # $OUT/fusion_check_h200.json
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_decode_h200 as e2e  # noqa: E402
import fp4ptq  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
ROUNDS = int(os.environ.get("ROUNDS", 3))
TIME_MS = [int(m) for m in os.environ.get("TIME_MS", "1,512").split(",")]
PARTS = os.environ.get("PARTS", "layers,model,timing").split(",")
dev = e2e.dev


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def alone(layer, x):
    fused, layer._fused = layer._fused, None
    try:
        return layer(x)
    finally:
        layer._fused = fused


def groups_of(block):
    return {"qkv": [block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj],
            "gate_up": [block.mlp.gate_proj, block.mlp.up_proj]}


def sync():
    if dev.type == "cuda":  # (TINY=1 on a CPU checks the script)
        torch.cuda.synchronize()


def timing(fn, calls=50):
    for _ in range(5):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    walls = []
    for _ in range(calls):
        sync()
        s = time.perf_counter()
        fn()
        sync()
        walls.append(time.perf_counter() - s)
    return (t1 - t0) * 1e6 / calls, statistics.median(walls) * 1e6, (t2 - t0) * 1e6 / calls


def main():
    res = {"env": e2e.env(), "layers": [], "model": {}, "timing": []}
    base = e2e.build_model()
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, e2e.SIZES["vocab_size"], (1, 64), device=dev, generator=g)
    for scheme in ("w4a16", "w4a4"):
        plain = e2e.quantized(base, scheme)[0]
        fused = copy.deepcopy(plain)
        report = fp4ptq.fuse_projections(fused)
        res["model"][scheme] = {"fusion": report}
        block = fused.model.layers[0]
        with torch.no_grad():
            for m in ((1, 2, 16, 128, 512) if "layers" in PARTS else ()):
                x = torch.randn(1, m, e2e.SIZES["hidden_size"], device=dev, dtype=torch.bfloat16, generator=g)
                for name, members in groups_of(block).items():
                    for _ in range(3):  # plans built, captured, replayed
                        outs = [layer(x) for layer in members]
                    for layer, y in zip(members, outs):
                        ref = alone(layer, x)
                        row = {"scheme": scheme, "m": m, "group": name, "layer": layer.out_features,
                               "rel_err": rel(y, ref), "bit_equal": bool(torch.equal(y, ref))}
                        res["layers"].append(row)
                print(scheme, m, [(r["group"], round(r["rel_err"], 5), r["bit_equal"]) for r in res["layers"]
                                  if r["scheme"] == scheme and r["m"] == m], flush=True)
            # the whole model
            if "model" in PARTS:
                emb = plain.model.embed_tokens.weight
                a = plain(ids, output_hidden_states=True)
                b = fused(ids, output_hidden_states=True)
                saved = emb.data.clone()
                emb.data.copy_(emb.data + (emb.data.abs() * 2.0 ** -8).to(emb.dtype) * torch.sign(emb.data))
                c = plain(ids, output_hidden_states=True)
                emb.data.copy_(saved)
                picks = sorted({i for i in (1, 2, 4, 8, 16) if i < len(a.hidden_states)} | {len(a.hidden_states) - 1})
                res["model"][scheme].update({
                    "fused_vs_unfused": {f"block {i}": rel(b.hidden_states[i], a.hidden_states[i]) for i in picks}
                    | {"logits": rel(b.logits, a.logits)},
                    "nudged_vs_unfused": {f"block {i}": rel(c.hidden_states[i], a.hidden_states[i]) for i in picks}
                    | {"logits": rel(c.logits, a.logits)}})
                print(scheme, res["model"][scheme], flush=True)
            # time block 0's groups
            pblock = plain.model.layers[0]
            for m in (TIME_MS if "timing" in PARTS else ()):
                x = torch.randn(1, m, e2e.SIZES["hidden_size"], device=dev, dtype=torch.bfloat16, generator=g)
                for name in ("qkv", "gate_up"):
                    variants = {"alone": lambda: [layer(x) for layer in groups_of(pblock)[name]],
                                "fused": lambda: [layer(x) for layer in groups_of(block)[name]]}
                    times: dict = {}
                    for _ in range(ROUNDS):
                        for label, fn in variants.items():
                            times.setdefault(label, []).append(timing(fn))
                    med = {label: [round(statistics.median(t[i] for t in ts), 2) for i in range(3)]
                           for label, ts in times.items()}
                    from fp4ptq.kernels import gemm
                    paths = {layer.out_features: gemm._auto_path(m, torch.bfloat16, scheme == "w4a4", layer.in_features,
                                                                 dev, layer.out_features)
                             for layer in groups_of(pblock)[name] + [groups_of(block)[name][0]._fused[0].module]}
                    res["timing"].append({"scheme": scheme, "m": m, "group": name,
                                          "enqueue_wall_throughput_us": med, "paths_by_rows": paths})
                    print(scheme, m, name, "enqueue / wall / back-to-back us:", med, paths, flush=True)
        del plain, fused
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "fusion_check_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
