"""``fp4ptq inspect``: a saved checkpoint checked as ``fp4ptq.load`` checks it (and against its recorded
hashes), then its per-layer table and plot."""
from __future__ import annotations

import json
from pathlib import Path

from .common import EXIT_MISSING, EXIT_OK, OUT_ROOT, CLIError, _is_checkpoint


def cmd_inspect(args) -> int:
    from ..eval.report import (
        inspect_checkpoint,
        inspect_markdown,
        inspect_plot,
        write_atomic,
    )

    path = Path(args.dir).expanduser()
    if not path.is_dir():
        raise CLIError(f"{path} is not a directory; give a checkpoint directory written by `fp4ptq quantize`",
                       EXIT_MISSING)
    from ..checkpoint import check_packed_has_config, validate

    if (path / "config.json").is_file():
        check_packed_has_config(path)   # packed tensors whose config lost its quantization_config: exit 5
    # what fp4ptq.load checks (config, headers, plan, names, shapes, dtypes) and the recorded hashes
    checked = validate(path, verify=not args.no_verify) if _is_checkpoint(path) else None
    try:
        summary = inspect_checkpoint(path)
    except FileNotFoundError as exc:
        raise CLIError(str(exc), EXIT_MISSING) from exc
    output = Path(args.output) if args.output else OUT_ROOT / f"inspect-{path.resolve().name}"
    text = inspect_markdown(summary)
    write_atomic(output / "inspect.json", json.dumps(summary, indent=2) + "\n")
    write_atomic(output / "inspect.md", text)
    png = inspect_plot(summary, output / "inspect.png")
    print(text)
    t = summary["totals"]
    err = f", mean rel. error {t['mean_rel_error']:.4f}" if t["mean_rel_error"] is not None else ""
    share = f", 4/6 share {t['four_share']:.3f}" if t["four_share"] is not None else ""
    if checked is None:
        verified = "not checked (no config.json with a quantization_config)"
    elif args.no_verify:
        verified = "hashes not checked (--no-verify): names, shapes and dtypes checked"
    elif checked["verified"] is None:
        verified = "no tensor hashes recorded (not written by fp4ptq): names, shapes and dtypes checked"
    else:
        verified = f"all {checked['verified']} tensors match their recorded hashes"
    print(f"{path.name}: {t['quantized_layers']} NVFP4 layers, {t['total_bytes'] / 2**20:.1f} MiB of tensors"
          f"{err}{share}; {verified}. Table and plot: {output / 'inspect.md'}, {png}")
    return EXIT_OK

