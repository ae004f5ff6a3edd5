"""Block-Hadamard rotations: the float model's function is unchanged, online rotations round-trip."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from fp4ptq import rotation
from fp4ptq.models import arch_spec

VOCAB = 96
pytestmark = pytest.mark.filterwarnings("ignore:save. no tokenizer given")


def _tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    model = (Qwen3ForCausalLM(Qwen3Config(head_dim=16, attention_bias=True, **kw)) if kind == "qwen3"
             else LlamaForCausalLM(LlamaConfig(**kw)))
    with torch.no_grad():   # non-trivial norm weights and biases, so folding them matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def test_hadamard_blocks_are_orthogonal_and_match_compressed_tensors():
    ct = pytest.importorskip("compressed_tensors.transform.utils.hadamard")
    for b in rotation.ROTATION_BLOCKS:
        M = rotation.hadamard_signs(b, seed=3) / b ** 0.5
        assert torch.allclose(M @ M.T, torch.eye(b, dtype=torch.float64))
    assert torch.equal(rotation.sylvester_hadamard(32), ct.deterministic_hadamard_matrix(32, torch.float64))
    assert rotation.block_for(576, 128) == 64 and rotation.block_for(1536, 128) == 128


@pytest.mark.parametrize("kind,block,seed,residual", [("llama", 16, 0, True), ("llama", 32, None, True),
                                                      ("qwen3", 64, 1, True), ("qwen3", 128, 2, False)])
def test_rotated_model_gives_the_same_logits(kind, block, seed, residual):
    model = _tiny(kind)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    plan = rotation.plan_from_spec(model, arch_spec(model), residual=residual)
    info = rotation.rotate_model(model, plan, block, seed=seed)
    with torch.no_grad():
        after = model(ids).logits
    assert info["head_untied"] == residual
    assert (model.lm_head.weight is not model.model.embed_tokens.weight) == residual
    assert len(info["online"]) == 2 and all(rotation.online_transform(model.get_submodule(n)) for n in info["online"])
    assert torch.allclose(after, before, atol=2e-5, rtol=1e-4), (after - before).abs().max()
    # the weights did change (a rotation that is the identity would pass the check above)
    assert not torch.allclose(model.model.layers[0].mlp.down_proj.weight.float(), _tiny(kind).model.layers[0].mlp.down_proj.weight)


def test_gemma_norms_are_refused():
    norm = type("GemmaRMSNorm", (torch.nn.Module,), {})()
    norm.weight = torch.nn.Parameter(torch.ones(16))
    with pytest.raises(rotation.RotationError, match="1 \\+ weight"):
        rotation.fold_norm(norm, [torch.nn.Linear(16, 4)], "model.norm")


def _calib(n=4, t=32):
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
def test_rotated_checkpoint_round_trips_with_its_transform_config(tmp_path, scheme):
    import json

    import fp4ptq
    from compressed_tensors.transform import TransformConfig

    model = _tiny("llama")
    config = fp4ptq.QuantConfig(method="rtn", four_six="mse", scheme=scheme, rotate=32, nsamples=4, seqlen=32)
    fp4ptq.quantize(model, config, _calib(), progress=False)
    down = model.model.layers[1].mlp.down_proj
    assert type(down).__name__ == "NVFP4Linear" and rotation.online_transform(down) is not None
    ids = _calib(2, 16)
    with torch.no_grad():
        before = model(ids).logits
    fp4ptq.save(model, tmp_path / "ckpt")
    qcfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    transforms = TransformConfig.model_validate(qcfg["transform_config"])
    scheme_ = transforms.config_groups[rotation.TRANSFORM_GROUP]
    assert scheme_.type == "random-hadamard" and scheme_.head_dim == 32
    assert scheme_.apply[0].targets == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert scheme_.apply[0].location == "input"
    loaded = fp4ptq.load(tmp_path / "ckpt", device="cpu", dtype=torch.float32)
    assert not loaded.config.tie_word_embeddings
    assert torch.equal(rotation.online_transform(loaded.model.layers[1].mlp.down_proj).weight,
                       rotation.online_transform(down).weight)
    with torch.no_grad():
        after = loaded(ids).logits
    assert torch.allclose(after, before, atol=1e-5, rtol=1e-5)
    assert loaded.fp4ptq_info["rotation"]["online"]["model.layers.0.mlp.down_proj"] == 32
    if scheme == "w4a16":   # transformers' from_pretrained (fp4ptq's quantizer) applies them too
        from transformers import AutoModelForCausalLM

        hf_loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
        assert rotation.online_transform(hf_loaded.model.layers[0].mlp.down_proj) is not None
        with torch.no_grad():
            assert torch.allclose(hf_loaded(ids).logits, before, atol=1e-5, rtol=1e-5)


def test_smoothing_skips_an_online_rotated_input():
    import fp4ptq

    model = _tiny("llama")
    config = fp4ptq.QuantConfig(method="awq", scheme="w4a16", rotate=16, nsamples=2, seqlen=32, awq_grid=2,
                                search_nsamples=1)
    fp4ptq.quantize(model, config, _calib(2), progress=False)
    smoothing = model.fp4ptq_info["smoothing"]
    down = smoothing["model.layers.0.mlp.down_proj"]   # discovery sees no exact fold past the rotation
    assert "skipped" in down and "awq_ratio" not in down
    assert "awq_ratio" in smoothing["model.layers.0.mlp.gate_proj"]
