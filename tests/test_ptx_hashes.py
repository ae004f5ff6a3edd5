"""Proof that a refactoring of ``fp4ptq.kernels`` leaves what runs on the GPU unchanged, checked without
a GPU: every kernel the dispatch can pick (per path, activation dtype and a representative layer shape)
compiled for sm_90 and sm_80 gives the PTX recorded in ``tests/data/ptx_hashes.json`` (its SHA-256 after
``normalized``: debug file / line records, which move with any edit of the source, are left out), and the
dispatch picks the recorded path, tile and split for every row of the README's kernel table and the
model zoo (``docs/KERNELS.md``) on both GPUs (``tests/data/dispatch_table.json``).

The launches are the ones the kernels' own launch builders make for these shapes: each module's
``Launch`` (and the directly launched Triton kernels) is replaced by a recorder, the operands are meta
tensors (taken as CUDA ones), and the device facts (SM count, compute capability, self-tests passed) are
those of an H200 (sm_90, 132 SMs) or an A100 (sm_80, 108 SMs). The cases: the dense paths (the GEMVs, the
fp32 GEMV gemv4, mma.py, wgmma.py, wsgemm.py, the tiled GEMM, the dequantize before cuBLAS, the quantize
kernels) and MoE layers as ``kernels.moe_experts`` launches them (the routing, the grouped GEMM W4A16 and
W4A4 with its ``quantize_pairs`` prologue, the SwiGLU gating, the combine, the prefill's dequantized experts).

Triton's PTX changes between its versions: the file records the version it was made with (``"triton"``);
under another Triton the check is skipped with a message (``.ci/run`` installs the recorded one).

Record or regenerate the data (only for an intended change of a kernel or of a rule, and say so in the
commit)::

    PYTHONPATH=$PWD python tests/test_ptx_hashes.py --add          # new cases only; recorded builds untouched
    PYTHONPATH=$PWD python tests/test_ptx_hashes.py --check --all  # print what differs, write nothing
    PYTHONPATH=$PWD python tests/test_ptx_hashes.py                # both files, every build

The file holds every case in bf16 and fp16 for both GPUs (269 builds, 212 distinct compiles, about 4
minutes on a loaded 2-core machine); the test compiles the ``REPRESENTATIVE`` part of it, one build of
every (GPU, kernel, dtype) (70 compiles; CPU and wall time in ``docs/KERNELS.md``; seconds from Triton's
cache); ``--check --all`` checks everything.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).parent / "data"
PTX_FILE = DATA / "ptx_hashes.json"
TRITON_KEY = "triton"  # in PTX_FILE: the Triton version the hashes were made with
DISPATCH_FILE = DATA / "dispatch_table.json"
ARCHS = {90: 132, 80: 108}  # compute capability -> SM count (H200, A100)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
           torch.int32: "*i32", torch.int16: "*i16", torch.uint8: "*u8", torch.int8: "*i8",
           torch.float8_e4m3fn: "*fp8e4nv"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg", "launch_pdl", "num_ctas")
META = torch.device("meta")

# (name, N, K): the README's Llama-3.1 layers and the model zoo of docs/KERNELS.md
README_LAYERS = {"8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096),
                 "8B.down": (4096, 14336), "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672)}
ZOO_LAYERS = {
    "Qwen2-7B.qkv": (4608, 3584), "Qwen2-7B.o": (3584, 3584), "Qwen2-7B.gate_up": (37888, 3584),
    "Qwen2-7B.down": (3584, 18944), "Qwen2-72B.qkv": (10240, 8192), "Qwen2-72B.gate_up": (59136, 8192),
    "Qwen2-72B.down": (8192, 29568), "Llama-2-7B.qkv": (12288, 4096), "Llama-2-7B.gate_up": (22016, 4096),
    "Llama-2-7B.down": (4096, 11008), "Gemma-2-9B.qkv": (8192, 3584), "Gemma-2-9B.o": (3584, 4096),
    "Gemma-2-9B.gate_up": (28672, 3584), "Gemma-2-9B.down": (3584, 14336), "Phi-3-mini.qkv": (9216, 3072),
    "Phi-3-mini.o": (3072, 3072), "Phi-3-mini.gate_up": (16384, 3072), "Phi-3-mini.down": (3072, 8192),
    "SmolLM2-135M.qkv": (960, 576), "SmolLM2-135M.gate_up": (3072, 576), "SmolLM2-135M.down": (576, 1536)}
README_MS = (1, 16, 128, 1024, 8192)
ZOO_MS = (1, 2, 16, 64, 128, 1024)


# --------------------------------------------------------------------------- #
# The device the dispatch sees, and the recorded launches
# --------------------------------------------------------------------------- #
@contextlib.contextmanager
def _device(arch: int):
    """The kernels' host code as on a GPU of compute capability ``arch`` // 10 whose Gluon kernels passed
    their self-tests (sm_90-only ones refused below sm_90), with launches recorded instead of run."""
    from fp4ptq.kernels import (_common, dot_scaled, gemm, gemv, grouped, grouped_dequant, mma, quantize_kernel,
                                routing, wgmma, wsgemm)

    mp = pytest.MonkeyPatch()
    cap = divmod(arch, 10)
    sms = ARCHS[arch]
    try:
        mp.setattr(_common, "INTERPRET", False)
        mp.setattr(quantize_kernel, "INTERPRET", False)
        mp.setattr(_common, "_sm_count", lambda device: sms)
        mp.setattr(_common, "_capability", lambda device: cap)
        mp.setattr(_common, "_pdl_possible", lambda device: arch >= 90)
        mp.setattr(dot_scaled, "ready", lambda device, fmt: "no FP4 tensor cores")
        mp.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        mp.setattr(quantize_kernel, "quant16_supported", lambda device, dtype: True)
        mp.setattr(quantize_kernel, "_asm_kind",
                   lambda device, dtype: 2 if dtype == torch.bfloat16 and arch < 90 else 1)
        mp.setattr(mma, "ready", lambda device: None)
        for module in (wgmma, wsgemm):
            mp.setattr(module, "ready", lambda device: None if arch >= 90 else "sm_90 only")
        for module in (_common, mma, quantize_kernel, wgmma, wsgemm):
            mp.setattr(module, "Launch", _Recorded)
        for name in ("_gemm_kernel", "_dequant_kernel"):
            mp.setattr(gemm, name, _Direct(getattr(gemm, name)))
        mp.setattr(gemv, "_gemv_blocks_kernel", _Direct(gemv._gemv_blocks_kernel))
        # the MoE launches (grouped.py, routing.py, grouped_dequant.py): the meta operands taken as CUDA ones
        for module in (grouped, routing):
            mp.setattr(module, "INTERPRET", False)
            mp.setattr(module, "_kernels_for", lambda x, backend, op: backend != "reference")
        mp.setattr(grouped, "triton_unavailable_reason", lambda x, op="quantize": None)
        mp.setattr(grouped, "_sm_count", lambda device: sms)
        mp.setattr(grouped_dequant, "_capability", lambda device: cap)
        mp.setattr(grouped_dequant, "takes_dequant", _on_cuda(grouped_dequant.takes_dequant))
        for module, names in ((grouped, ("_grouped_kernel", "_quantize_pairs_kernel", "_swiglu_kernel",
                                         "_combine_kernel")),
                              (routing, ("_route_one_chunk_kernel", "_route_hist_kernel", "_route_scan_kernel",
                                         "_route_place_kernel")),
                              (grouped_dequant, ("_dequant_experts_kernel",))):
            for name in names:
                mp.setattr(module, name, _Direct(getattr(module, name)))
        mp.setattr(wsgemm, "_summing_state", _meta_summing_state)
        _Recorded.built = []
        yield torch.device("cuda", 0)
    finally:
        mp.undo()


def _on_cuda(rule):
    """``rule(x, ...)`` (``grouped_dequant.takes_dequant``) asked about a CUDA tensor like the meta ``x``."""
    class OnCuda:
        def __init__(self, x):
            self.dtype, self.shape, self.is_cuda, self.device = x.dtype, x.shape, True, torch.device("cuda", 0)

    return lambda x, *args: rule(OnCuda(x), *args)


def _meta_summing_state(device, n_split: int, table: tuple, own: bool):
    """wsgemm.py's tile counters and summing table, as meta tensors."""
    return (torch.empty(n_split, dtype=torch.int32, device=META),
            torch.empty(len(table), dtype=torch.int32, device=META))


