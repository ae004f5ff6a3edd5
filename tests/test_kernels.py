"""Triton NVFP4 kernels vs the nvfp4.py reference, on CPU under TRITON_INTERPRET=1.

Triton decides at import whether its own library functions (``tl.max``,
``tl.sum``, ...) are interpreted, so the kernel tests run in a fresh Python
process started with ``TRITON_INTERPRET=1`` (by
``test_kernels_under_triton_interpreter``); the rest of the suite never sees
the variable. Run them directly with ``TRITON_INTERPRET=1 pytest tests/test_kernels.py``.
Shapes are small and odd on purpose: partial tiles in M, N and K. Outputs are
poisoned with NaN before each run and must come back finite.
"""
from __future__ import annotations

import importlib
import importlib.util
import itertools
import os
import subprocess
import sys

import pytest
import torch

from fp4ptq import kernels, nvfp4
from fp4ptq.kernels import BackendUnavailable
from fp4ptq.kernels import _common as cm, dispatch as dp, gemv as gv  # noqa: E402

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_qk = None  # quantize16, for Triton helpers defined inside tests (set there)
_gm = None  # gemm, the same
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess of test_kernels_under_triton_interpreter"
)


@pytest.mark.skipif(INTERPRETED, reason="this is the driver of the interpreted run")
def test_kernels_under_triton_interpreter():
    """The interpreted run, spread over the machine's cores by pytest-xdist where it is installed (the
    interpreter is single-threaded Python: 2 workers on 2 cores take about half the time)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", __file__]
    workers = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(workers)]
        env.setdefault("OMP_NUM_THREADS", "1")  # one torch thread a worker: the workers are the parallelism
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]


@pytest.fixture(scope="module")
def tk():
    """(quantize_kernel, gemm), built under the Triton interpreter."""
    qk = importlib.import_module("fp4ptq.kernels.quantize_kernel")
    gm = importlib.import_module("fp4ptq.kernels.gemm")
    assert cm.INTERPRET
    return qk, gm


@pytest.fixture
def fp32_kernel(tk, monkeypatch):
    """The fp32-compare quantize kernel for every dtype (the 16-bit one has its own tests below): it
    takes bf16 / fp16 where the 16-bit kernel's PTX does not run (before sm_90 for bf16)."""
    qk, _ = tk
    monkeypatch.setattr(qk, "quant16_supported", lambda device, dtype: False)
    return tk


def _activations(m, k, dtype, seed):
    """Heavy-tailed data with an all-zero block, a -0.0, a tiny (zero-scale) block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g).pow(4) * 3
    x[0, :16] = 0.0
    x[-1, 3] = -0.0
    if k >= 32:
        x[-1, 16:32] *= 1e-7
    return x.to(dtype)


def _same_quantized(q, r):
    assert torch.equal(q.global_enc, r.global_enc)
    assert torch.equal(q.block_scale.view(torch.uint8), r.block_scale.view(torch.uint8))
    assert torch.equal(q.packed, r.packed)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("four_six", [None, "max"])
@pytest.mark.parametrize("shape", [(5, 48), (3, 560)])
def test_quantize_kernel_bit_identical(fp32_kernel, dtype, four_six, shape):
    qk, _ = fp32_kernel
    x = _activations(*shape, dtype, seed=shape[1])
    q, r = qk.quantize(x, four_six), nvfp4.quantize(x, four_six)
    _same_quantized(q, r)
    if four_six is not None:
        assert torch.equal(q.chose_four, r.chose_four)


@interpreted
@pytest.mark.parametrize("rule", ["mse", "mae"])
def test_quantize_kernel_four_six_sums_only_flip_near_ties(fp32_kernel, rule):
    """Summed 4/6 errors may round differently from torch.sum; a flipped
    choice is allowed only where the two block errors are within 1e-5."""
    qk, _ = fp32_kernel
    x = _activations(64, 256, torch.bfloat16, seed=1)
    _assert_flips_only_at_near_ties(x, qk.quantize(x, rule), nvfp4.quantize(x, rule), rule)


def _assert_flips_only_at_near_ties(x, q, r, rule):
    """q's 4/6 choices equal r's except at blocks whose two candidate errors are within 1e-5
    (relative); everything else (codes, scales) equal."""
    flipped = q.chose_four != r.chose_four
    assert flipped.float().mean() < 0.01
    blocks = x.float().reshape(-1, 16)[flipped.reshape(-1)]
    enc = r.global_enc
    bmax = blocks.abs().amax(-1)
    errs = []
    for target in (6.0, 4.0):
        step = (nvfp4.block_scale(bmax, enc, target) / enc).unsqueeze(-1)
        x_hat = nvfp4.e2m1_rne(blocks / step) * step
        errs.append(nvfp4._block_error(x_hat, blocks, rule))
    assert torch.all((errs[0] - errs[1]).abs() <= 1e-5 * errs[0].abs().clamp(min=1e-30))
    same = ~flipped.unsqueeze(-1).expand(*flipped.shape, 16).reshape(x.shape)
    assert torch.equal(q.codes()[same], r.codes()[same])
    assert torch.equal(q.block_scale.view(torch.uint8)[~flipped], r.block_scale.view(torch.uint8)[~flipped])


@interpreted
def test_quantize_kernel_static_amax_saturates_like_reference(fp32_kernel):
    qk, _ = fp32_kernel
    x = _activations(9, 64, torch.bfloat16, seed=3)
    for amax in (0.05, 1.0, 1e4):
        for rule in (None, "mse"):
            q, r = qk.quantize(x, rule, amax=amax), nvfp4.quantize(x, rule, amax=amax)
            _same_quantized(q, r)


@interpreted
def test_quantize_scaled_is_code_times_scale(fp32_kernel):
    qk, _ = fp32_kernel
    x = _activations(7, 96, torch.bfloat16, seed=4)
    amax = torch.tensor(2.5)
    for rule in (None, "mae"):
        scaled, enc = qk.quantize_scaled(x, amax, rule)
        r = nvfp4.quantize(x, rule, amax=amax)
        expect = nvfp4.e2m1_decode(r.codes()) * r.block_scale.float().repeat_interleave(16, -1)
        assert torch.equal(enc, r.global_enc)
        assert torch.equal(scaled.float(), expect)


@pytest.fixture(params=[True, False], ids=["table", "per_block"])
def quant16(tk, monkeypatch, request):
    """The 16-bit quantize kernel on every size, with small tiles and 3 persistent programs, so
    that a program loops over many tiles (partial ones in M and K among them); thresholds from
    the per-program table or computed per block."""
    qk, _ = tk
    monkeypatch.setattr(qk, "QUANT16_MIN_ROWS", 0)
    monkeypatch.setattr(qk, "_use_table", lambda n_tiles, emit, four_six: request.param)
    monkeypatch.setattr(qk, "_tile16", lambda m, k: (8, 4, 4))
    monkeypatch.setattr(qk, "_programs", lambda device, n_tiles, *rule: min(n_tiles, 3))
    return qk


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("four_six,amax", [(None, None), (None, 1e4), ("mse", 0.05), ("mae", None), ("max", 1e4)])
def test_quantize16_kernel_bit_identical(quant16, dtype, four_six, amax):
    """Codes, scales, the global scale and the 4/6 choice equal the reference (a flipped 4/6
    choice only at a near-tie, as for the fp32 kernel); the scaled output is code x scale."""
    qk = quant16
    x = _activations(37, 96, dtype, seed=7)
    q, r = qk.quantize(x, four_six, amax=amax), nvfp4.quantize(x, four_six, amax=amax)
    if four_six in ("mse", "mae"):  # summed errors: another summation order may flip a near-tie
        assert torch.equal(q.global_enc, r.global_enc)
        _assert_flips_only_at_near_ties(x, q, r, four_six)
    else:  # no sum, no rounding of its own: exactly the reference
        _same_quantized(q, r)
        assert four_six is None or torch.equal(q.chose_four, r.chose_four)
    a = torch.tensor(2.0 if amax is None else amax)
    scaled, enc = qk.quantize_scaled(x, a, four_six)
    rs = nvfp4.quantize(x, four_six, amax=a)
    expect = nvfp4.e2m1_decode(rs.codes()) * rs.block_scale.float().repeat_interleave(16, -1)
    ok = (scaled.float() == expect).reshape(37, 6, 16).all(-1)
    assert torch.equal(enc, rs.global_enc)
    assert ok.all() if four_six in (None, "max") else ok.float().mean() > 0.99


def _four_six_exact_blocks(dtype, seed):
    """Rows of 16-element blocks under the global scale 1 (amax 1536) whose two Four Over Six errors are
    exact in fp32 under every rule: E4M3 block maxima (normal and subnormal scales, and maxima whose
    scale-to-6 or scale-to-4 product is an E4M3 rounding midpoint) over elements on a grid of 1/32 of the
    6-scale, so that the reference's and the kernel's sums agree exactly: many blocks are exact ties
    (both errors equal: the 6-scale must be kept) or differ by the grid's least unit. Also an all-zero
    block, single non-zero elements, elements on the E2M1 midpoints of both candidates."""
    g = torch.Generator().manual_seed(seed)
    e4m3 = torch.arange(1, 127, dtype=torch.int64).to(torch.uint8).view(torch.float8_e4m3fn).float()
    even = e4m3[(torch.arange(1, 127) % 8 % 2 == 0) & (torch.arange(1, 127) % 8 < 6)]  # 1.5 x exact in E4M3
    s6 = torch.cat([even[even <= 64.0][::3], e4m3[e4m3 <= 64.0][1::9], torch.tensor([2.0 ** -9, 1.0625])])
    rows = []
    for s in s6.tolist():
        k = torch.randint(0, 193, (4, 16), generator=g)  # a / (s / 32), up to 6 s
        k[0, 5:] = torch.tensor([8, 24, 40, 56, 80, 112, 160, 12, 36, 60, 84])  # E2M1 midpoints of both grids
        k[1] = torch.where(torch.rand(16, generator=g) < 0.5, k[1] // 32 * 32, k[1])  # half on the 6-grid
        # on both grids (0, 1.5, 3, 6 s) but for pairs of elements as far from the other grid as each other
        # (1 s and 0.75 s, 2 s and 2.25 s, 4 s and 4.5 s, 0.5 s and 0.75 s): a tie where the 4-scale is 1.5 s;
        # the last row the same with one element a grid unit off: the least difference
        k[2] = torch.tensor([0, 48, 96, 192])[torch.randint(0, 4, (16,), generator=g)]
        k[2, 1:9] = torch.tensor([32, 24, 64, 72, 128, 144, 16, 24])
        k[3] = k[2]
        k[3, 1 + int(torch.randint(0, 8, (1,), generator=g))] += 1
        block = k.float() * (s / 32.0)
        block[:, 0] = 6.0 * s
        block *= torch.where(torch.rand(4, 16, generator=g) < 0.5, -1.0, 1.0)
        rows.append(block.reshape(-1))
    x = torch.stack(rows)  # [n, 64]: a row of four blocks per scale
    x[0, :16] = 0.0  # all zeros
    x[1, :16] = 0.0
    x[1, 7] = -6.0  # a single non-zero (scale 1 and 1.5: both exact, a tie)
    x[2, :16] = 0.0
    x[2, 3] = 4.25  # a single non-zero whose scale-to-4 product 1.0625 is an E4M3 midpoint
    x[3, 16:32] = torch.linspace(0.0, 6.375, 16).div(1 / 32).round().mul(1 / 32)  # 6.375 / 6 = 1.0625, a midpoint
    return x.to(dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize16_four_six_exact_ties_and_least_differences(quant16, dtype):
    """Blocks whose candidate errors are exact (``_four_six_exact_blocks``): the kernel's 4/6 choice,
    codes and scales equal the reference's bit for bit under every rule, exact ties keeping the 6-scale."""
    qk = quant16
    x = _four_six_exact_blocks(dtype, seed=11)
    assert torch.equal(x.float(), x.float().to(dtype).float())
    for rule in ("mse", "mae", "max"):
        q, r = qk.quantize(x, rule, amax=1536.0), nvfp4.quantize(x, rule, amax=1536.0)
        assert float(r.global_enc) == 1.0
        _same_quantized(q, r)
        assert torch.equal(q.chose_four, r.chose_four), rule
        ties = _tie_blocks(x, r, rule)
        assert ties.any() and not r.chose_four.reshape(-1)[ties].any()


