"""End-to-end generation on one GPU: a Llama-3.1-8B-shaped model (its published sizes, random
N(0, 0.02) weights: no hub here) in bf16, then the same model quantized by fp4ptq (RTN, NVFP4
W4A16 and W4A4), run through transformers with a static KV cache.

Per model and batch size:
  * prefill: one eager forward of [B, PROMPT] tokens (ms);
  * decode, eager: HF's forward one token at a time from Python (what plain ``generate`` does);
  * decode, CUDA graph: one greedy step (forward + argmax fed back as the next token) captured
    once and replayed (what serving engines and ``torch.compile(mode="reduce-overhead")`` do):
    ms a token and tokens a second for the whole batch;
  * checks: the first replayed step's logits against the eager step's, and the share of equal
    tokens over CHECK_STEPS steps; the quantized model's prefill through the Triton kernels against
    the same model through the reference backend (hidden states after blocks 1 .. 32, logits), and
    against the bf16 model (random weights: a deep random model amplifies any difference);
  * where a token's GPU time goes: one eager step under torch.profiler, kernels by kind;
  * COMPILE=1 (B = 1, COMPILE_SCHEMES): the decode step through ``torch.compile(mode="reduce-overhead")``,
    which works because NVFP4Linear is one custom op to Dynamo (no graph breaks at the layers).

    PYTHONPATH=$PWD python benchmarks/e2e_decode_h200.py   # $OUT/e2e_decode_h200.{json,md}
    TINY=1 PYTHONPATH=$PWD python benchmarks/e2e_decode_h200.py   # on a CPU: checks the script in ~1 min

Knobs: BATCHES (default 1,16), PROMPT (512), STEPS (128 timed graph replays), SCHEMES
(bf16,w4a16,w4a4; "w4a16+fused" / "w4a4+fused": q/k/v and gate/up fused, ``fp4ptq.fuse_projections``), COMPILE (0), LAYERS (32; fewer for a quick check), TINY=1 (a 2-layer
small model, CPU-sized: checks the script, not a measurement), MODEL_DTYPE (bfloat16; float16 builds the
model and runs its activations in fp16, the unquantized model keeping the scheme name "bf16").
"""
from __future__ import annotations

import contextlib
import copy
import functools
import gc
import os
import time
import traceback

import torch

import fp4ptq
import harness
from fp4ptq import QuantConfig
from fp4ptq.modules import NVFP4Linear
from harness import rel

BATCHES = [int(b) for b in os.environ.get("BATCHES", "1,16").split(",")]
PROMPT = int(os.environ.get("PROMPT", 512))
STEPS = int(os.environ.get("STEPS", 128))
CHECK_STEPS = 8
SCHEMES = os.environ.get("SCHEMES", "bf16,w4a16,w4a4").split(",")
COMPILE = os.environ.get("COMPILE", "0") == "1"
COMPILE_SCHEMES = os.environ.get("COMPILE_SCHEMES", "bf16,w4a16").split(",")
TINY = os.environ.get("TINY", "0") == "1"
MODEL_DTYPE = getattr(torch, os.environ.get("MODEL_DTYPE", "bfloat16"))
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
            "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "sizes": SIZES,
            "model_dtype": str(MODEL_DTYPE)}


def build_model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SIZES), dtype=MODEL_DTYPE)
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
    """A static-cache greedy decoder for one model and batch size: ``step`` feeds ``tok`` [B, 1],
    keeps the last position's logits in ``logits`` and writes their argmax back into ``tok`` (the
    cache advances its own position counter in place), so a captured step replays as a decoder."""

    def __init__(self, model, batch: int):
        from transformers import StaticCache

        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=PROMPT + 2 * CHECK_STEPS + STEPS + 64)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.logits = torch.zeros(batch, SIZES["vocab_size"], dtype=torch.float32, device=dev)
        self.prompt = torch.randint(0, SIZES["vocab_size"], (batch, PROMPT), device=dev,
                                    generator=torch.Generator(device=dev).manual_seed(batch))

    @torch.no_grad()
    def prefill(self, hidden: bool = False):
        self.cache.reset()
        out = self.model(input_ids=self.prompt, past_key_values=self.cache, use_cache=True,
                         output_hidden_states=hidden)
        self.tok.copy_(out.logits[:, -1:].argmax(-1))
        self.logits.copy_(out.logits[:, -1])
        return out

    @torch.no_grad()
    def step(self):
        logits = self.model(input_ids=self.tok, past_key_values=self.cache, use_cache=True).logits
        self.logits.copy_(logits[:, -1])
        self.tok.copy_(logits[:, -1:].argmax(-1))


