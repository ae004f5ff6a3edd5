"""The NVFP4 reference numerics against brute-force references written here.

Rules under test come from NVFP4.md: E2M1 round-to-nearest-even with
saturation at 6, E4M3 block scales (round to nearest even), the fp32 global
scale (448, or 256 with Four Over Six), blocks of 16 along the last dim, and
the Four Over Six choice (ties keep 6).
"""
from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4ptq import nvfp4
from fp4ptq.nvfp4 import NVFP4Error

GRID = nvfp4.E2M1_VALUES


# --------------------------------------------------------------------------- #
# Brute-force references
# --------------------------------------------------------------------------- #
def brute_e2m1_index(r: float) -> int:
    """Index into GRID of the value nearest |r|; at a tie, the even index
    (even mantissa) wins. Saturation falls out: 6 is nearest to all r > 5."""
    a = abs(Fraction(r))  # exact arithmetic: no rounding in the reference itself
    dists = [abs(a - Fraction(g)) for g in GRID]
    best = min(dists)
    candidates = [i for i, d in enumerate(dists) if d == best]
    if len(candidates) == 1:
        return candidates[0]
    (even,) = [i for i in candidates if i % 2 == 0]
    return even


def all_e4m3_values() -> torch.Tensor:
    """Every finite non-negative E4M3 value, ascending (bit patterns 0x00..0x7E)."""
    bits = torch.arange(0, 0x7F, dtype=torch.uint8)
    return bits.view(torch.float8_e4m3fn).float()


E4M3 = all_e4m3_values()


def brute_e4m3(v: float) -> float:
    """Nearest E4M3 value (ties to the even bit pattern), saturating at 448."""
    if v >= 448.0:
        return 448.0
    d = (E4M3.double() - v).abs()
    best = d.min()
    idx = torch.nonzero(d == best).flatten().tolist()
    if len(idx) == 2:
        idx = [i for i in idx if i % 2 == 0]
    return float(E4M3[idx[0]])


def brute_quantize_block(block: torch.Tensor, global_enc: float, target: float):
    """Codes magnitudes, signs, dequantized values (float64) of one block of
    fp32 values with a brute-force scale and brute-force element rounding.
    The division x / step is the spec's own operation and is done in fp32."""
    bmax = float(block.abs().max())
    scale = brute_e4m3(float(torch.tensor(bmax, dtype=torch.float32) / target * torch.tensor(global_enc)))
    step = torch.tensor(scale, dtype=torch.float32) / torch.tensor(global_enc, dtype=torch.float32)
    if scale == 0.0:
        idx = [0] * block.numel()
        ratios = [0.0] * block.numel()
    else:
        ratios = (block / step).tolist()
        idx = [brute_e2m1_index(r) for r in ratios]
    values = [GRID[i] * (-1.0 if b < 0 else 1.0) for i, b in zip(idx, block.tolist())]
    # dequantized values are fp32 numbers (what is stored and served)
    x_hat = (torch.tensor(values, dtype=torch.float32) * step).double()
    return idx, scale, x_hat


def error(x_hat: torch.Tensor, x: torch.Tensor, rule: str) -> float:
    d = x_hat - x.double()
    return {"mse": float((d * d).sum()), "mae": float(d.abs().sum()), "max": float(d.abs().max())}[rule]


# --------------------------------------------------------------------------- #
# Element rounding: every code and every tie
# --------------------------------------------------------------------------- #
def test_every_code_decodes_to_its_value():
    codes = torch.arange(16, dtype=torch.uint8)
    expected = [*GRID, 0.0, *[-g for g in GRID[1:]]]
    assert nvfp4.e2m1_decode(codes).tolist() == expected


def test_e2m1_spec_examples():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.2, 1e9])
    assert nvfp4.e2m1_rne(x).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0]
    assert nvfp4.e2m1_rne(-x).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, -6.0, -6.0]


def test_e2m1_every_tie_and_its_neighbours():
    """At every midpoint between grid neighbours, and one fp32 ulp either side."""
    mids = [(a + b) / 2 for a, b in zip(GRID, GRID[1:])]
    points = torch.tensor(mids, dtype=torch.float32)
    up = torch.nextafter(points, torch.full_like(points, 100.0))
    down = torch.nextafter(points, torch.zeros_like(points))
    for vals in (points, up, down, torch.tensor(GRID), torch.tensor([6.0, 7.0, 100.0, 3e38])):
        for sign in (1.0, -1.0):
            x = vals * sign
            codes = nvfp4.e2m1_code(x)
            expected = [brute_e2m1_index(v) | (8 if sign < 0 else 0) for v in x.tolist()]
            assert codes.tolist() == expected, (x.tolist(), codes.tolist(), expected)


