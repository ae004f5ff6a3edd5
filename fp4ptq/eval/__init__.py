"""Evaluation: perplexity (perplexity.py), lm-eval tasks with offline data (tasks.py),
JSON / markdown / PNG reports (report.py)."""
from __future__ import annotations

from .perplexity import EvalDataError, load_corpus, perplexity

__all__ = ["EvalDataError", "load_corpus", "perplexity"]
