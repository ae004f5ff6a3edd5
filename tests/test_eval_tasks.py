"""Local task data (fp4ptq/eval/tasks.py): every reader turns the original public file
into rows that lm-eval's own task config renders into the prompts, choices and
targets the hub version would give."""
from __future__ import annotations

import bz2
import json

import pytest

pytest.importorskip("lm_eval")

from fp4ptq.eval import tasks as T  # noqa: E402
from fp4ptq.eval.perplexity import EvalDataError  # noqa: E402


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("taskdata")
    _jsonl(root / "arc" / "ARC-Easy-Test.jsonl", [
        {"id": "a1", "question": {"stem": "Which is a gas?", "choices": [
            {"text": "ice", "label": "A"}, {"text": "steam", "label": "B"}, {"text": "rock", "label": "C"}]},
         "answerKey": "B"},
        {"id": "a2", "question": {"stem": "Pick two.", "choices": [
            {"text": "one", "label": "1"}, {"text": "two", "label": "2"}]}, "answerKey": "2"}])
    _jsonl(root / "hellaswag" / "hellaswag_val.jsonl", [
        {"ind": 4, "activity_label": "Removing ice from car", "ctx_a": "Then, the man writes over the snow.",
         "ctx_b": "then", "endings": [" a", "b [title] c", "d", "e"], "label": 3, "split": "val"}])
    _jsonl(root / "boolq" / "val.jsonl", [
        {"question": "is it wet", "passage": "Water -- Water is wet.", "idx": 0, "label": "true"},
        {"question": "is fire cold", "passage": "Fire -- Fire is hot.", "idx": 1, "label": False}])
    _jsonl(root / "piqa" / "valid.jsonl", [{"goal": "Open a jar", "sol1": "twist the lid", "sol2": "eat it"}])
    (root / "piqa" / "valid-labels.lst").write_text("0\n")
    _jsonl(root / "winogrande" / "dev.jsonl", [
        {"qID": "w1", "sentence": "The cup fell off the table because _ was tilted.", "option1": "the cup",
         "option2": "the table", "answer": "2"}])
    _jsonl(root / "lambada" / "lambada_test.jsonl", [{"text": "he opened the door and saw his dog"}])
    return root


def _task(name, root):
    manager = T.task_manager([name])
    config, notes = T.local_task_config(name, root, manager)
    task = manager.load([config])["tasks"][name]
    return task, list(task.eval_docs), notes


def test_arc_ai2_format_renders_like_the_hub_task(data):
    task, docs, _ = _task("arc_easy", data)
    assert len(docs) == 2
    assert task.doc_to_text(docs[0]) == "Question: Which is a gas?\nAnswer:"
    assert task.doc_to_choice(docs[0]) == ["ice", "steam", "rock"] and task.doc_to_target(docs[0]) == 1
    assert task.doc_to_target(docs[1]) == 1  # numeric labels "1"-"4" work too


def test_hellaswag_original_jsonl_goes_through_lm_evals_process_docs(data):
    task, docs, notes = _task("hellaswag", data)
    assert notes == []
    assert task.doc_to_text(docs[0]) == "Removing ice from car: Then, the man writes over the snow. Then"
    assert task.doc_to_choice(docs[0]) == ["a", "b. c", "d", "e"] and task.doc_to_target(docs[0]) == 3


def test_hellaswag_six_line_file_is_read_as_published(tmp_path):
    lines = ["Roof shingle removal: A man is sitting on a roof. he", "3",
             "is using wrap.", "is ripping tiles.", "is holding a cube.", "starts pulling up roofing."]
    (tmp_path / "hellaswag").mkdir()
    with bz2.open(tmp_path / "hellaswag" / "hellaswag_val_full.txt.bz2", "wt") as f:
        f.write("\n".join(lines * 2) + "\n")
    task, docs, notes = _task("hellaswag", tmp_path)
    assert len(docs) == 2 and notes == [T.HELLASWAG_6LINE_NOTE]
    assert task.doc_to_text(docs[1]) == lines[0]
    assert task.doc_to_choice(docs[1]) == lines[2:] and task.doc_to_target(docs[1]) == 3


def test_boolq_piqa_winogrande_lambada_render_like_the_hub_tasks(data):
    task, docs, _ = _task("boolq", data)
    assert task.doc_to_text(docs[0]) == "Water -- Water is wet.\nQuestion: is it wet?\nAnswer:"
    assert task.doc_to_choice(docs[0]) == ["no", "yes"]
    assert [task.doc_to_target(d) for d in docs] == [1, 0]

    task, docs, _ = _task("piqa", data)
    assert task.doc_to_text(docs[0]) == "Question: Open a jar\nAnswer:"
    assert task.doc_to_choice(docs[0]) == ["twist the lid", "eat it"] and task.doc_to_target(docs[0]) == 0

    task, docs, _ = _task("winogrande", data)
    assert task.doc_to_choice(docs[0]) == ["The cup fell off the table because the cup",
                                           "The cup fell off the table because the table"]
    assert task.doc_to_target(docs[0]) == "was tilted." and task.doc_to_text(docs[0]) == 1

    task, docs, _ = _task("lambada_openai", data)
    assert task.doc_to_text(docs[0]) == "he opened the door and saw his"
    assert task.doc_to_target(docs[0]) == " dog"


def test_missing_files_name_what_is_expected_where(data, tmp_path):
    with pytest.raises(EvalDataError, match=r"hellaswag_val\.jsonl or .*hellaswag_val_full\.txt\.bz2"):
        T.local_file("hellaswag", tmp_path)
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa" / "valid.jsonl").write_text((data / "piqa" / "valid.jsonl").read_text())
    with pytest.raises(EvalDataError, match=r"valid-labels\.lst"):
        T.local_task_config("piqa", tmp_path, T.task_manager(["piqa"]))
    layout = T.data_layout()
    assert all(task in layout for task in ("wikitext", "c4", *T.DOWNSTREAM_TASKS))
