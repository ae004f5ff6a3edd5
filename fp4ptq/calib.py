"""Calibration data: ``get_calibration(source, tokenizer, nsamples, seqlen, seed)``
returns a LongTensor ``[nsamples, seqlen]`` of token ids.

Sources (never an evaluation split):
- "wikitext2": WikiText-2 (raw) **train** split from the hub, rows joined by
  blank lines (the usual GPTQ protocol);
- "c4": documents of the first C4 ``en`` **train** shard from the hub;
- "pile": documents of the (uncopyrighted) Pile **train** split, streamed;
- "self": data-free, sequences sampled from ``model`` itself (temperature 1,
  from a random non-special first token);
- a local path: a ``.txt`` file (one text), a ``.jsonl`` file (one document
  per line, its ``"text"`` field), or a directory holding such files (every
  ``.txt`` file one document, every ``.jsonl`` line one document).

Sampling: documents are taken in a seeded random order, tokenized and joined
with the tokenizer's EOS (or a blank line) until there are ``nsamples * seqlen``
tokens; the stream is cut into non-overlapping ``seqlen`` windows and
``nsamples`` of them are drawn without replacement (seeded). A single text is
one document. Too little text for one window is an error; enough for a window
but not for ``nsamples`` distinct ones draws windows at random offsets (a warning
says they overlap).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Iterable, Iterator

import torch

HUB_SOURCES = {
    # source: (dataset id, config, data_files, split, streaming)
    "wikitext2": ("Salesforce/wikitext", "wikitext-2-raw-v1", None, "train", False),
    "c4": ("allenai/c4", None, {"train": "en/c4-train.00000-of-01024.json.gz"}, "train", True),
    "pile": ("monology/pile-uncopyrighted", None, None, "train", True),
}
DATA_FREE = "self"
LOCAL_SUFFIXES = (".txt", ".jsonl")


class CalibrationDataError(ValueError):
    """Calibration data could not be built; the message says from what and why."""


def get_calibration(
    source: str,
    tokenizer,
    nsamples: int,
    seqlen: int,
    seed: int = 0,
    model=None,
) -> torch.LongTensor:
    """``[nsamples, seqlen]`` token ids from ``source`` (see the module doc), deterministic in ``seed``."""
    if nsamples <= 0 or seqlen <= 0:
        raise CalibrationDataError(f"nsamples and seqlen must be positive, got {nsamples} and {seqlen}")
    if source == DATA_FREE:
        if model is None:
            raise CalibrationDataError("calibration source 'self' samples from the model: pass model=")
        return sample_from_model(model, tokenizer, nsamples, seqlen, seed)
    generator = torch.Generator().manual_seed(seed)
    if source in HUB_SOURCES:
        documents = _hub_documents(source, seed)
        label = f"hub dataset {HUB_SOURCES[source][0]} ({HUB_SOURCES[source][3]} split)"
    else:
        documents, count = local_documents(source)
        order = torch.randperm(count, generator=generator).tolist()
        documents = [documents[i] for i in order]
        label = f"local source {source}"
    stream = _token_stream(documents, tokenizer, nsamples * seqlen)
    return _draw_windows(stream, nsamples, seqlen, generator, label)


# --------------------------------------------------------------------------- #
# Documents
# --------------------------------------------------------------------------- #
def local_documents(path: str | Path) -> tuple:
    """``(documents, count)`` from a .txt file, a .jsonl file or a directory of them."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CalibrationDataError(
            f"calibration source {str(path)!r} is neither a known dataset "
            f"({', '.join([*HUB_SOURCES, DATA_FREE])}) nor an existing file or directory"
        )
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in LOCAL_SUFFIXES)
        if not files:
            raise CalibrationDataError(f"calibration directory {p} holds no {' or '.join(LOCAL_SUFFIXES)} files")
    elif p.suffix.lower() in LOCAL_SUFFIXES:
        files = [p]
    else:
        raise CalibrationDataError(
            f"calibration file {p} has an unsupported suffix; use .txt (plain text) or .jsonl "
            "(one JSON object with a 'text' field per line), or a directory of them"
        )
    documents = []
    for f in files:
        documents.extend(_read_jsonl(f) if f.suffix.lower() == ".jsonl" else [f.read_text(encoding="utf-8")])
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise CalibrationDataError(f"calibration source {p} holds no text")
    return documents, len(documents)


