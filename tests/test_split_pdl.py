"""The summing pass of a K split as a programmatic dependent launch (cm.split_pdl): when it is
used, what the compiled kernels contain (PTX for sm_90, built here without the GPU), and that the
pass loads every partial before it adds them, in split order."""
from __future__ import annotations

import re

import pytest
import torch

from compile_target import compile_for
from fp4ptq.kernels import mma
from fp4ptq.kernels import _common as cm, gemv as gv  # noqa: E402

pytest.importorskip("triton")


def _finish_ptx(pdl: bool, segments: int = 4) -> str:
    types = {"part_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16"}
    ce = dict(SEGMENTS=segments, HAS_BIAS=False, BLOCK=1024, PDL=pdl)
    return compile_for(cm._gemv_split_finish, types, ce, num_warps=4).asm["ptx"]


@pytest.mark.parametrize("pdl", [False, True])
def test_summing_pass_waits_on_its_split_kernel_only_as_a_dependent(pdl):
    ptx = _finish_ptx(pdl)
    assert ("griddepcontrol.wait" in ptx) == pdl
    if pdl:  # the wait comes before the first read of a partial
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


@pytest.mark.parametrize("segments", [2, 3, 8])
def test_summing_pass_has_every_partial_in_flight_before_the_first_add(segments):
    """Unrolled segments: all loads are issued before the adds (which keep split order, so the bits
    are those of the loop that loaded one partial at a time)."""
    body = _finish_ptx(True, segments)
    first_add = body.index("add.f32")
    loads = re.findall(r"ld\.global(?:\.\w+)*\.v\d\.b32|ld\.global(?:\.\w+)*\.b32", body[:first_add])
    assert len(loads) >= segments


@pytest.mark.parametrize("trigger", [False, True])
def test_mma_kernel_signals_its_dependent_when_told(trigger):
    ce = dict(BN=128, BM=16, BK=128, WARPS=4, STAGES=3, SPLIT=True, HAS_BIAS=False, HAS_XENC=False,
              TRIGGER=trigger)
    ce.update(zip(("WL", "SL", "XL", "SC", "XC"), mma._layouts(128, 16, 128, 4)))
    types = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "wenc_ptr": "*fp32", "xenc_ptr": "*fp32",
             "bias_ptr": "*bf16", "y_ptr": "*fp32"}
    ptx = compile_for(mma._mma_kernel, types, ce, gluon=True, num_warps=4).asm["ptx"]
    assert ("griddepcontrol.launch_dependents" in ptx) == trigger
    if trigger:  # at the start: before the first copy of the ring
        assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("cp.async")


def _fake_cuda(monkeypatch, capability):
    monkeypatch.setattr(cm, "INTERPRET", False)
    monkeypatch.setattr(cm, "_capability", lambda device: capability)


@pytest.mark.parametrize("capability,expected", [((9, 0), True), ((10, 0), True), ((8, 9), False)])
def test_split_pdl_needs_sm90(monkeypatch, capability, expected):
    _fake_cuda(monkeypatch, capability)
    monkeypatch.setattr(torch.version, "hip", None)
    assert cm.split_pdl(torch.device("cuda", 0)) is expected
    assert cm.split_pdl(torch.device("cpu")) is False


