"""High-precision parts chosen by measurement (``QuantConfig.keep_budget``).

Sensitivity of a part (one linear, or one decoder block's linears) is the
increase of the mean KL divergence ``KL(p_float || p_part)`` of the next-token
distributions on calibration tokens when only that part is quantized (RTN with
the config's Four Over Six rule; W4A4 also rounds the part's inputs with their
calibrated amax). The float model's KL to itself is 0, so the figure is the
increase itself. A part's forward starts at its first decoder block: the blocks
before it give what they gave in the float pass (kept from it), so on average half
of the blocks are not run again, and the figures are the full forward's.

The most sensitive parts stay in bf16 while their extra bytes fit the budget:
``extra = bf16 bytes - NVFP4 bytes`` (packed codes, E4M3 block scales, fp32
global scales) of the part's weights. "PCT%" allows PCT% of the extra bytes of
keeping every quantizable linear in bf16; "N" keeps N parts. Parts are taken in
decreasing sensitivity, skipping one that would overflow the budget, so the
sum never exceeds it.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import distributed, nvfp4
from .config import QuantConfig, parse_keep_budget
from .nvfp4 import BLOCK_SIZE

# Tokens per calibration sequence the measurement runs (the leading ones of each row).
SENSITIVITY_TOKENS = 512


def extra_bytes(linear: nn.Linear, scheme: str) -> int:
    """Bytes a linear ``[out, in]`` costs in bf16 beyond its NVFP4 form (a bias costs the same in both)."""
    out_f, in_f = linear.weight.shape
    nvfp4_bytes = out_f * in_f // 2 + out_f * in_f // BLOCK_SIZE + 4 + (4 if scheme == "w4a4" else 0)
    return 2 * out_f * in_f - nvfp4_bytes


def select(parts: dict, costs: dict, budget: str) -> tuple:
    """``(kept names, budget in bytes or None for a count)``: parts by decreasing sensitivity
    (``parts``: name -> KL increase) that fit ``budget`` ("PCT%" of the sum of ``costs``, or "N")."""
    kind, value = parse_keep_budget(budget)
    order = sorted(parts, key=lambda n: (-parts[n], n))
    if kind == "count":
        return order[:value], None
    limit = int(value / 100 * sum(costs.values()))
    kept, used = [], 0
    for name in order:
        if used + costs[name] <= limit:
            kept.append(name)
            used += costs[name]
    if not kept and costs:
        smallest = min(costs, key=costs.get)
        warnings.warn(f"fp4ptq: keep budget {budget} ({limit} bytes) is less than the smallest part's extra bytes "
                      f"({smallest}: {costs[smallest]}): nothing is kept in bf16; raise the budget or keep smaller "
                      "parts (keep_unit='linear', --keep-unit linear)", stacklevel=2)
    return kept, limit


def _kl(reference_logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of ``KL(p_ref || p)``; both ``[T, vocab]``, the reference as log-probabilities."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return (reference_logp.exp() * (reference_logp - logp)).sum()


@contextlib.contextmanager
def _quantized_only(linears: Sequence[nn.Linear], config: QuantConfig, input_amax: dict) -> Iterator[None]:
    """Within the block, ``linears`` compute with RTN-rounded weights (and, W4A4, rounded inputs)."""
    saved, handles = [], []
    try:
        for lin in linears:
            saved.append((lin, lin.weight.data))
            lin.weight.data = nvfp4.fake_quantize(lin.weight.data.float(), config.four_six).to(lin.weight.dtype)
            if config.scheme == "w4a4":
                amax = input_amax[lin]

                def hook(module, args, amax=amax):
                    return (nvfp4.fake_quantize(args[0], config.four_six, amax=amax),) + tuple(args[1:])

                handles.append(lin.register_forward_pre_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for lin, weight in saved:
            lin.weight.data = weight


def _clone(output):
    """A block's output (a tensor or a tuple holding tensors) with its tensors copied."""
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, tuple):
        return tuple(_clone(o) for o in output)
    return output


@contextlib.contextmanager
def _replayed(blocks: Sequence[nn.Module], start: int, outputs: list) -> Iterator[None]:
    """Blocks before ``start`` return ``outputs[i]`` (their float-pass output for the row being run)
    instead of computing; the last of them a copy, in case block ``start`` writes into its input."""
    saved = []
    try:
        for i in range(start):
            saved.append((blocks[i], blocks[i].__dict__.get("forward")))
            blocks[i].forward = (lambda *a, _i=i, **k: _clone(outputs[_i])) if i == start - 1 else \
                (lambda *a, _i=i, **k: outputs[_i])
        yield
    finally:
        for block, forward in saved:
            if forward is None:
                del block.forward
            else:
                block.forward = forward


