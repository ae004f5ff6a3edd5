"""The CPU reference forward's shortcuts change nothing: the fused activation
fake-quantizer equals quantize + dequantize bit for bit, and NVFP4Linear's
decoded-weight cache gives the uncached outputs and follows its buffers."""
import copy
import io

import pytest
import torch

from fp4ptq import kernels, nvfp4
from fp4ptq.modules import DECODE_CACHE_ENV, NVFP4Linear

RULES = (None, "mse", "mae", "max")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal including the sign of zeros (torch.equal treats -0 == +0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(a.view(as_int), b.view(as_int))


def reference_fake_quantize(x, four_six, dtype=torch.float32, **scale):
    return nvfp4.quantize(x, four_six, **scale).dequantize(dtype)


def hard_activations(seed: int = 0) -> torch.Tensor:
    """[64, 128] fp32 rows of 8 blocks each: gaussian and heavy-tailed blocks, exact
    rounding ties under both candidate scales (with global_enc 1), zeros and -0, blocks
    whose E4M3 scale is subnormal or 0 (tiny against amax 8), and blocks far above amax 8."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 128, generator=g) * 2
    x[8:16] = x[8:16] ** 3                # heavy-tailed rows
    blocks = x.view(64, 8, 16)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    blocks[16, :, :8] = ties              # bmax 6: the 6-scale step is 1, every value a tie
    blocks[16, :, 8:] = -ties
    ties4 = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 4.0, 4.0])
    blocks[17, :, :8] = ties4             # bmax 4: the 4-scale step is 1, ties again
    blocks[17, :, 8:] = -ties4
    blocks[18] = 0.0
    blocks[19] = -0.0
    blocks[20, :, 0] = -1e-3              # zeros and one small negative that rounds to -0
    blocks[21] = torch.randn(8, 16, generator=g) * 5e-5   # E4M3-subnormal scale
    blocks[22] = torch.randn(8, 16, generator=g) * 1e-6   # scale rounds to 0: all zeros
    blocks[23] = torch.randn(8, 16, generator=g) * 100    # far above amax 8: scale and codes saturate
    blocks[24, :, 3] = 3e38                               # x / step overflows to inf
    return x


SCALES = ({"amax": torch.tensor(8.0)}, {"amax": 6.0}, {}, {"global_enc": torch.tensor(1.0)},
          {"global_enc": torch.tensor(448.0)})


def test_hard_activations_cover_the_cases():
    x = hard_activations()
    scales = nvfp4.quantize(x, amax=torch.tensor(8.0)).block_scale.float()
    assert (scales == 0).any() and ((scales > 0) & (scales < 2.0 ** -6)).any() and (scales == 448).any()
    # With global_enc 1 the scaled values of rows 16/17 sit exactly on rounding midpoints.
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert torch.isin(x[16].abs() / 1.0, midpoints).sum() >= 56
    assert float(nvfp4.block_scale(torch.tensor(4.0), torch.tensor(1.0), 4.0)) == 1.0
    assert float(nvfp4.block_scale(torch.tensor(6.0), torch.tensor(1.0), 6.0)) == 1.0


@pytest.mark.parametrize("four_six", RULES)
def test_fused_fake_quantize_equals_quantize_then_dequantize(four_six):
    x = hard_activations()
    for scale in SCALES:
        expected = reference_fake_quantize(x, four_six, **scale)
        got = nvfp4.fake_quantize_fused(x, four_six, dtype=torch.float32, **scale)
        assert same_bits(got, expected), (four_six, scale, int((got != expected).sum()))
    if four_six is not None:   # both candidates win somewhere, so the choice itself is compared
        share = nvfp4.quantize(x, four_six, amax=torch.tensor(8.0)).four_share()
        assert 0.05 < share < 0.95


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_fake_quantize_half_inputs_and_leading_dims(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 5, 64, generator=g) * 4).to(dtype)
    amax = torch.tensor(6.0)
    for four_six in RULES:
        for out in (None, torch.float32):
            expected = nvfp4.quantize(x, four_six, amax=amax).dequantize(out)
            got = nvfp4.fake_quantize_fused(x, four_six, amax=amax, dtype=out)
            assert same_bits(got, expected), (four_six, out)


def test_fused_fake_quantize_many_random_blocks_and_chunks(monkeypatch):
    # Scales over 12 binades, so every E2M1 interval and both candidates get hit; small
    # chunks make the row loop run several times.
    g = torch.Generator().manual_seed(2)
    binades = torch.randint(-8, 4, (120, 16, 1), generator=g).float()
    x = torch.randn(120, 256, generator=g) * torch.exp2(binades).expand(120, 16, 16).reshape(120, 256)
    monkeypatch.setattr(nvfp4, "_CHUNK_ELEMENTS", 256 * 7)
    for four_six in RULES:
        expected = reference_fake_quantize(x, four_six, amax=torch.tensor(4.0))
        assert same_bits(nvfp4.fake_quantize_fused(x, four_six, amax=torch.tensor(4.0)), expected), four_six


def test_fused_rounding_matches_e2m1_rne_on_every_boundary():
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.0, 2.5, 3.5, 4.0, 5.0, 6.0, 7.0])
    near = torch.cat([bounds, torch.nextafter(bounds, torch.zeros(())), torch.nextafter(bounds, torch.full((), 9.0))])
    mags = torch.cat([near, torch.linspace(0, 8, 40001), torch.tensor([0.0, 1e-45, 1e-38, 3e38])])
    got = nvfp4._e2m1_magnitude_times_step(mags.view(-1, 1), torch.ones(1, 1)).view(-1)
    assert same_bits(got, nvfp4.e2m1_rne(mags))


def test_fused_fake_quantize_errors_like_quantize():
    x = torch.randn(4, 32)
    x[2, 5] = float("nan")
    with pytest.raises(nvfp4.NVFP4Error, match="act.*NaN"):
        nvfp4.fake_quantize_fused(x, amax=1.0, name="act")
    with pytest.raises(nvfp4.NVFP4Error, match="not a multiple of 16"):
        nvfp4.fake_quantize_fused(torch.randn(4, 24), amax=1.0)
    with pytest.raises(nvfp4.NVFP4Error, match="unknown Four Over Six rule"):
        nvfp4.fake_quantize_fused(torch.randn(4, 32), "l2", amax=1.0)


# --------------------------------------------------------------------------- #
# The decoded-weight cache of NVFP4Linear
# --------------------------------------------------------------------------- #
def make_layer(scheme, four_six, dtype=torch.float32, seed=0, out_features=48, in_features=64, bias=True):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g) if bias else None
    q = nvfp4.quantize(weight.to(dtype), four_six)
    return NVFP4Linear.from_quantized(q, bias, scheme=scheme, input_amax=3.0 if scheme == "w4a4" else None,
                                      act_four_six=four_six if scheme == "w4a4" else None, dtype=dtype)


def uncached_reference(layer: NVFP4Linear, x: torch.Tensor) -> torch.Tensor:
    """The reference formulas as they read before any cache or fused quantizer."""
    weight = layer.quantized_weight()
    if layer.scheme == "w4a16":
        return torch.nn.functional.linear(x, weight.dequantize(x.dtype), layer.bias)
    x_hat = nvfp4.quantize(x, layer.act_four_six, amax=layer.input_amax()).dequantize(torch.float32)
    y = torch.nn.functional.linear(x_hat, weight.dequantize(torch.float32)).to(x.dtype)
    return y if layer.bias is None else y + layer.bias


@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
@pytest.mark.parametrize("four_six", [None, "mse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_forward_is_bit_identical(scheme, four_six, dtype):
    layer = make_layer(scheme, four_six, dtype)
    x = (torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    expected = uncached_reference(layer, x)
    layer.decode_cache = False
    uncached = layer(x)
    assert layer._decoded is None
    layer.decode_cache = True
    first, second = layer(x), layer(x)
    assert layer._decoded is not None
    for y in (uncached, first, second):
        assert same_bits(y, expected)
    # The second call used the kept tensor instead of decoding again.
    kept = layer._decoded[3]
    layer(x)
    assert layer._decoded[3] is kept


def test_cache_follows_buffer_changes():
    layer, other = make_layer("w4a4", "mse", seed=0), make_layer("w4a4", "mse", seed=1)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    layer.decode_cache = other.decode_cache = True
    want_other = other(x)
    want_self = layer(x)

    def check(expected):
        assert same_bits(layer(x), expected)

    # In-place copies of every weight buffer (what load_state_dict does by default).
    layer.load_state_dict(other.state_dict())
    check(want_other)
    # One buffer written in place at a time: the output is the reference of that mix.
    fresh = make_layer("w4a4", "mse", seed=0)
    for name in ("weight_packed", "weight_scale", "weight_global_scale"):
        layer.load_state_dict(other.state_dict())
        check(want_other)
        getattr(layer, name).copy_(getattr(fresh, name))
        mix = copy.deepcopy(other)
        getattr(mix, name).copy_(getattr(fresh, name))
        check(uncached_reference(mix, x))
    # Buffers replaced by new tensors (load_state_dict(assign=True), as fp4ptq.load does).
    layer.load_state_dict(make_layer("w4a4", "mse", seed=0).state_dict(), assign=True)
    check(want_self)
    # Moving the module drops the copy at once.
    assert layer._decoded is not None
    layer.to("cpu")
    assert layer._decoded is None
    check(want_self)


def test_cache_keyed_on_dtype_and_not_in_state_or_pickle():
    layer = make_layer("w4a16", "mse", bias=False)   # one layer, fp32 and bf16 activations
    layer.decode_cache = True
    keys = set(layer.state_dict())
    x = torch.randn(3, 64)
    y32 = layer(x)
    y16 = layer(x.bfloat16())
    assert layer._decoded[2] == torch.bfloat16
    assert same_bits(y16, uncached_reference(layer, x.bfloat16()))
    assert same_bits(layer(x), y32)
    assert set(layer.state_dict()) == keys
    saved = io.BytesIO()
    torch.save(layer, saved)          # pickles the module (plain pickle cannot do fp8 storages)
    saved.seek(0)
    for clone in (copy.deepcopy(layer), torch.load(saved, weights_only=False)):
        assert clone._decoded is None and same_bits(clone(x), y32)


def test_cache_switches(monkeypatch):
    from fp4ptq.eval import decoded_weight_cache

    layer = make_layer("w4a4", None)
    x = torch.randn(3, 64)
    expected = uncached_reference(layer, x)
    monkeypatch.setenv(DECODE_CACHE_ENV, "0")
    assert same_bits(layer(x), expected) and layer._decoded is None
    model = torch.nn.Sequential(layer)
    with decoded_weight_cache(model):          # forces the cache on for its duration
        assert same_bits(model(x), expected) and layer._decoded is not None
    assert layer.decode_cache is None and layer._decoded is None   # setting restored, copy dropped
    monkeypatch.delenv(DECODE_CACHE_ENV)
    assert same_bits(layer(x), expected) and layer._decoded is not None   # on by default
    layer.decode_cache = False
    assert same_bits(layer(x), expected) and layer._decoded is None


def test_no_cache_for_inference_tensors():
    with torch.inference_mode():
        layer = make_layer("w4a16", None)   # buffers are inference tensors: no version counter
        x = torch.randn(3, 64)
        layer.decode_cache = True
        assert same_bits(layer(x), uncached_reference(layer, x))
    assert layer._decoded is None
    # A cache filled under inference mode is not reused outside it (and vice versa).
    layer = make_layer("w4a16", None)
    layer.decode_cache = True
    with torch.inference_mode():
        layer(x)
    assert layer._decoded[1] is True
    layer(x)
    assert layer._decoded[1] is False


def test_w4a4_input_amax_is_kept_while_its_scale_is_unchanged():
    """The W4A4 forward keeps the activations' amax (``6 * 448 / input_global_scale``) instead of
    dividing on every call, and computes it again whenever the scale buffer is written in place,
    replaced, moved, or is an inference tensor (no version counter): the outputs always follow it."""
    layer = make_layer("w4a4", None)
    layer.decode_cache = False
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5)) * 4
    assert same_bits(layer(x), uncached_reference(layer, x))
    kept = layer._amax[1]
    layer(x)
    assert layer._amax[1] is kept   # not computed again
    layer.input_global_scale.mul_(2.0)   # in place: a new amax
    assert same_bits(layer(x), uncached_reference(layer, x)) and layer._amax[1] is not kept
    layer.load_state_dict(make_layer("w4a4", None, seed=3).state_dict(), assign=True)   # replaced
    layer.input_global_scale = torch.tensor([500.0])
    assert same_bits(layer(x), uncached_reference(layer, x))
    assert float(layer._amax[1]) == pytest.approx(6 * 448 / 500.0)
    layer.to(torch.float32)
    assert layer._amax is None
    with torch.inference_mode():
        frozen = make_layer("w4a4", None)
        frozen.decode_cache = False
        assert same_bits(frozen(x), uncached_reference(frozen, x)) and frozen._amax is None


def test_kernels_reference_uses_the_given_decoder_only_off_triton():
    layer = make_layer("w4a4", "mse")
    x = torch.randn(3, 64)
    calls = []

    def decoder(dtype):
        calls.append(dtype)
        return layer.dequantized_weight(dtype)

    y = kernels.linear_w4a4(x, layer.quantized_weight(), layer.input_amax(), layer.bias, four_six="mse",
                            backend="reference", decoded=decoder)
    assert calls == [torch.float32] and same_bits(y, uncached_reference(layer, x))


@pytest.mark.parametrize("four_six", [None, "mse", "mae", "max"])
def test_fake_quantize_takes_the_fused_path_with_the_same_bits(four_six, monkeypatch):
    x = hard_activations(3)
    expected = reference_fake_quantize(x, four_six, amax=torch.tensor(8.0))
    calls = []
    real = nvfp4.fake_quantize_fused
    monkeypatch.setattr(nvfp4, "fake_quantize_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert same_bits(nvfp4.fake_quantize(x, four_six, amax=torch.tensor(8.0)), expected) and calls
    # 2-D blocks and padding keep the packer's path.
    calls.clear()
    nvfp4.fake_quantize(x, four_six, block_2d=True)
    assert not calls
