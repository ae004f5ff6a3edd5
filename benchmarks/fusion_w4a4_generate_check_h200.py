"""Why did W4A4 ``generate`` tokens differ between the fused and unfused loads of one checkpoint
(load_fusion_check_h200.py: 3 of 16 equal, W4A16 16 of 16)? A LAYERS-block 8B-shaped W4A4 model,
saved and loaded unfused twice and fused, each generating 16 greedy tokens after a 16-token prompt
with plans on and off (``fp4ptq.modules.LAUNCH_PLANS``): per pair, the first step whose logits differ
and the relative difference there; then one decode step's layer outputs, fused against unfused.

    PYTHONPATH=$PWD python benchmarks/fusion_w4a4_generate_check_h200.py   # $OUT/fusion_w4a4_generate_check_h200.json
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("LAYERS", "4")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import e2e_decode_h200 as e2e  # noqa: E402
import fp4ptq  # noqa: E402
from fp4ptq import modules  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
SCHEME = os.environ.get("SCHEME", "w4a4")


def steps(model, ids, plans: bool):
    modules.LAUNCH_PLANS = plans
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:], torch.stack(out.logits).float()


def compare(a, b) -> dict:
    (ta, la), (tb, lb) = a, b
    diff = [i for i in range(la.shape[0]) if not torch.equal(la[i], lb[i])]
    first = diff[0] if diff else None
    return {"tokens_equal": float((ta == tb).float().mean()), "first_differing_step": first,
            "rel_diff_there": None if first is None else e2e.rel(la[first], lb[first])}


def main():
    res = {"env": e2e.env(), "scheme": SCHEME}
    base = e2e.build_model()
    ids = torch.randint(0, e2e.SIZES["vocab_size"], (1, 16), device=e2e.dev,
                        generator=torch.Generator(device=e2e.dev).manual_seed(2))
    model = e2e.quantized(base, SCHEME)[0]
    del base
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        fp4ptq.save(model.cpu(), path)
        del model
        a = fp4ptq.load(path, device=e2e.dev, fuse=False)
        a2 = fp4ptq.load(path, device=e2e.dev, fuse=False)
        b = fp4ptq.load(path, device=e2e.dev, fuse=True)
        runs = {}
        for plans in (True, False):
            for name, m in (("unfused", a), ("unfused again", a2), ("fused", b)):
                runs[(name, plans)] = steps(m, ids, plans)
        for plans in (True, False):
            tag = "plans" if plans else "no plans"
            res[f"unfused vs unfused again, {tag}"] = compare(runs[("unfused", plans)], runs[("unfused again", plans)])
            res[f"unfused vs fused, {tag}"] = compare(runs[("unfused", plans)], runs[("fused", plans)])
        res["unfused: plans vs no plans"] = compare(runs[("unfused", True)], runs[("unfused", False)])
        res["fused: plans vs no plans"] = compare(runs[("fused", True)], runs[("fused", False)])
        # one decode step's q/k/v and gate/up outputs, fused against unfused, on the same inputs
        modules.LAUNCH_PLANS = True
        seen = {}

        def hook(name):
            def record(module, inputs, output):
                seen.setdefault(name, []).append((inputs[0].detach().clone(), output.detach().clone()))
            return record
        handles = []
        for label, m in (("a", a), ("b", b)):
            for n, mod in m.named_modules():
                if isinstance(mod, fp4ptq.NVFP4Linear):
                    handles.append(mod.register_forward_hook(hook(f"{label}:{n}")))
        tok = runs[("unfused", True)][0][:1].view(1, 1)
        full = torch.cat([ids, tok], 1)
        with torch.no_grad():
            for m in (a, b):
                m(full)  # the same 17 tokens, no cache: compare per layer
        for h in handles:
            h.remove()
        layers = {}
        for key, val in seen.items():
            if key.startswith("a:"):
                n = key[2:]
                (xa, ya), (xb, yb) = val[0], seen["b:" + n][0]
                layers[n] = {"input_equal": torch.equal(xa, xb), "output_equal": torch.equal(ya, yb),
                             "rel": e2e.rel(yb, ya)}
        res["layers_at_17_rows"] = layers
    print(json.dumps({k: v for k, v in res.items() if k != "layers_at_17_rows"}, indent=1))
    print({k: v for k, v in list(res["layers_at_17_rows"].items())[:14]})
    with open(os.path.join(OUT, "fusion_w4a4_generate_check_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