def _tie_blocks(x, r, rule):
    """Blocks whose two candidate errors are exactly equal in the reference's arithmetic."""
    blocks = x.float().reshape(-1, 16)
    bmax = blocks.abs().amax(-1)
    errs = []
    for target in (6.0, 4.0):
        step = (nvfp4.block_scale(bmax, r.global_enc, target) / r.global_enc).unsqueeze(-1)
        errs.append(nvfp4._block_error(nvfp4.e2m1_rne(blocks / step) * step, blocks, rule))
    return errs[0] == errs[1]


@interpreted
@pytest.mark.parametrize("four_six", [None, "max"])
def test_quantize16_kernel_tiny_values(quant16, four_six):
    """bf16 values near 1e-36 with their own amax: the global scale passes 2^112 and the block
    thresholds go subnormal, where the per-block kernel leaves its fast fp64 rounding for the
    table's arithmetic; codes and scales still equal the reference."""
    qk = quant16
    x = (_activations(5, 64, torch.float32, seed=3) * 1e-36).bfloat16()
    q, r = qk.quantize(x, four_six), nvfp4.quantize(x, four_six)
    assert float(r.global_enc) > 2.0 ** 112
    _same_quantized(q, r)


@interpreted
@pytest.mark.parametrize("f16", [False, True])
def test_fast_thresholds_equal_the_table_arithmetic(tk, f16):
    """The per-block fast path (exact fp64 products read off as 16-bit patterns) gives the table's
    thresholds (fp32 directed rounding, then rounded up to the 16-bit format) for every scale code and
    the zero scale, under global scales across the whole range it is used for: bf16 up to 2^112, fp16
    everywhere a global scale can be (its subnormal and overflowing thresholds included)."""
    import triton
    import triton.language as tl

    global _qk
    _qk = importlib.import_module("fp4ptq.kernels.quantize16")  # (the jitted helper below resolves names
    # in this module's globals)

    @triton.jit
    def both(enc_ptr, fast_ptr, slow_ptr, F16: tl.constexpr):
        code = tl.arange(0, 128)
        scale = tl.where(code < 127, _qk._e4m3_value(code), 0.0)
        enc = tl.load(enc_ptr)
        f0, f1, f2, f3, f4, f5, f6 = _qk._row(enc_ptr, code, scale, enc, F16, False, True, False)
        s0, s1, s2, s3, s4, s5, s6 = _qk._row(enc_ptr, code, scale, enc, F16, False, False, False)
        for j, f, g in ((0, f0, s0), (1, f1, s1), (2, f2, s2), (3, f3, s3), (4, f4, s4), (5, f5, s5), (6, f6, s6)):
            tl.store(fast_ptr + j * 128 + code, f)
            tl.store(slow_ptr + j * 128 + code, g)

    g = torch.Generator().manual_seed(0)
    top = 127 if f16 else 112
    # global scales reach down to 1536 / (the largest fp32), where every step is still finite
    encs = [2.0 ** e for e in range(-116, top, 7)] + [2688.0, 1536.0, 0.3, 1.0 / 3.0, 1536.0 / 3.4028234663852886e38,
                                                      5.19e33 if not f16 else 3.4028234663852886e38]
    encs += (torch.rand(20, generator=g, dtype=torch.float64) * 200 - 100).exp2().tolist()
    for enc in encs:
        fast, slow = torch.zeros(7 * 128, dtype=torch.int32), torch.zeros(7 * 128, dtype=torch.int32)
        both[(1,)](torch.tensor([enc], dtype=torch.float32), fast, slow, F16=f16)
        assert torch.equal(fast, slow), enc


@interpreted
def test_quantize16_kernel_empty_input(quant16):
    """No rows: nothing launched, the global scale still follows the amax."""
    qk = quant16
    x = torch.zeros(0, 32, dtype=torch.bfloat16)
    packed, scale, enc, _ = qk.launch_quantize(x, torch.tensor(2.0))
    assert packed.shape == (0, 16) and scale.shape == (0, 2)
    assert torch.equal(enc, nvfp4.global_encode_scale(torch.tensor(2.0)))


@interpreted
def test_quantize16_kernel_reads_strided_rows(quant16):
    """A row stride other than K (even: the int32 view strides by it; odd: copied first)."""
    qk = quant16
    for width in (128, 113):
        big = _activations(9, width, torch.bfloat16, seed=width)
        x = big[:, 16:112]
        q, r = qk.quantize(x, None), nvfp4.quantize(x.contiguous(), None)
        _same_quantized(q, r)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_kernel_decodes_all_codes_exactly(tk, dtype):
    """Every code (0x0..0xF, incl. -0 and the 0.5 that lands on an fp16
    subnormal) under normal and subnormal E4M3 scales."""
    _, gm = tk
    codes = torch.arange(16, dtype=torch.uint8).repeat(6, 3)  # [6, 48]
    scales = torch.tensor([448.0, 1.0, 0.015625, 0.001953125, 0.005859375, 3.0]).unsqueeze(1).expand(6, 3)
    w = nvfp4.NVFP4Tensor(nvfp4.pack_codes(codes), scales.to(torch.float8_e4m3fn).contiguous(),
                          torch.tensor(7.5), torch.Size((6, 48)), dtype)
    assert torch.equal(gm.dequantize(w, dtype), w.dequantize(dtype))


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return nvfp4.quantize(torch.randn(n, k, generator=g) * 0.05)


def _rel(y, ref):
    assert torch.isfinite(y).all(), "output has unwritten (NaN) or non-finite elements"
    return float((y.float() - ref).norm() / ref.norm())


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path,shapes", [
    ("gemv4", [(1, 40, 80), (2, 33, 48), (1, 17, 1040)]),
    ("gemm", [(3, 70, 272), (17, 65, 144), (70, 130, 96)]),
    ("cublas", [(5, 33, 64)]),
])
def test_w4a16_matches_dequantized_matmul(tk, dtype, path, shapes):
    _, gm = tk
    for m, n, k in shapes:
        wq = _weight(n, k, seed=n)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        bias = torch.randn(n).to(dtype)
        ref = x.float() @ wq.dequantize(torch.float32).T + bias.float()
        out = torch.full((m, n), float("nan"), dtype=dtype)
        y = gm.linear_w4a16(x, wq, bias, path=path, out=out)
        assert y.data_ptr() == out.data_ptr()
        assert _rel(y, ref) < 1e-2, (path, m, n, k)


