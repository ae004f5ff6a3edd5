"""Which kernel takes a call, with which tile and K split: the rules of ``rules.py`` (``RULES``: the path;
``TILES``: the tile and split) read against the device by ``choose`` and ``plan``.

Paths: "gemv6" (the GEMVs, ``gemv.py``: x resident in registers, or streamed on the long-K layers),
"gemv4" (the fp32 GEMV, for layers of 2^31 blocks and more), "mma" (``mma.py``, Gluon ``mma.sync``),
"wgmma" (``wgmma.py``, sm_90), "wsgemm" (``wsgemm.py``, the warp-specialized sm_90 GEMM),
"dot_scaled" (``dot_scaled.py``, W4A4 on the FP4 tensor cores of sm_100+), "gemm" (the tiled Triton
GEMM, ``gemm.py``), "cublas" (dequantize, then cuBLAS). This module holds the conditions of the rules
that ask the device (``CONDITIONS``: a kernel's self-test, the SM count); ``rules.py`` imports no kernel
family, so each family's ``config`` reads its tile rows there. ``tests/test_ptx_hashes.py`` holds the
path, tile and split this gives for the README's and the model zoo's layers on sm_90 and sm_80.
"""
from __future__ import annotations

import importlib
from collections import namedtuple
from typing import Optional

import torch

from . import _common, gemv, rules
from ._common import cdiv
from .rules import GEMV_MAX_M, RULES, Call  # noqa: F401 - the rules, read here

Plan = namedtuple("Plan", "path tile split")


def _bf16_below_sm80(c: Call) -> bool:
    """bf16 activations on a GPU below sm_80 (T4, RTX 20), where the GEMVs' bf16x2 arithmetic is not PTX."""
    return c.dtype == torch.bfloat16 and gemv_bf16_reason(c.device) is not None


def _too_many_blocks(c: Call) -> bool:
    """More blocks than gemv6 / gemv7's 32-bit offsets address (``gemv.GEMV6_MAX_BLOCKS``)."""
    return not gemv._block_offsets_fit(c.n, c.k)


def _mma_ready(c: Call) -> bool:
    """mma.py takes the input and passed its self-test on the device."""
    return c.device is not None and mma_unavailable_reason(c.m, c.k, c.dtype, c.device) is None


def _sm90_module(path: str, c: Call):
    """The sm_90 Gluon module of ``path`` where it may run on ``c.device`` (a GPU, not the interpreter,
    Gluon importable), else None."""
    if c.device is None or c.device.type != "cuda" or _common.INTERPRET:
        return None
    try:
        return importlib.import_module(f".{path}", __package__)
    except Exception:  # noqa: BLE001 - Gluon missing or changed in this Triton (the guard says so)
        return None


def _wsgemm_fills(c: Call) -> bool:
    """wsgemm.py's plan for the device's SMs splits the last wave or fills the SMs (``wsgemm.fills``)."""
    module = _sm90_module("wsgemm", c)
    return module is not None and module.supports(c.m, c.n, c.k) \
        and module.fills(c.m, c.n, c.k, _common._sm_count(c.device))


def _wsgemm_ready(c: Call) -> bool:
    """wsgemm.py takes the input and passed its self-test on the device (sm_90)."""
    return c.device is not None and gluon_sm90_reason("wsgemm", *c[:4], c.device) is None


def _wgmma_ready(c: Call) -> bool:
    """wgmma.py takes the input and passed its self-test on the device (sm_90)."""
    return c.device is not None and gluon_sm90_reason("wgmma", *c[:4], c.device) is None


def _dot_scaled_ready(c: Call) -> bool:
    """The FP4 tensor cores (sm_100+) passed ``dot_scaled``'s self-test on the device."""
    if c.device is None or c.device.type != "cuda":
        return False
    from . import dot_scaled

    return dot_scaled.ready(c.device, "e2m1") is None


# the conditions of ``rules.RULES``: the device's here, the GEMVs' shape conditions from gemv.py
CONDITIONS = {**gemv.CONDITIONS, "bf16_below_sm80": _bf16_below_sm80, "too_many_blocks": _too_many_blocks,
              "mma_ready": _mma_ready, "wsgemm_fills": _wsgemm_fills, "wsgemm_ready": _wsgemm_ready,
              "wgmma_ready": _wgmma_ready, "dot_scaled_ready": _dot_scaled_ready}


