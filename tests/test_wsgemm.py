"""The warp-specialized Gluon GEMM (fp4ptq/kernels/wsgemm.py) on CPU.

Gluon kernels do not run under the Triton interpreter, so here: the decoder's PTX (a word of 8 codes
-> four 16-bit-float pairs in natural K order, times the scale) is executed by the PTX emulator and
checked against the reference decode for every code under normal, subnormal and extreme scales; the
kernel is compiled for sm_90 (TMA, mbarriers, wgmma, register reallocation between the partitions, no
global loads in the main loop); the shape rule and the dispatch guard are checked. Its numerics and
speed on the GPU: benchmarks/wsgemm_h200.py (results/wsgemm_h200_v4.json, wsgemm_h200_rule.json).
"""
from __future__ import annotations

import gc
import re

import pytest
import torch

from fp4ptq import nvfp4

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")
ws = pytest.importorskip("fp4ptq.kernels.wsgemm")
from fp4ptq.kernels import _gluon, gemm  # noqa: E402
from compile_target import compile_for  # noqa: E402
from ptx_emulator import (_halves, assert_same_registers, multiply_decode_inputs,  # noqa: E402
                          run_ptx_regs, sample_words_and_scales)
from fp4ptq.kernels import dispatch as dp  # noqa: E402


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_decoder_ptx_gives_codes_times_scale_in_natural_order(fmt):
    """Output register q holds codes (2q, 2q + 1) of the word as ``v * scale * 2^-26`` (bf16) or
    ``v * scale * 2^-14`` (fp16), exactly: the order of the activations' K, which come by TMA."""
    asm, dtype, s_pow, out_pow = {
        "bf16": (ws._DECODE_MUL.value, torch.bfloat16, 2.0**100, 2.0**-26),
        "fp16": (ws._DECODE_F16.value, torch.float16, 1.0, 2.0**-14)}[fmt]
    words, ref, scale = sample_words_and_scales()
    s16 = (scale * s_pow).to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    pair = s16 | (s16 << 16)
    regs = run_ptx_regs(asm, {**{f"${4 + i}": words for i in range(8)}, **{f"${12 + i}": pair for i in range(4)}})
    for q in range(4):
        lo, hi = _halves(regs[f"${q}"], dtype)
        assert torch.equal(lo, ref[:, 2 * q] * scale * out_pow), q
        assert torch.equal(hi, ref[:, 2 * q + 1] * scale * out_pow), q


def test_multiply_decoder_ptx_gives_the_shift_decoders_bits():
    """_DECODE_MUL (the decoder with the multiply decode) writes the same four natural-order pairs as
    the shift decoder (``decode_asm()``) for every pair of codes a register decodes."""
    inputs = multiply_decode_inputs(seed=4)
    assert_same_registers(ws.decode_asm(), ws._DECODE_MUL.value, inputs)
    text = ws._DECODE_MUL.value
    assert text.count("mul.lo.u32") == 4 and text.count("prmt.b32") == 4 and text.count("mul.rn.bf16x2") == 4


def test_decoder_ptx_is_mmas_shifts_plus_four_prmt():
    text = ws.decode_asm()
    assert text.count("mul.rn.bf16x2") == 4 and text.count("prmt.b32") == 4
    for p, (mag, _sign) in enumerate(_gluon.DECODE_SHIFTS):
        assert (f"shl.b32 a, $4, {mag};" if mag > 0 else f"shr.u32 a, $4, {-mag};") in text


