"""The kernels the dispatch launches on GPUs older than the H200 build there. Only the Hopper-only kernels
(wgmma.py, wsgemm.py) are kept off those GPUs by their guards; everything else the dispatch picks for bf16 / fp16
activations on an A100 (sm_80), an A10 / RTX 30 (sm_86) or an L40S / RTX 40 (sm_89) must compile for
them. The PTX features these kernels use are the same from sm_80 to sm_89, so sm_80 stands for the
three. Built here without a GPU (``compile_target``), each within the target's shared memory; the GEMV launches are the ones ``gv._gemv6``
builds for real layer shapes, recorded instead of run."""
from __future__ import annotations

import pytest
import torch

from compile_target import compile_for
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import quantize_kernel as qk
from ptx_emulator import _halves, run_ptx
from fp4ptq.kernels import _common as cm, dispatch as dp, gemv as gv  # noqa: E402

pytest.importorskip("triton")

POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
           torch.int32: "*i32", torch.int16: "*i16", torch.uint8: "*u8", torch.int8: "*i8"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg", "launch_pdl", "num_ctas")
# layers whose M = 1 / 2 GEMV builds differ: narrow single segment (loading ahead at M = 1), wide single
# segment, split K, streamed x with whole and with masked steps, the fp16 streamed config of the largest
SHAPES = {"8B.qkv": (6144, 4096), "8B.gate_up": (28672, 4096), "Llama-2-7B.down": (4096, 11008),
          "8B.down": (4096, 14336), "Qwen2-7B.down": (3584, 18944), "70B.down": (8192, 28672),
          "SmolLM2.down": (576, 1536)}


# shared memory a block may have (opt-in maxima): sm_75 (T4) 64 KB; sm_86 / sm_89 99 KB, the least of the
# sm_80-89 family that sm_80 stands for here (the A100 has 163 KB)
SMEM_LIMIT = {75: 64 * 1024, 80: 99 * 1024}


def _build(fn, types, constexprs, *, arch, **options):
    """``compile_for`` that also checks the build's shared memory fits the target family's blocks."""
    kernel = compile_for(fn, types, constexprs, arch=arch, **options)
    assert kernel.metadata.shared <= SMEM_LIMIT[arch], (fn, kernel.metadata.shared)
    return kernel


class _Recorded:
    """Stands in for ``cm.Launch``: keeps what would be launched."""
    built: list = []

    def __init__(self, kernel, grid, args, slots, kwargs):
        _Recorded.built.append((kernel, tuple(args), dict(kwargs)))

    def __call__(self, *tensors):  # pragma: no cover - never run here
        raise AssertionError("recorded launches are not run")