@interpreted
@pytest.mark.parametrize("m,n,k", [(1, 40, 80), (2, 33, 48), (1, 17, 1040), (1, 40, 768), (2, 37, 1792)])
def test_gemv6_matches_dequantized_matmul(tk, monkeypatch, m, n, k):
    """Resident-x GEMV, one segment (K masked to a power of two: 1040, 1792 = 112 of
    128 blocks) and split K (768 = 3 x 256 through the fp32 workspace), with a bias and
    x not 8-byte aligned (a view one element in: copied first); loading each row
    tile one step ahead (PREFETCH) gives the same bits; bf16 and fp16 activations (fp16x2 sums, within
    the tighter fp16 tolerance)."""
    _, gm = tk
    wq = _weight(n, k, seed=n)
    big = torch.randn(m, k + 1, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n)
    rule = gv._gemv6_config
    for x in (big[:, :k].contiguous().bfloat16(), big.bfloat16()[:, 1:], big.half()[:, 1:]):
        _gemv_with_and_without_prefetch(gm, monkeypatch, x, wq, bias, "_gemv6_config",
                                        lambda p: lambda m_, n_, k_: rule(m_, n_, k_)[:4] + (p,))
    monkeypatch.setattr(gv, "_gemv6_config", rule)
    assert gv._gemv6_config(m, n, k)[3] == (256 if k == 768 else k)


@interpreted
@pytest.mark.parametrize("lead,n,k,with_bias,gemv7,dtype", [
    ((1,), 24, 1024, False, False, torch.bfloat16),    # one segment
    ((2,), 24, 768, True, False, torch.bfloat16),      # split K (3 x 256): the workspace and the summing launch
    ((1, 1), 16, 768, False, False, torch.bfloat16),   # a 3-D input, split without a bias
    ((2,), 12, 1040, True, True, torch.bfloat16),      # the streamed-x GEMV
    ((1,), 24, 1024, True, False, torch.float16),   # fp16: one segment, a bias
    ((2,), 12, 1040, False, True, torch.float16),   # fp16 through the streamed-x GEMV
])
def test_launch_plan_gives_the_dispatch_bits(tk, monkeypatch, lead, n, k, with_bias, gemv7, dtype):
    """``linear_plan``: the dispatch's launches decided once for inputs shaped alike, called again and
    again with other inputs of that shape, gives ``linear_w4a16``'s bits every time; an input whose
    address the GEMV's 8-byte loads cannot use is refused (None: the dispatch copies it)."""
    _, gm = tk
    monkeypatch.setattr(gv, "GEMV7", "1" if gemv7 else "0")
    wq = _weight(n, k, seed=n)
    bias = torch.randn(n).to(dtype) if with_bias else None
    g = torch.Generator().manual_seed(k)
    xs = [torch.randn(*lead, k, generator=g).to(dtype) for _ in range(4)]
    plan = gm.linear_plan(xs[0], wq, bias)
    assert plan is not None
    for x in xs + xs[:1]:
        y = plan(x)
        assert y.shape == (*lead, n) and y.dtype == dtype
        assert torch.equal(y, gm.linear_w4a16(x, wq, bias))
    buf = torch.randn(xs[0].numel() + 1, generator=g).to(dtype)
    assert plan(buf[1:].view(xs[0].shape)) is None
    assert kernels.linear_plan(xs[0], wq, bias) is None  # "auto" on a CPU tensor: the reference backend
    assert kernels.linear_plan(xs[0], wq, bias, backend="triton") is not None
    with pytest.raises(BackendUnavailable):
        kernels.linear_plan(xs[0].float(), wq, bias, backend="triton")


@interpreted
def test_launch_plan_is_none_where_the_path_is_not_planned(tk):
    _, gm = tk
    wq = _weight(24, 1024, seed=3)
    x = torch.randn(1, 1024).bfloat16()
    assert gm.linear_plan(torch.randn(5, 1024).bfloat16(), wq) is None  # M = 5 here: the tiled GEMM
    assert gm.linear_plan(torch.randn(1, 2048).bfloat16()[:, ::2], wq) is None  # a strided K
    assert gm.linear_plan(x[:, :0].reshape(1, 0), _weight(24, 16, seed=1)) is None


@interpreted
def test_launch_plan_leaves_padded_scale_rows_to_the_dispatch(tk, monkeypatch):
    """wsgemm on K % 256 != 0 reads the scales from a padded copy (``wsgemm.tma_scales``), which a plan
    would hold past an in-place write to the weight; the dispatch takes those calls (None), before any
    launch is built."""
    _, gm = tk
    monkeypatch.setattr(dp, "choose", lambda *args, **kwargs: "wsgemm")
    assert gm.linear_plan(torch.randn(100, 1088).bfloat16(), _weight(64, 1088, seed=4)) is None


@interpreted
def test_module_keeps_its_plans_while_its_buffers_stay(tk, monkeypatch):
    """NVFP4Linear's plans (one per input signature): kept across calls and in-place writes (the
    launches read the new contents), rebuilt when a buffer is replaced or re-pointed, dropped by
    ``.to()`` and pickling, and bounded in number."""
    import copy

    from fp4ptq import modules

    real = kernels.linear_plan
    monkeypatch.setattr(modules.kernels, "linear_plan",
                        lambda x, w, b, a, four_six=None: real(x, w, b, a, four_six=four_six, backend="triton"))
    n, k = 24, 1024
    wq, wq2 = _weight(n, k, seed=1), _weight(n, k, seed=2)
    mod = modules.NVFP4Linear.from_quantized(wq, dtype=torch.bfloat16, bias=torch.randn(n))
    x = torch.randn(1, k).bfloat16()
    _, gm = tk

    def dispatch():
        return gm.linear_w4a16(x, mod.quantized_weight(), mod.bias)

    assert mod._plan(x)[0] is None  # a signature's first call: the dispatch's
    plan, _ = mod._plan(x)
    assert plan is not None and mod._plan(x)[0] is plan and torch.equal(plan(x), dispatch())
    mod.weight_packed.copy_(wq2.packed)  # in place (load_state_dict does this): same plan, new weights
    mod.weight_scale.copy_(wq2.block_scale)
    assert mod._plan(x)[0] is plan and torch.equal(mod._planned(x), dispatch())
    mod.weight_packed = wq.packed.clone()  # a replaced buffer
    assert mod._plan(x)[0] is None
    replanned, _ = mod._plan(x)
    assert replanned is not plan and torch.equal(mod._planned(x), dispatch())
    mod.weight_scale.data = wq.block_scale.clone()  # re-pointed under the same tensor
    assert mod._plan(x)[0] is None and mod._plan(x)[0] not in (None, replanned)
    assert torch.equal(mod._planned(x), dispatch())
    mod._plan(x.view(1, 1, k))
    assert mod._plan(x.view(1, 1, k))[0] not in (None, mod._plan(x)[0])  # another signature
    assert len(mod._plans) == 2
    assert copy.deepcopy(mod)._plans is None
    monkeypatch.setattr(modules, "MAX_PLANS", 2)
    mod._plan(torch.randn(2, k).bfloat16())
    assert len(mod._plans) == 1  # bounded: the old ones go
    mod.to("cpu")
    assert mod._plans is None
    # a plan that raises: the dispatch takes that signature from then on
    mod._plan(x)
    key = mod._plan(x)[1]
    mod._plans[key] = lambda x: 1 / 0
    assert mod._planned(x) is None and mod._plans[key] is None

    # W4A4: the amax goes to each call, so a new static scale (in place, or in an inference tensor whose
    # writes have no version to see) keeps the plan
    for inference in (False, True):
        with torch.inference_mode(inference):
            mod4 = modules.NVFP4Linear.from_quantized(wq, scheme="w4a4", input_amax=torch.tensor(3.0),
                                                      act_four_six="mse", dtype=torch.bfloat16)
        mod4._plan(x)
        plan4, _ = mod4._plan(x)
        assert plan4 is not None
        assert torch.equal(mod4._planned(x), gm.linear_w4a4(x, wq, mod4.input_amax(), four_six="mse"))
        with torch.inference_mode(inference):
            mod4.input_global_scale.mul_(2)  # a new static scale, in place
        assert mod4._plan(x)[0] is plan4
        assert torch.equal(mod4._planned(x), gm.linear_w4a4(x, wq, mod4.input_amax(), four_six="mse"))


@interpreted
@pytest.mark.parametrize("m,quant16_rows", [(1, 3), (2, 1)])
@pytest.mark.parametrize("four_six", [None, "mse"])
def test_w4a4_launch_plan_gives_the_dispatch_bits(tk, monkeypatch, m, quant16_rows, four_six):
    """The W4A4 plan (the activations' quantize launch, then the GEMV on the quantized operand with
    its global scale per call): ``linear_w4a4``'s bits, through the fp32-compare quantize kernel and
    (with ``QUANT16_MIN_ROWS`` lowered) the 16-bit one."""
    qk, gm = tk
    monkeypatch.setattr(qk, "QUANT16_MIN_ROWS", quant16_rows)
    n, k = 20, 768
    wq = _weight(n, k, seed=5)
    amax = torch.tensor(2.5)
    bias = torch.randn(n).bfloat16()
    g = torch.Generator().manual_seed(m)
    plan = gm.linear_plan(torch.zeros(m, k).bfloat16(), wq, bias, amax, four_six)
    assert plan is not None
    for call in range(4):
        x = (torch.randn(m, k, generator=g) * 2).bfloat16()
        a = amax * (1 + call % 2)  # the amax of each call
        assert torch.equal(plan(x, a), gm.linear_w4a4(x, wq, a, bias, four_six=four_six))
    assert gm.linear_plan(x, wq, bias, amax.double(), four_six) is None  # an amax the dispatch converts
    assert plan(x, amax.double()) is None