def test_e2m1_dense_sweep_matches_brute_force():
    x = torch.linspace(-7.0, 7.0, 14001)
    x = torch.cat([x, torch.tensor([(a + b) / 2 for a, b in zip(GRID, GRID[1:])])])
    expected = torch.tensor([brute_e2m1_index(v) for v in x.tolist()], dtype=torch.uint8)
    expected |= torch.signbit(x).to(torch.uint8) << 3
    assert torch.equal(nvfp4.e2m1_code(x), expected)


def test_negative_zero_sign_convention():
    # A small negative value rounds to zero and keeps its sign bit (0x8); -0 decodes to 0.
    codes = nvfp4.e2m1_code(torch.tensor([-0.1, -0.0, 0.0, 0.1]))
    assert codes.tolist() == [8, 8, 0, 0]
    assert nvfp4.e2m1_decode(codes).abs().tolist() == [0.0] * 4


# --------------------------------------------------------------------------- #
# E4M3 scales
# --------------------------------------------------------------------------- #
def test_e4m3_every_value_midpoint_and_neighbour():
    vals = E4M3
    mids = (vals[:-1].double() + vals[1:].double()) / 2
    mids32 = mids.float()
    assert torch.equal(mids32.double(), mids)  # midpoints are exact in fp32
    probes = torch.cat([
        vals, mids32,
        torch.nextafter(mids32, torch.full_like(mids32, 1e9)),
        torch.nextafter(mids32, torch.zeros_like(mids32)),
        torch.tensor([448.0, 449.0, 464.0, 480.0, 1e6, 2.0**-10, 2.0**-12]),
    ])
    got = nvfp4.e4m3_rne(probes)
    expected = torch.tensor([brute_e4m3(v) for v in probes.tolist()])
    assert torch.equal(got, expected)
    # ... and equals torch's own float8_e4m3fn cast inside the representable range.
    inside = probes[probes <= 448]
    assert torch.equal(got[probes <= 448], inside.to(torch.float8_e4m3fn).float())


def test_global_scale_values():
    amax = torch.tensor(3.7)
    assert nvfp4.global_encode_scale(amax).item() == pytest.approx(6 * 448 / 3.7, rel=1e-7)
    assert nvfp4.global_encode_scale(amax, four_six=True).item() == pytest.approx(6 * 256 / 3.7, rel=1e-7)
    assert nvfp4.global_encode_scale(torch.tensor(0.0)).item() == 1.0
    assert torch.isfinite(nvfp4.global_encode_scale(torch.tensor(1e-45)))


# --------------------------------------------------------------------------- #
# Blocks against the brute force (property tests)
# --------------------------------------------------------------------------- #
def _blocks_strategy():
    """Blocks mixing wide random magnitudes, zeros, and exact grid ties."""
    element = st.one_of(
        st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32),
        st.floats(-2.0**-20, 2.0**-20, allow_nan=False, width=32),
        st.sampled_from([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -2.5, -5.0, -0.25]),
    )
    return st.integers(1, 4).flatmap(lambda n: st.lists(element, min_size=16 * n, max_size=16 * n))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(_blocks_strategy(), st.sampled_from([None, "mse", "mae", "max"]))
def test_quantize_matches_brute_force(values, rule):
    x = torch.tensor(values, dtype=torch.float32).reshape(1, -1)
    q = nvfp4.quantize(x, rule)
    g = float(nvfp4.global_encode_scale(x.abs().max(), four_six=rule is not None))
    assert float(q.global_enc) == g
    codes = q.codes().reshape(-1, 16)
    scales = q.block_scale.float().reshape(-1)
    x_hat = q.dequantize(torch.float32).reshape(-1, 16).double()
    for b, block in enumerate(x.reshape(-1, 16)):
        idx6, s6, xh6 = brute_quantize_block(block, g, 6.0)
        if rule is None:
            assert (codes[b] & 7).tolist() == idx6
            assert scales[b].item() == s6
            assert torch.equal(x_hat[b], xh6)
            continue
        idx4, s4, xh4 = brute_quantize_block(block, g, 4.0)
        e6, e4 = error(xh6, block, rule), error(xh4, block, rule)
        chose = bool(q.chose_four.reshape(-1)[b])
        chosen_err = error(x_hat[b], block, rule)
        tol = 1e-6 * max(e4, e6) + 1e-30
        if abs(e4 - e6) > tol:  # clear decision: must match the brute force exactly
            assert chose == (e4 < e6)
            assert (codes[b] & 7).tolist() == (idx4 if chose else idx6)
            assert scales[b].item() == (s4 if chose else s6)
        # whichever was chosen, it never loses to the standard 6-scaled block
        assert chosen_err <= e6 + tol
        assert s4 <= 384.0  # the x1.5 scale never saturates under the 256 global scale


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["mse", "mae", "max"]))
def test_four_six_never_increases_block_error(seed, rule):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 64, generator=gen) * torch.exp(torch.randn(8, 1, generator=gen) * 2)
    q46 = nvfp4.quantize(x, rule)
    x_hat = q46.dequantize(torch.float32)
    # the 6-only quantization under the same (256) global scale
    _, _, _, x_hat6 = nvfp4.quantize_blocks(x.reshape(8, 4, 16), q46.global_enc, None)
    per_block = {
        "mse": lambda d: (d * d).sum(-1), "mae": lambda d: d.abs().sum(-1), "max": lambda d: d.abs().amax(-1),
    }[rule]
    chosen = per_block((x_hat - x).reshape(8, 4, 16))
    six = per_block(x_hat6 - x.reshape(8, 4, 16))
    assert torch.all(chosen <= six)


