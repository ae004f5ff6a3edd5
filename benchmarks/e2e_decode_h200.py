"""End-to-end generation on one GPU: a Llama-3.1-8B-shaped model (its published sizes, random
N(0, 0.02) weights: no hub here) in bf16, then the same model quantized by fp4ptq (RTN, NVFP4
W4A16 and W4A4), run through transformers with a static KV cache.

Per model and batch size:
  * prefill: one eager forward of [B, PROMPT] tokens (ms);
  * decode, eager: HF's forward one token at a time from Python (what plain ``generate`` does);
  * decode, CUDA graph: one greedy step (forward + argmax fed back as the next token) captured
    once and replayed (what serving engines and ``torch.compile(mode="reduce-overhead")`` do):
    ms a token and tokens a second for the whole batch;
  * checks: the replayed steps give the eager steps' tokens (same kernels, so the same bits);
    the quantized model's prefill logits against the bf16 model's (relative error).
  * COMPILE=1 (B = 1 only): the decode step through ``torch.compile(mode="reduce-overhead")``,
    which works because NVFP4Linear is one custom op to Dynamo (no graph breaks at the layers).

    PYTHONPATH=$PWD:$PWD/.peers python benchmarks/e2e_decode_h200.py   # $OUT/e2e_decode_h200.json

Knobs: BATCHES (default 1,16), PROMPT (512), STEPS (128 timed graph replays), SCHEMES
(bf16,w4a16,w4a4), COMPILE (0), LAYERS (32; fewer for a quick check), TINY=1 (a 2-layer
small model, CPU-sized: checks the script, not a measurement).
"""
from __future__ import annotations

import copy
import gc
import json
import os
import time
import traceback

import torch

import fp4ptq
from fp4ptq import QuantConfig
from fp4ptq.modules import NVFP4Linear

OUT = os.environ.get("OUT", "/tmp")
BATCHES = [int(b) for b in os.environ.get("BATCHES", "1,16").split(",")]
PROMPT = int(os.environ.get("PROMPT", 512))
STEPS = int(os.environ.get("STEPS", 128))
CHECK_STEPS = 8
SCHEMES = os.environ.get("SCHEMES", "bf16,w4a16,w4a4").split(",")
COMPILE = os.environ.get("COMPILE", "0") == "1"
TINY = os.environ.get("TINY", "0") == "1"
SIZES = dict(  # config.json of meta-llama/Llama-3.1-8B
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=int(os.environ.get("LAYERS", 32)),
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=False,
)
if TINY:
    SIZES.update(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: TINY=1 checks the script only


def env() -> dict:
    import transformers
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "sizes": SIZES}


def build_model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SIZES), dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.generation_config.pad_token_id = 0
    return model.eval()