def choose(m: int, dtype: torch.dtype, w4a4: bool, k: int = 0, device: Optional[torch.device] = None,
           n: int = 0) -> str:
    """The path of the first ``rules.RULES`` row that holds for M rows of ``dtype`` activations times an
    [N, K] weight on ``device`` (W4A4 when ``w4a4``). Its first answer for a Gluon path may run that
    kernel's self-test there."""
    found = rules.first(RULES, Call(m, n, k, dtype, device, w4a4), conditions=CONDITIONS)
    if found is None:
        raise AssertionError("the last rule takes every call")
    return found.path


def plan(m: int, n: int, k: int, dtype: torch.dtype, w4a4: bool = False,
         device: Optional[torch.device] = None) -> Plan:
    """What runs for M rows of ``dtype`` activations times an [N, K] weight on ``device``: the path
    (``choose``), its tile (``rules.TILES`` through the family's ``config``, completed for the device's SM
    count; gemv6's path gives ``("gemv7", tile)`` where the streamed-x GEMV runs) and its K split (K per
    program of mma.py / wgmma.py, gemv6's K segment, wsgemm.py's ``plan``: ``(full tiles, splits, K steps a
    part, first split weight tile)``; None where a path does not split K)."""
    path = choose(m, dtype, w4a4, k, device, n)
    if path == "gemv6":
        cfg7 = gemv._gemv7_config(m, n, k)
        if cfg7 is None:
            cfg = gemv._gemv6_config(m, n, k)
            return Plan(path, cfg, cfg[3])
        return Plan(path, ("gemv7", gemv._gemv7_f16_config(n, k, cfg7) if dtype == torch.float16 else cfg7), None)
    if path == "gemv4":
        return Plan(path, gemv._gemv4_config(m, n, k), None)
    if path == "gemm":
        return Plan(path, rules.tile("gemm", m, n, k), None)
    if path in ("mma", "wgmma", "wsgemm"):
        module = importlib.import_module(f".{path}", __package__)
        sms = _common._sm_count(device)
        cfg = module.config(m, n, k, sms)
        return Plan(path, cfg, module.plan(m, n, k, sms, cfg)[:4] if path == "wsgemm" else cfg[4])
    return Plan(path, None, None)


