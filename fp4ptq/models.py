"""Architecture knowledge, found from the model itself.

* The decoder blocks: the ``nn.ModuleList`` of repeated blocks (transformers'
  ``_no_split_modules`` names their class).
* Per block, by observation during one forward (``discover_block``): which
  linears (and which other modules, such as a Mixture-of-Experts router) read
  the same tensor, which module produced it, and where a smoothing scale folds
  exactly (checked by folding a random scale and comparing the block's output).
* Mixture-of-Experts expert tensors are made linears first (``fp4ptq.experts``).

Per-family tables (``ARCHITECTURES``) are kept as a check: for a family with a
table, what discovery finds must agree with it, so a wrong table (or a changed
transformers model) fails loudly.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from torch import nn

class UnsupportedArchitecture(ValueError):
    """The model's architecture has no table in fp4ptq/models.py."""


@dataclass(frozen=True)
class InputGroup:
    """Linears of one decoder block that read the same input tensor.

    linears: names relative to the block, e.g. ("self_attn.q_proj", ...).
    prev:    the module whose output (per channel) is that input, so smoothing
             scales ``s`` fold into it (its output divided by ``s``, the
             linears' input columns multiplied by ``s``): a norm, or a linear
             whose outputs reach the input channel for channel (v -> o, up -> down).
    inspect: the smallest module whose output the AWQ/SmoothQuant searches
             compare (it contains the linears and takes the same input).
    fused:   engines fuse these linears into one GEMM, so they share one
             weight global scale (one amax over the group).
    inspect_kwargs: ``inspect`` needs the block's keyword inputs (attention:
             position embeddings, mask); otherwise it is called on the input alone.
    """

    linears: tuple
    prev: Optional[str]
    inspect: Optional[str]      # "" = the block itself; None = no module takes exactly this input
    fused: bool = False
    inspect_kwargs: bool = False
    # Found by discovery (``discover_block``):
    fused_sets: tuple = ()      # tuples of linears sharing one weight global scale (q/k/v, gate/up, one expert's gate/up)
    readers: tuple = ()         # other modules reading the tensor that take the compensating scale (MoE routers)
    fold: Optional[str] = None  # how scales fold into prev: "linear", "norm" (w / s), "norm_offset" ((1 + w) / s - 1)
    why: Optional[str] = None   # why scales cannot fold here (the group is then quantized unsmoothed)

    def rounding_sets(self) -> list:
        """The linears in sets that share one weight global scale (singletons for the rest)."""
        sets = [tuple(s) for s in self.fused_sets] if self.fused_sets else (
            [tuple(self.linears)] if self.fused else [])
        covered = {n for s in sets for n in s}
        return sets + [(n,) for n in self.linears if n not in covered]


@dataclass(frozen=True)
class ArchSpec:
    """Where things are in a decoder-only model of one family.

    layers: dotted path of the decoder-block ModuleList in the CausalLM model.
    groups: the block's InputGroups, in forward order.
    final_norm: the norm feeding the LM head (its output is the head's input).
    head: the LM head linear (quantized only when not ignored).
    no_clip: linears the AWQ clipping search leaves alone (q/k act through the
        softmax, which a per-layer output error does not model).
    """

    layers: str
    groups: tuple
    final_norm: str = "model.norm"
    head: str = "lm_head"
    no_clip: tuple = ()

    def linear_names(self) -> list:
        return [name for group in self.groups for name in group.linears]


# Llama-style blocks: pre-norm attention (q/k/v/o) and gated MLP (gate/up/down).
_LLAMA_GROUPS = (
    InputGroup(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm", "self_attn",
               fused=True, inspect_kwargs=True),
    # v -> o folds only without grouped-query attention (v's outputs map 1:1 to o's inputs).
    InputGroup(("self_attn.o_proj",), "self_attn.v_proj", "self_attn.o_proj"),
    InputGroup(("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm", "mlp", fused=True),
    InputGroup(("mlp.down_proj",), "mlp.up_proj", "mlp.down_proj"),
)
LLAMA = ArchSpec(layers="model.layers", groups=_LLAMA_GROUPS, no_clip=("self_attn.q_proj", "self_attn.k_proj"))

# Qwen2 (q/k/v with biases), Qwen3 (q_norm/k_norm after q/k, which scale-folding
# into the inputs leaves untouched) and Mistral share Llama's module names.
ARCHITECTURES = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
}


