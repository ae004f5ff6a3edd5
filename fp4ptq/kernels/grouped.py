"""Grouped NVFP4 GEMM for Mixture-of-Experts layers: one launch per expert projection per layer (W4A4:
two, the activations quantized once first).

A MoE layer routes each of its T tokens to k of its E experts. ``route`` sorts the T * k (token, slot)
pairs by expert (stable, so within an expert the pairs keep token order) and cuts each expert's run of
pairs into tiles of ``block_m`` rows; ``grouped_linear`` then multiplies, in one launch, every pair's
activation row by its expert's weight, read from a stacked view of the experts' packed weights
(``StackedWeight``: codes ``[E, N, K/2]``, block scales ``[E, N, K/16]``, global scales ``[E]``). Only
tiles of experts that received pairs exist, so experts without tokens are never read; the grid has an
upper bound of tiles (``cdiv(P, block_m) + min(E, P)``, P pairs) known on the host, and the programs
past the real count return at once, so the launch needs no host synchronization (CUDA graphs).

The same kernel takes decode (a few pairs: one tile per active expert, each program streams a slice of
one expert's weight) and prefill (many pairs per expert: the tile of ``block_m`` rows reuses each
decoded weight tile ``block_m`` times). Gate and up are one GEMM (w13): the caller stacks each expert's
gate rows over its up rows (one shared weight global scale). The down projection reads the pairs in
sorted order (no gather). At decode (16-row tiles) on a grid short of programs, the launch splits K
(``split_for``; program_id(2) walks one slice) and writes fp32 partial sums ``[S, P, N]`` (output scale
applied, bias in the first slice) to a workspace; the consumers that run anyway add them in split order
(no atomics: run-to-run bit-identical, and no launch added). For 128-row tiles (prefill) W4A16 in bf16
takes another path: the active experts dequantized, then torch's grouped GEMM (``grouped_dequant.py``).

The glue around the two launches is Triton too on CUDA (torch ops elsewhere, and for ``backend="reference"``):
``route`` is a stable counting sort in three small launches, one at decode (``route_triton``; about 15 torch ops cost more
than both GEMMs at decode); ``swiglu`` the SwiGLU gating ``silu(g) * u`` of w13's output in one launch (fp32,
rounded once; a layer with other gating passes its own ``gate(g, u)``, run as torch ops); and ``combine`` the
weighted sum of each token's k rows in one launch reading y through the inverse permutation
(``Routing.position``). The routing and the combine equal their torch forms bit for bit, the gating within
the dense kernels' tolerance (the GPU's exp and division).

Numerics, as the dense kernels (``gemm.py``): the weight is decoded to ``code value * block scale``
(exact in 16 bits), the products summed in fp32 and the sum multiplied by ``2^14 / global_enc`` (one
correctly rounded scalar per expert). W4A4 first quantizes each pair's activation row once, in a prologue
launch (``quantize_pairs``), under the pair's expert's activation global scale with
``quantize_kernel.quantize_halves`` (the codes and scales of ``nvfp4.quantize``, Four Over Six included) to
a ``[P, K]`` workspace of the exact ``sign * v * scale`` operands in x's dtype; the kernel reads them as
W4A16 reads x (in sorted order) and divides by both global scales. The output therefore equals the per-expert reference (``grouped_linear_reference``:
the loop over experts through ``fp4ptq.kernels``' reference, i.e. ``nvfp4.py``) up to fp32 summation
order and the reference's rounding of the decoded weight to the activation dtype: the dense kernels'
tolerance (relative Frobenius error < 1e-2; docs/KERNELS.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import triton
import triton.language as tl

from .. import nvfp4
from ..nvfp4 import BLOCK_SIZE, NVFP4Tensor
from ._backend import BACKENDS, BackendUnavailable, linear_reference, triton_unavailable_reason
from ._common import INTERPRET, _output_scale, _sm_count, cdiv, decode_tile
from .quantize_kernel import FOUR_SIX_CODES, quantize_halves, signed_scaled
from .routing import (ROUTE_CHUNK, Routing, _kernels_for, block_m_for, route, route_launch_config,  # noqa: F401
                      route_reference, route_triton, tile_bound)


@dataclass
class StackedWeight:
    """One expert projection of a MoE layer, every expert's NVFP4 weight stacked.

    packed:    uint8 ``[E, N, K/2]``; scale: float8_e4m3fn ``[E, N, K/16]``;
    enc:       fp32 ``[E]`` weight global scales (divisors);
    bias:      ``[E, N]`` or None;
    input_amax: fp32 ``[E]`` each expert's calibrated activation amax for W4A4, or None for W4A16;
    four_six:  the activation Four Over Six rule (W4A4 only).

    ``input_enc`` (derived, fp32 ``[E]``): the activation global scales the reference derives from
    ``input_amax`` (``nvfp4.global_encode_scale``, Four Over Six's numerator where ``four_six``)."""

    packed: torch.Tensor
    scale: torch.Tensor
    enc: torch.Tensor
    bias: Optional[torch.Tensor] = None
    input_amax: Optional[torch.Tensor] = None
    four_six: Optional[str] = None

    def __post_init__(self) -> None:
        self.input_enc = (None if self.input_amax is None
                          else nvfp4.global_encode_scale(self.input_amax.float(), self.four_six is not None))

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    @property
    def out_features(self) -> int:
        return self.packed.shape[1]

    @property
    def in_features(self) -> int:
        return self.packed.shape[2] * 2

    def expert(self, e: int) -> NVFP4Tensor:
        """Expert ``e``'s weight as an ``NVFP4Tensor`` (views)."""
        return NVFP4Tensor(self.packed[e], self.scale[e], self.enc[e].reshape(()),
                           torch.Size((self.out_features, self.in_features)), torch.bfloat16)

    def check(self) -> None:
        """Raise ``NVFP4Error`` naming what is inconsistent."""
        e, n, half = self.packed.shape if self.packed.dim() == 3 else (None, None, None)
        if e is None or self.packed.dtype != torch.uint8:
            raise nvfp4.NVFP4Error(f"StackedWeight.packed: expected uint8 [E, N, K/2], got "
                                   f"{self.packed.dtype} {tuple(self.packed.shape)}")
        if self.scale.shape != (e, n, half * 2 // BLOCK_SIZE) or self.scale.dtype != torch.float8_e4m3fn:
            raise nvfp4.NVFP4Error(f"StackedWeight.scale: expected float8_e4m3fn {(e, n, half * 2 // BLOCK_SIZE)}, "
                                   f"got {self.scale.dtype} {tuple(self.scale.shape)}")
        if self.enc.shape != (e,) or self.enc.dtype != torch.float32:
            raise nvfp4.NVFP4Error(f"StackedWeight.enc: expected fp32 [{e}], got {self.enc.dtype} {tuple(self.enc.shape)}")
        if self.bias is not None and self.bias.shape != (e, n):
            raise nvfp4.NVFP4Error(f"StackedWeight.bias: expected [{e}, {n}], got {tuple(self.bias.shape)}")
        if self.input_amax is not None and self.input_amax.shape != (e,):
            raise nvfp4.NVFP4Error(f"StackedWeight.input_amax: expected [{e}], got {tuple(self.input_amax.shape)}")
        if self.four_six not in FOUR_SIX_CODES:
            raise nvfp4.NVFP4Error(f"StackedWeight.four_six: unknown rule {self.four_six!r}; "
                                   f"choose one of {nvfp4.FOUR_SIX_RULES}")


def stack_weights(weights: list, biases: Optional[list] = None, input_amax: Optional[list] = None,
                  four_six: Optional[str] = None) -> StackedWeight:
    """A ``StackedWeight`` from one ``NVFP4Tensor`` per expert (copies); W4A4 with the per-expert
    calibrated ``input_amax``."""
    if not weights:
        raise nvfp4.NVFP4Error("stack_weights: no expert weights")
    shape = weights[0].shape
    for e, w in enumerate(weights):
        if w.shape != shape or len(shape) != 2 or w.padded_k != shape[-1]:
            raise nvfp4.NVFP4Error(f"stack_weights: expert {e} has shape {tuple(w.shape)} (padded K {w.padded_k}); "
                                   f"every expert needs the unpadded 2-D shape {tuple(shape)}")
    amax = None
    if input_amax is not None:
        amax = torch.stack([torch.as_tensor(a, dtype=torch.float32).reshape(()) for a in input_amax])
        amax = amax.to(weights[0].packed.device)
    out = StackedWeight(
        torch.stack([w.packed for w in weights]), torch.stack([w.block_scale for w in weights]),
        torch.stack([w.global_enc.reshape(()).float() for w in weights]),
        None if biases is None else torch.stack(list(biases)), amax, four_six if input_amax is not None else None)
    out.check()
    return out




# --------------------------------------------------------------------------- #
# The consumers of the grouped launches: the SwiGLU gating after w13, the weighted combine after w2. Each
# reads the launch's output ``[P, N]`` or, where it split K, its fp32 partial sums ``[S, P, N]``, added in
# split order (``sum_partials``'s) before anything else.
# --------------------------------------------------------------------------- #
GATINGS = ("silu",)


@triton.jit
def _store_rounded(ptrs, v, mask, OUT_BF16: tl.constexpr):
    """Store fp32 ``v`` rounded to the output dtype; bf16 (``ptrs`` int16) rounds to nearest even by hand
    (the interpreter's cast truncates), NaN as torch's 0x7FC0."""
    if OUT_BF16:
        bits = v.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        tl.store(ptrs, tl.where(nan, 0x7FC0, rounded).to(tl.int16), mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _summed_row(row_ptr, n, mask, stride_s, S: tl.constexpr):
    """fp32 ``sum_s row[s * stride_s + n]``, from split 0 up (S = 1: the row widened)."""
    acc = tl.load(row_ptr + n, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, S):
        acc = acc + tl.load(row_ptr + s * stride_s + n, mask=mask, other=0.0)
    return acc


def swiglu_reference(gate_up: torch.Tensor, routing: Routing, dtype: torch.dtype) -> torch.Tensor:
    """``act [P, I]`` (``dtype``): ``silu(g) * u`` in fp32 of ``[g | u]``, the w13 output ``[P, 2I]`` or its
    fp32 partial sums ``[S, P, 2I]`` added in split order (rows of no expert: whatever they hold)."""
    gu = sum_partials(gate_up)
    inter = gu.shape[1] // 2
    return (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]).to(dtype)


@triton.jit
def _swiglu_kernel(y_ptr, valid_ptr, out_ptr, inter, stride_s, stride_y, stride_o,
                   S: tl.constexpr, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    if tl.load(valid_ptr + p) == 0:  # a pair of no expert: w13 never wrote its row, w2 never reads it
        return
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < inter
    row = y_ptr + p * stride_y
    g = _summed_row(row, n, ok, stride_s, S)
    u = _summed_row(row + inter, n, ok, stride_s, S)
    act = g / (1.0 + tl.exp(-g)) * u                # silu(g) * u in fp32 (exp -> inf for g < -88: -0 * u)
    _store_rounded(out_ptr + p * stride_o + n, act, ok, OUT_BF16)


def swiglu(gate_up: torch.Tensor, routing: Routing, dtype: torch.dtype, *, backend: str = "auto") -> torch.Tensor:
    """The SwiGLU gating of a MoE layer, ``act [P, I] = silu(g) * u`` in ``dtype`` from w13's output
    ``[P, 2I]`` (gate over up columns) or its fp32 partial sums ``[S, P, 2I]`` (``grouped_linear(...,
    partials=True)``), all in fp32 and rounded once: one launch on CUDA and under the interpreter (rows of
    pairs of no expert are not written), ``swiglu_reference``'s torch ops elsewhere. In place of torch's
    ``silu(g) * u`` on 16-bit g and u (two launches, three roundings); within the dense kernels' tolerance
    of it (the kernel's exp and division are the GPU's approximate ones)."""
    if gate_up.dim() not in (2, 3) or gate_up.shape[-2] != routing.pairs or gate_up.shape[-1] % 2:
        raise nvfp4.NVFP4Error(f"swiglu: expected [P, 2I] or [S, P, 2I] with P = {routing.pairs}, got "
                               f"{tuple(gate_up.shape)}")
    if (not _kernels_for(gate_up, backend, "swiglu") or gate_up.stride(-1) != 1
            or dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        return swiglu_reference(gate_up, routing, dtype)
    inter = gate_up.shape[-1] // 2
    out = torch.empty((routing.pairs, inter), dtype=dtype, device=gate_up.device)
    if routing.pairs == 0 or inter == 0:
        return out
    splits = gate_up.shape[0] if gate_up.dim() == 3 else 1
    block = min(1024, triton.next_power_of_2(inter))
    bf16 = dtype == torch.bfloat16
    _swiglu_kernel[(routing.pairs, cdiv(inter, block))](
        gate_up, routing.valid.view(torch.uint8), out.view(torch.int16) if bf16 else out, inter,
        gate_up.stride(0) if splits > 1 else 0, gate_up.stride(-2), out.stride(0),
        S=splits, BLOCK=block, OUT_BF16=bf16, num_warps=4)
    return out


def combine_reference(y: torch.Tensor, routing: Routing, top_k_weights: torch.Tensor,
                      dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``out [T, N]`` (``dtype``, default y's): ``sum_s top_k_weights[t, s] * y[sorted
    position of (t, s)]`` in torch ops: y's rows in fp32 (``[S, P, N]`` partial sums added in split order),
    the products in fp32, summed slot 0 + slot 1 + ... from 0 (pairs of no expert add 0)."""
    tokens, k = top_k_weights.shape
    w = top_k_weights.reshape(-1)[routing.order].float()
    contrib = torch.where(routing.valid[:, None], sum_partials(y) * w[:, None], 0.0)
    per_pair = torch.empty_like(contrib).index_copy_(0, routing.order, contrib).view(tokens, k, -1)
    acc = torch.zeros_like(per_pair[:, 0])
    for s in range(k):  # explicitly in slot order: torch's sum over k may use several accumulators
        acc = acc + per_pair[:, s]
    return acc.to(dtype or y.dtype)


@triton.jit
def _combine_kernel(y_ptr, w_ptr, position_ptr, valid_ptr, out_ptr, N, stride_y, stride_o, stride_s,
                    K: tl.constexpr, BLOCK_N: tl.constexpr, OUT_BF16: tl.constexpr, S: tl.constexpr = 1):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in tl.static_range(K):  # unrolled: the k rows' loads are independent, the sum stays in slot order
        pair = t * K + s
        p = tl.load(position_ptr + pair).to(tl.int64)
        v = (tl.load(valid_ptr + p) + tl.zeros((BLOCK_N,), dtype=tl.uint8)) != 0
        w = tl.load(w_ptr + pair).to(tl.float32)
        yv = _summed_row(y_ptr + p * stride_y, n, n_ok & v, stride_s, S)
        acc = acc + tl.where(v, yv * w, 0.0)        # (built without FMA contraction: torch's roundings)
    _store_rounded(out_ptr + t * stride_o + n, acc, n_ok, OUT_BF16)


def combine(y: torch.Tensor, routing: Routing, top_k_weights: torch.Tensor, dtype: Optional[torch.dtype] = None,
            *, backend: str = "auto") -> torch.Tensor:
    """A MoE layer's weighted sum: ``out [T, N]`` (``dtype``, default y's) with row t the fp32 sum, in slot
    order, of ``top_k_weights[t, s] * y[p]`` over the slots s, p the sorted position of pair (t, s) (y in
    sorted order, ``[P, N]``, or the fp32 partial sums ``[S, P, N]`` of a launch that split K, added in
    split order first); pairs of no expert add 0 (their rows are never read). One launch on CUDA and under
    the interpreter, bit-identical to ``combine_reference``."""
    tokens, k = top_k_weights.shape
    if y.dim() not in (2, 3) or y.shape[-2] != routing.pairs or tokens * k != routing.pairs:
        raise nvfp4.NVFP4Error(f"combine: y [{routing.pairs}, N] (or [S, {routing.pairs}, N]) and top_k_weights "
                               f"[T, k] with T * k = {routing.pairs} expected; got {tuple(y.shape)}, "
                               f"{tuple(top_k_weights.shape)}")
    dtype = dtype or y.dtype
    if (not _kernels_for(y, backend, "combine") or routing.position is None
            or dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        return combine_reference(y, routing, top_k_weights, dtype)
    n = y.shape[-1]
    out = torch.empty((tokens, n), dtype=dtype, device=y.device)
    if tokens == 0 or n == 0:
        return out
    if y.stride(-1) != 1:
        y = y.contiguous()
    w = top_k_weights.contiguous()
    block_n = min(512, triton.next_power_of_2(n))
    bf16 = dtype == torch.bfloat16
    splits = y.shape[0] if y.dim() == 3 else 1
    _combine_kernel[(tokens, cdiv(n, block_n))](
        y, w, routing.position, routing.valid.view(torch.uint8), out.view(torch.int16) if bf16 else out,
        n, y.stride(-2), out.stride(0), y.stride(0) if splits > 1 else 0, K=k, BLOCK_N=block_n, OUT_BF16=bf16,
        S=splits, num_warps=4, enable_fp_fusion=False)
    return out


# --------------------------------------------------------------------------- #
# Reference: the loop over experts (nvfp4.py through the kernels' reference backend)
# --------------------------------------------------------------------------- #
def grouped_linear_reference(x: torch.Tensor, routing: Routing, weight: StackedWeight,
                             gather: bool = True) -> torch.Tensor:
    """``y [P, N]``: sorted pair p times its expert's weight, expert by expert with the reference GEMMs
    (``kernels.linear_w4a16`` / ``linear_w4a4`` with ``backend="reference"``: ``_backend.linear_reference``).
    ``gather``: x is ``[T, K]`` read at ``routing.token`` (w13), else ``[P, K]`` in sorted order (down).
    Rows of no expert are 0."""
    y = x.new_zeros((routing.pairs, weight.out_features))
    offsets = routing.offsets.tolist()
    for e in range(weight.num_experts):
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        xe = x[routing.token[lo:hi].long()] if gather else x[lo:hi]
        w = weight.expert(e)
        bias = None if weight.bias is None else weight.bias[e]
        y[lo:hi] = linear_reference(xe, w, bias, None if weight.input_enc is None else weight.input_amax[e],
                                    weight.four_six)
    return y


# --------------------------------------------------------------------------- #
# The Triton kernel
# --------------------------------------------------------------------------- #
@triton.jit
def quantized_activation_tile(x_ptr, rows64, rows_ok, stride_xm, k0, K, x_enc, BLOCK_K: tl.constexpr,
                              FOUR_SIX: tl.constexpr):
    """Rows ``rows64`` x columns ``k0 .. k0 + BLOCK_K`` of x quantized to NVFP4 under ``x_enc`` (Four
    Over Six rule code ``FOUR_SIX``, 0 standard), as the exact fp32 operand ``sign * v * block_scale``
    ``[BM, BLOCK_K]`` (codes and scales of ``nvfp4.quantize``; rows and columns outside are 0)."""
    blocks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    ok = rows_ok[:, None, None] & (blocks < K // 16)[None, :, None]
    offs = rows64[:, None, None] * stride_xm + (blocks * 16)[None, :, None] + tl.arange(0, 8)[None, None, :]
    xa = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)      # elements 0..7 of each block
    xb = tl.load(x_ptr + offs + 8, mask=ok, other=0.0).to(tl.float32)  # 8..15
    ia, ib, scale, _, _ = quantize_halves(xa, xb, x_enc, FOUR_SIX)
    va = signed_scaled(ia, xa, scale)
    vb = signed_scaled(ib, xb, scale)
    full = tl.permute(tl.join(va, vb), (0, 1, 3, 2))                   # [BM, NB, 2, 8]: K order
    return tl.reshape(full, (rows64.shape[0], BLOCK_K))


@triton.jit
def _pair_rows(token_ptr, first, start, end, ROWS: tl.constexpr, GATHER: tl.constexpr):
    """Sorted pairs ``first .. first + ROWS`` of a tile from ``start`` to ``end``: (in range, the position
    loaded (``start`` past ``end``) int64, its activation row: ``token`` with ``GATHER``, else itself)."""
    p = first + tl.arange(0, ROWS)
    p_ok = p < end
    p_ld = tl.where(p_ok, p, start).to(tl.int64)
    if GATHER:
        rows = tl.load(token_ptr + p_ld).to(tl.int64)
    else:
        rows = p_ld
    return p_ok, p_ld, rows


@triton.jit
def _quantize_pairs_kernel(x_ptr, token_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr, xenc_ptr, q_ptr,
                           K, stride_xm, stride_qm, GATHER: tl.constexpr, FOUR_SIX: tl.constexpr,
                           BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The W4A4 prologue: program (tile, K chunk) writes the exact operand of the tile's pairs (``ROWS``
    at a time, only up to its expert's last pair) over columns ``[k0, k0 + BLOCK_K)`` in q's dtype."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e < 0:  # past the tiles of this call (the grid is an upper bound)
        return
    start = tl.load(tile_row_ptr + tile)
    end = tl.minimum(tl.load(offsets_ptr + e + 1), start + BLOCK_M)
    x_enc = tl.load(xenc_ptr + e)
    k0 = tl.program_id(1) * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    for r0 in range(start, end, ROWS):
        p_ok, p_ld, rows = _pair_rows(token_ptr, r0, start, end, ROWS, GATHER)
        v = quantized_activation_tile(x_ptr, rows, p_ok, stride_xm, k0, K, x_enc, BLOCK_K, FOUR_SIX)
        tl.store(q_ptr + p_ld[:, None] * stride_qm + cols[None, :], v.to(q_ptr.dtype.element_ty),
                 mask=p_ok[:, None] & (cols < K)[None, :])


@triton.jit
def _grouped_kernel(
    x_ptr, token_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    w_ptr, s_ptr, wenc_ptr, xenc_ptr, bias_ptr, y_ptr,
    N, K, stride_xm, stride_ym, stride_ys, k_split,
    GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, A4: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e < 0:  # past the tiles of this call (the grid is an upper bound)
        return
    start = tl.load(tile_row_ptr + tile)
    end = tl.load(offsets_ptr + e + 1)
    p_ok, p_ld, rows = _pair_rows(token_ptr, start, start, end, BLOCK_M, GATHER)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n_ld = tl.where(n_ok, n, 0).to(tl.int64)
    e64 = e.to(tl.int64)
    kw = K // 8
    kb = K // 16
    w_rows = w_ptr + (e64 * N + n_ld) * kw       # int32 words, 8 codes each
    s_rows = s_ptr + (e64 * N + n_ld) * kb       # E4M3 bytes
    ak = tl.arange(0, BLOCK_K)
    aw = tl.arange(0, BLOCK_K // 8)
    ab = tl.arange(0, BLOCK_K // 16)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    split = tl.program_id(2)                     # this program's slice of K: [k_lo, k_hi)
    k_lo = split * k_split
    k_hi = tl.minimum(K, k_lo + k_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ak)[None, :],  # W4A4: the prologue's operands
                    mask=p_ok[:, None] & (k0 + ak < K)[None, :], other=0.0)
        if EVEN_K:
            words = tl.load(w_rows[:, None] + (k0 // 8 + aw)[None, :])
            sb = tl.load(s_rows[:, None] + (k0 // 16 + ab)[None, :])
        else:
            words = tl.load(w_rows[:, None] + (k0 // 8 + aw)[None, :], mask=(k0 // 8 + aw < kw)[None, :], other=0)
            sb = tl.load(s_rows[:, None] + (k0 // 16 + ab)[None, :], mask=(k0 // 16 + ab < kb)[None, :], other=0)
        wt = decode_tile(words, sb, BLOCK_N, BLOCK_K, DT, False)  # v * scale * 2^-14, exact
        if DOT_FP32:  # Triton interpreter: its bf16 dot multiplies the raw uint16 patterns
            x = x.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(x, tl.trans(wt), acc)
    y = _output_scale(acc, wenc_ptr + e, xenc_ptr + e, 16384.0, A4)  # * 2^14 / (enc_w (* enc_x))
    if HAS_BIAS:  # added once: by the first split
        y += tl.where(split == 0, tl.load(bias_ptr + e64 * N + n_ld).to(tl.float32), 0.0)[None, :]
    ptrs = y_ptr + split.to(tl.int64) * stride_ys + p_ld[:, None] * stride_ym + n_ld[None, :]
    tl.store(ptrs, y.to(y_ptr.dtype.element_ty), mask=p_ok[:, None] & n_ok[None, :])


# (BLOCK_N, BLOCK_K, num_warps, num_stages) by tile rows, from the H200 sweep of
# ``benchmarks/bench_moe_h200.py --sweep`` (``results/moe_sweep_h200.json``: Qwen3-30B-A3B- and Mixtral-shaped
# experts at 1-4096 tokens, 12 tiles each; every pick below is the best or within 6% of it there).
# 16-row tiles (decode) on small grids want more programs: a narrow, deep tile while the 64-wide grid
# would not fill two waves of the 132 SMs, a deep one up to about three.
DECODE_SMALL_GRID = (32, 256, 4, 3)    # < 264 programs at BLOCK_N = 64
DECODE_MID_GRID = (64, 256, 4, 3)      # < 400
DECODE_TILE = (64, 128, 4, 4)
MID_TILE = (128, 64, 4, 3)             # 32- and 64-row tiles
PREFILL_TILE = (128, 64, 4, 3)         # 128-row tiles (was 8 warps: 10-27% slower, the sweep)


def kernel_config(block_m: int, n: int, k: int, tiles: int = 1 << 20) -> tuple:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for ``tiles`` tiles of ``block_m`` rows over N = ``n``
    (the rules above; BLOCK_K falls to a divisor of K where it must)."""
    if INTERPRET:
        return 32, 32 if k % 64 else 64, 4, 1
    if block_m <= 16:
        programs = tiles * cdiv(n, 64)
        bn, bk, warps, stages = (DECODE_SMALL_GRID if programs < 264 else DECODE_MID_GRID if programs < 400
                                 else DECODE_TILE)
    else:
        bn, bk, warps, stages = MID_TILE if block_m <= 64 else PREFILL_TILE
    return _fit_k((bn, bk, warps, stages), k)


# Split K for the 16-row tiles (decode). PREDICTION, not measured yet (benchmarks/NOTES.md, "Issue 44 item 1,
# split-K decode"). In the sweep (results/moe_sweep_h200.json) a decode program's K steps take a fixed time
# each (about 1.2-1.9 us for a 32 x 256 or 64 x 128 step, 0.8 us for 32 x 128: the loads -> decode -> MMA
# chain is latency-bound), so a launch whose programs all fit on the SMs at once lasts about its programs'
# steps: Qwen3-30B-A3B w13 at 1 token, 384 programs of 8 steps, 17.5 us; Mixtral w2, 256 programs of 56
# steps, 116 us (0.57 TB/s). Splitting K shortens each program but only helps while the split grid still
# fits in one wave of resident programs (RESIDENT an SM for each tile, from its registers); past that the
# second wave costs what the split saved. So a grid short of one wave takes the narrow tile DECODE_NARROW
# (68 registers: 7 programs an SM) split until that tile's wave is full, where that gives at least 2 K slices;
# else its own tile split within its own wave (at most SPLIT_MAX slices, each at least one K tile). The
# partial sums go to an fp32 workspace that the consumer already there (the SwiGLU gating after w13, the
# combine after w2) adds in split order: no atomics, no launch added.
DECODE_NARROW = (32, 128, 4, 4)
# Programs an SM holds: 65536 registers / (registers x 32 x warps) of the sm_90 builds made offline with
# Triton 3.9 (127, 160, 120 and 68 registers; the device's Triton may allocate otherwise); other tiles 4.
RESIDENT = {DECODE_SMALL_GRID: 4, DECODE_MID_GRID: 3, DECODE_TILE: 4, DECODE_NARROW: 7}
SPLIT_MAX = 8


def _fit_k(config: tuple, k: int) -> tuple:
    bn, bk, warps, stages = config
    while k % bk and bk > 16:
        bk //= 2
    return bn, bk, warps, stages


def resident(config: tuple) -> int:
    """Programs of tile ``config`` an SM holds (``RESIDENT``; a BLOCK_K cut to fit K takes its table
    entry's, a lower bound; 4 for other tiles)."""
    bn, bk, warps, stages = config
    fits = [r for (tbn, tbk, tw, ts), r in RESIDENT.items() if (tbn, tw, ts) == (bn, warps, stages) and tbk >= bk]
    return min(fits) if fits else 4


def split_for(block_m: int, n: int, k: int, active: int, config: tuple, sms: int, narrow: bool = True) -> tuple:
    """(tile, K slices) of a launch of ``block_m``-row tiles over N = ``n``, K = ``k`` with about ``active``
    tiles (one an active expert at decode: min(E, P)) on ``sms`` SMs, ``config`` being ``kernel_config``'s
    tile: the rule above (1 slice = no split; never an empty slice); ``narrow=False`` keeps ``config``."""
    if block_m > 16:
        return config, 1
    tiles = max(1, active)
    programs = tiles * cdiv(n, config[0])
    slots = resident(config) * sms
    if narrow and programs < slots and not INTERPRET:
        narrow = _fit_k(DECODE_NARROW, k)
        slices = k_slices(k, narrow[1], min(SPLIT_MAX, resident(narrow) * sms // (tiles * cdiv(n, narrow[0]))))[0]
        if slices >= 2:
            return narrow, slices
    return config, k_slices(k, config[1], min(SPLIT_MAX, max(1, slots // programs)))[0]


def k_slices(k: int, block_k: int, split: int) -> tuple:
    """(slices, K a slice): ``split`` (>= 1) slices of whole K tiles, fewer where K has fewer tiles or a
    slice would be empty."""
    steps = cdiv(k, block_k)
    per = cdiv(steps, max(1, min(split, steps)))
    return cdiv(steps, per), per * block_k


def sum_partials(y: torch.Tensor) -> torch.Tensor:
    """fp32 ``[P, N]``: the ``[S, P, N]`` partial sums added in split order from the first (the consumer
    kernels' order); a 2-D ``y`` (S = 1) widened."""
    if y.dim() == 2:
        return y.float()
    acc = y[0].clone()
    for s in range(1, y.shape[0]):
        acc += y[s]
    return acc


# The W4A4 prologue (``quantize_pairs``): each pair's activation row quantized once, its exact operand
# written to a [P, K] workspace that the grouped kernel reads as W4A16 reads x, in place of quantizing the
# row inside the kernel once per BLOCK_N-wide output tile (N / BLOCK_N = 24-448 times on the benchmark's
# layers) for one launch and 2 * P * K * 2 bytes more. PREDICTION, not measured yet (benchmarks/NOTES.md,
# "Issue 44 item 1, W4A4 activations quantized once"): it wins at every shape of the benchmark (the in-kernel
# form could only win where one output tile covers N), so W4A4 always takes it. A program quantizes ROWS
# pairs x BLOCK_K columns a step (about 2K elements for 4 warps): decode tiles (1-2 pairs an expert) 2 rows
# of a long K chunk, others 16 x 128.
PROLOGUE_DECODE = (2, 1024, 4)
PROLOGUE_TILE = (16, 128, 4)


def prologue_config(block_m: int, k: int) -> tuple:
    """(ROWS, BLOCK_K, num_warps) of the W4A4 prologue for tiles of ``block_m`` rows and K = ``k``."""
    if INTERPRET:
        return 2, 32, 4
    rows, bk, warps = PROLOGUE_DECODE if block_m <= 16 else PROLOGUE_TILE
    return rows, min(bk, triton.next_power_of_2(k)), warps


def quantize_pairs(x: torch.Tensor, routing: Routing, weight: StackedWeight, gather: bool = True,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The W4A4 prologue (one launch): ``q [P, K]`` in x's dtype, row p the exact operand ``sign * v *
    block_scale`` of pair p's activation row (``gather``: ``x[routing.token[p]]``, else ``x[p]``) quantized
    under its expert's ``weight.input_enc`` with nvfp4.quantize's codes and scales (Four Over Six by
    ``weight.four_six``, near-ties as ``quantize_kernel`` documents); rows of pairs of no expert are not
    written (``out`` as given, else uninitialized). Exact in bf16 / fp16 (2 + 4 significant bits)."""
    k = weight.in_features
    if weight.input_enc is None:
        raise nvfp4.NVFP4Error("quantize_pairs: the weight is W4A16 (no input_amax): nothing to quantize")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or (not gather and x.shape[0] != routing.pairs):
        raise nvfp4.NVFP4Error(f"quantize_pairs: x must be [{'T' if gather else routing.pairs}, {k}] with unit "
                               f"column stride, got shape {tuple(x.shape)} strides {tuple(x.stride())}")
    q = out if out is not None else torch.empty((routing.pairs, k), dtype=x.dtype, device=x.device)
    if routing.pairs == 0 or k == 0:
        return q
    rows, bk, warps = prologue_config(routing.block_m, k)
    _quantize_pairs_kernel[(routing.tile_expert.numel(), cdiv(k, bk))](
        x, routing.token, routing.tile_expert, routing.tile_row, routing.offsets, weight.input_enc, q,
        k, x.stride(0), q.stride(0), GATHER=gather, FOUR_SIX=FOUR_SIX_CODES[weight.four_six],
        BLOCK_M=routing.block_m, ROWS=rows, BLOCK_K=bk,
        num_warps=warps, enable_fp_fusion=False)  # the quantizer's roundings as written (nvfp4.py's)
    return q


def launch_plan(x: torch.Tensor, routing: Routing, weight: StackedWeight, config: Optional[tuple] = None,
                split: Optional[int] = None, path: Optional[str] = None) -> tuple:
    """What ``grouped_linear`` runs on CUDA for these operands: ``(path, (BLOCK_N, BLOCK_K, num_warps,
    num_stages), K slices, K a slice)``, path "dequant" (``grouped_dequant.takes_dequant``'s rule, or asked
    for), "kernel" (``kernel_config``'s tile, and ``split_for``'s tile and split unless ``split`` is given;
    ``config`` in place of the tile) or, W4A4, "quantize+kernel" (the prologue ``quantize_pairs``, then the
    kernel so)."""
    from .grouped_dequant import takes_dequant

    e, n, k = weight.num_experts, weight.out_features, weight.in_features
    if path == "dequant" or (path is None and takes_dequant(x, routing, weight)):
        return "dequant", None, 1, k
    bm = routing.block_m
    tile = config or kernel_config(bm, n, k, routing.tile_expert.numel())
    if split is None:
        tile, split = split_for(bm, n, k, min(e, routing.pairs), tile, _sm_count(x.device), narrow=config is None)
    return ("kernel" if weight.input_enc is None else "quantize+kernel", tile) + k_slices(k, tile[1], split)


def grouped_linear(x: torch.Tensor, routing: Routing, weight: StackedWeight, *, gather: bool = True,
                   backend: str = "auto", out: Optional[torch.Tensor] = None, config: Optional[tuple] = None,
                   split: Optional[int] = None, partials: bool = False, path: Optional[str] = None) -> torch.Tensor:
    """``y [P, N]`` (x's dtype): sorted pair p's activation row times its expert's NVFP4 weight (+ bias),
    W4A4 where ``weight.input_amax`` is set. ``gather``: x is ``[T, K]`` and pair p reads row
    ``routing.token[p]`` (w13); else x is ``[P, K]`` in sorted order (down). Rows of pairs routed to no
    expert are left unwritten (``out`` as given, else uninitialized).
    ``backend``: "auto" (Triton on CUDA / under the interpreter, else the reference), "reference",
    "triton". ``path``: "kernel" (the grouped kernel: one launch; W4A4 two, ``quantize_pairs`` first), "dequant" (W4A16: the active experts
    dequantized, then ``torch._grouped_mm``; ``grouped_dequant.py``), None: ``grouped_dequant.takes_dequant``'s
    rule. ``config``: (BLOCK_N, BLOCK_K, num_warps, num_stages) in place of ``kernel_config``'s and
    ``split``: K slices in place of ``split_for``'s (the benchmark's sweep). With ``partials`` the result is
    what the launch wrote for a consumer that sums it (``moe``: the gating, the combine): fp32 ``[S, P, N]``
    partial sums (output scale applied, bias in the first) where K was split, else ``[P, N]`` as above;
    without, split sums are added in split order in fp32 and rounded once to x's dtype."""
    from .grouped_dequant import grouped_mm_dequantized

    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    if path not in (None, "kernel", "dequant"):
        raise ValueError(f"grouped_linear: unknown path {path!r}; choose 'kernel', 'dequant' or None (the rule)")
    reason = triton_unavailable_reason(x, op="grouped_linear")
    if backend == "triton" and reason is not None:
        raise BackendUnavailable(f"backend='triton' cannot run grouped_linear: {reason}")
    if backend == "reference" or reason is not None:
        return grouped_linear_reference(x, routing, weight, gather)
    weight.check()
    e, n, k = weight.num_experts, weight.out_features, weight.in_features
    rows = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k:
        raise nvfp4.NVFP4Error(f"grouped_linear: x must be [rows, {k}], got shape {tuple(x.shape)}")
    if not gather and rows != routing.pairs:
        raise nvfp4.NVFP4Error(f"grouped_linear: x in sorted order needs {routing.pairs} rows, got {rows}")
    if routing.offsets.numel() != e + 1:
        raise nvfp4.NVFP4Error(f"grouped_linear: the routing is over {routing.offsets.numel() - 1} experts, "
                               f"the weight has {e}")
    if k % BLOCK_SIZE:
        raise nvfp4.NVFP4Error(f"grouped_linear: K = {k} is not a multiple of {BLOCK_SIZE}")
    if split is not None and split < 1:
        raise nvfp4.NVFP4Error(f"grouped_linear: split must be >= 1, got {split}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if routing.pairs == 0 or n == 0:
        return out if out is not None else torch.empty((routing.pairs, n), dtype=x.dtype, device=x.device)
    plan = launch_plan(x, routing, weight, config, split, path)
    if plan[0] == "dequant":
        y = grouped_mm_dequantized(x, routing, weight, gather)
        return y if out is None else out.copy_(torch.where(routing.valid[:, None], y, out))
    _, (bn, bk, warps, stages), slices, k_split = plan
    packed = weight.packed if weight.packed.is_contiguous() else weight.packed.contiguous()
    scale = weight.scale if weight.scale.is_contiguous() else weight.scale.contiguous()
    words = packed.view(torch.int32) if packed.data_ptr() % 4 == 0 and (k // 2) % 4 == 0 else None
    if words is None:
        raise nvfp4.NVFP4Error(f"grouped_linear: the packed weight must be 4-byte aligned with K % 8 == 0 (K = {k})")
    a4 = weight.input_enc is not None
    if a4:  # each pair's row quantized once (one launch); the kernel reads the operands in sorted order
        x, gather = quantize_pairs(x, routing, weight, gather), False
    bias = weight.bias.contiguous() if weight.bias is not None else None
    bm = routing.block_m
    if slices > 1:
        y = torch.empty((slices, routing.pairs, n), dtype=torch.float32, device=x.device)
    else:
        y = out if out is not None else torch.empty((routing.pairs, n), dtype=x.dtype, device=x.device)
    grid = (routing.tile_expert.numel(), cdiv(n, bn), slices)
    enc = weight.enc
    _grouped_kernel[grid](
        x, routing.token, routing.tile_expert, routing.tile_row, routing.offsets,
        words, scale.view(torch.uint8), enc, weight.input_enc if a4 else enc, bias if bias is not None else enc, y,
        n, k, x.stride(0), y.stride(-2), y.stride(0) if slices > 1 else 0, k_split,
        GATHER=gather, HAS_BIAS=bias is not None, A4=a4,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, DOT_FP32=INTERPRET,
        num_warps=warps, num_stages=stages,
    )
    if slices == 1 or partials:
        return y
    summed = sum_partials(y).to(x.dtype)
    return summed if out is None else out.copy_(torch.where(routing.valid[:, None], summed, out))


def moe(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w13: StackedWeight,
        w2: StackedWeight, gate: Union[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = "silu", *,
        backend: str = "auto", block_m: Optional[int] = None) -> torch.Tensor:
    """A MoE layer's experts: ``sum_slots top_k_weights[t, s] * down_e(gate(g, u))`` with ``[g | u] =
    w13_e(hidden[t])``, e = ``top_k_index[t, s]`` (slots routed outside ``[0, E)`` add nothing).
    ``gate``: "silu" (SwiGLU, ``silu(g) * u``: fused, ``swiglu``) or the layer's own gating as a callable
    ``gate(g, u) -> act`` (torch ops on ``[P, I]`` views of the gate and up halves, in hidden's dtype).
    Two grouped launches plus the routing, the gating and the weighted sum of each token's k rows
    (``combine``: fp32, in slot order, deterministic); where a launch splits K, its fp32 partial sums are
    added in split order by the gating (w13) and the combine (w2): run-to-run bit-identical.
    Numerics of the fused gating: silu and the product in fp32 from g and u as the GEMM summed them (fp32
    split sums, or the launch's output in hidden's dtype where K was not split), rounded once to hidden's
    dtype; the torch form (``gate`` callable) rounds g and u to hidden's dtype, silu(g) and the product
    again (both within the dense kernels' tolerance of the reference)."""
    tokens, k = top_k_index.shape
    if hidden.dim() != 2 or hidden.shape[0] != tokens or top_k_weights.shape != top_k_index.shape:
        raise nvfp4.NVFP4Error(f"moe: hidden [T, H], top_k_index and top_k_weights [T, k] expected; got "
                               f"{tuple(hidden.shape)}, {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}")
    if w13.out_features % 2 or w2.in_features != w13.out_features // 2:
        raise nvfp4.NVFP4Error(f"moe: w13 [{w13.out_features}, ...] must be gate over up rows feeding "
                               f"w2's {w2.in_features} inputs")
    if not (gate in GATINGS or callable(gate)):
        raise nvfp4.NVFP4Error(f"moe: gate must be one of {GATINGS} or a callable gate(g, u), got {gate!r}")
    glue = _glue_backend(hidden, backend)
    r = route(top_k_index, w13.num_experts, block_m, backend=glue)
    gate_up = grouped_linear(hidden, r, w13, gather=True, backend=backend, partials=True)
    if gate == "silu":
        act = swiglu(gate_up, r, hidden.dtype, backend=glue)
    else:
        if gate_up.dim() == 3:
            gate_up = sum_partials(gate_up).to(hidden.dtype)
        inter = w13.out_features // 2
        act = gate(gate_up[:, :inter], gate_up[:, inter:]).to(hidden.dtype).contiguous()
    y = grouped_linear(act, r, w2, gather=False, backend=backend, partials=True)
    # back to (token, slot) order; pairs of no expert contribute 0 (their rows were never written)
    return combine(y, r, top_k_weights, hidden.dtype, backend=glue)


def _glue_backend(hidden: torch.Tensor, backend: str) -> str:
    """The routing's and the combine's backend in ``moe``: their kernels where the grouped GEMMs run as
    Triton kernels, the torch ops where the GEMMs take the reference."""
    return "reference" if backend == "reference" or triton_unavailable_reason(hidden, op="grouped_linear") else "auto"


__all__ = ["GATINGS", "Routing", "StackedWeight", "block_m_for", "combine", "combine_reference", "grouped_linear",
           "grouped_linear_reference", "k_slices", "kernel_config", "launch_plan", "moe", "prologue_config", "quantize_pairs", "route", "route_reference", "route_triton",
           "split_for", "stack_weights", "sum_partials", "swiglu", "swiglu_reference", "tile_bound"]
