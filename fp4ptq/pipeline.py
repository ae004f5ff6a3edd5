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
"""
from __future__ import annotations

import contextlib
import copy
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import nn

from . import __version__, nvfp4
from .config import QuantConfig
from .methods import awq, smoothing, smoothquant
from .methods.gptq import gptq, hessian_update
from .methods.rtn import rtn
from .models import ArchSpec, InputGroup, arch_spec, decoder_blocks, set_module
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
    abs_sum: Optional[torch.Tensor] = None      # [in] fp32 sum |x|
    tokens: int = 0
    hessian: Optional[torch.Tensor] = None      # [in, in] fp32 sum x x^T
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
        self.abs_sum = asum if self.abs_sum is None else self.abs_sum.add_(asum)
        self.tokens += xf.shape[0]
        if self.hessian_wanted:
            self.hessian = hessian_update(self.hessian, x.detach())  # its dtype picks the matmul precision
        for seq in x.detach().split(1):  # x: [batch, T, in] -> sequences [1, T, in]
            if len(self.samples) >= self.keep_samples:
                break
            self.samples.append(seq.clone())

    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.tokens, 1)

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
    per_call = max(1, TOKENS_PER_CALL // max(1, sequences[0].shape[1])) if sequences else 1
    for start in range(0, len(sequences), per_call):
        chunk = sequences[start : start + per_call]
        yield start, start + len(chunk), torch.cat(chunk) if len(chunk) > 1 else chunk[0]


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
@torch.no_grad()
def smooth_group(
    block: nn.Module, group: InputGroup, stats: InputStats, config: QuantConfig, call: tuple
) -> dict:
    """Search the group's smoothing scales (AWQ ratio or SmoothQuant alpha) on
    the block-output error of ``group.inspect`` over ``stats.samples``, fold
    them, and rescale ``stats``. Returns what was chosen (for the report)."""
    prev = block.get_submodule(group.prev)
    linears = [block.get_submodule(n) for n in group.linears]
    if not all(type(lin) is nn.Linear for lin in linears) or not smoothing.can_fold(prev, linears):
        return {"skipped": "scales cannot be folded (channel counts differ, e.g. grouped-query v -> o)"}
    inspect = block.get_submodule(group.inspect)
    args, kwargs = call

    def run(x):
        return _first(inspect(x, **kwargs) if group.inspect_kwargs else inspect(x))

    batches = [batch for _, _, batch in _batches(stats.samples)]
    reference = [run(x).float() for x in batches]
    count = sum(r.numel() for r in reference)

    def loss(s: torch.Tensor) -> float:
        act_amax = (stats.absmax / s).max() if config.scheme == "w4a4" else None
        with smoothing.simulated_quantized(linears, s, four_six=config.four_six, act_amax=act_amax):
            return sum(float((run(x).float() - r).pow(2).sum()) for x, r in zip(batches, reference)) / count

    identity = torch.ones_like(stats.absmax)
    if config.transform == "awq":
        key, s, losses = smoothing.search_scales(awq.awq_candidates(stats.mean_abs(), config.awq_grid), loss)
        record = {"awq_ratio": key}
    else:
        alphas = config.smoothquant_alphas if config.smoothquant_alpha is None else (config.smoothquant_alpha,)
        w_absmax = smoothquant.weight_channel_absmax(linears)
        candidates = list(smoothquant.smoothquant_candidates(stats.absmax, w_absmax, alphas))
        if config.smoothquant_alpha is None:
            candidates.append((None, identity))  # the search may also decline to smooth
        key, s, losses = smoothing.search_scales(candidates, loss)
        record = {"smoothquant_alpha": key}
    record["loss"] = losses[key]
    record["loss_unsmoothed"] = losses.get(0.0 if config.transform == "awq" else None)
    if key is not None and not torch.equal(s, identity):
        smoothing.fold_scales(prev, linears, s)
        stats.rescale(s)
    return record


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
    spec: ArchSpec,
    group: InputGroup,
    members: list,
    stats: Optional[InputStats],
    config: QuantConfig,
    prefix: str,
) -> dict:
    """Round the group's quantizable linears ``members`` (names), swap them for
    ``NVFP4Linear``; returns their ``fp4ptq_info["layers"]`` entries."""
    linears = [block.get_submodule(n) for n in members]
    originals = [lin.weight.detach().float().clone() for lin in linears]
    # One global scale per fused group, fixed before clipping and rounding.
    shared = smoothing.group_weight_amax(linears) if group.fused else None
    amaxes = [shared if group.fused else nvfp4.tensor_amax(w) for w in originals]
    weights = list(originals)
    if config.transform == "awq" and config.awq_clip and stats is not None and stats.samples:
        x = _clip_tokens(stats.samples)
        for i, name in enumerate(members):
            if name not in spec.no_clip:
                weights[i] = awq.awq_clip(weights[i], x, four_six=config.four_six, amax=amaxes[i])

    names = [_join(prefix, n) for n in members]
    if config.rounding == "gptq":
        gptq_kwargs = dict(
            four_six=config.four_six, damp=config.gptq_damp, block_size=config.gptq_block_size,
            act_order=config.gptq_act_order, scale_choice=config.gptq_scale_choice,
        )
        if group.fused:  # same input, same Hessian, same global scale: one GPTQ over stacked rows
            q_all = gptq(torch.cat(weights), stats.hessian, amax=shared, name=" + ".join(names), **gptq_kwargs)
            bounds = torch.tensor([0] + [w.shape[0] for w in weights]).cumsum(0).tolist()
            qs = [_rows(q_all, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        else:
            qs = [gptq(w, stats.hessian, amax=a, name=n, **gptq_kwargs) for w, a, n in zip(weights, amaxes, names)]
    else:
        qs = [rtn(w, four_six=config.four_six, amax=a, name=n) for w, a, n in zip(weights, amaxes, names)]

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
    """The group's linears to quantize; the others go to ``high`` with the reason."""
    members = []
    for name in group.linears:
        full, lin = _join(prefix, name), block.get_submodule(name)
        if config.is_ignored(full):
            high[full] = "ignored by QuantConfig.ignore"
        elif not isinstance(lin, nn.Linear):
            high[full] = f"not an nn.Linear ({type(lin).__name__})"
        elif lin.in_features % BLOCK_SIZE:
            high[full] = f"in_features={lin.in_features} is not a multiple of {BLOCK_SIZE}"
            warnings.warn(f"fp4ptq: keeping {full} in high precision: {high[full]}", stacklevel=3)
        else:
            members.append(name)
    return members


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

    Quantized ``nn.Linear``s become ``NVFP4Linear``; ``model.fp4ptq_info``
    records the config, calibration and per-layer errors.
    """
    from tqdm.auto import tqdm

    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be an fp4ptq.QuantConfig, got {type(config).__name__}")
    started = time.perf_counter()
    spec = arch_spec(model)
    blocks = decoder_blocks(model, spec)
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

    block_prefix = spec.layers
    home = next(model.parameters()).device
    device = torch.device(device) if device is not None else home
    use_data = calib is not None and config.needs_calibration

    inputs = None  # without data (RTN W4A16) no block is ever run
    if use_data:
        inputs = capture_block_inputs(model, blocks, calib)
        inputs.hidden = [h.to(device) for h in inputs.hidden]

    layers, high, smoothing_info = {}, {}, {}
    bar = tqdm(range(len(blocks)), desc=f"fp4ptq {config.method} {config.scheme}", disable=not progress, unit="block")
    for index in bar:
        block = blocks[index]
        block_home = next(block.parameters()).device
        block.to(device)
        quantize_block(block, spec, config, f"{block_prefix}.{index}", inputs, index, device,
                       layers=layers, high=high, smoothing_info=smoothing_info)
        block.to(block_home)

    layers.update(_quantize_head(model, spec, config, inputs, device, high, use_data))
    for name, module in model.named_modules():
        if type(module) is nn.Linear and name not in high and not name.startswith(block_prefix + "."):
            high[name] = "outside the decoder blocks and not the LM head (no table entry in fp4ptq/models.py)"

    model.fp4ptq_info = {
        "fp4ptq_version": __version__,
        "config": config.to_dict(),
        "calibration": calibration,
        "layers": layers,
        "high_precision": high,
        "smoothing": smoothing_info,
        "elapsed_s": round(time.perf_counter() - started, 3),
    }
    return model


@torch.no_grad()
def quantize_block(
    block: nn.Module, spec: ArchSpec, config: QuantConfig, prefix: str, inputs: Optional[BlockInputs],
    index: int, device: torch.device, *, layers: dict, high: dict, smoothing_info: dict,
) -> None:
    """One decoder block (already on ``device``): statistics -> transforms ->
    rounding -> swap, then (with data) its quantized outputs replace
    ``inputs.hidden`` for the next block. Fills the three report dicts."""
    members = {g: _split_quantizable(block, g, config, prefix, high) for g in spec.groups}
    stats = dict.fromkeys(spec.groups)
    if inputs is not None:
        call = _to_device(inputs.calls[index], device)
        keep = config.search_nsamples if config.transform else 0
        with collect_input_stats(
            block, spec.groups, prefix, hessian=config.rounding == "gptq", keep_samples=keep
        ) as stats_list:
            run_block(block, inputs.hidden, call, replace=False)
        stats = dict(zip(spec.groups, stats_list))
        if config.transform:
            for group in spec.groups:
                smoothing_info[f"{prefix}.{group.linears[0]}"] = smooth_group(block, group, stats[group], config, call)
    for group in spec.groups:
        if members[group]:
            layers.update(quantize_group(block, spec, group, members[group], stats[group], config, prefix))
    if inputs is not None:
        stats = stats_list = None  # free the Hessians and search samples before the next pass
        run_block(block, inputs.hidden, call, replace=True)
    _record_stray_linears(block, spec, prefix, high)


def _record_stray_linears(block: nn.Module, spec: ArchSpec, prefix: str, high: dict) -> None:
    """Linears inside a block that the architecture table does not name stay in high precision."""
    known = set(spec.linear_names())
    for name, module in block.named_modules():
        if type(module) is nn.Linear and name not in known:
            high[f"{prefix}.{name}"] = "not named in fp4ptq/models.py's table for this architecture"


@torch.no_grad()
def _quantize_head(model, spec: ArchSpec, config: QuantConfig, inputs, device, high: dict, use_data: bool) -> dict:
    """Round the LM head (no smoothing) on the final norm's outputs, unless ignored."""
    try:
        head = model.get_submodule(spec.head)
    except AttributeError:
        return {}
    if config.is_ignored(spec.head):
        high[spec.head] = "ignored by QuantConfig.ignore"
        return {}
    group = InputGroup((spec.head,), spec.final_norm, spec.head)
    members = _split_quantizable(model, group, config, "", high)
    if not members:
        return {}
    norm = model.get_submodule(spec.final_norm)
    homes = [next(m.parameters()).device for m in (norm, head)]
    norm.to(device)
    # A copy on the device: the head's weight may be tied to the input embedding,
    # which must not follow it there.
    set_module(model, spec.head, copy.deepcopy(head).to(device))
    stats = None
    if use_data:
        stats = InputStats(spec.head, hessian_wanted=config.rounding == "gptq")
        for h in inputs.hidden:
            stats.update(norm(h))
    entries = quantize_group(model, spec, group, members, stats, _no_transform(config), "")
    norm.to(homes[0])
    model.get_submodule(spec.head).to(homes[1])
    return entries


def _no_transform(config: QuantConfig) -> QuantConfig:
    """The config with its transform dropped (the head is only rounded)."""
    method = {"awq": "rtn", "smoothquant": "rtn", "awq+gptq": "gptq", "smoothquant+gptq": "gptq"}.get(config.method, config.method)
    return QuantConfig(**{**config.to_dict(), "method": method})


__all__ = ["BlockInputs", "CalibrationError", "InputStats", "capture_block_inputs", "collect_input_stats",
           "quantize", "quantize_block", "quantize_group", "run_block", "smooth_group"]
