"""End-to-end quantization speed and memory on one GPU: a Llama-3.1-8B-shaped
model (sizes from its config, random weights), 128 x 2048 random calibration
tokens, GPTQ and AWQ through ``fp4ptq.quantize`` with the model kept on CPU and
one decoder block at a time on the GPU (the offload path).

Offload proof: the process's GPU memory is capped (``--mem-cap-gb``, default
12 GiB) below the model's own size (about 16 GB in bf16), so a successful run
is a model larger than the usable GPU memory quantized through the offload path.

    python benchmarks/gpu_quantize_8b.py                 # on the GPU machine; JSON to $OUT
    python benchmarks/gpu_quantize_8b.py --tiny          # shrunken check (CPU is fine)
    python benchmarks/gpu_quantize_8b.py --methods gptq --mem-cap-gb 0   # no cap

Writes ``$OUT/gpu_quantize_8b.json`` (or ``--out``) after each method, so a run
cut short keeps what finished. Target (BENCHMARKS.md): <= 5 minutes per method.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

import fp4ptq
from fp4ptq import QuantConfig
from fp4ptq.models import set_module

import harness

# Llama-3.1-8B's published sizes (config.json of meta-llama/Llama-3.1-8B).
LLAMA31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
)
METHODS = {
    "gptq": dict(method="gptq"),
    "awq": dict(method="awq"),
    "gptq-w4a4-mse": dict(method="gptq", scheme="w4a4", four_six="mse"),
    "awq-w4a4-mse": dict(method="awq", scheme="w4a4", four_six="mse"),
}


def build_model(sizes: dict, dtype: torch.dtype, seed: int, fill_device: torch.device):
    """The model on CPU with random N(0, 0.02) weights (norms at 1), generated on
    ``fill_device`` (fast on a GPU) and copied to CPU."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**sizes)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device="cpu")
    gen = torch.Generator(device=fill_device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                values = torch.randn(param.shape, generator=gen, device=fill_device, dtype=torch.float32) * 0.02
                param.copy_(values.to(dtype).cpu())
        # to_empty left the rotary inv_freq buffers uninitialized: rebuild those modules on CPU.
        for name, module in list(model.named_modules()):
            if name.endswith("rotary_emb"):
                set_module(model, name, type(module)(config=model.config))
    return model.eval()


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="shrunken config and calibration (checks the script)")
    parser.add_argument("--methods", default="gptq,awq", help=f"comma list of {sorted(METHODS)}")
    parser.add_argument("--nsamples", type=int, default=None, help="calibration sequences (default 128; tiny 4)")
    parser.add_argument("--seqlen", type=int, default=None, help="calibration length (default 2048; tiny 128)")
    parser.add_argument("--mem-cap-gb", type=float, default=12.0,
                        help="cap this process's GPU memory (GiB) below the model size; 0 = no cap")
    parser.add_argument("--device", default=None, help="default cuda when available, else cpu")
    parser.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_quantize_8b.json)")
    args = parser.parse_args(argv)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {sorted(METHODS)}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda and device.index is None:  # the memory-stat APIs need an explicit index
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = TINY if args.tiny else LLAMA31_8B
    nsamples = args.nsamples or (4 if args.tiny else 128)
    seqlen = args.seqlen or (128 if args.tiny else 2048)
    out_path = Path(args.out or Path(os.environ.get("OUT", ".")) / "gpu_quantize_8b.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)

    result = {
        "benchmark": "gpu_quantize_8b",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "fp4ptq_version": fp4ptq.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "model": "tiny Llama (shrunken check)" if args.tiny else "Llama-3.1-8B-shaped, random weights",
        "sizes": sizes,
        "calibration": {"nsamples": nsamples, "seqlen": seqlen, "tokens": "uniform random ids, seed 0"},
        "target_s": 300,
        "runs": {},
    }

    save, _ = harness.recorder(result, str(out_path))

    t0 = time.perf_counter()
    base = build_model(sizes, torch.bfloat16, seed=0, fill_device=device)
    result["build_s"] = round(time.perf_counter() - t0, 1)
    result["model_bytes"] = model_bytes(base)
    calib = torch.randint(0, sizes["vocab_size"], (nsamples, seqlen), generator=torch.Generator().manual_seed(0))
    if cuda and args.mem_cap_gb > 0:
        total = torch.cuda.get_device_properties(device).total_memory
        cap = int(args.mem_cap_gb * 2**30)
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        result["gpu_mem_cap_bytes"] = cap
        result["gpu_total_bytes"] = total
    print(f"model {result['model_bytes'] / 1e9:.2f} GB on CPU, built in {result['build_s']} s; "
          f"calibration {nsamples} x {seqlen}; device {result['device']}", flush=True)

    if cuda and not args.tiny:
        result["gptq_graph_check"] = graph_check(device)
        save()
        print(f"GPTQ CUDA-graph check: {result['gptq_graph_check']}", flush=True)

    timer = PhaseTimer(device) if cuda else None
    for name in methods:
        model = base if name == methods[-1] else _clone(base)  # the last run may consume the original
        config = QuantConfig(ignore=("lm_head",), nsamples=nsamples, seqlen=seqlen, **METHODS[name])
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fp4ptq.quantize(model, config, calib, device=device, progress=True)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        run = {
            "config": config.to_dict(),
            "quantize_s": round(seconds, 1),
            "meets_target": seconds <= result["target_s"],
            "layers_quantized": len(model.fp4ptq_info["layers"]),
            "mean_rel_error": sum(v["rel_error"] for v in model.fp4ptq_info["layers"].values())
            / max(1, len(model.fp4ptq_info["layers"])),
        }
        if cuda:
            peak = torch.cuda.max_memory_allocated(device)
            run["peak_gpu_bytes"] = peak
            run["peak_gpu_gib"] = round(peak / 2**30, 2)
            run["offload_proof"] = bool(
                result.get("gpu_mem_cap_bytes") and result["model_bytes"] > result["gpu_mem_cap_bytes"]
            )
        if timer is not None:
            run["phase_s"] = timer.take()  # nested: _round_set includes gptq; run_block includes hooks' hessian_update
        result["runs"][name] = run
        save()
        print(f"{name}: {run['quantize_s']} s, peak GPU {run.get('peak_gpu_gib', '-')} GiB", flush=True)
        del model

    print(json.dumps({k: v for k, v in result.items() if k != "sizes"}, indent=2))
    print(f"wrote {out_path}")
    return 0


class PhaseTimer:
    """Wall time per pipeline phase (patched module functions, each call closed by
    a CUDA synchronize), to say where the minutes go."""

    def __init__(self, device) -> None:
        import importlib

        self.device, self.totals, self.patched = device, {}, []
        # each function where its callers look it up: the block runner, the searches, the roundings
        for module, name in (("pipeline", "run_block"), ("pipeline", "capture_block_inputs"),
                             ("solve", "search_group"), ("solve", "_round_set"), ("solve", "gptq"),
                             ("stats", "hessian_update")):
            self._patch(importlib.import_module(f"fp4ptq.{module}"), name)

    def _patch(self, module, name) -> None:
        original = getattr(module, name)

        def timed(*args, **kwargs):
            torch.cuda.synchronize(self.device)
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                torch.cuda.synchronize(self.device)
                self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t

        setattr(module, name, timed)
        self.patched.append((module, name, original))

    def take(self) -> dict:
        out = {k: round(v, 1) for k, v in self.totals.items()}
        self.totals = {}
        return out


def graph_check(device, rows: int = 4096, cols: int = 4096) -> dict:
    """GPTQ on one random ``[rows, cols]`` layer, eager column loop vs CUDA-graph
    replay (``gptq(..., graphs=)``): identical codes and scales, and both times."""
    from fp4ptq.methods.gptq import gptq

    gen = torch.Generator(device=device).manual_seed(1)
    W = torch.randn(rows, cols, generator=gen, device=device) * 0.02
    X = torch.randn(8192, cols, generator=gen, device=device)
    H = X.t() @ X
    out = {"shape": [rows, cols]}
    results = {}
    for graphs in (False, True):
        for rule in (None, "mse"):
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            q = gptq(W, H, four_six=rule, graphs=graphs)
            torch.cuda.synchronize(device)
            key = f"{'graph' if graphs else 'eager'}_{rule or 'none'}"
            out[key + "_s"] = round(time.perf_counter() - t, 3)
            results[key] = q
    for rule in ("none", "mse"):
        a, b = results[f"eager_{rule}"], results[f"graph_{rule}"]
        out[f"identical_{rule}"] = bool(torch.equal(a.packed, b.packed) and torch.equal(
            a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8)))
    return out


def _clone(model):
    import copy

    return copy.deepcopy(model)


if __name__ == "__main__":
    raise SystemExit(main())
