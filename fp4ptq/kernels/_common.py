"""What every kernel family of ``fp4ptq.kernels`` shares, and nothing else: it imports none of them.

* ``cdiv`` and ``next_pow2`` for the launches' host side: ``triton.cdiv`` and ``triton.next_power_of_2``
  are constexpr functions in Triton 3.4+, and calling one from Python unwraps its arguments: about 2 us
  a call here, 7 on the H200 host, several times per layer call in eager use.
* ``Launch``: a Triton launch replayed past Triton's per-call work (below).
* The decode of packed NVFP4 words and E4M3 scales by bit moves (Triton helpers), the output
  scaling by the global scales, the split-K summing pass and programmatic dependent launches, and
  the device facts the launchers ask (SM count, compute capability).

Decoding
--------
Weights stay in the checkpoint layout (``weight_packed [N, K/2]`` uint8, read
as int32 words of 8 codes or int64 blocks of 16; ``weight_scale [N, K/16]``
e4m3): the codes are already contiguous along K, so a thread's 16-byte load
covers 32 codes (2 blocks) and a warp's loads are coalesced. No re-layout; one
cache: where K % 256 != 0 (Qwen2-72B's down layer) wsgemm reads the scales by TMA
from a copy with rows padded to 16 bytes, kept with the weight (``wsgemm.tma_scales``).

Decoding a word by bit moves (no lookup table)
----------------------------------------------
Code ``i`` of a word sits at bits ``4i..4i+3`` (sign = bit 3, magnitude = an
E2M1 exponent/mantissa field). Codes ``i`` and ``i+4`` become one register of
two 16-bit floats with one shift pair and one masked merge (LOP3)::

    r_i = ((w << (S - 4i)) & MAG) | ((w << (12 - 4i)) & 0x80008000)

(gemv6 / gemv7 decode bf16 in three operations instead, ``_pair_mul``: the nibbles
masked, one multiply that writes two copies of each, one mask.)

``S = 9`` puts the magnitude under fp16 exponent/mantissa bits 9..11: the
half is then ``v * 2^-14`` (0.5 is the fp16 subnormal 2^-15, which fp16
arithmetic and conversions keep). ``S = 6`` does the same under bf16's
fields: ``v * 2^-126`` (0.5 is the bf16 subnormal 2^-127). The powers of two
are folded into the block scale or the output scale once.

Block scales decode by bit moves too: the E4M3 byte shifted left by 7 is the
fp16 ``scale * 2^-8`` (subnormal E4M3 scales land on fp16 subnormals).

Exactness: ``v * scale`` (2 and 4 significant bits) is exact in bf16 and
fp16, so the tiled GEMM multiplies exactly-decoded weights (the global
``1/global_enc`` is applied once to the fp32 accumulator). W4A4 feeds the
same GEMMs with ``v_x * scale_x`` activations from the quantize kernel (exact
too), so every product is an exact NVFP4 x NVFP4 product, accumulated in fp32.
The exception is ``gemv5``/``gemv6``/``gemv7``: they sum each block's 16 products in bf16 (packed
``fma.rn.bf16x2``; ~2^-9 relative per block sum, ~4e-3 on the outputs measured), or for fp16
activations in fp16 (``fma.rn.f16x2``, ~5e-4 on the outputs: ``_x_pairs_f16``), before fp32 takes
over; under the Triton interpreter those FMAs are emulated.

Launch replay
-------------
A Triton launch whose grid and compile-time arguments are fixed, replayed without Triton's per-call
work.

``kernel[grid](*args, **kwargs)`` costs about 33 us of host time a call on the H200 host (Triton 3.6,
``benchmarks/launch_probe_h200.py``): the argument binder and specialization (8 us), the kernel-cache
key, the knobs, device and stream queries, and the C launcher itself (8 us). An eager layer call pays
it for every kernel. ``Launch`` keeps what a replay needs after the second call of the same
specialization: the compiled kernel's launcher, its function handle and metadata, and the values of
the arguments that never change (the compile-time ones and the fixed run-time ones); later calls go
straight to the C launcher with the per-call tensors put in their places.

Soundness: a compiled kernel depends on its arguments' specialization (each tensor's dtype and
whether its address is a multiple of 16; each integer's value class: equal to 1, a multiple of 16,
its width). The fixed arguments are the ones it was captured with (held here, so they stay alive),
and the per-call slots must be tensors: a replay checks each one's dtype and 16-byte alignment
against the capture and takes Triton's own path on any difference, on another current device, or
while launch hooks (profilers) are installed.

Where the compiled kernel needs no scratch buffers, the replay calls the C launcher itself, past
the Python wrapper that would otherwise expand every TMA descriptor argument on each call
(``make_tensordesc_arg``: about 3 us each on the H200 host): fixed descriptors (a weight's) are
expanded once at capture, per-call ones once per address, shape and strides (a few kept); Triton's
Python launcher took 8-12 us more a call at 512 rows on the H200 (``benchmarks/prefill_host_h200.py``).
Where the C launcher cannot be found (``_c_launcher``), the replay goes through that Python launcher.

The replay uses Triton's launcher interface of the versions it was checked on (``FAST_VERSIONS``);
on others, under the interpreter, or with ``FAST_LAUNCH = "0"``, every call is Triton's own
launch; ``FAST_LAUNCH = "1"`` forces the replay on another version.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .. import nvfp4
from ..nvfp4 import BLOCK_SIZE, NVFP4Tensor

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read when the kernels are built, as Triton does

try:  # griddepcontrol (programmatic dependent launch), Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # pragma: no cover - an older Triton: the summing pass launches plainly (split_pdl)
    _gdc_launch_dependents = _gdc_wait = None


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (b > 0)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as ``triton.next_power_of_2``."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


# --------------------------------------------------------------------------- #
# Launch replay
# --------------------------------------------------------------------------- #

FAST_VERSIONS = ("3.6.",)
FAST_LAUNCH = "auto"  # "auto": the checked Triton versions; "1" always, "0" never (Triton's own launch)


def fast_launch_enabled() -> bool:
    """Whether launches may be replayed past Triton's binder here (see the module docstring)."""
    if INTERPRET or FAST_LAUNCH == "0":
        return False
    return FAST_LAUNCH == "1" or triton.__version__.startswith(FAST_VERSIONS)


