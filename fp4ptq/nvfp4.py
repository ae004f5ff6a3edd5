"""NVFP4 numerics: the one source of truth (see docs/NVFP4.md in the shared docs).

Format: FP4 E2M1 values in blocks of 16 along the last dimension, one FP8 E4M3
block scale per block, one fp32 tensor scale ``global_enc`` (a divisor):

    x_hat = e2m1_value * (float(block_scale) / global_enc)

Everything here is plain, vectorized PyTorch and runs on any device for fp32,
fp16 and bf16 inputs of any leading shape. Kernels, methods and checkpoints
all ask these functions; nothing here knows about models or files.

Conventions pinned here (kernels reproduce them bit for bit):
- All arithmetic is fp32. ``step = float(block_scale) / global_enc`` is formed
  once per block; quantizing divides by it, dequantizing multiplies by it
  (the same order as the compressed-tensors decompressor, so its decoded
  weights equal ours bit for bit).
- Standard block scale: ``e4m3(bmax / 6 * global_enc)``; the Four Over Six
  "scale to 4" candidate: ``e4m3(bmax / 4 * global_enc)`` (equal to the spec's
  ``1.5 * bmax / 6`` in exact arithmetic, with one rounding fewer).
  Block scales saturate at 448 (only reachable with a caller-given amax).
- The sign bit of a code is the sign bit of the input, so a small negative
  value that rounds to zero is stored as -0 (0x8), as compressed-tensors does.
  -0 decodes to zero.
- Four Over Six errors are summed in the order of ``torch.sum`` over the 16
  (or 256 for 2D blocks) elements; ties keep the 6-scale.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

FP4_MAX = 6.0
FP8_MAX = 448.0
# Four Over Six maps the tensor amax to 6 * 256 so that the x1.5 ("scale to 4")
# block scale, at most 384, never saturates E4M3.
FOUR_SIX_FP8_MAX = 256.0
BLOCK_SIZE = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FOUR_SIX_RULES = ("mse", "mae", "max")
FourSixRule = Literal["mse", "mae", "max"]

@functools.lru_cache(maxsize=64)
def _constant(values: tuple, device: torch.device) -> torch.Tensor:
    """A read-only fp32 constant on ``device``, made once: building it per call
    would cost a host-to-device copy (a stall) per call on a GPU, e.g. per
    column inside GPTQ's loop."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def _just_below(v: float) -> float:
    return torch.nextafter(torch.tensor(v), torch.tensor(0.0)).item()


# Decision boundaries between neighbouring E2M1 magnitudes (see e2m1_code).
_E2M1_BOUNDS = (0.25, _just_below(0.75), 1.25, _just_below(1.75), 2.5, _just_below(3.5), 5.0)

# Rows of blocks processed at once by the reference quantizer: bounds the
# temporaries (about 40 bytes per element) without a Python loop over blocks.
_CHUNK_ELEMENTS = 1 << 24


class NVFP4Error(ValueError):
    """Bad input to the NVFP4 format functions (non-finite values, bad shapes)."""


# --------------------------------------------------------------------------- #
# Element and scale rounding
# --------------------------------------------------------------------------- #
def e2m1_code(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even mantissa, saturating at 6)
    and return its 4-bit code ``sign << 3 | index`` as uint8.

    The thresholds between neighbours of {0, .5, 1, 1.5, 2, 3, 4, 6} are the
    midpoints; at a tie the even-mantissa neighbour wins (0, 1, 2, 4 have even
    codes): 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
    """
    a = x.abs().float()
    # index = #(boundaries < a): ties at 0.25, 1.25, 2.5, 5 go down (a > b), ties at
    # 0.75, 1.75, 3.5 go up (a >= b, written as a > the fp32 value just below b).
    bounds = _constant(_E2M1_BOUNDS, x.device)
    index = torch.bucketize(a, bounds, out_int32=True).to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return sign | index


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Decode uint8 codes (low 4 bits) to fp32 values; 0x8 (-0) decodes to zero."""
    # One gather from the signed 16-entry table (entry 8 is -0.0).
    table = _constant(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), codes.device)
    return table[(codes & 0xF).long()]


