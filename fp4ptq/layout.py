"""The checkpoint's layout on disk: file names and compressed-tensors constants, reading and
validating safetensors headers (every field), the ``quantization_config`` parser, and the plan of
which linears are NVFP4 layers. ``fp4ptq.checkpoint`` writes and loads with these."""
from __future__ import annotations

import json
import logging
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch
from torch import nn

from . import nvfp4
from .modules import NVFP4Linear

FORMATS = ("compressed-tensors", "modelopt")
CT_FORMAT = "nvfp4-pack-quantized"
CT_QUANT_METHOD = "compressed-tensors"
CONFIG_FILE = "config.json"
REPORT_FILE = "fp4ptq_report.json"
MODELOPT_CONFIG_FILE = "hf_quant_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
RECORD_KEY = "fp4ptq"   # top-level config.json key for what only fp4ptq reads
# Tokenizer files copied from a local source model directory when no tokenizer object is given.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)

# The NVFP4 arguments of a compressed-tensors config group, exactly as the
# compressed-tensors package dumps its NVFP4A16 / NVFP4 presets
# (QuantizationArgs.model_dump; tests/test_checkpoint.py compares them).
_NVFP4_ARGS = {
    "num_bits": 4, "type": "float", "symmetric": True, "group_size": nvfp4.BLOCK_SIZE,
    "strategy": "tensor_group", "scale_dtype": "torch.float8_e4m3fn",
}
CT_WEIGHT_ARGS = {**_NVFP4_ARGS, "dynamic": False}
# Activations: static global scale (input_global_scale), block scales computed at run time.
CT_INPUT_ARGS = {**_NVFP4_ARGS, "dynamic": "local", "observer": "static_minmax"}