class _Recorded:
    """Stands in for ``Launch``: each call records the kernel with its full argument list."""
    built: list = []

    def __init__(self, kernel, grid, args, slots, kwargs):
        self.kernel, self.args, self.slots, self.kwargs = kernel, list(args), tuple(slots), dict(kwargs)

    def __call__(self, *tensors):
        args = list(self.args)
        for i, t in zip(self.slots, tensors):
            args[i] = t
        _Recorded.built.append((self.kernel, args, self.kwargs))


class _Direct:
    """Stands in for a Triton kernel launched as ``kernel[grid](*args, **kwargs)``."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _Recorded.built.append((self.kernel, list(args), dict(kwargs)))
        return launch


def _weight(n: int, k: int):
    """Meta tensors of an [N, K] NVFP4 weight: int32 code words, scale bytes, global scale."""
    return (torch.empty(n, k // 8, dtype=torch.int32, device=META),
            torch.empty(n, k // 16, dtype=torch.uint8, device=META),
            torch.empty(1, dtype=torch.float32, device=META))


def _nvfp4_weight(n: int, k: int):
    from fp4ptq.nvfp4 import NVFP4Tensor

    return NVFP4Tensor(torch.empty(n, k // 2, dtype=torch.uint8, device=META),
                       torch.empty(n, k // 16, dtype=torch.float8_e4m3fn, device=META),
                       torch.empty((), dtype=torch.float32, device=META), (n, k), torch.bfloat16)


def _operands(m, n, k, dtype, bias):
    x = torch.empty(m, k, dtype=dtype, device=META)
    y = torch.empty(m, n, dtype=dtype, device=META)
    return x, y, (torch.empty(n, dtype=dtype, device=META) if bias else None)


# Each case: (path, M, layer (N, K), bias, W4A4 operand, extra) -> the launches of that path's builder.
def _gemv(m, n, k, dtype, bias, w4a4, dependent=False):
    from fp4ptq.kernels import gemv

    words, sbits, enc = _weight(n, k)
    x, y, b = _operands(m, n, k, dtype, bias)
    xenc = enc if w4a4 else None
    gemv._gemv6(x, words, sbits, enc, enc, b if bias else enc, y, m, n, k, bias, xenc,
                dependent=dependent)(x, y)


def _gluon(module_name, m, n, k, dtype, bias, w4a4, **kw):
    import importlib

    module = importlib.import_module(f"fp4ptq.kernels.{module_name}")
    words, sbits, enc = _weight(n, k)
    x, y, b = _operands(m, n, k, dtype, bias)
    module.launches(x, words, sbits, enc, enc if w4a4 else None, b, y, **kw)(x, y)


def _tiled(m, n, k, dtype, bias, w4a4):
    from fp4ptq.kernels import gemm

    x, y, b = _operands(m, n, k, dtype, bias)
    xenc = torch.empty(1, dtype=torch.float32, device=META) if w4a4 else None
    gemm._matmul(x, _nvfp4_weight(n, k), b, xenc, path="gemm", out=y)


def _dequant(n, k, dtype):
    from fp4ptq.kernels import gemm

    gemm.dequantize(_nvfp4_weight(n, k), dtype)


def _gemv4(m, n, k, dtype, bias, w4a4):
    """The fp32 GEMV, where the dispatch takes it (layers of 2^31 blocks and more, K % 64 != 0)."""
    from fp4ptq.kernels import dispatch, gemm

    assert dispatch.choose(m, dtype, w4a4, k, torch.device("cuda", 0), n) == "gemv4"
    x, y, b = _operands(m, n, k, dtype, bias)
    xenc = torch.empty(1, dtype=torch.float32, device=META) if w4a4 else None
    gemm._matmul(x, _nvfp4_weight(n, k), b, xenc, path="gemv4", out=y)


# MoE layers (E experts, top-k, hidden H, expert width I): the benchmark's (benchmarks/bench_moe_h200.py)
MOE_LAYERS = {"Qwen3-30B-A3B": (128, 8, 2048, 768), "Mixtral-8x7B": (8, 2, 4096, 14336)}


def _stacked(e, n, k, w4a4):
    from fp4ptq.kernels.grouped import StackedWeight

    amax = torch.empty(e, dtype=torch.float32, device=META) if w4a4 else None
    return StackedWeight(torch.empty(e, n, k // 2, dtype=torch.uint8, device=META),
                         torch.empty(e, n, k // 16, dtype=torch.float8_e4m3fn, device=META),
                         torch.empty(e, dtype=torch.float32, device=META), None, amax, "mse" if w4a4 else None)


def _moe(model, tokens, dtype, w4a4):
    """A MoE layer's launches as ``kernels.moe_experts`` makes them (SwiGLU): the routing, w13 (W4A4: after
    its ``quantize_pairs`` prologue; prefill W4A16 bf16 on sm_90: dequantized experts), the gating, w2 and
    the weighted combine."""
    from fp4ptq.kernels import grouped

    e, top, h, inter = MOE_LAYERS[model]
    hidden = torch.empty(tokens, h, dtype=dtype, device=META)
    index = torch.empty(tokens, top, dtype=torch.int64, device=META)
    weights = torch.empty(tokens, top, dtype=dtype, device=META)
    grouped.moe(hidden, index, weights, _stacked(e, 2 * inter, h, w4a4), _stacked(e, h, inter, w4a4))


def _quantize(m, k, dtype, four_six, emit, trigger=False):
    from fp4ptq.kernels import quantize_kernel as qk

    x = torch.empty(m, k, dtype=dtype, device=META)
    amax = torch.empty(1, dtype=torch.float32, device=META)
    words = qk._words(x) if qk._takes_quant16(x, emit, None) else None
    qk.quantize_launches(x, words, amax, four_six, emit, None, trigger=trigger)(
        x if words is None else words, amax)


def _cases(arch: int) -> dict:
    """label -> a function of the dtype that makes that case's launches."""
    qkv, gate_up, down, d70, smol, qdown = ((6144, 4096), (28672, 4096), (4096, 14336), (8192, 28672),
                                           (576, 1536), (3584, 18944))
    cases = {
        # GEMV (M <= 2): narrow single segment (loads ahead at M = 1), large prefetching, K split,
        # streamed x (whole and masked steps), small layer; W4A4 operand with PDL, bias
        "gemv/8B.qkv/M1": lambda dt: _gemv(1, *qkv, dt, False, False),
        "gemv/8B.qkv/M2+bias": lambda dt: _gemv(2, *qkv, dt, True, False),
        "gemv/8B.gate_up/M1": lambda dt: _gemv(1, *gate_up, dt, False, False),
        "gemv/8B.down/M1": lambda dt: _gemv(1, *down, dt, False, False),
        "gemv/70B.down/M1": lambda dt: _gemv(1, *d70, dt, False, False),
        "gemv/Qwen2-7B.down/M1": lambda dt: _gemv(1, *qdown, dt, False, False),
        "gemv/SmolLM2.down/M1": lambda dt: _gemv(1, *smol, dt, False, False),
        "gemv/8B.qkv/M1/w4a4-pdl": lambda dt: _gemv(1, *qkv, dt, False, True, dependent=arch >= 90),
        # mma.py: M = 2 on a large layer, 16 (split K), 64, W4A4 as the quantize launch's dependent
        "mma/8B.gate_up/M2": lambda dt: _gluon("mma", 2, *gate_up, dt, False, False),
        "mma/8B.qkv/M16": lambda dt: _gluon("mma", 16, *qkv, dt, False, False),
        "mma/8B.down/M64+bias": lambda dt: _gluon("mma", 64, *down, dt, True, False),
        "mma/8B.o/M16/w4a4-pdl": lambda dt: _gluon("mma", 16, 4096, 4096, dt, False, True,
                                                   dependent=arch >= 90),
        # tiled GEMM (M <= 64 where mma.py cannot run) and the dequantize kernel before cuBLAS
        "gemm/M16+bias/w4a4": lambda dt: _tiled(16, 4096, 4096 + 16, dt, True, True),
        "gemm/M64": lambda dt: _tiled(64, 4096, 4096 + 16, dt, False, False),
        "dequant/8B.qkv": lambda dt: _dequant(*qkv, dt),
        # quantize kernels: fp32-compare (1-2 rows), 16-bit per block / with its table, Four Over Six,
        # the scaled W4A4 operand
        "quantize/M1/scaled": lambda dt: _quantize(1, 4096, dt, None, "scaled"),
        "quantize/M1/mse": lambda dt: _quantize(1, 4096, dt, "mse", "packed"),
        "quantize16/M16/scaled": lambda dt: _quantize(16, 4096, dt, None, "scaled", trigger=arch >= 90),
        "quantize16/M8192/packed": lambda dt: _quantize(8192, 28672, dt, None, "packed"),
        "quantize16/M1024/mse": lambda dt: _quantize(1024, 4096, dt, "mse", "packed"),
        "quantize16/M8192/mse": lambda dt: _quantize(8192, 4096, dt, "mse", "packed"),
        # the fp32 GEMV (path "gemv4"): a 2^31-block layer with K % 64 != 0 (mma.py takes the others)
        "gemv4/262144x131088/M1": lambda dt: _gemv4(1, 262144, 131088, dt, False, False),
        "gemv4/262144x131088/M2+bias/w4a4": lambda dt: _gemv4(2, 262144, 131088, dt, True, True),
        # MoE layers (kernels.moe_experts): decode (16-row tiles, K split where the grid is short: a narrow
        # tile, fp32 partials summed by the gating and the combine; the routing in one launch), 64-row
        # tiles, prefill (128-row tiles; the routing in three launches); W4A4 with its prologue
        "moe/Qwen3-30B-A3B/T1": lambda dt: _moe("Qwen3-30B-A3B", 1, dt, False),
        "moe/Mixtral-8x7B/T1": lambda dt: _moe("Mixtral-8x7B", 1, dt, False),
        "moe/Qwen3-30B-A3B/T4096": lambda dt: _moe("Qwen3-30B-A3B", 4096, dt, False),
        "moe-w4a4/Qwen3-30B-A3B/T1": lambda dt: _moe("Qwen3-30B-A3B", 1, dt, True),
        "moe-w4a4/Mixtral-8x7B/T256": lambda dt: _moe("Mixtral-8x7B", 256, dt, True),
    }
    if arch >= 90:
        cases.update({
            # wgmma.py (65..128 where wsgemm.py does not run)
            "wgmma/4096x1024/M96": lambda dt: _gluon("wgmma", 96, 4096, 1024, dt, False, False),
            "wgmma/8B.o/M128+bias/w4a4": lambda dt: _gluon("wgmma", 128, 4096, 4096, dt, True, True),
            # wsgemm.py: 64-, 128-, wide and 256-row (swapped) tiles, split tails summed in / after the launch
            "wsgemm/8B.qkv/M64": lambda dt: _gluon("wsgemm", 64, *qkv, dt, False, False),
            "wsgemm/8B.gate_up/M128+bias": lambda dt: _gluon("wsgemm", 128, *gate_up, dt, True, False),
            "wsgemm/Qwen2-72B.qkv/M96": lambda dt: _gluon("wsgemm", 96, 10240, 8192, dt, False, False),
            "wsgemm/8B.qkv/M1024/w4a4": lambda dt: _gluon("wsgemm", 1024, *qkv, dt, False, True),
            "wsgemm/8B.o/M1024+bias": lambda dt: _gluon("wsgemm", 1024, 4096, 4096, dt, True, False),
            "wsgemm/70B.down/M320": lambda dt: _gluon("wsgemm", 320, *d70, dt, False, False),
        })
    return cases


