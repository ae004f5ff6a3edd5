"""Mixture-of-Experts experts as one linear layer per expert projection.

transformers 5 stores a layer's routed experts as 3-D parameters
(``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, or transposed, with
gate and up concatenated or interleaved; see ``transformers.integrations.moe``).
NVFP4 checkpoints store every expert projection as a tensor of its own, under
the names of the original per-expert checkpoint (``experts.3.gate_proj`` or
Mixtral's ``experts.3.w1``), and engines (vLLM's compressed-tensors MoE loader)
read them so.

``LinearExperts`` holds the same weights as one ``ExpertMLP`` (gate, up, down
``nn.Linear``) per expert and computes the same function as the module it
replaces: every method, the packer, the checkpoint writer and the loader then
see ordinary linears (quantized: ``NVFP4Linear``), named as engines expect.

Calibration: with ``calibrate_all`` set, every expert also runs on every token
(so its statistics and Hessians see all calibration data), while the layer's
output still follows the real routing.

Two calling conventions: transformers 5's ``forward(hidden [T, H], top_k_index,
top_k_weights)`` (the routing weights scale the experts' outputs), and Llama 4's
``forward(routed_in [E * T, H])``: the caller (``Llama4TextMoe``) has already
scaled every token's copy for expert ``e`` by its routing score (zero where the
router did not pick ``e``: top-1 sigmoid), so the weights act on the experts'
*input* (vLLM: ``apply_router_weight_on_input``). Its tensors are transposed
(``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``), gate and up concatenated,
and its gating is ``act_fn(gate) * up`` without an ``_apply_gate``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

# Names of the per-expert projections when transformers has no conversion table
# for the model type (its checkpoints then store 3-D tensors): the names most
# per-expert checkpoints use.
DEFAULT_NAMES = ("gate_proj", "up_proj", "down_proj")


class UnsupportedExperts(ValueError):
    """An experts module whose layout LinearExperts does not reproduce."""


class ExpertMLP(nn.Module):
    """One expert: ``down(apply_gate(gate_up(x)))`` with gate, up and down as linears."""

    def __init__(self, names: tuple, hidden: int, inter: int, bias: bool, dtype=None, device=None) -> None:
        super().__init__()
        self.names = names
        gate, up, down = names
        kw = dict(dtype=dtype, device=device)
        self.add_module(gate, nn.Linear(hidden, inter, bias=bias, **kw))
        self.add_module(up, nn.Linear(hidden, inter, bias=bias, **kw))
        self.add_module(down, nn.Linear(inter, hidden, bias=bias, **kw))

    def projections(self) -> tuple:
        return tuple(getattr(self, n) for n in self.names)


class LinearExperts(nn.ModuleList):
    """Per-expert linears with the forward of transformers' experts modules:
    ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.

    ``apply_gate`` is the replaced module's gating (``act(gate) * up`` by default,
    gpt-oss' clamped SwiGLU), ``concatenated`` whether its gate_up output is
    ``[gate | up]`` (else interleaved ``gate0, up0, gate1, ...``)."""

    def __init__(self, experts: list, gating: nn.Module, concatenated: bool, num_experts: int,
                 input_scaled: bool = False) -> None:
        super().__init__(experts)
        # The replaced module, stripped of its weights: its _apply_gate (and act_fn,
        # limits) is the gating; kept out of the module tree (it holds no tensors we save).
        object.__setattr__(self, "_gating", gating)
        self.concatenated = concatenated
        self.num_experts = num_experts
        self.calibrate_all = False
        # Llama 4: forward(routed_in [E * T, H]), the routing scores applied to the input by the caller
        self.input_scaled = input_scaled

    def apply_gate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.concatenated:
            gate_up = torch.cat([gate, up], dim=-1)
        else:
            gate_up = torch.stack([gate, up], dim=-1).flatten(-2)
        apply = getattr(self._gating, "_apply_gate", None)
        if apply is None:   # Llama 4's experts: act_fn(gate) * up, no _apply_gate
            return self._gating.act_fn(gate) * up
        return apply(gate_up)

    def expert_forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self[index].projections()
        return down(self.apply_gate(gate(x), up(x)))

    def forward(self, hidden_states: torch.Tensor, top_k_index: Optional[torch.Tensor] = None,
                top_k_weights: Optional[torch.Tensor] = None, *args, **kwargs) -> torch.Tensor:
        if self.input_scaled:
            return self._input_scaled_forward(hidden_states)
        if hidden_states.is_cuda and self.grouped:
            out = self.grouped_forward(hidden_states, top_k_index, top_k_weights)
            if out is not None:
                return out
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # [E, k, T]: which (slot, token) pairs route to each expert; indices outside
            # [0, E) (transformers' masking of dropped slots) select nothing.
            dropped = (top_k_index < 0) | (top_k_index >= self.num_experts)
            index = top_k_index.masked_fill(dropped, self.num_experts)
            hits = torch.nn.functional.one_hot(index, self.num_experts + 1)
            hits = hits.permute(2, 1, 0)[: self.num_experts]
            active = hits.flatten(1).any(1).nonzero().flatten().tolist()
        experts = range(self.num_experts) if self.calibrate_all else active
        for e in experts:
            slot, token = torch.where(hits[e])
            if self.calibrate_all:   # every token through the expert (what discovery observes) ...
                self.expert_forward(e, hidden_states)
            if token.numel():   # ... and the output from its routed tokens alone, bit for bit the routed one
                y = self.expert_forward(e, hidden_states[token])
                y = y * top_k_weights[token, slot, None]
                out.index_add_(0, token, y.to(out.dtype))
        return out

    def _input_scaled_forward(self, routed_in: torch.Tensor) -> torch.Tensor:
        """Llama 4: ``routed_in [E * T, H]`` holds, expert by expert, every token scaled by its
        routing score for that expert (zero where it was not picked). Each expert runs on its
        picked rows (a zero row gives zero: no bias, ``act(0) * 0 = 0``). Under ``calibrate_all``
        (discovery's forward) an expert picked by no token still runs, on its zero rows, so that
        every expert is seen; the output is unchanged (the statistics come from ``calibration_rows``)."""
        hidden = routed_in.shape[-1]
        x = routed_in.reshape(self.num_experts, -1, hidden)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            with torch.no_grad():
                rows = (x[e] != 0).any(-1).nonzero().flatten()
            if rows.numel():
                out[e].index_copy_(0, rows, self.expert_forward(e, x[e][rows]).to(out.dtype))
            elif self.calibrate_all:
                self.expert_forward(e, x[e])   # zero rows: zero output
        return out.reshape(routed_in.shape)

    def calibration_rows(self, call: tuple, expert: int, routed: bool) -> torch.Tensor:
        """The inputs ``[n, H]`` expert ``expert`` sees in one captured call: its routed tokens
        (``routed``) or every token. ``call`` is the experts' own ``(hidden, top_k_index,
        top_k_weights)``; for Llama 4 (``input_scaled``) the router's ``(hidden, scores, logits)``:
        the routed rows scaled by their scores (as the model feeds them), and under "all" every
        token scaled by ``sigmoid(logit)``, the score it would get were the expert picked."""
        x = call[0].reshape(-1, call[0].shape[-1])
        if self.input_scaled:
            scores, logits = (t.reshape(-1, self.num_experts) for t in call[1:3])
            if routed:
                rows = (scores[:, expert] != 0).nonzero().flatten()
                return x[rows] * scores[rows, expert, None]
            return x * torch.sigmoid(logits[:, expert].float()).to(x.dtype)[:, None]
        if routed:
            return x[(call[1].reshape(x.shape[0], -1) == expert).any(-1)]
        return x

    def routed_counts(self, call: tuple) -> list:
        """Routed tokens per expert in one captured call (the same ``call`` as ``calibration_rows``)."""
        if self.input_scaled:
            return (call[1].reshape(-1, self.num_experts) != 0).sum(0).tolist()
        return torch.bincount(call[1].reshape(-1).long(), minlength=self.num_experts).tolist()

    # ------------------------------------------------------------------ #
    # NVFP4 experts on CUDA: two grouped launches (fp4ptq/kernels/grouped.py) instead of the loop
    # ------------------------------------------------------------------ #
    grouped = True   # set False to keep the loop over experts on CUDA too
    _stacked = None  # (held, w13, w2): the experts' buffers stacked (theirs are views of it); w13 None: not groupable
    _gate = None     # what the grouped path gates with: fused_gating() or apply_gate, found at the first call

    def grouped_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> Optional[torch.Tensor]:
        """``forward`` through the grouped NVFP4 kernel, or None where it does not apply: off CUDA,
        calibrating, under ``torch.compile``, where a gradient is asked for, with non-16-bit activations,
        or unless every expert projection is an ``NVFP4Linear`` (one scheme and Four Over Six rule, not
        fused by ``fusion.py``, gate and up of each expert sharing their global scales). The result
        equals the loop's up to fp32 summation order (the dense kernels' tolerance)."""
        if (self.calibrate_all or self.input_scaled or torch.compiler.is_compiling() or hidden_states.dim() != 2
                or hidden_states.dtype not in (torch.bfloat16, torch.float16)
                or (hidden_states.requires_grad and torch.is_grad_enabled())):
            return None
        stacked = self._stacked_weights(hidden_states.device)
        if stacked is None:
            return None
        from . import kernels

        if self._gate is None:
            object.__setattr__(self, "_gate", self.fused_gating() or self.apply_gate)
        return kernels.moe_experts(hidden_states, top_k_index, top_k_weights, stacked[1], stacked[2], self._gate)

    def fused_gating(self) -> Optional[str]:
        """"silu" where the replaced module's gating is transformers' default (``act_fn(gate) * up`` on
        ``[gate | up]``, not overridden) with a SiLU ``act_fn``: the grouped path then fuses it
        (``kernels.grouped.swiglu``); else None, and the grouped path calls ``apply_gate``."""
        try:
            from transformers.activations import SiLUActivation
            from transformers.integrations.moe import _default_apply_gate
        except ImportError:  # a transformers without them: the module's own gating
            return None
        gating = self._gating
        default = getattr(type(gating), "_apply_gate", None) is _default_apply_gate and "_apply_gate" not in vars(gating)
        silu = isinstance(getattr(gating, "act_fn", None), (nn.SiLU, SiLUActivation))
        return "silu" if self.concatenated and default and silu else None

    def _stacked_weights(self, device: torch.device):
        """(held, w13, w2) ``grouped.StackedWeight`` of the experts, built at the first call: each expert's
        gate rows over its up rows (w13), its down rows (w2). The packed codes and block scales move into
        the stacks and every expert's buffers become views of them (no memory added; in-place writes to
        codes and scales, e.g. ``load_state_dict``, reach both). Built again when any expert, projection,
        code, scale or global-scale tensor was replaced since (``.to()`` of one expert, a module swapped;
        ``.to()`` of this module and its ``load_state_dict`` drop the stacks at once: global scales and
        biases are copies in them). A layer that cannot be grouped is asked again after such a change."""
        from .modules import NVFP4Linear

        if not len(self) or not isinstance(self[0].projections()[0], NVFP4Linear):
            return None  # (not quantized: answered without looking at every expert)
        cached = self._stacked
        if cached is not None and self._still_held(cached[0]):
            return cached if cached[1] is not None else None
        self._stacked = (self._holding(), None, None)  # (until stacked: not groupable)
        projections = [mlp.projections() for mlp in self]
        linears = [p for ps in projections for p in ps]
        if not linears or not all(isinstance(p, NVFP4Linear) and p._fused is None for p in linears):
            return None
        spec = {(p.scheme, p.act_four_six, p.bias is not None, p.weight_packed.device) for p in linears}
        if len(spec) != 1 or next(iter(spec))[3] != device:
            return None
        scheme, four_six, has_bias, _ = next(iter(spec))
        with torch.no_grad():
            for gate, up, _down in projections:
                if not torch.equal(gate.weight_global_scale, up.weight_global_scale) or (
                        scheme == "w4a4" and not torch.equal(gate.input_global_scale, up.input_global_scale)):
                    return None
            w13 = self._stack([(g, u) for g, u, _ in projections], scheme, four_six, has_bias)
            w2 = self._stack([(d,) for _, _, d in projections], scheme, four_six, has_bias)
        self._stacked = (self._holding(), w13, w2)  # (the buffers are views of the stacks now)
        return self._stacked

    def _holding(self) -> tuple:
        """What the stacks were built from: the experts and, per projection, the module, its buffers and
        the tensors in them (identities, checked by ``_still_held``)."""
        experts = tuple(self._modules.values())
        held = []
        for mlp in experts:
            for name in mlp.names:
                m = mlp._modules.get(name)
                b = getattr(m, "_buffers", {})
                held.append((mlp._modules, name, m, b, b.get("weight_packed"), b.get("weight_scale"),
                             b.get("weight_global_scale")))
        return experts, held

    def _still_held(self, holding: tuple) -> bool:
        experts, held = holding
        return (len(experts) == len(self._modules) and all(a is b for a, b in zip(self._modules.values(), experts))
                and all(d.get(n) is m and b.get("weight_packed") is p and b.get("weight_scale") is s
                        and b.get("weight_global_scale") is g for d, n, m, b, p, s, g in held))

    @staticmethod
    def _stack(groups: list, scheme: str, four_six, has_bias: bool):
        """One ``StackedWeight`` over ``groups`` (one tuple of NVFP4Linears a expert, their rows
        concatenated); the members' codes and scales become views of it."""
        from .kernels.grouped import StackedWeight

        packed = torch.stack([torch.cat([m.weight_packed for m in g]) for g in groups])
        scale = torch.stack([torch.cat([m.weight_scale for m in g]) for g in groups])
        enc = torch.cat([g[0].weight_global_scale.float().reshape(1) for g in groups])
        bias = torch.stack([torch.cat([m.bias for m in g]) for g in groups]) if has_bias else None
        amax = torch.cat([g[0].input_amax().reshape(1) for g in groups]) if scheme == "w4a4" else None
        for e, g in enumerate(groups):
            row = 0
            for m in g:
                m._buffers["weight_packed"] = packed[e, row:row + m.out_features]
                m._buffers["weight_scale"] = scale[e, row:row + m.out_features]
                m._plans = None
                m._decoded = None
                row += m.out_features
        return StackedWeight(packed, scale, enc, bias, amax, four_six if scheme == "w4a4" else None)

    def _apply(self, fn, recurse=True):
        self._stacked = None  # the buffers are replaced: stack them again at the next CUDA call
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._stacked = None  # global scales and biases are copies in the stacks
        return super()._load_from_state_dict(*args, **kwargs)

    def __getstate__(self):
        state = super().__getstate__()
        state["_stacked"] = None
        return state


