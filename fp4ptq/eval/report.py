"""Evaluation and checkpoint reports: JSON (the record), markdown (to read), PNG (to look at).

An evaluation report is a JSON-able dict::

    {"fp4ptq_version", "created", "command", "settings": {...},
     "models": [{"name", "spec", "kind", "recipe", "quantization", "results": {task: result}}, ...],
     "reference": 0 | None}

``results[task]`` is what ``perplexity()`` returns for wikitext/c4 and what
``run_tasks()`` returns per task otherwise. With a reference (``--baseline``), the
other models' rows carry deltas against it. Several reports (one model each) can
be merged with ``merge_reports`` for a side-by-side table of many recipes.
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

PERPLEXITY_METRICS = (("token_perplexity", False), ("word_perplexity", False))
# (metric, higher_is_better) shown per task; the JSON keeps every metric lm-eval returned.
TABLE_METRICS = {
    "wikitext": PERPLEXITY_METRICS,
    "c4": PERPLEXITY_METRICS,
    "kld": (("kld", False), ("token_perplexity", False)),
    "arc_easy": (("acc_norm", True), ("acc", True)),
    "arc_challenge": (("acc_norm", True), ("acc", True)),
    "hellaswag": (("acc_norm", True), ("acc", True)),
    "piqa": (("acc_norm", True), ("acc", True)),
    "boolq": (("acc", True),),
    "winogrande": (("acc", True),),
    "lambada_openai": (("acc", True), ("perplexity", False)),
}


# ---------------------------------------------------------------------------- files

def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)   # mkstemp makes 0600; give the mode a plain open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _save_figure(fig, path: Path) -> Path:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    return write_atomic(path, buf.getvalue())


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---------------------------------------------------------------------------- eval reports

def new_report(models: list[dict], settings: dict, *, reference: Optional[int] = None,
               command: Optional[str] = None) -> dict:
    from .. import __version__

    return {
        "fp4ptq_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "settings": settings,
        "models": models,
        "reference": reference,
    }


def merge_reports(reports: list[dict], *, reference: Optional[int] = 0) -> dict:
    """One report holding every model of ``reports`` in order (deltas against ``reference``)."""
    models = [m for r in reports for m in r["models"]]
    return new_report(models, reports[0]["settings"], reference=reference, command="merged")


def metric_value(result: dict, metric: str) -> Optional[float]:
    if metric in result:                       # perplexity tasks: flat dict
        return result[metric]
    return result.get("metrics", {}).get(metric)


def _stderr(result: dict, metric: str) -> Optional[float]:
    return result.get("metrics", {}).get(f"{metric}_stderr")


def table_rows(report: dict) -> list[dict]:
    """One row per (task, metric): values per model and deltas against the reference."""
    tasks = []
    for m in report["models"]:
        tasks += [t for t in m["results"] if t not in tasks]
    rows = []
    ref = report.get("reference")
    for task in tasks:
        metrics = TABLE_METRICS.get(task, ())
        for metric, higher_better in metrics:
            values = [metric_value(m["results"][task], metric) if task in m["results"] else None
                      for m in report["models"]]
            if all(v is None for v in values):
                continue
            stderrs = [_stderr(m["results"].get(task, {}), metric) for m in report["models"]]
            deltas = [None] * len(values)
            if ref is not None and values[ref] is not None:
                deltas = [None if (i == ref or v is None) else v - values[ref] for i, v in enumerate(values)]
            rows.append({"task": task, "metric": metric, "higher_is_better": higher_better,
                         "values": values, "stderrs": stderrs, "deltas": deltas})
    return rows


def _is_accuracy(metric: str) -> bool:
    return metric.startswith("acc")


def _fmt_value(metric: str, value: Optional[float], stderr: Optional[float] = None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if _is_accuracy(metric):
        text = f"{100 * value:.2f}"
        return text + (f" ± {100 * stderr:.2f}" if stderr else "")
    return f"{value:.3f}" if value < 100 else f"{value:.1f}"


def _fmt_delta(metric: str, delta: Optional[float], ref_value: Optional[float], higher_better: bool) -> str:
    if delta is None:
        return ""
    if _is_accuracy(metric):
        text = f"{100 * delta:+.2f} pt"
    else:
        text = f"{delta:+.3f} ({100 * delta / ref_value:+.1f}%)" if ref_value else f"{delta:+.3f}"
    return text


def _samples_note(report: dict) -> list[str]:
    # Each task described once, in the order the tasks first appear, from the first model whose result
    # says what ran (not one that only stands for the baseline, such as kld's "the baseline itself").
    chosen: dict = {}
    for m in report["models"]:
        for task, res in m["results"].items():
            if task not in chosen or not _describes(chosen[task]) and _describes(res):
                chosen[task] = res
    lines = []
    for task, res in chosen.items():
        if "windows" in res:
            words = (f"; word ppl over {res['word_documents']}/{res['documents']} documents"
                     if res.get("word_perplexity") is not None else "")
            what = f"; {res['protocol']}" if task == "kld" and res.get("protocol") else ""
            lines.append(f"- {task}: {res['windows']}/{res['windows_available']} windows of {res['seqlen']} "
                         f"tokens ({res['tokens']:,} scored tokens){words}{what}; data: {res['source']}")
        else:
            lines.append(f"- {task}: {res.get('samples')}/{res.get('samples_available')} items, "
                         f"{res.get('num_fewshot', 0)}-shot; data: {res.get('source')}")
        lines += [f"  - note: {n}" for n in res.get("notes", [])]
    return lines


def _describes(res: dict) -> bool:
    return "windows" in res or "samples" in res


def markdown(report: dict) -> str:
    """A readable markdown page: settings, one table (models side by side, deltas), notes."""
    models = report["models"]
    ref = report.get("reference")
    header = ["task", "metric"]
    for i, m in enumerate(models):
        header.append(m["name"])
        if ref is not None and i != ref:
            header.append(f"Δ vs {models[ref]['name']}")
    lines = ["# fp4ptq evaluation", ""]
    for m in models:
        recipe = f" — {m['recipe']}" if m.get("recipe") else ""
        lines.append(f"- **{m['name']}**: `{m['spec']}` ({m['kind']}){recipe}")
    settings = report.get("settings", {})
    lines += ["", "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items() if v is not None), ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in table_rows(report):
        arrow = "↑" if row["higher_is_better"] else "↓"
        cells = [row["task"], f"{row['metric']} {arrow}"]
        for i, (v, se, d) in enumerate(zip(row["values"], row["stderrs"], row["deltas"])):
            cells.append(_fmt_value(row["metric"], v, se))
            if ref is not None and i != ref:
                cells.append(_fmt_delta(row["metric"], d, row["values"][ref], row["higher_is_better"]))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Accuracies in %, ± one standard error (lm-eval); perplexities lower is better.", ""]
    lines += ["What was evaluated:"] + _samples_note(report) + [""]
    return "\n".join(lines)


def plot(report: dict, path: str | Path) -> Path:
    """Grouped bars: accuracies (left) and perplexities (right), one colour per model."""
    plt = _pyplot()
    rows = table_rows(report)
    # One bar group per task: its first (primary) metric.
    seen, primary = set(), []
    for row in rows:
        if row["task"] not in seen:
            seen.add(row["task"])
            primary.append(row)
    panels = [("accuracy (%)", [r for r in primary if _is_accuracy(r["metric"])], 100.0),
              ("perplexity", [r for r in primary if not _is_accuracy(r["metric"])], 1.0)]
    panels = [p for p in panels if p[1]]
    widths = [max(2, len(p[1])) for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(1.6 * sum(widths) + 2, 4), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    names = [m["name"] for m in report["models"]]
    bar = 0.8 / len(names)
    for ax, (title, prow, scale) in zip(axes[0], panels):
        for j, name in enumerate(names):
            xs = [i + (j - (len(names) - 1) / 2) * bar for i in range(len(prow))]
            vals = [(r["values"][j] or 0.0) * scale for r in prow]
            # One standard error (lm-eval's) as error bars, where the metric has one.
            errs = [(r["stderrs"][j] or 0.0) * scale for r in prow]
            bars = ax.bar(xs, vals, bar, label=name, yerr=errs if any(errs) else None,
                          error_kw={"elinewidth": 0.8, "capsize": 2, "ecolor": "0.3"})
            ax.bar_label(bars, fmt="%.1f" if scale > 1 else "%.2f", fontsize=6, padding=2)
        ax.set_xticks(range(len(prow)))
        ax.set_xticklabels([f"{r['task']}\n{r['metric']}" for r in prow], fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    # The legend goes below the panels, where it covers no bar.
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = len(names) if len(names) <= 4 else 3
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.suptitle("fp4ptq eval" + (" (error bars: one standard error)" if any(
        e for r in primary for e in r["stderrs"] if e) else ""))
    fig.tight_layout(rect=(0, 0.08 + 0.04 * ((len(names) - 1) // ncol), 1, 1))
    out = _save_figure(fig, Path(path))
    plt.close(fig)
    return out


def write_report(report: dict, out_dir: str | Path, *, stem: str = "report") -> dict[str, Path]:
    """Write ``{stem}.json``, ``{stem}.md`` and ``{stem}.png`` into ``out_dir`` (each atomically)."""
    out_dir = Path(out_dir)
    paths = {
        "json": write_atomic(out_dir / f"{stem}.json", json.dumps(report, indent=2, default=str) + "\n"),
        "markdown": write_atomic(out_dir / f"{stem}.md", markdown(report)),
    }
    if table_rows(report):
        paths["png"] = plot(report, out_dir / f"{stem}.png")
    return paths


def load_report(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    if "models" not in data or "settings" not in data:
        raise ValueError(f"{path} is not an fp4ptq eval report (no 'models'/'settings' keys)")
    return data


# ---------------------------------------------------------------------------- checkpoint inspection

def _tensor_bytes(checkpoint: Path) -> dict[str, int]:
    """{tensor name: bytes on disk}, from the safetensors headers only (no tensor is read)."""
    from ..checkpoint import checkpoint_files, read_headers

    def itemsize(dtype: str) -> int:   # safetensors names: "BOOL", "U8", "F8_E4M3", "BF16", "F32", ...
        bits = re.match(r"[A-Z]+(\d+)", dtype)
        return max(1, int(bits.group(1)) // 8) if bits else 1

    return {name: math.prod(info.shape) * itemsize(info.dtype)
            for name, info in read_headers(checkpoint_files(checkpoint)).items()}


def _natural_key(name: str) -> list:
    # "model.layers.10.x" after "model.layers.9.x": digit runs compare as numbers.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def inspect_checkpoint(checkpoint: str | Path) -> dict:
    """Per-layer facts of a saved checkpoint: shape, scheme, 4/6 share, recorded error, bytes on disk."""
    checkpoint = Path(checkpoint)
    report_path = checkpoint / "fp4ptq_report.json"
    if not report_path.is_file():
        raise FileNotFoundError(
            f"{report_path} not found: {checkpoint} is not a checkpoint written by `fp4ptq quantize` / fp4ptq.save"
        )
    from ..integrity import read_report_checked

    info = read_report_checked(checkpoint)   # a field of the wrong type: CheckpointError naming it (exit 5)
    tensors = _tensor_bytes(checkpoint)
    layers, claimed = [], set()
    for name, rec in sorted(info.get("layers", {}).items(), key=lambda kv: _natural_key(kv[0])):
        mine = [t for t in tensors if t.startswith(name + ".")]
        claimed.update(mine)
        shape = rec.get("shape") or []
        layers.append({
            "name": name,
            "shape": shape,
            "scheme": rec.get("scheme"),
            "four_share": rec.get("four_share"),
            "rel_error": rec.get("rel_error"),
            "bytes": sum(tensors[t] for t in mine),
            "bf16_bytes": 2 * math.prod(shape) if shape else None,
        })
    other = sum(b for t, b in tensors.items() if t not in claimed)
    q_bytes = sum(layer["bytes"] for layer in layers)
    bf16 = sum(layer["bf16_bytes"] or 0 for layer in layers)
    errors = [layer["rel_error"] for layer in layers if layer["rel_error"] is not None]
    shares = [(layer["four_share"], math.prod(layer["shape"])) for layer in layers
              if layer["four_share"] is not None and layer["shape"]]
    totals = {
        "quantized_layers": len(layers),
        "quantized_bytes": q_bytes,
        "quantized_bf16_bytes": bf16,
        "compression_vs_bf16": (bf16 / q_bytes) if q_bytes else None,
        "other_bytes": other,
        "total_bytes": q_bytes + other,
        "mean_rel_error": sum(errors) / len(errors) if errors else None,
        "max_rel_error": max(errors) if errors else None,
        "four_share": (sum(s * n for s, n in shares) / sum(n for _, n in shares)) if shares else None,
    }
    collapsed, experts = group_experts(layers)
    return {
        "checkpoint": str(checkpoint),
        "config": info.get("config"),
        "calibration": info.get("calibration"),
        "high_precision": info.get("high_precision", {}),
        # every parameter tensor left in high precision, with its reason (fp4ptq >= issue 39's record)
        "kept_tensors": info.get("kept_tensors", {}),
        "rotation": info.get("rotation"),   # issue 43: block-Hadamard rotations
        "keep": info.get("keep"),           # issue 43: keep_budget's choice and measurements
        "layers": collapsed,
        "expert_layers": experts,
        "totals": totals,
    }


_EXPERT_NAME = re.compile(r"^(?P<moe>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)$")


def group_experts(layers: list) -> tuple:
    """``(rows, expert rows)``: every Mixture-of-Experts projection (``...experts.E.proj``)
    collapsed into one row per layer and projection (``...experts.*.proj``) with the
    minimum, mean and maximum error over its experts and their mean 4/6 share and
    total bytes; the per-expert rows are returned apart."""
    rows, experts, by_key = [], [], {}
    for layer in layers:
        match = _EXPERT_NAME.match(layer["name"])
        if match is None:
            rows.append(layer)
            continue
        experts.append(layer)
        key = f"{match['moe']}.*.{match['proj']}"
        if key not in by_key:
            by_key[key] = {**layer, "name": key, "experts": 0, "bytes": 0, "bf16_bytes": 0, "_err": [], "_share": []}
            rows.append(by_key[key])
        row = by_key[key]
        row["experts"] += 1
        row["bytes"] += layer["bytes"]
        row["bf16_bytes"] += layer["bf16_bytes"] or 0
        if layer["rel_error"] is not None:
            row["_err"].append(layer["rel_error"])
        if layer["four_share"] is not None:
            row["_share"].append(layer["four_share"])
    for row in by_key.values():
        errors, shares = row.pop("_err"), row.pop("_share")
        row["rel_error"] = sum(errors) / len(errors) if errors else None
        row["rel_error_min"] = min(errors) if errors else None
        row["rel_error_max"] = max(errors) if errors else None
        row["four_share"] = sum(shares) / len(shares) if shares else None
    return rows, experts


def kept_by_reason(kept: dict) -> dict:
    """``{reason: [tensor names]}`` in first-seen order, the names that differ only in their indices
    (layers, experts) collapsed into one with ``*`` and their count (``model.layers.*.input_layernorm.weight
    (30)``, ``...experts.*.gate_proj.bias``)."""
    out: dict = {}
    for name, why in kept.items():
        pattern = re.sub(r"(?<=\.)\d+(?=\.)", "*", name)
        names = out.setdefault(why, {})
        names[pattern] = names.get(pattern, 0) + 1
    return {why: [p if n == 1 or "*" not in p else f"{p} ({n})" for p, n in names.items()]
            for why, names in out.items()}


def _human_bytes(n: Optional[float]) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _fmt_opt(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def inspect_markdown(summary: dict) -> str:
    cfg = summary.get("config") or {}
    t = summary["totals"]
    lines = [f"# {summary['checkpoint']}", ""]
    if cfg:
        lines.append("Recipe: " + ", ".join(f"{k}={cfg[k]}" for k in ("method", "four_six", "scheme") if k in cfg))
        lines.append("")
    lines += ["| layer | shape | scheme | 4/6 share | rel. error | bytes |", "|---|---|---|---|---|---|"]
    for layer in summary["layers"]:
        error = _fmt_opt(layer["rel_error"], ".4f")
        name = layer["name"]
        if layer.get("experts"):   # min / mean / max over the experts of one MoE projection
            error = (f"{_fmt_opt(layer['rel_error_min'], '.4f')} / {error} / "
                     f"{_fmt_opt(layer['rel_error_max'], '.4f')}")
            name = f"{name} ({layer['experts']} experts)"
        lines.append(
            f"| {name} | {' x '.join(map(str, layer['shape']))} | {layer['scheme'] or '–'} | "
            f"{_fmt_opt(layer['four_share'], '.3f')} | {error} | "
            f"{_human_bytes(layer['bytes'])} |"
        )
    if summary.get("expert_layers"):
        lines += ["", "Experts: rel. error is min / mean / max over each projection's experts; 4/6 share their mean "
                      "(every expert's own row: `expert_layers` in inspect.json)."]
    lines += [
        "",
        f"Totals: {t['quantized_layers']} quantized layers, {_human_bytes(t['quantized_bytes'])} "
        f"(bf16 would be {_human_bytes(t['quantized_bf16_bytes'])}, "
        f"{_fmt_opt(t['compression_vs_bf16'], '.2f')}x smaller); other tensors {_human_bytes(t['other_bytes'])}; "
        f"checkpoint tensors {_human_bytes(t['total_bytes'])}.",
        f"Relative error: mean {_fmt_opt(t['mean_rel_error'], '.4f')}, max {_fmt_opt(t['max_rel_error'], '.4f')}; "
        f"4/6 share (blocks scaled to 4, weighted by size): {_fmt_opt(t['four_share'], '.3f')}.",
    ]
    if summary.get("high_precision"):
        lines += ["", "Kept in high precision: " + ", ".join(
            f"{name} ({why})" for name, why in summary["high_precision"].items())]
    if summary.get("kept_tensors"):
        lines += ["", f"Every tensor kept in high precision ({len(summary['kept_tensors'])}), by reason "
                      "(`kept_tensors` in inspect.json names each; layers and experts collapsed to `*`):"]
        lines += [f"- {why}: {', '.join(names)}" for why, names in kept_by_reason(summary["kept_tensors"]).items()]
    from .. import rotation, sensitivity

    for line in (rotation.describe(summary.get("rotation")), sensitivity.describe(summary.get("keep"))):
        if line:
            lines += ["", line]
    keep = summary.get("keep")
    if keep:
        lines += ["", "| part | KL increase | extra bytes in bf16 | kept |", "|---|---|---|---|"]
        kept = set(keep["kept_parts"])
        lines += [f"| {part} | {kl:.4g} | {keep['part_bytes'].get(part, 0)} | {'yes' if part in kept else ''} |"
                  for part, kl in keep["kl_increase"].items()]
    return "\n".join(lines) + "\n"


_BLOCK_NAME = re.compile(r"^(?P<stack>.*?)\.?(?P<block>\d+)\.(?P<kind>[^\d].*)$")


def inspect_series(layers: list) -> Optional[dict]:
    """Layers grouped for plotting against their decoder block: ``{kind: [(block, layer), ...]}`` with
    kind the name after the block index (``self_attn.q_proj``, ``mlp.down_proj``; prefixed by the layer
    stack where a model has several, such as a vision tower's), or None where a layer's name has no block
    index (then the plot shows the layers one by one)."""
    parsed = []
    for layer in layers:
        match = _BLOCK_NAME.match(layer["name"])
        if match is None:
            return None
        parsed.append((match["stack"], int(match["block"]), match["kind"], layer))
    several = len({stack for stack, *_ in parsed}) > 1
    series: dict = {}
    for stack, block, kind, layer in parsed:
        series.setdefault(f"{stack}.{kind}" if several else kind, []).append((block, layer))
    for points in series.values():
        points.sort(key=lambda p: p[0])
    return series


def inspect_plot(summary: dict, path: str | Path) -> Path:
    """Relative error of each quantized layer and its 4/6 share (blocks scaled to 4): against the decoder
    block, one line per projection (q, k, v, o, gate, up, down), where the names carry a block index;
    else one bar per layer in model order."""
    plt = _pyplot()
    layers = [layer for layer in summary["layers"] if layer["rel_error"] is not None]
    four = any(layer["four_share"] is not None for layer in layers)
    series = inspect_series(layers) if layers else None
    title = Path(summary["checkpoint"]).name
    if series is None:
        xs = range(len(layers))
        fig, ax = plt.subplots(figsize=(min(14, max(6, 0.18 * len(layers) + 2)), 4))
        ax.bar(xs, [layer["rel_error"] for layer in layers], color="tab:blue", label="relative error")
        ax.set_ylabel("relative Frobenius error")
        ax.set_xlabel("layer (model order)")
        if four:
            ax2 = ax.twinx()
            ax2.plot(list(xs), [layer["four_share"] if layer["four_share"] is not None else float("nan")
                                for layer in layers], color="tab:orange", marker=".", label="4/6 share")
            ax2.set_ylabel("share of blocks scaled to 4")
            ax2.set_ylim(0, 1)
            ax2.legend(loc="upper right", fontsize=8)
        if len(layers) <= 40:
            ax.set_xticks(list(xs))
            ax.set_xticklabels([layer["name"].removeprefix("model.") for layer in layers], rotation=90, fontsize=6)
        ax.legend(loc="upper left", fontsize=8)
        ax.set_title(title)
    else:
        fig, axes = plt.subplots(2 if four else 1, 1, figsize=(9, 7 if four else 4), sharex=True, squeeze=False)
        err_ax = axes[0][0]
        for kind, points in series.items():
            blocks = [b for b, _ in points]
            err_ax.plot(blocks, [layer["rel_error"] for _, layer in points], marker=".", label=kind)
            if four:
                axes[1][0].plot(blocks, [layer["four_share"] if layer["four_share"] is not None else float("nan")
                                         for _, layer in points], marker=".", label=kind)
        err_ax.set_ylabel("relative Frobenius error")
        err_ax.set_title(title)
        err_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
        err_ax.grid(alpha=0.3)
        if four:
            axes[1][0].set_ylabel("share of blocks scaled to 4")
            axes[1][0].grid(alpha=0.3)
        axes[-1][0].set_xlabel("decoder block")
    out = _save_figure(fig, Path(path))
    plt.close(fig)
    return out
