"""Mixture-of-Experts experts, one expert at a time: each expert's statistics (every calibration
token under ``moe_calib="all"``, its routed tokens under "routed"), its own smoothing, rounding and swap,
then freed, so peak memory does not grow with the number of experts. Both forms: ``LinearExperts``
(transformers 5's 3-D expert tensors, linearized) and a module list of expert MLPs (the older form)."""
from __future__ import annotations

import copy
import warnings
from dataclasses import replace

import torch

from . import distributed
from .models import InputGroup
from .solve import (
    InspectCall,
    apply_smoothing,
    install_group,
    quantize_group,
    rounding_unit,
    search_group,
    smooth_group,
)
from .stats import InputStats, _join, _stats_pre_hook, reduce_stats


def _down(module) -> str:
    return module[0].names[2]


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


@torch.no_grad()
def _quantize_experts(name, module, plan, shared_stats, members, captured, config, prefix,
                      smoothing_info, *, use_data: bool, batch_keys: list, world: distributed.World,
                      device) -> dict:
    """Stream the experts of one ``LinearExperts``: per expert, its statistics (every
    calibration token under ``moe_calib="all"``, its routed tokens under "routed"),
    the down projection's smoothing, rounding and swap; then they are freed, so
    peak memory does not grow with the number of experts. An expert without data
    is rounded with RTN and named in a warning.

    Over several ranks the experts go in runs of one per rank: each expert's
    statistics are reduced onto the rank that then searches and rounds it (on a
    copy), and every rank folds and swaps in the broadcast results. A run ends
    when its slowest solve does, so under "routed" (whose searches cost in
    proportion to each expert's routed tokens) the runs take the experts by
    decreasing cost (``_routed_order``); under "all" every expert costs the same
    and they go in turn. The report's entries keep the experts' order.
    ``captured`` holds this rank's batches; ``batch_keys`` their places in the run."""
    by_expert: dict = {}   # expert -> (its report entries, its smoothing records)
    gate_n, up_n, down_n = module[0].names
    chosen = {n for g in plan.groups for n in members[g]}
    groups_by_down = {g.linears[0]: g for g in plan.groups if len(g.linears) == 1}
    routed = use_data and config.moe_calib == "routed"
    keep = config.search_nsamples if config.transform else 0
    hidden_size, inter = module[0].projections()[0].in_features, module[0].projections()[2].in_features
    order = list(range(len(module)))
    if use_data and config.moe_calib == "routed" and world.parallel:
        order = _routed_order(module, captured, batch_keys, keep, config, world)
    for first in range(0, len(order), world.size):
        run = order[first:first + world.size]
        units, applies = [], []
        for owner, e in enumerate(run):
            mlp = module[e]
            local = f"{name}.{e}"
            full = _join(prefix, local)
            x_e = [module.calibration_rows(c, e, routed) for c in captured] if use_data else []
            n_tokens = distributed.sum_int(sum(int(x.shape[0]) for x in x_e), world, device) if use_data else 0
            no_data = use_data and n_tokens == 0
            if no_data:
                warnings.warn(f"fp4ptq: expert {full} received no calibration token (moe_calib='routed'); it is "
                              "rounded with RTN and its activation statistics come from all tokens", stacklevel=2)
                x_e = [module.calibration_rows(c, e, False) for c in captured]
            keys = [k for k, x in zip(batch_keys, x_e) if x.shape[0]]
            hessian_dst = owner if config.rounding == "gptq" and not no_data else None
            # gate/up statistics: under "all" the shared group's (every token), else this expert's tokens
            gu_stats = None
            if use_data:
                if not routed and shared_stats is not None:
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
                _token_rows(down_stats)
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
        for e, (mlp, full, rel, gu_group, gu_members, gu_stats, dn_group, down_members, down_stats, no_data), \
                (record, scales, gu_q, dn_q) in zip(run, applies, results):
            entries, smoothed = by_expert[e] = {}, {}
            if rel is not None:
                apply_smoothing(mlp, rel, down_stats, scales, record)
                record.pop("scales", None)
                smoothed[f"{full}.{down_n}"] = record
            entries.update(install_group(mlp, gu_group, gu_members, gu_stats, config, full, gu_q))
            if down_members:
                entries.update(install_group(mlp, dn_group, down_members, down_stats, config, full, dn_q))
            if no_data:
                for n in (gate_n, up_n, down_n):
                    if f"{full}.{n}" in entries:
                        entries[f"{full}.{n}"]["note"] = "no routed calibration token: RTN"
    entries = {}
    for e in sorted(by_expert):
        entries.update(by_expert[e][0])
        smoothing_info.update(by_expert[e][1])
    return entries


def _routed_order(module, captured, batch_keys: list, keep: int, config, world: distributed.World) -> list:
    """The experts by decreasing cost of their solve under "routed" (ties by index): the
    roundings' (from the shapes: the same for every expert with data, RTN's for one without)
    and, with a search, candidates x the down projection's size x its search samples' tokens
    (the expert's routed tokens in the run's first ``keep`` batches that reach it). The routed
    token counts of every batch come from every rank, so every rank finds the same order."""
    from .solve import _search_cost

    local = {k: module.routed_counts(call) for k, call in zip(batch_keys, captured)}
    counts = {}
    for part in distributed.gather_report(local, world):
        counts.update(part)
    gate_n, up_n, down_n = module[0].names
    costs = []
    for e in range(len(module)):
        tokens = [counts[k][e] for k in sorted(counts) if counts[k][e]]
        rtn = not tokens
        cost = sum(rounding_unit(module[e], None, InputGroup(names, None, None, fused_sets=(names,)), list(names),
                                 None, config, "", rtn_only=rtn).cost for names in ((gate_n, up_n), (down_n,)))
        if config.transform and not rtn:
            cost += _search_cost(module[e], InputGroup((down_n,), up_n, down_n), config) * sum(tokens[:keep])
        costs.append(cost)
    return sorted(range(len(module)), key=lambda e: (-costs[e], e))


def _token_rows(stats: InputStats) -> None:
    """An expert's routed tokens differ in number from batch to batch: its search samples
    become one row of tokens (the down projection's search compares a linear's outputs,
    token by token, so their grouping into sequences does not matter)."""
    if len({s.shape[1] for s in stats.samples}) > 1:
        stats.samples = [torch.cat([s.reshape(-1, s.shape[-1]) for s in stats.samples]).unsqueeze(0)]


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