def is_experts_module(module: nn.Module) -> bool:
    """transformers' 3-D experts (its ``use_experts_implementation`` classes, and
    any module holding ``gate_up_proj``/``down_proj`` as 3-D parameters)."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3 and down.dim() == 3)


def expert_names(model: nn.Module) -> tuple:
    """(gate, up, down) projection names of the original per-expert checkpoint,
    from transformers' conversion table for the model type (the sources it
    merges into ``experts.gate_up_proj`` and ``experts.down_proj``)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter

        conversions = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # noqa: BLE001 - older transformers: no table
        return DEFAULT_NAMES

    def projection(pattern: str) -> Optional[str]:
        # ".experts.*.w1.weight" -> "w1"
        head, star, tail = pattern.partition(".*.")
        return tail.removesuffix(".weight") if star and tail.endswith(".weight") else None

    gate = up = down = None
    for conv in conversions:
        if not isinstance(conv, WeightConverter):
            continue
        targets = getattr(conv, "_original_target_patterns", None) or conv.target_patterns
        sources = getattr(conv, "_original_source_patterns", None) or conv.source_patterns
        target = targets[0] if isinstance(targets, (list, tuple)) else targets
        sources = list(sources) if isinstance(sources, (list, tuple)) else [sources]
        names = [projection(s) for s in sources]
        if target.endswith("experts.gate_up_proj") and len(names) == 2 and all(names):
            gate, up = names
        elif target.endswith("experts.down_proj") and len(names) == 1 and names[0]:
            down = names[0]
    if gate and up and down:
        return gate, up, down
    return DEFAULT_NAMES


