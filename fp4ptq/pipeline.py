"""The sequential block runner: ``fp4ptq.quantize(model, config, calib)``.

1. Capture: every decoder block is swapped for a pass-through recorder and the
   model runs once per calibration sequence; this records the first block's
   input hidden states and each block's own call arguments (rotary position
   embeddings, attention mask, position ids, exactly as transformers passes
   them), without running any block.
2. Per block (only this block on ``device``, the rest stays where it is):
   a. statistics: forward-pre hooks on the first linear of each input group
      (scoped, always removed) collect per-channel max/mean |x|, the GPTQ
      Hessian and a few sequences for the searches; NaN/Inf is an error naming
      the layer;
   b. transforms: AWQ / SmoothQuant scales searched on the block-output error
      and folded into the preceding norm/linear (statistics rescaled to match);
   c. rounding: RTN or GPTQ per linear, one global scale per fused group;
   d. swap: ``nn.Linear`` -> ``NVFP4Linear`` (W4A4: static input amax = the
      calibrated max |x| after smoothing, 4/6 rule for the activations);
   e. propagate: run the quantized block to produce the next block's inputs.
3. The LM head, when not ignored, is rounded on the final norm's outputs.

Under torchrun (a process group is initialized) the same steps run on every
rank through the hooks into ``fp4ptq.distributed``: each rank captures and
propagates its share of the calibration sequences (whole batches), the
statistics are reduced before anything is solved, and the searches and
roundings are solve units split over the ranks by cost, their results
broadcast. Alone, every hook is a local step.
"""
from __future__ import annotations

import contextlib
import copy
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

import torch
from torch import nn

from . import __version__, distributed, nvfp4
from .config import QuantConfig
from .methods import awq, smoothing, smoothquant
from .methods.gptq import gptq, hessian_update
from .methods.rtn import rtn
from .models import InputGroup, set_module
from .modules import NVFP4Linear
from .nvfp4 import BLOCK_SIZE, NVFP4Error, NVFP4Tensor

# Tokens the AWQ clipping search measures its per-block output error on.
CLIP_TOKENS = 512
# Calibration sequences are run through a block in batches of about this many
# tokens (fewer, larger calls; the batch's activations stay small next to the block).
TOKENS_PER_CALL = 8192


class CalibrationError(ValueError):
    """Calibration data is missing or malformed."""


# --------------------------------------------------------------------------- #
# Input capture
# --------------------------------------------------------------------------- #
class _StopForward(Exception):
    """Raised by the recorder once it has what it needs (ends the model's forward)."""


@dataclass
class BlockInputs:
    """hidden: first block's inputs, one ``[1, T, hidden]`` tensor per sequence
    (updated in place as blocks are quantized); calls: per block, the
    ``(args, kwargs)`` it is called with besides the hidden states."""

    hidden: list
    calls: list
    start: int = 0   # global index of hidden[0] (a rank holds sequences [start, start + len(hidden)))
    total: int = 0   # sequences of the whole run, over all ranks
    unit: int = 1    # sequences per batch (the ranks' shares are whole batches)


class _Recorder(nn.Module):
    def __init__(self, index: int, record: BlockInputs, stop_at: list) -> None:
        super().__init__()
        self.index, self.record, self.stop_at = index, record, stop_at

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        if self.index == 0:
            self.record.hidden.append(hidden.detach())
        if self.record.calls[self.index] is None:
            self.record.calls[self.index] = (tuple(args[1:]), dict(kwargs))
        if self.index >= self.stop_at[0]:
            raise _StopForward
        return hidden  # transformers 5.x decoder blocks return the hidden-states tensor


@torch.no_grad()
def capture_block_inputs(model: nn.Module, blocks: nn.ModuleList, calib: torch.LongTensor) -> BlockInputs:
    """Run ``model`` on each row of ``calib [n, T]`` with the blocks replaced by
    recorders: the first sequence passes through all of them (each block's call
    arguments), later ones stop at the first block (its input hidden states)."""
    record = BlockInputs(hidden=[], calls=[None] * len(blocks))
    originals = list(blocks)
    stop_at = [len(blocks) - 1]
    device = model.get_input_embeddings().weight.device
    try:
        for i in range(len(blocks)):
            blocks[i] = _Recorder(i, record, stop_at)
        for row in range(calib.shape[0]):
            with contextlib.suppress(_StopForward):
                model(input_ids=calib[row : row + 1].to(device), use_cache=False)
            stop_at[0] = 0
    finally:
        for i, block in enumerate(originals):
            blocks[i] = block
    return record


def _to_device(obj, device):
    from accelerate.utils import send_to_device

    return send_to_device(obj, device)


# --------------------------------------------------------------------------- #
# Statistics
# --------------------------------------------------------------------------- #
@dataclass
class InputStats:
    """Statistics of the input ``x [..., in]`` shared by one input group."""

    name: str                                   # the layer errors name
    keep_samples: int = 0                       # sequences kept for the searches
    hessian_wanted: bool = False
    absmax: Optional[torch.Tensor] = None       # [in] fp32 max |x|
    abs_sum: Optional[torch.Tensor] = None      # [in] sum |x|: float64 while collecting, fp32 once reduced
    tokens: int = 0
    hessian: Optional[torch.Tensor] = None      # [in, in] sum x x^T: float64 while collecting, fp32 once reduced
    samples: list = field(default_factory=list)  # inputs [1, T, in] of the first keep_samples sequences

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        if not torch.isfinite(x).all():
            raise NVFP4Error(
                f"{self.name}: the calibration input holds {int(torch.isnan(x).sum())} NaN and "
                f"{int(torch.isinf(x).sum())} Inf value(s) (shape {tuple(x.shape)}). The float model "
                "already produces non-finite activations here: check the source weights and the "
                "calibration tokens, or compute in a wider dtype (e.g. float32)."
            )
        xf = x.detach().reshape(-1, x.shape[-1]).float()
        amax, asum = xf.abs().amax(0), xf.abs().sum(0)
        self.absmax = amax if self.absmax is None else torch.maximum(self.absmax, amax)
        # Sums over batches in float64: any grouping of the batches (one rank or
        # several, see fp4ptq.distributed) rounds to the same fp32 in all but
        # boundary cases. Each batch's own sum stays fp32 (x's dtype picks the
        # Hessian's matmul precision).
        self.abs_sum = asum.double() if self.abs_sum is None else self.abs_sum.add_(asum)
        self.tokens += xf.shape[0]
        if self.hessian_wanted:
            update = hessian_update(None, x.detach())
            self.hessian = update.double() if self.hessian is None else self.hessian.add_(update)
        for seq in x.detach().split(1):  # x: [batch, T, in] -> sequences [1, T, in]
            if len(self.samples) >= self.keep_samples:
                break
            self.samples.append(seq.clone())

    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum.float() / max(self.tokens, 1)

    def input_amax(self) -> torch.Tensor:
        return self.absmax.max()

    @torch.no_grad()
    def rescale(self, s: torch.Tensor) -> None:
        """The input became ``x / s`` (smoothing folded): update every statistic."""
        s = s.float()
        self.absmax = self.absmax / s
        self.abs_sum = self.abs_sum / s
        if self.hessian is not None:
            self.hessian = self.hessian / (s[:, None] * s[None, :])
        self.samples = [(x.float() / s).to(x.dtype) for x in self.samples]


