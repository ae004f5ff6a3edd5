"""The grouped NVFP4 MoE GEMM (fp4ptq/kernels/grouped.py) against the loop over experts (nvfp4.py).

The kernel checks run under ``TRITON_INTERPRET=1`` in a fresh process (as tests/test_kernels.py does:
Triton decides at import whether it interprets), started by ``test_grouped_under_triton_interpreter``;
the routing, the reference, the LinearExperts hook's stacking and the sm_90 / sm_80 builds run here.
Shapes are tiny and odd: 5 or 3 experts, some with no token, one token, masked slots, K not a multiple
of the K tile. Run directly: ``TRITON_INTERPRET=1 pytest tests/test_grouped.py``.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fp4ptq import nvfp4
from fp4ptq.experts import ExpertMLP, LinearExperts
from fp4ptq.modules import NVFP4Linear

pytest.importorskip("triton")

from fp4ptq.kernels import grouped as G
from fp4ptq.kernels import routing as R

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
TOLERANCE = 1e-2  # the dense kernels' (tests/test_kernels.py: relative Frobenius error against the reference)


@pytest.mark.skipif(INTERPRETED, reason="this is the driver of the interpreted run")
def test_grouped_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", __file__]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]


def _rel(y, ref):
    assert torch.isfinite(y).all(), "output has unwritten or non-finite elements"
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def _weights(e, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return [nvfp4.quantize(torch.randn(n, k, generator=g) * 0.05) for _ in range(e)]


def _x(t, k, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.rand(t, k, generator=g).pow(3) * 3
    x[0, :16] = 0.0        # an all-zero block
    if k >= 32:
        x[-1, 16:32] *= 1e-7  # a block whose scale rounds to zero
    return x.to(dtype)


# 5 experts, 7 tokens, top-2: expert 1 and 3 get nothing, a masked slot (the sentinel 5 = E, as transformers'
# expert-parallel masking), a token routed twice to one expert
INDEX_5 = torch.tensor([[0, 2], [2, 4], [4, 0], [0, 2], [2, 2], [4, 5], [0, 4]])


def test_route_sorts_pairs_and_tiles_only_active_experts():
    r = G.route(INDEX_5, 5, block_m=2)
    assert r.offsets.tolist() == [0, 4, 4, 9, 9, 13]
    flat = INDEX_5.reshape(-1)
    assert flat[r.order].tolist() == [0] * 4 + [2] * 5 + [4] * 4 + [5]
    assert r.token.tolist() == (r.order // 2).tolist() and r.valid.tolist() == [True] * 13 + [False]
    used = r.tile_expert >= 0
    assert r.tile_expert[used].tolist() == [0, 0, 2, 2, 2, 4, 4]           # experts 1 and 3: no tile
    assert r.tile_row[used].tolist() == [0, 2, 4, 6, 8, 9, 11]
    assert r.tile_expert.numel() == 7 + 5                                   # the host-side upper bound
    single = G.route(torch.tensor([[3]]), 5)
    assert single.block_m == 16 and (single.tile_expert >= 0).sum() == 1 and single.offsets.tolist()[3:5] == [0, 1]


def test_reference_is_the_loop_over_experts():
    ws = _weights(5, 24, 48, seed=1)
    sw = G.stack_weights(ws)
    x = _x(7, 48, seed=2)
    r = G.route(INDEX_5, 5)
    y = G.grouped_linear(x, r, sw, backend="reference")
    for p in range(r.pairs):
        t, e = int(r.order[p]) // 2, int(INDEX_5.reshape(-1)[r.order[p]])
        want = torch.zeros(24, dtype=x.dtype) if e >= 5 else torch.nn.functional.linear(
            x[t:t + 1], ws[e].dequantize(x.dtype))[0]
        assert torch.equal(y[p], want), p


def _stub_gating():
    class Gating:  # stands in for a transformers experts module's _apply_gate (concatenated SwiGLU)
        @staticmethod
        def _apply_gate(gate_up):
            g, u = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.silu(g) * u
    return Gating()


def _quantized_experts(e, hidden, inter, scheme="w4a16", four_six=None, seed=0, bias=False):
    """A LinearExperts of NVFP4Linear experts, gate and up of each sharing one global scale."""
    g = torch.Generator().manual_seed(seed)
    experts = []
    for i in range(e):
        mlp = ExpertMLP(("gate_proj", "up_proj", "down_proj"), hidden, inter, bias=False, dtype=torch.float32)
        ws = [torch.randn(inter, hidden, generator=g) * 0.05, torch.randn(inter, hidden, generator=g) * 0.05,
              torch.randn(hidden, inter, generator=g) * 0.05]
        shared = max(float(ws[0].abs().max()), float(ws[1].abs().max()))
        amaxes = (shared, shared, None)
        for name, w, amax in zip(mlp.names, ws, amaxes):
            b = torch.randn(w.shape[0], generator=g) * 0.1 if bias else None
            q = nvfp4.quantize(w, amax=amax)
            lin = NVFP4Linear.from_quantized(q, b, scheme=scheme, act_four_six=four_six, dtype=torch.bfloat16,
                                             input_amax=(2.5 + i if name != "down_proj" else 0.7) if scheme == "w4a4"
                                             else None)
            setattr(mlp, name, lin)
        experts.append(mlp)
    return LinearExperts(experts, _stub_gating(), True, e)


def test_experts_stack_once_as_views_and_fall_back_where_they_cannot():
    """The hook's stacking (CPU here; on CUDA forward takes it): codes and scales become views of the
    stacks (state_dict unchanged), built again when one expert's buffer is replaced, dropped by .to();
    an expert with its own gate and up global scales, and experts not quantized, are not grouped."""
    layer = _quantized_experts(3, 32, 16)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    _, w13, w2 = layer._stacked_weights(torch.device("cpu"))
    assert w13.packed.shape == (3, 32, 16) and w2.packed.shape == (3, 32, 8) and w13.input_amax is None
    gate = layer[1].gate_proj
    assert gate.weight_packed.data_ptr() == w13.packed[1].data_ptr()
    assert layer[1].up_proj.weight_packed.data_ptr() == w13.packed[1, 16:].data_ptr()
    after = layer.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k].view(torch.uint8) if before[k].dtype
                                                  == torch.float8_e4m3fn else before[k], after[k].view(torch.uint8)
                                                  if after[k].dtype == torch.float8_e4m3fn else after[k])
                                                  for k in before)
    assert layer._stacked_weights(torch.device("cpu"))[1] is w13          # cached
    layer[2].down_proj.weight_packed = layer[2].down_proj.weight_packed.clone()  # one expert's buffer replaced
    assert not layer._still_held(layer._stacked[0])
    _, w13_again, _ = layer._stacked_weights(torch.device("cpu"))
    assert w13_again is not w13 and layer[2].down_proj.weight_packed.data_ptr() == layer._stacked[2].packed[2].data_ptr()
    layer.to(torch.float32)
    assert layer._stacked is None
    odd = _quantized_experts(3, 32, 16, seed=4)
    with torch.no_grad():
        odd[2].up_proj.weight_global_scale.mul_(2)
    assert odd._stacked_weights(torch.device("cpu")) is None
    assert odd.grouped_forward(_x(2, 32, 0), torch.tensor([[0, 1], [2, 0]]), torch.ones(2, 2)) is None
    plain = LinearExperts([ExpertMLP(("w1", "w3", "w2"), 32, 16, False) for _ in range(3)], _stub_gating(), True, 3)
    assert plain._stacked_weights(torch.device("cpu")) is None and plain._stacked is None  # not quantized


@pytest.mark.skipif(INTERPRETED, reason="compiles for a GPU target; runs in the main process")
@pytest.mark.parametrize("arch,a4,bm", [(90, False, 16), (90, False, 128), (80, False, 128), (90, True, 64),
                                        (80, True, 16), (90, False, "narrow"), (80, True, "narrow")])
def test_grouped_kernel_compiles_for_sm90_and_sm80(arch, a4, bm):
    """No GPU here: the kernel's builds (W4A16; W4A4, the prologue's operands with both global scales;
    bf16; the decode tile, the split decode's narrow one writing fp32 partials, a mid and the prefill tile)
    compile for sm_90 and sm_80: tensor-core MMAs on the decoded weight (wgmma from the 64-row tile on
    sm_90, mma.sync otherwise) and shared memory within sm_80-89's 99 KB."""
    import re

    from compile_target import compile_for

    types = {"x_ptr": "*bf16", "token_ptr": "*i32", "tile_expert_ptr": "*i32", "tile_row_ptr": "*i32",
             "offsets_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*u8", "wenc_ptr": "*fp32", "xenc_ptr": "*fp32",
             "bias_ptr": "*fp32", "y_ptr": "*bf16"}
    bn, bk, warps, stages = G.DECODE_NARROW if bm == "narrow" else G.kernel_config(bm, 1536, 2048)
    if bm == "narrow":  # the split decode: the narrow tile writing fp32 partial sums
        bm, types = 16, dict(types, y_ptr="*fp32")
    consts = {"GATHER": not a4, "HAS_BIAS": False, "A4": a4, "BLOCK_M": bm, "BLOCK_N": bn,
              "BLOCK_K": bk, "EVEN_K": True, "DOT_FP32": False}
    built = compile_for(G._grouped_kernel, types, consts, arch=arch, num_warps=warps, num_stages=stages)
    ptx = built.asm["ptx"]
    mma = set(re.findall(r"wgmma\.mma_async|mma\.sync", ptx))
    assert mma == ({"wgmma.mma_async"} if arch == 90 and bm >= 64 else {"mma.sync"}), (arch, bm, mma)
    assert built.metadata.shared <= 99 * 1024, (arch, bm, built.metadata.shared)