# the GEMVs' tolerance against the fp32 product of the dequantized weight: bf16 block sums (2^-8 a
# rounding) within 1e-2; fp16 ones (2^-11, each block's x scaled into fp16's top binade) within 2e-3
GEMV_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _gemv_with_and_without_prefetch(gm, monkeypatch, x, wq, bias, config_name, config_for):
    """``linear_w4a16(x, wq, bias)`` on path gemv6 with ``gm.<config_name>`` set to ``config_for(prefetch)``
    for prefetch off and on: each written into a poisoned ``out``, within the GEMV tolerance of the
    reference (``GEMV_TOL`` of x's dtype), and the two bit-identical (loading ahead changes when bytes
    arrive, not the math)."""
    m, n = x.shape[0], wq.shape[0]
    bias = bias.to(x.dtype)
    ref = x.float() @ wq.dequantize(torch.float32).T + bias.float()
    got = []
    for prefetch in (False, True):
        monkeypatch.setattr(gv, config_name, config_for(prefetch))
        out = torch.full((m, n), float("nan"), dtype=x.dtype)
        y = gm.linear_w4a16(x, wq, bias, path="gemv6", out=out)
        assert y.data_ptr() == out.data_ptr()
        assert _rel(y, ref) < GEMV_TOL[x.dtype], (config_name, tuple(x.shape), x.dtype, n, prefetch)
        got.append(y)
    assert torch.equal(got[0], got[1])


@interpreted
@pytest.mark.parametrize("m,n,k,kc", [(1, 37, 1040, 32), (2, 24, 768, 16), (1, 9, 512, 64)])
def test_gemv7_streams_whole_rows_like_the_reference(tk, monkeypatch, m, n, k, kc):
    """The streamed-x GEMV (whole rows a program, x re-read each step): K over several steps with a
    masked last one (1040 = 65 blocks in steps of 32) or whole ones, row tiles past N, two programs
    walking several tiles each (the next tile's first chunk loaded ahead), two activation rows, a
    bias, x not 8-byte aligned, and W4A4 (the activations' global scale): all within the GEMV
    tolerance of the reference, with and without loading ahead (the same bits)."""
    _, gm = tk
    wq = _weight(n, k, seed=n + k)
    big = torch.randn(m, k + 1, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n)
    monkeypatch.setattr(gv, "GEMV7", "1")
    for x in (big[:, :k].contiguous().bfloat16(), big.half()[:, 1:], big.bfloat16()[:, 1:]):
        _gemv_with_and_without_prefetch(gm, monkeypatch, x, wq, bias, "_gemv7_config",
                                        lambda p: lambda m_, n_, k_: (4, 1, kc, 1, p))
    for dtype in (torch.bfloat16, torch.float16):  # W4A4: the quantized operand in x's dtype
        x = big[:, 1:].to(dtype)
        amax = x.float().abs().amax().reshape(1)
        ref4 = gm.linear_w4a4(x, wq, amax, bias.to(dtype), path="gemv4")
        assert _rel(gm.linear_w4a4(x, wq, amax, bias.to(dtype), path="gemv6"), ref4.float()) < GEMV_TOL[dtype]


@interpreted
@pytest.mark.parametrize("kernel,cfg,m,n,k", [
    ("_gemv6_config", (4, 1, 1, 1024, False), 1, 24, 1024),    # one segment, 3 tiles a program
    ("_gemv6_config", (4, 1, 1, 1024, True), 2, 24, 1024),     # loading ahead past the last tile
    ("_gemv6_config", (4, 1, 2, 256, True), 1, 16, 768),       # split K, 2 segments a row
    ("_gemv6_config", (4, 1, 1, 256, False), 1, 8, 272),       # a masked last segment
    ("_gemv7_config", (4, 1, 16, 1, True), 2, 12, 1040),       # a masked last step, loading ahead
    ("_gemv7_config", (4, 1, 32, 1, False), 1, 16, 1024),
])
def test_gemv_built_for_the_layers_k_gives_the_same_bits(tk, monkeypatch, kernel, cfg, m, n, k):
    """gemv6 / gemv7 built with K/16 as a compile-time constant (rows at constant distances, the tile
    index clamped where the run-time build remaps rows past N) give the bits of the build that takes K
    at run time (W4A16, and W4A4 on the quantized activations), and the launcher picks the
    constant build only where N is whole row tiles."""
    _, gm = tk
    monkeypatch.setattr(gv, "GEMV7", "1" if kernel == "_gemv7_config" else "0")
    monkeypatch.setattr(gv, kernel, lambda m_, n_, k_: cfg)
    wq = _weight(n, k, seed=k + n)
    x = _activations(m, k, torch.bfloat16, seed=k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).bfloat16()
    amax = x.float().abs().amax()
    const_kb = gv._const_kb
    got, got4 = [], []
    for const in (False, True):  # the run-time K build (as for N not whole row tiles), then the rule's
        monkeypatch.setattr(gv, "_const_kb", const_kb if const else (lambda n_, k_, rows: 0))
        assert gv._const_kb(n, k, cfg[0]) == (k // 16 if const else 0)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        got.append(gm.linear_w4a16(x, wq, bias, path="gemv6", out=out))
        if kernel == "_gemv6_config":
            got4.append(gm.linear_w4a4(x, wq, amax, bias, path="gemv6"))
    assert _rel(got[1], x.float() @ wq.dequantize(torch.float32).T + bias.float()) < 1e-2
    assert torch.equal(got[0], got[1])
    if got4:
        assert torch.equal(got4[0], got4[1])
    assert gv._const_kb(n + 1, k, cfg[0]) == 0  # a partial last tile keeps the run-time build


@interpreted
@pytest.mark.parametrize("prefetch", [False, True])
def test_gemv6_split_k_with_a_masked_last_segment(tk, monkeypatch, prefetch):
    """K = 272 in segments of 256 blocks' worth: the second program of a row holds 1 of its
    16 blocks (masked x and weights), summed through the workspace like an even split."""
    _, gm = tk
    m, n, k = 2, 19, 272
    monkeypatch.setattr(gv, "_gemv6_config", lambda m_, n_, k_: (4, 1, 8, 256, prefetch))
    wq = _weight(n, k, seed=5)
    x = _activations(m, k, torch.bfloat16, seed=5)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).bfloat16()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    y = gm.linear_w4a16(x, wq, bias, path="gemv6", out=out)
    assert _rel(y, x.float() @ wq.dequantize(torch.float32).T + bias.float()) < 1e-2


def test_gemv6_segments_keep_lanes_busy_without_cutting_rows_short():
    """K a multiple of 2048: its power-of-two divisor up to the cap (the tuned Llama shapes);
    any other K: the fewest segments with 85% of the lanes busy (Qwen2-7B's K = 3584 in one
    masked segment, 18944 in 5 of 4096, not 37 of 512; a long K never in one segment)."""
    assert gv._gemv6_segment(14336, 4096) == 2048 and gv._gemv6_segment(28672, 8192) == 4096
    assert gv._gemv6_segment(8192, 8192) == 8192 and gv._gemv6_segment(8192, 4096) == 4096
    assert gv._gemv6_segment(3584, 4096) == 3584       # one segment, 224 of 256 blocks
    assert gv._gemv6_segment(18944, 8192) == 4096      # 4 x 4096 + 2560
    assert gv._gemv6_segment(11008, 4096) == 4096      # Llama-2-7B down: 2 x 4096 + 2816
    assert gv._gemv6_segment(2560, 4096) == 512        # one segment would idle 37% of the lanes
    assert gv._gemv6_segment(1040, 4096) == 1040       # one masked segment
    assert gv._gemv6_segment(29568, 8192) == 8192      # Qwen2-72B down (K % 256 != 0): 3 x 8192 + 4992
    for k in (80, 768, 1040, 1792, 2560, 3584, 5120, 11008, 13824, 18944, 29568, 12304):
        for cap in (4096, 8192):
            seg = gv._gemv6_segment(k, cap)
            assert (seg == k and k <= cap) or (seg & (seg - 1) == 0 and 256 <= seg <= cap)


