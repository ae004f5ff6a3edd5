"""Architecture knowledge as data: where the decoder blocks are, which linears
read the same input, what produced that input (the module smoothing scales
fold into), and which linears engines fuse (one shared weight global scale).

To support a new architecture, add an ``ArchSpec`` to ``ARCHITECTURES`` under
its ``config.model_type``; nothing else in the package names modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
    prev: str
    inspect: str
    fused: bool = False
    inspect_kwargs: bool = False


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


__all__ = [
    "ARCHITECTURES", "ArchSpec", "InputGroup", "LLAMA", "UnsupportedArchitecture", "arch_spec",
    "decoder_blocks", "get_module", "set_module",
]
