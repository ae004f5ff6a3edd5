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

Which modules play which part comes as explicit lists (``RotationPlan``), for now
built from ``fp4ptq.models``' ArchSpec for Llama-family blocks (``plan_from_spec``).

The online rotations are recorded as compressed-tensors' ``transform_config``
(``compressed_tensors.transform.TransformConfig``: one ``hadamard`` or
``random-hadamard`` scheme, ``head_dim`` = the block, ``location: input``) inside
``quantization_config``; ``attach_from_config`` rebuilds them at load. The folded
(offline) rotations are already in the stored weights and are recorded in the
fp4ptq report only (a loader must not apply them again).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from .models import ArchSpec, UnsupportedArchitecture, decoder_blocks

from .config import ROTATION_BLOCKS  # noqa: E402 (one list, validated in QuantConfig)
TRANSFORM_GROUP = "online_hadamard"   # compressed-tensors names the module "{group}_{location}"
TRANSFORM_MODULE = f"{TRANSFORM_GROUP}_input"


class RotationError(ValueError):
    """A rotation cannot be applied (dimensions, norm type) or a transform_config cannot be read."""


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
    y = x.to(M.dtype).reshape(*x.shape[:-1], d // b, b) @ M
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
def rotate_output(linear: nn.Linear, M: torch.Tensor) -> None:
    """``W [out, in] -> R^T W`` and ``b -> b R`` (the linear now writes ``y R``)."""
    _set(linear.weight, apply_blocks(linear.weight.double().T, M).T)
    if linear.bias is not None:
        _set(linear.bias, apply_blocks(linear.bias.double(), M))


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
def fold_norm(norm: nn.Module, readers: list, name: str = "norm") -> None:
    """Fold an RMSNorm's weight into the linears reading its output (``W -> W diag(w)``), weight -> 1."""
    weight = _rms_norm_weight(norm, name)
    w = weight.double()
    for linear in readers:
        _set(linear.weight, linear.weight.double() * w.to(linear.weight.device))
    weight.data.fill_(1.0)


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


@torch.no_grad()
def rotate_model(model: nn.Module, plan: RotationPlan, block: int, *, seed: Optional[int] = 0,
                 head: str = "lm_head") -> dict:
    """Apply ``plan`` in place with rotation blocks of ``block`` (16, 32, 64 or 128; randomized
    signs from ``seed``, none when ``seed`` is None). The float model's function is unchanged.
    Returns the record for the report (blocks used per location, what was folded and attached)."""
    if block not in ROTATION_BLOCKS:
        raise RotationError(f"rotation block {block} is not one of {ROTATION_BLOCKS}")
    get = model.get_submodule
    hidden = model.get_input_embeddings().weight.shape[1]
    b_res = block_for(hidden, block) if plan.readers or plan.writers or plan.embeddings else None
    b_head = block_for(plan.head_dim, min(block, plan.head_dim)) if plan.heads else None
    seeds = (None, None, None) if seed is None else (seed, seed + 1, seed + 2)
    M_res = hadamard_signs(b_res, seeds[0]) if b_res else None
    untied = _untie_head(model, head) if head in plan.readers else False

    for norm, readers in plan.norms:
        fold_norm(get(norm), [get(r) for r in readers], norm)
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
            rotate_output(get(v), M_head)
            rotate_input(get(o), M_head)
    online_blocks = {}
    for name in plan.online:
        linear = get(name)
        b = block_for(linear.in_features, block)
        M = hadamard_signs(b, seeds[2])
        rotate_input(linear, M)
        attach_online(linear, OnlineHadamard(b, M, device=linear.weight.device))
        online_blocks[name] = b
    return {
        "block": block,
        "randomized": seed is not None,
        "seed": seed,
        "residual_block": b_res,
        "head_block": b_head,
        "online": online_blocks,
        "folded_norms": [n for n, _ in plan.norms],
        "head_untied": untied,
    }


# --------------------------------------------------------------------------- #
# compressed-tensors transform_config
# --------------------------------------------------------------------------- #
def transform_config(model: nn.Module, randomized: Optional[bool] = None) -> Optional[dict]:
    """The ``transform_config`` dict for ``quantization_config`` describing the model's online
    rotations (one scheme per block size), or None when it has none; validated against
    compressed-tensors' ``TransformConfig``."""
    by_size: dict = {}
    for name, module in model.named_modules():
        transform = online_transform(module)
        if transform is not None:
            by_size.setdefault(transform.weight.shape[0], []).append(name)
    if not by_size:
        return None
    if randomized is None:
        randomized = bool((getattr(model, "fp4ptq_info", None) or {}).get("rotation", {}).get("randomized", True))
    groups = {}
    for index, (size, targets) in enumerate(sorted(by_size.items())):
        key = TRANSFORM_GROUP if index == 0 else f"{TRANSFORM_GROUP}_{size}"
        groups[key] = {
            "type": "random-hadamard" if randomized else "hadamard",
            "apply": [{"targets": targets, "location": "input", "inverse": False, "ignore": []}],
            "randomize": False, "requires_grad": False, "head_dim": size, "precision": "float32",
        }
    if len(groups) > 1:
        raise RotationError("online rotations of several block sizes: compressed-tensors names the module after "
                            "its group, so one checkpoint holds one size")
    config = {"config_groups": groups}
    _validate(config)
    return config


def _validate(config: dict) -> None:
    try:
        from compressed_tensors.transform import TransformConfig
    except ImportError:   # the package is optional at load: the checks below still run
        return
    try:
        TransformConfig.model_validate(config)
    except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError, reported with the key
        raise RotationError(f"transform_config does not validate as compressed-tensors' TransformConfig: {exc}") from exc


def _targets(model: nn.Module, targets: list) -> list:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) or hasattr(m, "weight_packed")]
    out = []
    for target in targets:
        if target.startswith("re:"):
            out += [n for n in names if re.match(target[3:], n)]
        elif target in names:
            out.append(target)
    return list(dict.fromkeys(out))


