"""Packed NVFP4 checkpoints: ``save`` and ``load`` (see the shared docs, NVFP4.md, "Checkpoint layout").

On disk (``format="compressed-tensors"``, what vLLM, SGLang and transformers read
through the ``compressed-tensors`` package, format ``nvfp4-pack-quantized``), per
quantized linear ``P`` (exactly the buffers of ``NVFP4Linear``):

    P.weight_packed        uint8          [out, in/2]   codes, even element in the low nibble
    P.weight_scale         float8_e4m3fn  [out, in/16]  block scales
    P.weight_global_scale  float32        [1]           global_enc, a divisor
    P.input_global_scale   float32        [1]           W4A4 only: 6*448/input_amax, a divisor
    P.bias                 model dtype    [out]         when the layer has one

plus every other tensor of the model in its own dtype, sharded safetensors
(``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + index),
``config.json`` with ``quantization_config`` (keys checked against the
compressed-tensors package by the tests), the generation config, tokenizer
files and ``fp4ptq_report.json`` (how the model was made, per-layer errors,
tensor bytes).

Four Over Six for run-time activation quantization (W4A4) is ours alone: it is
stored under the top-level ``config.json`` key ``"fp4ptq"``, which other
loaders ignore and transformers keeps (it survives a ``save_pretrained``).
Engines that do not know it quantize activations with the standard scale,
which is still a correct NVFP4 model.

``format="modelopt"`` writes NVIDIA Model Optimizer's layout for TensorRT-LLM
(``P.weight``, ``P.weight_scale``, ``P.weight_scale_2``, ``P.input_scale``,
``hf_quant_config.json``). ModelOpt stores multipliers where compressed-tensors
stores divisors; ``divisor_to_multiplier`` is the one place that converts.

Unquantized tensors are stored in the source model's dtype (``save(dtype=...)``;
default: the dtype the source model was stored in when recorded, else the
model's), recorded as ``config.json``'s ``fp4ptq.dtype``. ``config.json``'s own
``dtype`` is ``bfloat16`` on every compressed-tensors checkpoint: compressed-tensors
decompresses NVFP4 weights to bf16 only, so that is the one dtype in which stock
transformers + compressed-tensors run the checkpoint with default arguments.
``fp4ptq.load`` computes in the stored dtype unless told otherwise.

Files are byte-reproducible (sorted safetensors metadata; no timings in the
report), and the report holds a hash per tensor (``checkpoint.tensor_xxh3_128``: XXH3-128 of
its dtype, shape and bytes as stored) and of config.json's quantization fields
(``checkpoint.config_quantization_sha256``), which ``load``, ``fp4ptq inspect`` and ``fp4ptq eval``
check by default (``verify=False`` / ``--no-verify`` skip it). It costs 9.4% of the demo model's
load time (median of 7 loads each way, CPU, warm file cache, a loaded 2-core machine:
``benchmarks/results/checkpoint_smollm2_cpu_verify.{json,md}``), under the 10% such a default may
cost. Hashing reads every byte once (~0.7 GB/s there), so the share is larger on models where the
fixed cost of building the skeleton weighs less.

Writes are atomic: everything goes to a hidden directory beside the target,
is fsynced, then renamed. A killed save leaves only that hidden
``.NAME.partial-PID-XXXXXXXX`` directory (config.json is written last, so even it
never looks complete), never a half-written ``NAME``; the next save into the
same target removes it (and puts back a ``.NAME.replaced-PID-XXXXXXXX`` copy if a
kill came between the two renames), with a log line saying so, but leaves alone
those of a save still running (process PID alive, written to within the hour).

``load`` builds the model skeleton without allocating weights (parameters on
the meta device), swaps in ``NVFP4Linear`` modules, checks every tensor's
name, dtype and shape against the safetensors headers (and each file's size
against its header, so truncated files are reported, not crashed into), then
assigns the packed tensors as they are: no dequantized copy of any weight.

This module is the checkpoint API and holds the loading side; ``save`` and what it derives from the
model are in ``writer.py``, the hashes and damage checks in ``integrity.py``, file names, header
validation and the layer plan in ``layout.py``, atomic writes in ``atomic.py``; all are re-exported here.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from . import rotation, transforms
from .atomic import (  # noqa: F401 - re-exported: fp4ptq.checkpoint is the checkpoint API
    _write_json,
    atomic_directory,
    clean_leftovers,
    is_model_output,
)
from .integrity import (
    check_packed_has_config,
    config_hash,
    read_json,
    read_report_checked,
    tensor_hashes,
    verify_hashes,
)
from .layout import (  # noqa: F401 - re-exported: fp4ptq.checkpoint is the checkpoint API
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
    SINGLE_FILE,
    STOCK_RUN_DTYPE,
    TIMING_KEYS,
    TOKENIZER_FILES,
    CheckpointError,
    LayerPlan,
    TensorInfo,
    _tied_targets,
    check_tensors,
    checkpoint_files,
    parse_quantization_config,
    plan_layers,
    read_headers,
    read_safetensors_header,
    swap_in_nvfp4,
)
from .modules import NVFP4Linear
from .writer import (
    _dtype_named,
    compressed_tensors_config,
    divisor_to_multiplier,
    fused_groups,
    modelopt_config,
    nvfp4_layers,
    save,
    stored_dtype,
    unshared_fused_scales,
)


def _config_dtype(config_dict: dict) -> torch.dtype:
    """The stored dtype of the unquantized tensors (``fp4ptq.dtype``), else config.json's ``dtype``."""
    ours = config_dict.get(RECORD_KEY)
    for name in ((ours or {}).get("dtype") if isinstance(ours, dict) else None,
                 config_dict.get("dtype"), config_dict.get("torch_dtype")):
        dtype = _dtype_named(name)
        if dtype is not None:
            return dtype
    return torch.bfloat16


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def read_report(path: Path) -> Optional[dict]:
    file = path / REPORT_FILE
    return json.loads(file.read_text()) if file.is_file() else None


