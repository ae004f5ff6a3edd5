"""Block-diagonal Hadamard rotations that leave the model's function unchanged.

A rotation ``R`` (orthogonal, block-diagonal with ``b x b`` Hadamard blocks,
``R = diag(s) H / sqrt(b)`` with random signs ``s`` when randomized) spreads a
channel's outlier over ``b`` channels before NVFP4 rounds them (QuaRot; FP-Quant's
MR-GPTQ with 128-wide blocks; the NVFP4 pre-training recipe's random Hadamard
transforms). Row-vector convention, ``y = x W^T``:

* residual stream ``h -> h R``: the embedding rows ``E R``; every reader of the
  stream (after its RMSNorm's weight is folded into it: a rotation does not
  commute with an elementwise scale) ``W -> W R``; every writer ``W -> R^T W``
  (bias ``b -> b R``). RMSNorm without its weight is rotation invariant
  (``||h R|| = ||h||``), so the norms keep working on the rotated stream.
* per attention head, ``v -> v R_h`` and ``o``'s input ``R_h``: ``W_v -> R_h^T W_v``
  (bias too), ``W_o -> W_o R_h``; the softmax mixes tokens, not channels, so it
  commutes (grouped-query attention too: every head uses the same ``R_h``).
* online, where no producer can absorb it (``down_proj``'s input comes through
  the gated product): ``W -> W R`` and the input ``x -> x R`` at run time, by a
  small module attached to the linear (``OnlineHadamard``) under
  compressed-tensors' transform naming ``{linear}.{group}_input.weight``.

Which modules play which part comes as explicit lists (``RotationPlan``): from
``fp4ptq.models``' ArchSpec for the families with a table (``plan_from_spec``), for
any other decoder from one observed forward per block (``plan_from_discovery``:
RMSNorm-type norms, Gemma's ``1 + weight`` included, MoE routers and every
expert's linears), each block's plan checked on a float32 copy of it. What cannot
be rotated exactly (LayerNorm, post-norms on the writers, another module reading
the stream) raises ``RotationError`` naming it, and ``rotate_model`` compares the
logits of a short sequence before and after (``PROBE_TOLERANCE``).

The online rotations are recorded as compressed-tensors' ``transform_config``, written and read
back by ``fp4ptq.transforms`` (which also says what stock transformers does with it). The folded
(offline) rotations are already in the stored weights and are recorded in the fp4ptq report only
(a loader must not apply them again).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from .models import ArchSpec, UnsupportedArchitecture, decoder_blocks

from .config import ROTATION_BLOCKS  # noqa: E402 (one list, validated in QuantConfig)
TRANSFORM_GROUP = "online_hadamard"   # compressed-tensors names the module "{group}_{location}"
TRANSFORM_MODULE = f"{TRANSFORM_GROUP}_input"


class RotationError(UnsupportedArchitecture):
    """A rotation cannot be applied (dimensions, norm type, a module that would not commute with it)
    or a transform_config cannot be read (an ``UnsupportedArchitecture``: exit 5 at the CLI)."""


# --------------------------------------------------------------------------- #
# Matrices
# --------------------------------------------------------------------------- #
def sylvester_hadamard(size: int) -> torch.Tensor:
    """The ``size x size`` Sylvester Hadamard matrix of +-1 (float64), ``size`` a power of two;
    the same matrix as compressed-tensors' ``deterministic_hadamard_matrix``."""
    if size < 1 or size & (size - 1):
        raise RotationError(f"a Hadamard block must be a power of two, got {size}")
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < size:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


def hadamard_signs(size: int, seed: Optional[int]) -> torch.Tensor:
    """The unnormalized block ``M = diag(s) H`` (+-1 entries, float64); ``s`` random signs from
    ``seed``, all ones when ``seed`` is None. The orthogonal rotation is ``M / sqrt(size)``."""
    H = sylvester_hadamard(size)
    if seed is None:
        return H
    s = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(seed)).double() * 2 - 1
    return s[:, None] * H


