"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", Algorithm 1) on the NVFP4 format.

Minimizes ``||W X - Q X||^2`` column by column: each column is rounded, and
its error, weighted by the inverse Hessian ``H^-1`` (``H = X X^T``), is pushed
onto the columns not yet quantized. NVFP4 specifics:

- The global scale is fixed first (from ``amax``: the max over a fused group),
  so every block scale lives on the same grid as in the stored tensor.
- Block scales belong to 16-column groups. A group's scales are chosen when
  the error feedback reaches its first column, from the *updated* weights of
  its 16 columns; the 16 columns are then rounded one by one with those scales.
- Four Over Six: with ``scale_choice="loop"`` each block picks 4 or 6 at that
  moment, on the updated weights, with the rule's error (``nvfp4.quantize_blocks``);
  ``"once"`` picks on the original weights before the loop (the published
  GPTQ+4/6 variant) for comparison.
- Act-order permutes whole 16-column groups (by decreasing summed Hessian
  diagonal) and columns inside each group (by decreasing diagonal), so each
  group stays contiguous and is still quantized as one NVFP4 block.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import nvfp4
from ..nvfp4 import BLOCK_SIZE, NVFP4Error, NVFP4Tensor


def hessian_update(H: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Add ``x^T x`` (fp32) for inputs ``x: [..., in]`` to ``H: [in, in]``
    (created when None). GPTQ only needs H up to a positive factor.

    bf16/fp16 inputs on CUDA use TF32 tensor cores: their values have at most
    10 mantissa bits, so TF32 holds them exactly and only the fp32 accumulation
    order differs from a plain fp32 product (8x the fp32 rate on Hopper)."""
    x2 = x.reshape(-1, x.shape[-1])
    exact_in_tf32 = x2.is_cuda and x2.dtype in (torch.bfloat16, torch.float16)
    x2 = x2.float()
    if exact_in_tf32:
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            update = x2.t() @ x2
        finally:
            torch.set_float32_matmul_precision(previous)
    else:
        update = x2.t() @ x2
    return update if H is None else H.add_(update)


def act_order_permutation(H: torch.Tensor) -> torch.Tensor:
    """Column order for act-order that keeps 16-column groups contiguous.

    Groups go by decreasing sum of their Hessian diagonal, and columns inside
    a group by decreasing diagonal. Returns ``perm: [in]`` (new -> old column).
    """
    diag = torch.diagonal(H).float()
    n_groups = diag.numel() // BLOCK_SIZE
    group_diag = diag.view(n_groups, BLOCK_SIZE)
    group_order = torch.argsort(group_diag.sum(1), descending=True, stable=True)
    within = torch.argsort(group_diag, dim=1, descending=True, stable=True)  # [groups, 16]
    return (group_order[:, None] * BLOCK_SIZE + within[group_order]).reshape(-1)


def _inverse_hessian_cholesky(H: torch.Tensor, damp: float, name: str) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``."""
    H = H.clone()
    H.diagonal().add_(damp * torch.diagonal(H).mean())
    try:
        L = torch.linalg.cholesky(H)
        Hinv = torch.cholesky_inverse(L)
        return torch.linalg.cholesky(Hinv, upper=True)
    except torch.linalg.LinAlgError as exc:
        raise NVFP4Error(
            f"{name}: GPTQ could not factor the damped Hessian ({exc}). Raise gptq_damp "
            "(QuantConfig.gptq_damp) or give more calibration samples."
        ) from exc


class _ColumnBuffers:
    """Inputs and outputs of one lazy-batch block of ``b`` columns (static
    storage, so that a CUDA graph can replay the block's column loop)."""

    def __init__(self, rows: int, b: int, device: torch.device, once: bool) -> None:
        g = b // BLOCK_SIZE
        self.W1 = torch.zeros(rows, b, dtype=torch.float32, device=device)      # in: weights, updated in place
        self.Hinv1 = torch.eye(b, dtype=torch.float32, device=device)           # in: H^-1 Cholesky block
        self.once_scale = torch.zeros(rows, g, dtype=torch.float32, device=device) if once else None
        self.once_four = torch.zeros(rows, g, dtype=torch.bool, device=device) if once else None
        self.codes = torch.zeros(rows, b, dtype=torch.uint8, device=device)     # out
        self.scales = torch.zeros(rows, g, dtype=torch.float32, device=device)  # out
        self.four = torch.zeros(rows, g, dtype=torch.bool, device=device)       # out
        self.err = torch.zeros(rows, b, dtype=torch.float32, device=device)     # out: scaled errors


def _quantize_columns(buf: _ColumnBuffers, global_enc: torch.Tensor, four_six: Optional[str],
                      code_values: torch.Tensor, once: bool) -> None:
    """GPTQ's inner loop over the columns of one block, in place on ``buf``.

    Only fixed-shape tensor ops and no host synchronisation, so the same
    function runs eagerly (CPU, or the first block) and is captured once into a
    CUDA graph that later blocks replay (see ``_ColumnBlockRunner``)."""
    W1, Hinv1 = buf.W1, buf.Hinv1
    step = divisor = None
    for i in range(W1.shape[1]):
        if i % BLOCK_SIZE == 0:          # entering a 16-column group: fix its block scales
            g = i // BLOCK_SIZE
            if not once:
                _, scale, four, _ = nvfp4.quantize_blocks(W1[:, i : i + BLOCK_SIZE], global_enc, four_six)
            else:
                scale, four = buf.once_scale[:, g], (buf.once_four[:, g] if four_six is not None else None)
            buf.scales[:, g] = scale
            if four is not None:
                buf.four[:, g] = four
            step = scale / global_enc    # [out]
            # w / inf = +-0: a block whose scale is 0 stores signed zeros, as the packer does.
            divisor = torch.where(step > 0, step, torch.inf)
        # The loop body runs once per column: few, small ops (they bound GPTQ's speed).
        w = W1[:, i]
        code = nvfp4.e2m1_code(w / divisor)
        q = code_values[code.long()] * step
        buf.codes[:, i] = code
        err = (w - q).div_(Hinv1[i, i])
        W1[:, i:].addr_(err, Hinv1[i, i:], alpha=-1)   # W1[:, i:] -= err (x) Hinv1[i, i:]
        buf.err[:, i] = err


class _ColumnBlockRunner:
    """Runs ``_quantize_columns`` for each lazy-batch block of one GPTQ call.

    On CUDA the loop is ~25 tiny kernels per column, so launching them from
    Python bounds GPTQ's speed: the first full-width block runs eagerly (it also
    warms up the lazily made constants), is then captured into a CUDA graph,
    and every later block of that width copies its inputs into the static
    buffers and replays the graph. The captured kernels are the eager ones, so
    the codes are the same (``graphs=False`` runs every block eagerly)."""

    def __init__(self, rows, block_size, device, global_enc, four_six, code_values, *, once: bool,
                 graphs: bool = True) -> None:
        self.rows, self.block_size, self.device = rows, block_size, device
        self.once = once
        self.args = (global_enc, four_six, code_values, once)   # _quantize_columns' arguments after buf
        self.use_graph = graphs and device.type == "cuda"
        self.graph = None
        self.buffers = {}

    def __call__(self, W1: torch.Tensor, Hinv1: torch.Tensor, once=None) -> _ColumnBuffers:
        b = W1.shape[1]
        buf = self.buffers.get(b)
        if buf is None:
            buf = self.buffers[b] = _ColumnBuffers(self.rows, b, self.device, once=self.once)
        buf.W1.copy_(W1)
        buf.Hinv1.copy_(Hinv1)
        if once is not None:
            buf.once_scale.copy_(once[0])
            if once[1] is not None:
                buf.once_four.copy_(once[1])
        if not self.use_graph or b != self.block_size:
            _quantize_columns(buf, *self.args)
            return buf
        with torch.cuda.device(self.device):  # the graph's streams live on the weights' GPU
            if self.graph is None:
                # Eager first (allocator and constants warm, side stream as CUDA graphs
                # ask), then capture: capturing does not run the kernels.
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    _quantize_columns(buf, *self.args)
                torch.cuda.current_stream().wait_stream(stream)
                # Capturing records the kernels without running them: the buffers keep
                # the eager results of this block.
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    _quantize_columns(buf, *self.args)
                return buf
            self.graph.replay()
        return buf


def gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    *,
    four_six: Optional[str] = None,
    amax: Optional[torch.Tensor | float] = None,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    scale_choice: str = "loop",
    name: str = "weight",
    graphs: bool = True,
) -> NVFP4Tensor:
    """GPTQ-quantize ``W: [out, in]`` given ``H: [in, in]`` (sum of ``x x^T``
    over calibration inputs) to an ``NVFP4Tensor``.

    four_six:     None or the Four Over Six rule ("mse" | "mae" | "max").
    amax:         global-scale source (default max|W|; the fused group's max to share it).
    damp:         fraction of mean(diag H) added to the diagonal.
    block_size:   columns per lazy batch update (a multiple of 16).
    act_order:    process columns by decreasing Hessian diagonal, group-wise.
    scale_choice: "loop" (4/6 and block scales chosen on the error-updated
                  weights as the loop reaches each group) or "once" (chosen on
                  the original weights before the loop).
    graphs:       on CUDA, replay each full lazy batch as a CUDA graph (same codes
                  as eager, faster); False runs every batch eagerly. No effect off CUDA.
    """
    if W.dim() != 2:
        raise NVFP4Error(f"{name}: GPTQ expects a 2-D weight [out, in], got shape {tuple(W.shape)}")
    out_features, in_features = W.shape
    if in_features % BLOCK_SIZE or block_size % BLOCK_SIZE:
        raise NVFP4Error(
            f"{name}: GPTQ needs in_features ({in_features}) and block_size ({block_size}) to be "
            f"multiples of {BLOCK_SIZE}; keep this layer in high precision"
        )
    if H.shape != (in_features, in_features):
        raise NVFP4Error(f"{name}: Hessian shape {tuple(H.shape)} does not match in_features={in_features}")
    if scale_choice not in ("loop", "once"):
        raise NVFP4Error(f"{name}: scale_choice must be 'loop' or 'once', got {scale_choice!r}")
    nvfp4.check_finite(W, name)
    nvfp4.check_finite(H, f"{name} (GPTQ Hessian)")

    global_enc = nvfp4.global_encode_scale(
        nvfp4.tensor_amax(W) if amax is None else amax, four_six is not None
    ).to(W.device)
    Wf = W.detach().float().clone()  # [out, in], updated in place by the error feedback
    H = H.detach().float().clone()

    # Columns no calibration input ever reached carry no error signal.
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    Wf[:, dead] = 0.0

    n_groups = in_features // BLOCK_SIZE
    perm = act_order_permutation(H) if act_order else None
    if perm is not None:
        Wf, H = Wf[:, perm], H[perm][:, perm]
    Hinv = _inverse_hessian_cholesky(H, damp, name)  # [in, in] upper triangular

    if scale_choice == "once":
        # Block scales (and 4/6 picks) of the original weights, fixed for the loop.
        _, once_scale, once_four, _ = nvfp4.quantize_blocks(
            Wf.view(out_features, n_groups, BLOCK_SIZE), global_enc, four_six
        )

    codes = torch.empty(out_features, in_features, dtype=torch.uint8, device=W.device)
    scales = torch.empty(out_features, n_groups, dtype=torch.float32, device=W.device)
    chose_four = torch.zeros(out_features, n_groups, dtype=torch.bool, device=W.device)
    # The value of each of the 16 codes, decoded once by the format's decoder: the
    # per-column decode is then one lookup (and no per-column host-to-device copy).
    code_values = nvfp4.e2m1_decode(torch.arange(16, dtype=torch.uint8, device=W.device))
    runner = _ColumnBlockRunner(out_features, block_size, W.device, global_enc, four_six, code_values,
                                once=scale_choice == "once", graphs=graphs)
    for i1 in range(0, in_features, block_size):
        i2 = min(i1 + block_size, in_features)
        g1, g2 = i1 // BLOCK_SIZE, i2 // BLOCK_SIZE
        once = None
        if scale_choice == "once":
            once = (once_scale[:, g1:g2], None if once_four is None else once_four[:, g1:g2])
        blk = runner(Wf[:, i1:i2], Hinv[i1:i2, i1:i2], once)
        codes[:, i1:i2] = blk.codes
        scales[:, g1:g2] = blk.scales
        chose_four[:, g1:g2] = blk.four
        Wf[:, i2:] -= blk.err @ Hinv[i1:i2, i2:]

    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
        group_order = perm.view(n_groups, BLOCK_SIZE)[:, 0] // BLOCK_SIZE  # new group -> old group
        unpermuted = torch.empty_like(scales)
        unpermuted[:, group_order] = scales
        scales = unpermuted
        four_unpermuted = torch.empty_like(chose_four)
        four_unpermuted[:, group_order] = chose_four
        chose_four = four_unpermuted
    return NVFP4Tensor(
        nvfp4.pack_codes(codes),
        scales.to(torch.float8_e4m3fn),   # exact: quantize_blocks returns E4M3 values
        global_enc,
        W.shape,
        W.dtype,
        chose_four if four_six is not None else None,
    )


__all__ = ["act_order_permutation", "gptq", "hessian_update"]
