"""Run the NVFP4 projections that read one input (q/k/v, gate/up) as one GEMM, in place.

Transformers' decoder blocks call ``q_proj``, ``k_proj`` and ``v_proj`` (and ``gate_proj``, ``up_proj``)
one after the other on the same hidden states. Serving engines fuse each such group into one matrix:
one launch instead of three, and one wider layer that fills the GPU better (on the H200 at one token,
the 8B q, k and v layers are each bound by launch latency). ``fuse_projections(model)`` does the same
for an fp4ptq model without changing its modules or its ``state_dict``:

* The members' packed weights and block scales are copied once into one buffer per group, and each
  member's buffers become row views of it (no memory is added).
* The first member called with an input runs the group's GEMM (an ``NVFP4Linear`` over the fused
  buffers, with its own launch plans) and returns its slice of the output columns; the others, called
  with the same input tensor (same object, unchanged since), return theirs without a launch.
* Outputs equal the separate layers' up to the order of fp32 summation inside the kernels (a wider
  layer may take another K split); each output element is still the exact products summed in fp32.
* On CUDA it pays at decoding sizes: the H200 measured 12-15% less GPU time a token in graph-replayed
  decoding of the Llama-3.1-8B shapes, and nothing at a 512-token prefill. So inputs of more than
  ``MAX_ROWS`` rows (and shapes whose fused layer the kernels would hand to dequantize + cuBLAS) run
  the layers alone.

A group fuses only when its members agree on what one GEMM needs: scheme, activation Four Over Six
rule, dtype, device, input size, bias or none, and equal weight global scales (``fp4ptq.quantize``
shares them across these groups, as engines require) and, for W4A4, equal input global scales.

Under ``torch.compile`` the group is one ``fp4ptq::nvfp4_linear`` op in the traced graph (the slices
handed out in the traced code; ``traced_output``). The fused path is skipped (the member runs alone)
when the input needs a gradient, and for any input other than the one the group last ran. A group
that sees its members' buffers replaced (``.to()``, ``.cuda()``, assigning ``.data``) or written in
place (``load_state_dict``, ``copy_``) dissolves itself for good: the members then run on their own
buffers (so fuse after moving the model to its device).
Inference tensors have no version counter, so for buffers or inputs created under
``torch.inference_mode()`` only replacement is seen.

``state_dict()`` of a fused member returns copies of its views (safetensors and ``save_pretrained``
refuse tensors that share memory). ``unfuse_projections(model)`` gives every member its own buffers
again.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import kernels
from .models import arch_spec, decoder_blocks
from .modules import NVFP4Linear, nvfp4_linear

_SHARED = ("weight_packed", "weight_scale")
# On CUDA, inputs of more rows run the layers alone: the H200 measured the gain at decoding sizes (graph-
# replayed 8B decode, 1 row: 12-15% less GPU time a token) and none at a 512-token prefill, where the
# strided column slices slow the elementwise kernels after the layers (0.9 ms more GPU time a forward)
# (results/e2e_decode_h200_fused.json, results/eager_generate_h200_fused_v2.json)
MAX_ROWS = 128


def _version(t: Optional[torch.Tensor]):
    """A tensor's version counter (None for no tensor or an inference tensor, which has none)."""
    return None if t is None or t.is_inference() else t._version