def e2m1_rne(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of ``x`` as fp32 (ties to even, saturating at +-6)."""
    return e2m1_decode(e2m1_code(x))


def e4m3_rne(x: torch.Tensor) -> torch.Tensor:
    """Round non-negative fp32 values to FP8 E4M3 (round to nearest even),
    saturating at 448; returned as fp32."""
    return x.float().clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()


# --------------------------------------------------------------------------- #
# Scales
# --------------------------------------------------------------------------- #
def check_finite(x: torch.Tensor, name: str = "tensor") -> None:
    """Raise ``NVFP4Error`` naming ``name`` if ``x`` holds NaN or Inf."""
    if not torch.isfinite(x).all():
        nan = int(torch.isnan(x).sum())
        inf = int(torch.isinf(x).sum())
        raise NVFP4Error(
            f"{name}: found {nan} NaN and {inf} Inf value(s) in a tensor of shape "
            f"{tuple(x.shape)}; NVFP4 cannot represent them. Fix the source "
            "weights/activations (or exclude this layer) before quantizing."
        )


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the whole tensor, as a 0-dim fp32 tensor."""
    return x.detach().abs().amax().float()


def global_encode_scale(amax: torch.Tensor | float, four_six: bool = False) -> torch.Tensor:
    """``global_enc = 6 * 448 / amax`` (``6 * 256 / amax`` with Four Over Six),
    1.0 where amax is 0. 0-dim fp32 tensor; a divisor: ``x = q * bs / global_enc``."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    numerator = FP4_MAX * (FOUR_SIX_FP8_MAX if four_six else FP8_MAX)
    enc = torch.where(amax > 0, numerator / amax, torch.ones_like(amax))
    # An amax so small that the division overflows: keep it finite.
    return enc.clamp(max=torch.finfo(torch.float32).max)


def block_scale(bmax: torch.Tensor, global_enc: torch.Tensor, target: float = FP4_MAX) -> torch.Tensor:
    """E4M3 block scale (as fp32) mapping a block max ``bmax`` to ``target``
    (6 standard, 4 for the Four Over Six candidate): ``e4m3(bmax / target * global_enc)``."""
    # Divide by a tensor, not a Python number: CUDA torch turns ``t / 6.0`` into
    # ``t * fl(1/6)`` (the CPU divides), so the scales would depend on the device.
    divisor = _constant((target,), bmax.device).reshape(())
    return e4m3_rne(bmax.float() / divisor * global_enc)


# --------------------------------------------------------------------------- #
# The quantized tensor
# --------------------------------------------------------------------------- #
@dataclass
class NVFP4Tensor:
    """An NVFP4-quantized tensor in the packed on-disk layout.

    packed:      uint8 ``[..., Kp/2]``, element 2j in the low nibble, 2j+1 high.
    block_scale: float8_e4m3fn ``[..., Kp/16]``.
    global_enc:  0-dim fp32 (divisor).
    shape:       the original shape (last dim K; Kp = K rounded up to 16 when
                 the tensor was quantized with ``pad=True``, else K).
    dtype:       the original dtype (dequantize's default output dtype).
    chose_four:  bool ``[..., Kp/16]`` (blocks that kept the 4-scale), or None
                 when quantized without Four Over Six. Not stored on disk.
    """

    packed: torch.Tensor
    block_scale: torch.Tensor
    global_enc: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    chose_four: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def padded_k(self) -> int:
        return self.packed.shape[-1] * 2

    def codes(self) -> torch.Tensor:
        """Unpacked uint8 codes ``[..., Kp]``."""
        return unpack_codes(self.packed)

    def step(self) -> torch.Tensor:
        """Per-block fp32 step ``float(block_scale) / global_enc``: ``[..., Kp/16]``."""
        return self.block_scale.float() / self.global_enc.float()

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``e2m1_value * (float(block_scale) / global_enc)`` in fp32, cast to
        ``dtype`` (default: the original dtype), cropped to the original shape."""
        values = e2m1_decode(self.codes())
        lead = values.shape[:-1]
        values = values.view(*lead, -1, BLOCK_SIZE) * self.step().unsqueeze(-1)
        values = values.reshape(*lead, self.padded_k)[..., : self.shape[-1]]
        return values.to(dtype or self.dtype)

    def to(self, device: torch.device | str) -> "NVFP4Tensor":
        return NVFP4Tensor(
            self.packed.to(device),
            self.block_scale.to(device),
            self.global_enc.to(device),
            self.shape,
            self.dtype,
            None if self.chose_four is None else self.chose_four.to(device),
        )

    def four_share(self) -> float:
        """Fraction of blocks that chose the 4-scale (0.0 without Four Over Six)."""
        if self.chose_four is None or self.chose_four.numel() == 0:
            return 0.0
        return float(self.chose_four.float().mean())


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., K]`` (K even) -> bytes ``[..., K/2]``: even element low nibble."""
    if codes.shape[-1] % 2:
        raise NVFP4Error(f"pack_codes: last dim {codes.shape[-1]} is odd")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """bytes ``[..., K/2]`` -> uint8 codes ``[..., K]``."""
    if packed.dtype != torch.uint8:
        raise NVFP4Error(f"unpack_codes: expected uint8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# --------------------------------------------------------------------------- #
# Quantizing blocks
# --------------------------------------------------------------------------- #
def _block_error(x_hat: torch.Tensor, x: torch.Tensor, rule: str) -> torch.Tensor:
    """Per-block error over the last dim (blocks ``[..., n]``)."""
    diff = x_hat - x
    if rule == "mse":
        return (diff * diff).sum(-1)
    if rule == "mae":
        return diff.abs().sum(-1)
    if rule == "max":
        return diff.abs().amax(-1)
    raise NVFP4Error(f"unknown Four Over Six rule {rule!r}; choose one of {FOUR_SIX_RULES}")


def _round_with_scale(x: torch.Tensor, scale: torch.Tensor, global_enc: torch.Tensor, values: bool = True):
    """Codes and (if ``values``) dequantized values of blocks ``x [..., n]`` for
    fp32 scales ``[...]``; blocks whose scale is 0 store zeros (keeping the sign bit)."""
    step = (scale / global_enc).unsqueeze(-1)
    scaled = torch.where(step > 0, x / step, x * 0.0)
    codes = e2m1_code(scaled)
    return codes, (e2m1_decode(codes) * step if values else None)


def quantize_blocks(
    x: torch.Tensor,
    global_enc: torch.Tensor,
    four_six: Optional[str] = None,
    *,
    values: bool = True,
):
    """Quantize blocks ``x: [..., n]`` (fp32, one block per trailing row of n
    elements; n = 16, or 256 for a flattened 16x16 tile) under ``global_enc``.

    Returns ``(codes uint8 [..., n], block_scale fp32 [...], chose_four bool [...]
    or None, x_hat fp32 [..., n])``. With ``four_six`` the block keeps the
    4-scale iff its ``four_six`` error is strictly below the 6-scale's.
    This is the primitive methods call (GPTQ per 16-column group).
    ``values=False`` skips x_hat (returned as None) where only codes are
    needed and no Four Over Six choice has to be made.
    """
    x = x.float()
    global_enc = global_enc.float()
    bmax = x.abs().amax(-1)
    scale6 = block_scale(bmax, global_enc, FP4_MAX)
    codes6, x_hat6 = _round_with_scale(x, scale6, global_enc, values or four_six is not None)
    if four_six is None:
        return codes6, scale6, None, x_hat6
    scale4 = block_scale(bmax, global_enc, 4.0)
    codes4, x_hat4 = _round_with_scale(x, scale4, global_enc)
    chose_four = _block_error(x_hat4, x, four_six) < _block_error(x_hat6, x, four_six)
    pick = chose_four.unsqueeze(-1)
    return (
        torch.where(pick, codes4, codes6),
        torch.where(chose_four, scale4, scale6),
        chose_four,
        torch.where(pick, x_hat4, x_hat6),
    )


def _validate(x: torch.Tensor, name: str, four_six: Optional[str], pad: bool, block_2d: bool) -> int:
    pad_k = _validate_layout(x, name, four_six, pad, block_2d)
    check_finite(x, name)
    return pad_k


def _validate_layout(x: torch.Tensor, name: str, four_six: Optional[str], pad: bool, block_2d: bool) -> int:
    """Everything ``_validate`` checks except finiteness; returns the padding of the last dim."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise NVFP4Error(f"{name}: expected a floating-point tensor, got {type(x).__name__} "
                         f"{getattr(x, 'dtype', '')}")
    if x.dim() == 0:
        raise NVFP4Error(f"{name}: cannot quantize a 0-dim tensor")
    if four_six is not None and four_six not in FOUR_SIX_RULES:
        raise NVFP4Error(f"{name}: unknown Four Over Six rule {four_six!r}; choose one of {FOUR_SIX_RULES}")
    k = x.shape[-1]
    if k % BLOCK_SIZE and not pad:
        raise NVFP4Error(
            f"{name}: last dim {k} is not a multiple of {BLOCK_SIZE} (shape {tuple(x.shape)}). "
            "NVFP4 blocks run along the last dim; pass pad=True to zero-pad and record the "
            "true size, or keep this layer in high precision."
        )
    if block_2d and (x.dim() < 2 or x.shape[-2] % BLOCK_SIZE and not pad):
        raise NVFP4Error(
            f"{name}: 2D 16x16 blocks need a 2-D tensor whose last two dims are multiples "
            f"of {BLOCK_SIZE}; got shape {tuple(x.shape)}"
        )
    return (-k) % BLOCK_SIZE


