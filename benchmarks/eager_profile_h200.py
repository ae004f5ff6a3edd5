"""Where an eager decode step's host time goes: the Llama-3.1-8B-shaped model of
``e2e_decode_h200.py`` (bf16, then RTN W4A16), ms a step over 10 eager steps, then cProfile tables
(by own time and by cumulative time) of 5 steps. Prints only (diagnosis for benchmarks/NOTES.md).

    PYTHONPATH=$PWD python benchmarks/eager_profile_h200.py
"""
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_decode_h200 as e2e  # noqa: E402


def main():
    base = e2e.build_model()
    for scheme in ("bf16", "w4a16"):
        model = base if scheme == "bf16" else e2e.quantized(base, scheme)[0]
        d = e2e.Decoder(model, 1)
        d.prefill()
        for _ in range(4):
            d.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            d.step()
        torch.cuda.synchronize()
        print(scheme, "eager ms a step", (time.perf_counter() - t0) * 100, flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            d.step()
        torch.cuda.synchronize()
        prof.disable()
        for order, rows in (("tottime", 30), ("cumtime", 45)):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(rows)
            print(text.getvalue()[:8000])


if __name__ == "__main__":
    main()
