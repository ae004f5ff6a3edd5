"""Downstream tasks through lm-eval's own Python API, from the hub or from local files.

The model we already hold (a float model or one with ``NVFP4Linear`` layers) is
wrapped in lm-eval's ``HFLM(pretrained=model, tokenizer=tokenizer)`` and the tasks
run through ``lm_eval.simple_evaluate``: prompts, choices, metrics and
aggregation are lm-eval's, not ours.

With ``data_dir`` the same registered task configs are used (their YAML, with
``doc_to_text`` / ``doc_to_choice`` / ``doc_to_target`` / metrics untouched); only
the dataset is swapped: ``custom_dataset`` returns a ``datasets.DatasetDict`` built
from the local file in the row format of the hub dataset the task normally reads,
and the task's split names point at that one split. Expected files (the original
public formats)::

    task            file under DATA_DIR                        format (split evaluated)
    arc_easy        arc/ARC-Easy-Test.jsonl                    AI2 ARC jsonl: {"id", "question": {"stem",
    arc_challenge   arc/ARC-Challenge-Test.jsonl                 "choices": [{"text","label"}]}, "answerKey"} (test)
    hellaswag       hellaswag/hellaswag_val.jsonl              original rowanz/hellaswag jsonl: {"activity_label",
                                                                 "ctx_a", "ctx_b", "endings", "label"} (validation)
                    or hellaswag/hellaswag_val_full.txt.bz2    6 lines per item: context, gold index, 4 endings
                                                                 (validation; see HELLASWAG_6LINE_NOTE)
    boolq           boolq/val.jsonl                            SuperGLUE BoolQ: {"question", "passage", "idx",
                                                                 "label": true|false|"true"|"false"} (validation)
    piqa            piqa/valid.jsonl + piqa/valid-labels.lst   original PIQA: {"goal","sol1","sol2"} per line and
                                                                 one 0/1 label per line (validation)
    winogrande      winogrande/dev.jsonl                       WinoGrande 1.1: {"sentence","option1","option2",
                                                                 "answer": "1"|"2"} (validation)
    lambada_openai  lambada/lambada_test.jsonl                 OpenAI's LAMBADA: {"text"} per line (test)

(``wikitext`` and ``c4`` are perplexity tasks: see ``fp4ptq.eval.perplexity``.)
"""
from __future__ import annotations

import bz2
import json
import logging
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .perplexity import EvalDataError

LM_EVAL_HINT = "the downstream tasks need lm-eval: pip install 'fp4ptq[eval]' (or pip install lm-eval)"

HELLASWAG_6LINE_NOTE = (
    "hellaswag from the 6-line file: its context line is activity_label + ': ' + ctx_a + ' ' + ctx_b "
    "as published, while lm-eval capitalizes ctx_b (whose boundary the file does not keep); "
    "endings and gold labels are identical"
)


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _arc_rows(path: Path) -> list[dict]:
    # AI2 jsonl -> the allenai/ai2_arc hub rows the task's Jinja templates index.
    rows = []
    for item in _read_jsonl(path):
        choices = item["question"]["choices"]
        rows.append({
            "id": item["id"],
            "question": item["question"]["stem"],
            "choices": {"text": [c["text"] for c in choices], "label": [c["label"] for c in choices]},
            "answerKey": item["answerKey"],
        })
    return rows


def _hellaswag_rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":  # original release: lm-eval's own process_docs runs on it
        return [{"activity_label": d["activity_label"], "ctx_a": d["ctx_a"], "ctx_b": d["ctx_b"],
                 "endings": d["endings"], "label": str(d["label"])} for d in _read_jsonl(path)]
    with bz2.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise EvalDataError(f"{path}: {len(lines)} lines is not a multiple of 6 (context, gold, 4 endings)")
    # Already in the post-process_docs shape: query / choices / label.
    return [{"query": lines[i], "label": lines[i + 1].strip(), "choices": lines[i + 2:i + 6]}
            for i in range(0, len(lines), 6)]


def _boolq_rows(path: Path) -> list[dict]:
    return [{"question": d["question"], "passage": d["passage"], "idx": d.get("idx", i),
             "label": int(d["label"] in (True, 1, "true", "True"))}
            for i, d in enumerate(_read_jsonl(path))]