@torch.no_grad()
def measure(model: nn.Module, parts: dict, calib: torch.LongTensor, config: QuantConfig,
            progress: bool = False, comm_device=None, blocks: Optional[Sequence[nn.Module]] = None) -> dict:
    """``{part: mean KL increase per token}`` for ``parts`` (name -> list of linears) on the first
    ``config.keep_nsamples`` calibration rows (their first SENSITIVITY_TOKENS tokens). ``blocks``:
    the decoder blocks in call order (default: ``models.find_blocks``); a part's forward starts at
    the first block holding one of its linears. Under torchrun the figures travel through
    ``comm_device`` (this rank's device; default: the model's)."""
    from tqdm.auto import tqdm

    from .models import find_blocks

    device = model.get_input_embeddings().weight.device
    rows = calib[: config.keep_nsamples, :SENSITIVITY_TOKENS].to(device)
    linears = {lin for members in parts.values() for lin in members}
    input_amax: dict = {}
    blocks = list(find_blocks(model)[1] if blocks is None else blocks)
    first_block: dict = {}   # module -> the first block holding it (a shared module: its first use)
    for index, block in enumerate(blocks):
        for module in block.modules():
            first_block.setdefault(module, index)
    outputs: list = [[None] * len(blocks) for _ in rows]   # [row][block]: the float pass's block outputs
    current = [0]

    def amax_hook(module, args):
        a = args[0].detach().abs().amax().float()
        input_amax[module] = torch.maximum(input_amax.get(module, a), a)

    handles = [lin.register_forward_pre_hook(amax_hook) for lin in linears] if config.scheme == "w4a4" else []
    handles += [b.register_forward_hook(lambda m, a, o, i=i: outputs[current[0]].__setitem__(i, o))
                for i, b in enumerate(blocks)]
    try:
        reference = []
        for current[0], r in enumerate(rows):
            reference.append(F.log_softmax(model(input_ids=r[None], use_cache=False).logits[0].float(), -1))
    finally:
        for handle in handles:
            handle.remove()
    # A block that did not run in the float pass (a model that skips some) has no output: start at 0.
    complete = all(o is not None for row in outputs for o in row)
    tokens = rows.numel()
    # Under torchrun the parts (each one forward per row: equal costs) are split over the ranks
    # and their figures broadcast; every rank measured the reference itself.
    world = distributed.world()
    owners = distributed.assign([1.0] * len(parts), world.size)
    bar = tqdm(total=owners.count(world.rank), desc="fp4ptq sensitivity", disable=not progress, unit="part")

    def kl_increase(members) -> float:
        start = min(first_block.get(lin, 0) for lin in members) if complete else 0
        total = 0.0
        with _quantized_only(members, config, input_amax):
            for ref, r, row_outputs in zip(reference, rows, outputs):
                with _replayed(blocks, start, row_outputs):
                    total += float(_kl(ref, model(input_ids=r[None], use_cache=False).logits[0]))
        bar.update()
        return total / tokens

    units = [distributed.SolveUnit(name, 1.0, lambda m=members: kl_increase(m)) for name, members in parts.items()]
    out = dict(zip(parts, distributed.run_units(units, world, comm_device or device, owners)))
    bar.close()
    return out


def choose(model: nn.Module, parts: dict, calib: torch.LongTensor, config: QuantConfig,
           progress: bool = False, comm_device=None, blocks: Optional[Sequence[nn.Module]] = None) -> dict:
    """Measure and select under ``config.keep_budget``; ``parts``: part name -> [(full linear name,
    module), ...] (a linear, a fused group or a block). Returns the record for the report (kept linears,
    per-part KL increase and extra bytes, the budget)."""
    costs = {p: sum(extra_bytes(lin, config.scheme) for _, lin in m) for p, m in parts.items()}
    kl = measure(model, {p: [lin for _, lin in m] for p, m in parts.items()}, calib, config, progress, comm_device,
                 blocks)
    kept_parts, limit = select(kl, costs, config.keep_budget)
    kept = [n for p in kept_parts for n, _ in parts[p]]
    return {
        "budget": config.keep_budget,
        "unit": config.keep_unit,
        "budget_bytes": limit,
        "extra_bytes": sum(costs[p] for p in kept_parts),
        "all_extra_bytes": sum(costs.values()),
        "kept_parts": kept_parts,
        "kept": kept,
        "tokens": int(min(calib.shape[1], SENSITIVITY_TOKENS) * min(calib.shape[0], config.keep_nsamples)),
        "kl_increase": {p: float(f"{v:.6g}") for p, v in sorted(kl.items(), key=lambda kv: -kv[1])},
        "part_bytes": costs,
    }


def describe(keep: Optional[dict]) -> Optional[str]:
    """One line for ``inspect``."""
    if not keep:
        return None
    budget = f"{keep['budget_bytes']} bytes" if keep.get("budget_bytes") is not None else "a count"
    top = ", ".join(f"{p} ({keep['kl_increase'][p]:.4g})" for p in keep["kept_parts"][:6])
    return (f"keep budget {keep['budget']} by {keep['unit']} ({budget}; {keep['extra_bytes']} extra bytes used): "
            f"{len(keep['kept'])} linear(s) in bf16, by KL increase: {top or 'none'}")


__all__ = ["SENSITIVITY_TOKENS", "choose", "describe", "extra_bytes", "measure", "select"]
