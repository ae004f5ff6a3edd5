"""transformers integration: ``AutoModelForCausalLM.from_pretrained(dir)`` builds
``NVFP4Linear`` layers (Triton kernels on CUDA, the reference elsewhere) from
packed NVFP4 checkpoints, once ``fp4ptq`` is imported.

How this coexists with transformers' own compressed-tensors quantizer
--------------------------------------------------------------------
Our checkpoints say ``quant_method: "compressed-tensors"`` (that is what vLLM
and SGLang dispatch on), so transformers routes them to its
``CompressedTensorsHfQuantizer``, which runs NVFP4 by decompressing every
weight to bf16 on the first forward pass. transformers' public
``register_quantizer`` refuses a name that is already registered, so
``register()`` replaces the ``"compressed-tensors"`` entry of transformers'
quantizer table with ``dispatch_quantizer``, which picks per checkpoint:

* ours (``FP4PTQHfQuantizer``) when every config group is NVFP4 as fp4ptq runs
  it (``nvfp4-pack-quantized``, 4-bit float, group 16, tensor_group; inputs
  absent or dynamic "local") with no KV-cache scheme, and the caller did not
  ask to dequantize. This includes checkpoints written by llm-compressor /
  compressed-tensors itself, not only ours.
* transformers' own quantizer for everything else (FP8, INT4, sparse, ...)
  and whenever ``quantization_config=CompressedTensorsConfig(dequantize=True)``
  is passed: that is the per-call way back to transformers' behaviour (dense
  dequantized weights, e.g. for fine-tuning), except for a checkpoint with online rotations
  (``transform_config``), which transformers' quantizer would run without them: refused.

``import fp4ptq`` arranges for ``register()`` to run as soon as transformers'
quantizer table is imported (``fp4ptq/_hook.py``; skip it with the environment
variable ``FP4PTQ_TRANSFORMERS_HOOK=0``); ``unregister()`` and ``stock_compressed_tensors()``
(a context manager) restore transformers' entry. Parsing the config still uses
transformers' ``CompressedTensorsConfig`` (as ``FP4PTQConfig``, registered in its place, which first
drops the guard that makes stock transformers refuse rotated checkpoints: ``fp4ptq/transforms.py``),
so ``from_pretrained`` needs the ``compressed-tensors`` package installed; ``fp4ptq.load`` does not.

The module swap, the config/tensor checks and the report are shared with
``fp4ptq.load`` (``fp4ptq/checkpoint.py``): both read the safetensors headers
first and raise ``CheckpointError`` naming what does not fit.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from transformers.quantizers import auto as _auto
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import CompressedTensorsConfig

from . import checkpoint, transforms

QUANT_METHOD = checkpoint.CT_QUANT_METHOD
_stock = {"quantizer": None, "config": None}


class FP4PTQConfig(CompressedTensorsConfig):
    """transformers' ``CompressedTensorsConfig`` less the guard our rotated checkpoints carry so that
    stock transformers refuses them (``fp4ptq.transforms``); keeps the checkpoint's ``transform_config``
    (``fp4ptq_transforms``: only fp4ptq's quantizer applies it), and writes both back in ``to_dict``
    (a ``save_pretrained`` of the loaded model keeps its rotations and the guard)."""

    def __init__(self, config_groups=None, **kwargs):
        self.fp4ptq_transforms = kwargs.get("transform_config") or None
        super().__init__(transforms.without_guard(config_groups), **kwargs)

    def to_dict(self) -> dict:
        out = super().to_dict()
        if self.fp4ptq_transforms:
            out["transform_config"] = self.fp4ptq_transforms
            transforms.guard_stock_loaders(out)
        return out


# transformers compares a checkpoint's config class with the caller's by name (merge_quantization_configs):
# a caller's CompressedTensorsConfig(dequantize=True) must still match this one
FP4PTQConfig.__name__ = CompressedTensorsConfig.__name__


def _nvfp4_problem(quantization_config):
    """None when fp4ptq runs this (transformers) CompressedTensorsConfig, else why not."""
    if getattr(quantization_config, "dequantize", False):
        return "dequantize=True was asked"
    ct_config = getattr(quantization_config, "quantization_config", None)
    if ct_config is None:
        return "no config groups"
    try:
        checkpoint.parse_quantization_config(ct_config.model_dump(), "quantization_config")
    except checkpoint.CheckpointError as exc:
        return str(exc)
    return None


class FP4PTQHfQuantizer(HfQuantizer):
    """Loads compressed-tensors NVFP4 checkpoints into ``NVFP4Linear`` modules:
    before the weights load, the targeted ``nn.Linear`` of the (meta-device)
    model are swapped for empty ``NVFP4Linear`` whose buffers carry the
    checkpoint's tensor names; transformers' loader then assigns the packed
    tensors as they are."""

    requires_calibration = True   # pre-quantized checkpoints only

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self._report = None

    def validate_environment(self, *args, **kwargs):
        return None

    def _process_model_before_weight_loading(self, model, dtype=None, checkpoint_files=None, **kwargs):
        if not checkpoint_files:
            raise checkpoint.CheckpointError("fp4ptq: NVFP4 checkpoints load from safetensors files; none were found")
        directory = Path(checkpoint_files[0]).parent
        where = str(directory / checkpoint.CONFIG_FILE)
        headers = checkpoint.read_headers(checkpoint_files)
        config_file = directory / checkpoint.CONFIG_FILE
        if config_file.is_file():
            qcfg = checkpoint.read_json(config_file).get("quantization_config")
        else:   # config given as an object: use the parsed one
            qcfg = self.quantization_config.quantization_config.model_dump()
        act_four_six = (getattr(model.config, checkpoint.RECORD_KEY, None) or {}).get("act_four_six")
        from .experts import linearize_model

        linearize_model(model, device="meta")   # MoE experts as saved: one linear per expert projection
        headers, qcfg = checkpoint.module_names(model, headers, qcfg)
        plan = checkpoint.plan_layers(model, qcfg, headers, act_four_six, where)
        checkpoint.swap_in_nvfp4(model, plan, dtype or model.dtype)
        checkpoint.attach_transforms(model, qcfg, where)   # online rotations (issue 43)
        checkpoint.check_tensors(model, headers, where)
        self._report = checkpoint.read_report(directory)
        return model

    def update_weight_conversions(self, weight_conversions, model):
        """Keep transformers' renamings, drop its merges of per-expert tensors into 3-D
        experts: the experts stay one linear per projection here (``fp4ptq.experts``)."""
        from transformers.core_model_loading import WeightConverter

        return [c for c in weight_conversions if not isinstance(c, WeightConverter)]

    def _process_model_after_weight_loading(self, model, **kwargs):
        model.fp4ptq_info = self._report
        # as fp4ptq.load: q/k/v and gate/up as one GEMM a group where device_map put the layers on
        # CUDA (one GPU or several); a model loaded on the CPU and moved afterwards stays unfused
        model.fp4ptq_fusion = checkpoint._fuse(model, None, checkpoint.fusion_device(model))
        return model

    def is_serializable(self):
        return True

    @property
    def is_trainable(self):
        return False

    @property
    def is_compileable(self):
        return True


def dispatch_quantizer(quantization_config, **kwargs):
    """The ``"compressed-tensors"`` entry of transformers' quantizer table while registered."""
    problem = _nvfp4_problem(quantization_config)
    if problem is None:
        return FP4PTQHfQuantizer(quantization_config, **kwargs)
    if getattr(quantization_config, "fp4ptq_transforms", False):
        raise checkpoint.CheckpointError(
            "this checkpoint has online rotations (quantization_config.transform_config), which transformers' own "
            f"compressed-tensors quantizer does not apply, and fp4ptq does not load it here ({problem}); load it "
            "without dequantize=True (fp4ptq applies the rotations) or with fp4ptq.load")
    stock = _stock["quantizer"]
    if stock is None:
        raise ImportError("transformers has no compressed-tensors quantizer for this checkpoint")
    return stock(quantization_config, **kwargs)


def register() -> None:
    """Route NVFP4 compressed-tensors checkpoints to ``FP4PTQHfQuantizer`` (idempotent)."""
    current = _auto.AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD)
    if current is dispatch_quantizer:
        return
    _stock["quantizer"] = current
    _stock["config"] = _auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD)
    _auto.AUTO_QUANTIZER_MAPPING[QUANT_METHOD] = dispatch_quantizer
    _auto.AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] = FP4PTQConfig   # reads the rotation guard