def _layout(module: nn.Module) -> tuple:
    """(transposed, concatenated, has_bias, input_scaled) of a transformers experts module."""
    if getattr(module, "has_gate", True) is False or getattr(module, "has_post_expert_norm", False):
        raise UnsupportedExperts(
            f"{type(module).__name__}: experts without a gate projection or with a post-expert norm are not "
            "supported yet; they stay in high precision")
    has_bias = isinstance(getattr(module, "gate_up_proj_bias", None), torch.Tensor)
    if not hasattr(module, "_apply_gate"):
        if _is_input_scaled(module) and not has_bias:
            return True, True, False, True
        raise UnsupportedExperts(
            f"{type(module).__name__} has no _apply_gate and is not Llama 4's layout (forward(routed_in) with "
            "gate_up_proj [E, H, 2I], down_proj [E, I, H], act_fn, no biases); its experts stay in high precision")
    transposed = bool(getattr(module, "is_transposed", False))
    concatenated = bool(getattr(module, "is_concatenated", True))
    return transposed, concatenated, has_bias, False


def _is_input_scaled(module: nn.Module) -> bool:
    """Llama 4's experts (``Llama4TextExperts``): ``forward(hidden_states)`` alone (the caller
    scales each expert's input by its routing score), an ``act_fn``, gate_up ``[E, H, 2I]``
    (gate then up) and down ``[E, I, H]``."""
    import inspect

    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    gate_up, down = module.gate_up_proj, module.down_proj
    return (len(params) == 1 and callable(getattr(module, "act_fn", None))
            and gate_up.shape[0] == down.shape[0] and gate_up.shape[1] == down.shape[2]
            and gate_up.shape[2] == 2 * down.shape[1])