def arch_spec(model: nn.Module) -> ArchSpec:
    """The ArchSpec for ``model`` (by ``model.config.model_type``), checked
    against the model's modules; raises ``UnsupportedArchitecture`` saying what to add."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    spec = ARCHITECTURES.get(model_type)
    if spec is None:
        raise UnsupportedArchitecture(
            f"fp4ptq has no architecture table for model_type={model_type!r} "
            f"({type(model).__name__}). Add an ArchSpec to ARCHITECTURES in fp4ptq/models.py: the "
            "path of the decoder-block list, and per block the linears that share an input, the "
            f"norm/linear producing it, and the fused groups. Known: {sorted(ARCHITECTURES)}."
        )
    blocks = decoder_blocks(model, spec)
    missing = [n for n in spec.linear_names() + [g.prev for g in spec.groups] if _get(blocks[0], n) is None]
    if missing:
        raise UnsupportedArchitecture(
            f"model_type={model_type!r}: decoder block {type(blocks[0]).__name__} lacks {missing} "
            "named by fp4ptq/models.py; fix that architecture's table"
        )
    return spec


def decoder_blocks(model: nn.Module, spec: ArchSpec) -> nn.ModuleList:
    blocks = _get(model, spec.layers)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise UnsupportedArchitecture(
            f"{type(model).__name__} has no decoder-block list at {spec.layers!r} "
            "(fix the `layers` path in fp4ptq/models.py)"
        )
    return blocks


def get_module(root: nn.Module, name: str) -> nn.Module:
    module = _get(root, name)
    if module is None:
        raise UnsupportedArchitecture(f"{type(root).__name__} has no submodule {name!r}")
    return module


def set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(get_module(root, parent) if parent else root, leaf, module)


def _get(root: nn.Module, name: str) -> Optional[nn.Module]:
    try:
        return root.get_submodule(name)
    except AttributeError:
        return None


# --------------------------------------------------------------------------- #
# Discovery
# --------------------------------------------------------------------------- #
def check_decoder_only(model: nn.Module) -> None:
    """Raise ``UnsupportedArchitecture`` for models fp4ptq does not quantize
    (encoder-decoders, encoders: no causal LM head over one block list)."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedArchitecture(
            f"{type(model).__name__} is an encoder-decoder model; fp4ptq quantizes decoder-only causal LMs")
    if head_name(model) is None:
        raise UnsupportedArchitecture(
            f"{type(model).__name__} has no language-model head; fp4ptq quantizes decoder-only causal LMs "
            "(load them with AutoModelForCausalLM)")


def find_blocks(model: nn.Module) -> tuple:
    """``(path, ModuleList)`` of the decoder blocks: the table's path for a family with
    a table, else the ``nn.ModuleList`` whose items are of a class transformers names in
    ``_no_split_modules`` (the longest such list), else the longest list of repeated
    modules holding linears or expert tensors."""
    spec = ARCHITECTURES.get(getattr(getattr(model, "config", None), "model_type", None))
    if spec is not None:
        return spec.layers, decoder_blocks(model, spec)
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    best, fallback = None, None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        classes = {type(m).__name__ for m in module}
        if len(classes) != 1:
            continue
        if classes & no_split and (best is None or len(module) > len(best[1])):
            best = (name, module)
        holds = any(isinstance(m, nn.Linear) for m in module[0].modules())
        if holds and (fallback is None or len(module) > len(fallback[1])):
            fallback = (name, module)
    found = best or fallback
    if found is None:
        raise UnsupportedArchitecture(
            f"{type(model).__name__}: no list of decoder blocks found (no nn.ModuleList of repeated modules "
            "holding linear layers); fp4ptq quantizes decoder-only transformer models")
    return found


def final_norm(model: nn.Module, layers_path: str) -> Optional[str]:
    """The norm whose output feeds the LM head: the last module outside the blocks
    with a 1-D weight of the hidden size (``model.norm``, ``final_layernorm``, ...)."""
    spec = ARCHITECTURES.get(getattr(getattr(model, "config", None), "model_type", None))
    if spec is not None and _get(model, spec.final_norm) is not None:
        return spec.final_norm
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    hidden = getattr(head, "in_features", None)
    found = None
    for name, module in model.named_modules():
        if name == layers_path or name.startswith(layers_path + "."):
            continue
        weight = getattr(module, "weight", None)
        if (isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.numel() == hidden
                and not list(module.children())):
            found = name
    return found