def gpu_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def timed(fn, reps: int = 1) -> float:
    """ms per call of fn (CUDA events around ``reps`` calls)."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


class Decoder:
    """A static-cache greedy decoder for one model and batch size: ``step`` feeds ``tok`` [B, 1]
    and writes the argmax back into it (the cache advances its own position counter in place)."""

    def __init__(self, model, batch: int):
        from transformers import StaticCache

        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=PROMPT + 2 * CHECK_STEPS + STEPS + 64)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.prompt = torch.randint(0, SIZES["vocab_size"], (batch, PROMPT), device=dev,
                                    generator=torch.Generator(device=dev).manual_seed(batch))

    @torch.no_grad()
    def prefill(self):
        self.cache.reset()
        logits = self.model(input_ids=self.prompt, past_key_values=self.cache, use_cache=True).logits
        self.tok.copy_(logits[:, -1:].argmax(-1))
        return logits[:, -1].float()

    @torch.no_grad()
    def step(self):
        logits = self.model(input_ids=self.tok, past_key_values=self.cache, use_cache=True).logits
        self.tok.copy_(logits[:, -1:].argmax(-1))


def run_model(model, label: str, ref_logits: dict, res: dict) -> dict:
    out = {"scheme": label, "gpu_bytes": gpu_bytes(model), "batches": {}}
    for batch in BATCHES:
        row = {}
        try:
            d = Decoder(model, batch)
            logits = d.prefill()  # first call: the kernels compile and self-test here
            row["prefill_ms"] = min(timed(d.prefill) for _ in range(3))
            logits = d.prefill()
            if label == "bf16":
                ref_logits[batch] = logits
            elif batch in ref_logits:
                ref = ref_logits[batch]
                row["prefill_logits_rel_err_vs_bf16"] = float((logits - ref).norm() / ref.norm())
                row["next_token_agreement_vs_bf16"] = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
            eager_tokens = []
            for _ in range(CHECK_STEPS):  # eager steps: also the warmup before the capture
                d.step()
                eager_tokens.append(d.tok.clone())
            row["eager_decode_ms"] = timed(d.step, 16)
            if dev.type != "cuda":
                out["batches"][batch] = row
                continue
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                d.step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                d.step()
            d.prefill()
            replayed = []
            for _ in range(CHECK_STEPS):
                graph.replay()
                replayed.append(d.tok.clone())
            row["graph_tokens_equal_eager"] = all(torch.equal(a, b) for a, b in zip(eager_tokens, replayed))
            row["graph_decode_ms"] = timed(graph.replay, STEPS)
            row["tokens_per_s"] = batch * 1e3 / row["graph_decode_ms"]
            del graph
            if COMPILE and batch == 1:
                row.update(compiled_decode(d))
        except Exception as exc:  # noqa: BLE001 - keep the other rows
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            row["traceback"] = traceback.format_exc()[-3000:]
        out["batches"][batch] = row
        print(label, batch, {k: v for k, v in row.items() if k != "traceback"}, flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def compiled_decode(d: Decoder) -> dict:
    """The decode step through torch.compile(mode="reduce-overhead"): compile time, ms a token, and
    whether its tokens follow the eager steps'."""
    torch._dynamo.reset()
    t0 = time.time()
    step = torch.compile(d.step, mode="reduce-overhead")
    d.prefill()
    eager = []
    for _ in range(CHECK_STEPS):
        d.step()
        eager.append(d.tok.clone())
    d.prefill()
    got = []
    for _ in range(CHECK_STEPS):
        step()
        got.append(d.tok.clone())
    compile_s = time.time() - t0
    result = {"compile_s": compile_s, "compiled_tokens_equal_eager": all(torch.equal(a, b) for a, b in zip(eager, got))}
    result["compiled_decode_ms"] = timed(step, STEPS // 2)
    return result


def quantized(base, scheme: str):
    model = copy.deepcopy(base)
    calib = None
    if scheme == "w4a4":  # static activation scales from random token windows
        calib = torch.randint(0, SIZES["vocab_size"], (8, 256), generator=torch.Generator().manual_seed(1))
    t0 = time.time()
    fp4ptq.quantize(model, QuantConfig(method="rtn", scheme=scheme), calib, device=dev, progress=False)
    seconds = time.time() - t0
    layers = sum(isinstance(m, NVFP4Linear) for m in model.modules())
    return model.eval(), seconds, layers


def main():
    res = {"env": env(), "prompt": PROMPT, "steps": STEPS, "models": []}
    path = os.path.join(OUT, "e2e_decode_h200.json")
    t0 = time.time()
    base = build_model()
    res["build_s"] = time.time() - t0
    ref_logits: dict = {}
    for scheme in SCHEMES:
        if scheme == "bf16":
            entry = run_model(base, "bf16", ref_logits, res)
        else:
            model, seconds, layers = quantized(base, scheme)
            entry = run_model(model, scheme, ref_logits, res)
            entry.update(quantize_s=seconds, nvfp4_layers=layers)
            del model
        res["models"].append(entry)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    print(report(res))


def report(res: dict) -> str:
    lines = ["| model | GPU bytes | B | prefill (ms) | eager decode (ms/token) | graph decode (ms/token) | "
             "tokens/s | vs bf16 | logits rel. err vs bf16 |", "|---|---|---|---|---|---|---|---|---|"]
    base = {b: r.get("graph_decode_ms") for m in res["models"] if m["scheme"] == "bf16" for b, r in m["batches"].items()}
    for m in res["models"]:
        for b, r in m["batches"].items():
            if "error" in r:
                lines.append(f"| {m['scheme']} | | {b} | error: {r['error'][:80]} |")
                continue
            if "graph_decode_ms" not in r:  # the CPU check
                lines.append(f"| {m['scheme']} | | {b} | {r['prefill_ms']:.1f} | {r['eager_decode_ms']:.2f} | | | | |")
                continue
            speed = f"{base[b] / r['graph_decode_ms']:.2f}x" if base.get(b) else ""
            err = r.get("prefill_logits_rel_err_vs_bf16")
            lines.append(f"| {m['scheme']} | {m['gpu_bytes'] / 1e9:.2f} GB | {b} | {r['prefill_ms']:.1f} | "
                         f"{r['eager_decode_ms']:.2f} | {r['graph_decode_ms']:.3f} | {r['tokens_per_s']:.0f} | {speed} | "
                         f"{'' if err is None else f'{err:.3f}'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