# --------------------------------------------------------------------------- #
# Compiling the recorded launches, and the PTX's hash
# --------------------------------------------------------------------------- #
def _spec(kernel, args, kwargs):
    """(kernel, signature types, compile-time arguments, divisible integers, options) of a launch, as
    Triton specializes it at run time (16-byte aligned pointers, integers equal to 1 or multiples of 16)."""
    from triton.runtime.jit import mangle_type

    names = kernel.arg_names
    constexprs = {a: v for a, v in kwargs.items() if a not in LAUNCH_OPTIONS}
    types, divisible = {}, []
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor):
            types[name] = POINTER[a.dtype]
        elif isinstance(a, bool) or a is None:
            raise AssertionError(f"{kernel}: argument {name} = {a!r}")
        elif isinstance(a, int):
            if a == 1:
                constexprs[name] = 1
            elif a % 16 == 0:
                divisible.append(name)
        else:
            types[name] = mangle_type(a)
    options = {a: kwargs[a] for a in LAUNCH_OPTIONS if a in kwargs}
    return kernel, types, constexprs, tuple(divisible), options


def normalized(ptx: str) -> str:
    """The PTX without what moves when only the Python source around a kernel does: the debug
    file / line records and the DWARF sections, and comments."""
    ptx = ptx.split("\t.section\t.debug_abbrev")[0]
    keep = []
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith((".file", ".loc", "//")) or "\t.section\t.debug" in line:
            continue
        keep.append(line.rstrip())
    return "\n".join(keep) + "\n"


