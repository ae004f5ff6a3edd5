"""The Gluon tensor-core GEMM (fp4ptq/kernels/mma.py) on CPU.

Gluon kernels do not run under the Triton interpreter, so here: the decode's
bit moves and the activation pairing are emulated bit for bit from the same
tables that generate the kernel's PTX and checked against the reference
decode; the kernel is compiled for sm_90 (and must use mma.sync and, with a
ring, cp.async); the dispatch guard refuses what the kernel cannot take. Its
numerics on the GPU: benchmarks/mma_h200.py (results/mma_h200.json).
"""
from __future__ import annotations

import contextlib
import re

import pytest
import torch

from fp4ptq import nvfp4

pytest.importorskip("triton")
gluon = pytest.importorskip("triton.experimental.gluon")
mma = pytest.importorskip("fp4ptq.kernels.mma")
from compile_target import compile_for  # noqa: E402
from ptx_emulator import (_halves, _prmt, assert_same_registers, multiply_decode_inputs,  # noqa: E402
                          sample_words_and_scales)
from fp4ptq.kernels import gemm  # noqa: E402
from fp4ptq.kernels import _common as cm, _gluon, dispatch as dp  # noqa: E402


def _u32(v: torch.Tensor) -> torch.Tensor:
    return v & 0xFFFFFFFF


def _shl(w: torch.Tensor, amount: int) -> torch.Tensor:
    return _u32(w << amount) if amount >= 0 else w >> (-amount)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_decode_bit_moves_give_every_code_times_its_scale(fmt):
    """Register p of a word holds codes p and p + 4 as ``v * 2^-126`` (bf16) or
    ``v * 2^-14`` (fp16); times the scale operand (bf16 ``scale * 2^100`` / fp16
    ``scale``) it is ``v * scale * 2^-26`` / ``v * scale * 2^-14``, exactly: every
    code, under normal, subnormal and the largest E4M3 scales."""
    shifts, mag_mask, dtype, place, s_pow, out_pow = {
        "bf16": (_gluon.DECODE_SHIFTS, _gluon.MAG_MASK, torch.bfloat16, 2.0**126, 2.0**100, 2.0**-26),
        "fp16": (_gluon.DECODE_SHIFTS_F16, _gluon.MAG_MASK_F16, torch.float16, 2.0**14, 1.0, 2.0**-14)}[fmt]
    words, ref, scale = sample_words_and_scales()
    s_op = (scale * s_pow).to(dtype).double()
    assert torch.equal(s_op, scale * s_pow)  # the scale operand is exact
    for p, (mag, sign) in enumerate(shifts):
        r = (_shl(words, mag) & mag_mask) | (_shl(words, sign) & _gluon.SIGN_MASK)
        lo, hi = _halves(r, dtype)
        assert torch.equal(lo * place, ref[:, p]) and torch.equal(hi * place, ref[:, p + 4]), p
        prod = (lo * s_op).to(dtype).double()  # mul.rn on the pair: exact, so no rounding to model
        assert torch.equal(prod, ref[:, p] * scale * out_pow), p


def test_activation_pairing_matches_the_decode_order():
    """The four prmt of _PAIR_X turn x0..x7 (four bf16x2 words) into (x_p, x_p+4),
    the order the decoded weight registers hold codes p and p + 4."""
    x = torch.randint(0, 2**16, (64, 8), dtype=torch.int64)
    regs = {4 + j: x[:, 2 * j] | (x[:, 2 * j + 1] << 16) for j in range(4)}
    for p, (a, b, sel) in enumerate(mma.PAIR_X_SELECTORS):
        out = _prmt(regs[a], regs[b], sel)
        assert torch.equal(out & 0xFFFF, x[:, p]) and torch.equal(out >> 16, x[:, p + 4]), p
    assert mma._PAIR_X.value.count("prmt.b32") == 4