def attach_from_config(model: nn.Module, config: Optional[dict], where: str, device=None) -> list:
    """Rebuild the online rotations a ``transform_config`` describes (their weights come from the
    checkpoint's ``{target}.{group}_input.weight``). Only what fp4ptq runs is accepted: hadamard /
    random-hadamard schemes at ``location: input``, not inverted, no permutation. Returns the targets."""
    if not config:
        return []
    _validate(config)
    attached = []
    for key, scheme in (config.get("config_groups") or {}).items():
        problem = None
        if scheme.get("type") not in ("hadamard", "random-hadamard"):
            problem = f"type {scheme.get('type')!r}"
        elif scheme.get("randomize"):
            problem = "randomize (permuted Hadamard) is set"
        elif key != TRANSFORM_GROUP:
            problem = f"group name {key!r} (fp4ptq reads {TRANSFORM_GROUP!r})"
        size = scheme.get("head_dim")
        for args in scheme.get("apply") or []:
            if problem is None and (args.get("location") != "input" or args.get("inverse")):
                problem = f"location {args.get('location')!r} inverse={args.get('inverse')} (fp4ptq runs online input rotations)"
            if problem:
                break
            targets = _targets(model, args.get("targets") or [])
            if not targets:
                problem = f"targets {args.get('targets')} match no linear of the model"
                break
            for name in targets:
                module = model.get_submodule(name)
                in_features = getattr(module, "in_features", None)
                if not size or in_features is None or in_features % size:
                    problem = f"head_dim {size} does not divide {name}'s input size {in_features}"
                    break
                attach_online(module, OnlineHadamard(size, device=device or "meta"))
                attached.append(name)
        if problem:
            raise RotationError(f"{where}: transform_config group {key!r}: {problem}; fp4ptq cannot apply it")
    return attached


def describe(info: Optional[dict]) -> Optional[str]:
    """One line for ``inspect``: the rotation record of a report."""
    if not info:
        return None
    online = sorted(set((info.get("online") or {}).values()))
    return (f"block-Hadamard {info.get('block')} ({'randomized, seed ' + str(info.get('seed')) if info.get('randomized') else 'not randomized'}): "
            f"residual {info.get('residual_block')}, per head {info.get('head_block')}, "
            f"online at {len(info.get('online') or {})} linears (block {online})")


__all__ = [
    "OnlineHadamard", "ROTATION_BLOCKS", "RotationError", "RotationPlan", "TRANSFORM_GROUP", "apply_blocks",
    "attach_from_config", "attach_online", "block_for", "describe", "fold_norm", "hadamard_signs", "move_online",
    "online_transform", "plan_from_spec", "rotate_input", "rotate_model", "rotate_output", "sylvester_hadamard",
    "transform_config",
]
