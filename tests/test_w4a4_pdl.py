"""W4A4 at small M: mma.py launched as the programmatic dependent of the activations' quantize launch
(cm.w4a4_pdl), and the plain launch taking over where a driver refuses dependent launches
(cm.dependent_or_plain). What the compiled kernels contain is read from their sm_90 PTX, built
here without the GPU; the pairing and the fallback are checked through the dispatch with the
launches recorded."""
from __future__ import annotations

import re

import pytest
import torch

from compile_target import compile_for
from fp4ptq import nvfp4
from fp4ptq.kernels import gemm as gm
from fp4ptq.kernels import mma, quantize_kernel
from fp4ptq.kernels import _common as cm, dispatch as dp, gemv as gv  # noqa: E402

pytest.importorskip("triton")

MMA_TYPES = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "wenc_ptr": "*fp32", "xenc_ptr": "*fp32",
             "bias_ptr": "*bf16", "y_ptr": "*fp32"}


def _mma_ptx(wait: bool, bn=128, bm=16, bk=128, warps=4, split=True) -> str:
    ce = dict(BN=bn, BM=bm, BK=bk, WARPS=warps, STAGES=3, SPLIT=split, HAS_BIAS=False, HAS_XENC=True,
              TRIGGER=split, WAIT=wait)
    ce.update(zip(("WL", "SL", "XL", "SC", "XC"), mma._layouts(bn, bm, bk, warps)))
    return compile_for(mma._mma_kernel, MMA_TYPES, ce, gluon=True, num_warps=warps, launch_pdl=wait).asm["ptx"]


def _prologue(ptx: str) -> str:
    """The PTX up to the ring's first wait (the copies of the first STAGES - 1 steps)."""
    return ptx[:ptx.index("cp.async.wait_group")]


@pytest.mark.parametrize("cfg", [(128, 16, 128, 4, True), (64, 32, 64, 2, False)])
def test_mma_copies_its_first_weight_steps_before_waiting_and_the_activations_after(cfg):
    bn, bm, bk, warps, split = cfg
    plain, dependent = _mma_ptx(False, *cfg), _mma_ptx(True, *cfg)
    assert "griddepcontrol.wait" not in plain
    head, tail = _prologue(dependent).split("griddepcontrol.wait")
    assert "ld.global" not in head  # nothing read before the wait but the weight's copies
    copies = lambda text: len(re.findall(r"cp\.async\.c[ag]\.shared\.global", text))  # noqa: E731
    x_per_step = bk * bm * 2 // (32 * warps * 16)  # 16-byte copies a thread a step of activations
    assert copies(tail) == 2 * x_per_step  # the activations of both steps, after the wait
    assert copies(head) + copies(tail) == copies(_prologue(plain))  # the same copies, reordered
    assert copies(head) > 0 and "cp.async.commit_group" not in head
    if split:  # the summing pass is still signalled at the start
        assert dependent.index("griddepcontrol.launch_dependents") < dependent.index("cp.async")


QUANT16_TYPES = {"x_ptr": "*i32", "amax_ptr": "*fp32", "table_ptr": "*i32", "enc_ptr": "*fp32", "packed_ptr": "*i32",
                 "scale_ptr": "*u8", "chose_ptr": "*i8", "scaled_ptr": "*i32"}
QUANT_TYPES = {"x_ptr": "*bf16", "amax_ptr": "*fp32", "enc_ptr": "*fp32", "packed_ptr": "*i32", "scale_ptr": "*u8",
               "chose_ptr": "*i8", "scaled_ptr": "*bf16"}


@pytest.mark.parametrize("trigger", [False, True])
@pytest.mark.parametrize("kernel", ["quant16", "fp32"])
def test_quantize_kernels_signal_the_gemm_after_them_when_told(kernel, trigger):
    common = dict(FOUR_SIX=0, EMIT_PACKED=False, EMIT_SCALED=True, TRIGGER=trigger)
    if kernel == "quant16":
        ce = dict(common, F16=False, ASM=True, BLOCK_M=1, BLOCKS_K=128, TABLE=False, WORD_MAJOR=False)
        k = compile_for(quantize_kernel._quantize16_kernel, QUANT16_TYPES, ce, num_warps=4, enable_fp_fusion=False)
    else:
        ce = dict(common, BLOCK_M=1, BLOCKS_K=32)
        k = compile_for(quantize_kernel._quantize_kernel, QUANT_TYPES, ce, num_warps=4, enable_fp_fusion=False)
    ptx = k.asm["ptx"]
    assert ptx.count("griddepcontrol.launch_dependents") == int(trigger)
    if trigger:  # as it starts: before its first load
        assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("ld.global")