# --------------------------------------------------------------------------- #
# Packing, idempotence, determinism
# --------------------------------------------------------------------------- #
def test_pack_unpack_round_trip_every_byte():
    codes = torch.tensor(list(itertools.product(range(16), repeat=2)), dtype=torch.uint8).reshape(-1)
    packed = nvfp4.pack_codes(codes)
    assert packed.tolist() == list(range(256)) or sorted(packed.tolist()) == list(range(256))
    assert torch.equal(nvfp4.unpack_codes(packed), codes)
    # element 2j in the low nibble
    assert nvfp4.pack_codes(torch.tensor([0x1, 0xF], dtype=torch.uint8)).item() == 0xF1


def test_dequantize_quantize_idempotent_on_representable_values():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.uint8)
    codes[:, ::16] = 0x7  # every block holds a +6: its max maps back onto itself
    scales = E4M3[torch.randint(1, len(E4M3), (32, 4), generator=gen)]
    global_enc = torch.tensor(1234.5)
    x = (nvfp4.e2m1_decode(codes).reshape(32, 4, 16) * (scales / global_enc).unsqueeze(-1)).reshape(32, 64)
    q = nvfp4.quantize(x, global_enc=global_enc)
    assert torch.equal(q.block_scale.float(), scales)
    assert torch.equal(q.dequantize(torch.float32), x)
    assert torch.equal(q.codes() & 7, codes & 7)


def test_fake_quantize_idempotent_under_fixed_global_scale():
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    g = nvfp4.global_encode_scale(x.abs().max())
    once = nvfp4.fake_quantize(x, global_enc=g)
    assert torch.equal(nvfp4.fake_quantize(once, global_enc=g), once)


def test_deterministic_and_chunk_independent(monkeypatch):
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    a = nvfp4.quantize(x, "mse")
    b = nvfp4.quantize(x, "mse")
    monkeypatch.setattr(nvfp4, "_CHUNK_ELEMENTS", 300)  # forces many chunks
    c = nvfp4.quantize(x, "mse")
    for q in (b, c):
        assert torch.equal(a.packed, q.packed)
        assert torch.equal(a.block_scale.view(torch.uint8), q.block_scale.view(torch.uint8))
        assert torch.equal(a.chose_four, q.chose_four)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_and_leading_shapes(dtype):
    x = torch.randn(2, 3, 5, 48, generator=torch.Generator().manual_seed(3)).to(dtype)
    q = nvfp4.quantize(x, "mae")
    assert q.packed.shape == (2, 3, 5, 24) and q.block_scale.shape == (2, 3, 5, 3)
    assert q.chose_four.shape == (2, 3, 5, 3)
    assert q.block_scale.dtype == torch.float8_e4m3fn and q.packed.dtype == torch.uint8
    out = q.dequantize()
    assert out.dtype == dtype and out.shape == x.shape
    # same codes as quantizing the fp32 upcast row by row
    flat = nvfp4.quantize(x.float().reshape(-1, 48), "mae")
    assert torch.equal(flat.packed, q.packed.reshape(-1, 24))


# --------------------------------------------------------------------------- #
# Edge cases
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_is_an_error_naming_the_tensor(bad):
    x = torch.randn(4, 32)
    x[2, 7] = bad
    with pytest.raises(NVFP4Error, match="layers.3.mlp.down_proj"):
        nvfp4.quantize(x, name="layers.3.mlp.down_proj")


def test_all_zero_tensor_and_zero_blocks():
    q = nvfp4.quantize(torch.zeros(4, 32), "mse")
    assert float(q.global_enc) == 1.0
    assert torch.equal(q.dequantize(torch.float32), torch.zeros(4, 32))
    x = torch.randn(4, 32)
    x[1, 16:] = 0.0
    q = nvfp4.quantize(x)
    assert q.block_scale[1, 1].float().item() == 0.0
    out = q.dequantize(torch.float32)
    assert torch.isfinite(out).all() and torch.equal(out[1, 16:], torch.zeros(16))