def current_device() -> int:
    """The current CUDA device's index, without ``torch.cuda.current_device``'s Python checks (about
    1 us a call on the H200 host; a replay asks once a launch, and CUDA is initialized by then)."""
    return torch._C._cuda_getDevice()


@functools.lru_cache(maxsize=None)
def cuda_sm_count(index: int) -> int:
    """The SM count of GPU ``index`` (asked once per GPU: ``get_device_properties`` costs about 10 us a
    call on the H200 host)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - an older Triton: no hook chains to look at
    _knobs = None


def _hooks_idle() -> bool:
    """No launch hooks installed (a profiler such as proton installs them; they need Triton's path)."""
    if _knobs is None:
        return True
    for hook in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


DESC_CACHE = 16  # per-call TMA descriptors expanded and kept per Launch (by address, shape, strides)


def _c_launcher(run, positions: int):
    """(C launch function, cooperative, PDL, {kernel-argument position: TMA metadata}, expander) of a
    Triton 3.6 ``CudaLauncher`` whose kernel needs no scratch memory, or None (another launcher, a
    wrapper this code does not know, scratch buffers to allocate each call)."""
    try:
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        launch, coop, pdl = run.launch, run.launch_cooperative_grid, run.launch_pdl
    except AttributeError:
        return None
    code = getattr(launch, "__code__", None)
    if code is None:  # the compiled C function itself: no descriptor arguments
        return launch, coop, pdl, {}, None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__ or ())))
    expand = launch.__globals__.get("make_tensordesc_arg")
    if code.co_name != "inner" or set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"} \
            or not callable(expand):
        return None
    indices = sorted(cells["tensordesc_indices"])
    metas = cells["tensordesc_meta"]
    if len(metas) != len(indices) or (indices and indices[-1] >= positions):
        return None
    return cells["launcher"], coop, pdl, dict(zip(indices, metas)), expand