def capture_step(d: Decoder) -> "torch.cuda.CUDAGraph":
    """``d.step`` captured in a CUDA graph (after a warm-up step on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        d.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d.step()
    return graph


def decode_tokens(d: Decoder, step, n: int):
    """Prefill, then ``n`` steps of ``step``: the tokens fed back and the first step's logits."""
    d.prefill()
    tokens, first = [], None
    for i in range(n):
        step()
        tokens.append(d.tok.clone())
        if i == 0:
            first = d.logits.clone()
    return torch.cat(tokens, 1), first


@contextlib.contextmanager
def reference_backend():
    """NVFP4Linear through the dispatch's reference backend (dequantize, then torch's matmul); its
    launch plans off (they call the kernels directly, not through these two functions)."""
    from fp4ptq import kernels, modules

    saved = kernels.linear_w4a16, kernels.linear_w4a4, modules.LAUNCH_PLANS
    kernels.linear_w4a16 = functools.partial(saved[0], backend="reference")
    kernels.linear_w4a4 = functools.partial(saved[1], backend="reference")
    modules.LAUNCH_PLANS = False
    try:
        yield
    finally:
        kernels.linear_w4a16, kernels.linear_w4a4, modules.LAUNCH_PLANS = saved


def kernel_error(d: Decoder) -> dict:
    """The quantized model's prefill through the Triton kernels against the same quantized model
    through the reference backend: hidden states (last position) after blocks 1, 8, 16 and 32,
    and the logits. Block 1 is the kernels' own error; the growth after it, how much this random
    32-block model amplifies any rounding difference."""
    ours = d.prefill(hidden=True)
    with reference_backend():
        ref = d.prefill(hidden=True)
    hs = len(ours.hidden_states) - 1
    out = {f"hidden_rel_err_block{i}": rel(ours.hidden_states[i][:, -1], ref.hidden_states[i][:, -1])
           for i in sorted({1, min(8, hs), min(16, hs), hs})}
    out["logits_rel_err_vs_reference_backend"] = rel(ours.logits[:, -1], ref.logits[:, -1])
    # the baseline: the reference backend against itself with the embeddings moved by one bf16 ulp at
    # random places (1 in 16), the size of difference that rounding in another order makes
    emb = d.model.get_input_embeddings()
    gen = torch.Generator(device=dev).manual_seed(2)

    def nudge(module, args, output):
        flip = torch.rand(output.shape, generator=gen, device=output.device) < 1 / 16
        return torch.where(flip, output * (1 + 2.0 ** -7), output)

    handle = emb.register_forward_hook(nudge)
    try:
        with reference_backend():
            moved = d.prefill(hidden=True)
    finally:
        handle.remove()
    for i in (1, hs):
        out[f"nudged_reference_hidden_rel_err_block{i}"] = rel(moved.hidden_states[i][:, -1], ref.hidden_states[i][:, -1])
    out["next_token_agreement_vs_reference_backend"] = float(
        (ours.logits[:, -1].argmax(-1) == ref.logits[:, -1].argmax(-1)).float().mean())
    return out


def our_kernel_names() -> tuple:
    """The names of fp4ptq's Triton and Gluon kernels (what the profiler calls their launches)."""
    import importlib

    names = set()
    for mod in ("_common", "gemm", "gemv", "quantize_kernel", "mma", "wgmma", "wsgemm", "dot_scaled"):
        try:
            module = importlib.import_module(f"fp4ptq.kernels.{mod}")
        except Exception:  # noqa: BLE001 - Gluon missing here
            continue
        names.update(name for name, obj in vars(module).items() if hasattr(obj, "fn") and hasattr(obj, "run"))
    return tuple(sorted(names, key=len, reverse=True))