def apply_blocks(x: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """``x [..., d] @ blockdiag(M, ..., M) / sqrt(b)`` for ``M [b, b]`` (``d`` a multiple of ``b``),
    computed in ``M``'s dtype and returned in it."""
    b = M.shape[0]
    d = x.shape[-1]
    if d % b:
        raise RotationError(f"a dimension of {d} is not a multiple of the rotation block {b}")
    y = x.to(M.dtype).reshape(*x.shape[:-1], d // b, b) @ M.to(x.device)
    return y.reshape(x.shape) / math.sqrt(b)


def block_for(dim: int, block: int) -> int:
    """The rotation block used on a dimension ``dim``: ``block``, halved until it divides ``dim``
    (SmolLM2's hidden size 576 takes 64 where 128 is asked); at least 2."""
    b = block
    while b > 1 and dim % b:
        b //= 2
    if b < 2:
        raise RotationError(f"no power-of-two rotation block up to {block} divides the dimension {dim}")
    return b


# --------------------------------------------------------------------------- #
# Folding into weights (float64, back to the weight's dtype)
# --------------------------------------------------------------------------- #
def _set(param: nn.Parameter, value: torch.Tensor) -> None:
    param.data = value.to(dtype=param.dtype, device=param.device).contiguous()


@torch.no_grad()
def rotate_input(linear: nn.Linear, M: torch.Tensor) -> None:
    """``W [out, in] -> W R`` (the linear now reads ``x R``)."""
    _set(linear.weight, apply_blocks(linear.weight.double(), M))


@torch.no_grad()
def rotate_output(linear: nn.Linear, M: torch.Tensor, rows: Optional[tuple] = None) -> None:
    """``W [out, in] -> R^T W`` and ``b -> b R`` (the linear now writes ``y R``); with ``rows =
    (start, stop)`` only those output rows (the v rows of a fused qkv projection)."""
    start, stop = rows or (0, linear.weight.shape[0])
    weight = linear.weight.double()
    weight[start:stop] = apply_blocks(weight[start:stop].T, M).T
    _set(linear.weight, weight)
    if getattr(linear, "bias", None) is not None:
        bias = linear.bias.double()
        bias[start:stop] = apply_blocks(bias[start:stop], M)
        _set(linear.bias, bias)


def _rms_norm_weight(norm: nn.Module, name: str) -> nn.Parameter:
    kind = type(norm).__name__
    if "Gemma" in kind:
        raise RotationError(f"{name} ({kind}) scales by (1 + weight); fp4ptq folds only x * weight RMSNorms")
    weight = getattr(norm, "weight", None)
    if "RMSNorm" not in kind or not isinstance(weight, nn.Parameter) or getattr(norm, "bias", None) is not None:
        raise RotationError(f"{name} ({kind}) is not an RMSNorm of the form x / rms(x) * weight: a rotation of "
                            "its input would not commute with it")
    return weight


@torch.no_grad()
def fold_norm(norm: nn.Module, readers: list, name: str = "norm", form: Optional[str] = None) -> None:
    """Fold an RMSNorm's gain into the modules reading its output (``W -> W diag(g)``) and make the
    norm gain-free. ``form``: "weight" (``x / rms(x) * weight``: g = weight, weight -> 1) or "offset"
    (Gemma's ``x / rms(x) * (1 + weight)``: g = 1 + weight, weight -> 0), as ``norm_form`` measured
    it; None: an RMSNorm class of the first form, checked by its name (the table path)."""
    if form is None:
        weight, offset = _rms_norm_weight(norm, name), 0.0
    else:
        weight, offset = norm.weight, (1.0 if form == "offset" else 0.0)
    w = weight.double() + offset
    for linear in readers:
        _set(linear.weight, linear.weight.double() * w.to(linear.weight.device))
    weight.data.fill_(1.0 - offset)


# --------------------------------------------------------------------------- #
# Online rotations
# --------------------------------------------------------------------------- #
class OnlineHadamard(nn.Module):
    """``x -> x blockdiag(M) / sqrt(b)`` before a linear (compressed-tensors' ``HadamardTransform``
    at ``location: input``: the same weight, the same formula, in ``float32``)."""

    fp4ptq_transform = True   # discovery (fp4ptq.models) keeps the linear carrying it a leaf

    def __init__(self, size: int, weight: Optional[torch.Tensor] = None, device=None) -> None:
        super().__init__()
        data = torch.empty(size, size, dtype=torch.float32, device=device) if weight is None \
            else weight.to(dtype=torch.float32, device=device)
        self.weight = nn.Parameter(data, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_blocks(x, self.weight.to(x.device)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"block={self.weight.shape[0]}"


def _online_pre_hook(module: nn.Module, args):
    return (getattr(module, TRANSFORM_MODULE)(args[0]),) + tuple(args[1:])


def attach_online(linear: nn.Module, transform: OnlineHadamard) -> None:
    """Register ``transform`` as ``linear.{TRANSFORM_MODULE}`` and run it on the linear's input
    (a forward pre-hook, first among the linear's pre-hooks)."""
    linear.register_module(TRANSFORM_MODULE, transform)
    linear.register_forward_pre_hook(_online_pre_hook, prepend=True)


def online_transform(module: nn.Module) -> Optional[OnlineHadamard]:
    found = getattr(module, TRANSFORM_MODULE, None)
    return found if isinstance(found, OnlineHadamard) else None


def move_online(old: nn.Module, new: nn.Module) -> None:
    """Carry an online rotation from a linear to the module replacing it (the pipeline's swap)."""
    transform = online_transform(old)
    if transform is not None and online_transform(new) is None:
        attach_online(new, transform)


# --------------------------------------------------------------------------- #
# The plan: which modules play which part
# --------------------------------------------------------------------------- #
@dataclass
class RotationPlan:
    """Full module names. ``norms``: (norm, its reader linears); ``readers``/``writers``: linears
    reading from / writing to the residual stream; ``heads``: (v, o) pairs rotated per head;
    ``online``: linears whose input is rotated at run time; ``head_dim``; ``embeddings``."""

    embeddings: list
    norms: list
    readers: list
    writers: list
    heads: list = field(default_factory=list)
    online: list = field(default_factory=list)
    head_dim: Optional[int] = None
    head_rows: dict = field(default_factory=dict)    # v -> (start, stop): its rows in a fused qkv projection
    norm_forms: dict = field(default_factory=dict)   # norm -> "weight" / "offset" (measured; table path: by class)
    notes: dict = field(default_factory=dict)        # what was left unrotated, with the reason
    source: str = "table"                            # "table" (ArchSpec) or "discovery"

    def lists(self) -> dict:
        """The module lists (what a table plan and a discovered plan must agree on)."""
        return {"embeddings": self.embeddings, "norms": [(n, list(r)) for n, r in self.norms],
                "readers": self.readers, "writers": self.writers, "heads": [tuple(h) for h in self.heads],
                "online": self.online}


def _head_dim(config) -> int:
    hd = getattr(config, "head_dim", None)
    return int(hd) if hd else config.hidden_size // config.num_attention_heads


def plan_from_spec(model: nn.Module, spec: ArchSpec, online: tuple = ("mlp.down_proj",),
                   residual: bool = True) -> RotationPlan:
    """The plan for a model described by an ArchSpec (Llama family): groups fed by a norm are
    residual readers (the norm folded into them); groups fed by a linear (v -> o, up -> down)
    write to the residual; v -> o is rotated per head; ``online`` (names relative to a block,
    globs allowed) get online rotations. The final norm feeds the LM head. ``residual=False`` leaves
    the residual stream (embeddings, norms, readers, writers) alone."""
    from fnmatch import fnmatchcase

    names = {id(m): n for n, m in model.named_modules()}
    embedding = model.get_input_embeddings()
    plan = RotationPlan(embeddings=[names[id(embedding)]], norms=[], readers=[], writers=[],
                        head_dim=_head_dim(model.config))
    blocks = decoder_blocks(model, spec)
    for index, block in enumerate(blocks):
        prefix = f"{spec.layers}.{index}"
        linear_names = [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]
        for group in spec.groups:
            full = [f"{prefix}.{n}" for n in group.linears]
            prev = block.get_submodule(group.prev)
            if isinstance(prev, nn.Linear):
                plan.writers += full
                if group.prev.endswith("v_proj"):
                    plan.heads += [(f"{prefix}.{group.prev}", f) for f in full]
            else:
                plan.norms.append((f"{prefix}.{group.prev}", full))
                plan.readers += full
        for pattern in online:
            hits = [n for n in linear_names if fnmatchcase(n, pattern)]
            if not hits:
                raise RotationError(f"online rotation {pattern!r}: no linear of {prefix} matches it "
                                    f"(its linears: {linear_names})")
            plan.online += [f"{prefix}.{n}" for n in hits]
    head = model.get_submodule(spec.head) if _has(model, spec.head) else None
    if isinstance(head, nn.Linear):
        plan.norms.append((spec.final_norm, [spec.head]))
        plan.readers.append(spec.head)
    if not residual:
        plan.embeddings, plan.norms, plan.readers, plan.writers = [], [], [], []
    return plan


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def _untie_head(model: nn.Module, head_name: str) -> bool:
    """Give a head tied to the input embedding its own weight (the two are rotated differently)."""
    head = model.get_submodule(head_name)
    embedding = model.get_input_embeddings()
    if head.weight is not embedding.weight and head.weight.data_ptr() != embedding.weight.data_ptr():
        return False
    head.weight = nn.Parameter(embedding.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    if getattr(model.config, "get_text_config", None) is not None:
        model.config.get_text_config().tie_word_embeddings = False
    for attr in ("all_tied_weights_keys", "_tied_weights_keys"):
        tied = getattr(model, attr, None)
        if isinstance(tied, dict):
            setattr(model, attr, {k: v for k, v in tied.items() if not k.startswith(head_name + ".")})
    return True


# --------------------------------------------------------------------------- #
# The plan from discovery (any pre-norm decoder with RMSNorm-type norms)
# --------------------------------------------------------------------------- #
# Relative output change a rotation check accepts (float32 forwards of float64-rotated weights).
CHECK_TOLERANCE = 1e-3


def _orthogonal(dim: int, seed: int) -> torch.Tensor:
    """The rotation the checks use on a dimension: random-sign Hadamard blocks of up to 128
    (cheap on large weights; a channel-mixing the norms and the block's function must commute with)."""
    return hadamard_signs(block_for(dim, 128), seed)


def _rel(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / scale.detach().double().norm().clamp_min(1e-30))


@torch.no_grad()
def norm_form(norm: nn.Module, name: str) -> str:
    """How a norm reading the residual stream applies its weight, measured on a float32 copy:
    "weight" (``n(x) * weight``) or "offset" (``n(x) * (1 + weight)``, Gemma), where ``n`` must
    commute with a rotation of its input (RMS normalization does; LayerNorm's mean subtraction and
    a bias do not). Raises RotationError naming the norm and what fails."""
    import copy

    kind = type(norm).__name__
    weight = getattr(norm, "weight", None)
    others = [n for n, _ in norm.named_parameters() if n != "weight"]
    if others or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise RotationError(f"{name} ({kind}) has parameters {others or 'other than one 1-D weight'}: not an "
                            "RMSNorm of the form x / rms(x) * weight, so a rotation of its input would not commute "
                            "with it")
    probe = copy.deepcopy(norm).float()
    dim = weight.numel()
    x = (torch.randn(4, dim, generator=torch.Generator().manual_seed(dim)) + 0.5).to(weight.device)
    w = probe.weight
    w.data.zero_()
    y0 = probe(x).float()
    w.data.fill_(1.0)
    y1 = probe(x).float()
    if y0.norm() <= 1e-6 * y1.norm():
        form, neutral, gain = "weight", 1.0, weight.float()
    elif (y1 - 2 * y0).norm() <= 1e-5 * y1.norm():
        form, neutral, gain = "offset", 0.0, 1 + weight.float()
    else:
        raise RotationError(f"{name} ({kind}): its output is neither n(x) * weight nor n(x) * (1 + weight) "
                            "(a bias, or another form); fp4ptq cannot fold it before a rotation")
    w.data.fill_(neutral)
    Q = _orthogonal(dim, 1).to(x.device)
    plain = probe(x).float()
    rotated = probe(apply_blocks(x, Q).float()).float()
    if _rel(rotated, apply_blocks(plain, Q), plain) > CHECK_TOLERANCE:
        raise RotationError(f"{name} ({kind}) does not commute with a rotation of its input (it subtracts the "
                            "mean, as LayerNorm does, or mixes channels): fp4ptq rotates the residual stream only "
                            "around RMSNorm-type norms")
    w.data.copy_(weight.float())
    if _rel(probe(x).float(), plain * gain.to(x.device), plain) > CHECK_TOLERANCE:
        raise RotationError(f"{name} ({kind}): its weight does not act as a per-channel gain of its output; "
                            "fp4ptq cannot fold it before a rotation")
    return form


def _head_shape(config) -> tuple:
    """``(query heads, key/value heads, head_dim)`` from the model's (text) config, or None."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    return int(heads), int(kv), _head_dim(config)


class _Probe:
    """A float32 copy of one block and its probe input: checks that a rotation applied to the copy
    leaves its function unchanged (``block(x R) = block(x) R`` for the residual stream)."""

    def __init__(self, block: nn.Module, hidden: torch.Tensor, call: tuple) -> None:
        import copy

        from .models import _cast_call, _out_tensor

        self.block = copy.deepcopy(block).float()
        self.hidden = hidden.float()
        self.call = _cast_call(call, torch.float32)
        self._out = _out_tensor
        self.reference = self.run(self.hidden)

    def run(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._out(self.block(hidden, *self.call[0], **self.call[1])).float()

    def moved(self, M: Optional[torch.Tensor] = None) -> float:
        """The output's change (relative to the block's own change of the stream) after the rotation
        applied to the copy; ``M`` the residual rotation (None: the stream is not rotated)."""
        hidden = self.hidden if M is None else apply_blocks(self.hidden, M).float()
        expected = self.reference if M is None else apply_blocks(self.reference, M)
        return _rel(self.run(hidden), expected, self.reference - self.hidden)

    @contextlib.contextmanager
    def trial(self, names: list):
        """Restore the copy's ``names`` modules' weights and biases afterwards."""
        saved = [(t, t.detach().clone()) for n in names for t in (getattr(self.block.get_submodule(n), "weight", None),
                                                                  getattr(self.block.get_submodule(n), "bias", None))
                 if isinstance(t, torch.Tensor)]
        try:
            yield
        finally:
            for t, v in saved:
                t.data.copy_(v)


def _block_roles(block: nn.Module, prefix: str, hidden: torch.Tensor, call: tuple, hidden_size: int) -> dict:
    """The residual stream's norms, readers and writers of one block, found by observing one forward
    (``fp4ptq.models.observe`` / ``discover_block``). Names relative to the block."""
    from .models import _children, _is_norm_like, _is_transform, discover_block, observe

    found = discover_block(block, hidden, call, probe=False)
    seen = observe(block, hidden, call)
    modules = dict(block.named_modules())
    order = {n: i for i, n in enumerate(seen["order"])}
    inputs, producers = seen["inputs"], seen["producers"]
    outputs = {}
    for key, name in producers.items():
        outputs.setdefault(name, key)
    routers = {r for g in found.groups for r in g.readers}
    weighted = {n: m for n, m in modules.items() if n and not _children(m) and not _is_transform(m)
                and any(True for _ in m.parameters(recurse=False))}

    def is_norm(n):
        m = modules[n]
        return not isinstance(m, nn.Linear) and _is_norm_like(m) and getattr(m, "weight", None) is not None \
            and m.weight.numel() == hidden_size

    # The residual stream: the block's input and the sums a hidden-size norm reads that no module produced.
    residual = {seen["block_input"]} | {inputs[n] for n in weighted if n in inputs and is_norm(n)
                                        and producers.get(inputs[n]) is None}
    norms = {n: outputs[n] for n in weighted if is_norm(n) and inputs.get(n) in residual and n in outputs}
    normed = {key: n for n, key in norms.items()}
    roles = {"norms": {n: [] for n in norms}, "readers": [], "writers": [], "routers": sorted(routers)}
    for key in list(residual) + list(normed):
        for n in seen["readers"].get(key, []):
            if n not in weighted or (key in residual and n in norms):
                continue
            module = modules[n]
            if isinstance(module, nn.Linear) or n in routers:
                roles["readers"].append(n)
                if key in normed:
                    roles["norms"][normed[key]].append(n)
            else:
                where = "residual stream" if key in residual else f"output of {normed[key]}"
                raise RotationError(f"{prefix}.{n} ({type(module).__name__}) reads the {where}: fp4ptq cannot "
                                    "rotate its input (not a linear, router or RMSNorm)")
    for n, module in weighted.items():
        if not isinstance(module, nn.Linear) or n in roles["readers"]:
            continue
        if n not in inputs:
            raise RotationError(f"{prefix}.{n}: the probe forward never called this linear, so fp4ptq cannot tell "
                                "whether it reads or writes the residual stream (an expert no token was routed to?)")
        if module.out_features != hidden_size:
            continue
        consumers = [c for c in seen["readers"].get(outputs.get(n), []) if c in weighted]
        post = [c for c in consumers if is_norm(c) or _is_norm_like(modules[c])]
        if post:
            raise RotationError(f"{prefix}.{n} writes through the norm {prefix}.{post[0]} "
                                f"({type(modules[post[0]]).__name__}) before the residual sum (a post-norm or "
                                "'sandwich' norm): a rotation of the residual stream does not commute with it")
        if not consumers:
            roles["writers"].append(n)
    roles["readers"].sort(key=lambda n: order.get(n, 0))
    roles["writers"].sort(key=lambda n: order.get(n, 0))
    roles["order"] = order
    return roles


def _find_heads(probe: _Probe, roles: dict, shape: Optional[tuple], prefix: str, notes: dict) -> list:
    """``[(v, o, rows)]``: per attention, the writer ``o`` reading the heads and the projection ``v``
    (its rows ``rows`` in a fused qkv) whose per-head rotation o undoes, each checked on the copy."""
    if shape is None:
        return []
    heads, kv, hd = shape
    modules = dict(probe.block.named_modules())
    order = roles["order"]
    found = []
    for o in roles["writers"]:
        lin = modules[o]
        if lin.in_features != heads * hd:
            continue
        parent = o.rpartition(".")[0]
        candidates = sorted((n for n, m in modules.items() if isinstance(m, nn.Linear) and n != o
                             and n.rpartition(".")[0] == parent and order.get(n, 1 << 30) < order.get(o, 0)
                             and m.out_features in (kv * hd, (heads + 2 * kv) * hd)),
                            key=lambda n: -order[n])
        M = _orthogonal(hd, 2)
        pair = None
        for v in candidates:
            out = modules[v].out_features
            rows = None if out == kv * hd else ((heads + kv) * hd, out)
            with probe.trial([v, o]):
                rotate_output(modules[v], M, rows)
                rotate_input(modules[o], M)
                if probe.moved() <= CHECK_TOLERANCE:
                    pair = (v, o, rows)
            if pair:
                break
        if pair:
            found.append(pair)
        else:
            notes[f"{prefix}.{o}"] = (f"no per-head v/o rotation: none of {candidates or 'its siblings'} is a value "
                                      "projection whose per-head rotation o undoes")
    return found


@torch.no_grad()
def plan_from_discovery(model: nn.Module, layers_path: str, blocks: nn.ModuleList, hidden: torch.Tensor,
                        calls: list, online: tuple = ("mlp.down_proj",), residual: bool = True) -> RotationPlan:
    """The plan for any decoder-only model, from what one probe forward shows per block (``hidden``:
    the first block's input ``[1, T, d]``, ``calls``: each block's call arguments, as the pipeline's
    capture records them). Residual readers: the linears and MoE routers reading the block's input or
    an RMSNorm-type norm of it (the norm's gain folded into them, Gemma's ``1 + weight`` too); writers:
    the hidden-size linears whose output no module of the block reads (o, down, every expert's down);
    per head: v (or a fused qkv's v rows) -> o. Each block's plan is checked on a float32 copy of it
    (``block(x R) == block(x) R`` with a random orthogonal ``R``); a module that cannot be rotated
    (LayerNorm, a post-norm on a writer, a module of another kind reading the stream) raises
    RotationError naming it. Nothing of the model is changed here."""
    from fnmatch import fnmatchcase

    from .experts import LinearExperts
    from .models import final_norm, head_name

    names = {id(m): n for n, m in model.named_modules()}
    embedding = model.get_input_embeddings()
    hidden_size = embedding.weight.shape[1]
    shape = _head_shape(model.config)
    plan = RotationPlan(embeddings=[names[id(embedding)]], norms=[], readers=[], writers=[],
                        head_dim=shape[2] if shape else None, source="discovery")
    matched = dict.fromkeys(online, 0)
    M_res = _orthogonal(hidden_size, 3)
    for index, block in enumerate(blocks):
        prefix = f"{layers_path}.{index}"
        call = calls[index]
        roles = _block_roles(block, prefix, hidden, call, hidden_size)
        probe = _Probe(block, hidden, call)
        heads = _find_heads(probe, roles, shape, prefix, plan.notes)
        modules = dict(probe.block.named_modules())
        if residual:
            forms = {n: norm_form(block.get_submodule(n), f"{prefix}.{n}") for n, r in roles["norms"].items() if r}
            for n, form in forms.items():
                fold_norm(modules[n], [modules[r] for r in roles["norms"][n]], n, form)
            for n in roles["readers"]:
                rotate_input(modules[n], M_res)
            for n in roles["writers"]:
                rotate_output(modules[n], M_res)
        M_head = _orthogonal(shape[2], 2) if heads else None
        for v, o, rows in heads:
            rotate_output(modules[v], M_head, rows)
            rotate_input(modules[o], M_head)
        moved = probe.moved(M_res if residual else None)
        if moved > CHECK_TOLERANCE:
            raise RotationError(f"{prefix} ({type(block).__name__}): rotating its residual readers {roles['readers']} "
                                f"and writers {roles['writers']} changes its output by {moved:.2e} (relative): the "
                                "block reads or writes the residual stream in a way fp4ptq does not model")
        del probe
        if residual:
            for n, readers in roles["norms"].items():
                if readers:
                    plan.norms.append((f"{prefix}.{n}", [f"{prefix}.{r}" for r in readers]))
                    plan.norm_forms[f"{prefix}.{n}"] = forms[n]
            plan.readers += [f"{prefix}.{n}" for n in roles["readers"]]
            plan.writers += [f"{prefix}.{n}" for n in roles["writers"]]
        plan.heads += [(f"{prefix}.{v}", f"{prefix}.{o}") for v, o, _ in heads]
        plan.head_rows.update({f"{prefix}.{v}": rows for v, _, rows in heads if rows})
        experts = [n for n, m in block.named_modules() if isinstance(m, LinearExperts)]
        linear_names = [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]
        for pattern in online:
            hits = [n for n in linear_names if fnmatchcase(n, pattern)]
            inside = [n for n in hits if any(n.startswith(e + ".") for e in experts)]
            if inside:
                raise RotationError(f"online rotation {pattern!r} matches the expert linear {prefix}.{inside[0]}: "
                                    "the grouped MoE kernel runs the experts' weights without their input hooks, "
                                    "so fp4ptq rotates experts' inputs only offline")
            if not hits:
                plan.notes[f"{prefix} online {pattern}"] = f"no linear of {prefix} matches it"
            matched[pattern] += len(hits)
            plan.online += [f"{prefix}.{n}" for n in hits]
    missing = [p for p, count in matched.items() if not count]
    if missing:
        raise RotationError(f"online rotation {missing}: no linear of any decoder block matches (block 0's "
                            f"linears: {[n for n, m in blocks[0].named_modules() if isinstance(m, nn.Linear)]}); "
                            "name the linears with rotate_online (--rotate-online), or none (rotate_online=(), "
                            "--rotate-online '') to rotate offline only")
    if residual:
        _plan_outside(model, layers_path, plan, final_norm(model, layers_path), head_name(model))
    else:
        plan.embeddings = []
    return plan


def _plan_outside(model: nn.Module, layers_path: str, plan: RotationPlan, norm: Optional[str],
                  head: Optional[str]) -> None:
    """The final norm and the LM head; any other module with weights outside the blocks is refused."""
    top = {n: m for n, m in model.named_modules()
           if n and n != layers_path and not n.startswith(layers_path + ".")
           and any(True for _ in m.parameters(recurse=False))}
    known = set(plan.embeddings) | {norm, head}
    unknown = [n for n in top if n not in known]
    if unknown:
        raise RotationError(f"{unknown[0]} ({type(top[unknown[0]]).__name__}) lies outside the decoder blocks and is "
                            "neither the embedding, the final norm nor the LM head: fp4ptq cannot tell how it meets "
                            "the residual stream, so it does not rotate this model")
    if head is None or not isinstance(model.get_submodule(head), nn.Linear):
        raise RotationError(f"{type(model).__name__}: no linear LM head to take the residual rotation")
    if norm is not None:
        plan.norm_forms[norm] = norm_form(model.get_submodule(norm), norm)
        plan.norms.append((norm, [head]))
    plan.readers.append(head)


@torch.no_grad()
def rotate_model(model: nn.Module, plan: RotationPlan, block: int, *, seed: Optional[int] = 0,
                 head: str = "lm_head", probe: bool = True) -> dict:
    """Apply ``plan`` in place with rotation blocks of ``block`` (16, 32, 64 or 128; randomized
    signs from ``seed``, none when ``seed`` is None). The float model's function is unchanged:
    with ``probe``, the logits of one short synthetic sequence before and after are compared and a
    relative change above ``PROBE_TOLERANCE`` (of the model's dtype) raises RotationError (the model
    is then left rotated: reload it). Returns the record for the report (blocks used per location,
    what was folded and attached, the probe's figure)."""
    if block not in ROTATION_BLOCKS:
        raise RotationError(f"rotation block {block} is not one of {ROTATION_BLOCKS}")
    get = model.get_submodule
    hidden = model.get_input_embeddings().weight.shape[1]
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(vocab // 8, max(vocab // 2, vocab // 8 + 1), (1, PROBE_TOKENS),
                        generator=torch.Generator().manual_seed(0))
    before = _probe_logits(model, ids) if probe else None
    b_res = block_for(hidden, block) if plan.readers or plan.writers or plan.embeddings else None
    b_head = block_for(plan.head_dim, block) if plan.heads else None
    seeds = (None, None, None) if seed is None else (seed, seed + 1, seed + 2)
    M_res = hadamard_signs(b_res, seeds[0]) if b_res else None
    untied = _untie_head(model, head) if head in plan.readers else False

    for norm, readers in plan.norms:
        fold_norm(get(norm), [get(r) for r in readers], norm, plan.norm_forms.get(norm))
    for name in plan.embeddings:
        emb = get(name)
        _set(emb.weight, apply_blocks(emb.weight.double(), M_res))
    for name in plan.readers:
        rotate_input(get(name), M_res)
    for name in plan.writers:
        rotate_output(get(name), M_res)
    if plan.heads:
        M_head = hadamard_signs(b_head, seeds[1])
        for v, o in plan.heads:
            rotate_output(get(v), M_head, plan.head_rows.get(v))
            rotate_input(get(o), M_head)
    online_blocks = {}
    for name in plan.online:
        linear = get(name)
        b = block_for(linear.in_features, block)
        M = hadamard_signs(b, seeds[2])
        rotate_input(linear, M)
        attach_online(linear, OnlineHadamard(b, M, device=linear.weight.device))
        online_blocks[name] = b
    change = None
    if probe:
        after = _probe_logits(model, ids)
        change = _rel(after, before, before)
        dtype = next(model.parameters()).dtype
        bound = PROBE_TOLERANCE.get(dtype, PROBE_TOLERANCE[torch.bfloat16])
        if not math.isfinite(change) or change > bound:
            raise RotationError(f"{type(model).__name__}: the rotated model's logits differ from the original's by "
                                f"{change:.3g} (relative; {dtype} allows {bound:g}): the rotation plan "
                                f"({plan.source}) does not preserve this model's function (the model is left "
                                "rotated: reload it)")
    record = {
        "block": block,
        "randomized": seed is not None,
        "seed": seed,
        "residual_block": b_res,
        "head_block": b_head,
        "online": online_blocks,
        "folded_norms": [n for n, _ in plan.norms],
        "head_untied": untied,
        "plan": plan.source,
    }
    if change is not None:
        record["probe_logits_change"] = float(f"{change:.3g}")
    if plan.notes:
        record["notes"] = dict(plan.notes)
    return record


# Tokens of the function-preservation probe (ordinary ids from the vocabulary's middle: the first ids
# are special tokens on which half-precision models are chaotic), and the relative logits change it
# accepts per dtype: rotated weights are rounded back to the model's dtype, and a bf16 model's logits
# move by 2-3% from that alone (SmolLM2-135M, Qwen2.5-Coder-0.5B); a plan that is wrong moves them ~50-150%.
PROBE_TOKENS = 8
PROBE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.bfloat16: 0.15, torch.float16: 0.05}


@torch.no_grad()
def _probe_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    device = model.get_input_embeddings().weight.device
    return model(input_ids=ids.to(device), use_cache=False).logits.float()


def describe(info: Optional[dict]) -> Optional[str]:
    """One line for ``inspect``: the rotation record of a report."""
    if not info:
        return None
    online = sorted(set((info.get("online") or {}).values()))
    return (f"block-Hadamard {info.get('block')} ({'randomized, seed ' + str(info.get('seed')) if info.get('randomized') else 'not randomized'}): "
            f"residual {info.get('residual_block')}, per head {info.get('head_block')}, "
            f"online at {len(info.get('online') or {})} linears (block {online})"
            + (f"; plan from {info['plan']}" if info.get("plan") else "")
            + (f", logits change {info['probe_logits_change']:.2g}" if info.get("probe_logits_change") is not None
               else ""))


__all__ = [
    "OnlineHadamard", "ROTATION_BLOCKS", "RotationError", "RotationPlan", "TRANSFORM_GROUP", "TRANSFORM_MODULE",
    "apply_blocks", "attach_online", "block_for", "describe", "fold_norm", "hadamard_signs", "move_online",
    "norm_form", "online_transform", "plan_from_discovery", "plan_from_spec", "rotate_input", "rotate_model",
    "rotate_output", "sylvester_hadamard",
]
