"""The kld eval task equals a direct computation on a toy case."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from fp4ptq.eval.kld import kl_divergence
from fp4ptq.eval.perplexity import PerplexityCorpus

VOCAB = 40


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def _model(seed):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=32)).eval()


def test_kld_equals_a_direct_computation():
    words = torch.randint(0, VOCAB - 1, (70,), generator=torch.Generator().manual_seed(0))
    corpus = PerplexityCorpus("wikitext", "toy", " ".join(f"w{i}" for i in words.tolist()), [], False)
    base, model = _model(0), _model(1)
    out = kl_divergence(model, base, _tokenizer(), seqlen=16, max_windows=3, progress=False, corpus=corpus)
    ids = words[:48].view(3, 16)
    with torch.no_grad():
        p = F.log_softmax(base(ids).logits[:, :-1].double(), -1)
        q = F.log_softmax(model(ids).logits[:, :-1].double(), -1)
    direct = F.kl_div(q, p, log_target=True, reduction="sum") / (3 * 15)
    assert out["windows"] == 3 and out["tokens"] == 45
    assert abs(out["kld"] - float(direct)) < 1e-5 * float(direct)
    nll = F.nll_loss(q.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    assert abs(out["token_perplexity"] - float(nll.exp())) < 1e-4
    assert kl_divergence(base, base, _tokenizer(), seqlen=16, max_windows=2, progress=False, corpus=corpus)["kld"] < 1e-6