def mma_unavailable_reason(m: int, k: int, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why the Gluon tensor-core kernel (path "mma") cannot take this input (None when it can)."""
    if _common.INTERPRET or device.type != "cuda":
        return "the mma path is a Gluon kernel: CUDA only, the Triton interpreter cannot run it"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the mma path takes bf16 or fp16 activations, got {dtype}"
    if not 0 < m <= 64 or k % 64:
        return f"the mma path takes 1 <= M <= 64 rows and K % 64 == 0, got M={m}, K={k}"
    try:
        from . import mma
    except Exception as exc:  # noqa: BLE001 - Gluon missing or changed in this Triton
        return f"Triton's Gluon dialect is not usable here ({exc})"
    return mma.ready(device)  # the GPU's support (sm_80 on, bf16 and fp16), compile and self-test: once a device


# K multiple each sm_90 Gluon kernel takes: wgmma.py's K steps go in pairs of 64; wsgemm.py's steps are 64
# (its scale bytes come by TMA from rows padded to 16-byte strides where K % 256 != 0: wsgemm.tma_scales).
GLUON_SM90_K = {"wgmma": 128, "wsgemm": 64}


def gluon_sm90_reason(path: str, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why the sm_90 Gluon kernel of ``path`` ("wgmma": wgmma.py, "wsgemm": wsgemm.py) cannot take
    this input (None when it can): CUDA, bf16/fp16 activations, its K multiple, then the module's
    ``ready`` (sm_90, compile and self-test: decided once per device)."""
    if _common.INTERPRET or device.type != "cuda":
        return f"the {path} path is a Gluon kernel: CUDA only, the Triton interpreter cannot run it"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the {path} path takes bf16 or fp16 activations, got {dtype}"
    if m <= 0 or n <= 0 or k % GLUON_SM90_K[path]:
        return f"the {path} path takes K % {GLUON_SM90_K[path]} == 0, got M={m}, N={n}, K={k}"
    try:
        module = importlib.import_module(f".{path}", __package__)
    except Exception as exc:  # noqa: BLE001 - Gluon missing or changed in this Triton
        return f"Triton's Gluon dialect is not usable here ({exc})"
    return module.ready(device)


def wgmma_unavailable_reason(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why the Gluon wgmma kernel (path "wgmma") cannot take this input (None when it can)."""
    return gluon_sm90_reason("wgmma", m, n, k, dtype, device)


def wsgemm_unavailable_reason(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why the warp-specialized Gluon kernel (path "wsgemm") cannot take this input (None when it can)."""
    return gluon_sm90_reason("wsgemm", m, n, k, dtype, device)


def gemv_bf16_reason(device: Optional[torch.device]) -> Optional[str]:
    """Why the GEMVs cannot take bf16 activations on ``device`` (None when they can): their block sums
    (and W4A4's quantization inside gemv6, whose operand is bf16 pairs whatever x's dtype) are
    ``fma.rn.bf16x2``, which PTX has from sm_80; below it (T4, RTX 20: sm_75) the dispatch gives those
    calls to the tiled GEMM (M <= 2), and W4A4 quantizes in its own launch."""
    if device is None or device.type != "cuda" or _common.INTERPRET or torch.version.hip:
        return None
    major, minor = _common._capability(device)
    if (major, minor) < (8, 0):
        return f"the GEMVs' bf16 arithmetic (fma.rn.bf16x2) needs sm_80 or later; this GPU is sm_{major}{minor}"
    return None


def w4a4_pairs(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether W4A4's mma.py launch for M rows of an [N, K] weight is the programmatic dependent of its
    quantize launch: ``w4a4_pdl``, and mma.py's grid (``mma.config``) is one where that measured faster.
    An empirical rule (H200, session 25, results/w4a4_pdl_h200_v*.json, plain -> dependent, us):
    grids of at most about one program an SM gained (Qwen2-7B qkv at M = 16, 144 programs: 12.91 ->
    12.19; 8B k at M = 32, 128: 9.81 -> 9.31; SmolLM2 qkv, 15: 6.96 -> 6.16), so did programs of at most
    4 K steps (Qwen2-7B o, 392 programs: 10.76 -> 9.70; Phi-3-mini o, 288: 9.84 -> 8.71) and grids whose
    warps fill the SMs (70B gate_up, 448 programs of 4 warps: 127.6 -> 123.1; 70B down, 512: -0.5 to
    -0.8); grids of 224-384 programs of 8-16 steps lost up to 41% (8B down at M = 16: 21.7 -> 30.6; 8B o
    10.5 -> 11.8; Gemma-2-9B o 10.5 -> 11.7) and stay plain. The likely cause (v6): the early-launched
    programs are placed unevenly while the quantize programs still hold the SMs; with at most a fair
    share of programs fitting an SM the dependent launch was faster on those grids too."""
    if not _common.w4a4_pdl(device):
        return False
    from . import mma

    sms = _common._sm_count(device)
    bn, _, bk, warps, k_split, _ = mma.config(m, n, k, sms)
    programs = cdiv(n, bn) * cdiv(k, k_split)  # (mma.programs)
    # at most 1.1 programs an SM, at most 4 K steps a program, or at least 13 warps an SM (of the 16 the
    # 128-register builds can hold)
    return programs * 10 <= sms * 11 or k_split // bk <= 4 or programs * warps >= sms * 13


def w4a4_pairs_path(path: str, m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether W4A4's GEMM on ``path`` is its quantize launch's programmatic dependent (the dispatch's
    and the plans' one decision): mma.py by ``w4a4_pairs``, gemv6 by ``gemv.w4a4_pairs_gemv``."""
    if path == "mma":
        return w4a4_pairs(m, n, k, device)
    return path == "gemv6" and gemv.w4a4_pairs_gemv(m, n, k, device)
