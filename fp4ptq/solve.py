"""The solves of one decoder block: the AWQ / SmoothQuant scale searches and their folds
(``search_group`` / ``apply_smoothing``), and rounding (RTN / GPTQ, one weight global scale per fused
set) with the swap to ``NVFP4Linear`` (``rounding_unit`` / ``install_group``)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from . import distributed, nvfp4, rotation
from .config import QuantConfig
from .methods import awq, scale_search, smoothing, smoothquant
from .methods.gptq import gptq
from .methods.rtn import rtn
from .models import InputGroup, set_module
from .modules import NVFP4Linear
from .nvfp4 import BLOCK_SIZE, NVFP4Tensor
from .stats import InputStats, _batches, _first, _join

# Tokens the AWQ clipping search measures its per-block output error on.
CLIP_TOKENS = 512


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
    if any(rotation.online_transform(lin) is not None for lin in linears):
        return {"skipped": "the input is rotated online (issue 43): scales on the producer's channels do not "
                           "reach the rotated channels"}, None
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
                 inputs, world: distributed.World, device) -> dict:
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


def _rows(q: NVFP4Tensor, start: int, stop: int) -> NVFP4Tensor:
    """Rows ``start:stop`` of a quantized ``[out, in]`` tensor."""
    return NVFP4Tensor(
        q.packed[start:stop], q.block_scale[start:stop], q.global_enc,
        torch.Size((stop - start, q.shape[1])), q.dtype,
        None if q.chose_four is None else q.chose_four[start:stop],
    )


def _clip_tokens(samples: list, count: int = CLIP_TOKENS) -> torch.Tensor:
    """Up to ``count`` tokens ``[t, in]`` evenly spread over the search samples."""
    x = torch.cat([s.reshape(-1, s.shape[-1]) for s in samples])
    idx = torch.linspace(0, x.shape[0] - 1, min(count, x.shape[0]), device=x.device).long()
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
    if config.weight_scale_search:  # issue 43: the global scale by whole-tensor error (one per fused set)
        sets = [originals] if fused else [[w] for w in originals]
        found = [scale_search.search_weight_amax(ws, a, four_six=config.four_six)[0]
                 for ws, a in zip(sets, [shared] if fused else amaxes)]
        amaxes = found * len(originals) if fused else found
        shared = amaxes[0] if fused else shared
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
    searched = {}
    if config.weight_scale_search:  # the chosen multiple of the plain amax (issue 43)
        plain = max(float(nvfp4.tensor_amax(w)) for w in originals)
        used = float(1 / nvfp4.global_encode_scale(1.0, config.four_six is not None) / qs[0].global_enc.float().cpu())
        searched["weight_amax_multiplier"] = round(used / plain, 4) if plain else 1.0
    input_amax = stats.input_amax() if config.scheme == "w4a4" else None
    for name, full, lin, w, q in zip(members, names, linears, originals, qs):
        new = NVFP4Linear.from_quantized(
            q, lin.bias, scheme=config.scheme, input_amax=input_amax,
            act_four_six=config.four_six, dtype=lin.weight.dtype,
        )
        rotation.move_online(lin, new)  # an online input rotation stays before the layer
        set_module(block, name, new)
        entries[full] = {
            "shape": [lin.out_features, lin.in_features],
            "scheme": config.scheme,
            "rel_error": nvfp4.quantization_error(w, q),
            "four_share": q.four_share() if config.four_six else None,
            **searched,
        }
    return entries


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


def _no_transform(config: QuantConfig) -> QuantConfig:
    """The config with its transform dropped (the head is only rounded)."""
    method = {"awq": "rtn", "smoothquant": "rtn", "awq+gptq": "gptq", "smoothquant+gptq": "gptq"}.get(config.method, config.method)
    return QuantConfig(**{**config.to_dict(), "method": method})
