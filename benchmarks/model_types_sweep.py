"""Every causal-LM model type the installed transformers registers, as a tiny random
model from its own config class: does fp4ptq quantize it (RTN and GPTQ, W4A16), save
it, load it back with the same logits? Writes which pass and, for the others, the
stage and the error (`benchmarks/results/model_types_sweep.{json,md}`).

    python benchmarks/model_types_sweep.py [--types llama,qwen3_moe] [--timeout 120]
    python benchmarks/model_types_sweep.py --update   # re-run the types that failed in fp4ptq's stages

Each model type runs in its own subprocess (a hang or crash is recorded, not fatal).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# Small sizes most config classes accept; families that need more are given it below.
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
             num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# Multimodal types whose vision tower defaults to a full-size one (SigLIP-400M for Gemma 3: it timed out):
# a small one, and the text sizes given to their text config (the top-level keys do not reach it).
_TEXT = {k: v for k, v in SMALL.items() if k not in ("pad_token_id", "bos_token_id", "eos_token_id")}
PER_TYPE = {
    # families whose config names its sizes otherwise (the defaults are full-size models: they timed out)
    "cpmant": dict(SMALL, dim_head=16, dim_ff=96, position_bias_num_buckets=32, position_bias_max_distance=64,
                   prompt_length=4),
    "hy_v4": dict(SMALL, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16,
                  v_head_dim=16, index_head_dim=16, index_n_heads=2, index_topk=8, n_shared_experts=1),
    "gemma3": dict(text_config=_TEXT, mm_tokens_per_image=4,
                   vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, image_size=32, patch_size=8)),
}


def check_type(model_type: str, small: dict | None = None, methods=("rtn", "gptq")) -> dict:
    """One model type, in this process: a tiny random model of its config class (``small``, default
    PER_TYPE's or SMALL), quantized with each method (W4A16), saved, loaded back with the same logits.
    ``{"ok": True, "quantized": n, "kept": {name: reason}}`` or ``{"ok": False, "stage", "error"}``."""
    import traceback
    import warnings

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import fp4ptq
    from fp4ptq import QuantConfig

    small = small if small is not None else PER_TYPE.get(model_type, SMALL)
    stage = "config"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.for_model(model_type, **small)
            stage = "build"
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).eval()
            vocab = min(int(getattr(config, "vocab_size", 128) or 128), 128)
            ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                model(ids)
            for method in methods:
                stage = f"quantize {method}"
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(config).eval()
                fp4ptq.quantize(model, QuantConfig(method=method), ids, progress=False)
                with torch.no_grad():
                    expected = model(ids).logits
                stage = f"save {method}"
                with tempfile.TemporaryDirectory() as d:
                    fp4ptq.save(model, d + "/ckpt")
                    stage = f"load {method}"
                    loaded = fp4ptq.load(d + "/ckpt", device="cpu", dtype=torch.float32)
                    with torch.no_grad():
                        got = loaded(ids).logits
                if not torch.equal(got, expected):
                    raise AssertionError(f"logits after loading differ by {float((got - expected).abs().max()):.3g}")
        info = model.fp4ptq_info
        return {"ok": True, "quantized": len(info["layers"]),
                "kept": {k: v for k, v in info["high_precision"].items() if k != "lm_head"}}
    except Exception as exc:  # noqa: BLE001 - the sweep records every failure
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f" (at {'/'.join(Path(frame.filename).parts[-2:])}:{frame.lineno})"
        return {"ok": False, "stage": stage, "error": f"{type(exc).__name__}: {str(exc)[:300]}{where}"}


# Each type in its own process (a hang or crash is recorded, not fatal).
ONE = r'''
import json, sys
sys.path.insert(0, sys.argv[3])
from model_types_sweep import check_type
print(json.dumps(check_type(sys.argv[1], json.loads(sys.argv[2]))))
'''


def causal_lm_types() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _tail(stderr, lines: int = 6) -> str:
    """The last lines of a crashed or timed-out run's stderr (its cause), one line of text."""
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    kept = [ln.strip() for ln in (stderr or "").strip().splitlines() if ln.strip()][-lines:]
    return " / ".join(kept)[-600:] or "(empty)"


def run_one(model_type: str, timeout: float) -> dict:
    started = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-c", ONE, model_type, json.dumps(PER_TYPE.get(model_type, SMALL)),
                              str(HERE)],
                             capture_output=True, text=True, timeout=timeout)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        result = json.loads(lines[-1]) if lines else {
            "ok": False, "stage": "process",
            "error": f"exit status {out.returncode} with no result; stderr: {_tail(out.stderr)}"}
    except subprocess.TimeoutExpired as exc:
        result = {"ok": False, "stage": "process",
                  "error": f"timed out after {timeout:.0f} s; stderr: {_tail(exc.stderr)}"}
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def markdown(results: dict) -> str:
    passed = [t for t, r in results.items() if r["ok"]]
    lines = [f"# fp4ptq on every causal-LM model type of transformers (tiny random models)", "",
             f"{len(passed)} of {len(results)} pass (RTN and GPTQ W4A16 quantize, save, load, same logits).", "",
             "| model type | result | quantized linears | kept in high precision / error |", "|---|---|---|---|"]
    for name, r in results.items():
        if r["ok"]:
            kept = "; ".join(f"{k}: {v}" for k, v in list(r["kept"].items())[:2]) or ""
            lines.append(f"| {name} | pass | {r['quantized']} | {kept} |")
        else:
            error = str(r["error"]).replace("|", "/").replace("\n", " ")[:300]
            lines.append(f"| {name} | fails at {r['stage']} | | {error} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", help="comma-separated model types (default: every causal-LM type)")
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--output", default=str(RESULTS / "model_types_sweep"))
    parser.add_argument("--update", action="store_true",
                        help="re-run --types (default: those that failed in fp4ptq's stages) into the existing results")
    args = parser.parse_args()
    out = Path(args.output)
    if args.update and not out.with_suffix(".json").exists():
        parser.error(f"--update re-runs into existing results, and {out.with_suffix('.json')} does not exist: "
                     "run once without --update first (or give --output)")
    results = json.loads(out.with_suffix(".json").read_text())["results"] if args.update else {}
    ours = ("quantize", "save", "load", "process")
    types = (args.types.split(",") if args.types else
             [t for t, r in results.items() if not r["ok"] and r["stage"].startswith(ours)] if args.update
             else causal_lm_types())
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = lambda x, **k: x  # noqa: E731
    for model_type in tqdm(types, desc="model types"):
        results[model_type] = run_one(model_type, args.timeout)
    import transformers

    results = dict(sorted(results.items()))
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"transformers": transformers.__version__, "small_config": SMALL, "results": results}
    with tempfile.NamedTemporaryFile("w", dir=out.parent, delete=False, suffix=".tmp") as f:
        json.dump(payload, f, indent=1)
    Path(f.name).replace(out.with_suffix(".json"))
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results).splitlines()[2])


if __name__ == "__main__":
    main()
