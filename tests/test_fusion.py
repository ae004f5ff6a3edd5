"""``fp4ptq.fuse_projections``: q/k/v and gate/up run as one GEMM a group, with the same outputs,
state dict and memory, and the group dissolves when its layers' buffers change."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import fp4ptq
from fp4ptq import fusion
from fp4ptq.modules import NVFP4Linear
from static_decoding import eager_and_compiled_steps

VOCAB = 128


def _quantized(scheme="w4a16", qwen=False, seed=0):
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
    model = (Qwen2ForCausalLM(Qwen2Config(**kw)) if qwen else LlamaForCausalLM(LlamaConfig(**kw))).eval()
    if qwen:  # non-zero q/k/v biases, so the fused bias is checked
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.Linear) and m.bias is not None:
                    m.bias.normal_()
    calib = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(seed))
    config = fp4ptq.QuantConfig(method="rtn", scheme=scheme, four_six="mse" if scheme == "w4a4" else None,
                                nsamples=4, seqlen=16)
    return fp4ptq.quantize(model, config, calib, progress=False)


IDS = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def _count_calls(monkeypatch):
    """Counts ``kernels.linear_*`` calls (every NVFP4 product on the CPU goes through one)."""
    from fp4ptq import kernels, modules
    calls = []
    for name in ("linear_w4a16", "linear_w4a4"):
        real = getattr(kernels, name)

        def counted(x, weight, *args, real=real, **kwargs):
            calls.append(weight.shape[0])
            return real(x, weight, *args, **kwargs)
        monkeypatch.setattr(kernels, name, counted)
    assert modules.kernels is kernels
    return calls


@pytest.mark.parametrize("scheme,qwen", [("w4a16", False), ("w4a4", False), ("w4a16", True)])
def test_fused_groups_give_the_layers_outputs_in_fewer_products(monkeypatch, scheme, qwen):
    model = _quantized(scheme, qwen)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = _logits(model)
    report = fp4ptq.fuse_projections(model)
    assert report == {"fused": 4, "skipped": {}}
    calls = _count_calls(monkeypatch)
    after = _logits(model)
    # per block: q/k/v as one product of 64 + 32 + 32 rows, o, gate/up as one of 256, down
    assert calls == [128, 64, 256, 64] * 2
    # the reference products of a wider weight: the same exact products, summed in fp32
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    # the state dict: the same bits, in tensors of their own (checkpoint writers refuse shared memory)
    fused_state = model.state_dict()
    assert fused_state.keys() == state.keys()
    for k, v in fused_state.items():
        assert torch.equal(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
                           state[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else state[k]), k
    ptrs = [v.untyped_storage().data_ptr() for v in fused_state.values()]
    assert len(set(ptrs)) == len(ptrs)


def test_fusing_adds_no_memory():
    model = _quantized()
    nbytes = sum(b.untyped_storage().nbytes() for b in model.buffers())
    fp4ptq.fuse_projections(model)
    q = model.model.layers[0].self_attn.q_proj
    storages = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in model.buffers()}
    assert sum(storages.values()) == nbytes
    assert q._shares_memory() and q.weight_packed.untyped_storage().data_ptr() == \
        model.model.layers[0].self_attn.v_proj.weight_packed.untyped_storage().data_ptr()


def test_a_slice_is_handed_out_once_per_input():
    model = _quantized()
    fp4ptq.fuse_projections(model)
    attn = model.model.layers[0].self_attn
    group = attn.q_proj._fused[0]
    x = torch.randn(3, 64)
    with torch.no_grad():
        q = attn.q_proj(x)
        assert group._last is not None and group._last[0] is x
        k = attn.k_proj(x)
        v = attn.v_proj(x)
        assert group._last is None  # every slice taken: nothing held
        k2 = attn.k_proj(x)         # called again: computed again
        x.mul_(2.0)                 # written in place: not the input the group ran
        q2 = attn.q_proj(x)
        other = torch.randn(3, 64)
        v3 = attn.v_proj(other)     # another input: its own product
    for name, y in (("q_proj", q), ("k_proj", k), ("v_proj", v), ("k_proj", k2)):
        assert torch.equal(y, _alone(getattr(attn, name), x / 2.0)), name
    assert torch.equal(q2, _alone(attn.q_proj, x)) and torch.equal(v3, _alone(attn.v_proj, other))


def _alone(layer: NVFP4Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's output computed by itself (not through its group)."""
    fused, layer._fused = layer._fused, None
    try:
        with torch.no_grad():
            return layer(x)
    finally:
        layer._fused = fused