@pytest.mark.skipif(INTERPRETED, reason="compiles for a GPU target; runs in the main process")
@pytest.mark.parametrize("arch,four_six,bm", [(90, 0, 16), (90, 1, 128), (80, 1, 16), (80, 0, 64)])
def test_w4a4_prologue_compiles_for_sm90_and_sm80(arch, four_six, bm):
    """The W4A4 prologue (standard and Four Over Six; the decode and the prefill program; gather and
    sorted rows) compiles for sm_90 and sm_80 without FMA contraction (its quantizer's roundings must stay
    those of nvfp4.py) and without local memory."""
    import re

    from compile_target import compile_for

    types = {"x_ptr": "*bf16", "token_ptr": "*i32", "tile_expert_ptr": "*i32", "tile_row_ptr": "*i32",
             "offsets_ptr": "*i32", "xenc_ptr": "*fp32", "q_ptr": "*bf16"}
    rows, bk, warps = G.PROLOGUE_DECODE if bm <= 16 else G.PROLOGUE_TILE
    consts = {"GATHER": bm <= 16, "FOUR_SIX": four_six, "BLOCK_M": bm, "ROWS": rows, "BLOCK_K": bk}
    ptx = compile_for(G._quantize_pairs_kernel, types, consts, arch=arch, num_warps=warps,
                      enable_fp_fusion=False).asm["ptx"]
    assert "fma.rn.f32" not in ptx
    assert sum(int(n) for n in re.findall(r"__local_depot\d+\[(\d+)\]", ptx)) == 0, (arch, four_six, bm)