@torch.no_grad()
def linearize(module: nn.Module, names: tuple = DEFAULT_NAMES, *, device=None) -> LinearExperts:
    """A ``LinearExperts`` with ``module``'s weights (copied expert by expert; the
    3-D parameters are released from ``module``). ``device="meta"`` builds an
    empty one (for loading a checkpoint)."""
    transposed, concatenated, has_bias, input_scaled = _layout(module)
    gate_up, down = module.gate_up_proj, module.down_proj
    num = gate_up.shape[0]
    # [E, 2I, H] (or [E, H, 2I] transposed) and [E, H, I] (or [E, I, H])
    hidden = gate_up.shape[2] if not transposed else gate_up.shape[1]
    inter = (gate_up.shape[1] if not transposed else gate_up.shape[2]) // 2
    dtype = gate_up.dtype
    meta = device == "meta" or gate_up.is_meta
    target = torch.device("meta") if meta else gate_up.device
    experts = []
    for e in range(num):
        mlp = ExpertMLP(names, hidden, inter, has_bias, dtype=dtype, device=target)
        if not meta:
            w_gu = gate_up[e].t() if transposed else gate_up[e]       # [2I, H]
            w_d = down[e].t() if transposed else down[e]              # [H, I]
            gate, up = (w_gu[:inter], w_gu[inter:]) if concatenated else (w_gu[0::2], w_gu[1::2])
            g, u, d = mlp.projections()
            g.weight.copy_(gate)
            u.weight.copy_(up)
            d.weight.copy_(w_d)
            if has_bias:
                b_gu, b_d = module.gate_up_proj_bias[e], module.down_proj_bias[e]
                bg, bu = (b_gu[:inter], b_gu[inter:]) if concatenated else (b_gu[0::2], b_gu[1::2])
                g.bias.copy_(bg)
                u.bias.copy_(bu)
                d.bias.copy_(b_d)
        experts.append(mlp)
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        if name in module._parameters:
            del module._parameters[name]
    return LinearExperts(experts, module, concatenated, num, input_scaled)


def linearize_model(model: nn.Module, *, device=None) -> dict:
    """Replace every 3-D experts module of ``model`` by a ``LinearExperts`` (in
    place). Returns ``{module name: reason}`` for experts modules left as they
    are (a layout not supported), so the caller can report them."""
    names = expert_names(model)
    kept = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, LinearExperts) or not is_experts_module(module):
            continue
        try:
            new = linearize(module, names, device=device)
        except UnsupportedExperts as exc:
            kept[name] = str(exc)
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return kept


def expert_linear_names(model: nn.Module) -> list:
    """Full names of every expert projection linear in ``model``."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, LinearExperts):
            for e, mlp in enumerate(module):
                out.extend(f"{name}.{e}.{n}" for n in mlp.names)
    return out


__all__ = ["DEFAULT_NAMES", "ExpertMLP", "LinearExperts", "UnsupportedExperts", "expert_linear_names",
           "expert_names", "is_experts_module", "linearize", "linearize_model"]
