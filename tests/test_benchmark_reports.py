"""The parts of the benchmark scripts that run on any machine: the reports they write from a results file."""
from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench_module():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(BENCH))


def _row(model, layer, m, path, ours, n=4608, k=3584):
    return {"model": model, "layer": layer, "n": n, "k": k, "m": m, "dtype": "torch.bfloat16", "path": path,
            "ours_us": ours, "cublas_us": 10.0, "speedup": 10.0 / ours, "w4a4_us": ours + 2, "rel_err": 1.7e-3,
            "w4a4_rel_err": 1.6e-3}


def test_model_zoo_report_merges_files_and_compares_with_an_earlier_run(tmp_path, capsys, bench_module):
    report = bench_module("model_zoo_h200")
    first = tmp_path / "a.json"
    first.write_text(json.dumps({"rows": [_row("Qwen2-7B", "qkv", 128, "wgmma", 26.9),
                                          _row("Qwen2-7B", "o", 128, "wgmma", 20.8, 3584, 3584)]}))
    later = tmp_path / "b.json"
    later.write_text(json.dumps({"rows": [_row("Qwen2-7B", "qkv", 128, "wsgemm", 18.7)]}))
    assert report.main(["--report", str(first), str(later), "--before", str(first)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| model | layer | N x K | M |") and "ours / before" in lines[0]
    assert len(lines) == 4  # header, rule, the two rows (the later file's qkv row replaces the first's)
    assert "| Qwen2-7B | qkv | 4608 x 3584 | 128 | bfloat16 | wsgemm | 18.7 | 10.0 | 0.53x |" in lines[2]
    assert lines[2].endswith("| wgmma | 26.9 | 0.70 |") and lines[3].endswith("| wgmma | 20.8 | 1.00 |")


def test_model_zoo_report_names_a_file_it_cannot_use(tmp_path, bench_module):
    report = bench_module("model_zoo_h200")
    bad = tmp_path / "kernels.json"
    bad.write_text(json.dumps({"table": []}))
    with pytest.raises(SystemExit, match="kernels.json is not a model_zoo_h200.py results file"):
        report.main(["--report", str(bad)])
    with pytest.raises(SystemExit, match="cannot read"):
        report.main(["--report", str(tmp_path / "missing.json")])


def test_kernel_table_report_rebuilds_the_committed_table(tmp_path, bench_module):
    """``bench_kernels_h200.py --report`` on the committed run gives the committed markdown, byte for byte
    (the README's kernel table is read from it), and draws its figure."""
    pytest.importorskip("matplotlib")
    kernels = bench_module("bench_kernels_h200")
    for name in ("kernels_h200.json", "read_floor_h200.json"):
        shutil.copy(BENCH / "results" / name, tmp_path / name)
    kernels.report(str(tmp_path / "kernels_h200.json"))
    assert (tmp_path / "kernels_h200.md").read_text() == (BENCH / "results" / "kernels_h200.md").read_text()
    assert (tmp_path / "kernels_h200_speedup.png").stat().st_size > 10_000


def test_harness_records_rows_atomically_and_names_a_missing_peers_dir(tmp_path, monkeypatch, capsys, bench_module):
    import torch

    harness = bench_module("harness")
    res: dict = {"env": {}}
    save, record = harness.recorder(res, str(tmp_path / "out" / "run.json"))
    record("rows", {"shape": "8B.o", "us": 5.8123})
    record("rows", {"shape": "8B.qkv", "us": 7.0})
    assert json.loads((tmp_path / "out" / "run.json").read_text())["rows"][0] == {"shape": "8B.o", "us": 5.8123}
    assert '"us": 5.812' in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["run.json"]  # no temporary file left
    assert harness.md_table(["a", "b"], [[1, "x"]]) == ["| a | b |", "|---|---|", "| 1 | x |"]
    assert harness.rel(torch.tensor([1.0, float("nan")]), torch.ones(2)) != harness.rel(torch.ones(2), torch.ones(2))
    assert harness.rel(torch.ones(2), torch.ones(2)) == 0.0
    monkeypatch.setenv("MS", "1,16,")
    assert harness.env_list("MS", "8", int) == [1, 16]
    monkeypatch.setenv("PEERS_DIR", str(tmp_path / "nowhere"))
    monkeypatch.delitem(sys.modules, "peers_h200", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # peers() puts PEERS_DIR on it
    with pytest.raises(SystemExit, match="peers_h200.py not found in PEERS_DIR="):
        harness.peers()
