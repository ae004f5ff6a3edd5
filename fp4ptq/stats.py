"""Calibration statistics of one input tensor (``InputStats``: max and mean |x| per channel, the
GPTQ Hessian, a few sequences for the searches), the scoped hooks that collect them, and running a
decoder block over the calibration sequences in batches."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import nn

from . import distributed
from .methods.gptq import hessian_update
from .nvfp4 import NVFP4Error

# Calibration sequences are run through a block in batches of about this many
# tokens (fewer, larger calls; the batch's activations stay small next to the block).
TOKENS_PER_CALL = 8192


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


_ONE_SEQUENCE_A_CALL = [False]   # set by ``one_sequence_a_call`` for models whose blocks do not batch


def sequences_per_call(seqlen: int) -> int:
    """Sequences per batch (counted from the run's first sequence on every rank)."""
    return 1 if _ONE_SEQUENCE_A_CALL[0] else max(1, TOKENS_PER_CALL // max(1, seqlen))


def batches_sequences(block: nn.Module, hidden: torch.Tensor, call: tuple) -> bool:
    """Whether ``block`` runs two copies of ``hidden [1, T, d]`` at once with its recorded call
    arguments (recorded for one sequence: rotary tables and masks broadcast over a batch in most
    families; ALiBi tables of ``[heads, 1, T]`` or masks checked against the batch do not)."""
    args, kwargs = call
    try:
        _first(block(torch.cat([hidden, hidden]), *args, **kwargs))
    except (RuntimeError, ValueError, IndexError):
        return False
    return True


@contextlib.contextmanager
def one_sequence_a_call(on: bool):
    """Within it, blocks and searches run one calibration sequence a call when ``on``."""
    before = _ONE_SEQUENCE_A_CALL[0]
    _ONE_SEQUENCE_A_CALL[0] = on
    try:
        yield
    finally:
        _ONE_SEQUENCE_A_CALL[0] = before


@torch.no_grad()
def run_block(block: nn.Module, hidden: list, call: tuple, *, replace: bool) -> None:
    """Run ``block`` on every sequence (outputs replace ``hidden`` in place when ``replace``)."""
    args, kwargs = call
    for start, stop, batch in _batches(hidden):
        out = _first(block(batch, *args, **kwargs))
        if replace:
            hidden[start:stop] = list(out.split(1))


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


def _capture_experts(store: list):
    def hook(module, args, kwargs):
        names = ("hidden_states", "top_k_index", "top_k_weights")
        values = list(args[:3]) + [kwargs.get(n) for n in names[len(args[:3]):]]
        store.append(tuple(v.detach() for v in values))

    return hook


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


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
