"""Compile a fp4ptq Triton or Gluon kernel for an NVIDIA GPU that this machine does not have (the
tests read the PTX it gives), with the argument facts the kernel sees at run time."""
from __future__ import annotations

import pytest


def compile_for(fn, types: dict, constexprs: dict, *, arch: int = 90, gluon: bool = False,
                divisible: tuple = (), **options):
    """``fn`` compiled for ``sm_<arch>``: arguments named in ``constexprs`` are compile-time constants
    (compile-time parameters left out take their default, as a launch would), the others take their
    type from ``types`` (``i32`` when not named there). As at run time, pointer
    arguments are 16-byte aligned (torch allocations; the launchers copy operands that are not) and
    the integers named in ``divisible`` are multiples of 16 (Triton specializes those). Skips the
    test on a Triton install without the CUDA toolchain."""
    import triton
    from triton.backends.compiler import GPUTarget

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source
    constexprs = dict(constexprs)
    for p in fn.params:  # an omitted compile-time parameter would otherwise become a run-time i32
        if p.is_constexpr and p.has_default and p.name not in constexprs:
            constexprs[p.name] = p.default
    sig = {a: ("constexpr" if a in constexprs else types.get(a, "i32")) for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(sig)
             if (a.endswith("_ptr") and a not in constexprs) or a in divisible}
    try:
        return triton.compile(Source(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    except (ImportError, FileNotFoundError) as exc:  # a Triton install without the CUDA toolchain
        pytest.skip(f"cannot compile for sm_{arch} here: {exc}")
