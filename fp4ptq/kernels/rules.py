"""The dispatch rules as data: which path takes a call (``RULES``) and which tile and K split it runs
(``TILES``), by M, N, K, activation dtype, W4A16 / W4A4 and GPU, read by one function, ``first``.

A row holds where it applies and what it gives (``row``): ``path``; ``m``, ``n``, ``k`` and ``nk``
(N * K, the weights), each an inclusive range ``(least, most)``; ``kdiv``, a multiple of which K must be;
``dtype`` (None: bf16 or fp16 activations alike) and ``w4a4`` (None: either); ``when``, named conditions
that must all hold; and ``out``, the tile (None in ``RULES``, whose answer is the path). ``first`` returns
the first row of a path (or of any path, for ``RULES``) that holds for a call. The conditions are what a
range cannot say; their reader passes them in (``first``'s ``conditions``), so this module imports no
kernel family and every family can read it:

* the device's (``dispatch.py``): ``bf16_below_sm80`` (bf16 on a GPU before sm_80, where the GEMVs'
  ``fma.rn.bf16x2`` is not PTX), ``mma_ready`` / ``wgmma_ready`` / ``wsgemm_ready`` / ``dot_scaled_ready``
  (the kernel takes the input and passed its self-test on the device: sm_90 for wgmma / wsgemm, sm_100 for
  the FP4 tensor cores), ``wsgemm_fills`` (``wsgemm.fills``: its plan for the SMs of the device splits the
  last wave's tiles or fills ``WSGEMM_MIN_FILL`` of the SMs), ``too_many_blocks`` (more than
  gemv6 / gemv7's 32-bit block offsets address, ``gemv.GEMV6_MAX_BLOCKS``);
* the GEMVs' (``gemv.py``): ``gemv6_one_segment`` / ``gemv6_split`` (K in one gemv6 segment or more,
  ``gemv._gemv6_segment`` under the cap of ``"gemv6/segment"``), ``gemv6_whole_2048`` (K whole segments of
  2048 or more), ``gemv7_whole_steps`` (K / 16 whole steps of 128 blocks).

What is computed, not chosen, stays with its family, which the column notes below name: the K split of
mma.py and wgmma.py from the SM count (the row gives the programs an SM it aims at and the least K a
program), gemv6's warps from its segment, gemv7's step that pads K less, wsgemm.py's split tail
(``wsgemm.plan``, a cost model of the SMs' time) and its 128 x 256 tile where that model says it is
cheaper. ``dispatch.plan`` gives the path, tile and split of a call together. The measurements behind the
rows are named at each (``benchmarks/results/``, summed up in ``docs/KERNELS.md``);
``tests/data/dispatch_table.json`` holds what they give for the README's and the model zoo's layers.
The MoE kernel's rules (``grouped.kernel_config`` / ``split_for``, ``grouped_dequant.takes_dequant``) are
not here: it is one op of its own (``kernels.moe_experts``), not a path of a single layer.
"""
from __future__ import annotations

from collections import namedtuple
from typing import Optional

import torch

NO_LIMIT = 1 << 62
ANY = (0, NO_LIMIT)
BF16, FP16 = torch.bfloat16, torch.float16
GEMV_MAX_M = 2  # the GEMVs take M <= 2 rows

Row = namedtuple("Row", "path m n k nk kdiv dtype w4a4 when out")
Call = namedtuple("Call", "m n k dtype device w4a4")


def row(path: str, m: tuple = ANY, *, n: tuple = ANY, k: tuple = ANY, nk: tuple = ANY, kdiv: int = 1,
        dtype: Optional[torch.dtype] = None, w4a4: Optional[bool] = None, when: tuple = (), out=None) -> Row:
    return Row(path, m, n, k, nk, kdiv, dtype, w4a4, when, out)


