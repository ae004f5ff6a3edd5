"""Writing packed NVFP4 checkpoints: ``save``, and what it reads off the model to do so (the
``quantization_config`` or ModelOpt's config, the fused groups and their shared scales, the tensors in
their stored dtype under the original checkpoint's names, the report). What lands on disk, and why:
``fp4ptq/checkpoint.py``'s docstring; import these names from ``fp4ptq.checkpoint``, the checkpoint API.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from . import nvfp4, transforms
from .atomic import _write_json, atomic_directory
from .integrity import config_hash, tensor_hashes
from .layout import (
    _QUANT_BUFFERS,
    CONFIG_FILE,
    CONFIG_HASH_KEY,
    CT_FORMAT,
    CT_INPUT_ARGS,
    CT_QUANT_METHOD,
    CT_WEIGHT_ARGS,
    FORMATS,
    RECORD_KEY,
    HASHES_KEY,
    INDEX_FILE,
    MODELOPT_CONFIG_FILE,
    REPORT_FILE,
    STOCK_RUN_DTYPE,
    TIMING_KEYS,
    TOKENIZER_FILES,
    CheckpointError,
    _tied_targets,
)
from .modules import NVFP4Linear


# --------------------------------------------------------------------------- #
# The one place the scale convention is converted
# --------------------------------------------------------------------------- #
def divisor_to_multiplier(scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors stores global scales as divisors (``w = q * bs / global_enc``,
    ``input_global_scale = 6*448/amax``); ModelOpt stores their reciprocals as
    multipliers (``weight_scale_2 = 1/global_enc``, ``input_scale = amax/(6*448)``).
    One fp32 division, so ``q * bs * multiplier`` may differ from ``q * bs / divisor``
    in the last bit."""
    return (1.0 / scale.float()).reshape(())


# --------------------------------------------------------------------------- #
# What the model holds
# --------------------------------------------------------------------------- #
def nvfp4_layers(model: nn.Module) -> dict:
    """``{full module name: NVFP4Linear}`` in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, NVFP4Linear)}


def _high_precision_linears(model: nn.Module) -> list:
    """Linears kept in high precision, and the MoE routers (engines must not quantize them either)."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    high = (getattr(model, "fp4ptq_info", None) or {}).get("high_precision") or {}
    names += [n for n, reason in high.items() if "router" in str(reason) and n not in names]
    return names


def _act_four_six(layers: dict):
    """The W4A4 Four Over Six rule(s): one value when uniform, else ``{name: rule}``."""
    rules = {name: m.act_four_six for name, m in layers.items() if m.scheme == "w4a4"}
    values = set(rules.values())
    if len(values) <= 1:
        return values.pop() if values else None
    return rules


def _schemes(layers: dict) -> dict:
    by_scheme: dict = {}
    for name, m in layers.items():
        by_scheme.setdefault(m.scheme, []).append(name)
    return by_scheme


def compressed_tensors_config(model: nn.Module) -> dict:
    """``quantization_config`` for config.json (compressed-tensors ``nvfp4-pack-quantized``).

    One group targeting every ``Linear`` when all quantized layers share a
    scheme (``ignore`` then lists every linear kept in high precision, by full
    name), else one group per scheme targeting its layers by name.
    """
    layers = nvfp4_layers(model)
    if not layers:
        raise CheckpointError("the model has no NVFP4Linear layers: quantize it (fp4ptq.quantize) before saving")
    by_scheme = _schemes(layers)
    groups = {}
    for index, scheme in enumerate(sorted(by_scheme)):
        targets = ["Linear"] if len(by_scheme) == 1 else by_scheme[scheme]
        groups[f"group_{index}"] = {
            "targets": targets,
            "weights": dict(CT_WEIGHT_ARGS),
            "input_activations": dict(CT_INPUT_ARGS) if scheme == "w4a4" else None,
            "output_activations": None,
            "format": CT_FORMAT,
        }
    config = {
        "quant_method": CT_QUANT_METHOD,
        "format": CT_FORMAT,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": _high_precision_linears(model),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "moe_sparsity_config": None,
    }
    online = transforms.transform_config(model)  # issue 43: online rotations, compressed-tensors' keys
    if online is not None:
        config["transform_config"] = online
        transforms.guard_stock_loaders(config)   # stock transformers would drop them: make it refuse
    return config


