"""What the command bodies share: the exit codes and ``CLIError``, messages on stderr, device and dtype
choice, output directories, model names and recipe labels."""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Optional

OUT_ROOT = Path("fp4ptq-out")

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_MISSING, EXIT_EXISTS, EXIT_UNSUPPORTED = 0, 1, 2, 3, 4, 5
EXIT_INTERRUPTED = 130
EXIT_CODES = f"""exit codes:
  {EXIT_OK}    success
  {EXIT_INTERNAL}    internal error (a bug: the traceback is printed; please report it)
  {EXIT_USAGE}    usage error: bad option or value, unknown task or method, invalid recipe
  {EXIT_MISSING}    input not found or unreachable: model, data file, hub access
  {EXIT_EXISTS}    the output already exists (pass --overwrite or choose another --output)
  {EXIT_UNSUPPORTED}    model or checkpoint not supported (architecture, model type) or damaged
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)"""


class CLIError(Exception):
    """An error the user can fix; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


def _say(message: str, *, every_rank: bool = False) -> None:
    """A message on stderr; under torchrun from rank 0 only, unless ``every_rank`` (errors, prefixed with the rank)."""
    from ..distributed import world

    w = world()
    if every_rank or w.main:
        print(f"fp4ptq: {f'rank {w.rank}: ' if w.parallel and every_rank else ''}{message}", file=sys.stderr,
              flush=True)


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    return name


def _dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _model_name(spec: Optional[str]) -> str:
    """A short name for file names and tables: the demo, a hub id's tail, a dir or a file stem."""
    from ..sources import DEMO_FILE

    if not spec or spec == "demo":
        return DEMO_FILE.split(".")[0]
    p = Path(spec.rstrip("/"))
    return p.stem if p.suffix.lower() == ".gguf" else p.name


def _prepare_output(path: Path, overwrite: bool, what: str, marker: Optional[str] = None) -> None:
    """Fail before any work when ``path`` exists; with ``--overwrite``, only an fp4ptq output (a
    model directory, or one holding ``marker``) or an empty directory may be replaced."""
    from ..checkpoint import is_model_output

    if path.exists() and not path.is_dir():
        raise CLIError(f"{path} exists and is not a directory; choose another --output", EXIT_EXISTS)
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise CLIError(f"{what} {path} already exists; pass --overwrite to replace it or choose another --output",
                           EXIT_EXISTS)
        ours = (path / marker).is_file() if marker else is_model_output(path)
        if not ours:
            raise CLIError(f"--overwrite: {path} is not empty and not an fp4ptq output (no "
                           f"{marker or 'config.json'}); refusing to replace it. Choose another --output",
                           EXIT_EXISTS)


def _is_checkpoint(path: Path) -> bool:
    """A directory holding a quantized checkpoint (config.json with a quantization_config)."""
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        return "quantization_config" in json.loads(config.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return False


def _recipe_text(config: Optional[dict]) -> Optional[str]:
    if not config:
        return None
    four_six = f", 4/6 {config['four_six']}" if config.get("four_six") else ""
    return f"{config['method']}{_options(config, ' + ')}{four_six}, {config['scheme']}"


def _options(config: dict, sep: str) -> str:
    """The non-default search options that change the result: AWQ clipping, GPTQ act-order."""
    opts = [name for key, name in (("awq_clip", "clip"), ("gptq_act_order", "act-order"))
            if config.get(key) and (key != "awq_clip" or "awq" in config["method"])
            and (key != "gptq_act_order" or "gptq" in config["method"])]
    if config.get("rotate"):
        opts.append(f"rot{config['rotate']}" + ("" if config.get("rotate_residual", True) else "x"))
    if config.get("weight_scale_search"):
        opts.append("wscale")
    if config.get("keep_budget"):
        opts.append(f"keep{str(config['keep_budget']).rstrip('%')}")
    return "".join(sep + o for o in opts)


def _quiet_libraries(quiet: bool) -> contextlib.AbstractContextManager:
    """With ``--quiet``: no progress bars from transformers (weight loading) or datasets."""
    if not quiet:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    from transformers.utils import logging as hf_logging

    if hf_logging.is_progress_bar_enabled():
        hf_logging.disable_progress_bar()
        stack.callback(hf_logging.enable_progress_bar)
    from ..eval.tasks import patched, silent_tqdm

    # transformers' GGUF reader draws its bar with plain tqdm, which disable_progress_bar does not reach
    stack.enter_context(patched([("transformers.modeling_gguf_pytorch_utils", "tqdm", silent_tqdm())]))
    try:
        import datasets
    except ImportError:
        return stack
    if datasets.is_progress_bar_enabled():
        datasets.disable_progress_bars()
        stack.callback(datasets.enable_progress_bars)
    return stack