KINDS = (("cublas", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk")),
         ("attention", ("flash", "fmha", "attention", "efficient", "softmax")))


def kernel_breakdown(fn, prefix: str = "") -> dict:
    """GPU time of one call of ``fn`` by kind of kernel (torch.profiler; copies and fills as "memcpy"),
    its CUDA runtime calls by name (graph launches, kernel launches) and its 8 costliest "other"
    kernels: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    ours = our_kernel_names()
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals, counts, runtime, others = {}, {}, {}, []
    for e in prof.key_averages():
        if e.key.startswith("cuda") and e.count:  # runtime calls: graph launches, kernel launches, copies
            runtime[e.key] = runtime.get(e.key, 0) + e.count
            continue
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if not us or e.count == 0:
            continue
        name = e.key.lower()
        if "Memcpy" in e.key or "Memset" in e.key:
            kind = "memcpy"
        elif any(e.key.startswith(o) for o in ours):
            kind = "fp4ptq"
        else:
            kind = next((k for k, keys in KINDS if any(t in name for t in keys)), "other")
        totals[kind] = totals.get(kind, 0.0) + us / 1e3
        counts[kind] = counts.get(kind, 0) + e.count
        if kind == "other":
            others.append((us / 1e3, e.count, e.key[:160]))
    top = [{"ms": round(ms, 4), "count": n, "kernel": key} for ms, n, key in sorted(others, reverse=True)[:8]]
    return {f"{prefix}kernel_ms_by_kind": totals, f"{prefix}kernels_by_kind": counts, f"{prefix}runtime_calls": runtime,
            f"{prefix}top_other_kernels": top}


def run_model(model, label: str, ref_logits: dict) -> dict:
    out = {"scheme": label, "gpu_bytes": gpu_bytes(model), "batches": {}}
    for batch in BATCHES:
        row = {}
        try:
            d = Decoder(model, batch)
            d.prefill()  # first call: the kernels compile and self-test here
            row["prefill_ms"] = min(timed(d.prefill) for _ in range(3))
            d.prefill()
            if label == "bf16":
                ref_logits[batch] = d.logits.clone()
            elif batch in ref_logits:
                row["logits_rel_err_vs_bf16"] = rel(d.logits, ref_logits[batch])
                row["next_token_agreement_vs_bf16"] = float(
                    (d.logits.argmax(-1) == ref_logits[batch].argmax(-1)).float().mean())
            if label != "bf16" and batch == BATCHES[0]:
                row.update(kernel_error(d))
            eager_tokens, eager_first = decode_tokens(d, d.step, CHECK_STEPS)  # also the capture's warmup
            again_tokens, again_first = decode_tokens(d, d.step, CHECK_STEPS)
            row["eager_repeat_first_step_logits_equal"] = torch.equal(again_first, eager_first)
            row["eager_repeat_tokens_agreement"] = float((again_tokens == eager_tokens).float().mean())
            row["eager_decode_ms"] = timed(d.step, 16)
            if dev.type != "cuda":
                out["batches"][batch] = row
                continue
            if batch == BATCHES[0]:
                d.prefill()
                row.update(kernel_breakdown(d.step))
                row.update(kernel_breakdown(d.prefill, "prefill_"))
            graph = capture_step(d)
            graph_tokens, graph_first = decode_tokens(d, graph.replay, CHECK_STEPS)
            row["graph_first_step_logits_equal_eager"] = torch.equal(graph_first, eager_first)
            row["graph_first_step_logits_rel_diff"] = rel(graph_first, eager_first)
            row["graph_tokens_agreement_with_eager"] = float((graph_tokens == eager_tokens).float().mean())
            row["graph_decode_ms"] = timed(graph.replay, STEPS)
            row["tokens_per_s"] = batch * 1e3 / row["graph_decode_ms"]
            del graph
        except Exception as exc:  # noqa: BLE001 - keep the other rows
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            row["traceback"] = traceback.format_exc()[-3000:]
        out["batches"][batch] = row
        print(label, batch, {k: v for k, v in row.items() if k != "traceback"}, flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def compiled_decode(model) -> dict:
    """B = 1 decode through torch.compile(mode="reduce-overhead"): compile time, ms a token, and the
    first step's logits and the tokens against the eager steps'."""
    torch._dynamo.reset()
    d = Decoder(model, 1)
    eager_tokens, eager_first = decode_tokens(d, d.step, CHECK_STEPS)
    for t in (d.tok, d.logits):  # the step writes them in place: static, so the CUDA graph may keep them
        torch._dynamo.mark_static_address(t)
    t0 = time.time()
    step = torch.compile(d.step, mode="reduce-overhead")
    tokens, first = decode_tokens(d, step, CHECK_STEPS)
    result = {"compile_s": time.time() - t0, "compiled_first_step_logits_rel_diff": rel(first, eager_first),
              "compiled_tokens_agreement_with_eager": float((tokens == eager_tokens).float().mean())}
    result["compiled_decode_ms"] = timed(step, STEPS // 2)
    return result


def quantized(base, scheme: str):
    """``base`` quantized by RTN to ``scheme``; "w4a16+fused" / "w4a4+fused": then its q/k/v and gate/up
    run as one GEMM a group (``fp4ptq.fuse_projections``)."""
    scheme, _, fused = scheme.partition("+")
    model = copy.deepcopy(base)
    calib = None
    if scheme == "w4a4":  # static activation scales from random token windows
        calib = torch.randint(0, SIZES["vocab_size"], (8, 256), generator=torch.Generator().manual_seed(1))
    t0 = time.time()
    fp4ptq.quantize(model, QuantConfig(method="rtn", scheme=scheme), calib, device=dev, progress=False)
    seconds = time.time() - t0
    if fused:
        report = fp4ptq.fuse_projections(model)
        if report["skipped"] or not report["fused"]:
            raise RuntimeError(f"fuse_projections: {report}")
    layers = sum(isinstance(m, NVFP4Linear) for m in model.modules())
    return model.eval(), seconds, layers


def main():
    res = {"env": env(), "prompt": PROMPT, "steps": STEPS, "models": []}
    save, _ = harness.recorder(res, harness.out_path("e2e_decode_h200.json"))

    t0 = time.time()
    base = build_model()
    res["build_s"] = time.time() - t0
    ref_logits: dict = {}
    models = {}
    for scheme in SCHEMES:
        if scheme == "bf16":
            models[scheme] = base
            entry = run_model(base, "bf16", ref_logits)
        else:
            model, seconds, layers = quantized(base, scheme)
            models[scheme] = model
            entry = run_model(model, scheme, ref_logits)
            entry.update(quantize_s=seconds, nvfp4_layers=layers)
        res["models"].append(entry)
        gc.collect()
        save()
    for entry in res["models"]:
        if COMPILE and entry["scheme"] in COMPILE_SCHEMES and dev.type == "cuda":
            try:
                entry["compiled_b1"] = compiled_decode(models[entry["scheme"]])
            except Exception as exc:  # noqa: BLE001
                entry["compiled_b1"] = {"error": f"{type(exc).__name__}: {exc}"[:2000],
                                        "traceback": traceback.format_exc()[-3000:]}
            print(entry["scheme"], "compiled", {k: v for k, v in entry["compiled_b1"].items() if k != "traceback"},
                  flush=True)
            save()
    harness.write_text(harness.out_path("e2e_decode_h200.md"), report(res) + "\n")
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
            err = r.get("logits_rel_err_vs_bf16")
            lines.append(f"| {m['scheme']} | {m['gpu_bytes'] / 1e9:.2f} GB | {b} | {r['prefill_ms']:.1f} | "
                         f"{r['eager_decode_ms']:.2f} | {r['graph_decode_ms']:.3f} | {r['tokens_per_s']:.0f} | {speed} | "
                         f"{'' if err is None else f'{err:.3f}'} |")
    lines += ["", "| model | B | eager again = eager (first step, tokens) | first step: graph = eager | "
              "graph tokens = eager | kernels vs reference backend: block 1 / last block / logits | the reference "
              "against itself, embeddings nudged: block 1 / last block | GPU ms of a decode step / of the prefill: "
              "NVFP4 kernels / cuBLAS / attention / other |", "|---|---|---|---|---|---|---|---|"]
    for m in res["models"]:
        for b, r in m["batches"].items():
            if "graph_decode_ms" not in r:
                continue
            blocks = sorted((k for k in r if k.startswith("hidden_rel_err_block")), key=lambda k: int(k[20:]))
            kern = (f"{r[blocks[0]]:.1e} / {r[blocks[-1]]:.1e} / {r['logits_rel_err_vs_reference_backend']:.1e}"
                    if blocks else "")
            nudged = sorted((k for k in r if k.startswith("nudged_reference_hidden_rel_err_block")),
                            key=lambda k: int(k[37:]))
            base_err = " / ".join(f"{r[k]:.1e}" for k in nudged)
            splits = []
            for prefix in ("", "prefill_"):
                kinds = r.get(f"{prefix}kernel_ms_by_kind")
                if kinds:
                    splits.append(" / ".join(f"{kinds.get(k, 0):.2f}" for k in ("fp4ptq", "cublas", "attention", "other")))
            lines.append(f"| {m['scheme']} | {b} | {r.get('eager_repeat_first_step_logits_equal')}, "
                         f"{r.get('eager_repeat_tokens_agreement', float('nan')):.0%} | "
                         f"{r['graph_first_step_logits_equal_eager']} ({r['graph_first_step_logits_rel_diff']:.1e}) | "
                         f"{r['graph_tokens_agreement_with_eager']:.0%} | {kern} | {base_err} | {'; '.join(splits)} |")
    for m in res["models"]:
        c = m.get("compiled_b1")
        if c and "error" not in c:
            lines.append(f"\n{m['scheme']}, B = 1, torch.compile(mode='reduce-overhead'): {c['compiled_decode_ms']:.3f} ms "
                         f"a token (compiled in {c['compile_s']:.0f} s; first step's logits {c['compiled_first_step_logits_rel_diff']:.1e} "
                         f"from eager, tokens {c['compiled_tokens_agreement_with_eager']:.0%} equal)")
        elif c:
            lines.append(f"\n{m['scheme']}, B = 1, torch.compile: {c['error'][:200]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