def quantize(
    x: torch.Tensor,
    four_six: Optional[str] = None,
    *,
    amax: Optional[torch.Tensor | float] = None,
    global_enc: Optional[torch.Tensor] = None,
    block_2d: bool = False,
    pad: bool = False,
    name: str = "tensor",
) -> NVFP4Tensor:
    """Quantize ``x [..., K]`` to NVFP4 (blocks of 16 along the last dim).

    four_six:   None (standard, scale to 6) or a rule "mse" | "mae" | "max".
    amax:       the tensor max to derive ``global_enc`` from (default max|x|);
                give it to share one global scale across fused layers or to
                use a calibrated static activation scale. Values above it
                saturate (block scale at 448, elements at 6).
    global_enc: the global scale itself (overrides ``amax``).
    block_2d:   one scale per 16x16 tile of the last two dims (the NVFP4
                pre-training recipe); stored as the ordinary layout with the
                tile's scale repeated over its 16 rows.
    pad:        zero-pad a last dim that is not a multiple of 16 (the true size
                is kept in ``shape`` and restored by ``dequantize``) instead of
                raising.
    name:       how errors name the tensor (e.g. the layer).
    """
    pad_k = _validate(x, name, four_six, pad, block_2d)
    if global_enc is None:
        global_enc = global_encode_scale(tensor_amax(x) if amax is None else amax, four_six is not None)
    global_enc = torch.as_tensor(global_enc, dtype=torch.float32, device=x.device).reshape(())
    shape, dtype = x.shape, x.dtype
    xf = x.detach().float()
    if pad_k:
        xf = torch.nn.functional.pad(xf, (0, pad_k))
    if block_2d:
        codes, scale, chose = _quantize_2d(xf, global_enc, four_six, pad)
    else:
        codes, scale, chose = _quantize_1d(xf, global_enc, four_six)
    return NVFP4Tensor(
        pack_codes(codes),
        scale.to(torch.float8_e4m3fn),
        global_enc,
        shape,
        dtype,
        chose,
    )