def _piqa_rows(path: Path) -> list[dict]:
    labels_path = path.with_name("valid-labels.lst")
    if not labels_path.is_file():
        raise EvalDataError(f"piqa: expected the labels file {labels_path} next to {path.name}")
    labels = [int(x) for x in labels_path.read_text().split()]
    items = _read_jsonl(path)
    if len(items) != len(labels):
        raise EvalDataError(f"piqa: {path} has {len(items)} items but {labels_path} has {len(labels)} labels")
    return [{"goal": d["goal"], "sol1": d["sol1"], "sol2": d["sol2"], "label": lab} for d, lab in zip(items, labels)]


def _winogrande_rows(path: Path) -> list[dict]:
    return [{"sentence": d["sentence"], "option1": d["option1"], "option2": d["option2"],
             "answer": str(d["answer"])} for d in _read_jsonl(path)]


def _lambada_rows(path: Path) -> list[dict]:
    return [{"text": d["text"]} for d in _read_jsonl(path)]


@dataclass(frozen=True)
class LocalTask:
    """How one lm-eval task reads its data from DATA_DIR."""

    files: tuple[str, ...]                # candidates under DATA_DIR, first existing wins
    split: str                            # the split name the task evaluates
    reader: Callable[[Path], list[dict]]  # file -> hub-format rows
    describe: str                         # the format, for --help
    drop_process_docs: tuple[str, ...] = ()  # files whose rows are already post-process_docs


# Where lm-eval keeps each task's YAML (indexing only these folders takes ~1 s instead of
# ~6 s for all 14k tasks; if a future lm-eval moves them, the full index is used).
LM_EVAL_TASK_DIRS = {
    "arc_easy": "arc", "arc_challenge": "arc", "hellaswag": "hellaswag", "boolq": "super_glue/boolq",
    "piqa": "piqa", "winogrande": "winogrande", "lambada_openai": "lambada",
}

LOCAL_TASKS: dict[str, LocalTask] = {
    "arc_easy": LocalTask(("arc/ARC-Easy-Test.jsonl",), "test", _arc_rows,
                          'AI2 ARC jsonl {"id","question":{"stem","choices":[{"text","label"}]},"answerKey"}'),
    "arc_challenge": LocalTask(("arc/ARC-Challenge-Test.jsonl",), "test", _arc_rows, "same as arc_easy"),
    "hellaswag": LocalTask(("hellaswag/hellaswag_val.jsonl", "hellaswag/hellaswag_val_full.txt.bz2"),
                           "validation", _hellaswag_rows,
                           "original rowanz/hellaswag jsonl, or 6 lines per item: context, gold, 4 endings",
                           drop_process_docs=(".bz2",)),
    "boolq": LocalTask(("boolq/val.jsonl",), "validation", _boolq_rows,
                       'SuperGLUE BoolQ jsonl {"question","passage","idx","label"}'),
    "piqa": LocalTask(("piqa/valid.jsonl",), "validation", _piqa_rows,
                      'original PIQA {"goal","sol1","sol2"} + piqa/valid-labels.lst (one 0/1 a line)'),
    "winogrande": LocalTask(("winogrande/dev.jsonl",), "validation", _winogrande_rows,
                            'WinoGrande 1.1 {"sentence","option1","option2","answer":"1"|"2"}'),
    "lambada_openai": LocalTask(("lambada/lambada_test.jsonl",), "test", _lambada_rows,
                                'OpenAI LAMBADA jsonl {"text"}'),
}
DOWNSTREAM_TASKS = tuple(LOCAL_TASKS)
# Group names users know from lm-eval and papers, expanded to the tasks above (lm-eval's own "lambada"
# group also holds lambada_standard, which fp4ptq does not run: name lambada_openai instead).
TASK_GROUPS = {"arc": ("arc_easy", "arc_challenge"), "ai2_arc": ("arc_easy", "arc_challenge")}

