"""WikiText-2 and C4 perplexity with a fixed, documented protocol.

Two numbers come out of one call, because papers report two different things:

**token_perplexity** (the GPTQ / AWQ / QuaRot protocol, what quantization papers print)
  * WikiText-2: the raw ``wikitext-2-raw-v1`` *test* split. Its hub rows are the
    lines of ``wiki.test.raw`` (trailing newline kept; whitespace-only lines become
    empty rows); the rows are joined with ``"\\n\\n"`` and tokenized **once** with
    the tokenizer's defaults (a BOS is prepended if the tokenizer does so).
  * C4: the first 1,100 documents of ``en/c4-validation.00000-of-00008.json.gz``
    joined with ``" "`` and tokenized once; only the first 256 windows are
    evaluated (as GPTQ does; ``max_windows`` lowers it further).
  * The token stream is cut into non-overlapping windows of ``seqlen`` tokens
    (default 2048); the last partial window is dropped (``dropped_tokens`` says
    how many tokens that was). Each window is a separate forward pass with no
    context from the previous one; the ``seqlen - 1`` next-token predictions of
    every window are scored, and
    ``token_perplexity = exp(mean NLL over all scored tokens)``.

**word_perplexity** (lm-evaluation-harness's ``wikitext`` task, so numbers compare
with harness tables)
  * Documents instead of one stream: WikiText-2 test is split into its 62 articles
    the way ``EleutherAI/wikitext_document_level`` does (a new page starts at each
    top-level ``" = Title = "`` line), and each page is detokenized with lm-eval's
    own ``wikitext_detokenizer``.
  * Each document is scored with lm-eval's rolling log-likelihood windows
    (``get_rolling_token_windows(..., max_seq_len=seqlen, context_len=1)`` +
    ``make_disjoint_window``, the prefix token being BOS, else EOS), so every token
    of the document is predicted, the first one from the prefix token.
  * ``word_perplexity = exp(total NLL / total words)``, words counted as lm-eval
    counts them: ``len(re.split(r"\\s+", page))`` on the page *before*
    detokenization; ``byte_perplexity`` and ``bits_per_byte`` likewise use the
    page's UTF-8 bytes.
  * Differences from a harness run: the window is ``seqlen`` (the harness uses the
    model's maximum length unless ``max_length`` is given), and ``max_windows``
    keeps only the leading documents whose windows fit in the budget.
  * C4 has no harness task; the same rolling protocol runs over the C4 documents
    (no detokenizer) so the variant exists for both.

The rolling-window and detokenizer functions come from lm-eval (``pip install
lm-eval``); without it ``word_perplexity`` is ``None`` and ``notes`` says why.

Data comes from the hub through ``datasets`` or, with ``data_dir``, from local
files laid out like this (the original public formats)::

    DATA_DIR/wikitext2/wiki.test.raw                          raw WikiText-2 test file
    DATA_DIR/c4/c4-validation.00000-of-00008.json.gz          C4 en validation shard 0
        (also accepted: DATA_DIR/c4/en/c4-validation.00000-of-00008.json.gz)
    DATA_DIR/c4/c4-train/N.txt                                fallback only: one document
        per file; used when the validation shard is absent and reported as
        ``source: c4-train documents`` because it is NOT the classic C4 figure.
"""
from __future__ import annotations

import gzip
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

TASKS = ("wikitext", "c4")

WIKITEXT_HUB = ("Salesforce/wikitext", "wikitext-2-raw-v1", "test")
WIKITEXT_FILE = "wikitext2/wiki.test.raw"
C4_HUB = "allenai/c4"
C4_SHARD = "en/c4-validation.00000-of-00008.json.gz"
C4_LOCAL_FILES = ("c4/c4-validation.00000-of-00008.json.gz", "c4/en/c4-validation.00000-of-00008.json.gz")
C4_FALLBACK_DIR = "c4/c4-train"
C4_DOCUMENTS = 1100   # GPTQ's choice: the first 1,100 validation documents ...
C4_MAX_WINDOWS = 256  # ... of which the first 256 windows are evaluated