class Launch:
    """``kernel[grid](*args, **kwargs)`` with ``args`` fixed except at the positions ``slots``, which
    each call fills, in order, with tensors: ``Launch(k, grid, args, slots, kwargs)(x, y)``.
    The first call of a specialization takes Triton's path; the second captures it; later ones
    replay it (see the module docstring)."""

    __slots__ = ("kernel", "grid", "args", "slots", "kwargs", "_seen", "_direct", "_c", "_descs")

    def __init__(self, kernel, grid: Sequence[int], args: Sequence, slots: Sequence[int], kwargs: dict):
        grid = tuple(int(g) for g in grid)
        self.kernel = kernel
        self.grid = grid + (1,) * (3 - len(grid))
        self.slots = tuple(slots)
        self.args = [None if i in self.slots else a for i, a in enumerate(args)]  # no per-call tensor kept
        self.kwargs = kwargs
        self._seen = None    # the slots' (dtype, aligned) of the last call through Triton's path
        self._direct = None  # (launcher, function, metadata, device, slot specs, tail values) or False
        self._c = None       # the C launcher's call: (function, head, flat arguments, slot places) or None
        self._descs = {}     # per-call TMA descriptors expanded for the C launcher

    @staticmethod
    def _spec(tensors) -> tuple:
        """Per slot: a tensor's dtype and 16-byte alignment; for a TMA descriptor (built by the caller
        with a fixed block shape and layout), its type and its base tensor's."""
        spec = []
        for t in tensors:
            if isinstance(t, torch.Tensor):
                spec.append((t.dtype, t.data_ptr() % 16 == 0))
            else:
                base = t.base
                spec.append((type(t), base.dtype, base.data_ptr() % 16 == 0))
        return tuple(spec)

    def __call__(self, *tensors: torch.Tensor) -> None:
        direct = self._direct
        if direct:
            run, function, metadata, device, spec, tail = direct
            if current_device() == device and self._spec(tensors) == spec and _hooks_idle():
                c = self._c
                if c is not None:
                    self._c_call(c, device, tensors)
                    return
                args = self.args.copy()  # (a copy: calls from two threads do not share it)
                for i, t in zip(self.slots, tensors):
                    args[i] = t
                g = self.grid
                run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), function, metadata,
                    None, None, None, *args, *tail)
                return
        args = list(self.args)
        for i, t in zip(self.slots, tensors):
            args[i] = t
        compiled = self.kernel[self.grid](*args, **self.kwargs)
        if not fast_launch_enabled() or compiled is None:
            return
        spec = self._spec(tensors)
        if self._seen == spec and direct is None:
            self._direct = self._capture(compiled, args, spec) or False  # False: not replayable here
            if self._direct:
                self._c = self._c_capture(args)
        self._seen = spec

    def _c_capture(self, args: list) -> Optional[tuple]:
        """The C launcher's call for this capture: its fixed leading arguments, the kernel arguments
        flattened as the Python wrapper would (descriptors expanded), and where each slot goes."""
        run, function, metadata, _, _, tail = self._direct
        values = list(args) + list(tail)
        c = _c_launcher(run, len(values))
        if c is None:
            return None
        launch, coop, pdl, descs, expand = c
        flat, places = [], {}
        try:
            for i, v in enumerate(values):
                if i in descs:
                    parts = expand(v, descs[i])
                    if i in self.slots:
                        if descs[i] is None:  # an expansion holding the tensor itself: not kept
                            return None
                        places[i] = (len(flat), len(parts), descs[i])
                        parts = [None] * len(parts)
                    flat.extend(parts)
                else:
                    if i in self.slots:
                        places[i] = (len(flat), 0, None)
                        v = None
                    flat.append(v)
        except Exception:  # noqa: BLE001 - a descriptor this Triton expands differently: keep its wrapper
            return None
        head = (function, coop, pdl, None, None, metadata, None, None, None)
        return launch, head, flat, [places[i] for i in self.slots], expand

    def _c_call(self, c: tuple, device: int, tensors) -> None:
        launch, head, flat, places, expand = c
        flat = flat.copy()
        for (at, width, meta), t in zip(places, tensors):
            if width == 0:
                flat[at] = t
                continue
            key = (t.base.data_ptr(), tuple(t.shape), tuple(t.strides), t.padding)
            parts = self._descs.get(key)
            if parts is None:
                if len(self._descs) >= DESC_CACHE:
                    self._descs.clear()
                parts = self._descs[key] = expand(t, meta)
            flat[at:at + width] = parts
        g = self.grid
        launch(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), *head, *flat)

    def _capture(self, compiled, args: list, spec: tuple) -> Optional[tuple]:
        """The replay state of a kernel just launched by Triton with ``args`` (None where this Triton's
        internals are not the ones the replay was written for)."""
        try:
            device = current_device()
            binder = self.kernel.device_caches[device][4]
            params, _, _ = binder(*args, **self.kwargs)
            values = list(params.values())
            if len(values) < len(args) or any(v is not a for v, a in zip(values, args)):
                return None
            run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
        except Exception:  # noqa: BLE001 - internals that moved: keep Triton's path
            return None
        if function is None or not callable(run):
            return None
        return run, function, metadata, device, spec, tuple(values[len(args):])

    @property
    def replaying(self) -> bool:
        """Whether calls now go straight to the captured launcher."""
        return bool(self._direct)


# --------------------------------------------------------------------------- #
# Decoding helpers
# --------------------------------------------------------------------------- #