@contextlib.contextmanager
def collect_input_stats(block: nn.Module, groups, prefix: str, *, hessian: bool, keep_samples: int) -> Iterator[list]:
    """Forward-pre hooks on the first linear of each group, yielding one
    ``InputStats`` per group; the hooks are removed on exit, error or not."""
    stats, handles = [], []
    try:
        for group in groups:
            first = group.linears[0]
            others = ", ".join(n.rsplit(".", 1)[-1] for n in group.linears[1:])
            name = _join(prefix, first) + (f" (input shared with {others})" if others else "")
            st = InputStats(name, keep_samples=keep_samples, hessian_wanted=hessian)
            handles.append(block.get_submodule(first).register_forward_pre_hook(_stats_hook(st)))
            stats.append(st)
        yield stats
    finally:
        for handle in handles:
            handle.remove()


def _stats_hook(st: InputStats):
    def hook(module, args):
        st.update(args[0])

    return hook


# --------------------------------------------------------------------------- #
# Running blocks
# --------------------------------------------------------------------------- #
def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _batches(sequences: list) -> Iterator[tuple]:
    """``(start, stop, batch)``: consecutive ``[1, T, d]`` sequences concatenated
    to ``[b, T, d]`` with about TOKENS_PER_CALL tokens. The recorded call
    arguments (rotary tables ``[1, T, hd]``, a ``[1, 1, T, T]`` mask or None)
    broadcast over the batch."""
    per_call = sequences_per_call(sequences[0].shape[1]) if sequences else 1
    for start in range(0, len(sequences), per_call):
        chunk = sequences[start : start + per_call]
        yield start, start + len(chunk), torch.cat(chunk) if len(chunk) > 1 else chunk[0]


