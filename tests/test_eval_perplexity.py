"""Perplexity protocol (fp4ptq/eval/perplexity.py) on a tiny random Llama and tiny text.

The tiny model/tokenizer/data builders here are reused by tests/test_cli.py.
"""
from __future__ import annotations

import gzip
import json
import math
import re

import pytest
import torch

from fp4ptq.eval import perplexity as ppl

WORDS = ("the cat sat on a mat and dog ran to big red house in park with old man who saw small bird "
         "= Title Section @-@ , . ' s").split()


def _sentence(rng: torch.Generator, n: int) -> str:
    idx = torch.randint(0, 22, (n,), generator=rng).tolist()
    return " ".join(WORDS[i] for i in idx)


def tiny_wikitext_raw(articles: int = 3, seed: int = 0) -> str:
    """A raw-WikiText-shaped file: headings ' = T = ', blank ' ' lines, paragraphs."""
    rng = torch.Generator().manual_seed(seed)
    lines = [" "]
    for a in range(articles):
        lines += [f" = Title{a} = ", " "]
        for s in range(2):
            lines += [" " + _sentence(rng, 40) + " . ", " ", f" = = Section{s} = = ", " "]
    return "\n".join(lines) + "\n"


def build_tokenizer(tmp_path=None):
    """A word-level fast tokenizer over WORDS (+ specials); saved to tmp_path if given."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {w: i for i, w in enumerate(specials + sorted(set(WORDS) | {f"Title{i}" for i in range(4)}
                                                          | {f"Section{i}" for i in range(2)} | {"="}))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", pad_token="<pad>")
    if tmp_path is not None:
        tok.save_pretrained(tmp_path)
    return tok


def build_model(vocab_size: int, seed: int = 0):
    """A 2-layer random Llama (hidden 64: every linear's in_features is a multiple of 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def write_data_dir(root, *, arc: bool = True):
    """Tiny files in the /work/shared/evaldata layout (wikitext2, c4-train, arc)."""
    (root / "wikitext2").mkdir(parents=True)
    (root / "wikitext2" / "wiki.test.raw").write_text(tiny_wikitext_raw(), encoding="utf-8")
    rng = torch.Generator().manual_seed(1)
    (root / "c4" / "c4-train").mkdir(parents=True)
    for i in range(3):
        (root / "c4" / "c4-train" / f"{i}.txt").write_text(_sentence(rng, 90), encoding="utf-8")
    if arc:
        (root / "arc").mkdir()
        rows = []
        for i in range(6):
            labels = ["A", "B", "C", "D"] if i % 2 else ["1", "2", "3", "4"]
            rows.append({"id": f"q{i}", "question": {"stem": _sentence(rng, 6) + " ?", "choices": [
                {"text": _sentence(rng, 2), "label": lab} for lab in labels]}, "answerKey": labels[i % 4]})
        for name in ("ARC-Easy-Test.jsonl", "ARC-Challenge-Test.jsonl"):
            (root / "arc" / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    return build_model(len(tok)), tok


def test_wikitext_rows_and_pages_follow_hub_layout():
    raw = tiny_wikitext_raw(articles=3)
    rows = ppl.wikitext_rows(raw)
    assert len(rows) == raw.count("\n")
    assert all(r == "" or r.endswith("\n") for r in rows) and "" in rows
    pages = ppl.wikitext_pages(raw)
    # One page per top-level heading; section headings ' = = S = = ' stay inside their page.
    assert len(pages) == 3
    assert all(p.startswith(f" = Title{i} = ") for i, p in enumerate(pages))
    assert " = = Section1 = = " in pages[0]


def test_token_perplexity_is_exp_mean_nll_over_non_overlapping_windows(tiny, tmp_path):
    model, tok = tiny
    data = write_data_dir(tmp_path / "data", arc=False)
    seqlen = 32
    out = ppl.perplexity(model, tok, "wikitext", data_dir=data, seqlen=seqlen, batch_size=2,
                         word_perplexity=False, progress=False)
    raw = (data / "wikitext2" / "wiki.test.raw").read_text()
    ids = tok("\n\n".join(ppl.wikitext_rows(raw)))["input_ids"]
    n = len(ids) // seqlen
    assert out["windows"] == out["windows_available"] == n and out["dropped_tokens"] == len(ids) - n * seqlen
    # Reference: HF's own shifted loss, window by window (each window has seqlen-1 targets).
    with torch.no_grad():
        losses = [model(torch.tensor([ids[i * seqlen:(i + 1) * seqlen]]),
                        labels=torch.tensor([ids[i * seqlen:(i + 1) * seqlen]])).loss.item() for i in range(n)]
    assert out["token_perplexity"] == pytest.approx(math.exp(sum(losses) / n), rel=1e-5)
    assert out["tokens"] == n * (seqlen - 1)

    limited = ppl.perplexity(model, tok, "wikitext", data_dir=data, seqlen=seqlen, max_windows=2,
                             word_perplexity=False, progress=False)
    assert limited["windows"] == 2
    assert limited["token_perplexity"] == pytest.approx(math.exp(sum(losses[:2]) / 2), rel=1e-5)


def test_word_perplexity_matches_lm_eval_rolling_loglikelihood(tiny, tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    model, tok = tiny
    data = write_data_dir(tmp_path / "data", arc=False)
    seqlen = 24  # shorter than every page, so documents span several rolling windows
    out = ppl.perplexity(model, tok, "wikitext", data_dir=data, seqlen=seqlen, progress=False)
    pages = ppl.wikitext_pages((data / "wikitext2" / "wiki.test.raw").read_text())
    lm = HFLM(pretrained=model, tokenizer=tok, max_length=seqlen, batch_size=1, device="cpu")
    reqs = [Instance("loglikelihood_rolling", {}, (wikitext_detokenizer({"page": p}),), i) for i, p in enumerate(pages)]
    loglik = sum(lm.loglikelihood_rolling(reqs, disable_tqdm=True))
    words = sum(len(re.split(r"\s+", p)) for p in pages)
    assert out["word_documents"] == len(pages) and out["words"] == words
    assert out["word_perplexity"] == pytest.approx(math.exp(-loglik / words), rel=1e-4)
    assert out["word_windows"] > len(pages)


def test_c4_reads_validation_shard_and_states_train_fallback(tiny, tmp_path):
    model, tok = tiny
    data = write_data_dir(tmp_path / "data", arc=False)
    fallback = ppl.perplexity(model, tok, "c4", data_dir=data, seqlen=32, word_perplexity=False, progress=False)
    assert fallback["source"].startswith("c4-train documents") and "not the classic" in fallback["notes"][0]
    docs = [(data / "c4" / "c4-train" / f"{i}.txt").read_text() for i in range(3)]
    with gzip.open(data / "c4" / "c4-validation.00000-of-00008.json.gz", "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "timestamp": "", "url": ""}) + "\n")
    shard = ppl.perplexity(model, tok, "c4", data_dir=data, seqlen=32, word_perplexity=False, progress=False)
    assert shard["notes"] == [] and "c4-validation" in shard["source"] and shard["documents"] == 3
    assert shard["token_perplexity"] == pytest.approx(fallback["token_perplexity"])  # same documents


def test_missing_data_names_the_expected_file(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ppl.EvalDataError, match=r"wikitext2/wiki\.test\.raw"):
        ppl.load_corpus("wikitext", tmp_path / "empty")
    with pytest.raises(ppl.EvalDataError, match=r"c4-validation\.00000-of-00008\.json\.gz"):
        ppl.load_corpus("c4", tmp_path / "empty")
    with pytest.raises(ppl.EvalDataError, match="does not exist"):
        ppl.load_corpus("wikitext", tmp_path / "nope")
    with pytest.raises(ValueError, match="unknown perplexity task"):
        ppl.load_corpus("ptb", tmp_path)


def test_decoded_weight_cache_keeps_outputs_bit_identical(tiny):
    import copy

    import fp4ptq
    from fp4ptq.eval import decoded_weight_cache
    from fp4ptq.modules import NVFP4Linear

    model, tok = tiny
    ids = torch.randint(4, len(tok), (2, 24), generator=torch.Generator().manual_seed(0))
    for scheme in ("w4a16", "w4a4"):
        q = fp4ptq.quantize(copy.deepcopy(model), fp4ptq.QuantConfig(scheme=scheme, four_six="mse", nsamples=2,
                                                                     seqlen=16), calib=ids[:, :16], progress=False)
        with torch.no_grad():
            plain = q(ids).logits
            with decoded_weight_cache(q):
                cached, again = q(ids).logits, q(ids).logits
        assert torch.equal(plain, cached) and torch.equal(plain, again)
        layers = [m for m in q.modules() if isinstance(m, NVFP4Linear)]
        assert layers and all("quantized_weight" not in m.__dict__ for m in layers)  # restored on exit
