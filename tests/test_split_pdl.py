"""The summing pass of a K split as a programmatic dependent launch (gemm.split_pdl): when it is
used, what the compiled kernels contain (PTX for sm_90, built here without the GPU), and that the
pass loads every partial before it adds them, in split order."""
from __future__ import annotations

import re

import pytest
import torch

from compile_target import compile_for
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import mma

pytest.importorskip("triton")


def _finish_ptx(pdl: bool, segments: int = 4) -> str:
    types = {"part_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16"}
    ce = dict(SEGMENTS=segments, HAS_BIAS=False, BLOCK=1024, PDL=pdl)
    return compile_for(gm._gemv_split_finish, types, ce, num_warps=4).asm["ptx"]


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
    monkeypatch.setattr(gm, "INTERPRET", False)
    monkeypatch.setattr(gm, "_capability", lambda device: capability)


@pytest.mark.parametrize("capability,expected", [((9, 0), True), ((10, 0), True), ((8, 9), False)])
def test_split_pdl_needs_sm90(monkeypatch, capability, expected):
    _fake_cuda(monkeypatch, capability)
    monkeypatch.setattr(torch.version, "hip", None)
    cuda = torch.device("cuda", 0)
    assert gm.split_pdl(cuda) is expected
    assert gm.split_trigger(cuda) is expected
    assert gm.split_pdl(torch.device("cpu")) is False


def test_split_pdl_knobs(monkeypatch):
    _fake_cuda(monkeypatch, (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(gm, "SPLIT_TRIGGER", False)
    assert gm.split_pdl(cuda) and not gm.split_trigger(cuda)
    monkeypatch.setattr(gm, "SPLIT_PDL", False)
    assert not gm.split_pdl(cuda) and not gm.split_trigger(cuda)
    monkeypatch.setattr(gm, "SPLIT_PDL", True)
    monkeypatch.setattr(gm, "INTERPRET", True)  # the interpreter launches plainly
    assert not gm.split_pdl(cuda)


def test_split_finish_launches_as_a_dependent_only_where_split_pdl_says(monkeypatch):
    y = torch.empty(3, 40, dtype=torch.bfloat16)
    for pdl in (False, True):
        monkeypatch.setattr(gm, "split_pdl", lambda device, pdl=pdl: pdl)
        launch = gm.split_finish(4, y, torch.zeros(40, dtype=torch.bfloat16))
        assert launch.kwargs["PDL"] is pdl and launch.kwargs["launch_pdl"] is pdl
        assert launch.kwargs["SEGMENTS"] == 4

