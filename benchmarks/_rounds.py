"""Helpers the H200 benchmark scripts share (they run their work on import, so they cannot import each
other): interleaved timing rounds, the relative error against a reference, and a results file saved as
rows come in."""
from __future__ import annotations

import json
import statistics

import peers_h200 as peers
import torch


def interleaved(fns: dict, rounds: int) -> dict:
    """Median us a call of each function, timed in ``rounds`` interleaved rounds (CUDA-graph replays,
    ``peers_h200.bench``); a function that raises gets its error's text instead of a time."""
    times = {}
    for _ in range(rounds):
        for label, fn in fns.items():
            try:
                times.setdefault(label, []).append(peers.bench(fn) * 1e3)
            except Exception as exc:  # noqa: BLE001 - record and go on
                times[label] = repr(exc)[:300]
    return {a: (statistics.median(b) if isinstance(b, list) else b) for a, b in times.items()}


def rel(y, ref) -> float:
    """Relative Frobenius error of ``y`` against ``ref`` (both taken in fp32)."""
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def graph_replays(fn, times: int = 5) -> list:
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream) and replayed ``times`` times:
    the capture's output after each replay, cloned."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    outs = []
    for _ in range(times):
        graph.replay()
        torch.cuda.synchronize()
        outs.append(out.clone())
    return outs


def weight_cache(generator, device):
    """``weight(n, k)``: an NVFP4 weight of random normal values * 0.02 drawn from ``generator`` on
    ``device``, and its bf16 decode, made once per shape."""
    from fp4ptq import nvfp4

    made = {}

    def weight(n, k):
        if (n, k) not in made:
            w = nvfp4.quantize(torch.randn(n, k, device=device, generator=generator) * 0.02)
            made[(n, k)] = (w, w.dequantize(torch.bfloat16))
        return made[(n, k)]
    return weight


def recorder(res: dict, path: str, digits: int = 3):
    """``(save, record)`` for a script's results ``res``, kept as JSON at ``path``: ``save()`` rewrites the
    file; ``record(key, row)`` appends ``row`` to ``res[key]``, prints it (floats rounded to ``digits``)
    and saves."""
    def save() -> None:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    def record(key: str, row: dict) -> None:
        res[key].append(row)
        print(json.dumps({a: (round(b, digits) if isinstance(b, float) else b) for a, b in row.items()}), flush=True)
        save()
    return save, record
