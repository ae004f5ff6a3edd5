"""Which kernel takes a call: the dispatch rules as one table (``RULES``), read by ``choose``.

Paths: "gemv6" (the GEMVs, ``gemv.py``: x resident in registers, or streamed on the long-K layers),
"gemv4" (the fp32 GEMV, for layers of 2^31 blocks and more), "mma" (``mma.py``, Gluon ``mma.sync``),
"wgmma" (``wgmma.py``, sm_90), "wsgemm" (``wsgemm.py``, the warp-specialized sm_90 GEMM),
"dot_scaled" (``dot_scaled.py``, W4A4 on the FP4 tensor cores of sm_100+), "gemm" (the tiled Triton
GEMM, ``gemm.py``), "cublas" (dequantize, then cuBLAS). The tile and K split of each path are its
module's ``config`` (``gemv._gemv6_config`` / ``_gemv7_config``, ``mma.config``, ``wgmma.config``,
``wsgemm.config`` and ``wsgemm.plan``, ``gemm._gemm_config``); the measurements behind every rule
are named where it is (``benchmarks/results/``) and summed up in ``docs/KERNELS.md``.
``tests/test_ptx_hashes.py`` holds the path, tile and split this gives for the README's and the model
zoo's layers on sm_90 and sm_80.
"""
from __future__ import annotations

import importlib
from collections import namedtuple
from typing import Optional

import torch

from . import _common, gemv
from ._common import cdiv

GEMV_MAX_M = 2       # the GEMVs take M <= 2 rows
MMA_MAX_M = 64       # mma.py takes M <= 64 (0: never; session-5 H200 sweeps, results/mma_h200_sweep*.json)
CUBLAS_MIN_M = 64    # dequantize + cuBLAS from M = 64 where no tensor-core kernel takes the call
WGMMA = True         # wgmma.py in use (results/wgmma_h200_v3.json: 1.05-1.37x dequantize + cuBLAS at M = 128)
WSGEMM = True        # wsgemm.py in use (results/wsgemm_h200_rule.json, wsgemm_h200_split.json)
WSGEMM_MIN_M = 0     # the least M wsgemm.py takes where above its own MIN_M (129: the rules before session 22)

Rule = namedtuple("Rule", "path least most w4a4 when")
NO_LIMIT = 1 << 62
# The first rule whose rows (least <= M <= most), kind (``w4a4``: True W4A4 only, None either) and every
# condition in ``when`` (the functions of ``CONDITIONS``) hold picks the path. M <= 2 first.
RULES = (
    # M <= 2: bf16 below sm_80 takes the tiled GEMM; mma.py at M = 2 on layers of 4M weights and more
    # (not the narrow ones where fp16 / W4A4 keep the GEMV) and on layers too large for gemv6's 32-bit
    # offsets; the fp32 GEMV on those if mma.py cannot run; else gemv6 (gemv7 on the long-K layers)
    Rule("gemm", 1, GEMV_MAX_M, None, ("bf16_below_sm80",)),
    Rule("mma", 2, 2, None, ("at_least_4m_weights", "not_narrow_gemv6_kept", "mma_ready")),
    Rule("mma", 1, GEMV_MAX_M, None, ("too_many_blocks", "above_25m_weights", "mma_ready")),
    Rule("gemv4", 1, GEMV_MAX_M, None, ("too_many_blocks",)),
    Rule("gemv6", 1, GEMV_MAX_M, None, ()),
    # M >= 3: W4A4 on the FP4 tensor cores (sm_100+); wsgemm.py where its rule takes the shape (sm_90,
    # M = 33..1024, W4A4 to 2048 / 8192); mma.py to M = 64; wgmma.py at 65..128 (sm_90); then
    # dequantize + cuBLAS from M = 64 and the tiled GEMM below (K % 64 != 0, or no Gluon)
    Rule("dot_scaled", GEMV_MAX_M + 1, NO_LIMIT, True, ("dot_scaled_ready",)),
    Rule("wsgemm", GEMV_MAX_M + 1, NO_LIMIT, None, ("wsgemm_preferred",)),
    Rule("mma", GEMV_MAX_M + 1, NO_LIMIT, None, ("mma_ready",)),
    Rule("wgmma", GEMV_MAX_M + 1, NO_LIMIT, None, ("wgmma_preferred",)),
    Rule("cublas", CUBLAS_MIN_M, NO_LIMIT, None, ()),
    Rule("gemm", 1, NO_LIMIT, None, ()),
)
Call = namedtuple("Call", "m n k dtype device w4a4")


def _bf16_below_sm80(c: Call) -> bool:
    """bf16 activations on a GPU below sm_80 (T4, RTX 20), where the GEMVs' bf16x2 arithmetic is not PTX."""
    return c.dtype == torch.bfloat16 and gemv_bf16_reason(c.device) is not None


