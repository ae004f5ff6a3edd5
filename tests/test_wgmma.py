"""The Gluon wgmma GEMM (fp4ptq/kernels/wgmma.py) on CPU.

Gluon kernels do not run under the Triton interpreter, so here: the K
relabelling is emulated in torch with the kernel's own reshapes, joins and
permutations (weights and activations must agree, and the activations must be
a permutation of each step), the pack-of-8 decode is emulated bit for bit from
the shift tables that generate its PTX and checked against the reference
decode, the kernel is compiled for sm_90 (wgmma with a register A operand, no
local memory), and the guard refuses what it cannot take. Numerics on the GPU:
benchmarks/wgmma_h200.py (results/wgmma_h200*.json).
"""
from __future__ import annotations

import contextlib
import re

import pytest
import torch

from fp4ptq import nvfp4

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")
wgmma = pytest.importorskip("fp4ptq.kernels.wgmma")
from compile_target import compile_for  # noqa: E402
from ptx_emulator import assert_same_registers, bf16_scale_pair, multiply_decode_words, sample_words_and_scales  # noqa: E402
from fp4ptq.kernels import _gluon  # noqa: E402
from fp4ptq.kernels import dispatch as dp  # noqa: E402


def _u32(v: torch.Tensor) -> torch.Tensor:
    return v & 0xFFFFFFFF