def test_tiny_blocks_whose_scale_rounds_to_zero_store_zeros():
    x = torch.zeros(1, 32)
    x[0, 0] = 1000.0
    x[0, 16:] = torch.linspace(-1e-4, 1e-4, 16)  # scale 1e-4/6*2.688 ~ 4.5e-5 < 2^-10
    q = nvfp4.quantize(x)
    assert q.block_scale[0, 1].float().item() == 0.0
    assert torch.equal((q.codes()[0, 16:] & 7), torch.zeros(16, dtype=torch.uint8))
    assert torch.equal(q.dequantize(torch.float32)[0, 16:].abs(), torch.zeros(16))


def test_last_dim_not_multiple_of_16():
    x = torch.randn(8, 40)
    with pytest.raises(NVFP4Error, match=r"model.embed.*last dim 40 is not a multiple of 16"):
        nvfp4.quantize(x, name="model.embed")
    q = nvfp4.quantize(x, pad=True)
    assert q.shape == x.shape and q.padded_k == 48
    out = q.dequantize(torch.float32)
    assert out.shape == x.shape
    # padding zeros do not change the real elements' quantization
    ref = nvfp4.quantize(torch.nn.functional.pad(x, (0, 8)), global_enc=q.global_enc)
    assert torch.equal(out, ref.dequantize(torch.float32)[:, :40])


def test_bad_rule_and_bad_input():
    with pytest.raises(NVFP4Error, match="unknown Four Over Six rule"):
        nvfp4.quantize(torch.randn(2, 16), "l2")
    with pytest.raises(NVFP4Error, match="floating-point"):
        nvfp4.quantize(torch.ones(2, 16, dtype=torch.int32))


# --------------------------------------------------------------------------- #
# Caller-given amax and 2D blocks
# --------------------------------------------------------------------------- #
def test_shared_amax_gives_one_global_scale_and_saturates():
    gen = torch.Generator().manual_seed(4)
    q_w, k_w = torch.randn(32, 64, generator=gen), torch.randn(16, 64, generator=gen) * 3
    shared = torch.maximum(q_w.abs().max(), k_w.abs().max())
    qa, qb = nvfp4.quantize(q_w, amax=shared), nvfp4.quantize(k_w, amax=shared)
    assert float(qa.global_enc) == float(qb.global_enc) == float(nvfp4.global_encode_scale(shared))
    # a static amax below the data saturates: scale at 448, values at +-6 steps
    x = torch.full((1, 16), 10.0)
    q = nvfp4.quantize(x, amax=1.0)
    assert q.block_scale.float().max().item() == 448.0
    assert torch.allclose(q.dequantize(torch.float32), torch.full((1, 16), 1.0))


def test_2d_blocks_share_one_scale_per_tile():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(48, 64, generator=gen)
    x[17, 3] = 40.0  # an outlier in tile (1, 0)
    q = nvfp4.quantize(x, block_2d=True)
    scales = q.block_scale.float()
    assert scales.shape == (48, 4)
    tiles = scales.reshape(3, 16, 4)
    assert torch.equal(tiles, tiles[:, :1, :].expand_as(tiles))
    g = q.global_enc
    bmax = x.reshape(3, 16, 4, 16).abs().amax(dim=(1, 3))
    assert torch.equal(tiles[:, 0, :], nvfp4.e4m3_rne(bmax / 6 * g))
    # elements round exactly as 1D blocks would under the tile's step
    step = (scales / g).repeat_interleave(16, dim=1)
    expected = nvfp4.e2m1_rne(x / step) * step
    assert torch.equal(q.dequantize(torch.float32), expected)
    # a scale shared by 16 rows is coarser than one per row
    assert nvfp4.quantization_error(x, q) >= nvfp4.quantization_error(x, nvfp4.quantize(x))
    q46 = nvfp4.quantize(x, "mse", block_2d=True)
    assert q46.chose_four.shape == (48, 4)


# --------------------------------------------------------------------------- #
# Real weights (skipped without the demo model package)
# --------------------------------------------------------------------------- #
def test_real_smollm2_weights_four_six_reduces_error(demo_source):
    model, _, _ = demo_source
    layer = model.model.layers[0]
    for name, linear in [("q_proj", layer.self_attn.q_proj), ("down_proj", layer.mlp.down_proj)]:
        w = linear.weight.detach()
        base = nvfp4.quantization_error(w, nvfp4.quantize(w, name=name))
        q46 = nvfp4.quantize(w, "mse", name=name)
        assert nvfp4.quantization_error(w, q46) < base
        assert 0.05 < q46.four_share() < 0.95