def _skeleton(path: Path, dtype: torch.dtype) -> nn.Module:
    """The model without weights (parameters on the meta device, buffers real)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, KeyError) as exc:
        import transformers

        raise CheckpointError(
            f"{path / CONFIG_FILE}: unsupported model type ({exc}). fp4ptq.load builds the model with "
            f"transformers {transformers.__version__} AutoModelForCausalLM; upgrade transformers or check model_type"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - config.json is input: whatever transformers raises on a bad field
        raise CheckpointError(f"{path / CONFIG_FILE}: transformers cannot build the model from it "
                              f"({type(exc).__name__}: {exc}); the file is damaged or was edited") from exc
    from .experts import linearize_model

    linearize_model(model, device="meta")   # MoE experts: one linear per expert projection, as saved
    return model


def module_names(model: nn.Module, headers: dict, qcfg) -> tuple:
    """The inverse of ``_original_names`` for loading: ``headers`` and ``qcfg``'s ``ignore``
    under the model's module names (only where transformers renames for the model type)."""
    from .models import checkpoint_names

    names = checkpoint_names(model, model.state_dict())
    inverse = {v: k for k, v in names.items() if k != v}
    if not inverse:
        return headers, qcfg

    def rename(key: str) -> str:
        for suffix in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
            if key.endswith("." + suffix):
                base = inverse.get(key.removesuffix(suffix) + "weight")
                return base.removesuffix("weight") + suffix if base else key
        return inverse.get(key, key)

    headers = {rename(k): v for k, v in headers.items()}
    if isinstance(qcfg, dict) and qcfg.get("ignore"):
        qcfg = {**qcfg, "ignore": [rename(f"{n}.weight").removesuffix(".weight") for n in qcfg["ignore"]]}
    return headers, qcfg