def modelopt_config(model: nn.Module) -> dict:
    """The ``quantization`` section of ModelOpt's ``hf_quant_config.json``."""
    from . import __version__

    by_scheme = _schemes(nvfp4_layers(model))
    if len(by_scheme) != 1:
        raise CheckpointError(
            f"format='modelopt': the model mixes schemes {sorted(by_scheme)}; a ModelOpt checkpoint has one "
            "quant_algo. Quantize every layer with one scheme, or save with format='compressed-tensors'"
        )
    scheme = next(iter(by_scheme))
    return {
        "producer": {"name": "fp4ptq", "version": __version__},
        "quantization": {
            "quant_algo": "NVFP4" if scheme == "w4a4" else "W4A16_NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": nvfp4.BLOCK_SIZE,
            "exclude_modules": _high_precision_linears(model),
        },
    }


def fused_groups(model: nn.Module) -> Optional[list]:
    """``[(label, full module names)]`` of each fused group (q/k/v, gate/up: one GEMM and one weight
    global scale in serving engines): the sets discovery found when the model was quantized
    (``fp4ptq_info["fused_groups"]``), else the ``fp4ptq.models`` table's; None when neither exists."""
    from .models import UnsupportedArchitecture, arch_spec, decoder_blocks

    recorded = (getattr(model, "fp4ptq_info", None) or {}).get("fused_groups")
    if recorded is not None:
        return [("{" + ", ".join(names) + "}", list(names)) for names in recorded]
    try:
        spec = arch_spec(model)
    except UnsupportedArchitecture:
        return None
    return [(f"{spec.layers}.{index}.{{{', '.join(group.linears)}}}",
             [f"{spec.layers}.{index}.{name}" for name in group.linears])
            for index, _ in enumerate(decoder_blocks(model, spec)) for group in spec.groups if group.fused]


def unshared_fused_scales(model: nn.Module) -> Optional[list]:
    """Fused groups whose layers do not share one weight global scale (or are not all quantized).
    None when there is no record nor table of them (nothing could be checked)."""
    groups = fused_groups(model)
    if groups is None:
        return None
    problems = []
    for label, names in groups:
        modules = [model.get_submodule(name) for name in names]
        quantized = [m for m in modules if isinstance(m, NVFP4Linear)]
        if not quantized:
            continue
        first = quantized[0].weight_global_scale
        if len(quantized) != len(modules) or any(not torch.equal(m.weight_global_scale, first) for m in quantized):
            problems.append(label)
    return problems


# --------------------------------------------------------------------------- #
# Tensors to write
# --------------------------------------------------------------------------- #
def _state_dict(model: nn.Module) -> dict:
    """The model's tensors without tied duplicates (safetensors stores one copy)."""
    state = model.state_dict()
    for target, source in _tied_targets(model).items():
        if target in state and source in state and state[target].data_ptr() == state[source].data_ptr():
            del state[target]
    for name, tensor in state.items():
        if tensor.is_meta:
            raise CheckpointError(f"tensor {name} is on the meta device (offloaded?); load the whole model first")
        if tensor.dtype == torch.float8_e4m3fn:
            # E4M3FN has no Inf; NaN is exponent+mantissa all ones. Block scales are never negative.
            bits = tensor.view(torch.uint8)
            if bool(((bits & 0x7F) == 0x7F).any() | ((bits & 0x80) != 0).any()):
                raise CheckpointError(f"{name}: NaN or negative FP8 block scales; re-quantize this layer")
        elif tensor.is_floating_point():
            nvfp4.check_finite(tensor, name)
    return state


def _stored_dtypes(state: dict, layers: dict, dtype: torch.dtype) -> dict:
    """``state`` with every floating tensor but the quantized buffers in ``dtype`` (the packed codes,
    block scales and fp32 global scales keep theirs)."""
    quant_names = {f"{name}.{buffer}" for name in layers for buffer in _QUANT_BUFFERS}
    out = {}
    for name, tensor in state.items():
        if name not in quant_names and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
            nvfp4.check_finite(tensor, f"{name} in {dtype}")   # e.g. an fp32 value beyond fp16's range
        out[name] = tensor
    return out