@interpreted
def test_gemv6_prefetches_on_large_and_narrow_layers(tk):
    """The swept rule: layers of 64M weights and more load each row tile a step ahead, with
    K segments up to 8192 (70B gate_up in one); at M = 1 so do the narrow single-segment layers
    (K one segment, N <= 8192: 4-row tiles, 4 programs an SM, twice the warps; tuned cold,
    results/narrow_ahead_h200.json); the others keep the plain loop."""
    _, gm = tk
    assert gv._gemv6_config(1, 28672, 4096) == (4, 4, 8, 4096, True)     # 8B gate_up
    assert gv._gemv6_config(1, 57344, 8192) == (4, 4, 4, 8192, True)     # 70B gate_up
    assert gv._gemv6_config(1, 8192, 28672) == (4, 4, 16, 4096, True)    # 70B down: 7 segments
    assert gv._gemv6_config(1, 4096, 14336) == (8, 2, 16, 2048, False)  # 8B down: 8 rows, 2 blocks a thread
    assert gv._gemv6_config(1, 3072, 8192) == (8, 4, 16, 4096, False)    # Phi-3-mini down
    assert gv._gemv6_config(1, 4096, 11008) == (4, 2, 16, 4096, False)   # Llama-2-7B down: masked tail, 4 rows
    assert gv._gemv6_config(1, 576, 1536) == (4, 1, 16, 512, False)      # SmolLM2 down: 512-K segments
    assert gv._gemv6_config(1, 6144, 4096) == (4, 4, 4, 4096, True)      # 8B qkv: 4 rows, 4 an SM, loading ahead
    assert gv._gemv6_config(2, 6144, 4096) == (4, 2, 4, 4096, False)     # (M = 2: the warm-tuned config)
    assert gv._gemv6_config(1, 960, 576) == (4, 1, 4, 576, True)         # SmolLM2 qkv: one warp
    assert gv._gemv6_config(1, 12288, 4096) == (8, 2, 8, 4096, False)    # Llama-2-7B qkv: 8 rows, 8 an SM


@interpreted
def test_gemv6_decodes_with_the_multiply_except_on_large_split_layers(tk):
    """The three-operation decode where K is whole segments of 2048 or more, not on layers of 64M
    weights and more whose K is split (70B down: 2% slower there in two H200 runs) nor where the
    last segment is masked or segments are short (3-5% slower on the layers timed)."""
    _, gm = tk
    assert gv._gemv6_muldec(28672, 4096) and gv._gemv6_muldec(57344, 8192)   # 8B / 70B gate_up
    assert gv._gemv6_muldec(4096, 14336) and gv._gemv6_muldec(6144, 4096)    # 8B down, 8B qkv
    assert gv._gemv6_muldec(128256, 4096) and gv._gemv6_muldec(3072, 8192)   # 8B lm_head, Phi-3-mini down
    assert not gv._gemv6_muldec(8192, 28672)                                 # 70B down: 7 segments
    assert not gv._gemv6_muldec(4096, 11008) and not gv._gemv6_muldec(4608, 3584)  # masked last segment
    assert not gv._gemv6_muldec(576, 1536)                                   # SmolLM2 down: 512-K segments


@interpreted
def test_fp16_gemv7_takes_sixteen_row_tiles_on_the_largest_layers(tk):
    """fp16 activations on layers of 128M weights and more: 16 rows, 4 warps, 4 programs an SM, nothing
    loaded ahead, the step that pads K less (70B down 256 blocks, Qwen2-72B down 128); smaller layers
    keep bf16's config."""
    _, gm = tk
    assert gv._gemv7_f16_config(8192, 28672, gv._gemv7_config(1, 8192, 28672)) == (16, 4, 256, 4, False)
    assert gv._gemv7_f16_config(8192, 29568, gv._gemv7_config(1, 8192, 29568)) == (16, 4, 128, 4, False)
    for n, k in ((4096, 14336), (3584, 18944)):
        assert gv._gemv7_f16_config(n, k, gv._gemv7_config(1, n, k)) == gv._gemv7_config(1, n, k)


@interpreted
def test_gemv7_takes_the_long_k_layers(tk, monkeypatch):
    """The streamed-x GEMV where gemv6 would split K on layers of 32M weights and more (the down
    projections): 2 warps, 128-block steps and loading ahead where such steps divide K, else 4 warps
    and the step of 128 or 256 blocks that pads K less; gemv6 elsewhere; the knob forces either way."""
    _, gm = tk
    assert gv._gemv7_config(1, 8192, 28672) == (8, 2, 128, 8, True)      # 70B down
    assert gv._gemv7_config(1, 4096, 14336) == (8, 2, 128, 8, True)      # 8B down
    assert gv._gemv7_config(1, 3584, 18944) == (8, 4, 256, 8, False)     # Qwen2-7B down: masked last step
    assert gv._gemv7_config(1, 4096, 11008) == (8, 4, 256, 8, False)     # Llama-2-7B down
    assert gv._gemv7_config(1, 8192, 29568) == (8, 4, 128, 8, False)     # Qwen2-72B down: 256 would pad more
    assert gv._gemv7_config(1, 5120, 17920) == (8, 4, 128, 8, False)     # Phi-3-medium down
    for n, k in ((57344, 8192), (28672, 4096), (6144, 4096), (576, 1536)):  # one segment, or small
        assert gv._gemv7_config(1, n, k) is None
    monkeypatch.setattr(gv, "GEMV7", "0")
    assert gv._gemv7_config(1, 8192, 28672) is None
    monkeypatch.setattr(gv, "GEMV7", "1")
    assert gv._gemv7_config(1, 6144, 4096) is not None


@interpreted
def test_gemv6_takes_only_layers_its_32_bit_block_offsets_address(tk):
    """gemv6 / gemv7 address blocks as row * K/16 + block in int32: the automatic choice moves a layer
    of 2^31 blocks or more to gemv4, and an explicit gemv6 launch refuses it, naming the shape."""
    _, gm = tk
    cpu = torch.device("cpu")
    assert gv._block_offsets_fit(128256, 16384)  # the largest embedding-sized layers: 131M blocks
    assert dp.choose(1, torch.bfloat16, False, 16384, cpu, 1 << 17) == "gemv6"
    big = (1 << 31) // (16384 // 16)  # rows whose blocks reach 2^31
    assert not gv._block_offsets_fit(big, 16384) and gv._block_offsets_fit(big - 1, 16384)
    assert dp.choose(1, torch.bfloat16, False, 16384, cpu, big) == "gemv4"
    with pytest.raises(ValueError, match=f"{big} x 16384 weight.*32-bit"):
        gv._gemv6(None, None, None, None, None, None, None, 1, big, 16384, False, None)


@interpreted
def test_gemv6_grid_is_cut_to_whole_waves(tk, monkeypatch):
    """Programs per SM above what fits at once round down to whole waves of
    resident programs (a partial second wave ran 1.5x slower on the H200)."""
    _, gm = tk
    grids = []
    kern = gv._gemv_resident_kernel
    monkeypatch.setattr(gv, "_gemv_resident_kernel", type("K", (), {
        "__getitem__": lambda self, grid: (grids.append(grid) or kern[grid])})())
    monkeypatch.setattr(gv, "_gemv6_config", lambda m, n, k: (1, 1, 8, k, False))
    monkeypatch.setattr(cm, "_sm_count", lambda device: 2)
    monkeypatch.setattr(gv, "_resident_programs", lambda *a: 3)
    wq = _weight(40, 64, seed=3)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref = x.float() @ wq.dequantize(torch.float32).T
    assert _rel(gm.linear_w4a16(x, wq, path="gemv6"), ref) < 1e-2
    assert grids[-1] == (12, 1, 1)  # 8 per SM -> two waves of 3 -> 6 per SM