def _ptx_only(*args):
    """Triton's stage hook: the pipeline ends at the PTX (its cubin stage, ptxas, about a sixth of the compile
    time, gives an empty binary); called without arguments, the key that keeps these builds apart in
    Triton's cache."""
    if not args:
        return "ptx-only", hashlib.sha256(b"ptx-only").hexdigest()
    args[1]["cubin"] = lambda src, metadata: b""


def _compiled(spec, arch: int) -> str:
    from compile_target import compile_for
    from triton import knobs

    kernel, types, constexprs, divisible, options = spec
    gluon = type(kernel).__name__.startswith("Gluon")
    hook, knobs.runtime.add_stages_inspection_hook = knobs.runtime.add_stages_inspection_hook, _ptx_only
    try:
        built = compile_for(kernel, types, constexprs, arch=arch, gluon=gluon, divisible=divisible, **options)
    finally:
        knobs.runtime.add_stages_inspection_hook = hook
    return hashlib.sha256(normalized(built.asm["ptx"]).encode()).hexdigest()


# The builds the test compiles (``_ci_build``): at least one of every kernel on each GPU in each activation
# dtype that the record holds, with the grouped MoE kernel's W4A16 and W4A4 builds apart (``_path``; checked
# by test_the_ci_set_builds_every_path_and_dtype_on_both_gpus), picked for the least compile time. An entry
# names a case (all its launches) or one build of it. ``python tests/test_ptx_hashes.py --check --all``
# compiles every case in both dtypes for both GPUs: run it for any change of the kernels.
REPRESENTATIVE = (
    "sm_80/dequant/8B.qkv/bf16", "sm_80/dequant/8B.qkv/fp16", "sm_80/gemm/M64/bf16", "sm_80/gemm/M64/fp16",
    "sm_80/gemv/70B.down/M1/bf16", "sm_80/gemv/8B.down/M1/fp16", "sm_80/gemv/8B.qkv/M1/w4a4-pdl/fp16",
    "sm_80/gemv/SmolLM2.down/M1/bf16/0:_gemv_resident_kernel",
    "sm_80/gemv/SmolLM2.down/M1/fp16/1:_gemv_split_finish", "sm_80/gemv4/262144x131088/M1/bf16",
    "sm_80/gemv4/262144x131088/M2+bias/w4a4/fp16", "sm_80/mma/8B.gate_up/M2/bf16/1:_gemv_split_finish",
    "sm_80/mma/8B.gate_up/M2/fp16/0:_mma_kernel", "sm_80/mma/8B.qkv/M16/bf16/0:_mma_kernel",
    "sm_80/moe-w4a4/Mixtral-8x7B/T256/bf16/1:_route_scan_kernel",
    "sm_80/moe-w4a4/Mixtral-8x7B/T256/bf16/5:_swiglu_kernel",
    "sm_80/moe-w4a4/Mixtral-8x7B/T256/bf16/6:_quantize_pairs_kernel",
    "sm_80/moe-w4a4/Mixtral-8x7B/T256/bf16/8:_combine_kernel",
    "sm_80/moe-w4a4/Mixtral-8x7B/T256/fp16/1:_route_scan_kernel",
    "sm_80/moe-w4a4/Mixtral-8x7B/T256/fp16/5:_swiglu_kernel",
    "sm_80/moe-w4a4/Qwen3-30B-A3B/T1/bf16/2:_grouped_kernel",
    "sm_80/moe-w4a4/Qwen3-30B-A3B/T1/fp16/2:_grouped_kernel",
    "sm_80/moe-w4a4/Qwen3-30B-A3B/T1/fp16/4:_quantize_pairs_kernel",
    "sm_80/moe/Mixtral-8x7B/T1/bf16/0:_route_one_chunk_kernel", "sm_80/moe/Mixtral-8x7B/T1/bf16/3:_grouped_kernel",
    "sm_80/moe/Mixtral-8x7B/T1/fp16/0:_route_one_chunk_kernel", "sm_80/moe/Mixtral-8x7B/T1/fp16/3:_grouped_kernel",
    "sm_80/moe/Mixtral-8x7B/T1/fp16/4:_combine_kernel", "sm_80/moe/Qwen3-30B-A3B/T4096/bf16/0:_route_hist_kernel",
    "sm_80/moe/Qwen3-30B-A3B/T4096/bf16/2:_route_place_kernel",
    "sm_80/moe/Qwen3-30B-A3B/T4096/fp16/0:_route_hist_kernel",
    "sm_80/moe/Qwen3-30B-A3B/T4096/fp16/2:_route_place_kernel", "sm_80/quantize/M1/scaled/bf16",
    "sm_80/quantize/M1/scaled/fp16", "sm_80/quantize16/M16/scaled/fp16", "sm_80/quantize16/M8192/mse/bf16",
    "sm_90/dequant/8B.qkv/bf16", "sm_90/dequant/8B.qkv/fp16", "sm_90/gemm/M16+bias/w4a4/bf16",
    "sm_90/gemm/M16+bias/w4a4/fp16", "sm_90/gemv/Qwen2-7B.down/M1/bf16", "sm_90/gemv/Qwen2-7B.down/M1/fp16",
    "sm_90/gemv/SmolLM2.down/M1/bf16", "sm_90/gemv/SmolLM2.down/M1/fp16", "sm_90/gemv4/262144x131088/M1/fp16",
    "sm_90/gemv4/262144x131088/M2+bias/w4a4/bf16", "sm_90/mma/8B.gate_up/M2/fp16/0:_mma_kernel",
    "sm_90/mma/8B.o/M16/w4a4-pdl/bf16/0:_mma_kernel", "sm_90/moe-w4a4/Mixtral-8x7B/T256/bf16/0:_route_hist_kernel",
    "sm_90/moe-w4a4/Mixtral-8x7B/T256/bf16/1:_route_scan_kernel",
    "sm_90/moe-w4a4/Mixtral-8x7B/T256/bf16/2:_route_place_kernel",
    "sm_90/moe-w4a4/Mixtral-8x7B/T256/bf16/6:_quantize_pairs_kernel",
    "sm_90/moe-w4a4/Mixtral-8x7B/T256/bf16/8:_combine_kernel",
    "sm_90/moe-w4a4/Mixtral-8x7B/T256/fp16/0:_route_hist_kernel",
    "sm_90/moe-w4a4/Mixtral-8x7B/T256/fp16/1:_route_scan_kernel",
    "sm_90/moe-w4a4/Mixtral-8x7B/T256/fp16/2:_route_place_kernel",
    "sm_90/moe-w4a4/Mixtral-8x7B/T256/fp16/6:_quantize_pairs_kernel",
    "sm_90/moe-w4a4/Mixtral-8x7B/T256/fp16/8:_combine_kernel",
    "sm_90/moe-w4a4/Qwen3-30B-A3B/T1/bf16/3:_swiglu_kernel",
    "sm_90/moe-w4a4/Qwen3-30B-A3B/T1/bf16/5:_grouped_kernel",
    "sm_90/moe-w4a4/Qwen3-30B-A3B/T1/fp16/2:_grouped_kernel",
    "sm_90/moe-w4a4/Qwen3-30B-A3B/T1/fp16/3:_swiglu_kernel",
    "sm_90/moe/Mixtral-8x7B/T1/bf16/0:_route_one_chunk_kernel",
    "sm_90/moe/Mixtral-8x7B/T1/fp16/0:_route_one_chunk_kernel", "sm_90/moe/Qwen3-30B-A3B/T1/bf16/1:_grouped_kernel",
    "sm_90/moe/Qwen3-30B-A3B/T1/fp16/1:_grouped_kernel",
    "sm_90/moe/Qwen3-30B-A3B/T4096/bf16/3:_dequant_experts_kernel", "sm_90/quantize/M1/scaled/bf16",
    "sm_90/quantize/M1/scaled/fp16", "sm_90/quantize16/M16/scaled/fp16", "sm_90/quantize16/M8192/packed/bf16",
    "sm_90/wgmma/8B.o/M128+bias/w4a4/bf16/0:_wgmma_kernel", "sm_90/wgmma/8B.o/M128+bias/w4a4/fp16/0:_wgmma_kernel",
    "sm_90/wsgemm/8B.qkv/M64/bf16/0:_ws_kernel", "sm_90/wsgemm/8B.qkv/M64/fp16/0:_ws_kernel",
)