def sequences_per_call(seqlen: int) -> int:
    """Sequences per batch (counted from the run's first sequence on every rank)."""
    return max(1, TOKENS_PER_CALL // max(1, seqlen))


@torch.no_grad()
def run_block(block: nn.Module, hidden: list, call: tuple, *, replace: bool) -> None:
    """Run ``block`` on every sequence (outputs replace ``hidden`` in place when ``replace``)."""
    args, kwargs = call
    for start, stop, batch in _batches(hidden):
        out = _first(block(batch, *args, **kwargs))
        if replace:
            hidden[start:stop] = list(out.split(1))


# --------------------------------------------------------------------------- #
# Transforms (AWQ / SmoothQuant)
# --------------------------------------------------------------------------- #
@dataclass
class InspectCall:
    """How a group's ``inspect`` module was called: its arguments besides the input
    tensor, and where that tensor went (``position`` in args, or ``keyword``)."""

    args: tuple
    kwargs: dict
    position: Optional[int] = 0
    keyword: Optional[str] = None

    def __call__(self, module: nn.Module, x: torch.Tensor):
        args, kwargs = list(self.args), dict(self.kwargs)
        if self.keyword is not None:
            kwargs[self.keyword] = x
        else:
            args.insert(self.position, x)
        return _first(module(*args, **kwargs))


def _record_call(store: dict, key):
    def hook(module, args, kwargs):
        if key in store:
            return
        if args and isinstance(args[0], torch.Tensor):
            store[key] = InspectCall(tuple(args[1:]), dict(kwargs), 0)
        elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            store[key] = InspectCall(tuple(args), rest, None, "hidden_states")
    return hook


@torch.no_grad()
def smooth_group(
    block: nn.Module, group: InputGroup, stats: InputStats, config: QuantConfig, call, members: Optional[list] = None,
) -> dict:
    """Search the group's smoothing scales (AWQ ratio or SmoothQuant alpha) on
    the output error of ``group.inspect`` over ``stats.samples``, fold them into
    ``group.prev`` (and the compensation into every reader, routers included),
    and rescale ``stats``. ``call``: how ``inspect`` is called (an ``InspectCall``,
    or the block's ``(args, kwargs)`` for a table group). ``members``: the linears
    that will be quantized (default: all). Returns what was chosen (for the report)."""
    record, scales = search_group(block, group, stats, config, call, members)
    apply_smoothing(block, group, stats, scales, record)
    return record


def apply_smoothing(block: nn.Module, group: InputGroup, stats: InputStats, scales: Optional[torch.Tensor],
                    record: dict) -> None:
    """Fold ``scales`` (from ``search_group``; None: nothing to fold), rescale ``stats``, note it in ``record``."""
    if scales is None:
        return
    readers = [block.get_submodule(n) for n in (*group.linears, *group.readers)]
    smoothing.fold_scales(block.get_submodule(group.prev), readers, scales, kind=group.fold or "auto")
    stats.rescale(scales)
    record["folded_into"] = group.prev
    if group.readers:
        record["compensated"] = list(group.readers)
    record["scales"] = scales   # the caller rescales what else it holds of this input (expert inputs)


@torch.no_grad()
def search_group(
    block: nn.Module, group: InputGroup, stats: InputStats, config: QuantConfig, call, members: Optional[list] = None,
) -> tuple:
    """The search half of ``smooth_group``: ``(record, scales or None)``, nothing changed."""
    if group.prev is None:
        return {"skipped": group.why or "no module to fold the scales into"}, None
    if group.inspect is None or call is None:
        return {"skipped": "no module takes exactly this input, so there is no output to compare"}, None
    prev = block.get_submodule(group.prev)
    linears = [block.get_submodule(n) for n in group.linears]
    readers = linears + [block.get_submodule(n) for n in group.readers]
    quantized = [block.get_submodule(n) for n in (group.linears if members is None else members)]
    if not all(type(lin) is nn.Linear for lin in linears) or not smoothing.can_fold(prev, readers):
        return {"skipped": "scales cannot be folded (channel counts differ, e.g. grouped-query v -> o)"}, None
    if not quantized:
        return {"skipped": "every linear of the group stays in high precision"}, None
    inspect = block.get_submodule(group.inspect) if group.inspect else block

    if isinstance(call, InspectCall):
        def run(x):
            return call(inspect, x)
    else:
        args, kwargs = call

        def run(x):
            return _first(inspect(x, **kwargs) if group.inspect_kwargs else inspect(x))

    batches = [batch for _, _, batch in _batches(stats.samples)]
    reference = [run(x).float() for x in batches]
    count = sum(r.numel() for r in reference)

    def loss(s: torch.Tensor) -> float:
        act_amax = (stats.absmax / s).max() if config.scheme == "w4a4" else None
        with smoothing.simulated_quantized(quantized, s, four_six=config.four_six, act_amax=act_amax):
            return sum(float((run(x).float() - r).pow(2).sum()) for x, r in zip(batches, reference)) / count

    identity = torch.ones_like(stats.absmax)
    if config.transform == "awq":
        key, s, losses = smoothing.search_scales(awq.awq_candidates(stats.mean_abs(), config.awq_grid), loss)
        record = {"awq_ratio": key}
    else:
        alphas = config.smoothquant_alphas if config.smoothquant_alpha is None else (config.smoothquant_alpha,)
        w_absmax = smoothquant.weight_channel_absmax(quantized)
        candidates = list(smoothquant.smoothquant_candidates(stats.absmax, w_absmax, alphas))
        if config.smoothquant_alpha is None:
            candidates.append((None, identity))  # the search may also decline to smooth
        key, s, losses = smoothing.search_scales(candidates, loss)
        record = {"smoothquant_alpha": key}
    record["loss"] = losses[key]
    record["loss_unsmoothed"] = losses.get(0.0 if config.transform == "awq" else None)
    return record, (s if key is not None and not torch.equal(s, identity) else None)


def _search_waves(groups) -> list:
    """``groups`` in runs whose searches can go in parallel, then fold in
    order, with the result of searching and folding one by one: a group
    starts a new run when an earlier fold of the run touches what its search
    reads (its ``inspect`` module's subtree, the whole block for "", or its linears)."""
    waves: list = []
    for group in groups:
        touched = [n for g in (waves[-1] if waves else ()) if g.prev is not None
                   for n in (g.prev, *g.linears, *g.readers)]
        read = tuple(r for r in (group.inspect, *group.linears) if r is not None)
        if waves and not any(t == r or t.startswith(r + ".") or not r for t in touched for r in read):
            waves[-1].append(group)
        else:
            waves.append([group])
    return waves


@torch.no_grad()
def smooth_block(block: nn.Module, groups: list, stats: dict, config: QuantConfig, calls: dict, members: dict,
                 inputs: BlockInputs, world: distributed.World, device) -> dict:
    """Every group's smoothing: the searches split over the ranks that hold
    sequences (they saw how each module is called), their results broadcast,
    the folds in group order on every rank. Returns the records by group."""
    records = {}
    among = [r for r in range(world.size) if len(set(distributed.shard(inputs.total, inputs.unit, world, r))) == 2]
    for wave in _search_waves(groups):
        units = [distributed.SolveUnit(g.linears[0], _search_cost(block, g, config),
                                       lambda g=g: search_group(block, g, stats[g], config, calls.get(g), members[g]))
                 for g in wave]
        for group, (record, scales) in zip(wave, distributed.run_units(units, world, device, among=among)):
            apply_smoothing(block, group, stats[group], scales, record)
            records[group] = record
    return records


def _search_cost(block: nn.Module, group: InputGroup, config: QuantConfig) -> float:
    """Candidates x parameters the search runs its samples through."""
    candidates = config.awq_grid if config.transform == "awq" else len(config.smoothquant_alphas) + 1
    inspect = block.get_submodule(group.inspect) if group.inspect else block
    return float(candidates * sum(p.numel() for p in inspect.parameters())) if group.inspect is not None else 0.0


# --------------------------------------------------------------------------- #
# Rounding and swapping
# --------------------------------------------------------------------------- #
def _rows(q: NVFP4Tensor, start: int, stop: int) -> NVFP4Tensor:
    """Rows ``start:stop`` of a quantized ``[out, in]`` tensor."""
    return NVFP4Tensor(
        q.packed[start:stop], q.block_scale[start:stop], q.global_enc,
        torch.Size((stop - start, q.shape[1])), q.dtype,
        None if q.chose_four is None else q.chose_four[start:stop],
    )


def _clip_tokens(samples: list) -> torch.Tensor:
    """Up to CLIP_TOKENS tokens ``[t, in]`` evenly spread over the search samples."""
    x = torch.cat([s.reshape(-1, s.shape[-1]) for s in samples])
    idx = torch.linspace(0, x.shape[0] - 1, min(CLIP_TOKENS, x.shape[0]), device=x.device).long()
    return x[idx]


@torch.no_grad()
def quantize_group(
    block: nn.Module,
    spec,
    group: InputGroup,
    members: list,
    stats: Optional[InputStats],
    config: QuantConfig,
    prefix: str,
    *,
    rtn_only: bool = False,
) -> dict:
    """Round the quantizable linears ``members`` (names) of one input group and
    swap them for ``NVFP4Linear``: each set of ``group.rounding_sets()`` shares one
    weight global scale (one GPTQ over its stacked rows). Returns their
    ``fp4ptq_info["layers"]`` entries. ``rtn_only``: RTN whatever the method (no data)."""
    unit = rounding_unit(block, spec, group, members, stats, config, prefix, rtn_only=rtn_only)
    return install_group(block, group, members, stats, config, prefix, unit.solve())


def _rounding_sets(group: InputGroup, members: list) -> list:
    chosen = set(members)
    return [names for names in ([n for n in s if n in chosen] for s in group.rounding_sets()) if names]


def rounding_unit(block: nn.Module, spec, group: InputGroup, members: list, stats: Optional[InputStats],
                  config: QuantConfig, prefix: str, *, rtn_only: bool = False) -> distributed.SolveUnit:
    """The rounding of ``quantize_group`` as one unit: its cost from the shapes
    (GPTQ's column sweep ~ rows x cols^2, its Cholesky ~ cols^3); ``solve()``
    returns the ``NVFP4Tensor``s of each rounding set (the block unchanged)."""
    sets = _rounding_sets(group, members)
    cost = 0.0
    for names in sets:
        shapes = [block.get_submodule(n).weight.shape for n in names]
        rows, cols = sum(sh[0] for sh in shapes), shapes[0][1]
        cost += rows * cols
        cost += rows * cols * cols + cols ** 3 if config.rounding == "gptq" and not rtn_only else 0
        cost += rows * cols * CLIP_TOKENS if config.transform == "awq" and config.awq_clip else 0
    return distributed.SolveUnit(
        _join(prefix, " + ".join(members)), float(cost),
        lambda: [_round_set(block, spec, names, len(names) > 1, stats, config, prefix, rtn_only) for names in sets])


def install_group(block: nn.Module, group: InputGroup, members: list, stats: Optional[InputStats],
                  config: QuantConfig, prefix: str, rounded: list) -> dict:
    """Swap ``members`` for ``NVFP4Linear``s holding ``rounded`` (a ``rounding_unit``'s
    result); their report entries."""
    entries = {}
    for names, qs in zip(_rounding_sets(group, members), rounded):
        entries.update(_install_set(block, names, stats, config, prefix, qs))
    return entries


def _round_set(block, spec, members, fused, stats, config, prefix, rtn_only) -> list:
    linears = [block.get_submodule(n) for n in members]
    originals = [lin.weight.detach().float().clone() for lin in linears]
    # One global scale per fused set, fixed before clipping and rounding.
    shared = smoothing.group_weight_amax(linears) if fused else None
    amaxes = [shared if fused else nvfp4.tensor_amax(w) for w in originals]
    weights = list(originals)
    no_clip = getattr(spec, "no_clip", ()) or ()
    if config.transform == "awq" and config.awq_clip and stats is not None and stats.samples and not rtn_only:
        x = _clip_tokens(stats.samples)
        for i, name in enumerate(members):
            if name not in no_clip and not name.endswith(("q_proj", "k_proj")):
                weights[i] = awq.awq_clip(weights[i], x, four_six=config.four_six, amax=amaxes[i])

    names = [_join(prefix, n) for n in members]
    if config.rounding == "gptq" and not rtn_only and stats is not None and stats.hessian is not None:
        gptq_kwargs = dict(
            four_six=config.four_six, damp=config.gptq_damp, block_size=config.gptq_block_size,
            act_order=config.gptq_act_order, scale_choice=config.gptq_scale_choice,
        )
        if fused:  # same input, same Hessian, same global scale: one GPTQ over stacked rows
            q_all = gptq(torch.cat(weights), stats.hessian, amax=shared, name=" + ".join(names), **gptq_kwargs)
            bounds = torch.tensor([0] + [w.shape[0] for w in weights]).cumsum(0).tolist()
            qs = [_rows(q_all, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        else:
            qs = [gptq(w, stats.hessian, amax=a, name=n, **gptq_kwargs) for w, a, n in zip(weights, amaxes, names)]
    else:
        qs = [rtn(w, four_six=config.four_six, amax=a, name=n) for w, a, n in zip(weights, amaxes, names)]
    return qs


def _install_set(block, members, stats, config, prefix, qs) -> dict:
    linears = [block.get_submodule(n) for n in members]
    originals = [lin.weight.detach().float() for lin in linears]
    names = [_join(prefix, n) for n in members]
    entries = {}
    input_amax = stats.input_amax() if config.scheme == "w4a4" else None
    for name, full, lin, w, q in zip(members, names, linears, originals, qs):
        new = NVFP4Linear.from_quantized(
            q, lin.bias, scheme=config.scheme, input_amax=input_amax,
            act_four_six=config.four_six, dtype=lin.weight.dtype,
        )
        set_module(block, name, new)
        entries[full] = {
            "shape": [lin.out_features, lin.in_features],
            "scheme": config.scheme,
            "rel_error": nvfp4.quantization_error(w, q),
            "four_share": q.four_share() if config.four_six else None,
        }
    return entries


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _split_quantizable(block: nn.Module, group: InputGroup, config: QuantConfig, prefix: str, high: dict) -> list:
    """The group's linears to quantize; the others go to ``high`` with the reason.
    A fused set (one weight global scale in engines) is quantized whole or not at all."""
    kept = {}
    for name in group.linears:
        full, lin = _join(prefix, name), block.get_submodule(name)
        if config.is_ignored(full):
            kept[name] = "ignored by QuantConfig.ignore"
        elif not isinstance(lin, nn.Linear):
            kept[name] = f"not an nn.Linear ({type(lin).__name__})"
        elif lin.in_features % BLOCK_SIZE:
            kept[name] = f"in_features={lin.in_features} is not a multiple of {BLOCK_SIZE}"
            warnings.warn(f"fp4ptq: keeping {full} in high precision: {kept[name]}", stacklevel=3)
    for fused in group.rounding_sets():
        held = [n for n in fused if n in kept]
        if held and len(fused) > 1:
            for n in fused:
                kept.setdefault(n, f"fused with {held[0].rsplit('.', 1)[-1]} (kept in high precision), and engines "
                                   "run a fused set with one weight scale")
    for name, reason in kept.items():
        high[_join(prefix, name)] = reason
    return [n for n in group.linears if n not in kept]


# --------------------------------------------------------------------------- #
# The entry point
# --------------------------------------------------------------------------- #
def _check_calib(calib, model) -> torch.LongTensor:
    if not isinstance(calib, torch.Tensor) or calib.dim() != 2 or calib.dtype != torch.long:
        raise CalibrationError(
            "calib must be a LongTensor [nsamples, seqlen] of token ids (e.g. from "
            f"fp4ptq.calib.get_calibration), got {type(calib).__name__} "
            f"{getattr(calib, 'dtype', '')} {tuple(getattr(calib, 'shape', ()))}"
        )
    vocab = model.get_input_embeddings().weight.shape[0]
    if calib.numel() == 0 or int(calib.min()) < 0 or int(calib.max()) >= vocab:
        raise CalibrationError(f"calib token ids must lie in [0, {vocab}) (the model's vocabulary), "
                               f"got range [{int(calib.min()) if calib.numel() else '-'}, "
                               f"{int(calib.max()) if calib.numel() else '-'}]")
    return calib


# Tokens of the synthetic sequence that shows discovery the blocks' structure when
# no calibration data is needed (RTN W4A16).
PROBE_TOKENS = 16


def _peak_memory(device: torch.device, world: distributed.World = distributed.SINGLE, sequences: int = 0) -> dict:
    import resource

    peak = {"host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        peak["device_bytes"] = torch.cuda.max_memory_allocated(device)
    if world.parallel:
        peak["ranks"] = distributed.gather_report({"rank": world.rank, "sequences": sequences, **peak}, world)
    return peak


@torch.no_grad()
def quantize(
    model: nn.Module,
    config: QuantConfig,
    calib: Optional[torch.LongTensor] = None,
    *,
    tokenizer=None,
    device: Optional[torch.device | str] = None,
    progress: bool = True,
) -> nn.Module:
    """Quantize ``model`` in place to NVFP4 as ``config`` says and return it.

    calib:     LongTensor ``[nsamples, seqlen]`` of token ids; when None and the
               config needs data it is built from ``config.calib`` with ``tokenizer``.
    device:    where each block is processed (e.g. "cuda"); the model otherwise
               stays where it is (keep it on CPU to quantize models larger than
               the device: only one block is on ``device`` at a time).
    progress:  tqdm bar over the decoder blocks.

    Any decoder-only model: the blocks, their linears, the input groups and their
    producers are found from the model (``fp4ptq.models``); Mixture-of-Experts
    expert tensors become one linear per expert projection (``fp4ptq.experts``).
    Quantized ``nn.Linear``s become ``NVFP4Linear``; ``model.fp4ptq_info``
    records the config, calibration, per-layer errors and every tensor kept in
    high precision with the reason.
    """
    from tqdm.auto import tqdm

    from .experts import LinearExperts, linearize_model
    from .models import ARCHITECTURES, check_against_table, check_decoder_only, discover_block, find_blocks

    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be an fp4ptq.QuantConfig, got {type(config).__name__}")
    check_decoder_only(model)
    started = time.perf_counter()
    high = {name: reason for name, reason in linearize_model(model).items()}
    layers_path, blocks = find_blocks(model)
    spec = ARCHITECTURES.get(getattr(model.config, "model_type", None))
    model.eval()

    calibration = {"source": None, "nsamples": 0, "seqlen": 0, "seed": None}
    if calib is None and config.needs_calibration:
        if tokenizer is None:
            raise CalibrationError(
                f"method={config.method!r} scheme={config.scheme!r} needs calibration data: pass "
                "calib (a LongTensor [nsamples, seqlen]) or tokenizer= to build it from config.calib"
            )
        from .calib import get_calibration

        calib = get_calibration(config.calib, tokenizer, config.nsamples, config.seqlen, config.seed, model=model)
        calibration = {"source": config.calib, "nsamples": config.nsamples, "seqlen": config.seqlen, "seed": config.seed}
    elif calib is not None:
        calib = _check_calib(calib, model)
        calibration = {"source": "tensor", "nsamples": calib.shape[0], "seqlen": calib.shape[1], "seed": None}
    if calib is not None and config.needs_calibration and any(isinstance(m, LinearExperts) for m in model.modules()):
        calibration["moe_calib"] = config.moe_calib

    home = next(model.parameters()).device
    device = torch.device(device) if device is not None else home
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    use_data = calib is not None and config.needs_calibration

    # Block inputs: the calibration data's, or (no data needed) a short synthetic
    # sequence that only shows discovery each block's structure.
    world = distributed.world()
    if use_data:
        inputs = capture_sharded(model, blocks, calib, world)
        inputs.hidden = [h.to(device) for h in inputs.hidden]
        probe_inputs = None
    else:
        vocab = model.get_input_embeddings().weight.shape[0]
        synthetic = (torch.arange(PROBE_TOKENS) % vocab).unsqueeze(0)
        probe_inputs = capture_block_inputs(model, blocks, synthetic)
        inputs = None

    layers, smoothing_info, groups_info = {}, {}, {}
    bar = tqdm(range(len(blocks)), desc=f"fp4ptq {config.method} {config.scheme}", disable=not progress or not world.main,
               unit="block")
    for index in bar:
        block = blocks[index]
        block_home = next(block.parameters()).device
        block.to(device)
        prefix = f"{layers_path}.{index}"
        source = inputs if use_data else probe_inputs
        call = _to_device(source.calls[index], device)
        # Discovery observes the run's first sequence, on every rank.
        hidden = (distributed.gather_first([inputs.start], inputs.hidden[:1], 1, world, device)[0] if use_data
                  else source.hidden[0]).to(device)
        plan = discover_block(block, hidden, call, probe=config.transform is not None)
        if spec is not None and layers_path == spec.layers:
            check_against_table(plan, spec, f"{prefix} ({type(block).__name__})")
        for name, reason in plan.high.items():
            high[_join(prefix, name)] = reason
        groups_info[prefix] = [{"linears": list(g.linears), "prev": g.prev, "fold": g.fold, "why": g.why,
                                "fused": [list(f) for f in g.fused_sets], "readers": list(g.readers)}
                               for g in plan.groups]
        quantize_block(block, plan, config, prefix, inputs, index, device,
                       layers=layers, high=high, smoothing_info=smoothing_info, spec=spec)
        block.to(block_home)

    layers.update(_quantize_head(model, layers_path, config, inputs, device, high, use_data))
    for name, module in model.named_modules():
        if type(module) is nn.Linear and name not in high and not name.startswith(layers_path + "."):
            high[name] = "outside the decoder blocks and not the LM head"

    model.fp4ptq_info = {
        "fp4ptq_version": __version__,
        "config": config.to_dict(),
        "calibration": calibration,
        "layers": layers,
        "high_precision": high,
        "smoothing": smoothing_info,
        "fused_groups": [[_join(p, n) for n in f] for p, gs in groups_info.items() for g in gs for f in g["fused"]],
        # Under torchrun every rank's peak (and share of sequences) too; like the run time it
        # stays out of the written report.
        "peak_memory": _peak_memory(device, world, len(inputs.hidden) if inputs else 0),
        "elapsed_s": round(time.perf_counter() - started, 3),
    }
    return model


def capture_sharded(model: nn.Module, blocks: nn.ModuleList, calib: torch.LongTensor,
                    world: distributed.World) -> BlockInputs:
    """``capture_block_inputs`` on this rank's share of ``calib`` (whole batches);
    a rank with no share still records the blocks' call arguments."""
    unit = sequences_per_call(calib.shape[1])
    start, stop = distributed.shard(calib.shape[0], unit, world)
    inputs = capture_block_inputs(model, blocks, calib[start:stop] if stop > start else calib[:1])
    if stop == start:
        inputs.hidden = []
    inputs.start, inputs.total, inputs.unit = start, calib.shape[0], unit
    return inputs


def reduce_stats(stats: InputStats, features: int, keys: list, keep: int, hessian_dst,
                 world: distributed.World, device) -> None:
    """Make ``stats`` (this rank's data) the statistics of the whole run (see
    fp4ptq.distributed), in fp32: the Hessian on every rank (``hessian_dst``
    "all"), on that rank only, or dropped (None: nobody rounds with it); the
    search samples are the ``keep`` of smallest ``keys`` (their places in the run)."""
    stats.hessian_wanted = stats.hessian_wanted and hessian_dst is not None
    if not stats.hessian_wanted:
        stats.hessian = None
    if stats.absmax is None:  # no data on this rank
        stats.absmax = torch.zeros(features, device=device)
        stats.abs_sum = torch.zeros(features, dtype=torch.float64, device=device)
        if stats.hessian_wanted:
            stats.hessian = torch.zeros(features, features, dtype=torch.float64, device=device)
    stats.absmax = distributed.max_over_ranks(stats.absmax, world)
    stats.abs_sum = distributed.sum_in_rank_order(stats.abs_sum, world)
    stats.tokens = distributed.sum_int(stats.tokens, world, device)
    if stats.hessian is not None:
        stats.hessian = distributed.sum_in_rank_order(stats.hessian, world,
                                                      dst=None if hessian_dst == "all" else hessian_dst)
    if keep and world.parallel:   # alone, the samples already are the run's first
        stats.samples = distributed.gather_first(keys, stats.samples, keep, world, device)


@torch.no_grad()
def quantize_block(
    block: nn.Module, plan, config: QuantConfig, prefix: str, inputs: Optional[BlockInputs],
    index: int, device: torch.device, *, layers: dict, high: dict, smoothing_info: dict, spec=None,
) -> None:
    """One decoder block (already on ``device``) with its discovered ``plan``:
    statistics -> transforms -> rounding -> swap (experts streamed one at a time),
    then (with data) its quantized outputs replace ``inputs.hidden`` for the next
    block. Fills the three report dicts."""
    from .experts import LinearExperts

    experts = {name: block.get_submodule(name) for name in plan.experts}

    def expert_of(name: str):
        return next((e for e in experts if name.startswith(e + ".")), None)

    lists = getattr(plan, "expert_lists", {}) or {}   # older MoE form: per-expert module lists

    def list_of(name: str):
        return next((n for n in lists if name.startswith(n + ".")), None)

    world = distributed.world()
    if world.parallel and lists and config.moe_calib == "routed" and config.transform and inputs is not None:
        raise distributed.DistributedError(
            f"{prefix}: experts held as a list of modules (the older MoE form) with --moe-calib routed and "
            f"{config.transform}: their search samples are single routed tokens, which fp4ptq does not yet order "
            "across ranks; use --moe-calib all, or run in one process")
    members = {g: _split_quantizable(block, g, config, prefix, high) for g in plan.groups}
    dense = {g: [n for n in members[g] if expert_of(n) is None and list_of(n) is None] for g in plan.groups}
    list_groups = [g for g in plan.groups if list_of(g.linears[0])]
    routed_lists = config.moe_calib == "routed"
    parent_inputs = {name: [] for name in lists}
    expert_groups = [g for g in plan.groups if any(expert_of(n) for n in g.linears)]
    rounded = [g for g in plan.groups if dense[g]]
    # Owners first: each group's Hessian is summed on the rank that rounds it.
    owners = distributed.assign([rounding_unit(block, spec, g, dense[g], None, config, prefix).cost for g in rounded],
                                world.size)
    stats = dict.fromkeys(plan.groups)
    captured = {name: [] for name in experts}   # per experts module: its (x, top_k_index, top_k_weights) calls
    calls: dict = {}
    if inputs is not None:
        call = _to_device(inputs.calls[index], device)
        keep = config.search_nsamples if config.transform else 0
        handles = []
        try:
            stats_list = []
            for g in plan.groups:
                if all(expert_of(n) for n in g.linears) and g.inspect is not None and expert_of(g.inspect or ""):
                    stats_list.append(None)   # one expert's down: its statistics come in the expert stream
                    continue
                if g in list_groups and not routed_lists:
                    stats_list.append(None)   # per-expert lists under "all": statistics in the expert stream
                    continue
                hook_name = g.inspect if g.inspect is not None else next(iter(dense[g] or g.linears))
                module = block.get_submodule(hook_name) if hook_name else block
                others = ", ".join(n.rsplit(".", 1)[-1] for n in g.linears[1:4])
                st = InputStats(_join(prefix, g.linears[0]) + (f" (input shared with {others})" if others else ""),
                                keep_samples=keep, hessian_wanted=config.rounding == "gptq")
                handles.append(module.register_forward_pre_hook(_stats_pre_hook(st), with_kwargs=True))
                if config.transform and g.inspect is not None:
                    handles.append(module.register_forward_pre_hook(_record_call(calls, g), with_kwargs=True))
                stats_list.append(st)
            for name, module in experts.items():
                handles.append(module.register_forward_pre_hook(_capture_experts(captured[name]), with_kwargs=True))
            for name, parent in lists.items():
                module = block.get_submodule(parent) if parent else block
                handles.append(module.register_forward_pre_hook(_capture_input(parent_inputs[name]), with_kwargs=True))
            run_block(block, inputs.hidden, call, replace=False)
        finally:
            for h in handles:
                h.remove()
        stats = dict(zip(plan.groups, stats_list))
        dst = dict(zip(rounded, owners))
        keys = [inputs.start + i for i in range(len(inputs.hidden))]
        for g in plan.groups:
            if stats[g] is not None:   # experts round with their group's Hessian on every rank
                reduce_stats(stats[g], block.get_submodule(g.linears[0]).weight.shape[-1], keys, keep,
                             "all" if g in expert_groups or g in list_groups else dst.get(g), world, device)
        if config.transform:
            records = smooth_block(block, [g for g in plan.groups if stats[g] is not None and g not in list_groups],
                                   stats, config, calls, members, inputs, world, device)
            for g, record in records.items():
                scales = record.pop("scales", None)
                if scales is not None and g in expert_groups:
                    for name in experts:
                        captured[name] = [(x / scales.to(x.dtype), i, w) for x, i, w in captured[name]]
                smoothing_info[_join(prefix, g.linears[0])] = record
    for g in plan.groups:
        if config.transform and inputs is None and g.why:
            smoothing_info[_join(prefix, g.linears[0])] = {"skipped": g.why}
    units = [rounding_unit(block, spec, g, dense[g], stats[g], config, prefix) for g in rounded]
    for g, result in zip(rounded, distributed.run_units(units, world, device, owners)):
        layers.update(install_group(block, g, dense[g], stats[g], config, prefix, result))
    batch_keys = ([inputs.start // inputs.unit + i for i in range(-(-len(inputs.hidden) // inputs.unit))]
                  if inputs is not None else [])
    for name in lists:   # every rank rounds these experts itself, from statistics reduced over the ranks
        layers.update(_quantize_expert_list(block, name, [g for g in list_groups if list_of(g.linears[0]) == name],
                                            stats, members, parent_inputs[name], config, prefix, smoothing_info,
                                            use_data=inputs is not None, batch_keys=batch_keys, world=world,
                                            device=device))
        parent_inputs[name] = None
    for name, module in experts.items():
        shared = [g for g in expert_groups if any(expert_of(n) == name and not n.endswith(_down(module)) for n in g.linears)]
        layers.update(_quantize_experts(block, name, module, plan, shared[0] if shared else None,
                                        stats.get(shared[0]) if shared else None, members, captured[name],
                                        config, prefix, high, smoothing_info, use_data=inputs is not None,
                                        batch_keys=batch_keys, world=world, device=device))
        captured[name] = None
    if inputs is not None:
        stats = None  # free the Hessians and search samples before the next pass
        run_block(block, inputs.hidden, call, replace=True)


def _down(module) -> str:
    return module[0].names[2]


def _stats_pre_hook(st: InputStats):
    def hook(module, args, kwargs):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        st.update(x)

    return hook


def _capture_input(store: list):
    def hook(module, args, kwargs):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        store.append(x.detach().reshape(-1, x.shape[-1]))

    return hook


@torch.no_grad()
def _quantize_expert_list(block, name, groups, stats, members, inputs, config, prefix, smoothing_info,
                          *, use_data, batch_keys=(), world=distributed.SINGLE, device=None) -> dict:
    """The older MoE form (an ``nn.ModuleList`` of expert MLPs): one expert at a time, its
    groups' statistics from every token reaching the layer (``moe_calib="all"``), or from its
    routed tokens ("routed"; an expert that got none is rounded with RTN, named in a warning,
    its activation statistics taken from every token), then smoothing of its own groups,
    rounding and swap."""
    entries = {}
    by_expert: dict = {}
    for g in groups:
        expert = g.linears[0][len(name) + 1:].split(".", 1)[0]
        by_expert.setdefault(int(expert), []).append(g)
    for e in sorted(by_expert):
        local = f"{name}.{e}"
        expert = block.get_submodule(local)
        todo = by_expert[e]
        routed = {g: stats.get(g) for g in todo} if config.moe_calib == "routed" and use_data else {}
        no_data = use_data and bool(routed) and all(st is None or st.tokens == 0 for st in routed.values())
        own = {}
        if use_data and (not routed or no_data):
            if no_data:
                warnings.warn(f"fp4ptq: expert {_join(prefix, local)} received no calibration token "
                              "(moe_calib='routed'); it is rounded with RTN and its activation statistics come "
                              "from all tokens", stacklevel=2)
            own = _expert_stats(block, expert, local, todo, inputs, config, prefix, hessian=not no_data)
            for g, st in own.items():   # one sample per captured batch of this rank
                reduce_stats(st, block.get_submodule(g.linears[0]).weight.shape[-1], list(batch_keys),
                             st.keep_samples, "all", world, device)
        for g in todo:
            st = own.get(g, routed.get(g))
            if config.transform and use_data and not no_data and st is not None and g.prev and st.tokens:
                rel = _relative(g, local)
                record = smooth_group(expert, rel, st, config, InspectCall((), {}, 0),
                                      [n[len(local) + 1:] for n in members[g]])
                record.pop("scales", None)
                smoothing_info[_join(prefix, g.linears[0])] = record
            chosen = [n[len(local) + 1:] for n in members[g]]
            if chosen:
                got = quantize_group(expert, None, _relative(g, local), chosen, st, config, _join(prefix, local),
                                     rtn_only=no_data)
                if no_data:
                    for rec in got.values():
                        rec["note"] = "no routed calibration token: RTN"
                entries.update(got)
    return entries


def _relative(g: InputGroup, local: str) -> InputGroup:
    """``g`` with names relative to the module ``local``."""
    cut = len(local) + 1

    def rel(n):
        return n[cut:] if n and n.startswith(local + ".") else (None if n else n)

    return replace(g, linears=tuple(rel(n) for n in g.linears), prev=rel(g.prev),
                   inspect=rel(g.inspect) if g.inspect else None,
                   fused_sets=tuple(tuple(rel(n) for n in f) for f in g.fused_sets))


def _expert_stats(block, expert, local, groups, inputs, config, prefix, *, hessian) -> dict:
    """Statistics of one expert's groups with every captured token run through it."""
    keep = config.search_nsamples if config.transform else 0
    out, handles = {}, []
    try:
        for g in groups:
            hook_name = g.inspect if g.inspect and g.inspect.startswith(local + ".") else g.linears[0]
            module = block.get_submodule(hook_name) if g.inspect != local else expert
            st = InputStats(_join(prefix, g.linears[0]), keep_samples=keep,
                            hessian_wanted=hessian and config.rounding == "gptq")
            handles.append(module.register_forward_pre_hook(_stats_pre_hook(st), with_kwargs=True))
            out[g] = st
        for x in inputs:
            expert(x.unsqueeze(0))
    finally:
        for h in handles:
            h.remove()
    return out


def _capture_experts(store: list):
    def hook(module, args, kwargs):
        names = ("hidden_states", "top_k_index", "top_k_weights")
        values = list(args[:3]) + [kwargs.get(n) for n in names[len(args[:3]):]]
        store.append(tuple(v.detach() for v in values))

    return hook


@torch.no_grad()
def _quantize_experts(block, name, module, plan, shared_group, shared_stats, members, captured, config, prefix,
                      high, smoothing_info, *, use_data: bool, batch_keys: list, world: distributed.World,
                      device) -> dict:
    """Stream the experts of one ``LinearExperts``: per expert, its statistics (every
    calibration token under ``moe_calib="all"``, its routed tokens under "routed"),
    the down projection's smoothing, rounding and swap; then they are freed, so
    peak memory does not grow with the number of experts. An expert without data
    is rounded with RTN and named in a warning.

    Over several ranks the experts go in runs of one per rank: each expert's
    statistics are reduced onto the rank that then searches and rounds it (on a
    copy), and every rank folds and swaps in the broadcast results.
    ``captured`` holds this rank's batches; ``batch_keys`` their places in the run."""
    entries = {}
    gate_n, up_n, down_n = module[0].names
    chosen = {n for g in plan.groups for n in members[g]}
    groups_by_down = {g.linears[0]: g for g in plan.groups if len(g.linears) == 1}
    xs = [x.reshape(-1, x.shape[-1]) for x, _, _ in captured] if use_data else []
    keep = config.search_nsamples if config.transform else 0
    hidden_size, inter = module[0].projections()[0].in_features, module[0].projections()[2].in_features
    for first in range(0, len(module), world.size):
        run = list(range(first, min(first + world.size, len(module))))
        units, applies = [], []
        for owner, e in enumerate(run):
            mlp = module[e]
            local = f"{name}.{e}"
            full = _join(prefix, local)
            rows = None
            if use_data and config.moe_calib == "routed":
                rows = [torch.where((idx == e).any(-1))[0] for _, idx, _ in captured]
            x_e = [x if rows is None else x[r] for x, r in zip(xs, rows or [None] * len(xs))]
            n_tokens = distributed.sum_int(sum(int(x.shape[0]) for x in x_e), world, device) if use_data else 0
            no_data = use_data and n_tokens == 0
            if no_data:
                warnings.warn(f"fp4ptq: expert {full} received no calibration token (moe_calib='routed'); it is "
                              "rounded with RTN and its activation statistics come from all tokens", stacklevel=2)
                x_e = xs
            keys = [k for k, x in zip(batch_keys, x_e) if x.shape[0]]
            hessian_dst = owner if config.rounding == "gptq" and not no_data else None
            # gate/up statistics: under "all" the shared group's (every token), else this expert's tokens
            gu_stats = None
            if use_data:
                if rows is None and shared_stats is not None:
                    gu_stats = shared_stats
                else:
                    gu_stats = InputStats(f"{full}.{gate_n} (input shared with {up_n})", keep_samples=keep,
                                          hessian_wanted=hessian_dst is not None)
                    for x in x_e:
                        if x.shape[0]:
                            gu_stats.update(x.unsqueeze(0))
                    reduce_stats(gu_stats, hidden_size, keys, keep, hessian_dst, world, device)
            # down statistics: its input act(gate(x)) * up(x) with the float weights
            down_stats = None
            down_group = groups_by_down.get(f"{local}.{down_n}")
            if use_data:
                down_stats = InputStats(f"{full}.{down_n}", keep_samples=keep, hessian_wanted=hessian_dst is not None)
                g, u, _ = mlp.projections()
                for x in x_e:
                    if x.shape[0]:
                        down_stats.update(module.apply_gate(g(x), u(x)).unsqueeze(0))
                reduce_stats(down_stats, inter, keys, keep, hessian_dst, world, device)
            rel = None
            if config.transform and use_data and down_group is not None and not no_data:
                rel = InputGroup((down_n,), up_n if down_group.prev == f"{local}.{up_n}" else None, down_n,
                                 fold="linear", why=down_group.why)
            gu_group = InputGroup((gate_n, up_n), None, None, fused_sets=((gate_n, up_n),))
            gu_members = [n for n in (gate_n, up_n) if f"{local}.{n}" in chosen]
            down_members = [down_n] if f"{local}.{down_n}" in chosen else []
            dn_group = InputGroup((down_n,), None, None)
            args = (mlp, full, rel, gu_group, gu_members, gu_stats, dn_group, down_members, down_stats, no_data)
            units.append(distributed.SolveUnit(full, 0.0, lambda args=args: _solve_expert(*args, config)))
            applies.append(args)
        results = distributed.run_units(units, world, device, owners=list(range(len(run))))
        for (mlp, full, rel, gu_group, gu_members, gu_stats, dn_group, down_members, down_stats, no_data), \
                (record, scales, gu_q, dn_q) in zip(applies, results):
            if rel is not None:
                apply_smoothing(mlp, rel, down_stats, scales, record)
                record.pop("scales", None)
                smoothing_info[f"{full}.{down_n}"] = record
            entries.update(install_group(mlp, gu_group, gu_members, gu_stats, config, full, gu_q))
            if down_members:
                entries.update(install_group(mlp, dn_group, down_members, down_stats, config, full, dn_q))
            if no_data:
                for n in (gate_n, up_n, down_n):
                    if f"{full}.{n}" in entries:
                        entries[f"{full}.{n}"]["note"] = "no routed calibration token: RTN"
    return entries


def _solve_expert(mlp, full, rel, gu_group, gu_members, gu_stats, dn_group, down_members, down_stats, no_data,
                  config) -> tuple:
    """One expert's down smoothing search and roundings, on a copy of it (the
    caller folds and swaps): ``(record, scales, gate/up tensors, down tensors)``."""
    record, scales = {}, None
    if rel is not None:
        record, scales = search_group(mlp, rel, down_stats, config, InspectCall((), {}, 0), down_members)
        if scales is not None:
            mlp, down_stats = copy.deepcopy(mlp), copy.copy(down_stats)
            apply_smoothing(mlp, rel, down_stats, scales, dict(record))
    gu_q = rounding_unit(mlp, None, gu_group, gu_members, gu_stats, config, full, rtn_only=no_data).solve()
    dn_q = (rounding_unit(mlp, None, dn_group, down_members, down_stats, config, full, rtn_only=no_data).solve()
            if down_members else None)
    return record, scales, gu_q, dn_q


@torch.no_grad()
def _quantize_head(model, layers_path: str, config: QuantConfig, inputs, device, high: dict, use_data: bool) -> dict:
    """Round the LM head (no smoothing) on the final norm's outputs, unless ignored."""
    from .models import final_norm, head_name

    head_path = head_name(model)
    if head_path is None:
        return {}
    if config.is_ignored(head_path):
        high[head_path] = "ignored by QuantConfig.ignore"
        return {}
    group = InputGroup((head_path,), None, head_path)
    members = _split_quantizable(model, group, config, "", high)
    if not members:
        return {}
    norm_path = final_norm(model, layers_path)
    head = model.get_submodule(head_path)
    norm = model.get_submodule(norm_path) if norm_path else nn.Identity()
    homes = [next(m.parameters(), torch.empty(0)).device for m in (norm, head)]
    norm.to(device)
    # A copy on the device: the head's weight may be tied to the input embedding,
    # which must not follow it there.
    set_module(model, head_path, copy.deepcopy(head).to(device))
    stats = None
    world = distributed.world()
    if use_data:
        stats = InputStats(head_path, hessian_wanted=config.rounding == "gptq")
        for h in inputs.hidden:
            stats.update(norm(h))
        reduce_stats(stats, model.get_submodule(head_path).weight.shape[-1], [], 0, 0, world, device)
    config = _no_transform(config)
    (rounded,) = distributed.run_units([rounding_unit(model, None, group, members, stats, config, "")], world, device,
                                       owners=[0])
    entries = install_group(model, group, members, stats, config, "", rounded)
    norm.to(homes[0])
    model.get_submodule(head_path).to(homes[1])
    return entries


def _no_transform(config: QuantConfig) -> QuantConfig:
    """The config with its transform dropped (the head is only rounded)."""
    method = {"awq": "rtn", "smoothquant": "rtn", "awq+gptq": "gptq", "smoothquant+gptq": "gptq"}.get(config.method, config.method)
    return QuantConfig(**{**config.to_dict(), "method": method})


__all__ = ["BlockInputs", "CalibrationError", "InputStats", "capture_block_inputs", "collect_input_stats",
           "quantize", "quantize_block", "quantize_group", "run_block", "smooth_group"]