@pytest.mark.skipif(INTERPRETED, reason="compiles for a GPU target; runs in the main process")
@pytest.mark.parametrize("arch", [90, 80])
def test_routing_and_combine_kernels_compile_for_sm90_and_sm80(arch):
    """The routing kernels (8 and 256 experts on sm_90, 256 on sm_80; the chunked three and the one-chunk
    one) and the combine compile for sm_90 and sm_80 with (next to) no local memory; the combine is built
    without FMA contraction (its products and sums round as torch's)."""
    import re

    from compile_target import compile_for

    def local_bytes(ptx):
        return sum(int(n) for n in re.findall(r"__local_depot\d+\[(\d+)\]", ptx))

    i32 = {name: "*i32" for name in ("hist_ptr", "base_ptr", "offsets_ptr", "tile_expert_ptr", "tile_row_ptr",
                                     "token_ptr", "position_ptr")}
    ptrs = dict(i32, idx_ptr="*i64", order_ptr="*i64", valid_ptr="*u8")
    for e in (8, 256) if arch == 90 else (256,):
        bins, cb, tb, warps = G.route_launch_config(e)
        chunked = {"CHUNK": G.ROUTE_CHUNK, "BINS": bins}
        built = [compile_for(R._route_hist_kernel, ptrs, chunked, arch=arch, num_warps=4),
                 compile_for(R._route_scan_kernel, ptrs, {"BINS": bins, "CB": cb, "TB": tb}, arch=arch,
                             num_warps=warps),
                 compile_for(R._route_place_kernel, ptrs, chunked, arch=arch, num_warps=4),
                 compile_for(R._route_one_chunk_kernel, ptrs, dict(chunked, TB=tb), arch=arch, num_warps=4)]
        assert all(local_bytes(b.asm["ptx"]) <= 16 for b in built), (arch, e)  # (E = 256 in one program: 8 B)
    combine = compile_for(G._combine_kernel, dict(ptrs, y_ptr="*bf16", w_ptr="*bf16", out_ptr="*i16"),
                          {"K": 8, "BLOCK_N": 512, "OUT_BF16": True}, arch=arch, num_warps=4, enable_fp_fusion=False)
    assert "fma.rn.f32" not in combine.asm["ptx"] and local_bytes(combine.asm["ptx"]) == 0


@pytest.mark.skipif(INTERPRETED, reason="compiles for a GPU target; runs in the main process")
@pytest.mark.parametrize("arch", [90, 80])
def test_gating_split_combine_and_dequant_kernels_compile_for_sm90_and_sm80(arch):
    """The consumers of split launches (the fused gating from bf16 rows and from 3 fp32 partials, the
    combine summing 3 partials) and the prefill path's stacked dequantize compile for sm_90 and sm_80
    without local memory; the combine and the dequantize are built without FMA contraction (their
    roundings are torch's / nvfp4.py's)."""
    import re

    from compile_target import compile_for

    from fp4ptq.kernels import grouped_dequant as D

    def local_bytes(ptx):
        return sum(int(n) for n in re.findall(r"__local_depot\d+\[(\d+)\]", ptx))

    ptrs = {"valid_ptr": "*u8", "out_ptr": "*i16", "position_ptr": "*i32", "w_ptr": "*bf16"}
    built = [compile_for(G._swiglu_kernel, dict(ptrs, y_ptr=y), {"S": s, "BLOCK": 1024, "OUT_BF16": True},
                         arch=arch, num_warps=4) for y, s in (("*bf16", 1), ("*fp32", 3))]
    combine = compile_for(G._combine_kernel, dict(ptrs, y_ptr="*fp32"), {"K": 8, "BLOCK_N": 512, "OUT_BF16": True,
                                                                          "S": 3}, arch=arch, num_warps=4,
                          enable_fp_fusion=False)
    dequant = compile_for(D._dequant_experts_kernel, {"w_ptr": "*i32", "s_ptr": "*u8", "wenc_ptr": "*fp32",
                                                      "offsets_ptr": "*i32", "out_ptr": "*i16"},
                          {"BLOCK_N": 32, "BLOCK_B": 16, "OUT_BF16": True}, arch=arch, num_warps=4,
                          enable_fp_fusion=False)
    assert all(local_bytes(b.asm["ptx"]) == 0 for b in built + [combine, dequant]), arch
    assert "fma.rn.f32" not in combine.asm["ptx"] and "fma.rn.f32" not in dequant.asm["ptx"]


