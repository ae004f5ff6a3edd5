"""Small-M NVFP4 GEMM (M <= 16) with one-warp consumers: mma.py's decode and
``mma.sync`` tiles, fed by TMA from a loader warp through mbarrier rings,
written in Gluon. sm_90 only; bf16 or fp16 activations, K % 256 == 0.
Experimental (session 13): not in the dispatch until measured.

Why: mma.py's programs are 4 warps that read one cp.async ring; every K step
ends in a CTA-wide barrier, so each warp waits for the slowest one, and at
128 registers an SM holds 16 warps (results/ncu_mma_70b_gate_up_m16_*_s13.txt:
about one eligible warp a scheduler, DRAM 43%). Here a program is one loader
warp and ``CONS`` consumer warps, each consumer its own warp-specialized
partition: the barriers the compiler places in a partition span that
partition only (one warp), and the consumers meet the loader only on the
rings' mbarriers, so a warp waits only when the data of its step has not
landed or it runs a whole ring ahead of the slowest one.

* The loader issues, per K step, one TMA copy of the activation tile
  ``[BM, BK]`` (rows past M read as zeros) and one of the code words of all
  the program's rows ``[32 CONS, BK/8]`` into ring slot ``i % STAGES``; per two
  steps one copy of their scale bytes ``[32 CONS, 16]``. It refills a slot
  when all ``CONS`` consumers have released it.
* Consumer ``p`` reads its 32 rows' words and scale bytes and the whole
  activation tile in mma.py's layouts (one warp), releases the slot, decodes
  with mma.py's ``_operands`` and accumulates with ``mma.sync`` in fp32; it
  writes its own rows at the end (``mma.store_output``).

Numerics are mma.py's: the same decode and products, the same K steps in
the same order, so the outputs equal mma.py's bit for bit at the same K split.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .mma import _layouts, _operands, aligned_operands, store_output
from .wsgemm import _tma_load

ROWS = gl.constexpr(64)  # weight rows a consumer warp (four m16 MMA tiles)


@gluon.jit
def _loader(x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, empty, s_ready, s_empty, off_n, k0, steps,
            CONS: gl.constexpr):
    """Ring slot ``i % STAGES`` holds K steps ``2i`` and ``2i + 1`` (one mbarrier wait and arrival a
    pair on each side); scale group ``g`` (16 bytes a row) covers steps ``4g .. 4g + 3``."""
    STAGES: gl.constexpr = ready.type.shape[0]
    BK: gl.constexpr = x_ring.type.shape[2]
    for i in range(steps // 2):
        s = i % STAGES
        if i % 2 == 0:
            g = i // 2
            mbarrier.wait(s_empty.index(g % 2), ((g // 2) & 1) ^ 1)  # fresh barriers count as phase 1 completed
            mbarrier.expect(s_ready.index(g % 2), s_desc.block_type.nbytes)
            _tma_load(s_desc, [off_n, (k0 + 2 * i) * (BK // 16)], s_ready.index(g % 2), s_ring.index(g % 2))
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), 2 * (x_desc.block_type.nbytes + w_desc.block_type.nbytes))
        for u in gl.static_range(2):
            _tma_load(x_desc, [0, (k0 + 2 * i + u) * BK], ready.index(s), x_ring.index(2 * s + u))
            _tma_load(w_desc, [off_n, (k0 + 2 * i + u) * (BK // 8)], ready.index(s), w_ring.index(2 * s + u))


@gluon.jit
def _scale_step(srow, j, BK: gl.constexpr, SL: gl.constexpr):
    """Step ``j`` (0..3) of a scale group's bytes ``[ROWS, 16]``."""
    if j == 0:
        sb = srow.slice(0, BK // 16, dim=1).load(SL)
    elif j == 1:
        sb = srow.slice(BK // 16, BK // 16, dim=1).load(SL)
    elif j == 2:
        sb = srow.slice(2 * (BK // 16), BK // 16, dim=1).load(SL)
    else:
        sb = srow.slice(3 * (BK // 16), BK // 16, dim=1).load(SL)
    return sb


@gluon.jit
def _consumer(x_ring, w_ring, s_ring, ready, empty, s_ready, s_empty, x_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr,
              M, N, stride_ym, off_n, pid_k, steps, P: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr,
              XL: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_XENC: gl.constexpr, SPLIT: gl.constexpr,
              MUL: gl.constexpr):
    STAGES: gl.constexpr = ready.type.shape[0]
    BM: gl.constexpr = x_ring.type.shape[1]
    BK: gl.constexpr = x_ring.type.shape[2]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    acc = gl.zeros([ROWS, BM], gl.float32, layout=mma)
    for i in range(steps // 2):
        s = i % STAGES
        g = i // 2
        if i % 2 == 0:
            mbarrier.wait(s_ready.index(g % 2), (g // 2) & 1)
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        srow = s_ring.index(g % 2).slice(ROWS * P, ROWS, dim=0)
        wp0 = w_ring.index(2 * s).slice(ROWS * P, ROWS, dim=0).load(WL)
        wp1 = w_ring.index(2 * s + 1).slice(ROWS * P, ROWS, dim=0).load(WL)
        sb0 = _scale_step(srow, 2 * (i % 2), BK, SL)
        sb1 = _scale_step(srow, 2 * (i % 2) + 1, BK, SL)
        xp0 = x_ring.index(2 * s).permute((1, 0)).load(XL)
        xp1 = x_ring.index(2 * s + 1).permute((1, 0)).load(XL)
        mbarrier.arrive(empty.index(s))
        if (i % 2 == 1) | (i == steps // 2 - 1):
            mbarrier.arrive(s_empty.index(g % 2))
        a, b = _operands(wp0, sb0, xp0, a_l, b_l, ROWS, BM, BK, MUL)
        acc = mma_v2(a, b, acc)
        a, b = _operands(wp1, sb1, xp1, a_l, b_l, ROWS, BM, BK, MUL)
        acc = mma_v2(a, b, acc)
    no = off_n + ROWS * P + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    mo = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    store_output(acc, no, mo, x_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr, M, N, stride_ym, pid_k,
                 HAS_BIAS, HAS_XENC, SPLIT)


@gluon.jit
def _wsmma_kernel(x_desc, w_desc, s_desc, x_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr, M, N, stride_ym, K_STEPS,
                  SPLIT_STEPS, HAS_BIAS: gl.constexpr, HAS_XENC: gl.constexpr, SPLIT: gl.constexpr,
                  STAGES: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, CONS: gl.constexpr,
                  WL: gl.constexpr, SL: gl.constexpr, XL: gl.constexpr, MUL: gl.constexpr):
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    off_n = pid_n * (ROWS * CONS)
    k0 = pid_k * SPLIT_STEPS
    steps = gl.minimum(SPLIT_STEPS, K_STEPS - k0)
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, BM, BK], x_desc.layout)
    # one copy of all the program's rows a step (the consumers read their 32-row slices)
    w_ring = gl.allocate_shared_memory(gl.int32, [2 * STAGES, ROWS * CONS, BK // 8], w_desc.layout)
    s_ring = gl.allocate_shared_memory(gl.uint8, [2, ROWS * CONS, 16], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    s_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    s_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONS)
    for i in gl.static_range(2):
        mbarrier.init(s_ready.index(i), count=1)
        mbarrier.init(s_empty.index(i), count=CONS)
    fence_async_shared()
    # (Gluon takes the partitions as one literal list: tuples of functions cannot be named). The default
    # partition (4 warps: the least a warp-specialized kernel has) is the loader.
    if True:
        gl.static_assert(CONS == 4, "4 consumer warps (128 rows: TMA boxes are powers of 2)")
        gl.warp_specialize([
            (_loader, (x_desc, w_desc, s_desc, x_ring, w_ring, s_ring, ready, empty, s_ready, s_empty, off_n, k0,
                       steps, CONS)),
            (_consumer, (x_ring, w_ring, s_ring, ready, empty, s_ready, s_empty, x_ptr, wenc_ptr, xenc_ptr,
                         bias_ptr, y_ptr, M, N, stride_ym, off_n, pid_k, steps, 0, WL, SL, XL, HAS_BIAS, HAS_XENC,
                         SPLIT, MUL)),
            (_consumer, (x_ring, w_ring, s_ring, ready, empty, s_ready, s_empty, x_ptr, wenc_ptr, xenc_ptr,
                         bias_ptr, y_ptr, M, N, stride_ym, off_n, pid_k, steps, 1, WL, SL, XL, HAS_BIAS, HAS_XENC,
                         SPLIT, MUL)),
            (_consumer, (x_ring, w_ring, s_ring, ready, empty, s_ready, s_empty, x_ptr, wenc_ptr, xenc_ptr,
                         bias_ptr, y_ptr, M, N, stride_ym, off_n, pid_k, steps, 2, WL, SL, XL, HAS_BIAS, HAS_XENC,
                         SPLIT, MUL)),
            (_consumer, (x_ring, w_ring, s_ring, ready, empty, s_ready, s_empty, x_ptr, wenc_ptr, xenc_ptr,
                         bias_ptr, y_ptr, M, N, stride_ym, off_n, pid_k, steps, 3, WL, SL, XL, HAS_BIAS, HAS_XENC,
                         SPLIT, MUL)),
        ], [1, 1, 1, 1], [REGS, REGS, REGS, REGS])


REGS = gl.constexpr(168)
MAX_M = 16


def config(m: int, n: int, k: int, sms: int = 132) -> tuple:
    """(consumer warps, ring stages, K steps a program): 12 consumers (384 rows) and the 4-warp loader
    partition are 16 warps, one program an SM at 128 registers; K is cut into ranges of whole steps
    for about four programs an SM (at least 8 steps a range)."""
    cons, stages, bk = 4, 4, 64  # stages: ring slots of two K steps
    tiles = triton.cdiv(n, ROWS.value * cons)
    steps = k // bk
    per = max(8, triton.cdiv(steps, max(1, round(2 * sms / tiles))))
    # 104 registers at launch: the loader warpgroup gives its registers up (setmaxnreg) to the consumers'
    # 168, two programs an SM
    return cons, stages, min(steps, triton.cdiv(per, 4) * 4), 104  # whole scale groups (256 K)


def supports(m: int, n: int, k: int) -> bool:
    return 0 < m <= MAX_M and n > 0 and k % 256 == 0


def matmul(x2: torch.Tensor, words: torch.Tensor, sbits: torch.Tensor, enc: torch.Tensor,
           x_enc: Optional[torch.Tensor], bias: Optional[torch.Tensor], y: torch.Tensor,
           cfg: Optional[tuple] = None) -> torch.Tensor:
    """``y [M, N] = x2 [M, K] @ W^T`` as ``mma.matmul`` (M <= 16, K % 256 == 0). ``cfg``: (consumer
    warps, ring stages, K steps of 64 a program, a multiple of 4: whole scale groups)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gemm import _sm_count, split_workspace, sum_splits

    m, k = x2.shape
    n = words.shape[0]
    if x2.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the wsmma path takes bf16 or fp16 activations, got {x2.dtype}")
    if not supports(m, n, k):
        raise ValueError(f"the wsmma path takes M <= {MAX_M} and K % 256 == 0, got M={m}, K={k}")
    cons, stages, split_steps, maxnreg = cfg or config(m, n, k, _sm_count(x2.device))
    if split_steps % 4 or cons != 4:
        raise ValueError(f"wsmma: config {(cons, stages, split_steps)}: 4 or 12 consumers, K ranges of whole scale groups")
    bm, bk = 16, 64
    x2, sbits = aligned_operands(x2, sbits)
    if words.stride(1) != 1 or (words.stride(0) * 4) % 16:
        words = words.contiguous()
    if sbits.stride(1) != 1 or sbits.stride(0) % 16:
        sbits = sbits.contiguous()
    rows = ROWS.value * cons
    # the default NVMMA layouts (a swizzle as wide as a row, up to 128 bytes): with no swizzle, Triton
    # reads an NVMMA tile wider than 16 bytes as 8 x 16-byte core matrices, not as the rows TMA writes
    gdt = gl.float16 if x2.dtype == torch.float16 else gl.bfloat16
    x_desc = TensorDescriptor.from_tensor(x2, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gdt))
    w_desc = TensorDescriptor.from_tensor(words, [rows, bk // 8],
                                          gl.NVMMASharedLayout.get_default_for([rows, bk // 8], gl.int32))
    s_desc = TensorDescriptor.from_tensor(sbits, [rows, 16],
                                          gl.NVMMASharedLayout.get_default_for([rows, 16], gl.uint8))
    wl, sl, xl, _, _ = _LAYOUTS.get(bk) or _LAYOUTS.setdefault(bk, _layouts(ROWS.value, bm, bk, 1))
    splits = triton.cdiv(k // bk, split_steps)
    target = split_workspace(splits, y)
    has_bias = bias is not None
    _wsmma_kernel[(triton.cdiv(n, rows), splits)](
        x_desc, w_desc, s_desc, x2, enc, x_enc.reshape(1) if x_enc is not None else enc, bias if has_bias else enc,
        target, m, n, y.stride(0), k // bk, split_steps,
        HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, SPLIT=splits > 1, STAGES=stages, BM=bm, BK=bk, CONS=cons,
        WL=wl, SL=sl, XL=xl, MUL=MUL_DECODE, num_warps=4, maxnreg=maxnreg,
    )
    return sum_splits(target, y, bias)


_LAYOUTS: dict = {}
MUL_DECODE = True  # bf16: the three-operation multiply decode (mma.py's _DECODE_MUL)
