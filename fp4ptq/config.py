"""QuantConfig: what to quantize and how, as one frozen, validated dataclass.

It is saved into every checkpoint (``to_dict``) and read back (``from_dict``),
so every field is a plain JSON value (tuples become lists on disk).

    QuantConfig(method="gptq", four_six="mse", scheme="w4a4")
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional

from .nvfp4 import FOUR_SIX_RULES

METHODS = ("rtn", "gptq", "awq", "smoothquant", "awq+gptq", "smoothquant+gptq")
SCHEMES = ("w4a16", "w4a4")
HUB_CALIB_SOURCES = ("wikitext2", "c4", "pile")
GPTQ_SCALE_CHOICES = ("loop", "once")
MOE_CALIB = ("all", "routed")
ROTATION_BLOCKS = (16, 32, 64, 128)
KEEP_UNITS = ("linear", "block")


class ConfigError(ValueError):
    """A QuantConfig field has a bad value; the message names the field."""


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize a model to NVFP4.

    method:      "rtn" (round to nearest), "gptq", "awq", "smoothquant", or a
                 transform followed by GPTQ rounding ("awq+gptq", "smoothquant+gptq").
    four_six:    None (every block scaled to 6) or the Four Over Six rule
                 "mse" | "mae" | "max" choosing 4 or 6 per block, for weights
                 and (W4A4) activations.
    scheme:      "w4a16" (weights only) or "w4a4" (weights and activations,
                 activations with a calibrated static global scale).
    ignore:      module-name patterns kept in high precision: an exact name, a
                 name suffix after a dot ("lm_head" matches "model.lm_head"),
                 a glob ("*.mlp.down_proj") or a regex prefixed "re:".

    Calibration (used when the method or scheme needs data):
    calib:       "wikitext2" | "c4" | "pile" (hub train splits), "self"
                 (sampled from the model), or a local path (.txt, .jsonl, or a
                 directory of documents); see ``fp4ptq.calib``.
    nsamples, seqlen, seed: number and length of calibration sequences, RNG seed.

    GPTQ: gptq_damp (fraction of mean diag(H) added to the diagonal),
    gptq_block_size (columns per lazy-update block, a multiple of 16),
    gptq_act_order (process 16-column groups by decreasing Hessian diagonal),
    gptq_scale_choice ("loop": each block's 4-or-6 scale is chosen when the
    error feedback reaches its 16 columns, on the updated weights; "once":
    chosen up front on the original weights, as in the published GPTQ+4/6).

    AWQ: awq_grid (points of the activation-exponent grid in [0, 1)),
    awq_clip (also search a per-block clipping ratio of the weights).
    SmoothQuant: smoothquant_alpha (migration strength in [0, 1]; None searches
    smoothquant_alphas on the calibration loss).
    search_nsamples: calibration sequences the AWQ/SmoothQuant searches run
    their block-output objective on (statistics use all ``nsamples``).

    Mixture-of-Experts: moe_calib ("all": every expert computes its statistics
    and Hessians on every calibration token, while the block's output follows
    the real routing; "routed": each expert only on the tokens routed to it).

    Past the published recipes (issue 43; fp4ptq/rotation.py, sensitivity.py,
    methods/scale_search.py):
    rotate:      None or a block-Hadamard rotation block (16, 32, 64, 128), folded into
                 the weights where exact and online at the inputs of ``rotate_online``
                 (names relative to a decoder block, globs allowed; ``()`` for none). Any
                 pre-norm decoder with RMSNorm-type norms (planned by the table or by
                 discovery); what cannot be rotated exactly raises ``RotationError``.
    rotate_random: random signs in the Hadamard blocks (from ``seed``).
    rotate_residual: also rotate the residual stream (embeddings, norms folded, every reader
                 and writer); False keeps only the per-head v/o and the online rotations.
    weight_scale_search: each weight's (fused group's) global scale chosen by the whole
                 tensor's reconstruction error over ``WEIGHT_SCALE_SWEEP`` x its amax (4/6 inside).
    keep_budget: None, "PCT%" (extra bytes at most PCT% of what keeping every quantizable
                 linear in bf16 would add) or "N" (a count): the parts (``keep_unit``
                 "linear" or "block") whose quantization raises the KL divergence to the
                 float model most, measured on ``keep_nsamples`` calibration sequences, stay bf16.
    """

    method: str = "rtn"
    four_six: Optional[str] = None
    scheme: str = "w4a16"
    ignore: tuple = ("lm_head",)
    calib: str = "c4"
    nsamples: int = 128
    seqlen: int = 2048
    seed: int = 0
    gptq_damp: float = 0.01
    gptq_block_size: int = 128
    gptq_act_order: bool = False
    gptq_scale_choice: str = "loop"
    awq_grid: int = 20
    awq_clip: bool = False
    smoothquant_alpha: Optional[float] = None
    smoothquant_alphas: tuple = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
    search_nsamples: int = 16
    moe_calib: str = "all"
    rotate: Optional[int] = None
    rotate_random: bool = True
    rotate_residual: bool = True
    rotate_online: tuple = ("mlp.down_proj",)
    weight_scale_search: bool = False
    keep_budget: Optional[str] = None
    keep_unit: str = "linear"
    keep_nsamples: int = 2

    def __post_init__(self) -> None:
        # Lists (e.g. from JSON) become tuples so the frozen config stays hashable.
        for name in ("ignore", "smoothquant_alphas", "rotate_online"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ConfigError(f"QuantConfig.{name} must be a sequence, got the string {value!r}")
            object.__setattr__(self, name, tuple(value))
        _choice("method", self.method, METHODS)
        _choice("scheme", self.scheme, SCHEMES)
        if self.four_six is not None:
            _choice("four_six", self.four_six, FOUR_SIX_RULES, extra=" or None")
        _choice("gptq_scale_choice", self.gptq_scale_choice, GPTQ_SCALE_CHOICES)
        _choice("moe_calib", self.moe_calib, MOE_CALIB)
        if not all(isinstance(p, str) and p for p in self.ignore):
            raise ConfigError(f"QuantConfig.ignore must hold non-empty strings, got {self.ignore!r}")
        for p in self.ignore:
            if p.startswith("re:"):
                try:
                    re.compile(p[3:])
                except re.error as exc:
                    raise ConfigError(f"QuantConfig.ignore: bad regex {p!r}: {exc}") from exc
        if not isinstance(self.calib, str) or not self.calib:
            raise ConfigError(f"QuantConfig.calib must be a source name or a path, got {self.calib!r}")
        for name in ("nsamples", "seqlen", "awq_grid", "search_nsamples", "keep_nsamples"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"QuantConfig.seed must be an int, got {self.seed!r}")
        _positive_int("gptq_block_size", self.gptq_block_size)
        if self.gptq_block_size % 16:
            raise ConfigError(
                f"QuantConfig.gptq_block_size={self.gptq_block_size} must be a multiple of 16 "
                "(NVFP4 blocks are 16 columns and are quantized as units)"
            )
        if not (isinstance(self.gptq_damp, (int, float)) and 0 < self.gptq_damp < 1):
            raise ConfigError(f"QuantConfig.gptq_damp must be in (0, 1), got {self.gptq_damp!r}")
        for name in ("gptq_act_order", "awq_clip", "rotate_random", "rotate_residual", "weight_scale_search"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"QuantConfig.{name} must be True or False, got {getattr(self, name)!r}")
        self._check_accuracy_options()
        alphas = self.smoothquant_alphas if self.smoothquant_alpha is None else (self.smoothquant_alpha,)
        if not alphas or not all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in alphas):
            raise ConfigError(f"SmoothQuant alpha(s) must be in [0, 1], got {alphas!r}")

    def _check_accuracy_options(self) -> None:
        """Issue 43's options: rotation, weight-scale search, keep budget."""
        if self.rotate is not None and self.rotate not in ROTATION_BLOCKS:
            raise ConfigError(f"QuantConfig.rotate={self.rotate!r} must be None or one of {ROTATION_BLOCKS}")
        if not all(isinstance(p, str) and p for p in self.rotate_online):
            raise ConfigError(f"QuantConfig.rotate_online must hold non-empty strings, got {self.rotate_online!r}")
        _choice("keep_unit", self.keep_unit, KEEP_UNITS)
        if self.keep_budget is not None:
            parse_keep_budget(self.keep_budget)

    @property
    def needs_samples(self) -> bool:
        """Whether the statistics keep calibration sequences (AWQ/SmoothQuant)."""
        return self.transform is not None

    # ------------------------------------------------------------------ #
    @property
    def transform(self) -> Optional[str]:
        """The smoothing transform ("awq" | "smoothquant") or None."""
        head = self.method.split("+")[0]
        return head if head in ("awq", "smoothquant") else None

    @property
    def rounding(self) -> str:
        """How weights are rounded: "gptq" or "rtn" (AWQ/SmoothQuant alone round to nearest)."""
        return "gptq" if self.method.endswith("gptq") else "rtn"

    @property
    def needs_calibration(self) -> bool:
        """Whether quantizing needs calibration data (any method but RTN, or W4A4)."""
        return self.method != "rtn" or self.scheme == "w4a4" or self.keep_budget is not None

    def is_ignored(self, name: str) -> bool:
        """Whether the module called ``name`` matches one of ``ignore``."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], name):
                    return True
            elif name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern):
                return True
        return False

    def to_dict(self) -> dict:
        """JSON-able dict (tuples as lists)."""
        out = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "QuantConfig":
        """Inverse of ``to_dict``; unknown keys are an error (they would be silently lost)."""
        known = {f.name for f in fields(cls)}
        data = dict(data)
        for name, off in RETIRED_FIELDS.items():   # recorded by earlier versions
            if name in data and data.pop(name) != off:
                raise ConfigError(f"QuantConfig.from_dict: {name} was removed (it never helped where measured; "
                                  "benchmarks/NOTES.md); this version cannot reproduce that config")
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"QuantConfig.from_dict: unknown field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**dict(data))


# Fields of earlier versions, with the value that meant "off": a record holding that value still reads.
RETIRED_FIELDS = {"input_scale_search": False}


def parse_keep_budget(value: str) -> tuple:
    """``("pct", float)`` for "PCT%" (0 < PCT <= 100), ``("count", int)`` for "N" (N >= 0)."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    try:
        if text and text.endswith("%"):
            pct = float(text[:-1])
            if 0 < pct <= 100:
                return "pct", pct
        elif text is not None and int(text) >= 0:
            return "count", int(text)
    except ValueError:
        pass
    raise ConfigError(f"QuantConfig.keep_budget={value!r} must be 'PCT%' (0 < PCT <= 100) or a count like '3'")


def _choice(name: str, value: Any, allowed: tuple, extra: str = "") -> None:
    if value not in allowed:
        raise ConfigError(f"QuantConfig.{name}={value!r} is not valid; choose one of {allowed}{extra}")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"QuantConfig.{name} must be a positive int, got {value!r}")


__all__ = ["ConfigError", "GPTQ_SCALE_CHOICES", "KEEP_UNITS", "ROTATION_BLOCKS", "parse_keep_budget", "HUB_CALIB_SOURCES", "METHODS", "QuantConfig", "SCHEMES"]