def _quantize_1d(xf: torch.Tensor, global_enc: torch.Tensor, four_six: Optional[str]):
    lead, kp = xf.shape[:-1], xf.shape[-1]
    blocks = xf.reshape(-1, kp // BLOCK_SIZE, BLOCK_SIZE)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(kp, 1))
    codes, scales, chose = [], [], []
    for start in range(0, blocks.shape[0], rows_per_chunk):
        c, s, f, _ = quantize_blocks(blocks[start : start + rows_per_chunk], global_enc, four_six, values=False)
        codes.append(c)
        scales.append(s)
        chose.append(f)
    codes = torch.cat(codes).reshape(*lead, kp)
    scales = torch.cat(scales).reshape(*lead, kp // BLOCK_SIZE)
    chose = None if four_six is None else torch.cat(chose).reshape(*lead, kp // BLOCK_SIZE)
    return codes, scales, chose


def _quantize_2d(xf: torch.Tensor, global_enc: torch.Tensor, four_six: Optional[str], pad: bool):
    *lead, rows, kp = xf.shape
    pad_rows = (-rows) % BLOCK_SIZE
    if pad_rows:
        xf = torch.nn.functional.pad(xf, (0, 0, 0, pad_rows))
    r16, k16 = (rows + pad_rows) // BLOCK_SIZE, kp // BLOCK_SIZE
    # tiles: [..., r16, k16, 16 rows * 16 cols]
    tiles = xf.reshape(*lead, r16, BLOCK_SIZE, k16, BLOCK_SIZE).transpose(-3, -2)
    tiles = tiles.reshape(*lead, r16, k16, BLOCK_SIZE * BLOCK_SIZE)
    codes, scale, chose, _ = quantize_blocks(tiles, global_enc, four_six, values=False)

    def untile(t: torch.Tensor) -> torch.Tensor:  # [..., r16, k16, 16, 16] -> [..., rows, kp]
        t = t.reshape(*lead, r16, k16, BLOCK_SIZE, BLOCK_SIZE).transpose(-3, -2)
        return t.reshape(*lead, r16 * BLOCK_SIZE, kp)[..., :rows, :]

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [..., r16, k16] -> [..., rows, k16]
        return t.repeat_interleave(BLOCK_SIZE, dim=-2)[..., :rows, :]

    return untile(codes), per_row(scale), None if chose is None else per_row(chose)


def dequantize(q: NVFP4Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Function form of ``NVFP4Tensor.dequantize``."""
    return q.dequantize(dtype)


def fake_quantize(
    x: torch.Tensor,
    four_six: Optional[str] = None,
    *,
    amax: Optional[torch.Tensor | float] = None,
    global_enc: Optional[torch.Tensor] = None,
    block_2d: bool = False,
    pad: bool = False,
    name: str = "tensor",
) -> torch.Tensor:
    """``dequantize(quantize(x, ...))`` in ``x``'s dtype and shape: what a
    method optimizes against and what W4A4 simulation feeds a matmul.
    1-D unpadded blocks go through ``fake_quantize_fused`` (the same bits, about
    4x faster on a CPU: AWQ/SmoothQuant searches call this per candidate)."""
    if not block_2d and not pad:
        return fake_quantize_fused(x, four_six, amax=amax, global_enc=global_enc, name=name)
    return quantize(
        x, four_six, amax=amax, global_enc=global_enc, block_2d=block_2d, pad=pad, name=name
    ).dequantize(x.dtype)


# E2M1's spacing is half the power of two at or below the magnitude (0.5 below 2,
# 1 in [2, 4), 2 in [4, 6]), but never below 0.5: the int32 pattern of 1.0 (exponent
# field only) is the floor of ``2 ** floor(log2 r)``.
_FP32_EXPONENT_MASK = 0x7F800000
_FP32_ONE_BITS = 0x3F800000


def _e2m1_magnitude_times_step(mag: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``e2m1_rne(mag / step) * step`` for magnitudes ``mag [..., n]`` (finite, >= 0)
    and block steps ``step [..., 1]`` (0 where the block scale is 0, giving 0s),
    by arithmetic instead of a table: a new tensor, temporaries updated in place.

    Exact: after clamping to 6 (E2M1 saturates), ``r / spacing`` only moves the
    exponent, ``round`` is ties-to-even (the even-mantissa neighbour, as
    ``e2m1_code``), and multiplying back by a power of two is exact."""
    # A zero step divides by inf instead: 0 for any finite magnitude, as the reference.
    r = mag / torch.where(step > 0, step, torch.inf)
    r.clamp_(max=FP4_MAX)
    # 2 ** floor(log2 r), at least 1 (0 and subnormals included): twice the E2M1 spacing.
    twice_spacing = r.view(torch.int32).bitwise_and(_FP32_EXPONENT_MASK).clamp_(min=_FP32_ONE_BITS).view(torch.float32)
    r.mul_(2.0).div_(twice_spacing).round_().mul_(twice_spacing).mul_(0.5)   # r is now e2m1_rne(mag / step)
    return r.mul_(step)


def fake_quantize_fused(
    x: torch.Tensor,
    four_six: Optional[str] = None,
    *,
    amax: Optional[torch.Tensor | float] = None,
    global_enc: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None,
    name: str = "tensor",
) -> torch.Tensor:
    """Bit for bit ``quantize(x, four_six, amax=amax, global_enc=global_enc,
    name=name).dequantize(dtype)`` (1-D blocks, last dim a multiple of 16), in
    fewer passes over memory: the dequantized values are computed directly
    (no codes, packing or table look-ups) from the magnitudes, with the sign
    copied from ``x`` at the end (the reference keeps the input's sign bit in the
    code, so a negative value rounding to 0 comes back as -0 here too).

    This is the W4A4 reference path's activation quantizer; ``quantize`` stays
    the definition (tests pin the two together). ``dtype`` defaults to ``x.dtype``.
    """
    _validate_layout(x, name, four_six, pad=False, block_2d=False)
    if global_enc is None:
        global_enc = global_encode_scale(tensor_amax(x) if amax is None else amax, four_six is not None)
    global_enc = torch.as_tensor(global_enc, dtype=torch.float32, device=x.device).reshape(())
    kp = x.shape[-1]
    # blocks: [rows, K/16, 16], the layout the reference's quantize_blocks reduces over.
    blocks = x.detach().float().reshape(-1, kp // BLOCK_SIZE, BLOCK_SIZE)
    out = torch.empty_like(blocks)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(kp, 1))
    for start in range(0, blocks.shape[0], rows_per_chunk):
        chunk = blocks[start : start + rows_per_chunk]
        mag = chunk.abs()
        bmax = mag.amax(-1)
        if not torch.isfinite(bmax).all():   # NaN/Inf reach the block max: name the tensor like quantize
            check_finite(x, name)
        step6 = (block_scale(bmax, global_enc, FP4_MAX) / global_enc).unsqueeze(-1)
        x_hat = _e2m1_magnitude_times_step(mag, step6)
        if four_six is not None:
            step4 = (block_scale(bmax, global_enc, 4.0) / global_enc).unsqueeze(-1)
            x_hat4 = _e2m1_magnitude_times_step(mag, step4)
            # |x_hat - x| is the same on magnitudes (both share x's sign), so the errors are the reference's.
            chose_four = _block_error(x_hat4, mag, four_six) < _block_error(x_hat, mag, four_six)
            x_hat = torch.where(chose_four.unsqueeze(-1), x_hat4, x_hat)
        torch.copysign(x_hat, chunk, out=out[start : start + rows_per_chunk])
    return out.reshape(x.shape).to(dtype or x.dtype)


def quantization_error(x: torch.Tensor, q: NVFP4Tensor) -> float:
    """Relative Frobenius error ``||x - x_hat|| / ||x||`` (0 for an all-zero x)."""
    xf = x.detach().float()
    norm = float(xf.norm())
    if norm == 0.0:
        return 0.0
    return float((q.dequantize(torch.float32) - xf).norm()) / norm


def activation_amax_from_global(input_global_scale: torch.Tensor) -> torch.Tensor:
    """Calibrated input amax from the on-disk ``input_global_scale`` divisor
    (``6 * 448 / amax``): the one place this convention is inverted."""
    return (FP4_MAX * FP8_MAX) / input_global_scale.float().reshape(())


def input_global_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """On-disk ``input_global_scale`` (``6 * 448 / amax``) for a calibrated amax."""
    return global_encode_scale(amax, four_six=False)


__all__ = [
    "BLOCK_SIZE", "E2M1_VALUES", "FOUR_SIX_FP8_MAX", "FOUR_SIX_RULES", "FP4_MAX", "FP8_MAX",
    "NVFP4Error", "NVFP4Tensor", "activation_amax_from_global", "block_scale", "check_finite",
    "dequantize", "e2m1_code", "e2m1_decode", "e2m1_rne", "e4m3_rne", "fake_quantize", "fake_quantize_fused",
    "global_encode_scale", "input_global_scale_from_amax", "pack_codes", "quantization_error",
    "quantize", "quantize_blocks", "tensor_amax", "unpack_codes",
]

