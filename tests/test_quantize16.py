"""The 16-bit quantize kernel's inline PTX (fp4ptq/kernels/quantize_kernel.py) on CPU.

The kernel's element work is PTX on the GPU; the Triton interpreter runs its Triton twin instead
(tests/test_kernels.py checks that one against the reference). Here a small emulator executes the
PTX text itself (the dozen instructions it uses, bit for bit: packed 16-bit float compares, adds,
FMAs, maxes and products rounded like the hardware, ``prmt``) on every bf16 / fp16 pattern and
checks it against the reference rounding, and the kernel is compiled for the H200's sm_90. The
same PTX on the GPU: benchmarks/quant16_h200.py (results/quant16_h200.json).
"""
from __future__ import annotations

import re

import pytest
import torch

from fp4ptq import nvfp4

pytest.importorskip("triton")
from fp4ptq.kernels import quantize16 as q16  # noqa: E402
from fp4ptq.kernels import quantize_kernel as qk  # noqa: E402
from compile_target import compile_for  # noqa: E402
from ptx_emulator import _halves, _join, run_ptx  # noqa: E402

def _all_patterns(dtype):
    bits = torch.arange(65536, dtype=torch.int64)
    finite = torch.isfinite(torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(dtype).float())
    return bits[finite]


def _pairs(p: torch.Tensor) -> torch.Tensor:
    """Words of two patterns: (p[i], p[reversed i]) so both halves see every pattern."""
    return p | (p.flip(0) << 16)


def _thresholds(step: float, dtype) -> list[torch.Tensor]:
    """A table row's seven 16-bit thresholds for one step, found from the reference itself: the
    smallest non-negative 16-bit value whose E2M1 index of ``fl(x / step)`` reaches i + 1 (+inf
    when none does), duplicated in both halves of a word."""
    p = _all_patterns(dtype)
    p = p[p < 0x8000]  # non-negative, in increasing value
    vals = torch.where(p >= 32768, p - 65536, p).to(torch.int16).view(dtype).float()
    index = nvfp4.e2m1_code(vals / torch.tensor(step, dtype=torch.float32)).long() & 7
    inf = 0x7C00 if dtype == torch.float16 else 0x7F80
    out = []
    for i in range(7):
        reach = (index >= i + 1).nonzero()
        h = int(p[reach[0, 0]]) if reach.numel() else inf
        out.append(torch.tensor(h | (h << 16), dtype=torch.int64))
    return out


def _threshold_words(step: float, dtype, like: torch.Tensor) -> list[torch.Tensor]:
    """``_thresholds`` shaped like ``like``; step 0 stands for a zero scale (every threshold +inf)."""
    if step == 0.0:
        inf = 0x7C00 if dtype == torch.float16 else 0x7F80
        ts = [torch.tensor(inf | (inf << 16), dtype=torch.int64)] * 7
    else:
        ts = _thresholds(step, dtype)
    return [t.expand_as(like) for t in ts]