class EvalDataError(RuntimeError):
    """Evaluation data is missing or unreadable; the message names the file expected and where."""


@dataclass
class PerplexityCorpus:
    """What one perplexity task reads: the joined stream and the documents."""

    task: str
    source: str                      # where the text came from (hub id or file)
    stream: str                      # text tokenized once for the token protocol
    documents: list[str]             # documents for the word protocol (before detokenizing)
    detokenize: bool                 # apply lm-eval's wikitext detokenizer per document
    window_cap: Optional[int] = None  # protocol's own cap on token windows (C4: 256)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- data

def wikitext_rows(raw_text: str) -> list[str]:
    """The hub's rows of a raw WikiText file: each line with its ``"\\n"``, blank lines as ``""``."""
    lines = raw_text.splitlines(keepends=True)
    return [line if line.strip() else "" for line in lines]


def wikitext_pages(raw_text: str) -> list[str]:
    """Articles of a raw WikiText file, as ``EleutherAI/wikitext_document_level`` splits them.

    A page starts at every top-level heading (``" = Title = "``; ``" = = Section = = "``
    is not top-level). Lines are re-joined with ``"\\n"``.
    """
    pages, current = [], []
    for line in raw_text.split("\n"):
        collapsed = line.replace("= = =", "===").replace("= =", "==").strip()
        if collapsed.startswith("= ") and collapsed.endswith(" ="):
            page = "\n".join(current)
            if page.strip():
                pages.append(page)
            current = []
        current.append(line)
    pages.append("\n".join(current))
    return pages


def _require(path: Path, what: str, hub_hint: str) -> Path:
    if not path.is_file():
        raise EvalDataError(
            f"{what}: expected the file {path} (missing). Put the original public file there, "
            f"or drop --data-dir to download it from the hub ({hub_hint})."
        )
    return path


def _load_wikitext(data_dir: Optional[Path]) -> PerplexityCorpus:
    if data_dir is not None:
        path = _require(data_dir / WIKITEXT_FILE, "WikiText-2 test", "Salesforce/wikitext, wikitext-2-raw-v1")
        raw = path.read_text(encoding="utf-8")
        source = str(path)
    else:
        rows = _hub_dataset(*WIKITEXT_HUB)["text"]
        # Rebuild the raw file from the rows (blank rows were " \n" lines) so both
        # protocols read the same text whichever way it arrived.
        raw = "".join(row if row else " \n" for row in rows)
        source = f"{WIKITEXT_HUB[0]}/{WIKITEXT_HUB[1]} ({WIKITEXT_HUB[2]})"
    return PerplexityCorpus(
        task="wikitext", source=source, stream="\n\n".join(wikitext_rows(raw)),
        documents=wikitext_pages(raw), detokenize=True,
    )


def _read_c4_shard(path: Path) -> list[str]:
    docs = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            docs.append(json.loads(line)["text"])
            if len(docs) == C4_DOCUMENTS:
                break
    return docs


def _load_c4(data_dir: Optional[Path]) -> PerplexityCorpus:
    notes = []
    if data_dir is None:
        docs = _hub_dataset(C4_HUB, None, "validation", data_files={"validation": C4_SHARD})["text"][:C4_DOCUMENTS]
        source = f"{C4_HUB} {C4_SHARD} (first {C4_DOCUMENTS} documents)"
    else:
        shard = next((data_dir / rel for rel in C4_LOCAL_FILES if (data_dir / rel).is_file()), None)
        fallback = data_dir / C4_FALLBACK_DIR
        if shard is not None:
            docs = _read_c4_shard(shard)
            source = f"{shard} (first {len(docs)} documents)"
        elif fallback.is_dir() and any(fallback.glob("*.txt")):
            files = sorted(fallback.glob("*.txt"), key=lambda p: (len(p.stem), p.stem))
            docs = [p.read_text(encoding="utf-8") for p in files]
            source = f"c4-train documents: {len(docs)} files from {fallback}"
            notes.append(
                f"C4 validation shard not found under {data_dir}/c4/; used {len(docs)} C4 *train* "
                "documents instead, so this is not the classic C4 validation perplexity"
            )
        else:
            raise EvalDataError(
                f"C4 validation: expected {data_dir / C4_LOCAL_FILES[0]} (the original "
                f"{C4_SHARD} from {C4_HUB}), or as a stated substitute one-document-per-file "
                f"texts in {fallback}/; neither exists. Drop --data-dir to read it from the hub."
            )
    return PerplexityCorpus(
        task="c4", source=source, stream=" ".join(docs), documents=list(docs),
        detokenize=False, window_cap=C4_MAX_WINDOWS, notes=notes,
    )