class FusedProjections:
    """One fused group: its ``NVFP4Linear`` over the concatenated buffers, the members (whose
    buffers are views of it) and the output of the last input it ran."""

    def __init__(self, members: list):
        first = members[0]
        self.members = list(members)
        self.bounds = []
        row = 0
        for m in members:
            self.bounds.append((row, row + m.out_features))
            row += m.out_features
        bias = first.bias is not None
        fused = NVFP4Linear(first.in_features, row, bias, scheme=first.scheme, act_four_six=first.act_four_six,
                            dtype=first.dtype, device=first.weight_packed.device)
        with torch.no_grad():
            torch.cat([m.weight_packed for m in members], out=fused.weight_packed)
            torch.cat([m.weight_scale for m in members], out=fused.weight_scale)
            fused.weight_global_scale.copy_(first.weight_global_scale)
            if first.input_global_scale is not None:
                fused.input_global_scale.copy_(first.input_global_scale)
            if bias:
                torch.cat([m.bias for m in members], out=fused.bias.data)
        fused.decode_cache = first.decode_cache
        self.module = fused
        for m, (r0, r1) in zip(members, self.bounds):
            for name in _SHARED:
                m._buffers[name] = getattr(fused, name)[r0:r1]
            if bias:
                m._parameters["bias"] = nn.Parameter(fused.bias.data[r0:r1], requires_grad=False)
            m._plans = None
            m._decoded = None
        # what the group relies on: the members' tensors (by identity) and every version counter
        self._held = [self._tensors(m) for m in members]
        self._watched = [fused.weight_packed, fused.weight_scale, fused.bias, fused.weight_global_scale,
                         fused.input_global_scale] + [t for m in members for t in (m.weight_global_scale,
                                                                                 m.input_global_scale, m.bias)]
        self._versions = [_version(t) for t in self._watched]
        self._last = None  # (input, its version, fused output, members still to take their slice)
        self._pays = {}    # (rows, dtype, device): whether the fused GEMM takes as fast a path as the layers
        self._traced = None  # ``_last`` of traced (compiled) code: (input, fused output, pending slices)
        for i, m in enumerate(members):
            m._fused = (self, i)

    @staticmethod
    def _tensors(m: NVFP4Linear) -> tuple:
        return m.weight_packed, m.weight_scale, m.weight_global_scale, m.input_global_scale, m.bias

    def _same_tensors(self) -> bool:
        """Whether every member still holds the group's tensors (identities only: what traced code can
        check; a layer moved with ``.to()`` after fusing then runs alone there)."""
        for m, held in zip(self.members, self._held):
            if any(a is not b for a, b in zip(self._tensors(m), held)):
                return False
        return True

    def intact(self) -> bool:
        """Whether every member still holds the group's tensors, none written in place since."""
        return self._same_tensors() and all(_version(t) == v for t, v in zip(self._watched, self._versions))

    def release(self) -> None:
        """Dissolve the group: every member runs on its own (view) buffers from now on."""
        for m in self.members:
            m._fused = None
            m._plans = None
        self.members, self._held, self._watched, self._last, self._traced = [], [], [], None, None
        self.module = None

    def _fused_pays(self, x: torch.Tensor) -> bool:
        """Whether the group runs as one GEMM for inputs of this many rows on CUDA (decided once per row
        count, dtype and device): up to ``MAX_ROWS`` rows, and not where the kernels' shape rules send
        the fused layer to dequantize + cuBLAS while a member alone gets a Triton kernel (H200,
        results/fusion_timing_h200.json: the 8B q/k/v at 512 rows, 15-35% slower fused)."""
        key = (x.numel() // max(1, x.shape[-1]), x.dtype, x.device)
        pays = self._pays.get(key)
        if pays is None and key[0] > MAX_ROWS:
            pays = self._pays[key] = False
        if pays is None:
            m, w4a4, k = key[0], self.module.scheme == "w4a4", self.module.in_features

            def path(n: int) -> str:
                return kernels.auto_path(m, n, k, x.dtype, x.device, w4a4=w4a4)
            pays = self._pays[key] = path(self.module.out_features) != "cublas" or all(
                path(layer.out_features) == "cublas" for layer in self.members)
        return pays

    def traced_output(self, index: int, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``output`` as ``torch.compile`` traces it: the group's custom op once per input tensor of the
        traced code, the slices handed out as in eager (Dynamo replays the bookkeeping as side
        effects). No version checks (a traced graph cannot see them): members whose buffers are
        replaced get recompiled graphs that find the group dissolved, as eager calls would."""
        module = self.module
        if module is None or x.numel() > MAX_ROWS * x.shape[-1] or not self._same_tensors():
            return None
        r0, r1 = self.bounds[index]
        last = self._traced
        if last is not None and last[0] is x and last[2][index]:
            pending = tuple(p and i != index for i, p in enumerate(last[2]))
            self._traced = (last[0], last[1], pending) if any(pending) else None
            return last[1][..., r0:r1]
        y = nvfp4_linear(x, module.weight_packed, module.weight_scale, module.weight_global_scale, module.bias,
                         module.input_global_scale, module.act_four_six)
        self._traced = (x, y, tuple(i != index for i in range(len(self.members))))
        return y[..., r0:r1]

    def output(self, index: int, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Member ``index``'s output for ``x``, or None where the member must run alone."""
        if self.module is None:
            return None
        if not self.intact():
            self.release()
            return None
        if x.is_cuda and not self._fused_pays(x):
            return None
        r0, r1 = self.bounds[index]
        last, version = self._last, _version(x)
        if last is not None and last[0] is x and last[1] == version and last[3][index]:
            last[3][index] = False
            if not any(last[3]):
                self._last = None  # every slice taken: hold nothing between calls
            return last[2][..., r0:r1]
        y = self.module(x)
        pending = [True] * len(self.members)
        pending[index] = False
        self._last = (x, version, y, pending)
        return y[..., r0:r1]


def _mismatch(members: list) -> Optional[str]:
    """Why these layers cannot run as one GEMM (None if they can)."""
    first = members[0]
    if any(m.weight_packed.is_meta for m in members):
        return "the weights are on the meta device (offloaded)"
    for m in members[1:]:
        for attr in ("scheme", "act_four_six", "dtype", "in_features"):
            if getattr(m, attr) != getattr(first, attr):
                return f"{attr} differs ({getattr(first, attr)} / {getattr(m, attr)})"
        if m.weight_packed.device != first.weight_packed.device:
            return "the layers are on different devices"
        if (m.bias is None) != (first.bias is None):
            return "only some layers have a bias"
        if not torch.equal(m.weight_global_scale, first.weight_global_scale):
            return "the weight global scales differ (quantize the group with one shared amax)"
        if first.input_global_scale is not None and not torch.equal(m.input_global_scale, first.input_global_scale):
            return "the input global scales differ"
    return None


def fuse_projections(model: nn.Module) -> dict:
    """Fuse every decoder block's q/k/v and gate/up NVFP4 layers (the fused groups of
    ``fp4ptq.models``) in place. Returns ``{"fused": n, "skipped": {group name: reason}}``; groups
    fused before are left as they are."""
    spec = arch_spec(model)
    fused, skipped = 0, {}
    for b, block in enumerate(decoder_blocks(model, spec)):
        for group in spec.groups:
            if not group.fused:
                continue
            name = f"{spec.layers}.{b}.{{{','.join(group.linears)}}}"
            members = [block.get_submodule(n) for n in group.linears]
            if not all(isinstance(m, NVFP4Linear) for m in members):
                skipped[name] = "not every layer is an NVFP4Linear"
                continue
            if any(m._fused is not None for m in members):
                continue
            reason = _mismatch(members)
            if reason:
                skipped[name] = reason
                continue
            FusedProjections(members)
            fused += 1
    return {"fused": fused, "skipped": skipped}


def unfuse_projections(model: nn.Module) -> int:
    """Give every fused layer of ``model`` its own buffers again (copies of its views); returns how
    many layers were fused."""
    count = 0
    for m in model.modules():
        if isinstance(m, NVFP4Linear) and m._shares_memory():
            if m._fused is not None:
                m._fused[0].release()
            with torch.no_grad():
                for name in _SHARED:
                    m._buffers[name] = m._buffers[name].clone()
                if m.bias is not None:
                    m._parameters["bias"] = nn.Parameter(m.bias.data.clone(), requires_grad=False)
            m._plans = None
            count += 1
    return count


__all__ = ["FusedProjections", "fuse_projections", "unfuse_projections"]
