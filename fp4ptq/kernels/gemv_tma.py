"""A GEMV (M = 1..2, bf16 activations, W4A16 and W4A4's dequantized-activation GEMV) whose weight
tiles come by TMA into a ring in shared memory, several row tiles in flight a program.

Why: gemv6 / gemv7 hold the weight tiles they load ahead in registers, one step at most (two steps
cost more registers and moves than they hid, NOTES session 14), so on the small 8B layers a program
waits for a DRAM round trip every tile or two: the profiles read latency-bound at about two warps a
scheduler (8B.o DRAM 26%, 8B.down 48%). With TMA the copies wait in shared memory instead, issued
by one thread with no address arithmetic, ``STAGES - 1`` tiles ahead (Triton's pipeliner on a
``tl.range`` with mbarriers), while the warps only decode: the bytes in flight no longer cost
registers. Tiles past N or K are zero-filled by the copy engine (codes 0, scale 0: no masks).

The math is gemv6's (x resident, ``CHUNKS == 1``) and gemv7's (x re-read a chunk at a time from L1,
``CHUNKS > 1``): the same per-block ``fma.rn.bf16x2`` sums and fp32 scaling (``_block_products``,
``_scaled_block_sums``), so the outputs agree with those GEMVs up to the order of the final fp32
sums, and with the reference as they do (about 4e-3 relative).

Runs under the Triton interpreter (the CPU tests) with the same descriptors.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..nvfp4 import BLOCK_SIZE
from ._ints import cdiv
from ._launch import Launch
from .gemm import (INTERPRET, _block_products, _output_factor, _scaled_block_sums, _sm_count, _x_pair_prmt,
                   _x_pairs_from_words, split_run)


@triton.jit
def _x_words_unpipelined(xw, bidx, b_ok, h: tl.constexpr, EMULATE: tl.constexpr):
    """``gemm._x_words`` as inline PTX loads, which Triton's pipeliner leaves where they are: as plain
    loads it turns them into cp.async copies through shared memory with a CTA barrier each (Triton 3.6
    SASS: 32 ``LDGSTS`` and ten ``BAR.SYNC`` a step), where x's 4 KB a step are L1 hits anyway.
    Past K the words read block 0 and are zeroed."""
    p = xw + bidx * 4 + 2 * h
    if EMULATE:
        lo = tl.load(p)
        hi = tl.load(p + 1)
    else:
        lo = tl.inline_asm_elementwise("ld.global.nc.b64 $0, [$1];", "=l,l", [p], dtype=tl.int64, is_pure=True,
                                       pack=1)
        hi = tl.inline_asm_elementwise("ld.global.nc.b64 $0, [$1 + 8];", "=l,l", [p], dtype=tl.int64,
                                       is_pure=True, pack=1)
    return tl.where(b_ok, lo, 0), tl.where(b_ok, hi, 0)


@triton.jit
def _x_pairs_unpipelined(xw, bidx, b_ok, h: tl.constexpr, EMULATE: tl.constexpr):
    """``gemm._x_pairs_stream`` on ``_x_words_unpipelined``'s words."""
    lo, hi = _x_words_unpipelined(xw, bidx, b_ok, h, EMULATE)
    lo0, lo1 = lo.to(tl.int32), (lo >> 32).to(tl.int32)
    hi0, hi1 = hi.to(tl.int32), (hi >> 32).to(tl.int32)
    return (_x_pair_prmt(lo0, hi0, 0x5410, EMULATE), _x_pair_prmt(lo0, hi0, 0x7632, EMULATE),
            _x_pair_prmt(lo1, hi1, 0x5410, EMULATE), _x_pair_prmt(lo1, hi1, 0x7632, EMULATE))


