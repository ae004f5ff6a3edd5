"""Where eager prefill's host time goes (diagnosis for benchmarks/NOTES.md). Session 16 measured one
eager forward of 512 tokens through the Llama-3.1-8B-shaped model at 37.7 ms with W4A16 launch plans
against 20.5 ms of GPU time (bf16: 24.5 ms).

Part 1, one layer (8B q / gate / down shapes; M = 128, 512; W4A16 and W4A4): the host time of a call
(enqueue time of CALLS back-to-back calls without waiting for the GPU: the launch queue holds them, so
this is host time even where the GPU is slower), for the module with its plan, the plan alone, and the
pieces of a planned wsgemm call (x's TMA descriptor, the workspace allocation); then cProfile's own-time
table of the planned module calls.

Part 2, the model (bf16 and W4A16, plans on): wall time of a forward of PROMPT tokens, its enqueue time,
the GPU's kernel time (torch.profiler), and cProfile's own-time and cumulative tables of one forward.

Both parts time NVFP4 layers with replays through the C launcher (``_launch.C_LAUNCH``, "c") and
through Triton's Python launcher ("py"), in interleaved rounds, after checking that both give the same
bits (layers at M = 1, 128, 512; the model's logits).

    PYTHONPATH=$PWD python benchmarks/prefill_host_h200.py   # $OUT/prefill_host_h200.json (+ tables)
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_decode_h200 as e2e  # noqa: E402
from host_overhead_h200 import profile_table  # noqa: E402
from fp4ptq import nvfp4  # noqa: E402
from fp4ptq.kernels import _launch  # noqa: E402
from fp4ptq.modules import NVFP4Linear  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
PROMPT = int(os.environ.get("PROMPT", 512))
CALLS = int(os.environ.get("CALLS", 200))
ROUNDS = int(os.environ.get("ROUNDS", 3))
SHAPES = {"8B.q": (4096, 4096), "8B.gate": (14336, 4096), "8B.down": (4096, 14336)}
dev = torch.device("cuda")


def enqueue_us(fn, calls: int = CALLS) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / calls


def launcher(mode: str, *mods) -> None:
    """Replays through the C launcher ("c") or Triton's Python one ("py"); plans rebuilt."""
    _launch.C_LAUNCH = mode == "c"
    for mod in mods:
        for sub in mod.modules():
            if isinstance(sub, NVFP4Linear):
                sub._plans = None


def outputs(fn, mode: str, *mods) -> torch.Tensor:
    launcher(mode, *mods)
    with torch.no_grad():
        for _ in range(6):  # a plan is built at the 2nd call, captured at its 2nd, replayed from its 3rd
            out = fn()
    return out.clone()


def layer_part(res: dict) -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fp4ptq.kernels import wsgemm
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        for scheme in ("w4a16", "w4a4"):
            mod = NVFP4Linear.from_quantized(nvfp4.quantize(w), scheme=scheme, dtype=torch.bfloat16,
                                             input_amax=4.0 if scheme == "w4a4" else None)
            for m in (1, 128, 512):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
                same = torch.equal(outputs(lambda: mod(x), "py", mod), outputs(lambda: mod(x), "c", mod))
                res["checks"][f"{name} {scheme} M={m}"] = same
                if not same:
                    raise AssertionError(f"{name} {scheme} M={m}: C-launcher replays differ")
                with torch.no_grad():
                    launcher("py", mod)
                    for _ in range(4):
                        mod(x)
                    plan, _key = mod._plan(x)
                    levels = {"F.linear": (lambda wb=w.to(torch.bfloat16): torch.nn.functional.linear(x, wb)),
                              "torch.empty": lambda: torch.empty(m, n, device=dev, dtype=torch.bfloat16)}
                    if plan is not None:
                        levels["plan"] = (lambda: plan(x)) if scheme == "w4a16" else (lambda: plan(x, mod._cached_input_amax()))
                    layout = wsgemm._smem_layout(128, 128, wsgemm.gl.bfloat16)
                    levels["TensorDescriptor.from_tensor"] = lambda: TensorDescriptor.from_tensor(x, [128, 128], layout)
                    times: dict = {}
                    for _ in range(ROUNDS):
                        for mode in ("py", "c"):
                            launcher(mode, mod)
                            for _ in range(4):
                                mod(x)
                            times.setdefault(f"module {mode}", []).append(enqueue_us(lambda: mod(x)))
                            if plan is not None:
                                plan, _key = mod._plan(x)
                                times.setdefault(f"plan {mode}", []).append(enqueue_us(levels["plan"]))
                        launcher("c", mod)
                        for label, fn in levels.items():
                            if label != "plan":
                                times.setdefault(label, []).append(enqueue_us(fn))
                    med = {a: round(statistics.median(b), 2) for a, b in times.items()}
                    prof = profile_table(lambda: mod(x), CALLS, "tottime", 25)
                print(name, scheme, m, med, flush=True)
                res["layers"].append({"layer": name, "scheme": scheme, "m": m, "host_us": med, "all_us": times,
                                      "planned": plan is not None})
                res["tables"][f"{name} {scheme} M={m}"] = prof