def first(rows: tuple, call: Call, path: Optional[str] = None, conditions: Optional[dict] = None) -> Optional[Row]:
    """The first of ``rows`` (of ``path``; any path where None) that holds for ``call``: M, N, K and N * K
    in its ranges, K a multiple of its ``kdiv``, its dtype and W4A16 / W4A4 (where it names them), then
    each condition of ``when`` in order (``conditions[name](call)``; a device's self-test runs only where
    everything before it holds). None where no row holds."""
    cm, cn, ck, cdtype, _, cw4a4 = call
    cnk = cn * ck
    for r in rows:  # (unpacked: the eager calls' host time)
        rpath, (m0, m1), (n0, n1), (k0, k1), (nk0, nk1), kdiv, dtype, w4a4, when, _ = r
        if m0 <= cm <= m1 and (path is None or rpath == path) and n0 <= cn <= n1 and k0 <= ck <= k1 \
                and nk0 <= cnk <= nk1 and ck % kdiv == 0 and (dtype is None or dtype == cdtype) \
                and (w4a4 is None or w4a4 == cw4a4) and all(conditions[name](call) for name in when):
            return r
    return None


_TILES_OF: dict = {}  # (id of TILES, path) -> that path's rows
_TILE: dict = {}      # (path, M, N, K, dtype, id of TILES, id of the conditions) -> its row: the launches' host time


def tile(path: str, m: int, n: int, k: int, dtype: Optional[torch.dtype] = None, conditions: Optional[dict] = None):
    """``out`` of the first ``TILES`` row of ``path`` for M rows of ``dtype`` times an [N, K] weight (the
    conditions of ``TILES`` are the GEMVs' shape conditions, so the answer is kept for the shape)."""
    key = (path, m, n, k, dtype, id(TILES), id(conditions))
    found = _TILE.get(key)
    if found is None:
        rows = _TILES_OF.get((id(TILES), path))
        if rows is None:
            rows = _TILES_OF[(id(TILES), path)] = tuple(r for r in TILES if r.path == path)
        found = first(rows, Call(m, n, k, dtype, None, None), path, conditions)
        if found is None:
            raise ValueError(f"no {path} tile in rules.TILES for M={m}, N={n}, K={k}: a row for it is missing")
        if len(_TILE) >= 1 << 16:
            _TILE.clear()
        _TILE[key] = found
    return found.out


# --------------------------------------------------------------------------- #
# Which path (``dispatch.choose``)
# --------------------------------------------------------------------------- #
NARROW = dict(n=(0, 8192), nk=(0, (1 << 26) - 1))  # gemv6's narrow layers, with ``gemv6_one_segment``
WSGEMM_MIN_FILL = 0.8  # wsgemm_fills: measured wins filled 0.85-0.97 of the SMs, losses 0.73 or less
WSGEMM_MIN_N_SMALL_M = 4096
_FILLS = ("wsgemm_fills", "wsgemm_ready")

