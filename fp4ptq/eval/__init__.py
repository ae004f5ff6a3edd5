"""Evaluation: perplexity (perplexity.py), lm-eval tasks with offline data (tasks.py),
JSON / markdown / PNG reports (report.py).

Entry point for perplexity: ``from fp4ptq.eval.perplexity import perplexity``.
"""
