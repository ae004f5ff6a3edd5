"""The documents and benchmarks/ agree: every result file that README.md or docs/*.md cites exists, every
file under benchmarks/results/ is cited, every benchmark script they name exists and every script in
benchmarks/ is named, and every probe that benchmarks/HISTORY.md names is gone from the tree and held by
the commit it gives.

A citation is a path after ``results/`` (``benchmarks/results/kernels_h200.md``, ``results/x_*.json``,
``accuracy_smollm2_h200.{md,png}``, a folder ending in ``/``), or a file name in backticks
(```wsgemm_narrow_h200.json```) that names a results file; braces and ``*`` expand as in the shell."""
from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_PATH = r"[\w.*{},/+-]*[\w*}/]"
_CITED = re.compile(r"(?<![\w/])(?:benchmarks/)?results/(" + _PATH + ")")
_NAMED = re.compile(r"`([\w.*{},+-]+\.(?:json|md|png|txt|csv|log))`")
_SCRIPT = re.compile(r"(?<![\w/])benchmarks/(\w+\.py)\b")
_PROBE = re.compile(r"\*\*(\w+\.py)\*\* \(([0-9a-f]{7,40})\)")


def _expand(pattern: str) -> list:
    """Shell brace expansion: ``a.{md,png}`` -> ``a.md``, ``a.png``."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _matches(pattern: str, rel: str) -> bool:
    if pattern.endswith("/"):
        return rel.startswith(pattern)
    return fnmatch.fnmatchcase(rel, pattern) or rel.startswith(pattern + "/")


def _citations():
    """``(cited, named)``: result paths cited after ``results/`` with the document citing each, and the
    backticked file names."""
    cited, named = [], []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        cited += [(p, doc.name) for m in _CITED.finditer(text) for p in _expand(m.group(1))]
        named += [p for m in _NAMED.finditer(text) for p in _expand(m.group(1))]
    return cited, named


def _result_files() -> list:
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file())


def test_every_cited_result_file_exists():
    files = _result_files()
    cited, _ = _citations()
    assert cited, "no result file cited at all: the citation pattern no longer matches the documents"
    missing = sorted({f"{doc}: results/{p}" for p, doc in cited if not any(_matches(p, f) for f in files)})
    assert not missing, "cited but not in benchmarks/results/: " + ", ".join(missing)


def test_every_result_file_is_cited():
    cited, named = _citations()
    patterns = [p for p, _ in cited]
    uncited = [f for f in _result_files() if not any(_matches(p, f) for p in patterns)
               and not any(fnmatch.fnmatchcase(f.rsplit("/", 1)[-1], n) for n in named)]
    assert not uncited, ("in benchmarks/results/ but cited by no document (cite it in README.md or docs/, "
                         "or delete it): " + ", ".join(uncited))


def test_every_named_benchmark_script_exists():
    named = {(m.group(1), doc.name) for doc in DOCS for m in _SCRIPT.finditer(doc.read_text(encoding="utf-8"))}
    assert named
    missing = sorted(f"{doc}: benchmarks/{name}" for name, doc in named if not (ROOT / "benchmarks" / name).exists())
    assert not missing, "named but not in benchmarks/ (HISTORY.md keeps the deleted probes): " + ", ".join(missing)


def test_every_benchmark_script_is_cited_by_a_document():
    """The reverse of the check above: each script in benchmarks/ (but the shared harness.py) is named
    (``benchmarks/NAME.py`` or ``NAME.py``) by README.md, docs/*.md, benchmarks/NOTES.md or HISTORY.md, so
    that a reader finds what it produces; a script no document names is a probe to delete."""
    docs = DOCS + [ROOT / "benchmarks" / "NOTES.md", ROOT / "benchmarks" / "HISTORY.md"]
    text = "\n".join(doc.read_text(encoding="utf-8") for doc in docs if doc.exists())
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "harness.py")
    assert scripts
    uncited = [name for name in scripts
               if not re.search(r"(?<![\w/])(?:benchmarks/)?" + re.escape(name) + r"\b", text)]
    assert not uncited, ("in benchmarks/ but named by no document (cite it in README.md, docs/, "
                         "benchmarks/NOTES.md or HISTORY.md, or delete it): " + ", ".join(uncited))


def test_history_names_deleted_probes_with_the_commit_that_holds_them():
    probes = _PROBE.findall((ROOT / "benchmarks" / "HISTORY.md").read_text(encoding="utf-8"))
    assert len(probes) >= 50
    assert not [name for name, _ in probes if (ROOT / "benchmarks" / name).exists()], "a probe still in the tree"
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("no git checkout: the commits are not checked")
    spec = "".join(f"{commit}:benchmarks/{name}\n" for name, commit in probes)
    out = subprocess.run(["git", "cat-file", "--batch-check"], input=spec, capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.splitlines()
    absent = [line for line in out if line.endswith(" missing")]
    if len(absent) == len(probes):
        pytest.skip("the history is not in this clone (shallow): the commits are not checked")
    assert not absent, "HISTORY.md names a commit that does not hold the script: " + ", ".join(absent)
