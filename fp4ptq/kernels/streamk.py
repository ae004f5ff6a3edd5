"""Small-M NVFP4 GEMM (W4A16, and W4A4 on the quantized activations) as a persistent stream-K
launch around mma.py's decode and ``mma.sync`` step (issue 44 item 2). Gluon; CUDA sm_80 and later;
bf16 or fp16 activations, M <= 64, K % 64 == 0. A forced path ("streamk") only: the dispatch does not
pick it until the H200 measured it ahead of mma.py (see ``dispatch.RULES``).

Why (benchmarks/NOTES.md, "Issue 44 item 2"): mma.py launches one program per row tile and K range,
about three an SM's worth, and every form of its step tried plateaus at 119-127 us on 70B gate_up at
M = 16, latency-bound. Its 448 programs of 128 rows sit 3 or 4 to an SM (3.39 on average), and the SMs
holding 4 (256 K steps against 217 on average) set the time. Here:

* The grid is the GPU: ``c * SMs`` programs (``c`` the programs an SM holds at once, read from the
  compiled kernel's registers and shared memory: ``_learn_per_sm``, ``resident_programs``; with
  ``MAXNREG = None`` a 128-register cap where the uncapped build holds fewer than mma.py's 4 of 4 warps),
  none waiting for another (no spin, no atomics: correct whatever is resident).
* The work is the flat sequence of (row tile, K step) pairs, tile-major; program ``p`` takes the
  contiguous steps ``[p * total // G, (p + 1) * total // G)``: every program has the same number
  of steps, give or take one, whatever the tile count, and one cp.async ring runs through all of
  them, across tile boundaries, its copies walking the sequence by increments (no division a step)
  with one scalar offset a step as in mma.py (a last tile reaching past N is moved up to end at N).
* Where a program's steps end a tile, or its range ends, the tile's fp32 partial sums go to the
  workspace ``[J, M, N]`` at slot ``j`` = the program's rank among the tile's programs. A second
  launch (a programmatic dependent on sm_90, as mma.py's summing pass) adds each tile's ``cnt``
  partials in slot order: deterministic, the same bits on every run on a GPU of the same SM count.

The step itself (loads of words, scale bytes and activations through the ring, the bit-move decode
into the A operand, the activations' pair order, the exact products summed in fp32, the
``2^26 / global_enc`` factor) is mma.py's, unchanged; the numerics are mma.py's K split's.

The Triton interpreter cannot run Gluon: tests/test_m16.py checks the schedule, the copy walk and the
summing pass (plain Triton, under the interpreter) against a torch model of the kernel, and
tests/test_ptx_hashes.py compiles the kernel for sm_90 and sm_80. On a GPU the path is used after
``ready`` (a self-test there: moved last tiles, N under one tile, fp16, 64- and 128-wide K steps).
Timed by benchmarks/bench_kernels_h200.py at M = 16 (``ours_w4a16_streamk``, ``_r96``).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from . import mma
from ._common import Launch, _gdc_wait, cdiv
from .mma import _copy, _launch_dependents, _operands, _sync, store_output

MAX_M = 64
PER_SM = {2: 8, 4: 4}  # programs an SM holds before the compiled kernel says (warps -> count; 128 registers)
# The register cap: None (auto) compiles without one and, where that build holds fewer programs an SM than
# ``PER_SM`` (more than 128 registers: mma.py's own 4-warp build has exactly 128 on the H200), with the cap
# that holds ``PER_SM``; 0: never a cap; a number: that cap.
MAXNREG: Optional[int] = None
LEAST_K = 512  # the least K a program takes where the steps do not fill c * SMs programs (mma.py keeps 1024)
_PER_SM_SEEN: dict = {}  # (tile, device, dtype, W4A4, MAXNREG) -> (programs an SM, cap, registers, shared bytes)


@gluon.jit
def _tile_row(t, N, BN: gl.constexpr):
    """The first row that tile ``t``'s programs compute: ``t * BN``, except that a last tile reaching past
    N is moved up to end at row N (where N >= BN): every row it reads exists, the rows it shares with
    the tile before are computed twice and stored once (``_streamk_kernel``). Where N < BN (one tile),
    0, and the rows past N read row 0 (the offsets' clamp)."""
    return gl.minimum(t * BN, gl.maximum(N - BN, 0))


@gluon.jit
def _issue(row0, kc, w_dst, s_dst, x_dst, w_ptr, s_ptr, x_ptr, w_off, s_off, x_off, KW, KB, BK: gl.constexpr):
    """cp.async copies of one step into one ring slot: the words ``[BN, BK/8]`` and scale bytes
    ``[BN, BK/16]`` of the rows from ``row0`` at K offset ``kc`` (``w_off`` / ``s_off``: this thread's
    offsets in a tile, fixed), and the activations ``[BK, BM]`` there. One scalar offset a step, as mma.py."""
    kc = gl.multiple_of(kc, BK)
    r = row0.to(gl.int64)
    _copy(w_dst, w_ptr + (r * KW + kc // 8) + w_off)
    _copy(s_dst, s_ptr + (r * KB + kc // 16) + s_off)
    _copy(x_dst, x_ptr + kc + x_off)


@gluon.jit
def _advance(qi, ti, ki, s1, STEPS):
    """The step after ``qi`` (tile ``ti``, K step ``ki``) in the flat sequence, or ``qi`` itself at the
    program's last step ``s1 - 1`` (the ring's trailing copies reload it): no division a step."""
    more = (qi < s1 - 1).to(gl.int32)
    ki = ki + more
    wrap = (ki == STEPS).to(gl.int32)
    return qi + more, ti + wrap, ki - wrap * STEPS


@gluon.jit
def _first_program(x, G, TOTAL):
    """The program whose steps hold flat step ``x``: the largest p with p * TOTAL // G <= x."""
    return ((x + 1) * G + TOTAL - 1) // TOTAL - 1


@gluon.jit
def _streamk_kernel(
    x_ptr, w_ptr, s_ptr, wenc_ptr, xenc_ptr, ws_ptr,
    M, N, KW8, KB4, stride_x8, STEPS, TOTAL, G,
    HAS_XENC: gl.constexpr, STAGES: gl.constexpr,
    BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, WARPS: gl.constexpr,
    WL: gl.constexpr, SL: gl.constexpr, XL: gl.constexpr, SC: gl.constexpr, XC: gl.constexpr,
    TRIGGER: gl.constexpr = False, MUL: gl.constexpr = False,
):
    if TRIGGER:  # the summing pass, a programmatic dependent, may launch now (every program is resident)
        _launch_dependents()
    KW = KW8 * 8  # words a row (K / 8)
    KB = KB4 * 4  # scale bytes a row (K / 16)
    stride_xm = stride_x8 * 8
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_l, k_width=8)
    pid = gl.program_id(0)
    s0 = pid * TOTAL // G
    s1 = (pid + 1) * TOTAL // G  # this program's steps [s0, s1), never empty (G <= TOTAL)

    rw = gl.arange(0, BN, layout=gl.SliceLayout(1, WL))
    rs = gl.arange(0, BN, layout=gl.SliceLayout(1, SC))
    w_off = gl.where(rw < N, rw, 0).to(gl.int64)[:, None] * KW + gl.arange(0, BK // 8, layout=gl.SliceLayout(0, WL))[None, :]
    s_off = gl.where(rs < N, rs, 0).to(gl.int64)[:, None] * KB + gl.arange(0, BK // 16, layout=gl.SliceLayout(0, SC))[None, :]
    xc = gl.arange(0, BM, layout=gl.SliceLayout(0, XC))
    x_off = gl.where(xc < M, xc, 0)[None, :] * stride_xm + gl.arange(0, BK, layout=gl.SliceLayout(1, XC))[:, None]
    # (activation rows past M read row 0: computed, never stored)

    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BK // 8], flat)
    s_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, BK // 16], flat)
    k_major: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[0, 1])
    x_ring = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BK, BM], k_major)
    qi = s0  # the next step to copy: flat index, row tile, K step
    ti = s0 // STEPS
    ki = s0 - ti * STEPS
    for p in gl.static_range(STAGES - 1):
        _issue(_tile_row(ti, N, BN), ki * BK, w_ring.index(p), s_ring.index(p), x_ring.index(p), w_ptr, s_ptr,
               x_ptr, w_off, s_off, x_off, KW, KB, BK)
        async_copy.commit_group()
        qi, ti, ki = _advance(qi, ti, ki, s1, STEPS)

    for t in range(s0 // STEPS, (s1 - 1) // STEPS + 1):
        acc = gl.zeros([BN, BM], gl.float32, layout=mma_l)
        for q in range(gl.maximum(s0, t * STEPS), gl.minimum(s1, (t + 1) * STEPS)):
            i = q - s0
            async_copy.wait_group(STAGES - 2)
            _sync()  # step q is in; every thread is done with the slot of step q - 1
            slot = i % STAGES
            wp = w_ring.index(slot).load(WL)
            sb = s_ring.index(slot).load(SL)
            xp = x_ring.index(slot).load(XL)
            nxt = (i + STAGES - 1) % STAGES
            # step q + STAGES - 1: the ring runs on across tiles; past the program's last step, a reload of it
            _issue(_tile_row(ti, N, BN), ki * BK, w_ring.index(nxt), s_ring.index(nxt), x_ring.index(nxt),
                   w_ptr, s_ptr, x_ptr, w_off, s_off, x_off, KW, KB, BK)
            async_copy.commit_group()
            qi, ti, ki = _advance(qi, ti, ki, s1, STEPS)
            a, b = _operands(wp, sb, xp, a_l, b_l, BN, BM, BK, MUL)
            acc = mma_v2(a, b, acc)
        j = pid - _first_program(t * STEPS, G, TOTAL)  # this program's slot among the tile's partials
        no = _tile_row(t, N, BN) + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_l))
        no = gl.where(no >= t * BN, no, N)  # a moved last tile: the rows of the tile before are not stored
        mo = gl.arange(0, BM, layout=gl.SliceLayout(0, mma_l))
        store_output(acc, no, mo, x_ptr, wenc_ptr, xenc_ptr, wenc_ptr, ws_ptr, M, N, N, j,
                     False, HAS_XENC, True)
    async_copy.wait_group(0)


@triton.jit
def _programs_of(x, G, TOTAL):
    """``_first_program`` in plain Triton (the summing pass's copy)."""
    return ((x + 1) * G + TOTAL - 1) // TOTAL - 1


@triton.jit
def _streamk_finish(ws_ptr, bias_ptr, y_ptr, M, N, stride_ym, STEPS, TOTAL, G, J: tl.constexpr,
                    BN: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``y[m, n] = sum_{j < cnt} ws[j, m, n] (+ bias)``, in slot order, cast to y's dtype: ``cnt`` the
    number of programs whose steps meet column n's row tile. ``PDL``: launched as the programmatic
    dependent of the stream-K launch; ``griddepcontrol.wait`` holds it until the partials are written."""
    if PDL:
        _gdc_wait()
    row = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    t = n // BN
    first = _programs_of(t * STEPS, G, TOTAL)
    cnt = _programs_of((t + 1) * STEPS - 1, G, TOTAL) - first + 1
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(J):  # unrolled: every partial's load in flight at once, the adds in order
        acc += tl.load(ws_ptr + (j * M + row) * N + n, mask=ok & (j < cnt), other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=ok)


def first_program(x: int, g: int, total: int) -> int:
    """The program (of ``g``) whose steps hold flat step ``x`` of ``total`` (the kernels' formula)."""
    return ((x + 1) * g + total - 1) // total - 1


@functools.lru_cache(maxsize=256)
def slots(tiles: int, steps: int, g: int) -> int:
    """The most programs whose steps meet one row tile (the workspace's slot count J)."""
    total = tiles * steps
    return max(first_program((t + 1) * steps - 1, g, total) - first_program(t * steps, g, total) + 1
               for t in range(tiles))


def config(m: int, n: int, k: int, sms: int = 132, per_sm: Optional[int] = None):
    """(BN, BM, BK, warps, stages, programs): mma.py's tile and ring for M rows, and the grid: ``c * SMs``
    programs, ``c`` the programs an SM holds (``per_sm``; ``PER_SM`` of the warp count when not known
    yet), fewer where a program would get under ``LEAST_K`` of K (``c`` at least 1), never more
    programs than steps."""
    bn, bm, bk, warps, _, stages = mma.config(m, n, k, sms)
    steps, tiles = k // bk, cdiv(n, bn)
    total = tiles * steps
    per_sm = per_sm or PER_SM.get(warps, 2)
    least = max(1, min(steps, LEAST_K // bk))
    c = min(per_sm, max(1, total // (sms * least)))
    return bn, bm, bk, warps, stages, min(total, c * sms)


def _seen_key(m: int, n: int, k: int, sms: int, device: torch.device, dtype: torch.dtype, w4a4: bool) -> tuple:
    return mma.config(m, n, k, sms)[:4] + (device, dtype, w4a4, MAXNREG)


def chosen(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
           w4a4: bool = False) -> dict:
    """What a call of this shape launches on ``device`` now (for benchmark records): the config, the
    programs an SM that sized it (None: not learned from the compiled kernel, ``PER_SM``'s guess) and
    the workspace's slots."""
    from ._common import _sm_count

    sms = _sm_count(device)
    per_sm, cap, regs, smem = _PER_SM_SEEN.get(_seen_key(m, n, k, sms, device, dtype, w4a4)) or (None,) * 4
    cfg = config(m, n, k, sms, per_sm)
    return {"config": cfg, "per_sm": per_sm, "maxnreg": cap if per_sm else _cap(), "registers": regs,
            "shared_bytes": smem, "slots": slots(cdiv(n, cfg[0]), k // cfg[2], cfg[5]), "sms": sms}


def _cap() -> int:
    """The cap a build takes before (or without) learning the compiled kernel's registers."""
    return int(MAXNREG or 0)


def supports(m: int, n: int, k: int) -> bool:
    """Whether the kernel takes this shape: 1 <= M <= 64, K a multiple of 64."""
    return 0 < m <= MAX_M and n > 0 and k % 64 == 0


def resident_programs(regs: int, smem: int, warps: int, sm_regs: int = 65536, sm_smem: int = 233472,
                      sm_threads: int = 2048) -> int:
    """Programs of ``warps`` warps, ``regs`` registers a thread and ``smem`` shared bytes that one SM holds
    at once (defaults: an H100 / H200 SM): registers go to warps in units of 256, and each program's
    shared memory takes 1 KB more (reserved by the driver)."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    return max(1, min(sm_regs // (per_warp * warps), sm_smem // (smem + 1024), sm_threads // (32 * warps), 32))


def _resident(compiled, warps: int, device: torch.device) -> Optional[tuple]:
    """(programs of ``compiled`` an SM of ``device`` holds at once, its registers a thread, its shared
    memory bytes), or None where this Triton does not say."""
    try:
        init = getattr(compiled, "_init_handles", None)
        if init is not None:
            init()
        regs, smem = int(compiled.n_regs), int(compiled.metadata.shared)
    except Exception:  # noqa: BLE001 - a Triton whose compiled kernel says this differently
        return None
    props = torch.cuda.get_device_properties(device)
    fits = resident_programs(regs, smem, warps, getattr(props, "regs_per_multiprocessor", 65536),
                             getattr(props, "shared_memory_per_multiprocessor", 233472),
                             getattr(props, "max_threads_per_multi_processor", 2048))
    return fits, regs, smem


_LAYOUTS: dict = {}


def launches(x2: torch.Tensor, words: torch.Tensor, sbits: torch.Tensor, enc: torch.Tensor,
             x_enc: Optional[torch.Tensor], bias: Optional[torch.Tensor], y: torch.Tensor,
             cfg: Optional[tuple] = None, slots_=(0, 5)):
    """``matmul``'s launches for operands shaped like these (``mma.aligned_operands`` already), as a
    callable ``run(*tensors) -> y`` taking x and y (y last; W4A4's global scale comes fixed). The
    stream-K launch writes partials into a fresh fp32 workspace, the summing pass (a programmatic
    dependent where ``split_pdl``) writes y."""
    from ._common import _sm_count, dependent_or_plain, split_pdl

    m, k = x2.shape
    n = words.shape[0]
    if x2.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the streamk path takes bf16 or fp16 activations, got {x2.dtype}")
    if not supports(m, n, k):
        raise ValueError(f"the streamk path takes 1 <= M <= {MAX_M} and K % 64 == 0, got M={m}, N={n}, K={k}")
    sms = _sm_count(x2.device)
    seen = _PER_SM_SEEN.get(_seen_key(m, n, k, sms, x2.device, x2.dtype, x_enc is not None))
    cap = seen[1] if seen else _cap()
    if cfg is None:
        cfg = config(m, n, k, sms, seen[0] if seen else None)
    bn, bm, bk, warps, stages, g = cfg
    steps, tiles = k // bk, cdiv(n, bn)
    total = tiles * steps
    if bm < m or bn % (16 * warps) or not 0 < g <= total or stages < 2:
        raise ValueError(f"streamk: config {cfg} does not tile M={m}, N={n}, K={k}")
    if total * (g + 1) >= 1 << 31:  # (the kernels' (x + 1) * G + TOTAL - 1 and pid * TOTAL stay in int32)
        raise ValueError(f"streamk: {total} steps on {g} programs overflow its 32-bit schedule (N={n}, K={k})")
    j = slots(tiles, steps, g)
    trigger = split_pdl(x2.device)
    launch = Launch(_streamk_kernel, (g,), _kernel_args(x2, words, sbits, enc, x_enc, None, cfg), slots_,
                    _kernel_options(cfg, x2, x_enc, trigger, cap))
    has_bias = bias is not None

    def finisher(pdl: bool):
        block = 1024
        return Launch(_streamk_finish, (cdiv(n, block), m),
                      (None, bias if has_bias else enc, None, m, n, y.stride(0), steps, total, g), (0, 2),
                      dict(J=j, BN=bn, HAS_BIAS=has_bias, BLOCK=block, PDL=pdl, launch_pdl=pdl, num_warps=4))

    finish = finisher(trigger)
    if trigger:
        finish = dependent_or_plain(finish, lambda: finisher(False), x2.device, "the stream-K summing pass")

    def run(x2, y):
        target = torch.empty(j, m, n, dtype=torch.float32, device=y.device)
        launch(x2, target)
        finish(target, y)
        return y
    return run


def _tile_layouts(bn: int, bm: int, bk: int, warps: int):
    key = (bn, bm, bk, warps)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = mma._layouts(bn, bm, bk, warps)
    return _LAYOUTS[key]


def _kernel_options(cfg: tuple, x2: torch.Tensor, x_enc, trigger: bool, cap: int) -> dict:
    bn, bm, bk, warps, stages, _ = cfg
    wl, sl, xl, sc, xc = _tile_layouts(bn, bm, bk, warps)
    return dict(HAS_XENC=x_enc is not None, STAGES=int(stages), BN=bn, BM=bm, BK=bk, WARPS=warps, WL=wl, SL=sl,
                XL=xl, SC=sc, XC=xc, TRIGGER=trigger, MUL=mma.MULDEC and x2.dtype == torch.bfloat16, num_warps=warps,
                **({"maxnreg": int(cap)} if cap else {}))


def _kernel_args(x2, words, sbits, enc, x_enc, ws, cfg: tuple) -> tuple:
    m, k = x2.shape
    n = words.shape[0]
    bn, _, bk, _, _, g = cfg
    steps = k // bk
    return (x2, words, sbits, enc, x_enc.reshape(1) if x_enc is not None else enc, ws, m, n, k // 64, k // 64,
            x2.stride(0) // 8, steps, cdiv(n, bn) * steps, g)


def _learn_per_sm(x2, words, sbits, enc, x_enc) -> None:
    """Compile the kernel for this call's tile (once a tile, device, dtype and kind; no launch) and keep
    how many of its programs an SM holds, so that ``config`` sizes the grid to what is resident at once;
    with ``MAXNREG = None``, where that is fewer than ``PER_SM``, the register cap that holds ``PER_SM``
    (kept if its build does)."""
    from ._common import _sm_count, split_pdl

    m, k = x2.shape
    n = words.shape[0]
    sms = _sm_count(x2.device)
    key = _seen_key(m, n, k, sms, x2.device, x2.dtype, x_enc is not None)
    if key in _PER_SM_SEEN:
        return
    cfg = config(m, n, k, sms)
    warps = cfg[3]

    def fit(cap: int):
        try:
            compiled = _streamk_kernel.warmup(*_kernel_args(x2, words, sbits, enc, x_enc, enc, cfg), grid=(cfg[5],),
                                              **_kernel_options(cfg, x2, x_enc, split_pdl(x2.device), cap))
        except Exception:  # noqa: BLE001 - no warmup in this Triton: the default count stays
            return None
        got = _resident(compiled, warps, x2.device)
        return None if got is None else (got[0], cap) + got[1:]

    seen = fit(_cap())
    want = PER_SM.get(warps, 2)
    if MAXNREG is None and seen is not None and seen[0] < want:
        capped = fit(65536 // (want * warps * 32) // 8 * 8)
        if capped is not None and capped[0] >= want:
            seen = capped
    _PER_SM_SEEN[key] = seen  # (None: this Triton did not say; PER_SM's guess and no cap stay)


def matmul(x2: torch.Tensor, words: torch.Tensor, sbits: torch.Tensor, enc: torch.Tensor,
           x_enc: Optional[torch.Tensor], bias: Optional[torch.Tensor], y: torch.Tensor,
           cfg: Optional[tuple] = None) -> torch.Tensor:
    """``y [M, N] = x2 [M, K] @ W^T`` (+ bias) as ``mma.matmul``, through the stream-K launch."""
    x2, sbits = mma.aligned_operands(x2, sbits)
    if cfg is None and x2.is_cuda and not torch.cuda.is_current_stream_capturing():
        _learn_per_sm(x2, words, sbits, enc, x_enc)
    return launches(x2, words, sbits, enc, x_enc, bias, y, cfg)(x2, y)


_READY: dict = {}


def _self_test(device: torch.device) -> Optional[str]:
    """Moved last tiles (N = 200, 1000 in 64- / 128-row tiles) and N under one tile (40), tiles shared by
    several programs, 128- and 64-wide K steps, M = 3 / 5 / 13 / 16 / 40, fp16."""
    cases = ((5, 200, 2048, torch.bfloat16), (16, 1000, 4096, torch.bfloat16), (40, 200, 1152, torch.bfloat16),
             (13, 200, 1088, torch.float16), (16, 4096, 1024, torch.bfloat16), (3, 40, 1024, torch.bfloat16))
    return mma.product_check(matmul, cases, device)


def ready(device: torch.device) -> Optional[str]:
    """None when ``device`` can run the kernel (as mma.py: sm_80 on, NVIDIA) and it compiled and
    passed its self-test there (decided once per device), otherwise why not."""
    index = mma._index(device)
    return mma.decide_once(_READY, index, lambda: mma._device_reason(index), _self_test, "the stream-K path")


def disable(device: torch.device, reason: str) -> None:
    """Stop using the kernel on ``device`` (a launch failed after the self-test passed)."""
    mma.stop_using(_READY, mma._index(device), reason, "the stream-K path")


__all__ = ["MAX_M", "chosen", "config", "disable", "first_program", "launches", "matmul", "ready", "resident_programs",
           "slots", "supports"]