def _read_jsonl(path: Path) -> list:
    documents = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationDataError(f"{path}:{lineno}: not valid JSON ({exc})") from exc
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise CalibrationDataError(f"{path}:{lineno}: expected an object with a string 'text' field")
            documents.append(row["text"])
    return documents


def _hub_documents(source: str, seed: int) -> Iterator[str]:
    """Documents of a hub train split in a seeded random order (lazy: only what is used is read)."""
    from datasets import load_dataset

    name, config, data_files, split, streaming = HUB_SOURCES[source]
    try:
        ds = load_dataset(name, config, data_files=data_files, split=split, streaming=streaming)
    except Exception as exc:  # the hub raises many types (connection, not found, auth)
        raise CalibrationDataError(
            f"could not load calibration dataset {name} ({split} split): {exc}. Without hub access, "
            "pass a local .txt/.jsonl file or a directory of documents as the calibration source"
        ) from exc
    if source == "wikitext2":
        # One text: the rows (lines, "" for blank ones) joined as in the GPTQ protocol.
        yield "\n\n".join(ds["text"])
        return
    for row in ds.shuffle(seed=seed, buffer_size=10_000):
        yield row["text"]


# --------------------------------------------------------------------------- #
# Tokens and windows
# --------------------------------------------------------------------------- #
def _token_stream(documents: Iterable[str], tokenizer, needed: int) -> torch.LongTensor:
    """Tokenize documents (joined by EOS, or a blank line) until ``needed`` tokens."""
    eos = getattr(tokenizer, "eos_token_id", None)
    separator = [eos] if eos is not None else _encode(tokenizer, "\n\n")
    ids, total = [], 0
    for doc in documents:
        tokens = _encode(tokenizer, doc)
        if ids:
            ids.append(separator)
            total += len(separator)
        ids.append(tokens)
        total += len(tokens)
        if total >= needed:
            break
    return torch.tensor([t for chunk in ids for t in chunk], dtype=torch.long)


def _encode(tokenizer, text: str) -> list:
    # verbose=False: long texts are cut into windows here, the model-length warning does not apply.
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _draw_windows(stream: torch.LongTensor, nsamples: int, seqlen: int, generator, label: str) -> torch.LongTensor:
    slots = stream.numel() // seqlen
    if slots == 0:
        raise CalibrationDataError(
            f"{label} has only {stream.numel()} tokens, fewer than seqlen={seqlen}: give more text or a smaller seqlen"
        )
    if slots >= nsamples:
        chosen = torch.randperm(slots, generator=generator)[:nsamples]
        starts = chosen * seqlen
    else:
        warnings.warn(
            f"fp4ptq: {label} has {stream.numel()} tokens, enough for {slots} distinct windows of "
            f"{seqlen}; drawing {nsamples} windows at random offsets (they overlap)",
            stacklevel=3,
        )
        starts = torch.randint(0, stream.numel() - seqlen + 1, (nsamples,), generator=generator)
    return torch.stack([stream[s : s + seqlen] for s in starts.tolist()])


@torch.no_grad()
def sample_from_model(model, tokenizer, nsamples: int, seqlen: int, seed: int = 0, batch_size: int = 8) -> torch.LongTensor:
    """Data-free calibration: sequences sampled from ``model`` (temperature 1,
    no top-k/top-p), each from a random non-special first token; seeded."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    special = torch.tensor(sorted(set(getattr(tokenizer, "all_special_ids", None) or [])), dtype=torch.long)
    allowed = torch.ones(vocab, dtype=torch.bool)
    allowed[special[special < vocab]] = False
    candidates = allowed.nonzero().squeeze(1)
    first = candidates[torch.randint(0, candidates.numel(), (nsamples, 1), generator=generator)]
    device = model.get_input_embeddings().weight.device
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else getattr(tokenizer, "eos_token_id", None)
    rows = []
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for start in range(0, nsamples, batch_size):
            prompt = first[start : start + batch_size].to(device)
            if seqlen == 1:
                rows.append(prompt.cpu())
                continue
            out = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, min_new_tokens=seqlen - 1, max_new_tokens=seqlen - 1, pad_token_id=pad,
            )
            rows.append(out[:, :seqlen].cpu())
    return torch.cat(rows).long()


__all__ = ["CalibrationDataError", "DATA_FREE", "HUB_SOURCES", "get_calibration", "local_documents", "sample_from_model"]