def _hub_dataset(path: str, name: Optional[str], split: str, **kwargs):
    import datasets

    try:
        return datasets.load_dataset(path, name, split=split, **kwargs)
    except Exception as exc:  # connection errors come in many types across versions
        raise EvalDataError(
            f"could not load {path} ({name or 'default'}, split {split}) from the Hugging Face hub: {exc}. "
            "Without hub access, pass --data-dir DIR with the files laid out as `fp4ptq eval --help` shows."
        ) from exc


def load_corpus(task: str, data_dir: Optional[str | Path] = None) -> PerplexityCorpus:
    """Read the evaluation text of ``task`` ("wikitext" | "c4") from the hub or ``data_dir``."""
    if task not in TASKS:
        raise ValueError(f"unknown perplexity task {task!r}; choose one of {', '.join(TASKS)}")
    root = None
    if data_dir is not None:
        root = Path(data_dir).expanduser()
        if not root.is_dir():
            raise EvalDataError(f"data directory {root} does not exist")
    return _load_wikitext(root) if task == "wikitext" else _load_c4(root)


# ---------------------------------------------------------------------------- scoring

def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    # input_ids: [B, T] -> logits in fp32: [B, T, V] (NLLs are summed over ~10^5 tokens).
    return model(input_ids=input_ids, use_cache=False).logits.float()


def _window_stream_nll(model, ids: torch.Tensor, seqlen: int, windows: int, batch_size: int,
                       device, progress: bool, desc: str) -> float:
    """Sum of next-token NLLs over ``windows`` non-overlapping windows of ``ids`` [N]."""
    total = 0.0
    bar = tqdm(total=windows, desc=desc, unit="win", disable=not progress)
    for start in range(0, windows, batch_size):
        count = min(batch_size, windows - start)
        batch = ids[start * seqlen:(start + count) * seqlen].view(count, seqlen).to(device)
        logits = _logits(model, batch)                                  # [B, L, V]
        total += F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        ).item()
        bar.update(count)
    bar.close()
    return total


def _rolling_windows(tokens: list[int], prefix_token: int, seqlen: int):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    return [make_disjoint_window(w) for w in get_rolling_token_windows(
        token_list=tokens, prefix_token=prefix_token, max_seq_len=seqlen, context_len=1)]


def _pair_loglikelihood(model, context: list[int], continuation: list[int], device) -> float:
    """log P(continuation | context), scored like lm-eval's ``_loglikelihood_tokens``."""
    full = torch.tensor(context + continuation, device=device)
    logits = _logits(model, full[:-1].unsqueeze(0))[0, -len(continuation):]    # [C, V]
    target = full[-len(continuation):]
    return torch.log_softmax(logits, dim=-1).gather(1, target.unsqueeze(1)).sum().item()


def _word_perplexity(model, tokenizer, corpus: PerplexityCorpus, seqlen: int, max_windows: Optional[int],
                     device, progress: bool) -> dict:
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if prefix is None:
        raise ValueError("word perplexity needs a BOS or EOS token in the tokenizer (lm-eval's prefix token)")
    plans = []  # (document, windows)
    budget = math.inf if max_windows is None else max_windows
    for doc in corpus.documents:
        target = wikitext_detokenizer({"page": doc}) if corpus.detokenize else doc
        windows = _rolling_windows(tokenizer.encode(target), prefix, seqlen)
        if plans and sum(len(w) for _, w in plans) + len(windows) > budget:
            break
        plans.append((doc, windows))
    loglik, words, nbytes = 0.0, 0, 0
    bar = tqdm(total=sum(len(w) for _, w in plans), desc=f"{corpus.task} word ppl", unit="win",
               disable=not progress)
    for doc, windows in plans:
        for context, continuation in windows:
            loglik += _pair_loglikelihood(model, context, continuation, device)
            bar.update(1)
        words += len(re.split(r"\s+", doc))
        nbytes += len(doc.encode("utf-8"))
    bar.close()
    return {
        "word_perplexity": math.exp(-loglik / words),
        "byte_perplexity": math.exp(-loglik / nbytes),
        "bits_per_byte": -loglik / nbytes / math.log(2),
        "word_documents": len(plans),
        "word_windows": sum(len(w) for _, w in plans),
        "words": words,
    }


