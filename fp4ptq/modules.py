"""NVFP4Linear: an ``nn.Linear`` replacement holding packed NVFP4 weights.

Its buffers are exactly the compressed-tensors checkpoint tensors, so its
``state_dict`` is what goes to disk:

    weight_packed        uint8           [out, in/2]
    weight_scale         float8_e4m3fn   [out, in/16]
    weight_global_scale  float32         [1]   (global_enc, a divisor)
    input_global_scale   float32         [1]   (W4A4 only: 6*448/input_amax)

``forward`` calls only ``fp4ptq.kernels`` (Triton on CUDA, reference elsewhere).
Under ``torch.compile`` it goes through one custom op, ``torch.ops.fp4ptq.nvfp4_linear``,
so that the kernels' launch logic (shape rules, self-tests, Python-side checks) is
opaque to Dynamo: a compiled model has no graph break at its NVFP4 layers and can
be captured whole in a CUDA graph (``mode="reduce-overhead"``).

Off CUDA the reference GEMMs multiply by the decoded weight; decoding costs more
than the matmul on a CPU, so the module keeps the decoded weight (one float copy
per layer) while its packed buffers stay the same tensors with the same contents
(see ``NVFP4Linear.decode_cache``). On CUDA the kernels read the packed weight
and nothing is cached.
"""
from __future__ import annotations

import os
import weakref
from typing import Optional

import torch
from torch import nn

from . import kernels, nvfp4
from .nvfp4 import BLOCK_SIZE, NVFP4Tensor

SCHEMES = ("w4a16", "w4a4")
DECODE_CACHE_ENV = "FP4PTQ_DECODE_CACHE"
# Eager CUDA calls go through launch plans kept per input shape (kernels.linear_plan); False turns them off.
LAUNCH_PLANS = True
MAX_PLANS = 32  # input signatures kept per module (prefill of varying lengths adds one each)
_UNSEEN, _SEEN_ONCE = object(), object()
_WEIGHT_BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale")