def load(path: str | Path, *, device=None, dtype: Optional[torch.dtype] = None,
         fuse: Optional[bool] = None, verify: bool = True) -> nn.Module:
    """Load a packed NVFP4 checkpoint (ours or any compressed-tensors
    ``nvfp4-pack-quantized`` one) with ``NVFP4Linear`` layers, in eval mode.

    device: where the tensors go (default: CUDA when available, else CPU);
            NVFP4Linear runs the Triton kernels on CUDA, the reference elsewhere.
    dtype:  compute dtype of activations and high-precision weights
            (default: the dtype the checkpoint stores them in).
    fuse:   run each block's q/k/v and gate/up as one GEMM a group
            (``fp4ptq.fuse_projections``; its report in ``model.fp4ptq_fusion``). Default: on
            CUDA, where it pays at decoding sizes, for the architectures ``fp4ptq.models``
            describes (others load unfused); True: on any device, and an architecture without
            a table is an error; False: never. Moving the model afterwards dissolves the groups.
    verify: check config.json's quantization fields and every tensor's bytes against the hashes the report
            recorded at save time (``CheckpointError`` on a mismatch, or when the report or its hashes are
            missing from an fp4ptq checkpoint: swapped offsets, flipped bits, an edited quantization
            config). Reads every byte once (9.4% of the demo model's load time on a CPU); False skips it.
            Checkpoints of other tools (no report, no fp4ptq record) are checked structurally only.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; give the checkpoint directory fp4ptq.save wrote")
    where = str(path / CONFIG_FILE)
    model, headers, from_file, report = _checked_skeleton(path, dtype)
    files = sorted({info.file for info in headers.values()})
    device = torch.device(device) if device is not None else _default_device()
    if verify:
        verify_hashes(path, headers, report)

    expected = model.state_dict()
    state = {}
    for file in tqdm(files, desc="Loading shards", disable=len(files) < 2):
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as handle:
                for file_key in handle.keys():
                    tensor = handle.get_tensor(file_key)
                    name = from_file.get(file_key, file_key)
                    want = expected[name].dtype
                    state[name] = tensor if tensor.dtype == want else tensor.to(want)
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: cannot be read ({exc}); re-copy it") from exc
    model.load_state_dict(state, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    still_meta = [n for n, t in model.state_dict().items() if t.is_meta]
    if still_meta:
        raise CheckpointError(f"{where}: tensors {still_meta[:5]} were not loaded (missing from the files)")
    model.to(device)   # the non-persistent buffers (e.g. rotary tables) built on the CPU
    model.eval()
    model.fp4ptq_info = report
    model.fp4ptq_fusion = _fuse(model, fuse, device)
    return model


def attach_transforms(model: nn.Module, qcfg: dict, where: str) -> None:
    """Online rotations of a ``transform_config`` (issue 43), as empty modules their weights load into."""
    try:
        transforms.attach_from_config(model, (qcfg or {}).get("transform_config"), where)
    except rotation.RotationError as exc:
        raise CheckpointError(str(exc)) from exc


def _checked_skeleton(path: Path, dtype: Optional[torch.dtype]) -> tuple:
    """``(model skeleton with NVFP4Linear swapped in, headers as in the files, {file tensor name:
    module tensor name} where they differ, report)`` after every check that needs no tensor data:
    config, headers, the layer plan, names, shapes and dtypes."""
    where = str(path / CONFIG_FILE)
    config_dict = read_json(path / CONFIG_FILE)
    if not isinstance(config_dict, dict):
        raise CheckpointError(f"{where} is not a JSON object; the file is damaged")
    dtype = dtype or _config_dtype(config_dict)
    file_headers = read_headers(checkpoint_files(path))
    ours = config_dict.get(RECORD_KEY) or {}
    act_four_six = ours.get("act_four_six") if isinstance(ours, dict) else None
    if act_four_six is not None and not isinstance(act_four_six, (str, dict)):
        raise CheckpointError(f"{where}: field {RECORD_KEY}.act_four_six is {act_four_six!r}; the file is damaged")
    report = read_report_checked(path)
    model = _skeleton(path, dtype)
    headers, qcfg = module_names(model, file_headers, config_dict.get("quantization_config"))
    from_file = {} if headers is file_headers else {f: m for m, f in zip(headers, file_headers) if f != m}
    plan = plan_layers(model, qcfg, headers, act_four_six, where)
    swap_in_nvfp4(model, plan, dtype)
    attach_transforms(model, qcfg, where)
    check_tensors(model, headers, where)
    return model, file_headers, from_file, report


def validate(path: str | Path, *, verify: bool = True) -> dict:
    """Every check ``load`` makes, without loading a tensor into a model: config, headers, the layer
    plan, names, shapes and dtypes, and (``verify``) the recorded tensor hashes. Returns
    ``{"tensors": n, "verified": n or None}``; raises ``CheckpointError`` naming what does not fit."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; give the checkpoint directory fp4ptq.save wrote")
    _, headers, _, report = _checked_skeleton(path, None)
    return {"tensors": len(headers), "verified": verify_hashes(path, headers, report) if verify else None}


