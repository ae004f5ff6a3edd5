"""Plain ``model.generate`` (eager, dynamic cache: what a transformers user runs by default) on the
Llama-3.1-8B-shaped model of ``e2e_decode_h200.py`` (random weights): bf16, RTN W4A16 and W4A4, the
NVFP4 models with their layers' launch plans on and off (``fp4ptq.modules.LAUNCH_PLANS``), in
interleaved rounds (the device's host drifts 30% between runs), medians.

Per round and model: a forward of the PROMPT tokens (prefill, M = PROMPT rows a layer),
``generate(max_new_tokens=1)`` (the prefill and one step) and ``generate(max_new_tokens=NEW)``;
decoding tokens/s = (NEW - 1) / (the difference). Check: the
model's logits on the first 1, 2 and 8 prompt tokens (no cache: every layer at M = 1, 2, 8, the gemv6 /
gemv7 and mma plans), plans on (three calls: built, captured, replayed) against plans off, bit for bit;
and the share of generated tokens equal between rounds, within a variant and between plans on and off
(HF's eager decoding on this stack is not bitwise repeatable at batch 1 even in bf16: session 15).

    PYTHONPATH=$PWD python benchmarks/eager_generate_h200.py   # $OUT/eager_generate_h200.json

Knobs: PROMPT (512), NEW (64), ROUNDS (5), SCHEMES (bf16,w4a16,w4a4), LAYERS (32), PLANS_OFF (1: also time
the NVFP4 models with plans off), FUSED (0; 1: also time each NVFP4 model with its q/k/v and gate/up run as
one GEMM a group, ``fp4ptq.fuse_projections``, its logits compared with the unfused model's).
"""
from __future__ import annotations

import os
import statistics
import time

import e2e_decode_h200 as e2e
import harness
import torch

from fp4ptq import modules

PROMPT = int(os.environ.get("PROMPT", 512))
NEW = int(os.environ.get("NEW", 64))
ROUNDS = int(os.environ.get("ROUNDS", 5))
SCHEMES = os.environ.get("SCHEMES", "bf16,w4a16,w4a4").split(",")
PLANS_OFF = os.environ.get("PLANS_OFF", "1") == "1"
FUSED = os.environ.get("FUSED", "0") == "1"


def generate(model, ids, new: int):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    torch.cuda.synchronize()
    return out[:, ids.shape[1]:], time.perf_counter() - t0


def prefill_forward(model, ids) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model(ids)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def agreement(a: list, b: list) -> float:
    """Mean share of equal tokens over pairs of distinct runs."""
    shares = [float((x == y).float().mean()) for i, x in enumerate(a) for j, y in enumerate(b) if a is not b or i < j]
    return statistics.mean(shares) if shares else float("nan")


def logits_check(model, ids) -> dict:
    out = {}
    with torch.no_grad():
        for t in (1, 2, 8):
            modules.LAUNCH_PLANS = False
            ref = model(ids[:, :t]).logits
            modules.LAUNCH_PLANS = True
            out[f"T={t}"] = all(torch.equal(model(ids[:, :t]).logits, ref) for _ in range(3))
    return out


def main():
    res = {"env": e2e.env(), "prompt": PROMPT, "new_tokens": NEW, "rounds": ROUNDS, "rows": []}
    base = e2e.build_model()
    ids = torch.randint(0, e2e.SIZES["vocab_size"], (1, PROMPT), device=e2e.dev,
                        generator=torch.Generator(device=e2e.dev).manual_seed(1))
    models = {scheme: base if scheme == "bf16" else e2e.quantized(base, scheme)[0] for scheme in SCHEMES}
    variants = [(s, p) for s in SCHEMES for p in ((None,) if s == "bf16" else (True, False) if PLANS_OFF else (True,))]
    if FUSED:
        import copy

        import fp4ptq
        for scheme in [s for s in SCHEMES if s != "bf16"]:
            fused = copy.deepcopy(models[scheme])
            res[f"{scheme}_fusion"] = report = fp4ptq.fuse_projections(fused)
            with torch.no_grad():
                a, b = models[scheme](ids).logits.float(), fused(ids).logits.float()
            report["logits_rel_diff_vs_unfused"] = float((a - b).norm() / a.norm())
            print(scheme, "fused", report, flush=True)
            models[scheme + "+fused"] = fused
            variants.append((scheme + "+fused", True))
    times: dict = {}
    tokens: dict = {}
    for model in models.values():  # warm up: compiles, self-tests, first plans
        generate(model, ids, 4)
    for r in range(ROUNDS):
        for scheme, plans in variants:
            modules.LAUNCH_PLANS = plans is not False
            forward = prefill_forward(models[scheme], ids)
            _, prefill = generate(models[scheme], ids, 1)
            out, full = generate(models[scheme], ids, NEW)
            times.setdefault((scheme, plans), []).append((prefill, full, forward))
            tokens.setdefault((scheme, plans), []).append(out)
        print("round", r, flush=True)
    modules.LAUNCH_PLANS = True
    for (scheme, plans), ts in times.items():
        prefill = statistics.median(t[0] for t in ts)
        decode = [(NEW - 1) / (full - pre) for pre, full, _ in ts]
        row = {"scheme": scheme, "plans": plans, "prefill_forward_ms": 1e3 * statistics.median(t[2] for t in ts),
               "prefill_and_one_token_s": prefill,
               "generate_s": statistics.median(t[1] for t in ts), "decode_tokens_per_s": statistics.median(decode),
               "decode_tokens_per_s_rounds": decode}
        runs = tokens[(scheme, plans)]
        row["token_agreement_between_rounds"] = agreement(runs, runs)
        if plans is True and (scheme, False) in tokens:
            row["token_agreement_with_plans_off"] = agreement(runs, tokens[(scheme, False)])
            row["logits_equal_plans_off"] = logits_check(models[scheme], ids)
        res["rows"].append(row)
        print({k: v for k, v in row.items() if k != "decode_tokens_per_s_rounds"}, flush=True)
    harness.write_json(harness.out_path("eager_generate_h200.json"), res)


if __name__ == "__main__":
    main()