def unregister() -> None:
    """Give the ``"compressed-tensors"`` entry back to transformers' own quantizer."""
    if _auto.AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is dispatch_quantizer:
        if _stock["quantizer"] is None:
            del _auto.AUTO_QUANTIZER_MAPPING[QUANT_METHOD]
        else:
            _auto.AUTO_QUANTIZER_MAPPING[QUANT_METHOD] = _stock["quantizer"]
        if _stock["config"] is not None:
            _auto.AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] = _stock["config"]


def is_registered() -> bool:
    return _auto.AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is dispatch_quantizer


@contextmanager
def stock_compressed_tensors():
    """Within the block, ``from_pretrained`` uses transformers' own compressed-tensors quantizer."""
    was = is_registered()
    unregister()
    try:
        yield
    finally:
        if was:
            register()


# Importing this module registers, as `import fp4ptq` arranges (fp4ptq/_hook.py), unless the hook is off.
# (When transformers' table is first imported by this module's own import above, the hook leaves the
# registering to this line: the module is not complete yet when the table finishes loading.)
if os.environ.get("FP4PTQ_TRANSFORMERS_HOOK", "1") != "0":
    register()

__all__ = ["FP4PTQConfig", "FP4PTQHfQuantizer", "dispatch_quantizer", "is_registered", "register", "stock_compressed_tensors",
           "unregister"]
