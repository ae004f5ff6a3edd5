"""``fp4ptq eval`` (perplexity, KL and lm-eval tasks, one model or side by side with a baseline) and
``fp4ptq compare`` (eval reports side by side)."""
from __future__ import annotations

import contextlib
import gc
import json
import shlex
import time
from pathlib import Path
from typing import Optional

from .common import (
    EXIT_MISSING,
    EXIT_OK,
    EXIT_UNSUPPORTED,
    OUT_ROOT,
    CLIError,
    _device,
    _dtype,
    _is_checkpoint,
    _model_name,
    _prepare_output,
    _recipe_text,
    _say,
)


def _load_model(spec: Optional[str], device: str, dtype, verify: bool = True):
    """``(model, tokenizer, entry)`` for an fp4ptq checkpoint dir, an HF dir / hub id / GGUF, or the demo."""
    from transformers import AutoTokenizer

    if spec == "demo":
        spec = None
    if spec and _is_checkpoint(Path(spec).expanduser()):
        import fp4ptq

        path = Path(spec).expanduser()
        # verify: negligible next to an evaluation; --no-verify skips it
        model = fp4ptq.load(path, device=device, dtype=dtype, verify=verify)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise CLIError(f"{path} has no usable tokenizer files ({exc}); save the checkpoint with "
                           "fp4ptq.save(..., tokenizer=tokenizer)", EXIT_MISSING) from exc
        info = getattr(model, "fp4ptq_info", None) or {}
        return model, tokenizer, {"name": path.name, "spec": str(spec), "kind": "fp4ptq checkpoint",
                                  "recipe": _recipe_text(info.get("config")), "quantization": info.get("config")}
    from ..sources import load_source_model

    try:
        model, tokenizer, src = load_source_model(spec, dtype=dtype, device=device)
    except ValueError as exc:  # transformers: "Unrecognized configuration class ... for AutoModelForCausalLM"
        raise CLIError(f"{spec or 'the demo model'} is not a causal language model transformers can load "
                       f"with AutoModelForCausalLM ({exc})", EXIT_UNSUPPORTED) from exc
    return model, tokenizer, {"name": _model_name(spec), "spec": spec or "demo", "kind": src.kind,
                              "recipe": "full precision", "quantization": None}


def _parse_tasks(text: str) -> list[str]:
    from ..eval.perplexity import TASKS as PPL_TASKS
    from ..eval.tasks import DOWNSTREAM_TASKS, TASK_GROUPS

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
    from ..eval.perplexity import EvalDataError, load_corpus
    from ..eval.tasks import LOCAL_TASKS, local_file

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
    from ..eval.perplexity import perplexity
    from ..eval.tasks import DOWNSTREAM_TASKS, run_tasks

    results = {}
    for task in tasks:
        if task == "kld":   # issue 43: KL to the baseline's next-token distributions (0 for the baseline itself)
            if baseline is None:
                results[task] = {"task": "kld", "kld": 0.0, "note": "the baseline itself"}
                continue
            from ..eval.kld import kl_divergence

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
    model, tokenizer, entry = _load_model(spec, device, dtype, verify=not getattr(args, "no_verify", False))
    from ..eval import decoded_weight_cache

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
    from ..eval.report import load_report

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
    from ..eval.perplexity import TASKS as PPL_TASKS
    from ..eval.perplexity import load_corpus
    from ..eval.report import new_report, write_report

    started = time.perf_counter()
    tasks = _parse_tasks(args.tasks)
    for name in ("limit", "max_windows", "batch_size", "ppl_batch_size", "seqlen"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    _check_data(tasks, args.data_dir)
    from ..sources import resolve

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
    from ..eval.report import markdown

    print(markdown(report))
    print(_eval_summary(report, paths["json"], time.perf_counter() - started))
    return EXIT_OK


def _eval_summary(report: dict, json_path: Path, seconds: float) -> str:
    from ..eval.report import metric_value

    entry = report["models"][-1]
    parts = []
    for task, res in entry["results"].items():
        if "token_perplexity" in res:
            parts.append(f"{task} ppl {res['token_perplexity']:.3f}")
        else:
            value = metric_value(res, res["primary"])
            parts.append(f"{task} {res['primary']} {100 * value:.1f}%")
    return f"evaluated {entry['name']}: {'; '.join(parts)}. Report: {json_path} [{seconds:.0f} s]"


def cmd_compare(args) -> int:
    from ..eval.report import load_report, markdown, new_report, write_report

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