# The metric a table shows first for each task (lm-eval names); the rest stay in the JSON.
PRIMARY_METRIC = {
    "arc_easy": "acc_norm", "arc_challenge": "acc_norm", "hellaswag": "acc_norm", "piqa": "acc_norm",
    "boolq": "acc", "winogrande": "acc", "lambada_openai": "acc",
}


def data_layout() -> str:
    """The expected ``--data-dir`` layout, one line per task (perplexity tasks included)."""
    from .perplexity import C4_FALLBACK_DIR, C4_LOCAL_FILES, WIKITEXT_FILE

    rows = [("wikitext", WIKITEXT_FILE, "raw WikiText-2 test file"),
            ("c4", C4_LOCAL_FILES[0], "C4 en validation shard 0 (json.gz); substitute: "
                                     f"{C4_FALLBACK_DIR}/N.txt, one document each (reported as such)")]
    rows += [(task, " | ".join(spec.files), spec.describe) for task, spec in LOCAL_TASKS.items()]
    return "\n".join(f"  {task:<15}{files}\n  {'':<15}  {what}" for task, files, what in rows)


def local_file(task: str, data_dir: str | Path) -> Path:
    """The local file ``task`` reads under ``data_dir``; raises naming the expected path(s)."""
    spec = LOCAL_TASKS[task]
    root = Path(data_dir).expanduser()
    for rel in spec.files:
        if (root / rel).is_file():
            return root / rel
    expected = " or ".join(str(root / rel) for rel in spec.files)
    raise EvalDataError(
        f"{task}: expected {expected} (missing). See `fp4ptq eval --help` for each task's file "
        "and format, or drop --data-dir to read the task from the hub."
    )


def local_task_config(task: str, data_dir: str | Path, task_manager) -> tuple[dict, list[str]]:
    """lm-eval's registered config for ``task`` with its dataset swapped for the local file.

    Returns ``(config_dict, notes)``; the dict is accepted by ``simple_evaluate(tasks=[...])``.
    """
    import datasets
    from lm_eval.tasks._yaml_loader import load_yaml

    path = local_file(task, data_dir)
    spec = LOCAL_TASKS[task]
    entry = task_manager.task_index.get(task)
    if entry is None or entry.yaml_path is None:
        raise EvalDataError(f"lm-eval has no registered YAML config for {task!r}; update lm-eval")
    config = dict(load_yaml(entry.yaml_path, resolve_func=True))
    rows = spec.reader(path)
    if not rows:
        raise EvalDataError(f"{task}: {path} holds no items")

    def custom_dataset(**_metadata_and_kwargs):  # lm-eval passes metadata + dataset_kwargs here
        return datasets.DatasetDict({spec.split: datasets.Dataset.from_list(rows)})

    notes = []
    config.update({
        "custom_dataset": custom_dataset,
        "dataset_path": f"local:{path}",
        "dataset_name": None,
        "dataset_kwargs": None,
        "training_split": None,
        "fewshot_split": None,
        "validation_split": spec.split if spec.split == "validation" else None,
        "test_split": spec.split if spec.split == "test" else None,
    })
    config.pop("tag", None)
    if path.suffix in spec.drop_process_docs:
        config.pop("process_docs", None)
        notes.append(HELLASWAG_6LINE_NOTE)
    return config, notes


