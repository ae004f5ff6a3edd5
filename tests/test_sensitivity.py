"""keep_budget: the most KL-sensitive parts stay bf16, within the extra-bytes budget exactly."""
from __future__ import annotations

import pytest
import torch

from fp4ptq import sensitivity
from fp4ptq.config import ConfigError, QuantConfig


def test_selection_respects_the_budget_exactly():
    kl = {"a": 5.0, "b": 4.0, "c": 3.0, "d": 2.0, "e": 1.0}
    costs = {"a": 60, "b": 30, "c": 50, "d": 10, "e": 10}   # total 160
    kept, limit = sensitivity.select(kl, costs, "50%")     # 80 bytes: a (60), b would overflow, c too, d (70), e (80)
    assert limit == 80 and kept == ["a", "d", "e"] and sum(costs[k] for k in kept) <= limit
    assert sensitivity.select(kl, costs, "2")[0] == ["a", "b"]
    assert sensitivity.select(kl, costs, "10%")[0] == ["d"]   # 16 bytes: a, b, c do not fit
    for bad in ("0%", "101%", "-1", "x"):
        with pytest.raises(ConfigError):
            QuantConfig(keep_budget=bad)


@pytest.mark.filterwarnings("ignore:save. no tokenizer given")
def test_a_budget_below_every_part_keeps_nothing_and_says_so():
    with pytest.warns(UserWarning, match=r"keep budget 1% \(3 bytes\) is less than the smallest part's extra bytes \(b: 100\)"):
        assert sensitivity.select({"a": 2.0, "b": 1.0}, {"a": 200, "b": 100}, "1%") == ([], 3)


def test_quantize_keeps_the_chosen_linears_and_inspect_shows_them(tmp_path):
    import fp4ptq
    from fp4ptq.eval.report import inspect_checkpoint, inspect_markdown
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, max_position_embeddings=32)).eval()
    calib = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    config = QuantConfig(method="rtn", four_six="mse", keep_budget="20%", nsamples=2, seqlen=16)
    fp4ptq.quantize(model, config, calib, progress=False)
    keep = model.fp4ptq_info["keep"]
    assert keep["kept"] and keep["extra_bytes"] <= keep["budget_bytes"] == int(0.2 * keep["all_extra_bytes"])
    assert len(keep["kl_increase"]) == 8 and all(v >= 0 for v in keep["kl_increase"].values())
    top = max(keep["kl_increase"], key=keep["kl_increase"].get)
    assert top in keep["kept_parts"] or keep["part_bytes"][top] > keep["budget_bytes"]
    for name in keep["kept"]:
        assert type(model.get_submodule(name)) is torch.nn.Linear
        assert "keep_budget" in model.fp4ptq_info["high_precision"][name]
    assert model.fp4ptq_info["config"]["ignore"] == ["lm_head"]   # the config as asked, the choice apart
    fp4ptq.save(model, tmp_path / "ckpt")
    text = inspect_markdown(inspect_checkpoint(tmp_path / "ckpt"))
    assert "keep budget 20%" in text and keep["kept"][0] in text


@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
def test_each_part_runs_from_its_block_and_measures_what_the_full_forward_does(scheme):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=2, max_position_embeddings=32)).eval()
    calib = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    config = QuantConfig(method="rtn", four_six="mse", scheme=scheme, keep_budget="20%", keep_nsamples=2)
    parts = {n: [m] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}   # 21 linears + lm_head
    layers = model.model.layers
    calls = {0: 0, 2: 0}
    for i in calls:
        layers[i].self_attn.q_proj.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    from_blocks = sensitivity.measure(model, parts, calib, config)
    assert calls == {0: 2 * (1 + 8), 2: 2 * (1 + 22)}   # block 0 runs for its 7 parts and lm_head only
    full = sensitivity.measure(model, parts, calib, config, blocks=[])   # no blocks known: every forward whole
    assert from_blocks == full and len(full) == 22
    assert all("forward" not in b.__dict__ for b in layers)   # the blocks are left as they were