@pytest.mark.parametrize("fmt,mul,tail", [("bf16", "fma.rn.bf16x2", ", z"), ("fp16", "mul.rn.f16x2", "")])
def test_decode_asm_is_generated_from_the_shift_table(fmt, mul, tail):
    """bf16's product is an fma with the -0 pair ``z`` (PTX from sm_80), fp16's a mul. (bf16's shift
    decode is the reference that the kernel's multiply decode is checked against.)"""
    text = mma._decode_asm() if fmt == "bf16" else mma._DECODE_F16.value
    assert text.count(mul) == 4
    assert ("mov.b32 z, 0x80008000;" in text) == bool(tail)
    for p, (mag, sign) in enumerate(_gluon.DECODE_SHIFTS if fmt == "bf16" else _gluon.DECODE_SHIFTS_F16):
        assert f"{mul} ${p}, a, $12{tail};" in text
        assert (f"shl.b32 a, $4, {mag};" if mag > 0 else f"shr.u32 a, $4, {-mag};") in text


def test_multiply_decode_gives_the_shift_decodes_bits():
    """_DECODE_MUL (three integer operations a register, one shift a word) writes the same four
    registers as the shift decode for every pair of codes each register holds, under every sampled scale."""
    inputs = multiply_decode_inputs(seed=2)
    assert_same_registers(mma._decode_asm(), mma._DECODE_MUL.value, inputs)
    text = mma._DECODE_MUL.value
    assert text.count("mul.lo.u32") == 4 and text.count("fma.rn.bf16x2") == 4 and text.count("shr.u32") == 1
    assert "shl.b32" not in text and text.count("and.b32") == 8 and "mul.rn.bf16x2" not in text


def test_fma_product_gives_the_mul_products_bits():
    """mma.py's bf16 decode takes the scale product as ``fma.rn.bf16x2`` with a -0 addend (sm_80 PTX):
    the same registers as with ``mul.rn.bf16x2`` (sm_90 PTX, which wgmma.py and wsgemm.py keep), zeros'
    signs included, for every pair of codes under every sampled scale."""
    inputs = multiply_decode_inputs(seed=3)
    assert_same_registers(mma._decode_mul_asm("mul.rn.bf16x2"), mma._DECODE_MUL.value, inputs)


def test_multiply_decode_build_compiles_for_sm90():
    """The bf16 build puts the multiply decode in the loop (not the shifts), with no local memory;
    SASS counts of it and of the shift build it replaced are in benchmarks/NOTES.md (twenty-seventh pass)."""
    cfg = dict(BN=128, BM=16, BK=128, WARPS=4, STAGES=3, SPLIT=True, HAS_BIAS=False, HAS_XENC=False)
    ce = dict(cfg)
    ce.update(zip(("WL", "SL", "XL", "SC", "XC"), mma._layouts(128, 16, 128, 4)))
    types = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "wenc_ptr": "*fp32", "xenc_ptr": "*fp32",
             "bias_ptr": "*bf16", "y_ptr": "*fp32"}
    ptx = compile_for(mma._mma_kernel, types, ce, gluon=True, num_warps=4).asm["ptx"]
    assert "mul.lo.u32 a, a, 0x1040" in ptx and "and.b32 a, a, 0x81c081c0" in ptx
    assert "or.b32 a, a, b" not in ptx  # (the shift decode joins its magnitude and sign moves)
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("cfg", [
    dict(BN=128, BM=16, BK=128, WARPS=4, STAGES=3, SPLIT=True, HAS_BIAS=False, HAS_XENC=True),
    dict(BN=64, BM=64, BK=64, WARPS=2, STAGES=0, SPLIT=False, HAS_BIAS=True, HAS_XENC=False),
    dict(BN=64, BM=8, BK=64, WARPS=2, STAGES=1, SPLIT=False, HAS_BIAS=True, HAS_XENC=True),
    dict(BN=128, BM=16, BK=128, WARPS=4, STAGES=3, SPLIT=False, HAS_BIAS=True, HAS_XENC=False, DT="fp16"),
])
def test_kernel_compiles_for_sm90_with_the_tensor_cores(cfg):
    """The shipped kernel builds for the H200's sm_90: bf16/fp16 mma.sync m16n8k16 fed from
    registers (the layout conversions are asserted trivial at compile time), cp.async
    for the ring, no spills to local memory."""
    ce = dict(cfg)
    dt = ce.pop("DT", "bf16")
    ce.update(zip(("WL", "SL", "XL", "SC", "XC"), mma._layouts(cfg["BN"], cfg["BM"], cfg["BK"], cfg["WARPS"])))
    types = {"x_ptr": f"*{dt}", "w_ptr": "*i32", "s_ptr": "*u8", "wenc_ptr": "*fp32", "xenc_ptr": "*fp32",
             "bias_ptr": f"*{dt}", "y_ptr": "*fp32" if cfg["SPLIT"] else f"*{dt}"}
    k = compile_for(mma._mma_kernel, types, ce, gluon=True, num_warps=cfg["WARPS"])
    ptx = k.asm["ptx"]
    ty = "f16" if dt == "fp16" else "bf16"
    assert re.search(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{ty}\.{ty}\.f32", ptx)
    assert ("cp.async" in ptx) == (cfg["STAGES"] >= 2)
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (57344, 8192),
                                 (8192, 28672), (1000, 1088), (320, 64), (128256, 4096), (8192, 29568),
                                 (3584, 3584), (3584, 18944), (960, 576)])
