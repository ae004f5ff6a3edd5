"""The weight global-scale search: never worse than the plain amax on its own objective, and used by quantize."""
from __future__ import annotations

import pytest
import torch

from fp4ptq import nvfp4
from fp4ptq.methods import scale_search


def test_weight_search_picks_the_least_reconstruction_error():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(32, 64, generator=g) * torch.rand(1, 64, generator=g)
    amax = W.abs().max()
    best, c, errors = scale_search.search_weight_amax([W], amax, four_six="mse")
    direct = {k: float((nvfp4.fake_quantize(W, "mse", amax=amax * k) - W).pow(2).sum()) for k in errors}
    assert errors == direct and errors[c] == min(errors.values()) and torch.equal(best, amax * c)
    assert c != 1.0 and errors[c] < errors[1.0]   # this tensor gains from the search


def test_quantize_with_the_search_records_it_and_lowers_weight_error():
    import fp4ptq
    from transformers import LlamaConfig, LlamaForCausalLM

    def run(**kw):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, max_position_embeddings=32)).eval()
        calib = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        config = fp4ptq.QuantConfig(method="rtn", four_six="mse", scheme="w4a4", nsamples=2, seqlen=16, **kw)
        return fp4ptq.quantize(model, config, calib, progress=False).fp4ptq_info["layers"]

    plain, searched = run(), run(weight_scale_search=True)
    for name, entry in searched.items():
        assert "weight_amax_multiplier" in entry and "input_amax_multiplier" not in entry
        if name.endswith(("o_proj", "down_proj")):   # unfused: the search's objective is this layer's error
            assert entry["rel_error"] <= plain[name]["rel_error"] + 1e-7, name


def test_a_record_of_the_retired_input_search_reads_when_off_and_is_refused_when_on():
    from fp4ptq.config import ConfigError, QuantConfig

    data = QuantConfig().to_dict()
    assert QuantConfig.from_dict({**data, "input_scale_search": False}) == QuantConfig()
    with pytest.raises(ConfigError, match="input_scale_search was removed"):
        QuantConfig.from_dict({**data, "input_scale_search": True})