@triton.jit
def _gemv_tma_kernel(
    x_ptr, w_desc, s_desc, wenc_ptr, xenc_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, HAS_XENC: tl.constexpr, ROWS: tl.constexpr, KC: tl.constexpr,
    CHUNKS: tl.constexpr, STAGES: tl.constexpr, EMULATE: tl.constexpr, MULDEC: tl.constexpr,
):
    # Program ``pid`` walks row tiles pid, pid + nprog, ... of activation row ``program_id(1)``; a
    # tile is CHUNKS steps of [ROWS, KC] blocks (int64 of 16 codes, and their scale bytes), each step
    # one TMA copy of each, STAGES - 1 steps ahead.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    row = tl.program_id(1).to(tl.int64)
    kb = K // 16
    ab = tl.arange(0, KC)
    ar = tl.arange(0, ROWS)
    xw = (x_ptr + row * stride_xm).to(tl.pointer_type(tl.int64))
    factor = _output_factor(wenc_ptr, xenc_ptr, 1.1805916207174113e21, HAS_XENC)  # 2^70
    mine = tl.cdiv(tl.cdiv(N, ROWS) - pid, nprog)  # row tiles this program walks
    if CHUNKS == 1:  # x resident: its pairs built once
        b_ok = ab < kb
        bidx = tl.where(b_ok, ab, 0)
        p00, p01, p02, p03 = _x_pairs_from_words(xw, bidx, b_ok, 0)
        p10, p11, p12, p13 = _x_pairs_from_words(xw, bidx, b_ok, 1)
        for i in tl.range(0, mine, num_stages=STAGES):
            t = pid + i * nprog
            cur = w_desc.load([t * ROWS, 0])
            csb = s_desc.load([t * ROWS, 0])
            part = _block_products(cur, p00[None, :], p01[None, :], p02[None, :], p03[None, :], p10[None, :],
                                   p11[None, :], p12[None, :], p13[None, :], EMULATE, MULDEC)
            y = tl.sum(_scaled_block_sums(part, csb), axis=1) * factor  # sum v * x * scale * 2^-70
            n = t * ROWS + ar
            n_ok = n < N
            if HAS_BIAS:
                y += tl.load(bias_ptr + tl.where(n_ok, n, 0)).to(tl.float32)
            tl.store(y_ptr + row * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:  # x re-read a chunk a step (L1 hits), the tile's products summed over its chunks
        # the tile K first ([KC, ROWS], gemv7's: a thread holds every row of its blocks, which x's
        # pairs then serve without a broadcast across threads)
        acc = tl.zeros((KC, ROWS), dtype=tl.float32)
        for s in tl.range(0, mine * CHUNKS, num_stages=STAGES):
            t = pid + (s // CHUNKS) * nprog
            c = s % CHUNKS
            cur = tl.trans(w_desc.load([t * ROWS, c * KC]))
            csb = tl.trans(s_desc.load([t * ROWS, c * KC]))
            bidx = c * KC + ab
            b_ok = bidx < kb
            bidx = tl.where(b_ok, bidx, 0)
            p00, p01, p02, p03 = _x_pairs_unpipelined(xw, bidx, b_ok, 0, EMULATE)
            p10, p11, p12, p13 = _x_pairs_unpipelined(xw, bidx, b_ok, 1, EMULATE)
            part = _block_products(cur, p00[:, None], p01[:, None], p02[:, None], p03[:, None], p10[:, None],
                                   p11[:, None], p12[:, None], p13[:, None], EMULATE, MULDEC)
            acc += _scaled_block_sums(part, csb)
            if c == CHUNKS - 1:  # the tile's last chunk: reduce, store, start the next tile at zero
                y = tl.sum(acc, axis=0) * factor
                n = t * ROWS + ar
                n_ok = n < N
                if HAS_BIAS:
                    y += tl.load(bias_ptr + tl.where(n_ok, n, 0)).to(tl.float32)
                tl.store(y_ptr + row * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
                acc = tl.zeros((KC, ROWS), dtype=tl.float32)

def config(m: int, n: int, k: int):
    """(ROWS, num_warps, KC blocks a step, STAGES, programs an SM) for this shape. K of at most 4096:
    x resident, the whole K a step (gemv6's narrow tile: 4 rows on 2 warps); longer K: steps of 128
    blocks (2048 K) on 8-row tiles (gemv7's). ``FP4PTQ_GEMV_TMA_CFG=rows,warps,kc,stages,per_sm``
    overrides it (the H200 sweeps)."""
    env = os.environ.get("FP4PTQ_GEMV_TMA_CFG")
    if env:
        rows, warps, kc, stages, per_sm = (int(v) for v in env.split(","))
        return rows, warps, kc, stages, per_sm
    kb = k // BLOCK_SIZE
    if kb <= 256:
        return 4, 2, max(16, 1 << (kb - 1).bit_length()), 4, 4
    return 8, 2, 128, 4, 4


def unavailable_reason(m: int, n: int, k: int) -> str | None:
    """Why this GEMV cannot run a shape (None: it can). TMA needs 16-byte row strides: K a multiple
    of 256 (the scale rows, K/16 bytes)."""
    if k % 256:
        return f"K = {k} is not a multiple of 256 (TMA needs 16-byte rows of scale bytes)"
    if m > 16:
        return f"M = {m}: the TMA GEMV is for decoding (M <= 16), one pass over the weight an activation row"
    return None


def launch(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc, cfg=None, slots=(0, 6)):
    """``run(*tensors) -> y`` of the TMA GEMV: the weight's descriptors built once, ``slots`` (x, y;
    the activations' global scale too in a W4A4 plan) filled each call."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    reason = unavailable_reason(m, n, k)
    if reason:
        raise ValueError(f"gemv_tma: {reason}")
    rows, warps, kc, stages, per_sm = cfg or config(m, n, k)
    kb = k // BLOCK_SIZE
    chunks = cdiv(kb, kc)
    w_desc = TensorDescriptor.from_tensor(words.view(torch.int64), [rows, kc])
    s_desc = TensorDescriptor.from_tensor(sbits.view(torch.uint8), [rows, kc])
    args = (x2, w_desc, s_desc, enc, xenc_arg, bias_arg, y, m, n, k, x2.stride(0), y.stride(0))
    kwargs = dict(HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, ROWS=rows, KC=kc, CHUNKS=chunks, STAGES=stages,
                  EMULATE=INTERPRET, MULDEC=True, num_warps=warps)
    grid = (max(1, min(cdiv(n, rows), per_sm * _sm_count(x2.device))), m)
    return split_run(Launch(_gemv_tma_kernel, grid, args, slots, kwargs), 1, y, None)
