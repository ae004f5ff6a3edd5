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
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn

from . import __version__, distributed, rotation, sensitivity
from .config import QuantConfig
from .models import InputGroup, UnsupportedArchitecture, set_module
from .moe import _down, _quantize_expert_list, _quantize_experts
from .solve import (  # noqa: F401 - re-exported: fp4ptq.pipeline is where users find the block runner's parts
    CLIP_TOKENS,
    InspectCall,
    _no_transform,
    _record_call,
    _split_quantizable,
    apply_smoothing,
    install_group,
    quantize_group,
    rounding_unit,
    search_group,
    smooth_block,
    smooth_group,
)
from .stats import (  # noqa: F401 - re-exported
    TOKENS_PER_CALL,
    batches_sequences,
    one_sequence_a_call,
    InputStats,
    _capture_experts,
    _capture_input,
    _join,
    _stats_pre_hook,
    collect_input_stats,
    reduce_stats,
    run_block,
    sequences_per_call,
)


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
    """Stands in for decoder block ``index`` while the inputs are recorded; attributes it lacks
    are the block's (model code that reads ``layer.attention_type`` or calls a block's method)."""

    def __init__(self, index: int, record: BlockInputs, stop_at: list, block: nn.Module,
                 run_block: bool = False) -> None:
        super().__init__()
        self.index, self.record, self.stop_at, self.run_block = index, record, stop_at, run_block
        object.__setattr__(self, "_block", block)   # not a submodule: the block stays where it is

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_block"), name)

    def forward(self, *args, **kwargs):
        call = (args, dict(kwargs))
        hidden = args[0] if args else kwargs.pop("hidden_states")
        if self.index == 0:
            self.record.hidden.append(hidden.detach())
        if self.record.calls[self.index] is None:
            self.record.calls[self.index] = (tuple(args[1:]), dict(kwargs))
        if self.index >= self.stop_at[0]:
            raise _StopForward
        if self.run_block:  # blocks that return a tuple (CPM-Ant, RWKV): the model unpacks the real output
            return object.__getattribute__(self, "_block")(*call[0], **call[1])
        return hidden  # transformers 5.x decoder blocks return the hidden-states tensor


@torch.no_grad()
def capture_block_inputs(model: nn.Module, blocks: nn.ModuleList, calib: torch.LongTensor) -> BlockInputs:
    """Run ``model`` on each row of ``calib [n, T]`` with the blocks replaced by
    recorders: the first sequence passes through all of them (each block's call
    arguments), later ones stop at the first block (its input hidden states)."""
    try:
        return _capture(model, blocks, calib, run_blocks=False)
    except Exception:  # noqa: BLE001 - model code that uses a block's output beyond the hidden states
        # (unpacks a tuple): again, with the first sequence through the real blocks
        return _capture(model, blocks, calib, run_blocks=True)


def _capture(model: nn.Module, blocks: nn.ModuleList, calib: torch.LongTensor, run_blocks: bool) -> BlockInputs:
    record = BlockInputs(hidden=[], calls=[None] * len(blocks))
    originals = list(blocks)
    stop_at = [len(blocks) - 1]
    device = model.get_input_embeddings().weight.device
    try:
        for i in range(len(blocks)):
            blocks[i] = _Recorder(i, record, stop_at, originals[i], run_blocks)
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






# --------------------------------------------------------------------------- #
# Running blocks
# --------------------------------------------------------------------------- #








# --------------------------------------------------------------------------- #
# Transforms (AWQ / SmoothQuant)
# --------------------------------------------------------------------------- #
