def test_in_place_writes_dissolve_the_group():
    model = _quantized()
    fp4ptq.fuse_projections(model)
    other = _quantized(seed=1)
    k = model.model.layers[0].self_attn.k_proj
    group = k._fused[0]
    with torch.no_grad():
        k.weight_packed.copy_(other.model.layers[0].self_attn.k_proj.weight_packed)
    expected = _logits(_unfused_copy(model))
    assert torch.equal(_logits(model), expected)
    assert group.module is None and k._fused is None
    # load_state_dict writes every buffer in place: the model follows the loaded weights
    fp4ptq.fuse_projections(model)
    model.load_state_dict(other.state_dict())
    assert torch.equal(_logits(model), _logits(other))


def _unfused_copy(model):
    copied = copy.deepcopy(model)
    assert all(m._fused is None for m in copied.modules() if isinstance(m, NVFP4Linear))
    return copied


def test_replaced_buffers_dissolve_the_group():
    model = _quantized()
    before = _logits(model)
    fp4ptq.fuse_projections(model)
    model._apply(lambda t: t.clone())  # what .to() to another device does: new tensors
    assert torch.equal(_logits(model), _logits(_unfused_copy(model)))
    assert all(m._fused is None for m in model.modules() if isinstance(m, NVFP4Linear))
    torch.testing.assert_close(_logits(model), before, rtol=1e-5, atol=1e-5)


def test_copies_pickles_and_unfusing_keep_the_weights():
    model = _quantized()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fp4ptq.fuse_projections(model)
    fused_logits = _logits(model)
    buf = io.BytesIO()
    torch.save(model, buf)  # (plain pickle cannot hold float8 tensors in this torch, fused or not)
    buf.seek(0)
    restored = torch.load(buf, weights_only=False)
    copied = copy.deepcopy(model)
    for m in (restored, copied):
        assert torch.equal(_logits(m), _logits(_unfused_copy(model)))
    assert fusion.unfuse_projections(model) == 10
    assert not any(m._shares_memory() or m._fused is not None for m in model.modules() if isinstance(m, NVFP4Linear))
    for k, v in model.state_dict().items():
        assert torch.equal(v.view(torch.uint8), state[k].view(torch.uint8)) if v.dtype == torch.float8_e4m3fn \
            else torch.equal(v, state[k])
    torch.testing.assert_close(_logits(model), fused_logits, rtol=1e-5, atol=1e-5)


def test_checkpoint_of_a_fused_model_round_trips(tmp_path):
    model = _quantized()
    fp4ptq.fuse_projections(model)
    fp4ptq.save(model, tmp_path / "ckpt")
    loaded = fp4ptq.load(tmp_path / "ckpt")
    for k, v in model.state_dict().items():
        w = loaded.state_dict()[k]
        assert torch.equal(v.view(torch.uint8), w.view(torch.uint8)) if v.dtype == torch.float8_e4m3fn \
            else torch.equal(v, w), k
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)  # plain torch.save too


def test_gradients_and_compilation_take_the_layers_own_path(monkeypatch):
    model = _quantized()
    fp4ptq.fuse_projections(model)
    calls = _count_calls(monkeypatch)
    x = torch.randn(2, 64, requires_grad=True)
    q = model.model.layers[0].self_attn.q_proj
    y = q(x)  # a gradient is wanted: the layer alone (kernels._Linear has the backward)
    y.sum().backward()
    assert calls == [64] and x.grad is not None
    with torch.no_grad():
        q(x)
    assert calls == [64, 128]


def test_groups_that_cannot_share_one_gemm_are_reported():
    model = _quantized()
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        mlp.up_proj.weight_global_scale.mul_(2.0)
    model.model.layers[0].self_attn.v_proj = torch.nn.Linear(64, 32, bias=False)
    report = fp4ptq.fuse_projections(model)
    assert report["fused"] == 2
    assert set(report["skipped"]) == {"model.layers.0.{self_attn.q_proj,self_attn.k_proj,self_attn.v_proj}",
                                      "model.layers.1.{mlp.gate_proj,mlp.up_proj}"}
    assert "global scales differ" in report["skipped"]["model.layers.1.{mlp.gate_proj,mlp.up_proj}"]
    assert fp4ptq.fuse_projections(model)["fused"] == 0  # the fused ones stay as they are


