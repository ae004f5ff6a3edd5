"""Markdown table of ``model_zoo_h200.py`` results (any machine, no GPU): per model layer and M, the
dispatch's path, its time against cuBLAS bf16 measured in the same run, the error against the reference
decode, and, with ``--before``, the time of an earlier results file on the same rows.

    python benchmarks/model_zoo_report.py benchmarks/results/model_zoo_h200_s28.json \
        --before benchmarks/results/model_zoo_h200_s27.json > benchmarks/results/model_zoo_h200_s28.md

Several results files are merged (a later file's row replaces an earlier one's for the same model, layer,
M and dtype).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _key(row: dict) -> tuple:
    return row["model"], row["layer"], row["m"], row.get("dtype", "torch.bfloat16")


def load_rows(paths) -> dict:
    """The rows of the results files ``paths`` by (model, layer, M, dtype), later files first."""
    rows = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"model_zoo_report: cannot read {path}: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise SystemExit(f"model_zoo_report: {path} is not a model_zoo_h200.py results file (no 'rows' list)")
        for row in data["rows"]:
            rows[_key(row)] = row
    return rows


def table(rows: dict, before: dict) -> str:
    """The markdown table, rows ordered as measured (model, layer, then M)."""
    head = ["model", "layer", "N x K", "M", "dtype", "path", "ours (us)", "cuBLAS bf16 (us)", "x cuBLAS",
            "W4A4 (us)", "rel. error", "W4A4 rel. error"]
    if before:
        head += ["before: path", "before (us)", "ours / before"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, row in rows.items():
        cells = [row["model"], row["layer"], f"{row['n']} x {row['k']}", str(row["m"]),
                 row.get("dtype", "torch.bfloat16").replace("torch.", ""), row["path"], f"{row['ours_us']:.1f}",
                 f"{row['cublas_us']:.1f}", f"{row['speedup']:.2f}x", f"{row['w4a4_us']:.1f}",
                 f"{row['rel_err']:.1e}", f"{row['w4a4_rel_err']:.1e}"]
        if before:
            old = before.get(key)
            cells += ([old["path"], f"{old['ours_us']:.1f}", f"{row['ours_us'] / old['ours_us']:.2f}"] if old
                      else ["", "", ""])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="model_zoo_h200.py results files (JSON)")
    ap.add_argument("--before", nargs="*", default=[], help="earlier results files to compare with")
    args = ap.parse_args(argv)
    rows = load_rows(args.results)
    before = load_rows(args.before) if args.before else {}
    sys.stdout.write(table(rows, before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
