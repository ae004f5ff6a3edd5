"""``model.generate`` as a transformers user runs it, on the Llama-3.1-8B-shaped model of
``e2e_decode_h200.py`` (random weights), bf16 and RTN W4A16: plain (dynamic cache, eager), with a
static cache, and with a static cache plus ``model.forward = torch.compile(model.forward,
mode="reduce-overhead")`` (the README's recipe). Per variant: the first call (compiles), then the
time of a second call of NEW tokens after a PROMPT-token prompt, and whether its tokens equal the
plain eager call's.

    PYTHONPATH=$PWD python benchmarks/generate_h200.py   # $OUT/generate_h200.json

Knobs: PROMPT (512), NEW (128), SCHEMES (bf16,w4a16; "w4a16+fused": q/k/v and gate/up fused,
``fp4ptq.fuse_projections``), VARIANTS (eager,static,static+compile), LAYERS (32), CALLS (1 timed call
after the first; more: the median, each call's time kept), NAME (generate_h200: the output file's stem),
PROFILE (0; 1: one more call under torch.profiler, its GPU kernel time by kind against its wall time,
and Dynamo's counters: graphs, graph breaks, recompiles).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_decode_h200 as e2e  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
PROMPT = int(os.environ.get("PROMPT", 512))
NEW = int(os.environ.get("NEW", 128))
SCHEMES = os.environ.get("SCHEMES", "bf16,w4a16").split(",")
VARIANTS = os.environ.get("VARIANTS", "eager,static,static+compile").split(",")
CALLS = int(os.environ.get("CALLS", 1))
NAME = os.environ.get("NAME", "generate_h200")
PROFILE = os.environ.get("PROFILE", "0") == "1"


def sync():
    if e2e.dev.type == "cuda":
        torch.cuda.synchronize()


def generate(model, ids, **kwargs):
    sync()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kwargs)
    sync()
    return out[:, ids.shape[1]:], time.perf_counter() - t0


def main():
    res = {"env": e2e.env(), "prompt": PROMPT, "new_tokens": NEW, "rows": []}
    base = e2e.build_model()
    ids = torch.randint(0, e2e.SIZES["vocab_size"], (1, PROMPT), device=e2e.dev,
                        generator=torch.Generator(device=e2e.dev).manual_seed(1))
    for scheme in SCHEMES:
        model = base if scheme == "bf16" else e2e.quantized(base, scheme)[0]
        forward = model.forward
        plain = None
        for variant in VARIANTS:
            if variant == "static+compile" and e2e.dev.type != "cuda":
                continue
            row = {"scheme": scheme, "variant": variant}
            try:
                model.forward = forward
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                kwargs = {}
                if variant != "eager":
                    kwargs["cache_implementation"] = "static"
                if variant == "static+compile":
                    model.forward = torch.compile(forward, mode="reduce-overhead")
                _, row["first_call_s"] = generate(model, ids, **kwargs)
                timed = [generate(model, ids, **kwargs) for _ in range(CALLS)]
                tokens = timed[0][0]
                seconds = sorted(t for _, t in timed)[len(timed) // 2]
                row.update(seconds=seconds, tokens_per_s=NEW / seconds)
                if CALLS > 1:
                    row["calls_s"] = [t for _, t in timed]
                    row["tokens_repeat"] = all(bool((t == tokens).all()) for t, _ in timed)
                if PROFILE:
                    from torch._dynamo.utils import counters

                    wall = []
                    row.update(e2e.kernel_breakdown(lambda: wall.append(generate(model, ids, **kwargs)[1])))
                    row["profiled_call_s"] = wall[-1]
                    row["dynamo_counters"] = {k: dict(v) for k, v in counters.items()
                                              if k in ("stats", "graph_break", "recompiles", "unimplemented")}
                if variant == "eager":
                    plain = tokens
                elif plain is not None:
                    row["tokens_equal_eager"] = float((tokens == plain).float().mean())
            except Exception as exc:  # noqa: BLE001 - keep the other rows
                row["error"] = f"{type(exc).__name__}: {exc}"[:1500]
                row["traceback"] = traceback.format_exc()[-3000:]
            res["rows"].append(row)
            print({k: v for k, v in row.items() if k != "traceback"}, flush=True)
            with open(os.path.join(OUT, NAME + ".json"), "w") as f:
                json.dump(res, f, indent=1)
        model.forward = forward
        if scheme != "bf16":
            del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