def _decode_reg(word: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mma.py's bf16 decode of register p (codes p, p + 4) as the two halves' values."""
    mag, sign = _gluon.DECODE_SHIFTS[p]
    shl = (lambda v, a: _u32(v << a) if a >= 0 else v >> -a)
    r = (shl(word, mag) & _gluon.MAG_MASK) | (shl(word, sign) & _gluon.SIGN_MASK)
    halves = []
    for part in (r & 0xFFFF, r >> 16):
        bits = torch.where(part >= 32768, part - 65536, part).to(torch.int16)
        halves.append(bits.view(torch.bfloat16).double() * 2.0**126)
    return halves[0], halves[1]


@pytest.mark.parametrize("bk", [64, 128])
def test_relabelling_is_a_permutation_of_each_step(bk):
    perm = wgmma.logical_to_actual(bk)
    assert sorted(perm) == list(range(bk))


@pytest.mark.parametrize("bk", [64, 128])
def test_activation_permutation_is_the_relabelling(bk):
    """_b_store's reshape/permute (the same calls, in torch) puts memory K
    ``logical_to_actual[kl]`` at logical K ``kl``."""
    s = bk // 32
    x = torch.arange(3 * bk).reshape(3, bk)
    xl = x.reshape(3, 4, s, 2, 2, 2).permute(0, 2, 4, 5, 1, 3).reshape(3, bk)
    assert torch.equal(xl, x[:, wgmma.logical_to_actual(bk)])


@pytest.mark.parametrize("bk", [64, 128])
def test_weight_operand_feeds_each_logical_k_the_right_code(bk):
    """_a_operand's reshape/join/permute (in torch) with the pack-of-8 decode:
    logical K ``kl`` of a row gets code ``logical_to_actual[kl]`` of the step
    times its block scale, for every code and scale."""
    s, rows = bk // 32, 16
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (rows, bk // 8), generator=gen, dtype=torch.int64)
    words[0, :2] = torch.tensor([0x76543210, 0xFEDCBA98])
    sbytes = torch.randint(0, 127, (rows, bk // 16), generator=gen, dtype=torch.int64)

    def spread(v):  # [rows, t, c, r1] -> [rows, t, r1, r0, c, h]
        v = torch.stack([v, v], -1)
        v = torch.stack([v, v], -1)
        return v.permute(0, 1, 3, 4, 2, 5).reshape(rows, bk)

    w = words.reshape(rows, 4, s).permute(0, 2, 1)
    w = spread(torch.stack([w, w >> 8], -1))  # (the kernel's int32 >> 8 is arithmetic: codes 6, 7 unused)
    sc = sbytes.reshape(rows, 4, s // 2)
    sc = torch.stack([sc, sc], -1).reshape(rows, 4, s).permute(0, 2, 1)
    sc = spread(torch.stack([sc, sc], -1))
    kl = torch.arange(bk)
    r0, h = (kl >> 3) & 1, kl & 1
    got = torch.empty(rows, bk, dtype=torch.float64)
    for p in (0, 1):
        lo, hi = _decode_reg(w, p)
        got = torch.where((r0 == p)[None, :], torch.where((h == 0)[None, :], lo, hi), got)
    got = got * sc.to(torch.uint8).view(torch.float8_e4m3fn).double()
    codes = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], -1).reshape(rows, bk)
    ref = nvfp4.e2m1_decode(codes.to(torch.uint8)).double()
    ref = ref * sbytes.to(torch.uint8).view(torch.float8_e4m3fn).double().repeat_interleave(16, 1)
    assert torch.equal(got, ref[:, wgmma.logical_to_actual(bk)])


def test_decode_asm_reads_each_rows_word_and_scale():
    """Pack order (h, row + 8, r0): $0/$2 from row g's word $4 and scale $12,
    $1/$3 from row g + 8's word $6 and scale $13, shifts of register r0."""
    for asm, shifts, mul in ((wgmma._decode_asm(), _gluon.DECODE_SHIFTS, "mul.rn.bf16x2"),
                             (wgmma._DECODE_F16.value, _gluon.DECODE_SHIFTS_F16, "mul.rn.f16x2")):
        lines = [ln for ln in asm.splitlines() if mul in ln]
        assert len(lines) == 4
        for q, line in enumerate(lines):
            r0, row8 = divmod(q, 2)
            word = f"${4 + 2 * row8}"
            assert line.endswith(f"{mul} ${q}, a, ${12 + row8};")
            mag = shifts[r0][0]
            assert (f"shl.b32 a, {word}, {mag};" if mag > 0 else f"shr.u32 a, {word}, {-mag};") in line


def test_multiply_decode_gives_the_shift_decodes_bits():
    """_DECODE_MUL (mma.py's multiply decode, three integer operations a register) writes the same
    four registers as the shift decode (``_decode_asm()``), rows g and g + 8 from their own words and scales."""
    words = multiply_decode_words()
    other = words.roll(1)
    pair = bf16_scale_pair(sample_words_and_scales(len(words), seed=3)[2])
    inputs = {**{f"${4 + i}": (words if i % 2 == 0 else other) for i in range(8)}, "$12": pair, "$13": pair.roll(5)}
    assert_same_registers(wgmma._decode_asm(), wgmma._DECODE_MUL.value, inputs)
    assert wgmma._DECODE_MUL.value.count("mul.lo.u32") == 4 and "shr" not in wgmma._DECODE_MUL.value


def _compile(cfg: dict, dt: str = "bf16", maxnreg: int = 0):
    ce = dict(cfg)
    ce.setdefault("HAS_XENC", False)
    ce.update(zip(("WL", "SL", "XL", "SC"), wgmma._layouts_wg(cfg["BN"], cfg["BM"], cfg["BK"], cfg["WARPS"])))
    types = {"x_ptr": f"*{dt}", "w_ptr": "*i32", "s_ptr": "*u8", "wenc_ptr": "*fp32", "xenc_ptr": "*fp32",
             "bias_ptr": f"*{dt}",
             "y_ptr": "*fp32" if cfg["SPLIT"] else f"*{dt}"}
    # (Llama shapes: K = 4096 gives KW8 = KB4 = stride_x8 = 64)
    return compile_for(wgmma._wgmma_kernel, types, ce, gluon=True,
                       divisible=("KW8", "KB4", "stride_x8", "stride_ym", "K_SPLIT"), num_warps=cfg["WARPS"],
                       **({"maxnreg": maxnreg} if maxnreg else {}))


@pytest.mark.parametrize("cfg,dt", [
    (dict(BN=128, BM=64, BK=128, WARPS=8, STAGES=3, WAIT=1, SPLIT=True, HAS_BIAS=False), "bf16"),
    (dict(BN=128, BM=256, BK=64, WARPS=8, STAGES=3, WAIT=0, SPLIT=False, HAS_BIAS=True), "bf16"),
    (dict(BN=64, BM=128, BK=64, WARPS=4, STAGES=2, WAIT=1, SPLIT=False, HAS_BIAS=True), "fp16"),
    (dict(BN=128, BM=64, BK=128, WARPS=8, STAGES=3, WAIT=0, SPLIT=False, HAS_BIAS=False, HAS_XENC=True), "bf16"),
    (dict(BN=128, BM=64, BK=128, WARPS=8, STAGES=3, WAIT=0, SPLIT=True, HAS_BIAS=False), "bf16"),
])
def test_kernel_compiles_for_sm90_with_register_a_wgmma(cfg, dt):
    """The kernel builds for the H200's sm_90: an asynchronous wgmma m64nBMk16 with the
    decoded weight from registers (every layout conversion of the operand is asserted
    trivial at compile time), cp.async for the ring, 16-byte activation loads, no local
    memory."""
    ptx = _compile(cfg, dt).asm["ptx"]
    # activations in 16-byte loads (the 2-byte loads left are the bias's, in the epilogue)
    assert "ld.global.v4" in ptx and len(re.findall(r"ld\.global(\.\w+)*\.b16", ptx)) <= (
        4 * cfg["BN"] // (32 * cfg["WARPS"]) if cfg["HAS_BIAS"] else 0)
    ty = "f16" if dt == "fp16" else "bf16"
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg['BM']}k16\.f32\.{ty}\.{ty}", ptx)
    assert "cp.async" in ptx and "wgmma.wait_group" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ("mul.lo.u32 a, a, 0x1040" in ptx) == (dt == "bf16")  # the multiply decode (bf16)


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (57344, 8192),
                                 (8192, 28672), (1000, 1152), (320, 128), (8192, 29568), (3584, 3584)])