def _compile(cfg=ws.DEFAULT_CONFIG, dt="bf16", bias=False, xenc=False, summers=False, swap=False):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    bm, bn, bk, xs, bs, dw, dr, maxnreg = cfg
    tdt, gdt = {"bf16": (torch.bfloat16, gl.bfloat16), "fp16": (torch.float16, gl.float16)}[dt]
    x_d = TensorDescriptor.from_tensor(torch.empty(1024, 4096, dtype=tdt), [bm, bk],
                                       gl.NVMMASharedLayout.get_default_for([bm, bk], gdt))
    w_d = TensorDescriptor.from_tensor(torch.empty(4096, 512, dtype=torch.int32), [bn, bk // 8],
                                       gl.NVMMASharedLayout.get_default_for([bn, bk // 8], gl.int32))
    s_d = TensorDescriptor.from_tensor(torch.empty(4096, 256, dtype=torch.uint8), [bn, 16],
                                       gl.NVMMASharedLayout.get_default_for([bn, 16], gl.uint8))
    warps = ws.consumer_warps(bm, bn)
    ce = dict(HAS_BIAS=bias, HAS_XENC=xenc, BM=bm, BN=bn, BK=bk, XSTAGES=xs, BSTAGES=bs, WARPS=warps,
              DEC_WARPS=dw, DEC_REGS=dr, SUM_SPLITS=2 if summers else 0, SWAP=swap)
    types = {"x_desc": mangle_type(x_d), "w_desc": mangle_type(w_d), "s_desc": mangle_type(s_d),
             "wenc_ptr": "*fp32", "xenc_ptr": "*fp32", "bias_ptr": f"*{dt}", "y_ptr": f"*{dt}", "part_ptr": "*fp32",
             "count_ptr": "*i32", "sum_ptr": "*i32"}
    return compile_for(ws._ws_kernel, types, ce, gluon=True, divisible=("N", "stride_ym", "n0"),
                       num_warps=warps, maxnreg=maxnreg)


@pytest.mark.parametrize("cfg,swap", [(ws.DEFAULT_CONFIG, True), (ws.SMALL_M_CONFIG, False), (ws.WIDE_M_CONFIG, False)])
def test_multiply_decoder_build_compiles_for_sm90(cfg, swap):
    """The decoder with the multiply decode (bf16) builds for sm_90 on the 256-, 128- and wide
    tiles: the multiply and its mask in place of the shifts, no local memory."""
    ptx = _compile(cfg, "bf16", swap=swap).asm["ptx"]
    assert "mul.lo.u32 a, a, 0x1040" in ptx and "and.b32 a, a, 0x81c081c0" in ptx and "or.b32 a, a, b" not in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("cfg,dt,bias,xenc", [
    (ws.DEFAULT_CONFIG, "bf16", False, False),
    (ws.DEFAULT_CONFIG, "fp16", True, True),
    ((128, 256, 64, 5, 2, 4, 128, 168), "bf16", True, False),
    (ws.SMALL_M_CONFIG, "bf16", True, True),
    (ws.TINY_M_CONFIG, "fp16", False, False),
    (ws.WIDE_M_CONFIG, "bf16", True, True),  # 256 weight rows at M = 65..128 (m64n256k16 on the decoded tile)
    ((128, 128, 64, 4, 2, 8, 80, 128), "bf16", False, False),  # 8 decoder warps: two threads a row
    ((128, 64, 64, 4, 2, 4, 96, 128), "bf16", True, False),  # 64 weight rows: one consumer warpgroup
])
def test_kernel_compiles_for_sm90_warp_specialized(cfg, dt, bias, xenc):
    """TMA copies completing on mbarriers, asynchronous wgmma from two shared-memory operands,
    registers moved from the decoder to the consumers (setmaxnreg), no local memory, and no global
    load in the K loop: the decoder's scale bytes come by TMA, so the proxy fence (MEMBAR) never waits
    on one (run v2: a global load in flight at every fence cost 10-20%)."""
    compiled = _compile(cfg, dt, bias, xenc)
    assert compiled.metadata.shared <= 227 * 1024  # what an H100 / H200 block may hold
    ptx = compiled.asm["ptx"]
    ty = "f16" if dt == "fp16" else "bf16"
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg[1]}k16\.f32\.{ty}\.{ty}", ptx)
    assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier.try_wait" in ptx
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    # the output in 16-byte stores (the accumulator layout alone gives 4-byte ones), the split tiles'
    # fp32 partial sums in 8-byte pairs
    assert "st.global.v4" in ptx and "st.global.v2.b32" in ptx and not re.search(r"st\.global\.b(16|32)", ptx)
    # the only global loads: the global scale(s) and the 16-bit bias, in the epilogue
    loads = [line for line in ptx.splitlines() if "ld.global" in line]
    assert len([line for line in loads if ".b16" not in line]) <= 1 + int(xenc), loads
    assert bias or len(loads) <= 1 + int(xenc)


def test_kernel_compiles_with_the_split_tiles_summed_in_the_launch():
    """The summing build: each part counts itself done after a barrier of the consumer partition with one
    release add at GPU scope; a summing program polls with acquire loads, reads the partials from L2
    (``.cg``) 16 bytes at a time, resets the counter; no local memory."""
    compiled = _compile(ws.DEFAULT_CONFIG, "bf16", True, False, summers=True)
    ptx = compiled.asm["ptx"]
    assert "red.global.gpu.release.add" in ptx and re.search(r"bar\.sync\s+0, 256;", ptx)
    assert "ld.global.gpu.acquire" in ptx and "atom.global.gpu.relaxed.exch" in ptx
    assert "ld.global.cg.v4" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert compiled.metadata.shared <= 227 * 1024


def test_shape_rule_follows_the_measured_rows():
    """results/wsgemm_h200_rule.json and wsgemm_h200_split.json: ahead of (or level with) dequantize +
    cuBLAS where whole tiles fill 80% of the SMs or the plan splits the last wave, from M = 129 to 1024;
    W4A4 also at M = 1536..8192 where K <= 4096 and to 2048 where K is longer."""
    assert ws.preferred(1024, 28672, 4096) and ws.preferred(1024, 4096, 4096)  # 896 / 128 tiles
    assert ws.preferred(1024, 4096, 14336) and ws.preferred(1024, 57344, 8192) and ws.preferred(1024, 8192, 28672)
    # 8B qkv at M = 1024: 192 tiles; the last 60 in 2 K ranges (96.2 us against 99.0 and whole tiles' 109.2)
    assert ws.preferred(1024, 6144, 4096) and ws.plan(1024, 6144, 4096)[:4] == (132, 2, 32, 33)
    # 8B down at M = 256: 32 tiles in 4 K ranges, 59.8 us against 98.2 (whole tiles 171.8)
    assert ws.preferred(256, 4096, 14336) and ws.plan(256, 4096, 14336)[1] == 4
    assert ws.preferred(512, 28672, 4096) and ws.preferred(512, 8192, 28672)
    # whole tiles filling 0.73 and no split that pays for its summing: behind (8B o / down at 768)
    assert ws.plan(768, 4096, 4096)[1] == 1 and not ws.preferred(768, 4096, 4096)
    assert not ws.preferred(768, 4096, 14336)
    assert ws.preferred(256, 28672, 4096) and ws.preferred(129, 57344, 8192)
    assert not ws.preferred(2048, 28672, 4096)  # W4A16 behind from M = 1536 on most layers
    assert ws.preferred(2048, 28672, 4096, w4a4=True) and ws.preferred(8192, 4096, 4096, w4a4=True)
    assert ws.preferred(2048, 8192, 28672, w4a4=True) and not ws.preferred(4096, 8192, 28672, w4a4=True)
    assert not ws.preferred(16384, 4096, 4096, w4a4=True)
    # M = 33..128 with the small tiles (wsgemm_small_m_h200.json): every measured layer, whole tiles or split
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)):
        assert ws.preferred(128, n, k) and ws.preferred(64, n, k) and ws.preferred(33, n, k)
    assert not ws.preferred(32, 28672, 4096)  # mma.py's 32-row tile, not timed against these
    # narrower than the measured layers (k / v of Llama-3.1-8B, 1024 rows): mma.py / wgmma.py keep them
    assert not ws.preferred(64, 1024, 4096) and not ws.preferred(128, 2048, 4096) and ws.preferred(129, 1024, 4096)
    # M = 65..128 from 3072 rows and K = 3072 at any fill (wsgemm_narrow_h200.json: ahead of wgmma.py on every
    # such layer measured: Qwen2-7B qkv / o / down, Gemma-2-9B o / down, Phi-3-mini qkv / o / down, Llama-2-7B qkv)
    for n, k in ((4608, 3584), (3584, 3584), (3584, 18944), (3584, 4096), (3584, 14336), (9216, 3072),
                 (3072, 3072), (3072, 8192), (12288, 4096)):
        assert ws.preferred(65, n, k) and ws.preferred(128, n, k, w4a4=True)
        if n < ws.MIN_N_SMALL_M:  # M = 33..64 (the 64-row tile) keeps its rule: mma.py there
            assert not ws.preferred(64, n, k)
    assert ws.preferred(128, 8192, 29568)  # Qwen2-72B down: K % 256 != 0, its scale rows padded (tma_scales)
    assert not ws.preferred(128, 3072, 2048) and not ws.preferred(128, 2560, 4096)  # below the measured N / K
    # M = 129..256 from 3584 rows and K = 3584 whatever the plan (wsgemm_mid_m_h200.json: ahead of dequantize +
    # cuBLAS on Qwen2-72B qkv at 256, whose whole tiles fill 0.61, and Qwen2-7B qkv / o at 192 / 256)
    assert ws.plan(256, 10240, 8192)[1] == 1 and ws.preferred(256, 10240, 8192)
    for n, k in ((4608, 3584), (3584, 3584)):
        assert ws.preferred(129, n, k) and ws.preferred(256, n, k, w4a4=True) and not ws.preferred(384, n, k)
    assert not ws.preferred(256, 3072, 3072)  # Phi-3-mini o: behind dequantize + cuBLAS there
    # ... and from MIN_N_WIDE rows at K >= MIN_K_WIDE (wsgemm_phi_gemma_h200.json: Phi-3-mini qkv, whose plan fills
    # 0.55, 16-22% ahead of dequantize + cuBLAS at M = 160..256)
    assert ws.preferred(129, 9216, 3072) and ws.preferred(256, 9216, 3072, w4a4=True)
    assert not ws.preferred(192, 4096, 3072) and not ws.preferred(192, 9216, 2048)  # narrower / shorter: as before
    assert not ws.preferred(1024, 28672, 4112) and not ws.supports(128, 4096, 4112)  # K % 64 (whole K steps)
    assert not ws.preferred(1024, 28672, 2048) and ws.supports(1024, 28672, 2048)  # below the measured K
    # K = 3072 / 3584 on wide layers only (wsgemm_h200_shortk.json)
    assert ws.preferred(256, 37888, 3584) and ws.preferred(1024, 8192, 3584) and ws.preferred(1024, 16384, 3072)
    assert not ws.preferred(1024, 4608, 3584) and not ws.preferred(256, 3072, 3072)
    # whole tiles: the plan's fill is the wave fill (8B gate_up: 896 tiles in 7 waves of 132)
    assert ws.plan(1024, 28672, 4096)[4] == pytest.approx(896 / 924)
    assert ws.plan(1024, 4096, 4096, sms=128)[:2] == (128, 1) and ws.plan(1024, 4096, 4096, sms=128)[4] == 1.0


def _programs(m, n, k, sms, parts_first=False):
    """The kernel's program -> (tile, first K step, steps) map, as ``_ws_kernel``'s ``_item`` computes
    it: whole tiles then split parts, or (``parts_first``, where ``summing_plan`` sums in the launch)
    the parts first."""
    cfg = ws.config(m, n, k, sms)
    full, splits, chunk, nt0, _ = ws.plan(m, n, k, sms, cfg)
    bm, bn, bk = cfg[:3]
    tiles, steps = -(-m // bm) * -(-n // bn), k // bk
    n_parts = (tiles - full) * splits if splits > 1 else 0
    out = []
    for pid in range(full + (tiles - full) * splits):
        if parts_first:
            is_part = pid < n_parts
            t, part = (full + pid // splits, pid % splits) if is_part else (pid - n_parts, 0)
        else:
            is_part = pid >= full
            t, part = (pid, 0) if not is_part else (full + (pid - full) // splits, (pid - full) % splits)
        k0 = part * chunk
        out.append((t, k0, min(steps - k0, chunk if is_part else steps)))
    return out, (full, splits, chunk, nt0), tiles, steps


@pytest.mark.parametrize("m,n,k,sms", [(1024, 6144, 4096, 132), (256, 4096, 14336, 132), (300, 520, 4096, 132),
                                       (768, 6144, 4096, 132), (1000, 6100, 4096, 132), (129, 57344, 8192, 132),
                                       (4100, 6144, 4096, 132), (1024, 6144, 4096, 114), (700, 3000, 5120, 78),
                                       (128, 6144, 4096, 132), (100, 57344, 8192, 132), (64, 4096, 14336, 132),
                                       (40, 28672, 4096, 132), (33, 1000, 2048, 78)])
@pytest.mark.parametrize("parts_first", [False, True])
def test_plan_covers_every_tile_and_k_step_once(m, n, k, sms, parts_first):
    """Every (tile, K step) is computed by exactly one program; split K ranges are whole scale groups
    (256 K) of at least MIN_PART_STEPS steps; the split tiles are whole weight-tile columns from nt0 on
    (the partial-sum workspace is [splits, M, N - nt0 * BN]), placed after the whole tiles."""
    progs, (full, splits, chunk, nt0), tiles, steps = _programs(m, n, k, sms, parts_first)
    num_m = -(-m // ws.config(m, n, k, sms)[0])
    covered = {}
    for t, k0, ks in progs:
        assert ks >= 1 and 0 <= k0 and k0 + ks <= steps
        for j in range(k0, k0 + ks):
            assert (t, j) not in covered
            covered[(t, j)] = True
    assert len(covered) == tiles * steps
    assert full == nt0 * num_m or splits == 1
    if splits > 1:
        assert chunk % 4 == 0 and chunk >= ws.MIN_PART_STEPS and -(-steps // chunk) == splits
        whole, parts = (progs[-full:], progs[:-full]) if parts_first and full else (progs[:full], progs[full:])
        assert all(t >= full for t, k0, ks in parts) and all(ks == steps and t < full for t, _, ks in whole)
    summing = ws.summing_plan(m, n, k, sms, ws.config(m, n, k, sms))
    if summing is not None:  # every summing program a whole tile after all parts, each index once
        n_parts, table, summers = summing
        assert splits > 1 and full > 0 and n_parts == (tiles - full) * splits and len(table) == len(progs)
        assert sorted(j for j in table if j >= 0) == list(range(summers)) and summers <= tiles - full
        assert all(i >= n_parts for i, j in enumerate(table) if j >= 0)


def test_summing_plan_names_the_whole_tiles_that_end_early():
    """8B qkv at M = 1024: 120 half-tile parts first, then 132 whole tiles; the 12 that start with the
    parts end half a tile early and sum the 60 split tiles (5 each). M = 768: 48 quarter-tile parts,
    84 whole tiles start with them, 12 of which sum the 12 split tiles (no more programs than tiles). No summing in the launch where every tile is
    split, nothing is split, or the idle time does not cover the reads (the summing launch then)."""
    n_parts, table, summers = ws.summing_plan(1024, 6144, 4096)
    assert (n_parts, summers) == (120, 12) and len(table) == 252
    assert [i for i, j in enumerate(table) if j >= 0] == list(range(120, 132))
    assert sorted(j for j in table if j >= 0) == list(range(12))
    n_parts, table, summers = ws.summing_plan(768, 6144, 4096)
    assert (n_parts, summers) == (48, 12) and min(i for i, j in enumerate(table) if j >= 0) >= n_parts
    assert ws.summing_plan(256, 4096, 14336) is None  # 32 tiles, all split 4 ways
    assert ws.summing_plan(1024, 28672, 4096) is None  # whole waves
    ws.summing_plan.cache_clear()
    try:
        ws.SUMMER_BYTES_A_STEP, saved = 1e3, ws.SUMMER_BYTES_A_STEP  # summing would take longer than the idle
        assert ws.summing_plan(1024, 6144, 4096) is None
    finally:
        ws.SUMMER_BYTES_A_STEP = saved
        ws.summing_plan.cache_clear()


def test_summing_counters_are_zero_once_and_never_new_inside_a_capture(monkeypatch):
    """A launch plan gets counters no other plan has; one-off calls share the device's; the table of
    summing programs is copied once. Inside a CUDA graph capture nothing new is made (its zeros would be
    written only when the graph runs): the caller takes the summing launch instead."""
    dev = torch.device("cpu")
    table = (-1, 0, 1)
    monkeypatch.setattr(ws, "_COUNTERS", {})
    monkeypatch.setattr(ws, "_SHARED", {})
    monkeypatch.setattr(ws, "_TABLES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    a, ta = ws._summing_state(dev, 60, table, own=True)
    b, tb = ws._summing_state(dev, 60, table, own=True)
    assert a.shape == b.shape == (60,) and int(a.abs().sum()) == int(b.abs().sum()) == 0
    assert a.data_ptr() + 60 * 4 <= b.data_ptr() and ta is tb and ta.tolist() == list(table)
    c, _ = ws._summing_state(dev, 60, table, own=False)
    d, _ = ws._summing_state(dev, 40, table, own=False)
    assert c.data_ptr() == d.data_ptr() and c.data_ptr() not in (a.data_ptr(), b.data_ptr())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert ws._summing_state(dev, 60, (0, -1), own=False) is None  # a new table
    assert ws._summing_state(dev, 10 ** 5, table, own=False) is None  # more shared counters
    assert ws._summing_state(dev, 1 << 14, table, own=True) is None  # a new slice of counters
    assert ws._summing_state(dev, 60, table, own=False)[0].data_ptr() == c.data_ptr()  # what exists


def test_plan_splits_only_where_the_model_saves_time():
    """Full waves stay whole (8B gate_up at M = 1024: 896 tiles, 0.97 fill); a split must beat whole
    tiles by MIN_SPLIT_GAIN in the model, summing included; fewer SMs change the plan."""
    assert ws.plan(1024, 28672, 4096)[1] == 1 and ws.plan(1024, 4096, 4096)[1] == 1
    assert ws.plan(1024, 6144, 4096, 192)[1] == 1  # 192 tiles on 192 SMs: one full wave
    whole = ws._span(192, 192, 1, 64, 64, 132, ws.PROGRAM_STEPS)
    split = ws._span(192, 132, 2, 32, 64, 132, ws.PROGRAM_STEPS)
    assert whole == 2 * (64 + ws.PROGRAM_STEPS) and split == (64 + ws.PROGRAM_STEPS) + (32 + ws.PROGRAM_STEPS)


def test_config_picks_the_tile_by_m():
    """64 rows (one consumer warpgroup) to M = 64, 128 rows to 128, 256 above (wsgemm_small_m_h200.json);
    every tile fits, and the 64-row one leaves room for two CTAs an SM (shared memory and registers)."""
    assert ws.config(33, 4096, 4096) == ws.config(64, 4096, 4096) == ws.TINY_M_CONFIG
    assert ws.config(65, 4096, 4096) == ws.config(128, 4096, 4096) == ws.SMALL_M_CONFIG
    assert ws.config(129, 4096, 4096) == ws.config(1024, 4096, 4096) == ws.DEFAULT_CONFIG
    for cfg in (ws.TINY_M_CONFIG, ws.SMALL_M_CONFIG, ws.DEFAULT_CONFIG):
        assert ws.check_config(cfg) is None
    bm, bn, bk, xs, bs, dec_warps, _, maxnreg = ws.TINY_M_CONFIG
    assert ws.consumer_warps(bm, bn) == ws.consumer_warps(128, 64) == 4
    assert ws.consumer_warps(128, 128) == ws.consumer_warps(256, 128) == 8
    assert 2 * (ws.consumer_warps(bm, bn) + dec_warps) * 32 * maxnreg <= 65536
    assert 2 * (xs * (bm * bk * 2 + bn * bk // 2) + bs * bn * bk * 2 + 2 * bn * 16) <= 228 * 1024


@pytest.mark.parametrize("dt,bias,xenc,summers", [("bf16", True, False, False), ("fp16", False, True, False),
                                                  ("bf16", True, False, True)])
def test_swapped_operands_compile_to_one_wide_mma_a_k16(dt, bias, xenc, summers):
    """The swapped build: the decoded weight tile is wgmma's A operand and the activation tile its B, so
    each warpgroup issues one m64n256k16 a k16 (against two m64n128k16 unswapped), with the same rings,
    partitions and register moves; the output still leaves in 16-byte stores (the transposed tile
    re-laid out), the split tiles' fp32 partials from the accumulator layout (whole 32-byte sectors a
    store); no local memory and no global load in the K loop."""
    compiled = _compile(ws.DEFAULT_CONFIG, dt, bias, xenc, summers=summers, swap=True)
    ptx = compiled.asm["ptx"]
    ty = "f16" if dt == "fp16" else "bf16"
    assert re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx) == ["m64n256k16"] * 4
    assert re.search(rf"m64n256k16\.f32\.{ty}\.{ty}", ptx)
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx and "cp.async.bulk.tensor.2d" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "st.global.v4" in ptx and not re.search(r"st\.global\.b16", ptx)
    loads = [line for line in ptx.splitlines() if "ld.global" in line and ".cg" not in line and "acquire" not in line]
    # the global scale(s), and in the summing build the program's summing index
    assert len([line for line in loads if ".b16" not in line]) <= 1 + int(xenc) + int(summers), loads
    assert compiled.metadata.shared <= 227 * 1024
    plain = _compile(ws.DEFAULT_CONFIG, dt, bias, xenc, summers=summers).asm["ptx"]
    assert re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", plain) == ["m64n128k16"] * 8


def test_swap_rule_and_refusal():
    """Swapped only where the tile has more activation rows than weight rows (256 x 128); a swapped tile
    needs 16 weight rows a consumer warp, refused with the reason otherwise."""
    assert ws.swapped(ws.DEFAULT_CONFIG)
    assert not ws.swapped(ws.SMALL_M_CONFIG) and not ws.swapped(ws.TINY_M_CONFIG)
    x = torch.empty(256, 4096, dtype=torch.bfloat16)
    words = torch.empty(4096, 512, dtype=torch.int32)
    sbits = torch.empty(4096, 256, dtype=torch.uint8)
    y = torch.empty(256, 4096, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16 a consumer warp"):
        ws.launches(x, words, sbits, torch.ones(1), None, None, y, cfg=(256, 64, 64, 4, 2, 4, 128, 168), swap=True)


def test_wide_tile_at_small_m_only_where_its_span_is_shorter(monkeypatch):
    """M = 65..128: 256 weight rows a tile where its plan's span at WIDE_STEP_COST a step is under
    WIDE_GAIN of the 128 x 128 tile's (the gate_up layers, 70B down: 10-20% faster on the H200; Qwen2-7B
    gate_up 12%; Qwen2-72B / 70B qkv 19-20%, 70B o 8-17%, Phi-3-mini qkv 11-16%), the 128 x 128 tile
    elsewhere (8B o / down lost 35-50% with it, the narrow layers of other models 37-46%; 8B qkv, Llama-2-7B
    qkv / gate_up level above M = 80; results/wsgemm_n256_h200.json, wsgemm_dec8_small_h200.json,
    wsgemm_narrow_h200.json, wsgemm_wide_rule_h200.json); never swapped; off by the knob."""
    assert ws.check_config(ws.WIDE_M_CONFIG) is None and not ws.swapped(ws.WIDE_M_CONFIG)
    for m in (65, 96, 128):
        # gate_up layers, 70B down; Qwen2-72B / 70B qkv and 70B o (wsgemm_wide_rule_h200.json: 8-20% faster), Phi-3-mini qkv
        for n, k in ((28672, 4096), (57344, 8192), (8192, 28672), (37888, 3584), (10240, 8192), (8192, 8192),
                     (9216, 3072)):
            assert ws.config(m, n, k) == ws.WIDE_M_CONFIG, (m, n, k)
        # the narrow layers (equal spans: the wide tile 37-50% slower)
        for n, k in ((4096, 4096), (4096, 14336), (1024, 4096), (4608, 3584), (3584, 3584), (3584, 18944),
                     (3072, 3072), (3584, 14336), (3072, 8192)):
            assert ws.config(m, n, k) == ws.SMALL_M_CONFIG, (m, n, k)
    for n, k in ((6144, 4096), (12288, 4096), (14336, 4096)):  # level at M = 96 / 128 (8B gate: 1-4% slower)
        assert ws.config(128, n, k) == ws.config(96, n, k) == ws.SMALL_M_CONFIG
    assert ws.config(65, 6144, 4096) == ws.WIDE_M_CONFIG  # 8B qkv at 65: 22.6 against 23.9 us
    assert ws.config(64, 28672, 4096) == ws.TINY_M_CONFIG and ws.config(129, 28672, 4096) == ws.DEFAULT_CONFIG
    assert ws.config(128, 28672, 4096, 264) == ws.SMALL_M_CONFIG  # twice the SMs: 112 tiles fill too few
    monkeypatch.setattr(ws, "WIDE_SMALL_M", False)
    assert ws.config(128, 28672, 4096) == ws.SMALL_M_CONFIG
    assert ws.config(384, 22016, 4096) == ws.DEFAULT_CONFIG


def test_wide_tile_above_m_128_only_where_its_span_is_shorter():
    """M > 128: 128 x 256 instead of 256 x 128 where its span at WIDE_BIG_STEP_COST a step is under WIDE_GAIN of
    the 256 x 128 tile's: at M = 257..384 and the like, where rounding M up to 128 rather than 256 saves tiles
    or a wave (results/wsgemm_wide_big_h200.json: the wide step 1.09-1.32 of a 256 x 128 one on 36 rows;
    Llama-2-7B gate_up at M = 384 160.5 -> 133.5 us); never where the spans are equal (M = 512, 1024: 16-27%
    slower), so the Llama-3.1 rows at M = 1024 keep the 256 x 128 tile."""
    wide = ((384, 22016, 4096), (384, 9216, 3072), (384, 10240, 8192), (384, 3584, 18944), (640, 3072, 8192))
    for m, n, k in wide:  # 10-17% faster with it
        assert ws.config(m, n, k) == ws.WIDE_M_CONFIG, (m, n, k)
    same = ((384, 3584, 4096), (640, 22016, 4096), (640, 8192, 8192), (896, 10240, 8192), (384, 8192, 8192))
    for m, n, k in same:  # within 4% or slower with it
        assert ws.config(m, n, k) == ws.DEFAULT_CONFIG, (m, n, k)
    for m in (129, 192, 256, 512, 768, 1024, 2048, 8192):  # equal spans
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672),
                     (9216, 3072), (22016, 4096)):
            assert ws.config(m, n, k) == ws.DEFAULT_CONFIG, (m, n, k)


def test_check_config_refuses_what_does_not_fit():
    assert ws.check_config(ws.DEFAULT_CONFIG) is None
    assert "shared memory" in ws.check_config((256, 128, 64, 6, 2, 4, 128, 168))
    assert ws.check_config((256, 128, 64, 2, 2, 4, 128, 168))  # the TMA ring runs 2 steps ahead
    assert ws.check_config((256, 128, 32, 4, 2, 4, 128, 168))


def test_dispatch_takes_wsgemm_where_the_rule_says(monkeypatch, sm90_dispatch):
    cuda = sm90_dispatch
    for dt in (torch.bfloat16, torch.float16):
        for w4a4 in (False, True):
            assert dp.choose(1024, dt, w4a4, 4096, cuda, 28672) == "wsgemm"
    assert dp.choose(1024, torch.bfloat16, False, 4096, cuda, 6144) == "wsgemm"  # its split tail
    assert dp.choose(768, torch.bfloat16, False, 4096, cuda, 4096) == "cublas"  # a partial wave
    assert dp.choose(2048, torch.bfloat16, False, 4096, cuda, 28672) == "cublas"
    assert dp.choose(2048, torch.bfloat16, True, 4096, cuda, 28672) == "wsgemm"  # W4A4
    assert dp.choose(8192, torch.bfloat16, True, 28672, cuda, 8192) == "cublas"
    # M = 33..128: the small tiles ahead of mma.py / wgmma.py; M <= 32 and short K stay on those
    for dt in (torch.bfloat16, torch.float16):
        assert dp.choose(128, dt, False, 4096, cuda, 28672) == "wsgemm"
        assert dp.choose(64, dt, True, 8192, cuda, 57344) == "wsgemm"
        assert dp.choose(33, dt, False, 14336, cuda, 4096) == "wsgemm"
        assert dp.choose(32, dt, False, 4096, cuda, 28672) == "mma"
        assert dp.choose(100, dt, False, 2048, cuda, 28672) == "wgmma"  # K below the rule's 4096
        assert dp.choose(48, dt, False, 2048, cuda, 28672) == "mma"
        assert dp.choose(64, dt, False, 4096, cuda, 1024) == "mma"  # N below MIN_N_SMALL_M
        assert dp.choose(128, dt, False, 4096, cuda, 1024) == "wgmma"
    assert dp.choose(1024, torch.bfloat16, False, 4112, cuda, 28672) == "cublas"  # K % 64
    monkeypatch.setattr(ws, "ready", lambda device: "self-test error 3.1e-01")  # failed there: not used
    assert dp.choose(1024, torch.bfloat16, False, 4096, cuda, 28672) == "cublas"


def test_explicit_wsgemm_path_off_cuda_or_on_odd_k_raises_with_the_reason():
    w = nvfp4.quantize(torch.randn(64, 256))
    with pytest.raises(ValueError, match="CUDA only"):
        gemm.linear_w4a16(torch.randn(600, 256).bfloat16(), w, path="wsgemm")
    assert "K % 64" in dp.wsgemm_unavailable_reason(600, 64, 4112, torch.bfloat16, torch.device("cuda", 0))
    assert "bf16 or fp16" in dp.wsgemm_unavailable_reason(600, 64, 4096, torch.float32, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="K % 64"):
        ws.matmul(torch.randn(600, 200).bfloat16(), torch.zeros(64, 25, dtype=torch.int32),
                  torch.zeros(64, 12, dtype=torch.uint8), torch.ones(1), None, None, torch.empty(600, 64))
    with pytest.raises(TypeError, match="bf16 or fp16"):
        ws.matmul(torch.randn(600, 256), torch.zeros(64, 32, dtype=torch.int32),
                  torch.zeros(64, 16, dtype=torch.uint8), torch.ones(1), None, None, torch.empty(600, 64))


def test_ready_refuses_other_gpus_once_without_a_self_test(monkeypatch):
    monkeypatch.setattr(ws, "_READY", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    called = []
    monkeypatch.setattr(ws, "_self_test", lambda device: called.append(device))
    assert "sm_90" in ws.ready(torch.device("cuda", 0))
    assert "sm_90" in ws.ready(torch.device("cuda", 0)) and not called
    assert "sm_90" in ws.ready(torch.device("cpu"))



def test_scale_rows_tma_cannot_read_come_from_a_padded_copy_kept_with_the_weight():
    """K % 256 != 0 (Qwen2-72B's down layer: 1848-byte scale rows): ``tma_scales`` gives the same bytes
    at 16-byte row strides, one copy a weight while it lives, made again after an in-place write;
    aligned rows are returned as they are."""
    w = nvfp4.quantize(torch.randn(40, 1088, generator=torch.Generator().manual_seed(3)))
    owner = w.block_scale
    sbits = owner.view(torch.uint8)
    padded = ws.tma_scales(sbits, owner)
    assert padded.shape == (40, 68) and padded.stride() == (80, 1) and padded.data_ptr() % 16 == 0
    assert torch.equal(padded, sbits)
    assert ws.tma_scales(owner.view(torch.uint8), owner) is padded  # a fresh view of the same weight: the copy
    owner[3, 5] = 2.0  # an in-place write bumps the version counter: a new copy with the new byte
    again = ws.tma_scales(owner.view(torch.uint8), owner)
    assert again is not padded and torch.equal(again, owner.view(torch.uint8))
    assert ws.tma_scales(sbits.clone()) is not ws.tma_scales(sbits.clone())  # no owner: nothing kept
    aligned = nvfp4.quantize(torch.randn(8, 256)).block_scale.view(torch.uint8)
    assert ws.tma_scales(aligned) is aligned or aligned.data_ptr() % 16
    key = id(owner)
    del w, owner, sbits, padded, again
    gc.collect()
    assert key not in ws._PADDED_SCALES  # the copy went with its weight
