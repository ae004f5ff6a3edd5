"""``fp4ptq.load`` on CUDA fuses q/k/v and gate/up by default: a Llama-3.1-8B-shaped model (LAYERS
blocks, random weights) quantized by RTN (W4A16 and W4A4), saved, then loaded three ways: the default
(fused), ``fuse=False``, and transformers' ``from_pretrained`` onto the GPU (``device_map``: fused by
fp4ptq's quantizer; on the CPU, TINY=1, ``fuse_projections`` stands in). Per
way: the fusion report, the logits at 1, 16 and 512 rows against the unfused load's (relative error
and equality), and the tokens of a 16-token greedy ``generate`` against the unfused load's.

    PYTHONPATH=$PWD python benchmarks/load_fusion_check_h200.py   # $OUT/load_fusion_check_h200.json

With two GPUs, two more ways: ``from_pretrained`` with a ``device_map`` that puts the first half of
the blocks on ``cuda:0`` and the rest on ``cuda:1`` (fused by default), and the same unfused
(``unfuse_projections``), whose logits should equal the one-GPU unfused load's bit for bit.

Knobs: LAYERS (4), SCHEMES (w4a16,w4a4). Needs transformers' fp4ptq hook (FP4PTQ_TRANSFORMERS_HOOK
not 0) for the from_pretrained way.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

os.environ.setdefault("LAYERS", "4")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import e2e_decode_h200 as e2e  # noqa: E402
import fp4ptq  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
SCHEMES = os.environ.get("SCHEMES", "w4a16,w4a4").split(",")
ROWS = (1, 16, 512)


def fused_layers(model) -> int:
    return sum(isinstance(m, fp4ptq.NVFP4Linear) and m._fused is not None for m in model.modules())


def split_map(layers: int) -> dict:
    """A Llama ``device_map`` with blocks ``0 .. layers/2 - 1`` on GPU 0 and the rest on GPU 1."""
    half = layers // 2
    return {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1,
            **{f"model.layers.{i}": int(i >= half) for i in range(layers)}}


def main():
    from transformers import AutoModelForCausalLM

    res = {"env": e2e.env(), "rows": []}
    base = e2e.build_model()
    gen = torch.Generator(device=e2e.dev).manual_seed(2)
    inputs = {r: torch.randint(0, e2e.SIZES["vocab_size"], (1, r), device=e2e.dev, generator=gen) for r in ROWS}
    for scheme in SCHEMES:
        row = {"scheme": scheme}
        try:
            model = e2e.quantized(base, scheme)[0]
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "ckpt")
                fp4ptq.save(model.cpu(), path)
                del model
                dev = e2e.dev  # (CPU: TINY=1 checks the script, with fuse=True standing in for the default)
                ways = {"unfused": fp4ptq.load(path, device=dev, fuse=False),
                        "load default": fp4ptq.load(path, device=dev, fuse=None if dev.type == "cuda" else True)}
                hf = AutoModelForCausalLM.from_pretrained(path, device_map=dev.type)
                row["from_pretrained report"] = hf.fp4ptq_fusion or fp4ptq.fuse_projections(hf)
                ways["from_pretrained"] = hf
                row["load default report"] = ways["load default"].fp4ptq_fusion
                if dev.type == "cuda" and torch.cuda.device_count() >= 2:
                    dmap = split_map(e2e.SIZES["num_hidden_layers"])
                    two = AutoModelForCausalLM.from_pretrained(path, device_map=dmap)
                    row["from_pretrained 2 GPUs report"] = two.fp4ptq_fusion
                    row["from_pretrained 2 GPUs devices"] = sorted(str(d) for d in
                                                                   fp4ptq.checkpoint.layers_devices(two))
                    ways["from_pretrained 2 GPUs"] = two
                    apart = AutoModelForCausalLM.from_pretrained(path, device_map=dmap)
                    row["from_pretrained 2 GPUs unfused layers"] = fp4ptq.unfuse_projections(apart)
                    ways["from_pretrained 2 GPUs, unfused"] = apart
                ref = {}
                for way, m in ways.items():
                    out = {"fused_layers": fused_layers(m)}
                    with torch.no_grad():
                        for r, ids in inputs.items():
                            logits = m(ids).logits.float()
                            if way == "unfused":
                                ref[r] = logits
                            else:
                                out[f"logits_rel_err_{r}_rows"] = e2e.rel(logits, ref[r])
                                out[f"logits_equal_{r}_rows"] = torch.equal(logits, ref[r])
                        tokens = m.generate(inputs[16], max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, 16:]
                    if way == "unfused":
                        ref["tokens"] = tokens
                    else:
                        out["generate_tokens_equal"] = float((tokens == ref["tokens"]).float().mean())
                    row[way] = out
                del ways, hf
                two = apart = None
        except Exception as exc:  # noqa: BLE001 - keep the other rows
            row["error"] = f"{type(exc).__name__}: {exc}"[:1500]
            row["traceback"] = traceback.format_exc()[-3000:]
        res["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        with open(os.path.join(OUT, "load_fusion_check_h200.json"), "w") as f:
            json.dump(res, f, indent=1)
        if e2e.dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