# --------------------------------------------------------------------------- #
# Rounding and swapping
# --------------------------------------------------------------------------- #




















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
def _keep_fused_groups_whole(model: nn.Module, config: QuantConfig) -> QuantConfig:
    """``ignore`` of part of a fused group (q/k/v, gate/up) keeps the whole group in high precision,
    with a warning now, as ``fp4ptq quantize --ignore`` does (``save`` would refuse it after the work)."""
    import warnings

    from .checkpoint import fused_ignore_extra

    extra = fused_ignore_extra(model, config)
    if not extra:
        return config
    warnings.warn(f"QuantConfig.ignore keeps part of a fused group (q/k/v or gate/up share one GEMM and one "
                  f"scale in serving engines): also keeping {len(extra)} layer(s) in high precision, e.g. "
                  f"{', '.join(extra[:3])}", stacklevel=3)
    return replace(config, ignore=tuple(config.ignore) + tuple(extra))


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
    from .models import (
        ARCHITECTURES,
        check_against_table,
        check_decoder_only,
        discover_block,
        find_blocks,
        head_name,
    )

    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be an fp4ptq.QuantConfig, got {type(config).__name__}")
    check_decoder_only(model)
    config = _keep_fused_groups_whole(model, config)
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

    # Issue 43: rotations (the float model's function unchanged), then the parts kept in bf16 by measurement.
    # A family with a table takes its plan from the table; any other from what one probe forward shows.
    rotation_info = keep_info = None
    config_record = config
    tabled = spec is not None and layers_path == spec.layers
    if config.rotate is not None:
        head = head_name(model)
        if tabled:
            plan = rotation.plan_from_spec(model, spec, config.rotate_online, config.rotate_residual)
        else:
            probe = _probe_inputs(model, blocks)
            plan = rotation.plan_from_discovery(model, layers_path, blocks, probe.hidden[0], probe.calls,
                                                config.rotate_online, config.rotate_residual)
        rotation_info = rotation.rotate_model(model, plan, config.rotate,
                                              seed=config.seed if config.rotate_random else None, head=head)
    world = distributed.world()
    if config.keep_budget is not None:
        keep_info = sensitivity.choose(model, _keep_candidates(model, layers_path, blocks, config), calib, config,
                                       progress and world.main, comm_device=device, blocks=blocks)
        config = replace(config, ignore=config.ignore + tuple(keep_info["kept"]))

    # Block inputs: the calibration data's, or (no data needed) a short synthetic
    # sequence that only shows discovery each block's structure.
    if use_data:
        inputs = capture_sharded(model, blocks, calib, world)
        inputs.hidden = [h.to(device) for h in inputs.hidden]
        probe_inputs = None
    else:
        probe_inputs = _probe_inputs(model, blocks)
        inputs = None

    layers, smoothing_info, groups_info = {}, {}, {}
    bar = tqdm(range(len(blocks)), desc=f"fp4ptq {config.method} {config.scheme}", disable=not progress or not world.main,
               unit="block")
    with contextlib.ExitStack() as batching:
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
            if index == 0 and use_data and inputs.total > 1 and sequences_per_call(hidden.shape[1]) > 1:
                # blocks whose recorded arguments do not batch (ALiBi, strict masks): a sequence a call
                batching.enter_context(one_sequence_a_call(not batches_sequences(block, hidden, call)))
            if spec is not None and layers_path == spec.layers:
                check_against_table(plan, spec, f"{prefix} ({type(block).__name__})")
            for name, reason in plan.high.items():   # (linearize_model's reason for its experts stays)
                high.setdefault(_join(prefix, name), reason)
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

    if keep_info is not None:
        for name in keep_info["kept"]:
            high[name] = f"kept in bf16 by keep_budget {config_record.keep_budget} (KL increase measured)"
    kept_tensors = kept_parameters(model, high)
    model.fp4ptq_info = {
        "fp4ptq_version": __version__,
        "config": config_record.to_dict(),
        "calibration": calibration,
        "layers": layers,
        "high_precision": high,
        # every parameter tensor not quantized (norms, embeddings, biases, routers, sinks ...), with its reason
        "kept_tensors": kept_tensors,
        "smoothing": smoothing_info,
        "fused_groups": [[_join(p, n) for n in f] for p, gs in groups_info.items() for g in gs for f in g["fused"]],
        # Under torchrun every rank's peak (and share of sequences) too; like the run time it
        # stays out of the written report.
        "peak_memory": _peak_memory(device, world, len(inputs.hidden) if inputs else 0),
        "elapsed_s": round(time.perf_counter() - started, 3),
    }
    if rotation_info is not None:
        model.fp4ptq_info["rotation"] = rotation_info
    if keep_info is not None:
        model.fp4ptq_info["keep"] = keep_info
    return model