# safetensors dtype names (header "dtype") -> torch dtypes.
_ST_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_QUANT_BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
# The dtype compressed-tensors decompresses NVFP4 weights to (its unpack default, no option), hence the
# config.json "dtype" under which stock transformers runs our checkpoints with default arguments.
STOCK_RUN_DTYPE = torch.bfloat16
# Report keys that differ between identical runs (run times, peak memory): kept out of the written
# report so identical runs give identical files (the CLI prints them).
TIMING_KEYS = ("elapsed_s", "seconds", "peak_memory")
HASHES_KEY = "tensor_xxh3_128"
# SHA-256 of what in config.json decides how the tensors are read (HASHED_CONFIG_KEYS); other fields
# (generation settings, max_position_embeddings, ...) may be edited without failing verification.
CONFIG_HASH_KEY = "config_quantization_sha256"
HASHED_CONFIG_KEYS = ("architectures", "model_type", "quantization_config", RECORD_KEY)
LEGACY_CONFIG_HASH_KEY = "config_sha256"   # the whole config.json, written before the key above
_log = logging.getLogger("fp4ptq")


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read; the message names the file/tensor and what to do."""



def _tied_targets(model: nn.Module) -> dict:
    """``{tied parameter name: the name it is tied to}`` (transformers' table)."""
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    return dict(tied) if isinstance(tied, dict) else {}



# --------------------------------------------------------------------------- #
# Reading: headers, validation, the layer plan
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class TensorInfo:
    dtype: str            # safetensors dtype name, e.g. "F8_E4M3"
    shape: tuple
    file: str
    offsets: tuple = (0, 0)   # [begin, end) in the data section


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_problem(name, entry) -> Optional[str]:
    """What is wrong with one tensor entry of a safetensors header (None: nothing)."""
    if not isinstance(entry, dict):
        return f"tensor {name!r}: its entry is {type(entry).__name__}, not an object"
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            return f"tensor {name!r}: field {field!r} is missing"
    unknown = sorted(set(entry) - {"dtype", "shape", "data_offsets"})
    if unknown:
        return f"tensor {name!r}: unknown field(s) {unknown}"
    if not isinstance(entry["dtype"], str) or entry["dtype"] not in _ST_DTYPES:
        return f"tensor {name!r}: field 'dtype' is {entry['dtype']!r}, not a safetensors dtype fp4ptq reads"
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        return f"tensor {name!r}: field 'shape' is {shape!r}, not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        return f"tensor {name!r}: field 'data_offsets' is {offsets!r}, not [begin, end]"
    nbytes = math.prod(shape) * _ST_DTYPES[entry["dtype"]].itemsize
    if offsets[1] - offsets[0] != nbytes:
        return (f"tensor {name!r}: field 'data_offsets' spans {offsets[1] - offsets[0]} bytes but its shape "
                f"{shape} {entry['dtype']} needs {nbytes}")
    return None


def read_safetensors_header(file: str | Path) -> dict:
    """``{tensor name: TensorInfo}`` of one safetensors file, reading only its header.
    Raises ``CheckpointError`` for a truncated or corrupt file (size checked
    against the data offsets the header declares)."""
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: {size} bytes, too short to be a safetensors file (truncated?)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CheckpointError(
                f"{file}: truncated: its header declares {header_len} header bytes but the file has {size}; "
                "re-copy or re-download it"
            )
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise CheckpointError(f"{file}: corrupt safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{file}: corrupt safetensors header: field '__metadata__' is not an object of "
                              "strings; the file is damaged")
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        problem = _entry_problem(name, entry)
        if problem:
            raise CheckpointError(f"{file}: corrupt safetensors header: {problem}; the file is damaged")
        tensors[name] = TensorInfo(entry["dtype"], tuple(entry["shape"]), str(file), tuple(entry["data_offsets"]))
    # The data section is the tensors back to back, without gaps or overlaps (the format's rule).
    data_end = 0
    for name, info in sorted(tensors.items(), key=lambda item: item[1].offsets):
        if info.offsets[0] != data_end:
            raise CheckpointError(
                f"{file}: corrupt safetensors header: tensor {name!r} field 'data_offsets' {list(info.offsets)} "
                f"{'overlaps the previous tensor' if info.offsets[0] < data_end else 'leaves a gap'} "
                f"(expected it to begin at {data_end}); the file is damaged")
        data_end = info.offsets[1]
    expected = 8 + header_len + data_end
    if size < expected:
        raise CheckpointError(
            f"{file}: truncated: the header says the file holds {expected} bytes, it has {size} "
            f"({expected - size} missing); re-copy or re-download it"
        )
    return tensors


def _index_shards(index: Path) -> list:
    """The shard file names ``model.safetensors.index.json`` maps tensors to; a damaged index is a
    ``CheckpointError`` naming the file and the field."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{index} is not valid JSON ({exc}); the file is damaged") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{index} is a JSON {type(data).__name__}, not an object; the file is damaged")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: field 'weight_map' is {str(weight_map)[:60]!r}, not an object of "
                              "{tensor name: shard file}; the file is damaged")
    bad = next(((k, v) for k, v in weight_map.items()
                if not isinstance(v, str) or not v or Path(v).name != v), None)
    if bad is not None:
        raise CheckpointError(f"{index}: field 'weight_map' maps {bad[0]!r} to {str(bad[1])[:60]!r}, not a shard "
                              "file name; the file is damaged")
    return sorted(set(weight_map.values()))


def checkpoint_files(path: Path) -> list:
    """The safetensors files of a checkpoint directory (from the index when sharded)."""
    index = path / INDEX_FILE
    if index.is_file():
        names = _index_shards(index)
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard(s) {missing} that are not in {path}; the copy is incomplete")
        return [path / n for n in names]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise CheckpointError(f"{path} has no {SINGLE_FILE} nor {INDEX_FILE}: not a safetensors checkpoint")


def read_headers(files: Iterable[str | Path]) -> dict:
    tensors = {}
    for file in files:
        for name, info in read_safetensors_header(file).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name} is in both {tensors[name].file} and {info.file}")
            tensors[name] = info
    return tensors


@dataclass(frozen=True)
class LayerPlan:
    scheme: str                      # "w4a16" | "w4a4"
    act_four_six: Optional[str]


def _args_problem(args, expected: dict, what: str) -> Optional[str]:
    if not isinstance(args, dict):
        return f"{what} is {args!r}"
    for key in ("num_bits", "type", "group_size", "strategy", "symmetric"):
        if args.get(key, expected[key]) != expected[key]:
            return f"{what}.{key} = {args.get(key)!r} (fp4ptq reads {expected[key]!r})"
    if what.endswith("input_activations") and args.get("dynamic") != "local":
        return f"{what}.dynamic = {args.get('dynamic')!r} (fp4ptq reads 'local': static global, run-time block scales)"
    return None


def _patterns_problem(patterns, what: str) -> Optional[str]:
    """What is wrong with a list of compressed-tensors targets (None: nothing)."""
    if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
        return f"{what} is {patterns!r}, not a list of names"
    for pattern in patterns:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as exc:
                return f"{what}: bad regex {pattern!r} ({exc})"
    return None


def parse_quantization_config(qcfg, where: str) -> tuple:
    """Check a compressed-tensors ``quantization_config`` describes NVFP4 that
    fp4ptq runs; return ``([(targets, scheme), ...], ignore)``."""
    if not isinstance(qcfg, dict):
        raise CheckpointError(f"{where}: no quantization_config; this is not a quantized checkpoint "
                              "(load it with transformers, or quantize it with fp4ptq first)")
    method = qcfg.get("quant_method")
    if method == "modelopt":
        raise CheckpointError(f"{where}: a ModelOpt export (for TensorRT-LLM / vLLM modelopt_fp4); fp4ptq loads "
                              "compressed-tensors checkpoints: save with format='compressed-tensors'")
    if method != CT_QUANT_METHOD:
        raise CheckpointError(f"{where}: quant_method {method!r} is not supported; fp4ptq loads {CT_QUANT_METHOD!r}")
    problems = []
    for key in ("kv_cache_scheme", "sparsity_config"):   # (transform_config: transforms.attach_from_config)
        if qcfg.get(key):
            problems.append(f"{key} is set (fp4ptq runs neither KV-cache quantization nor sparsity)")
    if (qcfg.get("quantization_status") or "compressed") != "compressed":
        problems.append(f"quantization_status = {qcfg.get('quantization_status')!r} (needs 'compressed')")
    groups = []
    config_groups = qcfg.get("config_groups") or {}
    if not isinstance(config_groups, dict):
        problems.append(f"config_groups is {type(config_groups).__name__}, not an object")
        config_groups = {}
    for name, group in config_groups.items():
        if not isinstance(group, dict):
            problems.append(f"group {name} is {type(group).__name__}, not an object")
            continue
        targets_problem = _patterns_problem(group.get("targets"), f"group {name}.targets")
        if targets_problem:
            problems.append(targets_problem)
            continue
        fmt = group.get("format") or qcfg.get("format")
        if fmt != CT_FORMAT:
            problems.append(f"group {name}: format {fmt!r} (fp4ptq reads {CT_FORMAT!r})")
        problem = _args_problem(group.get("weights"), CT_WEIGHT_ARGS, f"group {name}.weights")
        inputs = group.get("input_activations")
        if problem is None and inputs is not None:
            problem = _args_problem(inputs, CT_INPUT_ARGS, f"group {name}.input_activations")
        if group.get("output_activations"):
            problem = f"group {name}.output_activations is set (not supported)"
        if problem:
            problems.append(problem)
        groups.append((list(group.get("targets") or []), "w4a4" if inputs else "w4a16"))
    if not groups and not problems:
        problems.append("config_groups is empty")
    ignore_problem = _patterns_problem(qcfg.get("ignore") or [], "ignore")
    if ignore_problem:
        problems.append(ignore_problem)
    if problems:
        raise CheckpointError(f"{where}: quantization_config is not NVFP4 as fp4ptq runs it: " + "; ".join(problems))
    return groups, list(qcfg.get("ignore") or [])


def _matches(name: str, module: nn.Module, target: str) -> bool:
    """compressed-tensors' target syntax: ``re:<regex>`` (re.match on the module
    name), an exact module name, or a module class name (any base class)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or any(cls.__name__ == target for cls in type(module).__mro__)


