"""Routing of a MoE call for the grouped kernels (``grouped.py``): the (token, slot) pairs sorted by expert
and cut into tiles, with no host synchronization (CUDA graphs).

``route`` sorts the T * k pairs by expert (stable, so within an expert the pairs keep token order) and
cuts each expert's run into tiles of ``block_m`` rows; only tiles of experts that received pairs exist,
and the tile arrays have a host-known upper bound (``tile_bound``), the tiles past the real count marked
-1. On CUDA (and under the Triton interpreter) it is a counting sort in Triton (``route_triton``: one
launch up to ``ROUTE_CHUNK`` pairs, three past it); elsewhere, and for ``backend="reference"``, torch ops
(``route_reference``). Both give the same ``Routing``, field by field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import nvfp4
from ._backend import BACKENDS, BackendUnavailable
from ._common import INTERPRET, cdiv


@dataclass
class Routing:
    """The pairs of a MoE call sorted by expert, and the tiles the grouped kernel runs.

    order:       int64 ``[P]``: the pair (``token * k + slot``) at each sorted position; pairs routed
                 outside ``[0, E)`` (transformers' expert-parallel sentinel ``>= E``) sort last and
                 belong to no expert.
    token:       int32 ``[P]``: the token of each sorted pair (the activation row w13 reads).
    offsets:     int32 ``[E + 1]``: expert e's pairs are the sorted positions ``offsets[e]:offsets[e+1]``.
    tile_expert: int32 ``[tiles]``: each tile's expert, -1 for the unused tiles of the upper bound.
    tile_row:    int32 ``[tiles]``: each tile's first sorted position.
    valid:       bool ``[P]``: whether the sorted pair belongs to an expert.
    block_m:     rows a tile.
    position:    int32 ``[P]``: the sorted position of each pair (the inverse of ``order``; the combine
                 reads each token's k rows through it)."""

    order: torch.Tensor
    token: torch.Tensor
    offsets: torch.Tensor
    tile_expert: torch.Tensor
    tile_row: torch.Tensor
    valid: torch.Tensor
    block_m: int
    position: Optional[torch.Tensor] = None

    @property
    def pairs(self) -> int:
        return self.order.numel()


def block_m_for(pairs: int, experts: int) -> int:
    """Rows a tile: the mean pairs an expert (decode: a few, one 16-row tile each; prefill: up to 128)."""
    mean = cdiv(pairs, max(1, min(experts, pairs)))
    return 16 if mean <= 16 else 32 if mean <= 32 else 64 if mean <= 96 else 128


def tile_bound(pairs: int, experts: int, block_m: int) -> int:
    """The host-known upper bound of tiles: ``cdiv(P, block_m)`` plus one partial tile per active expert."""
    return cdiv(pairs, block_m) + min(experts, pairs)


def _kernels_for(x: torch.Tensor, backend: str, op: str) -> bool:
    """Whether ``op`` (routing, combine) runs as Triton kernels: ``backend`` "auto" or "triton" on a CUDA
    tensor or under the interpreter; "reference" (or a CPU tensor under "auto") takes the torch ops."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    able = x.is_cuda or INTERPRET
    if backend == "triton" and not able:
        raise BackendUnavailable(f"backend='triton' cannot run {op}: the input is on {x.device}, the Triton "
                                 f"kernels need a CUDA device (or TRITON_INTERPRET=1)")
    return backend != "reference" and able


def route(top_k_index: torch.Tensor, num_experts: int, block_m: Optional[int] = None, *,
          backend: str = "auto") -> Routing:
    """``Routing`` of ``top_k_index [T, k]`` over ``num_experts`` experts, without waiting for the device
    (no ``.item()``, no data-dependent shapes): capturable in a CUDA graph. On CUDA (and under the Triton
    interpreter) one launch up to ``ROUTE_CHUNK`` pairs, three past it (``route_triton``), else (a CPU
    tensor, or ``backend="reference"``) torch ops (``route_reference``); both give the same ``Routing``,
    field by field."""
    if top_k_index.dim() != 2:
        raise nvfp4.NVFP4Error(f"route: top_k_index must be [tokens, k], got shape {tuple(top_k_index.shape)}")
    if num_experts < 1:
        raise nvfp4.NVFP4Error(f"route: num_experts must be >= 1, got {num_experts}")
    if block_m is not None and block_m < 1:
        raise nvfp4.NVFP4Error(f"route: block_m must be >= 1, got {block_m}")
    if _kernels_for(top_k_index, backend, "route") and top_k_index.numel():
        return route_triton(top_k_index, num_experts, block_m)
    return route_reference(top_k_index, num_experts, block_m)


def route_reference(top_k_index: torch.Tensor, num_experts: int, block_m: Optional[int] = None) -> Routing:
    """``route`` in torch ops: a stable argsort of the pairs by expert, the counts, their cumulative sums
    and a ``searchsorted`` for the tiles."""
    tokens, k = top_k_index.shape
    dev = top_k_index.device
    flat = top_k_index.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(counts[:num_experts], 0)
    pairs = tokens * k
    bm = block_m or block_m_for(pairs, num_experts)
    tiles = (counts[:num_experts] + bm - 1) // bm
    cum = torch.cumsum(tiles, 0)
    t = torch.arange(tile_bound(pairs, num_experts, bm), device=dev)
    te = torch.searchsorted(cum, t, right=True)          # num_experts for the tiles past the last
    te_c = te.clamp(max=num_experts - 1)
    tile_row = offsets[te_c] + (t - (cum - tiles)[te_c]) * bm
    position = torch.empty(pairs, dtype=torch.int32, device=dev).index_copy_(
        0, order, torch.arange(pairs, dtype=torch.int32, device=dev))
    return Routing(order, (order // k).to(torch.int32), offsets.to(torch.int32),
                   torch.where(te < num_experts, te, -1).to(torch.int32), tile_row.to(torch.int32),
                   sorted_key < num_experts, bm, position)


# The routing kernels: a stable counting sort of the P pairs by key (the expert; E for the pairs of no
# expert, so they sort last; E + 1 for the lanes past P, never placed) in chunks of ROUTE_CHUNK pairs.
# (a) each chunk's histogram over BINS >= E + 2 bins; (b) one program: the totals, the offsets, each
# chunk's first position for each key, and the tile arrays over the host's upper bound; (c) each chunk
# places its pairs at its base for their key plus their rank among the chunk's pairs of that key. Pairs
# that fit one chunk (decode: up to 16 tokens at top-8) take one launch doing all three.
ROUTE_CHUNK = 128


@triton.jit
def _route_keys(idx_ptr, c, P, E, CHUNK: tl.constexpr):
    i = c * CHUNK + tl.arange(0, CHUNK)
    ok = i < P
    v = tl.load(idx_ptr + i, mask=ok, other=0).to(tl.int64)
    key = tl.where((v >= 0) & (v < E), v, E).to(tl.int32)
    return i, ok, tl.where(ok, key, E + 1)


@triton.jit
def _route_hist_kernel(idx_ptr, hist_ptr, P, E, CHUNK: tl.constexpr, BINS: tl.constexpr):
    c = tl.program_id(0)
    _, _, key = _route_keys(idx_ptr, c, P, E, CHUNK)
    tl.store(hist_ptr + c * BINS + tl.arange(0, BINS), tl.histogram(key, BINS))


@triton.jit
def _route_offsets_and_tiles(total, offsets_ptr, tile_expert_ptr, tile_row_ptr, E, TILES, BM,
                             BINS: tl.constexpr, TB: tl.constexpr):
    """From each key's pair count ``total [BINS]``: store the offsets and the tile arrays; return each
    key's first sorted position."""
    b = tl.arange(0, BINS)
    start = tl.cumsum(total, 0) - total
    tl.store(offsets_ptr + b, start, mask=b <= E)
    expert = b < E
    ntiles = tl.where(expert, (total + BM - 1) // BM, 0)
    cum = tl.cumsum(ntiles, 0)
    first = cum - ntiles                                 # each expert's first tile
    last = b == E - 1                                    # the tiles past the real ones count from the last expert
    for t0 in range(0, TILES, TB):
        t = t0 + tl.arange(0, TB)
        te = tl.sum((expert[None, :] & (cum[None, :] <= t[:, None])).to(tl.int32), 1)
        hit = expert[None, :] & (first[None, :] <= t[:, None]) & ((t[:, None] < cum[None, :]) | last[None, :])
        row = t * BM + tl.sum(tl.where(hit, start[None, :] - first[None, :] * BM, 0), 1)
        tl.store(tile_expert_ptr + t, tl.where(te < E, te, -1), mask=t < TILES)
        tl.store(tile_row_ptr + t, row, mask=t < TILES)
    return start


@triton.jit
def _route_store(i, ok, key, pos, order_ptr, token_ptr, valid_ptr, position_ptr, E, K):
    tl.store(order_ptr + pos, i.to(tl.int64), mask=ok)
    tl.store(token_ptr + pos, i // K, mask=ok)
    tl.store(valid_ptr + pos, (key < E).to(tl.uint8), mask=ok)
    tl.store(position_ptr + i, pos, mask=ok)


@triton.jit
def _route_scan_kernel(hist_ptr, base_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, C, E, TILES, BM,
                       BINS: tl.constexpr, CB: tl.constexpr, TB: tl.constexpr):
    b = tl.arange(0, BINS)
    total = tl.zeros((BINS,), dtype=tl.int32)
    for c0 in range(0, C, CB):
        rows = c0 + tl.arange(0, CB)
        blk = tl.load(hist_ptr + rows[:, None] * BINS + b[None, :], mask=(rows < C)[:, None], other=0)
        total += tl.sum(blk, 0)
    run = _route_offsets_and_tiles(total, offsets_ptr, tile_expert_ptr, tile_row_ptr, E, TILES, BM, BINS, TB)
    for c0 in range(0, C, CB):
        rows = c0 + tl.arange(0, CB)
        ok = (rows < C)[:, None]
        blk = tl.load(hist_ptr + rows[:, None] * BINS + b[None, :], mask=ok, other=0)
        tl.store(base_ptr + rows[:, None] * BINS + b[None, :], run[None, :] + tl.cumsum(blk, 0) - blk, mask=ok)
        run += tl.sum(blk, 0)


@triton.jit
def _route_one_chunk_kernel(idx_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, order_ptr, token_ptr, valid_ptr,
                            position_ptr, P, E, K, TILES, BM,
                            CHUNK: tl.constexpr, BINS: tl.constexpr, TB: tl.constexpr):
    """All of ``route`` in one program when the pairs fit one chunk (decode): a pair's position is the
    count of pairs with a smaller key plus the earlier pairs with its key."""
    i, ok, key = _route_keys(idx_ptr, 0, P, E, CHUNK)
    _route_offsets_and_tiles(tl.histogram(key, BINS), offsets_ptr, tile_expert_ptr, tile_row_ptr, E, TILES, BM,
                             BINS, TB)
    lane = tl.arange(0, CHUNK)
    before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & (lane[None, :] < lane[:, None]))
    pos = tl.sum(before.to(tl.int32), 1)
    _route_store(i, ok, key, pos, order_ptr, token_ptr, valid_ptr, position_ptr, E, K)


@triton.jit
def _route_place_kernel(idx_ptr, base_ptr, order_ptr, token_ptr, valid_ptr, position_ptr, P, E, K,
                        CHUNK: tl.constexpr, BINS: tl.constexpr):
    c = tl.program_id(0)
    i, ok, key = _route_keys(idx_ptr, c, P, E, CHUNK)
    lane = tl.arange(0, CHUNK)
    same_before = (key[:, None] == key[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(same_before.to(tl.int32), 1)           # stable: the chunk's earlier pairs of the same key
    pos = tl.load(base_ptr + c * BINS + key, mask=ok, other=0) + rank
    _route_store(i, ok, key, pos, order_ptr, token_ptr, valid_ptr, position_ptr, E, K)


def route_launch_config(num_experts: int) -> tuple:
    """(BINS, chunks a step of the scan, tiles a step of the scan, the scan's warps) for E experts. BINS is
    at least a warp (Triton lowers ``tl.histogram`` over at least 32 bins) and the kernels that call
    ``tl.histogram`` run 4 warps, one ROUTE_CHUNK-pair chunk exactly (a layout replicated over more warps
    would count each pair more than once)."""
    bins = max(32, triton.next_power_of_2(num_experts + 2))
    return bins, max(1, min(16, 4096 // bins)), max(16, min(128, 8192 // bins)), 4 if bins <= 128 else 8


def route_triton(top_k_index: torch.Tensor, num_experts: int, block_m: Optional[int] = None) -> Routing:
    """``route`` as three launches (histograms, scan, placement; one launch where the pairs fit one chunk):
    no host synchronization, deterministic, the same ``Routing`` as ``route_reference``."""
    tokens, k = top_k_index.shape
    dev = top_k_index.device
    pairs = tokens * k
    bm = block_m or block_m_for(pairs, num_experts)
    bound = tile_bound(pairs, num_experts, bm)
    idx = top_k_index.reshape(-1)
    if not idx.is_contiguous() or idx.dtype not in (torch.int32, torch.int64):
        idx = idx.contiguous().long()
    bins, cb, tb, warps = route_launch_config(num_experts)
    chunks = cdiv(pairs, ROUTE_CHUNK)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(bound, dtype=torch.int32, device=dev)
    tile_row = torch.empty(bound, dtype=torch.int32, device=dev)
    order = torch.empty(pairs, dtype=torch.int64, device=dev)
    token = torch.empty(pairs, dtype=torch.int32, device=dev)
    valid = torch.empty(pairs, dtype=torch.bool, device=dev)
    position = torch.empty(pairs, dtype=torch.int32, device=dev)
    placed = (order, token, valid.view(torch.uint8), position)
    if chunks == 1:  # decode: one launch
        _route_one_chunk_kernel[(1,)](idx, offsets, tile_expert, tile_row, *placed, pairs, num_experts, k, bound, bm,
                                     CHUNK=ROUTE_CHUNK, BINS=bins, TB=tb, num_warps=4)
    else:
        hist = torch.empty((chunks, bins), dtype=torch.int32, device=dev)
        base = torch.empty_like(hist)
        _route_hist_kernel[(chunks,)](idx, hist, pairs, num_experts, CHUNK=ROUTE_CHUNK, BINS=bins, num_warps=4)
        _route_scan_kernel[(1,)](hist, base, offsets, tile_expert, tile_row, chunks, num_experts, bound, bm,
                                 BINS=bins, CB=cb, TB=tb, num_warps=warps)
        _route_place_kernel[(chunks,)](idx, base, *placed, pairs, num_experts, k, CHUNK=ROUTE_CHUNK, BINS=bins,
                                       num_warps=4)
    return Routing(order, token, offsets, tile_expert, tile_row, valid, bm, position)
