"""A small emulator of the inline PTX blocks of fp4ptq's kernels, for CPU tests: the dozen
instructions they use, bit for bit (packed 16-bit float compares, adds, FMAs, maxes, mins and products
rounded like the hardware, integer subtractions, shifts, masks and ``lop3``, ``prmt``), on int64
tensors of 32-bit words."""
from __future__ import annotations

import torch

DTYPES = {"bf16x2": torch.bfloat16, "f16x2": torch.float16}


def _halves(r: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    def one(v):
        v = torch.where(v >= 32768, v - 65536, v)
        return v.to(torch.int16).view(dtype).double()
    return one(r & 0xFFFF), one((r >> 16) & 0xFFFF)


def _join(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    def bits(v):  # one rounding to the 16-bit format (values here are exact in fp32)
        return v.float().to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    return bits(lo) | (bits(hi) << 16)


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: int) -> torch.Tensor:
    """Default mode: selector nibble i picks byte ``nibble & 7`` of (a, b) for output byte i, or, with
    the nibble's bit 3 set, that byte's sign bit replicated over the 8 bits."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = torch.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = pool[nib & 7]
        if nib & 8:
            byte = torch.where(byte >= 0x80, 0xFF, 0)
        out |= byte << (8 * i)
    return out


def _lop3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, lut: int) -> torch.Tensor:
    """Bit i of the result is bit (a_i << 2 | b_i << 1 | c_i) of ``lut`` (PTX ``lop3.b32``)."""
    m = 0xFFFFFFFF
    out = torch.zeros_like(a)
    for idx in range(8):
        if lut >> idx & 1:
            term = (a if idx & 4 else ~a & m) & (b if idx & 2 else ~b & m) & (c if idx & 1 else ~c & m)
            out |= term
    return out & m


def run_ptx(asm: str, *inputs: torch.Tensor) -> torch.Tensor:
    """Execute one of the kernels' PTX blocks on int64 tensors of 32-bit words (``$0`` is the
    output, ``$1..`` the inputs), with the semantics of the PTX ISA for the instructions used."""
    return run_ptx_regs(asm, {f"${i + 1}": v for i, v in enumerate(inputs)})["$0"]


def run_ptx_regs(asm: str, inputs: dict) -> dict:
    """The same for any named operands: ``inputs`` maps ``$i`` to tensors; returns every register."""
    regs = {k: v.to(torch.int64) & 0xFFFFFFFF for k, v in inputs.items()}
    like = next(iter(regs.values()))

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return torch.full_like(like, int(tok, 0), dtype=torch.int64)

    body = asm.replace("{", " ").replace("}", " ")
    for stmt in (s.strip() for s in body.split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        dst, *src = [t.strip() for t in args.split(",")]
        parts = op.split(".")
        ty = parts[-1]
        if op == "mov.b32":
            out = val(src[0])
        elif op == "and.b32":
            out = val(src[0]) & val(src[1])
        elif op == "or.b32":
            out = val(src[0]) | val(src[1])
        elif op == "sub.u32":
            out = (val(src[0]) - val(src[1])) & 0xFFFFFFFF
        elif op == "lop3.b32":
            out = _lop3(val(src[0]), val(src[1]), val(src[2]), int(src[3], 0))
        elif op == "shr.u32":
            out = val(src[0]) >> int(src[1])
        elif op == "shl.b32":
            out = (val(src[0]) << int(src[1])) & 0xFFFFFFFF
        elif op == "mul.lo.u32":
            out = (val(src[0]) * val(src[1])) & 0xFFFFFFFF
        elif op == "max.u32":
            out = torch.maximum(val(src[0]), val(src[1]))
        elif op == "prmt.b32":
            out = _prmt(val(src[0]), val(src[1]), int(src[2], 0))
        elif ty in DTYPES:
            dt = DTYPES[ty]
            ops = [_halves(val(s), dt) for s in src]
            if parts[0] == "set":  # set.ge.T.T: 1.0 in each half where true
                assert parts[1] == "ge" and parts[2] == ty
                lo, hi = ((ops[0][j] >= ops[1][j]).double() for j in (0, 1))
            elif parts[0] == "add":
                lo, hi = (ops[0][j] + ops[1][j] for j in (0, 1))
            elif parts[0] == "mul":
                lo, hi = (ops[0][j] * ops[1][j] for j in (0, 1))
            elif parts[0] == "fma":
                lo, hi = (ops[0][j] * ops[1][j] + ops[2][j] for j in (0, 1))
            elif parts[0] == "max":
                lo, hi = (torch.maximum(ops[0][j], ops[1][j]) for j in (0, 1))
            elif parts[0] == "min":
                lo, hi = (torch.minimum(ops[0][j], ops[1][j]) for j in (0, 1))
            else:
                raise AssertionError(f"emulator: no {op}")
            out = _join(lo, hi, dt)
        else:
            raise AssertionError(f"emulator: no {op}")
        regs[dst] = out & 0xFFFFFFFF
    return regs


def sample_words_and_scales(n: int = 4096, seed: int = 0):
    """Test data for the decoders: ``n`` random words of 8 E2M1 codes (the first two hold every code
    once), their reference values ``[n, 8]`` (float64), and one E4M3 scale a word (float64) with zero,
    subnormal, unit and the largest scales among the first eight."""
    from fp4ptq import nvfp4

    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(0, 2**32, (n,), generator=gen, dtype=torch.int64)
    words[:2] = torch.tensor([0x76543210, 0xFEDCBA98])
    codes = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], 1)
    ref = nvfp4.e2m1_decode(codes.to(torch.uint8)).double()
    sbytes = torch.randint(0, 127, (n,), generator=gen, dtype=torch.int64)
    sbytes[:8] = torch.tensor([0, 1, 7, 8, 0x38, 0x70, 0x7E, 0x40])
    return words, ref, sbytes.to(torch.uint8).view(torch.float8_e4m3fn).double()


def multiply_decode_words() -> torch.Tensor:
    """Words for the multiply decode's tests: ``sample_words_and_scales``'s, and for each register p
    every one of the 256 pairs of codes (p, p + 4) it decodes, among random other codes."""
    words, _, _ = sample_words_and_scales()
    gen = torch.Generator().manual_seed(1)
    pairs = torch.arange(256, dtype=torch.int64)
    extra = []
    for p in range(4):
        w = torch.randint(0, 2**32, (256,), generator=gen, dtype=torch.int64)
        w &= ~((0xF << (4 * p)) | (0xF << (4 * p + 16)))
        extra.append(w | ((pairs & 0xF) << (4 * p)) | ((pairs >> 4) << (4 * p + 16)))
    return torch.cat([words, *extra])


def bf16_scale_pair(scale: torch.Tensor) -> torch.Tensor:
    """The decoders' bf16 scale operand: ``scale * 2^100`` (exact in bf16) in both halves of a word."""
    s16 = (scale * 2.0**100).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    return s16 | (s16 << 16)


def multiply_decode_inputs(seed: int) -> dict:
    """Operands of a decode block that reads one word in ``$4 .. $11`` and one bf16 scale pair in
    ``$12 .. $15`` (mma.py's and wsgemm.py's): ``multiply_decode_words`` and sampled scales."""
    words = multiply_decode_words()
    pair = bf16_scale_pair(sample_words_and_scales(len(words), seed=seed)[2])
    return {**{f"${4 + i}": words for i in range(8)}, **{f"${12 + i}": pair for i in range(4)}}


def assert_same_registers(asm_a: str, asm_b: str, inputs: dict, outputs: int = 4) -> None:
    """Both PTX blocks, run on the same ``inputs``, write the same bits to ``$0 .. $(outputs - 1)``."""
    a, b = run_ptx_regs(asm_a, inputs), run_ptx_regs(asm_b, inputs)
    for q in range(outputs):
        assert torch.equal(a[f"${q}"], b[f"${q}"]), f"${q}"