def decode_cache_enabled_by_env() -> bool:
    """``FP4PTQ_DECODE_CACHE=0`` (or false/no/off) turns the decoded-weight cache off; default on."""
    return os.environ.get(DECODE_CACHE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _buffer_state(tensor: torch.Tensor):
    """What identifies a buffer's contents: the tensor object, its storage and its
    version counter (bumped by every in-place write: ``copy_``, ``load_state_dict``)."""
    return weakref.ref(tensor), tensor.data_ptr(), tensor._version


def _same_buffer(state, tensor: torch.Tensor) -> bool:
    ref, data_ptr, version = state
    return ref() is tensor and data_ptr == tensor.data_ptr() and version == tensor._version


# buffers in the checkpoint's own dtypes, kept through dtype conversions (``NVFP4Linear._apply``), with the
# integer dtype of their bits
_FORMAT_BUFFERS = ("weight_scale", "weight_global_scale", "input_global_scale")
_BITS = {torch.float8_e4m3fn: torch.uint8, torch.float32: torch.int32}


def _linear(x: torch.Tensor, weight: NVFP4Tensor, bias: Optional[torch.Tensor],
            input_amax: Optional[torch.Tensor], act_four_six: Optional[str], decoded=None) -> torch.Tensor:
    """The layer's product through the dispatch: W4A4 when ``input_amax`` is given."""
    if input_amax is not None:
        return kernels.linear_w4a4(x, weight, input_amax, bias, four_six=act_four_six, decoded=decoded)
    return kernels.linear_w4a16(x, weight, bias, decoded=decoded)


@torch.library.custom_op("fp4ptq::nvfp4_linear", mutates_args=())
def nvfp4_linear(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                 weight_global_scale: torch.Tensor, bias: Optional[torch.Tensor],
                 input_global_scale: Optional[torch.Tensor], act_four_six: Optional[str]) -> torch.Tensor:
    """``NVFP4Linear.forward`` as one op for ``torch.compile`` (the buffers as arguments; W4A4 when
    ``input_global_scale`` is given). The same dispatch as eager, without the CPU decode cache."""
    out_features, half_k = weight_packed.shape
    weight = NVFP4Tensor(weight_packed, weight_scale, weight_global_scale.reshape(()),
                         torch.Size((out_features, 2 * half_k)), x.dtype)
    amax = None if input_global_scale is None else nvfp4.activation_amax_from_global(input_global_scale)
    return _linear(x, weight, bias, amax, act_four_six)


@nvfp4_linear.register_fake
def _(x, weight_packed, weight_scale, weight_global_scale, bias, input_global_scale, act_four_six):
    return x.new_empty((*x.shape[:-1], weight_packed.shape[0]))


class NVFP4Linear(nn.Module):
    """Packed NVFP4 linear layer.

    ``decode_cache``: None (default) follows ``FP4PTQ_DECODE_CACHE`` (on unless
    set to 0); True/False forces it. When on and the module is not on CUDA, the
    decoded weight is kept after the first forward and reused until one of the
    packed buffers is replaced or written in place (or the module is moved with
    ``.to()``); it is never part of the ``state_dict`` or a pickle.
    """

    # Class-level defaults also cover modules unpickled from before these attributes existed.
    decode_cache: Optional[bool] = None
    _decoded = None
    _amax = None  # (input_global_scale's state, its amax) for W4A4 forwards
    _plans = None  # {input signature: plan or None}, for the buffers in _plan_sources
    _plan_sources = None
    _fused = None  # (fusion.FusedProjections, this layer's index) while fused with its siblings

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        scheme: str = "w4a16",
        act_four_six: Optional[str] = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r}; choose one of {SCHEMES}")
        if in_features % BLOCK_SIZE:
            raise ValueError(
                f"NVFP4Linear: in_features={in_features} is not a multiple of {BLOCK_SIZE}; "
                "keep this layer in high precision"
            )
        if act_four_six is not None and act_four_six not in nvfp4.FOUR_SIX_RULES:
            raise ValueError(f"unknown Four Over Six rule {act_four_six!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = scheme
        self.act_four_six = act_four_six if scheme == "w4a4" else None
        self.dtype = dtype
        self.register_buffer(
            "weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer(
            "weight_scale",
            torch.zeros(out_features, in_features // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device),
        )
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        if scheme == "w4a4":
            self.register_buffer("input_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        else:
            self.input_global_scale = None
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.decode_cache: Optional[bool] = None
        # (buffer states, inference mode, dtype, decoded weight [out, in]) or None.
        self._decoded = None

    # ------------------------------------------------------------------ #
    @classmethod
    def from_quantized(
        cls,
        weight: NVFP4Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        scheme: str = "w4a16",
        input_amax: Optional[torch.Tensor | float] = None,
        act_four_six: Optional[str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> "NVFP4Linear":
        """Build from a quantized weight ``[out, in]`` (and, for W4A4, the
        calibrated input amax)."""
        out_features, in_features = weight.shape
        if weight.padded_k != in_features:
            raise ValueError("NVFP4Linear cannot hold a padded weight; keep the layer in high precision")
        dtype = dtype or weight.dtype
        mod = cls(
            in_features, out_features, bias is not None, scheme=scheme, act_four_six=act_four_six,
            dtype=dtype, device=weight.packed.device,
        )
        mod.weight_packed.copy_(weight.packed)
        mod.weight_scale.copy_(weight.block_scale)
        mod.weight_global_scale.copy_(weight.global_enc.reshape(1))
        if scheme == "w4a4":
            if input_amax is None:
                raise ValueError("scheme 'w4a4' needs the calibrated input_amax")
            mod.input_global_scale.copy_(nvfp4.input_global_scale_from_amax(input_amax).reshape(1))
        if bias is not None:  # (on the weight's device, as the other buffers)
            mod.bias.data = bias.detach().to(device=weight.packed.device, dtype=dtype).clone()
        return mod

    def quantized_weight(self) -> NVFP4Tensor:
        """A view of the packed weight as an ``NVFP4Tensor`` (no copy)."""
        return NVFP4Tensor(
            self.weight_packed,
            self.weight_scale,
            self.weight_global_scale.reshape(()),
            torch.Size((self.out_features, self.in_features)),
            self.dtype,
        )

    def dequantized_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return self.quantized_weight().dequantize(dtype or self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The weight ``[out, in]`` decoded to the layer's dtype, for model code that reads a linear's
        ``.weight`` (transformers' HunYuan-MoE and Ergo look up its dtype). A new tensor on each
        access, on the packed buffers' device: writing to it changes nothing (assigning raises), it
        is not a parameter or buffer (``state_dict`` and checkpoints hold only the packed triple), and
        it costs a decode, so fp4ptq's own forward never reads it."""
        return self.dequantized_weight()

    def input_amax(self) -> Optional[torch.Tensor]:
        if self.input_global_scale is None:
            return None
        return nvfp4.activation_amax_from_global(self.input_global_scale)

    def _cached_input_amax(self) -> Optional[torch.Tensor]:
        """``input_amax()``, computed again only when ``input_global_scale`` changed (eager calls would
        otherwise launch its division on every forward)."""
        scale = self.input_global_scale
        if scale is None:
            return None
        if scale.is_inference():  # no version counter to see in-place writes with
            return self.input_amax()
        cached = self._amax
        if cached is not None and _same_buffer(cached[0], scale):
            return cached[1]
        amax = self.input_amax()
        self._amax = (_buffer_state(scale), amax)
        return amax

    # ------------------------------------------------------------------ #
    def _caches_decode(self) -> bool:
        if self.weight_packed.is_cuda:
            return False
        enabled = self.decode_cache if self.decode_cache is not None else decode_cache_enabled_by_env()
        buffers = [getattr(self, name) for name in _WEIGHT_BUFFERS]
        # Inference tensors have no version counter, so in-place edits could not be seen.
        return enabled and buffers[0].device.type != "cuda" and not any(t.is_inference() for t in buffers)

    def _decoded_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``dequantized_weight(dtype)``, decoded once while the packed buffers are unchanged."""
        buffers = [getattr(self, name) for name in _WEIGHT_BUFFERS]
        inference = torch.is_inference_mode_enabled()
        cached = self._decoded
        if (cached is not None and cached[1] == inference and cached[2] == dtype
                and all(_same_buffer(state, t) for state, t in zip(cached[0], buffers))):
            return cached[3]
        self._decoded = None   # free the stale copy before decoding the new one
        decoded = self.dequantized_weight(dtype)
        self._decoded = (tuple(_buffer_state(t) for t in buffers), inference, dtype, decoded)
        return decoded

    def _plan(self, x: torch.Tensor):
        """The launch plan of eager calls shaped like ``x`` (``kernels.linear_plan``; None where there is
        none, and at a signature's first call), built at the second such call and kept while the
        buffers are the same tensors at the same addresses: plans hold views of them, and in-place
        writes are read by the next launch. W4A4: the amax goes to each call (``_planned``)."""
        bias = self._parameters.get("bias")
        buffers = self._buffers
        packed, scale, enc = buffers["weight_packed"], buffers["weight_scale"], buffers["weight_global_scale"]
        sources = (id(packed), id(scale), id(enc), id(bias), packed.data_ptr(), scale.data_ptr(), enc.data_ptr(),
                   None if bias is None else bias.data_ptr())
        plans = self._plans
        if plans is None or sources != self._plan_sources or len(plans) >= MAX_PLANS:
            plans = self._plans = {}  # (views of replaced buffers go with the old plans)
            self._plan_sources = sources
        key = self._plan_key(x)
        plan = plans.get(key, _UNSEEN)
        if plan is _UNSEEN:  # a signature's first call goes through the dispatch (a prompt length
            plans[key] = plan = _SEEN_ONCE  # seen once would not repay building a plan)
        elif plan is _SEEN_ONCE:
            amax = self._cached_input_amax() if self.scheme == "w4a4" else None
            plan = plans[key] = kernels.linear_plan(x, self.quantized_weight(), bias, amax,
                                                    four_six=self.act_four_six)
        return (None if plan is _SEEN_ONCE else plan), key

    @staticmethod
    def _plan_key(x: torch.Tensor) -> tuple:
        """The input signature a plan is kept under (plans are for CUDA inputs only)."""
        return x.shape, x.stride(), x.dtype, x.get_device()

    def _planned(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``forward(x)`` through the call's launch plan, or None where the dispatch takes the call (no
        plan, an input the plan cannot take, or a plan that raised: the dispatch then takes that input
        signature from now on, and reports what fails)."""
        plan, key = self._plan(x)
        if plan is None:
            return None
        amax = (self._cached_input_amax(),) if self.scheme == "w4a4" else ()
        try:
            if x.is_cuda and x.get_device() != torch._C._cuda_getDevice():  # a layer on another GPU
                with torch.cuda.device(x.device):                          # (device_map): launch there
                    return plan(x, *amax)
            return plan(x, *amax)
        except Exception:  # noqa: BLE001 - e.g. a Gluon config that fails to build: the dispatch falls back
            self._plans[key] = None
            return None

    def clear_decode_cache(self) -> None:
        """Drop the decoded weight (the next reference forward decodes again)."""
        self._decoded = None

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half() replace the buffers: the decoded copy is stale (and must not
        # follow the module to CUDA).
        self._decoded = None
        self._amax = None
        self._plans = None
        # The scales are part of the format (E4M3 block scales, fp32 global scales), not activations: a
        # dtype conversion (model.half(), model.to(torch.bfloat16)) must not reach them (it rounded the
        # global scales to 16 bits and changed every output). They go through ``fn`` as integer views of
        # their bits, which conversions leave alone and device moves, sharing and the like still take.
        kept = {}
        for name in _FORMAT_BUFFERS:
            buf = self._buffers.get(name)
            if buf is not None and buf.dtype in _BITS:
                kept[name] = buf
                self._buffers[name] = None
        try:
            super()._apply(fn, recurse)
        finally:
            for name, buf in kept.items():
                bits = buf.view(_BITS[buf.dtype])
                out = fn(bits)
                self._buffers[name] = buf if out is bits else out.view(buf.dtype)
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.weight_packed.device))
        if probe.is_floating_point():  # the layer's nominal dtype follows a conversion (as its bias does)
            self.dtype = probe.dtype
        return self

    def __getstate__(self):
        state = super().__getstate__()
        state["_decoded"] = None   # weak references do not pickle, and the copy is derived data
        state["_amax"] = None
        state["_plans"] = None
        state["_fused"] = None     # a copy runs on its own
        return state

    def _shares_memory(self) -> bool:
        """Whether the packed weight is a view into a larger buffer (``fusion.fuse_projections``)."""
        packed = self.weight_packed
        return packed.untyped_storage().nbytes() != packed.numel() * packed.element_size()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._shares_memory():  # fused: its own copies (checkpoint writers refuse shared memory)
            for name in ("weight_packed", "weight_scale", "bias"):
                if destination.get(prefix + name) is not None:
                    destination[prefix + name] = destination[prefix + name].detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # compiled: one opaque op (no graph break, no Python traced per launch); it has no backward, so
        # a graph that needs a gradient traces the eager code instead (kernels._Linear has one)
        if x.dtype == torch.float32 and x.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(x.device.type):
            # as F.linear under autocast: a 16-bit input (which the kernels take) and output; inside, the
            # layer computes what it computes on that input without autocast (W4A4's fp32 products stay fp32)
            with torch.autocast(x.device.type, enabled=False):
                return self.forward(x.to(torch.get_autocast_dtype(x.device.type)))
        fused = self._fused
        bias = self.bias
        grad = kernels.needs_grad(x, bias)
        if torch.compiler.is_compiling() and not grad:
            if fused is not None:
                y = fused[0].traced_output(fused[1], x)  # one op for the group (fp4ptq/fusion.py)
                if y is not None:
                    return y
            return nvfp4_linear(x, self.weight_packed, self.weight_scale, self.weight_global_scale, bias,
                                self.input_global_scale, self.act_four_six)
        if fused is not None and not grad:
            y = fused[0].output(fused[1], x)  # one GEMM for the group (fp4ptq/fusion.py)
            if y is not None:
                return y
        if x.is_cuda and LAUNCH_PLANS and not grad:  # (a plan launches outside autograd: kernels._Linear)
            y = self._planned(x)
            if y is not None:
                return y
        weight = self.quantized_weight()
        decoded = None
        if self._caches_decode():
            decoded = self._decoded_weight
        elif self._decoded is not None:
            self._decoded = None
        return _linear(x, weight, bias, self._cached_input_amax(), self.act_four_six, decoded)

    def extra_repr(self) -> str:
        extra = f", act_four_six={self.act_four_six}" if self.act_four_six else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scheme={self.scheme}{extra}"
        )