def _at_least_4m_weights(c: Call) -> bool:
    return c.n * c.k >= 1 << 22


def _not_narrow_gemv6_kept(c: Call) -> bool:
    """Not one of the narrow single-segment layers (``gemv._gemv6_narrow``: 8B qkv / o, Qwen2-7B qkv / o,
    Gemma-2-9B o) where fp16 and W4A4 keep the GEMV at M = 2 (gemv6 ahead by 0.5-6% in fp16; W4A4 mixed,
    -4% to +5%); bf16 W4A16 takes mma.py there too since its summing pass became a programmatic dependent
    (session 24, results/split_rules_h200*.json)."""
    narrow = gemv._block_offsets_fit(c.n, c.k) and gemv._gemv6_narrow(c.n, c.k)
    return not (narrow and (c.dtype != torch.bfloat16 or c.w4a4))


def _too_many_blocks(c: Call) -> bool:
    """More blocks than gemv6 / gemv7's 32-bit offsets address (``gemv.GEMV6_MAX_BLOCKS``)."""
    return not gemv._block_offsets_fit(c.n, c.k)


def _above_25m_weights(c: Call) -> bool:
    return c.n * c.k > 6144 * 4096


def _mma_ready(c: Call) -> bool:
    """mma.py takes the rows (``MMA_MAX_M``) and the input, and passed its self-test on the device."""
    return c.device is not None and MMA_MAX_M >= c.m and mma_unavailable_reason(c.m, c.k, c.dtype, c.device) is None


def _sm90(path: str, c: Call, preferred) -> bool:
    """``preferred(module)`` (its measured rows) and then the sm_90 kernel's guard (which runs its
    self-test on the device the first time)."""
    if c.device is None or c.device.type != "cuda" or _common.INTERPRET:
        return False
    try:
        module = importlib.import_module(f".{path}", __package__)
    except Exception:  # noqa: BLE001 - Gluon missing or changed in this Triton (the guard says so)
        return False
    return preferred(module) and gluon_sm90_reason(path, c.m, c.n, c.k, c.dtype, c.device) is None


def _wsgemm_preferred(c: Call) -> bool:
    """wsgemm.py's rule (``wsgemm.preferred``: where its tiles or its split tail fill the SMs; M = 33..128
    ahead of mma.py and wgmma.py with its 64- / 128-row tiles, results/wsgemm_small_m_h200.json)."""
    return WSGEMM and _sm90("wsgemm", c, lambda mod: max(mod.MIN_M, WSGEMM_MIN_M) <= c.m and mod.supports(c.m, c.n, c.k)
                            and mod.preferred(c.m, c.n, c.k, _common._sm_count(c.device), c.w4a4))


def _wgmma_preferred(c: Call) -> bool:
    """wgmma.py's rows (``wgmma.preferred``: 65 <= M <= 128) where wsgemm.py does not run."""
    return WGMMA and _sm90("wgmma", c, lambda mod: mod.preferred(c.m, c.n, c.k))


def _dot_scaled_ready(c: Call) -> bool:
    """The FP4 tensor cores (sm_100+) passed ``dot_scaled``'s self-test on the device."""
    if c.device is None or c.device.type != "cuda":
        return False
    from . import dot_scaled

    return dot_scaled.ready(c.device, "e2m1") is None


CONDITIONS = {name[1:]: fn for name, fn in globals().items() if name.startswith("_") and callable(fn)
              and name[1:] in {w for rule in RULES for w in rule.when}}


def choose(m: int, dtype: torch.dtype, w4a4: bool, k: int = 0, device: Optional[torch.device] = None,
           n: int = 0) -> str:
    """The path ``RULES`` pick for M rows of ``dtype`` activations times an [N, K] weight on ``device``
    (W4A4 when ``w4a4``). Its first answer for a Gluon path may run that kernel's self-test there.

    The measurements behind the M = 2 rows (``docs/KERNELS.md``): mma.py against gemv6 on layers of 4M
    weights and more, results/mma_h200_m2.json, m2_small_h200.json; bf16 W4A16 on the narrow layers too
    since its summing pass became a programmatic dependent (results/split_rules_h200*.json), fp16 (gemv6
    0.5-6% ahead) and W4A4 (mixed) keep gemv6 there; fp16 takes bf16's rules otherwise
    (results/gemv_fp16_h200.json)."""
    call = Call(m, n, k, dtype, device, w4a4)
    for rule in RULES:
        if rule.least <= m <= rule.most and rule.w4a4 in (None, w4a4) \
                and all(CONDITIONS[name](call) for name in rule.when):
            return rule.path
    raise AssertionError("the last rule takes every call")


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
