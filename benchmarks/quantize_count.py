"""Instructions a block of the 16-bit quantize kernel's tile loop, standard and Four Over Six, without a GPU
(issue 44 item 3): the kernel compiled for sm_90 (and sm_80) as the launch builds it (tile 1 x 128
blocks, 4 warps: a thread holds one block a tile), its PTX and the SASS of the bundled ptxas
(``cuobjdump``) read between the loop's label and its backward branch, counted by opcode. PTX counts the
lines of each inline-asm block's instructions too; its ``mov`` of constants ptxas folds into
immediates, so the count without them is the closer one. For bf16 the per-block loop holds two copies of
the tile (the fast threshold arithmetic and the table's, for global scales from 2^112), one of which runs.

    PYTHONPATH=$PWD python benchmarks/quantize_count.py            # table of counts
    PYTHONPATH=$PWD python benchmarks/quantize_count.py --opcodes  # and the most frequent opcodes
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

TYPES = {"x_ptr": "*i32", "amax_ptr": "*fp32", "table_ptr": "*i32", "enc_ptr": "*fp32", "packed_ptr": "*i32",
         "scale_ptr": "*u8", "chose_ptr": "*i8", "scaled_ptr": "*i32"}
RULES = {None: 0, "mse": 1, "mae": 2, "max": 3}


def _build(rule, f16: bool, table: bool, arch: int = 90, asm: int = 1):
    from compile_target import compile_for
    from fp4ptq.kernels import quantize_kernel as qk

    ce = dict(F16=f16, FOUR_SIX=RULES[rule], EMIT_PACKED=True, EMIT_SCALED=False, ASM=asm, BLOCK_M=1,
              BLOCKS_K=128, TABLE=table, WORD_MAJOR=table and rule is None)
    return compile_for(qk._quantize16_kernel, TYPES, ce, arch=arch, divisible=("K", "stride_xw", "stride_sw"),
                       num_warps=4, enable_fp_fusion=False)


def _loop(lines, label_of, target_of):
    """The lines from the loop's head to its backward branch (the longest backward branch)."""
    where = {label_of(l): i for i, l in enumerate(lines) if label_of(l)}
    best = None
    for i, l in enumerate(lines):
        t = target_of(l)
        if t in where and where[t] < i and (best is None or i - where[t] > best[1] - best[0]):
            best = (where[t], i)
    return lines[best[0]:best[1] + 1] if best else []


def ptx_ops(ptx: str) -> collections.Counter:
    lines = [l.strip() for l in ptx.splitlines()]
    body = _loop(lines, lambda l: (re.match(r"^(\$L__\w+):", l) or [None, None])[1],
                 lambda l: (re.search(r"bra(?:\.uni)?\s+(\$L__\w+);", l) or [None, None])[1])
    ops = collections.Counter()
    for l in body:
        if not l or l.startswith(("$", ".", "//")):
            continue
        for part in l.split(";"):
            p = part.strip().lstrip("{").strip()
            if not p or p.startswith((".reg", "}")):
                continue
            words = p.split()
            op = words[1] if words[0].startswith("@") else words[0]
            ops[op.split(".")[0]] += 1
    return ops


def sass_ops(cubin: bytes) -> collections.Counter:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    lines = [(int(m.group(1), 16), m.group(2).strip()) for m in
             (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", l) for l in out.splitlines()) if m]
    addr = {a: i for i, (a, _) in enumerate(lines)}
    body = _loop([f"{a:x} {ins}" for a, ins in lines], lambda l: int(l.split()[0], 16),
                 lambda l: (lambda m: int(m.group(1), 16) if m and int(m.group(1), 16) in addr else None)(
                     re.search(r"BRA.*?0x([0-9a-f]+)", l)))
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", l.split(None, 1)[1]).split()[0].split(".")[0]
                               for l in body)


def main(argv) -> None:
    print("| build | rule | PTX | PTX without mov | SASS |")
    print("|---|---|---|---|---|")
    for f16 in (False, True):
        for table in (True, False):
            for rule in (None, "mse", "mae", "max"):
                k = _build(rule, f16, table)
                p, s = ptx_ops(k.asm["ptx"]), sass_ops(k.asm["cubin"])
                name = f"sm_90 {'fp16' if f16 else 'bf16'} {'table' if table else 'per block'}"
                print(f"| {name} | {rule} | {sum(p.values())} | {sum(p.values()) - p['mov']} | {sum(s.values())} |")
                if "--opcodes" in argv:
                    print("|  |  | | " + ", ".join(f"{o} {n}" for o, n in p.most_common(8)) + " | "
                          + ", ".join(f"{o} {n}" for o, n in s.most_common(8)) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
