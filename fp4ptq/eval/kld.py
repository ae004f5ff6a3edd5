"""KL divergence to a baseline model's next-token distributions (the ``kld`` eval task).

Protocol: the WikiText-2 token windows of ``perplexity.py`` (the raw test split
joined and tokenized once, non-overlapping ``seqlen``-token windows, the first
``max_windows`` of them). In each window both models see the same tokens; at
each of the ``seqlen - 1`` positions whose next token is scored by the
perplexity protocol,

    KL(p_base || p_model) = sum_v p_base(v) (log p_base(v) - log p_model(v))

in fp32, and ``kld`` is its mean over all those positions. The models'
token perplexities on the same windows come with it. This is the figure
publishers of quantized models report (llama.cpp's ``--kl-divergence``): it
compares whole distributions, so it is far less noisy than task accuracies.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .perplexity import PerplexityCorpus, _model_device, load_corpus


def window_kl(base_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-position ``KL(p_base || p)`` for logits ``[..., vocab]`` (fp32), shape ``[...]``."""
    base_logp = F.log_softmax(base_logits.float(), dim=-1)
    logp = F.log_softmax(logits.float(), dim=-1)
    return (base_logp.exp() * (base_logp - logp)).sum(-1)


@torch.inference_mode()
def kl_divergence(
    model: torch.nn.Module,
    baseline: torch.nn.Module,
    tokenizer,
    *,
    task: str = "wikitext",
    data_dir: Optional[str | Path] = None,
    seqlen: int = 2048,
    max_windows: Optional[int] = None,
    progress: bool = True,
    corpus: Optional[PerplexityCorpus] = None,
) -> dict:
    """Mean next-token KL divergence of ``model`` to ``baseline`` (protocol: module docstring).

    Returns a JSON-able dict: ``task, source, protocol, seqlen, windows, windows_available, tokens,
    kld, kld_max_window, token_perplexity, baseline_token_perplexity, seconds``.
    """
    if seqlen < 2:
        raise ValueError(f"seqlen must be >= 2, got {seqlen}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1, got {max_windows}")
    corpus = corpus or load_corpus(task, data_dir)
    started = time.perf_counter()
    ids = torch.tensor(tokenizer(corpus.stream, verbose=False)["input_ids"], dtype=torch.long)
    available = ids.numel() // seqlen
    if available == 0:
        raise ValueError(f"{corpus.task}: the text has {ids.numel()} tokens, fewer than one window of {seqlen}")
    windows = min(w for w in (available, corpus.window_cap, max_windows) if w is not None)
    devices = _model_device(model), _model_device(baseline)
    states = model.training, baseline.training
    model.eval()
    baseline.eval()
    kl_sum = nll = base_nll = 0.0
    worst = 0.0
    try:
        for w in tqdm(range(windows), desc=f"{corpus.task} kld", unit="win", disable=not progress):
            window = ids[w * seqlen:(w + 1) * seqlen][None]
            targets = window[0, 1:]
            base_logits = baseline(input_ids=window.to(devices[1]), use_cache=False).logits[0, :-1].float()
            logits = model(input_ids=window.to(devices[0]), use_cache=False).logits[0, :-1].float()
            base_logits = base_logits.to(logits.device)
            kl = float(window_kl(base_logits, logits).sum())
            kl_sum += kl
            worst = max(worst, kl / (seqlen - 1))
            nll += float(F.cross_entropy(logits, targets.to(logits.device), reduction="sum"))
            base_nll += float(F.cross_entropy(base_logits, targets.to(logits.device), reduction="sum"))
    finally:
        model.train(states[0])
        baseline.train(states[1])
    tokens = windows * (seqlen - 1)
    return {
        "task": "kld",
        "source": corpus.source,
        "protocol": (f"mean KL(p_baseline || p_model) over the next-token distributions of the {seqlen}-token "
                     f"windows of the {corpus.task} perplexity protocol"),
        "seqlen": seqlen,
        "windows": windows,
        "windows_available": available,
        "tokens": tokens,
        "kld": kl_sum / tokens,
        "kld_max_window": worst,
        "token_perplexity": math.exp(nll / tokens),
        "baseline_token_perplexity": math.exp(base_nll / tokens),
        "seconds": round(time.perf_counter() - started, 3),
    }


__all__ = ["kl_divergence", "window_kl"]