@interpreted
@pytest.mark.parametrize("a4,four_six", [(False, None), (True, None), (True, "mse")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_linear_matches_reference(a4, four_six, dtype):
    """5 experts (two without a token), a masked slot, K = 80 (not a multiple of the K tile): the kernel
    against the loop over experts (bias included), within the dense kernels' tolerance, and elementwise
    within one output ulp of the exact fp32 products of the same operands (fake-quantized activations
    for W4A4, Four Over Six included); rows of no expert are not written."""
    e, n, k = 5, 40, 80
    ws = _weights(e, n, k, seed=3)
    bias = torch.randn(e, n, generator=torch.Generator().manual_seed(4)).to(dtype) * 0.1
    amax = [torch.tensor(2.0 + i) for i in range(e)] if a4 else None
    sw = G.stack_weights(ws, list(bias), amax, four_six)
    x = _x(7, k, seed=5, dtype=dtype)
    r = G.route(INDEX_5, e)
    out = torch.full((r.pairs, n), float("nan"), dtype=dtype)
    y = G.grouped_linear(x, r, sw, backend="triton", out=out)
    ref = G.grouped_linear_reference(x, r, sw)
    v = r.valid
    assert torch.isnan(y[~v]).all()
    assert _rel(y[v], ref[v]) < TOLERANCE
    exact = torch.empty(r.pairs, n)
    for p in range(r.pairs):
        ex = int(INDEX_5.reshape(-1)[r.order[p]])
        if ex >= e:
            continue
        xr = x[int(r.token[p])].float()[None]
        if a4:
            xr = nvfp4.fake_quantize(xr, four_six, amax=amax[ex])
        exact[p] = xr[0] @ ws[ex].dequantize(torch.float32).T + bias[ex].float()
    # every element within one unit in the last place of the output dtype (the interpreter's casts truncate)
    ulp = torch.finfo(dtype).eps
    assert ((y[v].float() - exact[v]).abs() <= exact[v].abs() * ulp * 1.01 + 1e-6).all()


@interpreted
@pytest.mark.parametrize("block_m", [16, 32])
def test_grouped_linear_sorted_rows_single_token_and_many_rows_a_tile(block_m):
    """The down projection's form (x in sorted order, no gather) with 3 experts: one token (one row in
    one tile), and 20 tokens top-3 (several tiles an expert, a partial last tile)."""
    e, n, k = 3, 24, 64
    sw = G.stack_weights(_weights(e, n, k, seed=6))
    for idx in (torch.tensor([[1]]), torch.randint(0, e, (20, 3), generator=torch.Generator().manual_seed(7))):
        r = G.route(idx, e, block_m=block_m)
        x = _x(r.pairs, k, seed=8)
        y = G.grouped_linear(x, r, sw, gather=False, backend="triton")
        assert _rel(y, G.grouped_linear_reference(x, r, sw, gather=False)) < TOLERANCE


@interpreted
@pytest.mark.parametrize("four_six", [None, "mse", "mae", "max"])
def test_w4a4_prologue_operands_and_output_are_bit_exact(four_six):
    """The W4A4 prologue (``quantize_pairs``: each pair's row quantized once under its expert's activation
    global scale) writes ``sign * v * block scale`` of nvfp4.quantize's codes and scales bit for bit
    (heavy-tailed rows, a zero and a tiny block; gather and sorted rows) and leaves the rows of no expert
    as given; and (standard, mse) the W4A4 launch equals, bit for bit, the W4A16 kernel run on those
    nvfp4.quantize operands with the global scale ``enc_w * enc_x``: what quantizing inside the kernel gave
    (the same operands, the same fp32 sums in the same order). 5 experts (two empty), a masked slot, a
    single token, biases, K = 80 split in 3 (fp32 partials) and not split. A W4A16 weight or an x of the
    wrong width is refused by name."""
    e, n, k = 5, 40, 80
    ws = _weights(e, n, k, seed=50)
    bias = torch.randn(e, n, generator=torch.Generator().manual_seed(51)).bfloat16() * 0.1
    amax = [torch.tensor(2.0 + i) for i in range(e)]
    sw = G.stack_weights(ws, list(bias), amax, four_six)
    as_w4a16 = G.StackedWeight(sw.packed, sw.scale, sw.enc * sw.input_enc, sw.bias)  # one fp32 product, as the kernel
    x = _x(7, k, seed=52)
    for idx in (INDEX_5, torch.tensor([[3]])):
        r = G.route(idx, e)
        v = r.valid
        for gather, h in ((True, x[:idx.shape[0]]), (False, _x(r.pairs, k, seed=53))):
            rows = h[r.token.long()] if gather else h
            want = torch.zeros(r.pairs, k, dtype=h.dtype)
            for p in range(r.pairs):
                ex = int(idx.reshape(-1)[r.order[p]])
                if ex < e:
                    q = nvfp4.quantize(rows[p:p + 1], four_six, amax=amax[ex])
                    want[p] = (nvfp4.e2m1_decode(q.codes()).view(-1, 16) * q.block_scale.float()[0, :, None]).reshape(k)
            got = G.quantize_pairs(h, r, sw, gather, out=torch.full((r.pairs, k), float("nan"), dtype=h.dtype))
            assert torch.isnan(got[~v]).all()
            assert torch.equal(got[v].view(torch.int16), want[v].view(torch.int16)), (idx.shape, gather)
            if four_six in ("mae", "max"):
                continue
            for split in (1, 3):
                y = G.grouped_linear(h, r, sw, gather=gather, split=split, partials=True)
                ref = G.grouped_linear(want, r, as_w4a16, gather=False, split=split, partials=True)
                bits = torch.int16 if split == 1 else torch.int32
                assert torch.equal(y[..., v, :].view(bits), ref[..., v, :].view(bits)), (idx.shape, gather, split)
    with pytest.raises(nvfp4.NVFP4Error, match="W4A16"):
        G.quantize_pairs(x, r, G.stack_weights(ws))
    with pytest.raises(nvfp4.NVFP4Error, match="x must be"):
        G.quantize_pairs(x[:, :64], r, sw)


def _same_routing(a, b):
    from dataclasses import fields

    for f in fields(G.Routing):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (f.name, x, y)
        else:
            assert x == y, (f.name, x, y)


# (tokens, k, experts, block_m): a single token, odd E, E = 256 (DeepSeek-V3), k = 1 and 8, exactly one
# chunk (128 pairs), P past one chunk and not a multiple of it (129, 264, 300, 400), block_m 1, 4, 16, 32
# and the default
ROUTE_CASES = [(1, 1, 5, None), (1, 8, 256, None), (7, 2, 7, 2), (16, 8, 128, None), (300, 1, 5, None),
               (50, 8, 256, 32), (43, 3, 7, 16), (100, 4, 1, None), (9, 2, 2, 1), (33, 8, 256, 4)]


@interpreted
def test_route_kernels_equal_the_torch_route():
    """``route`` on the kernels (one launch up to 128 pairs, three past it) against ``route_reference``
    (torch ops), field by field and dtype by dtype, over random routings with slots routed outside [0, E)
    (>= E and negative), experts without a pair, int64 and int32 indices; and the torch route's
    ``position`` is ``order``'s inverse."""
    g = torch.Generator().manual_seed(20)
    for tokens, k, e, bm in ROUTE_CASES:
        idx = torch.randint(-2, e + 2, (tokens, k), generator=g)
        if e > 4:
            idx[idx == 3] = 4                   # expert 3 gets no pair
        ref = G.route_reference(idx, e, bm)
        assert torch.equal(ref.order[ref.position.long()], torch.arange(tokens * k))
        _same_routing(G.route(idx, e, bm), ref)
        _same_routing(G.route(idx.int(), e, bm), ref)
    _same_routing(G.route(INDEX_5, 5, block_m=2), G.route(INDEX_5, 5, block_m=2, backend="reference"))


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_combine_kernel_is_bit_identical_to_the_torch_tail(dtype):
    """The combine (one launch) against ``combine_reference``: bit for bit (products and slot-order sums in
    fp32, round to nearest even), rows of no expert NaN and never read; k = 1, 2, 8, N not a power of two."""
    g = torch.Generator().manual_seed(21)
    for tokens, k, e, n in ((1, 1, 5, 24), (7, 2, 5, 40), (5, 8, 7, 600)):
        idx = torch.randint(-1, e + 1, (tokens, k), generator=g)
        r = G.route(idx, e)
        y = (torch.randn(r.pairs, n, generator=g) * torch.rand(r.pairs, n, generator=g).pow(4) * 10).to(dtype)
        y[~r.valid] = float("nan")
        w = torch.rand(tokens, k, generator=g).to(dtype)
        got = G.combine(y, r, w)
        assert got.dtype == dtype and not torch.isnan(got).any()
        assert torch.equal(got.view(torch.int16), G.combine_reference(y, r, w).view(torch.int16))


@interpreted
def test_moe_end_to_end_equals_the_torch_glue():
    """``moe`` with the routing and combine kernels equals the same two grouped launches around the torch
    routing and tail, bit for bit (5 experts, two without a token, a masked slot; a single token)."""
    ws13, ws2 = _weights(5, 64, 32, seed=22), _weights(5, 32, 32, seed=23)
    w13, w2 = G.stack_weights(ws13), G.stack_weights(ws2)
    x = _x(7, 32, seed=24)
    w = torch.rand(7, 2, generator=torch.Generator().manual_seed(25)).bfloat16()

    def gate(a, b):
        return torch.nn.functional.silu(a) * b
    for idx, h, tw in ((INDEX_5, x, w), (INDEX_5[:1, :1], x[:1], w[:1, :1])):
        r = G.route_reference(idx, 5)
        act = gate(*G.grouped_linear(h, r, w13, backend="triton").split(32, dim=1))
        y = G.grouped_linear(act.to(h.dtype).contiguous(), r, w2, gather=False, backend="triton")
        assert torch.equal(G.moe(h, idx, tw, w13, w2, gate), G.combine_reference(y, r, tw, h.dtype))


def _qwen3_gating():
    """transformers' Qwen3-MoE experts module (default gating, SiLU act_fn), without weights to speak of."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    return Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=8, num_experts=1))


@pytest.mark.skipif(INTERPRETED, reason="no kernel: runs in the main process")
def test_linear_experts_fuse_only_the_default_silu_gating():
    """The grouped path fuses the gating ("silu") only for transformers' default ``act_fn(gate) * up``
    on concatenated halves with a SiLU act_fn (Qwen3-MoE, Mixtral); another act_fn, an overridden
    ``_apply_gate`` (gpt-oss' clamped SwiGLU; the stub) or interleaved halves keep the layer's own."""
    from transformers.activations import ACT2FN

    layer = _quantized_experts(2, 32, 16)
    assert layer.fused_gating() is None                                     # the stub's own _apply_gate
    gating = _qwen3_gating()
    qwen3 = LinearExperts(list(layer), gating, True, 2)
    assert qwen3.fused_gating() == "silu"
    assert LinearExperts(list(layer), gating, False, 2).fused_gating() is None
    gating.act_fn = ACT2FN["gelu"]
    assert qwen3.fused_gating() is None
    gating.act_fn = torch.nn.SiLU()
    assert qwen3.fused_gating() == "silu"


@interpreted
@pytest.mark.parametrize("scheme,four_six,gating", [("w4a16", None, "stub"), ("w4a4", "mse", "stub"),
                                                    ("w4a16", None, "qwen3")])
def test_linear_experts_grouped_forward_matches_the_loop(scheme, four_six, gating):
    """LinearExperts (3 experts, top-2, biases, one expert without a token) through the hook's grouped
    path against its own loop over NVFP4Linear experts; a single token too. The stub's gating goes
    through torch ops, Qwen3-MoE's default SiLU gating through the fused ``swiglu``."""
    layer = _quantized_experts(3, 32, 16, scheme, four_six, seed=10, bias=True)
    if gating == "qwen3":
        layer = LinearExperts(list(layer), _qwen3_gating(), True, 3)
        assert layer.fused_gating() == "silu"
    g = torch.Generator().manual_seed(11)
    hidden = _x(5, 32, seed=12)
    idx = torch.tensor([[0, 2], [2, 0], [0, 0], [2, 3], [2, 2]])  # 3: a masked slot
    weights = torch.rand(5, 2, generator=g).bfloat16()
    for h, i, w in ((hidden, idx, weights), (hidden[:1], idx[:1, :1], weights[:1, :1])):
        loop = layer(h, i, w)
        grouped = layer.grouped_forward(h, i, w)
        assert grouped is not None and grouped.dtype == loop.dtype
        assert _rel(grouped, loop) < TOLERANCE


@interpreted
@pytest.mark.parametrize("a4", [False, True])
def test_split_k_partials_are_within_tolerance_and_bit_identical_run_to_run(a4):
    """K split in 3 (K = 80: slices of 32, 32 and 16 columns) and not split: 5 experts (two without a
    token), a masked slot, biases, and a single token: the fp32 partials ``[S, P, N]`` summed in split
    order are within the dense kernels' tolerance of the reference (W4A16, and W4A4 on the 7 tokens), two
    runs give the same bits, the bias is in the first slice only, and the summed form leaves the rows of
    no expert as given."""
    e, n, k = 5, 40, 80
    ws = _weights(e, n, k, seed=30)
    bias = torch.randn(e, n, generator=torch.Generator().manual_seed(31)).bfloat16() * 0.1
    sw = G.stack_weights(ws, list(bias), [torch.tensor(2.0 + i) for i in range(e)] if a4 else None)
    x = _x(7, k, seed=32)
    for idx in (INDEX_5,) if a4 else (INDEX_5, torch.tensor([[3]])):
        r = G.route(idx, e)
        ref = G.grouped_linear_reference(x[:idx.shape[0]], r, sw)
        v = r.valid
        for split in (1, 3):
            runs = [G.grouped_linear(x[:idx.shape[0]], r, sw, split=split, partials=True) for _ in range(2)]
            assert runs[0].shape == ((3, r.pairs, n) if split == 3 else (r.pairs, n))
            assert torch.equal(runs[0][..., v, :], runs[1][..., v, :])
            assert _rel(G.sum_partials(runs[0])[v], ref[v]) < TOLERANCE
        no_bias = G.stack_weights(ws, None, sw.input_amax, sw.four_six)
        parts = G.grouped_linear(x[:idx.shape[0]], r, no_bias, split=3, partials=True)
        assert torch.equal(runs[0][1:, v], parts[1:, v])                      # bias: first slice only
        out = torch.full((r.pairs, n), float("nan"), dtype=x.dtype)
        y = G.grouped_linear(x[:idx.shape[0]], r, sw, split=3, out=out)
        assert y is out and torch.isnan(y[~v]).all()
        assert torch.equal(y[v], G.sum_partials(runs[0])[v].to(x.dtype))


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_kernel_equals_the_torch_gating(dtype):
    """The fused gating (one launch) from w13's output [P, 2I] and from fp32 partials [3, P, 2I]: within
    two output ulps of ``swiglu_reference`` (fp32 silu * u rounded once) and within the dense kernels'
    tolerance of torch's ``silu(g) * u`` on 16-bit g and u; rows of no expert not written; large |g| (exp
    overflow) gives silu's limits."""
    g = torch.Generator().manual_seed(33)
    idx = torch.tensor([[0, 2], [2, 5], [4, 0]])                  # a masked slot: sorted last, not valid
    r = G.route(idx, 5)
    inter = 24
    parts = torch.randn(3, r.pairs, 2 * inter, generator=g) * 2
    parts[0, 0, :4] = torch.tensor([-200.0, 200.0, -30.0, 0.0])
    for gate_up in (parts.sum(0).to(dtype), parts):
        act = G.swiglu(gate_up, r, dtype)
        ref = G.swiglu_reference(gate_up, r, dtype)
        v = r.valid
        assert act.dtype == dtype and torch.isfinite(act[v]).all()
        ulp = torch.finfo(dtype).eps
        assert ((act[v].float() - ref[v].float()).abs() <= ref[v].float().abs() * 2 * ulp + 1e-6).all()
        gu = G.sum_partials(gate_up).to(dtype)
        torch_form = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        assert _rel(act[v], torch_form[v]) < TOLERANCE
    assert act[0, 0] == 0 and act[0, 2].float().abs() < 1e-9


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_combine_sums_fp32_partials_bit_identically(dtype):
    """The combine reading a split launch's fp32 partials [S, P, N] (S = 3; k = 1, 2, 8) adds them in
    split order before the weighted sum: bit for bit ``combine_reference``; rows of no expert not read."""
    g = torch.Generator().manual_seed(34)
    for tokens, k, e, n in ((1, 1, 5, 24), (7, 2, 5, 40), (5, 8, 7, 600)):
        idx = torch.randint(-1, e + 1, (tokens, k), generator=g)
        r = G.route(idx, e)
        y = torch.randn(3, r.pairs, n, generator=g) * torch.rand(3, r.pairs, n, generator=g).pow(4) * 10
        y[:, ~r.valid] = float("nan")
        w = torch.rand(tokens, k, generator=g).to(dtype)
        got = G.combine(y, r, w, dtype)
        assert got.dtype == dtype and not torch.isnan(got).any()
        assert torch.equal(got.view(torch.int16), G.combine_reference(y, r, w, dtype).view(torch.int16))


@interpreted
def test_moe_fused_silu_with_split_k_matches_the_reference():
    """``moe`` with gate="silu" (the single token splits K in 2 on both launches, on the interpreter's
    2-"SM" grid; 4 tokens do not): bit-identical from run to run; against the reference
    layer no further off than the torch-gated layer is from its own (+10%), and within twice the dense
    kernels' tolerance (a whole layer: here the interpreter's casts truncate both launches' bf16
    outputs, 1.1e-2 for either gating); an unknown gating is refused."""
    ws13, ws2 = _weights(3, 96, 96, seed=35), _weights(3, 96, 48, seed=36)
    w13, w2 = G.stack_weights(ws13), G.stack_weights(ws2)
    x = _x(4, 96, seed=37)
    tw = torch.rand(4, 2, generator=torch.Generator().manual_seed(38)).bfloat16()
    idx = torch.tensor([[0, 2], [2, 0], [0, 0], [2, 3]])

    def silu_gate(a, b):
        return torch.nn.functional.silu(a) * b
    for i, h, w in ((idx, x, tw), (idx[:1, :1], x[:1], tw[:1, :1])):
        r = G.route(i, 3)
        single = r.pairs == 1
        assert G.split_for(16, 96, 96, min(3, r.pairs), G.kernel_config(16, 96, 96), 2)[1] == (2 if single else 1)
        assert G.split_for(16, 96, 48, min(3, r.pairs), G.kernel_config(16, 96, 48), 2)[1] == (2 if single else 1)
        fused = [G.moe(h, i, w, w13, w2, "silu") for _ in range(2)]
        assert torch.equal(fused[0], fused[1])
        err = _rel(fused[0], G.moe(h, i, w, w13, w2, "silu", backend="reference"))
        torch_gated = _rel(G.moe(h, i, w, w13, w2, silu_gate), G.moe(h, i, w, w13, w2, silu_gate, backend="reference"))
        assert err < 2 * TOLERANCE and err <= 1.1 * torch_gated, (err, torch_gated)
    with pytest.raises(nvfp4.NVFP4Error, match="gate must be one of"):
        G.moe(x, idx, tw, w13, w2, "gelu")


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_experts_is_nvfp4_dequantize_bit_for_bit(dtype):
    """The prefill path's stacked dequantize (one launch): every expert with a pair equals
    ``nvfp4.dequantize`` to the activation dtype bit for bit (K = 80: a partial block tile), experts
    without one are left as given; the path (dequantize + torch._grouped_mm, bias, a single token) is
    within the dense kernels' tolerance of the reference and leaves the rows of no expert as given."""
    from fp4ptq.kernels import grouped_dequant as D

    e, n, k = 5, 40, 80
    ws = _weights(e, n, k, seed=39)
    bias = torch.randn(e, n, generator=torch.Generator().manual_seed(40)).to(dtype) * 0.1
    sw = G.stack_weights(ws, list(bias))
    r = G.route(INDEX_5, e)
    out = torch.full((e, n, k), float("nan"), dtype=dtype)
    got = D.dequantize_experts(sw, r.offsets, dtype, out=out)
    for i in range(e):
        if i in (1, 3):
            assert torch.isnan(got[i]).all(), i
        else:
            assert torch.equal(got[i].view(torch.int16), ws[i].dequantize(dtype).view(torch.int16)), i
    x = _x(7, k, seed=41, dtype=dtype)
    for idx in (INDEX_5, torch.tensor([[4]])):
        r = G.route(idx, e)
        h = x[:idx.shape[0]]
        out = torch.full((r.pairs, n), float("nan"), dtype=dtype)
        y = G.grouped_linear(h, r, sw, path="dequant", out=out)
        v = r.valid
        assert torch.isnan(y[~v]).all() and _rel(y[v], G.grouped_linear_reference(h, r, sw)[v]) < TOLERANCE
        sorted_rows = G.grouped_linear(h[r.token.long()], r, sw, gather=False, path="dequant")
        assert torch.equal(sorted_rows[v], y[v])


@pytest.mark.skipif(INTERPRETED, reason="no kernel: runs in the main process")
def test_split_and_prefill_rules_on_the_h200_layers(monkeypatch):
    """The decode split rule (132 SMs) and the prefill rule on the benchmark's layers: at 1 token
    Qwen3-30B-A3B's w13 and Mixtral's w2 (grids short of one wave) take the narrow tile split in 2 and 3;
    Qwen3's w2 (no room for 2 narrow slices), Mixtral's w13, both layers at 16 tokens and the prefill
    tiles keep their tile unsplit; the dequantize + grouped GEMM path only for W4A16 bf16 128-row tiles
    on a CUDA device of compute capability >= 9.0 with torch._grouped_mm."""
    from types import SimpleNamespace

    from fp4ptq.kernels import grouped_dequant as D

    monkeypatch.setattr(G, "INTERPRET", False)

    def plan(tokens, k, experts, n, kk):
        pairs = tokens * k
        bm = G.block_m_for(pairs, experts)
        tile, s = G.split_for(bm, n, kk, min(experts, pairs), G.kernel_config(bm, n, kk, G.tile_bound(pairs, experts, bm)),
                              132)
        return (tile,) + G.k_slices(kk, tile[1], s)
    narrow, small, mid, deep = G.DECODE_NARROW, G.DECODE_SMALL_GRID, G.DECODE_MID_GRID, G.DECODE_TILE
    assert plan(1, 8, 128, 1536, 2048) == (narrow, 2, 1024) and plan(1, 8, 128, 2048, 768) == (mid, 1, 768)
    assert plan(1, 2, 8, 28672, 4096) == (deep, 1, 4096) and plan(1, 2, 8, 4096, 14336) == (narrow, 3, 4864)
    assert plan(16, 8, 128, 1536, 2048) == (deep, 1, 2048) and plan(16, 2, 8, 4096, 14336) == (deep, 1, 14336)
    assert plan(4096, 8, 128, 2048, 768) == (G.PREFILL_TILE, 1, 768)
    assert G.split_for(16, 4096, 14336, 2, small, 132, narrow=False) == (small, 2)   # its own tile: one wave
    assert G.resident((32, 64, 4, 4)) == 7 and G.resident((128, 64, 4, 3)) == 4
    assert G.k_slices(80, 32, 8) == (3, 32) and G.k_slices(10 * 16, 16, 4) == (4, 48)

    monkeypatch.setattr(D, "_capability", lambda device: (9, 0))
    x = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device=torch.device("cuda", 0))
    w4a16, w4a4 = SimpleNamespace(input_enc=None), SimpleNamespace(input_enc=torch.ones(1))
    assert [G.block_m_for(t * k, e) for t, k, e in ((256, 8, 128), (256, 2, 8), (4096, 8, 128), (4096, 2, 8))] == \
        [16, 64, 128, 128]
    assert D.takes_dequant(x, SimpleNamespace(block_m=128), w4a16)
    assert not D.takes_dequant(x, SimpleNamespace(block_m=64), w4a16)
    assert not D.takes_dequant(x, SimpleNamespace(block_m=128), w4a4)
    assert not D.takes_dequant(SimpleNamespace(**dict(vars(x), dtype=torch.float16)), SimpleNamespace(block_m=128), w4a16)
    assert not D.takes_dequant(SimpleNamespace(**dict(vars(x), is_cuda=False)), SimpleNamespace(block_m=128), w4a16)
    monkeypatch.setattr(D, "_capability", lambda device: (8, 0))
    assert not D.takes_dequant(x, SimpleNamespace(block_m=128), w4a16)
    monkeypatch.setattr(D, "_capability", lambda device: (9, 0))
    monkeypatch.delattr(torch, "_grouped_mm")
    assert not D.takes_dequant(x, SimpleNamespace(block_m=128), w4a16)


@pytest.mark.skipif(INTERPRETED, reason="no kernel: runs in the main process")
def test_moe_benchmark_parses_and_reports_fake_timings(tmp_path, capsys):
    """benchmarks/bench_moe_h200.py without a GPU: its argument checks, and the markdown table, the goal
    verdicts and the figure it writes from a results file (fake timings); its bf16 peer (torch's grouped
    GEMM or the loop of matmuls, around the same sort and fused gating) equals the fp32 layer on the CPU; the
    table names the W4A16 launches' paths (K split, dequantize)."""
    import json
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import bench_moe_h200 as B
    finally:
        sys.path.remove(str(bench))
    args = B.parse(["--layers", "mixtral", "--tokens", "1,4096"])
    assert args.layers == ["mixtral"] and args.tokens == [1, 4096] and args.rounds == 3
    for bad in (["--layers", "llama"], ["--tokens", "1,x"], ["--tokens", "0"], ["--rounds", "0"], ["--splits", "2,0"]):
        with pytest.raises(SystemExit) as exc:
            B.parse(bad)
        assert exc.value.code == 2
    rows = []
    for layer, (e, k, h, f) in B.LAYERS.items():
        for tokens, speed in ((1, 3.0), (16, 2.4), (4096, 0.95)):
            row = {"layer": layer, "experts": e, "top_k": k, "hidden": h, "ffn": f, "tokens": tokens,
                   "active_experts": min(e, tokens * k), "bf16_impl": "grouped_mm", "bf16_us": 100.0}
            for s in B.SCHEMES:
                row.update({f"{s}_us": 100.0 / speed, f"{s}_x_bf16": speed, f"{s}_rel_err": 2e-3})
            rows.append(row)
    rows[0].update(route_us=7.5, route_torch_us=62.5, combine_us=4.0, combine_torch_us="RuntimeError('y')",
                   route_equal=True, combine_equal=True, w4a16_w13_path="kernel S=2", w4a16_w2_path="kernel S=3")
    rows[-1]["w4a4_46_us"] = "RuntimeError('x')"
    del rows[-1]["w4a4_46_x_bf16"]
    path = tmp_path / "moe_h200.json"
    path.write_text(json.dumps({"env": {"gpu": "fake"}, "rounds": 3, "rows": rows}))
    assert B.main(["--report", str(path)]) == 0
    md = (tmp_path / "moe_h200.md").read_text()
    assert "| Mixtral-8x7B | 4096 | 8/8 | 100.0 | grouped_mm | 105.3 | 0.95x |" in md
    assert "| failed | - |" in md and "| kernel S=2 / kernel S=3 |" in md
    assert "| Qwen3-30B-A3B | 1 | 7.5 | 62.5 | 4.0 | failed | True / True |" in md and md.count("| 16 | 7.5 |") == 0
    assert "| Qwen3-30B-A3B: decode (<= 16 tokens) >= 2.5x bf16 | 2.40x (worst) | not met |" in md
    assert "| Mixtral-8x7B: 4096 tokens >= 0.9x bf16 | 0.95x | met |" in md
    assert (tmp_path / "moe_h200.png").read_bytes()[:4] == b"\x89PNG"
    assert md in capsys.readouterr().out
    (tmp_path / "other.json").write_text(json.dumps({"table": []}))
    with pytest.raises(SystemExit, match="other.json is not a bench_moe_h200.py results file"):
        B.main(["--report", str(tmp_path / "other.json")])
    with pytest.raises(SystemExit, match="cannot read"):
        B.main(["--report", str(tmp_path / "missing.json")])

    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(6, 32, 32, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(6, 32, 16, generator=g) * 0.1).bfloat16()
    index, weights = B._routing(5, 6, 2, "cpu", g)
    x = torch.randn(5, 32, generator=g).bfloat16()

    def gate(a, b):
        return torch.nn.functional.silu(a) * b
    impl, make = B._bf16_layer(w13, w2)
    exact = B._fp32_layer(x, index, weights, w13, w2, gate)
    for name in {impl, "loop"}:
        assert _rel(make(x, index, weights, name)(), exact) < 1e-2
