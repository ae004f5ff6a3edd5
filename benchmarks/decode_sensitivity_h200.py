"""How far teacher-forced decoding of a quantized checkpoint moves when nothing but rounding changes: the
decoding path of ``smollm2_gpu_eval_h200.py`` (one token a forward, KV cache, bfloat16) through the kernels
and through the reference backend, each also with the embedding outputs nudged by one bf16 unit in the last
place (a forward hook on ``embed_tokens``; the tied ``lm_head`` is untouched). If kernels against reference
differ about as much as the reference against its own nudged run, the difference is the model's sensitivity
to rounding (W4A4 re-quantizes every layer's input), not an error of the kernels.

    PYTHONPATH=$PWD python3 benchmarks/decode_sensitivity_h200.py CKPT   # $OUT/decode_sensitivity_h200.json

On the CPU too (`DEVICE=cpu`: there the kernels ways are the reference, so pass
`WAYS="reference,reference nudged"`; the committed results are such runs, at `DECODE_SEQLEN=512`).

Knobs: DATA_DIR (.evaldata), DECODE_WINDOWS (1), DECODE_SEQLEN (256), WAYS.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DECODE_WINDOWS", "1")
os.environ.setdefault("DECODE_SEQLEN", "256")
import torch  # noqa: E402

import e2e_decode_h200 as e2e  # noqa: E402
import smollm2_gpu_eval_h200 as ev  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")


def nudge(module, inputs, output):
    """One unit in the last place more magnitude on every non-zero bf16 embedding output."""
    bits = output.view(torch.int16)
    return (bits + (output != 0).to(torch.int16)).view(output.dtype)


def main():
    import fp4ptq
    from fp4ptq.eval.perplexity import load_corpus
    from transformers import AutoTokenizer

    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: decode_sensitivity_h200.py CKPT (an fp4ptq checkpoint directory)")
    ckpt = sys.argv[1]
    tok = AutoTokenizer.from_pretrained(ckpt)
    corpus = load_corpus("wikitext", ev.DATA)
    ids = torch.tensor(tok(corpus.stream, verbose=False)["input_ids"], dtype=torch.long)
    runs = {}
    for way in os.environ.get("WAYS", "kernels,reference,reference nudged,kernels nudged").split(","):
        model = fp4ptq.load(ckpt, device=ev.DEVICE, dtype=torch.bfloat16)
        hook = model.model.embed_tokens.register_forward_hook(nudge) if "nudged" in way else None
        started = time.perf_counter()
        if way.startswith("reference"):
            with e2e.reference_backend():
                runs[way] = ev.decode_nll(model, ids)
        else:
            runs[way] = ev.decode_nll(model, ids)
        runs[way]["seconds"] = round(time.perf_counter() - started, 1)
        if hook is not None:
            hook.remove()
        del model
        print(way, runs[way]["seconds"], flush=True)
    res = {"ckpt": os.path.basename(ckpt), "windows": ev.DECODE_WINDOWS, "seqlen": ev.DECODE_SEQLEN,
           "ppl": {w: float(r["nll"].mean().exp()) for w, r in runs.items()}, "pairs": {}}
    names = list(runs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            res["pairs"][f"{a} / {b}"] = ev.agreement(runs[a], runs[b])
    print(json.dumps(res, indent=1))
    with open(os.path.join(OUT, "decode_sensitivity_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
