"""What the benchmark scripts share: the peers, CUDA-graph timing, and writing results.

Every time is what ``peers_h200.bench`` measures for ours and the peers alike: the median of a CUDA
graph of 10 calls, replayed (host overhead out, as engines run decode). ``peers_h200.py`` (cuBLAS,
torch's tinygemm int4, GemLite) is not part of the project: copy it from ``../shared/bench/`` into
``.peers/`` (git-ignored) and carry that folder to the GPU machine (``/work/shared/docs/BENCHMARKS.md``).

Results go to ``$OUT`` (default: the current directory) as ``NAME.json`` (everything), ``NAME.md`` (the
table) and, where a script draws one, ``NAME.png``; the files the README and docs/ cite are copied into
``benchmarks/results/``. Nothing here needs a GPU until a function times or captures something.
"""
from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
EVALDATA = Path(__file__).resolve().parents[2] / "shared" / "evaldata"   # beside the checkout
# Llama-3.1 linear layers (N out, K in): the rows of the README's kernel table
LLAMA_LAYERS = {
    "8B.qkv": (6144, 4096),
    "8B.o": (4096, 4096),
    "8B.gate_up": (28672, 4096),
    "8B.down": (4096, 14336),
    "70B.gate_up": (57344, 8192),
    "70B.down": (8192, 28672),
}


def env_list(name: str, default: str, kind=str) -> list:
    """A comma-separated knob from the environment, e.g. ``env_list("MS", "1,16", int)``."""
    return [kind(v) for v in os.environ.get(name, default).split(",") if v]


def out_path(name: str) -> str:
    """Where a results file named ``name`` goes: under ``$OUT`` (the device tool's folder) or here."""
    return os.path.join(os.environ.get("OUT", "."), name)


def peers():
    """The ``peers_h200`` module from ``$PEERS_DIR`` (default ``.peers``): ``bench``, ``env``,
    ``copy_bw``, ``bf16_peak``, ``make_tinygemm``, ``make_gemlite_int4``."""
    folder = os.environ.get("PEERS_DIR", ".peers")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        return importlib.import_module("peers_h200")
    except ImportError as exc:
        raise SystemExit(f"peers_h200.py not found in PEERS_DIR={folder!r}: copy ../shared/bench/peers_h200.py "
                         f"there and carry the folder (see BENCHMARKS.md): {exc}") from exc


def graph_us(fn) -> float:
    """Median microseconds a call of ``fn``, from replays of a CUDA graph of 10 calls."""
    return peers().bench(fn) * 1e3


def interleaved(fns: dict, rounds: int) -> dict:
    """Median us a call of each function, timed in ``rounds`` interleaved rounds (peers and ours move a
    few % between passes); a function that raises gets its error's text instead of a time."""
    times: dict = {}
    for _ in range(rounds):
        for label, fn in fns.items():
            try:
                times.setdefault(label, []).append(graph_us(fn))
            except Exception as exc:  # noqa: BLE001 - record and go on
                times[label] = repr(exc)[:300]
    return {a: (statistics.median(b) if isinstance(b, list) else b) for a, b in times.items()}


def rel(y, ref) -> float:
    """Relative Frobenius error of ``y`` against ``ref`` (both in fp32); NaN if ``y`` is not finite."""
    import torch

    y = y.float()
    if not torch.isfinite(y).all():
        return float("nan")
    return float((y - ref.float()).norm() / ref.float().norm())


def graph_replays(fn, times: int = 5) -> list:
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream) and replayed ``times`` times:
    the capture's output after each replay, cloned."""
    import torch

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


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temporary file beside it, then a rename)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: str, obj) -> None:
    write_text(path, json.dumps(obj, indent=1) + "\n")


def recorder(res: dict, path: str, digits: int = 3):
    """``(save, record)`` for a script's results ``res`` kept as JSON at ``path``: ``save()`` rewrites the
    file (so a run cut short keeps its rows); ``record(key, row)`` appends ``row`` to ``res[key]``,
    prints it (floats to ``digits``) and saves."""
    def save() -> None:
        write_json(path, res)

    def record(key: str, row: dict) -> None:
        res.setdefault(key, []).append(row)
        print(json.dumps({a: (round(b, digits) if isinstance(b, float) else b) for a, b in row.items()}), flush=True)
        save()
    return save, record


def read_results(path: str, script: str) -> dict:
    """A results file of ``script`` (a dict with a ``rows`` list), or ``SystemExit`` naming the file and
    what is wrong with it."""
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"{script}: cannot read {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise SystemExit(f"{script}: {path} is not a {script}.py results file (no 'rows' list)")
    return data


def md_table(head: list, rows: list) -> list:
    """Markdown lines of a table: the header, the rule, one line a row (cells as given, str()-ed)."""
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
