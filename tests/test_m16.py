"""The stream-K M <= 64 GEMM (fp4ptq/kernels/streamk.py, issue 44 item 2) on CPU.

Its Gluon launch cannot run under the Triton interpreter, so here: the schedule (every (row tile,
K step) pair in exactly one program, programs within one step of each other, a tile's programs
consecutive in slot order, the ring's incremental step walk equal to the flat order), the module's
launch wiring with the Gluon launch replaced by a torch model of its partial sums and the real
summing pass run under ``TRITON_INTERPRET=1`` (in a fresh process, as tests/test_grouped.py) against
the reference (fp32 matmul of nvfp4.py's dequantized weight) at M = 1, 5, 16, odd N, 64- and 128-wide
K steps; and the guard's errors. The sm_90 and sm_80 builds are compiled and hashed by
tests/test_ptx_hashes.py ("streamk" cases); numerics and timings on the GPU: the module's self-test and
benchmarks/bench_kernels_h200.py (``ours_w4a16_streamk``).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fp4ptq import nvfp4

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from fp4ptq.kernels import streamk as sk  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
in_main = pytest.mark.skipif(INTERPRETED, reason="no kernel: runs in the main process")
TOLERANCE = 1e-2  # the dense kernels' (tests/test_kernels.py: relative Frobenius error against the reference)


@pytest.mark.skipif(INTERPRETED, reason="this is the driver of the interpreted run")
def test_streamk_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", __file__]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]


def _ranges(total: int, g: int):
    return [(p * total // g, (p + 1) * total // g) for p in range(g)]


def _walk(s0: int, s1: int, steps: int, stages: int):
    """The kernel's copy order (``_advance`` from the program's first step, a copy per consumed step
    after ``stages - 1`` ahead), as (tile, K step) pairs, in the order the ring hands them out."""
    qi, ti, ki = s0, s0 // steps, s0 % steps
    issued = []
    for _ in range(stages - 1 + (s1 - s0)):
        issued.append((ti, ki))
        more = int(qi < s1 - 1)
        ki += more
        wrap = int(ki == steps)
        qi, ti, ki = qi + more, ti + wrap, ki - wrap * steps
    return issued


@in_main
@pytest.mark.parametrize("tiles,steps,g", [(448, 64, 528), (224, 32, 512), (7, 17, 5), (3, 9, 27), (64, 32, 256),
                                           (1, 1, 1), (5, 3, 4)])
def test_schedule_partitions_the_steps(tiles, steps, g):
    total = tiles * steps
    g = min(g, total)
    ranges = _ranges(total, g)
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    lengths = {s1 - s0 for s0, s1 in ranges}
    assert min(lengths) >= 1 and max(lengths) - min(lengths) <= 1
    for p, (s0, s1) in enumerate(ranges):
        assert sk.first_program(s0, g, total) == p and sk.first_program(s1 - 1, g, total) == p
        # the ring hands out step q exactly when the loop consumes it (the trailing copies reload s1 - 1)
        issued = _walk(s0, s1, steps, 3)
        assert issued[:s1 - s0] == [(q // steps, q % steps) for q in range(s0, s1)]
        assert set(issued[s1 - s0:]) <= {((s1 - 1) // steps, (s1 - 1) % steps)}
    slots_used = 0
    for t in range(tiles):
        first = sk.first_program(t * steps, g, total)
        last = sk.first_program((t + 1) * steps - 1, g, total)
        owners = [p for p, (s0, s1) in enumerate(ranges) if s0 < (t + 1) * steps and s1 > t * steps]
        assert owners == list(range(first, last + 1))
        slots_used = max(slots_used, last - first + 1)
    assert sk.slots(tiles, steps, g) == slots_used


@in_main
def test_config_fills_the_gpu_on_the_large_layers():
    # 70B gate_up at M = 16: 128-row tiles, 4 programs an SM (132 SMs), every program 54-55 steps
    bn, bm, bk, warps, stages, g = sk.config(16, 57344, 8192, 132, 4)
    assert (bn, bm, bk, warps, stages, g) == (128, 16, 128, 4, 3, 528)
    lengths = {s1 - s0 for s0, s1 in _ranges(448 * 64, g)}
    assert lengths == {54, 55}
    # a small layer keeps 512 K or more a program (fewer programs an SM), never more programs than steps
    assert sk.config(16, 4096, 4096, 132, 8)[5] == 3 * 132
    assert sk.config(1, 100, 64, 132, 8)[5] == 2
    assert sk.supports(16, 1000, 1088) and not sk.supports(65, 1000, 1088) and not sk.supports(16, 1000, 1040)


@in_main
def test_resident_programs():
    # mma.py's M = 16 tile (4 warps, a 3-step ring of 39936 bytes): 4 an SM up to 128 registers, 3 above
    assert [sk.resident_programs(r, 39936, 4) for r in (106, 128, 129, 168)] == [4, 4, 3, 3]
    assert sk.resident_programs(128, 26112, 2) == 8  # the 64-row tile on 2 warps
    assert sk.resident_programs(64, 120000, 4) == 1  # shared memory bound
    assert sk.resident_programs(128, 39936, 4, sm_smem=167936) == 4  # an A100 SM (164 KB)


@in_main
@pytest.mark.parametrize("regs,cap_regs,want", [(140, 128, (4, 128)), (120, None, (4, 0)), (140, 136, (3, 0))])
def test_register_cap_is_taken_only_where_it_keeps_four_programs(monkeypatch, regs, cap_regs, want):
    """MAXNREG = None: a build over 128 registers (3 programs of 4 warps an SM) is rebuilt with a 128 cap and
    that cap kept where its build holds 4; the grid and the launch follow what was kept."""
    from fp4ptq.kernels import _common

    class Kernel:
        def warmup(self, *args, grid, **kwargs):
            return kwargs.get("maxnreg", 0)

    monkeypatch.setattr(sk, "_streamk_kernel", Kernel())
    monkeypatch.setattr(sk, "_resident", lambda cap, warps, device: (
        sk.resident_programs(cap_regs if cap else regs, 39936, warps), cap_regs if cap else regs, 39936))
    monkeypatch.setattr(_common, "_sm_count", lambda device: 132)
    monkeypatch.setattr(sk, "_PER_SM_SEEN", {})
    launched = []
    monkeypatch.setattr(sk, "Launch", lambda kernel, grid, args, slots, kwargs: launched.append((grid, kwargs)))
    m, n, k = 16, 57344, 8192
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    words, sbits, enc = torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n, k // 16, dtype=torch.uint8), torch.ones(1)
    sk._learn_per_sm(x, words, sbits, enc, None)
    assert sk.chosen(m, n, k, x.device)["per_sm"] == want[0] and sk.chosen(m, n, k, x.device)["maxnreg"] == want[1]
    sk.launches(x, words, sbits, enc, None, None, torch.zeros(m, n, dtype=torch.bfloat16))
    (grid, kwargs), _ = launched
    assert grid == (132 * want[0],) and kwargs.get("maxnreg", 0) == want[1]


@in_main
def test_guard_refuses_what_it_cannot_take():
    w = torch.zeros(8, 1040 // 8, dtype=torch.int32)
    s = torch.zeros(8, 1040 // 16, dtype=torch.uint8)
    enc = torch.ones(1)
    with pytest.raises(ValueError, match="K % 64 == 0"):
        sk.launches(torch.zeros(4, 1040, dtype=torch.bfloat16), w, s, enc, None, None, torch.zeros(4, 8))
    with pytest.raises(ValueError, match="M <= 64"):
        sk.launches(torch.zeros(65, 1024, dtype=torch.bfloat16), w, s, enc, None, None, torch.zeros(65, 8))
    with pytest.raises(TypeError, match="bf16 or fp16"):
        sk.launches(torch.zeros(4, 1024), w, s, enc, None, None, torch.zeros(4, 8))
    from fp4ptq.kernels import gemm

    wq = nvfp4.quantize(torch.randn(8, 1040))
    with pytest.raises(ValueError, match="streamk"):  # the forced path names why it cannot run here
        gemm.linear_w4a16(torch.randn(4, 1040).bfloat16(), wq, path="streamk")


class _Model:
    """Stands in for the Gluon launch: each program's fp32 partial sums of its steps of each tile it meets,
    written into the workspace at its slot, as the kernel's ``store_output`` does (the exact products
    ``x * v * scale`` summed in fp32: here x @ W.T of the dequantized weight)."""

    def __init__(self, real, w: torch.Tensor):
        self.real, self.w = real, w

    def __call__(self, kernel, grid, args, slots, kwargs):
        if kernel is not sk._streamk_kernel:
            return self.real(kernel, grid, args, slots, kwargs)
        fixed = list(args)
        w = self.w

        def launch(x2, ws):
            m, n, steps, total, g = fixed[6], fixed[7], fixed[11], fixed[12], fixed[13]
            bn, bk = kwargs["BN"], kwargs["BK"]
            assert grid == (g,) and not kwargs["HAS_XENC"] and ws.shape[1:] == (m, n) and x2.shape[0] == m
            ws.fill_(float("nan"))  # a slot the summing pass reads unwritten would show
            for p, (s0, s1) in enumerate(_ranges(total, g)):
                for t in range(s0 // steps, (s1 - 1) // steps + 1):
                    q0, q1 = max(s0, t * steps) - t * steps, min(s1, (t + 1) * steps) - t * steps
                    j = p - sk.first_program(t * steps, g, total)
                    rows = slice(t * bn, min(n, (t + 1) * bn))
                    ks = slice(q0 * bk, q1 * bk)
                    ws[j, :, rows] = x2[:, ks].float() @ w[rows, ks].T
        return launch


@interpreted
@pytest.mark.parametrize("m,n,k,g", [(1, 200, 1088, None), (5, 200, 2048, 7), (16, 1000, 1088, 9), (16, 333, 4096, 40),
                                     (16, 130, 128, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_summing_pass_against_the_reference(monkeypatch, m, n, k, g, bias):
    from fp4ptq.kernels import _common

    gen = torch.Generator().manual_seed(m * 7 + n + k)
    wq = nvfp4.quantize(torch.randn(n, k, generator=gen) * 0.05)
    wref = wq.dequantize(torch.float32)
    x = (torch.randn(m, k, generator=gen) * 2).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    monkeypatch.setattr(sk, "Launch", _Model(sk.Launch, wref))
    _, _, words, sbits, enc = _common._weight_views(wq)
    cfg = None
    if g is not None:
        bn, bm, bk, warps, stages, _ = sk.config(m, n, k, 2)
        cfg = (bn, bm, bk, warps, stages, g)
        total = -(-n // bn) * (k // bk)
        assert sk.slots(-(-n // bn), k // bk, g) >= (2 if g > -(-n // bn) else 1)
        assert g <= total
    y = torch.full((m, n), float("nan")).bfloat16()
    sk.launches(x, words, sbits, enc, None, b, y, cfg)(x, y)
    ref = x.float() @ wref.T + (b.float() if bias else 0.0)
    assert torch.isfinite(y.float()).all()
    assert float((y.float() - ref).norm() / ref.norm()) < TOLERANCE
