"""Checkpoint size and save/load time: packed NVFP4 (compressed-tensors layout) vs the bf16 model.

    # the demo model on CPU (RTN + Four Over Six), with a perplexity check on a few windows
    python benchmarks/checkpoint_bench.py --model smollm2 --ppl-windows 4 --data-dir ../shared/evaldata
    # a random model with Llama-3.1-8B's shapes, on the GPU (the lead runs this on the H200)
    python benchmarks/checkpoint_bench.py --model llama8b --device cuda
    # the same code path at a tiny size, to check it on a CPU
    python benchmarks/checkpoint_bench.py --model llama8b --tiny
    # what load(verify=True) costs: loads with and without it, alternated, medians (-> ..._verify.{json,md})
    python benchmarks/checkpoint_bench.py --model smollm2 --verify 7

What is timed: ``fp4ptq.save`` (model on its device -> safetensors on disk, fsynced),
``fp4ptq.load`` and ``AutoModelForCausalLM.from_pretrained`` (disk -> NVFP4Linear
model on the device). The load follows the save, so the files are in the page
cache: these are warm-cache load times (dropping the cache needs root).
Correctness: the loaded model's logits equal the in-memory model's, bit for bit
(and, with ``--ppl-windows``, its WikiText-2 perplexity).

Writes ``benchmarks/results/checkpoint_<model>[_tiny]_<device>.{json,md}`` and prints the table.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import fp4ptq
from fp4ptq import checkpoint
from fp4ptq.modules import NVFP4Linear

import harness

# Llama-3.1-8B's shapes (random weights), and a tiny stand-in with the same structure.
SHAPES = {
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                    tie_word_embeddings=False),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512, tie_word_embeddings=False),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def random_nvfp4_llama(shape: str, device: torch.device, dtype=torch.bfloat16):
    """A Llama of the given shape whose linears (but lm_head) are NVFP4Linear with
    random codes and block scales (one global scale, so fused groups share it)
    and whose other weights are random: save/load cost does not depend on values.
    Returns (model, bf16 parameter bytes of the unquantized model)."""
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape])
    with init_empty_weights(include_buffers=False):
        model = LlamaForCausalLM(config)   # buffers (rotary tables) stay fp32, as from_pretrained builds them
    bf16_bytes = sum(p.numel() for p in model.parameters()) * 2
    gen = torch.Generator(device).manual_seed(0)
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and name != "lm_head":
            layer = NVFP4Linear(module.in_features, module.out_features, module.bias is not None,
                                dtype=dtype, device=device)
            layer.weight_packed.random_(0, 256, generator=gen)
            scales = torch.rand(layer.weight_scale.shape, device=device, generator=gen) * 447 + 1
            layer.weight_scale.copy_(scales.to(torch.float8_e4m3fn))
            layer.weight_global_scale.fill_(6 * 448 / 0.25)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, layer)
    for module in model.modules():
        for pname, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                value = torch.empty(param.shape, dtype=dtype, device=device)
                value = value.fill_(1.0) if param.dim() == 1 else value.normal_(0, 0.02, generator=gen)
                module._parameters[pname] = nn.Parameter(value, requires_grad=False)
    return model.to(device).eval(), bf16_bytes


def smollm2(device: torch.device, workdir: Path):
    """The demo model, RTN + 4/6 (MSE), W4A16; its bf16 checkpoint saved for the size baseline."""
    model, tokenizer, _ = fp4ptq.load_source_model(None, dtype=torch.bfloat16)
    from huggingface_hub import save_torch_state_dict

    # transformers refuses save_pretrained on a GGUF-loaded model: write the bf16 weights directly.
    bf16_dir = workdir / "bf16"
    bf16_dir.mkdir(exist_ok=True)
    save_torch_state_dict(model.state_dict(), bf16_dir, shared_tensors_to_discard=list(checkpoint._tied_targets(model)))
    bf16_bytes = dir_bytes(bf16_dir)
    started = time.perf_counter()
    fp4ptq.quantize(model.to(device), fp4ptq.QuantConfig(method="rtn", four_six="mse"), progress=False)
    return model, tokenizer, bf16_bytes, time.perf_counter() - started


def timed(fn, device):
    sync(device)
    started = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - started


def logits(model, ids, result: dict, what: str):
    """Logits for ``ids`` on the CPU, or None (error recorded) if the forward pass fails,
    so a kernel problem does not lose the save/load measurements."""
    try:
        with torch.no_grad():
            return model(ids).logits.float().cpu()
    except Exception as exc:  # noqa: BLE001 - recorded in the results
        result.setdefault("forward_errors", {})[what] = f"{type(exc).__name__}: {exc}"[:500]
        return None


def same(a, b):
    return None if a is None or b is None else bool(torch.equal(a, b))


def peak_load(fn, device):
    """Run a load, returning (model, seconds, peak device bytes allocated during it or None)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, seconds = timed(fn, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return model, seconds, peak


def verify_cost(ckpt: Path, device: torch.device, repeats: int) -> dict:
    """Median ``fp4ptq.load`` seconds without and with ``verify=True`` (alternated, warm cache)."""
    import statistics

    times = {False: [], True: []}
    for _ in range(repeats):
        for verify in (False, True):
            model, seconds, _ = peak_load(lambda v=verify: fp4ptq.load(ckpt, device=device, verify=v), device)
            times[verify].append(seconds)
            del model
    plain, checked = statistics.median(times[False]), statistics.median(times[True])
    headers = checkpoint.read_headers(checkpoint.checkpoint_files(ckpt))
    return {"repeats": repeats, "load_s": round(plain, 4), "load_verify_s": round(checked, 4),
            "overhead": round(checked / plain - 1, 4), "tensors": len(headers),
            "hashed_bytes": sum(i.offsets[1] - i.offsets[0] for i in headers.values()),
            "all_load_s": [round(t, 4) for t in times[False]], "all_load_verify_s": [round(t, 4) for t in times[True]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("smollm2", "llama8b"), default="smollm2")
    ap.add_argument("--tiny", action="store_true", help="llama8b: use a tiny shape (CPU check of the code path)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--ppl-windows", type=int, default=0, help="smollm2: WikiText-2 windows to compare (0: skip)")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--data-dir", default=os.environ.get("FP4PTQ_EVALDATA"))
    ap.add_argument("--verify", type=int, default=0, metavar="N",
                    help="also time N loads with verify=True and N without, alternated (results: ..._verify)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    device = torch.device(args.device)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fp4ptq-ckpt-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    name = args.model + ("_tiny" if args.tiny else "")
    result = {"model": name, "device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)

    tokenizer = None
    if args.model == "smollm2":
        model, tokenizer, bf16_bytes, quantize_s = smollm2(device, workdir)
        result["quantize_seconds"] = round(quantize_s, 2)
        result["bf16_bytes_measured"] = bf16_bytes
    else:
        model, bf16_bytes = random_nvfp4_llama("tiny" if args.tiny else "llama8b", device)
        result["bf16_bytes_analytic"] = bf16_bytes
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)

    ckpt = workdir / "nvfp4"
    _, save_s = timed(lambda: fp4ptq.save(model, ckpt, tokenizer=tokenizer, overwrite=True,
                                          max_shard_size=args.max_shard_size), device)
    report = json.loads((ckpt / checkpoint.REPORT_FILE).read_text())["checkpoint"]
    result.update(
        save_seconds=round(save_s, 2),
        checkpoint_bytes=dir_bytes(ckpt),
        safetensors_bytes=report["file_bytes"],
        shards=len(report["files"]),
        bits_per_quantized_weight=round(report["tensor_bytes"]["bits_per_quantized_weight"], 3),
    )
    result["size_vs_bf16"] = round(result["checkpoint_bytes"] / bf16_bytes, 4)
    expected = logits(model, ids, result, "in_memory")
    ppl_memory = None
    if args.ppl_windows:
        from fp4ptq.eval.perplexity import perplexity

        ppl_memory = perplexity(model, tokenizer, "wikitext", data_dir=args.data_dir, seqlen=args.seqlen,
                                max_windows=args.ppl_windows, word_perplexity=False, progress=False)
    del model
    loaded, load_s, load_peak = peak_load(lambda: fp4ptq.load(ckpt, device=device), device)
    result["load_logits_equal"] = same(logits(loaded, ids, result, "load"), expected)
    if ppl_memory is not None:
        from fp4ptq.eval.perplexity import perplexity

        ppl_loaded = perplexity(loaded, tokenizer, "wikitext", data_dir=args.data_dir, seqlen=args.seqlen,
                                max_windows=args.ppl_windows, word_perplexity=False, progress=False)
        result["ppl"] = {"windows": ppl_memory["windows"], "seqlen": args.seqlen,
                         "in_memory": ppl_memory["token_perplexity"], "loaded": ppl_loaded["token_perplexity"],
                         "equal": ppl_memory["nll_mean"] == ppl_loaded["nll_mean"]}
    del loaded
    if args.verify:
        result["verify"] = verify_cost(ckpt, device, args.verify)
    from transformers import AutoModelForCausalLM

    hf_model, hf_s, hf_peak = peak_load(
        lambda: AutoModelForCausalLM.from_pretrained(ckpt, device_map=str(device)), device)
    result["from_pretrained_logits_equal"] = same(logits(hf_model, ids, result, "from_pretrained"), expected)
    del hf_model
    result.update(load_seconds=round(load_s, 2), from_pretrained_seconds=round(hf_s, 2),
                  load_peak_device_bytes=load_peak, from_pretrained_peak_device_bytes=hf_peak)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"checkpoint_{name}_{device.type}{'_verify' if args.verify else ''}"
    harness.write_json(str(stem.with_suffix(".json")), result)
    gb = 1e9
    rows = [
        ("bf16 model (bytes)", f"{bf16_bytes / gb:.3f} GB" + ("" if args.model == "smollm2" else " (params x 2)")),
        ("NVFP4 checkpoint (bytes)", f"{result['checkpoint_bytes'] / gb:.3f} GB in {result['shards']} shard(s)"),
        ("size vs bf16", f"{result['size_vs_bf16']:.3f}"),
        ("bits per quantized weight", f"{result['bits_per_quantized_weight']}"),
        ("fp4ptq.save", f"{result['save_seconds']} s"),
        ("fp4ptq.load", f"{result['load_seconds']} s (logits equal: {result['load_logits_equal']})"),
        ("from_pretrained", f"{result['from_pretrained_seconds']} s "
                            f"(logits equal: {result['from_pretrained_logits_equal']})"),
    ]
    if load_peak is not None:
        rows.append(("peak GPU memory, load / from_pretrained",
                     f"{load_peak / gb:.2f} / {hf_peak / gb:.2f} GB"))
    if "verify" in result:
        v = result["verify"]
        rows.append((f"fp4ptq.load, median of {v['repeats']}, without / with verify=True",
                     f"{v['load_s']:.3f} / {v['load_verify_s']:.3f} s: verify adds {100 * v['overhead']:.1f}% "
                     f"({v['tensors']} tensors, {v['hashed_bytes'] / 1e6:.0f} MB hashed)"))
    if "ppl" in result:
        p = result["ppl"]
        rows.append((f"WikiText-2 ppl ({p['windows']} x {p['seqlen']} tokens)",
                     f"in memory {p['in_memory']:.4f}, loaded {p['loaded']:.4f}, equal: {p['equal']}"))
    title = f"Checkpoint: {name} on {device}" + (f" ({result['gpu']})" if "gpu" in result else "")
    table = [f"# {title}", "", *harness.md_table(["measure", "value"], rows), "",
             "Load times are warm-cache (the files were just written).", ""]
    harness.write_text(str(stem.with_suffix(".md")), "\n".join(table))
    print("\n".join(table))


if __name__ == "__main__":
    main()
