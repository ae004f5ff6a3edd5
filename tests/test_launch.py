"""``kernels._launch.Launch``: when a launch is replayed past Triton's binder, and that a replay passes
the C launcher exactly what Triton's own path passes. No GPU here: a stand-in kernel records both
paths (its ``kernel[grid](...)`` is Triton's path, its compiled kernel's ``run`` the launcher)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fp4ptq.kernels import _launch  # noqa: E402


class FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn-handle", "meta"

    def run(self, *call):
        self.log.append(("replay", call))


class FakeKernel:
    """Triton's path records (grid, args, kwargs) and returns the compiled kernel; the binder returns
    every parameter in order: the positional ones, then the constexprs (C1, C2) and a default (D)."""

    def __init__(self, bind_ok=True):
        self.log, self.bind_ok = [], bind_ok
        self.compiled = FakeCompiled(self.log)
        self.device_caches = {0: (None, None, None, None, self._binder)}

    def _binder(self, *args, C1=None, C2=None, D=5, **options):
        params = {f"a{i}": a for i, a in enumerate(args)}
        if not self.bind_ok:
            params = {f"a{i}": (a if i else object()) for i, a in enumerate(args)}
        params.update(C1=C1, C2=C2, D=D)
        return params, None, options

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return self.compiled
        return launch


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(_launch, "fast_launch_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)


def _launch_of(kernel):
    fixed = torch.zeros(8)
    return _launch.Launch(kernel, (3, 2), (None, fixed, 7, None), (0, 3), dict(C1=True, C2=4, num_warps=2)), fixed


def test_replays_from_the_third_call_with_triton_s_arguments(fast):
    kernel = FakeKernel()
    launch, fixed = _launch_of(kernel)
    x, y = torch.ones(8), torch.empty(8)
    for _ in range(4):
        launch(x, y)
    kinds = [entry[0] for entry in kernel.log]
    assert kinds == ["triton", "triton", "replay", "replay"]
    _, grid, args, kwargs = kernel.log[0]
    assert grid == (3, 2, 1) and kwargs == dict(C1=True, C2=4, num_warps=2)
    assert args[0] is x and args[1] is fixed and args[2] == 7 and args[3] is y
    call = kernel.log[2][1]
    # grid, stream, function, metadata, no launch metadata or hooks, then every parameter in order
    assert call[:9] == (3, 2, 1, 1234, "fn-handle", "meta", None, None, None)
    assert call[9] is x and call[10] is fixed and call[11] == 7 and call[12] is y and call[13:] == (True, 4, 5)
    assert launch.replaying
    assert launch.args[0] is None and launch.args[3] is None  # the per-call tensors are not kept


def test_other_specializations_take_triton_s_path(fast):
    kernel = FakeKernel()
    launch, _ = _launch_of(kernel)
    x, y = torch.ones(8), torch.empty(8)
    launch(x, y)
    launch(x, y)
    buf = torch.empty(9)
    misaligned = buf[1:]  # 4 bytes past a 16-byte boundary
    assert misaligned.data_ptr() % 16
    launch(misaligned, y)               # alignment differs from the capture
    launch(x.double(), y)               # dtype differs
    launch(x, y)
    assert [e[0] for e in kernel.log] == ["triton", "triton", "triton", "triton", "replay"]


def test_launch_hooks_and_another_device_take_triton_s_path(fast, monkeypatch):
    kernel = FakeKernel()
    launch, _ = _launch_of(kernel)
    x, y = torch.ones(8), torch.empty(8)
    launch(x, y)
    launch(x, y)
    monkeypatch.setattr(_launch, "_hooks_idle", lambda: False)
    launch(x, y)
    monkeypatch.setattr(_launch, "_hooks_idle", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    launch(x, y)
    assert [e[0] for e in kernel.log] == ["triton"] * 4


def test_no_replay_where_the_binder_does_not_bind_as_expected(fast):
    kernel = FakeKernel(bind_ok=False)
    launch, _ = _launch_of(kernel)
    x, y = torch.ones(8), torch.empty(8)
    for _ in range(4):
        launch(x, y)
    assert [e[0] for e in kernel.log] == ["triton"] * 4 and not launch.replaying


def test_switched_off_or_interpreted_never_replays(monkeypatch):
    monkeypatch.setattr(_launch, "FAST_LAUNCH", "0")
    assert not _launch.fast_launch_enabled()
    kernel = FakeKernel()
    launch, _ = _launch_of(kernel)
    for _ in range(4):
        launch(torch.ones(8), torch.empty(8))
    assert [e[0] for e in kernel.log] == ["triton"] * 4
    monkeypatch.setattr(_launch, "FAST_LAUNCH", "1")
    monkeypatch.setattr(_launch, "INTERPRET", True)
    assert not _launch.fast_launch_enabled()


def test_hooks_idle_reads_triton_s_hook_chains():
    knobs = pytest.importorskip("triton.knobs")
    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this Triton has no hook chains")
    assert _launch._hooks_idle()

    def probe(*args, **kwargs):
        return None
    hook.add(probe)
    try:
        assert not _launch._hooks_idle()
    finally:
        hook.remove(probe)
    assert _launch._hooks_idle()


class Descriptor:
    """Stands in for a TMA descriptor: a slot object that is not a tensor, with its base tensor."""

    def __init__(self, base):
        self.base = base


def test_descriptor_slots_are_checked_by_their_base_tensor(fast):
    kernel = FakeKernel()
    launch, _ = _launch_of(kernel)
    x, y = torch.ones(8), torch.empty(8)
    for _ in range(3):
        launch(Descriptor(x), y)
    launch(Descriptor(torch.empty(9)[1:]), y)  # a misaligned base
    launch(Descriptor(x.double()), y)          # another dtype
    launch(x, y)                               # a tensor where the capture had a descriptor
    assert [e[0] for e in kernel.log] == ["triton", "triton", "replay", "triton", "triton", "triton"]