def _capture_router(store: list):
    """Forward hook on a Llama 4 router: ``(its input, scores, logits)`` of every call."""
    def hook(module, args, kwargs, out):
        x = args[0] if args else kwargs["hidden_states"]
        scores, logits = out[0], out[1]
        store.append((x.detach(), scores.detach(), logits.detach()))

    return hook


def kept_parameters(model: nn.Module, high: dict) -> dict:
    """``{tensor name: reason}`` for every tensor of ``model``'s state left in high precision: its
    parameters and persistent buffers (DeepSeek's ``e_score_correction_bias``), save those of the
    quantized linears, which are their NVFP4 form (their biases are named: kept as engines keep them).
    A tensor of a module in ``high`` takes that module's reason (or its nearest ancestor's); the rest
    theirs by kind (embedding, norm, attention sinks, ...). A tied tensor is named once, under its first
    name (as ``named_parameters`` gives it)."""
    from .modules import NVFP4Linear

    out, seen = {}, {}
    for mname, module in model.named_modules():
        quantized = isinstance(module, NVFP4Linear)
        tensors = list(module.named_parameters(recurse=False))
        if not quantized:
            tensors += [(n, b) for n, b in module.named_buffers(recurse=False)
                        if n not in module._non_persistent_buffers_set]
        for pname, p in tensors:
            full = _join(mname, pname)
            if id(p) in seen:
                out[seen[id(p)]] += f"; tied to {full}"
                continue
            seen[id(p)] = full
            parts = mname.split(".") if mname else []
            owner = next((k for k in [full] + [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
                          if k in high), None)   # the tensor, its module or the nearest ancestor in high
            out[full] = high[owner] if owner is not None else _kept_reason(module, pname, p, quantized)
    return out


def _kept_reason(module: nn.Module, pname: str, p: torch.Tensor, quantized_owner: bool) -> str:
    if quantized_owner:
        return "bias of a quantized linear (kept in high precision, as engines keep it)"
    if isinstance(module, nn.Embedding):
        return "token embedding (a table lookup, no matmul: kept in high precision)"
    if pname == "sinks":
        return "attention sinks (one logit per head, added in the softmax: kept in high precision)"
    if "correction_bias" in pname:
        return "router score-correction bias (it picks the experts: kept in high precision)"
    if p.dim() <= 1 and not list(module.children()):
        return f"norm or scale vector ({type(module).__name__}.{pname}, 1-D: kept in high precision)"
    return (f"{type(module).__name__}.{pname} {tuple(p.shape)}: not a linear weight nor an expert tensor "
            "(kept in high precision)")


def _probe_inputs(model: nn.Module, blocks: nn.ModuleList) -> BlockInputs:
    """The blocks' inputs on a short synthetic sequence (PROBE_TOKENS tokens): enough for discovery
    to see each block's structure."""
    vocab = model.get_input_embeddings().weight.shape[0]
    return capture_block_inputs(model, blocks, (torch.arange(PROBE_TOKENS) % vocab).unsqueeze(0))


def _keep_candidates(model: nn.Module, layers_path: str, blocks: nn.ModuleList, config: QuantConfig) -> dict:
    """The parts ``keep_budget`` chooses among: ``{part name: [(linear name, module), ...]}`` over the
    linears the run would quantize, as discovery finds them in each block. A fused set (q/k/v,
    gate/up: one weight global scale) is one part: engines fuse it into one GEMM of one format, so it
    is kept or quantized whole; with ``keep_unit="block"`` a part is a block."""
    from .models import discover_block, head_name
    from .nvfp4 import BLOCK_SIZE

    probe = _probe_inputs(model, blocks)
    out = {}
    for index, block in enumerate(blocks):
        prefix = f"{layers_path}.{index}"
        plan = discover_block(block, probe.hidden[0], probe.calls[index], probe=False)
        for group in plan.groups:
            quantized = set(_split_quantizable(block, group, config, prefix, {}))
            for rounding_set in group.rounding_sets():
                members = [(_join(prefix, n), block.get_submodule(n)) for n in rounding_set if n in quantized]
                if config.keep_unit == "block":
                    out.setdefault(prefix, []).extend(members)
                elif len(members) > 1:
                    out[f"{prefix}.{{{', '.join(n[len(prefix) + 1:] for n, _ in members)}}}"] = members
                else:
                    out.update({n: [(n, m)] for n, m in members})
    head = head_name(model)
    module = model.get_submodule(head) if head else None
    if isinstance(module, nn.Linear) and not config.is_ignored(head) and module.in_features % BLOCK_SIZE == 0:
        out[head] = [(head, module)]
    return out


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


@torch.no_grad()
def quantize_block(
    block: nn.Module, plan, config: QuantConfig, prefix: str, inputs: Optional[BlockInputs],
    index: int, device: torch.device, *, layers: dict, high: dict, smoothing_info: dict, spec=None,
) -> None:
    """One decoder block (already on ``device``) with its discovered ``plan``:
    statistics -> transforms -> rounding -> swap (experts streamed one at a time),
    then (with data) its quantized outputs replace ``inputs.hidden`` for the next
    block. Fills the three report dicts."""

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
        keep = config.search_nsamples if config.needs_samples else 0
        handles = []
        try:
            stats_list = []
            for g in plan.groups:
                if all(expert_of(n) for n in g.linears) and g.inspect is not None and expert_of(g.inspect or ""):
                    stats_list.append(None)   # one expert's down: its statistics come in the expert stream
                    continue
                if g.linears and expert_of(g.linears[0]) and experts[expert_of(g.linears[0])].input_scaled:
                    stats_list.append(None)   # Llama 4: each expert reads its own scaled copy: in the expert stream
                    if config.transform and g.why:
                        smoothing_info[_join(prefix, g.linears[0])] = {"skipped": g.why}
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
                if module.input_scaled:   # Llama 4: the router's input and scores (calibration_rows)
                    if name not in plan.routers:
                        raise UnsupportedArchitecture(
                            f"{prefix}.{name}: experts fed routing-scaled inputs (Llama 4's layout) need their "
                            "router beside them (a Linear(hidden, experts)); none was found")
                    router = block.get_submodule(plan.routers[name])
                    handles.append(router.register_forward_hook(_capture_router(captured[name]), with_kwargs=True))
                    continue
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
                elif scales is not None and any(plan.routers.get(name) in g.readers for name in experts):
                    raise AssertionError(f"{prefix}: smoothing folded into the input of a router whose experts "
                                         "read a scaled copy of it (the fold probe should have refused it)")
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
        # the group of the experts' shared input (their gate/up): its statistics serve moe_calib="all"
        shared = next((g for g in expert_groups
                       if any(expert_of(n) == name and not n.endswith(_down(module)) for n in g.linears)), None)
        layers.update(_quantize_experts(name, module, plan, stats.get(shared), members, captured[name],
                                        config, prefix, smoothing_info, use_data=inputs is not None,
                                        batch_keys=batch_keys, world=world, device=device))
        captured[name] = None
    if inputs is not None:
        stats = None  # free the Hessians and search samples before the next pass
        run_block(block, inputs.hidden, call, replace=True)




















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




__all__ = ["BlockInputs", "CalibrationError", "InputStats", "capture_block_inputs", "collect_input_stats",
           "quantize", "quantize_block", "quantize_group", "run_block", "smooth_group"]