def model_part(res: dict) -> None:
    base = e2e.build_model()
    ids = torch.randint(0, e2e.SIZES["vocab_size"], (1, PROMPT), device=dev, generator=torch.Generator(device=dev).manual_seed(0))
    quant = e2e.quantized(base, "w4a16")[0]
    fwd_b = lambda: base(ids).logits  # noqa: E731
    fwd_q = lambda: quant(ids).logits  # noqa: E731
    same = torch.equal(outputs(fwd_q, "py", quant), outputs(fwd_q, "c", quant))
    res["checks"]["model logits"] = same
    if not same:
        raise AssertionError("model logits: C-launcher replays differ")
    variants = {"bf16": (fwd_b, None), "w4a16 py": (fwd_q, "py"), "w4a16 c": (fwd_q, "c")}
    walls: dict = {}
    enq: dict = {}
    with torch.no_grad():
        for _ in range(ROUNDS + 2):
            for label, (fwd, mode) in variants.items():
                if mode:
                    launcher(mode, quant)
                for _ in range(4):
                    fwd()
                for _ in range(3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fwd()
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    walls.setdefault(label, []).append((time.perf_counter() - t0) * 1e3)
                    enq.setdefault(label, []).append((t1 - t0) * 1e3)
        for label, (fwd, mode) in variants.items():
            if mode:
                launcher(mode, quant)
                for _ in range(4):
                    fwd()
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                fwd()
                torch.cuda.synchronize()
            gpu_ms = sum(e.device_time_total for e in p.key_averages()) / 1e3
            res["model"][label] = {"wall_ms": statistics.median(walls[label]), "enqueue_ms": statistics.median(enq[label]),
                                   "gpu_kernel_ms": gpu_ms, "walls": walls[label]}
            print(label, {a: (round(b, 2) if isinstance(b, float) else b) for a, b in res["model"][label].items() if a != "walls"},
                  flush=True)
            res["tables"][f"model {label} tottime"] = profile_table(fwd, 2, "tottime", 40)


def main() -> None:
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "layers": [], "model": {}, "tables": {},
           "checks": {}}
    parts = os.environ.get("PARTS", "layer,model").split(",")
    try:
        if "layer" in parts:
            layer_part(res)
        if "model" in parts:
            model_part(res)
    finally:
        with open(os.path.join(OUT, "prefill_host_h200.json"), "w") as f:
            json.dump({a: b for a, b in res.items() if a != "tables"}, f, indent=1)
        with open(os.path.join(OUT, "prefill_host_h200_tables.txt"), "w") as f:
            for a, b in res["tables"].items():
                f.write(f"==== {a}\n{b}\n")


if __name__ == "__main__":
    main()
