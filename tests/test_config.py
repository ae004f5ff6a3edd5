"""QuantConfig: validation names the bad field, JSON round trip, ignore patterns."""
import dataclasses
import json

import pytest

import fp4ptq
from fp4ptq.config import ConfigError, QuantConfig


def test_public_name_is_the_config_class():
    assert fp4ptq.QuantConfig is QuantConfig


def test_defaults_are_rtn_w4a16_ignoring_lm_head():
    cfg = QuantConfig()
    assert (cfg.method, cfg.scheme, cfg.four_six, cfg.ignore) == ("rtn", "w4a16", None, ("lm_head",))
    assert not cfg.needs_calibration


def test_round_trip_through_json():
    cfg = QuantConfig(method="awq+gptq", four_six="mae", scheme="w4a4", ignore=["lm_head", "re:.*down_proj"],
                      calib="/data/docs", nsamples=8, seqlen=64, seed=3, gptq_act_order=True,
                      smoothquant_alphas=[0.5, 0.75])
    data = json.loads(json.dumps(cfg.to_dict()))
    assert data["ignore"] == ["lm_head", "re:.*down_proj"]
    again = QuantConfig.from_dict(data)
    assert again == cfg and hash(again) == hash(cfg)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        QuantConfig().method = "gptq"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"method": "hqq"}, "method"),
        ({"scheme": "w8a8"}, "scheme"),
        ({"four_six": "l1"}, "four_six"),
        ({"gptq_block_size": 100}, "gptq_block_size"),
        ({"gptq_damp": 0.0}, "gptq_damp"),
        ({"nsamples": 0}, "nsamples"),
        ({"seqlen": 1.5}, "seqlen"),
        ({"ignore": "lm_head"}, "ignore"),
        ({"ignore": ("re:(",)}, "ignore"),
        ({"gptq_scale_choice": "twice"}, "gptq_scale_choice"),
        ({"smoothquant_alpha": 1.5}, "alpha"),
        ({"awq_clip": "yes"}, "awq_clip"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        QuantConfig(**kwargs)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="bits"):
        QuantConfig.from_dict({"method": "rtn", "bits": 4})


@pytest.mark.parametrize(
    "method, transform, rounding",
    [("rtn", None, "rtn"), ("gptq", None, "gptq"), ("awq", "awq", "rtn"), ("smoothquant", "smoothquant", "rtn"),
     ("awq+gptq", "awq", "gptq"), ("smoothquant+gptq", "smoothquant", "gptq")],
)
def test_method_splits_into_transform_and_rounding(method, transform, rounding):
    cfg = QuantConfig(method=method)
    assert (cfg.transform, cfg.rounding) == (transform, rounding)
    assert cfg.needs_calibration == (method != "rtn")


def test_w4a4_needs_calibration_even_with_rtn():
    assert QuantConfig(scheme="w4a4").needs_calibration


def test_ignore_patterns():
    cfg = QuantConfig(ignore=("lm_head", "*.mlp.down_proj", "re:model\\.layers\\.1\\..*"))
    assert cfg.is_ignored("lm_head")
    assert cfg.is_ignored("model.lm_head")               # suffix after a dot
    assert not cfg.is_ignored("model.not_lm_head")
    assert cfg.is_ignored("model.layers.0.mlp.down_proj")  # glob
    assert cfg.is_ignored("model.layers.1.self_attn.q_proj")  # regex
    assert not cfg.is_ignored("model.layers.0.self_attn.q_proj")