def plan_layers(model: nn.Module, qcfg: dict, headers: dict, act_four_six, where: str) -> dict:
    """``{module name: LayerPlan}`` for the linears the config quantizes, cross-checked
    with the tensors in the files (``headers``)."""
    groups, ignore = parse_quantization_config(qcfg, where)
    plan = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        scheme = next((s for targets, s in groups if any(_matches(name, module, t) for t in targets)), None)
        if scheme is None or any(_matches(name, module, t) for t in ignore):
            continue
        if isinstance(act_four_six, dict):
            rule = act_four_six.get(name)
        else:
            rule = act_four_six
        plan[name] = LayerPlan(scheme, rule if scheme == "w4a4" else None)

    packed = {n.removesuffix(".weight_packed") for n in headers if n.endswith(".weight_packed")}
    problems = []
    if sorted(packed - set(plan)):
        problems.append(f"the files hold packed weights for {sorted(packed - set(plan))[:5]} which the config "
                        "does not quantize (or which are not linear layers of this model)")
    if sorted(set(plan) - packed):
        problems.append(f"the config quantizes {sorted(set(plan) - packed)[:5]} but the files have no "
                        "weight_packed for them")
    for name, layer in plan.items():
        has_input = f"{name}.input_global_scale" in headers
        if layer.scheme == "w4a4" and not has_input and name in packed:
            problems.append(f"{name}: W4A4 in the config but no input_global_scale in the files")
        if layer.scheme == "w4a16" and has_input:
            problems.append(f"{name}: W4A16 in the config but the files hold an input_global_scale")
    if problems:
        raise CheckpointError(f"{where}: config and tensors do not match: " + "; ".join(problems))
    return plan