def _ci_build(case: str, label: str) -> bool:
    """Whether the test compiles build ``label`` of ``case`` ("sm_ARCH/case/dtype")."""
    return case in REPRESENTATIVE or label in REPRESENTATIVE


def ptx_hashes(log=None, every: bool = False, only=None) -> dict:
    """label -> PTX hash of the recorded launches of the ``REPRESENTATIVE`` cases and builds (``every``: of
    every case in both dtypes; ``only``: of the cases ``"sm_ARCH/case/dtype"`` for which ``only`` is true), for
    sm_90 and sm_80 (and ``dot_scaled`` for sm_100, where it runs, unless ``only`` is given)."""
    out, built = {}, {}
    for arch in ARCHS:
        for case, make in _cases(arch).items():
            for dname, dtype in DTYPES.items():
                name = f"sm_{arch}/{case}/{dname}"
                ci = not (only or every)
                if only and not only(name) or ci and not any(r == name or r.startswith(name + "/")
                                                            for r in REPRESENTATIVE):
                    continue
                with _device(arch):
                    make(dtype)
                    launches = list(_Recorded.built)
                for i, launch in enumerate(launches):
                    spec = _spec(*launch)
                    key = (arch, spec[0].__name__ if hasattr(spec[0], "__name__") else spec[0].fn.__name__,
                           repr(sorted(spec[1].items())), repr(sorted(spec[2].items(), key=lambda kv: kv[0])),
                           spec[3], repr(sorted(spec[4].items())))
                    if ci and not _ci_build(name, f"{name}/{i}:{key[1]}"):
                        continue
                    if key not in built:
                        t0 = time.time()
                        built[key] = _compiled(spec, arch)
                        if log:
                            log(f"sm_{arch} {case} {dname} #{i}: {key[1]} {time.time() - t0:.1f} s")
                    out[f"{name}/{i}:{key[1]}"] = built[key]
    if only is None:
        out.update(_dot_scaled_hashes())
    return out


