"""Do CUDA-graph replays of a decode step follow the eager steps, step by step, for the model with and
without ``fp4ptq.fuse_projections``? (``e2e_decode_h200.py`` compares the first step's logits and the
tokens of 8 steps; this compares every step's logits, over several eager runs and graph runs from
the same prefill.) Llama-3.1-8B-shaped model, RTN W4A16 (and W4A4), batch 1.

    PYTHONPATH=$PWD python benchmarks/fusion_graph_check_h200.py   # $OUT/fusion_graph_check_h200.json
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_decode_h200 as e2e  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
STEPS = int(os.environ.get("STEPS", 12))
RUNS = int(os.environ.get("RUNS", 3))
SCHEMES = os.environ.get("SCHEMES", "w4a16,w4a16+fused").split(",")


def run(d, step, forced=None):
    """Prefill, then STEPS steps; with ``forced`` the tokens fed back are those (teacher forcing, so
    every run sees the same inputs); the logits of every step."""
    d.prefill()
    logits = []
    for i in range(STEPS):
        if forced is not None:
            d.tok.copy_(forced[i])
        step()
        logits.append(d.logits.clone())
    return logits


def main():
    res = {"env": e2e.env(), "steps": STEPS, "runs": RUNS, "models": {}}
    if os.environ.get("PLANS") == "0":  # the dispatch on every call instead of the layers' launch plans
        from fp4ptq import modules
        modules.LAUNCH_PLANS = False
        res["plans"] = False
    base = e2e.build_model()
    with torch.no_grad():
        for scheme in SCHEMES:
            model = base if scheme == "bf16" else e2e.quantized(base, scheme)[0]
            d = e2e.Decoder(model, 1)
            first = run(d, d.step)
            tokens = []
            d.prefill()
            for i in range(STEPS):
                tokens.append(d.tok.clone())
                d.step()
            eager = [run(d, d.step, tokens) for _ in range(RUNS)]
            graph = e2e.capture_step(d)
            graphs = [run(d, graph.replay, tokens) for _ in range(RUNS)]
            ref = eager[0]

            def diffs(runs):
                return [[0.0 if torch.equal(a, b) else float((a - b).norm() / b.norm()) for a, b in zip(r, ref)]
                        for r in runs]
            res["models"][scheme] = {"eager_vs_eager0": diffs(eager[1:]), "graph_vs_eager0": diffs(graphs),
                                     "free_running_first_vs_forced": float((first[0] - ref[0]).norm() / ref[0].norm())}
            print(scheme, res["models"][scheme], flush=True)
            del graph, d
            if scheme != "bf16":
                del model
            torch.cuda.empty_cache()
    with open(os.path.join(OUT, "fusion_graph_check_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
