"""Calibration data: local files and directories, hub train splits (mocked),
data-free sampling; shapes, determinism, and clear errors."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from fp4ptq import calib
from fp4ptq.calib import CalibrationDataError, get_calibration


class CharTokenizer:
    """One token per character (ids 1..127), EOS = 0: enough for calibration."""

    eos_token_id = 0
    pad_token_id = 0
    all_special_ids = [0]

    def __call__(self, text, add_special_tokens=False, verbose=True):
        return {"input_ids": [1 + ord(c) % 127 for c in text]}


TOK = CharTokenizer()


def encode(text):
    return torch.tensor(TOK(text)["input_ids"])


def test_txt_file_windows_are_distinct_slices_and_seeded(tmp_path):
    text = "".join(f"line {i} of the calibration text.\n" for i in range(60))
    path = tmp_path / "a.txt"
    path.write_text(text)
    out = get_calibration(str(path), TOK, 6, 32, seed=0)
    assert out.shape == (6, 32) and out.dtype == torch.long
    stream = encode(text)
    # Each row is one of the non-overlapping 32-token slots of the token stream.
    slots = stream[: stream.numel() // 32 * 32].view(-1, 32)
    index = [next(i for i, slot in enumerate(slots) if torch.equal(slot, row)) for row in out]
    assert len(set(index)) == 6
    assert len({tuple(r.tolist()) for r in out}) == 6
    assert torch.equal(out, get_calibration(str(path), TOK, 6, 32, seed=0))
    assert not torch.equal(out, get_calibration(str(path), TOK, 6, 32, seed=1))


def test_directory_of_txt_and_jsonl_documents(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "1.txt").write_text("alpha " * 30)
    (tmp_path / "sub" / "2.txt").write_text("beta " * 30)
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": f"gamma {i} " * 10}) for i in range(3)))
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    docs, count = calib.local_documents(tmp_path)
    assert count == 5 and any(d.startswith("beta") for d in docs)
    out = get_calibration(str(tmp_path), TOK, 4, 24, seed=3)
    assert out.shape == (4, 24)
    assert torch.equal(out, get_calibration(str(tmp_path), TOK, 4, 24, seed=3))


def test_short_source_overlaps_with_a_warning_and_too_short_is_an_error(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("x" * 40)
    with pytest.warns(UserWarning, match="overlap"):
        assert get_calibration(str(path), TOK, 5, 16).shape == (5, 16)
    with pytest.raises(CalibrationDataError, match="fewer than seqlen=64"):
        get_calibration(str(path), TOK, 1, 64)


def test_missing_and_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(CalibrationDataError, match="nowhere.txt.*neither a known dataset"):
        get_calibration(str(tmp_path / "nowhere.txt"), TOK, 1, 8)
    bad = tmp_path / "data.csv"
    bad.write_text("a,b")
    with pytest.raises(CalibrationDataError, match="unsupported suffix"):
        get_calibration(str(bad), TOK, 1, 8)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(CalibrationDataError, match="broken.jsonl:2"):
        get_calibration(str(broken), TOK, 1, 8)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CalibrationDataError, match="holds no"):
        get_calibration(str(empty), TOK, 1, 8)


@pytest.mark.parametrize("source", ["wikitext2", "c4", "pile"])
def test_hub_sources_read_train_splits_only(source, monkeypatch):
    import datasets

    seen = {}

    class FakeStream(list):
        def shuffle(self, seed, buffer_size):
            seen["shuffle_seed"] = seed
            return FakeStream(reversed(self))

    class FakeDataset(dict):
        pass

    def fake_load_dataset(name, config=None, *, data_files=None, split=None, streaming=False):
        seen.update(name=name, split=split, data_files=data_files)
        rows = [f"document number {i} " * 5 for i in range(20)]
        if streaming:
            return FakeStream({"text": r} for r in rows)
        return FakeDataset(text=rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    out = get_calibration(source, TOK, 3, 16, seed=7)
    assert out.shape == (3, 16)
    assert seen["split"] == "train" and "valid" not in str(seen["data_files"]) and "test" not in str(seen)
    assert seen["name"] == calib.HUB_SOURCES[source][0]


def test_hub_failure_suggests_a_local_source(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(CalibrationDataError, match="local .txt/.jsonl"):
        get_calibration("c4", TOK, 1, 8)


def test_data_free_samples_from_the_model_deterministically():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=0, bos_token_id=0)).eval()
    state = torch.random.get_rng_state()
    out = get_calibration("self", TOK, 3, 12, seed=4, model=model)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone
    assert out.shape == (3, 12) and out.dtype == torch.long
    assert torch.all(out[:, 0] != 0)  # never starts on a special token
    assert torch.equal(out, get_calibration("self", TOK, 3, 12, seed=4, model=model))
    with pytest.raises(CalibrationDataError, match="model="):
        get_calibration("self", TOK, 1, 8)


def test_works_with_a_transformers_fast_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<eos>", "<unk>", "the", "cat", "sat", "on", "mat"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")
    (tmp_path / "t.txt").write_text("the cat sat on the mat " * 50)
    out = get_calibration(str(tmp_path / "t.txt"), tokenizer, 4, 10)
    assert out.shape == (4, 10) and int(out.max()) < len(words) and int(out.min()) >= 2
