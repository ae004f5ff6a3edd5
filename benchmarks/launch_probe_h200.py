"""Where the host time of one eager NVFP4Linear call goes, layer by layer of the call stack: the wall
time a call of back-to-back loops (the GPU idles between these small kernels, so wall = host time),
each level in interleaved rounds (the device's host drifts 30% between runs), medians:

    torch.empty          an allocation (the floor of any torch call)
    F.linear             bf16 cuBLAS on the same layer (the peer)
    compiled.run         Triton's C launcher with the bound arguments ready (what any launch pays)
    binder               Triton's argument binding / specialization alone
    binder+key           ... and its kernel-cache key
    kernel[grid]         a full Triton launch (binder, cache lookup, launcher)
    fast_launch          fp4ptq's launch cache (kernels/_launch.py), when present
    gemm._matmul         fp4ptq's shape rules + launch, below the dispatch
    linear_w4a16         the dispatch point (backend choice)
    module (no plans)    NVFP4Linear.forward through the dispatch (FP4PTQ_LAUNCH_PLANS=0)
    module               NVFP4Linear.forward: its launch plan for the shape, replayed past Triton's binder

Then a check: every layer x M (1, 2, 3, 16, 64, 128, 512) x (W4A16 with and without a bias, W4A4 with and without
Four Over Six) called 6 times through its module's plan, each output equal bit for bit to the
dispatch's (``kernels.linear_w4a16`` / ``linear_w4a4``). W4A4 modules are timed too (``w4a4 module``).

    PYTHONPATH=$PWD python benchmarks/launch_probe_h200.py   # $OUT/launch_probe_h200.json

Knobs: SHAPES (8B.q,8B.down), MS (1,16), CALLS (2000), ROUNDS (5), CHECK_MS (1,2,3,16,64,128,512).
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from fp4ptq import kernels, modules, nvfp4
from fp4ptq.kernels import gemm
from fp4ptq.modules import NVFP4Linear

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_overhead_h200 import per_call_us  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
ALL = {"8B.q": (4096, 4096), "8B.k": (1024, 4096), "8B.down": (4096, 14336), "8B.gate": (14336, 4096)}
SHAPES = os.environ.get("SHAPES", "8B.q,8B.down").split(",")
MS = [int(m) for m in os.environ.get("MS", "1,16").split(",")]
CALLS = int(os.environ.get("CALLS", 2000))
ROUNDS = int(os.environ.get("ROUNDS", 5))
CHECK_MS = [int(m) for m in os.environ.get("CHECK_MS", "1,2,3,16,64,128,512").split(",")]
dev = torch.device("cuda")


class Spy:
    """Stands in for a JITFunction: records the last launch (grid, args, kwargs) and forwards it."""

    def __init__(self, kernel):
        self.kernel, self.last = kernel, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.last = (grid, args, kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def triton_levels(kernel, grid, args, kwargs):
    """The Triton-side levels of one recorded launch."""
    from triton.runtime.jit import compute_cache_key

    device = torch.cuda.current_device()
    compiled = kernel.run(*args, grid=grid, warmup=False, **kwargs)
    kw = dict(kwargs)
    kw["debug"] = kernel.debug
    kernel_cache, key_cache, _, _, binder = kernel.device_caches[device]
    bound, spec, opts = binder(*args, **kw)
    values = list(bound.values())
    g = tuple(grid) + (1,) * (3 - len(grid))
    stream = torch._C._cuda_getCurrentRawStream(device)
    run, fn, meta = compiled.run, compiled.function, compiled.packed_metadata

    def direct():
        run(g[0], g[1], g[2], stream, fn, meta, None, None, None, *values)

    def direct_stream():
        run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), fn, meta, None, None, None, *values)

    def bind():
        binder(*args, **kw)

    def bind_key():
        _, s, o = binder(*args, **kw)
        compute_cache_key(key_cache, s, o)

    def full():
        kernel[grid](*args, **kwargs)

    return {"compiled.run": direct, "compiled.run+stream": direct_stream, "binder": bind, "binder+key": bind_key,
            "kernel[grid]": full}


def no_plans(mod, x):
    modules.LAUNCH_PLANS = False
    try:
        return mod(x)
    finally:
        modules.LAUNCH_PLANS = True


def check(res, g):
    """Plans against the dispatch, bit for bit, over repeated calls (the third on replays)."""
    bad = []
    for name, (n, k) in ALL.items():
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        q = nvfp4.quantize(w)
        variants = {"w4a16": dict(bias=None), "w4a16+bias": dict(bias=torch.randn(n, device=dev, generator=g)),
                    "w4a4": dict(scheme="w4a4", input_amax=torch.tensor(3.0)),
                    "w4a4+mse": dict(scheme="w4a4", input_amax=torch.tensor(3.0), act_four_six="mse")}
        for variant, kw in variants.items():
            mod = NVFP4Linear.from_quantized(q, dtype=torch.bfloat16, **kw).to(dev)
            for m in CHECK_MS:
                for call in range(6):
                    x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
                    with torch.no_grad():
                        y = mod(x)
                        if mod.scheme == "w4a4":
                            ref = kernels.linear_w4a4(x, mod.quantized_weight(), mod.input_amax(), mod.bias,
                                                      four_six=mod.act_four_six)
                        else:
                            ref = kernels.linear_w4a16(x, mod.quantized_weight(), mod.bias)
                    if not torch.equal(y, ref):
                        bad.append((name, m, variant, call, float((y.float() - ref.float()).abs().max())))
                plan = mod._plans.get(mod._plan_key(x)) if mod._plans else None
                res.setdefault("planned", {})[f"{name} M={m} {variant}"] = plan is not None
    res["check_mismatches"] = bad
    print("plan check mismatches:", bad[:10], "planned:", sum(res["planned"].values()), "of", len(res["planned"]),
          [key for key, v in res["planned"].items() if not v][:20], flush=True)


def main():
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": []}
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        pass
    g = torch.Generator(device=dev).manual_seed(0)
    check(res, g)
    cases = []
    for name in SHAPES:
        n, k = ALL[name]
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        q = nvfp4.quantize(w)
        mod = NVFP4Linear.from_quantized(q, dtype=torch.bfloat16)
        mod4 = NVFP4Linear.from_quantized(q, scheme="w4a4", input_amax=torch.tensor(3.0), dtype=torch.bfloat16).to(dev)
        weight = mod.quantized_weight()
        for m in MS:
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            levels = {
                "torch.empty": lambda m=m, n=n: torch.empty(m, n, dtype=torch.bfloat16, device=dev),
                "F.linear": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                "gemm._matmul": lambda x=x, weight=weight: gemm._matmul(x, weight, None),
                "linear_w4a16": lambda x=x, weight=weight: kernels.linear_w4a16(x, weight),
                "module (no plans)": lambda x=x, mod=mod: no_plans(mod, x),
                "module": lambda x=x, mod=mod: mod(x),
                "w4a4 module (no plans)": lambda x=x, mod=mod4: no_plans(mod, x),
                "w4a4 module": lambda x=x, mod=mod4: mod(x),
            }
            # record the launch the dispatch makes at this shape (gemv6 / gemv7 at M <= 2)
            spies = {}
            for attr in ("_gemv_resident_kernel", "_gemv_stream_kernel"):
                spies[attr] = Spy(getattr(gemm, attr))
                setattr(gemm, attr, spies[attr])
            try:
                with torch.no_grad():
                    gemm._matmul(x, weight, None)
            finally:
                for attr, spy in spies.items():
                    setattr(gemm, attr, spy.kernel)
            for spy in spies.values():
                if spy.last is not None:
                    levels.update(triton_levels(spy.kernel, *spy.last))
                    res.setdefault("kernels", {})[f"{name} M={m}"] = spy.kernel.fn.__name__
            cases.append((name, m, levels))
    times = {}
    with torch.no_grad():
        for r in range(ROUNDS):
            for name, m, levels in cases:
                for level, fn in levels.items():
                    times.setdefault((name, m, level), []).append(per_call_us(fn, CALLS))
            print("round", r, flush=True)
    for (name, m, level), ts in times.items():
        row = {"layer": name, "m": m, "level": level, "us": statistics.median(ts), "rounds": ts}
        res["rows"].append(row)
        print(f"{name:8s} M={m:<3d} {level:22s} {row['us']:8.2f} us", flush=True)
    with open(os.path.join(OUT, "launch_probe_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
