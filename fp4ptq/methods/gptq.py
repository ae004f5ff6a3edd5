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
    (created when None). GPTQ only needs H up to a positive factor."""
    x2 = x.reshape(-1, x.shape[-1]).float()
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
    step = divisor = None
    # The value of each of the 16 codes, decoded once by the format's decoder: the
    # per-column decode is then one lookup (and no per-column host-to-device copy).
    code_values = nvfp4.e2m1_decode(torch.arange(16, dtype=torch.uint8, device=W.device))
    for i1 in range(0, in_features, block_size):
        i2 = min(i1 + block_size, in_features)
        W1 = Wf[:, i1:i2].clone()            # [out, b]
        Err1 = torch.zeros_like(W1)          # [out, b]: scaled errors pushed to later blocks
        Hinv1 = Hinv[i1:i2, i1:i2]           # [b, b]
        for i in range(i2 - i1):
            if i % BLOCK_SIZE == 0:          # entering a 16-column group: fix its block scales
                g = (i1 + i) // BLOCK_SIZE
                if scale_choice == "loop":
                    _, scale, four, _ = nvfp4.quantize_blocks(W1[:, i : i + BLOCK_SIZE], global_enc, four_six)
                else:
                    scale, four = once_scale[:, g], once_four
                    four = None if four is None else four[:, g]
                scales[:, g] = scale
                if four is not None:
                    chose_four[:, g] = four
                step = scale / global_enc    # [out]
                # w / inf = +-0: a block whose scale is 0 stores signed zeros, as the packer does.
                divisor = torch.where(step > 0, step, torch.inf)
            # The loop body runs once per column: few, small ops (they bound GPTQ's speed).
            w = W1[:, i]
            code = nvfp4.e2m1_code(w / divisor)
            q = code_values[code.long()] * step
            codes[:, i1 + i] = code
            err = (w - q).div_(Hinv1[i, i])
            W1[:, i:].addr_(err, Hinv1[i, i:], alpha=-1)   # W1[:, i:] -= err (x) Hinv1[i, i:]
            Err1[:, i] = err
        Wf[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

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