def test_split_pdl_knob_and_interpreter(monkeypatch):
    _fake_cuda(monkeypatch, (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    cuda = torch.device("cuda", 0)
    assert cm.split_pdl(cuda)
    monkeypatch.setattr(cm, "SPLIT_PDL", False)
    assert not cm.split_pdl(cuda)
    monkeypatch.setattr(cm, "SPLIT_PDL", True)
    monkeypatch.setattr(cm, "INTERPRET", True)  # the interpreter launches plainly
    assert not cm.split_pdl(cuda)


@pytest.mark.parametrize("dependent", [False, True])
def test_summing_pass_is_a_dependent_only_of_a_kernel_that_signals_it(monkeypatch, dependent):
    """With and without a bias (the latter returns a wrapper around the launch), the pass's build and
    its launch option follow ``dependent``, never ``split_pdl`` alone."""
    built = []
    real = cm.Launch
    monkeypatch.setattr(cm, "Launch", lambda *a: built.append(a[4]) or real(*a))
    monkeypatch.setattr(cm, "split_pdl", lambda device: True)
    y = torch.empty(3, 40, dtype=torch.bfloat16)
    cm.split_finish(4, y, torch.zeros(40, dtype=torch.bfloat16), dependent)
    cm.split_finish(4, y, None, dependent)
    assert [(kw["PDL"], kw["launch_pdl"], kw["SEGMENTS"]) for kw in built] == [(dependent, dependent, 4)] * 2


def test_mma_signals_and_pairs_its_summing_pass_only_when_k_is_split(monkeypatch):
    """mma.launches: TRIGGER in the split kernel and a dependent summing pass go together, as
    ``split_pdl`` says; an unsplit call has neither."""
    seen = []
    monkeypatch.setattr(cm, "split_pdl", lambda device: True)
    monkeypatch.setattr(cm, "split_run", lambda launch, splits, y, bias, dependent=False:
                        seen.append((launch.kwargs["TRIGGER"], splits > 1, dependent)))
    monkeypatch.setattr(cm, "_sm_count", lambda device: 132)
    words, sbits, enc = torch.zeros(4096, 512, dtype=torch.int32), torch.zeros(4096, 256, dtype=torch.uint8), torch.ones(1)
    for m, k_split in ((16, 1024), (16, 4096)):
        x = torch.zeros(m, 4096, dtype=torch.bfloat16)
        mma.launches(x, words, sbits, enc, None, None, torch.empty(m, 4096, dtype=torch.bfloat16),
                     (64, 16, 128, 2, k_split, 3))
    assert seen == [(True, True, True), (False, False, False)]


@pytest.mark.parametrize("trigger", [False, True])
def test_gemv6_signals_its_dependent_when_told(trigger):
    types = {"x_ptr": "*bf16", "w_ptr": "*i64", "s_ptr": "*u8", "wenc_ptr": "*fp32", "xenc_ptr": "*fp32",
             "bias_ptr": "*bf16", "y_ptr": "*fp32"}
    ce = dict(HAS_BIAS=False, HAS_XENC=False, ROWS=4, KBP=256, EVEN_K=True, ALIGNED=True, EMULATE=False,
              SPLIT=True, PREFETCH=False, MULDEC=False, KB_C=0, F16=False,
              TRIGGER=trigger)
    ptx = compile_for(gv._gemv_resident_kernel, types, ce, num_warps=4).asm["ptx"]
    assert ("griddepcontrol.launch_dependents" in ptx) == trigger
    if trigger:  # at the start: before the first load
        assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("ld.global")


def test_gemv6_signals_and_pairs_its_summing_pass_only_when_k_is_split(monkeypatch):
    """gv._gemv6: TRIGGER in the split kernel and a dependent summing pass go together, as
    ``split_pdl`` says; a one-segment layer has neither."""
    seen = []
    monkeypatch.setattr(cm, "split_pdl", lambda device: True)
    monkeypatch.setattr(cm, "split_run", lambda launch, splits, y, bias, dependent=False:
                        seen.append((launch.kwargs["TRIGGER"], splits > 1, dependent)))
    monkeypatch.setattr(gv, "_whole_wave_programs", lambda *a, **k: 132 * 4)
    for n, k in ((3072, 3072), (4096, 4096)):  # Phi-3-mini o: 3 segments; 8B o: one
        x = torch.zeros(1, k, dtype=torch.bfloat16)
        words, sbits = torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n, k // 16, dtype=torch.uint8)
        gv._gemv6(x, words, sbits, torch.ones(1), torch.ones(1), torch.ones(1), torch.empty(1, n, dtype=torch.bfloat16),
                  1, n, k, False, None)
    assert seen == [(True, True, True), (False, False, False)]
