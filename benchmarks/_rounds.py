"""Helpers the H200 benchmark scripts share (they run their work on import, so they cannot import each
other): interleaved timing rounds and the relative error against a reference."""
from __future__ import annotations

import statistics

import peers_h200 as peers


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