SIGN_MASK = tl.constexpr(-2147450880)  # 0x80008000 as int32
FP16_MAG = tl.constexpr(0x0E000E00)    # fp16 exponent/mantissa bits 9..11 of both halves
BF16_MAG = tl.constexpr(0x01C001C0)    # bf16 bits 6..8 of both halves


@triton.jit
def _shl(w, amount: tl.constexpr):
    if amount >= 0:
        return w << amount
    else:
        return w >> (-amount)


@triton.jit
def _pair(w, i: tl.constexpr, S: tl.constexpr, MAG: tl.constexpr):
    """Register of 16-bit float patterns for codes i (low half) and i+4 (high)."""
    return (_shl(w, S - 4 * i) & MAG) | (_shl(w, 12 - 4 * i) & SIGN_MASK)


BF16_PAIR_BITS = tl.constexpr(-2118090304)  # 0x81C081C0 as int32: BF16_MAG | SIGN_MASK


@triton.jit
def _pair_mul(w, w8, i: tl.constexpr):
    """``_pair(w, i, 6, BF16_MAG)`` in three integer operations instead of
    four: the bf16 sign sits 6 bits above the magnitude's top, one bit above it
    in the code, so one multiply by ``2^a + 2^(a + 6)`` of the isolated nibbles
    makes two copies of each (bits a..a+3 and a+6..a+9, no carries: the four
    fields never overlap) and one mask keeps the magnitude of the first and the
    sign of the second. Codes 2, 3 (and 6, 7) need a right shift: they are
    taken as codes 0, 1 of ``w8 = w >> 8``, shared by both pairs."""
    if i < 2:
        t = w & (0x000F000F << (4 * i))
    else:
        t = w8 & (0x000F000F << (4 * (i - 2)))
    j: tl.constexpr = i % 2
    return (t * ((1 << (6 - 4 * j)) + (1 << (12 - 4 * j)))) & BF16_PAIR_BITS


@triton.jit
def _halves(r, DT: tl.constexpr):
    lo = r.to(tl.int16).to(DT, bitcast=True)
    hi = (r >> 16).to(tl.int16).to(DT, bitcast=True)
    return lo, hi


@triton.jit
def decode_word(w, DT: tl.constexpr):
    """int32 words -> eight 16-bit-float tensors (codes 0..7 of each word):
    ``v * 2^-14`` for ``DT = fp16``, ``v * 2^-126`` for ``DT = bf16``."""
    if DT == tl.float16:
        e0, e4 = _halves(_pair(w, 0, 9, FP16_MAG), DT)
        e1, e5 = _halves(_pair(w, 1, 9, FP16_MAG), DT)
        e2, e6 = _halves(_pair(w, 2, 9, FP16_MAG), DT)
        e3, e7 = _halves(_pair(w, 3, 9, FP16_MAG), DT)
    else:
        e0, e4 = _halves(_pair(w, 0, 6, BF16_MAG), DT)
        e1, e5 = _halves(_pair(w, 1, 6, BF16_MAG), DT)
        e2, e6 = _halves(_pair(w, 2, 6, BF16_MAG), DT)
        e3, e7 = _halves(_pair(w, 3, 6, BF16_MAG), DT)
    return e0, e1, e2, e3, e4, e5, e6, e7


@triton.jit
def scale_fp32(bits):
    """E4M3 bytes (uint8/int) -> ``scale * 2^-8`` as fp32 (exact)."""
    return (bits.to(tl.int16) << 7).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _assemble(e0, e1, e2, e3, e4, e5, e6, e7):
    """Eight ``[..., W]`` tensors (code i of each word) -> ``[..., W, 2, 2, 2]``
    whose row-major order is code 0..7 of each word: every ``tl.join`` appends
    the innermost dim, so join the outermost bit of the code index (i // 4) first."""
    return tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))