@pytest.mark.parametrize("m", [3, 8, 13, 16, 17, 32, 64])
def test_config_tiles_every_supported_shape(m, n, k):
    """Whole K steps a program (the last K range may be shorter), and at least one program an
    SM wherever K allows (Qwen2-72B's K = 29568 does not halve into whole steps: it had 64)."""
    bn, bm, bk, warps, k_split, stages = mma.config(m, n, k)
    assert bm >= m and bm % 8 == 0 and bn % (16 * warps) == 0
    assert k_split % bk == 0 and k % bk == 0 and bk in (64, 128) and stages == 3 and 0 < k_split <= k
    programs = -(-n // bn) * -(-k // k_split)
    assert programs >= 132 or k <= 1024 or k_split == 512  # fewer only unsplittable or at the smallest range


def test_uneven_k_ranges_only_where_halving_falls_short():
    """The tuned Llama shapes keep their power-of-two splits; Qwen2-72B's down layer gets 7
    ranges of 4224 instead of 64 programs holding all of K."""
    assert mma.config(16, 4096, 14336)[4] == 1792 and mma.config(16, 4096, 4096)[4] == 1024
    assert mma.config(16, 57344, 8192)[4] == 8192 and mma.config(16, 8192, 28672)[4] == 3584
    assert mma.config(16, 8192, 29568)[4] == 4224
    assert mma.config(16, 3584, 3584)[4] == 512  # 7 ranges: 392 programs instead of 112


def test_dispatch_guard_names_the_reason(monkeypatch):
    cpu = torch.device("cpu")
    assert "CUDA only" in dp.mma_unavailable_reason(16, 4096, torch.bfloat16, cpu)
    assert dp.choose(16, torch.bfloat16, False, 4096, cpu) == "gemm"
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(cm, "INTERPRET", False)
    monkeypatch.setattr(mma, "ready", lambda device: None)  # its self-test passed on that device
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H200
    assert dp.mma_unavailable_reason(16, 4096, torch.bfloat16, cuda) is None
    assert dp.choose(16, torch.bfloat16, False, 4096, cuda) == "mma"
    assert dp.choose(16, torch.bfloat16, True, 4096, cuda) == "mma"
    assert dp.choose(1, torch.bfloat16, False, 4096, cuda, 57344) == "gemv6"
    assert dp.choose(2, torch.bfloat16, False, 8192, cuda, 57344) == "mma"  # beat gemv6 there
    # M = 2, bf16 W4A16: mma.py from 4M weights, the narrow single-segment layers (8B o / qkv) included
    # (session 24); W4A4 keeps gemv6 on those
    assert dp.choose(2, torch.bfloat16, False, 4096, cuda, 4096) == "mma"
    assert dp.choose(2, torch.bfloat16, False, 4096, cuda, 6144) == "mma"
    assert dp.choose(2, torch.bfloat16, True, 4096, cuda, 6144) == "gemv6"
    assert dp.choose(2, torch.bfloat16, True, 14336, cuda, 4096) == "mma"
    assert dp.choose(2, torch.bfloat16, False, 3072, cuda, 3072) == "mma"    # Phi-3-mini o: 3 segments
    assert dp.choose(2, torch.bfloat16, False, 14336, cuda, 4096) == "mma"   # 8B down
    assert dp.choose(2, torch.bfloat16, False, 4096, cuda, 28672) == "mma"   # 8B gate_up
    assert dp.choose(2, torch.bfloat16, False, 576, cuda, 3072) == "gemv6"  # 1.8M: the GEMV
    assert dp.choose(65, torch.bfloat16, False, 4096, cuda) == "cublas"
    assert "bf16 or fp16" in dp.mma_unavailable_reason(16, 4096, torch.float32, cuda)
    assert dp.choose(16, torch.float16, False, 4096, cuda) == "mma"
    # fp16 takes bf16's rules (gemv6 / gemv7 with fp16x2 sums)
    assert dp.choose(1, torch.float16, False, 8192, cuda, 57344) == "gemv6"
    assert dp.choose(1, torch.float16, False, 4096, cuda, 6144) == "gemv6"
    assert dp.choose(2, torch.float16, False, 4096, cuda, 6144) == "gemv6"  # narrow
    assert dp.choose(2, torch.float16, False, 8192, cuda, 57344) == "mma"
    assert "K % 64" in dp.mma_unavailable_reason(16, 4112, torch.bfloat16, cuda)
    assert dp.choose(16, torch.bfloat16, False, 4112, cuda) == "gemm"
    monkeypatch.setattr(mma, "ready", lambda device: "self-test error 3.1e-01")  # failed there: not used
    assert dp.mma_unavailable_reason(16, 4096, torch.bfloat16, cuda) == "self-test error 3.1e-01"
    assert dp.choose(16, torch.bfloat16, False, 4096, cuda) == "gemm"


def test_bf16_and_fp16_take_the_mma_path_from_sm80(monkeypatch):
    """The bf16 decode's product is an fma (PTX: sm_80 on, as mma.sync). On an sm_80 / sm_89 GPU bf16
    and fp16 activations both take the kernel (before session 30 bf16 took the tiled GEMM there), and
    its self-test runs every case; below sm_80 the kernel does not run at all."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(cm, "INTERPRET", False)
    monkeypatch.setattr(mma, "ready", lambda device: None)
    for cap in ((8, 0), (8, 9)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert dp.mma_unavailable_reason(16, 4096, torch.bfloat16, cuda) is None
        assert dp.choose(16, torch.bfloat16, False, 4096, cuda) == "mma"
        assert dp.choose(16, torch.float16, False, 4096, cuda) == "mma"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "sm_80" in mma._device_reason(0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    tested = []

    def fake_matmul(x, words, sbits, enc, x_enc, bias, y):  # the product the kernel would give
        tested.append(x.dtype)
        w = nvfp4.NVFP4Tensor(words.view(torch.uint8), sbits.view(torch.float8_e4m3fn), enc.reshape(()),
                              (words.shape[0], x.shape[1]), torch.float32)
        return y.copy_(x.float() @ w.dequantize(torch.float32).T)

    monkeypatch.setattr(mma, "matmul", fake_matmul)
    assert mma._self_test(torch.device("cpu")) is None
    assert tested == [torch.bfloat16, torch.bfloat16, torch.float16, torch.bfloat16]


def test_explicit_mma_path_off_cuda_raises_with_the_reason():
    w = nvfp4.quantize(torch.randn(64, 128))
    with pytest.raises(ValueError, match="CUDA only"):
        gemm.linear_w4a16(torch.randn(4, 128).bfloat16(), w, path="mma")


def test_self_test_runs_once_per_device_and_a_failure_warns(monkeypatch):
    monkeypatch.setattr(mma, "_READY", {})
    calls = []

    def failing(device):
        calls.append(device)
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(mma, "_self_test", failing)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(mma, "_device_reason", lambda index: None)  # a GPU that can run it
    entered = []  # the self-test runs with its device current (Triton launches on the current device)
    monkeypatch.setattr(torch.cuda, "device", lambda index: entered.append(index) or contextlib.nullcontext())
    with pytest.warns(UserWarning, match="not used on cuda:0"):
        assert "PassManager" in mma.ready(torch.device("cuda"))
    assert "PassManager" in mma.ready(torch.device("cuda", 0)) and len(calls) == 1
    monkeypatch.setattr(mma, "_self_test", lambda device: None)
    assert mma.ready(torch.device("cuda", 1)) is None and entered == [0, 1]
    with pytest.warns(UserWarning, match="any more"):
        mma.disable(torch.device("cuda", 1), "failed at M=16")
    assert mma.ready(torch.device("cuda", 1)) == "failed at M=16"


def test_matmul_refuses_what_it_cannot_tile_before_launching():
    w = nvfp4.quantize(torch.randn(64, 128))
    words, sbits, enc = w.packed.view(torch.int32), w.block_scale.view(torch.uint8), w.global_enc.reshape(1)
    y = torch.empty(65, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M <= 64"):
        mma.matmul(torch.randn(65, 128).bfloat16(), words, sbits, enc, None, None, y)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        mma.matmul(torch.randn(4, 128), words, sbits, enc, None, None, y)
    with pytest.raises(ValueError, match="does not tile"):  # a K split that is not whole K steps
        mma.matmul(torch.randn(4, 128).bfloat16(), words, sbits, enc, None, None, y[:4],
                   cfg=(64, 8, 128, 2, 96, 3))
    assert not mma.supports(4, 64, 4112) and not mma.supports(0, 64, 128) and mma.supports(64, 64, 128)


def test_no_self_test_inside_a_cuda_graph_capture(monkeypatch):
    """The self-test syncs with the host, which a graph capture forbids: a first use while
    capturing takes the tiled GEMM and leaves the test for the next eager call."""
    monkeypatch.setattr(mma, "_READY", {})
    calls = []
    monkeypatch.setattr(mma, "_self_test", lambda device: calls.append(device))
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(mma, "_device_reason", lambda index: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert "graph capture" in mma.ready(torch.device("cuda", 0)) and not calls and not mma._READY
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert mma.ready(torch.device("cuda", 0)) is None and len(calls) == 1


def test_device_guard_makes_the_tensors_gpu_current(monkeypatch):
    """Triton launches on the current CUDA device, so the dispatch wraps its Triton calls in
    ``_on_device_of(x)``: that makes x's GPU current (a layer on cuda:1 while cuda:0 is
    current), and leaves CPU tensors and tensors on the current GPU alone (entering the
    context costs microseconds a layer call). (The wrapping itself needs two GPUs to run.)"""
    from fp4ptq import kernels

    entered = []
    monkeypatch.setattr(torch.cuda, "device", lambda device: entered.append(device) or contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def on_gpu(index):
        class OnGPU:
            is_cuda = True
            device = torch.device("cuda", index)
        return OnGPU()

    with kernels._on_device_of(on_gpu(1)):
        pass
    assert entered == [torch.device("cuda", 1)]
    with kernels._on_device_of(on_gpu(0)):
        pass
    with kernels._on_device_of(torch.zeros(1)):
        pass
    assert entered == [torch.device("cuda", 1)]


def test_gpus_that_cannot_run_it_are_refused_once_with_the_reason(monkeypatch):
    """Below sm_80 (no mma.sync) and on ROCm the kernel is refused without a self-test,
    and the answer is kept for the device (the dispatch asks on every call)."""
    monkeypatch.setattr(mma, "_READY", {})
    calls = []
    monkeypatch.setattr(mma, "_self_test", lambda device: calls.append(device))
    capability = {"value": (7, 5)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability["value"])
    assert "sm_80" in mma.ready(torch.device("cuda", 0))
    capability["value"] = (9, 0)
    assert "sm_80" in mma.ready(torch.device("cuda", 0)) and not calls  # decided once for cuda:0
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert "ROCm" in mma.ready(torch.device("cuda", 1)) and not calls
