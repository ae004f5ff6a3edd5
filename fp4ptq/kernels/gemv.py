"""The GEMVs (M = 1-2 activation rows): packed bf16x2 / fp16x2 sums on weights decoded in registers.

* ``_gemv_resident_kernel`` (path "gemv6"): the activation row held in registers as bf16x2 pairs,
  persistent programs over row tiles, K split into power-of-two segments (the last one masked) with
  an ordered fp32 summing pass where it is more than one; the next row tile loaded ahead on large
  layers and at M = 1 on the narrow single-segment ones. fp16 activations sum in fp16x2 on each
  block's x scaled by 2^e (``_x_pairs_f16``).
* ``_gemv_stream_kernel`` (gemv7, run by path "gemv6" where ``_gemv7_config`` names the shape: layers
  of 32M weights and more whose K gemv6 would split, the down projections): whole rows a program, x
  re-read from L1 each step, no split.
* ``_gemv_blocks_kernel`` (path "gemv4"): fp32 sums; the fallback for layers of 2^31 blocks and more,
  which the 32-bit block offsets of the two above cannot address.

gemv6 / gemv7 decode bf16 in three operations (``_pair_mul``: the nibbles masked, one multiply that
writes two copies of each, one mask) and sum each block's 16 products in bf16 (``fma.rn.bf16x2``;
~2^-9 relative per block sum, ~4e-3 on the outputs measured) or, for fp16 activations, in fp16
(``fma.rn.f16x2``, ~5e-4), before fp32 takes over; under the Triton interpreter those FMAs are
emulated. Configs: the H200 sweeps named at each rule (``benchmarks/results/``).

This module holds the configs (the measured rules) and the launches; the kernels themselves are in
``gemv_kernels.py``.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..nvfp4 import BLOCK_SIZE
from . import _common, rules
from ._common import cdiv, next_pow2
from .gemv_kernels import (  # noqa: F401 - _X_PAIR_* re-exported: the tests run their PTX
    _X_PAIR_HIGH,
    _X_PAIR_LOW,
    _gemv_blocks_kernel,
    _gemv_resident_kernel,
    _gemv_stream_kernel,
)

# --------------------------------------------------------------------------- #
# Host side: configs and launches
# --------------------------------------------------------------------------- #

def _gemv4_config(m: int, n: int, k: int):
    """(BLOCK_N, BLOCK_B, num_warps) of the fp32 GEMV (rows x blocks of 16 a step): ``rules.TILES``' gemv4
    rows, BLOCK_B cut to K's blocks (a power of two)."""
    block_n, block_b, warps = rules.tile("gemv4", m, n, k)
    return block_n, min(block_b, next_pow2(max(1, k // 16))), warps


def _gemv6_config(m: int, n: int, k: int):
    """(ROWS, num_warps, programs per SM, K segment, PREFETCH) of the resident-x
    GEMV: ``rules.TILES``' gemv6 rows (the H200 sweeps behind each are named there)
    with the K segment (``_segment``), as many warps (1 to the row's most) as give
    each thread the row's number of the segment's blocks, and, where the row names
    none, 32768 / segment programs an SM, at most 8. ``_gemv6`` cuts the programs
    to whole waves of what the compiled kernel fits on an SM."""
    seg = _segment(n, k)
    rows, blocks, most, per_sm, prefetch = rules.tile("gemv6", m, n, k, conditions=CONDITIONS)
    warps = max(1, min(most, next_pow2(max(1, seg // 16)) // (32 * blocks)))
    return rows, warps, max(1, min(8, 32768 // seg)) if per_sm is None else per_sm, seg, prefetch


def _segment(n: int, k: int) -> int:
    """gemv6's K segment of an [N, K] layer: ``_gemv6_segment`` under the cap of ``rules.TILES``'
    "gemv6/segment" rows."""
    return _gemv6_segment(k, rules.tile("gemv6/segment", 1, n, k))


def _whole_2048(c: rules.Call) -> bool:
    seg = _segment(c.n, c.k)
    return seg >= 2048 and c.k % seg == 0


# the GEMVs' conditions of ``rules.RULES`` / ``TILES`` (named there)
CONDITIONS = {
    "gemv6_split": lambda c: c.k > _segment(c.n, c.k),
    "gemv6_one_segment": lambda c: c.k <= _segment(c.n, c.k),
    "gemv6_whole_2048": _whole_2048,
    "gemv7_whole_steps": lambda c: (c.k // BLOCK_SIZE) % 128 == 0,
}


def _gemv6_muldec(n: int, k: int) -> bool:
    """Whether gemv6 decodes with ``_pair_mul`` (three operations a pair register)
    or the shifts (four): the multiply where K is whole segments of 2048 or more,
    except on large layers with K split. The H200 runs (interleaved rounds,
    results/muldec_h200.json, muldec_sweep_h200.json, muldec_rule_h200*.json):
    1-4% faster on every Llama-3.1 shape and the other whole-segment layers timed
    (70B qkv / o, 8B lm_head, Phi-3-mini and Gemma-2-9B down), but 2% slower on
    70B down (47.1 -> 48.1 us, its best other tile 47.8) and 3-5% slower on
    Llama-2-7B down and Qwen2-7B qkv (masked last segments) and SmolLM2 down
    (512-K segments); Qwen2-7B gate_up (masked) was 4.7% faster, Qwen2-7B o / down
    level. Those exceptions keep the shifts; why the multiply loses there is not
    known."""
    large = n * k >= 1 << 26
    seg = _gemv6_segment(k, 8192 if large else 4096)
    whole = k % seg == 0 and seg & (seg - 1) == 0  # no masked blocks (EVEN_K)
    return whole and seg >= 2048 and not (large and k > seg)


@functools.lru_cache(maxsize=None)
def _gemv6_segment(k: int, cap: int) -> int:
    """The K segment of gemv6: ``cdiv(K, segment)`` programs share a row, each holding
    its segment of x (a power-of-two number of blocks; the last segment, or a single
    one, masked where K ends). K a multiple of 2048: its largest power-of-two divisor
    up to ``cap``, no masking (the tuned Llama shapes). Any other K: of one masked
    segment (K <= cap), power-of-two segments from 2048 to ``cap`` with a masked last
    one, and an even split by K's power-of-two divisor (256 or more), the fewest
    segments that keep 85% of the lanes busy (else the most busy lanes): an even split
    by a small divisor cuts a row into many short segments (Qwen2-7B's K = 18944 into
    37 of 512), and one segment of a long K would not fit in registers."""
    div = k & -k  # the largest power of two dividing K
    if div >= 2048:
        return min(div, cap)
    options = [(1, 16 * next_pow2(max(1, k // 16)))] if k <= cap else []
    seg = 2048
    while seg <= cap:
        options.append((cdiv(k, seg), seg))
        seg *= 2
    if div >= 256:
        options.append((k // div, div))
    busy = [(count, size, k / (count * size)) for count, size in options]
    good = [o for o in busy if o[2] >= 0.85]
    count, size, _ = min(good) if good else max(busy, key=lambda o: (o[2], -o[0]))
    return k if count == 1 else size


_RESIDENT: dict = {}


def _resident_programs(args, grid, kwargs, device: torch.device, kernel) -> Optional[int]:
    """How many programs of this gemv6 build fit on one SM at once (registers,
    warps, shared memory), read from the compiled kernel; None if unknown.
    Cached per build. The session-4 configs were tuned where the kernel took
    127 registers (8 two-warp programs per SM, Triton 3.6); another compiler
    can allocate differently, and a grid just over a whole wave leaves a
    mostly idle second one (measured: 118 us instead of 81 on 70B.gate_up)."""
    if _common.INTERPRET or device.type != "cuda":
        return None
    key = (kernel.fn.__name__, device.index, args[0].dtype, args[6].dtype, tuple(kwargs.items()))  # fixed order
    if key not in _RESIDENT:
        try:
            compiled = kernel.warmup(*args, grid=grid, **kwargs)
            compiled._init_handles()
            props = torch.cuda.get_device_properties(device)
            warps = kwargs["num_warps"]
            regs = -(-compiled.n_regs // 8) * 8 * 32 * warps  # registers go out in 8-per-thread steps
            by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(1, regs)
            smem = compiled.metadata.shared
            by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // smem if smem else 32
            by_warps = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
            _RESIDENT[key] = max(1, min(by_regs, by_smem, by_warps, 32))
        except Exception:  # noqa: BLE001 - an introspection API that moved: keep the configured grid
            _RESIDENT[key] = None
    return _RESIDENT[key]


def _whole_wave_programs(kernel, args, grid, kwargs, device: torch.device, per_sm: int) -> int:
    """``per_sm`` programs an SM, cut to whole waves of what the compiled ``kernel``
    fits on one (the persistent GEMVs)."""
    sms = _common._sm_count(device)
    fit = _resident_programs(args, grid, kwargs, device, kernel)
    if fit is not None and per_sm > fit:
        return (per_sm // fit) * fit * sms  # whole waves only
    return per_sm * sms


# the streamed-x GEMV (gemv7) in the gemv6 path: "auto" where measured faster, "1" everywhere, "0" never
GEMV7 = "auto"


def _gemv7_config(m: int, n: int, k: int):
    """(ROWS, num_warps, KC blocks a step, programs per SM, PREFETCH) of the streamed-x
    GEMV for this shape (``rules.TILES``' gemv7 rows, bf16's), or None where gemv6 (x
    resident) runs (``_gemv7_preferred``)."""
    if GEMV7 == "0" or (GEMV7 == "auto" and not _gemv7_preferred(n, k)):
        return None
    return _gemv7_tile(rules.tile("gemv7", m, n, k, conditions=CONDITIONS), k)


def _gemv7_tile(out: tuple, k: int) -> tuple:
    """A gemv7 row's tile, KC where it names none the step of 128 or 256 blocks that pads K less (256 on a tie)."""
    rows, warps, kc, per_sm, prefetch = out
    kb = k // BLOCK_SIZE
    if kc is None:
        kc = 256 if cdiv(kb, 256) * 2 <= cdiv(kb, 128) else 128
    return rows, warps, kc, per_sm, prefetch


def _gemv7_f16_config(n: int, k: int, cfg: tuple) -> tuple:
    """gemv7's config for fp16 activations, which pay each block's x exponent every step (``_x_pairs_f16``):
    the fp16 row of ``rules.TILES``' gemv7 rows where it holds (layers of 128M weights and more), else ``cfg``
    (bf16's)."""
    found = rules.first(rules.TILES, rules.Call(1, n, k, torch.float16, None, None), "gemv7", CONDITIONS)
    return _gemv7_tile(found.out, k) if found.dtype == torch.float16 else cfg


def _gemv7_preferred(n: int, k: int) -> bool:
    """Where the streamed-x GEMV replaces gemv6: ``rules.TILES``' "gemv6/gemv7" rows."""
    return rules.tile("gemv6/gemv7", 1, n, k, conditions=CONDITIONS)


def _gemv7(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc, cfg, slots=(0, 6)):
    """The streamed-x GEMV's launch (whole rows a program, no K split): a ``Launch`` called with the
    arguments at ``slots`` (x and y; the activations' global scale too in a W4A4 plan)."""
    rows, warps, kc, per_sm, prefetch = cfg
    kb = k // 16
    args = (x2, words.view(torch.int64), sbits, enc, xenc_arg, bias_arg, y, m, n, k, x2.stride(0), y.stride(0))
    kwargs = dict(HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, ROWS=rows, KC=kc, EVEN_K=kb % kc == 0,
                  ALIGNED=k % 256 == 0, EMULATE=_common.INTERPRET, PREFETCH=prefetch,
                  KB_C=_const_kb(n, k, rows), F16=x2.dtype == torch.float16, num_warps=warps)
    programs = _whole_wave_programs(_gemv_stream_kernel, args, (1, m), kwargs, x2.device, per_sm)
    grid = (max(1, min(cdiv(n, rows), programs)), m)
    return _common.Launch(_gemv_stream_kernel, grid, args, slots, kwargs)


def _const_kb(n: int, k: int, rows: int) -> int:
    """``KB_C`` of gemv6 / gemv7: K/16 where the build may fix it (N a multiple of ``rows``), else 0 (K a
    run-time argument). With K fixed a thread's rows sit at constant distances and its loads take immediate
    offsets (8-10% fewer instructions a step, Triton 3.6 SASS)."""
    return k // BLOCK_SIZE if n % rows == 0 and k % BLOCK_SIZE == 0 else 0


# gemv6 / gemv7 address a row's blocks with 32-bit offsets (row * K/16 + block): layers of up to 2^31
# blocks (34 billion weights; the largest LLM layers hold about 2 billion)
GEMV6_MAX_BLOCKS = 1 << 31


def _block_offsets_fit(n: int, k: int) -> bool:
    return n * cdiv(k, BLOCK_SIZE) < GEMV6_MAX_BLOCKS


def _gemv6(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc, *, slots=(0, 6),
           dependent=False):
    """The resident-x GEMV's launches, K in segments
    (config) through an fp32 workspace and a summing pass: a callable ``run(*tensors) -> y`` taking
    the arguments at ``slots`` (x and y; the activations' global scale too in a W4A4 plan; y last).
    Shapes ``_gemv7_config`` names run the streamed-x GEMV instead (plainly). ``dependent``: the
    GEMV launches as the programmatic dependent of the quantize launch just before it, which
    signalled it (``w4a4_pairs_gemv``; plainly, should the driver refuse that)."""
    if not _block_offsets_fit(n, k):
        raise ValueError(f"gemv6: a {n} x {k} weight has {n * cdiv(k, BLOCK_SIZE)} blocks, more than its "
                         f"32-bit offsets address ({GEMV6_MAX_BLOCKS}); use path 'gemv4' or 'mma'")
    cfg7 = _gemv7_config(m, n, k)
    if cfg7 is not None and x2.dtype == torch.float16:
        cfg7 = _gemv7_f16_config(n, k, cfg7)
    if cfg7 is not None:
        return _common.split_run(_gemv7(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc, cfg7,
                                slots), 1, y, None)
    rows, warps, per_sm, seg, prefetch = _gemv6_config(m, n, k)
    if seg % 16:
        raise ValueError(f"gemv6: K segment {seg} is not a whole number of 16-blocks")
    segments = cdiv(k, seg)
    kbp = next_pow2(max(1, seg // 16))
    if segments > 1 and kbp != seg // 16:
        raise ValueError(f"gemv6: a K segment ({seg}) must be a power-of-two number of blocks")
    tiles = cdiv(n, rows)
    split = segments > 1
    target = _common.split_workspace(segments, y)
    args = (x2, words.view(torch.int64), sbits, enc, xenc_arg, bias_arg, target, m, n, k, x2.stride(0), y.stride(0))
    kwargs = dict(HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, ROWS=rows, KBP=kbp, EVEN_K=kbp * segments == k // 16,
                  ALIGNED=k % 256 == 0, EMULATE=_common.INTERPRET, SPLIT=split, num_warps=warps, enable_fp_fusion=True,
                  PREFETCH=prefetch, MULDEC=_gemv6_muldec(n, k), KB_C=_const_kb(n, k, rows),
                  F16=x2.dtype == torch.float16, TRIGGER=split and _common.split_pdl(x2.device))
    if dependent:
        kwargs.update(WAIT=True, launch_pdl=True)
    programs = _whole_wave_programs(_gemv_resident_kernel, args, (1, m, segments), kwargs, x2.device, per_sm)
    grid = (max(1, min(tiles, cdiv(programs, segments))), m, segments)
    launch = _common.Launch(_gemv_resident_kernel, grid, args, slots, kwargs)
    run = _common.split_run(launch, segments, y, bias_arg if has_bias else None, kwargs["TRIGGER"])
    if not dependent:
        return run
    plain = lambda: _gemv6(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc, slots=slots)  # noqa: E731
    return _common.dependent_or_plain(run, plain, x2.device, "gemv6 after the quantize launch")


def w4a4_pairs_gemv(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether W4A4's gemv6 launch for M rows of an [N, K] weight is the programmatic dependent of its
    quantize launch (its first row tile's weights loaded before the wait): where ``w4a4_pdl``, on layers
    under 64M weights (gemv6's
    small-layer configs), not where the streamed-x GEMV (gemv7) runs. H200, session 25
    (results/w4a4_pdl_h200_v7.json, plain -> dependent, us): M = 1 8B qkv 8.89 -> 8.55, 8B o 7.71 ->
    7.31, Qwen2-7B o 7.48 -> 7.08, Phi-3-mini o (K split) 7.55 -> 7.27, fp16 + mse + bias 8B qkv 9.54 ->
    8.90; M = 2 8B qkv 12.57 -> 11.99, 8B o 10.48 -> 9.88; on the 64M-weight configs level or slower
    (8B gate_up 23.30 -> 23.19, 70B gate_up 72.64 -> 73.51), so those stay plain."""
    return n * k < 1 << 26 and _common.w4a4_pdl(device) and _gemv7_config(m, n, k) is None


def gemv4(x2, words, sbits, enc, xenc_arg, bias_arg, y, m, n, k, has_bias, x_enc):
    """The fp32 GEMV's launch (path "gemv4"), writing y."""
    block_n, block_b, warps = _gemv4_config(m, n, k)
    _gemv_blocks_kernel[(cdiv(n, block_n), m)](
        x2, words.view(torch.int64), sbits, enc, xenc_arg, bias_arg, y, m, n, k,  # [N, K/16] blocks
        x2.stride(0), y.stride(0), HAS_BIAS=has_bias, HAS_XENC=x_enc is not None, BLOCK_N=block_n,
        BLOCK_B=block_b, EVEN_K=(k // 16) % block_b == 0, ALIGNED=k % 256 == 0, num_warps=warps,
    )
    return y