def _pow2_scaled_weight(n, k, seed, global_enc=3.0):
    """Random codes under power-of-two E4M3 block scales (2^-9, a subnormal, .. 2^7):
    what the interpreter's E8M0 reading of dot_scaled scales can represent."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.exp2(torch.randint(-9, 8, (n, k // 16), generator=g).float()).to(torch.float8_e4m3fn)
    return nvfp4.NVFP4Tensor(nvfp4.pack_codes(codes), scales, torch.tensor(global_enc), torch.Size((n, k)),
                             torch.bfloat16)


@interpreted
@pytest.mark.parametrize("m,n,k", [(5, 33, 64), (17, 40, 96), (3, 7, 160)])
def test_dot_scaled_matches_the_reference_decode(tk, m, n, k):
    """The FP4 tensor-core kernel (sm_100+; here the interpreter): NVFP4 x NVFP4
    and bf16/fp16 x NVFP4, partial tiles in M, N and K, a bias, fp32 output exact."""
    ds = importlib.import_module("fp4ptq.kernels.dot_scaled")
    w = _pow2_scaled_weight(n, k, seed=n)
    xq = _pow2_scaled_weight(m, k, seed=m + 100, global_enc=5.0)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(k))
    ref = xq.dequantize(torch.float32) @ w.dequantize(torch.float32).T + bias
    out = torch.full((m, n), float("nan"))
    y = ds.matmul(xq.packed, xq.block_scale, xq.global_enc, w, bias, torch.float32, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert _rel(y, ref) < 1e-6
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        ref16 = x.float() @ w.dequantize(torch.float32).T
        assert _rel(ds.matmul(x, None, None, w, None, torch.float32), ref16) < 1e-6


@interpreted
def test_w4a4_dot_scaled_path_equals_the_hopper_path(tk):
    """linear_w4a4(path="dot_scaled") quantizes x to codes + scales and gives the
    same bf16 output as the sm_90 tiled GEMM (x's block maxima are powers of two
    under a static amax of 448, so its scales are too)."""
    _, gm = tk
    g = torch.Generator().manual_seed(7)
    m, n, k = 6, 40, 96
    x = torch.randn(m, k, generator=g).clamp(-0.9, 0.9)
    x.view(m, k // 16, 16)[:, :, 0] = torch.exp2(torch.randint(0, 3, (m, k // 16), generator=g).float())
    x = x.bfloat16()
    w = _pow2_scaled_weight(n, k, seed=3)
    amax = torch.tensor(448.0)
    y = gm.linear_w4a4(x, w, amax, path="dot_scaled")
    assert torch.equal(y, gm.linear_w4a4(x, w, amax, path="gemm"))
    ref = nvfp4.fake_quantize(x.float(), None, amax=amax) @ w.dequantize(torch.float32).T
    assert _rel(y, ref) < 1e-2
    with pytest.raises(nvfp4.NVFP4Error, match="power-of-two"):
        gm.linear_w4a4(torch.randn(m, k).bfloat16(), w, torch.tensor(3.0), path="dot_scaled")


@pytest.mark.skipif(INTERPRETED, reason="compiles for a GPU target; runs in the main process")
@pytest.mark.parametrize("even_k", [True, False])
def test_dot_scaled_kernel_compiles_to_native_nvfp4_mma_for_sm100(even_k):
    """No FP4 GPU here, so compile the W4A4 kernel for sm_100 (masked K tails
    included: their E4M3 scale loads need a float fill) and check the PTX uses
    the block-scaled FP4 tensor-core MMA with 16-element E4M3 blocks."""
    import re

    from compile_target import compile_for

    ds = importlib.import_module("fp4ptq.kernels.dot_scaled")
    types = {"x_ptr": "*u8", "xs_ptr": "*fp8e4nv", "w_ptr": "*u8", "ws_ptr": "*fp8e4nv", "wenc_ptr": "*fp32",
             "xenc_ptr": "*fp32", "bias_ptr": "*fp32", "y_ptr": "*bf16"}
    consts = {"X_FMT": "e2m1", "HAS_BIAS": True, "HAS_XENC": True, "BLOCK_M": 128, "BLOCK_N": 128,
              "BLOCK_K": 128, "GROUP_M": 8, "EVEN_K": even_k}
    compiled = compile_for(ds._dot_scaled_kernel, types, consts, arch=100, num_warps=4, num_stages=3)
    mma = set(re.findall(r"tcgen05\.mma[\w.:]*", compiled.asm["ptx"]))
    assert any("kind::mxf4nvf4.block_scale" in op and ("block16" in op or "scale_vec::4X" in op) for op in mma), mma


def test_dot_scaled_is_used_only_where_it_self_tested(monkeypatch):
    """The sm_100 path's guard: refused off CUDA, below sm_100 and when turned
    off; on sm_100 it needs its self-test to pass, and a failure is a warning
    (the sm_90 kernels stay in use), asked once per device."""
    ds = importlib.import_module("fp4ptq.kernels.dot_scaled")
    monkeypatch.setattr(ds, "_READY", {})
    assert "cpu" in ds.ready(torch.device("cpu"), "e2m1")
    cap = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["value"])
    assert "no FP4 tensor cores" in ds.ready(torch.device("cuda", 0), "e2m1")
    cap["value"] = (10, 0)
    calls = []
    monkeypatch.setattr(ds, "_self_test", lambda device, fmt: calls.append(fmt) or None)
    assert ds.ready(torch.device("cuda", 1), "e2m1") is None
    assert ds.ready(torch.device("cuda", 1), "e2m1") is None and calls == ["e2m1"]

    def broken(device, fmt):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(ds, "_self_test", broken)
    with pytest.warns(UserWarning, match="not used on cuda:2"):
        assert "did not compile" in ds.ready(torch.device("cuda", 2), "bf16")


@interpreted
@pytest.mark.parametrize("four_six", [None, "mse"])
@pytest.mark.parametrize("path,m", [("gemv4", 2), ("gemv6", 2), ("gemm", 19),
                                    ("cublas", 6)])
def test_w4a4_matches_reference(tk, four_six, path, m):
    _, gm = tk
    n, k = 36, 160
    wq = _weight(n, k, seed=5)
    x = _activations(m, k, torch.bfloat16, seed=6)
    amax = torch.tensor(4.0)
    ref = kernels.linear_w4a4(x.float(), wq, amax, four_six=four_six, backend="reference")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    y = gm.linear_w4a4(x, wq, amax, four_six=four_six, path=path, out=out)
    assert _rel(y, ref) < 1e-2


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a4_dequantize_and_cublas_rounds_once_as_the_reference(tk, dtype):
    """The dequantize + cuBLAS W4A4 path (M > 64 on small-K layers) multiplies exact ``v * scale``
    operands with fp32 sums and divides by both global scales in fp32 before its one rounding into the
    activations' dtype, as the reference does: the outputs differ only where fp32 summation order or the
    reference's per-operand global-scale roundings move a value across a 16-bit rounding boundary
    (rounding the product to 16 bits first, then scaling it, differed in about a third of them): by at
    most one 16-bit unit, or, on outputs that cancel to below it, by at most what fp32 summation order
    can move a sum (K * 2^-24 * sum |x_q w|: the CPU's GEMM blocking decides the order)."""
    _, gm = tk
    m, n, k = 96, 64, 256
    wq = _weight(n, k, seed=21)
    x = _activations(m, k, dtype, seed=22)
    amax = x.float().abs().amax() * 0.5  # scales far from powers of two: the rounding order shows
    ref = kernels.linear_w4a4(x, wq, amax, backend="reference")
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = gm.linear_w4a4(x, wq, amax, path="cublas", out=out)
    assert (y == ref).float().mean() > 0.99
    ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
    xq = nvfp4.quantize(x.float(), amax=amax).dequantize(torch.float32)
    order = k * 2**-24 * (xq.abs() @ wq.dequantize(torch.float32).abs().T)
    assert ((y.float() - ref.float()).abs() <= torch.maximum(ulp, order)).all()


def test_w4a4_cublas_fp32_product_rows_are_chunked_under_the_byte_bound(monkeypatch):
    """The fp32 product of the W4A4 cuBLAS path is made in row chunks of at most
    ``W4A4_CUBLAS_FP32_BYTES`` (whole multiples of 128 rows, at least 128) that cover every row once."""
    from fp4ptq.kernels import gemm as gm

    monkeypatch.setattr(gm, "W4A4_CUBLAS_FP32_BYTES", 2 << 30)
    assert gm._row_chunks(8192, 57344) == [(0, 8192)]  # 70B gate_up at M = 8192: 1.75 GiB, one piece
    chunks = gm._row_chunks(32768, 57344)
    assert chunks[0] == (0, 9344) and chunks[-1][1] == 32768 and len(chunks) == 4
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert all(4 * (r1 - r0) * 57344 <= 2 << 30 and (r1 - r0) % 128 == 0 for r0, r1 in chunks[:-1])
    monkeypatch.setattr(gm, "W4A4_CUBLAS_FP32_BYTES", 1)
    assert gm._row_chunks(300, 64) == [(0, 128), (128, 256), (256, 300)] and gm._row_chunks(5, 64) == [(0, 5)]


@interpreted
def test_w4a4_cublas_chunked_rows_give_the_unchunked_output(tk, monkeypatch):
    """Row chunks of the fp32 product change no output: each output is the same K sum, scaled and rounded
    once, whether its rows were multiplied in one piece or in three (written into ``out`` in place)."""
    _, gm = tk
    m, n, k = 300, 64, 256
    wq = _weight(n, k, seed=23)
    x = _activations(m, k, torch.bfloat16, seed=24)
    amax = x.float().abs().amax() * 0.5
    whole = gm.linear_w4a4(x, wq, amax, path="cublas")
    monkeypatch.setattr(gm, "W4A4_CUBLAS_FP32_BYTES", 128 * 4 * n)  # 128-row chunks: 128, 128, 44
    assert len(gm._row_chunks(m, n)) == 3
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    y = gm.linear_w4a4(x, wq, amax, path="cublas", out=out)
    assert y.data_ptr() == out.data_ptr()
    ref = kernels.linear_w4a4(x, wq, amax, backend="reference")
    assert torch.equal(y, whole) and (y == ref).float().mean() > 0.99


@interpreted
@pytest.mark.parametrize("path", ["cublas", "gemm"])
def test_w4a4_fp16_does_not_overflow_before_the_global_scales(tk, path):
    """W4A4 multiplies v * scale operands (up to 6 * 448 each) and divides by both global
    scales afterwards: one such product is past fp16's 65504, so fp16 activations must not
    take an fp16 product (found on the H200: inf from dequantize + cuBLAS at M >= 65)."""
    _, gm = tk
    m, n, k = 7, 40, 128
    g = torch.Generator().manual_seed(11)
    wq = nvfp4.quantize(torch.randn(n, k, generator=g) * 0.05)
    x = (torch.randn(m, k, generator=g) * 2).half()
    amax = x.float().abs().amax()  # the largest activation gets the largest code and scale
    ref = kernels.linear_w4a4(x.float(), wq, amax, backend="reference")
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    y = gm.linear_w4a4(x, wq, amax, path=path, out=out)
    assert torch.isfinite(y).all() and _rel(y, ref) < 1e-2


@interpreted
def test_dispatch_runs_triton_under_interpreter_and_explains_refusals(tk, monkeypatch):
    x = _activations(4, 64, torch.bfloat16, seed=7)
    q = kernels.quantize(x, "mse", backend="triton")
    _same_quantized(q, nvfp4.quantize(x, "mse"))
    wq = _weight(24, 64, seed=8)
    y = kernels.linear_w4a16(x, wq, backend="triton")
    assert _rel(y, x.float() @ wq.dequantize(torch.float32).T) < 1e-2
    # auto never picks Triton for CPU tensors
    assert torch.equal(kernels.linear_w4a16(x, wq), torch.nn.functional.linear(x, wq.dequantize(x.dtype)))
    with pytest.raises(BackendUnavailable, match="bf16/fp16"):
        kernels.linear_w4a16(x.float(), wq, backend="triton")
    monkeypatch.setattr(kernels._backend, "_interpreting", lambda: False)
    with pytest.raises(BackendUnavailable, match="CUDA"):
        kernels.quantize(x, backend="triton")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels.quantize(x, backend="cuda")


@interpreted
def test_bf16x2_gemvs_match_dequantized_matmul_on_all_codes(tk):
    """Packed bf16x2 GEMVs (emulated under the interpreter): every code incl.
    0.5 (a bf16 subnormal in the decode) and subnormal E4M3 scales; its bf16
    block sums stay within the 1e-2 tolerance."""
    _, gm = tk
    codes = torch.arange(16, dtype=torch.uint8).repeat(6, 4)  # [6, 64]
    scales = torch.tensor([448.0, 1.0, 0.015625, 0.001953125, 0.005859375, 3.0]).unsqueeze(1).expand(6, 4)
    w = nvfp4.NVFP4Tensor(nvfp4.pack_codes(codes), scales.to(torch.float8_e4m3fn).contiguous(),
                          torch.tensor(7.5), torch.Size((6, 64)), torch.bfloat16)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref = x.float() @ w.dequantize(torch.float32).T
    for path in ("gemv4", "gemv6"):
        out = torch.full((1, 6), float("nan"), dtype=torch.bfloat16)
        err = (gm.linear_w4a16(x, w, path=path, out=out).float() - ref).norm(dim=0) / ref.norm(dim=0)
        assert float(err.max()) < 1e-2, (path, err)
    xh = x.half()  # fp16x2 sums: every code (0.5 is the fp16 subnormal 2^-15 in the decode) and scale
    ref = xh.float() @ w.dequantize(torch.float32).T
    err = (gm.linear_w4a16(xh, w, path="gemv6").float() - ref).norm(dim=0) / ref.norm(dim=0)
    assert float(err.max()) < 2e-3, err


@interpreted
@pytest.mark.parametrize("gemv7", ["0", "1"])
def test_fp16_gemvs_keep_fp16_precision_from_the_largest_to_subnormal_activations(tk, monkeypatch, gemv7):
    """fp16 x in gemv6 / gemv7: rows reaching 3e4 and 65504 (no block sum overflows), rows of 1e-3,
    blocks mixing 1e4 and 1e-3, all-zero blocks: each row within 2e-3 of the fp32 product and at least
    4x closer than the same row through bf16 (rounded to bf16 first); a row of fp16 subnormals (outputs
    near fp16's smallest numbers) within one unit of the output's last place (2^-10 relative) plus half
    the subnormal step (2^-24)."""
    _, gm = tk
    monkeypatch.setattr(gv, "GEMV7", gemv7)
    # gemv7 with the largest layers' fp16 tile (16 rows: a partial second tile here)
    monkeypatch.setattr(gv, "_gemv7_config", lambda m_, n_, k_: (16, 2, 16, 1, False) if gemv7 == "1" else None)
    n, k = 24, 528
    g = torch.Generator().manual_seed(7)
    wq = nvfp4.quantize(torch.randn(n, k, generator=g) * 1e-3)
    x = torch.randn(6, k, generator=g)
    x[0] *= 3e4 / x[0].abs().max()
    x[1] *= 1e-3
    x[2, :256], x[2, 256:] = 0.0, x[2, 256:] * 1e4
    x[3, ::2] *= 1e-4
    x[4] = 0.0
    x[4, 7] = 65504.0
    x[5] *= 1e-6  # fp16 subnormals
    xh = x.half()
    ref = xh.float() @ wq.dequantize(torch.float32).T
    y = torch.cat([gm.linear_w4a16(xh[r:r + 2], wq, path="gemv6") for r in range(0, 6, 2)]).float()
    yb = torch.cat([gm.linear_w4a16(xh[r:r + 2].bfloat16(), wq, path="gemv6") for r in range(0, 6, 2)]).float()
    assert torch.isfinite(y).all()
    for r in range(5):
        err, err_bf16 = _rel(y[r], ref[r]), _rel(yb[r], ref[r])
        assert err < 2e-3 and err * 4 < err_bf16, (r, err, err_bf16)
    assert ((y[5] - ref[5]).abs() <= ref[5].abs() * 2**-10 + 2**-24).all()


@interpreted
def test_gemv6_three_operation_pair_decode_equals_the_shift_decode(tk):
    """``_pair_mul`` (mask, one multiply, mask) gives ``_pair``'s bf16 pair for every pair register
    and every value of the two nibbles it reads, whatever the other six nibbles hold."""
    import triton
    import triton.language as tl

    global _gm
    _gm = cm

    @triton.jit
    def both(w_ptr, old_ptr, new_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        w = tl.load(w_ptr + offs, mask=ok, other=0)
        w8 = w >> 8
        for i in tl.static_range(4):
            tl.store(old_ptr + i * n + offs, _gm._pair(w, i, 6, _gm.BF16_MAG), mask=ok)
            tl.store(new_ptr + i * n + offs, _gm._pair_mul(w, w8, i), mask=ok)

    g = torch.Generator().manual_seed(0)
    both_nibbles = torch.arange(256, dtype=torch.int64)
    words = []
    for i in range(4):  # every (code i, code i + 4) under random other nibbles, incl. all-ones around them
        rest = torch.randint(0, 2**32, (256,), generator=g, dtype=torch.int64)
        rest[:16] = 0xFFFFFFFF
        keep = ~((0xF << (4 * i)) | (0xF << (4 * i + 16))) & 0xFFFFFFFF
        words.append((rest & keep) | ((both_nibbles & 0xF) << (4 * i)) | ((both_nibbles >> 4) << (4 * i + 16)))
    words.append(torch.randint(0, 2**32, (4096,), generator=g, dtype=torch.int64))
    w = torch.cat(words)
    w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    n = w.numel()
    old, new = torch.zeros(4 * n, dtype=torch.int32), torch.ones(4 * n, dtype=torch.int32)
    both[(triton.cdiv(n, 1024),)](w, old, new, n, BLOCK=1024)
    assert torch.equal(old, new)


@interpreted
def test_small_m_dispatch_picks_the_gemv_by_dtype(tk, monkeypatch):
    """M <= GEMV_MAX_M: the resident-x GEMV for bf16 and fp16 activations (packed bf16x2 / fp16x2
    sums)."""
    _, gm = tk
    seen = []
    for module, name in ((gv, "_gemv_resident_kernel"), (gv, "_gemv_blocks_kernel"), (gm, "_gemm_kernel")):
        kern = getattr(module, name)
        monkeypatch.setattr(module, name, type("K", (), {"__getitem__": lambda self, grid, n=name, k=kern: (
            seen.append(n) or k[grid])})())
    wq = _weight(24, 64, seed=2)
    for m, dtype in ((1, torch.bfloat16), (1, torch.float16), (8, torch.bfloat16)):
        gm.linear_w4a16(torch.randn(m, 64).to(dtype), wq)
    assert seen == ["_gemv_resident_kernel", "_gemv_resident_kernel", "_gemm_kernel"]


def test_dispatch_plan_gives_the_recorded_path_tile_and_split():
    """``dispatch.plan`` (the rule tables of ``rules.py`` read against an H200 and an A100) gives every row of
    ``tests/data/dispatch_table.json``: the path, tile and split the dispatch picked for the README's and the
    model zoo's layers before the tile rules became table rows."""
    pytest.importorskip("triton.experimental.gluon")
    import json

    import test_ptx_hashes as ph
    from fp4ptq.kernels import wsgemm

    got = {}
    for arch in ph.ARCHS:
        with ph._device(arch) as device:
            for layers, ms in ((ph.README_LAYERS, ph.README_MS), (ph.ZOO_LAYERS, ph.ZOO_MS)):
                for (layer, (n, k)), (dname, dtype), w4a4 in itertools.product(layers.items(), ph.DTYPES.items(),
                                                                               (False, True)):
                    rows = []
                    for m in ms:
                        path, tile, split = dp.plan(m, n, k, dtype, w4a4, device)
                        cfg = (tile, split, wsgemm.swapped(tile)) if path == "wsgemm" else tile
                        rows.append(f"M{m}: {path} {'' if cfg is None else cfg}".strip())
                    got[f"sm_{arch}/{layer}/{'w4a4' if w4a4 else 'w4a16'}/{dname}"] = " | ".join(rows)
    assert got == json.loads(ph.DISPATCH_FILE.read_text())


def test_rule_tables_name_known_conditions_and_give_a_tile_for_every_shape():
    """Every condition a row of ``rules.RULES`` / ``TILES`` names is one its reader passes, and every path of
    ``TILES`` has a row for any M, N and K (the last rules take what the others leave)."""
    from fp4ptq.kernels import rules

    assert {w for r in rules.RULES for w in r.when} <= set(dp.CONDITIONS)
    assert {w for r in rules.TILES for w in r.when} <= set(gv.CONDITIONS)
    for path in {r.path for r in rules.TILES}:
        for m, n, k in itertools.product((1, 2, 17, 64, 65, 129, 8192), (8, 16384, 1 << 20), (16, 4160, 1 << 16)):
            assert rules.tile(path, m, n, k, torch.float16, gv.CONDITIONS) is not None
    assert rules.first(rules.RULES, rules.Call(1, 8, 16, torch.float32, None, False), conditions=dp.CONDITIONS)
    with pytest.raises(ValueError, match="no mma tile"):
        rules.tile("mma", -1, 8, 16)


@interpreted
def test_gemvs_take_packed_codes_at_an_unaligned_address(tk):
    """A weight whose packed bytes start mid-word (a view into a larger buffer)."""
    _, gm = tk
    wq = _weight(12, 64, seed=4)
    buf = torch.empty(wq.packed.numel() + 3, dtype=torch.uint8)
    buf[3:] = wq.packed.reshape(-1)
    shifted = nvfp4.NVFP4Tensor(buf[3:].view(12, 32), wq.block_scale, wq.global_enc, wq.shape, wq.dtype)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    ref = x.float() @ wq.dequantize(torch.float32).T
    for path in ("gemv4", "gemv6", "gemm"):
        assert _rel(gm.linear_w4a16(x, shifted, path=path), ref) < 1e-2, path


@interpreted
def test_a_failed_automatic_mma_launch_falls_back_to_the_tiled_gemm(tk, monkeypatch):
    """The Gluon kernel is the automatic choice for 3 <= M <= 64 on CUDA: if its launch
    fails there (a config its self-test did not build), the call still returns the tiled
    GEMM's result, warns, and the kernel is not used again on that device; an
    explicitly requested path="mma" raises instead."""
    _, gm = tk
    mma = importlib.import_module("fp4ptq.kernels.mma")
    monkeypatch.setattr(mma, "_READY", {})
    monkeypatch.setattr(dp, "mma_unavailable_reason", lambda *a: mma._READY.get(-1))
    monkeypatch.setattr(dp, "choose", lambda m, *a, **k: "mma" if mma._READY.get(-1) is None else "gemm")

    def broken(*a, **k):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(mma, "matmul", broken)
    g = torch.Generator().manual_seed(3)
    w = nvfp4.quantize(torch.randn(48, 128, generator=g))
    x = torch.randn(5, 128, generator=g).bfloat16()
    want = gm.linear_w4a16(x, w, path="gemm")
    with pytest.warns(UserWarning, match="not used on cuda"):
        got = gm.linear_w4a16(x, w)
    assert torch.equal(got, want) and "PassManager" in mma._READY[-1]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the dispatch now skips mma on that device: no second warning
        assert torch.equal(gm.linear_w4a16(x, w), want)
    amax = x.float().abs().amax()
    mma._READY.clear()
    with pytest.warns(UserWarning, match="not used on cuda"):
        got4 = gm.linear_w4a4(x, w, amax)
    assert torch.equal(got4, gm.linear_w4a4(x, w, amax, path="gemm"))
    mma._READY.clear()
    with pytest.raises(RuntimeError, match="PassManager"):
        gm.linear_w4a16(x, w, path="mma")


@interpreted
@pytest.mark.parametrize("path,m", [("wgmma", 70), ("wsgemm", 200)])
def test_a_failed_automatic_sm90_launch_falls_back_to_dequantize_and_cublas(tk, monkeypatch, path, m):
    """wgmma (65 <= M <= 128) and wsgemm (129 <= M <= 1024) are automatic W4A16 choices on sm_90: if
    the launch fails there, the call returns what dequantize + cuBLAS gives, warns, and the kernel is
    not used again on that device; an explicitly requested path raises instead."""
    _, gm = tk
    kernel = pytest.importorskip(f"fp4ptq.kernels.{path}")
    monkeypatch.setattr(kernel, "_READY", {})
    monkeypatch.setattr(kernel, "_index", lambda device: -1)
    monkeypatch.setattr(dp, "choose", lambda m, *a, **k: path if kernel._READY.get(-1) is None else "cublas")

    def broken(*a, **k):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(kernel, "matmul", broken)
    g = torch.Generator().manual_seed(4)
    w = nvfp4.quantize(torch.randn(48, 256, generator=g))
    x = torch.randn(m, 256, generator=g).bfloat16()
    want = gm.linear_w4a16(x, w, path="cublas")
    with pytest.warns(UserWarning, match="not used on cuda:-1 any more"):
        got = gm.linear_w4a16(x, w)
    assert torch.equal(got, want) and "out of resources" in kernel._READY[-1]
    assert f"M={m}, N=48, K=256" in kernel._READY[-1]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the dispatch now skips the kernel on that device: no second warning
        assert torch.equal(gm.linear_w4a16(x, w), want)
    with pytest.raises(ValueError, match="CUDA only"):  # asked for by name: the guard's reason
        gm.linear_w4a16(x, w, path=path)


def test_host_integer_helpers_equal_tritons():
    """The launch code's ``cdiv`` / ``next_pow2`` (plain Python: Triton's are constexpr functions that
    cost microseconds a call from the host) give Triton's answers."""
    import triton

    from fp4ptq.kernels._common import cdiv, next_pow2

    for a in range(0, 700):
        assert next_pow2(a) == triton.next_power_of_2(a)
        for b in (1, 2, 3, 16, 128, 255, 256):
            assert cdiv(a, b) == triton.cdiv(a, b)
    for big in (2**31 - 1, 2**31, 2**33 + 5, 57344 * 8192):
        assert next_pow2(big) == triton.next_power_of_2(big) and cdiv(big, 16) == triton.cdiv(big, 16)


@interpreted
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("scheme", ["w4a16", "w4a4"])
def test_triton_layers_pass_gradients_as_the_reference_does(tk, m, scheme):
    """The Triton path (every CUDA call) asked for a gradient: the same forward bits as without one,
    and x's and the bias's gradients equal the reference backend's (``kernels._Linear``; before
    session 30 the output came back outside autograd and the gradient was dropped)."""
    g = torch.Generator().manual_seed(7)
    w = nvfp4.quantize(torch.randn(40, 160, generator=g))
    amax = torch.tensor(2.0)
    grads = {}
    for backend in ("triton", "reference"):
        x = torch.randn(m, 160, generator=torch.Generator().manual_seed(8)).mul(1.5).bfloat16().requires_grad_()
        bias = torch.randn(40, generator=torch.Generator().manual_seed(9)).bfloat16().requires_grad_()
        if scheme == "w4a16":
            run = lambda x, b: kernels.linear_w4a16(x, w, b, backend=backend)  # noqa: E731
        else:
            run = lambda x, b: kernels.linear_w4a4(x, w, amax, b, four_six="mse", backend=backend)  # noqa: E731
        y = run(x, bias)
        assert y.grad_fn is not None
        if backend == "triton":
            with torch.no_grad():
                assert torch.equal(y, run(x, bias))
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(10)).bfloat16())
        grads[backend] = (x.grad, bias.grad)
    assert torch.equal(grads["triton"][0], grads["reference"][0])
    assert torch.equal(grads["triton"][1], grads["reference"][1])