def _dot_scaled_hashes() -> dict:
    """W4A4 on the FP4 tensor cores (sm_100 and later only: compiled for sm_100)."""
    from fp4ptq.kernels import dot_scaled as ds

    types = {"x_ptr": "*u8", "xs_ptr": "*fp8e4nv", "w_ptr": "*u8", "ws_ptr": "*fp8e4nv", "wenc_ptr": "*fp32",
             "xenc_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16"}
    bm, bn, bk, group, warps, stages = 128, 128, 128, 8, 4, 3
    consts = dict(X_FMT="e2m1", HAS_BIAS=True, HAS_XENC=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
                  EVEN_K=True)
    spec = (ds._dot_scaled_kernel, types, consts, ("K", "stride_xm", "stride_ym"), dict(num_warps=warps,
                                                                                          num_stages=stages))
    return {"sm_100/dot_scaled/w4a4/0:_dot_scaled_kernel": _compiled(spec, 100)}


# --------------------------------------------------------------------------- #
# The dispatch's choice for every README and model-zoo row
# --------------------------------------------------------------------------- #
def dispatch_table() -> dict:
    """"sm_ARCH/layer/kind" -> "M1: path config | M16: ..." for the README's and the zoo's layers (kind:
    W4A16 or W4A4, bf16 or fp16); the config: the path's tile, split and options as its rules give them."""
    from fp4ptq.kernels import dispatch, gemm, gemv, mma, wgmma, wsgemm

    out = {}
    for arch, sms in ARCHS.items():
        with _device(arch) as device:
            for layers, ms in ((README_LAYERS, README_MS), (ZOO_LAYERS, ZOO_MS)):
                for layer, (n, k) in layers.items():
                    for m in ms:
                        for dname, dtype in DTYPES.items():
                            for w4a4 in (False, True):
                                path = dispatch.choose(m, dtype, w4a4, k, device, n)
                                if path == "mma":
                                    cfg = mma.config(m, n, k, sms)
                                elif path == "wgmma":
                                    cfg = wgmma.config(m, n, k, sms)
                                elif path == "wsgemm":
                                    c = wsgemm.config(m, n, k, sms)
                                    cfg = (c, wsgemm.plan(m, n, k, sms, c)[:4], wsgemm.swapped(c))
                                elif path == "gemv6":
                                    cfg = gemv._gemv7_config(m, n, k)
                                    if cfg is not None and dtype == torch.float16:
                                        cfg = gemv._gemv7_f16_config(n, k, cfg)
                                    cfg = ("gemv7", cfg) if cfg is not None else gemv._gemv6_config(m, n, k)
                                elif path == "gemm":
                                    cfg = gemm._gemm_config(m, n, k)
                                else:
                                    cfg = ""
                                kind = ("w4a4" if w4a4 else "w4a16") + "/" + dname
                                out.setdefault(f"sm_{arch}/{layer}/{kind}", []).append(f"M{m}: {path} {cfg}".strip())
    return {key: " | ".join(rows) for key, rows in out.items()}