def task_manager(tasks: list[str]):
    """An lm-eval ``TaskManager`` that indexes only the folders ``tasks`` live in."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    root = Path(lm_eval.tasks.__file__).parent
    folders = sorted({str(root / LM_EVAL_TASK_DIRS[t]) for t in tasks if (root / LM_EVAL_TASK_DIRS[t]).is_dir()})
    manager = TaskManager(include_defaults=False, include_path=folders) if folders else None
    if manager is None or not set(tasks) <= set(manager.all_tasks):
        manager = task_manager(tasks)
    return manager


def _flatten_metrics(task_result: dict) -> dict:
    # lm-eval keys look like "acc,none" / "acc_stderr,none"; keep the filter-less name.
    out = {}
    for key, value in task_result.items():
        if key in ("alias", "sample_len") or not isinstance(value, (int, float)):
            continue
        name, _, filt = key.partition(",")
        out[name if filt in ("", "none") else f"{name},{filt}"] = float(value)
    return out


def _quiet_git_hash() -> Optional[str]:
    """lm-eval's ``get_git_commit_hash`` (the git commit of the working directory, for its results)
    without the "fatal: not a git repository" git prints to the console outside a repository."""
    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return out.stdout.strip() or None


@contextmanager
def patched(patches: list):
    """Within the block, each ``(module name, attribute, value)`` is set (modules that cannot be
    imported or lack the attribute are left alone); the old values come back on exit."""
    import importlib

    saved = []
    for module_name, attr, value in patches:
        try:
            module = importlib.import_module(module_name)
        except ImportError:   # an optional part not installed: nothing to patch
            continue
        if hasattr(module, attr):
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def silent_tqdm():
    """A ``tqdm`` that draws nothing, for modules that create bars with no off switch."""
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def _lm_eval_console(quiet: bool):
    """Within the block, lm-eval asks git quietly and, when ``quiet``, draws no progress bars."""
    patches = [("lm_eval.evaluator", "get_git_commit_hash", _quiet_git_hash)]
    if quiet:
        patches += [(m, "tqdm", silent_tqdm())
                    for m in ("lm_eval.api.task", "lm_eval.api.model", "lm_eval.models.huggingface")]
    return patched(patches)


def run_tasks(
    model,
    tokenizer,
    tasks: list[str],
    *,
    data_dir: Optional[str | Path] = None,
    limit: Optional[int] = None,
    batch_size: int = 1,
    num_fewshot: int = 0,
    seed: int = 1234,
    max_length: Optional[int] = None,
    quiet: bool = False,
) -> dict:
    """Evaluate ``tasks`` (names from ``DOWNSTREAM_TASKS``) with lm-eval on the loaded model.

    ``limit`` keeps the first N items of each task (lm-eval's ``limit``); ``quiet`` hides lm-eval's
    progress bars.
    Returns ``{task: {"metrics": {...}, "primary": name, "samples": n, "source": where, "notes": [...]}}``.
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError as exc:
        raise ImportError(LM_EVAL_HINT) from exc
    unknown = [t for t in tasks if t not in LOCAL_TASKS]
    if unknown:
        raise ValueError(f"unknown downstream task(s) {unknown}; known: {', '.join(DOWNSTREAM_TASKS)}")
    if not tasks:
        return {}

    manager = task_manager(tasks)
    specs, notes, sources = [], {}, {}
    for task in tasks:
        if data_dir is None:
            specs.append(task)
            notes[task], sources[task] = [], "hub (lm-eval task config)"
        else:
            config, notes[task] = local_task_config(task, data_dir, manager)
            specs.append(config)
            sources[task] = config["dataset_path"].removeprefix("local:")

    # lm-eval warns about things that are deliberate here (an already-built model, our
    # custom_dataset, 0-shot overrides); keep the console to its progress bars and errors.
    lm_eval_logger = logging.getLogger("lm_eval")
    level = lm_eval_logger.level
    lm_eval_logger.setLevel(logging.ERROR)
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
        with _lm_eval_console(quiet):
            output = lm_eval.simple_evaluate(
                model=lm, tasks=specs, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                log_samples=False, bootstrap_iters=1000, random_seed=seed, numpy_random_seed=seed,
                torch_random_seed=seed, fewshot_random_seed=seed,
            )
    except (ConnectionError, OSError) as exc:
        if data_dir is None:
            raise EvalDataError(
                f"lm-eval could not fetch the task data ({exc}). Without hub access, pass --data-dir DIR "
                "with the files laid out as `fp4ptq eval --help` shows."
            ) from exc
        raise
    finally:
        lm_eval_logger.setLevel(level)
    results = {}
    for task in tasks:
        metrics = _flatten_metrics(output["results"][task])
        samples = output.get("n-samples", {}).get(task, {})
        results[task] = {
            "metrics": metrics,
            "primary": PRIMARY_METRIC[task],
            "samples": samples.get("effective"),
            "samples_available": samples.get("original"),
            "num_fewshot": num_fewshot,
            "source": sources[task],
            "notes": notes[task],
        }
    return results