@pytest.mark.parametrize("m", [1, 64, 65, 128, 200, 256, 1024, 4096])
def test_config_tiles_every_supported_shape(m, n, k):
    cfg = wgmma.config(m, n, k)
    assert wgmma.check_config(m, k, cfg) is None
    bn, bm, bk, warps, ks, *_ = cfg
    assert bm == (64 if m <= 128 else 128) and ks >= min(k, 512)
    if m == 128 and -(-k // ks) == 1 and ks > 512:  # one program a tile only when the tiles fill the SMs
        assert -(-n // bn) * -(-m // bm) >= 132


def test_uneven_k_ranges_only_where_halving_falls_short():
    assert wgmma.config(128, 4096, 4096)[4] == 1024 and wgmma.config(128, 4096, 14336)[4] == 3584
    assert wgmma.config(128, 8192, 29568)[4] == 14848  # 2 ranges (14848 + 14720): 256 programs, not 128
    assert wgmma.check_config(128, 29568, (128, 64, 64, 8, 14848, 3, 0, 0)) is None
    assert wgmma.check_config(128, 29568, (128, 64, 64, 8, 14784, 3, 0, 0))  # 14784 is 115.5 step pairs


def test_ready_refuses_other_gpus_once_without_a_self_test(monkeypatch):
    monkeypatch.setattr(wgmma, "_READY", {})
    calls = []
    monkeypatch.setattr(wgmma, "_self_test", lambda device: calls.append(device))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    capability = {"value": (10, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability["value"])
    assert "sm_90" in wgmma.ready(torch.device("cuda", 0))
    capability["value"] = (9, 0)
    assert "sm_90" in wgmma.ready(torch.device("cuda", 0)) and not calls  # decided once for cuda:0
    assert "sm_90" in wgmma.ready(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert "graph capture" in wgmma.ready(torch.device("cuda", 1)) and not calls and 1 not in wgmma._READY
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    assert wgmma.ready(torch.device("cuda", 1)) is None and len(calls) == 1
    assert wgmma.ready(torch.device("cuda", 1)) is None and len(calls) == 1


def test_a_failed_self_test_warns_and_is_kept(monkeypatch):
    monkeypatch.setattr(wgmma, "_READY", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())

    def failing(device):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(wgmma, "_self_test", failing)
    with pytest.warns(UserWarning, match="not used on cuda:0"):
        assert "PassManager" in wgmma.ready(torch.device("cuda", 0))
    assert "PassManager" in wgmma.ready(torch.device("cuda", 0))


def test_matmul_refuses_what_it_cannot_take_before_launching():
    w = nvfp4.quantize(torch.randn(64, 128))
    words, sbits, enc = w.packed.view(torch.int32), w.block_scale.view(torch.uint8), w.global_enc.reshape(1)
    y = torch.empty(4, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        wgmma.matmul(torch.randn(4, 128), words, sbits, enc, None, None, y)
    with pytest.raises(ValueError, match="does not tile"):
        wgmma.matmul(torch.randn(4, 128).bfloat16(), words, sbits, enc, None, None, y,
                     cfg=(128, 64, 64, 8, 64, 3, 1, 0))  # an odd number of K steps
    with pytest.raises(ValueError, match="does not tile"):
        wgmma.matmul(torch.randn(4, 128).bfloat16(), words, sbits, enc, None, None, y,
                     cfg=(64, 64, 64, 8, 128, 3, 1, 0))
    with pytest.raises(ValueError, match="K % 128"):
        wgmma.matmul(torch.randn(4, 192).bfloat16(), words, sbits, enc, None, None, y)
    assert not wgmma.supports(4, 64, 4112) and not wgmma.supports(4, 64, 192) and not wgmma.supports(0, 64, 128)
    assert wgmma.supports(64, 64, 128)


def test_preferred_rows_are_the_measured_window():
    """The dispatch rule: 64 < M <= 128 (ahead of dequantize + cuBLAS there on the H200;
    mma.py below, dequantize + cuBLAS above), K % 128 == 0."""
    assert not wgmma.preferred(64, 4096, 4096) and wgmma.preferred(65, 4096, 4096)
    assert wgmma.preferred(128, 57344, 8192) and not wgmma.preferred(129, 4096, 4096)
    assert not wgmma.preferred(100, 4096, 4160)  # K % 128 != 0


def test_product_check_compares_with_the_reference_decode():
    """The self-test's helper on CPU, with a stand-in for the kernel: the reference
    product passes, a wrong one is reported with its shape."""
    def reference(x, words, sbits, enc, x_enc, bias, y):
        n, k = words.shape[0], x.shape[1]
        w = nvfp4.NVFP4Tensor(words.view(torch.uint8), sbits.view(torch.float8_e4m3fn), enc.reshape(()),
                              torch.Size((n, k)), torch.bfloat16, None)
        return y.copy_(x.float() @ w.dequantize(torch.float32).T)

    cases = ((5, 24, 64, torch.bfloat16), (3, 16, 128, torch.float16))
    assert _gluon.product_check(reference, cases, torch.device("cpu")) is None
    msg = _gluon.product_check(lambda *a: a[-1].zero_(), cases, torch.device("cpu"))
    assert msg.startswith("self-test error 1.00e+00 at M=5, N=24, K=64")


def test_dispatch_takes_wgmma_for_65_to_128_rows_where_wsgemm_does_not(monkeypatch, sm90_dispatch):
    """wgmma.py takes M = 65..128 where wsgemm.py's rule does not (K below its 4096 here; on the
    measured Llama layers wsgemm's 128-row tile is ahead, results/wsgemm_small_m_h200.json)."""
    from fp4ptq.kernels import wsgemm

    cpu = torch.device("cpu")
    assert "CUDA only" in dp.wgmma_unavailable_reason(128, 4096, 4096, torch.bfloat16, cpu)
    cuda = sm90_dispatch
    for m in (65, 100, 128):
        assert dp.choose(m, torch.bfloat16, False, 2048, cuda, 4096) == "wgmma"
        assert dp.choose(m, torch.float16, False, 2048, cuda, 4096) == "wgmma"
        assert dp.choose(m, torch.bfloat16, True, 2048, cuda, 4096) == "wgmma"  # W4A4 too
        assert dp.choose(m, torch.bfloat16, False, 4096, cuda, 4096) == "wsgemm"
    assert dp.choose(64, torch.bfloat16, False, 2048, cuda, 4096) == "mma"
    # from M = 129 the warp-specialized GEMM (its split tail: 8B o at M = 129, 22.4 us against dequantize +
    # cuBLAS's 24.0, results/wsgemm_h200_split.json), or dequantize + cuBLAS where neither rule holds
    assert dp.choose(129, torch.bfloat16, False, 4096, cuda, 4096) == "wsgemm"
    assert dp.choose(129, torch.bfloat16, False, 2048, cuda, 4096) == "cublas"
    assert dp.choose(128, torch.bfloat16, False, 4112, cuda, 4096) == "cublas"  # K % 64 (wsgemm), % 128
    assert dp.choose(128, torch.bfloat16, False, 4160, cuda, 4096) == "wsgemm"  # K % 128 != 0, % 64 == 0
    assert "bf16 or fp16" in dp.wgmma_unavailable_reason(128, 64, 4096, torch.float32, cuda)
    monkeypatch.setattr(wsgemm, "ready", lambda device: "self-test error 3.1e-01")  # failed there: not used
    assert dp.choose(128, torch.bfloat16, False, 4096, cuda, 4096) == "wgmma"
    monkeypatch.setattr(wgmma, "ready", lambda device: "self-test error 3.1e-01")  # failed there: not used
    assert dp.choose(128, torch.bfloat16, False, 2048, cuda, 4096) == "cublas"


def test_explicit_wgmma_path_off_cuda_raises_with_the_reason():
    from fp4ptq.kernels import gemm

    w = nvfp4.quantize(torch.randn(64, 128))
    with pytest.raises(ValueError, match="CUDA only"):
        gemm.linear_w4a16(torch.randn(80, 128).bfloat16(), w, path="wgmma")