@triton.jit
def decode_tile(words, sbits, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr,
                BF16_DIRECT: tl.constexpr):
    """``words int32 [BN, BK/8]``, ``sbits [BN, BK/16]`` -> ``v * scale * 2^-c``
    in DT ``[BN, BK]``, K order, exact (c = 14, or 26 with ``BF16_DIRECT``).

    fp16 placement: ``(v * 2^-14) * scale`` in fp16 is exact (its smallest
    value 2^-24 is fp16's smallest subnormal); for bf16 it is then converted
    (exactly). ``BF16_DIRECT`` decodes straight into bf16 (``v * 2^-126``) and
    multiplies by ``scale * 2^100``: one conversion fewer, but it relies on
    bf16 arithmetic keeping the subnormal 2^-127 (code 0.5), which the
    benchmark checks on the GPU (the Triton interpreter flushes it)."""
    w3 = tl.reshape(words, (BLOCK_N, BLOCK_K // 16, 2))
    sf = scale_fp32(sbits)  # scale * 2^-8
    if BF16_DIRECT:
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_word(w3, tl.bfloat16)
        sf = (sf * 3.2451855365842673e32).to(tl.bfloat16)[:, :, None]  # (scale * 2^-8) * 2^108 = scale * 2^100
    else:
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_word(w3, tl.float16)
        sf = (sf * 256.0).to(tl.float16)[:, :, None]  # scale
    full = _assemble(e0 * sf, e1 * sf, e2 * sf, e3 * sf, e4 * sf, e5 * sf, e6 * sf, e7 * sf)
    return tl.reshape(full, (BLOCK_N, BLOCK_K)).to(tl.float32).to(DT)


@triton.jit
def _pow2_over(enc, POW2: tl.constexpr):
    """``POW2 / enc`` for an fp32 scalar ``enc``, correctly rounded."""
    return tl.math.div_rn(enc * 0.0 + POW2, enc)


@triton.jit
def _output_factor(wenc_ptr, xenc_ptr, POW2: tl.constexpr, HAS_XENC: tl.constexpr):
    """``POW2 / (global_enc_w (* global_enc_x))``: one correctly rounded fp32 scalar."""
    enc = tl.load(wenc_ptr)
    if HAS_XENC:
        enc = enc * tl.load(xenc_ptr)
    return _pow2_over(enc, POW2)


@triton.jit
def _output_scale(y, wenc_ptr, xenc_ptr, POW2: tl.constexpr, HAS_XENC: tl.constexpr):
    """``y * POW2 / global_enc_w (/ global_enc_x)`` in fp32: one correctly
    rounded scalar ``POW2 / global_enc`` per program, one multiply per output."""
    return y * _output_factor(wenc_ptr, xenc_ptr, POW2, HAS_XENC)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, wenc_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                    OUT_BF16: tl.constexpr):
    # the dequantize kernel of gemm.py's dequantize + cuBLAS path and, per expert, of grouped_dequant.py's
    # out[n, k] = dtype(fp32(v) * (fp32(scale) / global_enc)), exactly as the reference.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    kb = K // 16
    ok = (n < N)[:, None] & (blk < kb)[None, :]
    n64 = n.to(tl.int64)
    widx = tl.program_id(1) * BLOCK_B * 2 + tl.arange(0, BLOCK_B * 2)
    words = tl.load(w_ptr + n64[:, None] * (K // 8) + widx[None, :], mask=(n < N)[:, None] & (widx < K // 8)[None, :],
                    other=0)
    sb = tl.load(s_ptr + n64[:, None] * kb + blk[None, :], mask=ok, other=0)
    step = tl.math.div_rn(scale_fp32(sb) * 256.0, tl.load(wenc_ptr) + tl.zeros((BLOCK_N, BLOCK_B), tl.float32))
    w3 = tl.reshape(words, (BLOCK_N, BLOCK_B, 2))
    e0, e1, e2, e3, e4, e5, e6, e7 = decode_word(w3, tl.float16)
    st = step[:, :, None] * 16384.0  # also undoes the fp16 placement (exact)
    full = _assemble(e0.to(tl.float32) * st, e1.to(tl.float32) * st, e2.to(tl.float32) * st,
                     e3.to(tl.float32) * st, e4.to(tl.float32) * st, e5.to(tl.float32) * st,
                     e6.to(tl.float32) * st, e7.to(tl.float32) * st)
    vals = tl.reshape(full, (BLOCK_N, BLOCK_B * 16))
    k = tl.program_id(1) * BLOCK_B * 16 + tl.arange(0, BLOCK_B * 16)
    optr = out_ptr + n64[:, None] * K + k[None, :]
    omask = (n < N)[:, None] & (k < K)[None, :]
    if OUT_BF16:
        # fp32 -> bf16 round-half-even on the bit pattern (exact everywhere,
        # also under the Triton interpreter whose bf16 cast truncates)
        bits = vals.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(optr, bits.to(tl.int16), mask=omask)
    else:
        tl.store(optr, vals.to(out_ptr.dtype.element_ty), mask=omask)


# --------------------------------------------------------------------------- #
# Split K and programmatic dependent launches
# --------------------------------------------------------------------------- #

@triton.jit
def _gemv_split_finish(part_ptr, bias_ptr, y_ptr, M, N, stride_ym, SEGMENTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``y[m, n] = sum_s part[s, m, n] (+ bias)`` in fp32, in segment order, cast to y's dtype. The
    segments are unrolled, so every partial's load is in flight at once (the adds keep their order).
    ``PDL``: launched as a programmatic dependent of the split kernel, so it may be resident before
    that kernel ends; ``griddepcontrol.wait`` holds it until the partials are written and visible."""
    if PDL:
        _gdc_wait()
    row = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SEGMENTS):
        acc += tl.load(part_ptr + (s * M + row) * N + n, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=ok)


def split_workspace(splits: int, y: torch.Tensor) -> torch.Tensor:
    """Where a split-K launch writes: fp32 partial sums ``[splits, M, N]`` when K is
    split, ``y`` itself otherwise."""
    m, n = y.shape
    return torch.empty(splits, m, n, dtype=torch.float32, device=y.device) if splits > 1 else y


def split_finish(splits: int, y: torch.Tensor, bias: Optional[torch.Tensor], dependent: bool = False):
    """The summing pass of a split-K launch as a callable ``finish(target, y)``: ``y = sum of the
    ``split_workspace``'s partial sums in split order (+ bias)``; ``dependent``: launched as a
    programmatic dependent of the split kernel, which signals it (``split_pdl``)."""
    m, n = y.shape
    block = 1024
    pdl = bool(dependent)
    launch = Launch(_gemv_split_finish, (cdiv(n, block), m), (None, bias, None, m, n, y.stride(0)),
                    (0, 1, 2) if bias is None else (0, 2),
                    dict(SEGMENTS=splits, HAS_BIAS=bias is not None, BLOCK=block, PDL=pdl, launch_pdl=pdl, num_warps=4))
    if bias is not None:
        return launch

    def finish(target, y):
        launch(target, y, y)  # (no bias: y stands in for its pointer)
    return finish


def split_run(launch: Launch, splits: int, y: torch.Tensor, bias: Optional[torch.Tensor], dependent: bool = False):
    """``run(*tensors) -> y`` of a ``launch`` whose last slot is its output (y last among the tensors):
    written into y directly, or, K split, into a fresh ``split_workspace`` summed into y (+ bias);
    ``dependent``: the launch signals the summing pass, which launches as its programmatic dependent
    (plainly, should the driver refuse that: ``dependent_or_plain``)."""
    if splits == 1:
        def run(*tensors):
            launch(*tensors)
            return tensors[-1]
        return run
    finish = split_finish(splits, y, bias, dependent)
    if dependent:
        finish = dependent_or_plain(finish, lambda: split_finish(splits, y, bias), y.device, "the split-K summing pass")

    def run_split(*tensors):
        y = tensors[-1]
        target = split_workspace(splits, y)
        launch(*tensors[:-1], target)
        finish(target, y)
        return y
    return run_split


# The summing pass of a K split launches as a programmatic dependent of the split kernel (sm_90 on)
# where that kernel is mma.py's or gemv6's: they signal ``griddepcontrol.launch_dependents`` as they
# start, so the pass is resident before they end and waits in ``griddepcontrol.wait`` for the
# partials. Likewise W4A4's mma.py launch after the activations' quantize launch (``w4a4_pdl``): the
# quantize kernel signals as it starts and mma.py copies its first weight steps before it waits.
# A dependent is only ever paired with the launch just before it, which is ours and writes nothing
# the dependent reads before its wait; every other launch keeps the plain stream order (session 7
# measured PDL on the GEMVs themselves and removed it). A pass whose split kernel does not signal
# (wgmma.py, wsgemm.py) gains nothing from it (H200, session 24) and launches plainly. Where the
# driver refuses a dependent launch, the plain launch takes the call and none is tried again on that
# GPU (``dependent_or_plain``).
SPLIT_PDL = True
W4A4_PDL = True

_PDL_FAILED: dict = {}  # device index -> why a dependent launch failed there (no more are tried)


def _pdl_possible(device: torch.device) -> bool:
    """Whether launches on ``device`` may be programmatic dependents: an NVIDIA GPU of sm_90 or later,
    a Triton with griddepcontrol, not the interpreter, and no dependent launch refused there yet."""
    if INTERPRET or _gdc_wait is None or device.type != "cuda" or torch.version.hip:
        return False
    if _device_index(device) in _PDL_FAILED:
        return False
    return _capability(device) >= (9, 0)


def split_pdl(device: torch.device) -> bool:
    """Whether a split kernel on ``device`` signals its summing pass and the pass launches as its
    programmatic dependent (``SPLIT_PDL`` and ``_pdl_possible``)."""
    return SPLIT_PDL and _pdl_possible(device)


def w4a4_pdl(device: torch.device) -> bool:
    """Whether W4A4's activation quantize launch may signal mma.py, which then launches as its
    programmatic dependent (``W4A4_PDL`` and ``_pdl_possible``; ``dispatch.w4a4_pairs`` decides per shape)."""
    return W4A4_PDL and _pdl_possible(device)


def dependent_or_plain(dependent, plain, device: torch.device, what: str):
    """``call(*args)``: ``dependent(*args)`` (a programmatic dependent launch) while such launches work
    on ``device``, else ``plain(*args)`` (the same work launched plainly; a callable, or a function
    of no arguments that builds it, called once). If the dependent launch raises and the plain one
    then succeeds, the driver refused the dependent launch: a warning names the error, and no
    dependent launch is tried on that GPU again. If the plain one raises too, its error propagates
    (the fault was not the dependent launch's). Inside a CUDA graph capture a failed launch has
    already invalidated the capture: dependent launches are switched off on that GPU and the error
    says to capture again (the next capture launches plainly)."""
    index = _device_index(device)
    built = []

    def run_plain(*args):
        if not built:
            built.append(plain())
        return built[0](*args)

    def call(*args):
        if index in _PDL_FAILED:
            return run_plain(*args)
        try:
            return dependent(*args)
        except Exception as exc:  # noqa: BLE001 - e.g. a driver without programmatic dependent launch
            if _capturing():
                _PDL_FAILED[index] = f"{what}, inside a CUDA graph capture: {exc!r}"[:300]
                raise RuntimeError(f"fp4ptq: a programmatic dependent launch failed inside a CUDA graph capture "
                                   f"({_PDL_FAILED[index]}); such launches are off on cuda:{index} from now on: "
                                   "capture again") from exc
            result = run_plain(*args)
            if index not in _PDL_FAILED:
                _PDL_FAILED[index] = f"{what}: {exc!r}"[:300]
                warnings.warn(f"fp4ptq: programmatic dependent launches are not used on cuda:{index} any more "
                              f"({_PDL_FAILED[index]}); the plain launches take their calls", stacklevel=2)
            return result
    return call


# --------------------------------------------------------------------------- #
# Device facts and the weight's buffers
# --------------------------------------------------------------------------- #

def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a grid-stride loop with more than one program
    return cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _device_index(device: torch.device) -> int:
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else current_device()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple:
    return _capability_of(device.index if device.index is not None else current_device())


def _weight_in_place(weight: NVFP4Tensor) -> bool:
    """Whether ``_weight_views`` and the kernels' 16-byte loads use the weight's own codes and scales
    without copying them."""
    packed, scale = weight.packed, weight.block_scale
    return (packed.is_contiguous() and packed.data_ptr() % 16 == 0 and scale.is_contiguous()
            and scale.data_ptr() % 16 == 0)


def _weight_views(weight: NVFP4Tensor):
    n, k = weight.shape[0], weight.shape[-1]
    if len(weight.shape) != 2 or weight.padded_k != k or k % BLOCK_SIZE:
        raise nvfp4.NVFP4Error(
            f"Triton NVFP4 GEMM needs an unpadded 2-D weight with K % 16 == 0; got shape "
            f"{tuple(weight.shape)} (packed K {weight.padded_k})"
        )
    packed = weight.packed.contiguous()
    if packed.data_ptr() % 16:  # e.g. a view into a loaded file: the word views need aligned storage
        packed = packed.clone()
    words = packed.view(torch.int32)  # [N, K/8]: 8 codes a word, K order
    sbits = weight.block_scale.contiguous().view(torch.uint8)  # [N, K/16]
    enc = weight.global_enc.reshape(1).to(torch.float32)
    return n, k, words, sbits, enc


# --------------------------------------------------------------------------- #
# Encoding: E2M1 codes and E4M3 block scales (the quantize kernels')
# --------------------------------------------------------------------------- #
@triton.jit
def _ge_bound(b64, STRICT: tl.constexpr):
    """Smallest fp32 ``a`` with ``a > b64`` (``STRICT``) or ``a >= b64``, for a
    per-block fp64 ``b64 >= 0``: then ``|x| > B`` (or ``>= B``) is ``|x| >= a``."""
    b32 = b64.to(tl.float32)  # nearest
    back = b32.to(tl.float64)
    bits = b32.to(tl.int32, bitcast=True)
    if STRICT:
        bits = tl.where(back > b64, bits, bits + 1)
    else:
        bits = tl.where(back >= b64, bits, bits + 1)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_thresholds(step):
    """Per-block fp32 thresholds ``T0..T6`` (``[BM, NB]``) such that the E2M1
    index of ``fl(|x| / step)`` is the number of ``T_i <= |x|``; +inf for a
    zero step (the reference stores zeros there)."""
    s = step.to(tl.float64)
    # Midpoints between E2M1 neighbours, displaced by half an fp32 ulp of the
    # midpoint so ties fall to the even neighbour (see module doc):
    # ">" tests: 0.25 + 2^-26, 1.25 + 2^-24, 2.5 + 2^-23, 5 + 2^-22
    # ">=" tests: 0.75 - 2^-25, 1.75 - 2^-24, 3.5 - 2^-23
    t0 = _ge_bound(s * 0.250000014901161193847656250, True)
    t1 = _ge_bound(s * 0.749999970197677612304687500, False)
    t2 = _ge_bound(s * 1.250000059604644775390625000, True)
    t3 = _ge_bound(s * 1.749999940395355224609375000, False)
    t4 = _ge_bound(s * 2.500000119209289550781250000, True)
    t5 = _ge_bound(s * 3.499999880790710449218750000, False)
    t6 = _ge_bound(s * 5.000000238418579101562500000, True)
    zero = step <= 0.0
    inf = float("inf")
    return (tl.where(zero, inf, t0), tl.where(zero, inf, t1), tl.where(zero, inf, t2), tl.where(zero, inf, t3),
            tl.where(zero, inf, t4), tl.where(zero, inf, t5), tl.where(zero, inf, t6))


@triton.jit
def e2m1_value(index):
    """fp32 magnitude {0, .5, 1, 1.5, 2, 3, 4, 6} of an E2M1 index (0..7), by
    bit moves: the index under fp16 bits 9..11 is the fp16 ``v * 2^-14``."""
    half = (index << 9).to(tl.int16).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * 16384.0


@triton.jit
def e4m3_rne(v):
    """Round fp32 ``0 <= v <= 448`` to the nearest E4M3 value (ties to even).

    Returns ``(value fp32, bits int32)``. Done in integer/fp32 arithmetic so
    that it is exact everywhere (the Triton interpreter's fp8 cast is not).
    Normal range (v >= 2^-6): keep 3 mantissa bits of the fp32 pattern with
    round-half-even (a carry moves into the exponent, as it should); the E4M3
    pattern is then the fp32 pattern's top bits rebiased (127 -> 7).
    Subnormal range: multiples of 2^-9, i.e. ``RNE(v * 512)`` (2^23 trick);
    that integer is also the E4M3 pattern (8 -> 2^-6, the first normal).
    """
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # & 0xFFF00000
    normal_value = rounded.to(tl.float32, bitcast=True)
    normal_bits = (rounded >> 20) - 960  # (exp - 120) << 3 | mantissa
    sub_int = (v * 512.0 + 8388608.0) - 8388608.0  # RNE(v * 2^9), exact
    sub_value = sub_int * 0.001953125
    is_sub = v < 0.015625
    value = tl.where(is_sub, sub_value, normal_value)
    pattern = tl.where(is_sub, sub_int.to(tl.int32), normal_bits)
    return value, pattern


@triton.jit
def e4m3_block_scale(bmax, global_enc, TARGET: tl.constexpr):
    """``e4m3(min(bmax / TARGET * global_enc, 448))`` (the reference's order of
    operations): ``(value fp32, E4M3 bit pattern int32)``."""
    scale = tl.math.div_rn(bmax, TARGET) * global_enc
    return e4m3_rne(tl.minimum(scale, 448.0))


@triton.jit
def _combine(a, b, RULE: tl.constexpr):
    if RULE == 3:
        return tl.maximum(a, b)
    else:
        return a + b


@triton.jit
def global_enc_from_amax(amax, FOUR_SIX: tl.constexpr):
    """``6 * 448 / amax`` (``6 * 256 / amax`` with Four Over Six), 1 for amax 0,
    clamped to the fp32 max: ``nvfp4.global_encode_scale`` bit for bit."""
    numerator = 1536.0 if FOUR_SIX != 0 else 2688.0
    # torch evaluates ``numerator / amax`` as ``reciprocal(amax) * numerator``
    # (two roundings), on the CPU and on CUDA alike: do the same.
    recip = tl.math.div_rn(amax * 0.0 + 1.0, tl.where(amax > 0.0, amax, 1.0))
    enc = tl.where(amax > 0.0, recip * numerator, 1.0)
    return tl.minimum(enc, 3.4028234663852886e38)
