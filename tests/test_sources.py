"""Source models: the demo GGUF loads as a plain float model (skipped without it)."""
from __future__ import annotations

import torch


def test_demo_gguf_loads_as_a_plain_float_model_that_saves_and_reloads(tmp_path, demo_source):
    from transformers import AutoModelForCausalLM

    model, _, src = demo_source
    assert src.gguf_file and model.hf_quantizer is None and not model.is_quantized
    assert getattr(model.config, "quantization_config", None) is None
    model.save_pretrained(tmp_path / "float")  # refused while the GGUF quantizer was attached
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.float32)
    ids = torch.arange(1, 17)[None]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