STEPS = [float(torch.tensor(s).float()) for s in (1.0, 0.3, 2.0 ** -20 * 1.7, 1.0 / 3.0, 448.0 / 2688.0, 6e-3, 1e-30, 2.0 ** -130)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("step", STEPS)
def test_count_ptx_rounds_every_pattern_like_the_reference(dtype, step):
    """count - base == the E2M1 index of fl(|x| / step), for every finite |x| of the format, and
    the magnitude PTX turns that count into the E2M1 value."""
    f16 = dtype == torch.float16
    p = _all_patterns(dtype) & 0x7FFF
    words = _pairs(p)
    counts = run_ptx(q16._count_asm(f16), words, *[t.expand_as(words) for t in _thresholds(step, dtype)])
    base = 0x6400 if f16 else 0x4300
    lo, hi = counts & 0xFFFF, counts >> 16
    assert torch.all((lo & ~7) == base) and torch.all((hi & ~7) == base)
    xs, _ = _halves(words, dtype)
    expect = nvfp4.e2m1_rne(xs.float() / torch.tensor(step, dtype=torch.float32))
    index = (lo & 7)
    assert torch.equal(nvfp4.e2m1_decode(index).float(), expect.float())
    mags = run_ptx(q16._value_asm(f16), counts)
    mlo, mhi = _halves(mags, dtype)
    assert torch.equal(mlo.float(), expect.float())
    assert torch.equal(mhi.float(), nvfp4.e2m1_decode(hi & 7).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("step", STEPS + [0.0])
def test_four_six_magnitude_words_are_the_reference_magnitudes(dtype, step):
    """Four Over Six's magnitude count (the seven compares summed with E2M1 step weights) gives per half
    the magnitude of fl(|x| / step) on every finite pattern, bit for bit ``_value_asm``'s word of the plain
    count; the kept candidate's index word from it is the plain count's word (what the pack reads).
    Step 0: a zero scale (every threshold +inf)."""
    f16 = dtype == torch.float16
    words = _pairs(_all_patterns(dtype) & 0x7FFF)
    w = run_ptx(q16._wcount_asm(f16), words, *_threshold_words(step, dtype, words))
    count = run_ptx(q16._count_asm(f16), words, *_threshold_words(step, dtype, words))
    assert torch.equal(w, run_ptx(q16._value_asm(f16), count))
    xs, xh = _halves(words, dtype)
    wlo, whi = _halves(w, dtype)
    if step == 0.0:
        assert torch.all(w == 0)
    else:
        div = torch.tensor(step, dtype=torch.float32)
        assert torch.equal(wlo, nvfp4.e2m1_rne(xs.float() / div).double())
        assert torch.equal(whi, nvfp4.e2m1_rne(xh.float() / div).double())
    assert torch.equal(run_ptx(q16._windex_asm(f16), w), count)


def test_four_six_index_words_cover_every_magnitude_pair():
    """``_windex_asm`` on all 64 pairs of magnitude words: the count word ``base + i`` in each half (the
    16-bit pattern of 128 + i in bf16, of 1024 + i in fp16)."""
    for dtype in (torch.bfloat16, torch.float16):
        f16 = dtype == torch.float16
        base = 0x6400 if f16 else 0x4300
        i = torch.arange(64)
        v = nvfp4.e2m1_decode(torch.arange(8, dtype=torch.uint8)).double()
        w = _join(v[i % 8], v[i // 8], dtype)
        got = run_ptx(q16._windex_asm(f16), w)
        assert torch.equal(got, (base + i % 8) | ((base + i // 8) << 16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("step", STEPS + [0.0])
def test_integer_count_ptx_equals_the_packed_compare_count(dtype, step):
    """The integer-compare count (bf16 below sm_90) gives the packed float compares' count word on
    every non-negative pattern: every finite one, +inf, and every NaN (0, as the float compare is false
    there); step 0 stands for a zero scale (every threshold +inf)."""
    f16 = dtype == torch.float16
    words = _pairs(torch.arange(0x8000, dtype=torch.int64))  # every pattern with the sign clear: inf and NaNs too
    ts = _threshold_words(step, dtype, words)
    got = run_ptx(q16._count_int_asm(f16), words, *ts)
    expect = run_ptx(q16._count_asm(f16), words, *ts)
    assert torch.equal(got, expect)
    nan = torch.isnan(_halves(words, dtype)[0])
    assert nan.any() and torch.all((got[nan] & 7) == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_max8_ptx_is_the_block_max_pattern(dtype):
    g = torch.Generator().manual_seed(0)
    p = _all_patterns(dtype) & 0x7FFF
    words = p[torch.randint(0, p.numel(), (4096, 16), generator=g)]
    packed = words[:, 0::2] | (words[:, 1::2] << 16)
    got = run_ptx(q16._max8_asm(dtype == torch.float16), *packed.unbind(1))
    assert torch.equal(got, words.max(1).values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pack_ptx_puts_code_e_at_bits_4e_with_the_sign(dtype):
    g = torch.Generator().manual_seed(1)
    base = 0x6400 if dtype == torch.float16 else 0x4300
    idx = torch.randint(0, 8, (512, 8), generator=g)
    sign = torch.randint(0, 2, (512, 8), generator=g)
    mag = torch.randint(0, 0x7C00, (512, 8), generator=g)
    x = (sign << 15) | mag
    counts = (base + idx[:, 0::2]) | ((base + idx[:, 1::2]) << 16)
    xw = x[:, 0::2] | (x[:, 1::2] << 16)
    got = run_ptx(q16._PACK_ASM, *counts.unbind(1), *xw.unbind(1))
    code = idx | (sign << 3)
    expect = sum(code[:, e] << (4 * e) for e in range(8))
    assert torch.equal(got, expect)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_ptx_is_the_signed_code_times_the_scale_exactly(dtype):
    f16 = dtype == torch.float16
    codes = torch.arange(16)
    v = nvfp4.e2m1_decode(codes).abs()
    mag = _join(v[0::2].double(), v[1::2].double(), dtype)
    sign_src = _join(torch.where(codes[0::2] >= 8, -1.0, 1.0).double(),
                     torch.where(codes[1::2] >= 8, -1.0, 1.0).double(), dtype)
    e4m3 = torch.arange(1, 127, dtype=torch.int64).to(torch.uint8).view(torch.float8_e4m3fn).double()
    for s in e4m3:
        s2 = _join(s.reshape(1), s.reshape(1), dtype).expand_as(mag)
        got = run_ptx(q16._scaled_asm(f16), mag, s2, sign_src)
        lo, hi = _halves(got, dtype)
        expect = nvfp4.e2m1_decode(codes).double() * s
        assert torch.equal(lo, expect[0::2]) and torch.equal(hi, expect[1::2])


@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("four_six", [0, 1])
@pytest.mark.parametrize("table", [True, False])
def test_kernel_compiles_for_sm90_to_packed_half_instructions(f16, four_six, table):
    """The 16-bit kernel builds for sm_90 with the packed compares and adds, vectorized loads and
    no local memory; without the table, no table loads (only the input's 16-byte loads)."""
    ce = dict(F16=f16, FOUR_SIX=four_six, EMIT_PACKED=True, EMIT_SCALED=False, ASM=True, BLOCK_M=4, BLOCKS_K=64,
              TABLE=table, WORD_MAJOR=table and not four_six)
    types = {"x_ptr": "*i32", "amax_ptr": "*fp32", "table_ptr": "*i32", "enc_ptr": "*fp32", "packed_ptr": "*i32",
             "scale_ptr": "*u8", "chose_ptr": "*i8", "scaled_ptr": "*i32"}
    k = compile_for(qk._quantize16_kernel, types, ce, divisible=("K", "stride_xw", "stride_sw"), num_warps=4,
                    enable_fp_fusion=False)
    ptx = k.asm["ptx"]
    ty = "f16x2" if f16 else "bf16x2"
    # 2 blocks a thread; the per-block bf16 kernel holds its tile twice (fast fp64 rounding, and the
    # table's arithmetic for global scales of 2^112 and more)
    copies = 2 if not table and not f16 else 1
    assert len(re.findall(rf"set\.ge\.{ty}\.{ty}", ptx)) == 7 * 8 * (2 if four_six else 1) * 2 * copies
    assert "ld.global.v4.b32" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    scalar_loads = len(re.findall(r"ld\.global(?:\.[a-z]+)*\.b32 ", ptx))
    assert (scalar_loads > 1) == table  # table rows; the amax is the one scalar load of both
    # the table prologue stores whole lines: 16-byte vectors, no scalar stores but the global scale's
    assert (len(re.findall(r"st\.global\.v4\.b32", ptx)) >= 4) == table
    assert len(re.findall(r"st\.global\.b32 ", ptx)) == 1


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("four_six", [0, 1])
def test_integer_count_build_has_no_sm90_only_bf16_instructions(arch, four_six):
    """bf16 with integer compares (``ASM`` 2) builds for sm_80 and sm_90 with no packed bf16 ``set``,
    ``add`` or ``mul`` (sm_90 PTX), codes and the scaled W4A4 operand alike, without local memory."""
    types = {"x_ptr": "*i32", "amax_ptr": "*fp32", "table_ptr": "*i32", "enc_ptr": "*fp32", "packed_ptr": "*i32",
             "scale_ptr": "*u8", "chose_ptr": "*i8", "scaled_ptr": "*i32"}
    for table in (False, True):
        ce = dict(F16=False, FOUR_SIX=four_six, EMIT_PACKED=True, EMIT_SCALED=True, ASM=2, BLOCK_M=1, BLOCKS_K=128,
                  TABLE=table, WORD_MAJOR=False)
        ptx = compile_for(qk._quantize16_kernel, types, ce, arch=arch, divisible=("K", "stride_xw", "stride_sw"),
                          num_warps=4, enable_fp_fusion=False).asm["ptx"]
        assert not re.search(r"(set\.ge|add\.rn|mul\.rn)\.bf16x2", ptx)
        assert "lop3.b32" in ptx and "fma.rn.bf16x2" in ptx
        assert "ld.local" not in ptx and "st.local" not in ptx


def test_the_16_bit_kernel_runs_only_where_its_ptx_does(monkeypatch):
    """sm_80 and later (max / fma on bf16x2 and f16x2), bf16 counting with integer compares below sm_90
    (packed bf16 set / add are sm_90 PTX); never on ROCm or the CPU outside the interpreter; the
    fp32-compare kernel takes those inputs instead."""
    monkeypatch.setattr(qk, "INTERPRET", False)
    cuda = torch.device("cuda", 0)
    caps = {"cap": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: caps["cap"])
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert qk.quant16_supported(cuda, torch.bfloat16) and qk.quant16_supported(cuda, torch.float16)
    assert qk._asm_kind(cuda, torch.bfloat16) == 1 and qk._asm_kind(cuda, torch.float16) == 1
    for cap in ((8, 0), (8, 6), (8, 9)):
        caps["cap"] = cap
        assert qk.quant16_supported(cuda, torch.bfloat16) and qk.quant16_supported(cuda, torch.float16)
        assert qk._asm_kind(cuda, torch.bfloat16) == 2 and qk._asm_kind(cuda, torch.float16) == 1
    caps["cap"] = (7, 5)
    assert not qk.quant16_supported(cuda, torch.float16) and not qk.quant16_supported(cuda, torch.bfloat16)
    caps["cap"] = (10, 0)
    assert qk.quant16_supported(cuda, torch.bfloat16) and qk._asm_kind(cuda, torch.bfloat16) == 1
    monkeypatch.setattr(qk, "INTERPRET", True)
    assert qk._asm_kind(cuda, torch.bfloat16) == 0
    monkeypatch.setattr(qk, "INTERPRET", False)
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert not qk.quant16_supported(cuda, torch.bfloat16)
    assert not qk.quant16_supported(torch.device("cpu"), torch.bfloat16)


def test_table_rule_follows_the_h200_measurements():
    """Codes take the per-program table from 32768 tiles (64M elements) on, from 8192 under Four Over
    Six, the scaled W4A4 operand never."""
    assert not qk._use_table(16384, "packed") and not qk._use_table(32767, "packed")
    assert qk._use_table(32768, "packed") and qk._use_table(1 << 20, "packed")
    assert not qk._use_table(1 << 20, "scaled")
    assert qk._use_table(8192, "packed", "mse") and not qk._use_table(8191, "packed", "mae")
    assert not qk._use_table(1 << 20, "scaled", "mse")


def test_table_layout_rule():
    """Word-major for the standard codes, row-major under Four Over Six (the H200's faster of each)."""
    assert qk._word_major(None) and not qk._word_major("mse") and not qk._word_major("max")


def test_one_or_two_rows_take_the_fp32_compare_kernel(monkeypatch):
    """Decode-sized activations (1-2 rows, where the H200 measured the fp32-compare kernel level or
    ahead) take it; 3 rows and more the 16-bit kernel, which picks the table for large codes only."""
    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((self.name, kwargs.get("TABLE"), kwargs.get("WORD_MAJOR")))

    monkeypatch.setattr(qk, "_quantize16_kernel", Recorder("16-bit"))
    monkeypatch.setattr(qk, "_quantize_kernel", Recorder("fp32"))
    monkeypatch.setattr(qk, "quant16_supported", lambda device, dtype: True)
    amax = torch.tensor(1.0)
    for rows in (1, 2, 3, 16):
        qk.launch_quantize(torch.zeros(rows, 4096, dtype=torch.bfloat16), amax)
    qk.launch_quantize(torch.zeros(8, 4096, dtype=torch.float32), amax)
    monkeypatch.setattr(qk, "_programs", lambda device, n_tiles, *rule: 1)  # no tables of a million programs
    qk.launch_quantize(torch.zeros(2048, 4096 * 8, dtype=torch.bfloat16), amax)  # 64M elements of codes
    qk.launch_quantize(torch.zeros(2048, 4096 * 8, dtype=torch.bfloat16), amax, emit="scaled")
    qk.launch_quantize(torch.zeros(2048, 4096 * 8, dtype=torch.bfloat16), amax, "mse")
    assert launched == [("fp32", None, None), ("fp32", None, None), ("16-bit", False, False), ("16-bit", False, False),
                        ("fp32", None, None), ("16-bit", True, True), ("16-bit", False, False), ("16-bit", True, False)]