def _modelopt_state_dict(state: dict, layers: dict) -> dict:
    """Rename compressed-tensors tensors to ModelOpt's names (scales as multipliers)."""
    out = dict(state)
    for name, layer in layers.items():
        out[f"{name}.weight"] = out.pop(f"{name}.weight_packed")
        out[f"{name}.weight_scale_2"] = divisor_to_multiplier(out.pop(f"{name}.weight_global_scale"))
        if layer.scheme == "w4a4":
            out[f"{name}.input_scale"] = divisor_to_multiplier(out.pop(f"{name}.input_global_scale"))
    return out


def _tensor_bytes(state: dict, layers: dict) -> dict:
    def nbytes(tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    quant_names = {f"{name}.{buffer}" for name in layers for buffer in _QUANT_BUFFERS}
    quant = {n: t for n, t in state.items() if n in quant_names}
    packed = sum(nbytes(t) for n, t in quant.items() if n.endswith(".weight_packed"))
    scales = sum(nbytes(t) for t in quant.values()) - packed
    total = sum(nbytes(t) for t in state.values())
    quant_params = sum(m.in_features * m.out_features for m in layers.values())
    return {
        "packed_weights": packed,
        "scales": scales,
        "high_precision": total - packed - scales,
        "total": total,
        "quantized_weight_elements": quant_params,
        "bits_per_quantized_weight": 8.0 * (packed + scales) / max(quant_params, 1),
    }


# --------------------------------------------------------------------------- #
# Save
# --------------------------------------------------------------------------- #
def _write_shards(state: dict, directory: Path, max_shard_size, metadata: dict) -> dict:
    """Safetensors shards (+ index when there is more than one); returns ``{file: bytes}``."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    umask = os.umask(0)
    os.umask(umask)
    files = {}
    for filename, names in tqdm(split.filename_to_tensors.items(), desc="Writing shards",
                                disable=len(split.filename_to_tensors) < 2):
        shard = {name: state[name].detach().to("cpu").contiguous() for name in names}
        save_file(shard, str(directory / filename), metadata={"format": "pt", **metadata})
        _sort_header(directory / filename)
        # safetensors writes through a private temp file (mode 0600): give shards the usual mode.
        os.chmod(directory / filename, 0o666 & ~umask)
        files[filename] = (directory / filename).stat().st_size
    if split.is_sharded:
        _write_json(directory / INDEX_FILE, {"metadata": dict(split.metadata), "weight_map": split.tensor_to_filename})
    return files


def _sort_header(file: Path) -> None:
    """safetensors writes ``__metadata__`` from a hash map, in an order that changes from one process
    to the next: rewrite the header in place with sorted keys (the same compact JSON, so never longer;
    padded with spaces, as the format allows), so identical tensors give identical files."""
    with open(file, "r+b") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
        text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > length:   # cannot happen for safetensors' own compact JSON
            raise CheckpointError(f"{file}: cannot sort its header in place")
        handle.seek(8)
        handle.write(text.ljust(length, b" "))



def _strip_timings(data):
    """``data`` without the run-time keys (TIMING_KEYS), at any depth."""
    if isinstance(data, dict):
        return {k: _strip_timings(v) for k, v in data.items() if k not in TIMING_KEYS}
    if isinstance(data, list):
        return [_strip_timings(v) for v in data]
    return data


def _save_tokenizer(model: nn.Module, tokenizer, directory: Path) -> Optional[str]:
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
        return "tokenizer object"
    source = Path(str(getattr(getattr(model, "config", None), "_name_or_path", "") or ""))
    copied = [f for f in TOKENIZER_FILES if source.is_dir() and (source / f).is_file()]
    for name in copied:
        shutil.copyfile(source / name, directory / name)
    if copied:
        return str(source)
    warnings.warn("save: no tokenizer given and none found beside the source model; the checkpoint has no "
                  "tokenizer files (pass tokenizer=...)", stacklevel=3)
    return None


def _config_dict(model: nn.Module, quantization_config: dict, layers: dict, dtype: torch.dtype,
                 format: str = "compressed-tensors") -> dict:
    from . import __version__

    config = json.loads(model.config.to_json_string(use_diff=True))
    config["quantization_config"] = quantization_config
    # Engines (vLLM, SGLang, TensorRT-LLM) pick the model class from it; GGUF-built configs lack it.
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    stored = str(dtype).removeprefix("torch.")
    run = STOCK_RUN_DTYPE if format == "compressed-tensors" else dtype
    config["dtype"] = str(run).removeprefix("torch.")
    config.pop("torch_dtype", None)
    # A quantized tied target (e.g. lm_head tied to the embeddings) is no longer tied.
    if any(target.removesuffix(".weight") in layers for target in _tied_targets(model)):
        config["tie_word_embeddings"] = False
    config[RECORD_KEY] = {"version": __version__, "act_four_six": _act_four_six(layers), "report": REPORT_FILE,
                          "dtype": stored}
    return config


def _model_dtype(model: nn.Module, layers: dict) -> torch.dtype:
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    if floats:
        return max(set(floats), key=floats.count)
    return next(iter(layers.values())).dtype


def _dtype_named(name) -> Optional[torch.dtype]:
    dtype = getattr(torch, str(name or "").removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def stored_dtype(model: nn.Module, layers: dict) -> torch.dtype:
    """What ``save`` stores unquantized tensors in by default: the dtype the source model was stored
    in (``fp4ptq_info["source"]["dtype"]``, recorded by ``load_source_model`` via the CLI), else the
    dtype of the checkpoint the model was loaded from, else the model's own."""
    info = getattr(model, "fp4ptq_info", None) or {}
    for record in (info.get("source"), info.get("checkpoint")):
        dtype = _dtype_named((record or {}).get("dtype"))
        if dtype is not None:
            return dtype
    return _model_dtype(model, layers)


def _no_layers_error(model: nn.Module) -> CheckpointError:
    high = (getattr(model, "fp4ptq_info", None) or {}).get("high_precision") or {}
    if high:
        reasons = sorted({reason for reason in high.values()})
        return CheckpointError(
            f"no layer could be quantized: all {len(high)} linears stay in high precision ("
            + "; ".join(reasons[:3]) + "), so there is nothing to save as NVFP4")
    return CheckpointError("the model has no NVFP4Linear layers: quantize it (fp4ptq.quantize) before saving")


def _base_report(model: nn.Module, layers: dict) -> dict:
    """``model.fp4ptq_info`` or, for a model quantized by hand, what can be read off it."""
    from . import __version__

    info = getattr(model, "fp4ptq_info", None)
    if info:
        return json.loads(json.dumps(info))
    return {
        "fp4ptq_version": __version__,
        "config": None,
        "calibration": None,
        "layers": {
            name: {"shape": [m.out_features, m.in_features], "scheme": m.scheme, "rel_error": None, "four_share": None}
            for name, m in layers.items()
        },
        "high_precision": {name: "not quantized" for name in _high_precision_linears(model)},
        "note": "model.fp4ptq_info was absent (quantized outside fp4ptq.quantize); per-layer errors unknown",
    }


def _original_names(model: nn.Module, tensors: dict, quantization_config: dict) -> tuple:
    """Tensors (and ``ignore`` entries) under the names of the model type's original
    checkpoints, as transformers' ``save_pretrained`` writes them (``fp4ptq.models.checkpoint_names``)."""
    from .models import checkpoint_names

    names = checkpoint_names(model, tensors)
    if all(k == v for k, v in names.items()):
        return tensors, quantization_config
    ignore = quantization_config.get("ignore")
    if ignore:
        renamed = checkpoint_names(model, [f"{n}.weight" for n in ignore])
        quantization_config = {**quantization_config,
                               "ignore": [renamed[f"{n}.weight"].removesuffix(".weight") for n in ignore]}
    return {names[k]: v for k, v in tensors.items()}, quantization_config




def save(
    model: nn.Module,
    path: str | Path,
    *,
    tokenizer=None,
    overwrite: bool = False,
    format: str = "compressed-tensors",
    max_shard_size: int | str = "5GB",
    check_fused_scales: bool = True,
    dtype: Optional[torch.dtype] = None,
) -> Path:
    """Write ``model`` (with ``NVFP4Linear`` layers) as a packed checkpoint at ``path``.

    format: "compressed-tensors" (vLLM, SGLang, transformers, ``fp4ptq.load``)
            or "modelopt" (TensorRT-LLM; vLLM's ``modelopt_fp4``).
    max_shard_size: bytes or a string like "5GB"; a tensor larger than it gets its own shard.
    check_fused_scales: q/k/v and gate/up must share one weight global scale
            (engines fuse them into one GEMM with one scale); a model that breaks
            this is an error unless this is False.
    dtype:  dtype of the unquantized tensors on disk (default: ``stored_dtype``, the
            source model's); the packed codes and scales keep theirs.
    Returns the checkpoint directory.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown checkpoint format {format!r}; choose one of {FORMATS}")
    layers = nvfp4_layers(model)
    if not layers:
        raise _no_layers_error(model)
    if getattr(model, "config", None) is None:
        raise CheckpointError(f"{type(model).__name__} has no Hugging Face config; save needs a transformers model")
    unshared = unshared_fused_scales(model)
    if unshared and check_fused_scales:
        raise CheckpointError(
            f"fused layers do not share one weight global scale in {len(unshared)} place(s), e.g. "
            f"{unshared[:3]}; engines that fuse q/k/v and gate/up (vLLM, SGLang, TensorRT-LLM) use one "
            "scale for the fused matrix and would decode these wrongly. A group partly kept in high precision "
            "(QuantConfig.ignore naming one member) must be ignored whole: name every member (the CLI's "
            "--ignore does so itself); quantize with a shared amax (fp4ptq.quantize does); or, for a "
            "checkpoint only fp4ptq/transformers load, pass check_fused_scales=False (Python API only)"
        )
    dtype = dtype or stored_dtype(model, layers)
    state = _stored_dtypes(_state_dict(model), layers, dtype)
    report = _strip_timings(_base_report(model, layers))
    if format == "modelopt" and transforms.transform_config(model) is not None:
        raise CheckpointError("the model has online rotations (issue 43), which ModelOpt's layout cannot record; "
                              "save with format='compressed-tensors'")
    if format == "modelopt":
        quantization_config = {"quant_method": "modelopt", **modelopt_config(model)["quantization"]}
        tensors = _modelopt_state_dict(state, layers)
    else:
        quantization_config = compressed_tensors_config(model)
        tensors = state
    tensors, quantization_config = _original_names(model, tensors, quantization_config)
    config = _config_dict(model, quantization_config, layers, dtype, format)

    with atomic_directory(path, overwrite) as directory:
        files = _write_shards(tensors, directory, max_shard_size, {"producer": "fp4ptq", "layout": format})
        tokenizer_source = _save_tokenizer(model, tokenizer, directory)
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None and hasattr(model, "can_generate") and model.can_generate():
            generation_config.save_pretrained(str(directory))
        if format == "modelopt":
            _write_json(directory / MODELOPT_CONFIG_FILE, modelopt_config(model))
        report["checkpoint"] = {
            "format": format,
            "layout": CT_FORMAT if format == "compressed-tensors" else "modelopt NVFP4",
            "dtype": config[RECORD_KEY]["dtype"],
            "files": files,
            "file_bytes": sum(files.values()),
            "tensor_bytes": _tensor_bytes(state, layers),
            "fused_global_scales": "unchecked (no architecture table)" if unshared is None
            else ("shared" if not unshared else f"NOT shared: {unshared}"),
            "tokenizer": tokenizer_source,
            "act_four_six": config[RECORD_KEY]["act_four_six"],
            HASHES_KEY: tensor_hashes([directory / name for name in files]),
            CONFIG_HASH_KEY: config_hash(config),
        }
        _write_json(directory / REPORT_FILE, report)
        _write_json(directory / CONFIG_FILE, config)   # last: a partial directory never has it
    return Path(path).expanduser().absolute()

