"""Online rotations as compressed-tensors' ``transform_config`` (issue 43), and who applies it.

``transform_config`` (inside ``quantization_config``, where compressed-tensors' ``ModelCompressor``
writes it) holds one ``TransformScheme`` (``compressed_tensors.transform``): ``type`` ``hadamard``
(Sylvester, what compressed-tensors regenerates exactly) or ``random-hadamard`` (our signed
Sylvester blocks, which only the stored weights reproduce), ``head_dim`` = the block (the matrix is
block-diagonal), ``randomize: false`` (no permutation), ``precision: float32``, applied at
``location: input`` (online, ``inverse: false``) to the listed linears. Its weights are stored
unnormalized (+-1, float32) under ``{linear}.{group}_input.weight``, the name compressed-tensors'
``TransformFactory`` gives the submodule it attaches (``{group}_{location}``); every reader divides
by ``sqrt(head_dim)``. The keys are validated against the installed package's ``TransformConfig``.

Who applies it (read from the installed packages' sources):

* compressed-tensors 0.20.1: ``apply_transform_config(model, config)`` attaches the transforms
  (forward pre-hooks), regenerating the matrices (a loader that then loads the checkpoint's state
  dict gets ours, names included: ``tests/test_rotation.py`` checks it on our checkpoints).
  Nothing in its decompression path calls it.
* transformers 5.25: never. ``CompressedTensorsConfig`` passes ``transform_config`` to
  compressed-tensors' ``QuantizationConfig``, which ignores unknown keys, and its quantizer never
  calls ``apply_transform_config``: the rotation weights load as UNEXPECTED and are dropped, and the
  model runs without its online rotations, giving wrong logits without an error (an audit measured a
  mean relative 0.27 from fp4ptq.load's logits on SmolLM2). There is no config field that makes it apply them.
* vLLM (not run here): applies input transforms (``hadamard`` with its Hadamard kernel,
  ``random-hadamard`` with the stored weights); it reads a config group's keys one by one.
* fp4ptq (``fp4ptq.load``, ``from_pretrained`` after ``import fp4ptq``): ``attach_from_config``.

So that stock transformers fails loudly instead of silently, every config group of a checkpoint
with online rotations carries the key ``STOCK_GUARD_KEY``, which compressed-tensors'
``QuantizationScheme`` (``extra="forbid"``) refuses: transformers' ``from_pretrained`` stops with a
validation error naming the key, before any weight loads. vLLM and fp4ptq ignore it (fp4ptq's
transformers hook drops it before transformers parses the config). A checkpoint rotated offline
only (``--rotate-online ''``) has no transform_config, no guard, and runs anywhere.
"""
from __future__ import annotations

import re
from typing import Optional

from torch import nn

from .rotation import TRANSFORM_GROUP, OnlineHadamard, RotationError, attach_online, online_transform

STOCK_GUARD_KEY = "online_rotations_need_a_loader_that_applies_transform_config"
STOCK_GUARD_TEXT = ("this checkpoint runs its linears' inputs through online Hadamard rotations "
                    "(quantization_config.transform_config) that transformers' compressed-tensors "
                    "integration does not apply: load it with fp4ptq (import fp4ptq before from_pretrained, or "
                    "fp4ptq.load) or vLLM; quantize with --rotate-online '' for a checkpoint every loader runs")


def guard_stock_loaders(config: dict) -> dict:
    """Put ``STOCK_GUARD_KEY`` into every config group of a ``quantization_config`` that has a
    ``transform_config`` (in place; returned)."""
    if config.get("transform_config"):
        for group in (config.get("config_groups") or {}).values():
            group[STOCK_GUARD_KEY] = STOCK_GUARD_TEXT
    return config


def without_guard(config_groups):
    """``config_groups`` less ``STOCK_GUARD_KEY`` (a copy; anything that is not a dict as it is)."""
    if not isinstance(config_groups, dict):
        return config_groups
    return {name: ({k: v for k, v in group.items() if k != STOCK_GUARD_KEY} if isinstance(group, dict) else group)
            for name, group in config_groups.items()}


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


__all__ = ["STOCK_GUARD_KEY", "attach_from_config", "guard_stock_loaders", "transform_config", "without_guard"]