def _compare(got: dict, want: dict) -> list:
    return [f"{key}: recorded {want.get(key)!r}, now {got.get(key)!r}"
            for key in sorted(set(got) | set(want)) if got.get(key) != want.get(key)]


def test_dispatch_picks_the_recorded_path_tile_and_split():
    pytest.importorskip("triton.experimental.gluon")
    want = json.loads(DISPATCH_FILE.read_text())
    assert not _compare(dispatch_table(), want)


def _triton_mismatch(want: dict):
    """Why the recorded hashes cannot be checked with the installed Triton (None when they can): the PTX
    Triton generates changes between its versions, so the record holds the version it was made with."""
    import triton

    recorded = want.get(TRITON_KEY)
    if recorded == triton.__version__:
        return None
    return (f"the PTX hashes in {PTX_FILE.name} were recorded with Triton {recorded}, this is Triton "
            f"{triton.__version__}: install triton=={recorded} (as .ci/run does) to check them. To move the record "
            f"to this Triton, first check an unchanged commit with Triton {recorded} (--check --all), then "
            f"re-record every build with this one: PYTHONPATH=$PWD python tests/test_ptx_hashes.py")


def test_dispatched_kernels_compile_to_the_recorded_ptx():
    pytest.importorskip("triton.experimental.gluon")
    want = json.loads(PTX_FILE.read_text())
    mismatch = _triton_mismatch(want)
    if mismatch:
        pytest.skip(mismatch)
    got = ptx_hashes()
    assert len(got) >= 20 and not _compare(got, {label: want.get(label) for label in got})


