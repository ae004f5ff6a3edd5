"""``kernels._launch.Launch``: when a launch is replayed past Triton's binder, and that a replay passes
the C launcher exactly what Triton's own path passes. No GPU here: a stand-in kernel records both
paths (its ``kernel[grid](...)`` is Triton's path, its compiled kernel's ``run`` the launcher)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fp4ptq.kernels import _common as _launch  # noqa: E402


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
    monkeypatch.setattr(_launch, "current_device", lambda: 0)
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
    monkeypatch.setattr(_launch, "current_device", lambda: 1)
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


# --- the C launcher called directly (Triton 3.6's CudaLauncher, its descriptor wrapper) -----------------
BASE_ARGS = 13  # Triton 3.6's launcher arguments before the kernel's: grid, stream, function, flags, ...
EXPANDED = []   # make_tensordesc_arg's calls


def make_tensordesc_arg(arg, metadata):
    """Stands in for Triton 3.6's expansion of a host TMA descriptor (a fresh object each call)."""
    EXPANDED.append(arg)
    if metadata is None:
        return [arg.base, *arg.shape, *arg.strides, arg.padding == "nan", *arg.shape, *arg.strides]
    return [("tensor-map", arg.base.data_ptr(), metadata), *arg.shape, *arg.strides]


def _wrap(launcher, positions, tensordesc_meta):
    """Triton 3.6's ``wrap_handle_tensordesc`` as its launcher holds it: descriptors expanded per call."""
    tensordesc_indices = set(positions)

    def inner(*args):
        final_args = list(args[:BASE_ARGS])
        tensordesc_idx = 0
        for i, arg in enumerate(args[BASE_ARGS:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                tensordesc_idx += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)
    return inner


class CFunction:
    """Stands in for the compiled C launch function (no ``__code__``): records its arguments."""

    def __init__(self, log):
        self.log = log

    def __call__(self, *args):
        self.log.append(("c", args))


class FakeCudaLauncher:
    """Triton 3.6's ``CudaLauncher.__call__``: scratch buffers, then ``self.launch``."""

    def __init__(self, log, desc_positions=(), metas=None, scratch=0):
        self.log = log
        self.launch = CFunction(log)
        if desc_positions:
            self.launch = _wrap(self.launch, desc_positions, metas or [{"swizzle": 128}] * len(desc_positions))
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.log.append(("python",))
        scratch = object() if self.global_scratch_size else None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    scratch, None, *args)


class TmaDescriptor:
    """A host TMA descriptor as Triton 3.6's launcher reads it."""

    def __init__(self, base, shape=(8,), strides=(1,)):
        self.base, self.shape, self.strides, self.padding = base, list(shape), list(strides), "zero"


def _c_kernel(**launcher):
    kernel = FakeKernel()
    kernel.compiled.run = FakeCudaLauncher(kernel.log, **launcher)
    return kernel


def _wrapper_calls(kernel, launch, *tensors):
    """What Triton's own launcher passes the C function for these slots (through its Python wrapper)."""
    args = list(launch.args)
    for i, t in zip(launch.slots, tensors):
        args[i] = t
    run, function, metadata, _, _, tail = launch._direct
    start = len(kernel.log)
    run(3, 2, 1, 1234, function, metadata, None, None, None, *args, *tail)
    return [e for e in kernel.log[start:] if e[0] == "c"][0][1]


def test_the_c_launcher_gets_what_triton_s_wrapper_passes(fast):
    kernel = _c_kernel()
    launch, _ = _launch_of(kernel)
    x, y = torch.ones(8), torch.empty(8)
    for _ in range(4):
        launch(x, y)
    kinds = [e[0] for e in kernel.log]
    assert kinds == ["triton", "triton", "c", "c"]  # no Python launcher frame in the replays
    assert kernel.log[2][1] == _wrapper_calls(kernel, launch, x, y)


def test_descriptors_expanded_once_per_address(fast):
    kernel = _c_kernel(desc_positions=(0, 1))  # a per-call descriptor (slot 0) and a fixed one
    fixed = TmaDescriptor(torch.zeros(8))
    launch = _launch.Launch(kernel, (3, 2), (None, fixed, 7, None), (0, 3), dict(C1=True, C2=4, num_warps=2))
    x, y = torch.ones(8), torch.empty(8)
    launch(TmaDescriptor(x), y)
    launch(TmaDescriptor(x), y)
    EXPANDED.clear()
    for _ in range(3):
        launch(TmaDescriptor(x), y)
    assert [e[0] for e in kernel.log[-3:]] == ["c", "c", "c"]
    assert len(EXPANDED) == 1 and EXPANDED[0].base is x  # the fixed one at capture, x's once
    got = kernel.log[-1][1]
    assert got == _wrapper_calls(kernel, launch, TmaDescriptor(x), y)
    x2 = torch.ones(8)
    for desc in (TmaDescriptor(x2),                              # another address: expanded for it
                 TmaDescriptor(x, shape=(4,), strides=(2,))):    # another shape at the same address
        launch(desc, y)
        got = kernel.log[-1]
        assert got[0] == "c" and got[1] == _wrapper_calls(kernel, launch, desc, y)


def test_descriptor_cache_is_bounded(fast):
    kernel = _c_kernel(desc_positions=(0,))
    launch, _ = _launch_of(kernel)
    y = torch.empty(8)
    xs = [torch.ones(8) for _ in range(_launch.DESC_CACHE + 3)]
    for x in xs[:2]:
        launch(TmaDescriptor(x), y)
    for x in xs:
        launch(TmaDescriptor(x), y)
        got = kernel.log[-1]
        assert got[0] == "c" and got[1] == _wrapper_calls(kernel, launch, TmaDescriptor(x), y)
    assert len(launch._descs) <= _launch.DESC_CACHE


@pytest.mark.parametrize("launcher", [dict(scratch=256), dict(desc_positions=(0,), metas=[None])])
def test_scratch_or_descriptors_holding_tensors_keep_triton_s_launcher(fast, launcher):
    kernel = _c_kernel(**launcher)
    launch, _ = _launch_of(kernel)
    y = torch.empty(8)
    for _ in range(3):
        launch(TmaDescriptor(torch.ones(8)), y)
    assert launch.replaying and launch._c is None
    assert [e[0] for e in kernel.log] == ["triton", "triton", "python", "c"]


def test_an_unknown_launch_wrapper_keeps_triton_s_launcher(fast):
    kernel = _c_kernel()
    run = kernel.compiled.run
    c_function = run.launch

    def wrapper(*args):  # some other Triton's wrapper
        return c_function(*args)
    run.launch = wrapper
    launch, _ = _launch_of(kernel)
    for _ in range(3):
        launch(torch.ones(8), torch.empty(8))
    assert launch._c is None and [e[0] for e in kernel.log] == ["triton", "triton", "python", "c"]