def _weight(n=256, k=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return nvfp4.quantize(torch.randn(n, k, generator=g))


def _record_eager(monkeypatch, path: str, pdl: bool = True):
    seen = {}
    monkeypatch.setattr(dp, "choose", lambda *a, **k: path)
    monkeypatch.setattr(dp, "w4a4_pairs", lambda m, n, k, device: pdl)

    def quantize_scaled(x, amax, four_six=None, out_dtype=None, trigger=False):
        seen["trigger"] = trigger
        return x, torch.ones(())

    def matmul(x2, weight, bias, x_enc=None, *, path=None, out=None, picked=False, dependent=False, **kw):
        seen["dependent"], seen["path"] = dependent, path
        return torch.zeros(x2.shape[0], weight.shape[0], dtype=x2.dtype)

    monkeypatch.setattr(quantize_kernel, "quantize_scaled", quantize_scaled)
    monkeypatch.setattr(gm, "_matmul", matmul)
    return seen


@pytest.mark.parametrize("path,pdl,paired", [("mma", True, True), ("mma", False, False), ("wgmma", True, False),
                                             ("cublas", True, False)])
def test_w4a4_pairs_its_quantize_launch_with_mma_only(monkeypatch, path, pdl, paired):
    seen = _record_eager(monkeypatch, path, pdl)
    x = torch.randn(16, 512, dtype=torch.bfloat16)
    gm.linear_w4a4(x, _weight(), torch.tensor(3.0))
    assert seen == {"trigger": paired, "dependent": paired, "path": path}


def test_w4a4_does_not_pair_a_requested_path_or_a_weight_it_would_copy(monkeypatch):
    seen = _record_eager(monkeypatch, "mma")
    x = torch.randn(16, 512, dtype=torch.bfloat16)
    gm.linear_w4a4(x, _weight(), torch.tensor(3.0), path="mma")  # the requested path is checked after
    assert (seen["trigger"], seen["dependent"]) == (False, False)
    w = _weight()
    w.block_scale = torch.empty(w.block_scale.numel() + 1, dtype=w.block_scale.dtype)[1:].view_as(w.block_scale)
    gm.linear_w4a4(x, w, torch.tensor(3.0))  # misaligned scales: the views copy them, so no pairing
    assert (seen["trigger"], seen["dependent"]) == (False, False)
    gm.linear_w4a4(x, _weight(), torch.tensor(3.0))
    assert (seen["trigger"], seen["dependent"]) == (True, True)


@pytest.mark.parametrize("path,pdl", [("mma", True), ("mma", False), ("wgmma", True), ("gemv6", True),
                                      ("gemv6", False)])
def test_w4a4_plans_pair_the_same_launches(monkeypatch, path, pdl):
    seen = {}
    m = 1 if path == "gemv6" else 16
    monkeypatch.setattr(dp, "choose", lambda *a, **k: path)
    monkeypatch.setattr(dp, "w4a4_pairs", lambda m, n, k, device: pdl)
    monkeypatch.setattr(gv, "w4a4_pairs_gemv", lambda m, n, k, device: pdl)
    monkeypatch.setattr(gv, "_gemv6", lambda *a, dependent=False, **k: seen.__setitem__("dependent", dependent)
                        or (lambda *t: t[-1]))
    real = quantize_kernel.quantize_launches
    monkeypatch.setattr(quantize_kernel, "quantize_launches",
                        lambda *a: seen.__setitem__("trigger", a[6] if len(a) > 6 else False) or real(*a))
    from fp4ptq.kernels import wgmma

    for module in (mma, wgmma):
        monkeypatch.setattr(module, "launches", lambda *a, dependent=False, **k: seen.__setitem__("dependent", dependent)
                            or (lambda *t: t[-1]))
    plan = gm.linear_plan(torch.randn(m, 512, dtype=torch.bfloat16), _weight(), input_amax=torch.tensor([3.0]))
    assert plan is not None
    paired = path in ("mma", "gemv6") and pdl
    assert seen == {"trigger": paired, "dependent": paired}


@pytest.mark.parametrize("m,n,k,paired", [
    (16, 3584, 3584, True),     # Qwen2-7B o: 392 programs of 4 K steps (gained 10% on the H200)
    (16, 3072, 3072, True),     # Phi-3-mini o: 288 programs of 4 steps (11%)
    (16, 4608, 3584, True),     # Qwen2-7B qkv: 144 programs, about one an SM (6%)
    (32, 1024, 4096, True),     # 8B k at M = 32: 128 programs of 8 steps of 64 (5%)
    (16, 57344, 8192, True),    # 70B gate_up: 448 programs of 4 warps fill the slots (3.5%)
    (16, 4096, 14336, False),   # 8B down: 256 programs of 14 steps (41% slower)
    (16, 4096, 4096, False),    # 8B o: 256 of 8 steps (12% slower)
    (16, 3584, 4096, False),    # Gemma-2-9B o: 224 of 8 steps (12% slower)
    (16, 6144, 4096, False),    # 8B qkv: 384 of 8 steps (level)
    (32, 3584, 18944, False),   # Qwen2-7B down at M = 32: 448 programs but of 2 warps, 37 steps (not measured)
])
def test_w4a4_pairs_only_the_grids_where_it_measured_faster(monkeypatch, m, n, k, paired):
    monkeypatch.setattr(cm, "w4a4_pdl", lambda device: True)
    monkeypatch.setattr(cm, "_sm_count", lambda device: 132)
    assert dp.w4a4_pairs(m, n, k, torch.device("cuda", 0)) is paired
    monkeypatch.setattr(cm, "w4a4_pdl", lambda device: False)  # FP4PTQ_W4A4_PDL=0, or no PDL on the GPU
    assert dp.w4a4_pairs(m, n, k, torch.device("cuda", 0)) is False


def _mma_launch_kwargs(monkeypatch, dependent: bool, stages: int):
    seen = []
    monkeypatch.setattr(cm, "split_pdl", lambda device: False)
    monkeypatch.setattr(cm, "split_run", lambda launch, splits, y, bias, trigger=False:
                        seen.append(launch.kwargs) or (lambda *t: t[-1]))
    monkeypatch.setattr(cm, "_sm_count", lambda device: 132)
    words, sbits, enc = torch.zeros(256, 64, dtype=torch.int32), torch.zeros(256, 32, dtype=torch.uint8), torch.ones(1)
    x = torch.zeros(16, 512, dtype=torch.bfloat16)
    run = mma.launches(x, words, sbits, enc, torch.ones(1), None, torch.empty(16, 256, dtype=torch.bfloat16),
                       (64, 16, 128, 2, 512, stages), dependent=dependent)
    return seen[0], run


@pytest.mark.parametrize("dependent,stages,waits", [(True, 3, True), (False, 3, False), (True, 0, False)])
def test_mma_launches_wait_only_as_a_dependent_with_the_ring(monkeypatch, dependent, stages, waits):
    kwargs, _ = _mma_launch_kwargs(monkeypatch, dependent, stages)
    assert (kwargs.get("WAIT", False), kwargs.get("launch_pdl", False)) == (waits, waits)


def test_mma_launches_plainly_where_the_operands_would_need_a_copy(monkeypatch):
    """A copy launched between the quantize launch and a dependent mma.py would be read before its
    wait: misaligned operands take the plain launch (which copies them)."""
    seen = []
    monkeypatch.setattr(mma, "launches", lambda x2, *a, dependent=False, **k: seen.append(
        (dependent, x2.data_ptr() % 16 == 0)) or (lambda *t: t[-1]))
    words, sbits, enc = torch.zeros(256, 64, dtype=torch.int32), torch.zeros(256, 32, dtype=torch.uint8), torch.ones(1)
    y = torch.empty(16, 256, dtype=torch.bfloat16)
    misaligned = torch.empty(16 * 512 + 4, dtype=torch.bfloat16)[4:].view(16, 512)  # 8 bytes off
    assert not mma.operands_aligned(misaligned, sbits)
    mma.matmul(misaligned, words, sbits, enc, torch.ones(1), None, y, dependent=True)
    mma.matmul(torch.zeros(16, 512, dtype=torch.bfloat16), words, sbits, enc, torch.ones(1), None, y, dependent=True)
    assert seen == [(False, True), (True, True)]  # plain on the aligned copy, then dependent


@pytest.fixture
def fresh_pdl_state(monkeypatch):
    monkeypatch.setattr(cm, "_PDL_FAILED", {})
    return cm._PDL_FAILED


def test_a_refused_dependent_launch_falls_back_and_is_not_tried_again(fresh_pdl_state):
    calls = []

    def dependent(a):
        calls.append(("dependent", a))
        raise RuntimeError("Triton Error [CUDA]: operation not supported")

    def build_plain():
        calls.append("built")
        return lambda a: calls.append(("plain", a)) or a * 2

    cuda0 = torch.device("cuda", 0)
    call = cm.dependent_or_plain(dependent, build_plain, cuda0, "the test launch")
    with pytest.warns(UserWarning, match="programmatic dependent launches are not used on cuda:0 any more"):
        assert call(3) == 6
    assert call(4) == 8  # no second try, no second warning, the plain launch built once
    assert calls == [("dependent", 3), "built", ("plain", 3), ("plain", 4)]
    assert "operation not supported" in fresh_pdl_state[0]
    # every later decision on that GPU launches plainly
    other = cm.dependent_or_plain(lambda a: calls.append("other dependent"), lambda: (lambda a: a), cuda0, "x")
    assert other(5) == 5 and "other dependent" not in calls


def test_a_fault_of_the_plain_launch_too_propagates_and_keeps_dependent_launches(fresh_pdl_state):
    def dependent():
        raise RuntimeError("illegal address")

    def plain():
        raise RuntimeError("illegal address (plain)")

    call = cm.dependent_or_plain(dependent, lambda: plain, torch.device("cuda", 1), "the test launch")
    with pytest.raises(RuntimeError, match=r"illegal address \(plain\)"):
        call()
    assert fresh_pdl_state == {}


def test_a_dependent_launch_refused_inside_a_graph_capture_asks_to_capture_again(monkeypatch, fresh_pdl_state):
    """The capture is invalidated by the failed launch, so no plain launch can save it: dependent launches
    go off on that GPU and the error says to capture again; the next (eager or captured) call is plain."""
    calls = []

    def dependent():
        calls.append("dependent")
        raise RuntimeError("operation not permitted when stream is capturing")

    call = cm.dependent_or_plain(dependent, lambda: (lambda: calls.append("plain")), torch.device("cuda", 0), "x")
    monkeypatch.setattr(cm, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture.*capture again"):
        call()
    assert calls == ["dependent"] and 0 in fresh_pdl_state
    call()
    assert calls == ["dependent", "plain"]


def test_pdl_is_off_on_a_gpu_where_a_dependent_launch_was_refused(monkeypatch, fresh_pdl_state):
    monkeypatch.setattr(cm, "INTERPRET", False)
    monkeypatch.setattr(cm, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert cm.split_pdl(cuda0) and cm.w4a4_pdl(cuda0)
    fresh_pdl_state[0] = "refused"
    assert not cm.split_pdl(cuda0) and not cm.w4a4_pdl(cuda0)
    assert cm.split_pdl(cuda1) and cm.w4a4_pdl(cuda1)
    monkeypatch.setattr(cm, "W4A4_PDL", False)  # FP4PTQ_W4A4_PDL=0
    assert not cm.w4a4_pdl(cuda1) and cm.split_pdl(cuda1)


def test_split_run_sums_plainly_when_its_dependent_pass_is_refused(monkeypatch, fresh_pdl_state):
    """The split kernel has run (its partials written) when the dependent summing pass is refused:
    the plain pass sums the same partials."""
    order = []

    def finish_of(splits, y, bias, dependent=False):
        def finish(target, y):
            if dependent:
                raise RuntimeError("not supported")
            order.append("plain pass")
            y.copy_(target.sum(0))
        return finish

    monkeypatch.setattr(cm, "split_finish", finish_of)
    y = torch.zeros(2, 8, dtype=torch.float32)

    def launch(x, target):
        order.append("split kernel")
        target.copy_(x.expand_as(target))

    run = cm.split_run(launch, 3, y, None, dependent=True)
    with pytest.warns(UserWarning, match="the split-K summing pass"):
        out = run(torch.ones(2, 8), y)
    assert order == ["split kernel", "plain pass"]
    assert torch.equal(out, torch.full((2, 8), 3.0))


GEMV6_TYPES = {"x_ptr": "*bf16", "w_ptr": "*i64", "s_ptr": "*u8", "wenc_ptr": "*fp32", "xenc_ptr": "*fp32",
               "bias_ptr": "*bf16", "y_ptr": "*bf16"}


@pytest.mark.parametrize("prefetch", [False, True])
def test_gemv6_loads_its_first_tile_before_waiting_and_x_after(prefetch):
    ce = dict(HAS_BIAS=False, HAS_XENC=True, ROWS=4, KBP=256, EVEN_K=True, ALIGNED=True, EMULATE=False,
              SPLIT=False, PREFETCH=prefetch, MULDEC=True, KB_C=256 if prefetch else 0,
              F16=False, TRIGGER=False, WAIT=True)
    ptx = compile_for(gv._gemv_resident_kernel, GEMV6_TYPES, ce, num_warps=2, launch_pdl=True).asm["ptx"]
    plain = compile_for(gv._gemv_resident_kernel, GEMV6_TYPES, dict(ce, WAIT=False), num_warps=2).asm["ptx"]
    assert "griddepcontrol.wait" not in plain
    head, tail = ptx.split("griddepcontrol.wait")
    loads = lambda text: len(re.findall(r"ld\.global", text))  # noqa: E731
    if prefetch:  # the first row tile's codes and scales are in flight before the wait
        assert loads(head) > 0
    else:
        assert loads(head) == 0
    assert loads(tail) > 0 and loads(head) + loads(tail) == loads(plain)


def test_gemv6_pairing_takes_the_small_gemv6_layers_and_follows_its_knob(monkeypatch):
    monkeypatch.setattr(cm, "w4a4_pdl", lambda device: True)
    cuda = torch.device("cuda", 0)
    assert gv.w4a4_pairs_gemv(1, 6144, 4096, cuda)  # 8B qkv: gemv6 (measured 4% faster paired)
    assert gv.w4a4_pairs_gemv(2, 4096, 4096, cuda)  # 8B o at M = 2
    assert not gv.w4a4_pairs_gemv(1, 28672, 4096, cuda)  # 8B gate_up: 64M weights and more (level)
    assert not gv.w4a4_pairs_gemv(1, 57344, 8192, cuda)  # 70B gate_up (1% slower paired)
    assert not gv.w4a4_pairs_gemv(1, 4096, 14336, cuda)  # 8B down streams x through gemv7: not paired
    monkeypatch.setattr(cm, "w4a4_pdl", lambda device: False)  # FP4PTQ_W4A4_PDL=0, or no PDL on the GPU
    assert not gv.w4a4_pairs_gemv(1, 6144, 4096, cuda)


@pytest.mark.parametrize("path,pdl,paired", [("gemv6", True, True), ("gemv6", False, False)])
def test_w4a4_pairs_its_quantize_launch_with_gemv6_when_told(monkeypatch, path, pdl, paired):
    seen = _record_eager(monkeypatch, path, False)
    monkeypatch.setattr(gv, "w4a4_pairs_gemv", lambda m, n, k, device: pdl)
    gm.linear_w4a4(torch.randn(1, 512, dtype=torch.bfloat16), _weight(), torch.tensor(3.0))
    assert seen == {"trigger": paired, "dependent": paired, "path": path}


def test_gemv6_dependent_build_and_its_plain_twin(monkeypatch, fresh_pdl_state):
    built = []
    monkeypatch.setattr(cm, "split_run", lambda launch, splits, y, bias, trigger=False:
                        built.append(launch.kwargs) or (lambda *t: t[-1]))
    monkeypatch.setattr(gv, "_whole_wave_programs", lambda *a, **k: 132 * 4)
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    words, sbits = torch.zeros(6144, 512, dtype=torch.int32), torch.zeros(6144, 256, dtype=torch.uint8)
    args = (x, words, sbits, torch.ones(1), torch.ones(1), torch.ones(1), torch.empty(1, 6144, dtype=torch.bfloat16),
            1, 6144, 4096, False, torch.ones(1))
    gv._gemv6(*args)
    gv._gemv6(*args, dependent=True)
    assert "WAIT" not in built[0] and "launch_pdl" not in built[0]
    assert built[1]["WAIT"] is True and built[1]["launch_pdl"] is True