RULES = (
    # M <= 2: bf16 below sm_80 takes the tiled GEMM. At M = 2 the narrow single-segment layers (8B qkv / o,
    # Qwen2-7B qkv / o, Gemma-2-9B o) keep gemv6 in fp16 (0.5-6% ahead) and W4A4 (mixed, -4% to +5%); bf16
    # W4A16 takes mma.py there too since its summing pass became a programmatic dependent (session 24,
    # results/split_rules_h200*.json); mma.py takes M = 2 on layers of 4M weights and more (results/
    # mma_h200_m2.json, m2_small_h200.json) and, above 25M weights, the layers too large for gemv6's 32-bit
    # offsets (the fp32 GEMV where mma.py cannot run); else gemv6 (gemv7 on the long-K layers: TILES)
    row("gemm", (1, GEMV_MAX_M), dtype=BF16, when=("bf16_below_sm80",)),
    row("gemv6", (2, 2), dtype=FP16, **NARROW, when=("gemv6_one_segment",)),
    row("gemv6", (2, 2), w4a4=True, **NARROW, when=("gemv6_one_segment",)),
    row("mma", (2, 2), nk=(1 << 22, NO_LIMIT), when=("mma_ready",)),
    row("mma", (1, GEMV_MAX_M), nk=(6144 * 4096 + 1, NO_LIMIT), when=("too_many_blocks", "mma_ready")),
    row("gemv4", (1, GEMV_MAX_M), when=("too_many_blocks",)),
    row("gemv6", (1, GEMV_MAX_M)),
    # M >= 3: W4A4 on the FP4 tensor cores (sm_100+)
    row("dot_scaled", (3, NO_LIMIT), w4a4=True, when=("dot_scaled_ready",)),
    # wsgemm.py (sm_90), ahead of or level with the path it replaces on every measured row of these:
    # M = 65..128 on layers of 3072 rows and K >= 3072 at any fill (results/wsgemm_narrow_h200.json: ahead of
    # wgmma.py, whose 64-row tiles decode every weight twice at M = 128: Qwen2-7B qkv 27.1 -> 18.6 us, Phi-3-mini
    # o 16.6 -> 15.9; behind at 1024 rows, 8B k at M = 128: 15.9 against 11.6)
    row("wsgemm", (65, 128), n=(3072, NO_LIMIT), k=(3072, NO_LIMIT), when=("wsgemm_ready",)),
    # M = 129..256 (one 256-row tile a weight tile) on layers of 3584 rows and K >= 3584 whatever the plan
    # (results/wsgemm_mid_m_h200.json, against dequantize + cuBLAS: Qwen2-72B qkv at 256 127.1 -> 97.1 us;
    # behind on Phi-3-mini o and, from M = 384, on the K = 3584 layers), and of 8192 rows at K >= 3072
    # (results/wsgemm_phi_gemma_h200.json: Phi-3-mini qkv at 160..256 47.4 -> 38.3 us)
    row("wsgemm", (129, 256), n=(3584, NO_LIMIT), k=(3584, NO_LIMIT), when=("wsgemm_ready",)),
    row("wsgemm", (129, 256), n=(8192, NO_LIMIT), k=(3072, NO_LIMIT), when=("wsgemm_ready",)),
    # M = 33..1024 where its plan splits the last wave or fills 80% of the SMs (results/wsgemm_h200_v4.json,
    # wsgemm_h200_rule.json: 1.03-1.6x dequantize + cuBLAS; behind where a partial wave idles SMs and from
    # M = 1536 on most layers), K >= 4096 (K = 3072 / 3584 on layers of 8192 rows and more,
    # results/wsgemm_h200_shortk.json); at M = 33..128 (its 64- and 128-row tiles, results/
    # wsgemm_small_m_h200.json: 1.02-1.62x mma.py / wgmma.py) on layers of 4096 rows and more (k / v, 1024
    # rows, never timed alone, keep mma.py / wgmma.py: results/e2e_decode_h200_b64_128_*.json).
    row("wsgemm", (33, 128), n=(WSGEMM_MIN_N_SMALL_M, NO_LIMIT), k=(4096, NO_LIMIT), when=_FILLS),
    row("wsgemm", (33, 128), n=(8192, NO_LIMIT), k=(3072, NO_LIMIT), when=_FILLS),
    row("wsgemm", (129, 1024), k=(4096, NO_LIMIT), when=_FILLS),
    row("wsgemm", (129, 1024), n=(8192, NO_LIMIT), k=(3072, NO_LIMIT), when=_FILLS),
    # W4A4 (results/wsgemm_h200_split.json, "w4a4big": the cuBLAS path scales its output in a second pass):
    # to M = 2048, and to 8192 where K <= 4096 (8B o at 8192: 530 against 543 us; 70B down at 8192 behind)
    row("wsgemm", (1025, 2048), w4a4=True, k=(4096, NO_LIMIT), when=_FILLS),
    row("wsgemm", (1025, 2048), w4a4=True, n=(8192, NO_LIMIT), k=(3072, NO_LIMIT), when=_FILLS),
    row("wsgemm", (2049, 8192), w4a4=True, k=(4096, 4096), when=_FILLS),
    row("wsgemm", (2049, 8192), w4a4=True, n=(8192, NO_LIMIT), k=(3072, 4096), when=_FILLS),
    # mma.py to M = 64 (session-5 H200 sweeps, results/mma_h200_sweep*.json); wgmma.py at 65..128 (sm_90,
    # results/wgmma_h200_v3.json: 1.05-1.37x dequantize + cuBLAS at M = 128, level with mma.py at 64, behind
    # cuBLAS from 256); dequantize + cuBLAS from M = 64; the tiled GEMM below (K % 64 != 0, or no Gluon)
    row("mma", (3, 64), when=("mma_ready",)),
    row("wgmma", (65, 128), when=("wgmma_ready",)),
    row("cublas", (64, NO_LIMIT)),
    row("gemm", (1, NO_LIMIT)),
)