def head_name(model: nn.Module) -> Optional[str]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    return next((n for n, m in model.named_modules() if m is head), None)


@dataclass
class BlockPlan:
    """What ``discover_block`` found in one decoder block.

    groups:  the InputGroups in forward order (linears by name, relative to the block);
    experts: names of the ``LinearExperts`` modules (their linears are in the groups);
    high:    modules with weights that stay in high precision, with the reason
             (routers, gates; modules that are neither linears nor expert tensors);
    routers: ``{experts name: its router's name}`` (the router beside each ``LinearExperts``)."""

    groups: list
    experts: tuple = ()
    high: dict = field(default_factory=dict)
    routers: dict = field(default_factory=dict)
    expert_lists: dict = field(default_factory=dict)   # per-expert module lists (older MoE form): name -> parent


def _key(t) -> Optional[tuple]:
    """Identity of a tensor's data (views of it share it; kept tensors are never reused)."""
    if not isinstance(t, torch.Tensor):
        return None
    return (t.untyped_storage().data_ptr(), t.numel(), t.dtype)


def _first_tensor(args, kwargs):
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


def _out_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) and out else out


@contextlib.contextmanager
def _calibrate_all(block: nn.Module, on: bool):
    from .experts import LinearExperts

    experts = [m for m in block.modules() if isinstance(m, LinearExperts)]
    before = [m.calibrate_all for m in experts]
    try:
        for m in experts:
            m.calibrate_all = on
        yield
    finally:
        for m, b in zip(experts, before):
            m.calibrate_all = b