def _path(label: str) -> tuple:
    """(arch, path, dtype) of a recorded build ``sm_ARCH/family/.../dtype/i:kernel``: the path is the kernel
    (``_gemv_resident_kernel`` -> "gemv_resident"), the grouped MoE kernel's W4A4 builds apart ("grouped/w4a4")."""
    case, kernel = label.split(":")
    arch, family = case.split("/")[:2]
    path = kernel.strip("_").removesuffix("_kernel")
    return arch, path + ("/w4a4" if path == "grouped" and family == "moe-w4a4" else ""), case.split("/")[-2]


def test_the_ci_set_builds_every_path_and_dtype_on_both_gpus():
    """``REPRESENTATIVE`` (what the test above compiles) names recorded cases and builds, and holds a build of
    every (arch, path, dtype) that the record holds for sm_90 and sm_80."""
    want = json.loads(PTX_FILE.read_text())
    labels = [label for label in want if label.split("/")[0] in {f"sm_{a}" for a in ARCHS}]
    assert set(REPRESENTATIVE) <= set(labels) | {label.rsplit("/", 1)[0] for label in labels}
    every = {_path(label) for label in labels}
    ci = {_path(label) for label in labels if _ci_build(label.rsplit("/", 1)[0], label)}
    assert len(every) >= 70 and not every - ci, f"not in REPRESENTATIVE: {sorted(every - ci)}"


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    import triton

    sys.path.insert(0, str(Path(__file__).parent))
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731
    args = sys.argv[1:]
    if "--check" in args or "--add" in args:
        want = json.loads(PTX_FILE.read_text())
        if _triton_mismatch(want):
            sys.exit(_triton_mismatch(want))
    if "--add" in args:  # new cases only: every recorded build stays as it is
        known = {label.rsplit("/", 1)[0] for label in want}
        added = ptx_hashes(log=log, only=lambda name: name not in known)
        _write(PTX_FILE, {**added, **want})
        print(f"added {len(added)} builds to {PTX_FILE}: " + ", ".join(sorted({k.rsplit('/', 1)[0] for k in added})))
        sys.exit(0)
    table = dispatch_table()
    hashes = ptx_hashes(log=log, every="--check" not in args or "--all" in args)
    if "--check" in args:
        diff = _compare(table, json.loads(DISPATCH_FILE.read_text())) + _compare(hashes, {k: want.get(k) for k in hashes})
        print("\n".join(diff) or "unchanged")
        sys.exit(1 if diff else 0)
    _write(DISPATCH_FILE, table)
    _write(PTX_FILE, {**hashes, TRITON_KEY: triton.__version__})
    print(f"wrote {DISPATCH_FILE} ({len(table)} rows) and {PTX_FILE} ({len(hashes)} builds, Triton {triton.__version__})")