# --------------------------------------------------------------------------- #
# Which tile and K split (each family's ``config``; ``dispatch.plan``)
# --------------------------------------------------------------------------- #
# wsgemm.py's tiles: (BM, BN, BK, TMA ring stages, decoded ring stages, decoder warps, decoder registers,
# register cap a thread at launch)
WS_256x128 = (256, 128, 64, 4, 2, 4, 128, 168)
WS_128x128 = (128, 128, 64, 4, 2, 4, 128, 168)
WS_64x128 = (64, 128, 64, 4, 2, 4, 96, 128)
WS_128x256 = (128, 256, 64, 4, 2, 4, 128, 168)
WS_WIDE_GAIN = 0.95
_LARGE = (1 << 26, NO_LIMIT)  # gemv6's large layers: 64M weights and more

TILES = (
    # gemv6's K segment: at most 8192 on layers of 64M weights and more, 4096 below
    row("gemv6/segment", nk=_LARGE, out=8192),
    row("gemv6/segment", out=4096),
    # gemv6 (x resident): (ROWS, blocks of a row a thread, most warps, programs an SM, PREFETCH); the warps
    # from the segment (a thread holding that many blocks, 1 to most), the programs an SM None: 32768 /
    # segment, at most 8 (cut to whole waves at launch). Large layers (session 7, results/
    # gemv6_prefetch_h200.json: 8B gate_up 24.2 -> 22.6 us, 70B gate_up 80.0 -> 77.2, 70B down 50.4 -> 46.9):
    row("gemv6", nk=_LARGE, when=("gemv6_split",), out=(4, 1, 4, 16, True)),
    row("gemv6", nk=_LARGE, out=(4, 1, 4, None, True)),
    # K whole segments of 2048 or more: 8 rows, two blocks a thread (session 11, results/muldec_sweep_h200.json,
    # muldec_rule_h200_first.json: 8B down 16.4 -> 14.9 us; with a masked last or 512-K segments 2-6% slower)
    row("gemv6", when=("gemv6_split", "gemv6_whole_2048"), out=(8, 2, 8, 16, False)),
    # the narrow single-segment layers at M = 1: each row tile loaded ahead on twice the warps (session 20,
    # results/cold_sweep_h200.json, narrow_ahead_h200.json: 5-26% faster with the weights cold in L2, 8B qkv
    # 8.55 -> 6.99 us; at M = 2 15-20% slower: the session-9 row below)
    row("gemv6", (1, 1), **NARROW, when=("gemv6_one_segment",), out=(4, 2, 8, 4, True)),
    # the session-4 rule (results/sweep_h200_s4_round*.json), single-segment layers of at most 8192 rows on 4
    # rows and 4 programs an SM (session 9, results/gemv6_small_h200.json: Qwen2-7B qkv 8.79 -> 6.52 us)
    row("gemv6", when=("gemv6_split",), out=(4, 4, 8, 16, False)),
    row("gemv6", **NARROW, when=("gemv6_one_segment",), out=(4, 4, 8, 4, False)),
    row("gemv6", n=(16384, NO_LIMIT), out=(4, 4, 8, 8, False)),
    row("gemv6", out=(8, 4, 8, 8, False)),
    # gemv7 (x streamed) instead of gemv6 on layers of 32M weights and more whose K gemv6 would split (session
    # 11, gemv6 -> gemv7: 70B down 47.0 -> 42.3 us, Qwen2-72B down 67.7 -> 46.5; single-segment K stays)
    row("gemv6/gemv7", nk=(1 << 25, NO_LIMIT), when=("gemv6_split",), out=True),
    row("gemv6/gemv7", out=False),
    # gemv7: (ROWS, warps, KC blocks a step, programs an SM, PREFETCH); KC None: 256 or 128, whichever pads K
    # less, 256 on a tie (results/gemv7_h200.json, gemv7_masked_h200.json). fp16 on layers of 128M weights and
    # more: 16 rows a tile share each block's x exponent (session 21, results/gemv_fp16_h200_sweep.json:
    # 70B down 49.3 -> 41.4 us)
    row("gemv7", nk=(1 << 27, NO_LIMIT), dtype=FP16, out=(16, 4, None, 4, False)),
    row("gemv7", when=("gemv7_whole_steps",), out=(8, 2, 128, 8, True)),
    row("gemv7", out=(8, 4, None, 8, False)),
    # the fp32 GEMV: (BLOCK_N, BLOCK_B at most, warps), H200 runs 3 and 4
    row("gemv4", n=(16384, NO_LIMIT), out=(16, 64, 2)),
    row("gemv4", out=(8, 128, 4)),
    # mma.py: (BN, BK, warps, stages, (programs an SM, least K a program)); BM: M to a power of two, 8 or
    # more; a 3-step cp.async ring; K halved to about 3 programs an SM keeping 1024 K or more a program, else
    # ranges of 512 K or more (``mma.k_split``). The session-5 sweep (results/mma_h200.json): at M <= 16
    # 128 rows on 4 warps (64 on 2 to 25M weights) and K steps of 128; above, steps of 64 on 2 warps
    row("mma", (0, 16), nk=(0, 6144 * 4096), kdiv=128, out=(64, 128, 2, 3, (3, 1024))),
    row("mma", (0, 16), nk=(0, 6144 * 4096), out=(64, 64, 2, 3, (3, 1024))),
    row("mma", (0, 16), kdiv=128, out=(128, 128, 4, 3, (3, 1024))),
    row("mma", (0, 16), out=(128, 64, 4, 3, (3, 1024))),
    row("mma", (17, NO_LIMIT), n=(16384, NO_LIMIT), out=(128, 64, 2, 3, (3, 1024))),
    row("mma", (17, NO_LIMIT), out=(64, 64, 2, 3, (3, 1024))),
    # wgmma.py: (BN, BM, BK, warps, stages, wait depth, register cap, (programs an SM, least K a program));
    # K halved to about a program an SM in step pairs, 512 K or more (``wgmma.k_split``). Run v2: 64-row
    # tiles and no wait depth best up to M = 128
    row("wgmma", (0, 128), kdiv=256, out=(128, 64, 128, 8, 3, 0, 0, (1, 512))),
    row("wgmma", (0, 128), out=(128, 64, 64, 8, 3, 0, 0, (1, 512))),
    row("wgmma", (129, NO_LIMIT), kdiv=256, out=(128, 128, 128, 8, 2, 1, 0, (1, 512))),
    row("wgmma", (129, NO_LIMIT), out=(128, 128, 64, 8, 2, 1, 0, (1, 512))),
    # wsgemm.py: (tile, the 128 x 256 tile's cost a K step or None); the 128 x 256 tile where that cost times
    # its plan's span is under WS_WIDE_GAIN of the row's tile's (``wsgemm.config``). 64 rows (one consumer
    # warpgroup, two CTAs an SM) to M = 64 and 128 to 128 (session 22, results/wsgemm_small_m_h200.json);
    # 256 from 129 (run v2: 7-9% ahead of 128 x 256); the step costs fitted to the measured time ratios
    # (session 28, results/wsgemm_narrow_h200.json, wsgemm_wide_rule_h200.json: 1.37-1.54 at M <= 128;
    # session 29, results/wsgemm_wide_big_h200.json: 1.09-1.32 above)
    row("wsgemm", (0, 64), out=(WS_64x128, None)),
    row("wsgemm", (65, 128), out=(WS_128x128, 1.42)),
    row("wsgemm", (129, NO_LIMIT), out=(WS_256x128, 1.2)),
    # the tiled Triton GEMM: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages), the best of the H200 sweeps
    # (results/kernels_h200*.json; M <= 16 from run 4)
    row("gemm", (0, 16), n=(16384, NO_LIMIT), out=(16, 64, 128, 1, 4, 4)),
    row("gemm", (0, 16), out=(16, 32, 256, 1, 2, 4)),
    row("gemm", (17, 64), out=(64, 64, 128, 8, 4, 4)),
    row("gemm", out=(128, 128, 128, 8, 8, 3)),
)