def perplexity(
    model: torch.nn.Module,
    tokenizer,
    task: str = "wikitext",
    *,
    data_dir: Optional[str | Path] = None,
    seqlen: int = 2048,
    max_windows: Optional[int] = None,
    batch_size: int = 1,
    device: Optional[str | torch.device] = None,
    progress: bool = True,
    word_perplexity: bool = True,
    corpus: Optional[PerplexityCorpus] = None,
) -> dict:
    """Perplexity of a causal LM on WikiText-2 test or C4 validation (protocol: module docstring).

    Args:
        task: "wikitext" or "c4".
        data_dir: local data root (layout in the module docstring); None reads the hub.
        seqlen: window length in tokens, for both protocols.
        max_windows: evaluate only the first N token windows (and, for the word
            protocol, the leading documents whose rolling windows total <= N).
        batch_size: token windows per forward pass.
        device: where inputs go; default: the model's device.
        word_perplexity: also run the harness-style document pass (about as long again).
        corpus: pre-loaded text (``load_corpus``) to skip reading it again.

    Returns a JSON-able dict: ``task, source, protocol, seqlen, windows,
    windows_available, tokens, dropped_tokens, token_perplexity, nll_mean,
    word_perplexity, byte_perplexity, bits_per_byte, word_documents,
    word_windows, words, documents, seconds, notes``.
    """
    if seqlen < 2:
        raise ValueError(f"seqlen must be >= 2, got {seqlen}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1, got {max_windows}")
    corpus = corpus or load_corpus(task, data_dir)
    device = torch.device(device) if device is not None else _model_device(model)
    started = time.perf_counter()

    ids = torch.tensor(tokenizer(corpus.stream, verbose=False)["input_ids"], dtype=torch.long)   # [N]
    available = ids.numel() // seqlen
    if available == 0:
        raise ValueError(f"{corpus.task}: the text has {ids.numel()} tokens, fewer than one window of {seqlen}")
    windows = available
    for cap in (corpus.window_cap, max_windows):
        if cap is not None:
            windows = min(windows, cap)

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            total_nll = _window_stream_nll(model, ids, seqlen, windows, batch_size, device, progress,
                                           f"{corpus.task} ppl")
            scored = windows * (seqlen - 1)
            result = {
                "task": corpus.task,
                "source": corpus.source,
                "protocol": (f"token: non-overlapping {seqlen}-token windows of the joined split, "
                             "exp(mean next-token NLL); word: lm-eval rolling log-likelihood per document, "
                             "exp(NLL / words)"),
                "seqlen": seqlen,
                "windows": windows,
                "windows_available": available,
                "tokens": scored,
                "dropped_tokens": ids.numel() - available * seqlen,
                "token_perplexity": math.exp(total_nll / scored),
                "nll_mean": total_nll / scored,
                "documents": len(corpus.documents),
                "word_perplexity": None,
                "byte_perplexity": None,
                "bits_per_byte": None,
                "word_documents": 0,
                "word_windows": 0,
                "words": 0,
                "notes": list(corpus.notes),
            }
            if word_perplexity:
                try:
                    result.update(_word_perplexity(model, tokenizer, corpus, seqlen, max_windows, device, progress))
                except ImportError:
                    result["notes"].append("word_perplexity needs lm-eval (pip install lm-eval); not computed")
    finally:
        model.train(was_training)
    result["seconds"] = round(time.perf_counter() - started, 3)
    return result