def fused_ignore_extra(model: nn.Module, config) -> list:
    """The members of fused groups (q/k/v, gate/up: one GEMM and one weight global scale in vLLM,
    SGLang, TensorRT-LLM) that ``config.ignore`` leaves quantized while it keeps another member of the
    same group in high precision: ``fp4ptq quantize`` and ``fp4ptq.quantize`` keep them too (and say so),
    where ``save`` would otherwise refuse the unshared scales after all the work."""
    extra = []
    for _, names in fused_groups(model) or []:
        ignored = [n for n in names if config.is_ignored(n)]
        if ignored and len(ignored) < len(names):
            extra += [n for n in names if n not in ignored]
    return extra


def layers_devices(model: nn.Module) -> set:
    """The devices the ``NVFP4Linear`` layers of ``model`` are on (empty for none; ``meta`` for layers
    offloaded by accelerate)."""
    return {m.weight_packed.device for m in model.modules() if isinstance(m, NVFP4Linear)}


def fusion_device(model: nn.Module) -> Optional[torch.device]:
    """Where fusing ``model``'s projection groups by default pays: ``cuda`` when every NVFP4 layer is on
    a CUDA device (one or several: a ``device_map`` across GPUs keeps each decoder block on one, and a
    group split across devices is skipped with its reason), else None (the CPU, offloading, none)."""
    devices = layers_devices(model)
    return torch.device("cuda") if devices and all(d.type == "cuda" for d in devices) else None


def _fuse(model: nn.Module, fuse: Optional[bool], device: Optional[torch.device]) -> Optional[dict]:
    """The fusion of ``load`` (its ``fuse`` argument) and of transformers' ``from_pretrained`` (the
    default, on the layers' ``device``): the ``fuse_projections`` report, or None where it did not run."""
    from .fusion import fuse_projections
    from .models import UnsupportedArchitecture

    if fuse is False or (fuse is None and (device is None or device.type != "cuda")):
        return None
    try:
        return fuse_projections(model)
    except UnsupportedArchitecture:
        if fuse:
            raise
        return None



__all__ = [
    "CT_FORMAT", "CheckpointError", "FORMATS", "LayerPlan", "TensorInfo", "atomic_directory", "check_tensors",
    "checkpoint_files", "compressed_tensors_config", "fused_groups", "fused_ignore_extra", "divisor_to_multiplier", "fusion_device", "layers_devices", "load", "modelopt_config",
    "read_json", "clean_leftovers", "is_model_output", "stored_dtype", "tensor_hashes", "validate",
    "verify_hashes", "check_packed_has_config", "config_hash",
    "nvfp4_layers", "parse_quantization_config", "plan_layers", "read_headers", "read_report",
    "read_safetensors_header", "save", "swap_in_nvfp4", "unshared_fused_scales",
]