@torch.no_grad()
def observe(block: nn.Module, hidden: torch.Tensor, call: tuple) -> dict:
    """One forward of ``block`` (every expert on every token) with hooks on all its
    modules: ``inputs`` {module: key of its first input}, ``readers`` {key: modules in
    call order}, ``producers`` {key: innermost module that returned it}, ``order``."""
    args, kwargs = call
    inputs, readers, producers, order, keep, handles = {}, {}, {}, [], [], []

    def pre(name):
        def hook(module, a, kw):
            if name in inputs:
                return
            x = _first_tensor(a, kw)
            if x is not None:
                keep.append(x)
                inputs[name] = _key(x)
                readers.setdefault(_key(x), []).append(name)
                order.append(name)
        return hook

    def post(name):
        def hook(module, a, kw, out):
            o = _out_tensor(out)
            if isinstance(o, torch.Tensor):
                keep.append(o)
                producers.setdefault(_key(o), name)
        return hook

    try:
        for name, module in block.named_modules():
            if name:
                handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
                handles.append(module.register_forward_hook(post(name), with_kwargs=True))
        keep.append(hidden)
        with _calibrate_all(block, True):
            block(hidden, *args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return {"inputs": inputs, "readers": readers, "producers": producers, "order": order,
            "block_input": _key(hidden)}


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _lca(names: list) -> str:
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _fold_kinds(prev: nn.Module, channels: int) -> list:
    if isinstance(prev, nn.Linear):
        return ["linear"] if prev.out_features == channels else []
    weight = getattr(prev, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.numel() == channels:
        return ["norm", "norm_offset"]
    return []


@torch.no_grad()
def _fold_is_exact(block, hidden, call, reference, prev, readers, kind, channels) -> bool:
    """Fold a random positive scale into ``prev`` (kind) and its inverse into ``readers``;
    exact when the block's output moves by no more than rounding."""
    from .methods import smoothing

    gen = torch.Generator().manual_seed(channels)
    s = torch.exp(0.5 * torch.randn(channels, generator=gen)).to(hidden.device)
    saved = [(t, t.detach().clone()) for m in [prev, *readers] for t in (getattr(m, "weight", None),
                                                                         getattr(m, "bias", None))
             if isinstance(t, torch.Tensor)]
    try:
        smoothing.fold_scales(prev, readers, s, kind=kind)
        out = _out_tensor(block(hidden, *call[0], **call[1])).float()
    except smoothing.SmoothingError:
        return False
    finally:
        for t, v in saved:
            t.copy_(v)
    moved = (out - reference).norm() / (reference - hidden.float()).norm().clamp_min(1e-30)
    return bool(moved < 1e-3)


ROUTER_REASON = "MoE router (kept in high precision: it picks the experts)"
GATE_REASON = ("gate: one output per token that scales a branch through a sigmoid (kept in high precision, "
               "as MoE routing is; it takes the compensating scale where its input is smoothed)")


def _is_router(module: nn.Module, name: str, sibling_experts: dict, modules: dict) -> bool:
    """A module that scores experts: its output has one value per expert of an experts module (a
    ``LinearExperts``, a per-expert list, or 3-D expert tensors left unlinearized) beside it, or beside a
    wrapper that holds nothing else with parameters (HunYuan-MoE's ``mlp.gate.wg`` scores ``mlp.experts``)."""
    return _router_parent(module, name, sibling_experts, modules) is not None


def _router_parent(module: nn.Module, name: str, sibling_experts: dict, modules: dict) -> str | None:
    """The module holding the experts that ``module`` (at ``name``) scores, or None."""
    weight = getattr(module, "weight", None)
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 2):
        return None
    parent = _parent(name)
    while True:
        if weight.shape[0] in sibling_experts.get(parent, ()):
            return parent
        wrapper = modules.get(parent)
        if not parent or wrapper is None or sum(1 for m in wrapper.modules() if any(
                True for _ in m.parameters(recurse=False))) != 1:
            return None   # a wrapper holding other weights (a shared expert's MLP) is not a router's
        parent = _parent(parent)


@torch.no_grad()
def discover_block(block: nn.Module, hidden: torch.Tensor, call: tuple, *, probe: bool) -> BlockPlan:
    """The InputGroups of ``block``, observed on ``hidden [1, T, d]`` with its call
    arguments ``call = (args, kwargs)``. With ``probe``, each group's producer is
    tested for an exact fold of smoothing scales (computed in float32)."""
    from .experts import LinearExperts, is_experts_module

    modules = dict(block.named_modules())
    experts = tuple(n for n, m in modules.items() if isinstance(m, LinearExperts))
    sibling_experts: dict = {}
    for e in experts:
        sibling_experts.setdefault(_parent(e), set()).add(modules[e].num_experts)
    for n, m in modules.items():   # experts kept as 3-D tensors (a layout not linearized): their router still
        if not isinstance(m, LinearExperts) and is_experts_module(m):
            sibling_experts.setdefault(_parent(n), set()).add(m.gate_up_proj.shape[0])
    lists = _expert_lists(modules)
    for name in lists:
        sibling_experts.setdefault(_parent(name), set()).add(len(modules[name]))

    dtype = next((p.dtype for p in block.parameters() if p.is_floating_point()), torch.float32)
    if probe and dtype != torch.float32:
        block.float()   # exactness is judged in float32; bf16/fp16 -> fp32 -> back is lossless
        hidden = hidden.float()
        call = _cast_call(call, torch.float32)
    try:
        seen = observe(block, hidden, call)
        reference = None
        if probe:
            with _calibrate_all(block, False):
                reference = _out_tensor(block(hidden, *call[0], **call[1])).float()
        plan = _plan_groups(block, modules, seen, sibling_experts, hidden, call,
                            reference if probe else None)
    finally:
        if probe and dtype != torch.float32:
            block.to(dtype)
    plan.experts = experts
    plan.routers = {e: r for e in experts for r, why in plan.high.items()
                    if why == ROUTER_REASON and _router_parent(modules[r], r, sibling_experts, modules) == _parent(e)}
    plan.expert_lists = {name: _parent(name) for name in lists}
    _mirror_unrouted_experts(plan, modules, lists)
    return plan


def _expert_lists(modules: dict) -> dict:
    """The older Mixture-of-Experts form: an ``nn.ModuleList`` of identical expert MLPs
    (``experts.E.w1`` ...) beside a router whose output has one value per expert.
    Returns ``{list name: router name}``."""
    from .experts import LinearExperts

    found = {}
    for name, module in modules.items():
        if not isinstance(module, nn.ModuleList) or isinstance(module, LinearExperts) or len(module) < 2:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        first = next((m for m in module[0].modules() if isinstance(m, nn.Linear)), None)
        if first is None:
            continue
        parent = _parent(name)
        for other, candidate in modules.items():
            weight = getattr(candidate, "weight", None)
            if (other != name and _parent(other) == parent and not list(candidate.children())
                    and isinstance(weight, torch.Tensor) and weight.dim() == 2
                    and weight.shape == (len(module), first.in_features)):
                found[name] = other
                break
    return found


def _mirror_unrouted_experts(plan: BlockPlan, modules: dict, lists: dict) -> None:
    """Experts of a per-expert list that the observed forward did not route to get the
    groups of an expert that it did (they are the same module, so the same structure)."""
    for name in lists:
        grouped = {n for g in plan.groups for n in g.linears}
        count = len(modules[name])
        seen = [e for e in range(count) if any(n.startswith(f"{name}.{e}.") for n in grouped)]
        if not seen:
            continue
        source = f"{name}.{seen[0]}."
        template = [g for g in plan.groups if all(n.startswith(source) for n in g.linears)]
        for e in range(count):
            target = f"{name}.{e}."
            if e in seen:
                continue

            def move(n, target=target):
                if n == source[:-1]:
                    return target[:-1]
                return target + n[len(source):] if n and n.startswith(source) else n

            for g in template:
                plan.groups.append(replace(
                    g, linears=tuple(move(n) for n in g.linears), prev=move(g.prev),
                    inspect=move(g.inspect) if g.inspect else g.inspect,
                    fused_sets=tuple(tuple(move(n) for n in f) for f in g.fused_sets)))
            for n in list(plan.high):
                if n.startswith(target) and "never called" in plan.high[n]:
                    del plan.high[n]


def _cast_call(call: tuple, dtype) -> tuple:
    def cast(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(dtype)
        if isinstance(v, (tuple, list)):
            return type(v)(cast(x) for x in v)
        return v
    args, kwargs = call
    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def _plan_groups(block, modules, seen, sibling_experts, hidden, call, reference) -> BlockPlan:
    from .experts import is_experts_module

    high, groups = {}, []
    order = {n: i for i, n in enumerate(seen["order"])}
    grouped = set()
    for key, names in seen["readers"].items():
        leaves = [n for n in names if not _children(modules[n]) and not _is_transform(modules[n])]
        linears, routers, others = [], [], []
        for n in leaves:
            module = modules[n]
            if _is_router(module, n, sibling_experts, modules):
                routers.append(n)
                high[n] = ROUTER_REASON
            elif isinstance(module, nn.Linear) and module.out_features == 1:
                routers.append(n)   # qwen2_moe's shared_expert_gate: sigmoid(gate(x)) * shared_expert(x)
                high[n] = GATE_REASON
            elif isinstance(module, nn.Linear):
                linears.append(n)
            elif any(True for _ in module.parameters(recurse=False)):
                others.append(n)
        if not linears:
            continue
        grouped.update(linears)
        channels = linears[0] and modules[linears[0]].in_features
        # fused sets: linears of one parent module reading this tensor (q/k/v, gate/up, one expert's gate/up)
        by_parent: dict = {}
        for n in linears:
            by_parent.setdefault(_parent(n), []).append(n)
        fused_sets = tuple(tuple(v) for v in by_parent.values() if len(v) > 1)
        # inspect: the smallest module holding all readers that takes this tensor as its input
        inspect = _lca(linears + routers)
        while inspect and seen["inputs"].get(inspect) != key:
            inspect = _parent(inspect) if "." in inspect else ""
        if not inspect and key != seen["block_input"]:
            inspect = None   # no module takes exactly this tensor: statistics from the first linear, no search
        prev, fold, why = _find_fold(block, modules, seen, key, linears, routers, others, channels, order,
                                     hidden, call, reference)
        groups.append(InputGroup(tuple(linears), prev, inspect, fused=False, inspect_kwargs=False,
                                 fused_sets=fused_sets, readers=tuple(routers), fold=fold, why=why))
    for n, module in modules.items():
        if (n in grouped or n in high or _children(module) or _is_transform(module)
                or not any(True for _ in module.parameters(recurse=False))):
            continue
        if isinstance(module, nn.Linear):
            high[n] = "a linear the calibration forward never called"
        elif is_experts_module(module):
            high[n] = f"MoE experts in a layout fp4ptq does not linearize ({type(module).__name__}): kept in high precision"
        elif not _is_norm_like(module):
            high[n] = f"neither a linear nor an expert tensor ({type(module).__name__}): kept in high precision"
    groups.sort(key=lambda g: order.get(g.linears[0], 0))
    return BlockPlan(groups=groups, high=high)


def _is_transform(module: nn.Module) -> bool:
    """An online rotation attached to a linear (``fp4ptq.rotation.OnlineHadamard``, issue 43)."""
    return bool(getattr(module, "fp4ptq_transform", False))


def _children(module: nn.Module) -> list:
    """The module's children, without online rotations (a linear carrying one is still a leaf)."""
    return [c for c in module.children() if not _is_transform(c)]


def _is_norm_like(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    return bool(params) and all(p.dim() == 1 for p in params.values())


def _find_fold(block, modules, seen, key, linears, routers, others, channels, order, hidden, call, reference):
    """``(prev, fold kind, why not)`` for one input tensor."""
    readers = [modules[n] for n in linears + routers]
    if others:
        return None, None, f"also read by {others} ({type(modules[others[0]]).__name__}), which cannot take the scale"
    producer = seen["producers"].get(key)
    candidates = []
    if producer is not None and _fold_kinds(modules[producer], channels):
        candidates.append(producer)
    elif key == seen["block_input"]:
        return None, None, "reads the block's input (the residual stream), which no module of the block produces"
    else:
        # not produced by a module (e.g. attention's output, act(gate) * up): linears of the
        # same parent that ran before and have one output per input channel
        first = min(order.get(n, 0) for n in linears)
        parent = _parent(linears[0])
        candidates = [n for n, i in sorted(order.items(), key=lambda kv: -kv[1])
                      if i < first and _parent(n) == parent and isinstance(modules[n], nn.Linear)
                      and modules[n].out_features == channels and n not in linears]
    if not candidates:
        return None, None, "no module produces this input channel for channel (no exact fold)"
    if reference is None:   # no probing: name the producer found by identity, unverified
        return (producer, _fold_kinds(modules[producer], channels)[0], None) if producer in candidates else (
            None, None, "not probed")
    for name in candidates:
        for kind in _fold_kinds(modules[name], channels):
            with _calibrate_all(block, False):
                if _fold_is_exact(block, hidden, call, reference, modules[name], readers, kind, channels):
                    return name, kind, None
    return None, None, f"no exact fold: folding into {candidates} changes the block's output (not channel for channel)"


def check_against_table(plan: BlockPlan, spec: ArchSpec, where: str) -> None:
    """A family's table must describe what discovery found (same groups, fused sets, producers)."""
    found = {frozenset(g.linears): g for g in plan.groups}
    problems = []
    for group in spec.groups:
        g = found.get(frozenset(group.linears))
        if g is None:
            problems.append(f"the table's group {group.linears} is not a group of linears reading one tensor")
            continue
        fused = bool(g.fused_sets) and set(g.fused_sets[0]) == set(group.linears)
        if fused != group.fused:
            problems.append(f"{group.linears}: the table says fused={group.fused}, the model {fused}")
        if g.prev is not None and g.prev != group.prev:
            problems.append(f"{group.linears}: the table folds into {group.prev}, the model's producer is {g.prev}")
    if problems:
        raise UnsupportedArchitecture(f"{where}: fp4ptq/models.py's table disagrees with the model: "
                                      + "; ".join(problems) + ". Fix the table (or remove it: discovery suffices)")


def checkpoint_names(model: nn.Module, keys) -> dict:
    """``{module key: key in the original checkpoint}`` for state-dict ``keys``:
    transformers' own reverse renamings for the model type (Mixtral's
    ``mlp`` is ``block_sparse_moe`` in its checkpoints), as its ``save_pretrained``
    applies them. Keys it does not rename map to themselves."""
    keys = list(keys)
    try:
        from transformers.core_model_loading import revert_weight_conversion

        # [1, 1]: a conversion may transpose a tensor (Ergo's router); not a meta default device
        probe = {k: torch.tensor([[i]], device="cpu") for i, k in enumerate(keys)}
        out = revert_weight_conversion(model, probe)
        mapping = {}
        for new, value in out.items():
            value = value[0] if isinstance(value, list) else value
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                mapping[keys[int(value.flatten()[0])]] = new
    except Exception:  # noqa: BLE001 - a transformers without (or with changed) conversion tables
        return {k: k for k in keys}
    if len(set(mapping.values())) != len(mapping):
        return {k: k for k in keys}
    return {k: mapping.get(k, k) for k in keys}


__all__ = [
    "ARCHITECTURES", "ArchSpec", "BlockPlan", "InputGroup", "LLAMA", "UnsupportedArchitecture", "arch_spec",
    "check_against_table", "check_decoder_only", "checkpoint_names", "decoder_blocks", "discover_block", "final_norm", "find_blocks",
    "get_module", "head_name", "observe", "set_module",
]