def test_unsupported_architectures_are_named():
    from fp4ptq.models import UnsupportedArchitecture
    with pytest.raises(UnsupportedArchitecture, match="no architecture table"):
        fp4ptq.fuse_projections(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_the_group_runs_alone_where_fusing_would_leave_the_triton_kernels(monkeypatch):
    """On CUDA a group runs as one GEMM up to MAX_ROWS rows, and asks the kernels' shape rules first:
    where the fused layer would go to dequantize + cuBLAS and a layer alone to a Triton kernel, the
    layers run alone."""
    from fp4ptq import kernels
    model = _quantized()
    fp4ptq.fuse_projections(model)
    group = model.model.layers[0].self_attn.q_proj._fused[0]
    rules = {}
    monkeypatch.setattr(kernels, "auto_path", lambda m, n, k, dtype, device, w4a4: rules[n])
    x = torch.randn(1, 5, 64)
    for paths, pays in (({128: "cublas", 64: "wsgemm", 32: "wsgemm"}, False),
                        ({128: "cublas", 64: "cublas", 32: "cublas"}, True),
                        ({128: "wsgemm", 64: "cublas", 32: "wsgemm"}, True)):
        rules.clear()
        rules.update(paths)
        group._pays.clear()
        assert group._fused_pays(x) is pays
        rules.clear()  # decided once per row count
        assert group._fused_pays(x) is pays
    rules.update({128: "wsgemm", 64: "wsgemm", 32: "wsgemm"})
    assert not group._fused_pays(torch.randn(fusion.MAX_ROWS + 1, 64))  # prefill-sized inputs: alone
    assert group._fused_pays(torch.randn(2, fusion.MAX_ROWS // 2, 64))


def test_offloaded_layers_are_not_fused():
    with torch.device("meta"):
        layers = [NVFP4Linear(64, 32) for _ in range(3)]
    assert "meta" in fusion._mismatch(layers)


def test_a_compiled_fused_model_runs_one_op_a_group(monkeypatch):
    """Under torch.compile a group is one custom op too (its slices handed out in the traced code),
    without graph breaks; the compiled fused model gives the eager logits."""
    model = _quantized()
    fp4ptq.fuse_projections(model)
    eager = _logits(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        compiled(IDS, use_cache=False)
        calls = _count_calls(monkeypatch)
        out = compiled(IDS, use_cache=False).logits
    assert calls == [128, 64, 256, 64] * 2
    assert not torch._dynamo.utils.counters["graph_break"]
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    fused = [name for name, m in model.named_modules() if isinstance(m, NVFP4Linear) and m._fused is not None]
    assert len(fused) == 10  # still fused for eager calls
    assert all(m._fused[0]._traced is None for m in model.modules() if isinstance(m, NVFP4Linear) and m._fused)


def test_compiled_static_cache_decoding_of_a_fused_model_follows_eager():
    """transformers' compiled decoding (a static cache written in place, one token a step) on a fused
    W4A4 model: the compiled steps give the eager steps' logits."""
    model = _quantized("w4a4")
    fp4ptq.fuse_projections(model)
    eager, compiled = eager_and_compiled_steps(model, VOCAB)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_generate_compiles_a_fused_model_into_one_graph_with_the_eager_tokens(monkeypatch):
    """``generate`` with a static cache, which transformers compiles by itself (here with aot_eager,
    allowed on the CPU): one graph without breaks, the group's GEMM once a group in the compiled
    steps, and the tokens of eager generation."""
    from transformers import CompileConfig

    model = _quantized()
    fp4ptq.fuse_projections(model)
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))

    def generate(compile_config):
        model.generation_config.compile_config = compile_config
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                                  cache_implementation="static")[0, 8:]

    eager = generate(None)
    config = CompileConfig(backend="aot_eager", mode=None)
    config._compile_all_devices = True  # transformers compiles only on accelerators otherwise
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    calls = _count_calls(monkeypatch)
    compiled = generate(config)
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    # the prompt's forward runs eagerly; the traced decode step holds one product a group
    assert calls[-4:] == [128, 64, 256, 64]
    assert torch.equal(compiled, eager)


def test_auto_path_names_the_dispatch_s_choice(monkeypatch):
    from fp4ptq import kernels
    from fp4ptq.kernels import dispatch as dp
    assert kernels.auto_path(1, 4096, 4096, torch.bfloat16, torch.device("cpu")) == "reference"
    seen = []
    monkeypatch.setattr(kernels, "_interpreting", lambda: False)
    monkeypatch.setattr(dp, "choose", lambda *args: seen.append(args) or "wsgemm")
    assert kernels.auto_path(512, 6144, 4096, torch.bfloat16, "cuda:0", w4a4=True) == "wsgemm"
    assert seen == [(512, torch.bfloat16, True, 4096, torch.device("cuda:0"), 6144)]


def test_compiled_code_runs_layers_alone_once_their_buffers_were_replaced(monkeypatch):
    """Layers moved after fusing (new tensors): the traced code sees it and runs them alone."""
    model = _quantized()
    fp4ptq.fuse_projections(model)
    model._apply(lambda t: t.clone())  # what .to() to another device does
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        compiled(IDS, use_cache=False)
        calls = _count_calls(monkeypatch)
        out = compiled(IDS, use_cache=False).logits
    assert calls == [64, 32, 32, 64, 128, 128, 64] * 2
    torch.testing.assert_close(out, _logits(_unfused_copy(model)), rtol=1e-5, atol=1e-5)