def _gemv_launches(monkeypatch, dtype: torch.dtype) -> list:
    """Every distinct (kernel, compile-time arguments, argument types) ``_gemv6`` builds for SHAPES at
    M = 1 and 2."""
    monkeypatch.setattr(cm, "INTERPRET", False)
    monkeypatch.setattr(cm, "Launch", _Recorded)
    _Recorded.built = []
    meta = torch.device("meta")
    for n, k in SHAPES.values():
        words = torch.empty(n, k // 8, dtype=torch.int32, device=meta)
        sbits = torch.empty(n, k // 16, dtype=torch.uint8, device=meta)
        enc = torch.empty(1, dtype=torch.float32, device=meta)
        for m in (1, 2):
            x = torch.empty(m, k, dtype=dtype, device=meta)
            y = torch.empty(m, n, dtype=dtype, device=meta)
            gv._gemv6(x, words, sbits, enc, enc, enc, y, m, n, k, False, None)
    seen, out = set(), []
    for kernel, args, kwargs in _Recorded.built:
        if any(a is None for a in args):  # the split-K summing pass (its per-call slots): compiled below
            continue
        ce = {a: v for a, v in kwargs.items() if a not in LAUNCH_OPTIONS}
        names = kernel.arg_names
        types = {names[i]: POINTER[a.dtype] for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        divisible = tuple(names[i] for i, a in enumerate(args) if isinstance(a, int) and a % 16 == 0)
        key = (kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, tuple(sorted(ce.items())),
               tuple(sorted(types.items())), divisible)
        if key not in seen:
            seen.add(key)
            opts = {a: kwargs[a] for a in ("num_warps", "enable_fp_fusion") if a in kwargs}
            out.append((kernel, types, ce, divisible, opts))
    return out


@pytest.mark.parametrize("arch,dtype", [(80, torch.bfloat16), (80, torch.float16), (75, torch.float16)])
def test_gemv_builds_compile_for_older_gpus(monkeypatch, arch, dtype):
    """gemv6 / gemv7 (M <= 2) for sm_80. gemv7's
    bf16 activation pairs were ``mul.rn.bf16x2`` (PTX: sm_90 and later), so before this test an A100
    or an L40S stopped with a ptxas error on every long-K layer (Llama-3.1-8B's down projection) at
    batch 1 in bf16. On sm_75 (T4, RTX 20) the GEMVs take fp16 activations only
    (``dp.gemv_bf16_reason``), so only those builds are compiled there."""
    launches = _gemv_launches(monkeypatch, dtype)
    kernels = {k.fn.__name__ if hasattr(k, "fn") else k.__name__ for k, *_ in launches}
    assert kernels == {"_gemv_resident_kernel", "_gemv_stream_kernel"}  # both GEMVs were reached
    for kernel, types, ce, divisible, opts in launches:
        ptx = _build(kernel, types, ce, arch=arch, divisible=divisible, **opts).asm["ptx"]
        assert "mul.rn.bf16x2" not in ptx


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (9, 0)])
def test_bf16_gemv_calls_take_the_tiled_gemm_below_sm80(monkeypatch, capability):
    """On sm_75 bf16 activations at M <= 2 (W4A16 and W4A4) take the tiled GEMM, which builds there;
    fp16 keeps the GEMV; from sm_80 bf16 keeps it too."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(cm, "INTERPRET", False)
    monkeypatch.setattr(cm, "_capability", lambda device: capability)
    old = capability < (8, 0)
    assert (dp.gemv_bf16_reason(cuda) is not None) == old
    if old:
        assert "sm_80" in dp.gemv_bf16_reason(cuda) and "sm_75" in dp.gemv_bf16_reason(cuda)
    for m, n, k in ((1, 6144, 4096), (1, 4096, 14336), (2, 1536, 576)):
        for w4a4 in (False, True):
            assert dp.choose(m, torch.bfloat16, w4a4, k, cuda, n) == ("gemm" if old else "gemv6")
        assert dp.choose(1, torch.float16, False, k, cuda, n) == "gemv6"
    assert dp.gemv_bf16_reason(torch.device("cpu")) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_kernels_of_the_dispatch_compile_for_sm80(monkeypatch, dtype):
    """The tiled GEMM (M = 3..64 where mma.py does not run, and above; M <= 2 too on sm_75, where it is
    built as well), the dequantize kernel (before cuBLAS), the split-K summing pass and the quantize
    kernels (the 16-bit one, which counts bf16 with integer compares there, and the fp32-compare one of
    fp32 inputs and 1-2 rows)."""
    dt = POINTER[dtype]
    gemm_types = {"x_ptr": dt, "w_ptr": "*i64", "s_ptr": "*u8", "wenc_ptr": "*fp32", "xenc_ptr": "*fp32",
                  "bias_ptr": dt, "y_ptr": dt}
    for m in (16, 64):
        bm, bn, bk, group, warps, stages = gm._gemm_config(m, 4096, 4096)
        ce = dict(HAS_BIAS=True, HAS_XENC=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, EVEN_K=True,
                  BF16_DIRECT=dtype == torch.bfloat16, DOT_FP32=False)
        _build(gm._gemm_kernel, gemm_types, ce, arch=80, num_warps=warps, num_stages=stages)
        if m == 16:  # (the config of M <= 16)
            _build(gm._gemm_kernel, gemm_types, ce, arch=75, num_warps=warps, num_stages=stages)
    _build(gm._dequant_kernel, {"w_ptr": "*i64", "s_ptr": "*u8", "wenc_ptr": "*fp32",
                                     "out_ptr": "*i16" if dtype == torch.bfloat16 else "*fp16"},
                dict(BLOCK_N=32, BLOCK_B=16, OUT_BF16=dtype == torch.bfloat16), arch=80, num_warps=4,
                enable_fp_fusion=False)
    _build(cm._gemv_split_finish, {"part_ptr": "*fp32", "bias_ptr": dt, "y_ptr": dt},
                dict(SEGMENTS=4, HAS_BIAS=True, BLOCK=1024, PDL=False), arch=80, num_warps=4)
    monkeypatch.setattr(qk, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda", 0)
    assert qk.quant16_supported(cuda, dtype)
    for four_six in (0, 1):
        types = {"x_ptr": "*i32", "amax_ptr": "*fp32", "table_ptr": "*i32", "enc_ptr": "*fp32",
                 "packed_ptr": "*i32", "scale_ptr": "*u8", "chose_ptr": "*i8", "scaled_ptr": "*i32"}
        for table in (False, True):
            ce = dict(F16=dtype == torch.float16, FOUR_SIX=four_six, EMIT_PACKED=True, EMIT_SCALED=True,
                      ASM=qk._asm_kind(cuda, dtype), BLOCK_M=1, BLOCKS_K=128, TABLE=table, WORD_MAJOR=False)
            _build(qk._quantize16_kernel, types, ce, arch=80, divisible=("K", "stride_xw", "stride_sw"),
                   num_warps=4, enable_fp_fusion=False)
        types = {"x_ptr": dt, "amax_ptr": "*fp32", "enc_ptr": "*fp32", "packed_ptr": "*i32", "scale_ptr": "*u8",
                 "chose_ptr": "*i8", "scaled_ptr": dt}
        ce = dict(FOUR_SIX=four_six, EMIT_PACKED=True, EMIT_SCALED=True, BLOCK_M=1, BLOCKS_K=32)
        _build(qk._quantize_kernel, types, ce, arch=80, num_warps=4, enable_fp_fusion=False)


@pytest.mark.parametrize("asm", ["_X_PAIR_LOW", "_X_PAIR_HIGH"])
def test_streamed_x_pairs_are_x_times_2_to_64_exactly(asm):
    """gemv7's activation pairs (a byte permute, then times 2^64 as ``fma`` with a -0 addend, which PTX
    has from sm_80): on every bf16 pattern but NaN, the exact product, the sign of zero kept, inf from
    2^64 on (what ``mul.rn.bf16x2`` gave on sm_90, where ptxas emits the same HMUL2 for both)."""
    bits = torch.arange(65536, dtype=torch.int64)
    values = _halves(bits, torch.bfloat16)[0]
    keep = ~torch.isnan(values)
    bits, values = bits[keep], values[keep]
    other = bits.flip(0)
    if asm == "_X_PAIR_LOW":  # lanes: the low halves of a and b
        a, b = bits | (other << 16), other | (bits << 16)
        want_lo, want_hi = values, values.flip(0)
    else:  # the high halves of a and b
        a, b = other | (bits << 16), bits | (other << 16)
        want_lo, want_hi = values, values.flip(0)
    lo, hi = _halves(run_ptx(getattr(gv, asm).value, a, b), torch.bfloat16)
    for got, want in ((lo, want_lo), (hi, want_hi)):
        exact = want * 2.0**64
        expect = torch.where(exact.abs() > torch.finfo(torch.bfloat16).max, exact.sign() * float("inf"), exact)
        assert torch.equal(got, expect)
        assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mma_kernel_compiles_for_sm80(dtype):
    """mma.py (M = 3..64, and M = 2 on large layers) for sm_80 with bf16 activations too: its bf16
    decode's scale product is ``fma.rn.bf16x2`` with a -0 addend, no ``mul.rn.bf16x2`` (sm_90 PTX, with
    which bf16 had to take the tiled GEMM below sm_90); fp16 as before. The two configs of its rule."""
    pytest.importorskip("triton.experimental.gluon")
    from fp4ptq.kernels import mma

    dt = POINTER[dtype]
    for cfg in (dict(BN=128, BM=16, BK=128, WARPS=4, STAGES=3, SPLIT=True, HAS_BIAS=False, HAS_XENC=True),
                dict(BN=64, BM=64, BK=64, WARPS=2, STAGES=3, SPLIT=False, HAS_BIAS=True, HAS_XENC=False)):
        ce = dict(cfg)
        ce.update(zip(("WL", "SL", "XL", "SC", "XC"), mma._layouts(cfg["BN"], cfg["BM"], cfg["BK"], cfg["WARPS"])))
        types = {"x_ptr": dt, "w_ptr": "*i32", "s_ptr": "*u8", "wenc_ptr": "*fp32", "xenc_ptr": "*fp32",
                 "bias_ptr": dt, "y_ptr": "*fp32" if cfg["SPLIT"] else dt}
        ptx = _build(mma._mma_kernel, types, ce, gluon=True, arch=80, num_warps=cfg["WARPS"]).asm["ptx"]
        assert "mul.rn.bf16x2" not in ptx
        if dtype == torch.bfloat16:
            assert "fma.rn.bf16x2" in ptx