def swap_in_nvfp4(model: nn.Module, plan: dict, dtype: torch.dtype) -> None:
    """Replace the planned ``nn.Linear`` modules by empty ``NVFP4Linear`` on the meta device."""
    for name, layer in plan.items():
        linear = model.get_submodule(name)
        try:
            new = NVFP4Linear(linear.in_features, linear.out_features, linear.bias is not None,
                              scheme=layer.scheme, act_four_six=layer.act_four_six, dtype=dtype, device="meta")
        except ValueError as exc:
            raise CheckpointError(f"layer {name}: {exc}") from exc
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)


def check_tensors(model: nn.Module, headers: dict, where: str) -> None:
    """Every tensor the model expects is in the files with the right shape, and
    quantized tensors with their exact dtype; no unknown tensors."""
    expected = model.state_dict()
    tied = set(_tied_targets(model))
    missing = [n for n in expected if n not in headers and n not in tied]
    unexpected = [n for n in headers if n not in expected]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s), e.g. {missing[:5]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s), e.g. {unexpected[:5]}")
    for name, info in headers.items():
        if name not in expected:
            continue
        want = expected[name]
        if tuple(want.shape) != info.shape:
            problems.append(f"{name} has shape {list(info.shape)} in {Path(info.file).name}, the model needs "
                            f"{list(want.shape)}")
        have = _ST_DTYPES.get(info.dtype)
        quantized = name.rpartition(".")[2] in _QUANT_BUFFERS
        if quantized and have != want.dtype:
            problems.append(f"{name} is {info.dtype} in {Path(info.file).name}, must be {want.dtype}")
        elif not quantized and (have is None or have.is_floating_point != want.dtype.is_floating_point):
            problems.append(f"{name} is {info.dtype}, the model holds {want.dtype}")
    if problems:
        raise CheckpointError(f"{where}: tensors do not fit the model: " + "; ".join(problems))