@interpreted
@pytest.mark.parametrize("path", ["gemv6", "gemm", "cublas"])
def test_a_bias_of_another_dtype_is_taken_on_every_path(tk, path):
    """An fp32 bias with bf16 activations (an fp32 layer under autocast): every path takes it (the
    dequantize + cuBLAS path raised a dtype error before session 30) and lands near the exact product."""
    _, gm = tk
    g = torch.Generator().manual_seed(11)
    w = nvfp4.quantize(torch.randn(40, 160, generator=g))
    x = torch.randn(3 if path != "gemv6" else 2, 160, generator=g).bfloat16()
    bias = torch.randn(40, generator=g)
    y = gm.linear_w4a16(x, w, bias, path=path)
    ref = x.float() @ w.dequantize(torch.float32).T + bias
    assert y.dtype == torch.bfloat16
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2


@interpreted
def test_operands_on_another_device_are_refused_with_the_devices_named(tk):
    """The kernels read every operand where x is: a weight or bias elsewhere (another GPU, the CPU under a
    CUDA x) is refused before any launch, naming both devices (here the meta device stands in)."""
    _, gm = tk
    w = nvfp4.quantize(torch.randn(32, 64))
    x = torch.randn(2, 64).bfloat16()
    elsewhere = nvfp4.NVFP4Tensor(w.packed.to("meta"), w.block_scale.to("meta"), w.global_enc.to("meta"), w.shape,
                                  w.dtype)
    with pytest.raises(ValueError, match="activations are on cpu, its weight on meta"):
        gm.linear_w4a16(x, elsewhere)
    with pytest.raises(ValueError, match="its bias on meta"):
        gm.linear_w4a4(x, w, 2.0, torch.zeros(32, device="meta"))
    with pytest.raises(ValueError, match="its weight on meta"):
        gm.linear_plan(x, elsewhere)


@interpreted
def test_a_bias_that_is_not_n_values_is_refused(tk):
    _, gm = tk
    w = nvfp4.quantize(torch.randn(32, 64))
    x = torch.randn(2, 64).bfloat16()
    for bad in (torch.zeros(31), torch.zeros(1), torch.zeros(2, 32)):
        with pytest.raises(ValueError, match="bias of shape"):
            gm.linear_w4a16(x, w, bad.bfloat16())
